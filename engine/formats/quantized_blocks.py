"""A quantized GGUF matrix as the file stores it: one row of ggml blocks per output row.

read_gguf(keep_quantized=True) hands these to the Transformer instead of float32 copies, which
packs them for torch's weight-only kernels (engine/models/packed.py). Row operations (llama.cpp's
Q/K permutation, RoPE's row order) work on whole rows of blocks, so they never decode a value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# GGUF storage types kept packed; others are dequantized at load (F16, BF16 to the compute dtype).
PACKED_TENSOR_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")


@dataclass(frozen=True)
class QuantizedBlocks:
    """blocks: uint8 [rows, row_bytes] (a view of the file's memory map until rows are reordered);
    type_name: the ggml type ("Q4_K", ...); shape: (rows, cols) in torch order (cols = values per row)."""

    blocks: np.ndarray
    type_name: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def with_row_order(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedBlocks:
        """The rows in the order `reorder` (a function of a [rows, ...] tensor, like unpermute_qk or
        to_norm_order) would put a float matrix's rows: found by reordering row indices."""
        order = reorder(torch.arange(self.shape[0])[:, None])[:, 0].numpy()
        return QuantizedBlocks(np.ascontiguousarray(self.blocks[order]), self.type_name, self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]."""
        import gguf

        values = gguf.quants.dequantize(self.blocks, gguf.GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.shape))


def reorder_rows(t: torch.Tensor | QuantizedBlocks, reorder: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor | QuantizedBlocks:
    """reorder(t) for a float matrix; the same row order for blocks, moved whole (nothing decoded)."""
    return t.with_row_order(reorder) if isinstance(t, QuantizedBlocks) else reorder(t)
