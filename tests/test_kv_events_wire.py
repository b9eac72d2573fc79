"""vLLM's and SGLang's KV event batches as kvscope reads them (engine/watch/kv_events/formats.py, and the subscriber's
conversion in engine/watch/kv_events/subscriber.py): every wire layout, integer hashes signed and unsigned and byte
hashes, fields and event kinds from a later version, payloads that are no batch, the subscriber's fast path against
the full reader, and the endpoints `kvscope attach --vllm` takes. No sockets here: tests/test_kv_events_subscriber.py
has those."""
from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from engine import events as ev
from engine.errors import KvscopeError
from engine.watch.kv_events.formats import (
    CLEARED,
    DIALECTS,
    REMOVED,
    STORED,
    WireError,
    WireEvent,
    batch_from_object,
    decode_batch,
    encode_batch,
    unpack_payload,
)
from engine.watch.kv_events.subscriber import Endpoint, block_events, fast_block_events, parse_endpoint, record_maker
from tests.kv_events_publisher import with_unknown_fields, with_unknown_tag

WORKER = 3


def h(n: int) -> bytes:
    return n.to_bytes(8, "big")


def sample_events(dialect: str) -> list[WireEvent]:
    """What a worker says in one step, with every field its layout carries set to something other than a default."""
    later = dialect in ("array-v3", "map")
    hashes = (bytes(range(32)), bytes(range(1, 33))) if later else (h(11), h(12))
    stored = WireEvent(STORED, hashes, None, tuple(range(100, 108)), 4, lora_id=7,
                       medium="CPU" if dialect != "array-v1" else None,
                       lora_name="sql-adapter" if later else None,
                       extra_keys=(["mm-1", 0], None) if later else None,
                       group_idx=1 if dialect == "map" else None,
                       group_kind="sliding_window" if dialect == "map" else None,
                       sliding_window=512 if dialect == "map" else None)
    child = WireEvent(STORED, (h(13),), hashes[1], (9, 9, 9, 9), 4)
    return [stored, child, WireEvent(REMOVED, (hashes[0],), medium=stored.medium, group_idx=stored.group_idx),
            WireEvent(REMOVED, (h(13),)), WireEvent(CLEARED)]


def converted(payload: bytes, worker: int = WORKER):
    """The full reader's events, and the fast path's (None where it leaves the batch to the full reader)."""
    obj = unpack_payload(payload)
    return block_events(worker, batch_from_object(obj)), fast_block_events(obj, lambda rank: worker)


def event_fields(event: ev.Event) -> dict:
    fields = {k: v for k, v in vars(event).items() if k not in ("seq_no", "time")}
    for k, v in fields.items():
        if isinstance(v, np.ndarray):
            fields[k] = (v.dtype.str, v.tolist(), v.flags.writeable)
    return {"kind": type(event).__name__, **fields}


def same_conversion(a, b) -> None:
    assert [event_fields(e) for e in a.events] == [event_fields(e) for e in b.events]
    assert (a.rank, a.dialect, a.wire_events, a.blocks_stored, a.blocks_removed, a.unknown_tags, a.unknown_fields) == \
           (b.rank, b.dialect, b.wire_events, b.blocks_stored, b.blocks_removed, b.unknown_tags, b.unknown_fields)


