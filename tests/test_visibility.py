"""SWA visibility (engine/watch/visibility.py) against the attention kernel's own KQ mask.

The random tests drive real contexts (a plain tiny llama, an iSWA gemma3 with several windows, and
tiny llamas whose config asks for CHUNKED or SYMMETRIC sliding layers, which no supported model
has) with random decodes and sequence operations, then decode one token of a random sequence while
recording the mask UbatchAttention built (llama_kv_cache::set_input_kq_mask, src/llama-kv-cache.cpp).
The visibility computed from an event-fed mirror must equal that mask cell by cell: before the decode
up to the token's own cell, after it exactly. The hand-written cases follow llama.cpp's traced
scenarios in tests/test_swa_scenarios.py (S10, S13, S16), rebuilt on contexts.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import numpy as np
import pytest

import engine
from engine import events as ev
from engine.errors import MemoryOperationError
from engine.kv.attention import UbatchAttention
from engine.kv.cells import MAX_SEQ
from engine.kv.swa import SwaType
from engine.watch.visibility import (
    CacheVisibility,
    CellVisibility,
    LayerKind,
    visibility,
)
from tests.model_factory import in_memory_model

EMPTY, OTHER, ATTENDED, MASKED, FUTURE = (CellVisibility.EMPTY, CellVisibility.OTHER, CellVisibility.ATTENDED,
                                          CellVisibility.MASKED, CellVisibility.FUTURE)


@dataclass
class KernelMask:
    cache: str
    streams: tuple[int, ...]
    idxs: tuple[np.ndarray, ...]
    mask: np.ndarray  # [groups, 1, tokens per group, n_kv] bool, True = attend
    n_kv: int


@pytest.fixture
def kernel_masks(monkeypatch) -> list[KernelMask]:
    """Every KQ mask the kernel builds while the test runs. Patched on the class, so the cache module's
    own reference to UbatchAttention records too."""
    records: list[KernelMask] = []
    build = UbatchAttention.__init__

    def recording_init(self, cache, sinfo, ubatch):
        build(self, cache, sinfo, ubatch)
        records.append(KernelMask(cache.name, tuple(sinfo.streams), tuple(np.array(i) for i in sinfo.idxs),
                                  self.mask.numpy().copy(), self.n_kv))

    monkeypatch.setattr(UbatchAttention, "__init__", recording_init)
    return records


def watched_context(model, **params) -> tuple[engine.Context, engine.CacheMirror]:
    bus = engine.EventBus()
    mirror = engine.CacheMirror()
    mirror.attach(bus)
    ctx = engine.Context(model, bus=bus, type_k="f32", type_v="f32", **params)
    mirror.sync()
    return ctx, mirror


def sliding_llama(swa_type: SwaType, n_swa: int):
    """A tiny llama whose layer 0 slides with the given rule (the iSWA pair, as llama.cpp builds it
    for any model with sliding layers, e.g. llama4's chunked ones); layer 1 attends fully."""
    return in_memory_model(n_swa=n_swa, swa_type=int(swa_type), swa_layers=(True, False))


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_hf):
    return engine.load_model(tiny_gemma3_hf)


# ---- the kernel comparison ----------------------------------------------------------------------


def assert_kernel_row(before: CacheVisibility, after: CacheVisibility, rec: KernelMask) -> None:
    """One token's mask row against the visibility before the decode (the token's own cell aside) and
    after it (with the token's position, exactly)."""
    assert rec.streams == (after.stream,) == (before.stream,)
    row = rec.mask[0, 0, 0]
    (cell,) = rec.idxs[0]
    assert row.shape == (rec.n_kv,)
    np.testing.assert_array_equal(row, after.codes[:rec.n_kv] == ATTENDED, err_msg=f"{rec.cache} after")
    expected = before.codes[:rec.n_kv] == ATTENDED
    assert not expected[cell] and before.codes[cell] in (EMPTY, OTHER, MASKED), "only a free or masked cell is taken"
    expected[cell] = True
    np.testing.assert_array_equal(row, expected, err_msg=f"{rec.cache} before")
    for vis in (before, after):
        assert not np.any(vis.codes[rec.n_kv:] == ATTENDED), "an attended cell lies beyond the kernel's n_kv"


