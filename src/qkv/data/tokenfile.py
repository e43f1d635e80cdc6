"""A text tokenized once, streaming, into a file of ids that training reads as a memmap.

``qkv lm train --text FILE`` never holds the text, nor its ids, in memory: the file is
read a megabyte at a time (:class:`qkv.data.textfile.TextFile`), cut where the tokenizer
cannot tell the difference (:func:`qkv.data.textfile.tokenizer_pieces`), and each piece's
ids are appended to ``tokens.bin`` in the run directory, as raw ``uint16`` (``uint32``
for a vocabulary past 65,536 ids), the way nanoGPT prepares its data. Beside it,
``tokens.json`` records what the ids are of:

    {"format": "qkv-token-ids", "version": 1,
     "tokenizer": {"name": "gpt2", "n_vocab": 50257, "eot_token": 50256},
     "probe": [...], "dtype": "uint16", "count": 5145, "sha256": "<of tokens.bin>",
     "source": {"path": "the-verdict.txt", "bytes": 20479, "mtime_ns": ...,
                "sha256": "<of the text file>"},
     "seconds": 0.01, "tokens_per_second": 514500.0}

(``probe``: the ids of a fixed sentence, which tell two BPE vocabularies of one size
apart.) Training reads windows from ``np.memmap(tokens.bin)``. The next run over the
same text with the same tokenizer (a ``--resume`` above all) reuses the file once the
text's SHA-256 and the ids' SHA-256 match the record: the text is hashed, never
tokenized again. Anything else (another text, another tokenizer, a damaged or missing record) is
tokenized afresh; the record is written last, so a run killed mid-way leaves a file
that the next run does not trust.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..checks import parse_json
from ..utils.fileio import fsync_dir, open_regular, read_regular, temp_path, write_atomic
from .textfile import CHUNK_BYTES, TextFile, file_sha256, tokenizer_pieces
from .tokenizers import HFTokenizer, Tokenizer
from .translate import CorpusChangedError

__all__ = ["TOKENS_FILE", "TOKENS_INFO", "TokenFile", "prepare_token_file"]

TOKENS_FILE = "tokens.bin"
TOKENS_INFO = "tokens.json"
_FORMAT, _VERSION = "qkv-token-ids", 1
_MAX_INFO_BYTES = 2**16
# Encoded into the record: two tokenizers of the same name and size but other merges
# (another BPE folder) give other ids for it, and the ids are then not reused.
_PROBE = ("The quick brown fox's 12,345 jumps -- über naïve café!\n\t  Ünïcödé 字 \U0001f600"
          " <|endoftext|>")


@dataclass
class TokenFile:
    """The ids of a text file, as a read-only memmap, and what is known of them.

    ``ids``: ``(count,)`` ``uint16``/``uint32``; ``sha256``: the text file's digest;
    ``reused``: the file was there already (nothing was tokenized); ``info``: the
    ``tokens.json`` record (``tokens_per_second`` of the run that tokenized it).
    """

    ids: np.ndarray
    sha256: str
    reused: bool
    info: dict[str, Any]


def _dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tokenizer.n_vocab <= 2**16 else np.uint32)


def _read_info(path: Path) -> dict[str, Any] | None:
    """The record, or None if it is missing, not a regular file, too large or not JSON."""
    try:
        info = parse_json(read_regular(path, "token record", _MAX_INFO_BYTES))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _ids_digest(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """SHA-256 of an ids file and its largest id, read a chunk at a time."""
    digest, largest = hashlib.sha256(), -1
    with open_regular(path, "token file") as f:
        while chunk := f.read(CHUNK_BYTES - CHUNK_BYTES % dtype.itemsize):
            digest.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if ids.size:
                largest = max(largest, int(ids.max()))
    return digest.hexdigest(), largest


def _reusable(directory: Path, info: dict[str, Any] | None, digest: str,
              tokenizer: Tokenizer) -> str | None:
    """Why the ids in ``directory`` cannot be reused (None: they can)."""
    if info is None:
        return "no readable record"
    dtype = _dtype(tokenizer)
    source = info.get("source")
    count = info.get("count")
    if (info.get("format") != _FORMAT or info.get("version") != _VERSION
            or not isinstance(source, dict) or source.get("sha256") != digest):
        return "they are of another text"
    if (info.get("tokenizer") != tokenizer.to_dict() or info.get("dtype") != dtype.name
            or info.get("probe") != tokenizer.encode(_PROBE)):
        return "another tokenizer made them"
    path = directory / TOKENS_FILE
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return "the record is damaged"
    try:
        if os.stat(path).st_size != count * dtype.itemsize:
            return f"{TOKENS_FILE} does not have the recorded size"
        ids_digest, largest = _ids_digest(path, dtype)
    except OSError:
        return f"{TOKENS_FILE} cannot be read"
    if ids_digest != info.get("sha256") or largest >= tokenizer.n_vocab:
        return f"{TOKENS_FILE} does not match its record"
    return None


def prepare_token_file(
    text_path: str | os.PathLike[str],
    tokenizer: Tokenizer,
    directory: str | os.PathLike[str],
    *,
    sha256: str | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> TokenFile:
    """The ids of the text file ``text_path``, from ``directory/tokens.bin``: reused when
    it holds this text's ids by this tokenizer, else tokenized (streaming) into it.

    ``sha256``: the digest a run recorded for its text (a resume); a file that no longer
    has it is a one-line :class:`qkv.data.translate.CorpusChangedError` before anything
    is tokenized. ``progress`` shows a tqdm bar on stderr while tokenizing. Memory stays
    bounded by a few megabytes of text and ids, whatever the size of the file (a text
    with a stretch of more than :data:`qkv.data.textfile.MAX_UNCUT_CHARS` characters
    where it cannot be cut for tokenizing is refused: see
    :func:`qkv.data.textfile.tokenizer_pieces`). Measured on a 1 GiB text: 9 MiB (GPT-2
    BPE) and 22 MiB (bytes) above the interpreter's own.

    Raises:
        FileNotFoundError, qkv.utils.fileio.NotRegularFileError: ``text_path`` is not a
            regular file.
        ValueError: the text is not UTF-8, is empty, cannot be cut for tokenizing, or
            changed while it was read.
        OSError: the disk filled up (one line; the partial file is removed).
    """
    log = log or (lambda _: None)
    directory = Path(directory)
    source = TextFile(text_path, "text file")
    info_path, ids_path = directory / TOKENS_INFO, directory / TOKENS_FILE
    dtype = _dtype(tokenizer)
    info = _read_info(info_path)
    # Hashed first only when there is something to check it against: a recorded
    # digest, or ids that may be reused. Otherwise tokenizing hashes it on the way.
    digest = file_sha256(source.path, "text file") if sha256 or info else None
    if sha256 is not None and digest != sha256:
        raise CorpusChangedError(
            f"text file {source.path} has changed since the run was trained on it: its "
            f"SHA-256 is {str(digest)[:16]}..., the checkpoint recorded {sha256[:16]}...; "
            "restore that file")
    why = "no readable record" if digest is None else _reusable(directory, info, digest,
                                                                tokenizer)
    if why is None:
        assert info is not None and digest is not None
        ids = np.memmap(ids_path, dtype=dtype, mode="r", shape=(info["count"],))
        log(f"reusing the {info['count']:,} ids of {source.path} in {ids_path} "
            "(tokenized once already)")
        return TokenFile(ids, digest, True, info)
    if info is not None:
        log(f"tokenizing {source.path} again: the ids in {ids_path} cannot be reused ({why})")
    info = _tokenize(source, tokenizer, ids_path, dtype, progress)
    if digest is not None and info["source"]["sha256"] != digest:
        ids_path.unlink(missing_ok=True)
        raise ValueError(f"text file {source.path} changed while it was being read; "
                         "train on a file that nothing is writing to")
    digest = info["source"]["sha256"]
    write_atomic(info_path, (json.dumps(info, indent=1) + "\n").encode())
    log(f"tokenized {source.path} ({source.size:,} bytes) into {info['count']:,} ids in "
        f"{info['seconds']:.1f} s ({info['tokens_per_second']:,.0f} tokens/s), kept in "
        f"{ids_path}")
    ids = np.memmap(ids_path, dtype=dtype, mode="r", shape=(info["count"],))
    return TokenFile(ids, digest, False, info)


# Characters on each side of a cut that an open model's tokenizer is checked on.
_JUNCTION_CHARS = 256


def _piece_encoder(tokenizer: Tokenizer, what: str) -> Callable[[str], list[int]]:
    """``encode(piece)``: the ids of the next piece of a text, so that the pieces' ids
    joined are the text's.

    The cut points of :func:`qkv.data.textfile.tokenizer_pieces` are proven for GPT-2's
    pre-tokenizer and the byte tokenizer. An open model's tokenizer (:class:`HFTokenizer`)
    has its own pre-tokenizer, so each cut is checked as it is made: the characters
    around it must encode to the same ids whole as in two parts, else the text is
    refused in one line. Its BOS, if it adds one, starts the text once, as a whole
    encode would give it.
    """
    if not isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode
    tail = ""
    count = 0

    def ids_of(text: str) -> list[int]:
        try:
            return tokenizer.encode(text, add_special_tokens=False)
        except ValueError as error:  # one line naming the failing part: say where too
            raise ValueError(f"{what}, from character {count:,}: {error}") from None

    def encode(piece: str) -> list[int]:
        nonlocal tail, count
        ids = ids_of(piece)
        if tail:
            head = piece[:_JUNCTION_CHARS]
            whole = ids_of(tail + head)
            parts = ids_of(tail) + ids_of(head)
            if whole != parts:
                raise ValueError(f"{what}: this tokenizer does not give the same ids for "
                                 f"the text cut at character {count:,} as whole, so it "
                                 "cannot be tokenized in pieces; train on a smaller text")
        elif tokenizer.bos_token_id is not None and \
                tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]:
            ids = [tokenizer.bos_token_id, *ids]
        tail = piece[-_JUNCTION_CHARS:]
        count += len(piece)
        return ids

    return encode


def _tokenize(source: TextFile, tokenizer: Tokenizer, ids_path: Path, dtype: np.dtype,
              progress: bool) -> dict[str, Any]:
    """Write the ids of ``source`` to ``ids_path`` (replaced whole, at the end); the record."""
    ids_path.parent.mkdir(parents=True, exist_ok=True)
    ids_path.unlink(missing_ok=True)  # its record, if any, no longer matches
    ids_path.with_name(TOKENS_INFO).unlink(missing_ok=True)
    tmp = temp_path(ids_path)
    digest, count, has_text = hashlib.sha256(), 0, False
    start = time.perf_counter()
    bar = tqdm(total=source.size, unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress, file=sys.stderr, leave=False)
    try:
        with bar, open(tmp, "wb") as out:
            encode = _piece_encoder(tokenizer, f"text file {source.path}")
            for piece in tokenizer_pieces(source.pieces(), what=f"text file {source.path}"):
                has_text = has_text or not piece.isspace()
                data = np.asarray(encode(piece), dtype=dtype).tobytes()
                out.write(data)
                digest.update(data)
                count += len(data) // dtype.itemsize
                bar.update(source.bytes_read - bar.n)
            out.flush()
            os.fsync(out.fileno())
        if not has_text:
            raise ValueError(f"text file {source.path} is empty")
        os.replace(tmp, ids_path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            most = source.size * dtype.itemsize  # at most one id per byte of text
            raise OSError(
                f"no space left on the disk of {ids_path.parent} for the ids of "
                f"{source.path} (they take up to {most:,} bytes; the partial file was "
                "removed); free some space or choose another --run-dir") from None
        raise
    fsync_dir(ids_path.parent)
    seconds = time.perf_counter() - start
    assert source.sha256 is not None
    return {
        "format": _FORMAT, "version": _VERSION, "tokenizer": tokenizer.to_dict(),
        "probe": tokenizer.encode(_PROBE), "dtype": dtype.name, "count": count,
        "sha256": digest.hexdigest(),
        "source": {"path": str(source.path), "bytes": source.size,
                   "mtime_ns": source.mtime_ns, "sha256": source.sha256},
        "seconds": round(seconds, 3),
        "tokens_per_second": round(count / max(seconds, 1e-9), 1),
    }
