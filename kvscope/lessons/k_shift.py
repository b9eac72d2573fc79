"""Notebook 4, K-shift and context shift: its contexts, the checks that keep its prose true, and its pictures.

A cell's K rows are stored already rotated for the cell's position (RoPE), so moving a sequence to other
positions (`seq_add`) owes its keys a rotation, which the next decode pays (the K-shift, llama.cpp's
`llama_kv_cache::update` and `build_rope_shift` in src/llama-kv-cache.cpp). Everything here reads the
engine's own cells and K/V rows (`KVCache.cells`, `RowStorage.read_cells`) and checks them against a fresh
run of the same tokens at the new positions: what the notebook says is asserted where it is shown.

The notebook stays on one cache: contexts use `swa_full=True` (the demo model's iSWA pair then holds the
same cells twice, and llama.cpp's memory says it can shift) and the lesson reads the `base` cache, the
demo model's one full-attention layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

import engine
from engine import events as ev
from engine.models.config import ROPE_TYPE_NORM
from engine.runners.generate import resolve_n_keep
from engine.watch.describe import describe_event

VERSE = ("And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say unto the children of Israel, "
         "I AM hath sent me unto you.")
# f32 K/V: the numbers below compare rotations, not f16 rounding
SETTINGS = dict(n_ctx=128, pad=32, swa_full=True, type_k="f32", type_v="f32")
ROTATION_TOLERANCE = 1e-5  # the K-shift's f32 rotation against the same rotation in float64 (measured ~3e-7)
FRESH_TOLERANCE = 1e-4  # a shifted f32 K or V row against a fresh run's at the new position (measured ~2e-6)
LOGIT_TOLERANCE = 1e-3  # next-token logits of a shifted f32 cache against a fresh run (measured ~5e-6)
F16_LOGIT_TOLERANCE = 2e-2  # the same with f16 K/V, where each row is rounded to f16 twice (measured ~1e-3)
MIN_KL = 1e-4  # nats: more than rounding, so the context-shifted cache is not a fresh run of what it kept

SHIFTED, HELD, EMPTY = "#E69F00", "#56B4E9", "#EEEEEE"  # Okabe-Ito orange and sky blue, and a light grey


# ---- contexts --------------------------------------------------------------------------------------------
def context(model, **settings) -> engine.Context:
    """A small context of the lesson (SETTINGS, any of them overridden)."""
    return engine.Context(model, **{**SETTINGS, **settings})


def decode(ctx: engine.Context, tokens: list[int], positions, seq: int = 0) -> int:
    """Decode `tokens` of one sequence at `positions`; llama_decode's return code, which must be 0 here."""
    rc = ctx.decode(engine.Batch(tokens=list(tokens), pos=list(positions), seq_ids=[[seq]] * len(tokens)))
    assert rc == 0, f"decode returned {rc}: the lesson's cache is large enough for every token"
    return rc


def base_cache(ctx: engine.Context):
    """The cache of the full-attention layers: `base` of an iSWA pair (the demo model's), else the only one."""
    return getattr(ctx.memory, "base", ctx.memory)


def introduce(model, tokens: list[int]) -> str:
    """What the lesson runs on, in one sentence."""
    cfg = model.config
    (layer,) = base_cache(context(model, n_ctx=32)).layout.layer_ids  # the demo model has one full layer
    return (f"The demo model ({cfg.name}) reads the verse as {len(tokens)} tokens. Its base cache holds layer {layer}, "
            f"the one full-attention layer: {cfg.n_head_kv} K/V head of {cfg.head_dim} dims, RoPE base "
            f"{cfg.rope_base(layer):,.0f}, dims paired as {cfg.rope_type.upper()}.")


