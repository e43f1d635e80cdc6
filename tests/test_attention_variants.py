"""Learned sinks, gated outputs, shared keys and values and NoPE layers
(qkv.attention_variants, and the kernel's ``sinks``), against a float64 reference written
here from the equations and against transformers' own attention modules (gpt-oss,
Qwen3-Next, Gemma 4, SmolLM3) with random weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import Gemma4TextConfig, GptOssConfig, Qwen3NextConfig, SmolLM3Config
from transformers.cache_utils import KVSharingDict
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4TextAttention,
    Gemma4TextRotaryEmbedding,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
)
from transformers.models.smollm3.modeling_smollm3 import SmolLM3Attention, SmolLM3RotaryEmbedding

from qkv import MultiHeadAttention
from qkv.attention_variants import GatedAttention, KVHandoff, SharedKVAttention, SinkAttention
from qkv.functional import attention
from qkv.models.gpt import RMSNorm

D, H, G, HD = 16, 4, 2, 8  # width, query heads, key/value heads, head_dim (heads 32 wide)
F64 = torch.float64


# ----------------------------------------------------------------- the definitions


def rotate_pairs(x: torch.Tensor, positions: torch.Tensor, base: float,
                 dims: int | None = None) -> torch.Tensor:
    """RoPE by its definition on the first ``dims`` dimensions (all by default) of each
    head: dimension i and i + dims/2 form a 2-D vector turned by position *
    base^(-2i/dims). ``x (..., T, d)``."""
    d = x.shape[-1] if dims is None else dims
    out = x.clone()
    for i in range(d // 2):
        angle = positions.double() * base ** (-2 * i / d)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., i : i + 1], x[..., i + d // 2 : i + d // 2 + 1]
        out[..., i : i + 1] = a * c - b * s
        out[..., i + d // 2 : i + d // 2 + 1] = a * s + b * c
    return out


def reference(q, k, v, *, scale, causal=True, window=None, sinks=None, key_ok=None):
    """Attention of ``q (H, T_q, d)`` on ``k (G, T_k, d)``, ``v (G, T_k, d_v)``, one query
    and key at a time in float64, queries aligned to the last keys: ``w_ij = exp(s_ij) /
    (sum_j' exp(s_ij') + exp(sink_h))``. Returns ``(out (H, T_q, d_v), weights (H, T_q,
    T_k))``."""
    heads, tq = q.shape[:2]
    kv_heads, tk = k.shape[:2]
    out = torch.zeros(heads, tq, v.shape[-1], dtype=F64)
    weights = torch.zeros(heads, tq, tk, dtype=F64)
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i in range(tq):
            at = i + tk - tq
            seen = [j for j in range(tk)
                    if (not causal or j <= at) and (window is None or j > at - window)
                    and (key_ok is None or bool(key_ok[j]))]
            exps = {j: math.exp(float(q[h, i].double() @ k[g, j].double()) * scale)
                    for j in seen}
            total = sum(exps.values()) + (0.0 if sinks is None else math.exp(float(sinks[h])))
            for j in seen:
                weights[h, i, j] = exps[j] / total
                out[h, i] += weights[h, i, j] * v[g, j].double()
    return out, weights


def lin(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    y = x.double() @ layer.weight.detach().double().T
    return y if layer.bias is None else y + layer.bias.detach().double()


def split(y: torch.Tensor, heads: int) -> torch.Tensor:
    return y.view(y.shape[0], heads, -1).transpose(0, 1)  # (T, heads * d) -> (heads, T, d)


def reference_layer(layer, x, *, sinks=None, gated=False, rotary_dim=None):
    """``layer`` (MultiHeadAttention's projections) on one sequence ``x (T, D)`` by the
    equations: output ``(T, D)`` and weights ``(H, T, T)``."""
    T = len(x)
    q_all = lin(layer.W_query, x)
    if gated:  # each head's [query | gate]
        q_all, gate = q_all.view(T, H, 2, HD).unbind(2)
        q_all, gate = q_all.reshape(T, H * HD), gate.reshape(T, H * HD)
    q, k, v = split(q_all, H), split(lin(layer.W_key, x), G), split(lin(layer.W_value, x), G)
    if layer.rope:
        pos = torch.arange(T)
        q = rotate_pairs(q, pos, layer.rope_base, rotary_dim)
        k = rotate_pairs(k, pos, layer.rope_base, rotary_dim)
    out, weights = reference(q, k, v, scale=HD**-0.5, window=layer.window_size, sinks=sinks)
    merged = out.transpose(0, 1).reshape(T, H * HD)
    if gated:
        merged = merged * torch.sigmoid(gate)
    return lin(layer.out_proj, merged), weights


def one_line(excinfo) -> bool:
    return "\n" not in str(excinfo.value)


# ----------------------------------------------------------------- the kernel's sinks


@pytest.mark.parametrize("groups", [H, G, 1])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("num_queries", [7, 3, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_sinks_in_the_kernel_match_the_definition(groups, window, num_queries, padded):
    torch.manual_seed(0)
    q = torch.randn(2, H, num_queries, HD, dtype=F64)
    k, v = torch.randn(2, groups, 7, HD, dtype=F64), torch.randn(2, groups, 7, 5, dtype=F64)
    sinks = torch.randn(H, dtype=F64)
    key_ok = torch.ones(2, 7, dtype=torch.bool)
    if padded:
        key_ok[1, :4] = False  # left padding: batch 1's first query (of 7) sees nothing
    mask = key_ok[:, None, None, :] if padded else None
    fused, _ = attention(q, k, v, mask=mask, causal=True, window=window, sinks=sinks)
    eager, weights = attention(q, k, v, mask=mask, causal=True, window=window, sinks=sinks,
                               need_weights=True)
    for b in range(2):
        want_out, want_w = reference(q[b], k[b], v[b], scale=HD**-0.5, window=window,
                                     sinks=sinks, key_ok=key_ok[b])
        torch.testing.assert_close(fused[b], want_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(eager[b], want_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weights[b], want_w, rtol=1e-10, atol=1e-12)
    assert (weights.sum(-1) < 1).all()  # the sinks keep a share of every row


def test_without_a_sink_the_same_rows_sum_to_one():
    # The reference has to see the sink: leave it out and the rows are full again.
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, H, 5, HD, dtype=F64) for _ in range(3))
    _, plain = attention(q, k, v, causal=True, need_weights=True)
    _, sunk = attention(q, k, v, causal=True, need_weights=True,
                        sinks=torch.full((H,), -30.0, dtype=F64))
    torch.testing.assert_close(plain.sum(-1), torch.ones(1, H, 5, dtype=F64))
    torch.testing.assert_close(sunk, plain)  # a sink at -30 takes (almost) nothing


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("groups", [H, 1])
def test_fused_and_eager_sinks_agree_with_gradients(window, groups):
    torch.manual_seed(2)
    q = torch.randn(2, H, 6, HD, dtype=F64, requires_grad=True)
    k = torch.randn(2, groups, 6, HD, dtype=F64, requires_grad=True)
    v = torch.randn(2, groups, 6, HD, dtype=F64, requires_grad=True)
    sinks = torch.randn(H, dtype=F64, requires_grad=True)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., :6] = False  # one sequence entirely padded: zero output, finite gradients
    probe = torch.randn(2, H, 6, HD, dtype=F64)
    grads = []
    for need in (False, True):
        out, _ = attention(q, k, v, mask=mask, causal=True, window=window, sinks=sinks,
                           need_weights=need)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        grads.append((out, *torch.autograd.grad((out * probe).sum(), (q, k, v, sinks))))
    for fused, eager in zip(*grads, strict=True):
        assert torch.isfinite(fused).all()
        torch.testing.assert_close(fused, eager, rtol=1e-10, atol=1e-12)


def test_bad_sinks_are_one_line_errors():
    q = k = v = torch.randn(1, H, 3, HD)
    for bad, error in ((torch.zeros(H + 1), ValueError), (torch.zeros(1, H), ValueError),
                       (torch.zeros(H, dtype=torch.long), TypeError), ([0.0] * H, TypeError)):
        with pytest.raises(error, match="sinks must") as excinfo:
            attention(q, k, v, sinks=bad)
        assert one_line(excinfo)
    with pytest.raises(ValueError, match=r"sinks must have shape \(heads,\)"):
        attention(q[0, 0], k[0, 0], v[0, 0], sinks=torch.zeros(H))  # no heads axis


# ----------------------------------------------------------------- SinkAttention


def gpt_oss_pair(layer_type: str, seed: int = 0):
    """transformers' GptOssAttention for ``layer_type`` with random weights and sinks,
    and a SinkAttention holding the same, both float32."""
    cfg = GptOssConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=G,
                       head_dim=HD, sliding_window=3, num_hidden_layers=2,
                       layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                       vocab_size=10, num_local_experts=4, num_experts_per_tok=2,
                       intermediate_size=8, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 100.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    theirs = GptOssAttention(cfg, cfg.layer_types.index(layer_type)).eval()
    nn.init.normal_(theirs.sinks)
    ours = SinkAttention(D, D, 16, 0.0, H, qkv_bias=True, num_kv_groups=G, head_dim=HD,
                         window_size=3 if layer_type == "sliding_attention" else None,
                         rope=True, rope_base=100.0).eval()
    with torch.no_grad():
        for mine, hf in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                         ("out_proj", "o_proj")):
            getattr(ours, mine).load_state_dict(getattr(theirs, hf).state_dict())
        ours.sinks.copy_(theirs.sinks)
    return cfg, theirs, ours


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_sink_attention_matches_gpt_oss(layer_type):
    cfg, theirs, ours = gpt_oss_pair(layer_type)
    x = torch.randn(2, 9, D)
    present = torch.ones(2, 9, dtype=torch.long)
    present[1, :2] = 0  # left padding in the second sequence
    pos = torch.arange(9)[None].expand(2, -1)
    make_mask = (create_sliding_window_causal_mask if layer_type == "sliding_attention"
                 else create_causal_mask)
    mask = make_mask(config=cfg, inputs_embeds=x, attention_mask=present, cache=None,
                     position_ids=pos)
    with torch.no_grad():
        want, want_w = theirs(x, GptOssRotaryEmbedding(cfg)(x, pos), mask)
        got = ours(x, key_padding_mask=present == 0)
        got_eager, got_w = ours(x, key_padding_mask=present == 0, need_weights=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_eager, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_sink_attention_is_the_definition_and_decodes_as_it_runs(window, backend):
    torch.manual_seed(3)
    layer = SinkAttention(D, D, 12, 0.0, H, qkv_bias=True, num_kv_groups=G, head_dim=HD,
                          window_size=window, rope=True, rope_base=100.0,
                          backend=backend).double().eval()
    nn.init.normal_(layer.sinks)
    x = torch.randn(2, 9, D, dtype=F64)
    full, weights = layer(x, need_weights=True)
    for b in range(2):
        want, want_w = reference_layer(layer, x[b], sinks=layer.sinks.detach())
        torch.testing.assert_close(full[b], want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weights[b], want_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer(x), full, rtol=1e-10, atol=1e-12)
    for chunks in ([1] * 9, [4, 1, 2, 2], [5, 4]):
        cache, outs, start = layer.new_cache(2), [], 0
        for n in chunks:
            outs.append(layer(x[:, start : start + n], cache=cache))
            start += n
        torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------- GatedAttention


@pytest.mark.parametrize("partial", [0.25, 1.0])
def test_gated_attention_matches_qwen3_next(partial):
    cfg = Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=G,
                          head_dim=HD, num_hidden_layers=1, layer_types=["full_attention"],
                          vocab_size=10, rope_parameters={"rope_type": "default",
                                                          "rope_theta": 100.0,
                                                          "partial_rotary_factor": partial})
    cfg._attn_implementation = "eager"
    torch.manual_seed(4)
    theirs = Qwen3NextAttention(cfg, 0).eval()
    for norm in (theirs.q_norm, theirs.k_norm):
        nn.init.normal_(norm.weight, std=0.5)  # stored as 1 + weight, as Gemma's
    ours = GatedAttention(D, D, None, 0.0, H, num_kv_groups=G, head_dim=HD, out_bias=False,
                          rope=True, rope_base=100.0, rotary_dim=int(partial * HD),
                          q_norm=RMSNorm(HD, cfg.rms_norm_eps, gemma=True),
                          k_norm=RMSNorm(HD, cfg.rms_norm_eps, gemma=True)).eval()
    with torch.no_grad():
        for mine, hf in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                         ("out_proj", "o_proj")):
            getattr(ours, mine).weight.copy_(getattr(theirs, hf).weight)  # no renaming of rows
        ours.q_norm.scale.copy_(theirs.q_norm.weight)
        ours.k_norm.scale.copy_(theirs.k_norm.weight)
    x = torch.randn(2, 7, D)
    pos = torch.arange(7)[None].expand(2, -1)
    mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=pos)
    with torch.no_grad():
        want, want_w = theirs(x, Qwen3NextRotaryEmbedding(cfg)(x, pos), mask)
        got, got_w = ours(x, need_weights=True)
    torch.testing.assert_close(ours(x).detach(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("rotary_dim", [2, HD])
def test_gated_attention_is_the_definition_and_decodes_as_it_runs(window, rotary_dim):
    torch.manual_seed(5)
    layer = GatedAttention(D, D, 12, 0.0, H, qkv_bias=True, num_kv_groups=G, head_dim=HD,
                           window_size=window, rope=True, rope_base=100.0,
                           rotary_dim=rotary_dim).double().eval()
    assert layer.W_query.weight.shape == (2 * H * HD, D)
    x = torch.randn(2, 9, D, dtype=F64)
    full, weights = layer(x, need_weights=True)
    for b in range(2):
        want, want_w = reference_layer(layer, x[b], gated=True, rotary_dim=rotary_dim)
        torch.testing.assert_close(full[b], want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weights[b], want_w, rtol=1e-10, atol=1e-12)
    for chunks in ([1] * 9, [4, 1, 2, 2]):
        cache, outs, start = layer.new_cache(2), [], 0
        for n in chunks:
            outs.append(layer(x[:, start : start + n], cache=cache))
            start += n
        torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


def test_gated_attention_refuses_a_rotary_dim_it_cannot_turn():
    for bad, rope in ((3, True), (2 * HD, True), (2, False), (0, True)):
        with pytest.raises(ValueError, match="rotary_dim") as excinfo:
            GatedAttention(D, D, None, 0.0, H, head_dim=HD, rope=rope, rotary_dim=bad)
        assert one_line(excinfo)


# ----------------------------------------------------------------- SharedKVAttention


def test_shared_kv_attention_matches_gemma4():
    cfg = Gemma4TextConfig(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=G, head_dim=HD,
        global_head_dim=HD, num_hidden_layers=4, sliding_window=3, vocab_size=10,
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        hidden_size_per_layer_input=0, intermediate_size=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    cfg._attn_implementation = "eager"
    assert cfg.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    torch.manual_seed(6)
    x_source, x = torch.randn(2, 8, D), torch.randn(2, 8, D)
    pos = torch.arange(8)[None].expand(2, -1)
    rotary = Gemma4TextRotaryEmbedding(cfg)
    for source_idx, idx in ((0, 2), (1, 3)):
        kind = cfg.layer_types[idx]
        source, theirs = Gemma4TextAttention(cfg, source_idx), Gemma4TextAttention(cfg, idx)
        nn.init.normal_(theirs.q_norm.weight, mean=1.0, std=0.3)
        make_mask = (create_sliding_window_causal_mask if kind == "sliding_attention"
                     else create_causal_mask)
        mask = make_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                         position_ids=pos)
        states, rope = KVSharingDict(), rotary(x, pos, kind)
        with torch.no_grad():
            source(x_source, rope, mask, states)
            want, want_w = theirs(x, rope, mask, states)
        ours = SharedKVAttention(D, D, None, 0.0, H, num_kv_groups=G, head_dim=HD,
                                 out_bias=False, rope=True,
                                 rope_base=cfg.rope_parameters[kind]["rope_theta"],
                                 window_size=3 if kind == "sliding_attention" else None,
                                 q_norm=RMSNorm(HD, cfg.rms_norm_eps), scale=1.0).eval()
        assert sorted(ours.state_dict()) == ["W_query.weight", "out_proj.weight", "q_norm.scale"]
        with torch.no_grad():
            ours.W_query.weight.copy_(theirs.q_proj.weight)
            ours.out_proj.weight.copy_(theirs.o_proj.weight)
            ours.q_norm.scale.copy_(theirs.q_norm.weight)
            handoff = KVHandoff()
            handoff.append(*states[kind])  # what the source attended with
            got, got_w = ours(x, handoff, need_weights=True)
            torch.testing.assert_close(ours(x, handoff), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)


def shared_pair(window, backend="fused", seed=7):
    torch.manual_seed(seed)
    common = dict(num_kv_groups=G, head_dim=HD, window_size=window, rope=True,
                  rope_base=100.0, backend=backend)
    source = MultiHeadAttention(D, D, 12, 0.0, H, qkv_bias=True, **common).double().eval()
    shared = SharedKVAttention(D, D, 12, 0.0, H, qkv_bias=True, **common).double().eval()
    return source, shared


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_shared_kv_attention_is_the_definition_and_decodes_as_it_runs(window, backend):
    source, shared = shared_pair(window, backend)
    x_source, x = torch.randn(2, 9, D, dtype=F64), torch.randn(2, 9, D, dtype=F64)
    handoff = KVHandoff()
    torch.testing.assert_close(source(x_source, cache=handoff), source(x_source))
    full, weights = shared(x, handoff, need_weights=True)
    pos = torch.arange(9)
    for b in range(2):
        k = rotate_pairs(split(lin(source.W_key, x_source[b]), G), pos, 100.0)
        v = split(lin(source.W_value, x_source[b]), G)
        q = rotate_pairs(split(lin(shared.W_query, x[b]), H), pos, 100.0)
        out, want_w = reference(q, k, v, scale=HD**-0.5, window=window)
        want = lin(shared.out_proj, out.transpose(0, 1).reshape(9, H * HD))
        torch.testing.assert_close(full[b], want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weights[b], want_w, rtol=1e-10, atol=1e-12)
    assert shared.new_cache(2) is None  # the source's cache is the only one
    for chunks in ([1] * 9, [4, 1, 2, 2], [5, 4]):
        cache, outs, start = source.new_cache(2), [], 0
        for n in chunks:
            handoff = KVHandoff(cache)
            source(x_source[:, start : start + n], cache=handoff)
            outs.append(shared(x[:, start : start + n], handoff))
            start += n
        assert cache.pos == 9
        torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


def test_shared_kv_attention_refusals_are_one_line():
    source, shared = shared_pair(3)
    x = torch.randn(1, 4, D, dtype=F64)
    cases = [(lambda: shared(x, KVHandoff()), "run the source layer first")]
    handoff = KVHandoff()
    source(x, cache=handoff)
    cases.append((lambda: shared(x[:, :3], handoff), "new tokens"))
    _, wide = shared_pair(None)
    ring = KVHandoff(source.new_cache(1))
    source(x, cache=ring)
    cases.append((lambda: wide(x, ring), "window_size"))
    cases.append((lambda: shared(x, (handoff.keys, handoff.values)), "KVHandoff"))
    for call, words in cases:
        with pytest.raises((ValueError, TypeError), match=words) as excinfo:
            call()
        assert one_line(excinfo)
    assert not hasattr(shared, "W_key") and not hasattr(shared, "W_value")


# ----------------------------------------------------------------- NoPE


def test_a_layer_without_rope_matches_smollm3s_nope_layer():
    cfg = SmolLM3Config(hidden_size=D, num_attention_heads=H, num_key_value_heads=G,
                        num_hidden_layers=4, vocab_size=10, no_rope_layers=[1, 1, 1, 0],
                        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "eager"
    torch.manual_seed(8)
    x = torch.randn(2, 6, D)
    pos = torch.arange(6)[None].expand(2, -1)
    rope = SmolLM3RotaryEmbedding(cfg)(x, pos)
    mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=pos)
    results = {}
    for idx in (0, 3):  # a RoPE layer and the NoPE one, on the same weights
        theirs = SmolLM3Attention(cfg, idx).eval()
        if idx == 3:
            theirs.load_state_dict(results[0][0].state_dict())
        with torch.no_grad():
            results[idx] = theirs, theirs(x, rope, mask)[0]
    head_dim = D // H
    ours = MultiHeadAttention(D, D, None, 0.0, H, num_kv_groups=G, out_bias=False,
                              rope=False).eval()
    with torch.no_grad():
        for mine, hf in (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"),
                         ("out_proj", "o_proj")):
            getattr(ours, mine).weight.copy_(getattr(results[0][0], hf).weight)
        got = ours(x)
    assert ours.head_dim == head_dim
    torch.testing.assert_close(got, results[3][1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, results[0][1], atol=1e-3)  # RoPE would have changed it


# ----------------------------------------------------------------- fast == readable


def _layers(backend):
    torch.manual_seed(9)
    common = dict(qkv_bias=True, num_kv_groups=G, head_dim=HD, window_size=3, rope=True,
                  rope_base=100.0, backend=backend)
    sink = SinkAttention(D, D, 12, 0.0, H, **common).double()
    nn.init.normal_(sink.sinks)
    gated = GatedAttention(D, D, 12, 0.0, H, rotary_dim=4, **common).double()
    source, shared = shared_pair(3, backend, seed=10)
    return sink, gated, (source, shared)


def test_fused_and_eager_paths_agree_on_outputs_and_gradients():
    x = torch.randn(2, 7, D, dtype=F64)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 0] = True
    results = []
    for backend in ("fused", "eager"):
        sink, gated, (source, shared) = _layers(backend)
        outs = [sink(x, key_padding_mask=pad), gated(x, key_padding_mask=pad)]
        handoff = KVHandoff()
        outs.append(source(x.flip(1), cache=handoff, key_padding_mask=pad))
        outs.append(shared(x, handoff, key_padding_mask=pad))
        params = [*sink.parameters(), *gated.parameters(), *source.parameters(),
                  *shared.parameters()]
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=F64).view_as(o)).sum()
                   for o in outs)
        results.append((*outs, *torch.autograd.grad(loss, params)))
    sinks_at = 4 + [name for name, _ in sink.named_parameters()].index("sinks")
    assert results[0][sinks_at].shape == (H,) and results[0][sinks_at].abs().sum() > 0
    for fused, eager in zip(*results, strict=True):
        torch.testing.assert_close(fused, eager, rtol=1e-10, atol=1e-12)
