"""A slot-search dump of llama.cpp's log (`LLAMA_KV_CACHE_DEBUG`), read back into cells.

`llama_kv_cache::find_slot` (src/llama-kv-cache.cpp) prints, for each sequence of the ubatch, the state of
its stream before the ubatch is placed: a summary (n, used, head, size, n_swa); from level 3 (level 2 on a
sliding-window cache) the cell map, one label per cell ('.' empty, 'M' several sequences, else the
sequence id), 256 to a row ending in " *"; every cell's position, '%-5d' or '.', 64 to a row; and each
present sequence's min and max position. kvscope writes the same text (engine/kv/slot_debug.py).

What the text leaves open is kept open: an 'M' cell's sequences are only those whose min..max covers its
position (known when two are left); a map with sequence ids of different lengths ("1", "12") is split with
the help of the positions (an empty cell prints '.' in both rows) and of the present sequences, and a part
that still reads two ways is marked uncertain; a position row that cannot be read (a position of six digits
runs into the next, '%-5d' leaves no space) leaves its held cells at POS_UNKNOWN.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from engine.events import POS_UNKNOWN, SEQ_BITS_BYTES, SEQS_READ_TWO_WAYS, SEQS_SHARED_UNNAMED

SUMMARY = re.compile(r"find_slot: stream\[(\d+)\], n = +(-?\d+), used = +(\d+), head = +(\d+), size = +(\d+), "
                     r"n_swa = +(-?\d+)\s*$")
MIN_MAX = re.compile(r"find_slot: stream\[(\d+)\] min\[(\d+)\] = +(-?\d+), max\[(\d+)\] = +(-?\d+)\s*$")
MAP_TOKEN = re.compile(r"\.|M|\d+")
CELLS_PER_MAP_ROW = 256
CELLS_PER_POS_ROW = 64
POS_WIDTH = 5
EMPTY, SHARED = ord("."), ord("M")
POS_BYTES = np.zeros(256, dtype=bool)  # what a position row may hold, by byte
POS_BYTES[np.frombuffer(b".0123456789 ", dtype=np.uint8)] = True
MAP_BYTES = np.zeros(256, dtype=bool)
MAP_BYTES[np.frombuffer(b".M0123456789", dtype=np.uint8)] = True


@dataclass
class RawDump:
    """The lines of one dump as they came, before decoding."""

    stream: int
    n: int
    used: int
    head: int
    size: int
    n_swa: int
    map_rows: list[str] = field(default_factory=list)
    pos_rows: list[str] = field(default_factory=list)
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq -> (min, max)

    @property
    def map_rows_expected(self) -> int:
        return -(-self.size // CELLS_PER_MAP_ROW)

    @property
    def pos_rows_expected(self) -> int:
        return -(-self.size // CELLS_PER_POS_ROW)

    @property
    def has_cells(self) -> bool:
        return len(self.map_rows) == self.map_rows_expected and len(self.pos_rows) == self.pos_rows_expected

    @property
    def wants_map(self) -> bool:
        return len(self.map_rows) < self.map_rows_expected

    @property
    def wants_pos(self) -> bool:
        return not self.wants_map and len(self.pos_rows) < self.pos_rows_expected


@dataclass
class StreamPicture:
    """One stream as a dump showed it."""

    pos: np.ndarray  # int64 (size,): -1 empty, POS_UNKNOWN held at a position not read
    seq_bits: np.ndarray  # uint8 (size, 32)
    uncertain: np.ndarray  # uint8 (size,): 0, or how seq_bits are only the sequences that may hold it (events.SEQS_*)
    head: int
    used: int


class DumpError(ValueError):
    """A dump whose parts do not agree (a damaged log): it is skipped and counted."""


def decode(raw: RawDump) -> StreamPicture:
    size = raw.size
    pos = _positions(raw)
    held = pos != -1
    seq_bits = np.zeros((size, SEQ_BITS_BYTES), dtype=np.uint8)
    uncertain = np.zeros(size, dtype=np.uint8)
    map_text = "".join(_row_body(r) for r in raw.map_rows)
    present = sorted(raw.ranges)
    if len(map_text) == size:
        _single_chars(map_text, held, seq_bits, uncertain, pos, raw)
    else:
        _mixed_widths(raw, held, seq_bits, uncertain, pos, present)
    used = int(held.sum())
    if used != raw.used:
        raise DumpError(f"stream {raw.stream}: the summary says used = {raw.used}, the rows show {used} held cells")
    return StreamPicture(pos, seq_bits, uncertain, raw.head, used)


def _row_body(row: str) -> str:
    row = row.rstrip()
    return row[:-2] if row.endswith(" *") else row


def _positions(raw: RawDump) -> np.ndarray:
    size = raw.size
    body = "".join(r[:-2] if r.endswith(" *") else r for r in raw.pos_rows)  # trailing spaces are columns
    if len(body) == POS_WIDTH * size:  # every field in '%-5d' columns: read them all at once
        return _fixed_fields(body, raw)
    pos = np.full(size, -1, dtype=np.int64)
    rows = [_row_body(r) for r in raw.pos_rows]
    for i, row in enumerate(rows):
        first = i * CELLS_PER_POS_ROW
        n = min(CELLS_PER_POS_ROW, size - first)
        if len(row.rstrip()) <= POS_WIDTH * n <= len(row) + POS_WIDTH:
            pos[first:first + n] = _fixed_fields(row.ljust(POS_WIDTH * n), raw)
        else:
            # a position of six digits or more ran into its neighbour: which cells hold something is still
            # known ('.' has its 5 columns), but not where
            pos[first:first + n] = _unreadable_row(row, n)
    return pos


def _fixed_fields(text: str, raw: RawDump) -> np.ndarray:
    chars = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).reshape(-1, POS_WIDTH)
    if not POS_BYTES[chars].all():
        raise DumpError(f"stream {raw.stream}: a position row holds something else than positions")
    digits = chars.astype(np.int64) - ord("0")
    is_digit = (digits >= 0) & (digits <= 9)
    value = np.zeros(len(chars), dtype=np.int64)
    for j in range(POS_WIDTH):  # left-aligned: digits first, spaces after
        value = np.where(is_digit[:, j], value * 10 + digits[:, j], value)
    value[~is_digit[:, 0]] = -1
    return value


def _unreadable_row(row: str, n: int) -> np.ndarray:
    """A row where a position of six digits or more ran into its neighbour: '.' fields keep their 5
    columns, so which cells are empty is read where the row still splits into n fields; the positions of
    the held cells are not."""
    out = np.full(n, POS_UNKNOWN, dtype=np.int64)
    at, cell = 0, 0
    while at < len(row) and cell < n:
        if row[at] == ".":
            out[cell] = -1
            at += POS_WIDTH
        else:
            while at < len(row) and row[at].isdigit():
                at += 1
            while at < len(row) and row[at] == " ":
                at += 1
        cell += 1
    if cell != n or at < len(row.rstrip()):
        out[:] = POS_UNKNOWN  # not even the empty cells line up: the map decides which are held
    return out


def _single_chars(map_text: str, held: np.ndarray, seq_bits: np.ndarray, uncertain: np.ndarray,
                  pos: np.ndarray, raw: RawDump) -> None:
    codes = np.frombuffer(map_text.encode("ascii", errors="replace"), dtype=np.uint8)
    if not MAP_BYTES[codes].all():
        raise DumpError(f"stream {raw.stream}: a cell map row holds something else than cell labels")
    unread = pos == POS_UNKNOWN
    if unread.any():  # the map says which of the cells of an unreadable position row are empty
        pos[unread & (codes == EMPTY)] = -1
        held[:] = pos != -1
    if not np.array_equal(codes != EMPTY, held):
        raise DumpError(f"stream {raw.stream}: the cell map and the positions disagree on which cells are empty")
    digits = codes.astype(np.int16) - ord("0")
    for seq in np.unique(digits[(digits >= 0) & (digits <= 9)]).tolist():
        cells = np.flatnonzero(digits == seq)
        seq_bits[cells, seq >> 3] |= np.uint8(1 << (seq & 7))
    _shared(np.flatnonzero(codes == SHARED), seq_bits, uncertain, pos, raw.ranges)


def _shared(cells: np.ndarray, seq_bits: np.ndarray, uncertain: np.ndarray, pos: np.ndarray,
            ranges: dict[int, tuple[int, int]]) -> None:
    """'M' cells: the sequences whose min..max covers the cell's position may hold it; two of them must."""
    for cell in cells.tolist():
        p = int(pos[cell])
        maybe = [s for s, (lo, hi) in ranges.items() if p == POS_UNKNOWN or lo <= p <= hi]
        for s in maybe:
            seq_bits[cell, s >> 3] |= np.uint8(1 << (s & 7))
        uncertain[cell] = 0 if len(maybe) == 2 else SEQS_SHARED_UNNAMED


