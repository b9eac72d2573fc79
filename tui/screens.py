"""Screens over the main view: help (what every glyph and colour means), a prompt, and the settings that
rebuild the context, with the memory they would take shown before they are applied."""
from __future__ import annotations

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from engine.watch import style
from engine.watch.settings_form import SETTINGS, estimate_lines, parse_settings, shown
from tui.grid import ATTENTION_GLYPH, HEAT_LEVELS, heat_color

ROW_INDENT = 2  # a row of a help table starts here; its meaning, when it wraps, goes on under itself
TERM_GAP = 2
BLANK = Text("")


def orphanless_lines(text: Text, width: int, console: Console) -> list[Text]:
    """The text wrapped to `width` as a greedy wrap does, unless that leaves one word alone on the last line
    (an orphan): then at the widest narrower width that takes no more lines and gives the last line a word
    more."""
    lines = list(text.wrap(console, width))
    if len(lines) < 2 or len(lines[-1].plain.split()) > 1:
        return lines
    for narrower in range(width - 1, width // 2, -1):
        tried = list(text.wrap(console, narrower))
        if len(tried) > len(lines):
            break
        if len(tried[-1].plain.split()) > 1:
            return tried
    return lines


class Paragraph:
    """Prose that the dialog wraps to its width (it has no line breaks of its own), without an orphan."""

    def __init__(self, text: Text) -> None:
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from orphanless_lines(self.text, options.max_width, console)


class Rows:
    """Terms and their meanings: a column of terms, each meaning wrapped under itself beside it (without an
    orphan), so that however wide the dialog is, no line of a meaning starts under its term."""

    def __init__(self, rows: list[tuple[Text | str, str]]) -> None:
        self.rows = [(Text(term) if isinstance(term, str) else term, Text(meaning)) for term, meaning in rows]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        term_width = max(term.cell_len for term, _ in self.rows)
        hang = ROW_INDENT + term_width + TERM_GAP
        for term, meaning in self.rows:
            for k, line in enumerate(orphanless_lines(meaning, max(options.max_width - hang, 8), console)):
                start = Text(" " * ROW_INDENT) + term + " " * (term_width - term.cell_len + TERM_GAP) if k == 0 \
                    else Text(" " * hang)
                yield start + line


def _heading(title: str, after: str = "") -> Paragraph:
    text = Text()
    text.append(title, style="bold")  # the title alone: a Text's own style would embolden what follows too
    if after:
        text.append(f" {after}")
    return Paragraph(text)


def help_text(dark: bool, replay: bool, attached: bool = False) -> Group:
    """What every glyph, colour and key means, as paragraphs and tables that the dialog wraps to its width.
    The cells first (what the screen shows), then the keys: a replay's first when a recording is shown; only
    those that move the view when a llama.cpp process is watched (attached), which takes no command."""
    colours = Text()
    colours.append("Sequences", style="bold")
    colours.append(' keep one colour everywhere (on a light theme, ctrl+p "theme", the same hues come darker, '
                   'to stand out as well):')
    for i, colour in enumerate(style.palette(dark)):
        colours.append(" ")
        colours.append(f"{style.GLYPH_ONE}{i}", style=colour)
    empty = style.EMPTY_COLOR if dark else style.EMPTY_COLOR_ON_LIGHT
    one = style.seq_color(0, dark)
    cells = Rows([
        (Text(style.GLYPH_EMPTY, style=empty), "empty"),
        (Text(style.GLYPH_ONE, style=one), "one sequence (its colour)"),
        (Text(style.GLYPH_SHARED), "several sequences (the inspector says which)"),
        (Text(style.GLYPH_SHARED_UNNAMED), ("several sequences that a llama.cpp log does not name (an 'M' of its "
                                           "dump: the inspector lists those that may hold the cell)")),
        (Text(style.GLYPH_ONE, style=f"bold underline {one}"), "changed since the last frame (bold, underlined)"),
        (style.GLYPH_TENTATIVE, "touched by a dry run (a slot search that is undone)"),
        (Text(style.GLYPH_QUIRK, style=style.QUIRK_COLOR),
         "touched by an event that reproduces a llama.cpp QUIRK (the log's ! line says which)"),
        ("» «", "a pending shift, applied to the keys at the next decode (the K-shift)"),
        (Text(style.GLYPH_EMPTY, style=f"{empty} on {style.HEAD_COLOR}"),
         "the head, on a violet background: where the next slot search starts"),
        ("╳", "a cell of the selected sequence that its next token does not see (outside the sliding window)"),
        (Text(style.GLYPH_ONE, style=f"dim {style.seq_color(1, dark)}"),
         "dimmed: another sequence's cell, not seen by the selected one"),
        (Text(ATTENTION_GLYPH, style=f"{one} on {heat_color(HEAT_LEVELS - 1)}"),
         ("attention (a): the selected sequence's cells on a red background, darker to brighter by the weight "
          "its last token gave them (when the session publishes it: kvscope tui --attention)")),
        ("".join(style.OCCUPANCY_GLYPHS[1:]), ("a glyph that covers several cells (a lane wider than the screen, "
                                              "or zoomed out): from a few used to all")),
    ])
    session_keys = Rows([
        ("space", "start / pause the session"),
        ("n", "one step"),
        ("p", "a prompt: a new sequence (or a request of the parallel workload)"),
        ("arrows, mouse", "the cell under the cursor, explained beside the grid"),
        ("[ ]", "the lane before / after"),
        ("tab shift+tab", "the next / previous sequence: its window and attention are shown"),
        ("w a", "the window overlay, the attention overlay: on / off"),
        ("m", "the last ubatch's attention mask: its tokens x the cells, as the kernel masks them"),
        ("+ -", "zoom in / out"),
        ("x k y s", "the selected sequence: remove it, keep only it, copy it, shift it (a context shift)"),
        ("o", "settings: rebuild the context, with the memory it would take shown first"),
        ("ctrl+p", "every command (sequence operations, state save and load, clear, record)"),
        ("r", "record the session to a .kvtrace file (r again to stop)"),
        ("f g c", "the log's filters: kind of event, the selected sequence, the cache under the cursor"),
        ("? q", "this help, quit"),
    ])
    replay_keys = Rows([
        ("space", "play / pause (from the start when at the end)"),
        (", .", "one event back / forward"),
        ("< >", "a hundred events back / forward"),
        ("home end 0-9", "the start, the end, a tenth of the way"),
        ("j J", "the next / previous event of the kinds the log shows (f g c)"),
        ("tab, arrows", "the selected sequence and the cursor, as in a session"),
        ("m", "the attention mask of the last ubatch replayed so far"),
    ])
    attached_keys = Rows([
        ("arrows, mouse", "the cell under the cursor, explained beside the grid"),
        ("[ ]", "the lane before / after"),
        ("tab shift+tab", "the next / previous sequence: its window is shown"),
        ("w", "the window overlay: on / off"),
        ("+ -", "zoom in / out"),
        ("f g c", "the log's filters: kind of event, the selected sequence, the cache under the cursor"),
        ("? q", "this help, quit"),
    ])
    keys = [_heading("Keys of a replay", "(kvscope tui --replay FILE)"), replay_keys, BLANK,
            _heading("Keys of a session"), session_keys]
    if attached:
        keys = [_heading("Keys of a watched llama.cpp", (
            "(kvscope attach): kvscope only watches it. The cells are what its own log shows (its slot-search "
            "dumps); nothing is sent to the process, which is never stepped, paused, prompted or changed from "
            "here.")), attached_keys]
    elif not replay:
        keys = keys[3:] + [BLANK] + keys[:2]
    part, outcome = style.PROMPT_PART_COLORS, style.OUTCOME_COLORS
    return Group(
        Paragraph(Text("kvscope shows a KV cache the way llama.cpp keeps it: each cache stream is a lane of cells.")),
        BLANK,
        _heading("Cells"), cells, BLANK,
        Paragraph(colours), BLANK,
        *keys, BLANK,
        _heading("Lanes"),
        Rows([("kv", "the cache of a full-attention model"),
              ("base, swa", ("the two caches of a sliding-window model: its full-attention layers, its sliding "
                             "layers")),
              ("s0 s1 ...", "the streams: with split streams (-np without -kvu) each sequence has one of its own")]),
        BLANK,
        _heading("QUIRKs", "llama.cpp behaviour that looks unintended is reproduced, and its events say so (a ! in "
                           "the log): the dry run's SWA purge, the heads after a failed dry run, seq_div's shift "
                           "sign, the server's needless checkpoint search."), BLANK,
        _heading("Server slots", "(--workload server, or a real llama-server watched from its log: its slots, slot i "
                                 "on sequence i) each slot's last prompt as a bar, its last turns (task and outcome), "
                                 "the checkpoints it holds (their token counts) and their host memory (a part of the "
                                 "CPU bar). The log's \"server\" filter (f) shows the server's own lines."),
        Rows([(Text("█", style=part["reused"]), "prompt tokens served by the cache"),
              (Text("▓", style=part["lost"]), "held by the cache but processed again"),
              (Text("░", style=part["new"]), "new"),
              (Text("kept", style=outcome["kept"]), "a turn whose prefix was reused"),
              (Text("restored", style=outcome["restored"]), "a turn that restored a checkpoint"),
              (Text("forced", style=outcome["forced"]), "a turn forced to process its whole prompt again"),
              ("new", "a turn for which nothing was kept")]),
    )


def blocks_help_text(dark: bool) -> Group:
    """The help of the block views (a vLLM / SGLang deployment watched from its KV events): what a lane, a glyph,
    a colour and each panel mean, and the keys, which only move the view."""
    colours = Text()
    colours.append("Prefixes", style="bold")
    colours.append(" keep one colour on every worker, in both explorers and every run: the colour of a block is its "
                   "chain's first block's (its system prompt or conversation), picked by that block's hash from the "
                   "palette of the cell grids:")
    for colour in style.palette(dark):
        colours.append(" ")
        colours.append(style.GLYPH_ONE, style=colour)
    empty = style.EMPTY_COLOR if dark else style.EMPTY_COLOR_ON_LIGHT
    glyphs = Rows([
        (Text(style.GLYPH_ONE, style=style.palette(dark)[0]), "a block a worker holds, in its prefix's colour"),
        (Text(style.GLYPH_EMPTY, style=empty), "room the worker has for one more block (its capacity, where known)"),
        ("".join(style.OCCUPANCY_GLYPHS[1:]), ("a glyph that covers several blocks (a lane wider than the screen): "
                                              "from a few held to all, in the colour of the prefix holding most")),
        (Text(style.GLYPH_ONE, style=f"bold underline {style.palette(dark)[1]}"), "stored since the last frame"),
    ])
    panels = Rows([
        ("lanes", ("per worker, its summary (blocks held of its capacity, stored and evicted per second over the "
                   "publisher's last 5 s, batches lost), then a lane per medium (GPU, CPU offload) and KV cache "
                   "group (full attention, a sliding window): blocks by prefix, the oldest prefix first, each "
                   "prefix's blocks by depth")),
        ("block", ("the block under the cursor: when it was stored, its parent and prefix, its tokens, who else "
                   "holds it, and when it was evicted")),
        ("prefix tree", ("the selected worker's blocks as the parent hashes chain them: a chain of single children "
                         "is one line, a branch its blocks and what hangs below it")),
        ("router", ("what a KV-aware router sees: how deep the workers hold each shared prefix alike, and what each "
                    "worker alone holds")),
        ("evictions", "the blocks the workers evicted, newest first, and why when it was not the publisher's choice"),
    ])
    keys = Rows([
        ("arrows, mouse", "the block under the cursor, explained beside the lanes (the cursor follows its block)"),
        ("[ ]", "the lane before / after"),
        ("tab shift+tab", "the next / previous worker: its prefix tree is shown"),
        ("ctrl+p", "go to a worker, the most shared prefix, the block evicted last"),
        ("? q", "this help, quit"),
    ])
    return Group(
        Paragraph(Text("kvscope shows the prefix caches of vLLM or SGLang workers as their KV events describe them: "
                       "which hashed blocks each worker holds, in which medium, and what they were evicted for. "
                       "Nothing is sent to the workers; the events say what is held, not where, nor which request "
                       "hit it. Times are the publisher's clock.")),
        BLANK, _heading("Blocks"), glyphs, BLANK, Paragraph(colours), BLANK,
        _heading("Panels"), panels, BLANK,
        _heading("Keys", "(they move the view only)"), keys,
    )


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 100; max-width: 95%; height: auto; max-height: 90%;
                                  border: round $accent; background: $surface; padding: 1 2; }
    """

    def __init__(self, replay: bool = False, attached: bool = False, blocks: bool = False) -> None:
        """replay: a recording is shown (its keys come first); attached: a llama.cpp watched from its log (only
        the keys that move the view); blocks: vLLM / SGLang workers watched from their KV events."""
        super().__init__()
        self.replay, self.attached, self.blocks = replay, attached, blocks

    def compose(self) -> ComposeResult:
        dark = self.app.current_theme.dark
        with VerticalScroll():
            yield Static(blocks_help_text(dark) if self.blocks else help_text(dark, self.replay, self.attached),
                         id="help")


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