# ---- the base cache at one moment --------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """The base cache's cells (stream 0) and the K and V rows of its layers, copied at one moment."""

    cells: tuple[tuple[int, frozenset, int], ...]  # (pos, seq ids, pending shift) per cell
    layer_ids: tuple[int, ...]  # the model layers the cache holds, in the order of keys and values
    keys: torch.Tensor  # [n_layers, kv_size, n_embd_k] float32
    values: torch.Tensor  # [n_layers, kv_size, n_embd_v] float32
    head_dim: int
    type_k: str

    @classmethod
    def of(cls, ctx: engine.Context) -> Snapshot:
        cache = base_cache(ctx)
        every = torch.arange(cache.size)
        return cls(tuple(cache.cells(0)), tuple(cache.layout.layer_ids),
                   torch.stack([k.read_cells(0, every).clone() for k in cache.k]),
                   torch.stack([v.read_cells(0, every).clone() for v in cache.v]),
                   cache.layout.head_dim, cache.layout.type_k.name)

    def used(self) -> list[int]:
        """The cells that hold a token."""
        return [c for c, (pos, _, _) in enumerate(self.cells) if pos >= 0]

    def cell_at(self, pos: int, seq: int = 0) -> int:
        """The cell that holds `seq`'s token at `pos` (found, never assumed: a cell's index is not its position)."""
        found = [c for c, (p, seqs, _) in enumerate(self.cells) if p == pos and seq in seqs]
        assert len(found) == 1, f"{len(found)} cells hold seq {seq} at pos {pos}"
        return found[0]

    def key(self, cell: int, head: int = 0, layer: int = 0) -> torch.Tensor:
        """One head's K of a cell, [head_dim] float32 (layer: the index among layer_ids)."""
        return self.keys[layer, cell, head * self.head_dim:(head + 1) * self.head_dim]


def span(positions: list[int]) -> str:
    return f"{min(positions)}-{max(positions)}"


# ---- section 1: seq_add, then the K-shift --------------------------------------------------------------------
def check_seq_add(before: Snapshot, pending: Snapshot, delta: int) -> str:
    """seq_add changes positions and records the owed rotation (shift), and moves no data (llama_kv_cells::pos_add)."""
    moved = before.used()
    assert moved == pending.used(), "seq_add moved a token to another cell"
    for c in moved:
        assert pending.cells[c][0] == before.cells[c][0] + delta and pending.cells[c][2] == delta, pending.cells[c]
    assert torch.equal(before.keys, pending.keys) and torch.equal(before.values, pending.values), "seq_add moved data"
    old, new = [before.cells[c][0] for c in moved], [pending.cells[c][0] for c in moved]
    return (f"seq_add moved {len(moved)} cells from positions {span(old)} to {span(new)} and recorded a pending shift "
            f"of {delta:+d} in each; not one value of their K or V rows changed.")


def check_k_shift(pending: Snapshot, after: Snapshot) -> str:
    """The next decode first re-rotates K of every shifted cell (shifts back to 0), V untouched, then places
    its token: each token stays in its cell."""
    shifted = [c for c in pending.used() if pending.cells[c][2] != 0]
    assert shifted and all(shift == 0 for _, _, shift in after.cells), "the decode applies every pending shift"
    assert all(after.cells[c][0] == pending.cells[c][0] for c in shifted), "a K-shift moves no cell"
    idx = torch.tensor(shifted)
    assert not torch.equal(after.keys[:, idx], pending.keys[:, idx]), "the shifted cells' keys were re-rotated"
    assert torch.equal(after.values[:, idx], pending.values[:, idx]), "a value carries no position: V is not touched"
    (new,) = sorted(set(after.used()) - set(pending.used()))
    return (f"The decode first re-rotated the K rows of the {len(shifted)} shifted cells (their pending shifts are 0 "
            f"again), then put the new token in cell {new} at position {after.cells[new][0]}. Every token stayed in "
            f"its cell, and the V rows are bit for bit what they were.")


