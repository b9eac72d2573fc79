"""The attention mask of the last ubatch, drawn: the ubatch's tokens (rows) x the cache's cells (columns),
built from each cell's position and sequences as the attention kernel builds it.

Usage (a notebook; make the view BEFORE the decode you want to see: a watcher hears of ubatches placed
after it was made):

    from explorer import MaskView
    view = MaskView.of(session, cache="base")   # the full-attention cache ("swa": the sliding one)
    session.step().result()                     # ... or any decode
    view.update()                               # draws the last ubatch placed in that cache
    print(view.mask.describe())                 # the same mask in words
    lessons.picture(view, "caption")            # a still of it when the notebook is rendered
    view.follow(session)                        # or: redrawn live after each step
    MaskView.of(session, cache="base", ubatch=0)  # an earlier ubatch of the last decode (full-attention caches)

A square is coloured by the row's sequence (engine/watch/style.py: the same colour as its cells on the
grid) where the token attends to the cell, light grey where it is masked (another sequence's cell, or a
later position), a darker grey outside a sliding window, white with hatching where the cell is a hole
(empty below the last used cell) and a near-white grey in the padding up to n_kv. The token's own cell is
outlined, and on a sliding-window cache a bar marks where each token's window begins. Hovering a square
says the cell's position and sequences and why the token sees it or not. The mask is
engine/watch/attention_mask.py's, the kernel's own rule (tests/test_attention_mask.py compares them
bit for bit).
"""
from __future__ import annotations

import textwrap

import numpy as np
import plotly.graph_objects as go

from engine.watch import style
from engine.watch.attention_mask import (
    MaskCell,
    UbatchMask,
    last_decode_masks,
    last_ubatch_mask,
)
from engine.watch.watcher import Watcher
from explorer.view import WatcherView

N_SEQ_BANDS = len(style.PALETTE)
MASKED_BAND, OUTSIDE_BAND, EMPTY_BAND = N_SEQ_BANDS, N_SEQ_BANDS + 1, N_SEQ_BANDS + 2
N_BANDS = N_SEQ_BANDS + 3
MASKED_FILL = {False: "#DADADA", True: "#4A4A4A"}  # light grey on a light page (dark: a grey near the page)
OUTSIDE_FILL = {False: "#A8A8A8", True: "#767676"}
EMPTY_WHITE = {False: "#F4F4F4", True: "#262626"}  # an empty cell: the padding up to n_kv; a hole is hatched
HOLE_WHITE = {False: "#FFFFFF", True: "#1A1A1A"}
OUTLINE = {False: "#000000", True: "#FFFFFF"}
WINDOW_EDGE = {False: "#222222", True: "#F0F0F0"}
MAX_ROWS = 128  # a longer ubatch shows its last tokens (the title says so)
MAX_HOVER_SQUARES = 120_000  # beyond, hovering says the row and cell only (a text per square is heavy)
CELLS, HOLES, OWN, WINDOW = range(4)  # the figure's traces, in this order; legend keys after them


def band_colorscale(dark: bool = False) -> list[list]:
    """A flat band per palette colour, then masked, outside the window and empty: z in [-0.5, N_BANDS - 0.5]."""
    colours = [*style.palette(dark), MASKED_FILL[dark], OUTSIDE_FILL[dark], EMPTY_WHITE[dark]]
    scale = []
    for k, colour in enumerate(colours):
        scale += [[k / N_BANDS, colour], [(k + 1) / N_BANDS, colour]]
    return scale


def mask_bands(mask: UbatchMask) -> np.ndarray:
    """int [n_tokens, n_kv]: the colour band of each square (the row's sequence where it attends)."""
    seq_band = (mask.token_seq % N_SEQ_BANDS)[:, None]
    codes = mask.codes
    bands = np.full(codes.shape, MASKED_BAND, dtype=np.int64)
    bands[codes == MaskCell.EMPTY] = EMPTY_BAND
    bands[codes == MaskCell.WINDOW] = OUTSIDE_BAND
    attends = mask.allowed
    return np.where(attends, np.broadcast_to(seq_band, codes.shape), bands)


def hover_texts(mask: UbatchMask, rows: np.ndarray) -> list[list[str]]:
    cell_text = [mask.cell_text(c) for c in range(mask.n_kv)]
    return [[f"token {mask.token_label(k)}<br>{cell_text[c]}<br>{mask.why(k, c)}" for c in range(mask.n_kv)]
            for k in rows.tolist()]


