"""The notebook's block views of a vLLM / SGLang deployment (explorer/blocks.py) and the Explorer on KV events:
drawn from a watcher of a fake subscriber (synthetic block events on an EventBus), and end to end from a fake
vLLM publisher over ZeroMQ."""
from __future__ import annotations

import dataclasses
import hashlib
import html
import re
import time

import numpy as np
import pytest

pytest.importorskip("ipywidgets", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")
pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")

from engine import events as ev  # noqa: E402
from engine.errors import KvscopeError  # noqa: E402
from engine.watch import block_views as bv  # noqa: E402
from engine.watch import style  # noqa: E402
from engine.watch.kv_events.formats import hash_text  # noqa: E402
from engine.watch.sources import kv_events_source  # noqa: E402
from engine.watch.watcher import Watcher  # noqa: E402
from explorer import Explorer  # noqa: E402
from explorer.blocks import BlockLanes, BlockViews, EvictionLog, PrefixTree, RouterView  # noqa: E402

BS = 4
SYSTEM = list(range(100, 112))  # 3 blocks
CONVERSATION_A = SYSTEM + list(range(1, 9))  # 5 blocks: the system prompt's, then 2 of its own
CONVERSATION_B = SYSTEM + list(range(50, 54))  # 4 blocks
PIECES = tuple(f"<t{k}>" if k == 100 else f"w{k} " for k in range(200))  # a '<' that must not read as a tag
VOCABULARY = ev.Vocabulary("test-model", PIECES)


def chain(tokens: list[int]) -> list[bytes]:
    """The hashes of the full blocks of `tokens`, chained as vLLM chains them."""
    out, parent = [], b"seed"
    for k in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + np.array(tokens[k * BS:(k + 1) * BS], dtype=np.int64).tobytes()).digest()
        out.append(parent)
    return out


def stored(worker: int, tokens: list[int], *, skip: int = 0, ts: float = 1000.0, medium: str = ev.MEDIUM_GPU,
           group: int = 0, **fields) -> ev.BlocksStored:
    """The BlocksStored of the blocks of `tokens` after the first `skip` (whose last is the parent)."""
    hashes = chain(tokens)
    return ev.BlocksStored(worker, tuple(hashes[skip:]), hashes[skip - 1] if skip else None,
                           np.array(tokens[skip * BS:len(hashes) * BS]), BS, medium=medium, group=group, ts=ts,
                           **fields)


class FakeSubscriber:
    """Session-like as a KvEventSubscriber is (subscribe, current_state, label, status, close), its events put on
    its bus by the test."""

    label = "vLLM KV events from tcp://a:5557, tcp://a:5558"

    def __init__(self) -> None:
        self.bus = ev.EventBus()
        self.closed = False
        self.status = ev.SessionStatus("attached", 0, "kv-events", message=f"watching {self.label}")
        self.published: list[ev.Event] = []
        # a late subscriber starts from what was said so far, as the real one's BlockMirror state gives it
        self.bus.add_state_source(self._state_events)

    def _state_events(self) -> list[ev.Event]:
        return [dataclasses.replace(e) for e in self.published]

    def subscribe(self, maxsize: int = 65536, kinds=None, with_state: bool = True) -> ev.Subscription:
        return self.bus.subscribe(maxsize, kinds, with_state)

    def current_state(self) -> list[ev.Event]:
        return self.bus.current_state()

    def publish(self, *events: ev.Event) -> None:
        for event in events:
            self.published.append(event)
            self.bus.publish(event)

    def close(self) -> None:
        self.closed = True


def deployment(capacity: int = 8) -> FakeSubscriber:
    """Worker 0 holds conversation A on the GPU (capacity known), a copy on the CPU and one block of a sliding-window
    group; worker 1 holds conversation B, the system prompt stored apart from the rest."""
    fake = FakeSubscriber()
    fake.publish(VOCABULARY, fake.status,
                 ev.KvWorkerSeen(0, "tcp://a:5557", 0, "worker 0 (rank 0 at a:5557)", capacity_blocks=capacity),
                 ev.KvWorkerSeen(1, "tcp://a:5558", 1, "worker 1 (rank 1 at a:5558)"),
                 stored(0, CONVERSATION_A, ts=1000.0),
                 stored(0, CONVERSATION_A, medium="CPU", ts=1001.0),
                 stored(0, SYSTEM[:4], group=1, group_kind="sliding_window", sliding_window=128, ts=1002.0),
                 stored(1, SYSTEM, ts=1003.0),
                 stored(1, CONVERSATION_B, skip=3, ts=1004.0))
    return fake


