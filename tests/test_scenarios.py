"""Numbered scenarios of llama.cpp's KV cache (full attention: S1-S9, S11, S15; the sliding-window ones
are in test_swa_scenarios.py) and further observations of it, as exact cell tables. The expected tables
follow llama.cpp's rules: src/llama-kv-cache.cpp (llama_kv_cache::find_slot, apply_ubatch, the seq_*
operations, update), src/llama-kv-cells.h and llama_context::decode (src/llama-context.cpp).

Every scenario runs on a real context over a tiny in-memory llama (2 layers, n_head_kv 2, head_dim 8).
`pad` replaces llama.cpp's 256 padding so that a cache has 8 cells. After EVERY step the cache is
also rebuilt from the event bus (engine.CacheMirror) and compared with the engine, cell for cell and
head for head. Cell tables are written as `idx:pPOS{seqs}[shift]`, ranges as
`0-4:p0-p4{0}`; cells not listed are empty.
"""
from __future__ import annotations

import re

import pytest
import torch

import engine
from engine import events as ev
from engine.rope import Rotary
from tests.model_factory import in_memory_model


@pytest.fixture(scope="module")
def model():
    return in_memory_model()


# ---- helpers ------------------------------------------------------------------------------------
def token(seq: int, pos: int) -> int:
    """A token id that differs between sequences and positions (so K rows differ too)."""
    return (5 * pos + 17 * seq + 1) % 64


def make_batch(entries) -> engine.Batch:
    """entries: (seq or seqs, pos) or (seq or seqs, pos, token), in batch order."""
    seqs = [list(e[0]) if isinstance(e[0], (tuple, list)) else [e[0]] for e in entries]
    pos = [e[1] for e in entries]
    toks = [e[2] if len(e) > 2 else token(s[0], p) for e, s, p in zip(entries, seqs, pos)]
    return engine.Batch(tokens=toks, pos=pos, seq_ids=seqs)


def seq_range(seq, p0: int, p1: int):
    """Tokens of `seq` (an id or a tuple of ids) at positions p0..p1 inclusive."""
    return [(seq, p) for p in range(p0, p1 + 1)]


_CELL = re.compile(r"(\d+)(?:-(\d+))?:p(\d+)(?:-p(\d+))?\{([\d,]*)\}(?:\[([+-]?\d+)\])?$")


def table(text: str, size: int = 8) -> list[tuple[int, frozenset[int], int]]:
    """Table notation -> the engine's cells() list. `2-4:p5-p7{0,1}` expands to three cells."""
    cells = [(-1, frozenset(), 0)] * size
    for item in text.split():
        m = _CELL.match(item)
        assert m, f"bad cell notation {item!r}"
        i0, i1, p0, p1, seqs, shift = m.groups()
        i0, p0 = int(i0), int(p0)
        i1 = int(i1) if i1 else i0
        p1 = int(p1) if p1 else p0 + (i1 - i0)
        assert p1 - p0 == i1 - i0, f"{item!r}: cell and position ranges differ in length"
        seq_set = frozenset(int(s) for s in seqs.split(",") if s)
        for k in range(i1 - i0 + 1):
            cells[i0 + k] = (p0 + k, seq_set, int(shift or 0))
    return cells


def assert_mirror_matches(ctx: engine.Context, mirror: engine.CacheMirror) -> None:
    """The cache rebuilt from events equals the engine's, for every stream."""
    mirror.sync()
    assert not mirror.stale and mirror.stats.dropped == 0
    for s in range(ctx.memory.n_stream):
        assert mirror.cells(s) == ctx.memory.cells(s), f"mirror differs from the engine in stream {s}"
        assert mirror.head(s) == ctx.memory.head(s), f"mirror head differs from the engine in stream {s}"


def snapshot(ctx: engine.Context):
    """Everything an operation could change: cells, heads, pending copies and shifts, K/V data."""
    mem = ctx.memory
    return ([mem.cells(s) for s in range(mem.n_stream)], [mem.head(s) for s in range(mem.n_stream)],
            list(mem.pending_copies), [c.has_shift for c in mem.v_cells], [r.data.clone() for r in mem.k + mem.v])


def assert_same_state(a, b) -> None:
    assert a[:4] == b[:4]
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4])), "K/V data changed"


