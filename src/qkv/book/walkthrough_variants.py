"""The attention of 2025-26 models, one step at a time, after the book's chapter 3.

:func:`variant_steps` runs each mechanism of the attention core on a toy input in the
style of :mod:`qkv.book.walkthrough`: every :class:`~qkv.book.walkthrough.Step` holds
the tensors to print, in order, with their shapes in the printed headers, and the
cache a decoder keeps, counted token by token. The sections (prefixes of
:data:`VARIANT_SECTIONS`, described in :data:`qkv.options.WALKTHROUGH_MECHANISMS`):

- ``mla``: multi-head latent attention (:class:`qkv.latent_attention.LatentAttention`):
  the latent ``c (T, r)`` and the RoPE key, what its :class:`~qkv.kv_cache.LatentCache`
  keeps per token against what multi-head attention's :class:`~qkv.kv_cache.KVCache`
  would, and the "decompress, then attend" definition;
- ``absorbed``: the same layer with its key and value maps folded into the query and the
  output, attention in latent space, and decoding from the cache;
- ``dsa``: DeepSeek sparse attention (:class:`~qkv.latent_attention.SparseLatentAttention`):
  the lightning indexer's scores, the top-k keys of each query, attention over them;
- ``sinks``: :class:`qkv.attention_variants.SinkAttention`: rows of weights that sum to
  less than one, and where the rest goes;
- ``kvshare``: :class:`~qkv.attention_variants.SharedKVAttention`: a later layer attends
  with an earlier layer's keys and values (a :class:`~qkv.attention_variants.KVHandoff`),
  which only the earlier layer caches;
- ``induction``: a previous-token head and an induction head built by hand from
  :class:`qkv.MultiHeadAttention` on the text said twice, and the next word they predict;
- ``delta``: linear attention built up to the gated delta rule of
  :class:`qkv.linear_attention.GatedDeltaNet`: a running sum of ``k v^T``, a decay, the
  delta correction, and a state of fixed size against a cache that grows.

The toy input is the book's sentence (or the caller's text), each distinct word a
seeded random row of width :data:`D_MODEL` (:func:`~qkv.book.walkthrough.toy_embedding`),
as one batch: ``x (1, T, D_MODEL)``. Every layer is created after
``torch.manual_seed(seed)`` on a forked generator, so the caller's random state is left
alone and the same text and seed give the same numbers. The layers each step ran are in
its ``modules``, so their weights can be read back. Tensors are float32; caches are
counted in float32 bytes (4 per number).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..attention_variants import KVHandoff, SharedKVAttention, SinkAttention
from ..functional import causal_mask
from ..kv_cache import KVCache, LatentCache
from ..latent_attention import LatentAttention, SparseLatentAttention
from ..linear_attention import gated_delta_rule, gated_delta_weights, l2_normalize
from ..multihead import MultiHeadAttention
from ..options import BOOK_TEXT, WALKTHROUGH_MECHANISMS
from ..positional import apply_rope, apply_rope_interleaved, rope_angles
from .walkthrough import LabelPair, Step, toy_embedding

__all__ = ["variant_steps", "VARIANT_SECTIONS", "MECHANISMS", "D_MODEL", "LATENT",
           "SPARSE", "SINKS", "SHARED", "DEEPSEEK_V3_LATENT"]

# The toy layers' sizes: small enough to print, each dimension distinct where it can be
# so that a printed shape says which one it is.
D_MODEL = 8
NUM_HEADS = 2
# LatentAttention's options: r = 4, d_n = 3, d_r = 4 (two pairs, so that interleaved RoPE
# differs from "rotate half"), d_v = 3, and a query bottleneck of 6.
LATENT = dict(kv_lora_rank=4, q_lora_rank=6, qk_nope_head_dim=3, qk_rope_head_dim=4,
              v_head_dim=3)
# SparseLatentAttention's indexer: H = 2 index heads of d_I = 6 (RoPE on the first d_r = 4),
# each query keeps 3 keys.
SPARSE = dict(index_n_heads=2, index_head_dim=6, index_topk=3)
# The sink logits of the two heads (a trained model learns them): at 0 a head's sink
# weighs as much as a key it scores 0 with; at 2, e^2 = 7.4 times as much.
SINKS = (0.0, 2.0)
# The KV-sharing pair: 2 query heads of 4 sharing 1 key/value head (GQA), RoPE.
SHARED = dict(num_heads=2, num_kv_groups=1, rope=True)
# DeepSeek-V3's attention shape (its config.json: hidden_size 7168, 128 heads,
# kv_lora_rank 512, q_lora_rank 1536, qk_nope_head_dim 128, qk_rope_head_dim 64,
# v_head_dim 128), to count its cache per token beside the toy's.
DEEPSEEK_V3_LATENT = dict(d_model=7168, num_heads=128, kv_lora_rank=512, q_lora_rank=1536,
                          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
BYTES = 4  # float32

MECHANISMS = tuple(WALKTHROUGH_MECHANISMS)
VARIANT_SECTIONS = ("mla.1", "mla.2", "mla.3", "absorbed.1", "absorbed.2", "dsa.1", "dsa.2",
                    "dsa.3", "sinks.1", "sinks.2", "kvshare.1", "kvshare.2", "delta.1",
                    "delta.2", "delta.3", "delta.4", "induction.1", "induction.2",
                    "induction.3")
# The linear-attention head: keys and queries of 4, values of 3 (a state of 4 x 3).
DELTA_KEY, DELTA_VALUE = 4, 3


@dataclass
class _Toy:
    """The input every section shares, and what the MLA steps hand on."""

    tokens: tuple[str, ...]
    x: Tensor  # (1, T, D_MODEL)
    seed: int
    latent: dict[str, Tensor] = field(default_factory=dict)  # mla.1's tensors, for later

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def heads(self) -> tuple[str, ...]:
        return tuple(f"head {h + 1}" for h in range(NUM_HEADS))

    @property
    def attn(self) -> LabelPair:
        return self.tokens, self.tokens

    @property
    def by_token(self) -> LabelPair:
        return self.tokens, ()


def _seeded(seed: int) -> None:
    # torch.manual_seed's effect on the CPU generator, which initialises every layer here
    torch.random.default_generator.manual_seed(seed)


def _latent_layer(seed: int, cls: type[LatentAttention] = LatentAttention, **extra) -> nn.Module:
    _seeded(seed)
    return cls(D_MODEL, NUM_HEADS, **LATENT, **extra)


def _rope_table(num_tokens: int, dim: int) -> tuple[Tensor, Tensor]:
    """RoPE's ``cos, sin (T, dim)`` at positions ``0 .. T - 1`` (base 10,000)."""
    return rope_angles(torch.arange(num_tokens), dim)


