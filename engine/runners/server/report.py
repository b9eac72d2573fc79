"""What `kvscope server-sim` prints after the log: one line per turn (what was reused, what was processed,
and why), and the totals."""
from __future__ import annotations

from engine.runners.server.conversations import TurnResult
from engine.watch.server_slots import OUTCOME_TEXT


def turn_table(results: list[TurnResult]) -> list[str]:
    width = max([len(r.conversation) for r in results] + [12]) + 8
    order = {}
    for r in results:
        order.setdefault(r.conversation, len(order))
    results = sorted(results, key=lambda r: (order[r.conversation], r.turn))  # by conversation, in their order
    lines = [f"{'turn':<{width}} {'task':>5} {'slot':>4} {'prompt':>6} {'reused':>6} {'processed':>9}  outcome",]
    for r in results:
        label = f"{r.conversation} turn {r.turn}"
        lines.append(f"{label:<{width}} {r.task:>5} {r.slot:>4} {r.n_prompt:>6} {r.n_cached:>6} {r.n_processed:>9}  "
                     f"{OUTCOME_TEXT[r.outcome]}")
    prompt = sum(r.n_prompt for r in results)
    processed = sum(r.n_processed for r in results)
    share = f" ({100 * processed / prompt:.0f}% of the prompts' tokens)" if prompt else ""
    lines.append(f"{len(results)} turns: {prompt} prompt tokens, {processed} processed{share}, "
                 f"{sum(r.outcome == 'forced' for r in results)} forced to re-process, "
                 f"{sum(r.outcome == 'restored' for r in results)} saved by a checkpoint")
    return lines
