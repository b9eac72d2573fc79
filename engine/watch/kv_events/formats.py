"""The wire formats of vLLM's and SGLang's KV events, read and written: a message's payload is one msgpack
EventBatch of tagged BlockStored / BlockRemoved / AllBlocksCleared structs (msgspec, `tag=True`). Four layouts
exist, and a reader meets all of them in the field:

    array-v1  EventBatch [ts, events]; BlockStored [tag, hashes, parent, token_ids, block_size, lora_id];
              BlockRemoved [tag, hashes]. vLLM's first (vllm/distributed/kv_events.py at b4e69e0, 0.9) and
              SGLang's (python/sglang/srt/disaggregation/kv_events.py), whose ranks are told apart by port.
    array-v2  + data_parallel_rank after the events, + medium after lora_id and after BlockRemoved's hashes.
    array-v3  + lora_name and extra_keys after medium; hashes may be bytes (vLLM's sha256 hashes, sent whole
              unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES asks for their low 64 bits as an integer).
    map       the structs as maps with a "type" tag (vLLM main, 0181ea3): ts, events, data_parallel_rank
              (left out when unset); BlockStored adds group_idx, kv_cache_spec_kind and
              kv_cache_spec_sliding_window, BlockRemoved group_idx, each left out when unset (omit_defaults).

Array positions are those Dynamo's reader (lib/kv-router, zmq wire types) accepts. Reading is lenient the way
a reader of several versions must be: fields a layout lacks take their defaults, fields and positions past the
known ones are counted as unknown and skipped, an event of an unknown tag is counted and skipped, and a payload
that is not a batch at all is a WireError (the caller counts it; it is never fatal). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from engine.errors import KvscopeError

DIALECTS = ("array-v1", "array-v2", "array-v3", "map")
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
STORED_POSITIONS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys")  # after the tag, in array layouts
REMOVED_POSITIONS = ("block_hashes", "medium")
STORED_FIELDS = frozenset(STORED_POSITIONS) | {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                                               "block_mm_infos"}
REMOVED_FIELDS = frozenset(REMOVED_POSITIONS) | {"group_idx"}
BATCH_FIELDS = frozenset({"ts", "events", "data_parallel_rank", "dp_rank"})
HASH_MASK = (1 << 64) - 1


class WireError(KvscopeError):
    """A payload that is not a KV event batch in any layout kvscope reads."""


@dataclass
class WireEvent:
    """One event of a batch, whatever layout it came in. Hashes are bytes (an integer hash: its 8 big-endian
    bytes, unsigned, as vLLM's maybe_convert_block_hash and Dynamo's reader take them)."""

    tag: str  # STORED, REMOVED or CLEARED
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    group_kind: str | None = None
    sliding_window: int | None = None


@dataclass
class WireBatch:
    ts: float
    events: list[WireEvent]
    rank: int | None
    dialect: str
    unknown_tags: int = 0
    unknown_fields: int = 0
    unknown_tag_names: set[str] = field(default_factory=set)


def hash_bytes(value: Any) -> bytes:
    """A block hash as bytes: bytes stay, an integer (signed or unsigned 64 bits) becomes its 8 big-endian bytes."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value & HASH_MASK).to_bytes(8, "big")
    raise WireError(f"a block hash must be an integer or bytes, not {type(value).__name__}")


def hash_text(value: bytes | None, digits: int = 4) -> str:
    """How a hash is shown: 0x and its first hex digits ("0x3f2a"); "none" for a missing parent."""
    return "none" if value is None else "0x" + value.hex()[:digits]


# ---- reading --------------------------------------------------------------------------------------
def decode_batch(payload: bytes) -> WireBatch:
    """The batch in a message's payload, in whichever layout it came; WireError when it is none of them."""
    return batch_from_object(unpack_payload(payload))


def unpack_payload(payload: bytes) -> Any:
    """A payload's msgpack object (what batch_from_object reads); WireError when it is not msgpack."""
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack reports bad bytes with several exception types
        raise WireError(f"not msgpack ({type(e).__name__}: {e})") from None


