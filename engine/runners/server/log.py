"""llama-server's log lines, in its words and its layout.

tools/server/server-common.h prefixes every slot line with `slot %12.*s: id %2d | task %d | ` (the calling
function's name cut to 12 characters, right-aligned) and every server line with `srv  %12.*s: `; common/log
puts the time since start (`minutes.seconds.ms.us`) and a level letter in front. Most of the cache policy's
lines are trace lines (SLT_TRC), which llama-server prints as info (`I`) from verbosity 4 (`-v`); debug lines
(`D`) need `-v` too. The functions named here are the ones llama-server prints: the prompt-processing lines
come from a lambda, hence `operator()`.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

from engine import events as ev

KEPT_LINES = 20_000  # a long simulation keeps its latest lines; every line is also an event


def stamp(seconds: float) -> str:
    """common/log.cpp's time prefix: minutes.seconds.milliseconds.microseconds since the start."""
    us = int(seconds * 1e6)
    return f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"


class ServerLog:
    """Writes the server's lines: kept (the latest KEPT_LINES), published as ServerLogLine events, and
    handed to `echo` (e.g. print) when given; debug lines only when `verbose`."""

    def __init__(self, bus: ev.EventBus | None = None, *, verbose: bool = True,
                 echo: Callable[[str], None] | None = None) -> None:
        self.bus, self.verbose, self.echo = bus, verbose, echo
        self.lines: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
        self.started = time.perf_counter()

    def slot(self, level: str, func: str, slot_id: int, task_id: int, text: str) -> None:
        self._write(level, f"slot {func[:12]:>12}: id {slot_id:2d} | task {task_id} | {text}", slot_id, task_id)

    def srv(self, level: str, func: str, text: str) -> None:
        self._write(level, f"srv  {func[:12]:>12}: {text}", -1, -1)

    def _write(self, level: str, body: str, slot_id: int, task_id: int) -> None:
        if level == "debug" and not self.verbose:
            return
        line = f"{stamp(time.perf_counter() - self.started)} {ev.SERVER_LOG_LETTERS[level]} {body}"
        self.lines.append(line)
        if self.bus is not None:
            self.bus.publish(ev.ServerLogLine(level=level, text=body, slot=slot_id, task=task_id))
        if self.echo is not None:
            self.echo(line)


def without_stamp(line: str) -> str:
    """A log line without its time (what two runs of the same requests share)."""
    head, _, rest = line.partition(" ")
    return rest if head.count(".") == 3 else line
