"""One line per event, as the event logs of both front-ends print it, and which sequences and caches an
event concerns (for the logs' filters)."""
from __future__ import annotations

import signal
from dataclasses import dataclass

import numpy as np

from engine import events as ev
from engine.watch.frames import EMPTY, SHARED

SEEN_CAUSES = ("seen ", "restated")  # CellsSeen causes that are observations (engine/watch/llama_log/parser.py)
EVENT_GROUPS = ("all", "cells", "decodes", "tokens", "commands", "server", "blocks", "quirks")
SERVER_KINDS = ("ServerLogLine", "ServerTaskStarted", "ServerPromptReused", "CheckpointChanged", "ServerTaskFinished",
                "ServerSlotChanged")
GROUP_KINDS = {"cells": ("CellsChanged",), "decodes": ("DecodeStarted", "DecodeFinished", "SlotSearchFailed", "WorkloadStep"),
               "tokens": ("TokenSampled", "SequenceAssigned"),
               "commands": ("CommandDone", "SessionStatus", "ProcessExited"),
               "server": SERVER_KINDS,
               "blocks": ("KvWorkerSeen", "BlocksStored", "BlocksRemoved", "BlocksCleared", "BlockSnapshot",
                          "KvBatchesLost", "KvPublisherRestarted")}


def describe_event(event: ev.Event) -> str:
    """A short line: what happened, where, and why (QUIRKs and causes included)."""
    text = _what(event)
    if isinstance(event, ev.CellsChanged):
        if event.tentative:
            text += "  (dry run)"
        if event.cause:
            # a log's dump says when cells were seen, not what did it, unless a line before it said so
            observed = isinstance(event, ev.CellsSeen) and event.cause.startswith(SEEN_CAUSES)
            text += f"  {event.cause}" if observed else f"  by {event.cause}"
    if getattr(event, "quirk", ""):
        text += f"  ! {event.quirk}"
    return text


