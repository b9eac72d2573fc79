"""Arguments of the wrong type are refused at the public entry points, before anything changes, with an
error naming the call, the argument and the value (engine/arguments.py says what counts as what).

Before these checks, `seq_rm("0", ...)` or `seq_add(0, 0, -1, 1.5)` failed deep inside numpy with a
TypeError or IndexError that named nothing, and numpy silently turned a float token into an int."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import engine
from engine.batch import Batch
from engine.errors import ArgumentTypeError
from tests.model_factory import in_memory_model


@pytest.fixture(scope="module")
def model():
    return in_memory_model()


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_hf):
    return engine.load_model(tiny_gemma3_hf)


def state_of(ctx: engine.Context):
    """Cells, heads and pending copies of every cache, and the K/V bytes."""
    return ([(c.cells(s), c.head(s)) for c in ctx.memory.caches() for s in range(c.n_stream)],
            [copy.deepcopy(c.pending_copies) for c in ctx.memory.caches()],
            [r.data.clone() for c in ctx.memory.caches() for r in c.k + c.v])


def same_state(a, b) -> bool:
    return a[:2] == b[:2] and all(x.equal(y) for x, y in zip(a[2], b[2]))


@pytest.fixture(params=["plain", "iswa"])
def ctx(request, model, gemma3):
    m = model if request.param == "plain" else gemma3
    c = engine.Context(m, n_ctx=32, pad=8, n_seq_max=2, kv_unified=True, type_k="f32", type_v="f32")
    assert c.decode(Batch.for_sequence([5, 6, 7, 8], 0, 0)) == 0
    return c


MEMORY_CALLS = [
    (lambda m: m.seq_rm("0", -1, -1), "seq_rm: seq_id must be an int, got '0' (str)"),
    (lambda m: m.seq_rm(0, "1", -1), "seq_rm: p0 must be an int, got '1' (str)"),
    (lambda m: m.seq_rm(0, 1, 2.0), "seq_rm: p1 must be an int, got 2.0 (float)"),
    (lambda m: m.seq_keep(None), "seq_keep: seq_id must be an int, got None (NoneType)"),
    (lambda m: m.seq_cp(0, 1.0, -1, -1), "seq_cp: dst must be an int, got 1.0 (float)"),
    (lambda m: m.seq_cp([0], 1, -1, -1), "seq_cp: src must be an int, got [0] (list)"),
    (lambda m: m.seq_add(0, 0, -1, 1.5), "seq_add: delta must be an int, got 1.5 (float)"),
    (lambda m: m.seq_add(0, "0", -1, 1), "seq_add: p0 must be an int, got '0' (str)"),
    (lambda m: m.seq_div(0, 0, -1, "2"), "seq_div: d must be an int, got '2' (str)"),
    (lambda m: m.seq_pos_max("0"), "seq_pos_max: seq_id must be an int, got '0' (str)"),
    (lambda m: m.seq_pos_min(0.0), "seq_pos_min: seq_id must be an int, got 0.0 (float)"),
    (lambda m: m.clear("no"), "clear: data must be True or False, got 'no' (str)"),
    (lambda m: m.clear(2), "clear: data must be True or False, got 2 (int)"),
]


@pytest.mark.parametrize("call,message", MEMORY_CALLS)
def test_memory_operations_name_the_argument_and_change_nothing(ctx, call, message):
    before = state_of(ctx)
    with pytest.raises(ArgumentTypeError) as err:
        call(ctx.memory)
    assert str(err.value) == message
    assert isinstance(err.value, TypeError) and isinstance(err.value, engine.KvscopeError)
    assert same_state(before, state_of(ctx))


def test_cache_views_check_the_stream(model):
    ctx = engine.Context(model, n_ctx=16, pad=8, n_seq_max=2)
    for view in ("cells", "head", "used"):
        with pytest.raises(ArgumentTypeError, match=f"{view}: stream must be an int, got '1'"):
            getattr(ctx.memory, view)("1")


def test_numpy_integers_and_bools_are_accepted_as_c_would(ctx):
    mem = ctx.memory
    assert mem.seq_pos_max(np.int64(0)) == 3 and mem.seq_pos_max(np.int32(0)) == 3
    mem.seq_cp(np.int16(0), True, np.int64(-1), -1)  # True is seq 1, as C converts it
    assert mem.seq_pos_max(1) == 3
    mem.seq_rm(np.uint8(1), np.int64(2), -1)
    assert mem.seq_pos_max(1) == 1
    mem.seq_keep(np.int64(0))
    assert mem.seq_pos_max(1) == -1 and mem.seq_pos_max(0) == 3
    mem.clear(np.bool_(False))
    assert mem.seq_pos_max(0) == -1


@pytest.mark.parametrize("fields,message", [
    (dict(tokens=[5, "6"]), "Batch: tokens[1] must be an int, got '6' (str)"),
    (dict(tokens=[5, 6.7]), "Batch: tokens[1] must be an int, got 6.7 (float)"),
    (dict(tokens="56"), "Batch: tokens must be a sequence of ints, got str"),
    (dict(tokens=[5, 6], pos=[0, None]), "Batch: pos[1] must be an int, got None (NoneType)"),
    (dict(tokens=[5, 6], seq_ids=[[0], 0]), "Batch: seq_ids[1] must be a list of ints, got 0 (int)"),
    (dict(tokens=[5, 6], seq_ids=[[0], ["0"]]), "Batch: seq_ids[1][0] must be an int, got '0' (str)"),
    (dict(tokens=[5, 6], logits=[True, "yes"]), "Batch: logits[1] must be an int, got 'yes' (str)"),
])
def test_batch_fields_are_checked_when_the_batch_is_made(fields, message):
    with pytest.raises(ArgumentTypeError) as err:
        Batch(**fields)
    assert str(err.value) == message


def test_a_batch_changed_after_it_was_made_is_checked_again_by_decode(model):
    ctx = engine.Context(model, n_ctx=16, pad=8)
    batch = Batch([5, 6], [0, 1], [[0], [0]])
    batch.tokens[1] = 6.5
    with pytest.raises(ArgumentTypeError, match=r"tokens\[1\] must be an int, got 6.5"):
        ctx.decode(batch)
    assert ctx.memory.seq_pos_max(0) == -1


def test_batch_fields_accept_numpy_arrays_and_int8_output_flags(model):
    ctx = engine.Context(model, n_ctx=16, pad=8)
    batch = Batch(np.array([5, 6, 7], dtype=np.int32), np.arange(3), [np.array([0])] * 3,
                  np.array([0, 2, 1], dtype=np.int8))  # llama.cpp's logits field: nonzero = output
    assert ctx.decode(batch) == 0
    assert ctx.n_outputs == 2


@pytest.mark.parametrize("settings,message", [
    (dict(n_ctx="512"), "Context: n_ctx must be an int, got '512' (str)"),
    (dict(n_ctx=512.0), "Context: n_ctx must be an int, got 512.0 (float)"),
    (dict(n_batch=None), "Context: n_batch must be an int, got None (NoneType)"),
    (dict(n_seq_max="2"), "Context: n_seq_max must be an int, got '2' (str)"),
    (dict(kv_unified="yes"), "Context: kv_unified must be True or False, got 'yes' (str)"),
    (dict(swa_full=2), "Context: swa_full must be True or False, got 2 (int)"),
    (dict(type_k=8), "Context: type_k must be a str, got 8 (int)"),
    (dict(flash_attn=True), "Context: flash_attn must be a str, got True (bool)"),
    (dict(n_gpu_layers="all"), "Context: n_gpu_layers must be an int, got 'all' (str)"),
    (dict(tensor_split="3,1"), "Context: tensor_split must be a list (each item a number), got '3,1' (str)"),
    (dict(tensor_split=[1, "a"]), "Context: tensor_split[1] must be a number, got 'a' (str)"),
    (dict(devices="VGPU0=1GiB"), "Context: devices must be a list (each item a device name ('CUDA0', "
                                 "'VGPU0=2GiB') or an engine.placement.devices.Device), got 'VGPU0=1GiB' (str)"),
    (dict(tensor_overrides="ffn_.*=CPU"), "Context: tensor_overrides must be a list (each item a str), got "
                                          "'ffn_.*=CPU' (str)"),
    (dict(bus=object), "Context: bus must be an engine.EventBus or None, got type"),
    (dict(abort_callback=True), "Context: abort_callback must be callable or None, got True"),
])
def test_context_settings_of_the_wrong_type_are_named(model, settings, message):
    with pytest.raises(ArgumentTypeError) as err:
        engine.Context(model, **settings)
    assert str(err.value) == message


def test_a_context_needs_a_loaded_model():
    with pytest.raises(ArgumentTypeError, match=r"model must be an engine.Model \(from engine.load_model\), got str"):
        engine.Context("model.gguf")


@pytest.mark.parametrize("call,message", [
    (lambda c: c.state_seq_get_data("0"), "state_seq_get_data: seq_id must be an int, got '0' (str)"),
    (lambda c: c.state_seq_get_data(0, flags=1.0), "state_seq_get_data: flags must be an int, got 1.0 (float)"),
    (lambda c: c.state_seq_set_data("abc", 0), "state_seq_set_data: data must be bytes, got str"),
    (lambda c: c.state_seq_set_data(c.state_seq_get_data(0), "1"),
     "state_seq_set_data: dest_seq_id must be an int, got '1' (str)"),
    (lambda c: c.state_set_data(None), "state_set_data: data must be bytes, got NoneType"),
    (lambda c: c.state_save_file(3, [1]), "state_save_file: path must be a file path (str or pathlib.Path), got 3 (int)"),
    (lambda c: c.state_save_file("x.bin", [1, "2"]), "state_save_file: tokens[1] must be an int, got '2' (str)"),
    (lambda c: c.state_seq_save_file("x.bin", "0", [1]), "state_seq_save_file: seq_id must be an int, got '0' (str)"),
    (lambda c: c.state_load_file("x.bin", 5.0), "state_load_file: n_token_capacity must be an int, got 5.0 (float)"),
    (lambda c: c.state_seq_load_file("x.bin", None), "state_seq_load_file: dest_seq_id must be an int, got None"),
])
def test_state_calls_name_the_argument_and_change_nothing(ctx, tmp_path, monkeypatch, call, message):
    monkeypatch.chdir(tmp_path)
    before = state_of(ctx)
    with pytest.raises(ArgumentTypeError) as err:
        call(ctx)
    assert str(err.value).startswith(message)
    assert same_state(before, state_of(ctx))
    assert not (tmp_path / "x.bin").exists()
