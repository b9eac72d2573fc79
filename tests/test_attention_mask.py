"""The ubatch's KQ mask rebuilt from the watch layer (engine/watch/attention_mask.py) against the mask the
attention kernel really builds (engine/kv/attention.py UbatchAttention, llama.cpp's
llama_kv_cache::set_input_kq_mask): bit for bit, for every ubatch of every decode, in each scenario a
lesson draws (two sequences in one cache, a hole, a sliding window, several ubatches, a token of two
sequences, split streams).

The kernel's masks are recorded by wrapping UbatchAttention's constructor; at that moment the watcher is
polled, so the watch layer's answer is compared with the mask of the very ubatch being computed."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import engine
from engine.kv.attention import UbatchAttention
from engine.kv.swa import SwaType
from engine.watch.attention_mask import (
    MaskCell,
    MaskError,
    UbatchMask,
    cell_ranges,
    last_allocation,
    last_decode_masks,
    last_ubatch_mask,
    last_ubatch_masks,
    ubatch_mask,
)
from engine.watch.watcher import Watcher
from tests.model_factory import in_memory_model


@dataclass
class Recorded:
    cache: str
    streams: tuple[int, ...]
    idxs: tuple[np.ndarray, ...]
    mask: np.ndarray  # [groups, 1, tokens per group, n_kv]
    n_kv: int
    seen: list[UbatchMask]  # the watch layer's answer, polled while the kernel built its mask


class Watched:
    """A context, a watcher of its bus, and every mask the kernel built with the watch layer's answer."""

    def __init__(self, monkeypatch, model, **params) -> None:
        bus = engine.EventBus()
        self.watcher = Watcher(bus.subscribe(maxsize=1 << 16))
        self.ctx = engine.Context(model, bus=bus, type_k="f32", type_v="f32", **params)
        self.watcher.poll()
        self.records: list[Recorded] = []
        build = UbatchAttention.__init__
        records, watcher = self.records, self.watcher

        def recording_init(att, cache, sinfo, ubatch):
            build(att, cache, sinfo, ubatch)
            watcher.poll()
            records.append(Recorded(cache.name, tuple(sinfo.streams), tuple(np.array(i) for i in sinfo.idxs),
                                    att.mask.numpy().copy(), att.n_kv, last_ubatch_masks(watcher, cache.name)))

        monkeypatch.setattr(UbatchAttention, "__init__", recording_init)

    def decode(self, tokens, pos, seq_ids) -> list[Recorded]:
        start = len(self.records)
        assert self.ctx.decode(engine.Batch(tokens, pos, seq_ids)) == 0, self.ctx.last_error
        self.watcher.poll()
        return self.records[start:]

    def next_pos(self, seq: int) -> int:
        return self.ctx.memory.seq_pos_max(seq) + 1


def assert_same_as_kernel(records: list[Recorded]) -> None:
    assert records
    for rec in records:
        assert [m.stream for m in rec.seen] == list(rec.streams), rec.cache
        for g, mask in enumerate(rec.seen):
            assert mask.exact and mask.cache == rec.cache and mask.n_kv == rec.n_kv
            np.testing.assert_array_equal(mask.allowed, rec.mask[g, 0], err_msg=f"{rec.cache} stream {mask.stream}")
            np.testing.assert_array_equal(mask.token_cell, rec.idxs[g])
            np.testing.assert_array_equal(mask.allowed, np.isin(mask.codes, (MaskCell.ATTENDED, MaskCell.OWN)))
            assert all(mask.codes[k, c] == MaskCell.OWN for k, c in enumerate(mask.token_cell))


