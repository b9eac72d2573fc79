"""engine/models/packed.py: GGUF block decoders, PackedWeight (torch's int4 / int8 weight-only kernels) and
PackedRows, against gguf-py's dequantize.

Block bytes come two ways: random bytes with random finite f16 scale fields (every bit pattern of the
4/6-bit values and of Q4_K's packed 6-bit scales and mins, negative d, negative Q6_K scales), and
quantized normal weights (gguf-py quantizes Q8_0 and Q4_0; Q4_K and Q6_K are quantized by hand below
because gguf-py cannot).

Tolerances, all measured on torch 2.13 CPU and stated here:
  * decoders: bit-identical to gguf.quants.dequantize, except Q4_K rewritten as (q - 8)*scale + zero:
    within 4 float32 ulps of 8*scale (measured: 0).
  * matmul vs F.linear(x as bf16, w.dequantize()): |y - ref| <= 2^-8 |ref| + 1e-5 (|x| @ |W|^T), i.e. the
    kernels' bf16 output rounding (2^-9) and float32 accumulation order (measured excess <= 3e-8).
  * matmul vs F.linear(x, exact float32 weights), relative Frobenius: int4 <= 0.01 (measured ~0.003:
    bf16 activations, scales, zeros and outputs), int8 <= 0.02 (measured ~0.008: + per-row requantization).
  * int8 requantization of normal weights, relative Frobenius error of the weights: Q8_0 ~0.0077,
    Q6_K ~0.0075 (asserted < 0.01; bound per element: half a row step).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.models import packed as P
from engine.models.packed import PackedFormatError, PackedRows, PackedWeight
from engine.testing.kquants import quantize_q4_k, quantize_q6_k

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType

SHAPES = [(64, 256), (96, 512)]


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random block bytes [n, row_bytes] whose f16 scale fields are random finite values (either sign)."""
    rng = np.random.default_rng(seed)
    values_per_block, block_bytes = P.BLOCK_LAYOUTS[name]
    nb = k // values_per_block
    b = rng.integers(0, 256, (n, nb, block_bytes), dtype=np.uint8)
    f16_fields = {"Q8_0": [(0, 0.01)], "Q4_0": [(0, 0.01)], "Q4_K": [(0, 1e-3), (2, 1e-3)], "Q6_K": [(208, 1e-3)]}
    for offset, scale in f16_fields[name]:
        d = (rng.standard_normal((n, nb)) * scale).astype(np.float16)
        b[..., offset:offset + 2] = d.view(np.uint8).reshape(n, nb, 2)
    return b.reshape(n, -1)


def quantize(x: np.ndarray, name: str) -> np.ndarray:
    if name == "Q4_K":
        return quantize_q4_k(x)
    if name == "Q6_K":
        return quantize_q6_k(x)
    return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), QT[name])


def exact(blocks: np.ndarray, name: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, QT[name]), dtype=np.float32))


