"""What kvscope still has open when the interpreter exits is closed first, in order.

A session's worker, a recorder's writer and a remote session's I/O thread are daemon threads: Python does
not wait for them, and a worker still inside a torch op while the interpreter tears down makes the process
abort (`terminate called without an active exception`, exit code 134 instead of the script's own). So each
of them registers here when its thread starts and unregisters when closed; one atexit hook closes, before
the teardown, whatever is still registered:

    FRONT_ENDS  the notebook explorer and its views: they stop following first, so no redraw runs on a
                worker that is being closed
    WRITERS     recorders: their last events, index and trailer are written while the session is still
                there, and the file is complete
    SESSIONS    sessions (their worker ends after the step it is in) and remote sessions (their sockets)

Only weak references are kept: registering keeps nothing alive. Every close it calls waits a bounded
time for its thread, so the exit cannot hang. Torch-free, like the rest of engine/watch.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from typing import Protocol

FRONT_ENDS, WRITERS, SESSIONS = 0, 1, 2

log = logging.getLogger("kvscope.lifetime")


class Closable(Protocol):
    def close(self) -> None: ...


_lock = threading.Lock()
_registration_order = itertools.count()
_open: dict[int, tuple[int, int, weakref.ref]] = {}  # id(thing) -> (stage, registration number, weak ref)


def close_at_exit(thing: Closable, stage: int) -> None:
    """Have `thing.close()` called at interpreter exit unless discard(thing) came first."""
    if stage not in (FRONT_ENDS, WRITERS, SESSIONS):
        raise ValueError(f"close_at_exit: stage must be FRONT_ENDS, WRITERS or SESSIONS, got {stage!r}")
    key = id(thing)
    reference = weakref.ref(thing, lambda _: _forget(key))
    with _lock:
        _open[key] = (stage, next(_registration_order), reference)
    # atexit runs its hooks last registered first; registering again puts this one after the hooks of the
    # libraries imported since (torch's), so kvscope's threads stop before those libraries shut down.
    atexit.unregister(close_all)
    atexit.register(close_all)


def discard(thing: Closable) -> None:
    """`thing` was closed by its owner: nothing to do for it at exit."""
    _forget(id(thing))


def _forget(key: int) -> None:
    with _lock:
        _open.pop(key, None)


def still_open() -> list[Closable]:
    """What close_all would close, in its order: by stage, the latest registered first within one."""
    with _lock:
        entries = sorted(_open.values(), key=lambda entry: (entry[0], -entry[1]))
    return [thing for thing in (reference() for _, _, reference in entries) if thing is not None]


def close_all() -> None:
    """Close everything still registered (the atexit hook). A failing close is logged and the rest are
    still closed: one broken recorder must not leave a session's worker running into the teardown."""
    for thing in still_open():
        try:
            thing.close()
        except Exception as e:  # noqa: BLE001 - the others must be closed all the same
            log.warning("kvscope: closing %s at exit failed: %s: %s", type(thing).__name__, type(e).__name__, e)
        discard(thing)
