"""SWA visibility: which cells of each cache the next token of a sequence attends to, rebuilt from a
CacheMirror alone, so every front-end (terminal, notebook, replay viewer) draws the same answer.

The answer comes from engine.kv.swa.attends, the rule the attention kernel builds its KQ mask with
(engine/kv/attention.py UbatchAttention._build_mask, after llama.cpp's
llama_kv_cache::set_input_kq_mask in src/llama-kv-cache.cpp, windowed by llama_hparams::is_masked_swa
in src/llama-hparams.cpp), so a view and the kernel cannot disagree about a cell.

What a view gets per cache (only the stream the sequence lives in; with split streams the kernel
never reads another stream for that sequence's token, so other streams are left out):

- EMPTY: no position.
- OTHER: holds other sequences only. The KQ mask keeps a cell only when it holds the token's own
  sequence id, whoever else shares it, so a shared cell that holds this sequence is never OTHER.
- ATTENDED: holds the sequence and the next token sees it.
- MASKED: holds the sequence at a position <= next_pos, outside the window. These are the cells
  llama.cpp's find_slot may overwrite (when the sequence is their only one).
- FUTURE: holds the sequence at a position > next_pos (the causal part of the mask). The next
  token's position is seq_pos_max + 1 as the memory answers it (llama_batch_allocr::init,
  src/llama-batch.cpp, accepts no other), and seq_pos_max is recomputed from the cells, so
  seq_add/seq_div/seq_rm never leave a FUTURE cell in the cache that answers. The iSWA pair
  answers from its SWA cache, though: once the window has purged a sequence's old positions there,
  a seq_rm of its newer ones leaves the base cache holding positions the SWA cache no longer
  knows, and the next token comes at a position below them (llama.cpp does the same). Those base
  cells are FUTURE. A caller asking about an earlier position than the default sees them too.

The cells are the state before the token is decoded. The kernel's row for that token also holds
the token's own cell, placed by the decode itself (a free cell, or one whose only sequence's window
has passed it: MASKED or OTHER), so the kernel attends to exactly the ATTENDED cells plus one; the
SWA purge that comes with such a reuse (llama_kv_cache::apply_ubatch) removes only positions masked for
that token. (Not so in the dry run of a batch of several ubatches: a later ubatch is judged against the
positions the earlier ones placed, so its purge can remove positions their tokens still see; a QUIRK,
engine/kv/cache.py QUIRK_DRY_RUN_PURGE.)
Every ATTENDED cell stays used, and the kernel's n_kv (KVCache.n_kv) covers every used cell, so the
padded tail of the mask never hides one.

No torch here: engine.kv.swa is numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum

import numpy as np

from engine.errors import KvscopeError
from engine.kv.cells import MAX_SEQ
from engine.kv.swa import SwaType, attends
from engine.watch.mirror import CacheMirror, StreamState


class VisibilityError(KvscopeError, ValueError):
    """A visibility question the mirror cannot answer: no cache yet, or a sequence id no cache accepts."""

class CellVisibility(IntEnum):
    EMPTY = 0
    OTHER = 1
    ATTENDED = 2
    MASKED = 3
    FUTURE = 4


class LayerKind(str, Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class CacheVisibility:
    """One cache's cells as the next token of `seq_id` sees them (one stream's worth)."""

    cache: str
    kind: LayerKind
    layer_ids: tuple[int, ...]  # model layers that read this cache (an all-sliding model's base: none)
    n_swa: int
    swa_type: SwaType
    stream: int
    seq_id: int
    next_pos: int
    codes: np.ndarray  # int8 CellVisibility per cell, read-only
    pos: np.ndarray  # the cells' positions the codes were computed from, read-only

    @property
    def counts(self) -> dict[CellVisibility, int]:
        per_code = np.bincount(self.codes, minlength=len(CellVisibility))
        return {code: int(per_code[code]) for code in CellVisibility}

    @property
    def n_attended(self) -> int:
        return self.counts[CellVisibility.ATTENDED]

    @property
    def n_held(self) -> int:
        """Cells that hold the sequence: attended, masked or future."""
        c = self.counts
        return c[CellVisibility.ATTENDED] + c[CellVisibility.MASKED] + c[CellVisibility.FUTURE]

    def cells(self, code: CellVisibility) -> np.ndarray:
        return np.flatnonzero(self.codes == code)

    def describe(self) -> str:
        return (f"seq {self.seq_id}'s next token sees {self.n_attended} of {self.n_held} cells "
                f"({self.cache}, {self.kind.value}{self._window_text()})")

    def _window_text(self) -> str:
        return "" if self.kind is LayerKind.FULL else f", {self.swa_type.name.lower()} window {self.n_swa}"


@dataclass(frozen=True)
class SequenceVisibility:
    """Every cache of a context, as the token of `seq_id` at `next_pos` sees it."""

    seq_id: int
    next_pos: int
    caches: dict[str, CacheVisibility]
    stale: bool  # the mirror lost events: the answer is as stale as the mirror

    def of_kind(self, kind: LayerKind) -> list[CacheVisibility]:
        return [v for v in self.caches.values() if v.kind is kind]

    def for_layer(self, il: int) -> CacheVisibility:
        for v in self.caches.values():
            if il in v.layer_ids:
                return v
        raise KeyError(f"no cache holds model layer {il}")


def visibility(mirror: CacheMirror, seq_id: int, next_pos: int | None = None) -> SequenceVisibility:
    """What the next token of seq_id sees in every cache of the mirror. next_pos: that token's
    position; default seq_pos_max + 1 as the memory answers it (llama_batch_allocr::init,
    src/llama-batch.cpp, requires exactly that position), 0 for a sequence without cells."""
    # The mirror's lock keeps a concurrent sync() from changing cells between the caches.
    with mirror._lock:
        check_seq_id(mirror, seq_id)
        if next_pos is None:
            next_pos = memory_seq_pos_max(mirror, seq_id) + 1
        caches = {name: cache_visibility(mirror, name, seq_id, int(next_pos)) for name in mirror.caches}
        return SequenceVisibility(seq_id, int(next_pos), caches, mirror.stale)


def cache_visibility(mirror: CacheMirror, name: str, seq_id: int, next_pos: int) -> CacheVisibility:
    created = mirror.created[name]
    swa_type = SwaType(created.swa_type)
    stream = seq_to_stream(mirror, name, seq_id)
    st = mirror.caches[name].streams[stream]
    codes = cell_codes(st.pos, st.holds(seq_id), next_pos, created.n_swa, swa_type)
    return CacheVisibility(name, layer_kind(swa_type), tuple(created.layer_ids), created.n_swa, swa_type, stream,
                           seq_id, next_pos, _read_only(codes), _read_only(st.pos.copy()))


def cell_codes(pos: np.ndarray, holds_seq: np.ndarray, next_pos: int, n_swa: int, swa_type: SwaType) -> np.ndarray:
    """A CellVisibility per cell. ATTENDED is the kernel's own rule (engine.kv.swa.attends); the
    other codes only say why a cell is not attended."""
    attended = attends(pos, holds_seq, next_pos, n_swa, swa_type)
    codes = np.where(pos >= 0, np.int8(CellVisibility.OTHER), np.int8(CellVisibility.EMPTY))
    codes[holds_seq] = np.where(pos[holds_seq] > next_pos, np.int8(CellVisibility.FUTURE),
                                np.int8(CellVisibility.MASKED))
    codes[attended] = CellVisibility.ATTENDED
    return codes


def layer_kind(swa_type: SwaType) -> LayerKind:
    """The caches engine/kv/factory.py builds: "kv" (no window) and the iSWA pair's "base" are read
    by full-attention layers, "swa" by the sliding ones (llama_model::create_memory); deciding by
    the cache's own window also covers a plain cache built with one."""
    return LayerKind.FULL if swa_type == SwaType.NONE else LayerKind.SLIDING


