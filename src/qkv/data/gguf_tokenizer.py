"""An open model's tokenizer rebuilt from a GGUF file's metadata.

A GGUF file (what llama.cpp, Ollama and LM Studio run) carries no ``tokenizer.json``: it
stores the vocabulary as metadata under llama.cpp's keys (``tokenizer.ggml.tokens``,
``.merges``, ``.scores``, ``.token_type``, the BOS/EOS/padding ids, and
``tokenizer.chat_template``). :func:`tokenizer_from_gguf` builds the same
:class:`~qkv.data.tokenizers.HFTokenizer` a model folder gives from them, laid out as
transformers lays out the tokenizer it builds from the same file, so both give the same
ids:

- ``tokenizer.ggml.model = "gpt2"``: byte-level BPE (SmolLM2, Llama 3, Qwen). Tokens are
  spelled in GPT-2's byte alphabet; the text is split by the pattern
  ``tokenizer.ggml.pre`` names (Llama 3's, Qwen 2's, ...), else by GPT-2's.
- ``tokenizer.ggml.model = "llama"``: SentencePiece-style BPE with byte fallback (Llama 2,
  Mistral; Gemma's layout when ``general.architecture`` is a Gemma). When the file lists
  no merges they are recovered from the token scores (Gemma: from the token order).
- ``tokenizer.ggml.model = "gemma4"``: Gemma's layout with the merges the file lists and
  its tokens as spelled; no BOS added whatever the file's flag (Gemma 4's chat template
  writes ``<bos>`` itself: transformers' reading).

Tokens the file marks as control (type 3) become special tokens, matched whole in the
text; user-defined ones (type 4, e.g. ``<think>``) are matched whole too.

The file is read with the ``gguf`` package (``pip install 'qkv[gguf]'``), which maps it
into memory and never unpickles; only the metadata is read here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..checks import show
from ..models.gguf_weights import import_gguf
from ..utils.fileio import regular_file_stat
from ..utils.native import library_call
from .tokenizers import HFTokenizer, finish_hf_tokenizer, import_tokenizers

__all__ = [
    "GGUF_TOKENIZER_MODELS",
    "MAX_GGUF_TOKENS",
    "byte_alphabet",
    "tokenizer_from_gguf",
]

# The tokenizer kinds built here, as tokenizer.ggml.model names them.
GGUF_TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")
# Gemma 3's 262,144 tokens are the most of any supported family; 2**22 leaves room.
MAX_GGUF_TOKENS = 2**22
# Token types in tokenizer.ggml.token_type.
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma3_text")

# How text is split before byte-level merges, by tokenizer.ggml.pre: the pattern each
# family's merges were learned on (a name not listed gets GPT-2's own splitting).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen 2's, with combining marks (\p{M}) kept with the letters before them
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PATTERNS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3",
                     "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters: the printable Latin-1 bytes
    stand for themselves, and the 68 others (controls, space, soft hyphen, ...) are
    spelled by the characters from U+0100 on, in byte order. Byte-level BPE vocabularies
    write every token in these 256 characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + len(spelling) - len(printable))
    return spelling


class _Metadata:
    """Typed access to a GGUF reader's metadata, every problem one line naming the file."""

    def __init__(self, reader: Any, path: str,
                 metadata: Mapping[str, Any] | None = None) -> None:
        self.reader, self.path, self.metadata = reader, path, metadata

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        if self.metadata is not None:
            value = self.metadata.get(key)
            if value is None:
                return default
        else:
            field = self.reader.get_field(key)
            if field is None:
                return default
            try:
                value = field.contents()
            except (ValueError, IndexError, TypeError, UnicodeDecodeError) as error:
                raise ValueError(f"{self.path}: metadata {key} cannot be read "
                                 f"({type(error).__name__})") from None
        if kind is list:
            if not isinstance(value, list):
                raise ValueError(f"{self.path}: metadata {key} must be a list, got {show(value)}")
            return value
        if hasattr(value, "item"):  # a NumPy scalar
            value = value.item()
        if kind is int and isinstance(value, bool):
            value = None
        if not isinstance(value, kind):
            raise ValueError(f"{self.path}: metadata {key} has the wrong type ({show(value)})")
        return value

    def strings(self, key: str, required: bool = False) -> list[str] | None:
        value = self.get(key, list)
        if value is None:
            if required:
                raise ValueError(f"{self.path} has no {key}: it does not describe a tokenizer")
            return None
        if len(value) > MAX_GGUF_TOKENS:
            raise ValueError(f"{self.path}: {key} has {len(value):,} entries; at most "
                             f"{MAX_GGUF_TOKENS:,} are accepted")
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.path}: {key} must be a list of strings")
        return value

    def numbers(self, key: str, n: int) -> list[Any] | None:
        value = self.get(key, list)
        if value is not None and len(value) != n:
            raise ValueError(f"{self.path}: {key} has {len(value):,} entries for {n:,} tokens")
        return value

    def token_id(self, key: str, n: int) -> int | None:
        value = self.get(key, int)
        if value is not None and not 0 <= value < n:
            raise ValueError(f"{self.path}: {key} is {value}, not an id in range(0, {n:,})")
        return value


