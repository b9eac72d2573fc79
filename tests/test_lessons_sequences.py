"""Notebook 3's lesson module (kvscope/lessons/sequences.py): the base-cache grid, the maps and masks it prints,
and the checks that keep the notebook's sentences true. The parallel run itself is exercised by the notebook
(tests/test_notebooks.py); here its story is read from events made by hand."""
from __future__ import annotations

import pytest

pytest.importorskip("plotly")

import engine  # noqa: E402
from engine import events as ev  # noqa: E402
from engine.watch.attention_mask import last_ubatch_mask  # noqa: E402
from kvscope.lessons import sequences as lesson  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return engine.load_model("demo")


def unified(model, n_ctx: int = 64) -> engine.Context:
    return engine.Context(model, n_ctx=n_ctx, pad=32, n_seq_max=4, kv_unified=True, swa_full=True)


def test_the_grid_draws_the_base_cache_alone_and_lists_new_events_once(model):
    ctx = unified(model)
    grid = lesson.base_grid(ctx, columns=32)
    frame = grid.update()
    assert [(s.cache, s.stream) for s in frame.streams] == [("base", 0)]  # the swa cache is left out
    assert grid.new_events("CellsChanged") == []  # the state so far is drawn, not listed
    assert ctx.decode(engine.Batch.for_sequence(model.tokenizer.encode("And God said"), 0, 0)) == 0
    ctx.memory.seq_cp(0, 1, -1, -1)
    copied = grid.new_events("CellsCopied")
    assert [(e.cache, e.src_seq, e.dst_seq) for e in copied] == [("base", 0, 1)]  # the swa cache's copy is left out
    assert grid.event_lines("CellsCopied") == ""  # listed once
    assert grid.update().stream("base").used == 4


def test_a_batch_of_prompts_starts_each_sequence_at_position_zero_and_fills_a_unified_cache_in_order(model):
    batch = lesson.prompts_batch(model, ["And God said", "In the beginning"])
    assert batch.pos == [0, 1, 2, 3, 0, 1, 2, 3] and batch.seq_ids == [[0]] * 4 + [[1]] * 4
    assert lesson.batch_lines(model, batch).splitlines() == ["seq 0, pos 0-3: <bos> 'And' ' God' ' said'",
                                                             "seq 1, pos 0-3: <bos> 'In' ' the' ' beginning'"]
    ctx = unified(model)
    assert ctx.decode(batch) == 0
    lesson.check_in_batch_order(ctx, batch)
    assert lesson.stream_maps(ctx) == "stream 0: " + "00001111" + "." * 56 + "  (8/64 used, head 8)"
    assert lesson.positions_words(ctx, range(2)) == "seq 0 at positions 0-3, seq 1 at positions 0-3"
    ctx.memory.seq_rm(0, -1, -1)
    with pytest.raises(AssertionError):
        lesson.check_in_batch_order(ctx, batch)


def test_the_shared_prefix_and_what_each_token_of_the_next_batch_attends_to(model):
    prefix = model.tokenizer.encode("Thou art a helpful scribe.")
    words = model.tokenizer.encode(" And Moses Aaron Noah", add_bos=False)
    n = len(prefix)
    ctx = unified(model)
    watcher = lesson.watcher_of(ctx)
    assert ctx.decode(engine.Batch.for_sequence(prefix, 0, 0)) == 0
    for dst in (1, 2, 3):
        ctx.memory.seq_cp(0, dst, -1, -1)
    assert ctx.decode(engine.Batch(tokens=words, pos=[n] * 4, seq_ids=[[0], [1], [2], [3]])) == 0
    watcher.poll()
    mask = last_ubatch_mask(watcher, "base")
    lesson.check_shared_prefix(ctx, mask, n, range(4))
    assert lesson.shared_cells(ctx, range(4)) == n and lesson.own_cells(ctx, 2) == [n + 2]
    assert mask.counts().tolist() == [n + 1] * 4
    assert lesson.stream_maps(ctx).startswith("stream 0: " + "M" * n + "0123.")
    ctx.memory.seq_rm(3, -1, -1)  # seq 3 leaves the shared cells: no longer what the notebook says
    watcher.poll()
    with pytest.raises(AssertionError):
        lesson.check_shared_prefix(ctx, last_ubatch_mask(watcher, "base"), n, range(4))


def test_the_exercises_answers_follow_the_cell_rules(model):
    prefix = model.tokenizer.encode("Thou art a helpful scribe.")
    words = model.tokenizer.encode(" And Moses Aaron Noah", add_bos=False)
    n = len(prefix)
    assert lesson.used_after(model, prefix, words, "seq_rm", 0) == n + 3  # the shared cells stay for seqs 1-3
    assert lesson.used_after(model, prefix, words, "seq_keep", 2) == n + 1
    with pytest.raises(ValueError, match="seq_rm"):
        lesson.used_after(model, prefix, words, "seq_add", 0)
    assert lesson.stream_size(model, n_ctx=256, n_seq_max=4) == 64
    assert lesson.stream_size(model, n_ctx=100, n_seq_max=4) == 32  # 25 rounded up to the padding
    prompt = lesson.long_prompt(model, 40)
    assert lesson.split_decode_rc(model, prompt, n_ctx=256, n_seq_max=4) == 0
    assert lesson.split_decode_rc(model, prompt, n_ctx=128, n_seq_max=4) == 1


