"""kvscope's own cache seen the way vLLM's prefix cache is published: cells -> hashed blocks -> the BlockStored,
BlockRemoved and AllBlocksCleared events vLLM's ZmqEventPublisher sends (formats.WireEvent). What
engine/runners/kv_events_publisher.py puts on the wire, and so a load generator for whatever reads vLLM's KV
events (kvscope's own subscriber, a router).

    chains = BlockChains(block_size=16)
    for event in bus_events:                  # engine events, in order
        wire_events = chains.apply(event)     # [] when no block changed

The mapping, per sequence and stream of the full-attention cache ("kv"; "base" of an iSWA pair):
  - a sequence's blocks are its FULL blocks from position 0 on: block b exists while every position
    b*block_size .. (b+1)*block_size - 1 is held by exactly one cell of the sequence whose token is known; the
    chain stops at the first block that is not (a gap, a partial block, a position held twice);
  - hashes chain as vLLM's do: hash(b) = sha256(hash(b-1), or NONE_HASH for b = 0, + the block's token ids as
    little-endian int64). vLLM hashes a pickle or CBOR of (parent, tokens, extra keys) with a seed of its own, so
    the bytes differ from a vLLM's for the same tokens; what carries over is the structure: equal prefixes
    give equal hashes, and each hash names its whole prefix;
  - a hash held by several sequences (a prompt copied with seq_cp, two prompts with the same start, the same
    prefix in two streams) is one block, reference counted: BlockStored when the first holder appears,
    BlockRemoved when the last one loses it. llama.cpp frees a cell the moment its last sequence leaves it, so
    a block goes at once; vLLM keeps a freed block cached until its memory is taken (removal at eviction);
  - moved positions (seq_add, seq_div: a context shift) are other content: the moved blocks go, and what the
    new positions make is stored. The K-shift that re-rotates the keys later moves no position, so the blocks
    change with the move, not with the K-shift;
  - AllBlocksCleared when the cache is cleared (memory_clear, a state load), when a MemorySnapshot leaves it
    empty, when a new context replaces it, and when events were lost (see below).
With `sliding_window_group` (the map dialect: array layouts have no group field) an iSWA pair's "swa" cache is
published as group 1, kind "sliding_window", as vLLM publishes a sliding-window KV cache group: a block of it is
a block of the sequence's full-attention chain (the same hash and parent) whose positions the SWA cache still
holds with the same tokens; blocks the window left are removed from group 1 only. A model whose every layer
slides has one cache ("kv"), a sliding one: it is mapped as group 0 the same way (kind "sliding_window"), so a
sequence has no block once its window dropped position 0, where vLLM would keep the window's blocks.

What a cell holds is known from CellsAllocated's tokens only: cells restored from a saved state, or present
before this mapping started, carry no token (llama.cpp's state has none), so they make no block until they are
decoded again. A subscription that lost events (EventsDropped) cannot tell which cells changed meanwhile: every
block is cleared and every cell's token forgotten, so that what is published after is never invented.
Torch-free.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from engine import events as ev
from engine.errors import KvscopeError
from engine.watch.kv_events.formats import CLEARED, REMOVED, STORED, WireEvent
from engine.watch.mirror import CacheMirror

NONE_HASH = hashlib.sha256(b"kvscope NONE_HASH v1").digest()  # the parent of every chain's first block
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM's KVCacheSpecKind values
GROUP_FULL, GROUP_SLIDING = 0, 1
PRIMARY_CACHES = ("kv", "base")  # a context's full-attention cache (engine/kv: KVCache, KVCacheISWA.base)
SLIDING_CACHE = "swa"
UNKNOWN_TOKEN = -1


def block_hash(parent: bytes | None, tokens: np.ndarray) -> bytes:
    """The 32-byte hash of a block: sha256 over its parent's hash (NONE_HASH for a chain's first block) and its
    token ids as little-endian int64. The parent is always 32 bytes, so the encoding is unambiguous."""
    return hashlib.sha256((NONE_HASH if parent is None else parent)
                          + np.ascontiguousarray(tokens, dtype="<i8").tobytes()).digest()


@dataclass
class _Chain:
    """One sequence's full blocks in the full-attention cache: their tokens in position order, and hashes."""

    tokens: np.ndarray
    hashes: list[bytes]


