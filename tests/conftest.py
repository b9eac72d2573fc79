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


# Sliding-window architectures (tests/test_architectures.py). Windows are small (8) so that short
# sequences slide; gemma3 has 6 layers so that llama.cpp's pattern (il % 6 < 5 slides) has a
# full-attention layer, and a global RoPE base (1e6) unlike the sliding layers' 10000.
SWA_WINDOW = 8


@pytest.fixture(scope="session")
def tiny_gemma3_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Gemma3ForCausalLM (Gemma3TextConfig) folder: 6 layers, window 8, tied, seed 2."""
    from engine.testing import write_hf_model

    shape = {**TINY_TEST_SHAPE, "n_layer": 6}
    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-gemma3", "gemma3", seed=2, rope_theta=1e6,
                          sliding_window=SWA_WINDOW, **shape)


@pytest.fixture(scope="session")
def tiny_gemma2_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Gemma2ForCausalLM folder: 2 layers (layer 0 slides), window 8, soft-caps small
    enough to matter (attention 5, final 10), tied, seed 3."""
    from engine.testing import write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-gemma2", "gemma2", seed=3, sliding_window=SWA_WINDOW,
                          attn_softcap=5.0, final_softcap=10.0, **TINY_TEST_SHAPE)


@pytest.fixture(scope="session")
def tiny_mistral_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight MistralForCausalLM folder: every layer slides with window 8, untied, seed 4."""
    from engine.testing import write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("hf") / "tiny-mistral", "mistral", seed=4,
                          sliding_window=SWA_WINDOW, **TINY_TEST_SHAPE)