def test_two_sequences_in_one_cache_over_several_ubatches(monkeypatch):
    w = Watched(monkeypatch, in_memory_model(), n_ctx=64, n_seq_max=2, kv_unified=True, pad=16, n_ubatch=4, n_batch=16)
    recs = w.decode(list(range(3, 12)), [*range(5), *range(4)], [[0]] * 5 + [[1]] * 4)
    assert len(recs) == 3  # 9 tokens, 4 per ubatch
    assert_same_as_kernel(recs)
    # after the decode, each of its ubatches as the kernel masked it, the later ubatches not yet placed
    every = last_decode_masks(w.watcher, "kv")
    assert [m.ubatch for m in every] == [0, 1, 2]
    for mask, rec in zip(every, recs):
        assert mask.n_kv == rec.n_kv and mask.exact
        np.testing.assert_array_equal(mask.allowed, rec.mask[0, 0])
        np.testing.assert_array_equal(mask.token_cell, rec.idxs[0])
    for _ in range(2):
        assert_same_as_kernel(w.decode([5, 6], [w.next_pos(0), w.next_pos(1)], [[0], [1]]))
    mask = last_ubatch_mask(w.watcher, "kv")
    assert mask.token_seqs == ((0,), (1,)) and mask.counts().tolist() == [7, 6]
    text = mask.describe()
    assert ("token of seq 1 at pos 5 (cell 12) sees 6 cells: cells 5-8, 10 (its own sequence, positions 0-4) "
            "and its own cell; cells 0-4, 9, 11 hold seq 0 only") in text


def test_a_hole_left_by_seq_rm_and_a_later_change(monkeypatch):
    w = Watched(monkeypatch, in_memory_model(), n_ctx=64, n_seq_max=2, kv_unified=True, pad=16)
    w.decode(list(range(3, 11)), [*range(4), *range(4)], [[0]] * 4 + [[1]] * 4)
    w.ctx.memory.seq_rm(0, 1, 4)  # cells 1-3 empty; seq_rm moves the head back to cell 1 (llama.cpp)
    recs = w.decode([7], [w.next_pos(1)], [[1]])
    assert_same_as_kernel(recs)
    mask = last_ubatch_mask(w.watcher, "kv")
    assert mask.token_cell.tolist() == [1] and mask.is_hole(2) and not mask.is_hole(mask.n_used)
    assert "cells 2-3 are empty (a hole)" in mask.describe_row(0)
    assert mask.why(0, 2) == "masked: empty (a hole)" and mask.why(0, 0) == "masked: holds seq 0 only, not seq 1"
    w.ctx.memory.seq_rm(1, 2, -1)
    w.watcher.poll()
    later = last_ubatch_mask(w.watcher, "kv")
    assert not later.exact and later.changed_since and "changed since" in later.describe()


def test_a_sliding_window_in_several_ubatches(monkeypatch):
    model = in_memory_model(n_swa=4, swa_type=int(SwaType.STANDARD), swa_layers=(True, False))
    w = Watched(monkeypatch, model, n_ctx=32, n_seq_max=1, pad=8, n_ubatch=3, n_batch=32)
    recs = w.decode(list(range(3, 13)), list(range(10)), [[0]] * 10)
    assert sorted({r.cache for r in recs}) == ["base", "swa"] and len(recs) == 8
    assert_same_as_kernel(recs)
    base_recs = [r for r in recs if r.cache == "base"]
    every = last_decode_masks(w.watcher, "base")
    assert [m.ubatch for m in every] == [0, 1, 2, 3]
    for mask, rec in zip(every, base_recs):
        np.testing.assert_array_equal(mask.allowed, rec.mask[0, 0])
    assert [m.ubatch for m in last_decode_masks(w.watcher, "swa")] == [3]  # a window cache: the last only
    for _ in range(6):  # decode steps: the SWA cache reuses the cells its window left (and purges them)
        assert_same_as_kernel(w.decode([4], [w.next_pos(0)], [[0]]))
    swa = last_ubatch_mask(w.watcher, "swa")
    assert swa.counts().tolist() == [4] and swa.window_start(0) == int(swa.token_pos[0]) - 3
    assert "sliding window of 4" in swa.describe()
    base = last_ubatch_mask(w.watcher, "base")
    assert base.counts().tolist() == [int(base.token_pos[0]) + 1] and base.window_start(0) is None


