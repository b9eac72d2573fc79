"""Views to files: standalone HTML (every figure in one page, plotly's JavaScript inlined once) and PNG
(kaleido renders each figure in the machine's Chrome or Chromium; several figures are stacked)."""
from __future__ import annotations

import html
import io
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio


def plain_figure(figure) -> go.Figure:
    """A plain Figure of a figure or FigureWidget (what the exporters take)."""
    return go.Figure(figure.to_dict()) if isinstance(figure, go.FigureWidget) else figure


def figures_html(figures: list, *, title: str = "kvscope") -> str:
    """One standalone HTML page holding every figure."""
    if not figures:
        raise ValueError("nothing to export: the view draws no figure")
    parts = [pio.to_html(plain_figure(f), full_html=False, include_plotlyjs=(k == 0)) for k, f in enumerate(figures)]
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family: sans-serif'>{''.join(parts)}</body></html>")


def figures_png(figures: list, path: Path, *, width: int = 1200, scale: float = 2.0) -> Path:
    """The figures as one PNG, stacked top to bottom."""
    if not figures:
        raise ValueError("nothing to export: the view draws no figure")
    try:
        images = [pio.to_image(plain_figure(f), format="png", width=width, scale=scale) for f in figures]
    except (ValueError, RuntimeError) as e:
        raise RuntimeError(f"PNG export needs kaleido and Chrome or Chromium ({e}); export_html works without "
                           f"them") from None
    if len(images) == 1:
        path.write_bytes(images[0])
        return path
    from PIL import Image

    opened = [Image.open(io.BytesIO(data)) for data in images]
    sheet = Image.new("RGB", (max(i.width for i in opened), sum(i.height for i in opened)), "white")
    y = 0
    for image in opened:
        sheet.paste(image, (0, y))
        y += image.height
    sheet.save(path)
    return path
