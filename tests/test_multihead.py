"""qkv.MultiHeadAttention against independent references.

References: torch.nn.MultiheadAttention with copied weights, a naive float64
loop implementation (tests/reference.py), and the book's teaching classes
after mapping weights between them.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qkv
from reference import naive_mha


def torch_mha_like(ours: qkv.MultiHeadAttention) -> nn.MultiheadAttention:
    """An nn.MultiheadAttention holding exactly our weights."""
    same_width = ours.kdim == ours.d_out and ours.vdim == ours.d_out
    ref = nn.MultiheadAttention(
        ours.d_out,
        ours.num_heads,
        bias=True,
        kdim=ours.kdim,
        vdim=ours.vdim,
        batch_first=True,
    )
    with torch.no_grad():
        w = [ours.W_query.weight, ours.W_key.weight, ours.W_value.weight]
        if same_width:
            ref.in_proj_weight.copy_(torch.cat(w))
        else:
            ref.q_proj_weight.copy_(w[0])
            ref.k_proj_weight.copy_(w[1])
            ref.v_proj_weight.copy_(w[2])
        biases = [ours.W_query.bias, ours.W_key.bias, ours.W_value.bias]
        ref.in_proj_bias.copy_(
            torch.cat([b if b is not None else torch.zeros(ours.d_out) for b in biases])
        )
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    return ref.eval()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_matches_torch_multihead_self_attention(causal, qkv_bias, backend):
    torch.manual_seed(0)
    ours = qkv.MultiHeadAttention(
        16, 16, 12, 0.0, 4, qkv_bias=qkv_bias, causal=causal, backend=backend
    ).eval()
    ref = torch_mha_like(ours)
    x = torch.randn(3, 9, 16)
    attn_mask = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1) if causal else None
    expected, expected_w = ref(x, x, x, attn_mask=attn_mask, average_attn_weights=False)
    out, weights = ours(x, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_padding_matches_torch_multihead(causal):
    torch.manual_seed(1)
    ours = qkv.MultiHeadAttention(8, 8, None, 0.0, 2, causal=causal).eval()
    ref = torch_mha_like(ours)
    x = torch.randn(3, 5, 8)
    valid_lens = torch.tensor([5, 2, 1])
    pad = torch.arange(5)[None, :] >= valid_lens[:, None]  # True = padding, as nn.MHA
    attn_mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1) if causal else None
    expected, _ = ref(x, x, x, key_padding_mask=pad, attn_mask=attn_mask, need_weights=False)
    torch.testing.assert_close(ours(x, valid_lens=valid_lens), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x, key_padding_mask=pad), expected, atol=1e-5, rtol=1e-5)


def test_cross_attention_other_widths_matches_torch_multihead():
    torch.manual_seed(2)
    ours = qkv.MultiHeadAttention(12, 12, None, 0.0, 3, causal=False, kdim=7, vdim=5).eval()
    ref = torch_mha_like(ours)
    x, key, value = torch.randn(2, 4, 12), torch.randn(2, 6, 7), torch.randn(2, 6, 5)
    pad = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    expected, expected_w = ref(x, key, value, key_padding_mask=pad, average_attn_weights=False)
    out, weights = ours(x, key, value, key_padding_mask=pad, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, expected_w, atol=1e-6, rtol=1e-5)


def test_bool_mask_conventions_against_sdpa():
    """key_padding_mask True = padding; SDPA's attn_mask True = take part."""
    torch.manual_seed(3)
    ours = qkv.MultiHeadAttention(8, 8, None, 0.0, 1, causal=False).eval()
    x = torch.randn(2, 4, 8)
    pad = torch.tensor([[False, False, True, True], [False, True, True, True]])
    q, k, v = ours.W_query(x), ours.W_key(x), ours.W_value(x)
    sdpa = nn.functional.scaled_dot_product_attention(
        q[:, None], k[:, None], v[:, None], attn_mask=~pad[:, None, None, :]
    )[:, 0]
    torch.testing.assert_close(ours(x, key_padding_mask=pad), ours.out_proj(sdpa))
    # The inverted mask must give a different answer: the convention matters.
    assert not torch.allclose(ours(x, key_padding_mask=~pad), ours.out_proj(sdpa))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    tq=st.integers(1, 6),
    extra_keys=st.integers(0, 3),
    heads=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    causal=st.booleans(),
    padding=st.sampled_from(["none", "lens", "lens2d", "mask"]),
    backend=st.sampled_from(["fused", "eager"]),
    cross=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_naive_float64(
    batch, tq, extra_keys, heads, head_dim, causal, padding, backend, cross, seed
):
    g = torch.Generator().manual_seed(seed)
    d_out = heads * head_dim
    tk = tq + extra_keys if cross else tq
    kdim = 3 if cross else 5
    torch.manual_seed(seed)
    mha = qkv.MultiHeadAttention(
        5, d_out, None, 0.0, heads, qkv_bias=True, causal=causal, kdim=kdim, vdim=kdim,
        backend=backend,
    ).double()
    x = torch.randn(batch, tq, 5, generator=g, dtype=torch.float64)
    key = torch.randn(batch, tk, kdim, generator=g, dtype=torch.float64) if cross else None
    kwargs, ref_kwargs = {}, {}
    if padding == "lens":  # includes 0: fully masked rows must come out as zeros
        lens = torch.randint(0, tk + 1, (batch,), generator=g)
        kwargs, ref_kwargs = {"valid_lens": lens}, {"valid_lens": lens}
    elif padding == "lens2d":
        lens = torch.randint(0, tk + 1, (batch, tq), generator=g)
        kwargs, ref_kwargs = {"valid_lens": lens}, {"valid_lens": lens}
    elif padding == "mask":
        pad = torch.rand(batch, tk, generator=g) < 0.4
        kwargs, ref_kwargs = {"key_padding_mask": pad}, {"pad": pad}
    out, weights = mha(x, key, need_weights=True, **kwargs)
    exp_out, exp_w = naive_mha(mha, x, key, **ref_kwargs)
    # Zero-attention rows: the naive reference leaves the heads at 0, so the
    # output there is out_proj's bias; compare everything in one go.
    torch.testing.assert_close(out, exp_out, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(weights, exp_w, atol=1e-10, rtol=1e-9)
    fused = mha(x, key, **kwargs)
    torch.testing.assert_close(fused, exp_out, atol=1e-10, rtol=1e-9)
    # float32 stays within 1e-5 of the float64 truth
    out32 = mha.float()(x.float(), None if key is None else key.float(), **kwargs)
    torch.testing.assert_close(out32.double(), exp_out, atol=1e-5, rtol=1e-4)


def test_fused_equals_eager_float32():
    torch.manual_seed(4)
    mha = qkv.MultiHeadAttention(64, 64, 128, 0.0, 8).eval()
    x = torch.randn(4, 100, 64)
    lens = torch.tensor([100, 50, 1, 0])
    for kwargs in ({}, {"valid_lens": lens}):
        mha.backend = "fused"
        fused = mha(x, **kwargs)
        mha.backend = "eager"
        eager = mha(x, **kwargs)
        assert (fused - eager).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(backend):
    torch.manual_seed(5)
    mha = qkv.MultiHeadAttention(6, 6, None, 0.0, 2, backend=backend, out_bias=False)
    x = torch.randn(3, 4, 6, requires_grad=True)
    lens = torch.tensor([0, 2, 4])
    out = mha(x, valid_lens=lens)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0  # nothing to attend to
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mha.parameters())
    # Left padding + causal: the first queries of row 0 see only padding.
    x.grad = None
    pad = torch.tensor([[True, True, False, False], [False] * 4, [False] * 4])
    out = mha(x, key_padding_mask=pad)
    assert out[0, :2].abs().max() == 0 and out[0, 2:].abs().max() > 0
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()


