"""The event log: one line per event, filtered by kind, sequence and cache; a watched process that ended is
followed by the last lines it printed (where llama.cpp says why it stopped)."""
from __future__ import annotations

import collections

from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from engine import events as ev
from engine.watch import style
from engine.watch.describe import EVENT_GROUPS, EventFilter, describe_event, event_seqs

SHOWN_PER_FRAME = 20
LAST_LINES_INDENT = " " * 8  # under the event's text, past its number
KEPT_LINES = 2000


class EventLog(ScrollView, can_focus=False):  # the grid keeps the keys; the log scrolls with the mouse
    """Keeps each line as a tuple of plain values and renders only the rows on screen. A log of styled
    lines (RichLog) keeps a Strip per line, each with seven caches of its own: thousands of objects that
    every full pass of the garbage collector walks, which showed as 40-70 ms pauses of the keys."""

    DEFAULT_CSS = """
    EventLog { height: 8; border: round $primary-darken-2; overflow-x: hidden; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.filter = EventFilter()
        # (seq_no, text, seq whose colour it takes or -1, index of the QUIRK mark or -1); seq_no -1: a note
        self._rows: collections.deque[tuple[int, str, int, int]] = collections.deque(maxlen=KEPT_LINES)
        self._following = True  # showing the last line when lines last came: a resize keeps it there
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

    @property
    def line_count(self) -> int:
        return len(self._rows)

    def line_text(self, index: int) -> str:
        seq_no, body, _, _ = self._rows[index]
        return body if seq_no < 0 else f"{seq_no:>7} {body}"

    def clear(self) -> None:
        self._rows.clear()
        self._sized()

    def add_events(self, events: list[ev.Event]) -> None:
        """Append the kept events; of a burst, only the latest SHOWN_PER_FRAME (the log shows a few lines,
        and describing thousands of them per frame would slow the whole view), saying how many were passed."""
        kept = [e for e in events if self.keeps(e)]
        if not kept:
            return
        following = self.scroll_offset.y >= self.max_scroll_y
        if len(kept) > SHOWN_PER_FRAME:
            passed = len(kept) - SHOWN_PER_FRAME
            self._rows.append((-1, f"        ... {passed} more events (a recording or the filters show every one)",
                               -1, -1))
            kept = kept[-SHOWN_PER_FRAME:]
        self._rows.extend(row for event in kept for row in _rows(event))
        self._sized()
        self._following = following
        if following:
            # now, not after a refresh (whether that comes before a screenshot is a race); forced: the first
            # time the log outgrows its box its scrollbar is not there yet, which would make the scroll a no-op
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True, force=True)
        self.refresh()

    def on_resize(self) -> None:
        self._sized()
        if self._following:  # a box that grew or shrank (the first layout among them) still ends at the last line
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True, force=True)

    def _sized(self) -> None:
        size = Size(self.scrollable_content_region.width, len(self._rows))
        if (size.height > self.scrollable_content_region.height) != self.show_vertical_scrollbar:
            self.virtual_size = size  # the scrollbar comes or goes: the lines get another width, a layout
        else:
            # a layout per new line (what setting virtual_size does) re-renders every widget of the screen
            self.set_reactive(EventLog.virtual_size, size)
            if self.show_vertical_scrollbar:
                self.vertical_scrollbar.window_virtual_size = size.height
                self.vertical_scrollbar.refresh()
        self.refresh()

    def render_line(self, y: int) -> Strip:
        index = self.scroll_offset.y + y
        width = self.scrollable_content_region.width
        if index >= len(self._rows):
            return Strip.blank(width, self.rich_style)
        text = _text(self._rows[index], self.app.current_theme.dark)
        console = self.app.console
        line = Strip(text.render(console)).apply_style(console.get_style(text.style))  # the base style too
        return line.crop_extend(0, width, self.rich_style).apply_style(self.rich_style)


def _rows(event: ev.Event) -> list[tuple[int, str, int, int]]:
    """The event's line; after a ProcessExited, the process's last lines, as notes under it."""
    seqs = sorted(event_seqs(event))
    body = describe_event(event)
    quirk_at = body.index("!") if getattr(event, "quirk", "") else -1
    rows = [(event.seq_no, body, seqs[0] if len(seqs) == 1 else -1, quirk_at)]
    if isinstance(event, ev.ProcessExited) and event.last_lines:
        rows.append((-1, f"{LAST_LINES_INDENT}its last {len(event.last_lines)} lines:", -1, -1))
        rows += [(-1, f"{LAST_LINES_INDENT}│ {line}", -1, -1) for line in event.last_lines]
    return rows


def _text(row: tuple[int, str, int, int], dark: bool = True) -> Text:
    seq_no, body, seq, quirk_at = row
    if seq_no < 0:
        return Text(body, style="dim")
    text = Text(f"{seq_no:>7} ", style="dim")
    text.append(body, style=style.seq_color(seq, dark) if seq >= 0 else "")
    if quirk_at >= 0:
        text.stylize(style.QUIRK_COLOR, len(text) - len(body) + quirk_at)
    return text
