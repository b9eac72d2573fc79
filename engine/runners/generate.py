"""Text generation on a Context: tokenize, decode, sample, detokenize; one sequence or many at once.

The generator only uses the public Context API (decode, logits, memory ops), so what it does to the
cache is exactly what a llama.cpp program doing the same calls would do.

Context shift (llama-completion's rule: the "context full, swapping" branch of `main` in
`tools/completion/completion.cpp`), on with `context_shift=True`: before a sequence's next token is
decoded, if `n_past + 1 >= n_ctx_seq` (llama-completion's `n_past + pending >= n_ctx`),
the first `n_keep` positions are kept, half of the rest is discarded with `seq_rm` and the tail is
moved down with `seq_add`; the keys are re-rotated by the K-shift at the next decode. A decode that
returns 1 (no slot, e.g. a unified cache shared by several growing sequences) shifts the sequence
with the most discardable positions and retries. Without context shift, generation stops when a
decode finds no slot ("context_full"), as before. When the memory cannot shift (iSWA without
swa_full, M-RoPE) the option is switched off with llama.cpp's warning, as `common_init_from_params`
does.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from engine import events as ev
from engine.batch import Batch
from engine.context import Context
from engine.errors import KvscopeError
from engine.sampling import Sampler, SamplerParams

log = logging.getLogger("kvscope.generate")

TextCallback = Callable[[int, str], None]  # (seq_id, new text)


@dataclass(frozen=True)
class ContextShift:
    """One context shift of a sequence: positions [n_keep, n_keep + n_discard) were removed and
    [n_keep + n_discard, n_past) moved down by n_discard; n_past afterwards is n_past - n_discard."""

    seq_id: int
    n_past: int
    n_keep: int
    n_left: int
    n_discard: int


@dataclass
class SequenceResult:
    seq_id: int
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""  # "eog", "length" or "context_full"
    context_shifts: list[ContextShift] = field(default_factory=list)


@dataclass
class _Running:
    result: SequenceResult
    next_pos: int
    decoder: object
    last_token: int = -1
    n_keep: int = 0
    n_predict: int = 64


def check_n_predict(n_predict: int) -> None:
    """n_predict: -1 (no limit), 0 (evaluate the prompt only) or a number of tokens; the command checks it
    before loading a model."""
    if n_predict < -1:
        raise KvscopeError(f"n_predict must be -1 (no limit), 0 (the prompt only) or more, got {n_predict}")


def resolve_n_keep(n_keep: int, n_prompt: int, add_bos: bool) -> int:
    """llama-completion's n_keep: < 0 or > the prompt length -> the prompt length; otherwise
    n_keep + 1 when the vocabulary adds BOS (the BOS token is always kept)."""
    if n_keep < 0 or n_keep > n_prompt:
        return n_prompt
    return n_keep + int(add_bos)


def context_shift(ctx: Context, seq_id: int, n_past: int, n_keep: int, n_ctx: int | None = None) -> ContextShift | None:
    """Discard half of the positions after n_keep of one sequence, as llama-completion does:
    n_left = n_past - n_keep, n_discard = n_left / 2, seq_rm(seq, n_keep, n_keep + n_discard),
    seq_add(seq, n_keep + n_discard, n_past, -n_discard). The K-shift runs at the next decode.
    Returns None (and changes nothing) when there is nothing to discard. n_ctx: the sequence's context
    for the log line (default n_ctx_seq; a server slot's own context otherwise)."""
    n_left = n_past - n_keep
    n_discard = int(n_left / 2)  # C integer division (truncates towards zero)
    if n_discard <= 0:
        return None
    # llama-completion's line (it logs it at debug level; kvscope makes it a warning). n_ctx there is
    # the single sequence's context, i.e. n_ctx_seq here.
    log.warning("context full, swapping: n_past = %d, n_left = %d, n_ctx = %d, n_keep = %d, n_discard = %d",
                n_past, n_left, ctx.params.n_ctx_seq if n_ctx is None else n_ctx, n_keep, n_discard)
    with ctx.bus.cause(f"context shift of seq {seq_id}: n_keep = {n_keep}, n_discard = {n_discard}"):
        ctx.memory.seq_rm(seq_id, n_keep, n_keep + n_discard)
        ctx.memory.seq_add(seq_id, n_keep + n_discard, n_past, -n_discard)
    log.debug("after swap: n_past = %d", n_past - n_discard)
    return ContextShift(seq_id, n_past, n_keep, n_left, n_discard)


class Generator:
    """Generates text for one or several sequences of a context, one decode per step for all of them."""

    def __init__(self, ctx: Context, params: SamplerParams | None = None, *, context_shift: bool = False,
                 n_keep: int = 0) -> None:
        """context_shift, n_keep: llama.cpp's --context-shift and --keep (see the module docstring)."""
        if ctx.model.tokenizer is None:
            raise KvscopeError("this model has no tokenizer; generation needs one")
        self.ctx = ctx
        self.tokenizer = ctx.model.tokenizer
        self.sampler = Sampler(params or SamplerParams())
        self.t_sample_ms = 0.0
        self.n_sample = 0
        self.n_keep = int(n_keep)
        self.context_shift = bool(context_shift)
        if self.context_shift and not ctx.memory.can_shift():
            log.warning("common_init_from_params: KV cache shifting is not supported for this context, "
                        "disabling KV cache shifting")
            self.context_shift = False
        self.shifts: list[ContextShift] = []  # every context shift, in order
        self.last_rc = 0  # the return code of the last decode
        self.last_n_tokens = 0  # tokens decoded since a step began (GenerationRun resets it)

    def generate(self, prompt: str | Sequence[int], n_predict: int = 64, *, seq_id: int = 0,
                 on_text: TextCallback | None = None) -> SequenceResult:
        """Generate for one sequence (its cells are cleared first)."""
        return self.generate_parallel([prompt], n_predict, seq_ids=[seq_id], on_text=on_text)[0]

    def stream(self, prompt: str | Sequence[int], n_predict: int = 64, *, seq_id: int = 0) -> Iterator[str]:
        """Yield text pieces as they are generated (runs the whole generation eagerly per step)."""
        pieces: list[str] = []
        result_holder: list[SequenceResult] = []

        def collect(_: int, text: str) -> None:
            pieces.append(text)

        for _ in self._steps([prompt], n_predict, [seq_id], collect, result_holder):
            yield from pieces
            pieces.clear()
        yield from pieces

    def generate_parallel(self, prompts: Sequence[str | Sequence[int]], n_predict: int = 64, *,
                          seq_ids: Sequence[int] | None = None,
                          on_text: TextCallback | None = None) -> list[SequenceResult]:
        """Generate for several sequences at once: one prompt each, all advanced in every decode."""
        results: list[SequenceResult] = []
        for _ in self._steps(prompts, n_predict, seq_ids, on_text, results):
            pass
        return results

    def run(self, on_text: TextCallback | None = None) -> GenerationRun:
        """An open set of sequences, advanced one decode per step(); prompts can join between steps.
        What the session's generation workload drives."""
        return GenerationRun(self, on_text)

    # ---- the loop ---------------------------------------------------------------------------
    def _steps(self, prompts, n_predict, seq_ids, on_text, results_out) -> Iterator[None]:
        seq_ids = list(range(len(prompts))) if seq_ids is None else list(seq_ids)
        if not prompts:
            raise KvscopeError("no prompts: give at least one")
        check_n_predict(n_predict)
        if len(seq_ids) != len(prompts):
            raise KvscopeError(f"{len(prompts)} prompts but {len(seq_ids)} seq ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise KvscopeError(f"seq ids must be distinct, got {seq_ids}")
        run = self.run(on_text)
        results_out.extend(run.add(prompt, s, n_predict) for prompt, s in zip(prompts, seq_ids))
        while run.step():
            yield

    def _start(self, prompt, seq_id: int) -> _Running:
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise KvscopeError("the prompt is empty after tokenization")
        with self.ctx.bus.cause(f"new prompt for seq {seq_id}"):
            self.ctx.memory.seq_rm(seq_id, -1, -1)
        if self.ctx.bus.active:
            label = prompt if isinstance(prompt, str) else self.tokenizer.decode(tokens)
            self.ctx.bus.publish(ev.SequenceAssigned(seq_id, f"generation on seq {seq_id}", label, len(tokens)))
        self.sampler.reset(seq_id)
        self.sampler.accept(tokens, seq_id)
        result = SequenceResult(seq_id, tokens)
        n_keep = resolve_n_keep(self.n_keep, len(tokens), bool(self.tokenizer.add_bos))
        return _Running(result, 0, self.tokenizer.stream(context_ids=tokens), n_keep=n_keep)

    def _prefill(self, running: list[_Running]) -> list[torch.Tensor] | None:
        """Decode every prompt, in batches of at most n_batch tokens; the last token of each is an
        output. Returns each sequence's logits, or None when a decode failed."""
        pending = [(r, i) for r in running for i in range(len(r.result.prompt_tokens))]
        n_batch = self.ctx.n_batch
        logits: dict[int, torch.Tensor] = {}
        for start in range(0, len(pending), n_batch):
            chunk = pending[start:start + n_batch]
            batch = Batch([r.result.prompt_tokens[i] for r, i in chunk], [i for _, i in chunk],
                          [[r.result.seq_id] for r, _ in chunk],
                          [i == len(r.result.prompt_tokens) - 1 for r, i in chunk])
            rc = self.last_rc = self.ctx.decode(batch)
            self.last_n_tokens += len(chunk)
            if rc != 0:
                self._stop_all(running, rc)
                return None
            finishing = [r for r, i in chunk if i == len(r.result.prompt_tokens) - 1]
            for k, r in enumerate(finishing):
                logits[r.result.seq_id] = self.ctx.logits(k).clone()
        for r in running:
            r.next_pos = len(r.result.prompt_tokens)
        return [logits[r.result.seq_id] for r in running]

    def _sample_all(self, active: list[_Running], logits: torch.Tensor, on_text: TextCallback | None) -> None:
        t0 = time.perf_counter()
        tokens = self.sampler.sample_many(logits, seq_ids=[r.result.seq_id for r in active])
        self.t_sample_ms += (time.perf_counter() - t0) * 1e3
        self.n_sample += len(active)
        bus = self.ctx.bus
        for r, token in zip(active, tokens):
            r.last_token = token
            r.result.tokens.append(token)
            if self.tokenizer.is_eog(token):
                r.result.stop_reason = "eog"
                piece = ""
            else:
                piece = r.decoder.push(token)
                r.result.text += piece
                if piece and on_text:
                    on_text(r.result.seq_id, piece)
            if bus.active:
                bus.publish(ev.TokenSampled(r.result.seq_id, token, piece, r.next_pos))

    # ---- context shift ------------------------------------------------------------------------
    def _make_room(self, active: list[_Running]) -> list[_Running]:
        """Shift every sequence whose next token would fill its context (llama-completion:
        n_past + 1 >= n_ctx); a sequence that cannot shift stops with "context_full"."""
        n_ctx_seq = self.ctx.params.n_ctx_seq
        for r in active:
            if r.next_pos + 1 >= n_ctx_seq and not self._shift(r):
                log.warning("seq %d: context full and nothing left to discard (n_past = %d, n_keep = %d) => "
                            "stopping", r.result.seq_id, r.next_pos, r.n_keep)
                r.result.stop_reason = "context_full"
        return [r for r in active if not r.result.stop_reason]

    def _shift(self, r: _Running) -> bool:
        shift = context_shift(self.ctx, r.result.seq_id, r.next_pos, r.n_keep)
        if shift is None:
            return False
        r.next_pos -= shift.n_discard
        r.result.context_shifts.append(shift)
        self.shifts.append(shift)
        return True

    def _shift_longest(self, active: list[_Running]) -> bool:
        """After a decode found no slot: shift the sequence with the most discardable positions
        (ties: the lowest seq id). False when no sequence can shift."""
        for r in sorted(active, key=lambda r: (-(r.next_pos - r.n_keep), r.result.seq_id)):
            if self._shift(r):
                return True
        return False

    @staticmethod
    def _finished(r: _Running, n_predict: int) -> bool:
        if not r.result.stop_reason and 0 <= n_predict <= len(r.result.tokens):
            r.result.stop_reason = "length"
        return bool(r.result.stop_reason)

    def _stop_all(self, running: list[_Running], rc: int) -> None:
        reason = "context_full" if rc == 1 else f"decode_failed({rc})"
        log.warning("generation stopped: decode returned %d (%s)", rc, self.ctx.last_error)
        for r in running:
            if not r.result.stop_reason:
                r.result.stop_reason = reason


class GenerationRun:
    """Sequences generated together, one decode per step: the prompts added since the last step are
    prefilled first (a step of their own), then every running sequence advances by one token in one
    decode. A sequence stops at its n_predict, an end-of-generation token, or a full context."""

    def __init__(self, generator: Generator, on_text: TextCallback | None = None) -> None:
        self.gen = generator
        self.on_text = on_text
        self._new: list[_Running] = []
        self._active: list[_Running] = []

    @property
    def done(self) -> bool:
        return not self._new and not self._active

    def running_seq_ids(self) -> list[int]:
        return [r.result.seq_id for r in self._new + self._active]

    def add(self, prompt: str | Sequence[int], seq_id: int, n_predict: int = 64) -> SequenceResult:
        """A new sequence (its cells are cleared first); prefilled at the next step."""
        check_n_predict(n_predict)
        if seq_id in self.running_seq_ids():
            raise KvscopeError(f"seq {seq_id} is still generating; give another seq id or wait until it stops")
        r = self.gen._start(prompt, seq_id)
        r.n_predict = n_predict
        self._new.append(r)
        return r.result

    def shifted(self, seq_id: int, n_discard: int) -> None:
        """A running sequence was moved down by n_discard positions (a context shift made from outside
        the run): its next token goes there too. A sequence not prefilled yet is refused."""
        for r in self._active:
            if r.result.seq_id == seq_id:
                r.next_pos -= n_discard
                return
        if seq_id in self.running_seq_ids():
            raise KvscopeError(f"seq {seq_id} has not been prefilled yet; shift it once it generates")

    def stop(self, seq_id: int, reason: str) -> None:
        """Stop generating for a sequence (its cells stay): e.g. its cells were replaced by a loaded state."""
        for r in self._new + self._active:
            if r.result.seq_id == seq_id and not r.result.stop_reason:
                r.result.stop_reason = reason
        self._new = [r for r in self._new if r.result.seq_id != seq_id]
        self._retire()

    def step(self) -> bool:
        """One decode (a prefill of new prompts counts as one step). False when nothing is left to do."""
        gen = self.gen
        gen.last_n_tokens = 0
        if self._new:
            self._prefill_new()
            return True
        active = [r for r in self._active if not gen._finished(r, r.n_predict)]
        if gen.context_shift:
            active = gen._make_room(active)
        self._retire()
        if not active:
            return False
        while True:
            batch = Batch([r.last_token for r in active], [r.next_pos for r in active],
                          [[r.result.seq_id] for r in active], [True] * len(active))
            rc = gen.last_rc = gen.ctx.decode(batch)
            gen.last_n_tokens += len(batch)
            if rc == 1 and gen.context_shift and gen._shift_longest(active):
                continue  # llama.cpp would only see the failure; shifting frees cells, so retry
            break
        if rc != 0:
            gen._stop_all(active, rc)
        else:
            for r in active:
                r.next_pos += 1
            gen._sample_all(active, gen.ctx.all_logits(), self.on_text)
        self._retire()
        return True

    def _prefill_new(self) -> None:
        gen, new, self._new = self.gen, self._new, []
        first_logits = gen._prefill(new)
        if first_logits is None:  # the prefill decode failed: _prefill stopped them
            return
        for r in new:
            if r.n_predict == 0:  # llama.cpp evaluates the prompt and stops
                r.result.stop_reason = "length"
        going = [(r, lg) for r, lg in zip(new, first_logits) if r.n_predict != 0]
        if going:
            gen._sample_all([r for r, _ in going], torch.stack([lg for _, lg in going]), self.on_text)
        self._active += [r for r, _ in going]

    def _retire(self) -> None:
        """Sequences that stopped leave the run; their decoders give up any text they held back."""
        still = []
        for r in self._active:
            if self.gen._finished(r, r.n_predict):
                tail = r.decoder.flush()
                if tail:
                    r.result.text += tail
                    if self.on_text:
                        self.on_text(r.result.seq_id, tail)
            else:
                still.append(r)
        self._active = still
