"""Per-device memory bars (weights, K/V, compute against capacity, nvitop-style) and the layer map."""
from __future__ import annotations

from rich.text import Text

from engine.watch import style
from engine.watch.device_mirror import OPTIONAL_PARTS, DeviceMirror
from tui.text_panel import TextPanel

PART_COLORS = style.MEMORY_PART_COLORS
BAR_WIDTH = 18


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class DeviceBars(TextPanel):
    DEFAULT_CSS = """
    DeviceBars { height: auto; border: round $primary-darken-2; padding: 0 1; }
    """

    def show_devices(self, devices: DeviceMirror) -> None:
        self.border_title = "devices"
        text = Text()
        for row in devices.rows.values():
            total = row.capacity or row.used  # no capacity known: the bar shows the parts' shares
            text.append(f"{row.label:<8}▕")
            filled = 0
            for part, color in PART_COLORS.items():
                n = min(round(BAR_WIDTH * row.bytes.get(part, 0) / max(total, 1)), BAR_WIDTH - filled)
                text.append("█" * n, style=color)
                filled += n
            text.append("░" * (BAR_WIDTH - filled), style="dim")
            text.append(f"▏{mib(row.used)}")
            text.append(f" of {mib(row.capacity)}\n" if row.capacity else " no limit\n", style="dim")
        text.append("weights", style=PART_COLORS["weights"])
        text.append(" · ")
        text.append("K/V", style=PART_COLORS["kv"])
        text.append(" · ")
        text.append("compute", style=PART_COLORS["compute"])
        for part in OPTIONAL_PARTS:
            if any(row.bytes.get(part) for row in devices.rows.values()):
                text.append(" · ")
                text.append(part, style=PART_COLORS[part])
        letters, out = devices.layer_letters()
        if letters:
            text.append("\nlayers ")
            for letter, overridden in letters:
                text.append(letter, style="bold" if overridden else "")
            text.append(f" │ output {out or '?'}")
        self.show(text)
