"""What a session runs on its context between commands, one step at a time.

- idle: nothing runs by itself; a prompt given to the session is decoded at once into a free
  sequence, and the cache is then the user's to change with sequence operations.
- generate: sequences generate together, one decode per step (engine/runners/generate.py); a prompt
  joins at the next step.
- parallel: llama.cpp's parallel example (engine/runners/parallel.py): clients answering a stream of
  requests with continuous batching; a prompt becomes one more request.
- server: llama-server's slots (engine/runners/server/): the conversations of a chat script, with prompt
  reuse, context checkpoints and the server's log lines; a prompt becomes one more conversation.

A workload that owns its sequences (parallel, server) refuses a state loaded into one of them, and stopping
it leaves them as they are.

A workload never catches what its context raises: the session turns failures into events.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import Batch
from engine.context import Context
from engine.errors import KvscopeError
from engine.runners.generate import Generator
from engine.runners.parallel import DEFAULT_SYSTEM_PROMPT, ParallelRunner
from engine.runners.parallel_workload import make_schedule
from engine.sampling import SamplerParams
from engine.watch.protocol import StepOutcome

WORKLOAD_KINDS = ("idle", "generate", "parallel", "server")


IDLE = StepOutcome("idle")


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload, and its options: n_predict (tokens per prompt), and for "parallel" the clients,
    the requests of the schedule, their arrival gap, the schedule's seed and the shared system prompt."""

    kind: str = "idle"
    n_predict: int = 64
    n_clients: int = 4
    n_sequences: int = 16
    arrival_gap: int = 2
    schedule_seed: int | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    share_system_prompt: bool = True
    context_shift: bool = False  # generate: when a sequence fills its context; parallel: its slot's
    n_keep: int = 0
    n_ctx_slot: int = 0  # parallel: each client's own context (llama-server's slots), 0: none
    sampler: SamplerParams = field(default_factory=SamplerParams)  # or a dict of its fields
    chat: str = ""  # server: the chat script (docs/server-sim.md); "": the built-in demo conversations
    slot_prompt_similarity: float = 0.10  # server: -sps
    cache_reuse: int = 0  # server: --cache-reuse
    ctx_checkpoints: int = 32  # server: -ctxcp
    checkpoint_min_step: int = 8192  # server: -cms
    cache_ram_mib: int = 8192  # server: --cache-ram
    cache_idle_slots: bool = True  # server: --cache-idle-slots

    def __post_init__(self) -> None:
        if isinstance(self.sampler, dict):  # a front-end names the sampler's settings without importing it
            object.__setattr__(self, "sampler", SamplerParams(**self.sampler))
        if self.kind not in WORKLOAD_KINDS:
            raise KvscopeError(f"unknown workload {self.kind!r}; one of {', '.join(WORKLOAD_KINDS)}")
        if self.n_predict < 1 and self.n_predict != -1:
            raise KvscopeError(f"n_predict must be >= 1 (or -1: until the end of generation), got {self.n_predict}")

    def n_seq_max_needed(self) -> int:
        """Sequences a context needs for this workload (parallel: one per client and the system prompt's;
        server: one per slot)."""
        return {"parallel": self.n_clients + 1, "server": self.n_clients}.get(self.kind, 1)


def make_workload(spec: WorkloadSpec, ctx: Context):
    from engine.runners.server.workload import ServerWorkload

    kinds = {"idle": IdleWorkload, "generate": GenerationWorkload, "parallel": ParallelWorkload, "server": ServerWorkload}
    return kinds[spec.kind](spec, ctx)


def free_seq_id(ctx: Context, busy: list[int]) -> int:
    """The lowest sequence id that holds no cell and is not busy generating."""
    for seq_id in range(ctx.n_seq_max):
        if seq_id not in busy and ctx.memory.seq_pos_max(seq_id) < 0:
            return seq_id
    raise KvscopeError(f"every sequence of this context is in use (n_seq_max = {ctx.n_seq_max}); remove one "
                       f"with seq_rm, or rebuild with a larger n_seq_max")


