"""The KQ mask of a ubatch, rebuilt from a CacheMirror: the bridge between the cells a view draws and
the attention the model computes.

The kernel builds one boolean mask per ubatch and cache (engine/kv/attention.py
UbatchAttention._build_mask, after llama.cpp's llama_kv_cache::set_input_kq_mask in
src/llama-kv-cache.cpp): a row per token of the ubatch, a column per cell 0..n_kv-1, True where the
token attends to the cell. A token attends to a cell when the cell holds the token's sequence at a
position no later than the token's and (a sliding-window cache) inside its window. Both the kernel
and this module call engine.kv.swa.attends, so the picture and the kernel cannot disagree.

- Rows: the ubatch's tokens of one stream, in the ubatch's order. A token of several sequences is
  masked as its LAST LISTED sequence (llama.cpp reads seq_id[...][last]).
- Columns: cells 0..n_kv-1, n_kv being the used cells padded as the kernel pads them
  (KVCache.n_kv: the highest used cell + 1 of the ubatch's streams, rounded up to the context's
  `pad`, at least one pad, at most the cache's size). The kernel builds the mask after the ubatch
  was placed, so each token's own cell (and those of the tokens before it in the ubatch) is there.

Two ways in:

- last_ubatch_mask(watcher, cache): the ubatch the watcher last saw placed for real (the latest
  CellsAllocated that is not a dry run's: the dry run's placements are rolled back), against the
  mirror's cells. Right after the decode that is the kernel's mask bit for bit. If cells of the
  cache changed since (a seq_rm, a shift, the next decode's K-shift), `changed_since` says what, and
  the mask is that ubatch's tokens against the cells as they are now.
  The events carry each cell's sequences as a set, not the order the batch listed them: a token of
  several sequences is taken as its highest one, which is the last listed when the batch lists them
  in ascending order (as llama.cpp's own examples do). ubatch_mask takes the listed order.
- ubatch_mask(mirror, cache, token_pos, token_seqs): a batch of your own against the current cells.
  Without token_cells the tokens are not placed: each row lacks the token's own cell and the cells
  of the ubatch's earlier tokens, which the kernel's row will hold (the watch layer does not run the
  slot search). With token_cells (free cells only) they are placed there first, as apply_ubatch
  would, and the mask is the kernel's for a slot search that chose those cells.

No torch here: engine.kv.swa is numpy only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine import events as ev
from engine.errors import KvscopeError
from engine.kv.swa import SwaType, attends, is_masked_swa
from engine.watch.mirror import CacheMirror


class MaskError(KvscopeError, ValueError):
    """A mask the mirror cannot build: no such cache or stream, or a token that cannot be placed as asked."""


class MaskCell(IntEnum):
    """Why a token attends to a cell or not; ATTENDED and OWN are the kernel's True."""

    EMPTY = 0  # no position: a hole (below the last used cell) or the padding after it
    OTHER = 1  # holds other sequences only
    LATER = 2  # holds the token's sequence at a later position (the causal part of the mask)
    WINDOW = 3  # holds the token's sequence, outside its sliding window
    ATTENDED = 4
    OWN = 5  # the token's own cell (always attended)


ROWS_DESCRIBED = 4  # describe() words the first two and last two tokens of a longer ubatch


