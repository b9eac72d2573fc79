"""The last ubatch's attention mask as text (key m): a row per token of the ubatch, a glyph per cell, as the
attention kernel masks them (engine/watch/attention_mask.py, the kernel's own rule; the notebook's MaskView
draws the same mask).

    s0 p12 █··█████▣░░░╳╳
           the token of seq 0 at pos 12 attends to the █ cells (its own is ▣), not to the others

Glyphs: █ attends (in the colour of the token's sequence), ▣ the token's own cell, ░ masked (another
sequence's cell, or a later position), ╳ outside the sliding window (as on the grid), · an empty cell (a
hole). The padding up to n_kv is left out (the title says how wide n_kv is). [ or ] shows the other cache,
escape or m closes.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import ScrollableContainer, Vertical
from textual.screen import ModalScreen

from engine.watch import style
from engine.watch.attention_mask import MaskCell, UbatchMask, last_ubatch_mask
from tui.text_panel import TextPanel

GLYPH_OWN = "▣"
GLYPH_MASKED = "░"
GLYPH_OUTSIDE = "╳"  # the grid's mark of a cell outside the selected sequence's window
MAX_ROWS = 64  # a longer ubatch shows its last tokens
MASKED_COLOR = {True: "#6C6C6C", False: "#9A9A9A"}
REDRAW_EVERY_S = 0.25
LEGEND = (f"{style.GLYPH_ONE} attends (the colour of the token's sequence)   {GLYPH_OWN} its own cell   "
          f"{GLYPH_MASKED} masked: another sequence, or a later position   {GLYPH_OUTSIDE} outside the sliding "
          f"window   {style.GLYPH_EMPTY} empty (a hole)")


def row_label(mask: UbatchMask, k: int) -> str:
    seqs = mask.token_seqs[k]
    return f"s{','.join(map(str, seqs))} p{int(mask.token_pos[k])}"


def mask_title(mask: UbatchMask | None, cache: str | None = None) -> Text:
    """Which ubatch and cache, how many tokens and cells; or that there is none yet."""
    if mask is None:
        return Text(f"no ubatch placed in cache {cache or '?'} since the explorer started: step (n), then look again")
    text = Text(mask.title(), style="bold")
    n_rows = min(mask.n_tokens, MAX_ROWS)
    if n_rows < mask.n_tokens:
        text.append(f" (its last {n_rows} tokens)")
    if mask.n_used < mask.n_kv:
        text.append(f"; the {mask.n_kv - mask.n_used} padding cells after cell {mask.n_used - 1} are left out")
    return text


def mask_rows(mask: UbatchMask | None, dark: bool) -> Text:
    """A ruler of cell indices, then a row of glyphs per token (its label first): what the panel draws."""
    if mask is None:
        return Text("")
    shown = range(max(0, mask.n_tokens - MAX_ROWS), mask.n_tokens)
    width = max(mask.n_used, 1)  # the padding after the last used cell is masked for every token: left out
    labels = {k: row_label(mask, k) for k in shown}
    indent = max(len(label) for label in labels.values()) + 1
    text = Text(" " * indent + ruler(width) + "\n", no_wrap=True)
    grey = Style(color=MASKED_COLOR[dark])
    empty = Style(color=style.EMPTY_COLOR if dark else style.EMPTY_COLOR_ON_LIGHT)
    for k in shown:
        text.append(labels[k].ljust(indent))
        colour = Style(color=style.seq_color(int(mask.token_seq[k]), dark))
        for c in range(width):
            code = int(mask.codes[k, c])
            if code == MaskCell.OWN:
                text.append(GLYPH_OWN, colour + Style(bold=True))
            elif code == MaskCell.ATTENDED:
                text.append(style.GLYPH_ONE, colour)
            elif code == MaskCell.WINDOW:
                text.append(GLYPH_OUTSIDE, grey)
            elif code == MaskCell.EMPTY:
                text.append(style.GLYPH_EMPTY, empty)
            else:
                text.append(GLYPH_MASKED, grey)
        if k != shown[-1]:
            text.append("\n")
    return text


def mask_words(mask: UbatchMask | None) -> Text:
    """The last token's row in words (and a warning when the cells changed since), then the legend."""
    text = Text()
    if mask is not None:
        if not mask.exact:
            text.append(mask.describe().split("\n")[-1].strip() + "\n")
        text.append(mask.describe_row(mask.n_tokens - 1) + "\n\n")
    text.append(LEGEND, style="dim")
    return text


def ruler(width: int) -> str:
    """Cell indices every ten cells: '0         10        20'."""
    return "".join(str(start).ljust(10) for start in range(0, width, 10)).rstrip()


class MaskPanel(TextPanel):
    """One job: draw a UbatchMask's rows of glyphs (wider than the dialog, it scrolls sideways)."""

    DEFAULT_CSS = "MaskPanel { width: auto; height: auto; }"

    def show_mask(self, mask: UbatchMask | None, dark: bool) -> None:
        self.show(mask_rows(mask, dark))


class MaskScreen(ModalScreen[None]):
    """The last ubatch's mask over the main view, redrawn as the watcher's cells change."""

    # not tab: the app's tab (the next sequence) has priority over every screen's keys
    BINDINGS = [Binding("escape,m,q", "dismiss", "close"),
                Binding("right_square_bracket", "next_cache(1)", "next cache"),
                Binding("left_square_bracket", "next_cache(-1)", show=False)]
    DEFAULT_CSS = """
    MaskScreen { align: center middle; }
    MaskScreen > Vertical { width: 95%; height: auto; max-height: 90%; border: round $accent;
                            background: $surface; padding: 0 1; }
    MaskScreen TextPanel { width: 100%; height: auto; }
    MaskScreen ScrollableContainer { height: auto; max-height: 70vh; margin: 1 0; }
    MaskScreen MaskPanel { width: auto; }
    """

    def __init__(self, watcher_of, cache: str | None = None) -> None:
        """watcher_of: a function giving the watcher to read (the app's: a replay swaps its watcher);
        cache: the one shown first (None: base, else the first)."""
        super().__init__()
        self.watcher_of, self.cache = watcher_of, cache
        self.mask: UbatchMask | None = None

    def compose(self) -> ComposeResult:
        with Vertical():
            yield TextPanel(id="mask-title")
            with ScrollableContainer():
                yield MaskPanel(id="mask")
            yield TextPanel(id="mask-words")

    def on_mount(self) -> None:
        self.query_one(Vertical).border_title = "attention mask of the last ubatch · [ ]: the other cache · m: close"
        self.redraw()
        self.set_interval(REDRAW_EVERY_S, self.redraw)

    def caches(self) -> list[str]:
        return list(self.watcher_of().mirror.caches)

    def redraw(self) -> None:
        caches = self.caches()
        if self.cache not in caches:
            self.cache = "base" if "base" in caches else next(iter(caches), None)
        self.mask = None if self.cache is None else last_ubatch_mask(self.watcher_of(), self.cache)
        self.query_one("#mask-title", TextPanel).show(mask_title(self.mask, self.cache))
        self.query_one(MaskPanel).show_mask(self.mask, self.app.current_theme.dark)
        self.query_one("#mask-words", TextPanel).show(mask_words(self.mask))

    def action_next_cache(self, direction: int) -> None:
        caches = self.caches()
        if caches:
            k = caches.index(self.cache) if self.cache in caches else 0
            self.cache = caches[(k + direction) % len(caches)]
        self.redraw()
