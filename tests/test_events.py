"""Event bus semantics (engine/events.py) and what the engine publishes on it (engine/kv/cache.py,
engine/context.py): numbering, one event per operation, dry-run marking, removal reasons, K-shift
and stream-copy events, bounded queues that never block decoding, callback threads, late joiners
and concurrent publishers."""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch

import engine
from engine import events as ev
from tests.model_factory import in_memory_model

MODEL = in_memory_model()


def make(kv_size=8, *, unified=True, n_seq_max=2, n_ubatch=8, maxsize=65536):
    """A context on its own bus, one drained subscription and an attached mirror."""
    bus = engine.EventBus()
    sub = bus.subscribe(maxsize=maxsize)
    mirror = engine.CacheMirror()
    mirror.attach(bus)
    ctx = engine.Context(MODEL, n_ctx=kv_size if unified else kv_size * n_seq_max, pad=8, n_ubatch=n_ubatch,
                         n_seq_max=n_seq_max, kv_unified=unified, bus=bus)
    return ctx, sub, mirror


def prefill(ctx, seq_id, n, start=0):
    return ctx.decode(engine.Batch.for_sequence([1 + i for i in range(n)], seq_id, start))


def kinds(events):
    return [e.kind for e in events]


def cell_changes(events):
    return [e for e in events if isinstance(e, ev.CellsChanged)]


def assert_mirror_matches(ctx, mirror):
    mirror.sync()
    for s in range(ctx.memory.n_stream):
        assert mirror.cells(s) == ctx.memory.cells(s)
        assert mirror.head(s) == ctx.memory.head(s)


# ---- numbering and one event per operation ------------------------------------------------------


def test_seq_no_strictly_increasing_without_gaps():
    ctx, sub, _ = make(n_ubatch=2)
    prefill(ctx, 0, 5)
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_add(1, 2, -1, 3)
    prefill(ctx, 1, 2, start=8)
    ctx.memory.seq_rm(0, 3, -1)
    ctx.memory.seq_keep(1)
    assert prefill(ctx, 0, 8) == 1
    ctx.memory.clear()
    events = sub.drain()
    assert len(events) > 20
    assert [e.seq_no for e in events] == list(range(len(events)))
    times = [e.time for e in events]
    assert times == sorted(times)


def test_prefill_in_one_ubatch_is_one_allocation():
    ctx, sub, _ = make()
    sub.drain()
    assert prefill(ctx, 0, 5) == 0
    events = sub.drain()
    assert kinds(events) == ["DecodeStarted", "CellsAllocated", "SlotsRolledBack", "CellsAllocated",
                             "DecodeFinished"]
    dry, rollback, real = events[1:4]
    assert dry.tentative and rollback.tentative and not real.tentative
    for e in (dry, real):
        (ch,) = e.changes
        assert list(ch.cells) == [0, 1, 2, 3, 4] and list(ch.pos) == [0, 1, 2, 3, 4] and ch.head == 5
        assert ch.seq_sets() == [frozenset({0})] * 5
        assert e.n_tokens == 5 and e.ubatch == 0
    (ch,) = rollback.changes
    assert list(ch.cells) == [0, 1, 2, 3, 4] and list(ch.pos) == [-1] * 5 and ch.head == 0
    assert events[-1].rc == 0 and events[-1].ubatch_sizes == (5,)


def test_prefill_in_three_ubatches():
    ctx, sub, _ = make(n_ubatch=2)
    sub.drain()
    assert prefill(ctx, 0, 5) == 0
    events = sub.drain()
    allocs = [e for e in events if isinstance(e, ev.CellsAllocated)]
    assert [(a.tentative, a.ubatch, a.n_tokens) for a in allocs] == [
        (True, 0, 2), (True, 1, 2), (True, 2, 1), (False, 0, 2), (False, 1, 2), (False, 2, 1)]
    assert sum(isinstance(e, ev.SlotsRolledBack) for e in events) == 1
    assert events[-1].ubatch_sizes == (2, 2, 1)


def test_failed_decode_is_tentative_only():
    """rc 1 (tests/test_scenarios.py's S2): the dry run's events are all tentative and rolled back; the
    mirror is unchanged."""
    ctx, sub, mirror = make(n_ubatch=2)
    prefill(ctx, 0, 6)
    assert_mirror_matches(ctx, mirror)
    sub.drain()
    assert ctx.decode(engine.Batch.for_sequence([1, 2, 3, 4], 1, 0)) == 1
    events = sub.drain()
    assert kinds(events) == ["DecodeStarted", "CellsAllocated", "SlotSearchFailed", "SlotsRolledBack",
                             "DecodeFinished"]
    assert all(e.tentative for e in cell_changes(events))
    assert events[-1].rc == 1 and "failed to find a memory slot" in events[-1].message
    assert_mirror_matches(ctx, mirror)
    assert mirror.head(0) == 6


