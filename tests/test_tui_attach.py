"""Both explorers on a real llama.cpp watched from its own log (engine/runners/attach.py): the terminal explorer
offers only what watches (no key sends anything to the process, and pressing one says so), its status line
says what is watched, how the log's reading goes and how a process ended, the server-slots panel shows a real
llama-server's tasks, and the cells a log shows shared without naming by whom are marked and explained, in
the terminal and in the notebook grid alike. On the fixture logs of tests/data/llama-cpp-logs."""
from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from rich.cells import cell_len
from rich.text import Text

from engine import events as ev
from engine.runners.attach import AttachedLog
from engine.watch import style
from engine.watch.llama_log import LlamaLogParser
from engine.watch.sources import Source, attached_source
from engine.watch.watcher import Watcher
from tests.test_tui import help_lines, screen_lines
from tui.app import SESSION_ACTIONS, KvscopeApp
from tui.commands import SequenceCommands
from tui.event_log import EventLog
from tui.grid import CellGrid
from tui.inspector import CellInspector
from tui.keys import ATTACHED_KEYS
from tui.screens import HelpScreen
from tui.slots import SlotsPanel
from tui.status import StatusLine

pytestmark = pytest.mark.anyio
LOGS = Path(__file__).parent / "data" / "llama-cpp-logs"
SERVER = LOGS / "llama-server-gemma3-swa-chat.log"
UNIFIED = LOGS / "llama-cpp-kv-debug3-unified.log"
SIZES = [(80, 24), (120, 40)]
# keys that would command a session, each with the action it is bound to in a session
COMMAND_KEYS = {"space": "toggle_run", "n": "step", "p": "prompt", "x": "seq_op", "k": "seq_op", "y": "seq_op",
                "s": "seq_op", "o": "settings", "r": "record", "a": "toggle_attention"}
SHOWN_COMMANDS = ("start/pause", "n step", "p prompt", "o settings", "^p commands")  # the session's key bar
UNNAMED = "shared by 2 or more of seqs 0, 1, 2 (the log does not say which)"


@pytest.fixture
def anyio_backend():
    return "asyncio"


# ---- helpers --------------------------------------------------------------------------------------------
def watched(path: Path) -> tuple[KvscopeApp, AttachedLog]:
    """The explorer on a saved log, subscribed before the reading starts (as `kvscope attach` does): it gets
    every event from the log's first line."""
    attached = AttachedLog.read(path, start=False)
    app = KvscopeApp(attached_source(attached))
    attached.start()
    return app, attached


async def absorbed(app: KvscopeApp, pilot, attached: AttachedLog) -> None:
    """The log read to its end (or the process ended), and every event it gave drawn."""
    assert attached.wait(30), "the log was not read to its end"
    for _ in range(200):
        app.refresh_view()
        await pilot.pause()
        status = app.watcher.status  # the last event the source publishes
        if status is not None and status.state in ("finished", "exited") and not app.watcher.backlog:
            break
    app.refresh_view()
    await pilot.pause()


def parsed(path: Path) -> LlamaLogParser:
    parser = LlamaLogParser()
    parser.feed(path.read_bytes())
    parser.finish()
    return parser


def log_lines(app: KvscopeApp) -> list[str]:
    log = app.query_one(EventLog)
    return [log.line_text(k) for k in range(log.line_count)]


