"""Tiny models written from scratch, for tests, benchmarks and the CLI demo (nothing is downloaded).

- `train_tiny_tokenizer`: a byte-level BPE trained on `TINY_CORPUS`, with "<s>" and "</s>".
- `write_hf_model`: a random-weight LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM /
  Gemma2ForCausalLM / Gemma3ForCausalLM (text) folder (safetensors); the sliding-window archs get a
  small window (8 by default) so that short tests slide.
- `write_gguf_from_hf`: its GGUF twin, converted the way llama.cpp's convert_hf_to_gguf.py does
  (names from gguf's own TensorNameMap, Q/K permutation for llama and Mistral, which becomes a
  llama-architecture file without its window; Gemma: no permutation, norm weights + 1, sliding
  window and soft-cap keys; gpt2 tokenizer metadata). It reads the folder with json/safetensors
  directly, not with kvscope's reader, so that comparing the two readers is a real check.
- `write_tiny_llama_demo`: both, small enough for a CLI demo.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from engine.models.config import RopeScaling

logger = logging.getLogger(__name__)

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
# Shape of the test suite's tiny models (tests/conftest.py); multiples of 32 so Q8_0 works.
TINY_TEST_SHAPE: dict[str, int] = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, vocab_size=512)
TensorType = Literal["F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "mixed"]
Arch = Literal["llama", "qwen2", "mistral", "gemma2", "gemma3"]
WRITABLE_ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2", "gemma3")
# config.json model_type -> the architecture llama.cpp's converter writes
GGUF_ARCH_OF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama", "gemma2": "gemma2",
                           "gemma3_text": "gemma3"}
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")

TINY_CORPUS = """\
The lighthouse keeper woke before the sun, as he had done for thirty years. He climbed the narrow
stairs with a cup of tea in one hand and a rag in the other, and he polished the great lens until
it shone like water. Outside, the sea was calm and grey, and a few gulls were already arguing over
the remains of a fish on the rocks below. He liked the mornings best, when the world was quiet and
nothing had gone wrong yet.

In the village at the foot of the hill, the baker was pulling the first loaves out of the oven.
The smell of warm bread drifted down the main street and into the open windows of the houses.
Children would soon be walking to school, and their parents would stop at the bakery for bread,
milk and the latest news. Most of the news was small: a cat had been found, a fence had fallen
down, and the old bridge over the river needed another coat of paint before the winter came.

Learning a new language is a slow and patient kind of work. At first every sentence feels like a
puzzle, and you count the words on your fingers before you dare to speak. Then, one day, you
notice that you understood a joke without translating it in your head. That moment is worth all
the hours spent with lists of verbs and tables of endings. The trick is to keep going when it
feels as if nothing is changing, because the change is happening underneath.

A good recipe is a kind of promise. It says that if you take these things, in these amounts, and
treat them in this order, you will get something worth eating. Of course the promise is not
always kept. Ovens run hot or cold, flour changes from one bag to the next, and eggs come in many
sizes. An experienced cook reads the recipe as a set of suggestions and watches the food instead
of the clock.

The train left the city at a quarter past nine and headed north through the fields. Most of the
passengers were reading or sleeping, but a small boy near the window counted the cows and the
horses and reported the numbers to his grandmother, who wrote them down in a notebook. By the
time they reached the mountains he had counted two hundred and twelve cows, nine horses and one
very surprised goat standing on the roof of a shed.

Computers do exactly what they are told, which is both their strength and their weakness. A
program that works perfectly on Monday can fail on Tuesday because someone typed a name with an
accent, or because a file was a little larger than anyone expected. Careful programmers write
tests that try the strange cases on purpose. They ask what happens when the list is empty, when
the number is negative, and when the network is slow, and they write down the answers.

In the garden, the tomatoes were finally turning red. The beans had climbed to the top of their
poles and were reaching for the sky, while the pumpkins spread quietly across the path as if they
owned it. Every evening the gardener walked between the rows with a watering can, pulling a weed
here and there, and thinking about what to plant next spring. Gardens, she liked to say, teach you
that most good things take longer than you want them to.

