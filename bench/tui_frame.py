"""How fast the terminal explorer draws: the cell grid of large caches, and the event rate it keeps up with.

    python bench/tui_frame.py [--reps 20]

- grid: CellGrid.show() of a frame plus render_line() of every visible line, in a 160x48 terminal, for
  one-stream caches of 4k, 32k and 131k cells (every cell used, four sequences and shared cells), at one
  cell per glyph (the lanes scroll) and folded to fit the screen.
- events: the explorer as it runs (its frame timer; drain the watcher, take a frame, redraw; Textual's
  layout and paint) fed 4-stream decodes' events at 25k, 50k and 100k events/s for a few seconds: it
  keeps up when everything is taken within a few frames of arriving and the backlog does not grow.
- keys: from an arrow key reaching the app to its action running, pressed at random moments, while the
  demo generates (a threaded session, as `kvscope` runs it) and while fed 50k events/s.
Medians; other jobs share the machine, so compare within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time

import numpy as np
from textual import events

import engine
from engine import events as ev
from engine.batch import Batch
from engine.runners.demo import DEMO_SETTINGS, DEMO_WORKLOAD
from engine.runners.launch import threads_beside_a_ui
from engine.runners.session import Session
from engine.watch.frames import SHARED, Frame, StreamFrame
from engine.watch.sources import Source, session_source
from engine.watch.watcher import Watcher
from tui.app import KvscopeApp
from tui.grid import CellGrid


def synthetic_frame(size: int, shift: int = 0) -> Frame:
    """A full cache of four sequences taking turns cell by cell (a run per glyph: the most segments a row
    can have), every 17th cell shared; `shift` moves the sequences along, so that every row differs."""
    cells = np.arange(size)
    owner = ((cells + shift) % 4).astype(np.int16)
    owner[::17] = SHARED
    changed = np.zeros(size, dtype=bool)
    changed[-64:] = True
    return Frame(0, (StreamFrame("kv", 0, cells.astype(np.int64), owner, np.where(owner == SHARED, 2, 1).astype(np.int16),
                                 np.zeros(size, dtype=np.int64), changed, np.zeros(size, dtype=bool), size // 2,
                                 np.zeros(size, dtype=bool)),))


async def grid_ms(size: int, zoom: int, reps: int, every_row_new: bool = True) -> float:
    """Median ms of a frame: show() and render_line() of every visible line. every_row_new: cycle three
    frames that differ in every row (the grid reuses rows that look as in the last two frames)."""
    class GridOnly(KvscopeApp.__bases__[0]):  # a bare App holding one grid
        def compose(self):
            yield CellGrid()

    app = GridOnly()
    async with app.run_test(size=(160, 48)):
        grid = app.query_one(CellGrid)
        grid.zoom = zoom
        frames = [synthetic_frame(size, shift) for shift in ((0, 1, 2) if every_row_new else (0,))]
        times = []
        for rep in range(reps):
            t0 = time.perf_counter()
            grid.show(frames[rep % len(frames)], {"kv": "kv · full attention"})
            for y in range(grid.size.height):
                grid.render_line(y)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3


class PacedFeed:
    """An event stream that arrives at a fixed rate, seen as a watcher's subscription: drain() hands out
    what has arrived since the last drain. The backlog is what has arrived and not been taken."""

    dropped = 0

    def __init__(self, events: list[ev.Event], per_second: float) -> None:
        self.events, self.per_second = events, per_second
        self.taken, self.started = 0, None

    def arrived(self) -> int:
        if self.started is None:
            return 0
        return min(len(self.events), int((time.perf_counter() - self.started) * self.per_second))

    def drain(self) -> list[ev.Event]:
        due = self.arrived()
        out, self.taken = self.events[self.taken:due], max(self.taken, due)
        return out


async def keeps_up(events: list[ev.Event], per_second: float) -> dict:
    """The explorer as it runs (its own frame timer, refresh, Textual's layout and paint) fed at
    `per_second`: the frames it drew, the largest backlog, and how long after the last event arrived it
    had taken them all. It keeps up when that is about a frame and the backlog stays bounded."""
    feed = PacedFeed(events, per_second)
    app = KvscopeApp(Source("session", Watcher(feed)))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        frames0 = app.frames_drawn
        feed.started = time.perf_counter()
        duration = len(events) / per_second
        backlog = {"first half": 0, "second half": 0}
        watcher = app.watcher
        while feed.taken < len(events) or watcher.backlog:  # the watcher's own backlog: a poll's leftovers
            await asyncio.sleep(0.005)
            half = "first half" if time.perf_counter() - feed.started < duration / 2 else "second half"
            backlog[half] = max(backlog[half], feed.arrived() - feed.taken + watcher.backlog)
        late_s = time.perf_counter() - feed.started - duration
        return dict(frames_per_s=(app.frames_drawn - frames0) / (duration + late_s), late_s=late_s, **backlog)


async def key_latencies(app: KvscopeApp, n_keys: int) -> list[float]:
    """Seconds from a key reaching the app (as the terminal driver hands it over) to its action running,
    for `n_keys` arrow keys at random moments of the frame cycle."""
    ran = asyncio.Event()
    move = app.action_cursor

    def timed_move(d_glyph: int, d_row: int) -> None:  # Textual passes as many arguments as named here
        move(d_glyph, d_row)
        ran.set()

    app.action_cursor = timed_move
    latencies, rng = [], random.Random(1)
    for k in range(n_keys):
        ran.clear()
        key = events.Key("right" if k % 2 else "left", None)
        key.set_sender(app)
        t0 = time.perf_counter()
        app._driver.send_message(key)
        await asyncio.wait_for(ran.wait(), 5)
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(rng.uniform(0.01, 0.1))
    return latencies


async def keys_while_generating(n_keys: int) -> list[float]:
    """The demo as `kvscope` runs it (a core left to the explorer), generating as fast as it can."""
    with Session("demo", settings=DEMO_SETTINGS, workload=DEMO_WORKLOAD, threads=threads_beside_a_ui()) as session:
        app = KvscopeApp(session_source(session, "demo"))
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.pause()
            session.start().result()
            await asyncio.sleep(1.0)
            return await key_latencies(app, n_keys)


async def keys_while_fed(events_: list[ev.Event], per_second: float, n_keys: int) -> list[float]:
    feed = PacedFeed(events_, per_second)
    app = KvscopeApp(Source("session", Watcher(feed)))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        feed.started = time.perf_counter()
        return await key_latencies(app, n_keys)


def cycling_events(model, n_events: int) -> list[ev.Event]:
    """Events of single-token decodes of 4 sequences in 4 streams: 500 decodes, then the sequences are
    removed, which leaves the cache as it began, so the cycle repeats (renumbered) as long as asked."""
    ctx = engine.Context(model, n_ctx=4 * 512, n_seq_max=4, kv_unified=False, swa_full=True)
    sub = ctx.bus.subscribe(maxsize=1 << 22)
    for pos in range(500):
        assert ctx.decode(Batch([5, 6, 7, 8], [pos] * 4, [[0], [1], [2], [3]])) == 0
    for seq in range(4):
        ctx.memory.seq_rm(seq, -1, -1)
    cycle = sub.drain()
    return [dataclasses.replace(cycle[k % len(cycle)], seq_no=k) for k in range(n_events)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each event rate is fed")
    parser.add_argument("--keys", type=int, default=40, help="keys pressed per latency measurement")
    args = parser.parse_args()
    for size in (4096, 32768, 131072):
        one = asyncio.run(grid_ms(size, 1, args.reps))
        folded = asyncio.run(grid_ms(size, max(1, size // (150 * 40)), args.reps))
        same = asyncio.run(grid_ms(size, 1, args.reps, every_row_new=False))
        print(f"grid of {size:>6} cells: {one:6.2f} ms at one cell per glyph, {folded:6.2f} ms folded to the screen "
              f"(every row new); {same:6.2f} ms when the rows look as before")
    keys = asyncio.run(keys_while_generating(args.keys))
    print(f"keys while the demo generates: {_latency_text(keys)}")
    per_seconds = (25_000, 50_000, 100_000)
    events = cycling_events(engine.load_model("demo"), int(args.seconds * max(per_seconds)))
    for per_second in per_seconds:
        shown = asyncio.run(keeps_up(events[:int(args.seconds * per_second)], per_second))
        verdict = "keeps up" if shown["late_s"] < 0.25 and shown["second half"] <= 1.5 * max(shown["first half"], 1) \
            else "falls behind"
        print(f"explorer fed {per_second:>7,} events/s for {args.seconds:.0f} s: {verdict}: {shown['frames_per_s']:4.1f} "
              f"frames/s, largest backlog {shown['first half']:,} / {shown['second half']:,} events (first / second "
              f"half), all taken {1e3 * shown['late_s']:.0f} ms after the last arrived")
    keys = asyncio.run(keys_while_fed(events, 50_000, args.keys))
    print(f"keys while fed 50,000 events/s: {_latency_text(keys)}")


def _latency_text(seconds: list[float]) -> str:
    ms = sorted(1e3 * t for t in seconds)
    return (f"median {statistics.median(ms):.1f} ms, 90th percentile {ms[int(0.9 * (len(ms) - 1))]:.1f} ms, "
            f"max {ms[-1]:.1f} ms ({len(ms)} keys)")

if __name__ == "__main__":
    main()
