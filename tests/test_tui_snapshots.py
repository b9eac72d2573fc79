"""Snapshots of the explorer's screens at the sizes people use, 80x24 and 120x40 (and some at 160x48)
(pytest-textual-snapshot).

The screens show the demo workload, greedy, with its wall times zeroed, so that what is drawn depends on
the cache's behaviour only: replayed from a recording, or fed to a watcher as a session's events. After a
change to what the explorer draws, look at the new screens (pytest --snapshot-report) and accept them with
--snapshot-update."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from engine import events as ev
from engine.runners.demo import DEMO_SETTINGS, DEMO_WORKLOAD
from engine.runners.session import Session
from engine.sampling import SamplerParams
from engine.watch.recorder import Recorder
from engine.watch.recording import RecordingReader
from engine.watch.replay import Replay
from engine.watch.sources import Source
from engine.watch.watcher import Watcher
from tui.app import KvscopeApp
from tui.event_log import EventLog
from tui.grid import CellGrid
from tui.inspector import CellInspector

STEPS = 48  # past the demo's first failed slot search, first context shift and first request ended by an error
SIZES = [(80, 24), (120, 40)]
DEMO_LABEL = "demo: the parallel workload on the bundled model"  # what `kvscope` alone labels its session
TIMED = {"time": 0.0, "ms": 0.0, "ms_total": 0.0}


def without_wall_times(event: ev.Event) -> ev.Event:
    fields = {f.name for f in dataclasses.fields(event)}
    changes = {k: v for k, v in TIMED.items() if k in fields}
    if "ms_per_ubatch" in fields:
        changes["ms_per_ubatch"] = tuple(0.0 for _ in event.ms_per_ubatch)
    return dataclasses.replace(event, **changes)


@pytest.fixture(scope="module")
def demo_recording(tmp_path_factory):
    """The demo workload's first steps, greedy, as a recording without wall times."""
    path = tmp_path_factory.mktemp("snap") / "demo.kvtrace"
    workload = dataclasses.replace(DEMO_WORKLOAD, sampler=SamplerParams(temperature=0.0, seed=1))
    with Session("demo", settings=DEMO_SETTINGS, workload=workload, threaded=False) as session:
        subscription = session.subscribe(maxsize=1 << 20)
        events = session.current_state()
        session.step(STEPS).result()
        events += subscription.drain()
    kinds = {type(e).__name__ for e in events}
    assert {"SlotSearchFailed", "KShiftApplied"} <= kinds, "the demo no longer shows what the screens are meant to"
    assert any(isinstance(e, ev.CellsRemoved) and "(error: " in e.cause for e in events), \
        "no request of the demo ended in an error"
    with Recorder(path, keyframe_every=500) as recorder:
        for event in events:
            recorder.write(without_wall_times(event))
    return path


def replay_app(path, label: str = "demo.kvtrace") -> KvscopeApp:
    return KvscopeApp(Source("replay", replay=Replay(RecordingReader(path)), label=label))


async def at_the_end(pilot) -> None:
    """The replay at its last event, drawn, and the event log scrolled to its last line."""
    await pilot.press("end")
    await log_settled(pilot)


async def log_settled(pilot) -> None:
    """The event log scrolled to its last line: frames until it settles (on a slow machine the log's first
    layout can come after the frame that scrolls it)."""
    await pilot.pause()
    log = pilot.app.query_one(EventLog)
    for _ in range(20):
        pilot.app.refresh_view()
        await pilot.pause()
        if log.max_scroll_y > 0 and log.scroll_offset.y >= log.max_scroll_y:
            break
    assert log.scroll_offset.y >= log.max_scroll_y, "the event log never showed its last line"
    if log.show_vertical_scrollbar:  # its thumb follows the scroll a frame later
        log.vertical_scrollbar.position = log.scroll_offset.y
        log.vertical_scrollbar.refresh()
    await pilot.pause()


async def as_opened(pilot) -> None:
    """The replay as it opens, no key pressed: at its last event."""
    assert pilot.app.source.replay.at_end
    await log_settled(pilot)


@pytest.mark.parametrize("size", [*SIZES, (160, 48)])
def test_main_screen(snap_compare, demo_recording, size):
    """A replay opens at its end: the model in the title, where it stands in the status line, its own keys."""
    assert snap_compare(replay_app(demo_recording), terminal_size=size, run_before=as_opened)


@pytest.mark.parametrize("size", SIZES)
def test_a_session_screen(snap_compare, demo_recording, size):
    """A session's screen (its events given to a watcher as they came): its keys, the status line and the
    memory bars fitted to the width."""
    events = list(RecordingReader(demo_recording).events())

    class Arrived:
        dropped = 0

        def __init__(self) -> None:
            self.events = events

        def drain(self):
            out, self.events = self.events, []
            return out

    async def absorbed(pilot) -> None:
        for _ in range(200):  # a frame absorbs what its time allows: frames until the watcher has all
            if not pilot.app.watcher.backlog and pilot.app.watcher.events == len(events):
                break
            pilot.app.refresh_view()
            await pilot.pause()
        assert pilot.app.watcher.events == len(events)
        pilot.app.refresh_view()
        await log_settled(pilot)

    app = KvscopeApp(Source("session", Watcher(Arrived()), label=DEMO_LABEL))
    assert snap_compare(app, terminal_size=size, run_before=absorbed)


