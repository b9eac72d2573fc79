"""Replay (engine/watch/replay.py): a cursor over a recording that leaves its Watcher exactly as a live
watcher that received the same events was after the same event (mirror, frame columns, status, history
of the events replayed), forward and backward, by steps and by jumps; frames mark what a jump changed;
jumps to the next event of some kinds; moves past either end stop there; a cut recording replays what
it holds."""
from __future__ import annotations

import copy
import dataclasses
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import numpy as np
import pytest

import engine
from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.sampling import SamplerParams
from engine.watch import Recorder, RecordingReader, Watcher
from engine.watch.codec import CodecError, encode_event, event_kind
from engine.watch.frames import Frame
from engine.watch.history import CellHistory
from engine.watch.mirror import data_differences
from engine.watch.replay import Replay, concerns_seq

KEYFRAME_EVERY = 64
SHIFT_AT_STEP, FAIL_AT_STEP = 10, 14
COLUMNS = ("pos", "owner", "n_seqs", "shift")


class _Events:
    """A subscription that hands over a list of events once."""

    def __init__(self, events: list[ev.Event]) -> None:
        self.queue = list(events)

    def drain(self) -> list[ev.Event]:
        out, self.queue = self.queue, []
        return out


@dataclasses.dataclass
class LiveState:
    """What the live watcher showed after event `index` (taken between two workload steps)."""

    index: int
    snapshot: dict
    frame: Frame
    history: CellHistory  # a copy
    status: tuple


@dataclasses.dataclass
class Run:
    path: Path
    events: list[ev.Event]  # every event the live watcher received, in order
    states: list[LiveState]


def status_of(watcher: Watcher) -> tuple:
    """The status a view shows, as the seq_no of each event it comes from (the objects differ after a round trip)."""
    return tuple(e.seq_no if e is not None else None for e in (watcher.status, watcher.last_step, watcher.last_error))


def cells_of(watcher: Watcher) -> list[tuple[str, int, int]]:
    return [(name, s, c) for name, cache in watcher.mirror.caches.items() for s in range(len(cache.streams))
            for c in range(cache.size)]


def live_state(watcher: Watcher) -> LiveState:
    return LiveState(watcher.events - 1, watcher.mirror.snapshot(), watcher.frame(), copy.deepcopy(watcher.history),
                     status_of(watcher))


def fail_a_decode_after_its_first_ubatch(session: Session, seq_id: int) -> None:
    """seq_id (no client's) fills its stream but for one ubatch, then sends two: the dry run places the
    first and finds no cell for the second, so the rollback restores the stream's head from another
    stream's (QUIRK_DRY_RUN_HEADS) and the decode returns 1. Then seq_id is removed."""
    ctx = session.ctx
    size, n_ubatch = ctx.memory.base.size, ctx.params.n_ubatch
    tokens = [5 + p % 40 for p in range(size + n_ubatch)]
    for p0 in range(0, size - n_ubatch, n_ubatch):
        assert ctx.decode(engine.Batch(tokens[p0:p0 + n_ubatch], list(range(p0, p0 + n_ubatch)),
                                       [[seq_id]] * n_ubatch)) == 0
    p0 = size - n_ubatch
    assert ctx.decode(engine.Batch(tokens[p0:], list(range(p0, p0 + 2 * n_ubatch)), [[seq_id]] * 2 * n_ubatch)) == 1
    session.seq_rm(seq_id).result()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """The demo model (an iSWA pair) with split streams running llama.cpp's parallel example, a context shift
    of seq 2 (a K-shift follows) and a failing command on the way; a live watcher and a recorder attached
    together. The live watcher's state is kept after every step."""
    path = tmp_path_factory.mktemp("replay") / "parallel.kvtrace"
    spec = WorkloadSpec("parallel", n_clients=4, n_sequences=8, n_predict=24, arrival_gap=1,
                        sampler=SamplerParams(temperature=0.0, seed=1))
    session = Session("demo", settings=dict(n_ctx=1536, pad=32, n_seq_max=6, kv_unified=False, n_batch=64,
                                            n_ubatch=32, swa_full=True), workload=spec, threaded=False)
    try:
        live = Watcher.of(session, recent=1 << 20)
        recorder = Recorder(path, keyframe_every=KEYFRAME_EVERY)
        recorder.attach(session.bus)
        live.poll()
        states = [live_state(live)]
        for step in range(1, 200):
            if step == SHIFT_AT_STEP:
                session.context_shift(2, n_keep=4).result()
            if step == FAIL_AT_STEP:
                with pytest.raises(KvscopeError):
                    session.seq_rm(99).result()
                fail_a_decode_after_its_first_ubatch(session, seq_id=5)
            done = session.step(1).result()
            recorder.pump()
            live.poll()
            states.append(live_state(live))
            if done[-1].phase == "idle":
                break
        recorder.close()
    finally:
        session.close()
    return Run(path, list(live.recent), states)


