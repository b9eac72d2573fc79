"""One entry point for model files: `read_checkpoint(path)` for a GGUF file or a Hugging Face folder.

The result is the same whatever the format: a ModelConfig, float32 tensors under Hugging Face
names and layouts, and a Tokenizer. Every tensor the config implies is checked for presence and
shape here, so the transformer can trust what it is given. Errors are ModelFileError (or its
subclass UnsupportedArchitectureError) naming the file and the problem.

Example:
    ckpt = read_checkpoint("tiny-llama.gguf")
    ckpt.config.n_layer, ckpt.tensor_types["model.layers.0.self_attn.q_proj.weight"]  # 2, "Q8_0"
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from engine.errors import ModelFileError
from engine.formats.gguf_file import GGUF_MAGIC, read_gguf
from engine.formats.hf_folder import read_hf_folder
from engine.models.config import ModelConfig
from engine.models.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A model read from disk.

    Attributes:
        config: hyper-parameters.
        tensors: float32 weights under Hugging Face names and layouts.
        tokenizer: text <-> ids.
        source: the path read.
        file_format: "gguf" or "hf".
        tensor_types: storage type of each tensor in the file ("F32", "BF16", "Q8_0", ...).
        metadata: the GGUF header or the parsed config.json.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str
    file_format: Literal["gguf", "hf"]
    tensor_types: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with `config` needs, with its Hugging Face shape."""
    c = config
    q_rows, kv_rows = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.n_vocab, c.n_embd),
        "model.norm.weight": (c.n_embd,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.n_vocab, c.n_embd)
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.n_embd,),
            p + "post_attention_layernorm.weight": (c.n_embd,),
            p + "self_attn.q_proj.weight": (q_rows, c.n_embd),
            p + "self_attn.k_proj.weight": (kv_rows, c.n_embd),
            p + "self_attn.v_proj.weight": (kv_rows, c.n_embd),
            p + "self_attn.o_proj.weight": (c.n_embd, q_rows),
            p + "mlp.gate_proj.weight": (c.n_ff, c.n_embd),
            p + "mlp.up_proj.weight": (c.n_ff, c.n_embd),
            p + "mlp.down_proj.weight": (c.n_embd, c.n_ff),
        }
        if c.is_gemma:
            # a norm before and after attention and MLP (post_attention_layernorm is the norm of the
            # attention output here, not the one before the MLP as in llama)
            shapes |= {
                p + "pre_feedforward_layernorm.weight": (c.n_embd,),
                p + "post_feedforward_layernorm.weight": (c.n_embd,),
            }
        if c.has_qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
            if c.arch != "qwen2":  # HF's attention_bias covers o_proj too; qwen2's o_proj has none
                shapes[p + "self_attn.o_proj.bias"] = (c.n_embd,)
    return shapes


def check_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, source: str | Path) -> dict[str, torch.Tensor]:
    """The tensors `config` needs, checked for presence and shape; others are dropped (logged).

    Raises:
        ModelFileError: naming the file, the tensor, and the expected vs found shape.
    """
    expected = expected_tensor_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelFileError(f"{source}: tensor {name!r} is missing (expected shape {list(shape)})")
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ModelFileError(
                f"{source}: tensor {name!r} has shape {list(found)}, expected {list(shape)} from the model config"
            )
    unused = sorted(set(tensors) - set(expected))
    if unused:
        logger.info("%s: ignoring %d tensors kvscope does not use: %s", source, len(unused), ", ".join(unused[:5]))
    return {name: tensors[name] for name in expected}


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _read_gguf_checkpoint(path: Path) -> Checkpoint:
    contents = read_gguf(path)
    tokenizer = tokenizer_from_gguf_metadata(contents.metadata, source=path)
    return Checkpoint(
        config=contents.config,
        tensors=check_tensors(contents.tensors, contents.config, path),
        tokenizer=tokenizer,
        source=str(path),
        file_format="gguf",
        tensor_types=contents.tensor_types,
        metadata=contents.metadata,
    )


def _read_hf_checkpoint(folder: Path) -> Checkpoint:
    contents = read_hf_folder(folder)
    c = contents.config
    tokenizer = Tokenizer.from_file(
        contents.tokenizer_path,
        bos_id=c.bos_token_id,
        eos_ids=c.eos_token_ids,
        add_bos=c.add_bos and c.bos_token_id is not None,
    )
    tensors = dict(contents.tensors)
    if c.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # a tied head is the embedding, whatever the file holds
    return Checkpoint(
        config=c,
        tensors=check_tensors(tensors, c, folder),
        tokenizer=tokenizer,
        source=str(folder),
        file_format="hf",
        tensor_types=contents.tensor_types,
        metadata=contents.metadata,
    )


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read a model from a GGUF file or a Hugging Face folder (config.json + safetensors + tokenizer.json).

    Args:
        path: a `.gguf` file, a Hugging Face model folder, or that folder's config.json.

    Returns:
        a Checkpoint whose tensors all have the shapes the config implies.

    Raises:
        ModelFileError: the path is missing, a file is corrupt or truncated, or a tensor is missing
            or mis-shaped; the message names the file and the problem.
        UnsupportedArchitectureError: the architecture is not one kvscope runs.
    """
    path, file_format = locate_model(path)
    return _read_hf_checkpoint(path) if file_format == "hf" else _read_gguf_checkpoint(path)


def locate_model(path: str | Path) -> tuple[Path, str]:
    """(the folder or file to read, "hf" or "gguf") for a model path, or a ModelFileError naming it."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder; pass a .gguf file or a Hugging Face model folder")
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return path, "hf"
    if _is_gguf_file(path):
        return path, "gguf"
    raise ModelFileError(
        f"{path}: not a GGUF file (no .gguf suffix, no GGUF magic) and not a folder; "
        "pass a .gguf file or a Hugging Face model folder"
    )
