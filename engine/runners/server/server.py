"""A simulated llama-server: slots on sequences of one context, prompt reuse, context checkpoints and the
context shift, step by step, with the server's own log lines (tools/server/server-context.cpp; the policy
as the spec's section 14a describes it at 0c1e570, the details section 14a leaves open as read at
ggml-org/llama.cpp 001d906, which behaves as 0c1e570's logs show).

One `step()` is one iteration of llama-server's update loop: waiting tasks take slots (get_available_slot),
a generating slot adds its last sampled token to the batch, then prompt tokens of the slots reading their
prompt fill it up to n_batch (continuous batching), the batch is decoded, and each slot whose last token was
in it samples. A new prompt first goes through the reuse decision (`_start_prompt`): the common prefix with
the tokens the slot kept (`cache_prompt`), --cache-reuse chunk shifting, and on a sliding-window cache the
check that the cache still holds the window before the first new token, else a context checkpoint from
before it, else a full re-processing.

The host-memory prompt cache (--cache-ram) is engine/runners/server/prompt_cache.py. Not simulated:
speculative decoding, multimodal chunks, embeddings and reranking tasks, HTTP. Task ids count as
llama-server's do here: one per request and one per update-loop iteration that decodes (its NEXT_RESPONSE
task).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass

from engine import events as ev
from engine.batch import Batch
from engine.context import Context
from engine.errors import KvscopeError
from engine.placement.devices import CPU
from engine.runners.server.checkpoints import CheckpointStore
from engine.runners.server.log import ServerLog
from engine.runners.server.prompt_cache import PromptCache
from engine.runners.server.slot import Slot, Task, common_prefix, now_us, select_slot
from engine.sampling import Sampler, SamplerParams

QUIRK_NEEDLESS_SEARCH = (
    "llama.cpp QUIRK (tools/server/server-context.cpp, `pos_min >= pos_min_thold`): the cache still holds every "
    "position from {pos_min} on, and the window of the first new token needs those from {needed}, yet the server "
    "went to its checkpoints ({outcome}): {lost} tokens of the common prefix recomputed")
QUIRK_MOVED_CHUNKS = (
    "llama.cpp QUIRK (--cache-reuse, tools/server/server-context.cpp): {moved} reused tokens were moved down "
    "from where they were computed, after tokens this prompt no longer has; their keys and values still carry "
    "those, so this turn's logits are not those of its prompt processed anew")
FORCED_FULL = ("forcing full prompt re-processing due to lack of cache data (likely due to SWA or hybrid/recurrent "
               "memory, see https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055)")
CONTEXT_EXCEEDED = "Context size has been exceeded."
KEPT_FINISHED = 1000  # finished tasks a server keeps (a session may run one for hours); every one is an event


@dataclass(frozen=True)
class ServerParams:
    """llama-server's settings that decide what the cache does (flag names in the comments)."""

    n_slots: int = 1  # -np
    slot_prompt_similarity: float = 0.10  # -sps
    cache_reuse: int = 0  # --cache-reuse
    ctx_checkpoints: int = 32  # -ctxcp
    checkpoint_min_step: int = 8192  # -cms
    context_shift: bool = False  # --context-shift
    cache_ram_mib: int = 8192  # --cache-ram: the host-memory prompt cache's limit (-1: none, 0: no cache)
    cache_idle_slots: bool = True  # --cache-idle-slots: save idle slots to the prompt cache at each new task
    sampler: SamplerParams = SamplerParams(temperature=0.0)

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise KvscopeError(f"n_slots must be >= 1, got {self.n_slots}")
        for name in ("cache_reuse", "ctx_checkpoints", "checkpoint_min_step"):
            if getattr(self, name) < 0:
                raise KvscopeError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cache_ram_mib < -1:
            raise KvscopeError(f"cache_ram_mib must be >= -1 (-1: no limit, 0: no prompt cache), got {self.cache_ram_mib}")
        if not 0.0 <= self.slot_prompt_similarity <= 1.0:
            raise KvscopeError(f"slot_prompt_similarity must be in [0, 1], got {self.slot_prompt_similarity}")


