"""The notebook explorer's attention-mask view, without a browser: the figure's squares are the mask the
attention kernel built for the last ubatch (recorded from engine/kv/attention.py UbatchAttention), its
hover texts name positions and sequences, it follows decodes, and a sliding-window cache shows where each
token's window begins."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the notebook explorer needs the jupyter extra: pip install -e '.[jupyter]'")

from engine.kv.attention import UbatchAttention  # noqa: E402
from engine.runners.session import Session  # noqa: E402
from engine.runners.workloads import WorkloadSpec  # noqa: E402
from engine.sampling import SamplerParams  # noqa: E402
from engine.watch.attention_mask import MaskCell  # noqa: E402
from explorer import MaskView  # noqa: E402
from explorer.mask import (  # noqa: E402
    CELLS,
    EMPTY_BAND,
    HOLES,
    N_SEQ_BANDS,
    OUTSIDE_BAND,
    OWN,
    WINDOW,
)

SETTINGS = dict(n_ctx=128, pad=32, n_seq_max=4, kv_unified=True, swa_full=True, swa_window=8, n_ubatch=16)


@pytest.fixture
def session():
    s = Session("demo", settings=SETTINGS, threaded=False,
                workload=WorkloadSpec("generate", n_predict=30, sampler=SamplerParams(temperature=0.0, seed=1)))
    yield s
    s.close()


@pytest.fixture
def kernel_masks(monkeypatch) -> dict[str, np.ndarray]:
    """The last mask the kernel built for each cache, [groups, 1, tokens, n_kv]."""
    last: dict[str, np.ndarray] = {}
    build = UbatchAttention.__init__

    def recording_init(att, cache, sinfo, ubatch):
        build(att, cache, sinfo, ubatch)
        last[cache.name] = att.mask.numpy().copy()

    monkeypatch.setattr(UbatchAttention, "__init__", recording_init)
    return last


def squares(view: MaskView) -> np.ndarray:
    return np.array(view.figure.data[CELLS].z, dtype=np.int64)


def test_the_squares_are_the_kernels_mask_and_follow_decodes(session, kernel_masks):
    view = MaskView.of(session, cache="base", widget=False)
    assert view.mask is None and "no ubatch placed in cache base" in view.figure.layout.title.text
    session.add_prompt("And God said unto Moses").result()
    session.add_prompt("In the beginning").result()
    session.step(2).result()
    mask = view.update()
    assert mask is view.mask and mask.exact and mask.cache == "base"
    np.testing.assert_array_equal(mask.allowed, kernel_masks["base"][0, 0])
    z = squares(view)
    assert z.shape == mask.allowed.shape
    np.testing.assert_array_equal(z < N_SEQ_BANDS, mask.allowed)
    attended = mask.allowed
    row_bands = np.broadcast_to((mask.token_seq % N_SEQ_BANDS)[:, None], z.shape)
    np.testing.assert_array_equal(z[attended], row_bands[attended])
    assert (z[mask.codes == MaskCell.EMPTY] == EMPTY_BAND).all()
    own = view.figure.data[OWN]
    assert list(own.x) == mask.token_cell.tolist() and list(own.y) == list(range(mask.n_tokens))
    assert list(view.figure.layout.yaxis.ticktext) == [f"seq {s} · pos {p}" for s, p in
                                                       zip(mask.token_seq.tolist(), mask.token_pos.tolist())]
    text = np.array(view.figure.data[CELLS].text, dtype=object)
    for k in range(mask.n_tokens):
        c = int(mask.token_cell[k])
        assert f"cell {c}: pos {int(mask.token_pos[k])} · seq {int(mask.token_seq[k])}" in text[k, c]
        assert "attends: its own cell" in text[k, c]
    other = np.argwhere(mask.codes == MaskCell.OTHER)
    assert len(other)  # two sequences in one cache: each token is masked from the other's cells
    k, c = other[0]
    assert f"pos {int(mask.cell_pos[c])} · seq {mask.cell_seqs[c][0]}" in text[k, c] and "only, not seq" in text[k, c]
    before = mask.token_pos.copy()
    session.step(1).result()
    after = view.update()
    assert (after.token_pos == before + 1).all()
    np.testing.assert_array_equal(after.allowed, kernel_masks["base"][0, 0])
    np.testing.assert_array_equal(squares(view) < N_SEQ_BANDS, after.allowed)
    assert after.title() in view.figure.layout.title.text


def test_a_hole_is_hatched_and_a_later_change_is_said(session):
    view = MaskView.of(session, cache="base", widget=False)
    session.add_prompt("And God said unto Moses").result()
    session.add_prompt("In the beginning").result()
    session.step(1).result()
    session.seq_rm(0, 1, 3).result()
    view.update()
    assert not view.mask.exact and "changed since" in view.figure.layout.title.subtitle.text
    holes = view.figure.data[HOLES]
    assert list(holes.x) == [c for c in range(view.mask.n_kv) if view.mask.is_hole(c)] and len(holes.x) == 2


def test_a_sliding_window_cache_shows_where_each_window_begins(session, kernel_masks):
    view = MaskView.of(session, cache="swa", widget=False)
    session.add_prompt("And God said unto Moses, and spake unto him in the wilderness").result()
    session.step(3).result()
    mask = view.update()
    assert mask.cache == "swa" and mask.n_swa == 8
    np.testing.assert_array_equal(mask.allowed, kernel_masks["swa"][0, 0])
    outside = mask.codes == MaskCell.WINDOW
    assert outside.any() and (squares(view)[outside] == OUTSIDE_BAND).all()
    edge = view.figure.data[WINDOW]
    assert list(edge.y) == list(range(mask.n_tokens))
    for y, x in zip(edge.y, edge.x):
        first = int(x + 0.5)
        assert mask.allowed[y, first] and mask.cell_pos[first] == mask.window_start(y)
    assert "sliding window of 8" in view.figure.layout.title.text
    assert view.select(cache="base").n_swa == 0 and view.figure.data[WINDOW].x is None


def test_a_prompt_in_several_ubatches_shows_the_last(session, kernel_masks):
    view = MaskView.of(session, cache="base", widget=False)
    session.add_prompt("And God said unto Moses, and spake unto him in the wilderness of Sinai, in the tabernacle "
                       "of the congregation, on the first day of the second month").result()
    session.step(1).result()  # the prompt: more tokens than n_ubatch
    view.update()
    assert view.mask.ubatch >= 1 and len(view.figures()) == 1
    first = view.select(cache="base", ubatch=0)
    assert first.ubatch == 0 and first.n_tokens == 16 and squares(view).shape == first.allowed.shape
    assert view.select(cache="swa", ubatch=0) is None  # a window cache: the last ubatch only
    assert "no ubatch 0 of the last decode" in view.figure.layout.title.text
