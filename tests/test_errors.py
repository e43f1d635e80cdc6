"""Every documented error fires, as one line that names the bad value."""

import re

import pytest
import torch

import qkv
from qkv import d2l
from qkv.positional import sinusoidal_table


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
    raises_one_line(ValueError, "context_length must be a positive integer or None, got 0",
                    qkv.MultiHeadAttention, 4, 4, 0, 0.0, 2)
    raises_one_line(TypeError, r"dropout must be a probability in \[0, 1\), got '0.1' of type str",
                    qkv.MultiHeadAttention, 4, 4, 6, "0.1", 2)
    raises_one_line(ValueError, "dropout must be a probability",
                    qkv.CausalAttention, 3, 2, 6, -0.1)


# Every public constructor with its smallest valid arguments, and the size arguments it
# must refuse; those marked * may also be None.
CONSTRUCTORS = {
    "MultiHeadAttention": (qkv.MultiHeadAttention,
                           dict(d_in=4, d_out=4, context_length=6, dropout=0.0, num_heads=2),
                           ["d_in", "d_out", "num_heads", "context_length*", "kdim*", "vdim*"]),
    "CausalAttention": (qkv.CausalAttention, dict(d_in=3, d_out=2, context_length=6, dropout=0.0),
                        ["d_in", "d_out", "context_length"]),
    "SelfAttention_v1": (qkv.SelfAttention_v1, dict(d_in=3, d_out=2), ["d_in", "d_out"]),
    "SelfAttention_v2": (qkv.SelfAttention_v2, dict(d_in=3, d_out=2), ["d_in", "d_out"]),
    "MultiHeadAttentionWrapper": (
        qkv.MultiHeadAttentionWrapper,
        dict(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2),
        ["d_in", "d_out", "context_length", "num_heads"]),
    "d2l.MultiHeadAttention": (d2l.MultiHeadAttention, dict(num_hiddens=4, num_heads=2),
                               ["num_hiddens", "num_heads", "query_size*", "key_size*",
                                "value_size*"]),
    "d2l.AdditiveAttention": (d2l.AdditiveAttention,
                              dict(key_size=2, query_size=3, num_hiddens=4),
                              ["key_size", "query_size", "num_hiddens"]),
    "d2l.PositionalEncoding": (d2l.PositionalEncoding, dict(num_hiddens=4, max_len=10),
                               ["num_hiddens", "max_len"]),
    "sinusoidal_table": (sinusoidal_table, dict(max_len=10, num_hiddens=4),
                         ["max_len", "num_hiddens"]),
    "KVCache": (qkv.KVCache, dict(batch_size=1, num_heads=2, max_len=4, head_dim=3),
                ["batch_size", "num_heads", "max_len", "head_dim", "value_dim*"]),
}
BAD_SIZES = [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError),
             ("4", TypeError), (torch.tensor(4), TypeError), (None, TypeError)]


