"""Notebook 1, What a KV cache is: the plumbing and the checks behind its cells.

The notebook shows the idea (a prompt decoded, a cache's cells, the work with and without a cache, the bytes);
this module holds what would hide the idea in a cell: the greedy loops, the repeats and medians of the timings,
the tables and the chart, and the asserts that keep the notebook's prose true. Every claim asserted here is a
count (cells, positions, tokens computed, bytes); a time is measured and shown, never asserted, because any
other program on the machine can stall a step.

The notebook looks at one cache: the demo model keeps a pair (iSWA, notebook 5), made here with swa_full=True
so that both hold the same cells, and the views show `base` alone.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import engine
from engine.watch.describe import EventFilter

SHOWN_CACHE = "base"  # the cache notebooks 1-4 look at (notebook 5 brings in its partner, swa)
N_CTX = 256  # cells of the contexts the greedy loops and the timed calls decode in
REPEATS = 3  # runs of each greedy loop whose per-step medians are shown
CALL_ROUNDS = 6  # timed prefill and decode calls; the first warms up and is left out

Timer = Callable[[Callable[[], object]], float]  # seconds that calling its argument takes


def timed(call: Callable[[], object]) -> float:
    """The seconds call() takes. The notebook passes its own timer instead, defined in a cell, so that its
    test can run it under a clock where every interval is equal (nothing it asserts may depend on time)."""
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def context(model: engine.Model, n_ctx: int = N_CTX, **options) -> engine.Context:
    """A context with one pair of equal caches (swa_full=True): base and swa hold the same cells."""
    return engine.Context(model, n_ctx=n_ctx, pad=32, swa_full=True, **options)


def decode_text(ctx: engine.Context, tokens: list[int], p0: int = 0, seq_id: int = 0) -> int:
    """Decode tokens as one batch of sequence seq_id at positions p0, p0+1, ...; llama_decode's return code."""
    n = len(tokens)
    return ctx.decode(engine.Batch(tokens=tokens, pos=list(range(p0, p0 + n)), seq_ids=[[seq_id]] * n))


# ---- cells, in words -------------------------------------------------------------------------------------------
def used_cells(cells: list[tuple[int, frozenset[int], int]]) -> list[int]:
    """The indices of the cells that hold a token (position -1: empty)."""
    return [i for i, (pos, _, _) in enumerate(cells) if pos >= 0]


def sequences_text(seqs) -> str:
    """A cell's sequences as a reader writes them: '0', '0, 2', or 'none'."""
    return ", ".join(str(s) for s in sorted(seqs)) or "none"


def cells_table(cells: list[tuple[int, frozenset[int], int]], indices: list[int],
                token_text: Callable[[int], str] | None = None) -> str:
    """A Markdown table of some cells: index, position, sequences, pending shift (and the token at that position,
    when token_text(pos) is given): the words for llama_kv_cells' pos, seq and shift."""
    header = ["cell", "position", "sequences", "pending shift"] + (["token"] if token_text else [])
    rows = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for i in indices:
        pos, seqs, shift = cells[i]
        row = [str(i), str(pos) if pos >= 0 else "-1 (empty)", sequences_text(seqs), str(shift)]
        if token_text:
            row.append(f"`{token_text(pos)!r}`" if pos >= 0 else "")
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def show(markdown: str) -> None:
    """A Markdown table (or text) under the cell; printed when not in a notebook."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:
        print(markdown)
        return
    if get_ipython() is None:
        print(markdown)
    else:
        display(Markdown(markdown))


def assert_one_cell_per_token(cells: list[tuple[int, frozenset[int], int]], n_tokens: int, seq_id: int = 0) -> None:
    """What the prefill section says: a first batch in an empty cache takes cells 0..n-1, cell i at position i."""
    used = used_cells(cells)
    assert used == list(range(n_tokens)), f"prefill of {n_tokens} tokens used cells {used}"
    assert all(cells[i][0] == i and cells[i][1] == {seq_id} and cells[i][2] == 0 for i in used), cells[:n_tokens]


def prefill_in_fresh_context(model: engine.Model, text: str) -> tuple[int, int]:
    """The cells of base a prefill of `text` uses in an empty context, and the head afterwards (where the next
    slot search starts): an exercise's answers, computed by the engine."""
    ctx = context(model)
    tokens = model.tokenizer.encode(text)
    assert decode_text(ctx, tokens) == 0
    cells = ctx.memory.base.cells(0)
    assert_one_cell_per_token(cells, len(tokens))
    return len(used_cells(cells)), ctx.memory.base.head(0)


