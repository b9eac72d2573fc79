"""llama.cpp's own log, read into the events kvscope's engine publishes: a real llama-server, llama-cli or
any program on libllama, watched by the same views (docs/watching-llama-cpp.md).

Cells come from the slot-search dumps (`LLAMA_KV_CACHE_DEBUG=3` and debug logging, e.g. `-v`): each dump
is a full picture of one stream before a ubatch is placed, so each yields a CellsSeen of the cells that
differ from the stream's previous dump. The cause says when they were seen ("seen at the slot search of
ubatch 12") or, where a line in between says why a sequence lost cells (llama-server's `memory_seq_rm
[p0, end)`, its context shift, a `llama_memory_seq_rm(...)` call a program printed), that line's words.
Init lines give ContextCreated and device memory; llama-server's slot lines give its slots and tasks.

Nothing here is fatal: a line not understood is skipped and counted; a dump whose parts disagree is
counted as damaged and the stream waits for the next one (a dump is a keyframe of its stream).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from engine import events as ev
from engine.watch.llama_log.context_lines import ContextLines
from engine.watch.llama_log.dumps import MIN_MAX, SUMMARY, DumpError, RawDump, StreamPicture, decode
from engine.watch.llama_log.lines import TIME_PREFIX, LineSplitter, LogLine
from engine.watch.llama_log.server_lines import Removal, ServerLines
from engine.watch.mirror import CacheMirror

# a program on libllama that prints the memory calls it makes (as the fixtures' driver does) says why cells go
MEMORY_CALL = re.compile(r"llama_memory_(seq_rm|seq_cp|seq_keep|seq_add|seq_div|clear)\(\s*\w+\s*"
                         r"((?:,\s*-?\d+\s*)*)\)")
# the shape of a llama.cpp log line ("function: text", common's "que  start_loop: ..."): such a line that says
# nothing about the cache counts as another line of llama.cpp, not as one the parser failed to understand
LLAMA_LINE = re.compile(r"(?:[a-z]{3,4} +)?~?[A-Za-z_][\w.:~()]*: ")
MAP_LABELS = ".M0123456789"  # what a cell map's row is made of, before its " *"
POS_START = ".0123456789"
ROW_ENDS = ".M0123456789 *"
SLOT_FAILED = re.compile(r"decode: failed to find a memory slot for batch of size (\d+)")
DECODE_FAILED = re.compile(r"llama_decode: failed to decode, ret = (-?\d+)")


@dataclass
class ParserStats:
    bytes: int = 0
    lines: int = 0
    skipped: int = 0  # lines not understood
    other: int = 0  # llama.cpp's lines with nothing about the cache (the model loader, the graph, ...)
    dumps: int = 0  # slot-search dumps read (summary and, where printed, the cells)
    dumps_dropped: int = 0  # complete dumps not decoded, to keep up (coalesce)
    dumps_damaged: int = 0  # dumps whose parts disagree
    skipped_examples: tuple[str, ...] = ()  # the last few lines skipped, for a user asking why


@dataclass(frozen=True)
class Copy:
    """A seq_cp a line announced: cells of src in [p0, p1) now also hold dst."""

    src: int
    dst: int
    p0: int
    p1: int


class LlamaLogParser:
    """feed() the log as it comes; each call answers the events its complete lines make (unstamped)."""

    SKIPPED_EXAMPLES = 8

    def __init__(self) -> None:
        self.stats = ParserStats()
        self.coalesce = False
        self.program = ""
        self.ubatch = 0  # slot searches seen
        self._splitter = LineSplitter()
        self._context = ContextLines()
        self._server = ServerLines()
        self._mirror = CacheMirror()  # the picture so far: state_events() for a late watcher
        self._pictures: dict[tuple[str, int], StreamPicture] = {}
        self._implicit: dict[str, ev.ContextCreated] = {}  # caches seen in dumps before any init line
        self._ops: list[Removal | Copy] = []
        self._ops_seen: dict[tuple[str, int], int] = {}  # per stream: ops already applied to its pictures
        self._dump: RawDump | None = None
        self._dump_cache = ""
        self._dump_ubatch = 0
        self._dump_ops_at = 0
        self._last_summary: tuple | None = None
        self._waiting: dict[tuple[str, int], tuple[RawDump, int, int]] = {}  # coalesced: the last dump per stream
        self._out: list[ev.Event] = []
        self._skipped: list[str] = []
        self._host_bytes = (0, 0)  # the checkpoints and prompt cache last published

    # ---- input ------------------------------------------------------------------------------------
    def feed(self, data: str | bytes) -> list[ev.Event]:
        self.stats.bytes += len(data)
        raws = self._splitter.split(data)
        i, n = 0, len(raws)
        while i < n:
            if self._dump is not None and (self._dump.wants_map or self._dump.wants_pos and self._dump.map_rows):
                i = self._take_rows(raws, i)  # a dump's rows, many at a time: most of a log's bytes
                if i >= n:
                    break
            for line in self._splitter.clean(raws[i]):
                self._line(line)
            i += 1
        return self._flush()

    def _take_rows(self, raws: list[str], i: int) -> int:
        """Take the open dump's map or position rows from raws[i:]; answers where other lines begin."""
        dump = self._dump
        map_left = dump.map_rows_expected - len(dump.map_rows)
        pos_left = dump.pos_rows_expected - len(dump.pos_rows)
        n, taken = len(raws), 0
        while i < n and (map_left or pos_left):
            row = raws[i]
            if row.endswith("\r"):
                row = row[:-1]
            if not row:
                i += 1
                taken += 1
                continue
            # a row is told from other lines by its ends alone (decode checks every character, at once): a
            # line of another entry begins with a time prefix or ends in a letter
            first, last = row[0], row[-1]
            if (last not in ROW_ENDS or (first.isdigit() and TIME_PREFIX.match(row))
                    or first not in (MAP_LABELS if map_left else POS_START)):
                break
            if map_left:
                dump.map_rows.append(row)
                map_left -= 1
            else:
                dump.pos_rows.append(row)
                pos_left -= 1
            i += 1
            taken += 1
        self.stats.lines += taken
        return i

    def idle(self) -> list[ev.Event]:
        """No input came for a while: a dump that has its cells is complete (its min/max lines come at once)."""
        if self._dump is not None and self._dump.has_cells:
            self._end_dump()
        return self._flush()

    def finish(self) -> list[ev.Event]:
        for line in self._splitter.finish():
            self._line(line)
        if self._dump is not None:
            self._end_dump()
        return self._flush()

    def state_events(self) -> list[ev.Event]:
        """The picture so far as events, for a watcher that joins late."""
        return self._mirror.state_events() + self._server.state_events()

    @property
    def pending_chars(self) -> int:
        return self._splitter.pending

    def _flush(self) -> list[ev.Event]:
        if self._waiting and (self.coalesce or self._dump is None):
            for key, (raw, ubatch, ops_at) in list(self._waiting.items()):
                self._decode(raw, key[0], ubatch, ops_at)
            self._waiting.clear()
        out, self._out = self._out, []
        self._mirror.apply_all(out)
        return out

    # ---- one line ---------------------------------------------------------------------------------
    def _line(self, line: LogLine) -> None:
        self.stats.lines += 1
        text = line.text
        dump = self._dump
        if dump is not None:
            if self._dump_line(dump, text):
                return
        if text.startswith("find_slot: stream["):
            m = SUMMARY.match(text)
            if m:
                self._start_dump(m)
                return
        if not text.strip():
            return
        if self._other_line(text, line.level):
            return
        if LLAMA_LINE.match(text):
            self.stats.other += 1
            return
        self.stats.skipped += 1
        self._skipped.append(text[:200])
        if len(self._skipped) > 2 * self.SKIPPED_EXAMPLES:
            del self._skipped[:-self.SKIPPED_EXAMPLES]
        self.stats.skipped_examples = tuple(self._skipped[-self.SKIPPED_EXAMPLES:])

    def _dump_line(self, dump: RawDump, text: str) -> bool:
        """True when the line belongs to the open dump."""
        if not text:
            return True  # the newlines around the map and the positions (the rows are taken by _take_rows)
        if text.startswith("find_slot: stream[") and "min[" in text:
            m = MIN_MAX.match(text)
            if m and int(m.group(1)) == dump.stream:
                dump.ranges[int(m.group(2))] = (int(m.group(3)), int(m.group(5)))
                return True
        if dump.has_cells and not self._splitter.prefixed_log:
            self._end_dump()  # complete, and this line is the next thing
        # else: in a log of entries (common/log's prefixes), another thread's entry may come between any two
        # of the dump's (llama-server's HTTP threads do): the dump stays open until the next dump, a pause
        # (idle) or the end, so that none of its rows or min/max lines is lost
        return False

    def _other_line(self, text: str, level: str) -> bool:
        context = self._context.line(text)
        if context is not None:
            self._out.extend(context)
            return True
        server = self._server.line(text, level)
        if server is not None:
            events, removals = server
            self._out.extend(events)
            self._ops.extend(removals)
            host = (self._server.checkpoint_bytes, self._server.prompt_cache_bytes)
            if host != self._host_bytes:  # the server's host memory: checkpoints and prompt cache
                self._host_bytes = self._context.host_bytes = host
                self._out.append(self._context.memory_state(*host))
            if not self.program:
                self.program = "llama-server"
            return True
        if "llama_memory_" in text:
            m = MEMORY_CALL.search(text)
            if m:
                self._memory_call(m)
                return True
        if text.startswith(("decode: failed", "llama_decode: failed")):
            return self._decode_failed(text)
        return False

    def _decode_failed(self, text: str) -> bool:
        m = SLOT_FAILED.match(text)
        if m and self._last_summary is not None:
            cache, stream, _n, used, head = self._last_summary
            created = self._context.caches.get(cache) or self._implicit.get(cache)
            self._out.append(ev.SlotSearchFailed(cache=cache, stream=stream, n_tokens=int(m.group(1)),
                                                 size=created.kv_size if created else 0, used=used, head=head))
            return True
        m = DECODE_FAILED.match(text)
        if m:
            self._out.append(ev.DecodeFinished(rc=int(m.group(1)), n_tokens=0, ubatch_sizes=(), ms_total=0.0,
                                               message=text))
            return True
        return False

    def _memory_call(self, m: re.Match) -> None:
        op = m.group(1)
        args = [int(a) for a in re.findall(r"-?\d+", m.group(2))]
        call = f"llama_memory_{op}({', '.join(map(str, args))})"
        if op == "seq_rm" and len(args) == 3:
            self._ops.append(Removal(args[0], args[1], args[2], call))
        elif op == "seq_cp" and len(args) == 4:
            self._ops.append(Copy(args[0], args[1], args[2], args[3]))
        elif op in ("seq_add", "seq_div") and len(args) == 4:
            self._ops.append(Removal(args[0], args[1], args[2], call, kind="moved"))
        elif op == "seq_keep" and len(args) == 1:
            self._ops.append(Removal(-1, -1, -1, call, kind="kept", keep=args[0]))
        elif op == "clear":
            self._ops.append(Removal(-1, -1, -1, call))

    # ---- dumps ------------------------------------------------------------------------------------
    def _start_dump(self, m: re.Match) -> None:
        if self._dump is not None:
            self._end_dump()
        stream, n, used, head, size, n_swa = (int(g) for g in m.groups())
        cache = self._cache_name(size, n_swa, stream)
        first_cache = cache != "swa"
        key = (cache, stream, n, used, head)
        last = self._last_summary
        same_search = (last is not None and first_cache and last[0] == cache
                       and (stream > last[1] or key == last))
        if first_cache and not same_search or last is None:
            self.ubatch += 1
        self._last_summary = key
        self._dump = RawDump(stream, n, used, head, size, n_swa)
        # the operations a line announced before this dump are the ones its picture shows done
        self._dump_cache, self._dump_ubatch, self._dump_ops_at = cache, self.ubatch, len(self._ops)

    def _end_dump(self) -> None:
        raw, cache, ubatch = self._dump, self._dump_cache, self._dump_ubatch
        self._dump = None
        self.stats.dumps += 1
        key = (cache, raw.stream)
        if not raw.has_cells:
            self._head_only(raw, cache)
            return
        ops_at = self._dump_ops_at
        if self.coalesce:
            if key in self._waiting:
                self.stats.dumps_dropped += 1
            self._waiting[key] = (raw, ubatch, ops_at)
            return
        self._decode(raw, cache, ubatch, ops_at)

    def _decode(self, raw: RawDump, cache: str, ubatch: int, ops_at: int) -> None:
        key = (cache, raw.stream)
        try:
            picture = decode(raw)
        except DumpError:
            self.stats.dumps_damaged += 1
            return
        old = self._pictures.get(key)
        if old is None or len(old.pos) != len(picture.pos):
            old = _empty_picture(len(picture.pos))
        ops = self._ops[self._ops_seen.get(key, 0):ops_at]
        self._ops_seen[key] = ops_at
        _apply_copies(old, picture, [op for op in ops if isinstance(op, Copy)])
        self._pictures[key] = picture
        changed = ((old.pos != picture.pos) | (old.seq_bits != picture.seq_bits).any(axis=1)
                   | (old.uncertain != picture.uncertain))
        if not changed.any() and old.head == picture.head:
            return
        left = changed.copy()
        for op in ops:
            if isinstance(op, Removal):
                cells = op.cells(old, picture) & left
                if cells.any():
                    left &= ~cells
                    self._out.append(_seen(cache, raw.stream, np.flatnonzero(cells), picture, ubatch, op.cause))
        self._out.append(_seen(cache, raw.stream, np.flatnonzero(left), picture, ubatch,
                               f"seen at the slot search of ubatch {ubatch}"))
        # the dump numbers its caches' streams; the ubatch counter the slot searches since the log began
        self._trim_ops()

    def _head_only(self, raw: RawDump, cache: str) -> None:
        """A summary without cells (LLAMA_KV_CACHE_DEBUG=1, or 2 on a full-attention cache): the head is known."""
        key = (cache, raw.stream)
        picture = self._pictures.get(key)
        if picture is not None and picture.head != raw.head:
            picture.head = raw.head
            self._out.append(_seen(cache, raw.stream, np.zeros(0, dtype=np.int64), picture, self.ubatch,
                                   f"seen at the slot search of ubatch {self.ubatch} (no cell map in the log)"))

    def _trim_ops(self) -> None:
        low = min(self._ops_seen.values(), default=0)
        if low > 4096:  # operations every stream has seen are not needed again
            del self._ops[:low]
            self._ops_seen = {k: v - low for k, v in self._ops_seen.items()}

    def _cache_name(self, size: int, n_swa: int, stream: int) -> str:
        caches = self._context.caches
        if caches:
            name = "swa" if n_swa > 0 and "swa" in caches else "base" if "base" in caches else "kv"
            created = caches.get(name)
            if created is not None and created.kv_size == size and stream < created.n_stream:
                return name
        return self._implicit_cache("swa" if n_swa > 0 else "kv", size, n_swa, stream)

    def _implicit_cache(self, name: str, size: int, n_swa: int, stream: int) -> str:
        """A dump of a cache whose init lines the log does not hold (it began later): known from the dump."""
        created = self._implicit.get(name)
        if created is not None and created.kv_size == size and stream < created.n_stream:
            return name
        n_stream = max(stream + 1, created.n_stream if created is not None and created.kv_size == size else 1)
        created = ev.ContextCreated(
            cache=name, n_ctx=size * n_stream, n_ctx_seq=size, kv_size=size, n_stream=n_stream, n_seq_max=n_stream,
            n_layer=0, type_k="?", type_v="?", v_trans=False, k_bytes=0, v_bytes=0, n_batch=0, n_ubatch=0, pad=256,
            unified=n_stream == 1, model_name=self._context.model_name,
            log_lines=("(not in the log: this cache is known from its slot-search dumps only)",),
            n_swa=n_swa, n_swa_train=n_swa, swa_type=1 if n_swa > 0 else 0)
        self._implicit[name] = created
        self._out.append(created)
        # a cache announced again (more streams seen) starts empty in a watcher: restate what was shown
        for (cache, s), picture in self._pictures.items():
            if cache == name and len(picture.pos) == size:
                self._out.append(_seen(name, s, np.arange(size), picture, self.ubatch, "restated"))
        return name


