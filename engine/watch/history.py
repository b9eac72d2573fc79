"""Why is this cell here: the last few events that touched each cell, and a one-line story of them.

    allocated at step 12 for seq 2 (client 1, request 5), token ' the', pos 41; shifted -64 by the
    context shift of seq 2 at step 80

Kept as columns (one array per field, one row per cell, `depth` entries per cell in a ring), so that an
event touching thousands of cells is a few numpy assignments, never a Python loop over cells. Dry-run
changes are not history (they are undone at once), except the SWA purge of a dry run, which llama.cpp
does not undo. Token text comes from the Vocabulary event (no tokenizer needed); the request a sequence
serves from SequenceAssigned; the step from DecodeStarted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import events as ev

ALLOCATED, SEQ_REMOVED, FREED, SHARED, SHIFTED, DIVIDED, KEYS_ROTATED, RESTORED = range(1, 9)
_FIELDS = ("kind", "seq_no", "step", "in_decode", "seq", "token", "pos", "amount", "why")


@dataclass(frozen=True)
class HistoryEntry:
    """One event's effect on one cell."""

    kind: int  # ALLOCATED, SEQ_REMOVED, ...
    seq_no: int  # the event's number on the bus
    step: int  # the decode step it happened in or after (-1: before the first decode)
    in_decode: int  # 1: during that step's decode; 0: after it (a command, a workload's operation)
    seq: int  # the sequence it concerns (-1: all)
    token: int  # ALLOCATED: the token placed; else -1
    pos: int  # the cell's position after the event (-1: empty)
    amount: int  # SHIFTED / KEYS_ROTATED: the delta; DIVIDED: the divisor
    why: str  # the cause, else the operation (seq_rm, purge, failure_cleanup, ...)


class _StreamColumns:
    """The ring of entries of every cell of one stream: one int64 row per entry, a field per column."""

    def __init__(self, size: int, depth: int) -> None:
        self.depth = depth
        self.count = np.zeros(size, dtype=np.int64)  # entries ever written per cell
        self.data = np.full((size, depth, len(_FIELDS)), -1, dtype=np.int64)

    def write(self, cells: np.ndarray, **values) -> None:
        rows = np.empty((len(cells), len(_FIELDS)), dtype=np.int64)
        for i, name in enumerate(_FIELDS):  # small slices, then one scattered write
            rows[:, i] = values[name]
        self.data[cells, self.count[cells] % self.depth] = rows
        self.count[cells] += 1

    def entries(self, cell: int) -> list[dict]:
        n = int(self.count[cell])
        slots = [(n - k) % self.depth for k in range(min(n, self.depth), 0, -1)]  # oldest first
        return [dict(zip(_FIELDS, self.data[cell, s].tolist())) for s in slots]


