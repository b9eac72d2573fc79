"""Context checkpoints of a slot: when llama-server takes one, how a full list makes room, and the host
memory they hold (server-context.cpp, create_checkpoint, as of ggml-org/llama.cpp 001d906: the spacing
pass runs only when the list is one short of full, and a checkpoint at the same token count is replaced)."""
from __future__ import annotations

from engine import events as ev
from engine.kv.state import STATE_SEQ_FLAGS_PARTIAL_ONLY
from engine.placement.device_memory import publish_memory_change
from engine.placement.devices import CPU
from engine.runners.server.log import ServerLog
from engine.runners.server.slot import Checkpoint, Slot


class CheckpointStore:
    """Creates, erases and restores the checkpoints of the server's slots; every change is a
    CheckpointChanged event and moves the host memory the checkpoints hold."""

    def __init__(self, ctx, log: ServerLog, max_per_slot: int, min_step: int) -> None:
        self.ctx, self.log, self.max_per_slot, self.min_step = ctx, log, max_per_slot, min_step
        self._bytes = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def create(self, slot: Slot, n_tokens_cur: int, pos_min: int, pos_max: int) -> Checkpoint:
        """The state before the batch being built (its n_tokens_cur tokens are in slot.tokens already)."""
        cps, id_task = slot.checkpoints, slot.task_id
        last, i = -1, 0
        while len(cps) + 1 >= self.max_per_slot and i < len(cps):
            cp = cps[i]
            if cp.id_task != id_task and last >= 0 and cp.n_tokens <= last + self.min_step:
                self.log.slot("info", "create_checkpoint", slot.id, id_task,
                              f"erasing context checkpoint too close to an earlier one ({self._text(cp)})")
                self._erase(slot, i, "too close")
            else:
                last, i = cp.n_tokens, i + 1
        while len(cps) >= self.max_per_slot:
            self.log.slot("warn", "create_checkpoint", slot.id, id_task,
                          f"erasing old context checkpoint ({self._text(cps[0])})")
            self._erase(slot, 0, "old")
        n_tokens = len(slot.tokens) - n_tokens_cur
        for i in reversed([i for i, cp in enumerate(cps) if cp.n_tokens == n_tokens]):
            self.log.slot("info", "create_checkpoint", slot.id, id_task,
                          f"superseding context checkpoint at n_tokens = {n_tokens}")
            self._erase(slot, i, "superseded")
        data = self.ctx.state_seq_get_data(slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        cp = Checkpoint(id_task, n_tokens, pos_min, pos_max, data)
        cps.append(cp)
        self.log.slot("info", "create_checkpoint", slot.id, id_task,
                      f"created context checkpoint {len(cps)} of {self.max_per_slot} ({self._text(cp)})")
        self._changed(slot, cp, "created", "", +len(data))
        return cp

    def restore(self, slot: Slot, cp: Checkpoint) -> None:
        rc = self.ctx.state_seq_set_data(cp.data, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if rc == 0:
            raise RuntimeError(f"slot {slot.id}: restoring the checkpoint at n_tokens = {cp.n_tokens} failed: "
                               f"{self.ctx.last_error}")
        self._changed(slot, cp, "restored", "", 0)

    def erase_invalidated(self, slot: Slot, pos_next: int, n_swa: int) -> None:
        """Every checkpoint that ends after the position the new prompt goes on from."""
        i = 0
        while i < len(slot.checkpoints):
            cp = slot.checkpoints[i]
            if cp.pos_max > pos_next:
                self.log.slot("info", "operator()", slot.id, slot.task_id,
                              f"erased invalidated context checkpoint (pos_min = {cp.pos_min}, pos_max = {cp.pos_max}, "
                              f"n_tokens = {cp.n_tokens}, n_swa = {n_swa}, pos_next = {pos_next}, "
                              f"size = {cp.size_mib:.3f} MiB)")
                self._erase(slot, i, "invalidated")
            else:
                i += 1

    def adopt(self, slot: Slot, replaced: list[Checkpoint]) -> None:
        """The slot took the checkpoints of a prompt loaded from the prompt cache in place of `replaced`."""
        taken = slot.checkpoints
        slot.checkpoints = list(replaced)
        while slot.checkpoints:
            self._erase(slot, 0, "replaced from the prompt cache")
        for cp in taken:
            slot.checkpoints.append(cp)
            self._changed(slot, cp, "created", "from the prompt cache", +len(cp.data))

    def clear(self, slot: Slot) -> None:
        while slot.checkpoints:
            self._erase(slot, 0, "slot cleared")

    def _erase(self, slot: Slot, i: int, why: str) -> None:
        cp = slot.checkpoints.pop(i)
        self._changed(slot, cp, "erased", why, -len(cp.data))

    def _changed(self, slot: Slot, cp: Checkpoint, action: str, why: str, delta: int) -> None:
        bus = self.ctx.bus
        bus.publish(ev.CheckpointChanged(slot=slot.id, task=slot.task_id, action=action, pos_min=cp.pos_min,
                                         pos_max=cp.pos_max, n_tokens=cp.n_tokens, n_bytes=len(cp.data), why=why,
                                         n_held=len(slot.checkpoints)))
        if delta:  # llama-server keeps checkpoints in host memory, whatever device holds the cache
            self._bytes += delta
            publish_memory_change(bus, {CPU: abs(delta)}, "checkpoints", 1 if delta > 0 else -1)

    @staticmethod
    def _text(cp: Checkpoint) -> str:
        return f"{cp.describe()}, size = {cp.size_mib:.3f} MiB"
