"""`kvscope attach --vllm` (engine/watch/kv_events/subscriber.py, engine/runners/kv_events_command.py): a test
publisher that behaves like vLLM's ZmqEventPublisher (tests/kv_events_publisher.py) on 127.0.0.1, and kvscope's
subscriber following it: every layout, several workers, gaps replayed or lost, restarts, messages that are no batch,
100k blocks, late watchers, a recording, the token texts, and the command line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from engine import events as ev
from engine.cli import main
from engine.errors import KvscopeError
from engine.runners.kv_events_frames import LEGEND
from engine.watch import lifetime
from engine.watch.kv_events import subscriber as subscriber_module
from engine.watch.kv_events.formats import DIALECTS, WireEvent
from engine.watch.kv_events.subscriber import KvEventSubscriber
from engine.watch.kv_events.vocabulary import load_vocabulary
from engine.watch.recording import RecordingReader
from engine.watch.watcher import Watcher
from tests.kv_events_publisher import (
    KvEventsPublisher,
    cleared,
    free_port,
    removed,
    stored,
    with_unknown_fields,
    with_unknown_tag,
)

ROOT = Path(__file__).parent.parent
DEMO_GGUF = ROOT / "engine" / "models" / "demo" / "kvscope-demo-gemma3.gguf"


# ---- helpers ------------------------------------------------------------------------------------------------------------
def wait_for(condition, timeout: float = 15.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def watching(*publishers: KvEventsPublisher, **options) -> tuple[KvEventSubscriber, Watcher]:
    """A subscriber of the publishers with a watcher subscribed before it started, connected once this returns."""
    subscriber = KvEventSubscriber([p.spec for p in publishers], start=False, **options)
    watcher = Watcher.of(subscriber)
    subscriber.start()
    for p in publishers:
        p.wait_for_subscribers()
    return subscriber, watcher


def read(subscriber: KvEventSubscriber, publisher: KvEventsPublisher, batches: int, **counts) -> None:
    """Until the subscriber read `batches` batches of the publisher (and the other counts reached these)."""
    def there() -> bool:
        s = subscriber.stats[publisher.endpoint]
        return s.batches >= batches and all(getattr(s, k) >= v for k, v in counts.items())

    wait_for(there, what=f"{batches} batches of {publisher.endpoint} ({counts})")


def held(watcher: Watcher, worker: int) -> dict[tuple[str, int], dict[bytes, tuple[int, ...]]]:
    """A worker's blocks as the watcher's mirror holds them, in the shape of KvEventsPublisher.held_blocks()."""
    watcher.poll()
    blocks = watcher.mirror.blocks
    return {tier: {h: tuple(int(t) for t in b.token_ids) for h, b in blocks.blocks(worker, *tier).items()}
            for tier in blocks.tiers(worker)}


def kinds(events: list[ev.Event], *wanted: type) -> list[ev.Event]:
    return [e for e in events if isinstance(e, wanted)]


def chain(first: int, n: int, parent: int | None = None, **fields) -> WireEvent:
    """One BlockStored of n blocks with hashes first..first+n-1 and tokens derived from them."""
    return stored(list(range(first, first + n)), parent, block_size=4,
                  tokens=[(first + k) * 10 + t for k in range(n) for t in range(4)], **fields)


@pytest.fixture
def publisher():
    with KvEventsPublisher("map", rank=0) as p:
        yield p


# ---- what a publisher says reaches the mirror ---------------------------------------------------------------------------
@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_layout_reaches_the_mirror(dialect):
    rank = None if dialect == "array-v1" else 0
    with KvEventsPublisher(dialect, rank=rank) as pub:
        subscriber, watcher = watching(pub)
        with subscriber:
            pub.send([chain(1, 3), chain(10, 2, parent=3)])
            pub.send([removed([2]), chain(20, 1, parent=11)])
            pub.send([removed([10, 11])])
            read(subscriber, pub, 3)
            assert held(watcher, 0) == pub.held_blocks() != {}
            seen = watcher.mirror.blocks.seen[0]
            where = pub.endpoint.removeprefix("tcp://")
            assert (seen.endpoint, seen.rank, seen.dialect) == (pub.endpoint, -1 if rank is None else 0, dialect)
            assert seen.label == (f"worker 0 ({where})" if rank is None else f"worker 0 (rank 0 at {where})")
            stats = subscriber.stats[pub.endpoint]
            assert (stats.batches, stats.events, stats.blocks_stored, stats.blocks_removed) == (3, 5, 6, 3)
            assert stats.lost == stats.malformed == stats.unknown_fields == 0 and stats.dialect == dialect


def test_the_events_of_a_batch_in_order_and_a_worker_named_before_its_first_block(publisher):
    subscriber, watcher = watching(publisher)
    with subscriber:
        publisher.send([chain(1, 2, medium="CPU"), removed([1], medium="CPU"), cleared(), chain(5, 1)])
        read(subscriber, publisher, 1)
    watcher.poll()
    events = watcher.events_since(0)
    kept = [type(e).__name__ for e in events if not isinstance(e, (ev.KvEventStats, ev.SessionStatus))]
    assert kept == ["KvWorkerSeen", "BlocksStored", "BlocksRemoved", "BlocksCleared", "BlocksStored"]
    assert [e.state for e in kinds(events, ev.SessionStatus)] == ["attached", "closed"]
    assert held(watcher, 0) == publisher.held_blocks() == {("GPU", 0): {(5).to_bytes(8, "big"): (50, 51, 52, 53)}}


def test_two_publishers_are_two_workers_each_with_its_own_numbers():
    """vLLM with data parallelism: each rank publishes on its own port, numbering its batches from 0."""
    with KvEventsPublisher("map", rank=0) as first, KvEventsPublisher("map", rank=1) as second:
        subscriber, watcher = watching(first, second)
        with subscriber:
            first.send([chain(1, 2)])
            second.send([chain(100, 3)])
            second.send([removed([100])])
            first.send([chain(3, 1, parent=2)])
            read(subscriber, first, 2)
            read(subscriber, second, 2)
            watcher.poll()
            seen = {w: watcher.mirror.blocks.seen[w] for w in (0, 1)}
            by_rank = {s.rank: w for w, s in seen.items()}
            assert held(watcher, by_rank[0]) == first.held_blocks()
            assert held(watcher, by_rank[1]) == second.held_blocks()
            assert seen[by_rank[1]].label == f"worker {by_rank[1]} (rank 1 at {second.endpoint.removeprefix('tcp://')})"
            assert all(s.lost == 0 for s in subscriber.stats.values())  # interleaved, yet no gap: numbered apart
            assert subscriber.label == f"vLLM KV events from {first.endpoint}, {second.endpoint}"


def test_sglang_ranks_are_told_apart_by_port_alone():
    """SGLang's batches carry no rank (array-v1): the endpoint is the worker."""
    with KvEventsPublisher("array-v1") as a, KvEventsPublisher("array-v1") as b:
        subscriber, watcher = watching(a, b)
        with subscriber:
            a.send([chain(1, 1)])
            read(subscriber, a, 1)
            b.send([chain(1, 2)])  # the same hashes: the same prefix, held by both
            read(subscriber, b, 1)
            blocks = watcher.mirror.blocks
            assert held(watcher, 0) == a.held_blocks() and held(watcher, 1) == b.held_blocks()
            assert [(blocks.seen[w].endpoint, blocks.seen[w].rank, blocks.seen[w].dialect) for w in (0, 1)] == [
                (a.endpoint, -1, "array-v1"), (b.endpoint, -1, "array-v1")]
            assert [block.worker for block in blocks.find((1).to_bytes(8, "big"))] == [0, 1]


