"""Random operations on sliding-window caches and iSWA pairs keep the cache's guarantees.

After every step: the cells' own invariants, the mirror equals the engine, every sequence keeps
the positions its next token attends to (reuse only ever takes cells outside that window), sequences
stay gap-free (the purge's job), and in an iSWA pair the SWA cache never holds a (seq, pos) that
the base cache lacks.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import events as ev
from engine.kv.iswa import KVCacheISWA
from engine.kv.swa import SwaType
from engine.watch.mirror import CacheMirror
from tests.cell_checks import assert_cell_invariants
from tests.test_swa_scenarios import Driver, make_cache

N_SEQ = 3

operation = st.one_of(
    st.tuples(st.just("decode"), st.integers(0, N_SEQ - 1), st.integers(1, 5)),
    st.tuples(st.just("rm_tail"), st.integers(0, N_SEQ - 1), st.integers(0, 3)),
    st.tuples(st.just("rm_all"), st.integers(0, N_SEQ - 1), st.just(0)),
    st.tuples(st.just("cp"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1)),
    st.tuples(st.just("keep"), st.integers(0, N_SEQ - 1), st.just(0)),
)


def positions_of(cache, seq_id: int) -> set[int]:
    return {pos for pos, seqs, _ in cache.cells(0) if seq_id in seqs}


def check(memory, swa_cache, n_swa: int, swa_type: SwaType, decoded_max: dict[int, int],
          window_floor: dict[int, int]) -> None:
    for cache in memory.caches():
        assert_cell_invariants(cache.cells(0))
        assert 0 <= cache.head(0) <= cache.size
    for s in range(N_SEQ):
        present = positions_of(swa_cache, s)
        if present:
            assert present == set(range(min(present), max(present) + 1)), f"seq {s} has a gap: {sorted(present)}"
        top = decoded_max.get(s, -1)
        if top >= 0 and swa_type == SwaType.STANDARD:
            # what the sequence's next token (at top + 1) still attends to: (top + 1) - p < n_swa. Not below
            # an earlier window's start: cells masked then may have been reused (llama.cpp's
            # llama_kv_cache::find_slot reuses a masked cell of a single sequence, src/llama-kv-cache.cpp),
            # so removing a sequence's tail does not bring those positions back.
            window = set(range(max(0, top + 2 - n_swa, window_floor.get(s, 0)), top + 1))
            assert window <= present, f"seq {s} lost positions inside its window: {sorted(window - present)}"
    if isinstance(memory, KVCacheISWA):
        for s in range(N_SEQ):
            assert positions_of(memory.swa, s) <= positions_of(memory.base, s)


def run_ops(memory, swa_cache, ops, n_swa: int, swa_type: SwaType, bus, mirror) -> None:
    driver = Driver(memory, bus, mirror, n_ubatch=3)
    decoded_max: dict[int, int] = {}
    window_floor: dict[int, int] = {}  # per seq: the highest window start it has had
    for op, a, b in ops:
        if op == "decode":
            start = memory.seq_pos_max(a) + 1
            if driver.decode(list(range(start, start + b)), seq_id=a) == 0:
                decoded_max[a] = start + b - 1
        elif op == "rm_tail":
            top = memory.seq_pos_max(a)
            if top >= 0:
                memory.seq_rm(a, max(0, top - b), -1)
                decoded_max[a] = memory.seq_pos_max(a)
        elif op == "rm_all":
            memory.seq_rm(a, -1, -1)
            decoded_max.pop(a, None)
            window_floor.pop(a, None)
        elif op == "cp" and a != b:
            memory.seq_rm(b, -1, -1)
            memory.seq_cp(a, b, -1, -1)
            if a in decoded_max and memory.seq_pos_max(b) >= 0:
                decoded_max[b] = decoded_max[a]
                window_floor[b] = window_floor.get(a, 0)
            else:
                decoded_max.pop(b, None)
                window_floor.pop(b, None)
        elif op == "keep":
            memory.seq_keep(a)
            decoded_max = {a: decoded_max[a]} if a in decoded_max else {}
            window_floor = {a: window_floor[a]} if a in window_floor else {}
        for s, top in decoded_max.items():
            window_floor[s] = max(window_floor.get(s, 0), top + 2 - n_swa)
        driver.check_mirror()
        check(memory, swa_cache, n_swa, swa_type, decoded_max, window_floor)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=25), n_swa=st.integers(1, 4), kv=st.integers(6, 12),
       swa_type=st.sampled_from([SwaType.STANDARD, SwaType.CHUNKED]))
def test_random_operations_on_an_swa_cache(ops, n_swa, kv, swa_type):
    bus, mirror = ev.EventBus(), CacheMirror()
    mirror.attach(bus)
    swa = make_cache(bus, kv, n_swa=n_swa, swa_type=swa_type)
    run_ops(swa, swa, ops, n_swa, swa_type, bus, mirror)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=25), n_swa=st.integers(1, 3), base_kv=st.integers(8, 16),
       swa_kv=st.integers(4, 8))
def test_random_operations_on_an_iswa_pair(ops, n_swa, base_kv, swa_kv):
    bus, mirror = ev.EventBus(), CacheMirror()
    mirror.attach(bus)
    base = make_cache(bus, base_kv, name="base")
    swa = make_cache(bus, swa_kv, n_swa=n_swa, swa_type=SwaType.STANDARD)
    pair = KVCacheISWA(base, swa, unified=True, swa_full=False)
    run_ops(pair, swa, ops, n_swa, SwaType.STANDARD, bus, mirror)
