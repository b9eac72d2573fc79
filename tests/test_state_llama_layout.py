"""K rows in state data are laid out as llama.cpp lays them out, so that states cross between the engines.

llama.cpp's convert_hf_to_gguf permutes the Q and K weight rows of llama-family models (llama, and
Mistral, which it writes as llama): per head, Hugging Face row i becomes row 2i and row i + d/2 becomes
row 2i + 1, and llama.cpp then rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM). A key row llama.cpp caches
is therefore, per KV head, the Hugging Face key with its dims in the order 0, d/2, 1, d/2 + 1, ...
qwen2 and Gemma are converted unpermuted and rotated as Hugging Face does (LLAMA_ROPE_TYPE_NEOX).

The reference keys and values come from transformers (the model's own Hugging Face implementation),
reordered here with the converter's rule; the states "as llama.cpp writes them" are framed here as
src/llama-kv-cache.cpp state_write_meta/state_write_data and llama_state_seq_save_file write them,
with ggml's quantization from the gguf package, not with kvscope's writer or quantizers.
"""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import engine
from engine import Batch, Context
from engine.kv.state import caches_of
from engine.models.config import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from engine.rope import Rotary, to_norm_order
from engine.testing import write_gguf_from_hf, write_hf_model
from tests.model_factory import tiny_config
from tests.test_state import Parser

PROMPT = [1, 17, 42, 5, 99, 23, 8]  # shorter than the sliding windows (8) of the mistral and gemma fixtures
NEXT = 61
GGML_TYPE = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}  # ggml.h enum ggml_type
STATE_SEQ_FILE_MAGIC, STATE_SEQ_FILE_VERSION = 0x67677371, 2  # include/llama.h LLAMA_STATE_SEQ_MAGIC/VERSION


# ---- references --------------------------------------------------------------------------------------
def hf_keys_values(folder: Path, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (post-RoPE keys, values) as [T, n_head_kv, head_dim] from transformers' own forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values
    return [(layer.keys[0].transpose(0, 1).clone(), layer.values[0].transpose(0, 1).clone())
            for layer in cache.layers]


def llama_cpp_key_rows(keys: torch.Tensor) -> torch.Tensor:
    """Hugging Face keys [T, n_head_kv, D] -> the K rows llama.cpp caches [T, n_head_kv * D]: per head,
    HF dim i goes to 2i and dim i + D/2 to 2i + 1 (convert_hf_to_gguf LlamaModel.permute)."""
    t, h, d = keys.shape
    out = torch.empty_like(keys)
    out[..., 0::2] = keys[..., : d // 2]
    out[..., 1::2] = keys[..., d // 2:]
    return out.reshape(t, h * d)


def ggml_rows(rows: torch.Tensor, type_name: str) -> bytes:
    """Rows [T, n] stored as ggml stores them in a tensor of type_name (quantized: gguf's reference
    quantization, blocks of 32 along the row)."""
    a = np.ascontiguousarray(rows.numpy(), dtype=np.float32)
    if type_name == "f32":
        return a.astype("<f4").tobytes()
    if type_name == "f16":
        return a.astype("<f2").tobytes()
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[type_name.upper()]).tobytes()


def ggml_values(raw: bytes, type_name: str, n_cells: int) -> torch.Tensor:
    """Rows of a state's layer back to float32 [n_cells, n] (gguf's dequantization)."""
    if type_name == "f32":
        return torch.from_numpy(np.frombuffer(raw, dtype="<f4").reshape(n_cells, -1).copy())
    if type_name == "f16":
        return torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(n_cells, -1))
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(n_cells, -1)
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name.upper()]).copy())


