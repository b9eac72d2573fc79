"""A cache model rebuilt only from events: what the front-ends draw from.

The mirror never looks at the engine. Every CellsChanged event carries the complete new metadata
of the cells it touched and the stream head, so applying events in order reproduces the engine's
cells and heads exactly. A dry run's placements (tentative CellsAllocated) are skipped: the
SlotsRolledBack that follows restates every cell they touched as it was, so skipping them changes no
end state and saves a third of the work of a decode; the dry run's SWA purge, which llama.cpp does not
undo, is applied like any change. Views mark tentative cells from the frames (engine/watch/frames.py).
Each cell's sequences are kept as llama.cpp's 256-bit set, packed in 32 bytes.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

import numpy as np

from engine import events as ev
from engine.kv.cells import MAX_SEQ
from engine.watch.block_mirror import BLOCK_EVENTS, BlockMirror
from engine.watch.device_mirror import DeviceMirror

SNAPSHOT_SKIPS = ("time",)
_BLOCK_TYPES = frozenset(BLOCK_EVENTS)  # fields of kept events that snapshot() leaves out (see there)


@dataclass
class StreamState:
    pos: np.ndarray
    shift: np.ndarray
    seq_bits: np.ndarray  # (size, 32) uint8: each cell's sequence bitset, little-endian bit order
    head: int = 0
    # uint8 per cell: where not 0, seq_bits are only the sequences that may hold the cell (a log's 'M' cell:
    # engine.events.CellsSeen and its SEQS_* codes); None while there are none, so the engine's events pay nothing
    uncertain: np.ndarray | None = None

    def uncertain_cells(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int64) if self.uncertain is None else np.flatnonzero(self.uncertain)

    @property
    def seq(self) -> np.ndarray:
        """(MAX_SEQ, size) bool: which sequences each cell holds (unpacked on each call)."""
        return ev.unpack_seq_bits(self.seq_bits)

    def holds(self, seq_id: int) -> np.ndarray:
        """(size,) bool: the cells that hold seq_id."""
        return ((self.seq_bits[:, seq_id >> 3] >> (seq_id & 7)) & 1).astype(bool)

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
        self.vocabulary: ev.Vocabulary | None = None  # each token's text, when the context sent it
        self.sequences: dict[int, ev.SequenceAssigned] = {}  # what each sequence serves, as the runner said
        self.stale = False
        self.stats = MirrorStats()
        self.devices = DeviceMirror()  # device memory bars and the layer/device map
        self.blocks = BlockMirror()  # vLLM / SGLang workers' hashed blocks, where the events come from those
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
            self._apply(event)

    def apply_all(self, events: list[ev.Event]) -> None:
        """apply() for many events, under one lock."""
        with self._lock:
            for event in events:
                if type(event) in _BLOCK_TYPES:  # vLLM workers' blocks: tens of thousands a second, straight there
                    self._count(event)
                    self.blocks.apply(event)
                else:
                    self._apply(event)

    def _count(self, event: ev.Event) -> None:
        stats = self.stats
        stats.events += 1
        stats.last_seq_no = event.seq_no
        kind = type(event).__name__
        stats.kinds[kind] = stats.kinds.get(kind, 0) + 1

    def _apply(self, event: ev.Event) -> None:
        self._count(event)
        if isinstance(event, ev.CellsChanged):  # the most frequent first
            self._apply_changes(event)
        else:
            self._apply_other(event)

    def _apply_other(self, event: ev.Event) -> None:
        if isinstance(event, ev.ContextCreated):
            self._create(event)
        elif isinstance(event, ev.DecodeFinished):
            self.last_decode = event
        elif isinstance(event, ev.Vocabulary):
            self.vocabulary = event
        elif isinstance(event, ev.SequenceAssigned):
            self.sequences[event.seq_id] = event
        elif isinstance(event, (ev.ModelPlaced, ev.DeviceMemoryChanged, ev.DeviceMemoryState)):
            self.devices.apply(event)
        elif isinstance(event, BLOCK_EVENTS):
            self.blocks.apply(event)
        elif isinstance(event, ev.EventsDropped):
            self.stats.dropped += event.count
            self.stale = True

    def _create(self, event: ev.ContextCreated) -> None:
        self.created[event.cache] = event
        self.caches[event.cache] = CacheState(event.cache, event.kv_size, [
            StreamState(np.full(event.kv_size, -1, dtype=np.int64), np.zeros(event.kv_size, dtype=np.int64),
                        np.zeros((event.kv_size, MAX_SEQ // 8), dtype=np.uint8)) for _ in range(event.n_stream)])

    def _apply_changes(self, event: ev.CellsChanged) -> None:
        cache = self.caches.get(event.cache)
        if cache is None:
            self.stale = True  # joined after the context was created: wait for a snapshot
            return
        if event.tentative and isinstance(event, ev.CellsAllocated):
            return  # undone by the SlotsRolledBack that follows (see the module docstring)
        size = cache.size
        if isinstance(event, ev.CellsSeen):
            self._mark_uncertain(cache, event)
        for change in event.changes:
            st = cache.streams[change.stream]
            cells = change.cells
            if len(cells) == 1:  # a single-token decode's cell: scalar writes are several times faster
                i = int(cells[0])
                st.pos[i], st.shift[i], st.seq_bits[i] = change.pos[0], change.shift[0], change.seq_bits[0]
            else:
                # a whole stream in order (a snapshot, a keyframe): slices copy twice as fast as an index array
                if len(cells) == size and _every_cell(cells, size):
                    cells = slice(None)
                st.pos[cells] = change.pos
                st.shift[cells] = change.shift
                st.seq_bits[cells] = change.seq_bits
            if st.uncertain is not None and not isinstance(event, ev.CellsSeen):
                st.uncertain[change.cells] = 0  # the engine's events say exactly who holds a cell
            st.head = change.head
        if isinstance(event, ev.MemorySnapshot):
            self.stale = False

    @staticmethod
    def _mark_uncertain(cache: CacheState, event: ev.CellsSeen) -> None:
        for change, flags in zip(event.changes, event.uncertain or [None] * len(event.changes)):
            st = cache.streams[change.stream]
            if flags is not None and flags.any() and st.uncertain is None:
                st.uncertain = np.zeros(cache.size, dtype=np.uint8)
            if st.uncertain is not None:
                st.uncertain[change.cells] = flags if flags is not None else 0

    # ---- the same views as the engine's memory ------------------------------------------------
    def cells(self, stream: int = 0, cache: str = "kv") -> list[tuple[int, frozenset[int], int]]:
        with self._lock:
            return self.caches[cache].streams[stream].cells()

    def head(self, stream: int = 0, cache: str = "kv") -> int:
        return self.caches[cache].streams[stream].head

    def n_stream(self, cache: str = "kv") -> int:
        return len(self.caches[cache].streams)

    # ---- the mirror's state, as events and as plain data -----------------------------------------
    def state_events(self) -> list[ev.Event]:
        """Events that give a fresh mirror this mirror's state (snapshot() equal): the device state, each
        cache's ContextCreated as received, the Vocabulary, the last DecodeFinished, a MemorySnapshot per
        cache and, for a stale mirror, an EventsDropped that marks it stale again (after the snapshots,
        which clear the mark). Events made here carry the seq_no of the last event applied, as the bus
        stamps a context's state. A recording's keyframes are these events: state added to the mirror
        later must be added here too, or keyframes lose it."""
        with self._lock:
            received = [self.devices.placement, *self.created.values(), self.vocabulary, self.last_decode,
                        *self.sequences.values()]
            events = self.devices.state_events() + list(self.created.values())
            events += [e for e in (self.vocabulary, self.last_decode) if e is not None]
            events += list(self.sequences.values())
            events += [self._snapshot_event(cache) for cache in self.caches.values()]
            events += [e for cache in self.caches.values() for e in self._uncertain_event(cache)]
            events += self.blocks.state_events()
            if self.stale:
                events.append(ev.EventsDropped(self.stats.dropped, -1, -1))
            for event in events:
                if not any(event is r for r in received):
                    object.__setattr__(event, "seq_no", self.stats.last_seq_no)
            return events

    @staticmethod
    def _snapshot_event(cache: CacheState) -> ev.MemorySnapshot:
        every_cell = np.arange(cache.size, dtype=np.int64)
        return ev.MemorySnapshot(cache=cache.name, changes=tuple(
            ev.StreamCells(s, every_cell, st.pos.copy(), st.shift.copy(), st.seq_bits.copy(), st.head)
            for s, st in enumerate(cache.streams)))

    @staticmethod
    def _uncertain_event(cache: CacheState) -> list[ev.CellsSeen]:
        """The cells whose sequences are only possible ones, restated as such after the snapshot."""
        changes, flags = [], []
        for s, st in enumerate(cache.streams):
            cells = st.uncertain_cells()
            if len(cells):
                changes.append(ev.StreamCells(s, cells, st.pos[cells], st.shift[cells], st.seq_bits[cells], st.head))
                flags.append(st.uncertain[cells])
        return [ev.CellsSeen(cache=cache.name, changes=tuple(changes), uncertain=tuple(flags),
                             cause="restated")] if changes else []

    def snapshot(self) -> dict:
        """The state as plain data (dicts, lists, numbers, numpy arrays), for comparing two mirrors.
        Statistics (events applied, per-kind counts) are not state and are left out, and so is the `time`
        of the events kept (ContextCreated, ...): the bus stamps the state it hands a new subscriber with
        the time of that subscription, so two watchers of one bus would differ there and nowhere else."""
        with self._lock:
            return {
                "caches": {name: [{"pos": st.pos.copy(), "shift": st.shift.copy(), "seq_bits": st.seq_bits.copy(),
                                   "head": st.head, "uncertain": st.uncertain_cells(),
                                   "uncertain_codes": st.uncertain[st.uncertain_cells()] if st.uncertain is not None
                                   else np.zeros(0, dtype=np.uint8)} for st in cache.streams]
                           for name, cache in self.caches.items()},
                "created": {name: record_data(e, skip=SNAPSHOT_SKIPS) for name, e in self.created.items()},
                "vocabulary": record_data(self.vocabulary, skip=SNAPSHOT_SKIPS),
                "last_decode": record_data(self.last_decode, skip=SNAPSHOT_SKIPS),
                "sequences": {s: record_data(e, skip=SNAPSHOT_SKIPS) for s, e in self.sequences.items()},
                "stale": self.stale,
                "devices": record_data(self.devices.snapshot(), skip=SNAPSHOT_SKIPS),
                "blocks": self.blocks.snapshot(),
            }

    def differences(self, other: CacheMirror) -> list[str]:
        """Where this mirror's state differs from `other`'s (paths into snapshot()); empty when equal."""
        return data_differences(self.snapshot(), other.snapshot())

    def same_as(self, other: CacheMirror) -> bool:
        return not self.differences(other)


def _every_cell(cells: np.ndarray, size: int) -> bool:
    return len(cells) == size > 0 and cells[0] == 0 and cells[-1] == size - 1 and bool(np.all(np.diff(cells) == 1))


def record_data(record, skip: tuple[str, ...] = ()) -> object:
    """An event or nested record as plain data: {"kind": class name, field: value, ...}, recursively,
    without the fields named in `skip`; tuples become lists, so that a tuple and a list of equal items
    compare equal."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {"kind": type(record).__name__, **{f.name: record_data(getattr(record, f.name), skip)
                                                  for f in dataclasses.fields(record) if f.name not in skip}}
    if isinstance(record, (tuple, list)):
        return [record_data(v, skip) for v in record]
    if isinstance(record, dict):
        return {k: record_data(v, skip) for k, v in record.items()}
    return record


def data_differences(a, b, path: str = "") -> list[str]:
    """Paths at which two plain-data trees differ; numpy arrays compare by dtype, shape and values."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = list(a) + [k for k in b if k not in a]
        return [d for k in keys for d in (data_differences(a[k], b[k], f"{path}/{k}") if k in a and k in b
                                          else [f"{path}/{k}: only in {'the first' if k in a else 'the second'}"])]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in data_differences(x, y, f"{path}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(a, b))
        return [] if same else [f"{path}: {_short(a)} against {_short(b)}"]
    # by value: a head may be a numpy integer live and a Python int after a recording's round trip
    if a is None or b is None or isinstance(a, str) != isinstance(b, str) or a != b:
        return [] if a is b else [f"{path}: {_short(a)} against {_short(b)}"]
    return []


def _short(value) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."
