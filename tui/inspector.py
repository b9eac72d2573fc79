"""The cell under the cursor: where it is, what it holds, and the story of how it got there. Of a real
llama.cpp watched from its log, it says what the log leaves open: a shared cell's sequences it does not name,
a position it does not give."""
from __future__ import annotations

import numpy as np
from rich.text import Text

from engine.watch import style
from engine.watch.describe import open_seqs_words, position_text, unnamed_sharers_text
from engine.watch.history import ALLOCATED, CellHistory
from engine.watch.mirror import CacheMirror
from engine.watch.visibility import SequenceVisibility
from tui.text_panel import TextPanel

class CellInspector(TextPanel):
    DEFAULT_CSS = """
    CellInspector { height: auto; max-height: 12; border: round $primary-darken-2; padding: 0 1; }
    """

    def show_cell(self, mirror: CacheMirror, history: CellHistory, cache: str, stream: int, first: int, last: int,
                  seen: SequenceVisibility | None) -> None:
        self.border_title = f"cell {first}" if last - first == 1 else f"cells {first}..{last - 1}"
        text = Text()
        state = mirror.caches.get(cache)
        if state is None:
            self.show("no cache yet")
            return
        st = state.streams[stream]
        if last - first > 1:
            used = int((st.pos[first:last] >= 0).sum())
            text.append(f"{cache} stream {stream}: {used} of {last - first} cells used\n")
            unnamed = int(st.uncertain[first:last].sum()) if st.uncertain is not None else 0
            if unnamed:
                text.append(f"{unnamed} shared by sequences the log does not name\n")
            text.append("zoom in (+) to see single cells", style="dim")
            self.show(text)
            return
        pos = int(st.pos[first])
        seqs = np.flatnonzero(np.unpackbits(st.seq_bits[first], bitorder="little")).tolist() if pos >= 0 else []
        text.append(f"{cache} · stream {stream} · ")
        if pos < 0:
            text.append("empty", style="dim")
        else:
            dark = self.app.current_theme.dark
            text.append(f"{position_text(pos)} · ")
            if st.uncertain is not None and st.uncertain[first]:
                # the log's dump leaves the cell's sequences open: these may hold it
                code = int(st.uncertain[first])
                lead, why = open_seqs_words(code)
                if len(seqs) >= 2:
                    text.append(lead)
                    for k, s in enumerate(seqs):
                        text.append(("," if k else "") + f" {s}", style=style.seq_color(s, dark))
                    text.append(f" ({why}) ")
                else:
                    text.append(unnamed_sharers_text(seqs, code) + " ")
            else:
                text.append("seq" if len(seqs) == 1 else "seqs")
                for s in seqs:  # each in its colour; "seqs 0 1 2" rather than "seq 0 seq 1 seq 2": a narrow box
                    text.append(f" {s}", style=style.seq_color(s, dark))
                text.append(" ")
            token = _token_of(history, cache, stream, first)
            if token:
                text.append(f"· token {token!r}")
            shift = int(st.shift[first])
            if shift:
                text.append(f" · pending shift {shift:+d}", style="bold")
        if seen is not None and cache in seen.caches:
            text.append("\n" + seen.caches[cache].describe(), style="dim")
        lines = history.lines(cache, stream, first)
        if not lines:
            text.append("\nno event touched this cell since the watch began", style="dim italic")
        for k, line in enumerate(lines):  # newest first: a short box still shows what happened last
            text.append("\n" + ("▸ " if k == 0 else "  ") + line, style="italic" if k == 0 else "dim italic")
        self.show(text)


def _token_of(history: CellHistory, cache: str, stream: int, cell: int) -> str:
    """The text of the token the cell's last allocation placed ('' when the history does not reach it)."""
    for entry in reversed(history.entries(cache, stream, cell)):
        if entry.kind == ALLOCATED:
            return history.pieces[entry.token] if 0 <= entry.token < len(history.pieces) else f"#{entry.token}"
    return ""
