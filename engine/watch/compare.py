"""Two contexts on the same prompt, compared token by token from their events alone: for each position
of a sequence, the KL divergence of their next-token distributions and whether their most likely
tokens agree (OutputLogProbs, published by contexts made with publish_logits=True), and whether they
still share the text so far (TokenSampled). What an A/B view draws: f16 vs q4_0 K/V, unified vs split
streams, swa_full on vs off, all layers on a (virtual) GPU vs none.

Both contexts sample on their own. While the tokens they sampled agree, each position compares the two
distributions over the same text; from the first position where they sampled differently on, the texts
differ and so do the questions, so those rows are marked `same_text=False` (a view greys them out).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import events as ev


@dataclass(frozen=True)
class TokenComparison:
    """One position of the sequence, in both contexts."""

    pos: int
    kl: float  # KL(a || b) in nats: what b loses describing a's distribution
    top_a: int
    top_b: int
    same_text: bool  # both had sampled the same tokens before this position

    @property
    def agree(self) -> bool:
        return self.top_a == self.top_b


def kl_divergence(logp_a: np.ndarray, logp_b: np.ndarray) -> float:
    """KL(a || b) of two log-probability vectors, in nats (float64 sums; 0 where a gives no mass)."""
    p_a = np.exp(logp_a.astype(np.float64))
    return float(np.sum(p_a * (logp_a.astype(np.float64) - logp_b.astype(np.float64))))


class DistributionComparison:
    """Feed it the events of context a (apply_a) and b (apply_b); `rows` holds every position both have
    given a distribution for, in order of position."""

    def __init__(self, seq_id: int = 0) -> None:
        self.seq_id = seq_id
        self.rows: list[TokenComparison] = []
        self._pending: tuple[dict[int, np.ndarray], dict[int, np.ndarray]] = ({}, {})
        self._sampled: tuple[dict[int, int], dict[int, int]] = ({}, {})  # position -> token
        self.first_difference: int | None = None  # the first position the two sampled differently

    def apply_a(self, event: ev.Event) -> None:
        self._apply(0, event)

    def apply_b(self, event: ev.Event) -> None:
        self._apply(1, event)

    def _apply(self, side: int, event: ev.Event) -> None:
        if isinstance(event, ev.OutputLogProbs):
            for k, (seq, pos) in enumerate(zip(event.seq_ids, event.positions)):
                if seq == self.seq_id:
                    self._pending[side][pos] = event.logprobs[k]
                    self._pair(pos)
        elif isinstance(event, ev.TokenSampled) and event.seq_id == self.seq_id:
            self._sampled[side][event.pos] = event.token
            other = self._sampled[1 - side].get(event.pos)
            if other is not None and other != event.token and (self.first_difference is None
                                                                or event.pos < self.first_difference):
                self.first_difference = event.pos

    def _pair(self, pos: int) -> None:
        a, b = self._pending[0].get(pos), self._pending[1].get(pos)
        if a is None or b is None:
            return
        del self._pending[0][pos], self._pending[1][pos]
        # the distribution at `pos` predicts the token at pos + 1, after the text up to pos
        same = self.first_difference is None or pos < self.first_difference
        self.rows.append(TokenComparison(pos, kl_divergence(a, b), int(a.argmax()), int(b.argmax()), same))

    @property
    def compared(self) -> list[TokenComparison]:
        """The rows over the same text (before the first difference): what the numbers below summarise. A row
        is paired once both sides gave its distribution, and each side samples the tokens up to its position
        before that, so its `same_text` is final when it is made."""
        return [r for r in self.rows if r.same_text]

    def summary(self) -> dict:
        """n positions compared over the same text, their top-1 agreement and mean / max KL."""
        rows = self.compared
        if not rows:
            return {"n": 0, "top1_agreement": None, "mean_kl": None, "max_kl": None,
                    "first_difference": self.first_difference}
        kl = np.array([r.kl for r in rows])
        return {"n": len(rows), "top1_agreement": float(np.mean([r.agree for r in rows])), "mean_kl": float(kl.mean()),
                "max_kl": float(kl.max()), "first_difference": self.first_difference}
