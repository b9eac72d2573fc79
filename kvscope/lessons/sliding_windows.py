"""Notebook 5, sliding windows and iSWA: the plumbing and the checks behind its cells.

The notebook shows the idea in a few lines per cell; here live the scenarios it runs (a session on a
teaching-sized iSWA pair, contexts decoded and shifted by hand), the sentences it says under each output
(computed from the state, never typed in) and the asserts that keep its prose true: if the engine stops
behaving as the notebook says, the notebook stops with the assert that failed.

One window for the whole lesson: WINDOW (16), set with kvscope's `swa_window` (llama.cpp would need
`--override-kv gemma3.attention.sliding_window=int:16`); the demo model itself was trained with 64.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import engine
from engine import events
from engine.kv.cache import QUIRK_ISWA_SHIFT
from engine.kv.swa import SwaType, attends, is_masked_swa
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.watch import CellVisibility, Watcher, visibility
from engine.watch.attention_mask import MaskCell, UbatchMask, last_ubatch_mask
from engine.watch.describe import cell_map, describe_event

WINDOW = 16  # the lesson's one sliding window (kvscope's swa_window)
# The live session: a 128-cell base cache, llama.cpp's rule for the swa cache with a small ubatch and padding.
SETTINGS = dict(n_ctx=128, pad=32, n_ubatch=8, n_seq_max=1, kv_unified=True, swa_window=WINDOW)
GREEDY = dict(temperature=0.0, seed=1)
PROMPT = "And God said unto Moses, I AM THAT I AM"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def span(values) -> str:
    """'3-7' for consecutive numbers, '5' for one."""
    values = sorted(int(v) for v in values)
    if not values:
        return "none"
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


# ---- the model --------------------------------------------------------------------------------------


def describe_model(model) -> str:
    """The demo model's layers and window in a sentence, and the lesson's window beside it."""
    cfg = model.config
    sliding = [il for il in range(cfg.n_layer) if cfg.swa_layers[il]]
    full = [il for il in range(cfg.n_layer) if not cfg.swa_layers[il]]
    assert cfg.n_swa > 0 and sliding and full, "the demo model has sliding and full-attention layers"
    assert SwaType(cfg.swa_type) == SwaType.STANDARD
    return (f"{cfg.name}: {cfg.n_layer} layers; layers {span(sliding)} slide over a standard window of "
            f"{cfg.n_swa} positions, layer {span(full)} attends to everything. This notebook sets the window to "
            f"{WINDOW} (`swa_window={WINDOW}`).")


# ---- 1. three kinds of window ----------------------------------------------------------------------------

FUTURE, OUTSIDE, SEEN = 0, 1, 2  # a key for a query: after it (causal mask), outside its window, attended
KINDS = (SwaType.STANDARD, SwaType.CHUNKED, SwaType.SYMMETRIC)


def window_kinds(n_swa: int = WINDOW, n: int = 3 * WINDOW) -> dict[SwaType, np.ndarray]:
    """Per kind of window, states[q, k] for a query at position q and a key at position k (FUTURE, OUTSIDE
    or SEEN), from the rule the attention kernel masks with (engine.kv.swa). Standard and chunked windows
    come with the causal mask, as in a causal model; the symmetric one without (a non-causal model)."""
    p = np.arange(n)
    holds = np.ones((n, n), dtype=bool)  # every key belongs to the query's sequence here
    out = {}
    for kind in KINDS:
        if kind == SwaType.SYMMETRIC:
            seen = ~is_masked_swa(n_swa, kind, p[None, :], p[:, None])
            later = np.zeros((n, n), dtype=bool)
        else:
            seen = attends(p[None, :], holds, p[:, None], n_swa, kind)
            later = p[None, :] > p[:, None]
        out[kind] = np.where(seen, SEEN, np.where(later, FUTURE, OUTSIDE)).astype(np.int8)
    check_window_counts(out, n_swa)
    return out


def keys_seen(states: np.ndarray) -> np.ndarray:
    """How many keys each query attends to."""
    return (states == SEEN).sum(axis=1)


def check_window_counts(kinds: dict[SwaType, np.ndarray], n_swa: int) -> None:
    """The counts the notebook states: a standard window sees min(q + 1, n_swa) keys, a chunked one
    q % n_swa + 1, a symmetric one n_swa // 2 on each side plus itself."""
    n = len(next(iter(kinds.values())))
    p, half = np.arange(n), n_swa // 2
    assert (keys_seen(kinds[SwaType.STANDARD]) == np.minimum(p + 1, n_swa)).all()
    assert (keys_seen(kinds[SwaType.CHUNKED]) == p % n_swa + 1).all()
    assert (keys_seen(kinds[SwaType.SYMMETRIC]) == np.minimum(p, half) + np.minimum(n - 1 - p, half) + 1).all()
    # a full-attention layer has no window at all: only the causal mask
    full = attends(p[None, :], np.ones((n, n), dtype=bool), p[:, None], n_swa, SwaType.NONE)
    assert (full.sum(axis=1) == p + 1).all()


