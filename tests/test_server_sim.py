"""kvscope's llama-server simulation against llama-server itself (its log of a four-request chat on a
sliding-window gemma3, tests/data/) and against the engine: the numbers of spec section 14a per request,
with and without --swa-full and checkpoints, a checkpoint that saves a turn, and reuse that changes the cost
of a turn but not its answer."""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

import engine
from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.server import ServerLog, ServerParams, ServerSim, Task, without_stamp

LLAMA_SERVER_LOG = Path(__file__).parent / "data" / "llama-server-gemma3-swa-chat.log"
# Lines of that log kvscope does not print: the HTTP side, the sampler's settings, a task's JSON, graph reuse,
# and the queue's bookkeeping.
NOT_SIMULATED = ("init_listene", "local path", "loading model", "threads for HTTP server", "server_strea",
                 "eval_llama_c", "sampler chain", "sampler params", "launching slot", "graphs reused",
                 "posting NEXT_RESPONSE", "decline task", "no need to cancel", "chat template", "preserve_reasoning",
                 "llama_server", "n_batch (effective)", "cleaning up before exit", "model loaded", "listening on")


# Log-probabilities of one prompt decoded in other batches differ by float32 rounding (sums in another
# order): up to about 1e-3 on this model, where one lost cell moves them by more than 1.
BATCHING_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def gemma3_16(tmp_path_factory):
    """The shape of the model behind that log: gemma3, 6 layers (0-4 slide, window 16), 2 KV heads of 32 dims."""
    from engine.testing import write_hf_model

    folder = write_hf_model(tmp_path_factory.mktemp("hf") / "gemma3-w16", "gemma3", n_layer=6, n_embd=128, n_head=4,
                            n_head_kv=2, n_ff=256, vocab_size=512, seed=2, rope_theta=1e6, n_ctx_train=512,
                            sliding_window=16)
    return engine.load_model(folder)


def server(model, *, swa_full=False, publish_logits=False, **params) -> ServerSim:
    """llama-server -c 1024 -np 2 -b 32 -ub 32 (the log's command), with `params` as its flags."""
    ctx = engine.Context(model, n_ctx=1024, n_seq_max=2, kv_unified=False, n_batch=32, n_ubatch=32,
                         swa_full=swa_full, publish_logits=publish_logits)
    return ServerSim(ctx, ServerParams(n_slots=2, **params), log=ServerLog(ctx.bus, verbose=True))


def the_logged_chat(sim: ServerSim) -> list[ev.ServerTaskFinished]:
    """The log's four requests: prompts of random token ids that share what the log says they share."""
    rng = random.Random(1)
    words = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    first = words(270)
    sim.submit(Task(first, n_predict=4, id_slot=0))
    sim.run()
    longer = first + [t for t in words(81) if t != sim.slots[0].tokens[270]][:80]  # differs from what was generated
    sim.submit(Task(longer, n_predict=4, id_slot=0))
    sim.run()
    sim.submit(Task(first[:120] + [(first[120] + 1) % 500] + words(29), n_predict=4, id_slot=1))
    sim.run()
    sim.submit(Task(first[:40] + [(first[40] + 1) % 500] + words(29), n_predict=4, id_slot=0))
    sim.run()
    return sim.finished


def comparable(lines) -> list[str]:
    out = []
    for line in lines:
        line = without_stamp(line).rstrip()
        if any(skip in line for skip in NOT_SIMULATED):
            continue
        line = re.sub(r"time = +[\d.]+ ms / +(\d+) tokens.*", r"time = T ms / \1 tokens", line)
        line = re.sub(r"took [\d.]+ ms", "took T ms", line)
        line = re.sub(r"next token: +\d+ '.*'", "next token: X", line)
        line = re.sub(r"prompt 0x[0-9a-f]+:", "prompt P:", line)  # a pointer in llama-server's lines
        out.append(re.sub(r"id=\d+,", "id=X,", line))
    return out


def test_the_logged_chat_reads_as_llama_servers_log(gemma3_16):
    sim = server(gemma3_16)
    the_logged_chat(sim)
    theirs = comparable(LLAMA_SERVER_LOG.read_text().splitlines())
    ours = comparable(sim.log.lines)
    assert len(theirs) > 140
    assert ours == theirs


