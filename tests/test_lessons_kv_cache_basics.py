"""kvscope/lessons/kv_cache_basics.py keeps notebook 1's prose true: one cell per prompt token, one token
computed per cached step and the whole text per uncached one, the bytes of a cell against what the engine
allocates, base alone in the views with swa holding the same cells (swa_full). Times are never asserted: the
loops take a timer, and these tests give them one that returns a constant."""
from __future__ import annotations

import pytest

import engine
from engine.kv.types import cache_type
from kvscope.lessons import kv_cache_basics as lesson

PROMPT = "And God said unto Moses, I AM THAT I AM"


@pytest.fixture(scope="module")
def model():
    return engine.load_model("demo")


def no_clock(call) -> float:
    """A timer that runs the call and says it took a millisecond: the counts must not depend on the time."""
    call()
    return 1e-3


# ---- cells, in words -------------------------------------------------------------------------------------------
def test_cells_table_says_cells_in_words_not_reprs():
    cells = [(0, frozenset({0}), 0), (1, frozenset({0, 2}), -3), (-1, frozenset(), 0)]
    table = lesson.cells_table(cells, [0, 1, 2], token_text=lambda pos: ["<bos>", "And"][pos])
    assert "frozenset" not in table
    lines = table.splitlines()
    assert lines[0] == "| cell | position | sequences | pending shift | token |"
    assert lines[2] == "| 0 | 0 | 0 | 0 | `'<bos>'` |"
    assert lines[3] == "| 1 | 1 | 0, 2 | -3 | `'And'` |"
    assert lines[4] == "| 2 | -1 (empty) | none | 0 |  |"
    assert lesson.used_cells(cells) == [0, 1]


def test_a_prefill_in_an_empty_cache_takes_one_cell_per_token_from_cell_0(model):
    n = len(model.tokenizer.encode(PROMPT))
    assert lesson.prefill_in_fresh_context(model, PROMPT) == (n, n)  # n cells; the head right after them


def test_the_prefill_check_fails_on_cells_that_are_not_one_per_token():
    with pytest.raises(AssertionError):
        lesson.assert_one_cell_per_token([(0, frozenset({0}), 0), (-1, frozenset(), 0)], 2)
    with pytest.raises(AssertionError):
        lesson.assert_one_cell_per_token([(1, frozenset({0}), 0), (0, frozenset({0}), 0)], 2)


# ---- the live views of base ------------------------------------------------------------------------------------
def test_the_views_show_base_alone_and_swa_holds_the_same_cells(model):
    pytest.importorskip("ipywidgets")
    from engine.runners.session import Session
    from engine.runners.workloads import WorkloadSpec

    session = Session(model, settings=dict(n_ctx=64, pad=32, swa_full=True),
                      workload=WorkloadSpec("generate", n_predict=8), threaded=False)
    try:
        grid, log = lesson.base_grid(session, columns=32), lesson.base_log(session, lines=8)
        assert [t.name for t in grid.figure.data[::8]] == ["base s0"], "one lane: base"
        session.add_prompt(PROMPT).result()
        session.start().result()
        session.step(1).result()
        grid.update()
        n = len(model.tokenizer.encode(PROMPT))
        assert lesson.watched_cells(grid) == (n, n)
        session.step(2).result()
        grid.update()
        assert lesson.watched_cells(grid) == (n + 2, n + 2)
        assert lesson.written_in(grid, [0, n, n + 1]) == [0, 1, 2]
        assert lesson.cell_stories(grid, [0])[0].startswith("cell 0: allocated in decode 0 for seq 0")
        kept = log.update() or log.kept()
        assert kept and all(getattr(e, "cache", "base") == "base" for e in kept)
        assert log.cache.value == "base"
    finally:
        session.close()


def test_the_pair_check_fails_when_swa_holds_other_cells():
    from engine.watch.mirror import CacheMirror

    class Mirror(CacheMirror):
        def cells(self, stream=0, cache="kv"):
            return [(0, frozenset({0}), 0)] if cache == "base" else [(-1, frozenset(), 0)]

        def head(self, stream=0, cache="kv"):
            return 1

    with pytest.raises(AssertionError):
        lesson.assert_pair_alike(Mirror())


