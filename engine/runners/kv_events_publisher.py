"""kvscope's engine publishing vLLM's KV events over ZeroMQ: a load generator for whatever watches a vLLM or
SGLang deployment's prefix cache (`kvscope serve --kv-events tcp://*:5557`, kvscope's own subscriber, a router).

    publisher = KvEventPublisher(bus, "tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")  # binds now
    publisher.start()             # from here on, every engine event on `bus` that changes blocks is one batch
    ...
    publisher.close()

The cells become hashed blocks in engine/watch/kv_events/block_chains.py; this module puts them on the wire
as vllm/distributed/kv_events.py's ZmqEventPublisher does: a PUB socket sends [topic, seq (8 bytes, big-endian),
payload] per batch, payload one msgpack EventBatch in the chosen layout (engine/watch/kv_events/formats.py),
seq counting from 0; a ROUTER socket, when a replay endpoint is given, answers [client_id, b"", start_seq (8
bytes)] with [client_id, b"", seq, payload] for each batch still buffered from start_seq on (the last
buffer_steps ones), then [client_id, b"", -1 as 8 signed bytes, b""].

Threads: a mapping thread takes the bus's events from a subscription (never inside the decode: the engine
only queues them) and turns them into encoded batches; an I/O thread owns both sockets and hands batches to
PUB, answering replay requests between two. The engine never waits on either: PUB drops what a slow
subscriber cannot take, ROUTER drops replies to a requester that does not read them.

Clients are assumed hostile: a replay request that is not exactly [client_id, b"", 8 bytes] is ignored
(counted), no client can send the ROUTER more than MAX_REQUEST_BYTES (ZeroMQ disconnects it first), and a
reply goes only to the identity that asked. vLLM's wire format has no place for a credential, so there is
no token here: whoever reaches these ports reads every prompt's token ids (a warning says so when an
endpoint listens beyond this machine).
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass

import zmq

from engine import events as ev
from engine.errors import KvscopeError
from engine.watch.kv_events.block_chains import BlockChains
from engine.watch.kv_events.formats import DIALECTS, encode_batch

log = logging.getLogger("kvscope.kv_events")

BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's KVEventsConfig.buffer_steps)
PUB_HWM = 100_000  # messages ZeroMQ queues per subscriber before dropping (vLLM's hwm)
MAX_REQUEST_BYTES = 1024  # a replay request is 8 bytes (and the identity ZeroMQ adds): nobody needs more
MAX_SUBSCRIPTION_BYTES = 256  # what a SUB sends a PUB: its topic prefix
SUBSCRIPTION_QUEUE = 1 << 20  # engine events the mapping may fall behind before the bus drops some (and says so)
CLOSE_WAIT_S = 10.0
FLUSH_MS = 500  # how long the last batches may take to reach connected subscribers once closing
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BATCH, FLUSH, STOP = b"b", b"f", b"s"  # what the mapping thread hands the I/O thread
FLUSH_POLL_S = 0.1  # how long a flush request may wait for the mapping thread to look
LOCAL_HOSTS = ("localhost", "::1", "[::1]")
ENDPOINT = re.compile(r"tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\*|\d{1,5})")
WAKE_EVERY_S = ev.CALLBACK_INTERVAL  # the mapping thread wakes at most this often (see EventBus.subscribe_callback)


@dataclass
class PublisherStats:
    batches: int = 0  # batches sent on PUB (seq of the next one)
    events: int = 0  # BlockStored, BlockRemoved and AllBlocksCleared events in them
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    replay_requests: int = 0  # answered
    replayed_batches: int = 0
    refused_requests: int = 0  # malformed replay requests, ignored
    lost_engine_events: int = 0  # engine events the subscription dropped (every block was cleared then)
    mapping_errors: int = 0  # engine events the mapping failed on (logged; the mapping goes on)


def check_endpoint(endpoint: str, flag: str = "--kv-events") -> tuple[str, str]:
    """(host, port) of a tcp://host:port endpoint; port "*" takes any free one."""
    match = ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if match is None or (match["port"] != "*" and not 1 <= int(match["port"]) <= 65535):
        raise KvscopeError(f"{flag} takes an endpoint tcp://HOST:PORT to listen on, as vLLM's --kv-events-config "
                           f"endpoint (tcp://*:5557: every interface; tcp://127.0.0.1:5557: this machine only; port "
                           f"* takes a free one), got {endpoint!r}")
    return match["host"], match["port"]


