"""Notebook 3, Sequences and streams: the plumbing and the checks behind its cells.

The notebook decodes several sequences into one cache, shares a prefix with seq_cp, compares unified and
split streams and lets kvscope's parallel runner overflow its cache. What it shows is drawn from the events
(a Watcher on the context's bus or the session), of the `base` cache only: every context of notebooks 1-4 is
made with swa_full=True, so the demo model's `swa` cache holds the same cells (notebook 5 tells them apart).
The asserts here keep the notebook's sentences true.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import engine
from engine import events as ev
from engine.runners.demo import DEMO_SETTINGS, DEMO_WORKLOAD
from engine.runners.parallel import CONTEXT_EXCEEDED
from engine.runners.session import Session
from engine.watch.attention_mask import UbatchMask
from engine.watch.describe import cell_map, describe_event
from engine.watch.watcher import Watcher
from explorer import CellGrid

CACHE = "base"  # the one cache notebooks 1-4 look at
# The demo session's parallel workload and cache (four clients whose slots together claim more than its 256
# cells), with the model's own window: kvscope's demo narrows it to 16, which only the swa cache would show.
PARALLEL_SETTINGS = {k: v for k, v in DEMO_SETTINGS.items() if k != "swa_window"}
N_CLIENTS, SLOT_CELLS = DEMO_WORKLOAD.n_clients, DEMO_WORKLOAD.n_ctx_slot
assert PARALLEL_SETTINGS["swa_full"] and PARALLEL_SETTINGS["kv_unified"]
assert N_CLIENTS * SLOT_CELLS > PARALLEL_SETTINGS["n_ctx"], "the slots must claim more than the cache holds"


# ---- watching a context or a session ----------------------------------------------------------------------
def watcher_of(source) -> Watcher:
    """A Watcher of an engine.Context (its event bus) or of a Session: the state so far, then every event."""
    if isinstance(source, engine.Context):
        return Watcher(source.bus.subscribe(), source.bus.current_state)
    return Watcher.of(source)


class BaseGrid(CellGrid):
    """A CellGrid of the base cache alone (with swa_full the swa cache would repeat the same cells), that also
    lists the events that arrived since it last listed them."""

    def __init__(self, watcher: Watcher, **options) -> None:
        super().__init__(watcher, caches=(CACHE,), **options)  # polls: the state so far is drawn, not listed
        self._listed = watcher.events

    def new_events(self, *kinds: str) -> list[ev.Event]:
        """The events since the last call whose kind (or a parent kind, e.g. "CellsChanged") is one of `kinds`,
        of the base cache (events of no cache included)."""
        self.watcher.poll()
        events = self.watcher.events_since(self._listed)
        self._listed = self.watcher.events
        return [e for e in events if getattr(e, "cache", CACHE) == CACHE
                and any(k.__name__ in kinds for k in type(e).__mro__)]

    def event_lines(self, *kinds: str) -> str:
        """The new events of these kinds as both explorers' event logs print them, one a line."""
        return "\n".join(describe_event(e) for e in self.new_events(*kinds))


def base_grid(source, columns: int = 32) -> BaseGrid:
    """The base cache of a Context or a Session as a cell grid, `columns` cells a row."""
    return BaseGrid(watcher_of(source), columns=columns)


# ---- batches and cells in words ---------------------------------------------------------------------------
def prompts_batch(model, prompts: list[str]) -> engine.Batch:
    """One batch of several prompts: prompt k is sequence k, at positions 0, 1, ... of its own."""
    tokens, pos, seqs = [], [], []
    for seq, text in enumerate(prompts):
        ids = model.tokenizer.encode(text)
        tokens += ids
        pos += range(len(ids))
        seqs += [[seq]] * len(ids)
    return engine.Batch(tokens=tokens, pos=pos, seq_ids=seqs)


def token_text(model, token: int) -> str:
    """A token as the explorers quote it: '<bos>', 'And', ' God' (a leading space is part of the token)."""
    if token == model.tokenizer.bos_id:
        return "<bos>"
    return repr(model.tokenizer.decode([token]))


def long_prompt(model, n: int) -> list[int]:
    """n tokens of a verse said again and again (with the <bos> the tokenizer adds)."""
    tokens = model.tokenizer.encode(" ".join(["And the LORD spake unto Moses, saying,"] * n))[:n]
    assert len(tokens) == n
    return tokens