async def cursor_on(app: KvscopeApp, pilot, cell: int) -> str:
    """The cursor moved onto a cell of the first lane; what the inspector says then."""
    grid = app.query_one(CellGrid)
    _, glyph = grid.cursor
    per_row = grid.lanes[0].per_row
    await pilot.press(*["left"] * glyph, *["down"] * (cell // per_row), *["right"] * (cell % per_row))
    assert grid.cursor == (0, cell)
    app.refresh_view()
    await pilot.pause()
    return str(app.query_one(CellInspector).render())


def before_step_12(tmp_path: Path) -> Path:
    """The unified fixture up to its step 12: its last dump shows cells 0-3 as 'M' at positions 0 and 1, which
    every one of seqs 0, 1, 2 covers, and cells 6-7 as 'M' at positions 4 and 5, which only seqs 0 and 1 do."""
    text = UNIFIED.read_text()
    path = tmp_path / "unified-before-step-12.log"
    path.write_text(text[:text.index("=== STEP 12")])
    return path


# ---- what an attached source offers ---------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
async def test_the_engines_controls_are_not_offered_and_refused_once_when_pressed(size):
    app, attached = watched(SERVER)
    app.NOTIFICATION_TIMEOUT = 60  # the notice stays while the keys are pressed, however slow the machine
    try:
        async with app.run_test(size=size) as pilot:
            await absorbed(app, pilot, attached)
            keys = screen_lines(app)[-1]
            assert "? help" in keys and "q quit" in keys and "tab next seq" in keys, keys
            assert not any(shown in keys for shown in SHOWN_COMMANDS), keys
            # Textual's own keys panel (the palette's "Keys") lists the active bindings: none that commands
            active = {b.binding.action.partition("(")[0] for b in app.screen.active_bindings.values()}
            assert not active & SESSION_ACTIONS and {"next_seq", "toggle_window", "help"} <= active, active
            for key in COMMAND_KEYS:
                await pilot.press(key)
            await pilot.pause()
            assert app.screen is app.screen_stack[0], "a dialog of the session's opened"
            told = [n for n in app._notifications if "only watches an attached llama.cpp process" in str(n.message)]
            assert len(told) == 1, [str(n.message) for n in app._notifications]  # once, not once per key
            await pilot.press("w", "tab")  # what watches still works
            assert app.show_window is False and app.selected_seq == 0
    finally:
        attached.close()


def test_every_key_of_an_attached_source_is_bound_to_what_it_says():
    bound = {key.strip(): binding.action for binding in KvscopeApp.BINDINGS for key in binding.key.split(",")}
    for hint in ATTACHED_KEYS:
        actions = {bound.get(key) for key in hint.bindings}
        assert None not in actions, hint
        assert not {a.partition("(")[0] for a in actions} & SESSION_ACTIONS, hint
        if hint.action is not None:
            assert actions == {hint.action}, hint
    assert set(COMMAND_KEYS.items()) <= {(k, a.partition("(")[0]) for k, a in bound.items()}


@pytest.mark.parametrize("size", SIZES)
async def test_the_help_and_the_palette_leave_out_the_session(tmp_path, size):
    app, attached = watched(before_step_12(tmp_path))
    try:
        async with app.run_test(size=size) as pilot:
            await absorbed(app, pilot, attached)
            provider = SequenceCommands(app.screen)
            offered = [hit.text async for hit in provider.discover()]
            assert offered == ["help: what the glyphs and colours mean"], offered
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            lines = await help_lines(app, pilot)
    finally:
        attached.close()
    text = " ".join(line.strip() for line in lines)  # as it reads, wherever the dialog's width wrapped it
    assert "Keys of a watched llama.cpp" in text and "kvscope only watches it" in text
    for session_only in ("start / pause the session", "one step", "settings: rebuild", "record the session",
                         "Keys of a session", "Keys of a replay"):
        assert session_only not in text, session_only
    assert any(line.startswith(f"  {style.GLYPH_SHARED_UNNAMED}     several sequences that a llama.cpp log")
               for line in lines), text
    for k, line in enumerate(lines[1:], 1):  # reflowed as the other modes' help is: no orphans
        assert len(line.split()) != 1 or not lines[k - 1].strip(), f"an orphan {line!r} after {lines[k - 1]!r}"


# ---- the status line ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
async def test_the_status_line_says_the_log_was_read_and_how(size):
    expected = parsed(SERVER).stats
    app, attached = watched(SERVER)
    try:
        async with app.run_test(size=size) as pilot:
            await absorbed(app, pilot, attached)
            status = app.query_one(StatusLine)
            shown, width = str(status.render()), status.content_region.width
    finally:
        attached.close()
    assert cell_len(shown) <= width, shown
    assert shown.startswith("log read to its end · "), shown
    assert f"{expected.dumps} dumps read" in shown, shown
    if size == (120, 40):  # the figures a narrow line leaves out first
        assert f"{expected.dumps_dropped} dropped to keep up" in shown, shown
        assert f"{expected.skipped} lines not understood" in shown, shown


async def test_a_process_that_exits_says_its_status_and_last_lines(tmp_path):
    """A short process started through AttachedLog.run prints a llama.cpp log on stderr, then its own last
    words, and exits with status 3."""
    script = tmp_path / "fake_llama.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.stderr.write(open(sys.argv[1]).read())
        sys.stderr.write("main: failed to load the next prompt\\nmain: exiting\\n")
        sys.exit(3)
    """))
    attached = AttachedLog.run([sys.executable, str(script), str(before_step_12(tmp_path))], start=False,
                               passthrough=tmp_path / "passthrough.log")
    app = KvscopeApp(attached_source(attached))
    attached.start()
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await absorbed(app, pilot, attached)
            status = str(app.query_one(StatusLine).render())
            lines = log_lines(app)
            notified = [(str(n.title), str(n.message)) for n in app._notifications]
    finally:
        attached.close()
    pid = attached.pid
    assert status.startswith(f"{Path(sys.executable).name} (pid {pid}) exited with status 3 · "), status
    exited = next(k for k, line in enumerate(lines) if f"ProcessExited {Path(sys.executable).name} (pid {pid}) "
                                                       "exited with status 3" in line)
    assert lines[exited + 1].strip().startswith("its last ") and lines[exited + 1].strip().endswith(" lines:")
    shown = [line.strip().removeprefix("│ ") for line in lines[exited + 2:] if line.startswith(" " * 8 + "│")]
    assert shown[-2:] == ["main: failed to load the next prompt", "main: exiting"], lines[exited:]
    assert any(title.endswith("exited with status 3") and message.endswith("main: exiting")
               for title, message in notified), notified


def test_the_event_log_says_what_a_real_servers_log_leaves_open():
    from engine.watch.describe import describe_event

    started = ev.ServerTaskStarted(slot=1, task=7, selected_by="", similarity=-1.0, n_prompt=30)
    assert describe_event(started).endswith("slot chosen (the log does not say how), 30 prompt tokens")
    by_similarity = dataclasses.replace(started, selected_by="similarity")
    assert "slot chosen by prompt similarity," in describe_event(by_similarity)
    superseded = ev.CheckpointChanged(slot=0, task=3, action="erased", pos_min=-1, pos_max=-1, n_tokens=64, n_bytes=0,
                                      why="superseded", n_held=1)
    assert describe_event(superseded) == ("CheckpointChanged slot 0 erased (superseded) [range not in the log] "
                                          "n_tokens 64, size not in the log; 1 held")
    killed = ev.ProcessExited("llama-server", 4242, -9, ("a line",))
    assert describe_event(killed) == "ProcessExited llama-server (pid 4242) was killed by signal 9 (SIGKILL)"
    ended = dataclasses.replace(killed, returncode=-15, ended_by_kvscope=True)
    assert describe_event(ended) == "ProcessExited llama-server (pid 4242) ended by kvscope"


async def test_a_running_process_is_said_to_be_attached_until_kvscope_ends_it(tmp_path):
    script = tmp_path / "fake_llama.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        sys.stderr.write(open(sys.argv[1]).read())
        sys.stderr.flush()
        time.sleep(60)
    """))
    log = before_step_12(tmp_path)
    dumps = parsed(log).stats.dumps
    attached = AttachedLog.run([sys.executable, str(script), str(log)], start=False,
                               passthrough=tmp_path / "passthrough.log")
    app = KvscopeApp(attached_source(attached))
    attached.start()
    name = f"{Path(sys.executable).name} (pid {attached.pid})"
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            status = app.query_one(StatusLine)
            for _ in range(400):  # until the log's figures show every dump the process printed
                app.refresh_view()
                await pilot.pause(0.05)
                if f"{dumps} dumps read" in str(status.render()):
                    break
            shown = str(status.render())
            assert shown.startswith(f"attached to {name} · {dumps} dumps read · "), shown
            attached.close()
            await absorbed(app, pilot, attached)
            assert str(status.render()).startswith(f"{name} ended by kvscope · "), str(status.render())
    finally:
        attached.close()


