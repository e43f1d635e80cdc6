"""LLMs-from-scratch names beyond chapter 3: ``SimpleTokenizerV1``/``V2`` (ch. 2),
``PyTorchMultiHeadAttention`` and ``GPTModelFast`` (bonus material), the text-in
``create_dataloader`` and ``GPTDatasetV1``'s ``input_ids``/``target_ids``.

Expected ids, texts and tokens are the ones the book's notebooks and package tests print;
the models are checked against ``qkv.MultiHeadAttention``/``GPTModel`` with copied weights
and against a float64 computation written out here. Tests reading ../shared/data skip
when it is absent.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import qkv
from qkv.data import (
    GPTDatasetV1,
    SimpleTokenizerV1,
    SimpleTokenizerV2,
    create_dataloader,
    create_dataloader_v1,
    simple_split,
)
from qkv.data.tokenizers import BPE_DIR_ENV
from qkv.models import GPTModel, GPTModelFast, generate_text_simple

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# The chapter's pattern, for the reference vocabulary built here.
BOOK_SPLIT = r'([,.:;?_!"()\']|--|\s)'


def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def verdict_text():
    path = SHARED_DATA / "the-verdict.txt"
    if not path.is_file():
        pytest.skip("../shared/data is not present")
    return path.read_text(encoding="utf-8")


@pytest.fixture
def bpe_dir(monkeypatch):
    """GPT-2's BPE files, offline through $QKV_BPE_DIR, as a learner without network sets it."""
    folder = SHARED_DATA / "gpt2"
    if not (folder / "vocab.bpe").is_file():
        pytest.skip("../shared/data is not present")
    pytest.importorskip("tiktoken")
    monkeypatch.setenv(BPE_DIR_ENV, str(folder))
    return folder