def test_invalid_batch_publishes_only_the_result():
    ctx, sub, _ = make()
    prefill(ctx, 0, 3)
    sub.drain()
    assert ctx.decode(engine.Batch([1], [7], [[0]])) == -1
    events = sub.drain()
    assert kinds(events) == ["DecodeFinished"] and events[0].rc == -1


@pytest.mark.parametrize("op, args, reason", [
    ("seq_rm", (0, 1, 3), "seq_rm"),
    ("seq_rm", (-1, 1, -1), "seq_rm"),
    ("seq_keep", (1,), "seq_keep"),
    ("clear", (), "clear"),
])
def test_removal_reasons(op, args, reason):
    ctx, sub, mirror = make()
    ctx.decode(engine.Batch([1, 2, 3, 4], [0, 1, 0, 1], [[0], [0], [1], [1]]))
    sub.drain()
    getattr(ctx.memory, op)(*args)
    (e,) = sub.drain()
    assert isinstance(e, ev.CellsRemoved) and e.reason == reason and not e.tentative
    if op != "clear":
        assert e.seq_id == args[0]
    assert_mirror_matches(ctx, mirror)


def test_removal_fields():
    ctx, sub, _ = make()
    ctx.decode(engine.Batch([1, 2, 3, 4], [0, 1, 2, 3], [[0, 1]] * 2 + [[0]] * 2))
    sub.drain()
    ctx.memory.seq_rm(0, 1, -1)
    (e,) = sub.drain()
    assert (e.seq_id, e.p0, e.p1, e.n_freed) == (0, 1, -1, 2)
    (ch,) = e.changes
    assert list(ch.cells) == [1, 2, 3] and list(ch.pos) == [1, -1, -1] and ch.head == 2
    assert ch.seq_sets() == [frozenset({1}), frozenset(), frozenset()]


def test_failure_cleanup_reason_on_abort():
    """tests/test_scenarios.py's S15: abort in the second ubatch; its cells are applied then removed
    (reason failure_cleanup, as llama_context::decode removes them)."""
    ctx, sub, mirror = make(n_ubatch=2)
    sub.drain()
    calls = iter(range(100))
    ctx.abort_callback = lambda: next(calls) == MODEL.config.n_layer  # first layer of the 2nd ubatch
    assert prefill(ctx, 0, 4) == 2
    events = sub.drain()
    real = [e for e in cell_changes(events) if not e.tentative]
    assert kinds(real) == ["CellsAllocated", "CellsAllocated", "CellsRemoved"]
    rm = real[-1]
    assert rm.reason == "failure_cleanup" and (rm.seq_id, rm.p0, rm.p1) == (0, 2, -1)
    assert rm.changes[0].head == 2
    assert events[-1].kind == "DecodeFinished" and events[-1].rc == 2
    assert_mirror_matches(ctx, mirror)


# ---- K-shift and stream copies --------------------------------------------------------------------


def test_kshift_applied_after_seq_add_at_next_decode():
    ctx, sub, mirror = make()
    prefill(ctx, 0, 6)
    sub.drain()
    ctx.memory.seq_add(0, 4, -1, -2)  # cells 4,5: pos 2,3, shift -2
    (shifted,) = sub.drain()
    assert isinstance(shifted, ev.CellsShifted) and shifted.op == "add" and shifted.amount == -2
    (ch,) = shifted.changes
    assert list(ch.cells) == [4, 5] and list(ch.pos) == [2, 3] and list(ch.shift) == [-2, -2] and ch.head == 0
    assert list(shifted.old_pos[0]) == [4, 5]
    assert_mirror_matches(ctx, mirror)
    prefill(ctx, 0, 1, start=4)
    events = sub.drain()
    assert kinds(events)[:2] == ["DecodeStarted", "KShiftApplied"]
    k = events[1]
    (ch,) = k.changes
    assert list(ch.cells) == [4, 5] and list(ch.shift) == [0, 0] and list(k.amounts[0]) == [-2, -2]
    assert k.n_layers == MODEL.config.n_layer
    assert_mirror_matches(ctx, mirror)
    prefill(ctx, 0, 1, start=5)
    after = kinds(sub.drain())
    assert after[0] == "DecodeStarted" and "KShiftApplied" not in after, "the shift must be applied only once"