def window_figure(kinds: dict[SwaType, np.ndarray], n_swa: int = WINDOW):
    """The three windows side by side, a row per query and a column per key, in MaskView's colours: the
    sequence's colour where the query attends, dark grey outside the window, light grey after the query."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from engine.watch import style
    from explorer.mask import MASKED_FILL, OUTSIDE_FILL

    names = {SwaType.STANDARD: "standard (Gemma, gpt-oss)", SwaType.CHUNKED: "chunked (Llama 4)",
             SwaType.SYMMETRIC: "symmetric (no causal mask)"}
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=[names[k] for k in kinds], horizontal_spacing=0.06)
    colours = [MASKED_FILL[False], OUTSIDE_FILL[False], style.seq_color(0, False)]  # FUTURE, OUTSIDE, SEEN
    scale = [[edge, colours[k]] for k in range(3) for edge in (k / 3, (k + 1) / 3)]
    words = np.array(["masked: after the query (causal)", "masked: outside the window", "attended"])
    for col, (kind, states) in enumerate(kinds.items(), start=1):
        fig.add_trace(go.Heatmap(z=states, zmin=-0.5, zmax=2.5, colorscale=scale, showscale=False, xgap=1, ygap=1,
                                 customdata=words[states],
                                 hovertemplate="query %{y}, key %{x}: %{customdata}<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title_text="key position", row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    fig.update_yaxes(title_text="query position", row=1, col=1)
    fig.update_layout(height=400, width=1000, margin=dict(l=50, r=10, t=70, b=40), plot_bgcolor="#FFFFFF",
                      title=dict(text=f"window n_swa = {n_swa}: coloured where the query attends, dark grey outside "
                                      "the window, light grey after the query", font=dict(size=13), x=0.01))
    return fig


def window_caption(kinds: dict[SwaType, np.ndarray], n_swa: int = WINDOW) -> str:
    standard, chunked, symmetric = (keys_seen(kinds[k]) for k in KINDS)
    chunk_starts = np.flatnonzero(chunked == 1).tolist()
    return (f"A standard window of {n_swa} gives each query at most {int(standard.max())} keys (itself and the "
            f"{int(standard.max()) - 1} before it); a chunked one sees a single key at positions "
            f"{', '.join(map(str, chunk_starts))} (each chunk's start) and {int(chunked.max())} at a chunk's end; "
            f"a symmetric one sees {n_swa // 2} on each side plus itself, {int(symmetric.max())} keys.")


def keys_seen_table(kinds: dict[SwaType, np.ndarray], queries: list[int]) -> None:
    """Keys seen per query position, one column per kind of window."""
    print(f"{'query position':>14s}  " + "  ".join(f"{k.name.lower():>9s}" for k in kinds))
    for q in queries:
        print(f"{q:14d}  " + "  ".join(f"{int(keys_seen(states)[q]):9d}" for states in kinds.values()))


# ---- 2. the pair's two caches ---------------------------------------------------------------------------


def pad_to(n: int, pad: int) -> int:
    return (n + pad - 1) // pad * pad


def swa_rule(n_ctx_seq: int, n_swa: int, n_seq_max: int, unified: bool, n_ubatch: int, pad: int,
             swa_full: bool = False) -> int:
    """The swa cache's cells per stream, as llama_kv_cache_iswa's constructor computes them
    (src/llama-kv-cache-iswa.cpp): a window per sequence of the buffer, plus a ubatch, padded; never
    more than the base cache; all of it with swa_full."""
    if swa_full:
        return n_ctx_seq
    return pad_to(min(n_ctx_seq, n_swa * (n_seq_max if unified else 1) + n_ubatch), pad)


def created(ctx: engine.Context) -> dict[str, events.ContextCreated]:
    """Each cache's ContextCreated event: its size, layers, window and bytes."""
    return {e.cache: e for e in ctx.state_events() if isinstance(e, events.ContextCreated)}


SIZE_CASES = [dict(n_ctx=1024),  # llama.cpp's defaults: pad 256, n_ubatch 512, one sequence
              dict(n_ctx=4096, n_seq_max=4, kv_unified=True),
              dict(n_ctx=4096, n_seq_max=4, kv_unified=False),
              dict(n_ctx=128, pad=32, n_ubatch=8),  # the session below
              dict(n_ctx=128, pad=32, n_ubatch=8, n_seq_max=2, kv_unified=True),
              dict(n_ctx=128, pad=32, n_ubatch=8, swa_full=True)]


