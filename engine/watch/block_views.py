"""How both front-ends show a vLLM / SGLang deployment's prefix caches (a BlockMirror): the colours, the lanes of
block glyphs, and every sentence and line the views print, worded here once so that the terminal UI and the
notebook say the same thing the same way.

- Colour = prefix. Where the cell grids colour a cell by its sequence, a block is coloured by the first block of
  its chain (its `root`: the system prompt or conversation it continues), picked from style.PALETTE by a digest
  of that hash: the same prefix has the same colour on every worker, in both UIs, in every run.
- A lane is one worker's blocks in one medium (GPU, CPU offload, ...) and KV cache group, one glyph per block,
  ordered by prefix (the oldest first) and then by depth, so that a prefix reads as one run of its colour; the
  worker's capacity, where its publisher says it, follows as empty glyphs. A lane wider than its columns is
  folded as the cell grids fold (style.fold): each glyph covers several blocks, shaded by how many of them are
  held, in the colour of the prefix that holds most of them.
- Times are the publisher's wall clock, in local time, to a tenth of a second.

Torch-free; reads the mirror only through BlockMirror's public methods, and may run on a thread other than the
one applying events (the terminal works its views out on one).
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine import events as ev
from engine.watch import style
from engine.watch.block_mirror import Block, BlockMirror, PrefixShare, RouterView, TreeNode
from engine.watch.kv_events.formats import hash_text

TEXT_CHARS = 28  # a block's or prefix's text, shortened to this many characters
IDS_SHOWN = 6  # token ids shown when there is no vocabulary
TREE_INDENT_LEVELS = 12  # deeper branches stop moving right and say their level instead
ELLIPSIS = "…"
# control characters a piece may hold, shown as visible marks: a newline must not break a line of a view
_VISIBLE = str.maketrans({"\n": "⏎", "\r": "␍", "\t": "⇥", "\x00": "␀"})


# ---- colours and words --------------------------------------------------------------------------------
def prefix_color(root: bytes | None, dark: bool = True) -> str:
    """The colour of a prefix (its first block's hash), stable across workers, front-ends and runs. A digest
    rather than the hash's own bytes: integer hashes (SGLang, vLLM's 64-bit option) need not spread evenly."""
    if root is None:
        return style.EMPTY_COLOR if dark else style.EMPTY_COLOR_ON_LIGHT
    colours = style.palette(dark)
    digest = hashlib.blake2b(root, digest_size=4).digest()
    return colours[int.from_bytes(digest, "big") % len(colours)]


def clock_text(ts: float) -> str:
    """A publisher's timestamp as local time to a tenth of a second: "12:03:04.5"."""
    if ts <= 0:
        return "an unknown time"  # a publisher that sent no ts (or a block restored without one)
    seconds, tenths = divmod(round(ts * 10), 10)
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{tenths}"


def _pieces(vocabulary) -> Sequence[str] | None:
    """The token texts of an ev.Vocabulary, or of a plain sequence of strings."""
    if vocabulary is None:
        return None
    return getattr(vocabulary, "pieces", vocabulary)


def tokens_text(token_ids: Iterable[int], vocabulary=None, max_chars: int = TEXT_CHARS) -> str:
    """The text of these tokens (their pieces joined, control characters made visible), or without a vocabulary
    their ids ("ids 12 7 99 …"); at most about `max_chars` characters, an ellipsis where it was cut."""
    ids = [int(t) for t in token_ids]
    pieces = _pieces(vocabulary)
    if pieces is None:
        shown = " ".join(str(t) for t in ids[:IDS_SHOWN])
        return f"ids {shown}" + (f" {ELLIPSIS}" if len(ids) > IDS_SHOWN else "") if ids else "no tokens"
    text = "".join(pieces[t] if 0 <= t < len(pieces) else f"[{t}]" for t in ids).translate(_VISIBLE)
    return text if len(text) <= max_chars else text[:max_chars - 1] + ELLIPSIS


def _quoted(token_ids, vocabulary, max_chars: int = TEXT_CHARS) -> str:
    """Token text in quotes; ids bare (they are not text)."""
    text = tokens_text(token_ids, vocabulary, max_chars)
    return f"'{text}'" if _pieces(vocabulary) is not None else text


