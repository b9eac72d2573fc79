"""Tiny models built in memory (no files) for cache tests that only need a working forward pass."""
from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.model import Model
from engine.models.transformer import Transformer


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    t = {"model.embed_tokens.weight": rnd(cfg.n_vocab, cfg.n_embd), "model.norm.weight": 1 + rnd(cfg.n_embd),
         "lm_head.weight": rnd(cfg.n_vocab, cfg.n_embd)}
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + rnd(cfg.n_embd), p + "self_attn.q_proj.weight": rnd(q, cfg.n_embd),
                  p + "self_attn.k_proj.weight": rnd(kv, cfg.n_embd), p + "self_attn.v_proj.weight": rnd(kv, cfg.n_embd),
                  p + "self_attn.o_proj.weight": rnd(cfg.n_embd, q), p + "post_attention_layernorm.weight": 1 + rnd(cfg.n_embd),
                  p + "mlp.gate_proj.weight": rnd(cfg.n_ff, cfg.n_embd), p + "mlp.up_proj.weight": rnd(cfg.n_ff, cfg.n_embd),
                  p + "mlp.down_proj.weight": rnd(cfg.n_embd, cfg.n_ff)})
    return t


def tiny_config(**overrides) -> ModelConfig:
    base = dict(arch="llama", n_vocab=64, n_embd=32, n_layer=2, n_head=4, n_head_kv=2, head_dim=8, n_ff=64,
                rms_norm_eps=1e-5, rope_theta=10000.0, n_ctx_train=256, name="tiny-in-memory")
    base.update(overrides)
    return ModelConfig(**base)


def in_memory_model(seed: int = 0, **overrides) -> Model:
    cfg = tiny_config(**overrides)
    return Model(cfg, None, Transformer(cfg, random_tensors(cfg, seed), torch.float32), "<memory>", "memory", {})


def f32_weight_bytes(cfg: ModelConfig) -> tuple[list[int], int]:
    """Bytes of each layer's weights and of the output layer (norm and lm_head; a tied lm_head is the
    embedding, of the same size) in f32, counted from the tensors `random_tensors` writes rather than
    by the engine that places them."""
    t = random_tensors(cfg)
    layers = [4 * sum(v.numel() for k, v in t.items() if k.startswith(f"model.layers.{il}."))
              for il in range(cfg.n_layer)]
    return layers, 4 * (t["model.norm.weight"].numel() + t["lm_head.weight"].numel())