def settings_text(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def swa_size_of(model, **settings) -> int:
    """The swa cache's cells per stream of a context made with these settings (and the lesson's window),
    checked against the rule."""
    ctx = engine.Context(model, **{"swa_window": WINDOW, **settings})
    c, p = created(ctx), ctx.params
    rule = swa_rule(p.n_ctx_seq, c["swa"].n_swa, p.n_seq_max, p.kv_unified, p.n_ubatch, p.pad, p.swa_full)
    assert c["swa"].kv_size == rule, (settings, c["swa"].kv_size, rule)
    assert c["base"].kv_size == p.n_ctx_seq
    return c["swa"].kv_size


def size_table(model, cases: list[dict] = SIZE_CASES) -> list[tuple[int, int, int]]:
    """Per case, the cells per stream of base and swa as the contexts' ContextCreated events report
    them, next to the rule; asserts that they agree and that swa holds exactly the sliding layers."""
    sliding = tuple(il for il in range(model.config.n_layer) if model.config.swa_layers[il])
    rows = []
    print(f"{'settings (and swa_window=' + str(WINDOW) + ')':60s} {'base':>8s} {'swa':>8s} {'rule':>5s}")
    for settings in cases:
        ctx = engine.Context(model, swa_window=WINDOW, **settings)
        c, p = created(ctx), ctx.params
        rule = swa_rule(p.n_ctx_seq, c["swa"].n_swa, p.n_seq_max, p.kv_unified, p.n_ubatch, p.pad, p.swa_full)
        assert c["swa"].kv_size == rule and c["base"].kv_size == p.n_ctx_seq
        assert c["swa"].layer_ids == sliding and c["swa"].n_swa == WINDOW and c["base"].n_swa == 0
        streams = "" if p.kv_unified or p.n_seq_max == 1 else f" x{p.n_seq_max}"
        print(f"{settings_text(settings):60s} {str(c['base'].kv_size) + streams:>8s} "
              f"{str(c['swa'].kv_size) + streams:>8s} {rule:5d}")
        rows.append((c["base"].kv_size, c["swa"].kv_size, rule))
    return rows


def size_sentence(rows: list[tuple[int, int, int]]) -> str:
    """What to read in the table: the defaults' swa cache against the window, and the session's."""
    (_, defaults, _), (_, session, _) = rows[0], rows[3]
    return (f"Every swa size is the rule's. At llama.cpp's defaults (first row) the swa cache has {defaults} cells "
            f"for a window of {WINDOW}: the ubatch of 512 and the padding to 256 make most of it. The session below "
            f"(fourth row) gets {session}: {WINDOW} + {SETTINGS['n_ubatch']} = {WINDOW + SETTINGS['n_ubatch']}, padded "
            f"to a multiple of {SETTINGS['pad']}.")


# ---- 3. the live session -----------------------------------------------------------------------------


def new_session(model, **settings) -> Session:
    """A session on the lesson's settings (SETTINGS, changed by `settings`) generating greedily; one
    compute thread, since the demo model is tiny and a second one only contends."""
    workload = WorkloadSpec("generate", n_predict=200, sampler=GREEDY)
    return Session(model, settings={**SETTINGS, **settings}, workload=workload, threaded=False, threads=1)


def cache_sizes(watcher: Watcher) -> str:
    watcher.poll()
    base, swa = watcher.mirror.created["base"], watcher.mirror.created["swa"]
    rule = swa_rule(base.kv_size, swa.n_swa, SETTINGS["n_seq_max"], True, SETTINGS["n_ubatch"], SETTINGS["pad"])
    assert swa.kv_size == rule and swa.n_swa == WINDOW
    return (f"The window is {swa.n_swa} (the model was trained with {swa.n_swa_train}). base: {base.kv_size} cells for layer {span(base.layer_ids)}; swa: {swa.kv_size} cells for layers "
            f"{span(swa.layer_ids)}, the window {swa.n_swa} plus a ubatch of {SETTINGS['n_ubatch']} = "
            f"{swa.n_swa + SETTINGS['n_ubatch']}, padded to a multiple of {SETTINGS['pad']}.")


def both_caches(watcher: Watcher, seq: int) -> str:
    """After the prompt: the same cells in both caches, but the swa cache's next token already masks some."""
    watcher.poll()
    frame, seen = watcher.frame(), visibility(watcher.mirror, seq)
    base, swa = frame.stream("base"), frame.stream("swa")
    assert base.used == swa.used == seen.next_pos and (base.pos[:base.used] == swa.pos[:swa.used]).all()
    sw = seen.caches["swa"]
    masked = np.sort(sw.pos[sw.cells(CellVisibility.MASKED)])
    assert sw.n_attended == min(seen.next_pos, WINDOW - 1) and seen.caches["base"].n_attended == seen.next_pos
    return (f"The prompt's {seen.next_pos} tokens took cells 0-{seen.next_pos - 1} in both caches "
            f"(base {base.used}/{base.size} used, swa {swa.used}/{swa.size}). The next token, at position "
            f"{seen.next_pos}, will attend to all {seen.caches['base'].n_attended} in base, but only to "
            f"{sw.n_attended} in swa (positions {seen.next_pos - sw.n_attended}-{seen.next_pos - 1}, its window "
            f"with itself making {WINDOW}); positions {span(masked)} are already stored but masked.")


def after_slide(watcher: Watcher, seq: int) -> str:
    """Past the swa cache's end: base keeps every position, swa is full and has gone round."""
    watcher.poll()
    frame, seen = watcher.frame(), visibility(watcher.mirror, seq)
    base, swa = frame.stream("base"), frame.stream("swa")
    sw = seen.caches["swa"]
    assert seen.next_pos > swa.size, "the sequence is longer than the swa cache ..."
    assert swa.used == swa.size, "... which is full, not overflowing"
    assert base.used == seen.next_pos and seen.caches["base"].n_attended == seen.next_pos
    assert sw.n_attended == WINDOW - 1 and sw.counts[CellVisibility.MASKED] == swa.size - (WINDOW - 1)
    wrapped = np.flatnonzero(swa.pos >= swa.size)
    return (f"Position {seen.next_pos} is next. base holds all {base.used} positions in {base.used} cells; swa is "
            f"full ({swa.used} of {swa.size}) and went round: cells {span(wrapped)} now hold positions "
            f"{span(swa.pos[wrapped])}. The next token sees {sw.n_attended} swa cells (positions "
            f"{seen.next_pos - WINDOW + 1}-{seen.next_pos - 1}); the other {sw.counts[CellVisibility.MASKED]} are "
            f"stored but masked (crossed on the grid, grey in the window view).")


def a_reused_cell(watcher: Watcher) -> int:
    """A swa cell that was given to two positions: the one that holds the newest position."""
    watcher.poll()
    swa = watcher.frame().stream("swa")
    cell = int(np.argmax(swa.pos))
    assert swa.pos[cell] >= swa.size, "the newest position went into a reused cell"
    return cell


def pos_min_sentence(session: Session, seq: int) -> str:
    """The pair answers seq_pos_min from its swa cache: no longer 0 once the window slid."""
    memory = session.ctx.memory
    pos_min, base_min, pos_max = memory.seq_pos_min(seq), memory.base.seq_pos_min(seq), memory.seq_pos_max(seq)
    assert pos_min == memory.swa.seq_pos_min(seq) == pos_max + 1 - memory.swa.size and base_min == 0
    return (f"Asked for sequence {seq}'s lowest position, the pair answers {pos_min}, from its swa cache "
            f"(llama_kv_cache_iswa::seq_pos_min), although its base cache still holds position {base_min}.")


# ---- 4. the attention mask of a decode step ------------------------------------------------------------


class Stacked:
    """Several views as one picture, top to bottom (lessons.picture takes anything with figures())."""

    def __init__(self, *views) -> None:
        self.views = views

    def figures(self) -> list:
        return [figure for view in self.views for figure in view.figures()]


def check_decode_masks(base: UbatchMask, swa: UbatchMask) -> None:
    """What section 4 says of one decode step: base attends to every position up to the token; swa's
    window cuts the row at WINDOW cells (its own included) and every other used swa cell holds the sequence
    at a position outside the window (stored but masked); the empty columns are only the padding up to
    n_kv, the used cells rounded up to the padding (16 here)."""
    pos = int(base.token_pos[0])
    assert base.n_tokens == swa.n_tokens == 1 and int(swa.token_pos[0]) == pos and base.exact and swa.exact
    assert base.counts()[0] == pos + 1 and not len(base.cells(0, MaskCell.WINDOW))
    check_swa_row(swa)
    outside = swa.cells(0, MaskCell.WINDOW)
    assert len(outside) == swa.n_used - WINDOW and (swa.cell_pos[outside] <= pos - WINDOW).all()
    for mask in (base, swa):
        assert mask.n_kv == pad_to(mask.n_used, SETTINGS["pad"]) or mask.n_kv == len(mask.cell_pos)
        assert (mask.cells(0, MaskCell.EMPTY) >= mask.n_used).all(), "no hole: only padding is empty"


def check_swa_row(swa: UbatchMask) -> None:
    """A decode step's swa row: exactly the window, the token's own position and the WINDOW - 1 before it."""
    pos = int(swa.token_pos[0])
    assert swa.counts()[0] == WINDOW
    assert (np.sort(swa.cell_pos[swa.attended(0)]) == np.arange(pos - WINDOW + 1, pos + 1)).all()


def mask_sentence(base: UbatchMask, swa: UbatchMask) -> str:
    check_decode_masks(base, swa)
    pos, outside = int(swa.token_pos[0]), swa.cells(0, MaskCell.WINDOW)
    return (f"The token at position {pos}: in base its row attends to {int(base.counts()[0])} cells, positions "
            f"0-{pos}, and the {base.n_kv - base.n_used} white columns after them are padding (n_kv = {base.n_kv}). "
            f"In swa it attends to {int(swa.counts()[0])}, positions {pos - WINDOW + 1}-{pos} with its own cell "
            f"{int(swa.token_cell[0])}: the window cuts the row, and the other {len(outside)} cells, holding "
            f"positions {span(swa.cell_pos[outside])}, are stored but masked (dark grey).")


def purges_seen(watcher: Watcher) -> list:
    watcher.poll()
    return [e for e in watcher.recent if isinstance(e, events.CellsRemoved) and e.reason == "purge"]


def reuse_sentence(before: UbatchMask, after: UbatchMask, watcher: Watcher) -> str:
    """Tokens later: the new tokens went into cells the earlier row had masked (reused, no cell added), each
    the oldest position of the sequence, so no purge was needed."""
    check_swa_row(after)
    masked_before = set(before.cells(0, MaskCell.WINDOW).tolist())
    taken = sorted(masked_before & set(after.attended(0).tolist()))
    assert taken and after.n_used == before.n_used, "cells masked for the earlier token were reused"
    assert (before.cell_pos[taken] < after.token_pos[0] - WINDOW).all()
    assert not purges_seen(watcher), "each reuse took the sequence's oldest position: nothing below it to purge"
    steps = int(after.token_pos[0] - before.token_pos[0])
    return (f"{steps} tokens later (position {int(after.token_pos[0])}) the swa row again attends to "
            f"{int(after.counts()[0])} cells, and the cache still uses {after.n_used}: cells {span(taken)}, masked "
            f"for position {int(before.token_pos[0])} (they held positions {span(before.cell_pos[taken])}), were "
            f"reused for positions {span(after.cell_pos[taken])}. Each held the sequence's oldest position, so no "
            f"purge was needed.")


# ---- 5. shared cells and the purge ---------------------------------------------------------------------


def swa_size_why(ctx: engine.Context) -> tuple[int, str]:
    """The swa cache's cells per stream of a context, and why, in words (checked against the rule)."""
    p, n_swa = ctx.params, ctx.cache_config.n_swa
    size = created(ctx)["swa"].kv_size
    per_buffer = p.n_seq_max if p.kv_unified else 1
    raw = n_swa * per_buffer + p.n_ubatch
    assert size == swa_rule(p.n_ctx_seq, n_swa, p.n_seq_max, p.kv_unified, p.n_ubatch, p.pad, p.swa_full)
    if p.swa_full:
        return size, f"swa_full: as many cells as the base cache, {size}"
    windows = (f"a window of {n_swa} for each of the {per_buffer} sequences of the one buffer" if per_buffer > 1
               else f"one window of {n_swa} per stream")
    capped = f", at most the base cache's {p.n_ctx_seq}" if raw > p.n_ctx_seq else ""
    padded = (f"already a multiple of {p.pad}" if size == min(raw, p.n_ctx_seq)
              else f"padded to a multiple of {p.pad}: {size}")
    return size, f"{windows}, plus a ubatch of {p.n_ubatch}: {raw}{capped}, {padded}"


def shared_cells(watcher: Watcher) -> str:
    """After seq_cp: the prompt's cells hold both sequences, in both caches."""
    watcher.poll()
    swa = watcher.frame().stream("swa")
    shared = np.flatnonzero(swa.n_seqs > 1)
    assert len(shared) == swa.used, "every prompt cell now holds both sequences"
    return (f"{len(shared)} swa cells hold sequences 0 and 1 (`M` in llama.cpp's map of the cells: "
            f"{cell_map(swa.owner, 64)[0]}). Sequence 1 will not generate; sequence 0 will.")


def listen_for_removals(session: Session):
    """A subscription to the session's removals, to pick out the purges among them."""
    return session.subscribe(kinds=(events.CellsRemoved,))


def after_purge(watcher: Watcher, removals) -> str:
    """The purge took sequence 0 out of the shared cells, which now hold sequence 1 alone, still seen by it
    (they stay); it happened in the dry run, and was not rolled back (a QUIRK)."""
    watcher.poll()
    purged = [e for e in removals.drain() if e.reason == "purge"]
    removals.close()
    frame = watcher.frame()
    swa, base = frame.stream("swa"), frame.stream("base")
    n_prompt = int(np.count_nonzero(base.n_seqs > 1))  # base cells keep both sequences: nothing purges there
    assert purged, "the purge removed seq 0 from the shared cells"
    assert all(e.seq_id == 0 and e.cache == "swa" for e in purged)
    assert (swa.owner[:n_prompt] == 1).all(), "the shared swa cells now hold seq 1 alone"
    seen_by_1 = visibility(watcher.mirror, 1).caches["swa"]
    assert seen_by_1.n_attended == min(n_prompt, WINDOW - 1)
    first = purged[0]
    assert first.tentative and first.quirk, "the purge happens in the dry run, and is not rolled back"
    print(describe_event(first).split("  ! ")[0])
    print("  !", first.quirk)
    return (f"When sequence 0's new token took over the cell of its position {first.p1 - 1} (masked, and held by it "
            f"alone), the purge removed sequence 0 from all its positions below as well, [{first.p0}, {first.p1}). Cells "
            f"0-{n_prompt - 1} now hold sequence 1 alone (its colour on the grid): sequence 1's next token still "
            f"sees {seen_by_1.n_attended} of them, so they stay. In base all {n_prompt} still hold both sequences.")


def purge_mask_sentence(mask: UbatchMask, watcher: Watcher) -> str:
    """Sequence 0's decode step after the purge: the once-shared cells are masked as another sequence's."""
    watcher.poll()
    n_prompt = int(np.count_nonzero(watcher.frame().stream("base").n_seqs > 1))
    check_swa_row(mask)
    other = mask.cells(0, MaskCell.OTHER)
    assert other.tolist() == list(range(n_prompt)), "the purged cells hold sequence 1 only"
    assert all(mask.cell_seqs[c] == (1,) for c in other) and int(mask.token_seq[0]) == 0
    outside = mask.cells(0, MaskCell.WINDOW)
    return (f"Sequence 0's last token (position {int(mask.token_pos[0])}) attends to {int(mask.counts()[0])} swa cells, "
            f"its window. Cells {span(other)} are light grey: they hold sequence 1 only, so the mask hides them from "
            f"sequence 0 whatever their positions; {len(outside)} other cells of sequence 0 are outside its window "
            f"(dark grey), waiting to be reused.")


# ---- 6. what swa_full costs ------------------------------------------------------------------------------


def kv_bytes(ctx: engine.Context) -> dict[str, int]:
    return {name: e.k_bytes + e.v_bytes for name, e in created(ctx).items()}


def swa_full_cost(model, n_ctx: int = 4096) -> str:
    """K/V bytes of the pair at llama.cpp's defaults (pad 256, n_ubatch 512), without and with swa_full."""
    rows = {}
    for full in (False, True):
        ctx = engine.Context(model, n_ctx=n_ctx, swa_full=full, swa_window=WINDOW)
        rows[full] = (kv_bytes(ctx), created(ctx)["swa"].kv_size, ctx.memory.can_shift())
        del ctx
    for full, (nbytes, cells, can_shift) in rows.items():
        print(f"swa_full={full!s:5s}: swa cache {cells:4d} cells, K+V {sum(nbytes.values()) / 2**20:.2f} MiB "
              f"(base {nbytes['base'] / 2**20:.2f}, swa {nbytes['swa'] / 2**20:.2f}); can_shift = {can_shift}")
    (small, cells_small, shift_small), (large, cells_large, shift_large) = rows[False], rows[True]
    assert large["base"] == small["base"] and cells_large == n_ctx and not shift_small and shift_large
    assert large["swa"] * cells_small == small["swa"] * cells_large  # bytes grow with the cells
    ratio = sum(large.values()) / sum(small.values())
    n_sliding = sum(model.config.swa_layers)
    return (f"swa_full costs {ratio:.1f}x the K/V memory here: the {n_sliding} sliding layers of {model.config.n_layer} "
            f"get {cells_large} cells instead of {cells_small}. In exchange the memory can shift.")


# ---- 7. shifting -------------------------------------------------------------------------------------------

SHIFT = dict(n_ctx=64, pad=32, n_ubatch=8, swa_window=WINDOW, type_k="f32", type_v="f32")
STORY = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: and God "
         "divided the light from the darkness. And God called the light Day, and the darkness he called Night.")
