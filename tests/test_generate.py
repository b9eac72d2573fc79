"""The generator: greedy equals the argmax chain, seeds reproduce, parallel equals one-by-one."""
from __future__ import annotations

import pytest
import torch

import engine
from engine.batch import Batch
from engine.runners.generate import Generator
from engine.sampling import SamplerParams

GREEDY = SamplerParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_llama_gguf):
    return engine.load_model(tiny_llama_gguf)


def new_ctx(model, **kw):
    defaults = dict(n_ctx=256, pad=32, n_seq_max=3, kv_unified=True, type_k="f32", type_v="f32")
    defaults.update(kw)
    return engine.Context(model, **defaults)


def test_greedy_generation_is_the_argmax_chain(model):
    prompt = model.tokenizer.encode("The baker was pulling bread")
    result = Generator(new_ctx(model), GREEDY).generate(prompt, 12)
    ctx = new_ctx(model)
    tokens = list(prompt)
    expected = []
    assert ctx.decode(Batch.for_sequence(tokens, 0, 0)) == 0
    for _ in range(12):
        nxt = int(torch.argmax(ctx.logits(-1)))
        expected.append(nxt)
        if model.tokenizer.is_eog(nxt):
            break
        assert ctx.decode(Batch([nxt], [len(tokens)], [[0]])) == 0
        tokens.append(nxt)
    assert result.tokens == expected
    assert result.stop_reason in ("length", "eog")
    assert result.text == model.tokenizer.decode([t for t in expected if not model.tokenizer.is_eog(t)])


def test_same_seed_same_text_other_seed_other_text(model):
    params = SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = Generator(new_ctx(model), params).generate("Once upon a time", 24)
    b = Generator(new_ctx(model), params).generate("Once upon a time", 24)
    c = Generator(new_ctx(model), SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=43)).generate(
        "Once upon a time", 24)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


@pytest.mark.parametrize("kv_unified", [True, False])
def test_parallel_sequences_equal_one_by_one(model, kv_unified):
    """Three prompts of different lengths advanced together give each one's solo greedy result."""
    prompts = ["The lighthouse keeper", "A good recipe is a kind of promise that", "Learning"]
    together = Generator(new_ctx(model, kv_unified=kv_unified), GREEDY).generate_parallel(prompts, 10)
    assert len(together) == len(prompts)
    for seq_id, (prompt, res) in enumerate(zip(prompts, together)):
        solo = Generator(new_ctx(model), GREEDY).generate(prompt, 10)
        assert res.seq_id == seq_id
        assert res.tokens == solo.tokens, f"sequence {seq_id} differs when run in parallel"


def test_streamed_pieces_join_to_the_text(model):
    gen = Generator(new_ctx(model), GREEDY)
    pieces = list(gen.stream("In the village", 16))
    again = Generator(new_ctx(model), GREEDY).generate("In the village", 16)
    assert "".join(pieces) == again.text


def test_generation_stops_cleanly_when_the_cache_is_full(model):
    ctx = new_ctx(model, n_ctx=32, pad=32, n_seq_max=1)
    result = Generator(ctx, GREEDY).generate(list(range(5, 25)), 40)
    # greedy on this model samples no end-of-generation token before the 32 cells are full
    assert result.stop_reason == "context_full"
    assert len(result.prompt_tokens) + len(result.tokens) == 33  # 32 cells + the last sampled token
    assert ctx.memory.used(0) == 32


def test_token_sampled_events_carry_the_tokens(model):
    bus = engine.EventBus()
    sub = bus.subscribe(kinds=(engine.events.TokenSampled,))
    ctx = new_ctx(model, bus=bus)
    result = Generator(ctx, GREEDY).generate("The sea", 6)
    events = sub.drain()
    assert [e.token for e in events] == result.tokens
    assert [e.pos for e in events] == list(range(len(result.prompt_tokens), len(result.prompt_tokens) + 6))


def test_n_predict_minus_1_runs_until_the_cache_is_full_and_0_only_reads_the_prompt(model):
    """llama.cpp's -n: -1 has no limit, 0 evaluates the prompt and samples nothing."""
    ctx = new_ctx(model, n_ctx=64, pad=32, n_seq_max=1)
    prompt = list(range(5, 25))
    result = Generator(ctx, GREEDY).generate(prompt, -1)
    limited = Generator(new_ctx(model, n_ctx=64, pad=32, n_seq_max=1), GREEDY).generate(prompt, 100)
    assert result.tokens == limited.tokens and result.stop_reason == limited.stop_reason
    assert result.stop_reason == "context_full" and len(prompt) + len(result.tokens) == 64 + 1
    ctx = new_ctx(model, n_ctx=64, pad=32, n_seq_max=1)
    none = Generator(ctx, GREEDY).generate(prompt, 0)
    assert none.tokens == [] and none.stop_reason == "length" and ctx.memory.used(0) == len(prompt)


def test_bad_n_predict_and_no_prompts_are_refused(model):
    gen = Generator(new_ctx(model), GREEDY)
    with pytest.raises(engine.KvscopeError, match="n_predict must be -1"):
        gen.generate("The sea", -2)
    with pytest.raises(engine.KvscopeError, match="no prompts"):
        gen.generate_parallel([], 4)
