"""The wire protocol between `kvscope serve` (engine/runners/serve.py) and RemoteSession
(engine/watch/remote.py). Torch-free: a front-end on a machine without the engine speaks it.

A server has two ZeroMQ sockets on one host, PORT and PORT + 1:

- commands, ROUTER at tcp://HOST:PORT. A client's DEALER sends one frame, a msgpack map
  {"v": PROTOCOL_VERSION, "id": int, "token": str | None, "cmd": str, "args": [...], "kwargs": {...}};
  the server answers with two frames: a header {"v", "id", "ok", "instance", "stamp", "status",
  "error": [type name, message] or None} and the result (pack_value; empty when not ok).
  "status" is the session's Status right after the command, "stamp" orders statuses (see below).
- events, PUB at tcp://HOST:PORT+1. Multipart messages, the first frame being the topic:
      [b"ev", instance, event, event, ...]   events in seq_no order, each engine.watch.codec.encode_event
                                             (the framing of recordings)
      [b"em", instance, nonce]               the answer to a "sync" command (its nonce)
      [b"hb", instance, pack_value(map)]     a heartbeat every HEARTBEAT_INTERVAL s: {"v", "status", "stamp",
                                             "last_seq" (the last event sent), "closing" (the server stops),
                                             "max_message_bytes" (the largest command it takes)}
  "ev" and "em" share the prefix b"e", so one subscription gets both: a client that sees the marker of
  its own sync command knows that its subscription reached the server, and that every event published
  from then on reaches it (PUB/SUB's slow-joiner problem).

Every command carries the server's token (made up at start, or KVSCOPE_TOKEN; none only with
--no-token on this machine); a command message over the server's limit closes the sender's connection
(ZeroMQ's MAXMSGSIZE). The event socket asks for no token and nothing is encrypted: see the README.

`instance` is 8 random bytes per server process: a client that sees another one knows the server
restarted (its seq_no count starts again). `stamp` counts the statuses the server sent, in the order it
read them, so that a client keeps the newest whatever socket it came by.
"""
from __future__ import annotations

import builtins
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Callable

import msgpack
import numpy as np
import zmq

from engine import errors
from engine import events as ev
from engine.errors import KvscopeError
from engine.watch.codec import decode_event, encode_event

PROTOCOL_VERSION = 1
DEFAULT_PORT = 5590  # commands; events on DEFAULT_PORT + 1
DEFAULT_BIND = "127.0.0.1"
LOCAL_BINDS = ("127.0.0.1", "localhost", "::1")
TOKEN_ENV = "KVSCOPE_TOKEN"  # the token, for a server and its clients, out of sight of `ps`
HEARTBEAT_INTERVAL = 0.25  # seconds between two heartbeats of a server
DISCONNECTED_AFTER = 2.0  # seconds without a heartbeat after which a client says "disconnected"
TOPIC_EVENTS, TOPIC_MARKER, TOPIC_HEARTBEAT = b"ev", b"em", b"hb"
EVENT_PREFIX, HEARTBEAT_PREFIX = b"e", b"h"  # what a SUB socket subscribes to

EXT_TUPLE, EXT_SET, EXT_EVENT, EXT_RECORD = 1, 2, 3, 4


class RemoteSessionError(KvscopeError):
    """The server of a RemoteSession did not answer, answered in another protocol, or is closed."""


class RemoteAccessError(RemoteSessionError):
    """The server refused a command: it needs the token it printed when it started."""


class PathRefusedError(KvscopeError):
    """A server refused a file name a client gave: absolute, with '..', leading out of the folder the
    server was given for such files by a symbolic link, or naming no file it may use."""


