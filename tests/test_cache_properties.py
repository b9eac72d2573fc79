"""Property tests of the KV cache against an independent model of llama.cpp's rules (src/llama-kv-cells.h,
src/llama-kv-cache.cpp, src/llama-batch.cpp, src/llama-context.cpp).

Three layers:
- `RefCache`: a small, independent pure-Python model of the cell metadata, written from llama.cpp's
  llama_kv_cells (pos, seq, shift, has_shift), llama_kv_cache's seq_* operations, update, find_slot,
  apply_ubatch and prepare, llama_batch_allocr::split_simple / split_equal and the decode return codes
  of llama_context::decode (not from engine code). It tracks pos / seq set / shift per cell, the heads
  and has_shift, and decodes through those splits, find_slot and apply.
- `CacheMachine`: a hypothesis state machine that drives a real `Context` (tiny in-memory llama)
  and the reference side by side with random decodes and sequence operations, on 8-16 cell caches
  (unified and split streams, 2-3 seqs, n_ubatch 1-8), and checks after every step that engine,
  reference and event mirror agree cell for cell, plus the structural invariants.
- The scenarios of tests/test_scenarios.py replayed on the reference, and regression tests that pin
  engine bugs found by the machine.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import engine
from engine.errors import MemoryOperationError
from tests.cell_checks import assert_cell_invariants
from tests.model_factory import in_memory_model

INF = float("inf")
MODEL = in_memory_model()


# ---- reference model of llama.cpp's rules, independent of engine code --------------------------------


class RefError(Exception):
    """An operation kvscope refuses, leaving the state unchanged, where llama.cpp would abort on a
    GGML_ASSERT (docs/deviations-from-llama-cpp.md)."""


class RefStream:
    def __init__(self, size: int) -> None:
        self.pos = [-1] * size
        self.seq: list[set[int]] = [set() for _ in range(size)]
        self.shift = [0] * size
        self.head = 0
        self.has_shift = False

    def rm(self, i: int) -> None:
        self.pos[i], self.seq[i], self.shift[i] = -1, set(), 0

    def used(self) -> int:
        return sum(p >= 0 for p in self.pos)

    def cells(self) -> list[tuple[int, frozenset[int], int]]:
        return [(p, frozenset(s), sh) for p, s, sh in zip(self.pos, self.seq, self.shift)]


class RefCache:
    def __init__(self, size: int, n_stream: int, n_seq_max: int) -> None:
        self.size, self.n_stream, self.n_seq_max = size, n_stream, n_seq_max
        self.streams = [RefStream(size) for _ in range(n_stream)]

    def check_seq(self, s: int) -> None:  # split streams map only seq ids < n_seq_max to a stream (seq_to_stream)
        if not 0 <= s < (256 if self.n_stream == 1 else self.n_seq_max):
            raise RefError(f"invalid seq {s}")

    def st(self, s: int) -> RefStream:
        return self.streams[0 if self.n_stream == 1 else s]

    def positions(self, s: int) -> list[int]:
        c = self.st(s)
        return [c.pos[i] for i in range(self.size) if s in c.seq[i]]

    def pos_min(self, s: int) -> int:
        return min(self.positions(s), default=-1)

    def pos_max(self, s: int) -> int:
        return max(self.positions(s), default=-1)

    @staticmethod
    def rng(p0: int, p1: int) -> tuple[float, float]:  # llama_kv_cache::seq_*: p0 < 0 -> 0, p1 < 0 -> +inf
        return (0 if p0 < 0 else p0), (INF if p1 < 0 else p1)

    # llama_kv_cache::seq_rm, seq_cp, seq_keep, seq_add, seq_div (src/llama-kv-cache.cpp)
    def seq_rm(self, s: int, p0: int, p1: int) -> bool:
        if s != -1:
            self.check_seq(s)
        lo, hi = self.rng(p0, p1)
        for c in (self.streams if s == -1 else [self.st(s)]):
            freed = []
            for i in range(self.size):
                if c.pos[i] >= 0 and lo <= c.pos[i] < hi and (s == -1 or s in c.seq[i]):
                    c.seq[i].discard(s)
                    if s == -1 or not c.seq[i]:
                        c.rm(i)
                        freed.append(i)
            if freed and freed[0] < c.head:
                c.head = freed[0]
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.check_seq(src)
        self.check_seq(dst)
        a, b = self.st(src), self.st(dst)
        if a is b:
            if src == dst:
                return
            lo, hi = self.rng(p0, p1)
            idxs = [i for i in range(self.size) if src in a.seq[i] and lo <= a.pos[i] < hi]
            if any(dst in a.seq[i] for i in idxs):
                raise RefError("dst already shares cells with src")
            for i in idxs:
                a.seq[i].add(dst)
            return
        last = self.size - 1
        if not all(p <= 0 or p >= last for p in (p0, p1)):
            raise RefError("partial cross-stream copy")
        b.__init__(self.size)  # the destination stream is reset
        for i in range(self.size):
            if src in a.seq[i]:
                # un-shifted position, then the pending shift re-applied: pos/shift equal the source's
                b.pos[i], b.seq[i], b.shift[i] = a.pos[i], {dst}, a.shift[i]
                b.has_shift |= a.shift[i] != 0
        b.head = a.head

    def seq_keep(self, s: int) -> None:
        self.check_seq(s)
        c = self.st(s)
        freed = []
        for i in range(self.size):
            if s in c.seq[i]:
                c.seq[i] = {s}
            elif c.pos[i] >= 0:
                c.rm(i)
                freed.append(i)
        if freed and freed[0] < c.head:
            c.head = freed[0]

    def seq_add(self, s: int, p0: int, p1: int, d: int) -> None:
        self.check_seq(s)
        lo, hi = self.rng(p0, p1)
        if d == 0 or lo == hi:
            return
        c, freed = self.st(s), []
        for i in range(self.size):
            if s in c.seq[i] and lo <= c.pos[i] < hi:
                c.pos[i] += d
                c.shift[i] += d
                c.has_shift = True
                if c.pos[i] < 0:
                    c.rm(i)
                    freed.append(i)
        c.head = freed[0] if freed else 0

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        self.check_seq(s)
        lo, hi = self.rng(p0, p1)
        if d == 1 or lo == hi:
            return
        c = self.st(s)
        for i in range(self.size):
            if s in c.seq[i] and lo <= c.pos[i] < hi:
                old = c.pos[i]
                c.pos[i] = old // d
                c.shift[i] += old - c.pos[i]  # QUIRK sign: llama_kv_cells::pos_div adds old - new
                c.has_shift = True

    def clear(self) -> None:
        for c in self.streams:
            c.__init__(self.size)

    # llama_kv_cache::update: stream copies touch only data; the K-shift resets every shift
    def update(self) -> None:
        if any(c.has_shift for c in self.streams):
            for c in self.streams:
                c.shift = [0] * self.size
                c.has_shift = False

    # llama_batch_allocr::split_simple / split_equal (src/llama-batch.cpp); a token is (pos, seq ids)
    @staticmethod
    def split_simple(toks, n_ubatch):
        return [toks[i:i + n_ubatch] for i in range(0, len(toks), n_ubatch)]

    @staticmethod
    def split_equal_sequential(toks, n_ubatch):
        if any(len(t[1]) > 1 for t in toks):
            return None  # coupled seqs need a unified cache
        left, out = list(toks), []
        while left:
            sets = []
            for _, ids in left:
                if ids[0] not in sets and (not sets or ids[0] == sets[-1] + 1):
                    sets.append(ids[0])
                    if len(sets) > n_ubatch:  # split_equal's check lets n_ubatch + 1 seqs in
                        break
            per = {s: [t for t in left if t[1][0] == s] for s in sets}
            rounds = 0
            while all(rounds < len(per[s]) for s in sets):
                rounds += 1
                if (rounds + 1) * len(sets) > n_ubatch:
                    break
            ub = [t for s in sorted(sets) for t in per[s][:rounds]]
            taken = {id(t) for t in ub}
            left = [t for t in left if id(t) not in taken]
            out.append(ub)
        return out

    # llama_kv_cache::find_slot / apply_ubatch
    def find_slot(self, c: RefStream, n: int):
        h = 0 if c.head > c.used() + 2 * n else c.head
        if n > self.size:
            return None
        idxs = [(h + k) % self.size for k in range(self.size) if c.pos[(h + k) % self.size] < 0]
        return idxs[:n] if len(idxs) >= n else None

    def find_slots(self, ub):
        """find_slot for every stream group of the ubatch: [(stream id, tokens, cells)], or None when a
        group does not fit."""
        if self.n_stream == 1:
            groups = [(0, ub)]
        else:
            groups = [(s, [t for t in ub if t[1][0] == s]) for s in sorted({t[1][0] for t in ub})]
        slots = [self.find_slot(self.streams[s], len(g)) for s, g in groups]
        if any(sl is None for sl in slots):
            return None
        return [(s, g, sl) for (s, g), sl in zip(groups, slots)]

    def apply(self, placed) -> None:
        for s, g, sl in placed:
            c = self.streams[s]
            for i, (p, ids) in zip(sl, g):
                c.pos[i], c.seq[i] = p, set(ids)
            c.head = sl[-1] + 1

    def prepare(self, ubs):
        """llama_kv_cache::prepare, a dry run on a copy: the slots of every ubatch, or None when one does
        not fit. Either way the heads are restored as llama.cpp restores them (QUIRK "heads after the dry
        run"): newest first, stream strm[k] of a ubatch's slot gets the old head at INDEX k."""
        trial = copy.deepcopy(self)
        saved, plan = [], []
        for ub in ubs:
            placed = trial.find_slots(ub)
            if placed is None:
                break
            saved.append(([s for s, _, _ in placed], [c.head for c in trial.streams]))
            trial.apply(placed)
            plan.append(placed)
        for streams, heads_old in reversed(saved):
            for k, s in enumerate(streams):
                self.streams[s].head = heads_old[k]
        return plan if len(plan) == len(ubs) else None

    def decode(self, toks, n_ubatch: int, abort_ubatch: int | None = None) -> int:
        """toks: list of (pos, tuple of seq ids), a valid batch. Returns 0, 1, or 2 when the forward
        pass of ubatch number `abort_ubatch` is aborted (llama_context::decode)."""
        self.update()
        ubs = (self.split_simple(toks, n_ubatch) if self.n_stream == 1
               else self.split_equal_sequential(toks, n_ubatch))
        if ubs is None:
            return 1
        plan = self.prepare(ubs)
        if plan is None:
            return 1
        n_run = len(ubs) if abort_ubatch is None else min(abort_ubatch + 1, len(ubs))
        for placed in plan[:n_run]:  # the real apply reuses the dry run's slots
            self.apply(placed)
        if abort_ubatch is None or abort_ubatch >= len(ubs):
            return 0
        p_min: dict[int, int] = {}  # the failing ubatch was applied, then each of its seqs
        for p, ids in ubs[abort_ubatch]:  # loses [its smallest pos in that ubatch, +inf); llama.cpp
            p_min[ids[0]] = min(p_min.get(ids[0], p), p)  # keys this by each token's FIRST seq id only
        for q, p in sorted(p_min.items()):
            self.seq_rm(q, p, -1)
        return 2


# ---- helpers -----------------------------------------------------------------------------------


def make_ctx(kv_size: int, *, unified: bool, n_seq_max: int, n_ubatch: int, pad: int = 8):
    bus = engine.EventBus()
    mirror = engine.CacheMirror()
    mirror.attach(bus)
    n_ctx = kv_size if unified else kv_size * n_seq_max
    ctx = engine.Context(MODEL, n_ctx=n_ctx, pad=pad, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                         kv_unified=unified, bus=bus)
    assert ctx.memory.size == kv_size
    return ctx, mirror


def batch_of(toks, explicit_pos: bool = True) -> engine.Batch:
    return engine.Batch([1 + (p % 50) for p, _ in toks], [p for p, _ in toks] if explicit_pos else None,
                        [list(ids) for _, ids in toks])


def engine_state(ctx):
    mem = ctx.memory
    return ([mem.cells(s) for s in range(mem.n_stream)], [mem.head(s) for s in range(mem.n_stream)],
            [c.has_shift for c in mem.v_cells])


def ref_state(ref: RefCache):
    return ([c.cells() for c in ref.streams], [c.head for c in ref.streams], [c.has_shift for c in ref.streams])


def memberships(ctx) -> Counter:
    out = Counter()
    for s in range(ctx.memory.n_stream):
        for p, seqs, _ in ctx.memory.cells(s):
            out.update((s, q, p) for q in seqs)
    return out


def assert_structural(ctx, mirror, seq_ids) -> None:
    mem = ctx.memory
    mirror.sync()
    for s in range(mem.n_stream):
        cells = mem.cells(s)
        assert_cell_invariants(cells)
        assert mem.used(s) == sum(p >= 0 for p, _, _ in cells)
        assert 0 <= mem.head(s) <= mem.size
        assert mirror.cells(s) == cells, f"mirror differs from the engine in stream {s}"
        assert mirror.head(s) == mem.head(s), f"mirror head differs in stream {s}"
    for q in seq_ids:
        st_ = mem.seq_to_stream(q)
        pos = [p for p, seqs, _ in mem.cells(st_) if q in seqs]
        assert mem.seq_pos_min(q) == min(pos, default=-1)
        assert mem.seq_pos_max(q) == max(pos, default=-1)


# ---- the state machine -------------------------------------------------------------------------


CONFIGS = st.fixed_dictionaries({
    "kv_size": st.sampled_from([8, 12, 16]),
    "unified": st.booleans(),
    "n_seq_max": st.integers(2, 3),
    "n_ubatch": st.integers(1, 8),
})


class CacheMachine(RuleBasedStateMachine):
    """Engine, reference and mirror side by side; any disagreement is a failure."""

    @initialize(cfg=CONFIGS)
    def setup(self, cfg):
        self.cfg = cfg
        pad = 4 if cfg["kv_size"] == 12 else 8
        self.ctx, self.mirror = make_ctx(cfg["kv_size"], unified=cfg["unified"], n_seq_max=cfg["n_seq_max"],
                                         n_ubatch=cfg["n_ubatch"], pad=pad)
        self.ref = RefCache(cfg["kv_size"], 1 if cfg["unified"] else cfg["n_seq_max"], cfg["n_seq_max"])
        # unified memory ops accept any id < 256 (LLAMA_MAX_SEQ); one extra id exercises that
        self.op_seqs = list(range(cfg["n_seq_max"] + (1 if cfg["unified"] else 0)))

    # -- strategies that depend on the state
    def _p(self, data, label):
        known = sorted({p for c in self.ref.streams for p in c.pos if p >= 0}) or [0]
        return data.draw(st.one_of(st.just(-1), st.sampled_from(known), st.integers(-2, known[-1] + 2)),
                         label=label)

    def _seq(self, data, label):
        return data.draw(st.sampled_from(self.op_seqs), label=label)

    def _expect(self, op, *args):
        """Run op on the reference and the engine; a RefError means the engine must refuse and change nothing."""
        before = engine_state(self.ctx)
        try:
            expected = getattr(self.ref, op)(*args)
        except RefError:
            with pytest.raises(MemoryOperationError):
                getattr(self.ctx.memory, op)(*args)
            assert engine_state(self.ctx) == before, f"a refused {op}{args} changed the cache"
            return
        got = getattr(self.ctx.memory, op)(*args)
        if op == "seq_rm":
            assert got is True and expected is True

    # -- rules
    @rule(data=st.data())
    def decode(self, data):
        n_seq_max, unified = self.cfg["n_seq_max"], self.cfg["unified"]
        chosen = data.draw(st.lists(st.sampled_from(range(n_seq_max)), min_size=1, max_size=n_seq_max,
                                    unique=True), label="seqs")
        groups = [(s,) for s in chosen]
        if len(chosen) >= 2 and data.draw(st.booleans(), label="couple"):
            buckets: dict = {}
            for s in chosen:
                buckets.setdefault((self.ref.pos_min(s), self.ref.pos_max(s)), []).append(s)
            best = max(buckets.values(), key=len)
            if len(best) >= 2:
                cpl = tuple(data.draw(st.permutations(best), label="coupled order"))
                groups = [cpl] + [(s,) for s in chosen if s not in best]
        budget = self.ctx.n_batch
        counts = []
        for _ in groups:
            n = data.draw(st.integers(1, 6), label="n_tokens") if budget > 0 else 0
            n = min(n, budget)
            budget -= n
            counts.append(n)
        labels = data.draw(st.permutations([g for g, n in enumerate(counts) for _ in range(n)]), label="order")
        nxt = [self.ref.pos_max(g[0]) + 1 for g in groups]
        toks = []
        for g in labels:
            toks.append((nxt[g], groups[g]))
            nxt[g] += 1
        explicit_pos = data.draw(st.booleans(), label="explicit pos")
        pre_update = data.draw(st.booleans(), label="update first")
        # sometimes abort the forward pass of one ubatch (each ubatch asks once per layer)
        abort_ub = data.draw(st.one_of(st.none(), st.integers(0, 3)), label="abort ubatch")
        if pre_update:
            self.ctx.memory.update()
            self.ref.update()
        before_cells, _, before_shift = engine_state(self.ctx)
        if any(before_shift):  # decode starts with the K-shift, which only zeroes the shifts
            before_cells = [[(p, seqs, 0) for p, seqs, _ in cells] for cells in before_cells]
        before_m = memberships(self.ctx)
        expected = self.ref.decode(toks, self.cfg["n_ubatch"], abort_ub)
        calls = iter(range(10 ** 6))
        n_layer = MODEL.config.n_layer
        self.ctx.abort_callback = None if abort_ub is None else (lambda: next(calls) == abort_ub * n_layer)
        try:
            rc = self.ctx.decode(batch_of(toks, explicit_pos))
        finally:
            self.ctx.abort_callback = None
        assert rc == expected, f"decode rc {rc}, reference {expected}: {toks}"
        after_cells, _, _ = engine_state(self.ctx)
        if rc == 1:  # the heads may move (QUIRK "heads after the dry run"); agrees() checks them
            assert after_cells == before_cells, "rc 1 must change no cell"
        if rc == 0:
            st_ = self.ctx.memory.seq_to_stream
            added = Counter((st_(q), q, p) for p, ids in toks for q in ids)
            assert memberships(self.ctx) == before_m + added, "rc 0 must add exactly the batch's memberships"
        if not unified and any(len(g) > 1 for g in groups):
            assert rc == 1, "coupled seqs with split streams return 1 (no ubatch of split_equal takes them)"

    @rule(data=st.data())
    def invalid_decode(self, data):
        """rc -1: the state is untouched; not even the pending update runs (llama_context::decode checks
        the batch with llama_batch_allocr::init before memory->init_batch)."""
        kind = data.draw(st.sampled_from(["gap", "seq", "token"]), label="invalid kind")
        s = data.draw(st.sampled_from(range(self.cfg["n_seq_max"])), label="seq")
        p = self.ref.pos_max(s) + 1
        if kind == "gap":
            if p == 0:
                return
            batch = engine.Batch([1], [p + 1], [[s]])
        elif kind == "seq":
            batch = engine.Batch([1], [0], [[self.cfg["n_seq_max"]]])
        else:
            batch = engine.Batch([1, MODEL.n_vocab], [p, p + 1], [[s], [s]])
        before = engine_state(self.ctx), list(self.ctx.memory.pending_copies)
        assert self.ctx.decode(batch) == -1
        assert (engine_state(self.ctx), self.ctx.memory.pending_copies) == before

    @rule(data=st.data())
    def seq_rm(self, data):
        s = data.draw(st.sampled_from([-1] + self.op_seqs), label="seq")
        self._expect("seq_rm", s, self._p(data, "p0"), self._p(data, "p1"))

    @rule(data=st.data())
    def seq_cp(self, data):
        src, dst = self._seq(data, "src"), self._seq(data, "dst")
        if not self.cfg["unified"] and src != dst and data.draw(st.booleans(), label="full range"):
            p0, p1 = -1, -1
        else:
            p0, p1 = self._p(data, "p0"), self._p(data, "p1")
        self._expect("seq_cp", src, dst, p0, p1)

    @rule(data=st.data())
    def seq_keep(self, data):
        self._expect("seq_keep", self._seq(data, "seq"))

    @rule(data=st.data())
    def seq_add(self, data):
        s = self._seq(data, "seq")
        p0, p1 = self._p(data, "p0"), self._p(data, "p1")
        # often drop the seq's first position below 0: the head then jumps to the freed cell, which
        # is how slots come to wrap and the restart heuristic of find_slot fires
        drop_front = -(self.ref.pos_min(s) + 1) if self.ref.pos_min(s) >= 0 and p0 <= 0 else 0
        d = data.draw(st.one_of(st.integers(-6, 4), st.just(drop_front)), label="delta")
        self._expect("seq_add", s, p0, p1, d)

    @rule(data=st.data())
    def seq_div(self, data):
        d = data.draw(st.integers(1, 3), label="d")
        self._expect("seq_div", self._seq(data, "seq"), self._p(data, "p0"), self._p(data, "p1"), d)

    @precondition(lambda self: not self.cfg["unified"])
    @rule(data=st.data())
    def op_on_foreign_seq(self, data):
        """Split streams: seq ids >= n_seq_max are refused with the state unchanged (llama.cpp aborts on
        the GGML_ASSERT of seq_to_stream)."""
        op = data.draw(st.sampled_from(["seq_rm", "seq_keep", "seq_add", "seq_div", "seq_cp"]), label="op")
        bad = self.cfg["n_seq_max"]
        args = {"seq_rm": (bad, -1, -1), "seq_keep": (bad,), "seq_add": (bad, -1, -1, 1),
                "seq_div": (bad, -1, -1, 2), "seq_cp": (0, bad, -1, -1)}[op]
        self._expect(op, *args)

    @rule()
    def clear(self):
        self.ctx.memory.clear()
        self.ref.clear()

    # -- checked after every step
    @invariant()
    def agrees(self):
        assert_structural(self.ctx, self.mirror, self.op_seqs)
        assert engine_state(self.ctx) == ref_state(self.ref), "engine and reference disagree"


CacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.filter_too_much])
TestCacheMachine = CacheMachine.TestCase


