"""Tokenizers for GPT-style language modelling: GPT-2's byte-pair encoding, raw bytes, and
the tokenizers of today's open models.

Each turns text into a list of integer ids and back, and describes itself with a dict
that a checkpoint can store, so a trained model is always paired with its tokenizer:

    tok = get_tokenizer("gpt2")              # tiktoken's GPT-2 BPE, 50,257 ids
    ids = tok.encode("Hello<|endoftext|>")   # [15496, 50256]
    tok.decode(ids)                          # 'Hello<|endoftext|>'
    tokenizer_from_dict(tok.to_dict())       # the same tokenizer again

``"gpt2"`` is the tokenizer of LLMs-from-scratch chapter 2: tiktoken's ``gpt2`` encoding
with ``<|endoftext|>`` (id 50256) allowed as a special token. tiktoken downloads the two BPE
files on first use; to work offline, point ``bpe_dir`` (or the environment variable
``QKV_BPE_DIR``) at a folder holding GPT-2's original ``encoder.json`` and ``vocab.bpe``, and
the identical encoding is built from them locally. Rebuilding a tokenizer from a
checkpoint (:func:`tokenizer_from_dict`) never downloads: it needs those files.

``"bytes"`` needs nothing at all: every UTF-8 byte is a token (ids 0-255), plus id 256 for
``<|endoftext|>``. Sequences get about four times longer than with BPE on English, but the
vocabulary is tiny, which suits small models trained on a CPU.

``"hf"`` (:class:`HFTokenizer`) is an open model's own tokenizer (SmolLM2, Llama 3, Qwen,
Gemma, ...) run by Hugging Face's ``tokenizers`` library: read from a model folder's
``tokenizer.json`` with its ``tokenizer_config.json`` and ``generation_config.json``
(:func:`load_hf_tokenizer`), or built from a GGUF file's metadata
(:func:`qkv.data.gguf_tokenizer.tokenizer_from_gguf`). It gives the ids transformers gives
on the same folder, knows the model's BOS and EOS ids, and renders its chat template
(:meth:`HFTokenizer.chat_prompt`). Its dict holds the whole tokenizer (the tokenizer.json
text), so a run directory needs nothing else to rebuild it.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..checks import MAX_SIZE, check_int, check_str, parse_json, show
from ..options import HF_TOKENIZER_NAME, TOKENIZER_NAMES
from ..utils.fileio import open_regular, read_regular, regular_file_stat
from ..utils.native import LibraryPanic, library_call
from .chat import (
    MAX_CHAT_TEMPLATE_CHARS,
    chat_messages,
    check_chat_template,
    render_chat_template,
)

__all__ = [
    "BPE_DIR_ENV",
    "ENDOFTEXT",
    "GPT2_EOT_ID",
    "GPT2_PAT_STR",
    "TOKENIZER_NAMES",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "HFTokenizer",
    "HF_TOKENIZER_NAME",
    "MAX_TOKENIZER_JSON_BYTES",
    "SPECIAL_TOKEN_NAMES",
    "Tokenizer",
    "get_tokenizer",
    "finish_hf_tokenizer",
    "import_tokenizers",
    "load_hf_tokenizer",
    "tokenizer_from_dict",
]

ENDOFTEXT = "<|endoftext|>"
GPT2_EOT_ID = 50256
BPE_DIR_ENV = "QKV_BPE_DIR"

# GPT-2's pre-tokenisation pattern (tiktoken's r50k/gpt2 pat_str): text is first split into
# contractions, runs of letters, runs of digits, runs of other symbols (each optionally led by
# one space) and whitespace; BPE merges then act within each piece, never across pieces.
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)

BPE_FILES = ("encoder.json", "vocab.bpe")
# The same two files under the names a Hugging Face GPT-2 folder gives them.
HF_BPE_FILES = ("vocab.json", "merges.txt")
MAX_BPE_FILE_BYTES = 64 * 2**20


def _as_id_list(ids: Iterable[int] | Any) -> list[int]:
    """Accept a list, a tuple or a 1-D tensor/array of ids; return a list of Python ints."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class Tokenizer(ABC):
    """What every qkv tokenizer provides.

    Attributes:
        name: the name :func:`get_tokenizer` knows it by.
        n_vocab: number of ids; every id is in ``range(n_vocab)`` (the model's ``vocab_size``).
        eot_token: id of ``<|endoftext|>``, or None when the tokenizer has none.
    """

    name: str
    n_vocab: int
    eot_token: int | None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text -> ids. ``<|endoftext|>`` in the text becomes ``eot_token`` when there is one."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Ids (a list or a 1-D tensor) -> text."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description for a checkpoint; :func:`tokenizer_from_dict` reverses it."""
        return {"name": self.name, "n_vocab": self.n_vocab, "eot_token": self.eot_token}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_vocab={self.n_vocab}, eot_token={self.eot_token})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, 256 is ``<|endoftext|>``.

    Args:
        eot: reserve id 256 for ``<|endoftext|>`` (``n_vocab = 257``, the default). With
            ``eot=False`` the vocabulary is exactly the 256 bytes and the marker is encoded
            as its 13 ordinary bytes.

    ``decode`` replaces byte sequences that are not valid UTF-8 (a model can emit those)
    with U+FFFD instead of failing.
    """

    name = "bytes"

    def __init__(self, eot: bool = True) -> None:
        self.eot_token = 256 if eot else None
        self.n_vocab = 257 if eot else 256

    def encode(self, text: str) -> list[int]:
        # surrogateescape: bytes that were not UTF-8 where the text came from (Python
        # decodes a command line's stray bytes to lone surrogates) become those bytes again.
        if self.eot_token is None:
            return list(text.encode("utf-8", errors="surrogateescape"))
        ids: list[int] = []
        for i, piece in enumerate(text.split(ENDOFTEXT)):
            if i:
                ids.append(self.eot_token)
            ids.extend(piece.encode("utf-8", errors="surrogateescape"))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_id_list(ids)
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"ids must be in range(0, {self.n_vocab}) for {self!r}, got {bad[0]}")
        if self.eot_token is None:
            return bytes(ids).decode("utf-8", errors="replace")
        # Decode the bytes between markers separately, so an end-of-text never glues the
        # halves of a split multi-byte character together.
        pieces: list[list[int]] = [[]]
        for i in ids:
            if i == self.eot_token:
                pieces.append([])
            else:
                pieces[-1].append(i)
        return ENDOFTEXT.join(bytes(p).decode("utf-8", errors="replace") for p in pieces)


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-pair encoding through tiktoken, with ``<|endoftext|>`` allowed.

    Build it with :func:`get_tokenizer` (``"gpt2"``); wrapping a ready ``tiktoken.Encoding``
    also works. ``encode`` is the book's ``tokenizer.encode(text,
    allowed_special={"<|endoftext|>"})``.
    """

    name = "gpt2"

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.n_vocab = encoding.n_vocab
        self.eot_token = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special={ENDOFTEXT})

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_id_list(ids)
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"ids must be in range(0, {self.n_vocab}) for {self!r}, got {bad[0]}")
        return self.encoding.decode(ids)


# ----------------------------------------------------------------------------
# Open models' tokenizers: Hugging Face's tokenizers library

# Gemma 3's tokenizer.json (262,144 tokens) is 33 MB, Llama 3's 9 MB, Qwen's 7 MB.
MAX_TOKENIZER_JSON_BYTES = 64 * 2**20
# tokenizer_config.json and generation_config.json: Gemma 3's tokenizer_config.json, the
# largest known, is 1.2 MB (it lists every added token).
MAX_TOKENIZER_CONFIG_BYTES = 16 * 2**20
# The special tokens transformers names, in its order; each is a template variable too.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_HF_KEYS = ("name", "n_vocab", "eot_token", "tokenizer_json", "sha256", "special_tokens",
            "eos_token_ids", "chat_template")


def import_tokenizers() -> Any:
    """The tokenizers library, or a one-line ImportError saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError("an open model's tokenizer needs Hugging Face's tokenizers library: "
                          "pip install tokenizers (or pip install 'qkv[hf]')") from None
    return tokenizers


