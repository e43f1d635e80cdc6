"""Multi-head latent attention, DeepSeek sparse attention, interleaved RoPE and YaRN.

Each is checked against a float64 computation written here from its equations (never by
calling qkv), against transformers' own DeepSeek-V3, DeepSeek-V3.2 and Qwen3 modules on the
same weights, and its backends and caches against each other.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3

from qkv.kv_cache import KVCache, LatentCache
from qkv.latent_attention import LatentAttention, SparseLatentAttention
from qkv.multihead import MultiHeadAttention
from qkv.positional import (
    apply_rope_interleaved,
    check_rope_scaling,
    rope_angles,
    rope_attention_factor,
    rope_frequencies,
)

D, H, R, QR, DN, DR, DV = 32, 4, 16, 12, 8, 4, 6  # tiny MLA: every size different
IH, ID = 8, 8  # index heads and their width
BASE = 100.0
# YaRN as DeepSeek-V3 uses it (mscale = mscale_all_dim: the softmax gets the scale), and
# with mscale != mscale_all_dim, where the rotated queries and keys get some of it too.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0}
YARN_SPLIT = {**YARN, "mscale": 0.5, "mscale_all_dim": 1.5}
SIZES = dict(kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV)


# ------------------------------------------------------------------ references


def mscale(factor, m=1.0):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_reference(dim, base, factor, original, beta_fast=32.0, beta_slow=1.0,
                   truncate=True):
    """YaRN's frequencies in float64, pair by pair: pair i keeps base^(-2i/dim) if it
    turns more than beta_fast times over the original context, is divided by factor if
    fewer than beta_slow, and blends linearly in i between."""
    def pair_turning(turns):  # the pair i at which base^(2i/dim) * 2 pi * turns = original
        return dim * math.log(original / (2 * math.pi * turns)) / (2 * math.log(base))

    lo, hi = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    out = []
    for i in range(dim // 2):
        theta = base ** (-2 * i / dim)
        interpolated = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(theta / factor * interpolated + theta * (1 - interpolated))
    return torch.tensor(out, dtype=torch.float64)


def reference_frequencies(scaling):
    """(inverse frequencies, factor on cos/sin, factor on the softmax) for DR dims."""
    if scaling is None:
        return torch.tensor([BASE ** (-2 * i / DR) for i in range(DR // 2)],
                            dtype=torch.float64), 1.0, 1.0
    f = scaling["factor"]
    inv = yarn_reference(DR, BASE, f, scaling["original_max_position_embeddings"])
    on_rope = mscale(f, scaling["mscale"]) / mscale(f, scaling["mscale_all_dim"])
    return inv, on_rope, mscale(f, scaling["mscale_all_dim"]) ** 2


def rotate(v, positions, inv, factor, interleave):
    """v (..., T, d) turned pair by pair: (2i, 2i+1) or (i, i + d/2), angle t * inv[i]."""
    d = v.shape[-1]
    pairs = [(2 * i, 2 * i + 1) for i in range(d // 2)] if interleave else \
        [(i, i + d // 2) for i in range(d // 2)]
    out = v.clone()
    for i, (a, b) in enumerate(pairs):
        angle = positions.double() * inv[i]
        cos, sin = angle.cos() * factor, angle.sin() * factor
        out[..., a] = v[..., a] * cos - v[..., b] * sin
        out[..., b] = v[..., b] * cos + v[..., a] * sin
    return out


def rms(v, weight, eps=1e-6):
    return v / (v.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight


def reference_mla(sd, x, *, q_lora, interleave, scaling, keep=None):
    """MLA by its equations in float64: sd a state dict, x (b, T, D); keep (b, T, T) an
    extra mask (sparse attention) or None. Returns (out, weights (b, H, T, T))."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    t = x.shape[1]
    pos = torch.arange(t)
    inv, on_rope, on_softmax = reference_frequencies(scaling)

    def lin(name, v):
        return v @ sd[name + ".weight"].T + sd.get(name + ".bias", 0)

    cq = rms(lin("q_a_proj", x), sd["q_a_layernorm.weight"]) if q_lora else None
    q = (lin("q_b_proj", cq) if q_lora else lin("q_proj", x)).view(*x.shape[:2], H, DN + DR)
    ckv = lin("kv_a_proj_with_mqa", x)
    c = rms(ckv[..., :R], sd["kv_a_layernorm.weight"])
    k_r = rotate(ckv[..., R:], pos, inv, on_rope, interleave)  # (b, T, DR), one for all
    w_kvb = sd["kv_b_proj.weight"].view(H, DN + DV, R)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    if keep is not None:
        allowed = allowed & keep
    heads, weights = [], []
    for i in range(H):
        q_n = q[:, :, i, :DN]
        q_r = rotate(q[:, :, i, DN:], pos, inv, on_rope, interleave)
        k_n = c @ w_kvb[i, :DN].T
        v = c @ w_kvb[i, DN:].T
        s = (q_n @ k_n.transpose(1, 2) + q_r @ k_r.transpose(1, 2)) * \
            (DN + DR) ** -0.5 * on_softmax
        w = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        heads.append(w @ v)
        weights.append(w)
    out = lin("o_proj", torch.cat(heads, dim=-1))
    return out, torch.stack(weights, dim=1)