def test_tokens_reused_and_processed_per_request(gemma3_16):
    sim = server(gemma3_16)
    sub = sim.ctx.bus.subscribe(kinds=(ev.ServerPromptReused, ev.CheckpointChanged))
    done = the_logged_chat(sim)
    assert [(d.task, d.slot, d.n_cached, d.n_processed, d.n_kept) for d in done] == [
        (0, 0, 0, 270, 273), (14, 0, 270, 80, 353), (22, 1, 0, 150, 153), (32, 0, 0, 70, 73)]
    events = sub.drain()
    reused = [e for e in events if isinstance(e, ev.ServerPromptReused)]
    assert [(e.n_common, e.n_past, e.forced_full) for e in reused] == [(0, 0, False), (270, 270, False),
                                                                        (0, 0, False), (40, 0, True)]
    last = reused[-1]
    assert (last.pos_min, last.pos_min_thold) == (353 - 256, 40 - 16)  # the SWA ring kept 256 of 353 positions
    events = [e for e in events if isinstance(e, ev.CheckpointChanged)]
    created = [(e.slot, e.pos_min, e.pos_max, e.n_tokens) for e in events if e.action == "created"]
    assert created == [(0, 0, 237, 238), (0, 10, 265, 266), (0, 62, 317, 318), (0, 90, 345, 346),
                       (1, 0, 117, 118), (1, 0, 145, 146), (0, 0, 37, 38), (0, 0, 65, 66)]
    erased = [(e.n_tokens, e.why) for e in events if e.action == "erased"]
    assert erased == [(238, "invalidated"), (266, "invalidated"), (318, "invalidated"), (346, "invalidated")]
    sizes = {e.n_bytes for e in events if e.action == "created"}
    assert len(sizes) == 1 and f"{sizes.pop() / 2**20:.3f}" == "0.020"  # the window's 16 cells, as the log says
    assert sim.checkpoints.bytes_held == sum(len(cp.data) for s in sim.slots for cp in s.checkpoints)


def test_swa_full_reuses_the_prefix_and_takes_no_checkpoints(gemma3_16):
    sim = server(gemma3_16, swa_full=True)
    sub = sim.ctx.bus.subscribe(kinds=(ev.CheckpointChanged,))
    done = the_logged_chat(sim)
    assert [(d.n_cached, d.n_processed) for d in done] == [(0, 270), (270, 80), (0, 150), (40, 30)]
    assert sub.drain() == []
    assert "forcing full prompt re-processing" not in "\n".join(sim.log.lines)


def test_without_checkpoints_the_reuse_is_the_same_and_none_are_made(gemma3_16):
    sim = server(gemma3_16, ctx_checkpoints=0)
    sub = sim.ctx.bus.subscribe(kinds=(ev.CheckpointChanged,))
    done = the_logged_chat(sim)
    assert [(d.n_cached, d.n_processed) for d in done] == [(0, 270), (270, 80), (0, 150), (0, 70)]
    assert sub.drain() == []
    assert any(line.endswith("context checkpoints disabled") for line in sim.log.lines)





def test_a_checkpoint_at_a_user_message_saves_a_turn_that_diverges_outside_the_window(gemma3_16):
    """400 tokens, user messages from 100, 200, 300 and 380: checkpoints before the first user message (the
    list is empty) and the last, and before the batches near the end (368 = 400 - 32, 396 = 400 - 4). The next
    prompt keeps 120 tokens: the SWA ring lost positions below 147 and the window before 120 starts at 104,
    so the checkpoint at 100 is restored."""
    rng = random.Random(5)
    history = [rng.randrange(3, 500) for _ in range(400)]
    sim = server(gemma3_16, publish_logits=True)
    sub = sim.ctx.bus.subscribe(kinds=(ev.ServerPromptReused, ev.CheckpointChanged, ev.OutputLogProbs))
    sim.submit(Task(history, n_predict=2, id_slot=0, user_starts=(100, 200, 300, 380)))
    sim.run()
    created = [e.n_tokens for e in sub.drain() if isinstance(e, ev.CheckpointChanged)]
    assert created == [100, 368, 380, 396]
    edited = history[:120] + [(history[120] + 1) % 500] + [rng.randrange(3, 500) for _ in range(29)]
    sim.submit(Task(edited, n_predict=1, id_slot=0, user_starts=(100,)))
    done = sim.run()[-1]
    events = sub.drain()
    reused = next(e for e in events if isinstance(e, ev.ServerPromptReused))
    assert (reused.n_common, reused.restored_n_tokens, reused.n_past, reused.forced_full) == (120, 100, 99, False)
    assert (done.n_cached, done.n_processed) == (99, 51)
    erased = [(e.n_tokens, e.why) for e in events if isinstance(e, ev.CheckpointChanged) and e.action == "erased"]
    # the new prompt's user message at 100 gets its own checkpoint, which replaces the restored one
    assert erased == [(368, "invalidated"), (380, "invalidated"), (396, "invalidated"), (100, "superseded")]
    served = [e for e in events if isinstance(e, ev.OutputLogProbs) and e.positions == (149,)][0].logprobs[0]
    np.testing.assert_allclose(served, fresh_logprobs(gemma3_16, edited), atol=BATCHING_TOLERANCE)


