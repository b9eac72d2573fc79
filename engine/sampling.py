"""Token sampling as llama.cpp's default sampler chain does it, for one or many sequences.

The chain, in llama.cpp's order (``common_sampler`` with the default sampler sequence,
leaving out the samplers that are off by default):

1. repetition penalty over the last ``repeat_last_n`` tokens of a sequence's history:
   for each *distinct* token there, ``logit / penalty`` if ``logit > 0`` else ``logit * penalty``;
2. top-k: keep the ``top_k`` largest logits (``top_k <= 0`` disables it);
3. top-p: keep the smallest prefix, by descending probability, whose cumulative probability
   is ``>= top_p`` (always at least one token; ``top_p == 1`` disables it);
4. min-p: keep tokens whose probability is ``>= min_p * max probability`` (``min_p == 0`` disables it);
5. temperature: divide the surviving logits by ``temperature``;
6. draw one token from the softmax of what is left, with the sampler's ``torch.Generator``.

The probabilities used by top-p and min-p are those of the logits *before* temperature, as in
llama.cpp. ``temperature <= 0`` means greedy: the argmax of the penalised logits (ties go to the
lowest token id), and no random number is drawn.

Ties between equal logits are always broken towards the lowest token id (top-k's cut, the
top-p prefix order), so results do not depend on sort implementation details.

Random-number use is fixed so runs are reproducible: every non-greedy row draws exactly one
``float64`` uniform from the generator, rows in order, so ``sample_many(logits, histories)``
returns the same tokens, and leaves the generator in the same state, as calling ``sample`` on
each row in turn.

Everything over the vocabulary is vectorised torch; the only Python loops are over rows of a
batch and over history tokens.
"""
from __future__ import annotations

import math
import numbers
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = ["SamplerParams", "Sampler"]

_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_1d(logits: object, fn: str) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 1:
        raise ValueError(f"{fn}() takes logits of shape [n_vocab], got {tuple(logits.shape)}")


@dataclass(frozen=True)
class SamplerParams:
    """Sampling settings, named and defaulted as llama.cpp's ``common_params_sampling``.

    temperature:    > 0 scales logits before the draw; <= 0 means greedy (argmax).
    top_k:          keep the k most likely tokens; <= 0 disables.
    top_p:          nucleus cut-off in (0, 1]; 1.0 disables.
    min_p:          relative probability cut-off in [0, 1]; 0 disables.
    repeat_penalty: > 0; 1.0 disables.
    repeat_last_n:  how many of the most recent tokens the penalty looks at; 0 disables,
                    -1 means the whole history the sampler is given or has recorded.
    seed:           0 .. 2**64 - 1, or None for a random seed (see ``Sampler.seed``).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t):
            raise ValueError(
                f"temperature must be a finite number (> 0 to sample, <= 0 for greedy), got {t!r}"
            )
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer (<= 0 disables top-k), got {self.top_k!r}")
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables top-p), got {p!r}")
        m = self.min_p
        if not _is_real(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables min-p), got {m!r}")
        r = self.repeat_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0.0:
            raise ValueError(
                f"repeat_penalty must be a finite number > 0 (1.0 disables the penalty), got {r!r}"
            )
        n = self.repeat_last_n
        if not _is_int(n) or n < -1:
            raise ValueError(
                f"repeat_last_n must be an integer >= -1 (0 disables, -1 = whole history), got {n!r}"
            )
        s = self.seed
        if s is not None and (not _is_int(s) or not (0 <= s < _SEED_LIMIT)):
            raise ValueError(f"seed must be None (random) or an integer in [0, 2**64 - 1], got {s!r}")
        # Normalise numeric types (e.g. numpy scalars, ints for floats) to plain Python ones.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "min_p", float(m))
        object.__setattr__(self, "repeat_penalty", float(r))
        object.__setattr__(self, "repeat_last_n", int(n))
        if s is not None:
            object.__setattr__(self, "seed", int(s))

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature <= 0)."""
        return self.temperature <= 0.0

    @property
    def penalty_active(self) -> bool:
        return self.repeat_penalty != 1.0 and self.repeat_last_n != 0