def test_weight_transfer_v2_to_v1(inputs):
    torch.manual_seed(789)
    v2 = qkv.SelfAttention_v2(3, 2)
    v1 = qkv.SelfAttention_v1(3, 2)
    with torch.no_grad():
        v1.W_query.copy_(v2.W_query.weight.T)
        v1.W_key.copy_(v2.W_key.weight.T)
        v1.W_value.copy_(v2.W_value.weight.T)
    torch.testing.assert_close(v1(inputs), v2(inputs))


def test_wrapper_equals_weight_split_after_mapping(batch):
    torch.manual_seed(6)
    wrapper = qkv.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=3)
    mha = qkv.MultiHeadAttention(3, 6, 6, 0.0, num_heads=3)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            stacked = torch.cat([getattr(h, name).weight for h in wrapper.heads])
            getattr(mha, name).weight.copy_(stacked)
        # The wrapper concatenates heads with no output projection: use identity.
        mha.out_proj.weight.copy_(torch.eye(6))
        mha.out_proj.bias.zero_()
    torch.testing.assert_close(mha(batch), wrapper(batch))


def test_heads_equal_a_loop_over_heads():
    torch.manual_seed(7)
    mha = qkv.MultiHeadAttention(8, 8, None, 0.0, 4, causal=False)
    x = torch.randn(2, 5, 8)
    _, weights = mha(x, need_weights=True)
    q = mha.W_query(x).view(2, 5, 4, 2).transpose(1, 2)
    k = mha.W_key(x).view(2, 5, 4, 2).transpose(1, 2)
    for h in range(4):
        scores = q[:, h] @ k[:, h].transpose(1, 2) / math.sqrt(2)
        torch.testing.assert_close(weights[:, h], torch.softmax(scores, dim=-1))


