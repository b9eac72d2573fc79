"""Model hyper-parameters shared by every architecture kvscope runs.

A `ModelConfig` is what the readers in `engine/formats/` produce from a GGUF header or a
config.json, and what the transformer in `engine/models/transformer.py` is built from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2", "gemma3")
# The Gemma family: embeddings scaled by sqrt(n_embd), RMSNorm weights applied in float32 (the
# checkpoint holds llama.cpp's stored value 1 + w, see engine/formats/hf_folder.py), a norm before and
# after both attention and MLP, a gelu-tanh gated MLP and tied embeddings; gemma3 adds Q/K norms.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh")
# llama.cpp's RoPE types (include/llama.h LLAMA_ROPE_TYPE_NORM / LLAMA_ROPE_TYPE_NEOX), see ModelConfig.rope_type
ROPE_TYPE_NORM, ROPE_TYPE_NEOX = "norm", "neox"
ROPE_NORM_ARCHITECTURES = ("llama", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3" in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, named as in llama.cpp's hparams.

    Weights that go with a config always use Hugging Face tensor names and layouts
    (`model.layers.{i}.self_attn.q_proj.weight`, ...), whatever file they came from.
    """

    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_norm_eps: float
    rope_theta: float
    n_ctx_train: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = False
    name: str = ""
    # Sliding-window attention, in llama.cpp's terms: n_swa is the window (a key at p0 is masked
    # for a query at p1 when p1 - p0 >= n_swa, STANDARD type), swa_type an engine.kv.swa.SwaType
    # value, swa_layers one flag per layer (empty: no sliding layer).
    n_swa: int = 0
    swa_type: int = 0
    swa_layers: tuple[bool, ...] = ()
    # RoPE base of the sliding-window layers (gemma3: 10000 while full layers use rope_theta); None:
    # rope_theta. rope_freq_scale / rope_freq_scale_swa: llama.cpp's linear scaling of the angle
    # (1 / factor of HF's "linear" rope type) for full-attention / sliding layers.
    rope_theta_swa: float | None = None
    rope_freq_scale: float = 1.0
    rope_freq_scale_swa: float = 1.0
    # Attention scale is query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Soft-capping, x -> tanh(x / c) * c, of the attention logits (before masking) and of the final
    # logits; 0: none (gemma2: 50 and 30).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    hidden_act: str = "silu"  # gated MLP activation: "silu" (llama family) or "gelu_tanh" (Gemma)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; kvscope runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.n_head % self.n_head_kv != 0:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"hidden activation {self.hidden_act!r} is not one of {', '.join(HIDDEN_ACTIVATIONS)}")
        if self.swa_layers and len(self.swa_layers) != self.n_layer:
            raise ValueError(f"swa_layers has {len(self.swa_layers)} flags for {self.n_layer} layers")
        if self.has_swa and self.n_swa <= 0:
            raise ValueError(f"sliding-window layers need a window n_swa > 0, got {self.n_swa}")

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    @property
    def has_swa(self) -> bool:
        return any(self.swa_layers)

    @property
    def is_gemma(self) -> bool:
        """Gemma layer structure (see GEMMA_ARCHITECTURES)."""
        return self.arch in GEMMA_ARCHITECTURES

    @property
    def rope_type(self) -> str:
        """Which dims of a head RoPE turns together, as llama.cpp's llama_model_rope_type
        (src/llama-model.cpp) says for the arch.

        ROPE_TYPE_NORM (llama, and Mistral, which convert_hf_to_gguf writes as llama): dims 2i and
        2i + 1. The converter permutes these models' Q/K rows so that Hugging Face dims i and i + d/2
        become 2i and 2i + 1, so kvscope computes Q and K in that order too, and its K cache holds
        llama.cpp's rows (engine/models/transformer.py). ROPE_TYPE_NEOX (qwen2, Gemma): dims i and
        i + d/2, Hugging Face's rotate_half on rows stored as they are."""
        return ROPE_TYPE_NORM if self.arch in ROPE_NORM_ARCHITECTURES else ROPE_TYPE_NEOX

    @property
    def has_qk_norm(self) -> bool:
        """RMSNorm over each head of Q and K before RoPE (gemma3)."""
        return self.arch == "gemma3"

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_base(self, il: int) -> float:
        """The RoPE base (freq_base) of layer il."""
        if self.is_swa(il) and self.rope_theta_swa is not None:
            return self.rope_theta_swa
        return self.rope_theta

    def rope_freq_scale_of(self, il: int) -> float:
        return self.rope_freq_scale_swa if self.is_swa(il) else self.rope_freq_scale

    @property
    def n_embd_k_gqa(self) -> int:
        """Width of one K row of one layer (all KV heads)."""
        return self.head_dim * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        """Width of one V row of one layer (all KV heads)."""
        return self.head_dim * self.n_head_kv


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with `config` needs, under its Hugging Face name, with its torch shape.

    Both readers check against this: engine/formats/gguf_file.py translates it to llama.cpp names
    and ggml shapes, so that a GGUF's errors name what the file holds.
    """
    c = config
    q_rows, kv_rows = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.n_vocab, c.n_embd),
        "model.norm.weight": (c.n_embd,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.n_vocab, c.n_embd)
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.n_embd,),
            p + "post_attention_layernorm.weight": (c.n_embd,),
            p + "self_attn.q_proj.weight": (q_rows, c.n_embd),
            p + "self_attn.k_proj.weight": (kv_rows, c.n_embd),
            p + "self_attn.v_proj.weight": (kv_rows, c.n_embd),
            p + "self_attn.o_proj.weight": (c.n_embd, q_rows),
            p + "mlp.gate_proj.weight": (c.n_ff, c.n_embd),
            p + "mlp.up_proj.weight": (c.n_ff, c.n_embd),
            p + "mlp.down_proj.weight": (c.n_embd, c.n_ff),
        }
        if c.is_gemma:
            # a norm before and after attention and MLP (post_attention_layernorm is the norm of the
            # attention output here, not the one before the MLP as in llama)
            shapes |= {
                p + "pre_feedforward_layernorm.weight": (c.n_embd,),
                p + "post_feedforward_layernorm.weight": (c.n_embd,),
            }
        if c.has_qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
            if c.arch != "qwen2":  # HF's attention_bias covers o_proj too; qwen2's o_proj has none
                shapes[p + "self_attn.o_proj.bias"] = (c.n_embd,)
    return shapes