def test_one_publisher_whose_batches_carry_several_ranks_is_several_workers(publisher):
    """A relay (Dynamo's, an aggregating proxy) sends the batches of several ranks on one socket."""
    subscriber, watcher = watching(publisher, capacity_blocks=64)
    with subscriber:
        publisher.send([chain(1, 2)], rank=3)
        publisher.send([chain(1, 1)], rank=5)
        publisher.send([removed([1])], rank=3)
        read(subscriber, publisher, 3)
        blocks = watcher.mirror.blocks
        watcher.poll()
        assert {w: (s.rank, s.capacity_blocks) for w, s in blocks.seen.items()} == {0: (3, 64), 1: (5, 64)}
        assert held(watcher, 0) == publisher.held_blocks(3) and held(watcher, 1) == publisher.held_blocks(5)
        assert held(watcher, 0) == {("GPU", 0): {(2).to_bytes(8, "big"): (20, 21, 22, 23)}}


# ---- gaps and restarts --------------------------------------------------------------------------------------------------
def test_a_lost_batch_comes_back_through_the_replay_endpoint(publisher):
    subscriber, watcher = watching(publisher)
    with subscriber:
        publisher.send([chain(1, 2)])
        publisher.send([chain(3, 2, parent=2)], lose=True)
        publisher.send([removed([1])], lose=True)
        publisher.send([chain(5, 1, parent=4)])
        read(subscriber, publisher, 4)
        assert held(watcher, 0) == publisher.held_blocks()
        gaps = kinds(watcher.events_since(0), ev.KvBatchesLost)
        assert [(g.endpoint, g.first, g.last, g.recovered, g.lost, g.reason) for g in gaps] == [
            (publisher.endpoint, 1, 2, 2, 0, "")]
        assert publisher.replay_requests == [1]
        stats = subscriber.stats[publisher.endpoint]
        assert (stats.replayed, stats.lost) == (2, 0)
        # the replayed batches went out before the one that showed the gap
        order = [e for e in watcher.events_since(0) if isinstance(e, (ev.KvBatchesLost, ev.BlocksStored))]
        assert [getattr(e, "block_hashes", ("gap",))[0] for e in order] == [
            (1).to_bytes(8, "big"), "gap", (3).to_bytes(8, "big"), (5).to_bytes(8, "big")]