def _read_json_object(path: Path, what: str, max_bytes: int) -> dict[str, Any]:
    data = read_regular(path, what, max_bytes)
    try:
        obj = parse_json(data)
    except ValueError as error:
        raise ValueError(f"{what} {path}: {error}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {show(obj)}")
    return obj


def _token_text(what: str, value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken
    dict with its text under ``content``; None when unset."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{what} must be a string or {{'content': string}}, got {show(value)}")


def _added_token(tokenizers: Any, value: Any, what: str, special: bool) -> Any:
    """A ``tokenizers.AddedToken`` from a string or tokenizer_config.json's dict form."""
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=special, normalized=not special)
    if not isinstance(value, dict) or not isinstance(value.get("content"), str):
        raise ValueError(f"{what} must be a string or {{'content': string, ...}}, "
                         f"got {show(value)}")
    flags = {key: value[key] for key in ("single_word", "lstrip", "rstrip", "normalized",
                                         "special") if isinstance(value.get(key), bool)}
    flags.setdefault("special", special)
    return tokenizers.AddedToken(value["content"], **flags)


def _check_ids(what: str, ids: Any, n_vocab: int) -> list[int]:
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if not isinstance(ids, (list, tuple)) or len(ids) > 1024:
        raise ValueError(f"{what} must be an id or a list of ids, got {show(ids)}")
    out = [check_int(what, i, 0, n_vocab - 1) for i in ids]
    return list(dict.fromkeys(out))


