"""A real llama.cpp's KV cache, watched from its own debug log: `kvscope attach`, `Explorer.attach`.

    attached = AttachedLog.run(["llama-server", "-m", "model.gguf", "-np", "2"])  # started here
    attached = AttachedLog.read("server.log", follow=True)                        # a log written elsewhere
    watcher = Watcher.of(attached)            # session-like: subscribe(maxsize), current_state()
    ...
    attached.close()                          # a process started here ends with it

A process is started with LLAMA_KV_CACHE_DEBUG=3 in its environment and `-v` added to its arguments (the
slot-search dumps are debug lines), unless the command already asks for them (`added` says what was
added). Its stdin is /dev/null (an explorer has the terminal). Its stdout and stderr are read as they come,
written byte for byte to a passthrough file, and parsed by engine/watch/llama_log, each stream's lines
kept whole, whose events go out on this object's own EventBus, with a SessionStatus ("attached", then
"finished", "exited", "closed", or "stopped" when the parser failed), LogStats about once a second, and a
ProcessExited when the process ends. Subscribe through subscribe() (a Recorder's attach() takes this
object as its bus): it holds the lock the parser publishes under, so that the state a new subscriber
gets and the events after it never overlap. Made with start=False, nothing is read until start(), and a
subscriber gets every event from the log's first line.

Two threads: a reader that only moves bytes (so llama.cpp never waits on a full pipe while a dump is
parsed) and a parser. When the parser falls behind a live source (more than BEHIND_BYTES read and not
parsed, or bytes waiting longer than BEHIND_SECONDS), it parses with `coalesce` on: of several dumps of
one stream waiting, only the last is decoded and the others are counted as dropped; every dump is the
whole stream, so the picture is late for a moment and never wrong. A saved log read without --follow is
read at the parser's pace and loses nothing.

No orphans: the process runs in its own process group; close() (also at interpreter exit, through
engine/watch/lifetime.py) sends SIGTERM to the group, then SIGKILL after TERM_GRACE_S; on Linux the
process also gets SIGKILL from the kernel when the thread that started it ends, so a kvscope killed with
SIGKILL leaves nothing running. Torch-free.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from engine import events as ev
from engine.errors import KvscopeError
from engine.kv.slot_debug import ENV_VAR as KV_CACHE_DEBUG_ENV
from engine.watch import lifetime
from engine.watch.llama_log import LlamaLogParser

DEBUG_LEVEL = 3  # LLAMA_KV_CACHE_DEBUG level that prints the cell map of every cache at every slot search
LOG_DEFAULT_DEBUG = 1  # common/log.h: the verbosity (-lv) at which debug lines are printed
VERBOSITY_FLAGS = ("-lv", "--verbosity", "--log-verbosity")  # common/arg.cpp, each followed by N
VERBOSE_FLAGS = ("-v", "--verbose")

PIPE_READ_BYTES = 1 << 16
FILE_READ_BYTES = 1 << 20
BEHIND_BYTES = 2 << 20  # read and not parsed beyond this: parse with coalesce on
BEHIND_SECONDS = 1.0  # or bytes waited this long for the parser
PROCESS_BACKLOG_BYTES = 64 << 20  # then the reader stops reading, and the process waits on its pipe
FILE_BACKLOG_BYTES = 4 << 20  # a file is read at most this far ahead of the parser
IDLE_SECONDS = 0.2  # no input for this long: the parser completes a dump that waits for its last line
STATS_EVERY_S = 1.0
FOLLOW_POLL_S = 0.1  # how often a followed file at its end is looked at again
TERM_GRACE_S = 3.0  # between SIGTERM and SIGKILL when kvscope ends the process
LAST_LINES = 200  # lines the process printed last, kept for last_lines() and ProcessExited
LAST_LINES_IN_EVENT = 20
CLOSE_WAIT_S = 30.0  # close() waits this long for the parser to finish what was read

STDOUT, STDERR, FILE = "stdout", "stderr", "file"
log = logging.getLogger("kvscope.attach")
_RESTART, _END = "restart", "end"  # markers between the reader and the parser


@dataclass
class _Chunk:
    """Bytes read from one stream (or a marker: restart with its reason, end with the exit status)."""

    stream: str
    data: bytes = b""
    arrived: float = 0.0
    note: str = ""
    returncode: int | None = None


class _Backlog:
    """What the reader read and the parser has not taken yet, in order, with its size in bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: collections.deque[_Chunk] = collections.deque()
        self._cond = threading.Condition()
        self.nbytes = 0
        self.unblocked = False  # set by close: the reader no longer waits for room
        self.refused = False  # set when the parser is gone: what the reader reads goes to the passthrough only

    def put(self, item: _Chunk) -> None:
        with self._cond:
            if self.refused:
                return
            while self.nbytes >= self.limit and not self.unblocked:
                self._cond.wait(0.2)
            self._items.append(item)
            self.nbytes += len(item.data)
            self._cond.notify_all()

    def take_all(self, timeout: float) -> list[_Chunk]:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            items = list(self._items)
            self._items.clear()
            self.nbytes = 0
            self._cond.notify_all()
            return items

    def unblock(self) -> None:
        with self._cond:
            self.unblocked = True
            self._cond.notify_all()

    def refuse(self) -> None:
        with self._cond:
            self.refused = self.unblocked = True
            self._items.clear()
            self.nbytes = 0
            self._cond.notify_all()