def _empty_picture(size: int) -> StreamPicture:
    return StreamPicture(np.full(size, -1, dtype=np.int64), np.zeros((size, ev.SEQ_BITS_BYTES), dtype=np.uint8),
                         np.zeros(size, dtype=np.uint8), 0, 0)


def _holds(bits: np.ndarray, seq: int) -> np.ndarray:
    return ((bits[:, seq >> 3] >> (seq & 7)) & 1).astype(bool)


def _apply_copies(old: StreamPicture, new: StreamPicture, copies: list[Copy]) -> None:
    """An 'M' cell that held only src before, at the same position, holds src and dst after a seq_cp of it."""
    if not copies or not new.uncertain.any():
        return
    for cp in copies:
        p1 = cp.p1 if cp.p1 >= 0 else np.iinfo(np.int64).max
        was_src_only = _holds(old.seq_bits, cp.src) & (old.uncertain == 0) & (ev.seq_counts(old.seq_bits) == 1)
        cells = ((new.uncertain == ev.SEQS_SHARED_UNNAMED) & was_src_only & (old.pos == new.pos) & (new.pos >= max(cp.p0, 0)) & (new.pos < p1)
                 & _holds(new.seq_bits, cp.src) & _holds(new.seq_bits, cp.dst))
        for cell in np.flatnonzero(cells).tolist():
            new.seq_bits[cell] = 0
            for s in (cp.src, cp.dst):
                new.seq_bits[cell, s >> 3] |= np.uint8(1 << (s & 7))
            new.uncertain[cell] = 0


def _seen(cache: str, stream: int, cells: np.ndarray, picture: StreamPicture, ubatch: int, cause: str) -> ev.CellsSeen:
    cells = cells.astype(np.int64)
    change = ev.StreamCells(stream, ev._frozen_fresh(cells), ev._frozen_fresh(picture.pos[cells]),
                            ev._frozen_fresh(np.zeros(len(cells), dtype=np.int64)),
                            ev._frozen_fresh(picture.seq_bits[cells], np.uint8), picture.head)
    return ev.CellsSeen(cache=cache, changes=(change,), cause=cause, ubatch=ubatch,
                        uncertain=(ev._frozen_fresh(picture.uncertain[cells], np.uint8),))
