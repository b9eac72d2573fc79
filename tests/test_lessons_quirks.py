"""kvscope.lessons.quirks: every QUIRK of notebook 8 happens in its scenario as the notebook says, on the demo
model's own 64-position window (the one window of the notebook)."""
from __future__ import annotations

import pytest

import engine
from kvscope.lessons import quirks

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo model is tiny: one thread decodes it fastest (as the notebook does)
    yield engine.load_model("demo")
    torch.set_num_threads(threads)


def test_the_notebook_keeps_the_demo_models_window(model):
    assert model.config.n_swa == 64
    for ctx, _ in (quirks.three_clients(model), quirks.shared_prompt(model), quirks.sequence_past_the_window(model)):
        assert ctx.cache_config.n_swa == 64


def test_text_tokens_run_on_without_a_second_bos(model):
    tokens = quirks.text_tokens(model, 300)
    bos = tokens[0]
    assert len(tokens) == 300 and tokens.count(bos) == 1
    assert quirks.text_tokens(model, 5, start=120) == tokens[120:125]


def test_the_dry_run_gives_stream_1_stream_0s_head_and_a_failure_keeps_it(model):
    ctx, watcher = quirks.context(model, n_ctx=64, n_seq_max=2, kv_unified=False, n_ubatch=8)
    quirks.decode(ctx, watcher, seq=0, p0=0, n=20)
    rc, events = quirks.decode(ctx, watcher, seq=1, p0=0, n=16)
    assert rc == 0 and quirks.head_after_rollback(quirks.rolled_back(events), 1) == 20
    assert quirks.heads(ctx) == [20, 16] and not quirks.marked(events)
    rc, events = quirks.decode(ctx, watcher, seq=1, p0=16, n=20)
    assert rc == 1 and quirks.heads(ctx) == [20, 20] and quirks.marked(events)
    assert quirks.heads_text(ctx) == "stream 0 at cell 20, stream 1 at cell 20"
    quirks.decode(ctx, watcher, seq=1, p0=16, n=4)
    assert quirks.stream_maps(watcher, "base")[1].endswith("1111111111111111....1111........")


def test_the_dry_run_purge_outlives_a_failed_decode(model):
    ctx, watcher = quirks.three_clients(model)
    assert quirks.free_cells(ctx) == 8
    rc, events = quirks.decode(ctx, watcher, seq=2, p0=quirks.SYSTEM, n=32)
    quirks.check_purge_outlives_failure(ctx, rc, events, 0)
    assert ctx.memory.swa.seq_pos_min(1) == quirks.SYSTEM  # the question's cells were rolled back, the prompt's not


def test_a_later_ubatch_purges_positions_the_first_one_still_sees(model):
    """The QUIRK table's point (docs/coming-from-llama-cpp.md): find_slot judges the second ubatch against the
    first one's positions, and the purge removes positions the first ubatch's tokens, computed after, still see."""
    ctx, watcher = quirks.shared_prompt(model)
    first = quirks.PROMPT + quirks.ASKED
    rc, events = quirks.decode(ctx, watcher, seq=1, p0=first, n=32, all_logits=True)
    (purge,) = quirks.purges(events)
    assert (purge.p0, purge.p1) == (0, 72)
    seen = quirks.purged_but_seen(ctx, purge, range(first, first + 16))
    assert seen == {p: list(range(p - 63, quirks.PROMPT)) for p in range(first, first + 7)}
    reference = quirks.full_cache_logits(model, 32)
    alone, alone_watcher = quirks.shared_prompt(model)
    quirks.decode(alone, alone_watcher, seq=1, p0=first, n=16, all_logits=True)
    quirks.check_seen_positions_purged(ctx, rc, events, quirks.logit_gaps(ctx, reference),
                                       quirks.logit_gaps(alone, reference[:16]), seen, first)


def test_with_fewer_own_tokens_more_windows_are_cut(model):
    """Exercise 2's answer: 52 own tokens, the purge reaches position 67, and 11 tokens lose positions."""
    ctx, watcher = quirks.shared_prompt(model, asked=52)
    first = quirks.PROMPT + 52
    rc, events = quirks.decode(ctx, watcher, seq=1, p0=first, n=32)
    seen = quirks.purged_but_seen(ctx, quirks.purges(events)[0], range(first, first + 16))
    assert rc == 0 and len(seen) == 11