def test_seq_div_publishes_cells_shifted_with_quirk_sign():
    ctx, sub, mirror = make()
    prefill(ctx, 0, 8)
    sub.drain()
    ctx.memory.seq_div(0, 4, 8, 2)
    (e,) = sub.drain()
    assert e.op == "div" and e.amount == 2
    assert list(e.changes[0].pos) == [2, 2, 3, 3] and list(e.changes[0].shift) == [2, 3, 3, 4]
    assert_mirror_matches(ctx, mirror)


def test_no_kshift_when_seq_add_moved_nothing():
    """Regression (engine/kv/cells.py pos_add/pos_div set has_shift for an empty index array): a seq_add
    or seq_div that matches no cell must not make the next decode run a K-shift: in llama_kv_cells
    (src/llama-kv-cells.h) only pos_add / pos_div of a cell set has_shift, and llama_kv_cache::update
    shifts nothing without it."""
    ctx, sub, _ = make()
    prefill(ctx, 0, 3)
    ctx.memory.seq_add(0, 100, -1, 1)
    ctx.memory.seq_div(0, 100, -1, 2)
    sub.drain()
    assert prefill(ctx, 0, 1, start=3) == 0
    after = kinds(sub.drain())
    assert after[0] == "DecodeStarted" and "KShiftApplied" not in after


def test_same_stream_seq_cp_is_not_queued():
    ctx, sub, mirror = make()
    prefill(ctx, 0, 3)
    sub.drain()
    ctx.memory.seq_cp(0, 1, 1, -1)
    (e,) = sub.drain()
    assert isinstance(e, ev.CellsCopied) and not e.queued and (e.src_seq, e.dst_seq) == (0, 1)
    assert list(e.changes[0].cells) == [1, 2]
    assert e.changes[0].seq_sets() == [frozenset({0, 1})] * 2
    prefill(ctx, 0, 1, start=3)
    after = kinds(sub.drain())
    assert after[0] == "DecodeStarted" and "StreamCopyExecuted" not in after
    assert_mirror_matches(ctx, mirror)


def test_cross_stream_seq_cp_is_queued_and_executed_at_next_decode():
    ctx, sub, mirror = make(unified=False)
    prefill(ctx, 0, 3)
    prefill(ctx, 1, 2)
    sub.drain()
    ctx.memory.seq_cp(0, 1, -1, -1)
    (e,) = sub.drain()
    assert isinstance(e, ev.CellsCopied) and e.queued
    assert (e.src_stream, e.dst_stream, e.src_seq, e.dst_seq) == (0, 1, 0, 1)
    (ch,) = e.changes
    assert ch.stream == 1 and list(ch.cells) == list(range(8)) and ch.head == 3
    assert list(ch.pos) == [0, 1, 2] + [-1] * 5
    assert_mirror_matches(ctx, mirror)
    prefill(ctx, 1, 1, start=3)
    events = sub.drain()
    assert kinds(events)[:2] == ["DecodeStarted", "StreamCopyExecuted"]
    x = events[1]
    assert (x.src_stream, x.dst_stream, x.n_layers) == (0, 1, MODEL.config.n_layer)
    first = torch.arange(3)
    for r in ctx.memory.k:  # the copied rows arrived in stream 1
        assert np.array_equal(r.stored_rows(1, first).float().numpy(), r.stored_rows(0, first).float().numpy())
    prefill(ctx, 1, 1, start=4)
    after = kinds(sub.drain())
    assert after[0] == "DecodeStarted" and "StreamCopyExecuted" not in after, "a queued copy runs once"
    assert_mirror_matches(ctx, mirror)


# ---- bounded queues, callbacks, late joiners, threads -----------------------------------------------


def test_bounded_queue_never_blocks_and_reports_drops():
    ctx, full_sub, _ = make()
    full_sub.drain()
    small = ctx.bus.subscribe(maxsize=3, with_state=False)
    for i in range(6):
        assert prefill(ctx, 0, 1, start=i) == 0  # never drained meanwhile; must not block
    published = full_sub.drain()
    assert small.pending() == 3
    assert small.dropped == len(published) - 3
    first3 = small.drain()
    assert [e.seq_no for e in first3] == [e.seq_no for e in published[:3]]
    ctx.memory.seq_rm(0, 5, -1)
    notice, event = small.drain()
    assert isinstance(notice, ev.EventsDropped)
    assert notice.count == small.dropped == len(published) - 3
    assert (notice.first_seq_no, notice.last_seq_no) == (published[3].seq_no, published[-1].seq_no)
    assert isinstance(event, ev.CellsRemoved)
    ctx.memory.seq_rm(0, 4, -1)
    (again,) = small.drain()
    assert isinstance(again, ev.CellsRemoved), "the notice is sent once"


