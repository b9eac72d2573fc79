"""The status line: what runs, how fast, how full the caches are, and whether the view is right."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from engine.watch.watcher import Watcher


class StatusLine(Static):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $boost; padding: 0 1; }
    """

    def show_status(self, watcher: Watcher, tokens_per_s: float, source_label: str) -> None:
        text = Text()
        status = watcher.status
        state = status.state if status else "?"
        # the status event comes when the state changes; the steps' own events keep the count current
        step = max(status.step if status else 0, watcher.last_step.step if watcher.last_step else 0)
        text.append(f"{state} ", style="bold reverse" if state == "running" else
                    ("bold red" if state == "disconnected" else "bold"))
        if state == "disconnected":  # a remote session: RemoteSession reconnects by itself
            text.append(f" {status.message or 'the server is silent'}; retrying", style="red")
        decode = watcher.history.step  # the context's decode count, which the cell histories name
        text.append(f" step {step}" + (f" (decode {decode})" if decode >= 0 else "") + f" · {tokens_per_s:.0f} tok/s")
        for name, cache in watcher.mirror.caches.items():
            used = sum(int((st.pos >= 0).sum()) for st in cache.streams)
            total = cache.size * len(cache.streams)
            shifts = sum(int((st.shift != 0).sum()) for st in cache.streams)
            text.append(f" · {name} {used}/{total}")
            if shifts:
                text.append(f" ({shifts} to shift)")
        if watcher.backlog:
            text.append(f" · catching up: {watcher.backlog} events", style="yellow")
        if watcher.dropped:
            text.append(f" · dropped {watcher.dropped}, resynced {watcher.resyncs}", style="yellow")
        if watcher.stale:
            text.append(" · STALE", style="bold red")
        if source_label:
            text.append(f" · {source_label}", style="dim")
        self.update(text)
