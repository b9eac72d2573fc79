"""Notebook 5's lesson module (kvscope/lessons/sliding_windows.py): the rules its sentences state hold, and its
checks fail when the state does not match the prose. The whole notebook runs in tests/test_notebooks.py."""
from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.kv.swa import SwaType
from engine.watch import Watcher
from engine.watch.attention_mask import MaskCell, last_ubatch_mask
from kvscope.lessons import sliding_windows as lesson


@pytest.fixture(scope="module")
def model():
    return engine.load_model("demo")


def test_the_window_kinds_follow_llama_cpps_rule():
    kinds = lesson.window_kinds(n_swa=4, n=12)
    assert lesson.keys_seen(kinds[SwaType.STANDARD]).tolist() == [1, 2, 3, 4] + [4] * 8
    assert lesson.keys_seen(kinds[SwaType.CHUNKED]).tolist() == [1, 2, 3, 4] * 3
    assert lesson.keys_seen(kinds[SwaType.SYMMETRIC]).tolist() == [3, 4] + [5] * 8 + [4, 3]
    # the causal mask: nothing after the query in the causal kinds, keys after it in the symmetric one
    assert not (np.triu(kinds[SwaType.STANDARD], 1) == lesson.SEEN).any()
    assert kinds[SwaType.SYMMETRIC][0, 2] == lesson.SEEN and kinds[SwaType.STANDARD][4, 0] == lesson.OUTSIDE
    assert "positions 0, 4, 8" in lesson.window_caption(kinds, n_swa=4)


def test_the_window_check_catches_a_wrong_rule():
    kinds = lesson.window_kinds(n_swa=4, n=12)
    kinds[SwaType.CHUNKED] = kinds[SwaType.STANDARD]
    with pytest.raises(AssertionError):
        lesson.check_window_counts(kinds, 4)


def test_the_window_figure_draws_the_three_kinds():
    figure = lesson.window_figure(lesson.window_kinds())
    assert len(figure.data) == 3 and [len(t.z) for t in figure.data] == [3 * lesson.WINDOW] * 3


@pytest.mark.parametrize(("settings", "cells"), [
    (dict(n_ctx=1024, n_seq_max=1, kv_unified=True, n_ubatch=512, pad=256), 768),  # 16 + 512 -> 768
    (dict(n_ctx=128, n_seq_max=1, kv_unified=True, n_ubatch=8, pad=16), 32),  # 16 + 8 = 24 -> 32
    (dict(n_ctx=128, n_seq_max=2, kv_unified=True, n_ubatch=8, pad=16), 48),  # 2 x 16 + 8 = 40 -> 48
    (dict(n_ctx=64, n_seq_max=2, kv_unified=False, n_ubatch=8, pad=16), 32),  # per stream: 16 + 8 -> 32
    (dict(n_ctx=32, n_seq_max=4, kv_unified=True, n_ubatch=8, pad=16), 32),  # at most the base cache
    (dict(n_ctx=128, n_seq_max=1, kv_unified=True, n_ubatch=8, pad=16, swa_full=True), 128),
])
def test_the_swa_rule(settings, cells):
    n_ctx_seq = settings["n_ctx"] // (1 if settings["kv_unified"] else settings["n_seq_max"])
    assert lesson.swa_rule(n_ctx_seq, lesson.WINDOW, settings["n_seq_max"], settings["kv_unified"],
                           settings["n_ubatch"], settings["pad"], settings.get("swa_full", False)) == cells


def test_the_engine_sizes_the_swa_cache_by_the_rule_and_says_why(model):
    size, why = lesson.swa_size_answer(model, n_ctx=256, pad=16, n_ubatch=32, n_seq_max=3, kv_unified=True)
    assert size == 80 and "3 sequences" in why and "already a multiple of 16" in why
    size, why = lesson.swa_size_answer(model, n_ctx=256, pad=16, n_ubatch=32, n_seq_max=2, kv_unified=False)
    assert size == 48 and "one window of 16 per stream" in why
    rows = lesson.size_table(model, [dict(n_ctx=128, pad=16, n_ubatch=8)] * 4)
    assert rows[0] == (128, 32, 32) and "32" in lesson.size_sentence(rows)