class RemoteCommandError(KvscopeError):
    """A command failed on the server with an error type this side does not know; `remote_type` names it."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type


# ---- records that results carry (the same fields as engine.runners.session.Status and
# engine.runners.workloads.StepOutcome, which import torch) ---------------------------------------------
@dataclass(frozen=True)
class Status:
    """A session's state as its worker left it after the last command or step. A RemoteSession's state is
    "disconnected" while its server does not answer (the other fields: as last heard)."""

    state: str
    step: int
    workload: str
    steps_per_second: float
    model: str
    settings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutcome:
    """What one step did. phase "idle": nothing to do (no decode)."""

    phase: str
    n_tokens: int = 0
    n_sampled: int = 0
    rc: int = 0
    active_seqs: tuple[int, ...] = ()


RECORDS = {cls.__name__: cls for cls in (Status, StepOutcome)}


# ---- values: msgpack, with tuples, sets, events and the records above kept as they are ---------------
def pack_value(value: Any) -> bytes:
    """Arguments and results as bytes; unpack_value gives back equal values of the same types."""
    try:
        return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise RemoteSessionError(f"cannot send {_describe(value)}: {e}") from None


def unpack_value(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    except KvscopeError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack reports bad bytes with several exception types
        raise RemoteSessionError(f"a damaged message ({type(e).__name__}: {e}): is the other side a kvscope of "
                                 f"protocol {PROTOCOL_VERSION}?") from None


def _default(obj: Any) -> Any:
    """What msgpack does not write by itself (strict_types sends tuples and subclasses here)."""
    if isinstance(obj, tuple):
        return msgpack.ExtType(EXT_TUPLE, pack_value(list(obj)))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(EXT_SET, pack_value(_sorted_if_possible(obj)))
    if isinstance(obj, ev.Event):
        return msgpack.ExtType(EXT_EVENT, encode_event(obj))
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in RECORDS:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(EXT_RECORD, pack_value([type(obj).__name__, fields]))
    if isinstance(obj, np.generic):
        return obj.item()
    for base in (bool, int, float, str, bytes, list, dict):  # subclasses: an IntEnum, a str enum
        if isinstance(obj, base):
            return base(obj)
    if isinstance(obj, PurePath):
        return str(obj)
    raise TypeError(f"a value of type {type(obj).__name__} has no encoding")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TUPLE:
        return tuple(unpack_value(data))
    if code == EXT_SET:
        return frozenset(unpack_value(data))
    if code == EXT_EVENT:
        return decode_event(data)
    if code == EXT_RECORD:
        name, fields = unpack_value(data)
        cls = RECORDS.get(name)
        if cls is None:
            raise RemoteSessionError(f"unknown record {name!r} in a message (a newer kvscope server?)")
        return cls(**fields)
    raise RemoteSessionError(f"unknown extension type {code} in a message (a newer kvscope server?)")


def _sorted_if_possible(items) -> list:
    try:
        return sorted(items)
    except TypeError:
        return list(items)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# ---- errors across the wire ------------------------------------------------------------------------
def error_fields(error: BaseException) -> list[str]:
    return [type(error).__name__, str(error)]


def rebuild_error(type_name: str, message: str) -> Exception:
    """The server's exception as the same class where this side has it: kvscope's errors (torch-free),
    this module's, Python's built-in ones; RemoteCommandError otherwise."""
    for home in (errors, globals(), builtins):
        cls = home.get(type_name) if isinstance(home, dict) else getattr(home, type_name, None)
        if isinstance(cls, type) and issubclass(cls, Exception) and cls is not RemoteCommandError:
            try:
                return cls(message)
            except TypeError:  # an exception class whose constructor takes other arguments
                break
    return RemoteCommandError(type_name, message)


def token_from_environment() -> str | None:
    """The token in KVSCOPE_TOKEN, or None when it is unset or blank."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None


def is_local(bind: str) -> bool:
    """Whether an address is reachable from this machine only."""
    return bind in LOCAL_BINDS or bind.startswith("127.")


# ---- sockets ------------------------------------------------------------------------------------------
BURST = 1000  # messages read from one socket before an I/O thread looks at its others


def drain(sock: zmq.Socket, handle: Callable[[list], None], who: str, *, copy: bool = True) -> None:
    """Handle what waits on a socket, BURST messages at most (then the other sockets get their turn). A
    message that cannot be handled is logged and skipped: one bad message must not end the thread that
    serves everyone (`who` names that side in the log)."""
    for _ in range(BURST):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
        try:
            handle(frames)
        except Exception:  # noqa: BLE001 - see the docstring
            logging.getLogger("kvscope.remote").exception("%s: a message could not be handled; skipped", who)