def test_a_token_of_two_sequences(monkeypatch):
    w = Watched(monkeypatch, in_memory_model(), n_ctx=32, n_seq_max=2, kv_unified=True, pad=8)
    recs = w.decode([3, 4, 5], [0, 1, 2], [[0, 1]] * 3)
    assert_same_as_kernel(recs)
    assert last_ubatch_mask(w.watcher, "kv").token_label(0) == "seqs 0, 1 · pos 0"
    assert_same_as_kernel(w.decode([6, 7], [3, 3], [[0], [1]]))
    assert_same_as_kernel(w.decode([8], [4], [[0]]))


def test_a_batch_of_your_own_matches_the_kernel_when_placed_in_its_cells(monkeypatch):
    """ubatch_mask takes the sequences as the batch lists them: [1, 0] is masked as seq 0."""
    w = Watched(monkeypatch, in_memory_model(), n_ctx=32, n_seq_max=2, kv_unified=True, pad=8)
    w.decode([3, 4, 5, 6], [0, 1, 0, 1], [[0], [0], [1], [1]])
    w.ctx.memory.seq_cp(0, 1, -1, -1)
    w.watcher.poll()
    before = engine.CacheMirror()
    for event in w.watcher.mirror.state_events():
        before.apply(event)
    recs = w.decode([7, 8], [2, 3], [[1, 0], [1, 0]])
    (rec,) = recs
    mine = ubatch_mask(before, "kv", [2, 3], [[1, 0], [1, 0]], token_cells=rec.idxs[0])
    np.testing.assert_array_equal(mine.allowed, rec.mask[0, 0])
    assert mine.token_seq.tolist() == [0, 0]
    unplaced = ubatch_mask(before, "kv", [2, 3], [[1, 0], [1, 0]])
    assert (unplaced.token_cell == -1).all() and unplaced.counts().tolist() == [2, 2]
    assert "not placed yet" in unplaced.describe()
    with pytest.raises(MaskError):
        ubatch_mask(before, "kv", [2], [0], token_cells=[0])  # cell 0 is used
    with pytest.raises(MaskError):
        ubatch_mask(before, "nope", [2], [0])


def test_split_streams(monkeypatch):
    w = Watched(monkeypatch, in_memory_model(), n_ctx=32, n_seq_max=2, kv_unified=False, pad=8, n_ubatch=8)
    recs = w.decode(list(range(3, 9)), [0, 1, 2, 0, 1, 2], [[0]] * 3 + [[1]] * 3)
    assert_same_as_kernel(recs)
    assert [m.stream for m in last_ubatch_masks(w.watcher, "kv")] == [0, 1]
    assert [m.stream for m in last_decode_masks(w.watcher, "kv", stream=1)] == [1]
    assert_same_as_kernel(w.decode([9], [3], [[1]]))
    only = last_ubatch_mask(w.watcher, "kv")
    assert only.stream == 1 and last_ubatch_mask(w.watcher, "kv", stream=0) is None
    assert "stream 1" in only.title()


def test_the_dry_run_is_not_the_last_ubatch(monkeypatch):
    """A batch that does not fit is placed only by the dry run, which is rolled back: the last real
    ubatch stays the one before."""
    w = Watched(monkeypatch, in_memory_model(), n_ctx=16, n_seq_max=1, pad=8, n_ubatch=8, n_batch=32)
    w.decode(list(range(3, 13)), list(range(10)), [[0]] * 10)
    first, _ = last_allocation(w.watcher, "kv")
    assert w.ctx.decode(engine.Batch(list(range(3, 11)), list(range(10, 18)), [[0]] * 8)) == 1
    w.watcher.poll()
    again, changed = last_allocation(w.watcher, "kv")
    assert again is first and changed == ()


def test_cell_ranges():
    assert cell_ranges([0, 1, 2, 3, 4, 7, 9, 10]) == "0-4, 7, 9-10" and cell_ranges([]) == ""
