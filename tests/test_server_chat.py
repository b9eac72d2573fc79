"""Scripted conversations on the server simulation: the template, the script format and its errors, the
runner, and `kvscope server-sim` (on the demo model: its 64-token window, llama-server's batch sizes)."""
from __future__ import annotations

import json

import pytest

import engine
from engine.cli import main
from engine.runners.server import ServerLog, ServerParams, ServerSim
from engine.runners.server.chat import Message, answer_tokens, render
from engine.runners.server.conversations import ChatRunner, ScriptError, load_script, parse_script


@pytest.fixture(scope="module")
def demo():
    return engine.load_model("demo")


def sim_of(model, *, n_slots=2, swa_full=False, **params) -> ServerSim:
    ctx = engine.Context(model, n_ctx=2048, n_seq_max=n_slots, swa_full=swa_full)
    return ServerSim(ctx, ServerParams(n_slots=n_slots, **params), log=ServerLog(ctx.bus, verbose=False))


def test_the_template_keeps_messages_apart_and_strips_reasoning(demo):
    tok = demo.tokenizer
    history = [Message("system", "Be brief."), Message("user", "Who was Moses?"),
               Message("assistant", "<think>long thoughts</think>A prophet."), Message("user", "And Aaron?")]
    kept, stripped = render(tok, history), render(tok, history, reasoning="strip")
    first_answer = render(tok, history[:2])
    # the prompt of turn 1, then the answer as generated, is exactly the start of turn 2's prompt
    generated = first_answer.tokens + answer_tokens(tok, history[2].text)
    assert kept.tokens[:len(generated)] == generated
    assert stripped.tokens[:len(first_answer.tokens)] == first_answer.tokens
    assert stripped.tokens[len(first_answer.tokens):len(generated)] != generated[len(first_answer.tokens):]
    assert "think" not in tok.decode(stripped.tokens) and "think" in tok.decode(kept.tokens)
    for prompt in (kept, stripped):
        assert len(prompt.user_starts) == 2
        for start in prompt.user_starts:
            assert tok.decode(prompt.tokens[start:start + 3]).startswith("User")


