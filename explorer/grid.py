"""Cell grids as plotly heatmaps: one panel per cache stream, a cell per square coloured by sequence.

Each panel is a heatmap of `columns` cells a row; its colour scale has one band per palette colour
(sequence s: band s % 12), then "several sequences" and "empty", as engine/watch/style.py defines them
for both explorers. Hovering a cell gives its index, position, sequences, pending shift and the last
thing that happened to it (the watch layer's cell history). Markers show the head (where the next slot
search starts), the cells changed since the previous update, those the last decode's dry run touched,
(a red !) those an event touched that reproduces a llama.cpp QUIRK (the event log says which), and (the
terminal explorer's ▚) those a real llama.cpp's log shows shared without naming by whom.
With a sequence selected, its cells outside the sliding window are crossed, and (attention=True, on a
session made with publish_attention) the weight its last token gave each cell is laid over the grid in
red, per layer or averaged over the cache's layers.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import events as ev
from engine.watch import style
from engine.watch.attention import AttentionWatch
from engine.watch.describe import cache_title, position_text, unnamed_sharers_text
from engine.watch.frames import EMPTY, SHARED, Frame, FrameReader, StreamFrame
from engine.watch.visibility import CellVisibility, SequenceVisibility, visibility
from engine.watch.watcher import Watcher
from explorer.view import WatcherView

SHARED_BAND, EMPTY_BAND = len(style.PALETTE), len(style.PALETTE) + 1
CELLS, ATTENTION, CHANGED, DRY_RUN, QUIRK, HEAD, MASKED, UNNAMED = range(8)  # each lane's traces, in this order
TRACES_PER_LANE = 8
# Cells are drawn apart (a 1-pixel gap) up to this many per lane; beyond, they are a few pixels wide and
# gaps would hide a quarter of them, and the browser draws a heatmap with gaps three times slower.
GAPS_UP_TO_CELLS = 4096
ATTENTION_COLORSCALE = [[0.0, "rgba(214,39,40,0)"], [1.0, "rgba(214,39,40,0.9)"]]  # none: see-through
N_BANDS = len(style.PALETTE) + 2


def colour_bands(owner: np.ndarray) -> np.ndarray:
    """The colour band of each cell: its sequence's palette index, SHARED_BAND or EMPTY_BAND."""
    owner = owner.astype(np.int64)
    return np.where(owner == SHARED, SHARED_BAND, np.where(owner == EMPTY, EMPTY_BAND, owner % len(style.PALETTE)))


def band_colorscale(dark: bool = True) -> list[list]:
    """A plotly colour scale with a flat band per colour, for z in [-0.5, N_BANDS - 0.5]."""
    colours = [*style.palette(dark), style.owner_color(SHARED, dark), style.EMPTY_FILL[dark]]
    scale = []
    for k, colour in enumerate(colours):
        scale += [[k / N_BANDS, colour], [(k + 1) / N_BANDS, colour]]
    return scale


def as_gapped_rows(values: np.ndarray, columns: int) -> np.ndarray:
    """Heatmap z as rows of `columns`: NaN (no value) and the last row's padding become None, a gap plotly draws
    as nothing. Not NaN itself: a notebook sends a FigureWidget's data as strict JSON, which has no NaN, and
    refuses the redraw ("Out of range float values are not JSON compliant")."""
    rows = as_rows(np.asarray(values, dtype=float), columns, np.nan)
    return np.where(np.isnan(rows), None, rows.astype(object))


def as_rows(values: np.ndarray, columns: int, fill) -> np.ndarray:
    """A lane's per-cell values as rows of `columns`, the last row padded with `fill`."""
    rows = max(1, math.ceil(len(values) / columns))
    out = np.full(rows * columns, fill, dtype=object if isinstance(fill, str) or fill is None else float)
    out[:len(values)] = values
    return out.reshape(rows, columns)


class CellGrid(WatcherView):
    """The cell grids of a watcher's caches as a plotly figure; update() polls and redraws."""

    def __init__(self, watcher: Watcher, *, columns: int = 64, dark: bool = False, widget: bool = True,
                 attention: bool = False, attention_layer: int | None = None,
                 caches: tuple[str, ...] | None = None) -> None:
        """columns: cells per row; dark: colours for a dark page (JupyterLab's default theme is light);
        widget: a FigureWidget (live in a notebook) or a plain Figure (for export and tests); attention:
        lay the selected sequence's attention over the grid (attention_layer: one model layer's, None:
        the mean over the layers of each cache); caches: draw only these caches' lanes (None: every cache),
        e.g. ("base",) where an iSWA pair with swa_full holds the same cells twice."""
        self.watcher, self.columns, self.dark = watcher, columns, dark
        self.caches = None if caches is None else tuple(caches)
        # this grid's own marks (other views of the watcher keep theirs), from whichever watcher it shows now:
        # a timeline swaps in its replay's and back
        self._frames = FrameReader(lambda: self.watcher.frames)
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        self._lanes: tuple[tuple[str, int, int], ...] = ()  # (cache, stream, size) the figure is laid out for
        self._hover: dict[tuple[str, int], np.ndarray] = {}  # per lane: the hover text of every cell
        self._hover_unnamed: dict[tuple[str, int], np.ndarray] = {}  # per lane: the unnamed-sharer marks hovered
        self.selected_seq: int | None = None  # whose window (SWA visibility) is drawn
        self.attention_on, self.attention_layer = attention, attention_layer
        self.attention = AttentionWatch()
        self._events_seen = 0  # the watcher's event count when its recent events were last read
        self._marked = True  # the last drawing showed marks (changed, dry run, QUIRK) a redraw must clear
        self._drawn_for: tuple = ()  # the selection and attention settings the figure was drawn for
        # called with (cache, stream, cell) when a cell is clicked in the notebook (a FigureWidget only)
        self.on_cell_click: Callable[[str, int, int], None] | None = None
        self.update()

    def show_attention(self, on: bool = True, layer: int | None = None) -> Frame:
        """Lay the selected sequence's attention over the grid (layer None: averaged per cache), or not."""
        self.attention_on, self.attention_layer = on, layer
        return self.update()

    def forget(self) -> None:
        self._hover, self._hover_unnamed = {}, {}
        self._drawn_for = ()
        self.attention = AttentionWatch()
        self._events_seen = 0
        self._read_attention()

    def select(self, seq_id: int | None) -> Frame:
        """Show what the next token of `seq_id` sees (None: no sequence): its cells outside the sliding
        window are crossed, and each panel's title says how many cells it attends to."""
        self.selected_seq = seq_id
        return self.update()

    def update(self) -> Frame:
        """Apply what arrived, then redraw: the figure's layout only when the caches changed shape."""
        self.watcher.poll()
        new_attention = self._read_attention()
        frame = self._frames.frame()
        if self.caches is not None:
            frame = Frame(frame.seq_no, tuple(sf for sf in frame.streams if sf.cache in self.caches))
        lanes = tuple((sf.cache, sf.stream, sf.size) for sf in frame.streams)
        laid_out = lanes != self._lanes
        if laid_out:
            self._lay_out(frame)
        marked = any(sf.changed.any() or sf.tentative.any() or sf.quirk.any() for sf in frame.streams)
        drawn_for = (self.selected_seq, self.attention_on, self.attention_layer)
        if not (laid_out or marked or self._marked or drawn_for != self._drawn_for
                or (new_attention and self.attention_on)):
            return frame  # the figure already shows this: nothing to send to the browser
        self._marked, self._drawn_for = marked, drawn_for
        seen = self._visibility()
        with self.figure.batch_update():
            for k, sf in enumerate(frame.streams):
                self._draw_lane(k, sf, seen)
        return frame

    def _clicked(self, lane: tuple[str, int], points) -> None:
        if self.on_cell_click is not None and points.xs:
            self.on_cell_click(lane[0], lane[1], int(points.ys[0]) * self.columns + int(points.xs[0]))

    def cell_seqs(self, cache: str, stream: int, cell: int) -> list[int]:
        """The sequences a cell holds (what a click on it selects: the first)."""
        streams = self.watcher.mirror.caches[cache].streams
        if not (0 <= stream < len(streams) and 0 <= cell < len(streams[stream].pos)):
            return []
        return np.flatnonzero(np.unpackbits(streams[stream].seq_bits[cell], bitorder="little")).tolist()

    def width(self) -> int:
        """The figure's width in pixels: square-ish cells of 18 pixels up to 48 columns, narrower beyond
        (a notebook's output area is about 1000 pixels wide)."""
        return 50 + self.columns * (18 if self.columns <= 48 else max(4, 1000 // self.columns))

    def trace(self, lane: int, which: int):
        """One of a lane's traces: CELLS, ATTENTION, CHANGED, DRY_RUN, QUIRK, HEAD or MASKED."""
        return self.figure.data[TRACES_PER_LANE * lane + which]

    def _read_attention(self) -> int:
        """The attention events among those the watcher received since the last look (whoever polled it);
        how many there were."""
        new = self.watcher.events_since(self._events_seen)
        self._events_seen = self.watcher.events
        taken = 0
        for event in new:
            if isinstance(event, (ev.AttentionWeights, ev.ContextCreated)):
                self.attention.apply(event)
                taken += 1
        return taken

    def _weights(self, sf: StreamFrame) -> np.ndarray | None:
        if not self.attention_on or self.selected_seq is None:
            return None
        try:
            weights = self.attention.weights(self.selected_seq, sf.cache, sf.stream, self.attention_layer)
        except (KeyError, ValueError):
            return None
        return weights if weights.any() else None

    def _visibility(self) -> SequenceVisibility | None:
        if self.selected_seq is None or not self.watcher.mirror.caches:
            return None
        try:
            return visibility(self.watcher.mirror, self.selected_seq)
        except ValueError:
            return None  # the sequence holds no cell (yet, or any more)

    # ---- drawing ----------------------------------------------------------------------------------
    def _lay_out(self, frame: Frame) -> None:
        self._lanes = tuple((sf.cache, sf.stream, sf.size) for sf in frame.streams)
        self._hover, self._hover_unnamed = {}, {}
        n = max(1, len(frame.streams))
        rows = [max(1, math.ceil(sf.size / self.columns)) for sf in frame.streams] or [1]
        height = 60 + 20 * sum(rows) + 50 * n
        layout = make_subplots(rows=n, cols=1, row_heights=[r / sum(rows) for r in rows],
                               vertical_spacing=min(0.3, 45 / height) if n > 1 else 0.0,
                               subplot_titles=[self._title(sf) for sf in frame.streams] or [""])
        self.figure.data = []
        self.figure.layout = layout.layout
        for k, sf in enumerate(frame.streams):
            # traces name their panel's axes: a FigureWidget shown in a notebook must stay the same object,
            # so the subplot layout is copied into it rather than the figure replaced
            axes = dict(xaxis=f"x{k + 1}" if k else "x", yaxis=f"y{k + 1}" if k else "y")
            gap = 1 if sf.size <= GAPS_UP_TO_CELLS else 0
            self.figure.add_traces([
                go.Heatmap(z=as_gapped_rows(colour_bands(sf.owner), self.columns), zmin=-0.5, zmax=N_BANDS - 0.5,
                           colorscale=band_colorscale(self.dark), showscale=False, xgap=gap, ygap=gap,
                           # the cell index travels as numbers (sent once, in binary), the text only says what
                           # a cell holds: hover texts are most of what each redraw sends to the browser
                           customdata=as_rows(np.arange(sf.size), self.columns, -1).astype(np.int32),
                           hovertemplate=f"{sf.cache} stream {sf.stream} · cell %{{customdata}}<br>%{{text}}<extra></extra>",
                           name=f"{sf.cache} s{sf.stream}", **axes),
                go.Heatmap(z=None, zmin=0, zmax=1, xgap=gap,
                           ygap=gap, colorscale=ATTENTION_COLORSCALE, showscale=False, name="attention",
                           hoverinfo="skip", **axes),
                go.Scatter(mode="markers", name="changed", showlegend=k == 0, hoverinfo="skip", **axes,
                           marker=dict(symbol="square-open", size=9, color="#D55E00")),
                go.Scatter(mode="text", name="dry run", showlegend=k == 0, hoverinfo="skip", text=[], **axes,
                           textfont=dict(color="#CC79A7")),
                go.Scatter(mode="text", name="QUIRK (llama.cpp's, reproduced)", showlegend=k == 0, hoverinfo="skip",
                           text=[], textfont=dict(color=style.QUIRK_COLOR, size=13), **axes),
                go.Scatter(mode="markers", name="head", showlegend=k == 0, hoverinfo="skip", **axes,
                           marker=dict(symbol="triangle-down", size=10, color=style.HEAD_COLOR)),
                go.Scatter(mode="markers", name="outside the window", showlegend=k == 0, hoverinfo="skip", **axes,
                           marker=dict(symbol="x-thin-open", size=9, color="#222222", line=dict(width=2))),
                # a llama.cpp log's 'M' cells: shared, by sequences it does not name (the legend shows it when any is)
                go.Scatter(mode="text", name=f"{style.GLYPH_SHARED_UNNAMED} shared, by whom the log does not say",
                           showlegend=False, hoverinfo="skip", text=[], **axes,
                           # over the shared colour (white on a dark page, near black on a light one): its opposite
                           textfont=dict(color="#000000" if self.dark else "#FFFFFF", size=13))])
            if isinstance(self.figure, go.FigureWidget):
                self.figure.data[-TRACES_PER_LANE].on_click(
                    lambda _trace, points, _state, lane=(sf.cache, sf.stream): self._clicked(lane, points))
            suffix = str(k + 1) if k else ""
            n_rows = max(1, math.ceil(sf.size / self.columns))
            step = max(1, n_rows // 8)  # the first cell of every few rows, as the terminal explorer labels rows
            # fixed ranges: markers at the edges must not pad one lane narrower than another
            self.figure.layout[f"yaxis{suffix}"].update(
                range=[n_rows - 0.5, -0.5], autorange=False, showgrid=False, zeroline=False, tickvals=list(range(0, n_rows, step)),
                ticktext=[str(r * self.columns) for r in range(0, n_rows, step)], tickfont=dict(size=9))
            self.figure.layout[f"xaxis{suffix}"].update(range=[-0.5, self.columns - 0.5], autorange=False,
                                                         showticklabels=False, showgrid=False, zeroline=False)
        self.figure.update_layout(height=height + 30, width=self.width(), margin=dict(l=40, r=10, t=50, b=40),
                                  plot_bgcolor="rgba(0,0,0,0)",
                                  legend=dict(orientation="h", x=0, xanchor="left", y=0, yanchor="top"))

    def _draw_lane(self, k: int, sf: StreamFrame, seen: SequenceVisibility | None) -> None:
        heatmap, attention, changed, dry_run, quirk, head, masked, unnamed = \
            self.figure.data[TRACES_PER_LANE * k:TRACES_PER_LANE * (k + 1)]
        heatmap.z = as_gapped_rows(colour_bands(sf.owner), self.columns)
        weights = self._weights(sf)
        # the square root, as the terminal explorer shades it: a few strong cells do not hide the rest
        attention.z = as_gapped_rows(np.where(weights > 0, np.sqrt(weights / weights.max()), np.nan), self.columns) \
            if weights is not None else None
        texts, renewed = self._hover_texts(sf)
        if renewed:
            heatmap.text = as_rows(texts, self.columns, "")
        window = seen.caches.get(sf.cache) if seen is not None else None
        if window is not None and window.stream != sf.stream:
            window = None
        masked.x, masked.y = self._xy(window.cells(CellVisibility.MASKED) if window is not None
                                      else np.array([], dtype=np.int64))
        self.figure.layout.annotations[k].text = self._title(sf) + (f"<br>{window.describe()}" if window else "")
        x, y = self._xy(np.flatnonzero(sf.changed))
        changed.x, changed.y = x, y
        x, y = self._xy(np.flatnonzero(sf.tentative & ~sf.quirk))  # a QUIRK's ! takes the place of the dry run's ?
        dry_run.x, dry_run.y, dry_run.text = x, y, [style.GLYPH_TENTATIVE] * len(x)
        x, y = self._xy(np.flatnonzero(sf.quirk))
        quirk.x, quirk.y, quirk.text = x, y, [style.GLYPH_QUIRK] * len(x)
        head.x, head.y = self._xy(np.array([sf.head] if sf.head < sf.size else [], dtype=np.int64))
        x, y = self._xy(np.flatnonzero(self._unnamed(sf) & (sf.pos >= 0)))
        unnamed.x, unnamed.y, unnamed.text = x, y, [style.GLYPH_SHARED_UNNAMED] * len(x)
        if x and not unnamed.showlegend and not any(t.showlegend for t in self.figure.data[UNNAMED::TRACES_PER_LANE]):
            unnamed.showlegend = True  # once, on the first lane that has any

    def _unnamed(self, sf: StreamFrame) -> np.ndarray:
        """Per cell: shared by sequences a llama.cpp log does not name (the mirror's StreamState.uncertain)."""
        st = self.watcher.mirror.caches[sf.cache].streams[sf.stream]
        if st.uncertain is None or len(st.uncertain) != sf.size:
            return np.zeros(sf.size, dtype=bool)
        return st.uncertain.copy()

    def _xy(self, cells: np.ndarray) -> tuple[list[int], list[int]]:
        return (cells % self.columns).tolist(), (cells // self.columns).tolist()

    def _hover_texts(self, sf: StreamFrame) -> tuple[np.ndarray, bool]:
        """Every cell's hover text, and whether any was renewed: only the cells changed since the last
        update are described anew (the others' texts need not be sent again)."""
        key = (sf.cache, sf.stream)
        texts = self._hover.get(key)
        unnamed = self._unnamed(sf)
        before = self._hover_unnamed.get(key)
        # a log may name a cell's sequences later without changing what the frame draws: its text changes then
        redo = np.arange(sf.size) if texts is None else np.flatnonzero(
            sf.changed | (unnamed != before if before is not None and len(before) == sf.size else False))
        self._hover_unnamed[key] = unnamed
        if texts is None:
            texts = self._hover[key] = np.empty(sf.size, dtype=object)
        for cell in redo.tolist():
            texts[cell] = self.describe_cell(sf, cell)
        return texts, len(redo) > 0

    def describe_cell(self, sf: StreamFrame, cell: int) -> str:
        """What hovering a cell says besides its index: what it holds, a pending shift, its latest history."""
        pos = int(sf.pos[cell])
        lines = self.watcher.history.lines(sf.cache, sf.stream, cell)
        if pos < 0:
            text = "empty"
        else:
            st = self.watcher.mirror.caches[sf.cache].streams[sf.stream]
            seqs = np.flatnonzero(np.unpackbits(st.seq_bits[cell], bitorder="little")).tolist()
            if st.uncertain is not None and st.uncertain[cell]:  # as the terminal explorer's inspector says it
                text = f"{position_text(pos)} · {unnamed_sharers_text(seqs, int(st.uncertain[cell]))}"
            else:
                text = f"{position_text(pos)} · seq {', '.join(map(str, seqs))}"
            if sf.shift[cell]:
                text += f" · pending shift {int(sf.shift[cell]):+d}"
        return text + "<br>" + lines[0] if lines else text

    def _title(self, sf: StreamFrame) -> str:
        created = self.watcher.mirror.created.get(sf.cache)
        cache = cache_title(created) if created is not None else sf.cache
        return f"{cache} · stream {sf.stream} · {sf.used}/{sf.size} cells · head {sf.head}"
