"""A Session published over ZeroMQ (`kvscope serve`): commands from any number of RemoteSession clients
(engine/watch/remote.py), every event of the session's bus to all of them. The wire protocol, socket by
socket and frame by frame: engine/watch/protocol.py.

    server = SessionServer(bind="127.0.0.1", port=5590)   # binds now: a taken port fails before a model loads
    session = Session("demo", workload="generate")
    server.start(session)
    print(server.access_lines())                          # the token clients need, the folders they name files in
    ...
    server.close(); session.close()

Clients are assumed hostile, local ones included: every command carries the token (made up when not
given, also on 127.0.0.1; none only with no_token on this machine), the files a client names stay in the
server's folders (engine/runners/served_files.py), a command message over max_message_bytes closes its
sender's connection (ZeroMQ drops it before it is read) and an uploaded state is capped.

Threads: an I/O thread owns every socket (commands in; replies, events and heartbeats out); an encoder
thread turns the bus's events into bytes; the session's worker (and a small pool, for the queries that
wait) post the replies. A client never blocks any of them: PUB drops what a slow subscriber cannot take
(the client sees the gap in seq_no and resyncs), ROUTER drops replies to a client that went away.
"""
from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import secrets
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import zmq

from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.served_files import COMMANDS as FILE_COMMANDS
from engine.runners.served_files import MAX_STATE_BYTES, ServedFiles
from engine.watch.codec import CodecError, encode_event
from engine.watch.protocol import (
    DEFAULT_BIND,
    DEFAULT_PORT,
    HEARTBEAT_INTERVAL,
    PROTOCOL_VERSION,
    TOKEN_ENV,
    TOPIC_EVENTS,
    TOPIC_HEARTBEAT,
    TOPIC_MARKER,
    RemoteAccessError,
    RemoteSessionError,
    drain,
    error_fields,
    is_local,
    pack_value,
    token_from_environment,
    unpack_value,
)

log = logging.getLogger("kvscope.serve")

EVENTS_PER_MESSAGE = 256  # events batched into one PUB message: one message costs as much as ~10 small events
BYTES_PER_MESSAGE = 1 << 20
STREAM_QUEUE = 1 << 16  # events the encoder may fall behind before the stream drops some (and says so)
SEQ_BYTES = 8
TOKEN_BYTES = 16  # random bytes of a token the server makes up (22 characters)
SHORT_TOKEN_CHARS = 16  # a chosen token shorter than this is warned about: easy to guess
REQUEST_OVERHEAD_BYTES = 64 << 10  # a request beside the state it uploads: the command, its arguments, the token
SUBSCRIPTION_MAX_BYTES = 256  # what a subscriber sends to the event socket: a topic prefix of a few bytes

# Session methods a client may call; each returns a Future at once.
SESSION_COMMANDS = ("start", "pause", "stop", "step", "set_speed", "add_prompt", "set_workload", "seq_rm", "seq_cp",
                    "seq_keep", "seq_add", "seq_div", "clear", "context_shift", "rebuild", "load_model", "save_state",
                    "load_state")


