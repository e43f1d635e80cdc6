"""Sentence-pair data for seq2seq translation (the d2l English->French pipeline).

The pipeline, from raw text to batches:

    text = load_corpus(path)                       # "go.\tva !\n..." (one pair a line)
    src, tgt = read_pairs(preprocess(text), 600)   # [["go", "."], ...], [["va", "!"], ...]
    data = TranslationData.from_pairs(src, tgt, num_steps=10)
    for X, X_valid_len, Y, Y_valid_len in data.train_loader(64):
        ...                                        # X, Y: (batch, num_steps) int64

Each sentence gets `<eos>` appended, is mapped to ids and is truncated or padded with `<pad>`
to `num_steps`; `valid_len` (batch,) counts the tokens that are not padding, which is what the
masked softmax and the masked loss need. `load_data_nmt` is the one-call version with d2l's
name and return value, and `download_fra_eng` fetches the Tatoeba fra-eng corpus, verifying
the HTTP status and the SHA-1 (the reference saved whatever the server returned).
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, overload

import torch
from torch.utils.data import DataLoader, TensorDataset

from ..checks import MAX_COUNT, show
from ..options import SPLIT_BY
from .loading import batch_loader
from .textfile import TextFile, lines

FRA_ENG_URL = "http://d2l-data.s3-accelerate.amazonaws.com/fra-eng.zip"
FRA_ENG_SHA1 = "94646ad1522d915e7b0f9296181140edcf86a4f5"

UNK = "<unk>"
PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
RESERVED_TOKENS = (PAD, BOS, EOS)

# A batch, or a whole split: (src, src_valid_len, tgt, tgt_valid_len),
# shapes (n, num_steps), (n,), (n, num_steps), (n,), all int64.
Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
TokenLines = list[list[str]]


# ----------------------------------------------------------------------------
# Text -> token lists


def preprocess(text: str) -> str:
    """Normalise raw corpus text so that splitting on spaces gives sensible tokens.

    No-break spaces (U+202F, U+00A0, common in French typography) become spaces, everything
    is lower-cased, and a space is inserted before `, . ! ?` unless one is already there, so
    that "go." splits into "go" and ".". A mark at position 0 is left alone.
    """
    text = text.replace("\u202f", " ").replace("\xa0", " ").lower()
    out = []
    for i, char in enumerate(text):
        # Look at the *original* previous character, so "..." becomes " . . ." (3 tokens).
        if i > 0 and char in ",.!?" and text[i - 1] != " ":
            out.append(" ")
        out.append(char)
    return "".join(out)


def detokenize(tokens: Sequence[str]) -> str:
    """Token list -> text as a person writes it: the inverse of :func:`preprocess`'s split.

    ``["va", "!"] -> "va!"``, ``["hello", ",", "tom", "."] -> "hello, tom."``: the space
    :func:`preprocess` inserted before ``, . ! ?`` is removed. (Case and no-break spaces
    are not restored.) Used to score translations with sacreBLEU on detokenised text.
    """
    out: list[str] = []
    for token in tokens:
        if out and token in {",", ".", "!", "?"}:
            out[-1] += token
        else:
            out.append(token)
    return " ".join(out)


def read_pairs(text: str, num_examples: int | None = None) -> tuple[TokenLines, TokenLines]:
    """Split `source<TAB>target[<TAB>ignored...]` lines into token lists.

    Tokens are separated by spaces (empty tokens are dropped). Lines with fewer than two
    columns, or with an empty side, are skipped. The text is used as is: call `preprocess`
    first for raw corpus text. `<eos>` is *not* appended here (`build_array` does that).

    Args:
        text: the corpus, one pair per line.
        num_examples: keep exactly the first this many pairs (None: all of them).

    Returns:
        (source, target): two lists of the same length n, each item a list of tokens.
    """
    return _pairs_of_lines(text.split("\n"), num_examples)


def _pairs_of_lines(
    rows: Iterable[str], num_examples: int | None, *, preprocessed: bool = True
) -> tuple[TokenLines, TokenLines]:
    """:func:`read_pairs` on lines (each preprocessed first unless ``preprocessed``)."""
    if num_examples is not None and num_examples < 0:
        raise ValueError(f"num_examples must be >= 0 or None, got {num_examples}")
    source: TokenLines = []
    target: TokenLines = []
    # One string object per distinct token rather than per occurrence: a corpus of 200k
    # pairs repeats its few thousand words millions of times, and each copy costs ~50
    # bytes where a shared one costs a pointer.
    shared: dict[str, str] = {}
    for line in rows:
        # Stop *before* reading pair num_examples + 1 (the reference's loop read one extra).
        if num_examples is not None and len(source) >= num_examples:
            break
        if not preprocessed:
            line = preprocess(line)
        parts = line.rstrip("\r").split("\t")
        if len(parts) < 2:
            continue
        src = [shared.setdefault(tok, tok) for tok in parts[0].split(" ") if tok]
        tgt = [shared.setdefault(tok, tok) for tok in parts[1].split(" ") if tok]
        if src and tgt:
            source.append(src)
            target.append(tgt)
    return source, target


# The longest line a pair file may have: a sentence pair is a few hundred characters; a
# file without newlines (a binary file, a sparse file of zeros) is refused at this length
# instead of being held whole.
MAX_LINE_CHARS = 2**20


def read_pair_file(
    path: str | os.PathLike[str],
    num_examples: int | None = None,
    *,
    sha256: str | None = None,
    max_chars: int | None = None,
) -> tuple[TokenLines, TokenLines, str]:
    """``read_pairs(preprocess(load_corpus(path)), num_examples)`` and the file's SHA-256,
    streamed: the file is read a megabyte at a time and only the pairs are kept.

    The pairs are those of the whole-text pipeline: :func:`preprocess` treats each line
    alone as it would inside the text (a line's first character differs only by a space
    the split drops). The whole file is hashed even when ``num_examples`` pairs come
    first; ``sha256`` is checked as in :func:`read_corpus`. A line longer than
    :data:`MAX_LINE_CHARS`, or lines holding more than ``max_chars`` characters before
    ``num_examples`` pairs are read (the most whose pairs fit in memory), are a one-line
    ``ValueError``, raised before more is kept.
    """
    source = TextFile(path, "corpus file")
    pieces = source.pieces()
    read = lines(pieces, max_chars=MAX_LINE_CHARS, what=f"corpus file {source.path}")
    if max_chars is not None:
        read = _at_most(read, max_chars, source.path)
    src, tgt = _pairs_of_lines(read, num_examples, preprocessed=False)
    for _ in pieces:  # the rest of the file, for its digest
        pass
    assert source.sha256 is not None
    _check_digest(source.path, source.sha256, sha256)
    return src, tgt, source.sha256


def _at_most(rows: Iterable[str], max_chars: int, path: Path) -> Iterator[str]:
    """``rows``, until more than ``max_chars`` characters have come: then a ValueError."""
    total = 0
    for number, line in enumerate(rows, 1):
        total += len(line) + 1
        if total > max_chars:
            raise ValueError(
                f"corpus file {path}: its first {number:,} lines hold {total:,} characters, "
                f"more than the {max_chars:,} whose pairs fit in memory; keep fewer pairs")
        yield line


def load_corpus(path: str | os.PathLike[str]) -> str:
    """Read a UTF-8 corpus file and return its text (a leading byte-order mark is dropped).

    Raises:
        FileNotFoundError: nothing exists at `path`.
        ValueError: `path` is a directory or another non-regular file (a FIFO, a
            device), or the file is not valid UTF-8.
    """
    return read_corpus(path)[0]


class CorpusChangedError(ValueError):
    """A corpus file no longer has the SHA-256 a checkpoint recorded for it."""


def _check_digest(path: Path, digest: str, expected: str | None) -> None:
    if expected is not None and digest != expected:
        raise CorpusChangedError(
            f"corpus file {path} has changed since the run was trained on it: its SHA-256 is "
            f"{digest[:16]}..., the checkpoint recorded {expected[:16]}...; restore that file"
        )


def read_corpus(
    path: str | os.PathLike[str], *, sha256: str | None = None
) -> tuple[str, str]:
    """`load_corpus`'s text and the SHA-256 (hex) of the file's bytes, from one read.

    A run records the digest of the corpus it was trained on; passing it back as `sha256`
    when the run is evaluated or resumed makes a changed file a one-line
    `CorpusChangedError` instead of silently different data. The path is checked to be a
    regular file before it is opened (:class:`qkv.data.textfile.TextFile`).
    """
    source = TextFile(path, "corpus file")
    text = "".join(source.pieces())
    assert source.sha256 is not None
    _check_digest(source.path, source.sha256, sha256)
    return text, source.sha256


# ----------------------------------------------------------------------------
# Vocabulary


def _flatten(tokens: Iterable[Any]) -> list[str]:
    """Accept a flat list of tokens or a list of token lists (sentences); return a flat list."""
    if isinstance(tokens, str):
        raise TypeError("expected a list of tokens (or of token lists), got a single str")
    flat: list[str] = []
    for item in tokens:
        if isinstance(item, str):
            flat.append(item)
        else:
            flat.extend(item)
    return flat


class Vocab:
    """Token <-> id mapping.

    Ids: 0 is `<unk>`, then `reserved_tokens` in the given order, then the remaining tokens by
    descending frequency. Ties keep the order in which the tokens were first seen, so the same
    corpus always gives the same ids. Tokens seen fewer than `min_freq` times are left out and
    map to `<unk>`.

    Args:
        tokens: a flat list of tokens or a list of token lists.
        min_freq: drop tokens rarer than this.
        reserved_tokens: special tokens placed right after `<unk>`, e.g. `<pad>`, `<bos>`, `<eos>`.
    """

    def __init__(
        self,
        tokens: Iterable[str] | Iterable[Sequence[str]] = (),
        min_freq: int = 0,
        reserved_tokens: Sequence[str] = (),
    ) -> None:
        reserved = list(reserved_tokens)
        if UNK in reserved:
            raise ValueError(f"reserved_tokens must not contain {UNK!r}: it always has id 0")
        if len(set(reserved)) != len(reserved):
            raise ValueError(f"reserved_tokens has duplicates: {reserved}")
        # Counter remembers first-seen order and sorted() is stable (also with reverse=True),
        # which is what makes frequency ties deterministic.
        counter = collections.Counter(_flatten(tokens))
        token_freqs = sorted(counter.items(), key=lambda kv: kv[1], reverse=True)
        idx_to_token = [UNK, *reserved]
        seen = set(idx_to_token)
        for token, freq in token_freqs:
            if freq < min_freq:
                break  # sorted by frequency: everything after is rarer still
            if token not in seen:
                idx_to_token.append(token)
                seen.add(token)
        self._set(idx_to_token, token_freqs)

    def _set(self, idx_to_token: list[str], token_freqs: list[tuple[str, int]]) -> None:
        self.idx_to_token: list[str] = idx_to_token
        self.token_to_idx: dict[str, int] = {tok: i for i, tok in enumerate(idx_to_token)}
        # Every token of the corpus with its count, most frequent first (also the rare ones).
        self.token_freqs: list[tuple[str, int]] = token_freqs

    def __len__(self) -> int:
        return len(self.idx_to_token)

    def __contains__(self, token: object) -> bool:
        return token in self.token_to_idx

    @overload
    def __getitem__(self, tokens: str) -> int: ...

    @overload
    def __getitem__(self, tokens: Sequence[str]) -> list[int]: ...

    def __getitem__(self, tokens: str | Sequence[str]) -> int | list[int]:
        """Id of a token (unknown -> `unk`), or a list of ids for a list/tuple of tokens."""
        if isinstance(tokens, str):
            return self.token_to_idx.get(tokens, self.unk)
        return [self[tok] for tok in tokens]

    def to_tokens(self, ids: int | Iterable[Any] | torch.Tensor) -> str | list[Any]:
        """Token(s) for id(s): an int gives a str, a list (or 1-D tensor) gives a list of str.

        Tensors and numpy arrays of any rank are accepted; nested lists come back nested.
        """
        if hasattr(ids, "tolist"):  # torch tensors, numpy arrays and numpy scalars
            ids = ids.tolist()
        if isinstance(ids, int):
            if not 0 <= ids < len(self.idx_to_token):
                raise IndexError(f"token id {ids} out of range for a vocabulary of {len(self)}")
            return self.idx_to_token[ids]
        return [self.to_tokens(i) for i in ids]

    @property
    def unk(self) -> int:
        """Id of `<unk>` (always 0)."""
        return 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; `Vocab.from_dict(v.to_dict())` rebuilds the same ids."""
        return {
            "idx_to_token": list(self.idx_to_token),
            "token_freqs": [[tok, freq] for tok, freq in self.token_freqs],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | Sequence[str]) -> Vocab:
        """Rebuild a vocabulary from `to_dict()` output (or from a bare `idx_to_token` list).

        Raises:
            ValueError: `idx_to_token` is not a list of unique strings starting with `<unk>`,
                or `token_freqs` is not a list of `[token, count]` pairs.
        """
        if isinstance(d, Mapping):
            unknown = sorted(str(k) for k in set(d) - {"idx_to_token", "token_freqs"})
            if unknown:
                raise ValueError(f"vocabulary has unknown key(s) {', '.join(map(show, unknown))}; "
                                 "valid: idx_to_token, token_freqs")
            idx_to_token = d.get("idx_to_token")
            raw_freqs = d.get("token_freqs", [])
        elif isinstance(d, list):
            idx_to_token, raw_freqs = d, []
        else:
            raise ValueError(f"vocabulary must be a dict or a list, got {show(d)}")
        if not isinstance(idx_to_token, list) or not all(
            isinstance(tok, str) for tok in idx_to_token
        ):
            raise ValueError(f"vocabulary 'idx_to_token' must be a list of strings, "
                             f"got {show(idx_to_token)}")
        if not idx_to_token or idx_to_token[0] != UNK:
            raise ValueError(f"vocabulary 'idx_to_token' must have {UNK!r} at index 0")
        seen: set[str] = set()
        for tok in idx_to_token:
            if tok in seen:
                raise ValueError(f"vocabulary 'idx_to_token' has a duplicate token {show(tok)}")
            seen.add(tok)
        token_freqs = []
        for pair in raw_freqs if isinstance(raw_freqs, list) else [None]:
            ok = (
                isinstance(pair, (list, tuple))
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], int)
                and not isinstance(pair[1], bool)
                and 0 <= pair[1] <= MAX_COUNT
            )
            if not ok:
                raise ValueError("vocabulary 'token_freqs' must be a list of [token, count] "
                                 f"pairs with counts in [0, {MAX_COUNT}], found {show(pair)}")
            token_freqs.append((pair[0], pair[1]))
        vocab = cls()
        vocab._set(list(idx_to_token), token_freqs)
        return vocab

    def __repr__(self) -> str:
        head = ", ".join(repr(t) for t in self.idx_to_token[:6])
        more = ", ..." if len(self) > 6 else ""
        return f"Vocab(size={len(self)}, tokens=[{head}{more}])"


