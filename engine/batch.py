"""Batches: validation against the cache, and splitting into ubatches (llama.cpp's llama_batch_allocr).

Messages of InvalidBatchError are llama.cpp's, so that people who know its logs recognise them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from engine.arguments import int_array, int_lists, output_flags
from engine.errors import InvalidBatchError


@dataclass
class Batch:
    """Tokens to decode. `pos` None: continue each sequence after its last cached position.
    `seq_ids` None: every token in sequence 0. `logits` None: only the last token is an output."""

    tokens: Sequence[int]
    pos: Sequence[int] | None = None
    seq_ids: Sequence[Sequence[int]] | None = None
    logits: Sequence[bool] | None = None

    def __post_init__(self) -> None:
        _checked_fields(self)

    @classmethod
    def for_sequence(cls, tokens: Sequence[int], seq_id: int, start_pos: int, all_logits: bool = False) -> "Batch":
        n = len(tokens)
        return cls(list(tokens), list(range(start_pos, start_pos + n)), [[seq_id]] * n,
                   [all_logits or i == n - 1 for i in range(n)])

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, eq=False)
class UBatch:
    """A physical batch. Tokens of an equal split are grouped per sequence set, sets in order."""

    idxs: np.ndarray  # index of each token in the batch
    tokens: np.ndarray
    pos: np.ndarray
    seq_ids: tuple[tuple[int, ...], ...]
    output: np.ndarray  # bool
    n_seqs: int  # sequence sets (equal split); n_tokens for a simple split
    equal_seqs: bool
    seq_id_unq: tuple[int, ...]  # distinct seq ids, ascending

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class SeqPositions(Protocol):
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...


class BatchAllocator:
    """A validated batch and the state of its split into ubatches."""

    def __init__(self, batch: Batch, *, n_vocab: int, n_seq_max: int, memory: SeqPositions | None) -> None:
        # the fields are checked again: a Batch is mutable, and a decode must not see a str or a float
        tokens, pos, seq_ids, logits = _checked_fields(batch)
        n = len(tokens)
        if n == 0:
            raise InvalidBatchError("init: the batch is empty")
        self.tokens = tokens
        _check_tokens(self.tokens, n_vocab)
        seq_ids = ((0,),) * n if seq_ids is None else seq_ids
        if len(seq_ids) != n:
            raise InvalidBatchError(f"init: batch has {n} tokens but {len(seq_ids)} seq_id lists")
        self.seq_ids = seq_ids
        _check_seq_ids(self.seq_ids, n_seq_max)
        self.pos = _positions(pos, self.seq_ids, memory)
        self.output = _outputs(logits, n)
        self.n_outputs = int(self.output.sum())
        self.seq_set = [frozenset(ids) for ids in self.seq_ids]
        self.seq_set_map: dict[frozenset[int], list[int]] = {}
        for i, s in enumerate(self.seq_set):
            self.seq_set_map.setdefault(s, []).append(i)
        self.seq_id_unq = tuple(sorted(set().union(*self.seq_set)))
        self.has_cpl = _check_consistency(self.pos, self.seq_ids, memory)
        self.used = np.zeros(n, dtype=bool)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def split_reset(self) -> None:
        self.used[:] = False

    def all_used(self) -> bool:
        return bool(self.used.all())

    def split_simple(self, n_ubatch: int) -> UBatch | None:
        """The next up to n_ubatch unused tokens in batch order, any mix of sequences."""
        free = np.flatnonzero(~self.used)
        if free.size == 0:
            return None
        start = int(free[0])
        idxs = np.arange(start, min(start + n_ubatch, self.n_tokens))
        self.used[idxs] = True
        return self._ubatch(idxs, n_seqs=len(idxs), equal=False)

    def split_equal(self, n_ubatch: int, sequential: bool) -> UBatch | None:
        """Disjoint sequence sets, one token of each per round, the same count for every set."""
        if sequential and self.has_cpl:
            return None  # llama.cpp logs: sequential split is not supported with coupled sequences (-kvu)
        sets: list[frozenset[int]] = []
        last_seq_id = -1
        for i in np.flatnonzero(~self.used):
            cur = self.seq_set[i]
            add = all(not (s & cur) for s in sets)
            if sequential:
                add = add and (not sets or self.seq_ids[i][0] == last_seq_id + 1)
            if add:
                sets.append(cur)
                last_seq_id = self.seq_ids[i][0]
                # QUIRK (llama.cpp): the check comes after the append, so n_ubatch + 1 sets fit.
                if len(sets) > n_ubatch:
                    break
        if not sets:
            return None
        pending = [[i for i in self.seq_set_map[s] if not self.used[i]] for s in sets]
        per_set: list[list[int]] = [[] for _ in sets]
        rounds = 0
        while all(rounds < len(p) for p in pending):
            for k, p in enumerate(pending):
                per_set[k].append(p[rounds])
                self.used[p[rounds]] = True
            rounds += 1
            if (rounds + 1) * len(sets) > n_ubatch:
                break
        idxs = np.array([i for chunk in per_set for i in chunk], dtype=np.int64)
        return self._ubatch(idxs, n_seqs=len(sets), equal=True)

    def _ubatch(self, idxs: np.ndarray, n_seqs: int, equal: bool) -> UBatch:
        seq_ids = tuple(self.seq_ids[i] for i in idxs)
        unq = tuple(sorted({s for ids in seq_ids for s in ids}))
        return UBatch(idxs, self.tokens[idxs], self.pos[idxs], seq_ids, self.output[idxs], n_seqs, equal, unq)


def _check_tokens(tokens: np.ndarray, n_vocab: int) -> None:
    bad = np.flatnonzero((tokens < 0) | (tokens >= n_vocab))
    if bad.size:
        i = int(bad[0])
        raise InvalidBatchError(f"init: invalid token[{i}] = {int(tokens[i])}")


def _check_seq_ids(seq_ids: tuple[tuple[int, ...], ...], n_seq_max: int) -> None:
    for i, ids in enumerate(seq_ids):
        if not ids:
            raise InvalidBatchError(f"init: token {i} has no seq_id")
        for s, seq_id in enumerate(ids):
            if seq_id < 0 or seq_id >= n_seq_max:
                raise InvalidBatchError(f"init: invalid seq_id[{i}][{s}] = {seq_id} >= {n_seq_max}")
        if len(set(ids)) != len(ids):
            raise InvalidBatchError(f"init: token {i} lists a seq_id twice: {list(ids)}")


def _checked_fields(batch: Batch):
    """The batch's fields as arrays and tuples, or ArgumentTypeError naming the field and the value."""
    return (int_array(batch.tokens, "tokens", "Batch"),
            None if batch.pos is None else int_array(batch.pos, "pos", "Batch"),
            None if batch.seq_ids is None else int_lists(batch.seq_ids, "seq_ids", "Batch"),
            None if batch.logits is None else output_flags(batch.logits, "logits", "Batch"))