class Run:
    """A context whose bus feeds a mirror; each step re-checks the mirror against the engine."""

    def __init__(self, model, **params) -> None:
        params = {"n_ctx": 8, "pad": 8, "n_seq_max": 10, "kv_unified": True, "type_k": "f32", "type_v": "f32",
                  **params}
        self.model = model
        self.bus = engine.EventBus()
        self.mirror = engine.CacheMirror()
        self.mirror.attach(self.bus)
        self._log = self.bus.subscribe()
        self.events: list[ev.Event] = []
        self.ctx = engine.Context(model, bus=self.bus, **params)
        self.mem = self.ctx.memory
        self.check_mirror()

    def check_mirror(self) -> None:
        assert_mirror_matches(self.ctx, self.mirror)
        self.events += self._log.drain()

    def decode(self, entries) -> int:
        rc = self.ctx.decode(make_batch(entries))
        self.check_mirror()
        return rc

    def op(self, name: str, *args):
        result = getattr(self.mem, name)(*args)
        self.check_mirror()
        return result

    def refused(self, error: type, call) -> None:
        """call() must raise `error` and change nothing: no state, no data, no cell events."""
        before, n_events = snapshot(self.ctx), len(self.events)
        with pytest.raises(error):
            call()
        self.check_mirror()
        assert_same_state(before, snapshot(self.ctx))
        assert not [e for e in self.events[n_events:] if isinstance(e, ev.CellsChanged)]

    def expect(self, text: str, head: int, stream: int = 0) -> None:
        assert self.mem.cells(stream) == table(text, self.mem.size)
        assert self.mem.head(stream) == head

    def expect_seq(self, seq: int, p_min: int, p_max: int) -> None:
        assert (self.mem.seq_pos_min(seq), self.mem.seq_pos_max(seq)) == (p_min, p_max)

    def k_rows(self, cells, stream: int = 0) -> list[torch.Tensor]:
        """The stored K rows of some cells, one tensor [len(cells), n_embd_k] per layer."""
        return [r.stored_rows(stream, torch.tensor(list(cells))).clone() for r in self.mem.k]


def assert_reroped(model, before: list[torch.Tensor], after: list[torch.Tensor], deltas) -> None:
    """after == before re-rotated by deltas (per cell), in every layer; and something really moved."""
    cfg = model.config
    rotary = Rotary(cfg)
    delta = torch.tensor(deltas, dtype=torch.int64)
    for layer, (b, a) in enumerate(zip(before, after)):
        expected = rotary.shift_keys(layer, b.view(len(deltas), cfg.n_head_kv, cfg.head_dim), delta)
        torch.testing.assert_close(a, expected.reshape(len(deltas), -1), rtol=0, atol=1e-6)
        assert not torch.allclose(a, b), f"layer {layer}: the K rows were not re-roped"


def fresh_layer0_keys(model, tokens, positions) -> torch.Tensor:
    """Layer-0 K rows computed from scratch for tokens at positions (one seq per token, so any positions
    are valid). Layer 0's keys depend only on the token and its position, so re-roped rows must match."""
    run = Run(model, n_seq_max=len(tokens))
    assert run.decode([(i, p, t) for i, (t, p) in enumerate(zip(tokens, positions))]) == 0
    return run.mem.k[0].stored_rows(0, torch.arange(len(tokens))).clone()


# ---- scenarios ------------------------------------------------------------------------------------
def s1_prefill(model, n_ubatch: int = 8) -> Run:
    run = Run(model, n_ubatch=n_ubatch)
    assert run.decode(seq_range(0, 0, 4)) == 0
    run.expect("0-4:p0-p4{0}", head=5)
    run.expect_seq(0, 0, 4)
    return run


@pytest.mark.parametrize("n_ubatch", [8, 2])
def test_s1_prefill(model, n_ubatch):
    run = s1_prefill(model, n_ubatch)
    # With n_ubatch 2 (as llama.cpp ran it for S2) the prefill is 3 ubatches landing in the same cells.
    finished = run.mirror.last_decode
    assert finished.rc == 0 and finished.ubatch_sizes == ((5,) if n_ubatch == 8 else (2, 2, 1))
    assert run.mem.used() == 5