def known_block(mirror: BlockMirror, block_hash: bytes, worker: int | None = None) -> Block | None:
    """A block as some worker holds it (`worker`'s own copy first), else as the eviction log last saw it."""
    copies = mirror.find(block_hash)
    for block in copies:
        if block.worker == worker:
            return block
    if copies:
        return copies[0]
    if worker is not None:
        gone = mirror.last_eviction(worker, block_hash)
        if gone is not None:
            return gone.block
    # a copy (one C call, whole under the GIL): a view may read on a thread while events are applied
    for entry in reversed(list(mirror.evictions)):
        if entry.block.hash == block_hash:
            return entry.block
    return None


def colour_key(mirror: BlockMirror, block_hash: bytes, root: bytes | None) -> bytes | None:
    """What a block is coloured by, everywhere a view colours one: its branch (BlockMirror.branch_heads: the
    prompt, then each conversation) while some worker holds it, as the lanes colour it; its chain start once
    none does (an evicted block, which no lane shows)."""
    return mirror.branch_heads().get(block_hash, root)


def prefix_name(mirror: BlockMirror, root: bytes | None, vocabulary=None, max_chars: int = TEXT_CHARS) -> str:
    """How a prefix is named: its first block's text in quotes, else (no vocabulary, or its first block is not
    known: a chain whose start was never seen) its hash, "0x3f2a"."""
    if root is None:
        return "none"
    block = known_block(mirror, root)
    if block is None or _pieces(vocabulary) is None or len(block.token_ids) == 0:
        return hash_text(root)
    return f"'{tokens_text(block.token_ids, vocabulary, max_chars)}'"


def tier_name(mirror: BlockMirror, worker: int, medium: str, group: int) -> str:
    """"GPU", "CPU", "group 1 sliding window 128", "CPU group 1 full attention": the medium unless it is the GPU of
    a group other than 0 (the GPU is the default; naming it twice would crowd the summary)."""
    parts = [] if group and medium == ev.MEDIUM_GPU else [medium]
    if group:
        kind, window = mirror.group_kind(worker, group)
        text = f"group {group}"
        if kind:
            text += " " + kind.replace("_", " ")
        if window:
            text += f" {window}" if kind == "sliding_window" else f" (window {window})"
        parts.append(text)
    return " ".join(parts)


