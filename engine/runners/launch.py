"""What an explorer shows, from its command line: the demo session, a model run here with llama.cpp's
flags, a remote session (--connect) or a recording (--replay). The terminal explorer (`kvscope tui ...`)
and the notebook's `Explorer(...)` both open their source here, so the same flags mean the same thing."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
from collections.abc import Sequence

from engine import llama_flags
from engine.errors import KvscopeError
from engine.watch.sources import Source, remote_source, replay_source, session_source


def threads_beside_a_ui() -> int | None:
    """torch's compute threads for a session that shares its process with an explorer: one core fewer
    than the machine has, so that keys and redraws never wait for a decode's threads (in
    bench/tui_frame.py on 2 cores the slowest of 40 keys took 42-61 ms instead of 51-102 ms). None
    (torch's choice) when OMP_NUM_THREADS says how many."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, (os.cpu_count() or 2) - 1)


def open_source(args: argparse.Namespace, *, demo: bool, threaded: bool = True, start: bool | None = None) -> Source:
    """The source the parsed `tui` flags name; demo: the bundled model with the demo settings.
    start: run the demo (None: when threaded). A threaded session (an explorer beside it) leaves a core
    to the explorer (threads_beside_a_ui); a session stepped by hand (plain frames) keeps them all."""
    if args.connect:
        from engine.watch.remote import RemoteSession

        return remote_source(RemoteSession(args.connect, token=args.token), label=args.connect)
    if args.replay:
        return replay_source(args.replay)
    if demo:
        from engine.runners.demo import demo_session

        session = demo_session(threaded=threaded, steps_per_second=8.0 if threaded else 0.0,
                               threads=threads_beside_a_ui() if threaded else None)
        if threaded if start is None else start:
            session.start()
        return session_source(session, label="demo: the parallel workload on the bundled model")
    from engine.runners.session import Session

    settings, spec = llama_flags.session_settings(args)
    session = Session(args.model, settings=settings, workload=spec, steps_per_second=args.speed, dtype=args.dtype,
                      threaded=threaded, threads=threads_beside_a_ui() if threaded else None)
    llama_flags.begin_session(session, args)
    return session_source(session, label=str(args.model))


def parse_tui_flags(flags: str | Sequence[str] = ()) -> argparse.Namespace:
    """`kvscope tui`'s flags (a string is split as a shell would) as parsed arguments. A bad flag raises
    KvscopeError with argparse's message instead of exiting, so a notebook survives it."""
    words = shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags]
    told = io.StringIO()
    try:
        with contextlib.redirect_stderr(told):
            return llama_flags.build_parser().parse_args(["tui", *words])
    except SystemExit:
        lines = [line for line in told.getvalue().splitlines() if line.strip()]
        raise KvscopeError(f"kvscope tui {' '.join(words)}: {lines[-1] if lines else 'bad flags'}") from None


def source_from_flags(flags: str | Sequence[str] = (), *, threaded: bool = True, start: bool | None = None) -> Source:
    """The source `kvscope tui FLAGS` would show (no flags: the demo)."""
    args = parse_tui_flags(flags)
    words = shlex.split(flags) if isinstance(flags, str) else list(flags)
    return open_source(args, demo=not words, threaded=threaded, start=start)


def attached_log_source(log=None, command: str | Sequence[str] | None = None, *, follow: bool = False,
                        passthrough=None) -> Source:
    """A real llama.cpp's log as an explorer's source (engine/runners/attach.py), already reading: a saved log
    (`log`, with `follow` to keep reading as it grows) or a command started here (`command`, a list or a string
    split as a shell would; LLAMA_KV_CACHE_DEBUG=3 and -v added, its raw output to `passthrough`, by default a
    temporary file). Its watcher subscribes before the reading starts, so it gets every event from the first
    line. Closing the source ends the process."""
    from engine.runners.attach import AttachedLog
    from engine.watch.sources import attached_source

    if (log is None) == (command is None):
        raise KvscopeError("attach: give a log file or a command to run, one of the two")
    if log is not None and passthrough is not None:
        raise KvscopeError("attach: passthrough goes with a command run here, not a log file")
    if command is not None:
        argv = shlex.split(command) if isinstance(command, str) else [str(word) for word in command]
        attached = AttachedLog.run(argv, passthrough=passthrough, start=False)
    else:
        attached = AttachedLog.read(log, follow=follow, start=False)
    try:
        source = attached_source(attached)
        attached.start()
        return source
    except BaseException:
        attached.close()
        raise
