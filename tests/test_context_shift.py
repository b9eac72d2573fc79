"""Context shift as llama-completion does it (tools/completion/completion.cpp: when n_past + 1 >= n_ctx,
seq_rm of n_discard tokens after n_keep, then seq_add of the rest by -n_discard): the rule, the cache
operations, and the logits after the shift checked against a cache built by hand with the kept tokens'
K/V at their new positions."""
from __future__ import annotations

import logging

import pytest
import torch

import engine
from engine import events as ev
from engine.batch import Batch
from engine.cli import main
from engine.rope import Rotary
from engine.runners.generate import Generator, resolve_n_keep
from engine.sampling import SamplerParams

GREEDY = SamplerParams(temperature=0.0)
N_CTX = 32
PROMPT = "The lighthouse keeper woke"


@pytest.fixture(scope="module")
def model(tiny_llama_gguf):
    return engine.load_model(tiny_llama_gguf)


def new_ctx(model, **kw):
    defaults = dict(n_ctx=N_CTX, pad=32, n_seq_max=1, type_k="f32", type_v="f32")
    defaults.update(kw)
    return engine.Context(model, **defaults)


@pytest.mark.parametrize("n_keep, n_prompt, add_bos, expected", [
    (0, 10, True, 1),     # BOS is always kept
    (0, 10, False, 0),
    (4, 10, True, 5),
    (4, 10, False, 4),
    (10, 10, True, 11),   # llama-completion adds the BOS even when n_keep is the whole prompt
    (11, 10, True, 10),   # > prompt: the prompt length
    (-1, 10, True, 10),   # < 0: the prompt length
])
def test_n_keep_follows_llama_completion(n_keep, n_prompt, add_bos, expected):
    assert resolve_n_keep(n_keep, n_prompt, add_bos) == expected


