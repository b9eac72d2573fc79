"""The terminal explorer on vLLM / SGLang workers' KV events (a source of kind "kv-events"): the block views replace
the cell grid. Driven as a person would (Textual's pilot) on a fake publisher: an object with subscribe(maxsize)
and current_state(), as the KvEventSubscriber has, backed by an EventBus that the tests publish block events on.
What is asserted is what the screen shows: the lanes, the summaries, the tree, the inspector's sentence, the
eviction log, the status line, the keys and the help."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine import events as ev
from engine.watch import block_views as bv
from engine.watch import style
from engine.watch.kv_events.formats import hash_text
from engine.watch.sources import kv_events_source
from tests.test_block_mirror import BS, CONVERSATION_A, CONVERSATION_B, SYSTEM, chain, stored
from tests.test_block_views import T0, VOCAB, clock
from tests.test_tui import help_lines, screen_lines
from tui.app import KvscopeApp
from tui.blocks import BlockInspector, BlockLanes, LinesPanel
from tui.grid import CellGrid
from tui.keys import BLOCK_KEYS
from tui.screens import HelpScreen
from tui.status import StatusLine

pytestmark = pytest.mark.anyio
SIZES = [(80, 24), (200, 60)]
LABEL = "vLLM KV events from tcp://h:5557, tcp://h:5558"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakePublishers:
    """What the explorer needs of a KvEventSubscriber: subscribe(maxsize) and current_state() (session-like, for
    Watcher.of), a label and close(); the events are whatever a test publishes on its bus."""

    kind = "kv-events"

    def __init__(self, label: str = LABEL) -> None:
        self.bus = ev.EventBus()
        self.label = label
        self.closed = False

    def subscribe(self, maxsize: int = 65536, kinds=None, with_state: bool = True) -> ev.Subscription:
        return self.bus.subscribe(maxsize, kinds, with_state)

    def current_state(self) -> list[ev.Event]:
        return self.bus.current_state()

    def close(self) -> None:
        self.closed = True

    def publish(self, *events: ev.Event) -> None:
        for event in events:
            self.bus.publish(event)


def two_workers(fake: FakePublishers) -> None:
    """Two workers sharing a system prompt, each with its own conversation; worker 0 offloads to CPU."""
    fake.publish(
        VOCAB,
        ev.SessionStatus("attached", 0, "kv-events", message=f"watching {LABEL}"),
        ev.KvWorkerSeen(0, "tcp://h:5557", 0, "worker 0 (rank 0 at h:5557)", capacity_blocks=8, dialect="map"),
        ev.KvWorkerSeen(1, "tcp://h:5558", 1, "worker 1 (rank 1 at h:5558)", capacity_blocks=8, dialect="map"),
        stored(0, CONVERSATION_A, ts=T0 + 1.0),
        stored(1, SYSTEM, ts=T0 + 2.0),
        stored(1, CONVERSATION_B, skip=3, ts=T0 + 3.0),
        stored(0, CONVERSATION_A[:2 * BS], medium="CPU", ts=T0 + 4.0),
        ev.KvEventStats("tcp://h:5557", 40, 90, 7, 0, lost=2, replayed=3, dialect="map"),
        ev.KvEventStats("tcp://h:5558", 30, 60, 4, 0, malformed=1, unknown_fields=5, dialect="map"),
    )


def app_on(fake: FakePublishers) -> KvscopeApp:
    return KvscopeApp(kv_events_source(fake))


async def drawn(app: KvscopeApp, pilot) -> None:
    """Every event published so far absorbed and drawn: the lanes, the tree and the router's view (worked out on
    a thread) included."""
    app.refresh_view()
    await worked_out(app, pilot)


async def worked_out(app: KvscopeApp, pilot) -> None:
    """The block views worked out for what is on screen now."""
    await pilot.pause()
    for _ in range(300):
        if not app.blocks_busy:
            break
        await pilot.pause(0.01)
    assert not app.blocks_busy
    await pilot.pause()


def text_of(app: KvscopeApp, selector: str) -> str:
    return str(app.query_one(selector).render())


def screen(app: KvscopeApp) -> str:
    return "\n".join(screen_lines(app))


async def cursor_to(app: KvscopeApp, pilot, lane: int, glyph: int) -> None:
    lanes = app.query_one(BlockLanes)
    k, g = lanes.cursor
    await pilot.press(*(["right_square_bracket"] * (lane - k) if lane >= k else ["left_square_bracket"] * (k - lane)))
    k, g = lanes.cursor
    await pilot.press(*(["right"] * (glyph - g) if glyph >= g else ["left"] * (g - glyph)))
    assert lanes.cursor == (lane, glyph)


# ---- what the screen shows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
async def test_lanes_summaries_and_the_tree_show_the_workers_blocks(size):
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    async with app.run_test(size=size) as pilot:
        await drawn(app, pilot)
        assert not app.query(CellGrid)  # the block views replace the cells
        lanes = app.query_one(BlockLanes)
        assert [(s.lane.worker, s.lane.name, s.lane.glyphs) for s in lanes.lanes] == [
            (0, "GPU", style.GLYPH_ONE * 5 + style.GLYPH_EMPTY * 3),
            (0, "CPU", style.GLYPH_ONE * 2),
            (1, "GPU", style.GLYPH_ONE * 4 + style.GLYPH_EMPTY * 4)]
        shown = screen_lines(app)
        width = size[0]
        assert all(len(line) <= width for line in shown)
        text = "\n".join(shown)
        # each lane's glyphs on a row of their own, after its title
        for row in (" " + style.GLYPH_ONE * 5 + style.GLYPH_EMPTY * 3, " " + style.GLYPH_ONE * 4 + style.GLYPH_EMPTY * 4):
            assert any(line.startswith(row + " ") for line in shown), row
        assert " GPU · 5 of 8 blocks" in text and " CPU · 2 blocks" in text
        # a narrow lane keeps the worker's name and its GPU count, leaving out its address first
        address = " (rank {0} at h:555{1})" if width >= 200 else ""
        assert f"worker 0{address.format(0, 7)} · GPU 5 of 8 blocks" in text
        assert f"worker 1{address.format(1, 8)} · GPU 4 of 8 blocks" in text
        if width >= 200:
            assert "worker 0 (rank 0 at h:5557) · GPU 5 of 8 blocks · CPU 2 · +1.4 stored/s · -0.0 evicted/s · " \
                   "2 batches lost" in text
            assert "prefix tree · worker 0" in text and "█ 5 blocks 'You are a helpful'" in text
            assert "shared prefixes" in text
            assert " ".join(text_of(app, "#router").split()) == (
                "shared prefixes █ 'You are a helpful' 3 blocks (12 tokens) on workers 0 and 1, then worker 0 +2 · "
                "worker 1 +1 █ worker 0 alone holds 2 blocks of 'You are a helpful' █ worker 1 alone holds 1 block "
                "of 'You are a helpful'")
        # the tree panel holds the selected worker's tree_lines, whatever the width cuts
        assert text_of(app, "#tree").startswith(("█ 5 blocks 'You are", "█ 5 blocks 'You"))
        # the status line: what is watched, the blocks, and how the reading goes (lost and malformed: warnings)
        status = shown[-2]
        assert status.startswith(" attached · 2 workers, 11 blocks · ") and "2 lost" in status, status
        assert "1 malformed" in status and "unknown: 5 fields" in status, status
        if width >= 200:
            assert "70 batches" in status and "3 replayed" in status and LABEL in status, status


async def test_the_inspector_explains_the_block_under_the_cursor_and_follows_it():
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    a = chain(CONVERSATION_A)
    async with app.run_test(size=(160, 48)) as pilot:
        await drawn(app, pilot)
        await cursor_to(app, pilot, 0, 3)
        said = text_of(app, "#inspector")
        expected = (f"stored at {clock(T0 + 1.0)} by worker 0, child of block {hash_text(a[2])} ('You are a helpful', "
                    f"3 blocks deep), tokens ' the LORD said unto'")
        assert said == "█ " + expected, said
        assert app.query_one(BlockInspector).border_title == f"block {hash_text(a[3])} · worker 0"
        # a prefix stored earlier on the left goes: the cursor moves with its block, the sentence stays
        other = [60, 61, 62, 63, 64, 65, 66, 67]
        fake.publish(stored(0, other, ts=T0 - 10.0))
        await drawn(app, pilot)
        assert app.query_one(BlockLanes).cursor == (0, 5)
        assert text_of(app, "#inspector") == "█ " + expected
        # evicted: the cursor stays, and the inspector tells the eviction
        fake.publish(ev.BlocksRemoved(0, (a[4], a[3]), ts=T0 + 9.0))
        await drawn(app, pilot)
        assert app.query_one(BlockLanes).cursor == (0, 5)
        assert text_of(app, "#inspector").endswith(f"; evicted {clock(T0 + 9.0)}")
        assert app.query_one(BlockInspector).border_title == f"block {hash_text(a[3])} · worker 0 · evicted"
        # the cursor moves on: the block now under it
        await pilot.press("left")
        assert text_of(app, "#inspector").endswith("tokens ':⏎ Q:', also held by worker 1")


async def test_an_eviction_appears_in_the_log():
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    b = chain(CONVERSATION_B)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(app, pilot)
        assert "evictions, newest first · 0 logged" in screen(app)
        fake.publish(ev.BlocksRemoved(1, (b[3],), ts=T0 + 6.0))
        await drawn(app, pilot)
        line = f"{clock(T0 + 6.0)}  worker 1  {hash_text(b[3])} evicted · depth 3 of 'You are a helpful' · ' def f():'"
        text = screen(app)
        assert "evictions, newest first · 1 logged" in text and line in text, text
        assert "worker 1 · GPU 3 of 8 blocks" in text  # at 120 columns a lane leaves the worker's address out
        fake.publish(ev.BlocksCleared(0, ts=T0 + 7.0, cause="publisher restarted"))
        await drawn(app, pilot)
        assert f"{clock(T0 + 7.0)}  worker 0  " in screen_lines(app)[-7]  # the newest line first
        assert "publisher restarted" in screen(app)


async def test_the_views_follow_events_as_they_arrive():
    fake = FakePublishers()
    app = app_on(fake)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "no worker heard from yet" in screen(app)
        two_workers(fake)  # after the app started: its own frames must pick them up
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "worker 1 · GPU 4 of 8 blocks" in screen(app):
                break
        assert "worker 1 · GPU 4 of 8 blocks" in screen(app)
        fake.publish(stored(1, CONVERSATION_A, skip=3, ts=T0 + 5.0))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "GPU 6 of 8 blocks" in screen(app):
                break
        assert "worker 1 · GPU 6 of 8 blocks" in screen(app)


# ---- keys --------------------------------------------------------------------------------------------------
async def test_tab_selects_the_next_worker_and_its_tree_and_brackets_the_lanes():
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    fake.publish(stored(1, CONVERSATION_A, skip=3, ts=T0 + 5.0))
    async with app.run_test(size=(200, 60)) as pilot:
        await drawn(app, pilot)
        lanes = app.query_one(BlockLanes)
        assert lanes.selected_worker == 0
        await pilot.press("tab")
        await worked_out(app, pilot)
        assert lanes.selected_worker == 1 and lanes.cursor == (2, 0)
        tree = app.query_one("#tree", LinesPanel)
        assert tree.border_title == "prefix tree · worker 1"
        assert text_of(app, "#tree").splitlines() == ["█ 3 blocks 'You are a helpful'  +3 in 2 branches",
                                                      "█   2 blocks ' the LORD said unto'", "█   1 block ' def f():'"]
        assert "selected worker 1" in screen_lines(app)[0]
        await pilot.press("tab")  # round again
        assert lanes.selected_worker == 0
        await pilot.press("shift+tab")
        assert lanes.selected_worker == 1
        await pilot.press("left_square_bracket")  # the lane before: worker 0's CPU
        assert lanes.cursor[0] == 1 and lanes.lanes[1].lane.medium == "CPU"
        assert app.query_one(BlockInspector).border_title.endswith("worker 0")
        assert " by worker 0 in GPU and CPU, " in text_of(app, "#inspector")
        await pilot.press("down")  # past the lane's last row: into the next lane
        assert lanes.cursor[0] == 2


@pytest.mark.parametrize("size", SIZES)
async def test_the_key_bar_offers_what_moves_the_view_and_refuses_commands(size):
    fake = FakePublishers()
    app = app_on(fake)
    app.NOTIFICATION_TIMEOUT = 60
    two_workers(fake)
    async with app.run_test(size=size) as pilot:
        await drawn(app, pilot)
        keys = screen_lines(app)[-1]
        assert "? help" in keys and "q quit" in keys and "tab next worker" in keys, keys
        assert "start/pause" not in keys and "n step" not in keys
        for key in ("space", "n", "p", "w"):
            await pilot.press(key)
        await pilot.pause()
        notices = [str(n.message) for n in app._notifications]
        assert len(notices) == 1 and "only watches the workers' KV events" in notices[0], notices
        await pilot.click("#keys", offset=(keys.index("? help"), 0))
        assert isinstance(app.screen, HelpScreen)


def test_every_block_key_in_the_bar_is_bound_to_what_it_says():
    from textual.app import App

    bound = {key.strip(): binding.action for binding in KvscopeApp.BINDINGS for key in binding.key.split(",")}
    bound[App.COMMAND_PALETTE_BINDING] = "command_palette"
    for hint in BLOCK_KEYS:
        actions = {bound.get(key) for key in hint.bindings}
        assert None not in actions, (hint, "a key the bar shows is not bound")
        if hint.action is not None:
            assert actions == {hint.action}, hint
        else:
            assert all(a.startswith(("cursor(", "lane(")) for a in actions), hint


async def test_the_help_explains_blocks_prefixes_and_the_keys():
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(app, pilot)
        await pilot.press("question_mark")
        text = " ".join(" ".join(await help_lines(app, pilot)).split())
        assert "Prefixes keep one colour on every worker" in text
        assert "what a KV-aware router sees" in text and "tab shift+tab the next / previous worker" in text
        assert "space" not in text.split()  # no session key is offered
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_the_palette_goes_to_the_block_evicted_last():
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    b = chain(CONVERSATION_B)
    fake.publish(ev.BlocksRemoved(1, (b[3],), ts=T0 + 6.0))
    async with app.run_test(size=(160, 48)) as pilot:
        await drawn(app, pilot)
        await pilot.press("ctrl+p")
        await pilot.press(*"evicted last")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        lanes = app.query_one(BlockLanes)
        assert lanes.selected_worker == 1
        assert app.query_one(BlockInspector).border_title == f"block {hash_text(b[3])} · worker 1 · evicted"
        assert text_of(app, "#inspector").endswith(f"; evicted {clock(T0 + 6.0)}")
        await pilot.press("ctrl+p")
        await pilot.press(*"worker 0: its")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert lanes.selected_worker == 0 and lanes.cursor == (0, 0)


@pytest.mark.parametrize("size", [(80, 24), (200, 60), (40, 12)])
async def test_many_workers_and_blocks_fit_any_size_without_a_crash(size):
    fake = FakePublishers()
    app = app_on(fake)
    fake.publish(VOCAB)
    for w in range(6):
        fake.publish(ev.KvWorkerSeen(w, f"tcp://h:{5557 + w}", w, f"worker {w} (rank {w} at h:{5557 + w})",
                                     capacity_blocks=4096))
        n = 500 * (w + 1)
        hashes = tuple((w * 10_000 + i + 1).to_bytes(8, "big") for i in range(n))
        fake.publish(ev.BlocksStored(w, hashes, None, np.arange(n * BS) % 200, BS, ts=T0 + w))
        fake.publish(ev.BlocksStored(w, hashes[:100], None, np.arange(100 * BS) % 200, BS, medium="CPU", ts=T0 + w))
    async with app.run_test(size=size) as pilot:
        await drawn(app, pilot)
        shown = screen_lines(app)
        assert len(shown) == size[1] and all(len(line) <= size[0] for line in shown)
        lanes = app.query_one(BlockLanes)
        assert len(lanes.lanes) == 12
        # every lane folded to its rows: no more glyphs than it has places on screen
        for s in lanes.lanes:
            assert s.lane.n_glyphs <= s.per_row * s.n_rows
        await pilot.press("tab", "right", "down", "down", "right_square_bracket", "end", "left")
        await pilot.pause()
        assert app.query_one(StatusLine).render()
        assert bv.describe_block(app.watcher.mirror.blocks, lanes.selected_worker, lanes.cursor_glyph()[2],
                                 VOCAB) in " ".join(text_of(app, "#inspector").split("\n"))


async def test_blocks_take_their_prefix_colour_on_a_dark_and_a_light_theme():
    fake = FakePublishers()
    app = app_on(fake)
    two_workers(fake)
    root, own = chain(SYSTEM)[0], chain(CONVERSATION_A)[3]
    async with app.run_test(size=(120, 40)) as pilot:
        for theme, dark in (("textual-dark", True), ("textual-light", False)):
            app.theme = theme
            await drawn(app, pilot)
            lanes = app.query_one(BlockLanes)
            # worker 0's GPU lane: the system prompt's 3 blocks, its own conversation's 2, 3 empty places
            first_row = lanes.lanes[0].first_line + 1
            segments = [s for s in lanes.render_line(first_row) if s.text.strip()]
            colours = [(s.style.color.get_truecolor().hex.upper(), s.text) for s in segments][1:]  # after the cursor
            glyphs = "".join(text for _, text in colours)
            per_glyph = [colour for colour, text in colours for _ in text]
            assert glyphs == style.GLYPH_ONE * 4 + style.GLYPH_EMPTY * 3
            assert per_glyph == [bv.prefix_color(root, dark)] * 2 + [bv.prefix_color(own, dark)] * 2 + \
                [bv.prefix_color(None, dark)] * 3


async def test_a_recording_of_kv_events_replays_in_the_block_views(tmp_path):
    """`kvscope attach --vllm -o FILE`, then `kvscope tui --replay FILE`: the block views, moved by the replay's
    keys (a recording of cells keeps the grids)."""
    from engine.watch.recording import Recorder
    from engine.watch.sources import replay_source

    a = chain(CONVERSATION_A)
    bus, path = ev.EventBus(), tmp_path / "blocks.kvtrace"
    with Recorder(path, keyframe_every=2) as recorder:
        recorder.attach(bus)
        for event in [ev.KvWorkerSeen(0, "tcp://a:5557", 0), stored(0, CONVERSATION_A, ts=T0 + 1.0),
                      stored(0, CONVERSATION_B, skip=3, ts=T0 + 2.0), ev.BlocksRemoved(0, (a[4],), ts=T0 + 3.0)]:
            bus.publish(event)
        recorder.pump()
    source = replay_source(path)
    assert source.shows_blocks
    app = KvscopeApp(source)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            held = []
            for _ in range(4):
                await pilot.press("full_stop")
                await drawn(app, pilot)
                held.append(app.watcher.mirror.blocks.held(0))
            assert held == [0, 5, 6, 5]
            assert app.query_one(BlockLanes).layout is not None
            assert "event 4 of 4" in str(app.query_one("#evictions", LinesPanel).border_subtitle)
            assert hash_text(a[4]) in text_of(app, "#evictions")
    finally:
        source.close()
