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
