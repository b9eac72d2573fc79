"""Recordings (engine/watch/recording.py): a live run and its replayed recording give the same mirrors at
every keyframe, at the end and at any event; seeking goes forward and backward; files from a newer
schema, cut short or damaged give a RecordingError naming the file and the byte offset, never another
exception."""
from __future__ import annotations

import dataclasses
import random
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np
import pytest

import engine
from engine import events as ev
from engine.runners.parallel import ParallelRunner
from engine.runners.parallel_workload import make_schedule
from engine.sampling import SamplerParams
from engine.watch.codec import encode_event
from engine.watch.mirror import CacheMirror, data_differences
from engine.watch.recording import (
    CHUNK_HEAD_SIZE,
    EVENTS,
    KEYFRAME,
    Recorder,
    RecordingError,
    RecordingReader,
)
from tests.model_factory import in_memory_model

GREEDY = SamplerParams(temperature=0.0, seed=1)
KEYFRAME_EVERY = 100


@dataclass
class Run:
    path: Path
    live: list[ev.Event]  # what a live watcher attached next to the recorder received
    attached: CacheMirror  # a mirror attached to the bus during the run, synced after every step
    ctx: engine.Context


def live_snapshots(events: list[ev.Event], at: set[int]) -> dict[int, dict]:
    """Snapshots of one mirror fed the live events one by one, taken right after each event in `at`."""
    mirror, out = CacheMirror(), {}
    for i, event in enumerate(events):
        mirror.apply(event)
        if i in at:
            out[i] = mirror.snapshot()
    return out


def replay(events: list[ev.Event]) -> CacheMirror:
    mirror = CacheMirror()
    for event in events:
        mirror.apply(event)
    return mirror


def assert_same(expected: CacheMirror, got: CacheMirror, where: str) -> None:
    diff = expected.differences(got)
    assert not diff, f"{where}: {diff[:5]}"


def recorded(path: Path, bus: ev.EventBus, keyframe_every: int = KEYFRAME_EVERY, **kw) -> tuple[Recorder,
                                                                                                ev.Subscription]:
    """A recorder and a live subscription attached at the same moment, so that both get the same events."""
    live = bus.subscribe(maxsize=1 << 20)
    recorder = Recorder(path, keyframe_every=keyframe_every, **kw)
    recorder.attach(bus)
    return recorder, live


@pytest.fixture(scope="module")
def demo():
    return engine.load_model("demo")


@pytest.fixture(scope="module")
def parallel_run(demo, tmp_path_factory) -> Run:
    """The demo model (an iSWA pair: base and swa caches) with split streams, four clients answering six
    requests; the recorder joins after the context exists, so the recording starts from its state."""
    path = tmp_path_factory.mktemp("rec") / "parallel.kvtrace"
    bus = engine.EventBus()
    ctx = engine.Context(demo, n_ctx=1280, pad=32, n_seq_max=5, kv_unified=False, n_batch=64, bus=bus)
    attached = CacheMirror()
    attached.attach(bus)
    recorder, live = recorded(path, bus)
    for _ in ParallelRunner(ctx, 4, GREEDY).steps(make_schedule(6, seed=3, n_predict=48, arrival_gap=1)):
        recorder.pump()
        attached.sync()
    recorder.close()
    return Run(path, live.drain(), attached, ctx)


def test_the_run_exercises_both_caches_split_streams_and_cross_stream_copies(parallel_run):
    kinds = {e.kind for e in parallel_run.live}
    assert {"CellsAllocated", "SlotsRolledBack", "CellsCopied", "StreamCopyExecuted", "CellsRemoved",
            "MemorySnapshot", "Vocabulary", "SequenceAssigned"} <= kinds
    with RecordingReader(parallel_run.path) as rec:
        assert len(rec) == len(parallel_run.live) > 5 * KEYFRAME_EVERY
        assert rec.keyframes == tuple(range(KEYFRAME_EVERY - 1, len(rec), KEYFRAME_EVERY))
        assert not rec.truncated and rec.warnings == []
        end = rec.mirror_at(-1)
    assert {name: cache.size for name, cache in end.caches.items()} == {"base": 256, "swa": 128}
    assert end.n_stream("swa") == 5