# ----------------------------------------------------------------------------
# Token lists -> fixed-length id tensors


def truncate_pad(line: list[int], num_steps: int, padding_token: int) -> list[int]:
    """Cut `line` to `num_steps` ids, or pad it on the right with `padding_token`."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if len(line) > num_steps:
        return list(line[:num_steps])
    return list(line) + [padding_token] * (num_steps - len(line))


def build_array(
    lines: list[list[str]], vocab: Vocab, num_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn token lists into a padded id matrix.

    Each line gets `<eos>` appended, is mapped to ids, then truncated or padded with `<pad>`.

    Returns:
        array: (n, num_steps) int64 ids.
        valid_len: (n,) int64, the number of non-pad tokens per row (`<eos>` included unless
            truncated away).
    """
    for special in (PAD, EOS):
        if special not in vocab:
            raise ValueError(f"vocabulary has no {special!r} token (pass it in reserved_tokens)")
    pad, eos = vocab[PAD], vocab[EOS]
    rows = [truncate_pad([*vocab[line], eos], num_steps, pad) for line in lines]
    array = torch.tensor(rows, dtype=torch.long).reshape(len(lines), num_steps)
    # Count by length rather than by comparing with <pad>: a literal "<pad>" typed in the text
    # must not shorten the row, since masks treat positions < valid_len as real tokens.
    valid_len = torch.tensor([min(len(line) + 1, num_steps) for line in lines], dtype=torch.long)
    return array, valid_len


