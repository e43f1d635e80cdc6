r"""Multi-head latent attention (MLA: DeepSeek-V2, V3, R1, Kimi K2) and DeepSeek sparse
attention (DSA: DeepSeek-V3.2): attention whose cache holds one small latent per token
instead of every head's keys and values.

Multi-head latent attention
---------------------------
For the token at position ``t`` with input ``x`` (``d_model`` wide) and head ``i`` of
``h``; ``r = kv_lora_rank``, ``d_n = qk_nope_head_dim``, ``d_r = qk_rope_head_dim``,
``d_v = v_head_dim``::

    queries   c_q = RMSNorm(x W_qa)                          (q_lora_rank wide)
              [q_n,i ; q_r,i] = c_q W_qb                      (d_n + d_r per head)
              (without q_lora_rank: [q_n,i ; q_r,i] = x W_q)
              q_r,i <- RoPE(q_r,i, t)
    latent    [c ; k_r] = x W_kva                            (r + d_r)
              c <- RMSNorm(c)                                 the compressed keys and values
              k_r <- RoPE(k_r, t)                             one RoPE key for all heads
    per head  k_n,i = c W_UK,i   v_i = c W_UV,i               (W_kvb = [W_UK,i ; W_UV,i]_i)
    scores    s_i(t, u) = scale * (q_n,i(t) . k_n,i(u) + q_r,i(t) . k_r(u)),  u <= t
    output    o_i(t) = sum_u softmax_u(s_i(t, u)) v_i(u)
              out = [o_1 ... o_h] W_o

with ``scale = (d_n + d_r)^-1/2``, multiplied under YaRN by ``yarn_mscale(factor,
mscale_all_dim)^2`` (:func:`qkv.positional.yarn_mscale`). The module names are
transformers' (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so a
``DeepseekV3Attention``'s state dict loads as it is.

The position information rides only on ``q_r`` and ``k_r``: RoPE's rotation of a key
depends on its position, so it could not be folded into ``W_UK`` below; the decoupled
``k_r`` carries it instead, for all heads at once.

What a cache keeps. Everything a later query needs from token ``u`` is ``c(u)`` and
``k_r(u)``: ``r + d_r`` numbers per token and layer. At DeepSeek-V3's shape (``h = 128``,
``r = 512``, ``d_n = d_v = 128``, ``d_r = 64``) that is **576**, where the same heads'
keys and values would be ``128 x (192 + 128) =`` **40,960** (71 times more).

Two ways to attend (``backend``):

- ``"decompress"``, the definition: expand the latent into each head's keys ``[k_n,i ;
  k_r]`` and values ``v_i`` (``T x h x (d_n + d_r + d_v)`` numbers), then attend as
  multi-head attention does.
- ``"absorbed"``: never build them. Since ``q_n,i . (c W_UK,i) = (q_n,i W_UK,i^T) . c``,
  the key up-projection is folded into the query, which then lives in latent space;
  since ``sum_u a_u (c(u) W_UV,i) = (sum_u a_u c(u)) W_UV,i``, the value up-projection
  moves after the weighted sum::

      q_c,i   = q_n,i W_UK,i^T                                      (r wide)
      s_i(t, u) = scale * ([q_c,i ; q_r,i](t) . [c ; k_r](u))
      o_i(t)  = (sum_u softmax_u(s_i(t, u)) c(u)) W_UV,i

  That is multi-query attention with one key head ``[c ; k_r]`` (``r + d_r`` wide) and
  one value head ``c`` (``r`` wide), straight on the cache: a decoding step costs
  ``T x h x (2r + d_r)`` multiply-adds and builds nothing of size ``T x h``.

``"auto"`` (the default) runs the absorbed form for one new token (decoding) and
decompresses otherwise: over many queries, expanding the keys once costs less than
attending in the wider latent space.

DeepSeek sparse attention
-------------------------
:class:`SparseLatentAttention` is MLA in which each query attends to ``index_topk`` keys
only, chosen by a lightning indexer of ``H`` small index heads (``d_I =
index_head_dim``)::

    q^I_j = RoPE(c_q W^I_q)_j            (H heads, d_I wide; RoPE on the first d_r)
    k^I   = RoPE(LayerNorm(x W^I_k))     one index key per token, d_I wide
    w_j   = (x W^I_w)_j / sqrt(H)
    I(t, u) = sum_j w_j(t) ReLU(q^I_j(t) . k^I(u) / sqrt(d_I)),      u <= t
    S(t)  = the index_topk keys u <= t of largest I(t, u)

and MLA's softmax then runs over ``u in S(t)`` only. The indexer's RoPE is "rotate
half" whatever ``rope_interleave`` says, as DeepSeek-V3.2 was trained. A cache keeps
``k^I`` beside the latent: ``576 + 128 = 704`` numbers per token at V3.2's shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .checks import check_bool, check_dropout, check_float, check_positive_int
from .functional import attention, attention_logits, causal_mask
from .kv_cache import LatentCache
from .options import ATTENTION_POINTS
from .positional import (
    RopeTable,
    apply_rope,
    apply_rope_interleaved,
    check_rope_scaling,
    yarn_mscale,
)

__all__ = ["LatentAttention", "SparseLatentAttention", "LightningIndexer",
           "LATENT_BACKENDS", "latent_softmax_scale"]

LATENT_BACKENDS = ("auto", "decompress", "absorbed")


def latent_softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """The factor on MLA's scores: ``qk_head_dim^-1/2``, times ``yarn_mscale(factor,
    mscale_all_dim)^2`` under YaRN with ``mscale_all_dim`` set (DeepSeek-V3: about 1.874
    at factor 40). ``rope_scaling`` is :func:`~qkv.positional.check_rope_scaling`'s form."""
    scale = qk_head_dim ** -0.5
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn" and \
            rope_scaling["mscale_all_dim"]:
        scale *= yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
    return scale