def window_edges(mask: UbatchMask, rows: np.ndarray) -> tuple[list[float], list[int], list[str]]:
    """Per row of a sliding-window cache, where the token's window begins: the left edge of the attended
    cell holding the lowest position it sees (x), the row (y) and the words for hovering."""
    xs, ys, texts = [], [], []
    for y, k in enumerate(rows.tolist()):
        seen = mask.attended(k)
        if not seen.size:
            continue
        first = seen[np.argmin(mask.cell_pos[seen])]
        xs.append(float(first) - 0.5)
        ys.append(y)
        texts.append(f"{mask.token_label(k)}: its {mask.window_text()} begins at pos {mask.window_start(k)}; "
                     f"the lowest position it sees is {int(mask.cell_pos[first])} (cell {int(first)})")
    return xs, ys, texts


class MaskView(WatcherView):
    """The last ubatch's KQ mask in one cache as a plotly heatmap; update() polls and redraws."""

    def __init__(self, watcher: Watcher, *, cache: str | None = None, stream: int | None = None,
                 ubatch: int | None = None, dark: bool = False, widget: bool = True) -> None:
        """cache: "base" or "swa" of an iSWA pair, "kv" of a plain cache (None: base, else the only one);
        stream: with split streams, which one (None: the first the ubatch touched); ubatch: which ubatch of
        the last decode (None: its last; an earlier one only in a cache without a sliding window, see
        engine.watch.attention_mask.last_decode_masks); dark: colours for a dark page; widget: a FigureWidget
        (live in a notebook) or a plain Figure (export, tests)."""
        self.watcher, self.cache, self.stream, self.ubatch, self.dark = watcher, cache, stream, ubatch, dark
        self.mask: UbatchMask | None = None
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        self.figure.add_trace(go.Heatmap(z=[[EMPTY_BAND]], zmin=-0.5, zmax=N_BANDS - 0.5, showscale=False,
                                         colorscale=band_colorscale(dark), xgap=1, ygap=1, hoverinfo="text",
                                         name="cells"))
        self.figure.add_trace(go.Bar(name="empty cell (a hole)", base=-0.5, width=1, showlegend=True,
                                     marker=dict(color=HOLE_WHITE[dark], line=dict(width=0),
                                                 pattern=dict(shape="/", fgcolor=OUTSIDE_FILL[dark], size=6)),
                                     hovertemplate="cell %{x}: empty (a hole)<extra></extra>"))
        self.figure.add_trace(go.Scatter(mode="markers", name="the token's own cell", hoverinfo="skip",
                                         marker=dict(symbol="square-open", color=OUTLINE[dark], line=dict(width=2))))
        self.figure.add_trace(go.Scatter(mode="markers", name="where its window begins", hoverinfo="text",
                                         marker=dict(symbol="line-ns", line=dict(width=3, color=WINDOW_EDGE[dark]))))
        for name, colour in (("attends (the colour of the token's sequence)", style.seq_color(0, dark)),
                             ("masked: another sequence, or a later position", MASKED_FILL[dark]),
                             ("masked: outside the sliding window", OUTSIDE_FILL[dark])):
            self.figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                                             marker=dict(symbol="square", size=11, color=colour,
                                                         line=dict(width=1, color="#888888"))))
        self.figure.update_layout(margin=dict(l=10, r=10, t=70, b=40), plot_bgcolor="rgba(0,0,0,0)",
                                  barmode="overlay", bargap=0,
                                  xaxis=dict(title="cell", zeroline=False, showgrid=False),
                                  yaxis=dict(autorange="reversed", zeroline=False, showgrid=False),
                                  legend=dict(orientation="h", x=0, xanchor="left", y=-0.12, yanchor="top",
                                              font=dict(size=10)))
        self.update()

    def select(self, cache: str | None = None, stream: int | None = None,
               ubatch: int | None = None) -> UbatchMask | None:
        """Show another cache, stream or ubatch of the last decode, and redraw."""
        self.cache, self.stream, self.ubatch = cache, stream, ubatch
        return self.update()

    def cache_name(self) -> str | None:
        caches = self.watcher.mirror.caches
        if self.cache is not None:
            return self.cache
        return "base" if "base" in caches else next(iter(caches), None)

    def update(self) -> UbatchMask | None:
        self.watcher.poll()
        name = self.cache_name()
        self.mask = None if name is None else self._mask(name)
        with self.figure.batch_update():
            if self.mask is None:
                self._draw_nothing(name)
            else:
                self._draw(self.mask)
        return self.mask

    def _mask(self, name: str) -> UbatchMask | None:
        if self.ubatch is None:
            return last_ubatch_mask(self.watcher, name, self.stream)
        return next((m for m in last_decode_masks(self.watcher, name, self.stream) if m.ubatch == self.ubatch), None)

    def _draw_nothing(self, name: str | None) -> None:
        cells, holes, own, edge = self.figure.data[:4]
        cells.z, cells.text = [[EMPTY_BAND]], [["no ubatch yet"]]
        holes.x = holes.y = own.x = own.y = edge.x = edge.y = None
        where = f"cache {name}" if name else "any cache"
        text = f"no ubatch placed in {where} since this view was made: decode, then update()"
        if self.ubatch is not None:
            text = (f"no ubatch {self.ubatch} of the last decode in {where} (an earlier ubatch is drawn only in a "
                    f"cache without a sliding window)")
        self.figure.layout.title = dict(text=text, font=dict(size=12), x=0.01)
        self.figure.layout.height = 220

    def _draw(self, mask: UbatchMask) -> None:
        cells, holes, own, edge = self.figure.data[:4]
        rows = np.arange(max(0, mask.n_tokens - MAX_ROWS), mask.n_tokens)
        n_rows, n_kv = len(rows), mask.n_kv
        cell_px = float(np.clip(880 / n_kv, 3, 22))
        row_px = float(np.clip(420 / n_rows, 5, 22))
        gaps = 1 if cell_px >= 6 and row_px >= 6 else 0
        cells.z = mask_bands(mask)[rows].tolist()
        cells.x, cells.y = list(range(n_kv)), list(range(n_rows))
        cells.xgap = cells.ygap = gaps
        if n_rows * n_kv <= MAX_HOVER_SQUARES:
            cells.text, cells.hoverinfo, cells.hovertemplate = hover_texts(mask, rows), "text", None
        else:
            cells.text, cells.hovertemplate = None, "row %{y} · cell %{x}<extra></extra>"
        hole_cells = [c for c in range(n_kv) if mask.is_hole(c)]
        holes.x, holes.y = hole_cells, [n_rows] * len(hole_cells)
        placed = mask.token_cell[rows] >= 0
        own.x, own.y = mask.token_cell[rows][placed].tolist(), np.flatnonzero(placed).tolist()
        own.marker.size = max(4.0, min(cell_px, row_px) - 1)
        if mask.n_swa:
            edge.x, edge.y, edge.text = window_edges(mask, rows)
            edge.marker.size = max(4.0, row_px - 2)
        else:
            edge.x = edge.y = edge.text = None
        self.figure.data[4].marker.color = style.seq_color(int(mask.token_seq[-1]), self.dark)
        self.figure.data[6].visible = bool(mask.n_swa)
        labels = [mask.token_label(k) for k in rows.tolist()]
        show_labels = row_px >= 9
        self.figure.layout.yaxis.update(tickvals=list(range(n_rows)), ticktext=labels, range=[n_rows - 0.5, -0.5],
                                        autorange=False, showticklabels=show_labels, automargin=False)
        self.figure.layout.xaxis.update(range=[-0.5, n_kv - 0.5], autorange=False, automargin=False)
        shown = "" if n_rows == mask.n_tokens else f" (its last {n_rows} tokens shown)"
        subtitle = mask.describe_row(int(rows[-1]))
        if not mask.exact:
            subtitle = ("the cells changed since it was placed (" + ", ".join(mask.changed_since) + "): its tokens "
                        "against the cells as they are now" if mask.changed_since else "the watcher lost events")
        # the plot area is sized to the squares (kept in proportion, left-aligned, at any exported width); the
        # margins hold the labels, the title and the legend
        left = 14 + (int(7 * max(len(t) for t in labels)) if show_labels else 20)
        width = int(max(600, left + 20 + n_kv * cell_px))
        lines = textwrap.wrap(subtitle, max(60, int(width / 6.4)))
        top, bottom = 34 + 13 * len(lines), 95
        self.figure.layout.margin = dict(l=left, r=20, t=top, b=bottom)
        self.figure.layout.width = width
        self.figure.layout.height = int(top + bottom + n_rows * row_px)
        self.figure.layout.xaxis.update(constrain="domain", constraintoward="left")
        self.figure.layout.yaxis.update(scaleanchor="x", scaleratio=row_px / cell_px, constrain="domain")
        self.figure.layout.legend.update(y=-40 / (n_rows * row_px), yanchor="top")
        self.figure.layout.xaxis.title = dict(text="cell", standoff=4)
        self.figure.layout.title = dict(text=mask.title() + shown, font=dict(size=12), x=0.01, xref="container",
                                        y=1 - 6 / (top + bottom + n_rows * row_px), yref="container", yanchor="top",
                                        subtitle=dict(text="<br>".join(lines), font=dict(size=10)))
