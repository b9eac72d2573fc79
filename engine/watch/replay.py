"""Replay: a cursor over a recording that shows it through a Watcher, the same object a live session is
shown through, so that the terminal UI and the notebook explorer draw a replay with the code that draws
a live session: the grids, the cell inspector, the status line and the event log read `replay.watcher`.

    replay = Replay.open("run.kvtrace")
    replay.step()                      # the next event; step(-1) the one before, step(10) ten on
    replay.seek(1234)                  # right after event 1234 (-1: before the first event)
    replay.seek_fraction(0.5)          # a slider
    replay.next_of("KShiftApplied")    # jump to the next K-shift; None (and no move) when there is none
    replay.next_of(ev.CellsRemoved, seq_id=2)
    replay.previous_of("SlotsRolledBack", quirk=True)
    replay.watcher.frame(), replay.watcher.history.explain("swa", 0, 5), replay.watcher.recent

After every move the watcher holds exactly what a live watcher that received the recording's events as
they happened held after the same event: the same mirror, the same frame columns, the same status,
last step and last error, and the same history entries for the events the watcher was given (below).

How it moves. Forward by a few events (`step(n)`, or a seek a little further on), the events in between
are applied to the watcher as a live watcher gets them: one event costs tens of microseconds. Backward,
or forward further than the distance from a keyframe, the watcher's parts are rebuilt: from the state of
the recording's last keyframe at least `context` events before the target, then the events from there to
the target. The Watcher object stays the same; its mirror, frames and history are replaced, as a
watcher's resync replaces them, so a view reads them from the watcher at each redraw.

What a rebuilt watcher lacks. A keyframe holds the cache, not the story of each cell, so the history and
`recent` hold only the events replayed since that keyframe (`history_from` on): at least `context`
events before the target, and whatever the watcher is stepped through afterwards. Starting that far back
costs `context` more events per rebuild (256 by default: a quarter more than the 500 a rebuild replays on
average with a keyframe every 1000 events) and gives the cell inspector and the event log the events
that led to the target even when a keyframe lies just before it: the cells written in those events tell
their story. The status, last step, last error and the decode step that history
entries carry are taken from the events before the keyframe, found through the recording's kinds
(RecordingReader.kinds) without replaying them.

Frames. A frame marks as changed the cells that differ from the previous frame the watcher gave, across
rebuilds too, so that a view highlights what a jump changed. Tentative cells are those the dry run of the
last decode among the events applied since the previous frame touched; after a rebuild, those of the
target event alone.

For a view. The replay applies events when it moves, so the watcher's poll() finds none: redraw after a
move, and take the event log from `watcher.recent` (after a rebuild, `rebuilds` has grown and `recent`
starts anew at `history_from`).
"""
from __future__ import annotations

import bisect
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from engine import events as ev
from engine.arguments import int_arg
from engine.errors import KvscopeError
from engine.watch.frames import FrameSource
from engine.watch.recording_reader import RecordingReader
from engine.watch.server_slots import SERVER_EVENTS
from engine.watch.watcher import Watcher

KindsArg = str | type | Iterable[str | type] | None
EventTest = Callable[[ev.Event], bool]


class _NoEvents:
    """The subscription of a replay's watcher: the replay applies events itself, so a view's usual
    watcher.poll() finds nothing and changes nothing."""

    dropped = 0

    @staticmethod
    def drain() -> list[ev.Event]:
        return []


@dataclass(frozen=True)
class _Carry:
    """What a watcher knows from events before a keyframe that the keyframe's state does not hold."""

    status: ev.SessionStatus | None
    last_step: ev.WorkloadStep | None
    last_error: ev.CommandDone | None
    step: int  # the decode step of the last DecodeStarted (CellHistory.step)
    in_decode: bool


