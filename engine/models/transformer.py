"""A decoder-only transformer for the llama family (llama, qwen2) in plain PyTorch.

The model knows nothing about cells or streams: per ubatch it gets token ids, positions and an
attention object that stores this ubatch's K/V in the cache and hands back every visible K/V row
with the KQ mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.rope import Rotary


class AttentionInputs(Protocol):
    n_groups: int
    mask: torch.Tensor  # [groups, 1, tokens per group, n_kv] bool

    def store_and_load(self, il: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype): ...


class DecodeAborted(Exception):
    """Raised inside the forward pass when the abort callback asks to stop."""


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Transformer:
    """Weights in the compute dtype plus the forward pass of one ubatch."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.rotary = Rotary(config)

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in tensors else None

        self.tok_embd = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.tok_embd if config.tie_word_embeddings else w("lm_head.weight")
        self.layers = []
        for i in range(config.n_layer):
            p = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                attn_norm=w(p + "input_layernorm.weight"),
                wq=w(p + "self_attn.q_proj.weight"), wk=w(p + "self_attn.k_proj.weight"),
                wv=w(p + "self_attn.v_proj.weight"), wo=w(p + "self_attn.o_proj.weight"),
                bq=opt(p + "self_attn.q_proj.bias"), bk=opt(p + "self_attn.k_proj.bias"),
                bv=opt(p + "self_attn.v_proj.bias"),
                ffn_norm=w(p + "post_attention_layernorm.weight"),
                w_gate=w(p + "mlp.gate_proj.weight"), w_up=w(p + "mlp.up_proj.weight"),
                w_down=w(p + "mlp.down_proj.weight"),
            ))

    def n_params(self) -> int:
        tensors = [self.tok_embd, self.norm] + ([] if self.lm_head is self.tok_embd else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() for t in tensors)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                output_rows: torch.Tensor, should_abort: Callable[[], bool] | None = None) -> torch.Tensor:
        """tokens, positions: [T]; output_rows: indices into the ubatch. Returns [len(output_rows), n_vocab]
        float32 logits."""
        cfg = self.config
        T = tokens.shape[0]
        G = attn.n_groups
        x = self.tok_embd[tokens]  # [T, C]
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        for il, layer in enumerate(self.layers):
            if should_abort is not None and should_abort():
                raise DecodeAborted(f"aborted before layer {il}")
            h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            q = F.linear(h, layer.wq, layer.bq).view(T, cfg.n_head, cfg.head_dim)
            k = F.linear(h, layer.wk, layer.bk).view(T, cfg.n_head_kv, cfg.head_dim)
            v = F.linear(h, layer.wv, layer.bv)  # [T, n_embd_v_gqa]
            q = Rotary.apply(q, cos, sin)
            k = Rotary.apply(k, cos, sin)
            keys, values = attn.store_and_load(il, k.reshape(T, -1), v, self.dtype)  # [G, Hkv, n_kv, D]
            q = q.view(G, T // G, cfg.n_head, cfg.head_dim).transpose(1, 2)  # [G, H, T/G, D]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn.mask, enable_gqa=True)
            x = x + F.linear(o.transpose(1, 2).reshape(T, cfg.n_head * cfg.head_dim), layer.wo)
            h = rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps)
            x = x + F.linear(F.silu(F.linear(h, layer.w_gate)) * F.linear(h, layer.w_up), layer.w_down)
        x = rms_norm(x[output_rows], self.norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
