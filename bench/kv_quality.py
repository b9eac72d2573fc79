"""What a quantized KV cache costs in quality, and what it saves in memory.

A tiny random-weight llama (4 layers, n_embd 256, 4 heads of 64, 2 KV heads; written on the fly, nothing
is downloaded) generates greedily with an f32 cache. Every other configuration then decodes the same
prompt and is teacher-forced on the f32 run's tokens, one token per decode, so each step compares the
next-token distribution of the same context. Per configuration: the cache's bytes per token (from the
layout, as llama.cpp sizes it; also for a Llama-3-8B-shaped cache: 32 layers, 8 KV heads of 128), the
mean and max KL divergence KL(f32 || config) over the steps, and the top-1 agreement with the f32 run.

    python bench/kv_quality.py [--prompt 64] [--new 256] [--seed 0] [--threads 1]

Random weights give a sharper or flatter distribution than a trained model would, so compare the
rows with each other rather than with published numbers for real models.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import engine
from engine.kv.layout import CacheLayout
from engine.kv.types import cache_type

TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
QUANTIZED = tuple(t for t in TYPES if cache_type(t).is_quantized)
SHAPE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, vocab_size=512)


def write_model(folder: Path, seed: int) -> Path:
    from engine.testing import write_hf_model

    return write_hf_model(folder / "kvq-llama", "llama", seed=seed, **SHAPE)


def bytes_per_token(type_k: str, type_v: str, *, n_layer: int, n_head_kv: int, head_dim: int) -> int:
    """K + V bytes of one cell over all layers, from the cache layout (flash attention on: V not transposed)."""
    layout = CacheLayout(layer_ids=tuple(range(n_layer)), n_embd_k=n_head_kv * head_dim,
                         n_embd_v=n_head_kv * head_dim, n_head_kv=n_head_kv, head_dim=head_dim, kv_size=256,
                         n_stream=1, n_seq_max=1, type_k=cache_type(type_k), type_v=cache_type(type_v),
                         v_trans=False)
    return (layout.k_bytes() + layout.v_bytes()) // 256


def one(tokens: list[int], pos0: int) -> engine.Batch:
    n = len(tokens)
    return engine.Batch(tokens=tokens, pos=list(range(pos0, pos0 + n)), seq_ids=[[0]] * n, logits=[False] * (n - 1) + [True])


def run(model, type_k: str, type_v: str, prompt: list[int], n_new: int,
        forced: list[int] | None) -> tuple[torch.Tensor, list[int], float]:
    """Log-probabilities [n_new, n_vocab] of each step, the tokens fed, and the seconds taken. With `forced`
    the tokens are those (teacher forcing); without, the greedy choice of this run."""
    ctx = engine.Context(model, n_ctx=len(prompt) + n_new + 1, n_batch=512, n_ubatch=512,
                         type_k=type_k, type_v=type_v, flash_attn="auto")
    t0 = time.perf_counter()
    assert ctx.decode(one(prompt, 0)) == 0
    out, fed = [], []
    for i in range(n_new):
        logits = ctx.logits(-1).double()
        out.append(torch.log_softmax(logits, dim=-1))
        tok = forced[i] if forced is not None else int(torch.argmax(logits))
        fed.append(tok)
        if i + 1 < n_new:
            assert ctx.decode(one([tok], len(prompt) + i)) == 0
    return torch.stack(out), fed, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=256, help="generated (compared) tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (one is fastest for this tiny model and robust when the machine is shared)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model = engine.load_model(write_model(Path(tmp), args.seed))
    cfg = model.config
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.n_vocab, (args.prompt,), generator=g).tolist()

    ref, greedy, t_ref = run(model, "f32", "f32", prompt, args.new, None)
    p_ref = ref.exp()
    top_ref = ref.argmax(-1)

    configs = [(t, t) for t in TYPES] + [(t, "f16") for t in QUANTIZED]
    rows = []
    for tk, tv in configs:
        logp, _, secs = run(model, tk, tv, prompt, args.new, greedy)
        kl = (p_ref * (ref - logp)).sum(-1).clamp(min=0)
        agree = (logp.argmax(-1) == top_ref).double().mean()
        rows.append((tk, tv, bytes_per_token(tk, tv, n_layer=cfg.n_layer, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim),
                     bytes_per_token(tk, tv, n_layer=32, n_head_kv=8, head_dim=128),
                     float(kl.mean()), float(kl.max()), float(agree), secs))

    print(f"model: llama, {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads x {cfg.head_dim}, "
          f"{cfg.n_head_kv} KV heads, vocab {cfg.n_vocab}, random weights (seed {args.seed}); "
          f"prompt {args.prompt} tokens, {args.new} steps teacher-forced on the f32 run's greedy tokens; "
          f"f32 reference run {t_ref:.1f} s")
    print()
    print("| K | V | bytes/token (this model) | bytes/token (8B shape) | vs f16 | mean KL | max KL | top-1 agree | time (s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    f16_bytes = bytes_per_token("f16", "f16", n_layer=32, n_head_kv=8, head_dim=128)
    for tk, tv, b_model, b_8b, kl_mean, kl_max, agree, secs in rows:
        print(f"| {tk} | {tv} | {b_model} | {b_8b} | {b_8b / f16_bytes:.3f} | {kl_mean:.2e} | {kl_max:.2e} | "
              f"{agree * 100:.1f}% | {secs:.1f} |")


if __name__ == "__main__":
    main()