class _KindIndex:
    """Where each kind of event is in a recording, from the kinds alone (no event decoded), so that the
    next event of some kinds, or the last status before a keyframe, is a binary search away."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        at: dict[str, list[int]] = {}
        for i, kind in enumerate(kinds):
            at.setdefault(kind, []).append(i)
        self._at = {kind: np.array(where, dtype=np.int64) for kind, where in at.items()}
        self._unions: dict[frozenset[str], np.ndarray] = {}

    def positions(self, kinds: frozenset[str]) -> np.ndarray:
        """The sorted indices of the events of these kinds."""
        union = self._unions.get(kinds)
        if union is None:
            parts = [self._at[k] for k in kinds if k in self._at]
            union = self._unions[kinds] = np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        return union

    def last(self, kind: str, at_or_before: int) -> int:
        """The index of the last event of `kind` at or before an index; -1 if there is none."""
        where = self._at.get(kind)
        if where is None:
            return -1
        k = int(np.searchsorted(where, at_or_before, side="right"))
        return int(where[k - 1]) if k else -1


class Replay:
    """A recording shown through a Watcher, at any event (see the module docstring).

    `position` is the index of the last event applied (-1: before the first event); moves past either
    end stop there. `context`: a rebuild replays at least this many events before its target (>= 1)."""

    def __init__(self, reader: RecordingReader, *, history_depth: int = 8, recent: int = 2000,
                 context: int = 256) -> None:
        context = int_arg(context, "context", "Replay")
        if context < 1:
            raise KvscopeError(f"Replay: context must be >= 1 (the target event itself), got {context}")
        self.reader = reader
        self.context = context
        self.watcher = Watcher(_NoEvents(), None, history_depth=history_depth, recent=recent)
        self.position = -1
        self.history_from = 0  # the first event the watcher's history and `recent` cover
        self.rebuilds = 0  # how often the watcher's parts were rebuilt (a view may reset what it keeps)
        self._keyframes = list(reader.keyframes)
        self._index: _KindIndex | None = None
        self._failed_commands: list[int] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, **options) -> Replay:
        """A replay of the recording at `path`; close() closes the file."""
        return cls(RecordingReader(path), **options)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- where the cursor is -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.reader)

    @property
    def at_start(self) -> bool:
        return self.position < 0

    @property
    def at_end(self) -> bool:
        return self.position == len(self) - 1

    @property
    def fraction(self) -> float:
        """Where the cursor is, from 0.0 (before the first event) to 1.0 (after the last): for a slider."""
        return (self.position + 1) / len(self) if len(self) else 1.0

    @property
    def model_name(self) -> str:
        """The recorded model's name, wherever the cursor is (a view's title before the context's events
        too); "" when the recording names none."""
        named = self._kind_index().positions(_MODEL_NAMING_KINDS)
        return self.reader.event(int(named[0])).model_name if len(named) else ""

    @property
    def event(self) -> ev.Event | None:
        """The event the cursor stands on (the last one applied); None before the first."""
        return self.reader.event(self.position) if self.position >= 0 else None

    # ---- moving ----------------------------------------------------------------------------------
    def step(self, n: int = 1) -> int:
        """Move n events forward (backward when n < 0); returns the new position."""
        return self.seek(self.position + int_arg(n, "n", "step"))

    def seek(self, i: int) -> int:
        """Move to right after event i (-1: before the first event; beyond either end: that end); returns
        the new position."""
        target = min(max(int_arg(i, "i", "seek"), -1), len(self) - 1)
        if target == self.position:
            return target
        if target > self.position >= self._rebuild_start(target):  # a rebuild would replay no fewer events
            self._apply(self.watcher, self.position + 1, target + 1)
        else:
            self._rebuild(target)
        self.position = target
        self.watcher.events = target + 1  # as a live watcher that received the recording's events counts them
        return target

    def seek_fraction(self, fraction: float) -> int:
        """Move to a fraction of the recording: 0.0 before the first event, 1.0 after the last."""
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or math.isnan(fraction):
            raise KvscopeError(f"seek_fraction: fraction must be a number from 0 to 1, got {fraction!r}")
        return self.seek(round(min(max(fraction, 0.0), 1.0) * len(self)) - 1)

    def next_of(self, kinds: KindsArg = None, *, seq_id: int | None = None, cache: str | None = None,
                quirk: bool | None = None, where: EventTest | None = None) -> int | None:
        """Jump to the next event of these kinds (class names or classes of engine.events; a class stands
        for its subclasses too; None: any kind) that concerns seq_id and cache, carries a quirk text
        (quirk=True) or none (False), and passes `where`. Returns its index, or None without moving."""
        found = self.find(kinds, seq_id=seq_id, cache=cache, quirk=quirk, where=where)
        return None if found is None else self.seek(found)

    def previous_of(self, kinds: KindsArg = None, *, seq_id: int | None = None, cache: str | None = None,
                    quirk: bool | None = None, where: EventTest | None = None) -> int | None:
        """next_of, backward: the last such event before the one the cursor stands on."""
        found = self.find(kinds, seq_id=seq_id, cache=cache, quirk=quirk, where=where, backward=True)
        return None if found is None else self.seek(found)

    def find(self, kinds: KindsArg = None, *, seq_id: int | None = None, cache: str | None = None,
             quirk: bool | None = None, where: EventTest | None = None, start: int | None = None,
             backward: bool = False) -> int | None:
        """The index of the first such event (see next_of) after `start` (default: the position), or the
        last one before it when backward; None if there is none. Only events of the kinds asked for are
        decoded."""
        origin = self.position if start is None else int_arg(start, "start", "find")
        names = _kind_names(kinds)
        test = _event_test(seq_id, cache, quirk, where)
        for i in self._candidates(names, origin, backward):
            if test is None or test(self.reader.event(i)):
                return i
        return None

    # ---- applying events ---------------------------------------------------------------------------
    def _apply(self, watcher: Watcher, start: int, stop: int) -> None:
        """Events start..stop-1 to a watcher, as a live watcher gets them."""
        if stop > start >= 0:
            watcher.apply_all(list(self.reader.events(start, stop)))

    def _rebuild_start(self, target: int) -> int:
        """The keyframe a rebuild of `target` starts from (the event after which it holds the state), at
        least `context` events before the target; -1 for the start of the recording."""
        k = bisect.bisect_right(self._keyframes, target - self.context) - 1
        return self._keyframes[k] if k >= 0 else -1

    def _rebuild(self, target: int) -> None:
        """New watcher parts for `target`: a keyframe's state and the events after it. A view's frame reader
        compares the new frame source whole with what it showed last (engine/watch/frames.py)."""
        old = self.watcher
        parts = Watcher(_NoEvents(), None, history_depth=old.history.depth, recent=old.recent.maxlen)
        start = self._rebuild_start(target)
        if start >= 0:
            self._load_keyframe(parts, start)
            self._server_before(parts, start + 1)
        self._apply(parts, start + 1, target)
        parts.frames = FrameSource(parts.mirror)  # tentative marks of the target event only (module docstring)
        self._apply(parts, target, target + 1)
        old.mirror, old.frames, old.history, old.recent = parts.mirror, parts.frames, parts.history, parts.recent
        old.server = parts.server
        old.status, old.last_step, old.last_error = parts.status, parts.last_step, parts.last_error
        self.history_from = start + 1
        self.rebuilds += 1

    def _server_before(self, parts: Watcher, stop: int) -> None:
        """A server's slots as the events before `stop` left them: keyframes hold the cache, not the
        server's tasks and checkpoints, so its (few) events are read from the start."""
        where = self._kind_index().positions(_SERVER_KIND_NAMES)
        for i in where[:np.searchsorted(where, stop)].tolist():
            parts.server.apply(self.reader.event(i))

    def _load_keyframe(self, parts: Watcher, keyframe: int) -> None:
        """The keyframe's state into fresh watcher parts, and what the events before it left in a watcher."""
        parts.apply_all(self.reader.mirror_at(keyframe).state_events())
        parts.recent.clear()  # the state is no event of the recording: the log starts after it
        carry = self._carry_at(keyframe)
        parts.status, parts.last_step, parts.last_error = carry.status, carry.last_step, carry.last_error
        parts.history.step, parts.history.in_decode = carry.step, carry.in_decode

    def _carry_at(self, i: int) -> _Carry:
        """What a watcher given events 0..i knows besides the cache (see _Carry)."""
        index = self._kind_index()
        started = index.last("DecodeStarted", i)
        step = self.reader.event(started).step if started >= 0 else -1
        return _Carry(self._last_event(index.last("SessionStatus", i)),
                      self._last_event(index.last("WorkloadStep", i)),
                      self._last_event(self._last_failed_command(i)),
                      step, started > index.last("DecodeFinished", i))

    def _last_event(self, i: int) -> ev.Event | None:
        return self.reader.event(i) if i >= 0 else None

    def _last_failed_command(self, i: int) -> int:
        """The index of the last CommandDone that failed at or before event i; -1 if none did."""
        if self._failed_commands is None:
            done = self._kind_index().positions(frozenset({"CommandDone"}))
            self._failed_commands = [int(k) for k in done if not self.reader.event(int(k)).ok]
        k = bisect.bisect_right(self._failed_commands, i)
        return self._failed_commands[k - 1] if k else -1

    # ---- finding events ------------------------------------------------------------------------------
    def _kind_index(self) -> _KindIndex:
        if self._index is None:
            self._index = _KindIndex(self.reader.kinds())
        return self._index

    def _candidates(self, names: frozenset[str] | None, origin: int, backward: bool) -> Iterable[int]:
        """Indices of the events of these kinds (None: every event) after origin, or before it backward,
        nearest first."""
        if names is None:
            return range(origin - 1, -1, -1) if backward else range(max(origin + 1, 0), len(self))
        where = self._kind_index().positions(names)
        if backward:
            return (int(i) for i in where[:np.searchsorted(where, origin, side="left")][::-1])
        return (int(i) for i in where[np.searchsorted(where, origin, side="right"):])


