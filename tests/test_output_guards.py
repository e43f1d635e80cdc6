"""Output is never garbage, and no size a user types is unbounded (issue 21, items 3 and 6):
valid_lens values, reserved tokens in decoding, imported weights, JSON nesting, beam and
max-new-tokens bounds, streamed generation, library warnings and a closed or full stdout."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import functional as F

# ---------------------------------------------------------------------------
# valid_lens: whole numbers in [0, num_keys], or a one-line ValueError


BAD_LENS = [
    (torch.tensor([3.5, 1.0]), r"got 3\.5: not a whole number"),
    (torch.tensor([-1, 2]), r"got -1: negative"),
    (torch.tensor([2, 5]), r"got 5: more than the 4 keys there are"),
    (torch.tensor([float("nan"), 1.0]), r"got nan: not a whole number"),
    (torch.tensor([[1, 2], [2, 7]]), r"got 7: more than the 4 keys"),
]


@pytest.mark.parametrize(("lens", "message"), BAD_LENS)
def test_masked_softmax_refuses_lengths_it_would_round_or_clamp(lens, message):
    X = torch.rand(2, 2, 4)
    with pytest.raises(ValueError, match=r"valid_lens must be whole numbers in \[0, 4\].*"
                                         + message):
        qkv.masked_softmax(X, lens)


@pytest.mark.parametrize(("lens", "message"), BAD_LENS)
def test_attention_modules_refuse_bad_lengths(lens, message):
    torch.manual_seed(0)
    queries, keys = torch.randn(2, 2, 8), torch.randn(2, 4, 8)
    values = torch.randn(2, 4, 3)
    dot = qkv.DotProductAttention(dropout=0.0)
    with pytest.raises(ValueError, match=message):
        dot(queries, keys, values, lens)
    mha = qkv.MultiHeadAttention(8, 8, num_heads=2, dropout=0.0)
    with pytest.raises(ValueError, match=message):
        mha(queries, keys, valid_lens=lens)


def test_whole_number_lengths_of_any_dtype_mean_the_same_as_integers():
    # d2l passes float tensors of whole numbers as well as integer ones; the bounds
    # themselves (0 and the number of keys) are valid.
    torch.manual_seed(0)
    X = torch.rand(3, 2, 4)
    ints = torch.tensor([0, 2, 4])
    expected = torch.softmax(X.masked_fill(torch.arange(4) >= ints[:, None, None], -1e6), -1)
    for lens in (ints, ints.float(), ints.double(), ints.int()):
        torch.testing.assert_close(qkv.masked_softmax(X, lens), expected)


def test_a_length_changed_in_place_is_checked_again():
    # The check reads a tensor's values once however many layers pass it; a change in
    # place must not slip through that.
    X = torch.rand(2, 2, 4)
    lens = torch.tensor([1, 2])
    qkv.masked_softmax(X, lens)
    qkv.masked_softmax(X, lens)
    lens[0] = 9
    with pytest.raises(ValueError, match="got 9"):
        qkv.masked_softmax(X, lens)
    with pytest.raises(ValueError, match="got 3"):  # the same tensor, fewer keys
        qkv.masked_softmax(X[..., :2], torch.tensor([3, 1]))
    assert F.check_valid_lens(torch.tensor([4, 0]), 2, 2, 4) is None