def reference_selection(sd, x, *, topk, scaling):
    """DSA's lightning indexer by its equations in float64: keep (b, T, T), True at the
    top-k keys u <= t of each query t."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    b, t, _ = x.shape
    pos = torch.arange(t)
    inv, on_rope, _ = reference_frequencies(scaling)
    cq = rms(x @ sd["q_a_proj.weight"].T, sd["q_a_layernorm.weight"])
    q = (cq @ sd["indexer.wq_b.weight"].T).view(b, t, IH, ID)
    q = torch.cat((rotate(q[..., :DR].transpose(1, 2), pos, inv, on_rope, False)
                   .transpose(1, 2), q[..., DR:]), dim=-1)
    k = torch.nn.functional.layer_norm(x @ sd["indexer.wk.weight"].T, (ID,),
                                       sd["indexer.k_norm.weight"],
                                       sd["indexer.k_norm.bias"], eps=1e-6)
    k = torch.cat((rotate(k[..., :DR], pos, inv, on_rope, False), k[..., DR:]), dim=-1)
    w = x @ sd["indexer.weights_proj.weight"].T / math.sqrt(IH)  # (b, T, IH)
    keep = torch.zeros(b, t, t, dtype=torch.bool)
    for bi in range(b):
        for ti in range(t):
            score = sum(w[bi, ti, j] * torch.relu(k[bi, : ti + 1] @ q[bi, ti, j] / math.sqrt(ID))
                        for j in range(IH))
            keep[bi, ti, score.topk(min(topk, ti + 1)).indices] = True
    return keep


# ------------------------------------------------------------------ builders


def mla(q_lora=QR, interleave=True, scaling=YARN, backend="auto", seed=0, **kw):
    torch.manual_seed(seed)
    layer = LatentAttention(D, H, **SIZES, q_lora_rank=q_lora, rope_base=BASE,
                            rope_scaling=scaling, rope_interleave=interleave,
                            backend=backend, **kw)
    spread(layer)
    return layer.eval()


def dsa(topk=5, scaling=YARN, backend="auto", seed=0, **kw):
    torch.manual_seed(seed)
    layer = SparseLatentAttention(D, H, **SIZES, q_lora_rank=QR, rope_base=BASE,
                                  rope_scaling=scaling, backend=backend, index_n_heads=IH,
                                  index_head_dim=ID, index_topk=topk, **kw)
    spread(layer)
    return layer.eval()


def spread(module):
    """Random weights large enough that the softmax and the selection are far from flat."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)


def inputs(t=9, batch=2, seed=1, dtype=torch.float32):
    return torch.randn(batch, t, D, generator=torch.Generator().manual_seed(seed),
                       dtype=dtype)


# ------------------------------------------------------------------ the equations


@pytest.mark.parametrize("backend", ["decompress", "absorbed"])
@pytest.mark.parametrize("q_lora,interleave,scaling", [
    (QR, True, YARN), (None, False, None), (QR, False, YARN_SPLIT), (None, True, YARN_SPLIT)])
