"""The `kvscope` command's subcommands. Their flags, named as in llama.cpp's tools, and what the flags mean
as settings live in engine/llama_flags.py, which the launcher and the explorers share. Nothing here
imports torch until a command runs, so `kvscope --help` answers at once."""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import time

from engine.errors import KvscopeError
from engine.kv.cells import MAX_SEQ
from engine.llama_flags import (
    begin_session,
    build_parser,
    checked_context_settings,
    hint_kv_cache_debug,
    sampler_params,
    session_settings,
)

log = logging.getLogger("kvscope.cli")

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader went away

def _load_model(args: argparse.Namespace):
    """(model, load time in ms)."""
    import engine

    t_load = time.perf_counter()
    model = engine.load_model(args.model, dtype=args.dtype)
    return model, (time.perf_counter() - t_load) * 1e3


def cmd_generate(args: argparse.Namespace, bus=None) -> int:
    """bus: the EventBus the context publishes on (`record` passes one with a recorder attached)."""
    import engine
    from engine.runners.generate import Generator, check_n_predict

    settings = checked_context_settings(args, args.parallel)
    check_n_predict(args.n_predict)
    params = sampler_params(args)
    hint_kv_cache_debug(args.verbose)
    model, load_ms = _load_model(args)
    ctx = engine.Context(model, bus=bus, **settings)
    gen = Generator(ctx, params, context_shift=args.context_shift, n_keep=args.keep)
    log.info("sampler seed: %d", gen.sampler.seed)
    n_par = args.parallel
    if n_par == 1:
        sys.stdout.write(args.prompt)
        result = gen.generate(args.prompt, args.n_predict, on_text=lambda _s, text: _write(text))
        sys.stdout.write("\n")
        results = [result]
    else:
        results = gen.generate_parallel([args.prompt] * n_par, args.n_predict)
        for r in results:
            sys.stdout.write(f"\n[seq {r.seq_id}] {args.prompt}{r.text}\n")
    sys.stdout.flush()
    for r in results:
        if r.stop_reason not in ("length", "eog"):
            log.warning("seq %d stopped: %s", r.seq_id, r.stop_reason)
    _print_perf(ctx, gen, load_ms, args.verbose)
    return 0


def cmd_parallel(args: argparse.Namespace, bus=None) -> int:
    """bus: as for cmd_generate."""
    import engine
    from engine.runners.parallel import (
        DEFAULT_SYSTEM_PROMPT,
        ParallelRunner,
        check_system_prompt,
    )
    from engine.runners.parallel_workload import make_schedule

    if args.sequences < 0:
        raise KvscopeError(f"--sequences must be >= 0, got {args.sequences}")
    if args.parallel >= MAX_SEQ:
        raise KvscopeError(f"-np must be <= {MAX_SEQ - 1} for parallel, got {args.parallel}: sequence 0 holds the "
                           f"shared system prompt, so the context needs -np + 1 sequences, and it holds at most "
                           f"{MAX_SEQ}")
    # one sequence more for the system prompt, as llama-parallel
    settings = checked_context_settings(args, args.parallel + 1)
    params = sampler_params(args)
    system_prompt = DEFAULT_SYSTEM_PROMPT if args.system_prompt is None else args.system_prompt
    check_system_prompt(system_prompt, args.pps)
    requests = make_schedule(args.sequences, seed=args.seed, n_predict=args.n_predict, arrival_gap=args.arrival_gap)
    hint_kv_cache_debug(args.verbose)
    model, load_ms = _load_model(args)
    ctx = engine.Context(model, bus=bus, **settings)
    runner = ParallelRunner(ctx, args.parallel, params, system_prompt=system_prompt, share_system_prompt=args.pps,
                            n_ctx_slot=args.slot_ctx, context_shift=args.context_shift, n_keep=args.keep)
    log.info("sampler seed: %d", runner.seed)
    for info in runner.steps(requests):
        if args.steps:
            tries = " ".join(f"{d.n_tokens}:{d.rc}" for d in info.decodes)
            print(f"step {info.step:4d} {info.phase:6s} tokens {info.n_tokens:5d} (prompt {info.n_prompt_tokens:5d}, "
                  f"gen {info.n_gen_tokens:3d}) decodes [{tries}] kv used {info.kv_used:6d} "
                  f"admitted {[a[0] for a in info.admitted]} finished {[r.request.id for r in info.finished]}")
        for r in info.finished:
            _print_request(r, runner.n_sequences)
    sys.stdout.flush()
    summary = runner.summary()
    print()
    for line in summary.lines(str(args.model)):
        print(line)
    print()
    sys.stdout.flush()
    _print_perf(ctx, runner, load_ms, args.verbose)
    return 0


