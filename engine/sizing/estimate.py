"""Memory estimate without loading a model (`kvscope estimate`).

Reads only headers (GGUF metadata and tensor infos, or config.json), then sizes the weights as the
Transformer stores them in the compute dtype and the KV cache with the same functions the Context
uses (ContextParams.resolve, plan_placement, cache_layouts, kv_bytes_by_device), so the numbers are
the bytes a real Context would allocate or reserve per device.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.context import ContextParams
from engine.kv.factory import cache_layouts, kv_bytes_by_device, kv_size_by_layer
from engine.models.config import ModelConfig
from engine.models.model import compute_dtype, resolve_model_path
from engine.placement.devices import (
    CPU,
    Device,
    Placement,
    no_gpu_warning_lines,
    plan_placement,
    resolve_gpus,
)
from engine.placement.weight_devices import (
    WeightDevices,
    model_bytes_by_device,
    parse_tensor_overrides,
    plan_weight_devices,
    weight_tensor_sizes,
)
from engine.sizing.compute_memory import compute_bytes_by_device
from engine.sizing.settings_aliases import context_size, gpu_layers, with_swa_window

log = logging.getLogger("kvscope.estimate")


@dataclass(frozen=True)
class DeviceEstimate:
    """Bytes one device would hold. capacity/free: None where unknown (MPS; the CPU row has the host's
    MemTotal/MemAvailable); free is before this context (a virtual device's ledger may already hold
    other contexts' reservations)."""

    device: str
    virtual: bool
    model_bytes: int
    kv_bytes: int
    compute_bytes: int
    capacity: int | None
    free: int | None

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.kv_bytes + self.compute_bytes

    @property
    def fits(self) -> bool:
        return self.fits_keeping(0)

    def fits_keeping(self, margin: int) -> bool:
        """Fits with margin bytes left free (where the free memory is known)."""
        return self.free is None or self.total_bytes + margin <= self.free

    @property
    def label(self) -> str:
        return f"{self.device} (virtual)" if self.virtual else self.device


@dataclass(frozen=True)
class Estimate:
    model_name: str
    config: ModelConfig
    params: ContextParams
    placement: Placement
    dtype: str
    devices: tuple[DeviceEstimate, ...]

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def to_dict(self) -> dict:
        p = self.params
        return {
            "model": self.model_name, "arch": self.config.arch, "n_layer": self.config.n_layer, "dtype": self.dtype,
            "n_ctx": p.n_ctx, "n_ctx_seq": p.n_ctx_seq, "n_seq_max": p.n_seq_max, "n_stream": p.n_stream,
            "type_k": p.type_k, "type_v": p.type_v, "flash_attn": p.flash_attn,
            "n_gpu_layers": self.placement.n_gpu_layers, "fits": self.fits,
            "layer_devices": [d.name for d in self.placement.layer_devices],
            "output_device": self.placement.output_device.name,
            "devices": [{**asdict(d), "total_bytes": d.total_bytes, "fits": d.fits} for d in self.devices],
        }


# ---- header readers ----------------------------------------------------------------------------
def config_from_headers(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file or HF folder, from its header / config.json only."""
    return read_headers(path)[0]


def read_headers(path: str | Path) -> tuple[ModelConfig, dict[str, str] | None]:
    """The ModelConfig of a GGUF file or HF folder, and a GGUF's storage type of each tensor (llama.cpp
    name -> type; None for a Hugging Face folder, whose weights are never packed), from the header or
    config.json only: the header is read once."""
    from engine.models.load import locate_model

    path, file_format = locate_model(resolve_model_path(path))
    return (_hf_config(path), None) if file_format == "hf" else _gguf_header(path)


def _gguf_header(path: Path) -> tuple[ModelConfig, dict[str, str]]:
    from engine.formats.gguf_file import (
        check_tensor_infos,
        config_from_reader,
        metadata_from_reader,
        open_gguf,
    )

    reader = open_gguf(path)  # memory-maps the file; tensor data is never decoded here
    # rope_freqs (llama3) changes RoPE angles, not sizes: left out so that no tensor data is read
    config = config_from_reader(reader, metadata_from_reader(reader, path), path)
    check_tensor_infos(reader, config, path)  # a file that cannot load gets no estimate, told in its names
    return config, {t.name: t.tensor_type.name for t in reader.tensors}


def _hf_config(folder: Path) -> ModelConfig:
    from engine.formats.hf_folder import SpecialTokens, config_from_hf, read_json

    raw = read_json(folder / "config.json", required=True)
    # special tokens do not change sizes; the tokenizer is not opened
    return config_from_hf(raw, SpecialTokens(None, (), False), path=folder / "config.json",
                          name=folder.resolve().name)


# ---- weight sizes, as engine.models.transformer.Transformer stores them -------------------------
def model_bytes(config: ModelConfig, wd: WeightDevices, dtype: str = "f32",
                file_types: dict[str, str] | None = None) -> dict[Device, int]:
    """Weight bytes per device under wd, from the config's tensor shapes in the compute dtype, and the
    packed sizes of quantized matrices when file_types (llama.cpp name -> GGUF type) is given."""
    return model_bytes_by_device(wd, weight_tensor_sizes(config, compute_dtype(dtype), file_types),
                                 config.tie_word_embeddings)


# ---- the estimate ----------------------------------------------------------------------------------
def estimate(path: str | Path = "demo", *, dtype: str = "f32", keep_quantized: bool = True, **settings) -> Estimate:
    """Bytes per device for the model at path with engine.Context's settings (same names and
    defaults: n_ctx, n_batch, n_ubatch, n_seq_max, kv_unified, pad, type_k, type_v, flash_attn,
    swa_full, devices, n_gpu_layers, tensor_split, offload_kqv, tensor_overrides, kvsize, swa_window),
    without reading tensor data. keep_quantized: as engine.load_model's (a GGUF's quantized matrices
    count their packed bytes)."""
    cfg, file_types, name, gpus = _read_target(path, dtype, settings, keep_quantized)
    n_gpu_layers = gpu_layers(settings.get("n_gpu_layers"))
    for line in no_gpu_warning_lines(n_gpu_layers, gpus, setting=f"n_gpu_layers = {n_gpu_layers}",
                                     virtual_gpu='devices=["VGPU0=2GiB"]'):
        log.warning("%s", line)
    return _estimate(cfg, name, gpus, dtype, file_types=file_types, **settings)


def _read_target(path: str | Path, dtype: str, settings: dict, keep_quantized: bool
                 ) -> tuple[ModelConfig, dict[str, str] | None, str, list[Device]]:
    """Config, the tensors' storage types when quantized ones stay packed (else None) and name from the
    headers, and the GPUs of settings["devices"] (taken out of settings)."""
    compute_dtype(dtype)
    cfg, file_types = read_headers(path)
    name = cfg.name or Path(resolve_model_path(path)).name
    return cfg, file_types if keep_quantized else None, name, resolve_gpus(settings.pop("devices", None))


def _estimate(cfg: ModelConfig, name: str, gpus: Sequence[Device], dtype: str, *, n_ctx: int | None = None,
              n_batch: int = 2048, n_ubatch: int = 512, n_seq_max: int = 1, kv_unified: bool = False, pad: int = 256,
              type_k: str = "f16", type_v: str = "f16", flash_attn: str = "auto", swa_full: bool = False,
              n_gpu_layers: int | None = None, tensor_split: Sequence[float] | None = None,
              offload_kqv: bool = True, tensor_overrides: Sequence[str] | None = None, kvsize: int | None = None,
              swa_window: int | None = None, file_types: dict[str, str] | None = None) -> Estimate:
    n_ctx, n_gpu_layers = context_size(n_ctx, kvsize), gpu_layers(n_gpu_layers)
    cfg = with_swa_window(cfg, swa_window)
    params = ContextParams.resolve(
        n_ctx_train=cfg.n_ctx_train, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
        kv_unified=kv_unified, pad=pad, type_k=type_k, type_v=type_v, flash_attn=flash_attn, swa_full=swa_full,
        head_dims=(cfg.head_dim,) * cfg.n_layer)
    placement = plan_placement(cfg.n_layer, n_gpu_layers, gpus, tensor_split, offload_kqv)
    wd = plan_weight_devices(cfg, placement, parse_tensor_overrides(tensor_overrides, gpus))
    layouts = cache_layouts(cfg, params)
    kv = kv_bytes_by_device(layouts, placement.kv_devices)
    weights = model_bytes(cfg, wd, dtype, file_types)
    compute = compute_bytes_by_device(cfg, wd, params.n_ubatch, params.n_stream, kv_size_by_layer(layouts),
                                      compute_dtype(dtype))
    rows = tuple(DeviceEstimate(dev.name, dev.is_virtual, weights.get(dev, 0), kv.get(dev, 0), compute.get(dev, 0),
                                dev.total_bytes(), dev.free_bytes())
                 for dev in [CPU, *gpus])
    return Estimate(name, cfg, params, placement, dtype, rows)


def fit(path: str | Path = "demo", *, dtype: str = "f32", fit_target: int = 0, fit_ctx_min: int = 0,
        keep_quantized: bool = True, **settings) -> Estimate:
    """The estimate with the largest n_gpu_layers that fits the devices at n_ctx = fit_ctx_min (when
    given; else the requested n_ctx), then the largest n_ctx (a multiple of pad, at least
    fit_ctx_min, at most n_ctx_train or the request if larger) that fits with those layers: what
    llama.cpp's --fit, -fitc and -fitt decide. fit_target: bytes to leave free on every GPU (llama.cpp's
    default is 1 GiB; kvscope's is 0, as virtual devices are small). The requested n_gpu_layers is
    ignored. Raises when even the smallest context does not fit."""
    from engine.errors import ContextParamsError

    if fit_target < 0 or fit_ctx_min < 0:
        raise ContextParamsError(f"fit_target and fit_ctx_min must be >= 0, got {fit_target} and {fit_ctx_min}")
    cfg, settings["file_types"], name, gpus = _read_target(path, dtype, settings, keep_quantized)
    settings.pop("n_gpu_layers", None)
    settings["n_ctx"] = context_size(settings.pop("n_ctx", None), settings.pop("kvsize", None))
    pad = settings.get("pad", 256)

    def run(**overrides) -> Estimate:
        return _estimate(cfg, name, gpus, dtype, **{**settings, **overrides})

    def fits(est: Estimate) -> bool:  # the margin is for GPUs (llama.cpp's -fitt), not the host
        return all(d.fits_keeping(fit_target if d.device != "CPU" else 0) for d in est.devices)

    layers_at = {"n_ctx": fit_ctx_min} if fit_ctx_min else {}
    # fitting is not monotone in the layer count under a split by free memory, so try each, largest first
    ngl = next((n for n in range(cfg.n_layer + 1, 0, -1) if gpus and fits(run(n_gpu_layers=n, **layers_at))), 0)
    k_min = max(1, -(-fit_ctx_min // pad))
    steps = max(settings.get("n_ctx", 0) or cfg.n_ctx_train, cfg.n_ctx_train, k_min * pad) // pad
    if not fits(run(n_gpu_layers=ngl, n_ctx=k_min * pad)):
        raise ContextParamsError(
            f"nothing fits: even n_ctx = {k_min * pad} with n_gpu_layers = {ngl} exceeds a device"
            + (f" (keeping {fit_target} bytes free on each GPU)" if fit_target else "")
            + "; use a quantized cache type, fewer sequences, a smaller fit_ctx_min or larger devices")
    lo, hi = k_min, steps  # the largest k in [k_min, hi] with n_ctx = k * pad fitting (KV grows with n_ctx)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(run(n_gpu_layers=ngl, n_ctx=mid * pad)):
            lo = mid
        else:
            hi = mid - 1
    return run(n_gpu_layers=ngl, n_ctx=lo * pad)


def format_table(est: Estimate) -> str:
    """A per-device table in MiB, as `kvscope estimate` prints it."""
    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.2f}"

    p = est.params
    title = (f"model {est.model_name} ({est.config.arch}, {est.config.n_layer} layers, compute {est.dtype}); "
             f"n_ctx = {p.n_ctx}, n_seq_max = {p.n_seq_max}, n_stream = {p.n_stream}, "
             f"K {p.type_k}, V {p.type_v}, -ngl {est.placement.n_gpu_layers}")
    header = (f"{'device':<20} {'model MiB':>11} {'context MiB':>12} {'compute MiB':>12} {'total MiB':>11} "
              f"{'capacity MiB':>13} {'free MiB':>11}")
    lines = [title, header]
    for d in est.devices:
        flag = "" if d.fits else "  DOES NOT FIT"
        lines.append(f"{d.label:<20} {mib(d.model_bytes):>11} {mib(d.kv_bytes):>12} {mib(d.compute_bytes):>12} "
                     f"{mib(d.total_bytes):>11} {mib(d.capacity):>13} {mib(d.free):>11}{flag}")
    return "\n".join(lines)
