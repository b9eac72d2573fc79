"""RecordingReader: replays a `.kvtrace` file into the watch layer and seeks to any event, forward and
backward, from the nearest keyframe (format: engine/watch/recording_format.py). A file without its index
is read by scanning up to its last complete chunk, and says so.
"""
from __future__ import annotations

import bisect
import collections
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgpack

from engine import events as ev
from engine.watch.codec import CodecError, decode_event, event_kind
from engine.watch.mirror import CacheMirror
from engine.watch.recording_format import (
    CHUNK_CACHE,
    CHUNK_HEAD,
    CHUNK_HEAD_SIZE,
    ENTRY_LENGTH,
    ENTRY_REFERENCE,
    EVENTS,
    FILE_MAGIC,
    FORMAT_VERSION,
    HEADER,
    INDEX,
    KEYFRAME,
    NO_COMPRESSION,
    REFERENCE,
    TRAILER,
    TRAILER_MAGIC,
    ZLIB,
    ChunkRef,
    RecordingError,
)


class RecordingReader:
    """A recording, replayed into the watch layer.

        rec = RecordingReader("run.kvtrace")
        len(rec), rec.keyframes, rec.truncated, rec.warnings
        for event in rec.events(): ...
        mirror = rec.mirror_at(i)     # a new CacheMirror as it was right after event i
        mirror = rec.seek(i)          # the reader's own mirror, moved to event i (cheap when stepping)

    Every problem with the file is a RecordingError naming the file and the byte offset."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
            self.size = os.fstat(self._file.fileno()).st_size
        except OSError as e:
            raise RecordingError(self.path, None, f"cannot open the recording: {e.strerror or e}") from None
        self._lock = threading.Lock()
        # chunk offset -> (its entries, the events decoded from them so far): stepping back and forth
        # near one place decodes each event once
        self._cache: collections.OrderedDict[int, tuple[list, list]] = collections.OrderedDict()
        self.warnings: list[str] = []  # what was wrong but left the recording readable
        self.truncated = False
        try:
            self.format_version, self.schema_version, self.info, self.data_start = self._read_header()
            chunks = self._read_index()
            if chunks is None:
                chunks = self._scan()
            self._set_chunks(chunks)
        except BaseException:
            self._file.close()
            raise
        self._cursor: CacheMirror | None = None
        self.position = -1  # the last event applied to the cursor mirror (seek)
        self._kinds: tuple[str, ...] | None = None

    # ---- the header, the index and the chunk list --------------------------------------------
    def _read_header(self) -> tuple[int, int, dict, int]:
        fixed = self._read_at(0, HEADER.size)
        if len(fixed) < len(FILE_MAGIC) or not fixed.startswith(FILE_MAGIC):
            if FILE_MAGIC.startswith(fixed):
                raise self._error(len(fixed), "the file ends inside its header (truncated)")
            raise self._error(0, f"not a kvscope recording: it starts with {fixed[:8]!r}, not {FILE_MAGIC!r}")
        if len(fixed) < HEADER.size:
            raise self._error(len(fixed), "the file ends inside its header (truncated)")
        _, fmt, schema, info_len = HEADER.unpack(fixed)
        if fmt != FORMAT_VERSION:
            newer = "written by a newer kvscope (or damaged)" if fmt > FORMAT_VERSION else "damaged"
            raise self._error(8, f"file format version {fmt}: {newer}; this kvscope reads format {FORMAT_VERSION}")
        end = HEADER.size + info_len + 4
        if end > self.size:
            raise self._error(self.size, f"the file ends inside its header, which is {end} bytes long (truncated)")
        rest = self._read_at(HEADER.size, info_len + 4)
        body, (crc,) = rest[:info_len], struct.unpack("<I", rest[info_len:])
        if zlib.crc32(fixed[8:] + body) != crc:
            raise self._error(8, "the header is damaged (its crc32 does not match)")
        if schema != ev.SCHEMA_VERSION:
            who = "a newer" if schema > ev.SCHEMA_VERSION else "an older"
            raise self._error(10, f"its events are of schema version {schema}, written by {who} kvscope; this "
                                  f"kvscope reads schema version {ev.SCHEMA_VERSION} (engine.events.SCHEMA_VERSION)")
        try:
            info = msgpack.unpackb(body)
        except Exception as e:  # crc-checked, so only a writer of another format gets here
            raise self._error(HEADER.size, f"the header's info cannot be read ({e})") from None
        return fmt, schema, info if isinstance(info, dict) else {}, end

    def _read_index(self) -> list[ChunkRef] | None:
        """The chunks listed by the index, or None when the file has no trailer (it was cut short)."""
        if self.size < self.data_start + TRAILER.size:
            return None
        index_offset, magic = TRAILER.unpack(self._read_at(self.size - TRAILER.size, TRAILER.size))
        if magic != TRAILER_MAGIC:
            return None
        ref = ChunkRef(INDEX, index_offset, 0, -1)
        if not self.data_start <= index_offset <= self.size - TRAILER.size - CHUNK_HEAD_SIZE:
            raise self._error(self.size - TRAILER.size, f"the trailer points at byte {index_offset}, outside the "
                                                        f"chunks (damaged)")
        head = self._chunk_head(index_offset, expect=ref)
        raw = self._chunk_payload(index_offset, head)
        try:
            rows = msgpack.unpackb(raw)
            chunks = [ChunkRef(tag.encode("ascii"), int(off), int(first), int(count))
                      for tag, off, first, count in rows]
        except Exception as e:
            raise self._error(index_offset, f"the index cannot be read ({e})") from None
        if len(chunks) != head[3]:
            raise self._error(index_offset, f"the index lists {len(chunks)} chunks, its head says {head[3]}")
        return chunks

    def _scan(self) -> list[ChunkRef]:
        """Chunk heads from the start, up to the end of the last complete chunk."""
        chunks, offset = [], self.data_start
        while True:
            if offset == self.size:
                reason = "ends after its last chunk without an index"
                break
            if offset + CHUNK_HEAD_SIZE > self.size:
                reason = "ends inside the head of a chunk"
                break
            tag, _, first, count, _, stored, _ = self._chunk_head(offset)
            if tag == INDEX:  # the trailer, whose absence sent us here, follows the index
                reason = "ends inside its index and trailer"
                break
            end = offset + CHUNK_HEAD_SIZE + stored
            if end > self.size:
                reason = f"ends inside a chunk ({tag.decode('ascii')}, {end - offset} bytes long)"
                break
            chunks.append(ChunkRef(tag, offset, first, count))
            offset = end
        n = sum(c.count for c in chunks if c.tag == EVENTS)
        self.truncated = True
        self.warnings.append(f"{self.path}, byte {offset}: the recording {reason}: it was cut short (a recorder "
                             f"that did not finish); {n} events are readable")
        return chunks

    def _set_chunks(self, chunks: list[ChunkRef]) -> None:
        self._chunks_at = {c.offset: c for c in chunks}
        self._event_chunks = [c for c in chunks if c.tag == EVENTS]
        self._keyframe_chunks = [c for c in chunks if c.tag == KEYFRAME]
        expected = 0
        for c in self._event_chunks:
            if c.first != expected or c.count < 1:
                raise self._error(c.offset, f"an events chunk for events {c.first}.. where event {expected} was due "
                                            f"(damaged index or chunk head)")
            expected += c.count
        self.n_events = expected
        self._starts = [c.first for c in self._event_chunks]
        self._keyframe_firsts = [c.first for c in self._keyframe_chunks]
        for c in self._keyframe_chunks:
            if not 0 < c.first <= self.n_events:
                raise self._error(c.offset, f"a keyframe after event {c.first - 1}, outside the {self.n_events} "
                                            f"events of the recording")

    # ---- chunks --------------------------------------------------------------------------------
    def _chunk_head(self, offset: int, expect: ChunkRef | None = None) -> tuple:
        data = self._read_at(offset, CHUNK_HEAD_SIZE)
        if len(data) < CHUNK_HEAD_SIZE:
            raise self._error(offset, "the file ends inside the head of a chunk (truncated)")
        (crc,) = struct.unpack_from("<I", data, CHUNK_HEAD.size)
        head = CHUNK_HEAD.unpack_from(data)
        if zlib.crc32(data[:CHUNK_HEAD.size]) != crc or head[0] not in (EVENTS, KEYFRAME, INDEX):
            raise self._error(offset, "a damaged chunk head (its crc32 does not match, or it is not a chunk)")
        if expect is not None and (head[0] != expect.tag or (expect.count >= 0 and head[2:4] != (expect.first,
                                                                                                 expect.count))):
            raise self._error(offset, f"the chunk here is {head[0]!r} of {head[2]}+{head[3]}, the index says "
                                      f"{expect.tag!r} of {expect.first}+{expect.count} (damaged)")
        return head

    def _chunk_payload(self, offset: int, head: tuple) -> bytes:
        _, compression, _, _, raw_len, stored_len, crc = head
        start = offset + CHUNK_HEAD_SIZE
        stored = self._read_at(start, stored_len)
        if len(stored) < stored_len:
            raise self._error(start + len(stored), "the file ends inside a chunk (truncated)")
        if zlib.crc32(stored) != crc:
            raise self._error(start, f"the chunk's payload is damaged (its crc32 does not match; chunk at byte "
                                     f"{offset})")
        if compression == NO_COMPRESSION:
            raw = stored
        elif compression == ZLIB:
            try:
                raw = zlib.decompress(stored, bufsize=max(raw_len, 1))
            except zlib.error as e:
                raise self._error(start, f"the chunk's payload cannot be decompressed ({e})") from None
        else:
            raise self._error(offset, f"unknown compression {compression} (this kvscope knows 0 and 1)")
        if len(raw) != raw_len:
            raise self._error(start, f"the chunk's payload is {len(raw)} bytes, its head says {raw_len}")
        return raw

    def _entries(self, ref: ChunkRef) -> list:
        return self._cached(ref)[0]

    def _cached(self, ref: ChunkRef) -> tuple[list, list]:
        cached = self._cache.get(ref.offset)
        if cached is None:
            cached = self._cache[ref.offset] = (self._read_entries(ref), [None] * ref.count)
            if len(self._cache) > CHUNK_CACHE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(ref.offset)
        return cached

    def _read_entries(self, ref: ChunkRef) -> list:
        """The entries of a chunk: bytes, or (chunk offset, entry number) for a reference."""
        raw = self._chunk_payload(ref.offset, self._chunk_head(ref.offset, expect=ref))
        entries, pos = [], 0
        for number in range(ref.count):
            if pos + 4 > len(raw):
                raise self._error(ref.offset, f"entry {number} of the chunk runs past its payload (damaged)")
            (n,) = ENTRY_LENGTH.unpack_from(raw, pos)
            if n == REFERENCE:
                if pos + 4 + ENTRY_REFERENCE.size > len(raw):
                    raise self._error(ref.offset, f"entry {number} of the chunk runs past its payload (damaged)")
                entries.append(ENTRY_REFERENCE.unpack_from(raw, pos + 4))
                pos += 4 + ENTRY_REFERENCE.size
            else:
                if pos + 4 + n > len(raw):
                    raise self._error(ref.offset, f"entry {number} of the chunk runs past its payload (damaged)")
                entries.append(raw[pos + 4:pos + 4 + n])
                pos += 4 + n
        if pos != len(raw):
            raise self._error(ref.offset, f"the chunk has {len(raw) - pos} bytes after its {ref.count} entries "
                                          f"(damaged)")
        return entries

    def _entry_bytes(self, ref: ChunkRef, number: int) -> bytes:
        entry = self._entries(ref)[number]
        if isinstance(entry, bytes):
            return entry
        offset, target_number = entry
        target = self._chunks_at.get(offset)
        if target is None or offset >= ref.offset:
            raise self._error(ref.offset, f"entry {number} refers to a chunk at byte {offset}, which is not an "
                                          f"earlier chunk of this recording (damaged)")
        data = self._entries(target)
        if not (0 <= target_number < len(data) and isinstance(data[target_number], bytes)):
            raise self._error(ref.offset, f"entry {number} refers to entry {target_number} of the chunk at byte "
                                          f"{offset}, which it does not have (damaged)")
        return data[target_number]

    def _decode(self, ref: ChunkRef, number: int, what: str) -> ev.Event:
        with self._lock:
            decoded = self._cached(ref)[1]
            event = decoded[number]
            if event is None:
                try:
                    event = decoded[number] = decode_event(self._entry_bytes(ref, number))
                except CodecError as e:
                    raise self._error(ref.offset, f"{what} (entry {number} of this chunk) cannot be read: "
                                                  f"{e}") from None
            return event

    # ---- events ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.n_events

    @property
    def keyframes(self) -> tuple[int, ...]:
        """The events after which a keyframe holds the state: mirror_at(i) starts from the last one <= i."""
        return tuple(c.first - 1 for c in self._keyframe_chunks)

    def event(self, i: int) -> ev.Event:
        i = self._index(i)
        ref = self._event_chunks[bisect.bisect_right(self._starts, i) - 1]
        return self._decode(ref, i - ref.first, f"event {i}")

    def events(self, start: int = 0, stop: int | None = None) -> Iterator[ev.Event]:
        """Events start..stop-1 in order (all of them by default)."""
        for _, _, event in self._located(start, self.n_events if stop is None else min(stop, self.n_events)):
            yield event

    def kinds(self) -> tuple[str, ...]:
        """The kind (class name) of every event, read from its bytes without decoding it, so that a scan for
        events of some kinds (a replay's jump to the next K-shift) decodes only those. Read once, then kept."""
        if self._kinds is None:
            kinds = []
            with self._lock:
                for ref in self._event_chunks:
                    for number in range(ref.count):
                        try:
                            kinds.append(event_kind(self._entry_bytes(ref, number)))
                        except CodecError as e:
                            raise self._error(ref.offset, f"event {ref.first + number} (entry {number} of this "
                                                          f"chunk) cannot be read: {e}") from None
            self._kinds = tuple(kinds)
        return self._kinds

    def _located(self, start: int, stop: int) -> Iterator[tuple[int, ChunkRef, ev.Event]]:
        """(index, chunk, event) for events start..stop-1."""
        for k in range(max(bisect.bisect_right(self._starts, start) - 1, 0), len(self._event_chunks)):
            ref = self._event_chunks[k]
            if ref.first >= stop:
                return
            for number in range(max(start - ref.first, 0), min(stop - ref.first, ref.count)):
                yield ref.first + number, ref, self._decode(ref, number, f"event {ref.first + number}")

    def _index(self, i: int) -> int:
        n = self.n_events
        if not -n <= i < n:
            raise IndexError(f"event {i} is not in {self.path}, which has {n} events (0..{n - 1})" if n else
                             f"{self.path} has no events")
        return i + n if i < 0 else i

    # ---- mirrors ---------------------------------------------------------------------------------
    def mirror_at(self, i: int, *, from_keyframe: bool = True) -> CacheMirror:
        """A new mirror as it was right after event i, rebuilt from the last keyframe at or before i (from
        event 0 with from_keyframe=False)."""
        i = self._index(i)
        mirror, start = self._from_keyframe(i) if from_keyframe else (CacheMirror(), 0)
        self._replay(mirror, start, i + 1)
        return mirror

    def seek(self, i: int) -> CacheMirror:
        """The reader's own mirror, moved to right after event i: forward by replaying the events in between
        when that is shorter than starting from a keyframe, backward from a keyframe. Later seeks change or
        replace it; mirror_at gives a mirror of one's own."""
        i = self._index(i)
        keyframe = self._keyframe_before(i)
        start_from_keyframe = keyframe.first if keyframe is not None else 0
        if self._cursor is None or self.position > i or self.position + 1 < start_from_keyframe:
            self._cursor, self.position = None, -1
            cursor, start = self._from_keyframe(i)
            self._cursor, self.position = cursor, start - 1
        try:
            self._replay(self._cursor, self.position + 1, i + 1)
        except RecordingError:
            self._cursor, self.position = None, -1  # it holds some of the events only: start afresh next time
            raise
        self.position = i
        return self._cursor

    def _keyframe_before(self, i: int) -> ChunkRef | None:
        k = bisect.bisect_right(self._keyframe_firsts, i + 1) - 1
        return self._keyframe_chunks[k] if k >= 0 else None

    def _from_keyframe(self, i: int) -> tuple[CacheMirror, int]:
        """A mirror holding the last keyframe's state at or before event i, and the first event after it."""
        mirror = CacheMirror()
        ref = self._keyframe_before(i)
        if ref is None:
            return mirror, 0
        for number in range(ref.count):
            event = self._decode(ref, number, f"state event {number} of the keyframe after event {ref.first - 1}")
            self._apply(mirror, event, ref, f"state event {number} of the keyframe")
        return mirror, ref.first

    def _replay(self, mirror: CacheMirror, start: int, stop: int) -> None:
        for index, ref, event in self._located(start, stop):
            self._apply(mirror, event, ref, f"event {index}")

    def _apply(self, mirror: CacheMirror, event: ev.Event, ref: ChunkRef, what: str) -> None:
        try:
            mirror.apply(event)
        except Exception as e:  # an event of valid encoding but impossible content: the file's fault, not the viewer's
            raise self._error(ref.offset, f"{what} ({event.kind} #{event.seq_no}) cannot be applied to a mirror: "
                                          f"{type(e).__name__}: {e}") from None

    # ---- files -----------------------------------------------------------------------------------
    def _read_at(self, offset: int, n: int) -> bytes:
        self._file.seek(offset)
        return self._file.read(n)

    def _error(self, offset: int, message: str) -> RecordingError:
        return RecordingError(self.path, offset, message)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordingReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
