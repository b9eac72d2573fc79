"""Shared fixtures. Model fixtures are session-scoped: each tiny model is written once per run."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.testing.tiny_models import TINY_TEST_SHAPE


@pytest.fixture(scope="session")
def tiny_llama_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight LlamaForCausalLM folder (safetensors, tokenizer.json), seed 0, untied."""
    from engine.testing import write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-llama", "llama", seed=0, **TINY_TEST_SHAPE)


@pytest.fixture(scope="session")
def tiny_qwen2_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen2ForCausalLM folder (q/k/v biases, tied embeddings), seed 1."""
    from engine.testing import write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-qwen2", "qwen2", seed=1, tie=True, **TINY_TEST_SHAPE)


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The F32 GGUF twin of `tiny_llama_hf`, converted as llama.cpp does (Q/K permuted)."""
    from engine.testing import write_gguf_from_hf

    return write_gguf_from_hf(tiny_llama_hf, tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", tensor_type="F32")
