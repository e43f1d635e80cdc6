"""qkv.data.lm: sliding windows (the book's ch. 2), loaders, embeddings, the generated corpus."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from qkv.data.lm import (
    GPTDataset,
    GPTDatasetV1,
    create_dataloader,
    create_dataloader_v1,
    generated_corpus,
)
from qkv.data.tokenizers import ByteTokenizer, get_tokenizer
from qkv.models import GPTEmbedding

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"




def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------
# Windows


@pytest.mark.parametrize("n, max_length, stride", [(20, 4, 1), (20, 4, 4), (21, 4, 4),
                                                   (17, 5, 3), (5, 4, 7), (100, 1, 10)])
def test_window_count_and_shifted_targets(n, max_length, stride):
    ids = list(range(1000, 1000 + n))
    ds = GPTDataset(ids, max_length, stride)
    starts = list(range(0, n - max_length, stride))
    assert len(ds) == len(starts)
    for k, i in enumerate(starts):
        x, y = ds[k]
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == ids[i : i + max_length]
        assert y.tolist() == ids[i + 1 : i + max_length + 1]
    assert ds[-1][0].tolist() == ids[starts[-1] : starts[-1] + max_length]
    with pytest.raises(IndexError):
        ds[len(starts)]


def test_book_dataset_on_text_with_a_tokenizer():
    text = "In the beginning the cat sat on the mat."
    tok = ByteTokenizer()
    ds = GPTDatasetV1(text, tok, max_length=8, stride=8)
    ids = tok.encode(text)
    assert len(ds) == len(range(0, len(ids) - 8, 8)) == 4
    x, y = ds[1]
    assert tok.decode(x) == "eginning" and tok.decode(y) == "ginning "


def test_too_short_and_bad_sizes_are_one_line_errors():
    raises_one_line(ValueError, r"text too short: 4 tokens, but one window of max_length=4 "
                    r"needs at least 5", GPTDataset, [1, 2, 3, 4], 4, 1)
    raises_one_line(ValueError, "max_length and stride must be positive", GPTDataset,
                    [1, 2, 3], 0, 1)
    raises_one_line(ValueError, "token_ids must be a 1-D sequence of integers", GPTDataset,
                    torch.rand(10), 2, 1)
    raises_one_line(ValueError, "text too short: 3 tokens", create_dataloader_v1, "abc",
                    max_length=3, tokenizer=ByteTokenizer())
    raises_one_line(ValueError, r"only 6 windows for batch_size=8 with drop_last=True",
                    create_dataloader, list(range(10)), batch_size=8, max_length=4, stride=1)


def test_memory_is_the_ids_and_nothing_more():
    base = torch.arange(1_000_000) % 50257
    ds = GPTDataset(base, max_length=256, stride=1)
    assert len(ds) == 1_000_000 - 256
    assert ds.token_ids.data_ptr() == base.data_ptr()  # an int64 tensor is not even copied
    ptr = base.untyped_storage().data_ptr()
    assert all(
        x.untyped_storage().data_ptr() == ptr and y.untyped_storage().data_ptr() == ptr
        for x, y in (ds[i] for i in range(len(ds)))
    )
    held = sum(v.nbytes for v in vars(ds).values() if isinstance(v, torch.Tensor))
    assert held == 8_000_000  # 1,000,000 int64 ids, once


def test_loader_defaults_and_shapes():
    ids = list(range(2000))
    loader = create_dataloader(ids)
    assert isinstance(loader, DataLoader)
    assert (loader.batch_size, loader.drop_last, loader.num_workers) == (4, True, 0)
    assert len(loader.dataset) == len(range(0, 2000 - 256, 128))
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 256) and torch.equal(x[:, 1:], y[:, :-1])
    # drop_last=False keeps the short final batch
    loader = create_dataloader(ids, batch_size=5, max_length=100, stride=100, drop_last=False)
    assert [len(b[0]) for b in loader] == [5, 5, 5, 4]


def test_loader_shuffle_is_seeded_and_sampler_decides_order():
    ids = list(range(500))

    def firsts(**kw):
        loader = create_dataloader(ids, batch_size=2, max_length=4, stride=4, **kw)
        return [int(x[0, 0]) for x, _ in loader]

    ordered = firsts(shuffle=False)
    assert ordered == list(range(0, 496, 8))
    a = firsts(generator=torch.Generator().manual_seed(1))
    assert a == firsts(generator=torch.Generator().manual_seed(1)) and a != ordered

    class Backwards(Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    # shuffle=True (the default) would clash with a sampler in DataLoader; here it yields
    assert firsts(sampler=Backwards(124)) == list(range(492, -1, -8))


def test_v1_loader_with_a_given_tokenizer():
    text = generated_corpus(3000)
    loader = create_dataloader_v1(text, batch_size=2, max_length=16, stride=16, shuffle=False,
                                  tokenizer=ByteTokenizer())
    x, y = next(iter(loader))
    assert ByteTokenizer().decode(x[0]) == text[:16]
    assert ByteTokenizer().decode(y[0]) == text[1:17]


# ----------------------------------------------------------------------------
# The Verdict, as in the book (needs ../shared/data)


@pytest.fixture(scope="module")
def verdict():
    if not (SHARED_DATA / "gpt2" / "vocab.bpe").is_file():
        pytest.skip("../shared/data is not present")
    pytest.importorskip("tiktoken")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        tok = get_tokenizer("gpt2", bpe_dir=SHARED_DATA / "gpt2")
    return (SHARED_DATA / "the-verdict.txt").read_text(encoding="utf-8"), tok


def test_the_verdict_stride_1(verdict):
    text, tok = verdict
    loader = create_dataloader_v1(text, batch_size=1, max_length=4, stride=1, shuffle=False,
                                  tokenizer=tok)
    batches = iter(loader)
    x, y = next(batches)
    assert x.tolist() == [[40, 367, 2885, 1464]] and y.tolist() == [[367, 2885, 1464, 1807]]
    x, y = next(batches)
    assert x.tolist() == [[367, 2885, 1464, 1807]] and y.tolist() == [[2885, 1464, 1807, 3619]]
    assert len(loader) == 5145 - 4


def test_the_verdict_batch_8_and_embeddings(verdict):
    text, tok = verdict
    loader = create_dataloader_v1(text, batch_size=8, max_length=4, stride=4, shuffle=False,
                                  tokenizer=tok)
    x, y = next(iter(loader))
    assert x[0].tolist() == [40, 367, 2885, 1464]
    assert x[1].tolist() == [1807, 3619, 402, 271]
    assert y[0].tolist() == [367, 2885, 1464, 1807]
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:-1, -1], x[1:, 0])
    torch.manual_seed(123)
    emb = GPTEmbedding(50257, 256, context_length=4)
    assert emb(x).shape == (8, 4, 256)


# ----------------------------------------------------------------------------
# Embeddings


def test_embedding_is_token_plus_position():
    torch.manual_seed(0)
    emb = GPTEmbedding(vocab_size=10, emb_dim=6, context_length=5)
    idx = torch.tensor([[1, 2, 3], [4, 4, 4]])
    out = emb(idx)
    assert out.shape == (2, 3, 6)
    expected = emb.tok_emb.weight[idx] + emb.pos_emb.weight[:3]
    assert torch.allclose(out, expected)
    # positions continue after cached tokens
    assert torch.allclose(emb(idx[:, 2:], start_pos=2), expected[:, 2:])
    raises_one_line(ValueError, "sequence of 6 tokens is longer than context_length=5",
                    emb, torch.zeros(1, 6, dtype=torch.long))
    raises_one_line(ValueError, "sequence of 6 tokens is longer than context_length=5",
                    emb, torch.zeros(1, 2, dtype=torch.long), start_pos=4)
    raises_one_line(ValueError, r"token ids must have shape \(batch, tokens\)", emb,
                    torch.zeros(4, dtype=torch.long))


# ----------------------------------------------------------------------------
# Generated corpus


def test_generated_corpus_is_deterministic_english_like():
    text = generated_corpus()
    assert len(text) == 50_000 and text == generated_corpus(50_000, seed=0)
    assert generated_corpus(50_000, seed=1) != text
    assert generated_corpus(1234) == text[:1234]
    words = {w.strip('.,?"').lower() for w in text.split()}
    assert 200 <= len(words) <= 600
    assert "\n\n" in text and text[0].isupper()
    sentences = [s for s in text.replace("?", ".").split(". ") if s]
    assert len(sentences) > 500
    # the grammar agrees: "an" only before vowels, "a" only before consonants
    tokens = text.split()
    for article, word in zip(tokens, tokens[1:], strict=False):
        if article in ("a", "an"):
            assert (word[0] in "aeiou") == (article == "an"), (article, word)
    raises_one_line(ValueError, "num_chars must be positive", generated_corpus, 0)
