"""Context sizing (llama_context's constructor, src/llama-context.cpp) and the init lines with llama.cpp's
byte counts (llama_kv_cache's constructor, src/llama-kv-cache.cpp)."""
from __future__ import annotations

import pytest

from engine.context import ContextParams
from engine.errors import ContextParamsError
from engine.kv.layout import CacheLayout
from engine.kv.types import cache_type
from engine.placement.devices import CPU


def resolve(**kw):
    base = dict(n_ctx_train=4096, n_ctx=0, n_batch=2048, n_ubatch=512, n_seq_max=1, kv_unified=False, pad=256,
                type_k="f16", type_v="f16", flash_attn="auto", swa_full=False)
    base.update(kw)
    return ContextParams.resolve(**base)


@pytest.mark.parametrize("kw,n_ctx,n_ctx_seq,n_stream", [
    (dict(n_ctx=1000), 1024, 1024, 1),  # rounded up to 256
    (dict(n_ctx=0), 4096, 4096, 1),  # 0 = n_ctx_train
    (dict(n_ctx=2048, n_seq_max=3), 2304, 768, 3),  # PAD256(2048 / 3) = 768 per stream
    (dict(n_ctx=2048, n_seq_max=3, kv_unified=True), 2048, 2048, 1),
    (dict(n_ctx=100, n_seq_max=2, pad=8), 112, 56, 2),  # 104 // 2 = 52 -> 56 per stream
    (dict(n_ctx=0, n_seq_max=0), 4096, 4096, 1),  # n_seq_max = max(1, .)
])
def test_context_sizes(kw, n_ctx, n_ctx_seq, n_stream):
    p = resolve(**kw)
    assert (p.n_ctx, p.n_ctx_seq, p.n_stream) == (n_ctx, n_ctx_seq, n_stream)


def test_batch_sizes_are_clamped():
    p = resolve(n_ctx=512, n_batch=2048, n_ubatch=4096)
    assert (p.n_batch, p.n_ubatch) == (512, 512)
    p = resolve(n_ctx=4096, n_batch=1024, n_ubatch=2048)
    assert (p.n_batch, p.n_ubatch) == (1024, 1024)


@pytest.mark.parametrize("kw,n_ctx,n_batch,n_ubatch", [
    (dict(n_ctx=1), 256, 1, 1),  # llama.cpp 0c1e570 prints n_ctx = 256, n_ubatch = 1
    (dict(n_ctx=32, n_seq_max=3, kv_unified=True), 256, 32, 32),  # 0c1e570's log: n_ctx 256, n_batch 32, n_ubatch 32
    (dict(n_ctx=300), 512, 300, 300),
    (dict(n_ctx=0), 4096, 2048, 512),  # 0 = n_ctx_train, then the batch bound
    (dict(n_ctx=100, n_seq_max=3), 768, 100, 100),  # the bound is the requested n_ctx, not 3 x 256
])
def test_batch_is_bounded_by_the_requested_n_ctx_before_rounding(kw, n_ctx, n_batch, n_ubatch):
    p = resolve(**kw)
    assert (p.n_ctx, p.n_batch, p.n_ubatch) == (n_ctx, n_batch, n_ubatch)


@pytest.mark.parametrize("kw,message", [
    (dict(n_batch=0), "n_batch must be >= 1, got 0"),
    (dict(n_ubatch=0), "n_ubatch must be >= 1, got 0"),
])
def test_a_batch_size_of_zero_is_refused(kw, message):
    with pytest.raises(ContextParamsError, match=message):
        resolve(**kw)


@pytest.mark.parametrize("flash_attn,v_trans", [("auto", False), ("on", False), ("off", True)])
def test_flash_attn_decides_the_v_layout(flash_attn, v_trans):
    assert resolve(flash_attn=flash_attn).v_trans is v_trans


def layout(kv_size=4096, n_layer=32, n_head_kv=8, head_dim=128, type_k="f16", type_v="f16", n_stream=1, n_seq_max=1):
    return CacheLayout(layer_ids=tuple(range(n_layer)), n_embd_k=n_head_kv * head_dim, n_embd_v=n_head_kv * head_dim,
                       n_head_kv=n_head_kv, head_dim=head_dim, kv_size=kv_size, n_stream=n_stream,
                       n_seq_max=n_seq_max, type_k=cache_type(type_k), type_v=cache_type(type_v), v_trans=False)


def test_init_lines_of_a_32_layer_4096_cell_f16_cache():
    lines = layout().init_log_lines()
    assert lines == [
        "llama_kv_cache:        CPU KV buffer size =   512.00 MiB",
        "llama_kv_cache: size =  512.00 MiB (  4096 cells,  32 layers,  1/1 seqs), K (f16):  256.00 MiB, V (f16):  256.00 MiB",
    ]


def test_f32_and_split_streams_line():
    lines = layout(kv_size=256, n_layer=4, n_head_kv=2, head_dim=64, type_k="f32", type_v="bf16", n_stream=2,
                   n_seq_max=2).init_log_lines()
    # K: 256 cells x 2 streams x 128 values x 4 bytes x 4 layers = 1 MiB; V half of that
    assert lines[1] == ("llama_kv_cache: size =    1.50 MiB (   256 cells,   4 layers,  2/2 seqs), "
                        "K (f32):    1.00 MiB, V (bf16):    0.50 MiB")


def test_buffer_size_rounds_each_tensor_to_32_bytes():
    lo = layout(kv_size=3, n_layer=2, n_head_kv=1, head_dim=5, type_k="f16", type_v="f16")
    assert lo.k_bytes_per_layer() == 30
    assert lo.buffer_bytes_by_device() == {CPU: 2 * (32 + 32)}


def test_context_beyond_training_length_is_flagged():
    import engine
    from tests.model_factory import in_memory_model

    ctx = engine.Context(in_memory_model(), n_ctx=512)  # n_ctx_train 256
    assert "llama_context: n_ctx_seq (512) > n_ctx_train (256) -- possible training context overflow" in \
        ctx.init_log_lines
