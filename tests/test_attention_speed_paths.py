"""The decode attention path (engine.models.transformer.cache_attention) reads the cache in pieces, in
its own layout and float type: it must give what the fused kernel gives on full float32 copies, for
every layout the cache hands it (f32, f16, transposed V, several streams, GQA, soft-capping), and
the cache must hand it views, not copies, with an additive mask of n_kv width made once per ubatch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.batch import Batch
from engine.models import transformer as tr
from tests.decode_driver import decode_sequences
from tests.test_logits import hf_logits, prompts

N_STEPS = 12


def cache_rows(G: int, n_kv: int, Hkv: int, D: int, dtype: torch.dtype, transposed: bool, seed: int):
    """Rows as the cache stores them ([G, kv_size, Hkv * D], or [G, Hkv * D, kv_size] transposed) and
    the [G, Hkv, n_kv, D] strided view store_and_load hands out."""
    g = torch.Generator().manual_seed(seed)
    kv_size = n_kv + 37
    data = torch.randn(G, kv_size, Hkv * D, generator=g).to(dtype)
    if transposed:
        data = data.transpose(1, 2).contiguous()
        rows = data[:, :, :n_kv].transpose(-1, -2)
    else:
        rows = data[:, :n_kv]
    return rows.view(G, n_kv, Hkv, D).transpose(1, 2)


def reference(q, keys, values, mask, scale, cap):
    keys, values = keys.float().contiguous(), values.float().contiguous()
    if cap:
        return tr.softcapped_attention(q, keys, values, mask, scale, cap)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("v_transposed", [False, True])
@pytest.mark.parametrize("G,Tg,H,Hkv", [(1, 1, 6, 2), (2, 3, 4, 4), (1, 5, 8, 1)])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_cache_attention_equals_the_fused_kernel(monkeypatch, dtype, v_transposed, G, Tg, H, Hkv, cap):
    monkeypatch.setattr(tr, "chunk_cells", lambda rows: 16)  # many pieces, the last one short
    D, n_kv = 8, 70
    keys = cache_rows(G, n_kv, Hkv, D, dtype, False, 1)
    values = cache_rows(G, n_kv, Hkv, D, dtype, v_transposed, 2)
    assert keys.dtype == dtype and (Hkv == 1 or not keys.is_contiguous())
    q = torch.randn(G, H, Tg, D, generator=torch.Generator().manual_seed(3))
    allowed = torch.rand(G, 1, Tg, n_kv, generator=torch.Generator().manual_seed(4)) < 0.7
    allowed[..., 0] = True  # every token sees a cell
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    want = reference(q, keys, values, allowed, 0.3, cap)
    for mask in (allowed, additive):
        got = tr.cache_attention(q, keys, values, mask, 0.3, cap)
        assert got.shape == want.shape and got.dtype == q.dtype
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_chunk_cells_hold_about_a_megabyte_of_rows():
    rows = torch.empty(1, 8, 1 << 15, 128, dtype=torch.float16)
    assert tr.chunk_cells(rows) * 8 * 128 * 2 == tr.CHUNK_BYTES
    assert tr.chunk_cells(torch.empty(1, 64, 16, 256)) == 256  # never fewer than 256 cells


@pytest.mark.parametrize("type_kv,flash_attn", [("f32", "auto"), ("f16", "auto"), ("f16", "off")])
def test_the_cache_hands_out_views_and_one_additive_mask(tiny_llama_hf, monkeypatch, type_kv, flash_attn):
    """K and V are views of the layer's rows in the cache's own type; the mask is additive, n_kv wide,
    and the same tensor for every layer of the ubatch."""
    model = engine.load_model(tiny_llama_hf)
    ctx = engine.Context(model, n_ctx=256, pad=32, type_k=type_kv, type_v=type_kv, flash_attn=flash_attn)
    seen = []
    real = tr.cache_attention

    def spy(q, keys, values, mask, scale, cap=0.0):
        seen.append((keys, values, mask))
        return real(q, keys, values, mask, scale, cap)

    monkeypatch.setattr(tr, "cache_attention", spy)
    assert ctx.decode(Batch.for_sequence(list(range(3, 43)), 0, 0)) == 0  # 40 tokens: the fused kernel
    assert not seen
    assert ctx.decode(Batch.for_sequence([5], 0, 40)) == 0
    cache = ctx.memory
    assert len(seen) == model.config.n_layer
    storages = [(cache.k[i].data, cache.v[i].data) for i in range(model.config.n_layer)]
    for (keys, values, mask), (k_data, v_data) in zip(seen, storages):
        assert keys.dtype == values.dtype == k_data.dtype
        assert keys.untyped_storage().data_ptr() == k_data.untyped_storage().data_ptr()
        assert values.untyped_storage().data_ptr() == v_data.untyped_storage().data_ptr()
        assert keys.shape[2] == values.shape[2] == mask.shape[-1] == 64  # n_kv: 41 cells padded to 32
        assert mask.dtype == torch.float32 and mask is seen[0][2]
        assert mask[0, 0, 0, :41].eq(0).all() and mask[0, 0, 0, 41:].eq(float("-inf")).all()


@pytest.mark.parametrize("flash_attn", ["auto", "off"])
def test_decode_in_pieces_matches_transformers(tiny_llama_hf, monkeypatch, flash_attn):
    """Decode steps read the cache in pieces of 8 cells (two streams, f32): logits as transformers'."""
    monkeypatch.setattr(tr, "chunk_cells", lambda rows: 8)
    model = engine.load_model(tiny_llama_hf)
    ctx = engine.Context(model, n_ctx=128, pad=32, n_ubatch=8, n_seq_max=2, kv_unified=False,
                         type_k="f32", type_v="f32", flash_attn=flash_attn)
    seqs, got = decode_sequences(ctx, prompts(model.n_vocab), N_STEPS, seed=11)
    for s, toks in seqs.items():
        err = (got[s] - hf_logits(tiny_llama_hf, toks)).abs().max().item()
        assert err < 1e-4, f"seq {s}: max |engine - transformers| = {err}"