# ---- what a search asks for ---------------------------------------------------------------------------
def _event_classes() -> list[type]:
    return [c for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.Event)]


def _kind_names(kinds: KindsArg) -> frozenset[str] | None:
    """The class names of these kinds and of their subclasses; None for any kind."""
    if kinds is None:
        return None
    wanted = [kinds] if isinstance(kinds, (str, type)) else list(kinds)
    names: set[str] = set()
    for kind in wanted:
        cls = getattr(ev, kind, None) if isinstance(kind, str) else kind
        if not (isinstance(cls, type) and issubclass(cls, ev.Event)):
            raise KvscopeError(f"{kind!r} is not an event kind: name a class of engine.events (CellsAllocated, "
                               f"KShiftApplied, ...) or pass the class")
        names.update(c.__name__ for c in _event_classes() if issubclass(c, cls))
    return frozenset(names)


_SERVER_KIND_NAMES = frozenset(kind.__name__ for kind in SERVER_EVENTS)
_MODEL_NAMING_KINDS = frozenset({"ModelPlaced", "ContextCreated", "Vocabulary"})


def _event_test(seq_id: int | None, cache: str | None, quirk: bool | None,
                where: EventTest | None) -> EventTest | None:
    """One test for every condition given; None when there is none (every event of the kinds passes)."""
    tests: list[EventTest] = []
    if seq_id is not None:
        seq = int_arg(seq_id, "seq_id", "find")
        tests.append(lambda e: concerns_seq(e, seq))
    if cache is not None:
        tests.append(lambda e: concerns_cache(e, cache))
    if quirk is not None:
        tests.append(lambda e: bool(getattr(e, "quirk", "")) == quirk)
    if where is not None:
        tests.append(where)
    return (lambda e: all(t(e) for t in tests)) if tests else None