# ---- every layout ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_layout_reads_back_what_was_written(dialect):
    events = sample_events(dialect)
    rank = None if dialect == "array-v1" else 2
    batch = decode_batch(encode_batch(1700000000.25, events, rank, dialect))
    assert batch.dialect == dialect and batch.rank == rank and batch.ts == 1700000000.25
    assert batch.unknown_fields == batch.unknown_tags == 0
    assert [e.tag for e in batch.events] == [STORED, STORED, REMOVED, REMOVED, CLEARED]
    first = batch.events[0]
    assert first.block_hashes == events[0].block_hashes and first.token_ids == tuple(range(100, 108))
    assert (first.lora_id, first.medium, first.lora_name, first.group_idx, first.group_kind, first.sliding_window) == \
           (7, events[0].medium, events[0].lora_name, events[0].group_idx, events[0].group_kind, events[0].sliding_window)
    assert first.extra_keys == (None if events[0].extra_keys is None else (["mm-1", 0], None))
    assert batch.events[1].parent_hash == events[0].block_hashes[1]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_batch_becomes_the_blocks_it_says(dialect):
    events = sample_events(dialect)
    full, fast = converted(encode_batch(12.5, events, None if dialect == "array-v1" else 0, dialect))
    assert fast is not None  # the usual batch of every layout takes the fast path
    same_conversion(full, fast)
    stored, child, *removals, cleared = full.events
    assert isinstance(stored, ev.BlocksStored) and stored.worker == WORKER and stored.ts == 12.5
    assert stored.block_hashes == events[0].block_hashes and stored.parent_hash is None and stored.block_size == 4
    assert stored.token_ids.dtype == np.int64 and stored.token_ids.tolist() == list(range(100, 108))
    assert not stored.token_ids.flags.writeable
    assert stored.medium == (events[0].medium or ev.MEDIUM_GPU) and child.medium == ev.MEDIUM_GPU
    assert stored.lora == (events[0].lora_name or "id 7")  # the name where the layout has one, else the id
    assert stored.group == (events[0].group_idx or 0) and stored.sliding_window == (events[0].sliding_window or 0)
    assert stored.group_kind == (events[0].group_kind or "")
    assert stored.extra_keys == (("mm-1, 0", "") if events[0].extra_keys else ())
    assert child.parent_hash == events[0].block_hashes[1] and child.extra_keys == ()
    assert all(isinstance(r, ev.BlocksRemoved) and r.worker == WORKER for r in removals)
    if (stored.medium, stored.group) == (ev.MEDIUM_GPU, 0):  # array-v1 says no tier: both removals are one event
        assert [r.block_hashes for r in removals] == [(events[0].block_hashes[0], h(13))]
    else:
        assert [(r.block_hashes, r.medium, r.group) for r in removals] == [
            ((events[0].block_hashes[0],), stored.medium, stored.group), ((h(13),), ev.MEDIUM_GPU, 0)]
    assert isinstance(cleared, ev.BlocksCleared) and cleared.worker == WORKER and cleared.cause == ""
    assert (full.blocks_stored, full.blocks_removed, full.wire_events) == (3, 2, 5)


def test_consecutive_removals_of_one_tier_become_one_event():
    """vLLM evicts block by block, one BlockRemoved each: one BlocksRemoved says the same."""
    events = [WireEvent(REMOVED, (h(1),)), WireEvent(REMOVED, (h(2), h(3))), WireEvent(REMOVED, (h(4),), medium="CPU"),
              WireEvent(REMOVED, (h(5),), medium="CPU"), WireEvent(STORED, (h(6),), None, (1, 2), 2),
              WireEvent(REMOVED, (h(7),)), WireEvent(REMOVED, ())]
    full, fast = converted(encode_batch(1.0, events, 0, "map"))
    same_conversion(full, fast)
    assert [(type(e).__name__, getattr(e, "block_hashes", ()), getattr(e, "medium", "")) for e in full.events] == [
        ("BlocksRemoved", (h(1), h(2), h(3)), "GPU"), ("BlocksRemoved", (h(4), h(5)), "CPU"),
        ("BlocksStored", (h(6),), "GPU"), ("BlocksRemoved", (h(7),), "GPU")]
    assert full.blocks_removed == 6 and full.wire_events == 7


def test_sglang_batches_are_array_v1_without_a_rank():
    """SGLang's batches are [ts, events]: its ranks are told apart by the port they publish on."""
    payload = msgpack.packb([3.5, [[STORED, [1, 2], None, [5, 6, 7, 8], 2, None], [REMOVED, [1]]]])
    full, fast = converted(payload)
    same_conversion(full, fast)
    assert full.dialect == "array-v1" and full.rank is None
    assert [type(e).__name__ for e in full.events] == ["BlocksStored", "BlocksRemoved"]