def _queries(layer: LatentAttention, x: Tensor, cos: Tensor, sin: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
    """``x (T, D) -> c_q (T, q_lora_rank), q_nope (h, T, d_n), q_rope (h, T, d_r)``, the
    rope part rotated in interleaved pairs, with the layer's own projections."""
    d_n, d_r = layer.qk_nope_head_dim, layer.qk_rope_head_dim
    c_q = layer.q_a_layernorm(layer.q_a_proj(x))
    q = layer.q_b_proj(c_q).view(x.shape[0], layer.num_heads, d_n + d_r).transpose(0, 1)
    q_nope, q_rope = q.split([d_n, d_r], dim=-1)
    return c_q, q_nope, apply_rope_interleaved(q_rope, cos, sin)


def _latent(layer: LatentAttention, x: Tensor, cos: Tensor, sin: Tensor
            ) -> tuple[Tensor, Tensor]:
    """``x (T, D) -> c (T, r), k_rope (T, d_r)``: the normalised latent and the rotated
    key every head shares."""
    c, k_rope = layer.kv_a_proj_with_mqa(x).split(
        [layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
    return layer.kv_a_layernorm(c), apply_rope_interleaved(k_rope, cos, sin)


def _decompress(layer: LatentAttention, c: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
    """Every head's keys ``[c W_UK,i ; k_rope] (h, T, d_n + d_r)`` and values ``c W_UV,i
    (h, T, d_v)``: what multi-head attention would cache for the same heads."""
    h, d_n = layer.num_heads, layer.qk_nope_head_dim
    k_nope, v = layer.kv_b_proj(c).view(c.shape[0], h, d_n + layer.v_head_dim).transpose(
        0, 1).split([d_n, layer.v_head_dim], dim=-1)
    return torch.cat((k_nope, k_rope.expand(h, -1, -1)), dim=-1), v


def _bytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _latent_cache_bytes(cache: LatentCache) -> int:
    """Bytes of what ``cache`` holds now: its first ``pos`` tokens."""
    held = [cache.kv[:, : cache.pos]]
    if cache.index_keys is not None:
        held.append(cache.index_keys[:, : cache.pos])
    return _bytes(*held)


def _kv_cache_bytes(cache: KVCache) -> int:
    """Bytes of the keys and values ``cache`` holds now."""
    return _bytes(cache.keys[:, :, : cache.stored], cache.values[:, :, : cache.stored])


def _decode(layer: nn.Module, x: Tensor, cache: object) -> Tensor:
    """``layer`` run on ``x (1, T, D)`` one token at a time with ``cache``: ``(1, T, D)``."""
    return torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(x.shape[1])], dim=1)


def _run(layer: LatentAttention, x: Tensor, backend: str, **kwargs):
    """``layer(x, **kwargs)`` with its ``backend`` ("decompress" or "absorbed") for this
    one call."""
    saved, layer.backend = layer.backend, backend
    try:
        return layer(x, **kwargs)
    finally:
        layer.backend = saved


def _max_difference(a: Tensor, b: Tensor) -> Tensor:
    return (a - b).abs().max()


# ---------------------------------------------------------------------------
# Multi-head latent attention
# ---------------------------------------------------------------------------


def _step_mla_1(c: _Toy, layer: LatentAttention) -> Step:
    x = c.x[0]
    cos, sin = _rope_table(c.num_tokens, layer.qk_rope_head_dim)
    c_q, q_nope, q_rope = _queries(layer, x, cos, sin)
    latent, k_rope = _latent(layer, x, cos, sin)
    c.latent = dict(q_nope=q_nope, q_rope=q_rope, c=latent, k_rope=k_rope)
    r, d_r = layer.kv_lora_rank, layer.qk_rope_head_dim
    return Step(
        "mla.1",
        "Latent attention: the latent c and the RoPE key",
        f"LatentAttention (seed {c.seed}; d_model {D_MODEL}, {layer.num_heads} heads) "
        f"compresses each token into one latent c of width r = {r}: kv_a_proj_with_mqa "
        f"maps x to {r + d_r} numbers, the first {r} normalised (RMSNorm) into c, the last "
        f"{d_r} rotated by RoPE into k_rope, one key that every head shares. Positions live "
        "only in the rope parts: a rotation depends on the position, so it could not be "
        f"folded into the maps that rebuild keys from c. The queries go through a bottleneck "
        f"c_q (q_lora_rank {layer.q_lora_rank}) and split per head into q_nope "
        f"({layer.qk_nope_head_dim} wide) and q_rope ({d_r}, rotated).",
        {"x": x, "c_q": c_q, "q_nope": q_nope, "q_rope": q_rope, "c (latent)": latent,
         "k_rope": k_rope},
        labels={"x": c.by_token, "c_q": c.by_token, "q_nope": c.by_token,
                "q_rope": c.by_token, "c (latent)": c.by_token, "k_rope": c.by_token},
        modules={"mla": layer},
    )


def _deepseek_v3_per_token() -> Tensor:
    """Numbers cached per token and layer at DeepSeek-V3's shape: its latent attention's
    cache, and multi-head attention's for the same heads; both made on ``meta``."""
    shape = dict(DEEPSEEK_V3_LATENT)
    d_model, heads = shape.pop("d_model"), shape.pop("num_heads")
    with torch.device("meta"):
        v3 = LatentAttention(d_model, heads, **shape)
    latent = v3.new_cache(1, 1)
    mha = KVCache(1, heads, 1, v3.qk_head_dim, value_dim=v3.v_head_dim, device="meta")
    return torch.tensor([latent.kv.numel(), mha.keys.numel() + mha.values.numel()])


def _step_mla_2(c: _Toy, layer: LatentAttention) -> Step:
    h, t_max = layer.num_heads, c.num_tokens
    cache = layer.new_cache(1, t_max)
    # What multi-head attention with these heads would cache: every head's key and value.
    keys, values = _decompress(layer, c.latent["c"], c.latent["k_rope"])
    mha_cache = KVCache(1, h, t_max, layer.qk_head_dim, value_dim=layer.v_head_dim)
    held = []
    for t in range(t_max):
        layer(c.x[:, t : t + 1], cache=cache)
        mha_cache.append(keys[None, :, t : t + 1], values[None, :, t : t + 1])
        held.append([_latent_cache_bytes(cache), _kv_cache_bytes(mha_cache)])
    per_token = torch.tensor([cache.kv.shape[-1],
                              mha_cache.keys.shape[-1] * h + mha_cache.values.shape[-1] * h])
    v3 = _deepseek_v3_per_token()
    both = ("MLA", "MHA")
    return Step(
        "mla.2",
        "What the cache keeps per token",
        f"Decoding one token at a time, the layer's LatentCache stores [c ; k_rope] per token: "
        f"{int(per_token[0])} numbers, the rows below are the latents of mla.1. Multi-head "
        f"attention with the same {h} heads would cache each head's key (d_n + d_r = "
        f"{layer.qk_head_dim}) and value (d_v = {layer.v_head_dim}): {int(per_token[1])} "
        f"numbers. In float32 ({BYTES} bytes each) the two caches grow as listed. At "
        f"DeepSeek-V3's shape (128 heads, r = 512, d_r = 64) it is {int(v3[0])} numbers "
        f"against {int(v3[1]):,}, {int(v3[1]) / int(v3[0]):.0f} times fewer, per token and "
        "layer.",
        {"cache.kv": cache.kv[0, : cache.pos], "numbers per token": per_token,
         "cache bytes after each token": torch.tensor(held),
         "DeepSeek-V3 numbers per token": v3},
        labels={"cache.kv": c.by_token, "numbers per token": (both, None),
                "cache bytes after each token": (c.tokens, both),
                "DeepSeek-V3 numbers per token": (both, None)},
        modules={"mla": layer},
    )


def _step_mla_3(c: _Toy, layer: LatentAttention) -> Step:
    keys, values = _decompress(layer, c.latent["c"], c.latent["k_rope"])
    out, weights = _run(layer, c.x, "decompress", need_weights=True)
    return Step(
        "mla.3",
        "Decompress, then attend",
        "The definition: kv_b_proj rebuilds each head's key part k_nope = c W_UK,i and value "
        "v = c W_UV,i from the latent; the shared k_rope is appended to every head's key and "
        "q_rope to its query. Then it is multi-head attention with a causal mask, scores "
        f"scaled by (d_n + d_r)^-1/2 = {layer.scale:.4f}. Decoding this way rebuilds "
        f"T x {layer.num_heads} x {layer.qk_head_dim + layer.v_head_dim} numbers from the "
        "cache at every step.",
        {"keys (decompressed)": keys, "values (decompressed)": values,
         "scale": torch.tensor(layer.scale), "attn_weights": weights[0], "out": out[0]},
        labels={"keys (decompressed)": c.by_token, "values (decompressed)": c.by_token,
                "attn_weights": c.attn, "out": c.by_token},
        weights=weights[0],
        weights_title="LatentAttention",
        tokens=c.tokens,
        modules={"mla": layer},
    )


# ---------------------------------------------------------------------------
# Absorbed latent attention
# ---------------------------------------------------------------------------


def _step_absorbed_1(c: _Toy, layer: LatentAttention) -> Step:
    h, d_n, r = layer.num_heads, layer.qk_nope_head_dim, layer.kv_lora_rank
    w = layer.kv_b_proj.weight.view(h, d_n + layer.v_head_dim, r)
    w_uk, w_uv = w[:, :d_n], w[:, d_n:]  # (h, d_n, r), (h, d_v, r)
    q_latent = c.latent["q_nope"] @ w_uk  # (h, T, r): each head's query in latent space
    key = torch.cat((c.latent["c"], c.latent["k_rope"]), dim=-1)  # (T, r + d_r)
    query = torch.cat((q_latent, c.latent["q_rope"]), dim=-1)  # (h, T, r + d_r)
    keep = causal_mask(c.num_tokens)
    scores = (query @ key.T * layer.scale).masked_fill(~keep, float("-inf"))
    out, weights = _run(layer, c.x, "absorbed", need_weights=True)
    decompressed = _run(layer, c.x, "decompress")
    o_latent = weights[0] @ c.latent["c"]  # (h, T, r): the weighted sum of latents
    return Step(
        "absorbed.1",
        "Absorbed: attention in latent space",
        "Since q_nope . (c W_UK,i) = (q_nope W_UK,i^T) . c, the key map W_UK,i folds into "
        f"the query, which then lives in latent space (q_latent, r = {r} wide); since "
        "sum_u a_u (c_u W_UV,i) = (sum_u a_u c_u) W_UV,i, the value map moves after the "
        "weighted sum. So every head scores [q_latent ; q_rope] against the one cached key "
        "[c ; k_rope] and averages the latents themselves: multi-query attention straight "
        "on the cache, no per-head key or value built. Scores, weights and output are "
        "those of mla.3.",
        {"W_UK": w_uk, "q_latent": q_latent, "latent key [c ; k_rope]": key,
         "scores (latent space)": scores, "attn_weights": weights[0], "o_latent": o_latent,
         "W_UV": w_uv, "out (absorbed)": out[0],
         "max |absorbed - decompressed|": _max_difference(out, decompressed)},
        labels={"q_latent": c.by_token, "latent key [c ; k_rope]": c.by_token,
                "scores (latent space)": c.attn, "attn_weights": c.attn,
                "o_latent": c.by_token, "out (absorbed)": c.by_token},
        modules={"mla": layer},
    )


def _step_absorbed_2(c: _Toy, layer: LatentAttention) -> Step:
    full = layer(c.x)
    cache = layer.new_cache(1, c.num_tokens)
    stepped = _decode(layer, c.x, cache)  # backend "auto": absorbed for one token
    per_key = layer.num_heads * (layer.qk_head_dim + layer.v_head_dim)
    built = torch.tensor([[(t + 1) * per_key, 0] for t in range(c.num_tokens)])
    return Step(
        "absorbed.2",
        "Decoding from the latent cache",
        "Fed one token at a time with its LatentCache, the layer (backend 'auto') attends "
        "in the absorbed form: each step reads the cached [c ; k_rope] rows as they are. "
        "The output equals the full forward's. Decompressing instead would rebuild every "
        f"cached token's keys and values at each step ({per_key} numbers per token); the "
        "absorbed form builds none.",
        {"out (one token at a time)": stepped[0],
         "max |one at a time - full forward|": _max_difference(stepped, full),
         "keys and values built per step": built},
        labels={"out (one token at a time)": c.by_token,
                "keys and values built per step": (c.tokens, ("decompress", "absorbed"))},
        modules={"mla": layer},
    )


# ---------------------------------------------------------------------------
# DeepSeek sparse attention
# ---------------------------------------------------------------------------


def _index_inputs(layer: SparseLatentAttention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``x (1, T, D) -> c_q (1, T, q_lora_rank), cos, sin (T, d_r)``: what the indexer
    reads beside ``x``."""
    cos, sin = _rope_table(x.shape[1], layer.qk_rope_head_dim)
    return layer.q_a_layernorm(layer.q_a_proj(x)), cos, sin


def _step_dsa_1(c: _Toy, layer: SparseLatentAttention) -> Step:
    indexer = layer.indexer
    c_q, cos, sin = _index_inputs(layer, c.x)
    keys = indexer.keys(c.x, cos, sin)  # (1, T, d_I)
    # The index queries, for show: H heads from c_q, "rotate half" RoPE on the first d_r.
    q = indexer.wq_b(c_q[0]).view(c.num_tokens, indexer.num_heads, indexer.head_dim)
    q = q.transpose(0, 1)
    turned = apply_rope(q[..., : indexer.rope_dim], cos, sin)
    q = torch.cat((turned, q[..., indexer.rope_dim :]), dim=-1)
    w = indexer.weights_proj(c.x[0]) * indexer.num_heads**-0.5
    scores = indexer.scores(c.x, c_q, cos, sin, keys)[0]
    index_heads = tuple(f"head {j + 1}" for j in range(indexer.num_heads))
    return Step(
        "dsa.1",
        "Sparse attention: the lightning indexer",
        f"SparseLatentAttention (seed {c.seed}) is latent attention with an indexer that "
        f"picks which keys each query reads. {indexer.num_heads} small index heads "
        f"({indexer.head_dim} wide) score a query against each earlier token's one index "
        "key, each head's dot product passed through ReLU and weighted by w, a per-token "
        "weight of each head: I(t, u) = sum_j w_j(t) ReLU(q_j(t) . k(u) / sqrt(d_I)). The "
        "future is -inf. Only the ranking matters: no softmax, no gradient.",
        {"index keys": keys[0], "index queries": q, "w": w, "index scores": scores},
        labels={"index keys": c.by_token, "index queries": c.by_token,
                "w": (c.tokens, index_heads), "index scores": c.attn},
        modules={"dsa": layer},
    )


def _step_dsa_2(c: _Toy, layer: SparseLatentAttention) -> Step:
    indexer = layer.indexer
    c_q, cos, sin = _index_inputs(layer, c.x)
    keys = indexer.keys(c.x, cos, sin)
    selected = indexer.select(c.x, c_q, cos, sin, keys)[0]  # (T, k)
    kept = torch.zeros(c.num_tokens, c.num_tokens, dtype=torch.long)
    kept.scatter_(-1, selected, 1)
    kept = kept * causal_mask(c.num_tokens)
    k = selected.shape[-1]
    return Step(
        "dsa.2",
        "Top-k: the keys each query keeps",
        f"Each query keeps the index_topk = {indexer.top_k} keys of highest index score "
        f"(here {k}: no more than there are tokens), best first. A query with fewer than "
        f"{indexer.top_k} keys before it also picks some after it, which the causal mask "
        "then drops: the first queries keep all they may see, the later ones "
        f"{indexer.top_k} of their keys.",
        {"selected": selected, "kept": kept, "keys kept per query": kept.sum(dim=-1)},
        labels={"selected": c.by_token, "kept": c.attn, "keys kept per query": c.by_token},
        modules={"dsa": layer},
    )


def _step_dsa_3(c: _Toy, layer: SparseLatentAttention) -> Step:
    out, weights = layer(c.x, need_weights=True)
    selected = layer.selected[0]
    # With index_topk at the context's length every key is kept: dense latent attention.
    dense = _latent_layer(c.seed)
    dense.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if not k.startswith("indexer.")})
    top_k, layer.indexer.top_k = layer.indexer.top_k, c.num_tokens
    every_key = layer(c.x)
    layer.indexer.top_k = top_k
    cache = layer.new_cache(1, c.num_tokens)
    held = []
    for t in range(c.num_tokens):
        layer(c.x[:, t : t + 1], cache=cache)
        held.append([_bytes(cache.kv[:, : cache.pos]),
                     _bytes(cache.index_keys[:, : cache.pos])])
    stepped = _decode(layer, c.x, layer.new_cache(1, c.num_tokens))
    per_token = torch.tensor([cache.kv.shape[-1], cache.index_keys.shape[-1]])
    parts = ("latent", "index key")
    return Step(
        "dsa.3",
        "Attention over the kept keys only",
        "The softmax runs over each query's kept keys: every other weight is exactly 0, so "
        f"with a long context a query reads {layer.indexer.top_k} keys however many are "
        "cached. With index_topk at the number of tokens nothing is dropped and the layer "
        "is dense latent attention (the same weights in a LatentAttention). The cache keeps "
        "each token's index key beside its latent, so the indexer can rank old tokens "
        "without recomputing them: DeepSeek-V3.2 caches 576 + 128 = 704 numbers per token "
        "and layer.",
        {"attn_weights": weights[0], "out": out[0], "layer.selected": selected,
         "max |top_k = T - dense latent attention|": _max_difference(every_key, dense(c.x)),
         "numbers per token": per_token, "cache bytes after each token": torch.tensor(held),
         "max |one at a time - full forward|": _max_difference(stepped, out)},
        labels={"attn_weights": c.attn, "out": c.by_token, "layer.selected": c.by_token,
                "numbers per token": (parts, None),
                "cache bytes after each token": (c.tokens, parts)},
        weights=weights[0],
        weights_title=f"SparseLatentAttention, top {layer.indexer.top_k}",
        tokens=c.tokens,
        modules={"dsa": layer, "dense": dense},
    )


# ---------------------------------------------------------------------------
# Attention sinks
# ---------------------------------------------------------------------------


def _sink_layer(c: _Toy) -> SinkAttention:
    _seeded(c.seed)
    layer = SinkAttention(D_MODEL, D_MODEL, c.num_tokens, 0.0, num_heads=NUM_HEADS)
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor(SINKS))
    return layer


def _split_heads(t: Tensor, heads: int) -> Tensor:
    """``(T, heads * d) -> (heads, T, d)``."""
    return t.view(t.shape[0], heads, -1).transpose(0, 1)


def _step_sinks_1(c: _Toy, layer: SinkAttention) -> Step:
    x = c.x[0]
    q = _split_heads(layer.W_query(x), layer.num_heads)
    k = _split_heads(layer.W_key(x), layer.num_heads)
    keep = causal_mask(c.num_tokens)
    scores = (q @ k.transpose(-2, -1) * layer.head_dim**-0.5).masked_fill(~keep,
                                                                          float("-inf"))
    out, weights = layer(c.x, need_weights=True)
    sums = weights[0].sum(dim=-1)
    return Step(
        "sinks.1",
        "Learned sinks: weights that sum to less than one",
        f"SinkAttention (seed {c.seed}) gives each head one learned logit, its sink (here "
        f"{', '.join(f'{s:g}' for s in SINKS)}), that joins the softmax's denominator with no "
        "value behind it: w(t, u) = e^s(t,u) / (sum_u' e^s(t,u') + e^sink). A row's weights "
        "over the real keys add up to less than one; the rest, e^sink / (sum e^s + e^sink), "
        "goes to the sink, that is to nothing. A head with nothing to look for can so stay "
        "quiet instead of piling its weight on the first token.",
        {"scores": scores, "sinks": layer.sinks.detach(), "attn_weights": weights[0],
         "attn_weights.sum(dim=-1)": sums, "to the sink: 1 - sum": 1 - sums, "out": out[0]},
        labels={"scores": c.attn, "attn_weights": c.attn,
                "sinks": (c.heads, None),
                "attn_weights.sum(dim=-1)": (c.heads, c.tokens),
                "to the sink: 1 - sum": (c.heads, c.tokens), "out": c.by_token},
        weights=weights[0],
        weights_title="SinkAttention",
        tokens=c.tokens,
        modules={"sinks": layer},
    )


def _step_sinks_2(c: _Toy, layer: SinkAttention) -> Step:
    plain = MultiHeadAttention(D_MODEL, D_MODEL, c.num_tokens, 0.0, num_heads=NUM_HEADS)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "sinks"})
    out, weights = layer(c.x, need_weights=True)
    plain_out, plain_weights = plain(c.x, need_weights=True)
    kept = weights[0].sum(dim=-1, keepdim=True)  # (h, T, 1)
    return Step(
        "sinks.2",
        "Against the same layer without sinks",
        "MultiHeadAttention with the same weights and no sinks spreads each whole row over "
        "the keys. The sink layer's weights are those rows times the share the sink leaves "
        "(the sums of sinks.1): the sink only scales each query's context vector down, "
        "before out_proj, more so where a head's scores are low against its sink.",
        {"attn_weights (no sinks)": plain_weights[0],
         "max |sink weights - weights without sinks x sum|":
             _max_difference(weights[0], plain_weights[0] * kept),
         "out (no sinks)": plain_out[0], "out (sinks)": out[0]},
        labels={"attn_weights (no sinks)": c.attn, "out (no sinks)": c.by_token,
                "out (sinks)": c.by_token},
        modules={"sinks": layer, "plain": plain},
    )


# ---------------------------------------------------------------------------
# KV sharing across layers
# ---------------------------------------------------------------------------


def _shared_pair(c: _Toy) -> tuple[MultiHeadAttention, SharedKVAttention]:
    _seeded(c.seed)
    source = MultiHeadAttention(D_MODEL, D_MODEL, c.num_tokens, 0.0, **SHARED)
    later = SharedKVAttention(D_MODEL, D_MODEL, c.num_tokens, 0.0, **SHARED)
    return source, later


def _through_pair(source: MultiHeadAttention, later: SharedKVAttention, x: Tensor,
                  handoff: KVHandoff, need_weights: bool = False):
    """The source layer on ``x``, then the later layer on ``x + source(x)`` (standing in
    for the layers between them) with the source's keys and values."""
    y = source(x, cache=handoff)
    return later(x + y, handoff, need_weights=need_weights)


def _step_kvshare_1(c: _Toy, source: MultiHeadAttention, later: SharedKVAttention) -> Step:
    handoff = KVHandoff()
    out, weights = _through_pair(source, later, c.x, handoff, need_weights=True)
    params = torch.tensor([sum(p.numel() for p in m.parameters()) for m in (source, later)])
    pair = ("source", "later")
    return Step(
        "kvshare.1",
        "KV sharing: a later layer attends with an earlier layer's keys",
        f"The source layer (MultiHeadAttention, seed {c.seed}: {source.num_heads} query "
        f"heads, {source.num_kv_groups} key/value head of {source.head_dim}, RoPE) is given "
        "a KVHandoff as its cache; the handoff keeps the keys and values it attended with. "
        "A later SharedKVAttention (here fed x + source(x), standing in for the layers "
        "between) projects queries only and attends with those keys and values: it has no "
        "W_key or W_value, so fewer parameters.",
        {"handoff.keys": handoff.keys[0], "handoff.values": handoff.values[0],
         "attn_weights (later layer)": weights[0], "out (later layer)": out[0],
         "parameters": params},
        labels={"handoff.keys": c.by_token, "handoff.values": c.by_token,
                "attn_weights (later layer)": c.attn, "out (later layer)": c.by_token,
                "parameters": (pair, None)},
        weights=weights[0],
        weights_title="SharedKVAttention",
        tokens=c.tokens,
        modules={"source": source, "later": later},
    )


def _step_kvshare_2(c: _Toy, source: MultiHeadAttention, later: SharedKVAttention) -> Step:
    full = _through_pair(source, later, c.x, KVHandoff())
    cache = source.new_cache(1, c.num_tokens)
    assert later.new_cache(1, c.num_tokens) is None  # nothing of its own to keep
    steps, held = [], []
    for t in range(c.num_tokens):
        handoff = KVHandoff(cache)
        steps.append(_through_pair(source, later, c.x[:, t : t + 1], handoff))
        held.append([_kv_cache_bytes(cache), 2 * _kv_cache_bytes(cache)])
    stepped = torch.cat(steps, dim=1)
    return Step(
        "kvshare.2",
        "Decoding: the cache held once",
        "Decoding, the source layer's own KVCache sits inside a fresh KVHandoff each step: "
        "the new token's key and value are stored once and handed on, and the later layer's "
        "new_cache() is None. The output equals the full forward's. Two layers keep one "
        "layer's cache; without sharing each would keep its own, twice as much (Gemma 3n "
        "E4B shares 15 of its 35 layers' caches this way).",
        {"out (one token at a time)": stepped[0],
         "max |one at a time - full forward|": _max_difference(stepped, full),
         "cache bytes after each token": torch.tensor(held)},
        labels={"out (one token at a time)": c.by_token,
                "cache bytes after each token": (c.tokens, ("shared", "unshared"))},
        modules={"source": source, "later": later},
    )


# ---------------------------------------------------------------------------
# Linear attention, up to the gated delta rule
# ---------------------------------------------------------------------------


@dataclass
class _Delta:
    """One linear-attention head's inputs on the toy: ``q, k (T, d_k)`` L2-normalised (as
    Gated DeltaNet normalises them), ``v (T, d_v)``, and per token the decay ``a = exp(g)``
    and the write strength ``beta``."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    maps: nn.Module


def _delta_inputs(c: _Toy) -> _Delta:
    _seeded(c.seed)
    maps = nn.ModuleDict({"q": nn.Linear(D_MODEL, DELTA_KEY, bias=False),
                          "k": nn.Linear(D_MODEL, DELTA_KEY, bias=False),
                          "v": nn.Linear(D_MODEL, DELTA_VALUE, bias=False),
                          "a": nn.Linear(D_MODEL, 1), "b": nn.Linear(D_MODEL, 1)})
    x = c.x[0]
    g = torch.nn.functional.logsigmoid(maps["a"](x))[:, 0]  # log of a decay in (0, 1)
    return _Delta(l2_normalize(maps["q"](x)), l2_normalize(maps["k"](x)), maps["v"](x), g,
                  maps["b"](x).sigmoid()[:, 0], maps)


def _states(d: _Delta, decay: bool, delta: bool) -> tuple[Tensor, Tensor]:
    """The state after each token ``(T, d_k, d_v)`` and the outputs ``o_t = S_t^T q_t``
    ``(T, d_v)`` of linear attention, with the decay and the delta correction or not:
    the definition, one token at a time."""
    state = torch.zeros(DELTA_KEY, DELTA_VALUE)
    states, outputs = [], []
    for t in range(len(d.k)):
        a = d.g[t].exp() if decay else torch.tensor(1.0)
        state = a * state
        if delta:  # write only what the state does not already recall at k_t
            state = state + d.beta[t] * torch.outer(d.k[t], d.v[t] - state.T @ d.k[t])
        else:
            state = state + torch.outer(d.k[t], d.v[t])
        states.append(state)
        outputs.append(state.T @ d.q[t])
    return torch.stack(states), torch.stack(outputs)


def _step_delta_1(c: _Toy, d: _Delta) -> Step:
    states, out = _states(d, decay=False, delta=False)
    scores = (d.q @ d.k.T).masked_fill(~causal_mask(c.num_tokens), 0.0)
    return Step(
        "delta.1",
        "Linear attention: a running sum",
        "Drop the softmax and attention is associative: o_t = sum_{u<=t} (q_t . k_u) v_u = "
        "(sum_{u<=t} k_u v_u^T)^T q_t. The sum in brackets is the state S_t (d_k x d_v): "
        "each token adds its k v^T, a query reads it back with one product. The weights "
        "q_t . k_u are those of attention without its softmax (masked to u <= t).",
        {"k": d.k, "v": d.v, "S_T (the state after the last token)": states[-1],
         "weights q_t . k_u": scores, "out": out,
         "max |out - weights @ v|": _max_difference(out, scores @ d.v)},
        labels={"k": c.by_token, "v": c.by_token, "weights q_t . k_u": c.attn,
                "out": c.by_token},
        weights=scores,
        weights_title="linear attention (no softmax)",
        tokens=c.tokens,
        modules={"maps": d.maps},
    )


def _step_delta_2(c: _Toy, d: _Delta) -> Step:
    states, out = _states(d, decay=True, delta=False)
    # token u's write, decayed by every token after it up to t: prod_{u<j<=t} a_j
    cum = torch.cumsum(d.g, 0)
    keep = causal_mask(c.num_tokens)
    decays = torch.exp((cum[:, None] - cum[None, :]).masked_fill(~keep, float("-inf")))
    weights = (d.q @ d.k.T) * decays
    return Step(
        "delta.2",
        "Forgetting: a decay per token",
        "A sum only grows, so an old token weighs as much as a new one. A decay a_t = "
        "exp(g_t) in (0, 1) shrinks the state before each write: S_t = a_t S_{t-1} + k_t "
        "v_t^T. Token u then reaches query t through the product of the decays in between: "
        "weight (q_t . k_u) prod_{u<j<=t} a_j (Gated DeltaNet's g = -exp(A_log) "
        "softplus(a + dt_bias); here a seeded log-sigmoid).",
        {"a = exp(g)": d.g.exp(), "decay from u to t": decays, "weights": weights,
         "out": out, "max |out - weights @ v|": _max_difference(out, weights @ d.v)},
        labels={"a = exp(g)": c.by_token, "decay from u to t": c.attn, "weights": c.attn,
                "out": c.by_token},
        weights=weights,
        weights_title="decayed linear attention",
        tokens=c.tokens,
        modules={"maps": d.maps},
    )


def _step_delta_3(c: _Toy, d: _Delta) -> Step:
    states, out = _states(d, decay=True, delta=True)
    args = (d.q[None, None], d.k[None, None], d.v[None, None], d.g[None, None],
            d.beta[None, None])
    rule, _ = gated_delta_rule(*args, scale=1.0, backend="chunked", chunk_size=4)
    weights = gated_delta_weights(*args[:2], *args[3:], scale=1.0, chunk_size=4)[0, 0]
    return Step(
        "delta.3",
        "The delta rule: write only what is new",
        "Writing k_t v_t^T twice doubles it. The delta rule first reads what the decayed "
        "state recalls at k_t, a_t S_{t-1}^T k_t, and writes only the difference from v_t, "
        "scaled by beta_t in (0, 1): S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T "
        "k_t)^T. qkv's gated_delta_rule computes the same in chunks of matrix products; its "
        "effective weights W (out = W @ v) are not a softmax's: rows need not sum to 1 and "
        "may be negative.",
        {"beta": d.beta, "out (token by token)": out, "out (gated_delta_rule, chunked)":
             rule[0, 0], "max |token by token - chunked|": _max_difference(out, rule[0, 0]),
         "effective weights W": weights,
         "max |W @ v - out|": _max_difference(weights @ d.v, out)},
        labels={"beta": c.by_token, "out (token by token)": c.by_token,
                "out (gated_delta_rule, chunked)": c.by_token,
                "effective weights W": c.attn},
        weights=weights,
        weights_title="gated delta rule (effective weights)",
        tokens=c.tokens,
        modules={"maps": d.maps},
    )


def _step_delta_4(c: _Toy, d: _Delta) -> Step:
    state = torch.zeros(DELTA_KEY, DELTA_VALUE)
    cache = KVCache(1, 1, c.num_tokens, DELTA_KEY, value_dim=DELTA_VALUE)
    held = []
    for t in range(c.num_tokens):
        cache.append(d.k[None, None, t : t + 1], d.v[None, None, t : t + 1])
        held.append([_bytes(state), _kv_cache_bytes(cache)])
    return Step(
        "delta.4",
        "A state of fixed size against a cache that grows",
        f"Decoding, a linear-attention head keeps its state: d_k x d_v = {DELTA_KEY} x "
        f"{DELTA_VALUE} numbers whatever the context. Softmax attention's head keeps every "
        "key and value, d_k + d_v numbers more per token. So Qwen3-Next's and Qwen3.5's "
        "DeltaNet layers (3 of every 4) cost the same memory at 1k tokens as at 1M; only "
        "their full-attention layers' caches grow.",
        {"cache bytes after each token": torch.tensor(held)},
        labels={"cache bytes after each token": (c.tokens, ("state", "KV cache"))},
        modules={"maps": d.maps},
    )


# ---------------------------------------------------------------------------
# Induction heads, built by hand
# ---------------------------------------------------------------------------

# How sharply the hand-built heads pick their key: a matching key scores this much more
# than any other, e^8 ~ 3000 times the weight.
INDUCTION_SHARPNESS = 8.0
BOS = "<bos>"


@dataclass
class _Induction:
    """The two hand-built heads, the text twice and its one-hot residual stream."""

    tokens: tuple[str, ...]  # BOS, the toy's T words, the same words again: 2T + 1
    ids: Tensor  # (2T + 1,) each word's index among the distinct words
    x: Tensor  # (1, 2T + 1, width): [word one-hot | position | prev slot | out slot]
    previous: MultiHeadAttention  # layer 0
    induction: MultiHeadAttention  # layer 1
    vocab: int


def _induction_circuit(c: _Toy) -> _Induction:
    # BOS first, as the induction protocol has it: the first position has no word before
    # it, and BOS, never said again, is what layer 0 writes there.
    words = [BOS] + [t.lower() for t in c.tokens] * 2
    index = {w: i for i, w in enumerate(dict.fromkeys(words))}
    v, n = len(index), len(words)
    ids = torch.tensor([index[w] for w in words])
    width = 3 * v + n  # word, position, the previous word (layer 0 writes), output
    word, pos, prev, out = (slice(0, v), slice(v, v + n), slice(v + n, 2 * v + n),
                            slice(2 * v + n, width))
    x = torch.zeros(1, n, width)
    x[0, torch.arange(n), ids] = 1.0
    x[0, torch.arange(n), v + torch.arange(n)] = 1.0

    def head() -> MultiHeadAttention:
        layer = MultiHeadAttention(width, width, n, 0.0, num_heads=1, out_bias=False)
        for lin in (layer.W_query, layer.W_key, layer.W_value, layer.out_proj):
            lin.weight.zero_()
        return layer

    # Layer 0: position i's query is position i; position j's key is position j + 1, so
    # the query meets the key of j = i - 1. Its value is j's word, written to "prev".
    scale = INDUCTION_SHARPNESS * width ** 0.5  # undoes the 1/sqrt(d) of the scores
    previous = head()
    previous.W_query.weight[pos, pos] = torch.eye(n) * scale
    previous.W_key.weight[pos, pos] = torch.ones(n, n).tril(-1).triu(-1)  # row j+1 <- col j
    previous.W_value.weight[word, word] = torch.eye(v)
    previous.out_proj.weight[prev, word] = torch.eye(v)
    # Layer 1: the query is i's own word; a key is the word *before* j (the prev slot):
    # they meet where the word before j is the word at i, j the word that followed it.
    # Its value is j's word, written to "out": the prediction of the next word.
    induction = head()
    induction.W_query.weight[word, word] = torch.eye(v) * scale
    induction.W_key.weight[word, prev] = torch.eye(v)
    induction.W_value.weight[word, word] = torch.eye(v)
    induction.out_proj.weight[out, word] = torch.eye(v)
    return _Induction((BOS, *c.tokens, *c.tokens), ids, x, previous, induction, v)


def _step_induction_1(c: _Toy, d: _Induction) -> Step:
    _, weights = d.previous(d.x, need_weights=True)
    a = weights[0, 0]
    n = a.shape[-1]
    score = a[torch.arange(1, n), torch.arange(n - 1)].mean()
    return Step(
        "induction.1",
        "A previous-token head (layer 0)",
        "BOS, then the text twice, each word a one-hot row beside a one-hot position (no "
        "learned embedding: the circuit is easier to read). Layer 0's query at position i is i, "
        "the key at j is j + 1: they meet where j = i - 1, so each token attends to the "
        "one before it, and the head writes that word into a slot of the residual stream "
        "of its own: after it, each position carries 'the word before me was A'. Its "
        "previous-token score (the mean weight on i - 1, qkv heads' definition) is near 1.",
        {"attn_weights (layer 0)": a, "previous_token score": score},
        labels={"attn_weights (layer 0)": (d.tokens, d.tokens)},
        weights=a, weights_title="previous-token head", tokens=d.tokens,
        modules={"previous": d.previous, "induction": d.induction},
    )


def _step_induction_2(c: _Toy, d: _Induction) -> Step:
    x = d.x + d.previous(d.x)
    _, weights = d.induction(x, need_weights=True)
    a = weights[0, 0]
    t = c.num_tokens
    second = torch.arange(t + 1, 2 * t + 1)  # the second copy's positions
    score = a[second, second - t + 1].mean()
    return Step(
        "induction.2",
        "An induction head (layer 1) finds what came next last time",
        "Layer 1's query is the current word A; its keys read the slot layer 0 wrote, "
        "the word before each position. They meet at the positions that followed an "
        "earlier A: in the second copy, at i - T + 1, the word after A the first time "
        "(BOS, written where no word came before, is never a query's word). That is the "
        "induction head's stripe, T - 1 to the left of the diagonal; its induction score "
        "(mean weight on i - T + 1 over the second copy) is near 1. "
        "(A word said twice in one copy splits the weight between its followers.)",
        {"attn_weights (layer 1)": a, "induction score": score},
        labels={"attn_weights (layer 1)": (d.tokens, d.tokens)},
        weights=a, weights_title="induction head", tokens=d.tokens,
        modules={"previous": d.previous, "induction": d.induction},
    )


def _step_induction_3(c: _Toy, d: _Induction) -> Step:
    x = d.x + d.previous(d.x)
    x = x + d.induction(x)
    predicted = x[0, :, -d.vocab:]  # the out slot: the copied word, (2T, V)
    guess = predicted.argmax(dim=-1)
    t = c.num_tokens
    # the second copy's positions but its last, whose next word is not in the text
    right = (guess[t + 1:-1] == d.ids[t + 2:]).float()
    return Step(
        "induction.3",
        "What it predicts: the next word of the second copy",
        "The value the induction head copies is the word at the position it found, the "
        "one that followed A last time, so the out slot holds the next word of the "
        "second copy before it is read: [A][B] ... [A] -> [B]. A trained model does this "
        "with learned weights (qkv heads --induction-demo shows them forming); its loss on "
        "repeated text falls at the step the two heads appear (Olsson et al., 2022).",
        {"out slot (copied word, one column per distinct word)": predicted,
         "second copy: guess == next word": right},
        labels={"out slot (copied word, one column per distinct word)": (d.tokens, ())},
        modules={"previous": d.previous, "induction": d.induction},
    )


# ---------------------------------------------------------------------------
# All sections
# ---------------------------------------------------------------------------


def variant_steps(text: str | None = None, *, seed: int = 123) -> list[Step]:
    """Run every mechanism's section and return one :class:`Step` per stop, in the order
    of :data:`VARIANT_SECTIONS`.

    Args:
        text: whitespace-separated words (1 to 64); None: the book's "Your journey starts
            with one step". Each distinct word is a seeded random row of width
            :data:`D_MODEL`.
        seed: seeds the toy embedding and every layer (``torch.manual_seed``).
    """
    if not 0 <= seed < 2**62:
        raise ValueError(f"seed must be a non-negative integer below 2**62, got {seed}")
    tokens, inputs = toy_embedding(BOOK_TEXT if text is None else text, seed, D_MODEL)
    c = _Toy(tuple(tokens), inputs[None], seed)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        mla = _latent_layer(seed)
        dsa = _latent_layer(seed, SparseLatentAttention, **SPARSE)
        sinks = _sink_layer(c)
        source, later = _shared_pair(c)
        delta = _delta_inputs(c)
        circuit = _induction_circuit(c)
        steps = [
            _step_mla_1(c, mla),
            _step_mla_2(c, mla),
            _step_mla_3(c, mla),
            _step_absorbed_1(c, mla),
            _step_absorbed_2(c, mla),
            _step_dsa_1(c, dsa),
            _step_dsa_2(c, dsa),
            _step_dsa_3(c, dsa),
            _step_sinks_1(c, sinks),
            _step_sinks_2(c, sinks),
            _step_kvshare_1(c, source, later),
            _step_kvshare_2(c, source, later),
            _step_delta_1(c, delta),
            _step_delta_2(c, delta),
            _step_delta_3(c, delta),
            _step_delta_4(c, delta),
            _step_induction_1(c, circuit),
            _step_induction_2(c, circuit),
            _step_induction_3(c, circuit),
        ]
    for step in steps:
        step.tensors = {name: t.detach().cpu() for name, t in step.tensors.items()}
    return steps
