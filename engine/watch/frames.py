"""What a view draws, per redraw: one frame of every cache stream, coalescing all events since the last.

A view redraws a few times a second while the engine may publish thousands of events in between. The
cache mirror already holds every cell; the frame source only marks, per event, the cells it touched
(and those a dry run touched). `frame()` derives what a cell grid draws (the owning sequence or
"several", the number of sequences) for the marked cells only, tells which cells differ from the
previous frame, and copies a few flat arrays: cheap even for a 32k-cell cache (bench/watch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import events as ev
from engine.watch.mirror import CacheMirror, StreamState

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
    tentative: np.ndarray  # bool: touched by the dry run (slot search) of the last decode since the previous frame
    head: int
    quirk: np.ndarray  # bool: touched by an event that reproduces a llama.cpp QUIRK since the previous frame

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


class _Marks:
    """What one stream's frame adds to the mirror's cells: the owner and sequence count derived for the
    cells that changed, what the previous frame showed, and which cells events touched since."""

    def __init__(self, size: int) -> None:
        self.owner = np.full(size, EMPTY, dtype=np.int16)
        self.n_seqs = np.zeros(size, dtype=np.int16)
        self.dirty = np.zeros(size, dtype=bool)
        self.tentative = np.zeros(size, dtype=bool)
        self.quirk = np.zeros(size, dtype=bool)
        self.shown_pos = np.full(size, -1, dtype=np.int64)
        self.shown_shift = np.zeros(size, dtype=np.int64)
        self.shown_owner, self.shown_n_seqs = self.owner.copy(), self.n_seqs.copy()

    def shown_as(self, other: _Marks) -> None:
        """Take what `other` last showed as this stream's previous frame, and compare every cell anew."""
        self.shown_pos, self.shown_shift = other.shown_pos.copy(), other.shown_shift.copy()
        self.shown_owner, self.shown_n_seqs = other.shown_owner.copy(), other.shown_n_seqs.copy()
        self.dirty[:] = True

    def take(self, cache: str, stream: int, st: StreamState) -> StreamFrame:
        dirty = np.flatnonzero(self.dirty)
        if dirty.size:
            bits = st.seq_bits[dirty]
            n_seqs = ev.seq_counts(bits)
            self.n_seqs[dirty] = n_seqs
            self.owner[dirty] = np.where(n_seqs > 1, SHARED, ev.lowest_seq_ids(bits))  # EMPTY is -1 there too
        changed = np.zeros(len(st.pos), dtype=bool)
        changed[dirty] = ((st.pos[dirty] != self.shown_pos[dirty]) | (st.shift[dirty] != self.shown_shift[dirty])
                          | (self.owner[dirty] != self.shown_owner[dirty])
                          | (self.n_seqs[dirty] != self.shown_n_seqs[dirty]))
        frame = StreamFrame(cache, stream, st.pos.copy(), self.owner.copy(), self.n_seqs.copy(), st.shift.copy(),
                            changed, self.tentative.copy(), st.head, self.quirk.copy())
        self.shown_pos[dirty], self.shown_shift[dirty] = st.pos[dirty], st.shift[dirty]
        self.shown_owner[dirty], self.shown_n_seqs[dirty] = self.owner[dirty], self.n_seqs[dirty]
        self.dirty[:] = False
        self.tentative[:] = False
        self.quirk[:] = False
        return frame


class FrameSource:
    """Frames of a CacheMirror: the mirror keeps the cells, this marks which ones events touched, and
    frame() derives and copies what a view draws (see the module docstring)."""

    def __init__(self, mirror: CacheMirror) -> None:
        self.mirror = mirror
        self._marks: dict[tuple[str, int], _Marks] = {}
        self.seq_no = -1

    def apply(self, event: ev.Event) -> None:
        """Call after the mirror applied the event."""
        self.seq_no = event.seq_no
        if isinstance(event, ev.CellsChanged):
            for change in event.changes:
                marks = self._marks_of(event.cache, change.stream)
                if marks is not None:
                    # a single-token decode's cell: a scalar write is several times faster than an index array
                    cells = int(change.cells[0]) if len(change.cells) == 1 else change.cells
                    marks.dirty[cells] = True
                    if event.tentative:
                        marks.tentative[cells] = True
                    if event.quirk:
                        marks.quirk[cells] = True
        elif isinstance(event, ev.DecodeStarted):
            # a frame shows the slot search of the latest decode: over many steps (a slow view, a replay's
            # jump) the searches of all of them would mark nearly every cell
            for marks in self._marks.values():
                marks.tentative[:] = False
        elif isinstance(event, ev.ContextCreated):
            for key in [k for k in self._marks if k[0] == event.cache]:
                del self._marks[key]  # a new cache: every cell is new

    def continue_from(self, previous: FrameSource) -> None:
        """Compare the next frame with the last one `previous` gave, rather than with empty cells: for a view
        whose mirror was rebuilt instead of moved event by event (a replay that jumped), so that the first
        frame after the jump marks what the jump changed. A stream `previous` did not show at this size is
        compared with empty cells, as a new stream always is."""
        for key, old in previous._marks.items():
            marks = self._marks_of(*key)
            if marks is not None and len(marks.shown_pos) == len(old.shown_pos):
                marks.shown_as(old)

    def _marks_of(self, cache: str, stream: int) -> _Marks | None:
        marks = self._marks.get((cache, stream))
        if marks is None:
            state = self.mirror.caches.get(cache)
            if state is None or stream >= len(state.streams):
                return None
            marks = self._marks[(cache, stream)] = _Marks(state.size)
            marks.dirty[:] = True  # nothing shown yet: derive every cell once
        return marks

    def frame(self) -> Frame:
        """Every stream of every cache of the mirror (copies), and which cells changed since the last frame."""
        streams = []
        for name, state in self.mirror.caches.items():
            for s, st in enumerate(state.streams):
                streams.append(self._marks_of(name, s).take(name, s, st))
        return Frame(self.seq_no, tuple(streams))
