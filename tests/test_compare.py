"""A/B comparison of two contexts: the distributions a context publishes are its logits' log-softmax, the
watch layer's KL and top-1 agreement are the textbook ones, rows after the texts differ are marked, and
the notebook view shows the numbers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engine
from engine import events as ev
from engine.watch.compare import DistributionComparison, kl_divergence


def logprobs(p) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    return np.log(p / p.sum()).astype(np.float32)


def test_a_context_publishes_the_log_softmax_of_its_logits_per_output():
    model = engine.load_model("demo")
    ctx = engine.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True, publish_logits=True)
    sub = ctx.bus.subscribe(kinds=(ev.OutputLogProbs,), with_state=False)
    # two sequences in one batch, every token of seq 1 an output, in an order that is not per sequence
    batch = engine.Batch(tokens=[5, 9, 6, 10, 7], pos=[0, 0, 1, 1, 2], seq_ids=[[0], [1], [0], [1], [0]],
                         logits=[False, True, False, True, True])
    assert ctx.decode(batch) == 0
    (event,) = sub.drain()
    assert event.logprobs.shape == (3, model.config.n_vocab)
    assert event.seq_ids == (1, 1, 0) and event.positions == (0, 1, 2)
    expected = torch.log_softmax(ctx.all_logits().float(), dim=-1).numpy()
    np.testing.assert_allclose(event.logprobs, expected, rtol=0, atol=1e-6)
    assert ctx.decode(engine.Batch(tokens=[11], pos=[2], seq_ids=[[1]])) == 0
    (event,) = sub.drain()
    assert event.step == 1 and event.seq_ids == (1,) and event.positions == (2,)


def test_nothing_is_computed_for_logits_nobody_asked_for():
    model = engine.load_model("demo")
    ctx = engine.Context(model, n_ctx=256, publish_logits=False)
    sub = ctx.bus.subscribe(with_state=False)
    assert ctx.decode(engine.Batch(tokens=[5, 6])) == 0
    assert not any(isinstance(e, ev.OutputLogProbs) for e in sub.drain())


def test_kl_and_agreement_are_the_textbook_ones_and_rows_after_a_difference_are_marked():
    cmp = DistributionComparison(seq_id=0)
    a = [logprobs([0.7, 0.2, 0.1]), logprobs([0.1, 0.8, 0.1]), logprobs([0.3, 0.3, 0.4])]
    b = [logprobs([0.6, 0.3, 0.1]), logprobs([0.5, 0.4, 0.1]), logprobs([0.3, 0.3, 0.4])]
    for pos in range(3):
        cmp.apply_a(ev.OutputLogProbs(pos, (0,), (10 + pos,), a[pos][None]))
        cmp.apply_b(ev.OutputLogProbs(pos, (0, ), (10 + pos,), b[pos][None]))
        token_a, token_b = int(a[pos].argmax()), int(b[pos].argmax())
        cmp.apply_a(ev.TokenSampled(0, token_a, "", 11 + pos))
        cmp.apply_b(ev.TokenSampled(0, token_b, "", 11 + pos))
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.6, 0.3, 0.1])
    assert cmp.rows[0].kl == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-5)
    assert [r.agree for r in cmp.rows] == [True, False, True]
    # position 11 got different tokens (the row at 11 disagreed on its top-1): from there on the texts differ
    assert cmp.first_difference == 12
    assert [r.same_text for r in cmp.rows] == [True, True, False]
    s = cmp.summary()
    assert s["n"] == 2 and s["top1_agreement"] == 0.5 and s["first_difference"] == 12
    assert kl_divergence(a[2], b[2]) == pytest.approx(0.0, abs=1e-7)


def test_other_sequences_are_not_compared():
    cmp = DistributionComparison(seq_id=1)
    cmp.apply_a(ev.OutputLogProbs(0, (0, 1), (4, 7), np.stack([logprobs([1, 1]), logprobs([3, 1])])))
    cmp.apply_b(ev.OutputLogProbs(0, (1,), (7,), logprobs([1, 3])[None]))
    assert [(r.pos, r.top_a, r.top_b) for r in cmp.rows] == [(7, 0, 1)]


def test_the_same_settings_agree_everywhere_and_a_quantized_cache_does_not_quite():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from explorer.compare import Compare

    same = Compare.of_settings(a={}, b={}, prompt="And God said unto Moses", n_predict=12)
    try:
        for f in same.step(12):
            f.result()
        same.sessions[0].call(same.update).result()  # a redraw after both finished, where redraws run
        s = same.comparison.summary()
        assert s["n"] >= 10 and s["top1_agreement"] == 1.0 and s["max_kl"] < 1e-6 and s["first_difference"] is None
        assert "same text throughout" in same.summary.value
    finally:
        same.close()
    ab = Compare.of_settings(a=dict(type_k="f16", type_v="f16"), b=dict(type_k="q4_0", type_v="q4_0"),
                             prompt="And God said unto Moses", n_predict=12)
    try:
        for f in ab.step(12):
            f.result()
        ab.sessions[0].call(ab.update).result()
        s = ab.comparison.summary()
        assert s["n"] >= 1 and s["mean_kl"] > 1e-5
        assert f"{100 * s['top1_agreement']:.1f}%" in ab.summary.value
        kl_trace = ab.figure.data[0]
        assert list(kl_trace.x) == [r.pos for r in sorted(ab.comparison.rows, key=lambda r: r.pos) if r.same_text]
        assert "q4_0" in ab.columns[1].title.value and "tok/s" in ab.columns[1].status.value
        assert [c.grid._lanes for c in ab.columns][0] == [c.grid._lanes for c in ab.columns][1]
    finally:
        ab.close()
