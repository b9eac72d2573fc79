"""A simulated server: N client slots answering a stream of requests (llama.cpp's `parallel` example).

What it does to the cache, step by step (examples/parallel/parallel.cpp, with the server's batching):

- Sequence 0 holds a shared system prompt, decoded once. Client c (0-based) uses sequence c + 1, so
  the context needs n_seq_max >= n_clients + 1 (llama-parallel sets n_parallel + 1 itself; so does
  `kvscope parallel`). At the start every client gets the system prompt with
  `seq_cp(0, c + 1, -1, -1)`; when a request finishes its sequence is cleared with
  `seq_rm(c + 1, -1, -1)` and the system prompt copied in again, so an idle client always holds it.
- Unified cache (-kvu): the copy is metadata only, the system prompt's cells are shared by all
  sequences ({0, 1, ..., N}). Split streams (llama-parallel's default, -kvu off): each sequence has a
  stream of n_ctx_seq cells; `seq_cp` across streams resets the client's stream to a copy of stream 0
  (cells and, at the next decode, the K/V rows) — the system prompt is stored once per stream and
  costs every client its cells. This is what llama.cpp does; it works because stream 0 holds
  nothing but sequence 0.
- Requests come from a deterministic schedule (`make_schedule`, a seed): a question from a small
  built-in list, a token budget, an arrival step. A free client takes the oldest arrived request.
- Every step builds ONE batch (continuous batching, as llama-server): first one token for each
  generating client, then prompt tokens of clients still reading their prompt, in client order,
  until n_batch tokens; a longer prompt continues in the next step. The last prompt token and
  every generated token are outputs.
- Decode return code 1 (no KV slot), as llama-parallel / llama-server: halve n_batch and retry the
  rest of the batch in pieces of that size (a "cache miss"); after a successful piece n_batch goes back
  to its full value. When even a single token finds no slot, the request owning that token fails
  with llama-server's "Context size has been exceeded." and is dropped (its tokens leave the batch,
  its sequence is cleared and gets the system prompt back); the others continue. (llama-server fails
  every processing slot there — its TODO is to drop only one; llama-parallel exits.) Return code 2
  (aborted) stops the run; other failures drop the requests of the failed piece.
- A request ends on an end-of-generation token ("eog"), after n_predict tokens ("length"), or when
  its text contains the reverse prompt "User:" ("stop_word", text cut there), as llama-parallel.
- A slot's own context (`n_ctx_slot`, off by default as in llama-parallel; llama-server's per-slot
  n_ctx): a generating client whose next token would reach it (n_past + 1 >= n_ctx_slot) is shifted
  with llama-server's context shift when `context_shift` is on (the first n_keep positions kept,
  n_keep < 0: the whole prompt, system prompt included; half of the rest discarded with seq_rm, the tail
  moved down with seq_add; the K-shift re-rotates the keys at the next decode), else it stops with
  "limit" once n_past reaches it, as llama-server's "stopped due to running out of context capacity".
  Slots may together claim more than the cache holds, as a server's do: then slot searches fail and the
  batch is split as above.

Sampling: each request gets a fresh `Sampler` with the run's seed (llama.cpp's per-client sampler,
reset — and reseeded — per request), so a request's tokens do not depend on what runs beside it.
With no seed a random one is drawn per run (`ParallelRunner.seed`).
"""
from __future__ import annotations

import array
import collections
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from engine import events as ev
from engine.batch import Batch
from engine.context import Context
from engine.errors import KvscopeError
from engine.runners.generate import context_shift, resolve_n_keep
from engine.runners.parallel_records import (
    ClientState,
    DecodeCall,
    RequestResult,
    RunSummary,
    StepInfo,
)
from engine.runners.parallel_workload import (
    DEFAULT_SYSTEM_PROMPT,
    Request,
    check_system_prompt,
    format_prompt,
    make_schedule,
)
from engine.sampling import Sampler, SamplerParams

log = logging.getLogger("kvscope.parallel")
KEPT_RESULTS = 1000  # results an open run (keep_open) keeps, the latest ones

CONTEXT_EXCEEDED = "Context size has been exceeded."
REVERSE_PROMPT = "User:"  # llama-parallel stops an answer there and cuts it off


