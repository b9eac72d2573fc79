"""Notebook 2 (batches, ubatches and the slot search): its context, the rule every placement is checked
against, and the words and diagrams it prints.

The notebook decodes by hand on one context and reads what happened from the engine's events (a Watcher on the
context's bus), never from the cache's private fields. Each decode is checked against `find_slot_rule`, a plain
re-telling of llama.cpp's llama_kv_cache::find_slot (src/llama-kv-cache.cpp) for a full-attention cache: if the
engine ever chose other cells than the rule predicts, the notebook stops there instead of teaching something false.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

import engine
from engine import events as ev
from engine.batch import BatchAllocator
from engine.watch.describe import cell_map
from engine.watch.mirror import data_differences
from engine.watch.watcher import Watcher

N_CTX, PAD, N_UBATCH, N_SEQ = 64, 32, 8, 4
CACHE = "base"  # the full-attention cache of the demo model's pair (notebook 5 brings in `swa`)
PER_ROW = 32  # cells per row of a drawn lane
COL = 3  # characters per cell in a drawn lane

# Each sequence reads its own text: the token at position p is its text's token p (from the start again after
# the end), so a batch is "the next n tokens" of a sequence whatever happened to its cells.
TEXTS = (
    ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness "
     "was upon the face of the deep. And the Spirit of God moved upon the face of the waters."),
    ("And God said, Let there be light: and there was light. And God saw the light, that it was good: and God "
     "divided the light from the darkness. And God called the light Day, and the darkness he called Night."),
    ("The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he leadeth me beside "
     "the still waters. He restoreth my soul: he leadeth me in the paths of righteousness for his name's sake."),
    ("And the evening and the morning were the first day. And God said, Let there be a firmament in the midst of the "
     "waters, and let it divide the waters from the waters. And God made the firmament."),
)


# ---- the context and its sequences ------------------------------------------------------------------------------
def make_context(model: engine.Model, **settings) -> engine.Context:
    """The notebook's context: 64 cells (pad=32 instead of llama.cpp's 256, so that the cells can be drawn),
    ubatches of at most 8 tokens, up to 4 sequences in one unified stream, and swa_full=True so that the
    sliding-window cache of the demo model's pair holds the same cells as `base` (notebook 5 tells them apart)."""
    options = {"n_ctx": N_CTX, "pad": PAD, "n_ubatch": N_UBATCH, "n_seq_max": N_SEQ, "kv_unified": True,
               "swa_full": True}
    return engine.Context(model, **{**options, **settings})


def text_tokens(model: engine.Model, seq: int) -> list[int]:
    """Sequence `seq`'s whole text as tokens (<bos> first)."""
    return model.tokenizer.encode(TEXTS[seq % len(TEXTS)])


def tokens_at(model: engine.Model, seq: int, p0: int, n: int) -> list[int]:
    """Sequence `seq`'s tokens at positions p0 .. p0 + n - 1 (its text from the start again after the end)."""
    text = text_tokens(model, seq)
    return [text[p % len(text)] for p in range(p0, p0 + n)]


def next_batch(ctx: engine.Context, seq: int, n: int) -> engine.Batch:
    """A batch of sequence `seq`'s next n tokens, at the positions after its last one in the cache."""
    p0 = ctx.memory.seq_pos_max(seq) + 1
    return engine.Batch(tokens=tokens_at(ctx.model, seq, p0, n), pos=list(range(p0, p0 + n)), seq_ids=[[seq]] * n)


def mixed_batch(ctx: engine.Context, counts: dict[int, int]) -> engine.Batch:
    """One batch of several sequences' next tokens: counts = {seq: n}, in that order."""
    parts = [next_batch(ctx, seq, n) for seq, n in counts.items()]
    return engine.Batch(tokens=[t for b in parts for t in b.tokens], pos=[p for b in parts for p in b.pos],
                        seq_ids=[s for b in parts for s in b.seq_ids])