class CellHistory:
    """The last `depth` events of every cell of every cache, built from events only."""

    def __init__(self, depth: int = 8) -> None:
        self.depth = depth
        self.step = -1  # the current decode step (DecodeStarted.step)
        self.in_decode = False  # between a DecodeStarted and its DecodeFinished
        self.pieces: tuple[str, ...] = ()  # token text by id (Vocabulary)
        self.requests: dict[int, str] = {}  # seq id -> what it serves (SequenceAssigned)
        self._streams: dict[tuple[str, int], _StreamColumns] = {}
        self._sizes: dict[str, int] = {}
        self._why: list[str] = []  # interned cause texts: columns hold indices
        self._why_index: dict[str, int] = {}

    # ---- feeding ------------------------------------------------------------------------------
    def apply(self, event: ev.Event) -> None:
        if isinstance(event, ev.CellsChanged):
            self._apply_cells(event)
        elif isinstance(event, ev.DecodeStarted):
            self.step, self.in_decode = event.step, True
        elif isinstance(event, ev.DecodeFinished):
            self.in_decode = False
        elif isinstance(event, ev.ContextCreated):
            self._sizes[event.cache] = event.kv_size
            for key in [k for k in self._streams if k[0] == event.cache]:
                del self._streams[key]  # a new context: its cells have no past
        elif isinstance(event, ev.Vocabulary):
            self.pieces = event.pieces
        elif isinstance(event, ev.SequenceAssigned):
            self.requests[event.seq_id] = event.request

    def _apply_cells(self, event: ev.CellsChanged) -> None:
        kind = _kind_of(event)
        if kind is None:
            return
        why = self._intern(event.cause or _operation(event))
        for k, change in enumerate(event.changes):
            columns = self._columns(event.cache, change.stream)
            if columns is None:
                continue
            cells = change.cells
            values = dict(kind=kind, seq_no=event.seq_no, step=self.step, in_decode=int(self.in_decode), seq=-1,
                          token=-1, pos=change.pos, amount=0, why=why)
            if isinstance(event, ev.CellsAllocated):
                values["seq"] = _first_seq(change.seq_bits)
                values["token"] = event.tokens[k] if k < len(event.tokens) else -1
            elif isinstance(event, ev.CellsRemoved):
                values["kind"] = np.where(change.pos < 0, FREED, SEQ_REMOVED)
                values["seq"] = event.seq_id
            elif isinstance(event, ev.CellsCopied):
                values["seq"] = event.dst_seq
            elif isinstance(event, ev.CellsShifted):
                values["seq"], values["amount"] = event.seq_id, event.amount
            elif isinstance(event, ev.KShiftApplied):
                values["amount"] = event.amounts[k] if k < len(event.amounts) else 0
            columns.write(cells, **values)

    def _columns(self, cache: str, stream: int) -> _StreamColumns | None:
        key = (cache, stream)
        if key not in self._streams:
            size = self._sizes.get(cache)
            if size is None:
                return None  # joined before the cache's ContextCreated: nothing to attach cells to
            self._streams[key] = _StreamColumns(size, self.depth)
        return self._streams[key]

    def _intern(self, text: str) -> int:
        if text not in self._why_index:
            self._why_index[text] = len(self._why)
            self._why.append(text)
        return self._why_index[text]

    # ---- reading ------------------------------------------------------------------------------
    def entries(self, cache: str, stream: int, cell: int) -> list[HistoryEntry]:
        """The cell's remembered events, oldest first."""
        columns = self._streams.get((cache, stream))
        if columns is None:
            return []
        return [HistoryEntry(**{**e, "why": self._why[e["why"]] if e["why"] >= 0 else ""})
                for e in columns.entries(cell)]

    def explain(self, cache: str, stream: int, cell: int) -> str:
        """One line: what happened to the cell, oldest remembered event first."""
        entries = self.entries(cache, stream, cell)
        if not entries:
            return "no event touched this cell since the watch began"
        return "; ".join(self._describe(e) for e in entries)

    def _describe(self, e: HistoryEntry) -> str:
        when = (f"at step {e.step}" if e.in_decode else f"after step {e.step}") if e.step >= 0 else \
            "before the first decode"
        by = f" by {e.why}" if e.why else ""
        if e.kind == ALLOCATED:
            return f"allocated {when} for seq {e.seq}{self._request(e.seq)}, token {self._token(e.token)}, pos {e.pos}"
        if e.kind == SEQ_REMOVED:
            return f"seq {e.seq} removed{by} {when}"
        if e.kind == FREED:
            return f"freed{by} {when}"
        if e.kind == SHARED:
            return f"shared with seq {e.seq}{by} {when}"
        if e.kind == SHIFTED:
            return f"shifted {e.amount:+d} to pos {e.pos}{by} {when}"
        if e.kind == DIVIDED:
            return f"position divided by {e.amount} to {e.pos}{by} {when}"
        if e.kind == KEYS_ROTATED:
            return f"keys re-rotated by {e.amount:+d} (K-shift) {when}"
        return f"restored (pos {e.pos}){by} {when}"

    def _request(self, seq: int) -> str:
        request = self.requests.get(seq)
        return f" ({request})" if request else ""

    def _token(self, token: int) -> str:
        if 0 <= token < len(self.pieces):
            return repr(self.pieces[token])
        return f"#{token}"


def _kind_of(event: ev.CellsChanged) -> int | None:
    """The entry kind an event writes, or None when it is not history (a dry run and its undoing, a
    resync snapshot)."""
    if isinstance(event, ev.CellsRemoved):
        return SEQ_REMOVED if (not event.tentative or event.quirk) else None
    if event.tentative or isinstance(event, ev.SlotsRolledBack):
        return None
    if isinstance(event, ev.MemorySnapshot):
        return RESTORED if event.cause else None  # a snapshot with a cause: cells written by a state load
    if isinstance(event, ev.CellsShifted):
        return DIVIDED if event.op == "div" else SHIFTED
    return {ev.CellsAllocated: ALLOCATED, ev.CellsCopied: SHARED, ev.KShiftApplied: KEYS_ROTATED}.get(type(event))


def _operation(event: ev.CellsChanged) -> str:
    if isinstance(event, ev.CellsRemoved):
        return {"purge": "the SWA purge", "failure_cleanup": "a failed decode's cleanup"}.get(event.reason,
                                                                                             event.reason)
    if isinstance(event, ev.CellsShifted):
        return f"seq_{event.op}"
    if isinstance(event, ev.CellsCopied):
        return "seq_cp"
    return ""


def _first_seq(seq_bits: np.ndarray) -> np.ndarray:
    """The lowest sequence id of each placed cell (a placed cell holds at least one)."""
    return np.unpackbits(seq_bits, axis=1, bitorder="little").argmax(axis=1)