N_PAST, N_KEEP, N_DISCARD = 47, 4, 20


@dataclass
class ShiftRun:
    """A context decoded, shifted by hand and decoded once more: what the notebook shows of it."""

    ctx: engine.Context
    rc: int
    logits: np.ndarray
    watcher: Watcher  # a watcher of the context's events, for an event log


def shift_by_hand(model, swa_full: bool) -> ShiftRun:
    """Decode N_PAST tokens, shift them as llama-completion's context shift does (seq_rm, then seq_add),
    decode the next token."""
    bus = engine.EventBus()
    watcher = Watcher(bus.subscribe())
    story = model.tokenizer.encode(STORY)
    assert len(story) > N_PAST
    ctx = engine.Context(model, **SHIFT, swa_full=swa_full, bus=bus)
    assert ctx.decode(engine.Batch.for_sequence(story[:N_PAST], 0, 0)) == 0
    ctx.memory.seq_rm(0, N_KEEP, N_KEEP + N_DISCARD)
    ctx.memory.seq_add(0, N_KEEP + N_DISCARD, N_PAST, -N_DISCARD)
    rc = ctx.decode(engine.Batch([story[N_PAST]], [N_PAST - N_DISCARD], [[0]]))
    watcher.poll()
    return ShiftRun(ctx, rc, ctx.logits(-1).numpy().copy(), watcher)


