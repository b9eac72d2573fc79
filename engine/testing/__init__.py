"""Helpers for tests, benchmarks and demos: tiny models written from scratch (no downloads)."""
from engine.testing.tiny_models import (
    TINY_CORPUS,
    TINY_TEST_SHAPE,
    WRITABLE_ARCHITECTURES,
    train_tiny_tokenizer,
    write_gguf_from_hf,
    write_hf_model,
    write_tiny_llama_demo,
)

__all__ = [
    "TINY_CORPUS",
    "TINY_TEST_SHAPE",
    "WRITABLE_ARCHITECTURES",
    "train_tiny_tokenizer",
    "write_gguf_from_hf",
    "write_hf_model",
    "write_tiny_llama_demo",
]
