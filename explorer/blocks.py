"""A vLLM / SGLang deployment's prefix caches in the notebook, drawn from a watcher of their KV events (the
watch layer's BlockMirror): per worker a lane of blocks per medium and KV cache group, coloured by prefix; the
prefix tree as an icicle; what a KV-aware router sees; the eviction log; and how the reading of the publishers
goes. Every colour, glyph and sentence comes from engine/watch/block_views.py, which the terminal explorer
shares, so both say the same thing the same way.

    Explorer.attach(vllm=["tcp://10.0.0.5:5557,tcp://10.0.0.5:5558"], tokenizer="tokenizer.json")  # followed live
    views = BlockViews.of(subscriber)   # a KvEventSubscriber (engine/watch/kv_events); views.update() redraws

Redraws cost what is drawn, not what is held: a lane of more blocks than it has places folds (block_views'
glyph model: each mark covers several blocks, shaded by how many it holds), the tree collapses chains of single
children and draws its largest branches up to a cap, and a view whose blocks did not change sends nothing.
"""
from __future__ import annotations

import heapq
import html
import math
import time

import ipywidgets as widgets
import plotly.graph_objects as go

from engine import events as ev
from engine.watch import block_views as bv
from engine.watch import style
from engine.watch.block_mirror import BLOCK_EVENTS, BlockMirror, TreeNode
from engine.watch.kv_events.formats import hash_text
from engine.watch.watcher import Watcher
from explorer.view import LOG_TEXT_STYLE, WatcherView

# A lane folds beyond this many rows of marks: 16 rows of 64 keep a worker's lane in one screen and every
# redraw of it to about a thousand marks however many blocks the worker holds.
LANE_ROWS = 16
TREE_NODES = 300  # icicle boxes drawn at most: more are too thin to read, and each costs the browser
TREE_WIDTH = 460
TREE_PACE = 3.0  # the tree redraws no sooner than 3 times its drawing's time later (see BlockChanges)
SIDE_WIDTH = 400  # the router's lines beside the tree, at least (they take the rest of the row)
HOVER_LINE_CHARS = 90  # a hover sentence is broken after a comma beyond this: plotly's box does not wrap
ROUTER_LINES, EVICTION_LINES = 16, 14
WARNING_STYLE = "color:#B8860B"  # the explorer's status line's warning tone (explorer.explorer.TONE_STYLES)
# Block events that change what the block views draw; the publishers' once-a-second KvEventStats only move the
# status line, so that a quiet deployment costs no redraw.
DRAWN_EVENTS = tuple(kind for kind in BLOCK_EVENTS if kind is not ev.KvEventStats)


def hover_text(sentence: str) -> str:
    """A sentence as plotly hover text: escaped (token text such as '<|im_start|>' would read as a tag) and
    broken after a comma once a line is long; html.unescape(text.replace(',<br>', ', ')) gives it back."""
    parts = html.escape(sentence).split(", ")
    out, line = parts[0], len(parts[0])
    for part in parts[1:]:
        if line + 2 + len(part) > HOVER_LINE_CHARS:
            out += ",<br>" + part
            line = len(part)
        else:
            out += ", " + part
            line += 2 + len(part)
    return out


def vocabulary_of(watcher: Watcher) -> ev.Vocabulary | None:
    """The token texts the subscriber was given (load_vocabulary), which block_views words read; None: ids."""
    return watcher.mirror.vocabulary


def colored_line(line: bv.Line, dark: bool) -> str:
    """One of block_views' lines as HTML, in its prefix's colour as the event log colours a sequence's lines."""
    text = html.escape(line.text)
    if line.root is None:
        return text
    return f"<span style='color:{bv.prefix_color(line.root, dark)}'>{text}</span>"


