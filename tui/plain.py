"""The explorer without a terminal (a pipe, CI): the same views as plain text, one frame per step, for a
bounded number of steps; then it exits. Cell grids are llama.cpp's cell maps ('.' empty, the sequence id,
'M' for several), memory one row per device, and the events of each step one line each. A legend comes
first, once: a reader of `kvscope | head` sees what the marks mean before the first frame."""
from __future__ import annotations

import io
from typing import TextIO

from engine import events as ev
from engine.watch.describe import cell_map, describe_event
from engine.watch.watcher import Watcher

SHOWN_KINDS = (ev.CellsAllocated, ev.CellsRemoved, ev.CellsCopied, ev.CellsShifted, ev.KShiftApplied,
               ev.SlotSearchFailed, ev.DecodeFinished, ev.SequenceAssigned, ev.CommandDone)
CELLS_PER_ROW = 64
LEGEND = f"""\
kvscope: the KV cache as text, one frame per step (no terminal here: in one,
kvscope is an interactive explorer). What a frame shows:
  === step    the step: tokens decoded and sampled, llama_decode's return code
  lane        cache · full attention or its window · stream · used/size cells ·
              head (where the next slot search starts)
  cells       . empty   a number: the id of the one sequence holding the cell
              M several sequences (llama.cpp's cell map); {CELLS_PER_ROW} cells a row,
              the row's first cell before it
  memory      per device: weights, K/V cache, compute buffers (MiB), capacity
  events      the step's cell changes, failed slot searches, decodes, requests
              and commands, after their number; "by ...": who asked for it;
              "! ...": llama.cpp behaviour (a QUIRK) that kvscope reproduces
"""


def plain_frames(session, steps: int, out: TextIO, *, events_per_step: int = 12) -> int:
    """Step a synchronous session `steps` times, writing the legend, then a text frame after each step;
    returns steps done."""
    out.write(LEGEND)
    out.flush()
    watcher = Watcher.of(session)
    watcher.poll()
    session.start().result()
    done = 0
    for _ in range(steps):
        outcome = session.step(1).result()
        watcher.poll()
        done += 1
        _write_frame(watcher, out, events_per_step)
        if outcome and outcome[-1].phase == "idle":
            break
    return done


def _write_frame(watcher: Watcher, out: TextIO, events_per_step: int) -> None:
    step = watcher.last_step
    text = io.StringIO()
    text.write(f"=== step {step.step if step else 0}"
               f"{f': {step.n_tokens} tokens decoded, {step.n_sampled} sampled, rc {step.rc}' if step else ''}\n")
    frame = watcher.frame()
    for sf in frame.streams:
        created = watcher.mirror.created.get(sf.cache)
        window = f"window {created.n_swa}" if created and created.n_swa else "full attention"
        text.write(f"{sf.cache} · {window} · stream {sf.stream} · used {sf.used}/{sf.size} · head {sf.head}\n")
        for k, line in enumerate(cell_map(sf.owner, CELLS_PER_ROW)):
            text.write(f"  {k * CELLS_PER_ROW:5d} {line}\n")
    for row in watcher.mirror.devices.rows.values():
        cap = f" of {row.capacity / 2**20:.0f} MiB" if row.capacity else ""
        text.write(f"  {row.label:<16} weights {row.bytes['weights'] / 2**20:7.1f} MiB · K/V "
                   f"{row.bytes['kv'] / 2**20:6.2f} MiB · compute {row.bytes['compute'] / 2**20:6.1f} MiB{cap}\n")
    shown = [e for e in _this_step(watcher) if isinstance(e, SHOWN_KINDS) and not getattr(e, "tentative", False)]
    for event in shown[-events_per_step:]:
        text.write(f"  {event.seq_no:>6} {describe_event(event)}\n")
    out.write(text.getvalue())
    out.flush()


def _this_step(watcher: Watcher) -> list[ev.Event]:
    """The events since the previous WorkloadStep (this step's), from the watcher's recent events."""
    recent = list(watcher.recent)
    ends = [i for i, e in enumerate(recent) if isinstance(e, ev.WorkloadStep)]
    start = ends[-2] + 1 if len(ends) > 1 else 0
    return recent[start:]