class HFTokenizer(Tokenizer):
    """An open model's tokenizer, run by Hugging Face's ``tokenizers`` library.

    Build it with :func:`load_hf_tokenizer` (a model folder),
    :func:`qkv.data.gguf_tokenizer.tokenizer_from_gguf` (a GGUF file) or
    :func:`tokenizer_from_dict` (a run's config).

    Args:
        tokenizer_json: the whole tokenizer as ``tokenizer.json`` text: vocabulary,
            merges, normalizer, pre-tokenizer, added tokens, post-processor, decoder.
        special_tokens: the text of the named special tokens (keys from
            :data:`SPECIAL_TOKEN_NAMES`: ``bos_token``, ``eos_token``, ...); each must be a
            token of the vocabulary.
        eos_token_ids: the ids that end a reply (``generation_config.json`` may list
            several: Llama 3 Instruct stops at ``<|eot_id|>`` and ``<|end_of_text|>``);
            default: the id of ``eos_token``.
        chat_template: the model's Jinja chat template, or None.
        n_vocab: the model's vocabulary size when it is larger than the tokenizer's (Qwen
            pads its embedding to a multiple of 128 rows); ids without a token decode to
            nothing. Default: one past the largest id of the tokenizer.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` that encodes and decodes.
        tokenizer_json: its tokenizer.json text; ``sha256`` is that text's SHA-256.
        special_tokens: ``{"bos_token": "<|im_start|>", ...}``, only the ones set; the
            chat template sees them as variables.
        bos_token_id: id of ``bos_token`` (None without one).
        eos_token_ids: the ids that end a reply, without repeats.
        eot_token: id of ``eos_token``, else the first of ``eos_token_ids``, else None.
        chat_template: the Jinja chat template, or None (a base model).
    """

    name = HF_TOKENIZER_NAME

    def __init__(
        self,
        tokenizer_json: str,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Sequence[int] | int | None = None,
        chat_template: str | None = None,
        n_vocab: int | None = None,
    ) -> None:
        tokenizers = import_tokenizers()
        if not isinstance(tokenizer_json, str):
            raise ValueError(f"tokenizer_json must be tokenizer.json's text, got "
                             f"{show(tokenizer_json)}")
        try:
            with library_call():
                backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as error:  # the library raises plain Exception for bad JSON
            raise ValueError("not a tokenizer the tokenizers library reads "
                             f"({' '.join(str(error).split())[:200]})") from None
        # A tokenizer.json may carry truncation or padding settings; encode never applies
        # them (transformers applies them only when asked to).
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.tokenizer_json = tokenizer_json
        self.sha256 = hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()
        size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.n_vocab = size if n_vocab is None else check_int("n_vocab", n_vocab, size, MAX_SIZE)
        self.special_tokens: dict[str, str] = {}
        for key, text in (special_tokens or {}).items():
            if key not in SPECIAL_TOKEN_NAMES:
                raise ValueError(f"special token name {show(key)} is not one of "
                                 f"{', '.join(SPECIAL_TOKEN_NAMES)}")
            if text is None:
                continue
            if not isinstance(text, str) or backend.token_to_id(text) is None:
                raise ValueError(f"{key} {show(text)} is not a token of this tokenizer")
            self.special_tokens[key] = text
        self.bos_token_id = self.token_id("bos_token")
        eos = self.token_id("eos_token")
        if eos_token_ids is None:
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = _check_ids("eos_token_ids", eos_token_ids, self.n_vocab)
        self.eot_token = eos if eos is not None else (
            self.eos_token_ids[0] if self.eos_token_ids else None)
        if chat_template is not None and (
                not isinstance(chat_template, str) or not chat_template
                or len(chat_template) > MAX_CHAT_TEMPLATE_CHARS):
            raise ValueError("chat_template must be a non-empty string of at most "
                             f"{MAX_CHAT_TEMPLATE_CHARS:,} characters, got {show(chat_template)}")
        self.chat_template = chat_template

    def token_id(self, key: str) -> int | None:
        """The id of the special token ``key`` (``"bos_token"``, ``"pad_token"``, ...)."""
        text = self.special_tokens.get(key)
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids, as transformers' ``tokenizer.encode(text)``.

        Special tokens written in the text (``<|im_start|>``, ``<|endoftext|>``) become
        their ids. ``add_special_tokens`` adds what the tokenizer adds around a text
        (Llama's and Gemma's BOS); a rendered chat prompt already holds them, so it is
        encoded with ``add_special_tokens=False``.

        Raises:
            ValueError: one line naming the text's length and the part of the tokenizer
                that failed on it (a pre-tokenizer's regular expression that gives up on
                a pathological text, say: the library's panic included).
        """
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {show(text)}")
        try:
            with library_call():
                return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as error:  # the library's error, or its panic (LibraryPanic)
            raise ValueError(f"the tokenizer's {self._failing_part(text)} "
                             f"{_failed(error)} on a text of {len(text):,} characters: "
                             f"{_one_line(error)}") from None

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Ids (a list or a 1-D tensor) -> text, as transformers' ``tokenizer.decode``."""
        ids = _as_id_list(ids)
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ValueError(f"ids must be in range(0, {self.n_vocab}) for {self!r}, got {bad[0]}")
        try:
            with library_call():
                return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        except Exception as error:
            decoder = self.backend.decoder
            part = "model" if decoder is None else f"decoder ({type(decoder).__name__})"
            raise ValueError(f"the tokenizer's {part} {_failed(error)} on {len(ids):,} ids: "
                             f"{_one_line(error)}") from None

    def _failing_part(self, text: str) -> str:
        """Which part of the tokenizer fails on ``text``, found by running them one at a
        time as the library chains them: the normalizer, each pre-tokenizer (of a
        ``Sequence``, one by one), the model on each piece; else the post-processor."""
        backend = self.backend

        def runs(step: Callable[[], Any]) -> bool:
            try:
                with library_call():
                    step()
            except Exception:  # noqa: BLE001 - this one is the failing part
                return False
            return True

        normalized = [text]
        if backend.normalizer is not None and not runs(
                lambda: normalized.append(backend.normalizer.normalize_str(text))):
            return f"normalizer ({_part_names(backend.normalizer)})"
        pieces = [normalized[-1]]
        steps = _members(backend.pre_tokenizer) if backend.pre_tokenizer is not None else []
        for i, step in enumerate(steps):

            def split(step: Any = step) -> None:
                pieces[:] = [p for piece in pieces for p, _ in step.pre_tokenize_str(piece)]

            if not runs(split):
                where = f", step {i + 1} of a Sequence of {len(steps)}" if len(steps) > 1 else ""
                return f"pre-tokenizer ({type(step).__name__}{where})"
        if not runs(lambda: [backend.model.tokenize(piece) for piece in pieces]):
            return f"model ({type(backend.model).__name__})"
        processor = backend.post_processor
        return "post-processor" + (f" ({type(processor).__name__})" if processor else "")

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """The model's chat template rendered around one user message (and an optional
        system message), ending where the assistant's reply starts: what transformers'
        ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
        returns. Encode it with ``add_special_tokens=False``.

        Raises:
            ValueError: the tokenizer has no chat template, or the template refuses the
                conversation (Gemma 2's refuses a ``system`` message, ...), fails, or
                reaches a limit of :data:`qkv.data.chat.CHAT_RENDER_LIMITS`
                (:class:`~qkv.data.chat.ChatTemplateError`, one line).
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template (it is a base model, not an "
                             "instruction-tuned one); prompt it with plain text instead")
        return render_chat_template(self.chat_template, chat_messages(user, system),
                                    special_tokens=self.special_tokens,
                                    add_generation_prompt=True)

    def check_chat_template(self) -> None:
        """Render the chat template once, on a one-message conversation and under the
        render limits (:func:`qkv.data.chat.check_chat_template`); nothing to do without
        one.

        Raises:
            ChatTemplateError: (a ValueError) the template does not parse, reaches a
                limit or fails; one line saying which.
        """
        if self.chat_template is not None:
            check_chat_template(self.chat_template, special_tokens=self.special_tokens)

    def to_dict(self) -> dict[str, Any]:
        """The whole tokenizer as JSON-able data: :func:`tokenizer_from_dict` rebuilds it
        with no file and no network (``tokenizer_json`` is the tokenizer.json text, with
        its SHA-256 to check it by)."""
        return {
            "name": self.name, "n_vocab": self.n_vocab, "eot_token": self.eot_token,
            "special_tokens": dict(self.special_tokens),
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "sha256": self.sha256,
            "tokenizer_json": self.tokenizer_json,
        }

    def __repr__(self) -> str:
        return (f"HFTokenizer(n_vocab={self.n_vocab}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids})")


def _one_line(error: BaseException, limit: int = 200) -> str:
    return " ".join(str(error).split())[:limit] or type(error).__name__


def _failed(error: BaseException) -> str:
    return "panicked" if isinstance(error, LibraryPanic) else "failed"


def _members(part: Any) -> list[Any]:
    """The parts of a tokenizers ``Sequence`` (which has no len), or ``[part]``."""
    if type(part).__name__ != "Sequence":
        return [part]
    members = []
    while True:
        try:
            members.append(part[len(members)])
        except Exception:  # noqa: BLE001 - past its end (IndexError, or the library's own)
            return members or [part]


def _part_names(part: Any) -> str:
    members = _members(part)
    inner = ", ".join(type(m).__name__ for m in members) if members != [part] else ""
    return f"{type(part).__name__}: {inner}" if inner else type(part).__name__


def finish_hf_tokenizer(
    backend: Any,
    config: Mapping[str, Any],
    *,
    eos_token_ids: Sequence[int] | int | None = None,
    chat_template: str | None = None,
    add_flags: bool = False,
    where: str = "tokenizer_config.json",
) -> HFTokenizer:
    """An :class:`HFTokenizer` from a ``tokenizers.Tokenizer`` and a tokenizer config, set
    up as transformers sets up its tokenizer from the same pair.

    ``config`` holds what ``tokenizer_config.json`` may: the named special tokens
    (strings or ``{"content": ...}``), ``additional_special_tokens``,
    ``added_tokens_decoder``, ``add_bos_token`` / ``add_eos_token``. As transformers does,
    a special token missing from the vocabulary is added to it. With ``add_flags`` (a
    tokenizer built from a GGUF's metadata), when the config says ``add_bos_token`` or
    ``add_eos_token``, or the tokenizer has no post-processor, the post-processor becomes
    "BOS if asked, the text, EOS if asked"; without it (a folder's tokenizer.json) the
    tokenizer.json's own post-processor decides, and the two flags are ignored, as
    transformers ignores them when it reads a tokenizer.json. ``backend`` is changed in
    place. ``where`` names the config's origin in errors.
    """
    tokenizers = import_tokenizers()
    special = {name: _token_text(f"{where} {name}", config.get(name))
               for name in SPECIAL_TOKEN_NAMES}
    present = set(backend.get_vocab(with_added_tokens=True))
    to_add = []
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError(f"{where} added_tokens_decoder must be an object, got {show(decoder)}")
    for key in sorted(decoder, key=lambda k: int(k) if str(k).isdigit() else -1):
        token = _added_token(tokenizers, decoder[key], f"{where} added_tokens_decoder",
                             special=False)
        if token.content not in present:
            to_add.append(token)
    extra: list[Any] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key) or []
        if isinstance(value, dict):  # named extra tokens: their texts
            value = list(value.values())
        if not isinstance(value, list):
            raise ValueError(f"{where} {key} must be a list of tokens, got {show(value)}")
        extra += value
    for value in [config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name)] + extra:
        token = _added_token(tokenizers, value, f"{where} special token", special=True)
        if token.content not in present and all(t.content != token.content for t in to_add):
            to_add.append(token)
    if to_add:
        backend.add_tokens(to_add)
    edges = []
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        value = config.get(flag, False)
        if not isinstance(value, bool):
            raise ValueError(f"{where} {flag} must be true or false, got {show(value)}")
        text = special[name]
        edges.append((text, backend.token_to_id(text)) if value and text else None)
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if add_flags and (explicit or backend.post_processor is None):
        bos, eos = edges

        def around(seq: str, part: int) -> list[str]:
            return ([f"{bos[0]}:{part}"] if bos else []) + [f"{seq}:{part}"] + (
                [f"{eos[0]}:{part}"] if eos else [])

        single = " ".join(around("$A", 0))
        pair = " ".join(around("$A", 0) + around("$B", 1))
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[e for e in edges if e])
    return HFTokenizer(backend.to_str(), special_tokens=special, eos_token_ids=eos_token_ids,
                       chat_template=chat_template)


def _chat_template_of(config: Mapping[str, Any], where: str) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named templates
    of which the one named ``default`` is the chat template."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{where} lists chat templates {show(sorted(map(str, named)))} "
                         "but none named 'default'")
    raise ValueError(f"{where} chat_template must be a string, got {show(value)}")


def load_hf_tokenizer(folder: str | Path) -> HFTokenizer:
    """An open model's tokenizer from its Hugging Face folder, with no network access.

    Reads ``tokenizer.json`` (required), and when present ``tokenizer_config.json``
    (special tokens, the chat template; whether a BOS is added is tokenizer.json's to
    say), ``chat_template.jinja``
    (the chat template, preferred to the config's, as transformers prefers it) and
    ``generation_config.json`` (``eos_token_id``: one id or a list). Each must be a
    regular file of bounded size; every problem is one line naming the file.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``folder``.
        ValueError: a file that is too large, not JSON, or says something impossible.
        ImportError: the tokenizers library is not installed.
    """
    tokenizers = import_tokenizers()
    folder = Path(folder).expanduser()
    path = folder / "tokenizer.json"
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no tokenizer.json in {folder}: an open model's folder holds "
                                "tokenizer.json (GPT-2's vocab.json + merges.txt is the gpt2 "
                                "tokenizer)")
    data = read_regular(path, "tokenizer file", MAX_TOKENIZER_JSON_BYTES)
    try:
        parse_json(data)  # bounded nesting, one-line errors, before the library sees it
        with library_call():
            backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except ValueError as error:
        raise ValueError(f"tokenizer file {path}: {error}") from None
    except Exception as error:  # the library raises plain Exception for what it cannot read
        raise ValueError(f"tokenizer file {path} is not a tokenizer the tokenizers library "
                         f"reads ({' '.join(str(error).split())[:200]})") from None
    config: dict[str, Any] = {}
    config_path = folder / "tokenizer_config.json"
    if os.path.lexists(config_path):
        config = _read_json_object(config_path, "tokenizer config", MAX_TOKENIZER_CONFIG_BYTES)
    where = str(config_path)
    template = _chat_template_of(config, where)
    jinja_path = folder / "chat_template.jinja"
    if os.path.lexists(jinja_path):
        raw = read_regular(jinja_path, "chat template file", 4 * MAX_CHAT_TEMPLATE_CHARS)
        try:
            template = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"chat template file {jinja_path} is not UTF-8 text") from None
    eos_ids = None
    generation_path = folder / "generation_config.json"
    if os.path.lexists(generation_path):
        generation = _read_json_object(generation_path, "generation config",
                                       MAX_TOKENIZER_CONFIG_BYTES)
        eos_ids = generation.get("eos_token_id")
    try:
        return finish_hf_tokenizer(backend, config, eos_token_ids=eos_ids,
                                   chat_template=template, where=where)
    except ValueError as error:
        raise ValueError(f"{folder}: {error}") from None


def _hf_from_dict(d: Mapping[str, Any]) -> HFTokenizer:
    unknown = sorted(str(k) for k in set(d) - set(_HF_KEYS))
    if unknown:
        raise ValueError(f"tokenizer has unknown key(s) {', '.join(map(show, unknown[:5]))}; "
                         f"valid: {', '.join(_HF_KEYS)}")
    missing = [key for key in ("tokenizer_json", "sha256", "n_vocab") if key not in d]
    if missing:
        raise ValueError(f"an 'hf' tokenizer dict needs {', '.join(missing)}")
    text = d["tokenizer_json"]
    if not isinstance(text, str):
        raise ValueError("tokenizer tokenizer_json must be tokenizer.json's text, "
                         f"got {show(text)}")
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != d["sha256"]:
        raise ValueError("tokenizer tokenizer_json does not match its sha256: the stored "
                         "tokenizer was changed")
    try:
        parse_json(text)
    except ValueError as error:
        raise ValueError(f"tokenizer tokenizer_json: {error}") from None
    special = d.get("special_tokens") or {}
    if not isinstance(special, dict):
        raise ValueError(f"tokenizer special_tokens must be an object, got {show(special)}")
    tok = HFTokenizer(text, special_tokens=special, eos_token_ids=d.get("eos_token_ids"),
                      chat_template=d.get("chat_template"),
                      n_vocab=check_int("tokenizer n_vocab", d["n_vocab"], 1, MAX_SIZE))
    if "eot_token" in d and d["eot_token"] != tok.eot_token:
        raise ValueError(f"tokenizer 'hf' was saved with eot_token={show(d['eot_token'])} but "
                         f"rebuilds with eot_token={tok.eot_token}")
    return tok


def _import_tiktoken() -> Any:
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise ImportError(
            "the gpt2 tokenizer needs tiktoken: pip install tiktoken "
            "(or pip install 'qkv[gpt2]'); the 'bytes' tokenizer needs nothing"
        ) from None
    return tiktoken


def _sha256(path: Path) -> str:
    with open_regular(path, "GPT-2 BPE file") as f:
        return hashlib.sha256(f.read()).hexdigest()


@lru_cache(maxsize=4)
def _encoding_from_files(bpe_dir: str, stamp: tuple[int, ...],
                         names: tuple[str, str] = BPE_FILES) -> Any:
    """Build the GPT-2 ``tiktoken.Encoding`` from the data-gym files in ``bpe_dir``.

    ``stamp`` (the files' sizes and modification times) is part of the cache key only, so
    an edited file is read again instead of served from the cache.
    """
    tiktoken = _import_tiktoken()
    folder = Path(bpe_dir)
    encoder_json, vocab_bpe = folder / names[0], folder / names[1]
    try:
        # tiktoken keeps a copy of every file it reads in its own cache, keyed by the path
        # alone; passing the content hashes makes it notice when the file has changed.
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(vocab_bpe),
            encoder_json_file=str(encoder_json),
            vocab_bpe_hash=_sha256(vocab_bpe),
            encoder_json_hash=_sha256(encoder_json),
        )
    except (AssertionError, KeyError, ValueError, UnicodeDecodeError, RecursionError) as err:
        # tiktoken asserts that the merges reproduce encoder.json exactly.
        raise ValueError(
            f"{encoder_json} and {vocab_bpe} are not a matching GPT-2 BPE pair "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'mismatch'})"
        ) from None
    # In GPT-2's files the end-of-text id directly follows the 50,256 mergeable tokens.
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: len(ranks)},
    )


def _gpt2_from_dir(bpe_dir: str | Path) -> GPT2Tokenizer:
    folder = Path(bpe_dir).expanduser().resolve()
    names = BPE_FILES
    if not any((folder / name).is_file() for name in BPE_FILES) and all(
            (folder / name).is_file() for name in HF_BPE_FILES):
        names = HF_BPE_FILES  # a Hugging Face folder: vocab.json + merges.txt
    for name in names:  # a FIFO, a device or a directory there: said as what it is
        if os.path.lexists(folder / name):
            regular_file_stat(folder / name, "GPT-2 BPE file")
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"GPT-2 BPE files not found in {folder}: missing {', '.join(missing)} "
            f"; pass --bpe-dir DIR (or set ${BPE_DIR_ENV}) to a folder holding encoder.json "
            "and vocab.bpe"
        )
    stats = [(folder / name).stat() for name in names]
    for name, st in zip(names, stats, strict=True):
        # GPT-2's files are 1.0 MB and 0.5 MB; the folder may come from a checkpoint's
        # settings, so a huge or special file there is refused before it is read.
        if st.st_size > MAX_BPE_FILE_BYTES:
            raise ValueError(f"{folder / name} is {st.st_size:,} bytes; GPT-2's BPE files are "
                             f"far smaller (at most {MAX_BPE_FILE_BYTES:,} bytes accepted)")
    stamp = tuple(v for st in stats for v in (st.st_size, st.st_mtime_ns))
    return GPT2Tokenizer(_encoding_from_files(str(folder), stamp, names))


def get_tokenizer(name: str = "gpt2", *, bpe_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer called ``name``: ``"gpt2"`` or ``"bytes"``.

    Args:
        name: ``"gpt2"`` (GPT-2 BPE via tiktoken, 50,257 ids, ``<|endoftext|>`` = 50256) or
            ``"bytes"`` (:class:`ByteTokenizer`, 257 ids).
        bpe_dir: for ``"gpt2"``, a folder with GPT-2's ``encoder.json`` and ``vocab.bpe``
            (or a Hugging Face folder's ``vocab.json`` and ``merges.txt``, the same files
            under other names); the encoding is then built from those files with no
            network access. Defaults to
            ``$QKV_BPE_DIR``; with neither, ``tiktoken.get_encoding("gpt2")`` is used, which
            downloads the files once into tiktoken's cache. Ignored for ``"bytes"``.

    Raises:
        ValueError: unknown name, or BPE files that do not match each other.
        FileNotFoundError: ``bpe_dir`` lacks one of the two files.
        ImportError: ``"gpt2"`` without tiktoken installed.
    """
    if name == "bytes":
        return ByteTokenizer()
    if name != "gpt2":
        raise ValueError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZER_NAMES)}")
    if bpe_dir is None:
        bpe_dir = os.environ.get(BPE_DIR_ENV) or None
    if bpe_dir is not None:
        return _gpt2_from_dir(bpe_dir)
    tiktoken = _import_tiktoken()
    return GPT2Tokenizer(tiktoken.get_encoding("gpt2"))


def tokenizer_from_dict(d: Mapping[str, Any], *, bpe_dir: str | Path | None = None) -> Tokenizer:
    """Rebuild a tokenizer from :meth:`Tokenizer.to_dict` output (e.g. a checkpoint's config).

    Never touches the network: an ``"hf"`` tokenizer is rebuilt from the tokenizer.json
    text its dict holds (checked against the stored SHA-256); a ``"gpt2"`` tokenizer is
    built from the BPE files in ``bpe_dir`` (or ``$QKV_BPE_DIR``), and without either it
    is a one-line ``ValueError`` saying so. (Folders are machine-specific, so the dict
    does not store one.) The stored ``n_vocab`` and ``eot_token`` are checked against the
    rebuilt tokenizer, so a model never silently meets the wrong ids.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"tokenizer must be a dict like {{'name': 'bytes', 'n_vocab': 257, "
                         f"'eot_token': 256}}, got {show(d)}")
    if d.get("name") == HF_TOKENIZER_NAME:
        return _hf_from_dict(d)
    unknown = sorted(str(k) for k in set(d) - {"name", "n_vocab", "eot_token"})
    if unknown:
        raise ValueError(f"tokenizer has unknown key(s) {', '.join(map(show, unknown[:5]))}; "
                         "valid: name, n_vocab, eot_token")
    if "name" not in d:
        raise ValueError("tokenizer dict needs a 'name' (one of "
                         f"{', '.join((*TOKENIZER_NAMES, HF_TOKENIZER_NAME))})")
    name = check_str("tokenizer name", d["name"], choices=(*TOKENIZER_NAMES, HF_TOKENIZER_NAME))
    n_vocab = check_int("tokenizer n_vocab", d.get("n_vocab"), 1, MAX_SIZE) \
        if "n_vocab" in d else None
    eot = d.get("eot_token")
    if eot is not None:
        check_int("tokenizer eot_token", eot, 0, MAX_SIZE)
    if name == "bytes":
        tok: Tokenizer = ByteTokenizer(eot=d.get("eot_token", 256) is not None)
    else:
        if bpe_dir is None:
            bpe_dir = os.environ.get(BPE_DIR_ENV) or None
        if bpe_dir is None:
            raise ValueError(
                "the gpt2 tokenizer is rebuilt offline from GPT-2's encoder.json and vocab.bpe: "
                f"pass --bpe-dir DIR (or set ${BPE_DIR_ENV}) to a folder holding them"
            )
        tok = _gpt2_from_dir(bpe_dir)
    for key, saved in (("n_vocab", n_vocab), ("eot_token", eot)):
        if key in d and saved != getattr(tok, key):
            raise ValueError(
                f"tokenizer {name!r} was saved with {key}={saved} but rebuilds with "
                f"{key}={getattr(tok, key)}; check bpe_dir / ${BPE_DIR_ENV}"
            )
    return tok
