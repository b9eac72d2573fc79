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


class SwaWindow(WatcherView):
    """What the next token of a sequence sees, position by position, in each cache; update() redraws."""

    def __init__(self, watcher: Watcher, *, seq: int | None = None, dark: bool = False, widget: bool = True) -> None:
        self.watcher, self.seq, self.dark = watcher, seq, dark
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        self.figure.add_trace(go.Heatmap(showscale=False, xgap=1, ygap=2, zmin=-0.5, zmax=3.5,
                                         hovertemplate="%{text}<extra></extra>"))
        self.figure.update_layout(height=150, margin=dict(l=10, r=10, t=40, b=30), xaxis_title="position",
                                  yaxis=dict(autorange="reversed"), plot_bgcolor="rgba(0,0,0,0)")
        self.seen: SequenceVisibility | None = None
        self.update()

    def select(self, seq: int | None) -> SequenceVisibility | None:
        self.seq = seq
        return self.update()

    def _colorscale(self) -> list:
        colours = [style.EMPTY_FILL[self.dark], style.seq_color(self.seq or 0, self.dark), MASKED_COLOR, BEYOND_COLOR]
        scale = []
        for k, colour in enumerate(colours):
            scale += [[k / 4, colour], [(k + 1) / 4, colour]]
        return scale

    def update(self) -> SequenceVisibility | None:
        self.watcher.poll()
        self.seen = self._visibility()
        heatmap = self.figure.data[0]
        with self.figure.batch_update():
            if self.seen is None:
                heatmap.z, heatmap.x, heatmap.y, heatmap.text = None, None, None, None
                self.figure.layout.xaxis.visible = self.figure.layout.yaxis.visible = False
                self.figure.layout.title = dict(text="select a sequence to see its window" if self.seq is None
                                                else f"seq {self.seq} holds no cell", font=dict(size=12), x=0.01)
                return None
            windows = list(self.seen.caches.values())
            last = max(self.seen.next_pos, *(int(w.pos[w.codes == CellVisibility.FUTURE].max(initial=-1))
                                             for w in windows))
            first = max(0, last - MAX_POSITIONS + 1)
            rows = [position_states(w, first, last) for w in windows]
            labels = [f"{w.cache} ({w.kind.value}{f' {w.n_swa}' if w.n_swa else ''})" for w in windows]
            heatmap.z = np.stack(rows)
            heatmap.x = np.arange(first, last + 1)
            heatmap.y = labels
            next_pos = self.seen.next_pos
            heatmap.text = [[f"pos {first + k} · {label}: " + ("the next token itself" if first + k == next_pos
                                                                else WHAT[int(s)]) for k, s in enumerate(row)]
                            for row, label in zip(rows, labels)]
            heatmap.colorscale = self._colorscale()
            self.figure.layout.xaxis.visible = self.figure.layout.yaxis.visible = True
            self.figure.layout.height = 90 + 35 * len(windows)
            sees = " · ".join(f"{w.cache}: {int((row == SEEN).sum())} positions"
                              for w, row in zip(windows, rows))
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
