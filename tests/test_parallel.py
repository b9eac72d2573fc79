"""The parallel workload (llama.cpp's `parallel` example with continuous batching)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import engine
from engine import events as ev
from engine.cli import main
from engine.errors import KvscopeError
from engine.runners.parallel import CONTEXT_EXCEEDED, ParallelRunner
from engine.runners.parallel_workload import QUESTIONS, Request, make_schedule
from engine.sampling import SamplerParams

GREEDY = SamplerParams(temperature=0.0, seed=1)
SAMPLED = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
SYSTEM = "The Assistant answers briefly.\n"


@pytest.fixture(scope="module")
def model(tiny_llama_gguf):
    return engine.load_model(tiny_llama_gguf)


def new_ctx(model, n_clients=3, **kw):
    defaults = dict(n_ctx=512, pad=32, n_seq_max=n_clients + 1, kv_unified=True, type_k="f32", type_v="f32",
                    n_batch=64)
    defaults.update(kw)
    return engine.Context(model, **defaults)


def run(model, requests, n_clients=3, params=GREEDY, ctx=None, **kw):
    ctx = ctx or new_ctx(model, n_clients)
    kw.setdefault("system_prompt", SYSTEM)
    runner = ParallelRunner(ctx, n_clients, params, **kw)
    infos = list(runner.steps(requests))
    return runner, infos, sorted(runner.results, key=lambda r: r.request.id)


def test_schedule_is_deterministic_by_seed():
    a = make_schedule(12, seed=5, n_predict=40, arrival_gap=3)
    assert a == make_schedule(12, seed=5, n_predict=40, arrival_gap=3)
    assert a != make_schedule(12, seed=6, n_predict=40, arrival_gap=3)
    assert [r.id for r in a] == list(range(12))
    assert all(r.question in QUESTIONS and 10 <= r.n_predict <= 40 for r in a)
    arrivals = [r.arrival_step for r in a]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert len({r.n_predict for r in a}) > 1
    assert all(r.arrival_step == 0 for r in make_schedule(5, seed=5, arrival_gap=0))


@pytest.mark.parametrize("kv_unified", [True, False])
def test_every_request_finishes_and_a_seed_reproduces_the_run(model, kv_unified):
    requests = make_schedule(7, seed=2, n_predict=12, arrival_gap=2)
    first = run(model, requests, params=SAMPLED, ctx=new_ctx(model, kv_unified=kv_unified))
    again = run(model, requests, params=SAMPLED, ctx=new_ctx(model, kv_unified=kv_unified))
    runner, infos, results = first
    assert [r.request for r in results] == requests
    assert all(r.ok and r.stop_reason in ("eog", "length", "stop_word") for r in results)
    assert [r.tokens for r in results] == [r.tokens for r in again[2]]
    assert [(i.admitted, [r.request.id for r in i.finished]) for i in infos] == \
        [(i.admitted, [r.request.id for r in i.finished]) for i in again[1]]
    # each request admitted once and finished once, never before it arrived
    admitted = [rid for i in infos for rid, _ in i.admitted]
    finished = [r.request.id for i in infos for r in i.finished]
    assert sorted(admitted) == sorted(finished) == list(range(7))
    for r in results:
        assert r.request.arrival_step <= r.admitted_step <= r.finished_step
    # continuous batching: no batch above n_batch, some batch mixes prompt and generated tokens
    assert all(i.n_tokens <= runner.ctx.n_batch for i in infos)
    assert any(i.n_prompt_tokens and i.n_gen_tokens for i in infos)
    assert all(d.rc == 0 for i in infos for d in i.decodes)
    # all finished: the clients hold the system prompt again, nothing else
    n_sys = len(runner.system_tokens)
    mem = runner.ctx.memory
    for c in range(1, 4):
        assert (mem.seq_pos_min(c), mem.seq_pos_max(c)) == (0, n_sys - 1)
    summary = runner.summary()
    assert summary.n_prompt_total == sum(r.n_prompt for r in results)
    assert summary.n_gen_total == sum(r.n_decoded for r in results)
    assert summary.n_failed == 0 and summary.cache_misses == 0


def test_the_system_prompt_cells_are_shared_in_a_unified_cache(model):
    runner = ParallelRunner(new_ctx(model, 3), 3, GREEDY, system_prompt=SYSTEM)
    n_sys = len(runner.system_tokens)
    steps = runner.steps(make_schedule(5, seed=4, n_predict=10, arrival_gap=1))
    first = next(steps)
    assert first.phase == "system" and first.n_tokens == n_sys and first.kv_used == n_sys

    def system_cells():
        return [(pos, seqs) for pos, seqs, _ in runner.ctx.memory.cells(0) if 0 <= pos < n_sys]

    assert system_cells() and all(seqs == {0, 1, 2, 3} for _, seqs in system_cells())
    n_busy_steps = 0
    for info in steps:
        cells = system_cells()
        assert sorted(pos for pos, _ in cells) == list(range(n_sys))  # stored once, whatever runs
        assert all(seqs == {0, 1, 2, 3} for _, seqs in cells)
        busy = [c for c in info.clients if c.state != "idle"]
        # every other cell belongs to exactly one busy client
        others = [seqs for pos, seqs, _ in runner.ctx.memory.cells(0) if pos >= n_sys]
        assert all(len(seqs) == 1 and next(iter(seqs)) in {c.seq_id for c in busy} for seqs in others)
        n_busy_steps += bool(others)
    assert n_busy_steps >= 5  # the checks above ran while clients held cells of their own
    assert len(runner.results) == 5 and all(r.ok for r in runner.results)


def test_split_streams_copy_the_system_prompt_into_every_stream(model):
    bus = engine.EventBus()
    sub = bus.subscribe(kinds=(ev.CellsCopied, ev.StreamCopyExecuted))
    ctx = new_ctx(model, 2, kv_unified=False, n_ctx=3 * 96, bus=bus)
    runner = ParallelRunner(ctx, 2, GREEDY, system_prompt=SYSTEM)
    n_sys = len(runner.system_tokens)
    steps = runner.steps(make_schedule(3, seed=4, n_predict=8, arrival_gap=0))
    next(steps)
    copies = sub.drain()
    assert [(e.src_stream, e.dst_stream, e.queued) for e in copies] == [(0, 1, True), (0, 2, True)]
    for s in (1, 2):  # the client's stream: the system prompt at the same cells, its own seq id
        cells = ctx.memory.cells(s)
        assert [(p, set(q)) for p, q, _ in cells[:n_sys]] == [(p, {s}) for p in range(n_sys)]
    next(steps)  # the first decode runs the queued K/V stream copies
    executed = [(e.src_stream, e.dst_stream) for e in sub.drain() if isinstance(e, ev.StreamCopyExecuted)]
    assert executed == [(0, 1), (0, 2)]
    for layer in range(model.config.n_layer):
        k = ctx.memory.k[layer]
        for s in (1, 2):
            assert torch.equal(k.read_cells(s, torch.arange(n_sys)), k.read_cells(0, torch.arange(n_sys)))
    for _ in steps:
        pass
    assert all(r.ok for r in runner.results)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_greedy_parallel_clients_equal_each_request_alone(model, kv_unified):
    requests = make_schedule(6, seed=3, n_predict=12, arrival_gap=1)
    _, _, together = run(model, requests, ctx=new_ctx(model, kv_unified=kv_unified))
    assert [r.request for r in together] == requests and all(r.ok for r in together)
    for req, res in zip(requests, together):
        alone = dataclasses.replace(req, arrival_step=0)
        _, _, (solo,) = run(model, [alone], n_clients=1, ctx=new_ctx(model, 1))
        assert res.tokens == solo.tokens, f"request {req.id} differs when run beside others"
        assert res.text == solo.text


def test_an_unshared_system_prompt_gives_the_same_answers(model):
    requests = make_schedule(4, seed=8, n_predict=10, arrival_gap=0)
    _, _, shared = run(model, requests)
    runner, infos, unshared = run(model, requests, share_system_prompt=False)
    assert infos[0].phase == "batch"  # no system step
    assert [r.tokens for r in shared] == [r.tokens for r in unshared]
    assert all(r.n_prompt == len(runner.system_tokens) + s.n_prompt for r, s in zip(unshared, shared))


def test_no_kv_slot_halves_the_batch_then_drops_the_request(model, caplog):
    """A 96-cell unified pool and two clients that each need ~70 cells: decodes return 1, the batch
    is halved, and at one token the request that cannot be placed fails and is dropped."""
    ctx = new_ctx(model, 2, n_ctx=96, n_batch=32)
    requests = make_schedule(4, seed=3, n_predict=40, arrival_gap=0)
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        runner, infos, results = run(model, requests, n_clients=2, ctx=ctx, system_prompt="Hi.\n")
    assert "failed to decode the batch, retrying with n_batch" in caplog.text
    assert runner.cache_misses > 0
    retried = [i for i in infos if any(d.rc == 1 for d in i.decodes)]
    assert retried
    # after a failure of more than one token the next try is the same offset with at most half the tokens
    halvings = [(a, b) for info in retried for a, b in zip(info.decodes, info.decodes[1:])
                if a.rc == 1 and a.n_tokens > 1]
    assert halvings, "no batch of more than one token failed: nothing was halved"
    assert all(b.offset == a.offset and b.n_tokens <= a.n_tokens // 2 for a, b in halvings), halvings
    failed = [r for r in results if not r.ok]
    assert failed and all(r.stop_reason == "error" and r.error == CONTEXT_EXCEEDED for r in failed)
    assert any(r.ok for r in results)
    assert len(results) == 4 and all(r.finished_step >= 0 for r in results)
    # a dropped request's cells are gone; every client is back to the shared system prompt
    assert ctx.memory.used(0) == len(runner.system_tokens)
    assert all(seqs == {0, 1, 2} for p, seqs, _ in ctx.memory.cells(0) if p >= 0)
    assert runner.summary().n_failed == len(failed)


def test_an_aborted_decode_ends_the_run(model):
    ctx = new_ctx(model)
    runner = ParallelRunner(ctx, 3, GREEDY, system_prompt=SYSTEM)
    infos = []
    for info in runner.steps(make_schedule(6, seed=1, n_predict=30, arrival_gap=0)):
        infos.append(info)
        if len(infos) == 3:
            ctx.abort_callback = lambda: True
    assert infos[-1].rc == 2
    assert {r.stop_reason for r in infos[-1].finished} == {"aborted"}
    assert len(runner.results) == 3  # nothing new was started


def test_the_context_must_have_a_sequence_for_the_system_prompt(model):
    with pytest.raises(KvscopeError, match="n_seq_max >= 4"):
        ParallelRunner(new_ctx(model, 2), 3, GREEDY)


def test_run_returns_results_in_request_order(model):
    runner = ParallelRunner(new_ctx(model, 2), 2, GREEDY, system_prompt=SYSTEM)
    results = runner.run(5, seed=9, n_predict=6)
    assert [r.request.id for r in results] == list(range(5))
    assert [r.request for r in results] == make_schedule(5, seed=9, n_predict=6)
    reqs = [Request(0, "Why?", 3), Request(1, "How?", 3, arrival_step=4)]
    runner = ParallelRunner(new_ctx(model, 2), 2, GREEDY, system_prompt=SYSTEM)
    results = runner.run(requests=reqs)
    assert [len(r.tokens) for r in results] == [3, 3] and results[1].admitted_step == 4


def test_cli_parallel(tiny_llama_gguf, capsys):
    rc = main(["parallel", "-m", str(tiny_llama_gguf), "-np", "2", "-ns", "3", "-c", "256", "--pad", "32",
               "-n", "6", "--seed", "1", "--temp", "0", "-kvu", "--steps"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("Input:    ") == 3 and out.count("Response: ") == 3
    assert "main: n_parallel = 2, n_sequences = 3, cont_batching = 1, system tokens = " in out
    for line in ("Total prompt tokens:", "Total gen tokens:", "Total speed (AVG):", "Cache misses:             0"):
        assert line in out
    assert "step    0 system" in out
    assert "(   256 cells,   2 layers,  3/1 seqs)" in err  # -np 2 -> n_seq_max 3, one stream
    assert "started decoding" in err and "llama_perf_context_print" in err


def test_parallel_runs_on_a_sliding_window_model(capsys):
    """The default model is the demo Gemma 3, whose memory is an iSWA pair."""
    from engine.cli import main

    rc = main(["parallel", "-np", "2", "-ns", "3", "-n", "6", "-c", "512", "--seed", "1"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.count("Client ") == 3


def test_an_open_run_serves_submitted_requests_and_keeps_the_latest_results(model, monkeypatch):
    from engine.runners import parallel

    monkeypatch.setattr(parallel, "KEPT_RESULTS", 3)
    runner = ParallelRunner(new_ctx(model), 3, GREEDY)
    steps = runner.steps([Request(0, QUESTIONS[0], 4)], keep_open=True)
    phases = [next(steps).phase for _ in range(12)]
    assert phases[0] == "system" and phases[-1] == "idle"  # the schedule ran out: the run waits, open
    submitted = [runner.submit(QUESTIONS[i % 4], 3) for i in range(5)]
    assert [r.id for r in submitted] == [1, 2, 3, 4, 5]
    for _ in range(40):
        if next(steps).phase == "idle":
            break
    assert [r.request.id for r in runner.results] == [3, 4, 5] and all(r.ok for r in runner.results)


def _slot_positions(ctx, seq_id: int) -> list[int]:
    return sorted(p for p, seqs, _ in ctx.memory.cells(0) if seq_id in seqs)


def test_a_client_that_fills_its_slot_is_context_shifted_as_llama_server_does(model):
    """Slots of 40 positions, prompts kept (n_keep -1): before a client's next token would reach the end of
    its slot, half of its answer is discarded (seq_rm) and the rest moved down (seq_add), so its positions
    stay 0..n_past-1, each once, and never reach the slot's end; the shift's numbers are llama-server's."""
    ctx = new_ctx(model, 2, n_ctx=128)
    runner = ParallelRunner(ctx, 2, GREEDY, system_prompt=SYSTEM, n_ctx_slot=40, context_shift=True, n_keep=-1)
    sub = ctx.bus.subscribe(kinds=(ev.CellsRemoved,))
    requests = [Request(0, "Why?", 50), Request(1, "How?", 50, arrival_step=3)]
    for _ in runner.steps(requests):
        for c in runner.clients:
            if c.state == "generating":
                assert _slot_positions(ctx, c.seq_id) == list(range(c.n_past)) and c.n_past < 40
    results = sorted(runner.results, key=lambda r: r.request.id)
    assert all(r.ok and r.n_decoded == 50 for r in results)
    assert all(r.context_shifts >= 2 for r in results) and runner.n_shifts == sum(r.context_shifts for r in results)
    shifts = [e for e in sub.drain() if e.cause.startswith("context shift of seq")]
    assert len(shifts) == runner.n_shifts
    first = {r.seq_id: r for r in results}
    for e in shifts:
        r = first[e.seq_id]
        n_keep = r.n_past_start + r.n_prompt  # -1: the whole prompt, the shared system prompt included
        n_discard = (40 - 1 - n_keep) // 2  # llama-server: n_past + 1 >= n_ctx, n_discard = (n_past - n_keep) / 2
        assert e.cause == f"context shift of seq {e.seq_id}: n_keep = {n_keep}, n_discard = {n_discard}"
    assert ctx.memory.used(0) == len(runner.system_tokens)  # every answer's cells went with its request


