"""What the attention probe (Context(publish_attention=True)) costs decode, and that it costs nothing off.

Decode speed, batch 1, one token per decode (the next token the argmax), after a prompt restored from
a state file, so that every run starts from the same cache without paying for the prefill. Setups:
`llama100m`, bench/decode.py's ~100M-parameter llama at 256 cells; `demo256` and `demo4096`, the
bundled demo model (gemma3, an iSWA pair) with the full-attention cache's window at 256 and 4096 cells.

Variants, all in one process per rep, decoding in turn token by token (so that all see the same
machine load, which a shared machine changes from one second to the next; the turn order rotates
each rep), each with its own context:
  off        the probe off, nobody listening (the default)
  off+sub    the probe off, a queue subscriber (every other event is built)
  on+sub     the probe on, the same subscriber (AttentionWeights events too)
  baseline   with --baseline DIR: another checkout of kvscope (e.g. the code before a change, made with
             `git archive HEAD | tar -x -C DIR` before editing), nobody listening; imported in the
             same process after this one's modules are set aside (its decode imports nothing more)

Speeds are 1 / the median decode time of a run, as another job's burst would swamp a mean; ratios are
medians over reps of per-rep ratios.

    python bench/attention_probe.py [--reps 5] [--new 64] [--threads N] [--setups llama100m,demo256,demo4096]
                                    [--baseline DIR]
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (model, n_ctx, prompt tokens): after the prompt, WARMUP and --new tokens the window is the named size
SETUPS = {"llama100m": ("llama100m", 512, 128), "demo256": ("demo", 4096, 128), "demo4096": ("demo", 4096, 3960)}
WARMUP = 8  # untimed decodes first: a fresh process's first few run several times slower
VARIANTS = {"off": (False, False), "off+sub": (False, True), "on+sub": (True, True),  # (probe, listen)
            "baseline": (False, False)}


class Run:
    """One context decoding its own greedy continuation of the restored prompt, timing each decode."""

    def __init__(self, engine, model, spec: dict, probe: bool, listen: bool) -> None:
        from engine import events as ev

        self._batch = engine.Batch  # looked up now: engine's lazy attributes import from whichever checkout is current
        self._kind = getattr(ev, "AttentionWeights", ())  # () in a baseline checkout without the probe
        bus = engine.EventBus()
        self.sub = bus.subscribe(with_state=False) if listen else None
        kw = {"publish_attention": True} if probe else {}  # a baseline checkout may not know the setting
        self.ctx = engine.Context(model, n_ctx=spec["n_ctx"], bus=bus, **kw)
        self.ctx.state_set_data(Path(spec["state"]).read_bytes())
        self.token, self.pos, self.seconds, self.attention_events = 5, spec["prompt"], [], 0

    def step(self, timed: bool) -> None:
        t0 = time.perf_counter()
        assert self.ctx.decode(self._batch([self.token], [self.pos], [[0]])) == 0, self.ctx.last_error
        if timed:
            self.seconds.append(time.perf_counter() - t0)
        self.token, self.pos = int(self.ctx.logits(-1).argmax()), self.pos + 1
        if self.sub is not None:  # drained outside the timed call, as a watcher thread would
            n = sum(isinstance(e, self._kind) for e in self.sub.drain())
            self.attention_events += n if timed else 0

    def result(self) -> dict:
        n_kv = max(c.n_kv((0,)) for c in self.ctx.memory.caches())
        return {"tok_s": 1 / statistics.median(self.seconds), "n_kv": n_kv, "decodes": len(self.seconds),
                "attention_events": self.attention_events}


def import_checkout(tree: str):
    """The engine package of checkout `tree`, imported afresh: the modules of one imported before leave
    sys.modules, and its contexts keep working, since a decode imports nothing once a context exists."""
    for name in [m for m in sys.modules if m == "engine" or m.startswith("engine.")]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    try:
        engine = importlib.import_module("engine")
    finally:
        sys.path.remove(tree)
    assert Path(engine.__file__).resolve().is_relative_to(Path(tree).resolve()), engine.__file__
    return engine


def worker(spec: dict) -> dict:
    """spec["trees"]: {checkout: [variant, ...]}. Makes every variant's context, then decodes with each
    in turn (spec["order"]), returning each one's speed."""
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])  # before loading: the weights' column blocks follow it
    runs = {}
    for tree, names in spec["trees"].items():
        engine = import_checkout(tree)
        model = engine.load_model(spec["model"])
        runs.update({name: Run(engine, model, spec, *VARIANTS[name]) for name in names})
    for k in range(WARMUP + spec["new"]):
        for name in spec["order"]:
            runs[name].step(timed=k >= WARMUP)
    return {name: runs[name].result() for name in VARIANTS if name in runs}


