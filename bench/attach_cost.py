"""What watching a real llama.cpp costs: llama-server's token rate with and without the slot-search dump
(LLAMA_KV_CACHE_DEBUG=3 with -v), the log it then writes per second, and how fast kvscope's parser reads
that log (engine/watch/llama_log), on a 4k- and a 32k-cell cache.

    python bench/attach_cost.py [--bin DIR] [--model FILE] [--contexts 4096,32768] [--predict 64] [--reps 2]

--bin: the folder with llama-server (default $KVSCOPE_LLAMA_BIN). --model: a GGUF (default the bundled demo
model, a 26 MB gemma3: its full-attention cache has the context's cells, its sliding-window cache a few
hundred). Each rep starts a fresh server per setting, in turn (plain; -v; -v and the dump), sends one
/completion of --predict tokens after a short prompt, and reads the server's own timings. The log written
during that request is then parsed in one piece (every dump decoded) and in 4 MB reads with coalescing on
(what `kvscope attach` does when it falls behind: of several dumps of a stream in one read only the last is
decoded). Medians over reps.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.watch.llama_log import LlamaLogParser  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "engine" / "models" / "demo" / "kvscope-demo-gemma3.gguf"
SETTINGS = {"plain": ([], {}), "-v": (["-v"], {}), "-v + dump": (["-v"], {"LLAMA_KV_CACHE_DEBUG": "3"})}
PROMPT = "The cache of a language model keeps the keys and values of every token it has seen, so that"
READ = 4 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(port: int, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("llama-server did not answer /health")


def one_run(server: Path, model: Path, n_ctx: int, setting: str, predict: int, log_path: Path) -> dict:
    args, env = SETTINGS[setting]
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(server), "-m", str(model), "-c", str(n_ctx), "-np", "1", "-t", "2",
                                 "--port", str(port), "--no-webui", "--seed", "1", *args],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_ready(port, proc)
        start_bytes = log_path.stat().st_size
        t0 = time.perf_counter()
        answer = post(port, "/completion", {"prompt": PROMPT, "n_predict": predict, "cache_prompt": False,
                                            "temperature": 0, "ignore_eos": True})
        wall = time.perf_counter() - t0
        time.sleep(0.3)  # the log worker writes what is queued
        end_bytes = log_path.stat().st_size
    finally:
        proc.terminate()
        proc.wait(30)
    timings = answer["timings"]
    return {"decode_tps": timings["predicted_per_second"], "prompt_tps": timings["prompt_per_second"],
            "log_bytes": end_bytes - start_bytes, "wall": wall, "start": start_bytes, "end": end_bytes}


def parse_speed(data: bytes) -> dict:
    parser = LlamaLogParser()
    t0 = time.perf_counter()
    parser.feed(data)
    parser.finish()
    every = time.perf_counter() - t0
    coalesced = LlamaLogParser()
    coalesced.coalesce = True
    t0 = time.perf_counter()
    for at in range(0, len(data), READ):
        coalesced.feed(data[at:at + READ])
    coalesced.finish()
    fast = time.perf_counter() - t0
    return {"mb_s": len(data) / every / 1e6, "dumps_s": parser.stats.dumps / every, "dumps": parser.stats.dumps,
            "damaged": parser.stats.dumps_damaged, "coalesced_mb_s": len(data) / fast / 1e6,
            "coalesced_dropped": coalesced.stats.dumps_dropped}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.environ.get("KVSCOPE_LLAMA_BIN", ""))
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--predict", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    server = Path(args.bin) / "llama-server"
    if not server.is_file():
        print(f"no llama-server in {args.bin or '(set --bin or KVSCOPE_LLAMA_BIN)'}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        for n_ctx in (int(c) for c in args.contexts.split(",")):
            runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
            for rep in range(args.reps):
                for setting in SETTINGS:
                    log_path = Path(tmp) / f"{n_ctx}-{rep}-{setting.replace(' ', '')}.log"
                    run = one_run(server, args.model, n_ctx, setting, args.predict, log_path)
                    if setting == "-v + dump":
                        with open(log_path, "rb") as f:
                            f.seek(run["start"])
                            run.update(parse_speed(f.read(run["end"] - run["start"])))
                    runs[setting].append(run)
            med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
            dump = med["-v + dump"]
            log_rate = dump["log_bytes"] / dump["wall"] / 1e6
            print(f"n_ctx {n_ctx} ({args.model.name}, {args.predict} tokens, median of {args.reps}):")
            for s in SETTINGS:
                print(f"  {s:10s} decode {med[s]['decode_tps']:8.1f} tok/s ({med[s]['decode_tps'] / med['plain']['decode_tps']:.2f}x plain)"
                      f"  prompt {med[s]['prompt_tps']:8.1f} tok/s  log {med[s]['log_bytes'] / 1e6:7.2f} MB")
            print(f"  the dump's log: {log_rate:.1f} MB/s while generating, {dump['dumps']:.0f} dumps")
            print(f"  parser, every dump decoded: {dump['mb_s']:.1f} MB/s, {dump['dumps_s']:.0f} dumps/s "
                  f"({dump['mb_s'] / log_rate:.2f}x the log's rate), damaged {dump['damaged']:.0f}")
            print(f"  parser, 4 MB reads coalesced: {dump['coalesced_mb_s']:.1f} MB/s "
                  f"({dump['coalesced_mb_s'] / log_rate:.2f}x), {dump['coalesced_dropped']:.0f} dumps dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
