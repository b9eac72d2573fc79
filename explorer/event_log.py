"""The event log: the latest events the watcher received, one line each as the terminal explorer writes
them (engine/watch/describe.py), coloured by sequence, QUIRKs marked; filtered by kind, sequence and
cache with the same EventFilter."""
from __future__ import annotations

import html

import ipywidgets as widgets

from engine import events as ev
from engine.watch import style
from engine.watch.describe import EVENT_GROUPS, EventFilter, describe_event, event_seqs, held_seqs
from engine.watch.watcher import Watcher
from explorer.view import LOG_TEXT_STYLE, WatcherView, observe_value, replace_options, row

ANY = "any"


def event_line(event: ev.Event, dark: bool = False) -> str:
    """One event as an HTML line: its number dim, its text in its sequence's colour, a QUIRK in red."""
    body = html.escape(describe_event(event))
    seqs = sorted(event_seqs(event))
    colour = style.seq_color(seqs[0], dark) if len(seqs) == 1 else None
    if getattr(event, "quirk", "") and "!" in body:
        at = body.index("!")
        body = f"{body[:at]}<span style='color:{style.QUIRK_COLOR}; font-weight:bold'>{body[at:]}</span>"
    text = f"<span style='color:{colour}'>{body}</span>" if colour else body
    return f"<span style='opacity:0.55'>{event.seq_no:>7}</span> {text}"


class EventLog(WatcherView):
    """The last `lines` events the filter keeps; update() redraws when events arrived or the filter changed."""

    def __init__(self, watcher: Watcher, *, lines: int = 14, dark: bool = False) -> None:
        self.watcher, self.lines, self.dark = watcher, lines, dark
        self.filter = EventFilter()
        self.group = widgets.Dropdown(options=EVENT_GROUPS, value="all", description="events",
                                      layout=widgets.Layout(width="190px"))
        self.seq = widgets.Dropdown(options=[ANY], value=ANY, description="seq", layout=widgets.Layout(width="140px"))
        self.cache = widgets.Dropdown(options=[ANY], value=ANY, description="cache",
                                      layout=widgets.Layout(width="160px"))
        self.text = widgets.HTML(layout=widgets.Layout(height=f"{1.45 * lines + 0.6:.1f}em", overflow="auto"))
        for control in (self.group, self.seq, self.cache):
            observe_value(control, self._filter_changed)
        self.widget = widgets.VBox([row([self.group, self.seq, self.cache]), self.text])
        self._shown_at: tuple = ()
        self.update()

    def _filter_changed(self, _change=None) -> None:
        self.filter = EventFilter(self.group.value, None if self.seq.value == ANY else int(self.seq.value),
                                  None if self.cache.value == ANY else self.cache.value)
        self.redraw()

    def kept(self) -> list[ev.Event]:
        """The latest events the filter keeps, oldest first."""
        out = []
        for event in reversed(self.watcher.recent):
            if self.filter.keeps(event):
                out.append(event)
                if len(out) == self.lines:
                    break
        return out[::-1]

    def update(self) -> list[ev.Event]:
        self.watcher.poll()
        shown_at = (self.watcher.events, len(self.watcher.recent), self.filter)
        if shown_at == self._shown_at:
            return []
        self._shown_at = shown_at
        self._offer_choices()
        kept = self.kept()
        lines = "<br>".join(event_line(e, self.dark) for e in kept) or "<i>no event of this filter yet</i>"
        self.text.value = f"<div style='{LOG_TEXT_STYLE}'>{lines}</div>"
        return kept

    def _offer_choices(self) -> None:
        """The sequences and caches there are, in the filter's menus (the chosen one stays)."""
        mirror = self.watcher.mirror
        replace_options(self.cache, [ANY, *mirror.caches])
        replace_options(self.seq, [ANY, *(str(s) for s in held_seqs(mirror))])

    def forget(self) -> None:
        self._shown_at = ()
