"""kvscope.lessons.debugging: the scenarios of notebook 7 (debugging stories) behave as the notebook says, with
the one window the notebook states (swa_window=WINDOW in every story)."""
from __future__ import annotations

import json

import pytest

import engine
from kvscope.lessons import debugging

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model():
    return engine.load_model("demo")


@pytest.fixture(scope="module")
def no_cp(model):
    served = debugging.serve(model, ctx_checkpoints=0)
    yield served
    served.close()


def test_every_story_runs_with_the_one_window_the_notebook_states():
    for settings in (debugging.SERVER_SETTINGS, debugging.SHIFT_SETTINGS, debugging.CLIENT_SETTINGS):
        assert settings["swa_window"] == debugging.WINDOW == 16


def test_the_chat_script_goes_to_a_scratch_folder_not_the_working_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stripped, kept = debugging.chat_file("strip"), debugging.chat_file("keep")
    assert not list(tmp_path.iterdir()) and stripped.parent == kept.parent != tmp_path
    chat = json.loads(stripped.read_text(encoding="utf-8"))
    assert chat["reasoning"] == "strip" and json.loads(kept.read_text(encoding="utf-8"))["reasoning"] == "keep"
    assert len(chat["conversations"][0]["turns"]) == len(debugging.CHAT_TURNS)


def test_without_checkpoints_every_later_turn_is_forced(no_cp):
    debugging.check_forced(no_cp)
    debugging.check_swa_sizes(no_cp)
    texts = [debugging.decision_text(d) for d in no_cp.decisions()]
    assert "the whole prompt is new" in texts[0] and all("forced to re-process" in t for t in texts[1:])


def test_checkpoints_and_swa_full_each_process_fewer_tokens(model, no_cp, capsys):
    cp, full = debugging.serve(model), debugging.serve(model, swa_full=True)
    try:
        debugging.check_fixes(no_cp, cp, full)
        debugging.compare(no_cp, cp, full)
        table = capsys.readouterr().out
        assert "total" in table and str(no_cp.processed()) in table and str(full.cache_size("swa")) in table
    finally:
        cp.close()
        full.close()


def test_the_exercises_answers(model):
    """Exercise 1: one checkpoint per slot is enough here; exercise 2: with the <think> blocks kept, nothing is
    forced (the prompts part at the cache's end)."""
    one = debugging.serve(model, ctx_checkpoints=1)
    kept = debugging.serve(model, ctx_checkpoints=0, reasoning="keep")
    try:
        assert one.outcomes() == ["new", "restored", "restored"]
        assert kept.outcomes() == ["new", "kept", "kept"]
        assert all(d.pos_min < d.pos_min_thold for d in kept.decisions()[1:])
    finally:
        one.close()
        kept.close()


def test_the_context_shift_loses_the_system_prompt_unless_kept(model):
    lost = debugging.generate_until_shift(model, n_keep=0)
    kept = debugging.generate_until_shift(model, n_keep=len(debugging.system_ids(model.tokenizer)) - 1)
    try:
        debugging.check_system_prompt_lost(lost)
        debugging.check_system_prompt_kept(kept)
        assert debugging.SYSTEM.strip() in kept.text()
    finally:
        lost.close()
        kept.close()


def test_split_streams_refuse_the_passage_and_the_fixes_take_it(model):
    n_passage = len(model.tokenizer.encode(debugging.PASSAGE))
    clients = [debugging.four_clients(model, kv_unified=False), debugging.four_clients(model, kv_unified=True),
               debugging.four_clients(model, kv_unified=False, n_ctx=512)]
    try:
        debugging.check_split_failure(clients[0], n_passage)
        assert clients[1].rcs == clients[2].rcs == [0, 0, 0, 0]
        assert debugging.codes_text(clients[0].rcs) == "0, 0, 0, 1"
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("n, rc", [(64, 0), (65, 1)])
def test_the_longest_prompt_with_split_streams_is_one_stream(model, n, rc):
    """Exercise 4's answer: n_ctx / n_seq_max cells, whatever the other streams hold."""
    settings = dict(debugging.CLIENT_SETTINGS, kv_unified=False)
    ctx = engine.Context(model, **settings)
    tokens = (model.tokenizer.encode(debugging.PASSAGE) * 2)[:n]
    assert ctx.decode(engine.Batch.for_sequence([1, 2, 3], 0, 0)) == 0
    assert ctx.decode(engine.Batch.for_sequence(tokens, 3, 0)) == rc
    assert ctx.memory.base.size == 256 // 4 == 64
