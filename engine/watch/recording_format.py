"""The `.kvtrace` file layout shared by the writer (recorder.py) and the reader (recording_reader.py):
magic, header, chunk heads, the index trailer and the error they raise. The layout, byte by byte, and
the versioning rules: docs/recording-format.md.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib
from dataclasses import dataclass

import msgpack

from engine import events as ev
from engine.errors import KvscopeError

FILE_MAGIC = b"\x89KVT\r\n\x1a\n"  # the \r\n, \x1a and \n show a file mangled by a text-mode copy
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHI")  # magic, format version, schema version, info length; info and crc32 follow
CHUNK_HEAD = struct.Struct("<4sB3xQIIII")  # tag, compression, first, count, raw length, stored length, payload crc
CHUNK_HEAD_SIZE = CHUNK_HEAD.size + 4  # and the crc32 of the head itself
TRAILER = struct.Struct("<Q8s")  # offset of the index chunk, TRAILER_MAGIC
TRAILER_MAGIC = b"KVTINDEX"
EVENTS, KEYFRAME, INDEX = b"EVTS", b"KEYF", b"INDX"
NO_COMPRESSION, ZLIB = 0, 1
ENTRY_LENGTH = struct.Struct("<I")
REFERENCE = 0xFFFFFFFF  # an entry length that announces a reference to an earlier chunk's entry
ENTRY_REFERENCE = struct.Struct("<QI")  # chunk offset, entry number
DEDUP_MIN_BYTES = 1024  # keyframe entries at least this long are stored once (a Vocabulary, a ContextCreated)
CHUNK_CACHE = 16  # chunks a reader keeps decompressed


class RecordingError(KvscopeError):
    """A recording that cannot be written or read: names the file and, where known, the byte offset."""

    def __init__(self, path: str | os.PathLike, offset: int | None, message: str) -> None:
        self.path, self.offset = str(path), offset
        where = f"{self.path}" if offset is None else f"{self.path}, byte {offset}"
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class ChunkRef:
    """Where a chunk is and what it holds. EVTS: events first..first+count-1; KEYF: `count` state events,
    the state right after event first-1."""

    tag: bytes
    offset: int
    first: int
    count: int


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def header_bytes(info: dict) -> bytes:
    try:
        body = msgpack.packb(info)
    except (TypeError, ValueError, OverflowError) as e:
        raise KvscopeError(f"the recording's info must hold plain values (str, numbers, lists, dicts): {e}") from None
    fixed = HEADER.pack(FILE_MAGIC, FORMAT_VERSION, ev.SCHEMA_VERSION, len(body))
    return fixed + body + struct.pack("<I", zlib.crc32(fixed[8:] + body))


def kvscope_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvscope")
    except metadata.PackageNotFoundError:
        return "(not installed)"


