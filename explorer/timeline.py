"""A timeline slider that scrubs through a run: the views show the cache as it was right after the event
the slider stands on. It scrubs a recording, or the live session's history: a session's timeline
records every event to a file as it runs (engine/watch's Recorder, about 36 KiB per 1000 events), and
moving the slider opens that file as it stands, so the session can go on running meanwhile; "live"
returns the views to the session.

Either way the views are drawn from a Replay's watcher (engine/watch/replay.py), the object a live view
draws from, so a view needs nothing to be scrubbed but `show(timeline.watcher)`."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import ipywidgets as widgets

from engine.watch.describe import EVENT_GROUPS, EventFilter, describe_event
from engine.watch.recording import Recorder
from engine.watch.replay import Replay
from engine.watch.watcher import Watcher
from explorer.view import row


class Timeline:
    """Scrub a recording (`Timeline.open(path)`) or a session's history (`Timeline.of_session(session)`).

    attach(*views): the views it redraws when it moves; `watcher` is what they draw from (the replay's,
    or the live watcher while live). Moves: seek(i), step(n), jump(direction) to the next event the
    filter keeps, go_live()."""

    def __init__(self, *, path: Path, replay: Replay | None = None, live_watcher: Watcher | None = None,
                 recorder: Recorder | None = None, runner: Callable[[Callable[[], object]], object] | None = None) -> None:
        """A recording's timeline (path; replay: one already open on it), or a live session's (live_watcher,
        and the recorder writing its history to path)."""
        self.path, self.live_watcher, self.recorder, self.runner = path, live_watcher, recorder, runner
        if replay is None and recorder is None:
            replay = Replay.open(path)
        self.replay: Replay | None = replay
        self.views: list = []
        self.moved: Callable[[], None] | None = None  # called after every move (the explorer's header)
        self.filter = EventFilter()
        self._setting = False  # the slider is being moved by the code, not by a person
        self.slider = widgets.IntSlider(min=0, max=0, value=0, description="event", continuous_update=False,
                                        layout=widgets.Layout(width="420px"))
        self.play = widgets.Play(min=0, max=0, interval=100, step=1, description="play")
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.back = widgets.Button(icon="step-backward", tooltip="one event back")
        self.forward = widgets.Button(icon="step-forward", tooltip="one event on")
        self.previous_kind = widgets.Button(icon="fast-backward", tooltip="the previous event of the kind chosen")
        self.next_kind = widgets.Button(icon="fast-forward", tooltip="the next event of the kind chosen")
        self.kind = widgets.Dropdown(options=EVENT_GROUPS, value="all", layout=widgets.Layout(width="110px"))
        self.live_button = widgets.ToggleButton(value=self.live, description="live", tooltip="follow the session",
                                                disabled=recorder is None)
        for button in (self.back, self.forward, self.previous_kind, self.next_kind):
            button.layout = widgets.Layout(width="42px")
        self.label = widgets.HTML()
        self.back.on_click(lambda _: self._later(lambda: self.step(-1)))
        self.forward.on_click(lambda _: self._later(lambda: self.step(1)))
        self.previous_kind.on_click(lambda _: self._later(lambda: self.jump(-1)))
        self.next_kind.on_click(lambda _: self._later(lambda: self.jump(1)))
        self.kind.observe(lambda change: setattr(self, "filter", EventFilter(change["new"])), names="value")
        self.slider.observe(self._slider_moved, names="value")
        self.live_button.observe(self._live_toggled, names="value")
        self.widget = widgets.VBox([
            row([self.play, self.previous_kind, self.back, self.slider, self.forward, self.next_kind,
                          self.kind, self.live_button]),
            self.label])
        if self.replay is not None:
            self._show_position()

    @classmethod
    def open(cls, path: str | Path) -> Timeline:
        """The timeline of a recording."""
        return cls(path=Path(path))

    @classmethod
    def of_session(cls, session, live_watcher: Watcher, path: str | Path | None = None) -> Timeline:
        """The timeline of a live session's history, recorded from now on to `path` (default: a file in the
        temporary folder, left there for the user to keep)."""
        if path is None:
            path = Path(tempfile.mkstemp(prefix="kvscope-history-", suffix=".kvtrace")[1])
        recorder = Recorder(path)
        recorder.attach(session.bus)
        recorder.start()
        return cls(path=Path(path), live_watcher=live_watcher, recorder=recorder, runner=session.call)

    # ---- what the views draw from --------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.replay is None

    @property
    def watcher(self) -> Watcher:
        return self.live_watcher if self.replay is None else self.replay.watcher

    def attach(self, *views) -> None:
        self.views.extend(views)

    def show(self, *view_classes, **options) -> widgets.VBox:
        """The timeline above new views of these classes drawn from it, in one box:
        Timeline.open("run.kvtrace").show(CellGrid, EventLog)."""
        views = [cls(self.watcher, **options) for cls in view_classes]
        self.attach(*views)
        return widgets.VBox([self.widget, *(v.widget for v in views)])

    # ---- moving --------------------------------------------------------------------------------------
    def seek(self, i: int) -> int:
        """Show the cache right after event i (-1: before the first); leaves live mode."""
        replay = self._scrubbing()
        rebuilds = replay.rebuilds
        position = replay.seek(i)
        self._redraw(rebuilt=replay.rebuilds != rebuilds)
        return position

    def step(self, n: int = 1) -> int:
        return self.seek(self._scrubbing().position + n)

    def jump(self, direction: int) -> int | None:
        """To the next (direction > 0) or previous event of the filter's kind; None when there is none."""
        entered = self.replay is None
        replay = self._scrubbing()
        rebuilds = replay.rebuilds
        found = self.filter.jump(replay, direction)
        if found is not None or entered:  # entering the history, the views are drawn from it either way
            self._redraw(rebuilt=replay.rebuilds != rebuilds)
        if found is None:
            self.label.value = f"<i>no {'later' if direction > 0 else 'earlier'} event of the kind {self.filter.group}</i>"
        return found

    def go_live(self) -> None:
        """Back to the session: the views draw from the live watcher again."""
        if self.replay is None or self.live_watcher is None:
            return
        self.replay.close()
        self.replay = None
        for view in self.views:
            view.show(self.live_watcher)
        self._set_live_button(True)
        self.follow_live()
        if self.moved is not None:
            self.moved()

    def follow_live(self) -> None:
        """While live: the slider stands at the end of the history (called by the explorer's redraws)."""
        if self.replay is None and self.recorder is not None:
            self._set_slider(self.recorder.n_events, self.recorder.n_events)
            self.label.value = f"live · {self.recorder.n_events} events recorded to {self.path.name}"

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
            self.replay = None
        if self.recorder is not None:
            self.recorder.close()

    # ---- inside ------------------------------------------------------------------------------------
    def _scrubbing(self) -> Replay:
        """The replay to move: a live timeline opens its history as it stands now, at its end. The views
        take its watcher here and are drawn by the move that asked for it (once, where it lands)."""
        if self.replay is None:
            self.recorder.flush()
            self.replay = Replay.open(self.path)
            self.replay.seek(len(self.replay) - 1)
            for view in self.views:
                view.watcher = self.replay.watcher
                view.forget()
            self._set_live_button(False)
        return self.replay

    def _redraw(self, rebuilt: bool) -> None:
        for view in self.views:
            if rebuilt:
                view.forget()
            view.update()
        self._show_position()
        if self.moved is not None:
            self.moved()

    def _show_position(self) -> None:
        replay = self.replay
        self._set_slider(replay.position + 1, len(replay))
        event = replay.event
        where = f"event {replay.position + 1} of {len(replay)}"
        self.label.value = f"{where}: <code>{describe_event(event)}</code>" if event is not None else \
            f"{where}: before the first event"

    def _set_slider(self, value: int, maximum: int) -> None:
        self._setting = True
        try:
            self.slider.max = self.play.max = maximum
            self.slider.value = value
        finally:
            self._setting = False

    def _set_live_button(self, live: bool) -> None:
        self._setting = True
        try:
            self.live_button.value = live
        finally:
            self._setting = False

    def _slider_moved(self, change) -> None:
        if not self._setting:
            self._later(lambda: self.seek(change["new"] - 1))

    def _live_toggled(self, change) -> None:
        if self._setting:
            return
        self._later(self.go_live if change["new"] else lambda: self.seek(self._scrubbing().position))

    def _later(self, move: Callable[[], object]) -> None:
        """A move asked for by a control: on the session's worker when there is one (see WatcherView.runner)."""
        if self.runner is None:
            move()
        else:
            self.runner(move)