def decode_and_compare(ctx, mirror, masks: list[KernelMask], seq_id: int, token: int) -> CacheVisibility | None:
    """Decode seq_id's next token; compare every cache's mask with the visibility. Returns the
    visibility before the decode, or None when the token found no slot."""
    mirror.sync()
    before = visibility(mirror, seq_id)
    assert before.next_pos == ctx.memory.seq_pos_max(seq_id) + 1
    masks.clear()
    rc = ctx.decode(engine.Batch([token], [before.next_pos], [[seq_id]]))
    if rc != 0:
        assert rc == 1 and not masks, ctx.last_error
        return None
    mirror.sync()
    after = visibility(mirror, seq_id, before.next_pos)
    assert sorted(r.cache for r in masks) == sorted(after.caches)
    for rec in masks:
        assert_kernel_row(before.caches[rec.cache], after.caches[rec.cache], rec)
    return before


# ---- random caches --------------------------------------------------------------------------------


class RandomOps:
    """Random decodes and sequence operations of the public memory API; refused ones are skipped."""

    def __init__(self, ctx: engine.Context, rng: np.random.Generator, n_seq: int, unified: bool) -> None:
        self.ctx, self.rng, self.n_seq, self.unified = ctx, rng, n_seq, unified
        self.mem = ctx.memory

    def step(self) -> None:
        ops = [self.decode, self.decode, self.decode, self.seq_rm, self.fork, self.coupled_decode, self.seq_keep,
               self.seq_add, self.seq_div]
        try:
            ops[self.rng.integers(len(ops))]()
        except MemoryOperationError:
            pass  # an operation the engine refuses (an invalid sequence, a move of a plain cache that cannot shift)

    def seq(self) -> int:
        return int(self.rng.integers(self.n_seq))

    def tokens(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(3, self.ctx.model.n_vocab, n)]

    def decode(self) -> None:
        seqs = self.rng.choice(self.n_seq, size=int(self.rng.integers(1, self.n_seq + 1)), replace=False)
        tokens, pos, seq_ids = [], [], []
        for s in seqs:
            n = int(self.rng.integers(1, 6))
            p0 = self.mem.seq_pos_max(int(s)) + 1
            tokens += self.tokens(n)
            pos += list(range(p0, p0 + n))
            seq_ids += [[int(s)]] * n
        self.ctx.decode(engine.Batch(tokens, pos, seq_ids))

    def seq_rm(self) -> None:
        s = self.seq()
        p0 = int(self.rng.integers(-1, self.mem.seq_pos_max(s) + 2))
        p1 = -1 if self.rng.random() < 0.4 else p0 + int(self.rng.integers(1, 6))
        self.mem.seq_rm(s, p0, p1)

    def fork(self) -> None:
        src, dst = self.rng.choice(self.n_seq, size=2, replace=False)
        self.mem.seq_rm(int(dst), -1, -1)
        if self.unified:
            p0 = int(self.rng.integers(-1, 4))
            self.mem.seq_cp(int(src), int(dst), p0, -1)
        else:
            self.mem.seq_cp(int(src), int(dst), -1, -1)  # split streams copy whole streams only

    def coupled_decode(self) -> None:
        """Tokens of two sequences at once, when their positions allow it (llama_batch_allocr::init)."""
        if not self.unified:
            return
        a, b = (int(s) for s in self.rng.choice(self.n_seq, size=2, replace=False))
        if (self.mem.seq_pos_min(a), self.mem.seq_pos_max(a)) != (self.mem.seq_pos_min(b), self.mem.seq_pos_max(b)):
            return
        n, p0 = int(self.rng.integers(1, 4)), self.mem.seq_pos_max(a) + 1
        self.ctx.decode(engine.Batch(self.tokens(n), list(range(p0, p0 + n)), [[a, b]] * n))

    def free_older_half(self, s: int) -> None:
        lo, hi = self.mem.seq_pos_min(s), self.mem.seq_pos_max(s)
        self.mem.seq_rm(s, -1, (lo + hi + 1) // 2 + 1)

    def seq_keep(self) -> None:
        if self.rng.random() < 0.3:
            self.mem.seq_keep(self.seq())

    def seq_add(self) -> None:
        s = self.seq()
        p0 = int(self.rng.integers(-1, self.mem.seq_pos_max(s) + 2))
        self.mem.seq_add(s, p0, -1 if self.rng.random() < 0.5 else p0 + 3, int(self.rng.integers(-5, 6)))

    def seq_div(self) -> None:
        s = self.seq()
        self.mem.seq_div(s, int(self.rng.integers(0, 4)), -1, int(self.rng.integers(2, 4)))


def run_random(ctx, mirror, masks, *, n_seq: int, unified: bool, seed: int, steps: int = 40) -> dict:
    """Random operations, each followed by one compared token; returns what the probes saw."""
    rng = np.random.default_rng(seed)
    ops = RandomOps(ctx, rng, n_seq, unified)
    answering = "swa" if "swa" in mirror.caches else "kv"
    seen = dict.fromkeys(("compared", "attended", "masked", "other", "future"), 0)
    for _ in range(steps):
        ops.step()
        seq_id = ops.seq()
        before = decode_and_compare(ctx, mirror, masks, seq_id, ops.tokens(1)[0])
        if before is None:
            ops.free_older_half(seq_id)  # what a client does when its sequence finds no slot
            continue
        seen["compared"] += 1
        assert before.caches[answering].counts[FUTURE] == 0, "next_pos follows every cell of the answering cache"
        for vis in before.caches.values():
            counts = vis.counts
            if vis.kind is LayerKind.FULL:
                assert counts[MASKED] == 0, "a full-attention cache masks nothing of the sequence"
            for code in (ATTENDED, MASKED, OTHER, FUTURE):
                seen[code.name.lower()] += counts[code]
    assert seen["compared"] >= steps // 2, seen
    return seen


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_plain_llama_cache_equals_kernel_mask(kernel_masks, unified, seed):
    ctx, mirror = watched_context(in_memory_model(), n_ctx=48, n_seq_max=3, kv_unified=unified, pad=8, n_ubatch=8,
                                  n_batch=16)
    assert set(mirror.caches) == {"kv"}
    seen = run_random(ctx, mirror, kernel_masks, n_seq=3, unified=unified, seed=seed)
    assert seen["other"] > 0 if unified else seen["other"] == 0, seen


@pytest.mark.parametrize("window,unified,swa_full", [(2, True, False), (3, False, False), (5, True, True),
                                                     (None, False, True)])
def test_random_gemma3_iswa_equals_kernel_mask(kernel_masks, gemma3, window, unified, swa_full):
    ctx, mirror = watched_context(gemma3, n_ctx=48, n_seq_max=3, kv_unified=unified, pad=8, n_ubatch=8, n_batch=16,
                                  swa_window=window, swa_full=swa_full)
    assert mirror.created["swa"].n_swa == (window or gemma3.config.n_swa)
    seen = run_random(ctx, mirror, kernel_masks, n_seq=3, unified=unified, seed=window or 8)
    assert seen["masked"] > 0 and seen["attended"] > 0, seen


@pytest.mark.parametrize("swa_type,n_swa", [(SwaType.CHUNKED, 4), (SwaType.CHUNKED, 3), (SwaType.SYMMETRIC, 4),
                                            (SwaType.SYMMETRIC, 5)])
@pytest.mark.parametrize("unified", [True, False])
def test_random_chunked_and_symmetric_equal_kernel_mask(kernel_masks, swa_type, n_swa, unified):
    ctx, mirror = watched_context(sliding_llama(swa_type, n_swa), n_ctx=48, n_seq_max=3, kv_unified=unified, pad=8,
                                  n_ubatch=8, n_batch=16)
    assert SwaType(mirror.created["swa"].swa_type) == swa_type
    seen = run_random(ctx, mirror, kernel_masks, n_seq=3, unified=unified, seed=n_swa + 10 * int(swa_type))
    assert seen["masked"] > 0 and seen["attended"] > 0, seen


def test_a_coupled_token_is_masked_as_its_last_sequence(kernel_masks):
    """A token of seqs (0, 1) sees what seq 1 holds (UbatchAttention._build_mask, after llama.cpp's
    set_input_kq_mask, which keys the mask by the token's last seq id): seq 1's visibility, not 0's."""
    ctx, mirror = watched_context(in_memory_model(), n_ctx=16, n_seq_max=2, kv_unified=True, pad=8)
    assert ctx.decode(engine.Batch.for_sequence([5, 6, 7, 8], 0, 0)) == 0
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_rm(1, 1, 3)  # same first and last position, different cells: still coupled
    kernel_masks.clear()
    assert ctx.decode(engine.Batch([9], [4], [[0, 1]])) == 0
    mirror.sync()
    (rec,) = kernel_masks
    row = rec.mask[0, 0, 0]
    of_1, of_0 = (visibility(mirror, s, 4).caches["kv"].codes[:rec.n_kv] == ATTENDED for s in (1, 0))
    np.testing.assert_array_equal(row, of_1)
    assert np.flatnonzero(row).tolist() == [0, 3, 4] and np.flatnonzero(of_0).tolist() == [0, 1, 2, 3, 4]


# ---- hand-written cases (tests/test_swa_scenarios.py, traced from llama.cpp) ----------------------------


def swa_cells(ctx) -> list[tuple[int, set[int]]]:
    return [(p, set(s)) for p, s, _ in ctx.memory.swa.cells(0)]


def eight_cell_swa_context(swa_type: SwaType):
    """Window 4 on an 8-cell SWA cache: PAD8(min(16, 4 + 4)) = 8 cells (llama_kv_cache_iswa)."""
    ctx, mirror = watched_context(sliding_llama(swa_type, 4), n_ctx=16, pad=8, n_ubatch=4, n_batch=8)
    assert ctx.memory.swa.size == 8
    return ctx, mirror


def decode_positions(ctx, mirror, positions: list[int]) -> CacheVisibility:
    assert ctx.decode(engine.Batch.for_sequence([5] * len(positions), 0, positions[0])) == 0
    mirror.sync()
    return visibility(mirror, 0).caches["swa"]


def cells_by_code(vis: CacheVisibility) -> tuple[list[int], list[int], list[int]]:
    return vis.cells(ATTENDED).tolist(), vis.cells(MASKED).tolist(), vis.cells(EMPTY).tolist()


def test_standard_window_4_on_8_cells_after_positions_0_to_11():
    """S10: each step's decode, then which SWA cells seq 0's next token sees (p1 - p0 < 4)."""
    ctx, mirror = eight_cell_swa_context(SwaType.STANDARD)
    steps = [  # decoded positions -> (attended, masked, empty) cells for the next token
        ([0, 1, 2, 3, 4, 5], ([3, 4, 5], [0, 1, 2], [6, 7])),  # p6 sees p3-p5
        ([6], ([4, 5, 6], [0, 1, 2, 3], [7])),
        ([7], ([5, 6, 7], [0, 1, 2, 3, 4], [])),  # p8 sees p5-p7
        ([8], ([0, 6, 7], [1, 2, 3, 4, 5], [])),  # cell 0 now holds p8; p9 sees p6-p8
        ([9, 10, 11], ([1, 2, 3], [0, 4, 5, 6, 7], [])),  # cells 0-3: p8-p11, 4-7: p4-p7; p12 sees p9-p11
    ]
    for positions, expected in steps:
        vis = decode_positions(ctx, mirror, positions)
        assert cells_by_code(vis) == expected, positions
    assert swa_cells(ctx) == [(p, {0}) for p in (8, 9, 10, 11, 4, 5, 6, 7)], "S10's table"
    full = visibility(mirror, 0).caches["base"]
    assert cells_by_code(full) == (list(range(12)), [], [12, 13, 14, 15])
    assert vis.describe() == "seq 0's next token sees 3 of 8 cells (swa, sliding, standard window 4)"
    assert full.describe() == "seq 0's next token sees 12 of 12 cells (base, full)"


def test_chunked_window_4_on_8_cells():
    """S13: a token sees its own chunk of 4 positions only (p0 >= p1 // 4 * 4)."""
    ctx, mirror = eight_cell_swa_context(SwaType.CHUNKED)
    assert cells_by_code(decode_positions(ctx, mirror, list(range(8)))) == ([], list(range(8)), [])  # p8: new chunk
    assert cells_by_code(decode_positions(ctx, mirror, [8])) == ([0], list(range(1, 8)), [])
    vis = decode_positions(ctx, mirror, [9, 10])
    assert cells_by_code(vis) == ([0, 1, 2], [3, 4, 5, 6, 7], [])  # p11 sees p8-p10
    vis = decode_positions(ctx, mirror, [11])
    assert swa_cells(ctx) == [(p, {0}) for p in (8, 9, 10, 11, 4, 5, 6, 7)], "S13's table"
    assert cells_by_code(vis) == ([], list(range(8)), [])  # p12 opens a chunk: only its own cell


def test_symmetric_window_4_on_8_cells():
    """S16: |p1 - p0| <= 2, and never a later position (the kernel is causal)."""
    ctx, mirror = eight_cell_swa_context(SwaType.SYMMETRIC)
    assert cells_by_code(decode_positions(ctx, mirror, list(range(8)))) == ([6, 7], list(range(6)), [])
    vis = decode_positions(ctx, mirror, [8, 9])
    assert swa_cells(ctx) == [(8, {0}), (9, {0})] + [(p, {0}) for p in range(2, 8)], "S16's table"
    assert cells_by_code(vis) == ([0, 1], list(range(2, 8)), [])  # p10 sees p8, p9


def test_an_earlier_position_marks_later_cells_future():
    ctx, mirror = eight_cell_swa_context(SwaType.STANDARD)
    decode_positions(ctx, mirror, [0, 1, 2, 3, 4, 5])
    vis = visibility(mirror, 0, next_pos=3)
    assert vis.caches["swa"].codes.tolist() == [ATTENDED] * 4 + [FUTURE] * 2 + [EMPTY] * 2
    assert vis.caches["base"].cells(FUTURE).tolist() == [4, 5]
    assert visibility(mirror, 0, next_pos=5).caches["swa"].cells(ATTENDED).tolist() == [2, 3, 4, 5]


def test_base_cells_the_swa_cache_forgot_are_future(kernel_masks):
    """The window purged p0-p3 from the SWA cache; seq_rm(0, 4, -1) then empties it of seq 0 while the
    base keeps p0-p3. The pair answers seq_pos_max -1 from its SWA cache, so the next token comes at
    p0 and the kernel sees only base cell 0 (p0) besides its own: p1-p3 are later than the token."""
    ctx, mirror = eight_cell_swa_context(SwaType.STANDARD)
    for positions in ([0, 1, 2, 3, 4, 5], [6], [7], [8], [9, 10, 11]):
        decode_positions(ctx, mirror, positions)
    ctx.memory.seq_rm(0, 4, -1)
    assert (ctx.memory.seq_pos_max(0), ctx.memory.base.seq_pos_max(0)) == (-1, 3)
    before = decode_and_compare(ctx, mirror, kernel_masks, 0, 5)
    assert before.next_pos == 0
    assert before.caches["base"].codes[:4].tolist() == [ATTENDED, FUTURE, FUTURE, FUTURE]
    assert before.caches["swa"].counts[EMPTY] == 8
    assert [np.flatnonzero(r.mask[0, 0, 0]).tolist() for r in kernel_masks] == [[0, 4], [0]]


def test_shared_cells_decide_by_the_asked_sequence():
    ctx, mirror = watched_context(in_memory_model(), n_ctx=16, n_seq_max=2, kv_unified=True, pad=8)
    assert ctx.decode(engine.Batch.for_sequence([5] * 6, 0, 0)) == 0
    ctx.memory.seq_cp(0, 1, 0, 3)
    mirror.sync()
    one = visibility(mirror, 1)
    assert one.next_pos == 3
    assert one.caches["kv"].codes[:8].tolist() == [ATTENDED] * 3 + [OTHER] * 3 + [EMPTY] * 2
    assert visibility(mirror, 0).caches["kv"].cells(ATTENDED).tolist() == list(range(6))
    assert visibility(mirror, 2).caches["kv"].counts[OTHER] == 6 and visibility(mirror, 2).next_pos == 0


def test_split_streams_show_the_sequences_own_stream():
    ctx, mirror = watched_context(sliding_llama(SwaType.STANDARD, 2), n_ctx=32, n_seq_max=2, kv_unified=False, pad=8,
                                  n_ubatch=4)
    assert ctx.decode(engine.Batch.for_sequence([5] * 3, 0, 0)) == 0
    assert ctx.decode(engine.Batch.for_sequence([5] * 5, 1, 0)) == 0
    mirror.sync()
    for seq_id, n_held in ((0, 3), (1, 5)):
        vis = visibility(mirror, seq_id)
        assert {v.stream for v in vis.caches.values()} == {seq_id}
        assert vis.caches["base"].n_attended == vis.caches["base"].n_held == n_held
        assert vis.caches["swa"].n_attended == 1 and vis.caches["swa"].counts[OTHER] == 0


def test_layer_kinds_of_the_caches_a_context_gets(gemma3):
    _, mirror = watched_context(gemma3, n_ctx=32, pad=8)
    vis = visibility(mirror, 0)
    assert [(v.cache, v.kind, v.layer_ids) for v in vis.caches.values()] == [
        ("base", LayerKind.FULL, (5,)), ("swa", LayerKind.SLIDING, (0, 1, 2, 3, 4))]
    assert vis.for_layer(5).cache == "base" and vis.for_layer(2).cache == "swa"
    assert [v.cache for v in vis.of_kind(LayerKind.SLIDING)] == ["swa"]
    _, plain = watched_context(in_memory_model(), n_ctx=16, pad=8)
    only = visibility(plain, 0).caches["kv"]
    assert (only.kind, only.layer_ids, only.swa_type) == (LayerKind.FULL, (0, 1), SwaType.NONE)


def test_invalid_sequence_ids_are_refused():
    _, unified = watched_context(in_memory_model(), n_ctx=16, n_seq_max=2, kv_unified=True, pad=8)
    _, split = watched_context(in_memory_model(), n_ctx=16, n_seq_max=2, kv_unified=False, pad=8)
    assert visibility(unified, MAX_SEQ - 1).next_pos == 0
    for mirror, bad in ((unified, -1), (unified, MAX_SEQ), (unified, True), (unified, 1.0), (split, 2)):
        with pytest.raises(ValueError, match="seq_id"):
            visibility(mirror, bad)


def test_codes_are_read_only_and_the_mirror_staleness_is_passed_on():
    ctx, mirror = watched_context(in_memory_model(), n_ctx=16, pad=8)
    assert ctx.decode(engine.Batch.for_sequence([5] * 3, 0, 0)) == 0
    mirror.sync()
    vis = visibility(mirror, 0)
    with pytest.raises(ValueError):
        vis.caches["kv"].codes[0] = EMPTY
    assert not vis.stale
    mirror.apply(ev.EventsDropped(3, 0, 2))
    assert visibility(mirror, 0).stale


# ---- size and dependencies ---------------------------------------------------------------------------

N_BIG = 32768


def big_mirror(rng: np.random.Generator) -> engine.CacheMirror:
    """An iSWA pair of 32k cells per cache, as a mirror receives it in a snapshot: random positions
    and one of 8 sequences per used cell."""
    mirror = engine.CacheMirror()
    for name, n_swa, swa_type in (("base", 0, SwaType.NONE), ("swa", 4096, SwaType.STANDARD)):
        mirror.apply(ev.ContextCreated(
            cache=name, n_ctx=N_BIG, n_ctx_seq=N_BIG, kv_size=N_BIG, n_stream=1, n_seq_max=8, n_layer=1, type_k="f16",
            type_v="f16", v_trans=False, k_bytes=0, v_bytes=0, n_batch=512, n_ubatch=512, pad=256, unified=True,
            model_name="synthetic", log_lines=(), n_swa=n_swa, swa_type=int(swa_type)))
        pos = rng.integers(-1, 20000, N_BIG)
        seq = np.zeros((MAX_SEQ, N_BIG), dtype=bool)
        seq[rng.integers(0, 8, N_BIG), np.arange(N_BIG)] = True
        seq[:, pos < 0] = False
        mirror.apply(ev.MemorySnapshot(cache=name, changes=(ev.StreamCells(
            0, np.arange(N_BIG), pos, np.zeros(N_BIG, dtype=np.int64), ev.pack_seq_bits(seq), 0),)))
    return mirror


def test_two_32k_cell_caches_take_milliseconds():
    """Measured about 0.6 ms for both caches on the development machine; the bound only catches a
    per-cell Python loop (tens of ms), with room for a loaded machine."""
    mirror = big_mirror(np.random.default_rng(0))
    vis = visibility(mirror, 2)
    st = mirror.caches["swa"].streams[0]
    held = st.seq[2]
    assert vis.next_pos == int(st.pos[held].max()) + 1
    assert vis.caches["swa"].n_held == int(held.sum())
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        visibility(mirror, 2)
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.015, times


def test_the_visibility_module_works_without_torch():
    code = textwrap.dedent("""
        import sys; sys.modules['torch'] = None
        import numpy as np
        from engine import events as ev
        from engine.kv.cells import MAX_SEQ
        from engine.watch.mirror import CacheMirror
        from engine.watch.visibility import visibility
        m = CacheMirror()
        m.apply(ev.ContextCreated(cache="kv", n_ctx=4, n_ctx_seq=4, kv_size=4, n_stream=1, n_seq_max=1, n_layer=1,
                                  type_k="f16", type_v="f16", v_trans=False, k_bytes=0, v_bytes=0, n_batch=4,
                                  n_ubatch=4, pad=4, unified=True, model_name="x", log_lines=()))
        seq = np.zeros((MAX_SEQ, 4), dtype=bool); seq[0, :2] = True
        m.apply(ev.CellsAllocated(cache="kv", changes=(ev.StreamCells(0, np.arange(4), np.array([0, 1, -1, -1]),
                                  np.zeros(4, dtype=np.int64), ev.pack_seq_bits(seq), 2),)))
        print(visibility(m, 0).caches["kv"].describe())
        print(" ".join(sorted(k for k in sys.modules if k.startswith("engine"))))
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    described, loaded = done.stdout.splitlines()
    assert described == "seq 0's next token sees 2 of 2 cells (kv, full)"
    assert not set(loaded.split()) & {"engine.context", "engine.models.model", "engine.kv.cache"}, loaded
