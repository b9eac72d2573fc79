"""Sliding-window masking rule (llama.cpp's llama_hparams::is_masked_swa), vectorised."""
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