def test_mirror_on_a_bounded_queue_goes_stale_and_resyncs():
    ctx, _, _ = make()
    late = engine.CacheMirror()
    sub = late.attach(ctx.bus, maxsize=8)  # 5 events of state first: placement, device memory, context, vocabulary,
    # snapshot
    for i in range(4):  # 5 events each
        prefill(ctx, 0, 1, start=i)
    assert late.sync() == 8 and sub.dropped == 17 and not late.stale
    ctx.memory.seq_rm(0, 3, -1)  # room again: the EventsDropped notice, then this event
    assert late.sync() == 2
    assert late.stale and late.stats.dropped == 17
    ctx.publish_state()
    late.sync()
    assert not late.stale
    assert_mirror_matches(ctx, late)


def test_drained_queue_of_size_one_receives_events_again():
    """BUG engine/events.py Subscription._offer: with maxsize=1, once an event was dropped the check
    `len(queue) + 1 >= maxsize` is true even for an empty queue, so neither the EventsDropped notice
    nor any later event is ever delivered again: the watcher is silently cut off for good (the module
    docstring promises drops are 'counted, and announced to it by an EventsDropped record')."""
    bus = engine.EventBus()
    sub = bus.subscribe(maxsize=1)
    bus.publish(ev.TokenSampled(0, 1, "a", 0))
    bus.publish(ev.TokenSampled(0, 2, "b", 1))  # dropped
    assert sub.dropped == 1
    assert len(sub.drain()) == 1
    for i in range(3):
        bus.publish(ev.TokenSampled(0, 3 + i, "c", 2 + i))
        got = sub.drain()
        assert got, f"nothing delivered to a drained queue (publish {i}, dropped={sub.dropped})"


def test_subscribe_callback_thread_receives_events():
    ctx, _, _ = make()
    got, done = [], threading.Event()

    def on_event(e):
        got.append(e)
        if isinstance(e, ev.DecodeFinished):
            done.set()

    sub = ctx.bus.subscribe_callback(on_event)
    caller = threading.current_thread()
    seen_threads = []
    ctx.bus.subscribe_callback(lambda e: seen_threads.append(threading.current_thread()))
    prefill(ctx, 0, 3)
    assert done.wait(5)
    assert kinds(got) == ["ModelPlaced", "DeviceMemoryState", "ContextCreated", "Vocabulary", "MemorySnapshot",  # the state first
                          "DecodeStarted", "CellsAllocated", "SlotsRolledBack", "CellsAllocated", "DecodeFinished"]
    deadline = time.monotonic() + 5
    while len(seen_threads) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen_threads and all(t is not caller for t in seen_threads)
    sub.close()
    prefill(ctx, 0, 1, start=3)
    time.sleep(0.3)
    assert len(got) == 10, "a closed subscription gets nothing more"


def test_slow_callback_does_not_slow_decoding():
    def run(with_slow: bool) -> float:
        ctx, _, _ = make(kv_size=64)
        if with_slow:
            ctx.bus.subscribe_callback(lambda e: time.sleep(0.05))
        t0 = time.perf_counter()
        for i in range(20):
            assert prefill(ctx, 0, 1, start=i) == 0
        return time.perf_counter() - t0

    run(False)  # warm-up
    base = min(run(False) for _ in range(2))
    slow = run(True)
    # 20 decodes publish ~100 events; a blocking bus would need ~5 s here
    assert slow < base * 3 + 0.5, (base, slow)


def test_late_joiner_gets_the_state_when_it_subscribes():
    ctx, _, _ = make(unified=False, n_seq_max=3, n_ubatch=2)
    prefill(ctx, 0, 5)
    prefill(ctx, 2, 3)
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_add(1, 2, -1, 4)
    ctx.memory.seq_rm(0, 1, 3)
    late = engine.CacheMirror()
    late.attach(ctx.bus)  # no publish_state(): subscribing hands over the current state
    late.sync()
    assert not late.stale and late.n_stream() == 3
    assert late.created["kv"].kv_size == ctx.memory.size
    assert_mirror_matches(ctx, late)
    prefill(ctx, 1, 1, start=ctx.memory.seq_pos_max(1) + 1)  # and stays in step afterwards
    assert_mirror_matches(ctx, late)


