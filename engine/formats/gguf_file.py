"""Reading GGUF files (llama.cpp's model format) into Hugging Face names and layouts.

A GGUF holds metadata (hyper-parameters, the tokenizer) and tensors named the llama.cpp way
(`blk.0.attn_q.weight`), possibly quantized. `read_gguf` returns float32 torch tensors renamed to
the Hugging Face names the rest of kvscope uses, with llama.cpp's Q/K row permutation undone (llama
only: qwen2 and Gemma are stored unpermuted), and a `ModelConfig` built from the metadata the way
llama.cpp's llama_model::load_hparams reads it. Every failure is a `ModelFileError` naming the file.

Tensor errors speak GGUF: a missing, mis-shaped, cut or undecodable tensor is named as the file names
it (`blk.2.ffn_down.weight`, not the Hugging Face name kvscope uses inside), with shapes in ggml order
(ne0, the contiguous row length, first), as llama.cpp's llama_model_loader and gguf-py print them.
The checks read tensor infos only, before any data is decoded (`check_tensor_infos`).

Architectures and their keys:
- gemma3: `gemma3.attention.sliding_window` (absent or 0: no sliding window, as in llama.cpp), layer
  pattern 6 (il % 6 < 5 slides), `rope.freq_base` for full-attention layers and 10000 for sliding
  ones (llama.cpp hard-codes it), optional `rope.scaling.type` linear on full-attention layers,
  optional `final_logit_softcapping`, tensors attn_q_norm/attn_k_norm/post_attention_norm/
  post_ffw_norm, no output.weight (tied).
- gemma2: `gemma2.attention.sliding_window` (default 4096), pattern 2 (even layers slide),
  `attn_logit_softcapping` (default 50) and `final_logit_softcapping` (default 30).
- Gemma norm weights are stored as 1 + w (the converter adds 1); they are kept that way, which is
  also what the Hugging Face reader produces (engine/formats/hf_folder.py).
- Gemma's attention scale is not in the file: as llama.cpp, 1/sqrt(head_dim), except the 27B
  models (gemma2 46 layers, gemma3 62 layers), which use 1/sqrt(n_embd / n_head).
- A Mistral model converts to the llama architecture; its sliding window is not written, and llama.cpp
  ignores `llama.attention.sliding_window` if a file has it. kvscope does the same: a llama GGUF
  always runs with full attention (a warning names an ignored window), so a Mistral GGUF matches
  its Hugging Face folder only while the context is no longer than the window.

Example:
    contents = read_gguf("tiny.gguf")
    contents.tensors["model.layers.0.self_attn.q_proj.weight"].shape  # (n_head*head_dim, n_embd)
"""
from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelFileError, UnsupportedArchitectureError
from engine.formats.quantized_blocks import PACKED_TENSOR_TYPES, QuantizedBlocks, reorder_rows
from engine.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
    expected_tensor_shapes,
)

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

# llama.cpp architecture names kvscope reads from GGUF (Mistral models are "llama" there).
GGUF_ARCHITECTURES = tuple(a for a in SUPPORTED_ARCHITECTURES if a != "mistral")

# Storage types kvscope dequantizes; others (IQ*, Q2_K, ...) are refused with a clear message.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")

# Per-layer tensors: llama.cpp suffix -> Hugging Face suffix.
_LAYER_TENSOR_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Gemma's per-layer norms: llama.cpp's ffn_norm is the norm before the MLP (HF pre_feedforward_layernorm),
# post_attention_norm the norm of the attention output (HF post_attention_layernorm).
_GEMMA_LAYER_TENSOR_NAMES = {
    **_LAYER_TENSOR_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER_NAMES_BY_ARCH = {"gemma2": _GEMMA_LAYER_TENSOR_NAMES, "gemma3": _GEMMA_LAYER_TENSOR_NAMES}
# layer pattern of llama.cpp's set_swa_pattern(n) for the architectures with sliding windows
GGUF_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6}
GEMMA2_DEFAULT_SWA = 4096  # llama.cpp's default when gemma2.attention.sliding_window is absent
GEMMA3_ROPE_BASE_SWA = 10000.0  # llama.cpp's hard-coded RoPE base of gemma3's sliding layers
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_LAYER_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# said wherever a GGUF error gives a shape: the reverse of what a numpy/torch user expects
GGML_ORDER = "(ggml order, ne0 first, as llama.cpp and gguf-py list dimensions; numpy/torch order is the reverse)"