@pytest.fixture
def reader(run):
    with RecordingReader(run.path) as r:
        yield r


def reference(run: Run, i: int) -> Watcher:
    """A watcher given the live watcher's events up to event i, as it received them."""
    watcher = Watcher(_Events(run.events[:i + 1]))
    watcher.poll()
    return watcher


def columns_differences(expected: Frame, got: Frame) -> list[str]:
    diffs = [] if [(s.cache, s.stream, s.head) for s in expected.streams] == [
        (s.cache, s.stream, s.head) for s in got.streams] else ["streams or heads differ"]
    for e, g in zip(expected.streams, got.streams):
        diffs += [f"{e.cache}/{e.stream}/{c}" for c in COLUMNS if not np.array_equal(getattr(e, c), getattr(g, c))]
    return diffs


def assert_history_of_replayed_events(expected: CellHistory, replay: Replay, where: str) -> None:
    """Every cell keeps the expected entries of the events the replay's watcher was given, and a cell whose
    remembered events all lie there tells the same story."""
    since = replay.reader.event(replay.history_from).seq_no
    history = replay.watcher.history
    for key in cells_of(replay.watcher):
        entries = expected.entries(*key)
        kept = [e for e in entries if e.seq_no >= since]
        assert history.entries(*key) == kept, f"{where}: cell {key}"
        if len(kept) == len(entries):
            assert history.explain(*key) == expected.explain(*key), f"{where}: cell {key}"


def assert_like(replay: Replay, expected: Watcher, where: str) -> None:
    assert replay.watcher.mirror.same_as(expected.mirror), where
    assert not columns_differences(expected.frame(), replay.watcher.frame()), where
    assert status_of(replay.watcher) == status_of(expected), where
    assert (replay.watcher.history.step, replay.watcher.history.in_decode) == (expected.history.step,
                                                                               expected.history.in_decode), where
    assert_history_of_replayed_events(expected.history, replay, where)


# ---- the run itself ---------------------------------------------------------------------------------------
def test_the_recording_holds_what_the_live_watcher_received(run, reader):
    assert [(e.kind, e.seq_no) for e in reader.events()] == [(e.kind, e.seq_no) for e in run.events]
    assert len(reader.keyframes) >= 5
    kinds = {e.kind for e in run.events}
    assert {"KShiftApplied", "SlotsRolledBack", "CellsRemoved", "CellsCopied", "CommandDone"} <= kinds
    assert any(e.kind == "SlotsRolledBack" and e.quirk for e in run.events)
    assert any(isinstance(e, ev.CommandDone) and not e.ok for e in run.events)


# ---- the watcher after any move equals the live one ----------------------------------------------------
@pytest.mark.parametrize("context", [1, 256])
def test_at_the_live_watchers_steps_in_any_order(run, reader, context):
    """context=1 rebuilds from the keyframe right before the target, so status, last step, last error and
    the decode step of history entries come from events the replay never applies."""
    replay = Replay(reader, context=context)
    states = run.states[:]
    random.Random(context).shuffle(states)
    for state in states[:12] + sorted(states[12:24], key=lambda s: s.index) + sorted(
            states[24:], key=lambda s: -s.index):
        where = f"seek({state.index}), context {context}"
        replay.seek(state.index)
        assert replay.position == state.index, where
        diff = data_differences(state.snapshot, replay.watcher.mirror.snapshot())
        assert not diff, f"{where}: {diff[:5]}"
        assert status_of(replay.watcher) == state.status, where
        assert not columns_differences(state.frame, replay.watcher.frame()), where
        assert_history_of_replayed_events(state.history, replay, where)


def test_stepping_one_event_at_a_time_matches_a_watcher_fed_the_same_events(run, reader):
    replay = Replay(reader)
    watcher = Watcher(_Events([]))
    for i, event in enumerate(run.events[:3 * KEYFRAME_EVERY]):
        replay.step()
        watcher.apply(event)
        assert replay.position == i and replay.rebuilds == 0
        if i % 17 == 0:
            assert_like(replay, watcher, f"step to {i}")
    assert [e.seq_no for e in replay.watcher.recent] == [e.seq_no for e in watcher.recent]