def fresh_logprobs(model, prompt: list[int], *, swa_full: bool = False) -> np.ndarray:
    """The next-token log-probabilities after `prompt` in a new context (same batch sizes)."""
    ctx = engine.Context(model, n_ctx=1024, n_seq_max=2, kv_unified=False, n_batch=32, n_ubatch=32,
                         publish_logits=True, swa_full=swa_full)
    sub = ctx.bus.subscribe(kinds=(ev.OutputLogProbs,))
    for start in range(0, len(prompt), 32):
        assert ctx.decode(engine.Batch.for_sequence(prompt[start:start + 32], 0, start)) == 0
    return sub.drain()[-1].logprobs[-1]


def test_reuse_changes_the_cost_of_a_turn_not_its_answer(gemma3_16):
    """Random multi-turn histories on one slot, each turn's prompt cut back to a random point of the last
    one and extended: whether the server keeps the prefix, restores a checkpoint or re-processes it all, the
    first token's distribution equals a new context's for the whole prompt."""
    kinds = set()
    for seed in range(4):
        rng = random.Random(seed)
        sim = server(gemma3_16, publish_logits=True)
        sub = sim.ctx.bus.subscribe(kinds=(ev.OutputLogProbs, ev.ServerPromptReused))
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(20, 300))]
        for _ in range(5):
            starts = tuple(sorted(rng.sample(range(1, len(prompt)), k=min(3, len(prompt) - 1))))
            sim.submit(Task(prompt, n_predict=2, id_slot=0, user_starts=starts))
            sim.run()
            events = sub.drain()
            reused = next(e for e in events if isinstance(e, ev.ServerPromptReused))
            kinds.add("forced" if reused.forced_full else "restored" if reused.restored_n_tokens >= 0 else "kept")
            served = [e for e in events if isinstance(e, ev.OutputLogProbs) and e.positions[-1:] == (len(prompt) - 1,)]
            np.testing.assert_allclose(served[0].logprobs[-1], fresh_logprobs(gemma3_16, prompt),
                                       atol=BATCHING_TOLERANCE)
            cut = rng.randrange(1, len(prompt) + 1)
            prompt = prompt[:cut] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 200 if cut < 300 else 40))]
            prompt = prompt[:500]
    assert kinds == {"kept", "restored", "forced"}


def test_bad_requests_are_refused_and_leave_the_server_as_it_was(gemma3_16):
    sim = server(gemma3_16)
    with pytest.raises(KvscopeError, match="id_slot 5 is not a slot"):
        sim.submit(Task([5, 6, 7], id_slot=5))
    with pytest.raises(KvscopeError, match="at least one prompt token"):
        sim.submit(Task([]))
    with pytest.raises(KvscopeError, match="n_seq_max >= 3"):
        ServerSim(sim.ctx, ServerParams(n_slots=3))
    assert not sim.busy
    sim.submit(Task(list(range(3, 600)), id_slot=0))  # longer than the slot's 512 tokens
    done = sim.run()[-1]
    assert done.stop == "error" and "exceeds the available context size (512 tokens)" in done.error
    assert sim.ctx.memory.seq_pos_max(0) == -1 and not sim.slots[0].tokens


