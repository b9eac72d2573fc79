"""The attention probe (Context(publish_attention=True)): after each decode, one AttentionWeights event
per sequence with an output token, holding its last output token's attention over the cells, per
layer, averaged over heads. Checked against transformers' eager attention (output_attentions) on the
same weights, for the plain cache and an iSWA pair, unified and split streams; the masks (other
sequences, the sliding window) give 0; logits are bit-identical with the probe on and off; nothing is
computed or published when it is off or nobody listens; engine/watch/attention.py aligns the weights
with a cache's cells without torch."""
from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import engine
import engine.models.transformer as transformer_module
from engine import events as ev
from engine.batch import Batch
from engine.errors import ArgumentTypeError
from engine.watch.attention import AttentionWatch
from tests.decode_driver import decode_sequences
from tests.model_factory import in_memory_model

WINDOW = 8  # tests/conftest.py's SWA_WINDOW
N_STEPS = 4
ARCHS = {"llama": "tiny_llama_hf", "gemma3": "tiny_gemma3_hf", "gemma2": "tiny_gemma2_hf"}


@functools.cache
def hf_eager(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def hf_last_row(folder: Path, tokens: list[int]) -> np.ndarray:
    """transformers' attention of the last token over positions 0 .. len-1, mean over heads: [n_layer, len]."""
    with torch.no_grad():
        out = hf_eager(folder)(torch.tensor([tokens]), output_attentions=True)
    return torch.stack([a[0, :, -1].mean(0) for a in out.attentions]).numpy()


def prompts(n_vocab: int) -> dict[int, list[int]]:
    """Longer than the window, so that the sliding layers mask the oldest positions."""
    g = torch.Generator().manual_seed(5)
    return {0: torch.randint(3, n_vocab, (11,), generator=g).tolist(),
            1: torch.randint(3, n_vocab, (9,), generator=g).tolist()}


def probed_context(model: engine.Model, **kw) -> tuple[engine.Context, ev.Subscription]:
    bus = engine.EventBus()
    sub = bus.subscribe(kinds=(ev.AttentionWeights,))
    settings = {"n_ctx": 128, "pad": 32, "n_ubatch": 8, "n_seq_max": 2, "kv_unified": True, "type_k": "f32",
                "type_v": "f32", "bus": bus, "publish_attention": True}
    return engine.Context(model, **{**settings, **kw}), sub


def by_seq(events: list[ev.Event]) -> dict[int, ev.AttentionWeights]:
    out = {}
    for e in events:
        assert isinstance(e, ev.AttentionWeights)
        assert e.seq_id not in out, "one event per sequence and decode"
        out[e.seq_id] = e
    return out


def cache_by_name(ctx: engine.Context, name: str):
    return next(c for c in ctx.memory.caches() if c.name == name)


def weights_by_position(ctx: engine.Context, event: ev.AttentionWeights) -> np.ndarray:
    """The event's weights as [n_layer, event.pos + 1] by the position each cell holds, checking on the
    way that every cell not holding the sequence (or past its position) got exactly 0."""
    out = np.full((ctx.model.config.n_layer, event.pos + 1), np.nan)
    for name, stream, layer_ids, cells, weights in zip(event.caches, event.streams, event.layer_ids, event.cells,
                                                       event.weights):
        held = cache_by_name(ctx, name).cells(stream)
        for j, cell in enumerate(cells):
            pos, seqs, _ = held[cell]
            if event.seq_id in seqs and 0 <= pos <= event.pos:
                out[list(layer_ids), pos] = weights[:, j]
            else:
                assert not weights[:, j].any(), f"cell {cell} (pos {pos}, seqs {set(seqs)}) is masked"
    return np.nan_to_num(out, nan=0.0)  # positions no cell holds any more (slid out of the SWA cache)


def decode_checked(ctx, sub, batch: Batch, seqs: dict[int, list[int]], folder: Path) -> None:
    """Decode, then compare each sequence's event with transformers on that sequence's tokens so far."""
    assert ctx.decode(batch) == 0, ctx.last_error
    events = by_seq(sub.drain())
    assert sorted(events) == sorted(seqs)
    for s, e in events.items():
        assert e.pos == len(seqs[s]) - 1
        ref = hf_last_row(folder, seqs[s])
        got = weights_by_position(ctx, e)
        np.testing.assert_allclose(got, ref, atol=2e-6, err_msg=f"seq {s} at pos {e.pos}")


@pytest.mark.parametrize("kv_unified", [True, False])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_weights_equal_transformers_eager_attention(arch, kv_unified, request):
    """Two sequences prefilled in one batch (several ubatches), then advanced together: each event holds
    transformers' attention row of that sequence alone, cell by cell; gemma2 includes its soft-cap, the
    sliding layers of gemma3/gemma2 their window."""
    folder = request.getfixturevalue(ARCHS[arch])
    model = engine.load_model(folder)
    ctx, sub = probed_context(model, kv_unified=kv_unified)
    seqs = prompts(model.n_vocab)
    tokens = [t for s in seqs for t in seqs[s]]
    pos = [p for s in seqs for p in range(len(seqs[s]))]
    seq_ids = [[s] for s in seqs for _ in seqs[s]]
    decode_checked(ctx, sub, Batch(tokens, pos, seq_ids, [True] * len(tokens)), seqs, folder)
    g = torch.Generator().manual_seed(9)
    for _ in range(N_STEPS):
        step = {s: int(torch.randint(3, model.n_vocab, (1,), generator=g)) for s in seqs}
        batch = Batch(list(step.values()), [len(seqs[s]) for s in step], [[s] for s in step], [True] * len(step))
        for s, t in step.items():
            seqs[s].append(t)
        decode_checked(ctx, sub, batch, seqs, folder)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_bit_identical_with_the_probe_on_and_off(arch, request):
    model = engine.load_model(request.getfixturevalue(ARCHS[arch]))
    runs = []
    for probe in (False, True):
        ctx, sub = probed_context(model, publish_attention=probe, type_k="f16", type_v="f16")
        runs.append(decode_sequences(ctx, prompts(model.n_vocab), N_STEPS, seed=3))
        assert bool(sub.drain()) == probe
    (seqs_off, logits_off), (seqs_on, logits_on) = runs
    assert seqs_off == seqs_on
    for s in seqs_off:
        assert torch.equal(logits_off[s], logits_on[s]), f"seq {s}"


@pytest.mark.parametrize("cap", [0.0, 2.0])
@pytest.mark.parametrize("rows", [[1], [0, 1, 2], [0, 2, 5], [4, 6, 7]])
def test_probe_equals_a_per_head_softmax(rows, cap):
    """The batched computation (groups, GQA, a slice or a gather of rows) against one query head at a time."""
    g = torch.Generator().manual_seed(len(rows))
    G, H, Hkv, Tg, n_kv, D, scale = 2, 6, 2, 4, 10, 8, 0.3
    q, keys = torch.randn(G, H, Tg, D, generator=g), torch.randn(G, Hkv, n_kv, D, generator=g)
    mask = torch.rand(G, 1, Tg, n_kv, generator=g) < 0.6
    mask[..., 0] = True  # every token sees at least one cell, as its own always is
    expected = []
    for r in rows:
        grp, t = divmod(r, Tg)
        per_head = []
        for h in range(H):
            scores = keys[grp, h // (H // Hkv)] @ q[grp, h, t] * scale
            scores = torch.tanh(scores / cap) * cap if cap else scores
            per_head.append(torch.softmax(scores.masked_fill(~mask[grp, 0, t], float("-inf")), dim=-1))
        expected.append(torch.stack(per_head).mean(0))
    got = transformer_module.attention_weights(q, keys, mask, rows, scale, cap)
    torch.testing.assert_close(got, torch.stack(expected), rtol=0, atol=1e-6)
    assert got.dtype == torch.float32 and not got[~mask[[r // Tg for r in rows], 0, [r % Tg for r in rows]]].any()


def test_rows_sum_to_one_and_masked_cells_are_zero():
    ctx, sub = probed_context(in_memory_model(), n_seq_max=3)
    tokens = list(range(3, 15))
    seq_ids = [[0]] * 5 + [[1]] * 4 + [[2]] * 3
    pos = list(range(5)) + list(range(4)) + list(range(3))
    assert ctx.decode(Batch(tokens, pos, seq_ids, [True] * len(tokens))) == 0
    events = by_seq(sub.drain())
    cells = ctx.memory.cells(0)
    for s, e in events.items():
        (weights,) = e.weights
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-6)
        assert weights.dtype == np.float32 and weights.shape == (2, len(e.cells[0]))
        sees = np.array([s in cells[c][1] for c in e.cells[0]])
        assert (weights[:, sees] > 0).all() and not weights[:, ~sees].any()


def test_iswa_layers_go_to_the_cache_that_holds_them_and_the_window_masks(tiny_gemma3_hf):
    model = engine.load_model(tiny_gemma3_hf)
    ctx, sub = probed_context(model, n_seq_max=1)
    n = 2 * WINDOW + 3
    assert ctx.decode(Batch.for_sequence(list(range(3, 3 + n)), 0, 0)) == 0
    (e,) = sub.drain()
    assert e.caches == ("base", "swa") and e.layer_ids == ((5,), (0, 1, 2, 3, 4))
    assert e.layer_ids == (ctx.memory.base.layout.layer_ids, ctx.memory.swa.layout.layer_ids)
    for name, cells, weights in zip(e.caches, e.cells, e.weights):
        cache = cache_by_name(ctx, name)
        assert len(cells) == cache.n_kv((0,)) and len(weights) == len(cache.layout.layer_ids)
        pos = np.array([cache.cells(0)[c][0] for c in cells])
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-6)
        visible = (pos >= 0) & (pos > n - 1 - WINDOW) if name == "swa" else pos >= 0
        assert (weights[:, visible] > 0).all() and not weights[:, ~visible].any()


def test_split_streams_name_each_sequences_stream():
    ctx, sub = probed_context(in_memory_model(), kv_unified=False, n_seq_max=2)
    assert ctx.decode(Batch([3, 4, 5, 6, 7], [0, 1, 2, 0, 1], [[0]] * 3 + [[1]] * 2, [True] * 5)) == 0
    events = by_seq(sub.drain())
    assert events[0].streams == (0,) and events[1].streams == (1,)
    for s, e in events.items():
        weights = e.weights[0]
        held = [s in ctx.memory.cells(s)[c][1] for c in e.cells[0]]
        assert not weights[:, ~np.array(held)].any()
        np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-6)


def test_one_event_per_sequence_for_its_last_output_token_across_ubatches():
    """Sequence 0's last output is in the first ubatch, sequence 1's in the last; sequence 2 has no
    output and no event; a token shared by two sequences gives both the same weights."""
    ctx, sub = probed_context(in_memory_model(), n_seq_max=4, n_ubatch=4)
    tokens = list(range(3, 13))
    seq_ids = [[0]] * 3 + [[2]] * 3 + [[1]] * 3 + [[1, 3]]
    pos = [0, 1, 2, 0, 1, 2, 0, 1, 2, 3]
    logits = [True, True, False, False, False, False, True, False, False, True]
    assert ctx.decode(Batch(tokens, pos, seq_ids, logits)) == 0
    started = ctx.n_steps - 1
    events = by_seq(sub.drain())
    assert sorted(events) == [0, 1, 3]
    assert [(events[s].batch_index, events[s].pos, events[s].step) for s in (0, 1, 3)] == [
        (1, 1, started), (9, 3, started), (9, 3, started)]
    assert all(np.array_equal(a, b) for a, b in zip(events[1].weights, events[3].weights))


def test_events_sit_inside_their_step():
    bus = engine.EventBus()
    sub = bus.subscribe(with_state=False)
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, bus=bus, publish_attention=True)
    for step in range(2):
        assert ctx.decode(Batch.for_sequence([3, 4], 0, 2 * step)) == 0
    seen = [e for e in sub.drain() if isinstance(e, (ev.DecodeStarted, ev.AttentionWeights, ev.DecodeFinished))]
    assert [(e.kind, getattr(e, "step", None)) for e in seen] == [
        ("DecodeStarted", 0), ("AttentionWeights", 0), ("DecodeFinished", None),
        ("DecodeStarted", 1), ("AttentionWeights", 1), ("DecodeFinished", None)]


@pytest.fixture
def probe_calls(monkeypatch) -> list[int]:
    """Counts the forward pass's probe computations (one per layer per probed ubatch)."""
    calls: list[int] = []
    real = transformer_module.attention_weights

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(transformer_module, "attention_weights", counting)
    return calls


@pytest.mark.parametrize("setting,listening", [(False, True), (True, False), (False, False)])
def test_nothing_computed_or_published_when_off_or_unheard(setting, listening, probe_calls):
    bus = engine.EventBus()
    sub = bus.subscribe() if listening else None
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, bus=bus, publish_attention=setting)
    assert ctx.decode(Batch.for_sequence([3, 4, 5], 0, 0)) == 0
    assert probe_calls == []
    if sub is not None:
        assert not [e for e in sub.drain() if isinstance(e, ev.AttentionWeights)]


