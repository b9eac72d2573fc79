"""What llama-server's cache settings cost and save on a sliding-window model: the server simulation runs
the same chat scripts under each setting, and this prints, per setting, the prompt tokens processed
(prefill), the turns forced to re-process or saved by a checkpoint, the K/V memory of the context and the
host memory the checkpoints and the prompt cache (--cache-ram) hold, at their peak.

    python bench/server_reuse.py [--model demo] [-c 4096] [-ub 512] [--chat FILE ...]

Default chats: the built-in ones (engine/runners/server/chats/): demo.json (two users, a stripped
reasoning block, a changed system prompt, an inserted tool result) and reasoning.json (one user whose
answers carry long reasoning blocks the template strips). Scripted answers are generated as given, so the
numbers do not depend on sampling; timings are measured on this machine.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import engine
from engine import events as ev
from engine.runners.server import ServerLog, ServerParams, ServerSim
from engine.runners.server.conversations import ChatRunner, load_script

CHATS = Path(engine.__file__).parent / "runners" / "server" / "chats"
SETTINGS = (  # name, context settings, server settings
    ("default (SWA cache, 32 checkpoints)", {}, {}),
    ("-ctxcp 0 (no checkpoints)", {}, {"ctx_checkpoints": 0}),
    ("--swa-full", {"swa_full": True}, {}),
)


def kv_bytes(ctx) -> int:
    return sum(e.k_bytes + e.v_bytes for e in ctx.state_events() if isinstance(e, ev.ContextCreated))


def run(model, chat: Path, n_ctx: int, n_ubatch: int, context: dict, server: dict) -> dict:
    ctx = engine.Context(model, n_ctx=n_ctx, n_seq_max=2, n_ubatch=n_ubatch, **context)
    sim = ServerSim(ctx, ServerParams(n_slots=2, **server), log=ServerLog(ctx.bus, verbose=False))
    peak, cached = [0], [0]
    sub = ctx.bus.subscribe(kinds=(ev.CheckpointChanged,))
    started = time.perf_counter()
    runner = ChatRunner(sim, load_script(chat))
    while not runner.done:
        runner.step()
        sub.drain()
        peak[0] = max(peak[0], sim.checkpoints.bytes_held)
        cached[0] = max(cached[0], sim.prompt_cache.bytes_held if sim.prompt_cache is not None else 0)
    seconds = time.perf_counter() - started
    results = runner.results
    return {"prompt": sum(r.n_prompt for r in results), "processed": sum(r.n_processed for r in results),
            "forced": sum(r.outcome == "forced" for r in results), "restored": sum(r.outcome == "restored" for r in results),
            "kv_mib": kv_bytes(ctx) / 2**20, "checkpoints_mib": peak[0] / 2**20, "cache_mib": cached[0] / 2**20,
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("-c", "--ctx-size", type=int, default=4096)
    parser.add_argument("-ub", "--ubatch-size", type=int, default=512)
    parser.add_argument("--chat", action="append", default=None, help="a chat script (repeatable)")
    args = parser.parse_args()
    model = engine.load_model(args.model)
    chats = [Path(c) for c in args.chat] if args.chat else [CHATS / "demo.json", CHATS / "reasoning.json"]
    print(f"{model.config.name}: window {model.config.n_swa}, -c {args.ctx_size} -np 2 -ub {args.ubatch_size}")
    for chat in chats:
        print(f"\n{chat.name}")
        print(f"  {'setting':<38} {'processed':>14} {'forced':>6} {'restored':>8} {'K/V MiB':>8} {'ckpt MiB':>8} "
              f"{'cache MiB':>9} {'s':>6}")
        for name, context, server in SETTINGS:
            r = run(model, chat, args.ctx_size, args.ubatch_size, context, server)
            print(f"  {name:<38} {r['processed']:>5} of {r['prompt']:<5} {r['forced']:>6} {r['restored']:>8} "
                  f"{r['kv_mib']:>8.1f} {r['checkpoints_mib']:>8.2f} {r['cache_mib']:>9.2f} {r['seconds']:>6.2f}")


if __name__ == "__main__":
    main()