def test_the_sessions_window_slides_and_its_masked_cells_are_reused(model):
    session = lesson.new_session(model)
    try:
        watcher = Watcher.of(session)
        assert "32 cells" in lesson.cache_sizes(watcher)
        seq = session.add_prompt(lesson.PROMPT).result()
        session.step(1).result()
        assert "stored but masked" in lesson.both_caches(watcher, seq)
        session.step(24).result()
        said = lesson.after_slide(watcher, seq)
        assert "went round" in said and "32 of 32" in said
        assert watcher.frame().stream("swa").pos[lesson.a_reused_cell(watcher)] >= 32
        assert "answers" in lesson.pos_min_sentence(session, seq)

        session.step(1).result()
        watcher.poll()
        base, swa = last_ubatch_mask(watcher, "base"), last_ubatch_mask(watcher, "swa")
        assert "the window cuts the row" in lesson.mask_sentence(base, swa)
        assert len(lesson.Stacked(FakeView(1), FakeView(2)).figures()) == 2
        session.step(8).result()
        watcher.poll()
        later = last_ubatch_mask(watcher, "swa")
        assert "were reused" in lesson.reuse_sentence(swa, later, watcher)
        # the check sees a mask that does not match the prose: the base row given as the swa one
        with pytest.raises(AssertionError):
            lesson.check_decode_masks(base, base)
    finally:
        session.close()


class FakeView:
    def __init__(self, figure) -> None:
        self.figure = figure

    def figures(self) -> list:
        return [self.figure]


def test_the_purge_frees_a_sequence_from_shared_cells_in_the_dry_run(model):
    session = lesson.new_session(model, n_seq_max=2)
    try:
        watcher = Watcher.of(session)
        size, why = lesson.swa_size_why(session.ctx)
        assert size == 64 and "2 sequences" in why
        seq = session.add_prompt("In the beginning God created the heaven and the earth").result()
        session.step(1).result()
        session.seq_cp(seq, 1, -1, -1).result()
        assert "hold sequences 0 and 1" in lesson.shared_cells(watcher)
        removals = lesson.listen_for_removals(session)
        session.step(60).result()  # past the end of the swa cache's 64 cells: the slot search wraps
        said = lesson.after_purge(watcher, removals)
        assert "the purge removed sequence 0" in said
        said = lesson.purge_mask_sentence(last_ubatch_mask(watcher, "swa"), watcher)
        assert "hold sequence 1 only" in said
        with pytest.raises(AssertionError):  # the base row: nothing there is another sequence's alone
            lesson.purge_mask_sentence(last_ubatch_mask(watcher, "base"), watcher)
        with pytest.raises(engine.KvscopeError):
            session.context_shift(seq, n_keep=4).result()
    finally:
        session.close()


def test_swa_full_costs_memory_and_buys_shifting(model):
    said = lesson.swa_full_cost(model, n_ctx=1024)
    assert "768" in said and "1024" in said


def test_the_pair_says_it_cannot_shift_then_shifts(model):
    from explorer import EventLog

    runs = {full: lesson.shift_by_hand(model, swa_full=full) for full in (False, True)}
    log = EventLog(runs[False].watcher, lines=10)
    log.group.value = "cells"
    assert "can_shift = False" in lesson.shift_sentence(runs, log)
    log.lines = 1  # the shift's events scrolled out of the log: the check wants to see them marked
    log.forget()
    log.update()
    with pytest.raises(AssertionError):
        lesson.check_shift_quirk(runs, log)


def test_swa_full_shifts_but_its_swa_cache_still_slides(model):
    session = lesson.new_session(model, swa_full=True)
    try:
        seq = session.add_prompt("In the beginning God created the heaven and the earth").result()
        session.step(30).result()
        before = session.ctx.memory.seq_pos_max(seq)
        n_discard = session.context_shift(seq, n_keep=4).result()
        outcomes = session.step(5).result()
        said = lesson.shift_works(session, seq, before, n_discard, outcomes)
        assert "no longer hold the same cells" in said and "seq_pos_min is now 4" in said
    finally:
        session.close()


def test_prompt_reuse_needs_the_window(model):
    results = lesson.prompt_reuse(model, n_past=30)
    assert "re-processes the whole prompt" in lesson.reuse_report(results, n_past=30)
    exact, why = lesson.reuse_answer(model, n_past=55)
    assert exact and "reuses it too" in why


def test_a_decode_steps_row_counts(model):
    counts, why = lesson.attended_after(model, n_tokens=50)
    assert counts == (51, lesson.WINDOW) and "position 50" in why


def test_the_mask_words_agree_with_the_mask_codes(model):
    """The sentence's numbers come from the mask: the swa row's masked cells are all outside the window."""
    bus = engine.EventBus()
    watcher = Watcher(bus.subscribe())
    ctx = engine.Context(model, **lesson.SETTINGS, bus=bus)
    toks = model.tokenizer.encode(lesson.REUSE_TEXT)[:41]
    lesson.decode_in_batches(ctx, toks[:40], 0)
    assert ctx.decode(engine.Batch([toks[40]], [40], [[0]])) == 0
    watcher.poll()
    swa = last_ubatch_mask(watcher, "swa")
    assert len(swa.cells(0, MaskCell.WINDOW)) == swa.n_used - lesson.WINDOW
    assert f"other {swa.n_used - lesson.WINDOW} cells" in lesson.mask_sentence(last_ubatch_mask(watcher, "base"), swa)
