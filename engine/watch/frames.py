"""What a view draws, per redraw: one frame of every cache stream, coalescing all events since the last.

A view redraws a few times a second while the engine may publish thousands of events in between. The
cache mirror already holds every cell; the frame source only stamps, per event, the cells it touched
(and those a dry run touched, and those of a QUIRK) with the count of events applied. A FrameReader,
one per view, derives what a cell grid draws (the owning sequence or "several", the number of
sequences) for the cells touched since its own previous frame, tells which of them differ from what it
showed, and copies a few flat arrays: cheap even for a 32k-cell cache (bench/watch.py). Views that share
a watcher each see every change: no view's frame consumes another's marks.
"""
from __future__ import annotations

from collections.abc import Callable
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
    changed: np.ndarray  # bool: different from what this view's previous frame showed
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


class _StreamMarks:
    """What events told of one stream, for every reader of the frame source: per cell the tick of the last
    event that touched it, of the last dry run that touched it and of the last event that reproduces a
    QUIRK; and the owner and sequence count derived from the mirror, brought up to date when a frame is
    taken, for the cells touched since."""

    def __init__(self, size: int) -> None:
        # ticks start at 1 with the first event applied: 0 is "never"
        self.touched = np.zeros(size, dtype=np.int64)
        self.tentative = np.zeros(size, dtype=np.int64)
        self.quirk = np.zeros(size, dtype=np.int64)
        self.owner = np.full(size, EMPTY, dtype=np.int16)
        self.n_seqs = np.zeros(size, dtype=np.int16)
        self._derived_tick = -1  # every cell is derived once

    def derive(self, st: StreamState, tick: int) -> None:
        stale = np.flatnonzero(self.touched > self._derived_tick)
        if stale.size:
            bits = st.seq_bits[stale]
            n_seqs = ev.seq_counts(bits)
            self.n_seqs[stale] = n_seqs
            self.owner[stale] = np.where(n_seqs > 1, SHARED, ev.lowest_seq_ids(bits))  # EMPTY is -1 there too
        self._derived_tick = tick


class _Shown:
    """What one reader's last frame showed of one stream (empty cells before its first)."""

    def __init__(self, marks: _StreamMarks) -> None:
        size = len(marks.touched)
        self.marks = marks  # the marks compared against: another one (a new cache, a rebuilt source) is compared whole
        self.pos = np.full(size, -1, dtype=np.int64)
        self.shift = np.zeros(size, dtype=np.int64)
        self.owner = np.full(size, EMPTY, dtype=np.int16)
        self.n_seqs = np.zeros(size, dtype=np.int16)


class FrameSource:
    """Frames of a CacheMirror: the mirror keeps the cells, this marks which ones events touched (see the
    module docstring); a FrameReader per view derives and copies what that view draws."""

    def __init__(self, mirror: CacheMirror) -> None:
        self.mirror = mirror
        self._marks: dict[tuple[str, int], _StreamMarks] = {}
        self.seq_no = -1
        self.tick = 0  # events applied: what the marks count in
        self.tentative_since = 0  # the tick of the latest decode's start: dry runs before it are not drawn

    def apply(self, event: ev.Event) -> None:
        """Call after the mirror applied the event."""
        self.seq_no = event.seq_no
        self.tick = tick = self.tick + 1
        if isinstance(event, ev.CellsChanged):
            for change in event.changes:
                marks = self.marks_of(event.cache, change.stream)
                if marks is not None:
                    # a single-token decode's cell: a scalar write is several times faster than an index array
                    cells = int(change.cells[0]) if len(change.cells) == 1 else change.cells
                    marks.touched[cells] = tick
                    if event.tentative:
                        marks.tentative[cells] = tick
                    if event.quirk:
                        marks.quirk[cells] = tick
        elif isinstance(event, ev.DecodeStarted):
            # a frame shows the slot search of the latest decode: over many steps (a slow view, a replay's
            # jump) the searches of all of them would mark nearly every cell
            self.tentative_since = tick
        elif isinstance(event, ev.ContextCreated):
            for key in [k for k in self._marks if k[0] == event.cache]:
                del self._marks[key]  # a new cache: every cell is new

    def marks_of(self, cache: str, stream: int) -> _StreamMarks | None:
        marks = self._marks.get((cache, stream))
        if marks is None:
            state = self.mirror.caches.get(cache)
            if state is None or stream >= len(state.streams):
                return None
            marks = self._marks[(cache, stream)] = _StreamMarks(state.size)
        return marks


class FrameReader:
    """One view's frames of a watcher's frame source: which cells changed, were tried by a dry run or
    reproduced a QUIRK since THIS view's previous frame, whatever other views of the same watcher took
    frames in between. A source replaced since (a watcher's resync, a replay's rebuild) is compared
    whole with what this view showed last, so the first frame after a jump marks what the jump changed."""

    def __init__(self, source_of: Callable[[], FrameSource]) -> None:
        self._source_of = source_of
        self._shown: dict[tuple[str, int], _Shown] = {}
        self._tick = 0  # the source's tick at this reader's previous frame

    def frame(self) -> Frame:
        """Every stream of every cache of the mirror (copies), and which cells changed since the last frame."""
        source = self._source_of()
        shown, streams = {}, []
        for name, state in source.mirror.caches.items():
            for s, st in enumerate(state.streams):
                marks = source.marks_of(name, s)
                marks.derive(st, source.tick)
                before = self._shown.get((name, s))
                if before is None or before.marks is not marks:
                    before = _Shown(marks) if before is None or len(before.pos) != len(st.pos) else before
                    before.marks, since = marks, -1
                else:
                    since = self._tick
                streams.append(self._take(name, s, st, marks, before, since, source.tentative_since))
                shown[(name, s)] = before
        self._shown, self._tick = shown, source.tick
        return Frame(source.seq_no, tuple(streams))

    @staticmethod
    def _take(cache: str, stream: int, st: StreamState, marks: _StreamMarks, shown: _Shown, since: int,
              tentative_since: int) -> StreamFrame:
        touched = np.flatnonzero(marks.touched > since) if since >= 0 else slice(None)
        changed = np.zeros(len(st.pos), dtype=bool)
        changed[touched] = ((st.pos[touched] != shown.pos[touched]) | (st.shift[touched] != shown.shift[touched])
                            | (marks.owner[touched] != shown.owner[touched])
                            | (marks.n_seqs[touched] != shown.n_seqs[touched]))
        frame = StreamFrame(cache, stream, st.pos.copy(), marks.owner.copy(), marks.n_seqs.copy(), st.shift.copy(),
                            changed, marks.tentative > max(since, tentative_since), st.head, marks.quirk > max(since, 0))
        shown.pos[touched], shown.shift[touched] = st.pos[touched], st.shift[touched]
        shown.owner[touched], shown.n_seqs[touched] = marks.owner[touched], marks.n_seqs[touched]
        return frame
