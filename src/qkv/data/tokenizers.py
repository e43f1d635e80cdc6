"""Tokenizers for GPT-style language modelling: GPT-2's byte-pair encoding, and raw bytes.

Both turn text into a list of integer ids and back, and describe themselves with a small
dict that a checkpoint can store, so a trained model is always paired with its tokenizer:

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
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..checks import MAX_SIZE, check_int, check_str, show
from ..utils.fileio import open_regular, regular_file_stat

__all__ = [
    "BPE_DIR_ENV",
    "ENDOFTEXT",
    "GPT2_EOT_ID",
    "GPT2_PAT_STR",
    "TOKENIZER_NAMES",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "Tokenizer",
    "get_tokenizer",
    "tokenizer_from_dict",
]

ENDOFTEXT = "<|endoftext|>"
GPT2_EOT_ID = 50256
BPE_DIR_ENV = "QKV_BPE_DIR"
TOKENIZER_NAMES = ("gpt2", "bytes")

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

    Never touches the network: a ``"gpt2"`` tokenizer is built from the BPE files in
    ``bpe_dir`` (or ``$QKV_BPE_DIR``), and without either it is a one-line ``ValueError``
    saying so. (Folders are machine-specific, so the dict does not store one.) The stored
    ``n_vocab`` and ``eot_token`` are checked against the rebuilt tokenizer, so a model
    never silently meets the wrong ids.
    """
    if not isinstance(d, Mapping):
        raise ValueError(f"tokenizer must be a dict like {{'name': 'bytes', 'n_vocab': 257, "
                         f"'eot_token': 256}}, got {show(d)}")
    unknown = sorted(str(k) for k in set(d) - {"name", "n_vocab", "eot_token"})
    if unknown:
        raise ValueError(f"tokenizer has unknown key(s) {', '.join(map(show, unknown[:5]))}; "
                         "valid: name, n_vocab, eot_token")
    if "name" not in d:
        raise ValueError(f"tokenizer dict needs a 'name' (one of {', '.join(TOKENIZER_NAMES)})")
    name = check_str("tokenizer name", d["name"], choices=TOKENIZER_NAMES)
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