@pytest.mark.parametrize("script, message", [
    ({}, "non-empty list \"conversations\""),
    ({"conversations": [{"turns": []}]}, "conversations[0]: expected a non-empty list \"turns\""),
    ({"conversations": [{"turns": [{"usr": "hi"}]}]}, "conversations[0].turns[0]: unknown key 'usr'"),
    ({"conversations": [{"turns": [{"assistant": "hi"}]}]}, "turns[0]: a turn needs \"user\""),
    ({"conversations": [{"turns": [{"user": "hi", "n_predict": 0}]}]}, "n_predict must be a whole number >= 1"),
    ({"conversations": [{"slot": "a", "turns": [{"user": "hi"}]}]}, "slot must be a slot number or -1"),
    ({"reasoning": "hide", "conversations": [{"turns": [{"user": "hi"}]}]}, "reasoning: expected one of keep, strip"),
    ({"conversations": [{"turns": [{"user": "hi", "insert": {"at": 0, "role": "system", "text": "x"}}]}]},
     "insert.role must be user, assistant or tool"),
])
def test_a_bad_script_names_what_is_wrong(script, message):
    with pytest.raises(ScriptError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_script(script, "chat.json")


def test_an_unreadable_script_names_the_file(tmp_path):
    bad = tmp_path / "chat.json"
    bad.write_text("{ not json")
    with pytest.raises(ScriptError, match=r"chat.json: not JSON: .* line 1"):
        load_script(bad)
    with pytest.raises(ScriptError, match="cannot read the conversation script"):
        load_script(tmp_path / "missing.json")


def two_turns(**second) -> list:
    long_answer = "<think>" + " ".join(["The User asks about Moses and the law."] * 30) + "</think>A prophet."
    return parse_script({"conversations": [{"name": "a", "slot": 0, "reasoning": "strip", "turns": [
        {"user": "Who was Moses?", "assistant": long_answer}, {"user": "And Aaron?", "n_predict": 2, **second}]}]})


def test_a_stripped_reasoning_block_forces_re_processing_unless_the_swa_cache_is_full(demo):
    """The first answer is long (a reasoning block of ~300 tokens): the SWA cache (64-token window, 768 cells)
    still holds the positions where the second prompt parts from the first, so the prefix is kept, with or
    without --swa-full. A changed system prompt parts at once: nothing before it survives without --swa-full."""
    results = ChatRunner(sim_of(demo), two_turns()).run()
    first, second = results
    assert first.outcome == "new" and second.outcome in ("kept", "restored")
    assert second.n_cached >= first.n_prompt - 1 - 64  # at most the window is recomputed
    changed = ChatRunner(sim_of(demo), two_turns(system="You answer in five words.")).run()[1]
    assert changed.outcome == "forced" and changed.n_cached == 0
    full = ChatRunner(sim_of(demo, swa_full=True), two_turns(system="You answer in five words.")).run()[1]
    assert full.outcome == "kept" and full.n_cached == 1  # BOS is all the two prompts share


def test_two_users_keep_their_own_slots_and_an_error_ends_only_one_conversation(demo):
    script = parse_script({"conversations": [
        {"name": "a", "turns": [{"user": "Who was Moses?", "n_predict": 3}, {"user": "And Aaron?", "n_predict": 3}]},
        {"name": "b", "turns": [{"user": "Tell of the flood.", "n_predict": 3},
                                {"user": "word " * 2000, "n_predict": 3}, {"user": "never sent"}]}]})
    sim = sim_of(demo)
    results = ChatRunner(sim, script).run()
    by_turn = {(r.conversation, r.turn): r for r in results}
    assert set(by_turn) == {("a", 1), ("a", 2), ("b", 1), ("b", 2)}
    assert by_turn["a", 1].slot != by_turn["b", 1].slot  # both idle slots were empty: LRU gives each its own
    # its prefix is shorter than the window, so llama-server goes to its checkpoints (the QUIRK of
    # pos_min >= pos_min_thold at 0): a checkpoint of turn 1 serves it
    assert by_turn["a", 2].slot == by_turn["a", 1].slot and by_turn["a", 2].outcome == "restored"
    assert by_turn["b", 2].outcome == "error" and "exceeds the available context size" in by_turn["b", 2].answer
    assert not sim.busy


def test_a_script_asking_for_a_slot_the_server_lacks_is_refused(demo):
    script = parse_script({"conversations": [{"slot": 3, "turns": [{"user": "hi"}]}]})
    with pytest.raises(ScriptError, match="asks for slot 3, but the server has 2 slots"):
        ChatRunner(sim_of(demo), script)


def test_server_sim_prints_the_servers_lines_and_a_table_of_turns(tmp_path, capsys):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"conversations": [{"name": "alice", "slot": 0, "turns": [
        {"user": "Who was Moses?", "n_predict": 4}, {"user": "And Aaron?", "system": "Be terse.", "n_predict": 4}]}]}))
    assert main(["server-sim", "--chat", str(chat), "-c", "1024", "--temp", "0"]) == 0
    out = capsys.readouterr().out
    assert "I srv    load_model: initializing, n_slots = 2, n_ctx_slot = 512, kv_unified = 'false'" in out
    assert "forcing full prompt re-processing due to lack of cache data" in out
    table = out[out.index("turn "):].splitlines()
    assert table[1].split()[:2] == ["alice", "turn"] and table[1].endswith("nothing kept yet")
    assert table[2].endswith("full re-processing forced") and table[2].split()[6] == "0"
    assert table[3].startswith("2 turns:") and "1 forced to re-process" in table[3]


def test_server_sim_tells_a_bad_script_before_loading(tmp_path, capsys):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"conversations": [{"turns": [{"user": 3}]}]}))
    assert main(["server-sim", "--chat", str(chat), "-m", str(tmp_path / "no-model.gguf")]) == 1
    assert "turns[0]: user: expected text, got 3" in capsys.readouterr().err


def test_a_prefix_shorter_than_the_window_goes_to_the_checkpoints_and_is_marked_a_quirk(demo):
    from engine import events as ev

    sim = sim_of(demo)
    sub = sim.ctx.bus.subscribe(kinds=(ev.ServerPromptReused,))
    script = parse_script({"conversations": [{"slot": 0, "turns": [{"user": "Who was Moses?", "n_predict": 3},
                                                                  {"user": "And Aaron?", "n_predict": 3}]}]})
    first, second = ChatRunner(sim, script).run()
    reused = sub.drain()[-1]
    assert reused.pos_min == 0 and reused.pos_min_thold == 0  # everything is still there
    assert reused.n_past < reused.n_common == first.n_prompt + 2  # the prompt and the two answer tokens decoded
    assert "llama.cpp QUIRK" in reused.quirk and f"{reused.n_common - reused.n_past} tokens" in reused.quirk
    full = sim_of(demo, swa_full=True)
    sub = full.ctx.bus.subscribe(kinds=(ev.ServerPromptReused,))
    ChatRunner(full, script).run()
    assert sub.drain()[-1].quirk == ""  # --swa-full: n_swa 0, the prefix is kept whole
