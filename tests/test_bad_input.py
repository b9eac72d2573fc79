"""Bad input gets a clear answer (llama.cpp's return code or a named error) and changes nothing."""
from __future__ import annotations

import copy

import pytest

import engine
from engine.batch import Batch
from tests.model_factory import in_memory_model


def cache_state(ctx: engine.Context):
    mem = ctx.memory
    return ([mem.cells(s) for s in range(mem.n_stream)], [mem.head(s) for s in range(mem.n_stream)],
            copy.deepcopy(mem.pending_copies))


@pytest.fixture
def ctx():
    c = engine.Context(in_memory_model(), n_ctx=16, pad=8, n_seq_max=2, kv_unified=True)
    assert c.decode(Batch.for_sequence([5, 6, 7], 0, 0)) == 0
    return c


@pytest.mark.parametrize("batch,message", [
    (Batch([5], [3], [[2]]), "invalid seq_id[0][0] = 2 >= 2"),
    (Batch([5], [3], [[-1]]), "invalid seq_id[0][0] = -1 >= 2"),
    (Batch([5], [5], [[0]]), "Y = X + 1"),
    (Batch([5, 6], [0, 2], [[1], [1]]), "sequence 1 positions are not continuous"),
    (Batch([64], [3], [[0]]), "invalid token[0] = 64"),
    (Batch([-3], [3], [[0]]), "invalid token[0] = -3"),
    (Batch([5, 6], [1, 0], [[1], [1]]), "sequence 1 positions are decreasing"),
])
def test_invalid_batch_returns_minus_one_and_changes_nothing(ctx, batch, message):
    before = cache_state(ctx)
    assert ctx.decode(batch) == -1
    assert message in ctx.last_error
    assert cache_state(ctx) == before
    with pytest.raises(IndexError):
        ctx.logits(0)


def test_coupled_sequences_that_diverged_are_refused(ctx):
    assert ctx.decode(Batch.for_sequence([8, 9, 10], 1, 0)) == 0
    ctx.memory.seq_rm(1, 0, 1)  # seq 1 now spans 1..2, seq 0 spans 0..2
    before = cache_state(ctx)
    assert ctx.decode(Batch([9], [3], [[0, 1]])) == -1
    assert "sequence 1 is coupled to 0 in the input batch, but have divereged" in ctx.last_error
    assert cache_state(ctx) == before


def test_full_cache_returns_one_and_leaves_cells_unchanged():
    ctx = engine.Context(in_memory_model(), n_ctx=8, pad=8, n_ubatch=2)
    assert ctx.decode(Batch.for_sequence([1, 2, 3, 4, 5, 6], 0, 0)) == 0
    before = cache_state(ctx)
    assert ctx.decode(Batch.for_sequence([7, 8, 9, 10], 0, 6)) == 1
    assert ctx.last_error == "decode: failed to find a memory slot for batch of size 4"
    assert cache_state(ctx) == before
    assert ctx.decode(Batch.for_sequence([7, 8], 0, 6)) == 0  # what fits still fits


def test_batch_larger_than_n_batch_raises_and_changes_nothing(ctx):
    before = cache_state(ctx)
    with pytest.raises(engine.BatchTooLargeError, match="n_batch = 16"):
        ctx.decode(Batch.for_sequence(list(range(1, 18)), 0, 3))
    assert cache_state(ctx) == before


@pytest.mark.parametrize("op,message", [
    (lambda m: m.seq_rm(256, -1, -1), "seq_rm: invalid seq_id 256"),
    (lambda m: m.seq_cp(0, 300, -1, -1), "seq_cp: invalid seq_id 300"),
    (lambda m: m.seq_keep(-2), "seq_keep: invalid seq_id -2"),
    (lambda m: m.seq_add(-1, 0, 1, 1), "seq_add: invalid seq_id -1"),
    (lambda m: m.seq_div(0, 0, 4, 0), "seq_div: divisor 0 must be >= 1"),
    (lambda m: m.seq_pos_max(999), "seq_pos_max: invalid seq_id 999"),
])
def test_invalid_memory_operations_raise_and_change_nothing(ctx, op, message):
    before = cache_state(ctx)
    with pytest.raises(engine.MemoryOperationError, match=message):
        op(ctx.memory)
    assert cache_state(ctx) == before


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_seq_max=257), "n_seq_max = 257 > 256"),
    (dict(type_k="q9_9"), "unsupported KV cache type 'q9_9'"),
    (dict(flash_attn="maybe"), "flash_attn must be one of"),
    (dict(pad=0), "pad must be >= 1"),
    (dict(n_ctx=-5), "must not be negative"),
])
def test_bad_context_settings_are_named(kwargs, message):
    with pytest.raises(engine.ContextParamsError, match=message.replace("(", r"\(")):
        engine.Context(in_memory_model(), **kwargs)


def test_logits_index_out_of_range_is_named(ctx):
    assert ctx.decode(Batch([9, 10], [3, 4], [[0], [0]], [True, True])) == 0
    assert ctx.logits(1).shape == (64,)
    with pytest.raises(IndexError, match="produced 2 output"):
        ctx.logits(2)
    with pytest.raises(IndexError, match="batch token 0 was not marked"):
        ctx.decode(Batch([11, 12], [5, 6], [[0], [0]], [False, True])) or ctx.logits_for_token(0)


def test_n_ctx_1_gives_256_cells_but_a_batch_of_one_token():
    """llama.cpp 0c1e570 with n_ctx = 1 prints n_ctx = 256 and n_batch = n_ubatch = 1, and a 2-token decode
    then aborts on n_tokens_all <= n_batch; kvscope refuses it with a named error and changes nothing."""
    ctx = engine.Context(in_memory_model(), n_ctx=1)
    assert ctx.memory.size == 256
    lines = ctx.init_log_lines
    for line in ("llama_context: n_ctx         = 256", "llama_context: n_batch       = 1",
                 "llama_context: n_ubatch      = 1"):
        assert line in lines
    before = cache_state(ctx)
    with pytest.raises(engine.BatchTooLargeError, match="the batch has 3 tokens but n_batch = 1"):
        ctx.decode(Batch.for_sequence([5, 6, 7], 0, 0))
    assert cache_state(ctx) == before
    for p, t in enumerate([5, 6, 7]):
        assert ctx.decode(Batch([t], [p], [[0]])) == 0
    assert ctx.memory.seq_pos_max(0) == 2


@pytest.mark.parametrize("kwargs,setting", [(dict(n_batch=0), "n_batch"), (dict(n_ubatch=0), "n_ubatch")])
def test_a_context_that_could_decode_nothing_is_refused(kwargs, setting):
    with pytest.raises(engine.ContextParamsError, match=f"{setting} must be >= 1, got 0"):
        engine.Context(in_memory_model(), **kwargs)