@pytest.mark.parametrize("context", [1, 256])
def test_any_event_forward_and_backward(run, reader, context):
    n = len(reader)
    rnd = random.Random(10 + context)
    picks = rnd.sample(range(n), 25) + [0, n - 1] + [k + d for k in reader.keyframes[:3] for d in (-1, 0, 1)]
    replay = Replay(reader, context=context)
    for i in picks + sorted(picks) + sorted(picks, reverse=True):
        replay.seek(i)
        assert_like(replay, reference(run, i), f"seek({i}), context {context}")


def test_a_rebuild_replays_at_least_context_events_and_at_most_a_keyframe_more(run, reader):
    context = 100
    replay = Replay(reader, context=context)
    spacing = KEYFRAME_EVERY
    for i in random.Random(3).sample(range(len(reader)), 30):
        replay.seek(i)
        replay.step(-1)
        i -= 1
        replayed = i - replay.history_from + 1
        assert min(context, i + 1) <= replayed < context + spacing or replay.history_from == 0, i
        assert [e.seq_no for e in replay.watcher.recent] == [e.seq_no for e in run.events[replay.history_from:i + 1]]


def test_short_moves_forward_apply_events_and_moves_backward_or_far_rebuild(reader):
    context = 50
    replay = Replay(reader, context=context)
    k1, k3 = reader.keyframes[1], reader.keyframes[3]
    replay.seek(k1 + 1)
    rebuilds = replay.rebuilds
    for n in (1, 1, 7, 30):
        replay.step(n)
    assert replay.position == k1 + 40 and replay.rebuilds == rebuilds
    replay.step(-1)
    assert replay.position == k1 + 39 and replay.rebuilds == rebuilds + 1
    replay.seek(k3 + context + 5)  # keyframe k3 lies after the position: replaying from it is shorter
    assert replay.rebuilds == rebuilds + 2 and replay.history_from == k3 + 1
    replay.seek(reader.keyframes[4] + context - 1)  # a rebuild would start from k3 too: the position is past it
    assert replay.rebuilds == rebuilds + 2 and replay.history_from == k3 + 1


