"""The server simulation as a session's workload: the conversations of a chat script run on llama-server's
slots, one update-loop iteration per step, while the views watch the cache, the checkpoints and the log."""
from __future__ import annotations

from pathlib import Path

from engine.context import Context
from engine.errors import KvscopeError
from engine.runners.server.conversations import ChatRunner, Conversation, Turn, load_script
from engine.runners.server.log import ServerLog
from engine.runners.server.server import ServerParams, ServerSim
from engine.watch.protocol import StepOutcome

DEMO_CHAT = Path(__file__).parent / "chats" / "demo.json"


class ServerWorkload:
    name = "server"
    owns_sequences = True

    def __init__(self, spec, ctx: Context) -> None:
        params = ServerParams(n_slots=spec.n_clients, slot_prompt_similarity=spec.slot_prompt_similarity,
                              cache_reuse=spec.cache_reuse, ctx_checkpoints=spec.ctx_checkpoints,
                              checkpoint_min_step=spec.checkpoint_min_step, context_shift=spec.context_shift,
                              cache_ram_mib=spec.cache_ram_mib, cache_idle_slots=spec.cache_idle_slots,
                              sampler=spec.sampler)
        self.sim = ServerSim(ctx, params, log=ServerLog(ctx.bus, verbose=False))  # llama-server's lines without -v
        self.runner = ChatRunner(self.sim, load_script(spec.chat or DEMO_CHAT), n_keep=spec.n_keep)
        self.spec = spec
        self._asked = 0

    def step(self) -> StepOutcome:
        self.sim.follow_the_cache()
        if self.runner.done:
            return StepOutcome("idle")
        n_tokens = self.runner.step()  # failed decodes are the server's to handle: its log and the task say so
        return StepOutcome("batch" if n_tokens else "waiting", n_tokens, self.sim.sampled_last_step, 0,
                           self.active_seqs())

    def add_prompt(self, text: str, n_predict: int | None = None) -> int:
        """One more conversation of one turn, on any slot; returns nothing to wait for but its number."""
        self._asked += 1
        conversation = Conversation(f"prompt {self._asked}", (Turn(text, n_predict=n_predict or self.spec.n_predict),))
        self.runner.add(conversation)
        return self._asked

    def state_events(self) -> list:
        """For a watcher that starts now: the tasks running, and the checkpoints each slot holds with the
        host memory they take (the context's own state does not count them)."""
        return self.sim.state_events()

    def active_seqs(self) -> tuple[int, ...]:
        return tuple(s.id for s in self.sim.slots if s.is_processing)

    def shifted(self, seq_id: int, n_discard: int) -> None:
        pass  # check_shift refuses every shift of a slot's sequence

    def check_shift(self, seq_id: int) -> None:
        """A shift from outside would move a slot's cells without its kept tokens, which the next turn's
        reuse reads: refused (the server shifts a full slot itself with --context-shift)."""
        if seq_id in self.active_seqs():
            raise KvscopeError(f"slot {seq_id} is processing a task: shift it when it is idle (the server shifts a "
                               f"generating slot itself with --context-shift)")
        if seq_id < len(self.sim.slots):
            raise KvscopeError(f"seq {seq_id} is server slot {seq_id}: a shift from outside would leave the tokens it "
                               f"keeps out of step with its cells (the server shifts a full slot itself with "
                               f"--context-shift)")

    def stop_seq(self, seq_id: int, reason: str) -> None:
        raise KvscopeError("the server workload owns its slots' sequences: switch the session to the idle or "
                           "generate workload before loading a state into one that works")