# ---- hashes -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["array", "map"])
def test_integer_hashes_signed_and_unsigned_are_their_8_bytes(layout):
    """Older vLLMs sent Python's hash() (signed 64 bits), later ones the low 64 bits of sha256 (unsigned), and
    vLLM main sends 32 bytes: each is its bytes, an integer as unsigned big-endian, so -1 and 2**64-1 are one hash."""
    cases = [(-1, b"\xff" * 8), (2**64 - 1, b"\xff" * 8), (-(2**63), b"\x80" + b"\x00" * 7), (0, bytes(8)),
             (2**63 + 5, (2**63 + 5).to_bytes(8, "big")), (b"\x01" * 32, b"\x01" * 32)]
    for value, expected in cases:
        parent = -2
        if layout == "array":
            payload = msgpack.packb([1.0, [[STORED, [value], parent, [1], 1, None], [REMOVED, [value]]], 0],
                                    use_bin_type=True)
        else:
            payload = msgpack.packb({"ts": 1.0, "events": [
                {"type": STORED, "block_hashes": [value], "parent_block_hash": parent, "token_ids": [1],
                 "block_size": 1, "lora_id": None, "medium": None, "lora_name": None},
                {"type": REMOVED, "block_hashes": [value], "medium": None}]}, use_bin_type=True)
        full, fast = converted(payload)
        same_conversion(full, fast)
        stored, removed = full.events
        assert stored.block_hashes == (expected,) == removed.block_hashes, value
        assert stored.parent_hash == (2**64 - 2).to_bytes(8, "big")


def test_a_hash_that_is_neither_integer_nor_bytes_is_no_batch():
    for bad in ("abc", 1.5, True, None, [1]):
        payload = msgpack.packb([1.0, [[REMOVED, [bad]]]], use_bin_type=True)
        with pytest.raises(WireError, match="a block hash must be an integer or bytes"):
            decode_batch(payload)
        assert fast_block_events(unpack_payload(payload), lambda rank: 0) is None


# ---- later versions, and what is not a batch -----------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", DIALECTS)
def test_unknown_fields_and_event_kinds_are_counted_and_skipped(dialect):
    events = sample_events(dialect)[:3]
    plain = encode_batch(2.0, events, 1, dialect)
    changed = msgpack.packb(with_unknown_tag(with_unknown_fields(msgpack.unpackb(plain))), use_bin_type=True)
    batch = decode_batch(changed)
    assert batch.unknown_tags == 1 and batch.unknown_tag_names == {"BlockTouched"}
    assert batch.unknown_fields == 4  # one per event (3) and one in the batch
    assert [e.tag for e in batch.events] == [STORED, STORED, REMOVED]
    obj = unpack_payload(changed)
    assert fast_block_events(obj, lambda rank: 0) is None  # left to the full reader, which counts them
    full = block_events(0, batch_from_object(obj))
    usual = block_events(0, decode_batch(plain))
    assert [event_fields(e) for e in full.events] == [event_fields(e) for e in usual.events]
    assert (full.unknown_tags, full.unknown_fields, full.wire_events) == (1, 4, 4)


@pytest.mark.parametrize("payload,message", [
    (b"\xc1", "not msgpack"),
    (b"", "not msgpack"),
    (msgpack.packb("hello"), "a batch is"),
    (msgpack.packb([1.0]), "a batch is"),
    (msgpack.packb(["now", []]), "ts must be a number"),
    (msgpack.packb([1.0, {"a": 1}]), "events must be a list"),
    (msgpack.packb([1.0, [], "rank 0"]), "data_parallel_rank must be an integer"),
    (msgpack.packb([1.0, [42]]), "an event is a tagged array or map"),
    (msgpack.packb([1.0, [[STORED, [1], None, [1, "x"], 1, None]]]), "token_ids must be a list of integers"),
    (msgpack.packb([1.0, [[STORED, [1], None, [1], 0, None]]]), "block_size must be a positive integer"),
    (msgpack.packb([1.0, [[STORED, [1], None, [1], True, None]]]), "block_size must be a positive integer"),
    (msgpack.packb([1.0, [[STORED, [1], None, [1], 1, "lora"]]]), "lora_id must be int or nil"),
    (msgpack.packb([1.0, [[REMOVED, [1], 5]]]), "medium must be str or nil"),
    (msgpack.packb({"ts": 1.0, "events": [{"type": STORED, "block_hashes": [1], "token_ids": [1], "block_size": 1,
                                            "kv_cache_spec_sliding_window": "wide"}]}),
     "kv_cache_spec_sliding_window must be int or nil"),
    (msgpack.packb([1.0, [[REMOVED, "not a list"]]]), "block_hashes must be a list"),
])
def test_what_is_not_a_batch_is_a_wire_error_and_never_takes_the_fast_path(payload, message):
    with pytest.raises(WireError, match=message):
        decode_batch(payload)
    try:
        obj = unpack_payload(payload)
    except WireError:
        return
    assert fast_block_events(obj, lambda rank: 0) is None


