"""Explorer: every view of the notebook explorer on one source, with the controls of a live session.

    from explorer import Explorer
    Explorer()                                   # the demo session (the parallel workload, running)
    Explorer("model.gguf", "-c 512 -np 4 -kvu")  # a model run here, with `kvscope tui`'s flags
    Explorer("run.kvtrace")                      # a recording, scrubbed with the timeline
    Explorer("tcp://127.0.0.1:5757")             # a session served by `kvscope serve`
    Explorer(session)                            # a Session (or RemoteSession) made by hand
    Explorer.attach(command="llama-server -m model.gguf -np 2")   # a real llama.cpp's cache, from its log
    Explorer.attach("server.log", follow=True)   # a log llama.cpp writes elsewhere (LLAMA_KV_CACHE_DEBUG=3, -v)
    Explorer.attach(vllm=["tcp://10.0.0.5:5557,tcp://10.0.0.5:5558"], tokenizer="tokenizer.json")  # vLLM / SGLang

A vLLM or SGLang deployment (its workers' ZeroMQ KV events) has no cells: its views are the block views
(explorer/blocks.py: a lane of blocks per worker and tier, the prefix tree, the router's view, the evictions)
in place of the cell grids, the window and the memory bars.

How it stays live without a thread of its own: a session run here redraws the views on its worker
(Session.on_change, coalesced to `every_s`), and every control's redraw is queued to that worker too
(Session.call), so two redraws never overlap and the kernel stays free to run other cells. A remote
session, a llama.cpp log and KV events (Explorer.attach), are redrawn on the kernel's own thread, driven by a
ticker widget (Ticker) ticking in the browser; a recording only moves when its timeline does. A log has no
controls: kvscope only watches a real llama.cpp.
Views slower to draw than every_s are redrawn less often instead of queueing up, each redraw drawing the
latest state, and the status line says so (explorer/pacing.py).

What the engine logs while it works for a session run here (llama.cpp's lines: "context full, swapping:
...") is kept by the session (Session.log) and shown in the explorer's engine log, under the event log,
never written under whichever cell runs next.
"""
from __future__ import annotations

import collections
import html
import shlex
import time
from pathlib import Path

import anywidget
import ipywidgets as widgets
import traitlets

from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.launch import source_from_flags
from engine.watch import lifetime
from engine.watch.describe import _health_parts, cache_title, held_seqs, status_parts, tokens_per_second
from engine.watch.sources import Source, kv_events_source, remote_source, replay_source, session_source
from explorer.blocks import BlockViews, stats_html
from explorer.controls import SessionControls
from explorer.event_log import EventLog
from explorer.grid import CellGrid
from explorer.mask import MaskView
from explorer.memory import MemoryBars
from explorer.pacing import RedrawPacer
from explorer.server import ServerView
from explorer.session_log import SessionLogPanel
from explorer.settings import SettingsPanel
from explorer.timeline import Timeline
from explorer.view import Shown, choose, observe_value, replace_options, row
from explorer.window import SwaWindow

NO_SEQ = "none"
TONE_STYLES = {"running": "font-weight:bold; color:#009E73", "state": "font-weight:bold", "error": "color:#C00000",
               "warning": "color:#B8860B", "": ""}


class Ticker(anywidget.AnyWidget):
    """The follow ticker: `value` goes up every `interval` ms while a view of it is on the page and `playing` (its
    button pauses and resumes). A Play widget made with playing=True never ticks: ipywidgets 8's PlayView starts
    its timer only when `playing` changes while it is shown, and the browser shows it after it was made."""

    _esm = """
    function render({ model, el }) {
      const button = document.createElement("button");
      button.className = "jupyter-button";
      const label = () => {
        button.textContent = model.get("playing") ? "following: pause" : "paused: follow";
        button.title = model.get("playing") ? "stop redrawing as the source changes" : "redraw as the source changes";
      };
      button.onclick = () => { model.set("playing", !model.get("playing")); model.save_changes(); };
      model.on("change:playing", label);
      label();
      el.appendChild(button);
      const timer = setInterval(() => {
        if (model.get("playing")) { model.set("value", model.get("value") + 1); model.save_changes(); }
      }, model.get("interval"));
      return () => { clearInterval(timer); model.off("change:playing", label); };
    }
    export default { render };
    """
    value = traitlets.Int(0).tag(sync=True)
    interval = traitlets.Int(200).tag(sync=True)  # ms
    playing = traitlets.Bool(True).tag(sync=True)


