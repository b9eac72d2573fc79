"""`kvscope attach`: a real llama.cpp's cache from its own log (engine/runners/attach.py), a command run here
or a saved log (--log, --follow), recorded (-o, no view), in the terminal explorer, or as text frames
without a terminal. It runs until the log's end (--log without --follow), the command's exit, --seconds,
SIGINT or SIGTERM (and q in the explorer); a command it started ends with it. With --vllm it watches vLLM or
SGLang KV event publishers instead (engine/runners/kv_events_command.py), with the same views and recording.

Exit status: 0 when the log was read or kvscope ended the command (asked to stop: a signal, --seconds, q);
the command's own when it ended by itself (128 + N when signal N killed it), so that a script sees
llama.cpp's failure. Errors (a command not found, a log that cannot be read) are KvscopeError: `error: ...`
and exit status 1, as every kvscope command's."""
from __future__ import annotations

import argparse
import functools
import shlex
import signal
import sys
import threading
import time
from typing import Callable

from engine.errors import KvscopeError
from engine.runners.attach import AttachedLog, exit_status

View = Callable[["SignalStop", "float | None"], None]  # runs until the log ends or it is told to stop


class SignalStop:
    """SIGINT and SIGTERM ask for a stop, within the block. The handler only notes which signal came: one
    that took a lock (threading.Event.set does) could wait forever for the lock the interrupted main thread
    holds."""

    def __init__(self) -> None:
        self.reason = ""

    def __enter__(self) -> SignalStop:
        self._previous = {sig: signal.signal(sig, self._note) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, _frame) -> None:
        self.reason = self.reason or signal.Signals(signum).name

    def due(self, deadline: float | None) -> bool:
        """A signal came, or the deadline (time.monotonic()) passed."""
        return bool(self.reason) or (deadline is not None and time.monotonic() >= deadline)


def run_attach(args: argparse.Namespace, explorer_app: Callable[[], type] | None = None) -> int:
    """`kvscope attach` with its parsed flags (engine/llama_flags.py); returns the exit status. explorer_app:
    what loads the terminal explorer's App class (the kvscope command passes it: the engine never imports
    its front-ends); without it, a terminal gets text frames too. With --vllm: vLLM / SGLang KV event publishers
    (engine/runners/kv_events_command.py)."""
    if args.vllm:
        from engine.runners.kv_events_command import run_kv_events_attach

        return run_kv_events_attach(args, explorer_app)
    argv = checked_command(args)
    interactive = not args.output and sys.stdout.isatty() and sys.stdin.isatty()
    # a missing textual is told before anything starts
    explorer = explorer_app() if interactive and explorer_app is not None else None
    # Not started yet: the recording and the views subscribe first, and get every event from the first line.
    attached = AttachedLog.run(argv, passthrough=args.passthrough, start=False) if argv else \
        AttachedLog.read(args.log, follow=args.follow, start=False)
    from engine.runners.attach_frames import print_frames
    from engine.watch.sources import attached_source

    watch_until_stopped(args, attached, explorer, make_recorder=functools.partial(_recorder, args, attached),
                        make_source=lambda: attached_source(attached), print_frames=print_frames,
                        say_started=lambda: _say_what_runs(attached))
    _say_how_it_ended(attached)
    if attached.error is not None:
        raise KvscopeError(attached.status.message)
    if attached.returncode is not None and not attached.ended_by_kvscope:
        return exit_status(attached.returncode)
    return 0


def checked_command(args: argparse.Namespace) -> list[str]:
    """The command to run (empty with --log), after checking that the flags go together."""
    from engine.runners.kv_events_command import check_kv_event_flags

    check_kv_event_flags(args)  # --vllm's own flags, given without it
    argv = list(args.run)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if args.log is not None and argv:
        raise KvscopeError(f"attach: give --log FILE or a command after --, not both (got --log {args.log} and "
                           f"{shlex.join(argv)})")
    if args.log is None and not argv:
        raise KvscopeError("attach: nothing to watch: give a command to run after -- (kvscope attach -- llama-server "
                           "-m model.gguf) or a saved log (kvscope attach --log FILE)")
    if args.follow and args.log is None:
        raise KvscopeError("attach: --follow goes with --log FILE (a command run here is followed anyway)")
    if args.passthrough is not None and args.log is not None:
        raise KvscopeError("attach: --passthrough goes with a command run here; --log reads a file already written")
    check_watch_flags(args)
    return argv


def check_watch_flags(args: argparse.Namespace) -> None:
    """The flags of how long and how a watch runs, whatever is watched (a llama.cpp log, KV event publishers)."""
    if args.seconds is not None and not args.seconds > 0:
        raise KvscopeError(f"attach: --seconds must be > 0, got {args.seconds}")
    if not args.plain_every > 0:
        raise KvscopeError(f"attach: --plain-every must be > 0, got {args.plain_every}")
    if args.keyframe_every < 1:
        raise KvscopeError(f"attach: --keyframe-every must be >= 1, got {args.keyframe_every}")