def watcher_of(fake: FakeSubscriber) -> Watcher:
    watcher = Watcher.of(fake)
    watcher.poll()
    return watcher


def sentence(hover: str) -> str:
    """A mark's hover text as the sentence it shows (explorer.blocks.hover_text, undone)."""
    return html.unescape(hover.replace(",<br>", ", "))


def lane_marks(view: BlockLanes) -> list[tuple[str, list, list, list, list]]:
    """Per trace: its name, marks' y, colours, hover texts and opacities."""
    return [(t.name, list(t.y), list(t.marker.color), list(t.hovertext), list(t.marker.opacity))
            for t in view.figure.data]


# ---- the lanes ------------------------------------------------------------------------------------------------------
def test_lanes_draw_a_mark_per_block_in_its_prefix_colour_with_tiers_apart():
    fake = deployment(capacity=8)
    watcher = watcher_of(fake)
    view = BlockLanes(watcher, columns=4, widget=False)
    mirror = watcher.mirror.blocks
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    names = [name for name, *_ in lane_marks(view)]
    assert names == ["worker 0 GPU", "worker 0 group 1 sliding window 128", "worker 0 CPU", "worker 1 GPU"]
    rows = [set(y) for _, y, *_ in lane_marks(view)]
    assert all(rows[i].isdisjoint(rows[j]) for i in range(4) for j in range(i + 1, 4)), "each tier has rows of its own"
    gpu, window, cpu, other = view.figure.data
    # worker 0's GPU: the system prompt's 3 blocks, its own conversation's 2 (a branch of its own: worker 1 has
    # another below the prompt), then the 3 empty places its capacity of 8 leaves
    system_colour, own_colour = bv.prefix_color(a[0], dark=False), bv.prefix_color(a[3], dark=False)
    assert list(gpu.marker.color) == [system_colour] * 3 + [own_colour] * 2 + [style.EMPTY_FILL[False]] * 3
    # the capacity is the GPU pool's, for each KV cache group; an offload tier's size no event says
    assert len(window.x) == 8 and list(window.marker.color).count(style.EMPTY_FILL[False]) == 7
    assert len(cpu.x) == 5 and len(other.x) == 4
    assert list(other.marker.color) == [system_colour] * 3 + [bv.prefix_color(b[3], dark=False)], \
        "B continues the same system prompt (its colour), then its own conversation"
    # every held block's mark says describe_block's sentence of it, in its own tier
    for trace, lane in zip(view.figure.data, view.lanes):
        held = mirror.blocks(lane.worker, lane.medium, lane.group)
        assert set(lane.hashes) == set(held)
        for k, block_hash in enumerate(lane.hashes):
            assert sentence(trace.hovertext[k]) == bv.describe_block(mirror, lane.worker, block_hash, VOCABULARY)
    assert sentence(gpu.hovertext[5]) == bv.describe_glyph(mirror, view.lanes[0], 5, VOCABULARY)
    assert "empty" in gpu.hovertext[5]
    assert "&lt;t100&gt;" in gpu.hovertext[0], "token text is escaped, not read as a tag"
    assert set(view.lanes[0].hashes) == set(a) and set(view.lanes[3].hashes) == set(b)
    shown = [html.unescape(re.sub(r"<[^>]+>", "", note.text)) for note in view.figure.layout.annotations]
    assert bv.worker_summary(mirror, 0) in shown and bv.worker_summary(mirror, 1) in shown
    assert f"<b>{html.escape(mirror.label(0))}</b>" in view.figure.layout.annotations[0].text
    assert "GPU · 5 of 8 blocks" in shown and "CPU · 5 blocks" in shown


