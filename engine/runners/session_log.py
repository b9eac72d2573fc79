"""A session's log: the lines the engine logs while it works for that session, kept with the session
instead of written into whatever happens to own stderr at the time.

The engine logs as llama.cpp prints ("context full, swapping: n_past = 111, ..."), through the `kvscope.*`
and `engine.*` loggers. Without a handler configured, Python writes WARNING and above to stderr (its
"last resort"): from a session's worker thread that lands in a notebook under whichever cell runs next.
So one process-wide handler (_Router) sits on those two loggers and sends each record made on a thread
while it works for a session (its worker; the caller's thread during a command of an unthreaded session)
to that session's SessionLog: kept there (the latest KEPT_LINES), and printed on stderr only when the
session was made verbose. Records of no session go where they would have gone without the router.

Handlers the application configured (the `kvscope` command's, logging.basicConfig's, pytest's) still get
every record, a session's included: the router adds a destination and takes nothing away from them. For
the same reason it lowers the loggers' level (so that a session keeps its info or debug lines) only where
nobody else listens and nobody set that level; otherwise a session keeps what the application's levels let
through. (What the router lowered goes back when the last session closes.)
"""
from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from engine.arguments import flag_arg
from engine.errors import KvscopeError

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
KEPT_LINES = 2000  # a session running for hours keeps its latest lines
ROUTED_LOGGERS = ("kvscope", "engine")  # the engine's module loggers live under these two names


@dataclass(frozen=True)
class LogLine:
    """One record of a session's log."""

    number: int  # 1 for the session's first line; numbers go on past the KEPT_LINES kept
    level: str  # a key of LOG_LEVELS ("error" for anything above)
    logger: str  # the logger's name, e.g. "kvscope.generate"
    text: str  # the message as the engine wrote it; an exception's type and message after it
    time: float  # time.time() when it was logged


def level_name(levelno: int) -> str:
    for name, value in sorted(LOG_LEVELS.items(), key=lambda item: -item[1]):
        if levelno >= value:
            return name
    return "debug"


def checked_level(level: str) -> str:
    if level not in LOG_LEVELS:
        raise KvscopeError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return level


class SessionLog:
    """The lines logged for one session, `level` and above (see the module docstring); `verbose`: also
    printed on stderr, bare, as the `kvscope` command prints them."""

    def __init__(self, *, verbose: bool = False, level: str = "info") -> None:
        self.verbose = flag_arg(verbose, "verbose", "Session")
        self._level = checked_level(level)
        self._lines: collections.deque[LogLine] = collections.deque(maxlen=KEPT_LINES)
        self._lock = threading.Lock()
        self.n_lines = 0  # every line kept so far, those pushed out of the deque included
        _router().add(self)

    @property
    def level(self) -> str:
        return self._level

    @level.setter
    def level(self, level: str) -> None:
        """From now on keep lines of this level and above (a notebook's level switch)."""
        self._level = checked_level(level)
        _router().levels_changed()

    def lines(self, after: int = 0, level: str = "debug") -> list[LogLine]:
        """The kept lines numbered above `after`, of `level` and above, oldest first."""
        floor = LOG_LEVELS[checked_level(level)]
        with self._lock:
            return [line for line in self._lines if line.number > after and LOG_LEVELS[line.level] >= floor]

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """What this thread logs inside the block is this session's."""
        previous = getattr(_working_for, "log", None)
        _working_for.log = self
        try:
            yield
        finally:
            _working_for.log = previous

    def close(self) -> None:
        """The session is closed: its log stops asking the loggers for its level (the lines stay)."""
        _router().remove(self)

    def keep(self, record: logging.LogRecord) -> None:
        if record.levelno < LOG_LEVELS[self._level]:
            return
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            text = f"{text}: {type(error).__name__}: {error}"
        with self._lock:
            self.n_lines += 1
            self._lines.append(LogLine(self.n_lines, level_name(record.levelno), record.name, text, record.created))
        if self.verbose:
            sys.stderr.write(_BARE.format(record) + "\n")  # looked up now: a redirected stderr is followed


_BARE = logging.Formatter("%(message)s")
_working_for = threading.local()  # .log: the SessionLog of the session this thread works for, if any


class _Router(logging.Handler):
    """The one handler on ROUTED_LOGGERS (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._logs: weakref.WeakSet[SessionLog] = weakref.WeakSet()
        self._levels_lock = threading.Lock()
        self._levels_set: dict[str, int] = {}  # logger name -> the level the router gave it
        for name in ROUTED_LOGGERS:
            logging.getLogger(name).addHandler(self)

    def add(self, log: SessionLog) -> None:
        self._logs.add(log)
        self.levels_changed()

    def remove(self, log: SessionLog) -> None:
        self._logs.discard(log)
        self.levels_changed()

    def emit(self, record: logging.LogRecord) -> None:
        log = getattr(_working_for, "log", None)
        if log is not None:
            log.keep(record)
        elif not self._others_listen(logging.getLogger(record.name)):
            last_resort = logging.lastResort
            if last_resort is not None and record.levelno >= last_resort.level:
                last_resort.handle(record)  # as if the router were not there

    def levels_changed(self) -> None:
        """Let the loggers make the records the live sessions' logs keep, where that is the router's to do."""
        wanted = min((LOG_LEVELS[log.level] for log in list(self._logs)), default=None)
        with self._levels_lock:
            for name in ROUTED_LOGGERS:
                logger = logging.getLogger(name)
                ours = self._levels_set.pop(name, None)
                if logger.level not in (logging.NOTSET, ours):
                    continue  # the application set it since: its own
                if wanted is not None and not self._others_listen(logger) and \
                        wanted < logger.parent.getEffectiveLevel():
                    logger.setLevel(wanted)
                    self._levels_set[name] = wanted
                elif ours is not None:
                    logger.setLevel(logging.NOTSET)

    def _others_listen(self, logger: logging.Logger | None) -> bool:
        """Whether a handler besides the router gets this logger's records (Logger.callHandlers' walk)."""
        while logger is not None:
            if any(handler is not self for handler in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


_the_router: _Router | None = None
_router_lock = threading.Lock()


def _router() -> _Router:
    global _the_router
    with _router_lock:
        if _the_router is None:
            _the_router = _Router()
        return _the_router
