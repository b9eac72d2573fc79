"""The visual language both front-ends share: stable colours per sequence, and folding a lane wider than
the screen into glyphs that say how full their cells are and who holds most of them."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from engine.watch.frames import EMPTY, SHARED, StreamFrame
from engine.watch.style import (
    LIGHT_BACKGROUND,
    PALETTE,
    contrast,
    fold,
    occupancy_glyph,
    owner_color,
    owner_glyph,
    palette,
    seq_color,
)


def test_colours_are_stable_distinct_and_wrap():
    assert len(set(PALETTE)) == 12
    assert [seq_color(s) for s in range(12)] == list(PALETTE) and seq_color(13) == PALETTE[1]
    assert owner_color(SHARED) != owner_color(EMPTY) and owner_color(SHARED) not in PALETTE
    assert (owner_glyph(EMPTY), owner_glyph(SHARED), owner_glyph(3)) == ("·", "▒", "█")


@pytest.mark.parametrize(("dark", "background"), [(True, "#121212"), (True, "#1E1E1E"), (False, LIGHT_BACKGROUND),
                                                  (False, "#FFFFFF"), (False, "#FDF6E3")])
def test_cells_stand_out_on_dark_and_light_backgrounds(dark, background):
    colours = palette(dark)
    assert len(set(colours)) == 12 and [seq_color(s, dark) for s in range(12)] == list(colours)
    assert all(contrast(c, background) >= 3.0 for c in (*colours, owner_color(SHARED, dark)))
    assert contrast(owner_color(EMPTY, dark), background) >= 2.0  # dim on purpose, still visible
    assert owner_color(SHARED, dark) not in colours and owner_color(EMPTY, dark) not in colours


def test_contrast_is_wcag_s():
    assert contrast("#000000", "#FFFFFF") == pytest.approx(21.0) and contrast("#777777", "#777777") == 1.0
    assert contrast("#767676", "#FFFFFF") == pytest.approx(4.54, abs=0.01)  # the known AA grey on white


def random_frame(rng, size: int) -> StreamFrame:
    used = rng.random(size) < 0.6
    owner = np.where(used, rng.choice([0, 1, 2, 7, SHARED], size), EMPTY).astype(np.int16)
    return StreamFrame("kv", 0, np.where(used, rng.integers(0, 999, size), -1), owner,
                       np.where(owner == SHARED, 2, used.astype(np.int16)).astype(np.int16),
                       np.where(rng.random(size) < 0.05, 3, 0), rng.random(size) < 0.1, rng.random(size) < 0.1,
                       int(rng.integers(0, size + 1)), rng.random(size) < 0.05)


@pytest.mark.parametrize("size,columns", [(10, 80), (256, 80), (1000, 77), (32768, 100), (131072, 150)])
def test_folding_agrees_with_counting_cell_by_cell(size, columns):
    rng = np.random.default_rng(size)
    frame = random_frame(rng, size)
    folded = fold(frame, columns)
    assert len(folded.owner) <= columns and folded.start[0] == 0 and folded.start[-1] == size
    for k in rng.choice(len(folded.owner), min(40, len(folded.owner)), replace=False):
        cells = slice(folded.start[k], folded.start[k + 1])
        used = frame.pos[cells] >= 0
        counts = collections.Counter(frame.owner[cells][used].tolist())
        if counts:
            top = max(counts.values())
            assert counts[int(folded.owner[k])] == top  # a most frequent owner (ties: any of them)
        else:
            assert folded.owner[k] == EMPTY
        assert folded.occupancy[k] == pytest.approx(used.mean())
        assert folded.changed[k] == frame.changed[cells].any() and folded.tentative[k] == frame.tentative[cells].any()
        assert folded.shifted[k] == (frame.shift[cells] != 0).any()
    assert folded.head == min(frame.head // folded.cells_per_glyph, len(folded.owner))


def test_occupancy_shades():
    assert [occupancy_glyph(f) for f in (0, 0.1, 0.25, 0.3, 0.5, 0.75, 0.9, 1)] == [" ", "░", "░", "▒", "▒", "▓",
                                                                                      "█", "█"]