def open_source(source=None, flags: str | list[str] = (), *, start: bool = True) -> Source:
    """What the explorer shows: see the module docstring."""
    if source is None:
        return source_from_flags(flags, start=start)
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, Path)):
        text = str(source)
        if text.endswith(".kvtrace"):
            return replay_source(text)
        words = shlex.split(flags) if isinstance(flags, str) else list(flags)
        if text.startswith("tcp://"):
            return source_from_flags(["--connect", text, *words])
        return source_from_flags(["-m", text, *words], start=start)
    if hasattr(source, "bus"):
        return session_source(source, label=source.status().model)
    return remote_source(source)


# A live grid redraws every 0.2 s, or every 0.4 s beyond LARGE_GRID_CELLS cells: a 16k-cell grid every 0.2 s
# saturated headless Chromium 150 on the 2-core machine (a cell run meanwhile ran in the kernel within 1 s,
# but its output reached the page 4-11 s later, behind the queued grid updates); every 0.4 s, 0.5 s.
LARGE_GRID_CELLS = 8192
# KV events come in bursts of batches and the workers' rates are over 5 s: two redraws a second show them, and
# leave a large deployment's fold and tree (a few hundred ms at 100k blocks) room between ticks.
BLOCKS_EVERY_S = 0.5


def default_every_s(n_cells: int) -> float:
    """How often a live explorer redraws a grid of n_cells cells (all caches and streams), by default."""
    return 0.4 if n_cells > LARGE_GRID_CELLS else 0.2


