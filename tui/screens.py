"""Screens over the main view: help (what every glyph and colour means), a prompt, and the settings that
rebuild the context, with the memory they would take shown before they are applied."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from engine.watch import style
from engine.watch.settings_form import SETTINGS, estimate_lines, parse_settings, shown

HELP = """\
[b]kvscope[/b] shows a KV cache the way llama.cpp keeps it: each cache stream is a lane of cells.

[b]Cells[/b]
  {empty}  empty          {one}  one sequence (its colour)      {shared}  several sequences
  [u b]{one}[/u b]  changed since the last frame                  ?  touched by a dry run (slot search)
  [{quirk}]![/]  touched by an event that reproduces a llama.cpp QUIRK (the log's ! line says which)
  »/«  a pending shift (applied to the keys at the next decode: the K-shift)
  [on {head}] [/]  the head: where the next slot search starts
  ╳  the selected sequence's cell that its next token does not see (outside the sliding window)
  dim  another sequence's cell, not seen by the selected one
  red background: attention of the selected sequence's last token (when the session publishes it)
  When a lane is wider than the screen, a glyph covers several cells: {shades} from empty to full.

[b]Sequences[/b] keep one colour everywhere: {colours}
On a light theme (ctrl+p, "theme") the same hues come darker, to stand out as well.

[b]Lanes[/b]  kv: the cache of a full-attention model. base / swa: the two caches of a sliding-window
model (full-attention layers / sliding layers). With split streams (-np without -kvu) every sequence has
a stream of its own.

[b]QUIRKs[/b]  llama.cpp behaviour that looks unintended is reproduced, and its events say so (a ! in the
log): the dry run's SWA purge, the heads after a failed dry run, seq_div's shift sign, the server's
needless checkpoint search.

[b]Server slots[/b] (--workload server: llama-server's slots, slot i on sequence i) each slot's last prompt
as a bar: [{reused}]█[/] served by the cache  [{lost}]▓[/] held but processed again  [{fresh}]░[/] new; its last turns:
[{kept}]kept[/] prefix reused · [{restored}]restored[/] a checkpoint · [{forced}]forced[/] full re-processing · new (nothing kept);
the checkpoints it holds (their token counts) and their host memory (a part of the CPU bar). The log's
"server" filter (f) shows the server's own lines.

[b]Keys[/b]  space start/pause · n one step · p prompt · arrows / mouse: cell · [ ] lane · tab: next
sequence · w window overlay · a attention overlay · + - zoom · x rm · k keep · y copy · s shift the sequence
(context shift) · ctrl+p commands · o settings · r record · f g c log filters · ? help · q quit
[b]Replay[/b] (kvscope tui --replay FILE)  , . one event back / forward · < > a hundred · 0-9 home end: jump
to a tenth of the way · j J: next / previous event of the log's filter (f g c) · space: play / pause
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 100; max-width: 95%; height: auto; max-height: 90%;
                                  border: round $accent; background: $surface; padding: 1 2; }
    """

    def compose(self) -> ComposeResult:
        colours = " ".join(f"[{c}]{style.GLYPH_ONE}{i}[/]"
                           for i, c in enumerate(style.palette(self.app.current_theme.dark)))
        part, outcome = style.PROMPT_PART_COLORS, style.OUTCOME_COLORS
        text = HELP.format(reused=part["reused"], lost=part["lost"], fresh=part["new"], kept=outcome["kept"],
                           restored=outcome["restored"], forced=outcome["forced"], empty=style.GLYPH_EMPTY, one=style.GLYPH_ONE, shared=style.GLYPH_SHARED,
                           head=style.HEAD_COLOR, quirk=style.QUIRK_COLOR, shades="".join(style.OCCUPANCY_GLYPHS[1:]), colours=colours)
        with VerticalScroll():
            yield Static(text)


class PromptScreen(ModalScreen[str | None]):
    """A prompt for a new sequence (or a new request of the parallel workload)."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    PromptScreen { align: center middle; }
    PromptScreen > Vertical { width: 80; max-width: 95%; height: auto; border: round $accent;
                              background: $surface; padding: 1 2; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("A prompt for a new sequence (enter: add, escape: cancel)")
            yield Input(placeholder="And God said unto Moses", id="prompt")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class SettingsScreen(ModalScreen[dict | None]):
    """Context settings. Estimate shows what each device would hold; Apply rebuilds the context."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > Vertical { width: 100; max-width: 98%; height: auto; max-height: 95%; border: round $accent;
                                background: $surface; padding: 0 1; }
    SettingsScreen Grid { grid-size: 3; grid-columns: 14 22 1fr; grid-rows: 3; height: auto; }
    SettingsScreen Label { padding: 1 0; }
    #estimate { height: auto; min-height: 3; padding: 0 1; }
    """

    def __init__(self, current: dict, estimate, apply) -> None:
        """current: the context's settings; estimate(**settings) -> object with to_dict(); apply: called
        with the parsed settings when the user applies them."""
        super().__init__()
        self.current, self._estimate, self._apply = current, estimate, apply

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Context settings (enter or Estimate: memory per device; Apply: rebuild, the cache "
                        "starts empty)")
            with Grid():
                for name, _, what in SETTINGS:
                    yield Label(name)
                    yield Input(value=shown(self.current.get(name)), id=f"set-{name}")
                    yield Label(what)
            yield Static("", id="estimate")
            with Horizontal():
                yield Button("Estimate", id="estimate-button")
                yield Button("Apply", id="apply", variant="primary")
                yield Button("Cancel", id="cancel")

    def parsed(self) -> dict:
        """The fields as settings; a field that does not parse raises ValueError naming it."""
        return parse_settings({name: self.query_one(f"#set-{name}", Input).value for name, _, _ in SETTINGS})

    def show_estimate(self) -> bool:
        box = self.query_one("#estimate", Static)
        try:
            settings = self.parsed()
            result = self._estimate(**settings)
        except Exception as e:  # noqa: BLE001 - any bad value is told here, never a crash
            box.update(Text(f"cannot use these settings: {e}", style="bold red"))
            return False
        fits, lines = estimate_lines(result)
        box.update("\n".join(lines))
        return fits

    def on_input_submitted(self) -> None:
        self.show_estimate()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
        elif event.button.id == "estimate-button":
            self.show_estimate()
        elif self.show_estimate():
            self.dismiss(self.parsed())

    def action_cancel(self) -> None:
        self.dismiss(None)
