"""Gemma 4's pieces of attention, each against a reference written here from its equations
(float64) or against transformers' own function: proportional RoPE, values taken from the
keys and normalised without scale, per-layer head sizes in the layout, the per-layer
inputs. The whole model against transformers is tests/test_open_models.py's gemma4_text.
"""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention_variants import KVHandoff
from qkv.models.gpt import GPTConfig, GPTModel, RMSNorm
from qkv.multihead import MultiHeadAttention
from qkv.positional import check_rope_scaling, rope_frequencies

F64 = torch.float64


@pytest.mark.parametrize("head_dim, fraction, factor", [(32, 0.25, 1.0), (512, 0.25, 1.0),
                                                         (64, 0.5, 2.0), (16, 1.0, 1.0)])
def test_proportional_rope_frequencies_are_transformers(head_dim, fraction, factor):
    """The first ``fraction`` of the pairs turn at the frequencies they have in the whole
    head, the rest not at all: transformers' "proportional" RoPE."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = PretrainedConfig()
    config.head_dim, config.hidden_size, config.num_attention_heads = head_dim, 64, 4
    config.rope_parameters = {"rope_type": "proportional", "rope_theta": 1e6,
                              "partial_rotary_factor": fraction, "factor": factor}
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    scaling = check_rope_scaling({"rope_type": "proportional", "factor": factor,
                                  "partial_rotary_factor": fraction})
    ours = rope_frequencies(head_dim, 1e6, scaling)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    assert int((ours > 0).sum()) == int(fraction * head_dim // 2)


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Pair ``i`` of each head (dimensions ``i`` and ``i + d/2``) turned by ``position *
    freqs[i]``."""
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * freqs[None, :]  # (T, d/2)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1)


def test_values_from_keys_with_a_value_norm_is_the_definition():
    """A Gemma 4 full layer: ``k = rope(norm_k(x W_k))``, ``v = rms(x W_k)`` (the same
    projection, normalised without scale), ``q = rope(norm_q(x W_q))``, scores unscaled,
    causal softmax, GQA; its cache, one token at a time, gives the same outputs."""
    torch.manual_seed(0)
    d, heads, kv_heads, hd, T = 24, 4, 2, 16, 9
    scaling = {"rope_type": "proportional", "factor": 1.0, "partial_rotary_factor": 0.25}
    att = MultiHeadAttention(d, d, 32, num_heads=heads, num_kv_groups=kv_heads, head_dim=hd,
                             rope=True, rope_base=1e6, rope_scaling=scaling,
                             q_norm=RMSNorm(hd), k_norm=RMSNorm(hd), scale=1.0,
                             v_norm=RMSNorm(hd, scaled=False), values_from_keys=True,
                             out_bias=False).double().eval()
    assert att.W_value is None
    with torch.no_grad():
        att.q_norm.scale.normal_(1.0, 0.3)
        att.k_norm.scale.normal_(1.0, 0.3)
    x = torch.randn(2, T, d, dtype=F64)

    freqs = rope_frequencies(hd, 1e6, check_rope_scaling(scaling))
    positions = torch.arange(T)
    split = (2, T, -1, hd)
    q = rotate(rms((x @ att.W_query.weight.T).view(split)) * att.q_norm.scale,
               positions[:, None], freqs)
    raw_k = (x @ att.W_key.weight.T).view(split)
    k = rotate(rms(raw_k) * att.k_norm.scale, positions[:, None], freqs)
    v = rms(raw_k)
    group = heads // kv_heads
    out = torch.empty(2, T, heads, hd, dtype=F64)
    for h in range(heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2)  # (2, T, T), unscaled
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
        out[:, :, h] = scores.softmax(-1) @ v[:, :, h // group]
    want = out.reshape(2, T, heads * hd) @ att.out_proj.weight.T
    with torch.no_grad():
        full = att(x)
        # (qkv's RMSNorm normalises in float32, as the models' own code does)
        torch.testing.assert_close(full, want, rtol=0, atol=1e-6)
        cache = att.new_cache(2, T)
        steps = torch.cat([att(x[:, t : t + 1], cache=cache) for t in range(T)], dim=1)
        torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)


def test_values_from_keys_refuses_cross_attention():
    with pytest.raises(ValueError, match="values_from_keys.*self-attention only"):
        MultiHeadAttention(8, 8, num_heads=2, kdim=6, values_from_keys=True)


def gemma4_like(**changes) -> GPTConfig:
    """Three layers: sliding with 8-wide heads, full with 16-wide heads of one key/value
    head whose values are its keys, then a sliding layer sharing layer 0's keys and
    values with a twice wider MLP."""
    fields = dict(vocab_size=50, context_length=64, emb_dim=16, n_heads=2, n_layers=3,
                  n_kv_groups=2, head_dim=8, rope=True, rope_base=1e6, rope_local_base=1e4,
                  rope_scaling={"rope_type": "proportional", "factor": 1.0,
                                "partial_rotary_factor": 0.25},
                  window_size=4, layer_types=["sliding", "full", "sliding"], norm="rmsnorm",
                  mlp="geglu", hidden_dim=12, mlp_bias=False, qkv_bias=False, out_bias=False,
                  qk_norm=True, post_norms=True, query_scale=1.0, embed_scale=True,
                  attention_options={"mha": {"v_norm": True}},
                  layout=[{}, {"head_dim": 16, "kv_heads": 1,
                               "options": {"values_from_keys": True}},
                          {"attention": "shared_kv", "kv_source": 0, "hidden_dim": 24}],
                  per_layer_inputs={"width": 4, "vocab_size": 50}, layer_scalar=True,
                  logit_softcap=30.0, drop_rate=0.0, norm_eps=1e-6)
    return GPTConfig(**{**fields, **changes})


