"""Model hyper-parameters shared by every architecture kvscope runs.

A `ModelConfig` is what the readers in `engine/formats/` produce from a GGUF header or a
config.json, and what the transformer in `engine/models/transformer.py` is built from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


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
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; kvscope runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.n_head % self.n_head_kv != 0:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    @property
    def has_swa(self) -> bool:
        return any(self.swa_layers)

    @property
    def n_embd_k_gqa(self) -> int:
        """Width of one K row of one layer (all KV heads)."""
        return self.head_dim * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        """Width of one V row of one layer (all KV heads)."""
        return self.head_dim * self.n_head_kv
