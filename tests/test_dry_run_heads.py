"""QUIRK "heads after the dry run": llama.cpp's llama_kv_cache::prepare restores each touched stream's head
with `v_heads[strm[s]] = v_heads_old[s]`, where s is the stream's index in the ubatch's slot, not its id.

Seen in llama.cpp 0c1e570: with split streams, seq 0 at head 4 in stream 0 and seq 1 at head 88 in stream 1,
a batch of seq 1 whose later ubatch finds no slot (rc 1) leaves stream 1's head at 4, stream 0's old head.
These tests replay that on caches small enough to read, on a plain cache and on the iSWA pair (whose base
cache fails first), and check that the rollback event says it is a QUIRK.
"""
from __future__ import annotations

import pytest

import engine
from engine import events as ev
from tests.model_factory import in_memory_model


@pytest.fixture(scope="module")
def llama():
    return in_memory_model()


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_hf):
    return engine.load_model(tiny_gemma3_hf)


def seq_batch(seq_id: int, p0: int, p1: int) -> engine.Batch:
    """seq_id's tokens at positions p0..p1 inclusive."""
    n = p1 - p0 + 1
    return engine.Batch(tokens=[5 + (p + seq_id) % 40 for p in range(p0, p1 + 1)], pos=list(range(p0, p1 + 1)),
                        seq_ids=[[seq_id]] * n)


def rollbacks(sub: engine.events.Subscription, cache: str) -> list[ev.SlotsRolledBack]:
    return [e for e in sub.drain() if isinstance(e, ev.SlotsRolledBack) and e.cache == cache]


def split_context(model, **params) -> tuple[engine.Context, engine.events.Subscription]:
    bus = engine.EventBus()
    sub = bus.subscribe()
    ctx = engine.Context(model, n_ctx=8, pad=4, n_seq_max=2, kv_unified=False, n_ubatch=1, bus=bus,
                         type_k="f32", type_v="f32", **params)
    return ctx, sub


def test_failed_dry_run_gives_stream_1_the_old_head_of_stream_0(llama):
    ctx, sub = split_context(llama)
    mem = ctx.memory
    assert ctx.decode(seq_batch(0, 0, 1)) == 0 and ctx.decode(seq_batch(1, 0, 2)) == 0
    assert (mem.head(0), mem.head(1)) == (2, 3)
    sub.drain()
    # Two ubatches of seq 1: pos 3 takes stream 1's last cell, pos 4 finds no slot.
    assert ctx.decode(seq_batch(1, 3, 4)) == 1
    assert (mem.head(0), mem.head(1)) == (2, 2)  # stream 1 got stream 0's old head, not its own 3
    assert mem.cells(1) == [(p, frozenset({1}), 0) for p in range(3)] + [(-1, frozenset(), 0)]
    (rollback,) = rollbacks(sub, "kv")
    assert "llama.cpp QUIRK" in rollback.quirk and "stream 1: 3 -> 2" in rollback.quirk
    assert [(c.stream, c.head) for c in rollback.changes] == [(1, 2)]


def test_the_wrong_head_decides_where_the_next_token_goes(llama):
    """The head is only a search hint, but it is observable: the next slot search starts from it."""
    ctx, _ = split_context(llama)
    mem = ctx.memory
    assert ctx.decode(seq_batch(0, 0, 0)) == 0 and ctx.decode(seq_batch(1, 0, 2)) == 0
    mem.seq_rm(1, 1, 2)  # frees stream 1's cell 1; its head moves back to 1
    assert mem.head(1) == 1
    assert ctx.decode(engine.Batch(tokens=[7, 8, 9], pos=[1, 2, 3], seq_ids=[[0]] * 3)) == 0  # stream 0 head 4
    mem.seq_rm(1, 2, -1)  # seq 1 keeps only pos 0, cells 1..3 of stream 1 are free; head 1
    assert mem.head(1) == 1
    assert ctx.decode(seq_batch(1, 1, 4)) == 1  # three ubatches fit in cells 1..3, the fourth does not
    assert mem.head(1) == 4  # = stream 0's old head, restored into stream 1 by index
    assert ctx.decode(seq_batch(1, 1, 1)) == 0
    # From head 4 == size the scan wraps to cell 0 (taken) and then takes cell 1.
    assert mem.cells(1)[1] == (1, frozenset({1}), 0)


def test_nothing_is_restored_when_the_first_ubatch_finds_no_slot(llama):
    ctx, sub = split_context(llama)
    mem = ctx.memory
    assert ctx.decode(seq_batch(0, 0, 1)) == 0 and ctx.decode(seq_batch(1, 0, 3)) == 0
    sub.drain()
    assert ctx.decode(seq_batch(1, 4, 4)) == 1
    assert (mem.head(0), mem.head(1)) == (2, 4)
    assert rollbacks(sub, "kv") == []