When the storm finally arrived, it came from the west with a sound like a crowd of people
running. The rain hammered on the roofs and the wind bent the trees almost to the ground. In the
lighthouse, the keeper lit the lamp early and watched the beam sweep across the dark water. Far
out on the waves, a small fishing boat turned toward the light and made its slow way home.
"""


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tiny_tokenizer(vocab_size: int = 512, *, text: str | None = None) -> Any:
    """A byte-level BPE trained on `text` (default TINY_CORPUS) with `tokenizers`.

    Ids 0 and 1 are the special tokens "<s>" (BOS) and "</s>" (EOS); the next 256 are the bytes.
    A small corpus runs out of merges, so the vocabulary may end below `vocab_size` (logged).

    Returns:
        a `tokenizers.Tokenizer`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = 2 + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:  # the trainer would keep them all anyway: more tokens than the model's embedding rows
        raise ValueError(f"vocab_size must be at least {minimum} (the special tokens <s> and </s> and the 256 byte "
                         f"tokens of the byte-level tokenizer); got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (text or TINY_CORPUS).split("\n\n")
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        logger.info("tiny tokenizer has %d tokens (asked for %d)", tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Hugging Face folder


def _rope_parameters(rope_theta: float, rope_scaling: RopeScaling | dict | None) -> dict[str, Any]:
    """transformers 5 `rope_parameters` for default or llama3 RoPE."""
    if rope_scaling is None:
        return {"rope_type": "default", "rope_theta": rope_theta}
    scaling = asdict(rope_scaling) if isinstance(rope_scaling, RopeScaling) else dict(rope_scaling)
    scaling.pop("type", None)
    return {"rope_type": "llama3", **{k: v for k, v in scaling.items() if k != "rope_type"}, "rope_theta": rope_theta}


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, *, tied: bool, norm_center: float = 1.0) -> None:
    """Re-draw every weight so that logits are peaked but not degenerate.

    transformers' default init (std 0.02) gives near-uniform logits on a tiny model, which hides
    bugs; 1/sqrt(fan_in) keeps activations O(1), and norm weights around 1 (not exactly 1) make a
    mixed-up norm visible (Gemma multiplies by 1 + w, so its norm weights are drawn around
    norm_center 0). A tied embedding is also the head, so it gets the head's scale.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.copy_(norm_center + 0.2 * (torch.rand(p.shape, generator=g) - 0.5))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name and not tied:
            p.copy_(torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name or name == "lm_head.weight":
            # the head sets the logit scale: std 2 over a unit-RMS hidden state
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 / math.sqrt(p.shape[1])))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def _hf_config(arch: str, **kwargs: Any) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
    )

    if arch == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], **kwargs)
    if arch == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], **kwargs)
    if arch == "mistral":
        return MistralConfig(architectures=["MistralForCausalLM"], **kwargs)
    if arch == "gemma2":
        return Gemma2Config(architectures=["Gemma2ForCausalLM"], **kwargs)
    if arch == "gemma3":
        return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **kwargs)
    raise ValueError(f"arch {arch!r} is not one write_hf_model builds; use one of {', '.join(WRITABLE_ARCHITECTURES)}")


def _model_class(arch: str) -> Any:
    import transformers

    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
    return getattr(transformers, names[arch])


def _arch_kwargs(arch: str, *, head_dim: int, n_layer: int, rope_theta: float, rope_theta_swa: float,
                 rope_scaling: RopeScaling | dict | None, sliding_window: int | None,
                 attn_softcap: float | None, final_softcap: float | None) -> dict[str, Any]:
    """The config arguments that differ between architectures."""
    if arch in ("llama", "qwen2"):
        return {"rope_parameters": _rope_parameters(rope_theta, rope_scaling)}
    if arch == "mistral":
        return {"rope_parameters": _rope_parameters(rope_theta, rope_scaling), "head_dim": head_dim,
                "sliding_window": sliding_window}
    if rope_scaling is not None:
        raise ValueError(f"write_hf_model: rope_scaling is not available for {arch}")
    gemma = {"head_dim": head_dim, "query_pre_attn_scalar": head_dim, "sliding_window": sliding_window,
             "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": None}
    if arch == "gemma2":
        return {**gemma, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
                "attn_logit_softcapping": 50.0 if attn_softcap is None else attn_softcap,
                "final_logit_softcapping": 30.0 if final_softcap is None else final_softcap}
    if attn_softcap:
        raise ValueError("write_hf_model: Gemma 3 has no attention soft-capping")
    return {**gemma, "final_logit_softcapping": final_softcap or None,
            "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layer)],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": rope_theta_swa},
                                "full_attention": {"rope_type": "default", "rope_theta": rope_theta}}}


def write_hf_model(
    folder: str | Path,
    arch: Arch = "llama",
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
    rope_theta: float = 10000.0,
    rope_scaling: RopeScaling | dict | None = None,
    n_ctx_train: int = 2048,
    tie: bool | None = None,
    max_shard_size: int | str | None = None,
    sliding_window: int | None = 8,
    rope_theta_swa: float = 10000.0,
    attn_softcap: float | None = None,
    final_softcap: float | None = None,
) -> Path:
    """Write a random-weight float32 Hugging Face model folder with a tiny trained tokenizer.

    Args:
        folder: where to write (created); its name becomes the model name.
        arch: "llama" (LlamaForCausalLM), "qwen2" (Qwen2ForCausalLM, with q/k/v biases), "mistral"
            (MistralForCausalLM: every layer slides), "gemma2" (Gemma2ForCausalLM: even layers
            slide, soft-capping) or "gemma3" (Gemma3ForCausalLM with a Gemma3TextConfig: layer il
            slides unless il % 6 == 5, as llama.cpp's pattern; Q/K norms).
        rope_theta: the RoPE base (gemma3: of the full-attention layers).
        rope_scaling: llama3-style scaling, as a RopeScaling or a dict of its fields (llama family).
        tie: share the embedding with the output head (no lm_head.weight is written); default:
            tied for Gemma, untied otherwise.
        max_shard_size: e.g. "100KB" or bytes; when given, weights are split into shards with
            model.safetensors.index.json.
        sliding_window: HF's window W (a query sees W keys, itself included) of mistral, gemma2 and
            gemma3; None: no sliding window (mistral, gemma2) or none stated (gemma3).
        rope_theta_swa: gemma3's RoPE base of sliding layers (llama.cpp assumes 10000).
        attn_softcap, final_softcap: gemma2's soft-caps (default 50 and 30); gemma3's final soft-cap
            (default none).
        The other arguments are the hyper-parameters, named as in ModelConfig (vocab_size at least
        258: the tokenizer's two special tokens and 256 bytes); Gemma's query_pre_attn_scalar is
        head_dim, which is what llama.cpp assumes.

    Returns:
        the folder.
    """
    if arch not in WRITABLE_ARCHITECTURES:
        raise ValueError(f"arch {arch!r} is not one write_hf_model builds; use one of {', '.join(WRITABLE_ARCHITECTURES)}")
    gemma = arch in ("gemma2", "gemma3")
    tie = gemma if tie is None else tie
    tokenizer = train_tiny_tokenizer(vocab_size)  # refuses a vocabulary it cannot fit, before any file is made
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _hf_config(
        arch,
        vocab_size=vocab_size,
        hidden_size=n_embd,
        intermediate_size=n_ff,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head_kv,
        max_position_embeddings=n_ctx_train,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        **_arch_kwargs(arch, head_dim=n_embd // n_head, n_layer=n_layer, rope_theta=rope_theta,
                       rope_theta_swa=rope_theta_swa, rope_scaling=rope_scaling, sliding_window=sliding_window,
                       attn_softcap=attn_softcap, final_softcap=final_softcap),
    )
    model = _model_class(arch)(config).to(torch.float32).eval()
    _init_weights(model, seed, tied=tie, norm_center=0.0 if gemma else 1.0)
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **save_kwargs)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": arch != "qwen2",  # llama, mistral and Gemma add BOS; qwen2 does not
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": n_ctx_train,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return folder


# ---------------------------------------------------------------------------------------------
# GGUF conversion


def llama3_rope_freq_factors(scaling: RopeScaling, *, head_dim: int, rope_theta: float) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for llama3 scaling: one divisor per
    pair of dimensions (1 for short wavelengths, `factor` for long ones, smooth in between)."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _load_hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    return tensors


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: per head, HF rows i, i + d/2 -> rows 2i, 2i + 1."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _storage_type(gguf_name: str, array: np.ndarray, tensor_type: TensorType) -> str:
    """Which type a tensor is written as. 1-D tensors (norms, biases) always stay F32, as in llama.cpp."""
    if array.ndim == 1:
        return "F32"
    if tensor_type != "mixed":
        block = {"Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q6_K": 256}.get(tensor_type, 1)
        if array.shape[-1] % block != 0:
            raise ValueError(
                f"{gguf_name}: {tensor_type} needs the inner dimension to be a multiple of {block}, it is "
                f"{array.shape[-1]}; pick sizes that are multiples of {block} or use F16"
            )
        return tensor_type
    # "mixed": exercise several types in one file
    if gguf_name == "token_embd.weight":
        choice = "F16"
    elif gguf_name == "output.weight":
        choice = "F32"
    elif ".ffn_gate." in gguf_name or ".ffn_up." in gguf_name:
        choice = "F16"
    else:
        choice = "Q8_0"
    if choice == "Q8_0" and array.shape[-1] % 32 != 0:
        choice = "F16"
    return choice


def _add_tensor(writer: Any, name: str, array: np.ndarray, storage: str) -> None:
    import gguf

    if storage == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif storage == "F16":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
    else:
        from engine.testing.kquants import quantize_q4_k, quantize_q6_k

        qtype = gguf.GGMLQuantizationType[storage]
        values = np.ascontiguousarray(array, dtype=np.float32)
        k_writers = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}  # gguf-py has no K-quant writer
        q = k_writers[storage](values) if storage in k_writers else gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def _tokenizer_metadata(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """gpt2-style tokenizer keys from tokenizer.json, padded to vocab_size with [PADn] tokens."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    if tok["model"]["type"] != "BPE" or (tok.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{folder}: write_gguf_from_hf converts byte-level BPE tokenizers only")
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    for t in tok.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    by_id = {i: t for t, i in vocab.items()}
    n_vocab = max(int(config["vocab_size"]), len(by_id))
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    types = [3 if t in special else (1 if i in by_id else 5) for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges, "add_bos": bool(tok_config.get("add_bos_token"))}


def _write_metadata(writer: Any, arch: str, config: dict[str, Any], name: str, tensor_type: str) -> None:
    n_embd, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or n_embd // n_head)
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # gemma3: freq_base is the full-attention layers' (global) base
        rope = rope["full_attention"]
    file_types = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_K": 15, "Q6_K": 18, "mixed": 7}  # llama_ftype
    writer.add_name(name)
    writer.add_file_type(file_types[tensor_type])
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(n_embd)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or n_head))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))