# ----------------------------------------------------------------------------
# Dataset


def num_held_out(held_out: float | int, n: int) -> int:
    """How many of `n` pairs go to the held-out split (`held_out`: a fraction or a count)."""
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float)):
        raise TypeError(f"held_out must be a fraction (float) or a count (int), got {held_out!r}")
    if isinstance(held_out, int):
        k = held_out
    else:
        if not 0.0 <= held_out < 1.0:
            raise ValueError(f"held_out as a fraction must be in [0, 1), got {held_out}")
        k = round(held_out * n)
    if not 0 <= k < n:
        raise ValueError(f"held_out={held_out!r} leaves no training pairs out of {n}")
    return k



def held_out_indices(
    src_tokens: Sequence[Sequence[str]], held_out: float | int, *, seed: int = 0,
    by: str = "pair",
) -> list[int]:
    """The sorted indices of the pairs to hold out: a random choice under ``seed``.

    ``held_out`` is a fraction or a count of pairs (see :func:`num_held_out`).
    ``by="pair"`` draws pairs; ``by="source"`` draws distinct source sentences and holds
    out every pair of each one drawn, until at least that many pairs are held out, so
    that no held-out sentence is ever seen in training with another translation
    (corpora such as Tatoeba give one sentence several). The training split keeps at
    least one pair.
    """
    if by not in SPLIT_BY:
        raise ValueError(f"split by must be one of {', '.join(SPLIT_BY)}; got {by!r}")
    n = len(src_tokens)
    k = num_held_out(held_out, n)
    generator = torch.Generator().manual_seed(seed)
    if by == "pair":
        return sorted(torch.randperm(n, generator=generator)[:k].tolist())
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, tokens in enumerate(src_tokens):
        groups.setdefault(tuple(tokens), []).append(i)
    members = list(groups.values())
    chosen: list[int] = []
    for g in torch.randperm(len(members), generator=generator).tolist():
        if len(chosen) >= k:
            break
        if len(chosen) + len(members[g]) < n:  # never the whole corpus
            chosen += members[g]
    return sorted(chosen)


