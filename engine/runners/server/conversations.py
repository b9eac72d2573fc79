"""Scripted multi-turn conversations for the server simulation: a JSON file (docs/server-sim.md), and a
runner that sends each conversation's next turn once its last answer came back, as a chat client does.

    {
      "system": "A conversation between a curious User and a friendly Assistant.",   (optional, for all)
      "reasoning": "keep",              (optional, for all: how the template renders earlier answers: keep, strip)
      "conversations": [
        {"name": "alice", "slot": 0,    (slot: the request's id_slot; -1 or absent: any slot)
         "system": "...", "reasoning": "strip",           (optional, this conversation's own)
         "turns": [
           {"user": "Who was Moses?", "n_predict": 16},
           {"user": "And Aaron?", "assistant": "<think>He asks...</think> His brother."},
           {"user": "Be brief.", "system": "You answer in five words."},
           {"user": "Go on.", "insert": {"at": 2, "role": "tool", "text": "search: Exodus 4:14"}}
         ]}
      ]
    }

A turn's "assistant" fixes the answer (its tokens are generated as given, whatever the model would say: the
script decides what the history holds); without it the model answers with up to n_predict tokens (default
16). "system" changes the system prompt from that turn on; "insert" puts a message into the history from
that turn on, at that index of the messages before the new user message (0 = first after the system prompt).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine import events as ev
from engine.errors import KvscopeError
from engine.runners.server.chat import REASONING, ROLES, Message, answer_tokens, render
from engine.runners.server.server import ServerSim
from engine.runners.server.slot import Task
from engine.watch.server_slots import reuse_outcome

DEFAULT_SYSTEM = "A conversation between a curious User and a friendly Assistant.\n"
TURN_KEYS = {"user", "assistant", "n_predict", "system", "insert"}
CONVERSATION_KEYS = {"name", "slot", "system", "reasoning", "turns"}


class ScriptError(KvscopeError):
    pass


@dataclass(frozen=True)
class Turn:
    user: str
    assistant: str | None = None
    n_predict: int = 16
    system: str | None = None
    insert: tuple[int, Message] | None = None


@dataclass(frozen=True)
class Conversation:
    name: str
    turns: tuple[Turn, ...]
    slot: int = -1
    system: str = DEFAULT_SYSTEM
    reasoning: str = "keep"


def load_script(path: str | Path) -> list[Conversation]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ScriptError(f"cannot read the conversation script {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ScriptError(f"{path}: not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    return parse_script(data, str(path))


def parse_script(data, where: str = "script") -> list[Conversation]:
    if not isinstance(data, dict) or not isinstance(data.get("conversations"), list) or not data["conversations"]:
        raise ScriptError(f"{where}: expected an object with a non-empty list \"conversations\"")
    system = _text(data.get("system", DEFAULT_SYSTEM), f"{where}: system")
    reasoning = _reasoning(data.get("reasoning", "keep"), f"{where}: reasoning")
    conversations = []
    for i, c in enumerate(data["conversations"]):
        at = f"{where}: conversations[{i}]"
        if not isinstance(c, dict):
            raise ScriptError(f"{at}: expected an object")
        _known(c, CONVERSATION_KEYS, at)
        turns = c.get("turns")
        if not isinstance(turns, list) or not turns:
            raise ScriptError(f"{at}: expected a non-empty list \"turns\"")
        slot = c.get("slot", -1)
        if not isinstance(slot, int) or isinstance(slot, bool) or slot < -1:
            raise ScriptError(f"{at}: slot must be a slot number or -1 (any), got {slot!r}")
        conversations.append(Conversation(
            name=_text(c.get("name", f"conversation {i}"), f"{at}: name"),
            turns=tuple(_turn(t, f"{at}.turns[{k}]") for k, t in enumerate(turns)), slot=slot,
            system=_text(c.get("system", system), f"{at}: system"),
            reasoning=_reasoning(c.get("reasoning", reasoning), f"{at}: reasoning")))
    return conversations


def _turn(t, at: str) -> Turn:
    if not isinstance(t, dict):
        raise ScriptError(f"{at}: expected an object")
    _known(t, TURN_KEYS, at)
    if "user" not in t:
        raise ScriptError(f"{at}: a turn needs \"user\", the user's message")
    n_predict = t.get("n_predict", 16)
    if not isinstance(n_predict, int) or isinstance(n_predict, bool) or n_predict < 1:
        raise ScriptError(f"{at}: n_predict must be a whole number >= 1, got {n_predict!r}")
    insert = None
    if "insert" in t:
        ins = t["insert"]
        if not isinstance(ins, dict) or set(ins) != {"at", "role", "text"}:
            raise ScriptError(f"{at}: insert must be an object with \"at\", \"role\" and \"text\"")
        if not isinstance(ins["at"], int) or ins["at"] < 0:
            raise ScriptError(f"{at}: insert.at must be a message index >= 0, got {ins['at']!r}")
        if ins["role"] not in ROLES or ins["role"] == "system":
            raise ScriptError(f"{at}: insert.role must be user, assistant or tool, got {ins['role']!r}")
        insert = (ins["at"], Message(ins["role"], _text(ins["text"], f"{at}: insert.text")))
    assistant = t.get("assistant")
    return Turn(user=_text(t["user"], f"{at}: user"),
                assistant=None if assistant is None else _text(assistant, f"{at}: assistant"),
                n_predict=n_predict, system=None if "system" not in t else _text(t["system"], f"{at}: system"),
                insert=insert)


def _known(obj: dict, keys: set[str], at: str) -> None:
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise ScriptError(f"{at}: unknown key {unknown[0]!r}; known: {', '.join(sorted(keys))}")


def _text(value, at: str) -> str:
    if not isinstance(value, str):
        raise ScriptError(f"{at}: expected text, got {value!r}")
    return value


def _reasoning(value, at: str) -> str:
    if value not in REASONING:
        raise ScriptError(f"{at}: expected one of {', '.join(REASONING)}, got {value!r}")
    return value


@dataclass(frozen=True)
class TurnResult:
    conversation: str
    turn: int
    task: int
    slot: int
    n_prompt: int
    n_cached: int
    n_processed: int
    outcome: str  # "kept", "restored", "forced", "new" (nothing to reuse)
    answer: str


@dataclass
class _Progress:
    conversation: Conversation
    messages: list[Message] = field(default_factory=list)
    system: str = ""
    next_turn: int = 0
    waiting_task: int = -1


class ChatRunner:
    """Drives a ServerSim with conversations: each sends its next turn when its last answer came back."""

    def __init__(self, sim: ServerSim, conversations: list[Conversation], *, n_keep: int = 0) -> None:
        self.sim, self.tokenizer, self.n_keep = sim, sim.tokenizer, n_keep
        self.progress: list[_Progress] = []
        for conversation in conversations:
            self.add(conversation)
        self.results: list[TurnResult] = []
        self._turns: dict[int, tuple[_Progress, Turn]] = {}
        self._reuse: dict[int, ev.ServerPromptReused] = {}
        self._sub = sim.ctx.bus.subscribe(kinds=(ev.ServerPromptReused, ev.ServerTaskFinished), maxsize=1 << 20)

    def add(self, conversation: Conversation) -> None:
        if conversation.slot >= self.sim.params.n_slots:
            raise ScriptError(f"conversation {conversation.name!r} asks for slot {conversation.slot}, but the server "
                              f"has {self.sim.params.n_slots} slots (-np)")
        self.progress.append(_Progress(conversation, system=conversation.system))

    @property
    def done(self) -> bool:
        return all(p.next_turn == len(p.conversation.turns) and p.waiting_task < 0 for p in self.progress)

    def step(self) -> int:
        """Send the turns that are due, run one server step, take the answers that came back."""
        for p in self.progress:
            if p.waiting_task < 0 and p.next_turn < len(p.conversation.turns):
                self._send(p)
        n = self.sim.step()
        for e in self._sub.drain():
            if isinstance(e, ev.ServerPromptReused):
                self._reuse[e.task] = e
            elif e.task in self._turns:  # one of this runner's turns (a task given to the server by hand is not)
                self._answered(e)
        return n

    def run(self, max_steps: int = 1_000_000) -> list[TurnResult]:
        for _ in range(max_steps):
            if self.done:
                break
            self.step()
        self.sim.run()  # the server's "all slots are idle"
        self._sub.close()
        return self.results

    def _send(self, p: _Progress) -> None:
        turn = p.conversation.turns[p.next_turn]
        if turn.system is not None:
            p.system = turn.system
        if turn.insert is not None:
            at, message = turn.insert
            p.messages.insert(min(at, len(p.messages)), message)
        p.messages.append(Message("user", turn.user))
        prompt = render(self.tokenizer, [Message("system", p.system), *p.messages], reasoning=p.conversation.reasoning)
        answer = tuple(answer_tokens(self.tokenizer, turn.assistant)) if turn.assistant is not None else ()
        task = self.sim.submit(Task(prompt.tokens, n_predict=len(answer) or turn.n_predict, id_slot=p.conversation.slot,
                                    user_starts=prompt.user_starts, answer=answer, n_keep=self.n_keep,
                                    label=f"{p.conversation.name} turn {p.next_turn + 1}", text=turn.user))
        p.waiting_task = task.id
        self._turns[task.id] = (p, turn)

    def _answered(self, finished: ev.ServerTaskFinished) -> None:
        p, turn = self._turns.pop(finished.task)
        answer = turn.assistant if turn.assistant is not None else finished.text.rstrip("\n")
        reuse = self._reuse.pop(finished.task, None)
        outcome = "error" if finished.stop == "error" else "new" if reuse is None else reuse_outcome(reuse)
        self.results.append(TurnResult(p.conversation.name, p.next_turn + 1, finished.task, finished.slot,
                                       finished.n_prompt, finished.n_cached, finished.n_processed, outcome,
                                       finished.error or answer))
        p.waiting_task = -1
        if finished.stop == "error":  # the client got an error: this conversation ends here
            p.next_turn = len(p.conversation.turns)
            return
        p.messages.append(Message("assistant", answer))
        p.next_turn += 1