@pytest.mark.parametrize("bad, exc", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("cls", list(CONSTRUCTORS))
def test_sizes_must_be_positive_ints(cls, bad, exc):
    make, good, names = CONSTRUCTORS[cls]
    make(**good)  # the valid arguments are valid
    for name in names:
        optional = name.endswith("*")
        name = name.rstrip("*")
        if bad is None and optional:
            make(**{**good, name: None})
            continue
        unit = "number of tokens" if (cls, name) == ("KVCache", "max_len") else "integer"
        if exc is ValueError:
            match = rf"^{name} must be a positive {unit}( or None)?, got {bad}$"
        else:
            match = (rf"^{name} must be a positive {unit}( or None)?, got "
                     rf"{re.escape(repr(bad))} of type {type(bad).__name__}$")
        raises_one_line(exc, match, make, **{**good, name: bad})


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
    raises_one_line(ValueError, r"valid_lens must have shape \(2,\) \(one length per sequence\) "
                    r"or \(2, 5\) \(one per query\), got \(3,\)$",
                    mha, x, valid_lens=torch.tensor([1, 2, 3]))
    raises_one_line(ValueError, r"key_padding_mask must have shape \(2, 5\), got \(2, 4\)",
                    mha, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    raises_one_line(ValueError, r"key_padding_mask must be bool \(True = padding\)",
                    mha, x, key_padding_mask=torch.zeros(2, 5))
    raises_one_line(ValueError, "pass valid_lens or key_padding_mask, not both",
                    mha, x, valid_lens=torch.tensor([1, 2]),
                    key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    dot = qkv.DotProductAttention()
    raises_one_line(ValueError, r"valid_lens must have shape \(2,\) .* or \(2, 1\)",
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


@pytest.mark.parametrize("need_weights", [True, False], ids=["eager", "fused"])
def test_attention_masks_are_checked_the_same_on_both_backends(need_weights):
    q, k, v = torch.rand(2, 3, 5, 4), torch.rand(2, 3, 7, 4), torch.rand(2, 3, 7, 6)

    def call(*args, **kwargs):
        return qkv.attention(*args, need_weights=need_weights, **kwargs)

    shapes = r"scores' shape \(2, 3, 5, 7\) \(\.\.\., queries, keys\); shapes that do " \
             r"include \(7,\) and \(5, 7\)"
    raises_one_line(ValueError, r"mask of shape \(5,\) does not broadcast to the attention "
                    + shapes, call, q, k, v, mask=torch.ones(5, dtype=torch.bool))
    raises_one_line(ValueError, r"mask of shape \(4, 2, 3, 5, 7\) does not broadcast",
                    call, q, k, v, mask=torch.ones(4, 2, 3, 5, 7, dtype=torch.bool))
    raises_one_line(TypeError, r"mask must be a bool tensor \(True = may attend\), got dtype "
                    r"torch.float32; for a 0/1 mask pass mask.bool\(\)",
                    call, q, k, v, mask=torch.ones(5, 7))
    raises_one_line(TypeError, "got dtype torch.int64", call, q, k, v,
                    mask=torch.ones(5, 7, dtype=torch.long))
    raises_one_line(TypeError, "mask must be a bool tensor .* got list",
                    call, q, k, v, mask=[[True] * 7] * 5)
    raises_one_line(ValueError, "query and key must have the same width, got 4 and 3",
                    call, q, torch.rand(2, 3, 7, 3), v)
    raises_one_line(ValueError, "key and value must have the same number of tokens, got 7 and 6",
                    call, q, k, torch.rand(2, 3, 6, 6))
    raises_one_line(ValueError, r"query must have shape \(\.\.\., tokens, width\), got \(4,\)",
                    call, torch.rand(4), k, v)
    raises_one_line(ValueError, r"must have broadcastable leading \(batch, heads\) dims",
                    call, q, torch.rand(3, 3, 7, 4), torch.rand(3, 3, 7, 6))


# d2l's valid_lens: (batch,) or (batch, queries). A 0-dim tensor is refused, not broadcast
# (d2l's own masked_softmax fails on one unless the batch holds a single query).
VALID_LENS_USERS = {
    "masked_softmax": lambda lens: qkv.masked_softmax(torch.rand(2, 3, 4), lens),
    "d2l.masked_softmax": lambda lens: d2l.masked_softmax(torch.rand(2, 3, 4), lens),
    "DotProductAttention": lambda lens: qkv.DotProductAttention()(
        torch.rand(2, 3, 4), torch.rand(2, 4, 4), torch.rand(2, 4, 5), lens),
    "AdditiveAttention": lambda lens: qkv.AdditiveAttention(4, 6, 8)(
        torch.rand(2, 3, 6), torch.rand(2, 4, 4), torch.rand(2, 4, 5), lens),
    "MultiHeadAttention": lambda lens: qkv.MultiHeadAttention(6, 4, None, 0.0, 2)(
        torch.rand(2, 3, 6), valid_lens=lens),
    "MultiHeadAttention+cache": lambda lens: qkv.MultiHeadAttention(6, 4, 8, 0.0, 2)(
        torch.rand(2, 3, 6), valid_lens=lens, cache=qkv.KVCache(2, 2, 8, 2)),
    "d2l.MultiHeadAttention": lambda lens: d2l.MultiHeadAttention(4, 2)(
        torch.rand(2, 3, 4), torch.rand(2, 4, 4), torch.rand(2, 4, 4), lens),
}
EXPECTED_LENS = r"valid_lens must have shape \(2,\) \(one length per sequence\) or \(2, 3\) " \
                r"\(one per query\), got "


@pytest.mark.parametrize("use", list(VALID_LENS_USERS))
def test_valid_lens_shapes(use):
    call = VALID_LENS_USERS[use]
    call(torch.tensor([3, 2]))  # the two valid forms work (3 keys at the fewest)
    call(torch.tensor([[3, 1, 2], [0, 3, 3]]))
    raises_one_line(ValueError, EXPECTED_LENS + r"\(\); for one length shared by all, pass "
                    r"valid_lens.expand\(2\)$", call, torch.tensor(3))
    raises_one_line(ValueError, EXPECTED_LENS + r"\(2, 4\)$", call, torch.ones(2, 4))  # queries
    raises_one_line(ValueError, EXPECTED_LENS + r"\(3, 3\)$", call, torch.ones(3, 3))  # batch
    raises_one_line(ValueError, EXPECTED_LENS + r"\(3,\)$", call, torch.tensor([1, 2, 3]))
    raises_one_line(ValueError, EXPECTED_LENS + r"\(2, 3, 1\)$", call, torch.ones(2, 3, 1))
    raises_one_line(TypeError, r"valid_lens must be a tensor of lengths of shape \(2,\) or "
                    r"\(2, 3\), got list$", call, [4, 2])
    raises_one_line(TypeError, "valid_lens must hold lengths \\(integers\\), got dtype torch.bool",
                    call, torch.tensor([True, False]))


def test_masked_softmax_with_valid_lens_needs_3d_scores():
    raises_one_line(ValueError, r"X must have shape \(batch, queries, keys\) to be masked by "
                    r"valid_lens, got \(3, 4\)", qkv.masked_softmax, torch.rand(3, 4),
                    torch.tensor([1, 2, 3]))
    raises_one_line(TypeError, r"valid_lens must be a tensor of shape \(batch,\) or "
                    r"\(batch, queries\), got list", qkv.lengths_to_mask, [1, 2], 4)
    raises_one_line(TypeError, "mask must be a bool tensor", qkv.functional.softmax_with_mask,
                    torch.rand(2, 3), torch.ones(2, 3))
