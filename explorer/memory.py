"""Per-device memory bars as a plotly figure: weights, K/V and compute against each device's capacity
(virtual devices labelled), and the layer-to-device map underneath; drawn from the watch layer's device
mirror, in the part colours the terminal explorer uses (engine/watch/style.py)."""
from __future__ import annotations

import plotly.graph_objects as go

from engine.watch import style
from engine.watch.device_mirror import OPTIONAL_PARTS, PARTS, DeviceMirror
from engine.watch.watcher import Watcher
from explorer.view import WatcherView

PART_NAMES = {"weights": "weights", "kv": "K/V", "compute": "compute", "checkpoints": "checkpoints",
              "prompt cache": "prompt cache"}
FREE_COLOR = "#E8E8E8"
SIDE_WIDTH = 440  # pixels: the memory bars and the window sit beside the grid in the explorer


def mib(n: int) -> float:
    return n / 2**20


def layer_map_text(devices: DeviceMirror) -> str:
    """Where each layer's weights live, as the terminal explorer writes it (C: the CPU, G: a GPU,
    bold: a weight of it sent elsewhere by -ot), and the output layer's device."""
    letters, out = devices.layer_letters()
    if not letters:
        return ""
    marks = "".join(f"<b>{letter}</b>" if overridden else letter for letter, overridden in letters)
    return f"layers {marks} │ output {out or '?'}"


class MemoryBars(WatcherView):
    """One stacked bar per device; update() polls the watcher and redraws what changed."""

    def forget(self) -> None:
        self._shown = ()

    def __init__(self, watcher: Watcher, *, widget: bool = True) -> None:
        self.watcher = watcher
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        for part in PARTS:
            self.figure.add_trace(go.Bar(orientation="h", name=PART_NAMES[part], marker_color=style.MEMORY_PART_COLORS[part],
                                         hovertemplate="%{y}: %{x:.1f} MiB " + PART_NAMES[part] + "<extra></extra>"))
        self.figure.add_trace(go.Bar(orientation="h", name="free", marker_color=FREE_COLOR,
                                     hovertemplate="%{y}: %{x:.1f} MiB free<extra></extra>"))
        self.figure.update_layout(barmode="stack", height=160, width=SIDE_WIDTH, margin=dict(l=10, r=10, t=40, b=60),
                                  xaxis=dict(ticksuffix=" MiB"),
                                  legend=dict(orientation="h", x=0, xanchor="left", y=-0.35, yanchor="top",
                                              traceorder="normal"))
        self._shown: tuple = ()
        self.update()

    def update(self) -> None:
        self.watcher.poll()
        devices = self.watcher.mirror.devices
        rows = list(devices.rows.values())
        labels = [row.label for row in rows]
        shown = (tuple(labels), tuple((tuple(sorted(r.bytes.items())), r.capacity) for r in rows), devices.layer_letters())
        if shown == self._shown:
            return  # nothing to send to the browser
        self._shown = shown
        with self.figure.batch_update():
            for trace, part in zip(self.figure.data, PARTS):
                trace.x, trace.y = [mib(row.bytes.get(part, 0)) for row in rows], labels
                trace.showlegend = part not in OPTIONAL_PARTS or any(row.bytes.get(part) for row in rows)
            free = self.figure.data[len(PARTS)]
            # no known capacity (the host without a limit): no free part, the bar shows the parts' shares
            free.x = [mib(max(0, row.capacity - row.used)) if row.capacity else 0 for row in rows]
            free.y = labels
            self.figure.layout.height = 140 + 40 * max(1, len(rows))
            self.figure.layout.title = dict(text=layer_map_text(devices), font=dict(size=12), x=0.01, xanchor="left",
                                            y=0.98, yanchor="top")
