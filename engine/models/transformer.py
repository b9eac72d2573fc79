"""A decoder-only transformer for the llama family (llama, qwen2, mistral) and Gemma (gemma2,
gemma3 text) in plain PyTorch.

The model knows nothing about cells or streams: per ubatch it gets token ids, positions and an
attention object that stores this ubatch's K/V in the cache and hands back every visible K/V row
with the KQ mask (each layer's own: sliding-window layers get the window's mask). Q and K come out of
the projection in the order the model's RoPE turns (engine/rope.py): for the llama family that is
llama.cpp's order, so the cache holds the K rows llama.cpp's would.

Gemma, as Hugging Face computes it: the embedding is multiplied by sqrt(n_embd) rounded to the
compute dtype; every RMSNorm multiplies in float32 by a weight that already holds 1 + w (the value
llama.cpp's converter stores; HF folders get the +1 when read) and then casts; a norm before and
after attention and MLP; gelu-tanh gated MLP; gemma3 normalises each Q/K head before RoPE; the
attention scale is query_pre_attn_scalar ** -0.5. gemma2 soft-caps the attention logits before
masking (tanh(x / c) * c), which scaled_dot_product_attention cannot do, so that arch computes
attention explicitly; the final logits are soft-capped in float32.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from engine.formats.quantized_blocks import QuantizedBlocks, reorder_rows
from engine.models.config import ROPE_TYPE_NORM, ModelConfig
from engine.models.host_memory import advise_huge_pages
from engine.models.packed import PackedRows, PackedWeight
from engine.placement.devices import CPU, Device
from engine.placement.weight_devices import (
    BIAS_OF,
    LayerDevices,
    WeightDevices,
    all_on_cpu,
)
from engine.rope import Rotary, to_norm_order


class AttentionInputs(Protocol):
    """What the cache gives the model for one ubatch. Tokens are grouped per stream (n_groups
    groups of equal size); store_and_load returns K, V [groups, n_head_kv, n_kv, head_dim] and the
    layer's mask [groups, 1, tokens per group, n_kv] (True = attend), which differs between
    sliding-window and full-attention layers; None when every token attends to every cell given."""

    n_groups: int

    def store_and_load(self, il: int, k: torch.Tensor, v: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class WeightsProbe(Protocol):
    """Asks one ubatch's forward pass for the attention weights of a few of its tokens (the context's
    publish_attention setting): `rows` are token indices into the ubatch, ascending; `keep` receives
    each layer's weights, [len(rows), n_kv] float32 on the layer's K/V device."""

    rows: list[int]

    def keep(self, il: int, weights: torch.Tensor) -> None: ...


class DecodeAborted(Exception):
    """Raised inside the forward pass when the abort callback asks to stop."""


@dataclass
class LayerWeights:
    """One block's weights. Q, K and V are one matrix, gate and up another: one matmul each."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # n_embd -> (n_head + 2 n_head_kv) * head_dim, in row blocks (see row_blocks)
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # n_head * head_dim -> n_embd
    bo: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # n_embd -> 2 n_ff
    w_down: torch.Tensor  # n_ff -> n_embd
    # Gemma only (float32, holding 1 + w): norms of the attention and MLP outputs, Q/K head norms (gemma3)
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


MIN_SPLIT_ELEMENTS = 1 << 18  # 1 MiB of f32: below this a matrix-vector product is not bandwidth-bound
SPLIT_MAX_TOKENS = 64  # up to this many rows of x, products run per row block; above, as one GEMM


def row_blocks(weight: torch.Tensor, dtype: torch.dtype, n_split: int) -> torch.Tensor:
    """[out, in] (the files' layout) in the compute dtype, viewed as [n_split, out / n_split, in]:
    row blocks of one contiguous matrix.

    Decode multiplies one row by every weight matrix, so it is bound by memory bandwidth. Each output
    is the dot product of one contiguous weight row with x, as ggml computes it; a batched product
    over n_split (= threads) row blocks keeps every core streaming its own block. On a 2-core EPYC
    this reads f32 weights at ~26 GB/s, against ~20 for two column blocks of the transposed matrix
    and ~11 for F.linear (MKL's x @ W.T with one row). Small matrices stay in one block: for them
    the threads' start-up costs more than it saves, and much more on a busy machine. Large matrices
    are moved into huge pages in place (engine/models/host_memory.py): they stream faster."""
    return as_row_blocks(advise_huge_pages(weight.to(dtype).contiguous()), n_split)


