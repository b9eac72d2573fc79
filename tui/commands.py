"""The command palette (ctrl+p): every session command, on the selected sequence where it takes one."""
from __future__ import annotations

from functools import partial

from textual.command import Hit, Hits, Provider


class ListedCommands(Provider):
    """A palette provider of the commands its subclass lists in _commands() (name, help text, what runs it):
    all of them when the palette opens, those whose name matches as one types."""

    async def discover(self) -> Hits:
        for name, help_text, run in self._commands():
            yield Hit(1.0, name, run, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, run in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), run, help=help_text)


class SequenceCommands(ListedCommands):
    """Session commands: run, step, sequence operations, context shift, clear, state, settings, record."""

    def _commands(self) -> list[tuple[str, str, object]]:
        app = self.app
        session = app.source.session if app.source.live else None
        seq = app.selected_seq
        out = [("help: what the glyphs and colours mean", "the legend and every key", app.action_help)]
        if not (app.blocks_mode or app.attached):  # a log or KV events tell no ubatch (tui/app.py NEEDS_UBATCHES)
            out.append(("mask: the last ubatch's attention mask",
                        "its tokens x the cells, as the kernel masks them (m)", app.action_show_mask))
        if session is None:
            return out
        out += [
            ("start / pause", "run steps until paused", app.action_toggle_run),
            ("step", "one decode", app.action_step),
            ("prompt: add a sequence", "a new sequence (or request) from a prompt", app.action_prompt),
            ("settings: rebuild the context", "n_ctx, pad, streams, cache types, windows, devices", app.action_settings),
            ("clear the cache", "llama_memory_clear: every cell of every stream", partial(self._run, "clear")),
            ("save the whole state", "llama_state_get_data, to kvscope-state.bin", partial(self._save, None)),
            ("load the whole state", "llama_state_set_data, from kvscope-state.bin", partial(self._load, None)),
            ("record: start or stop", "write the event stream to a .kvtrace file", app.action_record),
        ]
        if seq is not None:
            out += [
                (f"seq_rm {seq}: remove the sequence", "llama_memory_seq_rm(seq, -1, -1)", partial(app.action_seq_op, "rm")),
                (f"seq_keep {seq}: keep only it", "llama_memory_seq_keep", partial(app.action_seq_op, "keep")),
                (f"seq_cp {seq}: copy to a free sequence", "llama_memory_seq_cp(seq, free, -1, -1)",
                 partial(app.action_seq_op, "cp")),
                (f"seq_add {seq} -1: move its positions down by one", "llama_memory_seq_add(seq, 0, -1, -1)",
                 partial(self._run, "seq_add", seq, 0, -1, -1)),
                (f"seq_add {seq} +1: move its positions up by one", "llama_memory_seq_add(seq, 0, -1, 1)",
                 partial(self._run, "seq_add", seq, 0, -1, 1)),
                (f"seq_div {seq} 2: halve its positions (self-extend)", "llama_memory_seq_div(seq, 0, -1, 2)",
                 partial(self._run, "seq_div", seq, 0, -1, 2)),
                (f"context shift of seq {seq}", "keep 4 positions, discard half of the rest, move the tail down",
                 partial(app.action_seq_op, "shift")),
                (f"save seq {seq}'s state", f"llama_state_seq_get_data, to kvscope-seq{seq}.bin", partial(self._save, seq)),
                (f"load seq {seq}'s state", f"llama_state_seq_set_data, from kvscope-seq{seq}.bin",
                 partial(self._load, seq)),
            ]
        return out

    def _run(self, name: str, *args) -> None:
        app = self.app
        app.command(name, getattr(app.source.session, name)(*args), done=f"{name} done")

    def _save(self, seq: int | None) -> None:
        path = "kvscope-state.bin" if seq is None else f"kvscope-seq{seq}.bin"
        self.app.command("save_state", self.app.source.session.save_state(path, seq_id=seq),
                         done=f"state saved to {path} ({{result}} bytes)")

    def _load(self, seq: int | None) -> None:
        path = "kvscope-state.bin" if seq is None else f"kvscope-seq{seq}.bin"
        self.app.command("load_state", self.app.source.session.load_state(path, seq_id=seq),
                         done=f"state loaded from {path}")

