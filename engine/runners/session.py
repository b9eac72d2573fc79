"""A session: a model, a context and a workload, driven by commands, on one worker thread.

Front-ends (the terminal UI, the notebook explorer, a remote client) never touch the cache, the model
or a thread of their own: they send commands here and watch the event bus. Every command is queued and
applied between two workload steps, so a view never sees a half-done decode, and returns a Future with
its result or its error. A command that fails, or a step whose decode fails, becomes an event
(CommandDone, WorkloadStep, SessionStatus) and leaves the worker running.

    session = Session("demo", settings=dict(n_ctx=512, n_seq_max=4, kv_unified=True), workload="generate")
    session.add_prompt("And God said").result()     # -> seq id
    session.start()                                 # steps run until paused, as fast as allowed
    session.seq_rm(0, 8, -1).result()               # applied between two steps
    session.close()

`threaded=False` runs each command at once on the calling thread (for tests and notebooks that step
by hand): `step(n)` then decodes before it returns.
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine import events as ev
from engine.arguments import int_arg, optional_int
from engine.context import Context
from engine.errors import KvscopeError
from engine.models.model import Model, load_model
from engine.runners.heap import release_free_heap
from engine.runners.session_log import SessionLog
from engine.runners.workloads import IDLE, WorkloadSpec, make_workload
from engine.sizing.estimate import estimate
from engine.watch import lifetime
from engine.watch.protocol import Status, StepOutcome

HEAP_RELEASE_EVERY_S = 60.0  # a running session gives freed heap back this often (engine/runners/heap.py)
CLOSE_WAIT_S = 60.0  # close() waits this long for the step the worker is in (a long prefill on a CPU)
log = logging.getLogger("kvscope.session")

# What a session's context gets unless told otherwise: small enough that the cache's behaviour shows
# within seconds on the demo model (the same names as engine.Context's settings).
DEFAULT_SETTINGS: dict[str, Any] = dict(n_ctx=512, n_seq_max=8, kv_unified=True)
NOT_MEMORY_SETTINGS = ("publish_attention", "publish_logits", "kv_cache_debug", "abort_callback", "bus")


class SessionClosedError(KvscopeError):
    """A command was sent to a session that is closed."""


@dataclass
class _Command:
    name: str
    run: Callable[[], Any]
    args: str
    future: Future
    quiet: bool = False  # no CommandDone event on success (internal queries)


@dataclass(eq=False)
class _Redraw:
    """An on_change callback and when it may run next."""

    callback: Callable[[], None]
    every_s: float
    due_at: float = 0.0
    pending: bool = False  # a step or command came since it last ran


class Session:
    """A context and its workload, changed only through commands (see the module docstring)."""

    def __init__(self, model: str | Path | Model = "demo", *, settings: dict | None = None,
                 workload: str | WorkloadSpec = "idle", threaded: bool = True, steps_per_second: float = 0.0,
                 bus: ev.EventBus | None = None, dtype: str = "f32", threads: int | None = None,
                 verbose: bool = False, log_level: str = "info") -> None:
        """threads: torch's compute threads for the whole process while the session is open (None: torch's
        own choice; close() gives back the count it found); a front-end that shares the process leaves a core
        to itself (engine/runners/launch.py).
        What the engine logs while it works for this session (llama.cpp's lines: "context full, swapping:
        ...") is kept in `self.log` (a SessionLog: lines of log_level and above) instead of being written on
        stderr from the worker, into whatever a notebook shows at the time; verbose: print them on stderr
        as well. Logging handlers the application configured get them either way (engine/runners/session_log.py)."""
        threads = optional_int(threads, "threads", "Session")
        if threads is not None and threads < 1:
            raise KvscopeError(f"Session: threads must be >= 1, got {threads}")
        self._threads = threads
        self._threads_found: int | None = None  # the process's torch threads before the session set its own
        self.log = SessionLog(verbose=verbose, level=log_level)
        self.bus = bus if bus is not None else ev.EventBus()
        self._settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self._spec = workload if isinstance(workload, WorkloadSpec) else WorkloadSpec(kind=workload)
        self._state, self._step, self._speed = "paused", 0, self._checked_speed(steps_per_second)
        self._idle_since_command = False
        self._step_requests: list[tuple[int, list[StepOutcome], Future]] = []
        self._last_step_start = 0.0
        self._heap_released_at = time.monotonic()
        self._redraws: list[_Redraw] = []  # on_change callbacks (views), run by the worker
        self._lock = threading.Lock()  # guards what status() reads
        self._queue: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._closed = False
        self._opened = False  # its state source registered (after the first context's)
        # what each sequence serves, for the state a new watcher starts from (the runners publish it once).
        # Only the latest per sequence is used, so the worker takes them from the queue after every step:
        # taken only when a watcher subscribes or resyncs, a session that nobody joins for hours kept every
        # request's assignment queued, up to the queue's 65536 (~25 MiB).
        self._assignments = self.bus.subscribe(kinds=(ev.SequenceAssigned,), with_state=False)
        self._assigned: dict[int, ev.SequenceAssigned] = {}
        self._assigned_lock = threading.Lock()  # the worker takes assignments while a subscriber reads them
        self.threaded = threaded
        self._thread: threading.Thread | None = None
        if threaded:
            # Every torch call of the session happens on its worker, the model's load included: a process
            # whose main thread also ran torch ops decodes from a second thread up to a third slower (two
            # OpenMP teams on two cores), which this avoids whenever the session loads the model itself.
            self._thread = threading.Thread(target=self._loop, name="kvscope-session", daemon=True)
            self._thread.start()
            lifetime.close_at_exit(self, lifetime.SESSIONS)
        opened = self._submit("open", lambda: self._open(model, dtype), quiet=True)
        try:
            opened.result()
        except BaseException:
            self.close()
            raise
        self.bus.add_state_source(self._state_events)
        self._opened = True
        self._publish_status()

    def _open(self, model: str | Path | Model, dtype: str) -> None:
        if self._threads is not None:
            import torch

            self._threads_found = torch.get_num_threads()
            torch.set_num_threads(self._threads)
        self._model = model if isinstance(model, Model) else load_model(model, dtype=dtype)
        self.ctx = self._new_context(self._settings, self._spec)
        self._workload = make_workload(self._spec, self.ctx)

    # ---- what a front-end reads ---------------------------------------------------------------
    @property
    def model(self) -> Model:
        return self._model

    def status(self) -> Status:
        with self._lock:
            return Status(self._state, self._step, self._spec.kind, self._speed, self._model.name,
                          dict(self._settings))

    def subscribe(self, maxsize: int = 65536, kinds: tuple[type, ...] | None = None) -> ev.Subscription:
        """A watcher's subscription: the session's current state first, then every event."""
        return self.bus.subscribe(maxsize, kinds)

    def on_change(self, callback: Callable[[], None], every_s: float = 0.2) -> Callable[[], None]:
        """Call `callback` on the session's worker after steps and commands change something: at most
        every `every_s` seconds while they come quickly, and once more after the last of them, so that a
        view redrawn from it ends on the final state. This is how a front-end that may not start a thread
        of its own (the notebook explorer) updates live; the callback runs between steps, so it delays
        the next one by its own time, and a callback that takes longer than every_s runs at most every
        twice its own time (the worker keeps half for the steps). A failing callback is published as a
        CommandDone error and kept. Returns a function that removes it."""
        if every_s < 0:
            raise KvscopeError(f"on_change: every_s must be >= 0, got {every_s}")
        redraw = _Redraw(callback, float(every_s))
        with self._lock:
            self._redraws.append(redraw)

        def remove() -> None:
            with self._lock:
                if redraw in self._redraws:
                    self._redraws.remove(redraw)
        return remove

    def call(self, function: Callable[[], Any], name: str = "call") -> Future:
        """Run `function` on the session's worker between steps, as on_change runs its callbacks, so that a
        redraw a UI handler asks for (on another thread) never overlaps one of them. The Future gives its
        result; a failure is its exception and a CommandDone error, and never ends the worker."""
        if not callable(function):
            raise KvscopeError(f"call: {function!r} is not callable")
        return self._submit(name, function, quiet=True)

    def estimate(self, **settings):
        """What the context would hold per device with these settings instead of the current ones (from
        file headers only; nothing changes). The model loaded in memory is estimated by its path."""
        merged = {**self._settings, **settings}
        for name in NOT_MEMORY_SETTINGS:  # settings of what a context publishes or prints, not of its bytes
            merged.pop(name, None)
        return estimate(self._model.path, keep_quantized=self._model.kept_quantized, **merged)

    # ---- running ------------------------------------------------------------------------------
    def start(self) -> Future:
        """Run steps until paused (a stopped workload starts afresh)."""
        return self._submit("start", self._do_start)

    def pause(self) -> Future:
        return self._submit("pause", lambda: self._set_state("paused"))

    def stop(self) -> Future:
        """End the workload: every sequence stops generating; the cells stay. start() begins a new one."""
        return self._submit("stop", self._do_stop)

    def step(self, n: int = 1) -> Future:
        """Run n steps (also while paused); the Future gives their StepOutcomes, fewer if the workload
        had nothing left to do."""
        n = int_arg(n, "n", "step")
        if n < 1:
            raise KvscopeError(f"step: n must be >= 1, got {n}")
        future: Future = Future()
        if not self.threaded:
            if self._closed:
                raise SessionClosedError("step: the session is closed")
            done: list[StepOutcome] = []
            with self.log.capturing():
                while len(done) < n and (not done or done[-1].phase != "idle"):
                    done.append(self._do_one_step())
                future.set_result(done)
                self._changed()
            return future
        return self._submit("step", lambda: self._step_requests.append((n, [], future)) or future, f"n={n}",
                            chain=future)

    def set_speed(self, steps_per_second: float) -> Future:
        """Steps per second while running; 0 for as fast as possible."""
        speed = self._checked_speed(steps_per_second)
        return self._submit("set_speed", lambda: self._set_speed(speed), f"{speed}")

    # ---- the workload ------------------------------------------------------------------------
    def add_prompt(self, text: str, n_predict: int | None = None) -> Future:
        """A prompt as a new sequence (generate, idle) or a new request (parallel); the Future gives the
        seq id (the request id for parallel)."""
        if not isinstance(text, str):
            raise KvscopeError(f"add_prompt: text must be a str, got {type(text).__name__}")
        n_predict = optional_int(n_predict, "n_predict", "add_prompt")
        return self._submit("add_prompt", lambda: self._workload.add_prompt(text, n_predict),
                            f"{text[:40]!r}, n_predict={n_predict}")

    def set_workload(self, workload: str | WorkloadSpec, **options) -> Future:
        """Replace the workload (its sequences stop; the cells stay, except that a parallel or server workload
        starts from an empty cache, since its clients or slots own their sequences)."""
        spec = workload if isinstance(workload, WorkloadSpec) else WorkloadSpec(kind=workload, **options)
        return self._submit("set_workload", lambda: self._do_set_workload(spec), spec.kind)

    # ---- sequence operations (llama_memory_*), applied between steps --------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> Future:
        return self._memory_op("seq_rm", seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> Future:
        return self._memory_op("seq_cp", src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> Future:
        return self._memory_op("seq_keep", seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> Future:
        return self._memory_op("seq_add", seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> Future:
        return self._memory_op("seq_div", seq_id, p0, p1, d)

    def clear(self, data: bool = True) -> Future:
        return self._memory_op("clear", data)

    def context_shift(self, seq_id: int, n_keep: int = 0, n_discard: int | None = None) -> Future:
        """llama.cpp's context shift of one sequence: keep positions [0, n_keep), remove the next
        n_discard (default: half of the rest, as llama-completion), move the tail down. A sequence the
        workload is generating continues at its new position. The Future gives n_discard."""
        seq_id, n_keep = int_arg(seq_id, "seq_id", "context_shift"), int_arg(n_keep, "n_keep", "context_shift")
        n_discard = optional_int(n_discard, "n_discard", "context_shift")
        return self._submit("context_shift", lambda: self._do_context_shift(seq_id, n_keep, n_discard),
                            f"seq {seq_id}, n_keep={n_keep}, n_discard={n_discard}")

    # ---- settings, model, state -------------------------------------------------------------------
    def rebuild(self, **settings) -> Future:
        """A new context with these settings changed (the loaded model kept); the cache starts empty and
        the workload afresh. Settings that do not fit are refused and the old context stays."""
        return self._submit("rebuild", lambda: self._do_rebuild(self._model, settings), _args_text(settings))

    def load_model(self, path: str | Path, dtype: str = "f32", **settings) -> Future:
        """Load another model and rebuild the context on it (settings as for rebuild)."""
        return self._submit("load_model", lambda: self._do_rebuild(load_model(path, dtype=dtype), settings),
                            f"{path}, {_args_text(settings)}")

    def save_state(self, path: str | Path | None = None, seq_id: int | None = None) -> Future:
        """The whole context's state (seq_id None) or one sequence's, as llama.cpp's state bytes; written
        to path when given (the Future then gives the file size)."""
        seq_id = optional_int(seq_id, "seq_id", "save_state")
        return self._submit("save_state", lambda: self._do_save(path, seq_id), f"{path}, seq {seq_id}")

    def load_state(self, source: bytes | str | Path, seq_id: int | None = None) -> Future:
        """Restore a state from bytes or a file (whole, or into seq_id). Sequences it replaces stop
        generating."""
        seq_id = optional_int(seq_id, "seq_id", "load_state")
        return self._submit("load_state", lambda: self._do_load(source, seq_id), f"seq {seq_id}")

    def engine_cells(self) -> Future:
        """The cells and head of every stream of every cache, as the engine itself reads them between two
        steps: {cache name: {"cells": [per stream: [(pos, seq ids, shift), ...]], "heads": [...]}}. What a
        watcher of this session (or of a remote one) can be compared with."""
        def read() -> dict:
            return {cache.name: {"cells": [cache.cells(s) for s in range(cache.n_stream)],
                                 "heads": [cache.head(s) for s in range(cache.n_stream)]}
                    for cache in self.ctx.memory.caches()}

        return self._submit("engine_cells", read, quiet=True)

    def current_state(self) -> list[ev.Event]:
        """The context's state as events, stamped with the last event published before it: what a watcher
        that lost events rebuilds from (it then skips queued events stamped at or before it)."""
        future = self._submit("current_state", lambda: self.bus.current_state(), "", quiet=True)
        return future.result()

    def close(self) -> None:
        """Stop the worker and release the context. Commands sent afterwards raise SessionClosedError."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=CLOSE_WAIT_S)
            lifetime.discard(self)
        if hasattr(self, "ctx"):  # a session whose opening failed has none
            self._set_state("closed")
            self._release_context()
        if self._threads_found is not None:  # the caller's own decodes (and estimates) run as before
            import torch

            torch.set_num_threads(self._threads_found)
        self.log.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the worker ------------------------------------------------------------------------------
    def _submit(self, name: str, run: Callable[[], Any], args: str = "", *, chain: Future | None = None,
                quiet: bool = False) -> Future:
        if self._closed:
            raise SessionClosedError(f"{name}: the session is closed")
        command = _Command(name, run, args, Future(), quiet)
        if self.threaded:
            self._queue.put(command)
        else:
            self._run_command(command)
        return chain if chain is not None else command.future

    def _loop(self) -> None:
        with self.log.capturing():  # everything the worker logs is this session's
            self._serve_commands_and_steps()

    def _serve_commands_and_steps(self) -> None:
        while True:
            try:
                command = self._queue.get(timeout=self._wait_time())
            except queue.Empty:
                command = False
            if command is None:
                return
            if command:
                self._run_command(command)
                continue  # every queued command before the next step
            if self._wants_step():
                self._timed_step()
            self._run_due_redraws()

    def _wait_time(self) -> float | None:
        """How long the worker may wait for a command: until the next step or the next redraw that waits
        for its turn; forever when neither is due."""
        redraw = self._redraw_wait()
        if not self._wants_step():
            return redraw
        if self._speed <= 0 or self._step_requests:
            return 0.0
        step = max(0.0, self._last_step_start + 1.0 / self._speed - time.monotonic())
        return step if redraw is None else min(step, redraw)

    def _redraw_wait(self) -> float | None:
        with self._lock:
            pending = [r.due_at for r in self._redraws if r.pending]
        return max(0.0, min(pending) - time.monotonic()) if pending else None

    def _changed(self) -> None:
        """A step or a command may have changed what views show: their redraws are pending."""
        with self._lock:  # on_change may add or remove one from another thread meanwhile
            for redraw in self._redraws:
                redraw.pending = True
        # stepped by hand (no worker to come back later): every view now
        self._run_due_redraws(every_pending=not self.threaded)

    def _run_due_redraws(self, every_pending: bool = False) -> None:
        with self._lock:
            due = [r for r in self._redraws if r.pending and (every_pending or time.monotonic() >= r.due_at)]
        for redraw in due:
            redraw.pending, started = False, time.monotonic()
            try:
                redraw.callback()
            except Exception as e:  # noqa: BLE001 - a view's failure must never end the worker
                self._publish(ev.CommandDone("on_change", getattr(redraw.callback, "__name__", "callback"), False,
                                             f"{type(e).__name__}: {e}", 0.0))
            finally:
                # Backpressure: a redraw slower than every_s would otherwise run after every step, the views
                # taking most of the worker's time (and the page getting more than it can draw). It waits as
                # long as it took instead: drawing takes at most half the worker, and the changes of the
                # steps meanwhile are drawn together, from the state they left, by the next one.
                ended = time.monotonic()
                redraw.due_at = max(started + redraw.every_s, ended + (ended - started))

    def _wants_step(self) -> bool:
        """A step is due: one was asked for, or the session runs ("idle": running with nothing to do, until
        a command gives the workload something)."""
        running = self._state in ("running", "idle")
        return bool(self._step_requests) or (running and not self._idle_since_command)

    def _run_command(self, command: _Command) -> None:
        t0 = time.perf_counter()
        self._idle_since_command = False  # a command may give an idle workload something to do
        try:
            with self.log.capturing(), self.bus.cause(f"command: {command.name}"):
                result = command.run()
        except Exception as e:  # noqa: BLE001 - a failing command must never end the worker
            command.future.set_exception(e)
            self._publish(ev.CommandDone(command.name, command.args, False, f"{type(e).__name__}: {e}",
                                         (time.perf_counter() - t0) * 1e3))
            return
        command.future.set_result(result)
        if not command.quiet:
            self._publish(ev.CommandDone(command.name, command.args, True, "", (time.perf_counter() - t0) * 1e3))
            self._changed()

    def _timed_step(self) -> None:
        self._last_step_start = time.monotonic()
        if self._last_step_start - self._heap_released_at >= HEAP_RELEASE_EVERY_S:
            self._heap_released_at = self._last_step_start
            release_free_heap()
        outcome = self._do_one_step()
        if self._step_requests:
            n, done, future = self._step_requests[0]
            done.append(outcome)
            if len(done) >= n or outcome.phase == "idle":
                self._step_requests.pop(0)
                future.set_result(done)
        self._changed()

    def _do_one_step(self) -> StepOutcome:
        t0 = time.perf_counter()
        try:  # no cause here: the runners name their own (a finished request, a context shift)
            outcome = self._workload.step()
        except Exception as e:  # noqa: BLE001 - a failing step pauses the session, never ends it
            log.exception("the %s workload failed", self._workload.name)
            self._set_state("paused", f"the {self._workload.name} workload failed: {type(e).__name__}: {e}")
            return IDLE
        self._take_assignments()
        if outcome.phase == "idle":
            self._idle_since_command = True
            if self._state == "running":
                self._set_state("idle")
            return outcome
        with self._lock:
            self._step += 1
            if self._state == "idle":
                self._state = "running"
        self._publish(ev.WorkloadStep(self._step, self._workload.name, outcome.phase, outcome.n_tokens,
                                      outcome.n_sampled, outcome.rc, (time.perf_counter() - t0) * 1e3,
                                      outcome.active_seqs))
        return outcome

    # ---- commands, run on the worker -------------------------------------------------------------
    def _do_start(self) -> None:
        if self._state == "stopped":
            self._workload = make_workload(self._spec, self.ctx)
        self._set_state("running")

    def _do_stop(self) -> None:
        if not self._workload.owns_sequences:  # the others' runs end with the workload, their cells stay
            for seq_id in self._workload.active_seqs():
                self._workload.stop_seq(seq_id, "stopped")
        self._workload = make_workload(WorkloadSpec(kind="idle"), self.ctx)
        for _, done, future in self._step_requests:
            future.set_result(done)
        self._step_requests.clear()
        self._set_state("stopped")

    def _do_set_workload(self, spec: WorkloadSpec) -> None:
        if spec.n_seq_max_needed() > self.ctx.n_seq_max:
            raise KvscopeError(f"the {spec.kind} workload needs n_seq_max >= {spec.n_seq_max_needed()}, the context "
                               f"has {self.ctx.n_seq_max}; rebuild with a larger n_seq_max first")
        workload = make_workload(spec, self.ctx)  # first: a workload that cannot be made leaves the cache as it was
        if workload.owns_sequences:  # it starts from an empty cache
            self.ctx.memory.clear()
        self._spec, self._workload = spec, workload
        self._publish_status()

    def _memory_op(self, name: str, *args) -> Future:
        return self._submit(name, lambda: getattr(self.ctx.memory, name)(*args), ", ".join(map(repr, args)))

    def _do_context_shift(self, seq_id: int, n_keep: int, n_discard: int | None) -> int:
        memory = self.ctx.memory
        n_past = memory.seq_pos_max(seq_id) + 1
        if n_past <= 0:
            raise KvscopeError(f"context_shift: seq {seq_id} holds no cells")
        n_left = n_past - n_keep
        n_discard = n_left // 2 if n_discard is None else n_discard
        if not 0 < n_discard <= n_left:
            raise KvscopeError(f"context_shift: n_discard must be in 1..{n_left} (seq {seq_id} holds positions "
                               f"up to {n_past - 1}, n_keep = {n_keep}), got {n_discard}")
        if not memory.can_shift():
            # llama.cpp's tools turn context shift off here; the memory would still take a seq_add (QUIRK_ISWA_SHIFT)
            raise KvscopeError("context_shift: this memory cannot shift (llama_memory_can_shift is false: an iSWA pair "
                               "needs swa_full); llama.cpp's tools turn context shift off here")
        check = getattr(self._workload, "check_shift", None)
        if check is not None:
            check(seq_id)
        with self.bus.cause(f"context shift of seq {seq_id} (command): n_keep = {n_keep}, n_discard = {n_discard}"):
            memory.seq_rm(seq_id, n_keep, n_keep + n_discard)
            memory.seq_add(seq_id, n_keep + n_discard, n_past, -n_discard)
        if seq_id in self._workload.active_seqs():
            self._workload.shifted(seq_id, n_discard)
        return n_discard

    def _do_rebuild(self, model: Model, changes: dict) -> None:
        settings = {**self._settings, **changes}
        if Path(model.path).exists():  # refuses settings that cannot work before the old context goes
            estimate(model.path, keep_quantized=model.kept_quantized, **settings)
        old_model, old_settings = self._model, self._settings
        # The estimate cannot see everything a context checks (a device's free memory after this context's
        # weights leave it), so a refusal can still come after the old context is gone: its cells then come
        # back from a state snapshot. The workload starts afresh on them (what it was generating stops).
        # A caller may still hold the old context (`ctx = session.ctx` in a notebook): then it is not freed,
        # its weights keep their placement, and the new one may be refused for that very reason. Such a
        # context is taken back as it is; recreating it would be refused the same way.
        saved = self.ctx.state_get_data() if self.ctx is not None else None
        old_ctx = weakref.ref(self.ctx) if self.ctx is not None else lambda: None
        self._release_context()
        try:
            self.ctx = self._new_context(settings, self._spec, model)
        except Exception:
            still_held = old_ctx()
            if still_held is not None:
                self.ctx = still_held
            else:
                self.ctx = self._new_context(old_settings, self._spec, old_model)
                if saved is not None:
                    self.ctx.state_set_data(saved)
            self._workload = make_workload(self._spec, self.ctx)
            raise
        self._model, self._settings = model, settings
        self._workload = make_workload(self._spec, self.ctx)
        if self._state == "finished":
            self._state = "paused"
        self._publish_status()

    def _do_save(self, path: str | Path | None, seq_id: int | None) -> bytes | int:
        data = self.ctx.state_get_data() if seq_id is None else self.ctx.state_seq_get_data(seq_id)
        if path is None:
            return data
        Path(path).write_bytes(data)
        return len(data)

    def _do_load(self, source: bytes | str | Path, seq_id: int | None) -> int:
        data = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
        replaced = [s for s in self._workload.active_seqs() if seq_id is None or s == seq_id]
        if replaced and self._workload.owns_sequences:
            self._workload.stop_seq(replaced[0], "")  # refuses: the workload owns its sequences
        n_read = self.ctx.state_set_data(data) if seq_id is None else self.ctx.state_seq_set_data(data, seq_id)
        for s in replaced:  # only once the state is in: a refused state changes nothing, generation included
            self._workload.stop_seq(s, "replaced by a loaded state")
        return n_read

    # ---- helpers ---------------------------------------------------------------------------------
    def _state_events(self) -> list[ev.Event]:
        """The session's part of a new watcher's starting state: its status, and the sequences' jobs."""
        assigned = self._take_assignments()
        status = self.status()
        workload_state = getattr(self._workload, "state_events", None)  # e.g. a server's slots and checkpoints
        return [ev.SessionStatus(status.state, status.step, status.workload, status.steps_per_second),
                *assigned, *(workload_state() if workload_state else [])]

    def _take_assignments(self) -> list[ev.SequenceAssigned]:
        """Keep the latest assignment of each sequence from those queued; returns them all."""
        with self._assigned_lock:
            for event in self._assignments.drain():
                self._assigned[event.seq_id] = event
            return list(self._assigned.values())

    def _new_context(self, settings: dict, spec: WorkloadSpec, model: Model | None = None) -> Context:
        settings = dict(settings)
        settings["n_seq_max"] = max(settings.get("n_seq_max", 1), spec.n_seq_max_needed())
        ctx = Context(model or self._model, bus=self.bus, **settings)
        if self._opened:  # the session's state (a workload's memory included) goes after the new context's
            self.bus.add_state_source(self._state_events)
        return ctx

    def _release_context(self) -> None:
        """Drop the context now, so that its weights' placement and device reservations are free for the
        next one (they are released when the context is collected)."""
        self._workload = None
        self.ctx = None
        gc.collect()

    @staticmethod
    def _checked_speed(steps_per_second: float) -> float:
        if not isinstance(steps_per_second, (int, float)) or isinstance(steps_per_second, bool) or steps_per_second < 0:
            raise KvscopeError(f"steps_per_second must be a number >= 0 (0: as fast as possible), got "
                               f"{steps_per_second!r}")
        return float(steps_per_second)

    def _set_speed(self, speed: float) -> None:
        with self._lock:
            self._speed = speed
        self._publish_status()

    def _set_state(self, state: str, message: str = "") -> None:
        with self._lock:
            self._state = state
        self._publish_status(message)

    def _publish_status(self, message: str = "") -> None:
        status = self.status()
        self._publish(ev.SessionStatus(status.state, status.step, status.workload, status.steps_per_second,
                                       message))

    def _publish(self, event: ev.Event) -> None:
        if self.bus.active:
            self.bus.publish(event)


def _args_text(settings: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in settings.items())
