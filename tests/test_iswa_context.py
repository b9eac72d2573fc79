"""A context on a sliding-window model gets the iSWA pair, with llama.cpp's sizes, log lines and rules."""
from __future__ import annotations

import logging

import pytest

import engine
from engine.kv.iswa import KVCacheISWA
from engine.runners.generate import Generator
from engine.sampling import SamplerParams

GREEDY = SamplerParams(temperature=0.0)


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_hf):
    return engine.load_model(tiny_gemma3_hf)


def test_iswa_layers_sizes_and_init_lines(gemma3):
    ctx = engine.Context(gemma3, n_ctx=1000, n_ubatch=64)
    mem = ctx.memory
    assert isinstance(mem, KVCacheISWA)
    assert mem.base.layout.layer_ids == (5,) and mem.swa.layout.layer_ids == (0, 1, 2, 3, 4)
    assert (mem.base.size, mem.swa.size) == (1024, 256)  # PAD256(min(1024, 8 + 64))
    lines = ctx.init_log_lines
    i = lines.index("llama_kv_cache_iswa: creating non-SWA KV cache, size = 1024 cells")
    assert lines[i + 2].startswith("llama_kv_cache: size = ") and "(  1024 cells,   1 layers,  1/1 seqs)" in lines[i + 2]
    assert lines[i + 3] == "llama_kv_cache_iswa: creating     SWA KV cache, size = 256 cells"
    assert "(   256 cells,   5 layers,  1/1 seqs)" in lines[i + 5]
    assert not mem.can_shift()


def test_swa_full_makes_both_caches_equal_and_shiftable(gemma3):
    ctx = engine.Context(gemma3, n_ctx=512, swa_full=True)
    assert ctx.memory.swa.size == ctx.memory.base.size == 512
    assert ctx.memory.can_shift()
    assert ctx.init_log_lines[-7].startswith("llama_kv_cache_iswa: using full-size SWA cache (ref: ")


def test_context_shift_is_disabled_without_swa_full(gemma3, caplog):
    ctx = engine.Context(gemma3, n_ctx=32, pad=8, n_ubatch=8, type_k="f32", type_v="f32")
    assert ctx.memory.swa.size < ctx.memory.base.size
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        gen = Generator(ctx, GREEDY, context_shift=True)
    assert "KV cache shifting is not supported for this context" in caplog.text
    result = gen.generate(list(range(5, 15)), 40)
    # 10 + 40 tokens do not fit 32 cells: a shift would have been due, and none ran
    assert result.stop_reason == "context_full" and not gen.shifts and not result.context_shifts


def test_seq_add_and_seq_div_are_accepted_though_the_pair_cannot_shift(gemma3):
    """llama.cpp's QUIRK (QUIRK_ISWA_SHIFT): can_shift is False, yet both caches move and the next decode
    re-rotates them (tests/test_iswa_shift.py checks the keys)."""
    ctx = engine.Context(gemma3, n_ctx=32, pad=8, n_ubatch=8)
    assert not ctx.memory.can_shift()
    assert ctx.decode(engine.Batch.for_sequence(list(range(5, 11)), 0, 0)) == 0
    ctx.memory.seq_rm(0, 0, 2)
    ctx.memory.seq_add(0, 2, -1, -2)
    ctx.memory.seq_div(0, 0, -1, 2)
    for cache in ctx.memory.caches():
        assert sorted(pos for pos, _, _ in cache.cells(0) if pos >= 0) == [0, 0, 1, 1]
    assert ctx.decode(engine.Batch([5], [2], [[0]])) == 0
    for cache in ctx.memory.caches():
        assert all(shift == 0 for _, _, shift in cache.cells(0))


def test_context_shift_runs_with_swa_full(gemma3):
    ctx = engine.Context(gemma3, n_ctx=32, pad=8, n_ubatch=8, swa_full=True, type_k="f32", type_v="f32")
    gen = Generator(ctx, GREEDY, context_shift=True)
    result = gen.generate(list(range(5, 15)), 40)
    assert gen.shifts and result.stop_reason in ("length", "eog")
    for cache in (ctx.memory.base, ctx.memory.swa):
        assert all(shift == 0 for _, _, shift in cache.cells(0))


def test_mirror_follows_both_caches(gemma3):
    bus = engine.EventBus()
    mirror = engine.CacheMirror()
    mirror.attach(bus)
    ctx = engine.Context(gemma3, n_ctx=64, pad=16, n_ubatch=4, bus=bus)
    Generator(ctx, GREEDY).generate(list(range(5, 25)), 20)
    mirror.sync()
    for cache in (ctx.memory.base, ctx.memory.swa):
        assert mirror.cells(0, cache.name) == cache.cells(0)
        assert mirror.head(0, cache.name) == cache.head(0)
    assert ctx.memory.seq_pos_min(0) > 0  # answered by the SWA cache after the window slid
    assert ctx.memory.base.seq_pos_min(0) == 0
