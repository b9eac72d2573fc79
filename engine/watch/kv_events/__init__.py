"""vLLM's and SGLang's prefix caches, watched from the KV events their workers publish over ZeroMQ.

    formats.py     the wire layouts: decode_batch / encode_batch (msgpack only)
    subscriber.py  KvEventSubscriber: one SUB socket per publisher, gaps replayed, events on a bus
    vocabulary.py  load_vocabulary: token texts from a tokenizer.json, a Hugging Face folder or a GGUF

The names below load on first use (PEP 562), so that reading formats.py costs no ZeroMQ and no tokenizers.
Torch-free.
"""
from __future__ import annotations

import importlib

_HOME = {
    "Endpoint": "engine.watch.kv_events.subscriber",
    "KvEventSubscriber": "engine.watch.kv_events.subscriber",
    "parse_endpoint": "engine.watch.kv_events.subscriber",
    "load_vocabulary": "engine.watch.kv_events.vocabulary",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'engine.watch.kv_events' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
