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
    """What the cache gives the model for one ubatch. Tokens are grouped per stream (n_groups
    groups of equal size); store_and_load returns K, V [groups, n_head_kv, n_kv, head_dim] and the
    layer's mask [groups, 1, tokens per group, n_kv] (True = attend), which differs between
    sliding-window and full-attention layers."""

    n_groups: int

    def store_and_load(self, il: int, k: torch.Tensor, v: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class DecodeAborted(Exception):
    """Raised inside the forward pass when the abort callback asks to stop."""


@dataclass
class LayerWeights:
    """One block's weights. Q, K and V are one matrix, gate and up another: one matmul each."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # n_embd -> (n_head + 2 n_head_kv) * head_dim, column-blocked (see input_major)
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # n_head * head_dim -> n_embd
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # n_embd -> 2 n_ff
    w_down: torch.Tensor  # n_ff -> n_embd


def input_major(weight: torch.Tensor, dtype: torch.dtype, n_split: int) -> torch.Tensor:
    """[out, in] (the files' layout) -> [n_split, in, out / n_split]: column blocks, input-major.

    Decode multiplies one row by every weight matrix, so it is bound by memory bandwidth. One
    vector-matrix product streams weights at about 25 GB/s on this kind of CPU; a batched product
    over two column blocks keeps both cores reading, at about 40 GB/s, with each output computed
    exactly as before (the blocks split outputs, never the sum)."""
    w = weight.t().to(dtype)  # [in, out]
    if n_split > 1 and w.shape[1] % n_split == 0:
        return w.reshape(w.shape[0], n_split, -1).permute(1, 0, 2).contiguous()
    return w.contiguous()[None]


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] times a column-blocked weight [n_split, in, out / n_split] (+ bias) -> [T, out]."""
    n_split = weight.shape[0]
    if n_split == 1:
        y = x @ weight[0]
    else:
        y = torch.bmm(x.unsqueeze(0).expand(n_split, -1, -1), weight)  # [n_split, T, out / n_split]
        y = y.transpose(0, 1).reshape(x.shape[0], n_split * weight.shape[2])
    return y if bias is None else y + bias


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

        self.tok_embd = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        # Tied embeddings stay [n_vocab, n_embd] and go through F.linear rather than being copied.
        n_split = max(1, torch.get_num_threads())
        self.lm_head_t = None if config.tie_word_embeddings else input_major(tensors["lm_head.weight"], dtype, n_split)
        self.layers = []
        for i in range(config.n_layer):
            p = f"model.layers.{i}.self_attn."
            m = f"model.layers.{i}.mlp."
            biases = [tensors.get(p + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append(LayerWeights(
                attn_norm=w(f"model.layers.{i}.input_layernorm.weight"),
                wqkv=input_major(torch.cat([tensors[p + f"{x}_proj.weight"] for x in "qkv"]), dtype, n_split),
                bqkv=None if biases[0] is None else torch.cat(biases).to(dtype),
                wo=input_major(tensors[p + "o_proj.weight"], dtype, n_split),
                ffn_norm=w(f"model.layers.{i}.post_attention_layernorm.weight"),
                w_gate_up=input_major(torch.cat([tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"]]),
                                      dtype, n_split),
                w_down=input_major(tensors[m + "down_proj.weight"], dtype, n_split),
            ))
        self._qkv_split = (config.n_head * config.head_dim, config.n_embd_k_gqa, config.n_embd_v_gqa)

    def n_params(self) -> int:
        tensors = [self.tok_embd, self.norm] + ([] if self.lm_head_t is None else [self.lm_head_t])
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
            q, k, v = project(h, layer.wqkv, layer.bqkv).split(self._qkv_split, dim=-1)
            q = q.view(T, cfg.n_head, cfg.head_dim)
            k = k.view(T, cfg.n_head_kv, cfg.head_dim)
            q = Rotary.apply(q, cos, sin)
            k = Rotary.apply(k, cos, sin)
            keys, values, mask = attn.store_and_load(il, k.reshape(T, -1), v, self.dtype)  # [G, Hkv, n_kv, D]
            q = q.view(G, T // G, cfg.n_head, cfg.head_dim).transpose(1, 2)  # [G, H, T/G, D]
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + project(o.transpose(1, 2).reshape(T, cfg.n_head * cfg.head_dim), layer.wo)
            h = rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps)
            gate, up = project(h, layer.w_gate_up).chunk(2, dim=-1)
            x = x + project(F.silu(gate) * up, layer.w_down)
        x = rms_norm(x[output_rows], self.norm, cfg.rms_norm_eps)
        logits = F.linear(x, self.tok_embd) if self.lm_head_t is None else project(x, self.lm_head_t)
        return logits.float()
