"""Quantized K/V cache types (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl): ggml's block bytes, the context's
validation (llama_init_from_model, src/llama-context.cpp), sizes and init lines (llama_kv_cache's
constructor, src/llama-kv-cache.cpp), decoding, and the K-shift on quantized keys (llama_kv_cache::update).

References for the bytes:
- gguf-py's numpy quantizers (`gguf.quants`), which copy ggml's reference quantizers, for the five
  types it can quantize, and its dequantizers for all six;
- GOLDEN: sha256 of the bytes that ggml's own quantize_row_*_ref (ggml/src/ggml-quants.c of llama.cpp
  0c1e570, the version vendored in llama-cpp-python 0.3.36, compiled with gcc -O2) wrote for
  `golden_rows()`, row by row as set_rows does. This is the byte-exact check for iq4_nl, which gguf-py
  cannot quantize, and for the signed-zero corner cases where gguf-py and ggml differ.
"""
from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import torch

import engine
from engine.context import ContextParams
from engine.errors import ContextParamsError
from engine.kv import quant
from engine.kv.layout import CacheLayout
from engine.kv.types import CACHE_TYPES, cache_type
from tests.model_factory import in_memory_model

QTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
GGUF_QUANTIZES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
GGML_TYPE = {name: getattr(gguf.GGMLQuantizationType, name.upper()) for name in QTYPES}

GOLDEN = {
    "q8_0": "a6503e0c69583e44ddd5a4028c3b549469ec3779f0e589bfc94697b3f67d876b",
    "q4_0": "1fec3b97f25950ccb6ed8bc32c4c08c5aa410f56cf3c593f5774aeddd6ed5cc1",
    "q4_1": "22af0d0da500d5aa796e3bb944d8ce48f62e2fb4b2c34014b8331af083cf7da9",
    "q5_0": "5b3824fce0e623fac2bffc6feda26a4a46d1597ce5f8e76a38ad8ce07b827975",
    "q5_1": "edd6aea0ae5b9fadc9b90b52b56baf3a73e45c7301dd6a2948d7720e0293921b",
    "iq4_nl": "941f1b4c16eb29c3ceba0685c4cb18b743c3e2d511d0cd0a712e4b64fe847c03",
}


def golden_rows() -> np.ndarray:
    """16 rows of 256 float32 values from a 32-bit LCG (exact float32 arithmetic, so the same on every
    machine), with special blocks: zeros, small values, exact halves, q8_0 rounding ties, a negated
    block, a constant block, a block below GROUP_MAX_EPS (not the first of its row) and large values."""
    s, vals = 0x5EED1234, np.empty(16 * 256, dtype=np.int64)
    for i in range(vals.size):
        s = (s * 1664525 + 1013904223) & 0xFFFFFFFF
        vals[i] = s - (1 << 32) if s >= (1 << 31) else s
    x = ((vals.astype(np.float32) / np.float32(1 << 28)) * np.float32(1.8) - np.float32(0.9)).astype(np.float32)
    x = x.reshape(16, 256)
    x[1, 32:64] = 0.0
    x[2, 64:96] *= np.float32(1e-3)
    x[3, :32] = np.arange(32, dtype=np.float32) * np.float32(0.5) - np.float32(8.0)
    x[3, 32:64] = np.float32(127.0)
    x[3, 33:64] = (np.arange(31, dtype=np.float32) - 15) + np.float32(0.5)
    x[4, 32:64] = -x[4, 32:64]
    x[5, 64:96] = np.float32(0.25)
    x[6, 96:128] *= np.float32(1e-20)
    x[7] *= np.float32(50.0)
    return x