# ---- a real llama-server's slots ----------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
async def test_the_slots_panel_shows_the_real_servers_tasks(size):
    """Tasks 0 and 14 on slot 0 (14 reused 0's 270 tokens), 22 on slot 1, then 32 on slot 0: its prompt shares
    40 tokens with what the slot held, but the SWA cache no longer holds them and no checkpoint covers the
    window, so llama-server forced a full re-processing and erased the slot's four checkpoints."""
    app, attached = watched(SERVER)
    try:
        async with app.run_test(size=size) as pilot:
            await absorbed(app, pilot, attached)
            panel = app.query_one(SlotsPanel)
            assert panel.display
            shown = str(panel.render())
            await pilot.press("f")  # the log's cell events (of a burst, the log shows the latest)
            log = "\n".join(log_lines(app))
    finally:
        attached.close()
    flat = " ".join(shown.split())  # as it reads, whatever the panel's width wrapped
    assert "slot 0 · idle, keeps 73 of 512 tokens" in flat and "slot 1 · idle, keeps 153 of 512 tokens" in flat, shown
    assert "▏0 new▏14 kept▏32 forced" in flat and "▏22 new" in flat, shown
    assert "0 reused 40 lost" in flat, shown  # task 32: held in common, processed again
    assert "cache from a pos not in the log, window needs 24: no checkpoint" in flat, shown
    assert "-1" not in shown and "0.0 MiB" not in shown, shown  # what the log does not give is not a number
    assert "checkpoints 2 · 41 KiB" in flat, shown  # the two created for task 32 (the four before were erased)
    assert "4 turns: 570 of 840 prompt tokens processed" in flat, shown
    # the causes of the cells a slot's memory_seq_rm freed, as the engine's own causes read
    assert "by memory_seq_rm [0, end) of slot 0, task 32" in log and "seen at the slot search of ubatch" in log


