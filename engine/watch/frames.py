"""What a view draws, per redraw: one frame of every cache stream, coalescing all events since the last.

A view redraws a few times a second while the engine may publish thousands of events in between. The
frame source writes each event's raw cell values into per-stream columns (touching only the cells the
event names) and marks them dirty; `frame()` derives what a cell grid draws (the owning sequence or
"several", the number of sequences) for the dirty cells only, tells which cells differ from the
previous frame, and copies a few flat arrays: cheap even for a 32k-cell cache (bench/watch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import events as ev

EMPTY, SHARED = -1, -2  # owner codes besides a sequence id


@dataclass(frozen=True)
class StreamFrame:
    """One stream of one cache as a view draws it. Arrays are copies: the frame stays as it was."""

    cache: str
    stream: int
    pos: np.ndarray  # int64, -1 = empty
    owner: np.ndarray  # int16: the only sequence, EMPTY, or SHARED (several)
    n_seqs: np.ndarray  # int16: sequences in the cell
    shift: np.ndarray  # int64: pending K-shift
    changed: np.ndarray  # bool: different from the previous frame, or changed and changed back since
    tentative: np.ndarray  # bool: touched by a dry run (a decode's slot search) since the previous frame
    head: int

    @property
    def size(self) -> int:
        return len(self.pos)

    @property
    def used(self) -> int:
        return int(np.count_nonzero(self.pos >= 0))


@dataclass(frozen=True)
class Frame:
    """Every stream of every cache, as of event `seq_no`."""

    seq_no: int
    streams: tuple[StreamFrame, ...]

    def stream(self, cache: str, stream: int = 0) -> StreamFrame:
        for s in self.streams:
            if s.cache == cache and s.stream == stream:
                return s
        raise KeyError(f"no stream {stream} of cache {cache!r} in this frame")


class _Columns:
    """One stream's columns. Events write raw values (position, shift, the sequence bitset) and mark the
    cells dirty; the owner and sequence count are derived for the dirty cells only when a frame is
    taken, once for all the events since the last frame."""

    def __init__(self, size: int) -> None:
        self.pos = np.full(size, -1, dtype=np.int64)
        self.shift = np.zeros(size, dtype=np.int64)
        self.seq_bits = np.zeros((size, ev.SEQ_BITS_BYTES), dtype=np.uint8)
        self.owner = np.full(size, EMPTY, dtype=np.int16)
        self.n_seqs = np.zeros(size, dtype=np.int16)
        self.dirty = np.zeros(size, dtype=bool)
        self.tentative = np.zeros(size, dtype=bool)
        self.head = 0
        # what the previous frame showed, to tell which cells changed since
        self.shown_pos, self.shown_shift = self.pos.copy(), self.shift.copy()
        self.shown_owner, self.shown_n_seqs = self.owner.copy(), self.n_seqs.copy()

    def write(self, change: ev.StreamCells) -> None:
        cells = change.cells
        self.pos[cells] = change.pos
        self.shift[cells] = change.shift
        self.seq_bits[cells] = change.seq_bits
        self.dirty[cells] = True
        self.head = change.head

    def take(self, cache: str, stream: int) -> StreamFrame:
        dirty = np.flatnonzero(self.dirty)
        if dirty.size:
            bits = self.seq_bits[dirty]
            n_seqs = ev.seq_counts(bits)
            self.n_seqs[dirty] = n_seqs
            self.owner[dirty] = np.where(n_seqs > 1, SHARED, ev.lowest_seq_ids(bits))  # EMPTY is -1 there too
        changed = np.zeros(len(self.pos), dtype=bool)
        changed[dirty] = ((self.pos[dirty] != self.shown_pos[dirty]) | (self.shift[dirty] != self.shown_shift[dirty])
                          | (self.owner[dirty] != self.shown_owner[dirty])
                          | (self.n_seqs[dirty] != self.shown_n_seqs[dirty]))
        frame = StreamFrame(cache, stream, self.pos.copy(), self.owner.copy(), self.n_seqs.copy(), self.shift.copy(),
                            changed, self.tentative.copy(), self.head)
        for shown, now in ((self.shown_pos, self.pos), (self.shown_shift, self.shift), (self.shown_owner, self.owner),
                           (self.shown_n_seqs, self.n_seqs)):
            shown[dirty] = now[dirty]
        self.dirty[:] = False
        self.tentative[:] = False
        return frame


class FrameSource:
    """Cell columns of every cache stream, kept current from events; frame() hands them to a view."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, int], _Columns] = {}
        self.seq_no = -1

    def apply(self, event: ev.Event) -> None:
        self.seq_no = event.seq_no
        if isinstance(event, ev.CellsChanged):
            self._apply_cells(event)
        elif isinstance(event, ev.ContextCreated):
            for key in [k for k in self._streams if k[0] == event.cache]:
                del self._streams[key]
            for s in range(event.n_stream):
                self._streams[(event.cache, s)] = _Columns(event.kv_size)

    def _apply_cells(self, event: ev.CellsChanged) -> None:
        # A dry run's placement is undone by the SlotsRolledBack that follows it, which restates those
        # cells as they were: only its mark is kept. Its SWA purge is not undone (llama.cpp's QUIRK), so
        # a tentative removal is written like any change.
        placed_tentatively = event.tentative and isinstance(event, ev.CellsAllocated)
        for change in event.changes:
            columns = self._streams.get((event.cache, change.stream))
            if columns is None:
                continue
            if event.tentative:
                columns.tentative[change.cells] = True
            if not placed_tentatively:
                columns.write(change)

    def frame(self) -> Frame:
        """The current columns of every stream (copies), and which cells changed since the last frame."""
        return Frame(self.seq_no, tuple(c.take(cache, stream) for (cache, stream), c in self._streams.items()))
