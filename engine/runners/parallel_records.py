"""What a parallel run reports: each request's result, each step's decodes and client states, and the
summary llama-parallel prints."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.runners.parallel_workload import Request


@dataclass
class RequestResult:
    """What happened to one request."""

    request: Request
    client: int
    seq_id: int
    # the tokens this request decodes (without the shared system prompt); an open run keeps a finished
    # request's tokens as an array("i")
    prompt_tokens: Sequence[int]
    n_past_start: int  # position of its first prompt token
    tokens: Sequence[int] = field(default_factory=list)  # sampled tokens (an eog token included)
    text: str = ""
    stop_reason: str = ""  # "eog", "length", "stop_word", "limit" (the slot's context), "error", "aborted"
    error: str = ""
    admitted_step: int = -1
    finished_step: int = -1
    t_admitted: float = 0.0
    t_first_token: float = 0.0
    t_finished: float = 0.0
    cache_misses: int = 0  # halvings of n_batch while this request was in a batch
    context_shifts: int = 0  # shifts of its sequence when it filled its slot's context

    @property
    def ok(self) -> bool:
        return self.stop_reason in ("eog", "length", "stop_word", "limit")

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_tokens)

    @property
    def n_decoded(self) -> int:
        return len(self.tokens)

    @property
    def time_s(self) -> float:
        return max(self.t_finished - self.t_admitted, 0.0)

    @property
    def speed(self) -> float:
        """(prompt + response tokens) per second, as llama-parallel prints it."""
        return (self.n_prompt + self.n_decoded) / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class DecodeCall:
    """One llama_decode of a step: tokens [offset, offset + n_tokens) of the step's batch."""

    offset: int
    n_tokens: int
    n_batch: int  # the batch size in force for this try
    rc: int


@dataclass(frozen=True)
class ClientState:
    client: int
    seq_id: int
    request_id: int  # -1 when idle
    state: str  # "idle", "prompt" (still reading its prompt) or "generating"
    n_past: int  # next position of its sequence


@dataclass(frozen=True)
class StepInfo:
    """What one step did, for front-ends driving the run live."""

    step: int
    phase: str  # "system" (the shared system prompt), "batch", or "idle" (nothing to do; keep_open runs)
    admitted: tuple[tuple[int, int], ...]  # (request id, client)
    finished: tuple[RequestResult, ...]  # ended in this step (failed ones included)
    n_tokens: int  # tokens in the step's batch
    n_prompt_tokens: int
    n_gen_tokens: int
    decodes: tuple[DecodeCall, ...]
    rc: int  # return code of the step's last decode (0, or 1 when its last piece failed even alone)
    n_batch: int  # the smallest batch size used in this step
    cache_misses: int  # halvings in this step
    sampled: tuple[tuple[int, int, int, str], ...]  # (client, request id, token, piece)
    clients: tuple[ClientState, ...]
    n_waiting: int  # arrived requests without a client
    n_pending: int  # requests not arrived yet
    kv_used: int  # used cells, all streams
    ms: float


@dataclass(frozen=True)
class RunSummary:
    n_clients: int
    n_sequences: int
    n_system_tokens: int
    n_prompt_total: int  # prompt tokens of finished requests (llama-parallel's "Total prompt tokens")
    n_gen_total: int
    n_failed: int
    cache_misses: int
    t_total_s: float

    def lines(self, model_path: str = "") -> list[str]:
        t = self.t_total_s if self.t_total_s > 0 else float("inf")
        out = [f"main: n_parallel = {self.n_clients}, n_sequences = {self.n_sequences}, cont_batching = 1, "
               f"system tokens = {self.n_system_tokens}"]
        if model_path:
            out.append(f"Model and path used:  {model_path}")
        out += [
            f"Total prompt tokens: {self.n_prompt_total:6d}, speed: {self.n_prompt_total / t:5.2f} t/s",
            f"Total gen tokens:    {self.n_gen_total:6d}, speed: {self.n_gen_total / t:5.2f} t/s",
            f"Total speed (AVG):   {'':6s}  speed: {(self.n_prompt_total + self.n_gen_total) / t:5.2f} t/s",
            f"Cache misses:        {self.cache_misses:6d}",
        ]
        if self.n_failed:
            out.append(f"Failed requests:     {self.n_failed:6d}")
        return out
