"""Per-device memory bars (weights, K/V, compute against capacity, nvitop-style) and the layer map, laid out
for the panel's width: no line is longer than the panel, so none wraps in the middle of a figure."""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text

from engine.watch import style
from engine.watch.device_mirror import OPTIONAL_PARTS, DeviceMirror, DeviceRow
from tui.text_panel import TextPanel

PART_COLORS = style.MEMORY_PART_COLORS
BAR_WIDTH = 18  # at most
BAR_AT_LEAST = 6  # a shorter bar shows too little: the capacity goes on a line of its own first
UNLAID_WIDTH = 44  # the width assumed before the panel is laid out


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class DeviceBars(TextPanel):
    DEFAULT_CSS = """
    DeviceBars { height: auto; border: round $primary-darken-2; padding: 0 1; }
    """

    _devices: DeviceMirror | None = None

    def on_resize(self) -> None:
        super().on_resize()
        if self._devices is not None:  # the bars fit the width: draw them for the new one
            self.show_devices(self._devices)

    def show_devices(self, devices: DeviceMirror) -> None:
        self._devices = devices
        self.border_title = "devices"
        width = self.content_region.width or UNLAID_WIDTH
        text = Text()
        label_width = max((cell_len(row.label) for row in devices.rows.values()), default=0)
        for row in devices.rows.values():
            for line in _device_lines(row, label_width, width):
                text.append_text(line)
                text.append("\n")
        names = [("weights", "weights"), ("K/V", "kv"), ("compute", "compute")]
        names += [(part, part) for part in OPTIONAL_PARTS if any(row.bytes.get(part) for row in devices.rows.values())]
        _append_wrapped(text, [Text(name, style=PART_COLORS[part]) for name, part in names], " · ", width)
        letters, out = devices.layer_letters()
        if letters:
            text.append("\n")
            layers = Text("layers ")
            for letter, overridden in letters:
                layers.append(letter, style="bold" if overridden else "")
            _append_wrapped(text, [layers, Text(f"│ output {out or '?'}")], " ", width)
        self.show(text)


def _device_lines(row: DeviceRow, label_width: int, width: int) -> list[Text]:
    """A device's bar and figures in one line when they fit, else with the capacity under the bar, else with
    the label above it too."""
    used = mib(row.used)
    capacity = f"of {mib(row.capacity)}" if row.capacity else "no limit"
    label = f"{row.label:<{label_width}} "
    for with_label, with_capacity in ((True, True), (True, False), (False, False)):  # beside the bar, or not
        bar_width = width - len("▕▏") - cell_len(used) - (cell_len(label) if with_label else 0) \
            - (1 + cell_len(capacity) if with_capacity else 0)
        if bar_width >= BAR_AT_LEAST:
            break  # else the last layout, however narrow
    bar = Text(label if with_label else "")
    _bar(bar, row, max(1, min(BAR_WIDTH, bar_width)))
    bar.append(used)
    if with_capacity:
        bar.append(f" {capacity}", style="dim")
        return [bar]
    indent = " " * (cell_len(label) if with_label else 1)
    lines = [bar, Text(indent + capacity, style="dim")]
    return lines if with_label else [Text(row.label), *lines]


def _bar(text: Text, row: DeviceRow, width: int) -> None:
    total = row.capacity or row.used  # no capacity known: the bar shows the parts' shares
    text.append("▕")
    filled = 0
    for part, color in PART_COLORS.items():
        n = min(round(width * row.bytes.get(part, 0) / max(total, 1)), width - filled)
        text.append("█" * n, style=color)
        filled += n
    text.append("░" * (width - filled), style="dim")
    text.append("▏")


def _append_wrapped(text: Text, items: list[Text], separator: str, width: int) -> None:
    """Items joined by a separator, a new line instead of the separator where the next would not fit."""
    column = 0
    for k, item in enumerate(items):
        if k:
            if column + len(separator) + item.cell_len > width:
                text.append("\n")
                column = 0
            else:
                text.append(separator)
                column += len(separator)
        text.append_text(item)
        column += item.cell_len
