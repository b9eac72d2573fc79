"""kvscope's visual language, defined once for every view (the terminal UI and the notebook explorer):
which colour a sequence has, how a cell's state reads, and how a cache wider than the screen is
folded into glyphs that each stand for several cells.

- Colour = sequence: a palette of 12 colours that stay apart for colour-blind readers (Okabe-Ito's
  eight, black replaced by a grey that shows on dark and light backgrounds, and four tints of them);
  sequence s always gets PALETTE[s % 12], in both UIs, in every run.
- A cell is empty (a dim dot), held by one sequence (a solid block in its colour) or by several (a
  distinct light shade, the count on inspection; a coarser checker when a real llama.cpp's log shows it
  shared without naming by whom, engine.events.CellsSeen); marks add what changed since the previous frame,
  what a dry run touched, a pending shift, and the cells a QUIRK event touched.
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
# The head: violet, apart from the red of attention (both are drawn behind cells in the terminal) and from the
# palette's hues; as a marker in the notebook 3.7:1 on the light background, 3.4:1 or more on dark ones.
HEAD_COLOR = "#AF00FF"
QUIRK_COLOR = "#FF5F87"
# On a light background the same hues, darkened until they stand out as well as on a dark one (3:1 or
# more against textual-light's #E0E0E0, the darkest light background a view is drawn on); shared cells dark.
LIGHT_BACKGROUND = "#E0E0E0"
SHARED_COLOR_ON_LIGHT = "#333333"
EMPTY_COLOR_ON_LIGHT = "#8A8A8A"

EMPTY_FILL = {True: "#2A2A2A", False: "#EEEEEE"}  # an empty cell drawn as a filled square: near the page
MEMORY_PART_COLORS = {"weights": "#0072B2", "kv": "#E69F00", "compute": "#999999",  # device memory bars
                      "checkpoints": "#CC79A7", "prompt cache": "#F5C766"}

# A server's turns: the prompt's tokens its slot's cache served, those it held but recomputed (a forced
# re-processing, a checkpoint from before them), and the new ones; and what the server decided per turn.
PROMPT_PART_COLORS = {"reused": "#009E73", "lost": "#D55E00", "new": "#999999"}
OUTCOME_COLORS = {"new": "#999999", "kept": "#009E73", "restored": "#56B4E9", "forced": "#D55E00",
                  "error": "#FF5F5F", "": "#999999"}

GLYPH_EMPTY = "·"
GLYPH_ONE = "█"
GLYPH_SHARED = "▒"
# shared, by sequences a llama.cpp log does not name (its dump's 'M'): the shared shade's coarser kin, in the shared
# colour; '?' would read as the dry run's mark
GLYPH_SHARED_UNNAMED = "▚"
GLYPH_TENTATIVE = "?"
GLYPH_QUIRK = "!"  # a cell an event reproducing a llama.cpp QUIRK touched (the event log says which)
GLYPH_HEAD = "▼"
OCCUPANCY_GLYPHS = (" ", "░", "▒", "▓", "█")  # a folded glyph: none, under a quarter, ..., all cells used


def relative_luminance(colour: str) -> float:
    """WCAG's relative luminance of a #RRGGBB colour."""
    channels = [int(colour[k:k + 2], 16) / 255 for k in (1, 3, 5)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: str, b: str) -> float:
    """WCAG's contrast ratio of two colours (1 to 21; 3 reads well for large marks such as cells)."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def _darkened(colour: str, background: str, ratio: float = 3.0) -> str:
    """The colour, its channels scaled down together (the hue kept) until it has `ratio` on `background`."""
    channels = [int(colour[k:k + 2], 16) for k in (1, 3, 5)]
    for scale in np.arange(1.0, 0.0, -0.02):
        darker = "#" + "".join(f"{round(c * scale):02X}" for c in channels)
        if contrast(darker, background) >= ratio:
            return darker
    return "#000000"


PALETTE_ON_LIGHT = tuple(_darkened(c, LIGHT_BACKGROUND) for c in PALETTE)


def palette(dark: bool = True) -> tuple[str, ...]:
    """The sequence colours for a dark or a light background (sequence s: palette[s % 12])."""
    return PALETTE if dark else PALETTE_ON_LIGHT


def seq_color(seq_id: int, dark: bool = True) -> str:
    """The colour of a sequence, the same in every view and every run (per kind of background)."""
    if seq_id < 0:
        return EMPTY_COLOR if dark else EMPTY_COLOR_ON_LIGHT
    colours = palette(dark)
    return colours[seq_id % len(colours)]


def owner_color(owner: int, dark: bool = True) -> str:
    """The colour of a cell or glyph by its owner code (a sequence id, EMPTY or SHARED)."""
    if owner == SHARED:
        return SHARED_COLOR if dark else SHARED_COLOR_ON_LIGHT
    return seq_color(owner, dark)  # EMPTY is negative: the empty colour


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
    quirk: np.ndarray  # bool: an event reproducing a llama.cpp QUIRK touched a cell of it


def fold(frame: StreamFrame, columns: int) -> Folded:
    """Fold a lane into at most `columns` glyphs (one cell each when it fits)."""
    size = frame.size
    per = max(1, -(-size // max(columns, 1)))  # ceil
    if per == 1:  # nothing to fold: the frame's own columns
        return Folded(1, np.arange(size + 1), frame.owner.astype(np.int16, copy=False), (frame.pos >= 0).astype(float),
                      frame.changed, frame.tentative, frame.shift != 0, min(frame.head, size), frame.quirk)
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
                  min(frame.head // per, len(idx)), np.logical_or.reduceat(frame.quirk, idx))


def _dominant_owner(owner: np.ndarray, used: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Per glyph, the owner code most of its used cells have (EMPTY when none is used): one bincount
    over (glyph, owner) pairs."""
    n_codes = MAX_SEQ + 2  # SHARED (-2), EMPTY (-1), then the sequence ids
    glyph = np.repeat(np.arange(len(idx)), np.diff(np.r_[idx, len(owner)]))
    keys = glyph[used] * n_codes + (owner[used].astype(np.int64) + 2)
    counts = np.bincount(keys, minlength=len(idx) * n_codes).reshape(len(idx), n_codes)
    best = counts.argmax(axis=1) - 2
    return np.where(counts.max(axis=1) > 0, best, EMPTY).astype(np.int16)