# ---- cells a log shows shared without naming by whom -----------------------------------------------------
async def test_unnamed_sharers_are_marked_and_the_inspector_says_so(tmp_path):
    app, attached = watched(before_step_12(tmp_path))
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await absorbed(app, pilot, attached)
            lane = app.query_one(CellGrid).lanes[0]
            assert lane.text[:11].tolist() == [style.GLYPH_SHARED_UNNAMED] * 4 + [style.GLYPH_ONE] * 2 + \
                [style.GLYPH_SHARED] * 2 + [style.GLYPH_ONE] * 3
            inspected = " ".join((await cursor_on(app, pilot, 2)).split())
            assert f"kv · stream 0 · pos 1 · {UNNAMED}" in inspected, inspected
            known = " ".join((await cursor_on(app, pilot, 6)).split())  # shared by exactly seqs 0 and 1
            assert "pos 4 · seqs 0 1" in known and "does not say" not in known, known
            assert "several seqs: seen at the slot search of ubatch" in known  # the cell's story: when the log showed it
    finally:
        attached.close()


def unknown_position_events() -> list[ev.Event]:
    """A cache of 8 cells whose dump showed cell 1 held by seq 0 at a position its row did not give."""
    created = ev.ContextCreated(
        cache="kv", n_ctx=8, n_ctx_seq=8, kv_size=8, n_stream=1, n_seq_max=1, n_layer=0, type_k="?", type_v="?",
        v_trans=False, k_bytes=0, v_bytes=0, n_batch=0, n_ubatch=0, pad=256, unified=True, model_name="", log_lines=(),
        n_swa=0, n_swa_train=0, swa_type=0)
    cells = np.array([0, 1], dtype=np.int64)
    bits = np.zeros((2, ev.SEQ_BITS_BYTES), dtype=np.uint8)
    bits[:, 0] = 1
    change = ev.StreamCells(0, cells, np.array([0, ev.POS_UNKNOWN]), np.zeros(2, np.int64), bits, 2)
    seen = ev.CellsSeen(cache="kv", changes=(change,),
                        cause="seen at the slot search of ubatch 1", ubatch=1, uncertain=(np.zeros(2, dtype=bool),))
    return [dataclasses.replace(e, seq_no=k) for k, e in enumerate([created, seen])]


class Arrived:
    """A subscription that holds the given events."""

    dropped = 0

    def __init__(self, events: list[ev.Event]) -> None:
        self.events = events

    def drain(self) -> list[ev.Event]:
        out, self.events = self.events, []
        return out


