"""The names articles about llama.cpp's KV cache use, resolved to the settings kvscope computes with:
`--kvsize` (the cache size in cells: llama.cpp's -c/--ctx-size), `--swa-window` (a sliding window
other than the model's, for experiments) and `LLAMA_OFFLOAD_LAYERS` (the default of -ngl); and the
checks of a context's settings that need no model (check_context_settings, check_swa_window).
One place for the Context, `kvscope estimate` and every command."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from engine.errors import ContextParamsError
from engine.kv.cells import MAX_SEQ
from engine.models.config import ModelConfig

LIBRARY_N_CTX = 512  # llama_context_default_params' n_ctx (the commands default to 0: n_ctx_train)
OFFLOAD_LAYERS_ENV = "LLAMA_OFFLOAD_LAYERS"
FLASH_ATTN_MODES = ("auto", "on", "off")


# ---- checks that need no model -----------------------------------------------------------------------
def check_context_settings(*, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, pad: int, type_k: str,
                           type_v: str, flash_attn: str, head_dims: Sequence[int] = ()) -> None:
    """Refuse context settings that no model could accept, with the fix in the message. Pure, so that
    the commands run it before loading a model (a typo is told at once, not after the load) and
    ContextParams.resolve runs the very same checks. head_dims: the K/V head size of every model
    layer, for the block-size check of quantized cache types (empty: not checked, as before a load)."""
    _check_sizes(n_ctx, n_batch, n_ubatch, pad)
    if n_seq_max > MAX_SEQ:
        raise ContextParamsError(f"n_seq_max = {n_seq_max} > {MAX_SEQ}: llama.cpp's contexts hold at most "
                                 f"{MAX_SEQ} sequences (LLAMA_MAX_SEQ); use {MAX_SEQ} or fewer")
    if flash_attn not in FLASH_ATTN_MODES:
        raise ContextParamsError(f"flash_attn must be one of {FLASH_ATTN_MODES}, got {flash_attn!r}")
    _check_cache_types(type_k, type_v, flash_attn, head_dims)


def _check_sizes(n_ctx: int, n_batch: int, n_ubatch: int, pad: int) -> None:
    if pad < 1:
        raise ContextParamsError(f"pad must be >= 1, got {pad}; llama.cpp always pads to 256, the default")
    if n_ctx < 0 or n_batch < 0 or n_ubatch < 0:
        raise ContextParamsError(f"sizes must not be negative (n_ctx={n_ctx}, n_batch={n_batch}, n_ubatch={n_ubatch}); "
                                 f"give 0 or more for n_ctx (0: the model's n_ctx_train) and 1 or more for the "
                                 f"batch sizes")
    # a context whose batch or ubatch holds no token can decode nothing
    if n_batch == 0:
        raise ContextParamsError("n_batch must be >= 1, got 0: no batch could be decoded; give the most tokens one "
                                 "decode may take (default 2048; it is capped at n_ctx)")
    if n_ubatch == 0:
        raise ContextParamsError("n_ubatch must be >= 1, got 0: no ubatch could be computed; give the most tokens "
                                 "computed at once (default 512; it is capped at n_batch)")


def _check_cache_types(type_k: str, type_v: str, flash_attn: str, head_dims: Sequence[int]) -> None:
    # torch: imported when a check runs, not when flags are parsed
    from engine.kv.types import cache_type

    ctype_k, ctype_v = cache_type(type_k), cache_type(type_v)
    # llama_init_from_model: quantized V needs flash attention (V is then not transposed)
    if ctype_v.is_quantized and flash_attn == "off":
        raise ContextParamsError(
            f"quantized V cache requires flash_attn to be enabled (type_v = {ctype_v.name}, "
            f"flash_attn = 'off'); use flash_attn='auto' or 'on', or an unquantized V cache (f16, bf16, f32)")
    if flash_attn == "off":
        return
    for kind, ctype in (("k", ctype_k), ("v", ctype_v)):
        bad = [d for d in head_dims if ctype.is_quantized and d % ctype.block_size]
        if bad:
            raise ContextParamsError(
                f"{kind.upper()} cache type {ctype.name} with block size {ctype.block_size} does not divide "
                f"n_embd_head_{kind}={bad[0]}; a quantized {kind.upper()} cache needs a head size that is a "
                f"multiple of {ctype.block_size}: use type_{kind}='f16' (or bf16, f32) with this model")


def check_swa_window(swa_window: int | None) -> None:
    """swa_window: None (the model's own window) or a window of at least one cell."""
    if swa_window is not None and swa_window < 1:
        raise ContextParamsError(f"swa_window must be >= 1, got {swa_window}; leave it out to keep the model's "
                                 f"own window")


# ---- aliases -------------------------------------------------------------------------------------------


def context_size(n_ctx: int | None, kvsize: int | None) -> int:
    """n_ctx, given as n_ctx or as its alias kvsize (total cells over all streams; 0: n_ctx_train)."""
    if kvsize is not None and n_ctx is not None and kvsize != n_ctx:
        raise ContextParamsError(f"n_ctx = {n_ctx} and kvsize = {kvsize} disagree: kvsize is another name for "
                                 f"n_ctx (llama.cpp's -c/--ctx-size); give one of them")
    if kvsize is not None:
        return kvsize
    return LIBRARY_N_CTX if n_ctx is None else n_ctx


def parse_gpu_layers(text: str, source: str) -> int:
    """-ngl's value: a number, or 'all' (every layer: -1)."""
    if text.strip().lower() == "all":
        return -1
    try:
        return int(text)
    except ValueError:
        raise ContextParamsError(f"{source} = {text!r}: expected a number of layers or 'all'") from None


def gpu_layers(n_gpu_layers: int | None) -> int:
    """n_gpu_layers as given, else the LLAMA_OFFLOAD_LAYERS environment variable, else 0."""
    if n_gpu_layers is not None:
        return n_gpu_layers
    text = os.environ.get(OFFLOAD_LAYERS_ENV, "").strip()
    return parse_gpu_layers(text, OFFLOAD_LAYERS_ENV) if text else 0


def with_swa_window(config: ModelConfig, swa_window: int | None) -> ModelConfig:
    """The config the caches are sized and masked with: the model's, or the same with another
    sliding window. The weights were trained with config.n_swa; another window changes which
    cells stay visible and can be reused, and the SWA cache's size."""
    check_swa_window(swa_window)
    if swa_window is None or swa_window == config.n_swa:
        return config
    if not config.has_swa:
        raise ContextParamsError(
            f"swa_window = {swa_window}: model {config.name or config.arch!r} has no sliding-window layers, so "
            f"there is no window to change (sliding-window models: gemma2, gemma3)")
    return dataclasses.replace(config, n_swa=swa_window)
