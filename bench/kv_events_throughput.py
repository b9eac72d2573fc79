"""How many block events per second `kvscope attach --vllm` keeps up with: a publisher process sends vLLM KV event
batches as fast as ZeroMQ takes them, and kvscope's KvEventSubscriber reads them, publishes them on its bus and
into its own BlockMirror (what a late watcher starts from); end to end, a Watcher (what a view polls) applies them
into its CacheMirror's BlockMirror as well, in this process.

    python bench/kv_events_throughput.py [--batches 3000] [--per-batch 64] [--dialect map] [--capacity 20000]
                                         [--chained] [--reps 3]

Each batch holds --per-batch BlockStored events of one block each (a decode step's newly full blocks, one per
request, as vLLM sends them; --chained makes them one request's chain instead, which the subscriber still
publishes one event each), and once the worker holds --capacity blocks, as many BlockRemoved events of one
block each (vLLM evicts block by block). A block event is one of those. The batches are encoded before the
clock starts (the publisher is then bounded by ZeroMQ alone); the clock runs from the first batch the subscriber
reads to the moment the mirror measured holds exactly the publisher's last block set, and the rate is the block
events of all batches over that time. Medians over reps. Prints a line to quote for each of the two measures.
Subscriber and watcher share one interpreter lock: "CPU of this process" near the wall time means the rate is
what one core does; other work on the machine lowers it.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from engine.watch.kv_events.formats import REMOVED, STORED, WireEvent, encode_batch  # noqa: E402

BLOCK_SIZE = 16


def make_batches(n_batches: int, per_batch: int, capacity: int, dialect: str, chained: bool,
                 seed: int = 0) -> tuple[list[bytes], set[bytes], int]:
    """The payloads, the block set the worker holds after the last, and the block events they carry."""
    rng = random.Random(seed)
    held: dict[bytes, None] = {}  # insertion order: the oldest is evicted first
    recent: collections.deque[bytes] = collections.deque(maxlen=8)  # parents a new request's block may extend
    payloads, n_events, next_hash = [], 0, 1
    for b in range(n_batches):
        events = []
        parent = None
        for _ in range(per_batch):
            h = next_hash.to_bytes(8, "big")
            next_hash += 1
            if not chained:
                parent = rng.choice((None, *recent))
            tokens = tuple(rng.randrange(32000) for _ in range(BLOCK_SIZE))
            events.append(WireEvent(STORED, (h,), parent, tokens, BLOCK_SIZE))
            held[h] = None
            recent.append(h)
            parent = h
        while len(held) > capacity:
            oldest = next(iter(held))
            del held[oldest]
            events.append(WireEvent(REMOVED, (oldest,)))
        n_events += len(events)
        payloads.append(encode_batch(1.7e9 + b * 1e-3, events, 0, dialect))
    return payloads, set(held), n_events


def publisher(path: str) -> None:
    """The publishing process: binds, says where, waits for the subscription, sends every batch, waits to be ended."""
    payloads = msgpack.unpackb(Path(path).read_bytes())
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    pub.recv()  # the subscription
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    sys.stdin.read()  # until the bench closes our stdin: the queued messages must not die with the socket
    pub.close(linger=0)
    context.term()


def run_once(payloads_file: str, expected: set[bytes], n_batches: int, watched: bool) -> tuple[float, float]:
    """(seconds from the first batch read to the last block set shown, seconds of this process's CPU meanwhile).
    watched: a Watcher applies the events too, and the clock stops when its mirror shows the set; else the clock
    stops when the subscriber's own mirror (what a late watcher starts from) holds it."""
    from engine.watch.kv_events.subscriber import KvEventSubscriber
    from engine.watch.watcher import Watcher

    proc = subprocess.Popen([sys.executable, __file__, "--publisher", payloads_file], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        subscriber = KvEventSubscriber([endpoint], start=False)
        # a queue that holds the whole burst: a view's smaller one would resync instead, which is not this measure
        watcher = Watcher.of(subscriber, maxsize=1 << 22) if watched else None
        subscriber.start()
        stats = lambda: subscriber.stats[endpoint]  # noqa: E731
        while stats().batches == 0:
            time.sleep(0.001)
        started, cpu = time.perf_counter(), time.process_time()
        while True:
            if watcher is not None:
                watcher.poll()
            if stats().batches >= n_batches:
                mirror = watcher.mirror.blocks if watcher is not None else subscriber.blocks
                if set(mirror.blocks(0)) == expected:
                    break
            time.sleep(0.02)  # a view redraws a few times a second; polling each event would only cost more
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        subscriber.close()
        assert stats().lost == stats().malformed == 0, stats()
        assert watcher is None or watcher.dropped == 0, "the watcher's queue overflowed: a resync was measured"
        return elapsed, cpu
    finally:
        proc.stdin.close()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--per-batch", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=20000)
    parser.add_argument("--dialect", default="map", choices=("array-v1", "array-v2", "array-v3", "map"))
    parser.add_argument("--chained", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--publisher", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publisher:
        publisher(args.publisher)
        return
    payloads, expected, n_events = make_batches(args.batches, args.per_batch, args.capacity, args.dialect,
                                                args.chained)
    with tempfile.NamedTemporaryFile(suffix=".msgpack", delete=False) as f:
        f.write(msgpack.packb(payloads))
    what = (f"{args.batches} {args.dialect} batches of {args.per_batch} one-block BlockStored"
            f"{' (chained)' if args.chained else ''} + evictions, {n_events:,} block events, {os.cpu_count()} CPUs, "
            f"publisher in another process")
    try:
        for watched, how in ((False, "into the subscriber's bus and mirror"), (True, "end to end, into a watcher")):
            runs = [run_once(f.name, expected, args.batches, watched) for _ in range(args.reps)]
            seconds = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(f"  runs (s): {', '.join(f'{r[0]:.2f}' for r in runs)}; CPU of this process: {cpu:.2f} s of "
                  f"{seconds:.2f} s")
            print(f"kvscope attach --vllm: {n_events / seconds:,.0f} block events/s applied {how} ({what})")
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