# ---- work per token --------------------------------------------------------------------------------------------
def test_the_cache_changes_the_work_not_the_text(model):
    prompt = model.tokenizer.encode("In the beginning")
    calls = []

    def counting(call) -> float:
        calls.append(call)
        return no_clock(call)

    cached = [lesson.greedy(model, prompt, 5, cache=True, timed=counting)]
    recomputed = [lesson.greedy(model, prompt, 5, cache=False, timed=counting)]
    assert len(calls) == 10 and cached[0].seconds == [1e-3] * 5, "every step is timed by the timer given"
    assert cached[0].computed == [1] * 5
    n = len(prompt)
    assert recomputed[0].computed == [n + 1, n + 2, n + 3, n + 4, n + 5]
    lesson.assert_work(cached, recomputed, n)
    other = lesson.GreedyRun(cached[0].tokens[:-1] + [cached[0].tokens[-1] + 1], [1e-3] * 5, [1] * 5)
    with pytest.raises(AssertionError):
        lesson.assert_work([other], recomputed, n)


def runs(computed: list[int], seconds: list[list[float]]) -> list[lesson.GreedyRun]:
    return [lesson.GreedyRun([], s, computed) for s in seconds]


def test_times_are_medians_of_the_runs_and_the_words_say_both_work_and_time():
    cached = runs([1, 1], [[0.001, 0.001], [0.003, 0.002], [0.002, 0.009]])
    recomputed = runs([5, 6], [[0.004, 0.006], [0.004, 0.006], [0.004, 0.006]])
    assert lesson.median_seconds(cached) == [0.002, 0.002]
    table = lesson.work_table(cached, recomputed, steps=(2,))
    assert table.splitlines()[-1] == "| 2 | 1 | 6 | 2.00 | 6.00 |"
    assert lesson.work_sentence(cached, recomputed) == (
        "Over all 2 steps: 2 tokens computed with the cache, 11 without (6x the work); 4 ms against 10 ms "
        "(2.5x the time on this machine, just now).")
    assert lesson.growth_sentence(recomputed, n=1).startswith(
        "Without the cache, the last 1 steps computed 1.2x the tokens of the first 1 and took 1.5x as long")
    figure = lesson.work_and_time_figure(cached, recomputed, n_prompt=4)
    assert [list(t.x) for t in figure.data] == [[5, 6]] * 4
    assert [t.name for t in figure.data] == ["with the cache"] * 2 + ["without"] * 2
    assert list(figure.data[2].y) == [5, 6] and list(figure.data[3].y) == [4.0, 6.0]
    assert len(lesson.work_and_time_figure(cached, n_prompt=4).data) == 2, "the cached runs alone: two lines"


def test_a_prefill_computes_its_tokens_in_one_call_and_a_decode_one(model):
    prompt = model.tokenizer.encode(PROMPT)
    prefill, decode = lesson.prefill_and_decode(model, prompt, timed=no_clock, rounds=2)
    assert (prefill.computed, decode.computed) == (len(prompt), 1)
    assert prefill.seconds == decode.seconds == 1e-3
    table = lesson.calls_table(prefill, decode)
    assert f"| prefill | {len(prompt)} | 1.00 |" in table and "| decode | 1 | 1.00 | 1.000 | 1000 |" in table


def test_the_default_timer_measures_the_call():
    seen = []
    assert lesson.timed(lambda: seen.append(1)) >= 0 and seen == [1]


# ---- bytes -----------------------------------------------------------------------------------------------------
def test_bytes_per_cell_is_layers_times_k_and_v_rows():
    assert lesson.bytes_per_cell(32, 8, 128) == 128 * 1024  # Llama 3 8B, f16
    assert lesson.bytes_per_cell(28, 4, 128) == 56 * 1024  # Qwen2.5 7B, f16
    assert lesson.bytes_per_cell(1, 1, 64, bytes_per_number=4) == 512
    assert lesson.bytes_per_number(cache_type("f16")) == 2
    assert lesson.bytes_per_number(cache_type("q8_0")) == 34 / 32  # a block of 32 numbers in 34 bytes


def test_the_bytes_of_a_cell_are_what_the_engine_allocates(model):
    f16 = lesson.allocated_bytes(model, 512)
    assert f16 == 512 * lesson.bytes_per_cell(1, model.config.n_head_kv, model.config.head_dim)
    assert lesson.allocated_bytes(model, 512, type_k="f32", type_v="f32") == 2 * f16
    assert lesson.allocated_bytes(model, 512, type_k="q8_0", type_v="q8_0") == 512 * 2 * 64 * 34 // 32


def test_the_pair_holds_every_layer_once_per_cell(model):
    ctx = lesson.context(model, 512)
    pair, weights = lesson.pair_and_weight_bytes(ctx)
    config = model.config
    assert pair == 512 * lesson.bytes_per_cell(config.n_layer, config.n_head_kv, config.head_dim)
    assert weights > pair > 0
