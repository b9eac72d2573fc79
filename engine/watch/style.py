"""kvscope's visual language, defined once for every view (the terminal UI and the notebook explorer):
which colour a sequence has, how a cell's state reads, and how a cache wider than the screen is
folded into glyphs that each stand for several cells.

- Colour = sequence: a palette of 12 colours that stay apart for colour-blind readers (Okabe-Ito's
  eight, black replaced by a grey that shows on dark and light backgrounds, and four tints of them);
  sequence s always gets PALETTE[s % 12], in both UIs, in every run.
- A cell is empty (a dim dot), held by one sequence (a solid block in its colour) or by several (a
  distinct light shade, the count on inspection); marks add what changed since the previous frame,
  what a dry run touched, a pending shift, and QUIRK events.
- Folding: when a lane has more cells than columns, each glyph covers `cells_per_glyph` cells and is
  shaded by their occupancy, coloured by the sequence holding most of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv.cells import MAX_SEQ
from engine.watch.frames import EMPTY, SHARED, StreamFrame

PALETTE = (
    "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999",  # Okabe-Ito
    "#F5C766", "#9DD3F2", "#66C5AB", "#E8A3CA",  # tints of the first, second, third and seventh
)
SHARED_COLOR = "#FFFFFF"  # several sequences in one cell
EMPTY_COLOR = "#5F5F5F"
HEAD_COLOR = "#FF5F5F"
QUIRK_COLOR = "#FF5F87"

GLYPH_EMPTY = "·"
GLYPH_ONE = "█"
GLYPH_SHARED = "▒"
GLYPH_TENTATIVE = "?"
GLYPH_HEAD = "▼"
OCCUPANCY_GLYPHS = (" ", "░", "▒", "▓", "█")  # a folded glyph: none, under a quarter, ..., all cells used


def seq_color(seq_id: int) -> str:
    """The colour of a sequence, the same in every view and every run."""
    return PALETTE[seq_id % len(PALETTE)] if seq_id >= 0 else EMPTY_COLOR


def owner_color(owner: int) -> str:
    """The colour of a cell or glyph by its owner code (a sequence id, EMPTY or SHARED)."""
    if owner == SHARED:
        return SHARED_COLOR
    return EMPTY_COLOR if owner == EMPTY else seq_color(owner)


def owner_glyph(owner: int) -> str:
    if owner == SHARED:
        return GLYPH_SHARED
    return GLYPH_EMPTY if owner == EMPTY else GLYPH_ONE


def occupancy_glyph(fraction: float) -> str:
    """A folded glyph's shade: how many of its cells are used."""
    if fraction <= 0:
        return OCCUPANCY_GLYPHS[0]
    return OCCUPANCY_GLYPHS[min(4, 1 + int(fraction * 4 - 1e-9))]


@dataclass(frozen=True)
class Folded:
    """A lane folded to n glyphs: glyph k covers cells [start[k], start[k + 1])."""

    cells_per_glyph: int
    start: np.ndarray  # first cell of each glyph, and the lane's size at the end
    owner: np.ndarray  # int16: the sequence holding most used cells of the glyph, SHARED, or EMPTY
    occupancy: np.ndarray  # float: used cells / cells of the glyph
    changed: np.ndarray  # bool: a cell of the glyph changed since the previous frame
    tentative: np.ndarray  # bool: a dry run touched a cell of it
    shifted: np.ndarray  # bool: a cell of it has a pending shift
    head: int  # the glyph that holds the head (n when the head is past the last cell)


def fold(frame: StreamFrame, columns: int) -> Folded:
    """Fold a lane into at most `columns` glyphs (one cell each when it fits)."""
    size = frame.size
    per = max(1, -(-size // max(columns, 1)))  # ceil
    if per == 1:  # nothing to fold: the frame's own columns
        return Folded(1, np.arange(size + 1), frame.owner.astype(np.int16, copy=False), (frame.pos >= 0).astype(float),
                      frame.changed, frame.tentative, frame.shift != 0, min(frame.head, size))
    start = np.arange(0, size + per, per)
    start[-1] = size
    start = np.unique(np.minimum(start, size))
    idx = start[:-1]
    used = frame.pos >= 0
    n_used = np.add.reduceat(used.astype(np.int64), idx)
    lengths = np.diff(start)
    owner = _dominant_owner(frame.owner, used, idx) if per > 1 else frame.owner.astype(np.int16)
    return Folded(per, start, owner, n_used / lengths, np.logical_or.reduceat(frame.changed, idx),
                  np.logical_or.reduceat(frame.tentative, idx), np.logical_or.reduceat(frame.shift != 0, idx),
                  min(frame.head // per, len(idx)))


def _dominant_owner(owner: np.ndarray, used: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Per glyph, the owner code most of its used cells have (EMPTY when none is used): one bincount
    over (glyph, owner) pairs."""
    n_codes = MAX_SEQ + 2  # SHARED (-2), EMPTY (-1), then the sequence ids
    glyph = np.repeat(np.arange(len(idx)), np.diff(np.r_[idx, len(owner)]))
    keys = glyph[used] * n_codes + (owner[used].astype(np.int64) + 2)
    counts = np.bincount(keys, minlength=len(idx) * n_codes).reshape(len(idx), n_codes)
    best = counts.argmax(axis=1) - 2
    return np.where(counts.max(axis=1) > 0, best, EMPTY).astype(np.int16)
