"""gemma3 (text), gemma2 and mistral: configs from Hugging Face folders and GGUF files, GGUF twins, and
logits equal to transformers' (f32 compute, f32 cache), before and after the sliding window slid.

Conventions checked here:
- HF's sliding window W (a query sees W keys, itself included) is llama.cpp's n_swa W.
- Gemma norm weights: HF stores w and multiplies by 1 + w; llama.cpp's converter stores 1 + w. kvscope's
  tensors hold 1 + w whatever the format, so a GGUF twin has identical tensors.
- Gemma Q/K are not permuted in GGUF; Mistral converts to a llama GGUF (permuted, no window), which
  kvscope, as llama.cpp, runs with full attention.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import engine
from engine.batch import Batch
from engine.errors import ModelFileError, UnsupportedArchitectureError
from engine.formats.gguf_file import (
    config_from_gguf_metadata,
    permute_qk,
    read_gguf_metadata,
)
from engine.models.load import read_checkpoint
from engine.rope import Rotary, inverse_frequencies
from engine.testing import write_gguf_from_hf
from tests.decode_driver import decode_sequences

TOL = 1e-4
WINDOW = 8  # tests/conftest.py's SWA_WINDOW
ARCH_FIXTURES = {"gemma3": "tiny_gemma3_hf", "gemma2": "tiny_gemma2_hf", "mistral": "tiny_mistral_hf"}


@pytest.fixture(scope="module")
def gguf_twins(tmp_path_factory, request):
    """arch -> the F32 GGUF twin of that arch's tiny HF folder, written on first use."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            hf = request.getfixturevalue(ARCH_FIXTURES[arch])
            made[arch] = write_gguf_from_hf(hf, tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf")
        return made[arch]

    return get


def _path(arch: str, file_format: str, request, gguf_twins) -> Path:
    return gguf_twins(arch) if file_format == "gguf" else request.getfixturevalue(ARCH_FIXTURES[arch])


def _copy(folder: Path, dst: Path, **config_changes) -> Path:
    """A copy of an HF folder with config.json entries replaced (None values are removed)."""
    shutil.copytree(folder, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def hf_logits(folder: Path, tokens: list[int], position_ids: torch.Tensor | None = None, **config_overrides):
    """transformers' logits for every position of one sequence (full forward, no cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **config_overrides).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens]), position_ids=position_ids).logits[0]


def _tokens(n: int, seed: int, n_vocab: int = 512) -> list[int]:
    return torch.randint(3, n_vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _context(model: engine.Model, **kw) -> engine.Context:
    return engine.Context(model, **{"n_ctx": 128, "pad": 32, "type_k": "f32", "type_v": "f32", **kw})


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape
    return (got - ref).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Configs


EXPECTED = {
    "gemma3": {"arch": "gemma3", "n_layer": 6, "n_swa": WINDOW, "swa_type": 1,
               "swa_layers": (True,) * 5 + (False,), "rope_theta": 1e6, "rope_theta_swa": 10000.0,
               "query_pre_attn_scalar": 16.0, "attn_softcap": 0.0, "final_softcap": 0.0,
               "hidden_act": "gelu_tanh", "tie_word_embeddings": True},
    "gemma2": {"arch": "gemma2", "n_layer": 2, "n_swa": WINDOW, "swa_type": 1,
               "swa_layers": (True, False), "rope_theta": 10000.0, "rope_theta_swa": None,
               "query_pre_attn_scalar": 16.0, "attn_softcap": 5.0, "final_softcap": 10.0,
               "hidden_act": "gelu_tanh", "tie_word_embeddings": True},
    "mistral": {"arch": "mistral", "n_layer": 2, "n_swa": WINDOW, "swa_type": 1,
                "swa_layers": (True, True), "rope_theta": 10000.0, "rope_theta_swa": None,
                "query_pre_attn_scalar": None, "attn_softcap": 0.0, "final_softcap": 0.0,
                "hidden_act": "silu", "tie_word_embeddings": False},
}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_hf_config(arch, request):
    cfg = read_checkpoint(request.getfixturevalue(ARCH_FIXTURES[arch])).config
    for key, value in EXPECTED[arch].items():
        assert getattr(cfg, key) == value, key
    assert cfg.has_swa and [cfg.is_swa(il) for il in range(cfg.n_layer)] == list(cfg.swa_layers)
    assert cfg.add_bos


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_gemma_gguf_twin_has_identical_config_and_tensors(arch, request, gguf_twins):
    hf = read_checkpoint(request.getfixturevalue(ARCH_FIXTURES[arch]))
    gg = read_checkpoint(gguf_twins(arch))
    assert gg.config == hf.config
    assert gg.tensors.keys() == hf.tensors.keys() and "lm_head.weight" not in gg.tensors
    for name, t in hf.tensors.items():
        assert torch.equal(gg.tensors[name], t), name


def test_mistral_gguf_is_llama_without_window(tiny_mistral_hf, gguf_twins):
    """llama.cpp's converter writes Mistral as a llama GGUF (Q/K permuted) and drops the window."""
    hf = read_checkpoint(tiny_mistral_hf)
    gg = read_checkpoint(gguf_twins("mistral"))
    assert gg.config.arch == "llama" and not gg.config.has_swa
    assert gg.config == dataclasses.replace(hf.config, arch="llama", n_swa=0, swa_type=0, swa_layers=())
    for name, t in hf.tensors.items():
        assert torch.equal(gg.tensors[name], t), name  # un-permuted on reading


def _gguf_raw(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return meta, {t.name: np.array(t.data, dtype=np.float32).reshape(shapes[t.name]) for t in reader.tensors}


def test_gemma3_gguf_is_written_as_llama_cpp_converts_it(tiny_gemma3_hf, gguf_twins):
    from safetensors.numpy import load_file

    meta, tensors = _gguf_raw(gguf_twins("gemma3"))
    hf = load_file(str(tiny_gemma3_hf / "model.safetensors"))
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.attention.sliding_window"] == WINDOW
    assert meta["gemma3.rope.freq_base"] == 1e6  # global layers; llama.cpp assumes 10000 for the others
    assert "gemma3.attn_logit_softcapping" not in meta and "gemma3.final_logit_softcapping" not in meta
    assert "output.weight" not in tensors
    for gguf_name, hf_name in [("blk.0.attn_norm.weight", "input_layernorm"),
                               ("blk.0.post_attention_norm.weight", "post_attention_layernorm"),
                               ("blk.0.ffn_norm.weight", "pre_feedforward_layernorm"),
                               ("blk.0.post_ffw_norm.weight", "post_feedforward_layernorm"),
                               ("blk.0.attn_q_norm.weight", "self_attn.q_norm"),
                               ("blk.0.attn_k_norm.weight", "self_attn.k_norm")]:
        np.testing.assert_array_equal(tensors[gguf_name], hf[f"model.layers.0.{hf_name}.weight"] + np.float32(1))
    np.testing.assert_array_equal(tensors["output_norm.weight"], hf["model.norm.weight"] + np.float32(1))
    # not permuted
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(tensors["blk.0.attn_k.weight"], hf["model.layers.0.self_attn.k_proj.weight"])


def test_gemma2_and_mistral_gguf_keys(tiny_mistral_hf, gguf_twins):
    from safetensors.numpy import load_file

    meta, _ = _gguf_raw(gguf_twins("gemma2"))
    assert meta["general.architecture"] == "gemma2"
    assert meta["gemma2.attention.sliding_window"] == WINDOW
    assert meta["gemma2.attn_logit_softcapping"] == 5.0 and meta["gemma2.final_logit_softcapping"] == 10.0
    meta, tensors = _gguf_raw(gguf_twins("mistral"))
    assert meta["general.architecture"] == "llama" and "llama.attention.sliding_window" not in meta
    q = load_file(str(tiny_mistral_hf / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], permute_qk(torch.from_numpy(q), 4).numpy())


def test_gemma_norms_hold_one_plus_w(tiny_gemma2_hf):
    """The HF reader adds 1 (in float32) to every Gemma norm weight, as llama.cpp's converter does."""
    from safetensors.torch import load_file

    raw = load_file(str(tiny_gemma2_hf / "model.safetensors"))
    ckpt = read_checkpoint(tiny_gemma2_hf)
    norms = [n for n in raw if n.endswith("norm.weight")]
    assert len(norms) == 1 + 4 * 2
    for name in norms:
        assert torch.equal(ckpt.tensors[name], raw[name] + 1.0), name
    assert torch.equal(ckpt.tensors["model.layers.0.mlp.up_proj.weight"], raw["model.layers.0.mlp.up_proj.weight"])


def test_gemma3_legacy_config_dialect(tiny_gemma3_hf, tmp_path):
    """transformers < 5 configs: rope_theta + rope_local_base_freq, sliding_window_pattern, no layer_types."""
    legacy = _copy(tiny_gemma3_hf, tmp_path / "legacy", rope_parameters=None, layer_types=None, rope_theta=1e6,
                   rope_local_base_freq=10000.0, sliding_window_pattern=6)
    assert read_checkpoint(legacy).config == dataclasses.replace(read_checkpoint(tiny_gemma3_hf).config,
                                                                 name="legacy")


def test_rotary_uses_each_layers_base_for_rope_and_k_shift(tiny_gemma3_hf):
    cfg = read_checkpoint(tiny_gemma3_hf).config
    rotary = Rotary(cfg)
    assert rotary.layer_table == [1, 1, 1, 1, 1, 0] and rotary.bases == ((1e6, 1.0), (10000.0, 1.0))
    assert torch.equal(rotary.inv_freqs[0], inverse_frequencies(cfg, 1e6))
    assert torch.equal(rotary.inv_freqs[1], inverse_frequencies(cfg, 10000.0))
    keys = torch.randn(5, cfg.n_head_kv, cfg.head_dim)
    delta = torch.tensor([3, -2, 7, 0, 11])
    for il, base in [(0, 10000.0), (5, 1e6)]:
        cos, sin = Rotary._cos_sin(inverse_frequencies(cfg, base), delta, torch.float32)
        assert torch.equal(rotary.shift_keys(il, keys, delta), Rotary.apply(keys, cos, sin))
    assert not torch.allclose(rotary.shift_keys(0, keys, delta), rotary.shift_keys(5, keys, delta))


def _gemma3_metadata(gguf_twins) -> dict:
    return read_gguf_metadata(gguf_twins("gemma3"))


def test_gguf_gemma_attention_scale_follows_llama_cpp(gguf_twins):
    """GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim, or n_embd / n_head for the 27B models."""
    meta = {**_gemma3_metadata(gguf_twins), "gemma3.attention.key_length": 32, "gemma3.attention.value_length": 32}
    assert config_from_gguf_metadata(meta, path="x.gguf").query_pre_attn_scalar == 32.0
    meta["gemma3.block_count"] = 62
    assert config_from_gguf_metadata(meta, path="x.gguf").query_pre_attn_scalar == 64 / 4


def test_gguf_gemma3_without_window_has_no_swa(gguf_twins):
    meta = _gemma3_metadata(gguf_twins)
    del meta["gemma3.attention.sliding_window"]
    cfg = config_from_gguf_metadata(meta, path="x.gguf")
    assert not cfg.has_swa and cfg.n_swa == 0


def test_gguf_llama_sliding_window_is_ignored_as_llama_cpp_does(gguf_twins, caplog):
    meta = {**read_gguf_metadata(gguf_twins("mistral")), "llama.attention.sliding_window": WINDOW}
    with caplog.at_level(logging.WARNING):
        cfg = config_from_gguf_metadata(meta, path="m.gguf")
    assert cfg.arch == "llama" and not cfg.has_swa
    assert "ignoring llama.attention.sliding_window" in caplog.text


# ---------------------------------------------------------------------------------------------
# Unsupported architectures stay clear


@pytest.mark.parametrize("model_type,classes,pattern", [
    ("gemma", ["GemmaForCausalLM"],
     r"architecture 'gemma' \(model_type\) is not supported; kvscope runs llama, qwen2, mistral, gemma2, gemma3"),
    ("gemma3", ["Gemma3ForConditionalGeneration"], r"'gemma3' .*multimodal.*'gemma3_text'"),
    ("gemma3_text", ["Gemma3ForConditionalGeneration"],
     r"architectures \['Gemma3ForConditionalGeneration'\] are not supported.*Gemma3ForCausalLM"),
])
def test_hf_unsupported_architectures(tiny_gemma3_hf, tmp_path, model_type, classes, pattern):
    folder = _copy(tiny_gemma3_hf, tmp_path / "other", model_type=model_type, architectures=classes)
    with pytest.raises(UnsupportedArchitectureError, match=pattern):
        read_checkpoint(folder)


def test_gemma3_embedding_model_is_refused(tiny_gemma3_hf, tmp_path):
    folder = _copy(tiny_gemma3_hf, tmp_path / "embed", use_bidirectional_attention=True)
    with pytest.raises(ModelFileError, match="use_bidirectional_attention"):
        read_checkpoint(folder)


@pytest.mark.parametrize("arch,pattern", [
    ("mistral", (r"'mistral' is not supported \(llama.cpp's converter writes Mistral models as 'llama'\); "
                 r"kvscope runs llama, qwen2, gemma2, gemma3")),
    ("gemma", r"'gemma' is not supported; kvscope runs llama, qwen2, gemma2, gemma3"),
    ("mamba", r"mamba\.gguf: architecture 'mamba' .*llama, qwen2"),
])
def test_gguf_unsupported_architectures(tmp_path, arch, pattern):
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match=pattern):
        read_checkpoint(path)


# ---------------------------------------------------------------------------------------------
# Logits within the window (no sliding yet)


@pytest.mark.parametrize("file_format", ["hf", "gguf"])
@pytest.mark.parametrize("arch", list(ARCH_FIXTURES))
def test_logits_within_window_match_transformers(arch, file_format, request, gguf_twins):
    """A 5-token prompt, then 2 cached decoding steps: 7 positions, shorter than the window."""
    hf_folder = request.getfixturevalue(ARCH_FIXTURES[arch])
    model = engine.load_model(_path(arch, file_format, request, gguf_twins))
    toks = _tokens(7, seed=21)
    ctx = _context(model)
    assert ctx.decode(Batch.for_sequence(toks[:5], 0, 0, all_logits=True)) == 0
    got = [ctx.all_logits().clone()]
    for i in range(5, 7):
        assert ctx.decode(Batch([toks[i]], [i], [[0]], [True])) == 0
        got.append(ctx.logits(0)[None].clone())
    err = _max_err(torch.cat(got), hf_logits(hf_folder, toks))
    assert err < TOL, f"{arch} ({file_format}): max |engine - transformers| = {err}"


@pytest.mark.parametrize("change", ["linear_rope", "final_softcap"])
def test_gemma3_variants_match_transformers(tiny_gemma3_hf, tmp_path, change):
    """Linear RoPE scaling of the global layers (Gemma 3 4B and larger) and a final soft-cap, from HF
    and through a GGUF twin."""
    if change == "linear_rope":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
        folder = _copy(tiny_gemma3_hf, tmp_path / "g3", rope_parameters=rope)
    else:
        folder = _copy(tiny_gemma3_hf, tmp_path / "g3", final_logit_softcapping=3.0)
    toks = _tokens(7, seed=5)
    ref = hf_logits(folder, toks)
    hf_cfg = read_checkpoint(folder).config
    gguf_path = write_gguf_from_hf(folder, tmp_path / "g3.gguf")
    assert read_checkpoint(gguf_path).config == hf_cfg
    if change == "linear_rope":
        assert hf_cfg.rope_freq_scale == 0.25 and hf_cfg.rope_freq_scale_swa == 1.0
    else:
        assert hf_cfg.final_softcap == 3.0 and ref.abs().max() < 3.0
    for path in (folder, gguf_path):
        ctx = _context(engine.load_model(path))
        assert ctx.decode(Batch.for_sequence(toks, 0, 0, all_logits=True)) == 0
        err = _max_err(ctx.all_logits(), ref)
        assert err < TOL, f"{change} ({path.name}): max |engine - transformers| = {err}"


# ---------------------------------------------------------------------------------------------
# Beyond the window: the iSWA pair (a base cache for full-attention layers, a sliding-window cache
# that reuses cells once the window slid)


def _run_sliding(model: engine.Model, prompts: dict[int, list[int]], n_steps: int, **ctx_kw):
    """Prefill every prompt in one batch (ubatches of 8), then n_steps steps advancing all sequences
    in one decode each. Returns the context, each sequence's tokens and the logits of each position."""
    ctx = _context(model, n_ubatch=8, n_seq_max=len(prompts), **ctx_kw)
    seqs, got = decode_sequences(ctx, prompts, n_steps, seed=17)
    return ctx, seqs, got


@pytest.mark.parametrize("file_format", ["hf", "gguf"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_logits_after_the_window_slid_match_transformers(arch, file_format, request, gguf_twins):
    """A 20-token prompt (window 8), then 40 cached steps: the SWA cache (32 cells) reuses cells of
    positions that left the window; every position's logits equal transformers' full forward."""
    hf_folder = request.getfixturevalue(ARCH_FIXTURES[arch])
    model = engine.load_model(_path(arch, file_format, request, gguf_twins))
    ctx, seqs, got = _run_sliding(model, {0: _tokens(20, seed=31)}, n_steps=40)
    swa = ctx.memory.swa
    assert swa.size < len(seqs[0]), "the test must make the SWA cache reuse cells"
    assert ctx.memory.seq_pos_min(0) > 0  # positions answered by the SWA cache: the oldest are gone
    assert ctx.memory.base.seq_pos_min(0) == 0
    err = _max_err(got[0], hf_logits(hf_folder, seqs[0]))
    assert err < TOL, f"{arch} ({file_format}) after sliding: max |engine - transformers| = {err}"


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("arch", list(ARCH_FIXTURES))
def test_two_sequences_after_the_window_slid_match_transformers(arch, kv_unified, request):
    """Two sequences decoded together (one stream or one each), both sliding well past the window."""
    hf_folder = request.getfixturevalue(ARCH_FIXTURES[arch])
    model = engine.load_model(hf_folder)
    _, seqs, got = _run_sliding(model, {0: _tokens(20, seed=41), 1: _tokens(13, seed=42)}, n_steps=30,
                                kv_unified=kv_unified)
    for s, toks in seqs.items():
        err = _max_err(got[s], hf_logits(hf_folder, toks))
        assert err < TOL, f"{arch} seq {s} (unified={kv_unified}): max |engine - transformers| = {err}"


def test_mistral_gguf_runs_full_attention_like_llama_cpp(tiny_mistral_hf, gguf_twins):
    """Past the window a Mistral GGUF (llama architecture) differs from its HF folder, which slides,
    and equals transformers run without a sliding window."""
    toks = _tokens(24, seed=51)
    ctx = _context(engine.load_model(gguf_twins("mistral")))
    assert ctx.decode(Batch.for_sequence(toks, 0, 0, all_logits=True)) == 0
    assert _max_err(ctx.all_logits(), hf_logits(tiny_mistral_hf, toks, sliding_window=None)) < TOL
    assert _max_err(ctx.all_logits(), hf_logits(tiny_mistral_hf, toks)) > 1e-2


@pytest.mark.parametrize("start,delta", [(10, -10), (0, 7)])
def test_gemma3_k_shift_uses_each_layers_rope_base(tiny_gemma3_hf, start, delta):
    """Shift a 14-token sequence (longer than the window) by delta with a full-size SWA cache (K-shift
    needs equal sizes): the next token's logits equal transformers' on the shifted positions, which
    needs base 10000 on the sliding layers and 1e6 on the full one."""
    model = engine.load_model(tiny_gemma3_hf)
    toks = _tokens(15, seed=61)
    ctx = _context(model, n_ctx=64, swa_full=True)
    assert ctx.memory.can_shift()
    assert ctx.decode(Batch.for_sequence(toks[:14], 0, start)) == 0
    ctx.memory.seq_add(0, -1, -1, delta)
    new_start = start + delta
    assert ctx.decode(Batch([toks[14]], [new_start + 14], [[0]], [True])) == 0
    assert all(shift == 0 for cache in ctx.memory.caches() for _, _, shift in cache.cells(0))
    ref = hf_logits(tiny_gemma3_hf, toks, position_ids=torch.arange(new_start, new_start + 15)[None])[-1]
    err = _max_err(ctx.logits(0), ref)
    assert err < TOL, f"after K-shift: max |engine - transformers| = {err}"
