"""The terminal explorer, driven as a person would (Textual's pilot): every binding does what the footer and
the help screen say, the grid shows the engine's cells, and a bad value is told, never a crash."""
from __future__ import annotations

import io
import re
import subprocess
import sys

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from engine import events as ev
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.sampling import SamplerParams
from engine.watch.frames import EMPTY, SHARED
from engine.watch.recorder import Recorder
from engine.watch.recording import RecordingReader
from engine.watch.sources import replay_source, session_source
from tui.app import KvscopeApp
from tui.grid import CellGrid
from tui.screens import HelpScreen, PromptScreen, SettingsScreen

pytestmark = pytest.mark.anyio
GREEDY = SamplerParams(temperature=0.0, seed=1)
SETTINGS = dict(n_ctx=256, pad=64, n_seq_max=4, kv_unified=True, swa_full=True, swa_window=16)
SIZES = [(80, 24), (120, 40)]  # the terminals people use: the smallest common one, and a wide one
DEMO_LABEL = "demo: the parallel workload on the bundled model"  # what `kvscope` alone labels its session


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def session():
    s = Session("demo", settings=SETTINGS, workload=WorkloadSpec("generate", n_predict=40, sampler=GREEDY))
    s.add_prompt("And God said unto Moses").result(30)
    yield s
    s.close()


def grid_equals_engine(app: KvscopeApp, session: Session) -> None:
    grid = app.query_one(CellGrid)
    for lane in grid.lanes:
        cache = next(c for c in session.ctx.memory.caches() if c.name == lane.cache)
        cells = cache.cells(lane.stream)
        assert lane.frame.pos.tolist() == [p for p, _, _ in cells]
        owners = [EMPTY if not s else (min(s) if len(s) == 1 else SHARED) for _, s, _ in cells]
        assert lane.frame.owner.tolist() == owners and lane.frame.head == cache.head(lane.stream)


async def settle(app, pilot, session, steps: int | None = None) -> None:
    """Wait for the session to finish what it was asked, then for a frame to show it."""
    if steps is not None:
        deadline = 200
        while session.status().step < steps and deadline:
            await pilot.pause(0.05)
            deadline -= 1
    session.engine_cells().result(30)  # every queued command has run
    await pilot.pause(0.2)
    app.refresh_view()
    await pilot.pause()