def _print_request(r, n_sequences: int) -> None:
    if r.ok:
        print(f"Client {r.client:3d}, seq {r.request.id:3d}/{n_sequences:3d}, prompt {r.n_prompt:4d} t, response "
              f"{r.n_decoded:4d} t, time {r.time_s:5.2f} s, speed {r.speed:5.2f} t/s, cache miss {r.cache_misses} \n")
        print(f"Input:    {r.request.question.strip()}")
        print(f"Response: {r.text.strip()}\n")
    else:
        print(f"Client {r.client:3d}, seq {r.request.id:3d}/{n_sequences:3d}, prompt {r.n_prompt:4d} t, response "
              f"{r.n_decoded:4d} t: {r.stop_reason}: {r.error}\n")
        print(f"Input:    {r.request.question.strip()}\n")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _print_perf(ctx, gen, load_ms: float, verbose: bool = False) -> None:
    perf = ctx.perf
    name = "llama_perf_context_print"

    def rate(ms: float, n: int) -> tuple[float, float]:
        return (ms / n if n else 0.0, 1e3 * n / ms if ms > 0 else 0.0)

    lines = [f"{name}:        load time = {load_ms:10.2f} ms"]
    per, tps = rate(perf.t_p_eval_ms, perf.n_p_eval)
    lines.append(f"{name}: prompt eval time = {perf.t_p_eval_ms:10.2f} ms / {perf.n_p_eval:5d} tokens "
                 f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)")
    per, tps = rate(perf.t_eval_ms, perf.n_eval)
    lines.append(f"{name}:        eval time = {perf.t_eval_ms:10.2f} ms / {perf.n_eval:5d} runs   "
                 f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)")
    per, tps = rate(gen.t_sample_ms, gen.n_sample)
    lines.append(f"{name}:    sampling time = {gen.t_sample_ms:10.2f} ms / {gen.n_sample:5d} runs   "
                 f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)")
    total = load_ms + perf.t_p_eval_ms + perf.t_eval_ms + gen.t_sample_ms
    lines.append(f"{name}:       total time = {total:10.2f} ms / {perf.n_p_eval + perf.n_eval:5d} tokens")
    if ctx.placement.gpus_present:
        # not a llama.cpp line: the traffic between devices that offloading costs (activations, logits)
        lines.append(f"kvscope_perf_print: device transfers = {perf.bytes_moved / 2 ** 20:10.2f} MiB / "
                     f"{perf.n_tokens_computed:5d} tokens ({perf.bytes_moved_per_token:8.0f} bytes per token, "
                     f"{perf.copy_ms:8.2f} ms copying)")
    if verbose:  # llama.cpp's tools print the breakdown at exit; kvscope also prints it after load
        lines += ctx.memory_breakdown_lines()
    for line in lines:
        print(line, file=sys.stderr)


def cmd_server_sim(args: argparse.Namespace) -> int:
    import engine
    from engine.runners.server import ServerLog, ServerParams, ServerSim
    from engine.runners.server.conversations import ChatRunner, load_script
    from engine.runners.server.report import turn_table
    from engine.runners.server.workload import DEMO_CHAT

    conversations = load_script(args.chat or DEMO_CHAT)  # a bad script is told before the model loads
    params = ServerParams(n_slots=args.parallel, slot_prompt_similarity=args.slot_prompt_similarity,
                          cache_reuse=args.cache_reuse, ctx_checkpoints=args.ctx_checkpoints,
                          checkpoint_min_step=args.checkpoint_min_step, context_shift=args.context_shift,
                          cache_ram_mib=args.cache_ram, cache_idle_slots=args.cache_idle_slots,
                          sampler=sampler_params(args))
    settings = checked_context_settings(args, args.parallel)
    model, _ = _load_model(args)
    ctx = engine.Context(model, **settings)
    sim = ServerSim(ctx, params, log=ServerLog(ctx.bus, verbose=args.verbose, echo=_write_line))
    runner = ChatRunner(sim, conversations, n_keep=args.keep)
    results = runner.run()
    _write_line("")
    for line in turn_table(results):
        _write_line(line)
    _write_line(f"checkpoints held at the end: {sim.checkpoints.bytes_held / 2**20:.3f} MiB of host memory")
    return 0


def _write_line(text: str) -> None:
    _write(text + "\n")