class Explorer(Shown):
    """The cell grids, SWA window, memory bars, event log and timeline of a source, and its controls; for a
    vLLM / SGLang deployment (a "kv-events" source) the block views instead of the grids, window and bars."""

    def __init__(self, source=None, flags: str | list[str] = (), *, columns: int = 64, dark: bool = False,
                 every_s: float | None = None, start: bool = True, history: bool = True,
                 attention: bool = False) -> None:
        """source, flags: see the module docstring; columns: cells per grid row; dark: colours for a dark
        page; every_s: at most this often a live session redraws (None: default_every_s of its cells);
        start: run the demo or the model at once; history: record a live session so the timeline can
        scrub back (a temporary .kvtrace)."""
        self.source = open_source(source, flags, start=start)
        self.session = self.source.session
        self.local = self.session is not None and hasattr(self.session, "bus")
        self.selected_seq: int | None = None
        self._steps: list[ev.WorkloadStep] = []
        self.update_seconds: collections.deque[float] = collections.deque(maxlen=100)
        self._events_seen = 0
        self.kv_events = self.source.shows_blocks
        watcher = self.source.watcher
        if every_s is None and self.kv_events:
            every_s = BLOCKS_EVERY_S
        elif every_s is None:
            watcher.poll()  # the caches' sizes arrive with the source's first events
            every_s = default_every_s(sum(c.size * len(c.streams) for c in watcher.mirror.caches.values()))
        self.every_s = every_s
        self.pacer = RedrawPacer(every_s)
        self.log = EventLog(watcher, dark=dark)
        self.server = ServerView(watcher, dark=dark)
        # a deployment's workers hold hashed blocks, not cells: no grid, window or memory bars to draw for them
        self.grid = self.window = self.bars = self.blocks = self.mask = None
        if self.kv_events:
            self.blocks = BlockViews(watcher, columns=columns, dark=dark, status_line=False)  # the explorer's says it
            self.views = [self.blocks, self.log, self.server]
        else:
            self.grid = CellGrid(watcher, columns=columns, dark=dark, attention=attention)
            self.window = SwaWindow(watcher, dark=dark)
            self.bars = MemoryBars(watcher)
            # drawn only while its panel is open: a mask is the last ubatch's tokens x every cell up to n_kv
            self.mask = MaskView(watcher, dark=dark)
            self.views = [self.grid, self.window, self.bars, self.log, self.server]
        # the engine's own lines, kept by a session run here (a remote one's stay on its server)
        self.session_log = SessionLogPanel(self.session) if self.local else None
        if self.grid is not None:
            self.grid.on_cell_click = self._cell_clicked
        self.header, self.status = widgets.HTML(), widgets.HTML()
        self._make_selection(attention)

        self.controls = SessionControls(self.session, watcher, lambda: self.selected_seq) \
            if self.session is not None else None
        self.settings = SettingsPanel(self.session, self.controls.tell) if self.session is not None else None
        self.timeline = self._timeline(history)
        self.widget = self._lay_out()
        self._ticker = None
        self._stop_following = self._follow(every_s)
        self.update()
        lifetime.close_at_exit(self, lifetime.FRONT_ENDS)

    @classmethod
    def attach(cls, log: str | Path | None = None, command: str | list[str] | None = None, *, follow: bool = False,
               passthrough: str | Path | None = None, vllm: str | list[str] | None = None,
               tokenizer: str | Path | None = None, topic: str = "", capacity_blocks: int = 0,
               **options) -> Explorer:
        """The explorer on a real llama.cpp's cache, read from its own log (engine/runners/attach.py): a saved
        log (`log`, with `follow` to keep reading as it grows), or a command started here (`command`, a list
        or a string split as a shell would; LLAMA_KV_CACHE_DEBUG=3 and -v are added, its raw output goes to
        `passthrough`, by default a temporary file). The process ends when the explorer is closed (or the
        kernel stops).
        Or on a vLLM / SGLang deployment's prefix caches, from its workers' ZeroMQ KV events (`vllm`: their
        publishers' endpoints, "tcp://HOST:PORT" or "tcp://HOST:PORT,tcp://HOST:REPLAY_PORT", one or a list;
        `tokenizer`: a tokenizer.json, a Hugging Face folder or a GGUF, so that blocks show their text; `topic`:
        the publishers' topic; `capacity_blocks`: the blocks a worker holds at most, where known). Closing the
        explorer disconnects. options: as for Explorer(...)."""
        if vllm is not None:
            llama_cpp = {"log": log, "command": command, "follow": follow or None, "passthrough": passthrough}
            given = [name for name, value in llama_cpp.items() if value is not None]
            if given:
                raise KvscopeError(f"attach: vllm= watches vLLM / SGLang publishers, {'= and '.join(given)}= a "
                                   f"llama.cpp; give one or the other")
            source = kv_events_subscription(vllm, tokenizer=tokenizer, topic=topic, capacity_blocks=capacity_blocks)
        else:
            vllm_only = {"tokenizer": tokenizer, "topic": topic or None, "capacity_blocks": capacity_blocks or None}
            given = [name for name, value in vllm_only.items() if value is not None]
            if given:
                raise KvscopeError(f"attach: {'= and '.join(given)}= go with vllm= (a vLLM / SGLang deployment's "
                                   f"KV events), not with a llama.cpp log or command")
            from engine.runners.launch import attached_log_source

            source = attached_log_source(log, command, follow=follow, passthrough=passthrough)
        try:
            return cls(source, **options)
        except BaseException:
            source.close()
            raise

    def _follow(self, every_s: float):
        """Redraw live: a local session's worker redraws (and runs the controls' redraws); a remote one and a
        llama.cpp log are ticked from the browser on the kernel's thread; a recording only moves with its
        timeline. Returns what stops it (None: nothing to stop)."""
        if self.local:
            for view in [*self.views, self.session_log]:
                view.runner = self.session.call
            return self.session.on_change(self.update, every_s)
        if self.session is not None or self.source.attached is not None:
            self._ticker = Ticker(interval=int(every_s * 1000))
            self._ticker.observe(lambda _: self._tick(), names="value")
            self.widget.children = (*self.widget.children, self._ticker)
        return None

    def _make_selection(self, attention: bool) -> None:
        """The row that chooses what the views show: the sequence, its attention (mean or a layer), and
        where the export buttons write."""
        self.seq_menu = widgets.Dropdown(options=[NO_SEQ], value=NO_SEQ, description="sequence",
                                         layout=widgets.Layout(width="180px"))
        self.attention_box = widgets.Checkbox(value=attention, description="attention", indent=False,
                                              tooltip="its last token's attention over the grid (publish_attention)",
                                              layout=widgets.Layout(width="110px"))
        self.layer_menu = widgets.Dropdown(options=["mean"], value="mean", description="layer",
                                           layout=widgets.Layout(width="140px"), style={"description_width": "40px"})
        self.export_path = widgets.Text(value="kvscope-view", description="export", layout=widgets.Layout(width="280px"))
        self.export_html_button = widgets.Button(description="HTML", tooltip="a standalone page of the grids and bars",
                                                 layout=widgets.Layout(width="70px"))
        self.export_png_button = widgets.Button(description="PNG", tooltip="an image for slides (kaleido + Chromium)",
                                                layout=widgets.Layout(width="70px"))
        observe_value(self.seq_menu, lambda seq: self._later(lambda: self.select(None if seq == NO_SEQ else int(seq))))
        self.attention_box.observe(lambda _: self._later(self._attention_changed), names="value")
        observe_value(self.layer_menu, lambda _: self._later(self._attention_changed))
        self.export_html_button.on_click(lambda _: self._export("html"))
        self.export_png_button.on_click(lambda _: self._export("png"))

    def _timeline(self, history: bool) -> Timeline | None:
        if self.source.replay is not None:
            timeline = Timeline(path=Path(self.source.label), replay=self.source.replay)
            for view in self.views:
                view.show(timeline.watcher)
        elif self.local and history:
            timeline = Timeline.of_session(self.session, self.source.watcher)
        else:
            return None
        timeline.attach(*self.views)
        timeline.moved = lambda: self._draw_status(timeline.watcher)
        return timeline

    def _lay_out(self) -> widgets.Widget:
        exports = [self.export_path, self.export_html_button, self.export_png_button]
        if self.kv_events:  # no sequences, attention or layers: blocks are named by hash and prefix
            selection, main = row(exports), self.blocks.widget
        else:
            selection = row([self.seq_menu, self.attention_box, self.layer_menu, *exports])
            main = row([self.grid.widget, widgets.VBox([self.bars.widget, self.window.widget])])
            main.layout.align_items = "flex-start"
        parts = [self.header, self.status]
        if self.controls is not None:
            parts.append(self.controls.widget)
        if self.settings is not None:
            accordion = widgets.Accordion(children=[self.settings.widget])
            accordion.set_title(0, "settings (rebuild the context; the estimate shows first)")
            accordion.selected_index = None
            parts.append(accordion)
        self.server.widget.layout.display = "none"  # until the source runs a server
        parts += [selection, main]
        if self.mask is not None:
            parts.append(self._mask_panel())
        parts.append(self.server.widget)
        if self.timeline is not None:
            parts.append(self.timeline.widget)
        parts.append(self.log.widget)
        if self.session_log is not None:
            parts.append(self.session_log.widget)
        return widgets.VBox(parts)

    def _mask_panel(self) -> widgets.Widget:
        """The attention mask of the last ubatch (the terminal explorer's `m`), folded until opened, with the
        cache it shows."""
        self.mask_cache = widgets.Dropdown(options=["base"], value="base", description="cache",
                                           layout=widgets.Layout(width="160px"), style={"description_width": "40px"})
        observe_value(self.mask_cache, lambda cache: self._later(lambda: self.mask.select(cache)))
        self.mask_panel = widgets.Accordion(children=[widgets.VBox([self.mask_cache, self.mask.widget])])
        self.mask_panel.set_title(0, "attention mask of the last ubatch (its tokens x the cells)")
        self.mask_panel.selected_index = None
        self.mask_panel.observe(lambda change: self._later(self._update_mask) if change["new"] == 0 else None,
                                names="selected_index")
        return self.mask_panel

    def _update_mask(self) -> None:
        """Redraw the mask if its panel is open (the caches it may show follow the source's)."""
        if self.mask is None or self.mask_panel.selected_index != 0:
            return
        replace_options(self.mask_cache, list(self.mask.watcher.mirror.caches) or ["base"])
        self.mask.select(self.mask_cache.value)

    # ---- drawing ------------------------------------------------------------------------------------
    def update(self) -> None:
        """Redraw every view from what arrived (while the timeline is live); the header and status always.
        Its times (seconds, the latest 100) are kept in `update_seconds`."""
        started = time.monotonic()
        self._update()
        ended = time.monotonic()
        self.update_seconds.append(ended - started)
        self.pacer.drawn(started, ended)

    def _tick(self) -> None:
        """The follow ticker's redraw (a remote session), unless it queued behind a slow one (RedrawPacer)."""
        if self.pacer.due():
            self.update()

    def _update(self) -> None:
        watcher = self.source.watcher if self.timeline is None else self.timeline.watcher
        if self.timeline is None or self.timeline.live:
            watcher.poll()
            self._read_steps(watcher)
            for view in self.views:
                view.update()
            self._update_mask()
            if self.timeline is not None:
                self.timeline.follow_live()
        if self.session_log is not None:
            self.session_log.update()
        self._offer_seqs(watcher)
        self._draw_status(watcher)
        self.server.widget.layout.display = None if watcher.server.active else "none"

    def _read_steps(self, watcher) -> None:
        new = watcher.events_since(self._events_seen)
        self._events_seen = watcher.events
        self._steps = (self._steps + [e for e in new if isinstance(e, ev.WorkloadStep)])[-256:]

    def _draw_status(self, watcher) -> None:
        if self.kv_events:
            self._draw_blocks_status(watcher)
            return
        created = watcher.mirror.created
        model = next(iter(created.values())).model_name if created else "?"
        status = watcher.status
        where = self.source.kind if self.timeline is None or self.timeline.live else \
            f"{self.source.kind} · timeline at event {self.timeline.replay.position + 1} of {len(self.timeline.replay)}"
        self.header.value = (f"<b>kvscope</b> · {html.escape(model)} · {html.escape(status.workload if status else '?')}"
                             f" · {html.escape(where)} · <span style='opacity:0.7'>{html.escape(self.source.label)}</span>"
                             f"<br><span style='opacity:0.7'>{' | '.join(html.escape(cache_title(c)) for c in created.values())}</span>")
        parts = []
        for text, tone in status_parts(watcher, with_error=True):
            parts.append(f"<span style='{TONE_STYLES[tone]}'>{html.escape(text)}</span>")
            if text.startswith("step "):
                parts.append(f"{tokens_per_second(self._steps, time.monotonic()):.0f} tok/s")
        self.status.value = " · ".join(parts + self._pacing_parts())

    def _pacing_parts(self) -> list[str]:
        slow = self.pacer.slowed()
        if slow is None:
            return []
        n = self.pacer.skipped
        skipped = f", {n} tick{'s' if n != 1 else ''} skipped" if n else ""
        return [f"<span style='{TONE_STYLES['warning']}'>views behind: a redraw takes {slow * 1e3:.0f} ms; "
                f"redrawing at most every {2 * slow:.1f} s{skipped}</span>"]

    def _draw_blocks_status(self, watcher) -> None:
        """A deployment's header (what is watched) and status line: whether the subscriber reads, and how the
        reading of its publishers goes (block_views.stats_text, from their KvEventStats)."""
        status = watcher.status
        state = status.state if status else "attached"
        self.header.value = (f"<b>kvscope</b> · {html.escape(self.source.kind)} · "
                             f"<span style='opacity:0.7'>{html.escape(self.source.label)}</span>")
        tone = "running" if state == "attached" else "error" if state == "stopped" else "state"
        parts = [f"<span style='{TONE_STYLES[tone]}'>{html.escape(state)}</span>"]
        if status is not None and status.message and state != "attached":
            parts.append(html.escape(status.message))
        parts.append(stats_html(watcher.mirror.blocks))
        # behind, dropped, stale: as a session's status line says it (describe.py has no public name for it yet)
        parts += [f"<span style='{TONE_STYLES[tone]}'>{html.escape(text)}</span>"
                  for text, tone in _health_parts(watcher)]
        self.status.value = " · ".join(parts + self._pacing_parts())

    def _offer_seqs(self, watcher) -> None:
        if self.kv_events:
            return
        replace_options(self.seq_menu, [NO_SEQ, *(str(s) for s in held_seqs(watcher.mirror))])
        layers = sorted(i for c in watcher.mirror.created.values() for i in c.layer_ids)
        replace_options(self.layer_menu, ["mean", *(str(i) for i in layers)])

    # ---- selection ----------------------------------------------------------------------------------
    def select(self, seq: int | None) -> None:
        """The sequence whose window, attention and operations the views show (None: none)."""
        self.selected_seq = seq
        if self.grid is None:
            return  # a deployment's blocks belong to no sequence
        self.grid.select(seq)
        self.window.select(seq)
        choose(self.seq_menu, NO_SEQ if seq is None else str(seq))  # the menu follows a click on the grid

    def _cell_clicked(self, cache: str, stream: int, cell: int) -> None:
        def select() -> None:
            seqs = self.grid.cell_seqs(cache, stream, cell)
            if seqs:
                self.select(seqs[0])
        self._later(select)

    def _attention_changed(self) -> None:
        if self.grid is None:
            return
        layer = None if self.layer_menu.value == "mean" else int(self.layer_menu.value)
        self.grid.show_attention(self.attention_box.value, layer)

    def _later(self, draw) -> None:
        """A redraw a control asked for, where redraws run (the session's worker for a local session)."""
        if self.local:
            self.session.call(draw)
        else:
            draw()

    # ---- export -------------------------------------------------------------------------------------
    def figures(self) -> list:
        """The grids, the window and the memory bars, and a server's turns when it runs one (what
        export_html and export_png write); of a deployment, the block lanes and the prefix tree."""
        if self.kv_events:
            return self.blocks.figures()
        shown = [self.grid.figure, self.window.figure, self.bars.figure]
        return shown + ([self.server.figure] if self.server.server.active else [])

    def _export(self, kind: str) -> None:
        tell = self.controls.tell if self.controls is not None else None
        path = Path(self.export_path.value.strip() or "kvscope-view").with_suffix(f".{kind}")
        try:
            done = self.export_html(path) if kind == "html" else self.export_png(path)
        except Exception as e:  # noqa: BLE001 - told on the message line, never raised into the notebook
            if tell:
                tell(f"export failed: {e}", False)
            return
        if tell:
            tell(f"exported to {done}")

    # ---- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop following, stop recording, close the source (a session run here is closed)."""
        lifetime.discard(self)
        if self._stop_following is not None:
            self._stop_following()
        if self.controls is not None:
            self.controls.close()
        if self.timeline is not None:
            self.timeline.close()
        self.source.close()


def kv_events_subscription(endpoints: str | list[str], *, tokenizer: str | Path | None = None, topic: str = "",
                           capacity_blocks: int = 0) -> Source:
    """A "kv-events" source reading these publishers (engine/watch/kv_events), already reading: its watcher
    subscribes before the subscriber starts, so it gets every event from the first batch."""
    from engine.watch.kv_events.subscriber import KvEventSubscriber

    if isinstance(endpoints, (str, Path)):
        endpoints = [str(endpoints)]
    vocabulary = None
    if tokenizer is not None:
        from engine.watch.kv_events.vocabulary import load_vocabulary

        vocabulary = load_vocabulary(tokenizer)
    subscriber = KvEventSubscriber(list(endpoints), topic=topic, vocabulary=vocabulary,
                                   capacity_blocks=capacity_blocks, start=False)
    try:
        source = kv_events_source(subscriber)
        subscriber.start()
        return source
    except BaseException:
        subscriber.close()
        raise