def test_cache_reuse_moves_a_chunk_that_the_new_prompt_repeats_further_on(gemma3_16):
    """--cache-reuse on a cache that can shift (--swa-full): the slot held A B C, the new prompt is A C D.
    C is found after the common prefix A, moved down over B (seq_rm of B, seq_add of C), and reused."""
    rng = random.Random(3)
    a, b, c = ([rng.randrange(3, 500) for _ in range(n)] for n in (40, 30, 60))
    sim = server(gemma3_16, swa_full=True, publish_logits=True, cache_reuse=16)
    sub = sim.ctx.bus.subscribe(kinds=(ev.ServerPromptReused, ev.OutputLogProbs, ev.CellsShifted))
    sim.submit(Task(a + b + c, n_predict=1, id_slot=0))
    sim.run()
    prompt = a + c + [rng.randrange(3, 500) for _ in range(5)]
    sim.submit(Task(prompt, n_predict=1, id_slot=0))
    done = sim.run()[-1]
    events = sub.drain()
    reused = [e for e in events if isinstance(e, ev.ServerPromptReused)][-1]
    assert (reused.n_cache_reused, reused.n_past) == (60, 100)
    assert (done.n_cached, done.n_processed) == (100, 5)
    assert any(e.amount == -30 for e in events if isinstance(e, ev.CellsShifted))  # C moved down over B
    assert any("reusing chunk with size 60, shifting KV cache [70, 130) -> [40, 100)" in line for line in sim.log.lines)
    # The moved chunk's keys and values were computed after B: this turn's distribution is not its prompt's
    # processed anew (by far more than batching rounding), and the reuse event says so as a QUIRK.
    served = [e for e in events if isinstance(e, ev.OutputLogProbs) and e.positions[-1:] == (len(prompt) - 1,)]
    differs = np.abs(served[0].logprobs[-1] - fresh_logprobs(gemma3_16, prompt, swa_full=True)).max()
    assert differs > 50 * BATCHING_TOLERANCE, differs
    assert reused.quirk.startswith("llama.cpp QUIRK (--cache-reuse") and "60 reused tokens were moved" in reused.quirk


def test_cache_reuse_is_refused_where_the_cache_cannot_shift(gemma3_16):
    sim = server(gemma3_16, cache_reuse=16)
    assert sim.cache_reuse == 0
    assert any("cache_reuse is not supported by this context, it will be disabled" in line for line in sim.log.lines)


def test_a_task_takes_the_most_similar_idle_slot_else_the_least_recently_used(gemma3_16):
    rng = random.Random(7)
    a, b = [rng.randrange(3, 500) for _ in range(60)], [rng.randrange(3, 500) for _ in range(60)]
    sim = server(gemma3_16)
    first = sim.submit(Task(a, n_predict=1))  # both slots empty, never used: the last one wins the tie
    sim.run()
    second = sim.submit(Task(b, n_predict=1))
    sim.run()
    assert [d.slot for d in sim.finished] == [1, 0]
    lines = "\n".join(sim.log.lines)
    assert "slot get_availabl: id  1 | task -1 | selected slot by LRU, t_last = -1" in lines
    sim.submit(Task(a[:50] + b[:20], n_predict=1))  # shares 50 of 70 with slot 1's tokens, nothing with slot 0's
    sim.run()
    assert sim.finished[-1].slot == 1 and sim.finished[-1].n_cached == 50
    assert "selected slot by LCP similarity, f_sim_best = 0.714 (> 0.100 thold), f_keep = 0.833" in "\n".join(sim.log.lines)
    sim.submit(Task([7] * 30, n_predict=1))  # like neither: the least recently used, slot 0
    sim.run()
    assert sim.finished[-1].slot == 0
    assert (first.id, second.id) == (0, 4)  # as llama-server counts: the first task took 3 update-loop iterations


def test_a_full_slot_shifts_its_context_and_goes_on(gemma3_16):
    """--context-shift on a cache that can shift: a slot whose next token would reach its 512 positions
    drops half of what follows --keep (llama-server's rule: n_keep + 1 for BOS, n_discard = n_left / 2)."""
    rng = random.Random(9)
    sim = server(gemma3_16, swa_full=True, context_shift=True)
    sub = sim.ctx.bus.subscribe(kinds=(ev.CellsShifted, ev.CellsRemoved))
    prompt = [rng.randrange(3, 500) for _ in range(500)]
    sim.submit(Task(prompt, n_predict=20, id_slot=0, n_keep=10))
    done = sim.run()[-1]
    assert done.stop == "limit" and done.n_generated == 20
    shift = "slot update_slots: id  0 | task 0 | slot context shift, n_keep = 11, n_left = 500, n_discard = 250"
    assert any(line.endswith(shift[shift.index("slot context"):]) and "W slot" in line for line in sim.log.lines)
    events = sub.drain()
    assert any(isinstance(e, ev.CellsRemoved) and (e.p0, e.p1) == (11, 261) and e.cause == "context shift" for e in events)
    assert any(isinstance(e, ev.CellsShifted) and e.amount == -250 for e in events)
    assert sim.ctx.memory.seq_pos_max(0) + 1 == len(sim.slots[0].tokens) == 500 + 19 - 250
    without = server(gemma3_16, swa_full=True)
    without.submit(Task(prompt, n_predict=20, id_slot=0))
    assert without.run()[-1].stop == "context"  # no shift: the slot stops when full


