"""The terminal explorer: composes the views and drives them from one Watcher, once per frame.

Nothing here knows a cache rule: the grid draws the watch layer's frames, the inspector its history and
SWA visibility, the bars its device mirror. Commands go to the session (or the remote session); their
Futures report back on the session's thread, so results reach the UI through call_from_thread. A real
llama.cpp watched from its log (an attached source) takes no command: the keys that would send one are left
out of the key bar, the help, the palette and Textual's keys panel (check_action), and pressed anyway, they
say so.
"""
from __future__ import annotations

import collections
import gc
import time
from concurrent.futures import Future
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.events import Click, Key
from textual.message import Message

from engine import events as ev
from engine.watch import AttentionWatch, Recorder, block_views, visibility
from engine.watch.describe import cache_title, free_seq, process_exit_text, tokens_per_second
from engine.watch.frames import SHARED
from engine.watch.sources import Source
from tui.blocks import BlockCommands, BlockInspector, BlockLanes, LinesPanel, lay_out
from tui.commands import SequenceCommands
from tui.devices import DeviceBars
from tui.event_log import EventLog
from tui.fit import FittedLine, Part
from tui.grid import CellGrid
from tui.inspector import CellInspector
from tui.keys import ATTACHED_KEYS, BLOCK_KEYS, REPLAY_KEYS, SESSION_KEYS, KeyBar
from tui.mask import MaskScreen
from tui.screens import HelpScreen, PromptScreen, SettingsScreen
from tui.slots import SlotsPanel
from tui.status import StatusLine

FRAMES_PER_SECOND = 20
POLL_BUDGET_S = 0.005  # a frame absorbs events for this long at most, so that keys wait a frame at most
CATCHING_UP_DRAW_EVERY_S = 0.2  # with a backlog, redraw this often; the frames between only absorb
UNDRAWN_KEPT = 200  # events kept for the log between two draws (it shows the latest of a burst)
REPLAY_EVENTS_PER_FRAME = 25  # a playing replay: about 500 events a second
SHOWN_IN_REPLAY_LOG = 50
# The actions that need a session to command (and the attention overlay, which a log has no weights for), and
# what pressing one says when a llama.cpp process is only watched
SESSION_ACTIONS = frozenset({"toggle_run", "step", "prompt", "seq_op", "settings", "record", "toggle_attention"})
# What a llama.cpp log cannot draw: its cell dumps tell positions and sequences, not the ubatch a decode placed
# (tokens, their order, who shares an 'M' cell), so the mask of the last ubatch is left out when attached
NEEDS_UBATCHES = frozenset({"show_mask"})
ONLY_WATCHES = ("kvscope only watches an attached llama.cpp process: it cannot step, pause, prompt or change it "
                "(? lists the keys that work)")
EXIT_LINES_NOTIFIED = 4  # of a process that ended: its last lines in the notification (the event log has more)
# vLLM / SGLang workers watched from their KV events: the block views replace the cell grid, and what only the cells
# have (the window and attention overlays, zoom, the event log's filters) is off
CELL_ONLY_ACTIONS = frozenset({"toggle_window", "toggle_attention", "zoom", "log_group", "log_seq", "log_cache",
                               "show_mask"})
ONLY_WATCHES_BLOCKS = ("kvscope only watches the workers' KV events: it cannot step, pause, prompt or change them "
                       "(? lists the keys that work)")
# The block views are worked out on a thread (laying the lanes out sorts every block held; the tree and the
# router's view walk them all: a second or more for a hundred thousand blocks, which the keys must not wait for),
# again as events come, after a rest of this many times the last working out (a thread that never rests takes the
# keys' share of the interpreter too), and at least a frame
BLOCKS_REST_FACTOR = 3


class BlocksWorkedOut(Message):
    """The block views worked out on a thread: the lanes, the prefix tree (of `worker`), the router's view."""

    def __init__(self, layout, worker: int | None, tree: list | None, router: list, cost_s: float) -> None:
        super().__init__()
        self.layout, self.worker, self.tree, self.router, self.cost_s = layout, worker, tree, router, cost_s