def batch_lines(model, batch: engine.Batch) -> str:
    """A batch per sequence: its positions and tokens, in batch order."""
    lines = []
    for seq in sorted({s for ids in batch.seq_ids for s in ids}):
        at = [k for k, ids in enumerate(batch.seq_ids) if seq in ids]
        pieces = " ".join(token_text(model, batch.tokens[k]) for k in at)
        span = f"pos {batch.pos[at[0]]}" + (f"-{batch.pos[at[-1]]}" if len(at) > 1 else "")
        lines.append(f"seq {seq}, {span}: {pieces}")
    return "\n".join(lines)


def check_in_batch_order(ctx, batch: engine.Batch) -> None:
    """A unified cache, empty before: the batch's tokens took cells 0, 1, ... in batch order."""
    cells = ctx.memory.base.cells(0)
    for k, (pos, seqs) in enumerate(zip(batch.pos, batch.seq_ids)):
        assert cells[k][:2] == (pos, frozenset(seqs)), (k, cells[k])
    assert used_cells(ctx) == len(batch)


def owners(cells) -> list[int]:
    """Per cell: its one sequence, -1 empty, -2 several (what cell_map draws)."""
    return [-1 if pos < 0 else (next(iter(seqs)) if len(seqs) == 1 else -2) for pos, seqs, _ in cells]


def stream_maps(ctx) -> str:
    """The base cache's streams as llama.cpp's LLAMA_KV_CACHE_DEBUG map draws them ('.' empty, the
    sequence id, 'M' several), each with its head and how many cells it uses."""
    base = ctx.memory.base
    lines = []
    for s in range(base.layout.n_stream):
        cells = base.cells(s)
        used = sum(pos >= 0 for pos, _, _ in cells)
        lines.append(f"stream {s}: {cell_map(owners(cells), per_line=len(cells))[0]}  "
                     f"({used}/{len(cells)} used, head {base.head(s)})")
    return "\n".join(lines)


def positions_words(ctx, seqs) -> str:
    """Which positions each sequence holds, in words."""
    mem = ctx.memory
    return ", ".join(f"seq {s} at positions {mem.seq_pos_min(s)}-{mem.seq_pos_max(s)}" for s in seqs)


def used_cells(ctx) -> int:
    """Used cells of the base cache, all streams."""
    base = ctx.memory.base
    return sum(pos >= 0 for s in range(base.layout.n_stream) for pos, _, _ in base.cells(s))


def free_cells(ctx) -> list[int]:
    """Free cells of the base cache, per stream."""
    base = ctx.memory.base
    return [sum(pos < 0 for pos, _, _ in base.cells(s)) for s in range(base.layout.n_stream)]


def total_cells(ctx) -> int:
    """Cells of the base cache, all streams."""
    layout = ctx.memory.base.layout
    return layout.n_stream * layout.kv_size


def own_cells(ctx, seq: int) -> list[int]:
    """The base cells (stream 0) that hold `seq` and no other sequence."""
    return [i for i, (pos, held, _) in enumerate(ctx.memory.base.cells(0)) if pos >= 0 and held == {seq}]


def seq_cells(ctx, seq: int, stream: int = 0) -> list[int]:
    """The base cells of one stream that hold `seq`."""
    return [i for i, (pos, held, _) in enumerate(ctx.memory.base.cells(stream)) if pos >= 0 and seq in held]


def used_in(watcher: Watcher) -> int:
    """Used base cells, all streams, as the watcher's mirror holds them (a session's cache)."""
    watcher.poll()
    return sum(int((st.pos >= 0).sum()) for st in watcher.mirror.caches[CACHE].streams)


def shared_cells(ctx, seqs) -> int:
    """Cells of the base cache (stream 0) that hold every one of `seqs`."""
    return sum(pos >= 0 and set(seqs) <= held for pos, held, _ in ctx.memory.base.cells(0))