def test_mla_matches_its_equations_in_float64(q_lora, interleave, scaling, backend):
    layer = mla(q_lora, interleave, scaling, backend).double()
    x = inputs(dtype=torch.float64)
    want, want_w = reference_mla(layer.state_dict(), x, q_lora=q_lora,
                                 interleave=interleave, scaling=scaling)
    got, got_w = layer(x, need_weights=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-11)  # the SDPA path


@pytest.mark.parametrize("backend", ["decompress", "absorbed"])
def test_sparse_attention_matches_its_equations_in_float64(backend):
    layer = dsa(topk=4, scaling=YARN_SPLIT, backend=backend).double()
    x = inputs(t=11, dtype=torch.float64)
    keep = reference_selection(layer.state_dict(), x, topk=4, scaling=YARN_SPLIT)
    want, want_w = reference_mla(layer.state_dict(), x, q_lora=True, interleave=True,
                                 scaling=YARN_SPLIT, keep=keep)
    got, got_w = layer(x, need_weights=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-12)
    # the selection the layer reports is the reference's, once the future is masked
    chosen = torch.zeros_like(keep).scatter_(-1, layer.selected, True)
    assert torch.equal(chosen & torch.ones(11, 11, dtype=torch.bool).tril(), keep)
    assert (got_w > 0).sum(-1).max() == 4  # at most top_k keys per query
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-11)


# ------------------------------------------------------------------ transformers


def hf_config(cls, q_lora, interleave, **extra):
    rope = {**YARN, "rope_theta": BASE, "beta_fast": 32, "beta_slow": 1}
    config = cls(hidden_size=D, num_attention_heads=H, num_key_value_heads=H,
                 kv_lora_rank=R, q_lora_rank=q_lora, qk_nope_head_dim=DN,
                 qk_rope_head_dim=DR, v_head_dim=DV, rope_parameters=rope,
                 max_position_embeddings=64, num_hidden_layers=1, **extra)
    if interleave is not None:
        config.rope_interleave = interleave
    config._attn_implementation = "eager"
    return config


def causal_additive(t):
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


@pytest.mark.parametrize("q_lora,interleave,bias", [(QR, True, True), (None, False, False)])
def test_mla_matches_transformers_deepseek_v3(q_lora, interleave, bias):
    config = hf_config(transformers.DeepseekV3Config, q_lora, interleave, attention_bias=bias)
    torch.manual_seed(0)
    theirs = hf_v3.DeepseekV3Attention(config, 0).eval()
    spread(theirs)
    t = 13
    x = inputs(t)
    cos_sin = hf_v3.DeepseekV3RotaryEmbedding(config)(x, torch.arange(t)[None])
    with torch.no_grad():
        want, want_w = theirs(x, cos_sin, causal_additive(t))
    ours = LatentAttention(D, H, **SIZES, q_lora_rank=q_lora, bias=bias, rope_base=BASE,
                           rope_scaling=YARN, rope_interleave=interleave).eval()
    ours.load_state_dict(theirs.state_dict())  # the same names: nothing to rename
    for backend in ("decompress", "absorbed"):
        ours.backend = backend
        got, got_w = ours(x, need_weights=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)


def test_sparse_attention_matches_transformers_deepseek_v32():
    config = hf_config(transformers.DeepseekV32Config, QR, None, index_topk=5,
                       index_head_dim=ID, index_n_heads=IH)
    torch.manual_seed(0)
    theirs = hf_v32.DeepseekV32Attention(config, 0).eval()
    spread(theirs)
    t = 12
    x = inputs(t)
    positions = torch.arange(t)[None]
    cos_sin = hf_v32.DeepseekV32RotaryEmbedding(config)(x, positions)
    mask = causal_additive(t)
    with torch.no_grad():
        want, want_w = theirs(x, cos_sin, mask, position_ids=positions)
        their_pick = theirs.indexer(x, theirs.q_a_layernorm(theirs.q_a_proj(x)), cos_sin,
                                    mask[:, 0], positions)
    ours = SparseLatentAttention(D, H, **SIZES, q_lora_rank=QR, rope_base=BASE,
                                 rope_scaling=YARN, index_n_heads=IH, index_head_dim=ID,
                                 index_topk=5).eval()
    ours.load_state_dict(theirs.state_dict())
    for backend in ("decompress", "absorbed"):
        ours.backend = backend
        got, got_w = ours(x, need_weights=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-5)
        assert torch.equal(ours.selected.sort(-1).values, their_pick.long().sort(-1).values)