# ---- the cells as the events tell them --------------------------------------------------------------------------
@dataclass(frozen=True)
class Cells:
    """One cache's cells as the watcher's mirror holds them: positions (-1 empty), the only sequence of each
    cell (-1 empty), the head."""

    pos: np.ndarray
    owner: np.ndarray
    head: int

    @property
    def size(self) -> int:
        return len(self.pos)

    @property
    def used(self) -> int:
        return int(np.count_nonzero(self.pos >= 0))

    def free(self) -> np.ndarray:
        return np.flatnonzero(self.pos < 0)

    def of_seq(self, seq: int) -> np.ndarray:
        return np.flatnonzero(self.owner == seq)

    def free_before_head(self) -> np.ndarray:
        return np.flatnonzero(self.pos[:min(self.head, self.size)] < 0)

    def freed_since(self, before: Cells) -> list[int]:
        """The cells used in `before` and free now."""
        return np.flatnonzero((before.pos >= 0) & (self.pos < 0)).tolist()

    def same_as(self, other: Cells) -> bool:
        return (np.array_equal(self.pos, other.pos) and np.array_equal(self.owner, other.owner)
                and self.head == other.head)


def cells(watcher: Watcher, cache: str = CACHE) -> Cells:
    """The cache's cells now (the watcher applies what arrived first)."""
    watcher.poll()
    st = watcher.mirror.caches[cache].streams[0]
    seqs = st.seq  # (MAX_SEQ, size) bool
    owner = np.where(seqs.any(axis=0), seqs.argmax(axis=0), -1)
    return Cells(st.pos.copy(), owner, int(st.head))


def both_caches_alike(watcher: Watcher) -> bool:
    """Whether the swa cache holds the same cells, with the same head, as base: so with swa_full=True (as many
    cells) while no sequence reaches position 64, the window, beyond which swa may reuse cells base keeps."""
    watcher.poll()
    mirror = watcher.mirror
    base, swa = mirror.caches["base"].streams[0], mirror.caches["swa"].streams[0]
    return (np.array_equal(base.pos, swa.pos) and np.array_equal(base.seq_bits, swa.seq_bits)
            and base.head == swa.head)


def nothing_free_before_head(watcher: Watcher) -> bool:
    """After decodes and seq_rm alone, every cell before the head is used: the head only lets the scan skip
    cells it knows are full, so the search takes the lowest free cells."""
    return cells(watcher).free_before_head().size == 0


# ---- the rule -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Search:
    """One slot search for n tokens: where it started, whether it restarted at cell 0, what it chose (None: no
    slot), and where the head is once the ubatch is placed."""

    n: int
    head: int
    used: int
    restarted: bool
    cells: tuple[int, ...] | None
    wrapped: bool

    @property
    def head_after(self) -> int:
        return self.cells[-1] + 1 if self.cells else self.head


def find_slot_rule(pos: np.ndarray, head: int, n: int) -> Search:
    """llama.cpp's llama_kv_cache::find_slot(ubatch, cont=false) for one stream of a full-attention cache, in
    plain Python: start at the head, or at cell 0 when head > used + 2n; take the first n empty cells, wrapping
    to cell 0 at the end of the cache; give up after testing every cell once."""
    size = len(pos)
    used = int(np.count_nonzero(pos >= 0))
    restarted = head > used + 2 * n
    cur = 0 if restarted else head
    if n > size:
        return Search(n, head, used, restarted, None, False)
    chosen, tested, wrapped = [], 0, False
    while True:
        if cur + 1 > size:  # the end of the cache: go on at cell 0
            tested += size - cur
            cur, wrapped = 0, True
            continue
        idx = cur
        cur += 1
        tested += 1
        if pos[idx] < 0:
            chosen.append(idx)
        if len(chosen) == n:
            return Search(n, head, used, restarted, tuple(chosen), wrapped and chosen[-1] < chosen[0])
        if tested >= size:
            return Search(n, head, used, restarted, None, wrapped)


