"""Decode and prompt speed of kvscope's engine against transformers `generate`, and the event overhead.

A ~100M-parameter llama with random weights is written on the fly (nothing is downloaded); both
engines run it in f32, greedy, batch 1: a 128-token prompt, then 128 new tokens. Runs are
interleaved and medians reported, because other jobs share the machine and absolute times swing.

    python bench/decode.py [--reps 3] [--prompt 128] [--new 128]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engine
from engine.models.transformer import project
from engine.runners.generate import Generator
from engine.sampling import SamplerParams

CONFIG = dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)


def write_model(folder: Path) -> Path:
    """A random llama saved as safetensors with a tokenizer, through the project's test writer."""
    from engine.testing import write_hf_model

    return write_hf_model(folder / "bench-llama", "llama", n_layer=CONFIG["num_hidden_layers"],
                          n_embd=CONFIG["hidden_size"], n_head=CONFIG["num_attention_heads"],
                          n_head_kv=CONFIG["num_key_value_heads"], n_ff=CONFIG["intermediate_size"],
                          vocab_size=CONFIG["vocab_size"], seed=0)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
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
