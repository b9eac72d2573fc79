"""A frame is the engine's cache as a view draws it: positions, owner (one sequence, several, none),
pending shifts, heads, and the cells touched since the previous frame."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.batch import Batch
from engine.watch.frames import EMPTY, SHARED
from engine.watch.watcher import Watcher
from tests.model_factory import in_memory_model


class _Source:
    """A bus and a context, seen as a Watcher's source."""

    def __init__(self, ctx: engine.Context) -> None:
        self.ctx = ctx

    def subscribe(self, maxsize: int):
        return self.ctx.bus.subscribe(maxsize)

    def current_state(self):
        return self.ctx.bus.current_state()


def expected_columns(cache, stream: int):
    cells = cache.cells(stream)
    pos = np.array([p for p, _, _ in cells])
    owner = np.array([EMPTY if not s else (min(s) if len(s) == 1 else SHARED) for _, s, _ in cells])
    return pos, owner, np.array([len(s) for _, s, _ in cells]), np.array([sh for _, _, sh in cells])


def assert_frame_is_the_engine(watcher: Watcher, ctx: engine.Context):
    watcher.poll()
    frame = watcher.frame()
    for cache in ctx.memory.caches():
        for s in range(cache.n_stream):
            f = frame.stream(cache.name, s)
            pos, owner, n_seqs, shift = expected_columns(cache, s)
            assert np.array_equal(f.pos, pos) and np.array_equal(f.owner, owner)
            assert np.array_equal(f.n_seqs, n_seqs) and np.array_equal(f.shift, shift)
            assert f.head == cache.head(s) and f.used == cache.used(s)
    return frame


@pytest.mark.parametrize("unified", [True, False])
def test_frames_follow_decodes_copies_and_shifts(unified):
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, n_seq_max=3, kv_unified=unified)
    watcher = Watcher.of(_Source(ctx))
    watcher.poll()
    assert not watcher.frame().stream("kv", 0).changed.any()  # the state a watcher starts from is no change
    assert ctx.decode(Batch([5, 6, 7, 8, 9, 10], [0, 1, 2, 0, 1, 2], [[0], [0], [0], [2], [2], [2]])) == 0
    frame = assert_frame_is_the_engine(watcher, ctx)
    assert frame.stream("kv", 0).changed.sum() == (6 if unified else 3)
    assert np.array_equal(frame.stream("kv", 0).tentative, frame.stream("kv", 0).changed)  # the dry run placed them first
    assert not assert_frame_is_the_engine(watcher, ctx).stream("kv", 0).changed.any()  # reset by the last frame
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_add(2, 1, -1, 5)
    frame = assert_frame_is_the_engine(watcher, ctx)
    if unified:
        shared = frame.stream("kv", 0).owner == SHARED
        assert shared.sum() == 3 and frame.stream("kv", 0).changed[shared].all()
    ctx.memory.seq_rm(0, -1, -1)
    assert_frame_is_the_engine(watcher, ctx)


def test_a_frame_copies_the_columns():
    ctx = engine.Context(in_memory_model(), n_ctx=16, pad=8)
    watcher = Watcher.of(_Source(ctx))
    assert ctx.decode(Batch([5, 6], [0, 1], [[0], [0]])) == 0
    watcher.poll()
    first = watcher.frame()
    ctx.memory.seq_rm(0, -1, -1)
    watcher.poll()
    assert first.stream("kv").used == 2 and watcher.frame().stream("kv").used == 0


def test_a_frame_after_several_decodes_marks_the_slot_search_of_the_last_one():
    """A slow view (or a replay's jump) takes one frame over many decodes: its tentative cells are the dry run
    of the latest decode, not of all of them, which would mark nearly every cell."""
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, n_seq_max=1)
    watcher = Watcher.of(_Source(ctx))
    watcher.poll()
    watcher.frame()
    for pos in range(5):
        assert ctx.decode(Batch([5 + pos], [pos], [[0]])) == 0
    tentative = assert_frame_is_the_engine(watcher, ctx).stream("kv", 0).tentative
    assert np.flatnonzero(tentative).tolist() == [4]  # the last token's cell, tried first by its dry run


