"""Cell metadata of one KV-cache stream, kept apart from the K/V tensors (llama.cpp's llama_kv_cells).

Every cell has a position (-1 = empty), a set of sequence ids and an accumulated shift that the next
K-shift will apply to its stored keys. The arrays change only through the primitives below, which
work on arrays of cell indices so that a ubatch or a sequence operation is one numpy step, not a
Python loop over cells.

Unlike llama.cpp, the `used` set and the per-sequence position maps are not stored: they are derived
from `pos` and `seq` on demand, so they can never disagree with the cells.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: width of a cell's sequence bitset


@dataclass(frozen=True)
class CellsSnapshot:
    """Saved metadata of some cells, used to roll back a dry run."""

    idxs: np.ndarray
    pos: np.ndarray
    shift: np.ndarray
    seq: np.ndarray  # (MAX_SEQ, len(idxs)) bool


class KVCells:
    """Metadata of `size` cells of one stream."""

    def __init__(self, size: int) -> None:
        assert size > 0, "a stream needs at least one cell"
        self.size = size
        self.pos = np.full(size, -1, dtype=np.int64)
        self.shift = np.zeros(size, dtype=np.int64)
        # Sequence-major so that the cells of one sequence are a contiguous row.
        self.seq = np.zeros((MAX_SEQ, size), dtype=bool)
        self.has_shift = False

    # ---- derived views -------------------------------------------------------------------
    def used_mask(self) -> np.ndarray:
        return self.pos >= 0

    def get_used(self) -> int:
        return int(np.count_nonzero(self.pos >= 0))

    def used_max_p1(self) -> int:
        """Highest used cell index + 1, or 0 when the stream is empty."""
        nz = np.flatnonzero(self.pos >= 0)
        return int(nz[-1]) + 1 if nz.size else 0

    def in_range(self, p0: int, p1: int, seq_id: int = -1) -> np.ndarray:
        """Indices of non-empty cells with positions in [p0, p1), holding seq_id (any when -1)."""
        hit = (self.pos >= max(p0, 0)) & (self.pos < p1)
        if seq_id >= 0:
            hit &= self.seq[seq_id]
        return np.flatnonzero(hit)

    def seq_pos_min(self, seq_id: int) -> int:
        p = self.pos[self.seq[seq_id]]
        return int(p.min()) if p.size else -1

    def seq_pos_max(self, seq_id: int) -> int:
        p = self.pos[self.seq[seq_id]]
        return int(p.max()) if p.size else -1

    def seq_pos_max_all(self) -> np.ndarray:
        """seq_pos_max for every sequence id at once (-1 where absent)."""
        masked = np.where(self.seq, self.pos[None, :], -1)
        return masked.max(axis=1)

    def single_seq_of(self, idxs: np.ndarray) -> np.ndarray:
        """For each cell: its only sequence id, or -1 when it holds none or several."""
        sub = self.seq[:, idxs]
        single = sub.sum(axis=0) == 1
        return np.where(single, sub.argmax(axis=0), -1)

    # ---- primitives ----------------------------------------------------------------------
    def pos_set(self, idxs: np.ndarray, pos: np.ndarray) -> None:
        """Give empty cells a position. Call only on empty cells; add sequences with seq_add."""
        assert np.all(self.pos[idxs] == -1), "pos_set on a non-empty cell"
        self.pos[idxs] = pos

    def seq_add(self, idxs: np.ndarray, seq_id: int) -> None:
        """Add a sequence to non-empty cells that do not hold it yet."""
        assert np.all(self.pos[idxs] >= 0), "seq_add on an empty cell"
        assert not np.any(self.seq[seq_id, idxs]), "seq_add: cell already holds the sequence"
        self.seq[seq_id, idxs] = True

    def rm(self, idxs: np.ndarray) -> None:
        """Empty cells: drop all sequences, position -1, shift 0."""
        self.pos[idxs] = -1
        self.shift[idxs] = 0
        self.seq[:, idxs] = False

    def seq_rm(self, idxs: np.ndarray, seq_id: int) -> np.ndarray:
        """Drop one sequence from cells that hold it. Returns the cells that became empty."""
        assert np.all(self.seq[seq_id, idxs]), "seq_rm: cell does not hold the sequence"
        self.seq[seq_id, idxs] = False
        freed = idxs[~self.seq[:, idxs].any(axis=0)]
        self.rm(freed)
        return freed

    def seq_keep(self, idxs: np.ndarray, seq_id: int) -> np.ndarray:
        """Non-empty cells holding seq_id keep only it; the others are emptied. Returns the freed."""
        holds = self.seq[seq_id, idxs]
        keep, freed = idxs[holds], idxs[~holds]
        self.seq[:, keep] = False
        self.seq[seq_id, keep] = True
        self.rm(freed)
        return freed

    def pos_add(self, idxs: np.ndarray, delta: int) -> np.ndarray:
        """Move non-empty cells by delta (for all their sequences). Returns cells freed below 0."""
        self.pos[idxs] += delta
        self.shift[idxs] += delta
        # llama.cpp sets has_shift inside the per-cell pos_add, so moving no cell sets nothing;
        # otherwise the next decode would run a K-shift that llama.cpp does not run.
        self.has_shift |= bool(idxs.size)
        freed = idxs[self.pos[idxs] < 0]
        self.rm(freed)
        return freed

    def pos_div(self, idxs: np.ndarray, d: int) -> None:
        """Divide positions (truncating). QUIRK (llama.cpp): shift accumulates old - new, the
        opposite sign of pos_add, so the next K-shift turns the keys away from the new position."""
        old = self.pos[idxs]
        new = np.where(old >= 0, old // d, -((-old) // d))  # C division truncates
        self.pos[idxs] = new
        self.shift[idxs] += old - new
        self.has_shift |= bool(idxs.size)  # per moved cell, as in pos_add

    def reset_shift(self) -> None:
        self.shift[:] = 0
        self.has_shift = False

    def clear(self) -> None:
        self.pos[:] = -1
        self.shift[:] = 0
        self.seq[:] = False
        self.has_shift = False

    def copy_cells(self, other: "KVCells", idxs: np.ndarray, seq_id: int) -> None:
        """Cells take other's position and pending shift at the same indices, holding only seq_id.
        Call only on empty cells. (llama.cpp sets pos - shift and re-applies the shift; doing it in
        one step keeps a divided cell, whose pos - shift can be negative, from passing through -1.)"""
        assert np.all(self.pos[idxs] == -1), "copy_cells into a non-empty cell"
        self.pos[idxs] = other.pos[idxs]
        self.shift[idxs] = other.shift[idxs]
        self.seq[seq_id, idxs] = True
        self.has_shift |= bool(np.any(other.shift[idxs] != 0))

    # ---- dry-run support -----------------------------------------------------------------
    def snapshot(self, idxs: np.ndarray) -> CellsSnapshot:
        idxs = np.asarray(idxs, dtype=np.int64)
        return CellsSnapshot(idxs, self.pos[idxs].copy(), self.shift[idxs].copy(), self.seq[:, idxs].copy())

    def restore(self, snap: CellsSnapshot) -> None:
        self.pos[snap.idxs] = snap.pos
        self.shift[snap.idxs] = snap.shift
        self.seq[:, snap.idxs] = snap.seq

    # ---- views ---------------------------------------------------------------------------
    def cell_tuples(self) -> list[tuple[int, frozenset[int], int]]:
        """One (pos, seq ids, shift) per cell; pos -1 and no seqs when empty."""
        out = []
        seq_lists = [[] for _ in range(self.size)]
        for s, i in zip(*np.nonzero(self.seq)):
            seq_lists[i].append(int(s))
        for i in range(self.size):
            out.append((int(self.pos[i]), frozenset(seq_lists[i]), int(self.shift[i])))
        return out