def _rope(rotary: Rotary, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    cos, sin = rotary.cos_sin(pos, torch.float32)
    return Rotary.apply(keys, cos, sin)


def test_logits_after_a_shift_equal_a_cache_holding_the_kept_tokens_at_their_new_positions(model):
    cfg = model.config
    prompt = model.tokenizer.encode(PROMPT)
    n_prompt = len(prompt)
    # The shift comes when n_past + 1 >= n_ctx, i.e. before decoding position 31. Generating
    # n_predict tokens runs n_predict - 1 decodes; this many make the last one the first after the shift.
    n_predict = (N_CTX - 1) - n_prompt + 2

    ctx = new_ctx(model)
    gen = Generator(ctx, GREEDY, context_shift=True, n_keep=3)
    res = gen.generate(prompt, n_predict)
    assert res.stop_reason == "length" and len(res.tokens) == n_predict
    assert len(gen.shifts) == 1
    shift = gen.shifts[0]
    n_keep, n_discard = 3 + 1, (N_CTX - 1 - 4) // 2  # +1: the tiny tokenizer adds BOS
    assert (shift.n_past, shift.n_keep, shift.n_left, shift.n_discard) == (N_CTX - 1, n_keep, N_CTX - 1 - n_keep,
                                                                           n_discard)
    assert res.context_shifts == [shift]

    # The same run one token shorter stops right before the shift: its cache is the pre-shift state.
    before_ctx = new_ctx(model)
    before = Generator(before_ctx, GREEDY, context_shift=True, n_keep=3).generate(prompt, n_predict - 1)
    assert before.tokens == res.tokens[:-1] and not before.context_shifts
    old_cells = {pos: i for i, (pos, seqs, _) in enumerate(before_ctx.memory.cells(0)) if pos >= 0}
    assert sorted(old_cells) == list(range(N_CTX - 1))

    old_pos = list(range(n_keep)) + list(range(n_keep + n_discard, N_CTX - 1))
    new_pos = list(range(len(old_pos)))
    assert new_pos[-1] == N_CTX - 1 - n_discard - 1
    new_cells = {pos: i for i, (pos, seqs, _) in enumerate(ctx.memory.cells(0)) if pos >= 0}
    assert sorted(new_cells) == new_pos + [new_pos[-1] + 1]  # plus the token decoded after the shift

    rotary = model.transformer.rotary
    p_old, p_new = torch.tensor(old_pos), torch.tensor(new_pos)
    src = torch.tensor([old_cells[p] for p in old_pos])
    dst = torch.tensor([new_cells[p] for p in new_pos])
    ref_k, ref_v = [], []
    for layer in range(cfg.n_layer):
        k_old = before_ctx.memory.k[layer].read_cells(0, src).view(-1, cfg.n_head_kv, cfg.head_dim)
        # The keys a token at its new position has: un-rotate by the old position, rotate by the new.
        k_ref = _rope(rotary, _rope(rotary, k_old, -p_old), p_new).reshape(len(old_pos), -1)
        v_old = before_ctx.memory.v[layer].read_cells(0, src)
        # The K-shift produced exactly those keys (up to rounding), and left V alone.
        torch.testing.assert_close(ctx.memory.k[layer].read_cells(0, dst), k_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(ctx.memory.v[layer].read_cells(0, dst), v_old)
        ref_k.append(k_ref)
        ref_v.append(v_old)

    all_tokens = prompt + res.tokens
    last_token, last_pos = all_tokens[N_CTX - 1], new_pos[-1] + 1

    def reference_logits(keys: list[torch.Tensor]) -> torch.Tensor:
        """A fresh cache holding the kept tokens at their new positions with the given K and the
        original V rows, then the next token decoded on top of it."""
        ref = new_ctx(model)
        kept = [all_tokens[p] for p in old_pos]
        assert ref.decode(Batch.for_sequence(kept, 0, 0)) == 0  # metadata: cells 0.. at positions 0..
        cells = torch.arange(len(kept))
        streams = torch.zeros_like(cells)
        for layer in range(cfg.n_layer):
            ref.memory.k[layer].write(streams, cells, keys[layer])
            ref.memory.v[layer].write(streams, cells, ref_v[layer])
        assert ref.decode(Batch([last_token], [last_pos], [[0]])) == 0
        return ref.logits(-1)

    shifted = ctx.logits(-1)
    torch.testing.assert_close(shifted, reference_logits(ref_k), atol=1e-4, rtol=0)
    # The comparison is not trivial: keys left at their old positions give other logits...
    unshifted = [before_ctx.memory.k[layer].read_cells(0, src) for layer in range(cfg.n_layer)]
    assert (reference_logits(unshifted) - shifted).abs().max() > 1e-3
    # ...and so does recomputing the kept tokens without the discarded ones.
    fresh = new_ctx(model)
    assert fresh.decode(Batch.for_sequence([all_tokens[p] for p in old_pos] + [last_token], 0, 0)) == 0
    assert (fresh.logits(-1) - shifted).abs().max() > 1e-3


def test_event_trail_of_a_shift(model):
    bus = engine.EventBus()
    sub = bus.subscribe(kinds=(ev.CellsRemoved, ev.CellsShifted, ev.KShiftApplied))
    ctx = new_ctx(model, bus=bus)
    prompt = model.tokenizer.encode(PROMPT)
    gen = Generator(ctx, GREEDY, context_shift=True, n_keep=-1)  # keep the whole prompt
    res = gen.generate(prompt, (N_CTX - 1) - len(prompt) + 2)
    assert res.stop_reason == "length"
    (shift,) = gen.shifts
    n_keep, n_past = len(prompt), N_CTX - 1
    n_discard = (n_past - n_keep) // 2
    assert (shift.n_keep, shift.n_discard) == (n_keep, n_discard)
    removed, moved, kshift = sub.drain()
    assert isinstance(removed, ev.CellsRemoved) and removed.reason == "seq_rm"
    assert (removed.seq_id, removed.p0, removed.p1, removed.n_freed) == (0, n_keep, n_keep + n_discard, n_discard)
    assert isinstance(moved, ev.CellsShifted) and moved.op == "add"
    assert (moved.seq_id, moved.p0, moved.p1, moved.amount) == (0, n_keep + n_discard, n_past, -n_discard)
    (cells,) = moved.changes
    assert cells.pos.tolist() == list(range(n_keep, n_past - n_discard))
    assert set(cells.shift.tolist()) == {-n_discard}
    assert isinstance(kshift, ev.KShiftApplied)
    (applied,) = kshift.changes
    assert applied.cells.tolist() == cells.cells.tolist() and set(applied.shift.tolist()) == {0}
    assert kshift.amounts[0].tolist() == [-n_discard] * len(cells.cells)


def test_generation_goes_on_through_many_shifts(model):
    ctx = new_ctx(model)
    prompt = model.tokenizer.encode(PROMPT)
    gen = Generator(ctx, GREEDY, context_shift=True, n_keep=2)
    res = gen.generate(prompt, 90)
    assert res.stop_reason == "length" and len(res.tokens) == 90
    assert len(gen.shifts) >= 3
    # every shift left the sequence gap-free: positions 0..max, one cell each
    assert ctx.memory.used(0) == ctx.memory.seq_pos_max(0) + 1
    kept = [pos for pos, _, _ in ctx.memory.cells(0) if 0 <= pos < 3]
    assert sorted(kept) == [0, 1, 2]


def test_without_context_shift_generation_stops_when_full(model):
    ctx = new_ctx(model)
    res = Generator(ctx, GREEDY).generate(model.tokenizer.encode(PROMPT), 90)
    assert res.stop_reason == "context_full" and not res.context_shifts
    assert ctx.memory.used(0) == N_CTX


def test_a_cache_that_cannot_shift_disables_it_with_llama_cpp_s_warning(model, caplog, monkeypatch):
    ctx = new_ctx(model)
    monkeypatch.setattr(ctx.memory, "can_shift", lambda: False)
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        gen = Generator(ctx, GREEDY, context_shift=True)
    assert "KV cache shifting is not supported for this context, disabling KV cache shifting" in caplog.text
    assert gen.context_shift is False
    res = gen.generate(model.tokenizer.encode(PROMPT), 90)
    assert res.stop_reason == "context_full" and not gen.shifts


def test_sequences_sharing_a_unified_cache_shift_when_a_decode_finds_no_slot(model):
    """Two sequences in one 64-cell pool: each may grow to 64 positions, so the pool runs out first;
    the decode returns 1 and the longest sequence is shifted."""
    ctx = new_ctx(model, n_ctx=64, n_seq_max=2, kv_unified=True)
    prompts = [model.tokenizer.encode(PROMPT), model.tokenizer.encode("A good recipe")]
    gen = Generator(ctx, GREEDY, context_shift=True)
    results = gen.generate_parallel(prompts, 40)
    assert [r.stop_reason for r in results] == ["length", "length"]
    assert gen.shifts
    for seq_id in (0, 1):
        positions = sorted(pos for pos, seqs, _ in ctx.memory.cells(0) if seq_id in seqs)
        assert positions == list(range(len(positions)))


def test_cli_context_shift(tiny_llama_gguf, capsys):
    rc = main(["generate", "-m", str(tiny_llama_gguf), "-p", PROMPT, "-n", "40", "-c", "32", "--pad", "32",
               "--seed", "1", "--temp", "0", "--context-shift", "--keep", "2"])
    err = capsys.readouterr().err
    assert rc == 0
    assert "context full, swapping: n_past = 31, n_left = 28, n_ctx = 32, n_keep = 3, n_discard = 14" in err
    assert "stopped: context_full" not in err
