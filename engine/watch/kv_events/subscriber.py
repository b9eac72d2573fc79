"""vLLM's and SGLang's prefix caches, watched from the KV events their workers publish: `kvscope attach --vllm`.

    subscriber = KvEventSubscriber([parse_endpoint("tcp://10.0.0.5:5557,tcp://10.0.0.5:5600")], start=False)
    watcher = Watcher.of(subscriber)          # session-like: subscribe(maxsize), current_state()
    subscriber.start()
    ...
    subscriber.close()

A vLLM worker with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'` (and an
SGLang one with its --kv-events-config) publishes every change of its prefix cache on a ZeroMQ PUB socket: each
message is [topic, seq (8 bytes, big-endian), payload], the payload one msgpack batch of BlockStored /
BlockRemoved / AllBlocksCleared (engine/watch/kv_events/formats.py reads all four layouts), and a ROUTER socket
beside it answers replay requests from a buffer of past batches. With data parallelism each rank publishes on
its own port (the endpoint's port + rank).

One thread owns every socket (ZeroMQ sockets are not thread-safe): a SUB socket per publisher, so that each
publisher's sequence numbers are followed on their own, and a DEALER per replay endpoint, made when a gap first
asks for one. A message that is not a batch (wrong frames, a sequence number that is not 8 bytes, a payload no
layout reads) is counted as malformed and skipped: publishers are not trusted, and nothing they send stops the
subscriber. ZMQ_MAXMSGSIZE caps what one message may take; ZeroMQ drops a connection that sends more and never
makes it again, so a SUB socket that lost its publisher and does not try again is connected anew (whatever came
meanwhile is a gap).

Sequence numbers, per publisher: the first message seen starts the count (kvscope joined late; nothing before it
is called lost). One past the last: applied. Further on: the batches between are asked of the replay endpoint
(waiting at most REPLAY_WAIT_S), those that come back are applied in order, then the batch that showed the gap,
and a KvBatchesLost says how many came back and why the others did not. Back at or below the last: the
publisher restarted, and what it said before is void: KvPublisherRestarted, and a BlocksCleared for each of its
workers, before its new batches.

Workers are (publisher, data_parallel_rank) pairs, numbered in the order first heard from; a KvWorkerSeen
names each before its first block event. Events go out on this object's own EventBus under the lock that
subscribe() and current_state() take (as engine/runners/attach.py's AttachedLog does), so that a new
subscriber gets the state so far and then every later event exactly once; the events of a burst of messages
go out together. The subscriber keeps its own BlockMirror (`blocks`), which is the state a late subscriber
starts from. A Vocabulary, when given, goes out first.

The usual batch is read straight from its msgpack objects into events (fast_block_events); any other goes through
formats.py's full reader (batch_from_object, block_events), which gives the same events for what both read and
counts what it does not know. Torch-free.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine import events as ev
from engine.errors import KvscopeError
from engine.watch import lifetime
from engine.watch.block_mirror import BlockMirror
from engine.watch.kv_events.formats import (
    CLEARED,
    HASH_MASK,
    REMOVED,
    REMOVED_FIELDS,
    STORED,
    STORED_FIELDS,
    WireBatch,
    WireError,
    _array_dialect,
    batch_from_object,
    unpack_payload,
)

MAX_MESSAGE_BYTES = 64 << 20  # ZMQ_MAXMSGSIZE of every socket: a publisher is not trusted with our memory
RECEIVE_HWM = 100_000  # messages ZeroMQ queues per socket while the thread is busy (a replay wait), as vLLM's PUB
REPLAY_WAIT_S = 1.0  # the most a gap waits for the replay endpoint's answer
STATS_EVERY_S = 1.0
POLL_MS = 100  # how long the thread sleeps in poll() before it looks at the stop flag and the stats again
DRAIN_MESSAGES = 256  # messages read from one socket before the events go out: bursts share one lock hold
CLOSE_WAIT_S = 10.0  # close() waits this long for the thread
RECONNECT_GRACE_S = 1.0  # a SUB socket that lost its publisher and did not begin to connect again by then: connected anew
END_SEQ = -1  # the sequence number (signed) of the frame that ends a replay
WORKLOAD = "kv-events"  # SessionStatus.workload

log = logging.getLogger("kvscope.kv_events")

_TCP = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.%a-z]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)"
                  r":(?P<port>[0-9]{1,5})")
_EXAMPLE = ("an endpoint is tcp://HOST:PORT, e.g. tcp://10.0.0.5:5557, or with its replay endpoint "
            "tcp://10.0.0.5:5557,tcp://10.0.0.5:5600")


@dataclass(frozen=True)
class Endpoint:
    """A publisher's PUB endpoint and, where it has one, its replay (ROUTER) endpoint."""

    pub: str
    replay: str | None = None

    @property
    def address(self) -> str:
        """"10.0.0.5:5557" (an ipc endpoint: its path), as labels show it."""
        return self.pub.split("://", 1)[1]

    def __str__(self) -> str:
        return self.pub if self.replay is None else f"{self.pub},{self.replay}"


