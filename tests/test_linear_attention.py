"""Gated DeltaNet (qkv.linear_attention): its forms against references outside qkv.

- the rule, recurrent and chunked, against a float64 loop written here from the equations
  (in the transposed layout ``S (d_v x d_k)``, ``o_t = S_t q_t``), with gradcheck and the
  two forms' gradients compared;
- the layer against a float64 forward written here from the equations (``F.conv1d``, the
  norms, the gates), uncached and cached;
- the layer against transformers' own Qwen3-Next and Qwen3.5 ``GatedDeltaNet`` modules
  with random weights, loaded through the documented renames.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.linear_attention import (
    DeltaNetCache,
    GatedDeltaNet,
    gated_delta_rule,
    gated_delta_weights,
    split_qkvz_ba,
)

torch.set_default_dtype(torch.float32)


def delta_reference(q, k, v, g, beta, scale, state=None):
    """The gated delta rule, one token, batch item and head at a time, in float64.

    ``S (d_v x d_k)``: ``S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k_t) k_t^T``,
    ``o_t = S_t (scale q_t)``, ``a_t = exp(g_t)``; value head ``j`` on key head
    ``j // (value_heads / key_heads)``. ``state``: ``(b, h, d_k, d_v)`` as qkv stores it.
    Returns ``out (b, h, T, d_v)`` and the final state ``(b, h, d_k, d_v)``."""
    q, k, v, g, beta = (t.detach().double() for t in (q, k, v, g, beta))
    b, hk, tokens, d_k = q.shape
    hv, d_v = v.shape[1], v.shape[-1]
    out = torch.zeros(b, hv, tokens, d_v, dtype=torch.float64)
    final = torch.zeros(b, hv, d_k, d_v, dtype=torch.float64)
    for n in range(b):
        for h in range(hv):
            kh = h // (hv // hk)
            s = (torch.zeros(d_v, d_k, dtype=torch.float64) if state is None
                 else state[n, h].detach().double().T.clone())
            for t in range(tokens):
                a = math.exp(g[n, h, t].item())
                kt, vt = k[n, kh, t], v[n, h, t]
                s = a * s + beta[n, h, t] * torch.outer(vt - a * (s @ kt), kt)
                out[n, h, t] = s @ (scale * q[n, kh, t])
            final[n, h] = s.T
    return out, final


def rule_inputs(b=2, hk=2, hv=4, tokens=37, d_k=5, d_v=3, dtype=torch.float64, seed=0,
                grad=False):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = F.normalize(randn(b, hk, tokens, d_k), dim=-1), F.normalize(randn(b, hk, tokens, d_k),
                                                                     dim=-1)
    v = randn(b, hv, tokens, d_v)
    g = -torch.rand(b, hv, tokens, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(b, hv, tokens, generator=gen, dtype=dtype)
    state = randn(b, hv, d_k, d_v)
    tensors = [q, k, v, g, beta, state]
    return [t.requires_grad_(grad) for t in tensors]


@pytest.mark.parametrize("tokens", [1, 5, 16, 37])  # < chunk, == chunk, not a multiple
@pytest.mark.parametrize("backend", ["chunked", "recurrent"])
def test_rule_matches_the_equations(tokens, backend):
    q, k, v, g, beta, state = rule_inputs(tokens=tokens)
    want, want_state = delta_reference(q, k, v, g, beta, 0.4, state)
    out, final = gated_delta_rule(q, k, v, g, beta, scale=0.4, initial_state=state,
                                  output_final_state=True, chunk_size=16, backend=backend)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, want_state, rtol=0, atol=1e-12)
    # from a zero state, with the default scale 1 / sqrt(d_k)
    out, none = gated_delta_rule(q, k, v, g, beta, chunk_size=16, backend=backend)
    assert none is None
    torch.testing.assert_close(out, delta_reference(q, k, v, g, beta, 5 ** -0.5)[0],
                               rtol=0, atol=1e-12)


def test_rule_chunk_sizes_and_strong_decay():
    # decays far below float range within a chunk: the masked exponent must not overflow
    q, k, v, g, beta, state = rule_inputs(tokens=40, hk=1, hv=2)
    g = g * 200
    want, _ = delta_reference(q, k, v, g, beta, 1.0, state)
    for size in (1, 3, 40, 64):
        out, _ = gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=state,
                                  chunk_size=size)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_rule_dtypes():
    q, k, v, g, beta, state = rule_inputs(tokens=20, dtype=torch.float32)
    want, want_state = delta_reference(q, k, v, g, beta, 0.5, state)
    for backend in ("chunked", "recurrent"):
        out, final = gated_delta_rule(q, k, v, g, beta, scale=0.5, initial_state=state,
                                      output_final_state=True, chunk_size=8, backend=backend)
        assert out.dtype == final.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(final.double(), want_state, rtol=0, atol=1e-5)
        # bfloat16 values: computed in float32, returned in bfloat16, the state in float32
        out, final = gated_delta_rule(q, k, v.bfloat16(), g, beta, scale=0.5,
                                      initial_state=state, output_final_state=True,
                                      chunk_size=8, backend=backend)
        assert out.dtype == torch.bfloat16 and final.dtype == torch.float32


def test_rule_gradcheck():
    tensors = rule_inputs(b=1, hk=1, hv=2, tokens=5, d_k=3, d_v=2, grad=True)
    assert torch.autograd.gradcheck(
        lambda *t: gated_delta_rule(*t[:5], initial_state=t[5], output_final_state=True,
                                    chunk_size=2),
        tensors)


def test_chunked_gradients_equal_recurrent_ones():
    grads = {}
    for backend in ("chunked", "recurrent"):
        tensors = rule_inputs(tokens=37, grad=True)
        out, final = gated_delta_rule(*tensors[:5], initial_state=tensors[5],
                                      output_final_state=True, chunk_size=16, backend=backend)
        gen = torch.Generator().manual_seed(1)
        loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() + \
            (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
        loss.backward()
        grads[backend] = [t.grad for t in tensors]
    for chunked, recurrent in zip(grads["chunked"], grads["recurrent"], strict=True):
        torch.testing.assert_close(chunked, recurrent, rtol=0, atol=1e-11)


def test_weights_are_the_rule_on_the_values():
    q, k, v, g, beta, _ = rule_inputs(tokens=21)
    weights = gated_delta_weights(q, k, g, beta, scale=0.3, chunk_size=8)
    assert weights.shape == (2, 4, 21, 21)
    want, _ = delta_reference(q, k, v, g, beta, 0.3)
    torch.testing.assert_close(weights @ v, want, rtol=0, atol=1e-12)
    assert (weights.triu(1) == 0).all()
    # one entry from its closed form: beta_s k_s^T (prod_u a_u (I - beta_u k_u k_u^T))^T q_t
    n, h, t, s = 1, 3, 9, 4
    kh = h // 2
    prod = torch.eye(5, dtype=torch.float64)
    for u in range(s + 1, t + 1):
        ku = k[n, kh, u]
        prod = math.exp(g[n, h, u]) * (torch.eye(5, dtype=torch.float64) -
                                       beta[n, h, u] * torch.outer(ku, ku)) @ prod
    closed = beta[n, h, s] * k[n, kh, s] @ prod.T @ (0.3 * q[n, kh, t])
    torch.testing.assert_close(weights[n, h, t, s], closed, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------
# The layer


def make_layer(dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    kwargs = dict(num_v_heads=4, head_v_dim=6, conv_kernel_size=4, chunk_size=8)
    kwargs.update(overrides)
    layer = GatedDeltaNet(16, 2, 5, **kwargs).to(dtype)
    with torch.no_grad():  # weights large enough for every part to matter
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.A_log.uniform_(-2, 1)
    return layer


def reference_heads(layer, x):
    """Float64 ``q, k (b, hk, T, dk)`` normalised, ``v (b, hv, T, dv)``, ``z (b, T, hv, dv)``,
    ``g, beta (b, hv, T)`` of the layer, from its equations: projections, F.conv1d with
    left padding, SiLU, L2 norms, gates."""
    p = {name: t.detach().double() for name, t in layer.state_dict().items()}
    x = x.detach().double()
    b, tokens, _ = x.shape
    hk, dk, hv, dv = layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim
    mixed = x @ p["in_proj_qkv.weight"].T
    width = p["conv1d.weight"].shape[-1]
    mixed = F.conv1d(mixed.transpose(1, 2), p["conv1d.weight"], padding=width - 1,
                     groups=mixed.shape[-1])[..., :tokens]
    mixed = F.silu(mixed).transpose(1, 2)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)

    def heads(t, h, d):
        return t.reshape(b, tokens, h, d).transpose(1, 2)

    q = heads(q, hk, dk) / torch.sqrt((heads(q, hk, dk) ** 2).sum(-1, keepdim=True) + 1e-6)
    k = heads(k, hk, dk) / torch.sqrt((heads(k, hk, dk) ** 2).sum(-1, keepdim=True) + 1e-6)
    z = (x @ p["in_proj_z.weight"].T).reshape(b, tokens, hv, dv)
    beta = torch.sigmoid(x @ p["in_proj_b.weight"].T).transpose(1, 2)
    g = (-torch.exp(p["A_log"]) * F.softplus(x @ p["in_proj_a.weight"].T + p["dt_bias"])
         ).transpose(1, 2)
    return q, k, heads(v, hv, dv), z, g, beta


def layer_reference(layer, x):
    """The layer in float64, from its equations: :func:`reference_heads`,
    :func:`delta_reference`, the gated RMSNorm, out_proj."""
    q, k, v, z, g, beta = reference_heads(layer, x)
    b, tokens, _ = x.shape
    out, _ = delta_reference(q, k, v, g, beta, layer.head_k_dim ** -0.5)
    out = out.transpose(1, 2)  # (b, T, hv, dv)
    out = out / torch.sqrt((out ** 2).mean(-1, keepdim=True) + layer.norm.eps)
    out = layer.norm.weight.detach().double() * out * F.silu(z)
    return out.reshape(b, tokens, -1) @ layer.out_proj.weight.detach().double().T


@pytest.mark.parametrize("backend", ["chunked", "recurrent"])
def test_layer_matches_the_equations(backend):
    layer = make_layer(backend=backend)
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), layer_reference(layer, x), rtol=0, atol=1e-10)


def test_layer_float32_and_bfloat16():
    layer = make_layer(torch.float32)
    x = torch.randn(2, 19, 16)
    want = layer_reference(layer, x)
    torch.testing.assert_close(layer(x).double(), want, rtol=0, atol=1e-4)
    out = layer.bfloat16()(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.double() - want).abs().max() < 0.1 * want.abs().max()


def test_layer_cache_continues_a_chunked_prompt():
    layer = make_layer(chunk_size=4)
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    full = layer(x)
    cache = layer.new_cache(2)
    size = cache.nbytes
    parts = [layer(x[:, :13], cache=cache)]  # a prompt of several chunks
    parts += [layer(x[:, t : t + 1], cache=cache) for t in range(13, 18)]  # one at a time
    parts.append(layer(x[:, 18:], cache=cache))  # then several tokens again
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-12)
    assert cache.pos == 23 and cache.nbytes == size
    # a prompt shorter than the convolution's window
    cache = layer.new_cache(2)
    parts = [layer(x[:, :2], cache=cache)] + [layer(x[:, t : t + 1], cache=cache)
                                              for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(parts, dim=1), layer(x[:, :6]), rtol=0, atol=1e-12)


def test_layer_gradients_chunked_equal_recurrent():
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    grads = {}
    for backend in ("chunked", "recurrent"):
        layer = make_layer(backend=backend)
        xi = x.clone().requires_grad_()
        (layer(xi) ** 2).sum().backward()
        grads[backend] = [xi.grad] + [p.grad for p in layer.parameters()]
    for chunked, recurrent in zip(grads["chunked"], grads["recurrent"], strict=True):
        torch.testing.assert_close(chunked, recurrent, rtol=1e-10, atol=1e-10)


def test_layer_token_weights():
    layer = make_layer()
    x = torch.randn(1, 11, 16, dtype=torch.float64)
    out, weights = layer(x, need_weights=True)
    torch.testing.assert_close(out, layer(x), rtol=0, atol=0)
    assert weights.shape == (1, 4, 11, 11)
    torch.testing.assert_close(layer.token_weights(x), weights, rtol=0, atol=0)
    # W @ v is the rule's output, for the layer's own q, k, v and gates
    q, k, v, z, g, beta = reference_heads(layer, x)
    want, _ = delta_reference(q, k, v, g, beta, 5 ** -0.5)
    torch.testing.assert_close(weights @ v, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------
# Against transformers' own layers


def hf_modules():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    shape = dict(hidden_size=16, num_hidden_layers=1, layer_types=["linear_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=5,
                 linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    configs = {"qwen3_next": transformers.Qwen3NextConfig(**shape),
               "qwen3_5": transformers.Qwen3_5TextConfig(**shape)}
    classes = {"qwen3_next": Qwen3NextGatedDeltaNet, "qwen3_5": Qwen3_5GatedDeltaNet}
    return transformers, configs, classes


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_layer_matches_transformers(family):
    transformers, configs, classes = hf_modules()
    config = configs[family]
    torch.manual_seed(3)
    theirs = classes[family](config, 0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    state = {name: t.clone() for name, t in theirs.state_dict().items()}
    if family == "qwen3_next":
        state = split_qkvz_ba(state, num_k_heads=2, num_v_heads=4, head_k_dim=5, head_v_dim=6)
    ours = GatedDeltaNet(16, 2, 5, num_v_heads=4, head_v_dim=6, conv_kernel_size=4,
                         norm_eps=config.rms_norm_eps)
    ours.load_state_dict(state)
    x = torch.randn(2, 70, 16)  # more than transformers' chunk of 64
    with torch.no_grad():
        want = theirs(x)
        torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)
        # cached: a prompt of 66 tokens, then one token at a time, on both sides
        hf_cache = transformers.DynamicCache(config=config)
        cache = ours.new_cache(2)
        steps = [(theirs(x[:, :66], cache=hf_cache), ours(x[:, :66], cache=cache))]
        steps += [(theirs(x[:, t : t + 1], cache=hf_cache), ours(x[:, t : t + 1], cache=cache))
                  for t in range(66, 70)]
    for hf_out, our_out in steps:
        torch.testing.assert_close(our_out, hf_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([o for _, o in steps], dim=1), want, rtol=0,
                               atol=1e-5)


# ----------------------------------------------------------------------------
# Refusals: one line each, naming the value


def one_line(excinfo):
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


def test_rule_refusals():
    q, k, v, g, beta, state = rule_inputs(tokens=4)
    cases = [
        (dict(backend="fast"), "backend must be one of ('chunked', 'recurrent'), got 'fast'"),
        (dict(chunk_size=0), "chunk_size must be a positive number of tokens, got 0"),
        (dict(scale=-1.0), "scale must be a finite number in (0.0, inf), got -1.0"),
        (dict(initial_state=state[:, :1]), "initial_state must have shape (2, 4, 5, 3)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            gated_delta_rule(q, k, v, g, beta, **kwargs)
        assert message in one_line(e)
    bad = [
        ((q, k[:, :1], v, g, beta), "q and k must have the same shape"),
        ((q, k, v[..., :3, :], g, beta), "v must have shape (2, value_heads, 4, d_v)"),
        ((q, k, v[:, :3], g[:, :3], beta[:, :3]), "value heads (3) must be a multiple of key "
                                                 "heads (2)"),
        ((q, k, v, g[..., :2], beta), "g must have shape (2, 4, 4)"),
        ((q, k, v, g, beta.long()), "beta must be a floating-point tensor, got torch.int64"),
        ((q[:, :, :0], k[:, :, :0], v[:, :, :0], g[..., :0], beta[..., :0]), "T = 0"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError) as e:
            gated_delta_rule(*args)
        assert message in one_line(e)


def test_layer_refusals():
    with pytest.raises(ValueError) as e:
        GatedDeltaNet(16, 3, 4, num_v_heads=4)
    assert "num_v_heads (4) must be a multiple of num_k_heads (3)" in one_line(e)
    with pytest.raises(ValueError) as e:
        GatedDeltaNet(16, 2, 4, backend="eager")
    assert "backend must be one of ('chunked', 'recurrent'), got 'eager'" in one_line(e)
    with pytest.raises(ValueError) as e:
        GatedDeltaNet(16, 2, 4, conv_kernel_size=0)
    assert "conv_kernel_size must be a positive integer, got 0" in one_line(e)
    with pytest.raises(ValueError) as e:
        GatedDeltaNet(16, 2, 4, norm_eps=0.0)
    assert "norm_eps must be a finite number in (0.0, inf), got 0.0" in one_line(e)
    layer = make_layer()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError) as e:
        layer(x[..., :8])
    assert "x must have shape (batch, tokens, 16), got (2, 3, 8)" in one_line(e)
    with pytest.raises(ValueError) as e:
        layer(x, cache=layer.new_cache(3))
    assert "make it with new_cache(2)" in one_line(e)
    with pytest.raises(ValueError) as e:
        layer(x, cache=layer.new_cache(2), need_weights=True)
    assert "need_weights needs the whole sequence in one call" in one_line(e)
    with pytest.raises(TypeError) as e:
        layer(x, cache={"conv": None})
    assert "cache must be a DeltaNetCache" in one_line(e)
    assert isinstance(layer.new_cache(2), DeltaNetCache)
    with pytest.raises(ValueError) as e:
        split_qkvz_ba({"in_proj_qkvz.weight": torch.zeros(10, 16),
                       "in_proj_ba.weight": torch.zeros(16, 16)},
                      num_k_heads=2, num_v_heads=4, head_k_dim=5, head_v_dim=6)
    assert "in_proj_qkvz.weight must have 68 rows (2 key heads x 34), got (10, 16)" in \
        one_line(e)
    with pytest.raises(ValueError) as e:
        split_qkvz_ba({}, num_k_heads=2, num_v_heads=4, head_k_dim=5, head_v_dim=6)
    assert "state dict lacks in_proj_qkvz.weight or in_proj_ba.weight" in one_line(e)
