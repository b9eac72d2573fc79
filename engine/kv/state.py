"""State save/restore of the KV cache in llama.cpp's byte format (src/llama-kv-cache.cpp
llama_kv_cache::state_write / state_read and their _meta/_data halves).

Everything is little endian (llama.cpp writes host byte order; kvscope runs on little-endian hosts).
The memory state is a sequence of per-cache states, one per cache in `caches` (a plain cache: one;
an iSWA pair: base then SWA, base skipped with STATE_SEQ_FLAGS_PARTIAL_ONLY). Each cache writes:

    u32 n_stream
    per stream: u32 cell_count; if > 0:
        metadata, per selected cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq id
        data: u32 v_trans, u32 n_layer
              per layer: i32 K ggml type, u64 K row bytes, the K rows of the selected cells
              V not transposed: per layer like K
              V transposed: per layer i32 type, u32 element size, u32 n_embd_v_gqa, then for each of the
                            n_embd_v_gqa rows the elements of the selected cells

K and V rows are written and read as the cache holds them, and the cache holds llama.cpp's rows: for
llama-family models (llama, Mistral) kvscope computes Q and K in the order convert_hf_to_gguf permutes
their rows into and turns them with llama.cpp's NORM RoPE (engine/rope.py), so a K row has, per KV
head, the Hugging Face dims in the order 0, d/2, 1, d/2 + 1, ..., from a GGUF or a Hugging Face folder
alike; qwen2 and Gemma rows keep the Hugging Face order, as llama.cpp's do. A state therefore crosses
between the engines as it is, for every cache type: a quantized K row is ggml's quantization of that
layout's 32-value blocks, which no reordering of an already quantized row could produce. Not modelled:
recent llama.cpp multiplies K and V by a Walsh-Hadamard matrix before storing them in a quantized
cache whose head size is a multiple of 64 (llama_kv_cache attn_rot_k/attn_rot_v, off with
LLAMA_ATTN_ROT_DISABLE=1); such quantized states hold rotated rows, which nothing in the bytes marks.

Selected cells are the non-empty ones; for a single sequence only those holding it and not
SWA-masked against the sequence's last position (max, not max + 1). The rows of the selected
cells in index order are exactly llama.cpp's "rows of each maximal range, ranges in order".

The wrappers llama_context adds (sequence and whole-context states, session files) are in
engine/kv/state_files.py.

Reading follows llama.cpp's order of operations, so a failure leaves the cache as it does: a whole
restore clears every stream once before reading (the 0c1e570 behaviour) and clears again on any
failure; a single-sequence restore removes the destination sequence before placing the cells with
find_slot + apply_ubatch (so they may scatter and the head moves) and removes it again on failure.
A stream-count mismatch, a wrong magic or a wrong model arch are refused before anything changes.
"""
from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

import numpy as np
import torch

from engine.batch import UBatch
from engine.errors import KvscopeError
from engine.kv.cache import KVCache
from engine.kv.storage import RowStorage
from engine.kv.swa import SwaType, is_masked_swa

log = logging.getLogger("kvscope.kv")

# include/llama.h
STATE_SEQ_IO_MAGIC = 0xAF143CD8  # src/llama-context.cpp io_magic: in-memory sequence states only
STATE_SEQ_FLAGS_NONE = 0
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # iSWA: save/restore the SWA cache only, not the base cache
STATE_SEQ_FLAGS_ON_DEVICE = 2  # llama.cpp keeps the data on the device; no meaning for kvscope
_KNOWN_FLAGS = STATE_SEQ_FLAGS_PARTIAL_ONLY | STATE_SEQ_FLAGS_ON_DEVICE

# ggml_type ids of the cache types
GGML_TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20,
                 "bf16": 30}
_GGML_TYPE_NAMES = {v: k for k, v in GGML_TYPE_IDS.items()}


class StateFileError(KvscopeError):
    """A saved state (bytes or file) cannot be restored: wrong magic or version, truncated, corrupt, or
    written by another model or with other cache settings. The message says what differs and how
    the cache was left."""