def shift_events(run: ShiftRun) -> list:
    return [e for e in run.watcher.recent if isinstance(e, (events.CellsShifted, events.KShiftApplied))]


def check_shift_quirk(runs: dict[bool, ShiftRun], log) -> float:
    """What section 7 says: the pair without swa_full says it cannot shift, then shifts (both caches
    re-rotated, rc 0, the events marked QUIRK and the log showing `!`); the logits match swa_full's."""
    plain, full = runs[False], runs[True]
    assert not plain.ctx.memory.can_shift() and full.ctx.memory.can_shift()
    assert plain.rc == full.rc == 0, "no abort: the decode ran"
    moves = shift_events(plain)
    assert sorted(e.cache for e in moves if isinstance(e, events.KShiftApplied)) == ["base", "swa"]
    assert moves and all(e.quirk == QUIRK_ISWA_SHIFT for e in moves)
    assert not any(e.quirk for e in shift_events(full))
    shown = [e for e in log.kept() if isinstance(e, (events.CellsShifted, events.KShiftApplied))]
    assert shown and all("  ! " in describe_event(e) for e in shown), "the event log marks them with !"
    diff = float(np.abs(plain.logits - full.logits).max())
    assert diff < 1e-4
    return diff


def shift_sentence(runs: dict[bool, ShiftRun], log) -> str:
    diff = check_shift_quirk(runs, log)
    plain = runs[False]
    return (f"Without swa_full (swa {plain.ctx.memory.swa.size} cells, base {plain.ctx.memory.base.size}) the pair "
            f"says can_shift = {plain.ctx.memory.can_shift()}, yet both caches re-rotated their keys and the decode "
            f"returned {plain.rc}; each of those events carries the QUIRK (`!`, in red). The next token's logits "
            f"match the swa_full run's to {diff:.1g}.")


