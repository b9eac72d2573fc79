"""Attention inputs for whole sequences without a KV cache: the model's `AttentionInputs` protocol
for training and reference forward passes (tools/train_demo_model.py).

The ubatch is `n_groups` sequences of equal length T, laid out one after another, each at positions
0 .. T-1. store_and_load hands back the sequence's own K/V as [n_groups, n_head_kv, T, head_dim] and
a causal mask; sliding-window layers also mask by llama.cpp's rule (engine.kv.swa.is_masked_swa;
STANDARD: key p0 is masked for query p1 when p1 - p0 >= n_swa), as the cache would.

Example:
    attn = FullSequenceAttention(model.config, n_groups=8, n_tokens=256)
    logits = model.transformer.forward_train(tokens, positions, attn, torch.arange(tokens.numel()))
"""
from __future__ import annotations

import numpy as np
import torch

from engine.kv.swa import SwaType, is_masked_swa
from engine.models.config import ModelConfig


def full_sequence_masks(config: ModelConfig, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(causal, sliding) masks [T, T], True = attend, for positions 0 .. T-1."""
    pos = np.arange(n_tokens)
    p0, p1 = pos[None, :], pos[:, None]  # key, query
    causal = p0 <= p1
    sliding = causal.copy()
    if config.has_swa:
        sliding &= ~is_masked_swa(config.n_swa, SwaType(config.swa_type or SwaType.STANDARD), p0, p1)
    return torch.from_numpy(causal), torch.from_numpy(sliding)


class FullSequenceAttention:
    """No cache: each layer attends over the ubatch's own K/V (see the module docstring)."""

    def __init__(self, config: ModelConfig, n_groups: int, n_tokens: int) -> None:
        self.config = config
        self.n_groups = n_groups
        self.n_tokens = n_tokens
        causal, sliding = full_sequence_masks(config, n_tokens)
        self._causal = causal[None, None].expand(n_groups, 1, n_tokens, n_tokens)
        self._sliding = sliding[None, None].expand(n_groups, 1, n_tokens, n_tokens)

    def positions(self) -> torch.Tensor:
        """Positions of the whole ubatch: 0 .. T-1 for each group, [n_groups * T]."""
        return torch.arange(self.n_tokens).repeat(self.n_groups)

    def store_and_load(self, il: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        cfg, G, T = self.config, self.n_groups, self.n_tokens
        if k.shape[0] != G * T:
            raise ValueError(f"FullSequenceAttention expects {G} x {T} tokens, got {k.shape[0]}")
        shape = (G, T, cfg.n_head_kv, cfg.head_dim)
        keys = k.to(dtype).reshape(shape).transpose(1, 2)
        values = v.to(dtype).reshape(shape).transpose(1, 2)
        return keys, values, (self._sliding if cfg.is_swa(il) else self._causal)
