"""The event log's words and filters (engine/watch/describe.py), shared by both front-ends."""
from __future__ import annotations

import numpy as np

import engine
from engine import events as ev
from engine.batch import Batch
from engine.watch.describe import describe_event, event_group, event_seqs
from tests.model_factory import in_memory_model


def test_each_event_names_its_sequences_and_group():
    ctx = engine.Context(in_memory_model(), n_ctx=16, pad=8, n_seq_max=4, kv_unified=True)
    sub = ctx.bus.subscribe()
    assert ctx.decode(Batch([5, 6, 7], [0, 0, 1], [[1], [3], [1, 2]])) == 0
    ctx.memory.seq_cp(1, 0, -1, -1)
    ctx.memory.seq_rm(3, -1, -1)
    events = sub.drain()
    placed = [e for e in events if isinstance(e, ev.CellsAllocated) and not e.tentative]
    assert [event_seqs(e) for e in placed] == [{1, 2, 3}]  # every sequence the allocation placed
    copied = next(e for e in events if isinstance(e, ev.CellsCopied))
    removed = next(e for e in events if isinstance(e, ev.CellsRemoved) and e.seq_id == 3)
    assert event_seqs(copied) == {0, 1} and event_seqs(removed) == {3}
    assert {event_group(e) for e in (copied, removed, *placed)} == {"cells"}
    started = next(e for e in events if isinstance(e, ev.DecodeStarted))
    assert event_seqs(started) == {1, 2, 3} and event_group(started) == "decodes"
    assert "seq 1 -> 0" in describe_event(copied)


def test_a_k_shift_counts_its_layers_in_words():
    ctx = engine.Context(in_memory_model(), n_ctx=16, pad=8, type_k="f32", type_v="f32")
    sub = ctx.bus.subscribe()
    assert ctx.decode(Batch.for_sequence([5, 6, 7], 0, 0)) == 0
    ctx.memory.seq_add(0, 0, -1, 2)
    ctx.memory.update()
    (shift,) = [e for e in sub.drain() if isinstance(e, ev.KShiftApplied)]
    n = len(ctx.memory.k)
    assert shift.n_layers == n and describe_event(shift).endswith(f"{n} layer{'s' if n != 1 else ''} re-rotated")
    one = ev.KShiftApplied(shift.cache, shift.changes, amounts=shift.amounts, n_layers=1)
    assert describe_event(one).endswith(" 1 layer re-rotated")


def test_a_log_line_names_scattered_cells_as_runs_not_one_span():
    """A ubatch placed in cells 10-15 and 24-25 read "cells 10-25 (8)", hiding the hole between the runs."""
    from engine.watch.describe import cell_runs

    assert cell_runs(np.array([10, 11, 12, 13, 14, 15, 24, 25])) == "10-15 24-25"
    assert cell_runs(np.array([60, 61, 62, 63, 0, 1, 2, 3])) == "60-63 0-3"  # a wrap-around, in placement order
    assert cell_runs(np.array([1, 3, 5, 7, 9])) == "1 3 5 +2 runs"
    assert cell_runs(np.array([1, 3, 5, 7])) == "1 3 5 +1 run"
    cells = np.array([10, 11, 12, 13, 14, 15, 24, 25])
    change = ev.StreamCells(0, cells, cells + 100, np.zeros(8, dtype=np.int64), np.zeros((8, 32), dtype=np.uint8), 26)
    event = ev.CellsAllocated("base", (change,), ubatch=0, n_tokens=8)
    assert "s0 cells 10-15 24-25 (8)" in describe_event(event)
