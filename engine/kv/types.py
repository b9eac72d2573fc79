"""K/V cache storage types: names, block sizes and row sizes exactly as ggml counts them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.errors import ContextParamsError
from engine.kv import quant


@dataclass(frozen=True)
class CacheType:
    name: str
    block_size: int  # values per block
    block_bytes: int  # bytes per block
    torch_dtype: torch.dtype | None  # storage dtype when the type maps onto a torch dtype
    # Quantized types: float rows [..., n] <-> block bytes [..., n / block_size * block_bytes] (uint8).
    quantize: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    dequantize: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    # blocks [..., block_bytes] -> into a float32 view [..., block_size], for the types that have such a decoder
    dequantize_into: Callable[[torch.Tensor, torch.Tensor], None] | None = field(default=None, compare=False,
                                                                                  repr=False)

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, n_values: int) -> int:
        """Bytes of one row of n_values values (ggml_row_size)."""
        if n_values % self.block_size:
            raise ContextParamsError(
                f"a row of {n_values} values is not a whole number of {self.name} blocks of {self.block_size}"
            )
        return n_values // self.block_size * self.block_bytes


CACHE_TYPES: dict[str, CacheType] = {
    "f32": CacheType("f32", 1, 4, torch.float32),
    "f16": CacheType("f16", 1, 2, torch.float16),
    "bf16": CacheType("bf16", 1, 2, torch.bfloat16),
}
# ggml's quantized types that llama.cpp accepts for the KV cache (-ctk/-ctv), in its order.
for _name in ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"):
    _q, _dq = quant.QUANTIZERS[_name]
    CACHE_TYPES[_name] = CacheType(_name, quant.QK, quant.BLOCK_BYTES[_name], None, quantize=_q, dequantize=_dq,
                                   dequantize_into=quant.DEQUANTIZERS_INTO.get(_name))
del _name, _q, _dq


def cache_type(name: str) -> CacheType:
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise ContextParamsError(
            f"unsupported KV cache type {name!r}; choose one of {', '.join(CACHE_TYPES)}"
        ) from None
