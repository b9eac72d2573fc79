"""Rotary position embeddings in the Hugging Face layout (rotate_half over two halves of a head).

GGUF llama weights are un-permuted at load time, so one rotation serves every architecture. A
rotation by `delta` composes with one by `pos`, which is what the K-shift relies on.

Layers may differ in their RoPE base and linear scale (gemma3: base 10000 on sliding-window layers,
rope_theta with the "linear" factor on full-attention layers), so there is one frequency table per
distinct (base, scale) and each layer, the K-shift included, uses its own.
"""
from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, base: float | None = None, freq_scale: float = 1.0) -> torch.Tensor:
    """Per dimension pair: the angle per position, with Llama 3 scaling or GGUF rope_freqs applied.
    base: the RoPE base (default config.rope_theta); freq_scale: linear scaling (1 / factor)."""
    d = config.head_dim
    base = config.rope_theta if base is None else base
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if freq_scale != 1.0:
        inv_freq = inv_freq / (1.0 / freq_scale)  # HF "linear": inv_freq / factor
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
    """cos/sin tables for arbitrary (also negative) positions, and the rotation itself.

    `inv_freqs` holds one table per distinct (base, scale) of the model's layers; `layer_table[il]`
    says which one layer il uses. `inv_freq` is the first (the full-attention layers' when there is
    a full-attention layer)."""

    def __init__(self, config: ModelConfig) -> None:
        keys: list[tuple[float, float]] = []
        self.layer_table: list[int] = []
        # full-attention layers first, so that table 0 is rope_theta's whenever some layer uses it
        order = sorted(range(config.n_layer), key=lambda il: config.is_swa(il))
        table_of: dict[int, int] = {}
        for il in order:
            key = (config.rope_base(il), config.rope_freq_scale_of(il))
            if key not in keys:
                keys.append(key)
            table_of[il] = keys.index(key)
        self.layer_table = [table_of[il] for il in range(config.n_layer)]
        if not keys:
            keys.append((config.rope_theta, config.rope_freq_scale))
        self.bases = tuple(keys)
        self.inv_freqs = [inverse_frequencies(config, base, scale) for base, scale in keys]  # [head_dim / 2] each
        self.inv_freq = self.inv_freqs[0]

    @staticmethod
    def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((angles, angles), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, layer: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of `positions` for `layer` (default: table 0)."""
        table = 0 if layer is None else self.layer_table[layer]
        return self._cos_sin(self.inv_freqs[table], positions, dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin of `positions` for every table; layer il uses tables(...)[layer_table[il]]."""
        return [self._cos_sin(inv_freq, positions, dtype) for inv_freq in self.inv_freqs]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, n_head, D]; cos, sin: [T, D]."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def shift_keys(self, layer: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate stored keys [N, n_head_kv, D] (float32) of model layer `layer` by delta [N]
        positions (the K-shift), with that layer's RoPE base and scale."""
        cos, sin = self.cos_sin(delta, torch.float32, layer)  # made on the host, like every RoPE table
        return self.apply(keys, cos.to(keys.device), sin.to(keys.device))
