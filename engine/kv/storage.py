"""K or V rows of one cache layer, preallocated: n_stream x kv_size rows of `width` values.

Rows are stored in the cache type's own layout: plain torch dtypes for f32/f16/bf16, and the
ggml block bytes for quantized types (see engine/kv/quant.py). Transposed V (flash attention off)
keeps each stream as [width, kv_size], as llama.cpp does; only float types can be transposed.
Callers see float rows and never the storage layout.
"""
from __future__ import annotations

import torch

from engine.kv.types import CacheType


class RowStorage:
    def __init__(self, ctype: CacheType, *, n_stream: int, kv_size: int, width: int, transposed: bool = False,
                 device: torch.device | str = "cpu") -> None:
        assert not (transposed and ctype.is_quantized), "quantized rows cannot be stored transposed"
        self.ctype = ctype
        self.n_stream, self.kv_size, self.width = n_stream, kv_size, width
        self.transposed = transposed
        self.row_bytes = ctype.row_bytes(width)
        if ctype.is_quantized:
            shape = (n_stream, kv_size, self.row_bytes)
            self.data = torch.zeros(shape, dtype=torch.uint8, device=device)
        else:
            shape = (n_stream, width, kv_size) if transposed else (n_stream, kv_size, width)
            self.data = torch.zeros(shape, dtype=ctype.torch_dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, streams: torch.Tensor, cells: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [N, width] (any float dtype) at (streams[i], cells[i])."""
        if streams.device != self.device:
            streams, cells = streams.to(self.device), cells.to(self.device)
        rows = rows.to(self.device)
        if self.ctype.is_quantized:
            self.data[streams, cells] = self.ctype.quantize(rows.float())
        elif self.transposed:
            self.data[streams, :, cells] = rows.to(self.data.dtype)
        else:
            self.data[streams, cells] = rows.to(self.data.dtype)

    def read(self, streams: slice | torch.Tensor, n_kv: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n_kv rows of the selected streams as [n_streams, n_kv, width] in dtype."""
        if self.ctype.is_quantized:
            blocks = self.data[streams, :n_kv]
            return self.ctype.dequantize(blocks).to(dtype)
        if self.transposed:
            return self.data[streams, :, :n_kv].transpose(-1, -2).to(dtype)
        return self.data[streams, :n_kv].to(dtype)

    def read_cells(self, stream: int, cells: torch.Tensor) -> torch.Tensor:
        """Rows of some cells of one stream as float32 [N, width]."""
        if self.ctype.is_quantized:
            return self.ctype.dequantize(self.data[stream, cells]).float()
        if self.transposed:
            return self.data[stream, :, cells].T.float()
        return self.data[stream, cells].float()

    def copy_stream(self, src: int, dst: int) -> None:
        self.data[dst].copy_(self.data[src])

    def zero_(self) -> None:
        self.data.zero_()