def test_token_ids_beyond_int64_are_refused_by_both_paths():
    payload = msgpack.packb([1.0, [[STORED, [1], None, [2**63], 1, None]]])
    obj = unpack_payload(payload)
    with pytest.raises(OverflowError):
        fast_block_events(obj, lambda rank: 0)
    with pytest.raises(OverflowError):
        block_events(0, batch_from_object(obj))


def random_batch(rng: random.Random, dialect: str) -> tuple[list[WireEvent], int | None]:
    later = dialect in ("array-v3", "map")
    events = []
    for _ in range(rng.randrange(0, 12)):
        kind = rng.choice((STORED, STORED, REMOVED, REMOVED, CLEARED))
        n = rng.randrange(0, 4)
        hashes = tuple(rng.randbytes(32 if later and rng.random() < 0.5 else 8) for _ in range(n))
        medium = rng.choice((None, "GPU", "CPU")) if dialect != "array-v1" else None
        group = rng.choice((None, 0, 1)) if dialect == "map" else None
        if kind == STORED:
            size = rng.choice((1, 4, 16))
            events.append(WireEvent(STORED, hashes, rng.choice((None, rng.randbytes(8))),
                                    tuple(rng.randrange(-5, 2**40) for _ in range(n * size)), size,
                                    lora_id=rng.choice((None, 3)), medium=medium,
                                    lora_name=rng.choice((None, "", "a")) if later else None,
                                    extra_keys=tuple(rng.choice((None, "k", ["x", 1], b"\x01")) for _ in hashes)
                                    if later and rng.random() < 0.5 else None,
                                    group_idx=group,
                                    group_kind=rng.choice((None, "full_attention")) if dialect == "map" else None,
                                    sliding_window=rng.choice((None, 0, 128)) if dialect == "map" else None))
        elif kind == REMOVED:
            events.append(WireEvent(REMOVED, hashes, medium=medium, group_idx=group))
        else:
            events.append(WireEvent(CLEARED))
    return events, None if dialect == "array-v1" else rng.choice((None, 0, 3))


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_fast_path_gives_the_full_readers_events(dialect):
    rng = random.Random(dialect)
    for _ in range(300):
        events, rank = random_batch(rng, dialect)
        full, fast = converted(encode_batch(rng.random() * 1e9, events, rank, dialect))
        assert fast is not None
        same_conversion(full, fast)


ODD_VALUES = [None, 0, 1, -1, 2**63, True, 1.5, "x", "GPU", b"\x01" * 8, b"", [], [1], [b"a"], ["a"], {"a": 1}]


