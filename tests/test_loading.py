"""Reading models: GGUF and Hugging Face twins agree, tokenizers agree, and bad files fail clearly."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.errors import ModelFileError, UnsupportedArchitectureError
from engine.formats.gguf_file import (
    dequantize_tensor,
    open_gguf,
    permute_qk,
    unpermute_qk,
)
from engine.formats.hf_folder import rope_from_hf_config
from engine.models.config import RopeScaling
from engine.models.load import Checkpoint, read_checkpoint
from engine.models.tokenizer import Tokenizer, tokenizer_from_gguf_metadata
from engine.testing import write_gguf_from_hf, write_hf_model
from engine.testing.tiny_models import TINY_TEST_SHAPE as TINY_SHAPE
from engine.testing.tiny_models import llama3_rope_freq_factors

SENTENCES = [
    "The lighthouse keeper woke before the sun.",
    "Children would soon be walking to school, and their parents would stop at the bakery!",
    "It's 9:15 -- he counted 212 cows, nine horses and one goat.\n\n  Indented line\twith a tab.",
    "Unicode works too: café, naïve, Ünïcödé, 東京, and an emoji 🙂.",
    "<s>special tokens in text</s> stay whole",
]
LLAMA3_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


@pytest.fixture(scope="module")
def llama_hf(tiny_llama_hf: Path) -> Checkpoint:
    return read_checkpoint(tiny_llama_hf)


@pytest.fixture(scope="module")
def llama_gguf(tiny_llama_gguf: Path) -> Checkpoint:
    return read_checkpoint(tiny_llama_gguf)


def _convert(hf: Path, tmp_path: Path, **kwargs) -> Checkpoint:
    return read_checkpoint(write_gguf_from_hf(hf, tmp_path / f"{hf.name}.gguf", **kwargs))


# ---------------------------------------------------------------------------------------------
# HF folder and GGUF twin


def test_f32_gguf_twin_has_identical_config_and_tensors(llama_hf: Checkpoint, llama_gguf: Checkpoint) -> None:
    assert llama_gguf.file_format == "gguf" and llama_hf.file_format == "hf"
    assert llama_gguf.config == llama_hf.config
    assert llama_gguf.config.n_vocab == TINY_SHAPE["vocab_size"] and llama_gguf.config.add_bos
    assert llama_gguf.tensors.keys() == llama_hf.tensors.keys()
    for name, hf_tensor in llama_hf.tensors.items():
        assert llama_gguf.tensors[name].dtype == torch.float32
        assert torch.equal(llama_gguf.tensors[name], hf_tensor), name
    assert set(llama_gguf.tensor_types.values()) == {"F32"}


def test_qwen2_twin_keeps_biases_and_tied_embeddings(tiny_qwen2_hf: Path, tmp_path: Path) -> None:
    hf = read_checkpoint(tiny_qwen2_hf)
    gg = _convert(tiny_qwen2_hf, tmp_path)
    assert gg.config == hf.config
    assert hf.config.arch == "qwen2" and hf.config.attention_bias and hf.config.tie_word_embeddings
    assert "lm_head.weight" not in gg.tensors and "model.layers.1.self_attn.k_proj.bias" in gg.tensors
    for name, hf_tensor in hf.tensors.items():
        assert torch.equal(gg.tensors[name], hf_tensor), name  # qwen2 is not permuted


def test_f16_twin_is_within_half_precision(tiny_llama_hf: Path, llama_hf: Checkpoint, tmp_path: Path) -> None:
    gg = _convert(tiny_llama_hf, tmp_path, tensor_type="F16")
    assert gg.config == llama_hf.config
    for name, hf_tensor in llama_hf.tensors.items():
        expected_type = "F32" if hf_tensor.ndim == 1 else "F16"  # norms stay F32, as in llama.cpp
        assert gg.tensor_types[name] == expected_type, name
        torch.testing.assert_close(gg.tensors[name], hf_tensor, rtol=1e-3, atol=1e-6, msg=name)


def _assert_within_q8_0_error(name: str, found: torch.Tensor, exact: torch.Tensor) -> None:
    """Q8_0 stores blocks of 32 as int8 times an f16 scale d = max|x| / 127: error <= d/2 plus the
    scale's own f16 rounding (127 * d * 2^-11), so 0.6 d is a strict bound."""
    blocks = exact.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    err = (found.reshape(-1, 32) - blocks).abs()
    assert bool((err <= 0.6 * d + 1e-7).all()), f"{name}: max error {err.max():.3g} exceeds the Q8_0 bound"


