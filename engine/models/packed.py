"""Quantized GGUF weights kept packed in memory and multiplied with PyTorch's weight-only kernels.

A Q8_0 / Q4_0 / Q4_K / Q6_K weight [N out, K in] is decoded once from its GGUF block bytes into the
operand format of one of torch's weight-only matmul kernels, never into a float32 matrix:

    kind   GGUF types    torch kernel (torch 2.13)                                  resident bits/weight
    int4   Q4_0, Q4_K    CPU:  _weight_int4pack_mm_for_cpu(x, w, 32, scales_zeros)  4 + 16*2/32 = 5
                         CUDA: _weight_int4pack_mm(x, w, 32, scales_zeros)          (file: 4.5)
    int8   Q8_0, Q6_K    _weight_int8pack_mm(x, w, scales)                           8 + 16/K     (file: 8.5, 6.5625)

Kernel conventions, checked by experiment on torch 2.13 (CPU build, AVX512):
  * int4: w_kernel = _convert_weight_to_int4pack_for_cpu(q int32 [N, K] values 0..15, inner_k_tiles) ->
    uint8 [N, K/2] in a CPU-specific nibble order (inner_k_tiles is ignored on CPU: 1, 2, 4 and 8 give
    the same bytes); N must be a multiple of 16 (padded here with zero rows, still packed; outputs
    sliced), K a multiple of the group size. scales_zeros is [K/32, N, 2] (scale, zero) in the
    activation's dtype and the weight is (q - 8) * scale + zero. Group sizes 32/64/128/256; ggml's
    sub-blocks are 32 wide, so 32 here. The output has the activation's dtype. f32 activations are
    12-40x slower than bf16 on this CPU, so activations go in as bf16 and results are cast back; the
    scale and zero are therefore stored as bf16 (rounded, relative 2^-9: the only change to the weights).
  * int8: one float scale per output row ([N], same dtype as x, no group-wise form), weight int8
    [N, K]; w = q * scale[n]. K must be a multiple of 16 on CPU (K = 40 gives wrong results, K = 8
    crashes); GGUF rows are multiples of 32. torch 2.13 has no group-wise int8 weight-only kernel on CPU
    (aten ops with int8/int4/pack in their names: _weight_int8pack_mm (per row), _int_mm (int8 x int8,
    activations would need quantizing), fbgemm_linear_int8_weight* (per row, legacy),
    _dyn_quant_matmul_4bit (4-bit with dynamically quantized activations)). So Q8_0's 32-wide and
    Q6_K's 16-wide group scales are folded into the values and each row is re-quantized to int8 with
    scale_row = max|w_row| / 127 rounded up to bf16 (so the kernel's bf16 scale is exact) and
    q = round(w / scale_row): lossy, about 0.8% relative (Frobenius) for normal weights, see
    tests/test_packed_weights.py.

Measured on the 2-core development CPU (2 threads, one vector, best of 15 interleaved rounds on a busy
machine): 8192x768 f32 F.linear 1.7 ms (0.54 ms when the machine was quiet), packed 0.20-0.25 ms for
each of the four types; 2048x768 F.linear 0.14 ms, packed 0.06 ms. For many rows at once (prompt
processing, M = 64..512) the packed kernels are about as fast as f32 or up to 1.6x slower.

Decoders (`decode_q4_0`, `decode_q4_k`, `decode_q8_0`, `decode_q6_k`) turn raw block bytes (uint8
[rows, row_bytes], as `gguf.GGUFReader` tensors hold them) into integer values and per-group float32
scales, vectorized over all rows and blocks; `dequantize_blocks` computes float32 values with the same
float32 operations as `gguf.quants.dequantize` (bit-identical).

Moving an int4 weight between devices needs its 4-bit values back from the kernel form. Nothing else is
kept for that (no unpacked or f32 copy): on CPU they are read back by inverting torch's nibble order,
which is learnt by packing probe matrices (see `_cpu_int4_source_index`) and checked by packing the
result again; on CUDA by multiplying the identity with scale 1 and zero 8 (`_int4_values_via_kernel`).

Example:
    w = PackedWeight.from_gguf_blocks(reader_tensor.data, "Q4_K", n_out=2048, n_in=768)
    y = w.matmul(x)            # x [M, 768] float32 -> [M, 2048] float32
    qkv = PackedWeight.from_gguf_parts([(q.data, "Q4_K", 768), (k.data, "Q4_K", 256), (v.data, "Q6_K", 256)],
                                       n_in=768)
    emb = PackedRows.from_gguf_blocks(tok_embd.data, "Q6_K", n_rows=32000, n_in=768)
    emb.rows(torch.tensor([1, 5, 9]))  # float32 [3, 768]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np
import torch

from engine.errors import KvscopeError
from engine.models.host_memory import advise_huge_pages

# type name -> (values per block, bytes per block): ggml-common.h block_q8_0, block_q4_0, block_q4_K, block_q6_K
BLOCK_LAYOUTS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210)}
INT4_TYPES = ("Q4_0", "Q4_K")  # -> q uint8 0..15, w = (q - 8) * scale + zero per 32 values
INT8_TYPES = ("Q8_0", "Q6_K")  # -> q int8, w = q * scale per GROUP_SIZES values
GROUP_SIZES = {"Q4_0": 32, "Q4_K": 32, "Q8_0": 32, "Q6_K": 16}
SUPPORTED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K")
# PackedRows also keeps plain float tables as raw bytes: name -> bytes per value
PLAIN_ROW_BYTES = {"F32": 4, "F16": 2, "BF16": 2}

INT4_GROUP = 32  # group size passed to the int4 kernels (one ggml sub-block)
# the CPU kernels' overloads, resolved once (the packet's lookup runs Python on every call)
_int4_mm_cpu = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_int8_mm = torch.ops.aten._weight_int8pack_mm.default
INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0 (CUDA: N % 8)
CPU_INT4_INNER_K_TILES = 2  # ignored by the CPU packer (1, 2, 4, 8 give the same bytes)
# Rows packed per call of the CPU packer: bounds the int32 copy it needs. Must be a multiple of 64:
# torch's CPU packer works on independent blocks of BLOCK_N = 64 (AVX512) or 32 (AVX2, scalar) rows,
# written contiguously (int4mm_kernel.cpp weight_to_int4pack_kernel), so chunks pack independently.
PACK_CHUNK_ROWS = 4096
REQUANT_CHUNK_ROWS = 4096  # rows decoded to float32 at a time when re-quantizing to int8

TypeName = Union[str, Any]  # "Q4_K" or a gguf.GGMLQuantizationType
Blocks = Union[np.ndarray, torch.Tensor]


class PackedFormatError(KvscopeError, ValueError):
    """Block bytes, a type or a shape that a packed weight cannot be built from."""


# ---------------------------------------------------------------------------------------------------
# Decoders: raw GGUF block bytes -> integer values and float32 group scales (vectorized, no loops)
# ---------------------------------------------------------------------------------------------------


def type_name_of(ggml_type: TypeName) -> str:
    """'Q4_K' for 'Q4_K', 'q4_k' or gguf.GGMLQuantizationType.Q4_K."""
    name = getattr(ggml_type, "name", ggml_type)
    if not isinstance(name, str):
        raise PackedFormatError(f"a GGUF type name is a str like 'Q4_K' (got {ggml_type!r})")
    return name.upper()


def row_bytes(ggml_type: TypeName, n_in: int) -> int:
    """Bytes of one row of `n_in` values stored as `ggml_type` (one of BLOCK_LAYOUTS)."""
    name = _check_type(ggml_type, SUPPORTED_TYPES, "pack")
    block_values, block_bytes = BLOCK_LAYOUTS[name]
    if n_in <= 0 or n_in % block_values:
        raise PackedFormatError(f"{name} rows hold a multiple of {block_values} values; got a row length of {n_in}")
    return n_in // block_values * block_bytes


def _check_type(ggml_type: TypeName, allowed: Sequence[str], what: str) -> str:
    name = type_name_of(ggml_type)
    if name not in allowed:
        raise PackedFormatError(f"cannot {what} GGUF type {name}; supported: {', '.join(allowed)}")
    return name


def _as_block_array(blocks: Blocks, name: str, n_in: int, n_out: int | None = None) -> np.ndarray:
    """`blocks` as uint8 numpy [n_out, row_bytes], checked; a view when possible (no copy)."""
    if isinstance(blocks, torch.Tensor):
        blocks = blocks.detach().cpu().numpy()
    blocks = np.asarray(blocks)
    expected_row = row_bytes(name, n_in)
    rows = blocks.shape[0] if (n_out is None and blocks.ndim == 2) else n_out
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape != (rows, expected_row):
        raise PackedFormatError(
            f"{name} blocks for {rows if rows is not None else '?'} rows of {n_in} values must be uint8 "
            f"[{rows if rows is not None else 'rows'}, {expected_row}] (raw block bytes, as gguf.GGUFReader "
            f"holds them); got {blocks.dtype} {list(blocks.shape)}"
        )
    return blocks


def _split_blocks(blocks: np.ndarray, name: str) -> np.ndarray:
    """[rows, row_bytes] -> [rows, blocks per row, block bytes] (a view)."""
    block_bytes = BLOCK_LAYOUTS[name][1]
    return blocks.reshape(blocks.shape[0], blocks.shape[1] // block_bytes, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian f16 bytes -> float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_q4_K: d f16, dmin f16, scales[12] (8 6-bit scales and 8 6-bit mins), qs[128].
    Returns q uint8 [N, K], step = d * sc and offset = dmin * m, float32 [N, K/32]: w = step*q - offset."""
    b = _split_blocks(blocks, "Q4_K")
    n, nb = b.shape[:2]
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16].reshape(n, nb, 3, 4)
    # bytes 0-3: low 6 bits = scales 0-3, top 2 bits = high bits of scales 4-7; bytes 4-7 the same for
    # the mins; bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = of mins 4-7
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 2) & 48)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], axis=-1)
    # qs: 4 runs of 32 bytes; run j holds sub-block 2j in its low nibbles and 2j+1 in its high nibbles
    qs = b[..., 16:].reshape(n, nb, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(n, nb * 256)
    step = (d[..., None] * sc.astype(np.float32)).reshape(n, nb * 8)
    offset = (dmin[..., None] * mn.astype(np.float32)).reshape(n, nb * 8)
    return q, step, offset


def decode_q4_0(blocks: Blocks, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_q4_0 (d f16, qs[16]: value j low nibble, j+16 high nibble), w = d * (q - 8).
    Returns q uint8 [N, K] (0..15), scale = d and zero = 0, float32 [N, K/32]: w = (q - 8)*scale + zero."""
    b = _split_blocks(_as_block_array(blocks, "Q4_0", n_in), "Q4_0")
    d = _f16(b[..., 0:2])
    qs = b[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(b.shape[0], b.shape[1] * 32)
    return q, d, np.zeros_like(d)


def decode_q4_k(blocks: Blocks, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """block_q4_K, w = d*sc*q - dmin*m per 32-wide sub-block. Returns q uint8 [N, K] (0..15), scale = d*sc
    and zero = 8*scale - dmin*m, float32 [N, K/32], so that w = (q - 8)*scale + zero (equal to gguf's
    d*sc*q - dmin*m up to float32 rounding of the rearranged sum: a few ulps of 8*scale)."""
    q, step, offset = _q4_k_fields(_as_block_array(blocks, "Q4_K", n_in))
    return q, step, np.float32(8) * step - offset


def decode_q8_0(blocks: Blocks, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """block_q8_0 (d f16, qs[32] int8). Returns q int8 [N, K] and scale = d float32 [N, K/32]: w = q*scale."""
    b = _split_blocks(_as_block_array(blocks, "Q8_0", n_in), "Q8_0")
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(b.shape[0], b.shape[1] * 32)
    return q, d


def decode_q6_k(blocks: Blocks, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """block_q6_K (ql[128] low 4 bits, qh[64] high 2 bits, scales[16] int8, d f16), w = d*sc*(q6 - 32)
    per 16 values. Returns q int8 [N, K] (-32..31) and scale = d*sc float32 [N, K/16]: w = q*scale."""
    b = _split_blocks(_as_block_array(blocks, "Q6_K", n_in), "Q6_K")
    n, nb = b.shape[:2]
    # each half of 128 values: ql bytes 0-31 -> values 0-31 (low nibble) and 64-95 (high), bytes 32-63
    # -> values 32-63 and 96-127; qh byte l -> bits 4-5 of values l, l+32, l+64, l+96 (shifts 0, 2, 4, 6)
    ql = b[..., :128].reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    q6 = (ql & 15).reshape(n, nb, 8, 32) | ((qh & 3).reshape(n, nb, 8, 32) << 4)
    q = (q6.astype(np.int8) - np.int8(32)).reshape(n, nb * 256)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    return q, (d[..., None] * sc).reshape(n, nb * 16)


def dequantize_blocks(blocks: Blocks, ggml_type: TypeName, n_in: int) -> np.ndarray:
    """float32 [N, K] values of raw blocks, computed with the same float32 operations as
    gguf.quants.dequantize (bit-identical results)."""
    name = _check_type(ggml_type, SUPPORTED_TYPES, "dequantize")
    blocks = _as_block_array(blocks, name, n_in)
    n = blocks.shape[0]
    if name == "Q4_0":
        q, d, _ = decode_q4_0(blocks, n_in)
        v = (q.astype(np.int8) - np.int8(8)).astype(np.float32).reshape(n, n_in // 32, 32)
        return (d[..., None] * v).reshape(n, n_in)
    if name == "Q4_K":
        q, step, offset = _q4_k_fields(blocks)
        v = q.astype(np.float32).reshape(n, n_in // 32, 32)
        return (step[..., None] * v - offset[..., None]).reshape(n, n_in)
    q, scale = decode_q8_0(blocks, n_in) if name == "Q8_0" else decode_q6_k(blocks, n_in)
    gs = GROUP_SIZES[name]
    return (q.astype(np.float32).reshape(n, n_in // gs, gs) * scale[..., None]).reshape(n, n_in)


def _decode_int4(blocks: np.ndarray, name: str, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return decode_q4_0(blocks, n_in) if name == "Q4_0" else decode_q4_k(blocks, n_in)


# ---------------------------------------------------------------------------------------------------
# int4: torch's tinygemm-style layouts
# ---------------------------------------------------------------------------------------------------


def _pack_int4_cpu(q: np.ndarray) -> torch.Tensor:
    """uint8 [N, K] values 0..15 (N % 16 == 0) -> the CPU kernel's uint8 [N, K/2], packed in row chunks."""
    n, k = q.shape
    out = torch.empty((n, k // 2), dtype=torch.uint8)
    for r0 in range(0, n, PACK_CHUNK_ROWS):
        chunk = torch.from_numpy(q[r0:r0 + PACK_CHUNK_ROWS].astype(np.int32))
        out[r0:r0 + PACK_CHUNK_ROWS] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, CPU_INT4_INNER_K_TILES)
    return out


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., B] -> uint8 [..., 2B]: nibble position 2*byte (low nibble), 2*byte + 1 (high)."""
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _cpu_int4_source_index(rows: int, k: int) -> np.ndarray:
    """For the CPU packer's output of a [rows, k] matrix: at each nibble position (see _nibbles), the flat
    index r*k + c of the value stored there. Learnt by packing probe matrices whose values are the
    successive hex digits of each element's own flat index (ceil(log16(rows*k)) packs of rows x k), so
    it holds whatever nibble order this machine's CPU capability (AVX512, AVX2, scalar) uses."""
    total = rows * k
    flat = np.arange(total, dtype=np.int64)
    source = np.zeros(total, dtype=np.int64)
    for digit in range(max(1, math.ceil((total - 1).bit_length() / 4))):
        probe = ((flat >> (4 * digit)) & 15).astype(np.int32).reshape(rows, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(probe), CPU_INT4_INNER_K_TILES)
        source |= _nibbles(packed.numpy().reshape(-1)).astype(np.int64) << (4 * digit)
    if not np.array_equal(np.bincount(source, minlength=total), np.ones(total, dtype=np.int64)):
        raise RuntimeError(f"torch's CPU int4 packing of a {rows}x{k} matrix is not a permutation of nibbles; "
                           "this torch build packs differently from what engine/models/packed.py expects")
    return source


def _unpack_int4_cpu(packed: torch.Tensor, k: int) -> np.ndarray:
    """Inverse of _pack_int4_cpu: uint8 [N, K/2] kernel bytes -> uint8 [N, K] values. Rows go in groups of
    64 (a multiple of every BLOCK_N the packer uses, so each group's bytes are its own, in the same order
    for every full group); the result is packed again and compared, so a wrong inverse cannot pass."""
    p = packed.numpy()
    n = p.shape[0]
    q = np.empty((n, k), dtype=np.uint8)
    full = n // 64 * 64
    for r0, r1 in ((0, full), (full, n)):
        if r1 == r0:
            continue
        rows = min(64, r1 - r0)
        source = _cpu_int4_source_index(rows, k)
        nib = _nibbles(p[r0:r1].reshape((r1 - r0) // rows, rows * k // 2))
        values = np.empty_like(nib)
        values[:, source] = nib
        q[r0:r1] = values.reshape(r1 - r0, k)
    if not torch.equal(_pack_int4_cpu(q), packed):
        raise RuntimeError("reading int4 values back from torch's CPU packing failed its check (packing them "
                           "again gives other bytes); this torch build packs differently than expected")
    return q


def _int4_values_via_kernel(weight: torch.Tensor, n_pad: int, k: int, mm: Any) -> torch.Tensor:
    """uint8 [n_pad, K] values 0..15 read back from any int4 kernel form by multiplying the identity with
    scale 1 and zero 8 ((q - 8)*1 + 8 = q, exact in bf16). Costs K*K*N multiply-adds: for the GPU."""
    device = weight.device
    ones_and_eights = torch.tensor([1.0, 8.0], dtype=torch.bfloat16, device=device).expand(k // INT4_GROUP, n_pad, 2)
    ones_and_eights = ones_and_eights.contiguous()
    q = torch.empty((n_pad, k), dtype=torch.uint8, device=device)
    step = 1024
    for c0 in range(0, k, step):
        c1 = min(k, c0 + step)
        eye = torch.zeros((c1 - c0, k), dtype=torch.bfloat16, device=device)
        eye[torch.arange(c1 - c0, device=device), torch.arange(c0, c1, device=device)] = 1
        q[:, c0:c1] = mm(eye, weight, INT4_GROUP, ones_and_eights).t().round().to(torch.uint8)
    return q


def _cuda_inner_k_tiles(k: int) -> int:
    """_convert_weight_to_int4pack (CUDA) needs K % (inner_k_tiles * 16) == 0, inner_k_tiles in 2, 4, 8."""
    return 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2


@dataclass(frozen=True, eq=False)
class _Int4Part:
    """Rows of a weight in torch's int4 kernel form. w = (q - 8) * scale + zero per 32 inputs.

    weight: CPU uint8 [n_pad, K/2]; CUDA int32 [n_pad/8, K/(tiles*16), 32, tiles/2] (inner_k_tiles = tiles).
    scales_zeros: bf16 [K/32, n_pad, 2], (scale, zero). Rows n..n_pad are padding (q = 8, scale = zero = 0).
    """

    weight: torch.Tensor
    scales_zeros: torch.Tensor
    n: int
    k: int
    inner_k_tiles: int = 0

    kind = "int4"

    @property
    def n_pad(self) -> int:
        return self.scales_zeros.shape[1]

    def __post_init__(self) -> None:
        # read by every matmul: worked out once (properties and device checks cost per call)
        object.__setattr__(self, "on_cpu", self.weight.device.type == "cpu")
        object.__setattr__(self, "unpadded", self.n_pad == self.n)

    @staticmethod
    def build(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, device: torch.device) -> _Int4Part:
        n, k = q.shape
        n_pad = -(-n // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
        if n_pad != n:  # the packer refuses N % 16 != 0: zero rows, sliced off the output
            q = np.concatenate([q, np.full((n_pad - n, k), 8, dtype=np.uint8)])
            scale = np.concatenate([scale, np.zeros((n_pad - n, scale.shape[1]), dtype=np.float32)])
            zero = np.concatenate([zero, np.zeros((n_pad - n, zero.shape[1]), dtype=np.float32)])
        sz = torch.from_numpy(np.stack([scale, zero], axis=-1).transpose(1, 0, 2).copy()).to(torch.bfloat16)
        return _Int4Part.from_values(torch.from_numpy(q), sz, n, device)

    @staticmethod
    def from_values(q: torch.Tensor, scales_zeros: torch.Tensor, n: int, device: torch.device) -> _Int4Part:
        """From uint8 values [n_pad, K] (any device) to the kernel form on `device`."""
        k = q.shape[1]
        if device.type == "cpu":
            packed = advise_huge_pages(_pack_int4_cpu(q.cpu().numpy()))  # streamed once per token: see host_memory
            return _Int4Part(packed, scales_zeros.to(device).contiguous(), n, k)
        if device.type == "cuda":
            # UNTESTED (no GPU where this was written): per aten/src/ATen/native/cuda/int4mm.cu, the CUDA
            # packer takes uint8 [N, K/2] with the even k in the HIGH nibble and needs bf16 activations.
            q = q.to(device)
            nibble_pairs = ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous()
            tiles = _cuda_inner_k_tiles(k)
            weight = torch.ops.aten._convert_weight_to_int4pack(nibble_pairs, tiles)
            return _Int4Part(weight, scales_zeros.to(device).contiguous(), n, k, tiles)
        raise PackedFormatError(f"int4 packed weights run on cpu or cuda, not {device}")

    def values(self) -> torch.Tensor:
        """uint8 [n_pad, K] 4-bit values, on this part's device."""
        if self.weight.device.type == "cpu":
            return torch.from_numpy(_unpack_int4_cpu(self.weight, self.k))
        return _int4_values_via_kernel(self.weight, self.n_pad, self.k, torch.ops.aten._weight_int4pack_mm)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16).contiguous()
        if self.on_cpu:
            y = _int4_mm_cpu(xb, self.weight, INT4_GROUP, self.scales_zeros)
        else:  # UNTESTED: CUDA
            y = torch.ops.aten._weight_int4pack_mm(xb, self.weight, INT4_GROUP, self.scales_zeros)
        return y if self.unpadded else y[:, : self.n]

    def dequantize(self) -> torch.Tensor:
        q = self.values()[: self.n].float()
        sz = self.scales_zeros[:, : self.n].float().to(q.device)  # [K/32, n, 2]
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [n, K/32]
        w = (q.view(self.n, -1, INT4_GROUP) - 8) * scale[..., None] + zero[..., None]
        return w.view(self.n, self.k)

    def to(self, device: torch.device) -> _Int4Part:
        return _Int4Part.from_values(self.values(), self.scales_zeros, self.n, device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight, self.scales_zeros)


# ---------------------------------------------------------------------------------------------------
# int8: one scale per output row
# ---------------------------------------------------------------------------------------------------


def _round_up_to_bf16(x: np.ndarray) -> np.ndarray:
    """Non-negative finite float32 -> the smallest bf16-representable float32 >= x."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)).view(np.float32)


def requantize_rows_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [N, K] -> (q int8 [N, K], scale float32 [N], bf16-exact): scale = max|w_row|/127 rounded up
    to bf16, q = round(w / scale) (|q| <= 127). All-zero rows get scale 0 and q 0."""
    scale = _round_up_to_bf16(np.abs(w).max(axis=1) / np.float32(127))
    ratio = np.divide(w, scale[:, None], out=np.zeros_like(w), where=scale[:, None] > 0)
    q = np.clip(np.rint(ratio), -127, 127).astype(np.int8)
    return q, scale


@dataclass(frozen=True, eq=False)
class _Int8Part:
    """Rows of a weight as int8 [n, K] and one bf16 scale per row: w = q * scale[n]."""

    q: torch.Tensor
    scales: torch.Tensor

    kind = "int8"

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.q.is_cpu:  # CPU: x, scales and the result share one dtype; bf16 is the fast one
            return _int8_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scales)
        # UNTESTED: CUDA's _weight_int8pack_mm (aten/src/ATen/native/cuda/int8mm.cu) computes in float32
        return torch.ops.aten._weight_int8pack_mm(x.float().contiguous(), self.q, self.scales.float())

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scales[ids].float()[:, None]

    def to(self, device: torch.device) -> _Int8Part:
        return _Int8Part(self.q.to(device), self.scales.to(device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.scales)


# ---------------------------------------------------------------------------------------------------
# PackedWeight
# ---------------------------------------------------------------------------------------------------


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _row_order(row_order: Any, n: int) -> np.ndarray | None:
    if row_order is None:
        return None
    order = row_order.detach().cpu().numpy() if isinstance(row_order, torch.Tensor) else np.asarray(row_order)
    if order.shape != (n,) or not np.issubdtype(order.dtype, np.integer):
        raise PackedFormatError(f"row_order must be {n} integer indices (a permutation of the {n} output rows); "
                                f"got {order.dtype} {list(order.shape)}")
    if not np.array_equal(np.sort(order), np.arange(n)):
        raise PackedFormatError(f"row_order must be a permutation of range({n}): every row exactly once")
    return order.astype(np.int64)


class PackedWeight:
    """A weight matrix [N out, K in] from GGUF Q8_0 / Q4_0 / Q4_K / Q6_K blocks, kept in torch's
    weight-only kernel formats (see the module docstring): `matmul(x)` is x @ W.T.

    Built from one tensor (`from_gguf_blocks`) or several stacked along N (`from_gguf_parts`, e.g. Q, K
    and V fused). Rows of int4 types (Q4_0, Q4_K) share one int4 part and rows of int8 types (Q8_0, Q6_K)
    one int8 part; a weight mixing both runs both kernels and concatenates the outputs (and, if a
    row_order interleaves them, puts the columns back in order with one index_select).
    """

    def __init__(self, parts: Sequence[_Int4Part | _Int8Part], ggml_types: Sequence[str], n_in: int,
                 gather: torch.Tensor | None) -> None:
        """Use from_gguf_blocks / from_gguf_parts. `gather`: output column i is column gather[i] of the
        parts' outputs concatenated (None: the identity)."""
        self._parts = tuple(parts)
        self._ggml_types = tuple(ggml_types)
        self._n_in = n_in
        self._gather = gather
        self._n_out = sum(p.n for p in self._parts)

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_gguf_blocks(cls, blocks: Blocks, ggml_type_name: TypeName, n_out: int, n_in: int,
                         row_order: Any = None, device: str | torch.device = "cpu") -> PackedWeight:
        """One GGUF tensor: raw blocks uint8 [n_out, row_bytes] of type `ggml_type_name`.
        row_order: optional permutation; output row i is source row row_order[i]."""
        return cls.from_gguf_parts([(blocks, ggml_type_name, n_out)], n_in, row_order=row_order, device=device)

    @classmethod
    def from_gguf_parts(cls, parts: Sequence[tuple[Blocks, TypeName, int]], n_in: int, row_order: Any = None,
                        device: str | torch.device = "cpu") -> PackedWeight:
        """Several GGUF tensors [(blocks, type name, n_out), ...] with the same n_in, stacked along N in
        the order given (types may differ). row_order: optional permutation of the stacked rows, applied
        before packing; output row i is stacked row row_order[i] (a RoPE row order, say)."""
        if not parts:
            raise PackedFormatError("a packed weight needs at least one part")
        names, decoded = [], []
        for blocks, type_name, n_out in parts:
            name = _check_type(type_name, SUPPORTED_TYPES, "pack")
            if int(n_out) <= 0:
                raise PackedFormatError(f"a {name} part must have at least one row (n_out={n_out})")
            arr = _as_block_array(blocks, name, int(n_in), int(n_out))
            names.append(name)
            decoded.append((name in INT4_TYPES, _decode_part(arr, name, int(n_in))))
        n_total = sum(int(p[2]) for p in parts)
        order = _row_order(row_order, n_total)
        if order is None:
            order = np.arange(n_total)
        # source row -> (kind, row within that kind's concatenation)
        is_int4 = np.concatenate([np.full(int(p[2]), four) for p, (four, _) in zip(parts, decoded)])
        local = np.empty(n_total, dtype=np.int64)
        for kind in (True, False):
            local[is_int4 == kind] = np.arange(int((is_int4 == kind).sum()))
        built, positions = [], []
        kinds_in_output_order = list(dict.fromkeys(is_int4[order].tolist()))
        for kind in kinds_in_output_order:
            pos = np.nonzero(is_int4[order] == kind)[0]  # output rows of this kind, in order
            rows = local[order[pos]]
            arrays = [a for four, a in decoded if four == kind]
            stacked = [np.concatenate([a[i] for a in arrays])[rows] for i in range(len(arrays[0]))]
            if kind:
                built.append(_Int4Part.build(*stacked, _device(device)))
            else:
                q, scale = stacked
                q = advise_huge_pages(torch.from_numpy(q))  # streamed once per token: see host_memory
                built.append(_Int8Part(q, torch.from_numpy(scale).to(torch.bfloat16)).to(_device(device)))
            positions.append(pos)
        cat_positions = np.concatenate(positions)
        gather = None
        if not np.array_equal(cat_positions, np.arange(n_total)):
            gather = torch.from_numpy(np.argsort(cat_positions)).to(_device(device))
        return cls(built, names, int(n_in), gather)

    # -- properties ----------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): outputs, inputs."""
        return (self._n_out, self._n_in)

    @property
    def ggml_types(self) -> tuple[str, ...]:
        """The GGUF types of the source parts, in stacking order."""
        return self._ggml_types

    @property
    def kinds(self) -> tuple[str, ...]:
        """Kernel parts: ("int4",), ("int8",) or both, in output order."""
        return tuple(p.kind for p in self._parts)

    @property
    def device(self) -> torch.device:
        return self._parts[0].tensors()[0].device

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held (kernel operands, scales, the row gather if any)."""
        tensors = [t for p in self._parts for t in p.tensors()]
        if self._gather is not None:
            tensors.append(self._gather)
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return (f"PackedWeight(shape={self.shape}, ggml_types={self.ggml_types}, kinds={self.kinds}, "
                f"device={self.device}, nbytes={self.nbytes})")

    # -- compute -------------------------------------------------------------------------------------

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any float dtype) -> x @ W.T [..., N] in x's dtype (kernels get bf16 activations)."""
        if x.shape[-1] != self._n_in or not x.is_floating_point():
            raise ValueError(f"PackedWeight{self.shape}.matmul needs float inputs [..., {self._n_in}]; "
                             f"got {x.dtype} {list(x.shape)}")
        if x.dim() == 2 and x.shape[0] and len(self._parts) == 1 and self._gather is None:
            return self._parts[0].matmul(x).to(x.dtype)  # the model's case, without the general path's ops
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self._n_in)
        if x2.shape[0] == 0:
            return x.new_zeros((*lead, self._n_out))
        if len(self._parts) == 1:
            y = self._parts[0].matmul(x2).to(x.dtype)
        else:
            y = torch.cat([p.matmul(x2).to(x.dtype) for p in self._parts], dim=1)
        if self._gather is not None:
            y = y.index_select(1, self._gather)
        return y.reshape(*lead, self._n_out)

    __call__ = matmul

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the weights the kernels multiply by (int4: bf16 scale and zero; int8: the
        per-row re-quantized values), on this weight's device. For tests and diagnostics."""
        w = torch.cat([p.dequantize().to(self.device) for p in self._parts])
        return w if self._gather is None else w.index_select(0, self._gather)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows [len(ids), K] (an embedding lookup); int8 kinds only."""
        ids = torch.as_tensor(ids, device=self.device).reshape(-1).long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._n_out):
            raise IndexError(f"row ids must be in [0, {self._n_out}); got {int(ids.min())}..{int(ids.max())}")
        if any(p.kind != "int8" for p in self._parts):
            raise PackedFormatError(
                f"rows() reads int8-packed weights only (Q8_0, Q6_K); this one holds {', '.join(self.ggml_types)} "
                "in torch's int4 kernel layout, which has no row access: keep an embedding table as PackedRows")
        if self._gather is not None:
            ids = self._gather[ids]
        if len(self._parts) == 1:
            return self._parts[0].rows(ids)
        out = torch.empty((ids.numel(), self._n_in), dtype=torch.float32, device=self.device)
        start = 0
        for p in self._parts:
            mask = (ids >= start) & (ids < start + p.n)
            out[mask] = p.rows(ids[mask] - start)
            start += p.n
        return out

    def to(self, device: str | torch.device) -> PackedWeight:
        """This weight on `device` (cpu or cuda); itself if already there. int4 parts are re-packed into
        that device's kernel layout from their 4-bit values (read back, not kept)."""
        device = _device(device)
        if device == self.device:
            return self
        gather = None if self._gather is None else self._gather.to(device)
        return PackedWeight([p.to(device) for p in self._parts], self._ggml_types, self._n_in, gather)


def packed_weight_nbytes(parts: Sequence[tuple[str, int]], n_in: int) -> int:
    """The nbytes of PackedWeight.from_gguf_parts over parts [(type name, n_out), ...] of n_in inputs
    (no row_order), from the sizes alone: what `kvscope estimate` counts for a packed matrix."""
    n_int4 = sum(n for t, n in parts if t in INT4_TYPES)
    n_int8 = sum(n for t, n in parts if t in INT8_TYPES)
    unknown = [t for t, _ in parts if t not in INT4_TYPES + INT8_TYPES]
    if unknown:
        raise PackedFormatError(f"no packed form for {', '.join(unknown)}; packed types: {', '.join(SUPPORTED_TYPES)}")
    total = 0
    if n_int4:
        n_pad = -(-n_int4 // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
        total += n_pad * n_in // 2 + (n_in // INT4_GROUP) * n_pad * 2 * 2  # values; bf16 (scale, zero) per group
    if n_int8:
        total += n_int8 * n_in + n_int8 * 2  # values; one bf16 scale per row
    kinds = [t in INT4_TYPES for t, n in parts if n]
    if sum(a != b for a, b in zip(kinds, kinds[1:])) > 1:  # a kind's rows not in one run: an int64 gather
        total += (n_int4 + n_int8) * 8
    return total


def _decode_part(blocks: np.ndarray, name: str, n_in: int) -> tuple[np.ndarray, ...]:
    """int4 types: (q uint8 [n, K], scale, zero float32 [n, K/32]); int8 types: (q int8 [n, K], scale
    float32 [n]) re-quantized per row, REQUANT_CHUNK_ROWS rows at a time (bounded float32 copies)."""
    if name in INT4_TYPES:
        return _decode_int4(blocks, name, n_in)
    qs, scales = [], []
    for r0 in range(0, blocks.shape[0], REQUANT_CHUNK_ROWS):
        q, s = requantize_rows_int8(dequantize_blocks(blocks[r0:r0 + REQUANT_CHUNK_ROWS], name, n_in))
        qs.append(q)
        scales.append(s)
    return np.concatenate(qs), np.concatenate(scales)


# ---------------------------------------------------------------------------------------------------
# PackedRows: an embedding table as raw block bytes
# ---------------------------------------------------------------------------------------------------


class PackedRows:
    """An embedding table [n_rows, n_in] kept as its GGUF bytes (uint8 [n_rows, row_bytes]); `rows(ids)`
    decodes only the rows asked for. Types: Q8_0, Q4_0, Q4_K, Q6_K, and F32 / F16 / BF16 given as bytes
    (`reader_tensor.data.view(np.uint8)`)."""

    def __init__(self, data: torch.Tensor, ggml_type_name: TypeName, n_in: int) -> None:
        """data: uint8 [n_rows, row_bytes] on any device (kept as given, not copied)."""
        name = _check_type(ggml_type_name, SUPPORTED_TYPES + tuple(PLAIN_ROW_BYTES), "keep rows of")
        expected = n_in * PLAIN_ROW_BYTES[name] if name in PLAIN_ROW_BYTES else row_bytes(name, n_in)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != expected:
            raise PackedFormatError(f"{name} rows of {n_in} values must be uint8 [rows, {expected}]; "
                                    f"got {data.dtype} {list(data.shape)}")
        self._data = data
        self._type = name
        self._n_in = n_in

    @classmethod
    def from_gguf_blocks(cls, blocks: Blocks, ggml_type_name: TypeName, n_rows: int, n_in: int,
                         device: str | torch.device = "cpu") -> PackedRows:
        """From raw bytes uint8 [n_rows, row_bytes] (copied: a GGUFReader's arrays map the file read-only)."""
        name = _check_type(ggml_type_name, SUPPORTED_TYPES + tuple(PLAIN_ROW_BYTES), "keep rows of")
        if name in PLAIN_ROW_BYTES:
            arr = blocks.detach().cpu().numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
            width = n_in * PLAIN_ROW_BYTES[name]
            if arr.dtype != np.uint8 or arr.shape != (n_rows, width):
                raise PackedFormatError(f"{name} rows of {n_in} values must be uint8 [{n_rows}, {width}] (bytes); "
                                        f"got {arr.dtype} {list(arr.shape)}")
        else:
            arr = _as_block_array(blocks, name, n_in, n_rows)
        return cls(torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True)).to(_device(device)), name, n_in)

    @property
    def shape(self) -> tuple[int, int]:
        return (self._data.shape[0], self._n_in)

    @property
    def ggml_type(self) -> str:
        return self._type

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def __repr__(self) -> str:
        return f"PackedRows(shape={self.shape}, ggml_type={self._type}, device={self.device}, nbytes={self.nbytes})"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [*ids.shape, n_in]: the rows `ids`, decoded as gguf.quants.dequantize would, on this
        table's device (the selected bytes are decoded on the CPU)."""
        ids = torch.as_tensor(ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"row ids must be integers; got {ids.dtype}")
        n_rows = self._data.shape[0]
        flat = ids.reshape(-1).to(self.device, torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_rows):
            raise IndexError(f"row ids must be in [0, {n_rows}); got {int(flat.min())}..{int(flat.max())}")
        raw = self._data.index_select(0, flat).cpu().numpy()
        if self._type == "F32":
            values = raw.view(np.float32)
        elif self._type == "F16":
            values = raw.view(np.float16).astype(np.float32)
        elif self._type == "BF16":
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = dequantize_blocks(raw, self._type, self._n_in)
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(*ids.shape, self._n_in)
        return out.to(self.device)

    def to(self, device: str | torch.device) -> PackedRows:
        device = _device(device)
        return self if device == self.device else PackedRows(self._data.to(device), self._type, self._n_in)