def test_a_prompt_the_slot_holds_whole_still_evaluates_its_last_token(gemma3_16):
    """The same prompt again (with --swa-full, so the cache serves all of it): llama-server evaluates at
    least one token for the logits, and says so."""
    prompt = [5 + i % 400 for i in range(100)]
    sim = server(gemma3_16, swa_full=True)
    sim.submit(Task(prompt + [7], n_predict=1, id_slot=0))
    sim.run()
    sim.submit(Task(prompt, n_predict=1, id_slot=0))
    done = sim.run()[-1]
    assert (done.n_cached, done.n_processed) == (99, 1)
    warned = [line.split("| ", 2)[-1] for line in sim.log.lines if " W slot" in line]
    assert warned == ["need to evaluate at least 1 token for each active slot (n_past = 100, task.n_tokens() = 100)",
                      "n_past was set to 99"]


def test_the_prompt_cache_brings_back_a_prompt_the_slot_gave_up(gemma3_16):
    """Slot 0 answers A, then B (B shares nothing with A: the server saves A to the prompt cache first),
    then A and more: the server saves B, finds A in the cache (it keeps all of itself and serves most of the
    new prompt), loads its state and reuses it. The answer is that of the prompt processed anew."""
    rng = random.Random(11)
    a, b = [rng.randrange(3, 500) for _ in range(200)], [rng.randrange(3, 500) for _ in range(120)]
    sim = server(gemma3_16, publish_logits=True)
    sub = sim.ctx.bus.subscribe(kinds=(ev.OutputLogProbs, ev.DeviceMemoryChanged))
    for prompt in (a, b):
        sim.submit(Task(prompt, n_predict=1, id_slot=0))
        sim.run()
    again = a + [rng.randrange(3, 500) for _ in range(30)]
    sim.submit(Task(again, n_predict=1, id_slot=0))
    done = sim.run()[-1]
    lines = "\n".join(without_stamp(line) for line in sim.log.lines)
    assert "srv         alloc:  - removing obsolete" not in lines
    assert "srv          load:  - found better prompt with f_keep = 1.000, f_sim = 0.870" in lines
    assert done.n_cached >= 200 - 32 and done.n_processed == len(again) - done.n_cached
    events = sub.drain()
    served = [e for e in events if isinstance(e, ev.OutputLogProbs) and e.positions[-1:] == (len(again) - 1,)]
    np.testing.assert_allclose(served[0].logprobs[-1], fresh_logprobs(gemma3_16, again), atol=BATCHING_TOLERANCE)
    held = sum(e.delta for e in events if isinstance(e, ev.DeviceMemoryChanged) and e.what == "prompt cache")
    assert held == sim.prompt_cache.bytes_held == sim.prompt_cache.size() > 0  # B's state is in it now


def test_with_one_buffer_for_all_an_idle_slot_is_saved_and_cleared(gemma3_16):
    ctx = engine.Context(gemma3_16, n_ctx=1024, n_seq_max=2, kv_unified=True, n_batch=32, n_ubatch=32)
    sim = ServerSim(ctx, ServerParams(n_slots=2), log=ServerLog(ctx.bus))
    sim.submit(Task(list(range(3, 80)), n_predict=1, id_slot=0))
    sim.run()
    assert sim.ctx.memory.seq_pos_max(0) >= 0
    sim.submit(Task(list(range(100, 140)), n_predict=1, id_slot=1))
    sim.run()
    lines = [without_stamp(line) for line in sim.log.lines]
    assert "I srv          init: idle slots will be saved to prompt cache and cleared upon starting a new task" in lines
    assert "I slot prompt_clear: id  0 | task -1 | clearing prompt with 77 tokens" in lines
    assert sim.ctx.memory.seq_pos_max(0) == -1 and not sim.slots[0].tokens
    assert [len(p.tokens) for p in sim.prompt_cache.prompts] == [77]


def test_without_a_prompt_cache_nothing_is_saved(gemma3_16):
    sim = server(gemma3_16, cache_ram_mib=0)
    the_logged_chat(sim)
    lines = [without_stamp(line) for line in sim.log.lines]
    assert "I srv    load_model: prompt cache is disabled - use `--cache-ram N` to enable it" in lines
    assert "W srv          init: --cache-idle-slots requires --cache-ram, disabling" in lines
    assert not any("saving" in line for line in lines) and sim.prompt_cache is None