def test_yarn_multi_head_attention_matches_transformers_qwen3():
    """Qwen3's long-context form: YaRN on an ordinary attention, its attention_factor on
    the rotated queries and keys, the softmax scale untouched."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    config = transformers.Qwen3Config(hidden_size=D, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      rope_parameters={**rope, "rope_theta": BASE},
                                      max_position_embeddings=64, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = hf_qwen3.Qwen3Attention(config, 0).eval()
    spread(theirs)
    t = 40  # past the original 16 positions
    x = inputs(t)
    cos_sin = hf_qwen3.Qwen3RotaryEmbedding(config)(x, torch.arange(t)[None])
    with torch.no_grad():
        want, _ = theirs(x, cos_sin, causal_additive(t))
    eps = config.rms_norm_eps
    ours = MultiHeadAttention(D, D, None, 0.0, 4, num_kv_groups=2, head_dim=16, rope=True,
                              rope_base=BASE, rope_scaling=rope, out_bias=False,
                              q_norm=nn.RMSNorm(16, eps=eps),
                              k_norm=nn.RMSNorm(16, eps=eps)).eval()
    names = {"q_proj": "W_query", "k_proj": "W_key", "v_proj": "W_value", "o_proj": "out_proj"}
    ours.load_state_dict({names.get(k.split(".")[0], k.split(".")[0]) + "." +
                          k.split(".", 1)[1]: v for k, v in theirs.state_dict().items()})
    torch.testing.assert_close(ours(x), want, rtol=0, atol=1e-5)
    assert rope_attention_factor(check_rope_scaling(rope)) == pytest.approx(
        0.1 * math.log(4) + 1)


# ------------------------------------------------------------------ backends and caches


def run_with_grads(layer, x, need_weights):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x, need_weights=need_weights)
    out, weights = out if need_weights else (out, None)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5),
                        dtype=out.dtype)
    (out * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), weights, x.grad, grads


@pytest.mark.parametrize("make", [mla, dsa], ids=["mla", "dsa"])
def test_backends_agree_in_float64_on_outputs_weights_and_gradients(make):
    layer = make(scaling=YARN_SPLIT).double()
    x = inputs(t=10, dtype=torch.float64)
    runs = []
    for backend in ("decompress", "absorbed"):
        layer.backend = backend
        runs += [run_with_grads(layer, x, True), run_with_grads(layer, x, False)]
    first = runs[0]
    # the MLA's own parameters all get gradients; the indexer (a top-k) none
    assert {n for n in first[3] if not n.startswith("indexer.")} == {
        n for n, _ in layer.named_parameters() if not n.startswith("indexer.")}
    for out, weights, x_grad, grads in runs[1:]:
        torch.testing.assert_close(out, first[0], rtol=0, atol=1e-12)
        if weights is not None:
            torch.testing.assert_close(weights, first[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(x_grad, first[2], rtol=0, atol=1e-11)
        assert grads.keys() == first[3].keys()
        for name in grads:
            torch.testing.assert_close(grads[name], first[3][name], rtol=0, atol=1e-10)


@pytest.mark.parametrize("make,backend", [(mla, "decompress"), (mla, "absorbed"),
                                          (mla, "auto"), (dsa, "absorbed"), (dsa, "auto")])
def test_cached_decoding_equals_the_full_forward(make, backend):
    layer = make(backend=backend).double()
    x = inputs(t=12, dtype=torch.float64)
    want, want_w = layer(x, need_weights=True)
    cache = layer.new_cache(2, 16)
    got = [layer(x[:, :5], cache=cache)]  # a prompt, then one token at a time
    for i in range(5, 12):  # the steps with weights (eager) and without (fused) alike
        if i % 2:
            out, w = layer(x[:, i : i + 1], cache=cache, need_weights=True)
            torch.testing.assert_close(w[..., 0, :], want_w[..., i, : i + 1], rtol=0,
                                       atol=1e-12)
        else:
            out = layer(x[:, i : i + 1], cache=cache)
        got.append(out)
    assert cache.pos == 12
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-11)
    cache.reset()
    torch.testing.assert_close(layer(x[:, :3], cache=cache), want[:, :3], rtol=0, atol=1e-11)


def test_auto_absorbs_for_one_new_token_and_decompresses_for_more(monkeypatch):
    layer = mla(backend="auto")
    calls = []
    for name in ("_absorbed", "_decompressed"):
        method = getattr(layer, name)
        monkeypatch.setattr(layer, name, lambda *a, name=name, method=method:
                            calls.append(name) or method(*a))
    cache = layer.new_cache(1, 8)
    layer(inputs(3, 1), cache=cache)
    layer(inputs(1, 1), cache=cache)
    assert calls == ["_decompressed", "_absorbed"]


def numbers_per_token(cache):
    """Numbers a cache holds per token and sequence, from its own buffers."""
    tensors = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() for t in tensors) // (tensors[0].shape[0] * cache.max_len)


def test_cache_holds_576_numbers_per_token_at_deepseek_v3s_shape():
    v3 = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
              qk_rope_head_dim=64, v_head_dim=128)
    with torch.device("meta"):  # the 7168-wide layers, built without memory
        latent = LatentAttention(7168, 128, **v3).new_cache(2, 8)
        sparse = SparseLatentAttention(7168, 128, **v3, index_n_heads=64,
                                       index_head_dim=128, index_topk=2048).new_cache(2, 8)
        full = KVCache(2, 128, 8, 128 + 64, value_dim=128)  # the same heads' keys, values
    assert numbers_per_token(latent) == 512 + 64 == 576
    assert numbers_per_token(sparse) == 512 + 64 + 128 == 704
    assert numbers_per_token(full) == 128 * (128 + 64 + 128) == 40_960
    assert latent.kv.device.type == "meta"


# ------------------------------------------------------------------ sparse attention


def test_sparse_attention_with_top_k_at_or_above_the_context_is_dense_mla():
    x = inputs(t=9, dtype=torch.float64)
    for topk in (9, 50):
        sparse = dsa(topk=topk).double()
        dense = mla().double()
        missing = dense.load_state_dict(sparse.state_dict(), strict=False)
        assert set(missing.unexpected_keys) == {n for n in sparse.state_dict()
                                                if n.startswith("indexer.")}
        for backend in ("decompress", "absorbed"):
            sparse.backend = dense.backend = backend
            out, w = sparse(x, need_weights=True)
            want, want_w = dense(x, need_weights=True)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-13)
            torch.testing.assert_close(w, want_w, rtol=0, atol=1e-14)
    # below the context it is not: a test that can fail
    sparse = dsa(topk=3).double()
    assert not torch.allclose(sparse(x), dense(x), atol=1e-3)


# ------------------------------------------------------------------ RoPE pieces


@pytest.mark.parametrize("rope,head_dim,context", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
      "rope_theta": 1e6}, 128, 131072),  # Qwen3's long-context config
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
      "rope_theta": 10000.0}, 64, 163840),  # DeepSeek-V3's
    ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
      "mscale": 0.707, "mscale_all_dim": 0.5, "truncate": False,
      "rope_theta": 10000.0}, 64, 163840),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
      "attention_factor": 0.9, "beta_fast": 8.0, "beta_slow": 2.0, "rope_theta": 100.0},
     16, 512)])
def test_yarn_matches_transformers_and_the_formula(rope, head_dim, context):
    config = transformers.Qwen3Config(head_dim=head_dim, rope_parameters=dict(rope),
                                      max_position_embeddings=context)
    their_freq, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    scaling = check_rope_scaling({k: v for k, v in rope.items() if k != "rope_theta"})
    ours = rope_frequencies(head_dim, rope["rope_theta"], scaling)
    torch.testing.assert_close(ours, their_freq.double(), rtol=2e-6, atol=0)  # float32's
    assert rope_attention_factor(scaling) == pytest.approx(their_factor, rel=1e-12)
    formula = yarn_reference(head_dim, rope["rope_theta"], rope["factor"],
                             rope["original_max_position_embeddings"],
                             rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0),
                             rope.get("truncate", True))
    torch.testing.assert_close(ours, formula, rtol=1e-14, atol=0)
    # the factor lands on cos and sin
    cos, sin = rope_angles(torch.arange(3), head_dim, rope["rope_theta"], scaling)
    angle = 2 * formula[1]
    assert cos[2, 1].item() == pytest.approx(math.cos(angle) * their_factor, rel=1e-12)
    assert sin[2, 1].item() == pytest.approx(math.sin(angle) * their_factor, rel=1e-12)


def test_interleaved_rope_turns_each_adjacent_pair_as_a_complex_number():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    cos, sin = rope_angles(torch.arange(5), 8, BASE)
    got = apply_rope_interleaved(x, cos, sin)
    # DeepSeek's own form: pairs (2i, 2i + 1) as complex numbers times e^(i t theta_i)
    theta = torch.tensor([BASE ** (-2 * i / 8) for i in range(4)], dtype=torch.float64)
    turn = torch.polar(torch.ones(5, 4, dtype=torch.float64), torch.arange(5.0)[:, None]
                       .double() * theta)
    want = torch.view_as_real(torch.view_as_complex(x.view(2, 3, 5, 4, 2)) * turn).flatten(-2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    # transformers writes the turned pairs de-interleaved (evens, then odds)
    q, _ = hf_v3.apply_rotary_pos_emb_interleave(x, x, cos[None], sin[None])
    torch.testing.assert_close(torch.cat((got[..., 0::2], got[..., 1::2]), -1), q,
                               rtol=0, atol=1e-14)


# ------------------------------------------------------------------ refusals


def one_line(error_type, call, *words):
    with pytest.raises(error_type) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_bad_arguments_are_one_line_refusals():
    def make(**kw):
        return lambda: LatentAttention(D, H, **{**SIZES, **kw})

    one_line(ValueError, make(kv_lora_rank=0), "kv_lora_rank", "positive")
    one_line(ValueError, make(qk_rope_head_dim=5), "qk_rope_head_dim", "even", "5")
    one_line(ValueError, make(backend="flash"), "backend", "absorbed", "'flash'")
    one_line(ValueError, make(q_lora_rank=-3), "q_lora_rank", "-3")
    one_line(TypeError, make(v_head_dim=2.5), "v_head_dim", "2.5")
    one_line(ValueError, make(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
             "original_max_position_embeddings")
    one_line(ValueError, make(rope_scaling={**YARN, "beta_fast": 1, "beta_slow": 2}),
             "beta_slow", "beta_fast")
    one_line(ValueError, make(rope_scaling={**YARN, "mscale": -1}), "mscale", "-1")

    def sparse(**kw):
        base = dict(q_lora_rank=QR, index_n_heads=IH, index_head_dim=ID, index_topk=4)
        return lambda: SparseLatentAttention(D, H, **SIZES, **{**base, **kw})

    one_line(ValueError, sparse(q_lora_rank=None), "q_lora_rank")
    one_line(ValueError, sparse(index_head_dim=2), "index_head_dim (2)", "qk_rope_head_dim")
    one_line(ValueError, sparse(index_topk=0), "index_topk")

    layer = mla(context_length=6)
    one_line(ValueError, lambda: layer(torch.randn(1, 3, D + 1)), "x must have shape", str(D))
    one_line(ValueError, lambda: layer(torch.randn(1, 7, D)), "context_length=6")
    one_line(TypeError, lambda: layer(torch.randn(1, 2, D), cache=KVCache(1, 4, 6, 8)),
             "LatentCache", "KVCache")
    cache = layer.new_cache(1, 4)
    layer(torch.randn(1, 3, D), cache=cache)
    one_line(ValueError, lambda: layer(torch.randn(1, 2, D), cache=cache), "full",
             "3 tokens stored", "max_len=4")
    one_line(ValueError, lambda: mla().new_cache(1), "max_len")
    one_line(ValueError, lambda: LatentCache(1, 4, R, DR).append(torch.randn(1, 2, R)),
             f"{R + DR} numbers per token")
    one_line(ValueError, lambda: dsa().new_cache(1, 4).append(torch.randn(1, 2, R + DR)),
             "index keys")