def cells_figure(moments: dict[str, Snapshot], n_cells: int | None = None) -> go.Figure:
    """The base cache's first cells at a few moments, one row each: the position in each cell, coloured
    by what the cell holds (orange: a rotation is still owed)."""
    n = n_cells or max(max(s.used(), default=0) for s in moments.values()) + 8
    labels = list(moments)[::-1]  # plotly draws the first row at the bottom
    z, text, hover = [], [], []
    for label in labels:
        cells = moments[label].cells[:n]
        z.append([2 if shift else (1 if pos >= 0 else 0) for pos, _, shift in cells])
        text.append([str(pos) if pos >= 0 else "" for pos, _, _ in cells])
        hover.append([f"cell {c}: " + (f"pos {pos}, pending shift {shift:+d}" if shift else
                                      (f"pos {pos}" if pos >= 0 else "empty"))
                      for c, (pos, _, shift) in enumerate(cells)])
    figure = go.Figure(go.Heatmap(z=z, x=list(range(n)), y=labels, text=text, texttemplate="%{text}",
                                  textfont=dict(size=9), hovertext=hover, hoverinfo="text", showscale=False, xgap=1,
                                  ygap=3, zmin=0, zmax=2, colorscale=[[0, EMPTY], [0.5, HELD], [1, SHIFTED]]))
    figure.update_layout(title="base cache, stream 0: the position held in each cell (orange: a K-shift is owed)",
                         height=90 + 55 * len(labels), width=1000, margin=dict(l=150, r=10, t=50, b=40),
                         xaxis=dict(title="cell", dtick=4), plot_bgcolor="white")
    return figure


