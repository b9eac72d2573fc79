"""The KV cache: preallocated K/V tensors plus per-stream cell metadata (llama.cpp's llama_kv_cache).

Plan, then commit: `find_slot` chooses cells without changing anything, `apply_ubatch` writes the
metadata. `prepare` dry-runs a whole batch and rolls back, so a decode is all-or-nothing at the slot
level. Sequence operations follow llama.cpp's public llama_memory_* calls, including their head
updates and QUIRKs. Every metadata change is published on the event bus.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np
import torch

from engine import events as ev
from engine.arguments import flag_arg, int_arg, ints
from engine.batch import BatchAllocator, UBatch
from engine.errors import MemoryOperationError
from engine.kv import slot_debug
from engine.kv.attention import UbatchAttention
from engine.kv.cells import MAX_SEQ, KVCells
from engine.kv.layout import CacheLayout
from engine.kv.slot_info import SlotInfo
from engine.kv.storage import RowStorage, Scratch
from engine.kv.swa import SwaType, is_masked_swa
from engine.placement.devices import Device, as_device

log = logging.getLogger("kvscope.kv")

POS_INF = np.iinfo(np.int64).max

# The texts the events carry for llama.cpp behaviour that looks unintended; views show them as is.
QUIRK_DRY_RUN_PURGE = ("llama.cpp QUIRK (src/llama-kv-cache.cpp, llama_kv_cache::prepare): the SWA purge of a "
                       "dry run is not rolled back outside the ubatches' own cells, even when the decode then "
                       "fails; with several ubatches, a later one's purge can remove positions an earlier "
                       "one's tokens still see")
QUIRK_DIV_SHIFT = ("llama.cpp QUIRK (src/llama-kv-cells.h, llama_kv_cells::pos_div): seq_div accumulates "
                   "old - new as the shift, so the next K-shift turns the keys away from the new positions")
QUIRK_DRY_RUN_HEADS = ("llama.cpp QUIRK (src/llama-kv-cache.cpp, llama_kv_cache::prepare): the dry run restores "
                       "each stream's head from the old head at the stream's index in the ubatch's slot, not at "
                       "its id, so a head takes another stream's old value ({streams}); the real apply sets it "
                       "again, so it lasts only after a failed decode")
QUIRK_ISWA_SHIFT = ("llama.cpp QUIRK (src/llama-kv-cache-iswa.cpp, llama_kv_cache_iswa::get_can_shift and "
                    "init_update): the memory says it cannot shift, then shifts: llama_memory_can_shift is false "
                    "for this iSWA pair (its SWA and base caches differ in size), yet seq_add/seq_div are "
                    "accepted and the next decode's K-shift re-rotates the keys of both caches, as each cache's "
                    "llama_kv_cache::update (src/llama-kv-cache.cpp) checks only its own get_can_shift")

# (k [N, n_head_kv, head_dim] float32, delta [N] int64) -> keys re-rotated by delta positions
KeyShifter = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """One llama.cpp KV cache: `n_stream` streams of `kv_size` cells over a set of model layers."""

    def __init__(self, layout: CacheLayout, *, bus: ev.EventBus, key_shifter: KeyShifter,
                 name: str = "kv", layer_devices: Sequence[Device | torch.device | str] | None = None,
                 debug_level: int | None = None) -> None:
        """layer_devices: where each cache layer's K and V live (default: all on the CPU).
        debug_level: llama.cpp's LLAMA_KV_CACHE_DEBUG (see slot_debug.py); None reads that variable."""
        self.layout = layout
        self.debug_level = slot_debug.level_from_env() if debug_level is None else int(debug_level)
        self.name = name
        self.bus = bus
        self._key_shifter = key_shifter
        self.size = layout.kv_size
        self.n_stream = layout.n_stream
        self.n_seq_max = layout.n_seq_max
        self.v_cells = [KVCells(layout.kv_size) for _ in range(layout.n_stream)]
        self.v_heads = [0] * layout.n_stream  # a search hint, not part of the cache state
        self.pending_copies: list[tuple[int, int]] = []
        # The QUIRK text this cache's moves and K-shifts carry: QUIRK_ISWA_SHIFT when it is half of an iSWA
        # pair that says it cannot shift (set by KVCacheISWA), else none.
        self.shift_quirk = ""
        self.layer_index = {il: i for i, il in enumerate(layout.layer_ids)}
        devices = list(layer_devices) if layer_devices is not None else ["cpu"] * len(layout.layer_ids)
        if len(devices) != len(layout.layer_ids):
            raise ValueError(f"{len(devices)} layer devices for {len(layout.layer_ids)} cache layers")
        # Kept as given: an engine.placement.devices.Device says which (possibly virtual) device a layer is on,
        # which its torch device alone cannot (a virtual device's memory is the host's).
        self.layer_devices = tuple(devices)
        torch_devices = [d.torch_device if isinstance(d, Device) else d for d in devices]
        rows = dict(n_stream=layout.n_stream, kv_size=layout.kv_size, n_head=layout.n_head_kv)
        self.k = [RowStorage(layout.type_k, width=layout.n_embd_k, device=d, **rows) for d in torch_devices]
        self.v = [RowStorage(layout.type_v, width=layout.n_embd_v, transposed=layout.v_trans, device=d, **rows)
                  for d in torch_devices]
        # f16/bf16 rows converted to the compute dtype for attention, into memory kept between layers and
        # decodes (engine/kv/storage.py Scratch); part of the compute buffer (engine/sizing/compute_memory.py)
        self.read_scratch = (Scratch(), Scratch())

    # ---- sizes and log lines -------------------------------------------------------------
    def k_bytes(self) -> int:
        return self.layout.k_bytes()

    def v_bytes(self) -> int:
        return self.layout.v_bytes()

    def init_log_lines(self) -> list[str]:
        return self.layout.init_log_lines([as_device(d) for d in self.layer_devices])

    def init_log_records(self, n_layer: int | None = None) -> list[tuple[int, str]]:
        """The init lines with llama.cpp's per-layer debug lines before them: each model layer's K/V
        device, or "filtered" for a layer of the other cache of an iSWA pair (n_layer: the model's)."""
        devices = dict(zip(self.layout.layer_ids, self.layer_devices))
        layers = [(logging.DEBUG, f"llama_kv_cache: layer {il:3d}: " +
                   (f"dev = {as_device(devices[il])}" if il in devices else "filtered"))
                  for il in range(n_layer if n_layer is not None else len(self.layout.layer_ids))]
        return layers + [(logging.INFO, line) for line in self.init_log_lines()]

    def caches(self) -> list["KVCache"]:
        """The caches behind this memory: just this one (an iSWA pair has two)."""
        return [self]

    # ---- state views ----------------------------------------------------------------------
    def cells(self, stream: int = 0) -> list[tuple[int, frozenset[int], int]]:
        """One (pos, seq ids, shift) per cell of a stream; pos -1 when empty."""
        return self.v_cells[self._check_stream(stream, "cells")].cell_tuples()

    def head(self, stream: int = 0) -> int:
        return self.v_heads[self._check_stream(stream, "head")]

    def used(self, stream: int = 0) -> int:
        return self.v_cells[self._check_stream(stream, "used")].get_used()

    def can_shift(self) -> bool:
        return True

    def seq_to_stream(self, seq_id: int) -> int:
        return 0 if self.n_stream == 1 else seq_id

    def _check_stream(self, stream: int, op: str) -> int:
        stream = int_arg(stream, "stream", op)
        if not 0 <= stream < self.n_stream:
            raise MemoryOperationError(f"stream {stream} does not exist; this cache has {self.n_stream} stream(s)")
        return stream

    def _check_seq(self, seq_id: int, op: str) -> None:
        limit = MAX_SEQ if self.n_stream == 1 else self.n_seq_max
        if not 0 <= seq_id < limit:
            detail = ("split streams: one stream per sequence" if self.n_stream > 1 else "unified cache")
            raise MemoryOperationError(f"{op}: invalid seq_id {seq_id}; valid ids are 0..{limit - 1} ({detail})")

    # ---- sequence operations ----------------------------------------------------------------
    def seq_pos_min(self, seq_id: int) -> int:
        seq_id = int_arg(seq_id, "seq_id", "seq_pos_min")
        self._check_seq(seq_id, "seq_pos_min")
        return self.v_cells[self.seq_to_stream(seq_id)].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        seq_id = int_arg(seq_id, "seq_id", "seq_pos_max")
        self._check_seq(seq_id, "seq_pos_max")
        return self.v_cells[self.seq_to_stream(seq_id)].seq_pos_max(seq_id)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1, *, reason: str = "seq_rm",
               tentative: bool = False, keep_head: bool = False) -> bool:
        """Remove seq_id (all sequences when -1) from the cells with positions in [p0, p1).
        keep_head: leave the heads alone (the SWA purge of apply_ubatch, see there)."""
        seq_id, p0, p1 = ints("seq_rm", seq_id=seq_id, p0=p0, p1=p1)
        if seq_id != -1:
            self._check_seq(seq_id, "seq_rm")
        lo, hi = position_range(p0, p1)
        changes, n_freed = [], 0
        streams = range(self.n_stream) if seq_id == -1 else [self.seq_to_stream(seq_id)]
        for s in streams:
            cells = self.v_cells[s]
            idxs = cells.in_range(lo, hi, seq_id)
            if seq_id == -1:
                cells.rm(idxs)
                freed = idxs
            else:
                freed = cells.seq_rm(idxs, seq_id)
            if freed.size and freed[0] < self.v_heads[s] and not keep_head:
                self.v_heads[s] = int(freed[0])
            n_freed += freed.size
            if idxs.size:
                changes.append(self._stream_cells(s, idxs))
        if changes:
            quirk = QUIRK_DRY_RUN_PURGE if (reason == "purge" and tentative) else ""
            self._publish(ev.CellsRemoved, changes, reason=reason, seq_id=seq_id, p0=p0, p1=p1,
                          n_freed=n_freed, tentative=tentative, quirk=quirk)
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make dst share src's cells in [p0, p1). Across streams the whole stream is copied."""
        src, dst, p0, p1 = self.check_seq_cp(src, dst, p0, p1)
        s_src, s_dst = self.seq_to_stream(src), self.seq_to_stream(dst)
        if s_src == s_dst:
            self._seq_cp_same_stream(s_src, src, dst, p0, p1)
        else:
            self._seq_cp_across_streams(s_src, s_dst, src, dst, p0, p1)

    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> tuple[int, int, int, int]:
        """Raise what seq_cp would refuse (llama.cpp aborts there), changing nothing; returns the
        arguments as ints."""
        src, dst, p0, p1 = ints("seq_cp", src=src, dst=dst, p0=p0, p1=p1)
        self._check_seq(src, "seq_cp")
        self._check_seq(dst, "seq_cp")
        s_src, s_dst = self.seq_to_stream(src), self.seq_to_stream(dst)
        if s_src == s_dst:
            cells = self.v_cells[s_src]
            idxs = cells.in_range(*position_range(p0, p1), src)
            if src != dst and np.any(cells.seq[dst, idxs]):
                raise MemoryOperationError(
                    f"seq_cp({src}, {dst}): sequence {dst} already shares cells with {src} in that range; "
                    f"remove it first with seq_rm({dst}, ...)")
            return src, dst, p0, p1
        last = self.size - 1
        if not ((p0 <= 0 or p0 >= last) and (p1 < 0 or p1 >= last or p1 == 0)):
            raise MemoryOperationError(
                f"seq_cp({src}, {dst}, {p0}, {p1}): with split streams only a full-range copy is supported "
                f"(use p0 = -1, p1 = -1); the whole stream {s_src} is copied to stream {s_dst}")
        return src, dst, p0, p1

    def _seq_cp_same_stream(self, stream: int, src: int, dst: int, p0: int, p1: int) -> None:
        if src == dst:
            return
        cells = self.v_cells[stream]
        idxs = cells.in_range(*position_range(p0, p1), src)
        cells.seq_add(idxs, dst)
        if idxs.size:
            self._publish(ev.CellsCopied, [self._stream_cells(stream, idxs)], src_seq=src, dst_seq=dst,
                          src_stream=stream, dst_stream=stream)

    def _seq_cp_across_streams(self, s_src: int, s_dst: int, src: int, dst: int, p0: int, p1: int) -> None:
        src_cells, dst_cells = self.v_cells[s_src], self.v_cells[s_dst]
        dst_cells.clear()
        dst_cells.copy_cells(src_cells, np.flatnonzero(src_cells.seq[src]), dst)
        self.v_heads[s_dst] = self.v_heads[s_src]
        self.pending_copies.append((s_src, s_dst))
        self._publish(ev.CellsCopied, [self._stream_cells(s_dst, np.arange(self.size))], src_seq=src,
                      dst_seq=dst, queued=True, src_stream=s_src, dst_stream=s_dst)

    def seq_keep(self, seq_id: int) -> None:
        """Keep only seq_id in its stream: its cells hold only it, every other cell is emptied."""
        seq_id = int_arg(seq_id, "seq_id", "seq_keep")
        self._check_seq(seq_id, "seq_keep")
        s = self.seq_to_stream(seq_id)
        cells = self.v_cells[s]
        idxs = np.flatnonzero(cells.used_mask())
        freed = cells.seq_keep(idxs, seq_id)
        if freed.size and freed[0] < self.v_heads[s]:
            self.v_heads[s] = int(freed[0])
        if idxs.size:
            self._publish(ev.CellsRemoved, [self._stream_cells(s, idxs)], reason="seq_keep", seq_id=seq_id,
                          n_freed=int(freed.size))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move seq_id's cells in [p0, p1) by delta; the keys follow at the next update (K-shift)."""
        seq_id, p0, p1, delta = ints("seq_add", seq_id=seq_id, p0=p0, p1=p1, delta=delta)
        self._check_seq(seq_id, "seq_add")
        self._check_shift("seq_add")
        lo, hi = position_range(p0, p1)  # normalised before the empty-range check, as llama.cpp does
        if delta == 0 or lo == hi:
            return
        s = self.seq_to_stream(seq_id)
        cells = self.v_cells[s]
        idxs = cells.in_range(lo, hi, seq_id)
        old = cells.pos[idxs].copy()
        freed = cells.pos_add(idxs, delta)
        # llama.cpp: the head goes to the first freed cell, else to 0, even if nothing moved.
        self.v_heads[s] = int(freed[0]) if freed.size else 0
        self._publish(ev.CellsShifted, [self._stream_cells(s, idxs)], op="add", seq_id=seq_id, p0=p0, p1=p1,
                      amount=delta, old_pos=(ev._frozen_array(old),), quirk=self.shift_quirk if idxs.size else "")

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions of seq_id's cells in [p0, p1) by d (QUIRK: shift sign, see cells.py)."""
        seq_id, p0, p1, d = ints("seq_div", seq_id=seq_id, p0=p0, p1=p1, d=d)
        self._check_seq(seq_id, "seq_div")
        self._check_shift("seq_div")
        if d < 1:
            raise MemoryOperationError(f"seq_div: divisor {d} must be >= 1")
        lo, hi = position_range(p0, p1)
        if d == 1 or lo == hi:
            return
        s = self.seq_to_stream(seq_id)
        cells = self.v_cells[s]
        idxs = cells.in_range(lo, hi, seq_id)
        old = cells.pos[idxs].copy()
        cells.pos_div(idxs, d)
        self._publish(ev.CellsShifted, [self._stream_cells(s, idxs)], op="div", seq_id=seq_id, p0=p0, p1=p1,
                      amount=d, old_pos=(ev._frozen_array(old),),
                      quirk="; ".join(filter(None, (QUIRK_DIV_SHIFT, self.shift_quirk if idxs.size else ""))))

    def _check_shift(self, op: str) -> None:
        if not self.can_shift():
            raise MemoryOperationError(f"{op}: this cache does not support K-shift (llama.cpp would abort at "
                                       f"the next decode)")

    def clear(self, data: bool = True) -> None:
        data = flag_arg(data, "data", "clear")
        changes = []
        for s, cells in enumerate(self.v_cells):
            idxs = np.flatnonzero(cells.used_mask())
            cells.clear()
            self.v_heads[s] = 0
            changes.append(self._stream_cells(s, idxs))
        if data:  # queued stream copies stay queued, as in llama.cpp
            for rows in self.k + self.v:
                rows.zero_()
        self._publish(ev.CellsRemoved, changes, reason="clear")

    # ---- slot search, dry run and apply -----------------------------------------------------
    def _token_groups(self, ubatch: UBatch) -> list[tuple[int, slice]]:
        """(stream, token slice) per group: all tokens in unified mode, one group per seq otherwise."""
        if self.n_stream == 1:
            return [(0, slice(0, ubatch.n_tokens))]
        n = ubatch.n_tokens // len(ubatch.seq_id_unq)
        return [(self.seq_to_stream(seq_id), slice(k * n, (k + 1) * n))
                for k, seq_id in enumerate(ubatch.seq_id_unq)]

    def find_slot(self, ubatch: UBatch) -> SlotInfo | None:
        """Choose cells for the ubatch without changing anything; None when it does not fit."""
        if self.debug_level > 0 and log.isEnabledFor(logging.DEBUG):  # the dump is O(cells): only if shown
            for seq_id in ubatch.seq_id_unq:  # one dump per unique seq, as llama.cpp prints it
                s = self.seq_to_stream(seq_id)
                for msg in slot_debug.stream_dump(self.v_cells[s], stream=s, head=self.v_heads[s], size=self.size,
                                                  n_swa=self.layout.n_swa, level=self.debug_level):
                    log.debug("%s", msg)
        streams, idxs = [], []
        for stream, tokens in self._token_groups(ubatch):
            n = tokens.stop - tokens.start
            found = self._find_cells(stream, n)
            if found is None:
                return None
            streams.append(stream)
            idxs.append(found)
        return SlotInfo(tuple(streams), tuple(idxs))

    def _find_cells(self, stream: int, n: int) -> np.ndarray | None:
        cells = self.v_cells[stream]
        head = self.v_heads[stream]
        used = cells.get_used()
        if head > used + 2 * n:
            head = 0  # llama.cpp's heuristic: a far head after many removals restarts the scan
        if n > self.size:
            log.error("find_slot: n_tokens = %d > size = %d", n, self.size)
            self._publish_slot_failure(stream, n)
            return None
        order = (head + np.arange(self.size)) % self.size
        usable = self._usable_cells(cells)[order]
        chosen = order[usable][:n]
        if chosen.size < n:
            self._publish_slot_failure(stream, n)
            return None
        return chosen

    def _usable_cells(self, cells: KVCells) -> np.ndarray:
        usable = ~cells.used_mask()
        if self.layout.swa_type != SwaType.NONE:
            all_idx = np.arange(self.size)
            single = cells.single_seq_of(all_idx)
            max_p1 = cells.seq_pos_max_all()[np.maximum(single, 0)] + 1
            usable |= (single >= 0) & is_masked_swa(self.layout.n_swa, self.layout.swa_type, cells.pos, max_p1)
        return usable

    def _publish_slot_failure(self, stream: int, n: int) -> None:
        if self.bus.active:
            self.bus.publish(ev.SlotSearchFailed(self.name, stream, n, self.size,
                                                 self.v_cells[stream].get_used(), self.v_heads[stream]))

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch, *, ubatch_index: int = 0,
                     tentative: bool = False) -> None:
        """Write the ubatch's positions and sequences into the chosen cells and move the heads."""
        changes, token_ids, max_rm = [], [], {}
        for (stream, tokens), idxs in zip(self._token_groups(ubatch), sinfo.idxs):
            cells = self.v_cells[stream]
            self._note_overwritten(cells, idxs, max_rm, stream)
            cells.pos_set(idxs, ubatch.pos[tokens])
            seq_lists = ubatch.seq_ids[tokens]
            counts = np.fromiter((len(ids) for ids in seq_lists), dtype=np.int64, count=len(seq_lists))
            flat_seq = np.fromiter((s for ids in seq_lists for s in ids), dtype=np.int64, count=int(counts.sum()))
            cells.seq[flat_seq, np.repeat(idxs, counts)] = True
            self.v_heads[stream] = int(idxs[-1]) + 1
            changes.append(self._stream_cells(stream, idxs))
            token_ids.append(ubatch.tokens[tokens])
        self._publish(ev.CellsAllocated, changes, ubatch=ubatch_index, n_tokens=ubatch.n_tokens,
                      tentative=tentative,
                      tokens=tuple(ev._frozen_array(t) for t in token_ids) if self.bus.active else ())
        # llama.cpp visits the seqs in ascending order and logs even when the seq has no cell left
        # (min -1: every cell of it was overwritten); that seq_rm then removes nothing.
        for (stream, seq_id), p_max in sorted(max_rm.items(), key=lambda kv: kv[0][1]):
            p_min = self.v_cells[stream].seq_pos_min(seq_id)
            if p_min <= p_max:
                log.debug("apply_ubatch: purging positions [%d, %d] of sequence %d from KV cache", p_min, p_max,
                          seq_id)
                # llama.cpp sets each head to the slot's last cell + 1 AFTER the purge (llama_kv_cache::apply_ubatch),
                # so a cell the purge frees below the slot never becomes the head.
                self.seq_rm(seq_id, p_min, p_max + 1, reason="purge", tentative=tentative, keep_head=True)

    def _note_overwritten(self, cells: KVCells, idxs: np.ndarray, max_rm: dict, stream: int) -> None:
        """SWA reuse: empty the masked cells about to be overwritten, remembering the highest
        position removed per sequence so that the purge keeps each sequence gap-free."""
        taken = idxs[cells.pos[idxs] >= 0]
        if not taken.size:
            return
        for seq_id, pos in zip(cells.single_seq_of(taken), cells.pos[taken]):
            key = (stream, int(seq_id))
            max_rm[key] = max(max_rm.get(key, -1), int(pos))
        cells.rm(taken)

    def split_batch(self, alloc: BatchAllocator, n_ubatch: int) -> list[UBatch] | None:
        """Simple split for one stream, sequential equal split for several (llama.cpp's choice)."""
        alloc.split_reset()
        ubatches = []
        while not alloc.all_used():
            if self.n_stream == 1:
                ub = alloc.split_simple(n_ubatch)
            else:
                ub = alloc.split_equal(n_ubatch, sequential=True)
            if ub is None:
                log.error("split_equal: sequential split is not supported when there are coupled sequences in "
                          "the input batch (you may need to use the -kvu flag)")
                return None
            ubatches.append(ub)
        return ubatches

    def init_batch(self, alloc: BatchAllocator, n_ubatch: int) -> tuple[list[UBatch], list[SlotInfo]] | None:
        """Split the batch and dry-run its placement: the ubatches and their slots, or None (decode
        returns 1)."""
        ubatches = self.split_batch(alloc, n_ubatch)
        slots = self.prepare(ubatches) if ubatches is not None else None
        return None if slots is None else (ubatches, slots)

    def prepare(self, ubatches: list[UBatch]) -> list[SlotInfo] | None:
        """Dry run: place every ubatch in turn, then restore. Returns the slots, or None if one fails.

        The heads are restored as llama.cpp restores them (QUIRK_DRY_RUN_HEADS): a stream touched by a
        ubatch gets back the old head at that stream's INDEX within the ubatch's slot, which is another
        stream's head whenever the index and the stream id differ (split streams). The rollback carries
        the QUIRK's text only when the dry run failed: after a successful one, applying its slots sets
        the head of every stream it restored, so the wrong head never outlives the decode (marking it
        there marked nearly every decode of a split-stream run). One case stays unmarked: a decode
        aborted between two ubatches leaves the later ubatches' streams with their wrong heads."""
        heads_before = list(self.v_heads)
        saved, slots = [], []
        for k, ub in enumerate(ubatches):
            sinfo = self.find_slot(ub)
            if sinfo is None:
                break
            snaps = [(stream, self.v_cells[stream].snapshot(idxs)) for stream, idxs in zip(sinfo.streams, sinfo.idxs)]
            saved.append((snaps, list(self.v_heads)))
            self.apply_ubatch(sinfo, ub, ubatch_index=k, tentative=True)
            slots.append(sinfo)
        failed = len(slots) != len(ubatches)
        restored: dict[int, set[int]] = {}
        for snaps, heads_old in reversed(saved):
            for s, (stream, snap) in enumerate(snaps):
                self.v_cells[stream].restore(snap)
                restored.setdefault(stream, set()).update(int(i) for i in snap.idxs)
                self.v_heads[stream] = heads_old[s]  # llama.cpp: v_heads[strm[s]] = v_heads_old[s]
        if restored:
            changes = [self._stream_cells(s, np.array(sorted(i), dtype=np.int64)) for s, i in sorted(restored.items())]
            moved = [s for s in restored if self.v_heads[s] != heads_before[s]] if failed else []
            quirk = QUIRK_DRY_RUN_HEADS.format(streams=", ".join(
                f"stream {s}: {heads_before[s]} -> {self.v_heads[s]}" for s in moved)) if moved else ""
            self._publish(ev.SlotsRolledBack, changes, tentative=True, quirk=quirk)
        return None if failed else slots

    # ---- update: stream copies and K-shift -------------------------------------------------
    def update(self) -> bool:
        """Run queued stream copies, then the K-shift. Returns whether anything was done."""
        did = False
        copies, self.pending_copies = self.pending_copies, []
        for src, dst in copies:
            for rows in self.k + self.v:
                rows.copy_stream(src, dst)
            log.debug("copying KV buffer: stream %d to stream %d", src, dst)
            if self.bus.active:
                self.bus.publish(ev.StreamCopyExecuted(self.name, src, dst, len(self.k)))
            did = True
        if any(c.has_shift for c in self.v_cells):
            self._check_shift("update")
            log.debug("update: applying K-shift")  # llama_kv_cache::update, "%s: applying K-shift"
            self._apply_k_shift()
            did = True
        return did

    def _apply_k_shift(self) -> None:
        lo = self.layout
        changes, amounts = [], []
        for s, cells in enumerate(self.v_cells):
            idxs = np.flatnonzero(cells.shift != 0)
            if idxs.size:
                delta = torch.from_numpy(cells.shift[idxs].copy())
                cell_idx = torch.from_numpy(idxs)
                stream_idx = torch.full_like(cell_idx, s)
                for il, k in zip(self.layout.layer_ids, self.k):
                    # Quantized K: dequantized, re-roped in f32, quantized again (as llama.cpp).
                    keys = k.read_cells(s, cell_idx).view(-1, lo.n_head_kv, lo.head_dim)
                    k.write(stream_idx, cell_idx, self._key_shifter(il, keys, delta).reshape(len(idxs), -1))
            amounts.append(ev._frozen_fresh(cells.shift[idxs]))  # one per change, empty for an unshifted stream
            cells.reset_shift()
            changes.append(self._stream_cells(s, idxs))
        self._publish(ev.KShiftApplied, changes, amounts=tuple(amounts), n_layers=len(self.k), quirk=self.shift_quirk)

    # ---- tensors for the forward pass -----------------------------------------------------
    def n_kv(self, streams: tuple[int, ...]) -> int:
        """Cells visible to attention: the used span rounded up to the padding (mask width)."""
        pad = self.layout.pad
        used_max_p1 = max(self.v_cells[s].used_max_p1() for s in streams)
        padded = (used_max_p1 + pad - 1) // pad * pad
        return min(self.size, max(pad, padded))

    def attention_inputs(self, sinfo: SlotInfo, ubatch: UBatch) -> UbatchAttention:
        return UbatchAttention(self, sinfo, ubatch)

    # ---- events ---------------------------------------------------------------------------
    def _stream_cells(self, stream: int, idxs: np.ndarray) -> ev.StreamCells | None:
        return self._cells_record(stream, idxs) if self.bus.active else None

    def _cells_record(self, stream: int, idxs: np.ndarray) -> ev.StreamCells:
        cells = self.v_cells[stream]
        idxs = np.asarray(idxs, dtype=np.int64)
        return ev.StreamCells(stream, ev._frozen_array(idxs), ev._frozen_fresh(cells.pos[idxs]),
                              ev._frozen_fresh(cells.shift[idxs]), ev.pack_seq_bits(cells.seq[:, idxs]),
                              self.v_heads[stream])

    def _publish(self, kind: type, changes: list, **fields) -> None:
        # A change is None when it was built while nobody listened; a watcher that subscribed in
        # the middle of this operation misses it and resyncs from a snapshot (publish_state).
        if self.bus.active and all(c is not None for c in changes):
            self.bus.publish(kind(cache=self.name, changes=tuple(changes), cause=self.bus.current_cause, **fields))

    def snapshot_events(self) -> list[ev.MemorySnapshot]:
        """The complete cell state as one event (built even when nobody listens yet)."""
        return [ev.MemorySnapshot(cache=self.name, changes=tuple(
            self._cells_record(s, np.arange(self.size)) for s in range(self.n_stream)))]

    def publish_snapshot(self) -> None:
        """Publish the complete state, so that a watcher that missed events can resync."""
        if self.bus.active:
            for event in self.snapshot_events():
                self.bus.publish(event)


def position_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's range rule: p0 < 0 means 0, p1 < 0 means +infinity; the range is [p0, p1)."""
    return max(p0, 0), (POS_INF if p1 < 0 else p1)