class KvscopeApp(App):
    """kvscope's terminal explorer (see tui/__init__.py)."""

    TITLE = "kvscope"
    COMMANDS = App.COMMANDS | {SequenceCommands, BlockCommands}
    CSS = """
    #title { height: 1; background: $primary-darken-2; color: $text; padding: 0 1; }
    #side { width: 48; scrollbar-size-vertical: 1; }
    #main { height: 2fr; }
    EventLog { height: 1fr; min-height: 8; }
    #evictions { height: 7; }
    #main.blocks #side { width: 40%; max-width: 80; min-width: 48; }
    Screen.-narrow #side { width: 32; }
    Screen.-narrow EventLog { height: 6; min-height: 6; }
    Screen.-narrow CellInspector { max-height: 9; }
    Screen.-narrow BlockInspector { max-height: 9; }
    Screen.-narrow #evictions { height: 5; }
    Screen.-narrow #main.blocks #side { width: 34; min-width: 34; }
    """
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]  # 80 columns: the grid keeps 32 cells a row
    BINDINGS = [
        Binding("space", "toggle_run", "start/pause"),
        Binding("n", "step", "step"),
        Binding("p", "prompt", "prompt"),
        # priority: the screen's own tab moves the focus, and the grid is the one widget that takes keys
        Binding("tab", "next_seq(1)", "next seq", priority=True),
        Binding("shift+tab", "next_seq(-1)", show=False, priority=True),
        Binding("w", "toggle_window", "window"),
        Binding("m", "show_mask", "mask"),
        Binding("a", "toggle_attention", "attention", show=False),
        Binding("plus,equals_sign", "zoom(-1)", "zoom in", show=False),
        Binding("minus", "zoom(1)", "zoom out", show=False),
        Binding("left", "cursor(-1, 0)", show=False),
        Binding("right", "cursor(1, 0)", show=False),
        Binding("up", "cursor(0, -1)", show=False),
        Binding("down", "cursor(0, 1)", show=False),
        Binding("left_square_bracket", "lane(-1)", show=False),
        Binding("right_square_bracket", "lane(1)", show=False),
        Binding("x", "seq_op('rm')", "rm seq", show=False),
        Binding("k", "seq_op('keep')", "keep seq", show=False),
        Binding("y", "seq_op('cp')", "copy seq", show=False),
        Binding("s", "seq_op('shift')", "ctx shift", show=False),
        Binding("o", "settings", "settings"),
        Binding("r", "record", "record", show=False),
        Binding("f", "log_group", show=False),
        Binding("g", "log_seq", show=False),
        Binding("c", "log_cache", show=False),
        Binding("comma", "replay_step(-1)", "back", show=False),
        Binding("full_stop", "replay_step(1)", "forward", show=False),
        Binding("less_than_sign", "replay_step(-100)", show=False),
        Binding("greater_than_sign", "replay_step(100)", show=False),
        Binding("j", "replay_jump(1)", "next of kind", show=False),
        Binding("J", "replay_jump(-1)", show=False),
        Binding("home", "replay_seek(0.0)", show=False),
        Binding("end", "replay_seek(1.0)", show=False),
        *[Binding(str(d), f"replay_seek({d / 10})", show=False) for d in range(10)],
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, source: Source, *, frames_per_second: int = FRAMES_PER_SECOND) -> None:
        super().__init__()
        self.source = source
        self.frames_per_second = frames_per_second
        self.selected_seq: int | None = None
        self.show_window = True
        self.show_attention = False
        self.attention = AttentionWatch()
        self.recorder: Recorder | None = None
        self._steps: collections.deque[ev.WorkloadStep] = collections.deque(maxlen=512)
        self._undrawn: list[ev.Event] = []  # events absorbed since the last draw (the latest, for the log)
        self._drawn_at = 0.0
        self._catching_up = False  # a refresh is scheduled to go on absorbing a backlog
        self.frames_drawn = 0
        self.playing = False  # a replay advancing by itself (space)
        self._shown_at: tuple[int, int] = (-2, -1)  # a replay's (position, rebuilds) last drawn
        self._refused_at = -1e9  # when a key an attached source cannot obey was last answered (time.monotonic)
        self.blocks_mode = source.shows_blocks
        self._blocks_busy = self._blocks_again = False  # the block views are being worked out; asked again since
        self._blocks_timer = None  # the next working out, when one rests before it
        self._tree_worker: int | None = -1  # whose tree the panel shows (-1: none drawn yet)

    # ---- layout ----------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield FittedLine(id="title")
        if self.blocks_mode:
            yield from self._compose_blocks()
            return
        with Horizontal(id="main"):
            yield CellGrid(id="grid")
            # a server's slots first (when it runs, they are what a turn did); the rest scrolls with the mouse
            with VerticalScroll(id="side", can_focus=False):
                yield SlotsPanel(id="slots")
                yield CellInspector(id="inspector")
                yield DeviceBars(id="devices")
        yield EventLog(id="log")
        yield StatusLine(id="status")
        yield KeyBar(id="keys")

    def _compose_blocks(self) -> ComposeResult:
        with Horizontal(id="main", classes="blocks"):
            yield BlockLanes(id="lanes")
            with VerticalScroll(id="side", can_focus=False):
                yield BlockInspector(id="inspector")
                yield LinesPanel(id="tree", beside_text=36)  # room for "█ 12 blocks" and "+123 in 45 branches"
                yield LinesPanel(id="router", wrap=True)
        yield LinesPanel(id="evictions")
        yield StatusLine(id="status")
        yield KeyBar(id="keys")

    def on_mount(self) -> None:
        if self.blocks_mode:
            self._view(BlockLanes).focus()
            self._view(KeyBar).show_keys(BLOCK_KEYS)
            self.set_interval(1 / self.frames_per_second, self.refresh_view)
            self.refresh_view()
            return
        self._view(CellGrid).focus()
        replay = self.source.replay
        if replay is not None:
            self._view(KeyBar).show_keys(REPLAY_KEYS)
            # A recording is opened to see what happened: its end shows the cache the run left and the events
            # that led there (event 0 is an empty cache, before the model even loaded); home or 0 goes back.
            if replay.at_start:
                replay.seek(len(replay) - 1)
            for warning in replay.reader.warnings:
                self.notify(warning, title="the recording is incomplete", severity="warning", timeout=30)
        else:
            self._view(KeyBar).show_keys(ATTACHED_KEYS if self.attached else SESSION_KEYS)
        self.set_interval(1 / self.frames_per_second, self.refresh_view)
        self.refresh_view()

    def _view(self, selector, kind=None):
        """A widget of the main screen, also while a dialog (help, settings) is on top of it."""
        screen = self.screen_stack[0]
        return screen.query_one(selector) if kind is None else screen.query_one(selector, kind)

    @property
    def watcher(self):
        return self.source.watcher

    @property
    def attached(self) -> bool:
        """A real llama.cpp watched from its log: nothing can be sent to it."""
        return self.source.attached is not None

    # ---- what an attached source cannot do ------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """An attached source's bindings that would command a session are off: Textual then leaves them out of
        its keys panel and runs nothing (on_key says why)."""
        if self.blocks_mode and action in CELL_ONLY_ACTIONS:
            return False
        return not (self.attached and (action in SESSION_ACTIONS or action in NEEDS_UBATCHES))

    def on_key(self, event: Key) -> None:
        if self.attached and _KEY_ACTIONS.get(event.key) in SESSION_ACTIONS:
            self.refuse_command()

    def refuse_command(self) -> None:
        """Say that an attached llama.cpp cannot be commanded: once while the notice is on screen, however
        often such keys are pressed."""
        now = time.monotonic()
        if now - self._refused_at >= self.NOTIFICATION_TIMEOUT:
            self._refused_at = now
            self.notify(ONLY_WATCHES_BLOCKS if self.blocks_mode else ONLY_WATCHES, severity="warning")

    # ---- one frame -------------------------------------------------------------------------------
    def refresh_view(self) -> None:
        """Drain the watch layer once, then redraw what the new events changed."""
        if not self.screen_stack or not self.screen_stack[0].is_mounted:
            return  # starting or closing: there is nothing to draw on
        try:
            self._refresh()
        except NoMatches:
            pass  # the main screen's widgets are being mounted or removed: the next frame draws

    def _refresh(self) -> None:
        if self.source.replay is not None:
            self._refresh_replay()
            return
        watcher = self.watcher
        counted = watcher.events
        watcher.poll(budget_s=POLL_BUDGET_S)
        new = watcher.events_since(counted)
        for event in new:
            self.attention.apply(event)
            if isinstance(event, ev.WorkloadStep):
                self._steps.append(event)
            elif isinstance(event, ev.ProcessExited):
                self._tell_exit(event)
        if new:
            self._undrawn = (self._undrawn + new)[-UNDRAWN_KEPT:]
        now = time.monotonic()
        # Behind (a burst left a backlog): draw a few times a second and give the other frames to
        # absorbing, so the view catches up; every frame still answers keys and updates the status line.
        draw_due = not watcher.backlog or now - self._drawn_at >= CATCHING_UP_DRAW_EVERY_S
        if (self._undrawn and draw_due) or self.frames_drawn == 0:
            self._draw(self._undrawn)
            self._undrawn, self._drawn_at = [], now
            if self.frames_drawn == 1:
                # What exists now (the model's vocabulary, the widgets) lives as long as the app: the
                # collector need not walk it again on each full pass, which a fast event stream triggers often.
                gc.freeze()
        self._draw_status()
        if watcher.backlog and not self._catching_up:
            # behind: go on absorbing as soon as the keys that came meanwhile were handled, not a frame later
            self._catching_up = True
            self.set_timer(0.001, self._catch_up)

    def _tell_exit(self, exited: ev.ProcessExited) -> None:
        """A watched process ended: how, and its last lines (all of them follow its line in the event log)."""
        failed = exited.returncode != 0 and not exited.ended_by_kvscope
        lines = "\n".join([line for line in exited.last_lines if line.strip()][-EXIT_LINES_NOTIFIED:])
        self.notify(lines or "it printed nothing", title=process_exit_text(exited),
                    severity="error" if failed else "information", timeout=30 if failed else 10)

    def _catch_up(self) -> None:
        self._catching_up = False
        self.refresh_view()

    def _refresh_replay(self) -> None:
        """A replay moves by keys (or plays): draw when its position moved, the log from what it replayed."""
        replay = self.source.replay
        if self.playing:
            replay.step(REPLAY_EVENTS_PER_FRAME)
            self.playing = not replay.at_end
        shown = (replay.position, replay.rebuilds)
        if shown != self._shown_at or self.frames_drawn == 0:
            self._shown_at = shown
            self.attention = AttentionWatch()
            recent = list(self.watcher.recent)
            if self.blocks_mode:  # a recording of KV events: no event log, the eviction log says what went
                self._draw(recent)
                self._view("#evictions", LinesPanel).border_subtitle = f"event {replay.position + 1} of {len(replay)}"
            else:
                for event in recent:
                    self.attention.apply(event)
                log = self._view(EventLog)
                log.clear()
                self._draw(recent[-SHOWN_IN_REPLAY_LOG:])
                log.border_subtitle = f"event {replay.position + 1} of {len(replay)}"
        self._draw_status()

    def _draw(self, new: list[ev.Event]) -> None:
        if self.blocks_mode:
            self._draw_blocks()
            return
        grid = self._view(CellGrid)
        mirror = self.watcher.mirror
        seen = self._visibility()
        overlays = {(name, cv.stream): cv.codes for name, cv in seen.caches.items()} if seen and self.show_window \
            else {}
        grid.show(self.watcher.frame(), self._lane_titles(), overlays, self._heat(), self._unnamed_sharers())
        self._draw_inspector(seen)
        self._view(DeviceBars).show_devices(mirror.devices)
        self._view(SlotsPanel).show_slots(self.watcher.server, self.current_theme.dark)
        self._view(EventLog).add_events(new)
        self._view("#title", FittedLine).show_parts(self._title())
        self.frames_drawn += 1

    # ---- the block views (a source of kind "kv-events") -----------------------------------------------------
    def _draw_blocks(self) -> None:
        """New events: the eviction log and the title now, the lanes, tree and router's view as soon as a thread has
        worked them out."""
        blocks = self.watcher.mirror.blocks
        evictions = self._view("#evictions", LinesPanel)
        rows = max(1, evictions.content_region.height)
        evictions.border_title = f"evictions, newest first · {len(blocks.evictions):,} logged"
        evictions.show_lines(block_views.eviction_lines(blocks, rows, self._vocabulary), self.current_theme.dark)
        self._view("#title", FittedLine).show_parts(self._blocks_title())
        self.frames_drawn += 1
        self._work_out_blocks()

    def _draw_block_panels(self) -> None:
        """What follows the cursor: the inspector, and (worked out apart) the selected worker's prefix tree, at
        once when the cursor went to another worker."""
        self._draw_block_inspector()
        if self._view(BlockLanes).selected_worker != self._tree_worker:
            self._work_out_blocks(now=True)

    def _draw_block_inspector(self) -> None:
        self._view(BlockInspector).show_block(self.watcher.mirror.blocks, self._view(BlockLanes).cursor_glyph(),
                                              self._vocabulary, self.current_theme.dark)

    def _work_out_blocks(self, now: bool = False) -> None:
        """Work the lanes, the tree and the router's view out on a thread. One at a time; asked again meanwhile,
        one more follows, after a rest (now: without one, unless one is being worked out)."""
        if self._blocks_timer is not None and now:
            self._blocks_timer.stop()
            self._blocks_timer = None
        if self._blocks_busy or self._blocks_timer is not None:
            self._blocks_again = True
            return
        self._blocks_busy, self._blocks_again = True, False
        blocks, vocabulary = self.watcher.mirror.blocks, self._vocabulary
        lanes = self._view(BlockLanes)
        width, height, held = lanes.size.width, lanes.size.height, lanes.lane_layout.held
        worker = lanes.selected_worker if lanes.lanes else next(iter(blocks.workers()), None)
        tree_chars, router_chars = self._view("#tree", LinesPanel).text_chars, self._view("#router", LinesPanel).text_chars
        max_lines = self._tree_lines()

        def work() -> None:
            started = time.perf_counter()
            layout = lay_out(blocks, width, height, held)
            tree = None if worker is None else block_views.tree_lines(blocks, worker, vocabulary, max_lines=max_lines,
                                                                      max_chars=tree_chars)
            router = block_views.router_lines(blocks, vocabulary, max_chars=router_chars)
            # a message rather than call_from_thread, which would wait for an app that may be closing
            self.post_message(BlocksWorkedOut(layout, worker, tree, router, time.perf_counter() - started))

        self.run_worker(work, thread=True, group="block-views")

    def on_blocks_worked_out(self, message: BlocksWorkedOut) -> None:
        self._blocks_busy = False
        dark = self.current_theme.dark
        lanes = self._view(BlockLanes)
        lanes.show(message.layout)
        self._draw_block_inspector()
        worker = message.worker
        tree = self._view("#tree", LinesPanel)
        tree.border_title = "prefix tree" if worker is None else f"prefix tree · worker {worker}"
        tree.show_lines(message.tree or [block_views.Line("no worker heard from yet")], dark)
        self._tree_worker = worker
        router = self._view("#router", LinesPanel)
        router.border_title = "router view · GPU"
        router.show_lines(message.router, dark)
        self._view("#title", FittedLine).show_parts(self._blocks_title())
        if lanes.selected_worker != worker:
            self._work_out_blocks(now=True)
        elif self._blocks_again:
            rest = max(1 / self.frames_per_second, BLOCKS_REST_FACTOR * message.cost_s)
            self._blocks_timer = self.set_timer(rest, self._blocks_rested)

    def _blocks_rested(self) -> None:
        self._blocks_timer = None
        self._work_out_blocks()

    @on(BlockLanes.Resized)
    def _lanes_resized(self) -> None:
        self._work_out_blocks(now=True)

    @property
    def blocks_busy(self) -> bool:
        """The block views are being worked out, or rest before they are again (the last ones show meanwhile)."""
        return self._blocks_busy or self._blocks_timer is not None

    def _tree_lines(self) -> int:
        """As many lines as a third of the screen: the tree shares the side with the inspector and the router."""
        return max(4, self.size.height // 3)

    @property
    def _vocabulary(self):
        return self.watcher.mirror.vocabulary

    def _blocks_title(self) -> list[Part]:
        blocks = self.watcher.mirror.blocks
        workers = blocks.workers()
        dialects = sorted({s.dialect for s in blocks.seen.values() if s.dialect})
        model = self._vocabulary.model_name if self._vocabulary is not None and self._vocabulary.model_name else ""
        worker = self._view(BlockLanes).selected_worker
        parts = [Part("kvscope", "bold"), Part("prefix caches"),
                 Part(f"{len(workers)} worker{'s' if len(workers) != 1 else ''}"),
                 Part(model or "no vocabulary: token ids shown", rank=2),
                 Part("/".join(dialects), rank=3) if dialects else None,
                 Part(f"selected worker {worker}", rank=1) if worker is not None else None]
        return [p for p in parts if p is not None]

    def go_to_block(self, worker: int, block: bytes | None = None) -> None:
        """The cursor onto a worker's block (or its first lane): for the command palette."""
        lanes = self._view(BlockLanes)
        if not lanes.to_block(worker, block) and block is not None:
            self.notify(f"worker {worker} no longer holds that block: the inspector tells its story",
                        severity="information")
        self._draw_block_panels()
        self._view("#title", FittedLine).show_parts(self._blocks_title())

    def _draw_inspector(self, seen) -> None:
        grid = self._view(CellGrid)
        where = grid.cursor_cells()
        if where is None:
            return
        lane, first, last = where
        self._view(CellInspector).show_cell(self.watcher.mirror, self.watcher.history, lane.cache, lane.stream,
                                                first, last, seen)

    def _draw_status(self) -> None:
        if self.blocks_mode:
            self._view(StatusLine).show_block_status(self.watcher, self.source.label)
            return
        if self.attached:
            attached = self.source.attached
            self._view(StatusLine).show_attached_status(self.watcher, attached.label if attached.kind == "file" else "")
            return
        self._view(StatusLine).show_status(self.watcher, self._tokens_per_second(), self.source.label,
                                           replay=self.source.replay, playing=self.playing)

    def _tokens_per_second(self) -> float:
        return tokens_per_second(self._steps, time.monotonic())

    def _title(self) -> list[Part]:
        """kvscope, the model, the workload and what is selected; when narrow, the selection's details go first."""
        created = self.watcher.mirror.created
        replay = self.source.replay
        model = next(iter(created.values())).model_name if created else (replay.model_name if replay else "")
        status = self.watcher.status
        workload = status.workload if status else (replay.reader.info.get("command", "") if replay else "")
        seq = "none" if self.selected_seq is None else str(self.selected_seq)
        parts = [Part("kvscope", "bold"), Part(model or "?"), Part(workload or "?", rank=1),
                 Part(f"{self.source.kind}", rank=4), Part(f"selected seq {seq}", rank=2)]
        if self.show_window:
            parts.append(Part("window shown", rank=3))
        if self.recorder:
            parts.append(Part("recording", "bold"))
        return parts

    def _lane_titles(self) -> dict[str, str]:
        return {name: cache_title(c) for name, c in self.watcher.mirror.created.items()}

    def _visibility(self):
        seq = self.selected_seq
        mirror = self.watcher.mirror
        if seq is None or not mirror.caches:
            return None
        try:
            return visibility(mirror, seq)
        except ValueError:
            return None

    def _unnamed_sharers(self) -> dict:
        """The cells a llama.cpp log shows shared without naming by whom, by (cache, stream) (copies: the
        mirror goes on changing)."""
        return {(name, s): st.uncertain.copy() for name, cache in self.watcher.mirror.caches.items()
                for s, st in enumerate(cache.streams) if st.uncertain is not None and st.uncertain.any()}

    def _heat(self) -> dict:
        if not self.show_attention or self.selected_seq is None:
            return {}
        heat = {}
        for name, cache in self.watcher.mirror.caches.items():
            for stream in range(len(cache.streams)):
                try:
                    weights = self.attention.weights(self.selected_seq, name, stream)
                except (KeyError, ValueError):
                    continue
                if weights is not None and weights.any():
                    heat[(name, stream)] = weights
        return heat

    # ---- the cursor and selection ------------------------------------------------------------------
    def action_cursor(self, d_glyph: int, d_row: int) -> None:
        if self.blocks_mode:
            self._view(BlockLanes).move_cursor(d_glyph=d_glyph, d_row=d_row)
            self._draw_block_panels()
            return
        self._view(CellGrid).move_cursor(d_glyph=d_glyph, d_row=d_row)
        self._select_from_cursor()

    def action_lane(self, d: int) -> None:
        if self.blocks_mode:
            self._view(BlockLanes).move_cursor(d_lane=d)
            self._draw_block_panels()
            return
        self._view(CellGrid).move_cursor(d_lane=d)
        self._select_from_cursor()

    @on(Click, "#grid")
    def _clicked(self, event: Click) -> None:
        if self._view(CellGrid).click_cell(event.x, event.y):
            self._select_from_cursor()

    @on(Click, "#lanes")
    def _clicked_block(self, event: Click) -> None:
        if self._view(BlockLanes).click_glyph(event.x, event.y):
            self._draw_block_panels()

    def _select_from_cursor(self) -> None:
        where = self._view(CellGrid).cursor_cells()
        if where is not None:
            lane, first, last = where
            owner = int(lane.frame.owner[first]) if last - first == 1 else -1
            if owner >= 0:
                self.selected_seq = owner
            elif owner == SHARED:
                st = self.watcher.mirror.caches[lane.cache].streams[lane.stream]
                held = [s for s in range(256) if st.holds(s)[first]]
                self.selected_seq = held[0] if held else self.selected_seq
        self._draw([])

    def action_next_seq(self, direction: int = 1) -> None:
        if self.blocks_mode:  # tab: the next worker, as it is the next sequence of the cells
            self._view(BlockLanes).to_worker(direction)
            self._draw_block_panels()
            self._view("#title", FittedLine).show_parts(self._blocks_title())
            return
        present = sorted({s for cache in self.watcher.mirror.caches.values() for st in cache.streams
                          for s in range(256) if st.holds(s).any()}, reverse=direction < 0)
        if not present:
            return
        current = self.selected_seq if self.selected_seq is not None else (-1 if direction > 0 else 256)
        after = [s for s in present if (s > current if direction > 0 else s < current)]
        self.selected_seq = after[0] if after else present[0]
        self._draw([])

    def action_toggle_window(self) -> None:
        self.show_window = not self.show_window
        self._draw([])

    def action_toggle_attention(self) -> None:
        self.show_attention = not self.show_attention
        if self.show_attention and not self.attention.seq_ids():
            self.notify("no attention events yet: start the session with publish_attention on "
                        "(kvscope tui --attention)", severity="warning")
        self._draw([])

    def action_show_mask(self) -> None:
        """The last ubatch's attention mask: its tokens x the cells (tui/mask.py)."""
        self.push_screen(MaskScreen(lambda: self.watcher))

    def action_zoom(self, direction: int) -> None:
        grid = self._view(CellGrid)
        grid.set_zoom(grid.zoom * 2 if direction > 0 else grid.zoom // 2)
        self._draw([])

    # ---- commands ----------------------------------------------------------------------------------
    def _session(self):
        if self.attached:
            self.refuse_command()
            return None
        if not self.source.live:
            self.notify("a recording cannot be changed: only replayed", severity="warning")
            return None
        return self.source.session

    def command(self, name: str, future: Future, done: str = "") -> None:
        """Report a session command's outcome when it comes (from the session's thread)."""
        def report(f: Future) -> None:
            error = f.exception()
            message = f"{name}: {type(error).__name__}: {error}" if error else (done.format(result=f.result())
                                                                                 if done else "")
            if message:
                self.call_from_thread(self.notify, message, severity="error" if error else "information")

        future.add_done_callback(report)

    # ---- replay -----------------------------------------------------------------------------------
    def action_replay_step(self, n: int) -> None:
        if self.source.replay is not None:
            self.playing = False
            self.source.replay.step(n)

    def action_replay_seek(self, fraction: float) -> None:
        if self.source.replay is not None:
            self.playing = False
            self.source.replay.seek_fraction(fraction)

    def action_replay_jump(self, direction: int) -> None:
        """To the next (or previous) event of the kinds the log's filter shows, of the selected sequence
        when the log follows one."""
        replay = self.source.replay
        if replay is None:
            return
        log = self._view(EventLog)
        if log.filter.jump(replay, direction) is None:
            self.notify(f"no {'later' if direction > 0 else 'earlier'} event of that kind", severity="warning")

    def action_toggle_run(self) -> None:
        replay = self.source.replay
        if replay is not None:
            if not self.playing and replay.at_end:
                replay.seek(-1)  # played to the end: play it again
            self.playing = not self.playing
            return
        session = self._session()
        if session is None:
            return
        running = self.watcher.status is not None and self.watcher.status.state in ("running", "idle")
        self.command("pause" if running else "start", session.pause() if running else session.start())

    def action_step(self) -> None:
        session = self._session()
        if session is not None:
            self.command("step", session.step(1))

    def action_prompt(self) -> None:
        if self._session() is None:
            return

        def add(text: str | None) -> None:
            if text:
                self.command("add_prompt", self.source.session.add_prompt(text), done="prompt added: {result}")

        self.push_screen(PromptScreen(), add)

    def action_seq_op(self, op: str) -> None:
        session = self._session()
        seq = self.selected_seq
        if session is None:
            return
        if seq is None:
            self.notify("select a sequence first (move the cursor onto one of its cells, or tab)", severity="warning")
            return
        if op == "rm":
            self.command("seq_rm", session.seq_rm(seq, -1, -1), done=f"seq {seq} removed")
        elif op == "keep":
            self.command("seq_keep", session.seq_keep(seq), done=f"only seq {seq} kept")
        elif op == "cp":
            dst = self._free_seq()
            self.command("seq_cp", session.seq_cp(seq, dst, -1, -1), done=f"seq {seq} copied to seq {dst}")
        elif op == "shift":
            self.command("context_shift", session.context_shift(seq, n_keep=4),
                         done=f"context shift of seq {seq}: {{result}} positions discarded")

    def _free_seq(self) -> int:
        return free_seq(self.watcher.mirror)

    def action_settings(self) -> None:
        session = self._session()
        if session is None:
            return
        current = dict(session.status().settings)

        def apply(settings: dict | None) -> None:
            if settings:
                self.command("rebuild", session.rebuild(**settings), done="context rebuilt")

        self.push_screen(SettingsScreen(current, session.estimate, apply), apply)

    def action_record(self) -> None:
        if self.attached:  # kvscope attach -o FILE records a watched llama.cpp from its first line
            self.refuse_command()
            return
        if self.recorder is not None:
            self.recorder.close()
            self.notify(f"recording written: {self.recorder.n_events} events to {self.recorder.path}")
            self.recorder = None
            return
        bus = getattr(self.source.session, "bus", None)
        if bus is None:
            self.notify("recording needs a session run here (not a remote one or a replay)", severity="warning")
            return
        path = Path(f"kvscope-{time.strftime('%Y%m%d-%H%M%S')}.kvtrace")
        self.recorder = Recorder(path)
        self.recorder.attach(bus)
        self.recorder.start()
        self.notify(f"recording to {path} (r again to stop)")

    def action_log_group(self) -> None:
        self._view(EventLog).cycle_group()
        self._refilter_log()

    def action_log_seq(self) -> None:
        self._view(EventLog).toggle_seq(self.selected_seq)
        self._refilter_log()

    def action_log_cache(self) -> None:
        where = self._view(CellGrid).cursor_cells()
        self._view(EventLog).toggle_cache(where[0].cache if where else None)
        self._refilter_log()

    def watch_theme(self, _theme: str) -> None:
        """Colours follow the background (engine/watch/style.py): redraw the log in the new theme's."""
        if self.screen_stack and self.screen_stack[0].is_mounted and self.frames_drawn:
            if self.blocks_mode:
                self._draw_blocks()
                self._view(BlockLanes).refresh()
                return
            self._refilter_log()
            self._view(CellGrid).refresh()

    def _refilter_log(self) -> None:
        """A new filter applies to what the log already showed too: redraw it from the watcher's recent
        events."""
        log = self._view(EventLog)
        log.clear()
        log.add_events(list(self.watcher.recent))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(replay=self.source.replay is not None, attached=self.attached,
                                    blocks=self.blocks_mode))

    async def action_quit(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self.exit()


# each key's action, by its name without arguments ("seq_op", not "seq_op('rm')")
_KEY_ACTIONS = {key.strip(): binding.action.partition("(")[0] for binding in KvscopeApp.BINDINGS
                 for key in binding.key.split(",")}