def test_concurrent_publishers_keep_order_for_every_subscriber():
    bus = engine.EventBus()
    queued = [bus.subscribe(maxsize=100000) for _ in range(2)]
    via_callback: list[int] = []
    bus.subscribe_callback(lambda e: via_callback.append(e.seq_no), maxsize=100000)
    n_threads, per_thread = 4, 1000
    start = threading.Barrier(n_threads)

    def worker(t):
        start.wait()
        for i in range(per_thread):
            bus.publish(ev.TokenSampled(t, i, "x", i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = n_threads * per_thread
    deadline = time.monotonic() + 10
    while len(via_callback) < total and time.monotonic() < deadline:
        time.sleep(0.01)
    for sub in queued:
        events = sub.drain()
        assert [e.seq_no for e in events] == list(range(total))
        for t in range(n_threads):  # each publisher's own events stay in its order
            assert [e.token for e in events if e.seq_id == t] == list(range(per_thread))
    assert via_callback == list(range(total))


def test_subscriber_joining_mid_operation_never_sees_none_changes():
    """BUG engine/kv/cache.py KVCache._stream_cells/_publish: each operation builds its StreamCells only
    `if self.bus.active` and publishes later after checking `bus.active` again. A watcher that subscribes
    from another thread in between (e.g. a UI attaching a late mirror while decoding runs) receives a
    CellsChanged event whose `changes` holds None instead of the touched cells. The interleaving is
    forced here by subscribing right after the first StreamCells was built."""
    bus = engine.EventBus()
    ctx = engine.Context(MODEL, n_ctx=8, pad=8, n_ubatch=8, n_seq_max=2, kv_unified=True, bus=bus)
    prefill(ctx, 0, 4)
    build, joined, late = ctx.memory._stream_cells, [], engine.CacheMirror()

    def build_then_someone_subscribes(stream, idxs):
        out = build(stream, idxs)
        if not joined:
            joined.append(bus.subscribe())
            late.attach(bus)
        return out

    ctx.memory._stream_cells = build_then_someone_subscribes
    ctx.memory.seq_rm(0, 1, -1)
    changed = [e for e in joined[0].drain() if isinstance(e, ev.CellsChanged)]
    assert changed and all(ch is not None for e in changed for ch in e.changes), changed
    # and what the watcher was given (the state when it subscribed, then any later event) is the engine's
    late.sync()
    assert (late.cells(0), late.head(0)) == (ctx.memory.cells(0), ctx.memory.head(0))
    assert [p for p, _, _ in late.cells(0)][:4] == [0, -1, -1, -1]


def test_an_event_published_during_a_delivery_waits_for_it():
    """Garbage collection can run a finalizer (which publishes a memory release) in the middle of a
    delivery; every subscriber must still see the events in seq_no order."""
    bus = engine.EventBus()
    first, second = bus.subscribe(), bus.subscribe()
    offer = first._offer
    nested = ev.DeviceMemoryChanged(device="VGPU0", virtual=True, capacity=1, reserved=0, what="kv", delta=-1)

    def offer_then_publish(event):  # as if collection ran a finalizer right here
        offer(event)
        if event is not nested:
            bus.publish(nested)

    first._offer = offer_then_publish
    outer = ev.DecodeStarted(1, 1, (0,))
    bus.publish(outer)
    for sub in (first, second):
        assert [e.seq_no for e in sub.drain()] == [0, 1]
    assert (outer.seq_no, nested.seq_no) == (0, 1)


def test_a_subscription_can_start_without_the_state():
    ctx, _, _ = make()
    prefill(ctx, 0, 2)
    assert kinds(ctx.bus.subscribe().drain()) == ["ModelPlaced", "DeviceMemoryState", "ContextCreated",
                                                  "Vocabulary", "MemorySnapshot"]
    assert ctx.bus.subscribe(with_state=False).drain() == []


def test_a_collected_context_gives_no_state():
    bus = engine.EventBus()
    ctx = engine.Context(MODEL, n_ctx=8, pad=8, bus=bus)
    assert len(bus.subscribe().drain()) == 5
    del ctx
    gc.collect()
    assert kinds(bus.subscribe().drain()) == []
