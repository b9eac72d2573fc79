"""A cache model rebuilt only from events: what the front-ends draw from.

The mirror never looks at the engine. Every CellsChanged event carries the complete new metadata
of the cells it touched and the stream head, so applying events in order reproduces the engine's
cells and heads exactly. Tentative (dry-run) changes are applied too and undone by the
SlotsRolledBack event that follows them, so the mirror also shows what a dry run tried.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from engine import events as ev
from engine.kv.cells import MAX_SEQ
from engine.watch.device_mirror import DeviceMirror


@dataclass
class StreamState:
    pos: np.ndarray
    shift: np.ndarray
    seq: np.ndarray  # (MAX_SEQ, size) bool
    head: int = 0

    def cells(self) -> list[tuple[int, frozenset[int], int]]:
        seq_lists = [[] for _ in range(len(self.pos))]
        for s, i in zip(*np.nonzero(self.seq)):
            seq_lists[i].append(int(s))
        return [(int(p), frozenset(sl), int(sh)) for p, sl, sh in zip(self.pos, seq_lists, self.shift)]


@dataclass
class CacheState:
    name: str
    size: int
    streams: list[StreamState]


@dataclass
class MirrorStats:
    events: int = 0
    dropped: int = 0  # events lost by a full subscription queue; the mirror is stale until resynced
    last_seq_no: int = -1
    kinds: dict[str, int] = field(default_factory=dict)


class CacheMirror:
    """Cells and heads of every cache of a context, rebuilt from its events."""

    def __init__(self) -> None:
        self.caches: dict[str, CacheState] = {}
        self.created: dict[str, ev.ContextCreated] = {}  # the facts of each cache, by cache name
        self.last_decode: ev.DecodeFinished | None = None
        self.stale = False
        self.stats = MirrorStats()
        self.devices = DeviceMirror()  # device memory bars and the layer/device map
        self._lock = threading.Lock()
        self._subscription: ev.Subscription | None = None

    def attach(self, bus: ev.EventBus, maxsize: int = 1 << 20) -> ev.Subscription:
        """Subscribe to a bus; call sync() to apply what arrived. The first events are the current state
        of every live context on the bus, so a mirror attached late is complete after its first sync()."""
        self._subscription = bus.subscribe(maxsize=maxsize)
        return self._subscription

    def sync(self) -> int:
        """Apply every queued event of the attached subscription; returns how many."""
        if self._subscription is None:
            raise RuntimeError("the mirror is not attached: call mirror.attach(bus) first")
        events = self._subscription.drain()
        for event in events:
            self.apply(event)
        return len(events)

    def apply(self, event: ev.Event) -> None:
        with self._lock:
            self.stats.events += 1
            self.stats.last_seq_no = event.seq_no
            self.stats.kinds[event.kind] = self.stats.kinds.get(event.kind, 0) + 1
            if isinstance(event, ev.ContextCreated):
                self._create(event)
            elif isinstance(event, ev.CellsChanged):
                self._apply_changes(event)
            elif isinstance(event, ev.DecodeFinished):
                self.last_decode = event
            elif isinstance(event, (ev.ModelPlaced, ev.DeviceMemoryChanged, ev.DeviceMemoryState)):
                self.devices.apply(event)
            elif isinstance(event, ev.EventsDropped):
                self.stats.dropped += event.count
                self.stale = True

    def _create(self, event: ev.ContextCreated) -> None:
        self.created[event.cache] = event
        self.caches[event.cache] = CacheState(event.cache, event.kv_size, [
            StreamState(np.full(event.kv_size, -1, dtype=np.int64), np.zeros(event.kv_size, dtype=np.int64),
                        np.zeros((MAX_SEQ, event.kv_size), dtype=bool)) for _ in range(event.n_stream)])

    def _apply_changes(self, event: ev.CellsChanged) -> None:
        cache = self.caches.get(event.cache)
        if cache is None:
            self.stale = True  # joined after the context was created: wait for a snapshot
            return
        for change in event.changes:
            st = cache.streams[change.stream]
            st.pos[change.cells] = change.pos
            st.shift[change.cells] = change.shift
            st.seq[:, change.cells] = ev.unpack_seq_bits(change.seq_bits)
            st.head = change.head
        if isinstance(event, ev.MemorySnapshot):
            self.stale = False

    # ---- the same views as the engine's memory ------------------------------------------------
    def cells(self, stream: int = 0, cache: str = "kv") -> list[tuple[int, frozenset[int], int]]:
        with self._lock:
            return self.caches[cache].streams[stream].cells()

    def head(self, stream: int = 0, cache: str = "kv") -> int:
        return self.caches[cache].streams[stream].head

    def n_stream(self, cache: str = "kv") -> int:
        return len(self.caches[cache].streams)
