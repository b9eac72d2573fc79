"""Tensor errors speak the file's language: GGUF names and ggml shapes for a GGUF file, Hugging Face
names and torch shapes for a Hugging Face folder.

A GGUF user looks for `blk.2.ffn_down.weight`, not `model.layers.2.mlp.down_proj.weight`, and reads
shapes the way llama.cpp and gguf-py print them (ne0 first). Each broken model below is built the same
way in both formats (a Hugging Face folder is damaged, then converted as llama.cpp's converter would),
and each error is compared whole.
"""
from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch

from engine.errors import ModelFileError
from engine.formats.gguf_file import (
    GGUF_ARCHITECTURES,
    gguf_tensor_name,
    hf_tensor_name,
)
from engine.models.load import expected_tensor_shapes, read_checkpoint
from engine.sizing.estimate import config_from_headers
from engine.testing import write_gguf_from_hf, write_hf_model
from engine.testing.tiny_models import TINY_TEST_SHAPE
from tests.model_factory import tiny_config

GGML_ORDER = "(ggml order, ne0 first, as llama.cpp and gguf-py list dimensions; numpy/torch order is the reverse)"
TORCH_ORDER = "(torch order, as safetensors stores it)"
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

Edit = Callable[[dict[str, torch.Tensor]], None]


def _drop(name: str) -> Edit:
    return lambda tensors: tensors.pop(name)


def _keep_rows(name: str, rows: int) -> Edit:
    return lambda tensors: tensors.update({name: tensors[name][:rows].contiguous()})


def _keep_columns(name: str, columns: int) -> Edit:
    return lambda tensors: tensors.update({name: tensors[name][:, :columns].contiguous()})


@dataclass(frozen=True)
class Damage:
    """One broken model, and the error each format must give (after "{path}: ")."""

    id: str
    model: str  # the fixture of the intact Hugging Face folder
    edit: Edit
    gguf_error: str
    hf_error: str


def _missing(gguf_name: str, ggml_shape: list[int], hf_name: str, torch_shape: list[int]) -> tuple[str, str]:
    return (f"tensor '{gguf_name}' is missing; the header's hyper-parameters need it with shape {ggml_shape} "
            f"{GGML_ORDER}; convert the model again",
            f"tensor '{hf_name}' is missing; config.json needs it with shape {torch_shape} {TORCH_ORDER}")


def _misshaped(gguf_name: str, found: list[int], need: list[int], hf_name: str) -> tuple[str, str]:
    return (f"tensor '{gguf_name}' has shape {found} but the header's hyper-parameters need {need} "
            f"{GGML_ORDER}; convert the model again",
            f"tensor '{hf_name}' has shape {found[::-1]} but config.json needs {need[::-1]} {TORCH_ORDER}")