@dataclass(frozen=True)
class UbatchMask:
    """One stream's KQ mask of a ubatch in one cache: its tokens x the cells 0..n_kv-1."""

    cache: str
    stream: int
    n_kv: int
    n_swa: int  # 0: full attention
    swa_type: SwaType
    token_pos: np.ndarray  # int64 [n_tokens]
    token_seqs: tuple[tuple[int, ...], ...]  # each token's sequences, the deciding one last
    token_cell: np.ndarray  # int64 [n_tokens]: the cell each token was placed in (-1: not placed)
    cell_pos: np.ndarray  # int64 [n_kv]: each cell's position (-1: empty)
    cell_seqs: tuple[tuple[int, ...], ...]  # [n_kv]: the sequences each cell holds, ascending
    allowed: np.ndarray  # bool [n_tokens, n_kv]: True = the token attends to the cell (the kernel's mask)
    codes: np.ndarray  # int8 [n_tokens, n_kv]: a MaskCell per token and cell
    ubatch: int = -1  # the ubatch's index in its decode (-1: a batch of your own, ubatch_mask)
    n_used: int = 0  # the highest used cell + 1 (of the ubatch's streams): cells from here on are padding
    pad: int = 1  # the context's padding of n_kv
    changed_since: tuple[str, ...] = field(default=())  # what changed the cells after the ubatch was placed
    stale: bool = False  # the mirror lost events: as stale as the mirror

    @property
    def n_tokens(self) -> int:
        return len(self.token_pos)

    @property
    def token_seq(self) -> np.ndarray:
        """int64 [n_tokens]: the sequence that decides each token's row (its last listed)."""
        return np.array([seqs[-1] for seqs in self.token_seqs], dtype=np.int64)

    @property
    def exact(self) -> bool:
        """True when this is the kernel's mask as it was built: nothing changed the cells since."""
        return not self.changed_since and not self.stale

    def row(self, k: int) -> np.ndarray:
        """bool [n_kv]: the cells token k attends to."""
        return self.allowed[k]

    def attended(self, k: int) -> np.ndarray:
        """The cells token k attends to (its own included), ascending."""
        return np.flatnonzero(self.allowed[k])

    def counts(self) -> np.ndarray:
        """int64 [n_tokens]: how many cells each token attends to."""
        return self.allowed.sum(axis=1).astype(np.int64)

    def cells(self, k: int, code: MaskCell) -> np.ndarray:
        """The cells of token k's row with this MaskCell."""
        return np.flatnonzero(self.codes[k] == code)

    def is_hole(self, cell: int) -> bool:
        """An empty cell below the last used one (a seq_rm left it, or the slot search skipped it)."""
        return 0 <= cell < self.n_used and self.cell_pos[cell] < 0

    def token_label(self, k: int) -> str:
        seqs = self.token_seqs[k]
        who = f"seq {seqs[0]}" if len(seqs) == 1 else "seqs " + ", ".join(map(str, seqs))
        return f"{who} · pos {int(self.token_pos[k])}"

    def cell_text(self, cell: int) -> str:
        """A cell in words: 'cell 4: pos 4 · seq 0', 'cell 5: empty (a hole)'."""
        pos, seqs = int(self.cell_pos[cell]), self.cell_seqs[cell]
        if pos < 0:
            return f"cell {cell}: empty ({'a hole' if self.is_hole(cell) else 'padding up to n_kv'})"
        return f"cell {cell}: pos {pos} · {seqs_text(seqs)}"

    def why(self, k: int, cell: int) -> str:
        """Why token k attends to the cell or not, in words."""
        code = MaskCell(int(self.codes[k, cell]))
        if code is MaskCell.EMPTY:
            return "masked: empty (a hole)" if self.is_hole(cell) else "masked: empty (padding up to n_kv)"
        if code is MaskCell.OTHER:
            return f"masked: holds {seqs_text(self.cell_seqs[cell])} only, not seq {self.token_seqs[k][-1]}"
        if code is MaskCell.LATER:
            return f"masked: pos {int(self.cell_pos[cell])} comes after the token's pos {int(self.token_pos[k])}"
        if code is MaskCell.WINDOW:
            return f"masked: outside the {self.window_text()}"
        return "attends: its own cell" if code is MaskCell.OWN else "attends"

    def window_text(self) -> str:
        kind = {SwaType.STANDARD: "sliding", SwaType.CHUNKED: "chunked", SwaType.SYMMETRIC: "symmetric"}
        return "full attention" if self.swa_type == SwaType.NONE else f"{kind[self.swa_type]} window of {self.n_swa}"

    def window_start(self, k: int) -> int | None:
        """The lowest position token k's window lets it see (None: full attention; symmetric windows
        also end at token pos + n_swa // 2)."""
        if self.swa_type == SwaType.NONE:
            return None
        p = int(self.token_pos[k])
        lows = np.arange(max(0, p - 4 * max(self.n_swa, 1)), p + 1)
        inside = lows[~is_masked_swa(self.n_swa, self.swa_type, lows, p)]
        return int(inside[0]) if inside.size else p

    def title(self) -> str:
        """One line: which ubatch, which cache, how wide."""
        which = "a batch of your own" if self.ubatch < 0 else f"ubatch {self.ubatch} of the last decode"
        stream = f", stream {self.stream}" if self.stream else ""
        return (f"{which} in cache {self.cache}{stream}: {self.n_tokens} token{'s' * (self.n_tokens != 1)} x "
                f"{self.n_kv} cells (n_kv: the {self.n_used} cells up to the last used one, padded to a multiple of "
                f"{self.pad}), {self.window_text()}")

    def describe_row(self, k: int) -> str:
        """Token k's row in words: which cells it sees and why it sees no other."""
        cell = int(self.token_cell[k])
        where = f" (cell {cell})" if cell >= 0 else " (not placed yet)"
        seen = self.cells(k, MaskCell.ATTENDED)
        n = int(self.allowed[k].sum())
        parts = []
        if seen.size:
            parts.append(f"{cells_word(seen)} {cell_ranges(seen)} (its own sequence, {self._positions_text(seen)})")
        if 0 <= cell < self.n_kv and self.codes[k, cell] == MaskCell.OWN:
            parts.append("its own cell")
        text = f"token of {self.token_label(k).replace(' · ', ' at ')}{where} sees {n} cell{'s' * (n != 1)}"
        text += (": " + " and ".join(parts)) if parts else ""
        holes = [c for c in self.cells(k, MaskCell.EMPTY) if self.is_hole(int(c))]
        notes = []
        if holes:
            notes.append(f"{cells_word(holes)} {cell_ranges(holes)} {verb(holes, 'be')} empty (a hole)")
        other = self.cells(k, MaskCell.OTHER)
        for seqs in sorted({self.cell_seqs[c] for c in other}):
            group = [c for c in other if self.cell_seqs[c] == seqs]
            notes.append(f"{cells_word(group)} {cell_ranges(group)} {verb(group, 'hold')} {seqs_text(seqs)} only")
        later = self.cells(k, MaskCell.LATER)
        if later.size:
            notes.append(f"{cells_word(later)} {cell_ranges(later)} {verb(later, 'hold')} its sequence at later "
                         f"positions")
        outside = self.cells(k, MaskCell.WINDOW)
        if outside.size:
            notes.append(f"{cells_word(outside)} {cell_ranges(outside)} {verb(outside, 'be')} outside its "
                         f"{self.window_text()}")
        return text + ("; " + "; ".join(notes) if notes else "")

    def describe(self) -> str:
        """Words a newcomer reads: the title, then a line per token (the first two and last two of a
        longer ubatch), and a warning when the cells changed since the ubatch was placed."""
        lines = [self.title()]
        ks = list(range(self.n_tokens))
        if len(ks) > ROWS_DESCRIBED:
            ks = ks[:ROWS_DESCRIBED // 2] + [None] + ks[-(ROWS_DESCRIBED // 2):]
        for k in ks:
            lines.append(f"  ... {self.n_tokens - ROWS_DESCRIBED} more tokens" if k is None
                         else "  " + self.describe_row(k))
        if self.changed_since:
            lines.append("  (the cells changed since it was placed: " + ", ".join(self.changed_since)
                         + "; these are its tokens against the cells as they are now)")
        if self.stale:
            lines.append("  (the watcher lost events: the cells may be out of date)")
        return "\n".join(lines)

    def _positions_text(self, cells: np.ndarray) -> str:
        pos = np.sort(self.cell_pos[cells])
        if pos.size == 1:
            return f"position {int(pos[0])}"
        if np.array_equal(pos, np.arange(pos[0], pos[0] + pos.size)):
            return f"positions {int(pos[0])}-{int(pos[-1])}"
        return f"positions {int(pos[0])} to {int(pos[-1])}, some missing"


def seqs_text(seqs: Sequence[int]) -> str:
    if not seqs:
        return "no sequence"
    return f"seq {seqs[0]}" if len(seqs) == 1 else "seqs " + ", ".join(map(str, seqs))


def cells_word(cells) -> str:
    return "cell" if len(cells) == 1 else "cells"


def verb(cells, infinitive: str) -> str:
    """The verb agreeing with a number of cells: 'holds' / 'hold', 'is' / 'are'."""
    one = len(cells) == 1
    return ("is" if one else "are") if infinitive == "be" else (infinitive + "s" if one else infinitive)


def cell_ranges(cells) -> str:
    """'0-4, 7, 9-10' for cells [0, 1, 2, 3, 4, 7, 9, 10]."""
    cells = sorted(int(c) for c in cells)
    out, start = [], None
    for i, c in enumerate(cells):
        if start is None:
            start = c
        if i + 1 == len(cells) or cells[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ", ".join(out)


# ---- building ---------------------------------------------------------------------------------------


def mask_codes(cell_pos: np.ndarray, holds: np.ndarray, token_pos: np.ndarray, token_cell: np.ndarray,
               n_swa: int, swa_type: SwaType) -> tuple[np.ndarray, np.ndarray]:
    """(allowed, codes): allowed is engine.kv.swa.attends, the kernel's rule; codes only say why.
    cell_pos [n_kv], holds [n_tokens, n_kv] (the cell holds the token's deciding sequence)."""
    tp = token_pos[:, None]
    allowed = attends(cell_pos[None, :], holds, tp, n_swa, swa_type)
    codes = np.where(cell_pos[None, :] >= 0, np.int8(MaskCell.OTHER), np.int8(MaskCell.EMPTY))
    codes = np.broadcast_to(codes, allowed.shape).copy()
    codes[holds & (cell_pos[None, :] >= 0)] = MaskCell.WINDOW
    codes[holds & (cell_pos[None, :] > tp)] = MaskCell.LATER
    codes[allowed] = MaskCell.ATTENDED
    rows = np.flatnonzero((token_cell >= 0) & (token_cell < len(cell_pos)))
    own = allowed[rows, token_cell[rows]]
    codes[rows[own], token_cell[rows[own]]] = MaskCell.OWN
    return allowed, codes


def padded_n_kv(n_used: int, pad: int, size: int) -> int:
    """KVCache.n_kv: the used span rounded up to the padding, at least one pad, at most the cache."""
    padded = (n_used + pad - 1) // pad * pad
    return min(size, max(pad, padded))


def used_max_p1(pos: np.ndarray) -> int:
    nz = np.flatnonzero(pos >= 0)
    return int(nz[-1]) + 1 if nz.size else 0


def _build(mirror: CacheMirror, cache: str, stream: int, pos: np.ndarray, seq_bits: np.ndarray,
           token_pos: np.ndarray, token_seqs: tuple[tuple[int, ...], ...], token_cell: np.ndarray,
           n_kv: int, n_used: int, **extra) -> UbatchMask:
    created = mirror.created[cache]
    swa_type = SwaType(created.swa_type)
    deciding = np.array([seqs[-1] for seqs in token_seqs], dtype=np.int64)
    bits = seq_bits[:n_kv]
    holds = ((bits[:, deciding >> 3] >> (deciding & 7).astype(np.uint8)) & 1).astype(bool).T  # [n_tokens, n_kv]
    cell_pos = np.asarray(pos[:n_kv], dtype=np.int64).copy()
    allowed, codes = mask_codes(cell_pos, holds.reshape(len(deciding), n_kv), token_pos, token_cell,
                                created.n_swa, swa_type)
    matrix = ev.unpack_seq_bits(bits)  # (MAX_SEQ, n_kv)
    cell_seqs = [[] for _ in range(n_kv)]
    for s, c in zip(*np.nonzero(matrix)):
        cell_seqs[c].append(int(s))
    return UbatchMask(cache, stream, n_kv, created.n_swa, swa_type, _read_only(token_pos.copy()), token_seqs,
                      _read_only(token_cell.copy()), _read_only(cell_pos), tuple(tuple(s) for s in cell_seqs),
                      _read_only(allowed), _read_only(codes), n_used=n_used, pad=created.pad, stale=mirror.stale,
                      **extra)


def _check(mirror: CacheMirror, cache: str, stream: int):
    if cache not in mirror.caches:
        known = ", ".join(sorted(mirror.caches)) or "none yet"
        raise MaskError(f"no cache named {cache!r} (the caches: {known})")
    streams = mirror.caches[cache].streams
    if not 0 <= stream < len(streams):
        raise MaskError(f"cache {cache!r} has {len(streams)} stream(s), not stream {stream}")
    return streams[stream]


def ubatch_mask(mirror: CacheMirror, cache: str, token_pos: Sequence[int], token_seqs: Sequence, *,
                stream: int = 0, n_kv: int | None = None, token_cells: Sequence[int] | None = None) -> UbatchMask:
    """The KQ mask a ubatch of your own would get against the mirror's current cells of one stream.
    token_seqs: per token, a sequence id or the list of its ids as the batch lists them (the last one
    decides). token_cells: the (free) cells the tokens would be placed in; None: not placed, so each row
    lacks the token's own cell and those of the earlier tokens of the ubatch. n_kv: the mask's width
    (default: the used cells, after placing, padded as the kernel pads)."""
    token_pos = np.asarray(token_pos, dtype=np.int64).reshape(-1)
    seqs = tuple(tuple(int(s) for s in ((ids,) if np.isscalar(ids) else ids)) for ids in token_seqs)
    if len(seqs) != len(token_pos) or any(not s for s in seqs):
        raise MaskError("give one position and at least one sequence per token")
    with mirror._lock:
        st = _check(mirror, cache, stream)
        pos, seq_bits = st.pos.copy(), st.seq_bits.copy()
        cells = np.full(len(token_pos), -1, dtype=np.int64)
        if token_cells is not None:
            cells = np.asarray(token_cells, dtype=np.int64).reshape(-1)
            if len(cells) != len(token_pos) or len(set(cells.tolist())) != len(cells):
                raise MaskError("give one distinct cell per token")
            if np.any((cells < 0) | (cells >= len(pos))) or np.any(pos[cells] >= 0):
                raise MaskError(f"token_cells must be free cells of the stream (0..{len(pos) - 1}, empty)")
            pos[cells] = token_pos
            for c, ids in zip(cells.tolist(), seqs):
                for s in ids:
                    seq_bits[c, s >> 3] |= np.uint8(1 << (s & 7))
        n_used = used_max_p1(pos)
        width = padded_n_kv(n_used, mirror.created[cache].pad, len(pos)) if n_kv is None else int(n_kv)
        return _build(mirror, cache, stream, pos, seq_bits, token_pos, seqs, cells, width, n_used)


# ---- the last ubatch a watcher saw ---------------------------------------------------------------------


def last_allocation(watcher, cache: str) -> tuple[ev.CellsAllocated, tuple[str, ...]] | None:
    """The latest real (not dry-run) CellsAllocated of `cache` among the watcher's recent events, and what
    changed that cache's cells after it (the ubatch's own SWA purge aside); None when there is none."""
    changes: list[str] = []
    for event in reversed(watcher.recent):
        if isinstance(event, ev.ContextCreated) and event.cache == cache:
            return None  # the cache was rebuilt since
        if not isinstance(event, ev.CellsChanged) or event.cache != cache:
            continue
        if isinstance(event, ev.CellsAllocated) and not event.tentative:
            # the purge apply_ubatch does right after placing (an SWA cache) is part of the ubatch's state
            while changes and changes[-1] == "purge":
                changes.pop()
            return event, tuple(dict.fromkeys(reversed(changes)))
        if event.tentative and not event.quirk or isinstance(event, ev.SlotsRolledBack):
            continue  # a dry run's placements, undone by its roll-back
        changes.append(_change_word(event))
    return None


def _change_word(event: ev.CellsChanged) -> str:
    if isinstance(event, ev.CellsRemoved):
        if event.tentative:
            return "the dry run's SWA purge"
        return event.reason if event.reason == "purge" else event.cause or event.reason
    if isinstance(event, ev.CellsShifted):
        return f"seq_{event.op}"
    if isinstance(event, ev.CellsCopied):
        return "seq_cp"
    if isinstance(event, ev.KShiftApplied):
        return "K-shift"
    if isinstance(event, ev.MemorySnapshot):
        return "a snapshot"
    return event.cause or type(event).__name__


def last_ubatch_masks(watcher, cache: str) -> list[UbatchMask]:
    """The last ubatch the watcher saw placed in `cache`, one UbatchMask per stream it touched (one,
    unless streams are split); empty when none was placed since the cache was created. Reads the
    watcher's mirror as it is: poll the watcher first."""
    found = last_allocation(watcher, cache)
    if found is None:
        return []
    event, changed = found
    mirror = watcher.mirror
    with mirror._lock:
        if cache not in mirror.caches:
            return []
        streams = mirror.caches[cache].streams
        n_used = max(used_max_p1(streams[c.stream].pos) for c in event.changes)
        n_kv = padded_n_kv(n_used, mirror.created[cache].pad, mirror.caches[cache].size)
        out = []
        for change in event.changes:
            st = streams[change.stream]
            # the event's seq bits are the cell's sequences right after placing: the token's own, as a set
            token_seqs = tuple(tuple(sorted(s)) for s in change.seq_sets())
            out.append(_build(mirror, cache, change.stream, st.pos, st.seq_bits,
                              np.asarray(change.pos, dtype=np.int64), token_seqs,
                              np.asarray(change.cells, dtype=np.int64), n_kv, n_used,
                              ubatch=event.ubatch, changed_since=changed))
        return out


def last_decode_masks(watcher, cache: str, stream: int | None = None) -> list[UbatchMask]:
    """Every ubatch of the last decode the watcher saw in `cache`, in order, in one stream (None: the first
    each ubatch touched): what notebook 2 steps through. The kernel built ubatch k's mask before the later
    ubatches were placed; a cache without a sliding window places a ubatch in free cells only, so that
    state is the current one with the later ubatches' cells emptied, exactly. A sliding-window cache may
    have placed a later ubatch over cells it reused, which no event restores: only the last ubatch is
    given there (last_ubatch_mask)."""
    found = last_allocation(watcher, cache)
    if found is None:
        return []
    last, changed = found
    mirror = watcher.mirror
    created = mirror.created.get(cache)
    if created is None or cache not in mirror.caches:
        return []
    if SwaType(created.swa_type) != SwaType.NONE:
        mask = last_ubatch_mask(watcher, cache, stream)
        return [] if mask is None else [mask]
    ubatches = [last]
    if last.ubatch > 0:
        events = list(watcher.recent)
        at = next(i for i in range(len(events) - 1, -1, -1) if events[i] is last)
        for event in reversed(events[:at]):
            if isinstance(event, ev.CellsAllocated) and event.cache == cache and not event.tentative:
                if event.ubatch != ubatches[-1].ubatch - 1:
                    break  # not this decode's (the recent events no longer hold its first ubatches)
                ubatches.append(event)
                if event.ubatch == 0:
                    break
    ubatches.reverse()
    out = []
    with mirror._lock:
        cache_state = mirror.caches[cache]
        streams = [(st.pos.copy(), st.seq_bits.copy()) for st in cache_state.streams]
        for event in reversed(ubatches):  # the last first: empty each ubatch's cells once its mask is built
            n_used = max(used_max_p1(streams[c.stream][0]) for c in event.changes)
            n_kv = padded_n_kv(n_used, created.pad, cache_state.size)
            for change in event.changes:
                if stream is None and change is not event.changes[0] or stream not in (None, change.stream):
                    continue
                pos, seq_bits = streams[change.stream]
                token_seqs = tuple(tuple(sorted(s)) for s in change.seq_sets())
                out.append(_build(mirror, cache, change.stream, pos.copy(), seq_bits.copy(),
                                  np.asarray(change.pos, dtype=np.int64), token_seqs,
                                  np.asarray(change.cells, dtype=np.int64), n_kv, n_used, ubatch=event.ubatch,
                                  changed_since=changed))
            for change in event.changes:
                pos, seq_bits = streams[change.stream]
                pos[change.cells] = -1
                seq_bits[change.cells] = 0
    return out[::-1]


def last_ubatch_mask(watcher, cache: str, stream: int | None = None) -> UbatchMask | None:
    """The last ubatch the watcher saw placed in `cache`, in one stream (None: the first it touched);
    None when no ubatch was placed there (or not in that stream)."""
    for mask in last_ubatch_masks(watcher, cache):
        if stream is None or mask.stream == stream:
            return mask
    return None


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr
