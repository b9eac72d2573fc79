"""A llama-server's turns and slots (kvscope's simulation, the server workload, or a real one watched from its
log): for every finished turn, its prompt's tokens as a stacked bar (served by the slot's cache, held but
processed again, new) with what the server decided (prefix kept, checkpoint restored, full re-processing
forced; ! a QUIRK), and per slot what it runs, keeps and the checkpoints it holds. Drawn from the watch
layer's ServerSlots, in the colours of the terminal explorer's slots panel (engine/watch/style.py)."""
from __future__ import annotations

import html

import ipywidgets as widgets
import plotly.graph_objects as go

from engine.watch import style
from engine.watch.describe import context_shifts_text, slot_keeps_text, turn_decision
from engine.watch.server_slots import OUTCOME_TEXT, ServerSlots, TurnView
from engine.watch.watcher import Watcher
from explorer.view import WatcherView

PARTS = (("reused", "served by the cache"), ("lost", "held, processed again"), ("new", "new tokens"))
OUTCOME_LABELS = {"new": "", "kept": "kept", "restored": "restored", "forced": "forced", "error": "error"}  # above bars
SHOWN_TURNS = 40  # the latest turns


def turn_parts(turn: TurnView) -> dict[str, int]:
    return {"reused": turn.n_past, "lost": turn.lost, "new": max(0, turn.n_prompt - turn.n_past - turn.lost)}


class ServerView(WatcherView):
    """The server's turns and slots; update() polls the watcher and redraws what changed. Hidden (an
    empty figure) while the source runs no server."""

    def __init__(self, watcher: Watcher, *, dark: bool = False, widget: bool = True) -> None:
        self.watcher, self.dark = watcher, dark
        self.figure = go.FigureWidget() if widget else go.Figure()
        for part, name in PARTS:
            self.figure.add_trace(go.Bar(name=name, marker_color=style.PROMPT_PART_COLORS[part],
                                         customdata=[], hovertemplate="%{x}<br>%{y} tokens " + name +
                                         "<br>%{customdata}<extra></extra>"))
        self.figure.update_layout(barmode="stack", height=300, margin=dict(l=40, r=10, t=60, b=60),
                                  title=dict(text="server turns: the prompt's tokens", font=dict(size=13), y=0.97),
                                  yaxis=dict(title="tokens"),
                                  legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0, traceorder="normal"),
                                  template="plotly_dark" if dark else "plotly_white")
        self.slots_html = widgets.HTML()
        self.widget = widgets.VBox([self.figure, self.slots_html]) if widget else self.figure
        self._shown: tuple = ()
        self.update()

    def forget(self) -> None:
        self._shown = ()

    @property
    def server(self) -> ServerSlots:
        return self.watcher.server

    def update(self) -> None:
        self.watcher.poll()
        server = self.server
        turns = sorted((t for s in server.slots.values() for t in s.turns), key=lambda t: t.task)[-SHOWN_TURNS:]
        shown = (tuple((t.task, t.n_past, t.n_prompt, t.outcome) for t in turns), self._slots_text(server))
        if shown == self._shown:
            return
        self._shown = shown
        labels = [f"{t.label or f'task {t.task}'} · slot {t.slot}" for t in turns]
        notes = [_note(t) for t in turns]
        with self.figure.batch_update():
            for trace, (part, _) in zip(self.figure.data, PARTS):
                trace.x, trace.y, trace.customdata = labels, [turn_parts(t)[part] for t in turns], notes
            self.figure.layout.annotations = [
                dict(x=label, y=t.n_prompt, text=OUTCOME_LABELS[t.outcome] + (" !" if t.quirk else ""), showarrow=False,
                     yshift=10, font=dict(size=11, color=style.OUTCOME_COLORS.get(t.outcome, "#999999")))
                for label, t in zip(labels, turns) if OUTCOME_LABELS.get(t.outcome)]
        self.slots_html.value = shown[1]

    def _slots_text(self, server: ServerSlots) -> str:
        if not server.active:
            return ""
        rows = []
        for view in sorted(server.slots.values(), key=lambda v: v.slot):
            color = style.seq_color(view.slot, self.dark)
            doing = (f"runs {html.escape(view.current.label or f'task {view.current.task}')}" if view.current
                     else slot_keeps_text(view))
            if view.context_shifts:
                doing += f" · {context_shifts_text(view.context_shifts)}"
            marks = ", ".join(str(n) for n in sorted(view.checkpoints))
            held = (f"{len(view.checkpoints)} checkpoints ({view.checkpoint_bytes / 2**20:.2f} MiB host memory) "
                    f"at n_tokens {marks}") if view.checkpoints else "no checkpoint"
            rows.append(f"<b style='color:{color}'>slot {view.slot}</b> · {doing} · {held}")
        totals = server.totals()
        if totals["tasks"]:
            rows.append(f"<span style='opacity:0.7'>{totals['tasks']} turns: {totals['processed']} of "
                        f"{totals['prompt']} prompt tokens processed · {totals['forced']} forced to re-process · "
                        f"{totals['restored']} saved by a checkpoint</span>")
        return "<br>".join(rows)


def _note(turn: TurnView) -> str:
    """A turn's hover: what the server decided, why (its words), the slots panel's few words on it, a QUIRK."""
    parts = [OUTCOME_TEXT.get(turn.outcome, ""), html.escape(turn.why), html.escape(turn_decision(turn)),
             html.escape(turn.quirk)]
    return "<br>".join(p for p in parts if p)