def test_a_poll_with_a_time_budget_keeps_the_rest_in_order_for_the_next():
    ctx = engine.Context(in_memory_model(), n_ctx=64, pad=8, n_seq_max=2, kv_unified=True)
    watcher = Watcher.of(_Source(ctx))
    watcher.poll()
    watcher.POLL_CHUNK = 8
    for pos in range(12):
        assert ctx.decode(Batch([5, 6], [pos, pos], [[0], [1]])) == 0
    applied = watcher.poll(budget_s=0.0)  # out of time after the first chunk
    assert applied == 8 and watcher.backlog > 0
    assert watcher.frame().stream("kv", 0).used < ctx.memory.used(0)  # behind, and it says so
    ctx.memory.seq_rm(1, 6, -1)  # arrives while the backlog waits: must come after it
    polls = 1
    while watcher.backlog or polls == 1:
        watcher.poll(budget_s=0.0)
        polls += 1
    assert polls > 3
    assert_frame_is_the_engine(watcher, ctx)
    assert watcher.history.lines("kv", 0, 23)[0] == "freed by seq_rm after decode 11"  # cell 23: seq 1, pos 11


def test_views_sharing_a_watcher_each_see_every_change_and_quirk():
    """One view's frame must not consume the marks another view of the same watcher has not drawn yet."""
    bus = engine.EventBus()
    watcher = Watcher(bus.subscribe())
    grid, inset = watcher.frame_reader(), watcher.frame_reader()
    ctx = engine.Context(in_memory_model(), n_ctx=8, pad=4, n_seq_max=2, kv_unified=False, n_ubatch=1,
                         type_k="f32", type_v="f32", bus=bus)
    assert ctx.decode(Batch([5, 6], [0, 1], [[0], [0]])) == 0
    assert ctx.decode(Batch([5, 6, 7], [0, 1, 2], [[1]] * 3)) == 0
    watcher.poll()
    grid.frame(), inset.frame()
    assert ctx.decode(Batch([8, 9], [3, 4], [[1]] * 2)) == 1  # rolled back with the QUIRK
    ctx.memory.seq_rm(0, 1, -1)
    watcher.poll()
    first = grid.frame()
    assert first.stream("kv", 1).quirk.tolist() == [False, False, False, True]
    assert first.stream("kv", 0).changed.tolist() == [False, True, False, False]
    second = inset.frame()  # taken after the grid's: the same marks
    for a, b in zip(first.streams, second.streams):
        assert np.array_equal(a.changed, b.changed) and np.array_equal(a.quirk, b.quirk)
        assert np.array_equal(a.tentative, b.tentative)
    again = grid.frame()  # nothing since the grid's own previous frame
    assert not any(s.changed.any() or s.quirk.any() for s in again.streams)


def test_a_new_view_marks_only_the_cells_a_quirk_touched():
    """A reader's first frame (a view opened late, or after a resync) marks the QUIRK's cells, not every cell."""
    bus = engine.EventBus()
    ctx = engine.Context(in_memory_model(), n_ctx=8, pad=4, n_seq_max=2, kv_unified=False, n_ubatch=1,
                         type_k="f32", type_v="f32", bus=bus)
    assert ctx.decode(Batch([5, 6], [0, 1], [[0], [0]])) == 0
    assert ctx.decode(Batch([5, 6, 7], [0, 1, 2], [[1]] * 3)) == 0
    from_state = Watcher.of(_Source(ctx))
    from_state.poll()
    assert not any(s.quirk.any() for s in from_state.frame_reader().frame().streams)  # a state holds no event
    watcher = Watcher(bus.subscribe())
    assert ctx.decode(Batch([8, 9], [3, 4], [[1]] * 2)) == 1
    watcher.poll()
    late = watcher.frame_reader().frame()
    assert late.stream("kv", 1).quirk.tolist() == [False, False, False, True]
    assert not late.stream("kv", 0).quirk.any()
