"""One line per event, as the event logs of both front-ends print it, and which sequences and caches an
event concerns (for the logs' filters)."""
from __future__ import annotations

import numpy as np

from engine import events as ev
from engine.watch.frames import EMPTY, SHARED


def describe_event(event: ev.Event) -> str:
    """A short line: what happened, where, and why (QUIRKs and causes included)."""
    text = _what(event)
    if isinstance(event, ev.CellsChanged):
        if event.tentative:
            text += "  (dry run)"
        if event.cause:
            text += f"  by {event.cause}"
        if event.quirk:
            text += f"  ! {event.quirk}"
    return text


def _cells(event: ev.CellsChanged) -> str:
    parts = []
    for c in event.changes:
        cells = c.cells
        if len(cells) == 0:
            continue
        span = f"{cells[0]}" if len(cells) == 1 else f"{cells.min()}-{cells.max()}"
        parts.append(f"s{c.stream} cells {span}" + (f" ({len(cells)})" if len(cells) > 2 else ""))
    return ", ".join(parts) or "no cell"


def _what(event: ev.Event) -> str:
    kind = type(event).__name__
    if isinstance(event, ev.CellsAllocated):
        return f"{kind} {event.cache} {_cells(event)}  ubatch {event.ubatch}, {event.n_tokens} tokens"
    if isinstance(event, ev.CellsRemoved):
        seq = "all seqs" if event.seq_id < 0 else f"seq {event.seq_id}"
        return f"{kind} {event.cache} {seq} [{event.p0}, {event.p1})  {event.reason}, {event.n_freed} freed"
    if isinstance(event, ev.CellsCopied):
        how = f"stream {event.src_stream} -> {event.dst_stream}, copy queued" if event.queued else "shared"
        return f"{kind} {event.cache} seq {event.src_seq} -> {event.dst_seq}  {how}"
    if isinstance(event, ev.CellsShifted):
        amount = f"{event.amount:+d}" if event.op == "add" else f"/{event.amount}"
        return f"{kind} {event.cache} seq {event.seq_id} [{event.p0}, {event.p1}) {amount}"
    if isinstance(event, ev.KShiftApplied):
        return f"{kind} {event.cache} {_cells(event)}  {event.n_layers} layers re-rotated"
    if isinstance(event, ev.CellsChanged):
        return f"{kind} {event.cache} {_cells(event)}"
    if isinstance(event, ev.DecodeStarted):
        return f"{kind} step {event.step}: {event.n_tokens} tokens of seqs {list(event.seq_ids)}"
    if isinstance(event, ev.DecodeFinished):
        rc = "ok" if event.rc == 0 else f"rc {event.rc}: {event.message.splitlines()[-1] if event.message else ''}"
        return f"{kind} {rc}, ubatches {list(event.ubatch_sizes)}, {event.ms_total:.1f} ms"
    if isinstance(event, ev.SlotSearchFailed):
        return (f"{kind} {event.cache} s{event.stream}: {event.n_tokens} tokens, used {event.used}/{event.size}, "
                f"head {event.head}")
    if isinstance(event, ev.TokenSampled):
        return f"{kind} seq {event.seq_id} pos {event.pos}: {event.piece!r}"
    if isinstance(event, ev.SequenceAssigned):
        return f"{kind} seq {event.seq_id}: {event.request} ({event.n_prompt_tokens} prompt tokens)"
    if isinstance(event, ev.CommandDone):
        return f"{kind} {event.command}({event.args})" + ("" if event.ok else f"  FAILED: {event.error}")
    if isinstance(event, ev.SessionStatus):
        return f"{kind} {event.state}, step {event.step}" + (f": {event.message}" if event.message else "")
    if isinstance(event, ev.WorkloadStep):
        return f"{kind} {event.step} {event.phase}: {event.n_tokens} tokens, {event.n_sampled} sampled, rc {event.rc}"
    if isinstance(event, ev.StreamCopyExecuted):
        return f"{kind} {event.cache} stream {event.src_stream} -> {event.dst_stream}"
    if isinstance(event, ev.EventsDropped):
        return f"{kind} {event.count} events lost: resyncing"
    return kind


def event_seqs(event: ev.Event) -> set[int]:
    """The sequences an event names (empty when it names none): an allocation's, those it placed; other
    cell events, the one the operation was about (not every sequence of the cells they touched)."""
    if isinstance(event, ev.CellsAllocated):
        rows = [c.seq_bits for c in event.changes if len(c.seq_bits)]
        if not rows:
            return set()
        placed = np.bitwise_or.reduce(np.concatenate(rows), axis=0)
        return set(np.flatnonzero(np.unpackbits(placed, bitorder="little")).tolist())
    for name in ("seq_id", "src_seq"):
        value = getattr(event, name, None)
        if isinstance(value, int) and value >= 0:
            out = {value}
            if name == "src_seq":
                out.add(event.dst_seq)
            return out
    if isinstance(event, ev.DecodeStarted):
        return set(event.seq_ids)
    return set()


def event_group(event: ev.Event) -> str:
    """The log filter an event belongs to: cells, decodes, tokens, commands, quirks (a QUIRK event is in
    both its own group and "quirks"), or other."""
    if isinstance(event, ev.CellsChanged):
        return "cells"
    if isinstance(event, (ev.DecodeStarted, ev.DecodeFinished, ev.SlotSearchFailed, ev.WorkloadStep)):
        return "decodes"
    if isinstance(event, (ev.TokenSampled, ev.SequenceAssigned)):
        return "tokens"
    if isinstance(event, (ev.CommandDone, ev.SessionStatus)):
        return "commands"
    return "other"


def cell_map(owner, per_line: int = 64) -> list[str]:
    """A stream's cells as llama.cpp's find_slot dump draws them (src/llama-kv-cache.cpp): '.' empty, the
    sequence id for one, 'M' for several; wrapped every `per_line` cells. owner: a frame's owner codes."""
    glyphs = ["." if o == EMPTY else "M" if o == SHARED else str(int(o)) for o in owner]
    return ["".join(glyphs[i:i + per_line]) for i in range(0, len(glyphs), per_line)]


def cache_title(created: ev.ContextCreated) -> str:
    """A cache as a lane's title says it: its name, window, layers and K/V types."""
    window = f"window {created.n_swa}" if created.n_swa else "full"
    n = len(created.layer_ids)
    types = created.type_k if created.type_k == created.type_v else f"{created.type_k}/{created.type_v}"
    return f"{created.cache} · {window} · {n} layer{'s' if n != 1 else ''} · {types}"