# ---- the reference against the scenarios of tests/test_scenarios.py ------------------------------


def _both(kv_size, *, unified=True, n_seq_max=3, n_ubatch=8):
    ctx, mirror = make_ctx(kv_size, unified=unified, n_seq_max=n_seq_max, n_ubatch=n_ubatch)
    return ctx, mirror, RefCache(kv_size, 1 if unified else n_seq_max, n_seq_max)


def _decode_both(ctx, ref, toks, n_ubatch=8):
    exp = ref.decode(toks, n_ubatch)
    assert ctx.decode(batch_of(toks)) == exp
    assert engine_state(ctx) == ref_state(ref)
    return exp


def _seq(s, p0, p1):
    return [(p, (s,)) for p in range(p0, p1)]


def _cells(ref_or_ctx, stream=0):
    if isinstance(ref_or_ctx, RefCache):
        cells = ref_or_ctx.streams[stream].cells()
    else:
        cells = ref_or_ctx.memory.cells(stream)
    return {i: (p, set(s), sh) for i, (p, s, sh) in enumerate(cells) if p >= 0}


def test_s2_atomic_failure():
    ctx, _, ref = _both(8, n_ubatch=2)
    assert _decode_both(ctx, ref, _seq(0, 0, 5), 2) == 0
    assert _decode_both(ctx, ref, _seq(0, 5, 6), 2) == 0
    assert _decode_both(ctx, ref, _seq(1, 0, 4), 2) == 1
    assert ref.streams[0].head == 6
    assert _decode_both(ctx, ref, _seq(1, 0, 2), 2) == 0
    assert _cells(ref)[6] == (0, {1}, 0) and _cells(ref)[7] == (1, {1}, 0) and ref.streams[0].head == 8