def test_a_lost_batch_without_a_replay_endpoint_is_said_and_the_rest_applied():
    with KvEventsPublisher("array-v2", rank=0, replay=False) as pub:
        subscriber, watcher = watching(pub)
        with subscriber:
            pub.send([chain(1, 1)])
            pub.send([chain(2, 1)], lose=True)
            pub.send([chain(3, 1), removed([1])])
            read(subscriber, pub, 2)
            watcher.poll()
            gaps = kinds(watcher.events_since(0), ev.KvBatchesLost)
            assert [(g.first, g.last, g.recovered, g.reason) for g in gaps] == [(1, 1, 0, "no replay endpoint")]
            mirror = held(watcher, 0)[("GPU", 0)]
            truth = pub.held_blocks()[("GPU", 0)]
            assert set(mirror) == set(truth) - {(2).to_bytes(8, "big")} == {(3).to_bytes(8, "big")}
            assert subscriber.stats[pub.endpoint].lost == 1


def test_a_replay_buffer_that_no_longer_holds_them_recovers_what_it_has():
    with KvEventsPublisher("map", rank=0, buffer_steps=2) as pub:
        subscriber, watcher = watching(pub)
        with subscriber:
            pub.send([chain(1, 1)])
            for first in (2, 3, 4):
                pub.send([chain(first, 1)], lose=True)
            pub.send([chain(5, 1)])  # the buffer now holds batches 3 (block 4) and 4 (block 5)
            read(subscriber, pub, 3)
            watcher.poll()
            gaps = kinds(watcher.events_since(0), ev.KvBatchesLost)
            assert [(g.first, g.last, g.recovered, g.reason) for g in gaps] == [
                (1, 3, 1, "the publisher's replay buffer no longer holds them")]
            assert set(held(watcher, 0)[("GPU", 0)]) == {n.to_bytes(8, "big") for n in (1, 4, 5)}
            stats = subscriber.stats[pub.endpoint]
            assert (stats.lost, stats.replayed) == (2, 1)


def test_a_replay_endpoint_that_does_not_answer_is_waited_for_a_bounded_time(monkeypatch):
    monkeypatch.setattr(subscriber_module, "REPLAY_WAIT_S", 0.3)
    with KvEventsPublisher("map", rank=0, replay=False) as pub:
        silent = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
        subscriber = KvEventSubscriber([f"{pub.endpoint},{silent}"], start=False)
        watcher = Watcher.of(subscriber)
        with subscriber.start():
            pub.wait_for_subscribers()
            pub.send([chain(1, 1)])
            pub.send([chain(2, 1)], lose=True)
            started = time.monotonic()
            pub.send([chain(3, 1)])
            read(subscriber, pub, 2)
            assert time.monotonic() - started < 5
            watcher.poll()
            gaps = kinds(watcher.events_since(0), ev.KvBatchesLost)
            assert [(g.first, g.last, g.recovered, g.reason) for g in gaps] == [
                (1, 1, 0, "the replay endpoint did not answer")]
            pub.send([chain(4, 1)])  # and it goes on reading
            read(subscriber, pub, 3)
            assert set(held(watcher, 0)[("GPU", 0)]) == {n.to_bytes(8, "big") for n in (1, 3, 4)}


