"""The states llama_context saves around the KV cache's own (engine/kv/state.py; src/llama-context.cpp
llama_context::state_write_data / state_seq_write_data and the llama_state_* file functions).

In memory: a sequence state is u32 0xaf143cd8, i32 seq id, memory state; a whole-context state is the
model arch as a string (u32 length + bytes), memory state. Files: 'ggsq' u32 magic, u32 version 2,
u32 n_tokens, i32 tokens, memory state (no 0xaf143cd8 wrapper); 'ggsn', version 9
(LLAMA_SESSION_VERSION), u32 n_tokens, i32 tokens, whole-context state.

The arch string is llama.cpp's name for the model (llm_arch_name), which for a Mistral model is
"llama": convert_hf_to_gguf converts MistralForCausalLM as a llama, so a Hugging Face Mistral folder
and its GGUF write, and accept, the same states.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from engine.kv.cache import KVCache
from engine.kv.state import (
    STATE_SEQ_IO_MAGIC,
    Reader,
    StateFileError,
    Writer,
    read_memory_state,
    write_memory_state,
)

log = logging.getLogger("kvscope.kv")

# include/llama.h
LLAMA_SESSION_MAGIC = 0x6767736E  # 'ggsn'
LLAMA_SESSION_VERSION = 9
LLAMA_STATE_SEQ_MAGIC = 0x67677371  # 'ggsq'
LLAMA_STATE_SEQ_VERSION = 2

# kvscope arch -> llama.cpp's arch of the model's GGUF, where they differ
_LLAMA_CPP_ARCH = {"mistral": "llama"}


def llama_cpp_arch(arch: str) -> str:
    """The arch name llama.cpp writes in, and expects from, whole-context states of this model."""
    return _LLAMA_CPP_ARCH.get(arch, arch)


def seq_state_bytes(caches: Sequence[KVCache], seq_id: int) -> bytes:
    """llama_state_seq_get_data: u32 0xaf143cd8, i32 seq id, memory state of seq_id."""
    w = Writer()
    w.u32(STATE_SEQ_IO_MAGIC)
    w.i32(seq_id)
    return write_memory_state(caches, seq_id, w)


def restore_seq_state(caches: Sequence[KVCache], data: bytes, dest_seq_id: int) -> int:
    """llama_state_seq_set_data; returns the bytes read."""
    r = Reader(data, "sequence state")
    magic = r.u32()
    if magic != STATE_SEQ_IO_MAGIC:
        raise StateFileError(f"wrong sequence state magic: {magic:#010x}, expected {STATE_SEQ_IO_MAGIC:#010x} "
                             f"(not a state from state_seq_get_data?); the cache is unchanged")
    r.i32()  # the saved seq id: ignored
    read_memory_state(r, caches, dest_seq_id)
    return r.n_read


def context_state_bytes(arch: str, caches: Sequence[KVCache], w: Writer | None = None) -> bytes:
    """llama_state_get_data: llama.cpp's name of the model arch as a string, then the whole memory state."""
    w = w if w is not None else Writer()
    w.string(llama_cpp_arch(arch))
    return write_memory_state(caches, -1, w)


def read_context_state(r: Reader, arch: str, caches: Sequence[KVCache]) -> None:
    saved, expected = r.string(), llama_cpp_arch(arch)
    if saved != expected:
        raise StateFileError(f"wrong model arch: '{saved}' instead of '{expected}'; the cache is unchanged")
    read_memory_state(r, caches, -1)


def restore_context_state(arch: str, caches: Sequence[KVCache], data: bytes) -> int:
    """llama_state_set_data; returns the bytes read (trailing bytes are ignored, as llama.cpp does)."""
    r = Reader(data, "context state")
    read_context_state(r, arch, caches)
    return r.n_read


def _token_bytes(tokens: Iterable[int]) -> tuple[int, bytes]:
    arr = np.asarray(list(tokens), dtype=np.int64)
    if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
        raise StateFileError("tokens must fit in 32-bit llama_token values")
    return int(arr.size), arr.astype("<i4").tobytes()


def _header(magic: int, version: int, tokens: Iterable[int]) -> Writer:
    n, data = _token_bytes(tokens)
    w = Writer()
    w.u32(magic)
    w.u32(version)
    w.u32(n)
    w.raw(data)
    return w


def _read_header(r: Reader, magic: int, version: int, kind: str, n_token_capacity: int | None) -> list[int]:
    m, v = r.u32(), r.u32()
    if m != magic or v != version:
        log.error("unknown (magic, version) for %s file: %08x, %08x", kind, m, v)
        raise StateFileError(f"unknown (magic, version) for {kind} file: {m:08x}, {v:08x}; expected {magic:08x}, "
                             f"{version:08x}; the cache is unchanged")
    n = r.u32()
    if n_token_capacity is not None and n > n_token_capacity:
        raise StateFileError(f"token count in {kind} file exceeded capacity! {n} > {n_token_capacity}; the cache "
                             f"is unchanged")
    return np.frombuffer(r.take(4 * n), dtype="<i4").astype(np.int64).tolist()


def save_session_file(path: str | Path, arch: str, caches: Sequence[KVCache], tokens: Iterable[int]) -> int:
    """llama_state_save_file; returns the file size."""
    w = _header(LLAMA_SESSION_MAGIC, LLAMA_SESSION_VERSION, tokens)
    data = context_state_bytes(arch, caches, w)
    Path(path).write_bytes(data)
    return len(data)


def load_session_file(path: str | Path, arch: str, caches: Sequence[KVCache],
                      n_token_capacity: int | None = None) -> list[int]:
    """llama_state_load_file; returns the tokens. Like llama.cpp, data left after the state is an
    error reported after the state was restored."""
    r = Reader(Path(path).read_bytes(), "session file")
    tokens = _read_header(r, LLAMA_SESSION_MAGIC, LLAMA_SESSION_VERSION, "session", n_token_capacity)
    start = r.n_read
    read_context_state(r, arch, caches)
    if r.left:
        raise StateFileError(f"did not read all of the session file data! size {r.n_read - start + r.left}, got "
                             f"{r.n_read - start} (the state was restored; {r.left} trailing bytes)")
    return tokens


def save_seq_file(path: str | Path, caches: Sequence[KVCache], seq_id: int, tokens: Iterable[int]) -> int:
    """llama_state_seq_save_file; returns the file size."""
    w = _header(LLAMA_STATE_SEQ_MAGIC, LLAMA_STATE_SEQ_VERSION, tokens)
    data = write_memory_state(caches, seq_id, w)
    Path(path).write_bytes(data)
    return len(data)


def load_seq_file(path: str | Path, caches: Sequence[KVCache], dest_seq_id: int,
                  n_token_capacity: int | None = None) -> list[int]:
    """llama_state_seq_load_file; returns the tokens (trailing bytes are not checked, as llama.cpp)."""
    r = Reader(Path(path).read_bytes(), "sequence state file")
    tokens = _read_header(r, LLAMA_STATE_SEQ_MAGIC, LLAMA_STATE_SEQ_VERSION, "sequence state", n_token_capacity)
    read_memory_state(r, caches, dest_seq_id)
    return tokens