def concerns_seq(event: ev.Event, seq_id: int) -> bool:
    """Whether an event concerns a sequence. An event that names sequences (a removal, a copy, a shift, a
    decode's batch, a sampled token, an assignment) concerns those it names, a removal of every sequence
    (seq_id -1) any of them; a cell change that names none (a placement, a rollback, a K-shift, a
    snapshot) concerns the sequences its cells hold afterwards; a server's event, its slot's sequence."""
    if isinstance(event, ev.CellsCopied):
        return seq_id in (event.src_seq, event.dst_seq)
    if isinstance(event, ev.DecodeStarted):
        return seq_id in event.seq_ids
    named = getattr(event, "seq_id", None)
    if named is not None:
        return named == seq_id or (named == -1 and isinstance(event, ev.CellsRemoved))
    if isinstance(event, ev.CellsChanged):
        byte, bit = seq_id >> 3, seq_id & 7
        return any(bool(np.any((change.seq_bits[:, byte] >> bit) & 1)) for change in event.changes)
    return getattr(event, "slot", None) == seq_id  # the server's events: slot i is sequence i


def concerns_cache(event: ev.Event, cache: str) -> bool:
    """Whether an event concerns a cache ("kv", "base", "swa"): it names it (cell changes, stream copies,
    a failed slot search, a context's creation, attention weights)."""
    return getattr(event, "cache", None) == cache or cache in getattr(event, "caches", ())