# ---- which caches a memory saves ---------------------------------------------------------------
def caches_of(memory, flags: int = STATE_SEQ_FLAGS_NONE) -> list[KVCache]:
    """The caches whose states make up the memory state, in order: [cache], or [base, swa] for an
    iSWA pair ([swa] with PARTIAL_ONLY). A plain cache ignores the flags, as llama.cpp's does."""
    if flags & ~_KNOWN_FLAGS:
        raise StateFileError(f"unknown state flags {flags:#x}; known: PARTIAL_ONLY = 1, ON_DEVICE = 2")
    if isinstance(memory, KVCache):
        return [memory]
    base, swa = getattr(memory, "base", None), getattr(memory, "swa", None)
    if isinstance(base, KVCache) and isinstance(swa, KVCache):
        return [swa] if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else [base, swa]
    raise TypeError(f"cannot save the state of a {type(memory).__name__}: expected a KVCache or an iSWA pair")


def type_id(name: str) -> int:
    try:
        return GGML_TYPE_IDS[name]
    except KeyError:
        raise StateFileError(f"cache type {name!r} has no ggml type id for state files") from None


def _type_label(tid: int) -> str:
    name = _GGML_TYPE_NAMES.get(tid)
    return f"{name} (ggml type {tid})" if name else f"ggml type {tid}"


# ---- byte streams ------------------------------------------------------------------------------
class Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def u32(self, v: int) -> None:
        self.buf += struct.pack("<I", v)

    def i32(self, v: int) -> None:
        self.buf += struct.pack("<i", v)

    def u64(self, v: int) -> None:
        self.buf += struct.pack("<Q", v)

    def raw(self, b: bytes | bytearray | memoryview) -> None:
        self.buf += b

    def string(self, s: str) -> None:
        data = s.encode()
        self.u32(len(data))
        self.raw(data)

    def getvalue(self) -> bytes:
        return bytes(self.buf)