def llama_cpp_slot_file(tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], type_k: str,
                        type_v: str) -> bytes:
    """A slot file as llama-server saves one sequence with llama_state_seq_save_file: 'ggsq', version,
    the tokens, then llama_kv_cache::state_write of one stream holding the cells 0..T-1 of seq 0: cell
    metadata (pos, 1 seq id, the id), v_trans 0, n_layer, then per layer (type, row size, K rows) and
    the same for V. K rows in llama.cpp's layout."""
    n = len(tokens)
    out = bytearray(struct.pack("<III", STATE_SEQ_FILE_MAGIC, STATE_SEQ_FILE_VERSION, n))
    out += struct.pack(f"<{n}i", *tokens)
    out += struct.pack("<II", 1, n)  # n_stream, cell_count
    for pos in range(n):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<II", 0, len(kv))
    for rows, type_name in [(llama_cpp_key_rows(k), type_k) for k, _ in kv] + \
                           [(v.reshape(n, -1), type_v) for _, v in kv]:
        data = ggml_rows(rows, type_name)
        out += struct.pack("<iQ", GGML_TYPE[type_name], len(data) // n) + data
    return bytes(out)


# ---- kvscope ---------------------------------------------------------------------------------------------
def new_ctx(model, type_k: str = "f32", type_v: str | None = None) -> Context:
    return Context(model, n_ctx=32, pad=32, n_seq_max=1, type_k=type_k, type_v=type_v or type_k, flash_attn="on")


def decode(ctx: Context, tokens: list[int], start: int) -> torch.Tensor:
    """Decode tokens at positions start.. in seq 0; the last token's logits."""
    rc = ctx.decode(Batch(list(tokens), list(range(start, start + len(tokens))), [[0]] * len(tokens)))
    assert rc == 0, ctx.last_error
    return ctx.logits(-1).clone()


def uninterrupted(model, type_k: str, type_v: str | None = None, start: int = 0) -> torch.Tensor:
    """The logits after NEXT when PROMPT and NEXT are decoded in one context from position start."""
    ctx = new_ctx(model, type_k, type_v)
    decode(ctx, PROMPT, start)
    return decode(ctx, [NEXT], start + len(PROMPT))


def state_layers(ctx: Context, data: bytes) -> tuple[list, list]:
    """(K, V) of a sequence state of ctx with one stream, in model layer order: per layer (ggml type id,
    row bytes, rows). An iSWA memory saves its base cache, then its SWA cache, each with its layers."""
    p = Parser(data)
    p.take("Ii")  # the in-memory sequence state's magic and seq id
    by_layer = {}
    for cache in caches_of(ctx.memory):
        (stream,) = p.cache()
        assert stream["v_trans"] == 0
        by_layer.update(zip(cache.layout.layer_ids, zip(stream["k"], stream["v"])))
    assert p.off == len(data) and sorted(by_layer) == list(range(ctx.model.config.n_layer))
    return [by_layer[il][0] for il in sorted(by_layer)], [by_layer[il][1] for il in sorted(by_layer)]


# ---- fixtures --------------------------------------------------------------------------------------------
class Llama:
    """A llama with 2 query heads sharing 1 KV head of 64 dims, loaded from its GGUF (Q/K unpermuted by
    the reader) and from its Hugging Face folder, and the keys and values transformers computes for
    PROMPT. Quantized K caches need heads of whole 32-value blocks; with 64 dims a block lies inside
    one head, where it holds other values in llama.cpp's layout than in the Hugging Face one."""

    def __init__(self, tmp_path_factory, n_layer: int) -> None:
        name = f"llama-{n_layer}l"
        self.folder = write_hf_model(tmp_path_factory.mktemp("hf") / name, "llama", n_layer=n_layer, n_embd=128,
                                     n_head=2, n_head_kv=1, n_ff=128, vocab_size=512, seed=7)
        gguf_path = write_gguf_from_hf(self.folder, tmp_path_factory.mktemp("gguf") / f"{name}.gguf")
        self.models = {"gguf": engine.load_model(gguf_path), "hf": engine.load_model(self.folder)}
        self.kv = hf_keys_values(self.folder, PROMPT)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """Llama by layer count. With one layer every K row depends only on its token and position, so the
    f32 keys transformers computes are the ones a quantized cache quantizes; deeper layers' keys
    depend on the precision of the cache below them."""
    made: dict[int, Llama] = {}

    def get(n_layer: int) -> Llama:
        if n_layer not in made:
            made[n_layer] = Llama(tmp_path_factory, n_layer)
        return made[n_layer]

    return get


# ---- the rotation in llama.cpp's layout ------------------------------------------------------------------
def test_norm_rope_on_reordered_rows_is_neox_rope_reordered():
    """llama.cpp's pairing on rows in the converter's order gives, bit for bit, Hugging Face's rotation
    in Hugging Face's order, reordered: the same products, in every compute dtype, at any position."""
    cfg = tiny_config(n_embd=64, n_head=4, n_head_kv=2, head_dim=16)
    assert cfg.rope_type == ROPE_TYPE_NORM
    norm, neox = Rotary(cfg), Rotary(dataclasses.replace(cfg, arch="qwen2"))
    assert neox.rope_type == ROPE_TYPE_NEOX
    x = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 17, -5, 300, 2047])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ours = Rotary.apply(llama_cpp_key_rows(x.to(dtype)).view(6, 4, 16), *norm.cos_sin(pos, dtype))
        theirs = llama_cpp_key_rows(Rotary.apply(x.to(dtype), *neox.cos_sin(pos, dtype)))
        assert torch.equal(ours.reshape(6, -1), theirs), dtype
    keys = llama_cpp_key_rows(x).view(6, 4, 16)
    delta = torch.tensor([3, -2, 0, 9, -300, 1])
    cos, sin = norm.cos_sin(pos, torch.float32)
    moved = norm.shift_keys(0, Rotary.apply(keys, cos, sin), delta)
    # composed rotations agree to float32 rounding of angles up to ~2000 rad
    torch.testing.assert_close(moved, Rotary.apply(keys, *norm.cos_sin(pos + delta, torch.float32)), rtol=0, atol=1e-4)


