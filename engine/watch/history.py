"""Why is this cell here: the last few events that touched each cell, and a one-line story of them.

    allocated in decode 12 for seq 2 (client 1, request 5), token ' the', pos 41; shifted -64 by the
    context shift of seq 2 after decode 80

A real llama.cpp read from its log (CellsSeen) gives each cell what its dumps showed, and why where a line
said so: "pos 41, seq 0: seen at the slot search of ubatch 12".

Decodes are counted as the context counts them (DecodeStarted.step: every llama_decode call, the system
prompt's and a retried batch's too), not as a workload counts its steps.

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

ALLOCATED, SEQ_REMOVED, FREED, SHARED, SHIFTED, DIVIDED, KEYS_ROTATED, RESTORED, SEEN = range(1, 10)
SEVERAL_SEQS = -2  # the seq of a SEEN entry of a cell several sequences hold
_FIELDS = ("kind", "step", "in_decode", "seq", "token", "pos", "amount", "why")  # int32 columns; seq_no apart


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


class _CacheColumns:
    """The ring of entries of every cell of every stream of one cache. A cell of stream s is row
    s * size + cell. Events are queued as they come (a few list appends each) and written in one
    vectorised step when someone reads, or when enough have queued: the watch layer absorbs events at
    the engine's pace, and history is read only when a person moves a cursor."""

    # Queued events that trigger a write. The queue holds whole events (their arrays included), so this bounds
    # what a watcher keeps alive besides its `recent` events: at 4096 a live watcher of an iSWA context held up
    # to 8192 events (~10 MiB) and let go of them at once, a saw whose peaks kept pymalloc's arenas and the
    # threads' glibc arenas growing in bench/soak.py (~1 MiB a minute). A write costs the same per event at 256
    # (bench/watch.py's events, writes included: ~70k events/s either way).
    FLUSH_AT = 256

    def __init__(self, n_stream: int, size: int, depth: int) -> None:
        self.size, self.depth = size, depth
        self.count = np.zeros(n_stream * size, dtype=np.int64)  # entries ever written per cell
        self.data = np.full((n_stream * size, depth, len(_FIELDS)), -1, dtype=np.int32)
        self.seq_no = np.full((n_stream * size, depth), -1, dtype=np.int64)
        self._queued: list[tuple] = []  # (event, kind, step, in_decode, why)

    def queue(self, entry: tuple) -> None:
        self._queued.append(entry)
        if len(self._queued) >= self.FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        rows, seq_no, values = _entry_rows(queued, self.size)
        if not len(rows):
            return  # events whose changes name no cell (a K-shift's unshifted streams)
        # the last `depth` entries of each cell in this batch, each in the slot after the previous one
        order = np.argsort(rows, kind="stable")
        rows, seq_no, values = rows[order], seq_no[order], values[order]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        lengths = np.diff(np.r_[starts, len(rows)])
        rank = np.arange(len(rows)) - np.repeat(starts, lengths)
        keep = rank >= np.repeat(lengths, lengths) - self.depth
        slot = (self.count[rows] + rank) % self.depth
        self.data[rows[keep], slot[keep]] = values[keep]
        self.seq_no[rows[keep], slot[keep]] = seq_no[keep]
        self.count[rows[starts]] += lengths

    def entries(self, stream: int, cell: int) -> list[dict]:
        self.flush()
        row = stream * self.size + cell
        n = int(self.count[row])
        slots = [(n - k) % self.depth for k in range(min(n, self.depth), 0, -1)]  # oldest first
        return [{"seq_no": int(self.seq_no[row, s]), **dict(zip(_FIELDS, self.data[row, s].tolist()))} for s in slots]