async def test_a_position_the_log_does_not_give_is_said_to_be_unknown():
    app = KvscopeApp(Source("session", Watcher(Arrived(unknown_position_events()))))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        inspected = " ".join((await cursor_on(app, pilot, 1)).split())
    assert "kv · stream 0 · position not in the log · seq 0" in inspected, inspected
    assert str(ev.POS_UNKNOWN) not in inspected


# ---- the notebook explorer: the same words ---------------------------------------------------------------
def test_the_notebook_grid_marks_unnamed_sharers_and_hovers_as_the_inspector_says(tmp_path):
    pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")
    from explorer.grid import CELLS
    from explorer.grid import UNNAMED as UNNAMED_TRACE
    from explorer.grid import CellGrid as NotebookGrid

    attached = AttachedLog.read(before_step_12(tmp_path), start=False)
    watcher = Watcher.of(attached)
    attached.start()
    try:
        assert attached.wait(30)
        grid = NotebookGrid(watcher, columns=32, widget=False)
    finally:
        attached.close()
    hover = np.array(grid.trace(0, CELLS).text, dtype=object).ravel()
    assert [hover[c].split("<br>")[0] for c in range(4)] == [f"pos {p} · {UNNAMED}" for p in (0, 0, 1, 1)]
    assert hover[6].split("<br>")[0] == "pos 4 · seq 0, 1"  # the sharers the log does name
    marks = grid.trace(0, UNNAMED_TRACE)
    assert sorted(zip(marks.y, marks.x)) == [(0, c) for c in range(4)]
    assert set(marks.text) == {style.GLYPH_SHARED_UNNAMED} and marks.showlegend

    unknown = Watcher(Arrived(unknown_position_events()))
    hover = np.array(NotebookGrid(unknown, columns=8, widget=False).trace(0, CELLS).text, dtype=object).ravel()
    assert hover[1].startswith("position not in the log · seq 0"), hover[1]


def test_the_notebook_server_view_shows_the_forced_re_processing():
    pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")
    from explorer.server import ServerView

    attached = AttachedLog.read(SERVER, start=False)
    watcher = Watcher.of(attached)
    attached.start()
    try:
        assert attached.wait(30)
        view = ServerView(watcher, widget=False)
    finally:
        attached.close()
    reused, lost, new = view.figure.data
    assert list(reused.x) == ["task 0 · slot 0", "task 14 · slot 0", "task 22 · slot 1", "task 32 · slot 0"]
    assert list(reused.y) == [0, 270, 0, 0] and list(lost.y) == [0, 0, 0, 40] and list(new.y) == [270, 80, 150, 30]
    note = reused.customdata[3]
    assert "full re-processing forced" in note and "window needs 24" in note and "-1" not in note, note
    assert "slot 0</b> · idle, keeps 73 of 512 tokens · 2 checkpoints" in view.slots_html.value


# ---- snapshots at the sizes people use (pytest-textual-snapshot; see tests/test_tui_snapshots.py) ------------
@dataclasses.dataclass
class SavedLog:
    """What the explorer asks of an attached source's log besides its events: its name and kind."""

    label: str
    kind: str = "file"

    def close(self) -> None:
        pass


def attach_events(tmp_path: Path, name: str, text: str) -> list[ev.Event]:
    """A log's events as `kvscope attach --log NAME` publishes them, made the same on every run: read under a
    relative name, every LogStats but the last left out (they come by the clock), renumbered, times zeroed."""
    import os

    path = tmp_path / name
    path.write_text(text)
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        attached = AttachedLog.read(name, start=False)
        subscription = attached.subscribe(1 << 20)
        attached.start()
        assert attached.wait(30)
        attached.close()
    finally:
        os.chdir(here)
    events = subscription.drain()
    last_stats = max(k for k, e in enumerate(events) if isinstance(e, ev.LogStats))
    kept = [e for k, e in enumerate(events) if not isinstance(e, ev.LogStats) or k == last_stats]
    return [dataclasses.replace(e, seq_no=k, time=0.0) for k, e in enumerate(kept)]


def snapshot_app(events: list[ev.Event], name: str) -> KvscopeApp:
    return KvscopeApp(Source("attached", Watcher(Arrived(list(events))), attached=SavedLog(name), label=name))