def _write_arch_metadata(writer: Any, model_type: str, config: dict[str, Any]) -> None:
    """The keys convert_hf_to_gguf.py's Gemma2Model / Gemma3Model add. Mistral (llama architecture)
    gets none: its sliding window is not written."""
    import gguf

    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        writer.add_sliding_window(int(config["sliding_window"]))
    elif model_type == "gemma3_text":
        assert config.get("attn_logit_softcapping") is None, "attn_logit_softcapping is removed in Gemma3"
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        if config.get("sliding_window_pattern") != 1 and config.get("sliding_window") is not None:
            writer.add_sliding_window(int(config["sliding_window"]))
        full = (config.get("rope_parameters") or {}).get("full_attention") or {}
        if full.get("rope_type") == "linear":  # applies to the global layers only
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(full["factor"]))


def _write_tokenizer(writer: Any, folder: Path, config: dict[str, Any]) -> None:
    tok = _tokenizer_metadata(folder, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name; the tiny tokenizer splits with the GPT-2 regex
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(int(config["bos_token_id"]))
    writer.add_eos_token_id(int(config["eos_token_id"]))
    writer.add_add_bos_token(tok["add_bos"])


def _write_rope_freqs(writer: Any, config: dict[str, Any]) -> None:
    """llama.cpp keeps llama3 rope scaling as a `rope_freqs.weight` tensor, not as metadata."""
    import gguf

    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return
    scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    factors = llama3_rope_freq_factors(scaling, head_dim=head_dim, rope_theta=float(rope["rope_theta"]))
    writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)