DAMAGES = [
    Damage("llama-missing-ffn_down", "tiny_llama_hf", _drop("model.layers.1.mlp.down_proj.weight"),
           *_missing("blk.1.ffn_down.weight", [128, 64], "model.layers.1.mlp.down_proj.weight", [64, 128])),
    Damage("llama-missing-token_embd", "tiny_llama_hf", _drop("model.embed_tokens.weight"),
           *_missing("token_embd.weight", [64, 512], "model.embed_tokens.weight", [512, 64])),
    Damage("llama-misshaped-attn_k", "tiny_llama_hf", _keep_rows("model.layers.0.self_attn.k_proj.weight", 16),
           *_misshaped("blk.0.attn_k.weight", [64, 16], [64, 32], "model.layers.0.self_attn.k_proj.weight")),
    # Q/K/V and gate/up are concatenated after loading; the error must name the file's tensor
    Damage("llama-misshaped-attn_v", "tiny_llama_hf", _keep_rows("model.layers.1.self_attn.v_proj.weight", 16),
           *_misshaped("blk.1.attn_v.weight", [64, 16], [64, 32], "model.layers.1.self_attn.v_proj.weight")),
    Damage("llama-misshaped-ffn_up", "tiny_llama_hf", _keep_rows("model.layers.0.mlp.up_proj.weight", 96),
           *_misshaped("blk.0.ffn_up.weight", [64, 96], [64, 128], "model.layers.0.mlp.up_proj.weight")),
    Damage("llama-misshaped-ffn_down", "tiny_llama_hf", _keep_columns("model.layers.0.mlp.down_proj.weight", 96),
           *_misshaped("blk.0.ffn_down.weight", [96, 64], [128, 64], "model.layers.0.mlp.down_proj.weight")),
    Damage("llama-misshaped-output", "tiny_llama_hf", _keep_rows("lm_head.weight", 256),
           *_misshaped("output.weight", [64, 256], [64, 512], "lm_head.weight")),
    # Gemma's norms are named differently in the two formats: HF's post_attention_layernorm is
    # llama.cpp's post_attention_norm here, and pre_feedforward_layernorm is ffn_norm
    Damage("gemma3-missing-post_attention_norm", "tiny_gemma3_hf",
           _drop("model.layers.1.post_attention_layernorm.weight"),
           *_missing("blk.1.post_attention_norm.weight", [64], "model.layers.1.post_attention_layernorm.weight", [64])),
    Damage("gemma3-missing-ffn_norm", "tiny_gemma3_hf", _drop("model.layers.3.pre_feedforward_layernorm.weight"),
           *_missing("blk.3.ffn_norm.weight", [64], "model.layers.3.pre_feedforward_layernorm.weight", [64])),
    Damage("gemma3-missing-post_ffw_norm", "tiny_gemma3_hf", _drop("model.layers.5.post_feedforward_layernorm.weight"),
           *_missing("blk.5.post_ffw_norm.weight", [64], "model.layers.5.post_feedforward_layernorm.weight", [64])),
    Damage("gemma3-missing-attn_q_norm", "tiny_gemma3_hf", _drop("model.layers.2.self_attn.q_norm.weight"),
           *_missing("blk.2.attn_q_norm.weight", [16], "model.layers.2.self_attn.q_norm.weight", [16])),
    Damage("gemma3-misshaped-attn_k_norm", "tiny_gemma3_hf", _keep_rows("model.layers.0.self_attn.k_norm.weight", 8),
           *_misshaped("blk.0.attn_k_norm.weight", [8], [16], "model.layers.0.self_attn.k_norm.weight")),
    Damage("gemma3-misshaped-attn_k", "tiny_gemma3_hf", _keep_rows("model.layers.0.self_attn.k_proj.weight", 16),
           *_misshaped("blk.0.attn_k.weight", [64, 16], [64, 32], "model.layers.0.self_attn.k_proj.weight")),
    # tied: the embedding is also the output head
    Damage("gemma3-misshaped-token_embd", "tiny_gemma3_hf", _keep_rows("model.embed_tokens.weight", 256),
           *_misshaped("token_embd.weight", [64, 256], [64, 512], "model.embed_tokens.weight")),
    Damage("qwen2-missing-attn_v-bias", "tiny_qwen2_hf", _drop("model.layers.1.self_attn.v_proj.bias"),
           *_missing("blk.1.attn_v.bias", [32], "model.layers.1.self_attn.v_proj.bias", [32])),
]


def _damaged_folder(request: pytest.FixtureRequest, damage: Damage, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(request.getfixturevalue(damage.model), tmp_path / f"broken-{damage.id}"))
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    damage.edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.id for d in DAMAGES])
def test_gguf_tensor_errors_use_gguf_names_and_ggml_shapes(
    request: pytest.FixtureRequest, damage: Damage, tmp_path: Path
) -> None:
    path = write_gguf_from_hf(_damaged_folder(request, damage, tmp_path), tmp_path / f"{damage.id}.gguf")
    with pytest.raises(ModelFileError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert message == f"{path}: {damage.gguf_error}"
    assert "model.layers" not in message and "_proj" not in message and "layernorm" not in message


@pytest.mark.parametrize("damage", DAMAGES[:1] + DAMAGES[7:8] + DAMAGES[-1:], ids=lambda d: d.id)
def test_estimate_refuses_a_gguf_that_cannot_load_in_its_names(
    request: pytest.FixtureRequest, damage: Damage, tmp_path: Path
) -> None:
    """`kvscope estimate` reads headers only, and must not estimate a model that would not load."""
    path = write_gguf_from_hf(_damaged_folder(request, damage, tmp_path), tmp_path / f"{damage.id}.gguf")
    with pytest.raises(ModelFileError) as caught:
        config_from_headers(path)
    assert str(caught.value) == f"{path}: {damage.gguf_error}"


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.id for d in DAMAGES])
def test_hf_tensor_errors_use_hf_names_and_torch_shapes(
    request: pytest.FixtureRequest, damage: Damage, tmp_path: Path
) -> None:
    folder = _damaged_folder(request, damage, tmp_path)
    with pytest.raises(ModelFileError) as caught:
        read_checkpoint(folder)
    assert str(caught.value) == f"{folder}: {damage.hf_error}"
    assert "blk." not in str(caught.value)


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_needed_tensor_has_a_gguf_name(arch: str, bias: bool) -> None:
    """GGUF errors are phrased from these names; a tensor without one would be reported the HF way."""
    config = tiny_config(arch=arch, attention_bias=bias)
    for hf_name in expected_tensor_shapes(config):
        gguf_name = gguf_tensor_name(hf_name, arch)
        assert gguf_name is not None, hf_name
        assert hf_tensor_name(gguf_name, arch) == hf_name


