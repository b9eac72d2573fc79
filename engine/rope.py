"""Rotary position embeddings, turning the pairs of dims that llama.cpp turns for the model's arch.

kvscope's K cache holds the rows llama.cpp's holds, so that states cross between the engines
(engine/kv/state.py) and a quantized K cache quantizes the same 32-value blocks. llama-family models
(ModelConfig.rope_type NORM) are converted with their Q/K rows permuted (convert_hf_to_gguf
LlamaModel.permute: per head, Hugging Face dims i and i + d/2 become 2i and 2i + 1) and llama.cpp turns
dims 2i and 2i + 1 together. kvscope computes Q and K in that order (`to_norm_order`, applied to the
weights in engine/models/transformer.py) and turns the same pairs. qwen2 and Gemma (NEOX) keep the
Hugging Face order and turn dims i and i + d/2 (rotate_half). Either way each pair turns by the same
angle; only the order of a head's dims differs, and Q and K share it, so attention is unchanged.

Why in the cache and not only in state files: reordering K rows when a state is written or read
would be exact for float caches only. A quantized K row is quantized in blocks of 32 along the row,
and with heads of 64 dims or more a block holds other values in llama.cpp's order than in the Hugging
Face one, so only a cache that quantizes rows already in llama.cpp's order holds llama.cpp's bytes.
Keeping that order also makes kvscope's K-shift turn the same pairs as llama.cpp's
(llama_kv_cache::build_rope_shift), and it costs nothing measurable: the Q/K weight rows are
reordered once at load (engine/models/transformer.py), and the NORM rotation takes one operation fewer
than the NEOX one (as fast for one token; slower for a long ubatch, where RoPE is a small share).

The cos/sin tables say which dims pair up: [T, D] tables pair dim i with i + D/2 (NEOX), [T, D/2, 2]
tables pair dims 2i and 2i + 1 (NORM; per pair, cos is (cos, cos) and sin the partner's signed factor
(-sin, sin)). `Rotary.apply` reads this from their shape, so that rotating with a model's own tables
(`cos_sin`, the K-shift) always works on the layout its cache holds. Both compute each value as
x * cos + partner * (+-sin), the same products in the same order.

A rotation by `delta` composes with one by `pos`, which is what the K-shift relies on. Layers may
differ in their RoPE base and linear scale (gemma3: base 10000 on sliding-window layers, rope_theta
with the "linear" factor on full-attention layers), so there is one frequency table per distinct
(base, scale) and each layer, the K-shift included, uses its own. Every head is rotated whole:
llama.cpp's partial rotary (n_rot < head_dim) is not used by the architectures kvscope runs, and
per-pair frequency factors for fewer dims than a head has are refused.
"""
from __future__ import annotations

import math

import torch

from engine.models.config import ROPE_TYPE_NEOX, ROPE_TYPE_NORM, ModelConfig


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
        rope_freqs = torch.as_tensor(rope_freqs, dtype=torch.float32)
        if rope_freqs.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {rope_freqs.numel()} factors for heads of {d} dims ({d // 2} pairs): "
                             f"partial rotary (n_rot < head_dim) is not supported")
        return inv_freq / rope_freqs
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


def to_norm_order(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Q or K weight rows (or a bias) of n_head heads from the Hugging Face order to the order NORM
    RoPE turns: per head, row i goes to 2i and row i + d/2 to 2i + 1 (convert_hf_to_gguf
    LlamaModel.permute). Differentiable, like every step of building the Transformer's weights."""
    d = rows.shape[0] // n_head
    if rows.shape[0] != n_head * d or d % 2:
        raise ValueError(f"{rows.shape[0]} rows do not split into {n_head} heads of an even size")
    return rows.reshape(n_head, 2, d // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class Rotary:
    """cos/sin tables for arbitrary (also negative) positions, and the rotation itself.

    `rope_type` is the model's (ModelConfig.rope_type): the tables it makes pair dims as its Q/K rows
    and its cache need. `inv_freqs` holds one table per distinct (base, scale) of the model's layers;
    `layer_table[il]` says which one layer il uses. `inv_freq` is the first (the full-attention
    layers' when there is a full-attention layer)."""

    def __init__(self, config: ModelConfig) -> None:
        if config.head_dim % 2:
            raise ValueError(f"RoPE turns pairs of dims: head_dim {config.head_dim} is odd")
        self.rope_type = config.rope_type
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
    def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                 rope_type: str = ROPE_TYPE_NEOX):
        """cos, sin: [T, D] for NEOX, [T, D/2, 2] for NORM (see the module docstring)."""
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        if rope_type == ROPE_TYPE_NORM:
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            return torch.stack((cos, cos), dim=-1), torch.stack((-sin, sin), dim=-1)
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, layer: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `positions` for `layer` (default: table 0), paired as this model's rows are."""
        table = 0 if layer is None else self.layer_table[layer]
        return self._cos_sin(self.inv_freqs[table], positions, dtype, self.rope_type)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin of `positions` for every table; layer il uses tables(...)[layer_table[il]]."""
        return [self._cos_sin(inv_freq, positions, dtype, self.rope_type) for inv_freq in self.inv_freqs]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, n_head, D]; cos, sin: [T, D] (NEOX) or [T, D/2, 2] (NORM), which also says which
        dims turn together."""
        return Rotary.turn(x, cos[:, None], sin[:, None])

    @staticmethod
    def broadcast_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """cos, sin as `turn` takes them: broadcast over heads, and for NORM pairs in float32 one
        complex table (cos + i sin) [T, 1, D/2] with sin None: a pair (x0, x1) is then turned by one
        complex product, (x0 + i x1)(cos + i sin), which is bit for bit x0 cos - x1 sin, x1 cos + x0 sin
        (tests/test_state_llama_layout.py), in one operation instead of four."""
        if cos.dim() == 3 and cos.dtype == torch.float32:
            return torch.complex(cos[..., 0], sin[..., 1])[:, None], None
        return cos[:, None], sin[:, None]

    @staticmethod
    def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
        """apply() with tables from broadcast_tables: cos, sin [T, 1, D] (NEOX), [T, 1, D/2, 2] (NORM),
        or a complex cos [T, 1, D/2] and sin None (NORM in float32)."""
        if sin is None:
            T, n_head, D = x.shape
            return torch.view_as_real(torch.view_as_complex(x.view(T, n_head, D // 2, 2)) * cos).view(T, n_head, D)
        if cos.dim() == 4:
            T, n_head, D = x.shape
            pairs = x.view(T, n_head, D // 2, 2)  # dims 2i, 2i + 1 (a view: only the last dim is split)
            # flip swaps each pair: of the ways to reorder the pairs, the quickest for one token
            return (pairs * cos + pairs.flip(-1) * sin).view(T, n_head, D)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def shift_keys(self, layer: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate stored keys [N, n_head_kv, D] (float32, in the cache's layout) of model layer
        `layer` by delta [N] positions (the K-shift), with that layer's RoPE base and scale."""
        cos, sin = self.cos_sin(delta, torch.float32, layer)  # made on the host, like every RoPE table
        return self.apply(keys, cos.to(keys.device), sin.to(keys.device))
