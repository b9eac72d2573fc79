"""What a view shows of a simulated llama-server, rebuilt from its events: per slot, the task it runs and
the ones it ran (how much of each prompt its cache served, and why not more), the checkpoints it holds,
and the host memory they take. No torch: the views import it."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from engine import events as ev

SERVER_EVENTS = (ev.ServerTaskStarted, ev.ServerPromptReused, ev.CheckpointChanged, ev.ServerTaskFinished,
                 ev.ServerSlotChanged, ev.ServerContextShifted)
OUTCOMES = ("new", "kept", "restored", "forced", "error")  # of a prompt: what the slot's cache served
OUTCOME_TEXT = {"new": "nothing kept yet", "kept": "prefix reused", "restored": "checkpoint restored",
                "forced": "full re-processing forced", "error": "failed"}


def reuse_outcome(event: ev.ServerPromptReused) -> str:
    """What the server's decision on a prompt was, as one of OUTCOMES (a failed task is "error" later)."""
    if event.n_kept == 0:
        return "new"
    return "forced" if event.forced_full else "restored" if event.restored_n_tokens >= 0 else "kept"


@dataclass
class TurnView:
    """One task on a slot: its prompt, what was reused, what was processed."""

    task: int
    slot: int
    label: str
    n_prompt: int
    selected_by: str = ""
    n_kept: int = 0  # tokens the slot held when the task came
    n_common: int = 0
    n_past: int = 0
    outcome: str = ""  # one of OUTCOMES, once the server decided
    why: str = ""
    quirk: str = ""
    pos_min: int = -1  # what the cache held from, and what the window needed from, when the server looked
    pos_min_thold: int = -1
    restored_n_tokens: int = -1
    n_processed: int = 0
    n_generated: int = 0
    stop: str = ""  # "" while it runs
    context_shifts: int = 0  # times llama-server made room in the slot during this task

    @property
    def reused(self) -> int:
        return self.n_past

    @property
    def lost(self) -> int:
        """Tokens the slot held in common with the prompt that were processed again."""
        return max(0, self.n_common - self.n_past)


@dataclass
class SlotView:
    slot: int
    current: TurnView | None = None
    turns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=ServerSlots.KEPT_TURNS))
    checkpoints: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # n_tokens -> (pos_min, pos_max, bytes)
    n_kept: int = 0  # tokens the slot keeps for its next task
    n_ctx_slot: int = -1  # the slot's context, once a task said it (-1: not known)
    context_shifts: int = 0  # over all its tasks

    @property
    def state(self) -> str:
        return "processing" if self.current is not None else "idle"

    @property
    def checkpoint_bytes(self) -> int:
        return sum(b for _, _, b in self.checkpoints.values())

    @property
    def last(self) -> TurnView | None:
        return self.current or (self.turns[-1] if self.turns else None)


class ServerSlots:
    """The slots of a server simulation, from ServerTaskStarted / ServerPromptReused / CheckpointChanged /
    ServerTaskFinished events. `active` once any came (a session running another workload has none)."""

    KEPT_TURNS = 64  # finished tasks kept per slot

    def __init__(self) -> None:
        self.slots: dict[int, SlotView] = {}
        self._tasks: dict[int, TurnView] = {}

    @property
    def active(self) -> bool:
        return bool(self.slots)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(s.checkpoint_bytes for s in self.slots.values())

    def slot(self, slot: int) -> SlotView:
        view = self.slots.get(slot)
        if view is None:
            view = self.slots[slot] = SlotView(slot)
        return view

    def apply(self, event: ev.Event) -> None:
        if isinstance(event, ev.ServerTaskStarted):
            turn = TurnView(event.task, event.slot, event.label, event.n_prompt, event.selected_by)
            self._tasks[event.task] = turn
            view = self.slot(event.slot)
            view.current = turn
            if event.n_ctx_slot >= 0:
                view.n_ctx_slot = event.n_ctx_slot
        elif isinstance(event, ev.ServerContextShifted):
            view = self.slot(event.slot)
            view.context_shifts += 1
            turn = self._tasks.get(event.task)
            if turn is not None:
                turn.context_shifts += 1
        elif isinstance(event, ev.ServerPromptReused):
            turn = self._tasks.get(event.task)
            if turn is not None:
                turn.n_kept, turn.n_common, turn.n_past = event.n_kept, event.n_common, event.n_past
                turn.outcome = reuse_outcome(event)
                turn.why, turn.quirk = event.why, event.quirk
                turn.pos_min, turn.pos_min_thold = event.pos_min, event.pos_min_thold
                turn.restored_n_tokens = event.restored_n_tokens
        elif isinstance(event, ev.CheckpointChanged):
            view = self.slot(event.slot)
            if event.action == "created":
                view.checkpoints[event.n_tokens] = (event.pos_min, event.pos_max, event.n_bytes)
            elif event.action == "erased":
                view.checkpoints.pop(event.n_tokens, None)
        elif isinstance(event, ev.ServerSlotChanged):
            self.slot(event.slot).n_kept = event.n_kept
        elif isinstance(event, ev.ServerTaskFinished):
            turn = self._tasks.pop(event.task, None) or TurnView(event.task, event.slot, event.label, event.n_prompt)
            turn.n_processed, turn.n_generated, turn.stop = event.n_processed, event.n_generated, event.stop
            turn.n_past = event.n_cached
            if event.stop == "error":
                turn.outcome, turn.why = "error", event.error
            view = self.slot(event.slot)
            view.turns.append(turn)
            view.n_kept = event.n_kept
            if view.current is turn or (view.current is not None and view.current.task == event.task):
                view.current = None

    def totals(self) -> dict[str, int]:
        """Prompt tokens of the finished tasks: all, reused, processed; and the tasks of each outcome."""
        turns = [t for s in self.slots.values() for t in s.turns]
        out = {"tasks": len(turns), "prompt": sum(t.n_prompt for t in turns), "reused": sum(t.n_past for t in turns),
               "processed": sum(t.n_processed for t in turns)}
        out.update({name: sum(t.outcome == name for t in turns) for name in OUTCOMES})
        return out