@dataclass
class TranslationData:
    """Both vocabularies and the tensors of a train and a held-out split.

    `train` and `valid` are `(src, src_valid_len, tgt, tgt_valid_len)` with shapes
    `(n, num_steps), (n,), (n, num_steps), (n,)`, int64; `valid` has n = 0 when nothing was
    held out. `train_pairs` / `valid_pairs` keep the token lists (without `<eos>`) the tensors
    were built from, e.g. to compute BLEU on the held-out sentences.
    """

    src_vocab: Vocab
    tgt_vocab: Vocab
    num_steps: int
    train: Split
    valid: Split
    train_pairs: list[tuple[list[str], list[str]]] = field(default_factory=list, repr=False)
    valid_pairs: list[tuple[list[str], list[str]]] = field(default_factory=list, repr=False)
    # SHA-256 of the corpus file the pairs were read from, for whoever reads them (None:
    # generated data, or not recorded); a checkpoint stores it to detect a changed corpus.
    corpus_sha256: str | None = None

    @classmethod
    def from_pairs(
        cls,
        src_tokens: list[list[str]],
        tgt_tokens: list[list[str]],
        *,
        num_steps: int = 10,
        min_freq: int = 2,
        held_out: float | int = 0.0,
        seed: int = 0,
        split_by: str = "pair",
        src_vocab: Vocab | None = None,
        tgt_vocab: Vocab | None = None,
    ) -> TranslationData:
        """Split the pairs, build vocabularies on the training split, and tensorise both splits.

        Args:
            src_tokens, tgt_tokens: token lists as returned by `read_pairs` (same length n).
            num_steps: length every sequence is truncated or padded to.
            min_freq: vocabulary cut-off (ignored for a vocabulary that is passed in).
            held_out: fraction in [0, 1) or number of pairs to hold out for validation.
            seed: the held-out pairs are a random subset chosen under this seed; both splits
                keep the corpus order, so held_out=0 gives the corpus in its original order.
            split_by: ``"pair"`` or ``"source"``: hold out whole source sentences, every
                translation of each (see :func:`held_out_indices`).
            src_vocab, tgt_vocab: reuse these (e.g. from a checkpoint) instead of building new
                ones; they must contain `<pad>` and `<eos>`.
        """
        if len(src_tokens) != len(tgt_tokens):
            raise ValueError(f"got {len(src_tokens)} source and {len(tgt_tokens)} target sentences")
        n = len(src_tokens)
        if n == 0:
            raise ValueError("no sentence pairs to build a dataset from")
        valid_idx = held_out_indices(src_tokens, held_out, seed=seed, by=split_by)
        held = set(valid_idx)
        train_idx = [i for i in range(n) if i not in held]
        train_pairs = [(src_tokens[i], tgt_tokens[i]) for i in train_idx]
        valid_pairs = [(src_tokens[i], tgt_tokens[i]) for i in valid_idx]
        # Vocabularies see the training split only, so held-out scores are honest about
        # unknown words.
        if src_vocab is None:
            src_vocab = Vocab([s for s, _ in train_pairs], min_freq, RESERVED_TOKENS)
        if tgt_vocab is None:
            tgt_vocab = Vocab([t for _, t in train_pairs], min_freq, RESERVED_TOKENS)

        def tensorise(pairs: list[tuple[list[str], list[str]]]) -> Split:
            src, src_len = build_array([s for s, _ in pairs], src_vocab, num_steps)
            tgt, tgt_len = build_array([t for _, t in pairs], tgt_vocab, num_steps)
            return src, src_len, tgt, tgt_len

        return cls(
            src_vocab=src_vocab,
            tgt_vocab=tgt_vocab,
            num_steps=num_steps,
            train=tensorise(train_pairs),
            valid=tensorise(valid_pairs),
            train_pairs=train_pairs,
            valid_pairs=valid_pairs,
        )

    def train_loader(
        self, batch_size: int, shuffle: bool = True, generator: torch.Generator | None = None
    ) -> DataLoader:
        """Batches `(src, src_valid_len, tgt, tgt_valid_len)` of the training split.

        Pass a seeded `generator` for a reproducible shuffle.
        """
        return batch_loader(TensorDataset(*self.train), batch_size, shuffle=shuffle,
                            generator=generator)

    def valid_loader(self, batch_size: int) -> DataLoader:
        """Batches of the held-out split, in order (empty when nothing was held out)."""
        return batch_loader(TensorDataset(*self.valid), batch_size)