class BlockChanges:
    """Whether a watcher's blocks changed since the last look, from the events it applied: each view keeps one,
    so that a view redraws only when what it draws moved (other views may poll the same watcher meanwhile).
    With a `pace`, a view whose drawing took t seconds draws again no sooner than pace * t later: the prefix
    tree of 100k blocks (most of its cost BlockMirror.tree's) then leaves the lanes most of the kernel's time,
    and draws the latest state at a later tick (the explorer's follow ticker keeps ticking)."""

    def __init__(self, pace: float = 0.0) -> None:
        self.pace = pace
        self._events = -1
        self._mirror: BlockMirror | None = None
        self._pending = False
        self._next_at = 0.0

    def changed(self, watcher: Watcher) -> bool:
        blocks = watcher.mirror.blocks
        counted, self._events = self._events, watcher.events
        if blocks is not self._mirror or counted < 0:
            self._mirror = blocks  # a resync or a replay's rebuild: a new mirror, all of it new
            return True
        if watcher.events - counted > len(watcher.recent):
            return True  # more arrived than the watcher keeps to look at: some may be block events
        return any(isinstance(e, DRAWN_EVENTS) for e in watcher.events_since(counted))

    def due(self, watcher: Watcher) -> bool:
        """Whether the view should draw now: its blocks changed since it last drew, and its pace allows."""
        self._pending = self.changed(watcher) or self._pending
        return self._pending and time.monotonic() >= self._next_at

    def drawn(self, started: float) -> None:
        ended = time.monotonic()
        self._pending, self._next_at = False, ended + self.pace * (ended - started)

    def forget(self) -> None:
        self._events, self._mirror, self._pending, self._next_at = -1, None, False, 0.0


class BlockView(WatcherView):
    """A view of a watcher's blocks that redraws only when they changed (`_changes`); forget() has the next
    update() draw whatever it finds (the watcher's mirror was replaced, or the page was rebuilt)."""

    _changes: BlockChanges

    def forget(self) -> None:
        self._changes.forget()


