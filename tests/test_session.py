"""The session: commands from another thread while the worker decodes, applied between steps; failures
become events and never end the worker; the watch layer equals the engine after any command sequence,
also after it lost events and resynced."""
from __future__ import annotations

import random
import threading
import time

import pytest

import engine
from engine import events as ev
from engine.errors import ArgumentTypeError, KvscopeError
from engine.runners.session import Session, SessionClosedError
from engine.runners.workloads import WorkloadSpec
from engine.sampling import SamplerParams
from engine.watch.watcher import Watcher

SMALL = dict(n_ctx=128, pad=16, n_seq_max=5, kv_unified=True, type_k="f32", type_v="f32")
GREEDY = SamplerParams(temperature=0.0, seed=1)


@pytest.fixture(scope="module")
def llama(tiny_llama_hf):
    return engine.load_model(tiny_llama_hf)


@pytest.fixture(scope="module")
def demo():
    return engine.load_model("demo")


def assert_watch_equals_engine(watcher: Watcher, session: Session) -> None:
    watcher.poll()
    assert not watcher.stale
    for cache in session.ctx.memory.caches():
        for s in range(cache.n_stream):
            assert watcher.mirror.cells(s, cache.name) == cache.cells(s), f"{cache.name} stream {s}"
            assert watcher.mirror.head(s, cache.name) == cache.head(s), f"{cache.name} stream {s} head"


def kinds(events) -> list[str]:
    return [e.kind for e in events]


# ---- synchronous use ------------------------------------------------------------------------------
def test_synchronous_session_steps_by_hand(llama):
    with Session(llama, settings=SMALL, workload=WorkloadSpec("generate", n_predict=6, sampler=GREEDY),
                 threaded=False) as session:
        watcher = Watcher.of(session)
        assert session.add_prompt("hello there").result() == 0
        assert session.add_prompt("a second prompt", n_predict=3).result() == 1
        outcomes = session.step(20).result()
        # a prefill step, then one decode per step until both sequences stop (6 and 3 tokens)
        assert [o.phase for o in outcomes] == ["batch"] * 6 + ["idle"]
        assert outcomes[0].active_seqs == (0, 1) and outcomes[3].active_seqs == (0,)
        assert session.status().step == 6
        assert_watch_equals_engine(watcher, session)
        sampled = [e for e in watcher.recent if isinstance(e, ev.TokenSampled)]
        assert sorted(e.seq_id for e in sampled).count(0) == 6 and [e.seq_id for e in sampled].count(1) == 3


def test_idle_workload_decodes_a_prompt_at_once(llama):
    with Session(llama, settings=SMALL, threaded=False) as session:
        seq = session.add_prompt("the quick brown fox").result()
        n = len(llama.tokenizer.encode("the quick brown fox"))
        assert session.ctx.memory.seq_pos_max(seq) == n - 1
        assert session.step(3).result()[0].phase == "idle"
        assert session.add_prompt("jumps").result() == seq + 1


# ---- threads ------------------------------------------------------------------------------------------
def test_every_command_from_another_thread_while_parallel_decodes(demo):
    settings = dict(n_ctx=512, pad=64, n_seq_max=6, kv_unified=True, swa_full=True)
    spec = WorkloadSpec("parallel", n_clients=4, n_sequences=12, n_predict=24, arrival_gap=1, sampler=GREEDY)
    with Session(demo, settings=settings, workload=spec) as session:
        watcher = Watcher.of(session)
        session.start().result(10)
        results: dict[str, object] = {}

        def drive() -> None:
            try:
                wait_for_step(session, 5)
                results["request"] = session.add_prompt("Who was Moses?", n_predict=8).result(30)
                results["cp"] = session.seq_cp(1, 5, -1, -1).result(30)  # seq 5 belongs to no client
                results["rm"] = session.seq_rm(5, 2, -1).result(30)
                results["add"] = session.seq_add(0, 5, -1, 1).result(30)  # seq 0 holds the system prompt
                results["div"] = session.seq_div(0, 0, -1, 1).result(30)  # d = 1: llama.cpp's no-op
                results["speed"] = session.set_speed(50).result(30)
                results["state"] = len(session.save_state(seq_id=5).result(30))
                results["keep"] = session.seq_keep(5).result(30)  # every client loses its cells: rc -1 follows
                session.pause().result(30)
                results["steps"] = len(session.step(2).result(30))
            except BaseException as e:  # noqa: BLE001 - reported by the assert below
                results["error"] = e

        thread = threading.Thread(target=drive)
        thread.start()
        thread.join(120)
        assert not thread.is_alive() and "error" not in results, results.get("error")
        assert results["request"] == 12 and results["rm"] is True and results["steps"] == 2
        assert results["state"] > 100
        assert session.status().state == "paused" and session.status().steps_per_second == 50
        assert_watch_equals_engine(watcher, session)
        done = [e for e in watcher.recent if isinstance(e, ev.CommandDone)]
        assert [e.command for e in done if e.ok][-10:] == ["add_prompt", "seq_cp", "seq_rm", "seq_add", "seq_div",
                                                          "set_speed", "save_state", "seq_keep", "pause", "step"]