def _mixed_widths(raw: RawDump, held: np.ndarray, seq_bits: np.ndarray, uncertain: np.ndarray, pos: np.ndarray,
                  present: list[int]) -> None:
    """Sequence ids of several lengths: each row's runs of digits are split into ids of present sequences,
    as many as the positions say the run covers."""
    names = {str(s): s for s in present} if present else {str(s): s for s in range(256)}
    shared_cells = []
    for r, row in enumerate(raw.map_rows):
        first = r * CELLS_PER_MAP_ROW
        n = min(CELLS_PER_MAP_ROW, raw.size - first)
        tokens = MAP_TOKEN.findall(_row_body(row))
        cell, lost = first, False
        for t, token in enumerate(tokens):
            if cell >= first + n:
                raise DumpError(f"stream {raw.stream}: map row {r} has more labels than its {n} cells")
            if token == ".":
                if held[cell] and not lost:
                    raise DumpError(f"stream {raw.stream}: cell {cell} is '.' in the map but holds a position")
                cell += 1
                continue
            if token == "M":
                shared_cells.append(cell)
                cell += 1
                continue
            if t + 1 < len(tokens) and tokens[t + 1] == "M":
                k = None  # the run ends where an 'M' begins: its length in cells is not in the positions
            else:
                end = cell
                while end < first + n and held[end]:
                    end += 1
                k = end - cell
            if k is None:
                counts = _token_counts(token, names)
                k = counts[0] if len(counts) == 1 else None
            choices = _choices(token, names, k, pos[cell:cell + k], raw.ranges) if k is not None else None
            if choices is None:
                # unreadable from here on in this row: the held cells keep every present sequence as possible
                rest = np.flatnonzero(held[cell:first + n]) + cell
                for s in names.values():
                    seq_bits[rest, s >> 3] |= np.uint8(1 << (s & 7))
                uncertain[rest] = SEQS_READ_TWO_WAYS
                lost = True
                break
            for j, ids in enumerate(choices):
                for s in ids:
                    seq_bits[cell + j, s >> 3] |= np.uint8(1 << (s & 7))
                uncertain[cell + j] = SEQS_READ_TWO_WAYS if len(ids) > 1 else 0
            cell += k
    _shared(np.array(shared_cells, dtype=np.int64), seq_bits, uncertain, pos, raw.ranges)