def _positions(pos: np.ndarray | None, seq_ids, memory: SeqPositions | None) -> np.ndarray:
    n = len(seq_ids)
    if pos is not None:
        if len(pos) != n:
            raise InvalidBatchError(f"init: batch has {n} tokens but {len(pos)} positions")
        return pos
    next_pos: dict[int, int] = {}
    pos = np.empty(n, dtype=np.int64)
    for i, ids in enumerate(seq_ids):
        first = ids[0]
        if first not in next_pos:
            next_pos[first] = memory.seq_pos_max(first) + 1 if memory is not None else 0
        pos[i] = next_pos[first]
        for s in ids:
            next_pos[s] = pos[i] + 1
    return pos


def _outputs(logits: np.ndarray | None, n: int) -> np.ndarray:
    if logits is None:
        out = np.zeros(n, dtype=bool)
        out[-1] = True
        return out
    if len(logits) != n:
        raise InvalidBatchError(f"init: batch has {n} tokens but {len(logits)} logits flags")
    return logits


def _check_consistency(pos, seq_ids, memory: SeqPositions | None) -> bool:
    """llama.cpp's consistency checks; returns whether any sequences are coupled."""
    seq_pos: dict[int, set[int]] = {}
    coupled: set[tuple[int, int]] = set()
    for i, ids in enumerate(seq_ids):
        for k, s in enumerate(ids):
            seq_pos.setdefault(s, set()).add(int(pos[i]))
            if k > 0:
                coupled.add((s, ids[0]))
    for s in sorted(seq_pos):
        p_min, p_max = min(seq_pos[s]), max(seq_pos[s])
        x = memory.seq_pos_max(s) if memory is not None else -1
        if x >= 0 and p_min != x + 1:
            raise InvalidBatchError(
                f"init: the tokens of sequence {s} in the input batch have inconsistent sequence positions:\n"
                f" - the last position stored in the memory module of the context (i.e. the KV cache) "
                f"for sequence {s} is X = {x}\n"
                f" - the tokens for sequence {s} in the input batch have a starting position of Y = {p_min}\n"
                f" it is required that the sequence positions remain consecutive: Y = X + 1")
        if p_max - p_min + 1 > len(seq_pos[s]):
            raise InvalidBatchError(f"init: sequence {s} positions are not continuous")
    if memory is not None:
        for s0, s1 in sorted(coupled):
            if (memory.seq_pos_min(s0) != memory.seq_pos_min(s1)
                    or memory.seq_pos_max(s0) != memory.seq_pos_max(s1)):
                raise InvalidBatchError(
                    f"init: sequence {s0} is coupled to {s1} in the input batch, but have divereged")
    # llama.cpp also intersects each sequence's sets here ("incompatible sequence sets"), but a
    # sequence is always in its own set, so that check cannot fail and is left out.
    cur_pos: dict[int, int] = {}
    for i, ids in enumerate(seq_ids):
        for s in ids:
            if pos[i] < cur_pos.get(s, -1):
                raise InvalidBatchError(f"init: sequence {s} positions are decreasing (not allowed)")
            cur_pos[s] = int(pos[i])
    return bool(coupled)

