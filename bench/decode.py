"""Decode and prompt speed of kvscope's engine against transformers `generate`, and the event overhead.

A ~100M-parameter llama with random weights is written on the fly (nothing is downloaded); both
engines run it in f32, greedy, batch 1: a 128-token prompt, then 128 new tokens. Runs are
interleaved and medians reported, because other jobs share the machine and absolute times swing.

    python bench/decode.py [--reps 3] [--prompt 128] [--new 128]

--context N[,N...] measures instead how decode time per token grows with the cells attention reads:
for each N and cache type (--cache-types, default f32,f16) the cache is filled with N cells of one
sequence, then single-token decodes are timed (the median of --decodes). --fill model prefills
through the model in n_ubatch pieces; --fill synthetic (the default, fast at 32k) stores the same
cells and random K/V rows without running the model: the decodes that follow are the real ones.

    python bench/decode.py --context 256,1024,4096,8192 [--cache-types f32,f16] [--decodes 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engine
from engine.batch import Batch
from engine.models.transformer import project
from engine.runners.generate import Generator
from engine.sampling import SamplerParams

CONFIG = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)


def write_model(folder: Path, n_ctx_train: int = CONFIG["max_position_embeddings"]) -> Path:
    """A random llama saved as safetensors with a tokenizer, through the project's test writer."""
    from engine.testing import write_hf_model

    return write_hf_model(folder / "bench-llama", "llama", n_layer=CONFIG["num_hidden_layers"],
                          n_embd=CONFIG["hidden_size"], n_head=CONFIG["num_attention_heads"],
                          n_head_kv=CONFIG["num_key_value_heads"], n_ff=CONFIG["intermediate_size"],
                          vocab_size=CONFIG["vocab_size"], seed=0, n_ctx_train=n_ctx_train)


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


def run_kvscope(model, prompt: list[int], n_new: int, with_subscriber: bool) -> tuple[float, float, int]:
    """(prompt tokens/s, decode tokens/s, events recorded)."""
    bus = engine.EventBus()
    recorded: list = []
    sub = bus.subscribe_callback(recorded.append) if with_subscriber else None
    ctx = engine.Context(model, n_ctx=512, n_batch=512, n_ubatch=512, bus=bus)
    gen = Generator(ctx, SamplerParams(temperature=0.0, seed=0))
    result = gen.generate(prompt, n_new)
    assert len(result.tokens) == n_new, result.stop_reason
    if sub is not None:
        deadline = time.time() + 5
        while sub.pending() and time.time() < deadline:
            time.sleep(0.01)
        sub.close()
    perf = ctx.perf
    return (perf.n_p_eval / (perf.t_p_eval_ms / 1e3), perf.n_eval / (perf.t_eval_ms / 1e3), len(recorded))


def weight_streaming_floor(model, reps: int = 10) -> float:
    """Tokens/s if a decode step did nothing but read every weight matrix once (one vector-matrix
    product each, in the engine's column-blocked layout):
    about the memory-bandwidth ceiling of any f32 engine on this machine."""
    tf = model.transformer
    mats = [tf.lm_head_t] + [w for layer in tf.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    xs = {m.shape[1]: torch.randn(1, m.shape[1]) for m in mats}
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            for m in mats:
                project(xs[m.shape[1]], m)
            times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times)


N_UBATCH = 512


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