# ---- what each token attends to ----------------------------------------------------------------------------
def check_shared_prefix(ctx, mask: UbatchMask, n_prefix: int, seqs) -> None:
    """After seq_cp of an n_prefix-token prompt and a batch of one token per sequence: the prefix's cells are
    held by every sequence, each sequence has one cell of its own, and in that batch's mask each token attends
    to the shared cells and its own cell, nothing else."""
    cells = ctx.memory.base.cells(0)
    assert all(held == frozenset(seqs) for pos, held, _ in cells[:n_prefix]), cells[:n_prefix]
    assert used_cells(ctx) == n_prefix + len(seqs)
    assert mask.exact and mask.n_tokens == len(seqs)
    for k, seq in enumerate(mask.token_seq.tolist()):
        own = own_cells(ctx, seq)
        assert mask.attended(k).tolist() == list(range(n_prefix)) + own, (seq, mask.attended(k), own)


def check_stream_copy(ctx, src: int, dst: int) -> None:
    """A seq_cp across streams: the destination stream holds the source stream's positions, as `dst` alone."""
    base = ctx.memory.base
    source = [(pos, seqs) for pos, seqs, _ in base.cells(src) if pos >= 0]
    copied = [(pos, seqs) for pos, seqs, _ in base.cells(dst) if pos >= 0]
    assert [pos for pos, _ in copied] == [pos for pos, _ in source] and source
    assert all(seqs == frozenset({dst}) for _, seqs in copied), copied


# ---- kvscope's parallel runner running out of cells -------------------------------------------------------
def parallel_session(model) -> Session:
    """The demo session's parallel workload on the base/swa pair with swa_full and the model's own window,
    stepped by hand (threaded=False)."""
    return Session(model, settings=PARALLEL_SETTINGS, workload=DEMO_WORKLOAD, threaded=False, steps_per_second=0)


@dataclass(frozen=True)
class DecodeTry:
    """One llama_decode of a workload step: its tokens' sequences and the return code."""

    step: int
    seqs: tuple[int, ...]
    rc: int
    used: int  # base cells used when its slot search failed (rc 1), else -1
    size: int


@dataclass(frozen=True)
class EndedRequest:
    """A request the runner ended because a single token of it found no cell."""

    seq: int
    cause: str
    n_freed: int


@dataclass(frozen=True)
class RetryStory:
    """The workload step in which a slot search first failed: its decodes, in order, and the request ended."""

    step: int
    tries: tuple[DecodeTry, ...]
    ended: tuple[EndedRequest, ...]
    log: tuple[str, ...] = ()  # the runner's warnings and errors during the step, in llama-parallel's words

    @property
    def sizes(self) -> list[int]:
        return [len(t.seqs) for t in self.tries]

    @property
    def failures(self) -> int:
        return sum(t.rc == 1 for t in self.tries)

    def table(self) -> str:
        """The decodes of that step and what the runner did after each, one a line."""
        lines = []
        for t in self.tries:
            n = len(t.seqs)
            what = "rc 0: placed and computed" if t.rc == 0 else \
                f"rc {t.rc}: no slot ({t.used}/{t.size} cells used)"
            lines.append(f"decode {t.step}: {n} token{'s' if n > 1 else ''} of seq {', '.join(map(str, t.seqs))}"
                         f"  -> {what}")
            for e in self.ended:
                if t.rc == 1 and n == 1 and t.seqs == (e.seq,):
                    lines.append(f"    the request of seq {e.seq} ends: \"{CONTEXT_EXCEEDED}\"; "
                                 f"its {e.n_freed} cells are freed")
        return "\n".join(lines)


def _retry_story(events: list[ev.Event], log: tuple[str, ...]) -> RetryStory:
    tries, ended, started, failed = [], [], None, None
    for e in events:
        if isinstance(e, ev.DecodeStarted):
            started, failed = e, None
        elif isinstance(e, ev.SlotSearchFailed) and e.cache == CACHE:
            failed = e
        elif isinstance(e, ev.DecodeFinished) and started is not None:
            tries.append(DecodeTry(started.step, tuple(started.seq_ids), e.rc,
                                   failed.used if failed else -1, failed.size if failed else -1))
        elif isinstance(e, ev.CellsRemoved) and e.cache == CACHE and CONTEXT_EXCEEDED in e.cause:
            ended.append(EndedRequest(e.seq_id, e.cause, e.n_freed))
        elif isinstance(e, ev.WorkloadStep):
            return RetryStory(e.step, tuple(tries), tuple(ended), log)
    raise AssertionError("the workload step did not finish")