def odd_event(rng: random.Random):
    """An event as a careless or future publisher might send it: right or wrong values in right or wrong places."""
    roll = rng.random()
    if roll < 0.4:
        event = [STORED] + [rng.choice(ODD_VALUES) for _ in range(rng.randrange(0, 11))]
        if len(event) >= 6 and rng.random() < 0.7:
            event[1:5] = [[rng.choice((1, -5, b"\x02" * 8, b"\x03" * 32)) for _ in range(rng.randrange(0, 3))],
                          rng.choice((None, 7, b"\x09" * 8)), [rng.randrange(100) for _ in range(rng.randrange(0, 9))],
                          rng.choice((1, 4, 0, -1, True))]
        return event
    if roll < 0.55:
        return [rng.choice((REMOVED, CLEARED, "BlockTouched"))] + [rng.choice(ODD_VALUES)
                                                                   for _ in range(rng.randrange(0, 4))]
    if roll < 0.95:
        event = {"type": rng.choice((STORED, REMOVED, CLEARED, "BlockTouched", None))}
        names = sorted({"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "future"})
        for name in rng.sample(names, rng.randrange(0, 8)):
            event[name] = rng.choice(ODD_VALUES)
        if rng.random() < 0.5:
            event.update(block_hashes=[1, 2], token_ids=[1, 2, 3, 4], block_size=2)
        return event
    return rng.choice(ODD_VALUES)


def test_the_fast_path_takes_only_what_the_full_reader_reads_the_same():
    """Whatever a publisher sends, the fast path gives the full reader's events or leaves the batch to it."""
    rng = random.Random(29)
    taken = 0
    for _ in range(3000):
        events = [odd_event(rng) for _ in range(rng.randrange(0, 4))]
        obj = rng.choice(([rng.choice((1.0, 2, "t")), events] + [rng.choice((None, 0, "r"))] * rng.randrange(0, 3),
                          {"ts": 1.0, "events": events, **({"data_parallel_rank": 1} if rng.random() < 0.5 else {})}))
        obj = unpack_payload(msgpack.packb(obj, use_bin_type=True))
        try:
            full, failure = block_events(0, batch_from_object(obj)), None
        except (WireError, OverflowError) as e:
            full, failure = None, type(e)
        try:
            fast = fast_block_events(obj, lambda rank: 0)
        except OverflowError:
            assert failure is OverflowError
            continue
        if fast is not None:
            taken += 1
            assert full is not None, obj
            same_conversion(full, fast)
    assert taken > 300  # the odd batches it takes are still many


def test_record_maker_makes_what_the_constructor_makes():
    made = record_maker(ev.BlocksStored)
    assert made is not ev.BlocksStored
    tokens = np.arange(4)
    args = (1, (h(1),), h(0), tokens, 4, "CPU", "a", 2, "sliding_window", 16, ("x",), 3.5)
    fast, slow = made(*args), ev.BlocksStored(*args)
    assert type(fast) is ev.BlocksStored and vars(fast) == vars(slow)
    assert fast.seq_no == -1 and fast.time == 0.0 and fast.kind == "BlocksStored"
    with pytest.raises(AttributeError):  # still frozen
        fast.worker = 2

    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Checked(ev.Event):
        n: int

        def __post_init__(self):
            if self.n < 0:
                raise ValueError("n < 0")

    assert record_maker(Checked) is Checked  # an __init__ that does more is not skipped


# ---- endpoints ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,endpoint", [
    ("tcp://10.0.0.5:5557", Endpoint("tcp://10.0.0.5:5557")),
    ("tcp://gpu-box.lan:5557,tcp://gpu-box.lan:5558", Endpoint("tcp://gpu-box.lan:5557", "tcp://gpu-box.lan:5558")),
    (" tcp://h:1 , tcp://h:2 ", Endpoint("tcp://h:1", "tcp://h:2")),
    ("tcp://[::1]:5557", Endpoint("tcp://[::1]:5557")),
    ("ipc:///tmp/kv.sock", Endpoint("ipc:///tmp/kv.sock")),
])
def test_endpoints_that_are_read(text, endpoint):
    assert parse_endpoint(text) == endpoint
    assert parse_endpoint(str(endpoint)) == endpoint


@pytest.mark.parametrize("text,message", [
    ("localhost:5557", "KV event endpoint 'localhost:5557' has no tcp:// in front; an endpoint is tcp://HOST:PORT"),
    ("tcp://*:5557", "'tcp://\\*:5557' is where a publisher binds: kvscope connects to it"),
    ("tcp://0.0.0.0:5557", "is where a publisher binds"),
    ("tcp://h:1,tcp://[::]:5558", "the replay address .tcp://\\[::\\]:5558. is where a publisher binds"),
    ("tcp://h", "'tcp://h' is not tcp://HOST:PORT"),
    ("tcp://h:port", "is not tcp://HOST:PORT"),
    ("udp://h:5557", "is not tcp://HOST:PORT"),
    ("tcp://h:0", "port 0 is not in 1..65535"),
    ("tcp://h:70000", "port 70000 is not in 1..65535"),
    ("tcp://h:1,", "the replay address '' has no tcp:// in front"),
    ("tcp://h:1,h:2", "the replay address 'h:2' has no tcp:// in front"),
    ("tcp://h:1,tcp://h:2,tcp://h:3", "has 3 addresses"),
    ("tcp://h:1,tcp://h:1", "the replay endpoint must differ"),
    ("", "KV event endpoint '' has no tcp:// in front"),
])
def test_endpoints_that_are_refused_say_why(text, message):
    with pytest.raises(KvscopeError, match=message):
        parse_endpoint(text)