# ---------------------------------------------------------------------------------------------
# Damage in the tensor infos of the header, which gguf-py's reader reports without a tensor name


def _patch_tensor_info(path: Path, name: str, *, dims: list[int] | None = None, type_id: int | None = None) -> None:
    """Rewrite one tensor info in place: (u64 length, name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    assert data.count(key) == 1, f"{name} must occur once in {path}"
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    if dims is not None:
        assert len(dims) == n_dims, "the patch keeps the number of dimensions"
        struct.pack_into(f"<{n_dims}Q", data, at + 4, *dims)
    if type_id is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copyfile(src, dst))


@pytest.fixture(params=["read_checkpoint", "estimate"])
def reader(request: pytest.FixtureRequest) -> Callable[[Path], object]:
    """Both ways of opening a GGUF: loading it, and `kvscope estimate`, which reads headers only."""
    return read_checkpoint if request.param == "read_checkpoint" else config_from_headers


def test_truncated_data_names_the_cut_tensor(tiny_llama_gguf: Path, tmp_path: Path, reader) -> None:
    data = tiny_llama_gguf.read_bytes()
    cut_at = len(data) // 2
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:cut_at])
    first_cut = next(t for t in gguf.GGUFReader(tiny_llama_gguf).tensors if t.data_offset + t.n_bytes > cut_at)
    with pytest.raises(ModelFileError) as caught:
        reader(cut)
    assert str(caught.value) == (
        f"{cut}: truncated GGUF: tensor '{first_cut.name}' needs bytes "
        f"[{first_cut.data_offset}, {first_cut.data_offset + first_cut.n_bytes}) but the file has {cut_at} bytes; "
        "download or convert it again"
    )


def test_quantized_row_that_is_not_whole_blocks_is_named(tiny_llama_hf: Path, tmp_path: Path, reader) -> None:
    path = write_gguf_from_hf(tiny_llama_hf, tmp_path / "q8.gguf", tensor_type="Q8_0")
    _patch_tensor_info(path, "blk.1.attn_q.weight", dims=[48, 64])
    with pytest.raises(ModelFileError) as caught:
        reader(path)
    assert str(caught.value) == (
        f"{path}: tensor 'blk.1.attn_q.weight' is Q8_0 with shape [48, 64] {GGML_ORDER}, but Q8_0 stores "
        "rows in blocks of 32 values and ne0 = 48 is not a multiple of 32; the file is damaged: download or "
        "convert it again"
    )


def test_unknown_tensor_type_is_named(tiny_llama_gguf: Path, tmp_path: Path, reader) -> None:
    path = _copy(tiny_llama_gguf, tmp_path / "odd-type.gguf")
    _patch_tensor_info(path, "blk.0.ffn_gate.weight", type_id=250)
    with pytest.raises(ModelFileError) as caught:
        reader(path)
    from importlib.metadata import version

    assert str(caught.value) == (
        f"{path}: tensor 'blk.0.ffn_gate.weight' has ggml type id 250, which gguf-py {version('gguf')} does not "
        "know; the file is damaged or newer than gguf-py: update gguf (pip install -U gguf), or download or "
        "convert the model again"
    )


def test_misshaped_rope_freqs_is_named(tmp_path: Path) -> None:
    folder = write_hf_model(tmp_path / "llama3", "llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                            **TINY_TEST_SHAPE)
    path = write_gguf_from_hf(folder, tmp_path / "llama3.gguf")
    _patch_tensor_info(path, "rope_freqs.weight", dims=[4])
    with pytest.raises(ModelFileError) as caught:
        read_checkpoint(path)
    assert str(caught.value) == (
        f"{path}: tensor 'rope_freqs.weight' has shape [4] but the header's hyper-parameters need [8] "
        f"{GGML_ORDER}; convert the model again"
    )


def test_undecodable_type_in_a_model_names_the_gguf_tensor(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """An F32 tensor relabelled Q5_0 (a type kvscope does not decode) needs fewer bytes, so the file
    still reads; the refusal must name the file's tensor."""
    path = _copy(tiny_llama_gguf, tmp_path / "q5.gguf")
    _patch_tensor_info(path, "blk.1.attn_output.weight", type_id=int(gguf.GGMLQuantizationType.Q5_0))
    with pytest.raises(ModelFileError) as caught:
        read_checkpoint(path)
    assert str(caught.value) == (
        f"{path}: tensor 'blk.1.attn_output.weight' is stored as Q5_0, which kvscope cannot dequantize; "
        "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K. Requantize the model with llama-quantize (e.g. to Q8_0)"
    )