def run_until_no_slot(session: Session, grid: BaseGrid, max_steps: int = 120) -> RetryStory:
    """Step the session until a slot search fails, redrawing the grid before each step (so that it then
    marks what the failing step changed); the story of that step (checked: the failed batch is retried in
    smaller pieces, one request ends, and the other sequences are decoded in the same step)."""
    watcher = grid.watcher
    session.start().result()
    for _ in range(max_steps):
        grid.update()
        seen, logged = watcher.events, session.log.n_lines
        session.step(1).result()
        watcher.poll()
        events = watcher.events_since(seen)
        if any(isinstance(e, ev.DecodeFinished) and e.rc == 1 for e in events):
            first = next(k for k, e in enumerate(events) if isinstance(e, ev.DecodeStarted))
            log = tuple(line.text for line in session.log.lines(after=logged, level="warning"))
            story = _retry_story(events[first:], log)
            check_retry(story)
            return story
    raise AssertionError(f"no slot search failed in {max_steps} steps")


def check_retry(story: RetryStory) -> None:
    """What the notebook says of kvscope's runner: a failed batch is split and retried; a single token that
    still finds no cell ends its own request only; the other sequences' tokens are decoded."""
    assert story.tries[0].rc == 1 and story.sizes[0] > min(story.sizes), story
    assert len(story.ended) == 1, story.ended
    seq = story.ended[0].seq
    lone = [t for t in story.tries if t.seqs == (seq,)]
    assert lone and all(t.rc == 1 for t in lone)
    decoded = {s for t in story.tries if t.rc == 0 for s in t.seqs}
    assert decoded == set(story.tries[0].seqs) - {seq}, (decoded, story)


def check_released(watcher: Watcher, seq: int) -> int:
    """A client whose request ended holds the shared system prompt again (seq 0's cells) and nothing else;
    how many cells that is."""
    watcher.poll()
    st = watcher.mirror.caches[CACHE].streams[0]
    held, prompt = st.holds(seq) & (st.pos >= 0), st.holds(0) & (st.pos >= 0)
    assert np.array_equal(held, prompt), np.flatnonzero(held ^ prompt)
    return int(held.sum())


# ---- the exercises' answers, computed by the engine ------------------------------------------------------
def stream_size(model, *, n_ctx: int, n_seq_max: int, pad: int = 32) -> int:
    """Cells per stream of a split cache."""
    ctx = engine.Context(model, n_ctx=n_ctx, pad=pad, n_seq_max=n_seq_max, kv_unified=False, swa_full=True)
    return ctx.memory.base.layout.kv_size


def split_decode_rc(model, tokens: list[int], *, n_ctx: int, n_seq_max: int, seq: int = 1, pad: int = 32) -> int:
    """llama_decode's return code for `tokens` of one sequence in a split cache."""
    ctx = engine.Context(model, n_ctx=n_ctx, pad=pad, n_seq_max=n_seq_max, kv_unified=False, swa_full=True)
    return ctx.decode(engine.Batch.for_sequence(tokens, seq, 0))


def shared_prefix_context(model, prefix: list[int], next_tokens: list[int]):
    """Notebook section 2's cache: `prefix` as seq 0, copied to seqs 1.., then one token each at the same
    position (next_tokens[k] for seq k)."""
    ctx = engine.Context(model, n_ctx=64, pad=32, n_seq_max=4, kv_unified=True, swa_full=True)
    assert ctx.decode(engine.Batch.for_sequence(prefix, 0, 0)) == 0
    for dst in range(1, len(next_tokens)):
        ctx.memory.seq_cp(0, dst, -1, -1)
    n = len(prefix)
    batch = engine.Batch(tokens=list(next_tokens), pos=[n] * len(next_tokens),
                         seq_ids=[[s] for s in range(len(next_tokens))])
    assert ctx.decode(batch) == 0
    return ctx


def used_after(model, prefix: list[int], next_tokens: list[int], operation: str, seq: int) -> int:
    """Used base cells of section 2's cache after seq_rm(seq, -1, -1) or seq_keep(seq)."""
    ctx = shared_prefix_context(model, prefix, next_tokens)
    if operation == "seq_rm":
        ctx.memory.seq_rm(seq, -1, -1)
    elif operation == "seq_keep":
        ctx.memory.seq_keep(seq)
    else:
        raise ValueError(f"operation must be 'seq_rm' or 'seq_keep', got {operation!r}")
    return used_cells(ctx)