def test_joining_late_is_no_gap(publisher):
    for first in range(5):  # sent before anyone subscribed: ZeroMQ drops them
        publisher.send([chain(first * 10 + 1, 1)])
    subscriber, watcher = watching(publisher)
    with subscriber:
        publisher.send([chain(100, 1)])
        publisher.send([chain(101, 1, parent=100)])
        read(subscriber, publisher, 2)
        watcher.poll()
        assert kinds(watcher.events_since(0), ev.KvBatchesLost) == [] and publisher.replay_requests == []
        assert set(held(watcher, 0)[("GPU", 0)]) == {(100).to_bytes(8, "big"), (101).to_bytes(8, "big")}


def test_a_restarted_publisher_clears_its_workers_and_is_followed_from_its_new_numbers():
    with KvEventsPublisher("map", rank=0) as pub, KvEventsPublisher("map", rank=1) as other:
        subscriber, watcher = watching(pub, other)
        with subscriber:
            pub.send([chain(1, 2)], rank=0)
            pub.send([chain(10, 2)], rank=2)  # a second worker behind the same endpoint
            pub.send([chain(20, 1)], rank=0)
            other.send([chain(50, 1)])
            read(subscriber, pub, 3)
            read(subscriber, other, 1)
            pub.restart()
            pub.send([chain(30, 1)], rank=0)
            read(subscriber, pub, 4, epochs=2)
            watcher.poll()
            events = watcher.events_since(0)
            restarts = kinds(events, ev.KvPublisherRestarted)
            assert [(r.endpoint, r.last_seq, r.seq, r.epoch) for r in restarts] == [(pub.endpoint, 2, 0, 1)]
            workers = {s.rank: w for w, s in watcher.mirror.blocks.seen.items() if s.endpoint == pub.endpoint}
            cleared_workers = [(c.worker, c.cause) for c in kinds(events, ev.BlocksCleared)]
            assert sorted(cleared_workers) == sorted((w, "publisher restarted") for w in workers.values())
            assert kinds(events, ev.KvBatchesLost) == []
            assert held(watcher, workers[0]) == pub.held_blocks(0) == {("GPU", 0): {(30).to_bytes(8, "big"): (
                300, 301, 302, 303)}}
            assert held(watcher, workers[2]) == {}
            other_worker = next(w for w, s in watcher.mirror.blocks.seen.items() if s.endpoint == other.endpoint)
            assert held(watcher, other_worker) == other.held_blocks()  # another publisher's workers keep theirs
            assert subscriber.stats[pub.endpoint].epochs == 2 and subscriber.stats[other.endpoint].epochs == 1


def test_a_publisher_process_that_restarts_on_its_port_is_followed_again():
    """A restarted vLLM binds its ports again and numbers from 0: ZeroMQ reconnects, and the restart is seen."""
    with KvEventsPublisher("map", rank=0) as before:
        subscriber, watcher = watching(before)
        before.send([chain(1, 2)])
        before.send([chain(3, 1)])
        read(subscriber, before, 2)
        port, replay_port = (int(e.rsplit(":", 1)[1]) for e in (before.endpoint, before.replay_endpoint))
    with subscriber, KvEventsPublisher("map", rank=0, port=port, replay_port=replay_port) as after:
        after.wait_for_subscribers()
        after.send([chain(10, 1)])
        read(subscriber, after, 3, epochs=2)
        watcher.poll()
        restarts = kinds(watcher.events_since(0), ev.KvPublisherRestarted)
        assert [(r.last_seq, r.seq, r.epoch) for r in restarts] == [(1, 0, 1)]
        assert held(watcher, 0) == after.held_blocks() == {("GPU", 0): {(10).to_bytes(8, "big"): (100, 101, 102, 103)}}


# ---- what is no batch ------------------------------------------------------------------------------------------------------
def test_unknown_fields_and_event_kinds_are_counted_and_the_rest_applied():
    with KvEventsPublisher("array-v3", rank=0) as pub:
        subscriber, watcher = watching(pub)
        with subscriber:
            pub.send([chain(1, 2), removed([1])], mutate=lambda b: with_unknown_tag(with_unknown_fields(b)))
            pub.send([chain(3, 1)])
            read(subscriber, pub, 2)
            stats = subscriber.stats[pub.endpoint]
            assert (stats.unknown_tags, stats.unknown_fields, stats.malformed) == (1, 3, 0)
            assert held(watcher, 0) == pub.held_blocks() and len(pub.held_blocks()[("GPU", 0)]) == 2


