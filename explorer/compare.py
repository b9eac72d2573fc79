"""A/B: two sessions of the same model on the same prompt, side by side. Each column shows its cell grid,
its memory per device and its speed; underneath, per position of the sequence, the KL divergence of
their next-token distributions and whether their most likely tokens agree (engine/watch/compare.py).

    ab = Compare.of_settings(a=dict(type_k="f16", type_v="f16"), b=dict(type_k="q4_0", type_v="q4_0"),
                             prompt="And God said", n_predict=64)
    ab            # in a notebook; ab.run() (or the start button) generates in both
    ab.comparison.summary()

Both sessions publish their distributions (publish_logits) and sample greedily, so while their
answers agree they are compared over the same text; from the first token they chose differently on,
the rows are greyed (see engine/watch/compare.py).
"""
from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING

import ipywidgets as widgets
import plotly.graph_objects as go

from engine import events as ev
from engine.watch import lifetime
from engine.watch.compare import DistributionComparison
from engine.watch.describe import status_parts, tokens_per_second
from engine.watch.watcher import Watcher
from explorer.grid import CellGrid
from explorer.memory import MemoryBars
from explorer.view import Shown, row

if TYPE_CHECKING:  # the engine's session imports torch: only of_settings makes sessions here
    from engine.runners.session import Session

COMMON_SETTINGS = dict(n_ctx=512, n_seq_max=1, kv_unified=True)
GREEDY = dict(temperature=0.0, seed=1)
AGREE_COLOR, DISAGREE_COLOR, OTHER_TEXT_COLOR = "#009E73", "#D55E00", "#BBBBBB"