def test_s3_shared_prefix_and_shift():
    ctx, _, ref = _both(8)
    _decode_both(ctx, ref, _seq(0, 0, 4))
    for x in (ctx.memory, ref):
        x.seq_cp(0, 1, -1, -1)
    _decode_both(ctx, ref, _seq(1, 4, 5))
    _decode_both(ctx, ref, _seq(0, 4, 5))
    for x in (ctx.memory, ref):
        x.seq_rm(0, 2, -1)
    assert ref.streams[0].head == 5
    for x in (ctx.memory, ref):
        x.seq_add(1, 0, 2, 10)
    assert engine_state(ctx) == ref_state(ref)
    assert _cells(ref) == {0: (10, {0, 1}, 10), 1: (11, {0, 1}, 10), 2: (2, {1}, 0), 3: (3, {1}, 0),
                           4: (4, {1}, 0)}
    assert ref.streams[0].head == 0 and (ref.pos_min(0), ref.pos_max(0), ref.pos_min(1)) == (10, 11, 2)


def test_s5_seq_rm_all_seqs_leaves_gap():
    ctx, _, ref = _both(8)
    toks = [(0, (0,)), (1, (0,)), (0, (1,)), (1, (1,)), (2, (0,)), (2, (1,)), (3, (0,))]
    _decode_both(ctx, ref, toks)
    for x in (ctx.memory, ref):
        x.seq_rm(-1, 1, 3)
    assert engine_state(ctx) == ref_state(ref)
    assert _cells(ref) == {0: (0, {0}, 0), 2: (0, {1}, 0), 6: (3, {0}, 0)} and ref.streams[0].head == 1
    _decode_both(ctx, ref, [(1, (1,))])
    assert ref.streams[0].head == 2