@dataclass(frozen=True)
class GGUFContents:
    """What a GGUF file holds, in kvscope's terms.

    `tensors` use Hugging Face names and layouts (float32, or QuantizedBlocks for quantized matrices
    read with keep_quantized); `tensor_types` gives each one's storage type in the file ("Q8_0",
    "F16", ...); `metadata` is every key/value of the header.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor | QuantizedBlocks]
    tensor_types: dict[str, str]
    metadata: dict[str, Any]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name of `arch`, or None if kvscope has no use for it."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_NAME_RE.match(gguf_name)
    if match is None:
        return None
    layer, suffix = match.groups()
    hf_suffix = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_TENSOR_NAMES).get(suffix)
    return None if hf_suffix is None else f"model.layers.{layer}.{hf_suffix}"


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str | None:
    """The llama.cpp name of a Hugging Face tensor name of `arch` (the inverse of hf_tensor_name)."""
    for gguf_name, hf in _GLOBAL_TENSOR_NAMES.items():
        if hf == hf_name:
            return gguf_name
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if m is None:
        return None
    by_hf = {hf: g for g, hf in _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_TENSOR_NAMES).items()}
    suffix = by_hf.get(m.group(2))
    return None if suffix is None else f"blk.{m.group(1)}.{suffix}"


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's per-head row interleave of a llama Q or K weight (or bias).

    The converter turns HF rows i and i + d/2 of each head into rows 2i and 2i + 1 (llama.cpp's
    RoPE rotates adjacent pairs, HF's rotates halves). This puts the halves back.
    """
    rows = weight.shape[0]
    assert rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads of even size"
    half = rows // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])  # (H, d/2, 2, ...)
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to a llama Q or K weight; the inverse of `unpermute_qk`."""
    rows = weight.shape[0]
    assert rows % (2 * n_head) == 0, f"{rows} rows do not split into {n_head} heads of even size"
    half = rows // n_head // 2
    w = weight.reshape(n_head, 2, half, *weight.shape[1:])  # (H, 2, d/2, ...)
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


# ---------------------------------------------------------------------------------------------
# Opening the file


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` on `path`, with every way a file can be bad turned into ModelFileError."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such GGUF file")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{path}: not a GGUF file (the first 4 bytes are {magic!r}, a GGUF starts with {GGUF_MAGIC!r})"
        )
    try:
        return _reader_class()(path)
    except _TensorInfoError as exc:
        raise ModelFileError(f"{path}: {exc}") from None
    except Exception as exc:  # GGUFReader raises ValueError, IndexError, KeyError, ... on bad bytes
        raise ModelFileError(
            f"{path}: corrupt or truncated GGUF ({file_size} bytes): the file ends before the data its "
            f"header describes, or the header is damaged ({type(exc).__name__}: {exc}); "
            "download or convert it again"
        ) from exc


class _TensorInfoError(Exception):
    """A tensor info that gguf-py cannot use; open_gguf prefixes the path."""


@functools.cache
def _reader_class() -> type:
    """gguf.GGUFReader, checking each tensor info before gguf-py maps its data: gguf-py reports a cut
    file, a partial quantization block or an unknown type as a numpy error that names no tensor."""
    import gguf

    class TensorCheckingReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _check_tensor_info(field, start_offs, int(self.data.size))
            super()._build_tensors(start_offs, fields)

    return TensorCheckingReader


def _check_tensor_info(field: Any, data_start: int, file_size: int) -> None:
    """Raise _TensorInfoError naming a tensor whose type is unknown, whose rows are not whole blocks
    of its type, or whose data runs past the end of the file."""
    import gguf

    if len(field.parts) != 6:
        return  # a gguf-py with another layout: its own (unnamed) errors still stop a bad file
    _, name_data, _, dims, raw_type, offset = field.parts  # length, name, n_dims, dims, type, offset
    name, ne = bytes(name_data).decode("utf-8", errors="replace"), [int(d) for d in dims]
    try:
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise _TensorInfoError(
            f"tensor {name!r} has ggml type id {int(raw_type[0])}, which gguf-py {_gguf_version()} does not know; "
            "the file is damaged or newer than gguf-py: update gguf (pip install -U gguf), or download or "
            "convert the model again"
        ) from None
    if ne and ne[0] % block:
        raise _TensorInfoError(
            f"tensor {name!r} is {qtype.name} with shape {ne} {GGML_ORDER}, but {qtype.name} stores rows in "
            f"blocks of {block} values and ne0 = {ne[0]} is not a multiple of {block}; the file is damaged: "
            "download or convert it again"
        )
    start = data_start + int(offset[0])
    end = start + math.prod(ne) // block * type_size
    if end > file_size:
        raise _TensorInfoError(
            f"truncated GGUF: tensor {name!r} needs bytes [{start}, {end}) but the file has {file_size} bytes; "
            "download or convert it again"
        )


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:  # a vendored copy has no package metadata
        return "(unknown version)"


# ---------------------------------------------------------------------------------------------
# Metadata


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every header key of the GGUF at `path` as plain Python values (str, int, float, bool, list)."""
    return metadata_from_reader(open_gguf(path), path)