def cmd_estimate(args: argparse.Namespace) -> int:
    import json

    from engine.sizing.estimate import estimate, fit, format_table

    kwargs = checked_context_settings(args, args.parallel, ignores_gpu_layers=args.fit)
    if args.fit:
        est = fit(args.model, dtype=args.dtype, fit_target=args.fit_target << 20, fit_ctx_min=args.fit_ctx, **kwargs)
    else:
        est = estimate(args.model, dtype=args.dtype, **kwargs)
    if args.fit and not args.json:
        print(f"proposed: -ngl {est.placement.n_gpu_layers} -c {est.params.n_ctx}")
    print(json.dumps(est.to_dict(), indent=2) if args.json else format_table(est))
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.testing.tiny_models import write_tiny_llama_demo

    try:
        hf, gguf_path = write_tiny_llama_demo(args.folder)
    except ModuleNotFoundError as e:  # the writer builds the model with transformers, a test dependency
        raise KvscopeError(f"make-tiny-model needs the package {e.name!r}, which the test dependencies bring: "
                           f"pip install -e '.[dev]'") from None
    print(f"wrote {hf} and {gguf_path}")
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    """Run generate or parallel with a Recorder on the context's bus."""
    from engine.events import EventBus
    from engine.watch.recording import Recorder

    if args.keyframe_every < 1:
        raise KvscopeError(f"--keyframe-every must be >= 1, got {args.keyframe_every}")
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "recorded", "output", "keyframe_every")}
    bus = EventBus()
    recorder = Recorder(args.output, args.keyframe_every, info={"command": args.recorded, "settings": settings})
    recorder.attach(bus)
    recorder.start()
    try:
        rc = {"generate": cmd_generate, "parallel": cmd_parallel}[args.recorded](args, bus=bus)
    except BaseException:
        try:
            _close_recording(recorder, quiet=recorder.n_events == 0)
        except KvscopeError as e:  # the command's own error is the one to report
            log.warning("warning: %s", e)
        raise
    _close_recording(recorder, quiet=False)
    return rc


def _close_recording(recorder, quiet: bool) -> None:
    """Complete the file and say what it holds; `quiet`: the command failed before any event, so there is
    nothing worth keeping and the file goes."""
    recorder.close()
    if quiet:
        recorder.path.unlink(missing_ok=True)
        return
    print(f"kvscope record: wrote {recorder.n_events} events, {recorder.n_keyframes} keyframes, "
          f"{recorder.bytes_written} bytes to {recorder.path}", file=sys.stderr)
    if recorder.dropped:
        log.warning("warning: the recorder's queue overflowed and %d events are missing from the recording (an "
                    "EventsDropped event marks where)", recorder.dropped)


def cmd_attach(args: argparse.Namespace) -> int:
    """A real llama.cpp's cache from its own log: recorded (-o), in the explorer, or as text frames
    (engine/runners/attach_command.py)."""
    from engine.runners.attach_command import run_attach

    return run_attach(args, getattr(args, "explorer_app", None))


def cmd_serve(args: argparse.Namespace) -> int:
    """A Session served over ZeroMQ until SIGINT or SIGTERM (engine/runners/serve.py); with --kv-events, its cache
    published as vLLM's KV events too (engine/runners/kv_events_publisher.py)."""
    from engine.events import EventBus
    from engine.runners.serve import SessionServer, stop_on_signals, wait_until_stopped
    from engine.runners.session import Session

    settings, spec = session_settings(args)
    _check_kv_event_flags(args)
    bus = EventBus()
    with SessionServer(args.bind, args.port, args.token, no_token=args.no_token, state_dir=args.state_dir,
                       models_dir=args.models_dir) as server:  # binds now: a taken port fails before loading
        publisher = _kv_event_publisher(args, bus)  # binds now too
        try:
            session = Session(args.model, settings=settings, workload=spec, steps_per_second=args.speed,
                              dtype=args.dtype, bus=bus)
        except BaseException:
            if publisher is not None:
                publisher.close()
            raise
        with stop_on_signals() as stop:  # from here on a signal stops cleanly, closing included
            try:
                server.start(session)
                if publisher is not None:
                    publisher.start()
                begin_session(session, args)
                _print_serve_banner(server, session, publisher)
                reason = wait_until_stopped(server, stop)
            finally:
                server.close()  # first: clients hear that the server stops, not that the session closed
                session.close()
                if publisher is not None:  # last: what the session did up to its end goes out
                    publisher.close()
    published = "" if publisher is None else f", {publisher.stats.batches} KV event batches published"
    print(f"kvscope serve: stopped ({reason}) after {server.commands} commands ({server.refused} refused), "
          f"{server.events_sent} events sent{published}", file=sys.stderr)
    return 0


