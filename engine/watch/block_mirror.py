"""The prefix caches of vLLM / SGLang workers, rebuilt from their KV events: what the block views draw.

Where CacheMirror holds cells (llama.cpp's cache: an index, a position, a set of sequences), a BlockMirror
holds hashed blocks, which is all a vLLM or SGLang worker says about its cache: per worker, per medium (GPU,
CPU offload, ...) and per KV cache group (full attention, a sliding window), the blocks held, each with its
parent's hash, token ids, block size, LoRA, and when it was stored; and the blocks evicted last. A block's
hash names its content and the whole prefix before it (vLLM chains the hashes), so the same hash on two
workers is the same prefix, and the parent hashes form a prefix tree.

The events say what is held, not where: no physical block ids, no hits, no request that used a block.
Torch-free. Applied from engine/events.py's KvWorkerSeen, BlocksStored, BlocksRemoved, BlocksCleared,
BlockSnapshot, KvBatchesLost, KvPublisherRestarted and KvEventStats; CacheMirror owns one (`mirror.blocks`)
and hands it those, so watchers, recordings and replays carry blocks as they carry cells.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from engine import events as ev

EVICTION_LOG = 2000  # evicted blocks remembered, newest last (all workers together)
RATE_HISTORY = 4096  # (ts, stored, evicted) samples kept per worker for the per-second rates
Tier = tuple[str, int]  # (medium, group)


@dataclass(slots=True, eq=False)
class Block:
    """One block a worker holds. `root` is the first block of its chain as far as the mirror knows it (the
    prefix it belongs to: which system prompt or conversation); `depth` how many blocks come before it
    (-1: not known, a parent the mirror never saw)."""

    hash: bytes
    parent: bytes | None
    token_ids: np.ndarray
    block_size: int
    worker: int
    medium: str
    group: int
    lora: str
    stored_ts: float
    stored_seq_no: int
    root: bytes
    depth: int
    extra_keys: str = ""


@dataclass(slots=True, eq=False)
class Evicted:
    """A block a worker no longer holds: as it was, when it went, and why ("" the publisher evicted it)."""

    block: Block
    evicted_ts: float
    cause: str = ""


@dataclass(eq=False)
class TreeNode:
    """A node of a worker's prefix tree: a held block, or (block None) a parent it does not hold or the
    mirror never saw, under which its children hang. `n_blocks` counts the held blocks of the subtree."""

    hash: bytes
    block: Block | None
    children: list[TreeNode] = field(default_factory=list)
    n_blocks: int = 0

    def walk(self) -> Iterator[tuple[int, TreeNode]]:
        """(depth below this node, node) in display order; iterative, since chains run thousands deep."""
        stack = [(0, self)]
        while stack:
            depth, node = stack.pop()
            yield depth, node
            stack.extend((depth + 1, c) for c in reversed(node.children))


@dataclass
class PrefixShare:
    """A prefix (its first block, `root`) as the workers hold it: the deepest block each worker holds of it."""

    root: bytes
    deepest: dict[int, Block]  # worker -> its deepest block of this prefix
    blocks: dict[int, int]  # worker -> how many blocks of this prefix it holds

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(sorted(self.deepest))


@dataclass
class RouterView:
    """BlockMirror.router_view(): the prefixes as the workers hold them, and what each holds alone."""

    held: dict[int, dict[bytes, Block]]  # worker -> hash -> block
    holders: dict[bytes, list[int]]  # hash -> the workers holding it
    shares: list[PrefixShare]  # the most widely held and longest first
    exclusive: dict[int, dict[bytes, int]]  # worker -> first block -> blocks of that prefix no other worker holds


@dataclass
class WorkerCounts:
    held: int = 0
    stored: int = 0  # blocks stored since the mirror began
    evicted: int = 0
    unknown_removals: int = 0  # removals of blocks the mirror did not hold (joined late, or a batch was lost)


@dataclass
class EndpointState:
    """What the subscriber said about one publisher: its last stats, the gaps, the restarts."""

    stats: ev.KvEventStats | None = None
    lost: int = 0  # batches lost for good
    recovered: int = 0
    restarts: int = 0
    gaps: list[ev.KvBatchesLost] = field(default_factory=list)


class BlockMirror:
    """Every worker's blocks, rebuilt from block events. Thread-safe: apply from one thread, read from others."""

    def __init__(self) -> None:
        self.seen: dict[int, ev.KvWorkerSeen] = {}
        self._tiers: dict[int, dict[Tier, dict[bytes, Block]]] = {}
        self._groups: dict[tuple[int, int], tuple[str, int]] = {}  # (worker, group) -> (kind, sliding window)
        # hash -> [root, depth, references]: the chain of every block held (by any worker, in any tier) or in the
        # eviction log, so that a child stored later finds its parent's; only that, so that a keyframe restores it
        self._chains: dict[bytes, list] = {}
        self.evictions: collections.deque[Evicted] = collections.deque(maxlen=EVICTION_LOG)
        self.counts: dict[int, WorkerCounts] = {}
        self._rates: dict[int, collections.deque[tuple[float, int, int]]] = {}
        self.endpoints: dict[str, EndpointState] = {}
        self.version = 0  # counts the events applied: what a view's cache of derived data is keyed by
        self._heads: tuple[int, dict[bytes, bytes]] = (-1, {})
        self._lock = threading.RLock()

    # ---- applying events ------------------------------------------------------------------------
    def apply(self, event: ev.Event) -> None:
        with self._lock:
            self._apply(event)

    def apply_all(self, events: list[ev.Event]) -> None:
        with self._lock:
            for event in events:
                self._apply(event)

    def _apply(self, event: ev.Event) -> None:
        self.version += 1
        kind = type(event)
        if kind is ev.BlocksStored:
            self._store(event)
        elif kind is ev.BlocksRemoved:
            self._remove(event)
        elif kind is ev.BlocksCleared:
            self._clear(event)
        elif kind is ev.KvWorkerSeen:
            self.seen[event.worker] = event
            self._worker(event.worker)
        elif kind is ev.BlockSnapshot:
            self._restore(event)
        elif kind is ev.KvBatchesLost:
            state = self._endpoint(event.endpoint)
            state.lost += event.lost
            state.recovered += event.recovered
            state.gaps.append(event)
            del state.gaps[:-100]
        elif kind is ev.KvPublisherRestarted:
            self._endpoint(event.endpoint).restarts += 1
        elif kind is ev.KvEventStats:
            self._endpoint(event.endpoint).stats = event

    def _worker(self, worker: int) -> dict[Tier, dict[bytes, Block]]:
        tiers = self._tiers.get(worker)
        if tiers is None:
            tiers = self._tiers[worker] = {}
            if worker not in self.seen:  # a publisher that never introduced it: known by its number alone
                self.seen[worker] = ev.KvWorkerSeen(worker, "")
            self.counts[worker] = WorkerCounts()
            self._rates[worker] = collections.deque(maxlen=RATE_HISTORY)
        return tiers

    def _endpoint(self, endpoint: str) -> EndpointState:
        state = self.endpoints.get(endpoint)
        if state is None:
            state = self.endpoints[endpoint] = EndpointState()
        return state

    def _chain_of(self, parent: bytes | None, own: bytes) -> tuple[bytes, int]:
        """(first block, depth) of a block whose parent is `parent`."""
        if parent is None:
            return own, 0
        known = self._chains.get(parent)
        if known is None:
            return parent, -1  # the chain's start is not known: its children still share a colour
        return known[0], (known[1] + 1 if known[1] >= 0 else -1)

    def _hold_chain(self, block: Block) -> None:
        entry = self._chains.get(block.hash)
        if entry is None:
            self._chains[block.hash] = [block.root, block.depth, 1]
        else:
            entry[2] += 1

    def _drop_chain(self, block: Block) -> None:
        entry = self._chains.get(block.hash)
        if entry is not None:
            entry[2] -= 1
            if entry[2] <= 0:
                del self._chains[block.hash]

    def _log_eviction(self, entry: Evicted) -> None:
        log = self.evictions
        if len(log) == log.maxlen:
            self._drop_chain(log[0].block)  # about to fall off the log
        log.append(entry)
        self._hold_chain(entry.block)

    def _store(self, event: ev.BlocksStored) -> None:
        tiers = self._tiers.get(event.worker) or self._worker(event.worker)
        tier_key = (event.medium, event.group)
        tier = tiers.get(tier_key)
        if tier is None:
            tier = tiers[tier_key] = {}
        if event.group_kind or event.sliding_window:
            self._groups[(event.worker, event.group)] = (event.group_kind, event.sliding_window)
        size, tokens, parent = event.block_size, event.token_ids, event.parent_hash
        extra, chains = event.extra_keys, self._chains
        worker, medium, group, lora, ts, seq_no = (event.worker, event.medium, event.group, event.lora, event.ts,
                                                   event.seq_no)
        one = len(event.block_hashes) == 1  # the usual event (vLLM sends a block's store as it fills)
        for k, h in enumerate(event.block_hashes):
            known = None if parent is None else chains.get(parent)  # _chain_of, inline
            if known is not None:
                root, depth = known[0], (known[1] + 1 if known[1] >= 0 else -1)
            else:
                root, depth = (h, 0) if parent is None else (parent, -1)
            block = Block(h, parent, tokens if one and len(tokens) <= size else tokens[k * size:(k + 1) * size], size,
                          worker, medium, group, lora, ts, seq_no, root, depth, extra[k] if k < len(extra) else "")
            old = tier.get(h)
            if old is not None:
                self._drop_chain(old)
            tier[h] = block
            entry = chains.get(h)  # _hold_chain, inline: this loop runs per block of a busy deployment
            if entry is None:
                chains[h] = [root, depth, 1]
            else:
                entry[2] += 1
            parent = h
        n = len(event.block_hashes)
        counts = self.counts[event.worker]
        counts.stored += n
        self._rates[event.worker].append((event.ts, n, 0))

    def _remove(self, event: ev.BlocksRemoved) -> None:
        tier = self._worker(event.worker).get((event.medium, event.group), {})
        counts = self.counts[event.worker]
        evicted = 0
        for h in event.block_hashes:
            block = tier.pop(h, None)
            if block is None:
                counts.unknown_removals += 1
                continue
            self._log_eviction(Evicted(block, event.ts, event.cause))
            self._drop_chain(block)
            evicted += 1
        counts.evicted += evicted
        self._rates[event.worker].append((event.ts, 0, evicted))

    def _clear(self, event: ev.BlocksCleared) -> None:
        tiers = self._worker(event.worker)
        n = sum(len(t) for t in tiers.values())
        cause = event.cause or "all blocks cleared"
        for tier in tiers.values():
            blocks = list(tier.values())
            for block in blocks[-EVICTION_LOG:]:  # the newest: a clear of 100k blocks logs its last few
                self._log_eviction(Evicted(block, event.ts, cause))
            for block in blocks:
                self._drop_chain(block)
        tiers.clear()
        self.counts[event.worker].evicted += n
        self._rates[event.worker].append((event.ts, 0, n))

    def _restore(self, event: ev.BlockSnapshot) -> None:
        tiers = self._worker(event.worker)
        tier_key = (event.medium, event.group)
        if event.group_kind or event.sliding_window:
            self._groups[(event.worker, event.group)] = (event.group_kind, event.sliding_window)
        blocks = []
        starts, sizes = event.token_starts, event.block_sizes
        exact = len(event.roots) == len(event.block_hashes) and event.depths is not None
        for k, h in enumerate(event.block_hashes):
            parent = event.parent_hashes[k]
            root, depth = (event.roots[k], int(event.depths[k])) if exact else self._chain_of(parent, h)
            blocks.append(Block(h, parent, event.token_ids[starts[k]:starts[k + 1]], int(sizes[k]), event.worker,
                                event.medium, event.group, event.lora[k] if k < len(event.lora) else "",
                                float(event.stored_ts[k]), int(event.stored_seq_nos[k]), root, depth))
        if event.evicted_ts is None:
            for old in tiers.get(tier_key, {}).values():
                self._drop_chain(old)
            tiers[tier_key] = {b.hash: b for b in blocks}
            for block in blocks:
                self._hold_chain(block)
        else:
            for block, when, cause in zip(blocks, event.evicted_ts, event.evicted_causes):
                self._log_eviction(Evicted(block, float(when), cause))

    # ---- reading --------------------------------------------------------------------------------
    def workers(self) -> list[int]:
        with self._lock:
            return sorted(self._tiers)

    def label(self, worker: int) -> str:
        seen = self.seen.get(worker)
        return seen.label if seen is not None and seen.label else f"worker {worker}"

    def tiers(self, worker: int) -> list[Tier]:
        """(medium, group) pairs the worker holds blocks in, GPU first."""
        with self._lock:
            keys = [k for k, t in self._tiers.get(worker, {}).items() if t]
        return sorted(keys, key=lambda k: (k[0] != ev.MEDIUM_GPU, k[0], k[1]))

    def group_kind(self, worker: int, group: int) -> tuple[str, int]:
        """(kv_cache_spec_kind, sliding window) of a worker's group, as its publisher said ("", 0: not said)."""
        return self._groups.get((worker, group), ("", 0))

    def blocks(self, worker: int, medium: str | None = None, group: int | None = None) -> dict[bytes, Block]:
        """hash -> block, of one worker, in one medium and group or all of them (None). A hash held in two
        media (a GPU block offloaded to CPU) is given once, as the first of the tiers() order holds it."""
        with self._lock:
            out: dict[bytes, Block] = {}
            for key in reversed(self.tiers(worker)):
                if (medium is None or key[0] == medium) and (group is None or key[1] == group):
                    out.update(self._tiers[worker][key])
            return out

    def held(self, worker: int, medium: str | None = None, group: int | None = None) -> int:
        with self._lock:
            return sum(len(t) for k, t in self._tiers.get(worker, {}).items()
                       if (medium is None or k[0] == medium) and (group is None or k[1] == group))

    def find(self, block_hash: bytes) -> list[Block]:
        """Every worker's copy of a block (any medium and group), and none: it is not held."""
        with self._lock:
            return [t[block_hash] for tiers in self._tiers.values() for t in tiers.values() if block_hash in t]

    def last_eviction(self, worker: int, block_hash: bytes) -> Evicted | None:
        with self._lock:
            for entry in reversed(self.evictions):
                if entry.block.hash == block_hash and entry.block.worker == worker:
                    return entry
            return None

    def chain(self, block_hash: bytes) -> tuple[bytes, int] | None:
        """(first block, depth) of a block held or in the eviction log."""
        entry = self._chains.get(block_hash)
        return None if entry is None else (entry[0], entry[1])

    def rates(self, worker: int, now_ts: float, window_s: float = 5.0) -> tuple[float, float]:
        """(stored, evicted) blocks per second over the last `window_s` seconds of the publisher's clock."""
        with self._lock:
            stored = evicted = 0
            for ts, s, e in reversed(self._rates.get(worker, ())):
                if ts < now_ts - window_s:
                    break
                stored += s
                evicted += e
        return stored / window_s, evicted / window_s

    def latest_ts(self) -> float:
        """The publisher clock of the newest block event (0.0 before any)."""
        with self._lock:
            return max((r[-1][0] for r in self._rates.values() if r), default=0.0)

    def tree(self, worker: int, medium: str | None = None, group: int | None = None) -> list[TreeNode]:
        """The prefix tree the parent hashes form: its roots, largest first. A block whose parent the worker
        does not hold hangs under a node (block None) for that parent, so that siblings stay together."""
        blocks = self.blocks(worker, medium, group)
        nodes = {h: TreeNode(h, b) for h, b in blocks.items()}
        missing: dict[bytes, TreeNode] = {}  # parents not held, kept apart: nodes is being iterated
        roots: list[TreeNode] = []
        for node in nodes.values():
            parent = node.block.parent
            if parent is None:
                roots.append(node)
                continue
            above = nodes.get(parent) or missing.get(parent)
            if above is None:
                above = missing[parent] = TreeNode(parent, None)
                roots.append(above)
            above.children.append(node)
        for root in roots:
            _count(root)
        roots.sort(key=lambda n: -n.n_blocks)
        return roots

    def branch_heads(self) -> dict[bytes, bytes]:
        """held hash -> the first block of its branch: walking up its chain, the last block before a parent
        that has several children (among the blocks any worker holds) or that no worker holds. A shared system
        prompt is one branch, each conversation below it another: what a lane colours by, the same on every
        worker. Worked out again only after new events."""
        with self._lock:
            if self._heads[0] == self.version:
                return self._heads[1]
            parents: dict[bytes, bytes | None] = {}
            for tiers in self._tiers.values():
                for tier in tiers.values():
                    for h, block in tier.items():
                        parents[h] = block.parent
            children: dict[bytes, int] = {}
            for parent in parents.values():
                if parent is not None:
                    children[parent] = children.get(parent, 0) + 1
            heads: dict[bytes, bytes] = {}
            for h in parents:
                path = []
                node = h
                while node not in heads:
                    parent = parents[node]
                    path.append(node)
                    if parent is None or parent not in parents or children.get(parent, 0) > 1:
                        head = node
                        break
                    node = parent
                else:
                    head = heads[node]
                for n in path:
                    heads[n] = head
            self._heads = (self.version, heads)
            return heads

    def router_view(self, medium: str | None = ev.MEDIUM_GPU) -> RouterView:
        """What a KV-aware router sees, worked out from one copy of each worker's blocks: the lock is held only
        while a worker's blocks are copied, not for the count (a while over a hundred thousand blocks, which
        would hold back the events meanwhile)."""
        held = {w: self.blocks(w, medium) for w in self.workers()}
        holders: dict[bytes, list[int]] = {}
        for worker, blocks in held.items():
            for h in blocks:
                holders.setdefault(h, []).append(worker)
        shares: dict[bytes, PrefixShare] = {}
        exclusive: dict[int, dict[bytes, int]] = {}
        for worker, blocks in held.items():
            only: dict[bytes, int] = {}
            for h, block in blocks.items():
                share = shares.get(block.root)
                if share is None:
                    share = shares[block.root] = PrefixShare(block.root, {}, {})
                share.blocks[worker] = share.blocks.get(worker, 0) + 1
                best = share.deepest.get(worker)
                if best is None or block.depth > best.depth:
                    share.deepest[worker] = block
                if len(holders[h]) == 1:
                    only[block.root] = only.get(block.root, 0) + 1
            exclusive[worker] = dict(sorted(only.items(), key=lambda kv: -kv[1]))
        ordered = sorted(shares.values(), key=lambda s: (-len(s.deepest), -max(b.depth for b in s.deepest.values()),
                                                         -sum(s.blocks.values())))
        return RouterView(held, holders, ordered, exclusive)

    def shared_prefixes(self, medium: str | None = ev.MEDIUM_GPU) -> list[PrefixShare]:
        """Every prefix (first block) with the deepest block each worker holds of it, the most widely held and
        longest first: what a KV-aware router sees when it picks a worker for a prompt."""
        return self.router_view(medium).shares

    def exclusive_blocks(self, worker: int, medium: str | None = ev.MEDIUM_GPU) -> dict[bytes, int]:
        """first block -> how many blocks of that prefix this worker holds that no other worker does."""
        return self.router_view(medium).exclusive.get(worker, {})

    # ---- the mirror's state, as events and as plain data ----------------------------------------
    def state_events(self) -> list[ev.Event]:
        """Events that give a fresh BlockMirror this one's state (snapshot() equal): each worker's KvWorkerSeen,
        a BlockSnapshot per medium and group it holds blocks in, and one of the eviction log. Counters and
        rates are history, not state: they start again from there."""
        with self._lock:
            # copies: whoever takes the state stamps its events, and the received ones stay as they came
            events: list[ev.Event] = [dataclasses.replace(s) for s in self.seen.values()]
            for worker, tiers in self._tiers.items():
                for (medium, group), tier in tiers.items():
                    if tier:
                        events.append(self._snapshot_event(worker, medium, group, list(tier.values())))
            # the log in its order: one snapshot per run of entries of one worker, medium and group
            for (worker, medium, group), run in itertools.groupby(
                    self.evictions, key=lambda e: (e.block.worker, e.block.medium, e.block.group)):
                entries = list(run)
                events.append(self._snapshot_event(worker, medium, group, [e.block for e in entries], entries))
            return events

    def _snapshot_event(self, worker: int, medium: str, group: int, blocks: list[Block],
                        evicted: list[Evicted] | None = None) -> ev.BlockSnapshot:
        lengths = np.array([len(b.token_ids) for b in blocks], dtype=np.int64)
        starts = np.zeros(len(blocks) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        tokens = np.concatenate([b.token_ids for b in blocks]).astype(np.int64) if blocks else np.zeros(0, np.int64)
        kind, window = self.group_kind(worker, group)
        return ev.BlockSnapshot(
            worker=worker, medium=medium, group=group, block_hashes=tuple(b.hash for b in blocks),
            parent_hashes=tuple(b.parent for b in blocks), token_ids=tokens, token_starts=starts,
            block_sizes=np.array([b.block_size for b in blocks], dtype=np.int64),
            stored_ts=np.array([b.stored_ts for b in blocks], dtype=np.float64),
            stored_seq_nos=np.array([b.stored_seq_no for b in blocks], dtype=np.int64),
            lora=tuple(b.lora for b in blocks), group_kind=kind, sliding_window=window,
            roots=tuple(b.root for b in blocks), depths=np.array([b.depth for b in blocks], dtype=np.int64),
            evicted_ts=None if evicted is None else np.array([e.evicted_ts for e in evicted], dtype=np.float64),
            evicted_causes=() if evicted is None else tuple(e.cause for e in evicted))

    def snapshot(self) -> dict:
        """The state as plain data, for comparing two mirrors: the workers, every held block's fields, the
        eviction log and what the publishers said of gaps and restarts (not the counters and rates)."""
        with self._lock:
            def block_data(b: Block) -> tuple:
                return (b.parent, tuple(int(t) for t in b.token_ids), b.block_size, b.lora, b.stored_ts,
                        b.stored_seq_no, b.root, b.depth)

            return {
                "workers": {w: (s.endpoint, s.rank, s.label, s.capacity_blocks, s.dialect) for w, s in self.seen.items()},
                "blocks": {w: {f"{m}/{g}": {h: block_data(b) for h, b in tier.items()}
                               for (m, g), tier in tiers.items() if tier} for w, tiers in self._tiers.items()},
                "groups": dict(self._groups),
                "evictions": [(e.block.worker, e.block.medium, e.block.group, e.block.hash, e.evicted_ts, e.cause,
                               *block_data(e.block)) for e in self.evictions],
            }

    def differences(self, other: BlockMirror) -> list[str]:
        from engine.watch.mirror import data_differences

        return data_differences(self.snapshot(), other.snapshot())

    def same_as(self, other: BlockMirror) -> bool:
        return not self.differences(other)


def _count(node: TreeNode) -> int:
    """n_blocks of every node below and including `node`, without recursion (chains run thousands deep)."""
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children)
    for n in reversed(order):
        n.n_blocks = (1 if n.block is not None else 0) + sum(c.n_blocks for c in n.children)
        n.children.sort(key=lambda c: -c.n_blocks)
    return node.n_blocks


BLOCK_EVENTS = (ev.KvWorkerSeen, ev.BlocksStored, ev.BlocksRemoved, ev.BlocksCleared, ev.BlockSnapshot,
                ev.KvBatchesLost, ev.KvPublisherRestarted, ev.KvEventStats)
