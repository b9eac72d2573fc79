"""A llama-server's slots beside the grid (kvscope's simulation, or a real one watched from its log): what each
slot runs, how much of its last prompt the cache served (reused, held but recomputed, new), the last turns'
outcomes and the checkpoints it holds."""
from __future__ import annotations

from rich.text import Text

from engine.watch import style
from engine.watch.describe import context_shifts_text, slot_keeps_text, turn_decision
from engine.watch.server_slots import ServerSlots, SlotView, TurnView
from tui.devices import mib
from tui.text_panel import TextPanel

BAR_WIDTH = 20  # at most; a narrow side column gets a shorter bar
SHOWN_TURNS = 6
SHOWN_CHECKPOINTS = 4


class SlotsPanel(TextPanel):
    DEFAULT_CSS = """
    SlotsPanel { height: auto; max-height: 16; border: round $primary-darken-2; padding: 0 1; display: none; }
    """

    _drawn_from: tuple[ServerSlots, bool] | None = None

    def on_resize(self) -> None:
        super().on_resize()
        if self._drawn_from is not None:  # the bars and marks fit the width: draw them for the new one
            self.show_slots(*self._drawn_from)

    def show_slots(self, server: ServerSlots, dark: bool) -> None:
        self._drawn_from = (server, dark)
        self.display = server.active
        if not server.active:
            return
        self.border_title = "server slots"
        text = Text()
        bar = max(6, min(BAR_WIDTH, self.content_region.width - 22))
        for n, view in enumerate(sorted(server.slots.values(), key=lambda v: v.slot)):
            if n:
                text.append("\n")
            _slot_lines(text, view, dark, bar)
        totals = server.totals()
        if totals["tasks"]:
            share = 100 * totals["processed"] / max(1, totals["prompt"])
            text.append(f"\n{totals['tasks']} turns: {totals['processed']} of {totals['prompt']} prompt tokens "
                        f"processed ({share:.0f}%) · {totals['forced']} forced · {totals['restored']} restored",
                        style="dim")
        self.show(text)


def _slot_lines(text: Text, view: SlotView, dark: bool, bar: int) -> None:
    color = style.seq_color(view.slot, dark)
    text.append(f"slot {view.slot}", style=f"bold {color}")
    turn = view.last
    if view.current is not None:
        text.append(f" · {view.current.label or f'task {view.current.task}'}", style=color)
    else:
        text.append(f" · {slot_keeps_text(view)}", style="dim")
    if view.context_shifts:
        text.append(f" · {context_shifts_text(view.context_shifts)}", style=style.OUTCOME_COLORS["forced"])
    if turn is not None and turn.outcome:
        text.append("\n ")
        _bar(text, turn, bar)
        text.append(f" {turn.n_past} reused", style=style.PROMPT_PART_COLORS["reused"])
        if turn.lost:
            text.append(f" {turn.lost} lost", style=style.PROMPT_PART_COLORS["lost"])
        decision = turn_decision(turn)
        if decision:
            text.append(f"\n {decision}", style=style.OUTCOME_COLORS[turn.outcome])
    if view.turns:
        text.append("\n ")
        shown, room = [], bar + 20
        for t in reversed(list(view.turns)[-SHOWN_TURNS:]):  # the latest that fit on the line
            room -= len(_turn_mark(t)) + bool(t.quirk)
            if room < 0:
                break
            shown.append(t)
        for t in reversed(shown):
            text.append(_turn_mark(t), style=style.OUTCOME_COLORS.get(t.outcome, ""))
            if t.quirk:
                text.append(style.GLYPH_QUIRK, style=style.QUIRK_COLOR)
    if view.checkpoints:
        head = f"\n checkpoints {len(view.checkpoints)} · {_size(view.checkpoint_bytes)} "
        marks, room = [], bar + 22 - len(head)
        for n in sorted(view.checkpoints, reverse=True)[:SHOWN_CHECKPOINTS]:  # the latest that fit
            room -= len(str(n)) + 2
            if room < 0:
                break
            marks.insert(0, f"▏{n}")
        text.append(head + " ".join(marks), style="dim")


def _bar(text: Text, turn: TurnView, width: int) -> None:
    """The prompt as a bar: served by the cache, held but recomputed, new."""
    n = max(turn.n_prompt, 1)
    reused = round(width * turn.n_past / n)
    lost = min(width - reused, round(width * turn.lost / n))
    text.append("█" * reused, style=style.PROMPT_PART_COLORS["reused"])
    text.append("▓" * lost, style=style.PROMPT_PART_COLORS["lost"])
    text.append("░" * (width - reused - lost), style=style.PROMPT_PART_COLORS["new"])


def _turn_mark(turn: TurnView) -> str:
    """A finished turn in the slot's row of turns: its task, as the server's log names it, and its outcome."""
    return f"▏{turn.task} {turn.outcome}"


def _size(n: int) -> str:
    """Host memory of checkpoints: a small model's take KiB, which "0.0 MiB" would show as nothing."""
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else mib(n)
