"""The iSWA pair (llama.cpp's llama_kv_cache_iswa): a base cache for the full-attention layers and
a sliding-window cache for the SWA layers, behind the same memory interface as one cache.

Sequence operations go to both caches; positions are answered by the SWA cache (so pos_min rises
once the window slid); a batch must find slots in both, base first.

A pair whose caches differ in size (swa_full off) answers can_shift() False, yet takes seq_add and
seq_div and re-rotates both caches' keys at the next update, as llama.cpp does: its events carry
QUIRK_ISWA_SHIFT (engine/kv/cache.py).
"""
from __future__ import annotations

import logging

import torch

from engine.arguments import flag_arg, int_arg, ints
from engine.batch import BatchAllocator, UBatch
from engine.errors import MemoryOperationError
from engine.kv.cache import QUIRK_ISWA_SHIFT, KVCache
from engine.kv.slot_info import SlotInfo

log = logging.getLogger("kvscope.kv")

FULL_SWA_REF = "https://github.com/ggml-org/llama.cpp/pull/13194#issuecomment-2868343055"


def swa_cache_size(kv_size: int, n_swa: int, *, unified: bool, n_seq_max: int, n_ubatch: int, pad: int,
                   swa_full: bool) -> int:
    """Cells per stream of the SWA cache (llama_kv_cache_iswa's constructor, src/llama-kv-cache-iswa.cpp). With a tiny kv_size the padding can make
    it larger than kv_size, exactly as a direct llama.cpp instantiation would."""
    if swa_full:
        return kv_size
    need = min(kv_size, n_swa * (n_seq_max if unified else 1) + n_ubatch)
    return (need + pad - 1) // pad * pad


