"""Explorer: every view of the notebook explorer on one source, with the controls of a live session.

    from explorer import Explorer
    Explorer()                                   # the demo session (the parallel workload, running)
    Explorer("model.gguf", "-c 512 -np 4 -kvu")  # a model run here, with `kvscope tui`'s flags
    Explorer("run.kvtrace")                      # a recording, scrubbed with the timeline
    Explorer("tcp://127.0.0.1:5757")             # a session served by `kvscope serve`
    Explorer(session)                            # a Session (or RemoteSession) made by hand
    Explorer.attach(command="llama-server -m model.gguf -np 2")   # a real llama.cpp's cache, from its log
    Explorer.attach("server.log", follow=True)   # a log llama.cpp writes elsewhere (LLAMA_KV_CACHE_DEBUG=3, -v)

How it stays live without a thread of its own: a session run here redraws the views on its worker
(Session.on_change, coalesced to `every_s`), and every control's redraw is queued to that worker too
(Session.call), so two redraws never overlap and the kernel stays free to run other cells. A remote
session, and a llama.cpp log (Explorer.attach), are redrawn on the kernel's own thread, driven by a Play
widget ticking in the browser; a recording only moves when its timeline does. A log has no controls:
kvscope only watches a real llama.cpp.
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

import ipywidgets as widgets

from engine import events as ev
from engine.runners.launch import source_from_flags
from engine.watch import lifetime
from engine.watch.describe import cache_title, held_seqs, status_parts, tokens_per_second
from engine.watch.sources import Source, remote_source, replay_source, session_source
from explorer.controls import SessionControls
from explorer.event_log import EventLog
from explorer.grid import CellGrid
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


def default_every_s(n_cells: int) -> float:
    """How often a live explorer redraws a grid of n_cells cells (all caches and streams), by default."""
    return 0.4 if n_cells > LARGE_GRID_CELLS else 0.2


class Explorer(Shown):
    """The cell grids, SWA window, memory bars, event log and timeline of a source, and its controls."""

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
        watcher = self.source.watcher
        if every_s is None:
            watcher.poll()  # the caches' sizes arrive with the source's first events
            every_s = default_every_s(sum(c.size * len(c.streams) for c in watcher.mirror.caches.values()))
        self.every_s = every_s
        self.pacer = RedrawPacer(every_s)
        self.grid = CellGrid(watcher, columns=columns, dark=dark, attention=attention)
        self.window = SwaWindow(watcher, dark=dark)
        self.bars = MemoryBars(watcher)
        self.log = EventLog(watcher, dark=dark)
        self.server = ServerView(watcher, dark=dark)
        self.views = [self.grid, self.window, self.bars, self.log, self.server]
        # the engine's own lines, kept by a session run here (a remote one's stay on its server)
        self.session_log = SessionLogPanel(self.session) if self.local else None
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
               passthrough: str | Path | None = None, **options) -> Explorer:
        """The explorer on a real llama.cpp's cache, read from its own log (engine/runners/attach.py): a saved
        log (`log`, with `follow` to keep reading as it grows), or a command started here (`command`, a list
        or a string split as a shell would; LLAMA_KV_CACHE_DEBUG=3 and -v are added, its raw output goes to
        `passthrough`, by default a temporary file). The process ends when the explorer is closed (or the
        kernel stops). options: as for Explorer(...)."""
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
            self._ticker = widgets.Play(interval=int(every_s * 1000), max=10**9, show_repeat=False,
                                        description="follow", playing=True)
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
        selection = row([self.seq_menu, self.attention_box, self.layer_menu, self.export_path,
                                  self.export_html_button, self.export_png_button])
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
        parts += [selection, main, self.server.widget]
        if self.timeline is not None:
            parts.append(self.timeline.widget)
        parts.append(self.log.widget)
        if self.session_log is not None:
            parts.append(self.session_log.widget)
        return widgets.VBox(parts)

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
        slow = self.pacer.slowed()
        if slow is not None:
            n = self.pacer.skipped
            skipped = f", {n} tick{'s' if n != 1 else ''} skipped" if n else ""
            parts.append(f"<span style='{TONE_STYLES['warning']}'>views behind: a redraw takes {slow * 1e3:.0f} ms; "
                         f"redrawing at most every {2 * slow:.1f} s{skipped}</span>")
        self.status.value = " · ".join(parts)

    def _offer_seqs(self, watcher) -> None:
        replace_options(self.seq_menu, [NO_SEQ, *(str(s) for s in held_seqs(watcher.mirror))])
        layers = sorted(i for c in watcher.mirror.created.values() for i in c.layer_ids)
        replace_options(self.layer_menu, ["mean", *(str(i) for i in layers)])

    # ---- selection ----------------------------------------------------------------------------------
    def select(self, seq: int | None) -> None:
        """The sequence whose window, attention and operations the views show (None: none)."""
        self.selected_seq = seq
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
        export_html and export_png write)."""
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
