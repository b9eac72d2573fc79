"""llama.cpp's LLAMA_KV_CACHE_DEBUG dump, printed by `llama_kv_cache::find_slot` (src/llama-kv-cache.cpp).

With level N >= 1, every find_slot prints, for each unique seq of the ubatch (ascending ids, also in
a unified cache, so a ubatch of seqs 0 and 1 prints the same stream twice), the state BEFORE the
ubatch is placed:
- the summary `find_slot: stream[%d], n = %5d, used = %5d, head = %5d, size = %5d, n_swa = %5d`
  (n = used_max_p1, head = the stored head, not the restart heuristic's);
- if (N == 2 and n_swa > 0) or N >= 3: the cell map and the position line, each logged as
  `"\\n%s\\n"`, then `find_slot: stream[%d] min[%d] = %5d, max[%d] = %5d` for each seq present in
  the stream.

The cache calls stream_dump with the cells it holds; nothing here knows the cache.

Each message here is the text of one LLAMA_LOG_DEBUG call without its final newline, which the log
handler adds (as every kvscope log line): so the map record starts with a newline, and ends with one
when the cell count is a multiple of 256 (llama.cpp's " *\\n" row break, then its own "\\n").
"""
from __future__ import annotations

import os

import numpy as np

from engine.errors import ContextParamsError
from engine.kv.cells import MAX_SEQ, KVCells

ENV_VAR = "LLAMA_KV_CACHE_DEBUG"

# map label per code: 0 empty, 1 several seqs, 2 + s the single seq s (std::to_string, so "12" is 2 chars)
_MAP_LABELS = np.array([".", "M", *(str(s) for s in range(MAX_SEQ))], dtype=object)


def level_from_env() -> int:
    """The level LLAMA_KV_CACHE_DEBUG asks for: 0 when unset or empty.

    llama.cpp reads it with atoi, which turns "abc" into 0 and "2x" into 2 without a word; a typo
    would silently switch the dump off, so anything but an integer is refused here instead.
    """
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ContextParamsError(f"{ENV_VAR}={raw!r} is not an integer; use 0 (off), 1 (summary per find_slot), "
                                 f"2 (also the cell map on SWA caches) or 3 (the cell map always)") from None


def shows_cells(level: int, n_swa: int) -> bool:
    return (level == 2 and n_swa > 0) or level > 2


def summary_line(cells: KVCells, *, stream: int, head: int, size: int, n_swa: int) -> str:
    return (f"find_slot: stream[{stream}], n = {cells.used_max_p1():5d}, used = {cells.get_used():5d}, "
            f"head = {head:5d}, size = {size:5d}, n_swa = {n_swa:5d}")


def cell_map(cells: KVCells) -> str:
    """One label per cell ('.' empty, the seq id, 'M' for several), " *" and a newline after every 256."""
    # Row by row over the present seqs: a reduction across all 256 seq rows per cell is ~10x slower.
    code = np.zeros(cells.size, dtype=np.int64)
    for s in np.flatnonzero(cells.seq.any(axis=1)).tolist():
        row = cells.seq[s]
        code[row] = np.where(code[row] == 0, 2 + s, 1)
    labels = _MAP_LABELS[code]
    labels[255::256] = labels[255::256] + " *\n"
    return "".join(labels.tolist())


def position_line(cells: KVCells) -> str:
    """Each cell's pos or '.', left-aligned in 5 (longer numbers unpadded); " *" after every 256 cells,
    a newline after every 64."""
    pos = cells.pos
    text = np.strings.ljust(np.where(pos >= 0, pos.astype(str), "."), 5)
    suffix = np.full(pos.size, "", dtype="<U3")
    suffix[63::64] = "\n"
    suffix[255::256] = " *\n"
    return "".join(np.strings.add(text, suffix).tolist())


def seq_min_max_lines(cells: KVCells, *, stream: int) -> list[str]:
    present = np.flatnonzero(cells.seq.any(axis=1))
    big = np.iinfo(np.int64).max
    p_min = np.where(cells.seq[present], cells.pos[None, :], big).min(axis=1)
    p_max = np.where(cells.seq[present], cells.pos[None, :], -1).max(axis=1)
    return [f"find_slot: stream[{stream}] min[{s}] = {lo:5d}, max[{s}] = {hi:5d}"
            for s, lo, hi in zip(present.tolist(), p_min.tolist(), p_max.tolist())]


def stream_dump(cells: KVCells, *, stream: int, head: int, size: int, n_swa: int, level: int) -> list[str]:
    """The messages find_slot logs for one unique seq whose stream holds `cells`."""
    msgs = [summary_line(cells, stream=stream, head=head, size=size, n_swa=n_swa)]
    if shows_cells(level, n_swa):
        msgs += ["\n" + cell_map(cells), "\n" + position_line(cells)]
        msgs += seq_min_max_lines(cells, stream=stream)
    return msgs
