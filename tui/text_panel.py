"""A panel of text that lays the screen out again only when its height may have changed."""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import Static


class TextPanel(Static):
    """Static.update lays the whole screen out by default (new text may need another height), and a layout
    re-renders every widget: done on each frame by the status line, the memory bars and the inspector, it
    cost about 20 ms a frame while generating, which is what a key waited for. This skips text that did not
    change and lays out only when the rows the text takes changed."""

    _shown: Text | None = None
    _rows = -1

    def show(self, text: Text | str) -> None:
        text = Text(text) if isinstance(text, str) else text
        if self._shown is not None and text == self._shown:
            return
        rows = self._rows_taken(text)
        self.update(text, layout=rows != self._rows)
        self._shown, self._rows = text, rows

    def _rows_taken(self, text: Text) -> int:
        width = max(self.content_region.width, 1)
        return sum(max(1, -(-cell_len(line) // width)) for line in text.plain.split("\n"))

    def on_resize(self) -> None:
        self._rows = -1  # the same text may wrap differently now
