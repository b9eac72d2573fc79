"""Drive a context the way the logits tests need: prefill several prompts in one batch, then advance
every sequence by one random token per decode, collecting the logits of every position."""
from __future__ import annotations

import torch

import engine
from engine.batch import Batch


def decode_sequences(ctx: engine.Context, prompts: dict[int, list[int]], n_steps: int, seed: int):
    """Returns each sequence's tokens and the logits the engine produced for each of its positions."""
    seqs = {s: list(t) for s, t in prompts.items()}
    tokens, pos, seq_ids = [], [], []
    for s, toks in seqs.items():
        tokens += toks
        pos += list(range(len(toks)))
        seq_ids += [[s]] * len(toks)
    assert ctx.decode(Batch(tokens, pos, seq_ids, [True] * len(tokens))) == 0, ctx.last_error
    got = {s: [] for s in seqs}
    for i in range(len(tokens)):
        got[seq_ids[i][0]].append(ctx.logits(i).clone())
    g = torch.Generator().manual_seed(seed)
    n_vocab = ctx.model.n_vocab
    for _ in range(n_steps):
        step = [(s, int(torch.randint(3, n_vocab, (1,), generator=g))) for s in seqs]
        batch = Batch([t for _, t in step], [len(seqs[s]) for s, _ in step], [[s] for s, _ in step],
                      [True] * len(step))
        for s, t in step:
            seqs[s].append(t)
        assert ctx.decode(batch) == 0, ctx.last_error
        for k, (s, _) in enumerate(step):
            got[s].append(ctx.logits(k).clone())
    return seqs, {s: torch.stack(v) for s, v in got.items()}