@dataclass
class _Client:
    index: int
    seq_id: int
    result: RequestResult | None = None
    state: str = "idle"
    prompt_done: int = 0  # prompt tokens already put in a batch
    n_past: int = 0
    last_token: int = -1
    sampler: Sampler | None = None
    decoder: object = None


class ParallelRunner:
    """N clients answering requests with continuous batching on one context.

        runner = ParallelRunner(ctx, n_clients=4, params=SamplerParams(temperature=0, seed=1))
        for info in runner.steps(make_schedule(16, seed=1)):   # live
            ...
        results = runner.run(16, seed=1)                       # or all at once
    """

    def __init__(self, ctx: Context, n_clients: int, params: SamplerParams | None = None, *,
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, share_system_prompt: bool = True,
                 n_ctx_slot: int = 0, context_shift: bool = False, n_keep: int = 0) -> None:
        """share_system_prompt: decode the system prompt once into sequence 0 and copy it (llama-parallel's
        -pps); False: every request decodes it itself, in its own sequence (same tokens).
        n_ctx_slot: each client's context in positions (0: none but the cache's); context_shift, n_keep:
        what happens when a client fills it (see the module docstring)."""
        if ctx.model.tokenizer is None:
            raise KvscopeError("this model has no tokenizer; the parallel workload needs one")
        if n_clients < 1:
            raise KvscopeError(f"n_clients must be >= 1, got {n_clients}")
        if ctx.n_seq_max < n_clients + 1:
            raise KvscopeError(
                f"{n_clients} clients use sequences 1..{n_clients} and sequence 0 holds the system prompt, so the "
                f"context needs n_seq_max >= {n_clients + 1} (it has {ctx.n_seq_max}); llama-parallel sets "
                f"n_parallel + 1 itself")
        if n_ctx_slot < 0 or n_ctx_slot > ctx.params.n_ctx_seq:
            raise KvscopeError(f"n_ctx_slot must be in 0..{ctx.params.n_ctx_seq} (the context of a sequence), got "
                               f"{n_ctx_slot}")
        if context_shift and not n_ctx_slot:
            raise KvscopeError("the parallel workload shifts a client when it fills its slot's context: give "
                               "n_ctx_slot with context_shift")
        if context_shift and not ctx.memory.can_shift():  # llama-server switches it off the same way
            log.warning("the context does not support context shift (iSWA without swa_full, or M-RoPE); "
                        "disabling it")
            context_shift = False
        self.ctx = ctx
        self.tokenizer = ctx.model.tokenizer
        self.n_clients = n_clients
        self.n_ctx_slot, self.context_shift, self.n_keep = n_ctx_slot, context_shift, n_keep
        self.n_shifts = 0
        params = params or SamplerParams()
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.params = SamplerParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    min_p=params.min_p, repeat_penalty=params.repeat_penalty,
                                    repeat_last_n=params.repeat_last_n, seed=self.seed)
        self.system_prompt = system_prompt
        self.share_system_prompt = share_system_prompt
        check_system_prompt(system_prompt, share_system_prompt)
        self.system_tokens = self.tokenizer.encode(system_prompt) if system_prompt else []
        if share_system_prompt and not self.system_tokens:
            raise KvscopeError(f"the system prompt {system_prompt!r} has no tokens, so there is nothing to share; "
                               f"give one with text, or share_system_prompt=False (--no-pps)")
        self.clients = [_Client(i, i + 1) for i in range(n_clients)]
        self.results: list[RequestResult] = []
        self.cache_misses = 0
        self.t_sample_ms = 0.0
        self.n_sample = 0
        self.t_start = 0.0
        self.t_end = 0.0
        self.n_sequences = 0
        self._started = False
        self._pending: list[Request] = []  # not arrived yet; submit() adds to it while the run goes on
        self._next_request_id = 0
        self._keep_open = False

    # ---- public API -------------------------------------------------------------------------
    def run(self, n_sequences: int | None = None, *, requests: Sequence[Request] | None = None,
            seed: int | None = None, n_predict: int = 64, arrival_gap: int = 2) -> list[RequestResult]:
        """Run a whole workload: `requests`, or `make_schedule(n_sequences, seed=..., n_predict=...,
        arrival_gap=...)`. Returns one result per request, in request order."""
        for _ in self.steps(self._requests(n_sequences, requests, seed, n_predict, arrival_gap)):
            pass
        return sorted(self.results, key=lambda r: r.request.id)

    def steps(self, requests: Sequence[Request], *, keep_open: bool = False) -> Iterator[StepInfo]:
        """Run the workload one step at a time: each StepInfo says what the step's batch did.
        A runner runs one workload. keep_open: when every request is done, yield "idle" steps (no
        decode) instead of ending, so that requests given to submit() later are still served."""
        if self._started:
            raise KvscopeError("this ParallelRunner has already run a workload; create a new one")
        self._started = True
        pending = sorted(requests, key=lambda r: (r.arrival_step, r.id))
        if len({r.id for r in pending}) != len(pending):
            raise KvscopeError("request ids must be distinct")
        self._pending, self._keep_open = pending, keep_open
        self._next_request_id = max((r.id for r in pending), default=-1) + 1
        if keep_open:  # an open run may serve requests for hours: keep the latest results, not all
            self.results = collections.deque(self.results, maxlen=KEPT_RESULTS)
        self.n_sequences = len(pending)
        self.t_start = time.perf_counter()
        log.info("main: Simulating parallel requests from clients:")
        log.info("main: n_parallel = %d, n_sequences = %d, cont_batching = 1, system tokens = %d", self.n_clients,
                 len(pending), len(self.system_tokens))
        try:
            if self.share_system_prompt:
                yield self._decode_system_prompt()
            yield from self._loop(self._pending)
        finally:
            self.t_end = time.perf_counter()

    def submit(self, question: str, n_predict: int, arrival_step: int = 0) -> Request:
        """A request that joins a running workload (steps() must have started): it arrives at
        arrival_step or, if that has passed, at the next step. Returns it, with its id."""
        if not self._started:
            raise KvscopeError("submit() joins a running workload: start it with steps() first")
        if n_predict < 1:
            raise KvscopeError(f"n_predict must be >= 1, got {n_predict}")
        req = Request(self._next_request_id, question, n_predict, arrival_step)
        self._next_request_id += 1
        self._pending.append(req)
        self._pending.sort(key=lambda r: (r.arrival_step, r.id))
        self.n_sequences += 1
        return req

    def shifted(self, seq_id: int, n_discard: int) -> None:
        """The sequence of a generating client was moved down by n_discard positions (a context shift
        made from outside the run): its next token goes there too."""
        c = self._generating_client(seq_id)
        c.n_past -= n_discard

    def check_shift(self, seq_id: int) -> None:
        """Refuse a context shift the run could not follow: a client still decoding its prompt."""
        self._generating_client(seq_id)

    def _generating_client(self, seq_id: int) -> _Client:
        for c in self.clients:
            if c.seq_id == seq_id:
                if c.state == "prompt":
                    raise KvscopeError(f"seq {seq_id} is still decoding its prompt; shift it once it generates")
                return c
        raise KvscopeError(f"seq {seq_id} is no client's sequence (clients use 1..{self.n_clients})")

    def summary(self) -> RunSummary:
        """Totals of the run (of the KEPT_RESULTS latest requests in a keep_open run)."""
        done = [r for r in self.results if r.ok]
        t_end = self.t_end or time.perf_counter()
        return RunSummary(self.n_clients, self.n_sequences, len(self.system_tokens),
                          sum(r.n_prompt for r in done), sum(r.n_decoded for r in done),
                          sum(1 for r in self.results if not r.ok), self.cache_misses,
                          max(t_end - self.t_start, 0.0))

    # ---- the loop ---------------------------------------------------------------------------
    @staticmethod
    def _requests(n_sequences, requests, seed, n_predict, arrival_gap) -> list[Request]:
        if requests is not None:
            return list(requests)
        if n_sequences is None:
            raise KvscopeError("give n_sequences or requests")
        return make_schedule(n_sequences, seed=seed, n_predict=n_predict, arrival_gap=arrival_gap)

    def _decode_system_prompt(self) -> StepInfo:
        t0 = time.perf_counter()
        log.info("main: Evaluating the system prompt ...")
        toks, n_batch, calls = self.system_tokens, self.ctx.n_batch, []
        for i in range(0, len(toks), n_batch):
            chunk = toks[i:i + n_batch]
            rc = self.ctx.decode(Batch(chunk, list(range(i, i + len(chunk))), [[0]] * len(chunk),
                                       [False] * (len(chunk) - 1) + [True]))
            calls.append(DecodeCall(i, len(chunk), n_batch, rc))
            if rc != 0:
                raise KvscopeError(f"failed to decode the system prompt (decode returned {rc}: "
                                   f"{self.ctx.last_error}); increase the context size")
        with self.ctx.bus.cause("copying the system prompt"):
            for c in self.clients:  # assign the system prompt's cells to every client
                self.ctx.memory.seq_cp(0, c.seq_id, -1, -1)
        return self._info(0, "system", (), (), len(toks), len(toks), 0, calls, 0, n_batch, 0, (), [], [], t0)

    def _loop(self, pending: list[Request]) -> Iterator[StepInfo]:
        waiting: list[Request] = []
        step = 0
        while True:
            step += 1
            busy = any(c.state != "idle" for c in self.clients)
            if not busy and not waiting and pending and pending[0].arrival_step > step:
                step = pending[0].arrival_step  # nothing to do until the next arrival
            while pending and pending[0].arrival_step <= step:
                waiting.append(pending.pop(0))
            if not busy and not waiting:
                if not self._keep_open:
                    break
                yield self._info(step, "idle", (), (), 0, 0, 0, (), 0, self.ctx.n_batch, 0, (), waiting, pending,
                                 time.perf_counter())
                continue
            t0 = time.perf_counter()
            finished: list[RequestResult] = []
            admitted = self._admit(waiting, step, finished)
            if self.n_ctx_slot:
                self._fit_slots(step, finished)
            entries = self._build_batch()
            n_tokens, n_gen = len(entries), sum(1 for e in entries if e[4] == "gen")
            sampled: list[tuple[int, int, int, str]] = []
            calls: list[DecodeCall] = []
            rc, min_batch, misses = self._decode_batch(entries, step, finished, sampled, calls)
            for c in self.clients:
                if c.result is None:
                    continue
                if rc == 2:  # aborted: every request in flight ends, nothing new starts
                    c.result.stop_reason, c.result.error = "aborted", "decode aborted"
                    finished.append(self._release(c, step))
                elif c.state == "generating" and self._done(c):
                    finished.append(self._release(c, step))
            yield self._info(step, "batch", admitted, finished, n_tokens, n_tokens - n_gen, n_gen, calls, rc,
                             min_batch, misses, sampled, waiting, pending, t0)
            if rc == 2:
                return

    def _admit(self, waiting: list[Request], step: int, finished: list[RequestResult]) -> tuple[tuple[int, int], ...]:
        admitted = []
        for c in self.clients:
            if c.state != "idle" or not waiting:
                continue
            req = waiting.pop(0)
            own = self.tokenizer.encode(format_prompt(req.question), add_bos=False)
            if self.share_system_prompt:
                prompt, n_past = own, len(self.system_tokens)
            else:
                prompt, n_past = self.system_tokens + own, 0
                with self.ctx.bus.cause(f"the start of request {req.id}"):
                    self.ctx.memory.seq_rm(c.seq_id, -1, -1)
            if self.ctx.bus.active:
                self.ctx.bus.publish(ev.SequenceAssigned(c.seq_id, f"client {c.index}, request {req.id}",
                                                         req.question, len(prompt)))
            c.result = RequestResult(req, c.index, c.seq_id, prompt, n_past, admitted_step=step,
                                     t_admitted=time.perf_counter())
            self.results.append(c.result)
            c.state, c.prompt_done, c.n_past = "prompt", 0, n_past
            c.sampler = Sampler(self.params)  # a fresh sampler: reset and reseeded, as common_sampler_reset
            c.decoder = self.tokenizer.stream(context_ids=prompt)
            admitted.append((req.id, c.index))
            if self.n_ctx_slot and n_past + len(prompt) >= self.n_ctx_slot:  # llama-server refuses it too
                c.result.stop_reason = "error"
                c.result.error = (f"the request exceeds the available context size: {n_past + len(prompt)} "
                                  f"positions, the slot has {self.n_ctx_slot}")
                finished.append(self._release(c, step))
                continue
            log.info("Client %3d, seq %4d, junk = %4d, prompt = %d, started decoding ...", c.index, req.id, 0,
                     len(prompt))
        return tuple(admitted)

    def _fit_slots(self, step: int, finished: list[RequestResult]) -> None:
        """llama-server before it builds a batch: a generating client whose next token would fill its
        slot's context is shifted (context_shift) or, without it, stops at the slot's end."""
        for c in self.clients:
            if c.state != "generating" or c.n_past + 1 < self.n_ctx_slot:
                continue
            r = c.result
            n_keep = resolve_n_keep(self.n_keep, r.n_past_start + r.n_prompt, bool(self.tokenizer.add_bos))
            shift = context_shift(self.ctx, c.seq_id, c.n_past, n_keep, self.n_ctx_slot) if self.context_shift \
                else None
            if shift is not None:
                c.n_past -= shift.n_discard
                r.context_shifts += 1
                self.n_shifts += 1
            elif c.n_past >= self.n_ctx_slot or self.context_shift:  # nothing left to discard after n_keep
                log.warning("Client %3d, seq %4d: stopped, the slot's context of %d is full (n_past = %d)",
                            c.index, r.request.id, self.n_ctx_slot, c.n_past)
                r.stop_reason = "limit"
                finished.append(self._release(c, step))

    def _build_batch(self) -> list[tuple[int, int, int, bool, str]]:
        """(client, token, pos, output, kind) per batch token: generating clients first, then prompt
        tokens up to n_batch."""
        entries = []
        for c in self.clients:
            if c.state == "generating":
                entries.append((c.index, c.last_token, c.n_past, True, "gen"))
        room = self.ctx.n_batch - len(entries)
        for c in self.clients:
            if c.state != "prompt" or room <= 0:
                continue
            prompt = c.result.prompt_tokens
            take = min(room, len(prompt) - c.prompt_done)
            for k in range(c.prompt_done, c.prompt_done + take):
                entries.append((c.index, prompt[k], c.result.n_past_start + k, k == len(prompt) - 1, "prompt"))
            c.prompt_done += take
            room -= take
        return entries

    def _decode_batch(self, entries, step, finished, sampled, calls) -> tuple[int, int, int]:
        """Decode the step's batch in pieces of n_batch, halving on return code 1."""
        full = self.ctx.n_batch
        n_batch, min_batch, misses, last_rc = full, full, 0, 0
        i = 0
        while i < len(entries):
            view = entries[i:i + n_batch]
            batch = Batch([e[1] for e in view], [e[2] for e in view], [[self.clients[e[0]].seq_id] for e in view],
                          [e[3] for e in view])
            rc = self.ctx.decode(batch)
            calls.append(DecodeCall(i, len(view), n_batch, rc))
            min_batch, last_rc = min(min_batch, n_batch), rc
            if rc == 0:
                self._sample_view(view, step, sampled)
                for e in view:  # an eog/length/stop-word finish is applied after the whole batch
                    self.clients[e[0]].n_past = max(self.clients[e[0]].n_past, e[2] + 1)
                i += len(view)
                n_batch = full
                continue
            if rc == 1 and len(view) > 1:
                misses += 1
                self.cache_misses += 1
                for cl in {e[0] for e in entries[i:]}:
                    self.clients[cl].result.cache_misses += 1
                # llama.cpp halves n_batch itself, also when the failed piece was already shorter (the
                # batch's tail), and so may retry the same tokens; kvscope halves the piece instead.
                n_batch = len(view) // 2
                log.warning("main : failed to decode the batch, retrying with n_batch = %d", n_batch)
                continue
            if rc == 2:
                log.error("main : decode aborted")
                return rc, min_batch, misses
            # no slot even for one token, or a failed computation: drop the request(s) of this piece
            error = CONTEXT_EXCEEDED if rc == 1 else f"decode failed, ret = {rc}"
            victims = sorted({e[0] for e in view})
            for cl in victims:
                c = self.clients[cl]
                log.error("Client %3d, seq %4d: %s (n_batch = %d, ret = %d)", c.index, c.result.request.id, error,
                          len(view), rc)
                c.result.stop_reason, c.result.error = "error", error
                finished.append(self._release(c, step))
            entries[i:] = [e for e in entries[i:] if e[0] not in victims]
            n_batch = full
        return last_rc, min_batch, misses

    def _sample_view(self, view, step: int, sampled: list) -> None:
        bus = self.ctx.bus
        for k, e in enumerate(view):
            if not e[3]:
                continue
            c = self.clients[e[0]]
            t0 = time.perf_counter()
            token = c.sampler.sample(self.ctx.logits_for_token(k), seq_id=c.seq_id)
            self.t_sample_ms += (time.perf_counter() - t0) * 1e3
            self.n_sample += 1
            r = c.result
            if not r.tokens:
                r.t_first_token = time.perf_counter()
            r.tokens.append(token)
            c.state, c.last_token = "generating", token
            if self.tokenizer.is_eog(token):
                piece = ""
                r.stop_reason = "eog"
            else:
                piece = c.decoder.push(token)
                r.text += piece
            sampled.append((c.index, r.request.id, token, piece))
            if bus.active:
                bus.publish(ev.TokenSampled(c.seq_id, token, piece, e[2] + 1))

    def _done(self, c: _Client) -> bool:
        r = c.result
        if r.stop_reason:
            return True
        if REVERSE_PROMPT in r.text:
            r.text = r.text[:r.text.index(REVERSE_PROMPT)]
            r.stop_reason = "stop_word"
        elif len(r.tokens) >= r.request.n_predict:
            r.stop_reason = "length"
        return bool(r.stop_reason)

    def _release(self, c: _Client, step: int) -> RequestResult:
        """The request is over: clear its sequence and give the client the system prompt back."""
        r = c.result
        if r.ok and r.stop_reason != "stop_word":
            tail = c.decoder.flush()
            r.text += tail
        r.finished_step, r.t_finished = step, time.perf_counter()
        # the error's own text in the cause: a cell's history then tells why its request ended ("... (error:
        # Context size has been exceeded.)"), as nothing else that reaches a view says it
        ended = f"{r.stop_reason}: {r.error}" if r.error else r.stop_reason
        with self.ctx.bus.cause(f"the end of request {r.request.id} ({ended})"):
            self.ctx.memory.seq_rm(c.seq_id, -1, -1)
            if self.share_system_prompt:
                self.ctx.memory.seq_cp(0, c.seq_id, -1, -1)
        if r.ok:
            log.debug("Client %3d, seq %3d/%3d, prompt %4d t, response %4d t, time %5.2f s, speed %5.2f t/s, "
                     "cache miss %d", c.index, r.request.id, self.n_sequences, r.n_prompt, r.n_decoded, r.time_s,
                     r.speed, r.cache_misses)
        c.result, c.state, c.sampler, c.decoder, c.prompt_done = None, "idle", None, None, 0
        c.n_past = len(self.system_tokens) if self.share_system_prompt else 0
        if self._keep_open:
            # An open run keeps its latest results for as long as it runs: their tokens as one array each
            # rather than a list of int objects (a thousand results held ~70k long-lived small objects; the
            # soak's slow climb measured the same without them, so that climb has another cause).
            r.prompt_tokens, r.tokens = array.array("i", r.prompt_tokens), array.array("i", r.tokens)
        return r

    def _info(self, step, phase, admitted, finished, n_tokens, n_prompt, n_gen, calls, rc, n_batch, misses,
              sampled, waiting, pending, t0) -> StepInfo:
        clients = tuple(ClientState(c.index, c.seq_id, c.result.request.id if c.result else -1, c.state, c.n_past)
                        for c in self.clients)
        kv_used = self._kv_used()
        return StepInfo(step, phase, tuple(admitted), tuple(finished), n_tokens, n_prompt, n_gen, tuple(calls), rc,
                        n_batch, misses, tuple(sampled), clients, len(waiting), len(pending), kv_used,
                        (time.perf_counter() - t0) * 1e3)

    def _kv_used(self) -> int:
        """Cells in use over all streams of the first cache: the plain cache, or the base
        (full-attention) cache of an iSWA pair, which holds every position."""
        cache = self.ctx.memory.caches()[0]
        return sum(cache.used(s) for s in range(cache.n_stream))