def test_a_failed_decode_publishes_no_weights(probe_calls):
    ctx, sub = probed_context(in_memory_model(), n_ctx=8, pad=8, n_seq_max=1)
    assert ctx.decode(Batch.for_sequence(list(range(3, 11)), 0, 0)) == 0
    sub.drain()
    assert ctx.decode(Batch.for_sequence([3], 0, 8)) == 1  # no free cell
    ctx.abort_callback = lambda: True
    ctx.memory.seq_rm(0, 4, -1)
    assert ctx.decode(Batch.for_sequence([3], 0, 4)) == 2
    assert sub.drain() == [] and len(probe_calls) == 2  # the first decode's two layers only


def test_the_setting_is_type_checked():
    with pytest.raises(ArgumentTypeError, match="publish_attention"):
        engine.Context(in_memory_model(), n_ctx=32, pad=8, publish_attention="yes")


def test_the_watch_aligns_weights_with_the_cells(tiny_gemma3_hf):
    model = engine.load_model(tiny_gemma3_hf)
    ctx, sub = probed_context(model, kv_unified=False)
    watch = AttentionWatch()
    watch.attach(ctx.bus)
    assert ctx.decode(Batch([3, 4, 5, 6, 7], [0, 1, 2, 0, 1], [[0]] * 3 + [[1]] * 2, [True] * 5)) == 0
    watch.sync()
    events = by_seq(sub.drain())
    assert watch.seq_ids() == [0, 1] and watch.latest(1) is not None and watch.latest(1).seq_no == events[1].seq_no
    for s, e in events.items():
        for name, stream, layer_ids, cells, weights in zip(e.caches, e.streams, e.layer_ids, e.cells, e.weights):
            size = cache_by_name(ctx, name).size
            expected = np.zeros((len(layer_ids), size), dtype=np.float32)
            expected[:, cells] = weights
            for k, il in enumerate(layer_ids):
                np.testing.assert_array_equal(watch.weights(s, name, stream, il), expected[k])
            np.testing.assert_allclose(watch.weights(s, name, stream), expected.mean(axis=0), rtol=1e-6)
            assert not watch.weights(s, name, 1 - stream).any()  # the other sequence's stream
    assert not watch.weights(7, "swa", 0).any() and len(watch.weights(7, "swa", 0)) == ctx.memory.swa.size
    with pytest.raises(ValueError, match="layer 5"):
        watch.weights(0, "swa", 0, 5)
    with pytest.raises(KeyError):
        watch.weights(0, "kv", 0)