def _count(n: int, noun: str, plural: str = "") -> str:
    """'1 block', '1,234 blocks', '2 batches'."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


def _depth_text(mirror: BlockMirror, block: Block) -> str:
    if block.depth < 0:
        missing = block.parent is not None and mirror.chain(block.parent) is None
        return "depth not known: " + ("its parent was never seen" if missing else
                                      "the start of its chain was never seen")
    return f"{_count(block.depth, 'block')} deep"


# ---- the inspector's sentence ------------------------------------------------------------------------
def describe_block(mirror: BlockMirror, worker: int, block_hash: bytes, vocabulary=None) -> str:
    """What the inspector says of one block of one worker: when it was stored, where it hangs in its prefix, its
    tokens, where else it is held, and when it was evicted if it no longer is."""
    copies = mirror.find(block_hash)
    own = [b for b in copies if b.worker == worker]
    evicted = None if own else mirror.last_eviction(worker, block_hash)
    if not own and evicted is None:
        return f"block {hash_text(block_hash)}: worker {worker} does not hold it, and its eviction log does not name it"
    own.sort(key=lambda b: (b.medium != ev.MEDIUM_GPU, b.medium, b.group))
    block = own[0] if own else evicted.block
    text = f"stored at {clock_text(block.stored_ts)} by worker {worker}"
    where = [tier_name(mirror, worker, b.medium, b.group) for b in (own or [block])]
    if where != [ev.MEDIUM_GPU]:
        text += " in " + _listed(where)
    if block.depth == 0:
        text += ", first block of its chain"
    else:
        text += f", child of block {hash_text(block.parent)} ("
        if block.depth > 0:
            text += f"{prefix_name(mirror, block.root, vocabulary)}, "
        text += _depth_text(mirror, block) + ")"
    text += f", tokens {_quoted(block.token_ids, vocabulary)}"
    if len(block.token_ids) < block.block_size:
        text += f" ({len(block.token_ids)} of its {block.block_size}: the publisher sent fewer)"
    if block.lora:
        text += f", LoRA {block.lora}"
    others = sorted({b.worker for b in copies if b.worker != worker})
    if others:
        text += ", also held by " + _workers_text(others)
    if evicted is not None:
        text += f"; evicted {clock_text(evicted.evicted_ts)}"
        if evicted.cause:
            text += f" ({evicted.cause})"
    else:  # held, but perhaps gone from a tier it was in (a GPU block evicted after its offload to CPU)
        gone = mirror.last_eviction(worker, block_hash)
        if gone is not None and all((b.medium, b.group) != (gone.block.medium, gone.block.group) for b in own):
            text += (f"; evicted from {tier_name(mirror, worker, gone.block.medium, gone.block.group)} "
                     f"{clock_text(gone.evicted_ts)}" + (f" ({gone.cause})" if gone.cause else ""))
    return text


def _listed(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ---- lanes of glyphs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockLane:
    """One worker's blocks in one medium and group as a row of glyphs: glyph k covers the lane's blocks
    places [start[k], start[k + 1]): the held blocks (`hashes`, in lane order), then the capacity's empty places."""

    worker: int
    medium: str
    group: int
    name: str  # tier_name(): "GPU", "CPU", "group 1 sliding window 128"
    hashes: tuple[bytes, ...]  # the held blocks, ordered by prefix (oldest first) and then by depth
    roots: tuple[bytes, ...]  # each held block's branch (BlockMirror.branch_heads), parallel to hashes: its colour
    places: int  # what the lane shows: its held blocks, then the empty capacity after them (where known)
    blocks_per_glyph: int
    start: np.ndarray  # first place of each glyph, then `capacity`
    glyph_roots: tuple[bytes | None, ...]  # per glyph, the prefix that holds most of its blocks (None: empty)
    occupancy: np.ndarray  # per glyph, held blocks / places
    glyphs: str  # one character per glyph

    @property
    def n_glyphs(self) -> int:
        return len(self.glyphs)

    @property
    def held(self) -> int:
        return len(self.hashes)

    def colors(self, dark: bool = True) -> list[str]:
        return [prefix_color(r, dark) for r in self.glyph_roots]

    def blocks_at(self, glyph: int) -> tuple[bytes, ...]:
        """The held blocks a glyph covers (none for an empty one)."""
        if not 0 <= glyph < self.n_glyphs:
            return ()
        return self.hashes[int(self.start[glyph]):min(int(self.start[glyph + 1]), self.held)]

    def glyph_of(self, block_hash: bytes) -> int | None:
        try:
            index = self.hashes.index(block_hash)
        except ValueError:
            return None
        return index // self.blocks_per_glyph

    def title(self) -> str:
        """The lane's label: "GPU · 1,234 of 4,096 blocks · 16 per glyph"."""
        return " · ".join(self.title_parts())

    def title_parts(self) -> list[str]:
        """title()'s parts: the tier's name, what it holds, and (folded) how many blocks a glyph covers."""
        parts = [self.name, f"{self.held:,}" + (f" of {self.places:,} blocks" if self.places > self.held
                                                else " " + ("block" if self.held == 1 else "blocks"))]
        if self.blocks_per_glyph > 1:
            parts.append(f"{self.blocks_per_glyph:,} per glyph")
        return parts


def describe_glyph(mirror: BlockMirror, lane: BlockLane, glyph: int, vocabulary=None,
                   max_chars: int = TEXT_CHARS) -> str:
    """What a folded glyph covers: "blocks 104-155 of 4,096 (52): 40 of 'You are a helpful', 12 of 0x3f2a", the
    empty places of the capacity counted as such."""
    if not 0 <= glyph < lane.n_glyphs:
        return "no glyph there"
    first, last = int(lane.start[glyph]), int(lane.start[glyph + 1])
    held = lane.blocks_at(glyph)
    text = f"blocks {first + 1:,}-{last:,} of {lane.places:,} ({last - first:,})" if last - first > 1 else \
        f"block {first + 1:,} of {lane.places:,}"
    if not held:
        return text + ": empty (capacity not in use)"
    counts: dict[bytes, int] = {}
    for root in lane.roots[first:first + len(held)]:
        counts[root] = counts.get(root, 0) + 1
    shown = sorted(counts.items(), key=lambda kv: -kv[1])
    words = [f"{n:,} of {prefix_name(mirror, root, vocabulary, max_chars)}" for root, n in shown[:3]]
    if len(shown) > 3:
        words.append(f"{sum(n for _, n in shown[3:]):,} of {len(shown) - 3:,} more prefixes")
    empty = last - first - len(held)
    if empty:
        words.append(f"{empty:,} empty")
    return text + ": " + ", ".join(words)