def test_each_layer_is_built_from_its_own_sizes_and_counted_from_the_modules():
    cfg = gemma4_like()
    model = GPTModel(cfg)
    atts = [block.att for block in model.trf_blocks]
    assert [(a.head_dim, a.num_kv_groups) for a in atts] == [(8, 2), (16, 1), (8, 2)]
    assert atts[1].W_value is None and atts[0].W_value is not None
    assert [block.ff.fc1.out_features for block in model.trf_blocks] == [12, 12, 24]
    assert [block.att.q_norm.scale.shape[0] for block in model.trf_blocks] == [8, 16, 8]
    # the cache: layer 0's ring of 4 and layer 1's keys and values (one head of 16), each
    # two tensors of float32; layer 2 keeps nothing
    assert cfg.kv_cache_bytes(1, 10) == 2 * 4 * (2 * 8 * 4 + 1 * 16 * 10)
    # per-layer inputs: a 50 x (3 * 4) table, a 16 -> 12 projection and a 4-wide norm;
    # each block's gate 16 -> 4, its projection 4 -> 16 and a 16-wide norm
    ple = model.per_layer_inputs
    assert sum(p.numel() for p in ple.parameters()) == 50 * 12 + 16 * 12 + 4
    assert sum(p.numel() for p in model.trf_blocks[0].ple.parameters()) == 2 * 16 * 4 + 16
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    # FLOPs: 6 per weight of every product, and 3 x 4 T d per layer for the scores, T the
    # keys a query reads (layer 0's window of 4, layer 1's 64, layer 2 its source's 4)
    # and d each layer's own query width (2 heads of 8, of 16, of 8)
    products = sum(m.weight.numel() for m in model.modules()
                   if isinstance(m, torch.nn.Linear))
    scores = 4 * 4 * 16 + 4 * 64 * 32 + 4 * 4 * 16
    assert cfg.training_flops_per_token() == 6 * products + 3 * scores


def test_per_layer_inputs_and_the_soft_cap_are_the_definition():
    """The per-layer inputs and the soft cap, recomputed here: each block adds ``norm(proj(
    gelu(gate(x)) * p_i))`` after its MLP, then multiplies by its scalar, where ``p =
    (norm(P e / sqrt(d)) + E[id] sqrt(w)) / sqrt(2)``; the logits are ``30 tanh(z / 30)``."""
    torch.manual_seed(1)
    cfg = gemma4_like()
    model = GPTModel(cfg).double().eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.layer_scalar.fill_(0.7)
    ids = torch.randint(0, 50, (1, 7))
    ple = model.per_layer_inputs
    e = model.tok_emb(ids) * math.sqrt(16)
    p = ((rms(ple.proj(e).view(1, 7, 3, 4) / 4.0) * ple.norm.scale)
         + ple.embed(ids).view(1, 7, 3, 4) * 2.0) / math.sqrt(2)
    handoff = KVHandoff()  # layer 0's keys and values, for layer 2
    with torch.no_grad():
        torch.testing.assert_close(ple(ids, e), p, rtol=0, atol=1e-6)  # (norm: float32)
        x = e
        for i, block in enumerate(model.trf_blocks):
            block.ple, gate = None, block.ple  # the block without its per-layer input...
            scalar, block.layer_scalar = block.layer_scalar, None
            y = block(x, cache=handoff) if i == 0 else block(x, shared=handoff)
            # ... then the per-layer input and the scalar, by their equations
            added = gate.proj(torch.nn.functional.gelu(gate.gate(y), approximate="tanh")
                              * p[:, :, i])
            x = (y + rms(added) * gate.norm.scale) * 0.7
            block.ple, block.layer_scalar = gate, scalar
        z = model.out_head(model.final_norm(x))
        torch.testing.assert_close(model(ids), 30.0 * torch.tanh(z / 30.0),
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("changes, words", [
    (dict(layout=[{"head_dim": 7}, {}, {}]), r"layout\[0\]\.head_dim must be even"),
    (dict(layout=[{"kv_heads": 3}, {}, {}]), r"layout\[0\]\.kv_heads \(3\) must divide"),
    (dict(layout=[{"options": 4}, {}, {}]), r"layout\[0\]\.options must be an object"),
    (dict(layout=[{"hidden_dim": 0}, {}, {}]), r"layout\[0\]\.hidden_dim"),
    (dict(per_layer_inputs={"width": 4}), r"per_layer_inputs must be None or"),
    (dict(logit_softcap=-1.0), r"logit_softcap"),
    (dict(layout=[{"mlp": "dense_and_moe"}, {}, {}]), r"mlp is 'dense_and_moe' but .*moe "
                                                       r"is None"),
])
def test_bad_layouts_are_one_line(changes, words):
    with pytest.raises(ValueError, match=words) as error:
        gemma4_like(**changes)
    assert "\n" not in str(error.value)