class ServerSim:
    def __init__(self, ctx: Context, params: ServerParams = ServerParams(), *, log: ServerLog | None = None) -> None:
        if ctx.n_seq_max < params.n_slots:
            raise KvscopeError(f"{params.n_slots} slots need n_seq_max >= {params.n_slots} (slot i uses sequence i); "
                               f"the context has n_seq_max = {ctx.n_seq_max}")
        self.ctx, self.params = ctx, params
        self.log = log if log is not None else ServerLog(ctx.bus)
        self.tokenizer = ctx.model.tokenizer
        n_ctx_slot = min(ctx.params.n_ctx_seq, ctx.model.config.n_ctx_train)
        self.slots = [Slot(i, n_ctx_slot) for i in range(params.n_slots)]
        self.n_swa = 0 if ctx.params.swa_full else max((c.layout.n_swa for c in ctx.memory.caches()), default=0)
        self.can_shift = ctx.memory.can_shift()
        self.context_shift = params.context_shift and self.can_shift
        self.cache_reuse = params.cache_reuse if self.can_shift else 0
        self.checkpoints = CheckpointStore(ctx, self.log, params.ctx_checkpoints, params.checkpoint_min_step)
        self.prompt_cache = PromptCache(ctx, self.log, params.cache_ram_mib, ctx.n_ctx) if params.cache_ram_mib else None
        self.cache_idle_slots = params.cache_idle_slots and self.prompt_cache is not None
        self.waiting: list[Task] = []
        self.finished: collections.deque[ev.ServerTaskFinished] = collections.deque(maxlen=KEPT_FINISHED)
        self.n_finished = 0
        self._next_task_id = 0
        self.sampled_last_step = 0
        self._decisions: dict[int, ev.ServerPromptReused] = {}  # each slot's last, for a watcher that starts late
        self._startup_lines(n_ctx_slot)

    def _startup_lines(self, n_ctx_slot: int) -> None:
        log, p = self.log, self.params
        if p.context_shift and not self.can_shift:
            log.srv("warn", "load_model", "the context does not support context shift (a sliding-window cache "
                                          "without --swa-full), disabling it")
        if p.cache_reuse and not self.can_shift:
            log.srv("warn", "load_model", "cache_reuse is not supported by this context, it will be disabled")
        log.srv("info", "load_model", f"initializing, n_slots = {p.n_slots}, n_ctx_slot = {n_ctx_slot}, "
                                      f"kv_unified = '{'true' if self.ctx.params.kv_unified else 'false'}'")
        for slot in self.slots:
            log.slot("info", "load_model", slot.id, -1, f"new slot, n_ctx = {slot.n_ctx}")
            log.slot("debug", "reset", slot.id, -1, "")
        if p.cache_ram_mib:
            limit = "no limit" if p.cache_ram_mib < 0 else f"{p.cache_ram_mib} MiB"
            log.srv("info", "load_model", f"prompt cache is enabled, size limit: {limit}")
            log.srv("info", "load_model", "use `--cache-ram 0` to disable the prompt cache")
        else:
            log.srv("info", "load_model", "prompt cache is disabled - use `--cache-ram N` to enable it")
        log.srv("info", "load_model", "for more info see https://github.com/ggml-org/llama.cpp/pull/16391")
        if p.ctx_checkpoints > 0:
            log.srv("info", "load_model", f"context checkpoints enabled, max = {p.ctx_checkpoints}, "
                                          f"min spacing = {p.checkpoint_min_step}")
        else:
            log.srv("info", "load_model", "context checkpoints disabled")
        if p.cache_idle_slots and not p.cache_ram_mib:
            log.srv("warn", "init", "--cache-idle-slots requires --cache-ram, disabling")
        elif p.cache_idle_slots:
            cleared = " and cleared" if self.ctx.params.kv_unified else ""
            log.srv("info", "init", f"idle slots will be saved to prompt cache{cleared} upon starting a new task")
            log.srv("debug", "init", "__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__")
        log.srv("info", "update_slots", "all slots are idle")
        self._idle_told = True

    def follow_the_cache(self) -> None:
        """After the cache was changed from outside (a command on an idle slot's sequence), each idle slot
        keeps the tokens up to its sequence's last position, as if the server had cut them itself; a slot
        whose sequence was emptied forgets its checkpoints too. llama-server has no such outside hand."""
        for slot in self.slots:
            if slot.is_processing or not slot.tokens:
                continue
            n_held = self.ctx.memory.seq_pos_max(slot.id) + 1
            if n_held < len(slot.tokens):
                del slot.tokens[max(n_held, 0):]
                if not slot.tokens:
                    self.checkpoints.clear(slot)
                self.ctx.bus.publish(ev.ServerSlotChanged(slot=slot.id, n_kept=len(slot.tokens),
                                                          why="cut by a command on its sequence"))

    def state_events(self) -> list[ev.Event]:
        """Events that tell a new watcher what the slots run and hold: each running task, each held
        checkpoint, and the host memory of all of them."""
        events: list[ev.Event] = []
        for slot in self.slots:
            task = slot.task
            if task is not None:
                events.append(ev.ServerTaskStarted(slot=slot.id, task=task.id, selected_by="", similarity=-1.0,
                                                   n_prompt=len(task.tokens), label=task.label, n_ctx_slot=slot.n_ctx))
                decided = self._decisions.get(slot.id)
                if decided is not None and decided.task == task.id:
                    events.append(dataclasses.replace(decided))  # a copy: the state gets its own stamp
            for cp in slot.checkpoints:
                events.append(ev.CheckpointChanged(slot=slot.id, task=cp.id_task, action="created", pos_min=cp.pos_min,
                                                   pos_max=cp.pos_max, n_tokens=cp.n_tokens, n_bytes=len(cp.data),
                                                   n_held=len(slot.checkpoints)))
        held = {"checkpoints": self.checkpoints.bytes_held,
                "prompt cache": self.prompt_cache.bytes_held if self.prompt_cache is not None else 0}
        for what, nbytes in held.items():
            if nbytes:
                events.append(ev.DeviceMemoryChanged(device=CPU.name, virtual=False, capacity=CPU.capacity,
                                                     reserved=None, what=what, delta=nbytes))
        return events

    # ---- tasks ---------------------------------------------------------------------------------
    def submit(self, task: Task) -> Task:
        """Queue a request; it takes a slot at the next step. The task gets its id now."""
        if not task.tokens:
            raise KvscopeError("a task needs at least one prompt token")
        if task.id_slot >= self.params.n_slots or task.id_slot < -1:
            raise KvscopeError(f"id_slot {task.id_slot} is not a slot of this server (0..{self.params.n_slots - 1}, "
                               f"or -1 for any)")
        task.id = self._take_task_id()
        self.waiting.append(task)
        return task

    def _take_task_id(self) -> int:
        self._next_task_id += 1
        return self._next_task_id - 1

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s.is_processing for s in self.slots)

    def run(self, max_steps: int = 1_000_000) -> list[ev.ServerTaskFinished]:
        """Step until every task is done; returns the tasks finished meanwhile (the latest KEPT_FINISHED)."""
        before = self.n_finished
        for _ in range(max_steps):
            if not self.busy:
                self.step()  # tells "all slots are idle", as the server does before it waits
                break
            self.step()
        new = min(self.n_finished - before, len(self.finished))
        return list(self.finished)[len(self.finished) - new:]

    def _launch_waiting(self) -> None:
        still = []
        for task in self.waiting:
            slot, how, similarity, update_cache = select_slot(self.slots, task, self.params.slot_prompt_similarity,
                                                              self.log)
            # llama-server would update the cache for a slot it asked for by id even while that slot works (and
            # then defers the task); kvscope leaves a working slot alone
            if slot is not None and update_cache and self.prompt_cache is not None and not slot.is_processing:
                self._update_prompt_cache(slot, task)
            if slot is None or slot.is_processing:
                still.append(task)  # "no slot is available" / "requested slot is unavailable": deferred
                continue
            slot.task, slot.state = task, "started"
            slot.sampler = Sampler(self.params.sampler)
            slot.generated, slot.truncated, slot.n_prompt_processed = [], False, 0
            self.log.slot("info", "launch_slot_with_task", slot.id, task.id, "processing task, is_child = 0")
            self.ctx.bus.publish(ev.SequenceAssigned(slot.id, f"slot {slot.id}, task {task.id}" +
                                                     (f" ({task.label})" if task.label else ""),
                                                     task.text, len(task.tokens)))
            self.ctx.bus.publish(ev.ServerTaskStarted(slot=slot.id, task=task.id, selected_by=how,
                                                      similarity=similarity, n_prompt=len(task.tokens),
                                                      label=task.label, n_ctx_slot=slot.n_ctx))
            if self.cache_idle_slots:
                self._save_idle_slots()
        self.waiting = still

    # ---- the host-memory prompt cache ---------------------------------------------------------------
    def _update_prompt_cache(self, slot: Slot, task: Task) -> None:
        """The chosen slot would lose most of what it holds (or came by LRU): save it, and load a cached prompt
        that serves the new one better, if there is one."""
        started = time.perf_counter()
        self.log.srv("info", "get_available_slot", "updating prompt cache")
        self.prompt_cache.save(slot)
        replaced = slot.checkpoints
        if self.prompt_cache.load(slot, task.tokens):
            if slot.checkpoints is not replaced:  # a saved prompt came in, with checkpoints of its own
                self.checkpoints.adopt(slot, replaced)
        else:
            self.log.slot("warn", "prompt_load", slot.id, -1, "failed to load prompt from cache")
            self._clear_prompt(slot)
        self.prompt_cache.update()
        self.log.srv("info", "get_available_slot", f"prompt cache update took {1e3 * (time.perf_counter() - started):.2f} ms")

    def _save_idle_slots(self) -> None:
        for slot in self.slots:
            if slot.is_processing:
                continue
            self.log.slot("info", "process_single_task", slot.id, -1, "saving idle slot to prompt cache")
            if self.prompt_cache.save(slot):
                self.log.slot("debug", "process_single_task", slot.id, -1, "__TEST_TAG_CACHE_IDLE_SLOT__")
                self.prompt_cache.update()
            if self.ctx.params.kv_unified:  # cleared: with one buffer for all, its cells are room for others
                self._clear_prompt(slot)

    def _clear_prompt(self, slot: Slot) -> None:
        """server_slot::prompt_clear: the sequence's cells, tokens and checkpoints go."""
        self.log.slot("info", "prompt_clear", slot.id, slot.task_id, f"clearing prompt with {len(slot.tokens)} tokens")
        self.clear_slot(slot, "cleared (its state is in the prompt cache)")

    # ---- the update loop -----------------------------------------------------------------------
    def step(self) -> int:
        """One iteration of update_slots; returns the tokens decoded (0: nothing to do)."""
        self.sampled_last_step = 0
        self._launch_waiting()
        if not any(s.is_processing for s in self.slots):
            if not self._idle_told:
                self.log.srv("info", "update_slots", "all slots are idle")
                self._idle_told = True
            return 0
        self._idle_told = False
        self._take_task_id()  # the NEXT_RESPONSE task each iteration posts
        for slot in self.slots:
            if slot.state == "generating" and len(slot.tokens) + 1 >= slot.n_ctx and self.context_shift:
                self._context_shift(slot)
        tokens, pos, seqs, outputs = [], [], [], []

        def add(slot: Slot, token: int, output: bool) -> None:
            tokens.append(token), pos.append(len(slot.tokens)), seqs.append([slot.id]), outputs.append(output)
            slot.tokens.append(token)

        for slot in self.slots:
            if slot.state == "generating":
                slot.i_batch = len(tokens)
                self.log.slot("debug", "handle_last_sampled_token", slot.id, slot.task_id,
                              f"slot decode token, id={slot.sampled}, n_ctx = {slot.n_ctx}, "
                              f"n_tokens = {len(slot.tokens)}, truncated = {int(slot.truncated)}")
                add(slot, slot.sampled, True)
        for slot in self.slots:
            if slot.state not in ("started", "prompt") or len(tokens) >= self.ctx.n_batch:
                continue
            if slot.state == "started" and not self._start_prompt(slot):
                continue
            self._fill_prompt(slot, tokens, add, outputs)
        if not tokens:
            return 0
        self._decode(Batch(tokens, pos, seqs, outputs))
        return len(tokens)

    # ---- a new prompt: what of it the slot's cache serves ---------------------------------------
    def _start_prompt(self, slot: Slot) -> bool:
        task, log, n_kept = slot.task, self.log, len(slot.tokens)
        prompt, n_prompt = task.tokens, len(task.tokens)
        slot.state = "prompt"
        slot.t_prompt_start = time.perf_counter()
        log.slot("info", "operator()", slot.id, task.id, f"new prompt, n_ctx_slot = {slot.n_ctx}, n_keep = "
                                                         f"{task.n_keep}, task.n_tokens = {n_prompt}")
        if n_prompt >= slot.n_ctx:
            self._fail(slot, f"request ({n_prompt} tokens) exceeds the available context size ({slot.n_ctx} "
                             f"tokens), try increasing it")
            return False
        n_past, n_moved = 0, 0
        if task.cache_prompt:
            n_past = common_prefix(slot.tokens, prompt)
            if self.cache_reuse > 0:
                n_past, n_moved = self._reuse_chunks(slot, n_past)
        n_common = n_past
        pos_next = n_past
        has_new_tokens = n_past < n_prompt
        pos_min_thold = max(0, pos_next - self.n_swa - (0 if has_new_tokens else 1))
        pos_min, forced, restored, why = -1, False, -1, ""
        if 0 < n_past <= len(slot.tokens):
            pos_min = self.ctx.memory.seq_pos_min(slot.id)
            if pos_min == -1:
                raise KvscopeError(f"slot {slot.id}: keeps {len(slot.tokens)} tokens but its sequence holds no cell")
            if pos_min >= pos_min_thold:
                found = None
                for cp in reversed(slot.checkpoints):
                    log.slot("info", "operator()", slot.id, task.id, f"checking checkpoint with [{cp.pos_min}, "
                                                                     f"{cp.pos_max}] against {pos_min_thold}...")
                    if cp.pos_max > pos_next:
                        continue
                    if cp.pos_min < pos_min_thold or cp.pos_min == 0:
                        found = cp
                        break
                if found is not None:
                    self.checkpoints.restore(slot, found)
                    pos_next = min(pos_next, max(found.pos_min + 1, found.pos_max))
                    n_past = min(min(pos_next, len(slot.tokens)), found.n_tokens)
                    restored = found.n_tokens
                    why = (f"the cache no longer holds positions {pos_min_thold}..{pos_min - 1} the window needs; "
                           f"restored the checkpoint of n_tokens = {found.n_tokens}")
                    log.slot("info", "operator()", slot.id, task.id,
                             f"restored context checkpoint ({found.describe()}, n_past = {n_past}, "
                             f"size = {found.size_mib:.3f} MiB)")
                else:
                    forced = True
                    why = (f"the sliding-window cache holds positions from {pos_min}, but the window before position "
                           f"{pos_next} starts at {pos_min_thold}, and no checkpoint ends at or before {pos_next}")
                    log.slot("info", "operator()", slot.id, task.id, FORCED_FULL)
                    pos_next, n_past = 0, 0
        quirk = ""
        # the first token evaluated (at n_common, or one before it when nothing is new) sees n_swa positions
        needed = max(0, n_common - (0 if has_new_tokens else 1) - self.n_swa + 1)
        if 0 <= pos_min <= needed and n_past < n_common:
            quirk = QUIRK_NEEDLESS_SEARCH.format(pos_min=pos_min, needed=needed, lost=n_common - n_past,
                                                 outcome="a full re-processing forced" if forced else
                                                 f"the checkpoint of n_tokens = {restored} restored")
        if n_moved:
            quirk = "; ".join(q for q in (quirk, QUIRK_MOVED_CHUNKS.format(moved=n_moved)) if q)
        self.checkpoints.erase_invalidated(slot, pos_next, self.n_swa)
        if n_past == n_prompt and n_past > 0:
            log.slot("warn", "operator()", slot.id, task.id, f"need to evaluate at least 1 token for each active slot "
                                                             f"(n_past = {n_past}, task.n_tokens() = {n_prompt})")
            n_past -= 1
            log.slot("warn", "operator()", slot.id, task.id, f"n_past was set to {n_past}")
        slot.n_past_reused = n_past
        del slot.tokens[n_past:]  # the cells go with the first batch's seq_rm
        decided = ev.ServerPromptReused(
            slot=slot.id, task=task.id, n_prompt=n_prompt, n_kept=n_kept, n_common=n_common, n_past=n_past,
            n_cache_reused=n_moved, forced_full=forced, why=why, pos_min=pos_min, pos_min_thold=pos_min_thold,
            restored_n_tokens=restored, quirk=quirk)
        self._decisions[slot.id] = decided
        self.ctx.bus.publish(decided)
        return True

    def _reuse_chunks(self, slot: Slot, n_past: int) -> tuple[int, int]:
        """--cache-reuse: after the common prefix, chunks of at least cache_reuse tokens that the new prompt
        repeats further on in the kept tokens are moved into place (seq_rm of the gap, seq_add of the chunk)."""
        kept, prompt, log, task = slot.tokens, slot.task.tokens, self.log, slot.task
        head_c = head_p = n_past
        moved = 0
        log.slot("debug", "operator()", slot.id, task.id,
                 f"trying to reuse chunks with size > {self.cache_reuse}, n_past = {n_past}")
        with self.ctx.bus.cause("server: --cache-reuse"):
            while head_c < len(kept) and head_p < len(prompt):
                n_match = 0
                while (head_c + n_match < len(kept) and head_p + n_match < len(prompt)
                       and kept[head_c + n_match] == prompt[head_p + n_match]):
                    n_match += 1
                if n_match >= self.cache_reuse:
                    log.slot("info", "operator()", slot.id, task.id,
                             f"reusing chunk with size {n_match}, shifting KV cache [{head_c}, {head_c + n_match}) -> "
                             f"[{head_p}, {head_p + n_match})")
                    kv_shift = head_p - head_c
                    self.ctx.memory.seq_rm(slot.id, head_p, head_c)
                    self.ctx.memory.seq_add(slot.id, head_c, head_c + n_match, kv_shift)
                    for i in range(n_match):
                        kept[head_p + i] = kept[head_c + i]
                    n_past += n_match
                    moved += n_match
                    head_c += n_match
                    head_p += n_match
                else:
                    head_c += 1
        del kept[head_p:]  # what follows the last moved chunk is cut by the first batch's seq_rm
        log.slot("debug", "operator()", slot.id, task.id, f"after context reuse, new n_past = {n_past}")
        return n_past, moved

    # ---- a batch of prompt tokens ---------------------------------------------------------------
    def _fill_prompt(self, slot: Slot, tokens: list, add, outputs: list) -> None:
        task, log, ctx = slot.task, self.log, self.ctx
        prompt, n_prompt = task.tokens, len(task.tokens)
        p0 = len(slot.tokens)
        log.slot("info", "operator()", slot.id, task.id, f"cached n_tokens = {p0}, memory_seq_rm [{p0}, end)")
        with ctx.bus.cause(f"server: slot {slot.id} new prompt"):
            if not ctx.memory.seq_rm(slot.id, p0, -1):
                raise KvscopeError(f"slot {slot.id}: seq_rm [{p0}, end) failed (llama-server aborts here)")
        do_checkpoint = self.params.ctx_checkpoints > 0 and self.n_swa > 0
        user_starts = set(task.user_starts)
        last_user_pos = task.user_starts[-1] if task.user_starts else -1
        cps, min_step, n_batch, n_ubatch = slot.checkpoints, self.params.checkpoint_min_step, ctx.n_batch, ctx.n_ubatch
        while len(slot.tokens) < n_prompt and len(tokens) < n_batch:
            add(slot, prompt[len(slot.tokens)], False)
            n = len(slot.tokens)
            if do_checkpoint and n in user_starts and (n == last_user_pos or not cps
                                                       or n > cps[-1].n_tokens + min_step):
                break  # the next batch starts the user message: a checkpoint goes before it
            if do_checkpoint and n_prompt in (n + min(n_batch, 4 + n_ubatch), n + min(n_batch, 4)):
                break  # the last tokens go in batches of their own, with checkpoints before them
        n_tokens_cur = len(slot.tokens) - p0
        slot.n_prompt_processed += n_tokens_cur
        near_prompt_end = n_prompt < len(slot.tokens) + n_ubatch
        is_user_start = p0 in user_starts
        if len(slot.tokens) == n_prompt:
            slot.state = "done_prompt"
            outputs[-1] = True
            slot.i_batch = len(tokens) - 1
            slot.sampler.accept(prompt, slot.id)
            log.slot("info", "init_sampler", slot.id, task.id, f"init sampler, took 0.00 ms, tokens: text = {n_prompt}, "
                                                               f"total = {n_prompt}")
        elif not is_user_start and not near_prompt_end:
            do_checkpoint = False
        pos_min, pos_max = ctx.memory.seq_pos_min(slot.id), ctx.memory.seq_pos_max(slot.id)
        do_checkpoint = do_checkpoint and pos_min >= 0 and (
            not cps or p0 == last_user_pos or near_prompt_end or p0 > cps[-1].n_tokens + min_step)
        log.slot("debug", "operator()", slot.id, task.id, f"main/do_checkpoint = {'yes' if do_checkpoint else 'no'}, "
                                                          f"pos_min = {pos_min}, pos_max = {pos_max}")
        if do_checkpoint:
            self.checkpoints.create(slot, n_tokens_cur, pos_min, pos_max)

    # ---- decode and sample ----------------------------------------------------------------------
    def _decode(self, batch: Batch) -> None:
        ctx, log = self.ctx, self.log
        n, off, n_batch = len(batch), 0, ctx.n_batch
        while off < n:
            size = min(n_batch, n - off)
            piece = Batch(batch.tokens[off:off + size], batch.pos[off:off + size], batch.seq_ids[off:off + size],
                          batch.logits[off:off + size])
            log.srv("debug", "decode", f"n_batch (effective) = {size}, off = {off}")
            rc = ctx.decode(piece)
            if rc == 1 and n_batch > 1:
                n_batch //= 2
                log.srv("warn", "update_slots", f"failed to find free space in the KV cache, retrying with smaller "
                                                f"batch size, off = {off}, n_batch = {n_batch}, ret = {rc}")
                continue
            if rc != 0:
                message = CONTEXT_EXCEEDED if rc == 1 else ("Invalid input batch." if rc == -1 else "Compute error.")
                log.srv("error", "update_slots", f"{message} off = {off}, n_batch = {n_batch}, ret = {rc}")
                for slot in self.slots:
                    if slot.is_processing:
                        self._fail(slot, message)
                return
            for slot in self.slots:
                if slot.state in ("done_prompt", "generating") and off <= slot.i_batch < off + size:
                    self._sample(slot, slot.i_batch - off)
            off += size

    def _sample(self, slot: Slot, index: int) -> None:
        if slot.state == "done_prompt":
            slot.state = "generating"
            slot.t_prompt_ms = 1e3 * (time.perf_counter() - slot.t_prompt_start)
            slot.t_gen_start = time.perf_counter()
        task, log = slot.task, self.log
        token = slot.sampler.sample(self.ctx.logits_for_token(index), seq_id=slot.id)
        if len(slot.generated) < len(task.answer):  # a scripted answer: the history holds what the script says
            token = task.answer[len(slot.generated)]
        slot.generated.append(token)
        self.sampled_last_step += 1
        piece = self.tokenizer.decode([token])
        if self.ctx.bus.active:
            self.ctx.bus.publish(ev.TokenSampled(slot.id, token, piece, len(slot.tokens)))
        n_gen = len(slot.generated)
        n_remaining = task.n_predict - n_gen if task.n_predict >= 0 else -1
        stop = ""
        if task.n_predict >= 0 and n_gen >= task.n_predict:
            stop = "limit"
            log.slot("debug", "process_token", slot.id, task.id, f"stopped by limit, n_gen = {n_gen}, "
                                                                 f"n_predict = {task.n_predict}")
        elif self.tokenizer.is_eog(token):
            stop = "eos"
            log.slot("debug", "process_token", slot.id, task.id, "stopped by EOS")
        elif not self.context_shift and len(slot.tokens) + 1 >= slot.n_ctx:
            stop = "context"
            log.slot("debug", "process_token", slot.id, task.id,
                     f"stopped due to running out of context capacity, prompt.n_tokens() = {len(slot.tokens)}, "
                     f"task.n_tokens = {len(task.tokens)}, n_gen = {n_gen}, n_ctx = {slot.n_ctx}")
        log.slot("debug", "process_token", slot.id, task.id, f"n_gen = {n_gen}, n_remaining = {n_remaining}, next "
                                                             f"token: {token:5d} '{piece}'")
        if stop:
            self._print_timings(slot)
            self._release(slot, stop)
        else:
            slot.sampled = token

    def _print_timings(self, slot: Slot) -> None:
        n_prompt, n_gen = slot.n_prompt_processed, len(slot.generated)
        t_prompt, t_gen = slot.t_prompt_ms, 1e3 * (time.perf_counter() - slot.t_gen_start)

        def rates(ms: float, n: int) -> str:
            per = ms / n if n else 0.0
            return f"({per:8.2f} ms per token, {1e3 * n / ms if ms > 0 else 0.0:8.2f} tokens per second)"

        for text in (f"prompt eval time = {t_prompt:10.2f} ms / {n_prompt:5d} tokens {rates(t_prompt, n_prompt)}",
                     f"       eval time = {t_gen:10.2f} ms / {n_gen:5d} tokens {rates(t_gen, n_gen)}",
                     f"      total time = {t_prompt + t_gen:10.2f} ms / {n_prompt + n_gen:5d} tokens"):
            self.log.slot("info", "print_timing", slot.id, slot.task_id, text)

    def _release(self, slot: Slot, stop: str, error: str = "") -> None:
        task = slot.task
        self.log.slot("info", "release", slot.id, task.id, f"stop processing: n_tokens = {len(slot.tokens)}, "
                                                           f"truncated = {int(slot.truncated)}")
        done = ev.ServerTaskFinished(
            slot=slot.id, task=task.id, n_prompt=len(task.tokens), n_cached=slot.n_past_reused,
            n_processed=slot.n_prompt_processed, n_generated=len(slot.generated), stop=stop,
            text=self.tokenizer.decode(slot.generated), n_kept=len(slot.tokens), label=task.label, error=error)
        self.finished.append(done)
        self.n_finished += 1
        self.ctx.bus.publish(done)
        slot.t_last_used = now_us()
        slot.state, slot.i_batch = "idle", -1
        self.log.slot("debug", "reset", slot.id, task.id, "")
        slot.task = None

    def _fail(self, slot: Slot, message: str) -> None:
        """The task gets the error; the slot forgets what it held (llama-server: send_error, release, clear)."""
        self.log.slot("error", "send_error", slot.id, slot.task_id, f"task id = {slot.task_id}, error: {message}")
        self._release(slot, "error", message)
        self.clear_slot(slot, "cleared after a failed task")

    def clear_slot(self, slot: Slot, why: str = "cleared") -> None:
        with self.ctx.bus.cause(f"server: slot {slot.id} {why}"):
            self.ctx.memory.seq_rm(slot.id, -1, -1)
        slot.tokens.clear()
        self.checkpoints.clear(slot)
        self.ctx.bus.publish(ev.ServerSlotChanged(slot=slot.id, n_kept=0, why=why))

    # ---- a full slot ------------------------------------------------------------------------------
    def _context_shift(self, slot: Slot) -> None:
        task = slot.task
        n_keep = len(task.tokens) if task.n_keep < 0 else task.n_keep
        if self.ctx.model.config.add_bos:
            n_keep += 1
        n_keep = min(slot.n_ctx - 4, n_keep)
        n_left = len(slot.tokens) - n_keep
        n_discard = task.n_discard if task.n_discard else n_left // 2
        n_discard = max(0, min(n_discard, max(0, n_left - 1)))
        self.log.slot("warn", "update_slots", slot.id, task.id,
                      f"slot context shift, n_keep = {n_keep}, n_left = {n_left}, n_discard = {n_discard}")
        self.ctx.bus.publish(ev.ServerContextShifted(slot=slot.id, task=task.id, n_keep=n_keep, n_left=n_left,
                                                     n_discard=n_discard))
        with self.ctx.bus.cause("context shift"):
            self.ctx.memory.seq_rm(slot.id, n_keep, n_keep + n_discard)
            self.ctx.memory.seq_add(slot.id, n_keep + n_discard, len(slot.tokens), -n_discard)
        del slot.tokens[n_keep:n_keep + n_discard]
        slot.truncated = True