def load_data_nmt(
    batch_size: int,
    num_steps: int,
    num_examples: int = 600,
    path: str | os.PathLike[str] | None = None,
) -> tuple[DataLoader, Vocab, Vocab]:
    """d2l's one-call loader: `(train_iter, src_vocab, tgt_vocab)` for the first pairs.

    Reads `path` (a `source<TAB>target` file), or downloads fra-eng when `path` is None,
    keeps exactly `num_examples` pairs and builds vocabularies with `min_freq=2`. Batches are
    `(X, X_valid_len, Y, Y_valid_len)` with X, Y of shape (batch_size, num_steps), shuffled.
    """
    corpus = Path(path) if path is not None else download_fra_eng()
    src, tgt = read_pairs(preprocess(load_corpus(corpus)), num_examples)
    data = TranslationData.from_pairs(src, tgt, num_steps=num_steps, min_freq=2)
    return data.train_loader(batch_size), data.src_vocab, data.tgt_vocab


# ----------------------------------------------------------------------------
# Download (status and hash checked, atomic writes, safe extraction)


class DownloadError(OSError, RuntimeError):
    """A download failed: network error, HTTP status other than 200, wrong SHA-1, bad zip.

    An ``OSError`` (the CLI reports those as one line) and, as it always was, a
    ``RuntimeError``.
    """


