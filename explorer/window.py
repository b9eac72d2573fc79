"""The sliding window of one sequence, along its positions: one row per cache (the full-attention layers'
and the sliding layers'), each position coloured by what the sequence's next token does with it: sees
it, holds it but masks it (outside the window), has no cell for it (never stored, or purged), or holds
it beyond the next position. The terminal explorer shows the same answer crossed on its grid; both
come from the watch layer's visibility (engine/watch/visibility.py), the kernel's own mask rule."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from engine.watch import style
from engine.watch.visibility import CacheVisibility, CellVisibility, SequenceVisibility, visibility
from engine.watch.watcher import Watcher
from explorer.memory import SIDE_WIDTH
from explorer.view import WatcherView

NOT_STORED, SEEN, MASKED, BEYOND = 0, 1, 2, 3
WHAT = {NOT_STORED: "no cell (never stored, or removed)", SEEN: "seen by the next token",
        MASKED: "stored, masked: outside the window", BEYOND: "stored beyond the next position"}
MASKED_COLOR, BEYOND_COLOR = "#7F7F7F", "#C9B3E6"
MAX_POSITIONS = 2048  # a longer sequence shows its last positions, where the window is


def position_states(window: CacheVisibility, first: int, last: int) -> np.ndarray:
    """What the next token does with each position first..last of the sequence in this cache."""
    states = np.full(last - first + 1, NOT_STORED, dtype=np.int8)
    for code, state in ((CellVisibility.MASKED, MASKED), (CellVisibility.FUTURE, BEYOND),
                        (CellVisibility.ATTENDED, SEEN)):  # seen last: it wins where a position is held twice
        pos = window.pos[window.codes == code]
        pos = pos[(pos >= first) & (pos <= last)]
        states[pos - first] = state
    return states


def runs(states: np.ndarray, first: int) -> dict[int, tuple[list[int], list[int]]]:
    """Per state, the (starts, lengths) of its runs of consecutive positions (states[k] is position first + k)."""
    out: dict[int, tuple[list[int], list[int]]] = {state: ([], []) for state in WHAT}
    if len(states) == 0:
        return out
    edges = np.flatnonzero(np.diff(states)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [len(states)]])
    for a, b in zip(starts.tolist(), ends.tolist()):
        out[int(states[a])][0].append(first + a)
        out[int(states[a])][1].append(b - a)
    return out


class SwaWindow(WatcherView):
    """What the next token of a sequence sees, position by position, in each cache; update() redraws.

    Each cache is a row of bars, one per run of positions in the same state (a few per row, so a redraw
    sends little however long the sequence), and a mark at the next token's own position."""

    def __init__(self, watcher: Watcher, *, seq: int | None = None, dark: bool = False, widget: bool = True) -> None:
        self.watcher, self.seq, self.dark = watcher, seq, dark
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        colours = {NOT_STORED: style.EMPTY_FILL[dark], SEEN: style.seq_color(0, dark), MASKED: MASKED_COLOR,
                   BEYOND: BEYOND_COLOR}
        for state, what in WHAT.items():
            self.figure.add_trace(go.Bar(orientation="h", name=what, marker_color=colours[state], showlegend=True,
                                         hovertemplate="%{y}: positions %{base} to %{customdata}<br>" + what
                                                       + "<extra></extra>"))
        self.figure.add_trace(go.Scatter(mode="markers", name="the next token", hovertemplate="%{y}: the next token at "
                                         "pos %{x}<extra></extra>", marker=dict(symbol="triangle-down", size=11,
                                                                               color=style.HEAD_COLOR)))
        self.figure.update_layout(height=150, width=SIDE_WIDTH, margin=dict(l=10, r=10, t=40, b=30),
                                  barmode="overlay", bargap=0.35, plot_bgcolor="rgba(0,0,0,0)",
                                  yaxis=dict(autorange="reversed"),
                                  legend=dict(orientation="h", x=0, xanchor="left", y=-0.45, yanchor="top",
                                              font=dict(size=10)))
        self.seen: SequenceVisibility | None = None
        self._empty_for: int | None = -1  # the selection the empty figure was drawn for (-1: not drawn empty)
        self.update()

    def select(self, seq: int | None) -> SequenceVisibility | None:
        self.seq = seq
        return self.update()

    def forget(self) -> None:
        self._empty_for = -1

    def update(self) -> SequenceVisibility | None:
        self.watcher.poll()
        self.seen = self._visibility()
        bars, marker = self.figure.data[:len(WHAT)], self.figure.data[len(WHAT)]
        if self.seen is None and self._empty_for == self.seq:
            return None  # already drawn so: nothing to send
        self._empty_for = self.seq if self.seen is None else -1
        with self.figure.batch_update():
            if self.seen is None:
                for trace in (*bars, marker):
                    trace.x, trace.y = None, None
                self.figure.layout.xaxis.visible = self.figure.layout.yaxis.visible = False
                self.figure.layout.showlegend = False
                self.figure.layout.title = dict(text="select a sequence to see its window" if self.seq is None
                                                else f"seq {self.seq} holds no cell", font=dict(size=12), x=0.01)
                return None
            windows = list(self.seen.caches.values())
            # up to the position before the next token's (the marker stands on its own), or the furthest
            # position held beyond it
            last = max(self.seen.next_pos - 1, *(int(w.pos[w.codes == CellVisibility.FUTURE].max(initial=-1))
                                                 for w in windows))
            first = max(0, last - MAX_POSITIONS + 1)
            rows = [position_states(w, first, last) for w in windows]
            labels = [f"{w.cache} ({w.kind.value}{f' {w.n_swa}' if w.n_swa else ''})" for w in windows]
            per_row = [runs(row, first) for row in rows]
            for state, trace in zip(WHAT, bars):
                starts = [a for r in per_row for a in r[state][0]]
                lengths = [n for r in per_row for n in r[state][1]]
                trace.base, trace.x = starts, lengths
                trace.y = [label for r, label in zip(per_row, labels) for _ in r[state][0]]
                trace.customdata = [a + n - 1 for a, n in zip(starts, lengths)]
            bars[SEEN].marker.color = style.seq_color(self.seq, self.dark)
            marker.x, marker.y = [self.seen.next_pos] * len(labels), labels
            self.figure.layout.xaxis.visible = self.figure.layout.yaxis.visible = True
            self.figure.layout.showlegend = True
            self.figure.layout.height = 130 + 35 * len(windows)
            sees = " · ".join(f"{w.cache}: {int((row == SEEN).sum())} positions" for w, row in zip(windows, rows))
            self.figure.layout.title = dict(text=f"seq {self.seq}: its next token (pos {self.seen.next_pos}) sees "
                                                 f"{sees}", font=dict(size=12), x=0.01)
        return self.seen

    def _visibility(self) -> SequenceVisibility | None:
        if self.seq is None or not self.watcher.mirror.caches:
            return None
        try:
            seen = visibility(self.watcher.mirror, self.seq)
        except ValueError:
            return None
        return seen if any(w.n_held for w in seen.caches.values()) else None