@dataclass(frozen=True)
class Prediction:
    """The searches of a batch's ubatches, each seeing the ones before it placed (the dry run)."""

    searches: tuple[Search, ...]

    @property
    def fits(self) -> bool:
        return all(s.cells is not None for s in self.searches)

    @property
    def cells(self) -> tuple[tuple[int, ...], ...]:
        """Per ubatch, the cells it takes (for a batch that fits)."""
        return tuple(s.cells for s in self.searches)

    @property
    def head_after(self) -> int:
        return self.searches[-1].head_after


def simple_split_sizes(n_tokens: int, n_ubatch: int = N_UBATCH) -> list[int]:
    """The ubatch sizes of llama.cpp's simple split: n_ubatch tokens each, the rest in the last."""
    return [min(n_ubatch, n_tokens - k) for k in range(0, n_tokens, n_ubatch)]


def predict(watcher: Watcher, n_tokens: int, n_ubatch: int = N_UBATCH) -> Prediction:
    """What the rule says a batch of n_tokens (one stream, simple split) will take, from the cells as they are
    now: ubatch after ubatch, each placed before the next is searched for; it stops at the first that finds no
    slot (the dry run stops there too)."""
    c = cells(watcher)
    pos, head, searches = c.pos.copy(), c.head, []
    for n in simple_split_sizes(n_tokens, n_ubatch):
        search = find_slot_rule(pos, head, n)
        searches.append(search)
        if search.cells is None:
            break
        pos[list(search.cells)] = 0  # taken
        head = search.head_after
    return Prediction(tuple(searches))


# ---- what a decode did, from its events -------------------------------------------------------------------------
@dataclass(frozen=True)
class Attempt:
    """One dry run: the cells each ubatch was placed in (tentatively), and the search that failed, if any."""

    placed: tuple[tuple[int, ...], ...]
    failed: ev.SlotSearchFailed | None
    split: str  # "simple" or "equal"


@dataclass(frozen=True)
class DecodeStory:
    """One decode, told by its events for one cache."""

    rc: int
    n_tokens: int
    attempts: tuple[Attempt, ...]
    placed: tuple[tuple[int, ...], ...]  # the real placements, per ubatch
    k_shifted: tuple[int, ...]  # cells whose keys the decode's K-shift re-rotated first
    head_after: int


def decode_events(watcher: Watcher, cache: str = CACHE) -> list[ev.Event]:
    """The events of the latest decode the watcher saw (DecodeStarted to DecodeFinished), those of the other
    cache of the pair left out."""
    watcher.poll()
    recent = list(watcher.recent)
    start = max(i for i, e in enumerate(recent) if isinstance(e, ev.DecodeStarted))
    end = next(i for i in range(start, len(recent)) if isinstance(recent[i], ev.DecodeFinished))
    return [e for e in recent[start:end + 1] if getattr(e, "cache", cache) == cache]


def touched(watcher: Watcher, cache: str) -> bool:
    """Whether the latest decode changed or searched anything in `cache` (an event of that cache)."""
    return any(getattr(e, "cache", None) == cache for e in decode_events(watcher, cache))


def last_decode(watcher: Watcher, expected: Prediction | None = None, cache: str = CACHE) -> DecodeStory:
    """The latest decode the watcher saw, told by its events; with `expected` (predict() before the decode),
    checked against the rule."""
    mine = decode_events(watcher, cache)
    finished = mine[-1]
    attempts, current, placed, shifted = [], [], [], ()
    for e in mine:
        if isinstance(e, ev.KShiftApplied):
            shifted = tuple(int(i) for c in e.changes for i in c.cells)
        elif isinstance(e, ev.CellsAllocated) and e.tentative:
            current.append(_event_cells(e))
        elif isinstance(e, ev.CellsAllocated):
            placed.append(_event_cells(e))
        elif isinstance(e, ev.SlotSearchFailed):
            attempts.append(Attempt(tuple(current), e, _split_name(len(attempts))))
            current = []
        elif isinstance(e, ev.SlotsRolledBack) and current:
            attempts.append(Attempt(tuple(current), None, _split_name(len(attempts))))
            current = []
    story = DecodeStory(finished.rc, finished.n_tokens, tuple(attempts), tuple(placed), shifted,
                        cells(watcher, cache).head)
    if expected is not None:
        check_decode(story, expected)
    return story


