"""Cell history: for every cell, the last `depth` events that touched it, in order, whatever the batching;
and the one-line story a viewer shows under the cursor."""
from __future__ import annotations

import random
import weakref

import pytest

import engine
from engine import events as ev
from engine.batch import Batch
from engine.watch import history as h
from engine.watch.history import CellHistory
from tests.model_factory import in_memory_model


def reference(events: list[ev.Event], depth: int) -> dict[tuple[str, int, int], list[tuple]]:
    """Per cell, (seq_no, kind, pos) of the history events, written the simple way."""
    out: dict[tuple[str, int, int], list[tuple]] = {}
    for event in events:
        if isinstance(event, ev.ContextCreated):
            out = {k: v for k, v in out.items() if k[0] != event.cache}
        if not isinstance(event, ev.CellsChanged):
            continue
        kind = h._kind_of(event)
        if kind is None:
            continue
        for change in event.changes:
            for cell, pos in zip(change.cells.tolist(), change.pos.tolist()):
                k = kind if kind != h.SEQ_REMOVED or pos >= 0 else h.FREED
                out.setdefault((event.cache, change.stream, cell), []).append((event.seq_no, k, pos))
    return {key: entries[-depth:] for key, entries in out.items()}


def random_events(seed: int, unified: bool) -> list[ev.Event]:
    rng = random.Random(seed)
    ctx = engine.Context(in_memory_model(), n_ctx=24, pad=8, n_seq_max=3, kv_unified=unified)
    sub = ctx.bus.subscribe()
    nxt = [0, 0, 0]
    for _ in range(120):
        op = rng.random()
        s = rng.randrange(3)
        if op < 0.5:
            if ctx.decode(Batch([5 + nxt[s] % 20], [nxt[s]], [[s]])) == 0:
                nxt[s] += 1
        elif op < 0.65:
            ctx.memory.seq_rm(s, rng.randint(0, 4), -1)
        elif op < 0.75 and unified:
            dst = (s + 1) % 3
            ctx.memory.seq_rm(dst, -1, -1)
            ctx.memory.seq_cp(s, dst, -1, -1)
        elif op < 0.9:
            ctx.memory.seq_add(s, rng.randint(0, 3), -1, rng.choice([-2, -1, 1, 2]))
        else:
            ctx.memory.seq_keep(s)
        for q in range(3):
            nxt[q] = ctx.memory.seq_pos_max(q) + 1
    return sub.drain()


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("flush_at", [1, 7, 4096])
def test_every_cell_keeps_its_last_events_in_order(unified, flush_at, monkeypatch):
    monkeypatch.setattr(h._CacheColumns, "FLUSH_AT", flush_at)  # a write per event, per few, or per read
    events = random_events(3, unified)
    depth = 3
    history = CellHistory(depth)
    for event in events:
        history.apply(event)
    expected = reference(events, depth)
    assert sum(len(v) for v in expected.values()) > 15 and max(map(len, expected.values())) == depth
    n_stream = 1 if unified else 3
    for stream in range(n_stream):
        for cell in range(8 if not unified else 24):
            got = [(e.seq_no, e.kind, e.pos) for e in history.entries("kv", stream, cell)]
            assert got == expected.get(("kv", stream, cell), []), (stream, cell)


def test_the_story_of_a_cell_names_token_request_and_cause():
    ctx = engine.Context(in_memory_model(), n_ctx=16, pad=8, n_seq_max=2, kv_unified=True)
    history = CellHistory()
    sub = ctx.bus.subscribe()
    ctx.bus.publish(ev.Vocabulary("tiny", tuple(f"<{i}>" for i in range(64))))
    ctx.bus.publish(ev.SequenceAssigned(0, "request 7", "hello", 3))
    assert ctx.decode(Batch([9, 10, 11], [0, 1, 2], [[0]] * 3)) == 0
    with ctx.bus.cause("a context shift"):
        ctx.memory.seq_rm(0, 0, 1)
        ctx.memory.seq_add(0, 1, -1, -1)
    assert ctx.decode(Batch([12], [2], [[0]])) == 0
    for event in sub.drain():
        history.apply(event)
    assert history.explain("kv", 0, 1) == ("allocated in decode 0 for seq 0 (request 7), token '<10>', pos 1; shifted -1 "
                                           "to pos 0 by a context shift after decode 0; keys re-rotated by -1 (K-shift) "
                                           "in decode 1")
    assert history.explain("kv", 0, 0).endswith("freed by a context shift after decode 0; allocated in decode 1 for seq 0 "
                                                "(request 7), token '<12>', pos 2")
    assert history.explain("kv", 0, 7) == "no event touched this cell since the watch began"


def test_a_long_run_keeps_its_cause_table_and_jobs_bounded_and_the_stories_right(monkeypatch):
    """A server names each request and context shift anew, for ever: the history drops the causes and jobs
    no remembered entry refers to, and what a cell says is unchanged by the dropping."""
    monkeypatch.setattr(CellHistory, "WHY_COMPACT_AT", 16)
    monkeypatch.setattr(CellHistory, "KEPT_REQUESTS", 4)
    ctx = engine.Context(in_memory_model(), n_ctx=16, pad=8, n_seq_max=1)
    history, sub = CellHistory(depth=2), ctx.bus.subscribe()
    for r in range(60):
        ctx.bus.publish(ev.SequenceAssigned(0, f"request {r}", "", 1))
        with ctx.bus.cause(f"the reset for request {r}"):
            ctx.memory.seq_rm(0, -1, -1)
        assert ctx.decode(Batch([9 + r % 5, 10], [0, 1], [[0], [0]])) == 0
        for event in sub.drain():
            history.apply(event)
    assert len(history._why) <= 16 and len(history.requests[0]) <= 8
    assert history.explain("kv", 0, 0) == ("freed by the reset for request 59 after decode 58; allocated in decode 59 "
                                           "for seq 0 (request 59), token #13, pos 0")


def test_a_history_keeps_few_events_alive_however_many_it_was_fed():
    """The columns queue whole events (arrays included) until they write them: at most FLUSH_AT per cache, a
    few hundred, so that a live watcher never holds thousands of events and lets go of them at once (with
    4096 the soak's resident memory climbed; bench/soak.py)."""
    assert h._CacheColumns.FLUSH_AT <= 512, "a live watcher would hold (and drop at once) thousands of events"
    ctx = engine.Context(in_memory_model(), n_ctx=24, pad=8, n_seq_max=1)
    history, sub = CellHistory(depth=2), ctx.bus.subscribe(maxsize=1 << 20)
    alive: weakref.WeakSet = weakref.WeakSet()
    fed = 0
    for r in range(3 * h._CacheColumns.FLUSH_AT):
        pos = r % 16
        if pos == 0:
            ctx.memory.seq_rm(0, -1, -1)
        assert ctx.decode(Batch([9 + r % 5], [pos], [[0]])) == 0
        for event in sub.drain():
            history.apply(event)
            fed += isinstance(event, ev.CellsChanged)
            alive.add(event)
    assert fed > 3 * h._CacheColumns.FLUSH_AT
    assert 0 < len(alive) <= h._CacheColumns.FLUSH_AT
    assert history.entries("kv", 0, 0)[-1].kind == h.ALLOCATED  # what was queued is still there when read
