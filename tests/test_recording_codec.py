"""The event codec (engine/watch/codec.py): every record class of engine.events round-trips, built from
its own annotations so that classes added later are covered without touching this file; arrays keep
dtype, shape and values; compatibility rules within one schema version; clear errors on bad bytes."""
from __future__ import annotations

import dataclasses
import types
import typing

import msgpack
import numpy as np
import pytest

from engine import events as ev
from engine.watch.codec import (
    CodecError,
    decode_event,
    encode_event,
    engine_events_class,
)
from engine.watch.mirror import data_differences, record_data


def sample_value(hint, depth: int = 0):
    """A value of the annotated type, varied by `depth` so that nested values differ."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is int:
        return 7 + depth
    if hint is float:
        return 0.25 + depth
    if hint is str:
        return f"text {depth} é"
    if hint is bool:
        return True
    if hint is bytes:
        return bytes([depth, 0xFF, 0x00]) + b"hash"  # a block hash: msgpack bin, zero and high bytes included
    if hint is np.ndarray:
        return np.arange(3 + depth, dtype=np.int64)
    if origin in (typing.Union, types.UnionType):
        return sample_value(next(a for a in args if a is not type(None)), depth)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (sample_value(args[0], depth + 1), sample_value(args[0], depth + 2))
        return tuple(sample_value(a, depth + 1) for a in args)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return sample_record(hint, depth + 1)
    raise AssertionError(f"sample_value has no sample for {hint!r}: add one so that the new field is covered")


def sample_record(cls: type, depth: int = 0):
    hints = typing.get_type_hints(cls, vars(ev))
    kwargs = {f.name: sample_value(hints[f.name], depth) for f in dataclasses.fields(cls)
              if f.init and f.name not in ("seq_no", "time")}
    return cls(**kwargs)


def stamped(event: ev.Event, seq_no: int = 41, t: float = 1234.5) -> ev.Event:
    object.__setattr__(event, "seq_no", seq_no)
    object.__setattr__(event, "time", t)
    return event


EVENT_CLASSES = [cls for name in dir(ev) if (cls := engine_events_class(name)) is not None and issubclass(cls, ev.Event)
                 and cls is not ev.Event]


def test_the_event_classes_are_found():
    names = {cls.__name__ for cls in EVENT_CLASSES}
    assert {"CellsAllocated", "MemorySnapshot", "ContextCreated", "DeviceMemoryState", "Vocabulary"} <= names


@pytest.mark.parametrize("cls", EVENT_CLASSES, ids=lambda c: c.__name__)
def test_every_event_class_round_trips(cls):
    event = stamped(sample_record(cls))
    back = decode_event(encode_event(event))
    assert type(back) is cls
    assert (back.seq_no, back.time) == (41, 1234.5)
    assert data_differences(record_data(event), record_data(back)) == []
    assert encode_event(back) == encode_event(event)


def cells(stream: int, idx: list[int], seqs: list[set[int]], head: int) -> ev.StreamCells:
    matrix = np.zeros((256, len(idx)), dtype=bool)
    for j, s in enumerate(seqs):
        matrix[list(s), j] = True
    return ev.StreamCells(stream, ev._frozen_array(idx), ev._frozen_array([10 + i for i in idx]),
                          ev._frozen_array([0] * len(idx)), ev.pack_seq_bits(matrix), head)


def test_a_cells_event_keeps_arrays_exactly():
    event = stamped(ev.CellsAllocated(cache="swa", changes=(cells(0, [3, 4], [{0}, {0, 255}], 5),
                                                            cells(2, [9], [{7}], 10)),
                                      tentative=True, cause="request admitted", ubatch=1, n_tokens=3,
                                      tokens=(ev._frozen_array([5, 6]), ev._frozen_array([8]))))
    back = decode_event(encode_event(event))
    assert back.changes[0].seq_sets() == [frozenset({0}), frozenset({0, 255})]
    for a, b in zip(event.changes, back.changes):
        for name in ("cells", "pos", "shift", "seq_bits"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
            assert not y.flags.writeable  # read-only, like the engine's
    assert back.tentative and back.cause == "request admitted" and back.tokens[1].tolist() == [8]


@pytest.mark.parametrize("arr", [np.zeros((0,), np.int64), np.arange(12, dtype=np.float32).reshape(3, 4),
                                 np.array([[1.5, -2]], dtype=">f8"), np.array(7, dtype=np.int16),
                                 np.arange(10, dtype=np.int32)[::3], np.array(["ab", "c"]),
                                 np.ones((2, 0, 3), dtype=bool)], ids=lambda a: f"{a.dtype.str}{a.shape}")
def test_arrays_of_any_plain_dtype_and_shape(arr):
    event = stamped(ev.KShiftApplied(cache="kv", changes=(), amounts=(arr,)))
    back = decode_event(encode_event(event)).amounts[0]
    assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)


def test_numpy_scalars_sets_and_none_are_values():
    event = stamped(ev.DeviceMemoryChanged(device="VGPU0", virtual=np.bool_(True), capacity=None,
                                           reserved=np.int64(1 << 40), what="kv", delta=np.int32(-5)))
    back = decode_event(encode_event(event))
    assert (back.virtual, back.capacity, back.reserved, back.delta) == (True, None, 1 << 40, -5)
    with_set = stamped(ev.DecodeStarted(n_tokens=1, n_outputs=1, seq_ids=frozenset({3, 1})))
    assert decode_event(encode_event(with_set)).seq_ids == frozenset({1, 3})


def test_values_without_an_encoding_are_refused_by_name():
    with pytest.raises(CodecError, match="DecodeStarted.*complex"):
        encode_event(ev.DecodeStarted(n_tokens=1, n_outputs=1, seq_ids=(1j,)))
    with pytest.raises(CodecError, match="dtype object"):
        encode_event(ev.KShiftApplied(cache="kv", changes=(), amounts=(np.array([None, 1]),)))

    @dataclasses.dataclass(frozen=True)
    class Elsewhere:
        x: int

    with pytest.raises(CodecError, match="Elsewhere has no encoding: only the records of engine.events"):
        encode_event(ev.DecodeStarted(n_tokens=1, n_outputs=1, seq_ids=(Elsewhere(1),)))


def raw_event(kind: str, fields: dict, seq_no: int = 3, t: float = 2.0) -> bytes:
    return msgpack.packb([kind, seq_no, t, fields], use_bin_type=True)


def test_an_unknown_field_is_dropped_and_a_missing_default_is_filled():
    """Within one schema version fields are only added, with a default (docs/recording-format.md)."""
    back = decode_event(raw_event("DecodeStarted", {"n_tokens": 4, "n_outputs": 1, "seq_ids": (0,),
                                                    "added_by_a_newer_kvscope": "x"}))
    assert (back.n_tokens, back.step, back.seq_no, back.time) == (4, -1, 3, 2.0)
    assert not hasattr(back, "added_by_a_newer_kvscope")


def test_an_unknown_kind_or_a_missing_required_field_is_a_clear_error():
    with pytest.raises(CodecError, match="unknown event or record kind 'SomethingNew'.*newer kvscope"):
        decode_event(raw_event("SomethingNew", {}))
    with pytest.raises(CodecError, match="DecodeStarted lacks the field\\(s\\) n_outputs, seq_ids"):
        decode_event(raw_event("DecodeStarted", {"n_tokens": 4}))
    with pytest.raises(CodecError, match="StreamCells is a record of engine.events, not an event"):
        decode_event(raw_event("StreamCells", {}))
    with pytest.raises(CodecError, match="'EventBus'"):  # in engine.events, but not a record
        decode_event(raw_event("EventBus", {}))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb([1, 2, 3, 4]),
                                  msgpack.packb(["DecodeStarted", "x", 1.0, {}]),
                                  msgpack.packb([msgpack.ExtType(9, b"")]), b"\x92\x01"])
def test_bytes_that_are_no_event_raise_codec_error(data):
    with pytest.raises(CodecError):
        decode_event(data)


def test_a_damaged_array_is_a_codec_error():
    good = encode_event(stamped(ev.KShiftApplied(cache="kv", changes=(), amounts=(np.arange(4),))))
    shape_4 = b"\x01" + (4).to_bytes(8, "little")  # ndim 1, shape (4,)
    assert good.count(shape_4) == 1
    with pytest.raises(CodecError, match="shape \\(5,\\) and dtype int64 needs 40 bytes, the data has 32"):
        decode_event(good.replace(shape_4, b"\x01" + (5).to_bytes(8, "little")))