def test_s2_atomic_failure(model):
    run = s1_prefill(model, n_ubatch=2)
    assert run.decode([(0, 5)]) == 0
    run.expect("0-5:p0-p5{0}", head=6)
    n_events = len(run.events)
    assert run.decode(seq_range(1, 0, 3)) == 1
    run.expect("0-5:p0-p5{0}", head=6)  # ubatch A's tentative cells 6,7 were rolled back
    run.expect_seq(0, 0, 5)
    run.expect_seq(1, -1, -1)
    assert "failed to find a memory slot for batch of size 4" in run.ctx.last_error
    # The dry run tried A at [6, 7] (h8), found no slot for B, and rolled back.
    dry = [e for e in run.events[n_events:] if isinstance(e, ev.CellsChanged)]
    assert [type(e) for e in dry] == [ev.CellsAllocated, ev.SlotsRolledBack]
    (tried,) = dry[0].changes
    assert dry[0].tentative and tried.cells.tolist() == [6, 7] and tried.pos.tolist() == [0, 1]
    assert tried.seq_sets() == [frozenset({1})] * 2 and tried.head == 8
    assert run.decode(seq_range(1, 0, 1)) == 0
    run.expect("0-5:p0-p5{0} 6:p0{1} 7:p1{1}", head=8)
    run.expect_seq(1, 0, 1)


def test_s3_shared_prefix_and_shared_cell_shift(model):
    run = Run(model)
    assert run.decode(seq_range(0, 0, 3)) == 0
    run.expect("0-3:p0-p3{0}", head=4)
    run.op("seq_cp", 0, 1, -1, -1)
    run.expect("0-3:p0-p3{0,1}", head=4)
    assert run.decode([(1, 4)]) == 0
    run.expect("0-3:p0-p3{0,1} 4:p4{1}", head=5)
    assert run.decode([(0, 4)]) == 0
    run.expect("0-3:p0-p3{0,1} 4:p4{1} 5:p4{0}", head=6)
    assert run.op("seq_rm", 0, 2, -1) is True
    run.expect("0:p0{0,1} 1:p1{0,1} 2:p2{1} 3:p3{1} 4:p4{1}", head=5)
    run.expect_seq(0, 0, 1)
    run.expect_seq(1, 0, 4)
    before = run.k_rows([0, 1])
    run.op("seq_add", 1, 0, 2, 10)  # moves the shared cells for seq 0 too
    run.expect("0:p10{0,1}[+10] 1:p11{0,1}[+10] 2:p2{1} 3:p3{1} 4:p4{1}", head=0)
    run.expect_seq(0, 10, 11)
    run.expect_seq(1, 2, 11)
    assert run.mem.v_cells[0].has_shift
    # The next decode applies the K-shift (+10) and places from h0.
    assert run.decode([(1, 12)]) == 0
    run.expect("0:p10{0,1} 1:p11{0,1} 2:p2{1} 3:p3{1} 4:p4{1} 5:p12{1}", head=6)
    assert not run.mem.v_cells[0].has_shift
    assert_reroped(model, before, run.k_rows([0, 1]), [10, 10])
    assert sum(isinstance(e, ev.KShiftApplied) for e in run.events) == 1


def test_s4_multi_seq_tokens(model):
    run = Run(model)
    assert run.decode(seq_range((0, 1), 0, 2)) == 0
    run.expect("0-2:p0-p2{0,1}", head=3)
    assert run.decode([(0, 3), (1, 3)]) == 0
    run.expect("0-2:p0-p2{0,1} 3:p3{0} 4:p3{1}", head=5)
    assert run.mem.used() == 5  # the debug dump's "n = 5, used = 5, head = 5, size = 8"
    run.expect_seq(0, 0, 3)
    run.expect_seq(1, 0, 3)


def test_s5_seq_rm_all_seqs_leaves_a_gap(model):
    run = Run(model)
    assert run.decode([(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2), (0, 3)]) == 0
    run.expect("0:p0{0} 1:p1{0} 2:p0{1} 3:p1{1} 4:p2{0} 5:p2{1} 6:p3{0}", head=7)
    assert run.op("seq_rm", -1, 1, 3) is True
    run.expect("0:p0{0} 2:p0{1} 6:p3{0}", head=1)
    run.expect_seq(0, 0, 3)  # gap: positions {0, 3}
    run.expect_seq(1, 0, 0)
    assert run.decode([(1, 1)]) == 0
    run.expect("0:p0{0} 1:p1{1} 2:p0{1} 6:p3{0}", head=2)
    run.expect_seq(1, 0, 1)


def test_s6_seq_keep(model):
    run = Run(model)
    assert run.decode(seq_range((0, 1), 0, 1)) == 0
    assert run.decode([(1, 2), (0, 2), (2, 0)]) == 0
    run.expect("0:p0{0,1} 1:p1{0,1} 2:p2{1} 3:p2{0} 4:p0{2}", head=5)
    run.op("seq_keep", 1)
    run.expect("0-2:p0-p2{1}", head=3)
    run.expect_seq(0, -1, -1)
    run.expect_seq(1, 0, 2)
    run.expect_seq(2, -1, -1)


