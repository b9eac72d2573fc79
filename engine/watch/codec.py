"""Events to bytes and back: the framing of recordings (engine/watch/recording.py) and of any live
stream of events (docs/recording-format.md, "Event encoding").

Encoding is generic: an event is written from its dataclass fields and read back by looking its
class up by name in engine.events, so event classes and fields added there later need no change
here. One event is one msgpack array `[kind, seq_no, time, {field: value}]`; nested records
(StreamCells, DeviceBytes, ...) and numpy arrays travel as msgpack extension types.

Compatibility, within one engine.events.SCHEMA_VERSION: a field the reader's class lacks is
dropped (it was added, with a default, by a newer kvscope), a field the data lacks takes the
class's default; an unknown event kind, or a missing field without a default, is a CodecError.
"""
from __future__ import annotations

import dataclasses
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from engine import events as ev
from engine.errors import KvscopeError

EXT_ARRAY = 1  # a numpy array: dtype, shape, raw bytes (see _array_payload)
EXT_RECORD = 2  # a nested engine.events dataclass: msgpack [name, {field: value}]
EXT_SET = 3  # a set or frozenset: msgpack array of its items; read back as a frozenset
ARRAY_KINDS = "biufcSUmM"  # numpy dtype kinds whose dtype.str names the type completely
EVENT_CLOCK_FIELDS = ("seq_no", "time")  # stamped by the bus; written before the field map
ARRAY_HEAD_CACHE = 4096  # array headers (dtype, shape) remembered: events repeat a few shapes many times


class CodecError(KvscopeError):
    """Bytes that are not an encoded event, or an event this kvscope cannot encode or rebuild."""


@dataclass(frozen=True)
class _Layout:
    """How one engine.events class is written and rebuilt."""

    cls: type
    names: tuple[str, ...]  # fields written to the map (an event's seq_no and time go separately)
    init_names: frozenset[str]
    required: frozenset[str]  # init fields without a default


_layouts: dict[type, _Layout] = {}
_layouts_by_name: dict[str, _Layout] = {}
_array_heads: dict[tuple[np.dtype, tuple[int, ...]], bytes] = {}
_array_shapes: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}
_local = threading.local()  # each thread's pool of Packers (see _pack)


def encode_event(event: ev.Event) -> bytes:
    """One event as bytes; decode_event gives back an equal event (seq_no and time included)."""
    layout = _layout_of(type(event))
    if not issubclass(layout.cls, ev.Event):
        raise CodecError(f"cannot encode {layout.cls.__name__} as an event: it is not an engine.events.Event")
    fields = {name: getattr(event, name) for name in layout.names}
    try:
        return _pack([layout.cls.__name__, event.seq_no, event.time, fields])
    except CodecError as e:
        raise CodecError(f"cannot encode {event.kind} #{event.seq_no}: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode {event.kind} #{event.seq_no}: {e}") from e


def decode_event(data: bytes) -> ev.Event:
    """The event that encode_event wrote into `data`; CodecError if `data` is anything else."""
    try:
        obj = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    except CodecError:
        raise
    except Exception as e:  # msgpack reports bad bytes with several exception types (ValueError, FormatError, ...)
        raise CodecError(f"not an encoded event ({type(e).__name__}: {e})") from None
    if not (isinstance(obj, tuple) and len(obj) == 4 and isinstance(obj[0], str) and isinstance(obj[3], dict)):
        raise CodecError(f"not an encoded event: expected [kind, seq_no, time, fields], got {_describe(obj)}")
    kind, seq_no, t, fields = obj
    layout = _layout_named(kind)
    if not issubclass(layout.cls, ev.Event):
        raise CodecError(f"{kind} is a record of engine.events, not an event")
    if not isinstance(seq_no, int) or not isinstance(t, (int, float)):
        raise CodecError(f"{kind}: seq_no and time must be numbers, got {seq_no!r} and {t!r}")
    event = _build(layout, fields)
    object.__setattr__(event, "seq_no", seq_no)
    object.__setattr__(event, "time", float(t))
    return event