def _byte_level(meta: _Metadata, tokens: list[str], tokenizers: Any) -> Any:
    """SmolLM2 / Llama 3 / Qwen: GPT-2's byte-level BPE."""
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, token in enumerate(tokens):
        # A token outside the byte alphabet (a special token written plainly) is spelled
        # through its UTF-8 bytes, as the vocabulary spells every other text.
        spelled = token if set(token) <= letters else "".join(
            alphabet[b] for b in token.encode("utf-8"))
        vocab[spelled] = i
    merges = _merges(meta, vocab, None)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False))
    pattern = SPLIT_PATTERNS.get(meta.get("tokenizer.ggml.pre", str))
    if pattern is None:
        backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = tokenizers.decoders.ByteLevel()
    return backend


def _sentencepiece(meta: _Metadata, tokens: list[str], tokenizers: Any, gemma: bool,
                   unk: str | None, respell: bool = True) -> Any:
    """Llama 2 / Mistral (and Gemma's variant): BPE over U+2581-spaced text with byte
    fallback. ``respell``: Gemma's whitespace tokens are stored as real spaces (Gemma 3's
    files; Gemma 4's keep their spelling)."""
    if gemma and respell:
        # Gemma's files store a token of several spaces as real spaces; in the text the
        # model sees they are U+2581s.
        tokens = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    # (without merges in the file, Gemma's are learned in token order, not score)
    order = {token: -i for i, token in enumerate(tokens)}
    vocab = {token: i for i, token in enumerate(tokens)}
    if gemma:
        scores = order
    else:
        values = meta.numbers("tokenizer.ggml.scores", len(tokens))
        scores = None if values is None else dict(zip(tokens, values, strict=True))
    merges = _merges(meta, vocab, scores)
    models, decoders = tokenizers.models, tokenizers.decoders
    if gemma:
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                                  unk_token=unk, dropout=None,
                                                  byte_fallback=True))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
            pattern=" ", behavior="merged_with_previous", invert=False)
        backend.normalizer = tokenizers.normalizers.Replace(" ", _SPACE)
        backend.decoder = decoders.Sequence(
            [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        return backend
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                              byte_fallback=True, dropout=None))
    # One U+2581 before the text's start, none after a special token: Llama's
    # "first" prepend scheme.
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return backend