def test_messages_that_are_no_batch_are_counted_and_never_stop_the_subscriber(publisher):
    subscriber, watcher = watching(publisher)
    with subscriber:
        publisher.send([chain(1, 1)])
        publisher.send_raw([b"just one frame"])
        publisher.send_raw([b"", b"\x00" * 7, b"a seq of 7 bytes"])
        publisher.send_raw([b"", (1).to_bytes(8, "big"), b"x", b"four frames"])
        publisher.send_payload(b"\xc1 not msgpack")  # with the next sequence number: no gap after it
        publisher.send_payload(msgpack.packb({"ts": "soon", "events": []}))
        publisher.send_payload(msgpack.packb([1.0, [["BlockStored", [1], None, [2**63], 1, None]]]))  # > int64
        publisher.send([chain(2, 1)])
        read(subscriber, publisher, 2, malformed=6)
        assert subscriber.stats[publisher.endpoint].malformed == 6 and not subscriber.finished
        assert held(watcher, 0) == publisher.held_blocks()
        assert kinds(watcher.events_since(0), ev.KvBatchesLost) == [] and subscriber.error is None


def test_a_message_over_the_size_cap_is_never_taken_and_the_publisher_is_connected_again(monkeypatch):
    """ZeroMQ drops a connection that sends a message over ZMQ_MAXMSGSIZE and never makes it again by itself."""
    monkeypatch.setattr(subscriber_module, "MAX_MESSAGE_BYTES", 4096)
    monkeypatch.setattr(subscriber_module, "REPLAY_WAIT_S", 0.3)
    monkeypatch.setattr(subscriber_module, "RECONNECT_GRACE_S", 0.2)
    with KvEventsPublisher("map", rank=0) as pub:
        subscriber, watcher = watching(pub)
        with subscriber:
            pub.send([chain(1, 1)])
            pub.send([chain(1000, 400)])  # ~10 kB
            pub.wait_for_subscribers(2)  # subscribed again: connected anew
            pub.send([chain(2, 1)])
            read(subscriber, pub, 2)
            stats = subscriber.stats[pub.endpoint]
            assert set(held(watcher, 0)[("GPU", 0)]) == {(1).to_bytes(8, "big"), (2).to_bytes(8, "big")}, stats
            # the replay endpoint sends the oversized batch first, and the replay's connection goes the same way
            assert (stats.lost, stats.replayed, stats.malformed) == (1, 0, 0) and subscriber.error is None, stats


def test_other_topics_are_counted_and_skipped():
    with KvEventsPublisher("map", rank=0, topic="kv") as pub:
        subscriber, watcher = watching(pub, topic="kv")
        with subscriber:
            pub.send([chain(1, 1)])
            other = msgpack.packb({"ts": 1.0, "events": []})
            pub.send_raw([b"kv-metrics", (99).to_bytes(8, "big"), other])  # ZeroMQ's prefix filter lets it through
            pub.send_raw([b"metrics", (98).to_bytes(8, "big"), other])  # filtered out by ZeroMQ itself
            pub.send([chain(2, 1)])
            read(subscriber, pub, 2)
            assert subscriber.stats[pub.endpoint].other_topics == 1
            assert held(watcher, 0) == pub.held_blocks()
            assert kinds(watcher.events_since(0), ev.KvBatchesLost, ev.KvPublisherRestarted) == []


