"""Decode and prompt speed of kvscope's engine against transformers and llama.cpp, and the event overhead.

A ~100M-parameter llama with random weights is written on the fly (nothing is downloaded), as a
Hugging Face folder (for transformers) and as a GGUF of it (for kvscope and llama.cpp: the same file
for both). Greedy, batch 1: a 128-token prompt, then 128 new tokens, the K/V cache in the first of
--cache-types (default f32) in every engine. Runs are interleaved and medians reported, because other
jobs share the machine and absolute times swing. The event overhead is measured per token with two
kvscope contexts decoding in lockstep, one with a recording subscriber and one without. Two more
lines say where decode time goes: the weights floor (one row times every weight matrix with kvscope's
kernels, nothing else: what decode could reach with no other cost) and the fixed cost per token (a
model of the same depth with 8 values per head, so that its weights cost almost nothing: dispatch and
bookkeeping), in kvscope and llama.cpp.

    python bench/decode.py [--reps 3] [--prompt 128] [--new 128] [--weights F32|Q8_0|Q4_0|Q4_K|Q6_K]

llama.cpp is the optional third engine: it runs when llama-cpp-python is installed (it is not a
kvscope dependency; building it takes ~10 minutes:
`CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_OPENMP=ON" pip install llama-cpp-python==0.3.36`).
Both engines' times are their own decode timers (llama_perf_context and Context.perf), which count
the same thing: the time inside decode. --weights writes the GGUF's matrices in that type (norms stay
F32); kvscope keeps quantized weights packed. The last prompt token's logits of kvscope and llama.cpp
are compared (llama.cpp quantizes activations for its quantized dot products: they differ a little).

--context N[,N...] measures instead how decode time per token grows with the cells attention reads:
for each N and cache type (--cache-types, default f32) the cache is filled with N cells of one
sequence, then single-token decodes are timed by the wall clock (the median of --decodes), in
kvscope and in llama.cpp. kvscope's cells are filled without running the model (--fill synthetic,
the default: the same cells and random K/V rows; the decodes that follow are the real ones) or by
prefilling (--fill model); llama.cpp always prefills.

    python bench/decode.py --context 256,1024,4096,8192,32768 [--cache-types f32,f16] [--decodes 16]

--cache-memory N[,N...] prints the bytes of an N-cell cache of this model per cache type (from
kvscope's estimate, which equals what a Context allocates: tests/test_estimate.py), and checks one
against a real allocation.

    python bench/decode.py --cache-memory 32768,131072
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import engine
from engine.batch import Batch
from engine.models.transformer import project
from engine.runners.generate import Generator
from engine.sampling import SamplerParams

CONFIG = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
N_UBATCH = 512
GGML_CACHE_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}


def write_models(folder: Path, weights: str, n_ctx_train: int = CONFIG["max_position_embeddings"]) -> tuple[Path, Path]:
    """The random llama as a Hugging Face folder and as a GGUF with `weights`-typed matrices."""
    from engine.testing import write_gguf_from_hf, write_hf_model

    hf = write_hf_model(folder / "bench-llama", "llama", n_layer=CONFIG["num_hidden_layers"],
                        n_embd=CONFIG["hidden_size"], n_head=CONFIG["num_attention_heads"],
                        n_head_kv=CONFIG["num_key_value_heads"], n_ff=CONFIG["intermediate_size"],
                        vocab_size=CONFIG["vocab_size"], seed=0, n_ctx_train=n_ctx_train)
    return hf, write_gguf_from_hf(hf, folder / f"bench-llama-{weights}.gguf", tensor_type=weights)


def llama_cpp_module():
    """llama_cpp when installed, else None (the third engine is optional)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