def wait_for_step(session: Session, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while session.status().step < n:
        assert time.monotonic() < deadline, "the session did not step"
        time.sleep(0.01)


def test_a_failing_command_is_an_event_and_the_worker_goes_on(llama):
    with Session(llama, settings=SMALL, workload=WorkloadSpec("generate", n_predict=50, sampler=GREEDY)) as session:
        sub = session.subscribe()
        session.add_prompt("hello").result(10)
        session.start().result(10)
        bad = [session.seq_add("0", 0, 1, 1), session.seq_cp(0, 1, 2.0, -1), session.context_shift(3, 0),
               session.rebuild(n_ctx=-4), session.load_state(b"not a state")]
        errors = []
        for future in bad:
            with pytest.raises(KvscopeError) as caught:
                future.result(30)
            errors.append(caught.value)
        assert isinstance(errors[0], ArgumentTypeError) and "seq 3 holds no cells" in str(errors[2])
        wait_for_step(session, 5)
        assert session.seq_rm(0, 3, -1).result(30) is True  # still serving commands
        session.pause().result(30)
        failed = [e for e in sub.drain() if isinstance(e, ev.CommandDone) and not e.ok]
        assert [e.command for e in failed] == ["seq_add", "seq_cp", "context_shift", "rebuild", "load_state"]
        assert "seq_id must be an int, got '0'" in failed[0].error
        assert session.ctx.n_ctx == 128  # the refused rebuild kept the old context


def test_a_failing_decode_stops_the_sequence_not_the_session(llama):
    """A command that breaks a running sequence's positions makes its next decode invalid (rc -1, as in
    llama.cpp); the sequence stops, the session keeps serving."""
    with Session(llama, settings=SMALL, workload=WorkloadSpec("generate", n_predict=40, sampler=GREEDY),
                 threaded=False) as session:
        sub = session.subscribe()
        session.add_prompt("hello world").result()
        session.step(3).result()
        session.seq_rm(0, 2, -1).result()  # seq 0 now ends at pos 1, but the workload decodes at its next pos
        outcome = session.step(1).result()[0]
        assert outcome.rc == -1 and outcome.active_seqs == ()
        finished = [e for e in sub.drain() if isinstance(e, ev.DecodeFinished)]
        assert finished[-1].rc == -1 and "Y = X + 1" in finished[-1].message
        assert session.add_prompt("again").result() == 1  # seq 0 still holds cells 0..1: the next free one
        assert [o.rc for o in session.step(2).result()] == [0, 0]


def test_context_shift_command_moves_a_generating_sequence(demo):
    settings = dict(n_ctx=256, pad=32, n_seq_max=2, kv_unified=True, swa_full=True)
    with Session(demo, settings=settings, workload=WorkloadSpec("generate", n_predict=60, sampler=GREEDY),
                 threaded=False) as session:
        watcher = Watcher.of(session)
        session.add_prompt("And God said unto Moses").result()
        session.step(20).result()
        before = session.ctx.memory.seq_pos_max(0)
        assert session.context_shift(0, n_keep=4, n_discard=10).result() == 10
        assert session.ctx.memory.seq_pos_max(0) == before - 10
        assert [o.rc for o in session.step(5).result()] == [0] * 5
        assert session.ctx.memory.seq_pos_max(0) == before - 10 + 5
        assert_watch_equals_engine(watcher, session)
        story = watcher.history.explain("base", 0, 20)
        assert story.startswith("allocated in decode ") and "shifted -10 to pos 10 by context shift of seq 0" in story
        assert "keys re-rotated by -10 (K-shift)" in story


def test_rebuild_keeps_the_model_and_starts_an_empty_cache(llama):
    with Session(llama, settings=SMALL, workload=WorkloadSpec("generate", n_predict=4, sampler=GREEDY),
                 threaded=False) as session:
        watcher = Watcher.of(session)
        session.add_prompt("hello").result()
        session.step(2).result()
        session.rebuild(n_ctx=64, type_k="f16", kv_unified=False).result()
        assert (session.ctx.n_ctx, session.ctx.params.type_k, session.ctx.memory.n_stream) == (80, "f16", 5)
        assert session.ctx.model is llama and session.ctx.memory.seq_pos_max(0) == -1
        assert session.add_prompt("again").result() == 0
        session.step(3).result()
        assert_watch_equals_engine(watcher, session)
        assert watcher.mirror.created["kv"].type_k == "f16"


def test_state_round_trip_through_the_session(llama, tmp_path):
    with Session(llama, settings=SMALL, threaded=False) as session:
        seq = session.add_prompt("remember this prompt").result()
        cells = session.ctx.memory.cells(0)
        assert session.save_state(tmp_path / "seq.bin", seq_id=seq).result() > 0
        whole = session.save_state().result()
        session.clear().result()
        assert session.ctx.memory.seq_pos_max(seq) == -1
        session.load_state(tmp_path / "seq.bin", seq_id=3).result()
        assert session.ctx.memory.seq_pos_max(3) == len(llama.tokenizer.encode("remember this prompt")) - 1
        session.load_state(whole).result()
        assert session.ctx.memory.cells(0) == cells


def test_speed_limit_spaces_the_steps(llama):
    spec = WorkloadSpec("generate", n_predict=-1, sampler=GREEDY)
    with Session(llama, settings=dict(SMALL, n_ctx=256), workload=spec, steps_per_second=20) as session:
        sub = session.subscribe(kinds=(ev.WorkloadStep,))
        session.add_prompt("go").result(10)
        session.start().result(10)
        time.sleep(1.0)
        session.pause().result(10)
        steps = sub.drain()
        assert 10 <= len(steps) <= 23, len(steps)  # 20 per second, give or take a busy machine
        gaps = [b.time - a.time for a, b in zip(steps, steps[1:])]
        assert min(gaps) > 0.035


def test_a_closed_session_refuses_commands(llama):
    session = Session(llama, settings=SMALL)
    thread = session._thread
    session.close()
    assert not thread.is_alive() and session.status().state == "closed"
    with pytest.raises(SessionClosedError, match="seq_rm: the session is closed"):
        session.seq_rm(0)


# ---- the watch layer stays right ------------------------------------------------------------------
def test_a_slow_watcher_resyncs_and_is_right_again(llama):
    spec = WorkloadSpec("parallel", n_clients=4, n_sequences=8, n_predict=12, arrival_gap=0, sampler=GREEDY)
    with Session(llama, settings=dict(SMALL, n_ctx=256), workload=spec) as session:
        slow = Watcher(session.subscribe(maxsize=16), session.current_state)
        session.start().result(10)
        wait_for_step(session, 15)
        session.pause().result(10)
        slow.poll()
        assert slow.dropped > 0 and slow.resyncs == 1
        assert_watch_equals_engine(slow, session)
        session.step(3).result(30)
        assert_watch_equals_engine(slow, session)  # and it stays in step after the resync


def test_random_command_sequences_keep_the_watch_layer_exact(demo):
    rng = random.Random(7)
    settings = dict(n_ctx=128, pad=16, n_seq_max=4, kv_unified=False, swa_full=True)
    with Session(demo, settings=settings, workload=WorkloadSpec("generate", n_predict=12, sampler=GREEDY),
                 threaded=False) as session:
        watcher = Watcher.of(session)
        for _ in range(60):
            op = rng.choice(["prompt", "step", "step", "rm", "cp", "keep", "add", "shift", "clear"])
            seq = rng.randrange(4)
            try:
                if op == "prompt":
                    session.add_prompt(rng.choice(["In the beginning", "And Moses said", "Behold"])).result()
                elif op == "step":
                    session.step(rng.randint(1, 4)).result()
                elif op == "rm":
                    session.seq_rm(seq, rng.randint(-1, 6), rng.choice([-1, 8])).result()
                elif op == "cp":
                    session.seq_cp(seq, (seq + 1) % 4).result()
                elif op == "keep":
                    session.seq_keep(seq).result()
                elif op == "add":
                    session.seq_add(seq, rng.randint(0, 4), -1, rng.randint(-3, 3)).result()
                elif op == "shift":
                    session.context_shift(seq, n_keep=1).result()
                else:
                    session.clear().result()
            except KvscopeError:
                pass  # refused (an empty sequence, a prefilling one): nothing changed, still checked below
            assert_watch_equals_engine(watcher, session)


def test_rebuild_onto_virtual_devices_and_a_refused_one(llama):
    with Session(llama, settings=SMALL, threaded=False) as session:
        session.rebuild(devices=["VGPU0=64MiB"], n_gpu_layers=-1, offload_kqv=False).result()
        assert [d.name for d in session.ctx.gpus] == ["VGPU0"]
        assert {d.name for d in session.ctx.placement.layer_devices} == {"VGPU0"}
        assert {d.name for d in session.ctx.placement.kv_devices} == {"CPU"}
        assert session.add_prompt("kept through a refused rebuild").result() == 0
        cells = session.ctx.memory.cells(0)
        watcher = Watcher.of(session)
        with pytest.raises(KvscopeError, match="VGPU1"):
            session.rebuild(devices=["VGPU1=1KiB"], n_gpu_layers=-1).result()
        assert [d.name for d in session.ctx.gpus] == ["VGPU0"]  # the old context stayed
        assert session.ctx.memory.cells(0) == cells and any(pos >= 0 for pos, _, _ in cells)  # and its cells
        watcher.poll()
        assert watcher.mirror.cells(0, session.ctx.memory.name) == cells
        assert session.add_prompt("still works").result() == 1


def test_a_rebuild_refused_because_the_caller_holds_the_old_context_keeps_it(demo):
    """A notebook that kept `ctx = session.ctx` keeps that context's weights placed: a rebuild that places
    them otherwise is refused, and the session goes on with the very context it had, cells and all."""
    with Session(demo, settings=dict(n_ctx=256), threaded=False) as session:
        session.rebuild(devices=["VGPU0=64MiB"], n_gpu_layers=-1).result()
        held = session.ctx
        assert session.add_prompt("And God said").result() == 0
        cells = held.memory.base.cells(0)
        with pytest.raises(KvscopeError, match="placed .* by another context"):
            session.rebuild(devices=["VGPU0=64MiB"], n_gpu_layers=2).result()
        assert session.ctx is held and session.ctx.memory.base.cells(0) == cells
        assert session.add_prompt("unto Moses").result() == 1


def test_every_command_from_another_thread_while_generation_decodes(demo, tmp_path):
    settings = dict(n_ctx=256, pad=32, n_seq_max=4, kv_unified=True, swa_full=True)
    spec = WorkloadSpec("generate", n_predict=-1, sampler=GREEDY, context_shift=True, n_keep=2)
    with Session(demo, settings=settings, workload=spec) as session:
        watcher = Watcher.of(session)
        done: list[str] = []
        errors: list[BaseException] = []

        def drive() -> None:
            try:
                assert session.add_prompt("And God said unto Moses").result(30) == 0
                session.start().result(30)
                wait_for_step(session, 10)
                assert session.add_prompt("In the beginning").result(30) == 1
                wait_for_step(session, 16)
                assert session.context_shift(0, n_keep=2, n_discard=4).result(30) == 4
                assert session.save_state(tmp_path / "seq1.bin", seq_id=1).result(30) > 0
                session.seq_cp(1, 2).result(30)
                session.seq_rm(2, 3, -1).result(30)
                session.seq_add(2, 0, -1, 2).result(30)
                session.seq_div(2, 0, -1, 2).result(30)
                session.seq_keep(2).result(30)  # the running sequences lose their cells: their decodes fail
                session.load_state(tmp_path / "seq1.bin", seq_id=3).result(30)
                session.set_speed(100).result(30)
                wait_for_step(session, session.status().step + 3)
                session.stop().result(30)
                session.clear().result(30)
                session.rebuild(n_ctx=512, type_k="f32").result(60)
                done.append("all")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        thread = threading.Thread(target=drive)
        thread.start()
        thread.join(180)
        assert not thread.is_alive() and not errors, errors
        assert done == ["all"] and session.status().state == "stopped"
        assert session.ctx.n_ctx == 512 and session.ctx.params.type_k == "f32"
        assert_watch_equals_engine(watcher, session)
        ok = [e.command for e in watcher.recent if isinstance(e, ev.CommandDone) and e.ok]
        assert ok == ["add_prompt", "start", "add_prompt", "context_shift", "save_state", "seq_cp", "seq_rm", "seq_add",
                      "seq_div", "seq_keep", "load_state", "set_speed", "stop", "clear", "rebuild"]


def test_a_running_session_that_ran_dry_resumes_when_given_work(llama):
    spec = WorkloadSpec("generate", n_predict=3, sampler=GREEDY)
    with Session(llama, settings=SMALL, workload=spec) as session:
        session.start().result(10)
        session.add_prompt("first").result(10)
        deadline = time.monotonic() + 30
        while session.status().state != "idle":
            assert time.monotonic() < deadline, "the session never ran dry"
            time.sleep(0.01)
        steps = session.status().step
        session.add_prompt("second").result(10)
        wait_for_step(session, steps + 3, timeout=20)  # it resumed by itself: 1 prefill and 2 decodes
        assert session.status().state in ("running", "idle")


def test_on_change_redraws_from_the_worker_coalesced_and_ends_on_the_final_state():
    seen, threads = [], set()
    with Session("demo", settings=dict(n_ctx=256, n_seq_max=2, kv_unified=True, swa_full=True),
                 workload=WorkloadSpec("generate", n_predict=64, sampler=SamplerParams(temperature=0.0, seed=1))) as s:
        def redraw():
            threads.add(threading.current_thread().name)
            seen.append(s.ctx.memory.base.used(0))  # the worker may read the engine: nothing else runs

        remove = s.on_change(redraw, every_s=0.5)
        s.add_prompt("And God said unto Moses").result()
        s.step(24).result()
        time.sleep(0.8)  # the last change's redraw waits for its turn, then comes by itself
        assert threads == {"kvscope-session"}
        final = s.engine_cells().result()["base"]["cells"][0]
        assert seen and seen[-1] == sum(1 for p, _, _ in final if p >= 0)
        assert len(seen) <= 6  # 25 changes in well under 2 s, drawn a few times, not 25
        n = len(seen)
        remove()
        s.step(2).result()
        time.sleep(0.6)
        assert len(seen) == n


def test_a_redraw_slower_than_its_cadence_waits_its_own_time_and_draws_the_steps_between():
    """Backpressure: a 0.3 s redraw asked for every 0.02 s came after every step, so the views took most
    of the worker's time; now it waits as long as it took, and the steps meanwhile are drawn together."""
    steps_at_redraws = []
    with Session("demo", settings=dict(n_ctx=256, n_seq_max=2, kv_unified=True, swa_full=True), steps_per_second=20,
                 workload=WorkloadSpec("generate", n_predict=-1, sampler=SamplerParams(temperature=0.0, seed=1))) as s:
        def slow_redraw():
            steps_at_redraws.append(s.status().step)
            time.sleep(0.3)

        s.on_change(slow_redraw, every_s=0.02)
        s.add_prompt("And God said unto Moses").result()
        s.start().result()
        time.sleep(3.0)
        s.pause().result()
    steps_between = [b - a for a, b in zip(steps_at_redraws, steps_at_redraws[1:])]
    assert len(steps_between) >= 3, steps_at_redraws
    # 0.3 s of drawing, then 0.3 s of steps at 20 per second: about 6 (fewer on a busy machine), not 1
    assert sum(steps_between) / len(steps_between) >= 2.5, steps_at_redraws


def test_a_failing_on_change_is_an_event_and_the_worker_goes_on():
    with Session("demo", settings=dict(n_ctx=256, n_seq_max=2, kv_unified=True, swa_full=True),
                 workload=WorkloadSpec("generate", n_predict=8)) as s:
        sub = s.subscribe(kinds=(ev.CommandDone,))
        s.on_change(lambda: 1 / 0, every_s=0.0)
        s.add_prompt("In the beginning").result()
        assert len(s.step(3).result()) == 3
        failed = [e for e in sub.drain() if e.command == "on_change"]
        assert failed and not failed[0].ok and "ZeroDivisionError" in failed[0].error


def test_call_runs_a_function_on_the_worker_between_steps_and_reports_its_failure():
    import threading

    from engine import events as ev
    from engine.errors import KvscopeError

    with Session("demo", settings=dict(n_ctx=256)) as session:
        sub = session.subscribe(kinds=(ev.CommandDone,))
        assert session.call(lambda: threading.current_thread().name).result(timeout=30) == "kvscope-session"

        def fails():
            raise ValueError("a view broke")

        with pytest.raises(ValueError, match="a view broke"):
            session.call(fails, "redraw").result(timeout=30)
        session.step(1).result(timeout=30)  # the worker lives on
        errors = [e for e in sub.drain() if isinstance(e, ev.CommandDone) and not e.ok]
        assert [(e.command, e.error) for e in errors] == [("redraw", "ValueError: a view broke")]
        with pytest.raises(KvscopeError, match="is not callable"):
            session.call(42)


def test_a_session_sets_torch_threads_when_asked_and_refuses_a_bad_count(monkeypatch):
    import torch

    from engine.errors import KvscopeError
    from engine.runners.launch import threads_beside_a_ui

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with Session("demo", settings=dict(n_ctx=256), threaded=False, threads=1):
            assert torch.get_num_threads() == 1
        # closed, it gives the process back the count it found: a lesson's one-thread session once left every
        # later context of the process estimating its compute buffer for one thread
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(KvscopeError, match="threads must be >= 1, got 0"):
        Session("demo", threads=0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert threads_beside_a_ui() == 7
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert threads_beside_a_ui() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_beside_a_ui() is None


def test_events_since_gives_what_a_view_has_not_seen_whoever_polled():
    from engine.watch.watcher import Watcher

    with Session("demo", settings=dict(n_ctx=256), workload="generate", threaded=False) as session:
        watcher = Watcher.of(session, recent=50)
        watcher.poll()
        counted = watcher.events
        assert watcher.events_since(counted) == []
        session.add_prompt("In the beginning").result()
        session.step(1).result()
        watcher.poll()  # another view polls; this one only counts
        new = watcher.events_since(counted)
        assert len(new) == watcher.events - counted > 0 and new == list(watcher.recent)[-len(new):]
        session.step(10).result()
        watcher.poll()
        assert watcher.events - counted > 50 and len(watcher.events_since(counted)) == 50, "as far as recent holds"


def test_a_session_keeps_only_the_latest_assignment_of_each_sequence(demo):
    """Every request publishes which sequence serves it; a session that no watcher joins anew for hours keeps
    the latest one per sequence for the next watcher's state, not a queue of every request's."""
    spec = WorkloadSpec("parallel", n_clients=2, n_sequences=0, n_predict=2, arrival_gap=0, sampler=GREEDY)
    with Session(demo, settings=dict(n_ctx=256, n_seq_max=3, kv_unified=True), workload=spec,
                 threaded=False) as session:
        for _ in range(12):
            session.add_prompt("Who was Moses?", n_predict=2).result()
        done = session.step(200).result()
        assert done[-1].phase == "idle"
        assert session._assignments.pending() == 0, "taken from the queue after each step"
        assigned = {e.seq_id: e.request for e in session.current_state() if isinstance(e, ev.SequenceAssigned)}
        assert sorted(assigned) == [1, 2] and {int(r.split()[-1]) for r in assigned.values()} == {10, 11}