def test_s6_seq_keep():
    ctx, _, ref = _both(8)
    _decode_both(ctx, ref, [(0, (0, 1)), (1, (0, 1))])
    _decode_both(ctx, ref, [(2, (1,)), (2, (0,)), (0, (2,))])
    for x in (ctx.memory, ref):
        x.seq_keep(1)
    assert engine_state(ctx) == ref_state(ref)
    assert _cells(ref) == {0: (0, {1}, 0), 1: (1, {1}, 0), 2: (2, {1}, 0)} and ref.streams[0].head == 3


def test_s7_context_shift():
    ctx, _, ref = _both(8)
    _decode_both(ctx, ref, _seq(0, 0, 8))
    for x in (ctx.memory, ref):
        x.seq_rm(0, 1, 4)
        x.seq_add(0, 4, 8, -3)
    assert engine_state(ctx) == ref_state(ref) and ref.streams[0].head == 0
    _decode_both(ctx, ref, _seq(0, 5, 6))
    assert _cells(ref) == {0: (0, {0}, 0), 1: (5, {0}, 0), 4: (1, {0}, 0), 5: (2, {0}, 0), 6: (3, {0}, 0),
                           7: (4, {0}, 0)} and ref.streams[0].head == 2


def test_s8_seq_div_quirk_sign():
    ctx, _, ref = _both(8)
    _decode_both(ctx, ref, _seq(0, 0, 8))
    for x in (ctx.memory, ref):
        x.seq_div(0, 4, 8, 2)
    assert engine_state(ctx) == ref_state(ref)
    assert [ref.streams[0].cells()[i][::2] for i in range(4, 8)] == [(2, 2), (2, 3), (3, 3), (3, 4)]
    assert ref.streams[0].head == 8