def test_main_screen_with_the_cursor_on_a_shifted_cell(snap_compare, demo_recording):
    async def on_a_cell(pilot) -> None:
        await at_the_end(pilot)
        history = pilot.app.watcher.history
        cell = next(c for c in range(256) if any("context shift" in line for line in history.lines("base", 0, c)))
        per_row = pilot.app.query_one(CellGrid).lanes[0].per_row
        await pilot.press(*["down"] * (cell // per_row), *["right"] * (cell % per_row))
        pilot.app.refresh_view()
        await pilot.pause()
        assert "context shift" in str(pilot.app.query_one(CellInspector).render())

    assert snap_compare(replay_app(demo_recording), terminal_size=(160, 48), run_before=on_a_cell)


@pytest.mark.parametrize("size", SIZES)
def test_help_screen(snap_compare, demo_recording, size):
    """The help reflowed to the dialog's width: tables whose meanings wrap under themselves, no orphans."""
    async def help_over_a_settled_screen(pilot) -> None:  # the log's scrollbar shows behind the dialog
        await as_opened(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(replay_app(demo_recording), terminal_size=size, run_before=help_over_a_settled_screen)


@pytest.mark.parametrize("size", SIZES)
def test_a_recording_cut_short(snap_compare, demo_recording, tmp_path, monkeypatch, size):
    """A recorder that did not finish: the status line says so for as long as the file is shown, and a
    notification tells where the file ends."""
    monkeypatch.chdir(tmp_path)  # the file by a relative name: the notification names it
    with Recorder("whole.kvtrace", keyframe_every=500, chunk_events=64) as recorder:  # chunks a cut leaves some of
        for event in RecordingReader(demo_recording).events():
            recorder.write(event)
    data = Path("whole.kvtrace").read_bytes()
    Path("cut.kvtrace").write_bytes(data[:len(data) * 2 // 3])
    cut = RecordingReader("cut.kvtrace")
    assert cut.truncated and len(cut) > 0
    assert snap_compare(replay_app("cut.kvtrace", label="cut.kvtrace"), terminal_size=size, run_before=as_opened)


@pytest.mark.parametrize("size", SIZES)
def test_the_inspector_on_a_request_that_ended_in_an_error(snap_compare, demo_recording, size):
    """The cell's story says why the request ended, in the runner's own words."""
    async def on_the_cell(pilot) -> None:
        await at_the_end(pilot)
        app = pilot.app
        lane = app.query_one(CellGrid).lanes[0]
        history = app.watcher.history
        cell = next(c for c in range(lane.frame.size)
                    if any("(error: " in line for line in history.lines(lane.cache, lane.stream, c)[:2]))
        await pilot.press(*["down"] * (cell // lane.per_row), *["right"] * (cell % lane.per_row))
        app.refresh_view()
        await pilot.pause()
        assert "(error: " in str(app.query_one(CellInspector).render())

    assert snap_compare(replay_app(demo_recording), terminal_size=size, run_before=on_the_cell)


def test_main_screen_on_a_light_theme(snap_compare, demo_recording):
    async def light(pilot) -> None:
        pilot.app.theme = "textual-light"
        await at_the_end(pilot)

    assert snap_compare(replay_app(demo_recording), terminal_size=(160, 48), run_before=light)


@pytest.fixture(scope="module")
def server_recording(tmp_path_factory):
    """The server workload's demo chats (two users on two slots), greedy, recorded to their end."""
    from engine.runners.workloads import WorkloadSpec

    path = tmp_path_factory.mktemp("snap") / "server.kvtrace"
    spec = WorkloadSpec(kind="server", n_clients=2, sampler=SamplerParams(temperature=0.0, seed=1))
    with Session("demo", settings=dict(n_ctx=2048, n_seq_max=2, n_batch=64, n_ubatch=64), workload=spec,
                 threaded=False) as session:
        subscription = session.subscribe(maxsize=1 << 20)
        events = session.current_state()
        session.step(400).result()
        events += subscription.drain()
    kinds = {type(e).__name__ for e in events}
    assert {"ServerPromptReused", "CheckpointChanged"} <= kinds
    with Recorder(path, keyframe_every=500) as recorder:
        for event in events:
            if isinstance(event, ev.ServerLogLine):  # the server's timing lines
                event = dataclasses.replace(event, text=re.sub(r" +\d+\.\d+( ms| tokens per second)", r" 0.00\1",
                                                               event.text))
            recorder.write(without_wall_times(event))
    return path


def test_server_slots_beside_the_grid(snap_compare, server_recording):
    async def server_log(pilot) -> None:
        await at_the_end(pilot)
        for _ in range(5):  # the log's filter, from "all" to "server": the server's own lines
            await pilot.press("f")
        pilot.app.refresh_view()
        await pilot.pause()

    assert snap_compare(replay_app(server_recording), terminal_size=(160, 48), run_before=server_log)