def watch_until_stopped(args: argparse.Namespace, watched, explorer, *, make_recorder: Callable[[], object],
                        make_source: Callable[[], object], print_frames: Callable[..., None],
                        say_started: Callable[[], None]) -> None:
    """Record (-o), explore (a terminal) or print text frames of `watched` (an AttachedLog or a KvEventSubscriber:
    start(), close(), started, finished) until it ends, --seconds passes or a signal (or q) asks to stop. The
    recording and the view subscribe before it starts, and so get every event."""
    recorder = None
    with SignalStop() as stop:
        try:
            if args.output:
                recorder = make_recorder()
                view: View = functools.partial(_wait, watched)
            elif explorer is not None:
                view = _explorer_view(explorer, make_source())
            else:
                view = _plain_view(watched, args.plain_every, print_frames)
            watched.start()
            say_started()
            view(stop, None if args.seconds is None else time.monotonic() + args.seconds)
        finally:
            watched.close()  # first: its last events (an exit, the final status and stats) reach the recording
            if recorder is not None:
                _close_recording(recorder, keep=watched.started)


# ---- the recording -------------------------------------------------------------------------------------
def _recorder(args: argparse.Namespace, attached: AttachedLog):
    """The recording -o names, with what was watched in its header, subscribed before the log starts."""
    from engine.watch.recording import Recorder

    info = {"command": "attach", "log": args.log or "", "run": attached.argv, "added": attached.added}
    recorder = Recorder(args.output, args.keyframe_every, info=info)
    recorder.attach(attached)
    recorder.start()
    return recorder


def _close_recording(recorder, keep: bool) -> None:
    """Complete the file and say what it holds; a command that never started leaves nothing to keep."""
    recorder.close()
    if not keep:
        recorder.path.unlink(missing_ok=True)
        return
    print(f"kvscope attach: wrote {recorder.n_events} events, {recorder.n_keyframes} keyframes, "
          f"{recorder.bytes_written} bytes to {recorder.path}", file=sys.stderr)
    if recorder.dropped:
        print(f"kvscope attach: warning: the recorder's queue overflowed and {recorder.dropped} events are missing "
              f"from the recording (an EventsDropped event marks where)", file=sys.stderr)


def _wait(watched, stop: SignalStop, deadline: float | None) -> None:
    """Until the log ends, the command exits, the deadline passes or a signal asks kvscope to stop."""
    while not watched.finished and not stop.due(deadline):
        time.sleep(0.1)  # a sleep, which a signal interrupts: its handler runs at once


# ---- the views -----------------------------------------------------------------------------------------
def _explorer_view(app_class, source) -> View:
    """The terminal explorer on a watched source (engine/watch/sources.py: a llama.cpp log, KV event publishers)
    until q; --seconds and SIGTERM close it from a thread of their own."""
    app = app_class(source)

    def explore(stop: SignalStop, deadline: float | None) -> None:
        shown = threading.Event()

        def close_when_told() -> None:
            while not shown.wait(0.2):
                if stop.due(deadline):
                    try:
                        app.call_from_thread(app.exit)
                        return
                    except RuntimeError:  # its loop has not started yet: try again at the next look
                        continue

        threading.Thread(target=close_when_told, name="kvscope-attach-stop", daemon=True).start()
        try:
            app.run()
        finally:
            shown.set()

    return explore


def _plain_view(watched, every_s: float, print_frames: Callable[..., None]) -> View:
    """Text frames on stdout (no terminal) until what is watched ends; told to stop, kvscope closes it first (ends
    the command it started), so that the last frame shows how it ended."""
    from engine.watch.watcher import Watcher

    watcher = Watcher.of(watched)

    def show(stop: SignalStop, deadline: float | None) -> None:
        def done() -> bool:
            if watched.finished:
                return True
            if stop.due(deadline):
                watched.close()
                return True
            return False

        print_frames(watcher, sys.stdout, every_s=every_s, done=done)

    return show


# ---- what kvscope says on stderr -----------------------------------------------------------------------
def _say_what_runs(attached: AttachedLog) -> None:
    """What kvscope added to the command and where its output goes, before a view hides the terminal."""
    if attached.kind == "process":
        print(f"kvscope attach: started {attached.label}: {shlex.join(attached.argv)}", file=sys.stderr)
        if attached.added:
            print(f"kvscope attach: added {', '.join(attached.added)}", file=sys.stderr)
        print(f"kvscope attach: its output (stdout and stderr) goes to {attached.passthrough_path}", file=sys.stderr)
    else:
        print(f"kvscope attach: {'following' if attached.follow else 'reading'} {attached.label}", file=sys.stderr)


def _say_how_it_ended(attached: AttachedLog) -> None:
    """The last status and the log's counts; for a command that failed by itself, its last lines (llama.cpp
    says why there)."""
    stats = attached.stats
    print(f"kvscope attach: {attached.status.message}; {stats.lines} lines, {stats.dumps} dumps read "
          f"({stats.dumps_dropped} dropped to keep up)", file=sys.stderr)
    if attached.returncode and not attached.ended_by_kvscope:
        lines = attached.last_lines(5)
        if lines:
            print("kvscope attach: its last lines:\n" + "\n".join(f"  {line}" for line in lines), file=sys.stderr)
