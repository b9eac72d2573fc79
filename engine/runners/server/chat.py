"""A small chat template for the simulation, and rendering a conversation into prompt tokens with the
token index where each user message starts (what llama-server's message spans tell its checkpoints).

Messages are tokenized one by one and joined, as a template of special tokens would keep them apart, so that
the same history always gives the same tokens and a message always starts on a token of its own. The roles
are plain text that any tokenizer can read (the demo model knows no special tokens):

    {system}\\n\\n
    User:\\n{text}\\n            (a user message)
    Tool:\\n{text}\\n            (a tool's result)
    Assistant:\\n{text}\\n       (an earlier answer)
    Assistant:\\n               (the generation prompt: the model answers from here)

A template may re-render earlier answers differently from how they were generated: with reasoning "strip",
`<think>...</think>` blocks are dropped from earlier answers (as many reasoning models' templates do), which is
one of the ways a new prompt parts from what the cache holds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import KvscopeError

ROLES = ("system", "user", "assistant", "tool")
REASONING = ("keep", "strip")
GENERATION_PROMPT = "Assistant:\n"
_THINK = re.compile(r"<think>.*?</think>\s*", re.S)


@dataclass(frozen=True)
class Message:
    role: str
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise KvscopeError(f"unknown message role {self.role!r}; one of {', '.join(ROLES)}")


@dataclass(frozen=True)
class RenderedPrompt:
    tokens: list[int]
    user_starts: tuple[int, ...]  # token index of each user message


def message_text(message: Message, *, reasoning: str = "keep") -> str:
    if message.role == "system":
        return f"{message.text}\n\n"
    text = _THINK.sub("", message.text) if message.role == "assistant" and reasoning == "strip" else message.text
    return f"{message.role.capitalize()}:\n{text}\n"


def render(tokenizer, messages: list[Message], *, reasoning: str = "keep") -> RenderedPrompt:
    """The prompt for the model's next answer: BOS (if the model adds one), each message, the generation
    prompt."""
    if reasoning not in REASONING:
        raise KvscopeError(f"reasoning must be one of {', '.join(REASONING)}, got {reasoning!r}")
    tokens = tokenizer.encode("", add_bos=True)
    starts = []
    for message in messages:
        if message.role == "user":
            starts.append(len(tokens))
        tokens += tokenizer.encode(message_text(message, reasoning=reasoning), add_bos=False)
    tokens += tokenizer.encode(GENERATION_PROMPT, add_bos=False)
    return RenderedPrompt(tokens, tuple(starts))


def answer_tokens(tokenizer, text: str) -> list[int]:
    """The tokens a model generates for an answer: its text and the newline that ends the message, so that
    an answer re-rendered as it was generated continues the cache exactly."""
    return tokenizer.encode(f"{text}\n", add_bos=False)