def memory_seq_pos_max(mirror: CacheMirror, seq_id: int) -> int:
    """seq_pos_max as the context's memory answers it: the iSWA pair asks its SWA cache
    (llama_kv_cache_iswa::seq_pos_max, src/llama-kv-cache-iswa.cpp), a plain memory its one cache."""
    name = answering_cache(mirror)
    st = mirror.caches[name].streams[seq_to_stream(mirror, name, seq_id)]
    return seq_pos_max(st, seq_id)


def answering_cache(mirror: CacheMirror) -> str:
    if "swa" in mirror.caches:
        return "swa"
    if len(mirror.caches) == 1:
        return next(iter(mirror.caches))
    if "kv" in mirror.caches:
        return "kv"
    raise VisibilityError(f"no cache answers seq_pos_max among {sorted(mirror.caches)}: pass next_pos")


def seq_pos_max(st: StreamState, seq_id: int) -> int:
    held = st.pos[st.holds(seq_id)]
    return int(held.max()) if held.size else -1


def seq_to_stream(mirror: CacheMirror, name: str, seq_id: int) -> int:
    """llama_kv_cache::seq_to_stream: one stream for all, or stream seq_id with split streams."""
    return 0 if len(mirror.caches[name].streams) == 1 else seq_id


def check_seq_id(mirror: CacheMirror, seq_id: int) -> None:
    """The ids llama_kv_cache accepts (src/llama-kv-cache.cpp GGML_ASSERTs): any below
    LLAMA_MAX_SEQ in one stream, one per stream otherwise."""
    if not mirror.caches:
        raise VisibilityError("the mirror holds no cache yet: attach it to a bus and sync() first")
    n_stream = max(len(c.streams) for c in mirror.caches.values())
    limit = MAX_SEQ if n_stream == 1 else n_stream
    if not (isinstance(seq_id, (int, np.integer)) and not isinstance(seq_id, bool) and 0 <= seq_id < limit):
        raise VisibilityError(f"invalid seq_id {seq_id!r}; valid ids are 0..{limit - 1}")


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr
