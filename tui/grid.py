"""The cell grid: every stream of every cache as a lane of glyphs, one per cell (or per few cells when the
lane is wider than the screen), coloured by sequence (engine/watch/style.py), with the cursor, the head,
the cells the last frame changed, the dry run's cells, pending shifts, and the selected sequence's window
or attention laid over it.

Line API: only the visible lines are built, from arrays kept per lane; a redraw costs the visible glyphs,
not the cache's size (bench/tui_frame.py measures it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from engine.watch import style
from engine.watch.frames import EMPTY, Frame, StreamFrame
from engine.watch.visibility import CellVisibility

LABEL_WIDTH = 6  # "00000 " before each row: the index of its first cell
TITLE = Style(bold=True)
DIM = Style(color="#6C6C6C")
CURSOR = Style(reverse=True)


@dataclass
class Lane:
    """One stream of one cache, folded for the current width and zoom."""

    cache: str
    stream: int
    title: str
    frame: StreamFrame
    folded: style.Folded
    per_row: int  # glyphs per row
    first_line: int  # its title's line in the grid
    codes: np.ndarray | None = None  # CellVisibility per cell for the selected sequence, or None
    heat: np.ndarray | None = None  # attention weight per cell, or None

    @property
    def n_glyphs(self) -> int:
        return len(self.folded.owner)

    @property
    def n_rows(self) -> int:
        return max(1, -(-self.n_glyphs // self.per_row))

    @property
    def n_lines(self) -> int:
        return 1 + self.n_rows


class CellGrid(ScrollView, can_focus=True):
    """Lanes of cells; see the module docstring."""

    DEFAULT_CSS = """
    CellGrid { height: 1fr; min-height: 6; scrollbar-size-vertical: 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lanes: list[Lane] = []
        self.zoom = 1  # cells per glyph at least (more when a lane would not fit its rows)
        self.cursor = (0, 0)  # (lane, glyph)
        self._frame: Frame | None = None
        self._titles: dict[str, str] = {}
        self._overlays: dict[tuple[str, int], np.ndarray] = {}
        self._heat: dict[tuple[str, int], np.ndarray] = {}

    # ---- what the app gives it -------------------------------------------------------------------
    def show(self, frame: Frame, titles: dict[str, str], overlays: dict[tuple[str, int], np.ndarray] | None = None,
             heat: dict[tuple[str, int], np.ndarray] | None = None) -> None:
        """A new frame; titles by cache name; overlays: the selected sequence's visibility codes and heat
        its attention per cell, both by (cache, stream)."""
        self._frame, self._titles = frame, titles
        self._overlays, self._heat = overlays or {}, heat or {}
        self._layout()

    def set_zoom(self, zoom: int) -> None:
        self.zoom = max(1, zoom)
        self._layout()

    def _layout(self) -> None:
        if self._frame is None:
            return
        room = self.size.width - LABEL_WIDTH - 1
        per_row = max(8, room // 16 * 16 if room >= 16 else room)  # rows of whole 16s: positions read easily
        lanes, line = [], 0
        for sf in self._frame.streams:
            folded = style.fold(sf, -(-sf.size // self.zoom))
            lane = Lane(sf.cache, sf.stream, self._lane_title(sf, folded), sf, folded, per_row, line,
                        self._overlays.get((sf.cache, sf.stream)), self._heat.get((sf.cache, sf.stream)))
            lanes.append(lane)
            line += lane.n_lines
        self.lanes = lanes
        lane, glyph = self.cursor
        lane = min(lane, len(lanes) - 1) if lanes else 0
        self.cursor = (lane, min(glyph, lanes[lane].n_glyphs - 1) if lanes else 0)
        self.virtual_size = Size(self.size.width, line)
        self.refresh()

    def _lane_title(self, sf: StreamFrame, folded: style.Folded) -> str:
        fold = f" · {folded.cells_per_glyph} cells per glyph" if folded.cells_per_glyph > 1 else ""
        return f"{self._titles.get(sf.cache, sf.cache)} · s{sf.stream} · {sf.used}/{sf.size} used · head {sf.head}{fold}"

    def on_resize(self) -> None:
        self._layout()

    # ---- the cursor ------------------------------------------------------------------------------
    def move_cursor(self, d_glyph: int = 0, d_row: int = 0, d_lane: int = 0) -> None:
        if not self.lanes:
            return
        lane, glyph = self.cursor
        if d_lane:
            lane = (lane + d_lane) % len(self.lanes)
            glyph = min(glyph, self.lanes[lane].n_glyphs - 1)
        n = self.lanes[lane].n_glyphs
        glyph = min(max(glyph + d_glyph + d_row * self.lanes[lane].per_row, 0), n - 1)
        self.cursor = (lane, glyph)
        self._scroll_to_cursor()
        self.refresh()

    def click_cell(self, x: int, y: int) -> bool:
        """Put the cursor on the glyph at widget coordinates (x, y); False when there is none."""
        line = y + int(self.scroll_offset.y)
        for k, lane in enumerate(self.lanes):
            row = line - lane.first_line - 1
            if 0 <= row < lane.n_rows and x >= LABEL_WIDTH:
                glyph = row * lane.per_row + (x - LABEL_WIDTH)
                if glyph < lane.n_glyphs and x - LABEL_WIDTH < lane.per_row:
                    self.cursor = (k, glyph)
                    self.refresh()
                    return True
        return False

    def cursor_cells(self) -> tuple[Lane, int, int] | None:
        """The lane under the cursor and the cells [first, last) its glyph covers."""
        if not self.lanes:
            return None
        lane = self.lanes[self.cursor[0]]
        start = lane.folded.start
        return lane, int(start[self.cursor[1]]), int(start[self.cursor[1] + 1])

    def _scroll_to_cursor(self) -> None:
        lane = self.lanes[self.cursor[0]]
        line = lane.first_line + 1 + self.cursor[1] // lane.per_row
        top, height = int(self.scroll_offset.y), self.size.height
        if line < top + 1:
            self.scroll_to(y=max(0, line - 1), animate=False)
        elif line >= top + height:
            self.scroll_to(y=line - height + 1, animate=False)

    # ---- drawing ---------------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        line = y + int(self.scroll_offset.y)
        for k, lane in enumerate(self.lanes):
            if lane.first_line <= line < lane.first_line + lane.n_lines:
                row = line - lane.first_line - 1
                strip = (Strip([Segment(lane.title[:self.size.width], TITLE)]) if row < 0
                         else self._row_strip(k, lane, row))
                return strip.extend_cell_length(self.size.width)
        return Strip.blank(self.size.width)

    def _row_strip(self, k: int, lane: Lane, row: int) -> Strip:
        lo = row * lane.per_row
        hi = min(lo + lane.per_row, lane.n_glyphs)
        segments = [Segment(f"{int(lane.folded.start[lo]):>5} ", DIM)]
        cursor = self.cursor[1] if self.cursor[0] == k else -1
        run_text, run_style = [], None
        for g in range(lo, hi):
            text, glyph_style = self._glyph(lane, g)
            if g == cursor:
                glyph_style = glyph_style + CURSOR
            if glyph_style != run_style and run_text:
                segments.append(Segment("".join(run_text), run_style))
                run_text = []
            run_text.append(text)
            run_style = glyph_style
        if run_text:
            segments.append(Segment("".join(run_text), run_style))
        return Strip(segments)

    def _glyph(self, lane: Lane, g: int) -> tuple[str, Style]:
        f = lane.folded
        owner = int(f.owner[g])
        if f.cells_per_glyph == 1:
            text = style.owner_glyph(owner)
        else:
            text = style.occupancy_glyph(float(f.occupancy[g]))
        color = style.owner_color(owner)
        bold = underline = False
        if f.tentative[g]:
            text = style.GLYPH_TENTATIVE
        if f.changed[g]:
            bold = underline = True
        if f.shifted[g] and f.cells_per_glyph == 1:
            text = "»" if lane.frame.shift[g] > 0 else "«"
        bgcolor = style.HEAD_COLOR if g == f.head else None
        dim = False
        if lane.codes is not None and f.cells_per_glyph == 1:
            code = lane.codes[g]
            if code == CellVisibility.MASKED:
                text, dim = "╳", True
            elif code in (CellVisibility.OTHER, CellVisibility.EMPTY) and owner != EMPTY:
                dim = True
        if lane.heat is not None and f.cells_per_glyph == 1 and lane.heat[g] > 0:
            bgcolor = _heat_color(float(lane.heat[g]))
        return text, Style(color=color, bgcolor=bgcolor, bold=bold, underline=underline, dim=dim)


def _heat_color(weight: float) -> str:
    """Attention as a background: from dark to a warm red as the weight grows (square root: small
    weights still show)."""
    level = int(40 + 200 * min(1.0, weight) ** 0.5)
    return f"rgb({level},{level // 4},{level // 6})"