@dataclass
class _Group:
    """One KV cache group as vLLM numbers them: the blocks held (hash -> how many sequences hold it) and, per
    (stream, sequence), the block indices and hashes it holds, in position order."""

    idx: int
    kind: str
    window: int | None
    refs: dict[bytes, int] = field(default_factory=dict)
    held: dict[tuple[int, int], tuple[tuple[int, ...], tuple[bytes, ...]]] = field(default_factory=dict)


@dataclass
class _Walk:
    group: _Group
    chain: _Chain
    blocks: tuple[int, ...]
    hashes: tuple[bytes, ...]


class _Delta:
    """What one engine event did to the groups' reference counts, turned into wire events at the end: a hash is
    stored or removed only when its count crossed zero over the whole event (a block one sequence lost and
    another took is neither)."""

    def __init__(self) -> None:
        self.before: dict[tuple[int, bytes], int] = {}
        self.released: list[tuple[_Group, bytes]] = []
        self.walks: list[_Walk] = []

    def release(self, group: _Group, h: bytes) -> None:
        count = group.refs[h]
        self.before.setdefault((group.idx, h), count)
        if count == 1:
            del group.refs[h]
        else:
            group.refs[h] = count - 1
        self.released.append((group, h))

    def take(self, group: _Group, h: bytes) -> None:
        count = group.refs.get(h, 0)
        self.before.setdefault((group.idx, h), count)
        group.refs[h] = count + 1

    def events(self, groups: list[_Group], block_size: int) -> list[WireEvent]:
        out = []
        for group in groups:  # removals first, as vLLM evicts before it stores into the freed blocks
            gone = list(dict.fromkeys(h for g, h in self.released if g is group and h not in group.refs
                                      and self.before[(group.idx, h)] > 0))
            if gone:
                out.append(WireEvent(REMOVED, block_hashes=tuple(gone), medium=ev.MEDIUM_GPU, group_idx=group.idx))
        for group in groups:
            out += self._stored(group, block_size)
        return out

    def _stored(self, group: _Group, block_size: int) -> list[WireEvent]:
        out, said = [], set()
        for walk in (w for w in self.walks if w.group is group):
            run: list[int] = []
            for b, h in zip(walk.blocks, walk.hashes):
                new = h not in said and self.before.get((group.idx, h), 1) == 0 and h in group.refs
                if new and run and b == run[-1] + 1:
                    run.append(b)
                    said.add(h)
                    continue
                if run:
                    out.append(self._event(group, walk.chain, run, block_size))
                run = [b] if new else []
                if new:
                    said.add(h)
            if run:
                out.append(self._event(group, walk.chain, run, block_size))
        return out

    @staticmethod
    def _event(group: _Group, chain: _Chain, run: list[int], block_size: int) -> WireEvent:
        first, last = run[0], run[-1]
        return WireEvent(STORED, block_hashes=tuple(chain.hashes[first:last + 1]),
                         parent_hash=chain.hashes[first - 1] if first > 0 else None,
                         token_ids=tuple(chain.tokens[first * block_size:(last + 1) * block_size].tolist()),
                         block_size=block_size, lora_id=None, medium=ev.MEDIUM_GPU, lora_name=None,
                         group_idx=group.idx, group_kind=group.kind, sliding_window=group.window)


@dataclass
class BlockChainStats:
    events: int = 0  # engine events applied
    wire_events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    lost_events: int = 0  # engine events the subscription dropped (each loss clears every block)