@pytest.mark.parametrize("tensor_type", ["Q8_0", "mixed"])
def test_quantized_twin_is_within_quantization_error(
    tiny_llama_hf: Path, llama_hf: Checkpoint, tmp_path: Path, tensor_type: str
) -> None:
    gg = _convert(tiny_llama_hf, tmp_path, tensor_type=tensor_type)
    assert gg.config == llama_hf.config
    if tensor_type == "mixed":
        assert set(gg.tensor_types.values()) == {"F32", "F16", "Q8_0"}
    for name, hf_tensor in llama_hf.tensors.items():
        kind = gg.tensor_types[name]
        if kind == "Q8_0":
            _assert_within_q8_0_error(name, gg.tensors[name], hf_tensor)
        elif kind == "F16":
            torch.testing.assert_close(gg.tensors[name], hf_tensor, rtol=1e-3, atol=1e-6, msg=name)
        else:
            assert torch.equal(gg.tensors[name], hf_tensor), name


def test_sharded_safetensors_load_like_a_single_file(llama_hf: Checkpoint, tmp_path: Path) -> None:
    folder = write_hf_model(tmp_path / "tiny-llama", "llama", seed=0, max_shard_size="60KB", **TINY_SHAPE)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    sharded = read_checkpoint(folder)
    assert sharded.config == llama_hf.config
    for name, tensor in llama_hf.tensors.items():
        assert torch.equal(sharded.tensors[name], tensor), name


def test_config_json_path_reads_its_folder(tiny_llama_hf: Path, llama_hf: Checkpoint) -> None:
    assert read_checkpoint(tiny_llama_hf / "config.json").config == llama_hf.config


# ---------------------------------------------------------------------------------------------
# Q/K permutation


def test_permute_moves_half_rows_to_adjacent_rows() -> None:
    """One head of size 4: HF rows (0, 1 | 2, 3) become llama.cpp rows (0, 2, 1, 3)."""
    w = torch.arange(4.0).reshape(4, 1)
    assert permute_qk(w, n_head=1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_qk(permute_qk(w, 3), 3), w)


def test_gguf_reader_undoes_the_llama_permutation(
    tiny_llama_hf: Path, tiny_llama_gguf: Path, llama_hf: Checkpoint, llama_gguf: Checkpoint, tmp_path: Path
) -> None:
    raw = {t.name: t for t in open_gguf(tiny_llama_gguf).tensors}
    for layer in range(TINY_SHAPE["n_layer"]):
        for short, hf_name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
            name = f"model.layers.{layer}.self_attn.{hf_name}.weight"
            stored = dequantize_tensor(raw[f"blk.{layer}.{short}.weight"], tiny_llama_gguf)
            assert not torch.equal(stored, llama_hf.tensors[name]), "the file should hold permuted rows"
            assert torch.equal(llama_gguf.tensors[name], llama_hf.tensors[name])
    # a file written without the permutation reads back wrong: the reader really un-permutes
    unpermuted = _convert(tiny_llama_hf, tmp_path, permute_qk=False)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(unpermuted.tensors[q], llama_hf.tensors[q])
    assert torch.equal(unpermuted.tensors[q], unpermute_qk(llama_hf.tensors[q], TINY_SHAPE["n_head"]))


# ---------------------------------------------------------------------------------------------
# RoPE scaling


def test_llama3_rope_scaling_reaches_both_formats(tmp_path: Path) -> None:
    folder = write_hf_model(
        tmp_path / "llama3", "llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, **TINY_SHAPE
    )
    hf = read_checkpoint(folder)
    assert hf.config.rope_scaling == LLAMA3_SCALING and hf.config.rope_theta == 500000.0
    gg = _convert(folder, tmp_path)
    # llama.cpp keeps llama3 scaling as a rope_freqs tensor of per-pair divisors, not as keys
    assert gg.config.rope_scaling is None
    expected = llama3_rope_freq_factors(LLAMA3_SCALING, head_dim=hf.config.head_dim, rope_theta=500000.0)
    assert torch.equal(gg.config.extra["rope_freqs"], torch.from_numpy(expected))
    assert dataclasses.replace(gg.config, rope_scaling=LLAMA3_SCALING) == hf.config