@dataclass(frozen=True)
class DebugCommand:
    """A command as AttachedLog.run starts it: its arguments, environment and what kvscope added."""

    argv: list[str]
    env: dict[str, str]
    added: list[str]


def debug_command(argv: Sequence[str], environ: dict[str, str] | None = None) -> DebugCommand:
    """`argv` with what makes llama.cpp print its slot-search dumps: LLAMA_KV_CACHE_DEBUG=3 (unless the
    environment asks for 3 or more already), and `-v` (unless -v/--verbose or -lv N with N >= 1 is there:
    the dumps are debug lines). After `-lv 0` the appended -v wins, as the last verbosity flag does in
    llama.cpp's parser; `added` says so."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if environ is None else environ)
    added = []
    old = env.get(KV_CACHE_DEBUG_ENV, "").strip()
    try:
        old_level = int(old) if old else 0
    except ValueError:
        old_level = 0
    if old_level < DEBUG_LEVEL:
        env[KV_CACHE_DEBUG_ENV] = str(DEBUG_LEVEL)
        added.append(f"{KV_CACHE_DEBUG_ENV}={DEBUG_LEVEL}" + (f" (was {old})" if old else ""))
    verbosity = _verbosity(argv[1:])
    if verbosity is None or verbosity < LOG_DEFAULT_DEBUG:
        argv.append("-v")
        added.append("-v" if verbosity is None else
                     f"-v (the command's verbosity {verbosity} hides the debug lines the dumps are)")
    return DebugCommand(argv, env, added)


def _verbosity(args: list[str]) -> int | None:
    """The verbosity the arguments ask llama.cpp for: a large number for -v, N for -lv N (-1 when N is not
    a number), None when they say nothing. The last flag wins, as in llama.cpp."""
    verbosity = None
    for i, arg in enumerate(args):
        if arg in VERBOSE_FLAGS:
            verbosity = 2**31 - 1
        elif arg in VERBOSITY_FLAGS:
            try:
                verbosity = int(args[i + 1])
            except (IndexError, ValueError):
                verbosity = -1
    return verbosity


class AttachedLog(ev.WatchedBus):
    """A llama.cpp log read as it comes, as events: see the module docstring. Made by run() or read()."""

    def __init__(self, *, label: str, kind: str, path: Path | None = None, follow: bool = False,
                 command: DebugCommand | None = None, passthrough: Path | None = None) -> None:
        self.label = label
        self.kind = kind  # "process" or "file"
        self.path = path  # the log read (a file)
        self.follow = follow
        self.command = command
        self.argv = command.argv if command else []
        self.added = command.added if command else []
        self.passthrough_path = passthrough
        self.pid: int | None = None
        self.returncode: int | None = None
        self.ended_by_kvscope = False
        self.error: Exception | None = None  # what stopped the parser (a bug), if anything did
        self.bus = ev.EventBus()  # subscribe through subscribe(), which keeps the state and the events in step
        self._parser = LlamaLogParser()
        self._lock = threading.RLock()  # parse+publish, and the state a new subscriber gets: never both at once
        live = kind == "process" or follow
        self._may_drop = live  # a saved log read to its end keeps every dump
        self._backlog = _Backlog(PROCESS_BACKLOG_BYTES if kind == "process" else FILE_BACKLOG_BYTES)
        self._partial: dict[str, bytes] = {}  # per stream: the start of a line whose end has not come
        self._last_lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self._unread_file = 0  # a followed file's bytes beyond what the reader read (behind, too)
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._status = ev.SessionStatus("attached", 0, self._workload(), message=self._running_message())
        self._stats_at = 0.0
        self._stats_last: tuple | None = None
        self._last_stats: ev.LogStats | None = None  # for the state a late watcher starts from
        self._idle = True
        self._reader: threading.Thread | None = None
        self._parser_thread: threading.Thread | None = None
        self._started = False
        self._handle = None  # a log file opened by read(), until start() hands it to the reader
        self._passthrough_made_here = False  # a temporary file: removed if the command never starts
        self.bus.add_state_source(self._state_events)

    # ---- constructors ----------------------------------------------------------------------------
    @classmethod
    def run(cls, argv: Sequence[str], *, passthrough: str | os.PathLike | None = None,
            env: dict[str, str] | None = None, start: bool = True) -> AttachedLog:
        """Start `argv` (llama-server, llama-cli, ...) with its debug dumps on (debug_command) and read its
        output. passthrough: where its raw output goes (default: a temporary file, kept; see
        passthrough_path). env: its environment (default: this process's). start: False to subscribe
        first and call start() then. KvscopeError when the command cannot be started."""
        argv = [str(a) for a in argv]
        if not argv or not argv[0]:
            raise KvscopeError("attach: no command given to run (e.g. llama-server -m model.gguf)")
        command = debug_command(argv, env)
        made_here = passthrough is None
        if made_here:
            fd, name = tempfile.mkstemp(prefix=f"kvscope-{Path(argv[0]).name}-", suffix=".log")
            os.close(fd)
            passthrough = name
        attached = cls(label=Path(argv[0]).name, kind="process", command=command, passthrough=Path(passthrough))
        attached._passthrough_made_here = made_here
        return attached.start() if start else attached

    @classmethod
    def read(cls, path: str | os.PathLike, *, follow: bool = False, start: bool = True) -> AttachedLog:
        """Read a saved llama.cpp log (its stderr, e.g. `llama-server ... 2> server.log`); follow: keep
        reading as it grows, like tail -f (a file truncated or replaced is read again from its start, as
        a new log). start: False to subscribe first and call start() then. KvscopeError when it cannot be
        read."""
        path = Path(path)
        try:
            handle = open(path, "rb")
        except OSError as e:
            raise KvscopeError(f"attach --log: cannot read {str(path)!r}: {e.strerror or e}") from None
        attached = cls(label=str(path), kind="file", path=path, follow=follow)
        attached._handle = handle
        return attached.start() if start else attached

    def start(self) -> AttachedLog:
        """Begin reading (for run(): start the process). An AttachedLog made with start=False lets its
        watchers and recorders subscribe first: they then get every event from the log's first line, rather
        than the picture so far. Returns itself."""
        if self._started:
            raise KvscopeError(f"attach: {self.label} is started already")
        if self._stop.is_set():
            raise KvscopeError(f"attach: {self.label} is closed")
        if self.kind == "process":
            self._start_process()
        else:
            self._reader = threading.Thread(target=self._read_file, args=(self._handle,), name="kvscope-attach-read",
                                            daemon=True)
            self._handle = None
            self._reader.start()
        self._started = True
        self._publish(self._status)
        self._parser_thread = threading.Thread(target=self._parse_loop, name="kvscope-attach-parse", daemon=True)
        self._parser_thread.start()
        lifetime.close_at_exit(self, lifetime.SESSIONS)
        return self

    def _start_process(self) -> None:
        try:
            sink = open(self.passthrough_path, "wb", buffering=0)
        except OSError as e:
            raise KvscopeError(f"attach: cannot write the passthrough file {str(self.passthrough_path)!r}: "
                               f"{e.strerror or e}") from None
        started = threading.Event()
        outcome: list[BaseException | subprocess.Popen] = []
        self._reader = threading.Thread(target=self._run_process, args=(sink, started, outcome),
                                        name="kvscope-attach-read", daemon=True)
        self._reader.start()
        started.wait()
        if isinstance(outcome[0], BaseException):
            self._stop.set()
            if self._passthrough_made_here:
                self.passthrough_path.unlink(missing_ok=True)
            raise outcome[0]
        self.pid = outcome[0].pid
        self.label = f"{Path(self.argv[0]).name} (pid {self.pid})"
        self._status = dataclasses.replace(self._status, message=self._running_message())

    # ---- what a watcher reads: subscribe() and current_state(), from WatchedBus -------------------------
    def _state_events(self) -> list[ev.Event]:
        with self._lock:
            if not self._started:
                return []  # its first status comes with start(), which knows the pid
            stats = [dataclasses.replace(self._last_stats)] if self._last_stats is not None else []
            return [*self._parser.state_events(), dataclasses.replace(self._status), *stats]

    @property
    def program(self) -> str:
        """What the log says it is ("llama-server", "llama-cli", ...), else the command's name."""
        return self._parser.program or (Path(self.argv[0]).name if self.argv else "")

    @property
    def stats(self):
        """The parser's counts (bytes, lines, skipped, dumps, dumps_dropped) of the log read so far."""
        return self._parser.stats

    @property
    def started(self) -> bool:
        """start() ran (the process was started, the file is being read)."""
        return self._started

    @property
    def status(self) -> ev.SessionStatus:
        """The last SessionStatus published: "attached", then "finished", "exited" or "closed"."""
        return self._status

    @property
    def finished(self) -> bool:
        """The log was read to its end, or the process ended (and what it printed was parsed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until finished (a saved log read to its end, the process ended); False on timeout."""
        return self._finished.wait(timeout)

    def last_lines(self, n: int = 20) -> list[str]:
        """The last n lines the process (or the log) printed, stdout's and stderr's as they came."""
        with self._lock:
            lines = list(self._last_lines)
        return lines[-n:] if n > 0 else []

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop reading; a process started here is ended (SIGTERM to its process group, SIGKILL after
        TERM_GRACE_S). Waits for both threads; the last events (ProcessExited, the final SessionStatus and
        LogStats) are published before it returns. Idempotent."""
        if self._stop.is_set():
            self._join()
            return
        self._stop.set()
        if not self._started:
            if self._handle is not None:
                self._handle.close()
            if self._passthrough_made_here:
                self.passthrough_path.unlink(missing_ok=True)
            return
        self._backlog.unblock()  # the reader must not wait for room now: it has the process's last words to read
        if self.kind == "process":
            self._end_process()
        self._join()
        lifetime.discard(self)

    def _join(self) -> None:
        for thread in (self._reader, self._parser_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(CLOSE_WAIT_S)

    def _end_process(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        self.ended_by_kvscope = True
        _signal_group(process.pid, signal.SIGTERM)
        if self._reader is not None:
            self._reader.join(TERM_GRACE_S)
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGKILL)

    def __enter__(self) -> AttachedLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the reader: bytes only ----------------------------------------------------------------------
    _process: subprocess.Popen | None = None

    def _run_process(self, sink, started: threading.Event, outcome: list) -> None:
        """Start the process on this thread (the kernel's PR_SET_PDEATHSIG watches the thread that started
        it, and this one lives until the process is gone), then move its output to the sink and the parser."""
        argv = self.command.argv
        try:
            process = subprocess.Popen(argv, env=self.command.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, preexec_fn=_own_group_dying_with(os.getpid()))
        except FileNotFoundError:
            outcome.append(KvscopeError(f"attach: no such command: {argv[0]!r}"
                                        + ("" if os.sep in argv[0] else " (not found on PATH)")))
        except PermissionError:
            outcome.append(KvscopeError(f"attach: {argv[0]!r} cannot be run (not executable, or a folder)"))
        except OSError as e:
            outcome.append(KvscopeError(f"attach: cannot start {argv[0]!r}: {e.strerror or e}"))
        else:
            self._process = process
            outcome.append(process)
        if isinstance(outcome[0], BaseException):
            sink.close()
            started.set()
            return
        started.set()
        try:
            self._pump_pipes(process, sink)
        finally:
            sink.close()
            returncode = process.wait()
            self.returncode = returncode
            self._backlog.unblock()
            self._backlog.put(_Chunk(_END, arrived=time.monotonic(), returncode=returncode))

    def _pump_pipes(self, process: subprocess.Popen, sink) -> None:
        selector = selectors.DefaultSelector()
        for stream, pipe in ((STDOUT, process.stdout), (STDERR, process.stderr)):
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ, stream)
        try:
            while selector.get_map():
                ready = selector.select(0.2)
                if not ready:
                    if process.poll() is not None:
                        break  # it ended, and something it started holds its pipes open: nothing more comes
                    continue
                for key, _ in ready:
                    try:
                        data = os.read(key.fd, PIPE_READ_BYTES)
                    except BlockingIOError:
                        continue
                    if not data:
                        selector.unregister(key.fileobj)
                        continue
                    sink.write(data)
                    self._backlog.put(_Chunk(key.data, data, time.monotonic()))
        finally:
            selector.close()
            process.stdout.close()
            process.stderr.close()

    def _read_file(self, handle) -> None:
        path = self.path
        try:
            while not self._stop.is_set():
                data = handle.read(FILE_READ_BYTES)
                if data:
                    self._backlog.put(_Chunk(FILE, data, time.monotonic()))
                    if self.follow:
                        self._unread_file = max(0, os.fstat(handle.fileno()).st_size - handle.tell())
                    continue
                if not self.follow:
                    break
                self._unread_file = 0
                handle = self._reopened_if_changed(handle, path)
        finally:
            handle.close()
            self._backlog.unblock()
            self._backlog.put(_Chunk(_END, arrived=time.monotonic()))

    def _reopened_if_changed(self, handle, path: Path):
        """At the end of a followed file: the same handle when the file only waits to grow; a fresh start
        (and a restart marker for the parser) when it was truncated or replaced."""
        try:
            now = os.stat(path)
        except OSError:  # removed (a rotation in progress): wait for the new one
            self._stop.wait(FOLLOW_POLL_S)
            return handle
        mine = os.fstat(handle.fileno())
        if (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
            try:
                fresh = open(path, "rb")
            except OSError:
                self._stop.wait(FOLLOW_POLL_S)
                return handle
            handle.close()
            self._backlog.put(_Chunk(_RESTART, arrived=time.monotonic(), note="was replaced"))
            return fresh
        if now.st_size < handle.tell():
            handle.seek(0)
            self._backlog.put(_Chunk(_RESTART, arrived=time.monotonic(), note="was truncated"))
            return handle
        self._stop.wait(FOLLOW_POLL_S)
        return handle

    # ---- the parser ------------------------------------------------------------------------------------
    def _parse_loop(self) -> None:
        try:
            self._parse_all()
        except Exception as e:  # a bug of the parser: said on the status line and kept, never a silent stop
            self.error = e
            self._backlog.refuse()  # a process goes on: its output still reaches the passthrough file
            log.exception("kvscope attach: the parser failed on %s", self.label)
            self._set_status("stopped", f"kvscope stopped reading {self.label}: the parser failed: "
                                        f"{type(e).__name__}: {e}")
            self._finished.set()

    def _parse_all(self) -> None:
        while True:
            items = self._backlog.take_all(IDLE_SECONDS)
            if not items:
                if not self._idle:
                    self._idle = True
                    with self._lock:
                        self._publish_all(self._parser.idle())
                self._maybe_publish_stats()
                continue
            self._idle = False
            behind = self._may_drop and (
                sum(len(i.data) for i in items) + self._backlog.nbytes + self._unread_file >= BEHIND_BYTES
                or time.monotonic() - items[0].arrived >= BEHIND_SECONDS)
            self._parser.coalesce = behind
            for stream, group in _runs(items):
                if stream == _END:
                    self._end(group[0])
                    return
                if stream == _RESTART:
                    self._restart(group[0].note)
                else:
                    self._parse(stream, b"".join(item.data for item in group))
            self._maybe_publish_stats()

    def _parse(self, stream: str, data: bytes) -> None:
        """Feed the complete lines of `data` (with the start of a line that waited): each stream's lines
        stay whole, whichever stream wrote last."""
        data = self._partial.pop(stream, b"") + data
        cut = data.rfind(b"\n") + 1
        if cut < len(data):
            self._partial[stream] = data[cut:]
        if cut:
            self._feed(data[:cut])

    def _feed(self, data: bytes) -> None:
        with self._lock:
            _keep_last_lines(self._last_lines, data)
            self._publish_all(self._parser.feed(data))
            self._note_program()

    def _flush_partials(self) -> None:
        for stream in list(self._partial):
            self._feed(self._partial.pop(stream) + b"\n")

    def _restart(self, why: str) -> None:
        """A followed file was truncated or replaced: what was read is complete, and the file is a new log."""
        self._flush_partials()
        with self._lock:
            self._publish_all(self._parser.finish())
            self._publish_stats()
            self._parser = LlamaLogParser()
            self._set_status("attached", f"{self.label} {why}: reading it again from its start, as a new log")

    def _end(self, end: _Chunk) -> None:
        self._flush_partials()
        with self._lock:
            self._parser.coalesce = False
            self._publish_all(self._parser.finish())
            self._note_program()
            self._publish_stats()
            if self.kind == "process":
                self._publish_exit(end.returncode)
            elif self._stop.is_set():
                self._set_status("closed", f"{self.label}: stopped reading")
            else:
                self._set_status("finished", f"{self.label}: read to its end")
        self._finished.set()

    def _publish_exit(self, returncode: int) -> None:
        how = _exit_text(returncode)
        if self.ended_by_kvscope:
            message = f"{self.label} ended by kvscope ({how})"
        else:
            message = f"{self.label} exited ({how})"
        self._publish(ev.ProcessExited(self.program, self.pid or -1, returncode,
                                       tuple(list(self._last_lines)[-LAST_LINES_IN_EVENT:]), self.ended_by_kvscope))
        self._set_status("exited", message)

    # ---- publishing ------------------------------------------------------------------------------------
    def _publish(self, event: ev.Event) -> None:
        with self._lock:
            self.bus.publish(event)

    def _publish_all(self, events: list[ev.Event]) -> None:
        for event in events:
            self.bus.publish(event)

    def _set_status(self, state: str, message: str) -> None:
        self._status = ev.SessionStatus(state, 0, self._workload(), message=message)
        self._publish(dataclasses.replace(self._status))

    def _note_program(self) -> None:
        """Once the log says which program it is, the status says it too."""
        if self._status.workload != self._workload() and self._status.state == "attached":
            self._set_status("attached", self._status.message)

    def _workload(self) -> str:
        return self.program or "llama.cpp"

    def _running_message(self) -> str:
        if self.kind == "process":
            return f"attached to {self.label}"
        return f"{'following' if self.follow else 'reading'} {self.label}"

    def _maybe_publish_stats(self) -> None:
        if time.monotonic() - self._stats_at >= STATS_EVERY_S:
            with self._lock:
                self._publish_stats(only_changed=True)

    def _publish_stats(self, only_changed: bool = False) -> None:
        s = self._parser.stats
        behind = self._backlog.nbytes + self._unread_file
        figures = (s.bytes, s.lines, s.skipped, s.dumps, s.dumps_dropped, behind)
        self._stats_at = time.monotonic()
        if only_changed and figures == self._stats_last:
            return
        self._stats_last = figures
        self._last_stats = ev.LogStats(self.label, *figures)
        self._publish(dataclasses.replace(self._last_stats))


# ---- helpers ------------------------------------------------------------------------------------------
def _runs(items: list[_Chunk]) -> list[tuple[str, list[_Chunk]]]:
    """Consecutive items of one stream together (markers alone), in order."""
    runs: list[tuple[str, list[_Chunk]]] = []
    for item in items:
        if runs and runs[-1][0] == item.stream and item.stream not in (_RESTART, _END):
            runs[-1][1].append(item)
        else:
            runs.append((item.stream, [item]))
    return runs


LAST_LINES_TAIL = 1 << 14  # only the tail of a block is looked at for its last lines


def _keep_last_lines(kept: collections.deque, block: bytes) -> None:
    tail = block[-LAST_LINES_TAIL:]
    lines = tail.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if len(block) > LAST_LINES_TAIL and lines:
        lines.pop(0)  # cut by the tail
    kept.extend(line.rstrip(b"\r").decode("utf-8", errors="replace") for line in lines)


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def exit_status(returncode: int) -> int:
    """A process's status as a shell gives it: its exit status, or 128 + the signal that killed it."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone already


def _own_group_dying_with(parent_pid: int) -> Callable[[], None]:
    """What the child runs between fork and exec: its own process group (so that kvscope can end it and
    whatever it starts, and the terminal's Ctrl-C reaches kvscope only), and on Linux SIGKILL when the
    thread that started it ends (PR_SET_PDEATHSIG), kvscope killed included. libc's prctl is looked up
    here, before the fork."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None

    def in_child() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent_pid:  # the parent died before the line above: nobody will end it
                os._exit(1)

    return in_child