def shift_works(session: Session, seq: int, before: int, n_discard: int, outcomes) -> str:
    """With swa_full the session's context shift runs and generation goes on from the moved positions. The
    swa cache is as large as base but still slides: after the shift (seq_add puts both heads back to 0) its
    slot search takes the kept first positions' cells, outside the new tokens' window, where base takes free
    cells; so the pair's seq_pos_min is no longer 0."""
    memory = session.ctx.memory
    after = memory.seq_pos_max(seq)
    assert memory.can_shift() and memory.swa.size == memory.base.size
    assert [o.rc for o in outcomes] == [0] * len(outcomes) and all(o.n_tokens == 1 for o in outcomes)
    assert after == before - n_discard + len(outcomes), "one position per generated token, from the shifted end"
    new = set(range(after - len(outcomes) + 1, after + 1))
    cells = {name: [c for c, (pos, _, _) in enumerate(cache.cells(0)) if pos in new]
             for name, cache in (("base", memory.base), ("swa", memory.swa))}
    n_keep = 4
    kept_in_base = sorted(pos for pos, seqs, _ in memory.base.cells(0)[:n_keep] if seq in seqs)
    assert kept_in_base == list(range(n_keep)) and cells["swa"][:n_keep] == list(range(n_keep))
    assert cells["base"][0] >= n_keep and memory.seq_pos_min(seq) == n_keep and memory.base.seq_pos_min(seq) == 0
    return (f"With swa_full both caches have {memory.swa.size} cells and can_shift is True: the context shift kept "
            f"{n_keep} positions and discarded the next {n_discard} (last position {before} -> {before - n_discard}), "
            f"and generation went on for {len(outcomes)} steps, return code 0 each. Yet the two caches no longer hold "
            f"the same cells: swa_full gives the swa cache room, not another rule. The shift put both heads back to "
            f"0; base took free cells {span(cells['base'])} for the new positions, swa took cells "
            f"{span(cells['swa'])}, whose kept positions 0-{n_keep - 1} were outside the new tokens' window. The pair's "
            f"seq_pos_min is now {memory.seq_pos_min(seq)}.")


