"""Shifting an iSWA pair whose SWA cache is smaller than its base cache, as llama.cpp does (QUIRK_ISWA_SHIFT).

llama_memory_can_shift answers false for such a pair (llama_kv_cache_iswa::get_can_shift compares the two
sizes, src/llama-kv-cache-iswa.cpp), yet llama_kv_cache_iswa::seq_add / seq_div pass the move to both caches
unchecked, and the next decode's update runs each cache's own llama_kv_cache::update (init_update makes one
update context per cache), whose own get_can_shift passes: both caches' keys are re-rotated and the decode
returns 0 (observed at llama.cpp 0c1e570: two K-shifts). kvscope does the same; the moves and K-shifts carry
QUIRK_ISWA_SHIFT. can_shift() still answers False, so the tools' context shift stays off.
"""
from __future__ import annotations

import pytest
import torch

import engine
from engine import events as ev
from engine.batch import Batch
from engine.errors import KvscopeError
from engine.kv.cache import QUIRK_DIV_SHIFT, QUIRK_ISWA_SHIFT
from engine.rope import Rotary
from engine.runners.session import Session
from engine.watch.describe import EventFilter, describe_event

TOKENS = list(range(5, 17))  # 12 tokens: they fit both caches of the contexts below (SWA 16 cells, base 32)
SETTINGS = dict(n_ctx=32, pad=8, n_ubatch=8, type_k="f32", type_v="f32")


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_hf):
    return engine.load_model(tiny_gemma3_hf)


def new_ctx(model, **kw) -> engine.Context:
    return engine.Context(model, **{**SETTINGS, **kw})


def positions(cache) -> dict[int, int]:
    """pos -> cell of seq 0's cells (one cell per position here)."""
    held = {pos: i for i, (pos, seqs, _) in enumerate(cache.cells(0)) if 0 in seqs}
    assert len(held) == sum(1 for _, seqs, _ in cache.cells(0) if 0 in seqs)
    return held


def keys(cache, il: int, cells: list[int]) -> torch.Tensor:
    """Layer il's stored K rows of those cells, [N, n_head_kv, head_dim]."""
    lo = cache.layout
    return cache.k[cache.layer_index[il]].read_cells(0, torch.tensor(cells)).view(-1, lo.n_head_kv, lo.head_dim)


def rope(model, il: int, k: torch.Tensor, pos: list[int]) -> torch.Tensor:
    """k turned by the angles of positions pos with layer il's own RoPE base (negative: turned back)."""
    cos, sin = model.transformer.rotary.cos_sin(torch.tensor(pos), torch.float32, il)
    return Rotary.apply(k, cos, sin)


def context_shift(ctx, n_keep: int, n_discard: int, n_past: int) -> None:
    """llama-completion's context shift (tools/completion/completion.cpp), by hand."""
    ctx.memory.seq_rm(0, n_keep, n_keep + n_discard)
    ctx.memory.seq_add(0, n_keep + n_discard, n_past, -n_discard)


def test_the_pair_says_it_cannot_shift(gemma3):
    ctx = new_ctx(gemma3)
    assert (ctx.memory.base.size, ctx.memory.swa.size) == (32, 16)
    assert not ctx.memory.can_shift()
    assert new_ctx(gemma3, swa_full=True).memory.can_shift()


