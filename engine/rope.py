"""Rotary position embeddings in the Hugging Face layout (rotate_half over two halves of a head).

GGUF llama weights are un-permuted at load time, so one rotation serves every architecture. A
rotation by `delta` composes with one by `pos`, which is what the K-shift relies on.
"""
from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per dimension pair: the angle per position, with Llama 3 scaling or GGUF rope_freqs applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rope_freqs = config.extra.get("rope_freqs")
    if rope_freqs is not None:
        # llama.cpp stores Llama 3 scaling as per-pair divisors of the angle.
        return inv_freq / torch.as_tensor(rope_freqs, dtype=torch.float32)
    if config.rope_scaling is not None:
        return _llama3_scaled(inv_freq, config)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    rs = config.rope_scaling
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary:
    """cos/sin tables for arbitrary (also negative) positions, and the rotation itself."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = inverse_frequencies(config)  # [head_dim / 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((angles, angles), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, n_head, D]; cos, sin: [T, D]."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def shift_keys(self, layer: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate stored keys [N, n_head_kv, D] (float32) by delta [N] positions (the K-shift)."""
        cos, sin = self.cos_sin(delta, torch.float32)
        return self.apply(keys, cos, sin)