def test_s7_context_shift_and_k_shift(model):
    run = Run(model)
    assert run.decode(seq_range(0, 0, 7)) == 0
    run.expect("0-7:p0-p7{0}", head=8)
    # n_keep 1, n_past 8 -> n_discard 3
    run.op("seq_rm", 0, 1, 4)
    run.expect("0:p0{0} 4-7:p4-p7{0}", head=1)
    before = run.k_rows(range(8))
    run.op("seq_add", 0, 4, 8, -3)
    run.expect("0:p0{0} 4:p1{0}[-3] 5:p2{0}[-3] 6:p3{0}[-3] 7:p4{0}[-3]", head=0)  # nothing freed -> h0
    assert run.mem.v_cells[0].has_shift
    run.expect_seq(0, 0, 4)
    assert run.decode([(0, 5)]) == 0  # n_past 5
    run.expect("0:p0{0} 1:p5{0} 4:p1{0} 5:p2{0} 6:p3{0} 7:p4{0}", head=2)
    after = run.k_rows(range(8))
    assert_reroped(model, [b[4:] for b in before], [a[4:] for a in after], [-3] * 4)
    assert torch.equal(after[0][0], before[0][0]) and torch.equal(after[1][0], before[1][0])
    # Independent check of sign and composition: layer 0 keys of the same tokens roped at 1..4 directly.
    fresh = fresh_layer0_keys(model, [token(0, p) for p in range(4, 8)], [1, 2, 3, 4])
    torch.testing.assert_close(after[0][4:], fresh, rtol=0, atol=1e-5)
    # Shifts were reset: the decode after it runs no K-shift.
    shifted_rows = run.k_rows(range(8))
    n_kshift = sum(isinstance(e, ev.KShiftApplied) for e in run.events)
    assert n_kshift == 1
    assert run.decode([(0, 6)]) == 0
    run.expect("0:p0{0} 1:p5{0} 2:p6{0} 4:p1{0} 5:p2{0} 6:p3{0} 7:p4{0}", head=3)
    assert sum(isinstance(e, ev.KShiftApplied) for e in run.events) == n_kshift
    again = run.k_rows(range(8))
    assert all(torch.equal(a[[0, 1, 4, 5, 6, 7]], s[[0, 1, 4, 5, 6, 7]]) for a, s in zip(again, shifted_rows))


def test_s8_seq_div_quirk(model):
    run = Run(model)
    assert run.decode(seq_range(0, 0, 7)) == 0
    before = run.k_rows(range(4, 8))
    run.op("seq_div", 0, 4, 8, 2)
    # QUIRK (llama_kv_cells::pos_div): shift accumulates old - new (the opposite sign of pos_add).
    run.expect("0-3:p0-p3{0} 4:p2{0}[+2] 5:p2{0}[+3] 6:p3{0}[+3] 7:p3{0}[+4]", head=8)  # seq_div keeps the head
    run.expect_seq(0, 0, 3)
    # The next decode runs the update first (llama_context::decode calls memory->update before
    # init_batch); the cache is full, so it then returns 1, with the K-shift already applied and the
    # shifts reset.
    assert run.decode([(0, 4)]) == 1
    run.expect("0-3:p0-p3{0} 4:p2{0} 5:p2{0} 6:p3{0} 7:p3{0}", head=8)
    assert not run.mem.v_cells[0].has_shift
    after = run.k_rows(range(4, 8))
    assert_reroped(model, before, after, [2, 3, 3, 4])
    # So the keys sit at angles 6, 8, 9, 11 while the cells say 2, 2, 3, 3.
    tokens = [token(0, p) for p in range(4, 8)]
    torch.testing.assert_close(after[0], fresh_layer0_keys(model, tokens, [6, 8, 9, 11]), rtol=0, atol=1e-5)
    assert not torch.allclose(after[0], fresh_layer0_keys(model, tokens, [2, 2, 3, 3]), atol=1e-3)


