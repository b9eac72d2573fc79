"""Notebook 2's lesson module (kvscope/lessons/slot_search.py): the slot-search rule it checks every placement
against, read against llama.cpp's find_slot and against the engine, and the words and checks the notebook prints."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import engine
from engine.watch import Watcher
from kvscope.lessons import slot_search as ss


def pos_of(cells: str) -> np.ndarray:
    """A stream from a map: '.' empty, anything else a used cell (its position is irrelevant to the search)."""
    return np.array([-1 if c == "." else 0 for c in cells], dtype=np.int64)


# ---- the rule, without the engine ---------------------------------------------------------------------------
def test_the_rule_takes_the_first_free_cells_from_the_head_and_moves_the_head_past_them():
    search = ss.find_slot_rule(pos_of("xxxx............"), head=4, n=5)
    assert search.cells == (4, 5, 6, 7, 8) and search.head_after == 9
    assert not search.restarted and not search.wrapped


def test_a_ubatch_takes_scattered_cells_when_a_hole_is_too_small():
    """llama.cpp scenario S9 (a non-contiguous slot): cells 0, 1, 6, 7 free, head 0, four tokens."""
    search = ss.find_slot_rule(pos_of("..xxxx.."), head=0, n=4)
    assert search.cells == (0, 1, 6, 7) and search.head_after == 8


def test_the_scan_wraps_to_cell_0_at_the_end_of_the_cache():
    search = ss.find_slot_rule(pos_of("..xxxx.."), head=6, n=4)  # 6 > 4 + 8 is false: no restart
    assert search.cells == (6, 7, 0, 1) and search.wrapped and search.head_after == 2
    at_end = ss.find_slot_rule(pos_of("..xxxxxx"), head=8, n=1)  # a head one past the last cell
    assert at_end.cells == (0,) and not at_end.restarted


def test_the_search_restarts_at_cell_0_exactly_when_head_exceeds_used_plus_2n():
    pos = pos_of("." * 38 + "..xx" + "x" * 18 + "....")  # 20 used, head 38, as in the notebook's section 5
    for n in range(1, 13):
        search = ss.find_slot_rule(pos, head=38, n=n)
        assert search.restarted == (38 > 20 + 2 * n)
        assert search.cells[0] == (0 if search.restarted else 38)
    assert ss.find_slot_rule(pos, head=38, n=8).restarted and not ss.find_slot_rule(pos, head=38, n=9).restarted


def test_no_slot_when_fewer_cells_are_free_than_tokens_or_the_ubatch_is_larger_than_the_cache():
    assert ss.find_slot_rule(pos_of("xx..xxxx"), head=2, n=3).cells is None
    assert ss.find_slot_rule(pos_of("........"), head=0, n=9).cells is None


def test_runs_names_cells_as_ranges_in_the_order_given():
    assert ss.runs([10, 11, 12, 13, 14, 15, 24, 25]) == "10-15, 24-25"
    assert ss.runs([60, 61, 62, 63, 0, 1]) == "60-63, 0-1"
    assert ss.runs([7]) == "7" and ss.runs([]) == "none"


# ---- against the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo model is tiny: one thread decodes it fastest, on a busy machine above all
    yield engine.load_model("demo")
    torch.set_num_threads(threads)


@pytest.fixture
def ctx(model):
    return ss.make_context(model)


def test_the_notebooks_batch_splits_simply_in_one_stream_and_equally_for_split_streams(model):
    p0, p1 = ss.text_tokens(model, 0), ss.text_tokens(model, 1)
    batch = engine.Batch(tokens=p0[:10] + p1[:6], pos=[*range(10), *range(6)], seq_ids=[[0]] * 10 + [[1]] * 6)
    simple, equal = ss.split(model, batch, "simple"), ss.split(model, batch, "equal")
    assert [len(u) for u in simple] == [8, 8] and {s for s, _ in simple[1]} == {0, 1}
    assert [len(u) for u in equal] == [8, 4, 4]
    assert ss.split_text(equal, sep="; ") == ("ubatch 0 (8): seq 0 pos 0-3, seq 1 pos 0-3; ubatch 1 (4): seq 0 pos 4-5, "
                                              "seq 1 pos 4-5; ubatch 2 (4): seq 0 pos 6-9")


def random_steps(ctx, seed: int, steps: int, ops: list[str], n_max: int):
    """Random operations in one stream; each decode is checked against the rule (last_decode asserts that it took
    the predicted cells, or failed where predicted leaving every cell and the head as they were). Yields each
    operation's name and, for a decode, the rule's searches."""
    watcher = Watcher.of(ctx.bus)
    rng = random.Random(seed)
    for _ in range(steps):
        op, seq = rng.choice(ops), rng.randrange(ss.N_SEQ)
        searches = ()
        if op == "decode":
            n = rng.randint(1, n_max)
            if ctx.memory.seq_pos_max(seq) + n >= 60:
                continue  # stay inside the window: swa holds the same cells as base
            before, expected = ss.cells(watcher), ss.predict(watcher, n)
            rc = ctx.decode(ss.next_batch(ctx, seq, n))
            ss.last_decode(watcher, expected)
            assert rc == (0 if expected.fits else 1)
            assert rc == 0 or ss.cells(watcher).same_as(before)
            searches = expected.searches
        elif op == "seq_rm":
            ctx.memory.seq_rm(seq, rng.choice([-1, rng.randrange(0, 30)]), -1)
        elif op == "seq_cp":
            free = [s for s in range(ss.N_SEQ) if ctx.memory.seq_pos_max(s) < 0]
            if free and ctx.memory.seq_pos_max(seq) >= 0:
                ctx.memory.seq_cp(seq, free[0], -1, -1)
        elif op == "seq_add":
            ctx.memory.seq_add(seq, 0, -1, -rng.randint(1, 12))
        else:
            ctx.memory.seq_keep(seq)
        yield op, searches, watcher


def test_without_seq_add_every_cell_before_the_head_stays_used_and_only_a_failing_scan_wraps(ctx):
    """Decodes, seq_rm, seq_cp and seq_keep in one stream: every cell before the head stays used, so the search
    takes the lowest free cells, and a scan that wraps round to cell 0 finds nothing there (the notebook's
    sections 2 and 6)."""
    seen = {"placed": 0, "failed": 0}
    for op, searches, watcher in random_steps(ctx, seed=7, steps=40, n_max=24,
                                              ops=["decode"] * 3 + ["seq_rm", "seq_cp", "seq_keep"]):
        assert ss.nothing_free_before_head(watcher), op
        for search in searches:
            assert not search.wrapped or search.cells is None
            assert not search.restarted  # head <= used: it cannot exceed used + 2n
            seen["placed" if search.cells else "failed"] += 1
    assert seen["placed"] > 10 and seen["failed"] >= 2  # both paths were taken


def test_with_seq_add_the_engine_still_places_what_the_rule_predicts(ctx):
    """seq_add can leave the head past free cells (the notebook's sections 4 and 5): the rule still predicts
    every placement."""
    seen = set()
    for op, searches, watcher in random_steps(ctx, seed=0, steps=50, n_max=16,
                                              ops=["decode"] * 3 + ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_add"]):
        if op == "seq_add" and not ss.nothing_free_before_head(watcher):
            seen.add("head past a free cell")
        if any(s.restarted for s in searches):
            seen.add("restart")
    assert seen == {"head past a free cell", "restart"}


def test_seq_add_sets_the_head_to_the_first_cell_it_emptied_else_to_0(ctx):
    watcher = Watcher.of(ctx.bus)
    assert ctx.decode(ss.next_batch(ctx, 0, 10)) == 0 and ctx.decode(ss.next_batch(ctx, 1, 20)) == 0
    ctx.memory.seq_rm(0, -1, -1)
    ctx.memory.seq_add(1, 0, -1, -4)  # positions 0-3 of seq 1 (cells 10-13) fall below 0
    c = ss.cells(watcher)
    assert c.head == 10 and c.free_before_head().tolist() == list(range(10))
    ctx.memory.seq_add(1, 0, -1, 2)  # nothing emptied
    assert ss.cells(watcher).head == 0


def test_a_wrapping_batch_and_a_restart_as_the_notebook_steps_them(ctx):
    watcher = Watcher.of(ctx.bus)
    for seq, n in ((0, 10), (1, 20), (2, 28)):
        assert ctx.decode(ss.next_batch(ctx, seq, n)) == 0  # cells 0-57, head 58
    ctx.memory.seq_rm(0, -1, -1)
    ctx.memory.seq_add(1, 0, -1, -8)  # cells 10-17 emptied: head 10, cells 0-9 free before it
    expected = ss.predict(watcher, 16)
    assert ctx.decode(ss.next_batch(ctx, 3, 16)) == 0
    story = ss.last_decode(watcher, expected)
    assert story.placed == (tuple(range(10, 18)), (58, 59, 60, 61, 62, 63, 0, 1)) and expected.searches[1].wrapped
    assert story.k_shifted  # seq 1's cells, re-rotated before the placement
    assert any("cells 58-63, 0-1" in line for line in ss.story_lines(story))


def test_a_batch_that_does_not_fit_is_refused_after_two_dry_runs_and_changes_nothing(ctx):
    watcher = Watcher.of(ctx.bus)
    assert ctx.decode(ss.next_batch(ctx, 0, 40)) == 0
    before = ss.cells(watcher)
    expected = ss.predict(watcher, 30)
    assert not expected.fits and len(expected.searches) == 4  # 24 cells free: the fourth ubatch finds no slot
    assert ctx.decode(ss.next_batch(ctx, 1, 30)) == 1
    story = ss.last_decode(watcher, expected)
    assert [a.split for a in story.attempts] == ["simple", "equal"]
    assert all(len(a.placed) == 3 and a.failed is not None for a in story.attempts) and not story.placed
    assert ss.cells(watcher).same_as(before) and not ss.touched(watcher, "swa") and ss.touched(watcher, "base")
    lines = ss.story_lines(story)
    assert lines[-1] == "decode returned 1 (no slot)" and "no slot (0 cells free)" in lines[3]


def test_the_restart_table_asks_find_slot_and_places_nothing(ctx):
    watcher = Watcher.of(ctx.bus)
    assert ctx.decode(ss.next_batch(ctx, 0, 40)) == 0 and ctx.decode(ss.next_batch(ctx, 1, 10)) == 0
    ctx.memory.seq_rm(0, -1, -1)
    ctx.memory.seq_add(1, 0, -1, -2)  # head 40, 8 used
    lines = ss.restart_table(ctx, watcher, seq=1, ns=[1, 15, 16])
    assert lines[0] == "head 40, used 8"
    assert "yes: from cell 0" in lines[2] and "yes: from cell 0" in lines[3] and "no: from the head" in lines[4]
    assert ss.restarts(ctx, watcher, seq=1, n=15) and not ss.restarts(ctx, watcher, seq=1, n=16)
    assert ss.plan(ctx, seq=1, n=2) == (0, 1) and ss.cells(watcher).head == 40


def test_the_lane_draws_cells_positions_and_the_head(ctx):
    watcher = Watcher.of(ctx.bus)
    assert ctx.decode(ss.next_batch(ctx, 2, 5)) == 0
    lines = ss.lane(watcher)
    assert lines[0] == "base cache: 64 cells, 5 used, head 5"
    assert lines[2].startswith("  seq  2  2  2  2  2  .") and lines[3].startswith("  pos  0  1  2  3  4  .")
    assert lines[4].index("^") == len("  cell ") + ss.COL * 5
    assert ss.both_caches_alike(watcher)


def test_where_positions_are_says_which_cells_hold_which_positions(ctx):
    watcher = Watcher.of(ctx.bus)
    for seq, n in ((0, 6), (1, 4), (0, 3)):
        assert ctx.decode(ss.next_batch(ctx, seq, n)) == 0
    assert ss.where_positions_are(watcher, 0) == ["positions 0-5 in cells 0-5", "positions 6-8 in cells 10-12"]
    assert ss.where_positions_are(watcher, 1) == ["positions 0-3 in cells 6-9"]


def test_scattered_cells_give_the_logits_of_contiguous_ones(ctx):
    watcher = Watcher.of(ctx.bus)
    assert ctx.decode(ss.next_batch(ctx, 0, 6)) == 0 and ctx.decode(ss.next_batch(ctx, 1, 10)) == 0
    ctx.memory.seq_rm(0, -1, -1)
    assert ctx.decode(ss.next_batch(ctx, 2, 9)) == 0  # cells 0-5 and 16-18
    assert ss.where_positions_are(watcher, 2) == ["positions 0-5 in cells 0-5", "positions 6-8 in cells 16-18"]
    assert ss.logits_gap_against_fresh(ctx, watcher, seq=2) < 1e-3


def test_check_mask_recomputes_the_mask_from_positions_and_sequences(ctx):
    from explorer import MaskView

    watcher = Watcher.of(ctx.bus)
    assert ctx.decode(ss.next_batch(ctx, 3, 12)) == 0
    ctx.memory.seq_rm(3, 0, 6)  # cells 0-5 emptied: the batch below takes 0-4, and cell 5 stays a hole
    assert ctx.decode(ss.mixed_batch(ctx, {1: 3, 3: 2})) == 0
    assert ss.last_decode(watcher).placed == ((0, 1, 2, 3, 4),)
    mask = MaskView(watcher, cache="base", widget=False).update()
    ss.check_mask(mask, watcher)
    assert mask.token_seqs == ((1,), (1,), (1,), (3,), (3,))
    wrong = dataclasses.replace(mask, allowed=~mask.allowed)
    with pytest.raises(AssertionError, match="row 0"):
        ss.check_mask(wrong, watcher)