def default_cache_dir() -> Path:
    """`$QKV_CACHE` if set, else `~/.cache/qkv`."""
    env = os.environ.get("QKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qkv"


def _sha1_of(path: Path) -> str:
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(url: str, dest: Path, sha1: str, timeout: float) -> None:
    """Download `url` to `dest`; `dest` only ever appears complete and with the right hash."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The temp file lives next to `dest` so that os.replace is a same-filesystem atomic rename.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha1()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as resp:
                    status = getattr(resp, "status", None)
                    if status is not None and status != 200:
                        raise DownloadError(f"cannot download {url}: HTTP status {status}")
                    while chunk := resp.read(1 << 16):
                        digest.update(chunk)
                        out.write(chunk)
            except urllib.error.HTTPError as e:  # urlopen raises this for 4xx/5xx
                raise DownloadError(
                    f"cannot download {url}: the server answered HTTP {e.code} {e.reason}"
                ) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                reason = getattr(e, "reason", None) or e
                raise DownloadError(
                    f"cannot download {url}: the network failed ({reason})"
                ) from None
            except http.client.HTTPException as e:  # e.g. the connection dropped mid-body
                raise DownloadError(
                    f"cannot download {url}: the network failed ({type(e).__name__} {e})"
                ) from None
        got = digest.hexdigest()
        if got != sha1.lower():
            raise DownloadError(f"SHA-1 mismatch for {url}: expected {sha1.lower()}, got {got}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _extract(zip_path: Path, dest_dir: Path) -> None:
    """Extract `zip_path` under `dest_dir`, refusing members that would land outside it."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            members = zf.infolist()
            for info in members:  # check everything before writing anything
                parts = PurePosixPath(info.filename.replace("\\", "/")).parts
                unsafe = (
                    not parts
                    or info.filename.startswith(("/", "\\"))
                    or ".." in parts
                    or ":" in parts[0]  # a Windows drive such as "C:"
                )
                if unsafe:
                    raise DownloadError(
                        f"refusing to extract unsafe member {info.filename!r} from {zip_path}"
                    )
            for info in members:
                target = dest_dir.joinpath(*PurePosixPath(info.filename.replace("\\", "/")).parts)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
                try:
                    with zf.open(info) as src, os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(src, out)
                    os.replace(tmp_name, target)  # a half-extracted file is never visible
                finally:
                    Path(tmp_name).unlink(missing_ok=True)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{zip_path} is not a valid zip archive: {e}") from e


def _fra_eng_paths(cache_dir: str | os.PathLike[str] | None, url: str) -> tuple[Path, Path]:
    """Where the zip of `url` and its extracted `fra-eng/fra.txt` live in the cache."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    zip_name = PurePosixPath(urllib.parse.urlparse(url).path).name or "fra-eng.zip"
    return cache / zip_name, cache / "fra-eng" / "fra.txt"


def download_fra_eng(
    cache_dir: str | os.PathLike[str] | None = None,
    url: str = FRA_ENG_URL,
    sha1: str = FRA_ENG_SHA1,
    *,
    timeout: float = 60.0,
) -> Path:
    """Fetch (once) and unpack the fra-eng corpus; return the path of `fra-eng/fra.txt`.

    A cached zip whose SHA-1 matches is reused without touching the network, and so is a
    `fra-eng/fra.txt` put in the cache by hand when there is no zip. Otherwise the zip is
    downloaded, its HTTP status and SHA-1 are checked, and it is moved into the cache
    atomically before being extracted.

    Args:
        cache_dir: where the zip and the extracted folder live (default: `default_cache_dir()`).
        url, sha1: source of the archive and its expected SHA-1 (hex).
        timeout: seconds to wait on the network before giving up.

    Raises:
        DownloadError: network failure, HTTP status other than 200, SHA-1 mismatch, a corrupt
            or unsafe archive, or an archive without `fra-eng/fra.txt`; one line that says
            where to put the file instead.
    """
    zip_path, txt_path = _fra_eng_paths(cache_dir, url)
    cache = zip_path.parent
    try:
        if zip_path.is_file() and _sha1_of(zip_path) == sha1.lower():
            if not txt_path.is_file():
                _extract(zip_path, cache)
        elif txt_path.is_file() and not zip_path.exists():
            return txt_path  # placed there by hand, as the error below suggests
        else:
            _fetch(url, zip_path, sha1, timeout)
            _extract(zip_path, cache)  # re-extract: the old text may come from another archive
        if not txt_path.is_file():
            raise DownloadError(f"{zip_path} does not contain fra-eng/fra.txt")
    except DownloadError as e:
        raise DownloadError(
            f"{e}; instead, put fra.txt (tab-separated source<TAB>target lines) at {txt_path}, "
            "or pass --data PATH to such a file"
        ) from None
    return txt_path


def cached_fra_eng(
    cache_dir: str | os.PathLike[str] | None = None,
    url: str = FRA_ENG_URL,
    sha1: str = FRA_ENG_SHA1,
) -> Path:
    """The cached fra-eng corpus, never downloaded: what evaluating or resuming a run uses.

    Raises:
        FileNotFoundError: the cache holds neither `fra-eng/fra.txt` nor a zip with the
            right SHA-1; one line naming the path to fill.
    """
    zip_path, txt_path = _fra_eng_paths(cache_dir, url)
    if not txt_path.is_file() and zip_path.is_file() and _sha1_of(zip_path) == sha1.lower():
        _extract(zip_path, zip_path.parent)
    if not txt_path.is_file():
        raise FileNotFoundError(
            f"the fra-eng corpus is not in the cache: {txt_path} is missing, and qkv downloads "
            "it only when asked to with --data fra-eng; put fra.txt (tab-separated "
            "source<TAB>target lines) there, or pass --data PATH to such a file"
        )
    return txt_path