def test_forward_pass_rotation_is_apply_bit_for_bit():
    """The forward pass turns Q and K with the tables broadcast once per ubatch (float32 NORM pairs as
    one complex product): exactly what Rotary.apply gives, which the K-shift and the tests above use."""
    for arch, dtype in [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32)]:
        rotary = Rotary(dataclasses.replace(tiny_config(n_embd=64, n_head=4, n_head_kv=2, head_dim=16), arch=arch))
        pos = torch.tensor([0, 1, 17, 300, 2047, 5])
        x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)).to(dtype)[:, :6 * 16].view(6, 6, 16)  # a strided slice
        cos, sin = rotary.cos_sin(pos, dtype)
        tables = Rotary.broadcast_tables(cos, sin)
        assert (tables[1] is None) == (arch == "llama" and dtype == torch.float32)
        assert torch.equal(Rotary.turn(x, *tables), Rotary.apply(x, cos, sin)), (arch, dtype)


def test_weight_rows_follow_the_converters_permutation():
    """to_norm_order is convert_hf_to_gguf's LlamaModel.permute: the key rows it yields are the keys
    with their dims reordered as llama_cpp_key_rows reorders them."""
    w = torch.randn(2 * 16, 8, generator=torch.Generator().manual_seed(1))  # 2 heads of 16 rows
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(x @ to_norm_order(w, 2).T, llama_cpp_key_rows((x @ w.T).view(3, 2, 16)))
    with pytest.raises(ValueError, match="heads of an even size"):
        to_norm_order(torch.randn(2 * 15, 8), 2)


def test_partial_rotary_is_refused():
    """Per-pair frequency factors for fewer dims than a head has mean llama.cpp's n_rot < head_dim,
    which kvscope does not run: refused rather than rotating the wrong dims."""
    cfg = tiny_config(extra={"rope_freqs": torch.ones(2)})  # heads of 8 dims have 4 pairs
    with pytest.raises(ValueError, match="partial rotary"):
        Rotary(cfg)