def write_gguf_from_hf(
    hf_folder: str | Path,
    gguf_path: str | Path,
    *,
    tensor_type: TensorType = "F32",
    permute_qk: bool = True,
) -> Path:
    """Convert a folder written by `write_hf_model` to GGUF, as llama.cpp's converter would.

    Args:
        hf_folder: the Hugging Face folder.
        gguf_path: the file to write.
        tensor_type: storage of 2-D weights: "F32", "F16", "Q8_0" or "Q4_0" (inner dim a multiple of
            32), "Q4_K" or "Q6_K" (a multiple of 256; engine/testing/kquants.py), or "mixed" (F32, F16
            and Q8_0 for different tensors). Norms and biases are always F32.
        permute_qk: apply llama.cpp's Q/K row permutation for llama and Mistral (False writes a
            deliberately wrong file, for tests that show the permutation matters). Gemma and qwen2
            are never permuted.

    Returns:
        gguf_path.
    """
    import gguf

    hf_folder, gguf_path = Path(hf_folder), Path(gguf_path)
    config = json.loads((hf_folder / "config.json").read_text())
    model_type = config["model_type"]
    if model_type not in GGUF_ARCH_OF_MODEL_TYPE:
        raise ValueError(f"{hf_folder}: write_gguf_from_hf converts {', '.join(GGUF_ARCH_OF_MODEL_TYPE)}, "
                         f"not {model_type!r}")
    arch = GGUF_ARCH_OF_MODEL_TYPE[model_type]
    gemma = model_type in GEMMA_MODEL_TYPES
    n_layer, n_head = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    n_head_kv = int(config.get("num_key_value_heads") or n_head)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layer)

    writer = gguf.GGUFWriter(str(gguf_path), arch)
    _write_metadata(writer, arch, config, hf_folder.resolve().name, tensor_type)
    _write_arch_metadata(writer, model_type, config)
    _write_tokenizer(writer, hf_folder, config)
    _write_rope_freqs(writer, config)
    for hf_name, array in sorted(_load_hf_tensors(hf_folder).items()):
        if gemma and hf_name == "lm_head.weight":
            continue  # llama.cpp's Gemma models always use the embedding as the head
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{hf_folder}: no llama.cpp name for tensor {hf_name!r}")
        if gemma and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # the converter stores Gemma's 1 + w
        if arch == "llama" and permute_qk and ".q_proj." in hf_name:
            array = _permute(array, n_head)
        elif arch == "llama" and permute_qk and ".k_proj." in hf_name:
            array = _permute(array, n_head_kv)
        _add_tensor(writer, gguf_name, array, _storage_type(gguf_name, array, tensor_type))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


# ---------------------------------------------------------------------------------------------
# Demo


def write_tiny_llama_demo(folder: str | Path, *, tensor_type: TensorType = "F32") -> tuple[Path, Path]:
    """Write a 4-layer, 128-wide llama for CLI demos: `folder/tiny-llama` and `folder/tiny-llama.gguf`.

    Returns:
        (hf_folder, gguf_path).
    """
    folder = Path(folder)
    hf = write_hf_model(
        folder / "tiny-llama",
        "llama",
        n_layer=4,
        n_embd=128,
        n_head=4,
        n_head_kv=2,
        n_ff=256,
        vocab_size=512,
        seed=1234,
    )
    return hf, write_gguf_from_hf(hf, folder / "tiny-llama.gguf", tensor_type=tensor_type)