def test_lanes_redraw_only_when_blocks_change():
    fake = deployment()
    watcher = watcher_of(fake)
    view = BlockLanes(watcher, columns=4)
    drawn = []
    draw = view._draw
    view._draw = lambda *args: drawn.append(args[1]) or draw(*args)
    fake.publish(ev.KvEventStats("tcp://a:5557", 3, 3, 12, 0))
    view.update()
    assert drawn == [], "a stats event changes no block: nothing is sent"
    a = chain(CONVERSATION_A)
    fake.publish(ev.BlocksRemoved(0, (a[4], a[3]), ts=1010.0))
    view.update()
    assert view.lanes[0].hashes == tuple(a[:3])
    assert len(drawn) == 1
    gpu = view.figure.data[0]
    assert len(gpu.x) == 8 and list(gpu.marker.color).count(style.EMPTY_FILL[False]) == 5


def test_a_hundred_thousand_blocks_fold_to_a_bounded_number_of_marks():
    fake = FakeSubscriber()
    n = 100_000
    hashes = tuple(k.to_bytes(8, "big") for k in range(1, n + 1))
    fake.publish(ev.KvWorkerSeen(0, "tcp://a:5557", 0, "worker 0", capacity_blocks=2 * n),
                 ev.BlocksStored(0, hashes, None, np.arange(n * BS) % 200, BS, ts=1000.0))
    watcher = watcher_of(fake)
    started = time.perf_counter()
    view = BlockLanes(watcher, columns=64, rows=16, widget=False)
    took = time.perf_counter() - started
    (trace,) = view.figure.data
    (lane,) = view.lanes
    assert len(trace.x) <= 64 * 16 and lane.blocks_per_glyph == -(-2 * n // (64 * 16))
    assert sum(len(lane.blocks_at(k)) for k in range(lane.n_glyphs)) == n
    colour = bv.prefix_color(hashes[0], dark=False)
    held = [k for k in range(lane.n_glyphs) if lane.blocks_at(k)]
    assert all(trace.marker.color[k] == colour for k in held)
    assert all(trace.marker.color[k] == style.EMPTY_FILL[False] for k in range(len(held), lane.n_glyphs))
    mirror = watcher.mirror.blocks
    for k in (0, len(held) - 1, len(held), lane.n_glyphs - 1):  # full, partly held, empty
        assert sentence(trace.hovertext[k]) == bv.describe_glyph(mirror, lane, k)
    assert [trace.marker.opacity[k] for k in (0, len(held))] == [1.0, 1.0] and trace.marker.opacity[len(held) - 1] < 1
    assert took < 10, f"drawing 100k blocks took {took:.1f} s"


# ---- the prefix tree ------------------------------------------------------------------------------------------------
def icicle_rows(view: PrefixTree) -> dict[str, tuple[str, int, str]]:
    icicle = view.figure.data[0]
    return {i: (p, v, label) for i, p, v, label in zip(icicle.ids, icicle.parents, icicle.values, icicle.labels)}


def test_the_icicle_is_the_mirrors_prefix_tree_with_chains_collapsed():
    fake = FakeSubscriber()
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    fake.publish(VOCABULARY,
                 stored(0, CONVERSATION_A), stored(0, CONVERSATION_B, skip=3),  # a system prompt, two branches
                 stored(1, CONVERSATION_B))  # one chain
    view = PrefixTree(watcher_of(fake), widget=False)
    rows = icicle_rows(view)
    text = bv.tokens_text
    assert rows == {
        "workers": ("", 10, "2 workers"),
        "worker 0": ("workers", 6, "worker 0"), "worker 1": ("workers", 4, "worker 1"),
        f"0/{a[0].hex()}": ("worker 0", 6, html.escape(text(SYSTEM[:4], VOCABULARY))),
        f"0/{a[3].hex()}": (f"0/{a[0].hex()}", 2, html.escape(text(CONVERSATION_A[12:16], VOCABULARY))),
        f"0/{b[3].hex()}": (f"0/{a[0].hex()}", 1, html.escape(text(CONVERSATION_B[12:16], VOCABULARY))),
        f"1/{b[0].hex()}": ("worker 1", 4, html.escape(text(SYSTEM[:4], VOCABULARY))),
    }
    mirror = view.watcher.mirror.blocks
    assert rows["worker 0"][1] == sum(r.n_blocks for r in mirror.tree(0))
    icicle = view.figure.data[0]
    k = list(icicle.ids).index(f"0/{a[3].hex()}")
    assert sentence(icicle.hovertext[k]) == bv.describe_block(mirror, 0, a[3], VOCABULARY)
    # in its branch's colour, as the lanes colour its blocks: the conversation below the shared system prompt
    assert icicle.marker.colors[k] == bv.prefix_color(a[3], dark=False) != bv.prefix_color(a[0], dark=False)
    assert icicle.marker.colors[list(icicle.ids).index(f"0/{a[0].hex()}")] == bv.prefix_color(a[0], dark=False)
    assert view.left_out == (0, 0) and "not drawn" not in view.figure.layout.title.text


def test_blocks_whose_parent_was_never_seen_hang_under_a_box_for_it():
    fake = FakeSubscriber()
    parent, first, second = b"\x07" * 8, b"\x08" * 8, b"\x09" * 8
    fake.publish(ev.BlocksStored(0, (first, second), parent, np.arange(8), BS))  # joined after the parent was stored
    view = PrefixTree(watcher_of(fake), widget=False)
    assert icicle_rows(view) == {
        "worker 0": ("", 2, "worker 0"),  # one worker: its box is the top
        f"0/{parent.hex()}": ("worker 0", 2, hash_text(parent)),
        f"0/{first.hex()}": (f"0/{parent.hex()}", 2, html.escape(bv.tokens_text(range(4)))),
    }


def test_a_large_tree_draws_its_largest_branches_and_says_what_it_left_out():
    fake = FakeSubscriber()
    events = [stored(0, SYSTEM)]
    for k in range(50):  # 50 conversations after the system prompt, conversation k of k % 5 + 1 blocks
        events.append(stored(0, SYSTEM + [150 + k] * (BS * (k % 5 + 1)), skip=3))
    fake.publish(*events)
    view = PrefixTree(watcher_of(fake), max_nodes=11, widget=False)
    rows = icicle_rows(view)
    system = chain(SYSTEM)[0]
    branches = {i: r for i, r in rows.items() if r[0] == f"0/{system.hex()}"}
    # the system prompt, then the 10 largest conversations: the 10 of 5 blocks
    assert len(rows) == 1 + 11 and len(branches) == 10 and {r[1] for r in branches.values()} == {5}
    left = 50 - 10
    left_blocks = sum(k % 5 + 1 for k in range(50)) - 50
    assert view.left_out == (left, left_blocks)
    assert f"… {left:,} more branches ({left_blocks:,} blocks) not drawn" in view.figure.layout.title.text
    assert rows[f"0/{system.hex()}"][1] == 3 + sum(k % 5 + 1 for k in range(50))


def test_a_slow_tree_redraws_after_a_pause_with_the_latest_blocks(monkeypatch):
    from explorer import blocks

    clock = [100.0]
    monkeypatch.setattr(blocks.time, "monotonic", lambda: clock[0])
    fake = FakeSubscriber()
    fake.publish(stored(0, SYSTEM))
    view = PrefixTree(watcher_of(fake), widget=False)
    view._changes.drawn(started=99.0)  # as if that drawing took a second
    fake.publish(stored(0, CONVERSATION_A, skip=3))
    view.update()
    assert icicle_rows(view)["worker 0"][1] == 3, "drawn again only TREE_PACE seconds later"
    clock[0] += blocks.TREE_PACE
    view.update()
    assert icicle_rows(view)["worker 0"][1] == 5, "the change waited, it was not lost"


# ---- the router and the evictions ------------------------------------------------------------------------------------
def test_the_router_and_the_eviction_log_name_the_right_workers_and_blocks():
    fake = deployment()
    watcher = watcher_of(fake)
    router, evictions = RouterView(watcher), EvictionLog(watcher)
    mirror = watcher.mirror.blocks
    a = chain(CONVERSATION_A)
    shown = [html.unescape(line) for line in re.findall(r"<span style='color:#[0-9A-F]{6}'>(.*?)</span>",
                                                        router.widget.value)]
    lines = bv.router_lines(mirror, VOCABULARY, 16)
    coloured = [line for line in lines if line.root is not None]
    assert shown == [line.text for line in coloured]
    # the system prompt is shared, and each worker holds a continuation of it no other does
    assert [(line.worker, line.root) for line in coloured] == [(None, a[0]), (0, a[0]), (1, a[0])]
    assert "workers 0 and 1" in shown[0] and "2 blocks" in shown[1] and "1 block" in shown[2]
    assert all(f"<span style='color:{bv.prefix_color(a[0], False)}'>" in router.widget.value for _ in coloured)
    assert "no block evicted yet" in evictions.text.value

    fake.publish(ev.BlocksRemoved(0, (a[4],), ts=1010.0), ev.BlocksRemoved(1, (chain(CONVERSATION_B)[3],), ts=1011.0))
    watcher.poll()
    router.update()
    evictions.update()
    logged = bv.eviction_lines(mirror, 14, VOCABULARY)
    assert [(line.worker, line.block) for line in logged] == [(1, chain(CONVERSATION_B)[3]), (0, a[4])]  # newest first
    shown = [html.unescape(line) for line in re.findall(r"<span style='color:#[0-9A-F]{6}'>(.*?)</span>",
                                                        evictions.text.value)]
    assert shown == [line.text for line in logged]
    assert "worker 1" in shown[0] and hash_text(chain(CONVERSATION_B)[3]) in shown[0]
    assert "worker 0" in shown[1] and hash_text(a[4]) in shown[1]
    # worker 1's own block is gone: all it holds now, worker 0 holds too
    assert [line.worker for line in bv.router_lines(mirror, VOCABULARY, 16) if line.worker is not None] == [0, 1]
    assert bv.router_lines(mirror, VOCABULARY, 16)[-1].text in html.unescape(router.widget.value)


def test_the_block_views_together_say_how_the_reading_goes():
    fake = deployment()
    fake.publish(ev.KvEventStats("tcp://a:5557", 40, 90, 12, 2, lost=3, replayed=5, malformed=1, unknown_tags=2,
                                 unknown_fields=4, dialect="map"))
    views = BlockViews(watcher_of(fake), columns=8)
    status = html.unescape(re.sub(r"<[^>]+>", "", views.status.value))
    assert status == bv.stats_text(views.watcher.mirror.blocks)
    warned = [html.unescape(w) for w in re.findall(r"<span style='color:#B8860B'>(.*?)</span>", views.status.value)]
    assert warned == ["3 lost", "1 malformed", "unknown: 2 tags, 4 fields"]
    assert "40 batches" in status and "3 lost" in status and "5 replayed" in status and "1 malformed" in status
    assert "unknown: 2 tags, 4 fields" in status
    assert views.figures() == [views.lanes.figure, views.tree.figure]


# ---- the Explorer ----------------------------------------------------------------------------------------------------
def ticks_until(x: Explorer, done, what: str, timeout_s: float = 10.0) -> None:
    """Ticks of the follow ticker, as the browser sends them, until done() (a tick right after a redraw waits, as
    explorer/pacing.py paces them)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not shown after {timeout_s:.0f} s"
        x._ticker.value += 1
        time.sleep(0.02)


def test_the_explorer_on_kv_events_shows_the_block_views_and_follows_them(tmp_path):
    fake = deployment()
    x = Explorer(kv_events_source(fake))
    try:
        assert x.grid is None and x.window is None and x.bars is None
        assert x.blocks.widget in x.widget.children
        assert x._ticker is not None and x._ticker in x.widget.children, "followed from the browser's ticker"
        assert "kv-events" in x.header.value and html.escape(fake.label) in x.header.value
        a = chain(CONVERSATION_A)
        assert x.blocks.lanes.lanes[0].hashes == tuple(a)

        fake.publish(ev.BlocksRemoved(0, (a[4],), ts=1010.0),
                     ev.KvEventStats("tcp://a:5557", 7, 9, 12, 1, malformed=2, unknown_tags=1))
        ticks_until(x, lambda: hash_text(a[4]) in x.blocks.evictions.text.value, "the eviction")
        assert "worker 0" in x.blocks.evictions.text.value
        assert x.blocks.lanes.lanes[0].hashes == tuple(a[:4])
        assert "7 batches" in x.status.value and "2 malformed" in x.status.value and "unknown: 1 tag" in x.status.value
        assert "BlocksRemoved worker 0" in x.log.text.value
        # batches lost for good: worker 0's summary warns that its picture may miss blocks
        fake.publish(ev.KvBatchesLost("tcp://a:5557", 3, 5, recovered=1))
        mirror = x.source.watcher.mirror.blocks
        ticks_until(x, lambda: any(kind == "warning" for _, kind in bv.worker_summary_parts(mirror, 0)), "the loss")
        (warning,) = [text for text, kind in bv.worker_summary_parts(mirror, 0) if kind == "warning"]
        ticks_until(x, lambda: f"<span style='color:#B8860B'>{html.escape(warning)}</span>"
                    in x.blocks.lanes.figure.layout.annotations[0].text, "the warning")
        assert "2 batches" in warning
        page = x.export_html(tmp_path / "blocks.html").read_text()
        assert page.count("<div id=") == 2 and '"type":"icicle"' in page.replace(" ", "")
    finally:
        x.close()
    assert fake.closed


def test_attach_takes_a_deployment_or_a_llama_cpp_not_both(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("")
    with pytest.raises(KvscopeError, match=r"vllm= watches vLLM / SGLang publishers, log= a llama.cpp"):
        Explorer.attach(log, vllm=["tcp://127.0.0.1:5557"])
    with pytest.raises(KvscopeError, match=r"command= a llama.cpp"):
        Explorer.attach(command="llama-server -m m.gguf", vllm="tcp://127.0.0.1:5557")
    with pytest.raises(KvscopeError, match=r"tokenizer= go with vllm="):
        Explorer.attach(log, tokenizer="tokenizer.json")
    with pytest.raises(KvscopeError, match=r"KV event endpoint 'tcp://\*:5557'"):
        Explorer.attach(vllm=["tcp://*:5557"])


def test_attach_to_a_publisher_end_to_end(tmp_path):
    publisher_module = pytest.importorskip("tests.kv_events_publisher")
    tokenizers = pytest.importorskip("tokenizers")
    from engine.watch.kv_events.vocabulary import load_vocabulary

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(50)} | {"[UNK]": 50},
                                                                 unk_token="[UNK]"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with publisher_module.KvEventsPublisher("map") as publisher:
        x = Explorer.attach(vllm=[publisher.spec], tokenizer=tmp_path / "tokenizer.json", capacity_blocks=16)
        try:
            publisher.wait_for_subscribers()
            hashes = [bytes([k]) * 32 for k in range(1, 6)]
            tokens = [(7 * i) % 50 for i in range(5 * 4)]
            publisher.send([publisher_module.stored(hashes[:3], tokens=tokens[:12]),
                            publisher_module.stored(hashes[3:], hashes[2], tokens=tokens[12:])])
            ticks_until(x, lambda: x.blocks.lanes.lanes and x.blocks.lanes.lanes[0].held == 5, "5 blocks stored")
            (lane,) = x.blocks.lanes.lanes
            assert lane.hashes == tuple(hashes) and lane.places == 16
            assert len(x.blocks.lanes.figure.data[0].x) == 16
            # the tokenizer's text, as block_views words it, in the hover of the block
            first = sentence(x.blocks.lanes.figure.data[0].hovertext[0])
            words = bv.tokens_text(tokens[:4], load_vocabulary(tmp_path / "tokenizer.json"))
            assert words.startswith("w0w7w14") and f"tokens '{words}'" in first
            publisher.send([publisher_module.removed([hashes[4]])])
            ticks_until(x, lambda: hash_text(hashes[4]) in x.blocks.evictions.text.value, "the eviction")
            ticks_until(x, lambda: "1 publisher" in x.status.value, "the stats")
            assert "attached" in x.status.value
        finally:
            x.close()
        assert x.source.attached.finished
