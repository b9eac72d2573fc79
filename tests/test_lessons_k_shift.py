"""Notebook 4's lesson module (kvscope/lessons/k_shift.py): its checks hold on the engine, fail when what they
guard is false, and its pictures draw what the notebook's captions say."""
from __future__ import annotations

import math

import pytest
import torch

import engine
from engine.models.config import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from kvscope.lessons import k_shift
from tests.model_factory import in_memory_model

pytest.importorskip("plotly")


@pytest.fixture(scope="module")
def demo():
    return engine.load_model("demo")


@pytest.fixture(scope="module")
def verse(demo):
    return demo.tokenizer.encode(k_shift.VERSE)


def moved_whole(model, tokens, delta, **settings):
    """Section 1 as the notebook runs it: snapshots before, between (pending) and after the K-shift, and a fresh run."""
    n = len(tokens)
    ctx, fresh = k_shift.context(model, **settings), k_shift.context(model, **settings)
    k_shift.decode(ctx, tokens[:-1], range(n - 1))
    before = k_shift.Snapshot.of(ctx)
    ctx.memory.seq_add(0, 0, -1, delta)
    pending = k_shift.Snapshot.of(ctx)
    k_shift.decode(ctx, tokens[-1:], [n - 1 + delta])
    k_shift.decode(fresh, tokens, range(delta, n + delta))
    return ctx, fresh, before, pending, k_shift.Snapshot.of(ctx)


def test_pairs_are_adjacent_dims_for_norm_and_half_a_head_apart_for_neox():
    assert k_shift.pair_dims(ROPE_TYPE_NORM, 64, 3) == (6, 7)
    assert k_shift.pair_dims(ROPE_TYPE_NEOX, 64, 3) == (3, 35)
    with pytest.raises(ValueError, match="pairs 0..31"):
        k_shift.pair_dims(ROPE_TYPE_NEOX, 64, 32)


def test_a_rotation_by_a_then_b_is_a_rotation_by_a_plus_b():
    x, y = k_shift.rotate(*k_shift.rotate(0.3, -1.2, 0.7), 2.1)
    assert math.dist((x, y), k_shift.rotate(0.3, -1.2, 2.8)) < 1e-12
    assert math.hypot(x, y) == pytest.approx(math.hypot(0.3, -1.2))


