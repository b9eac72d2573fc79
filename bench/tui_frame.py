"""How fast the terminal explorer draws: the cell grid of large caches, and the event rate it keeps up with.

    python bench/tui_frame.py [--reps 20]

- grid: CellGrid.show() of a frame plus render_line() of every visible line, in a 160x48 terminal, for
  one-stream caches of 4k, 32k and 131k cells (every cell used, four sequences and shared cells), at one
  cell per glyph (the lanes scroll) and folded to fit the screen.
- events: the explorer's refresh (drain the watcher, take a frame, redraw) fed by a stream of 4-stream
  decodes' events as fast as it can take them: events per second absorbed without falling behind.
Medians; other jobs share the machine, so compare within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from watch import _Recorded, four_stream_events  # noqa: E402 - bench/watch.py's event stream

import engine  # noqa: E402
from engine import events as ev  # noqa: E402
from engine.watch.frames import SHARED, Frame, StreamFrame  # noqa: E402
from engine.watch.watcher import Watcher  # noqa: E402
from tui.app import KvscopeApp  # noqa: E402
from tui.grid import CellGrid  # noqa: E402
from tui.sources import Source  # noqa: E402


def synthetic_frame(size: int) -> Frame:
    cells = np.arange(size)
    owner = (cells % 4).astype(np.int16)
    owner[::17] = SHARED
    changed = np.zeros(size, dtype=bool)
    changed[-64:] = True
    return Frame(0, (StreamFrame("kv", 0, cells.astype(np.int64), owner, np.where(owner == SHARED, 2, 1).astype(np.int16),
                                 np.zeros(size, dtype=np.int64), changed, np.zeros(size, dtype=bool), size // 2),))


async def grid_ms(size: int, zoom: int, reps: int) -> float:
    class GridOnly(KvscopeApp.__bases__[0]):  # a bare App holding one grid
        def compose(self):
            yield CellGrid()

    app = GridOnly()
    async with app.run_test(size=(160, 48)):
        grid = app.query_one(CellGrid)
        grid.zoom = zoom
        frame = synthetic_frame(size)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            grid.show(frame, {"kv": "kv · full attention"})
            for y in range(grid.size.height):
                grid.render_line(y)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3


async def events_absorbed(events: list[ev.Event]) -> float:
    """Events per second through the app's refresh: watcher drain, frame, redraw of every widget."""
    feed = _Recorded([])
    app = KvscopeApp(Source("session", Watcher(feed)), frames_per_second=1)  # refreshes driven by hand below
    async with app.run_test(size=(160, 48)):
        batch = 2000
        t0 = time.perf_counter()
        for start in range(0, len(events), batch):
            feed.events = events[start:start + batch]
            app.refresh_view()
        return len(events) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    for size in (4096, 32768, 131072):
        one = asyncio.run(grid_ms(size, 1, args.reps))
        folded = asyncio.run(grid_ms(size, max(1, size // (150 * 40)), args.reps))
        print(f"grid of {size:>6} cells: {one:6.2f} ms at one cell per glyph, {folded:6.2f} ms folded to the screen")
    events = four_stream_events(engine.load_model("demo"), 1000)
    rate = asyncio.run(events_absorbed(events))
    print(f"explorer refresh: {rate:,.0f} events/s absorbed ({len(events)} events of 1000 4-stream decodes, "
          f"refreshed every 2000 events)")


if __name__ == "__main__":
    main()
