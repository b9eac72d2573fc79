"""K or V rows of one cache layer, preallocated: n_stream x kv_size rows of `width` values.

Rows are stored in the cache type's own layout: float types (f32/f16/bf16) as torch dtypes, quantized
types as the ggml block bytes (see engine/kv/quant.py). Transposed V (flash attention off) keeps each
stream as [width, kv_size], as llama.cpp does; only float types can be transposed. Callers see rows
([cells, width]) and never the storage layout.

Rows that are not transposed are stored head-major, [stream, head, cell, head_dim]: one head's K (or V)
for every cell is contiguous, so that decode attention reads n_kv cells of a head as one block rather
than n_kv pieces of head_dim values strided by the row width (at 8k cells and beyond the strided reads
cost the attention kernel ~1.5x). A row is `n_head` such pieces; writing one ubatch's rows scatters
them, which is cheap next to reading the whole cache every layer and token. Quantized rows too, as
[stream, head, cell, a head's block bytes], when a head holds whole blocks (head_dim a multiple of 32,
as in every common model): they decode into head-major float rows without a transpose, and attention
then reads them contiguously (~1.6x faster at 8k cells than the rows viewed by head). llama.cpp keeps a
row contiguous ([cells, width] or [cells, row_bytes] per stream); its state files are written in that
order (`stored_rows`), so nothing outside this class sees the difference.
"""
from __future__ import annotations

import torch

from engine.kv.types import CacheType

DEQUANT_CELLS = 2048  # cells of quantized rows decoded at once for attention