class LlamaCpp:
    """One llama.cpp context on the GGUF, driven token by token through llama-cpp-python."""

    def __init__(self, gguf: Path, n_ctx: int, cache_type: str = "f32") -> None:
        self.lib = llama_cpp_module()
        threads = torch.get_num_threads()
        self.llm = self.lib.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=N_UBATCH, n_ubatch=N_UBATCH,
                                  n_threads=threads, n_threads_batch=threads, type_k=GGML_CACHE_TYPES[cache_type],
                                  type_v=GGML_CACHE_TYPES[cache_type], verbose=False,
                                  # a quantized V cache needs flash attention in llama.cpp (its -fa auto turns it on
                                  # on the CPU; llama-cpp-python's default is off, and the context then fails)
                                  flash_attn=cache_type.startswith("q"))
        self.ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()
        self.prefilled = 0  # cells of the last decode_ms_after prefill still in the cache

    def last_logits(self) -> np.ndarray:
        """The last decoded token's logits (llama_get_logits_ith: `scores` is stale without logits_all)."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def reset(self) -> None:
        self.prefilled = 0
        self.llm.reset()
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        self.lib.llama_perf_context_reset(self.ctx)

    def generate(self, prompt: list[int], n_new: int) -> tuple[float, float, np.ndarray]:
        """(prompt tokens/s, decode tokens/s, the last prompt token's logits), greedy."""
        self.reset()
        self.llm.eval(prompt)
        prompt_logits = self.last_logits()
        token = int(prompt_logits.argmax())
        for _ in range(n_new - 1):
            self.llm.eval([token])
            token = int(self.last_logits().argmax())
        perf = self.lib.llama_perf_context(self.ctx)
        return perf.n_p_eval / (perf.t_p_eval_ms / 1e3), perf.n_eval / (perf.t_eval_ms / 1e3), prompt_logits

    def decode_ms_after(self, tokens: list[int], n_cells: int, n_decodes: int) -> list[float]:
        """ms per single-token decode (wall clock), n_decodes after prefilling n_cells tokens. The
        prefill (minutes at 32k cells) is kept for the next call with the same n_cells: only the cells
        the timed decodes added are removed."""
        if self.prefilled == n_cells:
            mem = self.lib.llama_get_memory(self.ctx)
            assert self.lib.llama_memory_seq_rm(mem, 0, n_cells, -1)
            self.llm.n_tokens = n_cells
        else:
            self.reset()
            self.llm.eval(tokens[:n_cells])
            self.prefilled = n_cells
        times = []
        for j in range(n_decodes + 2):  # two warm-up decodes
            t0 = time.perf_counter()
            self.llm.eval([tokens[n_cells + j]])
            times.append((time.perf_counter() - t0) * 1e3)
        return times[2:]


def run_transformers(hf, prompt: list[int], n_new: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s). Prompt time: one forward; decode: generate minus that."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        t0 = time.perf_counter()
        hf(ids)
        t_prompt = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
        t_gen = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + n_new
    return len(prompt) / t_prompt, (n_new - 1) / max(t_gen - t_prompt, 1e-9)


KVSCOPE_SETTINGS: dict = {}  # placement (--ngl) and cache type of every kvscope context in a speed run


def speed_context(model, bus: engine.EventBus | None = None) -> engine.Context:
    """A kvscope context of a speed run: 512 cells, one ubatch per prompt, KVSCOPE_SETTINGS."""
    return engine.Context(model, n_ctx=512, n_batch=N_UBATCH, n_ubatch=N_UBATCH, bus=bus, **KVSCOPE_SETTINGS)


def close_when_delivered(sub, timeout_s: float = 5.0) -> None:
    """Close a subscribe_callback subscription once its thread has delivered what was queued."""
    deadline = time.time() + timeout_s
    while sub.pending() and time.time() < deadline:
        time.sleep(0.01)
    sub.close()


def run_kvscope(model, prompt: list[int], n_new: int, with_subscriber: bool) -> tuple[float, float, int, np.ndarray]:
    """(prompt tokens/s, decode tokens/s, events recorded, the last prompt token's logits)."""
    bus = engine.EventBus()
    recorded: list = []
    sub = bus.subscribe_callback(recorded.append) if with_subscriber else None
    first = speed_context(model)
    assert first.decode(Batch.for_sequence(prompt, 0, 0)) == 0
    prompt_logits = first.logits(-1).float().cpu().numpy().copy()
    del first
    ctx = speed_context(model, bus)
    gen = Generator(ctx, SamplerParams(temperature=0.0, seed=0))
    result = gen.generate(prompt, n_new)
    assert len(result.tokens) == n_new, result.stop_reason
    if sub is not None:
        close_when_delivered(sub)
    perf = ctx.perf
    return (perf.n_p_eval / (perf.t_p_eval_ms / 1e3), perf.n_eval / (perf.t_eval_ms / 1e3), len(recorded),
            prompt_logits)


def event_overhead_lockstep(model, prompt: list[int], n_new: int) -> tuple[list[float], int]:
    """Per-token cost of events, paired in time: two contexts on the same model decode the same greedy
    tokens in lockstep, one on a bus with a recording subscriber and one with none (the engine then
    builds no events). Each step times both decodes back to back, in alternating order, so that the
    machine's drifting speed cancels out of each ratio. Returns the per-step ratios with / without - 1
    and the events recorded."""
    bus = engine.EventBus()
    recorded: list = []
    sub = bus.subscribe_callback(recorded.append)
    plain, watched = speed_context(model), speed_context(model, bus)
    for ctx in (plain, watched):
        assert ctx.decode(Batch.for_sequence(prompt, 0, 0)) == 0
    token = int(plain.logits(-1).argmax())
    ratios = []
    for i in range(n_new):
        batch = Batch.for_sequence([token], 0, len(prompt) + i)
        ms = {}
        for ctx in ((plain, watched) if i % 2 == 0 else (watched, plain)):
            t0 = time.perf_counter()
            assert ctx.decode(batch) == 0
            ms[ctx is watched] = time.perf_counter() - t0
        ratios.append(ms[True] / ms[False] - 1)
        token = int(plain.logits(-1).argmax())
    close_when_delivered(sub)
    return ratios, len(recorded)


def weight_streaming_floor(model, reps: int = 10) -> float:
    """Tokens/s if a decode step did nothing but multiply one row by every weight matrix once, in the
    engine's layout and with its kernels (row blocks for float weights; torch's int8/int4 kernels,
    bf16 conversions included, for packed ones): the ceiling of any decode built on these products
    on this machine."""
    tf = model.transformer
    mats = [tf.output_weight()] + [w for layer in tf.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    device = tf.norm.device
    xs = {m.shape[-1]: torch.randn(1, m.shape[-1], dtype=tf.dtype, device=device) for m in mats}
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for m in mats:
                project(xs[m.shape[-1]], m)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times)


def fixed_cost_ms(folder: Path, cache_type: str, with_llama_cpp: bool, n_decodes: int = 64) -> dict[str, float]:
    """Median ms per decoded token, after 128 cells, of a llama with bench's layer and head counts but 8 values
    per head: what an engine spends per token beside reading its weights (dispatch, bookkeeping)."""
    from engine.testing import write_gguf_from_hf, write_hf_model

    n_head = CONFIG["num_attention_heads"]
    hf = write_hf_model(folder / "narrow-llama", "llama", n_layer=CONFIG["num_hidden_layers"], n_embd=8 * n_head,
                        n_head=n_head, n_head_kv=CONFIG["num_key_value_heads"], n_ff=16 * n_head, vocab_size=300,
                        seed=0, n_ctx_train=CONFIG["max_position_embeddings"])
    gguf = write_gguf_from_hf(hf, folder / "narrow-llama.gguf", tensor_type="F32")
    tokens = torch.randint(3, 300, (128 + n_decodes + 2,), generator=torch.Generator().manual_seed(1)).tolist()
    model = engine.load_model(gguf)
    out = {"kvscope": statistics.median(kvscope_decode_ms_after(model, tokens, 128, cache_type, n_decodes, "model"))}
    if with_llama_cpp:
        out["llama.cpp"] = statistics.median(LlamaCpp(gguf, 512, cache_type).decode_ms_after(tokens, 128, n_decodes))
    return out


def logits_agreement(ours: np.ndarray, theirs: np.ndarray) -> str:
    """How far two logit rows are apart, in words with numbers."""
    diff = np.abs(ours - theirs)
    scale = np.abs(theirs).max()
    return (f"max |diff| {diff.max():.4g} ({diff.max() / scale:.2%} of the largest |logit|), mean |diff| "
            f"{diff.mean():.4g}, top-1 {'same' if ours.argmax() == theirs.argmax() else 'DIFFERENT'}")


def speed_main(args) -> None:
    lib = None if args.no_llama_cpp else llama_cpp_module()
    with_transformers = args.weights == "F32" and not args.no_transformers
    with tempfile.TemporaryDirectory() as tmp:
        folder, gguf = write_models(Path(tmp), args.weights)
        model = engine.load_model(gguf, dtype=args.dtype)
        hf = None
        if with_transformers:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        llama = LlamaCpp(gguf, n_ctx=512, cache_type=args.cache_type) if lib is not None else None
        file_bytes = gguf.stat().st_size
    held = model.transformer.resident_weight_bytes()
    print(f"model: llama, {model.transformer.n_params() / 1e6:.1f} M parameters, {args.weights} weights "
          f"(GGUF {file_bytes / 2**20:.1f} MiB; kvscope holds {held / 2**20:.1f} MiB), "
          f"{args.dtype} compute, {args.cache_type} cache, torch threads {torch.get_num_threads()}"
          + (f", n_gpu_layers {args.ngl}" if args.ngl else ""))
    if lib is None:
        print("llama.cpp: not run (" + ("--no-llama-cpp)" if args.no_llama_cpp else "llama-cpp-python is not installed)"))
    prompt = torch.randint(3, model.n_vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    rows: dict[str, list[tuple[float, ...]]] = {"kvscope": [], "kvscope+events": []}
    if hf is not None:
        rows["transformers"] = []
    if llama is not None:
        rows["llama.cpp"] = []
    run_kvscope(model, prompt[:8], 4, False)  # warm-up
    if llama is not None:
        llama.generate(prompt[:8], 4)
    floors, n_events, logits = [], 0, {}
    for rep in range(args.reps):
        floors.append(weight_streaming_floor(model))
        if hf is not None:
            rows["transformers"].append(run_transformers(hf, prompt, args.new))
        if llama is not None:
            p, d, logits["llama.cpp"] = llama.generate(prompt, args.new)
            rows["llama.cpp"].append((p, d))
        # Alternate which kvscope run goes first, so that neither always follows the other.
        for with_events in ((False, True) if rep % 2 == 0 else (True, False)):
            p, d, n, logits["kvscope"] = run_kvscope(model, prompt, args.new, with_events)
            rows["kvscope+events" if with_events else "kvscope"].append((p, d))
            n_events = n if with_events else n_events
        print(f"rep {rep + 1}: " + ", ".join(f"{k} decode {v[-1][1]:.1f} tok/s" for k, v in rows.items()), flush=True)

    def paired(a: str, b: str, i: int) -> float:
        """Median over reps of the per-rep ratio a / b (runs of one rep follow each other)."""
        return statistics.median(x[i] / y[i] for x, y in zip(rows[a], rows[b]))

    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    print(f"\n{'':16s} {'prompt tok/s':>13s} {'decode tok/s':>13s}")
    for k, (p, d) in med.items():
        print(f"{k:16s} {p:13.1f} {d:13.1f}")
    floor = statistics.median(floors)
    print(f"{'weights floor':16s} {'':13s} {floor:13.1f}   (one matvec per weight matrix, nothing else)")
    print()
    for other in ("llama.cpp", "transformers"):
        if other in rows:
            print(f"decode speed ratio kvscope / {other}: {paired('kvscope', other, 1):.2f}x")
            print(f"prompt speed ratio kvscope / {other}: {paired('kvscope', other, 0):.2f}x")
    print("decode speed as a share of the weights floor: "
          + ", ".join(f"{k} {med[k][1] / floor:.0%}" for k in rows if k != "kvscope+events"))
    overhead = 1 - paired("kvscope+events", "kvscope", 1)
    print(f"event overhead (recording subscriber vs none), whole generations: {overhead * 100:+.2f}% "
          f"({n_events} events per generation)")
    ratios, n_lockstep = event_overhead_lockstep(model, prompt, args.new)
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    print(f"event overhead per decoded token, lockstep pairs: median {med * 100:+.2f}% (quartiles {q1 * 100:+.1f}% "
          f".. {q3 * 100:+.1f}%, {len(ratios)} tokens, {n_lockstep} events)")
    if "llama.cpp" in logits:
        print(f"last prompt token's logits, kvscope vs llama.cpp: {logits_agreement(logits['kvscope'], logits['llama.cpp'])}")
    with tempfile.TemporaryDirectory() as tmp:
        fixed = fixed_cost_ms(Path(tmp), args.cache_type, llama is not None)
    print(f"fixed cost per token ({CONFIG['num_hidden_layers']} layers {8 * CONFIG['num_attention_heads']} wide, "
          "128 cells: dispatch and bookkeeping, almost no weights): "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in fixed.items()))


def synthetic_forward(transformer, n_vocab: int):
    """A stand-in for Transformer.forward that stores random K/V rows for every layer of each cache
    the ubatch writes (the cells themselves are placed by the real slot search) and returns zero
    logits: a fast fill of N cells that runs no model."""
    gen = torch.Generator().manual_seed(2)

    def forward(tokens, positions, attn, output_rows, should_abort=None, *, probe=None):
        for part in attn.parts():
            cache = part.cache
            for rows in (*cache.k, *cache.v):
                new = torch.randn(len(tokens), rows.width, generator=gen)
                rows.write(part._token_stream.to(rows.device), part._token_cell.to(rows.device), new)
        return torch.zeros(len(output_rows), n_vocab)

    return forward


def kvscope_decode_ms_after(model, tokens: list[int], n_cells: int, cache_type: str, n_decodes: int,
                            fill: str) -> list[float]:
    """ms per single-token decode (wall clock) of one sequence, n_decodes after n_cells cached cells."""
    n_ctx = (n_cells + n_decodes + 4 + 255) // 256 * 256
    ctx = engine.Context(model, n_ctx=n_ctx, n_batch=N_UBATCH, n_ubatch=N_UBATCH, type_k=cache_type,
                         type_v=cache_type)
    tf = model.transformer
    if fill == "synthetic":
        tf.forward = synthetic_forward(tf, model.n_vocab)  # an instance attribute: removed below
    try:
        for i in range(0, n_cells, N_UBATCH):
            assert ctx.decode(Batch.for_sequence(tokens[i:min(i + N_UBATCH, n_cells)], 0, i)) == 0
    finally:
        vars(tf).pop("forward", None)
    times = []
    for j in range(n_decodes + 2):  # two warm-up decodes
        pos = n_cells + j
        t0 = time.perf_counter()
        assert ctx.decode(Batch.for_sequence([tokens[pos]], 0, pos)) == 0
        times.append((time.perf_counter() - t0) * 1e3)
    return times[2:]


def context_main(args) -> None:
    sizes = [int(n) for part in args.context for n in part.split(",") if n]
    types = [t for t in args.cache_types.split(",") if t]
    lib = None if args.no_llama_cpp else llama_cpp_module()
    n_ctx_train = max(CONFIG["max_position_embeddings"], max(sizes) + args.decodes + 512)
    with tempfile.TemporaryDirectory() as tmp:
        _, gguf = write_models(Path(tmp), args.weights, n_ctx_train)
        model = engine.load_model(gguf)
        llamas = {}
        if lib is not None:
            n_ctx = (max(sizes) + args.decodes + 4 + 255) // 256 * 256
            llamas = {t: LlamaCpp(gguf, n_ctx, t) for t in types}
    print(f"model: llama, {model.transformer.n_params() / 1e6:.1f} M parameters, {args.weights} weights, torch "
          f"threads {torch.get_num_threads()}, kvscope fill: {args.fill}; llama.cpp: "
          f"{'prefilled' if llamas else 'not run'}")
    tokens = torch.randint(3, model.n_vocab, (max(sizes) + args.decodes + 2,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    kvscope_decode_ms_after(model, tokens, 256, types[0], 2, "synthetic")  # warm-up
    results: dict[tuple[str, int, str], list[float]] = {}
    for n in sizes:
        for _ in range(args.reps):  # reps of one size back to back: llama.cpp prefills once per size
            for t in types:
                results.setdefault(("kvscope", n, t), []).extend(
                    kvscope_decode_ms_after(model, tokens, n, t, args.decodes, args.fill))
                if t in llamas:
                    results.setdefault(("llama.cpp", n, t), []).extend(
                        llamas[t].decode_ms_after(tokens, n, args.decodes))
                print(f"{n} cells, {t}: " + ", ".join(f"{e} {statistics.median(v):.1f} ms"
                                                       for (e, m, c), v in results.items() if (m, c) == (n, t)),
                      flush=True)
    print(f"\ndecode ms per token (median of {args.reps} x {args.decodes})")
    header = " ".join(f"{'kvscope ' + t:>12s}" + (f" {'llama.cpp ' + t:>14s} {'ratio':>6s}" if llamas else "")
                      for t in types)
    print(f"{'cells':>8s} {header}")
    for n in sizes:
        cols = []
        for t in types:
            ours = statistics.median(results["kvscope", n, t])
            cols.append(f"{ours:12.1f}")
            if ("llama.cpp", n, t) in results:
                theirs = statistics.median(results["llama.cpp", n, t])
                cols.append(f"{theirs:14.1f} {ours / theirs:6.2f}")
        print(f"{n:8d} " + " ".join(cols))
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"engine": e, "cells": n, "type": t, "median_ms": statistics.median(v), "ms": v}
            for (e, n, t), v in results.items()]))