def test_s9_non_contiguous_slot(model):
    run = Run(model)
    assert run.decode([(1, 0), (1, 1)] + seq_range(0, 0, 3)) == 0
    run.expect("0:p0{1} 1:p1{1} 2-5:p0-p3{0}", head=6)
    run.op("seq_rm", 1, -1, -1)
    run.expect("2-5:p0-p3{0}", head=0)
    assert run.decode(seq_range(0, 4, 7)) == 0
    assert run.mirror.last_decode.ubatch_sizes == (4,)
    run.expect("0:p4{0} 1:p5{0} 2-5:p0-p3{0} 6:p6{0} 7:p7{0}", head=8)
    run.expect_seq(0, 0, 7)


def split_run(model, **params) -> Run:
    """Two streams of 4 cells (n_ctx_seq = pad_to(8 // 2, 4))."""
    return Run(model, **{"n_ctx": 8, "pad": 4, "n_seq_max": 2, "kv_unified": False, **params})


def test_s11_split_streams(model):
    run = split_run(model)
    assert (run.mem.n_stream, run.mem.size, run.ctx.n_ubatch) == (2, 4, 8)
    assert "(     4 cells,   2 layers,  2/2 seqs)" in run.ctx.init_log_lines[-1]
    assert run.decode([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]) == 0
    # split_equal: U1 = s0p0, s0p1, s1p0, s1p1; U2 = s0p2
    assert run.mirror.last_decode.ubatch_sizes == (4, 1)
    allocated = [e for e in run.events if isinstance(e, ev.CellsAllocated) and not e.tentative]
    assert [[(c.stream, c.cells.tolist()) for c in e.changes] for e in allocated] == [[(0, [0, 1]), (1, [0, 1])],
                                                                                     [(0, [2])]]
    run.expect("0-2:p0-p2{0}", head=3, stream=0)
    run.expect("0-1:p0-p1{1}", head=2, stream=1)
    first = torch.arange(3)
    k_src = [r.stored_rows(0, first).clone() for r in run.mem.k]
    assert not any(torch.equal(r.stored_rows(1, first[:2]), s[:2]) for r, s in zip(run.mem.k, k_src))
    run.op("seq_cp", 0, 1, -1, -1)
    run.expect("0-2:p0-p2{0}", head=3, stream=0)
    run.expect("0-2:p0-p2{1}", head=3, stream=1)
    run.expect_seq(1, 0, 2)
    assert run.mem.pending_copies == [(0, 1)]
    # The copy runs at the next decode's start, before that decode places its token.
    assert run.decode([(1, 3)]) == 0
    assert run.mem.pending_copies == []
    assert [(e.src_stream, e.dst_stream) for e in run.events if isinstance(e, ev.StreamCopyExecuted)] == [(0, 1)]
    run.expect("0-3:p0-p3{1}", head=4, stream=1)
    run.expect("0-2:p0-p2{0}", head=3, stream=0)
    for r, s in zip(run.mem.k, k_src):
        assert torch.equal(r.stored_rows(1, first), s) and torch.equal(r.stored_rows(1, first), r.stored_rows(0, first))
    for v in run.mem.v:
        if v.transposed:
            assert torch.equal(v.data[1][:, :3], v.data[0][:, :3])
        else:
            assert torch.equal(v.stored_rows(1, first), v.stored_rows(0, first))


def test_s11_capacity_is_per_stream(model):
    run = split_run(model)
    assert run.decode(seq_range(0, 0, 3)) == 0
    run.expect("0-3:p0-p3{0}", head=4, stream=0)
    assert run.decode([(0, 4)]) == 1  # stream 1 is empty, but seq 0 can only use stream 0
    run.expect("0-3:p0-p3{0}", head=4, stream=0)
    run.expect("", head=0, stream=1)
    assert run.decode(seq_range(1, 0, 3)) == 0
    run.expect("0-3:p0-p3{1}", head=4, stream=1)


class AbortInSecondUbatch:
    """An abort callback: called before each layer of each ubatch (2 layers here), it returns True
    from its 3rd call on, i.e. at the start of the second ubatch. Inactive until armed."""

    def __init__(self) -> None:
        self.armed = False
        self.calls = 0

    def __call__(self) -> bool:
        if not self.armed:
            return False
        self.calls += 1
        return self.calls >= 3


