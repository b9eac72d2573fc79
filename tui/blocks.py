"""The block views: a vLLM / SGLang deployment's prefix caches, watched from its KV events (a source of kind
"kv-events"), in the terminal. Every word and glyph comes from engine/watch/block_views.py, which the notebook
shares; here they are laid out:

    BlockLanes      per worker its summary line, then a lane per medium and KV cache group: one glyph per block,
                    coloured by prefix, the capacity as empty dots; the cursor, which follows its block
    BlockInspector  the block under the cursor, in a sentence (and what a folded glyph covers)
    LinesPanel      lines with a swatch of their prefix's colour: the selected worker's prefix tree, the
                    router's view, the eviction log
    BlockCommands   the command palette's entries for these views
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from engine import events as ev
from engine.watch import block_views as bv
from engine.watch.block_mirror import BlockMirror
from engine.watch.kv_events.formats import hash_text
from tui.commands import ListedCommands
from tui.fit import Part, fit
from tui.scrolling import scroll_to_lane_row
from tui.text_panel import TextPanel

INDENT = 1  # columns before a lane's glyphs
MAX_ROWS_PER_LANE = 8  # a lane takes at most this many rows; beyond, its glyphs fold
DIM = Style(color="#8A8A8A")
SWATCH = "█ "
SUMMARY_RANKS = {"name": 0, "held": 0, "tier": 5, "rate": 2, "warning": 1, "unseen": 3}  # by worker_summary_parts' kinds
ADDRESS_RANK = 4  # "(rank 1 at h:5558)" after a worker's name


@dataclass
class ShownLane:
    """A lane as laid out: its glyph model (block_views.BlockLane), its rows, and what each glyph looks like."""

    lane: bv.BlockLane
    first_line: int  # its title's line
    per_row: int
    new: list[bool] = field(default_factory=list)  # per glyph: it covers a block stored since the last layout

    @property
    def n_rows(self) -> int:
        return max(1, -(-self.lane.n_glyphs // self.per_row))


@dataclass
class LaneLayout:
    """Every worker's lanes laid out for a size: what BlockLanes draws. Worked out from the mirror by lay_out(),
    which may run on a thread of its own (it sorts every block held), and shown by BlockLanes.show()."""

    width: int  # the widget's, when laid out
    lanes: list[ShownLane]
    lines: list[tuple]  # per line: ("summary", worker) | ("title", lane) | ("row", lane, row)
    summaries: dict[int, list[tuple[str, str]]]  # worker -> its worker_summary_parts
    held: dict[tuple[int, str, int], set[bytes]]  # (worker, medium, group) -> the blocks it holds: the next "new"


def lay_out(mirror: BlockMirror, width: int, height: int,
            held_before: dict[tuple[int, str, int], set[bytes]] | None = None) -> LaneLayout:
    """The lanes of a widget `width` x `height` cells: per worker its summary line, then per tier a title and as
    many rows as the height shares out (MAX_ROWS_PER_LANE at most), a lane folded to fit its rows; glyphs whose
    blocks `held_before` lacks are marked new."""
    per_row = max(8, width - INDENT - 1)  # - 1: the scrollbar's column, whether it shows or not
    workers = mirror.workers()
    tiers = {w: mirror.tiers(w) or [(ev.MEDIUM_GPU, 0)] for w in workers}
    n_lanes = sum(len(t) for t in tiers.values())
    title_lines = len(workers) + n_lanes
    rows = max(1, min(MAX_ROWS_PER_LANE, (height - title_lines) // max(n_lanes, 1)))
    layout = LaneLayout(width, [], [], {}, {})
    for worker in workers:
        layout.summaries[worker] = bv.worker_summary_parts(mirror, worker)
        layout.lines.append(("summary", worker))
        for medium, group in tiers[worker]:
            places = max(mirror.held(worker, medium, group), bv.capacity_of(mirror, worker, medium))
            lane_rows = max(1, min(rows, -(-places // per_row)))
            lane = bv.block_lane(mirror, worker, medium, group, columns=per_row * lane_rows)
            key = (worker, medium, group)
            shown = ShownLane(lane, len(layout.lines), per_row,
                              _new_glyphs(lane, None if held_before is None else held_before.get(key)))
            layout.held[key] = set(lane.hashes)
            layout.lines.append(("title", len(layout.lanes)))
            layout.lines += [("row", len(layout.lanes), r) for r in range(shown.n_rows)]
            layout.lanes.append(shown)
    return layout


class BlockLanes(ScrollView, can_focus=True, inherit_bindings=False):
    """Every worker's lanes; see the module docstring. Like the cell grid it leaves the arrows to the app.

    The cursor is a (lane, glyph) pair, anchored to the block it was put on: when blocks come and go the cursor
    follows its block along the lane, and when the block is evicted the cursor stays where it was and the
    inspector goes on telling that block's story (its eviction included) until the cursor moves."""

    DEFAULT_CSS = """
    BlockLanes { height: 1fr; min-height: 6; scrollbar-size-vertical: 1; overflow-x: hidden; }
    """

    class Resized(Message):
        """The lanes need laying out again for a new size (whoever lays them out is told)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lane_layout = LaneLayout(0, [], [], {}, {})
        self.cursor = (0, 0)  # (lane, glyph)
        self.anchor: tuple[int, str, int, bytes] | None = None  # (worker, medium, group, block) the cursor is on

    @property
    def lanes(self) -> list[ShownLane]:
        return self.lane_layout.lanes

    # ---- layout ------------------------------------------------------------------------------------------
    def show(self, layout: LaneLayout) -> None:
        """A new frame: lay_out()'s lanes, the cursor moved along with its block."""
        self.lane_layout = layout
        self._follow_anchor()
        self.virtual_size = Size(self.size.width, len(layout.lines))
        self.refresh()

    def lay_out(self, mirror: BlockMirror) -> None:
        """Lay the lanes out from the mirror here and now (lay_out() and show())."""
        self.show(lay_out(mirror, self.size.width, self.size.height, self.lane_layout.held))

    def on_resize(self) -> None:
        self.post_message(self.Resized())

    # ---- the cursor --------------------------------------------------------------------------------------
    def _follow_anchor(self) -> None:
        """After a new frame: the cursor onto its block where the lane still holds it, else kept in range."""
        if not self.lanes:
            self.cursor = (0, 0)
            return
        if self.anchor is not None:
            worker, medium, group, block = self.anchor
            for k, shown in enumerate(self.lanes):
                lane = shown.lane
                if (lane.worker, lane.medium, lane.group) == (worker, medium, group):
                    glyph = lane.glyph_of(block)
                    if glyph is not None:
                        self.cursor = (k, glyph)
                        return
                    self.cursor = (k, min(self.cursor[1], lane.n_glyphs - 1))
                    return
        lane = min(self.cursor[0], len(self.lanes) - 1)
        self.cursor = (lane, max(0, min(self.cursor[1], self.lanes[lane].lane.n_glyphs - 1)))

    def _anchor_cursor(self) -> None:
        lane = self.lanes[self.cursor[0]].lane
        held = lane.blocks_at(self.cursor[1])
        self.anchor = (lane.worker, lane.medium, lane.group, held[0]) if held else None

    def move_cursor(self, d_glyph: int = 0, d_row: int = 0, d_lane: int = 0) -> None:
        """Left/right a glyph, up/down a row (into the lane above or below past a lane's edge), or a lane."""
        if not self.lanes:
            return
        k, glyph = self.cursor
        if d_lane:
            k = (k + d_lane) % len(self.lanes)
            glyph = min(glyph, self.lanes[k].lane.n_glyphs - 1)
        elif d_row:
            shown = self.lanes[k]
            row, column = divmod(glyph, shown.per_row)
            row += d_row
            if row < 0 and k > 0:
                k -= 1
                row = self.lanes[k].n_rows - 1
            elif row >= shown.n_rows and k < len(self.lanes) - 1:
                k += 1
                row = 0
            glyph = max(0, row) * self.lanes[k].per_row + column
        glyph = min(max(glyph + d_glyph, 0), self.lanes[k].lane.n_glyphs - 1)
        self.cursor = (k, glyph)
        self._anchor_cursor()
        self._scroll_to_cursor()
        self.refresh()

    def to_worker(self, direction: int) -> None:
        """The cursor to the first lane of the next (or previous) worker."""
        if not self.lanes:
            return
        workers = sorted({s.lane.worker for s in self.lanes})
        current = self.selected_worker
        k = (workers.index(current) + direction) % len(workers) if current in workers else 0
        self.to_block(workers[k])

    def to_block(self, worker: int, block: bytes | None = None) -> bool:
        """The cursor onto a worker's block (in its first lane holding it), or onto its first lane. A block no lane
        holds (evicted) is still the one the inspector tells of, the cursor on the worker's first lane: False
        then, and when the worker has no lane."""
        first = None
        for k, shown in enumerate(self.lanes):
            if shown.lane.worker != worker:
                continue
            first = k if first is None else first
            glyph = 0 if block is None else shown.lane.glyph_of(block)
            if glyph is not None:
                self._put_cursor(k, glyph, block)
                return True
        if first is not None:
            self._put_cursor(first, 0, block)
        return False

    def _put_cursor(self, k: int, glyph: int, block: bytes | None) -> None:
        self.cursor = (k, glyph)
        self._anchor_cursor()
        if block is not None:
            lane = self.lanes[k].lane
            self.anchor = (lane.worker, lane.medium, lane.group, block)
        self._scroll_to_cursor()
        self.refresh()

    @property
    def selected_worker(self) -> int | None:
        return self.lanes[self.cursor[0]].lane.worker if self.lanes else None

    def cursor_glyph(self) -> tuple[bv.BlockLane, int, bytes | None] | None:
        """The lane and glyph under the cursor, and the block the inspector tells of: the anchored one (which
        may have been evicted since), else the glyph's first."""
        if not self.lanes:
            return None
        lane = self.lanes[self.cursor[0]].lane
        if self.anchor is not None and self.anchor[:3] == (lane.worker, lane.medium, lane.group):
            return lane, self.cursor[1], self.anchor[3]
        held = lane.blocks_at(self.cursor[1])
        return lane, self.cursor[1], held[0] if held else None

    def click_glyph(self, x: int, y: int) -> bool:
        """The cursor onto the glyph at widget coordinates (x, y); False when there is none."""
        line = y + int(self.scroll_offset.y)
        lines = self.lane_layout.lines
        if not 0 <= line < len(lines) or lines[line][0] != "row" or x < INDENT:
            return False
        _, k, row = lines[line]
        shown = self.lanes[k]
        glyph = row * shown.per_row + x - INDENT
        if x - INDENT >= shown.per_row or glyph >= shown.lane.n_glyphs:
            return False
        self.cursor = (k, glyph)
        self._anchor_cursor()
        self.refresh()
        return True

    def _scroll_to_cursor(self) -> None:
        shown = self.lanes[self.cursor[0]]
        scroll_to_lane_row(self, shown.first_line, self.cursor[1] // shown.per_row)

    # ---- drawing ---------------------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        line = y + int(self.scroll_offset.y)
        width = self.scrollable_content_region.width
        base = self.rich_style  # the theme's background under every segment (see tui/grid.py)
        lines = self.lane_layout.lines
        if not 0 <= line < len(lines):
            return Strip.blank(width, base)
        what = lines[line]
        if what[0] == "summary":
            line = fit(_summary_parts(what[1], self.lane_layout.summaries[what[1]]), width - 1)
            strip = Strip(line.render(self.app.console)).apply_style(base)
        elif what[0] == "title":
            name, held, *per_glyph = self.lanes[what[1]].lane.title_parts()
            # narrow: how many blocks a glyph covers goes first, then the tier's name is cut short
            parts = [Part(name, rank=1, shrinks=True), Part(held), *(Part(p, rank=2) for p in per_glyph)]
            strip = Strip([Segment(" " * INDENT + fit(parts, width - INDENT - 1).plain, base + DIM)])
        else:
            strip = self._row_strip(what[1], what[2], base)
        return strip.extend_cell_length(width, base).crop(0, width)

    def _row_strip(self, k: int, row: int, base: Style) -> Strip:
        shown = self.lanes[k]
        lane = shown.lane
        lo = row * shown.per_row
        hi = min(lo + shown.per_row, lane.n_glyphs)
        dark = self.app.current_theme.dark
        cursor = self.cursor[1] if self.cursor[0] == k else -1
        segments = [Segment(" " * INDENT, base)]
        run, run_style = [], None
        for g in range(lo, hi):
            root = lane.glyph_roots[g]
            glyph_style = Style(color=bv.prefix_color(root, dark), bgcolor=base.bgcolor, reverse=g == cursor,
                                bold=shown.new[g] if shown.new else False, underline=shown.new[g] if shown.new else False)
            if glyph_style != run_style and run:
                segments.append(Segment("".join(run), run_style))
                run = []
            run.append(lane.glyphs[g])
            run_style = glyph_style
        if run:
            segments.append(Segment("".join(run), run_style))
        return Strip(segments)


def _summary_parts(worker: int, summary: list[tuple[str, str]]) -> list[Part]:
    """A worker's summary fitted to a lane's width: its name and GPU count always; the other tiers (their lanes'
    titles say them too) go first, then a label's address ("worker 1 (rank 1 at h:5558)"), then the rates, the
    warnings last."""
    parts: list[Part] = []
    name = f"worker {worker}"
    for text, kind in summary:
        if kind == "name" and text.startswith(name + " ("):
            parts += [Part(name, "bold"), Part(text[len(name):], "bold", rank=ADDRESS_RANK, before="")]
        elif kind == "rate" and parts and parts[-1].rank == SUMMARY_RANKS["rate"]:
            # stored and evicted per second go together: one without the other would mislead
            parts[-1] = Part(f"{parts[-1].text} · {text}", "bold", rank=SUMMARY_RANKS["rate"])
        else:
            parts.append(Part(text, "bold yellow" if kind == "warning" else "bold", rank=SUMMARY_RANKS[kind]))
    return parts


def _new_glyphs(lane: bv.BlockLane, before: set[bytes] | None) -> list[bool]:
    """Per glyph: it covers a block the lane did not hold at the previous draw (none on the first draw: all new
    would say nothing)."""
    new = [False] * lane.n_glyphs
    if before is None:
        return new
    per = lane.blocks_per_glyph
    for index, block in enumerate(lane.hashes):
        if block not in before:
            new[index // per] = True
    return new


class BlockInspector(TextPanel):
    """The block under the cursor: block_views.describe_block's sentence, after what a folded glyph covers."""

    DEFAULT_CSS = """
    BlockInspector { height: auto; max-height: 12; border: round $primary-darken-2; padding: 0 1; }
    """

    def show_block(self, mirror: BlockMirror, where: tuple[bv.BlockLane, int, bytes | None] | None,
                   vocabulary=None, dark: bool = True) -> None:
        if where is None:
            self.border_title = "block"
            self.show("no worker heard from yet: blocks show as the publishers send them")
            return
        lane, glyph, block = where
        text = Text()
        if lane.blocks_per_glyph > 1:
            room = max(10, min(bv.TEXT_CHARS, self.content_region.width - 12))  # the note stays a line or two
            text.append(bv.describe_glyph(mirror, lane, glyph, vocabulary, room) + "\n", style="dim")
        if block is None:
            self.border_title = f"worker {lane.worker} · {lane.name}"
            room = lane.places > lane.held
            text.append("an empty place: the worker could hold a block here (its capacity)" if room else "no block here")
            self.show(text)
            return
        held = bv.known_block(mirror, block, lane.worker)
        gone = not any(b.worker == lane.worker for b in mirror.find(block))
        # said in the title too: a narrow inspector may cut the sentence before its end, where the eviction is
        self.border_title = f"block {hash_text(block)} · worker {lane.worker}" + (" · evicted" if gone else "")
        if held is not None:
            text.append(SWATCH, style=bv.prefix_color(bv.colour_key(mirror, block, held.root), dark))
        text.append(bv.describe_block(mirror, lane.worker, block, vocabulary))
        self.show(text)


class LinesPanel(TextPanel):
    """Lines of block_views (Line), each after a swatch of its prefix's colour, cut at the width rather than
    wrapped (a tree must keep one line per branch to read as a tree, a log one line per entry), or wrapped (wrap:
    the router's sentences)."""

    DEFAULT_CSS = """
    LinesPanel { height: auto; border: round $primary-darken-2; padding: 0 1; }
    """

    _lines: list[bv.Line] | None = None
    _dark = True

    def __init__(self, *, wrap: bool = False, beside_text: int = 28, **kwargs) -> None:
        """wrap: wrap long lines rather than cut them; beside_text: the cells a line takes besides a prefix's
        text (its swatch, counts, indent), for text_chars."""
        super().__init__(**kwargs)
        self.wrap, self.beside_text = wrap, beside_text

    def show_lines(self, lines: list[bv.Line], dark: bool = True) -> None:
        self._lines, self._dark = lines, dark
        width = self.content_region.width
        text = Text()
        for k, line in enumerate(lines):
            if k:
                text.append("\n")
            row = Text()
            if line.root is not None:
                row.append(SWATCH, style=bv.prefix_color(line.root, dark))
            row.append(line.text)
            if width > 0 and not self.wrap:
                row.truncate(width, overflow="ellipsis")
            text.append_text(row)
        self.show(text)

    def on_resize(self) -> None:
        super().on_resize()
        if self._lines is not None:
            self.show_lines(self._lines, self._dark)

    @property
    def text_chars(self) -> int:
        """How much of a prefix's text a line of this width has room for, beside its counts."""
        return max(10, min(bv.TEXT_CHARS, self.content_region.width - self.beside_text))


class BlockCommands(ListedCommands):
    """The palette's entries for the block views: go to a worker, to the deepest block of the most shared
    prefix, to the block evicted last; and the help."""

    def _commands(self) -> list[tuple[str, str, object]]:
        app = self.app
        if not getattr(app, "blocks_mode", False):
            return []
        blocks = app.watcher.mirror.blocks
        out = [("help: what the block glyphs and colours mean", "the legend and every key", app.action_help)]
        for worker in blocks.workers():
            out.append((f"worker {worker}: its lanes and prefix tree", blocks.label(worker),
                        partial(app.go_to_block, worker, None)))
        shares = [s for s in blocks.shared_prefixes() if len(s.deepest) > 1]
        if shares:
            worker, deepest = max(shares[0].deepest.items(), key=lambda wb: wb[1].depth)
            out.append(("the most shared prefix: its deepest block", f"worker {worker}, block {hash_text(deepest.hash)}",
                        partial(app.go_to_block, worker, deepest.hash)))
        if blocks.evictions:
            gone = blocks.evictions[-1].block
            out.append(("the block evicted last", f"worker {gone.worker}, block {hash_text(gone.hash)}",
                        partial(app.go_to_block, gone.worker, gone.hash)))
        return out

