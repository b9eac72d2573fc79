"""The block views' visual language (engine/watch/block_views.py), shared by the terminal and the notebook: the
colour of a prefix, the text of tokens, the inspector's sentence, the lanes of glyphs (their order, capacity and
folding), the worker summary, the prefix tree, the router's view and the eviction log; built from synthetic block
events as tests/test_block_mirror.py builds its mirrors."""
from __future__ import annotations

import datetime

import numpy as np
import pytest

from engine import events as ev
from engine.watch import block_views as bv
from engine.watch import style
from engine.watch.block_mirror import BlockMirror
from engine.watch.kv_events.formats import hash_text
from tests.test_block_mirror import (
    BS,
    CONVERSATION_A,
    CONVERSATION_B,
    SYSTEM,
    chain,
    stored,
)

T0 = 1_700_000_000.0  # a publisher's wall clock
WORDS = {100: "You", 101: " are", 102: " a", 103: " helpful", 104: " assistant", 105: ".", 106: " Answer",
         107: " briefly", 108: ":", 109: "\n", 110: " Q", 111: ":", 1: " the", 2: " LORD", 3: " said", 4: " unto",
         5: " Moses", 6: ",", 7: " saying", 8: ".", 50: " def", 51: " f", 52: "(", 53: "):"}
VOCAB = ev.Vocabulary("test-model", tuple(WORDS.get(i, f"<{i}>") for i in range(200)))