class BlockLanes(BlockView):
    """Per worker its summary line and a lane per medium and KV cache group: a square per block (per glyph of
    block_views' model once folded) in its prefix's colour, the capacity after them as empty squares, hovering
    a block says describe_block's sentence. update() polls and redraws when blocks changed."""

    def __init__(self, watcher: Watcher, *, columns: int = 64, rows: int = LANE_ROWS, dark: bool = False,
                 widget: bool = True) -> None:
        """columns: marks per row; rows: rows a lane takes before it folds; dark: colours for a dark page."""
        self.watcher, self.columns, self.rows, self.dark = watcher, columns, rows, dark
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        self.lanes: list[bv.BlockLane] = []  # as drawn, one trace each, in the figure's order
        self._changes = BlockChanges()
        pixels = self.mark_pixels()
        self.figure.update_layout(
            width=60 + columns * pixels, margin=dict(l=10, r=10, t=10, b=10), plot_bgcolor="rgba(0,0,0,0)",
            showlegend=False, hoverlabel=dict(align="left"),
            xaxis=dict(range=[-0.5, columns - 0.5], autorange=False, visible=False, fixedrange=True),
            yaxis=dict(autorange=False, visible=False, fixedrange=True))
        self.update()

    @property
    def max_marks(self) -> int:
        """Marks a lane draws at most; beyond, each covers several blocks."""
        return self.columns * self.rows

    def mark_pixels(self) -> int:
        """A mark's pitch in pixels: square marks of 18 pixels up to 48 columns, narrower beyond, so that the lanes
        (with the summaries' room) fit the 960-odd pixels of a JupyterLab output area beside its file browser."""
        return 18 if self.columns <= 48 else max(4, 880 // self.columns)

    def update(self) -> list[bv.BlockLane]:
        self.watcher.poll()
        if not self._changes.changed(self.watcher):
            return self.lanes  # the figure already shows this: nothing to send to the browser
        mirror = self.watcher.mirror.blocks
        vocabulary = vocabulary_of(self.watcher)
        lanes, headers = [], []
        for worker in mirror.workers():
            headers.append((len(lanes), summary_html(mirror, worker)))
            lanes += bv.worker_lanes(mirror, worker, self.max_marks)
        self._draw(mirror, lanes, headers, vocabulary)
        self.lanes = lanes
        return lanes

    def hover_texts(self, mirror: BlockMirror, lane: bv.BlockLane, vocabulary) -> list[str]:
        """Per mark: describe_block's sentence of its block; of a folded or an empty mark, describe_glyph's."""
        texts = []
        for k in range(lane.n_glyphs):
            covered = lane.blocks_at(k)
            if len(covered) == 1 and lane.blocks_per_glyph == 1:
                texts.append(hover_text(bv.describe_block(mirror, lane.worker, covered[0], vocabulary)))
            else:
                texts.append(hover_text(bv.describe_glyph(mirror, lane, k, vocabulary)))
        return texts

    def _draw(self, mirror: BlockMirror, lanes: list[bv.BlockLane], headers: list[tuple[int, str]],
              vocabulary) -> None:
        pixels = self.mark_pixels()
        title_rows = max(1.0, 16 / pixels)  # a line of text, in rows of marks
        header_at = dict(headers)
        y, annotations, placed = 0.0, [], []
        for k, lane in enumerate(lanes):
            if k in header_at:
                y += title_rows * (0.6 if k else 0.0)
                annotations.append(self._text(header_at[k], y, 12, escaped=True))
                y += title_rows
            annotations.append(self._text(lane.title(), y, 11))
            y += title_rows * 0.9
            placed.append(y)
            y += math.ceil(max(1, lane.n_glyphs) / self.columns)
        if not lanes:
            annotations.append(self._text(bv.router_lines(mirror)[0].text, 0, 12))  # "no worker heard from yet"
            y = title_rows
        if len(self.figure.data) != len(lanes):
            # a worker or a tier came or went (rare): the traces follow, outside batch_update, which cannot add
            self.figure.data = []
            self.figure.add_traces([go.Scatter(mode="markers", hovertemplate="%{hovertext}<extra></extra>",
                                               marker=dict(symbol="square", line=dict(width=0)))
                                    for _ in lanes])
        with self.figure.batch_update():
            size = max(3, pixels - 3)
            for trace, lane, top in zip(self.figure.data, lanes, placed):
                n = lane.n_glyphs
                trace.x = [k % self.columns for k in range(n)]
                trace.y = [top + k // self.columns for k in range(n)]
                trace.name = f"worker {lane.worker} {lane.name}"
                trace.hovertext = self.hover_texts(mirror, lane, vocabulary)
                held_colors = lane.colors(self.dark)
                trace.marker.color = [c if root is not None else style.EMPTY_FILL[self.dark]
                                      for c, root in zip(held_colors, lane.glyph_roots)]
                # a folded mark shades as the terminal's occupancy glyphs do: the fewer blocks held, the fainter
                trace.marker.opacity = [1.0] * n if lane.blocks_per_glyph == 1 else \
                    [0.3 + 0.7 * float(f) if f > 0 else 1.0 for f in lane.occupancy]
                trace.marker.size = size
            rows = max(1.0, y)
            self.figure.layout.yaxis.range = [rows - 0.5, -title_rows - 0.5]
            self.figure.layout.height = int(30 + (rows + title_rows) * pixels)
            self.figure.layout.annotations = annotations

    @staticmethod
    def _text(text: str, y: float, size: int, escaped: bool = False) -> dict:
        return dict(text=text if escaped else html.escape(text), x=-0.5, y=y, xref="x", yref="y", xanchor="left",
                    yanchor="middle", showarrow=False, font=dict(size=size))


class PrefixTree(BlockView):
    """Every worker's prefix tree as a plotly icicle: a box per branch (a chain of single children collapsed into
    one, ids "worker/hash", parents by parent hash), sized by the blocks held below it, labelled with its first
    block's text, in its prefix's colour; the largest TREE_NODES branches drawn, the title says what was left
    out."""

    def __init__(self, watcher: Watcher, *, max_nodes: int = TREE_NODES, dark: bool = False, widget: bool = True,
                 width: int = TREE_WIDTH) -> None:
        self.watcher, self.max_nodes, self.dark = watcher, max_nodes, dark
        self.figure = go.FigureWidget() if widget else go.Figure()
        self.widget = self.figure
        self.figure.add_trace(go.Icicle(branchvalues="total", maxdepth=8, sort=False, tiling=dict(orientation="h"),
                                        hovertemplate="%{label}<br>%{value:,} blocks held here<br>%{hovertext}"
                                                      "<extra></extra>"))
        self.figure.update_layout(width=width, height=420, margin=dict(l=5, r=5, t=40, b=5),
                                  title=dict(font=dict(size=13), x=0.01, xanchor="left"))
        self.left_out = (0, 0)  # (branches, blocks) the last drawing left out
        self._changes = BlockChanges(pace=TREE_PACE)
        self.update()

    def update(self) -> None:
        self.watcher.poll()
        if not self._changes.due(self.watcher):
            return
        started = time.monotonic()
        mirror = self.watcher.mirror.blocks
        nodes, self.left_out = self.nodes(mirror, vocabulary_of(self.watcher))
        ids, parents, values, labels, hovers, colors = (list(column) for column in zip(*nodes)) if nodes else \
            ([], [], [], [], [], [])
        branches, blocks = self.left_out
        title = "prefix tree: a box per branch, sized by its blocks"
        if branches:
            title += f" · … {branches:,} more branch{'es' if branches != 1 else ''} ({blocks:,} blocks) not drawn"
        with self.figure.batch_update():
            icicle = self.figure.data[0]
            icicle.ids, icicle.parents, icicle.values, icicle.labels = ids, parents, values, labels
            icicle.hovertext, icicle.marker.colors = hovers, colors
            self.figure.layout.title.text = html.escape(title)
        self._changes.drawn(started)

    def nodes(self, mirror: BlockMirror, vocabulary) -> tuple[list[tuple], tuple[int, int]]:
        """(id, parent, value, label, hover, colour) per box, parents first, and the (branches, blocks) left out.
        Branches are taken largest first across every worker, so the cap drops the smallest."""
        workers = mirror.workers()
        out: list[tuple] = []
        top = ""
        if len(workers) > 1:  # plotly draws one hierarchy: several workers hang under one box
            top = "workers"
            out.append((top, "", 0, f"{len(workers)} workers", "", style.EMPTY_FILL[self.dark]))
        frontier: list[tuple[int, int, int, TreeNode, str]] = []  # (-blocks, order, worker, node, parent id)
        order = 0
        total = 0
        for worker in workers:
            roots = mirror.tree(worker)
            held = sum(r.n_blocks for r in roots)
            total += held
            worker_id = f"worker {worker}"
            out.append((worker_id, top, held, mirror.label(worker), bv.worker_summary(mirror, worker),
                        style.EMPTY_FILL[self.dark]))
            for root in roots:
                heapq.heappush(frontier, (-root.n_blocks, order, worker, root, worker_id))
                order += 1
        if top:
            out[0] = (top, "", total, *out[0][3:])
        drawn = 0
        while frontier and drawn < self.max_nodes:
            _, _, worker, node, parent = heapq.heappop(frontier)
            last = self._chain_end(node)
            node_id = f"{worker}/{node.hash.hex()}"
            out.append((node_id, parent, node.n_blocks, *self._describe(mirror, worker, node, last, vocabulary)))
            drawn += 1
            for child in last.children:
                heapq.heappush(frontier, (-child.n_blocks, order, worker, child, node_id))
                order += 1
        return out, (len(frontier), sum(-f[0] for f in frontier))

    @staticmethod
    def _chain_end(node: TreeNode) -> TreeNode:
        """The last node of the chain of single held children from `node` (as block_views' tree lines collapse)."""
        if node.block is None:
            return node
        last = node
        while len(last.children) == 1 and last.children[0].block is not None:
            last = last.children[0]
        return last

    def _describe(self, mirror: BlockMirror, worker: int, node: TreeNode, last: TreeNode, vocabulary) -> tuple:
        """(label, hover, colour) of a branch from `node` to `last`."""
        if node.block is None:
            label = hash_text(node.hash)
            root = node.hash
        else:
            label = bv.tokens_text(node.block.token_ids, vocabulary)
            root = bv.colour_key(mirror, node.hash, node.block.root)
        hover = hover_text(bv.describe_block(mirror, worker, node.hash, vocabulary))
        return html.escape(label), hover, bv.prefix_color(root, self.dark)


class RouterView(BlockView):
    """What a KV-aware router sees (block_views.router_lines): the prefixes several workers hold and how deep,
    then per worker what only it holds; each line in its prefix's colour."""

    def __init__(self, watcher: Watcher, *, lines: int = ROUTER_LINES, dark: bool = False) -> None:
        self.watcher, self.lines, self.dark = watcher, lines, dark
        self.widget = widgets.HTML(layout=widgets.Layout(flex=f"1 1 {SIDE_WIDTH}px", overflow="auto"))
        self._changes = BlockChanges()
        self.update()

    def update(self) -> None:
        self.watcher.poll()
        if not self._changes.changed(self.watcher):
            return
        lines = bv.router_lines(self.watcher.mirror.blocks, vocabulary_of(self.watcher), self.lines)
        body = "<br>".join(colored_line(line, self.dark) for line in lines)
        # wrapped: beside the tree a shared prefix's line runs past the page (its indent is kept)
        self.widget.value = f"<b>router</b><div style='{LOG_TEXT_STYLE}; white-space: pre-wrap'>{body}</div>"


class EvictionLog(BlockView):
    """The blocks evicted last, newest first (block_views.eviction_lines), each in its prefix's colour."""

    def __init__(self, watcher: Watcher, *, lines: int = EVICTION_LINES, dark: bool = False) -> None:
        self.watcher, self.lines, self.dark = watcher, lines, dark
        self.text = widgets.HTML(layout=widgets.Layout(height=f"{1.45 * lines + 0.6:.1f}em", overflow="auto"))
        self.widget = widgets.VBox([widgets.HTML("<b>evictions</b>"), self.text])
        self._changes = BlockChanges()
        self.update()

    def update(self) -> None:
        self.watcher.poll()
        if not self._changes.changed(self.watcher):
            return
        lines = bv.eviction_lines(self.watcher.mirror.blocks, self.lines, vocabulary_of(self.watcher))
        body = "<br>".join(colored_line(line, self.dark) for line in lines) or "<i>no block evicted yet</i>"
        self.text.value = f"<div style='{LOG_TEXT_STYLE}'>{body}</div>"


class BlockViews(WatcherView):
    """Every block view of one watcher, one under the other: how the reading goes (block_views.stats_text), the
    lanes, and the prefix tree beside the router and the eviction log."""

    def __init__(self, watcher: Watcher, *, columns: int = 64, dark: bool = False, widget: bool = True,
                 status_line: bool = True) -> None:
        """columns: marks per lane row; status_line: show how the reading goes above the lanes (an Explorer
        says it in its own status line)."""
        self.watcher, self.dark = watcher, dark
        self.lanes = BlockLanes(watcher, columns=columns, dark=dark, widget=widget)
        self.tree = PrefixTree(watcher, dark=dark, widget=widget)
        self.router = RouterView(watcher, dark=dark)
        self.evictions = EvictionLog(watcher, dark=dark)
        self.status = widgets.HTML()
        self.parts = [self.lanes, self.tree, self.router, self.evictions]
        # the evictions' lines are the longest: under the tree and the router, the page's width
        beside = widgets.HBox([self.tree.widget, self.router.widget],
                              layout=widgets.Layout(flex_flow="row wrap", align_items="flex-start"))
        shown = [self.lanes.widget, beside, self.evictions.widget]
        self.widget = widgets.VBox([self.status, *shown] if status_line else shown)
        self._draw_status()

    def figures(self) -> list:
        return [self.lanes.figure, self.tree.figure]

    def show(self, watcher: Watcher) -> None:
        self.watcher = watcher
        for part in self.parts:
            part.show(watcher)
        self._draw_status()

    def forget(self) -> None:
        for part in self.parts:
            part.forget()

    def update(self) -> None:
        self.watcher.poll()
        for part in self.parts:
            part.update()
        self._draw_status()

    def _draw_status(self) -> None:
        self.status.value = stats_html(self.watcher.mirror.blocks)


def summary_html(mirror: BlockMirror, worker: int) -> str:
    """block_views.worker_summary as plotly text: the worker's name bold, what may leave blocks out of the picture
    (batches lost, restarts) in the warning colour."""
    styled = {"name": "<b>{}</b>", "warning": f"<span style='{WARNING_STYLE}'>{{}}</span>"}
    return " · ".join(styled.get(kind, "{}").format(html.escape(text))
                      for text, kind in bv.worker_summary_parts(mirror, worker))


def stats_html(mirror: BlockMirror) -> str:
    """block_views.stats_parts as a status line, what may leave blocks out of the picture in the warning colour."""
    return " · ".join(f"<span style='{WARNING_STYLE}'>{html.escape(text)}</span>" if warning else html.escape(text)
                      for text, warning in bv.stats_parts(mirror))
