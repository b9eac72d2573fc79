"""A KV event publisher for tests, behaving like vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py): a PUB
socket that sends [topic, seq (8 bytes, big-endian), payload] and a ROUTER replay socket that answers [b"", first
seq] with [b"", seq, payload] for each buffered batch from `first` on, then [b"", -1 (8 bytes, signed), b""].

It writes any layout of engine/watch/kv_events/formats.py and keeps its own truth (`held`: the blocks it said
each rank holds), with hooks for what a real deployment does to a subscriber: a batch sent into the buffer but
not on the wire (lost), a buffer too small to replay it, a restart (sequence numbers from 0 again, nothing
held), raw frames, and fields and event tags from a future version.

The PUB socket is an XPUB (the same on the wire) so that a test can wait until a subscriber's subscription has
arrived, rather than sleep: ZeroMQ drops what a PUB sends before a subscriber is connected."""
from __future__ import annotations

import collections
import socket
import threading
import time
from typing import Any, Callable

import msgpack
import zmq

from engine import events as ev
from engine.watch.kv_events.formats import CLEARED, REMOVED, STORED, WireEvent, encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port nothing listens on now (for an endpoint that must not answer)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def stored(hashes: list, parent=None, *, block_size: int = 4, tokens: list[int] | None = None, **fields) -> WireEvent:
    """A BlockStored of `hashes` (bytes, or integers as the older layouts carry them); tokens default to a
    pattern derived from each block's position, block_size per block."""
    from engine.watch.kv_events.formats import hash_bytes

    if tokens is None:
        tokens = [(i * 7 + 3) % 50000 for i in range(len(hashes) * block_size)]
    return WireEvent(STORED, tuple(hash_bytes(h) for h in hashes), None if parent is None else hash_bytes(parent),
                     tuple(tokens), block_size, **fields)


def removed(hashes: list, **fields) -> WireEvent:
    from engine.watch.kv_events.formats import hash_bytes

    return WireEvent(REMOVED, tuple(hash_bytes(h) for h in hashes), **fields)


def cleared() -> WireEvent:
    return WireEvent(CLEARED)


