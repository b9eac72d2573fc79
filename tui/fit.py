"""One line of parts that fits its width: when the parts are too long together, the least needed go first
(and the one that may shrink is cut short), so that what matters is never clipped at the right edge and a
line never wraps into a row it does not have (the title, the status line)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from rich.cells import cell_len
from rich.text import Text

from tui.text_panel import TextPanel

ELLIPSIS = "…"
SHRUNK_AT_LEAST = 12  # a shrinking part cut shorter than this says too little: it is left out instead


@dataclass(frozen=True)
class Part:
    """A piece of a line: its text and style, the separator before it (dropped with it), and its rank: 0
    is always shown, higher ranks are left out first when the line is too long."""

    text: str
    style: str = ""
    rank: int = 0
    before: str = " · "
    shrinks: bool = False  # cut short with an ellipsis rather than left out while some of it fits


def fit(parts: list[Part], width: int) -> Text:
    """The parts as one line of at most `width` cells (width <= 0: all of them, not yet laid out)."""
    kept = _first_without_separator(list(parts))
    if width <= 0:
        return _joined(kept)
    while _length(kept) > width:
        droppable = [k for k, p in enumerate(kept) if p.rank > 0]
        if not droppable:
            break
        worst = max(droppable, key=lambda k: (kept[k].rank, k))  # the least needed, the rightmost of equals
        part = kept[worst]
        room = width - (_length(kept) - cell_len(part.text))
        if part.shrinks and room >= SHRUNK_AT_LEAST:
            kept[worst] = replace(part, text=_cut(part.text, room))
            break
        del kept[worst]
        kept = _first_without_separator(kept)
    line = _joined(kept)
    line.truncate(width, overflow="ellipsis")  # what ranks 0 alone overflow: cut, never wrapped
    return line


def _first_without_separator(parts: list[Part]) -> list[Part]:
    return [replace(parts[0], before=""), *parts[1:]] if parts else parts


def _length(parts: list[Part]) -> int:
    return sum(cell_len(p.before) + cell_len(p.text) for p in parts)


def _cut(text: str, room: int) -> str:
    line = Text(text)
    line.truncate(room - 1)
    return line.plain.rstrip() + ELLIPSIS


def _joined(parts: list[Part]) -> Text:
    line = Text(no_wrap=True, overflow="ellipsis")
    for part in parts:
        line.append(part.before)
        line.append(part.text, style=part.style)
    return line


class FittedLine(TextPanel):
    """A one-row panel showing parts fitted to its width, fitted again when its width changes."""

    DEFAULT_CSS = """
    FittedLine { height: 1; }
    """

    _parts: list[Part] | None = None

    def show_parts(self, parts: list[Part]) -> None:
        self._parts = parts
        self.show(fit(parts, self.content_region.width))

    def on_resize(self) -> None:
        super().on_resize()
        if self._parts is not None:
            self.show(fit(self._parts, self.content_region.width))
