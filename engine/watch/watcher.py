"""One watcher of a session: its subscription, the cache and device mirrors, the cell history, and what
a status line shows. Front-ends own one each and call poll() when they redraw.

A watcher whose bounded queue overflowed has missed events, so its mirror may be wrong. It notices the
EventsDropped notice, asks its source for the current state (Session.current_state, or the remote
session's), rebuilds the mirror from it and skips every queued event the state already contains: a view
is never wrong without saying so (`stale` is true only until that resync), and never for long.
"""
from __future__ import annotations

import collections
import itertools
import time
from typing import Callable

from engine import events as ev
from engine.errors import KvscopeError
from engine.watch.frames import Frame, FrameReader, FrameSource
from engine.watch.block_mirror import BLOCK_EVENTS
from engine.watch.history import CellHistory
from engine.watch.mirror import CacheMirror
from engine.watch.server_slots import SERVER_EVENTS, ServerSlots

StateSource = Callable[[], list[ev.Event]]
_STATUS_KINDS = (ev.SessionStatus, ev.WorkloadStep, ev.CommandDone)
_SERVER_KINDS = frozenset(SERVER_EVENTS)
_BLOCK_TYPES = frozenset(BLOCK_EVENTS)


class Watcher:
    """Mirrors, history and status of one event stream, kept in step by poll()."""

    POLL_CHUNK = 1024  # events applied between two looks at the clock of a poll with a budget

    def __init__(self, subscription: ev.Subscription, current_state: StateSource | None = None, *,
                 history_depth: int = 8, recent: int = 2000) -> None:
        """subscription: where events come from (Session.subscribe(), or a remote one); current_state:
        where a fresh state comes from after lost events (None: wait for the next snapshot)."""
        self.subscription = subscription
        self.current_state = current_state
        self.mirror = CacheMirror()
        self.frames = FrameSource(self.mirror)
        self._frame_reader = self.frame_reader()
        self.history = CellHistory(history_depth)
        self.server = ServerSlots()  # a server simulation's slots (empty for other workloads)
        self.recent: collections.deque[ev.Event] = collections.deque(maxlen=recent)  # for the event log
        self.status: ev.SessionStatus | None = None
        self.last_step: ev.WorkloadStep | None = None
        self.last_error: ev.CommandDone | None = None
        self.events = 0
        self.resyncs = 0
        self.dropped = 0
        self._skip_until: int | None = None  # events stamped at or before it are in the last resync's state
        self._backlog: list[ev.Event] = []  # taken from the queue, left by a poll that ran out of time

    @classmethod
    def of(cls, source, *, maxsize: int = 1 << 16, **options) -> Watcher:
        """A watcher of anything with subscribe(maxsize) and current_state(): a Session, a RemoteSession.
        It leaves out OutputLogProbs: a vocabulary's worth of numbers per token, for comparisons (engine/
        watch/compare.py has its own subscription), which nothing a watcher keeps uses."""
        subscription = source.subscribe(maxsize)
        subscription.left_out = (ev.OutputLogProbs,)
        return cls(subscription, source.current_state, **options)

    @property
    def stale(self) -> bool:
        return self.mirror.stale

    @property
    def backlog(self) -> int:
        """Events taken from the queue that a poll with a time budget left for the next one."""
        return len(self._backlog)

    def events_since(self, counted: int) -> list[ev.Event]:
        """The events applied after the watcher had counted `counted` (its `events` then), oldest first, as
        far as `recent` still holds them: what a view that reads the watcher without polling it (others
        may poll the same watcher) has not seen yet."""
        new = min(self.events - counted, len(self.recent))
        if new <= 0:
            return []
        return list(itertools.islice(self.recent, len(self.recent) - new, None))

    def poll(self, budget_s: float | None = None) -> int:
        """Apply every event that arrived; returns how many were applied (those a resync's state already
        held are skipped). With a budget, stop once about `budget_s` seconds went by and keep the rest,
        in order, for the next poll: a view under a burst of events still draws and answers keys."""
        arrived = self.subscription.drain()
        events = self._backlog + arrived if self._backlog else arrived
        self._backlog = []
        deadline = None if budget_s is None else time.perf_counter() + budget_s
        taken, applied_before = 0, self.events
        while taken < len(events):
            chunk = events[taken:taken + self.POLL_CHUNK] if deadline is not None else events
            self._apply_arrived(chunk)
            taken += len(chunk)
            if deadline is not None and time.perf_counter() >= deadline:
                self._backlog = events[taken:]
                break
        # A full queue tells its watcher only with the next event that fits, so after draining it ask
        # the queue itself whether it dropped anything since: the view is then right at once.
        dropped = getattr(self.subscription, "dropped", 0)
        if dropped > self.dropped:
            self.dropped = dropped
            self.mirror.stale = True
            self._resync()
        return self.events - applied_before

    def _apply_arrived(self, events: list[ev.Event]) -> None:
        batch = []
        for event in events:
            if isinstance(event, ev.EventsDropped):
                self.apply_all(batch)
                batch = []
                if self._skip_until is None or event.last_seq_no > self._skip_until:
                    self.mirror.apply(event)  # marks the mirror stale
                    self._resync()
            elif self._skip_until is None or event.seq_no > self._skip_until:
                batch.append(event)
        self.apply_all(batch)

    def apply(self, event: ev.Event) -> None:
        self.apply_all([event])

    def apply_all(self, events: list[ev.Event]) -> int:
        """Apply events in order (the mirror takes them under one lock); returns how many."""
        start = 0
        for i, event in enumerate(events):
            if isinstance(event, ev.ContextCreated) and i > start:
                self._apply_segment(events[start:i])  # cells of the cache as it was, before it is replaced
                start = i
        self._apply_segment(events[start:])
        return len(events)

    def _apply_segment(self, events: list[ev.Event]) -> None:
        self.mirror.apply_all(events)
        frames, history = self.frames, self.history
        for event in events:
            kind = type(event)
            if kind in _BLOCK_TYPES:  # the mirror's blocks are all they change; tens of thousands a second
                continue
            frames.apply(event)
            history.apply(event)
            if kind in _STATUS_KINDS:
                self._note_status(event)
            elif kind in _SERVER_KINDS:
                self.server.apply(event)
        self.recent.extend(events)
        self.events += len(events)

    def _note_status(self, event: ev.Event) -> None:
        if isinstance(event, ev.SessionStatus):
            self.status = event
        elif isinstance(event, ev.WorkloadStep):
            self.last_step = event
        elif not event.ok:
            self.last_error = event

    def frame(self) -> Frame:
        """Every cache stream as a view draws it, and the cells changed since the previous call: for a
        watcher shown by one view. Views that share a watcher take a frame_reader() each."""
        return self._frame_reader.frame()

    def frame_reader(self) -> FrameReader:
        """Frames for one more view of this watcher: its changed, tentative and QUIRK marks count from its
        own previous frame, whichever views take frames in between. It follows the watcher's frame
        source across resyncs (and a replay's rebuilds)."""
        return FrameReader(lambda: self.frames)

    def _resync(self) -> None:
        if self.current_state is None:
            return  # stays stale until a MemorySnapshot comes by itself
        try:
            state = self.current_state()
        except KvscopeError:
            return  # the source is gone (a remote server died): stay stale, and try again at the next loss
        mirror = CacheMirror()
        frames = FrameSource(mirror)
        for event in state:
            mirror.apply(event)
            frames.apply(event)
            if isinstance(event, (ev.Vocabulary, ev.SequenceAssigned)):  # the rest would reset the history
                self.history.apply(event)
            if isinstance(event, ev.SessionStatus):
                self.status = event
        mirror.stats.dropped = self.dropped
        self.mirror, self.frames = mirror, frames
        if state:
            self._skip_until = max(e.seq_no for e in state)
        self.resyncs += 1
