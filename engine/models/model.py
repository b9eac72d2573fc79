"""A loaded model: config, tokenizer and the transformer in its compute dtype."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import ContextParamsError, ModelFileError
from engine.formats.quantized_blocks import PACKED_TENSOR_TYPES
from engine.models.config import ModelConfig
from engine.models.tokenizer import Tokenizer
from engine.models.transformer import Transformer

log = logging.getLogger("kvscope.model")

COMPUTE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# The bundled demo model (engine/models/demo/MODEL_CARD.md), loaded by the name "demo".
DEMO_MODEL_NAME = "demo"
DEMO_MODEL_PATH = Path(__file__).resolve().parent / "demo" / "kvscope-demo-gemma3.gguf"


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of a compute dtype name (f32, bf16, f16), or a ContextParamsError."""
    if name not in COMPUTE_DTYPES:
        raise ContextParamsError(f"unknown compute dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


def resolve_model_path(path: str | Path) -> str | Path:
    """The name "demo" is the bundled demo model's file; any other path is returned as given."""
    if str(path) != DEMO_MODEL_NAME:
        return path
    if not DEMO_MODEL_PATH.is_file():
        raise ModelFileError(
            f"the bundled demo model is missing: {DEMO_MODEL_PATH} does not exist; reinstall kvscope, or "
            "rebuild it with `python tools/train_demo_model.py` (see engine/models/demo/MODEL_CARD.md)")
    return DEMO_MODEL_PATH


@dataclass
class Model:
    config: ModelConfig
    tokenizer: Tokenizer
    transformer: Transformer
    path: str
    file_format: str
    tensor_types: dict[str, str]
    kept_quantized: bool = False  # quantized GGUF matrices kept packed (load_model's keep_quantized)

    @property
    def name(self) -> str:
        return self.config.name or Path(self.path).name

    _pieces: tuple[str, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def token_pieces(self) -> tuple[str, ...]:
        """The text of every token id, each decoded alone (special tokens as written), computed once;
        empty for a model without a tokenizer (the in-memory test models)."""
        if self._pieces is None:
            tok = self.tokenizer
            self._pieces = () if tok is None else tuple(_piece(tok, i) for i in range(self.n_vocab))
        return self._pieces


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text; a token that is part of a UTF-8 character (a byte token) shows as its vocabulary
    entry instead of a replacement character."""
    text = tokenizer.decode([token_id])
    return tokenizer.token_text(token_id) if "\ufffd" in text else text


def load_model(path: str | Path, *, dtype: str = "f32", keep_quantized: bool = True) -> Model:
    """Load a GGUF file or a Hugging Face folder; "demo" loads the bundled demo model. dtype: compute
    dtype, f32 (default), bf16 or f16. keep_quantized: a GGUF's Q8_0, Q4_0, Q4_K and Q6_K matrices stay
    packed and run on torch's weight-only int8/int4 kernels (engine/models/packed.py); False decodes
    them to the compute dtype (exactly the file's values, at 4-8x the memory)."""
    from engine.models.load import read_checkpoint

    torch_dtype = compute_dtype(dtype)
    path = resolve_model_path(path)
    ckpt = read_checkpoint(path, keep_quantized=keep_quantized)
    transformer = Transformer(ckpt.config, ckpt.tensors, torch_dtype)
    log.info("load_tensors: loaded %s (%s, %d layers, %.2f M parameters, compute %s)", ckpt.config.name or path,
             ckpt.config.arch, ckpt.config.n_layer, transformer.n_params() / 1e6, dtype)
    kept = keep_quantized and any(t in PACKED_TENSOR_TYPES for t in ckpt.tensor_types.values())
    return Model(ckpt.config, ckpt.tokenizer, transformer, str(path), ckpt.file_format, dict(ckpt.tensor_types), kept)


def file_types_by_gguf_name(model: Model) -> dict[str, str] | None:
    """llama.cpp tensor name -> GGUF storage type of a model whose quantized matrices are packed (what
    weight_tensor_sizes sizes them by); None when nothing is packed."""
    from engine.formats.gguf_file import gguf_tensor_name

    if not model.kept_quantized:
        return None
    return {gguf_tensor_name(name, model.config.arch): t for name, t in model.tensor_types.items()}
