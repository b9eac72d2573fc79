"""Compute buffers: the activation memory a decode needs on each device, beyond weights and K/V.

llama.cpp measures its compute buffers by allocating the graph of the worst-case ubatch (n_ubatch
tokens, every one an output, attending over the whole cache). kvscope's forward pass allocates
activations as PyTorch ops run, so it bounds the same worst case from the shapes the forward pass
creates: for each phase of the pass (a layer's attention, a layer's MLP, the output layer) the
tensors alive at once, placed on the device each lives on; a device's compute bytes are the
largest phase on it. Attention scores are counted as the kernel that runs holds them (see
_scores_bytes). It is meant as a bound, so that a context admitted by it does not run out of
memory half-way through a decode; tests/test_memory_breakdown.py measures a real decode's peak
against it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.models.config import ModelConfig
from engine.placement.devices import CPU, Device
from engine.placement.weight_devices import WeightDevices


def compute_bytes_by_device(config: ModelConfig, wd: WeightDevices, n_ubatch: int, n_stream: int,
                            kv_size_by_layer: Mapping[int, int], dtype: torch.dtype) -> dict[Device, int]:
    """Worst-case activation bytes per device for a ubatch of n_ubatch tokens, all outputs.
    kv_size_by_layer[il]: cells per stream of layer il's cache (an SWA layer's may be smaller)."""
    c, s, T = config, dtype.itemsize, n_ubatch
    groups = min(n_stream, T)  # streams one ubatch can span: each gets its own K/V read
    q_width, kv_width = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    peak: dict[Device, int] = {}

    def phase(*live: tuple[Device, int]) -> None:
        """(device, bytes) alive at once in one phase; several on one device add up."""
        on_device: dict[Device, int] = {}
        for dev, nbytes in live:
            on_device[dev] = on_device.get(dev, 0) + nbytes
        for dev, nbytes in on_device.items():
            peak[dev] = max(peak.get(dev, 0), nbytes)

    residual = 3 * T * c.n_embd * s  # x, the normed input, the sum being formed
    for il, devs in enumerate(wd.layers):
        n_kv = kv_size_by_layer[il]
        attention = (
            T * (q_width + 2 * kv_width) * s  # Q, K, V of the ubatch
            + 2 * groups * n_kv * kv_width * s  # K and V read back from the cache in the compute dtype
            + T * n_kv * (1 + s)  # the boolean mask and its additive form
            + _scores_bytes(c, devs.kv, T, n_kv, s)
            + T * q_width * s)  # the attention output
        phase((devs.residual, residual), (devs.wqkv, T * (q_width + 2 * kv_width) * s),
              (devs.kv, attention), (devs.wo, T * (q_width + c.n_embd) * s))
        phase((devs.residual, residual), (devs.ffn_norm, T * c.n_embd * s),
              (devs.w_gate_up, 4 * T * c.n_ff * s),  # gate|up, the activation, their product
              (devs.w_down, T * (c.n_ff + c.n_embd) * s))
    logits = 2 * T * c.n_vocab * s  # the row blocks' product and its copy into rows (one for few tokens)
    as_f32 = T * c.n_vocab * 4 if s != 4 else 0  # logits are handed out in float32
    host_copy = T * c.n_vocab * 4 if wd.output.torch_device.type != "cpu" else 0  # and read on the host
    phase((wd.output_norm, 2 * T * c.n_embd * s), (wd.output, T * c.n_embd * s + logits + as_f32),
          (CPU, host_copy))
    return peak


# torch's CPU flash-attention kernel works in blocks of at most this many queries x keys per thread
CPU_FUSED_BLOCK = 256 * 512


def _scores_bytes(c: ModelConfig, kv_device: Device, T: int, n_kv: int, s: int) -> int:
    """Attention scores and probabilities. On the host, scaled_dot_product_attention runs torch's
    fused CPU kernel, which holds a block of scores per thread; on a GPU a boolean mask with grouped
    K/V heads sends it down the math path, which materialises all of them, as does Gemma 2's
    soft-capped attention everywhere (scores, their soft-capped and masked copies, probabilities)."""
    if c.attn_softcap:
        return 4 * c.n_head * T * n_kv * s
    if kv_device.torch_device.type == "cpu":
        return 2 * torch.get_num_threads() * min(T * n_kv, CPU_FUSED_BLOCK) * 4
    return 2 * c.n_head * T * n_kv * s
