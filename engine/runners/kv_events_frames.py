"""`kvscope attach --vllm` without a terminal (a pipe, CI): vLLM / SGLang workers' prefix caches as text frames, at
most one per `every_s` while they change and one at the end, like engine/runners/attach_frames.py does for a
llama.cpp log. A frame says, per publisher, what was read and lost, and per worker and tier (medium and KV cache
group) how many blocks it holds and how many it stored and evicted since the frame before."""
from __future__ import annotations

import io
from typing import Callable, TextIO

from engine import events as ev
from engine.runners.attach_frames import frame_loop, write_events
from engine.watch.watcher import Watcher

SHOWN_KINDS = (ev.KvBatchesLost, ev.KvPublisherRestarted, ev.BlocksCleared, ev.KvWorkerSeen)
LEGEND = """\
kvscope attach --vllm: vLLM / SGLang workers' prefix caches from their KV events, as text (no
terminal here: in one, kvscope attach opens the explorer). What a frame shows:
  === time    seconds since kvscope attached · the status
  publisher   its endpoint · batches read · blocks it stored and removed · messages
              that were not batches · batches missed (of them replayed) · its restarts
  worker      its label (the publisher's data-parallel rank where it says it) · wire
              layout · blocks stored and evicted since the frame before
    tier      medium and KV cache group: blocks held (of the worker's capacity, where
              given)
  events      gaps, restarts, clears and new workers since the frame before
"""


def print_block_frames(watcher: Watcher, out: TextIO, *, every_s: float, done: Callable[[], bool],
                       events_per_frame: int = 12) -> int:
    """Write the legend, then a frame whenever the blocks changed and `every_s` went by, until done() is true;
    then a last frame of what came since. Returns the frames written."""
    counts_before: dict[int, tuple[int, int]] = {}

    def write(new: list[ev.Event], seconds: float) -> None:
        write_block_frame(watcher, out, new, seconds=seconds, counts_before=counts_before,
                          events_per_frame=events_per_frame)

    return frame_loop(watcher, out, LEGEND, write, every_s=every_s, done=done)


def write_block_frame(watcher: Watcher, out: TextIO, new: list[ev.Event], *, seconds: float,
                      counts_before: dict[int, tuple[int, int]], events_per_frame: int = 12) -> None:
    """One frame. counts_before: each worker's (stored, evicted) at the frame before, updated here."""
    blocks = watcher.mirror.blocks
    text = io.StringIO()
    status = watcher.status
    text.write(f"=== {seconds:.1f} s · " + (f"{status.state}: {status.message}" if status else "?") + "\n")
    for endpoint, state in sorted(blocks.endpoints.items()):
        s = state.stats
        read = "no batch yet" if s is None else (
            f"{s.batches} batches · {s.blocks_stored} blocks stored, {s.blocks_removed} removed · "
            f"{s.malformed} malformed")
        text.write(f"{endpoint} · {read} · {state.lost + state.recovered} batches missed ({state.recovered} replayed) · "
                   f"{state.restarts} restarts\n")
    for worker in blocks.workers():
        seen = blocks.seen.get(worker)
        layout = f" · {seen.dialect}" if seen is not None and seen.dialect else ""
        counts = blocks.counts[worker]
        stored_before, evicted_before = counts_before.get(worker, (0, 0))
        counts_before[worker] = (counts.stored, counts.evicted)
        text.write(f"{blocks.label(worker)}{layout} · +{counts.stored - stored_before} stored, "
                   f"-{counts.evicted - evicted_before} evicted since the frame before\n")
        capacity = f" of {seen.capacity_blocks}" if seen is not None and seen.capacity_blocks else ""
        tiers = blocks.tiers(worker)
        if not tiers:
            text.write("  no blocks held\n")
        for medium, group in tiers:
            kind, window = blocks.group_kind(worker, group)
            about = ", ".join(part for part in (kind, f"window {window}" if window else "") if part)
            text.write(f"  {medium} group {group}{f' ({about})' if about else ''}: "
                       f"{blocks.held(worker, medium, group)} blocks held{capacity}\n")
    write_events(text, [e for e in new if isinstance(e, SHOWN_KINDS)], events_per_frame)
    out.write(text.getvalue())
    out.flush()
