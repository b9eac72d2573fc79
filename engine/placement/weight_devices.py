"""Which device holds each weight: the layer placement of -ngl, then `-ot REGEX=DEVICE` overrides
(llama.cpp's tensor_buft_overrides, applied in `llama_model_base::load_tensors`, src/llama-model.cpp).

Overrides are matched against llama.cpp's tensor names ("blk.3.ffn_down.weight", "output.weight"),
whatever file the model came from, with a regex *search*; the first pattern that matches decides.
They move weights only: each layer's K/V stay on the layer's device and the residual stream with
them, so an overridden weight costs an activation copy to its device and back.

Deviation from llama.cpp, said where it bites: kvscope keeps Q, K and V of a layer in one matrix,
and gate and up in another (one matmul each), so a pattern must send attn_q/attn_k/attn_v (and
their biases) together, and ffn_gate/ffn_up together; one that splits them is refused with the
pattern that would not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.errors import DeviceSpecError
from engine.models.config import ModelConfig
from engine.placement.devices import CPU, Device, Placement

# LayerWeights field -> the llama.cpp tensors it holds (a bias goes with its matrix)
LAYER_FIELD_TENSORS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("attn_norm.weight",),
    "wqkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "q_norm": ("attn_q_norm.weight",),
    "k_norm": ("attn_k_norm.weight",),
    "wo": ("attn_output.weight", "attn_output.bias"),
    "post_attn_norm": ("post_attention_norm.weight",),
    "ffn_norm": ("ffn_norm.weight",),
    "w_gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "w_down": ("ffn_down.weight",),
    "post_ffn_norm": ("post_ffw_norm.weight",),
}
BIAS_OF = {"bqkv": "wqkv", "bo": "wo"}  # LayerWeights bias fields and the matrix whose device they share
FIELD_OF_TENSOR = {t: field for field, tensors in LAYER_FIELD_TENSORS.items() for t in tensors}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorOverride:
    """One `-ot` item: weights whose llama.cpp name matches `pattern` (regex search) go to `device`."""

    pattern: str
    device: Device

    def matches(self, tensor_name: str) -> bool:
        return re.search(self.pattern, tensor_name) is not None

    def __str__(self) -> str:
        return f"{self.pattern}={self.device.name}"


def parse_tensor_overrides(specs: Sequence[str] | None, gpus: Sequence[Device]) -> tuple[TensorOverride, ...]:
    """`-ot` values, each "REGEX=DEVICE[,REGEX=DEVICE...]", in order. DEVICE is CPU or one of gpus."""
    available = {"CPU": CPU, **{g.name.upper(): g for g in gpus}}
    out: list[TensorOverride] = []
    for spec in specs or ():
        for item in spec.split(","):
            pattern, sep, target = item.rpartition("=")
            if not sep or not pattern:
                raise DeviceSpecError(f"bad tensor override {item!r}: write REGEX=DEVICE, e.g. 'ffn_.*=CPU'")
            try:
                re.compile(pattern)
            except re.error as e:
                raise DeviceSpecError(f"bad tensor override {item!r}: {pattern!r} is not a regex ({e})") from None
            device = available.get(target.strip().upper())
            if device is None:
                virtual = [d.name for d in available.values() if d.is_virtual]
                raise DeviceSpecError(
                    f"unknown buffer type {target.strip()!r} in tensor override {item!r}; available buffer types: "
                    f"{', '.join(d.name for d in available.values())}"
                    + (f" (virtual: {', '.join(virtual)})" if virtual else ""))
            out.append(TensorOverride(pattern, device))
    return tuple(out)


@dataclass(frozen=True)
class LayerDevices:
    """Devices of one layer: the residual stream and K/V (from -ngl/-nkvo) and each weight field."""

    residual: Device
    kv: Device
    fields: dict[str, Device]

    def __post_init__(self) -> None:
        # each field also as a plain attribute (devs.wqkv): the forward pass reads ~20 per layer and
        # token, and a __getattr__ fallback costs a failed lookup each time
        for name, device in self.fields.items():
            if name not in ("residual", "kv", "fields"):
                object.__setattr__(self, name, device)


@dataclass(frozen=True)
class WeightDevices:
    """Where every weight lives: the input embedding, each layer's weight fields, the output norm and
    the output matrix (a tied embedding's copy), plus the tensors an override moved, for the log."""

    tok_embd: Device
    layers: tuple[LayerDevices, ...]
    output_norm: Device
    output: Device
    overridden: tuple[tuple[str, Device], ...] = ()

    def device_of(self, tensor_name: str) -> Device:
        """The device of one llama.cpp-named weight ("blk.2.attn_q.weight", "output_norm.weight")."""
        if tensor_name == "token_embd.weight":
            return self.tok_embd
        if tensor_name == "output_norm.weight":
            return self.output_norm
        if tensor_name == "output.weight":
            return self.output
        m = _LAYER_TENSOR.match(tensor_name)
        if m is None or m.group(2) not in FIELD_OF_TENSOR or int(m.group(1)) >= len(self.layers):
            raise KeyError(f"{tensor_name!r} is not a weight kvscope places")
        return self.layers[int(m.group(1))].fields[FIELD_OF_TENSOR[m.group(2)]]

    def override_log_lines(self, tensor_sizes: dict[str, tuple[int, str]]) -> list[str]:
        """llama.cpp's debug lines for overridden tensors; tensor_sizes: name -> (bytes, type name)."""
        return [f"tensor {name} ({tensor_sizes[name][0] // 2**20} MiB {tensor_sizes[name][1]}) buffer type "
                f"overridden to {dev}" for name, dev in self.overridden]

    def devices(self) -> list[Device]:
        """Every device holding some weight, CPU first, then in order of first use."""
        seen: dict[str, Device] = {"CPU": CPU}
        for dev in [self.tok_embd, *(d for layer in self.layers for d in layer.fields.values()),
                    self.output_norm, self.output]:
            seen.setdefault(dev.name, dev)
        return list(seen.values())


def layer_fields(config: ModelConfig) -> tuple[str, ...]:
    """The weight fields a layer of this model has (LayerWeights names with a tensor)."""
    fields = ["attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down"]
    if config.has_qk_norm:
        fields += ["q_norm", "k_norm"]
    if config.is_gemma:
        fields += ["post_attn_norm", "post_ffn_norm"]
    return tuple(fields)


def field_tensor_names(config: ModelConfig, il: int, field: str) -> tuple[str, ...]:
    """llama.cpp names of the tensors one field of layer il holds, for this model (biases only if any)."""
    names = LAYER_FIELD_TENSORS[field]
    if not config.attention_bias or (field == "wo" and config.arch == "qwen2"):
        names = tuple(n for n in names if not n.endswith(".bias"))
    return tuple(f"blk.{il}.{n}" for n in names)


def output_tensor_name(config: ModelConfig) -> str:
    # llama.cpp creates a tied output as a duplicate of token_embd, under that name
    return "token_embd.weight" if config.tie_word_embeddings else "output.weight"


# Matrices the Transformer fuses into one (packed together when all are quantized), by llama.cpp suffix.
FUSED_MATRICES = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


def _ggml_type_label(type_name: str) -> str:
    """A GGUF storage type as llama.cpp prints it (ggml_type_name): q8_0, q4_0, q4_K, q6_K."""
    return type_name.lower().replace("_k", "_K")


def weight_tensor_sizes(config: ModelConfig, dtype, file_types: Mapping[str, str] | None = None
                        ) -> dict[str, tuple[int, str]]:
    """llama.cpp name -> (bytes, type name) of every weight as kvscope stores it: the compute dtype,
    except Gemma's norms, kept in float32. Sizes come from the config alone (no tensor is read).

    file_types: llama.cpp name -> GGUF storage type, for a model whose quantized matrices stay packed
    (engine/models/packed.py): those count their packed bytes (a fused Q|K|V or gate|up matrix is packed
    as one, its padding counted with its first tensor), a quantized embedding its blocks, and a tied
    quantized embedding adds the packed copy the output layer multiplies by ("output.weight")."""
    import torch

    from engine.formats.gguf_file import gguf_tensor_name
    from engine.formats.quantized_blocks import PACKED_TENSOR_TYPES
    from engine.models.load import expected_tensor_shapes
    from engine.models.packed import packed_weight_nbytes, row_bytes

    type_names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    shapes = {gguf_tensor_name(hf, config.arch): shape for hf, shape in expected_tensor_shapes(config).items()}
    packed = {name: t for name, t in (file_types or {}).items()
              if t in PACKED_TENSOR_TYPES and len(shapes.get(name, ())) == 2}
    out = {}
    for name, shape in shapes.items():
        f32 = config.is_gemma and name.endswith("norm.weight")
        t = torch.float32 if f32 else dtype
        n = 1
        for d in shape:
            n *= d
        out[name] = (n * t.itemsize, type_names[t])
    if not packed:
        return out

    def packed_alone(name: str) -> int:
        rows, cols = shapes[name]
        return packed_weight_nbytes([(packed[name], rows)], cols)

    fused_names = set()
    for il in range(config.n_layer):
        for group in FUSED_MATRICES:
            names = [f"blk.{il}.{suffix}" for suffix in group]
            fused_names.update(names)
            if not all(n in packed for n in names):
                continue  # decoded to the compute dtype, as sized above
            total = packed_weight_nbytes([(packed[n], shapes[n][0]) for n in names], shapes[names[0]][1])
            alone = {n: packed_alone(n) for n in names[1:]}
            out[names[0]] = (total - sum(alone.values()), _ggml_type_label(packed[names[0]]))
            out.update({n: (b, _ggml_type_label(packed[n])) for n, b in alone.items()})
    for name, type_name in packed.items():
        if name in fused_names:
            continue
        if name == "token_embd.weight":
            rows, cols = shapes[name]
            out[name] = (rows * row_bytes(type_name, cols), _ggml_type_label(type_name))
            if config.tie_word_embeddings:
                out["output.weight"] = (packed_alone(name), _ggml_type_label(type_name))
        else:
            out[name] = (packed_alone(name), _ggml_type_label(type_name))
    return out


def model_bytes_by_device(wd: WeightDevices, tensor_sizes: dict[str, tuple[int, str]],
                          tie_word_embeddings: bool) -> dict[Device, int]:
    """Weight bytes per device; a tied output layer on the input embedding's device shares that
    tensor, on another device it is a whole copy (llama.cpp duplicates it)."""
    out: dict[Device, int] = {}
    for name, (nbytes, _) in tensor_sizes.items():
        dev = wd.device_of(name)
        out[dev] = out.get(dev, 0) + nbytes
    # a tied output layer listed on its own is a separate (packed) copy, counted above wherever it is
    if tie_word_embeddings and wd.output.name != wd.tok_embd.name and "output.weight" not in tensor_sizes:
        out[wd.output] = out.get(wd.output, 0) + tensor_sizes["token_embd.weight"][0]
    return out


def model_buffer_log_lines(bytes_by_device: dict[Device, int]) -> list[str]:
    """llama.cpp's `load_tensors: <buffer> model buffer size = X MiB`, the CPU's first."""
    devices = sorted(bytes_by_device, key=lambda d: d.name != "CPU")
    return [f"load_tensors: {str(d):>12s} model buffer size = {bytes_by_device[d] / 2**20:8.2f} MiB"
            for d in devices if bytes_by_device[d]]


def all_on_cpu(config: ModelConfig) -> WeightDevices:
    """Every weight, K/V and activation on the CPU: a model no context has placed."""
    layer = LayerDevices(CPU, CPU, {f: CPU for f in layer_fields(config)})
    return WeightDevices(CPU, (layer,) * config.n_layer, CPU, CPU)


def plan_weight_devices(config: ModelConfig, placement: Placement,
                        overrides: Sequence[TensorOverride] = ()) -> WeightDevices:
    overridden: list[tuple[str, Device]] = []

    def device_of(names: Sequence[str], default: Device, what: str) -> Device:
        chosen = {}
        for name in names:
            hit = next((o for o in overrides if o.matches(name)), None)
            chosen[name] = (hit.device if hit else default, hit)
        devices = {d.name for d, _ in chosen.values()}
        if len(devices) > 1:
            parts = ", ".join(f"{n} -> {d}" for n, (d, _) in chosen.items())
            raise DeviceSpecError(
                f"tensor overrides split {what}: {parts}. kvscope stores these tensors as one matrix, so they "
                f"must go to the same device; widen the pattern (e.g. 'attn_[qkv]' or 'ffn_(gate|up)')")
        dev = next(iter(chosen.values()))[0]
        overridden.extend((n, d) for n, (d, hit) in chosen.items() if hit is not None)
        return dev

    layers = []
    for il, residual in enumerate(placement.layer_devices):
        fields = {f: device_of(field_tensor_names(config, il, f), residual, f"layer {il}'s {f}")
                  for f in layer_fields(config)}
        layers.append(LayerDevices(residual, placement.kv_devices[il], fields))
    tok_embd = device_of(["token_embd.weight"], placement.input_device, "the input embedding")
    output_norm = device_of(["output_norm.weight"], placement.output_device, "the output norm")
    output = device_of([output_tensor_name(config)], placement.output_device, "the output matrix")
    # the tied output's name is token_embd's: log it once, as llama.cpp has two tensors of that name
    return WeightDevices(tok_embd, tuple(layers), output_norm, output, tuple(dict.fromkeys(overridden)))