def settings_text(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "defaults"


class _Column:
    """One session's side: its watcher, grid, memory bars and status."""

    def __init__(self, label: str, session: Session, settings: dict, columns: int) -> None:
        self.label, self.session = label, session
        self.watcher = Watcher.of(session)
        self.grid = CellGrid(self.watcher, columns=columns)
        self.bars = MemoryBars(self.watcher)
        self.title = widgets.HTML(f"<b>{html.escape(label)}</b> · {html.escape(settings_text(settings))}")
        self.status = widgets.HTML()
        self.steps: list[ev.WorkloadStep] = []
        self._events_seen = 0
        self.widget = widgets.VBox([self.title, self.status, self.grid.widget, self.bars.widget],
                                   layout=widgets.Layout(width="50%"))

    def update(self) -> None:
        self.watcher.poll()
        new = self.watcher.events_since(self._events_seen)
        self._events_seen = self.watcher.events
        self.steps = (self.steps + [e for e in new if isinstance(e, ev.WorkloadStep)])[-256:]
        self.grid.update()
        self.bars.update()
        parts = [text for text, _ in status_parts(self.watcher, with_error=True)]
        self.status.value = html.escape(" · ".join(parts)) + \
            f" · {tokens_per_second(self.steps, time.monotonic()):.0f} tok/s"


class Compare(Shown):
    """Two sessions side by side and their next-token distributions compared (see the module docstring)."""

    export_title = "kvscope A/B"

    def __init__(self, a: Session, b: Session, *, labels: tuple[str, str] = ("A", "B"),
                 settings: tuple[dict, dict] = ({}, {}), seq_id: int = 0, columns: int = 32,
                 every_s: float = 0.25) -> None:
        """a, b: sessions of the same model made with publish_logits=True (of_settings makes them)."""
        self.sessions = (a, b)
        self.columns = tuple(_Column(label, s, st, columns) for label, s, st in zip(labels, (a, b), settings))
        self.comparison = DistributionComparison(seq_id)
        self._logits = tuple(s.subscribe(1 << 16, kinds=(ev.OutputLogProbs, ev.TokenSampled)) for s in (a, b))
        self.figure = go.FigureWidget()
        self.figure.add_trace(go.Scatter(mode="lines+markers", name="KL(A‖B), same text", line=dict(color="#0072B2"),
                                         hovertemplate="pos %{x}: KL %{y:.4f} nats<extra></extra>"))
        self.figure.add_trace(go.Scatter(mode="markers", name="top-1 differs", hoverinfo="skip",
                                         marker=dict(symbol="x", size=10, color=DISAGREE_COLOR)))
        self.figure.add_trace(go.Scatter(mode="lines", name="after the texts differ", hoverinfo="skip",
                                         line=dict(color=OTHER_TEXT_COLOR, dash="dot")))
        self.figure.update_layout(height=260, margin=dict(l=50, r=10, t=40, b=40), xaxis_title="position",
                                  yaxis_title="KL (nats)", legend=dict(orientation="h", y=1.02, yanchor="bottom"))
        self.summary = widgets.HTML()
        self.prompt = widgets.Text(placeholder="And God said unto Moses", description="prompt",
                                   layout=widgets.Layout(width="420px"))
        self.add_button = widgets.Button(description="add to both", tooltip="the prompt as a sequence in both sessions")
        self.run_button = widgets.ToggleButton(description="start", icon="play", tooltip="generate in both")
        self.step_button = widgets.Button(description="step both", tooltip="one decode in each")
        self.message = widgets.HTML()
        self.add_button.on_click(lambda _: self.add_prompt(self.prompt.value))
        self.run_button.observe(lambda c: self.run() if c["new"] else self.pause(), names="value")
        self.step_button.on_click(lambda _: self.step())
        self.widget = widgets.VBox([
            row([self.prompt, self.add_button, self.run_button, self.step_button]), self.message,
            widgets.HBox([c.widget for c in self.columns]), self.summary, self.figure])
        # every redraw on a's worker: b's changes are queued there too, so two redraws never overlap
        self._stops = [a.on_change(self.update, every_s), b.on_change(lambda: a.call(self.update), every_s)]
        self.update()
        lifetime.close_at_exit(self, lifetime.FRONT_ENDS)

    @classmethod
    def of_settings(cls, model: str = "demo", *, a: dict, b: dict, prompt: str | None = None, n_predict: int = 64,
                    common: dict | None = None, labels: tuple[str, str] | None = None, **options) -> Compare:
        """Two sessions of `model` with the common settings and a's and b's own, generating greedily; the
        prompt (if any) is added to both."""
        from engine.runners.session import Session
        from engine.runners.workloads import WorkloadSpec

        base = {**COMMON_SETTINGS, **(common or {}), "publish_logits": True}
        spec = WorkloadSpec("generate", n_predict=n_predict, sampler=GREEDY)
        sessions = [Session(model, settings={**base, **own}, workload=spec) for own in (a, b)]
        view = cls(*sessions, labels=labels or ("A", "B"), settings=(a, b), **options)
        if prompt:
            view.add_prompt(prompt)
        return view

    # ---- commands to both ---------------------------------------------------------------------------
    def add_prompt(self, text: str) -> None:
        if not text.strip():
            self.message.value = "<span style='color:#C00000'>type a prompt first</span>"
            return
        for s in self.sessions:
            s.add_prompt(text)

    def run(self) -> None:
        for s in self.sessions:
            s.start()

    def pause(self) -> None:
        for s in self.sessions:
            s.pause()

    def step(self, n: int = 1) -> list:
        return [s.step(n) for s in self.sessions]

    # ---- drawing ------------------------------------------------------------------------------------
    def update(self) -> None:
        for sub, apply in zip(self._logits, (self.comparison.apply_a, self.comparison.apply_b)):
            for event in sub.drain():
                apply(event)
        for column in self.columns:
            column.update()
        rows = sorted(self.comparison.rows, key=lambda r: r.pos)
        same = [r for r in rows if r.same_text]
        after = [r for r in rows if not r.same_text]
        with self.figure.batch_update():
            kl, differs, other = self.figure.data
            kl.x, kl.y = [r.pos for r in same], [r.kl for r in same]
            differs.x, differs.y = [r.pos for r in same if not r.agree], [r.kl for r in same if not r.agree]
            other.x, other.y = [r.pos for r in after], [r.kl for r in after]
        s = self.comparison.summary()
        if not s["n"]:
            self.summary.value = "no position compared yet: add a prompt and step or start"
            return
        diverged = (f" · the texts differ from position {s['first_difference']} on (greyed)"
                    if s["first_difference"] is not None else " · same text throughout")
        self.summary.value = (f"<b>{s['n']}</b> positions compared over the same text · top-1 agreement "
                              f"<b>{100 * s['top1_agreement']:.1f}%</b> · KL mean {s['mean_kl']:.4f}, max "
                              f"{s['max_kl']:.4f} nats{diverged}")

    def figures(self) -> list:
        """Both grids and the divergence chart (what export_html and export_png write)."""
        return [self.columns[0].grid.figure, self.columns[1].grid.figure, self.figure]

    def close(self) -> None:
        lifetime.discard(self)
        for stop in self._stops:
            stop()
        for sub in self._logits:
            sub.close()
        for s in self.sessions:
            s.close()