# ---- many blocks, late watchers, recordings ----------------------------------------------------------------------------
def test_a_hundred_thousand_blocks_end_as_the_publishers_set(publisher):
    subscriber, watcher = watching(publisher)
    with subscriber:
        next_hash, batches = 1, 0
        while next_hash <= 100_000:
            events = [chain(next_hash + 10 * k, 10, parent=None if k == 0 else next_hash + 10 * k - 1)
                      for k in range(50)]
            if batches % 4 == 3:  # some go again: the cache evicts
                events.append(removed(list(range(next_hash - 700, next_hash - 600))))
            publisher.send(events)
            next_hash += 500
            batches += 1
        read(subscriber, publisher, batches)
        truth = publisher.held_blocks()
        assert sum(len(t) for t in truth.values()) == 100_000 - 100 * (batches // 4)
        assert held(watcher, 0) == truth
        assert subscriber.blocks.held(0) == sum(len(t) for t in truth.values())  # the subscriber's own picture
        assert subscriber.stats[publisher.endpoint].blocks_stored == 100_000


def test_a_late_watcher_starts_from_the_same_picture(publisher):
    vocabulary = ev.Vocabulary("tiny", ("a", "b"))
    subscriber, early = watching(publisher, vocabulary=vocabulary)
    with subscriber:
        publisher.send([chain(1, 3), chain(7, 1, medium="CPU")])
        publisher.send([removed([2])])
        read(subscriber, publisher, 2)
        late = Watcher.of(subscriber)
        early.poll()
        late.poll()
        assert late.mirror.blocks.same_as(early.mirror.blocks), late.mirror.blocks.differences(early.mirror.blocks)
        assert late.mirror.vocabulary.pieces == early.mirror.vocabulary.pieces == ("a", "b")
        assert late.status.state == "attached"
        assert isinstance(early.events_since(0)[0], ev.Vocabulary)  # first: views show text from the first block on


def test_a_recording_rebuilds_the_live_picture(tmp_path, publisher):
    from engine.watch.recording import Recorder

    out = tmp_path / "blocks.kvtrace"
    subscriber = KvEventSubscriber([publisher.spec], start=False)
    live = Watcher.of(subscriber)
    recorder = Recorder(out, keyframe_every=5)
    recorder.attach(subscriber)
    recorder.start()
    with subscriber.start():
        publisher.wait_for_subscribers()
        for k in range(12):
            publisher.send([chain(100 * k + 1, 3, parent=None if k == 0 else 100 * (k - 1) + 3)])
            if k % 3 == 2:
                publisher.send([removed([100 * (k - 1) + 1])])
        publisher.send([chain(5000, 1)], lose=True)
        publisher.send([chain(6000, 1)])
        read(subscriber, publisher, 18)
    recorder.close()
    live.poll()
    with RecordingReader(out) as reader:
        assert not reader.truncated and len(reader.keyframes) > 1
        last = reader.mirror_at(len(reader) - 1)
        recorded = list(reader.events())
    assert last.blocks.same_as(live.mirror.blocks), last.blocks.differences(live.mirror.blocks)
    assert held(live, 0) == publisher.held_blocks()
    assert [e.state for e in recorded if isinstance(e, ev.SessionStatus)] == ["attached", "closed"]
    assert any(isinstance(e, ev.KvBatchesLost) and e.recovered == 1 for e in recorded)


# ---- lifetime ---------------------------------------------------------------------------------------------------------------
def test_close_is_idempotent_and_ends_the_thread(publisher):
    subscriber = KvEventSubscriber([publisher.spec])
    assert subscriber in lifetime.still_open() and subscriber.status.state == "attached" and subscriber.started
    with pytest.raises(KvscopeError, match="started already"):
        subscriber.start()
    subscriber.close()
    subscriber.close()
    assert subscriber.finished and subscriber.status.state == "closed" and subscriber not in lifetime.still_open()
    assert not subscriber._thread.is_alive()
    with pytest.raises(KvscopeError, match="closed"):
        subscriber.start()
    never = KvEventSubscriber([publisher.spec], start=False)
    never.close()
    assert never.finished and never.status.state == "closed" and never.current_state() == []


def test_stats_come_about_once_a_second_and_at_close(publisher):
    subscriber, watcher = watching(publisher)
    publisher.send([chain(1, 1)])
    read(subscriber, publisher, 1)
    wait_for(lambda: watcher.poll() is not None and any(
        isinstance(e, ev.KvEventStats) and e.batches == 1 for e in watcher.events_since(0)), what="stats")
    subscriber.close()
    watcher.poll()
    stats = kinds(watcher.events_since(0), ev.KvEventStats)
    assert stats[-1].endpoint == publisher.endpoint and stats[-1].batches == 1 and stats[-1].blocks_stored == 1
    assert stats[-1].epochs == 1 and stats[-1].dialect == "map"


def test_bad_arguments_are_clear_errors(publisher):
    with pytest.raises(KvscopeError, match="no publisher endpoint given"):
        KvEventSubscriber([])
    with pytest.raises(KvscopeError, match="given twice"):
        KvEventSubscriber([publisher.endpoint, publisher.spec])
    with pytest.raises(KvscopeError, match="capacity_blocks must be an integer >= 0"):
        KvEventSubscriber([publisher.spec], capacity_blocks=-1)
    with pytest.raises(KvscopeError, match="vocabulary must be an engine.events.Vocabulary"):
        KvEventSubscriber([publisher.spec], vocabulary=["a"])
    with pytest.raises(KvscopeError, match="has no tcp:// in front"):
        KvEventSubscriber(["127.0.0.1:5557"])


# ---- token texts ---------------------------------------------------------------------------------------------------------
def write_tokenizer(folder: Path) -> list[str]:
    """A small word-level tokenizer.json, as a Hugging Face folder holds it; its words by id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "the", "cache", "holds", "blocks", "é"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return words


def test_a_vocabulary_from_a_tokenizer_json_or_its_folder(tmp_path):
    words = write_tokenizer(tmp_path / "my-model")
    from_file = load_vocabulary(tmp_path / "my-model" / "tokenizer.json")
    from_folder = load_vocabulary(tmp_path / "my-model")
    assert from_file.pieces == from_folder.pieces == tuple(words)
    assert from_file.model_name == from_folder.model_name == "my-model"
    (tmp_path / "my-model" / "config.json").write_text(json.dumps({"_name_or_path": "org/my-model-7b"}))
    assert load_vocabulary(tmp_path / "my-model").model_name == "org/my-model-7b"


def test_a_vocabulary_from_a_gguf_is_its_tokenizers_text_of_each_id():
    from engine.formats.gguf_file import read_gguf_metadata
    from engine.models.tokenizer import tokenizer_from_gguf_metadata

    vocabulary = load_vocabulary(DEMO_GGUF)
    tokenizer = tokenizer_from_gguf_metadata(read_gguf_metadata(DEMO_GGUF), source=DEMO_GGUF)
    assert vocabulary.model_name == "kvscope-demo-gemma3" and len(vocabulary.pieces) == tokenizer.n_vocab
    for token_id in (0, 2, 3, 1000, len(vocabulary.pieces) - 1):
        text = tokenizer.decode([token_id])
        assert vocabulary.pieces[token_id] == (tokenizer.token_text(token_id) if "\ufffd" in text else text)


def test_a_vocabulary_that_cannot_be_read_is_a_clear_error(tmp_path):
    with pytest.raises(KvscopeError, match=r"tokenizer '.*nowhere': no such file or folder"):
        load_vocabulary(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvscopeError, match="the folder has no tokenizer.json; .* downloads nothing"):
        load_vocabulary(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(KvscopeError, match="cannot be read as a tokenizers file"):
        load_vocabulary(tmp_path / "bad.json")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(DEMO_GGUF.read_bytes()[:2000])
    with pytest.raises(KvscopeError, match="not a readable GGUF file"):
        load_vocabulary(cut)


def test_nothing_of_it_needs_torch(tmp_path):
    """The machine that watches a vLLM deployment has no torch: the subscriber, the vocabulary and the command."""
    code = f"""
import sys; sys.modules['torch'] = None
from engine.watch.kv_events.subscriber import KvEventSubscriber
from engine.watch.kv_events.vocabulary import load_vocabulary
from engine.runners.kv_events_command import run_kv_events_attach
from engine.runners.kv_events_frames import print_block_frames
from engine.watch.watcher import Watcher
vocabulary = load_vocabulary({str(DEMO_GGUF)!r})
with KvEventSubscriber(["tcp://127.0.0.1:{free_port()}"], vocabulary=vocabulary) as subscriber:
    watcher = Watcher.of(subscriber)
    watcher.poll()
assert watcher.mirror.vocabulary.model_name == "kvscope-demo-gemma3"
print(" ".join(sorted(m for m in sys.modules if m.startswith("engine"))))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"engine.watch.kv_events.subscriber", "engine.models.tokenizer"} <= loaded
    assert not loaded & {"engine.context", "engine.models.model", "engine.formats.gguf_file"}, loaded