class Sampler:
    """Samples tokens from logits with a fixed chain and a private, seeded ``torch.Generator``.

    History for the repetition penalty can be passed on each call (``history=``), or recorded by
    the sampler per sequence: pass ``seq_id=`` and the sampled token is appended to that
    sequence's recent-token buffer (``accept`` adds tokens such as the prompt yourself). With a
    ``seq_id`` the penalty window is the last ``repeat_last_n`` tokens of the recorded tokens
    followed by ``history``.
    """

    def __init__(self, params: SamplerParams | None = None) -> None:
        self.params = params if params is not None else SamplerParams()
        self.seed: int = self.params.seed if self.params.seed is not None else secrets.randbits(64)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        n = self.params.repeat_last_n
        self._maxlen: int | None = None if n < 0 else n
        self._recent: dict[int, deque[int]] = {}

    # ---- per-sequence history -------------------------------------------------------------

    def accept(self, tokens: int | Iterable[int], seq_id: int = 0) -> None:
        """Record token(s) as the most recent of sequence ``seq_id`` (e.g. the prompt)."""
        buf = self._recent.get(seq_id)
        if buf is None:
            buf = self._recent[seq_id] = deque(maxlen=self._maxlen)
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        if _is_int(tokens):
            buf.append(int(tokens))  # type: ignore[arg-type]
        else:
            buf.extend(int(t) for t in tokens)  # type: ignore[union-attr]

    def recent_tokens(self, seq_id: int = 0) -> tuple[int, ...]:
        """The recorded tokens of ``seq_id`` the penalty looks at, oldest first."""
        return tuple(self._recent.get(seq_id, ()))

    def reset(self, seq_id: int | None = None) -> None:
        """Forget the recorded history of one sequence, or of all when ``seq_id`` is None."""
        if seq_id is None:
            self._recent.clear()
        else:
            self._recent.pop(seq_id, None)

    # ---- sampling ---------------------------------------------------------------------------

    def sample(
        self, logits: torch.Tensor, history: Sequence[int] = (), *, seq_id: int | None = None
    ) -> int:
        """Sample one token id from ``logits`` of shape [n_vocab]."""
        _check_1d(logits, "sample")
        seq_ids = None if seq_id is None else [seq_id]
        return self.sample_many(logits.unsqueeze(0), [history], seq_ids=seq_ids)[0]

    def sample_many(
        self,
        logits: torch.Tensor,
        histories: Sequence[Sequence[int]] | None = None,
        *,
        seq_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Sample one token per row of ``logits`` [n, n_vocab].

        Same tokens and generator state as calling ``sample(logits[i], histories[i],
        seq_id=seq_ids[i])`` for i = 0, 1, ... in order.
        """
        x = self._prepare(logits, histories, seq_ids)
        n = x.shape[0]
        if n == 0:
            return []
        if self.params.greedy:
            tokens = torch.argmax(x, dim=-1).tolist()  # first maximal index = lowest id
        else:
            ids, weights, last = self._distribution(x)
            cdf = torch.cumsum(weights, dim=-1)
            # One uniform per row, rows in order: identical to n sequential sample() calls.
            u = torch.cat(
                [torch.rand(1, generator=self.generator, dtype=torch.float64) for _ in range(n)]
            ).to(cdf.device)
            total = cdf.gather(1, last.unsqueeze(-1))
            pos = torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True).squeeze(-1)
            pos = torch.minimum(pos, last)  # u * total may round up to total
            tokens = ids.gather(1, pos.unsqueeze(-1)).squeeze(-1).tolist()
        if seq_ids is not None:
            for sid, tok in zip(seq_ids, tokens):
                self.accept(tok, sid)
        return tokens

    def probabilities(
        self, logits: torch.Tensor, history: Sequence[int] = (), *, seq_id: int | None = None
    ) -> torch.Tensor:
        """The distribution ``sample`` draws from, as float64 [n_vocab] (zeros where filtered).

        Greedy gives a one-hot vector. Uses no random numbers and records nothing.
        """
        _check_1d(logits, "probabilities")
        seq_ids = None if seq_id is None else [seq_id]
        x = self._prepare(logits.unsqueeze(0), [history], seq_ids)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        if self.params.greedy:
            out.scatter_(1, torch.argmax(x, dim=-1, keepdim=True), 1.0)
        else:
            ids, weights, last = self._distribution(x)
            out.scatter_(1, ids, weights / weights.sum(dim=-1, keepdim=True))
        return out[0]

    # ---- internals --------------------------------------------------------------------------

    def _window(self, history: Sequence[int], seq_id: int | None) -> list[int]:
        n = self.params.repeat_last_n
        if n == 0:
            return []
        tokens = list(history)
        if seq_id is not None and seq_id in self._recent:
            tokens = list(self._recent[seq_id]) + tokens
        return tokens if n < 0 else tokens[-n:]

    def _prepare(
        self,
        logits: torch.Tensor,
        histories: Sequence[Sequence[int]] | None,
        seq_ids: Sequence[int] | None,
    ) -> torch.Tensor:
        """Validate, copy to float32 and apply the repetition penalty. Returns [n, n_vocab]."""
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
        if logits.dim() != 2:
            raise ValueError(f"sample_many() takes logits of shape [n, n_vocab], got {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
        n, n_vocab = logits.shape
        if n_vocab == 0:
            raise ValueError("logits have an empty vocabulary dimension")
        if histories is not None and len(histories) != n:
            raise ValueError(f"got {len(histories)} histories for {n} rows of logits")
        if seq_ids is not None:
            if len(seq_ids) != n:
                raise ValueError(f"got {len(seq_ids)} seq_ids for {n} rows of logits")
            if len(set(seq_ids)) != len(seq_ids):
                raise ValueError("seq_ids in one sample_many() call must be distinct")
        x = logits.detach().to(torch.float32, copy=True)
        if n == 0:
            return x
        if not bool(torch.isfinite(x).all()):
            if bool(torch.isnan(x).any()):
                raise ValueError("logits contain NaN")
            if bool(torch.isposinf(x).any()):
                raise ValueError("logits contain +inf")
        if bool(torch.isneginf(x).all(dim=-1).any()):
            raise ValueError("a row of logits is all -inf: there is no token to sample")

        if self.params.penalty_active:
            rows: list[int] = []
            cols: list[int] = []
            for i in range(n):
                hist = histories[i] if histories is not None else ()
                window = self._window(hist, None if seq_ids is None else seq_ids[i])
                distinct = set(int(t) for t in window)
                if not distinct:
                    continue
                lo, hi = min(distinct), max(distinct)
                if lo < 0 or hi >= n_vocab:
                    bad = lo if lo < 0 else hi
                    raise ValueError(f"history token {bad} is out of range [0, {n_vocab})")
                rows.extend([i] * len(distinct))
                cols.extend(distinct)
            if rows:
                r = torch.tensor(rows, dtype=torch.long, device=x.device)
                c = torch.tensor(cols, dtype=torch.long, device=x.device)
                v = x[r, c]
                pen = self.params.repeat_penalty
                x[r, c] = torch.where(v > 0, v / pen, v * pen)
        return x

    def _distribution(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Apply top-k, top-p, min-p and temperature to penalised logits [n, V].

        Returns ``(ids, weights, last)``: candidate token ids [n, m] by descending logit (ties:
        lowest id first), their unnormalised final weights [n, m] (float64)
        ``exp((logit - max) / temperature)``, zero for filtered candidates, and the position [n]
        of each row's last candidate with a positive weight. Kept candidates are a prefix, and
        the draw uses a running sum, whose prefix does not depend on what follows it, so a row
        gives the same token alone or in a batch padded with other rows' candidates.
        """
        p = self.params
        n, n_vocab = x.shape
        k = p.top_k
        use_top_k = 0 < k < n_vocab
        xmax = x.max(dim=-1, keepdim=True).values.to(torch.float64)
        log_min_p = math.log(p.min_p) if p.min_p > 0.0 else -math.inf

        # How many candidates to carry: top-k's k, else (with min-p) the most that pass min-p in
        # any row, else the whole vocabulary. Sorting only those is what keeps this cheap.
        if use_top_k:
            m = k
        elif p.min_p > 0.0:
            m = int(((x.to(torch.float64) - xmax) >= log_min_p).sum(dim=-1).max())
        else:
            m = n_vocab
        if m < n_vocab:
            # The m-th largest value is well defined even with ties; keep everything above it,
            # then the lowest ids among those equal to it until there are exactly m.
            kth = torch.topk(x, m, dim=-1).values[:, -1:]
            above = x > kth
            equal = x == kth
            room = m - above.sum(dim=-1, keepdim=True)
            sel = above | (equal & (torch.cumsum(equal.to(torch.int64), dim=-1) <= room))
            cand_ids = sel.nonzero()[:, 1].view(n, m)  # row-major: ascending ids in each row
            vals, order = torch.sort(x.gather(1, cand_ids), dim=-1, descending=True, stable=True)
            ids = cand_ids.gather(1, order)
        else:
            vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)

        rel = vals.to(torch.float64) - xmax  # <= 0; the first candidate is the finite maximum
        keep = torch.ones_like(rel, dtype=torch.bool)
        if p.top_p < 1.0:
            # Probabilities over top-k's survivors, or over the whole vocabulary without top-k.
            if use_top_k:
                lse = torch.logsumexp(rel, dim=-1, keepdim=True)
            else:
                lse = torch.logsumexp(x.to(torch.float64) - xmax, dim=-1, keepdim=True)
            cum = torch.cumsum(torch.exp(rel - lse), dim=-1)
            cum_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
            keep &= cum_before < p.top_p  # smallest prefix reaching top_p; first always kept
        if p.min_p > 0.0:
            # prob_i >= min_p * prob_max  <=>  logit_i - logit_max >= log(min_p)
            keep &= rel >= log_min_p
        weights = torch.where(keep, torch.exp(rel / p.temperature), torch.zeros_like(rel))
        last = (weights > 0).sum(dim=-1) - 1  # weights[:, 0] == 1, so last >= 0
        return ids, weights, last
