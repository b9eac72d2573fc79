"""The server simulation as a session's workload: run from the worker while a watcher follows it, the watch
layer's slots (engine/watch/server_slots.py) tell what the server decided, checkpoints show as host memory,
a watcher that starts late gets them too, and commands and stop() behave."""
from __future__ import annotations

import json
import time

import pytest

from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.watch.watcher import Watcher
from tests.test_session import assert_watch_equals_engine

SETTINGS = dict(n_ctx=2048, n_seq_max=2, n_batch=64, n_ubatch=64)
GREEDY = {"temperature": 0.0}


def server_spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(kind="server", n_clients=2, sampler=GREEDY, **kw)


def wait_until_idle(session: Session, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while session.status().state != "idle":
        assert time.monotonic() < deadline, f"still {session.status().state}"
        time.sleep(0.02)


def test_the_demo_chats_run_on_the_worker_and_the_watch_layer_follows(tmp_path):
    with Session("demo", settings=SETTINGS, workload=server_spec()) as session:
        watcher = Watcher.of(session)
        finished = session.subscribe(kinds=(ev.ServerTaskFinished,))
        session.start().result(30)
        wait_until_idle(session)
        assert_watch_equals_engine(watcher, session)
        done = finished.drain()
        slots = watcher.server
        assert len(done) == 8 and slots.totals()["tasks"] == 8
        assert slots.totals()["processed"] == sum(d.n_processed for d in done)
        assert slots.totals()["reused"] == sum(d.n_cached for d in done)
        assert slots.totals()["forced"] >= 1 and slots.totals()["restored"] >= 1  # the demo script shows both
        sim = session._workload.sim
        assert slots.checkpoint_bytes == sim.checkpoints.bytes_held > 0
        assert watcher.mirror.devices.rows["CPU"].bytes["checkpoints"] == sim.checkpoints.bytes_held
        for slot in sim.slots:
            view = slots.slots[slot.id]
            assert sorted(view.checkpoints) == sorted(cp.n_tokens for cp in slot.checkpoints)
            assert view.n_kept == len(slot.tokens) and view.current is None
        late = Watcher.of(session)  # starts from the session's state: the checkpoints are in it
        late.poll()
        assert late.server.checkpoint_bytes == sim.checkpoints.bytes_held
        assert late.mirror.devices.rows["CPU"].bytes["checkpoints"] == sim.checkpoints.bytes_held


def test_a_command_on_an_idle_slot_is_followed_by_the_next_turn(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"conversations": [{"slot": 0, "turns": [
        {"user": "Who was Moses?", "n_predict": 4}, {"user": "And Aaron?", "n_predict": 4}]}]}))
    with Session("demo", settings={**SETTINGS, "swa_full": True}, workload=server_spec(chat=str(chat)),
                 threaded=False) as session:
        sub = session.subscribe(kinds=(ev.ServerPromptReused,))
        sim = session._workload.sim
        while not sim.finished:
            session.step().result()
        session.seq_rm(0, 10, -1).result()  # the slot keeps its first 10 positions
        session.step(200).result()
        second = [e for e in sub.drain() if isinstance(e, ev.ServerPromptReused)][-1]
        assert (second.n_kept, second.n_past) == (10, 10)


def test_stop_ends_a_workload_that_owns_its_sequences():
    for spec in (server_spec(), WorkloadSpec(kind="parallel", n_clients=2, sampler=GREEDY)):
        with Session("demo", settings=SETTINGS, workload=spec, threaded=False) as session:
            session.step(5).result()
            session.stop().result()
            assert session.status().state == "stopped"


def test_a_working_slot_refuses_a_context_shift_and_a_loaded_state():
    with Session("demo", settings={**SETTINGS, "swa_full": True}, workload=server_spec(), threaded=False) as session:
        session.step(3).result()
        busy = session._workload.active_seqs()[0]
        with pytest.raises(KvscopeError, match=f"slot {busy} is processing a task"):
            session.context_shift(busy, 4).result()
        with pytest.raises(KvscopeError, match="the server workload owns its slots"):
            session.load_state(session.save_state(seq_id=busy).result(), seq_id=busy).result()



def test_an_idle_slot_refuses_a_shift_from_outside():
    """Its cells would move without the tokens it keeps, which the next turn's reuse reads."""
    settings = {**SETTINGS, "n_seq_max": 3, "swa_full": True}
    with Session("demo", settings=settings, workload=WorkloadSpec(kind="server", n_clients=3, sampler=GREEDY),
                 threaded=False) as session:
        session.step(3).result()
        assert 2 not in session._workload.active_seqs()  # the demo chats use slots 0 and 1
        session.seq_cp(0, 2).result()  # slot 2's sequence now holds cells a shift would move
        with pytest.raises(KvscopeError, match="seq 2 is server slot 2: a shift from outside"):
            session.context_shift(2, 2).result()


def test_the_server_flags_reach_the_workload(tmp_path):
    from engine.llama_flags import build_parser, session_settings

    args = build_parser().parse_args(["tui", "--workload", "server", "-np", "3", "-ctxcp", "4", "-cms", "16",
                                      "-sps", "0.5", "--cache-reuse", "8"])
    settings, spec = session_settings(args)
    assert (spec.kind, spec.n_clients, spec.ctx_checkpoints, spec.checkpoint_min_step, spec.slot_prompt_similarity,
            spec.cache_reuse, settings["n_seq_max"]) == ("server", 3, 4, 16, 0.5, 8, 3)
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(KvscopeError, match="bad.json: expected an object"):
        session_settings(build_parser().parse_args(["tui", "--workload", "server", "--chat", str(bad)]))


def test_a_recorded_server_run_replays_its_slots_at_any_event(tmp_path):
    from engine.watch import Recorder, RecordingReader
    from engine.watch.replay import Replay
    from engine.watch.server_slots import SERVER_EVENTS, ServerSlots

    path = tmp_path / "server.kvtrace"
    with Session("demo", settings=SETTINGS, workload=server_spec(), threaded=False) as session:
        subscription = session.subscribe(maxsize=1 << 20)
        events = session.current_state()
        session.step(400).result()
        events += subscription.drain()
    with Recorder(path, keyframe_every=100) as recorder:
        for event in events:
            recorder.write(event)
    replay = Replay(RecordingReader(path))
    for target in (len(events) // 3, len(events) // 2, len(events) - 1, 10):  # forward past keyframes, and back
        replay.seek(target)
        expected = ServerSlots()
        for event in events[:target + 1]:
            if isinstance(event, SERVER_EVENTS):
                expected.apply(event)
        shown = replay.watcher.server
        assert shown.totals() == expected.totals(), target
        assert {s: sorted(v.checkpoints) for s, v in shown.slots.items()} == \
            {s: sorted(v.checkpoints) for s, v in expected.slots.items()}


def test_a_workload_that_cannot_be_made_leaves_the_cache_as_it_was(tmp_path):
    with Session("demo", settings=SETTINGS, workload=WorkloadSpec(kind="idle"), threaded=False) as session:
        session.add_prompt("And God said").result()
        before = session.ctx.memory.seq_pos_max(0)
        with pytest.raises(KvscopeError, match="cannot read the conversation script"):
            session.set_workload(server_spec(chat=str(tmp_path / "missing.json"))).result()
        assert before >= 0 and session.ctx.memory.seq_pos_max(0) == before
        session.set_workload(server_spec()).result()
        assert session.ctx.memory.seq_pos_max(0) == -1  # the server owns its slots' sequences: it starts empty
