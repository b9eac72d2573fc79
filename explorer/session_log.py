"""The engine's log of a session run here (Session.log): llama.cpp's lines ("context full, swapping: ..."),
the latest ones of the level chosen and above, in the explorer instead of under whichever notebook cell
runs next. A remote session's log stays on its server (`kvscope serve` prints it there)."""
from __future__ import annotations

import html
import logging
from typing import Callable

import ipywidgets as widgets

from explorer.view import LOG_TEXT_STYLE, Shown, observe_value, row

SHOWN_LEVELS = ("error", "warning", "info", "debug")
LEVEL_STYLES = {"error": "color:#C00000", "warning": "color:#B8860B", "info": "", "debug": "opacity:0.6"}


def log_line(line) -> str:
    """One LogLine as an HTML line: its number dim, its text coloured by level."""
    return (f"<span style='opacity:0.55'>{line.number:>6}</span> "
            f"<span style='{LEVEL_STYLES[line.level]}'>{html.escape(line.text)}</span>")


class SessionLogPanel(Shown):
    """The last `lines` lines of a session's log at the level the switch shows and above. Choosing a lower
    level also has the session keep such lines from then on (it keeps info and above unless told)."""

    # How a redraw the level switch asks for is run (the explorer's: on the session's worker).
    runner: Callable[[Callable[[], object]], object] | None = None

    def __init__(self, session, *, lines: int = 8) -> None:
        self.session_log, self.lines = session.log, lines
        self.level = widgets.Dropdown(options=SHOWN_LEVELS, value=self.session_log.level, description="engine log",
                                      tooltip="the lowest level shown; debug lines are kept from when it is chosen",
                                      layout=widgets.Layout(width="220px"), style={"description_width": "70px"})
        self.summary = widgets.HTML()
        self.text = widgets.HTML(layout=widgets.Layout(height=f"{1.45 * lines + 0.6:.1f}em", overflow="auto"))
        observe_value(self.level, self._level_chosen)
        self.widget = widgets.VBox([row([self.level, self.summary]), self.text],
                                   layout=widgets.Layout(margin="8px 0 0 0"))
        self._shown_at: tuple = ()
        self.update()

    def _level_chosen(self, level: str) -> None:
        if logging.getLevelName(level.upper()) < logging.getLevelName(self.session_log.level.upper()):
            self.session_log.level = level
        if self.runner is None:
            self.update()
        else:
            self.runner(self.update)

    def update(self) -> None:
        """Redraw when lines came or the level changed."""
        shown_at = (self.session_log.n_lines, self.level.value)
        if shown_at == self._shown_at:
            return
        self._shown_at = shown_at
        kept = self.session_log.lines(level=self.level.value)
        latest = kept[-self.lines:]
        body = "<br>".join(log_line(line) for line in latest) or f"<i>no line at {self.level.value} or above yet</i>"
        self.text.value = f"<div style='{LOG_TEXT_STYLE}'>{body}</div>"
        self.summary.value = (f"<span style='opacity:0.7'>{len(kept)} line{'s' if len(kept) != 1 else ''} at "
                              f"{self.level.value} and above, the latest {len(latest)} shown · "
                              f"{self.session_log.n_lines} logged</span>")
