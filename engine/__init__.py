"""kvscope's inference engine: real weights, correct logits, and a KV cache that behaves like llama.cpp's.

    model = engine.load_model(path)
    ctx = engine.Context(model, n_ctx=512)
    rc = ctx.decode(engine.Batch(tokens=[...], pos=[...], seq_ids=[[0], ...], logits=[...]))
"""
from engine import events
from engine.batch import Batch
from engine.context import Context
from engine.errors import (
                           BatchTooLargeError,
                           ContextParamsError,
                           InvalidBatchError,
                           KvscopeError,
                           MemoryOperationError,
                           ModelFileError,
                           UnsupportedArchitectureError,
)
from engine.events import EventBus
from engine.mirror import CacheMirror
from engine.models.model import Model, load_model

__all__ = [
    "Batch", "BatchTooLargeError", "events", "CacheMirror", "Context", "ContextParamsError", "EventBus",
    "InvalidBatchError", "KvscopeError", "MemoryOperationError", "Model", "ModelFileError",
    "UnsupportedArchitectureError", "load_model",
]