class IdleWorkload:
    name = "idle"
    owns_sequences = False

    def __init__(self, spec: WorkloadSpec, ctx: Context) -> None:
        self.ctx = ctx

    def step(self) -> StepOutcome:
        return IDLE

    def add_prompt(self, text: str, n_predict: int | None = None) -> int:
        """Decode the prompt into a free sequence now; returns its seq id."""
        tokens = self.ctx.model.tokenizer.encode(text)
        if not tokens:
            raise KvscopeError("the prompt is empty after tokenization")
        seq_id = free_seq_id(self.ctx, [])
        if len(tokens) > self.ctx.n_batch:
            raise KvscopeError(f"the prompt has {len(tokens)} tokens but n_batch = {self.ctx.n_batch}")
        rc = self.ctx.decode(Batch.for_sequence(tokens, seq_id, 0))
        if rc != 0:
            raise KvscopeError(f"decoding the prompt into seq {seq_id} returned {rc}: {self.ctx.last_error}")
        return seq_id

    def active_seqs(self) -> tuple[int, ...]:
        return ()

    def shifted(self, seq_id: int, n_discard: int) -> None:
        pass

    def stop_seq(self, seq_id: int, reason: str) -> None:
        pass


class GenerationWorkload:
    name = "generate"
    owns_sequences = False

    def __init__(self, spec: WorkloadSpec, ctx: Context) -> None:
        self.ctx = ctx
        self.spec = spec
        self.generator = Generator(ctx, spec.sampler, context_shift=spec.context_shift, n_keep=spec.n_keep)
        self.run = self.generator.run()

    def step(self) -> StepOutcome:
        n_before = self.generator.n_sample
        if not self.run.step():
            return IDLE
        return StepOutcome("batch", self.generator.last_n_tokens, self.generator.n_sample - n_before,
                           self.generator.last_rc, self.active_seqs())

    def add_prompt(self, text: str, n_predict: int | None = None) -> int:
        seq_id = free_seq_id(self.ctx, self.run.running_seq_ids())
        self.run.add(text, seq_id, self.spec.n_predict if n_predict is None else n_predict)
        return seq_id

    def active_seqs(self) -> tuple[int, ...]:
        return tuple(self.run.running_seq_ids())

    def shifted(self, seq_id: int, n_discard: int) -> None:
        self.run.shifted(seq_id, n_discard)

    def stop_seq(self, seq_id: int, reason: str) -> None:
        self.run.stop(seq_id, reason)


class ParallelWorkload:
    name = "parallel"
    owns_sequences = True

    def __init__(self, spec: WorkloadSpec, ctx: Context) -> None:
        self.spec = spec
        self.runner = ParallelRunner(ctx, spec.n_clients, spec.sampler, system_prompt=spec.system_prompt,
                                     share_system_prompt=spec.share_system_prompt, n_ctx_slot=spec.n_ctx_slot,
                                     context_shift=spec.context_shift, n_keep=spec.n_keep)
        schedule = make_schedule(spec.n_sequences, seed=spec.schedule_seed, n_predict=max(spec.n_predict, 1),
                                 arrival_gap=spec.arrival_gap)
        self._steps = self.runner.steps(schedule, keep_open=True)
        self._started = False

    def step(self) -> StepOutcome:
        self._started = True
        info = next(self._steps)
        return StepOutcome(info.phase, info.n_tokens, len(info.sampled), info.rc, self.active_seqs())

    def add_prompt(self, text: str, n_predict: int | None = None) -> int:
        """One more request; returns its request id (a client takes it when one is free)."""
        if not self._started:
            self.step()  # the run starts with the shared system prompt; requests join after it
        return self.runner.submit(text, self.spec.n_predict if n_predict is None else n_predict).id

    def active_seqs(self) -> tuple[int, ...]:
        return tuple(c.seq_id for c in self.runner.clients if c.state != "idle")

    def shifted(self, seq_id: int, n_discard: int) -> None:
        self.runner.shifted(seq_id, n_discard)

    def check_shift(self, seq_id: int) -> None:
        self.runner.check_shift(seq_id)

    def stop_seq(self, seq_id: int, reason: str) -> None:
        raise KvscopeError("the parallel workload owns its sequences: switch the session to the idle or generate "
                           "workload before loading a state")