def lane_order(blocks: Iterable[Block]) -> list[Block]:
    """Blocks by prefix, the prefix first stored first (a lane keeps its order as blocks come and go), then by
    depth: a prefix reads as one run of its colour, its system prompt leftmost."""
    return _ordered(blocks)[0]


def _ordered(blocks: Iterable[Block], mirror: BlockMirror | None = None) -> tuple[list[Block], np.ndarray, list[bytes]]:
    """lane_order(), with each block's prefix as a number (the prefixes in lane order): one numpy sort, since a
    lane is redrawn with every batch and holds up to a hundred thousand blocks. Ties keep the mirror's order,
    which is the order the blocks were stored in."""
    blocks = list(blocks)
    n = len(blocks)
    if not n:
        return [], np.zeros(0, dtype=np.int64), []
    heads = mirror.branch_heads() if mirror is not None else {}
    roots = [heads.get(b.hash, b.root) for b in blocks]  # colour by branch: the prompt, then each conversation
    stored = [b.stored_ts for b in blocks]
    first: dict[bytes, float] = {}
    for root, ts in zip(roots, stored):
        seen = first.get(root)
        if seen is None or ts < seen:
            first[root] = ts
    prefixes = sorted(first, key=lambda r: (first[r], r))
    rank = {root: k for k, root in enumerate(prefixes)}
    code = np.fromiter((rank[r] for r in roots), dtype=np.int64, count=n)
    depth = np.fromiter((b.depth for b in blocks), dtype=np.int64, count=n)
    order = np.lexsort((np.array(stored), depth, code))
    return [blocks[i] for i in order.tolist()], code[order], prefixes


def capacity_of(mirror: BlockMirror, worker: int, medium: str) -> int:
    """The blocks a worker's tier can hold where its publisher said so (0: not known). vLLM reports its GPU pool;
    an offload tier's size is its connector's, which no event says."""
    seen = mirror.seen.get(worker)
    return seen.capacity_blocks if seen is not None and medium == ev.MEDIUM_GPU else 0


