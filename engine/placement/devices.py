"""Devices and per-layer placement, as llama.cpp's model loader decides them (`llama_model_base::load_tensors`
in src/llama-model.cpp: the last -ngl layers, the output layer counting as one, split by -ts).

A Device is either real (the CPU, a CUDA GPU, an Apple MPS GPU) or *virtual*: a named pretend GPU whose
memory is host memory, accounted against a capacity the user gives ("VGPU0=2GiB"). Virtual devices let
the offload rules and the memory accounting be exercised on a machine without a GPU; they are labelled
"(virtual)" wherever they are shown so that nobody mistakes one for real hardware.

plan_placement() is a pure function: which device each model layer, the output layer and each layer's
KV cache belong to, plus the loader's log lines.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from engine.errors import DeviceSpecError

DEVICE_KINDS = ("cpu", "cuda", "mps", "virtual")
SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_VIRTUAL_SPEC = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*=\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")


class _Ledger:
    """Bytes reserved on a virtual device; shared by every context that uses the device."""

    def __init__(self) -> None:
        self.reserved = 0


@dataclass(frozen=True)
class Device:
    """One device. name is llama.cpp's ("CPU", "CUDA0", ...); capacity is total bytes (None: unknown)."""

    name: str
    kind: str
    torch_device: torch.device
    capacity: int | None = None
    _ledger: _Ledger | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise DeviceSpecError(f"device kind must be one of {DEVICE_KINDS}, got {self.kind!r}")
        if self.is_virtual and self._ledger is None:
            object.__setattr__(self, "_ledger", _Ledger())

    @property
    def is_virtual(self) -> bool:
        return self.kind == "virtual"

    @property
    def is_gpu(self) -> bool:
        """True for anything layers can be offloaded to (real GPUs and virtual ones)."""
        return self.kind != "cpu"

    def __str__(self) -> str:
        return f"{self.name} (virtual)" if self.is_virtual else self.name

    # ---- memory ------------------------------------------------------------------------------
    def free_bytes(self) -> int | None:
        """Free memory now: capacity minus what kvscope reserved for a virtual device, the driver's
        figure for CUDA, the kernel's MemAvailable for the CPU (host), None where unknown (MPS)."""
        if self.is_virtual:
            return self.capacity - self._ledger.reserved
        if self.kind == "cuda":
            return torch.cuda.mem_get_info(self.torch_device)[0]
        if self.kind == "cpu":
            return host_available_bytes()
        return None

    def total_bytes(self) -> int | None:
        """Memory size: a virtual device's capacity, a GPU's total memory, the host's MemTotal."""
        if self.kind == "cuda":
            return torch.cuda.mem_get_info(self.torch_device)[1]
        if self.kind == "cpu":
            return host_meminfo_bytes("MemTotal")
        return self.capacity

    def description(self) -> str:
        """What llama.cpp's breakdown prints in parentheses after the name."""
        if self.is_virtual:
            return "virtual, host memory"
        if self.kind == "cuda":
            name = torch.cuda.get_device_name(self.torch_device)
            for prefix in ("NVIDIA ", "GeForce ", "Tesla "):  # llama.cpp strips these vendor words
                name = name.removeprefix(prefix)
            return name
        return "Apple GPU" if self.kind == "mps" else "host"

    def reserved_bytes(self) -> int:
        """Bytes kvscope has reserved on a virtual device (0 for real ones, whose memory torch tracks)."""
        return self._ledger.reserved if self.is_virtual else 0

    def reserve(self, nbytes: int) -> None:
        """Account nbytes on a virtual device; the caller must have checked free_bytes() first."""
        if self.is_virtual:
            if nbytes > self.free_bytes():
                raise DeviceSpecError(f"{self}: {nbytes} bytes needed but only {self.free_bytes()} free")
            self._ledger.reserved += nbytes

    def release(self, nbytes: int) -> None:
        if self.is_virtual:
            self._ledger.reserved = max(0, self._ledger.reserved - nbytes)


CPU = Device("CPU", "cpu", torch.device("cpu"))