class Reader:
    """Reads a state; running past the end raises StateFileError (llama.cpp: 'unexpectedly reached
    end of buffer')."""

    def __init__(self, data: bytes | bytearray | memoryview, what: str = "state") -> None:
        self.buf = memoryview(data).cast("B")
        self.off = 0
        self.what = what

    @property
    def n_read(self) -> int:
        return self.off

    @property
    def left(self) -> int:
        return len(self.buf) - self.off

    def take(self, n: int) -> memoryview:
        if n > self.left:
            raise StateFileError(f"the {self.what} is truncated: {n} more bytes needed at offset {self.off}, "
                                 f"only {self.left} left (unexpectedly reached end of buffer)")
        out = self.buf[self.off:self.off + n]
        self.off += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def i32(self) -> int:
        return struct.unpack("<i", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> str:
        n = self.u32()
        return bytes(self.take(n)).decode(errors="replace")


# ---- writer ------------------------------------------------------------------------------------
def selected_cells(cache: KVCache, stream: int, seq_id: int = -1) -> np.ndarray:
    """Indices of the cells a state of seq_id (-1: all) holds, ascending."""
    cells = cache.v_cells[stream]
    sel = cells.used_mask()
    if seq_id != -1:
        sel = sel & cells.seq[seq_id]
        lo = cache.layout
        if lo.swa_type != SwaType.NONE:
            # llama.cpp compares against seq_pos_max, not seq_pos_max + 1 as find_slot does
            sel = sel & ~is_masked_swa(lo.n_swa, lo.swa_type, cells.pos, cells.seq_pos_max(seq_id))
    return np.flatnonzero(sel)


def write_cache_state(w: Writer, cache: KVCache, seq_id: int = -1) -> None:
    """llama_kv_cache::state_write."""
    if seq_id != -1:
        cache._check_seq(seq_id, "state_write")
    w.u32(cache.n_stream)
    for s in range(cache.n_stream):
        idxs = selected_cells(cache, s, seq_id)
        w.u32(len(idxs))
        if not len(idxs):
            continue
        _write_meta(w, cache, s, idxs, seq_id)
        _write_data(w, cache, s, idxs)


def _write_meta(w: Writer, cache: KVCache, stream: int, idxs: np.ndarray, seq_id: int) -> None:
    cells = cache.v_cells[stream]
    n_seq_max = cache.n_seq_max
    if seq_id == -1:
        listed = cells.seq[:n_seq_max, idxs]  # seq ids >= n_seq_max are not written (as llama.cpp)
    else:
        listed = np.zeros((n_seq_max, len(idxs)), dtype=bool)
        if seq_id < n_seq_max:  # QUIRK: a unified cache's seq id >= n_seq_max is written as 0 seq ids
            listed[seq_id] = cells.seq[seq_id, idxs]
    # One i32 word each: pos, n_seq_id, then the ids ascending; built for all cells at once.
    counts = listed.sum(axis=0)
    cell_of_id, ids = np.nonzero(listed.T)  # by cell, then by seq id
    starts = 2 * np.arange(len(idxs)) + np.concatenate(([0], np.cumsum(counts)[:-1]))
    out = np.empty(2 * len(idxs) + int(counts.sum()), dtype="<i4")
    out[starts] = cells.pos[idxs]
    out[starts + 1] = counts
    first_id = np.concatenate(([0], np.cumsum(counts)[:-1]))
    out[starts[cell_of_id] + 2 + np.arange(len(ids)) - first_id[cell_of_id]] = ids
    w.raw(out.tobytes())


def _rows_bytes(rows: RowStorage, stream: int, idxs: torch.Tensor) -> bytes:
    """Raw bytes of the rows of some cells, in cell order (K, or V not transposed)."""
    t = rows.stored_rows(stream, idxs.to(rows.device)).contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes()


def _columns_bytes(rows: RowStorage, stream: int, idxs: torch.Tensor, n_rows: int) -> bytes:
    """Transposed V: for each of the first n_rows rows, the elements of the cells in cell order."""
    t = rows.data[stream][:n_rows][:, idxs.to(rows.device)].contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes()


def _write_data(w: Writer, cache: KVCache, stream: int, idxs: np.ndarray) -> None:
    v_trans = cache.layout.v_trans
    idx_t = torch.from_numpy(np.ascontiguousarray(idxs, dtype=np.int64))
    w.u32(1 if v_trans else 0)
    w.u32(len(cache.k))
    for k in cache.k:
        w.i32(type_id(k.ctype.name))
        w.u64(k.row_bytes)
        w.raw(_rows_bytes(k, stream, idx_t))
    for v in cache.v:
        w.i32(type_id(v.ctype.name))
        if not v_trans:
            w.u64(v.row_bytes)
            w.raw(_rows_bytes(v, stream, idx_t))
        else:
            w.u32(v.ctype.block_bytes)  # ggml_type_size: float types only here
            w.u32(v.width)
            w.raw(_columns_bytes(v, stream, idx_t, v.width))


def write_memory_state(caches: Sequence[KVCache], seq_id: int = -1, w: Writer | None = None) -> bytes:
    """The memory state of all caches (seq_id -1: everything)."""
    w = w if w is not None else Writer()
    for cache in caches:
        write_cache_state(w, cache, seq_id)
    return w.getvalue()


# ---- reader ------------------------------------------------------------------------------------
class _Failed(Exception):
    """A check of state_read_meta/state_read_data failed (llama.cpp returns false)."""


def read_cache_state(r: Reader, cache: KVCache, dest_seq_id: int = -1) -> None:
    """llama_kv_cache::state_read into one cache (dest_seq_id -1: the whole cache)."""
    if dest_seq_id != -1:
        cache._check_seq(dest_seq_id, "state_read")
    n_stream = r.u32()
    if n_stream != cache.n_stream:
        log.error("state_read: n_stream mismatch")
        raise StateFileError(
            f"n_stream mismatch in cache {cache.name!r}: the state has {n_stream} stream(s), this cache has "
            f"{cache.n_stream} (saved with {'split' if n_stream > 1 else 'unified'} streams"
            f"{f' for {n_stream} sequences' if n_stream > 1 else ''}); the cache is unchanged")
    if dest_seq_id == -1:
        cache.clear(True)  # once for all streams, before reading any (0c1e570)
    stream = -1
    try:
        for s in range(cache.n_stream):
            stream = s
            cell_count = r.u32()
            if cell_count == 0:
                continue
            strm = s if dest_seq_id == -1 else cache.seq_to_stream(dest_seq_id)
            dest = _read_meta(r, cache, strm, cell_count, dest_seq_id)
            _read_data(r, cache, strm, cell_count, dest)
    except (_Failed, StateFileError) as e:
        # llama_kv_cache::state_read: any failure clears (whole) or removes dest (single). A truncated
        # state counts as a failure here too; in llama.cpp its read exception bypasses this cleanup and
        # leaves the cells read so far (kvscope does not reproduce that half-restored cache).
        if dest_seq_id == -1:
            cache.clear(True)
            left = "the cache was cleared"
        else:
            cache.seq_rm(dest_seq_id, -1, -1)
            left = f"sequence {dest_seq_id} was removed from it"
        log.error("state_read: failed to restore kv cache")
        raise StateFileError(f"failed to restore kv cache {cache.name!r} (saved stream {stream}): {e}; {left}") \
            from None
    if dest_seq_id == -1:
        cache.publish_snapshot()  # restored cells were written directly: resync the watchers


def _read_meta(r: Reader, cache: KVCache, strm: int, cell_count: int, dest_seq_id: int) -> np.ndarray:
    """Read the metadata of cell_count cells; returns the cell index of each (llama.cpp's slot info)."""
    cells = cache.v_cells[strm]
    if dest_seq_id != -1:
        cache.seq_rm(dest_seq_id, -1, -1)
        pos = np.empty(cell_count, dtype=np.int64)
        for i in range(cell_count):
            p, n_seq_id = r.i32(), r.u32()
            if n_seq_id != 1:
                log.error("state_read_meta: invalid seq_id-agnostic kv cell")
                raise _Failed(f"invalid seq_id-agnostic kv cell: cell {i} of a sequence state lists {n_seq_id} "
                              f"sequence ids, expected exactly 1")
            r.i32()  # the saved seq id is ignored: the cells go to dest_seq_id
            if p < 0:
                raise _Failed(f"cell {i} has the invalid position {p}")
            pos[i] = p
        ubatch = UBatch(idxs=np.arange(cell_count), tokens=np.zeros(cell_count, dtype=np.int64), pos=pos,
                        seq_ids=((dest_seq_id,),) * cell_count, output=np.zeros(cell_count, dtype=bool),
                        n_seqs=1, equal_seqs=True, seq_id_unq=(dest_seq_id,))
        sinfo = cache.find_slot(ubatch)
        if sinfo is None:
            log.error("state_read_meta: failed to find %d available cells in kv cache", cell_count)
            raise _Failed(f"failed to find {cell_count} available cells in kv cache (size {cache.size}, "
                          f"{cache.used(strm)} used in stream {strm})")
        cache.apply_ubatch(sinfo, ubatch)
        return np.asarray(sinfo.idxs[0], dtype=np.int64)

    if cell_count > cells.size:
        log.error("state_read_meta: not enough cells in kv cache")
        raise _Failed(f"not enough cells in kv cache: the state has {cell_count} cells in this stream, this "
                      f"cache has {cells.size}")
    n_seq_max = cache.n_seq_max
    pos = np.empty(cell_count, dtype=np.int64)
    seq = np.zeros((cells.seq.shape[0], cell_count), dtype=bool)
    for i in range(cell_count):
        p, n_seq_id = r.i32(), r.u32()
        if p < 0:
            raise _Failed(f"cell {i} has the invalid position {p}")
        pos[i] = p
        for _ in range(n_seq_id):
            sid = r.i32()
            if sid < 0 or sid >= n_seq_max:
                log.error("state_read_meta: invalid seq_id, %d is out of range [0, %u)", sid, n_seq_max)
                raise _Failed(f"invalid seq_id, {sid} is out of range [0, {n_seq_max}) (cell {i}; this context "
                              f"has n_seq_max = {n_seq_max})")
            if seq[sid, i]:
                raise _Failed(f"cell {i} lists sequence {sid} twice")
            seq[sid, i] = True
        if n_seq_id == 0:
            # QUIRK (llama.cpp): a cell without seq ids stays non-empty and belongs to no sequence
            log.warning("state_read_meta: cell %d (pos %d) has no sequence id below n_seq_max = %d", i, p, n_seq_max)
    # The cache was cleared before reading: the cells go compactly to 0..cell_count-1.
    cells.pos[:cell_count] = pos
    cells.seq[:, :cell_count] = seq
    return np.arange(cell_count, dtype=np.int64)


def _read_data(r: Reader, cache: KVCache, strm: int, cell_count: int, dest: np.ndarray) -> None:
    """llama_kv_cache::state_read_data: check the layout, then copy the rows into the chosen cells."""
    layer_ids = cache.layout.layer_ids
    v_trans, n_layer = r.u32(), r.u32()
    if n_layer != len(cache.k):
        log.error("state_read_data: mismatched layer count (%u instead of %u)", n_layer, len(cache.k))
        raise _Failed(f"mismatched layer count: the state has {n_layer} layers, this cache has {len(cache.k)} "
                      f"(a state of another model?)")
    if cell_count > cache.size:
        log.error("state_read_data: not enough cells in kv cache to restore state (%u > %u)", cell_count, cache.size)
        raise _Failed(f"not enough cells in kv cache to restore state ({cell_count} > {cache.size})")
    if bool(v_trans) != cache.layout.v_trans:
        log.error("state_read_data: incompatible V transposition")
        raise _Failed(f"incompatible V transposition: the state has V {'transposed' if v_trans else 'not transposed'}"
                      f" (flash_attn {'off' if v_trans else 'on/auto'}), this cache has V "
                      f"{'transposed' if cache.layout.v_trans else 'not transposed'}")
    dest_t = torch.from_numpy(np.ascontiguousarray(dest, dtype=np.int64))
    pending: list[tuple[RowStorage, torch.Tensor, bool]] = []
    for il, k in zip(layer_ids, cache.k):
        _check_type(r, k, "key", il)
        _check_row_bytes(r, k, "key", il)
        pending.append((k, _take_rows(r, k, cell_count), False))
    for il, v in zip(layer_ids, cache.v):
        _check_type(r, v, "value", il)
        if not cache.layout.v_trans:
            _check_row_bytes(r, v, "value", il)
            pending.append((v, _take_rows(r, v, cell_count), False))
        else:
            el_ref, n_embd_ref = r.u32(), r.u32()
            if el_ref != v.ctype.block_bytes:
                log.error("state_read_data: mismatched value element size (%d != %d, layer %d)",
                          v.ctype.block_bytes, el_ref, il)
                raise _Failed(f"mismatched value element size in layer {il}: this cache has {v.ctype.block_bytes} "
                              f"bytes, the state has {el_ref}")
            if n_embd_ref != v.width:
                log.error("state_read_data: mismatched GQA embedding size (%u != %u, layer %d)", v.width,
                          n_embd_ref, il)
                raise _Failed(f"mismatched GQA embedding size in layer {il}: this cache has {v.width}, the state "
                              f"has {n_embd_ref}")
            raw = _copy(r.take(cell_count * v.width * v.ctype.block_bytes))
            pending.append((v, raw.view(v.dtype).view(v.width, cell_count), True))
    # Every check passed: store the rows (llama.cpp also defers its tensor writes to the end).
    for rows, values, transposed in pending:
        idx = dest_t.to(rows.device)
        if transposed:
            rows.data[strm][:, idx] = values.to(rows.device)
        else:
            rows.store_rows(strm, idx, values.to(rows.device))


def _check_row_bytes(r, rows: RowStorage, what: str, il: int) -> None:
    """Read a layer's u64 row size and refuse a state whose rows differ from this cache's."""
    row_ref = r.u64()
    if row_ref != rows.row_bytes:
        log.error("state_read_data: mismatched %s row size (%d != %d, layer %d)", what, rows.row_bytes, row_ref, il)
        raise _Failed(f"mismatched {what} row size in layer {il}: this cache has {rows.row_bytes} bytes, the state "
                      f"has {row_ref}")


def _check_type(r: Reader, rows: RowStorage, what: str, il: int) -> None:
    tid_ref = r.i32()
    tid = type_id(rows.ctype.name)
    if tid != tid_ref:
        log.error("state_read_data: mismatched %s type (%d != %d, layer %d)", what, tid, tid_ref, il)
        raise _Failed(f"mismatched {what} type in layer {il}: this cache has {_type_label(tid)}, the state has "
                      f"{_type_label(tid_ref)}")


def _copy(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(view), dtype=torch.uint8) if len(view) else torch.zeros(0, dtype=torch.uint8)


def _take_rows(r: Reader, rows: RowStorage, cell_count: int) -> torch.Tensor:
    raw = _copy(r.take(cell_count * rows.row_bytes))
    if rows.dtype == torch.uint8:  # quantized: block bytes
        return raw.view(cell_count, rows.row_bytes)
    return raw.view(rows.dtype).view(cell_count, rows.width)


def read_memory_state(r: Reader, caches: Sequence[KVCache], dest_seq_id: int = -1) -> None:
    """Restore every cache in turn (an iSWA pair: base, then SWA). A failing cache raises; the ones
    before it stay restored, as in llama.cpp."""
    if dest_seq_id != -1:
        for cache in caches:  # llama.cpp asserts this; refuse before anything changes
            cache._check_seq(dest_seq_id, "state_seq_set_data")
    for cache in caches:
        read_cache_state(r, cache, dest_seq_id)