def _split_name(k: int) -> str:
    # the iSWA pair's unified memory tries a simple split, then an equal split (llama_kv_cache_iswa::init_batch)
    return "simple" if k == 0 else "equal"


def _event_cells(event: ev.CellsChanged) -> tuple[int, ...]:
    return tuple(int(i) for c in event.changes for i in c.cells)


def check_decode(story: DecodeStory, expected: Prediction) -> None:
    """The engine placed every ubatch where the rule said, or failed where the rule said it would."""
    if expected.fits:
        assert story.rc == 0, f"the rule says the batch fits, the decode returned {story.rc}"
        assert story.placed == expected.cells, f"placed {story.placed}, the rule says {expected.cells}"
        assert story.head_after == expected.head_after, (story.head_after, expected.head_after)
    else:
        assert story.rc == 1 and not story.placed, f"the rule says no slot, the decode returned {story.rc}"
        first = story.attempts[0]
        assert first.placed == expected.cells[:-1] and first.failed is not None, (first, expected)


def runs(cells) -> str:
    """Cell indices as ranges in the order given: "10-15, 24-25"."""
    cells = [int(c) for c in cells]
    if not cells:
        return "none"
    parts, start = [], cells[0]
    for a, b in zip(cells, cells[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def story_lines(story: DecodeStory) -> list[str]:
    """The decode in words: the dry run(s), the real placements, the return code."""
    lines = []
    if story.k_shifted:
        lines.append(f"first the K-shift: the keys of cells {runs(story.k_shifted)} are re-rotated (notebook 4)")
    for attempt in story.attempts:
        how = f" ({attempt.split} split)" if len(story.attempts) > 1 else ""
        for k, cells_k in enumerate(attempt.placed):
            lines.append(f"dry run{how}: ubatch {k} ({_tokens(len(cells_k))}) -> {_cells_word(cells_k)} "
                         f"{runs(cells_k)}")
        if attempt.failed is not None:
            f = attempt.failed
            lines.append(f"dry run{how}: ubatch {len(attempt.placed)} ({_tokens(f.n_tokens)}) -> no slot "
                         f"({f.size - f.used} cells free)")
        if attempt.placed:
            lines.append(f"dry run{how}: rolled back, every cell as it was")
    for k, cells_k in enumerate(story.placed):
        lines.append(f"placed:  ubatch {k} ({_tokens(len(cells_k))}) -> {_cells_word(cells_k)} {runs(cells_k)}")
    lines.append(f"decode returned {story.rc}" + (" (no slot)" if story.rc == 1 else ""))
    return lines


# ---- diagrams ----------------------------------------------------------------------------------------------------
def lane(watcher: Watcher, cache: str = CACHE) -> list[str]:
    """The cache as rows of text, 32 cells a row, as docs/how-the-kv-cache-works.md draws it: cell index, the
    llama.cpp map glyph ('.' empty, the sequence id), position, and the head."""
    watcher.poll()
    sf = watcher.frame().stream(cache)
    glyphs = cell_map(sf.owner, per_line=sf.size)[0]
    out = [f"{cache} cache: {sf.size} cells, {sf.used} used, head {sf.head}"]
    for r0 in range(0, sf.size, PER_ROW):
        idx = range(r0, min(r0 + PER_ROW, sf.size))
        out.append("  cell " + "".join(f"{i:<{COL}}" for i in idx).rstrip())
        out.append("  seq  " + "".join(f"{glyphs[i]:<{COL}}" for i in idx).rstrip())
        out.append("  pos  " + "".join(f"{int(sf.pos[i]) if sf.pos[i] >= 0 else '.':<{COL}}" for i in idx).rstrip())
        if r0 <= sf.head < r0 + PER_ROW:
            out.append("       " + " " * (COL * (sf.head - r0)) + "^ head")
    if sf.head >= sf.size:
        out.append(f"  head {sf.head}: one past the last cell (the next search starts at cell 0)")
    return out


def _cells_word(cells) -> str:
    return "cell" if len(cells) == 1 else "cells"


def show(watcher: Watcher, story: DecodeStory | None = None, grid=None) -> None:
    """Print a decode's story (if given) and the base cache after it; bring the grid (if given) up to date, so
    that its marks (changed cells, the dry run's ?) are this step's."""
    assert both_caches_alike(watcher), "the swa cache should hold the same cells as base here"
    print("\n".join((story_lines(story) if story is not None else []) + lane(watcher)))
    if grid is not None:
        grid.update()


def draw(grid) -> go.Figure:
    """Show the grid as it was last drawn (show() draws it after each step, with that step's marks: another
    update() now would clear them) as a plain figure that stays so (a live grid would show only the latest
    state wherever it is displayed), and return that figure (for lessons.picture)."""
    from IPython.display import display

    still = go.Figure(grid.figure)
    display(still)
    return still


def where_positions_are(watcher: Watcher, seq: int) -> list[str]:
    """Sequence `seq`'s cells as runs: "positions 6-7 in cells 24-25" (index and position need not agree)."""
    c = cells(watcher)
    mine = c.of_seq(seq)
    order = mine[np.argsort(c.pos[mine], kind="stable")]
    parts, start = [], 0
    for k in range(1, len(order) + 1):
        if k == len(order) or order[k] != order[k - 1] + 1 or c.pos[order[k]] != c.pos[order[k - 1]] + 1:
            a, b = order[start], order[k - 1]
            p, q = int(c.pos[a]), int(c.pos[b])
            pos_text = f"position {p}" if a == b else f"positions {p}-{q}"
            cell_text = f"cell {a}" if a == b else f"cells {a}-{b}"
            parts.append(f"{pos_text} in {cell_text}")
            start = k
    return parts


# ---- ubatch splits ------------------------------------------------------------------------------------------------
def split(model: engine.Model, batch: engine.Batch, how: str,
          n_ubatch: int = N_UBATCH) -> list[list[tuple[int, int]]]:
    """The batch cut into ubatches as llama.cpp's llama_batch_allocr does it (engine/batch.py): "simple" (one
    stream: the next n_ubatch tokens in batch order) or "equal" (a stream per sequence: each ubatch the same
    number of tokens of every sequence in it). Each ubatch as (seq, pos) per token."""
    alloc = BatchAllocator(batch, n_vocab=model.n_vocab, n_seq_max=N_SEQ, memory=None)
    out = []
    while not alloc.all_used():
        ub = alloc.split_simple(n_ubatch) if how == "simple" else alloc.split_equal(n_ubatch, sequential=True)
        assert ub is not None, f"the {how} split cannot take this batch"
        out.append([(ids[0], int(p)) for ids, p in zip(ub.seq_ids, ub.pos)])
    return out


def split_text(ubatches: list[list[tuple[int, int]]], sep: str = "\n  ") -> str:
    """"ubatch 0 (8): seq 0 pos 0-7", "ubatch 1 (8): seq 0 pos 8-9, seq 1 pos 0-5", joined by sep."""
    parts = []
    for k, ub in enumerate(ubatches):
        groups: list[list] = []
        for seq, p in ub:
            if groups and groups[-1][0] == seq and groups[-1][2] == p - 1:
                groups[-1][2] = p
            else:
                groups.append([seq, p, p])
        parts.append(f"ubatch {k} ({len(ub)}): " + ", ".join(
            f"seq {s} pos {a}" + (f"-{b}" if b != a else "") for s, a, b in groups))
    return sep.join(parts)


# ---- planning without placing ------------------------------------------------------------------------------------
def plan(ctx: engine.Context, seq: int, n: int) -> tuple[int, ...] | None:
    """The cells the engine's find_slot would choose for a ubatch of sequence seq's next n tokens, without placing
    anything (llama.cpp plans, then commits: find_slot changes nothing). None: no slot."""
    batch = next_batch(ctx, seq, n)
    alloc = BatchAllocator(batch, n_vocab=ctx.model.n_vocab, n_seq_max=ctx.n_seq_max, memory=ctx.memory)
    found = ctx.memory.base.find_slot(alloc.split_simple(n))
    return None if found is None else tuple(int(i) for i in found.idxs[0])


def restart_table(ctx: engine.Context, watcher: Watcher, seq: int, ns: list[int]) -> list[str]:
    """For ubatches of n tokens: does the search restart at cell 0 (head > used + 2n), and which cells does the
    engine's find_slot choose; each row checked against the rule, and the cache left as it was."""
    c = cells(watcher)  # polls the watcher first
    before = watcher.mirror.snapshot()
    lines = [f"head {c.head}, used {c.used}", f"{'tokens':>6}  {'head > used + 2n ?':<30}  cells find_slot chooses"]
    for n in ns:
        rule = find_slot_rule(c.pos, c.head, n)
        chosen = plan(ctx, seq, n)
        assert chosen == rule.cells, f"{n} tokens: find_slot chose {chosen}, the rule says {rule.cells}"
        assert rule.restarted == (c.head > c.used + 2 * n)
        test = f"{c.head} > {c.used + 2 * n:<3} {'yes: from cell 0' if rule.restarted else 'no: from the head'}"
        lines.append(f"{n:6d}  {test:<30}  {runs(chosen) if chosen else 'no slot'}")
    watcher.poll()
    assert not data_differences(before, watcher.mirror.snapshot()), "planning changed the cache"
    return lines


def restarts(ctx: engine.Context, watcher: Watcher, seq: int, n: int) -> bool:
    """Whether a search for a ubatch of n tokens would start at cell 0 rather than at the head (head > used +
    2n); the engine's find_slot is asked too, and must choose what the rule chooses."""
    c = cells(watcher)
    rule = find_slot_rule(c.pos, c.head, n)
    assert plan(ctx, seq, n) == rule.cells, "find_slot and the rule disagree"
    return rule.restarted


# ---- attention does not care where a cell is ---------------------------------------------------------------------
def logits_gap_against_fresh(ctx: engine.Context, watcher: Watcher, seq: int) -> float:
    """The last decode's output (the last token of `seq`) against the same tokens at the same positions decoded
    in a fresh context, where they take cells 0, 1, 2, ... : the largest difference of a logit."""
    watcher.poll()
    started = next(e for e in reversed(watcher.recent) if isinstance(e, ev.DecodeStarted))
    assert tuple(started.seq_ids) == (seq,), "the last decode should be this sequence's alone"
    n = ctx.memory.seq_pos_max(seq) + 1
    assert ctx.memory.seq_pos_min(seq) == 0, "the sequence should hold its positions from 0"
    fresh = make_context(ctx.model)
    tokens = tokens_at(ctx.model, seq, 0, n)
    assert fresh.decode(engine.Batch(tokens=tokens, pos=list(range(n)), seq_ids=[[0]] * n)) == 0
    return float((ctx.logits(-1).float() - fresh.logits(-1).float()).abs().max())


def check_mask(mask, watcher: Watcher) -> None:
    """The drawn mask (explorer.MaskView's UbatchMask) is the rule worked out again from the mirror's cells: a
    token attends to a cell exactly when the cell holds the token's sequence at a position no later than the
    token's (a full-attention cache), whatever the cell's index."""
    assert mask.exact, "the cells changed since the ubatch was placed"
    st = watcher.mirror.caches[mask.cache].streams[mask.stream]
    pos = st.pos[:mask.n_kv]
    for k, (p, seqs) in enumerate(zip(mask.token_pos.tolist(), mask.token_seqs)):
        holds = st.holds(seqs[-1])[:mask.n_kv]
        rule = holds & (pos >= 0) & (pos <= p)
        assert np.array_equal(mask.allowed[k], rule), f"row {k}: the mask differs from the rule"