def block_lane(mirror: BlockMirror, worker: int, medium: str = ev.MEDIUM_GPU, group: int = 0,
               columns: int = 0) -> BlockLane:
    """A lane of one worker's tier, folded to at most `columns` glyphs (0: one glyph per block, unfolded)."""
    ordered, code, prefixes = _ordered(mirror.blocks(worker, medium, group).values(), mirror)
    held = len(ordered)
    places = max(held, capacity_of(mirror, worker, medium))
    per = max(1, -(-places // columns)) if columns > 0 else 1
    start = np.arange(0, places + per, per)
    start = np.unique(np.minimum(start, places)) if places else np.zeros(1, dtype=np.int64)
    n = len(start) - 1
    used = np.clip(held - start[:-1], 0, np.diff(start))
    occupancy = used / np.maximum(np.diff(start), 1)
    glyph_roots = _dominant_roots(code, prefixes, per, n)
    if per == 1:
        glyphs = style.GLYPH_ONE * held + style.GLYPH_EMPTY * (n - held)
    else:
        # an empty folded glyph keeps the empty dot: the capacity must read as room, not as a gap
        glyphs = "".join(style.occupancy_glyph(f) if f > 0 else style.GLYPH_EMPTY for f in occupancy)
    return BlockLane(worker, medium, group, tier_name(mirror, worker, medium, group), tuple(b.hash for b in ordered),
                     tuple(prefixes[k] for k in code.tolist()), places, per, start, glyph_roots, occupancy, glyphs)


def _dominant_roots(code: np.ndarray, prefixes: list[bytes], per: int, n: int) -> tuple[bytes | None, ...]:
    """Per glyph (of `per` places each), the prefix most of its held blocks belong to (the leftmost of equals):
    one count over (glyph, prefix) pairs."""
    out: list[bytes | None] = [None] * n
    if not len(code):
        return tuple(out)
    n_prefixes = len(prefixes)
    glyph = np.arange(len(code)) // per
    pairs, counts = np.unique(glyph * n_prefixes + code, return_counts=True)
    order = np.lexsort((pairs, -counts, pairs // n_prefixes))  # per glyph, its most frequent prefix first
    best = pairs[order][np.r_[True, np.diff(pairs[order] // n_prefixes) != 0]]
    for pair in best.tolist():
        out[pair // n_prefixes] = prefixes[pair % n_prefixes]
    return tuple(out)


def worker_lanes(mirror: BlockMirror, worker: int, columns: int = 0) -> list[BlockLane]:
    """A worker's lanes, GPU first; a worker that holds nothing still gets its GPU lane (its capacity, empty)."""
    tiers = mirror.tiers(worker) or [(ev.MEDIUM_GPU, 0)]
    return [block_lane(mirror, worker, medium, group, columns) for medium, group in tiers]


# ---- lines of text --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Line:
    """A line a view prints, with what it is about: the prefix that colours it, the worker and block it names
    (a view may let one pick it)."""

    text: str
    root: bytes | None = None
    worker: int | None = None
    block: bytes | None = None

    def __str__(self) -> str:
        return self.text


def _rate(x: float) -> str:
    return f"{x:.1f}"


def worker_summary(mirror: BlockMirror, worker: int, now_ts: float | None = None) -> str:
    """"worker 1 (rank 1 at h:5558) · GPU 1,234 of 4,096 blocks · group 1 sliding window 128: 300 · CPU 200 ·
    +12.0 stored/s · -3.0 evicted/s · 2 batches lost": the rates over the last 5 s of the publisher's clock."""
    return " · ".join(text for text, _ in worker_summary_parts(mirror, worker, now_ts))


SUMMARY_KINDS = ("name", "held", "tier", "rate", "warning", "unseen")


def worker_summary_parts(mirror: BlockMirror, worker: int, now_ts: float | None = None) -> list[tuple[str, str]]:
    """worker_summary()'s parts as (text, kind): "name" (its label), "held" (its first tier's blocks, of its
    capacity), "tier" (each other tier's), "rate" (stored and evicted per second), "warning" (batches lost,
    restarts: the picture may miss blocks), "unseen" (removals of blocks the mirror never saw: usual for a
    subscriber that joined late), so that a narrow view knows which to leave out."""
    parts = [(mirror.label(worker), "name")]
    tiers = mirror.tiers(worker) or [(ev.MEDIUM_GPU, 0)]
    for k, (medium, group) in enumerate(tiers):
        name, n = tier_name(mirror, worker, medium, group), mirror.held(worker, medium, group)
        capacity = capacity_of(mirror, worker, medium)
        if k == 0:
            parts.append((f"{name} {n:,}" + (f" of {_count(capacity, 'block')}" if capacity else
                                              " " + ("block" if n == 1 else "blocks")), "held"))
        else:
            parts.append((f"{name}{':' if name[-1].isdigit() else ''} {n:,}", "tier"))
    stored, evicted = mirror.rates(worker, mirror.latest_ts() if now_ts is None else now_ts)
    parts += [(f"+{_rate(stored)} stored/s", "rate"), (f"-{_rate(evicted)} evicted/s", "rate")]
    seen = mirror.seen.get(worker)
    state = mirror.endpoints.get(seen.endpoint) if seen is not None and seen.endpoint else None
    if state is not None:
        # the gaps this mirror saw, or the publisher's count when it joined after some (a state carries no gaps)
        lost = max(state.lost, state.stats.lost if state.stats is not None else 0)
        if lost:
            parts.append((f"{_count(lost, 'batch', 'batches')} lost", "warning"))
        if state.restarts:
            parts.append((f"restarted {state.restarts}×", "warning"))
    counts = mirror.counts.get(worker)
    if counts is not None and counts.unknown_removals:
        parts.append((f"{_count(counts.unknown_removals, 'removal')} of blocks never seen", "unseen"))
    return parts


def _branch_text(node: TreeNode, vocabulary, max_chars: int) -> tuple[str, TreeNode]:
    """A node and the chain of single children below it as one line's text, and the chain's last node (whose
    children are the branches)."""
    if node.block is None:
        return f"{hash_text(node.hash)} (not held)", node
    first, length, last = node, 1, node
    while len(last.children) == 1 and last.children[0].block is not None:
        last = last.children[0]
        length += 1
    text = f"{_count(length, 'block')} {_quoted(first.block.token_ids, vocabulary, max_chars)}"
    return text, last


def tree_lines(mirror: BlockMirror, worker: int, vocabulary=None, max_lines: int = 40,
               medium: str | None = None, group: int | None = None, max_chars: int = TEXT_CHARS) -> list[Line]:
    """A worker's prefix tree, indented, a chain of single children one line ("12 blocks 'You are a helpful…'"),
    a branching line followed by what hangs below it ("+36 in 3 branches"); at most `max_lines` lines, the last
    saying what did not fit."""
    roots = mirror.tree(worker, medium, group)
    if not roots:
        return [Line(f"worker {worker} holds no blocks", worker=worker)]
    lines: list[Line] = []
    own_blocks: list[int] = []  # blocks each line stands for itself (its chain), for the line saying what is left
    stack: list[tuple[int, TreeNode]] = [(0, r) for r in reversed(roots)]
    while stack and len(lines) < max(1, max_lines):
        level, node = stack.pop()
        text, last = _branch_text(node, vocabulary, max_chars)
        if last.children:
            below = sum(c.n_blocks for c in last.children)
            text += f"  +{below:,} in {_count(len(last.children), 'branch', 'branches')}"
        indent = "  " * min(level, TREE_INDENT_LEVELS)
        if level > TREE_INDENT_LEVELS:
            indent += f"[{level}] "
        root = node.block.root if node.block is not None else node.hash
        lines.append(Line(indent + text, colour_key(mirror, node.hash, root), worker, node.hash))
        own_blocks.append(node.n_blocks - sum(c.n_blocks for c in last.children))
        stack.extend((level + 1, c) for c in reversed(last.children))
    if stack:
        lines.pop()  # its place says what did not fit, itself included
        rest = sum(n.n_blocks for _, n in stack) + own_blocks.pop()
        lines.append(Line(f"… {_count(len(stack) + 1, 'more branch', 'more branches')} ({_count(rest, 'block')})",
                          worker=worker))
    return lines


def router_lines(mirror: BlockMirror, vocabulary=None, max_lines: int = 20,
                 medium: str | None = ev.MEDIUM_GPU, max_chars: int = TEXT_CHARS) -> list[Line]:
    """What a KV-aware router sees: the prefixes several workers hold, longest first, with how deep each worker
    holds them (a prompt starting with that prefix reuses that many blocks there); then per worker the prefixes
    only it holds (a prompt continuing them is worth sending there)."""
    workers = mirror.workers()
    if not workers:
        return [Line("no worker heard from yet")]
    view = router_view(mirror, medium)
    shared = [s for s in view.shares if len(s.deepest) > 1]
    lines: list[Line] = []
    budget = max(2, max_lines - len(workers) - 1)
    if len(workers) > 1:
        lines.append(Line("shared prefixes" if shared else "no prefix is held by two workers"))
        for share in shared[:budget - 1]:
            lines.append(Line("  " + _share_text(mirror, share, view, vocabulary, max_chars), share.root))
        if len(shared) > budget - 1:
            lines.append(Line(f"  … {len(shared) - budget + 1:,} more shared"))
    for worker in workers:
        only = view.exclusive.get(worker, {})
        if not only:
            lines.append(Line(f"worker {worker}: nothing only it holds", worker=worker))
            continue
        root, n = next(iter(only.items()))
        text = f"worker {worker} alone holds {_count(n, 'block')} of {prefix_name(mirror, root, vocabulary, max_chars)}"
        if len(only) > 1:
            text += f", {_count(sum(only.values()) - n, 'block')} of {_count(len(only) - 1, 'more prefix', 'more prefixes')}"
        lines.append(Line(text, root, worker))
    return lines[:max_lines]


def router_view(mirror: BlockMirror, medium: str | None = ev.MEDIUM_GPU) -> RouterView:
    return mirror.router_view(medium)


def _share_text(mirror: BlockMirror, share: PrefixShare, view: RouterView, vocabulary, max_chars: int) -> str:
    """"'You are a helpful' 12 blocks (192 tokens) on workers 0 and 2, then worker 0 +3 · worker 2 +1": the
    deepest block two workers hold alike (the part of a prompt either would serve from cache), and how far each
    worker's own continuation goes beyond it."""
    common: Block | None = None
    for worker, block in share.deepest.items():  # up from each worker's deepest block to one another holds too
        own = view.held[worker]
        node: Block | None = block
        while node is not None and len(view.holders.get(node.hash, ())) < 2:
            node = own.get(node.parent) if node.parent is not None else None
        if node is not None and (common is None or node.depth > common.depth):
            common = node
    name = prefix_name(mirror, share.root, vocabulary, max_chars)
    if common is None or common.depth < 0:
        return f"{name} on {_workers_text(share.workers)} (how deep not known)"
    text = f"{name} {_deep(common)} on {_workers_text(view.holders[common.hash])}"
    beyond = [f"worker {w} +{b.depth - common.depth:,}" for w, b in sorted(share.deepest.items())
              if b.depth > common.depth]
    return text + (", then " + " · ".join(beyond) if beyond else "")


def _workers_text(workers) -> str:
    workers = sorted(workers)
    return f"worker {workers[0]}" if len(workers) == 1 else "workers " + _listed([str(w) for w in workers])


def _deep(block: Block) -> str:
    """How much of a prefix a worker holds, by its deepest block."""
    if block.depth < 0:
        return "(depth not known)"
    return _count(block.depth + 1, "block") + (f" ({(block.depth + 1) * block.block_size:,} tokens)"
                                               if block.block_size else "")


def eviction_lines(mirror: BlockMirror, n: int = 20, vocabulary=None, max_chars: int = TEXT_CHARS) -> list[Line]:
    """The eviction log, newest first: "12:03:09.1  worker 1  0x3f2a evicted · depth 4 of 'You are a helpful' ·
    ' the LORD said'": when, whose, which block and why ("evicted": the publisher's own choice; else kvscope's
    reason, "publisher restarted"), where it sat in which prefix, and its tokens."""
    entries = list(mirror.evictions)[-n:] if n > 0 else []
    lines = []
    for entry in reversed(entries):
        b = entry.block
        where = "" if (b.medium, b.group) == (ev.MEDIUM_GPU, 0) else f" from {tier_name(mirror, b.worker, b.medium, b.group)}"
        if b.depth == 0:
            place = "first block of its chain"
        else:
            place = (f"depth {b.depth}" if b.depth > 0 else "depth not known") + \
                f" of {prefix_name(mirror, b.root, vocabulary, max_chars)}"
        lines.append(Line(f"{clock_text(entry.evicted_ts)}  worker {b.worker}  {hash_text(b.hash)} "
                          f"{entry.cause or 'evicted'}{where} · {place} · {_quoted(b.token_ids, vocabulary, max_chars)}",
                          b.root, b.worker, b.hash))
    return lines


def stats_parts(mirror: BlockMirror) -> list[tuple[str, bool]]:
    """How the reading of the publishers goes, all endpoints together, as (text, is a warning) parts: "2
    publishers", "1,234 batches", "2 lost", "5 replayed", "0 malformed", "unknown: 1 tag, 3 fields"; a warning is
    what means the picture may miss blocks or the publisher speaks a layout kvscope half knows."""
    states = list(mirror.endpoints.values())
    stats = [s.stats for s in states if s.stats is not None]
    if not stats:
        return [("no publisher stats yet", False)]
    total = {name: sum(getattr(s, name) for s in stats) for name in
             ("batches", "lost", "replayed", "malformed", "unknown_tags", "unknown_fields")}
    parts = [(_count(len(stats), "publisher"), False), (_count(total["batches"], "batch", "batches"), False),
             (f"{total['lost']:,} lost", total["lost"] > 0), (f"{total['replayed']:,} replayed", False),
             (f"{total['malformed']:,} malformed", total["malformed"] > 0)]
    if total["unknown_tags"] or total["unknown_fields"]:
        unknown = [_count(total[name], noun) for name, noun in (("unknown_tags", "tag"), ("unknown_fields", "field"))
                   if total[name]]
        parts.append(("unknown: " + ", ".join(unknown), True))
    restarts = sum(s.restarts for s in states)
    if restarts:
        parts.append((_count(restarts, "restart"), True))
    dialects = sorted({s.dialect for s in stats if s.dialect})
    if dialects:
        parts.append(("/".join(dialects), False))
    return parts


def stats_text(mirror: BlockMirror) -> str:
    """stats_parts() as one line: "2 publishers · 1,234 batches · 2 lost · 5 replayed · 0 malformed"."""
    return " · ".join(text for text, _ in stats_parts(mirror))