def _entry_rows(queued: list[tuple], size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows, event numbers and field values of queued events, one row per touched cell, in order."""
    cells, streams, lengths, pos, tokens, bits, alloc_rows = [], [], [], [], [], [], []
    scalars = []  # per event: kind, step, in_decode, seq, amount, why, seq_no
    n_rows = 0
    for event, kind, step, in_decode, why in queued:
        n_event = 0
        for k, change in enumerate(event.changes):
            n = len(change.cells)
            cells.append(change.cells)
            streams.append(np.full(n, change.stream * size, dtype=np.int64))
            pos.append(change.pos)
            n_event += n
            if kind == ALLOCATED or kind == SEEN:
                bits.append(change.seq_bits)
                tokens.append(event.tokens[k] if kind == ALLOCATED and len(event.tokens) == len(event.changes)
                              else np.full(n, -1))
                alloc_rows.append(np.arange(n_rows, n_rows + n))
            n_rows += n
        seq, amount = _seq_and_amount(event)
        scalars.append((kind, step, in_decode, seq, amount, why, event.seq_no))
        lengths.append(n_event)
    rows = np.concatenate(cells).astype(np.int64) + np.concatenate(streams)
    per_event = np.array(scalars, dtype=np.int64)
    expanded = np.repeat(per_event, lengths, axis=0)
    values = np.empty((n_rows, len(_FIELDS)), dtype=np.int32)
    values[:, 0], values[:, 1], values[:, 2] = expanded[:, 0], expanded[:, 1], expanded[:, 2]
    values[:, 3], values[:, 4], values[:, 6], values[:, 7] = expanded[:, 3], -1, expanded[:, 4], expanded[:, 5]
    values[:, 5] = np.concatenate(pos)
    removed = values[:, 0] == SEQ_REMOVED
    values[removed & (values[:, 5] < 0), 0] = FREED
    amounts = [e for e in queued if isinstance(e[0], ev.KShiftApplied)]
    if amounts:  # the K-shift's amount differs per cell
        values[values[:, 0] == KEYS_ROTATED, 6] = np.concatenate(
            [a for e, *_ in amounts for a in (e.amounts if len(e.amounts) == len(e.changes)
                                              else [np.zeros(len(c.cells)) for c in e.changes])])
    if alloc_rows:
        at = np.concatenate(alloc_rows)
        held = np.concatenate(bits)
        values[at, 3] = _first_seq(held)
        values[at, 4] = np.concatenate(tokens)
        seen = values[at, 0] == SEEN  # a log's cell: empty, or held by several sequences
        counts = ev.seq_counts(held)
        values[at[seen & (counts == 0)], 3] = -1
        values[at[seen & (counts > 1)], 3] = SEVERAL_SEQS
    return rows, expanded[:, 6], values


def _seq_and_amount(event: ev.CellsChanged) -> tuple[int, int]:
    if isinstance(event, ev.CellsRemoved):
        return event.seq_id, 0
    if isinstance(event, ev.CellsCopied):
        return event.dst_seq, 0
    if isinstance(event, ev.CellsShifted):
        return event.seq_id, event.amount
    return -1, 0


class CellHistory:
    """The last `depth` events of every cell of every cache, built from events only."""

    KEPT_REQUESTS = 256  # per sequence; a cell's ring of `depth` entries rarely spans more jobs than this
    WHY_COMPACT_AT = 4096  # interned cause texts that trigger dropping those no cell refers to any more

    def __init__(self, depth: int = 8) -> None:
        self.depth = depth
        self.step = -1  # the current decode step (DecodeStarted.step)
        self.in_decode = False  # between a DecodeStarted and its DecodeFinished
        self.pieces: tuple[str, ...] = ()  # token text by id (Vocabulary)
        self.requests: dict[int, list[tuple[int, str]]] = {}  # seq id -> (seq_no, job) of every SequenceAssigned
        self._caches: dict[str, _CacheColumns] = {}
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
            self._caches[event.cache] = _CacheColumns(event.n_stream, event.kv_size, self.depth)  # no past yet
        elif isinstance(event, ev.Vocabulary):
            self.pieces = event.pieces
        elif isinstance(event, ev.SequenceAssigned):
            jobs = self.requests.setdefault(event.seq_id, [])
            jobs.append((event.seq_no, event.request))
            if len(jobs) > 2 * self.KEPT_REQUESTS:  # a server reuses a sequence for ever: keep the recent jobs
                del jobs[:-self.KEPT_REQUESTS]

    def _apply_cells(self, event: ev.CellsChanged) -> None:
        kind = _kind_of(event)
        columns = self._caches.get(event.cache)
        if kind is None or columns is None or not event.changes:
            return  # not history, or joined before the cache's ContextCreated: no cells to attach it to
        columns.queue((event, kind, self.step, int(self.in_decode), self._intern(event.cause or _operation(event))))

    def _intern(self, text: str) -> int:
        if text not in self._why_index:
            if len(self._why) >= self.WHY_COMPACT_AT:
                self._compact_why()
            self._why_index[text] = len(self._why)
            self._why.append(text)
        return self._why_index[text]

    def _compact_why(self) -> None:
        """Causes name requests and steps, so a long run makes new ones for ever; only those still in
        some cell's ring are kept, and the columns renumbered to match."""
        for columns in self._caches.values():
            columns.flush()
        refs = [c.data[..., 7].ravel() for c in self._caches.values()]
        used = np.unique(np.concatenate(refs)) if refs else np.empty(0, dtype=np.int32)
        used = used[used >= 0]
        renumber = np.full(len(self._why) + 1, -1, dtype=np.int32)  # index -1 reads the last slot: stays -1
        renumber[used] = np.arange(len(used), dtype=np.int32)
        for columns in self._caches.values():
            columns.data[..., 7] = renumber[columns.data[..., 7]]
        self._why = [self._why[i] for i in used.tolist()]
        self._why_index = {text: i for i, text in enumerate(self._why)}

    # ---- reading ------------------------------------------------------------------------------
    def entries(self, cache: str, stream: int, cell: int) -> list[HistoryEntry]:
        """The cell's remembered events, oldest first."""
        columns = self._caches.get(cache)
        if columns is None:
            return []
        return [HistoryEntry(**{**e, "why": self._why[e["why"]] if e["why"] >= 0 else ""})
                for e in columns.entries(stream, cell)]

    def explain(self, cache: str, stream: int, cell: int) -> str:
        """One line: what happened to the cell, oldest remembered event first."""
        entries = self.entries(cache, stream, cell)
        if not entries:
            return "no event touched this cell since the watch began"
        return "; ".join(self._describe(e) for e in entries)

    def lines(self, cache: str, stream: int, cell: int) -> list[str]:
        """The cell's remembered events, newest first, one line each (what a view shows when it has little
        room: the latest first). Copies of the cell to several sequences by one operation are one line."""
        groups: list[list[HistoryEntry]] = []
        for e in self.entries(cache, stream, cell):
            last = groups[-1][-1] if groups else None
            if last is not None and e.kind == last.kind == SHARED and (e.why, e.step, e.in_decode) == \
                    (last.why, last.step, last.in_decode):
                groups[-1].append(e)
            else:
                groups.append([e])
        return [self._describe(g[0]) if len(g) == 1 else self._describe_shared(g) for g in reversed(groups)]

    def _describe_shared(self, group: list[HistoryEntry]) -> str:
        e = group[0]
        seqs = ", ".join(str(g.seq) for g in group)
        return self._describe(e).replace(f"shared with seq {e.seq}", f"shared with seqs {seqs}", 1)

    def _describe(self, e: HistoryEntry) -> str:
        when = (f"in decode {e.step}" if e.in_decode else f"after decode {e.step}") if e.step >= 0 else \
            "before the first decode"
        by = f" by {e.why}" if e.why else ""
        if e.kind == ALLOCATED:
            return (f"allocated {when} for seq {e.seq}{self._request(e.seq, e.seq_no)}, token {self._token(e.token)}, "
                    f"pos {e.pos}")
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
        if e.kind == SEEN:  # a llama.cpp log's dump: no decode steps, the cause says when
            held = "empty" if e.pos == -1 else "pos " + ("?" if e.pos == ev.POS_UNKNOWN else str(e.pos)) + (
                ", several seqs" if e.seq == SEVERAL_SEQS else f", seq {e.seq}")
            return f"{held}: {e.why}"
        return f"restored (pos {e.pos}){by} {when}"

    def _request(self, seq: int, seq_no: int) -> str:
        """The job the sequence served when event seq_no happened: its last assignment before it."""
        jobs = [job for at, job in self.requests.get(seq, ()) if at <= seq_no]
        return f" ({jobs[-1]})" if jobs else ""

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
    return {ev.CellsAllocated: ALLOCATED, ev.CellsCopied: SHARED, ev.KShiftApplied: KEYS_ROTATED,
            ev.CellsSeen: SEEN}.get(type(event))


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