def test_seq_div_stores_old_minus_new_and_the_k_shift_applies_it(model):
    ctx, watcher = quirks.context(model, n_ctx=64, swa_full=True)
    quirks.decode(ctx, watcher, seq=0, p0=0, n=12)
    mark = watcher.events
    ctx.memory.seq_div(0, 4, 8, 2)
    ctx.memory.seq_add(0, 8, 12, -4)
    div, add = quirks.shifts_since(watcher, mark)
    quirks.check_div_sign(div, add)
    assert quirks.shift_text(div) == "div: positions [4, 5, 6, 7] became [2, 2, 3, 3], pending shift [2, 3, 3, 4]  ! QUIRK"
    _, events = quirks.decode(ctx, watcher, seq=0, p0=ctx.memory.seq_pos_max(0) + 1, n=1)
    turned = quirks.rotations(events)
    assert [turned[c] for c in range(4, 12)] == [2, 3, 3, 4, -4, -4, -4, -4]


def test_llama_server_searches_its_checkpoints_only_while_the_chat_is_shorter_than_the_window(model):
    for ctx_checkpoints in (32, 0):
        quirks.check_search_though_cached(quirks.serve(model, quirks.SHORT_CHAT, ctx_checkpoints=ctx_checkpoints),
                                          model.config.n_swa)
    long = quirks.serve(model, quirks.long_first_message(quirks.SHORT_CHAT)).last()
    assert long.n_common > model.config.n_swa and not long.quirk and long.n_past == long.n_common
    assert "no search happened" in quirks.search_text(long)


def test_cache_reuse_moves_the_answer_and_without_it_only_the_prefix_is_reused(model):
    reuse = quirks.serve(model, quirks.REASONING_CHAT, swa_full=True, cache_reuse=4)
    quirks.check_reuse_moved(reuse)
    plain = quirks.serve(model, quirks.REASONING_CHAT, swa_full=True, cache_reuse=0).last()
    assert plain.n_past == plain.n_common < reuse.last().n_past and not plain.quirk


def test_the_pair_answers_seq_pos_max_from_swa_alone(model):
    ctx, watcher = quirks.sequence_past_the_window(model)
    assert (ctx.memory.seq_pos_max(0), ctx.memory.base.seq_pos_max(0), ctx.memory.swa.seq_pos_max(0)) == (-1, 39, -1)
    assert quirks.decode(ctx, watcher, seq=0, p0=0, n=1)[0] == 0
    assert quirks.future_cells(watcher) == 38  # positions 2..39: after the next token's, position 1


def test_a_ubatch_holds_n_ubatch_plus_one_sequences(model):
    ctx, watcher = quirks.context(model, n_ctx=64, n_seq_max=4, kv_unified=False, n_ubatch=2)
    tokens = quirks.text_tokens(model, 4)
    assert ctx.decode(engine.Batch(tokens=tokens, pos=[0] * 4, seq_ids=[[0], [1], [2], [3]])) == 0
    assert quirks.ubatch_sizes(watcher) == [3, 1]


def test_a_sequence_at_or_above_n_seq_max_is_lost_in_a_saved_state(model):
    ctx, watcher = quirks.context(model, n_ctx=64, n_seq_max=2, kv_unified=True)
    quirks.decode(ctx, watcher, seq=0, p0=0, n=6)
    ctx.memory.seq_cp(0, 5, -1, -1)
    ctx.memory.seq_rm(0, -1, -1)
    restored, _ = quirks.context(model, n_ctx=64, n_seq_max=2, kv_unified=True)
    restored.state_set_data(ctx.state_get_data())
    assert quirks.orphan_cells(ctx) == 0 and quirks.orphan_cells(restored) == 6


def test_cells_and_positions_read_in_words():
    cells = [(0, frozenset({5}), 0), (1, frozenset(), 0)]
    assert quirks.cells_text(cells, 2) == ["cell 0: position 0, held by sequence 5",
                                           "cell 1: position 1, held by no sequence"]
    assert quirks.positions_text([63]) == "position 63" and quirks.positions_text([57, 58, 63]) == "positions 57 to 63"