def test_the_event_survives_the_recording_codec():
    """engine/watch/codec.py writes events from their dataclass fields: nested tuples and float32 arrays
    of AttentionWeights come back equal."""
    codec = pytest.importorskip("engine.watch.codec", reason="the recording codec is not in this checkout")
    ctx, sub = probed_context(in_memory_model(), n_seq_max=2)
    assert ctx.decode(Batch([3, 4, 5, 6], [0, 1, 0, 1], [[0], [0], [1], [1]], [True] * 4)) == 0
    for e in sub.drain():
        back = codec.decode_event(codec.encode_event(e))
        assert (back.seq_id, back.step, back.batch_index, back.pos, back.caches, back.streams, back.layer_ids) == (
            e.seq_id, e.step, e.batch_index, e.pos, e.caches, e.streams, e.layer_ids)
        for a, b in zip(back.cells + back.weights, e.cells + e.weights):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_the_watch_works_without_torch():
    code = textwrap.dedent("""
        import sys; sys.modules['torch'] = None  # any 'import torch' now raises ImportError
        import numpy as np
        from engine import events as ev
        from engine.watch.attention import AttentionWatch
        watch = AttentionWatch()
        watch.apply(ev.AttentionWeights(0, 3, 1, 1, ("kv",), (0,), ((0, 1),), (ev._frozen_array([0, 1]),),
                                        (ev._frozen_array([[0.25, 0.75], [0.5, 0.5]], np.float32),)))
        print(watch.weights(0, "kv", 0).tolist(), watch.weights(0, "kv", 0, 1).tolist())
        print(sorted(m for m in sys.modules if m.startswith("engine")))
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[0.375, 0.625] [0.5, 0.5]"
    assert "engine.kv.attention" not in lines[1] and "engine.context" not in lines[1]