def test_s9_non_contiguous_slot():
    ctx, _, ref = _both(8)
    _decode_both(ctx, ref, _seq(1, 0, 2) + _seq(0, 0, 4))
    for x in (ctx.memory, ref):
        x.seq_rm(1, -1, -1)
    _decode_both(ctx, ref, _seq(0, 4, 8))
    assert {i: c[0] for i, c in _cells(ref).items()} == {0: 4, 1: 5, 2: 0, 3: 1, 4: 2, 5: 3, 6: 6, 7: 7}
    assert ref.streams[0].head == 8


def test_s11_split_streams():
    ctx, _, ref = _both(8, unified=False, n_seq_max=2)
    _decode_both(ctx, ref, _seq(0, 0, 3) + _seq(1, 0, 2))
    assert (ref.streams[0].head, ref.streams[1].head) == (3, 2)
    for x in (ctx.memory, ref):
        x.seq_cp(0, 1, -1, -1)
    assert engine_state(ctx) == ref_state(ref)
    assert _cells(ref, 1) == {i: (i, {1}, 0) for i in range(3)} and ref.streams[1].head == 3
    assert ctx.memory.pending_copies == [(0, 1)]
    # capacity is per stream
    ctx, _, ref = _both(8, unified=False, n_seq_max=2)
    assert _decode_both(ctx, ref, _seq(0, 0, 8)) == 0
    assert _decode_both(ctx, ref, _seq(0, 8, 9)) == 1
    assert _decode_both(ctx, ref, _seq(1, 0, 4)) == 0