# ---- the command line ---------------------------------------------------------------------------------------------------
def kvscope(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "attach", *args], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def feed_while_running(proc: subprocess.Popen, pub: KvEventsPublisher) -> None:
    """Once kvscope subscribed: a few batches, one of them lost and replayed."""
    pub.wait_for_subscribers(timeout=60)
    pub.send([chain(1, 2)])
    pub.send([chain(3, 1, parent=2)], lose=True)
    pub.send([chain(4, 1, parent=3), removed([1])])
    assert proc.poll() is None, "kvscope ended before the batches were sent"


def test_attach_vllm_with_output_records_without_a_terminal(tmp_path, publisher):
    out = tmp_path / "run.kvtrace"
    proc = kvscope("--vllm", publisher.spec, "-o", str(out), "--seconds", "3", cwd=tmp_path)
    feed_while_running(proc, publisher)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    err = stderr.decode()
    assert f"kvscope attach: watching vLLM KV events from {publisher.endpoint}" in err
    assert "kvscope attach: wrote " in err and f"to {out}" in err
    assert f"kvscope attach: {publisher.endpoint}: 3 batches, 4 blocks stored, 1 removed; 1 batches missed " \
           f"(1 replayed, 0 lost)" in err
    with RecordingReader(out) as reader:
        assert reader.info["vllm"] == [publisher.spec] and reader.info["command"] == "attach"
        last = reader.mirror_at(len(reader) - 1)
    blocks = last.blocks
    assert {tier: {h: tuple(int(t) for t in b.token_ids) for h, b in blocks.blocks(0, *tier).items()}
            for tier in blocks.tiers(0)} == publisher.held_blocks()