# ---- the live views of base ------------------------------------------------------------------------------------
def base_grid(session, *, columns: int = 32):
    """The session's CellGrid showing base alone: the swa lane would draw the same cells a second time."""
    from explorer import CellGrid

    return CellGrid.of(session, columns=columns, caches=(SHOWN_CACHE,))


def base_log(session, *, lines: int = 8):
    """The session's EventLog filtered to base's events (and those of no cache: decodes, sampled tokens)."""
    from explorer import EventLog
    from explorer.view import choose

    log = EventLog.of(session, lines=lines)
    choose(log.cache, SHOWN_CACHE)  # the menu says what the log shows
    log.filter = EventFilter(cache=SHOWN_CACHE)
    log.update()
    return log


def assert_pair_alike(mirror) -> None:
    """What the notebook says of the pair: with swa_full, swa holds the very cells base holds (while the text
    stays this short: the slot searches of both start at the same head and find the same empty cells)."""
    assert mirror.cells(0, "base") == mirror.cells(0, "swa"), "swa_full: base and swa should hold the same cells"
    assert mirror.head(0, "base") == mirror.head(0, "swa")


def watched_cells(grid) -> tuple[int, int]:
    """How many cells of base the grid's watcher has seen used, and base's head; checks the pair alike."""
    mirror = grid.watcher.mirror
    assert_pair_alike(mirror)
    return len(used_cells(mirror.cells(0, SHOWN_CACHE))), mirror.head(0, SHOWN_CACHE)


def cell_stories(grid, cells: list[int]) -> list[str]:
    """Each cell's history as the explorers' inspector tells it (from the events, not from the cache)."""
    return [f"cell {cell}: {grid.watcher.history.explain(SHOWN_CACHE, 0, cell)}" for cell in cells]


def written_in(grid, cells: list[int]) -> list[int]:
    """The decode step that last wrote each cell (0: the prefill), from the watch layer's history."""
    steps = []
    for cell in cells:
        entries = grid.watcher.history.entries(SHOWN_CACHE, 0, cell)
        assert entries and entries[-1].in_decode, f"cell {cell} was not written by a decode"
        steps.append(entries[-1].step)
    return steps


# ---- what the cache buys: work per token -----------------------------------------------------------------------
@dataclass
class GreedyRun:
    """One greedy generation: its tokens (prompt included), and per step the seconds of the decode call and the
    tokens that call ran through the model."""

    tokens: list[int]
    seconds: list[float]
    computed: list[int]


def greedy(model: engine.Model, prompt: list[int], n_new: int, *, cache: bool, timed: Timer = timed,
           n_ctx: int = N_CTX) -> GreedyRun:
    """Greedy decoding of n_new tokens. With the cache each step decodes the one new token; without it, each
    step clears the cache (every key and value forgotten) and decodes the whole text again."""
    ctx = context(model, n_ctx)
    out, seconds, computed = list(prompt), [], []
    assert decode_text(ctx, out) == 0
    for _ in range(n_new):
        out.append(int(ctx.logits(-1).argmax()))
        before = ctx.perf.n_tokens_computed
        if cache:
            seconds.append(timed(lambda: decode_text(ctx, out[-1:], p0=len(out) - 1)))
        else:
            seconds.append(timed(lambda: (ctx.memory.clear(), decode_text(ctx, out))))
        computed.append(ctx.perf.n_tokens_computed - before)
    return GreedyRun(out, seconds, computed)


def greedy_runs(model: engine.Model, prompt: list[int], n_new: int, *, cache: bool, timed: Timer = timed,
                repeats: int = REPEATS, n_ctx: int = N_CTX) -> list[GreedyRun]:
    """`repeats` greedy runs after a short warm-up (the first calls of a process pay for torch's first use),
    so that each step's time can be a median: one stalled run does not move it."""
    greedy(model, prompt, 4, cache=cache, timed=timed, n_ctx=n_ctx)
    return [greedy(model, prompt, n_new, cache=cache, timed=timed, n_ctx=n_ctx) for _ in range(repeats)]