def test_s15_mid_batch_abort(model):
    abort = AbortInSecondUbatch()
    run = Run(model, n_ubatch=2, abort_callback=abort)
    abort.armed = True
    assert run.decode(seq_range(0, 0, 3)) == 2
    # Second ubatch was applied (cells 2,3, h4), then seq_rm(0, 2, -1) -> h2.
    run.expect("0:p0{0} 1:p1{0}", head=2)
    run.expect_seq(0, 0, 1)
    applied = [e for e in run.events if isinstance(e, ev.CellsAllocated) and not e.tentative]
    assert [(e.changes[0].cells.tolist(), e.changes[0].head) for e in applied] == [([0, 1], 2), ([2, 3], 4)]
    cleanup = [e for e in run.events if isinstance(e, ev.CellsRemoved) and e.reason == "failure_cleanup"]
    assert [(e.seq_id, e.p0, e.p1) for e in cleanup] == [(0, 2, -1)]
    assert run.mirror.last_decode.rc == 2


def test_s15_abort_variant_head_shows_the_ubatch_was_applied(model):
    abort = AbortInSecondUbatch()
    run = Run(model, n_ubatch=2, abort_callback=abort)
    assert run.decode(seq_range(1, 0, 2)) == 0
    run.op("seq_rm", 1, 0, 2)
    run.expect("2:p2{1}", head=0)
    abort.armed = True
    assert run.decode(seq_range(0, 0, 3)) == 2
    # The second ubatch landed on 3,4 (h5); removing it frees 3 first -> h3, not 2.
    run.expect("0:p0{0} 1:p1{0} 2:p2{1}", head=3)


def test_abort_cleanup_uses_each_tokens_first_seq_id(model):
    """llama.cpp's decode cleanup keys pos_min by ubatch.seq_id[i][0] only (llama-context.cpp), so a
    coupled token's other seqs keep the cells of the aborted ubatch."""
    abort = AbortInSecondUbatch()
    run = Run(model, n_ubatch=2, abort_callback=abort)
    abort.armed = True
    assert run.decode(seq_range((0, 1), 0, 3)) == 2
    run.expect("0-1:p0-p1{0,1} 2-3:p2-p3{1}", head=4)  # nothing freed, so the head stays after the slot
    run.expect_seq(0, 0, 1)
    run.expect_seq(1, 0, 3)


# ---- further observations (full-attention caches) ------------------------------------------------------
def test_decode_seq_id_at_or_above_n_seq_max_is_invalid_even_unified(model):
    run = Run(model, n_seq_max=2)
    assert run.decode(seq_range(0, 0, 1)) == 0
    before = snapshot(run.ctx)
    assert run.decode([(5, 0)]) == -1
    assert "invalid seq_id[0][0] = 5 >= 2" in run.ctx.last_error
    assert run.decode([(2, 0)]) == -1
    assert_same_state(before, snapshot(run.ctx))


def test_unified_memory_ops_accept_seq_ids_up_to_255(model):
    run = Run(model, n_seq_max=2)
    assert run.decode(seq_range(0, 0, 3)) == 0
    run.op("seq_cp", 0, 255, -1, -1)
    run.expect("0-3:p0-p3{0,255}", head=4)
    run.expect_seq(255, 0, 3)
    run.op("seq_add", 255, 2, -1, 1)
    run.expect("0-1:p0-p1{0,255} 2:p3{0,255}[+1] 3:p4{0,255}[+1]", head=0)
    run.op("seq_div", 255, 3, -1, 2)
    run.op("seq_rm", 255, 0, 1)
    run.expect("0:p0{0} 1:p1{0,255} 2:p1{0,255}[+3] 3:p2{0,255}[+3]", head=0)
    run.op("seq_keep", 255)
    run.expect("1:p1{255} 2:p1{255}[+3] 3:p2{255}[+3]", head=0)
    for call in (lambda: run.mem.seq_cp(255, 256), lambda: run.mem.seq_rm(256), lambda: run.mem.seq_keep(256),
                 lambda: run.mem.seq_add(256, 0, -1, 1), lambda: run.mem.seq_div(256, 0, -1, 2)):
        run.refused(engine.MemoryOperationError, call)
    assert run.decode([(255, 3)]) == -1  # but decode still checks against n_seq_max


def test_coupled_tokens_with_split_streams_return_1(model):
    run = split_run(model)
    before = snapshot(run.ctx)
    assert run.decode(seq_range((0, 1), 0, 1)) == 1
    assert "failed to find a memory slot" in run.ctx.last_error
    assert_same_state(before, snapshot(run.ctx))
    # The same tokens are fine with a unified cache.
    assert Run(model, n_seq_max=2).decode(seq_range((0, 1), 0, 1)) == 0