def parse_endpoint(text: str) -> Endpoint:
    """"tcp://HOST:PORT" or "tcp://HOST:PORT,tcp://HOST:PORT" (the publisher's, then its replay endpoint), as
    `kvscope attach --vllm` takes them; ipc://PATH too. KvscopeError for anything else."""
    if not isinstance(text, str):
        raise KvscopeError(f"a KV event endpoint is a string, not {type(text).__name__}; {_EXAMPLE}")
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 2:
        raise KvscopeError(f"KV event endpoint {text!r} has {len(parts)} addresses: give the publisher's and at most "
                           f"its replay endpoint's; {_EXAMPLE}")
    pub = _address(parts[0], text, "the publisher's address")
    replay = _address(parts[1], text, "the replay address") if len(parts) == 2 else None
    if replay == pub:
        raise KvscopeError(f"KV event endpoint {text!r}: the replay endpoint must differ from the publisher's "
                           f"(vLLM's replay_endpoint is a ROUTER socket on a port of its own)")
    return Endpoint(pub, replay)


def _address(part: str, text: str, what: str) -> str:
    if part.startswith("ipc://") and len(part) > len("ipc://"):
        return part
    match = _TCP.fullmatch(part)
    wildcard = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]):[0-9]+", part)
    if match is None or wildcard:
        if wildcard:
            why = "is where a publisher binds: kvscope connects to it, give the host it runs on"
        elif "://" not in part:
            why = "has no tcp:// in front"
        else:
            why = "is not tcp://HOST:PORT"
        where = f"KV event endpoint {part!r}" if part == text.strip() else f"KV event endpoint {text!r}: {what} {part!r}"
        raise KvscopeError(f"{where} {why}; {_EXAMPLE}")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise KvscopeError(f"KV event endpoint {text!r}: port {port} is not in 1..65535")
    return part


# ---- a batch's events ------------------------------------------------------------------------------------
def record_maker(cls: type) -> Callable[..., Any]:
    """A function that makes cls(*values) (every positional field given, kw-only ones at their defaults) without
    the dataclass's generated __init__: a frozen one pays an object.__setattr__ per field, 14 for a BlocksStored,
    which is most of what a block event costs to make. The class itself where its __init__ could do more (a
    __post_init__, a field that init leaves out, a kw-only field without a default, slots)."""
    fields = dataclasses.fields(cls)
    if (hasattr(cls, "__post_init__") or "__slots__" in vars(cls) or any(not f.init for f in fields)
            or any(f.kw_only and f.default is dataclasses.MISSING for f in fields)):
        return cls
    positional = tuple(f.name for f in fields if not f.kw_only)
    kw_defaults = {f.name: f.default for f in fields if f.kw_only}
    new = object.__new__

    def make(*values: Any) -> Any:
        obj = new(cls)
        state = obj.__dict__
        state.update(zip(positional, values))
        state.update(kw_defaults)
        return obj

    return make


_blocks_stored = record_maker(ev.BlocksStored)


@dataclass
class Converted:
    """A batch as kvscope events for one worker, with what its publisher's counts need."""

    events: list[ev.Event]
    rank: int | None
    dialect: str
    wire_events: int  # the batch's events, those of unknown kinds included
    blocks_stored: int = 0
    blocks_removed: int = 0
    unknown_tags: int = 0
    unknown_fields: int = 0


