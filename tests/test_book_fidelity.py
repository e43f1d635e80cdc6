"""The books' formulas as the books write them: softmax_naive (overflow included) beside
softmax_stable, and d2l's sinusoidal positional table.

References are re-statements of the books' code or float64 computations, never qkv's.
"""

import math

import pytest
import torch

import qkv
from qkv.book.walkthrough import walkthrough_steps
from qkv.positional import sinusoidal_table

# LLMs-from-scratch §3.3.1: x2's softmax weights, as printed in the book.
BOOK_WEIGHTS_2 = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]


def test_softmax_naive_overflows_as_the_book_teaches():
    out = qkv.softmax_naive(torch.tensor([1000.0, 0.0]))
    # exp(1000) is inf in float32: inf / inf = nan, 1 / inf = 0
    assert math.isnan(out[0].item())
    assert out[1].item() == 0.0


def test_softmax_stable_gives_the_right_weights_where_naive_overflows():
    out = qkv.softmax_stable(torch.tensor([1000.0, 0.0]))
    assert out.tolist() == [1.0, 0.0]
    x = torch.tensor([1000.0, 1001.0, 999.0])
    e = [math.exp(v - 1001.0) for v in (1000.0, 1001.0, 999.0)]  # float64 by hand
    expected = torch.tensor([v / sum(e) for v in e])
    torch.testing.assert_close(qkv.softmax_stable(x), expected)
    assert torch.isnan(qkv.softmax_naive(x)).all()


def test_softmax_naive_is_the_books_formula():
    torch.manual_seed(0)
    x = torch.randn(7) * 5
    book = torch.exp(x) / torch.exp(x).sum(dim=0)  # the book's line
    assert torch.equal(qkv.softmax_naive(x), book)
    assert torch.equal(qkv.softmax_naive(x, dim=0), book)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_naive_and_stable_agree_where_naive_does_not_overflow(dim):
    torch.manual_seed(1)
    x = torch.randn(4, 6, dtype=torch.float64) * 10
    reference = torch.exp(x) / torch.exp(x).sum(dim=dim, keepdim=True)  # float64
    torch.testing.assert_close(qkv.softmax_naive(x.float(), dim=dim), reference.float())
    torch.testing.assert_close(qkv.softmax_stable(x.float(), dim=dim), reference.float())


def test_walkthrough_shows_where_the_two_softmaxes_part():
    step = walkthrough_steps()[0]
    assert step.section == "3.3.1"
    naive = [t for name, t in step.tensors.items() if name.startswith("softmax_naive(")]
    stable = [t for name, t in step.tensors.items() if name.startswith("softmax_stable(")]
    assert len(naive) == len(stable) == 1
    assert torch.isnan(naive[0]).all()
    # a constant added to every score leaves softmax unchanged: the book's weights again
    assert stable[0].tolist() == pytest.approx(BOOK_WEIGHTS_2, abs=1e-4)
    assert step.tensors["attn_weights_2_naive"].tolist() == pytest.approx(
        BOOK_WEIGHTS_2, abs=1e-4
    )
    text = step.render()
    assert "nan" in text and "softmax_stable" in text


def d2l_table(max_len: int, num_hiddens: int) -> torch.Tensor:
    """d2l's PositionalEncoding.__init__, restated: (1, max_len, num_hiddens), float32."""
    P = torch.zeros((1, max_len, num_hiddens))
    X = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
        10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens
    )
    P[:, :, 0::2] = torch.sin(X)
    P[:, :, 1::2] = torch.cos(X)
    return P


def float64_table(max_len: int, num_hiddens: int) -> torch.Tensor:
    """sin/cos(pos / 10000^(2j/d)) in float64, one column at a time."""
    pos = torch.arange(max_len, dtype=torch.float64)
    table = torch.zeros(max_len, num_hiddens, dtype=torch.float64)
    for j in range(num_hiddens // 2):
        angle = pos / 10000 ** (2 * j / num_hiddens)
        table[:, 2 * j] = torch.sin(angle)
        table[:, 2 * j + 1] = torch.cos(angle)
    return table


@pytest.mark.parametrize(("max_len", "num_hiddens"), [(60, 32), (1000, 32), (1000, 512), (7, 2)])
def test_positional_table_is_d2ls(max_len, num_hiddens):
    pe = qkv.PositionalEncoding(num_hiddens, 0.0, max_len=max_len)
    torch.testing.assert_close(pe.P, d2l_table(max_len, num_hiddens), atol=1e-7, rtol=0)
    torch.testing.assert_close(
        sinusoidal_table(max_len, num_hiddens), d2l_table(max_len, num_hiddens)[0],
        atol=1e-7, rtol=0,
    )
    # float32 angles near position 1000 are rounded to about 6e-5
    atol = 1e-4 if max_len > 100 else 5e-6
    torch.testing.assert_close(
        pe.P[0].double(), float64_table(max_len, num_hiddens), atol=atol, rtol=0
    )