def context_decode_ms(model, n_cells: int, cache_type: str, n_decodes: int, fill: str) -> list[float]:
    """ms per token of n_decodes single-token decodes of one sequence after n_cells cached cells."""
    n_ctx = (n_cells + n_decodes + 4 + 255) // 256 * 256
    ctx = engine.Context(model, n_ctx=n_ctx, n_batch=N_UBATCH, n_ubatch=N_UBATCH, type_k=cache_type,
                         type_v=cache_type)
    tokens = torch.randint(3, model.n_vocab, (n_cells + n_decodes + 2,),
                           generator=torch.Generator().manual_seed(1)).tolist()
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
    with tempfile.TemporaryDirectory() as tmp:
        n_ctx_train = max(CONFIG["max_position_embeddings"], max(sizes) + args.decodes + 512)
        model = engine.load_model(write_model(Path(tmp), n_ctx_train))
    print(f"model: llama, {model.transformer.n_params() / 1e6:.1f} M parameters, f32 weights, torch threads "
          f"{torch.get_num_threads()}, fill: {args.fill}")
    context_decode_ms(model, 256, types[0], 2, "synthetic")  # warm-up
    results: dict[tuple[int, str], list[float]] = {}
    for rep in range(args.reps):
        for n in sizes:
            for t in types:
                results.setdefault((n, t), []).extend(context_decode_ms(model, n, t, args.decodes, args.fill))
    print(f"\ndecode ms per token (median of {args.reps} x {args.decodes})")
    print(f"{'cells':>8s} " + " ".join(f"{t:>8s}" for t in types))
    for n in sizes:
        print(f"{n:8d} " + " ".join(f"{statistics.median(results[n, t]):8.1f}" for t in types))
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"cells": n, "type": t, "median_ms": statistics.median(v), "ms": v} for (n, t), v in results.items()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=None, help="default 3; with --context 1")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--context", action="append", default=[],
                        help="cells before the timed decodes, e.g. 256,1024,4096,8192 (repeatable)")
    parser.add_argument("--cache-types", default="f32,f16", help="with --context: K and V cache types")
    parser.add_argument("--decodes", type=int, default=16, help="with --context: timed decodes per run")
    parser.add_argument("--fill", choices=("synthetic", "model"), default="synthetic",
                        help="with --context: how the N cells are filled")
    parser.add_argument("--json", help="with --context: also write every time to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.context:
        args.reps = args.reps or 1
        context_main(args)
        return
    args.reps = args.reps or 3
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp))
        model = engine.load_model(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print(f"model: llama, {model.transformer.n_params() / 1e6:.1f} M parameters, f32, torch threads "
          f"{torch.get_num_threads()}")
    prompt = torch.randint(3, model.n_vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    rows: dict[str, list[tuple[float, ...]]] = {"transformers": [], "kvscope": [], "kvscope+events": []}
    run_kvscope(model, prompt[:8], 4, False)  # warm-up
    floors, n_events = [], 0
    for rep in range(args.reps):
        floors.append(weight_streaming_floor(model))
        rows["transformers"].append(run_transformers(hf, prompt, args.new))
        # Alternate which kvscope run goes first, so that neither always follows the other.
        for with_events in ((False, True) if rep % 2 == 0 else (True, False)):
            p, d, n = run_kvscope(model, prompt, args.new, with_events)
            rows["kvscope+events" if with_events else "kvscope"].append((p, d))
            n_events = n if with_events else n_events
        print(f"rep {rep + 1}: " + ", ".join(f"{k} decode {v[-1][1]:.1f} tok/s" for k, v in rows.items()))

    def paired(a: str, b: str, i: int) -> float:
        """Median over reps of the per-rep ratio a / b (pairs run back to back)."""
        return statistics.median(x[i] / y[i] for x, y in zip(rows[a], rows[b]))

    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    print(f"\n{'':16s} {'prompt tok/s':>13s} {'decode tok/s':>13s}")
    for k, (p, d) in med.items():
        print(f"{k:16s} {p:13.1f} {d:13.1f}")
    floor = statistics.median(floors)
    print(f"{'weights floor':16s} {'':13s} {floor:13.1f}   (one matvec per weight matrix, nothing else)")
    print(f"\ndecode speed ratio kvscope / transformers: {paired('kvscope', 'transformers', 1):.2f}x")
    print(f"prompt speed ratio kvscope / transformers: {paired('kvscope', 'transformers', 0):.2f}x")
    print(f"decode speed as a share of the weights floor: kvscope {med['kvscope'][1] / floor:.0%}, "
          f"transformers {med['transformers'][1] / floor:.0%}")
    overhead = 1 - paired("kvscope+events", "kvscope", 1)
    print(f"event overhead (recording subscriber vs none), decode: {overhead * 100:+.2f}% "
          f"({n_events} events per generation)")


if __name__ == "__main__":
    main()
