"""llama-server's slot lines (tools/server/server-context.cpp), turned into the events kvscope's own server
simulation publishes (engine/runners/server/), so that the same views show a real server's slots.

`slot <func>: id <slot> | task <task> | <text>` and `srv  <func>: <text>`. The log says which slot a task
took and how (by id, by prompt similarity, the least recently used), how long its prompt is, how many tokens
the slot's cache served (`cached n_tokens = N, memory_seq_rm [N, end)`, the first such line of a task),
whether it forced a full re-processing, which checkpoints it created, restored and erased, and how it
ended. What the log does not say stays at its "not known" value (-1, or "").
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from engine import events as ev

MIB = 1 << 20
SLOT_LINE = re.compile(r"slot +(\S.{0,11}?): id +(\d+) \| task (-?\d+) \| ?(.*)$")
SRV_LINE = re.compile(r"srv +(\S.{0,11}?): (.*)$")
SELECTED = re.compile(r"selected slot by (id|LCP similarity|LRU)(?:.*?f_sim_best = ([\d.]+))?")
CHECKING_SIM = re.compile(r" - checking sim = ([\d.]+) \((\d+)/(\d+)\)")
NEW_PROMPT = re.compile(r"new prompt, n_ctx_slot = (\d+), n_keep = (-?\d+), task\.n_tokens = (\d+)")
CACHED = re.compile(r"cached n_tokens = (\d+), memory_seq_rm \[(\d+), end\)")
CHECKING_CHECKPOINT = re.compile(r"checking checkpoint with \[(-?\d+), (-?\d+)\] against (-?\d+)")
CHECKPOINT = re.compile(r"(created context checkpoint (\d+) of \d+|restored context checkpoint|erased invalidated context "
                        r"checkpoint|erasing old context checkpoint|erasing context checkpoint too close to an earlier one)"
                        r" \(pos_min = (-?\d+), pos_max = (-?\d+), n_tokens = (\d+).*?size = ([\d.]+) MiB")
SUPERSEDED = re.compile(r"superseding context checkpoint at n_tokens = (\d+)")
N_PAST_SET = re.compile(r"n_past was set to (\d+)")
TIMING = re.compile(r"(prompt eval|eval) time = +[\d.]+ ms / +(\d+) tokens")
STOP = re.compile(r"stop processing: n_tokens = (\d+), truncated = (\d+)")
CONTEXT_SHIFT = re.compile(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)")
CLEARING = re.compile(r"clearing prompt with (\d+) tokens")
SEND_ERROR = re.compile(r"task id = -?\d+, error: (.*)$")
STOPPED = (("stopped by EOS", "eos"), ("stopped by limit", "limit"), ("stopped by time limit", "limit"),
           ("stopped by indentation limit", "limit"), ("stopped due to running out of context", "context"))
FORCED = "forcing full prompt re-processing"
PROMPT_CACHE_STATE = re.compile(r" - cache state: (\d+) prompts?, ([\d.]+) MiB")
QUIET_SERVER_FUNCS = ("update_slots", "decode", "process_sing", "stop")  # srv debug lines of every batch


@dataclass
class TaskFacts:
    slot: int
    task: int
    n_prompt: int = 0
    n_kept: int = 0
    n_common: int = -1
    n_past: int = -1
    forced: bool = False
    pos_min_thold: int = -1
    restored: int = -1
    decided: bool = False
    n_processed: int = 0
    n_generated: int = 0
    stop: str = ""
    error: str = ""


@dataclass
class SlotFacts:
    n_kept: int = 0
    selected_by: str = ""
    similarity: float = -1.0
    lcp: int = -1
    checkpoints: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # n_tokens -> (pos_min, pos_max, bytes)


@dataclass(frozen=True)
class Removal:
    """What a line says happened to a sequence's cells at positions [p0, p1) (-1: from the start / to the
    end), for the cause of the changes the next dump shows: kind "removed" (seq -1: every sequence),
    "moved" (a seq_add or seq_div: positions changed), "kept" (a seq_keep: every sequence but `keep` left)."""

    seq: int
    p0: int
    p1: int
    cause: str
    kind: str = "removed"
    keep: int = -1

    def cells(self, old, new) -> np.ndarray:
        """Of a stream's cells before (old) and after (new), those this operation explains."""
        lo = max(self.p0, 0)
        hi = self.p1 if self.p1 >= 0 else np.iinfo(np.int64).max
        in_range = (old.pos >= lo) & (old.pos < hi) & (old.pos != -1)
        if self.kind == "moved":
            return in_range & _holds(old.seq_bits, self.seq) & (new.pos != old.pos) & (new.pos != -1)
        if self.kind == "kept":
            kept = _holds(old.seq_bits, self.keep)
            return (old.pos != -1) & ~kept & (new.pos == -1)
        if self.seq < 0:
            return in_range & (new.pos == -1)
        return in_range & _holds(old.seq_bits, self.seq) & ~_holds(new.seq_bits, self.seq)


