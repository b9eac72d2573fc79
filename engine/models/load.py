"""One entry point for model files: `read_checkpoint(path)` for a GGUF file or a Hugging Face folder.

The result is the same whatever the format: a ModelConfig, float32 tensors under Hugging Face
names and layouts, and a Tokenizer. Every tensor the config implies is checked for presence and
shape before the transformer sees it, in the terms of the file the user holds: a GGUF is checked by
engine/formats/gguf_file.py under llama.cpp names and ggml shapes (`blk.2.ffn_down.weight`, ne0
first), a Hugging Face folder here under its own names and torch shapes. Errors are ModelFileError
(or its subclass UnsupportedArchitectureError) naming the file and the problem.

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
from engine.models.config import ModelConfig, expected_tensor_shapes
from engine.models.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

logger = logging.getLogger(__name__)

TORCH_ORDER = "(torch order, as safetensors stores it)"  # how a Hugging Face folder's shapes are written


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


def check_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, source: str | Path) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's tensors that `config` needs, checked for presence and shape; others are
    dropped (logged). GGUF files are checked by read_gguf, in llama.cpp's names.

    Raises:
        ModelFileError: naming the folder, the tensor, and the expected vs found torch shape.
    """
    expected = expected_tensor_shapes(config)
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelFileError(
                f"{source}: tensor {name!r} is missing; config.json needs it with shape {list(shape)} {TORCH_ORDER}"
            )
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ModelFileError(
                f"{source}: tensor {name!r} has shape {list(found)} but config.json needs {list(shape)} {TORCH_ORDER}"
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


def _read_gguf_checkpoint(path: Path, keep_quantized: bool) -> Checkpoint:
    contents = read_gguf(path, keep_quantized=keep_quantized)  # checks the tensors itself, so that errors use the file's names
    tokenizer = tokenizer_from_gguf_metadata(contents.metadata, source=path)
    return Checkpoint(
        config=contents.config,
        tensors=contents.tensors,
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


def read_checkpoint(path: str | Path, *, keep_quantized: bool = False) -> Checkpoint:
    """Read a model from a GGUF file or a Hugging Face folder (config.json + safetensors + tokenizer.json).

    Args:
        path: a `.gguf` file, a Hugging Face model folder, or that folder's config.json.
        keep_quantized: a GGUF's Q8_0, Q4_0, Q4_K and Q6_K matrices stay QuantizedBlocks.

    Returns:
        a Checkpoint whose tensors all have the shapes the config implies.

    Raises:
        ModelFileError: the path is missing, a file is corrupt or truncated, or a tensor is missing
            or mis-shaped; the message names the file and the problem.
        UnsupportedArchitectureError: the architecture is not one kvscope runs.
    """
    path, file_format = locate_model(path)
    return _read_hf_checkpoint(path) if file_format == "hf" else _read_gguf_checkpoint(path, keep_quantized)


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
