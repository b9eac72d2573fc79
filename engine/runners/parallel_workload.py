"""The requests a simulated server answers (llama.cpp's `parallel` example): questions, token budgets
and arrival steps, drawn from a seed so that a run can be repeated."""
from __future__ import annotations

import random
from dataclasses import dataclass

from engine.errors import KvscopeError

DEFAULT_SYSTEM_PROMPT = (
    "A conversation between a curious User and a friendly Assistant. The Assistant answers every "
    "question briefly, clearly and politely.\n\n"
)

SCHEDULE_SEED = 1234  # llama-parallel calls srand(1234) before drawing its prompts

QUESTIONS: tuple[str, ...] = (
    "Why is the sky blue?",
    "How do bees make honey?",
    "What is the best way to learn a new language?",
    "Can you explain how a lighthouse helps ships at night?",
    "What should I cook for dinner tonight?",
    "Why do we have seasons?",
    "How far away is the moon?",
    "What makes bread rise in the oven?",
    "Could you recommend a good book about the sea, and tell me why you like it?",
    "How does a train stay on its tracks?",
    "What is a simple recipe for vegetable soup?",
    "Why do cats purr?",
    "How old is the oldest tree in the world?",
    "What is the difference between weather and climate?",
    "If you could visit any city in the world, which one would it be and why?",
    "How do I keep a small garden alive in a dry summer?",
)


def format_prompt(question: str) -> str:
    """A client's prompt after the system prompt, as llama-parallel builds it."""
    return f"User:\n{question}\nAssistant:\n"


@dataclass(frozen=True)
class Request:
    """One simulated request. `id` is its index in the schedule (llama-parallel's seq counter)."""

    id: int
    question: str
    n_predict: int
    arrival_step: int = 0


def make_schedule(n_sequences: int, *, seed: int | None = None, n_predict: int = 64,
                  arrival_gap: int = 2) -> list[Request]:
    """A deterministic list of requests: question drawn from QUESTIONS, token budget uniform in
    [n_predict // 4 (at least 1), n_predict], and arrival steps whose gaps are uniform in
    [0, 2 * arrival_gap] (arrival_gap 0: everything arrives at step 0, as in llama-parallel).
    seed None -> 1234."""
    if n_sequences < 0:
        raise KvscopeError(f"n_sequences must be >= 0, got {n_sequences}")
    if n_predict < 1:
        raise KvscopeError(f"n_predict must be >= 1, got {n_predict}")
    if arrival_gap < 0:
        raise KvscopeError(f"arrival_gap must be >= 0, got {arrival_gap}")
    lo = max(1, n_predict // 4)
    rng = random.Random(SCHEDULE_SEED if seed is None else seed)
    requests, step = [], 0
    for i in range(n_sequences):
        if i > 0:
            step += rng.randint(0, 2 * arrival_gap)
        requests.append(Request(i, rng.choice(QUESTIONS), rng.randint(lo, n_predict), step))
    return requests


def check_system_prompt(system_prompt: str, share_system_prompt: bool) -> None:
    """A shared system prompt needs text; `kvscope parallel` checks it before loading a model."""
    if share_system_prompt and not system_prompt:
        raise KvscopeError("share_system_prompt needs a non-empty system prompt: give one (--system-prompt), or "
                           "share_system_prompt=False (--no-pps) to have each request decode none")