async def drawn(pilot, events: list[ev.Event]) -> None:
    """Every event absorbed and drawn, the event log at its last line."""
    app = pilot.app
    for _ in range(200):
        if not app.watcher.backlog and app.watcher.events == len(events):
            break
        app.refresh_view()
        await pilot.pause()
    assert app.watcher.events == len(events)
    log = app.query_one(EventLog)
    for _ in range(20):
        app.refresh_view()
        await pilot.pause()
        if log.max_scroll_y > 0 and log.scroll_offset.y >= log.max_scroll_y:
            break
    if log.show_vertical_scrollbar:  # its thumb follows the scroll a frame later
        log.vertical_scrollbar.position = log.scroll_offset.y
        log.vertical_scrollbar.refresh()
    await pilot.pause()


@pytest.fixture(scope="module")
def server_events(tmp_path_factory):
    return attach_events(tmp_path_factory.mktemp("attach"), "server.log", SERVER.read_text())


@pytest.fixture(scope="module")
def unified_events(tmp_path_factory):
    text = UNIFIED.read_text()
    return attach_events(tmp_path_factory.mktemp("attach"), "unified.log", text[:text.index("=== STEP 12")])


@pytest.mark.parametrize("size", SIZES)
def test_a_watched_llama_server_screen(snap_compare, server_events, size):
    """The server's slots beside the grid, the log's figures in the status line, only the keys that watch."""
    async def run_before(pilot) -> None:
        await drawn(pilot, server_events)

    assert snap_compare(snapshot_app(server_events, "server.log"), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES)
def test_an_unnamed_sharer_inspected(snap_compare, unified_events, size):
    """The ▚ cells of the unified log before its step 12, the cursor on one: the inspector lists who may hold it."""
    async def run_before(pilot) -> None:
        await drawn(pilot, unified_events)
        assert UNNAMED in " ".join((await cursor_on(pilot.app, pilot, 2)).split())

    assert snap_compare(snapshot_app(unified_events, "unified.log"), terminal_size=size, run_before=run_before)


def test_a_slot_that_shifted_its_context_says_so_in_both_explorers():
    """llama-server's context-shift line (as kvscope's simulation writes it, in llama-server's words): the
    slot's context and its shifts, in the slots panel's words and the notebook ServerView's."""
    from engine.watch.describe import context_shifts_text, slot_keeps_text
    from engine.watch.llama_log import LlamaLogParser
    from engine.watch.server_slots import ServerSlots

    lines = [
        "0.00.100.000 I slot   operator(): id  0 | task 0 | new prompt, n_ctx_slot = 512, n_keep = 0, task.n_tokens = 500",
        "0.00.100.001 I slot   operator(): id  0 | task 0 | cached n_tokens = 0, memory_seq_rm [0, end)",
        "0.00.200.000 W slot update_slots: id  0 | task 0 | slot context shift, n_keep = 11, n_left = 500, n_discard = 250",
        "0.00.300.000 W slot update_slots: id  0 | task 0 | slot context shift, n_keep = 11, n_left = 500, n_discard = 250",
        "0.00.400.000 I slot print_timing: id  0 | task 0 | prompt eval time =      41.30 ms /   500 tokens (    0.15 ms per token)",
        "0.00.400.001 I slot      release: id  0 | task 0 | stop processing: n_tokens = 269, truncated = 1",
    ]
    parser = LlamaLogParser()
    slots = ServerSlots()
    for event in parser.feed("\n".join(lines) + "\n") + parser.finish():
        slots.apply(event)
    view = slots.slots[0]
    assert (view.n_ctx_slot, view.context_shifts, view.turns[-1].context_shifts) == (512, 2, 2)
    assert slot_keeps_text(view) == "idle, keeps 269 of 512 tokens"
    assert context_shifts_text(view.context_shifts) == "2 context shifts"
    from tui.slots import _slot_lines

    text = Text()
    _slot_lines(text, view, True, 20)
    assert "slot 0 · idle, keeps 269 of 512 tokens · 2 context shifts" in text.plain
    pytest.importorskip("ipywidgets", reason="the notebook explorer needs the jupyter extra")
    from explorer.server import ServerView

    shown = ServerView.__new__(ServerView)
    shown.dark = True
    assert "idle, keeps 269 of 512 tokens · 2 context shifts" in ServerView._slots_text(shown, slots)
