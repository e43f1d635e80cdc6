"""UTF-8 text files of any size, read as a stream.

A corpus is never read whole: :class:`TextFile` checks what the path is and its size
before opening it (a FIFO, ``/dev/zero`` or a directory is refused in one line, see
:func:`qkv.utils.fileio.open_regular`), then hands out the text a megabyte at a time,
decoded and normalised exactly as reading the whole file in text mode would (universal
newlines, no leading byte-order mark), while it hashes the raw bytes:

    source = TextFile("story.txt")
    for piece in source.pieces():         # str, about 1 MiB each
        ...
    source.sha256                          # hex digest of the file's bytes, once read

:func:`lines` turns those pieces into lines (bounded in length), and
:func:`tokenizer_pieces` into pieces that a tokenizer encodes to the same ids, piece by
piece, as it would the whole text.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..utils.fileio import open_regular, regular_file_stat

__all__ = [
    "CHUNK_BYTES",
    "MAX_UNCUT_CHARS",
    "TextFile",
    "file_sha256",
    "lines",
    "split_point",
    "tokenizer_pieces",
]

# Bytes read at a time: large enough that the per-read cost vanishes, small enough that
# a few copies of it (raw, decoded, normalised) are nothing beside the model.
CHUNK_BYTES = 2**20


def file_sha256(path: str | os.PathLike[str], what: str = "file") -> str:
    """SHA-256 (hex) of a regular file's bytes, read a chunk at a time."""
    digest = hashlib.sha256()
    with open_regular(path, what) as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class TextFile:
    """A UTF-8 text file, checked to be a regular file, read as a stream of pieces.

    Attributes:
        path, size, mtime_ns: the file and what ``os.stat`` said of it before reading.
        bytes_read: how far :meth:`pieces` has read (for a progress bar).
        sha256: hex digest of the bytes :meth:`pieces` read; None until it has read them all.

    Raises (when built): ``FileNotFoundError`` for a missing path,
    :class:`qkv.utils.fileio.NotRegularFileError` for anything but a regular file; each
    one line naming ``what`` ("text file", "corpus file") and the path.
    """

    def __init__(self, path: str | os.PathLike[str], what: str = "text file") -> None:
        self.path = Path(path)
        self.what = what
        st = regular_file_stat(self.path, what)
        self.size = st.st_size
        self.mtime_ns = st.st_mtime_ns
        self.bytes_read = 0
        self.sha256: str | None = None

    def pieces(self, chunk_bytes: int | None = None) -> Iterator[str]:
        """The text, in pieces of about ``chunk_bytes`` characters, whose concatenation
        is exactly what ``path.read_text(encoding="utf-8")`` (in text mode: ``\\r\\n`` and
        ``\\r`` become ``\\n``) with a leading byte-order mark dropped would give.

        At most :attr:`size` bytes are read (a file that grows meanwhile is read as it
        was). Invalid UTF-8 is a one-line ``ValueError`` giving the byte offset.
        ``chunk_bytes`` defaults to :data:`CHUNK_BYTES`.
        """
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        digest = hashlib.sha256()
        decoder = codecs.getincrementaldecoder("utf-8")()
        left, offset, started, held_cr = self.size, 0, False, False
        with open_regular(self.path, self.what) as f:
            while True:
                data = f.read(min(chunk_bytes, left)) if left else b""
                left -= len(data)
                final = not data
                digest.update(data)
                pending = len(decoder.getstate()[0])  # bytes of a character cut in two
                try:
                    text = decoder.decode(data, final)
                except UnicodeDecodeError as e:
                    where = f"{e.reason} at byte {offset - pending + e.start}"
                    raise ValueError(f"{self.what} is not valid UTF-8 ({where}): "
                                     f"{self.path}") from None
                offset += len(data)
                self.bytes_read = offset
                if held_cr:  # a "\r" that ended the previous piece: "\r\n" may span two
                    text = "\r" + text
                held_cr = not final and text.endswith("\r")
                if held_cr:
                    text = text[:-1]
                if not started and text:
                    started = True
                    text = text.removeprefix("\ufeff")
                text = text.replace("\r\n", "\n").replace("\r", "\n")
                if text:
                    yield text
                if final:
                    break
        self.sha256 = digest.hexdigest()


