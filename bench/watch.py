"""Rates of the live layer: how fast the watch layer absorbs events, what a session and a watcher cost a
decode, and how long a view's frame of a large cache takes.

    python bench/watch.py [--reps 5]

- events/s: the events of single-token decodes with 4 split streams (each decode: one token of each of
  4 sequences), recorded once, then applied to fresh watchers (cache mirror + frames + cell history),
  and to a bare CacheMirror for comparison.
- session overhead: tokens/s of the demo model generating 4 sequences together, run by a plain
  GenerationRun on the main thread vs by a threaded Session (which loads the model on its worker) with
  a Watcher polled 20 times a second from the main thread (a UI's redraw rate). Each run is a process
  of its own, as a front-end is: interleaved, medians of per-pair ratios.
- frame: Watcher.frame() of a 32768-cell cache whose cells all hold sequences.
Other jobs share the machine: compare ratios measured in one run.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import engine
from engine import events as ev
from engine.batch import Batch
from engine.runners.generate import Generator
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.sampling import SamplerParams
from engine.watch.mirror import CacheMirror
from engine.watch.watcher import Watcher

GREEDY = SamplerParams(temperature=0.0, seed=1)
PROMPTS = ["And God said unto Moses", "In the beginning", "And the LORD spake", "Blessed are they"]


class _Recorded:
    """A finished event stream, seen as a watcher's subscription."""

    def __init__(self, events: list[ev.Event]) -> None:
        self.events, self.dropped = events, 0

    def drain(self) -> list[ev.Event]:
        out, self.events = self.events, []
        return out


def four_stream_events(model, n_steps: int) -> list[ev.Event]:
    ctx = engine.Context(model, n_ctx=4 * 2048, n_seq_max=4, kv_unified=False, swa_full=True)
    sub = ctx.bus.subscribe(maxsize=1 << 22)
    for step in range(n_steps):
        assert ctx.decode(Batch([5, 6, 7, 8], [step] * 4, [[0], [1], [2], [3]])) == 0
    return sub.drain()


def events_per_second(events: list[ev.Event], reps: int) -> tuple[float, float]:
    watcher_s, mirror_s = [], []
    for _ in range(reps):
        watcher = Watcher(_Recorded(list(events)))
        t0 = time.perf_counter()
        watcher.poll()
        watcher_s.append(time.perf_counter() - t0)
        mirror = CacheMirror()
        t0 = time.perf_counter()
        for event in events:
            mirror.apply(event)
        mirror_s.append(time.perf_counter() - t0)
    return len(events) / statistics.median(watcher_s), len(events) / statistics.median(mirror_s)


def plain_tokens_per_second(model_path: str, n_new: int) -> float:
    model = engine.load_model(model_path)
    ctx = engine.Context(model, n_ctx=512, n_seq_max=4, kv_unified=True)
    run = Generator(ctx, GREEDY).run()
    for s, prompt in enumerate(PROMPTS):
        run.add(prompt, s, n_new)
    run.step()  # the prefill, not timed: both sides time decodes only
    t0, n = time.perf_counter(), 0
    while run.step():
        n += 1
    return n * len(PROMPTS) / (time.perf_counter() - t0)


def session_tokens_per_second(model_path: str, n_new: int) -> float:
    spec = WorkloadSpec("generate", n_predict=n_new, sampler=GREEDY)
    with Session(model_path, settings=dict(n_ctx=512, n_seq_max=4, kv_unified=True), workload=spec) as session:
        watcher = Watcher.of(session)
        steps = session.subscribe(kinds=(ev.WorkloadStep,))
        for prompt in PROMPTS:
            session.add_prompt(prompt).result()
        session.step(1).result()  # the prefill
        steps.drain()
        session.start().result()
        while session.status().state == "running":  # the UI: poll and take a frame 20 times a second
            watcher.poll()
            watcher.frame()
            time.sleep(0.05)
        decoded = [e for e in steps.drain() if e.phase == "batch"]
        # timed by the steps' own events: the UI's 50 ms naps would otherwise count after the last step
        elapsed = decoded[-1].time - decoded[0].time + decoded[0].ms / 1e3
        return len(decoded) * len(PROMPTS) / elapsed


def run_variant(variant: str, model_path: str, n_new: int) -> float:
    """tokens/s of one run in a process of its own."""
    out = subprocess.run([sys.executable, __file__, "--variant", variant, "--model", model_path, "--new", str(n_new)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def frame_ms(reps: int, size: int = 32768) -> float:
    mirror_events = [ev.ContextCreated(cache="kv", n_ctx=size, n_ctx_seq=size, kv_size=size, n_stream=1, n_seq_max=4,
                                       n_layer=1, type_k="f16", type_v="f16", v_trans=False, k_bytes=0, v_bytes=0,
                                       n_batch=512, n_ubatch=512, pad=256, unified=True, model_name="bench",
                                       log_lines=())]
    seq = np.zeros((256, size), dtype=bool)
    seq[np.arange(size) % 4, np.arange(size)] = True
    change = ev.StreamCells(0, np.arange(size), np.arange(size), np.zeros(size, dtype=np.int64),
                            ev.pack_seq_bits(seq), 0)
    mirror_events.append(ev.MemorySnapshot(cache="kv", changes=(change,)))
    watcher = Watcher(_Recorded(mirror_events))
    watcher.poll()
    times = []
    for _ in range(reps * 20):
        t0 = time.perf_counter()
        frame = watcher.frame()
        times.append(time.perf_counter() - t0)
    assert frame.stream("kv").used == size
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000, help="decodes whose events are absorbed")
    parser.add_argument("--new", type=int, default=48, help="tokens per sequence in the overhead runs")
    parser.add_argument("--model", default="demo",
                        help="the model of the overhead runs: demo, or 100m (bench/decode.py's ~100M llama, written "
                             "to a temporary folder), or a path")
    parser.add_argument("--variant", choices=["plain", "session"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # one overhead run, in a process of its own
        run = plain_tokens_per_second if args.variant == "plain" else session_tokens_per_second
        print(run(args.model, args.new))
        return

    model = engine.load_model("demo")
    events = four_stream_events(model, args.steps)
    per_s, mirror_per_s = events_per_second(events, args.reps)
    print(f"events absorbed: {per_s:,.0f} events/s by a Watcher (mirror + frames + history), "
          f"{mirror_per_s:,.0f} by a bare CacheMirror ({len(events)} events of {args.steps} 4-stream decodes)")

    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model
        if model_path == "100m":
            sys.path.insert(0, str(Path(__file__).parent))
            from decode import write_model  # noqa: PLC0415 - the decode bench's model, only when asked for

            model_path = str(write_model(Path(tmp)))
        ratios, plain, session = [], [], []
        for _ in range(args.reps):
            p, s = run_variant("plain", model_path, args.new), run_variant("session", model_path, args.new)
            plain.append(p)
            session.append(s)
            ratios.append(s / p)
    print(f"session + watcher at 20 Hz ({args.model}): {statistics.median(session):.1f} tok/s vs plain "
          f"{statistics.median(plain):.1f} tok/s: overhead {100 * (1 - statistics.median(ratios)):+.1f}% (median of "
          f"{args.reps} paired runs)")
    print(f"frame of a 32768-cell cache: {frame_ms(args.reps):.3f} ms")


if __name__ == "__main__":
    main()