def host_meminfo_bytes(key: str) -> int | None:
    """A /proc/meminfo figure in bytes (Linux); None where the file or the key is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == key:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_available_bytes() -> int | None:
    """Host memory a new allocation can get without swapping (MemAvailable)."""
    return host_meminfo_bytes("MemAvailable")


# ---- discovery and virtual devices ------------------------------------------------------------
def discover_devices() -> list[Device]:
    """The real devices of this machine: the CPU first, then every CUDA GPU, then MPS."""
    devices = [CPU]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(i).total_memory
            devices.append(Device(f"CUDA{i}", "cuda", torch.device("cuda", i), total))
    if torch.backends.mps.is_available():
        # ggml's Metal backend names its device MTL0.
        devices.append(Device("MTL0", "mps", torch.device("mps")))
    return devices


def as_device(device: Device | torch.device | str) -> Device:
    """A Device for a torch device (or its name) given where a Device was expected: "cpu" is the CPU."""
    if isinstance(device, Device):
        return device
    td = torch.device(device)
    if td.type == "cpu":
        return CPU
    if td.type == "cuda":
        index = td.index if td.index is not None else 0
        return Device(f"CUDA{index}", "cuda", torch.device("cuda", index))
    if td.type == "mps":
        return Device("MTL0", "mps", td)
    raise DeviceSpecError(f"torch device {td} is not one kvscope supports; use cpu, cuda:N or mps")


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648. Units: B, KiB, MiB, GiB (binary; a fraction is rounded down to bytes)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2) not in SIZE_UNITS:
        raise DeviceSpecError(f"bad size {text!r}: write a number and one of {', '.join(SIZE_UNITS)}, e.g. '2GiB'")
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])


def virtual_device(spec: str, taken_names: Sequence[str] = ()) -> Device:
    """A virtual device from 'NAME=SIZE' (e.g. 'VGPU0=2GiB'); its memory is host memory."""
    m = _VIRTUAL_SPEC.match(spec)
    if not m:
        raise DeviceSpecError(f"bad virtual device spec {spec!r}: write NAME=SIZE, e.g. 'VGPU0=2GiB' "
                              f"(NAME starts with a letter; SIZE units {', '.join(SIZE_UNITS)})")
    name = m.group(1)
    if name.upper() in {t.upper() for t in taken_names}:
        raise DeviceSpecError(f"virtual device name {name!r} is already used by a device; pick another, e.g. 'VGPU0'")
    capacity = parse_size(m.group(2) + m.group(3))
    if capacity <= 0:
        raise DeviceSpecError(f"virtual device {name!r} needs a capacity above 0 bytes, got {spec!r}")
    return Device(name, "virtual", torch.device("cpu"), capacity)


def resolve_gpus(devices: Sequence[Device | str] | None) -> list[Device]:
    """The GPUs a context may offload to. None: every real GPU found. Otherwise each item is a Device,
    the name of a real device ("CUDA0"), or a virtual device spec ("VGPU0=2GiB")."""
    real = discover_devices()
    if devices is None:
        return [d for d in real if d.is_gpu]
    by_name = {d.name.upper(): d for d in real}
    gpus: list[Device] = []
    for item in devices:
        if isinstance(item, Device):
            dev = item
        elif "=" in item:
            dev = virtual_device(item, [d.name for d in real] + [g.name for g in gpus])
        elif item.upper() in by_name:
            dev = by_name[item.upper()]
        else:
            raise DeviceSpecError(f"unknown device {item!r}; available: {', '.join(d.name for d in real)}"
                                  f" (or a virtual device NAME=SIZE, e.g. 'VGPU0=2GiB')")
        if not dev.is_gpu:
            raise DeviceSpecError(f"{dev} cannot be an offload device: the CPU is always used; list only GPUs")
        if dev.name.upper() in {g.name.upper() for g in gpus}:
            raise DeviceSpecError(f"device {dev} is listed twice; list each device once")
        gpus.append(dev)
    return gpus


def no_gpu_warning_lines(n_gpu_layers: int, gpus: Sequence[Device], *, setting: str,
                         virtual_gpu: str) -> list[str]:
    """What llama.cpp's -ngl prints when there is no GPU to offload to (common/arg.cpp), and how to try the
    offload with a virtual GPU instead; empty when nothing is ignored. setting: the name of what is
    ignored; virtual_gpu: how the caller adds a virtual GPU (a flag, or a keyword argument)."""
    if n_gpu_layers == 0 or gpus:
        return []
    return [f"warning: no usable GPU found, {setting} will be ignored",
            "warning: one possible reason is that torch was installed without GPU support (a CPU-only build)",
            f"warning: to offload layers without a GPU, add a virtual one: {virtual_gpu}"]


# ---- placement -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where each part of the model lives. layer_devices[il] for il in 0..n_layer-1."""

    n_layer: int
    n_gpu_layers: int  # normalised: a negative request became n_layer + 1
    i_gpu_start: int
    input_device: Device
    layer_devices: tuple[Device, ...]
    output_device: Device
    kv_devices: tuple[Device, ...]
    gpus_present: bool

    def info_log_lines(self) -> list[str]:
        """llama.cpp's load_tensors info lines (printed only when GPU offload is supported)."""
        if not self.gpus_present:
            return []
        n_gpu = min(self.n_gpu_layers, self.n_layer)
        lines = []
        repeating = n_gpu
        if repeating > 0:
            # QUIRK kept from llama.cpp: one of the n_gpu layers is counted as the output layer, so a
            # full offload reports n_layer - 1 repeating layers.
            lines.append("load_tensors: offloading output layer to GPU")
            repeating -= 1
        lines.append(f"load_tensors: offloading {repeating} repeating layers to GPU")
        offloaded = min(self.n_gpu_layers, self.n_layer + 1)
        lines.append(f"load_tensors: offloaded {offloaded}/{self.n_layer + 1} layers to GPU")
        return lines

    def debug_log_lines(self, is_swa: Sequence[bool] = ()) -> list[str]:
        """One line per layer and the output layer (index n_layer, never SWA)."""
        swa = list(is_swa) or [False] * self.n_layer
        devices = list(self.layer_devices) + [self.output_device]
        return [f"load_tensors: layer {il:3d} assigned to device {dev}, is_swa = {int(il < self.n_layer and swa[il])}"
                for il, dev in enumerate(devices)]


