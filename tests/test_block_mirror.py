"""BlockMirror: vLLM / SGLang workers' hashed blocks rebuilt from block events, and rebuilt again from its own
state (a keyframe), from encoded events (a recording or a remote stream) and through a CacheMirror."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from engine import events as ev
from engine.watch.block_mirror import EVICTION_LOG, BlockMirror
from engine.watch.codec import decode_event, encode_event
from engine.watch.mirror import CacheMirror

BS = 4


def chain(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
    """Hashes of the full blocks of `tokens`, chained as vLLM chains them."""
    out = []
    for k in range(len(tokens) // BS):
        parent = hashlib.sha256((parent or b"seed") + np.array(tokens[k * BS:(k + 1) * BS], dtype=np.int64).tobytes()).digest()
        out.append(parent)
    return out


def stored(worker: int, tokens: list[int], parent: bytes | None = None, *, skip: int = 0, ts: float = 1.0,
           medium: str = ev.MEDIUM_GPU, group: int = 0, seq_no: int = 0) -> ev.BlocksStored:
    """The BlocksStored of the blocks of `tokens` after the first `skip` (whose last is the parent)."""
    hashes = chain(tokens)
    parent = hashes[skip - 1] if skip else parent
    event = ev.BlocksStored(worker, tuple(hashes[skip:]), parent, np.array(tokens[skip * BS:len(hashes) * BS]),
                            BS, medium=medium, group=group, ts=ts)
    object.__setattr__(event, "seq_no", seq_no)
    return event


SYSTEM = list(range(100, 112))  # 3 blocks
CONVERSATION_A = SYSTEM + list(range(1, 9))  # 5 blocks
CONVERSATION_B = SYSTEM + list(range(50, 54))  # 4 blocks


def two_workers() -> BlockMirror:
    mirror = BlockMirror()
    mirror.apply_all([
        ev.KvWorkerSeen(0, "tcp://a:5557", 0, "worker 0 (rank 0 at a:5557)"),
        ev.KvWorkerSeen(1, "tcp://a:5558", 1, "worker 1 (rank 1 at a:5558)"),
        stored(0, CONVERSATION_A, ts=10.0, seq_no=2),
        stored(1, SYSTEM, ts=11.0, seq_no=3),
        stored(1, CONVERSATION_B, skip=3, ts=12.0, seq_no=4),
    ])
    return mirror


def test_blocks_chain_into_a_prefix_tree_per_worker():
    mirror = two_workers()
    assert mirror.workers() == [0, 1]
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    assert set(mirror.blocks(0)) == set(a) and set(mirror.blocks(1)) == set(b)
    block = mirror.blocks(0)[a[4]]
    assert block.parent == a[3] and block.depth == 4 and block.root == a[0]
    assert list(block.token_ids) == CONVERSATION_A[16:20] and block.stored_ts == 10.0
    # worker 1 stored its conversation apart from its system prompt: the chain still runs through the parent
    assert mirror.blocks(1)[b[3]].depth == 3 and mirror.blocks(1)[b[3]].root == b[0] == a[0]
    roots = mirror.tree(0)
    assert len(roots) == 1 and roots[0].hash == a[0] and roots[0].n_blocks == 5
    assert [n.hash for _, n in roots[0].walk()] == a


def test_shared_and_exclusive_prefixes_are_what_a_router_sees():
    mirror = two_workers()
    (share,) = mirror.shared_prefixes()
    assert share.root == chain(SYSTEM)[0] and share.workers == (0, 1)
    assert share.deepest[0].depth == 4 and share.deepest[1].depth == 3
    # the system prompt's 3 blocks are on both; beyond it each worker holds its own conversation
    assert mirror.exclusive_blocks(0) == {chain(SYSTEM)[0]: 2}
    assert mirror.exclusive_blocks(1) == {chain(SYSTEM)[0]: 1}


def test_removal_logs_evictions_and_a_late_child_keeps_its_chain():
    mirror = two_workers()
    a = chain(CONVERSATION_A)
    mirror.apply(ev.BlocksRemoved(0, (a[4], a[3]), ts=20.0))
    assert set(mirror.blocks(0)) == set(a[:3])
    assert [(e.block.hash, e.evicted_ts) for e in mirror.evictions] == [(a[4], 20.0), (a[3], 20.0)]
    assert mirror.last_eviction(0, a[3]).block.depth == 3
    # a removal of a block never stored (joined late, a lost batch) is counted, not an error
    mirror.apply(ev.BlocksRemoved(0, (b"\x00" * 8,), ts=21.0))
    assert mirror.counts[0].unknown_removals == 1 and mirror.counts[0].evicted == 2
    # the evicted block's chain is still known through the eviction log: a child stored again finds its depth
    mirror.apply(stored(0, CONVERSATION_A, skip=4, ts=22.0))
    assert mirror.blocks(0)[a[4]].depth == 4


def test_media_and_groups_are_held_apart():
    mirror = two_workers()
    a = chain(CONVERSATION_A)
    mirror.apply(stored(0, CONVERSATION_A, medium="CPU", ts=13.0))
    mirror.apply(ev.BlocksStored(0, (a[0],), None, np.array(SYSTEM[:4]), BS, group=1, group_kind="sliding_window",
                                 sliding_window=128, ts=14.0))
    assert mirror.tiers(0) == [("GPU", 0), ("GPU", 1), ("CPU", 0)]
    assert mirror.held(0, "CPU") == 5 and mirror.held(0, group=1) == 1 and mirror.held(0) == 11
    assert mirror.group_kind(0, 1) == ("sliding_window", 128)
    mirror.apply(ev.BlocksRemoved(0, (a[0],), medium="CPU", ts=15.0))
    assert a[0] in mirror.blocks(0, "GPU", 0) and a[0] not in mirror.blocks(0, "CPU")


def test_clear_and_restart_empty_a_worker_only():
    mirror = two_workers()
    mirror.apply(ev.BlocksCleared(1, ts=30.0, cause="publisher restarted"))
    assert mirror.held(1) == 0 and mirror.held(0) == 5
    assert mirror.evictions[-1].cause == "publisher restarted" and mirror.counts[1].evicted == 4


def rebuilt(mirror: BlockMirror) -> BlockMirror:
    fresh = BlockMirror()
    fresh.apply_all([decode_event(encode_event(e)) for e in mirror.state_events()])
    return fresh


def test_state_events_rebuild_an_equal_mirror_through_the_codec():
    mirror = two_workers()
    a = chain(CONVERSATION_A)
    mirror.apply_all([ev.BlocksRemoved(0, (a[4],), ts=20.0), stored(1, CONVERSATION_A, medium="CPU", ts=21.0),
                      ev.BlocksRemoved(1, (a[0],), medium="CPU", ts=22.0), ev.BlocksRemoved(0, (a[3],), ts=23.0)])
    copy = rebuilt(mirror)
    assert copy.same_as(mirror), copy.differences(mirror)
    # and it goes on the same way: the next events give equal mirrors again
    more = [stored(0, CONVERSATION_A, skip=3, ts=24.0), ev.BlocksRemoved(1, tuple(chain(CONVERSATION_B)), ts=25.0)]
    mirror.apply_all(more)
    copy.apply_all(more)
    assert copy.same_as(mirror), copy.differences(mirror)


def test_a_full_eviction_log_keeps_the_newest_and_rebuilds():
    mirror = BlockMirror()
    tokens = list(range(4 * (EVICTION_LOG + 10)))
    mirror.apply(stored(0, tokens, ts=1.0))
    hashes = chain(tokens)
    mirror.apply(ev.BlocksRemoved(0, tuple(hashes), ts=2.0))
    assert len(mirror.evictions) == EVICTION_LOG and mirror.evictions[-1].block.hash == hashes[-1]
    assert rebuilt(mirror).same_as(mirror)


def test_a_cache_mirror_carries_blocks_in_its_state_and_snapshot():
    cells = CacheMirror()
    cells.apply_all([ev.KvWorkerSeen(0, "tcp://a:5557"), stored(0, CONVERSATION_A)])
    assert cells.blocks.held(0) == 5
    again = CacheMirror()
    again.apply_all(cells.state_events())
    assert again.same_as(cells) and again.blocks.held(0) == 5
    cells.apply(ev.BlocksCleared(0))
    assert not again.same_as(cells)


@pytest.mark.parametrize("n_blocks", [100_000])
def test_a_hundred_thousand_blocks(n_blocks):
    mirror = BlockMirror()
    hashes = tuple(i.to_bytes(8, "big") for i in range(1, n_blocks + 1))
    # 1000 conversations of 100 blocks each, every chain starting at its own first block
    events = []
    for c in range(1000):
        part = hashes[c * 100:(c + 1) * 100]
        events.append(ev.BlocksStored(c % 4, part, None, np.arange(100 * BS), BS, ts=float(c)))
    mirror.apply_all(events)
    assert sum(mirror.held(w) for w in mirror.workers()) == n_blocks
    roots = mirror.tree(0)
    assert len(roots) == 250 and all(r.n_blocks == 100 for r in roots)
    assert max(d for d, _ in roots[0].walk()) == 99
    assert rebuilt(mirror).same_as(mirror)


def test_a_recording_rebuilds_the_mirror_at_every_event(tmp_path):
    """Keyframes hold the blocks (CacheMirror.state_events carries them), so a reader seeking anywhere, from a
    keyframe or from the start, gets the mirror the live one was after that event."""
    from engine.watch.recording import Recorder, RecordingReader

    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    events = [ev.KvWorkerSeen(0, "tcp://a:5557", 0), ev.KvWorkerSeen(1, "tcp://a:5558", 1),
              stored(0, CONVERSATION_A, ts=1.0), stored(1, CONVERSATION_B, ts=2.0),
              ev.BlocksRemoved(0, (a[4], a[3]), ts=3.0), stored(0, CONVERSATION_A, skip=3, ts=4.0, medium="CPU"),
              ev.BlocksCleared(1, ts=5.0), stored(1, CONVERSATION_B, skip=2, ts=6.0),
              ev.BlocksRemoved(1, (b[3],), ts=7.0)]
    bus = ev.EventBus()
    live, path = [], tmp_path / "blocks.kvtrace"
    with Recorder(path, keyframe_every=3) as recorder:
        recorder.attach(bus)
        mirror = CacheMirror()
        for event in events:
            bus.publish(event)
            mirror.apply(event)
            live.append(mirror.blocks.snapshot())
        recorder.pump()
    with RecordingReader(path) as reader:
        assert len(reader) == len(events) and len(reader.keyframes) >= 3
        for i, expected in enumerate(live):
            for from_keyframe in (True, False):
                rebuilt_blocks = reader.mirror_at(i, from_keyframe=from_keyframe).blocks.snapshot()
                assert rebuilt_blocks == expected, (i, from_keyframe)


def test_blocks_import_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import engine.watch.block_mirror, engine.watch.kv_events.formats, engine.watch.block_mirror\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_blocks_whose_parent_is_not_held_hang_under_a_node_for_it():
    """Joined late: the worker holds the end of a chain whose start it stored before kvscope listened."""
    mirror = BlockMirror()
    mirror.apply(stored(0, CONVERSATION_A, skip=3))
    mirror.apply(stored(0, CONVERSATION_B, skip=3))
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    (root,) = mirror.tree(0)
    assert root.block is None and root.hash == a[2] and root.n_blocks == 3
    assert sorted(c.hash for c in root.children) == sorted([a[3], b[3]])
    assert mirror.blocks(0)[a[4]].depth == -1 and mirror.blocks(0)[a[4]].root == a[2]


def test_branch_heads_split_a_shared_prompt_from_each_conversation():
    """Lanes colour by branch: a system prompt every conversation shares is one branch, each conversation below
    it another, the same on every worker; a chain with no branching is one branch whatever its length."""
    mirror = two_workers()
    a, b, s = chain(CONVERSATION_A), chain(CONVERSATION_B), chain(SYSTEM)
    heads = mirror.branch_heads()
    assert [heads[h] for h in s] == [s[0]] * 3
    assert [heads[h] for h in a[3:]] == [a[3], a[3]] and heads[b[3]] == b[3]
    assert mirror.branch_heads() is heads  # nothing new: not worked out again
    # joined late: children of a parent nobody holds head their own branches
    late = BlockMirror()
    late.apply_all([stored(0, CONVERSATION_A, skip=3), stored(0, CONVERSATION_B, skip=3)])
    assert late.branch_heads() == {a[3]: a[3], a[4]: a[3], b[3]: b[3]}