def _holds(bits: np.ndarray, seq: int) -> np.ndarray:
    return ((bits[:, seq >> 3] >> (seq & 7)) & 1).astype(bool)


class ServerLines:
    """Reads slot and srv lines; `line()` answers (events, removals) for one of them, None for another line."""

    def __init__(self) -> None:
        self.slots: dict[int, SlotFacts] = {}
        self.tasks: dict[int, TaskFacts] = {}  # running, by slot
        self.prompt_cache_bytes = 0  # llama-server's cache of saved prompts (--cache-ram), host memory

    @property
    def checkpoint_bytes(self) -> int:
        return sum(b for facts in self.slots.values() for _, _, b in facts.checkpoints.values())

    def slot(self, slot: int) -> SlotFacts:
        facts = self.slots.get(slot)
        if facts is None:
            facts = self.slots[slot] = SlotFacts()
        return facts

    def line(self, text: str, level: str) -> tuple[list[ev.Event], list[Removal]] | None:
        if text.startswith("slot "):
            m = SLOT_LINE.match(text)
            if m is None:
                return None
            slot, task, body = int(m.group(2)), int(m.group(3)), m.group(4)
            events: list[ev.Event] = [ev.ServerLogLine(level=level or "info", text=text, slot=slot, task=task)]
            removals: list[Removal] = []
            self._slot_line(slot, task, body, events, removals)
            return events, removals
        if text.startswith("srv "):
            m = SRV_LINE.match(text)
            if m is None:
                return None
            state = PROMPT_CACHE_STATE.search(m.group(2))
            if state:
                self.prompt_cache_bytes = round(float(state.group(2)) * MIB)
            if level == "debug" and m.group(1).strip() in QUIET_SERVER_FUNCS:
                return [], []
            return [ev.ServerLogLine(level=level or "info", text=text)], []
        return None

    def _slot_line(self, slot: int, task: int, body: str, events: list, removals: list) -> None:
        facts = self.slot(slot)
        m = SELECTED.search(body)
        if m:
            facts.selected_by = {"id": "id", "LCP similarity": "similarity", "LRU": "lru"}[m.group(1)]
            facts.similarity = float(m.group(2)) if m.group(2) else facts.similarity
            return
        m = CHECKING_SIM.search(body)
        if m:
            facts.similarity, facts.lcp = float(m.group(1)), int(m.group(2))
            return
        m = NEW_PROMPT.search(body)
        if m:
            run = self.tasks[slot] = TaskFacts(slot, task, n_prompt=int(m.group(3)), n_kept=facts.n_kept)
            events.append(ev.SequenceAssigned(slot, f"slot {slot}, task {task}", "", run.n_prompt))
            events.append(ev.ServerTaskStarted(slot=slot, task=task, selected_by=facts.selected_by,
                                               similarity=facts.similarity, n_prompt=run.n_prompt,
                                               n_ctx_slot=int(m.group(1))))
            run.n_common = facts.lcp
            facts.selected_by, facts.similarity, facts.lcp = "", -1.0, -1
            return
        run = self.tasks.get(slot)
        m = CACHED.search(body)
        if m:
            p0 = int(m.group(2))
            removals.append(Removal(slot, p0, -1, f"memory_seq_rm [{p0}, end) of slot {slot}, task {task}"))
            if run is not None and not run.decided:
                run.decided, run.n_past = True, int(m.group(1))
                n_common = run.n_common if run.n_common >= 0 else run.n_past
                events.append(ev.ServerPromptReused(
                    slot=slot, task=task, n_prompt=run.n_prompt, n_kept=run.n_kept, n_common=max(n_common, run.n_past),
                    n_past=run.n_past, forced_full=run.forced,
                    why="llama-server: forcing full prompt re-processing due to lack of cache data" if run.forced else "",
                    pos_min_thold=run.pos_min_thold, restored_n_tokens=run.restored))
            return
        m = CHECKPOINT.search(body)
        if m:
            self._checkpoint(slot, task, m, events)
            if run is not None and m.group(1).startswith("restored"):
                run.restored = int(m.group(5))
            return
        m = SUPERSEDED.search(body)
        if m:
            n_tokens = int(m.group(1))
            lo, hi, nbytes = facts.checkpoints.pop(n_tokens, (-1, -1, 0))
            events.append(ev.CheckpointChanged(slot=slot, task=task, action="erased", pos_min=lo, pos_max=hi,
                                               n_tokens=n_tokens, n_bytes=nbytes, why="superseded",
                                               n_held=len(facts.checkpoints)))
            return
        m = CHECKING_CHECKPOINT.search(body)
        if m:
            if run is not None:
                run.pos_min_thold = int(m.group(3))
            return
        if FORCED in body:
            if run is not None:
                run.forced = True
            return
        m = N_PAST_SET.search(body)
        if m:
            if run is not None:
                run.n_past = int(m.group(1))
            return
        m = TIMING.search(body)
        if m:
            if run is not None:
                if m.group(1) == "prompt eval":
                    run.n_processed = int(m.group(2))
                else:
                    run.n_generated = int(m.group(2))
            return
        for words, stop in STOPPED:
            if body.startswith(words):
                if run is not None:
                    run.stop = stop
                return
        m = SEND_ERROR.search(body)
        if m:
            if run is not None:
                run.stop, run.error = "error", m.group(1)
            return
        m = STOP.search(body)
        if m:
            facts.n_kept = int(m.group(1))
            run = self.tasks.pop(slot, None) or TaskFacts(slot, task)
            events.append(ev.ServerTaskFinished(
                slot=slot, task=task, n_prompt=run.n_prompt, n_cached=max(run.n_past, 0), n_processed=run.n_processed,
                n_generated=run.n_generated, stop=run.stop or ("limit" if int(m.group(2)) else ""), text="",
                n_kept=facts.n_kept, error=run.error))
            return
        m = CONTEXT_SHIFT.search(body)
        if m:
            n_keep, n_discard = int(m.group(1)), int(m.group(3))
            events.append(ev.ServerContextShifted(slot=slot, task=task, n_keep=n_keep, n_left=int(m.group(2)),
                                                  n_discard=n_discard))
            cause = f"context shift of slot {slot}, task {task}: n_keep = {n_keep}, n_discard = {n_discard}"
            removals.append(Removal(slot, n_keep, n_keep + n_discard, cause))
            removals.append(Removal(slot, n_keep + n_discard, -1, cause, kind="moved"))
            return
        m = CLEARING.search(body)
        if m:
            facts.n_kept = 0
            removals.append(Removal(slot, -1, -1, f"slot {slot} cleared its prompt"))
            events.append(ev.ServerSlotChanged(slot=slot, n_kept=0, why="cleared"))

    def _checkpoint(self, slot: int, task: int, m: re.Match, events: list) -> None:
        facts = self.slot(slot)
        what = m.group(1)
        lo, hi, n_tokens = int(m.group(3)), int(m.group(4)), int(m.group(5))
        nbytes = round(float(m.group(6)) * MIB)
        if what.startswith("created"):
            facts.checkpoints[n_tokens] = (lo, hi, nbytes)
            action, why = "created", ""
        elif what.startswith("restored"):
            action, why = "restored", ""
        else:
            facts.checkpoints.pop(n_tokens, None)
            action = "erased"
            why = "invalidated" if "invalidated" in what else "old" if "old" in what else "too close"
        events.append(ev.CheckpointChanged(slot=slot, task=task, action=action, pos_min=lo, pos_max=hi, n_tokens=n_tokens,
                                           n_bytes=nbytes, why=why, n_held=len(facts.checkpoints)))

    def state_events(self) -> list[ev.Event]:
        """The checkpoints each slot holds, as 'created' events (a watcher that joins late)."""
        out: list[ev.Event] = []
        for slot, facts in sorted(self.slots.items()):
            for n_tokens, (lo, hi, nbytes) in sorted(facts.checkpoints.items()):
                out.append(ev.CheckpointChanged(slot=slot, task=-1, action="created", pos_min=lo, pos_max=hi,
                                                n_tokens=n_tokens, n_bytes=nbytes, n_held=len(facts.checkpoints)))
            if facts.n_kept:
                out.append(ev.ServerSlotChanged(slot=slot, n_kept=facts.n_kept, why="as the log showed it"))
        return out
