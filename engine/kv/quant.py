"""ggml's block quantization of K/V rows, in torch: q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl.

Every function works on whole rows, vectorised over all blocks (no Python loop over blocks):

    quantize(x)    float  [..., n]                       -> uint8 [..., n / 32 * block_bytes]
    dequantize(b)  uint8  [..., n / 32 * block_bytes]    -> float32 [..., n]

The bytes are ggml's block structs, little-endian, in memory order (ggml-common.h):

    q8_0    34 B  d: f16, qs: 32 x int8                       x = d * q
    q4_0    18 B  d: f16, qs: 16 B                            x = d * (q - 8)
    q4_1    20 B  d: f16, m: f16, qs: 16 B                    x = d * q + m
    q5_0    22 B  d: f16, qh: 4 B, qs: 16 B                   x = d * (q - 16)
    q5_1    24 B  d: f16, m: f16, qh: 4 B, qs: 16 B           x = d * q + m
    iq4_nl  18 B  d: f16, qs: 16 B                            x = d * kvalues_iq4nl[q]

Nibbles: byte j of qs holds value j in its low nibble and value j + 16 in its high nibble. q5's qh is a
little-endian uint32 whose bit j is the fifth bit of value j.

Quantization reproduces ggml's reference quantizers (ggml-quants.c `quantize_row_*_ref`) operation for
operation in float32: the same amax/min/max choices (first index of the largest |x| for q4_0/q5_0), the
same float32 expressions, truncating casts and f16 round-to-nearest-even scales, so the bytes are equal
to the C code's (checked against ggml-quants.c of llama.cpp 0c1e570 compiled with gcc: identical on
200k random blocks for every type). iq4_nl follows quantize_row_iq4_nl_ref (ntry = -1: one least-squares
scale, no scale search), with its sums accumulated sequentially in float32 as the C loops do.

Where ggml's CPU backend does not call the reference quantizer: on x86 with AVX (and on ARM NEON) the
KV cache's q8_0 rows are written by the SIMD quantize_row_q8_0, which uses id = 127/amax and rounds
halves to even; it can differ from the reference (used here, and by the CUDA backend) by one step on
rare values. The other five types call the reference on every CPU.
"""
from __future__ import annotations

import torch

QK = 32  # values per block, for every type here

# ggml-common.h kvalues_iq4nl
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_KV_F32 = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32)
GROUP_MAX_EPS = 1e-15  # ggml-quants.c; as float32 in the comparison below

BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}