class SessionServer:
    """Serves one Session to RemoteSession clients (see the module docstring)."""

    def __init__(self, bind: str = DEFAULT_BIND, port: int = DEFAULT_PORT, token: str | None = None, *,
                 no_token: bool = False, state_dir: str | os.PathLike | None = None,
                 models_dir: str | os.PathLike | None = None, max_state_bytes: int = MAX_STATE_BYTES) -> None:
        """bind: the interface to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface);
        commands on `port`, events on port + 1. token: what every command must carry (None: KVSCOPE_TOKEN,
        else a random one; see access_lines). no_token: commands need none; refused unless bound to this
        machine only, and logged as a warning. state_dir: the folder of the files save_state, load_state and
        a chat script name (None: kvscope-state/ in the current folder, made on first use); models_dir: the
        folder load_model takes names in (None: only the bundled "demo"); both must exist.
        max_state_bytes: the largest state a client may upload; a command message may be
        REQUEST_OVERHEAD_BYTES larger (max_message_bytes), and ZeroMQ disconnects a client that sends more."""
        self.bind, self.port = check_bind(bind), check_port(port)
        self.token = chosen_token(token, no_token, self.bind)
        self._queries = ThreadPoolExecutor(2, thread_name_prefix="kvscope-serve-query")  # its threads start on use
        self.files = ServedFiles(state_dir=state_dir, models_dir=models_dir, max_state_bytes=max_state_bytes,
                                 pool=self._queries)
        self.max_message_bytes = max_state_bytes + REQUEST_OVERHEAD_BYTES
        if no_token:
            log.warning("kvscope serve: --no-token: every user of this machine can drive this session, and save and "
                        "load states in %s; leave --no-token out to require the printed token", self.state_dir)
        self.instance = os.urandom(8)  # tells clients that a restarted server is another one
        self.session = None
        self.commands = self.refused = self.events_sent = 0
        self._zmq = zmq.Context()
        try:
            self._router = self._bound(zmq.ROUTER, port)
            self._pub = self._bound(zmq.PUB, port + 1)
        except BaseException:
            self._zmq.destroy(linger=0)
            raise
        # Replies and events come from other threads; only the I/O thread touches the sockets above, so
        # those threads hand their frames over through this pair (unbounded: handing over never blocks).
        inbox_address = f"inproc://kvscope-serve-{self.instance.hex()}"
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(inbox_address)
        self._outbox = self._zmq.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(inbox_address)
        self._outbox_lock = threading.Lock()
        self._stream: ev.Subscription | None = None
        self._threads: list[threading.Thread] = []
        self._stamp = 0  # statuses sent, in the order they were read
        self._last_seq = -1  # the last event sent on the PUB socket
        self._stopping = False
        self._closed = False

    @property
    def serving(self) -> bool:
        """Whether the I/O thread runs (started, not stopped, not failed)."""
        return bool(self._threads) and self._threads[0].is_alive()

    @property
    def state_dir(self):
        """The folder save_state and load_state take names in (a pathlib.Path; it may not exist yet)."""
        return self.files.states.root

    @property
    def models_dir(self):
        """The folder load_model takes names in; None: only the bundled "demo"."""
        return None if self.files.models is None else self.files.models.root

    def access_lines(self) -> list[str]:
        """What a client needs to know, for the server's banner: the token (or that there is none), where
        the files it names are, and what the token does not cover."""
        if self.token is None:
            access = "no token (--no-token): every user of this machine can send commands"
        else:
            access = f"token: {self.token}"
        events = (f"events: {self.event_address} asks for no token, and nothing is encrypted: whoever reaches that "
                  f"port reads the prompts and the generated text (from another machine: tunnel it, ssh -L)")
        return [access, *self.files.summary(), events]

    @property
    def command_address(self) -> str:
        return f"tcp://{self.bind}:{self.port}"

    @property
    def event_address(self) -> str:
        return f"tcp://{self.bind}:{self.port + 1}"

    def start(self, session) -> None:
        """Serve `session` from now on (a threaded engine.runners.session.Session)."""
        if self.session is not None:
            raise KvscopeError("this server already serves a session")
        if not session.threaded:
            raise KvscopeError("a served session must be threaded: Session(..., threaded=True)")
        self.session = session
        # Without the state: a client gets that from current_state, stamped in the same seq_no count.
        self._stream = session.bus.subscribe(STREAM_QUEUE, with_state=False)
        for target, name in ((self._serve, "kvscope-serve-io"), (self._encode_events, "kvscope-serve-events")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        """Stop serving (a last heartbeat tells clients so); the session stays open."""
        if self._closed:
            return
        self._stopping = True
        self._post([b"stop"])
        if self._stream is not None:
            self._stream.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self._queries.shutdown(wait=False, cancel_futures=True)
        with self._outbox_lock:
            self._closed = True
            self._outbox.close(linger=0)
        if any(thread.is_alive() for thread in self._threads):
            log.warning("kvscope serve: a server thread did not stop; its sockets stay open until exit")
            return
        if not self._threads:  # never started: the I/O thread did not close them
            for sock in (self._router, self._pub, self._inbox):
                sock.close(linger=0)
        self._zmq.term()

    def __enter__(self) -> SessionServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- setting up ---------------------------------------------------------------------------------
    def _bound(self, kind: int, port: int) -> zmq.Socket:
        sock = self._zmq.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # Checked by ZeroMQ as the bytes arrive, before any token is: a client cannot make the server
        # hold more than this for one frame (it is disconnected instead).
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes if kind == zmq.ROUTER else SUBSCRIPTION_MAX_BYTES)
        # ZMTP heartbeats: a client machine that vanished without closing its connection is noticed
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        address = f"tcp://{self.bind}:{port}"
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise KvscopeError(f"cannot listen on {address} ({e}): another kvscope serve, or another program, uses "
                               f"port {port}; pick another with --port (the events take the port after it)") from None
        return sock

    # ---- the I/O thread -------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._inbox, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stopping:
                ready = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self._inbox in ready:
                    self._drain_inbox()
                if self._router in ready:
                    self._drain_router()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + HEARTBEAT_INTERVAL
            self._heartbeat(closing=True)
        except Exception:  # noqa: BLE001 - logged; clients then see the server as gone
            log.exception("kvscope serve: the I/O thread failed")
        finally:
            for sock in (self._router, self._pub, self._inbox):
                sock.close(linger=0)

    def _drain_inbox(self) -> None:
        drain(self._inbox, self._on_inbox, "kvscope serve", copy=False)

    def _drain_router(self) -> None:
        drain(self._router, lambda frames: self._on_request(frames[0], frames[1:]), "kvscope serve")

    def _on_inbox(self, frames: list) -> None:
        what = frames[0].bytes
        if what == b"pub":
            self._last_seq = int.from_bytes(frames[1].bytes, "little", signed=True)
            self._pub.send_multipart([TOPIC_EVENTS, self.instance, *frames[2:]], copy=False)
            self.events_sent += len(frames) - 2
        elif what == b"reply":
            req_id, error = unpack_value(frames[2].bytes)
            self._reply(frames[1].bytes, req_id, frames[3], error)

    def _on_request(self, identity: bytes, frames: list[bytes]) -> None:
        self.commands += 1
        req_id = -1
        trusted = False  # the session's status goes only to a client that gave the token
        try:
            request = checked_request(frames)
            req_id = request["id"]
            self._check_access(request)
            trusted = True
            future = self._dispatch(request["cmd"], request["args"], request["kwargs"])
        except Exception as e:  # noqa: BLE001 - every refusal and synchronous error goes back to the client
            if isinstance(e, RemoteAccessError):
                self.refused += 1
            self._reply(identity, req_id, b"", error_fields(e), with_status=trusted)
            return
        future.add_done_callback(functools.partial(self._post_reply, identity, req_id))

    def _check_access(self, request: dict) -> None:
        if request["v"] != PROTOCOL_VERSION:
            raise RemoteSessionError(f"this server speaks kvscope protocol {PROTOCOL_VERSION}, the client "
                                     f"{request['v']}: install the same kvscope version on both machines")
        if self.token is None:
            return
        given = request["token"]
        if given is None:
            raise RemoteAccessError(f"refused {request['cmd']}: this server takes commands only with its token, which "
                                    f"`kvscope serve` printed when it started (the line \"token: ...\"); pass it as "
                                    f"RemoteSession(address, token=...) or `kvscope tui --connect ADDRESS --token T`, "
                                    f"or set {TOKEN_ENV} (which a command line does not show to other users)")
        if not hmac.compare_digest(str(given).encode(), self.token.encode()):
            raise RemoteAccessError(f"refused {request['cmd']}: wrong token; use the one `kvscope serve` printed "
                                    f"when it started")

    def _dispatch(self, cmd: str, args: list, kwargs: dict) -> Future:
        if cmd == "sync":
            self._pub.send_multipart([TOPIC_MARKER, self.instance, bytes(kwargs.get("nonce", b""))])
            return _done(None)
        if cmd == "status":
            return _done(self.session.status())
        if cmd in QUERIES:
            return self._queries.submit(QUERIES[cmd], self.session, *args, **kwargs)
        if cmd == "engine_cells":
            return engine_cells(self.session)
        if cmd in FILE_COMMANDS:  # the ones that name files or carry a state
            return getattr(self.files, cmd)(self.session, *args, **kwargs)
        if cmd in SESSION_COMMANDS:
            return getattr(self.session, cmd)(*args, **kwargs)
        known = sorted({*SESSION_COMMANDS, *QUERIES, "engine_cells", "status", "sync"})
        raise RemoteSessionError(f"unknown command {cmd!r}; a kvscope server takes {', '.join(known)}")

    def _reply(self, identity: bytes, req_id: int, payload, error: list | None, with_status: bool = True) -> None:
        """The status is read here, on the I/O thread, so that stamps follow the order of the reads."""
        status, stamp = self._status() if with_status else (None, -1)
        header = pack_value({"v": PROTOCOL_VERSION, "id": req_id, "ok": error is None, "instance": self.instance,
                             "stamp": stamp, "status": status, "error": error})
        self._router.send_multipart([identity, header, payload if error is None else b""], copy=False)

    def _heartbeat(self, closing: bool = False) -> None:
        status, stamp = self._status()
        beat = {"v": PROTOCOL_VERSION, "status": status, "stamp": stamp, "last_seq": self._last_seq,
                "closing": closing, "max_message_bytes": self.max_message_bytes}
        self._pub.send_multipart([TOPIC_HEARTBEAT, self.instance, pack_value(beat)])

    def _status(self):
        self._stamp += 1
        return self.session.status(), self._stamp

    # ---- other threads ------------------------------------------------------------------------------
    def _post(self, frames: list) -> None:
        """Hand frames to the I/O thread (from any thread)."""
        with self._outbox_lock:
            if self._closed:
                return
            try:  # never blocks while the I/O thread reads (no limit); dropped once it has stopped
                self._outbox.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.debug("kvscope serve: %s dropped, the server is stopping", frames[0])

    def _post_reply(self, identity: bytes, req_id: int, future: Future) -> None:
        """Runs where the command finished (the session's worker, mostly): the result is encoded there."""
        try:
            payload, error = pack_value(future.result()), None
        except Exception as e:  # noqa: BLE001 - the command's own error, or a result with no encoding
            payload, error = b"", error_fields(e)
        self._post([b"reply", identity, pack_value([req_id, error]), payload])

    def _encode_events(self) -> None:
        stream = self._stream
        while True:
            first = stream.get(timeout=0.5)
            if first is not None:
                self._send_events([first, *stream.drain()])
            elif stream.closed:
                return

    def _send_events(self, events: list[ev.Event]) -> None:
        frames: list[bytes] = []
        size, last = 0, -1
        for event in events:
            try:
                data = encode_event(event)
            except CodecError:  # clients see the gap in seq_no and resync
                log.exception("kvscope serve: %s #%d has no encoding; it is not sent", event.kind, event.seq_no)
                continue
            frames.append(data)
            size, last = size + len(data), event.seq_no
            if len(frames) >= EVENTS_PER_MESSAGE or size >= BYTES_PER_MESSAGE:
                self._post([b"pub", last.to_bytes(SEQ_BYTES, "little", signed=True), *frames])
                frames, size = [], 0
        if frames:
            self._post([b"pub", last.to_bytes(SEQ_BYTES, "little", signed=True), *frames])