def cache_memory_main(args) -> None:
    from engine.sizing.estimate import estimate

    sizes = [int(n) for part in args.cache_memory for n in part.split(",") if n]
    types = ("f32", "f16", "bf16", "q8_0", "q4_0")
    with tempfile.TemporaryDirectory() as tmp:
        _, gguf = write_models(Path(tmp), args.weights, max(sizes))
        table = {(n, t): estimate(gguf, n_ctx=n, type_k=t, type_v=t, flash_attn="on").devices[0].kv_bytes
                 for n in sizes for t in types}
        checked_cells, checked_type = min(sizes), "q8_0"
        ctx = engine.Context(engine.load_model(gguf), n_ctx=checked_cells, type_k=checked_type, type_v=checked_type,
                             flash_attn="on")
        allocated = sum(c.k_bytes() + c.v_bytes() for c in ctx.memory.caches())
        assert allocated == table[checked_cells, checked_type], (allocated, table[checked_cells, checked_type])
    cfg = CONFIG
    print(f"K+V cache of bench/decode.py's model ({cfg['num_hidden_layers']} layers x {cfg['num_key_value_heads']} KV "
          f"heads x {cfg['hidden_size'] // cfg['num_attention_heads']} dims), MiB; flash attention on (quantized V needs it)")
    print(f"{'cells':>8s} " + " ".join(f"{t:>8s}" for t in types))
    for n in sizes:
        print(f"{n:8d} " + " ".join(f"{table[n, t] / 2**20:8.1f}" for t in types))
    print(f"(a real {checked_cells}-cell {checked_type} context allocated {allocated} bytes: the estimate's figure)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=None, help="default 3 (with --context: 2)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--weights", default="F32", choices=("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"),
                        help="type of the GGUF's weight matrices (norms stay F32)")
    parser.add_argument("--dtype", default="f32", choices=("f32", "bf16", "f16"), help="kvscope's compute dtype")
    parser.add_argument("--ngl", type=int, default=0,
                        help="kvscope's n_gpu_layers (-1: all) on the CUDA devices torch sees; llama.cpp runs as built")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when installed")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers")
    parser.add_argument("--context", action="append", default=[],
                        help="cells before the timed decodes, e.g. 256,1024,4096,8192 (repeatable)")
    parser.add_argument("--cache-types", default="f32",
                        help="K and V cache types, e.g. f32,f16 (with --context: each; otherwise the first, for every engine)")
    parser.add_argument("--decodes", type=int, default=16, help="with --context: timed decodes per run")
    parser.add_argument("--fill", choices=("synthetic", "model"), default="synthetic",
                        help="with --context: how kvscope's N cells are filled")
    parser.add_argument("--json", help="with --context: also write every time to this file")
    parser.add_argument("--cache-memory", action="append", default=[],
                        help="cells, e.g. 32768,131072: print the cache bytes per cache type instead")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.ngl:
        KVSCOPE_SETTINGS["n_gpu_layers"] = args.ngl
    # one cache type for both engines (kvscope's own default, like llama.cpp's, is f16)
    args.cache_type = args.cache_types.split(",")[0]
    KVSCOPE_SETTINGS.update(type_k=args.cache_type, type_v=args.cache_type)
    if args.cache_memory:
        cache_memory_main(args)
    elif args.context:
        args.reps = args.reps or 2
        context_main(args)
    else:
        args.reps = args.reps or 3
        speed_main(args)


if __name__ == "__main__":
    main()
