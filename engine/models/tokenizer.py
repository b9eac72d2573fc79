"""Text <-> token ids, for models from tokenizer.json or from a GGUF's tokenizer metadata.

`Tokenizer` wraps a `tokenizers.Tokenizer` and adds what llama.cpp's vocab knows: the BOS id and
whether the model wants it, the end-of-generation ids, and streaming decode that never splits a
multi-byte UTF-8 character.

A GGUF has no tokenizer.json; `backend_from_gguf_metadata` rebuilds one from the vocabulary,
merges/scores and token types llama.cpp stores, with the pre-tokenizer regexes llama.cpp uses.

Example:
    tok = Tokenizer.from_file("tokenizer.json", bos_id=1, eos_ids=(2,), add_bos=True)
    ids = tok.encode("Hello world")            # [1, ...]
    stream = tok.stream()
    text = "".join(stream.push(i) for i in ids) + stream.flush()
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from engine.errors import ModelFileError

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regexes from llama.cpp's llm_tokenizer_bpe (src/llama-vocab.cpp). Each list is
# applied in turn, every regex splitting the pieces the previous one left, as llama.cpp does.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt-2": (_GPT2_SPLIT,),  # llama.cpp's name (llama-vocab.cpp)
    "gpt2": (_GPT2_SPLIT,),  # what kvscope wrote before, the demo model included; llama.cpp refuses it
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "stablelm2": (_QWEN2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
}
# llama.cpp sets tokenizer_ignore_merges for these: a word already in the vocabulary is one token
_IGNORE_MERGES_PRE = ("llama-bpe", "llama3")
_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


# ---------------------------------------------------------------------------------------------
# The tokenizer


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's BOS/EOS conventions.

    Args:
        backend: the tokenizers object doing the work.
        bos_id: the beginning-of-sequence id, or None if the model has none.
        eos_ids: every id that ends generation (llama.cpp's "end of generation" set).
        add_bos: whether `encode` puts BOS in front when not told otherwise.
    """

    def __init__(
        self, backend: Backend, *, bos_id: int | None, eos_ids: Sequence[int] = (), add_bos: bool = False
    ) -> None:
        if add_bos and bos_id is None:
            raise ValueError("add_bos=True needs a bos_id; pass the model's BOS token id or add_bos=False")
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.add_bos = add_bos

    @classmethod
    def from_file(
        cls, path: str | Path, *, bos_id: int | None, eos_ids: Sequence[int] = (), add_bos: bool = False
    ) -> Tokenizer:
        """Load a tokenizer.json."""
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:
            raise ModelFileError(f"{path}: cannot be read as a tokenizers file: {exc}") from exc
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos)

    @property
    def n_vocab(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (may be below the model's n_vocab)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; add_bos=None follows the model's default. Special tokens in text are parsed."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this model has no BOS token; pass add_bos=False")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; ids the tokenizer does not know (padding rows of the model) decode to nothing."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id as stored (e.g. "Ġthe", "▁the", "<0x0A>"); "" if unknown."""
        return self.backend.id_to_token(token_id) or ""

    def is_eog(self, token_id: int) -> bool:
        """Whether `token_id` ends generation."""
        return token_id in self.eos_ids

    def stream(self, *, skip_special: bool = False, context_ids: Sequence[int] = ()) -> StreamDecoder:
        """A StreamDecoder; `context_ids` (e.g. the prompt) give the left context for spacing."""
        return StreamDecoder(self, skip_special=skip_special, context_ids=context_ids)


class StreamDecoder:
    """Turns ids arriving one at a time into text increments, holding back incomplete characters.

    Each `push` decodes a short window of recent ids twice (with and without the new ones) and
    emits the difference once it no longer ends in U+FFFD, the mark of a partial UTF-8 sequence.
    Decoding a window rather than single ids keeps SentencePiece's leading-space handling right.
    `flush` emits whatever is left at the end.
    """

    _CONTEXT = 6  # ids of left context kept from `context_ids`

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False, context_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = list(context_ids)[-self._CONTEXT :]
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became complete (often "", sometimes several characters)."""
        self._ids.append(int(token_id))
        emitted = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(emitted) or full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[: self._prefix]  # keep the window short
        self._read -= self._prefix
        self._prefix = 0
        return full[len(emitted) :]

    def flush(self) -> str:
        """Return the text still held back (possibly with U+FFFD for bytes that never completed)."""
        emitted = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full[len(emitted) :] if len(full) > len(emitted) else ""


# ---------------------------------------------------------------------------------------------
# Building a tokenizer from GGUF metadata


def tokenizer_from_gguf_metadata(metadata: dict[str, Any], *, source: str | Path) -> Tokenizer:
    """A Tokenizer for a GGUF's `tokenizer.ggml.*` metadata (see `backend_from_gguf_metadata`)."""
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if metadata.get(key) is not None and int(metadata[key]) not in eos_ids:
            eos_ids.append(int(metadata[key]))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    default_add_bos = metadata.get("tokenizer.ggml.model") == "llama"
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    return Tokenizer(
        backend_from_gguf_metadata(metadata, source=source),
        bos_id=None if bos is None else int(bos),
        eos_ids=eos_ids,
        add_bos=add_bos,
    )


def backend_from_gguf_metadata(metadata: dict[str, Any], *, source: str | Path) -> Backend:
    """Rebuild a `tokenizers.Tokenizer` from GGUF tokenizer metadata.

    Args:
        metadata: GGUF header keys; uses tokenizer.ggml.{model, pre, tokens, token_type, merges,
            scores, unknown_token_id, add_space_prefix}.
        source: the file, named in errors.

    Raises:
        ModelFileError: no vocabulary, or a tokenizer model other than "gpt2" and "llama".
    """
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelFileError(f"{source}: GGUF has no tokenizer.ggml.tokens; kvscope needs the vocabulary")
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise ModelFileError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, source)
    elif model == "llama":
        backend = _sentencepiece_bpe(metadata, tokens, token_types, source)
    else:
        raise ModelFileError(
            f"{source}: tokenizer model {model!r} (tokenizer.ggml.model) is not supported; kvscope "
            "reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
        )
    _add_special_tokens(backend, tokens, token_types)
    return backend