def test_split_streams_small_n_ubatch_hold_n_ubatch_plus_1_seqs(model):
    run = Run(model, n_ctx=16, pad=4, n_seq_max=4, kv_unified=False, n_ubatch=2)
    assert (run.mem.n_stream, run.mem.size, run.ctx.n_ubatch) == (4, 4, 2)
    assert run.decode([(0, 0), (1, 0), (2, 0), (3, 0)]) == 0
    assert run.mirror.last_decode.ubatch_sizes == (3, 1)  # 3 = n_ubatch + 1 seqs, one token each
    for s in range(4):
        run.expect(f"0:p0{{{s}}}", head=1, stream=s)


@pytest.mark.parametrize("p0, p1", [(1, -1), (0, 2), (-1, 1), (2, 3)])
def test_partial_range_cross_stream_seq_cp_is_refused(model, p0, p1):
    run = split_run(model)
    assert run.decode([(0, 0), (0, 1), (0, 2), (1, 0)]) == 0
    run.refused(engine.MemoryOperationError, lambda: run.mem.seq_cp(0, 1, p0, p1))
    run.expect("0:p0{1}", head=1, stream=1)


@pytest.mark.parametrize("p0, p1", [(-1, -1), (0, 0), (3, -1), (0, 3), (5, 9)])
def test_full_range_cross_stream_seq_cp_ignores_the_range(model, p0, p1):
    """p0 <= 0 or p0 >= kv_size - 1, likewise p1, counts as "full"; the whole stream is then copied."""
    run = split_run(model)
    assert run.decode([(0, 0), (0, 1), (0, 2), (1, 0)]) == 0
    run.op("seq_cp", 0, 1, p0, p1)
    run.expect("0-2:p0-p2{1}", head=3, stream=1)
    assert run.mem.pending_copies == [(0, 1)]


def test_cross_stream_seq_cp_keeps_pending_shifts(model):
    run = split_run(model)
    assert run.decode(seq_range(0, 0, 2)) == 0
    run.op("seq_add", 0, 1, -1, 5)
    run.op("seq_cp", 0, 1, -1, -1)
    run.expect("0:p0{1} 1:p6{1}[+5] 2:p7{1}[+5]", head=0, stream=1)
    assert run.mem.v_cells[1].has_shift


@pytest.mark.parametrize("call", [
    lambda m: m.seq_rm(2, -1, -1), lambda m: m.seq_cp(0, 2, -1, -1), lambda m: m.seq_cp(2, 0, -1, -1),
    lambda m: m.seq_keep(2), lambda m: m.seq_add(2, 0, -1, 1), lambda m: m.seq_div(2, 0, -1, 2),
    lambda m: m.seq_add(255, 0, -1, 1), lambda m: m.seq_pos_max(2),
], ids=["seq_rm", "seq_cp_dst", "seq_cp_src", "seq_keep", "seq_add", "seq_div", "seq_add_255", "seq_pos_max"])
def test_split_stream_memory_ops_refuse_seq_ids_at_or_above_n_seq_max(model, call):
    run = split_run(model)
    assert run.decode([(0, 0), (0, 1), (1, 0)]) == 0
    run.refused(engine.MemoryOperationError, lambda: call(run.mem))


def test_batch_larger_than_n_batch_is_refused(model):
    run = Run(model, n_batch=4)
    assert run.ctx.n_batch == 4
    assert run.decode(seq_range(0, 0, 1)) == 0
    run.op("seq_add", 0, 1, -1, 1)  # a pending K-shift must not run either
    run.refused(engine.BatchTooLargeError, lambda: run.ctx.decode(make_batch(seq_range(0, 3, 7))))
    assert run.mem.v_cells[0].has_shift
    assert run.decode(seq_range(0, 3, 6)) == 0  # n_batch tokens are fine


def test_same_stream_seq_cp_into_a_seq_already_sharing_cells_is_refused(model):
    run = Run(model)
    assert run.decode(seq_range(0, 0, 3)) == 0
    run.op("seq_cp", 0, 1, -1, -1)
    run.refused(engine.MemoryOperationError, lambda: run.mem.seq_cp(0, 1, -1, -1))
    run.refused(engine.MemoryOperationError, lambda: run.mem.seq_cp(0, 1, 3, 4))
    # Atomic: seq 1 shares only cell 3 now; a copy over the whole range must not add it to 0-2 either.
    run.op("seq_rm", 1, 0, 3)
    run.expect("0-2:p0-p2{0} 3:p3{0,1}", head=4)
    run.refused(engine.MemoryOperationError, lambda: run.mem.seq_cp(0, 1, -1, -1))
    run.op("seq_cp", 0, 1, 0, 3)  # the cells it does not share yet are fine
    run.expect("0-3:p0-p3{0,1}", head=4)
    run.op("seq_cp", 0, 0, -1, -1)  # src == dst: no-op
    run.expect("0-3:p0-p3{0,1}", head=4)