def plan_placement(n_layer: int, n_gpu_layers: int, gpus: Sequence[Device], tensor_split: Sequence[float] | None = None,
                   offload_kqv: bool = True) -> Placement:
    """llama.cpp's layer placement: the last n_gpu_layers "layers" (the output layer counts as one)
    go to the GPUs, split between them by tensor_split (default: free memory; capacity for virtual ones)."""
    if n_layer < 1:
        raise DeviceSpecError(f"n_layer must be >= 1, got {n_layer}")
    if any(not d.is_gpu for d in gpus):
        raise DeviceSpecError(f"gpus must not include the CPU (got {[str(d) for d in gpus]}); it is always used")
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1) if gpus else 0
    check_tensor_split(gpus, tensor_split)
    # Only when something is offloaded: the default split asks CUDA for free memory, which starts it up.
    splits = _split_points(gpus, tensor_split) if act > 0 else np.zeros(0, np.float32)

    def device_of(il: int) -> Device:
        if il < i_gpu_start or il - i_gpu_start >= act:
            return CPU
        # std::upper_bound over float split points, in float32 as llama.cpp computes them.
        x = np.float32(il - i_gpu_start) / np.float32(act)
        return gpus[int(np.searchsorted(splits, x, side="right"))]

    layers = tuple(device_of(il) for il in range(n_layer))
    kv = layers if offload_kqv else (CPU,) * n_layer
    return Placement(n_layer, ngl, i_gpu_start, CPU, layers, device_of(n_layer), kv, bool(gpus))


def check_tensor_split(gpus: Sequence[Device], tensor_split: Sequence[float] | None) -> None:
    """One weight >= 0 per GPU; the commands check it before loading a model."""
    if tensor_split is not None and len(tensor_split) != len(gpus):
        raise DeviceSpecError(f"tensor_split has {len(tensor_split)} values for {len(gpus)} GPUs "
                              f"({', '.join(map(str, gpus))}); give one weight per GPU, e.g. 3,1")
    if tensor_split is not None and any(w < 0 for w in tensor_split):
        raise DeviceSpecError(f"tensor_split weights must be >= 0, got {list(tensor_split)}")


def _split_points(gpus: Sequence[Device], tensor_split: Sequence[float] | None) -> np.ndarray:
    """Cumulative normalised weights; all-zero or absent tensor_split means 'by free memory'."""
    if len(gpus) == 1:
        weights = [1.0]  # one GPU takes every offloaded layer, whatever its free memory
    elif tensor_split is None or all(w == 0 for w in tensor_split):
        weights = [_default_weight(d) for d in gpus]
    else:
        weights = list(tensor_split)
    cumulative = np.cumsum(np.asarray(weights, dtype=np.float32), dtype=np.float32)
    return cumulative / cumulative[-1]


def _default_weight(device: Device) -> float:
    # llama.cpp splits by each device's free memory; a virtual device's is its capacity.
    if device.is_virtual:
        return float(device.capacity)
    free = device.free_bytes()
    if free is None:
        raise DeviceSpecError(f"free memory of {device} is unknown; give tensor_split explicitly")
    return float(free)