class _Removals:
    """Consecutive BlockRemoved events of one medium and group, gathered into one BlocksRemoved (vLLM evicts
    block by block, one event each): what they say is the same, at a fraction of the events."""

    __slots__ = ("hashes", "tier")

    def __init__(self) -> None:
        self.hashes: list[bytes] = []
        self.tier: tuple[str, int] | None = None

    def add(self, hashes: tuple[bytes, ...], tier: tuple[str, int], worker: int, ts: float, out: list) -> None:
        if tier != self.tier:
            self.flush(worker, ts, out)
            self.tier = tier
        self.hashes += hashes

    def flush(self, worker: int, ts: float, out: list) -> None:
        if self.hashes:
            out.append(ev.BlocksRemoved(worker, tuple(self.hashes), self.tier[0], self.tier[1], ts))
            self.hashes = []


def block_events(worker: int, batch: WireBatch) -> Converted:
    """The events of a batch formats.py decoded. OverflowError for token ids beyond int64."""
    out: list[ev.Event] = []
    ts = batch.ts
    n_stored = n_removed = 0
    removals = _Removals()
    gpu = ev.MEDIUM_GPU
    for e in batch.events:
        tag = e.tag
        if tag == REMOVED:
            if e.block_hashes:
                removals.add(e.block_hashes, (e.medium or gpu, e.group_idx or 0), worker, ts, out)
                n_removed += len(e.block_hashes)
            continue
        removals.flush(worker, ts, out)
        if tag == CLEARED:
            out.append(ev.BlocksCleared(worker, ts))
        elif e.block_hashes:
            out.append(_stored_event(worker, e.block_hashes, e.parent_hash, e.token_ids, e.block_size, e.lora_id,
                                     e.medium, e.lora_name, e.extra_keys, e.group_idx, e.group_kind,
                                     e.sliding_window, ts))
            n_stored += len(e.block_hashes)
    removals.flush(worker, ts, out)
    return Converted(out, batch.rank, batch.dialect, len(batch.events) + batch.unknown_tags, n_stored, n_removed,
                     batch.unknown_tags, batch.unknown_fields)


def _stored_event(worker: int, hashes: tuple[bytes, ...], parent: bytes | None, token_ids, block_size: int,
                  lora_id: int | None, medium: str | None, lora_name: str | None, extra_keys, group: int | None,
                  group_kind: str | None, window: int | None, ts: float) -> ev.BlocksStored:
    tokens = np.array(token_ids, dtype=np.int64)
    tokens.flags.writeable = False
    lora = lora_name or (f"id {lora_id}" if lora_id is not None else "")
    extra = () if extra_keys is None else tuple(_key_text(k) for k in extra_keys)
    return _blocks_stored(worker, hashes, parent, tokens, block_size, medium or ev.MEDIUM_GPU, lora, group or 0,
                          group_kind or "", window or 0, extra, ts)


# The fast path: the usual batch (every field of a known type, nothing unknown) read straight from its msgpack
# objects into events, without formats.py's WireEvents, which cost as much again. Anything else, it leaves to
# batch_from_object and block_events, which read every layout and say what is wrong; both give the same events
# (tests/test_kv_events_wire.py compares them).
_BATCH_KEYS = frozenset({"ts", "events", "data_parallel_rank"})
_STORED_KEYS = STORED_FIELDS | {"type"}
_REMOVED_KEYS = REMOVED_FIELDS | {"type"}
_INTS, _BYTES = frozenset({int}), frozenset({bytes})
_OPTIONAL_INT = frozenset({int, type(None)})
_OPTIONAL_STR = frozenset({str, type(None)})
_NOT_USUAL = object()  # what the fast path's helpers return for a value it leaves to the full reader


