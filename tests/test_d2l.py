"""d2l's scoring functions, multi-head form and positional encoding."""

import math

import pytest
import torch
from torch import nn

import qkv
from qkv import d2l

# d2l's demo: identical keys give uniform weights over the valid keys, so the
# result is the mean of the first 2 (first example) or 6 (second) value rows.
KEYS = torch.ones(2, 10, 2)
VALUES = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
VALID_LENS = torch.tensor([2, 6])
EXPECTED = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])


def test_additive_attention_demo():
    torch.manual_seed(0)
    attn = qkv.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    queries = torch.normal(0, 1, (2, 1, 20))
    out = attn(queries, KEYS, VALUES, VALID_LENS)
    torch.testing.assert_close(out, EXPECTED)
    assert attn.attention_weights.shape == (2, 1, 10)


def test_dot_product_attention_demo():
    torch.manual_seed(0)
    attn = qkv.DotProductAttention(dropout=0.5).eval()
    queries = torch.normal(0, 1, (2, 1, 2))
    torch.testing.assert_close(attn(queries, KEYS, VALUES, VALID_LENS), EXPECTED)


def test_additive_attention_against_formula_and_projected_keys():
    torch.manual_seed(1)
    attn = qkv.AdditiveAttention(3, 5, 7).eval()
    q, k, v = torch.randn(2, 4, 5), torch.randn(2, 6, 3), torch.randn(2, 6, 2)
    lens = torch.tensor([6, 3])
    out = attn(q, k, v, lens)
    # float64 loop reference
    Wq, Wk, wv = (m.weight.double() for m in (attn.W_q, attn.W_k, attn.w_v))
    for b in range(2):
        for i in range(4):
            scores = torch.stack(
                [(wv @ torch.tanh(Wq @ q[b, i].double() + Wk @ k[b, j].double()))[0]
                 for j in range(int(lens[b]))]
            )
            expected = torch.softmax(scores, 0) @ v[b, : int(lens[b])].double()
            torch.testing.assert_close(out[b, i].double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(attn(q, k, v, lens, projected_keys=attn.project_keys(k)), out)


def test_zero_valid_len_gives_zeros_not_uniform():
    attn = qkv.DotProductAttention().eval()
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    out = attn(q, k, v, torch.tensor([0, 5]))
    assert (out[0] == 0).all() and (attn.attention_weights[0] == 0).all()


def test_dot_product_attention_2d_valid_lens():
    attn = qkv.DotProductAttention().eval()
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 6)
    attn(q, k, v, torch.tensor([[1, 5]]))
    w = attn.attention_weights
    torch.testing.assert_close(w[0, 0], torch.tensor([1.0, 0, 0, 0, 0]))
    torch.testing.assert_close(w[0, 1], torch.softmax(q[0, 1] @ k[0].T / 2, dim=-1))


def d2l_reference_mha(m, queries, keys, values, valid_lens):
    """d2l's algorithm: fold the heads into the batch and repeat valid_lens."""
    h = m.num_heads

    def fold(x):  # (b, n, h*d) -> (b*h, n, d)
        b, n, _ = x.shape
        return x.reshape(b, n, h, -1).permute(0, 2, 1, 3).reshape(b * h, n, -1)

    q = fold(queries @ m.W_query.weight.T)
    k = fold(keys @ m.W_key.weight.T)
    v = fold(values @ m.W_value.weight.T)
    lens = torch.repeat_interleave(valid_lens, repeats=h, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    weights = qkv.masked_softmax(scores, lens)
    out = weights @ v  # (b*h, n_q, d)
    b = queries.shape[0]
    out = out.reshape(b, h, out.shape[1], -1).permute(0, 2, 1, 3).reshape(b, out.shape[1], -1)
    return out @ m.out_proj.weight.T, weights


def test_d2l_multihead_example_and_reference():
    torch.manual_seed(2)
    m = d2l.MultiHeadAttention(100, 5, 0.5).eval()
    queries, kv = torch.randn(2, 4, 100), torch.randn(2, 6, 100)
    valid_lens = torch.tensor([3, 2])
    out = m(queries, kv, kv, valid_lens)
    assert out.shape == (2, 4, 100)
    expected, ref_w = d2l_reference_mha(m, queries, kv, kv, valid_lens)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.attention_weights.reshape(10, 4, 6), ref_w, atol=1e-6, rtol=0)
    assert m.out_proj.bias is None and m.W_query.bias is None  # bias-free by default
    assert isinstance(m, qkv.MultiHeadAttention)  # one implementation, not two


def test_d2l_multihead_other_widths():
    m = d2l.MultiHeadAttention(8, 2, 0.0, query_size=3, key_size=5, value_size=7).eval()
    out = m(torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.randn(2, 6, 7), torch.tensor([6, 1]))
    assert out.shape == (2, 4, 8)
    with pytest.raises(ValueError, match="num_hiddens \\(10\\) must be divisible by num_heads"):
        d2l.MultiHeadAttention(10, 3, 0.0)


def test_positional_encoding_formula():
    pe = qkv.PositionalEncoding(32, 0.0, max_len=60).eval()
    X = torch.zeros(1, 60, 32)
    P = pe(X)[0].double()
    pos = torch.arange(60, dtype=torch.float64)[:, None]
    for j in range(16):
        angle = pos[:, 0] / 10000 ** (2 * j / 32)
        torch.testing.assert_close(P[:, 2 * j], torch.sin(angle), atol=1e-5, rtol=0)
        torch.testing.assert_close(P[:, 2 * j + 1], torch.cos(angle), atol=1e-5, rtol=0)
    X = torch.randn(3, 10, 32)
    torch.testing.assert_close(pe(X), X + pe.P[:, :10])


def test_positional_encoding_odd_width_dropout_and_errors():
    pe = qkv.PositionalEncoding(7, 0.5, max_len=20)
    assert pe.P.shape == (1, 20, 7)
    pe.train()
    out = pe(torch.zeros(4, 20, 7))
    assert (out == 0).any()  # dropout is on in training
    pe.eval()
    torch.testing.assert_close(pe(torch.zeros(1, 20, 7)), pe.P)
    with pytest.raises(ValueError, match="longer than max_len=20"):
        pe(torch.zeros(1, 21, 7))
    with pytest.raises(ValueError, match=r"shape \(batch, tokens, 7\)"):
        pe(torch.zeros(21, 7))


def test_d2l_names_are_exported():
    for name in ("masked_softmax", "DotProductAttention", "AdditiveAttention",
                 "MultiHeadAttention", "PositionalEncoding"):
        assert hasattr(d2l, name)
    assert isinstance(d2l.PositionalEncoding(4, 0.0), nn.Module)
