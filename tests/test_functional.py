"""qkv.functional: masks, softmaxes and the attention kernel."""

import itertools
import math

import pytest
import torch

import qkv
from qkv import functional as F


def test_stable_softmax_does_not_overflow_where_the_books_does():
    x = torch.tensor([1000.0, 1001.0, 999.0])
    textbook = torch.exp(x) / torch.exp(x).sum()  # the book's naive formula
    assert torch.isnan(textbook).all()
    assert torch.isnan(qkv.softmax_naive(x)).all()  # kept as the book writes it
    ours = qkv.softmax_stable(x)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, torch.softmax(x, dim=0))
    big = torch.randn(4, 7) * 300
    torch.testing.assert_close(qkv.softmax_stable(big, dim=-1), torch.softmax(big, dim=-1))


def test_loop_forms_equal_matrix_forms():
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    torch.testing.assert_close(qkv.all_attention_scores_loop(x), qkv.all_attention_scores(x))
    w = torch.softmax(torch.randn(5), dim=0)
    torch.testing.assert_close(qkv.context_vector_loop(w, x), qkv.context_vector(w, x))


def test_causal_mask_shapes_and_alignment():
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(qkv.causal_mask(3), expected)
    # Two new queries after three cached keys: positions 3 and 4 of 5.
    assert torch.equal(
        qkv.causal_mask(2, 5),
        torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="num_queries <= num_keys"):
        qkv.causal_mask(4, 2)


def test_lengths_to_mask_1d_and_2d():
    m = qkv.lengths_to_mask(torch.tensor([2, 0]), 3)
    assert m.shape == (2, 1, 3)
    assert m.tolist() == [[[True, True, False]], [[False, False, False]]]
    m2 = qkv.lengths_to_mask(torch.tensor([[1, 3], [2, 2]]), 3)
    assert m2.shape == (2, 2, 3)
    assert m2[0].tolist() == [[True, False, False], [True, True, True]]
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(batch,\)"):
        qkv.lengths_to_mask(torch.ones(2, 2, 2), 3)


def test_masked_softmax_follows_the_reference():
    torch.manual_seed(1)
    X = torch.rand(2, 2, 4)
    out = qkv.masked_softmax(X, torch.tensor([2, 3]))
    assert out.shape == (2, 2, 4)
    assert (out[0, :, 2:] == 0).all() and (out[1, :, 3:] == 0).all()
    torch.testing.assert_close(out[0, :, :2], torch.softmax(X[0, :, :2], dim=-1))
    out2 = qkv.masked_softmax(X, torch.tensor([[1, 3], [2, 4]]))
    torch.testing.assert_close(out2[0, 0], torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(out2[1, 1], torch.softmax(X[1, 1], dim=-1))
    torch.testing.assert_close(qkv.masked_softmax(X), torch.softmax(X, dim=-1))
    # Documented reference behaviour: valid length 0 gives a uniform row.
    torch.testing.assert_close(
        qkv.masked_softmax(X, torch.tensor([0, 4]))[0], torch.full((2, 4), 0.25)
    )


def test_softmax_with_mask_zero_rows_and_gradients():
    scores = torch.randn(2, 3, 4, requires_grad=True)
    keep = torch.tensor([[True, True, False, False], [False] * 4])[:, None, :]
    w = F.softmax_with_mask(scores, keep)
    assert (w[1] == 0).all()
    torch.testing.assert_close(w[0].sum(-1), torch.ones(3))
    w.sum().backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("need_weights", [True, False])
def test_attention_kernel_against_formula(need_weights):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 6)
    mask = torch.rand(2, 1, 5, 7) < 0.7
    out, w = qkv.attention(q, k, v, mask=mask, causal=True, need_weights=need_weights)
    qd, kd, vd = q.double(), k.double(), v.double()
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(4)
    allowed = mask & qkv.causal_mask(5, 7)
    ref_w = torch.softmax(scores.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    torch.testing.assert_close(out.double(), ref_w @ vd, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w.double(), ref_w, atol=1e-6, rtol=1e-5)
    else:
        assert w is None


def test_attention_custom_scale():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    out, w = qkv.attention(q, k, v, scale=1.0, need_weights=True)
    torch.testing.assert_close(w, torch.softmax(q @ k.transpose(1, 2), -1))
    fused, _ = qkv.attention(q, k, v, scale=1.0)
    torch.testing.assert_close(fused, out)



def reference_attention(q, k, v, keep):
    """float64 ``softmax(q k^T / sqrt(d)) v`` with ``keep`` broadcast by hand; a query with
    nothing to attend to gets zeros. Shares no code with qkv."""
    qd, kd, vd = q.double(), k.double(), v.double()
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = keep.expand(scores.shape)
    weights = torch.zeros_like(scores)
    for index in itertools.product(*map(range, scores.shape[:-1])):  # one query row each
        row = keep[index]
        if row.any():
            weights[index][row] = torch.softmax(scores[index][row], dim=0)
    return weights @ vd, weights


@pytest.mark.parametrize("need_weights", [True, False], ids=["eager", "fused"])
@pytest.mark.parametrize(
    "mask_shape", [(), (7,), (5, 7), (1, 5, 7), (2, 1, 5, 7), (2, 3, 5, 7), (2, 1, 1, 7)]
)
def test_both_backends_take_any_broadcastable_mask(mask_shape, need_weights):
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 6)
    keep = torch.rand(mask_shape) < 0.6
    if keep.dim() >= 1:
        keep[..., 0] = False  # a key nobody may see ...
    if keep.dim() >= 2:  # ... and a row that may see nothing: zeros, not NaN
        keep[(0,) * (keep.dim() - 1)] = False
    out, w = qkv.attention(q, k, v, mask=keep, need_weights=need_weights)
    ref_out, ref_w = reference_attention(q, k, v, keep)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(w.double(), ref_w, atol=1e-6, rtol=1e-5)
    # all-False and all-True 0-dim masks: nothing to attend to, or no mask at all
    nothing, _ = qkv.attention(q, k, v, mask=torch.tensor(False), need_weights=need_weights)
    assert (nothing == 0).all()
    everything, _ = qkv.attention(q, k, v, mask=torch.tensor(True), need_weights=need_weights)
    torch.testing.assert_close(everything.double(), reference_attention(
        q, k, v, torch.tensor(True))[0], atol=1e-5, rtol=1e-5)
