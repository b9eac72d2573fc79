"""Sizes of one KV cache and llama.cpp's init log lines, computed from the layout alone (no tensors)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.kv.swa import SwaType
from engine.kv.types import CacheType
from engine.placement.devices import CPU, Device

CPU_BUFFER_ALIGNMENT = 32
CUDA_BUFFER_ALIGNMENT = 128
CUDA_ROW_PADDING = 512  # values


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of one cache; all counts as llama.cpp's."""

    layer_ids: tuple[int, ...]  # model layers stored in this cache
    n_embd_k: int  # K row width of a layer
    n_embd_v: int  # V row width (n_embd_v_gqa_max when V is transposed)
    n_head_kv: int
    head_dim: int
    kv_size: int  # cells per stream
    n_stream: int
    n_seq_max: int
    type_k: CacheType
    type_v: CacheType
    v_trans: bool
    pad: int = 256
    n_swa: int = 0
    swa_type: SwaType = SwaType.NONE

    def k_bytes_per_layer(self) -> int:
        return self.kv_size * self.n_stream * self.type_k.row_bytes(self.n_embd_k)

    def v_bytes_per_layer(self) -> int:
        return self.kv_size * self.n_stream * self.type_v.row_bytes(self.n_embd_v)

    def k_bytes(self) -> int:
        return self.k_bytes_per_layer() * len(self.layer_ids)

    def v_bytes(self) -> int:
        return self.v_bytes_per_layer() * len(self.layer_ids)

    def layer_buffer_bytes(self, device: Device = CPU) -> int:
        """One layer's K and V tensors as a buffer of `device` allocates them (virtual devices: host rules)."""
        return (self._tensor_bytes(self.type_k, self.n_embd_k, device)
                + self._tensor_bytes(self.type_v, self.n_embd_v, device))

    def _tensor_bytes(self, ctype: CacheType, width: int, device: Device) -> int:
        nbytes = self.kv_size * self.n_stream * ctype.row_bytes(width)
        if device.kind != "cuda":
            return _aligned(nbytes, CPU_BUFFER_ALIGNMENT)
        # ggml-cuda pads a quantized tensor's rows to a multiple of 512 values, once per tensor.
        if ctype.is_quantized and width % CUDA_ROW_PADDING:
            nbytes += ctype.row_bytes(CUDA_ROW_PADDING - width % CUDA_ROW_PADDING)
        return _aligned(nbytes, CUDA_BUFFER_ALIGNMENT)

    def buffer_bytes_by_device(self, layer_devices: Sequence[Device] | None = None) -> dict[Device, int]:
        """One KV buffer per device holding any of this cache's layers (default: all on the CPU)."""
        devices = layer_devices if layer_devices is not None else [CPU] * len(self.layer_ids)
        out: dict[Device, int] = {}
        for dev in devices:
            out[dev] = out.get(dev, 0) + self.layer_buffer_bytes(dev)
        return out

    def init_log_lines(self, layer_devices: Sequence[Device] | None = None) -> list[str]:
        """llama.cpp's llama_kv_cache info lines, byte for byte: a buffer line per device, sorted by name."""
        mib = 1024.0 * 1024.0
        k, v = self.k_bytes(), self.v_bytes()
        buffers = sorted(self.buffer_bytes_by_device(layer_devices).items(), key=lambda item: str(item[0]))
        buffer_lines = [f"llama_kv_cache: {str(dev):>10s} KV buffer size = {nbytes / mib:8.2f} MiB"
                        for dev, nbytes in buffers]
        return buffer_lines + [
            (f"llama_kv_cache: size = {(k + v) / mib:7.2f} MiB ({self.kv_size:6d} cells, "
             f"{len(self.layer_ids):3d} layers, {self.n_seq_max:2d}/{self.n_stream} seqs), "
             f"K ({self.type_k.name}): {k / mib:7.2f} MiB, V ({self.type_v.name}): {v / mib:7.2f} MiB"),
        ]


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