def check_options(endpoint: str, replay_endpoint: str | None = None, block_size: int = 16, topic: str = "",
                  dialect: str = "map", buffer_steps: int = BUFFER_STEPS, rank: int | None = None) -> None:
    """Raise what KvEventPublisher would refuse, binding nothing (`kvscope serve` asks before it loads a model)."""
    check_endpoint(endpoint, "--kv-events")
    if replay_endpoint is not None:
        _, port = check_endpoint(replay_endpoint, "--kv-events-replay")
        if replay_endpoint == endpoint and port != "*":
            raise KvscopeError(f"--kv-events-replay must differ from --kv-events (both {endpoint}): the replay "
                               f"socket needs a port of its own")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise KvscopeError(f"--block-size takes the tokens of a block, 1 or more (vLLM's default: 16), got "
                           f"{block_size!r}")
    if not isinstance(topic, str):
        raise KvscopeError(f"--kv-events-topic must be a text, got {topic!r}")
    if dialect not in DIALECTS:
        raise KvscopeError(f"--kv-events-dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
    if not isinstance(buffer_steps, int) or isinstance(buffer_steps, bool) or buffer_steps < 1:
        raise KvscopeError(f"buffer_steps must be 1 or more batches, got {buffer_steps!r}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise KvscopeError(f"rank (the batches' data_parallel_rank) must be None or an integer >= 0, got {rank!r}")


def is_loopback(host: str) -> bool:
    return host in LOCAL_HOSTS or host.startswith("127.")


class KvEventPublisher:
    """vLLM's KV events of the engine on `bus`, over ZeroMQ (see the module docstring)."""

    def __init__(self, bus: ev.EventBus, endpoint: str, replay_endpoint: str | None = None, block_size: int = 16,
                 topic: str = "", dialect: str = "map", buffer_steps: int = BUFFER_STEPS,
                 rank: int | None = None) -> None:
        """Binds both sockets now, so that a taken port fails before a model loads. endpoint, replay_endpoint:
        tcp://HOST:PORT (always bound: vLLM binds a wildcard host and connects to any other, kvscope listens
        either way; port * takes a free one, named by .endpoint and .replay_endpoint). dialect: one of
        formats.DIALECTS ("map", vLLM's current one, sends the 32-byte hashes; array-v1/v2 send their low 64
        bits, as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES does). The map dialect also sends an iSWA pair's
        sliding-window cache as KV cache group 1 (array layouts have no group field and send the full-attention
        cache only). rank: each batch's data_parallel_rank (vLLM sends its DP rank, 0 for one; None leaves it
        out)."""
        check_options(endpoint, replay_endpoint, block_size, topic, dialect, buffer_steps, rank)
        self.chains = BlockChains(block_size, sliding_window_group=dialect == "map")
        self.bus, self.dialect, self.rank = bus, dialect, rank
        self.block_size, self.topic = block_size, topic.encode()
        self.stats = PublisherStats()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._zmq = zmq.Context()
        self._pub = self._router = None
        try:
            self._pub = self._bound(zmq.PUB, endpoint, "--kv-events")
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._router = self._bound(zmq.ROUTER, replay_endpoint, "--kv-events-replay")
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            # Batches go from the mapping thread to the I/O thread, the only one that touches the sockets above;
            # unbounded, so that handing one over never waits.
            address = f"inproc://kvscope-kv-events-{id(self):x}"
            self._inbox = self._zmq.socket(zmq.PULL)
            self._inbox.setsockopt(zmq.RCVHWM, 0)
            self._inbox.bind(address)
            self._outbox = self._zmq.socket(zmq.PUSH)
            self._outbox.setsockopt(zmq.SNDHWM, 0)
            self._outbox.connect(address)
            self._outbox_lock = threading.Lock()  # the mapping thread's, and close()'s should that thread hang
        except BaseException:
            self._zmq.destroy(linger=0)
            raise
        for address in filter(None, (self.endpoint, self.replay_endpoint)):
            host, _ = check_endpoint(address)
            if not is_loopback(host):
                # Said where it matters: vLLM's format carries no credential, so nothing here can ask for one.
                log.warning("kvscope: the KV event stream on %s carries every prompt's token ids, unauthenticated "
                            "and unencrypted, to anyone who connects (vLLM's format has no place for a token); "
                            "listen on 127.0.0.1, or tunnel it (ssh -L), unless this network is trusted", address)
        self._subscription: ev.Subscription | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._flushes: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._flushed: collections.deque[threading.Event] = collections.deque()  # handed to the I/O thread
        self._closed = False

    def _bound(self, kind: int, endpoint: str, flag: str) -> zmq.Socket:
        sock = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, PUB_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
        else:
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            # A whole replay fits a requester's queue; beyond it ROUTER drops, so a client that asks again and
            # again without reading holds at most this many messages here.
            sock.setsockopt(zmq.SNDHWM, (self._buffer.maxlen or BUFFER_STEPS) + 1)
        host, _ = check_endpoint(endpoint, flag)
        if host.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise KvscopeError(f"{flag}: cannot listen on {endpoint} ({e}): another program (a vLLM?) uses that "
                               f"port, or the host is not an address of this machine") from None
        return sock

    # ---- running ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish from now on. The subscription starts from the bus's current state (a cache's cells present
        before now carry no token and make no block: see block_chains.py)."""
        if self._closed:
            raise KvscopeError("this KV event publisher is closed")
        if self._threads:
            raise KvscopeError("this KV event publisher is already started")
        self._subscription = self.bus.subscribe(SUBSCRIPTION_QUEUE, kinds=(ev.CellsChanged, ev.ContextCreated))
        for target, name in ((self._serve, "kvscope-kv-events-io"), (self._map, "kvscope-kv-events-map")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def publishing(self) -> bool:
        return len(self._threads) == 2 and all(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Stop: map what the engine already published, send it, then close the sockets and join the threads."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._subscription is not None:
            self._subscription.close()
        mapper = self._threads[1] if len(self._threads) == 2 else None
        if mapper is not None:
            mapper.join(CLOSE_WAIT_S)
        with self._outbox_lock:
            self._outbox.send(STOP)  # the I/O thread stops after every batch handed over before it
        if self._threads:
            self._threads[0].join(CLOSE_WAIT_S)
        with self._outbox_lock:  # only now: closed at once, it could drop what the I/O thread has not read
            self._outbox.close(linger=0)
        if any(t.is_alive() for t in self._threads):
            log.warning("kvscope: a KV event publisher thread did not stop; its sockets stay open until exit")
            return
        if not self._threads:  # never started: the I/O thread did not close them
            for sock in (self._pub, self._router, self._inbox):
                if sock is not None:
                    sock.close(linger=0)
        self._zmq.term()

    def __enter__(self) -> KvEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def banner(self) -> str:
        replay = f", replay on {self.replay_endpoint}" if self.replay_endpoint else ""
        topic = f", topic {self.topic.decode()!r}" if self.topic else ""
        return (f"KV events (vLLM's, {self.dialect} layout, blocks of {self.block_size} tokens{topic}) on "
                f"{self.endpoint}{replay}")

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every engine event published on the bus before this call is mapped and its batch sent on
        PUB (and buffered for replay); False if that took longer than `timeout` seconds or the publisher is not
        running. What a test or a script driving the engine by hand waits on before it reads the stream."""
        if not self.publishing:
            return False
        done = threading.Event()
        self._flushes.put(done)
        return done.wait(timeout)

    # ---- the mapping thread -----------------------------------------------------------------------------
    def _map(self) -> None:
        sub = self._subscription
        try:
            while True:
                first = sub.get(timeout=FLUSH_POLL_S)
                if first is not None:
                    if not self._stopping.is_set():
                        time.sleep(WAKE_EVERY_S)  # one wake-up per burst, not per event: the decode keeps its cores
                    for event in [first, *sub.drain()]:
                        self._map_one(event)
                self._pass_flushes(sub)
                if first is None and sub.closed:
                    break
        finally:
            self._pass_flushes(sub, closing=True)

    def _pass_flushes(self, sub: ev.Subscription, closing: bool = False) -> None:
        """Hand the flush requests made so far to the I/O thread, behind the batches of every event queued before
        them: taken first, then the queue seen empty, so that nothing offered before a request is still queued
        (nor in hand: this thread maps between two drains)."""
        waiting = []
        while not self._flushes.empty():
            waiting.append(self._flushes.get_nowait())
        if not waiting:
            return
        if sub.pending() and not closing:
            for done in waiting:
                self._flushes.put(done)
            return
        with self._outbox_lock:
            if self._outbox.closed:
                return
            self._flushed.extend(waiting)
            self._outbox.send_multipart([FLUSH, len(waiting).to_bytes(4, "big")])

    def _map_one(self, event: ev.Event) -> None:
        if isinstance(event, ev.EventsDropped):
            self.stats.lost_engine_events += event.count
            log.warning("kvscope: the KV event publisher fell %d engine events behind; every block is cleared and "
                        "comes back as it is decoded again", event.count)
        try:
            wire = self.chains.apply(event)
        except Exception:  # noqa: BLE001 - one event the mapping cannot follow must not stop the stream
            self.stats.mapping_errors += 1
            log.exception("kvscope: the KV event mapping failed on %s #%d; its blocks are cleared", event.kind,
                          event.seq_no)
            wire = self.chains.apply(ev.EventsDropped(1, event.seq_no, event.seq_no))
        if not wire:
            return
        payload = encode_batch(time.time(), wire, self.rank, self.dialect)
        with self._outbox_lock:
            if self._outbox.closed:
                return
            self._outbox.send_multipart([BATCH, payload], copy=False)
        self.stats.events += len(wire)
        for w in wire:
            if w.tag == "BlockStored":
                self.stats.blocks_stored += len(w.block_hashes)
            elif w.tag == "BlockRemoved":
                self.stats.blocks_removed += len(w.block_hashes)
            else:
                self.stats.clears += 1

    # ---- the I/O thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        try:
            running = True
            while running:
                ready = dict(poller.poll(500))
                if self._router is not None and self._router in ready:
                    self._answer_requests()
                if self._inbox in ready:
                    running = self._send_batches()
        except Exception:  # noqa: BLE001 - logged; subscribers then hear nothing more
            log.exception("kvscope: the KV event publisher's I/O thread failed")
        finally:
            self._pub.close(linger=FLUSH_MS)
            for sock in (self._router, self._inbox):
                if sock is not None:
                    sock.close(linger=0)

    def _send_batches(self) -> bool:
        """Send what the mapping handed over; False once told to stop."""
        for _ in range(1000):  # then the replay socket gets its turn
            try:
                frames = self._inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames[0] == STOP:
                return False
            if frames[0] == FLUSH:  # the requests handed over with it (later ones may be queued behind it)
                for _ in range(int.from_bytes(frames[1], "big")):
                    self._flushed.popleft().set()
                continue
            payload = frames[1]
            seq = self.stats.batches
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self.stats.batches = seq + 1
        return True

    def _answer_requests(self) -> None:
        for _ in range(100):  # a flood of requests must not keep batches waiting
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats.refused_requests += 1
                log.debug("kvscope: ignored a replay request of %d frames (sizes %s): a request is [b\"\", start "
                          "sequence number as 8 bytes] from a DEALER or REQ socket", len(frames),
                          [len(f) for f in frames[:4]])
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            self.stats.replay_requests += 1
            first = self._buffer[0][0] if self._buffer else 0
            for seq, payload in itertools.islice(self._buffer, max(0, start - first), None):
                self._router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload], copy=False)
                self.stats.replayed_batches += 1
            self._router.send_multipart([client, b"", END_SEQ, b""])