# ---- helpers ------------------------------------------------------------------------------------
def _to_blocks(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """float rows [..., n] -> float32 blocks [..., n/32, 32] and the leading shape."""
    n = x.shape[-1]
    if n % QK:
        raise ValueError(f"a row of {n} values is not a whole number of blocks of {QK}")
    return x.to(torch.float32).reshape(*x.shape[:-1], n // QK, QK), tuple(x.shape[:-1])


def _from_bytes(b: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """uint8 rows [..., nb * block_bytes] -> [..., nb, block_bytes]."""
    if b.dtype != torch.uint8:
        raise TypeError(f"quantized rows must be uint8, got {b.dtype}")
    nbytes = b.shape[-1]
    if nbytes % block_bytes:
        raise ValueError(f"a row of {nbytes} bytes is not a whole number of {block_bytes}-byte blocks")
    return b.reshape(*b.shape[:-1], nbytes // block_bytes, block_bytes)


def _rows(blocks: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    return blocks.reshape(*lead, -1)


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] -> its f16 (round to nearest even, as GGML_FP32_TO_FP16) as 2 bytes [..., 2]."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _f16_value(b: torch.Tensor) -> torch.Tensor:
    """2 bytes [..., 2] -> float32 [..., 1]."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] (values 0..15) -> [..., 16]: value j low nibble, value j + 16 high nibble."""
    return (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> uint8 [..., 32] in value order."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32] (values 0..31) -> qh [..., 4]: little-endian uint32, bit j = bit 4 of value j."""
    bits = ((q >> 4) & 1).to(torch.int32).reshape(*q.shape[:-1], 4, 8)
    return (bits << torch.arange(8, dtype=torch.int32, device=q.device)).sum(-1).to(torch.uint8)


def _unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """qh [..., 4] -> uint8 [..., 32], the fifth bit (0 or 16) of each value."""
    bits = (qh.unsqueeze(-1).to(torch.int32) >> torch.arange(8, dtype=torch.int32, device=qh.device)) & 1
    return (bits.reshape(*qh.shape[:-1], 32) << 4).to(torch.uint8)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C roundf: halves away from zero (torch.round rounds halves to even)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.copysign(fl + torch.floor(2 * (a - fl)), v)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """`d ? 1.0f/d : 0.0f`"""
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """ggml's `amax = 0, max = 0; if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` scan: the first value
    with the largest |x| of each block, and +0.0 when the block is all zeros (whatever their signs)."""
    a = x.abs()
    v = torch.gather(x, -1, a.argmax(dim=-1, keepdim=True))
    return torch.where(v == 0, torch.zeros_like(v), v)


def _first_min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `if (v < min) min = v; if (v > max) max = v;` scan: the FIRST minimal and maximal value of each
    block (this decides the sign of a zero, which reaches the f16 bytes of d and m)."""
    return (torch.gather(x, -1, x.argmin(dim=-1, keepdim=True)),
            torch.gather(x, -1, x.argmax(dim=-1, keepdim=True)))


# ---- q8_0 -------------------------------------------------------------------------------------------
def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    xb, lead = _to_blocks(x)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    d = amax / 127
    q = _roundf(xb * _inverse(d)).to(torch.int8).view(torch.uint8)
    return _rows(torch.cat([_f16_bytes(d), q], dim=-1), lead)


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    blk = _from_bytes(b, 34)
    values = torch.empty(*blk.shape[:-1], QK, dtype=torch.float32, device=b.device)
    dequantize_q8_0_into(blk, values)
    return _rows(values, tuple(b.shape[:-1]))


def dequantize_q8_0_into(blk: torch.Tensor, out: torch.Tensor) -> None:
    """Blocks [..., 34] decoded into float32 `out` [..., 32] (a view: where the values belong): each int8 value
    times its block's f16 scale, in one pass with no temporaries (gathering the values into a contiguous copy
    first took ~13x as long for 2048 rows of 256)."""
    torch.mul(blk[..., 2:].view(torch.int8), _f16_value(blk[..., :2]), out=out)


# ---- q4_0 / q5_0 (symmetric, scale from the signed absmax) --------------------------------------
def _quantize_sym(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """q4_0 (nmax 8) and q5_0 (nmax 16): d = max / -nmax, q = MIN(2 nmax - 1, (int8_t)(x * id + nmax + 0.5f))."""
    xb, lead = _to_blocks(x)
    d = _signed_absmax(xb) / -nmax
    q = torch.trunc(xb * _inverse(d) + (nmax + 0.5)).clamp(max=2 * nmax - 1).to(torch.uint8)
    return d, q, lead


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q, lead = _quantize_sym(x, 8)
    return _rows(torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=-1), lead)


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    blk = _from_bytes(b, 18)
    values = torch.empty(*blk.shape[:-1], QK, dtype=torch.float32, device=b.device)
    dequantize_q4_0_into(blk, values)
    return _rows(values, tuple(b.shape[:-1]))


def dequantize_q4_0_into(blk: torch.Tensor, out: torch.Tensor) -> None:
    """Blocks [..., 18] decoded into float32 `out` [..., 32] (a view, as dequantize_q8_0_into): each nibble
    minus 8 in int8, over whole blocks at once (long runs of bytes; the scale's bytes come out as junk that
    is not read), then each half of a block times its scale, in one pass into place."""
    d = _f16_value(blk[..., :2])
    low = (blk & 0x0F).view(torch.int8).sub_(8)
    high = (blk >> 4).view(torch.int8).sub_(8)
    torch.mul(low[..., 2:], d, out=out[..., :16])
    torch.mul(high[..., 2:], d, out=out[..., 16:])


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q, lead = _quantize_sym(x, 16)
    return _rows(torch.cat([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], dim=-1), lead)


def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    blk = _from_bytes(b, 22)
    d = _f16_value(blk[..., :2])
    q = (_unpack_nibbles(blk[..., 6:]) | _unpack_high_bits(blk[..., 2:6])).to(torch.float32) - 16
    return _rows(q * d, tuple(b.shape[:-1]))


# ---- q4_1 / q5_1 (affine: scale and min) --------------------------------------------------------------
def _quantize_affine(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """q4_1 (15 levels) and q5_1 (31): d = (max - min) / levels, q = (x - min) * id + 0.5f truncated."""
    xb, lead = _to_blocks(x)
    lo, hi = _first_min_max(xb)
    d = (hi - lo) / levels
    q = torch.trunc((xb - lo) * _inverse(d) + 0.5)
    # q4_1: MIN(15, (int8_t)...); q5_1: (uint8_t)... and only the low 5 bits are stored.
    q = q.clamp(max=15) if levels == 15 else q.to(torch.int32) & 0x1F
    return d, lo, q.to(torch.uint8), lead


def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    d, m, q, lead = _quantize_affine(x, 15)
    return _rows(torch.cat([_f16_bytes(d), _f16_bytes(m), _pack_nibbles(q)], dim=-1), lead)


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    blk = _from_bytes(b, 20)
    d, m = _f16_value(blk[..., :2]), _f16_value(blk[..., 2:4])
    q = _unpack_nibbles(blk[..., 4:]).to(torch.float32)
    return _rows(q * d + m, tuple(b.shape[:-1]))


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    d, m, q, lead = _quantize_affine(x, 31)
    return _rows(torch.cat([_f16_bytes(d), _f16_bytes(m), _pack_high_bits(q), _pack_nibbles(q)], dim=-1), lead)


def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    blk = _from_bytes(b, 24)
    d, m = _f16_value(blk[..., :2]), _f16_value(blk[..., 2:4])
    q = (_unpack_nibbles(blk[..., 8:]) | _unpack_high_bits(blk[..., 4:8])).to(torch.float32)
    return _rows(q * d + m, tuple(b.shape[:-1]))


# ---- iq4_nl ----------------------------------------------------------------------------------------
def _best_index_iq4nl(v: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8(16, kvalues_iq4nl, v), elementwise: the nearest table entry, the upper one
    on a tie (`x - val[mu-1] < val[mu] - x ? mu-1 : mu`)."""
    vals = _KV_F32.to(v.device)
    mu = torch.searchsorted(vals, v.contiguous(), right=True).clamp(1, 15)  # val[mu-1] <= v < val[mu]
    lower, upper = vals[mu - 1], vals[mu]
    idx = torch.where(v - lower < upper - v, mu - 1, mu)
    idx = torch.where(v >= vals[15], torch.full_like(idx, 15), idx)
    return torch.where(v <= vals[0], torch.zeros_like(idx), idx)


def _sequential_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in index order, in float32 (the C loop's `s += p[j]`), vectorised over the rest."""
    cols = p.movedim(-1, 0).contiguous()
    s = torch.zeros_like(cols[0])
    for j in range(cols.shape[0]):  # 32 values of a block, not the blocks
        s = s + cols[j]
    return s


def quantize_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_iq4_nl_ref, which is what the CPU backend's from_float (and so the KV cache's
    set_rows) calls: quantize_row_iq4_nl_impl with ntry = -1 and no importance weights. That is: start
    from d = max / kvalues[0] (the value with the largest |x| lands on -127), pick each value's nearest
    table entry for 1/d, then keep those indices and store the weighted least-squares scale
    d = sum(w q x) / sum(w q q) with w = x^2 (no scale search: ntry = -1 skips it and the final re-pick).

    Blocks with max |x| < GROUP_MAX_EPS get d = 0 and ggml packs its index buffer unchanged: the indices
    of the previous block of the same row, or uninitialised memory for the leading blocks of a row.
    kvscope copies the previous block's indices and writes zeros for the leading ones; such blocks
    decode to zeros either way."""
    xb, lead = _to_blocks(x)
    vals = _KV_F32.to(xb.device)
    vmax = _signed_absmax(xb)  # [..., nb, 1]
    tiny = vmax.abs() < torch.tensor(GROUP_MAX_EPS, dtype=torch.float32, device=xb.device)
    vmax = torch.where(tiny, torch.ones_like(vmax), vmax)  # those blocks get d = 0 below
    d0 = vmax / vals[0]
    idx = _best_index_iq4nl((1.0 / d0) * xb)  # [..., nb, 32]
    q = vals[idx]
    wq = (xb * xb) * q
    sumqx, sumq2 = _sequential_sum(wq * xb), _sequential_sum(wq * q)  # [..., nb]
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, torch.ones_like(sumq2)),
                    torch.zeros_like(sumq2))
    tiny = tiny[..., 0]
    d = torch.where(tiny, torch.zeros_like(d), d).unsqueeze(-1)
    if bool(tiny.any()):
        # the indices of the last earlier block of the row that was not tiny; zeros before the first one
        nb = xb.shape[-2]
        pos = torch.arange(nb, device=xb.device).expand(tiny.shape)
        src = torch.where(tiny, torch.full_like(pos, -1), pos).cummax(dim=-1).values
        stale = torch.gather(idx, -2, src.clamp(min=0).unsqueeze(-1).expand(idx.shape))
        stale = torch.where((src >= 0).unsqueeze(-1), stale, torch.zeros_like(stale))
        idx = torch.where(tiny.unsqueeze(-1), stale, idx)
    return _rows(torch.cat([_f16_bytes(d), _pack_nibbles(idx.to(torch.uint8))], dim=-1), lead)


def dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    blk = _from_bytes(b, 18)
    d = _f16_value(blk[..., :2])
    q = _KV_F32.to(b.device)[_unpack_nibbles(blk[..., 2:]).to(torch.long)]
    return _rows(d * q, tuple(b.shape[:-1]))


QUANTIZERS = {
    "q8_0": (quantize_q8_0, dequantize_q8_0),
    "q4_0": (quantize_q4_0, dequantize_q4_0),
    "q4_1": (quantize_q4_1, dequantize_q4_1),
    "q5_0": (quantize_q5_0, dequantize_q5_0),
    "q5_1": (quantize_q5_1, dequantize_q5_1),
    "iq4_nl": (quantize_iq4_nl, dequantize_iq4_nl),
}
# Decoders of blocks [..., block_bytes] into a float32 view [..., 32], for the types whose rows attention reads
# most (the others decode into a new tensor, which is then copied where it belongs).
DEQUANTIZERS_INTO = {"q8_0": dequantize_q8_0_into, "q4_0": dequantize_q4_0_into}
