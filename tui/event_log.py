"""The event log: one line per event, filtered by kind, sequence and cache."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from engine import events as ev
from engine.watch import style
from engine.watch.describe import EVENT_GROUPS, EventFilter, describe_event, event_seqs

SHOWN_PER_FRAME = 20


class EventLog(RichLog, can_focus=False):  # the grid keeps the keys; the log scrolls with the mouse
    DEFAULT_CSS = """
    EventLog { height: 8; border: round $primary-darken-2; overflow-x: hidden; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=2000, wrap=False, markup=False, **kwargs)
        self.filter = EventFilter()
        self._title()

    def _title(self) -> None:
        self.border_title = self.filter.describe() + "  (f: kind, g: this seq, c: this cache)"

    def cycle_group(self) -> None:
        self.filter.group = EVENT_GROUPS[(EVENT_GROUPS.index(self.filter.group) + 1) % len(EVENT_GROUPS)]
        self._title()

    def toggle_seq(self, seq: int | None) -> None:
        self.filter.seq = None if self.filter.seq is not None else seq
        self._title()

    def toggle_cache(self, cache: str | None) -> None:
        self.filter.cache = None if self.filter.cache is not None else cache
        self._title()

    def keeps(self, event: ev.Event) -> bool:
        return self.filter.keeps(event)

    def add_events(self, events: list[ev.Event]) -> None:
        """Append the kept events; of a burst, only the latest SHOWN_PER_FRAME (the log shows a few lines,
        and writing thousands of them per frame would slow the whole view), saying how many were passed."""
        kept = [e for e in events if self.keeps(e)]
        if not kept:
            return
        lines = []
        if len(kept) > SHOWN_PER_FRAME:
            passed = len(kept) - SHOWN_PER_FRAME
            lines.append(Text(f"        ... {passed} more events (a recording or the filters show every one)",
                              style="dim"))
            kept = kept[-SHOWN_PER_FRAME:]
        dark = self.app.current_theme.dark
        lines += [_line(event, dark) for event in kept]
        # one write for the frame's lines: RichLog does per write what costs most (~0.75 ms a write here)
        self.write(Text("\n").join(lines))


def _line(event: ev.Event, dark: bool = True) -> Text:
    text = Text(f"{event.seq_no:>7} ", style="dim")
    seqs = sorted(event_seqs(event))
    body = describe_event(event)
    color = style.seq_color(seqs[0], dark) if len(seqs) == 1 else None
    text.append(body, style=color or "")
    if getattr(event, "quirk", ""):
        text.stylize(style.QUIRK_COLOR, len(text) - len(body) + body.index("!"))
    return text