def test_s15_abort_in_second_ubatch():
    ctx, _, ref = _both(8, n_ubatch=2)
    calls = iter(range(100))
    ctx.abort_callback = lambda: next(calls) == MODEL.config.n_layer  # first layer of ubatch 2
    assert ctx.decode(batch_of(_seq(0, 0, 4))) == ref.decode(_seq(0, 0, 4), 2, abort_ubatch=1) == 2
    assert engine_state(ctx) == ref_state(ref)
    assert _cells(ref) == {0: (0, {0}, 0), 1: (1, {0}, 0)} and ref.streams[0].head == 2


def test_slot_wraps_after_seq_add_frees_a_cell():
    """seq_add puts the head on the first freed cell; the next slot scans from there and wraps."""
    ctx, _, ref = _both(8)
    _decode_both(ctx, ref, _seq(0, 0, 4) + _seq(1, 0, 4))
    for x in (ctx.memory, ref):
        x.seq_rm(0, -1, -1)
        x.seq_add(1, -1, -1, -1)  # seq 1 pos 0 (cell 4) drops below 0 -> head 4
    assert ref.streams[0].head == 4 and engine_state(ctx) == ref_state(ref)
    _decode_both(ctx, ref, _seq(1, 3, 5))
    assert _cells(ref)[4] == (3, {1}, 0) and _cells(ref)[0] == (4, {1}, 0) and ref.streams[0].head == 1


