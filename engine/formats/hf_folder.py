"""Reading Hugging Face model folders: config.json, *.safetensors and the tokenizer files.

Only safetensors are read. Pickle checkpoints (`pytorch_model.bin`) can run arbitrary code when
loaded, so they are refused with a message that says how to convert them.

Both config.json dialects are understood: transformers < 5 writes `rope_theta` and `rope_scaling`,
transformers 5 writes `rope_parameters={"rope_type": ..., "rope_theta": ...}` (Gemma 3: one such dict
per layer type, "full_attention" and "sliding_attention"; before 5: `rope_theta`, `rope_local_base_freq`).

Architectures (config.json model_type -> kvscope arch): llama, qwen2, mistral, gemma2, and
gemma3_text -> gemma3 (the text-only Gemma3ForCausalLM; the multimodal model_type "gemma3" is refused).
Sliding windows: HF's window W lets a query see W keys including itself, which is llama.cpp's n_swa W
(masked when p1 - p0 >= n_swa). mistral: every layer slides when sliding_window is set; gemma2/gemma3:
the layers whose layer_types entry is "sliding_attention" (older configs: sliding_window_pattern).

Gemma norms: HF stores w and computes x * (1 + w); llama.cpp's converter stores 1 + w. kvscope's
tensors hold 1 + w for both formats: `read_hf_folder` adds 1 (in float32, as HF does at run time) to
every Gemma tensor whose name ends in "norm.weight", so a GGUF twin has identical tensors.

Example:
    contents = read_hf_folder("models/tiny-llama")
    contents.config.n_layer, contents.tensors["model.norm.weight"].shape
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from engine.errors import ModelFileError, UnsupportedArchitectureError
from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

# config.json model_type -> kvscope architecture (llama.cpp's name)
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "gemma2": "gemma2", "gemma3_text": "gemma3"}
# config.json "architectures" entry for each model_type kvscope runs
HF_ARCHITECTURE_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                           "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


@dataclass(frozen=True)
class HFFolderContents:
    """What a Hugging Face model folder holds, in kvscope's terms.

    `tensors` are float32 copies under their file names (Gemma norm weights as 1 + w, see the module
    docstring); `tensor_types` is each one's dtype in the file ("BF16", ...); `metadata` is config.json as parsed; `tokenizer_config` is
    tokenizer_config.json (empty if absent).
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tensor_types: dict[str, str]
    tokenizer_path: Path
    tokenizer_config: dict[str, Any]
    metadata: dict[str, Any]


def read_json(path: Path, *, required: bool) -> dict[str, Any]:
    """A JSON object from `path`; {} if it is absent and not required. Bad JSON is a ModelFileError."""
    if not path.is_file():
        if required:
            raise ModelFileError(f"{path}: missing; a Hugging Face model folder needs {path.name}")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# config.json