def _merges(meta: _Metadata, vocab: dict[str, int],
            scores: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The file's merges, or, without any, the merges its vocabulary implies: every way
    to cut a token into two tokens, best first (by ``scores`` when given, else by id)."""
    listed = meta.strings("tokenizer.ggml.merges")
    if listed is not None:
        pairs = [tuple(m.split(" ")) for m in listed]
        bad = next((m for m, p in zip(listed, pairs, strict=True) if len(p) != 2), None)
        if bad is not None:
            raise ValueError(f"{meta.path}: merge {show(bad)} is not two tokens with one space "
                             "between")
        return pairs  # type: ignore[return-value]
    rank: dict[str, Any] = vocab if scores is None else scores
    found = []
    for token, score in rank.items():
        cuts = [(token[:k], token[k:]) for k in range(1, len(token))
                if token[:k] in vocab and token[k:] in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        found += [(left, right, score) for left, right in cuts]
    # Higher scores merge first; with ids as the rank, lower ids do.
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=scores is not None)
    return [(left, right) for left, right, _ in found]


def tokenizer_from_gguf(path: str | os.PathLike[str], *, reader: Any = None,
                        metadata: Mapping[str, Any] | None = None) -> HFTokenizer:
    """The tokenizer a GGUF file's metadata describes, as an :class:`HFTokenizer`.

    Args:
        path: the ``.gguf`` file (a regular file).
        reader: a ``gguf.GGUFReader`` already open on ``path`` (the model's import reads
            the file once); default: one is opened here.
        metadata: instead of a reader, the file's metadata already read, full key ->
            value (:func:`qkv.models.gguf_weights.read_gguf_metadata`: plain lists,
            a fifteenth of a reader's memory for a 50k vocabulary).

    Returns:
        The tokenizer, with the file's BOS / EOS / padding / unknown tokens, its EOS id as
        the one that ends a reply, and ``tokenizer.chat_template`` as its chat template.
        A BOS is added to each encoded text when the file says
        ``tokenizer.ggml.add_bos_token`` (a ``llama`` vocabulary that does not say adds
        one, as llama.cpp does).

    Raises:
        ValueError: one line naming the file: not a GGUF, no tokenizer in it, a tokenizer
            kind other than :data:`GGUF_TOKENIZER_MODELS`, or metadata that contradicts
            itself (ids out of range, lists of different lengths).
        ImportError: the gguf or tokenizers package is missing.
    """
    path = Path(path)
    gguf = import_gguf()
    tokenizers = import_tokenizers()
    if reader is None and metadata is None:
        regular_file_stat(path, "GGUF file")
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError,
                UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not a GGUF file qkv can read "
                             f"({type(error).__name__}: {' '.join(str(error).split())[:160]})"
                             ) from None
    meta = _Metadata(reader, str(path), metadata)
    model = meta.get("tokenizer.ggml.model", str)
    if model is None:
        raise ValueError(f"{path} has no tokenizer.ggml.model: it does not describe a tokenizer")
    if model not in GGUF_TOKENIZER_MODELS:
        raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is not supported; supported: "
                         f"{', '.join(GGUF_TOKENIZER_MODELS)}")
    tokens = meta.strings("tokenizer.ggml.tokens", required=True)
    n = len(tokens)
    architecture = meta.get("general.architecture", str, "")
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    ids = {name: meta.token_id(f"tokenizer.ggml.{key}", n) for name, key in names.items()}
    config: dict[str, Any] = {name: None if i is None else tokens[i] for name, i in ids.items()}
    builders: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: _byte_level(meta, tokens, tokenizers),
        "llama": lambda: _sentencepiece(meta, tokens, tokenizers,
                                        architecture in _GEMMA_ARCHITECTURES,
                                        config["unk_token"]),
        "gemma4": lambda: _sentencepiece(meta, tokens, tokenizers, True, config["unk_token"],
                                         respell=False),
    }
    try:
        with library_call():  # the tokenizers library on the file's vocabulary and merges
            backend = builders[model]()
    except ValueError:
        raise
    except Exception as error:  # its own error, or its panic (LibraryPanic)
        raise ValueError(f"{path}: the tokenizers library cannot build a {model} tokenizer "
                         f"from its metadata ({' '.join(str(error).split())[:200]})") from None
    if model == "llama":
        config["add_bos_token"] = True  # llama.cpp's default for these vocabularies
    if model == "llama" and architecture in _GEMMA_ARCHITECTURES:
        config["mask_token"] = "<mask>"  # Gemma's tokenizer always names one
    for flag in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{flag}", bool)
        if value is not None:
            config[flag] = value
    if model == "gemma4":  # its chat template writes <bos>; the text alone gets none
        config["add_bos_token"] = False
    types = meta.numbers("tokenizer.ggml.token_type", n) or []
    _add_marked_tokens(backend, tokens, types, tokenizers, byte_level=model == "gpt2")
    template = meta.get("tokenizer.chat_template", str)
    try:
        return finish_hf_tokenizer(backend, config, eos_token_ids=ids["eos_token"],
                                   chat_template=template or None, add_flags=True,
                                   where="its tokenizer metadata")
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _add_marked_tokens(backend: Any, tokens: Sequence[str], types: Sequence[int],
                       tokenizers: Any, byte_level: bool) -> None:
    """Control tokens as special tokens, user-defined ones as plain added tokens: each is
    then matched whole in the text instead of being cut into pieces. In a byte-level
    vocabulary a "control" token written outside the byte alphabet is a mislabel in the
    file (adding it would grow the vocabulary past the model's), so it is skipped."""
    letters = set(byte_alphabet().values())
    control = [tokenizers.AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types, strict=False)
               if kind == _CONTROL and (not byte_level or set(t) <= letters)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [tokenizers.AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types, strict=False)
            if kind == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