def _count(n: int, noun: str) -> str:
    """'1 token', '3 tokens'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


RUNS_SHOWN = 3  # runs of cells a log line names before "+N runs": scattered placements stay readable


def cell_runs(cells: np.ndarray) -> str:
    """Cells in their order as runs of neighbours: '10-15 24-25', '60-63 0-3' (a wrap-around), never one span
    over the gap between runs, which would hide that the cells are scattered."""
    cells = np.asarray(cells, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(cells) != 1) + 1
    runs = [(int(run[0]), int(run[-1])) for run in np.split(cells, breaks)]
    named = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:RUNS_SHOWN]]
    if len(runs) > RUNS_SHOWN:
        named.append("+" + _count(len(runs) - RUNS_SHOWN, "run"))
    return " ".join(named)


def _cells(event: ev.CellsChanged) -> str:
    parts = []
    for c in event.changes:
        cells = c.cells
        if len(cells) == 0:
            continue
        parts.append(f"s{c.stream} cells {cell_runs(cells)}" + (f" ({len(cells)})" if len(cells) > 2 else ""))
    return ", ".join(parts) or "no cell"


def _what(event: ev.Event) -> str:
    kind = type(event).__name__
    if isinstance(event, ev.CellsAllocated):
        return f"{kind} {event.cache} {_cells(event)}  ubatch {event.ubatch}, {_count(event.n_tokens, 'token')}"
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
        return f"{kind} {event.cache} {_cells(event)}  {_count(event.n_layers, 'layer')} re-rotated"
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
    if isinstance(event, ev.DeviceMemoryChanged):
        return f"{kind} {event.device} {event.what} {event.delta / 2**20:+.2f} MiB"
    if isinstance(event, ev.ProcessExited):
        return f"{kind} {process_exit_text(event)}"
    if isinstance(event, ev.LogStats):
        return f"{kind} {event.source}: {_count(event.lines, 'line')}, " + ", ".join(log_figures(event))
    if kind in GROUP_KINDS["blocks"] or isinstance(event, ev.KvEventStats):
        return _block_what(event, kind)
    return _server_what(event, kind)


def _tier_text(medium: str, group: int) -> str:
    """Where blocks are, said only when it is not the usual GPU memory of group 0."""
    parts = [] if medium == ev.MEDIUM_GPU else [medium]
    if group:
        parts.append(f"group {group}")
    return f" ({', '.join(parts)})" if parts else ""


def _block_what(event: ev.Event, kind: str) -> str:
    from engine.watch.kv_events.formats import hash_text

    if isinstance(event, ev.BlocksStored):
        n = len(event.block_hashes)
        first = hash_text(event.block_hashes[0]) if n else "none"
        return (f"{kind} worker {event.worker}: {_count(n, 'block')} from {first}{_tier_text(event.medium, event.group)}"
                f", child of {hash_text(event.parent_hash)}, {_count(len(event.token_ids), 'token')}")
    if isinstance(event, ev.BlocksRemoved):
        n = len(event.block_hashes)
        first = hash_text(event.block_hashes[0]) if n else "none"
        why = f"  by {event.cause}" if event.cause else ""
        return f"{kind} worker {event.worker}: {_count(n, 'block')} from {first}{_tier_text(event.medium, event.group)}{why}"
    if isinstance(event, ev.BlocksCleared):
        return f"{kind} worker {event.worker}" + (f"  by {event.cause}" if event.cause else "")
    if isinstance(event, ev.KvWorkerSeen):
        rank = f" rank {event.rank}" if event.rank >= 0 else ""
        return f"{kind} worker {event.worker}{rank} at {event.endpoint}" + (f" ({event.dialect})" if event.dialect else "")
    if isinstance(event, ev.BlockSnapshot):
        what = "evicted" if event.evicted_ts is not None else "held"
        return (f"{kind} worker {event.worker}: {_count(len(event.block_hashes), 'block')} {what}"
                f"{_tier_text(event.medium, event.group)}")
    if isinstance(event, ev.KvBatchesLost):
        how = f"{event.recovered} replayed, {event.lost} lost" + (f" ({event.reason})" if event.reason else "")
        return f"{kind} {event.endpoint}: batches {event.first}-{event.last} missed; {how}"
    if isinstance(event, ev.KvPublisherRestarted):
        return (f"{kind} {event.endpoint}: sequence numbers went back from {event.last_seq} to {event.seq}; its "
                f"blocks are cleared (epoch {event.epoch})")
    if isinstance(event, ev.KvEventStats):
        return (f"{kind} {event.endpoint}: {event.batches} batches, {event.blocks_stored} blocks stored, "
                f"{event.blocks_removed} removed, {event.lost} lost, {event.malformed} malformed")
    return kind


def _server_what(event: ev.Event, kind: str) -> str:
    if isinstance(event, ev.ServerLogLine):
        return f"{ev.SERVER_LOG_LETTERS[event.level]} {event.text}"
    if isinstance(event, ev.ServerTaskStarted):
        # a real llama-server's log may not say how the slot was chosen, nor the similarity (-1)
        similarity = f"by similarity {event.similarity:.3f}" if event.similarity >= 0 else "by prompt similarity"
        how = {"id": "by its id", "similarity": similarity, "lru": "least recently used",
               "": "(the log does not say how)"}
        return (f"{kind} slot {event.slot}: task {event.task}" + (f" ({event.label})" if event.label else "") +
                f", slot chosen {how.get(event.selected_by, event.selected_by)}, {event.n_prompt} prompt tokens")
    if isinstance(event, ev.ServerPromptReused):
        text = (f"{kind} slot {event.slot} task {event.task}: {event.n_past} of {event.n_prompt} tokens reused, "
                f"{event.n_prompt - event.n_past} to process")
        if event.forced_full:
            return text + f"  FULL RE-PROCESSING: {event.why}"
        if event.restored_n_tokens >= 0:
            return text + f"  (checkpoint of n_tokens = {event.restored_n_tokens} restored)"
        return text
    if isinstance(event, ev.CheckpointChanged):
        why = f" ({event.why})" if event.why else ""
        # a checkpoint a real llama-server's log erased without having shown it: its range and size are not known
        span = f"[{event.pos_min}, {event.pos_max}]" if event.pos_max >= 0 else "[range not in the log]"
        size = f"{event.n_bytes / 2**20:.3f} MiB" if event.n_bytes > 0 or event.pos_max >= 0 else "size not in the log"
        return (f"{kind} slot {event.slot} {event.action}{why} {span} n_tokens {event.n_tokens}, {size}; "
                f"{event.n_held} held")
    if isinstance(event, ev.ServerSlotChanged):
        return f"{kind} slot {event.slot} {event.why}: keeps {_count(event.n_kept, 'token')}"
    if isinstance(event, ev.ServerTaskFinished):
        stop = f"error: {event.error}" if event.error else event.stop
        return (f"{kind} slot {event.slot} task {event.task}: {stop}; {event.n_cached} reused, {event.n_processed} "
                f"processed, {event.n_generated} generated; the slot keeps {_count(event.n_kept, 'token')}")
    return kind


def event_seqs(event: ev.Event) -> set[int]:
    """The sequences an event names (empty when it names none): an allocation's, those it placed (and a
    log's CellsSeen, those of the cells it shows); other cell events, the one the operation was about (not
    every sequence of the cells they touched)."""
    if isinstance(event, (ev.CellsAllocated, ev.CellsSeen)):  # a log's dump: the sequences of the cells it shows
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
    slot = getattr(event, "slot", -1)  # the server's events: slot i is sequence i
    return {slot} if isinstance(slot, int) and slot >= 0 else set()


def event_group(event: ev.Event) -> str:
    """The log filter an event belongs to: cells, decodes, tokens, commands, quirks (a QUIRK event is in
    both its own group and "quirks"), or other."""
    if isinstance(event, ev.CellsChanged):
        return "cells"
    if isinstance(event, (ev.DecodeStarted, ev.DecodeFinished, ev.SlotSearchFailed, ev.WorkloadStep)):
        return "decodes"
    if isinstance(event, (ev.TokenSampled, ev.SequenceAssigned)):
        return "tokens"
    if isinstance(event, (ev.CommandDone, ev.SessionStatus, ev.ProcessExited)):
        return "commands"
    if type(event).__name__ in SERVER_KINDS:
        return "server"
    if type(event).__name__ in GROUP_KINDS["blocks"]:
        return "blocks"
    return "other"


@dataclass
class EventFilter:
    """What an event log shows: a group of kinds (EVENT_GROUPS), one sequence's events, one cache's."""

    group: str = "all"
    seq: int | None = None
    cache: str | None = None

    def __post_init__(self) -> None:
        if self.group not in EVENT_GROUPS:
            raise ValueError(f"event group {self.group!r}: the groups are {', '.join(EVENT_GROUPS)}")

    def keeps(self, event: ev.Event) -> bool:
        if isinstance(event, (ev.LogStats, ev.KvEventStats)):
            return False  # the status line's figures: a line each second would push the cache's events out
        if self.group == "quirks":
            if not getattr(event, "quirk", ""):
                return False
        elif self.group != "all" and event_group(event) != self.group:
            return False
        if self.seq is not None and self.seq not in event_seqs(event):
            return False
        return self.cache is None or getattr(event, "cache", self.cache) == self.cache

    def jump(self, replay, direction: int) -> int | None:
        """Move a Replay to the next (direction > 0) or previous event this filter keeps; its index, or
        None (and no move) when there is none."""
        jump = replay.next_of if direction > 0 else replay.previous_of
        return jump(GROUP_KINDS.get(self.group), seq_id=self.seq, cache=self.cache,
                    quirk=True if self.group == "quirks" else None)

    def describe(self) -> str:
        parts = [f"events: {self.group}"]
        if self.seq is not None:
            parts.append(f"seq {self.seq}")
        if self.cache is not None:
            parts.append(f"cache {self.cache}")
        return " · ".join(parts)


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
    return f"{created.cache} · {window} · {_count(n, 'layer')} · {types}"


def held_seqs(mirror) -> list[int]:
    """The sequences that hold at least one cell of any cache of a CacheMirror, ascending."""
    bits = np.zeros(32, dtype=np.uint8)
    for cache in mirror.caches.values():
        for stream in cache.streams:
            if len(stream.seq_bits):
                bits |= np.bitwise_or.reduce(stream.seq_bits, axis=0)
    return np.flatnonzero(np.unpackbits(bits, bitorder="little")).tolist()


def free_seq(mirror) -> int:
    """A sequence id that holds no cell, below the context's n_seq_max (the last id when all are taken):
    where a seq_cp from a front-end copies to."""
    created = next(iter(mirror.created.values()), None)
    limit = created.n_seq_max if created else 1
    used = set(held_seqs(mirror))
    return next((s for s in range(limit) if s not in used), limit - 1)


def status_parts(watcher, *, with_error: bool = False) -> list[tuple[str, str]]:
    """The status line of a Watcher as (text, tone) parts, tone one of "state", "running", "error",
    "warning", "": what runs, at which step, how full each cache is and how many shifts are pending,
    and whether the view is behind, lost events or is stale (with_error: and the last failed command).
    Each explorer styles the tones its way."""
    status = watcher.status
    state = status.state if status else "?"
    parts = [(state, "running" if state == "running" else "error" if state == "disconnected" else "state")]
    if state == "disconnected":  # a remote session: RemoteSession reconnects by itself
        parts.append((f"{status.message or 'the server is silent'}; retrying", "error"))
    # the status event comes when the state changes; the steps' own events keep the count current
    step = max(status.step if status else 0, watcher.last_step.step if watcher.last_step else 0)
    decode = watcher.history.step  # the context's decode count, which the cell histories name
    if status is None and watcher.last_step is None:
        # no workload counts steps (a context driven by hand, `kvscope record`): "step 0" would be false
        parts.append((f"decode {decode}" if decode >= 0 else "no decode yet", ""))
    else:
        parts.append((f"step {step}" + (f" (decode {decode})" if decode >= 0 else ""), ""))
    parts += _cache_parts(watcher) + _health_parts(watcher)
    if with_error and watcher.last_error is not None:
        e = watcher.last_error
        parts.append((f"last error: {e.command}: {e.error}", "error"))
    return parts


def _cache_parts(watcher) -> list[tuple[str, str]]:
    """How full each cache is, and its pending shifts."""
    parts = []
    for name, cache in watcher.mirror.caches.items():
        used = sum(int((st.pos >= 0).sum()) for st in cache.streams)
        shifts = sum(int((st.shift != 0).sum()) for st in cache.streams)
        parts.append((f"{name} {used}/{cache.size * len(cache.streams)}" + (f" ({shifts} to shift)" if shifts else ""),
                      ""))
    return parts


def _health_parts(watcher) -> list[tuple[str, str]]:
    """Whether the view is behind, lost events or is stale."""
    parts = []
    if watcher.backlog:
        parts.append((f"catching up: {watcher.backlog} events", "warning"))
    if watcher.dropped:
        parts.append((f"dropped {watcher.dropped}, resynced {watcher.resyncs}", "warning"))
    if watcher.stale:
        parts.append(("STALE", "error"))
    return parts


SPEED_WINDOW_S = 2.0  # tokens/s averages the workload steps of the last seconds


def tokens_per_second(steps, now: float) -> float:
    """Tokens sampled per second over the WorkloadStep events of the last SPEED_WINDOW_S seconds (their
    `time` is time.monotonic() of the session's process); 0 with fewer than two."""
    recent = [s for s in steps if now - s.time <= SPEED_WINDOW_S]
    if len(recent) < 2:
        return 0.0
    span = recent[-1].time - recent[0].time + recent[0].ms / 1e3
    return sum(s.n_sampled for s in recent) / span if span > 0 else 0.0


# ---- a real llama.cpp watched from its own log (engine/runners/attach.py, engine/watch/llama_log) ------------------
UNNAMED_SHARERS = "the log does not say which"
UNNAMED_SHARERS_LEAD = "shared by 2 or more of seqs"  # then the ids (the terminal explorer colours each)
READ_TWO_WAYS = "the log's map reads more than one way here"
READ_TWO_WAYS_LEAD = "held by one or more of seqs"


def open_seqs_words(code: int) -> tuple[str, str]:
    """(lead, why) of a cell whose sequences a log leaves open (engine.events.SEQS_* codes)."""
    if code == ev.SEQS_READ_TWO_WAYS:
        return READ_TWO_WAYS_LEAD, READ_TWO_WAYS
    return UNNAMED_SHARERS_LEAD, UNNAMED_SHARERS


def position_text(pos: int) -> str:
    """A held cell's position as both explorers say it: "pos 41", or "position not in the log" for a cell a
    llama.cpp log's dump shows held without a readable position (POS_UNKNOWN)."""
    return "position not in the log" if pos == ev.POS_UNKNOWN else f"pos {pos}"


def unnamed_sharers_text(seqs: list[int], code: int = ev.SEQS_SHARED_UNNAMED) -> str:
    """A cell whose sequences a log's dump leaves open (engine.events.CellsSeen's `uncertain` code), as both
    explorers say it: "shared by 2 or more of seqs 0, 1, 2 (the log does not say which)" for an 'M' cell (the
    sequences whose positions in the dump cover the cell's), "held by one or more of seqs 1, 12 (the log's
    map reads more than one way here)" where ids of several lengths split more than one way."""
    lead, why = open_seqs_words(code)
    if len(seqs) >= 2 or code == ev.SEQS_READ_TWO_WAYS:
        return f"{lead} {', '.join(map(str, seqs))} ({why})"
    return f"shared by 2 or more sequences ({why})"


def log_figures(stats: ev.LogStats) -> list[str]:
    """How the reading of a llama.cpp log goes, in words: dumps read, dumps dropped to keep up, lines not
    understood."""
    return [f"{_count(stats.dumps, 'dump')} read", f"{stats.dumps_dropped} dropped to keep up",
            f"{_count(stats.skipped, 'line')} not understood"]


def process_exit_text(event: ev.ProcessExited) -> str:
    """How a watched process ended: "llama-server exited with status 3", "llama-server was killed by signal 9
    (SIGKILL)", or, when kvscope ended it, "llama-server ended by kvscope"."""
    program = event.program or "the process"
    who = f"{program} (pid {event.pid})" if event.pid > 0 else program
    if event.ended_by_kvscope:
        return f"{who} ended by kvscope"
    if event.returncode < 0:
        return f"{who} was killed by signal {-event.returncode}{_signal_name(-event.returncode)}"
    return f"{who} exited with status {event.returncode}"


def _signal_name(number: int) -> str:
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:
        return ""


def latest(watcher, kind: type):
    """The latest of the watcher's recent events of `kind`, None when they hold none (a LogStats comes about
    once a second, and a ProcessExited just before the "exited" status: they are near the end)."""
    for event in reversed(watcher.recent):
        if isinstance(event, kind):
            return event
    return None


def attached_status_parts(watcher) -> list[tuple[str, str]]:
    """The status line of a watched llama.cpp log as (text, tone) parts, as status_parts gives a session's:
    what is watched and how it ended ("attached to llama-server (pid 4242)", "log read to its end",
    "llama-server (pid 4242) exited with status 3"), how the reading goes (log_figures, from the last
    LogStats), how full each cache is, and whether the view is behind."""
    status = watcher.status
    state = status.state if status else "attached"
    if state == "exited":
        exited = latest(watcher, ev.ProcessExited)
        failed = exited is not None and exited.returncode != 0 and not exited.ended_by_kvscope
        parts = [(process_exit_text(exited) if exited else status.message, "error" if failed else "state")]
    elif state == "finished":
        parts = [("log read to its end", "state")]
    else:
        parts = [(status.message if status and status.message else state, "running" if state == "attached"
                  else "state")]
    stats = latest(watcher, ev.LogStats)
    if stats is not None:
        read, dropped, skipped = log_figures(stats)
        parts += [(read, ""), (dropped, "warning" if stats.dumps_dropped else ""), (skipped, "")]
        if stats.behind_bytes:
            parts.append((f"{stats.behind_bytes / 2**20:.1f} MiB of log not parsed yet", "warning"))
    return parts + _cache_parts(watcher) + _health_parts(watcher)


def turn_decision(turn) -> str:
    """Why a server's cache served what it did for a turn (engine.watch.server_slots.TurnView), in a few words
    (the slots panel, ServerView's hover); what a real llama-server's log does not give (-1) is said to be
    not known rather than shown as a number."""
    if turn.outcome == "restored":
        return f"checkpoint at {turn.restored_n_tokens} restored"
    if turn.outcome == "forced":
        cache = f"cache from pos {turn.pos_min}" if turn.pos_min >= 0 else "cache from a pos not in the log"
        window = f"window needs {turn.pos_min_thold}" if turn.pos_min_thold >= 0 else "window's need not in the log"
        return f"{cache}, {window}: no checkpoint"
    return ""


def slot_keeps_text(view) -> str:
    """An idle slot (engine.watch.server_slots.SlotView) in both explorers' words: "idle, keeps 43 of 512
    tokens" (its context once a task said it)."""
    of = f" of {view.n_ctx_slot}" if view.n_ctx_slot >= 0 else ""
    return f"idle, keeps {view.n_kept}{of} tokens"


def context_shifts_text(n: int) -> str:
    """"2 context shifts": how often llama-server made room in a slot (--context-shift); "" for none."""
    return f"{n} context shift{'s' if n != 1 else ''}" if n else ""