def assert_matches_effective_weights(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y = x @ w.T up to the kernels' bf16 activations and outputs (see the module docstring)."""
    xb = x.to(torch.bfloat16).float()
    ref = F.linear(xb, w)
    bound = 2.0**-8 * ref.abs() + 1e-5 * F.linear(xb.abs(), w.abs())
    excess = ((y.float() - ref).abs() - bound).max().item()
    assert excess <= 0, f"matmul is off by up to {excess:.3g} beyond the bf16 bound"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --- decoders ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", P.SUPPORTED_TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_decoders_reproduce_gguf_dequantize(name: str, n: int, k: int) -> None:
    for blocks in (random_blocks(name, n, k, seed=n), quantize(np.random.default_rng(k).standard_normal((n, k)), name)):
        ref = gguf.quants.dequantize(blocks, QT[name])
        assert np.array_equal(P.dequantize_blocks(blocks, name, k), ref)  # same float32 operations: bit-identical
        if name in P.INT4_TYPES:
            q, scale, zero = (P.decode_q4_0 if name == "Q4_0" else P.decode_q4_k)(blocks, k)
            assert q.dtype == np.uint8 and q.shape == (n, k) and q.max() <= 15
            assert scale.shape == zero.shape == (n, k // 32) and scale.dtype == zero.dtype == np.float32
            w = (q.astype(np.float32).reshape(n, -1, 32) - 8) * scale[..., None] + zero[..., None]
            ulp = np.spacing(np.abs(8 * scale)).astype(np.float32)[..., None]
            assert np.all(np.abs(w - ref.reshape(n, -1, 32)) <= 4 * ulp)
            if name == "Q4_0":
                assert not zero.any()
        else:
            q, scale = (P.decode_q8_0 if name == "Q8_0" else P.decode_q6_k)(blocks, k)
            gs = P.GROUP_SIZES[name]
            assert q.dtype == np.int8 and q.shape == (n, k) and scale.shape == (n, k // gs)
            if name == "Q6_K":
                assert q.min() >= -32 and q.max() <= 31
            w = q.astype(np.float32).reshape(n, -1, gs) * scale[..., None]
            assert np.array_equal(w.reshape(n, k), ref)
    # the random bytes exercise what they should: sub-block scales that differ, both signs
    if name == "Q4_K":
        q, step, offset = P._q4_k_fields(random_blocks(name, n, k))
        assert len(np.unique(step)) > n and len(np.unique(offset)) > n and (step < 0).any()
    if name == "Q6_K":
        assert (P.decode_q6_k(random_blocks(name, n, k), k)[1] < 0).any()


def test_q4_k_scale_unpacking_by_hand() -> None:
    """One Q4_K block built field by field: d = 1, dmin = 0.5, scale j = j + 1 + 16*(j >= 4), min j = 63 - j,
    value i of sub-block j = (i + j) % 16; each w = d*sc*q - dmin*m."""
    sc = np.array([1, 2, 3, 4, 21, 22, 23, 24], dtype=np.uint8)
    m = np.array([63, 62, 61, 60, 59, 58, 57, 56], dtype=np.uint8)
    scales = np.concatenate([(sc[:4] & 63) | ((sc[4:] >> 4) << 6), (m[:4] & 63) | ((m[4:] >> 4) << 6),
                             (sc[4:] & 15) | ((m[4:] & 15) << 4)]).astype(np.uint8)
    q = (np.arange(32)[None, :] + np.arange(8)[:, None]) % 16
    qs = (q[0::2] | (q[1::2] << 4)).astype(np.uint8).reshape(-1)
    block = np.concatenate([np.float16(1).reshape(1).view(np.uint8), np.float16(0.5).reshape(1).view(np.uint8),
                            scales, qs])[None, :]
    want = (sc[:, None] * q - 0.5 * m[:, None]).astype(np.float32).reshape(1, 256)
    assert np.array_equal(P.dequantize_blocks(block, "Q4_K", 256), want)
    assert np.array_equal(gguf.quants.dequantize(block, QT.Q4_K), want)


# --- PackedWeight ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", P.SUPPORTED_TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matmul_matches_dequantized_linear(name: str, n: int, k: int) -> None:
    blocks = random_blocks(name, n, k, seed=7)
    w = PackedWeight.from_gguf_blocks(blocks, name, n, k)
    ref_w = exact(blocks, name)
    assert w.shape == (n, k) and w.ggml_types == (name,) and w.device == torch.device("cpu")
    assert w.kinds == ("int4",) if name in P.INT4_TYPES else ("int8",)
    eff = w.dequantize()
    assert eff.dtype == torch.float32 and eff.shape == (n, k)
    torch.manual_seed(0)
    for m in (1, 7):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            y = w.matmul(x)
            assert y.dtype == dtype and y.shape == (m, n)
            assert_matches_effective_weights(y, x, eff)
            assert rel_err(y, F.linear(x.float(), ref_w)) <= (0.01 if name in P.INT4_TYPES else 0.02)
    x3 = torch.randn(2, 3, k)
    assert torch.equal(w.matmul(x3), w.matmul(x3.reshape(6, k)).reshape(2, 3, n))
    assert w.matmul(torch.randn(0, k)).shape == (0, n)


@pytest.mark.parametrize("name", P.INT4_TYPES)
def test_int4_weights_differ_from_exact_only_by_bf16_scale_and_zero(name: str) -> None:
    n, k = 64, 512
    blocks = random_blocks(name, n, k, seed=3)
    q, scale, zero = (P.decode_q4_0 if name == "Q4_0" else P.decode_q4_k)(blocks, k)
    err = (PackedWeight.from_gguf_blocks(blocks, name, n, k).dequantize() - exact(blocks, name)).abs().numpy()
    bound = 2.0**-8 * (np.abs(q.astype(np.float32).reshape(n, -1, 32) - 8) * np.abs(scale)[..., None]
                       + np.abs(zero)[..., None]) + 4 * np.spacing(np.abs(8 * scale))[..., None]
    assert np.all(err.reshape(n, -1, 32) <= bound)


@pytest.mark.parametrize("name", P.INT8_TYPES)
def test_int8_requantization_error(name: str) -> None:
    """Normal weights quantized as `name`, re-quantized to one int8 scale per row: each weight moves by at
    most half a row step (max|w_row| / 127, rounded up to bf16); overall ~0.75% (Frobenius)."""
    n, k = 256, 768
    blocks = quantize(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32), name)
    ref = exact(blocks, name)
    got = PackedWeight.from_gguf_blocks(blocks, name, n, k).dequantize()
    step = ref.abs().amax(dim=1, keepdim=True) / 127 * (1 + 2.0**-7)
    assert torch.all((got - ref).abs() <= step / 2 * (1 + 1e-5))
    assert 0.001 < rel_err(got, ref) < 0.01


def test_n_not_a_multiple_of_16_is_padded_and_still_packed() -> None:
    n, k = 40, 256  # the CPU int4 packer refuses N % 16 != 0: 8 zero rows are packed and sliced off
    blocks = random_blocks("Q4_K", n, k, seed=5)
    w = PackedWeight.from_gguf_blocks(blocks, "Q4_K", n, k)
    x = torch.randn(3, k)
    assert w.matmul(x).shape == (3, n)
    assert_matches_effective_weights(w.matmul(x), x, w.dequantize())
    assert w.nbytes == 48 * (k // 2 + k // 32 * 4)


def test_fused_parts_of_mixed_types_and_row_order() -> None:
    k = 256
    parts = [(random_blocks("Q4_K", 64, k, 1), "Q4_K", 64), (random_blocks("Q6_K", 32, k, 2), "Q6_K", 32),
             (random_blocks("Q4_0", 32, k, 3), "Q4_0", 32), (random_blocks("Q8_0", 48, k, 4), "Q8_0", 48)]
    full = torch.cat([exact(b, t) for b, t, _ in parts])
    x = torch.randn(5, k)
    fused = PackedWeight.from_gguf_parts(parts, n_in=k)
    assert fused.shape == (176, k) and fused.ggml_types == ("Q4_K", "Q6_K", "Q4_0", "Q8_0")
    assert fused.kinds == ("int4", "int8")
    # each source part is packed as it would be alone (int4 Q4_K + Q4_0 share a part, Q6_K + Q8_0 another)
    alone = torch.cat([PackedWeight.from_gguf_blocks(b, t, n, k).dequantize() for b, t, n in parts])
    assert torch.equal(fused.dequantize(), alone)
    assert_matches_effective_weights(fused.matmul(x), x, alone)
    assert rel_err(fused.matmul(x), F.linear(x, full)) < 0.02

    order = torch.randperm(176, generator=torch.Generator().manual_seed(0))  # interleaves int4 and int8 rows
    permuted = PackedWeight.from_gguf_parts(parts, n_in=k, row_order=order)
    assert torch.equal(permuted.dequantize(), alone[order])
    assert_matches_effective_weights(permuted.matmul(x), x, alone[order])
    assert rel_err(permuted.matmul(x), F.linear(x, full[order])) < 0.02

    # a RoPE-style order within one type: no gather needed, same bytes budget as unpermuted
    rope = torch.arange(64).view(2, 32).t().reshape(-1)  # interleaved halves
    one = PackedWeight.from_gguf_blocks(parts[0][0], "Q4_K", 64, k, row_order=rope)
    assert torch.equal(one.dequantize(), PackedWeight.from_gguf_blocks(parts[0][0], "Q4_K", 64, k).dequantize()[rope])
    assert one.nbytes == PackedWeight.from_gguf_blocks(parts[0][0], "Q4_K", 64, k).nbytes


@pytest.mark.parametrize("name,ratio", [("Q4_0", 10 / 9), ("Q4_K", 10 / 9), ("Q8_0", 32 / 34), ("Q6_K", 256 / 210)])
def test_resident_bytes_close_to_the_file(name: str, ratio: float) -> None:
    """int4: 4 bits + bf16 scale and zero per 32 = 5 bits (file 4.5); int8: 8 bits + a bf16 per row (Q8_0
    file 8.5, Q6_K file 6.5625)."""
    n, k = 256, 1024
    blocks = random_blocks(name, n, k)
    w = PackedWeight.from_gguf_blocks(blocks, name, n, k)
    per_row_scales = 0 if name in P.INT4_TYPES else 2 * n
    assert w.nbytes == round(blocks.nbytes * ratio) + per_row_scales
    assert w.nbytes / blocks.nbytes < {"Q4_0": 1.12, "Q4_K": 1.12, "Q8_0": 0.95, "Q6_K": 1.23}[name]


def test_int4_values_read_back_two_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU inverse of torch's nibble order (used by to() and dequantize()) agrees with reading the
    values through the kernel (the CUDA method), including packing in several chunks and a partial
    last 64-row group."""
    monkeypatch.setattr(P, "PACK_CHUNK_ROWS", 64)
    n, k = 208, 256
    q = np.random.default_rng(0).integers(0, 16, (n, k), dtype=np.uint8)
    packed = P._pack_int4_cpu(q)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q).int(), 2))
    assert np.array_equal(P._unpack_int4_cpu(packed, k), q)
    via_kernel = P._int4_values_via_kernel(packed, n, k, torch.ops.aten._weight_int4pack_mm_for_cpu)
    assert np.array_equal(via_kernel.numpy(), q)


def test_to_same_device_is_identity_and_rows() -> None:
    k = 256
    w8 = PackedWeight.from_gguf_blocks(random_blocks("Q6_K", 32, k), "Q6_K", 32, k)
    assert w8.to("cpu") is w8 and w8.to(torch.device("cpu")) is w8
    ids = torch.tensor([3, 0, 31, 3])
    assert torch.equal(w8.rows(ids), w8.dequantize()[ids])
    w4 = PackedWeight.from_gguf_blocks(random_blocks("Q4_0", 32, k), "Q4_0", 32, k)
    with pytest.raises(PackedFormatError, match="int8.*PackedRows"):
        w4.rows(ids)
    with pytest.raises(IndexError, match=r"\[0, 32\)"):
        w8.rows(torch.tensor([32]))


def test_clear_errors() -> None:
    k = 256
    with pytest.raises(PackedFormatError, match="Q5_0.*supported: Q8_0, Q4_0, Q4_K, Q6_K"):
        PackedWeight.from_gguf_blocks(np.zeros((4, 176), np.uint8), "Q5_0", 4, k)
    assert issubclass(PackedFormatError, ValueError)
    good = random_blocks("Q4_K", 4, k)
    with pytest.raises(ValueError, match=r"uint8 \[4, 144\].*got uint8 \[4, 145\]"):
        PackedWeight.from_gguf_blocks(np.zeros((4, 145), np.uint8), "Q4_K", 4, k)
    with pytest.raises(ValueError, match=r"uint8 \[8, 144\].*got uint8 \[4, 144\]"):
        PackedWeight.from_gguf_blocks(good, "Q4_K", 8, k)
    with pytest.raises(ValueError, match=r"got float32"):
        PackedWeight.from_gguf_blocks(good.astype(np.float32), "Q4_K", 4, k)
    with pytest.raises(ValueError, match="multiple of 256 values; got a row length of 288"):
        PackedWeight.from_gguf_blocks(good, "Q4_K", 4, 288)
    with pytest.raises(ValueError, match="permutation"):
        PackedWeight.from_gguf_blocks(good, "Q4_K", 4, k, row_order=[0, 1, 1, 2])
    w = PackedWeight.from_gguf_blocks(good, "Q4_K", 4, k)
    with pytest.raises(ValueError, match=r"\[\.\.\., 256\]"):
        w.matmul(torch.randn(1, 128))
    with pytest.raises(PackedFormatError, match="Q5_K"):
        PackedRows.from_gguf_blocks(np.zeros((4, 176), np.uint8), "Q5_K", 4, k)


# --- PackedRows --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", P.SUPPORTED_TYPES)
def test_packed_rows_decode_only_the_rows_asked_for(name: str) -> None:
    n, k = 96, 512
    blocks = random_blocks(name, n, k, seed=11)
    table = PackedRows.from_gguf_blocks(blocks, name, n, k)
    assert table.shape == (n, k) and table.nbytes == blocks.nbytes and table.ggml_type == name
    assert table.to("cpu") is table
    ref = exact(blocks, name)
    ids = torch.tensor([5, 0, 95, 5, 42])
    assert torch.equal(table.rows(ids), ref[ids])
    assert torch.equal(table.rows(ids.view(1, 5)), ref[ids].view(1, 5, k))
    assert table.rows(torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(IndexError, match=r"\[0, 96\)"):
        table.rows(torch.tensor([96]))


def test_packed_rows_plain_types() -> None:
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    table = PackedRows.from_gguf_blocks(x.astype(np.float16).view(np.uint8), "F16", 8, 64)
    assert torch.equal(table.rows(torch.tensor([7, 1])), torch.from_numpy(x.astype(np.float16)[[7, 1]].astype(np.float32)))
    table = PackedRows.from_gguf_blocks(x.view(np.uint8), "F32", 8, 64)
    assert torch.equal(table.rows(torch.tensor([2])), torch.from_numpy(x[[2]]))


def test_built_from_gguf_reader_tensors(tmp_path: Path) -> None:
    """GGUFReader tensors hold exactly the raw form the constructors take (a read-only memory map)."""
    x = np.random.default_rng(4).standard_normal((48, 512)).astype(np.float32)
    arrays = {"q4k": (quantize_q4_k(x), QT.Q4_K), "q6k": (quantize_q6_k(x[:16]), QT.Q6_K), "q8": (quantize(x, "Q8_0"), QT.Q8_0)}
    writer = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    for name, (data, qtype) in arrays.items():
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "w.gguf")).tensors}
    fused = PackedWeight.from_gguf_parts([(tensors["q4k"].data, tensors["q4k"].tensor_type, 48),
                                          (tensors["q6k"].data, tensors["q6k"].tensor_type, 16)], n_in=512)
    assert fused.ggml_types == ("Q4_K", "Q6_K")
    ref = torch.cat([exact(arrays["q4k"][0], "Q4_K"), exact(arrays["q6k"][0], "Q6_K")])
    v = torch.randn(2, 512)
    assert rel_err(fused.matmul(v), F.linear(v, ref)) < 0.02
    table = PackedRows.from_gguf_blocks(tensors["q8"].data, tensors["q8"].tensor_type, 48, 512)
    assert torch.equal(table.rows(torch.tensor([47, 0])), exact(arrays["q8"][0], "Q8_0")[[47, 0]])
