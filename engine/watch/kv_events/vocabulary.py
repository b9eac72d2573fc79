"""The text of every token id of a model, for views of a vLLM or SGLang worker's blocks (`kvscope attach --vllm
... --tokenizer PATH`): their events carry token ids only.

    vocabulary = load_vocabulary("Qwen2.5-7B-Instruct/")        # a Hugging Face folder: its tokenizer.json
    vocabulary = load_vocabulary("tokenizer.json")
    vocabulary = load_vocabulary("qwen2.5-7b-instruct-q4_k_m.gguf")  # its tokenizer.ggml.* metadata

Local files only: nothing is ever downloaded. A GGUF's header is read with the gguf package's GGUFReader (a
memory map: the weights are not read), and its tokenizer rebuilt by engine/models/tokenizer.py, as the engine
does for a model it runs. Each id is decoded alone; an id that is part of a character (a byte token) shows as
its vocabulary entry, as Model.token_pieces shows it. Torch-free.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine import events as ev
from engine.errors import KvscopeError

GGUF_MAGIC = b"GGUF"
TOKENIZER_FILE = "tokenizer.json"


def load_vocabulary(path: str | Path) -> ev.Vocabulary:
    """A Vocabulary event (model name, the text of each token id) from a tokenizer.json, a folder holding one, or
    a GGUF file. KvscopeError for a path that is missing, unreadable, or none of these."""
    from engine.models.tokenizer import Tokenizer

    path = Path(path)
    if not path.exists():
        raise KvscopeError(f"tokenizer {str(path)!r}: no such file or folder")
    if path.is_dir():
        folder, path = path, path / TOKENIZER_FILE
        if not path.is_file():
            ggufs = sorted(folder.glob("*.gguf"))
            hint = f" (or give the GGUF file: {ggufs[0]})" if ggufs else ""
            raise KvscopeError(f"tokenizer {str(folder)!r}: the folder has no {TOKENIZER_FILE}{hint}; kvscope reads a "
                               f"tokenizer.json, a Hugging Face folder or a GGUF file, and downloads nothing")
        name = _folder_model_name(folder)
    else:
        name = ""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise KvscopeError(f"tokenizer {str(path)!r}: cannot be read: {e.strerror or e}") from None
    if magic == GGUF_MAGIC:
        tokenizer, name = _gguf_tokenizer(path)
    else:
        tokenizer = Tokenizer.from_file(path, bos_id=None)  # a ModelFileError (a KvscopeError) names what is wrong
        name = name or _folder_model_name(path.parent)
    return ev.Vocabulary(name, _pieces(tokenizer))


def _gguf_tokenizer(path: Path):
    from engine.errors import ModelFileError
    from engine.models.tokenizer import tokenizer_from_gguf_metadata

    try:
        from gguf import GGUFReader

        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader fails on a cut or corrupt header with several exception types
        raise KvscopeError(f"tokenizer {str(path)!r}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = field.contents()
        except Exception as e:  # bad UTF-8, value types the reader does not know
            raise KvscopeError(f"tokenizer {str(path)!r}: metadata key {key!r} cannot be read: {e}") from None
    try:
        tokenizer = tokenizer_from_gguf_metadata(metadata, source=path)
    except ModelFileError:
        raise
    except Exception as e:  # metadata of the right keys and the wrong shapes
        raise KvscopeError(f"tokenizer {str(path)!r}: its tokenizer metadata cannot be used: {type(e).__name__}: "
                           f"{e}") from None
    name = metadata.get("general.name")
    return tokenizer, name if isinstance(name, str) and name else path.stem


def _folder_model_name(folder: Path) -> str:
    """config.json's _name_or_path where it names the model, else the folder's name."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        named = config.get("_name_or_path") if isinstance(config, dict) else None
    except (OSError, ValueError):
        named = None
    return named if isinstance(named, str) and named else folder.resolve().name


def _pieces(tokenizer) -> tuple[str, ...]:
    backend = tokenizer.backend
    n = tokenizer.n_vocab
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)  # one call: fast in Rust
    return tuple(tokenizer.token_text(i) if "\ufffd" in text else text for i, text in enumerate(texts))
