"""Every documented error fires, as one line that names the bad value."""

import pytest
import torch

import qkv
from qkv import d2l


def raises_one_line(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_heads_must_divide_d_out():
    msg = raises_one_line(ValueError, r"d_out \(5\) must be divisible by num_heads \(2\)",
                          qkv.MultiHeadAttention, 3, 5, 6, 0.0, 2)
    assert "num_heads in [1, 5]" in msg
    raises_one_line(ValueError, "num_heads must be a positive integer, got 0",
                    qkv.MultiHeadAttention, 3, 4, 6, 0.0, 0)


def test_bad_constructor_values():
    raises_one_line(ValueError, r"dropout must be a probability in \[0, 1\), got 1.5",
                    qkv.MultiHeadAttention, 4, 4, 6, 1.5, 2)
    raises_one_line(ValueError, r"backend must be one of \('fused', 'eager'\), got 'flash'",
                    qkv.MultiHeadAttention, 4, 4, 6, 0.0, 2, backend="flash")
    raises_one_line(ValueError, "context_length must be positive or None, got 0",
                    qkv.MultiHeadAttention, 4, 4, 0, 0.0, 2)
    raises_one_line(ValueError, "dropout must be a probability",
                    qkv.CausalAttention, 3, 2, 6, -0.1)


def test_too_long_for_context_length():
    mha = qkv.MultiHeadAttention(3, 2, 6, 0.0, 2)
    raises_one_line(ValueError, "sequence of 7 tokens is longer than context_length=6",
                    mha, torch.rand(1, 7, 3))
    ca = qkv.CausalAttention(3, 2, 6, 0.0)
    raises_one_line(ValueError, "sequence of 8 tokens is longer than context_length=6",
                    ca, torch.rand(2, 8, 3))
    wrapper = qkv.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)
    raises_one_line(ValueError, "longer than context_length=6", wrapper, torch.rand(2, 8, 3))


def test_wrong_input_shapes():
    mha = qkv.MultiHeadAttention(3, 4, 6, 0.0, 2)
    raises_one_line(ValueError, r"x must have shape \(batch, tokens, 3\), got \(6, 3\)",
                    mha, torch.rand(6, 3))
    raises_one_line(ValueError, r"x must have shape \(batch, tokens, 3\), got \(1, 6, 4\)",
                    mha, torch.rand(1, 6, 4))
    cross = qkv.MultiHeadAttention(3, 4, None, 0.0, 2, causal=False, kdim=5)
    raises_one_line(ValueError, r"key must have shape \(batch, tokens, 5\), got \(1, 4, 3\)",
                    cross, torch.rand(1, 2, 3), torch.rand(1, 4, 3))
    raises_one_line(ValueError, "must share the batch size",
                    cross, torch.rand(2, 2, 3), torch.rand(1, 4, 5), torch.rand(1, 4, 3))
    ca = qkv.CausalAttention(3, 2, 6, 0.0)
    raises_one_line(ValueError, r"x must have shape \(batch, tokens, 3\)", ca, torch.rand(6, 3))


def test_bad_padding_arguments():
    mha = qkv.MultiHeadAttention(4, 4, None, 0.0, 2)
    x = torch.rand(2, 5, 4)
    raises_one_line(ValueError, r"valid_lens must have shape \(2,\) or \(2, queries\)",
                    mha, x, valid_lens=torch.tensor([1, 2, 3]))
    raises_one_line(ValueError, r"key_padding_mask must have shape \(2, 5\), got \(2, 4\)",
                    mha, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    raises_one_line(ValueError, r"key_padding_mask must be bool \(True = padding\)",
                    mha, x, key_padding_mask=torch.zeros(2, 5))
    raises_one_line(ValueError, "pass valid_lens or key_padding_mask, not both",
                    mha, x, valid_lens=torch.tensor([1, 2]),
                    key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    dot = qkv.DotProductAttention()
    raises_one_line(ValueError, r"valid_lens must have shape \(2,\) or \(2, 1\)",
                    dot, torch.rand(2, 1, 3), torch.rand(2, 4, 3), torch.rand(2, 4, 3),
                    torch.tensor([1, 2, 3]))
    raises_one_line(ValueError, "queries and keys must have the same width, got 3 and 2",
                    dot, torch.rand(2, 1, 3), torch.rand(2, 4, 2), torch.rand(2, 4, 3))


def test_cache_errors():
    mha = qkv.MultiHeadAttention(4, 4, None, 0.0, 2)
    raises_one_line(ValueError, "no context_length; pass max_len", mha.new_cache, 1)
    cache = mha.new_cache(1, max_len=3)
    mha(torch.rand(1, 2, 4), cache=cache)
    raises_one_line(ValueError, r"KV cache is full: 2 tokens stored \+ 2 new > max_len=3",
                    mha, torch.rand(1, 2, 4), cache=cache)
    raises_one_line(ValueError, "cache holds batch 1 x 2 heads",
                    mha, torch.rand(2, 1, 4), cache=mha.new_cache(1, max_len=3))
    raises_one_line(ValueError, "max_len must be a positive number of tokens, got 0",
                    qkv.KVCache, 1, 1, 0, 4)


def test_d2l_errors():
    raises_one_line(ValueError, r"num_hiddens \(10\) must be divisible by num_heads \(3\)",
                    d2l.MultiHeadAttention, 10, 3, 0.0)
    raises_one_line(ValueError, "causal attention needs num_queries <= num_keys, got 3 > 2",
                    qkv.causal_mask, 3, 2)