def as_published(events: list[ev.Event]) -> list[bytes]:
    """Encoded events, with the time of the leading state events left out: the bus stamps the state it
    hands each new subscriber with the moment of that subscription."""
    n_state = next((i for i, e in enumerate(events) if e.seq_no != events[0].seq_no), len(events))
    return [encode_event(dataclasses.replace(e, time=0.0) if i < n_state else e) for i, e in enumerate(events)]


def test_every_event_reads_back_as_published(parallel_run):
    with RecordingReader(parallel_run.path) as rec:
        back = list(rec.events())
    assert as_published(back) == as_published(parallel_run.live)
    assert [e.seq_no for e in back] == [e.seq_no for e in parallel_run.live]
    assert back[0].kind == "ModelPlaced" and back[0].seq_no == back[6].seq_no  # it starts with the state


def test_replay_equals_the_live_mirror_at_every_keyframe_and_at_the_end(parallel_run):
    live = parallel_run.live
    with RecordingReader(parallel_run.path) as rec:
        for i, snapshot in live_snapshots(live, set(rec.keyframes)).items():
            diff = data_differences(snapshot, rec.mirror_at(i).snapshot())
            assert not diff, f"after event {i}: {diff[:5]}"
        end = rec.mirror_at(-1)
    assert_same(parallel_run.attached, end, "the end")
    ctx = parallel_run.ctx
    for cache in ctx.memory.caches():  # and the live mirror is the engine's cache
        for s in range(cache.n_stream):
            assert end.cells(s, cache.name) == cache.cells(s) and end.head(s, cache.name) == cache.head(s)


def test_any_event_from_its_keyframe_equals_a_replay_from_the_start(parallel_run):
    live = parallel_run.live
    picks = sorted(random.Random(5).sample(range(len(live)), 20) + [0, 1, KEYFRAME_EVERY - 2, KEYFRAME_EVERY])
    with RecordingReader(parallel_run.path) as rec:
        for i in picks:
            expected = replay(live[:i + 1])
            assert_same(expected, rec.mirror_at(i), f"event {i} from its keyframe")
            assert_same(expected, rec.mirror_at(i, from_keyframe=False), f"event {i} replayed from event 0")


def test_seek_forward_and_backward(parallel_run):
    live = parallel_run.live
    n = len(live)
    with RecordingReader(parallel_run.path) as rec:
        cursor, prev = None, -1
        for i in [n - 1, 0, 3, 4, KEYFRAME_EVERY + 7, KEYFRAME_EVERY - 1, n // 2, n // 2 + 1, n // 2 + 60, 2, -1]:
            mirror = rec.seek(i)
            i %= n
            assert rec.position == i
            assert_same(replay(live[:i + 1]), mirror, f"seek({i})")
            if prev < i:  # forward: the same mirror moves on, unless a keyframe in between is nearer
                assert (mirror is cursor) == (cursor is not None and not any(prev < k <= i for k in rec.keyframes))
            cursor, prev = mirror, i
        with pytest.raises(IndexError, match=f"event {n} is not in .*parallel.kvtrace, which has {n} events"):
            rec.seek(n)


def test_keyframes_store_the_vocabulary_once(parallel_run, tmp_path):
    """A keyframe refers to the Vocabulary event already in the file rather than storing it again."""
    with RecordingReader(parallel_run.path) as rec:
        n_keyframes = len(rec.keyframes)
    path = tmp_path / "one-keyframe.kvtrace"
    with Recorder(path, keyframe_every=len(parallel_run.live)) as recorder:
        for event in parallel_run.live:
            recorder.write(event)
    vocabulary = next(e for e in parallel_run.live if isinstance(e, ev.Vocabulary))
    vocab_bytes = len(encode_event(vocabulary))
    extra = parallel_run.path.stat().st_size - path.stat().st_size
    assert 0 < extra < (n_keyframes - 1) * vocab_bytes / 4, (extra, n_keyframes, vocab_bytes)
    with RecordingReader(parallel_run.path) as rec:
        for k in rec.keyframes:
            assert rec.mirror_at(k).vocabulary.pieces == vocabulary.pieces


# ---- a unified cache with every sequence operation ------------------------------------------------------
def prefill(ctx, seq_id, n, start=0):
    return ctx.decode(engine.Batch.for_sequence([1 + i % 50 for i in range(n)], seq_id, start))


def test_unified_cache_with_shifts_copies_removals_and_a_failed_decode(tmp_path):
    bus = engine.EventBus()
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, n_ubatch=8, n_seq_max=3, kv_unified=True, bus=bus)
    assert prefill(ctx, 0, 6) == 0  # before the recorder: it gets this as state
    recorder, live = recorded(tmp_path / "ops.kvtrace", bus, keyframe_every=7, chunk_events=3)
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.memory.seq_add(1, 2, -1, 3)
    assert prefill(ctx, 1, 2, start=9) == 0  # runs the K-shift first
    ctx.memory.seq_div(0, 0, -1, 2)
    assert prefill(ctx, 2, 5) == 0
    recorder.pump()
    ctx.memory.seq_rm(0, 2, -1)
    ctx.memory.seq_keep(1)
    assert prefill(ctx, 2, 30, start=5) == 1  # no slot: rc 1
    ctx.memory.clear()
    assert prefill(ctx, 0, 3) == 0
    recorder.close()
    events = live.drain()
    assert {"KShiftApplied", "CellsShifted", "CellsCopied", "CellsRemoved", "SlotSearchFailed"} <= {e.kind for e in
                                                                                                   events}
    with RecordingReader(recorder.path) as rec:
        assert len(rec) == len(events) and len(rec.keyframes) == len(events) // 7
        for i in range(len(events)):
            assert_same(replay(events[:i + 1]), rec.mirror_at(i), f"event {i}")
        assert rec.mirror_at(-1).cells(0) == ctx.memory.cells(0)