@pytest.fixture
def tiktoken_gpt2(bpe_dir):
    """The reference encoding, built by tiktoken itself from the two files."""
    import tiktoken
    import tiktoken.load

    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(bpe_dir / "vocab.bpe"), encoder_json_file=str(bpe_dir / "encoder.json"))
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
    return tiktoken.Encoding(name="gpt2", pat_str=pat, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


# ----------------------------------------------------------------------------
# SimpleTokenizerV1 / V2 (ch. 2.3-2.4)


def test_split_prints_the_chapters_pieces():
    assert simple_split("Hello, world. Is this-- a test?") == [
        "Hello", ",", "world", ".", "Is", "this", "--", "a", "test", "?"]
    assert simple_split("Hello, world. This, is a test.") == [
        "Hello", ",", "world", ".", "This", ",", "is", "a", "test", "."]
    raises_one_line(ValueError, "text must be a str, got list", simple_split, ["a"])


def test_v1_on_the_verdict(verdict_text):
    assert len(verdict_text) == 20479
    words = simple_split(verdict_text)
    assert words == [w.strip() for w in re.split(BOOK_SPLIT, verdict_text) if w.strip()]
    assert len(words) == 4690
    assert words[:10] == ["I", "HAD", "always", "thought", "Jack", "Gisburn", "rather", "a",
                          "cheap", "genius"]
    vocab = {token: i for i, token in enumerate(sorted(set(words)))}
    assert len(vocab) == 1130
    assert list(vocab.items())[:3] == [("!", 0), ('"', 1), ("'", 2)]
    assert vocab["HAD"] == 44 and vocab["Hermia"] == 50

    tokenizer = SimpleTokenizerV1(vocab)
    text = """"It's the last he painted, you know,"
           Mrs. Gisburn said with pardonable pride."""
    ids = tokenizer.encode(text)
    assert ids == [1, 56, 2, 850, 988, 602, 533, 746, 5, 1126, 596, 5, 1, 67, 7, 38, 851,
                   1108, 754, 793, 7]
    decoded = '" It\' s the last he painted, you know," Mrs. Gisburn said with pardonable pride.'
    assert tokenizer.decode(ids) == decoded
    assert tokenizer.decode(torch.tensor(ids)) == decoded
    assert tokenizer.str_to_int is vocab and tokenizer.int_to_str[1126] == "you"
    # The chapter's point: V1 cannot encode a word it has not seen.
    raises_one_line(ValueError, "'Hello' is not in the vocabulary", tokenizer.encode,
                    "Hello, do you like tea. Is this-- a test?")


def test_v2_on_the_verdict(verdict_text):
    all_tokens = sorted(set(simple_split(verdict_text)))
    all_tokens.extend(["<|endoftext|>", "<|unk|>"])
    vocab = {token: i for i, token in enumerate(all_tokens)}
    assert len(vocab) == 1132
    assert list(vocab.items())[-3:] == [("yourself", 1129), ("<|endoftext|>", 1130),
                                        ("<|unk|>", 1131)]
    tokenizer = SimpleTokenizerV2(vocab)
    text = " <|endoftext|> ".join(("Hello, do you like tea?",
                                   "In the sunlit terraces of the palace."))
    ids = tokenizer.encode(text)
    assert ids == [1131, 5, 355, 1126, 628, 975, 10, 1130, 55, 988, 956, 984, 722, 988, 1131, 7]
    assert tokenizer.decode(ids) == (
        "<|unk|>, do you like tea? <|endoftext|> In the sunlit terraces of the <|unk|>.")


def test_v1_and_v2_differ_only_where_the_book_does():
    vocab = {w: i for i, w in enumerate(["<|unk|>", "a", ":", ";", ",", "b", "--"])}
    v1, v2 = SimpleTokenizerV1(vocab), SimpleTokenizerV2(vocab)
    ids = v1.encode("a: b; a, b--a")
    assert ids == v2.encode("a: b; a, b--a") == [1, 2, 5, 3, 1, 4, 5, 6, 1]
    # V1's decode leaves ':' and ';' detached, V2's attaches them; neither attaches '--'
    assert v1.decode(ids) == "a : b ; a, b -- a"
    assert v2.decode(ids) == "a: b; a, b -- a"
    assert v2.encode("a c, zz") == [1, 0, 4, 0]
    raises_one_line(ValueError, "'c' is not in the vocabulary", v1.encode, "a c")


def test_simple_tokenizer_errors_are_one_line():
    raises_one_line(ValueError, "vocab must be a dict", SimpleTokenizerV1, ["a", "b"])
    raises_one_line(ValueError, "vocab must map str tokens to int ids", SimpleTokenizerV1,
                    {"a": "0"})
    raises_one_line(ValueError, "gives id 0 to both 'a' and 'b'", SimpleTokenizerV1,
                    {"a": 0, "b": 0})
    raises_one_line(ValueError, "vocab has no '<|unk|>'", SimpleTokenizerV2, {"a": 0})
    raises_one_line(ValueError, "id 7 is not in the vocabulary", SimpleTokenizerV1({"a": 0}).decode,
                    [0, 7])


# ----------------------------------------------------------------------------
# PyTorchMultiHeadAttention (ch. 3 bonus)


def test_attention_signature_and_the_books_state_dict():
    params = inspect.signature(qkv.PyTorchMultiHeadAttention).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("d_in", inspect.Parameter.empty), ("d_out", inspect.Parameter.empty),
        ("num_heads", inspect.Parameter.empty), ("dropout", 0.0), ("qkv_bias", False)]
    mha = qkv.PyTorchMultiHeadAttention(6, 8, num_heads=2, qkv_bias=True)
    assert {k: tuple(v.shape) for k, v in mha.state_dict().items()} == {
        "qkv.weight": (24, 6), "qkv.bias": (24,), "proj.weight": (8, 8), "proj.bias": (8,)}
    assert mha.head_dim == 4 and mha.dropout == 0.0
    # a state dict under the book's names, as torch.save(book_mha.state_dict()) writes it
    saved = {"qkv.weight": torch.randn(24, 6), "qkv.bias": torch.randn(24),
             "proj.weight": torch.randn(8, 8), "proj.bias": torch.randn(8)}
    mha.load_state_dict(saved, strict=True)
    assert torch.equal(mha.qkv.weight, saved["qkv.weight"])
    plain = qkv.PyTorchMultiHeadAttention(6, 8, 2)
    assert sorted(plain.state_dict()) == ["proj.bias", "proj.weight", "qkv.weight"]


def copy_into_mha(fused: qkv.PyTorchMultiHeadAttention, mha: qkv.MultiHeadAttention) -> None:
    """Split the fused projection: rows [0, d), [d, 2d), [2d, 3d) are query, key, value."""
    with torch.no_grad():
        for part, layer in zip(fused.qkv.weight.chunk(3), (mha.W_query, mha.W_key, mha.W_value),
                               strict=True):
            layer.weight.copy_(part)
        if fused.qkv.bias is not None:
            for part, layer in zip(fused.qkv.bias.chunk(3),
                                   (mha.W_query, mha.W_key, mha.W_value), strict=True):
                layer.bias.copy_(part)
        mha.out_proj.load_state_dict(fused.proj.state_dict())


