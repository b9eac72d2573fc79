"""Logits of the engine equal transformers' for the same weights (f32 compute, f32 cache)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import engine
from engine.batch import Batch
from tests.decode_driver import decode_sequences

TOL = 1e-4
N_STEPS = 32


def hf_logits(folder: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one sequence, no cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def prompts(n_vocab: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {0: torch.randint(3, n_vocab, (12,), generator=g).tolist(),
            1: torch.randint(3, n_vocab, (9,), generator=g).tolist()}


def run_two_sequences(model: engine.Model, *, kv_unified: bool, flash_attn: str = "auto"):
    """Prefill two prompts in one batch, then N_STEPS steps advancing both sequences in one decode."""
    ctx = engine.Context(model, n_ctx=128, pad=32, n_ubatch=8, n_seq_max=2, kv_unified=kv_unified,
                         type_k="f32", type_v="f32", flash_attn=flash_attn)
    return decode_sequences(ctx, prompts(model.n_vocab), N_STEPS, seed=11)


@pytest.mark.parametrize("kv_unified,flash_attn", [(True, "auto"), (False, "auto"), (True, "off")])
@pytest.mark.parametrize("arch_fixture", ["tiny_llama_hf", "tiny_qwen2_hf"])
def test_logits_match_transformers(arch_fixture, kv_unified, flash_attn, request):
    folder = request.getfixturevalue(arch_fixture)
    model = engine.load_model(folder)
    seqs, got = run_two_sequences(model, kv_unified=kv_unified, flash_attn=flash_attn)
    for s, toks in seqs.items():
        ref = hf_logits(folder, toks)
        assert got[s].shape == ref.shape
        err = (got[s] - ref).abs().max().item()
        assert err < TOL, f"seq {s}: max |engine - transformers| = {err}"


@pytest.mark.parametrize("start,delta", [(10, -10), (0, 7)])
def test_logits_after_seq_add_and_k_shift_equal_a_fresh_run(tiny_llama_hf, start, delta):
    """Move a whole sequence by delta (its keys are re-roped at the next decode): the next token's
    logits must equal transformers' on the same tokens placed at the shifted positions."""
    model = engine.load_model(tiny_llama_hf)
    toks = torch.randint(3, model.n_vocab, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    ctx = engine.Context(model, n_ctx=64, pad=32, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(toks[:20], 0, start)) == 0
    ctx.memory.seq_add(0, -1, -1, delta)
    new_start = start + delta
    assert ctx.memory.seq_pos_max(0) == new_start + 19
    assert ctx.decode(Batch([toks[20]], [new_start + 20], [[0]], [True])) == 0
    assert all(shift == 0 for _, _, shift in ctx.memory.cells(0))

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        positions = torch.arange(new_start, new_start + 21)[None]
        ref = hf(torch.tensor([toks]), position_ids=positions).logits[0, -1]
    err = (ctx.logits(0) - ref).abs().max().item()
    assert err < TOL, f"after K-shift: max |engine - fresh run| = {err}"


def _storage_roundtrip(tensor: torch.Tensor, storage: str) -> torch.Tensor:
    """The values a tensor has after being stored as `storage` in a GGUF, in its own layout."""
    import gguf

    a = tensor.numpy().astype(np.float32)
    if storage == "F32":
        return torch.from_numpy(a)
    if storage == "F16":
        return torch.from_numpy(a.astype(np.float16).astype(np.float32))
    qtype = gguf.GGMLQuantizationType[storage]
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype).reshape(a.shape))


def test_mixed_gguf_matches_its_hf_twin(tiny_llama_hf, tmp_path):
    """A GGUF with F32, F16 and Q8_0 tensors and permuted Q/K gives the logits of an HF model holding
    the same stored values in the HF layout (so a wrong un-permutation cannot cancel out)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from engine.testing import write_gguf_from_hf

    gguf_path = write_gguf_from_hf(tiny_llama_hf, tmp_path / "mixed.gguf", tensor_type="mixed")
    model = engine.load_model(gguf_path, keep_quantized=False)  # the file's exact values (packing: test_packed_model.py)
    assert {"F32", "F16", "Q8_0"} <= set(model.tensor_types.values())
    original = load_file(str(tiny_llama_hf / "model.safetensors"))
    twin = {name: _storage_roundtrip(t, model.tensor_types[name]) for name, t in original.items()}
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_hf, dtype=torch.float32).eval()
    hf.load_state_dict(twin, strict=True)
    toks = torch.randint(3, model.n_vocab, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0]
    ctx = engine.Context(model, n_ctx=64, pad=32, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(toks, 0, 0, all_logits=True)) == 0
    err = (ctx.all_logits() - ref).abs().max().item()
    assert err < TOL, f"max |gguf engine - hf twin| = {err}"


def test_f16_cache_stays_close(tiny_llama_hf):
    """The default f16 cache rounds K and V; the logits move by about llama.cpp's 1e-3."""
    model = engine.load_model(tiny_llama_hf)
    toks = prompts(model.n_vocab)[0]
    ctx = engine.Context(model, n_ctx=64, pad=32)
    assert ctx.decode(Batch.for_sequence(toks, 0, 0, all_logits=True)) == 0
    err = (ctx.all_logits() - hf_logits(tiny_llama_hf, toks)).abs().max().item()
    assert 0 < err < 2e-2


@pytest.fixture(scope="module")
def llama3_scaled_hf(tmp_path_factory):
    """A tiny llama with Llama 3 rope scaling whose window is small enough that most dimension
    pairs are scaled or smoothed."""
    from engine.models.config import RopeScaling
    from engine.testing import write_hf_model

    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-llama3", "llama", n_layer=2, n_embd=64, n_head=4,
                          n_head_kv=2, n_ff=128, vocab_size=512, seed=4, rope_scaling=scaling)


@pytest.mark.parametrize("as_gguf", [False, True])
def test_llama3_rope_scaling_matches_transformers(llama3_scaled_hf, tmp_path, as_gguf):
    """HF folders carry the scaling in config.json; GGUF files as rope_freqs divisors."""
    from engine.testing import write_gguf_from_hf

    path = write_gguf_from_hf(llama3_scaled_hf, tmp_path / "l3.gguf") if as_gguf else llama3_scaled_hf
    model = engine.load_model(path)
    # each format carries the scaling its own way, and only that way (so the logits check below reads it)
    assert (model.config.rope_scaling is None, "rope_freqs" in model.config.extra) == (as_gguf, as_gguf)
    toks = torch.randint(3, model.n_vocab, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    ctx = engine.Context(model, n_ctx=64, pad=32, type_k="f32", type_v="f32")
    assert ctx.decode(Batch.for_sequence(toks, 0, 0, all_logits=True)) == 0
    err = (ctx.all_logits() - hf_logits(llama3_scaled_hf, toks)).abs().max().item()
    assert err < TOL, f"llama3 rope scaling: max |engine - transformers| = {err}"
