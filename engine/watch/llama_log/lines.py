"""llama.cpp's log text, cut into lines and cleaned of what common/log.cpp puts around a message.

A log read live arrives in pieces: a line cut by a read waits for its end. Windows line ends, colour codes
(`--log-colors`), the time and level prefix (`0.00.500.093 I `, `--log-timestamps`, `--log-prefix`) are
accepted or absent. common/log.cpp writes one message per entry; a message without a final newline (an
HTTP thread's, in llama-server) runs into the next entry's prefix, so a prefix found inside a line starts a
new one there.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TIME_PREFIX = re.compile(r"(\d+\.\d{2}\.\d{3}\.\d{3}) ")
LEVEL_PREFIX = re.compile(r"([DIWE]) ")
PREFIX_INSIDE = re.compile(r"(?<=\S)(?=\d+\.\d{2}\.\d{3}\.\d{3} [DIWE] )")
LEVELS = {"D": "debug", "I": "info", "W": "warn", "E": "error"}


@dataclass(frozen=True)
class LogLine:
    """One line of a message: its text without prefix, and the level letter's name ("" when the log has none)."""

    text: str
    level: str = ""


class LineSplitter:
    """Bytes or text in, cleaned lines out; the partial last line is kept until its end comes."""

    def __init__(self) -> None:
        self._tail = ""
        self._tail_bytes = b""
        self.prefixed_log = False  # a time prefix was seen: look for prefixes inside lines too

    def feed(self, data: str | bytes) -> list[LogLine]:
        return [line for raw in self.split(data) for line in self.clean(raw)]

    def split(self, data: str | bytes) -> list[str]:
        """The complete lines in what came so far, as they are (clean() them, or read a dump's rows raw)."""
        text = self._decode(data)
        if not text:
            return []
        text = self._tail + text
        cut = text.rfind("\n")
        if cut < 0:
            self._tail = text
            return []
        self._tail = text[cut + 1:]
        return text[:cut].split("\n")

    def finish(self) -> list[LogLine]:
        """The partial last line, as it is (the log ended there)."""
        text = self._tail + (self._tail_bytes.decode("utf-8", errors="replace") if self._tail_bytes else "")
        self._tail, self._tail_bytes = "", b""
        return self.clean(text) if text else []

    @property
    def pending(self) -> int:
        """Characters held back waiting for their line's end."""
        return len(self._tail) + len(self._tail_bytes)

    def _decode(self, data: str | bytes) -> str:
        if isinstance(data, str):
            return data
        data = self._tail_bytes + data
        # a multi-byte character cut by the read waits for its other bytes
        keep = 0
        for back in range(1, min(4, len(data)) + 1):
            byte = data[-back]
            if byte < 0x80:
                break
            if byte >= 0xC0:  # the lead byte: is its character complete?
                need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                keep = back if back < need else 0
                break
        self._tail_bytes = data[len(data) - keep:] if keep else b""
        return (data[:len(data) - keep] if keep else data).decode("utf-8", errors="replace")

    def clean(self, raw: str) -> list[LogLine]:
        """One raw line, without its line end, colour codes and prefix; several where a message without a
        final newline ran into the next entry's prefix."""
        if raw.endswith("\r"):
            raw = raw[:-1]
        if "\x1b" in raw:
            raw = ANSI_ESCAPE.sub("", raw)
        # the level letter between spaces is the cheap sign of a prefix inside (rows of a dump never have one)
        if (self.prefixed_log and len(raw) > 16 and (" D " in raw or " I " in raw or " W " in raw or " E " in raw)
                and PREFIX_INSIDE.search(raw, 1)):
            return [self._line(piece) for piece in PREFIX_INSIDE.split(raw)]
        return [self._line(raw)]

    def _line(self, raw: str) -> LogLine:
        if not raw or not (raw[0].isdigit() or raw[1:2] == " "):
            return LogLine(raw)
        match = TIME_PREFIX.match(raw)
        if match:
            self.prefixed_log = True
            raw = raw[match.end():]
        if raw in LEVELS:  # a level letter before an empty message, its space trimmed by a copy
            return LogLine("", LEVELS[raw])
        match = LEVEL_PREFIX.match(raw)
        if match:
            return LogLine(raw[2:], LEVELS[match.group(1)])
        return LogLine(raw)
