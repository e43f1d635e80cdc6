"""Grouped-query attention, sliding windows and RoPE in qkv.MultiHeadAttention, against a
float64 reference written out here from the definitions, with the layer's own weights."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from qkv import MultiHeadAttention
from qkv.kv_cache import KVCache, kv_cache_bytes

D, H = 16, 4  # width and query heads: head_dim 4


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE by its definition: dimension i and i + d/2 of each head form a 2-D vector,
    turned by the angle position * base^(-2i/d). ``x (heads, T, d)``."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        angle = positions.double() * base ** (-2 * i / d)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., :, i : i + 1], x[..., :, i + d // 2 : i + d // 2 + 1]
        out[..., :, i : i + 1] = a * c - b * s
        out[..., :, i + d // 2 : i + d // 2 + 1] = a * s + b * c
    return out


def reference(layer: MultiHeadAttention, x: torch.Tensor, *, valid_len: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(T, d_out)`` and weights ``(heads, T, T)`` of ``layer`` on one sequence
    ``x (T, d_in)``, in float64, by loops over the definitions."""
    x = x.double()
    T, hd, g = len(x), layer.head_dim, layer.num_kv_groups

    def heads(linear: torch.nn.Linear, n: int) -> torch.Tensor:
        y = x @ linear.weight.double().T
        if linear.bias is not None:
            y = y + linear.bias.double()
        return y.view(T, n, hd).transpose(0, 1)  # (n, T, hd)

    q, k, v = heads(layer.W_query, H), heads(layer.W_key, g), heads(layer.W_value, g)
    if layer.rope:
        positions = torch.arange(T)
        q, k = rotate_pairs(q, positions, layer.rope_base), rotate_pairs(k, positions,
                                                                          layer.rope_base)
    weights = torch.zeros(H, T, T, dtype=torch.float64)
    out = torch.zeros(H, T, hd, dtype=torch.float64)
    for h in range(H):
        kv = h // (H // g)  # the key/value head this query head shares
        for i in range(T):
            seen = [j for j in range(T)
                    if (not layer.causal or j <= i)
                    and (layer.window_size is None or j > i - layer.window_size)
                    and (valid_len is None or j < valid_len)]
            scores = torch.stack([q[h, i] @ k[kv, j] / math.sqrt(hd) for j in seen])
            w = torch.softmax(scores, dim=0)
            weights[h, i, seen] = w
            out[h, i] = sum(wj * v[kv, j] for wj, j in zip(w, seen, strict=True))
    merged = out.transpose(0, 1).reshape(T, H * hd)
    result = merged @ layer.out_proj.weight.double().T + layer.out_proj.bias.double()
    return result, weights


def make(groups=H, window=None, rope=False, backend="fused", seed=0, **kw):
    torch.manual_seed(seed)
    return MultiHeadAttention(D, D, kw.pop("context_length", 12), 0.0, H, qkv_bias=True,
                              num_kv_groups=groups, window_size=window, rope=rope,
                              rope_base=kw.pop("rope_base", 100.0), backend=backend,
                              **kw).double().eval()


COMBOS = list(itertools.product([H, 2, 1], [None, 3], [False, True], ["fused", "eager"]))