class BlockChains:
    """Engine events in, the vLLM KV events they amount to out (see the module docstring)."""

    def __init__(self, block_size: int = 16, sliding_window_group: bool = False) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise KvscopeError(f"a block size is a number of tokens, 1 or more (vLLM's default: 16), got {block_size!r}")
        self.block_size = block_size
        self.sliding_window_group = sliding_window_group
        self.stats = BlockChainStats()
        self._reset()

    def _reset(self) -> None:
        self.mirror = CacheMirror()
        self._tokens: dict[str, list[np.ndarray]] = {}  # per cache, per stream: each cell's token (-1 unknown)
        self.primary: str | None = None
        self.sliding: str | None = None
        self._chains: dict[tuple[int, int], _Chain] = {}
        self._groups: list[_Group] = []

    # ---- what is held ---------------------------------------------------------------------------------
    @property
    def groups(self) -> list[int]:
        return [g.idx for g in self._groups]

    def held(self, group: int = GROUP_FULL) -> dict[bytes, int]:
        """The blocks published as held in `group`: hash -> how many (stream, sequence) pairs hold it."""
        return dict(self._group(group).refs) if self._has_group(group) else {}

    def sequence_blocks(self, seq_id: int, stream: int = 0, group: int = GROUP_FULL) -> list[bytes]:
        """The hashes `group` holds for one sequence, in position order."""
        if not self._has_group(group):
            return []
        return list(self._group(group).held.get((stream, seq_id), ((), ()))[1])

    def recomputed(self, group: int = GROUP_FULL) -> set[bytes]:
        """The blocks of `group` computed afresh from the cells now, with nothing taken from earlier events:
        what held() must equal (a check of the incremental bookkeeping)."""
        if not self._has_group(group):
            return set()
        found: set[bytes] = set()
        primary = self.mirror.caches[self.primary]
        for stream in range(len(primary.streams)):
            for seq_id in _seqs_in(primary.streams[stream].seq_bits):
                chain = self._full_chain(stream, seq_id, None)
                if group == GROUP_FULL:
                    found.update(chain.hashes)
                else:
                    found.update(self._sliding_blocks(stream, seq_id, chain)[1])
        return found

    # ---- applying engine events ---------------------------------------------------------------------
    def apply(self, event: ev.Event) -> list[WireEvent]:
        """The wire events one engine event amounts to, in the order a publisher sends them ([] for most)."""
        self.stats.events += 1
        if isinstance(event, ev.CellsChanged):
            out = self._apply_cells(event)
        elif isinstance(event, ev.ContextCreated):
            out = self._created(event)
        elif isinstance(event, ev.EventsDropped):
            out = self._lost(event.count)
        else:
            return []
        for wire in out:
            self.stats.wire_events += 1
            if wire.tag == STORED:
                self.stats.blocks_stored += len(wire.block_hashes)
            elif wire.tag == REMOVED:
                self.stats.blocks_removed += len(wire.block_hashes)
            else:
                self.stats.clears += 1
        return out

    def _created(self, event: ev.ContextCreated) -> list[WireEvent]:
        if event.cache in PRIMARY_CACHES:
            # A new context (a rebuild, another model): whatever the old one held is gone, whichever caches it had.
            out = self._cleared_if_held()
            self._reset()
            self.primary = event.cache
            sliding = event.n_swa > 0  # a context whose every layer slides has one cache, and it slides
            self._groups = [_Group(GROUP_FULL, SLIDING_WINDOW if sliding else FULL_ATTENTION,
                                   event.n_swa if sliding else None)]
        elif event.cache == SLIDING_CACHE and self.sliding_window_group and self.primary is not None:
            out = []
            self.sliding = event.cache
            self._groups = [self._groups[0], _Group(GROUP_SLIDING, SLIDING_WINDOW, event.n_swa or None)]
        else:
            return []
        self.mirror.apply(event)
        self._tokens[event.cache] = [np.full(event.kv_size, UNKNOWN_TOKEN, dtype=np.int64)
                                     for _ in range(event.n_stream)]
        return out

    def _lost(self, count: int) -> list[WireEvent]:
        self.stats.lost_events += count
        out = self._cleared_if_held()
        self._forget_blocks()
        for streams in self._tokens.values():
            for tokens in streams:
                tokens.fill(UNKNOWN_TOKEN)
        return out

    def _cleared_if_held(self) -> list[WireEvent]:
        return [WireEvent(CLEARED)] if any(g.refs for g in self._groups) else []

    def _forget_blocks(self) -> None:
        self._chains.clear()
        for group in self._groups:
            group.refs.clear()
            group.held.clear()

    def _apply_cells(self, event: ev.CellsChanged) -> list[WireEvent]:
        name = event.cache
        if name not in (self.primary, self.sliding) or name not in self.mirror.caches:
            return []
        if event.tentative and isinstance(event, ev.CellsAllocated):
            return []  # undone by the SlotsRolledBack that follows (engine/watch/mirror.py skips it too)
        cache = self.mirror.caches[name]
        before = []
        for change in event.changes:
            st = cache.streams[change.stream]
            before.append((st.pos[change.cells], st.seq_bits[change.cells]))  # fancy indexing: copies
        self.mirror.apply(event)
        touched: set[tuple[int, int]] = set()
        if isinstance(event, ev.CellsRemoved) and event.reason == "clear":
            # A clear empties every cell, also those a lost event left wrong here (it lists only the cells the
            # engine held): from here on this copy is exact again, and every sequence held is looked at again.
            for st, tokens in zip(cache.streams, self._tokens[name]):
                st.pos.fill(-1)
                st.seq_bits.fill(0)
                tokens.fill(UNKNOWN_TOKEN)
            touched.update(key for group in self._groups for key in group.held)
        for k, (change, (old_pos, old_bits)) in enumerate(zip(event.changes, before)):
            tokens = self._tokens[name][change.stream]
            old_tokens = tokens[change.cells]
            self._place_tokens(event, k, change, old_pos, name)
            changed = ((old_pos != change.pos) | (old_bits != change.seq_bits).any(axis=1)
                       | (old_tokens != tokens[change.cells]))
            if changed.any():
                bits = np.bitwise_or.reduce(np.concatenate([old_bits[changed], change.seq_bits[changed]]), axis=0)
                touched.update((change.stream, s) for s in _seqs_in(bits[None, :]))
        if name == self.primary and self._empties(event, cache):
            out = [WireEvent(CLEARED)] if isinstance(event, ev.CellsRemoved) or any(g.refs for g in self._groups) \
                else []
            self._forget_blocks()
            return out
        if not touched:
            return []
        delta = _Delta()
        keys = sorted(touched)
        if name == self.primary:
            # group 1 is the chain's blocks the window holds: it changes with the chain, or with the window's cells
            keys = [key for key in keys if self._update_full(key, delta)]
        if self.sliding is not None:
            for key in keys:
                self._update_sliding(key, delta)
        return delta.events(self._groups, self.block_size)

    def _empties(self, event: ev.CellsChanged, cache) -> bool:
        """Whether the event emptied the full-attention cache as a whole: a clear (said even when nothing was
        held, as vLLM's prefix-cache reset says it), or a snapshot of an empty cache (a loaded empty state)."""
        if isinstance(event, ev.CellsRemoved) and event.reason == "clear":
            return True
        return isinstance(event, ev.MemorySnapshot) and all(not (st.pos >= 0).any() for st in cache.streams)

    def _place_tokens(self, event: ev.CellsChanged, k: int, change: ev.StreamCells, old_pos: np.ndarray,
                      name: str) -> None:
        """Each touched cell's token after the event: placed ones take the ubatch's, a stream copied whole takes
        its source's, moved ones keep theirs (seq_add and seq_div move content), and a cell given a position
        any other way (a restored state, a log's dump) holds a token nobody said."""
        tokens = self._tokens[name][change.stream]
        cells = change.cells
        if isinstance(event, ev.CellsAllocated):
            given = event.tokens[k] if k < len(event.tokens) else None
            tokens[cells] = given if given is not None and len(given) == len(cells) else UNKNOWN_TOKEN
        elif isinstance(event, ev.CellsCopied) and event.queued and event.src_stream != change.stream:
            # the copy keeps cell indices (KVCells.copy_cells)
            tokens[cells] = np.where(change.pos >= 0, self._tokens[name][event.src_stream][cells], UNKNOWN_TOKEN)
        elif not isinstance(event, (ev.CellsShifted, ev.KShiftApplied)):
            tokens[cells[change.pos != old_pos]] = UNKNOWN_TOKEN
        tokens[cells[change.pos < 0]] = UNKNOWN_TOKEN

    # ---- one sequence --------------------------------------------------------------------------------
    def _full_chain(self, stream: int, seq_id: int, old: _Chain | None) -> _Chain:
        st = self.mirror.caches[self.primary].streams[stream]
        cells = np.flatnonzero(st.holds(seq_id))
        bs = self.block_size
        n = len(cells)
        if n < bs:
            return _Chain(np.zeros(0, dtype=np.int64), [])
        pos = st.pos[cells]
        inside = (pos >= 0) & (pos < n)  # n cells cover positions 0..n-1 at most
        pos = pos[inside]
        counts = np.bincount(pos, minlength=n)
        ordered = np.full(n, UNKNOWN_TOKEN, dtype=np.int64)
        ordered[pos] = self._tokens[self.primary][stream][cells[inside]]
        bad = (counts != 1) | (ordered == UNKNOWN_TOKEN)
        n_ok = int(np.argmax(bad)) if bad.any() else n
        n_blocks = n_ok // bs
        tokens = ordered[:n_blocks * bs]
        same = _common_blocks(old, tokens, bs) if old is not None else 0
        hashes = old.hashes[:same] if old is not None else []
        parent = hashes[-1] if hashes else None
        for b in range(same, n_blocks):
            parent = block_hash(parent, tokens[b * bs:(b + 1) * bs])
            hashes.append(parent)
        return _Chain(tokens, hashes)

    def _update_full(self, key: tuple[int, int], delta: _Delta) -> bool:
        """Recompute one sequence's chain; whether its blocks changed."""
        old = self._chains.get(key)
        chain = self._full_chain(*key, old)
        if chain.hashes:
            self._chains[key] = chain
        else:
            self._chains.pop(key, None)
        return self._hold(self._groups[0], key, chain, tuple(range(len(chain.hashes))), tuple(chain.hashes), delta)

    def _sliding_blocks(self, stream: int, seq_id: int, chain: _Chain) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """The blocks of the full-attention chain whose positions the sliding-window cache holds, each once,
        with the same tokens."""
        n = len(chain.tokens)
        if n == 0:
            return (), ()
        st = self.mirror.caches[self.sliding].streams[stream]
        cells = np.flatnonzero(st.holds(seq_id))
        pos = st.pos[cells]
        inside = (pos >= 0) & (pos < n)
        pos = pos[inside]
        counts = np.bincount(pos, minlength=n)
        found = np.full(n, UNKNOWN_TOKEN, dtype=np.int64)
        found[pos] = self._tokens[self.sliding][stream][cells[inside]]
        ok = ((counts == 1) & (found == chain.tokens)).reshape(-1, self.block_size).all(axis=1)
        blocks = tuple(np.flatnonzero(ok).tolist())
        return blocks, tuple([chain.hashes[b] for b in blocks])

    def _update_sliding(self, key: tuple[int, int], delta: _Delta) -> None:
        chain = self._chains.get(key) or _Chain(np.zeros(0, dtype=np.int64), [])
        blocks, hashes = self._sliding_blocks(*key, chain)
        self._hold(self._groups[1], key, chain, blocks, hashes, delta)

    @staticmethod
    def _hold(group: _Group, key: tuple[int, int], chain: _Chain, blocks: tuple[int, ...],
              hashes: tuple[bytes, ...], delta: _Delta) -> bool:
        """Make `group` hold these blocks for `key`; whether that changed anything."""
        _, old_hashes = group.held.get(key, ((), ()))
        if old_hashes == hashes:
            return False
        new_set, old_set = set(hashes), set(old_hashes)
        for h in reversed(old_hashes):  # deepest first: a tree of blocks loses leaves before their parents
            if h not in new_set:
                delta.release(group, h)
        for h in hashes:
            if h not in old_set:
                delta.take(group, h)
        if hashes:
            group.held[key] = (blocks, hashes)
        else:
            group.held.pop(key, None)
        delta.walks.append(_Walk(group, chain, blocks, hashes))
        return True

    # ---- helpers --------------------------------------------------------------------------------------
    def _has_group(self, group: int) -> bool:
        return any(g.idx == group for g in self._groups)

    def _group(self, group: int) -> _Group:
        for g in self._groups:
            if g.idx == group:
                return g
        raise KvscopeError(f"no KV cache group {group}: this mapping has groups {self.groups}")


def _seqs_in(seq_bits: np.ndarray) -> list[int]:
    """The sequence ids any of these packed bitsets (n, 32) hold."""
    if not len(seq_bits):
        return []
    union = np.bitwise_or.reduce(seq_bits, axis=0)
    return [int(s) for s in np.flatnonzero(np.unpackbits(union, bitorder="little"))]


def _common_blocks(old: _Chain, tokens: np.ndarray, block_size: int) -> int:
    """How many leading blocks two chains' tokens share (their hashes are then equal: no need to hash again)."""
    m = min(len(old.tokens), len(tokens)) // block_size
    if m == 0:
        return 0
    equal = (old.tokens[:m * block_size] == tokens[:m * block_size]).reshape(m, block_size).all(axis=1)
    return m if equal.all() else int(np.argmin(equal))
