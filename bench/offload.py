"""Decode speed and device traffic of layer offload (-ngl 0, half, all; all with -nkvo; all with the
MLP weights kept on the CPU by -ot), on CUDA or virtual devices.

A random llama is written on the fly (nothing is downloaded) and run in f32, greedy, batch 1: a
prompt, then new tokens one at a time. Each setting places the weights differently, and a model's
weights are placed one way at a time, so every run gets its own Context, deleted before the next.
Runs are interleaved (the order of the settings rotates each repetition) and medians reported.

On a machine with CUDA the GPU is "CUDA0" and copies are PCIe transfers. Without one, the GPU is a
virtual device ("VGPU0=8GiB") whose memory is host memory: the bytes moved are the same as on a real
GPU, but a "copy" is a host memcpy, so its time says nothing about PCIe.

    python bench/offload.py [--reps 3] [--prompt 64] [--new 64] [--layers 12] [--size 512] [--json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engine
from engine.batch import Batch

VIRTUAL_GPU = "VGPU0=8GiB"


def write_model(folder: Path, n_layer: int, n_embd: int) -> Path:
    """A random llama (head size 64, 4 KV heads at most) through the project's test writer."""
    from engine.testing import write_hf_model

    n_head = max(1, n_embd // 64)
    return write_hf_model(folder / "bench-offload-llama", "llama", n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                          n_head_kv=min(4, n_head), n_ff=n_embd * 11 // 4, vocab_size=8000, seed=0)


def settings(n_layer: int) -> dict[str, dict]:
    """Context placement keywords per setting. "half" offloads half of the n_layer + 1 llama.cpp layers
    (the output counts as one). The last two show what costs traffic beyond layer boundaries: K/V
    kept on the CPU (attention runs there, so Q, K, V go over and its output comes back), and MLP
    weights kept on the CPU with -ot (the MLP's input and output cross in every layer)."""
    return {"ngl 0": dict(n_gpu_layers=0), "ngl half": dict(n_gpu_layers=(n_layer + 1) // 2),
            "ngl all": dict(n_gpu_layers=-1), "all -nkvo": dict(n_gpu_layers=-1, offload_kqv=False),
            "all -ot ffn": dict(n_gpu_layers=-1, tensor_overrides=["ffn_.*=CPU"])}


def layers_on_gpu(ctx) -> str:
    p = ctx.placement
    n = sum(d.is_gpu for d in p.layer_devices) + int(p.output_device.is_gpu)
    return f"{n}/{p.n_layer + 1}"


def run(model, device: str, placement: dict, prompt: list[int], n_new: int) -> dict:
    """One prompt + n_new greedy steps on a fresh context; decode-only traffic is measured from the
    counters after the prompt, because the prompt moves only one output row to the output layer."""
    ctx = engine.Context(model, n_ctx=len(prompt) + n_new, n_batch=len(prompt), n_ubatch=len(prompt),
                         devices=[device], **placement)
    perf = ctx.perf
    assert ctx.decode(Batch.for_sequence(prompt, seq_id=0, start_pos=0)) == 0, ctx.last_error
    moved0, copy0, tokens0 = perf.bytes_moved, perf.copy_ms, perf.n_tokens_computed
    token = int(ctx.logits(-1).argmax())
    for i in range(n_new):
        assert ctx.decode(Batch.for_sequence([token], seq_id=0, start_pos=len(prompt) + i)) == 0, ctx.last_error
        token = int(ctx.logits(-1).argmax())
    n_dec = perf.n_tokens_computed - tokens0
    row = {
        "layers_on_gpu": layers_on_gpu(ctx),
        "decode_tok_s": perf.n_eval / (perf.t_eval_ms / 1e3),
        "prompt_tok_s": perf.n_p_eval / (perf.t_p_eval_ms / 1e3),
        "bytes_moved_per_token": (perf.bytes_moved - moved0) / n_dec,
        "copy_ms_per_token": (perf.copy_ms - copy0) / n_dec,
        "copy_share": (perf.copy_ms - copy0) / perf.t_eval_ms,
    }
    del ctx, perf
    gc.collect()  # the next setting places the weights another way: this context must be gone first
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--size", type=int, default=512, help="hidden size (n_embd), a multiple of 64")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON instead of a table")
    args = parser.parse_args()
    torch.manual_seed(0)
    real = torch.cuda.is_available()
    device = "CUDA0" if real else VIRTUAL_GPU
    with tempfile.TemporaryDirectory() as tmp:
        model = engine.load_model(write_model(Path(tmp), args.layers, args.size))
    prompt = torch.randint(3, model.n_vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    plan = settings(args.layers)
    for placement in plan.values():  # warm-up: first CUDA kernels and first allocations are slow
        run(model, device, placement, prompt[:8], 4)
    rows: dict[str, list[dict]] = {name: [] for name in plan}
    t_start = time.perf_counter()
    names = list(plan)
    for rep in range(args.reps):
        # Rotate the order so that no setting always runs first (or right after another).
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            rows[name].append(run(model, device, plan[name], prompt, args.new))
        if not args.json:
            print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]['decode_tok_s']:.1f} tok/s" for k, v in rows.items()),
                  flush=True)
    med = {name: {k: (statistics.median(r[k] for r in runs) if k != "layers_on_gpu" else runs[0][k])
                  for k in runs[0]} for name, runs in rows.items()}
    gpu_label = device if real else f"{VIRTUAL_GPU.split('=')[0]} (virtual)"
    meta = {"device": gpu_label, "real_gpu": real, "n_layer": args.layers, "n_embd": args.size,
            "params_m": model.transformer.n_params() / 1e6, "prompt": args.prompt, "new": args.new, "reps": args.reps,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - t_start}
    if args.json:
        print(json.dumps({**meta, "settings": med}, indent=2))
        return
    copy_kind = "CUDA copies, synchronised (PCIe)" if real else \
        "host memcpy between CPU and a virtual GPU: NOT a PCIe transfer"
    print(f"\nmodel: llama, {meta['params_m']:.1f} M parameters, {args.layers} layers, f32; prompt {args.prompt}, "
          f"{args.new} new tokens, medians of {args.reps}")
    print(f"GPU: {gpu_label} -- {'a REAL device' if real else 'a VIRTUAL device (host memory; no GPU here)'}; "
          f"copies: {copy_kind}")
    print(f"\n{'setting':12s} {'on GPU':>7s} {'decode tok/s':>13s} {'prompt tok/s':>13s} {'bytes/token':>12s} "
          f"{'copy ms/tok':>12s} {'copy share':>11s}")
    for name, m in med.items():
        print(f"{name:12s} {m['layers_on_gpu']:>7s} {m['decode_tok_s']:13.1f} {m['prompt_tok_s']:13.1f} "
              f"{m['bytes_moved_per_token']:12.0f} {m['copy_ms_per_token']:12.4f} {m['copy_share']:11.2%}")
    print("\nbytes/token, copy ms/tok and copy share are for the decode steps (one token each): activations "
          "crossing device boundaries plus, when the output layer is offloaded, the logits (n_vocab x 4 bytes) "
          "coming back to the host; copy share is copy time over decode time")


if __name__ == "__main__":
    main()