@pytest.mark.parametrize("groups,window,rope,backend", COMBOS)
def test_every_combination_matches_the_definition_in_float64(groups, window, rope, backend):
    layer = make(groups, window, rope, backend)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    out, weights = layer(x, need_weights=True)
    plain = layer(x)
    for b in range(2):
        want_out, want_w = reference(layer, x[b])
        torch.testing.assert_close(out[b], want_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(plain[b], want_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weights[b], want_w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("groups,window,rope,backend", COMBOS)
def test_cached_decoding_equals_the_full_forward(groups, window, rope, backend):
    layer = make(groups, window, rope, backend)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    full = layer(x)
    for chunks in ([1] * 9, [4, 1, 2, 2], [5, 4]):
        cache = layer.new_cache(2)
        assert cache.keys.shape[1] == groups  # only the key/value heads are stored
        assert cache.max_len == (12 if window is None else window)
        outs, start = [], 0
        for n in chunks:
            outs.append(layer(x[:, start : start + n], cache=cache))
            start += n
            assert cache.stored <= cache.max_len
        torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rope", [False, True])
def test_a_window_decodes_past_the_context_length_in_window_sized_memory(rope):
    layer = make(2, 3, rope, context_length=6)
    x = torch.randn(1, 20, D, dtype=torch.float64)
    cache = layer.new_cache(1)
    outs = [layer(x[:, :4], cache=cache)]  # a prefill longer than the window
    for t in range(4, 20):
        outs.append(layer(x[:, t : t + 1], cache=cache))
    assert cache.pos == 20 and cache.keys.shape[2] == 3  # 20 tokens, 3 slots
    want, _ = reference(layer, x[0])  # the definition has no context limit
    torch.testing.assert_close(torch.cat(outs, dim=1)[0], want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="longer than context_length=6"):
        layer(x[:, :7])  # without a ring, the context still bounds a forward


def test_grouped_heads_agree_with_pytorchs_own_enable_gqa():
    layer = make(2, backend="eager")
    x = torch.randn(2, 7, D, dtype=torch.float64)
    q = layer._split_heads(layer.W_query(x))  # noqa: SLF001 - the layer's projections
    k = layer._split_heads(layer.W_key(x))  # noqa: SLF001
    v = layer._split_heads(layer.W_value(x))  # noqa: SLF001
    assert (q.shape[1], k.shape[1]) == (4, 2)
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = layer.out_proj(heads.transpose(1, 2).reshape(2, 7, D))
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-12)


def test_padding_masks_still_work_with_grouped_heads():
    layer = make(2, causal=False)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    valid = torch.tensor([4, 6])
    out = layer(x, valid_lens=valid)
    for b in range(2):
        want, _ = reference(layer, x[b], valid_len=int(valid[b]))
        torch.testing.assert_close(out[b], want, rtol=1e-10, atol=1e-12)


def test_cross_attention_with_grouped_heads_and_the_self_attention_only_options():
    layer = make(2, causal=False, kdim=8, vdim=8)
    out = layer(torch.randn(2, 3, D, dtype=torch.float64),
                torch.randn(2, 5, 8, dtype=torch.float64))
    assert out.shape == (2, 3, D) and layer.W_key.weight.shape == (2 * 4, 8)
    for kw in ({"rope": True}, {"window": 2}):
        rotating = make(**kw)
        with pytest.raises(ValueError, match="self-attention only"):
            rotating(torch.randn(1, 3, D, dtype=torch.float64),
                     torch.randn(1, 3, D, dtype=torch.float64))


def test_bad_options_are_one_line_errors():
    cases = [({"num_kv_groups": 3}, "num_kv_groups \\(3\\) must divide num_heads \\(4\\)"),
             ({"num_kv_groups": 0}, "num_kv_groups"),
             ({"window_size": 0}, "window_size"),
             ({"window_size": 2, "causal": False}, "window_size needs causal=True"),
             ({"rope_base": 1.0}, "rope_base"),
             ({"rope": "yes"}, "rope")]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            MultiHeadAttention(D, D, 8, 0.0, H, **kw)
    with pytest.raises(ValueError, match="even head_dim"):
        MultiHeadAttention(D, 12, 8, 0.0, 4, rope=True)  # head_dim 3
    ring = make(window=2).new_cache(1)
    with pytest.raises(ValueError, match="ring cache"):
        make(window=2)(torch.randn(1, 2, D, dtype=torch.float64), cache=ring,
                       key_padding_mask=torch.zeros(1, 2, dtype=torch.bool))


def test_kv_cache_bytes_counts_layers_heads_positions_and_the_window():
    # GPT-2 small: 12 layers x 12 heads x 64 dims, float32, 1,024 tokens: 72 MiB per row
    small = kv_cache_bytes(layers=12, kv_heads=12, head_dim=64, batch=1, tokens=1024)
    assert small == 12 * 12 * 1024 * 2 * 64 * 4 == 72 * 2**20
    assert kv_cache_bytes(layers=12, kv_heads=3, head_dim=64, batch=1, tokens=1024) \
        == small // 4
    assert kv_cache_bytes(layers=12, kv_heads=12, head_dim=64, batch=1, tokens=8192,
                          window=1024) == small
    # A real cache holds what the function says.
    layer = make(2, 3)
    cache: KVCache = layer.new_cache(5)
    held = (cache.keys.numel() + cache.values.numel()) * cache.keys.element_size()
    assert held == kv_cache_bytes(layers=1, kv_heads=2, head_dim=4, batch=5, tokens=100,
                                  window=3, bytes_per_value=8)


def test_the_kept_rope_table_is_the_angles_of_every_position_asked_for():
    from qkv.positional import RopeTable

    def angles(n, width, base):  # RoPE by its definition, in float64
        pos = torch.arange(n, dtype=torch.float64)[:, None]
        inv = base ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
        a = torch.cat((pos * inv, pos * inv), dim=-1)
        return a.cos(), a.sin()

    table = RopeTable(limit=600)
    for length, width, base, dtype in [(3, 8, 1e4, torch.float64), (300, 8, 1e4, torch.float64),
                                       (700, 8, 1e4, torch.float64), (5, 4, 1e4, torch.float64),
                                       (5, 4, 500.0, torch.float64), (9, 4, 500.0, torch.float32)]:
        cos, sin = table(length, width, base, None, dtype, torch.device("cpu"))
        want_cos, want_sin = angles(length, width, base)
        assert cos.shape == (length, width) and cos.dtype == dtype
        torch.testing.assert_close(cos.double(), want_cos, rtol=0, atol=1e-7)
        torch.testing.assert_close(sin.double(), want_sin, rtol=0, atol=1e-7)
