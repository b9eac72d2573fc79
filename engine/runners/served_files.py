"""The commands of a served session that name files or carry a state: save_state, load_state, load_model
and set_workload (a server workload's chat script). `kvscope serve` (engine/runners/serve.py) runs them
here instead of on the session directly, so that every path a remote client names stays inside the
folders the server was given (engine/runners/confined_paths.py) and an uploaded state is capped.

    files = ServedFiles(state_dir=None, models_dir=None, max_state_bytes=MAX_STATE_BYTES, pool=executor)
    files.save_state(session, "run.state")       # a Future; kvscope-state/run.state in the current folder

The session itself reads and writes no file for a client: a state is written here from its bytes, and
read here before the session gets them. Torch-free.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, Callable

from engine.errors import KvscopeError
from engine.runners.confined_paths import ConfinedFolder
from engine.watch.protocol import PathRefusedError

DEFAULT_STATE_DIR = "kvscope-state"  # in the folder the server starts in, made on first use
MAX_STATE_BYTES = 256 << 20  # a state a client uploads; an 8B model's f16 cache of 2k cells is ~256 MiB
BUNDLED_MODEL = "demo"  # what load_model takes as the bundled demo model (engine.models.model.DEMO_MODEL_NAME)
COMMANDS = ("save_state", "load_state", "load_model", "set_workload")


class ServedFiles:
    """The folders and the state cap of one server, and the commands that use them (see the module docstring)."""

    def __init__(self, *, state_dir: str | Path | None, models_dir: str | Path | None, max_state_bytes: int,
                 pool: Executor) -> None:
        """state_dir None: kvscope-state/ in the current folder, made (mode 0700) when a client first uses it.
        models_dir None: load_model takes only the bundled demo model. pool: where files are read, so that
        reading one never holds up the caller (the server's I/O thread)."""
        if state_dir is None:
            self.states = ConfinedFolder(Path.cwd() / DEFAULT_STATE_DIR, "state folder", "--state-dir", create=True)
        else:
            self.states = ConfinedFolder(state_dir, "state folder", "--state-dir")
        self.models = None if models_dir is None else ConfinedFolder(models_dir, "models folder", "--models-dir")
        if not isinstance(max_state_bytes, int) or isinstance(max_state_bytes, bool) or max_state_bytes < 1:
            raise KvscopeError(f"max_state_bytes must be an int >= 1, got {max_state_bytes!r}")
        self.max_state_bytes = max_state_bytes
        self._pool = pool

    def save_state(self, session, path=None, seq_id=None) -> Future:
        """path None: the state's bytes; else a name in the state folder (the Future gives the file's size)."""
        if path is None:
            return session.save_state(None, seq_id)
        self.states.resolve(path, "save_state")  # refused before the session does any work
        return _then(session.save_state(None, seq_id),
                     lambda data: self.states.write_bytes(path, data, "save_state"))

    def load_state(self, session, source, seq_id=None) -> Future:
        """source: the state's bytes (at most max_state_bytes), or a name in the state folder."""
        if isinstance(source, bytes):
            if len(source) > self.max_state_bytes:
                raise KvscopeError(f"load_state: the state sent is {len(source)} bytes; this server takes states of "
                                   f"at most {self.max_state_bytes} bytes (save it to a file in its state folder "
                                   f"and load it by name instead)")
            return session.load_state(source, seq_id)
        if isinstance(source, str):
            self.states.resolve(source, "load_state")
            reading = self._pool.submit(self.states.read_bytes, source, "load_state")
            return _then(reading, lambda data: session.load_state(data, seq_id))
        raise KvscopeError(f"load_state: source must be the state's bytes or a file name in the server's state "
                           f"folder, got {type(source).__name__}")

    def load_model(self, session, path, dtype: str = "f32", **settings) -> Future:
        """path: "demo", or a name in the models folder (a GGUF file or a Hugging Face folder)."""
        if path == BUNDLED_MODEL:
            return session.load_model(path, dtype, **settings)
        if self.models is None:
            raise PathRefusedError(f"load_model: refused {path!r}: this server loads only {BUNDLED_MODEL!r} (the "
                                   f"bundled model); it loads others only from a folder given with --models-dir")
        return session.load_model(str(self.models.resolve(path, "load_model")), dtype, **settings)

    def set_workload(self, session, workload, **options) -> Future:
        """Session.set_workload from plain values: a workload given as a map (a WorkloadSpec's fields; a
        sampler as a map of SamplerParams' fields, which WorkloadSpec takes as it is); a chat script is a name
        in the state folder."""
        if isinstance(workload, dict):
            options = {**workload, **options}
            workload = options.pop("kind", "idle")
        if options.get("chat"):  # "": the built-in conversations
            options["chat"] = str(self.states.resolve(options["chat"], "set_workload"))
        return session.set_workload(workload, **options)

    def summary(self) -> list[str]:
        """Where the files that clients name are (the server's banner)."""
        models = (f"models: load_model takes names in {self.models.root}, and {BUNDLED_MODEL!r}" if self.models else
                  f"models: load_model takes only {BUNDLED_MODEL!r} (no --models-dir)")
        return [f"states: save_state, load_state and a chat script take names in {self.states.root}"
                + (" (made on first use)" if not self.states.root.exists() else ""), models]


def _then(first: Future, step: Callable[[Any], Any]) -> Future:
    """A Future of step(first's result), made without waiting: step runs where `first` finishes, and a
    Future that step returns is followed the same way."""
    result: Future = Future()

    def take(outcome: Future) -> None:
        try:
            value = step(outcome.result())
        except Exception as e:  # noqa: BLE001 - the command's error, handed to its client
            result.set_exception(e)
            return
        if isinstance(value, Future):
            value.add_done_callback(lambda inner: _copy(inner, result))
        else:
            result.set_result(value)

    first.add_done_callback(take)
    return result


def _copy(source: Future, target: Future) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