def test_the_demo_models_full_layer_turns_pair_0_one_radian_per_position(demo):
    theta = k_shift.angles_per_position(demo, layer=5)
    assert theta.shape == (demo.config.head_dim // 2,)
    assert theta[0].item() == 1.0 and theta[1].item() == pytest.approx(1e6 ** (-2 / 64))
    assert 1000 * theta[-1].item() < 0.01  # "the last pairs barely move in a thousand positions"
    assert "layer 5" in k_shift.introduce(demo, [1, 2, 3]) and "NEOX" in k_shift.introduce(demo, [1, 2, 3])


def test_seq_add_moves_positions_only_and_the_next_decode_rotates_keys_only(demo, verse):
    ctx, fresh, before, pending, after = moved_whole(demo, verse, 16)
    said = k_shift.check_seq_add(before, pending, delta=16)
    assert f"{len(verse) - 1} cells from positions 0-{len(verse) - 2} to 16-{len(verse) + 14}" in said
    assert "pending shift of +16" in said
    with pytest.raises(AssertionError):
        k_shift.check_seq_add(before, pending, delta=8)  # the shift recorded is the one asked for
    said = k_shift.check_k_shift(pending, after)
    assert f"new token in cell {len(verse) - 1} at position {len(verse) + 15}" in said
    with pytest.raises(AssertionError):
        k_shift.check_k_shift(pending, pending)  # nothing was applied yet
    assert "untouched" in k_shift.check_values(after, k_shift.Snapshot.of(fresh))
    assert "largest difference" in k_shift.check_logits(ctx, fresh)
    figure = k_shift.cells_figure({"before": before, "pending": pending, "after": after})
    assert list(figure.data[0].y) == ["after", "pending", "before"]
    assert figure.data[0].z[1][0] == 2 and figure.data[0].text[1][0] == "16"  # pending: orange, the new position


def test_the_k_shift_of_a_neox_model_turns_dims_i_and_i_plus_half_by_delta_theta(demo, verse):
    _, fresh, before, _, after = moved_whole(demo, verse, 16)
    check = k_shift.rope_pairs(demo, before, after, k_shift.Snapshot.of(fresh), cell=5, pairs=(0, 4, 10))
    assert [p.i for p in check.pairs] == [0, 4, 10] and check.n_pairs == 32
    assert check.pairs[1].dims == (4, 36) and check.pairs[1].turned == pytest.approx(16 * 1e6 ** (-8 / 64))
    assert check.rotation_error < k_shift.ROTATION_TOLERANCE and check.fresh_error < k_shift.FRESH_TOLERANCE
    assert math.dist(check.pairs[0].stored, check.pairs[0].fresh) > 0.1  # the stored key is not the new position's
    figure = k_shift.rope_figure(check)
    assert len(figure.layout.annotations) == 3 and "pair 4 (dims 4 and 36)" in figure.layout.annotations[1].text
    assert "wound 2.5 times" in k_shift.rope_caption(check)
    assert "0, 32" in k_shift.pairs_table(check)


def test_the_k_shift_of_a_norm_model_turns_adjacent_dims(verse):
    """The picture's pairing follows the model: on a llama (NORM) model dims 2i, 2i + 1 turn together, and
    reading the NEOX pairs there would not be a rotation (the check would fail)."""
    model = in_memory_model()
    tokens = [t % model.config.n_vocab for t in verse[:12]]
    _, fresh, before, _, after = moved_whole(model, tokens, 5)
    check = k_shift.rope_pairs(model, before, after, k_shift.Snapshot.of(fresh), cell=2, pairs=(0, 3))
    assert check.pairs[1].dims == (6, 7) and check.rotation_error < k_shift.ROTATION_TOLERANCE
    key_before, key_after = before.key(2), after.key(2)
    wrong = [(key_before[i].item(), key_before[i + 4].item()) for i in range(4)]
    wrong_after = [(key_after[i].item(), key_after[i + 4].item()) for i in range(4)]
    theta = k_shift.angles_per_position(model, layer=0)
    assert max(math.dist(k_shift.rotate(*w, 5 * theta[i].item()), a)
               for i, (w, a) in enumerate(zip(wrong, wrong_after))) > 1e-3


def test_the_rotation_is_compared_on_an_f32_cache_only(demo, verse):
    _, fresh, before, _, after = moved_whole(demo, verse[:10], 4, type_k="f16", type_v="f16")
    with pytest.raises(ValueError, match="f32"):
        k_shift.rope_pairs(demo, before, after, k_shift.Snapshot.of(fresh), cell=2, pairs=(0,))


def test_an_f16_cache_shifts_up_to_f16_rounding(demo, verse):
    said = k_shift.check_f16_shift(demo, verse, delta=16)
    assert said.startswith("With f16 K/V the same shift leaves the logits within")


def test_a_context_shift_leaves_a_cache_that_is_neither_the_full_text_nor_a_fresh_run(demo, verse):
    forgot = k_shift.forget(demo, verse[:-1], n_keep=4, n_discard=16)
    assert forgot.kl(forgot.shifted, forgot.rerun) > k_shift.MIN_KL
    assert forgot.kl(forgot.shifted, forgot.full) > k_shift.MIN_KL
    assert forgot.dropped == demo.tokenizer.decode(verse[4:20])
    cell = forgot.before.cell_at(30)
    assert k_shift.Snapshot.of(forgot.shifted).cells[cell][0] == 14  # exercise 1: 30 - 16, in the same cell
    assert "Most likely next token" in k_shift.describe_forgetting(forgot, demo)
    assert "full text" in k_shift.forgetting_table(forgot, demo)
    assert {trace.name for trace in k_shift.forgetting_figure(forgot, demo).data} == {
        "full text", "context-shifted", "fresh run of the kept tokens"}


def test_seq_div_records_old_minus_new_as_the_shift(demo, verse):
    before, after = k_shift.seq_div_moment(demo, verse, 2)
    cell = before.cell_at(21)
    assert after.cells[cell][0] == 10 and after.cells[cell][2] == 11


def test_a_pair_without_swa_full_says_it_cannot_shift_and_shifts(demo, verse):
    assert k_shift.can_shift_without_swa_full(demo, verse[:8], delta=8) == (False, 0)


class Polled:
    """What run_until_context_shift needs of a view (a watcher and update()), without drawing anything."""

    def __init__(self, watcher) -> None:
        self.watcher = watcher

    def update(self) -> None:
        self.watcher.poll()


def test_a_sessions_context_shift_is_read_from_its_events(demo):
    from engine.runners.session import Session
    from engine.runners.workloads import WorkloadSpec
    from engine.watch import Watcher

    prompt = "And God said unto Moses, I AM THAT I AM: and he said"  # ~20 tokens: a few steps fill 32 cells
    session = Session(demo, settings=dict(n_ctx=32, pad=32, swa_full=True), threaded=False,
                      workload=WorkloadSpec("generate", n_predict=60, context_shift=True, n_keep=2,
                                            sampler=dict(temperature=0.0)))
    try:
        view = Polled(Watcher.of(session))
        session.add_prompt(prompt).result()
        session.start().result()
        step = k_shift.run_until_context_shift(session, view, view)
        assert k_shift.swap_line(session).startswith("context full, swapping: n_past = 31")
        lines = k_shift.shift_step_lines(step)
        kinds = [line.split()[0] for line in lines]
        assert kinds == ["CellsRemoved", "CellsShifted", "KShiftApplied", "CellsAllocated"]
        shift = k_shift.ContextShift.of(step)
        assert (shift.n_keep, shift.n_discard, shift.n_past, shift.new_cell) == (3, 14, 31, 3)
        assert shift.cells_to_explain() == (0, 2, 3, 17)
        assert "cells 4-16 are the discarded tokens' empty cells" in shift.caption()
        said = k_shift.check_context_shift(session, shift, asked_keep=2, prompt=prompt)
        assert said.startswith("Cell 3 holds position 17 and cell 17 position 3")
    finally:
        session.close()


def test_decode_refuses_a_failed_decode(demo):
    ctx = k_shift.context(demo, n_ctx=32)
    k_shift.decode(ctx, list(range(5, 25)), range(20))
    with pytest.raises(AssertionError, match="decode returned 1"):  # 20 more tokens do not fit in 32 cells
        k_shift.decode(ctx, list(range(25, 45)), range(20, 40))


def test_snapshot_finds_a_token_by_position_not_by_cell(demo):
    ctx = k_shift.context(demo)
    k_shift.decode(ctx, [5, 6, 7], [10, 11, 12])
    snap = k_shift.Snapshot.of(ctx)
    assert snap.cell_at(11) == 1 and snap.used() == [0, 1, 2]
    assert snap.key(1).shape == (demo.config.head_dim,) and snap.keys.dtype == torch.float32
    with pytest.raises(AssertionError, match="0 cells hold seq 0 at pos 3"):
        snap.cell_at(3)
