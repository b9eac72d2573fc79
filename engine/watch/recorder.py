"""Recorder: writes a `.kvtrace` file from an event bus (format: engine/watch/recording_format.py and
docs/recording-format.md). Events go into compressed chunks; every K events a keyframe holds the
recorder's mirror state as events (CacheMirror.state_events), so that a reader can seek; closing writes
an index of every chunk. A recorder that is killed leaves a file a reader still reads up to its last
complete chunk.
"""
from __future__ import annotations

import datetime
import os
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

import msgpack

from engine import events as ev
from engine.errors import KvscopeError
from engine.watch import lifetime
from engine.watch.codec import CodecError, encode_event
from engine.watch.mirror import CacheMirror
from engine.watch.recording_format import (
    CHUNK_HEAD,
    DEDUP_MIN_BYTES,
    ENTRY_LENGTH,
    ENTRY_REFERENCE,
    EVENTS,
    INDEX,
    KEYFRAME,
    NO_COMPRESSION,
    REFERENCE,
    TRAILER,
    TRAILER_MAGIC,
    ZLIB,
    ChunkRef,
    RecordingError,
    digest,
    header_bytes,
    kvscope_version,
)


CLOSE_WAIT_S = 30.0  # close() waits this long for the background pump to see that it must stop


class Recorder:
    """Writes the events of a bus to a recording.

        rec = Recorder("run.kvtrace", keyframe_every=1000)
        rec.attach(ctx.bus)      # the recording starts with the bus's current state
        rec.start()              # pump in a background thread (or call rec.pump() yourself)
        ...                      # run the engine
        rec.close()              # the last chunk, the index; the file is complete

    pump(), flush() and close() may be called from any thread."""

    def __init__(self, path: str | os.PathLike, keyframe_every: int = 1000, *, info: dict | None = None,
                 chunk_events: int = 256, chunk_bytes: int = 1 << 20, flush_seconds: float = 2.0,
                 compress_level: int = 6) -> None:
        if keyframe_every < 1 or chunk_events < 1:
            raise KvscopeError(f"keyframe_every and chunk_events must be >= 1, got {keyframe_every} and "
                               f"{chunk_events}")
        self.path = Path(path)
        self.keyframe_every, self.chunk_events, self.chunk_bytes = keyframe_every, chunk_events, chunk_bytes
        self.flush_seconds, self.compress_level = flush_seconds, compress_level
        self.mirror = CacheMirror()  # the state every keyframe stores
        self.n_events = 0
        self.n_keyframes = 0
        self.chunks: list[ChunkRef] = []
        self.error: BaseException | None = None  # what stopped the background pump
        self._lock = threading.RLock()
        self._subscription: ev.Subscription | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pending = _PendingChunk(0)
        # digest of each long entry of the last keyframe -> where its bytes are (chunk offset, entry number)
        self._keyframe_entries: dict[bytes, tuple[int, int]] = {}
        self._closed = False
        try:
            self._file = open(self.path, "wb")
        except OSError as e:
            raise RecordingError(self.path, None, f"cannot create the recording: {e.strerror or e}") from None
        self.offset = 0
        try:
            self._write(header_bytes(self._info(info)))
            self._file.flush()  # a recorder killed at once still leaves a file that says what it is
        except BaseException:
            self._file.close()
            raise

    def _info(self, extra: dict | None) -> dict:
        info = {"writer": f"kvscope {kvscope_version()}", "python": sys.version.split()[0],
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "keyframe_every": self.keyframe_every}
        return {**info, **(extra or {})}

    @property
    def bytes_written(self) -> int:
        return self.offset

    @property
    def dropped(self) -> int:
        """Events the bus could not queue for this recorder (its queue was full); the recording holds an
        EventsDropped event where they are missing."""
        return self._subscription.dropped if self._subscription is not None else 0

    # ---- input -------------------------------------------------------------------------------
    def attach(self, bus: ev.EventBus, maxsize: int = 1 << 20) -> ev.Subscription:
        """Subscribe to `bus`: the recording gets the bus's current state first, then every event."""
        self._subscription = bus.subscribe(maxsize=maxsize, with_state=True)
        return self._subscription

    def start(self, interval: float = 0.05) -> None:
        """Pump the subscription every `interval` seconds on a daemon thread until close()."""
        if self._subscription is None:
            raise KvscopeError("the recorder is not attached: call recorder.attach(bus) first")
        self._thread = threading.Thread(target=self._pump_loop, args=(interval,), name="kvscope-recorder",
                                        daemon=True)
        self._thread.start()
        lifetime.close_at_exit(self, lifetime.WRITERS)

    def _pump_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.pump()
                with self._lock:
                    if self._pending.age() >= self.flush_seconds:
                        self._close_chunk()  # so that a recorder killed later loses little
                        self._file.flush()
            except Exception as e:  # kept for close(), which raises it: a thread has no caller to tell
                self.error = e
                return

    def pump(self) -> int:
        """Write every event queued on the subscription; returns how many."""
        with self._lock:
            if self._subscription is None or self._closed:
                return 0
            events = self._subscription.drain()
            for event in events:
                self.write(event)
            return len(events)

    def write(self, event: ev.Event) -> None:
        """Record one event (pump() calls this; a caller without a bus may too)."""
        with self._lock:
            if self._closed:
                raise RecordingError(self.path, self.offset, f"the recording is closed; {event.kind} "
                                                             f"#{event.seq_no} was not written")
            try:
                data = encode_event(event)
            except CodecError as e:
                raise RecordingError(self.path, self.offset, str(e)) from None
            self._pending.add(data)
            self.n_events += 1
            try:
                self.mirror.apply(event)
            except Exception as e:
                raise RecordingError(self.path, self.offset, f"{event.kind} #{event.seq_no} was recorded, but the "
                                     f"recorder's mirror cannot apply it, so keyframes would be wrong: "
                                     f"{type(e).__name__}: {e}") from e
            if self.n_events % self.keyframe_every == 0:
                self._close_chunk()
                self._write_keyframe()
            elif self._pending.count >= self.chunk_events or self._pending.nbytes >= self.chunk_bytes:
                self._close_chunk()

    # ---- output ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what is queued and buffered, so that a reader sees every event recorded so far."""
        with self._lock:
            self.pump()
            if not self._closed:
                self._close_chunk()
                self._file.flush()

    def close(self) -> None:
        """Stop the pump, write the last events, the index and the trailer, and close the file. Raises the
        error that stopped a background pump, if one did (the file is still closed, complete up to it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_WAIT_S)  # then the lock below waits for the pump it is in
            lifetime.discard(self)
        with self._lock:
            if self._closed:
                return
            try:
                if self.error is None:
                    self.pump()
                self._close_chunk()
                index = msgpack.packb([[c.tag.decode("ascii"), c.offset, c.first, c.count] for c in self.chunks])
                index_offset = self._write_chunk(INDEX, 0, len(self.chunks), index)
                self._write(TRAILER.pack(index_offset, TRAILER_MAGIC))
            finally:
                self._closed = True
                self._file.close()
                if self._subscription is not None:
                    self._subscription.close()
        if self.error is not None:
            raise RecordingError(self.path, None, f"recording stopped early: {self.error}") from self.error

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_chunk(self) -> None:
        pending = self._pending
        if pending.count:
            offset = self._write_chunk(EVENTS, pending.first, pending.count, bytes(pending.payload))
            self.chunks.append(ChunkRef(EVENTS, offset, pending.first, pending.count))
        self._pending = _PendingChunk(self.n_events)

    def _write_keyframe(self) -> None:
        """The mirror's state events; a long one with the same bytes as in the last keyframe (the Vocabulary,
        a ContextCreated: state that rarely changes) refers to where those bytes already are."""
        entries, seen, inline = _PendingChunk(self.n_events), {}, []
        for event in self.mirror.state_events():
            data = encode_event(event)
            key = digest(data) if len(data) >= DEDUP_MIN_BYTES else None
            where = self._keyframe_entries.get(key)
            if where is None:
                if key is not None:
                    inline.append((key, entries.count))
                entries.add(data)
            else:
                seen[key] = where
                entries.add_reference(*where)
        offset = self._write_chunk(KEYFRAME, self.n_events, entries.count, bytes(entries.payload))
        self._keyframe_entries = {**seen, **{key: (offset, number) for key, number in inline}}
        self.chunks.append(ChunkRef(KEYFRAME, offset, self.n_events, entries.count))
        self.n_keyframes += 1

    def _write_chunk(self, tag: bytes, first: int, count: int, raw: bytes) -> int:
        stored = zlib.compress(raw, self.compress_level)
        compression = ZLIB
        if len(stored) >= len(raw):
            stored, compression = raw, NO_COMPRESSION
        head = CHUNK_HEAD.pack(tag, compression, first, count, len(raw), len(stored), zlib.crc32(stored))
        offset = self.offset
        self._write(head + struct.pack("<I", zlib.crc32(head)) + stored)
        return offset

    def _write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            raise RecordingError(self.path, self.offset, f"cannot write: {e.strerror or e}") from None
        self.offset += len(data)


class _PendingChunk:
    """The entries of a chunk being filled."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.count = 0
        self.payload = bytearray()
        self.started = 0.0

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def add(self, data: bytes) -> None:
        if not self.count:
            self.started = time.monotonic()
        self.payload += ENTRY_LENGTH.pack(len(data))
        self.payload += data
        self.count += 1

    def add_reference(self, offset: int, number: int) -> None:
        self.payload += ENTRY_LENGTH.pack(REFERENCE) + ENTRY_REFERENCE.pack(offset, number)
        self.count += 1

    def age(self) -> float:
        return time.monotonic() - self.started if self.count else 0.0