def _model_type_of(raw: dict[str, Any], path: Path) -> str:
    """The kvscope architecture of a config.json (HF_MODEL_TYPES), or UnsupportedArchitectureError."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise ModelFileError(f"{path}: config.json has no model_type")
    if model_type not in HF_MODEL_TYPES:
        hint = ""
        if model_type == "gemma3":
            hint = (" (the multimodal Gemma 3; kvscope runs the text-only Gemma3ForCausalLM, "
                    "config.json model_type 'gemma3_text')")
        raise UnsupportedArchitectureError(
            f"{path}: architecture {model_type!r} (model_type) is not supported{hint}; "
            f"kvscope runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    classes = raw.get("architectures") or []
    expected = HF_ARCHITECTURE_CLASSES[model_type]
    if classes and expected not in classes:
        raise UnsupportedArchitectureError(
            f"{path}: architectures {classes} are not supported; kvscope runs "
            f"{', '.join(HF_ARCHITECTURE_CLASSES.values())}"
        )
    return HF_MODEL_TYPES[model_type]


def rope_from_hf_config(raw: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from either config.json dialect."""
    params = raw.get("rope_parameters") or {}
    legacy = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ModelFileError(f"{path}: rope_parameters/rope_scaling must be JSON objects")
    scaling = {**legacy, **params}  # the transformers 5 form wins where both are present
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "default" or (kind == "linear" and factor == 1.0):
        return theta, None
    if kind != "llama3":
        raise ModelFileError(
            f"{path}: rope scaling type {kind!r} is not supported; kvscope implements 'default' and 'llama3'"
        )
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ModelFileError(f"{path}: llama3 rope scaling needs original_max_position_embeddings")
    return theta, RopeScaling(
        factor=factor,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a token as "<s>" or as {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SpecialTokens:
    """The BOS/EOS facts a folder states across config.json, generation_config.json, tokenizer_config.json."""

    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool


def special_tokens(
    raw: dict[str, Any],
    generation_config: dict[str, Any],
    tokenizer_config: dict[str, Any],
    token_to_id: Callable[[str], int | None],
    *,
    adds_bos: Callable[[int | None], bool],
) -> SpecialTokens:
    """Merge the special-token facts.

    `token_to_id` resolves tokens given by text; `adds_bos(bos_id)` says whether tokenizer.json's
    post-processor inserts that BOS, which decides add_bos when tokenizer_config.json is silent.
    """
    bos_ids = _ids(raw.get("bos_token_id")) or _ids(generation_config.get("bos_token_id"))
    bos_text = _token_content(tokenizer_config.get("bos_token"))
    if not bos_ids and bos_text is not None and token_to_id(bos_text) is not None:
        bos_ids = [token_to_id(bos_text)]
    eos: list[int] = []
    eos_text = _token_content(tokenizer_config.get("eos_token"))
    text_ids = [token_to_id(eos_text)] if eos_text is not None and token_to_id(eos_text) is not None else []
    for i in _ids(raw.get("eos_token_id")) + _ids(generation_config.get("eos_token_id")) + text_ids:
        if i not in eos:
            eos.append(i)
    bos_id = bos_ids[0] if bos_ids else None
    add_bos = tokenizer_config["add_bos_token"] if "add_bos_token" in tokenizer_config else adds_bos(bos_id)
    return SpecialTokens(bos_id=bos_id, eos_ids=tuple(eos), add_bos=bool(add_bos))


def _rope_type_params(params: dict[str, Any], path: Path, what: str) -> tuple[float, float]:
    """(rope_theta, llama.cpp freq_scale) of one Gemma 3 layer type: "default" or "linear" RoPE."""
    if not isinstance(params, dict):
        raise ModelFileError(f"{path}: rope parameters of {what} layers must be a JSON object")
    kind = params.get("rope_type", params.get("type", "default"))
    factor = float(params.get("factor", 1.0))
    if kind not in ("default", "linear"):
        raise ModelFileError(f"{path}: rope type {kind!r} of {what} layers is not supported for gemma3; "
                             "kvscope implements 'default' and 'linear'")
    if kind == "linear" and factor <= 0:
        raise ModelFileError(f"{path}: linear rope factor must be positive, got {factor}")
    return float(params["rope_theta"]), 1.0 if kind == "default" else 1.0 / factor


def gemma3_rope_from_hf_config(raw: dict[str, Any], path: Path) -> dict[str, float]:
    """ModelConfig's rope fields of a gemma3 config.json: per layer type in transformers 5,
    rope_theta / rope_local_base_freq / rope_scaling (full layers only) before."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = dict(params.get(FULL) or {})
        sliding = dict(params.get(SLIDING) or {})
    else:
        full = {**(raw.get("rope_scaling") or {}), **(params or {})}
        sliding = {"rope_type": "default"}
        if raw.get("rope_local_base_freq") is not None:
            sliding["rope_theta"] = raw["rope_local_base_freq"]
        if raw.get("rope_theta") is not None:
            full.setdefault("rope_theta", raw["rope_theta"])
    full.setdefault("rope_theta", 1_000_000.0)  # transformers' Gemma3TextConfig defaults
    sliding.setdefault("rope_theta", 10_000.0)
    theta, scale = _rope_type_params(full, path, "full-attention")
    theta_swa, scale_swa = _rope_type_params(sliding, path, "sliding-window")
    return {"rope_theta": theta, "rope_freq_scale": scale, "rope_theta_swa": theta_swa,
            "rope_freq_scale_swa": scale_swa}


def _layer_types(raw: dict[str, Any], n_layer: int, default_pattern: int, path: Path) -> list[str]:
    """Per layer "sliding_attention" or "full_attention": layer_types, or (older configs)
    sliding_window_pattern n, where layer i slides iff (i + 1) % n != 0."""
    types = raw.get("layer_types")
    if types is None:
        n = int(raw.get("sliding_window_pattern") or default_pattern)
        return [SLIDING if (i + 1) % n else FULL for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer or set(types) - {SLIDING, FULL}:
        raise ModelFileError(f"{path}: layer_types must list {n_layer} entries of {SLIDING!r} or {FULL!r}, "
                             f"found {types!r}")
    return types


def _arch_fields(arch: str, raw: dict[str, Any], n_layer: int, path: Path) -> dict[str, Any]:
    """ModelConfig fields that depend on the architecture: sliding window, rope per layer type,
    soft-caps, attention scale, activation."""
    from engine.kv.swa import SwaType

    fields: dict[str, Any] = {}
    if arch in ("llama", "qwen2", "mistral"):
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFileError(f"{path}: hidden_act {act!r} is not supported for {arch}; kvscope implements 'silu'")
    if arch == "mistral":
        window = raw.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
        if window:
            fields.update(n_swa=int(window), swa_type=int(SwaType.STANDARD), swa_layers=(True,) * n_layer)
        return fields
    if arch not in ("gemma2", "gemma3"):
        return fields
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ModelFileError(f"{path}: hidden activation {act!r} is not supported for {arch}; "
                             f"kvscope implements {', '.join(GEMMA_ACTIVATIONS)}")
    fields["hidden_act"] = GEMMA_ACTIVATIONS[act]
    fields["query_pre_attn_scalar"] = float(raw.get("query_pre_attn_scalar", 256))
    window = raw.get("sliding_window", 4096)  # transformers' Gemma2Config / Gemma3TextConfig default
    if window:
        types = _layer_types(raw, n_layer, 2 if arch == "gemma2" else 6, path)
        layers = tuple(t == SLIDING for t in types)
        if any(layers):
            fields.update(n_swa=int(window), swa_type=int(SwaType.STANDARD), swa_layers=layers)
    if arch == "gemma2":
        fields["attn_softcap"] = float(raw.get("attn_logit_softcapping", 50.0) or 0.0)
        fields["final_softcap"] = float(raw.get("final_logit_softcapping", 30.0) or 0.0)
        return fields
    if raw.get("use_bidirectional_attention"):
        raise ModelFileError(f"{path}: use_bidirectional_attention=true (an embedding model) is not supported; "
                             "kvscope runs causal language models")
    if raw.get("attn_logit_softcapping"):
        logger.warning("%s: ignoring attn_logit_softcapping: Gemma 3 does not soft-cap attention "
                       "(transformers and llama.cpp ignore it too)", path)
    fields["final_softcap"] = float(raw.get("final_logit_softcapping") or 0.0)
    fields.update(gemma3_rope_from_hf_config(raw, path))
    return fields


def config_from_hf(raw: dict[str, Any], special: SpecialTokens, *, path: Path, name: str) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json and the folder's special tokens."""
    arch = _model_type_of(raw, path)
    if raw.get("mlp_bias"):
        raise ModelFileError(f"{path}: mlp_bias=true is not supported by kvscope")
    if raw.get("use_sliding_window"):
        logger.warning("%s: use_sliding_window is set; kvscope runs qwen2 with full attention", path)
    try:
        n_embd = int(raw["hidden_size"])
        n_head = int(raw["num_attention_heads"])
        n_layer = int(raw["num_hidden_layers"])
        fields = _arch_fields(arch, raw, n_layer, path)
        if "rope_theta" in fields:  # gemma3: per layer type
            theta, scaling = fields.pop("rope_theta"), None
        else:
            theta, scaling = rope_from_hf_config(raw, path)
        gemma = arch in ("gemma2", "gemma3")
        return ModelConfig(
            arch=arch,
            n_vocab=int(raw["vocab_size"]),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=int(raw.get("num_key_value_heads") or n_head),
            head_dim=int(raw.get("head_dim") or n_embd // n_head),
            n_ff=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            n_ctx_train=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),  # Gemma configs default to tied
            attention_bias=True if arch == "qwen2" else bool(raw.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=special.bos_id,
            eos_token_ids=special.eos_ids,
            add_bos=special.add_bos,
            name=name,
            **fields,
        )
    except KeyError as exc:
        raise ModelFileError(f"{path}: config.json lacks the key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelFileError(f"{path}: config.json has a bad value: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# safetensors


def _refuse_pickle(folder: Path) -> None:
    pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in folder.glob(pattern))
    if pickles:
        raise ModelFileError(
            f"{folder}: only pickle checkpoints found ({', '.join(pickles)}); kvscope refuses pickle "
            "files because loading them can run arbitrary code. Convert them to safetensors, e.g. "
            "with transformers: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out)"
        )
    raise ModelFileError(f"{folder}: no *.safetensors weights found")


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards its index names, or every *.safetensors in it."""
    index_path = folder / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = read_json(index_path, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(f"{index_path}: has no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelFileError(f"{index_path}: names shard {f.name!r}, which is missing from {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        _refuse_pickle(folder)
    return files


def read_safetensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Float32 copies of every tensor in `files`, and each tensor's dtype in the file."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise ModelFileError(f"{f}: tensor {name!r} also appears in another shard")
                    t = handle.get_tensor(name)
                    types[name] = _DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch."))
                    tensors[name] = t.to(torch.float32)
        except ModelFileError:
            raise
        except Exception as exc:  # SafetensorError, OSError: bad header, truncated data
            raise ModelFileError(f"{f}: corrupt or truncated safetensors file: {exc}") from exc
    return tensors, types


def add_gemma_norm_shift(tensors: dict[str, torch.Tensor]) -> None:
    """HF Gemma norms hold w and multiply by 1 + w; store 1 + w, as llama.cpp's converter does
    (convert_hf_to_gguf adds 1 to every tensor whose name ends in "norm.weight")."""
    for name in list(tensors):
        if name.endswith("norm.weight"):
            tensors[name] = tensors[name] + 1.0


# ---------------------------------------------------------------------------------------------
# The folder


def _post_processor_adds_bos(backend: Any, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor puts BOS in front (Llama 3's TemplateProcessing does)."""
    if bos_id is None:
        return False
    return backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


def read_hf_folder(folder: str | Path) -> HFFolderContents:
    """Read a Hugging Face model folder.

    Args:
        folder: a folder with config.json, tokenizer.json and safetensors weights.

    Returns:
        HFFolderContents with float32 tensors under their file names.

    Raises:
        ModelFileError: a file is missing, invalid or holds only pickle weights.
        UnsupportedArchitectureError: model_type is not one of SUPPORTED_ARCHITECTURES.
    """
    from tokenizers import Tokenizer as Backend

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFileError(f"{folder}: no such model folder")
    raw = read_json(folder / "config.json", required=True)
    _model_type_of(raw, folder / "config.json")  # fail on the architecture before reading weights
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ModelFileError(f"{tokenizer_path}: missing; kvscope needs tokenizer.json (a 'fast' tokenizer)")
    try:
        backend = Backend.from_file(str(tokenizer_path))
    except Exception as exc:
        raise ModelFileError(f"{tokenizer_path}: cannot be read as a tokenizers file: {exc}") from exc
    tokenizer_config = read_json(folder / "tokenizer_config.json", required=False)
    generation_config = read_json(folder / "generation_config.json", required=False)
    special = special_tokens(
        raw,
        generation_config,
        tokenizer_config,
        backend.token_to_id,
        adds_bos=lambda bos_id: _post_processor_adds_bos(backend, bos_id),
    )
    config = config_from_hf(raw, special, path=folder / "config.json", name=folder.resolve().name)
    tensors, types = read_safetensors(safetensors_files(folder))
    if config.is_gemma:
        add_gemma_norm_shift(tensors)
    return HFFolderContents(
        config=config,
        tensors=tensors,
        tensor_types=types,
        tokenizer_path=tokenizer_path,
        tokenizer_config=tokenizer_config,
        metadata=raw,
    )