# ---- details of the seq_* operations and update the scenarios rely on ---------------------------------
def test_seq_add_full_range_with_negative_bounds(model):
    """p0 < 0 -> 0 and p1 < 0 -> +inf are applied before the empty-range check (llama.cpp)."""
    run = Run(model)
    assert run.decode(seq_range(0, 0, 3)) == 0
    run.op("seq_add", 0, -1, -1, 2)
    run.expect("0-3:p2-p5{0}[+2]", head=0)
    run.op("seq_div", 0, -1, -1, 2)
    run.expect("0:p1{0}[+3] 1:p1{0}[+4] 2:p2{0}[+4] 3:p2{0}[+5]", head=0)
    assert run.decode([(0, 3)]) == 0
    run.expect("0:p1{0} 1:p1{0} 2:p2{0} 3:p2{0} 4:p3{0}", head=5)
    # [0, 0) after clamping is empty: a no-op that leaves the head alone.
    run.op("seq_add", 0, -1, 0, 7)
    run.expect("0:p1{0} 1:p1{0} 2:p2{0} 3:p2{0} 4:p3{0}", head=5)


def test_seq_add_with_nothing_in_range_resets_the_head_but_sets_no_shift(model):
    """llama.cpp's has_shift is set per moved cell (pos_add), so nothing in range -> no K-shift later."""
    run = s1_prefill(model)
    run.op("seq_add", 0, 100, -1, 1)
    run.expect("0-4:p0-p4{0}", head=0)
    run.op("seq_add", 3, -1, -1, 1)  # a seq absent from the cache: head 0 too
    run.op("seq_div", 0, 100, -1, 2)
    run.expect("0-4:p0-p4{0}", head=0)
    assert not run.mem.v_cells[0].has_shift and not run.mem.pending_copies
    assert run.decode([(0, 5)]) == 0
    assert not any(isinstance(e, ev.KShiftApplied) for e in run.events)


def test_swa_purge_does_not_pull_the_head_back():
    """apply_ubatch sets head = last slot cell + 1 AFTER the SWA purge (llama.cpp), so a cell the purge
    frees below the slot does not steer the next ubatch's find_slot. Driven on a bare SWA KVCache."""
    from engine.batch import BatchAllocator
    from engine.kv.cache import CacheLayout, KVCache
    from engine.kv.swa import SwaType
    from engine.kv.types import cache_type

    layout = CacheLayout(layer_ids=(0,), n_embd_k=16, n_embd_v=16, n_head_kv=2, head_dim=8, kv_size=8, n_stream=1,
                         n_seq_max=1, type_k=cache_type("f32"), type_v=cache_type("f32"), v_trans=False, pad=8,
                         n_swa=2, swa_type=SwaType.STANDARD)
    cache = KVCache(layout, bus=engine.EventBus(), key_shifter=lambda il, k, d: k)

    def place(entries, n_ubatch):
        alloc = BatchAllocator(make_batch(entries), n_vocab=64, n_seq_max=1, memory=cache)
        ubatches = []
        while not alloc.all_used():
            ubatches.append(alloc.split_simple(n_ubatch))
        slots = cache.prepare(ubatches)
        for sinfo, ub in zip(slots, ubatches):
            cache.apply_ubatch(sinfo, ub)

    place(seq_range(0, 0, 7), 8)
    cache.seq_rm(0, 0, 2)
    cache.seq_add(0, 3, 4, -10)  # cell 3 goes below 0: head 3
    assert cache.cells() == table("2:p2{0} 4-7:p4-p7{0}") and cache.head() == 3
    # Dry run: A = pos 8,9 -> [3, 4] (cell 4 masked), purge [2, 4] frees cell 2, head 5; B = pos 10 -> cell 5
    # (p5 masked). With the head pulled back to the freed cell 2, B would have gone to cell 2 instead.
    place(seq_range(0, 8, 10), 2)
    assert cache.cells() == table("3:p8{0} 4:p9{0} 5:p10{0} 6:p6{0} 7:p7{0}")
    assert cache.head() == 6