async def test_steps_and_the_grid_shows_the_engines_cells(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(4):
            await pilot.press("n")
        await settle(app, pilot, session, steps=4)
        assert session.status().step == 4
        grid_equals_engine(app, session)
        assert {lane.cache for lane in app.query_one(CellGrid).lanes} == {"base", "swa"}


async def test_space_starts_and_pauses(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("space")
        await settle(app, pilot, session, steps=3)
        assert app.watcher.status.state in ("running", "idle")
        await pilot.press("space")
        await settle(app, pilot, session)
        assert session.status().state == "paused"
        grid_equals_engine(app, session)


async def test_prompt_adds_a_sequence(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("p")
        assert isinstance(app.screen, PromptScreen)
        await pilot.press(*"In the beginning")
        await pilot.press("enter")
        await pilot.press("n")
        await settle(app, pilot, session, steps=1)
        assert session.ctx.memory.seq_pos_max(1) >= 0  # the new prompt took seq 1 and was prefilled


async def test_cursor_selection_overlays_and_zoom(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("n", "n")
        await settle(app, pilot, session, steps=2)
        grid = app.query_one(CellGrid)
        await pilot.press("right", "right")
        assert grid.cursor == (0, 2)
        assert app.selected_seq == 0  # the cursor's cell holds seq 0
        assert str(app.query_one("#inspector").border_title) == "cell 2"
        await pilot.press("down")
        assert grid.cursor[1] == 2 + grid.lanes[0].per_row
        await pilot.press("right_square_bracket")
        assert grid.cursor[0] == 1
        await pilot.press("w")
        assert app.show_window is False
        await pilot.press("w", "minus")
        assert grid.zoom == 2 and grid.lanes[0].folded.cells_per_glyph == 2
        await pilot.press("plus")
        assert grid.zoom == 1
        await pilot.press("tab")
        assert app.selected_seq == 0  # the only sequence
        assert app.focused is grid  # tab selects sequences; the grid keeps the keys


async def test_tab_cycles_the_selected_sequence_both_ways(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        session.add_prompt("In the beginning").result(30)
        session.add_prompt("Blessed are they").result(30)
        await pilot.press("n")
        await settle(app, pilot, session, steps=1)
        seen = []
        for _ in range(4):
            await pilot.press("tab")
            seen.append(app.selected_seq)
        assert seen[:3] == sorted(seen[:3]) and len(set(seen[:3])) == 3 and seen[3] == seen[0]
        await pilot.press("shift+tab")
        assert app.selected_seq == seen[2]
        await pilot.press("right")
        assert app.query_one(CellGrid).cursor[1] == 1  # the arrows still move the cursor


async def test_sequence_keys_change_the_cache(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(12):
            await pilot.press("n")
        await settle(app, pilot, session, steps=12)
        await pilot.press("right")  # seq 0 selected
        n_before = session.ctx.memory.seq_pos_max(0)
        await pilot.press("y")
        await settle(app, pilot, session)
        assert session.ctx.memory.seq_pos_max(1) == n_before  # copied to the first free sequence
        await pilot.press("s")
        await settle(app, pilot, session)
        assert session.ctx.memory.seq_pos_max(0) < n_before  # the context shift discarded positions
        await pilot.press("k")
        await settle(app, pilot, session)
        assert session.ctx.memory.seq_pos_max(1) == -1  # keep: only seq 0 is left
        await pilot.press("x")
        await settle(app, pilot, session)
        assert session.ctx.memory.seq_pos_max(0) == -1
        grid_equals_engine(app, session)


async def test_a_failing_command_is_told_not_crashed(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        app.selected_seq = 3  # a sequence with no cell: a context shift is refused
        await pilot.press("s")
        await settle(app, pilot, session)
        await pilot.pause(0.3)
        assert any("seq 3 holds no cells" in str(n.message) for n in app._notifications)
        assert app.is_running


async def test_settings_estimate_then_apply_rebuilds(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(140, 48)) as pilot:
        await pilot.press("o")
        assert isinstance(app.screen, SettingsScreen)
        field = app.screen.query_one("#set-n_ctx")
        field.value = "not a number"
        await pilot.click("#estimate-button")
        assert "n_ctx: 'not a number' is not a whole number" in str(app.screen.query_one("#estimate").render())
        field.value = "512"
        await pilot.pause(0.3)  # a button ignores clicks while it shows the last one (0.2 s)
        await pilot.click("#estimate-button")
        assert "fits: True" in str(app.screen.query_one("#estimate").render())
        await pilot.click("#apply")
        await settle(app, pilot, session)
        assert session.ctx.n_ctx == 512


async def test_help_and_log_filters(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        log = app.query_one("#log")
        await pilot.press("n")
        await settle(app, pilot, session, steps=1)
        await pilot.press("f")
        assert log.filter.group == "cells"
        await pilot.press("right", "g", "c")
        assert log.filter.seq == 0 and log.filter.cache == "base"
        await pilot.press("q")
    assert not app.is_running


def test_kvscope_without_a_terminal_prints_text_frames_and_exits():
    done = subprocess.run([sys.executable, "-m", "kvscope.launcher", "tui", "--plain-steps", "3", "-m", "demo",
                           "--workload", "generate", "-p", "And God said", "-c", "256", "--pad", "64"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    frames = [line for line in done.stdout.splitlines() if line.startswith("=== step")]
    assert len(frames) == 3
    assert "base · full attention · stream 0 · used" in done.stdout and "swa · window 64" in done.stdout
    assert "3 steps shown as text (no terminal)" in done.stdout
    maps = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("      0 ")]
    assert maps and set(maps[-1]) <= set(".0M")


def test_the_demo_without_a_terminal():
    done = subprocess.run([sys.executable, "-m", "kvscope.launcher"], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    frames = [line for line in done.stdout.splitlines() if line.startswith("=== step")]  # not the legend's
    assert len(frames) == 30 and "SequenceAssigned" in done.stdout
    used = [int(line.split("used ")[1].split("/")[0]) for line in done.stdout.splitlines()
            if line.startswith("base ·")]
    assert np.diff(used).min() < 0  # finished requests freed cells


async def test_a_replayed_recording_shows_the_final_grid_and_steps_back(session, tmp_path):
    from engine.watch import Recorder
    from engine.watch.sources import replay_source

    path = tmp_path / "run.kvtrace"
    recorder = Recorder(path, keyframe_every=100)
    recorder.attach(session.bus)
    session.step(30).result(60)
    session.context_shift(0, n_keep=4).result(30)
    session.step(2).result(30)
    recorder.pump()
    recorder.close()
    source = replay_source(path)
    app = KvscopeApp(source)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("end")
        await pilot.pause(0.2)
        app.refresh_view()
        grid_equals_engine(app, session)  # the last event's grid is the live engine's
        replay = source.replay
        end = replay.position
        await pilot.press("comma", "comma")
        await pilot.pause(0.1)
        app.refresh_view()
        assert replay.position == end - 2
        await pilot.press("f", "J")  # back to the previous cell event
        assert isinstance(replay.event, __import__("engine").events.CellsChanged)
        await pilot.press("0")
        assert replay.position <= 0
        await pilot.press("x")  # a recording cannot be changed: told, not crashed
        await pilot.pause(0.2)
        assert any("only replayed" in str(n.message) for n in app._notifications)


class _Burst:
    """A subscription that hands a watcher everything at once: a view that starts far behind."""

    dropped = 0

    def __init__(self, events) -> None:
        self.events = events

    def drain(self):
        out, self.events = self.events, []
        return out


def burst_of_events(n_events: int, cells_per_stream: int = 128):
    """A context's events: cycles of 4 sequences decoding 100 tokens and being removed (which leaves the
    cache as it began, so one cycle, renumbered, repeats), then 5 decodes that stay; and the context."""
    import dataclasses

    import engine
    from engine.batch import Batch
    from tests.model_factory import in_memory_model

    ctx = engine.Context(in_memory_model(), n_ctx=4 * cells_per_stream, pad=32, n_seq_max=4, kv_unified=False)
    sub = ctx.bus.subscribe(maxsize=1 << 20)
    for pos in range(100):
        assert ctx.decode(Batch([5, 6, 7, 8], [pos] * 4, [[0], [1], [2], [3]])) == 0
    for seq in range(4):
        ctx.memory.seq_rm(seq, -1, -1)
    state = sub.drain()
    created = sum(1 for e in state if type(e).__name__ in ("ContextCreated", "ModelPlaced", "DeviceMemoryState",
                                                            "Vocabulary", "MemorySnapshot"))
    state, cycle = state[:created], state[created:]
    n_events = -(-n_events // len(cycle)) * len(cycle)  # whole cycles: the cache ends empty
    events = state + [dataclasses.replace(cycle[k % len(cycle)], seq_no=len(state) + k) for k in range(n_events)]
    for pos in range(5):
        assert ctx.decode(Batch([9, 9, 9, 9], [pos] * 4, [[0], [1], [2], [3]])) == 0
    tail = sub.drain()
    return ctx, events + [dataclasses.replace(e, seq_no=len(events) + k) for k, e in enumerate(tail)]


async def test_keys_answer_while_a_burst_of_events_is_absorbed():
    import asyncio
    import time

    from textual import events as keys

    from engine.watch.sources import Source
    from engine.watch.watcher import Watcher
    from tui.status import StatusLine

    ctx, events = burst_of_events(150_000)  # a watcher needs a second or more to absorb them
    app = KvscopeApp(Source("session", Watcher(_Burst(events))))
    async with app.run_test(size=(120, 40)):
        await asyncio.sleep(0.1)  # the first frame (pilot.pause() would wait for an idle CPU: the burst's end)
        assert 0 < app.watcher.backlog < len(events)  # one frame took its share, not all
        assert "catching up" in str(app.query_one(StatusLine).render())
        ran = asyncio.Event()
        app.action_cursor = lambda *a: ran.set()
        latencies = []
        for key in ("right", "left", "down", "up", "right"):
            if not app.watcher.backlog:
                break
            ran.clear()
            event = keys.Key(key, None)
            event.set_sender(app)
            t0 = time.perf_counter()
            app._driver.send_message(event)
            await asyncio.wait_for(ran.wait(), 5)
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.03)
        assert len(latencies) >= 3, "the burst was absorbed before the keys were measured"
        assert max(latencies) < 0.5, latencies  # absorbing it all at once takes seconds
        for _ in range(400):
            if not app.watcher.backlog:
                break
            await asyncio.sleep(0.02)
        app.refresh_view()
        assert app.watcher.backlog == 0 and app.watcher.events == len(events)
        grid = app.query_one(CellGrid)
        for lane in grid.lanes:
            cells = ctx.memory.cells(lane.stream)
            assert lane.frame.pos.tolist() == [p for p, _, _ in cells]


async def test_arrows_move_the_cursor_when_the_lanes_overflow_the_screen():
    from engine.watch.sources import Source
    from engine.watch.watcher import Watcher

    _, events = burst_of_events(0, cells_per_stream=512)  # four lanes of 512 cells: taller than the grid
    app = KvscopeApp(Source("session", Watcher(_Burst(events))))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        grid = app.query_one(CellGrid)
        assert grid.virtual_size.height > grid.size.height  # it scrolls
        await pilot.press("right", "right", "down")
        assert grid.cursor == (0, 2 + grid.lanes[0].per_row)
        assert grid.scroll_offset.x == 0  # the arrows never scroll sideways
        await pilot.press(*["right_square_bracket"] * 3, *["down"] * 8)  # the last lane, below the screen
        assert grid.cursor[0] == 3 and grid.scroll_offset.y > 0  # the grid followed the cursor


async def test_cells_read_on_a_dark_and_on_a_light_theme():
    from engine.watch import style
    from engine.watch.sources import Source
    from engine.watch.watcher import Watcher

    _, events = burst_of_events(0)  # four sequences in four streams
    app = KvscopeApp(Source("session", Watcher(_Burst(events))))
    seen = {}
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        for theme in ("textual-dark", "textual-light"):
            app.theme = theme
            await pilot.pause()
            grid = app.query_one(CellGrid)
            background = grid.background_colors[1].hex
            colours = {seg.style.color.triplet.hex.upper() for y in range(grid.size.height)
                       for seg in grid.render_line(y) if seg.text.strip("·« »") and seg.style and seg.style.color
                       and seg.style.color.triplet}
            cells = colours & {c.upper() for c in style.palette(app.current_theme.dark)}
            assert len(cells) == 4, (theme, colours)  # the four sequences' colours are drawn
            assert all(style.contrast(c, background) >= 3.0 for c in cells), (theme, background, cells)
            seen[theme] = cells
    assert seen["textual-dark"] != seen["textual-light"]  # the light theme has its own, darker colours


async def test_the_log_follows_new_events_unless_scrolled_back(session):
    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        log = app.query_one("#log")
        await pilot.press("n")
        await settle(app, pilot, session, steps=1)
        for _ in range(3):  # until the log outgrows its box
            await pilot.press("n")
            await settle(app, pilot, session, steps=1)
        assert log.max_scroll_y > 0 and log.scroll_offset.y == log.max_scroll_y
        last_shown = log.line_text(log.line_count - 1)
        assert str(app.watcher.recent[-1].seq_no) in last_shown
        log.scroll_to(y=0, animate=False, immediate=True)
        await pilot.press("n")
        await settle(app, pilot, session, steps=1)
        assert log.scroll_offset.y == 0  # reading back: not pulled down by the next step
        log.scroll_to(y=log.max_scroll_y, animate=False, immediate=True)
        await pilot.press("n")
        await settle(app, pilot, session, steps=1)
        assert log.scroll_offset.y == log.max_scroll_y  # at the end again: it follows


async def test_panels_lay_the_screen_out_only_when_their_height_changes(session, monkeypatch):
    from rich.text import Text

    from tui.status import StatusLine
    from tui.text_panel import TextPanel

    app = KvscopeApp(session_source(session))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        panel = app.query_one(StatusLine)
        refreshes = []
        monkeypatch.setattr(TextPanel, "refresh", lambda self, *a, layout=False, **k: refreshes.append(layout))
        panel.show(Text("step 1"))
        panel.show(Text("step 1"))
        assert refreshes == [False]  # one row as before: repainted, not laid out; the same text: nothing
        panel.show(Text("step 2"))
        assert refreshes == [False, False]
        inspector = app.query_one("CellInspector")
        inspector.show(Text("one\ntwo"))
        inspector.show(Text("one\nthree"))
        inspector.show(Text("one\ntwo\nthree"))
        assert refreshes[2:] == [True, False, True]
        inspector.show(Text("x" * 500))  # one line, wrapped to several rows
        assert refreshes[-1] is True


def test_a_reader_that_stops_early_ends_the_text_frames_quietly():
    """`kvscope | head`: once the reader closes the pipe, kvscope stops writing and exits 0, without a
    BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.launcher", "tui", "--plain-steps", "200", "-m", "demo",
                             "--workload", "generate", "-p", "And God said", "-c", "256", "--pad", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    first = proc.stdout.readline()
    while first and not first.startswith(b"=== step"):  # the legend comes first
        first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its lines
    _, err = proc.communicate(timeout=120)
    assert first.startswith(b"=== step 1")
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


# ---- the explorer at the sizes people use (80x24, 120x40) ---------------------------------------------------
def screen_lines(app: KvscopeApp) -> list[str]:
    """The screen as a person reads it: the text of every row of the composed screen, dialogs included (what
    App.export_screenshot draws)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system=None, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text().splitlines()


def test_a_fitted_line_leaves_out_the_least_needed_parts_first():
    from tui.fit import Part, fit

    parts = [Part("running "), Part("step 12", before=" "), Part(" (decode 14)", rank=4, before=""),
             Part("3 tok/s", rank=3), Part("base 10/256", rank=2), Part("a long label of the source", rank=9,
                                                                              shrinks=True)]
    whole = fit(parts, 0).plain
    assert whole == "running  step 12 (decode 14) · 3 tok/s · base 10/256 · a long label of the source"
    assert fit(parts, len(whole)).plain == whole
    assert fit(parts, len(whole) - 5).plain == "running  step 12 (decode 14) · 3 tok/s · base 10/256 · a long label of the…"
    # room for 9 cells of the label: too few to say anything, so it goes
    assert fit(parts, len(whole) - 17).plain == "running  step 12 (decode 14) · 3 tok/s · base 10/256"
    assert fit(parts, 50).plain == "running  step 12 · 3 tok/s · base 10/256"
    assert fit(parts, 24).plain == "running  step 12"  # rank 0 alone
    assert fit(parts, 10).plain == "running  …"  # rank 0 alone too long: cut, never wrapped


@pytest.fixture(scope="module")
def hand_recording(tmp_path_factory):
    """A recording of a context driven by hand (as `kvscope record` writes: no workload steps, no session
    status), in chunks of 64 events so that a copy cut short keeps some of them."""
    path = tmp_path_factory.mktemp("replay") / "hand.kvtrace"
    _, events = burst_of_events(400)
    with Recorder(path, chunk_events=64) as recorder:
        for event in events:
            recorder.write(event)
    return path


@pytest.mark.parametrize("size", SIZES)
async def test_the_key_bar_keeps_help_and_quit(session, size):
    app = KvscopeApp(session_source(session, label=DEMO_LABEL))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        keys = screen_lines(app)[-1]
        assert "? help" in keys and "q quit" in keys, keys
        assert "space start/pause" in keys and "n step" in keys, keys
        await pilot.click("#keys", offset=(keys.index("? help"), 0))  # a key is clicked as it is pressed
        assert isinstance(app.screen, HelpScreen)


def test_every_key_in_the_bar_is_bound_to_what_it_says():
    from textual.app import App

    from tui.keys import REPLAY_KEYS, SESSION_KEYS

    bound = {key.strip(): binding.action for binding in KvscopeApp.BINDINGS for key in binding.key.split(",")}
    bound[App.COMMAND_PALETTE_BINDING] = "command_palette"
    for hint in SESSION_KEYS + REPLAY_KEYS:
        actions = {bound.get(key) for key in hint.bindings}
        assert None not in actions, (hint, "a key the bar shows is not bound")
        if hint.action is not None:
            assert actions == {hint.action}, hint
        else:  # keys of a replay that need a direction: its moves
            assert all(a.startswith("replay_") for a in actions), hint


@pytest.mark.parametrize("size", SIZES)
async def test_a_replay_opens_at_its_end_and_says_where_it_stands(hand_recording, size):
    """Not at event 0 (an empty screen, the model "?"), nor "step 0 (decode 77)" for a recording that has no
    workload steps, nor the keys of a session."""
    reader = RecordingReader(hand_recording)
    recorded = list(reader.events())
    model = next(e.model_name for e in recorded if isinstance(e, ev.ContextCreated))
    last_decode = [e.step for e in recorded if isinstance(e, ev.DecodeStarted)][-1]
    app = KvscopeApp(replay_source(hand_recording))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        replay, n = app.source.replay, len(reader)
        assert replay.at_end and app.query_one(CellGrid).lanes[0].frame.used > 0
        lines = screen_lines(app)
        assert f"kvscope · {model}" in lines[0]
        status, keys = lines[-2], lines[-1]
        assert f"event {n} of {n}" in status and f"decode {last_decode}" in status and "step 0" not in status
        assert "space play/pause" in keys and ", . ±1 event" in keys and "? help" in keys and "q quit" in keys
        assert not any(live in keys for live in ("n step", "p prompt", "o settings")), keys
        await pilot.press("home")
        await pilot.pause()
        app.refresh_view()
        lines = screen_lines(app)
        assert f"kvscope · {model}" in lines[0] and f"event 0 of {n}" in lines[-2] and "no decode yet" in lines[-2]
        await pilot.press("space")  # plays from where it stands (a short recording may reach its end at once)
        assert app.playing or replay.position > 0


@pytest.mark.parametrize("size", SIZES)
async def test_a_recording_cut_short_says_so_on_screen(hand_recording, tmp_path, size):
    data = hand_recording.read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[:len(data) * 2 // 3])  # a recorder killed: no index, the last chunk incomplete
    reader = RecordingReader(cut)
    assert reader.truncated and 0 < len(reader) < len(RecordingReader(hand_recording))
    app = KvscopeApp(replay_source(cut))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        from tui.status import StatusLine

        status = str(app.query_one(StatusLine).render())
        assert "CUT SHORT" in status and f"event {len(reader)} of {len(reader)}" in status, status
        assert any(reader.warnings[0] in str(n.message) for n in app._notifications)


async def help_lines(app: KvscopeApp, pilot) -> list[str]:
    """Every line of the help dialog's text as the screen shows it, page after page (it scrolls)."""
    from textual.containers import VerticalScroll
    from textual.widgets import Static

    scroll = app.screen.query_one(VerticalScroll)
    text = app.screen.query_one(Static)
    rows: dict[int, str] = {}
    while True:
        top = int(scroll.scroll_offset.y)
        screen = screen_lines(app)
        region, left, right = scroll.content_region, text.content_region.x, text.content_region.right
        for row in range(region.height):
            rows[top + row] = screen[region.y + row][left:right].rstrip()
        if top >= scroll.max_scroll_y:
            return [rows[k] for k in sorted(rows)]
        scroll.scroll_to(y=top + region.height, animate=False, immediate=True)
        await pilot.pause()


@pytest.mark.parametrize("size", SIZES)
async def test_the_help_reflows_without_orphan_lines(hand_recording, size):
    """The help's text has no line breaks of its own, so the dialog wraps it once: no word is left alone on a
    line in the middle of a paragraph, and a table's meaning wraps under itself, not under its term."""
    app = KvscopeApp(replay_source(hand_recording))
    async with app.run_test(size=size) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        lines = await help_lines(app, pilot)
    assert any("pending shift" in line for line in lines) and any("home end 0-9" in line for line in lines)
    for k, line in enumerate(lines[1:], 1):
        above = lines[k - 1]
        if len(line.split()) == 1:  # a lone word is a heading, after a blank line, or an orphan
            assert not above.strip(), f"an orphan {line!r} after {above!r}"
        if line.strip() and above.strip() and above.startswith(" "):  # after a table's row: a row or its meaning
            assert line.startswith(" "), f"{line!r} is not under the meaning of {above!r}"


@pytest.mark.parametrize("size", SIZES)
async def test_memory_figures_stay_on_their_lines_and_in_view(session, size):
    """"28.3 MiB no limit" never wraps, and the devices panel is not pushed below the side column's fold."""
    from tui.devices import DeviceBars, mib

    app = KvscopeApp(session_source(session, label=DEMO_LABEL))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        bars = app.query_one(DeviceBars)
        lines = str(bars.render()).splitlines()
        assert all(cell_len(line) <= bars.content_region.width for line in lines), lines
        for row in app.watcher.mirror.devices.rows.values():
            capacity = f"of {mib(row.capacity)}" if row.capacity else "no limit"
            assert any(mib(row.used) in line for line in lines) and any(capacity in line for line in lines), lines
        assert bars.region.bottom <= app.query_one("#side").region.bottom


@pytest.mark.parametrize("size", SIZES)
async def test_the_status_line_fits_while_running(session, size):
    from tui.status import StatusLine

    app = KvscopeApp(session_source(session, label=DEMO_LABEL))
    async with app.run_test(size=size) as pilot:
        await pilot.press("space")
        await settle(app, pilot, session, steps=2)
        status = app.query_one(StatusLine)
        shown = str(status.render())
        assert cell_len(shown) <= status.content_region.width, shown
        watcher = app.watcher
        assert shown.startswith(watcher.status.state) and f"step {watcher.last_step.step}" in shown, shown
        assert all(f"{name} " in shown for name in watcher.mirror.caches), shown
        await pilot.press("space")


@pytest.fixture
def failing_session():
    """The parallel workload on a cache too small for its four clients: by its third step a decode finds no
    slot even for one token, and the request that token belongs to ends in an error."""
    spec = WorkloadSpec("parallel", n_clients=4, n_sequences=8, n_predict=60, arrival_gap=0, sampler=GREEDY)
    s = Session("demo", settings={"n_ctx": 128, "pad": 32, "n_seq_max": 5, "kv_unified": True, "n_batch": 64},
                workload=spec)
    yield s
    s.close()


async def test_the_inspector_says_why_a_request_ended_in_an_error(failing_session):
    from engine.runners.parallel import CONTEXT_EXCEEDED
    from tui.inspector import CellInspector

    app = KvscopeApp(session_source(failing_session))
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(3):
            await pilot.press("n")
        await settle(app, pilot, failing_session, steps=3)
        lane = app.query_one(CellGrid).lanes[0]
        history = app.watcher.history
        cell = next(c for c in range(lane.frame.size)
                    if any("(error" in line for line in history.lines(lane.cache, lane.stream, c)))
        await pilot.press(*["down"] * (cell // lane.per_row), *["right"] * (cell % lane.per_row))
        app.refresh_view()
        await pilot.pause()
        shown = str(app.query_one(CellInspector).render())
    ended = [line for line in shown.splitlines() if "(error" in line]
    assert ended, shown
    for line in ended:  # the runner's own words for the failure, not just its stop reason
        assert f"(error: {CONTEXT_EXCEEDED})" in line, line


def test_text_frames_begin_with_a_legend():
    """`kvscope | head -20`: what the marks mean comes first, then the first frame; kvscope ends quietly once
    head has its lines."""
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.launcher"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    lines = [proc.stdout.readline().decode() for _ in range(20)]
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()
    first_frame = next(k for k, line in enumerate(lines) if line.startswith("=== step 1"))
    legend = "".join(lines[:first_frame])
    for mark in (". empty", "M several sequences", "head (where the next slot search starts)", "=== step",
                 "K/V cache", "QUIRK"):
        assert mark in legend, legend
    frame = lines[first_frame:]
    assert any(re.match(r"\w+ · (full attention|window \d+) · stream \d+ · used \d+/\d+ · head \d+$", line)
               for line in frame), frame
