"""RemoteSession: a Session served by `kvscope serve` on another machine or process, driven over ZeroMQ.
Torch-free: a front-end on a laptop uses it without the engine or its weights.

    remote = RemoteSession("tcp://gpu-box:5590", token="...")   # what `kvscope serve` printed
    watcher = Watcher.of(remote)          # the server's state first, then every event
    remote.add_prompt("And God said").result()
    remote.start()
    ...
    remote.close()                        # the server goes on serving its other clients

Commands return Futures, as Session's do; a command's error is the server's, rebuilt as the same class
where this side has it (kvscope's errors, Python's built-ins; RemoteCommandError otherwise). A command
fails with RemoteSessionError ("no answer from tcp://...: the server is gone or busy") when the server
stays silent (no reply, no heartbeat) for `timeout` seconds, or when the connection closes while it is
pending (it may or may not have run then). status() never waits: it is the last status the server sent
(with every reply and in its heartbeats), with state "disconnected" while the server is silent.

The client reconnects by itself. A server that comes back on the same address is another one: its seq_no
count starts again, so this side renumbers its events after the highest it has seen (seq_no keep growing
for a watcher), and every subscription gets an EventsDropped notice, on which a Watcher rebuilds from the
new server's state. Subscriptions also get a SessionStatus "disconnected" when the server goes silent,
and the server's own status when it answers again.

Threads: the caller's, and one I/O thread that owns the sockets, sends commands, decodes events into the
subscriptions (bounded queues that count what they drop, as engine.events.Subscription) and resolves
the Futures. Callbacks added to those Futures run on the I/O thread: they must not wait for another
command's result. The wire protocol: engine/watch/protocol.py.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine import events as ev
from engine.watch import lifetime
from engine.watch.codec import CodecError, decode_event
from engine.watch.protocol import (
    DEFAULT_PORT,
    DISCONNECTED_AFTER,
    EVENT_PREFIX,
    HEARTBEAT_PREFIX,
    PROTOCOL_VERSION,
    TOPIC_EVENTS,
    TOPIC_HEARTBEAT,
    TOPIC_MARKER,
    PathRefusedError,
    RemoteAccessError,
    RemoteCommandError,
    RemoteSessionError,
    Status,
    StepOutcome,
    drain,
    pack_value,
    rebuild_error,
    token_from_environment,
    unpack_value,
)

__all__ = ["PathRefusedError", "RemoteAccessError", "RemoteCommandError", "RemoteSession", "RemoteSessionError",
           "RemoteSubscription", "Status", "StepOutcome"]

log = logging.getLogger("kvscope.remote")

DEFAULT_TIMEOUT = 10.0
TICK = 0.05  # seconds between two looks at the clock (timeouts, heartbeats, sync retries)
SYNC_RETRY = 0.1  # seconds before a sync marker that did not come is asked for again
UNKNOWN = Status("disconnected", 0, "", 0.0, "", {})


@dataclass
class _Pending:
    """A request, from the moment it is queued until its answer (or its failure)."""

    id: int
    cmd: str
    body: bytes
    done: Callable[[Any, BaseException | None], None]
    created: float
    sent_at: float = 0.0


class RemoteSubscription(ev.Subscription):
    """engine.events.Subscription fed by a RemoteSession's I/O thread. Until the state it starts from has
    come, what arrives is held back, so that the state comes first and nothing it holds comes twice."""

    def __init__(self, link: _Link, maxsize: int, kinds: tuple[type, ...] | None) -> None:
        super().__init__(link, maxsize, kinds)  # close() asks the link to stop feeding it
        self._held: list[tuple[str, Any]] | None = []

    def _push(self, op: str, item: Any) -> None:
        if self._held is not None:
            self._held.append((op, item))
        else:
            self._apply(op, item)

    def _apply(self, op: str, item: Any) -> None:
        if op == "event" or op == "status":
            self._offer(item)
        elif op == "missed":
            self._note_missed(*item)
        else:
            self._notice(item)

    def _release(self, state: list[ev.Event]) -> None:
        """The state first, then what was held and is newer than it."""
        for event in state:
            self._offer(event)
        upto = max((e.seq_no for e in state), default=None)
        held, self._held = self._held or [], None
        for op, item in held:
            if upto is not None and ((op == "event" and item.seq_no <= upto) or (op == "missed" and item[2] <= upto)):
                continue
            self._apply(op, item)

    def _note_missed(self, count: int, first: int, last: int) -> None:
        """Events lost on the way: counted as a full queue counts its own, and told with the next event."""
        with self._cond:
            self.dropped += count
            self._missed += count
            if self._missed_first < 0:
                self._missed_first = first
            self._missed_last = last

    def _notice(self, event: ev.Event) -> None:
        """A notice made by this side rides beyond maxsize, as the bus's own EventsDropped does."""
        with self._cond:
            self._queue.append(event)
            self._cond.notify()

    def _end(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class RemoteSession:
    """The Session API over the network (see the module docstring)."""

    def __init__(self, address: str = f"tcp://127.0.0.1:{DEFAULT_PORT}", *, token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        """address: the command address `kvscope serve` printed (events come from the port after it);
        token: the one it printed (None: the KVSCOPE_TOKEN environment variable's, if set); timeout: seconds
        of silence from the server after which a command fails."""
        host, port = parse_address(address)
        if token is not None and not isinstance(token, str):
            raise RemoteSessionError(f"token must be a str (what `kvscope serve` printed), got {type(token).__name__}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise RemoteSessionError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.address = f"tcp://{host}:{port}"
        self.events_address = f"tcp://{host}:{port + 1}"
        self.token = token if token is not None else token_from_environment()
        self.timeout = float(timeout)
        self._ids = itertools.count(1)
        self._link = _Link(self.address, self.events_address, float(timeout), self._request_body)
        lifetime.close_at_exit(self, lifetime.SESSIONS)

    # ---- what a front-end reads ------------------------------------------------------------------
    def status(self) -> Status:
        """The server's status as it last sent it; state "disconnected" while it is silent. Never waits."""
        return self._link.current_status()

    @property
    def connected(self) -> bool:
        return self._link.connected

    @property
    def disconnect_reason(self) -> str:
        """Why the server counts as disconnected ("" while it answers)."""
        return "" if self._link.connected else self._link.why

    def subscribe(self, maxsize: int = 65536, kinds: tuple[type, ...] | None = None) -> RemoteSubscription:
        """A watcher's subscription: the server's current state first, then every event. Raises
        RemoteSessionError when the server does not answer."""
        sub = RemoteSubscription(self._link, maxsize, kinds)
        self._link.run(lambda: self._link.add(sub))
        try:
            state = self.current_state()
            self._wait(self._link.run_future(lambda: sub._release(state)), "subscribe")
        except BaseException:
            sub.close()
            raise
        return sub

    def current_state(self) -> list[ev.Event]:
        """Session.current_state of the server: its state as events, stamped with the last event it published
        before them, in this client's seq_no count. Every event a subscription gets afterwards is newer."""
        self._check_open("current_state")
        future: Future = Future()
        self._link.run(lambda: self._link.fetch_state(_resolver(future)))
        return self._wait(future, "current_state")

    def estimate(self, **settings) -> dict:
        """What the server's context would hold per device with these settings (Estimate.to_dict(): the
        Estimate object holds the engine's own types)."""
        return self._wait(self._call("estimate", **settings), "estimate")

    def engine_cells(self) -> Future:
        """The cells and head of every stream of every cache as the engine itself reads them, between two
        steps: {cache name: {"cells": [[(pos, seq ids, shift), ...] per stream], "heads": [...]}}. For
        checking a watcher against the engine."""
        return self._call("engine_cells")

    # ---- running -----------------------------------------------------------------------------------
    def start(self) -> Future:
        return self._call("start")

    def pause(self) -> Future:
        return self._call("pause")

    def stop(self) -> Future:
        return self._call("stop")

    def step(self, n: int = 1) -> Future:
        """The Future gives a list of StepOutcome (engine.watch.protocol's, with the engine's fields)."""
        return self._call("step", n)

    def set_speed(self, steps_per_second: float) -> Future:
        return self._call("set_speed", steps_per_second)

    # ---- the workload ------------------------------------------------------------------------------
    def add_prompt(self, text: str, n_predict: int | None = None) -> Future:
        return self._call("add_prompt", text, n_predict)

    def set_workload(self, workload, **options) -> Future:
        """workload: "idle", "generate", "parallel", or a WorkloadSpec; options as WorkloadSpec's fields
        (sampler: a SamplerParams or a map of its fields)."""
        return self._call("set_workload", workload, **options)

    # ---- sequence operations -----------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> Future:
        return self._call("seq_rm", seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> Future:
        return self._call("seq_cp", src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> Future:
        return self._call("seq_keep", seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> Future:
        return self._call("seq_add", seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> Future:
        return self._call("seq_div", seq_id, p0, p1, d)

    def clear(self, data: bool = True) -> Future:
        return self._call("clear", data)

    def context_shift(self, seq_id: int, n_keep: int = 0, n_discard: int | None = None) -> Future:
        return self._call("context_shift", seq_id, n_keep, n_discard)

    # ---- settings, model, state (paths are the server machine's) -------------------------------------
    def rebuild(self, **settings) -> Future:
        return self._call("rebuild", **settings)

    def load_model(self, path, dtype: str = "f32", **settings) -> Future:
        return self._call("load_model", path, dtype, **settings)

    def save_state(self, path=None, seq_id: int | None = None) -> Future:
        """path None: the Future gives the state's bytes (sent over); else the size of the file written
        on the server's machine."""
        return self._call("save_state", path, seq_id)

    def load_state(self, source, seq_id: int | None = None) -> Future:
        """source: state bytes (sent over), or a file path on the server's machine."""
        return self._call("load_state", source, seq_id)

    def close(self) -> None:
        """Disconnect (the server goes on); pending commands fail, subscriptions end."""
        self._link.close()
        lifetime.discard(self)

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteSession({self.address!r}, {'connected' if self.connected else 'disconnected'})"

    # ---- plumbing ------------------------------------------------------------------------------------
    def _call(self, cmd: str, *args, **kwargs) -> Future:
        self._check_open(cmd)
        future: Future = Future()
        req_id, body = self._request_body(cmd, [_plain(a) for a in args], {k: _plain(v) for k, v in kwargs.items()})
        limit = self._link.max_message_bytes
        if limit is not None and len(body) > limit:  # the server's ZeroMQ would drop the connection instead
            future.set_exception(RemoteSessionError(
                f"{cmd}: the request is {len(body)} bytes; the server at {self.address} takes messages of at most "
                f"{limit} bytes (a state of that size: save it in the server's state folder and load it by name)"))
            return future
        self._link.run(lambda: self._link.send(req_id, cmd, body, _resolver(future)))
        return future

    def _request_body(self, cmd: str, args: list, kwargs: dict) -> tuple[int, bytes]:
        req_id = next(self._ids)
        return req_id, pack_value({"v": PROTOCOL_VERSION, "id": req_id, "token": self.token, "cmd": cmd,
                                   "args": args, "kwargs": kwargs})

    def _check_open(self, cmd: str) -> None:
        if self._link.closed:
            raise RemoteSessionError(f"{cmd}: this RemoteSession is closed; make a new one to reconnect")

    def _wait(self, future: Future, cmd: str):
        """The Future's result; the link resolves every Future (an answer, an error, or its timeout)."""
        while True:
            try:
                return future.result(timeout=1.0)
            except FutureTimeout:
                if not self._link.alive:
                    raise RemoteSessionError(f"{cmd}: this RemoteSession is closed") from None


def _resolver(future: Future) -> Callable[[Any, BaseException | None], None]:
    def done(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled by its caller
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    return done


def _plain(value: Any) -> Any:
    """A WorkloadSpec or SamplerParams (when this side has the engine) as the map of its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def parse_address(address: str) -> tuple[str, int]:
    """("host", port) of "tcp://host:port"."""
    hint = f"expected tcp://HOST:PORT, as `kvscope serve` prints it (e.g. tcp://127.0.0.1:{DEFAULT_PORT})"
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise RemoteSessionError(f"{hint}, got {address!r}")
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise RemoteSessionError(f"{hint}, got {address!r}")
    return host, int(port)


class _Link:
    """The I/O thread and everything it owns. Methods not marked otherwise run on that thread only."""

    def __init__(self, address: str, events_address: str, timeout: float,
                 make_body: Callable[[str, list, dict], tuple[int, bytes]]) -> None:
        """make_body(cmd, args, kwargs): a request's id and bytes (the session's, with its token)."""
        self.address, self.events_address, self.timeout = address, events_address, timeout
        self._make_body = make_body
        self._zmq = zmq.Context()
        ipv6 = address.startswith("tcp://[")
        self._dealer = self._socket(zmq.DEALER, ipv6)
        self._dealer.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a server not (yet) connected: see _send
        self._dealer.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # a vanished server machine is noticed, not waited for
        self._dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        self._monitor = self._dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._dealer.connect(address)
        self._sub = self._socket(zmq.SUB, ipv6)
        self._sub.setsockopt(zmq.SUBSCRIBE, HEARTBEAT_PREFIX)
        self._sub.connect(events_address)
        wake_address = f"inproc://kvscope-remote-{os.urandom(6).hex()}"
        self._wake_in = self._zmq.socket(zmq.PULL)
        self._wake_in.bind(wake_address)
        self._wake_out = self._zmq.socket(zmq.PUSH)
        self._wake_out.setsockopt(zmq.SNDHWM, 0)
        self._wake_out.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._subs_lock = threading.Lock()
        self.subs: tuple[RemoteSubscription, ...] = ()
        self._unsent: collections.deque[_Pending] = collections.deque()
        self._pending: dict[int, _Pending] = {}
        # what the server said
        self.instance: bytes | None = None
        self._retired: set[bytes] = set()
        self.connected = self._ever_connected = False
        self.why = f"no answer from {address} yet"
        self.last_contact = 0.0
        self._status: Status | None = None
        self._stamp = -1
        self._announce = False  # tell the subscriptions the server's status when it next comes
        self.max_message_bytes: int | None = None  # the largest command the server takes, from its heartbeats
        # the event stream
        self._events_on = False
        self._synced: bytes | None = None  # the server whose sync marker came: its events all reach us
        self._sync_nonce: bytes | None = None
        self._sync_deadline = self._sync_next = 0.0
        self._sync_in_flight = False
        self._sync_waiters: list[Callable[[BaseException | None], None]] = []
        self._offset = 0  # added to the seq_no of the current server's events
        self._seq_high = -1
        self._next_raw: int | None = None  # the seq_no the next event of the server should have
        self.closed = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvscope-remote", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, ipv6: bool) -> zmq.Socket:
        sock = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)  # back within half a second of a restart
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    # ---- called from any thread -----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, call: Callable[[], None]) -> None:
        """Run `call` on the I/O thread, after every call queued before it."""
        self._calls.put(call)
        with self._wake_lock:
            if not self.closed:
                self._wake_out.send(b"", zmq.NOBLOCK)

    def run_future(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()

        def wrapped() -> None:
            try:
                future.set_result(call())
            except Exception as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)
        self.run(wrapped)
        return future

    def current_status(self) -> Status:
        status = self._status or UNKNOWN
        return status if self.connected else dataclasses.replace(status, state="disconnected")

    def _remove(self, sub: RemoteSubscription) -> None:
        """Subscription.close() calls this (as it calls the bus's)."""
        with self._subs_lock:
            self.subs = tuple(s for s in self.subs if s is not sub)

    def close(self) -> None:
        if self.closed:
            return
        self._stopping = True
        try:
            self.run(lambda: None)  # wakes the I/O thread from its poll
        except zmq.Again:  # it saw _stopping at a poll's timeout and closed its end of the wake pipe
            pass
        self._thread.join(timeout=10)
        with self._wake_lock:
            self.closed = True
            self._wake_out.close(linger=0)
        for sub in self.subs:
            sub._end()
        if not self._thread.is_alive():
            self._zmq.term()

    # ---- the I/O thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self._wake_in, self._sub, self._monitor, self._dealer):
            poller.register(sock, zmq.POLLIN)
        writing = False
        while not self._stopping:
            if writing != bool(self._unsent):  # wait for room to send only while something waits
                writing = bool(self._unsent)
                poller.modify(self._dealer, zmq.POLLIN | (zmq.POLLOUT if writing else 0))
            ready = dict(poller.poll(TICK * 1000))
            try:
                self._turn(ready)
            except Exception:  # noqa: BLE001 - a bug here must not end the thread that resolves every Future
                log.exception("kvscope remote: the I/O thread failed on a message; it goes on")
        self._shut()

    def _turn(self, ready: dict) -> None:
        if self._wake_in in ready:
            drain(self._wake_in, lambda _frames: None, "kvscope remote")
            while True:
                try:
                    call = self._calls.get_nowait()
                except queue.Empty:
                    break
                call()
        if self._monitor in ready:
            self._on_monitor()
        if self._dealer in ready:
            drain(self._dealer, self._on_reply, "kvscope remote")
        self._flush()
        if self._sub in ready:
            drain(self._sub, self._on_broadcast, "kvscope remote")
        self._check_clock(time.monotonic())

    def _shut(self) -> None:
        error = RemoteSessionError(f"the RemoteSession of {self.address} was closed")
        while True:  # calls queued before the close still resolve their Futures (send() fails them)
            try:
                self._calls.get_nowait()()
            except queue.Empty:
                break
            except Exception:  # noqa: BLE001 - closing goes on
                log.exception("kvscope remote: a call failed while closing")
        for pending in [*self._unsent, *self._pending.values()]:
            pending.done(None, error)
        self._unsent.clear()
        self._pending.clear()
        self._sync_done(error)
        self._dealer.disable_monitor()
        for sock in (self._monitor, self._dealer, self._sub, self._wake_in):
            sock.close(linger=0)

    # ---- commands ------------------------------------------------------------------------------------
    def send(self, req_id: int, cmd: str, body: bytes, done: Callable[[Any, BaseException | None], None]) -> None:
        if self._stopping:
            done(None, RemoteSessionError(f"{cmd}: the RemoteSession of {self.address} was closed"))
            return
        self._unsent.append(_Pending(req_id, cmd, body, done, time.monotonic()))
        self._flush()

    def _flush(self) -> None:
        """Send what waits, in order. IMMEDIATE: with no server connected, nothing is queued inside ZeroMQ,
        where a restarted server would get commands meant for the old one."""
        while self._unsent:
            pending = self._unsent[0]
            try:
                self._dealer.send(pending.body, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unsent.popleft()
            pending.sent_at = time.monotonic()
            self._pending[pending.id] = pending

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("kvscope remote: a reply of %d frames from %s, not 2: ignored", len(frames), self.address)
            return
        header = unpack_value(frames[0])
        if not self._compatible(header):
            pending = self._pending.pop(header.get("id"), None)
            if pending is not None:
                pending.done(None, self._incompatible(header))
            return
        if not self._heard(header["instance"]):
            return
        if header["status"] is not None:
            self._take_status(header["status"], header["stamp"])
        pending = self._pending.pop(header["id"], None)
        if pending is None:
            return  # failed already (timed out), or an answer to a repeated sync
        if header["ok"]:
            pending.done(unpack_value(frames[1]), None)
        else:
            pending.done(None, rebuild_error(*header["error"]))

    def _on_monitor(self) -> None:
        while True:
            try:
                message = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if message["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for pending in self._pending.values():
                pending.done(None, RemoteSessionError(
                    f"no answer from {self.address}: the server is gone or busy (the connection closed while "
                    f"{pending.cmd} was pending; it may or may not have run)"))
            self._pending.clear()
            self._sync_in_flight = False
            self._lost(f"the connection to {self.address} closed")

    def _check_clock(self, now: float) -> None:
        if self.connected and now - self.last_contact > DISCONNECTED_AFTER:
            self._lost(f"no heartbeat from {self.events_address} for {DISCONNECTED_AFTER:g} s")
        late = [p for p in self._pending.values() if now - max(p.sent_at, self.last_contact) > self.timeout]
        for pending in late:
            del self._pending[pending.id]
            pending.done(None, RemoteSessionError(
                f"no answer from {self.address}: the server is gone or busy (silent for {self.timeout:g} s while "
                f"{pending.cmd} was pending)"))
        while self._unsent and now - self._unsent[0].created > self.timeout:
            pending = self._unsent.popleft()
            pending.done(None, RemoteSessionError(
                f"no answer from {self.address}: the server is gone or busy (no connection for {self.timeout:g} s; "
                f"is `kvscope serve` running there, with --port {self.address.rsplit(':', 1)[1]}?)"))
        if self._sync_nonce is not None:
            if now > self._sync_deadline:
                self._sync_done(RemoteSessionError(
                    f"no answer on the event stream {self.events_address} for {self.timeout:g} s: the server is gone "
                    f"or busy, or that port is not reachable from here"))
            elif not self._sync_in_flight and now >= self._sync_next:
                self._send_sync()

    # ---- what the server says ---------------------------------------------------------------------------
    def _compatible(self, message: dict) -> bool:
        return isinstance(message, dict) and message.get("v") == PROTOCOL_VERSION

    def _incompatible(self, message) -> RemoteSessionError:
        version = message.get("v") if isinstance(message, dict) else None
        return RemoteSessionError(f"the server at {self.address} speaks kvscope protocol {version}, this client "
                                  f"{PROTOCOL_VERSION}: install the same kvscope version on both machines")

    def _heard(self, instance: bytes) -> bool:
        """Note a message of server `instance`; False for a server that was replaced since."""
        if instance in self._retired:
            return False
        self.last_contact = time.monotonic()
        if instance != self.instance:
            if self.instance is not None:
                self._restarted()
            self.instance, self._next_raw, self._stamp = instance, None, -1
        if not self.connected:
            # told only when it comes back: a first connection has nothing to correct
            self._announce = self._ever_connected
            self.connected, self.why, self._ever_connected = True, "", True
        return True

    def _restarted(self) -> None:
        """Another server answers on the address: number its events after every one seen so far, and tell
        each subscription that what it holds is gone."""
        self._retired.add(self.instance)
        self._offset = self._seq_high = self._seq_high + 1
        notice = ev.EventsDropped(0, self._offset, self._offset)
        object.__setattr__(notice, "seq_no", self._offset)
        object.__setattr__(notice, "time", time.monotonic())
        self._to_subs("notice", notice)

    def _take_status(self, status: Status, stamp: int) -> None:
        if stamp <= self._stamp:
            return  # an older status that came by the other socket
        self._stamp, self._status = stamp, status
        if self._announce:
            self._announce = False
            self._status_event(status.state, f"connected to {self.address}")

    def _lost(self, why: str) -> None:
        self.why = why
        if self.connected:
            self.connected = False
            self._status_event("disconnected", why)

    def _status_event(self, state: str, message: str) -> None:
        """A SessionStatus made here, stamped as the bus stamps its notices: with the seq_no the next event
        will have."""
        self._to_subs("status", self._stamped_status(self._seq_high + 1, state, message))

    def _stamped_status(self, seq_no: int, state: str | None = None, message: str = "") -> ev.SessionStatus:
        """A SessionStatus of the server's last status (or `state`), made on this side."""
        last = self._status or UNKNOWN
        event = ev.SessionStatus(state or last.state, last.step, last.workload, last.steps_per_second, message)
        object.__setattr__(event, "seq_no", seq_no)
        object.__setattr__(event, "time", time.monotonic())
        return event

    def _on_broadcast(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            return
        topic, instance = frames[0], frames[1]
        if topic == TOPIC_HEARTBEAT:
            beat = unpack_value(frames[2])
            if not self._compatible(beat):
                self._lost(str(self._incompatible(beat)))
            elif beat["closing"]:
                if instance == self.instance:
                    self._lost(f"the server at {self.address} stopped")
            elif self._heard(instance):
                self.max_message_bytes = beat.get("max_message_bytes")
                self._take_status(beat["status"], beat["stamp"])
                self._check_tail(beat["last_seq"])
        elif topic == TOPIC_MARKER:
            if self._heard(instance) and frames[2] == self._sync_nonce:
                self._synced = instance
                self._sync_done(None)
        elif topic == TOPIC_EVENTS and self._heard(instance):
            for data in frames[2:]:
                try:
                    event = decode_event(data)
                except CodecError:  # an event of a newer kvscope: the gap in seq_no makes watchers resync
                    log.exception("kvscope remote: an event from %s cannot be read; skipped", self.events_address)
                    continue
                self._on_event(event)

    # ---- events ----------------------------------------------------------------------------------------
    def add(self, sub: RemoteSubscription) -> None:
        with self._subs_lock:
            self.subs = (*self.subs, sub)
        if not self._events_on:
            self._sub.setsockopt(zmq.SUBSCRIBE, EVENT_PREFIX)
            self._events_on = True

    def _to_subs(self, op: str, item: Any) -> None:
        for sub in self.subs:
            sub._push(op, item)

    def _to_live_subs(self, op: str, item: Any) -> None:
        """To the subscriptions that have their state already (the others get it with their state)."""
        for sub in self.subs:
            if sub._held is None:
                sub._push(op, item)

    def _on_event(self, event: ev.Event) -> None:
        raw = event.seq_no
        if isinstance(event, ev.EventsDropped):  # the server's own queue overflowed: it says so itself
            self._renumber(event)
            self._next_raw = raw  # a notice shares its seq_no with the event after the gap
            self._to_subs("event", event)
            return
        if self._next_raw is not None and raw > self._next_raw:
            self._missed(self._next_raw, raw - 1)
        if self._next_raw is None or raw >= self._next_raw:
            self._next_raw = raw + 1
        self._renumber(event)
        self._seq_high = max(self._seq_high, event.seq_no)
        self._to_subs("event", event)

    def _check_tail(self, last_seq: int) -> None:
        """A heartbeat says which event the server sent last; after it on the same socket, so any event up
        to it that did not come was lost (PUB drops what a slow subscriber cannot take)."""
        if self._synced == self.instance and self._next_raw is not None and last_seq >= self._next_raw:
            self._missed(self._next_raw, last_seq)
            self._next_raw = last_seq + 1

    def _missed(self, first_raw: int, last_raw: int) -> None:
        self._seq_high = max(self._seq_high, last_raw + self._offset)  # they were published: numbers taken
        self._to_subs("missed", (last_raw - first_raw + 1, first_raw + self._offset, last_raw + self._offset))

    def _renumber(self, event: ev.Event) -> None:
        if not self._offset:
            return
        object.__setattr__(event, "seq_no", event.seq_no + self._offset)
        if isinstance(event, ev.EventsDropped):
            for name in ("first_seq_no", "last_seq_no"):
                if getattr(event, name) >= 0:
                    object.__setattr__(event, name, getattr(event, name) + self._offset)

    # ---- a consistent start: sync, then the state ------------------------------------------------------
    def fetch_state(self, done: Callable[[Any, BaseException | None], None]) -> None:
        """The server's state, renumbered. With subscriptions, asked only once their subscription reached
        the server (sync), so that every event after the state reaches them."""
        def answered(state, error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
                return
            for event in state:
                self._renumber(event)
                self._seq_high = max(self._seq_high, event.seq_no)
            # A watcher that resyncs takes only the cache from the state: the status it shows comes with its
            # events, so the status that the state holds follows them too.
            self._to_live_subs("status", self._stamped_status(self._seq_high + 1))
            done(state, None)

        def ask(error: BaseException | None) -> None:
            if error is not None:
                done(None, error)
            else:
                req_id, body = self._make_body("current_state", [], {})
                self.send(req_id, "current_state", body, answered)

        if self.subs:
            self._when_synced(ask)
        else:
            ask(None)

    def _when_synced(self, then: Callable[[BaseException | None], None]) -> None:
        if self.instance is not None and self._synced == self.instance:
            then(None)
            return
        self._sync_waiters.append(then)
        if self._sync_nonce is None:
            self._sync_nonce = os.urandom(8)
            self._sync_deadline = time.monotonic() + self.timeout
            self._send_sync()

    def _send_sync(self) -> None:
        """Ask the server to publish our marker; asked again, SYNC_RETRY after each answer, until it comes
        (a SUB socket's subscription reaches the PUB socket some time after it is made)."""
        nonce = self._sync_nonce

        def answered(_result, error: BaseException | None) -> None:
            if nonce != self._sync_nonce:
                return
            self._sync_in_flight = False
            self._sync_next = time.monotonic() + SYNC_RETRY
            if error is not None:
                self._sync_done(error)

        self._sync_in_flight = True
        req_id, body = self._make_body("sync", [], {"nonce": nonce})
        self.send(req_id, "sync", body, answered)

    def _sync_done(self, error: BaseException | None) -> None:
        waiters, self._sync_waiters = self._sync_waiters, []
        self._sync_nonce, self._sync_in_flight = None, False
        for then in waiters:
            then(error)
