"""llama-server's host-memory prompt cache (`--cache-ram`, server_prompt_cache in tools/server/server-task.cpp):
whole sequence states of prompts a slot held, with their checkpoints, kept in host memory so that a later task
may load a better starting point than what its slot holds. Slots never share cells; a prefix moves from one
slot to another only as a saved state loaded again."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from engine.placement.device_memory import publish_memory_change
from engine.placement.devices import CPU
from engine.runners.server.log import ServerLog
from engine.runners.server.slot import Checkpoint, Slot, common_prefix

MIB = 1024 * 1024
KEEP_AT_LEAST = 0.25  # an entry that would keep less of itself than this is not loaded ("don't trash large prompts")


@dataclass
class CachedPrompt:
    tokens: list[int]
    checkpoints: list[Checkpoint]
    data: bytes = b""
    number: int = 0  # stands for llama-server's pointer in its "prompt %p" lines

    @property
    def size(self) -> int:
        return len(self.data) + sum(len(cp.data) for cp in self.checkpoints)


@dataclass
class PromptCache:
    ctx: object
    log: ServerLog
    limit_mib: int  # --cache-ram: -1 no limit
    limit_tokens: int  # the whole context's n_ctx
    prompts: collections.deque = field(default_factory=collections.deque)  # oldest first
    _numbered: int = 0
    _bytes: int = 0

    @property
    def limit_size(self) -> int:
        return 0 if self.limit_mib < 0 else self.limit_mib * MIB

    def size(self) -> int:
        return sum(p.size for p in self.prompts)

    def n_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.prompts)

    def save(self, slot: Slot) -> bool:
        """server_slot::prompt_save: the slot's whole sequence state and checkpoints, unless the cache holds
        them already."""
        if not slot.tokens:
            return False
        state_size = self.ctx.state_seq_get_size(slot.id)
        self.log.srv("info", "prompt_save", f" - saving prompt with length {len(slot.tokens)}, total state size = "
                                            f"{state_size / MIB:.3f} MiB (draft: 0.000 MiB)")
        entry = self._alloc(slot, state_size)
        if entry is None:
            return False
        entry.data = self.ctx.state_seq_get_data(slot.id)
        self._held()
        return True

    def _alloc(self, slot: Slot, state_size: int) -> CachedPrompt | None:
        tokens = slot.tokens
        for p in self.prompts:
            if common_prefix(p.tokens, tokens) == len(tokens):
                self.log.srv("info", "alloc", " - prompt is already in the cache, skipping")
                return None
        new_size = state_size + sum(len(cp.data) for cp in slot.checkpoints)
        limit = self.limit_size
        if limit > 0 and new_size > limit:
            self.log.srv("warn", "alloc", f" - prompt state size {new_size / MIB:.3f} MiB exceeds cache size limit "
                                          f"{limit / MIB:.3f} MiB, skipping")
            return None
        for p in list(self.prompts):
            if common_prefix(p.tokens, tokens) == len(p.tokens):
                self.log.srv("info", "alloc", f" - removing obsolete cached prompt with length {len(p.tokens)}")
                self.prompts.remove(p)
        while limit > 0 and self.prompts and self.size() + new_size > limit:
            self.log.srv("warn", "alloc", f" - making room for prompt cache entry, removing oldest entry (size = "
                                          f"{self.prompts[0].size / MIB:.3f} MiB)")
            self.prompts.popleft()
        self._numbered += 1
        entry = CachedPrompt(list(tokens), list(slot.checkpoints), number=self._numbered)
        self.prompts.append(entry)
        return entry

    def load(self, slot: Slot, prompt: list[int]) -> bool:
        """server_prompt_cache::load: the cached prompt that keeps more of itself and serves more of the new
        prompt than what the slot holds (both), into the slot; False when its state does not restore."""
        lcp = common_prefix(slot.tokens, prompt)
        f_keep_best = lcp / len(slot.tokens) if slot.tokens else -1.0
        f_sim_best = lcp / len(prompt)
        self.log.srv("info", "load", f" - looking for better prompt, base f_keep = {f_keep_best:.3f}, "
                                     f"f_sim = {f_sim_best:.3f}")
        best = None
        for p in self.prompts:
            lcp_cur = common_prefix(p.tokens, prompt)
            f_keep, f_sim = lcp_cur / len(p.tokens), lcp_cur / len(prompt)
            self.log.srv("info", "load", f"   - prompt with length {len(p.tokens):7d}, lcp = {lcp_cur:7d}, "
                                         f"f_keep = {f_keep:.3f}, f_sim = {f_sim:.3f}")
            if f_keep < KEEP_AT_LEAST:
                continue
            if f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best, best = f_keep, f_sim, p
        if best is None:
            return True
        self.log.srv("info", "load", f" - found better prompt with f_keep = {f_keep_best:.3f}, f_sim = {f_sim_best:.3f}")
        if self.ctx.state_seq_set_data(best.data, slot.id) != len(best.data):
            self.log.srv("error", "load", f"failed to restore state with size {len(best.data)}")
            return False
        slot.tokens, slot.checkpoints = best.tokens, best.checkpoints
        self.prompts.remove(best)
        self._held()
        return True

    def update(self) -> None:
        """Drop the oldest prompts over the byte limit, then over the token limit (raised to what the bytes
        allow), and tell the cache's state."""
        limit = self.limit_size
        while limit > 0 and self.prompts and self.size() > limit:
            self.log.srv("warn", "update", f" - cache size limit reached, removing oldest entry (size = "
                                           f"{self.prompts[0].size / MIB:.3f} MiB)")
            self.prompts.popleft()
        size_per_token = max(1.0, self.size() / max(1, self.n_tokens()))
        limit_tokens_cur = max(self.limit_tokens, int(limit / size_per_token)) if limit > 0 else self.limit_tokens
        while self.limit_tokens > 0 and self.prompts and self.n_tokens() > limit_tokens_cur:
            self.log.srv("warn", "update", f" - cache token limit ({self.limit_tokens}, est: {limit_tokens_cur}) "
                                           f"reached, removing oldest entry (size = {self.prompts[0].size / MIB:.3f} MiB)")
            self.prompts.popleft()
        self.log.srv("info", "update", f" - cache state: {len(self.prompts)} prompts, {self.size() / MIB:.3f} MiB "
                                       f"(limits: {limit / MIB:.3f} MiB, {self.limit_tokens} tokens, "
                                       f"{limit_tokens_cur} est)")
        for p in self.prompts:
            self.log.srv("info", "update", f"   - prompt {0x1000 * p.number:#x}: {len(p.tokens):7d} tokens, "
                                           f"checkpoints: {len(p.checkpoints):2d}, {p.size / MIB:9.3f} MiB")
        self._held()

    def _held(self) -> None:
        """The host memory the cache holds, as a part of the CPU's bar ("prompt cache")."""
        held = self.size()
        if held != self._bytes:
            delta, self._bytes = held - self._bytes, held
            publish_memory_change(self.ctx.bus, {CPU: abs(delta)}, "prompt cache", 1 if delta > 0 else -1)

    @property
    def bytes_held(self) -> int:
        return self._bytes