def test_seq_rm_then_seq_add_re_rotates_the_keys_of_both_caches(gemma3):
    """The keys of every moved cell, in every layer of both caches, are turned back from the old position and
    on to the new one with that layer's RoPE base (1e6 on the full layer of the base cache, 10000 on the
    sliding ones); the kept cells and V are left alone."""
    rotary = gemma3.transformer.rotary
    assert rotary.layer_table[5] != rotary.layer_table[0]  # the two caches turn with different bases
    ctx = new_ctx(gemma3)
    assert ctx.decode(Batch.for_sequence(TOKENS, 0, 0)) == 0
    n_keep, n_discard, n_past = 2, 4, len(TOKENS)
    before = {}
    for cache in ctx.memory.caches():
        cells = positions(cache)
        assert sorted(cells) == list(range(n_past))  # both caches hold every position
        before[cache.name] = (cells, {il: keys(cache, il, list(cells.values())) for il in cache.layout.layer_ids},
                              [cache.v[i].read_cells(0, torch.tensor(list(cells.values())))
                               for i in range(len(cache.v))])

    context_shift(ctx, n_keep, n_discard, n_past)
    moved_old = list(range(n_keep + n_discard, n_past))
    moved_new = [p - n_discard for p in moved_old]
    for cache in ctx.memory.caches():
        cells_before = before[cache.name][0]
        shifts = {pos: shift for pos, seqs, shift in cache.cells(0) if 0 in seqs}
        assert shifts == {**{p: 0 for p in range(n_keep)}, **{p: -n_discard for p in moved_new}}, cache.name
        assert {p: i for p, i in positions(cache).items() if p >= n_keep} == \
            {p - n_discard: cells_before[p] for p in moved_old}, f"{cache.name}: the moved cells stayed in place"
        for il in cache.layout.layer_ids:  # the keys wait for the next decode's K-shift
            assert torch.equal(keys(cache, il, list(cells_before.values())), before[cache.name][1][il])

    assert ctx.decode(Batch([99], [n_past - n_discard], [[0]])) == 0  # the next position
    for cache in ctx.memory.caches():
        cells_before, k_before, v_before = before[cache.name]
        assert all(shift == 0 for _, _, shift in cache.cells(0)), f"{cache.name}: shifts left pending"
        order = list(cells_before)  # positions 0..n_past-1, as k_before's rows
        moved_rows = [order.index(p) for p in moved_old]
        # the kept positions still held (the SWA cache gives the new token a cell its window left behind)
        held = positions(cache)
        kept = [p for p in range(n_keep) if held.get(p) == cells_before[p]]
        assert kept == ([0, 1] if cache.name == "base" else [1])
        kept_rows = [order.index(p) for p in kept]
        for il in cache.layout.layer_ids:
            now = keys(cache, il, [cells_before[p] for p in moved_old])
            old = k_before[il][moved_rows]
            by_hand = rope(gemma3, il, rope(gemma3, il, old, [-p for p in moved_old]), moved_new)
            torch.testing.assert_close(now, by_hand, atol=1e-5, rtol=1e-5, msg=f"{cache.name} layer {il}")
            assert (now - old).abs().max() > 1e-2, f"{cache.name} layer {il}: the keys were not turned"
            other = 0 if il == 5 else 5  # the other cache's base would give other keys
            assert (rope(gemma3, other, rope(gemma3, other, old, [-p for p in moved_old]), moved_new)
                    - now).abs().max() > 1e-3
            assert torch.equal(keys(cache, il, [cells_before[p] for p in kept]), k_before[il][kept_rows])
        for i in range(len(cache.v)):
            assert torch.equal(cache.v[i].read_cells(0, torch.tensor([cells_before[p] for p in moved_old])),
                               v_before[i][moved_rows])


def test_after_the_shift_both_caches_hold_what_a_fresh_context_computes_at_the_new_positions(gemma3):
    """Cut the tail, move the rest up by 5: the moved tokens never saw the cut ones, so a context that decodes
    them at the new positions from the start computes the same keys in every layer of both caches (RoPE
    attention depends on position differences only), and the next token's logits."""
    n_cut, delta = 8, 5
    ctx = new_ctx(gemma3)
    assert ctx.decode(Batch.for_sequence(TOKENS, 0, 0)) == 0
    ctx.memory.seq_rm(0, n_cut, -1)
    ctx.memory.seq_add(0, 0, n_cut, delta)
    nxt = Batch([99], [n_cut + delta], [[0]])
    assert ctx.decode(nxt) == 0
    fresh = new_ctx(gemma3)
    assert fresh.decode(Batch.for_sequence(TOKENS[:n_cut], 0, delta)) == 0
    assert fresh.decode(nxt) == 0
    torch.testing.assert_close(ctx.logits(-1), fresh.logits(-1), atol=1e-4, rtol=0)
    compared = {}
    for cache, fresh_cache in zip(ctx.memory.caches(), fresh.memory.caches()):
        got, want = positions(cache), positions(fresh_cache)
        # the SWA cache may have reused a cell the window left behind for the new token
        common = sorted(p for p in got if p in want and p < n_cut + delta)
        compared[cache.name] = common
        for il in cache.layout.layer_ids:
            torch.testing.assert_close(keys(cache, il, [got[p] for p in common]),
                                       keys(fresh_cache, il, [want[p] for p in common]), atol=1e-4, rtol=1e-4,
                                       msg=f"{cache.name} layer {il}")
    assert compared["base"] == list(range(delta, n_cut + delta))
    n_swa = ctx.memory.swa.layout.n_swa
    assert set(range(n_cut + delta - n_swa + 1, n_cut + delta)) <= set(compared["swa"])  # the new token's window


def shift_events(model, **settings) -> tuple[engine.Context, dict[str, list[int]], list[ev.Event]]:
    """A context shift, a seq_div of nothing and one of four cells, then the next decode: the context, the
    cells each cache had a pending shift in before that decode, and the events."""
    bus = engine.EventBus()
    sub = bus.subscribe(kinds=(ev.CellsShifted, ev.KShiftApplied))
    ctx = new_ctx(model, bus=bus, **settings)
    assert ctx.decode(Batch.for_sequence(TOKENS, 0, 0)) == 0
    context_shift(ctx, 2, 4, len(TOKENS))  # positions 0, 1 kept; 6..11 -> 2..7
    ctx.memory.seq_div(0, 8, -1, 2)  # nothing at 8 or above any more
    ctx.memory.seq_div(0, 4, 8, 2)  # positions 4..7 -> 2, 2, 3, 3
    pending = {cache.name: [i for i, (_, _, shift) in enumerate(cache.cells(0)) if shift]
               for cache in ctx.memory.caches()}
    assert ctx.decode(Batch([99], [ctx.memory.seq_pos_max(0) + 1], [[0]])) == 0
    return ctx, pending, sub.drain()