# ---- the layout of K rows in kvscope's states --------------------------------------------------------------
@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_llama_key_rows_in_a_state_are_llama_cpps(llamas, source):
    llama = llamas(2)
    ctx = new_ctx(llama.models[source])
    decode(ctx, PROMPT, 0)
    k_layers, v_layers = state_layers(ctx, ctx.state_seq_get_data(0))
    for (_, _, k_raw), (_, _, v_raw), (keys, values) in zip(k_layers, v_layers, llama.kv):
        torch.testing.assert_close(ggml_values(k_raw, "f32", len(PROMPT)), llama_cpp_key_rows(keys),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(ggml_values(v_raw, "f32", len(PROMPT)), values.reshape(len(PROMPT), -1),
                                   rtol=0, atol=1e-5)


def test_mistral_folder_key_rows_are_llama_cpps(tiny_mistral_hf):
    """llama.cpp converts Mistral as llama, permuted: a state of the Hugging Face folder must be too."""
    ctx = new_ctx(engine.load_model(tiny_mistral_hf))
    decode(ctx, PROMPT, 0)
    k_layers, _ = state_layers(ctx, ctx.state_seq_get_data(0))
    for (_, _, k_raw), (keys, _) in zip(k_layers, hf_keys_values(tiny_mistral_hf, PROMPT)):
        torch.testing.assert_close(ggml_values(k_raw, "f32", len(PROMPT)), llama_cpp_key_rows(keys),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("type_k", ["q8_0", "q4_0"])
def test_quantized_key_rows_are_llama_cpps_blocks(llamas, type_k):
    """A quantized K row holds ggml's quantization of the key in llama.cpp's layout: blocks of 32 of the
    permuted row, with their own scales, which no permutation of Hugging Face-layout blocks gives."""
    llama = llamas(1)
    ctx = new_ctx(llama.models["gguf"], type_k)
    decode(ctx, PROMPT, 0)
    (tid, row_bytes, k_raw), = state_layers(ctx, ctx.state_seq_get_data(0))[0]
    rows = llama_cpp_key_rows(llama.kv[0][0])
    expected = ggml_rows(rows, type_k)
    assert (tid, row_bytes) == (GGML_TYPE[type_k], len(expected) // len(PROMPT))
    # The keys agree to float rounding, so the blocks agree but for a value on a rounding edge.
    got, want = (ggml_values(raw, type_k, len(PROMPT)) for raw in (k_raw, expected))
    assert (got != want).float().mean() < 0.01
    step = rows.abs().max() / (127 if type_k == "q8_0" else 7)
    torch.testing.assert_close(got, want, rtol=0, atol=float(step) * 1.01)


@pytest.mark.parametrize("folder_fixture", ["tiny_qwen2_hf", "tiny_gemma3_hf"])
def test_key_rows_of_unpermuted_archs_stay_hugging_faces(request, folder_fixture):
    """qwen2 and Gemma are converted without the permutation and rotated as Hugging Face does: their
    K rows are the Hugging Face keys as they are."""
    folder = request.getfixturevalue(folder_fixture)
    ctx = new_ctx(engine.load_model(folder))
    decode(ctx, PROMPT, 0)
    k_layers, v_layers = state_layers(ctx, ctx.state_seq_get_data(0))
    for (_, _, k_raw), (_, _, v_raw), (keys, values) in zip(k_layers, v_layers, hf_keys_values(folder, PROMPT)):
        torch.testing.assert_close(ggml_values(k_raw, "f32", len(PROMPT)), keys.reshape(len(PROMPT), -1),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(ggml_values(v_raw, "f32", len(PROMPT)), values.reshape(len(PROMPT), -1),
                                   rtol=0, atol=1e-5)


# ---- states written by llama.cpp, loaded in kvscope ----------------------------------------------------------
# (cache type, layers, tolerance): quantized caches on one layer, whose keys the f32 reference gives exactly
SLOT_CASES = [("f32", 2, 1e-4), ("f16", 2, 2e-3), ("q8_0", 1, 1e-3), ("q4_0", 1, 1e-3)]


@pytest.mark.parametrize("source", ["gguf", "hf"])
@pytest.mark.parametrize("type_k, n_layer, atol", SLOT_CASES)
def test_llama_cpp_slot_file_continues_with_the_same_logits(llamas, tmp_path, source, type_k, n_layer, atol):
    llama = llamas(n_layer)
    model = llama.models[source]
    path = tmp_path / "slot.bin"
    path.write_bytes(llama_cpp_slot_file(PROMPT, llama.kv, type_k, type_k))
    ctx = new_ctx(model, type_k)
    assert ctx.state_seq_load_file(path, 0) == PROMPT
    assert [c[0] for c in ctx.memory.cells()[:len(PROMPT) + 1]] == list(range(len(PROMPT))) + [-1]
    torch.testing.assert_close(decode(ctx, [NEXT], len(PROMPT)), uninterrupted(model, type_k), rtol=0, atol=atol)


def test_llama_cpp_slot_file_then_a_k_shift(llamas, tmp_path):
    """The K-shift turns keys of llama.cpp's layout: a loaded state moved by 3 positions continues as
    the prompt decoded 3 positions later does (RoPE makes attention depend on relative positions only)."""
    llama = llamas(2)
    model = llama.models["gguf"]
    path = tmp_path / "slot.bin"
    path.write_bytes(llama_cpp_slot_file(PROMPT, llama.kv, "f32", "f32"))
    ctx = new_ctx(model)
    ctx.state_seq_load_file(path, 0)
    ctx.memory.seq_add(0, 0, -1, 3)
    moved = decode(ctx, [NEXT], len(PROMPT) + 3)
    torch.testing.assert_close(moved, uninterrupted(model, "f32", start=3), rtol=0, atol=1e-4)


# ---- kvscope's own round trip ----------------------------------------------------------------------------------
@pytest.mark.parametrize("type_k, n_layer", [("f32", 2), ("f16", 2), ("q8_0", 1)])
def test_llama_round_trip(llamas, type_k, n_layer):
    """kvscope -> state (llama.cpp's layout) -> kvscope continues exactly as the source context."""
    llama = llamas(n_layer)
    src = new_ctx(llama.models["gguf"], type_k)
    decode(src, PROMPT, 0)
    data = src.state_seq_get_data(0)
    k_layers, _ = state_layers(src, data)
    for (_, _, k_raw), (keys, _) in zip(k_layers, llama.kv):
        expected = ggml_values(ggml_rows(llama_cpp_key_rows(keys), type_k), type_k, len(PROMPT))
        got = ggml_values(k_raw, type_k, len(PROMPT))
        step = 1e-5 if type_k == "f32" else float(expected.abs().max()) / 127  # f16: ~1/1024 relative
        torch.testing.assert_close(got, expected, rtol=0, atol=step)
    dst = new_ctx(llama.models["hf"], type_k)
    assert dst.state_seq_set_data(data, 0) == len(data)
    assert dst.state_seq_get_data(0) == data
    assert torch.equal(decode(dst, [NEXT], len(PROMPT)), decode(src, [NEXT], len(PROMPT)))


# ---- whole-context states carry llama.cpp's arch name ------------------------------------------------------------
def test_mistral_folder_and_its_gguf_share_whole_states(tmp_path_factory):
    """llama.cpp runs a converted Mistral as 'llama' and names its states so; a Mistral folder without a
    sliding window (a plain cache, as llama.cpp's) writes and accepts those states too."""
    folder = write_hf_model(tmp_path_factory.mktemp("hf") / "mistral-full", "mistral", sliding_window=None,
                            n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, vocab_size=512, seed=5)
    gguf_path = write_gguf_from_hf(folder, tmp_path_factory.mktemp("gguf") / "mistral-full.gguf")
    models = [engine.load_model(folder), engine.load_model(gguf_path)]
    assert [m.config.arch for m in models] == ["mistral", "llama"]
    for src_model, dst_model in (models, models[::-1]):
        src = new_ctx(src_model)
        decode(src, PROMPT, 0)
        data = src.state_get_data()
        assert data[:9] == struct.pack("<I", 5) + b"llama"
        dst = new_ctx(dst_model)
        assert dst.state_set_data(data) == len(data)
        torch.testing.assert_close(decode(dst, [NEXT], len(PROMPT)), decode(src, [NEXT], len(PROMPT)),
                                   rtol=0, atol=1e-5)
