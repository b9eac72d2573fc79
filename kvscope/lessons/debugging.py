"""Notebook 7, debugging stories: each story's scenario, set up and run on the demo model, and the checks
that keep the notebook's prose true, so that its cells show the idea in a few lines.

Story 1: a chat on a simulated one-slot llama-server whose prompts are re-processed every turn (the sliding
window's cache no longer holds what the next prompt needs). Story 2: a context shift that drops the system
prompt. Story 3: split streams that refuse a long prompt while the total has room.

Every story runs with one sliding window, WINDOW positions (the demo model's own is 64): small enough that a
sliding-window cache of a few dozen cells fills during a short chat.
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine import events as ev
from engine.runners.session import Session
from engine.runners.workloads import WorkloadSpec
from engine.watch import Watcher
from engine.watch.describe import describe_event
from engine.watch.history import ALLOCATED

WINDOW = 16  # positions in every story's sliding window (swa_window=): one size for the whole notebook
GREEDY = {"temperature": 0.0}  # the same text on every run

_scratch: Path | None = None  # chat scripts go here, not into the reader's folder


def scratch_folder() -> Path:
    """A temporary folder for the chat scripts, removed when Python exits (a notebook leaves the reader's
    folder as it found it)."""
    global _scratch
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="kvscope-lesson-"))
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


# ---- story 1: prompts re-processed every turn ------------------------------------------------------------------
CHAT_TURNS = [
    ("Who was Moses?",
     "<think>The User asks about Moses. He led the children of Israel out of Egypt and gave them the law.</think>"
     "He led Israel out of Egypt."),
    ("And his brother?",
     "<think>Aaron was the elder brother of Moses and the first high priest of Israel.</think>Aaron, the high priest."),
    ("Thank you.", "You are welcome."),
]
SYSTEM_PROMPT = "You answer briefly."
# n_ubatch 16: llama.cpp sizes the SWA cache n_swa x n_seq_max + n_ubatch (src/llama-kv-cache-iswa.cpp), 32 cells
SERVER_SETTINGS = dict(n_ctx=256, n_seq_max=1, pad=16, n_batch=64, n_ubatch=16, swa_window=WINDOW)


def chat_file(reasoning: str = "strip") -> Path:
    """The chat script of story 1 (docs/server-sim.md's format): one client, three turns of a reasoning model.
    reasoning "strip": the template drops earlier answers' <think> blocks (as most reasoning templates do);
    "keep": it renders them as generated."""
    chat = {"system": SYSTEM_PROMPT, "reasoning": reasoning,
            "conversations": [{"name": "ann", "slot": 0,
                               "turns": [{"user": u, "assistant": a} for u, a in CHAT_TURNS]}]}
    path = scratch_folder() / f"chat-{reasoning}.json"
    path.write_text(json.dumps(chat), encoding="utf-8")
    return path


def show_chat() -> None:
    """The chat as the client sends it, turn by turn."""
    print(f"system: {SYSTEM_PROMPT}")
    for user, assistant in CHAT_TURNS:
        print(f"user:      {user}\nassistant: {assistant}")


@dataclass
class Served:
    """A chat run to its end on a simulated llama-server, and a watcher that saw every event."""

    session: Session
    watcher: Watcher

    def turns(self) -> list:
        """The finished turns, in order: what the server decided and how many prompt tokens it processed."""
        return sorted((t for s in self.watcher.server.slots.values() for t in s.turns), key=lambda t: t.task)

    def outcomes(self) -> list[str]:
        return [t.outcome for t in self.turns()]

    def processed(self) -> int:
        """Prompt tokens processed over the whole chat (the work the cache did not save)."""
        return sum(t.n_processed for t in self.turns())

    def decisions(self) -> list[ev.ServerPromptReused]:
        """llama-server's decision for each prompt, with the numbers it compared."""
        return [e for e in self.watcher.recent if isinstance(e, ev.ServerPromptReused)]

    def log_lines(self, text: str) -> list[str]:
        """The server's own log lines that contain `text`."""
        return [e.text for e in self.watcher.recent if isinstance(e, ev.ServerLogLine) and text in e.text]

    def checkpoints(self, action: str) -> list[ev.CheckpointChanged]:
        return [e for e in self.watcher.recent if isinstance(e, ev.CheckpointChanged) and e.action == action]

    def table(self) -> None:
        """One line per turn: its prompt, what the cache served, what was processed, the server's outcome."""
        for t in self.turns():
            print(f"{t.label:<12} prompt {t.n_prompt:3d} tokens, reused {t.n_past:3d}, processed {t.n_processed:3d}: "
                  f"{t.outcome}")

    def cache_size(self, cache: str) -> int:
        return self.watcher.mirror.caches[cache].size

    def positions(self, cache: str) -> tuple[int, int]:
        """The lowest and highest position the slot's sequence holds in `cache`."""
        pos = self.watcher.mirror.caches[cache].streams[0].pos
        return int(pos[pos >= 0].min()), int(pos.max())

    def close(self) -> None:
        self.session.close()


def serve(model, *, swa_full: bool = False, ctx_checkpoints: int = 32, reasoning: str = "strip") -> Served:
    """Story 1's chat on a simulated llama-server with one slot (the `server` workload, as `kvscope server-sim`
    runs it), stepped to the end. ctx_checkpoints is llama-server's -ctxcp, swa_full its --swa-full."""
    session = Session(model, settings=dict(SERVER_SETTINGS, swa_full=swa_full), threaded=False, threads=1,
                      workload=WorkloadSpec("server", n_clients=1, chat=str(chat_file(reasoning)), sampler=GREEDY,
                                            ctx_checkpoints=ctx_checkpoints))
    watcher = Watcher.of(session, recent=20_000)  # before the first step: it sees every event
    while session.step(100).result()[-1].phase != "idle":
        pass
    watcher.poll()
    return Served(session, watcher)


def decision_text(e: ev.ServerPromptReused) -> str:
    """llama-server's test for a sliding-window cache, in words, with the numbers it compared."""
    if e.pos_min_thold < 0 or e.n_common == 0:
        return f"task {e.task}: nothing in common with the cache, the whole prompt is new"
    verdict = ("not below it: forced to re-process" if e.forced_full else
               "not below it: a checkpoint restored" if e.restored_n_tokens >= 0 else "below it: the prefix reused")
    return (f"task {e.task}: {e.n_common} tokens in common; the window of the first new token needs positions "
            f"from {e.pos_min_thold} on; the swa cache holds the slot's from {e.pos_min} on, {verdict}")


def check_forced(served: Served) -> None:
    """Story 1 without checkpoints: every turn after the first processes its whole prompt, and the server
    prints the line from the bug reports once per such turn; its test says why (pos_min >= pos_min_thold)."""
    turns = served.turns()
    assert [t.outcome for t in turns] == ["new", "forced", "forced"], [t.outcome for t in turns]
    assert all(t.n_processed == t.n_prompt for t in turns)
    lines = served.log_lines("forcing full prompt re-processing")
    assert len(lines) == 2 and all("due to lack of cache data" in line for line in lines), lines
    for e in served.decisions()[1:]:
        assert e.forced_full and e.pos_min >= e.pos_min_thold, e


def check_swa_sizes(served: Served) -> None:
    """The SWA cache of a one-slot server holds n_swa x n_seq_max + n_ubatch cells (src/llama-kv-cache-iswa.cpp)
    and only the latest positions; the base cache keeps the whole conversation from position 0."""
    settings = SERVER_SETTINGS
    assert served.cache_size("swa") == settings["swa_window"] * settings["n_seq_max"] + settings["n_ubatch"]
    assert served.cache_size("swa") < served.cache_size("base")
    assert served.positions("base")[0] == 0 < served.positions("swa")[0]
    assert served.positions("base")[1] == served.positions("swa")[1]


def check_fixes(no_cp: Served, cp: Served, full: Served) -> None:
    """Checkpoints restore instead of forcing; --swa-full reuses the whole common prefix and never forces;
    each fix processes fewer tokens than the last, and --swa-full pays with a full-size SWA cache."""
    assert cp.outcomes() == ["new", "restored", "restored"], cp.outcomes()
    assert all(c.n_processed < n.n_processed for c, n in zip(cp.turns()[1:], no_cp.turns()[1:]))
    assert full.outcomes() == ["new", "kept", "kept"], full.outcomes()
    assert all(t.n_past == e.n_common for t, e in zip(full.turns()[1:], full.decisions()[1:]))
    assert not full.log_lines("forcing full")
    assert no_cp.processed() > cp.processed() > full.processed()
    assert full.cache_size("swa") == full.cache_size("base") > no_cp.cache_size("swa")


def compare(no_cp: Served, cp: Served, full: Served) -> None:
    """Prompt tokens processed per turn with each setting, and the cells of the SWA cache each one costs."""
    print(f"{'turn':<14}{'prompt':>7}{'-ctxcp 0':>10}{'checkpoints':>13}{'--swa-full':>12}")
    for a, b, c in zip(no_cp.turns(), cp.turns(), full.turns()):
        print(f"{a.label:<14}{a.n_prompt:>7}{a.n_processed:>10}{b.n_processed:>13}{c.n_processed:>12}")
    prompts = sum(t.n_prompt for t in no_cp.turns())
    print(f"{'total':<14}{prompts:>7}{no_cp.processed():>10}{cp.processed():>13}{full.processed():>12}")
    print(f"{'swa cells':<14}{'':>7}{no_cp.cache_size('swa'):>10}{cp.cache_size('swa'):>13}{full.cache_size('swa'):>12}")


# ---- story 2: the context shift that drops the system prompt ----------------------------------------------------
SYSTEM = "You are Moses, the servant of the LORD. Answer as Moses would.\n\n"
USER = "User: Who brought the people out of Egypt?\nMoses:"
SHIFT_SETTINGS = dict(n_ctx=64, n_seq_max=1, pad=16, swa_full=True, swa_window=WINDOW)


@dataclass
class Shifted:
    """A generation stopped right after its first context shift."""

    session: Session
    watcher: Watcher
    shift: ev.CellsRemoved  # the shift's seq_rm
    tokenizer: object

    def held_tokens(self) -> list[int]:
        """The tokens seq 0's cells hold, in position order (each cell's last allocation in its history)."""
        stream = self.watcher.mirror.caches["base"].streams[0]
        tokens = {}
        for cell in np.flatnonzero(stream.pos >= 0):
            allocated = [e for e in self.watcher.history.entries("base", 0, int(cell)) if e.kind == ALLOCATED]
            tokens[int(stream.pos[cell])] = allocated[-1].token
        return [tokens[p] for p in sorted(tokens)]

    def text(self) -> str:
        """What the model sees now: the text its cells hold."""
        return self.tokenizer.decode(self.held_tokens())

    def freed_by_shift(self, cells) -> list[int]:
        """The cells among `cells` that the context shift freed (from their history)."""
        return [c for c in cells if any("context shift" in e.why and e.pos < 0
                                        for e in self.watcher.history.entries("base", 0, c))]

    def describe(self) -> str:
        return describe_event(self.shift)

    def close(self) -> None:
        self.session.close()


def system_ids(tokenizer) -> list[int]:
    """The system prompt's tokens, BOS included: the prompt's first tokens."""
    ids = tokenizer.encode(SYSTEM)
    assert tokenizer.encode(SYSTEM + USER)[:len(ids)] == ids
    return ids


def generate_until_shift(model, n_keep: int) -> Shifted:
    """Generate from the system prompt and a question (greedy, --context-shift, --keep n_keep) until the first
    context shift has happened."""
    session = Session(model, settings=SHIFT_SETTINGS, threaded=False, threads=1,
                      workload=WorkloadSpec("generate", n_predict=60, context_shift=True, n_keep=n_keep,
                                            sampler=GREEDY))
    watcher = Watcher.of(session)
    session.add_prompt(SYSTEM + USER).result()
    for _ in range(60):
        session.step().result()
        watcher.poll()
        shifts = [e for e in watcher.recent if isinstance(e, ev.CellsRemoved) and "context shift" in e.cause]
        if shifts:
            return Shifted(session, watcher, shifts[0], model.tokenizer)
    raise AssertionError("no context shift happened")


def check_system_prompt_lost(lost: Shifted) -> None:
    """n_keep = 0 keeps only BOS: the shift frees every cell of the system prompt but cell 0, and the text the
    model sees no longer has it."""
    n_system = len(system_ids(lost.tokenizer))
    assert lost.shift.p0 == 1
    assert SYSTEM.strip() not in lost.text()
    assert lost.freed_by_shift(range(1, n_system)) == list(range(1, n_system))
    kept = lost.watcher.recent
    assert any(isinstance(e, ev.CellsShifted) and "context shift" in e.cause for e in kept)


def check_system_prompt_kept(kept: Shifted) -> None:
    """n_keep = the system prompt's length (without BOS): the shift starts after it, and its cells keep their
    tokens at their positions."""
    ids = system_ids(kept.tokenizer)
    assert kept.shift.p0 == len(ids)
    assert kept.held_tokens()[:len(ids)] == ids
    assert not kept.freed_by_shift(range(len(ids)))


# ---- story 3: split streams -------------------------------------------------------------------------------------
QUESTIONS = ["Who was Moses?", "And Aaron?", "Tell of the flood."]
PASSAGE = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
           "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
           "And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
           "God divided the light from the darkness.")