def test_both_config_json_dialects_give_the_same_rope() -> None:
    path = Path("config.json")
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    v5 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    assert rope_from_hf_config(legacy, path) == rope_from_hf_config(v5, path) == (500000.0, LLAMA3_SCALING)
    assert rope_from_hf_config({"rope_theta": 1e6}, path) == (1e6, None)
    with pytest.raises(ModelFileError, match="'yarn' is not supported"):
        rope_from_hf_config({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, path)


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_gguf_tokenizer_encodes_and_decodes_like_tokenizer_json(llama_hf: Checkpoint, llama_gguf: Checkpoint) -> None:
    hf_tok, gg_tok = llama_hf.tokenizer, llama_gguf.tokenizer
    assert (gg_tok.bos_id, gg_tok.eos_ids, gg_tok.add_bos) == (hf_tok.bos_id, hf_tok.eos_ids, True)
    for text in SENTENCES:
        ids = hf_tok.encode(text)
        assert gg_tok.encode(text) == ids, text
        assert ids[0] == hf_tok.bos_id and hf_tok.encode(text, add_bos=False) == ids[1:]
        assert gg_tok.decode(ids[1:]) == hf_tok.decode(ids[1:]) == text
    special = hf_tok.encode(SENTENCES[-1], add_bos=False)
    assert special[0] == hf_tok.bos_id and [i for i in special if hf_tok.is_eog(i)] == [1]
    assert gg_tok.decode(special, skip_special=True) == "special tokens in text stay whole"


def test_stream_decoder_never_splits_a_character(llama_gguf: Checkpoint) -> None:
    tok = llama_gguf.tokenizer
    text = SENTENCES[3]
    ids = tok.encode(text, add_bos=False)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(p == "" for p in pieces) > 1, "some ids carry only part of a character and must wait"


def _spm_metadata() -> dict:
    """SentencePiece-style vocabulary as llama.cpp stores it: control, byte and scored tokens."""
    pieces = {"▁": -1.0, "h": -2.0, "e": -2.1, "l": -2.2, "o": -2.3, "w": -2.4, "r": -2.5, "d": -2.6,
              "ll": -3.0, "▁h": -3.1, "▁he": -3.2, "llo": -3.3, "▁hello": -3.4, "▁w": -3.5, "or": -3.6,
              "▁wor": -3.7, "ld": -3.8, "▁world": -3.9, "el": -9.0}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values())
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


def test_sentencepiece_metadata_builds_a_round_tripping_tokenizer() -> None:
    tok = tokenizer_from_gguf_metadata(_spm_metadata(), source="spm.gguf")
    ids = tok.encode("hello world")
    assert tok.add_bos and ids[0] == 1  # llama.cpp adds BOS for SPM vocabularies by default
    assert [tok.token_text(i) for i in ids[1:]] == ["▁hello", "▁world"]
    text = "hello world\nhé! dd"
    pieces = [tok.token_text(i) for i in tok.encode(text, add_bos=False)]
    assert "<0x0A>" in pieces and "<0xC3>" in pieces  # unknown characters fall back to bytes
    assert tok.decode(tok.encode(text)[1:]) == text
    stream = tok.stream()
    assert [stream.push(i) for i in ids[1:]] == ["hello", " world"]