def test_attach_vllm_stops_on_sigterm_with_a_complete_recording(tmp_path, publisher):
    out = tmp_path / "run.kvtrace"
    proc = kvscope("--vllm", publisher.spec, "-o", str(out), cwd=tmp_path)
    feed_while_running(proc, publisher)  # subscribed: kvscope's signal handlers are in place
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    with RecordingReader(out) as reader:
        assert not reader.truncated
        recorded = list(reader.events())
    assert [e.state for e in recorded if isinstance(e, ev.SessionStatus)] == ["attached", "closed"]


def test_attach_vllm_without_a_terminal_prints_text_frames(tmp_path):
    with KvEventsPublisher("map", rank=1) as pub:
        proc = kvscope("--vllm", pub.spec, "--seconds", "3", "--plain-every", "0.5", "--capacity-blocks", "100",
                       cwd=tmp_path)
        feed_while_running(proc, pub)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    text = stdout.decode()
    assert text.startswith(LEGEND)
    frames = text.split("=== ")[1:]
    last = frames[-1]
    assert "closed: " in last and f"{pub.endpoint} · 3 batches · 4 blocks stored, 1 removed" in last
    assert "2 batches missed (1 replayed)" not in last and "1 batches missed (1 replayed)" in last
    assert f"worker 0 (rank 1 at {pub.endpoint.removeprefix('tcp://')}) · map" in text
    assert "GPU group 0: 3 blocks held of 100" in last
    assert "KvBatchesLost" in text


@pytest.mark.parametrize("argv,message", [
    (["--vllm", "localhost:5557"], "attach --vllm: KV event endpoint 'localhost:5557' has no tcp:// in front"),
    (["--vllm", "tcp://*:5557"], "is where a publisher binds"),
    (["--vllm", "tcp://h:1", "--log", "x.log"], "attach: --log is for a llama.cpp's log; --vllm watches"),
    (["--vllm", "tcp://h:1", "--", "llama-server"], "kvscope runs no command with it (got llama-server)"),
    (["--vllm", "tcp://h:1", "--passthrough", "p.log"], "attach: --passthrough is for a llama.cpp's log"),
    (["--topic", "kv", "--", "llama-server"], "attach: --topic goes with --vllm ENDPOINT"),
    (["--vllm", "tcp://h:1", "--seconds", "0"], "attach: --seconds must be > 0, got 0.0"),
    (["--vllm", "tcp://h:1", "--capacity-blocks", "-2"], "attach: --capacity-blocks must be >= 0, got -2"),
    (["--vllm", "tcp://h:1", "--tokenizer", "/no/such/tokenizer"], "attach --tokenizer: tokenizer '/no/such/tokenizer'"),
])
def test_bad_endpoints_and_flags_are_one_line_errors(argv, message, capsys):
    assert main(["attach", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err


def test_attach_help_documents_the_vllm_flags(capsys):
    with pytest.raises(SystemExit):
        main(["attach", "--help"])
    text = capsys.readouterr().out
    for flag in ("--vllm ENDPOINT[,REPLAY]", "--topic T", "--tokenizer PATH", "--capacity-blocks N"):
        assert flag in text
    assert "kvscope attach --vllm tcp://HOST:5557[,tcp://HOST:5600]" in text