def as_row_blocks(w: torch.Tensor, n_split: int) -> torch.Tensor:
    """A contiguous [out, in] matrix viewed as row blocks [n_split, out / n_split, in] (one block when it
    is small or out does not divide)."""
    if n_split > 1 and w.shape[0] % n_split == 0 and w.numel() >= MIN_SPLIT_ELEMENTS:
        return w.view(n_split, w.shape[0] // n_split, w.shape[1])
    return w[None]


Weight = torch.Tensor | PackedWeight  # a matrix: float in row blocks (row_blocks), or packed quantized


def fused_matrix(parts: list[torch.Tensor | QuantizedBlocks], dtype: torch.dtype, n_split: int) -> Weight:
    """Matrices [out_i, in] stacked along their outputs into one weight: packed when every part is a
    quantized GGUF matrix, else float in the compute dtype (quantized parts decoded: a file that mixes
    float and quantized pieces of one fused matrix is rare, and one kernel per matrix keeps it simple)."""
    if all(isinstance(p, QuantizedBlocks) for p in parts):
        return PackedWeight.from_gguf_parts([(p.blocks, p.type_name, p.shape[0]) for p in parts], parts[0].shape[1])
    floats = [p.dequantize() if isinstance(p, QuantizedBlocks) else p for p in parts]
    return row_blocks(floats[0] if len(floats) == 1 else torch.cat(floats), dtype, n_split)


def weight_nbytes(t: torch.Tensor | PackedWeight | PackedRows) -> int:
    """Resident bytes of a weight, packed or not."""
    return t.nbytes if isinstance(t, (PackedWeight, PackedRows)) else t.numel() * t.element_size()


def weight_numel(t: torch.Tensor | PackedWeight | PackedRows) -> int:
    """Parameters in a weight, packed or not."""
    if isinstance(t, (PackedWeight, PackedRows)):
        return t.shape[0] * t.shape[1]
    return t.numel()


def project(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] times a weight in row blocks [n_split, out / n_split, in] or a packed one (+ bias)
    -> [T, out]."""
    if isinstance(weight, PackedWeight):
        y = weight.matmul(x)
        return y if bias is None else y + bias
    n_split, _, n_in = weight.shape
    T = x.shape[0]
    if n_split == 1 or not 0 < T <= SPLIT_MAX_TOKENS:  # one GEMM (prefill, small matrices, no rows)
        return F.linear(x, weight.view(-1, n_in), bias)
    y = torch.bmm(weight, x.t().expand(n_split, n_in, T))  # [n_split, out / n_split, T]: each block's outputs
    y = y.view(1, -1) if T == 1 else y.view(-1, T).t().contiguous()
    return y if bias is None else y + bias


_EPS_TABLES: dict[float, torch.Tensor] = {}


def _eps_table(eps: float) -> torch.Tensor:
    """eps as a [1, 1] CPU tensor, made once (addmm adds it to the product)."""
    table = _EPS_TABLES.get(eps)
    if table is None:
        table = _EPS_TABLES[eps] = torch.full((1, 1), eps)
    return table


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in float32, cast, then multiply by the weight in the compute dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if x.dim() == 2 and x.shape[0] == 1 and x.is_cpu and torch.is_inference_mode_enabled():
            # One row (decode, 2 norms per layer): mean(x^2) + eps as one BLAS call, eps + (x x^T) / n.
            # F.rms_norm has no fused CPU kernel: its six operations cost ~30 us per call in a decode step.
            return x * torch.addmm(_eps_table(eps), x, x.t(), alpha=1.0 / x.shape[-1]).rsqrt_() * weight
        return F.rms_norm(x, x.shape[-1:], weight, eps)  # x * rsqrt(mean(x^2) + eps) * w
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and multiply by the float32 weight (1 + w) in float32, then cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap, as HF writes it."""
    return torch.tanh(x / cap) * cap


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped logits (gemma2), computed as HF's eager attention does.

    q [G, H, Tg, D]; keys, values [G, Hkv, n_kv, D]; mask [G, 1, Tg, n_kv] (True = attend).
    Query head h reads KV head h // (H / Hkv): the query heads of a group are stacked along the
    token axis so that K and V are never copied per head. Returns [G, H, Tg, D]."""
    G, H, Tg, D = q.shape
    Hkv = keys.shape[1]
    n_rep = H // Hkv
    qg = q.reshape(G, Hkv, n_rep * Tg, D)
    scores = (qg @ keys.transpose(-1, -2)) * scale  # [G, Hkv, n_rep * Tg, n_kv]
    scores = softcap(scores, cap).view(G, Hkv, n_rep, Tg, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = probs.view(G, Hkv, n_rep * Tg, -1) @ values  # [G, Hkv, n_rep * Tg, D]
    return out.view(G, H, Tg, D)


GROUPED_MAX_TOKENS = 8  # up to this many tokens per stream, query heads attend as one group per KV head


def grouped_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                            scale: float | None) -> torch.Tensor:
    """One scaled_dot_product_attention call for grouped-query attention.

    q [G, H, Tg, D]; keys, values [G, Hkv, n_kv, D], usually strided views of the cache rows;
    mask [G, 1, Tg, n_kv] (True = attend). Returns [G, H, Tg, D].

    With few tokens per stream (decode), the query heads that share a KV head are stacked along the
    token axis, so that the kernel reads each K/V row once per KV head: enable_gqa on the CPU
    repeats K and V per query head first, which at 32k cells costs twice the attention itself. The
    mask rows follow the stacking (repeated, or broadcast for one token). With many tokens
    (prefill) the kernel's own GQA is as fast or faster, and the stacked mask would be n_rep times
    larger. Either way one call per layer: many small ops would hold the GIL from other threads."""
    G, H, Tg, D = q.shape
    Hkv = keys.shape[1]
    n_rep = H // Hkv
    if n_rep == 1 or Tg > GROUPED_MAX_TOKENS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=n_rep > 1, scale=scale)
    qg = q.reshape(G, Hkv, n_rep * Tg, D)  # row r * Tg + t: query head kv * n_rep + r, token t
    mg = mask if Tg == 1 or mask is None else mask.repeat(1, 1, n_rep, 1)
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=mg, scale=scale).view(G, H, Tg, D)


def single_query_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                           scale: float | None) -> torch.Tensor:
    """The attention of one token (a decode step of one sequence): q [1, H, D]; keys, values
    [1, Hkv, n_kv, D]; mask [1, 1, 1, n_kv] or None. Query heads lie in memory grouped by the KV head
    they read, so one view stacks them as grouped_query_attention does, without its reshapes (decode
    pays per dispatch). Returns [1, H * D]."""
    _, H, D = q.shape
    Hkv = keys.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(1, Hkv, H // Hkv, D), keys, values, attn_mask=mask, scale=scale)
    return o.view(1, H * D)


def attention_weights(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, rows: list[int], scale: float,
                      cap: float) -> torch.Tensor:
    """The attention probabilities of the ubatch tokens `rows`, averaged over the query heads: [len(rows), n_kv]
    float32, 0 on masked cells. Scores are formed in the compute dtype, scaled, soft-capped (cap > 0)
    and masked as the real attention does, then normalised in float32.

    q [G, H, Tg, D]; keys [G, Hkv, n_kv, D]; mask [G, 1, Tg, n_kv] (True = attend; None: all); rows index the
    ubatch's tokens group after group. Rows are taken a group at a time, so that a group's K is read
    in place rather than copied per row."""
    _, H, Tg, D = q.shape
    Hkv, n_kv = keys.shape[1], keys.shape[2]
    by_group: dict[int, list[int]] = {}
    for r in rows:
        by_group.setdefault(r // Tg, []).append(r % Tg)
    out = []
    for g, ts in by_group.items():
        P = len(ts)
        # consecutive rows (one per sequence in a decode step) as a slice: views, not gathers
        t = slice(ts[0], ts[0] + P) if ts[-1] - ts[0] == P - 1 else torch.tensor(ts, device=q.device)
        qg = q[g][:, t].reshape(Hkv, (H // Hkv) * P, D)  # query head h reads KV head h // (H / Hkv)
        scores = (qg @ keys[g].transpose(-1, -2)) * scale  # [Hkv, n_rep * P, n_kv]
        if cap:
            scores = softcap(scores, cap)
        scores = scores.view(Hkv, H // Hkv, P, n_kv)
        if mask is not None:
            scores = torch.where(mask[g, 0, t], scores, float("-inf"))
        out.append(torch.softmax(scores, dim=-1, dtype=torch.float32).mean(dim=(0, 1)))
    return out[0] if len(out) == 1 else torch.cat(out)


class Transformer:
    """Weights in the compute dtype plus the forward pass of one ubatch."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.rotary = Rotary(config)

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(dtype).contiguous()

        gemma = config.is_gemma

        def norm_w(name: str) -> torch.Tensor:
            # Gemma norms multiply in float32 (HF: output * (1.0 + weight.float())), so keep them float32
            return tensors[name].to(torch.float32).contiguous() if gemma else w(name)

        self._norm = gemma_rms_norm if gemma else rms_norm
        self._act = (lambda g: F.gelu(g, approximate="tanh")) if config.hidden_act == "gelu_tanh" else F.silu
        # HF multiplies by sqrt(hidden_size) as a tensor of the compute dtype
        self.embd_scale = torch.tensor(config.n_embd ** 0.5, dtype=dtype) if gemma else None
        self.attn_scale = config.attn_scale if config.query_pre_attn_scalar is not None else None
        embd = tensors["model.embed_tokens.weight"]
        # A quantized embedding stays as the file's blocks; a lookup decodes only the rows it reads.
        self.tok_embd = (PackedRows.from_gguf_blocks(embd.blocks, embd.type_name, *embd.shape)
                         if isinstance(embd, QuantizedBlocks) else advise_huge_pages(w("model.embed_tokens.weight")))
        self.norm = norm_w("model.norm.weight")
        # Tied embeddings stay [n_vocab, n_embd], the output layer's own layout, and are not copied; a
        # quantized tied embedding also has a packed copy for the output layer (the blocks have no
        # kernel, the packed int4 form no row access).
        self.n_split = n_split = max(1, torch.get_num_threads())
        self.tied = config.tie_word_embeddings
        self.lm_head = None if self.tied else fused_matrix([tensors["lm_head.weight"]], dtype, n_split)
        self.packed_output_copy = self.tied and isinstance(embd, QuantizedBlocks)
        self.layers = []
        for i in range(config.n_layer):
            p = f"model.layers.{i}.self_attn."
            m = f"model.layers.{i}.mlp."
            weights = self._rope_order([tensors[p + f"{x}_proj.weight"] for x in "qkv"])
            biases = self._rope_order([tensors.get(p + f"{x}_proj.bias") for x in "qkv"])
            ln = f"model.layers.{i}."
            self.layers.append(LayerWeights(
                attn_norm=norm_w(ln + "input_layernorm.weight"),
                wqkv=fused_matrix(weights, dtype, n_split),
                bqkv=None if biases[0] is None else torch.cat(biases).to(dtype),
                wo=fused_matrix([tensors[p + "o_proj.weight"]], dtype, n_split),
                bo=None if p + "o_proj.bias" not in tensors else w(p + "o_proj.bias"),
                # llama: the norm before the MLP is HF's post_attention_layernorm; Gemma names it
                # pre_feedforward_layernorm and uses post_attention_layernorm on the attention output
                ffn_norm=norm_w(ln + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
                w_gate_up=fused_matrix([tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"]], dtype, n_split),
                w_down=fused_matrix([tensors[m + "down_proj.weight"]], dtype, n_split),
                post_attn_norm=norm_w(ln + "post_attention_layernorm.weight") if gemma else None,
                post_ffn_norm=norm_w(ln + "post_feedforward_layernorm.weight") if gemma else None,
                q_norm=norm_w(p + "q_norm.weight") if config.has_qk_norm else None,
                k_norm=norm_w(p + "k_norm.weight") if config.has_qk_norm else None,
            ))
        self._qkv_split = (config.n_head * config.head_dim, config.n_embd_k_gqa, config.n_embd_v_gqa)
        # The output layer's weights: the tied embedding is the same tensor until placed on another device.
        self.output_embd = None
        if self.packed_output_copy:
            self.output_embd = fused_matrix([embd], dtype, n_split)
        elif self.tied:
            self.output_embd = self.tok_embd
        # Placement (engine.placement.weight_devices): everything on the CPU until place() is called.
        self.weight_devices: WeightDevices = all_on_cpu(config)
        self.bytes_moved = 0  # bytes copied between devices, ever (activations, logits); contexts read differences
        self.copy_seconds = 0.0  # wall time of those moves, ever (CUDA copies synchronised to be timed)

    def _rope_order(self, qkv: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Q, K, V rows (weights, or biases: None where absent) with Q and K in the order this model's
        RoPE turns (engine/rope.py). For llama-family models that is the order convert_hf_to_gguf
        writes and llama.cpp computes in, so the K cache and every state saved from it hold llama.cpp's
        K rows, quantized blocks included. Reordering the rows once here costs nothing per token, and
        Q is reordered as K is, so their products are unchanged."""
        cfg = self.config
        if cfg.rope_type != ROPE_TYPE_NORM:
            return qkv
        q, k, v = qkv

        def reorder(t, n_head: int):
            return None if t is None else reorder_rows(t, lambda rows: to_norm_order(rows, n_head))

        return [reorder(q, cfg.n_head), reorder(k, cfg.n_head_kv), v]

    # ---- placement (src/llama-model.cpp llama_model_base::load_tensors) ---------------------------------
    @staticmethod
    def _nbytes(tensors) -> int:
        return sum(weight_nbytes(t) for t in tensors if t is not None)

    def layer_field_tensors(self, il: int) -> dict[str, list[torch.Tensor]]:
        """Layer il's tensors by weight field; a bias is listed with the matrix it belongs to."""
        layer = self.layers[il]
        out: dict[str, list[torch.Tensor]] = {}
        for name, t in vars(layer).items():
            if t is not None:
                out.setdefault(BIAS_OF.get(name, name), []).append(t)
        return out

    def weight_bytes_by_device(self, wd: WeightDevices) -> dict[Device, int]:
        """Bytes of weights each device holds under wd. A tied output layer on the input embedding's
        device shares that tensor; on another device it is a whole copy (llama.cpp duplicates it)."""
        out: dict[Device, int] = {}

        def add(dev: Device, nbytes: int) -> None:
            out[dev] = out.get(dev, 0) + nbytes

        add(wd.tok_embd, self._nbytes([self.tok_embd]))
        for il, devs in enumerate(wd.layers):
            for name, tensors in self.layer_field_tensors(il).items():
                add(devs.fields[name], self._nbytes(tensors))
        add(wd.output_norm, self._nbytes([self.norm]))
        if self.lm_head is not None:
            add(wd.output, self._nbytes([self.lm_head]))
        elif self.packed_output_copy:
            add(wd.output, self._nbytes([self.output_embd]))
        elif wd.output.name != wd.tok_embd.name:
            add(wd.output, self._nbytes([self.tok_embd]))
        return out

    def resident_weight_bytes(self) -> int:
        """Bytes of weights held on all devices together under the current placement (packed bytes for
        packed weights; a tied output layer copied to another device counts twice, as in llama.cpp)."""
        return sum(self.weight_bytes_by_device(self.weight_devices).values())

    def place(self, wd: WeightDevices | None) -> None:
        """Move every weight to its device's torch device (None: all to the CPU). A virtual device's
        torch device is the CPU, so nothing moves in memory, but its boundaries are still crossed in
        forward() and counted in bytes_moved: boundaries are between Devices, not torch devices."""
        wd = wd or all_on_cpu(self.config)
        self.tok_embd = self.tok_embd.to(wd.tok_embd.torch_device)
        for layer, devs in zip(self.layers, wd.layers):
            for name, t in vars(layer).items():
                if t is not None:
                    setattr(layer, name, t.to(devs.fields[BIAS_OF.get(name, name)].torch_device))
        self.norm = self.norm.to(wd.output_norm.torch_device)
        if self.packed_output_copy:
            self.output_embd = self.output_embd.to(wd.output.torch_device)
        elif self.tied:
            self.output_embd = self.tok_embd.to(wd.output.torch_device)  # the same tensor on the same device
        else:
            self.lm_head = self.lm_head.to(wd.output.torch_device)
        self.weight_devices = wd

    def _move(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        """x copied across a device boundary. Between virtual devices (both host memory) the copy is a
        host memcpy, so that its time is real, if smaller than a PCIe transfer would take."""
        self.bytes_moved += x.numel() * x.element_size()
        t0 = time.perf_counter()
        moved = x.clone() if x.device == device else x.to(device)
        if moved.is_cuda or x.is_cuda:
            torch.cuda.synchronize(moved.device if moved.is_cuda else x.device)
        self.copy_seconds += time.perf_counter() - t0
        return moved

    def _to(self, x: torch.Tensor, src: Device, dst: Device) -> torch.Tensor:
        """x, computed on src, as an input on dst; a copy (counted) only where the devices differ."""
        if src is dst or src.name == dst.name:
            return x
        return self._move(x, dst.torch_device)

    def n_params(self) -> int:
        tensors = [self.tok_embd, self.norm] + ([] if self.lm_head is None else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(weight_numel(t) for t in tensors)

    def output_weight(self) -> Weight:
        """The output layer's matrix as project() takes it: lm_head, the packed copy of a quantized tied
        embedding, or a float tied embedding viewed as row blocks (a view: it follows place())."""
        if self.lm_head is not None:
            return self.lm_head
        if isinstance(self.output_embd, PackedWeight):
            return self.output_embd
        return as_row_blocks(self.output_embd, self.n_split)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids [T] -> [T, C] in the compute dtype, on the embedding's device."""
        if isinstance(self.tok_embd, PackedRows):
            return self.tok_embd.rows(tokens).to(self.dtype)
        return self.tok_embd[tokens.to(self.tok_embd.device)]

    def _attention(self, il: int, layer: LayerWeights, devs: LayerDevices, x: torch.Tensor,
                   rope: "RopeTables", attn: AttentionInputs, probe: WeightsProbe | None) -> torch.Tensor:
        """Self-attention of one layer over the cache; x: [T, C] residual on devs.residual. Returns
        [T, C] on devs.residual. Each step runs where its weights are; the cache reads and the
        attention itself run on the layer's K/V device, as llama.cpp schedules them (so -nkvo
        sends Q, K, V to the CPU and the attention output back)."""
        cfg, norm, eps, to = self.config, self._norm, self.config.rms_norm_eps, self._to
        T, G = x.shape[0], attn.n_groups
        h = norm(to(x, devs.residual, devs.attn_norm), layer.attn_norm, eps)
        qkv = project(to(h, devs.attn_norm, devs.wqkv), layer.wqkv, layer.bqkv)
        q_width, k_width, _ = self._qkv_split
        v = qkv[:, q_width + k_width:]
        if layer.q_norm is None:  # Q and K heads turned by RoPE together: one rotation per layer
            qk = rope.apply(il, qkv[:, :q_width + k_width].view(T, cfg.n_head + cfg.n_head_kv, cfg.head_dim))
            q = to(qk[:, :cfg.n_head], devs.wqkv, devs.kv)
            k = to(qk[:, cfg.n_head:], devs.wqkv, devs.kv)
        else:  # gemma3: each head normalised first, Q and K by their own weights (and maybe devices)
            q = qkv[:, :q_width].view(T, cfg.n_head, cfg.head_dim)
            k = qkv[:, q_width:q_width + k_width].view(T, cfg.n_head_kv, cfg.head_dim)
            q = to(rope.apply(il, norm(to(q, devs.wqkv, devs.q_norm), layer.q_norm, eps)), devs.q_norm, devs.kv)
            k = to(rope.apply(il, norm(to(k, devs.wqkv, devs.k_norm), layer.k_norm, eps)), devs.k_norm, devs.kv)
        keys, values, mask = attn.store_and_load(il, k.reshape(T, -1), to(v, devs.wqkv, devs.kv),
                                                 self.dtype)  # [G, Hkv, n_kv, D]
        if T == 1 and probe is None and not cfg.attn_softcap:
            o = single_query_attention(q, keys, values, mask, self.attn_scale)
        else:
            q = q.reshape(G, T // G, cfg.n_head, cfg.head_dim).transpose(1, 2)  # [G, H, T/G, D]
            if cfg.attn_softcap:
                o = softcapped_attention(q, keys, values, mask, cfg.attn_scale, cfg.attn_softcap)
            else:
                o = grouped_query_attention(q, keys, values, mask, self.attn_scale)
            if probe is not None:  # from the same q, K and mask, after the real attention, which it leaves alone
                probe.keep(il, attention_weights(q, keys, mask, probe.rows, cfg.attn_scale, cfg.attn_softcap))
            o = o.transpose(1, 2).reshape(T, cfg.n_head * cfg.head_dim)
        o = project(to(o, devs.kv, devs.wo), layer.wo, layer.bo)
        if layer.post_attn_norm is None:
            return to(o, devs.wo, devs.residual)
        return to(norm(to(o, devs.wo, devs.post_attn_norm), layer.post_attn_norm, eps), devs.post_attn_norm,
                  devs.residual)

    def _mlp(self, layer: LayerWeights, devs: LayerDevices, x: torch.Tensor) -> torch.Tensor:
        """Gated MLP of one layer; x: [T, C] residual on devs.residual. Returns [T, C] there."""
        norm, eps, to = self._norm, self.config.rms_norm_eps, self._to
        h = norm(to(x, devs.residual, devs.ffn_norm), layer.ffn_norm, eps)
        gate, up = project(to(h, devs.ffn_norm, devs.w_gate_up), layer.w_gate_up).chunk(2, dim=-1)
        h = project(to(self._act(gate) * up, devs.w_gate_up, devs.w_down), layer.w_down)
        if layer.post_ffn_norm is None:
            return to(h, devs.w_down, devs.residual)
        return to(norm(to(h, devs.w_down, devs.post_ffn_norm), layer.post_ffn_norm, eps), devs.post_ffn_norm,
                  devs.residual)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                output_rows: torch.Tensor, should_abort: Callable[[], bool] | None = None, *,
                probe: WeightsProbe | None = None) -> torch.Tensor:
        """tokens, positions: [T]; output_rows: indices into the ubatch. Returns [len(output_rows), n_vocab]
        float32 logits. probe: also hand it every layer's attention weights of its rows."""
        return self.forward_train(tokens, positions, attn, output_rows, should_abort, probe=probe)

    def forward_train(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                      output_rows: torch.Tensor, should_abort: Callable[[], bool] | None = None, *,
                      probe: WeightsProbe | None = None) -> torch.Tensor:
        """`forward` without inference mode, so that autograd records it: when the tensors the
        Transformer was built from require grad, the loss reaches them through the fused, row-blocked
        weights (tools/train_demo_model.py trains this way with engine.models.full_sequence)."""
        cfg, wd, to = self.config, self.weight_devices, self._to
        x = self.embed(tokens)  # [T, C]
        if self.embd_scale is not None:
            x = x * self.embd_scale.to(x.device)
        rope = RopeTables(self.rotary, positions, self.dtype)
        at = wd.tok_embd
        for il, (layer, devs) in enumerate(zip(self.layers, wd.layers)):
            if should_abort is not None and should_abort():
                raise DecodeAborted(f"aborted before layer {il}")
            x = to(x, at, devs.residual)  # a layer boundary: a copy only where the device changes
            at = devs.residual
            x = x + self._attention(il, layer, devs, x, rope, attn, probe)
            x = x + self._mlp(layer, devs, x)
        x = x[output_rows.to(x.device)]  # only the output rows cross to the output layer
        x = self._norm(to(x, at, wd.output_norm), self.norm, cfg.rms_norm_eps)
        x = to(x, wd.output_norm, wd.output)
        logits = project(x, self.output_weight())
        # logits are read on the host: from an offloaded output layer that is one more crossing, and
        # with a large vocabulary the largest one per token
        logits = self._to(logits.float(), wd.output, CPU)
        if cfg.final_softcap:
            logits = softcap(logits, cfg.final_softcap)
        return logits


class RopeTables:
    """A ubatch's RoPE cos/sin tables, made once on the CPU and copied to each torch device that asks
    (tables are inputs, like positions, not activations: not counted as moved)."""

    def __init__(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self._layer_table = rotary.layer_table
        # shaped once to broadcast over heads (Rotary.turn), rather than per layer
        self._tables = {torch.device("cpu"): [Rotary.broadcast_tables(c, s) for c, s in rotary.tables(positions, dtype)]}

    def apply(self, il: int, x: torch.Tensor) -> torch.Tensor:
        tables = self._tables.get(x.device)
        if tables is None:
            cpu = self._tables[torch.device("cpu")]
            tables = self._tables[x.device] = [(c.to(x.device), None if s is None else s.to(x.device)) for c, s in cpu]
        cos, sin = tables[self._layer_table[il]]
        return Rotary.turn(x, cos, sin)