# ---- 8. prompt reuse ---------------------------------------------------------------------------------------

REUSE = dict(n_ctx=128, pad=32, n_ubatch=8, swa_window=WINDOW)
REUSE_TEXT = STORY + " And the evening and the morning were the first day."
REUSE_NEW = " and God blessed the seventh day, and sanctified it"


def decode_in_batches(ctx: engine.Context, toks: list[int], start: int) -> np.ndarray:
    """Decode toks into seq 0 from position start, 8 at a time as a client would send them; every
    token's logits."""
    out = []
    for i in range(0, len(toks), 8):
        batch = engine.Batch.for_sequence(toks[i:i + 8], 0, start + i, all_logits=True)
        assert ctx.decode(batch) == 0, ctx.last_error
        out.append(ctx.all_logits().numpy().copy())
    return np.concatenate(out)


@dataclass
class Reuse:
    swa_full: bool
    held: list[int]  # the positions the swa cache holds after seq_rm
    missing: int  # of the window's positions the first new token needs
    pos_min: int
    diff: float  # the new tokens' logits against a fresh run's


def prompt_reuse(model, n_past: int = 30, n_tokens: int = 60) -> dict[bool, Reuse]:
    """Decode n_tokens, cut the sequence back to n_past (seq_rm), decode 8 new tokens there; compare with a
    fresh context that decodes the same text from scratch. Without and with swa_full."""
    tokens = model.tokenizer.encode(REUSE_TEXT)[:n_tokens]
    new = model.tokenizer.encode(REUSE_NEW, add_bos=False)[:8]
    expected = decode_in_batches(engine.Context(model, **REUSE), tokens[:n_past] + new, 0)[n_past:]
    out = {}
    for full in (False, True):
        ctx = engine.Context(model, **REUSE, swa_full=full)
        decode_in_batches(ctx, tokens, 0)
        ctx.memory.seq_rm(0, n_past, -1)
        held = sorted(p for p, s, _ in ctx.memory.swa.cells(0) if 0 in s)
        needed = set(range(max(0, n_past - WINDOW + 1), n_past))
        pos_min = ctx.memory.seq_pos_min(0)  # what llama-server reads (the cut leaves the lowest position as it was)
        diff = float(np.abs(decode_in_batches(ctx, new, n_past) - expected).max())
        out[full] = Reuse(full, held, len(needed - set(held)), pos_min, diff)
    return out