@pytest.mark.parametrize("used, n, cell", [(1, 3, 0), (2, 3, 8), (1, 4, 8)])
def test_find_slot_restart_heuristic(used, n, cell):
    """llama_kv_cache::find_slot: head > used + 2n restarts the scan at 0. Head 8 and the bound sit next
    to each other on both sides: 8 > 1 + 6 restarts; 8 > 2 + 6 and 8 > 1 + 8 do not."""
    ctx, _, ref = _both(16)
    _decode_both(ctx, ref, _seq(0, 0, 8) + _seq(1, 0, 8))
    for x in (ctx.memory, ref):
        x.seq_rm(0, -1, -1)
        x.seq_add(1, -1, -1, used - 8)  # frees cells 8..15 - used, head 8; seq 1 keeps `used` cells
    assert ref.streams[0].head == 8 and ref.streams[0].used() == used
    _decode_both(ctx, ref, _seq(1, used, used + n))
    assert _cells(ref)[cell] == (used, {1}, 0)


def test_split_equal_holds_n_ubatch_plus_one_seqs():
    """With split streams one ubatch holds up to n_ubatch + 1 seqs, one token each: split_equal
    (src/llama-batch.cpp) checks the number of sets only after adding one."""
    ctx, mirror, ref = _both(8, unified=False, n_seq_max=3, n_ubatch=2)
    assert _decode_both(ctx, ref, [(0, (0,)), (0, (1,)), (0, (2,)), (1, (0,))], 2) == 0
    mirror.sync()
    assert mirror.last_decode.ubatch_sizes == (3, 1)