def random_rows(seed: int, n_rows: int = 400, width: int = 256) -> np.ndarray:
    """Normal rows with blocks of many scales, repeated maxima, ties and constant blocks; no block made
    only of zeros (gguf-py picks the sign of a zero scale differently from ggml, see below)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows * width // 32, 32)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-4, 3, size=(x.shape[0], 1))).astype(np.float32)
    x[1::9, :4] = x[1::9, :1].max()  # a repeated maximum
    x[2::9] = np.round(rng.standard_normal(x[2::9].shape) * 32).astype(np.float32) / 8  # exact eighths: ties
    x[3::9] = -np.abs(x[3::9])
    x[4::9] = np.float32(0.75)
    x[5::9, ::2] = 0.0
    return x.reshape(n_rows, width)


def q(name: str, x) -> np.ndarray:
    return CACHE_TYPES[name].quantize(torch.as_tensor(x)).numpy()


def dq(name: str, b) -> np.ndarray:
    return CACHE_TYPES[name].dequantize(torch.as_tensor(b)).numpy()


# ---- block bytes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", QTYPES)
def test_registered_with_ggml_block_sizes(name):
    t = cache_type(name)
    expected = {"q8_0": 34, "q4_0": 18, "iq4_nl": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24}[name]
    assert (t.block_size, t.block_bytes, t.is_quantized) == (32, expected, True)
    assert (t.block_size, t.block_bytes) == gguf.GGML_QUANT_SIZES[GGML_TYPE[name]]
    assert cache_type(name.upper()) is t
    x = torch.randn(3, 5, 128)
    b = t.quantize(x)
    assert b.dtype == torch.uint8 and b.shape == (3, 5, t.row_bytes(128))
    assert t.dequantize(b).shape == (3, 5, 128) and t.dequantize(b).dtype == torch.float32


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_is_byte_exact_with_gguf(name, seed):
    x = random_rows(seed)
    np.testing.assert_array_equal(q(name, x), gguf.quants.quantize(x, GGML_TYPE[name]))


@pytest.mark.parametrize("name", QTYPES)
def test_quantize_is_byte_exact_with_ggml(name):
    got = q(name, golden_rows())
    assert got.shape == (16, 8 * cache_type(name).block_bytes)
    assert hashlib.sha256(got.tobytes()).hexdigest() == GOLDEN[name]


@pytest.mark.parametrize("name", QTYPES)
def test_dequantize_is_exact_with_gguf(name):
    """Every code of every nibble / byte, under scales of many sizes and both signs."""
    rng = np.random.default_rng(5)
    t = cache_type(name)
    blocks = rng.integers(0, 256, size=(2000, t.block_bytes), dtype=np.uint8)
    n_scales = 2 if name in ("q4_1", "q5_1") else 1  # d, and m for the affine types
    scales = (rng.standard_normal((2000, n_scales)) * 10.0 ** rng.uniform(-4, 3, (2000, 1))).astype(np.float16)
    blocks[:, : 2 * n_scales] = scales.view(np.uint8)
    rows = blocks.reshape(200, -1)
    np.testing.assert_array_equal(dq(name, rows), gguf.quants.dequantize(rows, GGML_TYPE[name]))


def test_q8_0_rounds_halves_away_from_zero():
    """quantize_row_q8_0_ref uses roundf: with amax 127 (d = 1) the value 2.5 is stored as 3, -0.5 as -1."""
    x = np.zeros(32, dtype=np.float32)
    x[:5] = [127.0, 2.5, -0.5, 0.5, -3.5]
    b = q("q8_0", x)
    assert b[:2].view(np.float16)[0] == 1.0
    assert b[2:7].view(np.int8).tolist() == [127, 3, -1, 1, -4]


def test_nibble_and_high_bit_order():
    """Byte j of qs: value j in the low nibble, value j + 16 in the high one; q5's qh bit j = bit 4 of value j."""
    x = -np.arange(32, dtype=np.float32)  # q4_0: d = -31 / -8, q = round(x / d) + 8
    b = q("q4_0", x)
    codes = np.concatenate([b[2:] & 0x0F, b[2:] >> 4])
    d = np.float32(-31.0) / np.float32(-8.0)
    np.testing.assert_array_equal(codes, np.minimum(15, np.trunc(x * (np.float32(1) / d) + np.float32(8.5))).astype(np.uint8))
    b5 = q("q5_1", np.arange(32, dtype=np.float32))  # min 0, d = 1: code j = j
    qh = int.from_bytes(bytes(b5[4:8]), "little")
    codes5 = [(b5[8 + j % 16] >> (4 * (j // 16)) & 0x0F) | ((qh >> j & 1) << 4) for j in range(32)]
    assert codes5 == list(range(32))


@pytest.mark.parametrize(("name", "d_m_bytes"), [
    ("q4_0", [0x00, 0x80]),  # max stays +0.0 in ggml's scan, d = +0 / -8 = -0 (gguf-py: +0, from x[0] = -0)
    ("q5_0", [0x00, 0x80]),
    ("q4_1", [0x00, 0x00, 0x00, 0x80]),  # min = max = the first value, -0: d = +0, m = -0
    ("q5_1", [0x00, 0x00, 0x00, 0x80]),
    ("q8_0", [0x00, 0x00]),
])
def test_zero_block_scales_follow_ggml(name, d_m_bytes):
    """A block of zeros whose first value is -0.0: the sign of a zero scale as ggml's C code writes it
    (checked against ggml-quants.c); gguf-py differs here for all but q8_0."""
    x = np.zeros(32, dtype=np.float32)
    x[0] = -0.0
    assert q(name, x)[: len(d_m_bytes)].tolist() == d_m_bytes
    assert not dq(name, q(name, x)).any()


def iq4_nl_reference(block: np.ndarray) -> bytes:
    """quantize_row_iq4_nl_ref for one block that is not below GROUP_MAX_EPS, written out as the C code
    runs it (scalar float32, sequential sums)."""
    f = np.float32
    vals = [f(v) for v in quant.KVALUES_IQ4NL]

    def best_index(v):
        if v <= vals[0]:
            return 0
        if v >= vals[15]:
            return 15
        ml, mu = 0, 15
        while mu - ml > 1:
            mav = (ml + mu) // 2
            if v < vals[mav]:
                mu = mav
            else:
                ml = mav
        return mu - 1 if v - vals[mu - 1] < vals[mu] - v else mu

    amax, vmax = f(0), f(0)
    for v in block:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    d = vmax / vals[0]
    inv = f(1) / d
    sumqx, sumq2, idx = f(0), f(0), []
    for v in block:
        idx.append(best_index(inv * v))
        qv, w = vals[idx[-1]], v * v
        sumqx = f(sumqx + w * qv * v)
        sumq2 = f(sumq2 + w * qv * qv)
    d = sumqx / sumq2 if sumq2 > 0 else f(0)
    qs = [idx[j] | (idx[j + 16] << 4) for j in range(16)]
    return np.float16(d).tobytes() + bytes(qs)


def test_iq4_nl_matches_a_scalar_transliteration():
    x = random_rows(7, n_rows=8)
    got = q("iq4_nl", x).reshape(-1, 18)
    for i, block in enumerate(x.reshape(-1, 32)):
        assert got[i].tobytes() == iq4_nl_reference(block), f"block {i}"


def test_iq4_nl_tiny_blocks_are_zero_scaled():
    """max |x| < GROUP_MAX_EPS: d = 0 (ggml leaves the previous block's indices in qs; kvscope copies them)."""
    x = golden_rows()[6]
    b = q("iq4_nl", x).reshape(-1, 18)
    assert b[3, :2].tolist() == [0, 0] and b[3, 2:].tolist() == b[2, 2:].tolist()
    assert not dq("iq4_nl", b[3]).any()


# max |x - dequantize(quantize(x))| per block, in units of the block's max |x| (or range for q4_1/q5_1)
# (q4_0/q5_0: a full step where the code +8/+16 is clamped; iq4_nl: half the widest table gap, 12/127, and
# the least-squares scale; measured 0.108)
ROUND_TRIP_BOUND = {"q8_0": 0.5 / 127 + 2 ** -10, "q4_0": 1 / 8 + 2 ** -9, "q5_0": 1 / 16 + 2 ** -9,
                    "q4_1": 0.5 / 15 + 2 ** -9, "q5_1": 0.5 / 31 + 2 ** -9, "iq4_nl": 0.15}
# root-mean-square error on normal data, in units of the data's standard deviation (measured + margin)
# (measured: q8_0 0.0053, q5_1 0.038, q5_0 0.043, q4_1 0.078, iq4_nl 0.079, q4_0 0.085)
ROUND_TRIP_RMS = {"q8_0": 0.007, "q5_1": 0.05, "q5_0": 0.055, "q4_1": 0.1, "q4_0": 0.11, "iq4_nl": 0.1}


@pytest.mark.parametrize("name", QTYPES)
def test_round_trip_error_bounds(name):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((256, 32)) * 10.0 ** rng.uniform(-3, 3, (256, 1))).astype(np.float32)
    err = np.abs(dq(name, q(name, x)) - x)
    span = (x.max(1) - x.min(1)) if name in ("q4_1", "q5_1") else np.abs(x).max(1)
    assert (err.max(1) <= ROUND_TRIP_BOUND[name] * span).all()
    z = rng.standard_normal((64, 1024)).astype(np.float32)
    rms = float(np.sqrt(((dq(name, q(name, z)) - z) ** 2).mean()))
    assert rms < ROUND_TRIP_RMS[name]


def test_round_trip_ordering():
    z = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    rms = {n: float(np.sqrt(((dq(n, q(n, z)) - z) ** 2).mean())) for n in QTYPES}
    assert rms["q8_0"] < rms["q5_1"] < rms["q4_1"]
    assert rms["q5_0"] < rms["q4_0"] and rms["iq4_nl"] < rms["q4_0"]


def test_quantize_is_idempotent_on_its_own_output():
    """Re-quantizing dequantized q8_0 / q4_0 rows gives the same bytes (the K-shift relies on nothing
    like this, but a stable grid is a cheap check of scale handling)."""
    x = random_rows(2, n_rows=16)
    for name in ("q8_0", "q4_0"):
        b = q(name, x)
        np.testing.assert_array_equal(q(name, dq(name, b)), b)


# ---- sizes and init lines (llama_kv_cache's constructor) -----------------------------------------------------
def layout(type_k: str, type_v: str) -> CacheLayout:
    """A Llama-3-8B-sized cache: 32 layers, 8 KV heads x 128, 4096 cells, 1 sequence, flash attention on."""
    return CacheLayout(layer_ids=tuple(range(32)), n_embd_k=1024, n_embd_v=1024, n_head_kv=8, head_dim=128,
                       kv_size=4096, n_stream=1, n_seq_max=1, type_k=cache_type(type_k),
                       type_v=cache_type(type_v), v_trans=False)


@pytest.mark.parametrize(("name", "mib"), [
    ("f32", "512.00"), ("f16", "256.00"), ("bf16", "256.00"), ("q8_0", "136.00"), ("q4_0", " 72.00"),
    ("iq4_nl", " 72.00"), ("q4_1", " 80.00"), ("q5_0", " 88.00"), ("q5_1", " 96.00"),
])
def test_init_lines_for_every_type(name, mib):
    total = f"{2 * float(mib):7.2f}"
    assert layout(name, name).init_log_lines() == [
        f"llama_kv_cache:        CPU KV buffer size = {total:>8s} MiB",
        f"llama_kv_cache: size = {total} MiB (  4096 cells,  32 layers,  1/1 seqs), "
        f"K ({name}): {mib:>7s} MiB, V ({name}): {mib:>7s} MiB",
    ]


def test_init_line_of_a_q8_0_k_with_an_f16_v():
    assert layout("q8_0", "f16").init_log_lines()[1] == (
        "llama_kv_cache: size =  392.00 MiB (  4096 cells,  32 layers,  1/1 seqs), "
        "K (q8_0):  136.00 MiB, V (f16):  256.00 MiB")


@pytest.mark.parametrize("name", QTYPES)
def test_storage_holds_the_block_bytes(name):
    model = in_memory_model(n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=64)
    ctx = engine.Context(model, n_ctx=256, type_k=name, type_v=name)
    t = cache_type(name)
    for rows in ctx.memory.k + ctx.memory.v:
        assert rows.data.dtype == torch.uint8 and rows.nbytes == 256 * t.block_bytes
        assert rows.stored_rows(0, torch.arange(256)).shape == (256, t.block_bytes)  # llama.cpp's rows
    assert ctx.memory.k_bytes() == ctx.memory.v_bytes() == 2 * 256 * t.block_bytes
    mib = f"{2 * 256 * t.block_bytes / 2 ** 20:7.2f}"
    assert ctx.init_log_lines[-1].endswith(f"K ({name}): {mib} MiB, V ({name}): {mib} MiB")


# ---- validation (llama_init_from_model) ---------------------------------------------------------------------
def resolve(**kw):
    base = dict(n_ctx_train=4096, n_ctx=512, n_batch=2048, n_ubatch=512, n_seq_max=1, kv_unified=False, pad=256,
                type_k="f16", type_v="f16", flash_attn="auto", swa_full=False)
    base.update(kw)
    return ContextParams.resolve(**base)


@pytest.mark.parametrize("name", QTYPES)
def test_quantized_v_with_flash_attn_off_fails(name):
    with pytest.raises(ContextParamsError, match="quantized V cache requires flash_attn") as e:
        resolve(type_v=name, flash_attn="off")
    assert name in str(e.value) and "flash_attn='auto'" in str(e.value)


@pytest.mark.parametrize("name", QTYPES)
def test_quantized_v_forces_flash_attn_on(name, caplog):
    p = resolve(type_v=name, flash_attn="auto", head_dims=(64,) * 4)
    assert (p.flash_attn, p.v_trans) == ("on", False)
    assert resolve(type_v=name, flash_attn="on").flash_attn == "on"
    # the context says so after the model's load_tensors lines, where llama_init_from_model says it
    model = in_memory_model(n_embd=64, n_head=1, n_head_kv=1, head_dim=64)
    with caplog.at_level("INFO", logger="kvscope"):
        engine.Context(model, n_ctx=256, type_v=name)
    lines = caplog.messages
    note = lines.index("llama_init_from_model: enabling flash_attn since it is required for quantized V cache")
    assert note > max(i for i, line in enumerate(lines) if line.startswith("load_tensors:"))
    assert note < lines.index("llama_context: constructing llama_context")


def test_quantized_k_alone_keeps_the_requested_flash_attn():
    assert (resolve(type_k="q4_0", flash_attn="off").flash_attn, resolve(type_k="q4_0", flash_attn="off").v_trans) \
        == ("off", True)
    assert resolve(type_k="q4_0", flash_attn="auto").flash_attn == "auto"
    assert resolve(type_k="q4_0", flash_attn="off", head_dims=(48,)).flash_attn == "off"  # no check with FA off


@pytest.mark.parametrize(("kw", "message"), [
    (dict(type_k="q8_0"), "K cache type q8_0 with block size 32 does not divide n_embd_head_k=48"),
    (dict(type_k="q4_0", flash_attn="on"), "K cache type q4_0 with block size 32 does not divide n_embd_head_k=48"),
    (dict(type_v="iq4_nl"), "V cache type iq4_nl with block size 32 does not divide n_embd_head_v=48"),
    (dict(type_k="f16", type_v="q5_1"), "V cache type q5_1 with block size 32 does not divide n_embd_head_v=48"),
])
def test_head_size_must_be_a_multiple_of_the_block(kw, message):
    with pytest.raises(ContextParamsError, match=message) as e:
        resolve(head_dims=(64, 48), **kw)
    assert "f16" in str(e.value)  # names the fix


def test_context_checks_the_model_head_size():
    model = in_memory_model()  # head_dim 8
    with pytest.raises(ContextParamsError, match="does not divide n_embd_head_k=8"):
        engine.Context(model, n_ctx=256, type_k="q8_0", type_v="f16")
    with pytest.raises(ContextParamsError, match="quantized V cache requires flash_attn"):
        engine.Context(model, n_ctx=256, type_v="q8_0", flash_attn="off")


# ---- decoding through a quantized cache ------------------------------------------------------------------------
MODEL = in_memory_model(n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=64, n_vocab=64)
TOKENS = torch.randint(0, 64, (48,), generator=torch.Generator().manual_seed(0)).tolist()


def decode_logits(type_k: str, type_v: str, flash_attn: str = "auto", model=MODEL) -> tuple[engine.Context, torch.Tensor]:
    """A 40-token prompt, then 8 single-token decodes; the logits of every position."""
    ctx = engine.Context(model, n_ctx=256, type_k=type_k, type_v=type_v, flash_attn=flash_attn)
    assert ctx.decode(engine.Batch(tokens=TOKENS[:40], pos=list(range(40)), seq_ids=[[0]] * 40, logits=[True] * 40)) == 0
    out = [ctx.all_logits().clone()]
    for i in range(40, 48):
        assert ctx.decode(engine.Batch(tokens=[TOKENS[i]], pos=[i], seq_ids=[[0]], logits=[True])) == 0
        out.append(ctx.all_logits().clone())
    return ctx, torch.cat(out)


@pytest.fixture(scope="module")
def f32_run():
    return decode_logits("f32", "f32")


# |logits - f32-cache logits| on MODEL (logit std 1.1), max and mean over 48 positions x 64 tokens
# (measured max: q8_0 0.088, q5_1 0.83, iq4_nl 1.07, q4_1 1.05, q5_0 1.28, q4_0 1.42; mean: q8_0 0.013,
# q5 0.10, 4-bit types 0.18; llama.cpp on its tiny llama: q8_0 0.047, q4_0 0.58)
LOGIT_MAX = {"q8_0": 0.2, "q5_1": 1.5, "q5_0": 2.0, "q4_1": 2.0, "q4_0": 2.2, "iq4_nl": 2.0}
LOGIT_MEAN = {"q8_0": 0.03, "q5_1": 0.2, "q5_0": 0.2, "q4_1": 0.35, "q4_0": 0.35, "iq4_nl": 0.35}
# relative RMS error of layer 0's cached K and V rows (same inputs in both runs) against the f32 cache's
# (measured: q8_0 0.0056, q5_1 0.038, q5_0 0.044, q4_1 0.079, iq4_nl 0.081, q4_0 0.089)
ROW_BOUND = {"q8_0": 0.008, "q5_1": 0.05, "q5_0": 0.055, "q4_1": 0.1, "q4_0": 0.11, "iq4_nl": 0.1}


@pytest.mark.parametrize("name", QTYPES)
def test_quantized_cache_decodes_close_to_f32(name, f32_run):
    ref_ctx, ref = f32_run
    ctx, logits = decode_logits(name, name)
    assert ctx.params.flash_attn == "on" and not ctx.params.v_trans
    assert float((logits - ref).abs().max()) < LOGIT_MAX[name]
    assert float((logits - ref).abs().mean()) < LOGIT_MEAN[name]
    # layer 0's rows in the cache are the f32 run's rows up to the type's rounding
    for mine, theirs in ((ctx.memory.k[0], ref_ctx.memory.k[0]), (ctx.memory.v[0], ref_ctx.memory.v[0])):
        a, b = mine.read(slice(0, 1), 48, torch.float32), theirs.read(slice(0, 1), 48, torch.float32)
        assert float((a - b).norm() / b.norm()) < ROW_BOUND[name]


@pytest.mark.parametrize("name", QTYPES)
def test_quantized_k_with_f16_v_and_flash_attn_off(name, f32_run):
    """Quantized K alone needs no flash attention; V is then transposed f16."""
    ctx, logits = decode_logits(name, "f16", flash_attn="off")
    assert ctx.params.v_trans and ctx.memory.v[0].transposed
    assert float((logits - f32_run[1]).abs().max()) < LOGIT_MAX[name]
    assert float((logits - f32_run[1]).abs().mean()) < LOGIT_MEAN[name]


def test_quantized_cache_is_not_the_f16_cache(f32_run):
    """Guard against a type that silently falls back to float storage."""
    _, f16 = decode_logits("f16", "f16")
    _, q4 = decode_logits("q4_0", "q4_0")
    assert float((f16 - f32_run[1]).abs().max()) < 0.02 < float((q4 - f32_run[1]).abs().max())


# ---- K-shift on quantized keys (llama_kv_cache::update) -------------------------------------------------------
@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_1", "iq4_nl"])
def test_k_shift_requantizes_the_roped_keys(name):
    model = in_memory_model(n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64)
    ctx = engine.Context(model, n_ctx=256, type_k=name, type_v=name)
    assert ctx.decode(engine.Batch(tokens=TOKENS[:20], pos=list(range(20)), seq_ids=[[0]] * 20, logits=[False] * 20)) == 0
    mem = ctx.memory
    every_cell = torch.arange(256)
    old_k = [rows.stored_rows(0, every_cell).clone() for rows in mem.k]
    old_v = [rows.stored_rows(0, every_cell).clone() for rows in mem.v]
    mem.seq_rm(0, 2, 5)
    mem.seq_add(0, 5, -1, -3)
    shifted = torch.arange(5, 20)
    assert [c[0] for c in mem.cells()[:20]] == [0, 1, -1, -1, -1] + list(range(2, 17))

    rotary = model.transformer.rotary
    t = cache_type(name)
    expected = []
    for il, k in enumerate(old_k):
        keys = t.dequantize(k[shifted]).view(-1, 2, 32)
        delta = torch.full((len(shifted),), -3, dtype=torch.int64)
        expected.append(t.quantize(rotary.shift_keys(il, keys, delta).reshape(len(shifted), -1)))

    assert ctx.decode(engine.Batch(tokens=[TOKENS[20]], pos=[17], seq_ids=[[0]], logits=[True])) == 0
    new_cell = 2  # the first free cell
    for il in range(len(mem.k)):
        data = mem.k[il].stored_rows(0, every_cell)
        assert torch.equal(data[shifted], expected[il]), f"layer {il}"
        assert not torch.equal(data[shifted], old_k[il][shifted])
        assert torch.equal(data[:2], old_k[il][:2])  # not shifted, not rewritten
        assert not torch.equal(data[new_cell], old_k[il][new_cell])  # the new token's key
        keep = torch.tensor([0, 1] + shifted.tolist())
        assert torch.equal(mem.v[il].stored_rows(0, every_cell)[keep], old_v[il][keep])  # V is never touched
    assert all(c[2] == 0 for c in mem.cells())


def test_cell_state_does_not_depend_on_the_cache_type():
    def trace(type_k, type_v):
        ctx = engine.Context(MODEL, n_ctx=256, n_seq_max=2, kv_unified=True, type_k=type_k, type_v=type_v)
        mem, states = ctx.memory, []
        assert ctx.decode(engine.Batch(tokens=TOKENS[:12], pos=list(range(6)) * 2, seq_ids=[[0]] * 6 + [[1]] * 6,
                                       logits=[False] * 11 + [True])) == 0
        states.append((mem.cells(), mem.head(), mem.used()))
        mem.seq_cp(0, 1, 0, 3)
        mem.seq_rm(1, 3, -1)
        mem.seq_add(0, 2, -1, 5)
        states.append((mem.cells(), mem.head(), mem.used()))
        assert ctx.decode(engine.Batch(tokens=TOKENS[12:15], pos=[11, 12, 13], seq_ids=[[0]] * 3, logits=[True] * 3)) == 0
        mem.seq_div(0, 0, -1, 2)
        states.append((mem.cells(), mem.head(), mem.used(), mem.seq_pos_min(0), mem.seq_pos_max(0)))
        return states

    ref = trace("f32", "f32")
    for name in QTYPES:
        assert trace(name, name) == ref
        assert trace(name, "f16") == ref