# ---- section 2: the rotation, pair by pair --------------------------------------------------------------------
def pair_dims(rope_type: str, head_dim: int, i: int) -> tuple[int, int]:
    """The two dims of a head that RoPE turns together as pair i: 2i and 2i + 1 (NORM: llama, Mistral), or
    i and i + d/2 (NEOX: qwen2, Gemma), as engine/rope.py and llama.cpp's llama_model_rope_type say."""
    if not 0 <= i < head_dim // 2:
        raise ValueError(f"a head of {head_dim} dims has pairs 0..{head_dim // 2 - 1}, not {i}")
    return (2 * i, 2 * i + 1) if rope_type == ROPE_TYPE_NORM else (i, i + head_dim // 2)


def angles_per_position(model, layer: int) -> torch.Tensor:
    """theta_i of every pair of model layer `layer`, in radians per position: the engine's own RoPE table
    for that layer (base^(-2i/d), with the layer's base and scaling), as float64."""
    rotary = model.transformer.rotary
    return rotary.inv_freqs[rotary.layer_table[layer]].double()


def rotate(x: float, y: float, angle: float) -> tuple[float, float]:
    """(x, y) turned counter-clockwise by `angle` radians: what RoPE does to a pair."""
    c, s = math.cos(angle), math.sin(angle)
    return x * c - y * s, x * s + y * c


@dataclass(frozen=True)
class RopePair:
    """One pair of one cell's key: as stored before a shift, after the K-shift, and from a fresh run."""

    i: int
    dims: tuple[int, int]
    theta: float  # radians per position
    pos: int  # the position the stored pair was computed at
    delta: int  # the shift
    stored: tuple[float, float]
    shifted: tuple[float, float]
    fresh: tuple[float, float]

    @property
    def turned(self) -> float:
        """The angle the K-shift owes this pair: delta * theta_i."""
        return self.delta * self.theta

    @property
    def rotation_error(self) -> float:
        return math.dist(self.shifted, rotate(*self.stored, self.turned))

    @property
    def fresh_error(self) -> float:
        return math.dist(self.shifted, self.fresh)


def _pairs(rope_type: str, key: torch.Tensor) -> list[tuple[float, float]]:
    d = key.shape[0]
    return [(float(key[a]), float(key[b])) for a, b in (pair_dims(rope_type, d, i) for i in range(d // 2))]


@dataclass(frozen=True)
class RopeCheck:
    """Every pair of one cell's key checked, and the pairs to picture."""

    cell: int
    pairs: list[RopePair]  # the pictured ones
    n_pairs: int
    rotation_error: float  # the largest over all pairs
    fresh_error: float
    slowest: float  # theta of the last pair, radians per position


def rope_pairs(model, before: Snapshot, after: Snapshot, fresh: Snapshot, *, cell: int, pairs: tuple[int, ...],
               head: int = 0) -> RopeCheck:
    """Pairs of `cell`'s key (one head, the base cache's first layer) before a shift and after the K-shift,
    and the same token's key from `fresh`, a run at the new positions. Asserts, for EVERY pair of the head,
    that the shifted pair is the stored one turned by delta * theta_i, and the fresh run's pair."""
    if before.type_k != "f32":
        raise ValueError(f"use an f32 K cache for this comparison (type_k='f32'), not {before.type_k}: a rounded "
                         f"cache compares its rounding, not the rotation")
    (pos, seqs, _), new_pos = before.cells[cell], after.cells[cell][0]
    delta, layer = new_pos - pos, before.layer_ids[0]
    fresh_cell = fresh.cell_at(new_pos, seq=min(seqs))
    theta = angles_per_position(model, layer)
    rope_type = model.config.rope_type
    stored, shifted, again = (_pairs(rope_type, snap.key(c, head))
                              for snap, c in ((before, cell), (after, cell), (fresh, fresh_cell)))
    found = [RopePair(i, pair_dims(rope_type, before.head_dim, i), float(theta[i]), pos, delta, stored[i], shifted[i],
                      again[i]) for i in range(len(stored))]
    for p in found:
        assert p.rotation_error < ROTATION_TOLERANCE, f"pair {p.i}: the K-shift is not a rotation by delta * theta"
        assert p.fresh_error < FRESH_TOLERANCE, f"pair {p.i}: the shifted key is not the fresh run's"
    return RopeCheck(cell, [found[i] for i in pairs], len(found), max(p.rotation_error for p in found),
                     max(p.fresh_error for p in found), found[-1].theta)


def pairs_table(check: RopeCheck) -> str:
    """The pictured pairs in a small table: the angle each turned, and where each landed."""
    lines = ["pair  dims     theta (rad/pos)  turned by delta*theta   stored angle  after K-shift  fresh run"]
    for p in check.pairs:
        winds = abs(p.turned) / (2 * math.pi)
        turns = f"{p.turned:7.3f} rad" + (f" ({winds:.1f} turns)" if winds > 1 else "")
        angles = [math.degrees(math.atan2(y, x)) for x, y in (p.stored, p.shifted, p.fresh)]
        lines.append(f"{p.i:4d}  {p.dims[0]:2d}, {p.dims[1]:2d}   {p.theta:14.5f}  {turns:<22}"
                     + "".join(f"  {a:9.1f} deg" for a in angles))
    return "\n".join(lines)


def describe_pairs(check: RopeCheck) -> str:
    p = check.pairs[0]
    return (f"In all {check.n_pairs} pairs of the key (pictured: {len(check.pairs)}), the K-shift's result is the "
            f"stored pair turned by {p.delta}·θ_i, to within {check.rotation_error:.1e}, and the fresh run's key at "
            f"position {p.pos + p.delta}, to within {check.fresh_error:.1e}: f32 rounding, nothing more. (The slowest "
            f"pair, {check.n_pairs - 1}, turns {1000 * check.slowest:.1e} rad in a thousand positions.)")


def rope_caption(check: RopeCheck) -> str:
    fast, slow = check.pairs[0], check.pairs[-1]
    new = fast.pos + fast.delta
    return (f"Key moment: cell {check.cell}'s key on the planes of {len(check.pairs)} of its pairs. Grey: as stored at "
            f"position {fast.pos}; blue: after the K-shift to {new}; orange circle: the fresh run's key at {new}. "
            f"Pair {fast.i} wound {abs(fast.turned) / (2 * math.pi):.1f} times round, pair {slow.i} turned "
            f"{math.degrees(abs(slow.turned)):.0f} degrees; every arrow kept its length and landed on the fresh run's "
            f"key.")


def check_values(after: Snapshot, fresh: Snapshot) -> str:
    """V rows of the shifted cache equal a fresh run's at the new positions, though the K-shift never touched them."""
    cells = after.used()
    twins = [fresh.cell_at(after.cells[c][0], min(after.cells[c][1])) for c in cells]  # the same tokens, fresh
    error = (after.values[:, cells] - fresh.values[:, twins]).abs().max().item()
    assert error < FRESH_TOLERANCE, f"V rows differ from a fresh run's by {error}"
    return (f"The V rows of all {len(cells)} cells equal the fresh run's to within {error:.1e}, untouched: a value "
            f"carries no position, so a shift owes it nothing.")


def _arc(p: RopePair, radius: float) -> tuple[list[float], list[float]]:
    """The way from the stored pair's angle to the shifted one's, a spiral when it winds more than once."""
    start, n = math.atan2(p.stored[1], p.stored[0]), 240
    winds = abs(p.turned) > 2 * math.pi
    points = [(start + p.turned * t / n, radius * (0.55 + (0.4 * t / n if winds else 0.2))) for t in range(n + 1)]
    return [r * math.cos(a) for a, r in points], [r * math.sin(a) for a, r in points]


def rope_figure(check: RopeCheck) -> go.Figure:
    """Each pictured pair on its plane: the stored pair (grey), after the K-shift (blue), the fresh run's
    (orange circle), and the arc of the rotation by delta * theta_i."""
    pairs = check.pairs
    titles = [f"pair {p.i} (dims {p.dims[0]} and {p.dims[1]})<br>θ = {p.theta:.4g} rad/pos, turned {p.turned:.2f} rad"
              for p in pairs]
    figure = make_subplots(rows=1, cols=len(pairs), subplot_titles=titles, horizontal_spacing=0.06)
    for k, p in enumerate(pairs, start=1):
        r = math.hypot(*p.stored)
        legend = k == 1
        arc_x, arc_y = _arc(p, r)
        figure.add_trace(go.Scatter(x=arc_x, y=arc_y, mode="lines+markers", name=f"turned by {p.delta}·θ",
                                    line=dict(color="#999999", dash="dot"), showlegend=legend, hoverinfo="skip",
                                    marker=dict(symbol="arrow", angleref="previous", color="#999999",
                                                size=[0] * (len(arc_x) - 1) + [11])), row=1, col=k)
        for (x, y), name, colour in ((p.stored, f"stored at pos {p.pos}", "#777777"),
                                     (p.shifted, f"after the K-shift, pos {p.pos + p.delta}", "#0072B2")):
            figure.add_trace(go.Scatter(x=[0, x], y=[0, y], mode="lines+markers", name=name, showlegend=legend,
                                        line=dict(color=colour, width=3),
                                        hovertemplate=f"{name}: (%{{x:.3f}}, %{{y:.3f}})<extra></extra>",
                                        marker=dict(symbol="arrow", angleref="previous", size=[0, 14], color=colour)),
                             row=1, col=k)
        figure.add_trace(go.Scatter(x=[p.fresh[0]], y=[p.fresh[1]], mode="markers", showlegend=legend,
                                    name=f"fresh run at pos {p.pos + p.delta}",
                                    hovertemplate="fresh run: (%{x:.3f}, %{y:.3f})<extra></extra>",
                                    marker=dict(symbol="circle-open", size=22, color="#D55E00", line=dict(width=2))),
                         row=1, col=k)
        bound = 1.15 * r
        figure.update_xaxes(range=[-bound, bound], zeroline=True, showgrid=False, row=1, col=k,
                            title_text=f"dim {p.dims[0]}")
        figure.update_yaxes(range=[-bound, bound], zeroline=True, showgrid=False, row=1, col=k,
                            scaleanchor=f"x{k if k > 1 else ''}", title_text=f"dim {p.dims[1]}")
    figure.update_layout(height=440, width=1000, margin=dict(l=50, r=10, t=80, b=40), plot_bgcolor="white",
                         legend=dict(orientation="h", x=0, y=-0.18))
    return figure


# ---- section 3: what the model reads ----------------------------------------------------------------------------
def logit_difference(a: engine.Context, b: engine.Context) -> float:
    """The largest difference of the last token's logits of two contexts."""
    return (a.logits(-1).float() - b.logits(-1).float()).abs().max().item()


def check_logits(shifted: engine.Context, fresh: engine.Context) -> str:
    """Attention sees only differences of positions: a sequence moved whole predicts as a fresh run at the
    new positions does."""
    error = logit_difference(shifted, fresh)
    assert error < LOGIT_TOLERANCE, f"logits after the K-shift differ from a fresh run's by {error}"
    top = fresh.logits(-1).float().abs().max().item()
    return (f"Next-token logits after the shift against the fresh run: largest difference {error:.1e} (allowed "
            f"{LOGIT_TOLERANCE:g}), on logits that reach {top:.1f}: the same prediction.")


def shifted_and_fresh(model, tokens: list[int], delta: int, **settings) -> tuple[engine.Context, engine.Context]:
    """Section 1 in one go: tokens but the last at 0.., seq_add by delta, the last token; and a fresh run
    of all of them at delta.."""
    n = len(tokens)
    shifted, fresh = context(model, **settings), context(model, **settings)
    decode(shifted, tokens[:-1], range(n - 1))
    shifted.memory.seq_add(0, 0, -1, delta)
    decode(shifted, tokens[-1:], [n - 1 + delta])
    decode(fresh, tokens, range(delta, n + delta))
    return shifted, fresh


def check_f16_shift(model, tokens: list[int], delta: int) -> str:
    """The default f16 cache: the K-shift reads f16 keys, turns them in f32 and stores f16 again, so the
    shifted cache is a fresh run up to f16 rounding (larger than f32's, still small)."""
    f16 = logit_difference(*shifted_and_fresh(model, tokens, delta, type_k="f16", type_v="f16"))
    f32 = logit_difference(*shifted_and_fresh(model, tokens, delta))
    assert f32 < f16 < F16_LOGIT_TOLERANCE, (f16, f32)
    return (f"With f16 K/V the same shift leaves the logits within {f16:.1e} of a fresh run (f32: {f32:.1e}): the "
            f"rotation is computed in f32 on keys read from f16 and stored back in f16, so only f16 rounding is left.")


# ---- section 4: the context shift of a generating session ---------------------------------------------------
def run_until_context_shift(session, grid, log, max_steps: int = 80) -> list[ev.Event]:
    """Step the session one token at a time, redrawing the views, until a step shifts; that step's events."""
    for _ in range(max_steps):
        counted = grid.watcher.events
        session.step(1).result()
        grid.update()
        step = grid.watcher.events_since(counted)
        if any(isinstance(e, ev.CellsShifted) for e in step):
            log.update()
            return step
    raise AssertionError(f"the cache did not fill within {max_steps} steps")


def swap_line(session) -> str:
    """llama-completion's own line for the shift (LOG_DBG in tools/completion/completion.cpp), from the session's
    log."""
    lines = [line.text for line in session.log.lines() if line.text.startswith("context full, swapping")]
    assert lines, "the session logged no context shift"
    return lines[-1]


def shift_step_lines(step: list[ev.Event], cache: str = "base") -> list[str]:
    """The base cache's events of the shifting step, in order: removed, shifted, K-shift, then the new token.
    llama-completion shifts just before decoding its next token, so the owed rotation is paid at once."""
    kinds = (ev.CellsRemoved, ev.CellsShifted, ev.KShiftApplied, ev.CellsAllocated)
    picked = [e for e in step if isinstance(e, kinds) and e.cache == cache and not e.tentative]
    assert [type(e) for e in picked] == list(kinds), [type(e).__name__ for e in picked]
    return [describe_event(e) for e in picked]


@dataclass(frozen=True)
class ContextShift:
    """One context shift read from its events: the kept, discarded and moved cells, and where the next token went."""

    n_keep: int
    n_discard: int
    n_past: int  # positions held before the shift
    new_cell: int  # where the next token went

    @classmethod
    def of(cls, step: list[ev.Event], cache: str = "base") -> ContextShift:
        removed = next(e for e in step if isinstance(e, ev.CellsRemoved) and e.cache == cache)
        shifted = next(e for e in step if isinstance(e, ev.CellsShifted) and e.cache == cache)
        placed = next(e for e in step if isinstance(e, ev.CellsAllocated) and e.cache == cache and not e.tentative)
        assert shifted.amount == -(removed.p1 - removed.p0) and shifted.p0 == removed.p1
        return cls(removed.p0, removed.p1 - removed.p0, shifted.p1, int(placed.changes[0].cells[0]))

    def caption(self) -> str:
        assert self.new_cell == self.n_keep, "the next token takes the first freed cell"
        moved = self.n_keep + self.n_discard
        return (f"Key moment: the pair after the context shift (base on top). Cells 0-{self.n_keep - 1} kept their "
                f"tokens, cells {self.n_keep + 1}-{moved - 1} are the discarded tokens' empty cells, cells "
                f"{moved}-{self.n_past - 1} hold the moved tokens, now at positions "
                f"{self.n_keep}-{self.n_past - self.n_discard - 1}, and the new token took cell {self.new_cell} "
                f"(hover a cell for its position).")

    def cells_to_explain(self) -> tuple[int, ...]:
        """The first cell, the last kept one, the one the next token took, and the first moved one."""
        return 0, self.n_keep - 1, self.new_cell, self.n_keep + self.n_discard


def check_context_shift(session, shift: ContextShift, asked_keep: int, prompt: str) -> str:
    """The shift as llama-completion makes it: n_keep plus the BOS token kept, half of the rest discarded, the
    tail moved down in place, and the next token in the first free cell."""
    model = session.model
    n_prompt = len(model.tokenizer.encode(prompt))
    assert shift.n_keep == resolve_n_keep(asked_keep, n_prompt, model.config.add_bos) == asked_keep + 1
    assert shift.n_discard == (shift.n_past - shift.n_keep) // 2
    cells = session.engine_cells().result()["base"]["cells"][0]
    first_moved = shift.n_keep + shift.n_discard
    assert cells[first_moved][0] == shift.n_keep, "the first moved token kept its cell, at position n_keep"
    assert shift.new_cell == shift.n_keep and cells[shift.new_cell][0] == shift.n_past - shift.n_discard
    return (f"Cell {shift.new_cell} holds position {cells[shift.new_cell][0]} and cell {first_moved} position "
            f"{cells[first_moved][0]}: a cell's index is not its position. The moved tokens kept their cells; the new "
            f"token took the first free one, in the hole the discarded tokens left.")


# ---- section 5: what the model forgets --------------------------------------------------------------------------
@dataclass
class Forgetting:
    """The next token after the full text, after a context shift, and after a fresh run of only what it kept."""

    full: engine.Context
    shifted: engine.Context
    rerun: engine.Context
    before: Snapshot  # the shifted context's base cache just before its context shift
    dropped: str
    n_keep: int
    n_discard: int

    def kl(self, a: engine.Context, b: engine.Context) -> float:
        """KL(a || b) of the next-token distributions, in nats."""
        p, q = (torch.log_softmax(c.logits(-1).float(), -1) for c in (a, b))
        return float((p.exp() * (p - q)).sum())

    def top(self, ctx: engine.Context, model, k: int = 5) -> list[tuple[str, float]]:
        probs = torch.softmax(ctx.logits(-1).float(), -1)
        values, ids = probs.topk(k)
        return [(model.tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids)]


def forget(model, tokens: list[int], n_keep: int, n_discard: int) -> Forgetting:
    """A context shift of `tokens` (keep n_keep, discard n_discard, the last token decoded after it), next to
    the full text and a fresh run of the kept tokens. Asserts what the notebook says of them."""
    n = len(tokens)
    full, shifted, rerun = context(model), context(model), context(model)
    decode(full, tokens, range(n))
    decode(shifted, tokens[:-1], range(n - 1))
    before = Snapshot.of(shifted)
    shifted.memory.seq_rm(0, n_keep, n_keep + n_discard)
    shifted.memory.seq_add(0, n_keep + n_discard, -1, -n_discard)
    decode(shifted, tokens[-1:], [n - 1 - n_discard])
    kept = tokens[:n_keep] + tokens[n_keep + n_discard:]
    decode(rerun, kept, range(len(kept)))
    found = Forgetting(full, shifted, rerun, before, model.tokenizer.decode(tokens[n_keep:n_keep + n_discard]), n_keep,
                       n_discard)
    _check_what_is_kept(found)
    assert found.kl(shifted, rerun) > MIN_KL, "the kept tokens' cells still carry what they saw"
    return found


def _check_what_is_kept(f: Forgetting) -> None:
    """The first n_keep tokens came before the discarded ones: their keys and values are the fresh run's. The
    moved tokens' K and V in the base cache (layer 5, above the first layer) were computed with the discarded
    tokens in view: they are not."""
    shifted, rerun = Snapshot.of(f.shifted), Snapshot.of(f.rerun)
    keep = list(range(f.n_keep))
    assert (shifted.keys[:, keep] - rerun.keys[:, keep]).abs().max() < FRESH_TOLERANCE
    assert (shifted.values[:, keep] - rerun.values[:, keep]).abs().max() < FRESH_TOLERANCE
    moved = [c for c in shifted.used() if c >= f.n_keep]
    twins = [rerun.cell_at(shifted.cells[c][0]) for c in moved]
    assert (shifted.values[:, moved] - rerun.values[:, twins]).abs().max() > 100 * FRESH_TOLERANCE


def forgetting_table(f: Forgetting, model) -> str:
    """The top five next tokens of the three runs, side by side."""
    runs = {"full text": f.full, "context-shifted": f.shifted, "fresh run of the kept tokens": f.rerun}
    tops = {name: f.top(ctx, model) for name, ctx in runs.items()}
    lines = ["      " + "".join(f"{name:<30}" for name in runs)]
    for k in range(5):
        row = (tops[name][k] for name in runs)
        lines.append(f"  {k + 1}.  " + "".join(f"{tok!r:<14}{p:6.3f}{'':10}" for tok, p in row))
    return "\n".join(lines)


def describe_forgetting(f: Forgetting, model) -> str:
    first = {name: repr(f.top(ctx, model, 1)[0][0]) for name, ctx in (("full", f.full), ("shifted", f.shifted),
                                                                       ("rerun", f.rerun))}
    to_rerun, to_full = f.kl(f.shifted, f.rerun), f.kl(f.shifted, f.full)
    closer = "the fresh run of the kept tokens than to the full text" if to_rerun < to_full else \
        "the full text than to the fresh run of the kept tokens"
    return (f"Most likely next token: {first['full']} after the full text, {first['shifted']} after the context "
            f"shift, {first['rerun']} after a fresh run of the kept tokens. KL(shifted ‖ fresh run) = {to_rerun:.3f} "
            f"nats and KL(shifted ‖ full text) = {to_full:.3f} nats: the shifted cache is closer to {closer}, and "
            f"is neither.")


def forgetting_figure(f: Forgetting, model) -> go.Figure:
    """The probabilities of each run's three most likely next tokens, in all three runs."""
    runs = (("full text", f.full, "#999999"), ("context-shifted", f.shifted, "#0072B2"),
            ("fresh run of the kept tokens", f.rerun, "#D55E00"))
    ids: list[int] = []
    for _, ctx, _ in runs:
        ids += [int(i) for i in torch.softmax(ctx.logits(-1).float(), -1).topk(3).indices if int(i) not in ids]
    figure = go.Figure()
    for name, ctx, colour in runs:
        probs = torch.softmax(ctx.logits(-1).float(), -1)[ids]
        figure.add_trace(go.Bar(x=[repr(model.tokenizer.decode([i])) for i in ids], y=probs.tolist(), name=name,
                                marker_color=colour))
    figure.update_layout(barmode="group", height=360, width=1000, yaxis_title="probability of the next token",
                         title=f"The next token after a context shift (keep {f.n_keep}, discard {f.n_discard})",
                         margin=dict(l=60, r=10, t=80, b=40), plot_bgcolor="white", xaxis_tickfont=dict(size=16),
                         legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom"))
    return figure


# ---- exercises -------------------------------------------------------------------------------------------------------
def seq_div_moment(model, tokens: list[int], divisor: int) -> tuple[Snapshot, Snapshot]:
    """The base cache before and after seq_div of the whole sequence (llama.cpp's self-extend), before the
    next decode: the positions divided, and the shift recorded with llama.cpp's sign (QUIRK_DIV_SHIFT)."""
    ctx = context(model)
    decode(ctx, tokens, range(len(tokens)))
    before = Snapshot.of(ctx)
    ctx.memory.seq_div(0, 0, -1, divisor)
    return before, Snapshot.of(ctx)


def can_shift_without_swa_full(model, tokens: list[int], delta: int) -> tuple[bool, int]:
    """A pair whose SWA cache is smaller than its base (swa_full off, n_ctx 1024): what llama_memory_can_shift
    says, and the return code of the decode after a seq_add all the same (QUIRK_ISWA_SHIFT)."""
    ctx = context(model, n_ctx=1024, swa_full=False)
    assert ctx.memory.swa.size < ctx.memory.base.size
    decode(ctx, tokens, range(len(tokens)))
    says = ctx.memory.can_shift()
    ctx.memory.seq_add(0, 0, -1, delta)
    return says, ctx.decode(engine.Batch(tokens=tokens[-1:], pos=[len(tokens) + delta], seq_ids=[[0]]))
