"""Which memory a context gets (llama.cpp's llama_model::create_memory): a plain cache, or the iSWA
pair when the model has sliding-window layers."""
from __future__ import annotations

from engine import events as ev
from engine.kv.cache import KeyShifter, KVCache
from engine.kv.iswa import KVCacheISWA, swa_cache_size
from engine.kv.layout import CacheLayout
from engine.kv.memory import Memory
from engine.kv.swa import SwaType
from engine.kv.types import cache_type
from engine.models.config import ModelConfig


def build_memory(cfg: ModelConfig, params, *, bus: ev.EventBus, key_shifter: KeyShifter) -> Memory:
    """params: the context's resolved ContextParams."""

    def layout(layer_ids: tuple[int, ...], kv_size: int, n_swa: int = 0, swa_type: SwaType = SwaType.NONE):
        return CacheLayout(
            layer_ids=layer_ids, n_embd_k=cfg.n_embd_k_gqa, n_embd_v=cfg.n_embd_v_gqa, n_head_kv=cfg.n_head_kv,
            head_dim=cfg.head_dim, kv_size=kv_size, n_stream=params.n_stream, n_seq_max=params.n_seq_max,
            type_k=cache_type(params.type_k), type_v=cache_type(params.type_v), v_trans=params.v_trans,
            pad=params.pad, n_swa=n_swa, swa_type=swa_type)

    all_layers = tuple(range(cfg.n_layer))
    if not cfg.has_swa:
        return KVCache(layout(all_layers, params.n_ctx_seq), bus=bus, key_shifter=key_shifter)
    swa_layers = tuple(il for il in all_layers if cfg.is_swa(il))
    base_layers = tuple(il for il in all_layers if not cfg.is_swa(il))
    size_swa = swa_cache_size(params.n_ctx_seq, cfg.n_swa, unified=params.kv_unified, n_seq_max=params.n_seq_max,
                              n_ubatch=params.n_ubatch, pad=params.pad, swa_full=params.swa_full)
    base = KVCache(layout(base_layers, params.n_ctx_seq), bus=bus, key_shifter=key_shifter, name="base")
    swa = KVCache(layout(swa_layers, size_swa, cfg.n_swa, SwaType(cfg.swa_type)), bus=bus,
                  key_shifter=key_shifter, name="swa")
    return KVCacheISWA(base, swa, unified=params.kv_unified, swa_full=params.swa_full)
