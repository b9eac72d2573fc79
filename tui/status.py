"""The status line: what runs, how fast, how full the caches are, and whether the view is right (the
parts come from the watch layer, as the notebook explorer's)."""
from __future__ import annotations

from rich.text import Text

from engine.watch.describe import status_parts
from engine.watch.watcher import Watcher
from tui.text_panel import TextPanel

TONES = {"running": "bold reverse", "state": "bold", "error": "bold red", "warning": "yellow", "": ""}


class StatusLine(TextPanel):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $boost; padding: 0 1; }
    """

    def show_status(self, watcher: Watcher, tokens_per_s: float, source_label: str) -> None:
        text = Text()
        (state, tone), *rest = status_parts(watcher)
        text.append(f"{state} ", style=TONES[tone])
        for part, tone in rest:
            if part.startswith("step "):
                text.append(f" {part} · {tokens_per_s:.0f} tok/s")
            elif tone == "error" and part.endswith("retrying"):
                text.append(f" {part}", style="red")
            else:
                text.append(f" · {part}", style=TONES[tone])
        if source_label:
            text.append(f" · {source_label}", style="dim")
        self.show(text)
