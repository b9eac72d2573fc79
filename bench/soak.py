"""A long run of the live layer: does anything grow, get lost or go wrong over time?

    python bench/soak.py [--minutes 30] [--port 5790] [--out /tmp/soak.kvtrace] [--without PART ...]
                         [--census MINUTES] [--trace-malloc FRAMES] [--trace-from MINUTES]

One process runs a Session (the demo model, the parallel workload, new requests whenever the queue runs
dry) served over ZeroMQ, and attaches four watchers:
- a view: a Watcher polled 10 times a second, taking a frame each time;
- a slow view: a Watcher with a 64-event queue polled every 2 s, so that it drops events and resyncs;
- a remote view: a RemoteSession's Watcher, polled 5 times a second;
- a Recorder writing every event to a file.
Every minute it prints the resident memory (VmRSS) and the counts; every 5 minutes it pauses the session
and checks each view against the engine's own cells. At the end the recording is replayed to its last
event and compared with the view's mirror. It fails (exit 1) if memory after the warm-up moves by more
than 5% (the warm-up: 3 minutes, and until the run keeps as many finished requests as it ever will,
KEPT_RESULTS, a bounded buffer that takes about 6 minutes to fill here), if a view disagrees with the engine, if a dropped event was not followed by a resync, or
if the recording does not replay. Not part of the test command: it takes as long as you give it.

To find what grows: --census counts the objects alive by type at quiet points (the session paused, every
queue drained, the views' histories written, garbage collected) and says what grew since the first count,
without slowing the run; --trace-malloc does the same with tracemalloc snapshots (allocation sites, but
several times slower). Both print what the places that keep events or requests hold. The per-minute line
gives pymalloc's bytes in use beside its arenas, and the collector's runs.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import gc
import os
import re
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Iterator

import engine
from engine.runners.parallel import KEPT_RESULTS
from engine.runners.serve import SessionServer
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.sampling import SamplerParams
from engine.watch import Recorder, RecordingReader, Watcher
from engine.watch.remote import RemoteSession

WARM_UP_S = 180
QUESTIONS = ["Who was Moses?", "What did the LORD say?", "Tell of the flood.", "Who built the ark?"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_mib() -> tuple[float, float] | None:
    """glibc's malloc: bytes in use (mmap'd chunks included) and bytes free but held (mallinfo2), in MiB;
    None elsewhere. mallinfo2 sums every arena, the threads' (the session's worker, the pollers, the recorder,
    ZeroMQ) as well as the main one: glibc_arenas_mib gives them one by one, anonymous_regions_mib where
    resident memory is."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def python_arenas_mib() -> tuple[float, float] | None:
    """pymalloc's arenas (mmap'd outside glibc's heap, so mallinfo2 does not count them): the memory of the
    arenas allocated now, and the bytes in blocks in use in them, in MiB, from sys._debugmallocstats (which
    writes to the C stderr). Arenas well above the blocks in use: memory held by a few live objects per
    arena (fragmentation). None where pymalloc is not the allocator (under tracemalloc, for one)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read()
    count = re.search(r"# arenas allocated current\s*=\s*([\d,]+)", text)
    size = re.search(r"arenas \* ([\d,]+) bytes/arena", text)
    used = re.search(r"# bytes in allocated blocks\s*=\s*([\d,]+)", text)
    if count is None or size is None or used is None:
        return None
    number = [int(m.group(1).replace(",", "")) for m in (count, size, used)]
    return number[0] * number[1] / 2**20, number[2] / 2**20


def glibc_arenas_mib() -> list[tuple[float, float]] | None:
    """Every glibc arena (the main one first, then one per thread that allocated, up to glibc's limit): the
    memory it took from the system and how much of that is in use, in MiB (malloc_info); None elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        malloc_info, fdopen, fclose = libc.malloc_info, libc.fdopen, libc.fclose
    except (OSError, AttributeError):
        return None
    fdopen.restype, fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
    malloc_info.argtypes, fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.TemporaryFile() as out:
        stream = fdopen(os.dup(out.fileno()), b"w")
        if not stream:
            return None
        malloc_info(0, stream)
        fclose(stream)
        out.seek(0)
        text = out.read().decode("ascii", "replace")
    arenas = []
    for heap in re.findall(r'<heap nr="\d+">(.*?)</heap>', text, re.S):
        free = sum(int(n) for n in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', heap))
        system = re.search(r'<system type="current" size="(\d+)"', heap)
        if system is not None:
            arenas.append((int(system.group(1)) / 2**20, (int(system.group(1)) - free) / 2**20))
    return arenas


def rss_mib(kind: str = "VmRSS") -> float:
    """Resident memory from /proc/self/status: VmRSS (all), RssAnon (heaps, arenas, stacks) or RssFile
    (mapped files: the model, libraries), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def anonymous_regions_mib() -> dict[str, float]:
    """Resident anonymous memory by kind of mapping (/proc/self/smaps): glibc's [heap], thread stacks, and
    anonymous mmaps by size (1 MiB: pymalloc's arenas; others: glibc's large chunks, torch, numpy)."""
    out = {"heap": 0.0, "arenas (1 MiB maps)": 0.0, "other anonymous maps": 0.0}
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return {}
    size = name = None
    for line in text.splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            size, name = hi - lo, head[5] if len(head) > 5 else ""
        elif head[0] == "Anonymous:" and size is not None:
            kib = int(head[1])
            if name == "[heap]":
                out["heap"] += kib / 1024
            elif name == "":
                out["arenas (1 MiB maps)" if size == 1 << 20 else "other anonymous maps"] += kib / 1024
    return out


class Poller(threading.Thread):
    """Polls a watcher every `interval` seconds (a view redrawing)."""

    def __init__(self, watcher: Watcher, interval: float, frames: bool = False) -> None:
        super().__init__(daemon=True)
        self.watcher, self.interval, self.frames = watcher, interval, frames
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            with self.lock:
                self.watcher.poll()
                if self.frames:
                    self.watcher.frame()


def disagreements(name: str, watcher: Watcher, engine_cells: dict) -> list[str]:
    watcher.poll()
    out = []
    for cache, data in engine_cells.items():
        for s, (cells, head) in enumerate(zip(data["cells"], data["heads"])):
            if watcher.mirror.cells(s, cache) != cells or watcher.mirror.head(s, cache) != head:
                out.append(f"{name}: {cache} stream {s} differs from the engine")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=5790)
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "soak.kvtrace"))
    parser.add_argument("--without", action="append", default=[], choices=["view", "slow view", "remote view", "recorder"],
                        help="leave a part out, to find which one a growth comes from (repeatable)")
    parser.add_argument("--trace-malloc", type=int, default=0, metavar="FRAMES",
                        help="trace Python allocations (tracemalloc, FRAMES frames deep, e.g. 10): a snapshot at the end "
                             "of the warm-up, then every 5 minutes the top differences against it (slow: a run for looking "
                             "for a growth, not for the memory verdict)")
    parser.add_argument("--census", type=float, default=0.0, metavar="MINUTES",
                        help="every MINUTES after the warm-up, with the session paused and its queues drained: the objects "
                             "alive by type and what grew since the first count, and what the places that keep events or "
                             "requests hold (cheap: no tracemalloc, so the run keeps its pace)")
    parser.add_argument("--trace-from", type=float, default=None, metavar="MINUTES",
                        help="take the first snapshot or count at this minute instead of at the end of the warm-up (the "
                             "differences then include the kept requests filling up)")
    parser.add_argument("--trace-top", type=int, default=25, help="how many differences to print")
    args = parser.parse_args()
    if args.trace_malloc:
        tracemalloc.start(args.trace_malloc)

    settings = dict(n_ctx=2048, n_seq_max=5, kv_unified=True, swa_full=True)
    spec = WorkloadSpec("parallel", n_clients=4, n_sequences=32, n_predict=48, arrival_gap=1,
                        sampler=SamplerParams(temperature=0.8, seed=1))
    model = engine.load_model("demo")
    failures: list[str] = []
    with Session(model, settings=settings, workload=spec) as session, \
            SessionServer("127.0.0.1", args.port) as server:
        server.start(session)
        remote = (RemoteSession(server.command_address, token=server.token) if "remote view" not in args.without
                  else None)
        views = {"view": lambda: Poller(Watcher.of(session), 0.1, frames=True),
                 "slow view": lambda: Poller(Watcher(session.subscribe(64), session.current_state), 2.0),
                 "remote view": lambda: Poller(Watcher.of(remote), 0.2)}
        views = {name: make() for name, make in views.items() if name not in args.without}
        recorder = Recorder(args.out) if "recorder" not in args.without else None
        if recorder is not None:
            recorder.attach(session.bus)
            recorder.start()
        for poller in views.values():
            poller.start()
        session.start().result()
        t0 = time.monotonic()
        rss: list[tuple[float, float]] = []
        warm_from: float | None = None
        next_check, next_sample = 300.0, 0.0
        baseline: tracemalloc.Snapshot | None = None
        first_census: tuple[collections.Counter, int] | None = None
        next_trace = 0.0
        while (elapsed := time.monotonic() - t0) < args.minutes * 60:
            time.sleep(0.2)
            if session.status().state in ("idle", "finished"):  # keep the clients busy
                for i in range(32):
                    session.add_prompt(QUESTIONS[i % len(QUESTIONS)], n_predict=48)
            if elapsed >= next_sample:
                next_sample += 60.0
                rss.append((elapsed, rss_mib()))
                parts = [f"{name} {poller.watcher.events} events, {poller.watcher.dropped} dropped, "
                         f"{poller.watcher.resyncs} resyncs" for name, poller in views.items()]
                if recorder is not None:
                    parts.append(f"recorded {recorder.n_events}")
                heap = malloc_mib()
                if heap is not None:
                    parts.insert(0, f"malloc in use {heap[0]:.1f} MiB, free {heap[1]:.1f} MiB")
                regions = anonymous_regions_mib()
                if regions:
                    parts.insert(0, "anonymous: " + ", ".join(f"{k} {v:.1f}" for k, v in regions.items()))
                arenas = python_arenas_mib()
                parts.insert(0, "gc: " + ", ".join(f"gen{g} {st['collections']} runs, {st['collected']} collected"
                                                    for g, st in enumerate(gc.get_stats())))
                parts.insert(0, f"python blocks {sys.getallocatedblocks()}"
                             + (f" ({arenas[1]:.1f} MiB) in {arenas[0]:.0f} MiB of arenas" if arenas is not None else ""))
                kept = getattr(getattr(session._workload, "runner", None), "results", ())
                if warm_from is None and elapsed >= WARM_UP_S and len(kept) >= KEPT_RESULTS:
                    warm_from = elapsed
                if tracemalloc.is_tracing():
                    parts.insert(0, f"traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB")
                print(f"{elapsed / 60:5.1f} min  rss {rss[-1][1]:7.1f} MiB (anon {rss_mib('RssAnon'):.1f}, files "
                      f"{rss_mib('RssFile'):.1f})  step {session.status().step:7d}  requests kept {len(kept)}  "
                      + " · ".join(parts), flush=True)
                traced_from = warm_from if args.trace_from is None else args.trace_from * 60
                looking = tracemalloc.is_tracing() or args.census
                if looking and traced_from is not None and elapsed >= max(traced_from, next_trace):
                    next_trace = elapsed + 60.0 * (args.census or 5.0)
                    with quiet(session, views, recorder):
                        print(holders(session, views, recorder), flush=True)
                        if args.census:
                            counts = census()
                            if first_census is None:
                                first_census = counts
                            print_census(first_census, counts, elapsed, args.trace_top)
                        if tracemalloc.is_tracing():
                            snapshot = quiet_snapshot()
                            if baseline is None:
                                baseline = snapshot
                                print(f"tracemalloc: baseline at minute {elapsed / 60:.1f}, "
                                      f"{sum(s.size for s in baseline.statistics('filename')) / 2**20:.2f} MiB traced",
                                      flush=True)
                            else:
                                print_growth(baseline, snapshot, elapsed, args.trace_top)
            if elapsed >= next_check:
                next_check += 300.0
                failures += check_views(session, views)
        failures += check_views(session, views, resume=False)  # the session stays paused from here on
        for name, poller in views.items():
            if poller.watcher.dropped and not poller.watcher.resyncs:
                failures.append(f"the {name} dropped {poller.watcher.dropped} events and never resynced")
            poller.stopped.set()
        if recorder is not None:
            recorder.close()
            if "view" in views:
                failures += check_recording(args.out, views["view"].watcher)
        failures += check_memory(rss, warm_from)
        if remote is not None:
            remote.close()
    print("soak: OK" if not failures else "soak: FAILED\n  " + "\n  ".join(failures))
    return 0 if not failures else 1


@contextlib.contextmanager
def quiet(session: Session, views: dict[str, Poller], recorder: Recorder | None) -> Iterator[None]:
    """The session paused and everything in flight settled: the views polled (their cell histories written,
    so that they hold no queued events), the recorder flushed, garbage collected. What is alive then is
    what stays, so that events in flight neither hide nor fake a growth."""
    session.pause().result()
    try:
        time.sleep(1.0)  # the remote view's events are on their way
        for poller in views.values():
            with poller.lock:
                poller.watcher.poll()
                for columns in poller.watcher.history._caches.values():
                    columns.flush()
        if recorder is not None:
            recorder.flush()
        gc.collect()
        yield
    finally:
        session.start().result()


def quiet_snapshot() -> tracemalloc.Snapshot:
    # tracemalloc's own module and the import machinery are not the program's memory
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__),
                                                     tracemalloc.Filter(False, "<frozen importlib._bootstrap*>")])


def census() -> tuple[collections.Counter, int]:
    """Objects the collector tracks, by type, and all allocated blocks (strings and numbers included)."""
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects()), sys.getallocatedblocks()


def print_census(first: tuple[collections.Counter, int], now: tuple[collections.Counter, int], elapsed: float,
                 top: int) -> None:
    arenas = python_arenas_mib()
    glibc = glibc_arenas_mib()
    print(f"census at minute {elapsed / 60:.1f}: {now[1]} blocks ({now[1] - first[1]:+d} since the first)"
          + (f", {arenas[1]:.1f} MiB in use in {arenas[0]:.0f} MiB of pymalloc arenas" if arenas else "")
          + ("; glibc arenas in use (of taken), MiB: " + ", ".join(f"{u:.1f} ({t:.1f})" for t, u in glibc)
             if glibc else "") + "; types that grew most:", flush=True)
    grown = sorted(((n - first[0].get(t, 0), t, n) for t, n in now[0].items()), reverse=True)
    print("  " + ", ".join(f"{t} {d:+d} (now {n})" for d, t, n in grown[:top] if d > 0), flush=True)


def holders(session: Session, views: dict[str, Poller], recorder: Recorder | None) -> str:
    """How much each place that may hold events or per-request records holds now (what the differences of
    --trace-malloc and --census are read against): events alive, each watcher's recent events, queued history
    entries, remembered jobs and cause texts, the kept requests, the session's queued assignments, the
    recording's chunk index."""
    alive = sum(1 for o in gc.get_objects() if issubclass(type(o), engine.events.Event))  # type(): no __class__ lookups
    parts = [f"events alive {alive}"]
    for name, poller in views.items():
        w = poller.watcher
        queued = sum(len(c._queued) for c in w.history._caches.values())
        jobs = sum(len(j) for j in w.history.requests.values())
        parts.append(f"{name}: recent {len(w.recent)}, history queued {queued}, jobs {jobs}, causes {len(w.history._why)}")
    runner = getattr(session._workload, "runner", None)
    if runner is not None:
        parts.append(f"requests kept {len(runner.results)}")
    parts.append(f"session's assignments queued {session._assignments.pending()}")
    if recorder is not None:
        parts.append(f"recording chunks {len(recorder.chunks)}")
    return "holders: " + " · ".join(parts)


def print_growth(baseline: tracemalloc.Snapshot, now: tracemalloc.Snapshot, elapsed: float, top: int) -> None:
    """The allocations that grew most since the baseline: by line, then the biggest by traceback."""
    total = sum(s.size for s in now.statistics("filename"))
    base = sum(s.size for s in baseline.statistics("filename"))
    print(f"tracemalloc at minute {elapsed / 60:.1f}: {total / 2**20:.2f} MiB traced "
          f"({(total - base) / 2**20:+.2f} MiB since the baseline); top {top} by line:", flush=True)
    grown = sorted((s for s in now.compare_to(baseline, "lineno") if s.size_diff > 0), key=lambda s: -s.size_diff)
    for stat in grown[:top]:
        print(f"  {stat}")
    print(f"top {min(top, 10)} by traceback:")
    grown = sorted((s for s in now.compare_to(baseline, "traceback") if s.size_diff > 0), key=lambda s: -s.size_diff)
    for stat in grown[:min(top, 10)]:
        print(f"  {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+d} blocks (now {stat.size / 1024:.1f} KiB, "
              f"{stat.count} blocks)")
        for line in stat.traceback.format(limit=10, most_recent_first=True):
            print(f"    {line}")
    sys.stdout.flush()


def check_views(session: Session, views: dict[str, Poller], resume: bool = True) -> list[str]:
    session.pause().result()
    cells = session.engine_cells().result()
    time.sleep(1.0)  # the remote view's events are on their way
    out = []
    for name, poller in views.items():
        with poller.lock:
            out += disagreements(name, poller.watcher, cells)
    if resume:
        session.start().result()
    print(f"views checked against the engine: {'all equal' if not out else '; '.join(out)}", flush=True)
    return out


def check_recording(path: str, view: Watcher) -> list[str]:
    with RecordingReader(path) as reader:
        mirror = reader.seek(len(reader) - 1)
        size = Path(path).stat().st_size
        print(f"recording: {len(reader)} events, {len(reader.keyframes)} keyframes, {size / 2**20:.1f} MiB "
              f"({size / len(reader) * 1000 / 1024:.1f} KiB per 1k events)")
        differs = [c for c in view.mirror.caches if view.mirror.cells(0, c) != mirror.cells(0, c)]
    return [f"the replayed recording differs from the view in {differs}"] if differs else []


def check_memory(rss: list[tuple[float, float]], warm_from: float | None) -> list[str]:
    if warm_from is None:
        print("rss: the run ended before its warm-up did (the kept requests never reached their bound)")
        return []
    after = [m for t, m in rss if t >= warm_from]
    if len(after) < 2:
        return []
    low, high = min(after), max(after)
    print(f"rss after warm-up (from minute {warm_from / 60:.0f}): {low:.1f} .. {high:.1f} MiB "
          f"({100 * (high - low) / low:.1f}%)")
    return [f"resident memory moved {100 * (high - low) / low:.1f}% after warm-up"] if high > low * 1.05 else []


if __name__ == "__main__":
    sys.exit(main())