def _first_ids(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id, keeping the first id of a token that appears twice (padded vocabularies)."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _split_merges(merges: Sequence[str], source: str | Path) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelFileError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        pairs.append((parts[0], parts[1]))
    return pairs


def pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`."""
    if pre is None:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
        pre = "default"
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        logger.warning("unknown pre-tokenizer %r; falling back to the GPT-2 regex (text may split differently)", pre)
        regexes = PRE_TOKENIZER_REGEXES["gpt-2"]
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level_bpe(metadata: dict[str, Any], tokens: Sequence[str], source: str | Path) -> Backend:
    """GPT-2 style: bytes spelled as printable characters, ranked merges, regex pre-splitting."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelFileError(f"{source}: tokenizer model 'gpt2' needs tokenizer.ggml.merges, which is missing")
    pre = metadata.get("tokenizer.ggml.pre")
    backend = Backend(
        models.BPE(
            vocab=_first_ids(tokens),
            merges=_split_merges(merges, source),
            ignore_merges=pre in _IGNORE_MERGES_PRE,
        )
    )
    backend.pre_tokenizer = pre_tokenizer_for(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]
) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two known tokens,
    best score first (as transformers' `generate_merges` does for LlamaTokenizer)."""
    vocab = _first_ids(tokens)
    candidates: list[tuple[str, str, float]] = []
    for token, score, ok in zip(tokens, scores, mergeable):
        if not ok:
            continue
        local = [
            (token[:k], token[k:], float(score))
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        candidates.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece_bpe(
    metadata: dict[str, Any], tokens: Sequence[str], token_types: Sequence[int], source: str | Path
) -> Backend:
    """SentencePiece BPE: "▁" for spaces, <0xNN> byte tokens for what the vocabulary lacks."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelFileError(f"{source}: tokenizer model 'llama' needs one tokenizer.ggml.scores entry per token")
    mergeable = [t in (TOKEN_NORMAL, TOKEN_USER_DEFINED) for t in token_types]
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None and TOKEN_UNKNOWN in token_types:
        unk_id = list(token_types).index(TOKEN_UNKNOWN)
    backend = Backend(
        models.BPE(
            vocab=_first_ids(tokens),
            merges=merges_from_scores(tokens, scores, mergeable),
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: Backend, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Control tokens become special (matched whole, skippable in decode); user-defined ones are
    matched whole too, as llama.cpp does. Both keep their ids: they are already in the vocabulary."""
    pairs = list(zip(tokens, token_types))
    control = [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in pairs if k == TOKEN_USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
