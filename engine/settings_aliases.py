"""The names articles about llama.cpp's KV cache use, resolved to the settings kvscope computes with:
`--kvsize` (the cache size in cells: llama.cpp's -c/--ctx-size), `--swa-window` (a sliding window
other than the model's, for experiments) and `LLAMA_OFFLOAD_LAYERS` (the default of -ngl).
One place for the Context, `kvscope estimate` and every command."""
from __future__ import annotations

import dataclasses
import os

from engine.errors import ContextParamsError
from engine.models.config import ModelConfig

LIBRARY_N_CTX = 512  # llama_context_default_params' n_ctx (the commands default to 0: n_ctx_train)
OFFLOAD_LAYERS_ENV = "LLAMA_OFFLOAD_LAYERS"


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
    if swa_window is None or swa_window == config.n_swa:
        return config
    if not config.has_swa:
        raise ContextParamsError(
            f"swa_window = {swa_window}: model {config.name or config.arch!r} has no sliding-window layers, so "
            f"there is no window to change (sliding-window models: gemma2, gemma3)")
    if swa_window < 1:
        raise ContextParamsError(f"swa_window must be >= 1, got {swa_window}")
    return dataclasses.replace(config, n_swa=swa_window)
