"""The key bar at the bottom: the keys of what is shown (a session's, a replay's, or those of a llama.cpp
process watched from its log, which takes no command), fitted to the width.

Textual's Footer lists every shown binding in a row that is cut at the right edge, so on an 80-column
terminal `? help` and `q quit`, the two keys that lead to everything else, were the first to go. Here each
key has a rank: when the bar is too narrow, the least needed keys are left out, never help and quit.
A click on a key does what the key does."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual.events import Click

from tui.text_panel import TextPanel

GAP = "  "


@dataclass(frozen=True)
class KeyHint:
    """A key as the bar shows it: the key(s) as written, what it does, the action a click runs (None: the
    keys need a choice, e.g. a direction), the bindings it stands for (for the tests), and its rank (0:
    always shown; higher ranks are left out first when the bar is narrow)."""

    keys: str
    does: str
    action: str | None
    bindings: tuple[str, ...]
    rank: int


HELP = KeyHint("?", "help", "help", ("question_mark",), 0)
QUIT = KeyHint("q", "quit", "quit", ("q",), 0)
# In the order they are shown; help and quit at the right end, where a reader of a key bar looks for them.
SESSION_KEYS = (
    KeyHint("space", "start/pause", "toggle_run", ("space",), 1),
    KeyHint("n", "step", "step", ("n",), 2),
    KeyHint("p", "prompt", "prompt", ("p",), 4),
    KeyHint("tab", "next seq", "next_seq(1)", ("tab",), 3),
    KeyHint("w", "window", "toggle_window", ("w",), 7),
    KeyHint("m", "mask", "show_mask", ("m",), 8),
    KeyHint("o", "settings", "settings", ("o",), 6),
    KeyHint("^p", "commands", "command_palette", ("ctrl+p",), 5),
    HELP,
    QUIT,
)
REPLAY_KEYS = (
    KeyHint("space", "play/pause", "toggle_run", ("space",), 1),
    KeyHint(", .", "±1 event", None, ("comma", "full_stop"), 2),
    KeyHint("< >", "±100 events", None, ("less_than_sign", "greater_than_sign"), 5),
    KeyHint("0-9", "seek", None, tuple(str(d) for d in range(10)), 4),
    KeyHint("j J", "next/prev of kind", None, ("j", "J"), 6),
    KeyHint("tab", "next seq", "next_seq(1)", ("tab",), 3),
    KeyHint("m", "mask", "show_mask", ("m",), 7),
    HELP,
    QUIT,
)

# A llama.cpp watched from its log (kvscope attach): what moves the view only; nothing is sent to the process.
ATTACHED_KEYS = (
    KeyHint("tab", "next seq", "next_seq(1)", ("tab",), 1),
    KeyHint("w", "window", "toggle_window", ("w",), 2),
    KeyHint("+ -", "zoom", None, ("plus", "minus"), 4),
    KeyHint("f", "log filter", "log_group", ("f",), 3),
    HELP,
    QUIT,
)

# vLLM / SGLang workers' prefix caches watched from their KV events: the keys move between workers and blocks only.
BLOCK_KEYS = (
    KeyHint("←→↑↓", "block", None, ("left", "right", "up", "down"), 2),
    KeyHint("[ ]", "lane", None, ("left_square_bracket", "right_square_bracket"), 4),
    KeyHint("tab", "next worker", "next_seq(1)", ("tab",), 1),
    KeyHint("^p", "commands", "command_palette", ("ctrl+p",), 3),
    HELP,
    QUIT,
)


def fitted(hints: tuple[KeyHint, ...], width: int) -> list[KeyHint]:
    """The hints that fit in `width` cells, the least needed left out first (width <= 0: all)."""
    kept = list(hints)
    while width > 0 and _length(kept) > width:
        droppable = [h for h in kept if h.rank > 0]
        if not droppable:
            break
        kept.remove(max(droppable, key=lambda h: h.rank))
    return kept


def _length(hints: list[KeyHint]) -> int:
    return sum(cell_len(h.keys) + 1 + cell_len(h.does) for h in hints) + len(GAP) * max(len(hints) - 1, 0)


class KeyBar(TextPanel):
    """The keys of the current mode that fit, clickable."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"keybar--key"}
    DEFAULT_CSS = """
    KeyBar { height: 1; dock: bottom; padding: 0 1; background: $footer-background; color: $footer-foreground; }
    KeyBar > .keybar--key { color: $footer-key-foreground; text-style: bold; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hints: tuple[KeyHint, ...] = SESSION_KEYS
        self._spans: list[tuple[int, int, KeyHint]] = []  # the x range (content cells) of each hint shown

    def show_keys(self, hints: tuple[KeyHint, ...]) -> None:
        self.hints = hints
        self._draw()

    def on_mount(self) -> None:
        self._draw()

    def on_resize(self) -> None:
        super().on_resize()
        self._draw()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        if self.is_mounted:  # a new theme: the keys' colour is the theme's (an unchanged line costs nothing)
            self._draw()

    def shown(self) -> list[KeyHint]:
        return fitted(self.hints, self.content_region.width)

    def _draw(self) -> None:
        key_style = self.get_component_rich_style("keybar--key")
        text, spans, x = Text(no_wrap=True, overflow="crop"), [], 0
        for k, hint in enumerate(self.shown()):
            if k:
                text.append(GAP)
                x += len(GAP)
            start = x
            text.append(hint.keys, style=key_style)
            text.append(f" {hint.does}")
            x += cell_len(hint.keys) + 1 + cell_len(hint.does)
            spans.append((start, x, hint))
        self._spans = spans
        self.show(text)

    async def on_click(self, event: Click) -> None:
        x = event.x - self.styles.padding.left
        for start, end, hint in self._spans:
            if start <= x < end and hint.action is not None:
                await self.run_action(f"app.{hint.action}")
                return