def fast_block_events(obj: Any, worker_of: Callable[[int | None], int]) -> Converted | None:
    """The events of an unpacked batch of the usual shape (worker_of: the worker of a rank); None for any other,
    which batch_from_object and block_events then read."""
    if type(obj) is dict:
        if not _BATCH_KEYS.issuperset(obj):
            return None
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
        maps = True
    elif type(obj) is list and 2 <= len(obj) <= 3:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) == 3 else None
        maps = False
    else:
        return None
    if (type(ts) is not float and type(ts) is not int) or type(events) is not list or type(rank) not in _OPTIONAL_INT:
        return None
    ts = float(ts)
    worker = worker_of(rank)
    out: list[ev.Event] = []
    n_stored = n_removed = 0
    removals = _Removals()
    gpu = ev.MEDIUM_GPU
    for raw in events:
        if maps:
            if type(raw) is not dict:
                return None
            tag = raw.get("type")
            if tag == STORED:
                if not _STORED_KEYS.issuperset(raw):
                    return None
                get = raw.get
                event = _usual_stored(worker, get("block_hashes"), get("parent_block_hash"), get("token_ids"),
                                      get("block_size"), get("lora_id"), get("medium"), get("lora_name"),
                                      get("extra_keys"), get("group_idx"), get("kv_cache_spec_kind"),
                                      get("kv_cache_spec_sliding_window"), ts)
            elif tag == REMOVED:
                if not _REMOVED_KEYS.issuperset(raw):
                    return None
                hashes, medium, group = _usual_hashes(raw.get("block_hashes")), raw.get("medium"), raw.get("group_idx")
                event = REMOVED
            elif tag == CLEARED and len(raw) == 1:
                event = CLEARED
            else:
                return None
        else:
            if type(raw) is not list or not raw:
                return None
            tag, n = raw[0], len(raw)
            if tag == STORED and 6 <= n <= 9:
                event = _usual_stored(worker, raw[1], raw[2], raw[3], raw[4], raw[5], raw[6] if n > 6 else None,
                                      raw[7] if n > 7 else None, raw[8] if n > 8 else None, None, None, None, ts)
            elif tag == REMOVED and 2 <= n <= 3:
                hashes, medium, group = _usual_hashes(raw[1]), raw[2] if n > 2 else None, None
                event = REMOVED
            elif tag == CLEARED and n == 1:
                event = CLEARED
            else:
                return None
        if event is REMOVED:
            if hashes is _NOT_USUAL or type(medium) not in _OPTIONAL_STR or type(group) not in _OPTIONAL_INT:
                return None
            if hashes:
                removals.add(hashes, (medium or gpu, group or 0), worker, ts, out)
                n_removed += len(hashes)
            continue
        if event is _NOT_USUAL:
            return None
        removals.flush(worker, ts, out)
        if event is CLEARED:
            out.append(ev.BlocksCleared(worker, ts))
        elif event is not None:
            out.append(event)
            n_stored += len(event.block_hashes)
    removals.flush(worker, ts, out)
    return Converted(out, rank, "map" if maps else _array_dialect(obj, events), len(events), n_stored, n_removed)


def _usual_hashes(hashes: Any) -> tuple[bytes, ...] | object:
    if type(hashes) is not list:
        return _NOT_USUAL
    kinds = set(map(type, hashes))
    if kinds <= _BYTES:
        return tuple(hashes)
    if kinds <= _INTS:
        return tuple([(h & HASH_MASK).to_bytes(8, "big") for h in hashes])
    return _NOT_USUAL


def _usual_stored(worker: int, hashes: Any, parent: Any, tokens: Any, size: Any, lora_id: Any, medium: Any,
                  lora_name: Any, extra: Any, group: Any, kind: Any, window: Any, ts: float) -> Any:
    """A BlockStored's event; None when it stores no block; _NOT_USUAL for a value the fast path leaves alone."""
    block_hashes = _usual_hashes(hashes)
    if (block_hashes is _NOT_USUAL or type(tokens) is not list or type(size) is not int or size <= 0
            or not set(map(type, tokens)) <= _INTS):
        return _NOT_USUAL
    if type(parent) is int:
        parent = (parent & HASH_MASK).to_bytes(8, "big")
    elif parent is not None and type(parent) is not bytes:
        return _NOT_USUAL
    if (type(lora_id) not in _OPTIONAL_INT or type(medium) not in _OPTIONAL_STR or type(lora_name) not in _OPTIONAL_STR
            or (extra is not None and type(extra) is not list) or type(group) not in _OPTIONAL_INT
            or type(kind) not in _OPTIONAL_STR or type(window) not in _OPTIONAL_INT):
        return _NOT_USUAL
    if not block_hashes:
        return None
    return _stored_event(worker, block_hashes, parent, tokens, size, lora_id, medium, lora_name, extra, group, kind,
                         window, ts)


def _key_text(key: Any) -> str:
    """One block's extra hash keys as text: vLLM sends a tuple of multimodal hashes, a LoRA name, a cache salt."""
    if key is None:
        return ""
    if isinstance(key, str):
        return key
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).hex()
    if isinstance(key, (list, tuple)):
        return ", ".join(_key_text(k) for k in key)
    return str(key)