def bind(sock: zmq.Socket, port: int | None, timeout: float = 10.0) -> int:
    """Bind to `port` (waiting while the socket that had it lets it go), or to a free port; the port."""
    if port is None:
        return sock.bind_to_random_port(f"tcp://{HOST}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.bind(f"tcp://{HOST}:{port}")
            return port
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class KvEventsPublisher:
    """Bound to 127.0.0.1 on free ports; `spec` is what `kvscope attach --vllm` takes for it."""

    def __init__(self, dialect: str = "map", *, topic: str = "", rank: int | None = None, replay: bool = True,
                 buffer_steps: int = 10_000, clock: Callable[[], float] = time.time, port: int | None = None,
                 replay_port: int | None = None) -> None:
        """port, replay_port: where to bind (a restarted publisher binds where the old one was); default: free ones."""
        self.dialect, self.rank, self.clock = dialect, rank, clock
        self.topic = topic.encode()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription is told, a second subscriber's too
        self.pub.setsockopt(zmq.SNDHWM, 0)  # a fast test publisher must not drop what it means to send
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{HOST}:{bind(self.pub, port)}"
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.buffer_lock = threading.Lock()
        self.next_seq = 0
        self.subscriptions = 0
        # the truth: rank -> (medium, group) -> hash -> token ids
        self.held: dict[int | None, dict[tuple[str, int], dict[bytes, tuple[int, ...]]]] = {}
        self.replay_requests: list[int] = []
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._replay_thread = None
        if replay:
            router = self.context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = f"tcp://{HOST}:{bind(router, replay_port)}"
            self._replay_thread = threading.Thread(target=self._serve_replay, args=(router,), daemon=True)
            self._replay_thread.start()

    @property
    def spec(self) -> str:
        return self.endpoint if self.replay_endpoint is None else f"{self.endpoint},{self.replay_endpoint}"

    # ---- subscribers ---------------------------------------------------------------------------------------------
    def wait_for_subscribers(self, n: int = 1, timeout: float = 10.0) -> None:
        """Until n subscriptions arrived in all (what the XPUB reads from its subscribers)."""
        deadline = time.monotonic() + timeout
        while self.subscriptions < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no subscriber on {self.endpoint} after {timeout} s")
            if self.pub.poll(int(left * 1000) + 1):
                message = self.pub.recv()
                if message[:1] == b"\x01":
                    self.subscriptions += 1

    # ---- sending ----------------------------------------------------------------------------------------------------
    def send(self, events: list[WireEvent], *, rank: int | None | str = "default", lose: bool = False,
             mutate: Callable[[Any], Any] | None = None, ts: float | None = None) -> int:
        """One batch; returns its sequence number. lose: buffered for replay and never sent (a batch the network
        dropped). mutate: changes the batch as msgpack objects before it is packed (unknown fields and tags)."""
        rank = self.rank if rank == "default" else rank
        payload = encode_batch(self.clock() if ts is None else ts, events, rank, self.dialect)
        if mutate is not None:
            payload = msgpack.packb(mutate(msgpack.unpackb(payload, raw=False)), use_bin_type=True)
        self._note(events, rank)
        return self.send_payload(payload, lose=lose)

    def send_payload(self, payload: bytes, *, lose: bool = False) -> int:
        """Any payload, with the next sequence number (and into the replay buffer)."""
        seq = self.next_seq
        self.next_seq += 1
        with self.buffer_lock:
            self.buffer.append((seq, payload))
        if not lose:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Frames as they are: no sequence number is used."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """What a restarted vLLM looks like on the wire: numbers from 0 again, an empty buffer, nothing held."""
        self.next_seq = 0
        with self.buffer_lock:
            self.buffer.clear()
        self.held.clear()

    def _note(self, events: list[WireEvent], rank: int | None) -> None:
        tiers = self.held.setdefault(rank, {})
        for e in events:
            if e.tag == CLEARED:
                tiers.clear()
                continue
            tier = tiers.setdefault((e.medium or ev.MEDIUM_GPU, e.group_idx or 0), {})
            if e.tag == REMOVED:
                for h in e.block_hashes:
                    tier.pop(h, None)
                continue
            for k, h in enumerate(e.block_hashes):
                tier[h] = tuple(e.token_ids[k * e.block_size:(k + 1) * e.block_size])

    def held_blocks(self, rank: int | None = "default") -> dict[tuple[str, int], dict[bytes, tuple[int, ...]]]:
        rank = self.rank if rank == "default" else rank
        return {tier: dict(blocks) for tier, blocks in self.held.get(rank, {}).items() if blocks}

    # ---- replay ---------------------------------------------------------------------------------------------------
    def _serve_replay(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                self.replay_requests.append(first)
                with self.buffer_lock:
                    buffered = [(seq, payload) for seq, payload in self.buffer if seq >= first]
                for seq, payload in buffered:
                    router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(5)
        self.pub.close(linger=0)
        self.context.term()

    def __enter__(self) -> KvEventsPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- batches from a future version ------------------------------------------------------------------------------------
def with_unknown_fields(batch: Any) -> Any:
    """Every event and the batch gain a field kvscope does not know: a map key, or an array position past the
    known ones (as a newer vLLM appends them)."""
    if isinstance(batch, dict):
        for event in batch["events"]:
            event["block_mm_hashes_v9"] = [1, 2]
        batch["engine_id"] = "e0"
        return batch
    for event in batch[1]:
        if event[0] == STORED:
            event.extend([None] * (9 - len(event)) + ["from the future"])  # past extra_keys
        elif event[0] == REMOVED:
            event.extend([None] * (3 - len(event)) + ["from the future"])  # past medium
    while len(batch) < 3:
        batch.append(None)
    batch.append("engine e0")
    return batch


def with_unknown_tag(batch: Any) -> Any:
    """A BlockTouched event (a kind kvscope does not know) before the others."""
    if isinstance(batch, dict):
        batch["events"].insert(0, {"type": "BlockTouched", "block_hashes": [b"\x01" * 8]})
    else:
        batch[1].insert(0, ["BlockTouched", [1]])
    return batch