def metadata_from_reader(reader: Any, path: str | Path) -> dict[str, Any]:
    """The header key/values of an open reader; the reader's own `GGUF.*` entries are left out."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception as exc:  # bad UTF-8, unknown value types
            raise ModelFileError(f"{path}: metadata key {key!r} cannot be read: {exc}") from exc
    return metadata


def _arch_of(metadata: dict[str, Any], path: str | Path) -> str:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: GGUF has no general.architecture key; is it a model file?")
    if arch not in GGUF_ARCHITECTURES:
        hint = " (llama.cpp's converter writes Mistral models as 'llama')" if arch.startswith("mistral") else ""
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported{hint}; kvscope runs {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def _float(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06), so a
    GGUF and the config.json it came from give equal configs."""
    return float(str(np.float32(value)))


def _require(metadata: dict[str, Any], key: str, path: str | Path) -> Any:
    if key not in metadata:
        raise ModelFileError(f"{path}: GGUF metadata key {key!r} is missing")
    return metadata[key]


def _rope_scaling_from_metadata(metadata: dict[str, Any], arch: str, path: str | Path) -> RopeScaling | None:
    """Rope scaling from `{arch}.rope.scaling.*` keys (llama3 GGUFs use a rope_freqs tensor instead)."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear" and factor == 1.0:
        return None  # some converters write a no-op linear scaling
    if kind != "llama3":
        raise ModelFileError(
            f"{path}: rope scaling type {kind!r} (factor {factor}) is not supported; "
            "kvscope implements unscaled RoPE and llama3-style scaling"
        )
    return RopeScaling(
        factor=factor,
        low_freq_factor=_float(metadata.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
        high_freq_factor=_float(metadata.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            _require(metadata, f"{arch}.rope.scaling.original_context_length", path)
        ),
    )


def swa_pattern_layers(n_layer: int, n_pattern: int, dense_first: bool = False) -> tuple[bool, ...]:
    """llama.cpp's llama_hparams::set_swa_pattern: n 0 -> every layer slides, 1 -> none; otherwise
    layer il slides iff il % n < n - 1 (dense_first: iff il % n != 0)."""
    if n_pattern == 0:
        return (True,) * n_layer
    if n_pattern == 1:
        return (False,) * n_layer
    if dense_first:
        return tuple(il % n_pattern != 0 for il in range(n_layer))
    return tuple(il % n_pattern < n_pattern - 1 for il in range(n_layer))


def _arch_hparams(metadata: dict[str, Any], arch: str, n_layer: int, n_embd: int, n_head: int, head_dim: int,
                  path: str | Path) -> dict[str, Any]:
    """The ModelConfig fields llama.cpp reads per architecture: sliding window and layer pattern,
    the sliding layers' RoPE base, soft-caps, attention scale, activation."""
    from engine.kv.swa import SwaType

    fields: dict[str, Any] = {}
    base_swa = metadata.get(f"{arch}.rope.freq_base_swa")
    if arch in GGUF_SWA_PATTERNS:
        default_swa = GEMMA2_DEFAULT_SWA if arch == "gemma2" else 0
        n_swa = int(metadata.get(f"{arch}.attention.sliding_window", default_swa) or 0)
        if n_swa > 0:
            fields.update(n_swa=n_swa, swa_type=int(SwaType.STANDARD),
                          swa_layers=swa_pattern_layers(n_layer, GGUF_SWA_PATTERNS[arch]))
        if arch == "gemma3":
            if base_swa is not None and _float(base_swa) != GEMMA3_ROPE_BASE_SWA:
                logger.warning("%s: ignoring %s.rope.freq_base_swa = %s; llama.cpp uses %s for gemma3's sliding layers",
                               path, arch, base_swa, GEMMA3_ROPE_BASE_SWA)
            fields["rope_theta_swa"] = GEMMA3_ROPE_BASE_SWA
            fields["attn_softcap"] = 0.0  # removed in Gemma 3
            fields["final_softcap"] = _float(metadata.get(f"{arch}.final_logit_softcapping", 0.0))
        else:
            if base_swa is not None:
                fields["rope_theta_swa"] = _float(base_swa)
            fields["attn_softcap"] = _float(metadata.get(f"{arch}.attn_logit_softcapping", 50.0))
            fields["final_softcap"] = _float(metadata.get(f"{arch}.final_logit_softcapping", 30.0))
        # llama.cpp: 1/sqrt(n_embd / n_head) for the 27B models, else 1/sqrt(head_dim)
        fields["query_pre_attn_scalar"] = float(n_embd // n_head if n_layer == _GEMMA_27B_LAYERS[arch] else head_dim)
        fields["hidden_act"] = "gelu_tanh"
    elif metadata.get(f"{arch}.attention.sliding_window"):
        logger.warning("%s: ignoring %s.attention.sliding_window = %s: llama.cpp runs the %s architecture with "
                       "full attention, and so does kvscope", path, arch,
                       metadata[f"{arch}.attention.sliding_window"], arch)
    return fields


def _linear_rope_scale(metadata: dict[str, Any], arch: str, path: str | Path) -> float:
    """gemma3's `rope.scaling.type` linear (full-attention layers only): llama.cpp's freq_scale, 1 / factor."""
    if metadata.get(f"{arch}.rope.scaling.type") != "linear":
        return 1.0
    factor = _float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if factor <= 0:
        raise ModelFileError(f"{path}: rope scaling factor must be positive, got {factor}")
    return 1.0 / factor


def _eos_ids_from_metadata(metadata: dict[str, Any]) -> tuple[int, ...]:
    """eos first, then end-of-turn / end-of-message ids, each once (llama.cpp's EOG set)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return tuple(ids)


def config_from_gguf_metadata(
    metadata: dict[str, Any],
    *,
    path: str | Path,
    embedding_rows: int | None = None,
    has_output: bool = True,
    has_attention_bias: bool = False,
    rope_freqs: torch.Tensor | None = None,
) -> ModelConfig:
    """Build a ModelConfig from GGUF header keys.

    Args:
        metadata: the header, as `read_gguf_metadata` returns it.
        path: the file, named in errors.
        embedding_rows: rows of token_embd, used for n_vocab when the header has no vocabulary.
        has_output: False when the file has no output.weight (tied embeddings).
        has_attention_bias: True when the file has attn_q.bias tensors.
        rope_freqs: llama3-style per-dim-pair frequency divisors, kept in `extra["rope_freqs"]`.
    """
    arch = _arch_of(metadata, path)
    n_embd = int(_require(metadata, f"{arch}.embedding_length", path))
    n_head = int(_require(metadata, f"{arch}.attention.head_count", path))
    n_layer = int(_require(metadata, f"{arch}.block_count", path))
    n_head_kv = int(metadata.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", n_embd // n_head))
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens:
        n_vocab = len(tokens)
    elif embedding_rows is not None:
        n_vocab = embedding_rows
    else:
        raise ModelFileError(f"{path}: cannot tell the vocabulary size (no tokenizer.ggml.tokens, no token_embd)")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    default_add_bos = metadata.get("tokenizer.ggml.model") == "llama"  # llama.cpp: SPM adds BOS unless told
    extra: dict[str, Any] = {}
    if rope_freqs is not None:
        extra["rope_freqs"] = rope_freqs
    arch_fields = _arch_hparams(metadata, arch, n_layer, n_embd, n_head, head_dim, path)
    if arch == "gemma3":
        rope_scaling, arch_fields["rope_freq_scale"] = None, _linear_rope_scale(metadata, arch, path)
    else:
        rope_scaling = _rope_scaling_from_metadata(metadata, arch, path)
    try:
        return ModelConfig(
            arch=arch,
            n_vocab=n_vocab,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=int(_require(metadata, f"{arch}.feed_forward_length", path)),
            rms_norm_eps=_float(_require(metadata, f"{arch}.attention.layer_norm_rms_epsilon", path)),
            rope_theta=_float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            n_ctx_train=int(_require(metadata, f"{arch}.context_length", path)),
            tie_word_embeddings=not has_output,
            attention_bias=has_attention_bias,
            rope_scaling=rope_scaling,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_eos_ids_from_metadata(metadata),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            name=str(metadata.get("general.name", "")),
            extra=extra,
            **arch_fields,
        )
    except ValueError as exc:  # ModelConfig's own checks (e.g. n_head not a multiple of n_head_kv)
        raise ModelFileError(f"{path}: inconsistent hyper-parameters: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Tensors


def ggml_shape(reader_tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's dimensions as the file lists them: ggml order, ne0 (the row length) first."""
    return tuple(int(d) for d in reader_tensor.shape.tolist())


def _check_decodable(reader_tensor: Any, path: str | Path) -> None:
    type_name = reader_tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise ModelFileError(
            f"{path}: tensor {reader_tensor.name!r} is stored as {type_name}, which kvscope cannot "
            f"dequantize; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}. Requantize the model with "
            "llama-quantize (e.g. to Q8_0)"
        )


def dequantize_tensor(reader_tensor: Any, path: str | Path) -> torch.Tensor:
    """A float32 torch copy of one GGUF tensor, in numpy/torch dimension order."""
    import gguf

    _check_decodable(reader_tensor, path)
    ne = ggml_shape(reader_tensor)
    try:
        values = gguf.quants.dequantize(reader_tensor.data, reader_tensor.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(ne[::-1])
    except Exception as exc:
        raise ModelFileError(
            f"{path}: tensor {reader_tensor.name!r} ({reader_tensor.tensor_type.name}, shape {list(ne)} "
            f"{GGML_ORDER}) cannot be decoded: {exc}"
        ) from exc
    # copy: the reader's arrays are views of a read-only memory map of the file
    return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def expected_ggml_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF of `config` must hold, under its llama.cpp name, with its ggml shape."""
    shapes = {}
    for hf_name, shape in expected_tensor_shapes(config).items():
        gguf_name = gguf_tensor_name(hf_name, config.arch)
        assert gguf_name is not None, f"no llama.cpp name for {hf_name} of {config.arch}"
        shapes[gguf_name] = shape[::-1]
    return shapes


def check_tensor_infos(reader: Any, config: ModelConfig, path: str | Path) -> None:
    """Check that the file holds every tensor `config` needs, with the right shape and a type kvscope
    decodes, from the tensor infos alone (no data is read).

    Raises:
        ModelFileError: naming the file, the tensor as the file names it, and the shapes in ggml order.
    """
    found = {t.name: t for t in reader.tensors}
    needed = expected_ggml_shapes(config)
    if ROPE_FREQS_TENSOR in found:
        needed[ROPE_FREQS_TENSOR] = (config.head_dim // 2,)  # one factor per rotated dimension pair
    for name, shape in needed.items():
        if name not in found:
            raise ModelFileError(
                f"{path}: tensor {name!r} is missing; the header's hyper-parameters need it with shape "
                f"{list(shape)} {GGML_ORDER}; convert the model again"
            )
        have = ggml_shape(found[name])
        if have != shape:
            raise ModelFileError(
                f"{path}: tensor {name!r} has shape {list(have)} but the header's hyper-parameters need "
                f"{list(shape)} {GGML_ORDER}; convert the model again"
            )
        _check_decodable(found[name], path)


def config_from_reader(reader: Any, metadata: dict[str, Any], path: str | Path,
                       rope_freqs: torch.Tensor | None = None) -> ModelConfig:
    """config_from_gguf_metadata, completed from the tensor infos: the vocabulary size when the header
    has no tokens, and whether output.weight and attention biases are present."""
    shapes = {t.name: ggml_shape(t) for t in reader.tensors}
    embed = shapes.get("token_embd.weight")
    return config_from_gguf_metadata(
        metadata,
        path=path,
        embedding_rows=embed[-1] if embed else None,  # ne1 of a well-formed token_embd
        has_output="output.weight" in shapes,
        has_attention_bias="blk.0.attn_q.bias" in shapes,
        rope_freqs=rope_freqs,
    )


def _undo_permutation(tensors: dict[str, torch.Tensor | QuantizedBlocks], config: ModelConfig) -> None:
    """llama.cpp permutes Q/K rows (weights and biases) of llama models only (Mistral included, which
    converts to llama); qwen2, gemma2 and gemma3 are stored as is."""
    if config.arch != "llama" or config.head_dim % 2:
        return
    for name in list(tensors):
        n_head = (config.n_head if ".self_attn.q_proj." in name else
                  config.n_head_kv if ".self_attn.k_proj." in name else None)
        if n_head is None:
            continue
        tensors[name] = reorder_rows(tensors[name], lambda rows: unpermute_qk(rows, n_head))


def quantized_blocks(reader_tensor: Any, path: str | Path) -> QuantizedBlocks:
    """A quantized matrix's rows of blocks, not decoded (a view of the file's memory map)."""
    ne = ggml_shape(reader_tensor)
    data = np.asarray(reader_tensor.data)
    if data.ndim != 2 or data.shape[0] != ne[1]:
        raise ModelFileError(f"{path}: tensor {reader_tensor.name!r} ({reader_tensor.tensor_type.name}, shape "
                             f"{list(ne)} {GGML_ORDER}) holds {data.shape} bytes of blocks; convert the model again")
    return QuantizedBlocks(data, reader_tensor.tensor_type.name, (ne[1], ne[0]))


def _decode_needed(reader: Any, config: ModelConfig, path: Path,
                   keep_quantized: bool) -> tuple[dict[str, torch.Tensor | QuantizedBlocks], dict[str, str]]:
    """The tensors `config` needs, decoded and renamed to Hugging Face names, with their storage types.
    keep_quantized: matrices of PACKED_TENSOR_TYPES stay blocks (QuantizedBlocks)."""
    needed = expected_ggml_shapes(config)
    tensors: dict[str, torch.Tensor | QuantizedBlocks] = {}
    tensor_types: dict[str, str] = {}
    for rt in reader.tensors:
        if rt.name in needed:
            hf_name = hf_tensor_name(rt.name, config.arch)
            kept = keep_quantized and rt.tensor_type.name in PACKED_TENSOR_TYPES and len(ggml_shape(rt)) == 2
            tensors[hf_name] = quantized_blocks(rt, path) if kept else dequantize_tensor(rt, path)
            tensor_types[hf_name] = rt.tensor_type.name
        elif rt.name != ROPE_FREQS_TENSOR:
            logger.warning("%s: skipping tensor %r, which kvscope does not use", path, rt.name)
    return tensors, tensor_types


def read_gguf(path: str | Path, *, keep_quantized: bool = False) -> GGUFContents:
    """Read a GGUF model: config, float32 tensors under Hugging Face names, storage types, metadata.

    Args:
        path: a `.gguf` file.
        keep_quantized: keep Q8_0, Q4_0, Q4_K and Q6_K matrices as QuantizedBlocks (for packing)
            instead of decoding them to float32.

    Returns:
        GGUFContents holding exactly the tensors the config needs, with the shapes it implies;
        tensors llama.cpp keeps but kvscope does not use are skipped (logged).

    Raises:
        ModelFileError: the file is missing, not GGUF or truncated, or a tensor is missing, mis-shaped
            or of a type kvscope cannot decode; tensors are named as in the file, shapes in ggml order.
        UnsupportedArchitectureError: general.architecture is not one of SUPPORTED_ARCHITECTURES.
    """
    path = Path(path)
    reader = open_gguf(path)
    metadata = metadata_from_reader(reader, path)
    _arch_of(metadata, path)  # fail on the architecture before decoding any tensor
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    config = config_from_reader(reader, metadata, path,
                                rope_freqs=None if rope_freqs is None else dequantize_tensor(rope_freqs, path))
    check_tensor_infos(reader, config, path)
    tensors, tensor_types = _decode_needed(reader, config, path, keep_quantized)
    _undo_permutation(tensors, config)
    return GGUFContents(config=config, tensors=tensors, tensor_types=tensor_types, metadata=metadata)
