"""States cross between llama.cpp and kvscope, checked against llama.cpp itself through llama-cpp-python's
low-level API (skipped when llama_cpp cannot be imported).

A llama whose heads have 64 dims (so that a quantization block lies inside one head) is run in both
engines from the same GGUF. One engine decodes a prompt and saves its state, the other loads it and
decodes one more token; the logits must match those of the saving engine as well as the two engines
match without any state transfer. Before kvscope kept K rows in llama.cpp's layout this gave a
max |dlogit| of about 1.7 in both directions.

llama.cpp rotates Q, K and V by a Walsh-Hadamard matrix before storing them when the cache type is
quantized and the head size a multiple of 64 (llama_kv_cache attn_rot_k/attn_rot_v,
src/llama-kv-cache.cpp). kvscope does not, so quantized states cross only with that rotation off:
the tests set LLAMA_ATTN_ROT_DISABLE=1 for them.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest
import torch

import engine
from engine import Batch, Context
from engine.testing import write_gguf_from_hf, write_hf_model
from tests.test_state import Parser

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36 builds llama.cpp)")

PROMPT = [1, 17, 42, 5, 99, 23, 8]
NEXT = 61
N_CTX = 256  # llama.cpp pads n_ctx to 256 cells; kvscope gets the same size
GGML_TYPE = {"f32": 0, "f16": 1, "q8_0": 8}  # ggml.h enum ggml_type
FLASH_ATTN = {"on": 1, "off": 0}  # llama.h enum llama_flash_attn_type
CASES = [("f32", "off"), ("f32", "on"), ("f16", "off"), ("f16", "on"), ("q8_0", "on")]
# llama.cpp keeps the log callback for the life of the process, so the callback lives as long
_QUIET_LOG = llama_cpp.llama_log_callback(lambda level, text, user_data: None)


class LlamaCpp:
    """One llama.cpp model and the contexts made from it, freed together."""

    def __init__(self, gguf_path) -> None:
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_QUIET_LOG, ctypes.c_void_p())
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
        assert self.model, "llama.cpp could not load the GGUF"
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self._contexts: list = []

    def context(self, type_kv: str, flash_attn: str):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = N_CTX
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = 2
        params.type_k = params.type_v = GGML_TYPE[type_kv]
        params.flash_attn_type = FLASH_ATTN[flash_attn]
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        assert ctx, "llama.cpp could not create the context"
        self._contexts.append(ctx)
        return ctx

    def decode(self, ctx, tokens: list[int], start: int) -> torch.Tensor:
        """Decode tokens at positions start.. in seq 0; the last token's logits."""
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            assert llama_cpp.llama_decode(ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        logits = llama_cpp.llama_get_logits_ith(ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy())

    @staticmethod
    def get_state(ctx, kind: str) -> bytes:
        if kind == "seq":
            n = llama_cpp.llama_state_seq_get_size(ctx, 0)
            buf = (ctypes.c_uint8 * n)()
            assert llama_cpp.llama_state_seq_get_data(ctx, buf, n, 0) == n
        else:
            n = llama_cpp.llama_state_get_size(ctx)
            buf = (ctypes.c_uint8 * n)()
            assert llama_cpp.llama_state_get_data(ctx, buf, n) == n
        return bytes(buf)

    @staticmethod
    def set_state(ctx, kind: str, data: bytes) -> int:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if kind == "seq":
            return llama_cpp.llama_state_seq_set_data(ctx, buf, len(data), 0)
        return llama_cpp.llama_state_set_data(ctx, buf, len(data))

    def close(self) -> None:
        for ctx in self._contexts:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(self.model)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = write_hf_model(tmp_path_factory.mktemp("hf") / "llama-64", "llama", n_layer=2, n_embd=128, n_head=2,
                            n_head_kv=1, n_ff=128, vocab_size=512, seed=7)
    gguf_path = write_gguf_from_hf(folder, tmp_path_factory.mktemp("gguf") / "llama-64.gguf")
    lcpp = LlamaCpp(gguf_path)
    yield lcpp, engine.load_model(gguf_path)
    lcpp.close()


@pytest.fixture(autouse=True)
def no_attention_rotation(monkeypatch):
    """llama.cpp reads LLAMA_ATTN_ROT_DISABLE when it creates a cache (see the module docstring)."""
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")


def kvscope_ctx(model, type_kv: str, flash_attn: str) -> Context:
    return Context(model, n_ctx=N_CTX, n_seq_max=1, type_k=type_kv, type_v=type_kv, flash_attn=flash_attn)


def kvscope_decode(ctx: Context, tokens: list[int], start: int) -> torch.Tensor:
    assert ctx.decode(Batch(list(tokens), list(range(start, start + len(tokens))), [[0]] * len(tokens))) == 0
    return ctx.logits(-1).clone()


def kvscope_get_state(ctx: Context, kind: str) -> bytes:
    return ctx.state_seq_get_data(0) if kind == "seq" else ctx.state_get_data()


def kvscope_set_state(ctx: Context, kind: str, data: bytes) -> int:
    return ctx.state_seq_set_data(data, 0) if kind == "seq" else ctx.state_set_data(data)


def engines_differ_by(models, type_kv: str, flash_attn: str) -> float:
    """max |dlogit| between the engines decoding PROMPT + NEXT without any state transfer."""
    lcpp, model = models
    lctx = lcpp.context(type_kv, flash_attn)
    lcpp.decode(lctx, PROMPT, 0)
    kctx = kvscope_ctx(model, type_kv, flash_attn)
    kvscope_decode(kctx, PROMPT, 0)
    diff = (lcpp.decode(lctx, [NEXT], len(PROMPT)) - kvscope_decode(kctx, [NEXT], len(PROMPT))).abs().max()
    # llama.cpp's CPU flash attention and quantized caches round differently from kvscope's, but the
    # engines must still agree, or comparing them after a state transfer would say nothing.
    assert diff < 0.05
    return float(diff)


def memory_state(data: bytes, kind: str):
    """The one cache state of a sequence or whole-context state."""
    p = Parser(data)
    if kind == "seq":
        p.take("Ii")
    else:
        p.raw(p.take("I"))  # the arch name
    return p.cache()[0]


def assert_same_framing_and_first_layer(a: bytes, b: bytes, kind: str, type_kv: str) -> None:
    """Same sizes, cell metadata and layer headers; layer 0's K and V rows (which depend only on the
    tokens and positions) agree to the cache type's rounding."""
    import gguf

    assert len(a) == len(b)
    sa, sb = memory_state(a, kind), memory_state(b, kind)
    assert (sa["meta"], sa["v_trans"]) == (sb["meta"], sb["v_trans"])
    assert [layer[:-1] for layer in sa["k"] + sa["v"]] == [layer[:-1] for layer in sb["k"] + sb["v"]]
    qtype = gguf.GGMLQuantizationType[type_kv.upper()]
    for ra, rb in ((sa["k"][0], sb["k"][0]), (sa["v"][0], sb["v"][0])):
        # transposed V (flash attention off) is one array of elements, compared as such
        xa, xb = (gguf.quants.dequantize(np.frombuffer(r[-1], dtype=np.uint8).reshape(len(PROMPT), -1), qtype)
                  for r in (ra, rb))
        np.testing.assert_allclose(xa, xb, rtol=0, atol=0.01 * np.abs(xa).max())


@pytest.mark.parametrize("kind", ["seq", "whole"])
@pytest.mark.parametrize("type_kv, flash_attn", CASES)
def test_llama_cpp_state_continues_in_kvscope(models, kind, type_kv, flash_attn):
    lcpp, model = models
    baseline = engines_differ_by(models, type_kv, flash_attn)
    lctx = lcpp.context(type_kv, flash_attn)
    lcpp.decode(lctx, PROMPT, 0)
    data = lcpp.get_state(lctx, kind)
    expected = lcpp.decode(lctx, [NEXT], len(PROMPT))

    kctx = kvscope_ctx(model, type_kv, flash_attn)
    assert kvscope_set_state(kctx, kind, data) == len(data)
    got = kvscope_decode(kctx, [NEXT], len(PROMPT))
    assert float((got - expected).abs().max()) <= 2 * baseline + 1e-4


@pytest.mark.parametrize("kind", ["seq", "whole"])
@pytest.mark.parametrize("type_kv, flash_attn", CASES)
def test_kvscope_state_continues_in_llama_cpp(models, kind, type_kv, flash_attn):
    lcpp, model = models
    baseline = engines_differ_by(models, type_kv, flash_attn)
    kctx = kvscope_ctx(model, type_kv, flash_attn)
    kvscope_decode(kctx, PROMPT, 0)
    data = kvscope_get_state(kctx, kind)
    expected = kvscope_decode(kctx, [NEXT], len(PROMPT))

    lctx = lcpp.context(type_kv, flash_attn)
    assert lcpp.set_state(lctx, kind, data) == len(data)
    got = lcpp.decode(lctx, [NEXT], len(PROMPT))
    assert float((got - expected).abs().max()) <= 2 * baseline + 1e-4


@pytest.mark.parametrize("kind", ["seq", "whole"])
@pytest.mark.parametrize("type_kv, flash_attn", CASES)
def test_both_engines_save_the_same_state(models, kind, type_kv, flash_attn):
    lcpp, model = models
    lctx = lcpp.context(type_kv, flash_attn)
    lcpp.decode(lctx, PROMPT, 0)
    kctx = kvscope_ctx(model, type_kv, flash_attn)
    kvscope_decode(kctx, PROMPT, 0)
    ours, theirs = kvscope_get_state(kctx, kind), lcpp.get_state(lctx, kind)
    if kind == "whole":
        assert theirs[:9] == ours[:9] == struct.pack("<I", 5) + b"llama"
    assert_same_framing_and_first_layer(theirs, ours, kind, type_kv)


def test_llama_cpp_opens_the_demo_model_and_agrees_with_kvscope():
    """The bundled demo model is a file llama.cpp loads (its pre-tokenizer is named as llama.cpp names it),
    both engines tokenize and compute it alike, and a sequence state crosses in both directions."""
    from engine.models.model import resolve_model_path

    path = resolve_model_path("demo")
    lcpp = LlamaCpp(path)
    try:
        model = engine.load_model(path)
        prompt = model.tokenizer.encode("And God said unto Moses")
        n = llama_cpp.llama_tokenize(llama_cpp.llama_model_get_vocab(lcpp.model), b"And God said unto Moses", 23,
                                     (llama_cpp.llama_token * 64)(), 64, True, False)
        assert n == len(prompt)
        lctx, kctx = lcpp.context("f32", "off"), kvscope_ctx(model, "f32", "off")
        theirs, ours = lcpp.decode(lctx, prompt, 0), kvscope_decode(kctx, prompt, 0)
        # F16 weights: llama.cpp's CPU matmuls round activations to f16, kvscope computes in f32
        baseline = float((theirs - ours).abs().max())
        assert baseline < 2e-2 and int(theirs.argmax()) == int(ours.argmax())
        next_token = int(ours.argmax())
        kvscope_into_llama = lcpp.context("f32", "off")
        assert lcpp.set_state(kvscope_into_llama, "seq", kctx.state_seq_get_data(0)) > 0
        llama_into_kvscope = kvscope_ctx(model, "f32", "off")
        assert llama_into_kvscope.state_seq_set_data(lcpp.get_state(lctx, "seq"), 0) > 0
        ours_next = kvscope_decode(kctx, [next_token], len(prompt))
        theirs_next = lcpp.decode(lctx, [next_token], len(prompt))
        # each engine continues the other's state as it continues its own
        assert float((lcpp.decode(kvscope_into_llama, [next_token], len(prompt)) - theirs_next).abs().max()) \
            <= 2 * baseline + 1e-4
        assert float((kvscope_decode(llama_into_kvscope, [next_token], len(prompt)) - ours_next).abs().max()) \
            <= 2 * baseline + 1e-4
    finally:
        lcpp.close()