def clock(ts: float) -> str:
    """Local time to a tenth of a second, worked out apart from the module."""
    tenths = round(ts * 10)
    return datetime.datetime.fromtimestamp(tenths // 10).strftime("%H:%M:%S") + f".{tenths % 10}"


def deployment() -> BlockMirror:
    """Two workers sharing a 3-block system prompt, each with its own conversation after it; worker 0 offloads
    its conversation to CPU and holds a sliding-window group; worker 0 evicts the last block of its GPU copy."""
    mirror = BlockMirror()
    a = chain(CONVERSATION_A)
    mirror.apply_all([
        ev.KvWorkerSeen(0, "tcp://h:5557", 0, "worker 0 (rank 0 at h:5557)", capacity_blocks=8),
        ev.KvWorkerSeen(1, "tcp://h:5558", 1, "worker 1 (rank 1 at h:5558)", capacity_blocks=8),
        stored(0, CONVERSATION_A, ts=T0 + 1.04),
        stored(1, SYSTEM, ts=T0 + 2.0),
        stored(1, CONVERSATION_B, skip=3, ts=T0 + 3.0),
        stored(0, CONVERSATION_A, medium="CPU", ts=T0 + 4.0),
        ev.BlocksStored(0, (a[0],), None, np.array(SYSTEM[:BS]), BS, group=1, group_kind="sliding_window",
                        sliding_window=128, ts=T0 + 4.5),
        ev.BlocksRemoved(0, (a[4],), ts=T0 + 5.0),
    ])
    return mirror


# ---- colours and words ------------------------------------------------------------------------------------
def test_a_prefix_has_one_colour_of_the_palette_everywhere_and_prefixes_spread_over_it():
    mirror = deployment()
    root = chain(SYSTEM)[0]
    # the same prefix on both workers (and in a mirror rebuilt apart) has the same colour
    assert {b.root for w in (0, 1) for b in mirror.blocks(w).values()} == {root}
    colour = bv.prefix_color(root)
    assert colour in style.PALETTE and bv.prefix_color(bytes(root)) == colour
    assert bv.prefix_color(root, dark=False) == style.PALETTE_ON_LIGHT[style.PALETTE.index(colour)]
    # small integer hashes (SGLang's, vLLM's 64-bit option) still spread over the palette
    colours = {bv.prefix_color(i.to_bytes(8, "big")) for i in range(1, 200)}
    assert len(colours) >= 10
    assert bv.prefix_color(None) == style.EMPTY_COLOR


def test_tokens_read_as_text_with_a_vocabulary_and_as_ids_without():
    assert bv.tokens_text([100, 101, 102, 103], VOCAB) == "You are a helpful"
    assert bv.tokens_text([108, 109, 110], VOCAB) == ":⏎ Q"  # a newline must not break a view's line
    long = bv.tokens_text(list(range(100, 112)) * 3, VOCAB, max_chars=20)
    assert len(long) == 20 and long.endswith("…") and long.startswith("You are a helpful")
    assert bv.tokens_text([199, 250], VOCAB) == "<199>[250]"  # an id past the vocabulary is shown, not an error
    assert bv.tokens_text([12, 7, 99]) == "ids 12 7 99"
    assert bv.tokens_text(range(10)) == "ids 0 1 2 3 4 5 …"
    assert bv.tokens_text([]) == "no tokens"


def test_a_prefix_is_named_by_its_first_tokens_else_by_its_hash():
    mirror = deployment()
    root = chain(SYSTEM)[0]
    assert bv.prefix_name(mirror, root, VOCAB) == "'You are a helpful'"
    assert bv.prefix_name(mirror, root) == hash_text(root) == "0x" + root.hex()[:4]
    # a chain whose start the mirror never saw is named by the hash of that start
    orphan = BlockMirror()
    orphan.apply(stored(0, CONVERSATION_A, skip=2, ts=T0))
    start = chain(CONVERSATION_A)[1]
    assert bv.prefix_name(orphan, start, VOCAB) == hash_text(start)


# ---- the inspector's sentence -----------------------------------------------------------------------------
def test_the_inspector_says_when_where_and_what_a_block_is():
    mirror = deployment()
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    assert bv.describe_block(mirror, 1, b[3], VOCAB) == (
        f"stored at {clock(T0 + 3.0)} by worker 1, child of block {hash_text(b[2])} ('You are a helpful', "
        f"3 blocks deep), tokens ' def f():'")
    # held in three tiers, and by the other worker too
    assert bv.describe_block(mirror, 0, a[0], VOCAB) == (
        f"stored at {clock(T0 + 1.0)} by worker 0 in GPU, group 1 sliding window 128 and CPU, first block of its "
        f"chain, tokens 'You are a helpful', also held by worker 1")
    # without a vocabulary: ids, and the prefix by its hash
    assert bv.describe_block(mirror, 1, b[3]) == (
        f"stored at {clock(T0 + 3.0)} by worker 1, child of block {hash_text(b[2])} ({hash_text(a[0])}, "
        f"3 blocks deep), tokens ids 50 51 52 53")


def test_an_evicted_block_tells_its_eviction():
    mirror = deployment()
    a = chain(CONVERSATION_A)
    # gone from the GPU, still offloaded in CPU
    assert bv.describe_block(mirror, 0, a[4], VOCAB).endswith(
        f"in CPU, child of block {hash_text(a[3])} ('You are a helpful', 4 blocks deep), tokens ' Moses, saying.'"
        f"; evicted from GPU {clock(T0 + 5.0)}")
    mirror.apply(ev.BlocksRemoved(0, (a[4],), medium="CPU", ts=T0 + 6.0))
    assert bv.describe_block(mirror, 0, a[4], VOCAB) == (
        f"stored at {clock(T0 + 4.0)} by worker 0 in CPU, child of block {hash_text(a[3])} ('You are a helpful', "
        f"4 blocks deep), tokens ' Moses, saying.'; evicted {clock(T0 + 6.0)}")
    mirror.apply(ev.BlocksCleared(1, ts=T0 + 7.0, cause="publisher restarted"))
    b = chain(CONVERSATION_B)
    assert bv.describe_block(mirror, 1, b[3]).endswith(f"; evicted {clock(T0 + 7.0)} (publisher restarted)")
    assert "does not hold it" in bv.describe_block(mirror, 1, b"\x01" * 8)


def test_a_block_whose_chain_start_was_never_seen_says_so():
    mirror = BlockMirror()
    a = chain(CONVERSATION_A)
    mirror.apply(stored(0, CONVERSATION_A, skip=2, ts=T0))  # joined late: a[1], its parent, never seen
    assert bv.describe_block(mirror, 0, a[2], VOCAB).startswith(
        f"stored at {clock(T0)} by worker 0, child of block {hash_text(a[1])} (depth not known: its parent was "
        f"never seen), tokens")
    assert "(depth not known: the start of its chain was never seen)" in bv.describe_block(mirror, 0, a[3], VOCAB)


def test_times_are_local_to_a_tenth_of_a_second():
    assert bv.clock_text(T0 + 4.96) == clock(T0 + 5.0)  # rounded, not cut
    assert bv.clock_text(T0 + 1.04) == clock(T0 + 1.0)
    assert bv.clock_text(0.0) == "an unknown time"


# ---- lanes of glyphs ----------------------------------------------------------------------------------------
def test_a_lane_orders_blocks_by_prefix_then_depth_and_shows_the_capacity():
    mirror = deployment()
    # a second prefix, stored after the system prompt, goes right of it
    other = [60, 61, 62, 63, 64, 65, 66, 67]
    mirror.apply(stored(1, other, ts=T0 + 9.0))
    lane = bv.block_lane(mirror, 1)
    sys_root, other_root = chain(SYSTEM)[0], chain(other)[0]
    assert lane.hashes == (*chain(CONVERSATION_B), *chain(other))
    # coloured by branch: the system prompt both workers hold, then worker 1's own conversation below it (worker
    # 0 has another there), then the other prefix
    own = chain(CONVERSATION_B)[3]
    assert lane.roots == (sys_root,) * 3 + (own,) + (other_root,) * 2
    assert lane.places == 8 and lane.blocks_per_glyph == 1
    assert lane.glyphs == style.GLYPH_ONE * 6 + style.GLYPH_EMPTY * 2
    assert lane.colors() == [bv.prefix_color(sys_root)] * 3 + [bv.prefix_color(own)] + \
        [bv.prefix_color(other_root)] * 2 + [style.EMPTY_COLOR] * 2
    assert lane.glyph_of(chain(other)[1]) == 5 and lane.blocks_at(5) == (chain(other)[1],) and lane.blocks_at(7) == ()
    assert lane.title() == "GPU · 6 of 8 blocks"


def test_media_and_groups_are_lanes_of_their_own():
    mirror = deployment()
    lanes = bv.worker_lanes(mirror, 0)
    assert [(l.medium, l.group, l.name, l.held) for l in lanes] == [
        ("GPU", 0, "GPU", 4), ("GPU", 1, "group 1 sliding window 128", 1), ("CPU", 0, "CPU", 5)]
    # the capacity a publisher says is its GPU pool's: an offload tier shows only what it holds
    assert lanes[0].places == 8 and lanes[2].places == 5
    assert lanes[2].title() == "CPU · 5 blocks"
    # a worker heard from but holding nothing still has its GPU lane, all room
    mirror.apply(ev.KvWorkerSeen(2, "tcp://h:5559", 2, capacity_blocks=3))
    mirror.apply(ev.BlocksCleared(2, ts=T0 + 8.0))
    (empty,) = bv.worker_lanes(mirror, 2)
    assert empty.glyphs == style.GLYPH_EMPTY * 3 and empty.held == 0


def test_ten_thousand_blocks_fold_into_eighty_columns_coloured_by_the_prefix_holding_most():
    mirror = BlockMirror()
    mirror.apply(ev.KvWorkerSeen(0, "tcp://h:5557", 0, capacity_blocks=12_000))
    # prefix k holds 100 + k blocks, stored in order (the first stored leftmost)
    hashes, roots, n = [], [], 0
    for k in range(40):
        size = 100 + k * 10
        part = tuple((n + i + 1).to_bytes(8, "big") for i in range(size))
        mirror.apply(ev.BlocksStored(0, part, None, np.zeros(size * BS, dtype=np.int64), BS, ts=T0 + k))
        hashes += part
        roots += [part[0]] * size
        n += size
    assert n == 11_800
    lane = bv.block_lane(mirror, 0, columns=80)
    assert lane.blocks_per_glyph == 150 and lane.n_glyphs == 80 and lane.places == 12_000
    assert lane.hashes == tuple(hashes)
    for g in range(80):
        covered = roots[g * 150:(g + 1) * 150]
        if covered:
            most = max(set(covered), key=lambda r: (covered.count(r), -covered.index(r)))
            assert covered.count(lane.glyph_roots[g]) == covered.count(most), g
        else:
            assert lane.glyph_roots[g] is None
    # shaded by how many of its places are held: full, then the partly held glyph, then the empty capacity
    assert lane.glyphs[:78] == style.OCCUPANCY_GLYPHS[4] * 78
    assert lane.occupancy[78] == pytest.approx((11_800 - 78 * 150) / 150)
    assert lane.glyphs[78] == style.occupancy_glyph(lane.occupancy[78]) and lane.glyphs[79] == style.GLYPH_EMPTY
    assert lane.glyph_of(hashes[10_000]) == 10_000 // 150 and len(lane.blocks_at(0)) == 150
    text = bv.describe_glyph(mirror, lane, 1)
    # blocks 150-299: the second prefix's 150-209, the third's 210-299
    assert text == f"blocks 151-300 of 12,000 (150): 90 of {hash_text(roots[210])}, 60 of {hash_text(roots[150])}"
    assert bv.describe_glyph(mirror, lane, 79) == "blocks 11,851-12,000 of 12,000 (150): empty (capacity not in use)"


# ---- lines --------------------------------------------------------------------------------------------------
def test_the_worker_summary_counts_tiers_rates_and_losses():
    mirror = deployment()
    mirror.apply(ev.KvBatchesLost("tcp://h:5557", 10, 12, recovered=1))
    # in the last 5 s of the publisher's clock (up to T0 + 5): 5 + 5 + 1 blocks stored, 1 evicted
    assert bv.worker_summary(mirror, 0) == ("worker 0 (rank 0 at h:5557) · GPU 4 of 8 blocks · group 1 sliding "
                                            "window 128: 1 · CPU 5 · +2.2 stored/s · -0.2 evicted/s · 2 batches lost")
    assert bv.worker_summary(mirror, 1, now_ts=T0 + 100) == (
        "worker 1 (rank 1 at h:5558) · GPU 4 of 8 blocks · +0.0 stored/s · -0.0 evicted/s")
    mirror.apply(ev.BlocksRemoved(1, (b"\x09" * 8,), ts=T0 + 6.0))
    assert bv.worker_summary(mirror, 1).endswith("1 removal of blocks never seen")


def test_the_prefix_tree_collapses_chains_and_names_branches():
    mirror = deployment()
    lines = bv.tree_lines(mirror, 1, VOCAB)
    assert [l.text for l in lines] == ["4 blocks 'You are a helpful'"]
    # worker 1 takes conversation A too: the system prompt branches in two
    mirror.apply(stored(1, CONVERSATION_A, skip=3, ts=T0 + 6.0))
    lines = bv.tree_lines(mirror, 1, VOCAB)
    assert [l.text for l in lines] == ["3 blocks 'You are a helpful'  +3 in 2 branches",
                                       "  2 blocks ' the LORD said unto'", "  1 block ' def f():'"]
    root = chain(SYSTEM)[0]
    # each line in its branch's colour, as the lane colours the same blocks: the prompt, then each conversation
    branches = [root, chain(CONVERSATION_A)[3], chain(CONVERSATION_B)[3]]
    assert [l.root for l in lines] == branches and all(l.worker == 1 for l in lines)
    lane = bv.block_lane(mirror, 1)
    assert [lane.roots[lane.hashes.index(l.block)] for l in lines] == branches
    assert lines[1].block == chain(CONVERSATION_A)[3]
    # without a vocabulary, ids; and a tree cut short says what did not fit
    assert bv.tree_lines(mirror, 1, max_lines=2) == [
        bv.Line("3 blocks ids 100 101 102 103  +3 in 2 branches", root, 1, root),
        bv.Line("… 2 more branches (3 blocks)", worker=1)]
    assert bv.tree_lines(BlockMirror(), 0)[0].text == "worker 0 holds no blocks"


def test_a_chain_below_a_missing_parent_hangs_from_it():
    mirror = BlockMirror()
    mirror.apply(stored(0, CONVERSATION_A, skip=2, ts=T0))
    a = chain(CONVERSATION_A)
    assert [l.text for l in bv.tree_lines(mirror, 0, VOCAB)] == [f"{hash_text(a[1])} (not held)  +3 in 1 branch",
                                                                 "  3 blocks ':⏎ Q:'"]


def test_the_router_sees_how_deep_workers_share_a_prefix_and_what_only_one_holds():
    mirror = deployment()
    root = chain(SYSTEM)[0]
    lines = bv.router_lines(mirror, VOCAB)
    # worker 0 holds 4 blocks of its conversation on the GPU, worker 1 4 of its own: 3 alike, then 1 more each
    assert [l.text for l in lines] == [
        "shared prefixes",
        "  'You are a helpful' 3 blocks (12 tokens) on workers 0 and 1, then worker 0 +1 · worker 1 +1",
        "worker 0 alone holds 1 block of 'You are a helpful'",
        "worker 1 alone holds 1 block of 'You are a helpful'"]
    assert lines[1].root == root and lines[2].worker == 0
    other = [60, 61, 62, 63, 64, 65, 66, 67]
    mirror.apply(stored(1, other, ts=T0 + 9.0))
    assert bv.router_lines(mirror)[-1].text == (
        f"worker 1 alone holds 2 blocks of {hash_text(chain(other)[0])}, 1 block of 1 more prefix")
    single = BlockMirror()
    single.apply(stored(0, SYSTEM, ts=T0))
    assert [l.text for l in bv.router_lines(single)] == [f"worker 0 alone holds 3 blocks of {hash_text(root)}"]
    assert bv.router_lines(BlockMirror())[0].text == "no worker heard from yet"


def test_the_router_view_sees_which_worker_holds_what_alone():
    mirror = deployment()
    other = [60, 61, 62, 63, 64, 65, 66, 67]
    mirror.apply_all([stored(1, other, ts=T0 + 9.0), stored(2, CONVERSATION_A, ts=T0 + 10.0)])
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    view = bv.router_view(mirror)
    first = view.shares[0]
    assert first.root == a[0] and first.workers == (0, 1, 2)
    # worker 0 evicted a[4] from its GPU
    assert {w: blk.hash for w, blk in first.deepest.items()} == {0: a[3], 1: b[3], 2: a[4]}
    # worker 2 holds what worker 0 holds (and a[4] more): neither has anything alone; worker 1 has its conversation and the other
    assert view.exclusive == {0: {}, 1: {chain(other)[0]: 2, a[0]: 1}, 2: {a[0]: 1}}
    assert view.holders[a[3]] == [0, 2] and view.holders[a[4]] == [2] and view.holders[b[3]] == [1]


def test_the_eviction_log_reads_newest_first_with_its_causes():
    mirror = deployment()
    a, b = chain(CONVERSATION_A), chain(CONVERSATION_B)
    mirror.apply(ev.BlocksRemoved(0, (a[3],), medium="CPU", ts=T0 + 6.0))
    mirror.apply(ev.BlocksCleared(1, ts=T0 + 7.0, cause="publisher restarted"))
    lines = bv.eviction_lines(mirror, 3, VOCAB)
    # the clear logs worker 1's blocks in the order it held them: the newest line is its last
    restarted = f"{clock(T0 + 7.0)}  worker 1  {{}} publisher restarted · depth {{}} of 'You are a helpful' · {{}}"
    assert [l.text for l in lines] == [restarted.format(hash_text(b[3]), 3, "' def f():'"),
                                       restarted.format(hash_text(b[2]), 2, "':⏎ Q:'"),
                                       restarted.format(hash_text(b[1]), 1, "' assistant. Answer briefly'")]
    older = bv.eviction_lines(mirror, 10)
    assert older[-2].text == (f"{clock(T0 + 6.0)}  worker 0  {hash_text(a[3])} evicted from CPU · depth 3 of "
                              f"{hash_text(a[0])} · ids 1 2 3 4")
    assert older[-1].text == (f"{clock(T0 + 5.0)}  worker 0  {hash_text(a[4])} evicted · depth 4 of "
                              f"{hash_text(a[0])} · ids 5 6 7 8")
    assert older[-1].block == a[4] and older[-1].worker == 0
    assert bv.eviction_lines(mirror, 0) == []


def test_the_publishers_stats_add_up_and_warn():
    mirror = deployment()
    assert bv.stats_text(mirror) == "no publisher stats yet"
    mirror.apply(ev.KvEventStats("tcp://h:5557", 100, 300, 50, 10, lost=2, replayed=5, dialect="map"))
    mirror.apply(ev.KvEventStats("tcp://h:5558", 20, 40, 10, 0, unknown_fields=3, dialect="array-v3"))
    assert bv.stats_parts(mirror) == [("2 publishers", False), ("120 batches", False), ("2 lost", True),
                                      ("5 replayed", False), ("0 malformed", False),
                                      ("unknown: 3 fields", True), ("array-v3/map", False)]
    mirror.apply(ev.KvPublisherRestarted("tcp://h:5557", 99, 0, 1))
    assert bv.stats_text(mirror).endswith("1 restart · array-v3/map")


def test_the_views_are_torch_free():
    import subprocess
    import sys

    code = ("import sys, engine.watch.block_views; "
            "assert 'torch' not in sys.modules and 'textual' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)

