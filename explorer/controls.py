"""The controls of a live session: run, pause and step; a prompt for a new sequence; the sequence
operations on the selected sequence (llama_memory_seq_rm / cp / keep / add / div, a context shift, clear);
save and load state; record the event stream. Every button sends a session command (a Future) and
reports its result on the message line; nothing here touches the cache itself."""
from __future__ import annotations

import html
from typing import Callable

import ipywidgets as widgets

from engine.watch.describe import free_seq
from explorer.view import row

WORKLOADS = ("idle", "generate", "parallel", "server")


def button(description: str, tooltip: str, width: str = "auto", style: str = "") -> widgets.Button:
    return widgets.Button(description=description, tooltip=tooltip, button_style=style,
                          layout=widgets.Layout(width=width))


class SessionControls:
    """Buttons and fields that drive `session`; `selected()` says which sequence the operations act on."""

    def __init__(self, session, watcher, selected: Callable[[], int | None], *, recorder_path: str = "kvscope.kvtrace",
                 state_path: str = "kvscope-state.bin") -> None:
        self.session, self.watcher, self.selected = session, watcher, selected
        self.message = widgets.HTML()
        self.recorder = None
        self.run = widgets.ToggleButton(description="start", tooltip="run steps until paused", icon="play")
        self.step = button("step", "one decode")
        self.n_steps = widgets.BoundedIntText(value=1, min=1, max=10_000, layout=widgets.Layout(width="70px"))
        self.speed = widgets.FloatSlider(value=session.status().steps_per_second if session is not None else 8.0, min=0, max=50,
                                         step=1, description="steps/s", readout_format=".0f",
                                         tooltip="0: as fast as the machine goes", continuous_update=False)
        self.workload = widgets.Dropdown(options=WORKLOADS, description="workload",
                                         value=session.status().workload if session is not None else "idle",
                                         tooltip="idle: prompts you add; generate: each prompt generates; "
                                                 "parallel: llama.cpp's parallel clients",
                                         layout=widgets.Layout(width="200px"))
        self.prompt = widgets.Text(placeholder="And God said unto Moses", description="prompt",
                                   layout=widgets.Layout(width="420px"))
        self.add_prompt = button("add", "the prompt as a new sequence (a new request of the parallel workload)")
        self.ops = {
            "rm": button("rm", "llama_memory_seq_rm(seq, -1, -1): remove the sequence"),
            "cp": button("cp", "llama_memory_seq_cp(seq, free, -1, -1): copy it to a free sequence"),
            "keep": button("keep", "llama_memory_seq_keep(seq): remove every other sequence"),
            "add": button("add Δ", "llama_memory_seq_add(seq, 0, -1, Δ): move its positions by Δ"),
            "div": button("div d", "llama_memory_seq_div(seq, 0, -1, d): divide its positions (self-extend)"),
            "shift": button("context shift", "keep n_keep positions, discard half of the rest, move the tail down"),
            "clear": button("clear", "llama_memory_clear: every cell of every stream", style="danger"),
        }
        self.delta = widgets.IntText(value=-1, description="Δ", layout=widgets.Layout(width="110px"),
                                     style={"description_width": "20px"})
        self.divisor = widgets.BoundedIntText(value=2, min=1, max=1024, description="d",
                                              layout=widgets.Layout(width="110px"), style={"description_width": "20px"})
        self.n_keep = widgets.BoundedIntText(value=4, min=0, max=1 << 20, description="n_keep",
                                             layout=widgets.Layout(width="150px"), style={"description_width": "50px"})
        self.state_path = widgets.Text(value=state_path, description="state file", layout=widgets.Layout(width="260px"))
        self.seq_only = widgets.Checkbox(value=False, description="selected sequence only", indent=False,
                                         layout=widgets.Layout(width="190px"))
        self.save = button("save", "llama_state_get_data (or _seq_ with the box ticked) to the file", "70px")
        self.load = button("load", "llama_state_set_data (or _seq_) from the file", "70px")
        self.record_path = widgets.Text(value=recorder_path, description="recording", layout=widgets.Layout(width="260px"))
        self.record = widgets.ToggleButton(description="record", tooltip="write the event stream to a .kvtrace file",
                                           icon="circle", layout=widgets.Layout(width="100px"))
        self._wire()
        self.widget = widgets.VBox([
            row([self.run, self.step, self.n_steps, self.speed, self.workload]),
            row([self.prompt, self.add_prompt]),
            row([*(self.ops[k] for k in ("rm", "cp", "keep", "add")), self.delta, self.ops["div"], self.divisor,
                          self.ops["shift"], self.n_keep, self.ops["clear"]]),
            row([self.state_path, self.seq_only, self.save, self.load, self.record_path, self.record]),
            self.message])

    # ---- what the buttons do ------------------------------------------------------------------------
    def _wire(self) -> None:
        self.run.observe(lambda c: self.toggle_run(c["new"]), names="value")
        self.step.on_click(lambda _: self.command("step", self.session.step(self.n_steps.value),
                                                  lambda r: f"{len(r)} step{'s' if len(r) != 1 else ''} done"))
        self.speed.observe(lambda c: self.command("set_speed", self.session.set_speed(c["new"]),
                                                  lambda _: f"speed: {c['new']:.0f} steps/s" if c["new"] else
                                                  "speed: as fast as possible"), names="value")
        self.add_prompt.on_click(lambda _: self.add())
        self.workload.observe(lambda c: self.command(
            "set_workload", self.session.set_workload(c["new"]), lambda _: f"workload: {c['new']}"), names="value")
        for name, b in self.ops.items():
            b.on_click(lambda _, name=name: self.seq_op(name))
        self.save.on_click(lambda _: self.save_state())
        self.load.on_click(lambda _: self.load_state())
        self.record.observe(lambda c: self.toggle_record(c["new"]), names="value")

    def tell(self, text: str, ok: bool = True) -> None:
        colour = "inherit" if ok else "#C00000"
        self.message.value = f"<span style='color:{colour}'>{html.escape(text)}</span>"

    def command(self, name: str, future, done: Callable[[object], str]) -> None:
        """Report a session command's result (or its error) on the message line when it completes."""
        def report(f) -> None:
            error = f.exception()
            self.tell(done(f.result()) if error is None else f"{name} failed: {error}", error is None)
        future.add_done_callback(report)

    def toggle_run(self, on: bool) -> None:
        self.run.description, self.run.icon = ("pause", "pause") if on else ("start", "play")
        self.command("start" if on else "pause", self.session.start() if on else self.session.pause(),
                     lambda _: "running" if on else "paused")

    def add(self) -> None:
        text = self.prompt.value.strip()
        if not text:
            self.tell("type a prompt first", False)
            return
        self.command("add_prompt", self.session.add_prompt(text), lambda r: f"prompt added: {r}")

    def seq_op(self, name: str) -> None:
        """One sequence operation on the selected sequence (clear needs none)."""
        session = self.session
        if name == "clear":
            self.command("clear", session.clear(), lambda _: "cache cleared")
            return
        seq = self.selected()
        if seq is None:
            self.tell(f"{name}: select a sequence first (the seq menu, or click one of its cells)", False)
            return
        if name == "rm":
            self.command("seq_rm", session.seq_rm(seq, -1, -1), lambda _: f"seq {seq} removed")
        elif name == "cp":
            dst = free_seq(self.watcher.mirror)
            self.command("seq_cp", session.seq_cp(seq, dst, -1, -1), lambda _: f"seq {seq} copied to seq {dst}")
        elif name == "keep":
            self.command("seq_keep", session.seq_keep(seq), lambda _: f"only seq {seq} kept")
        elif name == "add":
            delta = self.delta.value
            self.command("seq_add", session.seq_add(seq, 0, -1, delta), lambda _: f"seq {seq} moved by {delta:+d}")
        elif name == "div":
            d = self.divisor.value
            self.command("seq_div", session.seq_div(seq, 0, -1, d), lambda _: f"seq {seq}'s positions divided by {d}")
        elif name == "shift":
            self.command("context_shift", session.context_shift(seq, n_keep=self.n_keep.value),
                         lambda r: f"context shift of seq {seq}: {r} positions discarded")

    def _state_target(self) -> tuple[str, int | None] | None:
        seq = self.selected() if self.seq_only.value else None
        if self.seq_only.value and seq is None:
            self.tell("select a sequence first, or untick 'selected sequence only'", False)
            return None
        return self.state_path.value.strip(), seq

    def save_state(self) -> None:
        target = self._state_target()
        if target is not None:
            path, seq = target
            self.command("save_state", self.session.save_state(path, seq_id=seq),
                         lambda n: f"state{f' of seq {seq}' if seq is not None else ''} saved to {path} ({n} bytes)")

    def load_state(self) -> None:
        target = self._state_target()
        if target is not None:
            path, seq = target
            self.command("load_state", self.session.load_state(path, seq_id=seq),
                         lambda _: f"state loaded from {path}" + (f" into seq {seq}" if seq is not None else ""))

    def toggle_record(self, on: bool) -> None:
        from engine.watch.recording import Recorder

        if not on:
            if self.recorder is not None:
                self.recorder.close()
                self.tell(f"recording written: {self.recorder.n_events} events to {self.recorder.path}")
                self.recorder = None
            return
        bus = getattr(self.session, "bus", None)
        if bus is None:
            self.tell("recording needs a session run here (not a remote one)", False)
            self.record.value = False
            return
        try:
            self.recorder = Recorder(self.record_path.value.strip())
        except Exception as e:  # noqa: BLE001 - a bad path is told, never raised into the notebook
            self.tell(f"cannot record: {e}", False)
            self.record.value = False
            return
        self.recorder.attach(bus)
        self.recorder.start()
        self.tell(f"recording to {self.recorder.path} (press record again to stop)")

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
