"""Which memory a context gets (llama.cpp's llama_model::create_memory): a plain cache, or the iSWA
pair when the model has sliding-window layers."""
from __future__ import annotations

from typing import Sequence

from engine import events as ev
from engine.kv.cache import KeyShifter, KVCache
from engine.kv.iswa import KVCacheISWA, swa_cache_size
from engine.kv.layout import CacheLayout
from engine.kv.memory import Memory
from engine.kv.swa import SwaType
from engine.kv.types import cache_type
from engine.models.config import ModelConfig
from engine.placement.devices import Device


def cache_layouts(cfg: ModelConfig, params) -> dict[str, CacheLayout]:
    """The layout of every cache the context will get, by cache name: {"kv"} or {"base", "swa"}.
    Sizes only; nothing is allocated, so memory can be checked before build_memory()."""

    def layout(layer_ids: tuple[int, ...], kv_size: int, n_swa: int = 0, swa_type: SwaType = SwaType.NONE):
        return CacheLayout(
            layer_ids=layer_ids, n_embd_k=cfg.n_embd_k_gqa, n_embd_v=cfg.n_embd_v_gqa, n_head_kv=cfg.n_head_kv,
            head_dim=cfg.head_dim, kv_size=kv_size, n_stream=params.n_stream, n_seq_max=params.n_seq_max,
            type_k=cache_type(params.type_k), type_v=cache_type(params.type_v), v_trans=params.v_trans,
            pad=params.pad, n_swa=n_swa, swa_type=swa_type)

    all_layers = tuple(range(cfg.n_layer))
    if not cfg.has_swa:
        return {"kv": layout(all_layers, params.n_ctx_seq)}
    swa_layers = tuple(il for il in all_layers if cfg.is_swa(il))
    base_layers = tuple(il for il in all_layers if not cfg.is_swa(il))
    size_swa = swa_cache_size(params.n_ctx_seq, cfg.n_swa, unified=params.kv_unified, n_seq_max=params.n_seq_max,
                              n_ubatch=params.n_ubatch, pad=params.pad, swa_full=params.swa_full)
    return {"base": layout(base_layers, params.n_ctx_seq),
            "swa": layout(swa_layers, size_swa, cfg.n_swa, SwaType(cfg.swa_type))}


def kv_bytes_by_device(layouts: dict[str, CacheLayout], kv_devices: Sequence[Device]) -> dict[Device, int]:
    """Bytes of K and V buffers each device will hold; kv_devices[il] is model layer il's KV device."""
    need: dict[Device, int] = {}
    for lo in layouts.values():
        for dev, nbytes in lo.buffer_bytes_by_device([kv_devices[il] for il in lo.layer_ids]).items():
            need[dev] = need.get(dev, 0) + nbytes
    return need


def kv_size_by_layer(layouts: dict[str, CacheLayout]) -> dict[int, int]:
    """Cells per stream of each model layer's cache."""
    return {il: lo.kv_size for lo in layouts.values() for il in lo.layer_ids}


def build_memory(cfg: ModelConfig, params, *, bus: ev.EventBus, key_shifter: KeyShifter,
                 kv_devices: Sequence[Device] | None = None, kv_cache_debug: int | None = None) -> Memory:
    """params: the context's resolved ContextParams. kv_devices[il]: where model layer il's K/V live
    (default: all on the CPU). kv_cache_debug: every cache's LLAMA_KV_CACHE_DEBUG level (None: each
    cache reads the environment variable, as llama.cpp does)."""
    layouts = cache_layouts(cfg, params)

    def cache(name: str) -> KVCache:
        lo = layouts[name]
        devices = None if kv_devices is None else [kv_devices[il] for il in lo.layer_ids]
        return KVCache(lo, bus=bus, key_shifter=key_shifter, name=name, layer_devices=devices,
                       debug_level=kv_cache_debug)

    if "kv" in layouts:
        return cache("kv")
    return KVCacheISWA(cache("base"), cache("swa"), unified=params.kv_unified, swa_full=params.swa_full)
