"""kvscope's inference engine: real weights, correct logits, and a KV cache that behaves like llama.cpp's.

    model = engine.load_model(path)
    ctx = engine.Context(model, n_ctx=512)
    rc = ctx.decode(engine.Batch(tokens=[...], pos=[...], seq_ids=[[0], ...], logits=[...]))

The names below are imported on first use (PEP 562), so that a watcher importing only the event records
and the mirrors (engine.events, engine.watch.mirror) never loads torch or the model code.
"""
from __future__ import annotations

import importlib

_HOME = {
    "events": "engine.events",
    "Batch": "engine.batch",
    "Context": "engine.context",
    "EventBus": "engine.events",
    "CacheMirror": "engine.watch.mirror",
    "Model": "engine.models.model",
    "load_model": "engine.models.model",
    "ArgumentTypeError": "engine.errors",
    "BatchTooLargeError": "engine.errors",
    "ContextParamsError": "engine.errors",
    "InvalidBatchError": "engine.errors",
    "KvscopeError": "engine.errors",
    "MemoryOperationError": "engine.errors",
    "ModelFileError": "engine.errors",
    "UnsupportedArchitectureError": "engine.errors",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home.endswith(f".{name}") else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