def test_a_shifted_client_generates_what_a_context_shifting_generator_does(model):
    """One client whose slot is the whole context, its prompt decoded in its own sequence: the parallel
    runner's context shift and llama-completion's (Generator, context_shift) give the same tokens."""
    from engine.runners.generate import Generator

    ctx = new_ctx(model, 1, n_ctx=64)
    runner = ParallelRunner(ctx, 1, GREEDY, system_prompt=SYSTEM, share_system_prompt=False, n_ctx_slot=64,
                            context_shift=True, n_keep=-1)
    (result,) = runner.run(requests=[Request(0, "Why is the sky blue?", 90)])
    assert result.context_shifts >= 2
    alone = Generator(new_ctx(model, 0, n_ctx=64, n_seq_max=1), GREEDY, context_shift=True, n_keep=-1)
    expected = alone.generate(result.prompt_tokens, 90)
    assert len(expected.context_shifts) == result.context_shifts
    assert result.tokens == expected.tokens


def test_without_context_shift_a_client_stops_at_its_slots_end_and_a_long_prompt_is_refused(model):
    ctx = new_ctx(model, 2, n_ctx=128)
    runner = ParallelRunner(ctx, 2, GREEDY, system_prompt=SYSTEM, n_ctx_slot=40)
    long_question = "Tell me " * 20
    results = runner.run(requests=[Request(0, "Why?", 50), Request(1, long_question, 5)])
    stopped, refused = results
    assert stopped.stop_reason == "limit" and stopped.ok
    # every position of the slot decoded (its last sampled token never is)
    assert stopped.n_past_start + stopped.n_prompt + stopped.n_decoded - 1 == 40
    assert refused.stop_reason == "error" and "exceeds the available context size" in refused.error
    assert refused.n_decoded == 0 and runner.n_shifts == 0


def test_slot_settings_are_checked(model, caplog):
    with pytest.raises(KvscopeError, match="n_ctx_slot must be in 0..128"):
        ParallelRunner(new_ctx(model, 2, n_ctx=128), 2, GREEDY, n_ctx_slot=129)
    with pytest.raises(KvscopeError, match="give n_ctx_slot with context_shift"):
        ParallelRunner(new_ctx(model, 2, n_ctx=128), 2, GREEDY, context_shift=True)
    # an SWA cache smaller than the base cache cannot shift (llama.cpp: get_can_shift compares the sizes)
    swa = engine.Context(engine.load_model("demo"), n_ctx=1024, n_seq_max=3, kv_unified=True)
    with caplog.at_level(logging.WARNING, logger="kvscope"):
        runner = ParallelRunner(swa, 2, GREEDY, n_ctx_slot=100, context_shift=True)
    assert not runner.context_shift and "does not support context shift" in caplog.text