def test_a_background_recorder_writes_the_same_events(tmp_path):
    bus = engine.EventBus()
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, n_ubatch=8, n_seq_max=2, bus=bus)
    recorder, live = recorded(tmp_path / "bg.kvtrace", bus, keyframe_every=5)
    recorder.start(interval=0.001)
    for k in range(6):
        assert prefill(ctx, k % 2, 2, start=2 * (k // 2)) == 0
    recorder.close()
    events = live.drain()
    with RecordingReader(recorder.path) as rec:
        assert as_published(list(rec.events())) == as_published(events)
        assert_same(replay(events), rec.mirror_at(-1), "the end")


def test_a_recorder_that_lost_events_records_that_and_keyframes_keep_the_mirror_stale(tmp_path):
    bus = engine.EventBus()
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, n_ubatch=8, n_seq_max=2, bus=bus)
    recorder = Recorder(tmp_path / "lossy.kvtrace", keyframe_every=3)
    recorder.attach(bus, maxsize=2)
    for k in range(4):
        prefill(ctx, 0, 1, start=k)
        recorder.pump()  # the queue holds 2 events: the rest of each decode's are lost
    recorder.close()
    assert recorder.dropped > 0
    with RecordingReader(recorder.path) as rec:
        kinds = [e.kind for e in rec.events()]
        assert "EventsDropped" in kinds
        assert rec.mirror_at(-1).stale and rec.mirror_at(-1).same_as(rec.mirror_at(-1, from_keyframe=False))
        assert rec.keyframes and rec.mirror_at(rec.keyframes[-1]).stale


def test_writing_after_close_and_a_bad_path_are_recording_errors(tmp_path):
    recorder = Recorder(tmp_path / "closed.kvtrace")
    recorder.close()
    with pytest.raises(RecordingError, match="closed.kvtrace.*the recording is closed; DecodeStarted"):
        recorder.write(ev.DecodeStarted(1, 1, (0,)))
    with pytest.raises(RecordingError, match="no-such-dir/x.kvtrace: cannot create the recording"):
        Recorder(tmp_path / "no-such-dir" / "x.kvtrace")


# ---- versions, truncation and damage ----------------------------------------------------------------------
def small_recording(path: Path) -> list[ev.Event]:
    bus = engine.EventBus()
    ctx = engine.Context(in_memory_model(), n_ctx=32, pad=8, n_ubatch=4, n_seq_max=2, kv_unified=False, bus=bus)
    recorder, live = recorded(path, bus, keyframe_every=6, chunk_events=4)
    for k in range(5):
        prefill(ctx, k % 2, 3, start=3 * (k // 2))
        recorder.pump()
    recorder.close()
    return live.drain()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, list[ev.Event]]:
    path = tmp_path_factory.mktemp("small") / "small.kvtrace"
    return path, small_recording(path)


def copy_with(tmp_path: Path, data: bytes, name: str) -> Path:
    out = tmp_path / name
    out.write_bytes(data)
    return out


def chunks_of(path: Path):
    with RecordingReader(path) as rec:
        return rec._event_chunks, rec._keyframe_chunks, rec.data_start


@pytest.mark.parametrize("schema", [ev.SCHEMA_VERSION + 1, ev.SCHEMA_VERSION - 1])
def test_a_recording_of_another_schema_version_is_refused_by_name(tmp_path, monkeypatch, schema):
    monkeypatch.setattr(ev, "SCHEMA_VERSION", schema)
    with Recorder(tmp_path / "other.kvtrace") as recorder:
        recorder.write(ev.DecodeStarted(1, 1, (0,)))
    monkeypatch.undo()
    newer = "a newer" if schema > ev.SCHEMA_VERSION else "an older"
    with pytest.raises(RecordingError, match=f"other.kvtrace, byte 10: its events are of schema version {schema}, "
                                             f"written by {newer} kvscope; this kvscope reads schema version "
                                             f"{ev.SCHEMA_VERSION}"):
        RecordingReader(tmp_path / "other.kvtrace")


def test_a_newer_file_format_is_refused_by_name(small, tmp_path):
    data = bytearray(small[0].read_bytes())
    data[8:10] = struct.pack("<H", 2)
    path = copy_with(tmp_path, bytes(data), "format2.kvtrace")
    with pytest.raises(RecordingError, match="format2.kvtrace, byte 8: file format version 2: written by a newer "
                                             "kvscope"):
        RecordingReader(path)


def test_a_file_that_is_no_recording(tmp_path):
    path = tmp_path / "notes.kvtrace"
    path.write_text("hello, this is text\n")
    with pytest.raises(RecordingError, match="notes.kvtrace, byte 0: not a kvscope recording"):
        RecordingReader(path)
    with pytest.raises(RecordingError, match="missing.kvtrace: cannot open the recording"):
        RecordingReader(tmp_path / "missing.kvtrace")


@pytest.mark.parametrize("cut", [0, 3, 8, 12, 17, -1], ids=lambda c: f"cut{c}")
def test_a_file_cut_inside_its_header_is_an_error_naming_the_offset(small, tmp_path, cut):
    data_start = chunks_of(small[0])[2]
    cut = data_start - 1 if cut == -1 else cut
    path = copy_with(tmp_path, small[0].read_bytes()[:cut], "cut.kvtrace")
    with pytest.raises(RecordingError, match=r"cut.kvtrace, byte \d+: .*(truncated|not a kvscope recording)") as err:
        RecordingReader(path)
    assert err.value.offset is not None and err.value.offset <= cut


def test_a_file_cut_inside_a_chunk_reads_up_to_the_last_complete_chunk(small, tmp_path):
    full, live = small
    event_chunks = chunks_of(full)[0]
    data = full.read_bytes()
    for chunk in event_chunks[1:]:
        for cut, where in ((chunk.offset + 5, "ends inside the head of a chunk"),
                           (chunk.offset + CHUNK_HEAD_SIZE + 3, "ends inside a chunk"),
                           (chunk.offset, "ends after its last chunk without an index")):
            path = copy_with(tmp_path, data[:cut], f"cut{cut}.kvtrace")
            with RecordingReader(path) as rec:
                assert rec.truncated and len(rec) == chunk.first, (cut, len(rec))
                assert f"cut{cut}.kvtrace, byte {chunk.offset}: the recording {where}" in rec.warnings[0]
                assert f"{chunk.first} events are readable" in rec.warnings[0]
                assert_same(replay(live[:chunk.first]), rec.mirror_at(-1), f"cut at {cut}")
                assert all(k < chunk.first for k in rec.keyframes)


@pytest.mark.parametrize("back", [1, 15, 17, 30])
def test_a_file_cut_in_its_index_or_trailer_reads_every_event(small, tmp_path, back):
    full, live = small
    path = copy_with(tmp_path, full.read_bytes()[:-back], "no-index.kvtrace")
    with RecordingReader(path) as rec:
        assert rec.truncated and len(rec) == len(live)
        assert "no-index.kvtrace, byte " in rec.warnings[0]
        assert "the recording ends inside its index and trailer" in rec.warnings[0]
        assert_same(replay(live), rec.mirror_at(-1), "the end")


def test_a_damaged_chunk_payload_names_the_file_and_offset(small, tmp_path):
    full, live = small
    event_chunks, _, _ = chunks_of(full)
    chunk = event_chunks[2]
    data = bytearray(full.read_bytes())
    data[chunk.offset + CHUNK_HEAD_SIZE + 2] ^= 0xFF
    path = copy_with(tmp_path, bytes(data), "flipped.kvtrace")
    with RecordingReader(path) as rec:  # the index is intact, so the file opens
        assert as_published(list(rec.events(0, chunk.first))) == as_published(live[:chunk.first])
        message = f"flipped.kvtrace, byte {chunk.offset + CHUNK_HEAD_SIZE}: the chunk's payload is damaged"
        with pytest.raises(RecordingError, match=message):
            rec.event(chunk.first)
        with pytest.raises(RecordingError, match=message):
            rec.mirror_at(chunk.first)
        with pytest.raises(RecordingError, match=message):
            rec.mirror_at(-1, from_keyframe=False)
        assert rec.keyframes[-1] >= chunk.first + chunk.count  # a later keyframe steps over the damage
        assert_same(replay(live), rec.mirror_at(-1), "the end")


def test_a_damaged_chunk_head_names_the_file_and_offset(small, tmp_path):
    full, _ = small
    chunk = chunks_of(full)[0][1]
    data = bytearray(full.read_bytes())
    data[chunk.offset + 9] ^= 0x01  # in `first`
    path = copy_with(tmp_path, bytes(data), "head.kvtrace")
    with RecordingReader(path) as rec, pytest.raises(RecordingError,
                                                     match=f"head.kvtrace, byte {chunk.offset}: a damaged chunk head"):
        list(rec.events())
    truncated = copy_with(tmp_path, bytes(data[:-20]), "head-no-index.kvtrace")
    with pytest.raises(RecordingError, match=f"head-no-index.kvtrace, byte {chunk.offset}: a damaged chunk head"):
        RecordingReader(truncated)  # scanning meets it


def read_everything(path: Path) -> None:
    with RecordingReader(path) as rec:
        events = list(rec.events())
        if len(rec):
            rec.mirror_at(-1)
            for k in rec.keyframes:
                rec.mirror_at(k)
        assert len(events) == len(rec)


def test_random_damage_and_cuts_give_recording_errors_only(small, tmp_path):
    """What a viewer meets on a bad file: a RecordingError, or a readable (maybe shorter) recording."""
    full, _ = small
    data = full.read_bytes()
    rng = random.Random(11)
    path = tmp_path / "fuzz.kvtrace"
    outcomes = {"error": 0, "read": 0}
    for trial in range(150):
        damaged = bytearray(data)
        if trial % 3 == 0:
            damaged = damaged[:rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 3)):
                damaged[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            read_everything(path)
            outcomes["read"] += 1
        except RecordingError as e:
            assert "fuzz.kvtrace" in str(e) and e.offset is not None, e
            outcomes["error"] += 1
    assert outcomes["error"] > 20 and outcomes["read"] > 20, outcomes


def test_readers_of_one_file_are_independent(small, tmp_path):
    full, live = small
    shutil.copy(full, tmp_path / "a.kvtrace")
    with RecordingReader(tmp_path / "a.kvtrace") as a, RecordingReader(full) as b:
        a.seek(5)
        b.seek(len(live) - 1)
        assert a.seek(6).same_as(replay(live[:7])) and b.position == len(live) - 1
        assert np.array_equal(a.mirror_at(3).caches["kv"].streams[0].pos,
                              replay(live[:4]).caches["kv"].streams[0].pos)


def test_chunks_close_every_chunk_events_and_at_each_keyframe(small):
    """small_recording: chunk_events=4, keyframe_every=6."""
    event_chunks, keyframes, _ = chunks_of(small[0])
    assert {c.tag for c in event_chunks} == {EVENTS} and {c.tag for c in keyframes} == {KEYFRAME}
    firsts, count = [0], 0
    for n in range(1, len(small[1]) + 1):
        count += 1
        if n % 6 == 0 or count == 4:
            firsts.append(n)
            count = 0
    assert [c.first for c in event_chunks] == [f for f in firsts if f < len(small[1])]
    assert [c.first for c in keyframes] == list(range(6, len(small[1]) + 1, 6))
    assert all(k.offset > c.offset for k in keyframes for c in event_chunks if c.first < k.first)


def test_the_file_is_as_documented(small):
    """Parse a recording with docs/recording-format.md alone (struct, zlib and msgpack, no kvscope code)."""
    path, live = small
    data = path.read_bytes()
    assert data[:8] == b"\x89KVT\r\n\x1a\n"
    fmt, schema, n = struct.unpack_from("<HHI", data, 8)
    assert (fmt, schema) == (1, ev.SCHEMA_VERSION)
    assert struct.unpack_from("<I", data, 16 + n)[0] == zlib.crc32(data[8:16 + n])
    info = msgpack.unpackb(data[16:16 + n])
    assert info["keyframe_every"] == 6 and info["writer"].startswith("kvscope")
    index_offset, magic = struct.unpack_from("<Q8s", data, len(data) - 16)
    assert magic == b"KVTINDEX"
    offset, chunks, events, keyframes = 16 + n + 4, [], [], {}
    while offset < len(data) - 16:
        tag, compression, zeros, first, count, raw_len, stored_len, crc = struct.unpack_from("<4sB3sQIIII", data,
                                                                                            offset)
        assert zeros == bytes(3)
        assert struct.unpack_from("<I", data, offset + 32)[0] == zlib.crc32(data[offset:offset + 32])
        stored = data[offset + 36:offset + 36 + stored_len]
        assert zlib.crc32(stored) == crc
        raw = zlib.decompress(stored) if compression == 1 else stored
        assert len(raw) == raw_len
        if tag == b"INDX":
            assert offset == index_offset and msgpack.unpackb(raw) == [list(c) for c in chunks]
        else:
            chunks.append((tag.decode(), offset, first, count))
            entries, pos = [], 0
            for _ in range(count):
                (length,) = struct.unpack_from("<I", raw, pos)
                if length == 0xFFFFFFFF:
                    entries.append(struct.unpack_from("<QI", raw, pos + 4))
                    pos += 16
                else:
                    entries.append(raw[pos + 4:pos + 4 + length])
                    pos += 4 + length
            assert pos == len(raw)
            if tag == b"EVTS":
                assert first == len(events)
                events += entries
            else:
                keyframes[first] = entries
        offset += 36 + stored_len
    assert offset == len(data) - 16
    decoded = [msgpack.unpackb(e, ext_hook=lambda code, payload: (code, payload)) for e in events]
    assert [(d[0], d[1]) for d in decoded] == [(e.kind, e.seq_no) for e in live]
    allocated = next(d for d, e in zip(decoded, live) if e.kind == "CellsAllocated")
    code, payload = allocated[3]["tokens"][0]
    dtype_len = payload[0]
    dtype, ndim = payload[1:1 + dtype_len].decode(), payload[1 + dtype_len]
    shape = struct.unpack_from(f"<{ndim}Q", payload, 2 + dtype_len)
    tokens = np.frombuffer(payload[2 + dtype_len + 8 * ndim:], dtype=dtype).reshape(shape)
    first_allocation = next(e for e in live if e.kind == "CellsAllocated")
    assert code == 1 and np.array_equal(tokens, first_allocation.tokens[0])
    assert sorted(keyframes) == list(range(6, len(live) + 1, 6))
    kinds = [msgpack.unpackb(e, ext_hook=lambda c, p: None)[0] for e in keyframes[6]]
    assert kinds[0] == "ModelPlaced" and kinds[-1] == "MemorySnapshot"