def lines(pieces: Iterable[str], *, max_chars: int, what: str) -> Iterator[str]:
    """The lines of the text that ``pieces`` make up, without their ``"\\n"``, as
    ``text.split("\\n")`` would give them (a text ending in ``"\\n"`` ends with an empty
    line).

    A line longer than ``max_chars`` is a one-line ``ValueError`` naming ``what`` and the
    line's number, raised before more than about ``max_chars`` characters of it are held.
    """
    partial: list[str] = []
    held = 0
    number = 1
    for piece in pieces:
        parts = piece.split("\n")
        for part in parts[:-1]:
            if held + len(part) > max_chars:
                raise _too_long(what, number, max_chars)
            partial.append(part)
            yield "".join(partial)
            partial, held = [], 0
            number += 1
        held += len(parts[-1])
        if held > max_chars:
            raise _too_long(what, number, max_chars)
        partial.append(parts[-1])
    yield "".join(partial)


def _too_long(what: str, number: int, max_chars: int) -> ValueError:
    return ValueError(f"{what}: line {number:,} is longer than {max_chars:,} characters; "
                      "a pair file holds one 'source<TAB>target' pair per line")


# Where a text can be cut so that a tokenizer gives the same ids for the two parts as
# for the whole, for GPT-2's pre-tokenizer (GPT2_PAT_STR) and for the byte tokenizer:
# before a space between two non-space characters ("a| b": the space always starts the
# next piece, " b"), or after a newline between two non-space characters ("a\n|b": the
# newline is a piece of its own either way). Every other piece of the pattern either
# never contains whitespace or is a whitespace run, which such a cut never splits; the
# special token <|endoftext|> holds no whitespace either. Python's \S excludes every
# character that str.isspace() calls whitespace, a superset of Unicode's White_Space
# that the tokenizer's \s matches. The pattern runs on the reversed text, to find the
# last cut first.
_REVERSED_CUT = re.compile(r"(?<=\S)(?: (?=\S)|(?=\n\S))")


def split_point(text: str, start: int = 0) -> int:
    """The last index ``i > start`` where ``text`` may be cut, for tokenizing
    ``text[:i]`` and ``text[i:]`` separately to give the ids of ``text``; 0 if none."""
    reversed_text = text[: start - 1 if start > 0 else None : -1]
    match = _REVERSED_CUT.search(reversed_text)
    if match is None:
        return 0
    at = match.start()
    # " " at reversed index r is the space at len - 1 - r, which starts the second part;
    # an empty match at r is the boundary len - r, right after the newline.
    cut = len(text) - 1 - at if reversed_text[at] == " " else len(text) - at
    return cut if cut > start else 0


# The longest stretch of text with no place to cut it (see split_point) that
# tokenizer_pieces holds: natural text has one every few characters; a file of
# megabytes without a space or newline between words is not text to learn from.
MAX_UNCUT_CHARS = 16 * 2**20


def tokenizer_pieces(
    pieces: Iterable[str],
    min_chars: int | None = None,
    *,
    max_uncut: int = MAX_UNCUT_CHARS,
    what: str = "text",
) -> Iterator[str]:
    """Regroup text ``pieces`` into pieces of at least ``min_chars`` characters (but the
    last) that end where :func:`split_point` allows, so that encoding each and joining
    the ids gives the ids of the whole text.

    A stretch of more than ``max_uncut`` characters with no such place (a run of
    whitespace, a file of zero bytes, text without spaces or newlines) is a one-line
    ``ValueError`` naming ``what``, raised before more of it is held. ``min_chars``
    defaults to :data:`CHUNK_BYTES`.
    """
    min_chars = min_chars or CHUNK_BYTES
    buffer = ""
    scanned = 0  # no cut lies before this index of buffer
    done = 0  # characters handed out so far
    for piece in pieces:
        buffer += piece
        if len(buffer) < min_chars:
            continue
        cut = split_point(buffer, max(0, scanned - 2))
        if cut == 0:
            if len(buffer) > max_uncut:
                raise ValueError(
                    f"{what} has {len(buffer):,} characters from character {done:,} on "
                    "with no space or newline between two non-space characters, where it "
                    f"could be cut for tokenizing (at most {max_uncut:,} are accepted); "
                    "is it text?")
            scanned = len(buffer)
            continue
        yield buffer[:cut]
        done += cut
        buffer, scanned = buffer[cut:], 0
    if buffer:
        yield buffer