def server_threshold(n_past: int) -> int:
    """llama-server's pos_min_thold for a new prompt that goes on past the reused n_past tokens
    (tools/server/server-context.cpp): the swa cache must still hold a position below it."""
    return max(0, n_past - WINDOW)


def reuse_report(results: dict[bool, Reuse], n_past: int = 30) -> str:
    for r in results.values():
        print(f"swa_full={r.swa_full!s:5s}: after seq_rm the swa cache holds positions {span(r.held)} "
              f"(seq_pos_min {r.pos_min}); {r.missing} of the {WINDOW - 1} positions the window needs are missing; "
              f"logits differ from a fresh run by up to {r.diff:.2g}")
    plain, full = results[False], results[True]
    assert plain.missing > 0 and plain.diff > 1e-2, "without swa_full: a broken window, wrong logits"
    assert full.missing == 0 and full.diff < 1e-3, "with swa_full: the prefix is reused exactly"
    assert plain.pos_min >= server_threshold(n_past), "what llama-server's pos_min check catches"
    return (f"Without swa_full the decode returns 0, but the sliding layers miss {plain.missing} of the window's "
            f"positions and the logits are off by up to {plain.diff:.2g}. llama-server sees seq_pos_min "
            f"{plain.pos_min} >= {n_past} - {WINDOW} = {server_threshold(n_past)} and re-processes the whole prompt "
            f"instead. With swa_full the reused cells give the fresh run's logits.")


def reuse_answer(model, n_past: int) -> tuple[bool, str]:
    """Whether reusing a prefix of n_past tokens without swa_full gives the fresh run's logits, and why."""
    plain = prompt_reuse(model, n_past=n_past)[False]
    exact = plain.diff < 1e-3
    assert exact == (plain.missing == 0), "exact exactly when the window's positions are all still there"
    server = "reuses it too" if plain.pos_min < server_threshold(n_past) else "still re-processes the prompt"
    return exact, (f"after the cut the swa cache holds positions {span(plain.held)}; the first new token needs "
                   f"{max(0, n_past - WINDOW + 1)}-{n_past - 1}, and {plain.missing} of them are missing. llama-server "
                   f"(seq_pos_min {plain.pos_min} against {server_threshold(n_past)}) {server}.")


# ---- exercises -------------------------------------------------------------------------------------------


def swa_size_answer(model, **settings) -> tuple[int, str]:
    """The swa cache's cells per stream for these settings (and the lesson's window), and why."""
    return swa_size_why(engine.Context(model, swa_window=WINDOW, **settings))


def attended_after(model, n_tokens: int) -> tuple[tuple[int, int], str]:
    """Decode n_tokens of one sequence on the lesson's settings, then its next token: how many cells that
    token's row of the mask attends to in base and in swa, its own cell included; and why."""
    bus = engine.EventBus()
    watcher = Watcher(bus.subscribe())
    ctx = engine.Context(model, **SETTINGS, bus=bus)
    toks = model.tokenizer.encode(REUSE_TEXT)
    assert len(toks) > n_tokens
    decode_in_batches(ctx, toks[:n_tokens], 0)
    assert ctx.decode(engine.Batch([toks[n_tokens]], [n_tokens], [[0]])) == 0
    watcher.poll()
    base, swa = (last_ubatch_mask(watcher, cache) for cache in ("base", "swa"))
    check_swa_row(swa)
    counts = (int(base.counts()[0]), int(swa.counts()[0]))
    return counts, (f"the token at position {n_tokens} sees every position 0-{n_tokens} in base ({counts[0]} cells), "
                    f"and in swa only its window: itself and the {WINDOW - 1} positions before it ({counts[1]}).")
