"""Tests for engine/sampling.py: llama.cpp-style sampler chain."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import Sampler, SamplerParams


def make(**kw) -> Sampler:
    kw.setdefault("seed", 1234)
    return Sampler(SamplerParams(**kw))


# Only the filter under test is on; everything else disabled.
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def frequencies(sampler: Sampler, logits: torch.Tensor, n: int) -> dict[int, float]:
    tokens = sampler.sample_many(logits.unsqueeze(0).expand(n, -1).contiguous())
    return {t: c / n for t, c in Counter(tokens).items()}


# ---- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_greedy_is_argmax(temperature):
    g = torch.Generator().manual_seed(0)
    s = make(temperature=temperature, top_k=5, top_p=0.5, min_p=0.3)
    for _ in range(20):
        logits = torch.randn(1000, generator=g) * 4
        assert s.sample(logits) == int(torch.argmax(logits))
    batch = torch.randn(6, 1000, generator=g)
    assert s.sample_many(batch) == torch.argmax(batch, dim=-1).tolist()


def test_greedy_ties_go_to_lowest_id_and_use_no_random_numbers():
    s = make(temperature=0.0)
    state = s.generator.get_state()
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert s.sample(logits) == 1
    assert torch.equal(s.generator.get_state(), state)
    probs = s.probabilities(logits)
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("temperature", [0.05, 0.8, 1.0, 3.0, 100.0])
def test_top_k_1_equals_greedy_for_any_temperature(temperature):
    g = torch.Generator().manual_seed(1)
    s = make(temperature=temperature, top_k=1, top_p=1.0, min_p=0.0)
    for _ in range(30):
        logits = torch.randn(500, generator=g)
        assert s.sample(logits) == int(torch.argmax(logits))
    # ties: the single survivor of top_k=1 is the lowest id, as greedy picks
    tied = torch.tensor([1.0, 5.0, 2.0, 5.0])
    assert all(s.sample(tied) == 1 for _ in range(20))
    # and with a repetition penalty, top_k=1 still matches greedy
    pen = dict(repeat_penalty=2.0, repeat_last_n=8)
    sk = make(temperature=temperature, top_k=1, **pen)
    sg = make(temperature=0.0, **pen)
    for _ in range(20):
        logits = torch.randn(50, generator=g)
        hist = torch.randint(0, 50, (8,), generator=g).tolist()
        assert sk.sample(logits, hist) == sg.sample(logits, hist)


# ---- top-p ----------------------------------------------------------------------------------

# A hand-made distribution, deliberately not in id order.
TOP_P_PROBS = {3: 0.40, 0: 0.25, 5: 0.15, 1: 0.10, 4: 0.06, 2: 0.04}
TOP_P_LOGITS = torch.tensor([math.log(TOP_P_PROBS[i]) for i in range(6)], dtype=torch.float32)


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.30, {3}),  # first token alone passes 0.30; at least one is always kept
        (0.01, {3}),
        (0.64, {3, 0}),  # 0.40 + 0.25 = 0.65 >= 0.64
        (0.66, {3, 0, 5}),  # needs the third: 0.80 >= 0.66
        (0.75, {3, 0, 5}),
        (0.85, {3, 0, 5, 1}),  # 0.90
        (0.95, {3, 0, 5, 1, 4}),  # 0.96
        (0.99, {3, 0, 5, 1, 4, 2}),
        (1.00, {3, 0, 5, 1, 4, 2}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    s = make(**{**PLAIN, "top_p": top_p})
    probs = s.probabilities(TOP_P_LOGITS)
    assert {i for i in range(6) if probs[i] > 0} == kept
    total = sum(TOP_P_PROBS[i] for i in kept)
    for i in kept:
        assert probs[i].item() == pytest.approx(TOP_P_PROBS[i] / total, rel=1e-5)


def test_top_p_sampling_frequencies_match_renormalised_probabilities():
    s = make(**{**PLAIN, "top_p": 0.75})
    n = 20000
    freq = frequencies(s, TOP_P_LOGITS, n)
    assert set(freq) == {3, 0, 5}
    expected = {3: 0.40 / 0.80, 0: 0.25 / 0.80, 5: 0.15 / 0.80}
    for tok, p in expected.items():
        assert abs(freq[tok] - p) < 0.015, (tok, freq[tok], p)
    # the single-row path draws from the same set
    seen = {s.sample(TOP_P_LOGITS) for _ in range(300)}
    assert seen == {3, 0, 5}


def test_top_p_uses_probabilities_before_temperature():
    # At T=0.5 the tempered distribution would reach 0.75 with two tokens; llama.cpp applies
    # top-p to the untempered one (three tokens), then tempers the survivors.
    s = make(**{**PLAIN, "top_p": 0.75, "temperature": 0.5})
    probs = s.probabilities(TOP_P_LOGITS)
    kept = [3, 0, 5]
    assert {i for i in range(6) if probs[i] > 0} == set(kept)
    w = {i: TOP_P_PROBS[i] ** 2 for i in kept}
    for i in kept:
        assert probs[i].item() == pytest.approx(w[i] / sum(w.values()), rel=1e-5)


@pytest.mark.parametrize("top_k", [0, 5, 6])
def test_ties_at_the_top_p_cut_keep_the_lowest_id(top_k):
    probs = [0.2, 0.001, 0.2, 0.009, 0.39, 0.2]  # ids 0, 2, 5 tie
    logits = torch.tensor([math.log(p) for p in probs], dtype=torch.float32)
    s = make(**{**PLAIN, "top_k": top_k, "top_p": 0.5})  # 0.39 + one of the 0.2s
    kept = s.probabilities(logits) > 0
    assert kept.nonzero().flatten().tolist() == [0, 4]
    s = make(**{**PLAIN, "top_k": top_k, "top_p": 0.7})  # 0.39 + two of them
    assert (s.probabilities(logits) > 0).nonzero().flatten().tolist() == [0, 2, 4]


def test_top_k_applies_before_top_p():
    # top_k=2 leaves {3, 0}; renormalised they are 0.615 / 0.385, so top_p=0.6 keeps {3} only
    # (without top-k first, 0.40 < 0.6 and token 0 would also be kept).
    s = make(**{**PLAIN, "top_k": 2, "top_p": 0.6})
    probs = s.probabilities(TOP_P_LOGITS)
    assert {i for i in range(6) if probs[i] > 0} == {3}
    s = make(**{**PLAIN, "top_k": 3})
    probs = s.probabilities(TOP_P_LOGITS)
    assert {i for i in range(6) if probs[i] > 0} == {3, 0, 5}


# ---- min-p ----------------------------------------------------------------------------------

MIN_P_PROBS = [0.05, 0.50, 0.09, 0.20, 0.06, 0.10]
MIN_P_LOGITS = torch.tensor([math.log(p) for p in MIN_P_PROBS], dtype=torch.float32)


@pytest.mark.parametrize(
    "min_p, kept",
    [
        (0.0, {0, 1, 2, 3, 4, 5}),
        (0.05, {0, 1, 2, 3, 4, 5}),  # cut 0.025
        (0.15, {1, 2, 3, 5}),  # cut 0.075: relative to the max, not absolute 0.15
        (0.19, {1, 3, 5}),  # cut 0.095
        (0.5, {1}),  # cut 0.25
        (1.0, {1}),
    ],
)
def test_min_p_cutoff_is_relative_to_max_probability(min_p, kept):
    for top_k in (0, 6, 40):  # both candidate-selection paths
        s = make(**{**PLAIN, "min_p": min_p, "top_k": top_k})
        probs = s.probabilities(MIN_P_LOGITS)
        assert {i for i in range(6) if probs[i] > 0} == kept
        total = sum(MIN_P_PROBS[i] for i in kept)
        for i in kept:
            assert probs[i].item() == pytest.approx(MIN_P_PROBS[i] / total, rel=1e-5)


def test_min_p_sampling_only_draws_allowed_tokens():
    s = make(**{**PLAIN, "min_p": 0.15})
    freq = frequencies(s, MIN_P_LOGITS, 20000)
    assert set(freq) == {1, 2, 3, 5}
    for tok in (1, 2, 3, 5):
        assert abs(freq[tok] - MIN_P_PROBS[tok] / 0.89) < 0.015


def test_min_p_on_large_vocab_matches_full_sort_semantics():
    # Rows with very different numbers of min-p survivors in one batch.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 5000, generator=g) * torch.tensor([[0.5], [2.0], [6.0], [1.0]])
    s = make(temperature=0.7, top_k=0, top_p=0.9, min_p=0.1)
    for row in logits:
        probs = s.probabilities(row)
        p = torch.softmax(row.double(), -1)
        keep_min_p = p >= 0.1 * p.max() * (1 - 1e-9)
        assert ((probs > 0) <= keep_min_p).all()
        assert (probs > 0).sum() >= 1
        assert probs.sum().item() == pytest.approx(1.0)


# ---- repetition penalty ---------------------------------------------------------------------


def test_repetition_penalty_divides_positive_logits():
    logits = torch.tensor([2.0, 1.8, 0.5])
    assert make(temperature=0.0).sample(logits, [0]) == 0
    s = make(temperature=0.0, repeat_penalty=1.5)
    assert s.sample(logits, [0]) == 1  # 2.0 / 1.5 = 1.33 < 1.8
    assert s.sample(logits, [2]) == 0


def test_repetition_penalty_multiplies_negative_logits():
    logits = torch.tensor([-1.0, -1.2, -3.0])
    assert make(temperature=0.0).sample(logits, [0]) == 0
    s = make(temperature=0.0, repeat_penalty=1.5)
    assert s.sample(logits, [0]) == 1  # -1.0 * 1.5 = -1.5 < -1.2 (dividing would raise it)


def test_repetition_penalty_exact_values_distinct_tokens_and_window():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    s = make(**PLAIN, repeat_penalty=2.0, repeat_last_n=3)
    # token 0 appears three times but is penalised once; token 3 is outside the window of 3
    probs = s.probabilities(logits, [3, 0, 1, 0, 0])
    expected = torch.softmax(torch.tensor([1.0, -2.0, 0.5, 1.0], dtype=torch.float64), -1)
    assert torch.allclose(probs, expected, atol=1e-6)
    # repeat_last_n = 0 turns the penalty off
    off = make(**PLAIN, repeat_penalty=2.0, repeat_last_n=0)
    assert torch.allclose(
        off.probabilities(logits, [0, 1]), torch.softmax(logits.double(), -1), atol=1e-6
    )


def test_repetition_penalty_with_recorded_sequence_history():
    logits = torch.tensor([2.0, 1.8, 0.5])
    s = make(temperature=0.0, repeat_penalty=1.5, repeat_last_n=2)
    assert s.sample(logits, seq_id=7) == 0  # nothing recorded yet; 0 is now recorded
    assert s.recent_tokens(7) == (0,)
    assert s.sample(logits, seq_id=7) == 1  # 0 is penalised
    assert s.recent_tokens(7) == (0, 1)
    assert s.sample(logits, seq_id=7) == 0  # both penalised: 1.33 > 1.2
    assert s.recent_tokens(7) == (1, 0)  # only the last repeat_last_n are kept
    assert s.sample(logits, seq_id=8) == 0  # sequences are independent
    s.accept([1, 0], seq_id=9)
    assert s.sample(torch.tensor([2.0, 1.8, 1.4]), seq_id=9) == 2  # 1.33, 1.2, 1.4
    s.reset(7)
    assert s.recent_tokens(7) == () and s.recent_tokens(8) == (0,)


def test_does_not_modify_caller_logits():
    logits = torch.tensor([2.0, -1.0, 0.5])
    before = logits.clone()
    make(repeat_penalty=3.0).sample(logits, [0, 1])
    assert torch.equal(logits, before)


# ---- determinism ----------------------------------------------------------------------------


def _run(sampler: Sampler, n: int = 60) -> list[int]:
    g = torch.Generator().manual_seed(99)
    return [sampler.sample(torch.randn(200, generator=g)) for _ in range(n)]


def test_same_seed_same_tokens_different_seed_different_tokens():
    params = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = _run(make(seed=42, **params))
    b = _run(make(seed=42, **params))
    c = _run(make(seed=43, **params))
    assert a == b
    assert a != c


def test_random_seed_is_exposed_and_reproduces():
    s = Sampler(SamplerParams(seed=None, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0))
    assert isinstance(s.seed, int) and 0 <= s.seed < 2**64
    again = Sampler(SamplerParams(seed=s.seed, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0))
    assert _run(s) == _run(again)


def _check_many_equals_rows(params: dict, logits: torch.Tensor, histories) -> None:
    a, b = make(**params), make(**params)
    many = a.sample_many(logits, histories)
    rows = [b.sample(logits[i], histories[i]) for i in range(logits.shape[0])]
    assert many == rows
    assert torch.equal(a.generator.get_state(), b.generator.get_state())


@pytest.mark.parametrize(
    "params",
    [
        {},
        dict(top_k=0),  # min-p candidate shrinking, different survivors per row
        dict(top_k=0, min_p=0.0, top_p=0.5),
        dict(top_k=3, repeat_penalty=1.3),
        dict(temperature=0.0, repeat_penalty=1.3),
    ],
)
def test_sample_many_equals_sample_per_row(params):
    g = torch.Generator().manual_seed(5)
    n = 8
    scale = torch.linspace(0.2, 5.0, n).unsqueeze(-1)
    logits = torch.randn(n, 300, generator=g) * scale
    histories = [torch.randint(0, 300, (i * 3,), generator=g).tolist() for i in range(n)]
    for _ in range(5):
        _check_many_equals_rows(params, logits, histories)


def test_sample_many_with_seq_ids_records_per_sequence():
    s = make(temperature=0.0, repeat_penalty=1.5)
    logits = torch.tensor([[2.0, 1.8, 0.5], [0.1, 0.2, 0.3]])
    assert s.sample_many(logits, seq_ids=[0, 1]) == [0, 2]
    assert s.sample_many(logits, seq_ids=[0, 1]) == [1, 1]
    assert s.recent_tokens(0) == (0, 1) and s.recent_tokens(1) == (2, 1)
    with pytest.raises(ValueError, match="distinct"):
        s.sample_many(logits, seq_ids=[3, 3])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.sampled_from([0.3, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.5]),
    repeat_penalty=st.sampled_from([1.0, 0.7, 1.5]),
    n=st.integers(1, 5),
    data_seed=st.integers(0, 10_000),
)
def test_sample_many_equals_rows_property(seed, temperature, top_k, top_p, min_p, repeat_penalty, n, data_seed):
    g = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(n, 64, generator=g) * 3
    logits[logits < -4] = -math.inf  # masked tokens must never be drawn
    histories = [torch.randint(0, 64, (5,), generator=g).tolist() for _ in range(n)]
    params = dict(
        seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty,
    )
    _check_many_equals_rows(params, logits, histories)
    tokens = make(**params).sample_many(logits, histories)
    assert len(tokens) == n
    for i, t in enumerate(tokens):
        assert math.isfinite(logits[i, t].item())
        assert make(**params).probabilities(logits[i], histories[i])[t] > 0


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.01), r"min_p must be in \[0, 1\]"),
        (dict(temperature=float("nan")), r"temperature must be a finite number"),
        (dict(temperature=float("inf")), r"temperature must be a finite number"),
        (dict(temperature="hot"), r"temperature must be a finite number"),
        (dict(top_k=2.5), r"top_k must be an integer"),
        (dict(top_k=True), r"top_k must be an integer"),
        (dict(repeat_penalty=0.0), r"repeat_penalty must be a finite number > 0"),
        (dict(repeat_penalty=-1.0), r"repeat_penalty must be a finite number > 0"),
        (dict(repeat_penalty=float("inf")), r"repeat_penalty must be a finite number > 0"),
        (dict(repeat_last_n=-2), r"repeat_last_n must be an integer >= -1"),
        (dict(repeat_last_n=1.0), r"repeat_last_n must be an integer >= -1"),
        (dict(seed=-1), r"seed must be None \(random\) or an integer in \[0, 2\*\*64 - 1\]"),
        (dict(seed=2**64), r"seed must be None"),
        (dict(seed=1.5), r"seed must be None"),
    ],
)
def test_parameter_validation_messages(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplerParams(**kw)


def test_valid_edge_parameters_and_defaults():
    d = SamplerParams()
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repeat_penalty, d.repeat_last_n, d.seed) == (
        0.8, 40, 0.95, 0.05, 1.0, 64, None,
    )
    for kw in (
        dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0), dict(min_p=1.0), dict(temperature=0),
        dict(temperature=-2), dict(top_k=0), dict(top_k=-1), dict(repeat_last_n=-1),
        dict(repeat_last_n=0), dict(seed=0), dict(seed=2**64 - 1), dict(repeat_penalty=0.5),
    ):
        SamplerParams(**kw)
    assert SamplerParams(temperature=0).greedy and not SamplerParams().greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.top_k = 3


def test_logits_validation():
    s = make()
    with pytest.raises(ValueError, match="NaN"):
        s.sample(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="all -inf"):
        s.sample(torch.full((4,), -math.inf))
    with pytest.raises(ValueError, match=r"shape \[n_vocab\]"):
        s.sample(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="out of range"):
        make(repeat_penalty=1.1).sample(torch.zeros(4), [4])
    with pytest.raises(ValueError, match="2 histories for 3 rows"):
        s.sample_many(torch.zeros(3, 4), [[], []])
    # masked (-inf) tokens are never drawn, even when top_k keeps them as candidates
    logits = torch.full((10,), -math.inf)
    logits[7] = 0.0
    s = make(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0)
    assert {s.sample(logits) for _ in range(50)} == {7}