def _suffix_ways(digits: str, names: dict[str, int], most: int, allowed=None) -> np.ndarray:
    """ways[i, r] is True when digits[i:] splits into exactly r ids of `names` (r <= most). With `allowed`
    (id -> bool per token index, for a split into exactly `most`), the token at index most - r may only be an
    id whose sequence's min..max covers that cell's position."""
    length = len(digits)
    ways = np.zeros((length + 1, most + 1), dtype=bool)
    ways[length, 0] = True
    widths = sorted({len(name) for name in names})
    for i in range(length - 1, -1, -1):
        for w in widths:
            seq = names.get(digits[i:i + w]) if i + w <= length else None
            if seq is not None:
                step = ways[i + w, :-1]
                ways[i, 1:] |= step if allowed is None else step & allowed(seq)[::-1]
    return ways


def _token_counts(digits: str, names: dict[str, int]) -> list[int]:
    """How many ids `digits` may split into."""
    ways = _suffix_ways(digits, names, len(digits))
    return np.flatnonzero(ways[0]).tolist()


def _choices(digits: str, names: dict[str, int], k: int, cell_pos: np.ndarray,
             ranges: dict[int, tuple[int, int]]) -> list[set[int]] | None:
    """For each of the k cells of a run of digits (at positions cell_pos), the ids it may hold over every split
    of the run into k ids of `names` whose min..max covers the cell's position; None when there is none."""
    if k <= 0 or len(digits) < k:
        return None
    cache: dict[int, np.ndarray] = {}

    def allowed(seq: int) -> np.ndarray:
        mask = cache.get(seq)
        if mask is None:
            lo, hi = ranges.get(seq, (-(2 ** 62), 2 ** 62))
            mask = cache[seq] = (cell_pos == POS_UNKNOWN) | ((cell_pos >= lo) & (cell_pos <= hi))
        return mask

    ways = _suffix_ways(digits, names, k, allowed)
    if not ways[0, k]:
        return None
    length = len(digits)
    reach = np.zeros((length + 1, k + 1), dtype=bool)  # reach[i, t]: digits[:i] splits into t ids
    reach[0, 0] = True
    choices: list[set[int]] = [set() for _ in range(k)]
    widths = sorted({len(name) for name in names})
    for i in range(length):
        if not reach[i].any():
            continue
        for w in widths:
            seq = names.get(digits[i:i + w]) if i + w <= length else None
            if seq is None:
                continue
            ok = reach[i, :k] & allowed(seq)
            reach[i + w, 1:] |= ok
            # token t spans [i, i + w) in a full split: t ids before it, k - t - 1 after it
            for t in np.flatnonzero(ok & ways[i + w, k - 1::-1][:k]).tolist():
                choices[t].add(seq)
    return choices