def test_the_watcher_object_stays_and_poll_changes_nothing(reader):
    replay = Replay(reader)
    watcher = replay.watcher
    replay.seek(len(reader) // 2)
    before = watcher.mirror.snapshot()
    replay.seek(10)
    replay.step(3)
    assert replay.watcher is watcher
    assert watcher.poll() == 0 and watcher.events == 14 and not watcher.stale
    replay.seek(len(reader) // 2)
    assert not data_differences(before, watcher.mirror.snapshot())


# ---- frames across moves --------------------------------------------------------------------------
def differs(a: Frame, b: Frame, cache: str, stream: int) -> np.ndarray:
    x, y = a.stream(cache, stream), b.stream(cache, stream)
    return np.logical_or.reduce([getattr(x, c) != getattr(y, c) for c in COLUMNS])


def tentative_cells(events: list[ev.Event], cache: str, stream: int, size: int) -> np.ndarray:
    """Cells the dry run of the last decode among `events` touched (a frame shows that decode's slot search)."""
    marked = np.zeros(size, dtype=bool)
    for event in events:
        if isinstance(event, ev.DecodeStarted):
            marked[:] = False
        if isinstance(event, ev.CellsChanged) and event.tentative and event.cache == cache:
            for change in event.changes:
                if change.stream == stream:
                    marked[change.cells] = True
    return marked


def test_the_first_frame_after_any_move_marks_what_the_move_changed(run, reader):
    replay = Replay(reader, context=40)
    rnd = random.Random(4)
    replay.seek(KEYFRAME_EVERY)
    previous = replay.watcher.frame()
    moves = [("step", 1), ("step", 5), ("seek", None), ("step", -1), ("seek", None), ("step", 200), ("step", -300)]
    paths = set()
    for kind, amount in moves * 3:
        was, rebuilds = replay.position, replay.rebuilds
        if kind == "step":
            replay.step(amount)
        else:
            replay.seek(rnd.randrange(len(reader)))
        frame = replay.watcher.frame()
        rebuilt = replay.rebuilds > rebuilds
        paths.add(rebuilt)
        passed = [run.events[replay.position]] if rebuilt else run.events[was + 1:replay.position + 1]
        assert frame.seq_no == run.events[replay.position].seq_no
        for s in frame.streams:
            where = f"{kind} {amount} to {replay.position}: {s.cache}/{s.stream}"
            assert np.array_equal(s.changed, differs(previous, frame, s.cache, s.stream)), where
            assert np.array_equal(s.tentative, tentative_cells(passed, s.cache, s.stream, s.size)), where
        again = replay.watcher.frame()
        assert not any(s.changed.any() or s.tentative.any() for s in again.streams)
        previous = again
    assert paths == {True, False}  # moves by events applied and by rebuilds


def test_a_frame_before_the_first_event_is_empty_and_the_next_one_marks_every_cell(reader):
    replay = Replay(reader)
    replay.seek(len(reader) - 1)
    replay.watcher.frame()
    replay.seek(-1)
    assert replay.watcher.frame().streams == () and replay.watcher.mirror.caches == {}
    replay.seek(len(reader) - 1)
    frame = replay.watcher.frame()
    for s in frame.streams:
        assert np.array_equal(s.changed, s.pos >= 0)


# ---- jumps to events of some kinds -------------------------------------------------------------------
def indices(run: Run, test) -> list[int]:
    return [i for i, e in enumerate(run.events) if test(e)]


@pytest.mark.parametrize("query, test", [
    (dict(kinds="KShiftApplied"), lambda e: e.kind == "KShiftApplied"),
    (dict(kinds=ev.SlotsRolledBack, quirk=True), lambda e: e.kind == "SlotsRolledBack" and bool(e.quirk)),
    (dict(kinds="CellsRemoved", seq_id=2), lambda e: e.kind == "CellsRemoved" and e.seq_id in (2, -1)),
    (dict(kinds=[ev.CellsAllocated, "CellsCopied"], cache="swa"),
     lambda e: e.kind in ("CellsAllocated", "CellsCopied") and e.cache == "swa"),
    (dict(kinds=ev.CellsChanged, seq_id=3, cache="base"),
     lambda e: isinstance(e, ev.CellsChanged) and e.cache == "base" and concerns_seq(e, 3)),
    (dict(seq_id=1, where=lambda e: isinstance(e, ev.TokenSampled)),
     lambda e: isinstance(e, ev.TokenSampled) and e.seq_id == 1),
], ids=["kshift", "quirky-rollback", "removed-seq2", "swa-placed-or-copied", "base-changes-of-seq3",
        "tokens-of-seq1"])
def test_next_of_and_previous_of_visit_every_such_event_in_order(run, reader, query, test):
    expected = indices(run, test)
    assert expected, "the run has such events"
    replay = Replay(reader)
    forward = []
    while (found := replay.next_of(**query)) is not None:
        assert replay.position == found
        forward.append(found)
    assert forward == expected
    assert replay.position == expected[-1]
    backward = []
    while (found := replay.previous_of(**query)) is not None:
        backward.append(found)
    assert backward == expected[-2::-1] and replay.position == expected[0]
    assert replay.find(**query, start=-1) == expected[0]
    assert replay.find(**query, start=len(reader), backward=True) == expected[-1]


def test_a_jump_lands_on_the_event_with_the_live_watchers_state(run, reader):
    replay = Replay(reader, context=1)
    first_kshift = replay.next_of("KShiftApplied")
    assert replay.event.kind == "KShiftApplied" and replay.event.seq_no == run.events[first_kshift].seq_no
    expected = reference(run, first_kshift)
    assert replay.watcher.mirror.same_as(expected.mirror)
    assert all(s.shift.max(initial=0) == 0 for s in replay.watcher.frame().streams)  # the K-shift applied every shift
    removal = replay.previous_of(ev.CellsRemoved, seq_id=2)
    assert removal is not None and removal < first_kshift and replay.event.seq_id == 2
    assert "context shift" in replay.event.cause


def test_a_seq_filter_reads_the_sequences_an_event_names_or_else_its_cells_hold(run):
    allocated = [e for e in run.events if isinstance(e, ev.CellsAllocated) and not e.tentative]
    for event in allocated[:40]:
        held = set().union(*(s for c in event.changes for s in c.seq_sets()))
        for seq in range(5):
            assert concerns_seq(event, seq) == (seq in held)
    copied = next(e for e in run.events if isinstance(e, ev.CellsCopied))
    assert [s for s in range(5) if concerns_seq(copied, s)] == sorted({copied.src_seq, copied.dst_seq})
    every_sequence = ev.CellsRemoved(cache="kv", changes=(), reason="clear")  # seq_id -1
    assert all(concerns_seq(every_sequence, s) for s in range(5))
    assert not concerns_seq(ev.WorkloadStep(1, "parallel", "batch", 4, 4, 0, 1.0, (0, 1, 2)), 1)


def test_no_such_event_leaves_the_cursor_where_it_was(reader):
    replay = Replay(reader)
    replay.seek(len(reader) - 1)
    assert replay.next_of("KShiftApplied") is None and replay.at_end
    replay.seek(5)
    assert replay.previous_of("KShiftApplied") is None and replay.position == 5
    assert replay.next_of("AttentionWeights") is None and replay.position == 5  # a kind the run never published
    with pytest.raises(KvscopeError, match="'NoSuchEvent' is not an event kind"):
        replay.next_of("NoSuchEvent")
    with pytest.raises(KvscopeError, match="is not an event kind"):
        replay.next_of(ev.StreamCells)


# ---- the ends ------------------------------------------------------------------------------------------
def test_moves_past_either_end_stop_there(reader):
    n = len(reader)
    replay = Replay(reader)
    assert replay.position == -1 and replay.at_start and replay.event is None and replay.fraction == 0.0
    assert replay.step(-3) == -1 and replay.seek(-50) == -1
    assert replay.seek(n + 10) == n - 1 and replay.at_end and replay.fraction == 1.0
    assert replay.step(5) == n - 1 and replay.step() == n - 1
    assert replay.seek_fraction(0.0) == -1 and replay.seek_fraction(-2) == -1
    assert replay.seek_fraction(1.0) == n - 1 and replay.seek_fraction(7.5) == n - 1
    assert replay.seek_fraction(0.5) == round(0.5 * n) - 1
    assert math.isclose(replay.fraction, (round(0.5 * n)) / n)
    with pytest.raises(KvscopeError, match="fraction must be a number"):
        replay.seek_fraction(float("nan"))
    with pytest.raises(KvscopeError, match="n must be an int"):
        replay.step(1.5)
    with pytest.raises(KvscopeError, match="context must be >= 1"):
        Replay(reader, context=0)


def test_a_cut_recording_replays_what_it_holds(run, tmp_path):
    data = run.path.read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[:len(data) * 3 // 5])
    with Replay.open(cut) as replay:
        n = len(replay)
        assert replay.reader.truncated and 0 < n < len(run.events)
        assert replay.seek(len(run.events)) == n - 1 and replay.at_end
        expected = reference(run, n - 1)
        assert replay.watcher.mirror.same_as(expected.mirror)
        assert status_of(replay.watcher) == status_of(expected)
        later = indices(run, lambda e: e.kind == "KShiftApplied")
        assert replay.find("KShiftApplied", start=-1) == (later[0] if later[0] < n else None)
        assert replay.seek(n // 3) == n // 3
        assert replay.watcher.mirror.same_as(reference(run, n // 3).mirror)


def test_an_empty_recording(tmp_path):
    path = tmp_path / "empty.kvtrace"
    Recorder(path).close()
    with Replay.open(path) as replay:
        assert len(replay) == 0 and replay.at_end and replay.at_start
        assert replay.step() == -1 and replay.seek_fraction(0.7) == -1 and replay.next_of() is None
        assert replay.watcher.frame().streams == ()


def test_a_replay_needs_no_torch(run):
    code = f"""
        import sys
        sys.modules["torch"] = None  # any 'import torch' now raises ImportError
        from engine.watch.replay import Replay
        with Replay.open({str(run.path)!r}) as replay:
            replay.seek_fraction(0.5)
            replay.next_of("KShiftApplied")
            replay.step(-1)
            assert replay.watcher.frame().streams
        engine_side = [m for m in sys.modules if m.startswith(("engine.context", "engine.models", "engine.runners"))]
        assert not engine_side, engine_side
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr


# ---- the kinds a jump searches, read without decoding ---------------------------------------------------
def test_a_recordings_kinds_are_read_from_its_bytes(run, reader):
    assert reader.kinds() == tuple(e.kind for e in run.events)
    assert encode_event(run.events[5])[:1] == b"\x94" and event_kind(encode_event(run.events[5])) == run.events[5].kind


@pytest.mark.parametrize("data", [b"", b"\x94", b"\x94\xa5Cel", msgpack.packb([1, 2, 3, 4]),
                                  msgpack.packb(["Kind", 1])])
def test_the_kind_of_bytes_that_are_no_event_is_a_codec_error(data):
    with pytest.raises(CodecError, match="not an encoded event"):
        event_kind(data)