# ---- what commands run ------------------------------------------------------------------------------
def _current_state(session) -> list[ev.Event]:
    return session.current_state()


def _estimate(session, **settings) -> dict:
    return session.estimate(**settings).to_dict()


# Queries that wait for their answer: they run on the server's pool, never on the I/O thread.
QUERIES: dict[str, Callable[..., Any]] = {"current_state": _current_state, "estimate": _estimate}


def engine_cells(session) -> Future:
    """The engine's own cells and heads, read on the session's worker: what a client compares its watcher with."""
    return session.engine_cells()


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def checked_request(frames: list[bytes]) -> dict:
    if len(frames) != 1:
        raise RemoteSessionError(f"a request is one frame, got {len(frames)}: is the client a kvscope RemoteSession "
                                 f"of protocol {PROTOCOL_VERSION}?")
    request = unpack_value(frames[0])
    if not isinstance(request, dict):
        raise RemoteSessionError(f"a request must be a map, got {type(request).__name__}")
    shape = {"v": int, "id": int, "cmd": str, "args": list, "kwargs": dict}
    wrong = [key for key, kind in shape.items() if not isinstance(request.get(key), kind)]
    if wrong:
        raise RemoteSessionError(f"a request lacks, or has the wrong type of, {', '.join(wrong)}: is the client a "
                                 f"kvscope RemoteSession of protocol {PROTOCOL_VERSION}?")
    request.setdefault("token", None)
    return request