class ISWAAttention:
    """Routes each layer to the attention inputs of the cache that holds it."""

    def __init__(self, base_attn, swa_attn, swa_layers: dict[int, int]) -> None:
        self.base_attn, self.swa_attn = base_attn, swa_attn
        self._swa_layers = swa_layers
        self.n_groups = base_attn.n_groups

    def store_and_load(self, il: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        attn = self.swa_attn if il in self._swa_layers else self.base_attn
        return attn.store_and_load(il, k, v, dtype)

    def parts(self) -> tuple:
        """The attention inputs of each cache: base, then SWA (the attention probe reads both)."""
        return (self.base_attn, self.swa_attn)


class KVCacheISWA:
    """Two KVCache instances over disjoint layer sets: `base` (full attention) and `swa`."""

    name = "iswa"

    def __init__(self, base: KVCache, swa: KVCache, *, unified: bool, swa_full: bool) -> None:
        assert base.n_stream == swa.n_stream, "both caches of an iSWA pair have the same streams"
        self.base, self.swa = base, swa
        self.unified = unified
        self.swa_full = swa_full
        self.size = base.size
        self.n_stream = base.n_stream
        self.n_seq_max = base.n_seq_max
        # The sizes never change: a pair that cannot shift marks every move and K-shift of its caches.
        shift_quirk = "" if self.can_shift() else QUIRK_ISWA_SHIFT
        for cache in self.caches():
            cache.shift_quirk = shift_quirk

    def caches(self) -> list[KVCache]:
        return [self.base, self.swa]

    # ---- sizes and logs --------------------------------------------------------------------
    def init_log_lines(self) -> list[str]:
        return [line for level, line in self.init_log_records() if level == logging.INFO]

    def init_log_records(self) -> list[tuple[int, str]]:
        n_layer = len(self.base.layout.layer_ids) + len(self.swa.layout.layer_ids)
        records = []
        if self.swa_full:
            records.append((logging.INFO, f"llama_kv_cache_iswa: using full-size SWA cache (ref: {FULL_SWA_REF})"))
        records.append((logging.INFO, f"llama_kv_cache_iswa: creating non-SWA KV cache, size = {self.base.size} cells"))
        records += self.base.init_log_records(n_layer)
        records.append((logging.INFO, f"llama_kv_cache_iswa: creating     SWA KV cache, size = {self.swa.size} cells"))
        records += self.swa.init_log_records(n_layer)
        return records

    def k_bytes(self) -> int:
        return self.base.k_bytes() + self.swa.k_bytes()

    def v_bytes(self) -> int:
        return self.base.v_bytes() + self.swa.v_bytes()

    # ---- views --------------------------------------------------------------------------------
    def cells(self, stream: int = 0):
        raise MemoryOperationError("an iSWA memory holds two caches: use memory.base.cells(stream) or "
                                   "memory.swa.cells(stream)")

    def head(self, stream: int = 0):
        raise MemoryOperationError("an iSWA memory holds two caches: use memory.base.head(stream) or "
                                   "memory.swa.head(stream)")

    def can_shift(self) -> bool:
        """llama_kv_cache_iswa::get_can_shift: both caches can shift and have the same size (in practice:
        swa_full). llama.cpp's tools, and kvscope's runners, turn context shift off when it is False; the
        pair itself still shifts (QUIRK_ISWA_SHIFT, see seq_add and update)."""
        return self.base.can_shift() and self.swa.can_shift() and self.base.size == self.swa.size

    def snapshot_events(self) -> list:
        return self.base.snapshot_events() + self.swa.snapshot_events()

    def publish_snapshot(self) -> None:
        self.base.publish_snapshot()
        self.swa.publish_snapshot()

    # ---- sequence operations: both caches; positions from the SWA cache ----------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1, **kw) -> bool:
        seq_id, p0, p1 = ints("seq_rm", seq_id=seq_id, p0=p0, p1=p1)
        self._check_both(seq_id, "seq_rm", allow_all=True)
        ok_base = self.base.seq_rm(seq_id, p0, p1, **kw)
        return self.swa.seq_rm(seq_id, p0, p1, **kw) and ok_base

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        # Validated on both before either changes, so a refusal leaves the pair consistent.
        for cache in self.caches():
            src, dst, p0, p1 = cache.check_seq_cp(src, dst, p0, p1)
        self.base.seq_cp(src, dst, p0, p1)
        self.swa.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        seq_id = int_arg(seq_id, "seq_id", "seq_keep")
        self._check_both(seq_id, "seq_keep")
        self.base.seq_keep(seq_id)
        self.swa.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Both caches, even when can_shift() is False (llama_kv_cache_iswa::seq_add checks nothing):
        QUIRK_ISWA_SHIFT then marks the moves."""
        seq_id, p0, p1, delta = ints("seq_add", seq_id=seq_id, p0=p0, p1=p1, delta=delta)
        self._check_both(seq_id, "seq_add")
        self.base.seq_add(seq_id, p0, p1, delta)
        self.swa.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Both caches, as seq_add (QUIRK_ISWA_SHIFT when can_shift() is False)."""
        seq_id, p0, p1, d = ints("seq_div", seq_id=seq_id, p0=p0, p1=p1, d=d)
        self._check_both(seq_id, "seq_div")
        self.base.seq_div(seq_id, p0, p1, d)
        self.swa.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.swa.seq_pos_max(seq_id)

    def clear(self, data: bool = True) -> None:
        data = flag_arg(data, "data", "clear")  # checked before the base cache is cleared
        self.base.clear(data)
        self.swa.clear(data)

    def _check_both(self, seq_id: int, op: str, allow_all: bool = False) -> None:
        if not (allow_all and seq_id == -1):
            self.base._check_seq(seq_id, op)

    # ---- decode steps -------------------------------------------------------------------------
    def update(self) -> bool:
        """Each cache's own update, base first (llama_kv_cache_iswa::init_update makes one update context
        per cache): each checks only its own can_shift, so a pair whose can_shift() is False re-rotates
        the keys of both (QUIRK_ISWA_SHIFT on their KShiftApplied events)."""
        did_base = self.base.update()
        return self.swa.update() or did_base

    def init_batch(self, alloc: BatchAllocator, n_ubatch: int):
        """Unified: a simple split first, then an equal split if either cache found no slot; split
        streams: a sequential equal split only. Base is prepared before SWA (llama.cpp)."""
        if self.unified:
            plan = self._prepare_both(self._split(alloc, n_ubatch, simple=True))
            if plan is not None:
                return plan
        return self._prepare_both(self._split(alloc, n_ubatch, simple=False))

    def _split(self, alloc: BatchAllocator, n_ubatch: int, simple: bool) -> list[UBatch] | None:
        alloc.split_reset()
        ubatches = []
        while not alloc.all_used():
            if simple:
                ub = alloc.split_simple(n_ubatch)
            else:
                ub = alloc.split_equal(n_ubatch, sequential=not self.unified)
            if ub is None:
                return None
            ubatches.append(ub)
        return ubatches

    def _prepare_both(self, ubatches: list[UBatch] | None):
        if ubatches is None:
            return None
        slots_base = self.base.prepare(ubatches)
        if slots_base is None:
            return None
        slots_swa = self.swa.prepare(ubatches)
        if slots_swa is None:
            return None
        return ubatches, list(zip(slots_base, slots_swa))

    def apply_ubatch(self, sinfo: tuple[SlotInfo, SlotInfo], ubatch: UBatch, *, ubatch_index: int = 0,
                     tentative: bool = False) -> None:
        self.base.apply_ubatch(sinfo[0], ubatch, ubatch_index=ubatch_index, tentative=tentative)
        self.swa.apply_ubatch(sinfo[1], ubatch, ubatch_index=ubatch_index, tentative=tentative)

    def attention_inputs(self, sinfo: tuple[SlotInfo, SlotInfo], ubatch: UBatch) -> ISWAAttention:
        return ISWAAttention(self.base.attention_inputs(sinfo[0], ubatch),
                             self.swa.attention_inputs(sinfo[1], ubatch), self.swa.layer_index)
