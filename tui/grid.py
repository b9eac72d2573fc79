"""The cell grid: every stream of every cache as a lane of glyphs, one per cell (or per few cells when the
lane is wider than the screen), coloured by sequence (engine/watch/style.py), with the cursor, the head,
the cells the last frame changed, the dry run's cells, pending shifts, the cells a llama.cpp log shows shared
without naming by whom, and the selected sequence's window or attention laid over it.

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
from engine.watch.frames import EMPTY, SHARED, Frame, StreamFrame
from engine.watch.visibility import CellVisibility
from tui.fit import Part, fit
from tui.scrolling import scroll_to_lane_row

LABEL_WIDTH = 6  # "00000 " before each row: the index of its first cell
TITLE = Style(bold=True)
DIM = Style(color="#6C6C6C")
# A narrow lane title leaves out the cache's K/V types, then its layers (the rightmost of a rank goes first),
# then the head, which the cells show too.
HEAD_RANK, TITLE_DETAIL_RANK = 1, 2


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
    unnamed: np.ndarray | None = None  # per cell: shared by sequences a llama.cpp log does not name, or None
    text: np.ndarray | None = None  # the glyph of each glyph position (see _glyph_arrays)
    key: np.ndarray | None = None  # its style, as a key of _STYLES

    @property
    def n_glyphs(self) -> int:
        return len(self.folded.owner)

    @property
    def n_rows(self) -> int:
        return max(1, -(-self.n_glyphs // self.per_row))

    @property
    def n_lines(self) -> int:
        return 1 + self.n_rows


class CellGrid(ScrollView, can_focus=True, inherit_bindings=False):
    """Lanes of cells; see the module docstring. The arrows, home and end belong to the app (the cursor,
    a replay's seek): a scroll view's own bindings would scroll instead whenever the lanes overflow."""

    DEFAULT_CSS = """
    CellGrid { height: 1fr; min-height: 6; scrollbar-size-vertical: 1; overflow-x: hidden; }
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
        self._unnamed: dict[tuple[str, int], np.ndarray] = {}
        self._strips: dict[tuple, Strip] = {}  # the rows drawn since the last frame, by what they show
        self._previous_strips: dict[tuple, Strip] = {}  # those of the frame before

    # ---- what the app gives it -------------------------------------------------------------------
    def show(self, frame: Frame, titles: dict[str, str], overlays: dict[tuple[str, int], np.ndarray] | None = None,
             heat: dict[tuple[str, int], np.ndarray] | None = None,
             unnamed: dict[tuple[str, int], np.ndarray] | None = None) -> None:
        """A new frame; titles by cache name; overlays: the selected sequence's visibility codes, heat its
        attention per cell, unnamed the cells a llama.cpp log shows shared without naming by whom (the mirror's
        StreamState.uncertain), all by (cache, stream)."""
        self._frame, self._titles = frame, titles
        self._overlays, self._heat, self._unnamed = overlays or {}, heat or {}, unnamed or {}
        self._previous_strips, self._strips = self._strips, {}
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
            key = (sf.cache, sf.stream)
            lane = Lane(sf.cache, sf.stream, self._lane_title(sf, folded), sf, folded, per_row, line,
                        self._overlays.get(key), self._heat.get(key), self._unnamed.get(key))
            lane.text, lane.key = _glyph_arrays(lane)
            lanes.append(lane)
            line += lane.n_lines
        self.lanes = lanes
        lane, glyph = self.cursor
        lane = min(lane, len(lanes) - 1) if lanes else 0
        self.cursor = (lane, min(glyph, lanes[lane].n_glyphs - 1) if lanes else 0)
        self.virtual_size = Size(self.size.width, line)
        self.refresh()

    def _lane_title(self, sf: StreamFrame, folded: style.Folded) -> str:
        """The cache's title, the stream, how full it is and where its head is, fitted to the width."""
        name, *details = self._titles.get(sf.cache, sf.cache).split(" · ")  # name · window · layers · types
        parts = [Part(name), *(Part(d) if k == 0 else Part(d, rank=TITLE_DETAIL_RANK) for k, d in enumerate(details))]
        parts += [Part(f"s{sf.stream}"), Part(f"{sf.used}/{sf.size}"), Part(f"head {sf.head}", rank=HEAD_RANK)]
        if folded.cells_per_glyph > 1:
            parts.append(Part(f"{folded.cells_per_glyph} cells per glyph"))
        return fit(parts, self.size.width - 1).plain  # - 1: the scrollbar's column, whether it shows or not

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
        scroll_to_lane_row(self, lane.first_line, self.cursor[1] // lane.per_row)

    # ---- drawing ---------------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        line = y + int(self.scroll_offset.y)
        width = self.scrollable_content_region.width
        # the theme's background under every segment: a Line API widget is otherwise drawn on the
        # terminal's default background, dark under a light theme
        base = self.rich_style
        for k, lane in enumerate(self.lanes):
            if lane.first_line <= line < lane.first_line + lane.n_lines:
                row = line - lane.first_line - 1
                strip = (Strip([Segment(lane.title[:width], base + TITLE)]) if row < 0
                         else self._row_strip(k, lane, row, base))
                return strip.extend_cell_length(width, base)
        return Strip.blank(width, base)

    def _row_strip(self, k: int, lane: Lane, row: int, base: Style) -> Strip:
        lo = row * lane.per_row
        hi = min(lo + lane.per_row, lane.n_glyphs)
        text, key = lane.text[lo:hi], lane.key[lo:hi].copy()
        cursor = self.cursor[1] - lo if self.cursor[0] == k else -1
        if 0 <= cursor < len(key):
            key[cursor] |= CURSOR_BIT
        # Most rows look as they did in the previous frame: reuse their strips (keyed by what they show)
        label = int(lane.folded.start[lo])
        seen = (label, base, key.tobytes(), text.tobytes())
        strip = self._strips.get(seen) or self._previous_strips.get(seen)
        if strip is None:
            strip = self._build_row(label, text, key, base)
        self._strips[seen] = strip
        return strip

    def _build_row(self, label: int, text: np.ndarray, key: np.ndarray, base: Style) -> Strip:
        segments = [Segment(f"{label:>5} ", base + DIM)]
        # one segment per run of equal style: a row is a few runs, not a glyph each
        bounds = np.flatnonzero(key[1:] != key[:-1]) + 1
        starts = np.r_[0, bounds]
        ends = np.r_[bounds, len(key)]
        dark, background = self.app.current_theme.dark, base.bgcolor
        for a, b in zip(starts.tolist(), ends.tolist()):
            segments.append(Segment("".join(text[a:b].tolist()), _style(int(key[a]), dark, background)))
        return Strip(segments)


# ---- glyphs as arrays: one numpy pass per lane and frame -----------------------------------------------
# A style key packs: colour index (sequence palette, then SHARED, EMPTY) | flag bits | heat level
COLOURS = {dark: (*style.palette(dark), style.owner_color(SHARED, dark), style.owner_color(EMPTY, dark))
           for dark in (True, False)}  # by theme: dark or light background
SHARED_INDEX, EMPTY_INDEX = len(style.PALETTE), len(style.PALETTE) + 1
CHANGED_BIT, DIM_BIT, HEAD_BIT, CURSOR_BIT = 1 << 4, 1 << 5, 1 << 6, 1 << 7
HEAT_SHIFT, HEAT_LEVELS = 8, 8
# A cell its sequence fills (█) would hide the attention background: under attention, half of it is left to the
# background, the other half keeps the sequence's colour.
ATTENTION_GLYPH = "▄"
_STYLES: dict[tuple, Style] = {}


def _style(key: int, dark: bool = True, background=None) -> Style:
    """The style of a glyph's key on a dark or light theme whose background is `background`."""
    found = _STYLES.get((key, dark, background))
    if found is None:
        heat = key >> HEAT_SHIFT
        bgcolor = heat_color(heat) if heat else (style.HEAD_COLOR if key & HEAD_BIT else background)
        found = _STYLES[(key, dark, background)] = Style(color=COLOURS[dark][key & 0xF], bgcolor=bgcolor,
                                             bold=bool(key & CHANGED_BIT), underline=bool(key & CHANGED_BIT),
                                             dim=bool(key & DIM_BIT), reverse=bool(key & CURSOR_BIT))
    return found


def _glyph_arrays(lane: Lane) -> tuple[np.ndarray, np.ndarray]:
    """Each glyph's character and style key, for the whole lane at once."""
    f = lane.folded
    owner = f.owner.astype(np.int64)
    one = f.cells_per_glyph == 1
    colour = np.where(owner == SHARED, SHARED_INDEX, np.where(owner == EMPTY, EMPTY_INDEX, owner % len(style.PALETTE)))
    if one:
        text = np.where(owner == SHARED, style.GLYPH_SHARED, np.where(owner == EMPTY, style.GLYPH_EMPTY,
                                                                       style.GLYPH_ONE))
        shift = lane.frame.shift
        text = np.where(shift > 0, "»", np.where(shift < 0, "«", text))
        if lane.unnamed is not None and len(lane.unnamed) == len(text):
            text = np.where(lane.unnamed & (owner != EMPTY), style.GLYPH_SHARED_UNNAMED, text)
    else:
        levels = np.array(style.OCCUPANCY_GLYPHS)
        text = levels[np.where(f.occupancy <= 0, 0, np.minimum(4, 1 + (f.occupancy * 4 - 1e-9).astype(int)))]
    text = np.where(f.tentative, style.GLYPH_TENTATIVE, text)
    text = np.where(f.quirk, style.GLYPH_QUIRK, text)
    key = colour + np.where(f.changed, CHANGED_BIT, 0)
    if lane.codes is not None and one:
        masked = lane.codes == CellVisibility.MASKED
        text = np.where(masked, "╳", text)
        unseen = masked | (((lane.codes == CellVisibility.OTHER) | (lane.codes == CellVisibility.EMPTY)) & (owner != EMPTY))
        key = key + np.where(unseen, DIM_BIT, 0)
    if f.head < len(key):
        key[f.head] |= HEAD_BIT
    if lane.heat is not None and one:
        level = np.minimum(HEAT_LEVELS - 1, np.ceil(np.sqrt(np.clip(lane.heat, 0, 1)) * (HEAT_LEVELS - 1))).astype(int)
        key = key + (level << HEAT_SHIFT)
        text = np.where((level > 0) & (text == style.GLYPH_ONE), ATTENTION_GLYPH, text)
    return text.astype("<U1"), key.astype(np.int64)


def heat_color(level: int) -> str:
    """Attention as a background, from dark to a warm red; levels follow the square root of the weight,
    so that small weights still show."""
    red = 40 + 200 * level // (HEAT_LEVELS - 1)
    return f"rgb({red},{red // 4},{red // 6})"