def test_sentencepiece_metadata_matches_sentencepiece_itself() -> None:
    """Export a trained SentencePiece BPE the way convert_hf_to_gguf does; ids must match spm's."""
    spm = pytest.importorskip("sentencepiece")
    import io

    from engine.testing import TINY_CORPUS

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TINY_CORPUS.splitlines()), model_writer=model, vocab_size=600, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
                "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id()}
    tok = tokenizer_from_gguf_metadata(metadata, source="spm.gguf")
    for text in SENTENCES[:4]:
        assert tok.encode(text, add_bos=False) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_unknown_tokenizer_model_names_file_and_model() -> None:
    metadata = {"tokenizer.ggml.model": "wordpiece", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(ModelFileError, match=r"bert\.gguf.*'wordpiece'"):
        tokenizer_from_gguf_metadata(metadata, source="bert.gguf")


def test_add_bos_needs_a_bos_id(llama_hf: Checkpoint) -> None:
    with pytest.raises(ValueError, match="needs a bos_id"):
        Tokenizer(llama_hf.tokenizer.backend, bos_id=None, add_bos=True)


# ---------------------------------------------------------------------------------------------
# Dequantization of types the converter does not write


def _write_single_tensor_gguf(path: Path, arrays: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in arrays.items():
        if data.dtype == np.uint8:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _read_all(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
    return {t.name: (dequantize_tensor(t, path), t.tensor_type.name) for t in open_gguf(path).tensors}


def _q4_k_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made Q4_K (ggml block_q4_K): per 256 values, f16 d and dmin, 12 bytes of 6-bit scales
    and mins for 8 sub-blocks of 32, and 128 bytes of 4-bit values; x = d*sc*q - dmin*m.
    Returns (bytes, the exact values those bytes encode)."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    span = blocks.max(axis=2) - lo
    d = np.float16(span.max(axis=1) / 15 / 63).astype(np.float32)
    dmin = np.float16((-lo).max(axis=1) / 63).astype(np.float32)
    sc = np.clip(np.rint(span / 15 / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((blocks + (dmin[:, None] * m)[..., None]) / step), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(
        [(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)  # sub-blocks 2j (low) and 2j+1 (high)
    raw = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                          dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), packed_scales, qs], axis=1)
    exact = step * q - (dmin[:, None] * m)[..., None]
    return raw.reshape(x.shape[0], -1), exact.reshape(x.shape)


def _q6_k_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made Q6_K (ggml block_q6_K): per 256 values, 128 bytes of low 4 bits, 64 bytes of high
    2 bits, 16 int8 scales (one per 16 values) and an f16 d; x = d*scale*(q - 32)."""
    blocks = x.reshape(-1, 16, 16).astype(np.float32)
    sub_scale = np.abs(blocks).max(axis=2) / 31
    d = np.float16(sub_scale.max(axis=1) / 127).astype(np.float32)
    scales = np.clip(np.rint(sub_scale / d[:, None]), 1, 127).astype(np.int8)
    step = (d[:, None] * scales)[..., None]
    q = (np.clip(np.rint(blocks / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    raw = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8),
                          d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    exact = step * (q.reshape(-1, 16, 16).astype(np.float32) - 32)
    return raw.reshape(x.shape[0], -1), exact.reshape(x.shape)


def test_dequantizes_bf16_q4_0_q4_k_q6_k(tmp_path: Path) -> None:
    """gguf-py quantizes BF16 and Q4_0 but not Q4_K/Q6_K, so those blocks are built by hand above
    from ggml's layouts; their decoded values must equal exactly what the bytes encode."""
    Q = gguf.GGMLQuantizationType
    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)  # not square: catches shape order
    bf16 = x.view(np.uint32) & 0xFFFF0000  # values exactly representable in bf16
    q4_k, q4_k_exact = _q4_k_blocks(x)
    q6_k, q6_k_exact = _q6_k_blocks(x)
    path = _write_single_tensor_gguf(tmp_path / "types.gguf", {
        "bf16": (gguf.quants.quantize(bf16.view(np.float32), Q.BF16), Q.BF16),
        "q4_0": (gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0),
        "q4_k": (q4_k, Q.Q4_K),
        "q6_k": (q6_k, Q.Q6_K),
    })
    got = _read_all(path)
    assert {name: kind for name, (_, kind) in got.items()} == {name: name.upper() for name in got}
    assert all(t.shape == (6, 512) and t.dtype == torch.float32 for t, _ in got.values())
    assert torch.equal(got["bf16"][0], torch.from_numpy(bf16.view(np.float32)))
    torch.testing.assert_close(got["q4_k"][0], torch.from_numpy(q4_k_exact), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["q6_k"][0], torch.from_numpy(q6_k_exact), rtol=1e-6, atol=1e-6)
    # worst cases: Q4_0 clips the far extreme by d = amax/8; Q4_K rounds to half of range/15;
    # Q6_K to half of amax/31 (plus a little for the rounded scales)
    amax = np.abs(x).max()
    for name, bound in (("q4_0", amax / 8), ("q4_k", amax / 14), ("q6_k", amax / 50)):
        err = (got[name][0] - torch.from_numpy(x)).abs().max().item()
        assert err <= bound, f"{name}: max error {err:.3g} above {bound:.3g}"


def test_undecodable_type_names_the_tensor_and_the_fix(tmp_path: Path) -> None:
    x = np.zeros((2, 256), dtype=np.float32)
    q5_0 = gguf.GGMLQuantizationType.Q5_0
    path = _write_single_tensor_gguf(tmp_path / "q5.gguf", {"w": (gguf.quants.quantize(x, q5_0), q5_0)})
    with pytest.raises(ModelFileError, match=r"q5\.gguf.*'w'.*Q5_0.*llama-quantize"):
        _read_all(path)


# ---------------------------------------------------------------------------------------------
# Bad input


def _copy_folder(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def test_missing_path() -> None:
    with pytest.raises(ModelFileError, match=r"nowhere\.gguf: no such file or folder"):
        read_checkpoint("/nowhere/nowhere.gguf")


def test_corrupt_magic(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad-magic.gguf"
    bad.write_bytes(b"GGML" + tiny_llama_gguf.read_bytes()[4:])
    with pytest.raises(ModelFileError, match=r"bad-magic\.gguf: not a GGUF file.*b'GGML'"):
        read_checkpoint(bad)


@pytest.mark.parametrize("keep", [0.5, 0.01, 0.999])
def test_truncated_gguf(tiny_llama_gguf: Path, tmp_path: Path, keep: float) -> None:
    """Cut in the tensor data, inside the header, and one byte short of the end."""
    data = tiny_llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)] if keep < 0.999 else data[:-1])
    with pytest.raises(ModelFileError, match=r"cut\.gguf: .*truncated"):
        read_checkpoint(cut)


def test_hf_folder_of_unsupported_architecture(tiny_llama_hf: Path, tmp_path: Path) -> None:
    folder = _copy_folder(tiny_llama_hf, tmp_path / "gemma")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gemma3", architectures=["Gemma3ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=r"gemma.*'gemma3'.*llama, qwen2"):
        read_checkpoint(folder)


# Missing and mis-shaped tensors: tests/test_gguf_errors.py, which checks that each format's errors
# use that format's own tensor names and shape order.


def test_pickle_only_folder_is_refused(tiny_llama_hf: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_llama_hf / name, folder / name)
    (folder / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ModelFileError, match=r"pickled.*pytorch_model\.bin.*refuses pickle.*safetensors"):
        read_checkpoint(folder)


@pytest.mark.parametrize("damage", ["invalid json", "no config", "no tokenizer", "truncated weights"])
def test_broken_hf_folder(tiny_llama_hf: Path, tmp_path: Path, damage: str) -> None:
    folder = _copy_folder(tiny_llama_hf, tmp_path / "broken")
    weights = folder / "model.safetensors"
    if damage == "invalid json":
        (folder / "config.json").write_text('{"model_type": "llama",')
        expected = r"config\.json: invalid JSON"
    elif damage == "no config":
        (folder / "config.json").unlink()
        expected = r"config\.json: missing"
    elif damage == "no tokenizer":
        (folder / "tokenizer.json").unlink()
        expected = r"tokenizer\.json: missing"
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        expected = r"model\.safetensors: corrupt or truncated"
    with pytest.raises(ModelFileError, match=expected):
        read_checkpoint(folder)


def test_pre_tokenizers_split_like_llama_cpp(caplog: pytest.LogCaptureFixture) -> None:
    from engine.models.tokenizer import pre_tokenizer_for

    def pieces(pre: str | None) -> list[str]:
        return [p for p, _ in pre_tokenizer_for(pre).pre_tokenize_str("It's 12345 cats")]

    assert pieces("gpt-2") == pieces("gpt2") == ["It", "'s", "Ġ12345", "Ġcats"]  # llama.cpp's name; kvscope's old one
    assert pieces("llama-bpe") == pieces("llama3") == ["It", "'s", "Ġ", "123", "45", "Ġcats"]
    assert pieces("qwen2") == ["It", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġcats"]
    assert pieces("smollm") == ["It", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġcats"]
    assert pieces("default") == ["It", "'", "s", "Ġ", "123", "45", "Ġcats"]
    with caplog.at_level("WARNING"):
        assert pieces("no-such-pre") == pieces("gpt-2")
    assert "unknown pre-tokenizer 'no-such-pre'" in caplog.text


def test_bos_from_a_post_processor_is_the_default_and_not_doubled(tiny_llama_hf: Path, tmp_path: Path) -> None:
    """Llama 3 folders say "add BOS" only through tokenizer.json's TemplateProcessing."""
    folder = _copy_folder(tiny_llama_hf, tmp_path / "templated")
    tok_json = json.loads((folder / "tokenizer.json").read_text())
    tok_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok_json))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ckpt = read_checkpoint(folder)
    assert ckpt.config.add_bos
    ids = ckpt.tokenizer.encode("hello")
    assert ids[0] == 0 and ids[1] != 0


def test_test_model_writer_refuses_a_vocabulary_smaller_than_its_tokenizer(tmp_path: Path) -> None:
    """The byte-level test tokenizer always holds 258 tokens: a smaller model vocabulary would make a folder
    whose tokenizer has more tokens than the embedding has rows (its GGUF then fails to load)."""
    from engine.testing import write_hf_model

    with pytest.raises(ValueError, match="vocab_size must be at least 258"):
        write_hf_model(tmp_path / "m", "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, vocab_size=256)
    assert not (tmp_path / "m").exists()
