"""`kvscope attach` without a terminal (a pipe, CI): the cache of a watched llama.cpp log as text frames, at
most one per `every_s` while it changes and one at the end, like the explorer's text frames (tui/plain.py)
for a session. Cell grids are llama.cpp's cell maps ('.' empty, the sequence id, 'M' for several)."""
from __future__ import annotations

import io
import time
from typing import Callable, TextIO

from engine import events as ev
from engine.watch.describe import cell_map, describe_event
from engine.watch.server_slots import SERVER_EVENTS
from engine.watch.watcher import Watcher

CELLS_PER_ROW = 64
SHOWN_KINDS = (ev.CellsChanged, ev.SlotSearchFailed, *SERVER_EVENTS)
LEGEND = f"""\
kvscope attach: a llama.cpp's KV cache read from its log, as text (no terminal here:
in one, kvscope attach opens the explorer). What a frame shows:
  === time    seconds since kvscope attached · the status · dumps read (dropped
              to keep up) · log lines kvscope did not use
  lane        cache · full attention or its window · stream · used/size cells ·
              head (where the next slot search starts)
  cells       . empty   a number: the id of the one sequence holding the cell
              M several sequences (llama.cpp's cell map); {CELLS_PER_ROW} cells a row,
              the row's first cell before it
  events      the cell changes and the server's slot events since the frame
              before, after their number
"""


def print_frames(watcher: Watcher, out: TextIO, *, every_s: float, done: Callable[[], bool],
                 events_per_frame: int = 12) -> int:
    """Write the legend, then a frame whenever the cache changed and `every_s` went by, until done() is
    true; then a last frame of what came since. Returns the frames written."""
    stats: ev.LogStats | None = None

    def write(new: list[ev.Event], seconds: float) -> None:
        nonlocal stats
        stats = next((e for e in reversed(new) if isinstance(e, ev.LogStats)), stats)
        write_frame(watcher, out, new, seconds=seconds, stats=stats, events_per_frame=events_per_frame)

    return frame_loop(watcher, out, LEGEND, write, every_s=every_s, done=done)


def frame_loop(watcher: Watcher, out: TextIO, legend: str, write: Callable[[list[ev.Event], float], None], *,
               every_s: float, done: Callable[[], bool]) -> int:
    """Write the legend, then write(the events since the last frame, seconds since the start) whenever events came
    and `every_s` went by, until done() is true; then a last frame of what came since. Returns the frames written.
    The loop of every text view without a terminal (a llama.cpp log's cells, KV event publishers' blocks)."""
    out.write(legend)
    out.flush()
    started = time.monotonic()
    shown = 0  # the watcher's event count at the last frame
    frames = 0
    last_frame = -every_s
    while True:
        finished = done()  # before the poll: the events that made it true are drawn
        watcher.poll()
        now = time.monotonic()
        if watcher.events > shown and (finished or now - last_frame >= every_s):
            write(watcher.events_since(shown), now - started)
            shown, last_frame, frames = watcher.events, now, frames + 1
        if finished:
            return frames
        time.sleep(min(0.1, every_s))


def write_frame(watcher: Watcher, out: TextIO, new: list[ev.Event], *, seconds: float,
                stats: ev.LogStats | None = None, events_per_frame: int = 12) -> None:
    """One frame: the status and the log's counts, every cache stream's cell map, and the cell and slot
    events among `new` (what came since the frame before)."""
    text = io.StringIO()
    status = watcher.status
    parts = [f"=== {seconds:.1f} s", f"{status.state}: {status.message}" if status else "?"]
    if stats is not None:
        parts.append(f"{stats.dumps} dumps ({stats.dumps_dropped} dropped to keep up), "
                     f"{stats.skipped} of {stats.lines} lines not used")
    text.write(" · ".join(parts) + "\n")
    for sf in watcher.frame().streams:
        created = watcher.mirror.created.get(sf.cache)
        window = f"window {created.n_swa}" if created and created.n_swa else "full attention"
        text.write(f"{sf.cache} · {window} · stream {sf.stream} · used {sf.used}/{sf.size} · head {sf.head}\n")
        for k, line in enumerate(cell_map(sf.owner, CELLS_PER_ROW)):
            text.write(f"  {k * CELLS_PER_ROW:5d} {line}\n")
    write_events(text, [e for e in new if isinstance(e, SHOWN_KINDS) and not getattr(e, "tentative", False)],
                 events_per_frame)
    out.write(text.getvalue())
    out.flush()


def write_events(text: TextIO, shown: list[ev.Event], events_per_frame: int) -> None:
    """A frame's events, its last `events_per_frame` after their number, saying how many came before them."""
    if len(shown) > events_per_frame:
        text.write(f"  ... {len(shown) - events_per_frame} events before these\n")
    for event in shown[-events_per_frame:]:
        text.write(f"  {event.seq_no:>6} {describe_event(event)}\n")
