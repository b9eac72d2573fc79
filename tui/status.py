"""The status line: what runs (or where a replay stands, or which llama.cpp log is watched and how its reading
goes), how fast, how full the caches are, and whether the view is right (the parts come from the watch layer,
as the notebook explorer's). It fits its width: the source's label and the speed go first, the state, the
step and any warning never."""
from __future__ import annotations

from engine.watch import block_views
from engine.watch.describe import attached_status_parts, status_parts
from engine.watch.watcher import Watcher
from tui.fit import FittedLine, Part

TONES = {"running": "bold reverse", "state": "bold", "error": "bold red", "warning": "yellow", "": ""}
DECODE_RANK, SPEED_RANK, CACHE_RANK, LABEL_RANK = 4, 3, 2, 9
DUMPS_RANK, DROPPED_RANK, NOT_UNDERSTOOD_RANK = 1, 3, 5  # a watched log's figures; dropped dumps, when any, never go
STATS_RANK = 5  # KV event publishers' figures that are not warnings


class StatusLine(FittedLine):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $boost; padding: 0 1; }
    """

    def show_status(self, watcher: Watcher, tokens_per_s: float, source_label: str, *, replay=None,
                    playing: bool = False) -> None:
        """replay: the Replay shown (its position and whether its file was cut short replace the recorded
        state and the speed); playing: it advances by itself."""
        (state, tone), *rest = status_parts(watcher)
        if replay is None:
            parts = [Part(f"{state} ", TONES[tone])]
        else:
            parts = [Part("▶ playing " if playing else "replay ", TONES["running" if playing else "state"]),
                     Part(f"event {replay.position + 1} of {len(replay)}", before=" ")]
            if replay.reader.truncated:
                parts.append(Part("CUT SHORT: the recorder did not finish", TONES["error"]))
        for text, tone in rest:
            if text.startswith(("step ", "decode ", "no decode")):
                step, decode, count = text.partition(" (decode ")
                parts.append(Part(step, before=" " if replay is None else " · "))
                if decode:
                    parts.append(Part(f" (decode {count}", rank=DECODE_RANK, before=""))
                if replay is None and step.startswith("step "):
                    parts.append(Part(f"{tokens_per_s:.0f} tok/s", rank=SPEED_RANK))
            elif tone == "error" and text.endswith("retrying"):
                parts.append(Part(text, "red", before=" "))
            else:
                parts.append(Part(text, TONES[tone], rank=CACHE_RANK if tone == "" else 0))
        if source_label:
            parts.append(Part(source_label, "dim", rank=LABEL_RANK, shrinks=True))
        self.show_parts(parts)

    def show_attached_status(self, watcher: Watcher, log_label: str = "") -> None:
        """A llama.cpp watched from its log: what is watched and how it ended, the log's figures, the caches.
        log_label: a saved log's path (a process says who it is in its first part)."""
        (state, tone), *rest = attached_status_parts(watcher)
        parts = [Part(state, TONES[tone])]
        for text, tone in rest:
            if tone:
                rank = 0  # a warning (dumps dropped, the view behind) is never left out
            elif text.endswith(" read"):
                rank = DUMPS_RANK
            elif text.endswith(" dropped to keep up"):
                rank = DROPPED_RANK
            elif text.endswith(" not understood"):
                rank = NOT_UNDERSTOOD_RANK
            else:
                rank = CACHE_RANK
            parts.append(Part(text, TONES[tone], rank=rank))
        if log_label and log_label not in state:
            parts.append(Part(log_label, "dim", rank=LABEL_RANK, shrinks=True))
        self.show_parts(parts)

    def show_block_status(self, watcher: Watcher, source_label: str) -> None:
        """vLLM / SGLang publishers watched: whether they still are, the workers and blocks, how the reading goes
        (batches, lost, replayed, malformed, unknown tags and fields: a warning, never left out, when any), and
        the source's label."""
        status, blocks = watcher.status, watcher.mirror.blocks
        state = status.state if status is not None else "waiting"
        parts = [Part(state, TONES["state"])]
        if watcher.stale:
            parts.append(Part("events lost: resyncing", TONES["warning"]))
        workers = blocks.workers()
        held = sum(blocks.held(w) for w in workers)
        # after the warnings, the last thing left out: how many workers and blocks are watched
        parts.append(Part(f"{len(workers)} worker{'s' if len(workers) != 1 else ''}, {held:,} blocks", rank=1))
        for text, warning in block_views.stats_parts(blocks):
            parts.append(Part(text, TONES["warning"]) if warning else Part(text, rank=STATS_RANK))
        if source_label:
            parts.append(Part(source_label, "dim", rank=LABEL_RANK, shrinks=True))
        self.show_parts(parts)