class LatentAttention(nn.Module):
    r"""Multi-head latent attention, causal (the module docstring has the equations).

    Args:
        d_model: width of the input and of the output.
        num_heads: query heads ``h``.
        kv_lora_rank: width ``r`` of the latent ``c`` that keys and values are compressed to.
        qk_nope_head_dim: each head's key and query width without position, ``d_n``.
        qk_rope_head_dim: the rotated part's width ``d_r`` (even), the RoPE key's too.
        v_head_dim: each head's value width ``d_v``.
        q_lora_rank: width of the queries' bottleneck ``c_q``; None: one ``q_proj``.
        context_length: longest sequence accepted (and a cache's default length); None:
            any.
        dropout: dropout on the attention weights (training only).
        bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``, where the
            family puts them (``attention_bias``); the other projections have none.
        rope_base, rope_scaling: RoPE's base and its stretching
            (:func:`qkv.positional.check_rope_scaling`; YaRN also scales the softmax).
        rope_interleave: rotate interleaved pairs ``(2i, 2i + 1)`` (DeepSeek's weights)
            rather than ``(i, i + d_r / 2)``.
        norm_eps: epsilon of the RMSNorms on the latents.
        backend: ``"auto"``, ``"decompress"`` or ``"absorbed"`` (the module docstring).

    Shapes:
        ``x (batch, T, d_model) -> (batch, T, d_model)``; with ``need_weights=True`` also
        the weights ``(batch, num_heads, T, T_k)``, ``T_k`` the keys attended to (the
        cached tokens and the new ones).

    Taps (qkv.heads; ``tap`` as :class:`qkv.MultiHeadAttention`'s): ``q`` is each
    head's whole query ``[q_n,i ; q_r,i]`` after RoPE ``(batch, h, T, d_n + d_r)``;
    ``k`` and ``v`` are the new tokens' per-head keys ``[k_n,i ; k_r]`` and values
    ``v_i`` decompressed from their latent ``(batch, h, T, d_n + d_r or d_v)``, whichever
    backend runs (the absorbed form never builds them; they are computed for the tap),
    and only read: the cache keeps the latent, so edit ``q`` or ``head_out``. ``scores``
    and ``weights`` ``(batch, h, T, T_k)`` are those of the form that ran, over every key
    (``-inf`` and 0 where a sparse layer's indexer did not select a key); ``head_out``
    is ``o_i (batch, T, h, d_v)`` before ``o_proj``.
    """

    tap_points = ATTENTION_POINTS
    tap_read_only = frozenset({"k", "v", "scores", "weights"})

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        context_length: int | None = None,
        dropout: float = 0.0,
        bias: bool = False,
        rope_base: float = 10_000.0,
        rope_scaling: dict[str, Any] | None = None,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, size in (("d_model", d_model), ("num_heads", num_heads),
                           ("kv_lora_rank", kv_lora_rank),
                           ("qk_nope_head_dim", qk_nope_head_dim),
                           ("qk_rope_head_dim", qk_rope_head_dim),
                           ("v_head_dim", v_head_dim)):
            check_positive_int(name, size)
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE turns pairs), got "
                             f"{qk_rope_head_dim}")
        if q_lora_rank is not None:
            check_positive_int("q_lora_rank", q_lora_rank, "integer or None")
        if context_length is not None:
            check_positive_int("context_length", context_length, "integer or None")
        check_dropout(dropout)
        check_bool("bias", bias)
        check_float("rope_base", rope_base, 1.0, lo_open=True)
        rope_scaling = check_rope_scaling(rope_scaling)
        check_bool("rope_interleave", rope_interleave)
        norm_eps = check_float("norm_eps", norm_eps, 0.0, lo_open=True)
        if backend not in LATENT_BACKENDS:
            raise ValueError(f"backend must be one of {LATENT_BACKENDS}, got {backend!r}")
        self.d_model, self.num_heads = d_model, num_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.context_length = context_length
        self.rope_base, self.rope_scaling = float(rope_base), rope_scaling
        self.rope_interleave = rope_interleave
        self.backend = backend
        self.scale = latent_softmax_scale(self.qk_head_dim, rope_scaling)

        q_width = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim,
                                            bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        # No bias: the absorbed form moves this map across the softmax, which only a
        # linear map (not an affine one) survives.
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        # DeepSeek sparse attention's indexer (SparseLatentAttention); None: dense MLA.
        self.indexer: LightningIndexer | None = None
        self.selected: Tensor | None = None
        self.tap: Any = None  # qkv.heads' tap, as qkv.MultiHeadAttention's
        self._rope_table = RopeTable(context_length)

    # -- the steps ------------------------------------------------------------------

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on ``x (..., T, d_r)`` in this model's pairing of dimensions."""
        rotate = apply_rope_interleaved if self.rope_interleave else apply_rope
        return rotate(x, cos, sin)

    def _queries(self, x: Tensor, cos: Tensor, sin: Tensor
                 ) -> tuple[Tensor | None, Tensor, Tensor]:
        """``x (b, T, d_model)`` -> ``(c_q (b, T, q_lora_rank) or None, q_n (b, h, T,
        d_n), q_r (b, h, T, d_r))``, ``q_r`` rotated."""
        b, t, _ = x.shape
        if self.q_lora_rank is None:
            c_q, q = None, self.q_proj(x)
        else:
            c_q = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(c_q)
        q = q.view(b, t, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_n, q_r = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return c_q, q_n, self._rotate(q_r, cos, sin)

    def _latent(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x (b, T, d_model) -> [c ; k_r] (b, T, r + d_r)``: each token's normalised
        latent and rotated RoPE key, side by side: what a cache keeps."""
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                  dim=-1)
        return torch.cat((self.kv_a_layernorm(c), self._rotate(k_r, cos, sin)), dim=-1)

    def _decompressed(self, q_n: Tensor, q_r: Tensor, kv: Tensor, keep: Tensor | None,
                      need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Attention by the definition: every head's keys and values rebuilt from the
        latent. ``q_n (b, h, T, d_n)``, ``q_r (b, h, T, d_r)``, ``kv (b, T_k, r + d_r)``
        -> ``(o (b, h, T, d_v), weights (b, h, T, T_k) or None)``."""
        k, v = self._heads_kv(kv)
        q = torch.cat((q_n, q_r), dim=-1)
        return attention(q, k, v, mask=keep, causal=True, scale=self.scale,
                         dropout_p=self._dropout_p(), need_weights=need_weights)

    def _heads_kv(self, kv: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's keys and values rebuilt from the latent: ``kv (b, T_k, r + d_r)``
        -> ``(k (b, h, T_k, d_n + d_r), v (b, h, T_k, d_v))``, ``k = [k_n,i ; k_r]``."""
        b, t_k, _ = kv.shape
        h, d_n, d_r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        c, k_r = kv.split([self.kv_lora_rank, d_r], dim=-1)
        k_n, v = (self.kv_b_proj(c).view(b, t_k, h, d_n + self.v_head_dim).transpose(1, 2)
                  .split([d_n, self.v_head_dim], dim=-1))  # (b, h, T_k, d_n), (b, h, T_k, d_v)
        k = torch.cat((k_n, k_r[:, None].expand(b, h, t_k, d_r)), dim=-1)  # k_r: every head's
        return k, v

    def _absorbed(self, q_n: Tensor, q_r: Tensor, kv: Tensor, keep: Tensor | None,
                  need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The same attention in latent space: ``W_UK`` folded into the queries, ``W_UV``
        applied after the weighted sum; no per-head key or value is built. Shapes as
        :meth:`_decompressed`'s."""
        r = self.kv_lora_rank
        q, w_uv = self._latent_queries(q_n, q_r)  # (b, h, T, r + d_r)
        # One key head [c ; k_r] and one value head c for all h query heads: multi-query
        # attention on the cache itself.
        key, value = kv[:, None], kv[:, None, :, :r]
        if q.shape[2] == 1:
            # One new token (a decoding step): its h heads are h queries of the one key
            # head, two matrix products over the cache, where the multi-query kernel reads
            # the shared key head once per query head (1.8x faster at 4,096 cached tokens).
            # Exact: a lone newest query sees every key, so there is no causal mask to
            # keep, and a sparse `keep (b, 1, 1, T_k)` applies to every head alike.
            o_c, weights = attention(q.transpose(1, 2), key, value, mask=keep,
                                     scale=self.scale, dropout_p=self._dropout_p(),
                                     need_weights=need_weights)  # (b, 1, h, r)
            o_c = o_c.transpose(1, 2)
            weights = None if weights is None else weights.transpose(1, 2)
        else:
            o_c, weights = attention(q, key, value, mask=keep, causal=True, scale=self.scale,
                                     dropout_p=self._dropout_p(),
                                     need_weights=need_weights)  # o_c (b, h, T, r)
        return o_c @ w_uv.transpose(1, 2), weights  # (b, h, T, d_v)

    def _latent_queries(self, q_n: Tensor, q_r: Tensor) -> tuple[Tensor, Tensor]:
        """The absorbed form's queries ``[q_n,i W_UK,i ; q_r,i] (b, h, T, r + d_r)`` and
        the value up-projections ``W_UV (h, d_v, r)`` it applies after the sum."""
        h, d_n, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, d_n + self.v_head_dim, r)
        w_uk, w_uv = w[:, :d_n], w[:, d_n:]  # (h, d_n, r), (h, d_v, r)
        q_c = q_n @ w_uk  # (b, h, T, r): each head's query in latent coordinates
        return torch.cat((q_c, q_r), dim=-1), w_uv

    def _dropout_p(self) -> float:
        return self.dropout.p if self.training else 0.0

    # -- forward --------------------------------------------------------------------

    def forward(self, x: Tensor, *, cache: LatentCache | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend causally from each token of ``x (batch, T, d_model)`` to itself and the
        tokens before it, with ``cache`` (:meth:`new_cache`) also to every token stored,
        new ones appended; positions continue from ``cache.pos``.

        Returns ``(batch, T, d_model)``, or ``(output, weights (batch, num_heads, T,
        T_k))`` with ``need_weights``.
        """
        self._check_call(x, cache)
        b, t, _ = x.shape
        past = 0 if cache is None else cache.pos
        cos, sin = self._rope_table(past + t, self.qk_rope_head_dim, self.rope_base,
                                    self.rope_scaling, x.dtype, x.device)
        cos, sin = cos[past:], sin[past:]  # (T, d_r): the new tokens' positions

        c_q, q_n, q_r = self._queries(x, cos, sin)
        kv = self._latent(x, cos, sin)  # (b, T, r + d_r)
        if self.tap is not None:
            q_n, q_r = self._tap_inputs(q_n, q_r, kv)
        index_keys = None if self.indexer is None else self.indexer.keys(x, cos, sin)
        if cache is not None:
            kv, index_keys = cache.append(kv, index_keys)  # every token stored, in order
        keep = None
        if self.indexer is not None:  # sparse: each query keeps its index_topk best keys
            selected = self.indexer.select(x, c_q, cos, sin, index_keys)  # (b, T, k)
            keep = torch.zeros(b, t, kv.shape[1], dtype=torch.bool, device=x.device)
            keep = keep.scatter_(-1, selected, True)[:, None]  # (b, 1, T, T_k)
            self.selected = selected if need_weights else None

        backend = self.backend
        if backend == "auto":
            backend = "absorbed" if t == 1 else "decompress"
        attend = self._absorbed if backend == "absorbed" else self._decompressed
        o, weights = attend(q_n, q_r, kv, keep, need_weights)  # o (b, h, T, d_v)
        heads = o.transpose(1, 2)  # (b, T, h, d_v)
        if self.tap is not None:
            weights = self._tap_scores(attend, backend, q_n, q_r, kv, keep, weights,
                                       need_weights)
            if "head_out" in self.tap.names:
                heads = self.tap("head_out", heads)
        out = self.o_proj(heads.reshape(b, t, self.num_heads * self.v_head_dim))
        return (out, weights) if need_weights else out

    # -- taps (qkv.heads) ---------------------------------------------------------

    def _tap_inputs(self, q_n: Tensor, q_r: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
        """``self.tap``'s ``q`` (``[q_n ; q_r]``, replaced by what it returns), and ``k``
        and ``v``: the new tokens' keys and values decompressed from their latent ``kv``,
        only read (the cache keeps the latent, not them)."""
        names = self.tap.names
        if "q" in names:
            q = torch.cat((q_n, q_r), dim=-1)
            edited = self.tap("q", q)
            if edited is not q:  # unedited, the kernel reads the very tensors it always does
                q_n, q_r = edited.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if "k" in names or "v" in names:
            k, v = self._heads_kv(kv)
            if "k" in names:
                self.tap("k", k)
            if "v" in names:
                self.tap("v", v)
        return q_n, q_r

    def _tap_scores(self, attend: Any, backend: str, q_n: Tensor, q_r: Tensor, kv: Tensor,
                    keep: Tensor | None, weights: Tensor | None, need_weights: bool
                    ) -> Tensor | None:
        """``self.tap``'s ``weights`` (the form that ran, called again with
        ``need_weights`` when the call did not ask for them) and ``scores`` (``(b, h, T,
        T_k)``, ``-inf`` where a key is hidden: after the query, or not selected by a
        sparse layer's indexer), computed beside the kernel; returns the call's weights."""
        names = self.tap.names
        if "weights" in names:
            tapped = weights if weights is not None else attend(q_n, q_r, kv, keep, True)[1]
            self.tap("weights", tapped)
        if "scores" in names:
            if backend == "absorbed":
                q, _ = self._latent_queries(q_n, q_r)
                k = kv[:, None]  # the one shared key head [c ; k_r]
            else:
                q, k = torch.cat((q_n, q_r), dim=-1), self._heads_kv(kv)[0]
            self.tap("scores", attention_logits(q, k, mask=keep, causal=True,
                                                scale=self.scale))
        return weights

    def _check_call(self, x: Tensor, cache: LatentCache | None) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (batch, tokens, {self.d_model}), got {shape}")
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache (layer.new_cache(...)), got "
                            f"{type(cache).__name__}")
        span = x.shape[1] + (0 if cache is None else cache.pos)
        if self.context_length is not None and span > self.context_length:
            raise ValueError(f"sequence of {span} tokens is longer than "
                             f"context_length={self.context_length}")

    def new_cache(self, batch_size: int, max_len: int | None = None) -> LatentCache:
        """A :class:`~qkv.kv_cache.LatentCache` for this layer of ``max_len`` positions
        (default: ``context_length``), in the weights' dtype and device."""
        max_len = self.context_length if max_len is None else max_len
        if max_len is None:
            raise ValueError("this layer has no context_length; pass max_len to new_cache()")
        weight = self.kv_b_proj.weight
        return LatentCache(batch_size, max_len, self.kv_lora_rank, self.qk_rope_head_dim,
                           index_dim=None if self.indexer is None else self.indexer.head_dim,
                           dtype=weight.dtype, device=weight.device)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, "
                f"kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
                f"context_length={self.context_length}, backend={self.backend!r}, "
                f"rope_base={self.rope_base:g}, rope_interleave={self.rope_interleave}"
                + (f", rope_scaling={self.rope_scaling}" if self.rope_scaling else ""))


def _check_indexer(num_heads: Any, head_dim: Any, rope_dim: int, top_k: Any) -> None:
    for name, size in (("index_n_heads", num_heads), ("index_head_dim", head_dim),
                       ("index_topk", top_k)):
        check_positive_int(name, size)
    if isinstance(rope_dim, int) and head_dim < rope_dim:
        raise ValueError(f"index_head_dim ({head_dim}) must be at least qk_rope_head_dim "
                         f"({rope_dim}): RoPE turns its first {rope_dim} dimensions")


class LightningIndexer(nn.Module):
    """DeepSeek sparse attention's indexer: which keys each query attends to.

    Args:
        d_model: width of the layer's input ``x``.
        q_lora_rank: width of the query latent ``c_q`` it reads its queries from.
        num_heads: index heads ``H`` (``index_n_heads``).
        head_dim: their width ``d_I`` (``index_head_dim``), at least ``rope_dim``.
        rope_dim: how many of the first dimensions RoPE turns ("rotate half" pairs).
        top_k: keys kept per query (``index_topk``).

    Module names are transformers' (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``).
    Nothing flows back through the selection (a top-k has no gradient), so the indexer
    runs without autograd, as DeepSeek-V3.2's attention does; it is trained apart.
    """

    def __init__(self, d_model: int, q_lora_rank: int, num_heads: int, head_dim: int,
                 rope_dim: int, top_k: int) -> None:
        super().__init__()
        _check_indexer(num_heads, head_dim, rope_dim, top_k)
        for name, size in (("d_model", d_model), ("q_lora_rank", q_lora_rank)):
            check_positive_int(name, size)
        self.num_heads, self.head_dim, self.rope_dim, self.top_k = (num_heads, head_dim,
                                                                    rope_dim, top_k)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(d_model, num_heads, bias=False)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE ("rotate half") on the first ``rope_dim`` of ``x (..., T, d_I)``."""
        turned, kept = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(turned, cos, sin), kept), dim=-1)

    @torch.no_grad()
    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x (b, T, d_model) -> k^I (b, T, d_I)``: each token's index key, rotated."""
        return self._rotate(self.k_norm(self.wk(x)), cos, sin)

    @torch.no_grad()
    def scores(self, x: Tensor, c_q: Tensor, cos: Tensor, sin: Tensor, keys: Tensor
               ) -> Tensor:
        """The index scores ``I (b, T, T_k)`` of the ``T`` new tokens against ``keys (b,
        T_k, d_I)`` (the last ``T`` of them the new tokens'), ``-inf`` after each query:
        ``sum_j w_j ReLU(q^I_j . k^I / sqrt(d_I))``, in at least float32."""
        b, t, _ = x.shape
        dtype = torch.promote_types(x.dtype, torch.float32)
        q = self.wq_b(c_q).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        q = self._rotate(q, cos, sin).to(dtype)  # (b, H, T, d_I)
        # The 1 / sqrt(d_I) changes no ranking (a positive factor); it keeps the scores
        # DeepSeek's. All H heads' scores at once, (b, H, T, T_k), as DeepSeek computes them.
        per_head = torch.relu(q @ keys.to(dtype)[:, None].transpose(-2, -1)
                              * self.head_dim ** -0.5)
        w = self.weights_proj(x).to(dtype) * self.num_heads ** -0.5  # (b, T, H)
        index = torch.einsum("bth,bhtu->btu", w, per_head)
        future = ~causal_mask(t, keys.shape[1], device=x.device)
        return index.masked_fill(future, float("-inf"))

    def select(self, x: Tensor, c_q: Tensor, cos: Tensor, sin: Tensor, keys: Tensor
               ) -> Tensor:
        """The ``min(top_k, T_k)`` keys of largest index score for each new token, ``(b,
        T, k)`` int64 positions into ``keys``. A query with fewer than ``top_k`` keys
        before it also gets some after it: the causal mask drops them."""
        index = self.scores(x, c_q, cos, sin, keys)
        return index.topk(min(self.top_k, index.shape[-1]), dim=-1).indices

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"rope_dim={self.rope_dim}, top_k={self.top_k}")


class SparseLatentAttention(LatentAttention):
    """DeepSeek sparse attention (DeepSeek-V3.2): :class:`LatentAttention` in which each
    query attends only to the ``index_topk`` keys its :class:`LightningIndexer` ranks
    highest (the module docstring has the equations). With ``index_topk`` at or above
    the number of keys it is MLA exactly.

    Args: those of :class:`LatentAttention` (``q_lora_rank`` required: the indexer reads
    its queries from ``c_q``), and ``index_n_heads``, ``index_head_dim``, ``index_topk``.

    A cache (:meth:`new_cache`) also keeps each token's index key. With
    ``need_weights=True`` the layer keeps that call's selection in ``selected`` ``(batch,
    T, min(index_topk, T_k))``: positions into the keys attended to (those after a
    query, picked while it has fewer than ``index_topk`` before it, are masked out).
    """

    # What its attention weights are, for a page that draws them (qkv view).
    weights_note = ("sparse attention: each query weighs only the index_topk keys its "
                    "lightning indexer selected; every other key has weight 0")

    def __init__(self, d_model: int, num_heads: int, *, index_n_heads: int,
                 index_head_dim: int, index_topk: int, **kwargs: Any) -> None:
        if kwargs.get("q_lora_rank") is None:
            raise ValueError("SparseLatentAttention needs q_lora_rank: its indexer reads its "
                             "queries from the query latent")
        # Checked before the layer's own parameters are made, as the rest are.
        _check_indexer(index_n_heads, index_head_dim, kwargs.get("qk_rope_head_dim", 0),
                       index_topk)
        super().__init__(d_model, num_heads, **kwargs)
        self.indexer = LightningIndexer(d_model, self.q_lora_rank, index_n_heads,
                                        index_head_dim, self.qk_rope_head_dim, index_topk)