def test_dropout_off_in_eval_and_scaled_in_training():
    torch.manual_seed(8)
    ca = qkv.CausalAttention(8, 4, 16, 0.5)
    x = torch.randn(2, 16, 8)
    q, k, v = ca.W_query(x), ca.W_key(x), ca.W_value(x)
    scores = (q @ k.transpose(1, 2)).masked_fill(ca.mask.bool(), float("-inf"))
    weights = torch.softmax(scores / 2, dim=-1)

    ca.eval()
    torch.testing.assert_close(ca(x), weights @ v)

    # Training: each weight is kept with probability 1 - p and then scaled by
    # 1 / (1 - p) = 2, so the surviving entries are doubled.
    ca.train()
    torch.manual_seed(10)
    out = ca(x)
    torch.manual_seed(10)
    scaled_keep = nn.functional.dropout(torch.ones_like(weights), 0.5)
    assert set(scaled_keep.unique().tolist()) == {0.0, 2.0}
    torch.testing.assert_close(ca.attention_weights, weights)  # kept before dropout
    torch.testing.assert_close(out, (weights * scaled_keep) @ v)
    assert not torch.allclose(out, weights @ v)


def test_fused_dropout_is_active_in_training_only():
    torch.manual_seed(11)
    mha = qkv.MultiHeadAttention(8, 8, None, 0.3, 2)
    x = torch.randn(2, 32, 8)
    mha.train()
    assert not torch.allclose(mha(x), mha(x))
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))


@pytest.mark.parametrize(
    "dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-10), (torch.bfloat16, 3e-2)]
)
@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_dtypes(dtype, atol, backend):
    torch.manual_seed(12)
    mha = qkv.MultiHeadAttention(16, 16, 32, 0.0, 4, backend=backend)
    x = torch.randn(2, 10, 16)
    lens = torch.tensor([10, 3])
    exp_out, _ = naive_mha(mha, x, valid_lens=lens)
    out = mha.to(dtype)(x.to(dtype), valid_lens=lens)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), exp_out, atol=atol, rtol=atol)


def test_torch_compile():
    torch.manual_seed(13)
    mha = qkv.MultiHeadAttention(16, 16, None, 0.0, 4).eval()
    x = torch.randn(2, 8, 16)
    lens = torch.tensor([8, 5])
    # Inductor for real (it compiles C++ on the CPU); fullgraph: no graph breaks.
    compiled = torch.compile(mha, fullgraph=True)
    torch.testing.assert_close(compiled(x), mha(x))
    torch.testing.assert_close(compiled(x, valid_lens=lens), mha(x, valid_lens=lens))


def test_no_context_length_means_any_length_without_tt_mask(monkeypatch):
    mha = qkv.MultiHeadAttention(8, 8, None, 0.0, 2).eval()
    built = []
    real = qkv.functional.causal_mask
    monkeypatch.setattr(
        qkv.functional, "causal_mask", lambda *a, **k: built.append(a) or real(*a, **k)
    )
    out = mha(torch.randn(1, 3000, 8))
    assert out.shape == (1, 3000, 8)
    assert built == []  # is_causal path: no T x T mask was materialised


def test_state_dict_from_book_layer_loads():
    """The book's layer saves its causal mask as a buffer; we accept and drop it."""
    torch.manual_seed(14)
    mha = qkv.MultiHeadAttention(4, 4, 6, 0.0, 2)
    book_state = dict(mha.state_dict())
    book_state["mask"] = torch.triu(torch.ones(6, 6), diagonal=1)
    fresh = qkv.MultiHeadAttention(4, 4, 6, 0.0, 2)
    fresh.load_state_dict(book_state)
    x = torch.randn(1, 6, 4)
    torch.testing.assert_close(fresh(x), mha(x))


def test_kv_cache_matches_full_forward():
    torch.manual_seed(15)
    mha = qkv.MultiHeadAttention(8, 8, 12, 0.0, 2).eval()
    x = torch.randn(2, 10, 8)
    full = mha(x)
    cache = mha.new_cache(batch_size=2)
    steps = [mha(x[:, :4], cache=cache)]  # a prompt chunk, then one token at a time
    steps += [mha(x[:, t : t + 1], cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=1e-5)
    assert cache.pos == 10
    with pytest.raises(ValueError, match="longer than context_length=12"):
        mha(torch.randn(2, 3, 8), cache=cache)


def test_buffers_and_parameters_move_with_to():
    ca = qkv.CausalAttention(3, 2, 6, 0.0).to(torch.float64)
    assert ca.mask.dtype == torch.float64
    assert "mask" in dict(ca.named_buffers())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    torch.manual_seed(16)
    mha = qkv.MultiHeadAttention(32, 32, 64, 0.0, 4).eval()
    x = torch.randn(2, 64, 32)
    lens = torch.tensor([64, 7])
    expected = mha(x, valid_lens=lens)
    got = mha.cuda()(x.cuda(), valid_lens=lens)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