def batch_from_object(obj: Any) -> WireBatch:
    """decode_batch for a payload already unpacked (a reader with a fast path of its own unpacks once)."""
    if isinstance(obj, dict):
        unknown = len(obj.keys() - BATCH_FIELDS)
        ts, events = obj.get("ts"), obj.get("events")
        rank = obj.get("data_parallel_rank", obj.get("dp_rank"))
        layout = "map"
    elif isinstance(obj, list) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
        unknown = max(0, len(obj) - 3)
        layout = "array"
    else:
        raise WireError(f"a batch is [ts, events, rank] or a map of them, not {_describe(obj)}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise WireError(f"a batch's ts must be a number, not {_describe(ts)}")
    if not isinstance(events, list):
        raise WireError(f"a batch's events must be a list, not {_describe(events)}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise WireError(f"a batch's data_parallel_rank must be an integer, not {_describe(rank)}")
    batch = WireBatch(float(ts), [], rank, layout, unknown_fields=unknown)
    for raw in events:
        event = _decode_event(raw, batch)
        if event is not None:
            batch.events.append(event)
    if layout == "array":
        batch.dialect = _array_dialect(obj, events)
    return batch


# The reader's hot path (a worker publishes tens of thousands of blocks a second): one type() look per value
# and C-level scans of hash and token lists, where isinstance per element would cost more than the rest.
_INTS, _BYTES = frozenset({int}), frozenset({bytes})
_STORED_KNOWN = STORED_FIELDS | {"type"}  # a map event's own tag is no unknown field
_REMOVED_KNOWN = REMOVED_FIELDS | {"type"}
_CLEARED_KNOWN = frozenset({"type"})
_TAGS = (STORED, REMOVED, CLEARED)


def _decode_event(raw: Any, batch: WireBatch) -> WireEvent | None:
    if type(raw) is dict:
        tag = raw.get("type")
        values = raw
    elif type(raw) is list and raw and type(raw[0]) is str:
        tag = raw[0]
        names = STORED_POSITIONS if tag == STORED else REMOVED_POSITIONS if tag == REMOVED else ()
        values = dict(zip(names, raw[1:]))
    else:
        raise WireError(f"an event is a tagged array or map, not {_describe(raw)}")
    if tag not in _TAGS:  # counted as one unknown event, its fields with it, in either layout
        batch.unknown_tags += 1
        batch.unknown_tag_names.add(str(tag)[:40])
        return None
    if values is not raw:
        batch.unknown_fields += max(0, len(raw) - 1 - len(names))
    known = _STORED_KNOWN if tag == STORED else _REMOVED_KNOWN if tag == REMOVED else _CLEARED_KNOWN
    if not known.issuperset(values):
        batch.unknown_fields += len(values.keys() - known)
    if tag == CLEARED:
        return WireEvent(tag)
    hashes = values.get("block_hashes")
    if type(hashes) is not list:
        raise WireError(f"{tag}: block_hashes must be a list, not {_describe(hashes)}")
    kinds = set(map(type, hashes))
    if kinds <= _BYTES:
        block_hashes = tuple(hashes)
    elif kinds <= _INTS:
        block_hashes = tuple([(h & HASH_MASK).to_bytes(8, "big") for h in hashes])
    else:
        block_hashes = tuple(hash_bytes(h) for h in hashes)  # raises for what is neither
    medium, group_idx = values.get("medium"), values.get("group_idx")
    if (medium is not None and type(medium) is not str) or (group_idx is not None and type(group_idx) is not int):
        _optional(values, "medium", str, tag)  # raises, naming the field
        _optional(values, "group_idx", int, tag)
    if tag == REMOVED:
        return WireEvent(tag, block_hashes, medium=medium, group_idx=group_idx)
    parent = values.get("parent_block_hash")
    parent_hash = None if parent is None else parent if type(parent) is bytes else hash_bytes(parent)
    tokens = values.get("token_ids")
    if type(tokens) is not list or not set(map(type, tokens)) <= _INTS:
        raise WireError(f"{tag}: token_ids must be a list of integers")
    size = values.get("block_size")
    if type(size) is not int or size <= 0:
        raise WireError(f"{tag}: block_size must be a positive integer, not {_describe(size)}")
    lora_id, lora_name, extra = values.get("lora_id"), values.get("lora_name"), values.get("extra_keys")
    kind, window = values.get("kv_cache_spec_kind"), values.get("kv_cache_spec_sliding_window")
    if ((lora_id is not None and type(lora_id) is not int) or (lora_name is not None and type(lora_name) is not str)
            or (kind is not None and type(kind) is not str) or (window is not None and type(window) is not int)):
        for name, expected in (("lora_id", int), ("lora_name", str), ("kv_cache_spec_kind", str),
                               ("kv_cache_spec_sliding_window", int)):
            _optional(values, name, expected, tag)  # the first wrong one raises, naming itself
    return WireEvent(tag, block_hashes, parent_hash, tuple(tokens), size, lora_id, medium, lora_name,
                     tuple(extra) if type(extra) is list else None, group_idx, kind, window)


def _optional(values: dict, name: str, kind: type, tag: str) -> Any:
    value = values.get(name)
    if value is None or type(value) is kind:
        return value
    raise WireError(f"{tag}: {name} must be {kind.__name__} or nil, not {_describe(value)}")


def _array_dialect(batch: list, events: list) -> str:
    """Which array layout a batch is in, as far as it shows (an empty batch shows little)."""
    longest, bytes_hashes = 0, False
    for e in events:
        if type(e) is not list or not e:
            continue
        if e[0] == STORED and len(e) > longest:
            longest = len(e)
        if not bytes_hashes and len(e) > 1 and type(e[1]) is list:
            bytes_hashes = not _BYTES.isdisjoint(map(type, e[1]))
    if longest > 7 or bytes_hashes:
        return "array-v3"
    return "array-v2" if len(batch) > 2 or longest > 6 else "array-v1"


def _describe(obj: Any) -> str:
    text = repr(obj)
    return f"{type(obj).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# ---- writing --------------------------------------------------------------------------------------
def encode_batch(ts: float, events: list[WireEvent], rank: int | None = None, dialect: str = "map") -> bytes:
    """A batch as a publisher of `dialect` writes it (what kvscope's own publisher and the tests send)."""
    if dialect not in DIALECTS:
        raise KvscopeError(f"unknown KV event dialect {dialect!r}: kvscope writes {', '.join(DIALECTS)}")
    if dialect == "map":
        body: Any = {"ts": ts, "events": [_event_map(e) for e in events]}
        if rank is not None:
            body["data_parallel_rank"] = rank
    else:
        body = [ts, [_event_array(e, dialect) for e in events]]
        if dialect != "array-v1":
            body.append(rank)
    return msgpack.packb(body, use_bin_type=True)


def _wire_hash(value: bytes, dialect: str) -> int | bytes:
    """Earlier layouts carry integers: a hash longer than 8 bytes goes as its low 64 bits, as vLLM sends it."""
    if dialect == "array-v3" or dialect == "map":
        return value
    return int.from_bytes(value, "big") & HASH_MASK


def _event_array(e: WireEvent, dialect: str) -> list:
    if e.tag == CLEARED:
        return [CLEARED]
    hashes = [_wire_hash(h, dialect) for h in e.block_hashes]
    if e.tag == REMOVED:
        return [REMOVED, hashes] if dialect == "array-v1" else [REMOVED, hashes, e.medium]
    parent = None if e.parent_hash is None else _wire_hash(e.parent_hash, dialect)
    out = [STORED, hashes, parent, list(e.token_ids), e.block_size, e.lora_id]
    if dialect != "array-v1":
        out.append(e.medium)
    if dialect == "array-v3":
        out += [e.lora_name, None if e.extra_keys is None else list(e.extra_keys)]
    return out


def _event_map(e: WireEvent) -> dict:
    if e.tag == CLEARED:
        return {"type": CLEARED}
    if e.tag == REMOVED:
        out = {"type": REMOVED, "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.group_idx is not None:
            out["group_idx"] = e.group_idx
        return out
    out = {"type": STORED, "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_hash,
           "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": e.lora_id, "medium": e.medium,
           "lora_name": e.lora_name}
    optional = {"extra_keys": None if e.extra_keys is None else list(e.extra_keys), "group_idx": e.group_idx,
                "kv_cache_spec_kind": e.group_kind, "kv_cache_spec_sliding_window": e.sliding_window}
    out.update({k: v for k, v in optional.items() if v is not None})  # msgspec's omit_defaults
    return out


def token_array(tokens: tuple[int, ...]) -> np.ndarray:
    arr = np.array(tokens, dtype=np.int64)
    arr.flags.writeable = False
    return arr