def test_successful_dry_run_moves_the_head_tentatively_without_a_quirk_mark(llama):
    """After a successful dry run the real apply sets every restored head again, so the wrong head never
    outlives the decode: the rollback shows where it was put, but is not marked as a QUIRK (marking it
    flagged nearly every decode of a split-stream run)."""
    ctx, sub = split_context(llama)
    mem = ctx.memory
    assert ctx.decode(seq_batch(0, 0, 1)) == 0 and ctx.decode(seq_batch(1, 0, 0)) == 0
    sub.drain()
    assert ctx.decode(seq_batch(1, 1, 2)) == 0
    events = sub.drain()
    (rollback,) = [e for e in events if isinstance(e, ev.SlotsRolledBack)]
    assert rollback.tentative and rollback.quirk == ""
    assert [(c.stream, c.head) for c in rollback.changes] == [(1, 2)]  # stream 0's old head, for a moment
    real = [e for e in events if isinstance(e, ev.CellsAllocated) and not e.tentative]
    assert [c.head for e in real for c in e.changes] == [2, 3]
    assert (mem.head(0), mem.head(1)) == (2, 3)  # the real apply set the head again


def test_a_split_stream_run_marks_the_quirk_only_at_failed_decodes(llama):
    """Many decodes of a split-stream run, some of which fail: the marks are exactly the failures whose
    restored heads differ from the heads before."""
    ctx, sub = split_context(llama)
    assert ctx.decode(seq_batch(0, 0, 1)) == 0 and ctx.decode(seq_batch(1, 0, 0)) == 0
    for p in (1, 2):
        assert ctx.decode(seq_batch(1, p, p)) == 0
    assert ctx.decode(seq_batch(1, 3, 4)) == 1  # the third ubatch of this stream finds no cell
    marked = [e for e in sub.drain() if isinstance(e, ev.SlotsRolledBack) and e.quirk]
    assert len(marked) == 1 and "stream 1: 3 -> 2" in marked[0].quirk


def test_unified_and_in_order_streams_are_not_marked(llama):
    ctx, sub = split_context(llama)
    assert ctx.decode(engine.Batch(tokens=[5, 6], pos=[0, 0], seq_ids=[[0], [1]])) == 0
    (rollback,) = rollbacks(sub, "kv")
    assert rollback.quirk == ""  # streams [0, 1] at indices [0, 1]: every head restored to its own value
    bus = engine.EventBus()
    sub = bus.subscribe()
    ctx = engine.Context(llama, n_ctx=8, pad=8, n_seq_max=2, kv_unified=True, n_ubatch=1, bus=bus)
    assert ctx.decode(seq_batch(1, 0, 2)) == 0
    (rollback,) = rollbacks(sub, "kv")  # one dry run of three ubatches, rolled back once
    assert rollback.quirk == "" and [c.stream for c in rollback.changes] == [0]


def test_iswa_base_cache_fails_first_and_keeps_the_quirk(gemma3):
    ctx, sub = split_context(gemma3)
    mem = ctx.memory
    assert mem.base.size == 4 and mem.swa.size >= 4
    assert ctx.decode(seq_batch(0, 0, 1)) == 0 and ctx.decode(seq_batch(1, 0, 2)) == 0
    assert (mem.base.head(0), mem.base.head(1)) == (2, 3)
    swa_heads = (mem.swa.head(0), mem.swa.head(1))
    sub.drain()
    assert ctx.decode(seq_batch(1, 3, 4)) == 1
    assert (mem.base.head(0), mem.base.head(1)) == (2, 2)
    (rollback,) = rollbacks(sub, "base")
    assert "stream 1: 3 -> 2" in rollback.quirk
    # The base cache failed, so the SWA cache was never asked.
    assert (mem.swa.head(0), mem.swa.head(1)) == swa_heads
    assert rollbacks(sub, "swa") == []


def test_iswa_successful_dry_run_marks_neither_cache(gemma3):
    ctx, sub = split_context(gemma3)
    assert ctx.decode(seq_batch(0, 0, 1)) == 0 and ctx.decode(seq_batch(1, 0, 0)) == 0
    sub.drain()
    assert ctx.decode(seq_batch(1, 1, 2)) == 0
    events = sub.drain()
    for cache in ("base", "swa"):
        (rollback,) = [e for e in events if isinstance(e, ev.SlotsRolledBack) and e.cache == cache]
        assert rollback.quirk == "" and [(c.stream, c.head) for c in rollback.changes] == [(1, 2)]
    assert (ctx.memory.base.head(1), ctx.memory.swa.head(1)) == (3, 3)
