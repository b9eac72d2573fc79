"""A slot of the simulated llama-server: the sequence it owns, the tokens that sequence holds, its context
checkpoints, and the task it runs; and how a task picks a slot (server-context.cpp, get_available_slot)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.runners.server.log import ServerLog
from engine.sampling import Sampler


@dataclass
class Task:
    """One completion request. `tokens` is the rendered prompt; `user_starts` the token indices where user
    messages start (llama-server's message spans: checkpoints are taken there); id_slot -1: any slot."""

    tokens: list[int]
    n_predict: int = 16
    id_slot: int = -1
    cache_prompt: bool = True
    n_keep: int = 0
    n_discard: int = 0
    user_starts: tuple[int, ...] = ()
    answer: tuple[int, ...] = ()  # the answer's tokens when a script fixes it (generated as given)
    label: str = ""
    text: str = ""  # what the request asks, for the views (the last user message)
    id: int = -1  # given by the server when it takes the task


@dataclass
class Checkpoint:
    """The state of a slot's sequence before a batch: the SWA cache's part only (PARTIAL_ONLY), with the
    positions llama-server records for it (the sequence's pos_min/pos_max as the batch starts)."""

    id_task: int
    n_tokens: int
    pos_min: int
    pos_max: int
    data: bytes

    @property
    def size_mib(self) -> float:
        return len(self.data) / 1024 / 1024

    def describe(self) -> str:
        return f"pos_min = {self.pos_min}, pos_max = {self.pos_max}, n_tokens = {self.n_tokens}"


@dataclass
class Slot:
    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)  # what the sequence holds (prompt + generated, less the last)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # oldest first
    t_last_used: int = -1
    task: Task | None = None
    state: str = "idle"  # idle, started, prompt, done_prompt, generating
    sampler: Sampler | None = None
    n_past_reused: int = 0
    n_prompt_processed: int = 0
    generated: list[int] = field(default_factory=list)
    sampled: int = -1  # the token sampled last, decoded in the next batch
    i_batch: int = -1  # index in the current batch of the token whose logits this slot samples from
    truncated: bool = False
    t_prompt_start: float = 0.0
    t_prompt_ms: float = 0.0
    t_gen_start: float = 0.0

    @property
    def is_processing(self) -> bool:
        return self.state != "idle"

    @property
    def task_id(self) -> int:
        return self.task.id if self.task is not None else -1


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def select_slot(slots: list[Slot], task: Task, similarity_threshold: float,
                log: ServerLog) -> tuple[Slot | None, str, float, bool]:
    """get_available_slot: the requested slot; else the idle slot whose kept tokens share the longest prefix
    with the prompt, as a share of the prompt, when above the threshold (-sps); else the least recently used
    idle slot (ties: the last one). Returns (slot, how it was chosen, similarity or -1, whether the server
    updates its prompt cache now: the slot would keep less than half of what it holds, or came by LRU)."""
    chosen, how, best, update_cache = None, "", -1.0, False
    if task.id_slot != -1:
        chosen = slots[task.id_slot % len(slots)]
        how = "id"
        log.slot("info", "get_available_slot", chosen.id, -1, f"selected slot by id ({task.id_slot})")
    if similarity_threshold != 0.0:
        f_sim_best = 0.0
        for slot in slots:
            if task.id_slot != -1 and slot.id != chosen.id:
                continue
            if slot.is_processing:
                log.slot("info", "get_available_slot", slot.id, -1, " - skipping, is_processing = 1")
                continue
            if not slot.tokens:
                log.slot("info", "get_available_slot", slot.id, -1, " - skipping, slot is empty")
                continue
            lcp = common_prefix(slot.tokens, task.tokens)
            f_sim = lcp / len(task.tokens)
            log.slot("info", "get_available_slot", slot.id, -1,
                     f" - checking sim = {f_sim:.3f} ({lcp}/{len(task.tokens)}) > {similarity_threshold:.3f}")
            if f_sim > f_sim_best and f_sim > similarity_threshold:
                f_sim_best, chosen = f_sim, slot
                how = "id" if task.id_slot != -1 else "similarity"
        if chosen is not None:
            best = f_sim_best if f_sim_best > 0 else -1.0
            # llama-server divides by the slot's token count: 0 / 0 for an empty slot is NaN, and NaN < 0.5
            # is false, so a task given an empty slot by id never consults the prompt cache
            f_keep = f_sim_best * len(task.tokens) / len(chosen.tokens) if chosen.tokens else float("nan")
            if task.id_slot == -1:
                log.slot("info", "get_available_slot", chosen.id, -1,
                         f"selected slot by LCP similarity, f_sim_best = {f_sim_best:.3f} "
                         f"(> {similarity_threshold:.3f} thold), f_keep = {f_keep:.3f}")
            update_cache = f_keep < 0.5
    if chosen is None:
        t_last = -1
        for slot in slots:
            if slot.is_processing:
                continue
            if chosen is None or slot.t_last_used <= t_last:
                chosen, t_last = slot, slot.t_last_used
        if chosen is not None:
            how, update_cache = "lru", True
            log.slot("info", "get_available_slot", chosen.id, -1, f"selected slot by LRU, t_last = {t_last}")
    return chosen, how, best, update_cache


def now_us() -> int:
    return time.perf_counter_ns() // 1000