def chosen_token(token: str | None, no_token: bool, bind: str) -> str | None:
    """The token a server asks for: the given one, else KVSCOPE_TOKEN's, else a random one; None only with
    no_token, which a server that listens beyond this machine refuses."""
    if no_token:
        if token is not None:
            raise KvscopeError("--token and --no-token contradict each other: give one of them")
        if not is_local(bind):
            raise KvscopeError(f"--no-token only with --bind 127.0.0.1 (or ::1, localhost): this machine only, got "
                               f"--bind {bind}; off this machine every command needs the token")
        return None
    if token is None:
        return token_from_environment() or secrets.token_urlsafe(TOKEN_BYTES)
    if not isinstance(token, str) or not token.strip():
        raise KvscopeError(f"--token must be a non-empty text, got {token!r}: leave it out to get a random one")
    if len(token) < SHORT_TOKEN_CHARS:
        log.warning("kvscope serve: a token of %d characters is easy to guess; leave --token out to get a random "
                    "one", len(token))
    return token


def check_bind(bind: str) -> str:
    if not isinstance(bind, str) or not bind.strip() or any(c in bind for c in "/ "):
        raise KvscopeError(f"--bind takes an interface address such as 127.0.0.1 (this machine only) or 0.0.0.0 "
                           f"(every interface), got {bind!r}")
    return bind


def check_port(port: int) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65534:
        raise KvscopeError(f"--port must be in 1..65534 (the events take the port after it), got {port!r}")
    return port


# ---- running until told to stop ----------------------------------------------------------------------
class StopRequest:
    """Set by SIGINT or SIGTERM while stop_on_signals is in force; `reason` names what set it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM ask for a clean stop for the whole block, shutting down included: a second Ctrl-C
    while the server stops changes nothing (the default handler would raise in the middle of closing)."""
    stop = StopRequest()
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.set(signal.Signals(signum).name))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_until_stopped(server: SessionServer, stop: StopRequest) -> str:
    """Block until `stop` is set (or the server's I/O thread ends); returns why. Reads nothing from stdin, so
    it runs the same without a terminal."""
    while not stop.event.wait(0.5):  # a timed wait: signal handlers run between two waits
        if not server.serving:
            return "the server's I/O thread ended (see the log above)"
    return stop.reason