def run_worker(spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], check=False, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"worker failed ({spec}):\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def write_state(model_path: str, n_ctx: int, n_prompt: int, path: Path) -> None:
    """Prefill a random prompt once with this checkout and save the context's state."""
    import torch

    import engine

    model = engine.load_model(model_path)
    ctx = engine.Context(model, n_ctx=n_ctx)
    prompt = torch.randint(3, model.n_vocab, (n_prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    for i in range(0, n_prompt, ctx.n_batch):
        chunk = prompt[i:i + ctx.n_batch]
        assert ctx.decode(engine.Batch(chunk, list(range(i, i + len(chunk))), [[0]] * len(chunk))) == 0
    path.write_bytes(ctx.state_get_data())


def one_rep(spec: dict, rep: int, baseline: str | None) -> dict[str, dict]:
    trees = {str(ROOT): ["off", "off+sub", "on+sub"]}
    if baseline:
        trees[str(Path(baseline).resolve())] = ["baseline"]
    names = [n for group in trees.values() for n in group]
    order = names[rep % len(names):] + names[:rep % len(names)]
    return run_worker({**spec, "trees": trees, "order": order})


def paired(rows: list[dict[str, dict]], a: str, b: str) -> float:
    return statistics.median(r[a]["tok_s"] / r[b]["tok_s"] for r in rows)


def report(setup: str, rows: list[dict[str, dict]]) -> None:
    print(f"\n{setup} (widest window {rows[0]['off']['n_kv']} cells): median decode tok/s")
    for name in rows[0]:
        each = ", ".join(f"{r[name]['tok_s']:.1f}" for r in rows)
        print(f"  {name:9s} {statistics.median(r[name]['tok_s'] for r in rows):8.1f}   reps: {each}")
    print(f"  off+sub / off:          {paired(rows, 'off+sub', 'off'):.3f}   (building the other events)")
    print(f"  on+sub / off+sub:       {paired(rows, 'on+sub', 'off+sub'):.3f}   (the probe; "
          f"{rows[0]['on+sub']['attention_events']} AttentionWeights events in {rows[0]['on+sub']['decodes']} "
          "timed decodes)")
    if "baseline" in rows[0]:
        print(f"  off / baseline:         {paired(rows, 'off', 'baseline'):.3f}   (probe off, nobody listening)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each run (0: torch's default)")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--baseline", help="another kvscope checkout, timed with the probe-less default")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from decode import write_model  # bench/decode.py's ~100M llama

    setups = args.setups.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {"demo": "demo"}
        if any(SETUPS[s][0] == "llama100m" for s in setups):
            models["llama100m"] = str(write_model(tmp))
        specs = {}
        for s in setups:
            model, n_ctx, n_prompt = SETUPS[s]
            write_state(models[model], n_ctx, n_prompt, tmp / f"{s}.state")
            specs[s] = {"model": models[model], "n_ctx": n_ctx, "prompt": n_prompt, "new": args.new,
                        "threads": args.threads, "state": str(tmp / f"{s}.state")}
        rows: dict[str, list[dict[str, dict]]] = {s: [] for s in setups}
        for rep in range(args.reps):
            for s in setups:
                rows[s].append(one_rep(specs[s], rep, args.baseline))
                print(f"rep {rep + 1} {s}: " + ", ".join(f"{v} {r['tok_s']:.1f}" for v, r in rows[s][-1].items()),
                      flush=True)
    for s in setups:
        report(s, rows[s])


if __name__ == "__main__":
    main()