class Scratch:
    """Memory reused for converted K or V rows: one growing buffer per torch device and dtype. What
    take() returns is valid until the next take() of the same buffer (the next layer's read). It grows
    by half again when too small (a decode reads one more cell each step: growing by what is needed
    would reallocate every step), up to `limit` elements: the storage's own, which the compute buffer
    bound counts in the compute dtype (engine/sizing/compute_memory.py)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, limit: int) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(max(n, min(n + n // 2, limit)), dtype=dtype, device=device)
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class RowStorage:
    def __init__(self, ctype: CacheType, *, n_stream: int, kv_size: int, width: int, transposed: bool = False,
                 n_head: int = 1, device: torch.device | str = "cpu") -> None:
        assert not (transposed and ctype.is_quantized), "quantized rows cannot be stored transposed"
        assert width % n_head == 0, f"a row of {width} values does not split into {n_head} heads"
        self.ctype = ctype
        self.n_stream, self.kv_size, self.width = n_stream, kv_size, width
        self.transposed = transposed
        self.row_bytes = ctype.row_bytes(width)
        self.n_head = n_head
        self.head_dim = width // n_head
        self.head_major = not transposed and self.head_dim % ctype.block_size == 0
        # a row and a head's part of it as stored: values, or block bytes for quantized types
        self.row_elements = self.row_bytes if ctype.is_quantized else width
        self.head_elements = self.row_elements // n_head
        if ctype.is_quantized and not self.head_major:  # a block spans two heads: whole rows
            self.data = torch.zeros((n_stream, kv_size, self.row_bytes), dtype=torch.uint8, device=device)
        elif ctype.is_quantized:
            self.data = torch.zeros((n_stream, n_head, kv_size, self.head_elements), dtype=torch.uint8, device=device)
        elif transposed:
            self.data = torch.zeros((n_stream, width, kv_size), dtype=ctype.torch_dtype, device=device)
        else:
            self.data = torch.zeros((n_stream, n_head, kv_size, self.head_dim), dtype=ctype.torch_dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        """The stored element type (uint8 for quantized blocks)."""
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, streams: torch.Tensor | int, cells: torch.Tensor | slice, rows: torch.Tensor) -> None:
        """Store rows [N, width] (any float dtype) at (streams[i], cells[i]); or, with `streams` one stream
        and `cells` a slice, at that run of cells: plain slicing then, no index kernels (a decode step
        writes two rows per layer, usually to consecutive cells of one stream)."""
        run = isinstance(cells, slice)
        # .to() only where something changes: a no-op .to() still costs a dispatch
        if not run and streams.device != self.device:
            streams, cells = streams.to(self.device), cells.to(self.device)
        if rows.device != self.device:
            rows = rows.to(self.device)
        if self.ctype.is_quantized:
            rows = self.ctype.quantize(rows.float())
        elif rows.dtype != self.data.dtype:
            rows = rows.to(self.data.dtype)
        if self.transposed:  # [width, N] per stream; index tensors put the token axis first
            self.data[streams, :, cells] = rows.t() if run else rows
        elif not self.head_major:
            self.data[streams, cells] = rows
        elif run:  # [n_head, N, head_elements] per stream
            self.data[streams, :, cells] = rows.view(-1, self.n_head, self.head_elements).transpose(0, 1)
        else:
            self.data[streams, :, cells] = rows.view(-1, self.n_head, self.head_elements)

    def read_heads(self, streams: slice | torch.Tensor, n_kv: int, dtype: torch.dtype,
                   scratch: Scratch | None = None) -> torch.Tensor:
        """The first n_kv cells of the selected streams as [n_streams, n_head, n_kv, head_dim] in dtype:
        for float rows in dtype a view of the storage (no copy); rows of another type converted or
        decoded into `scratch` when given (reused memory: a fresh 64 MiB f32 copy per layer at 32k cells
        costs more in page faults than the attention itself)."""
        if self.ctype.is_quantized:
            values = self._decoded(streams, n_kv, dtype, scratch)
            if self.head_major:
                return values
            return values.view(values.shape[0], n_kv, self.n_head, self.head_dim).transpose(1, 2)
        heads = self.data[streams, :, :n_kv]
        if self.transposed:  # [n_streams, width, n_kv] -> a view by head
            heads = heads.view(heads.shape[0], self.n_head, self.head_dim, n_kv).transpose(-1, -2)
        if heads.dtype == dtype:
            return heads
        if scratch is None:
            return heads.to(dtype)
        return scratch.take(heads.shape, dtype, heads.device, self.data.numel()).copy_(heads)

    def _decoded(self, streams: slice | torch.Tensor, n_kv: int, dtype: torch.dtype,
                 scratch: Scratch | None = None) -> torch.Tensor:
        """The first n_kv cells of quantized rows decoded, in the storage's layout: [n_streams, n_head, n_kv,
        head_dim] head-major, else [n_streams, n_kv, width]. Into scratch when given, DEQUANT_CELLS cells at a
        time: the decoder's temporaries stay a few MiB (reused by the allocator) instead of several copies of
        the whole read, each mapped fresh (a q8_0 cache at 32k cells: 843 ms per token that way); q8_0 and
        q4_0 blocks decode straight into place."""
        # cells on axis -2 in either layout, a head's or a row's block bytes on the last
        blocks = self.data[streams, :, :n_kv] if self.head_major else self.data[streams, :n_kv]
        if scratch is None:
            return self.ctype.dequantize(blocks).to(dtype)
        n_values = self.head_dim if self.head_major else self.width
        out = scratch.take((*blocks.shape[:-1], n_values), dtype, self.device, self.n_stream * self.kv_size * self.width)
        into = self.ctype.dequantize_into if dtype == torch.float32 else None
        n_blocks = n_values // self.ctype.block_size
        for start in range(0, n_kv, DEQUANT_CELLS):
            cells = slice(start, min(start + DEQUANT_CELLS, n_kv))
            if into is None:
                out[..., cells, :] = self.ctype.dequantize(blocks[..., cells, :])
            else:
                into(blocks[..., cells, :].unflatten(-1, (n_blocks, self.ctype.block_bytes)),
                     out[..., cells, :].unflatten(-1, (n_blocks, self.ctype.block_size)))
        return out

    def read(self, streams: slice | torch.Tensor, n_kv: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n_kv rows of the selected streams as [n_streams, n_kv, width] in dtype."""
        if self.ctype.is_quantized:
            values = self._decoded(streams, n_kv, dtype)
            if not self.head_major:
                return values
            return values.transpose(1, 2).reshape(values.shape[0], n_kv, self.width)
        if self.transposed:
            return self.data[streams, :, :n_kv].transpose(-1, -2).to(dtype)
        heads = self.data[streams, :, :n_kv]  # [n_streams, n_head, n_kv, head_dim]
        return heads.transpose(1, 2).reshape(heads.shape[0], n_kv, self.width).to(dtype)

    def read_cells(self, stream: int, cells: torch.Tensor) -> torch.Tensor:
        """Rows of some cells of one stream as float32 [N, width]."""
        if self.ctype.is_quantized:
            return self.ctype.dequantize(self.stored_rows(stream, cells)).float()
        if self.transposed:
            return self.data[stream, :, cells].T.float()
        return self.stored_rows(stream, cells).float()

    def stored_rows(self, stream: int, cells: torch.Tensor) -> torch.Tensor:
        """Rows of some cells of one stream as stored, in llama.cpp's row order: [N, width] values, or
        [N, row_bytes] block bytes for quantized types (not for transposed V)."""
        assert not self.transposed, "transposed V is read by columns"
        if self.head_major:
            return self.data[stream][:, cells].transpose(0, 1).reshape(len(cells), self.row_elements)
        return self.data[stream][cells]

    def store_rows(self, stream: int, cells: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows as `stored_rows` returns them (the storage's element type), at cells of one stream."""
        assert not self.transposed, "transposed V is written by columns"
        if self.head_major:
            self.data[stream][:, cells] = rows.view(len(cells), self.n_head, self.head_elements).transpose(0, 1)
        else:
            self.data[stream][cells] = rows

    def copy_stream(self, src: int, dst: int) -> None:
        self.data[dst].copy_(self.data[src])

    def zero_(self) -> None:
        self.data.zero_()
