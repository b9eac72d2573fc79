"""Which cells a token attends to: llama.cpp's sliding-window rule (llama_hparams::is_masked_swa) and
the KQ mask rule built on it (llama_kv_cache::set_input_kq_mask), vectorised with numpy.

The attention kernel (engine/kv/attention.py) and the watch layer's SWA visibility both call
`attends`, so what a view shows a token seeing is what the kernel let it see. No torch here."""
from __future__ import annotations

from enum import IntEnum

import numpy as np


class SwaType(IntEnum):
    NONE = 0
    STANDARD = 1
    CHUNKED = 2
    SYMMETRIC = 3


def is_masked_swa(n_swa: int, swa_type: SwaType, p0, p1):
    """True where a key at position p0 is outside the window of a query at position p1.
    Works on scalars and numpy arrays (broadcast)."""
    p0 = np.asarray(p0)
    p1 = np.asarray(p1)
    if swa_type == SwaType.NONE:
        return np.zeros(np.broadcast(p0, p1).shape, dtype=bool)
    if swa_type == SwaType.STANDARD:
        return p1 - p0 >= n_swa
    if swa_type == SwaType.CHUNKED:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == SwaType.SYMMETRIC:
        half = n_swa // 2
        return (p1 - p0 < -half) | (p1 - p0 > half)
    raise ValueError(f"unknown swa type {swa_type!r}")


def attends(cell_pos, holds_seq, token_pos, n_swa: int, swa_type: SwaType):
    """True where a token at token_pos attends to a cell at cell_pos: the cell is not empty, holds the
    token's deciding sequence (holds_seq), is not later than the token, and is inside its window.
    Broadcasts like is_masked_swa (cells along one axis, tokens along another)."""
    cell_pos = np.asarray(cell_pos)
    keep = np.asarray(holds_seq) & (cell_pos >= 0) & (cell_pos <= token_pos)
    if swa_type != SwaType.NONE:
        keep &= ~is_masked_swa(n_swa, swa_type, cell_pos, token_pos)
    return keep