def median_seconds(runs: list[GreedyRun]) -> list[float]:
    """Each step's median seconds over the runs."""
    return [statistics.median(step) for step in zip(*(run.seconds for run in runs))]


def assert_work(cached: list[GreedyRun], recomputed: list[GreedyRun], n_prompt: int) -> None:
    """What the section asserts, in every run: the same text either way (the cache changes the cost, not the
    answer), one token computed per step with the cache, and the whole text so far (t tokens) without it."""
    n_new = len(cached[0].computed)
    assert all(run.tokens == cached[0].tokens for run in cached + recomputed), "the cache must not change the text"
    assert all(run.computed == [1] * n_new for run in cached)
    assert all(run.computed == list(range(n_prompt + 1, n_prompt + n_new + 1)) for run in recomputed)


def work_table(cached: list[GreedyRun], recomputed: list[GreedyRun], steps: tuple[int, ...]) -> str:
    """Some steps side by side: the tokens each computed (the work) next to its median milliseconds (the cost)."""
    with_s, without_s = median_seconds(cached), median_seconds(recomputed)
    rows = [f"| step | tokens computed, with the cache | without | ms with the cache (median of {len(cached)}) "
            f"| ms without |", "|---:|---:|---:|---:|---:|"]
    for step in steps:
        i = step - 1
        rows.append(f"| {step} | {cached[0].computed[i]} | {recomputed[0].computed[i]} | {1000 * with_s[i]:.2f} "
                    f"| {1000 * without_s[i]:.2f} |")
    return "\n".join(rows)


def work_sentence(cached: list[GreedyRun], recomputed: list[GreedyRun]) -> str:
    """The totals over all steps, in words: the work and the time, with and without the cache."""
    work = sum(recomputed[0].computed) / sum(cached[0].computed)
    with_ms, without_ms = 1000 * sum(median_seconds(cached)), 1000 * sum(median_seconds(recomputed))
    return (f"Over all {len(cached[0].computed)} steps: {sum(cached[0].computed)} tokens computed with the cache, "
            f"{sum(recomputed[0].computed)} without ({work:.0f}x the work); {with_ms:.0f} ms against "
            f"{without_ms:.0f} ms ({without_ms / with_ms:.1f}x the time on this machine, just now).")


def growth_sentence(recomputed: list[GreedyRun], n: int = 8) -> str:
    """Without the cache, how the last n steps compare with the first n: in work, and in time."""
    computed, seconds = recomputed[0].computed, median_seconds(recomputed)
    work = statistics.median(computed[-n:]) / statistics.median(computed[:n])
    time_ratio = statistics.median(seconds[-n:]) / statistics.median(seconds[:n])
    return (f"Without the cache, the last {n} steps computed {work:.1f}x the tokens of the first {n} and took "
            f"{time_ratio:.1f}x as long; with it, every step computed one token.")


