"""qkv.data.tokenizers: bytes, GPT-2 BPE built offline from data-gym files, save/restore.

A tiny BPE in GPT-2's file format is written by the tests themselves, so the GPT-2 code path
runs everywhere; the real GPT-2 files are checked when ../shared/data is present. Nothing
here may download: tiktoken.get_encoding is replaced by a function that fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from qkv.data.tokenizers import (
    BPE_DIR_ENV,
    ENDOFTEXT,
    ByteTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    get_tokenizer,
    tokenizer_from_dict,
)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"



def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# ----------------------------------------------------------------------------
# A tiny BPE in GPT-2's data-gym format


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in the order of its encoder ids.

    Printable bytes map to themselves; the others (space, controls, ...) are shifted to
    chr(256 + n) so that no token string contains whitespace.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    # encoder ids: printable bytes first, then the shifted ones, each in byte order
    return dict(sorted(table.items(), key=lambda kv: (kv[0] not in printable, kv[0])))


MERGES = ["h e", "t he", "Ġ the", "a n", "an d", "Ġ and", "Ġ c", "a t", "Ġc at"]


def write_tiny_bpe(folder: Path, merges: list[str] = MERGES) -> Path:
    table = bytes_to_unicode()
    encoder = {char: i for i, char in enumerate(table.values())}
    for merge in merges:
        encoder["".join(merge.split())] = len(encoder)
    encoder[ENDOFTEXT] = len(encoder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    (folder / "vocab.bpe").write_text(
        "#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8"
    )
    return folder


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    return write_tiny_bpe(tmp_path / "bpe")


def byte_id(char: str) -> int:
    return list(bytes_to_unicode()).index(ord(char))


# ----------------------------------------------------------------------------
# Bytes


def test_byte_tokenizer_round_trip_and_eot():
    tok = get_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.n_vocab, tok.eot_token, tok.name) == (257, 256, "bytes")
    text = f"héllo ✓{ENDOFTEXT}next"
    ids = tok.encode(text)
    assert ids[:3] == [104, 0xC3, 0xA9] and 256 in ids and max(ids) < tok.n_vocab
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    # invalid UTF-8 from a model is replaced, never an exception
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"


def test_byte_tokenizer_without_eot():
    tok = ByteTokenizer(eot=False)
    assert (tok.n_vocab, tok.eot_token) == (256, None)
    assert tok.encode(ENDOFTEXT) == list(ENDOFTEXT.encode())
    raises_one_line(ValueError, r"ids must be in range\(0, 256\).*got 256", tok.decode, [256])


# ----------------------------------------------------------------------------
# GPT-2 format, built from files


def test_tiny_bpe_merges_and_round_trip(tiny_dir):
    tok = get_tokenizer("gpt2", bpe_dir=tiny_dir)
    assert isinstance(tok, GPT2Tokenizer)
    n_merges = len(MERGES)
    # ids: 256 bytes, then one per merge, then <|endoftext|>
    assert tok.eot_token == 256 + n_merges and tok.n_vocab == 256 + n_merges + 1
    assert byte_id(" ") == 220  # "Ġ", as in GPT-2's own encoder.json
    ids = tok.encode("the cat and the hat")
    # "the" = merge 1, " cat" = merge 8, " and" = merge 5, " the" = merge 2;
    # " hat" only gets "a t" (merge 7): "Ġ", "h", "at"
    assert ids == [257, 264, 261, 258, 220, byte_id("h"), 263]
    assert tok.decode(ids) == "the cat and the hat"
    text = f"unicode ✓ stays{ENDOFTEXT} the end"
    ids = tok.encode(text)
    assert tok.eot_token in ids and tok.decode(ids) == text


def test_environment_variable_gives_the_folder(tiny_dir, monkeypatch):
    monkeypatch.setenv(BPE_DIR_ENV, str(tiny_dir))
    assert get_tokenizer("gpt2").encode("the") == [257]


def test_edited_files_are_read_again(tmp_path):
    folder = write_tiny_bpe(tmp_path / "bpe")
    assert get_tokenizer("gpt2", bpe_dir=folder).encode("the") == [257]
    write_tiny_bpe(folder, merges=["a t"])
    assert get_tokenizer("gpt2", bpe_dir=folder).encode("the") == [byte_id(c) for c in "the"]


def test_to_dict_round_trip(tiny_dir):
    for tok in (ByteTokenizer(), ByteTokenizer(eot=False)):
        again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
        assert (again.n_vocab, again.eot_token) == (tok.n_vocab, tok.eot_token)
    tok = get_tokenizer("gpt2", bpe_dir=tiny_dir)
    d = tok.to_dict()
    assert d == {"name": "gpt2", "n_vocab": 266, "eot_token": 265}
    assert tokenizer_from_dict(d, bpe_dir=tiny_dir).encode("the cat") == tok.encode("the cat")
    raises_one_line(ValueError, "saved with n_vocab=50257 but rebuilds with n_vocab=266",
                    tokenizer_from_dict, {**d, "n_vocab": 50257}, bpe_dir=tiny_dir)


def test_errors_are_one_line(tmp_path, tiny_dir, monkeypatch):
    msg = raises_one_line(ValueError, "unknown tokenizer 'gpt3'", get_tokenizer, "gpt3")
    assert "gpt2, bytes" in msg
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "vocab.bpe").write_text("#version: 0.2\n")
    raises_one_line(FileNotFoundError, "missing encoder.json",
                    get_tokenizer, "gpt2", bpe_dir=tmp_path / "half")
    raises_one_line(FileNotFoundError, "missing encoder.json, vocab.bpe",
                    get_tokenizer, "gpt2", bpe_dir=tmp_path / "nowhere")
    # merges that do not reproduce encoder.json
    (tiny_dir / "vocab.bpe").write_text("#version: 0.2\nh e\nt he\nx y\n")
    raises_one_line(ValueError, "not a matching GPT-2 BPE pair", get_tokenizer, "gpt2",
                    bpe_dir=tiny_dir)
    raises_one_line(ValueError, "needs a 'name'", tokenizer_from_dict, {})
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if not installed
    raises_one_line(ImportError, "pip install tiktoken", get_tokenizer, "gpt2",
                    bpe_dir=write_tiny_bpe(tmp_path / "other"))


def test_from_dict_never_downloads(tmp_path, monkeypatch):
    """A gpt2 tokenizer is rebuilt from BPE files only; without a folder, one line says how
    to give one (tiktoken.get_encoding, which downloads, fails the test if called)."""
    msg = raises_one_line(ValueError, "pass --bpe-dir DIR", tokenizer_from_dict,
                          {"name": "gpt2", "n_vocab": 50257, "eot_token": 50256})
    assert BPE_DIR_ENV in msg
    folder = write_tiny_bpe(tmp_path / "env")
    monkeypatch.setenv(BPE_DIR_ENV, str(folder))
    assert tokenizer_from_dict({"name": "gpt2"}).n_vocab == 266


@pytest.mark.parametrize(
    "d, match",
    [
        ([1, 2], "tokenizer must be a dict"),
        ({"name": "gpt3"}, "tokenizer name must be one of 'gpt2', 'bytes', 'hf', got 'gpt3'"),
        ({"name": ["bytes"]}, "tokenizer name must be one of"),
        ({"name": "bytes", "n_vocab": True}, r"n_vocab must be an integer in \[1, "),
        ({"name": "bytes", "n_vocab": 10**400}, "n_vocab .* about 401 digits"),
        ({"name": "bytes", "eot_token": "256"}, "eot_token must be an integer"),
        ({"name": "bytes", "n_vocab": 300}, "saved with n_vocab=300 but rebuilds with n_vocab=257"),
        ({"name": "bytes", "merges": []}, "unknown key.*'merges'"),
    ],
)
def test_from_dict_validates(d, match):
    raises_one_line(ValueError, match, tokenizer_from_dict, d)


def test_oversized_bpe_file_is_refused_unread(tmp_path):
    folder = write_tiny_bpe(tmp_path / "big")
    with open(folder / "encoder.json", "r+b") as f:
        f.truncate(65 * 2**20)  # sparse: nothing is written, the size is what counts
    raises_one_line(ValueError, "encoder.json is 68,157,440 bytes", get_tokenizer, "gpt2",
                    bpe_dir=folder)


# ----------------------------------------------------------------------------
# The real GPT-2 files


@pytest.fixture(scope="module")
def gpt2_dir() -> Path:
    folder = SHARED_DATA / "gpt2"
    if not (folder / "encoder.json").is_file():
        pytest.skip("../shared/data/gpt2 is not present")
    pytest.importorskip("tiktoken")
    return folder


def test_real_gpt2_files_reproduce_the_book(gpt2_dir, monkeypatch):
    tok = get_tokenizer("gpt2", bpe_dir=gpt2_dir)
    assert (tok.n_vocab, tok.eot_token) == (50257, 50256)
    text = (SHARED_DATA / "the-verdict.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert len(ids) == 5145 and ids[:5] == [40, 367, 2885, 1464, 1807]
    assert tok.decode(ids) == text
    # LLMs-from-scratch §2.5
    book = "Hello, do you like tea? <|endoftext|> In the sunlit terraces of someunknownPlace."
    ids = tok.encode(book)
    assert ids == [15496, 11, 466, 345, 588, 8887, 30, 220, 50256, 554, 262, 4252, 18250,
                   8812, 2114, 286, 617, 34680, 27271, 13]
    assert tok.decode(ids) == book


def test_byte_tokenizer_keeps_bytes_that_were_not_utf8():
    """A command line's stray bytes reach Python as lone surrogates (PEP 383); the byte
    tokenizer gives back exactly those bytes instead of failing."""
    import os

    from qkv.data.tokenizers import ByteTokenizer

    raw = b"The \xffcat \xfe"
    text = os.fsdecode(raw)  # what sys.argv holds for these bytes on POSIX
    assert ByteTokenizer().encode(text) == list(raw)
    assert ByteTokenizer(eot=False).encode(text + "<|endoftext|>") == list(
        raw + b"<|endoftext|>")