def event_kind(data: bytes) -> str:
    """The kind (class name) of an encoded event, read without decoding the rest: cheap enough to scan a
    whole recording for events of some kinds. CodecError if `data` does not start as an encoded event."""
    # the usual bytes, a fixarray of 4 and then a fixstr (kind names are short), need no unpacker
    if len(data) > 2 and data[0] == 0x94 and 0xA0 <= data[1] <= 0xBF:
        end = 2 + (data[1] & 0x1F)
        if len(data) >= end:
            try:
                return data[2:end].decode("utf-8")
            except UnicodeDecodeError:
                pass  # fall through to the general reader, which names the problem
    try:
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(data)
        n = unpacker.read_array_header()
        kind = unpacker.unpack()
    except Exception as e:  # msgpack reports bad bytes with several exception types
        raise CodecError(f"not an encoded event ({type(e).__name__}: {e})") from None
    if n != 4 or not isinstance(kind, str):
        raise CodecError(f"not an encoded event: expected [kind, seq_no, time, fields], got an array of {n} "
                         f"starting with {_describe(kind)}")
    return kind


# ---- encoding --------------------------------------------------------------------------------
def _pack(obj: Any) -> bytes:
    """obj packed by a Packer of this thread's pool. Packing a nested record happens while the Packer of
    the record around it is busy, so each level of nesting takes one of its own; creating a Packer per
    record would cost a quarter of the encoding time."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = []
    packer = pool.pop() if pool else msgpack.Packer(default=_default, use_bin_type=True)
    try:
        return packer.pack(obj)
    finally:
        packer.reset()  # no partial output of a failed pack() may reach the next one
        pool.append(packer)


def _default(obj: Any) -> Any:
    """What msgpack cannot write by itself."""
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(EXT_ARRAY, _array_payload(obj))
    layout = _layouts.get(type(obj))
    if layout is not None or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        layout = layout or _layout_of(type(obj))
        return msgpack.ExtType(EXT_RECORD, _pack([layout.cls.__name__, {name: getattr(obj, name)
                                                                          for name in layout.names}]))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(EXT_SET, _pack(_sorted_if_possible(obj)))
    raise CodecError(f"a value of type {type(obj).__name__} has no encoding ({obj!r:.80})")


def _sorted_if_possible(items) -> list:
    """Sorted, so that equal sets give equal bytes; in iteration order when the items do not compare."""
    try:
        return sorted(items)
    except TypeError:
        return list(items)


def _array_payload(arr: np.ndarray) -> bytes:
    """dtype.str length (u8), dtype.str (ascii), ndim (u8), shape (u64 each, little-endian), C-order bytes."""
    key = (arr.dtype, arr.shape)
    head = _array_heads.get(key)
    if head is None:
        if arr.dtype.kind not in ARRAY_KINDS or arr.dtype.itemsize == 0:
            raise CodecError(f"numpy arrays of dtype {arr.dtype} (kind {arr.dtype.kind!r}, {arr.dtype.itemsize} "
                             f"bytes per item) have no encoding; kinds {ARRAY_KINDS!r} of items with bytes do")
        dtype = arr.dtype.str.encode("ascii")
        head = struct.pack(f"<B{len(dtype)}sB{arr.ndim}Q", len(dtype), dtype, arr.ndim, *arr.shape)
        if len(_array_heads) >= ARRAY_HEAD_CACHE:
            _array_heads.clear()
        _array_heads[key] = head
    return head + arr.tobytes()  # tobytes writes C order whatever the array's layout


# ---- decoding --------------------------------------------------------------------------------
def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_ARRAY:
        return _array_from(data)
    if code == EXT_RECORD:
        return _record_from(data)
    if code == EXT_SET:
        items = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False, ext_hook=_ext_hook)
        return frozenset(items)
    raise CodecError(f"unknown extension type {code} (this kvscope knows {EXT_ARRAY}, {EXT_RECORD}, {EXT_SET})")


def _array_from(data: bytes) -> np.ndarray:
    n = data[0] if data else 0
    end = 2 + n + 8 * data[1 + n] if len(data) > 1 + n else -1
    if end < 0 or len(data) < end:
        raise CodecError(f"a damaged numpy array header ({len(data)} bytes)")
    head = data[:end]
    shape_info = _array_shapes.get(head)
    if shape_info is None:
        shape_info = _array_shape(head, n)
        if len(_array_shapes) >= ARRAY_HEAD_CACHE:
            _array_shapes.clear()
        _array_shapes[head] = shape_info
    dtype, shape, count = shape_info
    if len(data) - end != count * dtype.itemsize:
        raise CodecError(f"a numpy array of shape {shape} and dtype {dtype} needs {count * dtype.itemsize} bytes, "
                         f"the data has {len(data) - end}")
    # read-only, as the engine's own event arrays are
    arr = np.frombuffer(data, dtype=dtype, offset=end, count=count)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _array_shape(head: bytes, n: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """dtype, shape and element count of an array header."""
    try:
        dtype = np.dtype(head[1:1 + n].decode("ascii"))
        shape = struct.unpack_from(f"<{head[1 + n]}Q", head, 2 + n)
    except (struct.error, UnicodeDecodeError, TypeError, ValueError) as e:
        raise CodecError(f"a damaged numpy array header ({e})") from None
    if dtype.kind not in ARRAY_KINDS or dtype.itemsize == 0:
        raise CodecError(f"a numpy array of dtype {dtype} (kind {dtype.kind!r}, {dtype.itemsize} bytes per item) "
                         f"cannot be read back")
    return dtype, shape, math.prod(shape)


def _record_from(data: bytes) -> Any:
    obj = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    if not (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], dict)):
        raise CodecError(f"a damaged record: expected [name, fields], got {_describe(obj)}")
    return _build(_layout_named(obj[0]), obj[1])


def _build(layout: _Layout, fields: dict) -> Any:
    missing = layout.required - fields.keys()
    if missing:
        raise CodecError(f"{layout.cls.__name__} lacks the field(s) {', '.join(sorted(missing))}, which have no "
                         f"default (written by another schema of engine.events?)")
    kwargs = {k: v for k, v in fields.items() if k in layout.init_names}
    try:
        obj = layout.cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CodecError(f"{layout.cls.__name__} cannot be rebuilt from its fields: {e}") from None
    for name in layout.names:  # fields the constructor does not take
        if name not in layout.init_names and name in fields:
            object.__setattr__(obj, name, fields[name])
    return obj


def _describe(obj: Any) -> str:
    text = repr(obj)
    return f"{type(obj).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


# ---- class layouts ---------------------------------------------------------------------------
def _layout_of(cls: type) -> _Layout:
    layout = _layouts.get(cls)
    if layout is None:
        if engine_events_class(cls.__name__) is not cls:
            raise CodecError(f"{cls.__module__}.{cls.__qualname__} has no encoding: only the records of "
                             f"engine.events do")
        layout = _layouts[cls] = _make_layout(cls)
    return layout


def _layout_named(name: str) -> _Layout:
    layout = _layouts_by_name.get(name)
    if layout is None:
        cls = engine_events_class(name)
        if cls is None:
            raise CodecError(f"unknown event or record kind {name!r}: engine.events has no such class (written by a "
                             f"newer kvscope?)")
        layout = _layouts_by_name[name] = _layouts.setdefault(cls, _make_layout(cls))
    return layout


def engine_events_class(name: str) -> type | None:
    """The dataclass of engine.events called `name`, or None."""
    cls = getattr(ev, name, None)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == ev.__name__:
        return cls
    return None


def _make_layout(cls: type) -> _Layout:
    fields = dataclasses.fields(cls)
    skip = EVENT_CLOCK_FIELDS if issubclass(cls, ev.Event) else ()
    names = tuple(f.name for f in fields if f.name not in skip)
    init_names = frozenset(f.name for f in fields if f.init and f.name not in skip)
    required = frozenset(f.name for f in fields if f.init and f.name not in skip
                         and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return _Layout(cls, names, init_names, required)
