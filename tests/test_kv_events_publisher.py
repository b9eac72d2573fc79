"""kvscope's engine publishing vLLM's KV events (engine/runners/kv_events_publisher.py, the mapping in
engine/watch/kv_events/block_chains.py): a real engine Context on a tiny model, a SUB socket and a DEALER in the
test. Shared prefixes are stored once, a sequence's removal takes only its own blocks, a clear says
AllBlocksCleared, the blocks the stream describes are those of the engine's own cells, the replay socket answers
as vLLM's does and ignores what is not a request, every dialect decodes, and `kvscope serve --kv-events`
publishes until SIGTERM."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import zmq

import engine
from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.kv_events_publisher import END_SEQ, KvEventPublisher, check_endpoint
from engine.watch.kv_events import formats
from engine.watch.kv_events.block_chains import NONE_HASH, BlockChains
from tests.model_factory import in_memory_model
from tests.test_remote import free_port_pair

REPO = Path(__file__).resolve().parents[1]
LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"
WAIT_S = 10.0


@pytest.fixture(scope="module")
def model():
    return in_memory_model()


@pytest.fixture(scope="module")
def swa_model():
    """Layer 0 slides over a window of 8, layer 1 attends to everything: an iSWA pair of caches."""
    return in_memory_model(n_swa=8, swa_type=1, swa_layers=(True, False))


def hash_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The documented hash, computed here on its own: sha256(parent or NONE_HASH + tokens as int64 LE)."""
    out, parent = [], NONE_HASH
    for b in range(len(tokens) // block_size):
        parent = hashlib.sha256(parent + np.array(tokens[b * block_size:(b + 1) * block_size], "<i8").tobytes()).digest()
        out.append(parent)
    return out


def expected_blocks(cache, tokens_of: dict[int, list[int] | dict[int, int]], block_size: int) -> dict[int, list[bytes]]:
    """From the engine's own cells: each sequence's full blocks from position 0, each position held once; the
    token at each position as the test put it there (a list by position, or a dict position -> token)."""
    out = {}
    for stream in range(cache.n_stream):
        positions = defaultdict(list)
        for pos, seqs, _shift in cache.cells(stream):
            for s in seqs:
                positions[s].append(pos)
        for s, held in positions.items():
            n = 0
            while held.count(n) == 1:
                n += 1
            out[s] = hash_chain([tokens_of[s][p] for p in range(n)], block_size)
    return out


class Stream:
    """What a subscriber of the publisher sees: the raw messages, decoded batches, and the blocks they leave
    held per group (BlockStored adds, BlockRemoved takes away, AllBlocksCleared empties)."""

    def __init__(self, publisher: KvEventPublisher, topic: bytes = b"") -> None:
        self.publisher = publisher
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(publisher.endpoint)
        self.messages: list[list[bytes]] = []
        self.last = -1  # the seq of the last batch received
        self.held: dict[int, set[bytes]] = defaultdict(set)

    def join(self, ctx) -> None:
        """Wait until the subscription is in place (a PUB drops what it sends before): clear the (empty) cache,
        which always says AllBlocksCleared, until one arrives; then forget what came."""
        deadline = time.monotonic() + WAIT_S
        while True:
            ctx.memory.clear()
            assert self.publisher.flush(WAIT_S)
            if self.sock.poll(100):
                break
            assert time.monotonic() < deadline, "the SUB socket never received the publisher's batches"
        self.read()
        self.messages.clear()

    def read(self) -> list[formats.WireBatch]:
        """Every batch published so far (after a flush: all the engine did), decoded and applied."""
        assert self.publisher.flush(WAIT_S)
        last = self.publisher.stats.batches - 1
        new = []
        while self.last < last:
            assert self.sock.poll(int(WAIT_S * 1000)), f"batch {last} never arrived"
            message = self.sock.recv_multipart()
            assert self.last < 0 or self.seq(message) == self.last + 1, "a batch was lost on the way"
            self.last = self.seq(message)
            self.messages.append(message)
            new.append(message)
        batches = [formats.decode_batch(m[2]) for m in new]
        for batch in batches:
            for e in batch.events:
                group = self.held[e.group_idx or 0]
                if e.tag == formats.STORED:
                    group.update(e.block_hashes)
                elif e.tag == formats.REMOVED:
                    group.difference_update(e.block_hashes)
                else:
                    for held in self.held.values():
                        held.clear()
        return batches

    @staticmethod
    def seq(message: list[bytes]) -> int:
        return int.from_bytes(message[1], "big")

    def close(self) -> None:
        self.sock.close(linger=0)


@contextlib.contextmanager
def published(ctx, **options):
    publisher = KvEventPublisher(ctx.bus, LOOPBACK_ANY_PORT, replay_endpoint=LOOPBACK_ANY_PORT, **options)
    publisher.start()
    stream = Stream(publisher, publisher.topic)
    try:
        stream.join(ctx)
        yield publisher, stream
    finally:
        stream.close()
        publisher.close()


def events_of(batches: list[formats.WireBatch], tag: str) -> list[formats.WireEvent]:
    return [e for b in batches for e in b.events if e.tag == tag]


def decode(ctx, tokens: list[int], seq_id: int, start: int) -> None:
    assert ctx.decode(engine.Batch.for_sequence(tokens, seq_id, start)) == 0


PREFIX = list(range(1, 33))  # 32 tokens: two blocks of 16
TAIL_A, TAIL_B = [40 + i % 20 for i in range(20)], [3 + i % 17 for i in range(20)]


def test_a_shared_prefix_is_stored_once_and_a_removal_takes_only_its_own_blocks(model):
    ctx = engine.Context(model, n_ctx=256, n_seq_max=4, kv_unified=True)
    with published(ctx, block_size=16) as (publisher, stream):
        a, b = PREFIX + TAIL_A, PREFIX + TAIL_B
        both = engine.Batch(a + b, list(range(52)) * 2, [[0]] * 52 + [[1]] * 52)
        assert ctx.decode(both) == 0
        batches = stream.read()
        stored = events_of(batches, formats.STORED)
        shared, own_a, own_b = hash_chain(PREFIX, 16), hash_chain(a, 16)[2], hash_chain(b, 16)[2]
        assert [e.block_hashes for e in stored] == [(*shared, own_a), (own_b,)]
        assert stored[0].parent_hash is None and stored[0].token_ids == tuple(a[:48])
        assert stored[1].parent_hash == shared[1] and stored[1].token_ids == tuple(b[32:48])
        assert all(e.block_size == 16 and e.medium == "GPU" and e.lora_id is None and e.lora_name is None
                   for e in stored)
        assert publisher.chains.held() == {shared[0]: 2, shared[1]: 2, own_a: 1, own_b: 1}

        ctx.memory.seq_rm(1, -1, -1)
        removed = events_of(stream.read(), formats.REMOVED)
        assert [e.block_hashes for e in removed] == [(own_b,)]
        assert stream.held[0] == {*shared, own_a} == publisher.chains.recomputed()
        assert stream.held[0] == set(expected_blocks(ctx.memory, {0: a}, 16)[0])

        ctx.memory.clear()
        assert [e.tag for b in stream.read() for e in b.events] == [formats.CLEARED]
        assert stream.held[0] == set() == set(publisher.chains.held())


def test_a_prompt_copied_with_seq_cp_shares_its_blocks_until_the_last_holder_loses_them(model):
    ctx = engine.Context(model, n_ctx=256, n_seq_max=4, kv_unified=True)
    with published(ctx, block_size=16) as (publisher, stream):
        decode(ctx, PREFIX + [7, 8, 9, 10], 0, 0)
        stream.read()
        before = publisher.stats.batches
        ctx.memory.seq_cp(0, 1, -1, -1)
        stream.read()
        assert publisher.stats.batches == before  # a copy holds the same blocks: nothing new to store
        assert publisher.chains.held() == {h: 2 for h in hash_chain(PREFIX, 16)}

        own = [40 + i for i in range(16)]
        decode(ctx, own, 1, 36)
        tokens_1 = PREFIX + [7, 8, 9, 10] + own
        stored = events_of(stream.read(), formats.STORED)
        assert [e.block_hashes for e in stored] == [(hash_chain(tokens_1, 16)[2],)]
        assert stored[0].parent_hash == hash_chain(PREFIX, 16)[1]

        before = publisher.stats.batches
        ctx.memory.seq_rm(0, -1, -1)
        stream.read()
        assert publisher.stats.batches == before  # sequence 1 still holds every block sequence 0 held

        ctx.memory.seq_rm(1, 16, -1)
        removed = events_of(stream.read(), formats.REMOVED)
        chain = hash_chain(tokens_1, 16)
        assert [e.block_hashes for e in removed] == [(chain[2], chain[1])]  # deepest first
        assert stream.held[0] == {chain[0]} == publisher.chains.recomputed()


def test_moved_positions_are_other_blocks_and_the_stream_matches_the_cells(model):
    """A context shift (seq_rm, then seq_add of what follows): the blocks after the cut go, the moved tokens
    make new ones at their new positions; the K-shift of the next decode moves nothing more."""
    ctx = engine.Context(model, n_ctx=256, n_seq_max=2, kv_unified=True)
    tokens = [(7 * i) % 60 + 1 for i in range(64)]
    with published(ctx, block_size=16) as (publisher, stream):
        decode(ctx, tokens, 0, 0)
        stream.read()
        old = hash_chain(tokens, 16)
        assert stream.held[0] == set(old)

        ctx.memory.seq_rm(0, 16, 32)
        removed = events_of(stream.read(), formats.REMOVED)
        assert [set(e.block_hashes) for e in removed] == [set(old[1:])]

        ctx.memory.seq_add(0, 32, -1, -16)
        moved = tokens[:16] + tokens[32:]
        new = hash_chain(moved, 16)
        batches = stream.read()
        assert [e.block_hashes for e in events_of(batches, formats.STORED)] == [tuple(new[1:])]
        assert events_of(batches, formats.STORED)[0].parent_hash == old[0] == new[0]

        decode(ctx, [5], 0, 48)  # its update runs the K-shift: positions stay, so do the blocks
        stream.read()
        assert stream.held[0] == set(new) == publisher.chains.recomputed()
        assert stream.held[0] == set(expected_blocks(ctx.memory, {0: moved + [5]}, 16)[0])


def test_split_streams_and_generation_keep_the_stream_equal_to_the_cells(model):
    """Four sequences on split streams, a prompt copied across streams, many single-token steps."""
    ctx = engine.Context(model, n_ctx=512, n_seq_max=4, kv_unified=False)
    bs = 8
    rng = np.random.default_rng(0)
    tokens_of = {0: [int(t) for t in rng.integers(1, 60, 21)]}
    with published(ctx, block_size=bs) as (publisher, stream):
        decode(ctx, tokens_of[0], 0, 0)
        ctx.memory.seq_cp(0, 2, -1, -1)  # across streams: stream 2 becomes a copy of stream 0
        tokens_of[2] = list(tokens_of[0])
        tokens_of[1] = tokens_of[0][:16] + [59, 58, 57]
        decode(ctx, tokens_of[1], 1, 0)
        for step in range(30):
            for s in (0, 1, 2):
                t = int(rng.integers(1, 60))
                decode(ctx, [t], s, len(tokens_of[s]))
                tokens_of[s].append(t)
        ctx.memory.seq_rm(1, 20, -1)
        stream.read()
        expected = expected_blocks(ctx.memory, tokens_of, bs)
        assert stream.held[0] == {h for chain in expected.values() for h in chain} == publisher.chains.recomputed()
        assert publisher.chains.sequence_blocks(0, stream=0) == expected[0]
        assert publisher.chains.sequence_blocks(2, stream=2) == expected[2]
        # the same prefix in two streams is one block, as vLLM's prefix cache holds it once
        assert publisher.chains.held()[expected[0][0]] == 3


def test_a_position_held_twice_ends_the_chain_before_it(model):
    """seq_add can move cells onto positions the sequence still holds: attention then sees both, and the
    block is no one content; the chain stops there (and resumes once the position is held once)."""
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    tokens = list(range(1, 13))
    with published(ctx, block_size=4) as (publisher, stream):
        decode(ctx, tokens, 0, 0)
        stream.read()
        ctx.memory.seq_add(0, 8, -1, -4)  # 8..11 onto 4..7, which 4..7 still hold
        removed = events_of(stream.read(), formats.REMOVED)
        chain = hash_chain(tokens, 4)
        assert [e.block_hashes for e in removed] == [(chain[2], chain[1])]
        assert stream.held[0] == {chain[0]} == publisher.chains.recomputed()
        ctx.memory.seq_rm(0, 4, 8)  # both copies of 4..7 go: block 0 alone is what remains
        ctx.memory.seq_rm(0, 8, -1)
        decode(ctx, tokens[8:12], 0, 4)
        stored = events_of(stream.read(), formats.STORED)
        assert [e.block_hashes for e in stored] == [(hash_chain(tokens[:4] + tokens[8:], 4)[1],)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_stream_equal_to_the_cells(model, seed):
    """Decodes, seq_rm of any range, seq_cp, context shifts, seq_keep and clears in a random order: after each,
    the blocks the stream leaves held are those of the engine's cells, counted afresh."""
    rng = np.random.default_rng(seed)
    ctx = engine.Context(model, n_ctx=256, n_seq_max=4, kv_unified=True)
    tokens_of: dict[int, dict[int, int]] = {s: {} for s in range(4)}  # position -> token, as the test placed them
    ops, most = defaultdict(int), 0
    with published(ctx, block_size=4) as (publisher, stream):
        for _ in range(80):
            s = int(rng.integers(0, 4))
            held = tokens_of[s]
            op = rng.choice(["decode", "decode", "decode", "rm", "cp", "shift", "keep", "clear"],
                            p=[.2, .2, .2, .12, .12, .1, .03, .03])
            if op == "decode" and ctx.memory.cells(0).count((-1, frozenset(), 0)) > 40:
                start = max(held, default=-1) + 1
                new = [int(t) for t in rng.integers(1, 60, int(rng.integers(1, 11)))]
                decode(ctx, new, s, start)
                held.update({start + i: t for i, t in enumerate(new)})
            elif op == "rm" and held:
                p0 = int(rng.integers(0, max(held) + 1))
                p1 = int(rng.integers(p0 + 1, max(held) + 2)) if rng.random() < .7 else -1
                ctx.memory.seq_rm(s, p0, p1)
                for p in [p for p in held if p >= p0 and (p1 < 0 or p < p1)]:
                    del held[p]
            elif op == "cp" and held:
                dst = (s + 1 + int(rng.integers(0, 3))) % 4
                ctx.memory.seq_rm(dst, -1, -1)  # seq_cp refuses a destination that shares the range already
                ctx.memory.seq_cp(s, dst, -1, -1)
                tokens_of[dst] = dict(held)
            elif op == "shift" and len(held) > 8:
                keep, top = int(rng.integers(0, 4)), max(held) + 1
                discard = int(rng.integers(1, max(2, (top - keep) // 2)))
                # a cell has one position: the cells of s that move move for every sequence sharing them
                moved = [(pos, seqs) for pos, seqs, _ in ctx.memory.cells(0) if s in seqs and pos >= keep + discard]
                if any(pos - discard in tokens_of[k] and pos - discard not in {q for q, o in moved if k in o}
                       for pos, seqs in moved for k in seqs - {s}):
                    continue  # another sequence would hold a position twice (test_a_position_held_twice_...)
                ctx.memory.seq_rm(s, keep, keep + discard)
                for p in [p for p in held if keep <= p < keep + discard]:
                    del held[p]
                ctx.memory.seq_add(s, keep + discard, -1, -discard)
                for k in {k for _, seqs in moved for k in seqs}:
                    gone = {pos for pos, seqs in moved if k in seqs}
                    tokens_of[k] = {**{p: t for p, t in tokens_of[k].items() if p not in gone},
                                    **{p - discard: tokens_of[k][p] for p in gone}}
            elif op == "keep":
                ctx.memory.seq_keep(s)
                tokens_of = {k: (v if k == s else {}) for k, v in tokens_of.items()}
            elif op == "clear":
                ctx.memory.clear()
                tokens_of = {k: {} for k in tokens_of}
            else:
                continue
            ops[str(op)] += 1
            stream.read()
            expected = expected_blocks(ctx.memory, tokens_of, 4)
            assert stream.held[0] == {h for chain in expected.values() for h in chain}, (ops, op)
            assert stream.held[0] == publisher.chains.recomputed() == set(publisher.chains.held())
            for seq_id, chain in expected.items():
                assert publisher.chains.sequence_blocks(seq_id) == chain
            most = max(most, len(stream.held[0]))
    assert len(ops) == 6 and most >= 10, (ops, most)  # every kind of operation ran, on a cache that held blocks


def test_a_new_context_on_the_bus_clears_every_block(model):
    """A session's rebuild or load_model: the old cache is gone, whatever it held."""
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    with published(ctx, block_size=4) as (publisher, stream):
        decode(ctx, list(range(1, 13)), 0, 0)
        stream.read()
        assert len(stream.held[0]) == 3
        engine.Context(model, n_ctx=64, n_seq_max=1, bus=ctx.bus)
        assert [e.tag for b in stream.read() for e in b.events] == [formats.CLEARED]
        assert not publisher.chains.held()


def test_lost_engine_events_clear_every_block_and_nothing_is_invented_after(model):
    """A subscription that overflowed cannot say which cells changed: the mapping clears, forgets every token,
    and publishes only what later events show; a clear makes it exact again."""
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True, n_ubatch=4)
    recorded = ctx.bus.subscribe()
    first, second, again = list(range(1, 17)), list(range(20, 36)), list(range(40, 52))
    decode(ctx, first, 0, 0)
    decode(ctx, second, 1, 0)
    ctx.memory.seq_rm(1, -1, -1)
    decode(ctx, again, 1, 0)
    events = recorded.drain()
    cut = next(i for i, e in enumerate(events) if isinstance(e, ev.CellsAllocated) and not e.tentative
               and 1 in e.changes[0].seq_sets()[0])  # the first cells of the second prompt
    complete, lossy = BlockChains(4), BlockChains(4)
    for e in events:
        complete.apply(e)
    assert set(complete.held()) == set(hash_chain(first, 4) + hash_chain(again, 4))
    for e in events[:cut]:
        lossy.apply(e)
    assert [w.tag for w in lossy.apply(ev.EventsDropped(1, events[cut].seq_no, events[cut].seq_no))] == [
        formats.CLEARED]
    for e in events[cut + 1:]:
        lossy.apply(e)
    # the first prompt's tokens are forgotten; the last one's cells were all placed after the loss
    assert set(lossy.held()) == set(hash_chain(again, 4)) == lossy.recomputed()
    assert lossy.stats.lost_events == 1
    ctx.memory.clear()
    decode(ctx, first, 0, 0)
    for e in recorded.drain():
        complete.apply(e)
        lossy.apply(e)
    assert lossy.held() == complete.held() == {h: 1 for h in hash_chain(first, 4)}


def test_the_sliding_window_cache_is_group_1_of_the_map_dialect(swa_model):
    ctx = engine.Context(swa_model, n_ctx=64, pad=8, n_seq_max=1, kv_unified=True, n_ubatch=8)
    assert ctx.memory.swa.size < ctx.memory.base.size  # the window's cells get reused: blocks leave group 1
    tokens = list(range(1, 21))
    with published(ctx, block_size=4) as (publisher, stream):
        decode(ctx, tokens, 0, 0)
        for i in range(6):
            decode(ctx, [30 + i], 0, 20 + i)
            tokens.append(30 + i)
        batches = stream.read()
        chain = hash_chain(tokens, 4)
        assert stream.held[0] == set(chain)
        in_window = {p for p, seqs, _ in ctx.memory.swa.cells(0) if 0 in seqs}
        window_blocks = {chain[b] for b in range(len(chain)) if set(range(4 * b, 4 * b + 4)) <= in_window}
        assert stream.held[1] == window_blocks == publisher.chains.recomputed(1)
        assert window_blocks < set(chain)
        stored = events_of(batches, formats.STORED)
        assert {(e.group_idx, e.group_kind, e.sliding_window) for e in stored} == {
            (0, "full_attention", None), (1, "sliding_window", 8)}
        left = {h for e in events_of(batches, formats.REMOVED) for h in e.block_hashes}
        assert left == set(chain) - window_blocks
        assert all(e.group_idx == 1 for e in events_of(batches, formats.REMOVED))


def test_array_layouts_send_the_full_attention_cache_only(swa_model):
    """Their events have no group: the sliding-window cache's removals would read as the full cache's."""
    ctx = engine.Context(swa_model, n_ctx=64, pad=8, n_seq_max=1, kv_unified=True, n_ubatch=8)
    tokens = list(range(1, 27))
    with published(ctx, block_size=4, dialect="array-v3") as (publisher, stream):
        decode(ctx, tokens, 0, 0)
        batches = stream.read()
        assert not events_of(batches, formats.REMOVED)
        assert [h for e in events_of(batches, formats.STORED) for h in e.block_hashes] == hash_chain(tokens, 4)
        assert publisher.chains.groups == [0]


@pytest.mark.parametrize("dialect", formats.DIALECTS)
def test_every_dialect_decodes_as_the_layout_it_is(model, dialect):
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    tokens = list(range(1, 21))
    with published(ctx, block_size=4, dialect=dialect, rank=3, topic="kv-events") as (publisher, stream):
        decode(ctx, tokens, 0, 0)
        ctx.memory.seq_rm(0, 8, -1)
        batches = stream.read()
        assert all(m[0] == b"kv-events" for m in stream.messages)
        assert [Stream.seq(m) for m in stream.messages] == list(range(stream.seq(stream.messages[0]),
                                                                       publisher.stats.batches))
        assert {b.dialect for b in batches} == {dialect}
        assert {b.rank for b in batches} == {None if dialect == "array-v1" else 3}
        assert all(abs(b.ts - time.time()) < 60 for b in batches)
        full = hash_chain(tokens, 4)
        # integer layouts carry each hash's low 64 bits, as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES sends them
        wire = full if dialect in ("array-v3", "map") else [h[-8:] for h in full]
        stored, removed = events_of(batches, formats.STORED), events_of(batches, formats.REMOVED)
        assert [h for e in stored for h in e.block_hashes] == wire
        assert [h for e in removed for h in e.block_hashes] == wire[:1:-1]
        assert stored[0].token_ids == tuple(tokens)
        assert removed[0].medium == (None if dialect == "array-v1" else "GPU")


def replay(replay_endpoint: str, request: list[bytes], timeout_s: float = WAIT_S) -> list[list[bytes]]:
    """Send one request from a DEALER; the replies up to the end marker ([] when none came in time)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart(request)
        replies = []
        while sock.poll(int(timeout_s * 1000)):
            frames = sock.recv_multipart()
            replies.append(frames)
            if frames[1] == END_SEQ:
                return replies
        return []
    finally:
        sock.close(linger=0)


def test_replay_sends_every_buffered_batch_from_the_start_asked_then_the_end_marker(model):
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    with published(ctx, block_size=4, buffer_steps=5) as (publisher, stream):
        for i in range(4):
            decode(ctx, [1 + i, 2, 3, 4], i % 2, 4 * (i // 2))
        ctx.memory.seq_rm(0, -1, -1)
        stream.read()
        sent = {Stream.seq(m): m[2] for m in stream.messages}
        total = publisher.stats.batches
        assert total >= 6  # the join's clears, the four decodes, the removal
        replies = replay(publisher.replay_endpoint, [b"", (0).to_bytes(8, "big")])
        assert replies[-1] == [b"", END_SEQ, b""]
        seqs = [int.from_bytes(r[1], "big") for r in replies[:-1]]
        assert seqs == list(range(total - 5, total))  # only buffer_steps are kept
        assert all(r[0] == b"" and r[2] == sent[s] for r, s in zip(replies, seqs))
        middle = replay(publisher.replay_endpoint, [b"", (total - 2).to_bytes(8, "big")])
        assert [int.from_bytes(r[1], "big") for r in middle[:-1]] == [total - 2, total - 1]
        late = replay(publisher.replay_endpoint, [b"", (total + 10).to_bytes(8, "big")])
        assert late == [[b"", END_SEQ, b""]]
        assert publisher.stats.replay_requests == 3


def test_what_is_not_a_replay_request_is_ignored_and_the_publisher_goes_on(model, caplog):
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    with published(ctx, block_size=4) as (publisher, stream), caplog.at_level(logging.DEBUG, "kvscope.kv_events"):
        bad = [[b"", b"\x00" * 7], [b"x", b"\x00" * 8], [b"", b"\x00" * 8, b"more"], [b"\x00" * 8]]
        for request in bad:
            assert replay(publisher.replay_endpoint, request, timeout_s=0.3) == []
        assert publisher.stats.refused_requests == len(bad)
        assert "ignored a replay request" in caplog.text
        # more than a request can be: ZeroMQ disconnects the sender before anything is read
        big = zmq.Context.instance().socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(publisher.replay_endpoint)
        big.send_multipart([b"", b"\x00" * 4096])
        assert not big.poll(300)
        big.close(linger=0)
        assert publisher.stats.refused_requests == len(bad)

        decode(ctx, list(range(1, 9)), 0, 0)
        stored = events_of(stream.read(), formats.STORED)
        assert [h for e in stored for h in e.block_hashes] == hash_chain(list(range(1, 9)), 4)
        good = replay(publisher.replay_endpoint, [b"", (0).to_bytes(8, "big")])
        assert good[-1] == [b"", END_SEQ, b""] and len(good) == publisher.stats.batches + 1
        assert publisher.publishing


def test_only_the_requester_gets_the_replay(model):
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    with published(ctx, block_size=4) as (publisher, _stream):
        bystander = zmq.Context.instance().socket(zmq.DEALER)
        bystander.setsockopt(zmq.LINGER, 0)
        bystander.connect(publisher.replay_endpoint)
        try:
            assert replay(publisher.replay_endpoint, [b"", (0).to_bytes(8, "big")])
            assert not bystander.poll(200)
        finally:
            bystander.close(linger=0)


def test_listening_beyond_this_machine_warns_that_the_token_ids_are_open(model, caplog):
    bus = engine.EventBus()
    with caplog.at_level(logging.WARNING, "kvscope"):
        KvEventPublisher(bus, LOOPBACK_ANY_PORT).close()
        assert "token ids" not in caplog.text
        publisher = KvEventPublisher(bus, "tcp://*:*")
        publisher.close()
    assert re.search(r"tcp://0\.0\.0\.0:\d+ carries every prompt's token ids, unauthenticated", caplog.text)


@pytest.mark.parametrize("options, message", [
    (dict(endpoint="tcp://127.0.0.1"), "takes an endpoint tcp://HOST:PORT"),
    (dict(endpoint="ipc:///tmp/x"), "takes an endpoint tcp://HOST:PORT"),
    (dict(endpoint="tcp://127.0.0.1:70000"), "takes an endpoint tcp://HOST:PORT"),
    (dict(replay_endpoint="tcp://:5"), "--kv-events-replay takes an endpoint"),
    (dict(block_size=0), "--block-size takes the tokens of a block, 1 or more"),
    (dict(dialect="array-v4"), "--kv-events-dialect must be one of array-v1, array-v2, array-v3, map"),
    (dict(buffer_steps=0), "buffer_steps must be 1 or more"),
    (dict(rank=-1), "data_parallel_rank"),
])
def test_bad_options_are_named(options, message):
    options = {"endpoint": LOOPBACK_ANY_PORT, **options}
    with pytest.raises(KvscopeError, match=re.escape(message)):
        KvEventPublisher(engine.EventBus(), **options)


def test_a_taken_port_is_named():
    first = KvEventPublisher(engine.EventBus(), LOOPBACK_ANY_PORT)
    try:
        with pytest.raises(KvscopeError, match="--kv-events: cannot listen on"):
            KvEventPublisher(engine.EventBus(), first.endpoint)
    finally:
        first.close()


def test_endpoints_accept_a_wildcard_host_and_port():
    assert check_endpoint("tcp://*:5557") == ("*", "5557")
    assert check_endpoint("tcp://[::1]:*") == ("[::1]", "*")


def test_closing_joins_its_threads_and_frees_the_ports(model):
    ctx = engine.Context(model, n_ctx=128, n_seq_max=2, kv_unified=True)
    publisher = KvEventPublisher(ctx.bus, LOOPBACK_ANY_PORT, replay_endpoint=LOOPBACK_ANY_PORT, block_size=4)
    publisher.start()
    decode(ctx, list(range(1, 9)), 0, 0)
    threads = list(publisher._threads)
    endpoint, replay_endpoint = publisher.endpoint, publisher.replay_endpoint
    publisher.close()
    assert not any(t.is_alive() for t in threads) and not ctx.bus.active
    assert (publisher.stats.batches, publisher.stats.blocks_stored) == (1, 2)  # what the engine did went out
    again = KvEventPublisher(ctx.bus, endpoint, replay_endpoint=replay_endpoint)  # the ports are free again
    again.close()


# ---- kvscope serve --kv-events ----------------------------------------------------------------------------
SERVE_FLAGS = ["-c", "256", "--pad", "32", "-np", "2", "-kvu", "-ctk", "f32", "-ctv", "f32", "--workload", "idle"]


def test_serve_publishes_kv_events_and_stops_on_sigterm(tmp_path):
    port = free_port_pair("127.0.0.1", set())
    prompt = "Once upon a time there was a little cat who liked to sit in the sun all day long"
    argv = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), *SERVE_FLAGS, "-p", prompt,
            "--kv-events", LOOPBACK_ANY_PORT, "--kv-events-replay", LOOPBACK_ANY_PORT, "--block-size", "4",
            "--kv-events-topic", "kv"]
    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in out.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        line = re.search(r"KV events \(vLLM's, map layout, blocks of 4 tokens, topic 'kv'\) on (tcp://\S+), "
                         r"replay on (tcp://\S+), no token", out.read_text())
        assert line, out.read_text()
        stored = []
        while not stored:  # the prompt was decoded before the banner; its batches may still be on their way
            replies = replay(line[2], [b"", (0).to_bytes(8, "big")])
            stored = [e for r in replies[:-1] for e in formats.decode_batch(r[2]).events if e.tag == formats.STORED]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert {e.group_idx for e in stored} == {0, 1}  # the demo model is an iSWA pair
        assert all(e.block_size == 4 and len(e.token_ids) == 4 * len(e.block_hashes) for e in stored)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, err.read_text()
        assert re.search(r"stopped \(SIGTERM\) after .* [1-9]\d* KV event batches published", err.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "8"], "--block-size only with --kv-events ENDPOINT"),
    (["--kv-events", "tcp://127.0.0.1:*", "--block-size", "0"], "--block-size takes the tokens of a block"),
    (["--kv-events", "udp://x:1"], "--kv-events takes an endpoint tcp://HOST:PORT"),
])
def test_serve_refuses_bad_kv_event_flags_before_loading(flags, message, capsys, monkeypatch):
    from engine import cli
    from engine.runners import serve

    def no_server(*_args, **_kwargs):
        raise AssertionError("a port was taken before the flags were checked")

    monkeypatch.setattr(serve, "SessionServer", no_server)
    assert cli.main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err