def test_a_split_cache_refuses_a_prompt_longer_than_a_stream_and_copies_streams(model):
    ctx = engine.Context(model, n_ctx=128, pad=32, n_seq_max=4, kv_unified=False, swa_full=True)
    assert ctx.decode(engine.Batch.for_sequence(lesson.long_prompt(model, 40), 1, 0)) == 1
    assert lesson.free_cells(ctx) == [32] * 4 and lesson.total_cells(ctx) == 128
    system = model.tokenizer.encode("Thou art a helpful scribe.")
    assert ctx.decode(engine.Batch.for_sequence(system, 0, 0)) == 0
    ctx.memory.seq_cp(0, 2, -1, -1)
    lesson.check_stream_copy(ctx, 0, 2)
    assert lesson.used_cells(ctx) == 2 * len(system)
    assert lesson.seq_cells(ctx, 2, stream=2) == list(range(len(system)))
    with pytest.raises(AssertionError):
        lesson.check_stream_copy(ctx, 0, 3)  # stream 3 got nothing


def story_events(*, lone_rc: int = 1, decoded_after: tuple[int, ...] = (4,)) -> list[ev.Event]:
    """A workload step as the parallel runner publishes it: 4 tokens fail, 2 fit, 2 fail, seq 3 alone fails
    and its request ends, seq 4 alone fits."""
    events: list[ev.Event] = []
    step = 38

    def decode(seqs, rc):
        nonlocal step
        events.append(ev.DecodeStarted(n_tokens=len(seqs), n_outputs=len(seqs), seq_ids=tuple(seqs), step=step))
        if rc == 1:
            events.append(ev.SlotSearchFailed(cache="swa", stream=0, n_tokens=len(seqs), size=256, used=250, head=0))
            events.append(ev.SlotSearchFailed(cache="base", stream=0, n_tokens=len(seqs), size=256, used=254, head=254))
        events.append(ev.DecodeFinished(rc=rc, n_tokens=len(seqs), ubatch_sizes=(), ms_total=0.5))
        step += 1

    decode((1, 2, 3, 4), 1)
    decode((1, 2), 0)
    decode((3, 4), 1)
    decode((3,), lone_rc)
    cause = "the end of request 2 (error: Context size has been exceeded.)"
    events.append(ev.CellsRemoved(cache="base", changes=(), seq_id=3, n_freed=52, cause=cause))
    for seqs in ((s,) for s in decoded_after):
        decode(seqs, 0)
    events.append(ev.WorkloadStep(step=39, workload="parallel", phase="generate", n_tokens=4, n_sampled=3, rc=0, ms=1.0))
    return events


def test_the_retry_story_reads_a_failed_step_from_its_events():
    story = lesson._retry_story(story_events(), ("main : failed to decode the batch, retrying with n_batch = 2",))
    assert story.step == 39 and story.sizes == [4, 2, 2, 1, 1] and story.failures == 3
    assert story.tries[0].used == 254 and story.tries[1].used == -1  # the base cache's count, not the swa's
    assert [(e.seq, e.n_freed) for e in story.ended] == [(3, 52)]
    lesson.check_retry(story)
    lines = story.table().splitlines()
    assert lines[0] == "decode 38: 4 tokens of seq 1, 2, 3, 4  -> rc 1: no slot (254/256 cells used)"
    assert lines[4] == ('    the request of seq 3 ends: "Context size has been exceeded."; its 52 cells are freed')
    assert lines[5] == "decode 42: 1 token of seq 4  -> rc 0: placed and computed"


def test_the_retry_check_refuses_what_the_notebook_does_not_say():
    with pytest.raises(AssertionError):  # seq 4's token was never decoded: the others did not go on
        lesson.check_retry(lesson._retry_story(story_events(decoded_after=()), ()))
    with pytest.raises(AssertionError):  # the lone token fitted: no request should have ended
        lesson.check_retry(lesson._retry_story(story_events(lone_rc=0), ()))
    with pytest.raises(AssertionError, match="did not finish"):
        lesson._retry_story(story_events()[:-1], ())


def test_the_parallel_settings_are_the_demos_with_the_models_own_window():
    assert lesson.PARALLEL_SETTINGS["swa_full"] and "swa_window" not in lesson.PARALLEL_SETTINGS
    assert lesson.N_CLIENTS * lesson.SLOT_CELLS > lesson.PARALLEL_SETTINGS["n_ctx"]
    assert lesson.PARALLEL_SETTINGS["n_seq_max"] == lesson.N_CLIENTS + 1  # seq 0 keeps the system prompt
