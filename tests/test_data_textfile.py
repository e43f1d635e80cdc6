"""Text files read as streams: the same text, lines, pairs and token ids as reading whole."""

import hashlib
import random

import pytest

from conftest import SHARED_DATA
from qkv.data import textfile
from qkv.data.textfile import TextFile, lines, split_point, tokenizer_pieces
from qkv.data.tokenizers import ENDOFTEXT, get_tokenizer
from qkv.data.translate import load_corpus, preprocess, read_pair_file, read_pairs

SHARED = SHARED_DATA
VERDICT = SHARED / "the-verdict.txt"
FRA = SHARED / "fra-eng" / "fra.txt"
BPE = SHARED / "gpt2"

# Characters and strings that GPT-2's pre-tokenizer treats differently: spaces, runs of
# whitespace of every kind, newlines with spaces around them, contractions, digits,
# punctuation runs, letters of other scripts, emoji, the special token and its halves.
PIECES = [" ", "  ", "\n", "\n\n", "\t", " \n", "\n ", "\u00a0", "\u2028", "\u3000", "\x1c",
          "\x85", "\x00", "a", "b", "Hello", "'s", "'ll", "n't", "123", "4", "!", "?!", ".",
          "\u2014", "\u00e9", "\u5b57", "\u3002", "\U0001f600", ENDOFTEXT, "<|endo", "ftext|>",
          " it's", " the", "'", "\r\n"]


def _text_reference(data: bytes) -> str:
    """How the whole file reads in text mode: universal newlines, no leading BOM."""
    text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    return text.removeprefix("\ufeff")


def _adversarial(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


@pytest.fixture(scope="module")
def tokenizers():
    found = [get_tokenizer("bytes")]
    if (BPE / "encoder.json").is_file():
        pytest.importorskip("tiktoken")
        found.append(get_tokenizer("gpt2", bpe_dir=BPE))
    return found


def _pieces_ids(tokenizer, pieces):
    return [i for piece in pieces for i in tokenizer.encode(piece)]


def test_pieces_are_the_text_read_whole(tmp_path):
    # "\r\n" cut between two chunks, a BOM, a multi-byte character cut between chunks
    data = "\ufeffone\r\ntwo\rthree\r\n\u00e9\u5b57\U0001f600\r".encode() * 5
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    for chunk in (1, 2, 3, 5, 7, 64, 2**20):
        source = TextFile(path)
        assert "".join(source.pieces(chunk)) == _text_reference(data), chunk
        assert source.sha256 == hashlib.sha256(data).hexdigest()
        assert source.size == len(data) and source.bytes_read == len(data)


def test_invalid_utf8_names_the_byte_across_chunks(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"abc\xc3\xa9d" + b"\xff" + b"xyz")  # bad byte at offset 6
    for chunk in (1, 2, 4, 100):
        with pytest.raises(ValueError, match=r"not valid UTF-8 \(.* at byte 6\): .*bad\.txt"):
            "".join(TextFile(path).pieces(chunk))


def test_lines_are_split_on_newlines_and_bounded():
    text = "a\tb\n\nc\td\ne"
    for size in (1, 2, 3, 100):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert list(lines(pieces, max_chars=10, what="x")) == text.split("\n")
    assert list(lines([], max_chars=1, what="x")) == [""]
    assert list(lines(["ab\n"], max_chars=2, what="x")) == ["ab", ""]
    with pytest.raises(ValueError, match=r"^f: line 2 is longer than 3 characters"):
        list(lines(["ab\nabcd"], max_chars=3, what="f"))
    with pytest.raises(ValueError, match="line 1 "):
        list(lines(["ab", "cd"], max_chars=3, what="f"))


def test_pair_file_gives_the_pairs_of_the_whole_text_pipeline(tmp_path):
    rng = random.Random(1)
    marks = ["go", ".", "!", "?", ",", "...", " ", "\t", "\u202f", "\xa0", "\u00c9T\u00c9",
             "\u03a3", "OS\u03a3", "\r\n", "\n", "\r", "\u0130"]
    text = "\ufeff" + "".join(rng.choice(marks) for _ in range(20000))
    path = tmp_path / "pairs.txt"
    path.write_bytes(text.encode())
    expected = read_pairs(preprocess(load_corpus(path)))
    assert expected[0]  # the test has pairs to compare
    for num_examples in (None, 0, 1, 50):
        src, tgt, digest = read_pair_file(path, num_examples)
        reference = read_pairs(preprocess(load_corpus(path)), num_examples)
        assert (src, tgt) == reference
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(not FRA.is_file(), reason="needs ../shared/data/fra-eng")
def test_pair_file_on_fra_eng(monkeypatch):
    monkeypatch.setattr(textfile, "CHUNK_BYTES", 4096)  # many chunk boundaries
    src, tgt, _ = read_pair_file(FRA)
    assert (src, tgt) == read_pairs(preprocess(load_corpus(FRA)))
    assert len(src) == 18_066  # the pairs its README counts


def test_split_point_cuts_only_between_words():
    assert split_point("ab cd") == 2  # before the space
    assert split_point("ab\ncd") == 3  # after the newline
    assert split_point("ab cd ef") == 5  # the last place
    assert split_point("ab  cd") == 0  # a run of spaces is one piece
    assert split_point("ab \ncd") == 0
    assert split_point("ab\n\ncd") == 0
    assert split_point("ab ") == 0 and split_point(" ab") == 0
    assert split_point("abcdef") == 0
    assert split_point("ab cd ef", start=3) == 5
    assert split_point("ab cd", start=2) == 0


def test_chunked_tokenization_equals_whole_on_adversarial_text(tokenizers):
    rng = random.Random(0)
    for trial in range(150):
        text = _adversarial(rng, rng.randint(0, 300))
        for step, size in ((1, 1), (3, 2), (7, 5), (11, 40)):
            incoming = [text[i:i + step] for i in range(0, len(text), step)]
            pieces = list(tokenizer_pieces(incoming, size))
            assert "".join(pieces) == text
            if len(text) > 40:
                assert len(pieces) > 1 or split_point(text) == 0
            for tokenizer in tokenizers:
                assert _pieces_ids(tokenizer, pieces) == tokenizer.encode(text), (
                    trial, size, tokenizer.name, text)


@pytest.mark.skipif(not VERDICT.is_file(), reason="needs ../shared/data/the-verdict.txt")
def test_chunked_tokenization_equals_whole_on_real_text(tokenizers):
    text = VERDICT.read_text(encoding="utf-8")
    incoming = [text[i:i + 97] for i in range(0, len(text), 97)]
    pieces = list(tokenizer_pieces(incoming, 200))
    assert len(pieces) > 50
    for tokenizer in tokenizers:
        assert _pieces_ids(tokenizer, pieces) == tokenizer.encode(text)
    if len(tokenizers) > 1:
        assert len(tokenizers[1].encode(text)) == 5145  # the figure the book gives


def test_a_stretch_that_cannot_be_cut_is_refused_before_it_is_held():
    def endless():
        while True:
            yield "x" * 1000

    with pytest.raises(ValueError, match=r"^story has 5,000 characters from character 0 on"):
        list(tokenizer_pieces(endless(), 10, max_uncut=4500, what="story"))