# ---- regressions: engine bugs this machine found (all fixed in the engine since) ---------------------


def _prefill(n=3, **kw):
    kw.setdefault("unified", True)
    ctx, mirror, ref = _both(8, n_seq_max=2, **kw)
    _decode_both(ctx, ref, _seq(0, 0, n))
    return ctx, ref


def test_seq_add_whole_range_minus1_minus1_shifts_the_seq():
    """Regression, engine/kv/cache.py KVCache.seq_add: `p0 == p1` was tested before p0 < 0 -> 0 and
    p1 < 0 -> +inf (llama_kv_cache::seq_add normalizes first), so seq_add(s, -1, -1, d), which
    shifts the whole sequence, was silently a no-op."""
    ctx, ref = _prefill()
    ctx.memory.seq_add(0, -1, -1, 2)
    ref.seq_add(0, -1, -1, 2)
    assert _cells(ctx) == {0: (2, {0}, 2), 1: (3, {0}, 2), 2: (4, {0}, 2)}
    assert engine_state(ctx) == ref_state(ref)


def test_seq_div_whole_range_minus1_minus1_divides_the_seq():
    """Regression, engine/kv/cache.py KVCache.seq_div: the same early `p0 == p1` test on raw values."""
    ctx, ref = _prefill(4)
    ctx.memory.seq_div(0, -1, -1, 2)
    ref.seq_div(0, -1, -1, 2)
    assert _cells(ctx) == {0: (0, {0}, 0), 1: (0, {0}, 1), 2: (1, {0}, 1), 3: (1, {0}, 2)}
    assert engine_state(ctx) == ref_state(ref)


def test_seq_add_empty_normalized_range_keeps_head():
    """Regression, engine/kv/cache.py KVCache.seq_add: seq_add(s, -1, 0, d) is [0, 0) once normalized, an
    early return in llama.cpp that leaves the head alone; the engine reset the head to 0."""
    ctx, ref = _prefill()
    ctx.memory.seq_add(0, -1, 0, 2)
    assert ctx.memory.head(0) == 3


def test_seq_add_matching_no_cell_sets_no_pending_shift():
    """Regression, engine/kv/cells.py KVCells.pos_add / pos_div (called by KVCache.seq_add/seq_div with
    an empty index array) set has_shift although no cell moved. In llama_kv_cells (src/llama-kv-cells.h)
    has_shift becomes true only in pos_add / pos_div of a cell, so llama_kv_cache::update finds nothing
    to do and the next decode runs no K-shift."""
    ctx, ref = _prefill()
    ctx.memory.seq_add(0, 100, -1, 1)  # nothing in range; head still goes to 0 (S12)
    assert ctx.memory.head(0) == 0
    assert not ctx.memory.v_cells[0].has_shift
    ctx.memory.seq_div(0, 100, -1, 2)
    assert not ctx.memory.v_cells[0].has_shift and not ctx.memory.pending_copies


def test_cross_stream_seq_cp_after_seq_div():
    """Regression, engine/kv/cache.py KVCache._seq_cp_across_streams: after seq_div the un-shifted
    position pos - shift can be negative (pos 1 / 2 -> pos 0, shift +1 -> -1). pos_set wrote -1, then
    KVCells.seq_add raised a bare AssertionError after the destination stream was already cleared,
    leaving a cell with a position and no seq (a broken cell invariant) and the mirror unaware.
    llama_kv_cache::seq_cp across streams gives dst src's un-shifted position, then re-applies the same
    shift, so pos/shift match."""
    ctx, ref = _prefill(2, unified=False)
    ctx.memory.seq_div(0, 0, 100, 2)
    ref.seq_div(0, 0, 100, 2)
    assert _cells(ctx) == {0: (0, {0}, 0), 1: (0, {0}, 1)}
    ctx.memory.seq_cp(0, 1, -1, -1)
    ref.seq_cp(0, 1, -1, -1)
    assert _cells(ctx, 1) == {0: (0, {1}, 0), 1: (0, {1}, 1)}
    assert ctx.memory.v_cells[1].has_shift
    assert engine_state(ctx) == ref_state(ref)