def naive_float64(fused: qkv.PyTorchMultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal multi-head attention written out head by head, in float64."""
    x = x.double()
    w = fused.qkv.weight.double()
    b = fused.qkv.bias.double() if fused.qkv.bias is not None else torch.zeros(w.shape[0],
                                                                              dtype=torch.float64)
    d, h = fused.d_out, fused.num_heads
    hd = d // h
    q, k, v = (x @ w[i * d:(i + 1) * d].T + b[i * d:(i + 1) * d] for i in range(3))
    t = x.shape[1]
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    heads = []
    for i in range(h):
        cols = slice(i * hd, (i + 1) * hd)
        scores = q[..., cols] @ k[..., cols].transpose(-2, -1) / hd ** 0.5
        weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        heads.append(weights @ v[..., cols])
    return torch.cat(heads, dim=-1) @ fused.proj.weight.double().T + fused.proj.bias.double()


@pytest.mark.parametrize("d_in, d_out, heads, bias", [(6, 8, 2, False), (8, 8, 4, True),
                                                      (5, 12, 3, True)])
def test_attention_equals_multihead_and_a_float64_computation(d_in, d_out, heads, bias):
    torch.manual_seed(0)
    fused = qkv.PyTorchMultiHeadAttention(d_in, d_out, heads, qkv_bias=bias).eval()
    mha = qkv.MultiHeadAttention(d_in, d_out, None, 0.0, heads, qkv_bias=bias).eval()
    copy_into_mha(fused, mha)
    x = torch.randn(3, 7, d_in)
    out = fused(x)
    assert out.shape == (3, 7, d_out)
    torch.testing.assert_close(out, mha(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.double(), naive_float64(fused, x), atol=1e-5, rtol=1e-5)
    # causal: the first token's output does not depend on what follows it
    torch.testing.assert_close(fused(x[:, :1]), out[:, :1], atol=1e-6, rtol=1e-5)


def test_attention_seeded_like_the_books_multihead_and_its_dropout():
    # The fused Linear draws its 3 * d_out rows in the order the three Linear layers of
    # the book's MultiHeadAttention draw theirs, from the same bound (fan-in d_in).
    torch.manual_seed(123)
    fused = qkv.PyTorchMultiHeadAttention(256, 256, num_heads=2)
    torch.manual_seed(123)
    mha = qkv.MultiHeadAttention(256, 256, 4, 0.0, num_heads=2)
    torch.testing.assert_close(
        fused.qkv.weight, torch.cat((mha.W_query.weight, mha.W_key.weight, mha.W_value.weight)),
        atol=0, rtol=0)
    torch.testing.assert_close(fused.proj.weight, mha.out_proj.weight, atol=0, rtol=0)
    # Training mode: the book's forward, PyTorch's kernel with dropout, under one seed.
    fused.dropout = 0.5
    x = torch.randn(2, 4, 256)
    q, k, v = fused.qkv(x).view(2, 4, 3, 2, 128).permute(2, 0, 3, 1, 4)
    torch.manual_seed(7)
    ref = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
    ref = fused.proj(ref.transpose(1, 2).reshape(2, 4, 256))
    torch.manual_seed(7)
    torch.testing.assert_close(fused.train()(x), ref)
    assert not torch.allclose(fused.eval()(x), ref)


def test_attention_errors_are_one_line():
    raises_one_line(ValueError, r"d_out \(10\) must be divisible by num_heads \(4\)",
                    qkv.PyTorchMultiHeadAttention, 8, 10, 4)
    raises_one_line(ValueError, r"dropout must be a probability in \[0, 1\), got 1.5",
                    qkv.PyTorchMultiHeadAttention, 8, 8, 2, 1.5)
    mha = qkv.PyTorchMultiHeadAttention(8, 8, 2)
    raises_one_line(ValueError, r"x must have shape \(batch, tokens, 8\), got \(2, 3, 6\)",
                    mha, torch.zeros(2, 3, 6))


# ----------------------------------------------------------------------------
# GPTModelFast (ch. 4 bonus)

TINY = {"vocab_size": 50, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2,
        "drop_rate": 0.1, "qkv_bias": False}


def fast_state_from(model: GPTModel) -> dict[str, torch.Tensor]:
    """GPTModel's weights under GPTModelFast's (the book's) names."""
    out = {}
    for name, tensor in model.state_dict().items():
        name = name.replace(".scale", ".weight").replace(".shift", ".bias")
        name = name.replace("att.out_proj.", "att.proj.")
        if ".att.W_query." in name:  # the fused rows: query, key, value
            parts = [model.state_dict()[name.replace("W_query", w)]
                     for w in ("W_query", "W_key", "W_value")]
            out[name.replace("W_query", "qkv")] = torch.cat(parts)
        elif ".att.W_key." not in name and ".att.W_value." not in name:
            out[name] = tensor
    return out


def test_fast_model_state_dict_names_are_the_books():
    model = GPTModelFast({**TINY, "n_layers": 1, "qkv_bias": True})
    assert list(model.state_dict()) == [
        "tok_emb.weight", "pos_emb.weight",
        "trf_blocks.0.att.qkv.weight", "trf_blocks.0.att.qkv.bias",
        "trf_blocks.0.att.proj.weight", "trf_blocks.0.att.proj.bias",
        "trf_blocks.0.ff.layers.0.weight", "trf_blocks.0.ff.layers.0.bias",
        "trf_blocks.0.ff.layers.2.weight", "trf_blocks.0.ff.layers.2.bias",
        "trf_blocks.0.norm1.weight", "trf_blocks.0.norm1.bias",
        "trf_blocks.0.norm2.weight", "trf_blocks.0.norm2.bias",
        "final_norm.weight", "final_norm.bias", "out_head.weight"]
    assert isinstance(model.trf_blocks[0].att, qkv.PyTorchMultiHeadAttention)
    assert isinstance(model.final_norm, torch.nn.LayerNorm)
    assert list(inspect.signature(GPTModelFast).parameters) == ["cfg"]


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fast_model_gives_gpt_models_logits(qkv_bias):
    cfg = {**TINY, "qkv_bias": qkv_bias}
    torch.manual_seed(1)
    model = GPTModel(cfg).eval()
    fast = GPTModelFast(cfg).eval()
    fast.load_state_dict(fast_state_from(model), strict=True)
    idx = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        torch.testing.assert_close(fast(idx), model(idx), atol=1e-5, rtol=1e-5)
    raises_one_line(ValueError, "sequence of 17 tokens is longer than context_length=16",
                    fast, torch.zeros(1, 17, dtype=torch.long))


def test_fast_model_refuses_what_it_cannot_build():
    raises_one_line(ValueError, "GPTModelFast builds the book's GPT-2 .* not rope=True",
                    GPTModelFast, {**TINY, "rope": True})
    raises_one_line(ValueError, "not tie_weights=True", GPTModelFast,
                    qkv.models.GPTConfig(**TINY, tie_weights=True))
    raises_one_line(ValueError, "unknown GPTConfig field", GPTModelFast, {**TINY, "emb": 3})


def test_fast_model_reproduces_the_books_generation():
    # The book package's test: seed 123, untrained 124M GPTModelFast, "Hello, I am",
    # 10 greedy tokens (the same as GPTModel's).
    torch.manual_seed(123)
    model = GPTModelFast({"vocab_size": 50257, "context_length": 1024, "emb_dim": 768,
                          "n_heads": 12, "n_layers": 12, "drop_rate": 0.1,
                          "qkv_bias": False}).eval()
    expected = [15496, 11, 314, 716, 27018, 24086, 47843, 30961, 42348, 7267, 49706, 43231,
                47062, 34657]
    out = generate_text_simple(model, torch.tensor([expected[:4]]), 10, 1024)
    assert out.tolist() == [expected]
    # The exact tokens mean something only if no step was a near-tie.
    with torch.no_grad():
        top2 = torch.stack([model(out[:, :t])[0, -1].topk(2).values for t in range(4, 14)])
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


# ----------------------------------------------------------------------------
# Loaders: create_dataloader(txt, ...) and create_dataloader_v1 (ch. 2)


def book_windows(ids: list[int], max_length: int, stride: int):
    """The book's GPTDatasetV1 loop, written out: lists of input and target tensors."""
    starts = range(0, len(ids) - max_length, stride)
    return ([torch.tensor(ids[i:i + max_length]) for i in starts],
            [torch.tensor(ids[i + 1:i + max_length + 1]) for i in starts])


def test_text_in_loader_prints_the_exercise_batches(bpe_dir, verdict_text):
    # ch. 2 exercise solutions: create_dataloader(raw_text, batch_size=4, max_length=2,
    # stride=2), whose DataLoader does not shuffle.
    x, _ = next(iter(create_dataloader(verdict_text, batch_size=4, max_length=2, stride=2,
                                       shuffle=False)))
    assert x.tolist() == [[40, 367], [2885, 1464], [1807, 3619], [402, 271]]
    x, _ = next(iter(create_dataloader(verdict_text, batch_size=4, max_length=8, stride=2,
                                       shuffle=False)))
    assert x.tolist() == [[40, 367, 2885, 1464, 1807, 3619, 402, 271],
                          [2885, 1464, 1807, 3619, 402, 271, 10899, 2138],
                          [1807, 3619, 402, 271, 10899, 2138, 257, 7026],
                          [402, 271, 10899, 2138, 257, 7026, 15632, 438]]


def test_v1_loader_offline_prints_the_chapters_batch(bpe_dir, verdict_text):
    loader = create_dataloader_v1(verdict_text, batch_size=8, max_length=4, stride=4,
                                  shuffle=False)
    inputs, targets = next(iter(loader))
    assert inputs.tolist() == [[40, 367, 2885, 1464], [1807, 3619, 402, 271],
                               [10899, 2138, 257, 7026], [15632, 438, 2016, 257],
                               [922, 5891, 1576, 438], [568, 340, 373, 645],
                               [1049, 5975, 284, 502], [284, 3285, 326, 11]]
    assert targets[:, -1].tolist() == [1807, 10899, 15632, 922, 568, 1049, 284, 287]
    params = inspect.signature(create_dataloader_v1).parameters
    assert [(p.name, p.default) for p in params.values()][:7] == [
        ("txt", inspect.Parameter.empty), ("batch_size", 4), ("max_length", 256),
        ("stride", 128), ("shuffle", True), ("drop_last", True), ("num_workers", 0)]


def test_shuffled_text_loader_follows_the_books_random_stream(bpe_dir, verdict_text,
                                                               tiktoken_gpt2):
    ids = tiktoken_gpt2.encode(verdict_text, allowed_special={"<|endoftext|>"})
    assert len(ids) == 5145
    inputs, targets = book_windows(ids, 256, 128)
    torch.manual_seed(123)
    ours = [(x.tolist(), y.tolist()) for x, y in create_dataloader(verdict_text)]
    torch.manual_seed(123)
    book = DataLoader(list(zip(inputs, targets, strict=True)), batch_size=4, shuffle=True,
                      drop_last=True)
    assert ours == [(x.tolist(), y.tolist()) for x, y in book]
    assert len(ours) == 39 // 4


def test_dataset_v1_keeps_input_ids_and_target_ids(bpe_dir, verdict_text, tiktoken_gpt2):
    ids = tiktoken_gpt2.encode(verdict_text, allowed_special={"<|endoftext|>"})
    inputs, targets = book_windows(ids, 4, 1)
    dataset = GPTDatasetV1(verdict_text, tiktoken_gpt2, max_length=4, stride=1)
    assert isinstance(dataset.input_ids, list) and isinstance(dataset.target_ids, list)
    assert len(dataset.input_ids) == len(dataset.target_ids) == len(dataset) == 5141
    assert all(torch.equal(a, b) for a, b in zip(dataset.input_ids, inputs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(dataset.target_ids, targets, strict=True))
    assert dataset.input_ids[0].tolist() == [40, 367, 2885, 1464]
    assert dataset.input_ids is dataset.input_ids  # built once


def test_small_text_sample_as_the_chapter_3_notebook(bpe_dir):
    raw_text = (SHARED_DATA / "small-text-sample.txt").read_text(encoding="utf-8")
    torch.manual_seed(123)
    x, y = next(iter(create_dataloader(raw_text, batch_size=8, max_length=4, stride=4)))
    assert x.shape == y.shape == (8, 4)
    embedded = torch.nn.Embedding(50257, 256)(x) + torch.nn.Embedding(1024, 256)(torch.arange(4))
    assert embedded.shape == (8, 4, 256)


def test_ids_still_work_and_mixed_arguments_fail_in_one_line():
    ids = list(range(100, 141))
    x, y = next(iter(create_dataloader(ids, batch_size=2, max_length=4, stride=4,
                                       shuffle=False)))
    assert x.tolist() == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert y.tolist() == [[101, 102, 103, 104], [105, 106, 107, 108]]
    raises_one_line(ValueError, "tokenizer is for a text, but the data is a list",
                    create_dataloader, ids, tokenizer=qkv.data.ByteTokenizer())
    raises_one_line(ValueError, "txt must be the text to tokenize .* got list",
                    create_dataloader_v1, ids)
    # a text with a given tokenizer needs no BPE files
    x, _ = next(iter(create_dataloader("abcdefghij", batch_size=1, max_length=4, stride=4,
                                       shuffle=False, tokenizer=qkv.data.ByteTokenizer())))
    assert x.tolist() == [[97, 98, 99, 100]]