def work_and_time_figure(cached: list[GreedyRun], recomputed: list[GreedyRun] | None = None, *, n_prompt: int):
    """Two panels over the text's length: the tokens each step computed, and its median milliseconds; with the
    cache, and (when given) without it."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    n_new = len(cached[0].computed)
    x = list(range(n_prompt + 1, n_prompt + n_new + 1))
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                           subplot_titles=("tokens computed in the step",
                                           f"ms for the step (median of {len(cached)} runs)"))
    lines = [("with the cache", "#1f77b4", cached)] + ([("without", "#ff7f0e", recomputed)] if recomputed else [])
    for name, colour, runs in lines:
        for row, y in enumerate((runs[0].computed, [1000 * s for s in median_seconds(runs)]), 1):
            figure.add_trace(go.Scatter(x=x, y=y, name=name, legendgroup=name, line_color=colour,
                                        showlegend=row == 1), row=row, col=1)
    figure.update_xaxes(title_text="tokens in the text", row=2, col=1)
    figure.update_layout(height=460, width=900, margin=dict(t=40))
    return figure


# ---- prefill vs decode -----------------------------------------------------------------------------------------
@dataclass
class Call:
    """A kind of decode call: the tokens it ran through the model, and its median seconds."""

    computed: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else float("inf")


def prefill_and_decode(model: engine.Model, prompt: list[int], *, timed: Timer = timed,
                       rounds: int = CALL_ROUNDS) -> tuple[Call, Call]:
    """A call of the whole prompt (prefill) and a call of one token after it (decode), `rounds` times each in
    an emptied cache; the first round warms up and is left out, the others' medians are kept. Asserts the work:
    the prefill computes every prompt token in its one call, the decode one token."""
    ctx = context(model)
    n = len(prompt)
    prefills, decodes = [], []
    for _ in range(rounds):
        ctx.memory.clear()
        for calls, tokens, p0 in ((prefills, prompt, 0), (decodes, prompt[:1], n)):
            before = ctx.perf.n_tokens_computed
            seconds = timed(lambda: decode_text(ctx, tokens, p0=p0))
            calls.append((ctx.perf.n_tokens_computed - before, seconds))
    assert {c for c, _ in prefills} == {n} and {c for c, _ in decodes} == {1}
    return (Call(n, statistics.median(s for _, s in prefills[1:])),
            Call(1, statistics.median(s for _, s in decodes[1:])))


def calls_table(prefill: Call, decode: Call) -> str:
    """The two calls side by side: tokens computed next to milliseconds and tokens per second."""
    rows = ["| call | tokens computed | ms (median) | ms per token | tokens per second |", "|---|---:|---:|---:|---:|"]
    for name, call in (("prefill", prefill), ("decode", decode)):
        rows.append(f"| {name} | {call.computed} | {1000 * call.seconds:.2f} | "
                    f"{1000 * call.seconds / call.computed:.3f} | {call.tokens_per_second:.0f} |")
    return "\n".join(rows)


# ---- what the cache costs: bytes -------------------------------------------------------------------------------
def bytes_per_cell(n_layer: int, n_head_kv: int, head_dim: int, bytes_per_number: float = 2) -> float:
    """One cell's bytes: in each of n_layer layers, a K row and a V row of n_head_kv x head_dim numbers each
    (f16 by default: 2 bytes a number)."""
    return n_layer * 2 * n_head_kv * head_dim * bytes_per_number


def bytes_per_number(cache_type) -> float:
    """What one number of a cache type costs (a quantized type stores blocks of numbers)."""
    return cache_type.block_bytes / cache_type.block_size


def checked_cell_bytes(cache) -> float:
    """One cell of a cache, from the model's shape, checked against the bytes the engine allocated for it."""
    layout = cache.layout
    assert layout.type_k == layout.type_v, "one type for K and V here"
    per_cell = bytes_per_cell(len(layout.layer_ids), layout.n_head_kv, layout.head_dim, bytes_per_number(layout.type_k))
    assert layout.n_embd_k == layout.n_embd_v == layout.n_head_kv * layout.head_dim
    allocated = cache.k_bytes() + cache.v_bytes()
    assert allocated == layout.kv_size * per_cell, (allocated, layout.kv_size, per_cell)
    return per_cell


def allocated_bytes(model: engine.Model, n_ctx: int, **types) -> int:
    """The bytes the engine allocates for base's K and V in a context of n_ctx cells (types: type_k, type_v)."""
    base = context(model, n_ctx, **types).memory.base
    checked_cell_bytes(base)
    return base.k_bytes() + base.v_bytes()


def pair_and_weight_bytes(ctx: engine.Context) -> tuple[int, int]:
    """The K/V bytes of both caches of the pair and the model's weight bytes. Checks that the pair holds all the
    model's layers at every cell (swa_full) and that it is what the context's memory breakdown counts."""
    memory, config = ctx.memory, ctx.model.config
    pair = sum(cache.k_bytes() + cache.v_bytes() for cache in (memory.base, memory.swa))
    assert memory.base.layout.kv_size == memory.swa.layout.kv_size, "swa_full: both caches have every cell"
    assert pair == memory.base.layout.kv_size * bytes_per_cell(config.n_layer, config.n_head_kv, config.head_dim)
    breakdown = ctx.memory_breakdown().values()
    assert pair == sum(b.context for b in breakdown)
    return pair, sum(b.model for b in breakdown)