def _batch_ts(obj: Any) -> float:
    """The publisher's clock of an unpacked batch, as far as it says it; else this machine's."""
    ts = obj.get("ts") if type(obj) is dict else obj[0] if type(obj) is list and obj else None
    return float(ts) if type(ts) in (int, float) else time.time()


# ---- one publisher ------------------------------------------------------------------------------------------
class _Publisher:
    """What the thread knows of one publisher: its sockets, its sequence numbers, its workers, its counts."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.name = endpoint.pub
        self.sub: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None  # the SUB socket's connection events
        self.dropped_at: float | None = None  # when the connection went and ZeroMQ did not try again yet
        self.dealer: zmq.Socket | None = None
        self.last_seq: int | None = None
        self.epochs = 1
        self.workers: dict[int | None, int] = {}  # data_parallel_rank (None: not said) -> worker
        self.dialect = ""
        self.batches = self.events = self.blocks_stored = self.blocks_removed = 0
        self.lost = self.replayed = self.malformed = self.unknown_tags = self.unknown_fields = self.other_topics = 0
        self.published: tuple | None = None  # the figures of the last KvEventStats sent

    def figures(self) -> tuple:
        return (self.batches, self.events, self.blocks_stored, self.blocks_removed, self.lost, self.replayed,
                self.malformed, self.unknown_tags, self.unknown_fields, self.other_topics, self.epochs, self.dialect)

    def stats(self) -> ev.KvEventStats:
        return ev.KvEventStats(self.name, *self.figures())


class KvEventSubscriber(ev.WatchedBus):
    """The KV events of one or more vLLM / SGLang publishers, as kvscope events: see the module docstring."""

    kind = "kv-events"  # what a front-end asks to tell it from an attached llama.cpp log ("process", "file")

    def __init__(self, endpoints: Sequence[Endpoint | str], *, topic: str = "", vocabulary: ev.Vocabulary | None = None,
                 capacity_blocks: int = 0, start: bool = True) -> None:
        """endpoints: Endpoint objects, or texts parse_endpoint reads. topic: the topic vLLM's publisher was
        given (its `topic`, "" by default); messages of another topic are counted and skipped. vocabulary: the
        model's token texts (load_vocabulary), sent first so that views show text. capacity_blocks: the blocks a
        worker holds at most (vLLM's num_gpu_blocks), where known. start: False to subscribe first (a watcher, a
        Recorder) and call start() then."""
        parsed = [e if isinstance(e, Endpoint) else parse_endpoint(e) for e in endpoints]
        if not parsed:
            raise KvscopeError("KV events: no publisher endpoint given (tcp://HOST:5557 for a vLLM worker)")
        pubs = [e.pub for e in parsed]
        twice = sorted({p for p in pubs if pubs.count(p) > 1})
        if twice:
            raise KvscopeError(f"KV events: endpoint {', '.join(twice)} given twice (its sequence numbers would "
                               f"read as gaps)")
        if not isinstance(topic, str):
            raise KvscopeError(f"KV events: topic must be a string, not {type(topic).__name__}")
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
            raise KvscopeError(f"KV events: capacity_blocks must be an integer >= 0, got {capacity_blocks!r}")
        if vocabulary is not None and not isinstance(vocabulary, ev.Vocabulary):
            raise KvscopeError(f"KV events: vocabulary must be an engine.events.Vocabulary (load_vocabulary gives "
                               f"one), not {type(vocabulary).__name__}")
        self.endpoints = tuple(parsed)
        self.topic = topic
        self.vocabulary = vocabulary
        self.capacity_blocks = capacity_blocks
        self.label = "vLLM KV events from " + ", ".join(pubs)
        self.error: Exception | None = None  # what stopped the thread (a bug), if anything did
        self.bus = ev.EventBus()  # subscribe through subscribe(), which keeps the state and the events in step
        self.blocks = BlockMirror()  # every worker's blocks as published so far: the state a late subscriber gets
        self._topic = topic.encode("utf-8")
        self._publishers = [_Publisher(e) for e in parsed]
        self._n_workers = 0
        self._lock = threading.RLock()  # publish, and the state a new subscriber gets: never both at once
        self._status = ev.SessionStatus("attached", 0, WORKLOAD, message=f"watching {self.label}")
        self._last_stats: dict[str, ev.KvEventStats] = {}
        self._stats_at = 0.0
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context | None = None
        self._started = False
        self.bus.add_state_source(self._state_events)
        if start:
            self.start()

    # ---- starting -----------------------------------------------------------------------------------------
    def start(self) -> KvEventSubscriber:
        """Connect to every publisher and begin reading. A subscriber made with start=False lets its watchers
        and recorders subscribe first: they then get every event from the first batch. Returns itself."""
        if self._stop.is_set():
            raise KvscopeError(f"{self.label}: closed")
        if self._thread is not None:
            raise KvscopeError(f"{self.label}: started already")
        ready = threading.Event()
        outcome: list[BaseException | None] = []
        self._thread = threading.Thread(target=self._run, args=(ready, outcome), name="kvscope-kv-events", daemon=True)
        self._thread.start()
        ready.wait()
        if outcome[0] is not None:
            self._thread.join(CLOSE_WAIT_S)
            self._stop.set()
            self._finished.set()
            raise outcome[0]
        lifetime.close_at_exit(self, lifetime.SESSIONS)
        return self

    def _open_sockets(self) -> None:
        self._context = zmq.Context()
        for pub in self._publishers:
            pub.sub = self._socket(zmq.SUB)
            pub.sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            pub.monitor = pub.sub.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            try:
                pub.sub.connect(pub.endpoint.pub)
            except zmq.ZMQError as e:
                raise KvscopeError(f"KV events: cannot connect to {pub.endpoint.pub}: {e}") from None

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        return sock

    # ---- what a watcher reads: subscribe() and current_state(), from WatchedBus --------------------------------
    def _state_events(self) -> list[ev.Event]:
        with self._lock:
            if not self._started:
                return []  # the vocabulary and the first status come with start()
            # copies: the bus stamps the state's seq_no on them, and the originals went out with their own
            events: list[ev.Event] = [] if self.vocabulary is None else [dataclasses.replace(self.vocabulary)]
            events.append(dataclasses.replace(self._status))
            events += [dataclasses.replace(e) for e in self.blocks.state_events()]
            events += [dataclasses.replace(s) for s in self._last_stats.values()]
            return events

    @property
    def status(self) -> ev.SessionStatus:
        """The last SessionStatus published: "attached", then "closed" (or "stopped" when the thread failed)."""
        return self._status

    @property
    def stats(self) -> dict[str, ev.KvEventStats]:
        """Each publisher's counts so far, by its endpoint."""
        return {pub.name: pub.stats() for pub in self._publishers}

    @property
    def started(self) -> bool:
        return self._started

    @property
    def finished(self) -> bool:
        """The thread ended: closed, or stopped by an error (see `error`)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until finished; False on timeout."""
        return self._finished.wait(timeout)

    # ---- the end ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop reading and close the sockets. Waits for the thread; the last KvEventStats of every publisher and
        the final SessionStatus are published before it returns. Idempotent."""
        if self._stop.is_set():
            self._join()
            return
        self._stop.set()
        if not self._started:
            self._status = ev.SessionStatus("closed", 0, WORKLOAD, message=f"{self.label}: closed before it started")
            self._finished.set()
            return
        self._join()
        lifetime.discard(self)

    def _join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT_S)

    def __enter__(self) -> KvEventSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the thread -----------------------------------------------------------------------------------------------
    def _run(self, ready: threading.Event, outcome: list) -> None:
        try:
            self._open_sockets()
        except BaseException as e:  # handed to start(), which raises it on the caller's thread
            self._close_sockets()
            outcome.append(e if isinstance(e, KvscopeError) else KvscopeError(f"KV events: {type(e).__name__}: {e}"))
            ready.set()
            return
        with self._lock:  # the first events, before start() returns and anything else is read
            self._started = True
            if self.vocabulary is not None:
                self.bus.publish(dataclasses.replace(self.vocabulary))
            self.bus.publish(dataclasses.replace(self._status))
        outcome.append(None)
        ready.set()
        try:
            self._read_loop()
        except Exception as e:  # a bug: said on the status line and kept, never a silent stop
            self.error = e
            log.exception("kvscope: reading %s failed", self.label)
            self._set_status("stopped", f"kvscope stopped reading {self.label}: {type(e).__name__}: {e}")
        finally:
            self._close_sockets()
            try:
                self._publish_stats(force=True)
                if self.error is None:
                    self._set_status("closed", f"{self.label}: stopped listening")
            finally:
                self._finished.set()

    def _close_sockets(self) -> None:
        for pub in self._publishers:
            if pub.monitor is not None:
                pub.sub.disable_monitor()
            for sock in (pub.monitor, pub.sub, pub.dealer):
                if sock is not None:
                    sock.close(linger=0)
            pub.sub = pub.monitor = pub.dealer = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        by_socket, by_monitor = {}, {}
        for pub in self._publishers:
            poller.register(pub.sub, zmq.POLLIN)
            poller.register(pub.monitor, zmq.POLLIN)
            by_socket[pub.sub] = pub
            by_monitor[pub.monitor] = pub
        while not self._stop.is_set():
            ready = poller.poll(POLL_MS)
            out: list[ev.Event] = []
            for sock, _ in ready:
                if sock in by_monitor:
                    self._note_connection(by_monitor[sock])
                    continue
                pub = by_socket[sock]
                for _ in range(DRAIN_MESSAGES):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take(pub, frames, out)
            if out:
                self._publish_all(out)
            now = time.monotonic()
            for pub in self._publishers:
                if pub.dropped_at is not None and now - pub.dropped_at >= RECONNECT_GRACE_S:
                    self._reconnect(pub)
            if now - self._stats_at >= STATS_EVERY_S:
                self._publish_stats()

    def _note_connection(self, pub: _Publisher) -> None:
        """ZeroMQ tries again by itself after a network error (CONNECT_RETRIED follows the DISCONNECTED), but never
        after a protocol error, which a message over MAX_MESSAGE_BYTES is: a drop with no retry is noted, and
        _reconnect connects again after RECONNECT_GRACE_S."""
        while pub.monitor.poll(0):
            event = recv_monitor_message(pub.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                pub.dropped_at = time.monotonic()
            else:
                pub.dropped_at = None

    def _reconnect(self, pub: _Publisher) -> None:
        """What was sent meanwhile is a gap, which the replay endpoint fills."""
        pub.dropped_at = None
        try:
            pub.sub.disconnect(pub.endpoint.pub)
        except zmq.ZMQError:
            pass  # the connection is gone for good already
        pub.sub.connect(pub.endpoint.pub)

    def _take(self, pub: _Publisher, frames: list[bytes], out: list[ev.Event]) -> None:
        """One message: its sequence number followed (a gap replayed, a restart cleared), its events into out."""
        if len(frames) != 3 or len(frames[1]) != 8:
            pub.malformed += 1
            return
        topic, seq_bytes, payload = frames
        if self._topic and topic != self._topic:
            pub.other_topics += 1  # ZeroMQ filters by prefix: "kv" lets "kv-other" through
            return
        seq = int.from_bytes(seq_bytes, "big")
        obj = self._unpacked(pub, payload)
        last = pub.last_seq
        if last is not None and seq != last + 1:
            if seq <= last:
                self._restarted(pub, seq, _batch_ts(obj), out)
            else:
                self._recover(pub, last + 1, seq - 1, out)
        pub.last_seq = seq
        if obj is not _NOT_USUAL:
            self._convert(pub, obj, out)

    def _unpacked(self, pub: _Publisher, payload: bytes) -> Any:
        """The payload's msgpack object; _NOT_USUAL (counted) for one that is not msgpack."""
        try:
            return unpack_payload(payload)
        except WireError:
            pub.malformed += 1
            return _NOT_USUAL

    def _convert(self, pub: _Publisher, obj: Any, out: list[ev.Event]) -> bool:
        """A batch's events into out, after a KvWorkerSeen for a worker heard from the first time; counted. False
        (counted as malformed) for one that is not a batch."""
        def worker_of(rank: int | None) -> int:
            worker = pub.workers.get(rank)
            return self._n_workers if worker is None else worker  # a new one's number, taken only if it has events

        try:
            converted = fast_block_events(obj, worker_of)
            if converted is None:
                batch = batch_from_object(obj)
                converted = block_events(worker_of(batch.rank), batch)
        except (WireError, OverflowError):  # OverflowError: token ids beyond int64
            pub.malformed += 1
            return False
        pub.batches += 1
        pub.events += converted.wire_events
        pub.blocks_stored += converted.blocks_stored
        pub.blocks_removed += converted.blocks_removed
        pub.unknown_tags += converted.unknown_tags
        pub.unknown_fields += converted.unknown_fields
        pub.dialect = converted.dialect
        if converted.events and converted.rank not in pub.workers:
            worker = self._n_workers
            self._n_workers += 1
            pub.workers[converted.rank] = worker
            out.append(self._worker_seen(pub, worker, converted))
        out += converted.events
        return True

    def _worker_seen(self, pub: _Publisher, worker: int, converted: Converted) -> ev.KvWorkerSeen:
        where = pub.endpoint.address
        rank = converted.rank
        label = f"worker {worker} ({where})" if rank is None else f"worker {worker} (rank {rank} at {where})"
        return ev.KvWorkerSeen(worker, pub.name, -1 if rank is None else rank, label, self.capacity_blocks,
                               converted.dialect)

    def _restarted(self, pub: _Publisher, seq: int, ts: float, out: list[ev.Event]) -> None:
        """The publisher's numbers went back: a new publisher, which holds nothing the old one said it held."""
        out.append(ev.KvPublisherRestarted(pub.name, pub.last_seq, seq, pub.epochs))
        pub.epochs += 1
        for worker in pub.workers.values():
            out.append(ev.BlocksCleared(worker, ts, cause="publisher restarted"))

    def _recover(self, pub: _Publisher, first: int, last: int, out: list[ev.Event]) -> None:
        """Batches first..last never came: those the replay endpoint still has are applied, in order."""
        count = last - first + 1
        if pub.endpoint.replay is None:
            payloads, reason = {}, "no replay endpoint"
        else:
            payloads, reason = self._ask_replay(pub, first, last)
        replayed: list[ev.Event] = []
        recovered = 0
        for seq in sorted(payloads):
            obj = self._unpacked(pub, payloads[seq])
            if obj is not _NOT_USUAL and self._convert(pub, obj, replayed):
                recovered += 1
        if recovered < count and len(payloads) == count:
            reason = "the replayed batches were not readable"
        pub.replayed += recovered
        pub.lost += count - recovered
        out.append(ev.KvBatchesLost(pub.name, first, last, recovered, "" if recovered == count else reason))
        out += replayed

    def _ask_replay(self, pub: _Publisher, first: int, last: int) -> tuple[dict[int, bytes], str]:
        """The payloads of batches first..last the replay endpoint sends back (vLLM's ZmqEventPublisher: every
        buffered batch from `first` on, then an END_SEQ frame), and why some are missing."""
        sock = pub.dealer
        if sock is None:
            sock = pub.dealer = self._socket(zmq.DEALER)
            sock.connect(pub.endpoint.replay)
        try:
            sock.send_multipart([b"", first.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            self._drop_dealer(pub)
            return {}, "the replay endpoint did not answer"
        payloads: dict[int, bytes] = {}
        deadline = time.monotonic() + REPLAY_WAIT_S
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                self._drop_dealer(pub)
                return payloads, ("the replay endpoint did not answer" if not payloads else
                                  "the replay endpoint stopped answering")
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
                pub.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                return payloads, "the publisher's replay buffer no longer holds them"
            if first <= seq <= last:  # later ones come on the SUB socket as well
                payloads.setdefault(seq, frames[2])

    def _drop_dealer(self, pub: _Publisher) -> None:
        """An answer that comes after the wait would read as the answer to the next request: a new socket then."""
        if pub.dealer is not None:
            pub.dealer.close(linger=0)
            pub.dealer = None

    # ---- publishing -----------------------------------------------------------------------------------------------
    def _publish_all(self, events: Iterable[ev.Event]) -> None:
        events = list(events)
        with self._lock:
            publish = self.bus.publish
            for event in events:
                publish(event)
            self.blocks.apply_all(events)  # after: the mirror keeps the seq_no each BlocksStored was stamped with

    def _set_status(self, state: str, message: str) -> None:
        with self._lock:
            self._status = ev.SessionStatus(state, 0, WORKLOAD, message=message)
            self.bus.publish(dataclasses.replace(self._status))

    def _publish_stats(self, force: bool = False) -> None:
        """A KvEventStats for each publisher whose counts changed (force: for each)."""
        self._stats_at = time.monotonic()
        with self._lock:  # _last_stats is read by _state_events
            out = []
            for pub in self._publishers:
                figures = pub.figures()
                if force or figures != pub.published:
                    pub.published = figures
                    stats = pub.stats()
                    self._last_stats[pub.name] = stats
                    out.append(dataclasses.replace(stats))
            if out:
                self._publish_all(out)