CLIENT_SETTINGS = dict(n_ctx=256, n_seq_max=4, pad=16, swa_window=WINDOW)


@dataclass
class Clients:
    """Four prompts decoded into four sequences of one session, as four clients send them."""

    session: Session
    watcher: Watcher
    rcs: list[int]  # each prompt's decode return code
    errors: list  # each prompt's error (None: decoded)

    def streams(self) -> int:
        return len(self.watcher.mirror.caches["base"].streams)

    def stream_size(self) -> int:
        return self.watcher.mirror.caches["base"].size

    def used(self) -> int:
        return sum(int((s.pos >= 0).sum()) for s in self.watcher.mirror.caches["base"].streams)

    def total_cells(self) -> int:
        return self.stream_size() * self.streams()

    def failures(self) -> list[ev.SlotSearchFailed]:
        return [e for e in self.watcher.recent if isinstance(e, ev.SlotSearchFailed)]

    def close(self) -> None:
        self.session.close()


def four_clients(model, prompts: list[str] | None = None, **settings) -> Clients:
    """An idle session: each prompt (three questions and a passage unless given) is decoded at once into the next
    free sequence; the return codes come from the DecodeFinished events."""
    session = Session(model, settings={**CLIENT_SETTINGS, **settings}, threaded=False, threads=1)
    watcher = Watcher.of(session)
    errors = [session.add_prompt(text).exception() for text in (prompts or QUESTIONS + [PASSAGE])]
    watcher.poll()
    rcs = [e.rc for e in watcher.recent if isinstance(e, ev.DecodeFinished)]
    return Clients(session, watcher, rcs, errors)


def codes_text(rcs: list[int]) -> str:
    return ", ".join(str(rc) for rc in rcs)


def check_split_failure(split: Clients, n_passage: int) -> None:
    """Split streams: the passage is longer than its stream, though the streams together have room; the decode
    returns 1 ("could not find a KV slot for the batch", llama_decode in include/llama.h), and the failed slot
    search names stream 3 of the size n_ctx / n_seq_max."""
    assert split.rcs == [0, 0, 0, 1], split.rcs
    assert split.stream_size() == CLIENT_SETTINGS["n_ctx"] // CLIENT_SETTINGS["n_seq_max"] < n_passage
    assert n_passage < split.total_cells() - split.used()
    failed = split.failures()[0]
    assert failed.stream == 3 and failed.size == split.stream_size() and failed.n_tokens == n_passage
    assert any(isinstance(e, ev.DecodeFinished) and e.rc == 1 for e in split.watcher.recent)