def _kv_event_options(args: argparse.Namespace) -> dict:
    # data_parallel_rank 0: what a vLLM of one data-parallel rank sends
    return dict(replay_endpoint=args.kv_events_replay, block_size=args.block_size, topic=args.kv_events_topic,
                dialect=args.kv_events_dialect, rank=0)


def _check_kv_event_flags(args: argparse.Namespace) -> None:
    """--kv-events and the flags that need it, refused before any port is taken or model loaded."""
    if args.kv_events is not None:
        from engine.runners.kv_events_publisher import check_options

        check_options(args.kv_events, **_kv_event_options(args))
        return
    given = [flag for flag, value, default in (("--kv-events-replay", args.kv_events_replay, None),
                                               ("--block-size", args.block_size, 16),
                                               ("--kv-events-topic", args.kv_events_topic, ""),
                                               ("--kv-events-dialect", args.kv_events_dialect, "map"))
             if value != default]
    if given:
        raise KvscopeError(f"{', '.join(given)} only with --kv-events ENDPOINT (where the KV events go)")


def _kv_event_publisher(args: argparse.Namespace, bus):
    """The --kv-events publisher, bound (None without --kv-events)."""
    if args.kv_events is None:
        return None
    from engine.runners.kv_events_publisher import KvEventPublisher

    return KvEventPublisher(bus, args.kv_events, **_kv_event_options(args))


def _print_serve_banner(server, session, publisher=None) -> None:
    """Where to connect, on stdout (a script reads it): with the token when commands need one."""
    import socket

    status = session.status()
    host = socket.gethostname() if server.bind in ("0.0.0.0", "*", "::") else server.bind
    token = f", token={server.token!r}" if server.token else ""
    lines = [f"kvscope serve: {status.model}, {status.workload} workload, {status.state}",
             f"kvscope serve: commands on {server.command_address}, events on {server.event_address}"]
    lines += [f"kvscope serve: {line}" for line in server.access_lines()]
    if publisher is not None:
        lines.append(f"kvscope serve: {publisher.banner()}, no token: whoever connects reads the prompts' token ids")
    lines += [f"kvscope serve: connect with RemoteSession(\"tcp://{host}:{server.port}\"{token})",
              "kvscope serve: ready; SIGINT (Ctrl-C) or SIGTERM stops it"]
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None, *, explorer_app=None) -> int:
    """explorer_app: what loads the terminal explorer (the kvscope command, kvscope/launcher.py, passes it to
    `attach`: the engine never imports its front-ends)."""
    args = build_parser().parse_args(argv)
    args.explorer_app = explorer_app
    logger = logging.getLogger("kvscope")
    level = logger.level
    handler = _log_to_stderr(verbose=getattr(args, "verbose", False))
    try:
        return _run(args)
    except BrokenPipeError:
        return _stdout_reader_gone()
    finally:  # called in-process (a test, a notebook), -v must not leave kvscope's logger at DEBUG
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args: argparse.Namespace) -> int:
    if args.command == "tui":  # the engine never imports its front-ends: the kvscope command starts it
        raise KvscopeError("the terminal explorer starts from the kvscope command (kvscope.launcher), not engine.cli")
    commands = {"generate": cmd_generate, "parallel": cmd_parallel, "estimate": cmd_estimate,
                "make-tiny-model": cmd_make_tiny_model, "record": cmd_record,
                "serve": cmd_serve, "server-sim": cmd_server_sim, "attach": cmd_attach}
    try:
        rc = commands[args.command](args)
        sys.stdout.flush()  # now rather than at exit, so that a reader that went away is noticed in main
        return rc
    except KvscopeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # sampler parameter validation
        print(f"error: {e}", file=sys.stderr)
        return 2


def _stdout_reader_gone() -> int:
    """The reader of stdout closed the pipe (`kvscope ... | head`): stop quietly, as Unix tools do. stdout
    is pointed at /dev/null so that Python's own flush at exit has nothing left to fail on."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, io.UnsupportedOperation):  # a stdout without a file descriptor
        pass
    return SIGPIPE_EXIT


def _log_to_stderr(verbose: bool) -> logging.Handler:
    """llama.cpp prints its log lines bare on stderr; so does kvscope's command."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("kvscope")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    return handler


if __name__ == "__main__":
    sys.exit(main())