def test_the_moves_and_k_shifts_of_a_pair_that_cannot_shift_carry_the_quirk(gemma3):
    ctx, pending, events = shift_events(gemma3)
    assert not ctx.memory.can_shift()
    kinds = [(type(e).__name__, e.cache, getattr(e, "op", "")) for e in events]
    assert kinds == [("CellsShifted", "base", "add"), ("CellsShifted", "swa", "add"),
                     ("CellsShifted", "base", "div"), ("CellsShifted", "swa", "div"),  # nothing in range
                     ("CellsShifted", "base", "div"), ("CellsShifted", "swa", "div"),
                     ("KShiftApplied", "base", ""), ("KShiftApplied", "swa", "")]
    add, empty_div, div, kshift = events[0:2], events[2:4], events[4:6], events[6:8]
    assert all(e.quirk == QUIRK_ISWA_SHIFT for e in add + kshift)
    assert all(e.quirk == QUIRK_DIV_SHIFT for e in empty_div)  # no cell moved: no K-shift follows from it
    assert all(e.quirk == f"{QUIRK_DIV_SHIFT}; {QUIRK_ISWA_SHIFT}" for e in div)
    for e in kshift:  # one K-shift per cache, over that cache's moved cells and all its layers
        assert e.changes[0].cells.tolist() == pending[e.cache] and len(pending[e.cache]) >= 5
        assert e.n_layers == (1 if e.cache == "base" else 5)
    assert "the memory says it cannot shift, then shifts" in QUIRK_ISWA_SHIFT
    for name in ("llama_kv_cache_iswa::get_can_shift", "init_update", "llama_kv_cache::update"):
        assert name in QUIRK_ISWA_SHIFT
    # what both explorers' event logs show: the line, its "!", and the "quirks" filter
    line = describe_event(events[-1])
    assert line.startswith("KShiftApplied swa s0 cells") and line.endswith(f"  ! {QUIRK_ISWA_SHIFT}")
    assert all(EventFilter("quirks").keeps(e) for e in add + div + kshift)


def test_with_swa_full_no_quirk_is_marked(gemma3):
    ctx, _, events = shift_events(gemma3, swa_full=True)
    assert ctx.memory.can_shift()
    assert [type(e).__name__ for e in events][-2:] == ["KShiftApplied", "KShiftApplied"]
    for e in events:
        assert e.quirk == (QUIRK_DIV_SHIFT if getattr(e, "op", "") == "div" else ""), describe_event(e)


def test_a_move_of_nothing_carries_no_quirk_and_needs_no_k_shift(gemma3):
    bus = engine.EventBus()
    sub = bus.subscribe(kinds=(ev.CellsShifted, ev.KShiftApplied))
    ctx = new_ctx(gemma3, bus=bus)
    assert ctx.decode(Batch.for_sequence(TOKENS, 0, 0)) == 0
    ctx.memory.seq_add(0, 100, -1, 5)
    assert ctx.decode(Batch([99], [len(TOKENS)], [[0]])) == 0
    events = sub.drain()
    assert [type(e).__name__ for e in events] == ["CellsShifted", "CellsShifted"]
    assert not any(e.quirk for e in events)


def test_the_context_shift_command_stays_off_as_in_llama_cpp_s_tools(gemma3):
    """llama.cpp's tools turn --context-shift off when llama_memory_can_shift is false; the session's
    context_shift command refuses the same way, while its seq_add goes to the memory (and shifts)."""
    with Session(gemma3, settings={**SETTINGS, "n_ctx": 64, "n_seq_max": 1}, threaded=False) as session:
        assert session.ctx.memory.swa.size < session.ctx.memory.base.size and not session.ctx.memory.can_shift()
        seq = session.add_prompt("hello there, how are you").result()
        n_past = session.ctx.memory.seq_pos_max(seq) + 1
        with pytest.raises(KvscopeError, match="cannot shift"):
            session.context_shift(seq, n_keep=1, n_discard=2).result()
        assert session.ctx.memory.seq_pos_max(seq) == n_past - 1  # nothing moved
        session.seq_rm(seq, 1, 3).result()
        session.seq_add(seq, 3, -1, -2).result()
        assert session.ctx.memory.seq_pos_max(seq) == n_past - 3
        for cache in session.ctx.memory.caches():
            assert any(shift == -2 for _, _, shift in cache.cells(0))
