"""Sizes of one KV cache and llama.cpp's init log lines, computed from the layout alone (no tensors)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv.swa import SwaType
from engine.kv.types import CacheType

CPU_BUFFER_ALIGNMENT = 32


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

    def buffer_bytes(self) -> int:
        """The CPU KV buffer: every tensor rounded up to the backend alignment."""
        per_layer = _aligned(self.k_bytes_per_layer()) + _aligned(self.v_bytes_per_layer())
        return per_layer * len(self.layer_ids)

    def init_log_lines(self) -> list[str]:
        """llama.cpp's llama_kv_cache info lines, byte for byte."""
        mib = 1024.0 * 1024.0
        k, v = self.k_bytes(), self.v_bytes()
        return [
            f"llama_kv_cache: {'CPU':>10s} KV buffer size = {self.buffer_bytes() / mib:8.2f} MiB",
            (f"llama_kv_cache: size = {(k + v) / mib:7.2f} MiB ({self.kv_size:6d} cells, "
             f"{len(self.layer_ids):3d} layers, {self.n_seq_max:2d}/{self.n_stream} seqs), "
             f"K ({self.type_k.name}): {k / mib:7.2f} MiB, V ({self.type_v.name}): {v / mib:7.2f} MiB"),
        ]


def _aligned(n: int, alignment: int = CPU_BUFFER_ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment
