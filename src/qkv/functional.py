"""Functional attention: the building blocks every qkv module is made of.

The file reads top to bottom the way the books teach attention:

1. parameter-free self-attention on raw embeddings (scores, three ways to
   normalise them, context vectors), in loop form and in matrix form;
2. masks: causal masks and padding masks built from ``valid_lens``;
3. :func:`attention`, the one scaled dot-product kernel that all trainable
   modules call. It has an *eager* path that materialises and returns the
   attention weights, and a *fused* path through
   :func:`torch.nn.functional.scaled_dot_product_attention`.

Mask convention
---------------
Inside this module a boolean mask means **True = may attend** (keep), the same
meaning as ``attn_mask`` in :func:`torch.nn.functional.scaled_dot_product_attention`.
The modules' ``key_padding_mask`` argument follows the name it shares with
:class:`torch.nn.MultiheadAttention`: **True = padding, ignored**.

Fully masked rows
-----------------
A query that may attend to no key at all (for example a sequence with
``valid_len == 0``) gets an all-zero weight row and a zero output, never NaN,
in the forward pass and in the gradients. d2l's reference
:func:`masked_softmax` instead fills masked scores with ``-1e6`` and so gives
such a row *uniform* weights; it is kept here as written for reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_positive_int
from .options import BACKENDS

__all__ = [
    "attention_scores",
    "attention_scores_loop",
    "all_attention_scores",
    "all_attention_scores_loop",
    "normalize_by_sum",
    "softmax_naive",
    "softmax_stable",
    "context_vector",
    "context_vector_loop",
    "simple_self_attention",
    "causal_mask",
    "lengths_to_mask",
    "masked_softmax",
    "softmax_with_mask",
    "attention",
    "attention_logits",
    "BACKENDS",
]


# ---------------------------------------------------------------------------
# 1. Parameter-free self-attention (LLMs-from-scratch §3.3)
# ---------------------------------------------------------------------------


def attention_scores_loop(query: Tensor, inputs: Tensor) -> Tensor:
    """Scores of one query against every input row, one dot product at a time.

    ``query (d,)``, ``inputs (T, d) -> (T,)``.
    """
    scores = torch.empty(inputs.shape[0], dtype=inputs.dtype, device=inputs.device)
    for i, x_i in enumerate(inputs):
        scores[i] = torch.dot(x_i, query)
    return scores


def attention_scores(query: Tensor, inputs: Tensor) -> Tensor:
    """Scores of one query against every input row as one matrix-vector product.

    ``query (d,)``, ``inputs (T, d) -> (T,)``.
    """
    return inputs @ query


def all_attention_scores_loop(inputs: Tensor) -> Tensor:
    """Every query against every key with an explicit double loop.

    ``inputs (T, d) -> (T, T)``; entry ``[i, j]`` is ``inputs[i] · inputs[j]``.
    """
    n = inputs.shape[0]
    scores = torch.empty(n, n, dtype=inputs.dtype, device=inputs.device)
    for i, x_i in enumerate(inputs):
        for j, x_j in enumerate(inputs):
            scores[i, j] = torch.dot(x_i, x_j)
    return scores


def all_attention_scores(inputs: Tensor) -> Tensor:
    """Every query against every key as one matrix product.

    ``inputs (..., T, d) -> (..., T, T)``.
    """
    return inputs @ inputs.transpose(-2, -1)


def normalize_by_sum(scores: Tensor, dim: int = -1) -> Tensor:
    """Divide scores by their sum so they add up to one.

    Only meaningful for positive scores; softmax is what attention really uses.
    """
    return scores / scores.sum(dim=dim, keepdim=True)


def softmax_naive(x: Tensor, dim: int = -1) -> Tensor:
    """The book's hand-written softmax, ``exp(x) / exp(x).sum(dim)``, exactly as written.

    Kept for fidelity, overflow included: ``exp`` of a float32 above about 88.7 is
    ``inf``, so ``softmax_naive(torch.tensor([1000., 0.]))`` is ``[nan, 0.]``
    (``inf / inf``). Use :func:`softmax_stable` (or ``torch.softmax``) on real scores.
    The book sums over ``dim=0`` of one ``(T,)`` score vector, where that is also ``-1``,
    the default here as for :func:`softmax_stable`.
    """
    return torch.exp(x) / torch.exp(x).sum(dim=dim, keepdim=True)


def softmax_stable(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax by hand, made safe: subtract the maximum, then ``exp(x) / exp(x).sum()``.

    The shift cancels in the ratio, so wherever :func:`softmax_naive` does not overflow
    both give the same weights; the largest exponent is now ``exp(0) = 1``, so large
    scores give the right weights instead of ``nan``.
    """
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = torch.exp(shifted)
    return exp / exp.sum(dim=dim, keepdim=True)


def context_vector_loop(weights: Tensor, inputs: Tensor) -> Tensor:
    """Weighted sum of input rows, accumulated one row at a time.

    ``weights (T,)``, ``inputs (T, d) -> (d,)``.
    """
    context = torch.zeros(inputs.shape[1], dtype=inputs.dtype, device=inputs.device)
    for w_i, x_i in zip(weights, inputs, strict=True):
        context = context + w_i * x_i
    return context


def context_vector(weights: Tensor, inputs: Tensor) -> Tensor:
    """Weighted sum of input rows as a matrix product.

    ``weights (T,) -> (d,)`` for one query or ``weights (T_q, T) -> (T_q, d)``
    for all queries, with ``inputs (T, d)``.
    """
    return weights @ inputs


def simple_self_attention(inputs: Tensor) -> tuple[Tensor, Tensor]:
    """Self-attention with no trainable weights, all queries at once.

    ``inputs (..., T, d) -> (context (..., T, d), weights (..., T, T))``.
    """
    weights = torch.softmax(all_attention_scores(inputs), dim=-1)
    return weights @ inputs, weights


# ---------------------------------------------------------------------------
# 2. Masks (True = may attend)
# ---------------------------------------------------------------------------


def causal_mask(num_queries: int, num_keys: int | None = None, device=None, *,
                window: int | None = None) -> Tensor:
    """Boolean ``(num_queries, num_keys)`` mask, True where a query may look.

    Queries are aligned to the *end* of the keys: with a KV cache the
    ``num_queries`` new tokens are the last ones, so query ``i`` sits at
    position ``i + num_keys - num_queries`` and sees keys up to that position.
    For ``num_queries == num_keys`` this is the usual lower triangle. With a
    ``window``, each query sees only its last ``window`` keys, itself included (a
    band below the diagonal).
    """
    num_keys = num_queries if num_keys is None else num_keys
    if num_queries > num_keys:
        raise ValueError(
            f"causal attention needs num_queries <= num_keys, got {num_queries} > {num_keys}"
        )
    offset = num_keys - num_queries
    keep = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(offset)
    if window is not None:
        check_positive_int("window", window)
        keep = keep.triu(offset - window + 1)
    return keep


def check_valid_lens(
    valid_lens: Any, batch: int, num_queries: int, num_keys: int | None = None
) -> None:
    """Raise a one-line error unless ``valid_lens`` is d2l's ``(batch,)`` or
    ``(batch, num_queries)`` tensor of lengths.

    A 0-dim tensor is refused rather than broadcast: d2l's own ``masked_softmax`` only
    copes with one when the batch holds a single query, and every other API here takes
    the one length per sequence explicitly.

    With ``num_keys``, the lengths themselves are checked too: whole numbers (d2l passes
    integer tensors and float tensors of whole numbers alike) in ``[0, num_keys]``. A
    mask built from 3.5 would silently keep 4 keys, from -1 none, from more than
    ``num_keys`` all; each is a caller's bug, so each is a ``ValueError`` instead. The
    values are read on the CPU only (a comparison of a few lengths): on an accelerator,
    reading them would stall every step until the device caught up.
    """
    if not isinstance(valid_lens, Tensor):
        raise TypeError(
            f"valid_lens must be a tensor of lengths of shape ({batch},) or "
            f"({batch}, {num_queries}), got {type(valid_lens).__name__}"
        )
    if valid_lens.dtype == torch.bool or valid_lens.is_complex():
        raise TypeError(f"valid_lens must hold lengths (integers), got dtype {valid_lens.dtype}")
    if tuple(valid_lens.shape) not in ((batch,), (batch, num_queries)):
        hint = f"; for one length shared by all, pass valid_lens.expand({batch})" * (
            valid_lens.dim() == 0
        )
        raise ValueError(
            f"valid_lens must have shape ({batch},) (one length per sequence) or "
            f"({batch}, {num_queries}) (one per query), got {tuple(valid_lens.shape)}{hint}"
        )
    if num_keys is not None:
        _check_length_values(valid_lens, num_keys)


def _check_length_values(valid_lens: Tensor, num_keys: int) -> None:
    """One-line ``ValueError`` unless every length is a whole number in ``[0, num_keys]``."""
    if valid_lens.device.type != "cpu" or torch.compiler.is_compiling():
        # Reading the values of a tensor on an accelerator waits for it (a sync in every
        # training step), and a traced graph does not know them at all; lengths are
        # checked where reading them is free, on the CPU, where d2l's calls and qkv's
        # batches make them.
        return
    lens = valid_lens.detach()
    bad = (lens < 0) | (lens > num_keys)
    if lens.is_floating_point():
        bad |= lens != lens.round()  # true for NaN as well
    if bool(bad.any()):  # the one read of the values
        first = lens[bad][0].item()
        if isinstance(first, float) and not (math.isfinite(first) and first.is_integer()):
            why = "not a whole number"
        elif first < 0:
            why = "negative"
        else:
            why = f"more than the {num_keys} keys there are"
        raise ValueError(
            f"valid_lens must be whole numbers in [0, {num_keys}] (the number of keys), "
            f"got {first!r}: {why}"
        )


def lengths_to_mask(valid_lens: Tensor, num_keys: int) -> Tensor:
    """Turn d2l-style ``valid_lens`` into a boolean keep mask over the keys.

    ``valid_lens (batch,) -> (batch, 1, num_keys)``: one length per example,
    shared by all of its queries.
    ``valid_lens (batch, queries) -> (batch, queries, num_keys)``: one length per
    query. Key position ``j`` is kept when ``j < valid_len``.
    """
    if not isinstance(valid_lens, Tensor):
        raise TypeError(
            "valid_lens must be a tensor of shape (batch,) or (batch, queries), "
            f"got {type(valid_lens).__name__}"
        )
    if valid_lens.dim() not in (1, 2):
        raise ValueError(
            "valid_lens must have shape (batch,) or (batch, queries), "
            f"got {tuple(valid_lens.shape)}"
        )
    positions = torch.arange(num_keys, device=valid_lens.device)
    lens = valid_lens if valid_lens.dim() == 2 else valid_lens[:, None]
    return positions < lens[..., None]


def masked_softmax(X: Tensor, valid_lens: Tensor | None = None) -> Tensor:
    """d2l's reference masked softmax over the last axis.

    ``X (batch, queries, keys)``; ``valid_lens`` is None, ``(batch,)`` or
    ``(batch, queries)``. Scores at or beyond the valid length are replaced by
    ``-1e6`` before the softmax, so they receive (near) zero weight.

    Kept exactly as the reference defines it: a row whose valid length is 0 is
    filled entirely with ``-1e6`` and therefore comes out *uniform*, not zero.
    The production kernel :func:`attention` returns zeros for such rows.
    """
    if valid_lens is None:
        return torch.softmax(X, dim=-1)
    if X.dim() != 3:
        raise ValueError(
            f"X must have shape (batch, queries, keys) to be masked by valid_lens, "
            f"got {tuple(X.shape)}"
        )
    check_valid_lens(valid_lens, X.shape[0], X.shape[1], X.shape[-1])
    keep = lengths_to_mask(valid_lens.to(X.device), X.shape[-1])
    return torch.softmax(X.masked_fill(~keep, -1e6), dim=-1)


def _guard_empty_rows(keep: Tensor) -> tuple[Tensor, Tensor]:
    """Open fully masked rows so the kernels never see them, and remember which.

    A row with nothing to attend to would give softmax ``0 / 0 = nan`` and nan
    gradients. Opening the whole row gives finite (meaningless) numbers that
    the caller then multiplies by ``row_ok == False``, i.e. zero; the zero also
    cuts the gradient, so nothing flows back from those rows.
    """
    row_ok = keep.any(dim=-1, keepdim=True)
    return keep | ~row_ok, row_ok


def softmax_with_mask(scores: Tensor, keep: Tensor | None) -> Tensor:
    """Softmax over the last axis where ``keep`` is True; zero elsewhere.

    ``scores (..., q, k)``, ``keep`` boolean and broadcastable to it (True = may attend).
    A row with no True at all becomes all zeros, never NaN.
    """
    keep = _checked_mask(keep, tuple(scores.shape))
    return _masked_softmax(scores, keep, in_place=False, may_have_empty_rows=True)


def _checked_mask(mask: Tensor | None, scores_shape: tuple[int, ...]) -> Tensor | None:
    """``mask`` as every kernel here takes it, or a one-line error saying what would do.

    Both attention backends go through this one check, so they accept the same masks:
    boolean, broadcastable to ``scores_shape (..., T_q, T_k)`` without enlarging it. A
    mask of fewer than two dimensions (``(T_k,)``: one keep flag per key, or a 0-dim
    flag) gets leading 1s, as broadcasting would give it; the fused kernel needs them.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"mask must be a bool tensor (True = may attend), got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(
            f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
            "for a 0/1 mask pass mask.bool()"
        )
    if not _stretches_to(mask.shape, scores_shape):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the attention scores' "
            f"shape {scores_shape} (..., queries, keys); shapes that do include "
            f"({scores_shape[-1]},) and {scores_shape[-2:]}"
        )
    if mask.dim() < 2:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    return mask


# PyTorch 2.5 added grouped key/value heads to scaled_dot_product_attention.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _query_groups(query: Tensor, key: Tensor, value: Tensor) -> int:
    """Query heads per key/value head: 1, or ``H / G`` when ``key`` and ``value`` have
    ``G`` heads (dim -3) that divide the query's ``H`` (grouped-query attention)."""
    if not all(isinstance(t, Tensor) and t.dim() >= 3 for t in (query, key, value)):
        return 1
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if kv_heads in (1, heads) or value.shape[-3] != kv_heads or heads % kv_heads:
        return 1  # the usual rules (broadcasting) apply, and say what is wrong
    return heads // kv_heads


def _scores_shape(query: Tensor, key: Tensor, value: Tensor, groups: int = 1
                  ) -> tuple[int, ...]:
    """Shape ``(..., T_q, T_k)`` of ``query @ key^T``, or a one-line error on bad inputs;
    with ``groups > 1`` key and value have ``1 / groups`` of the query's heads."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor (..., tokens, width), got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have shape (..., tokens, width), got {tuple(t.shape)}"
            )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same width, got {query.shape[-1]} and {key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same number of tokens, got {key.shape[-2]} "
            f"and {value.shape[-2]}"
        )
    batch = tuple(query.shape[:-2])
    key_lead, value_lead = tuple(key.shape[:-2]), tuple(value.shape[:-2])
    if groups > 1:  # each key/value head stands for `groups` query heads
        key_lead = (*key_lead[:-1], key_lead[-1] * groups)
        value_lead = (*value_lead[:-1], value_lead[-1] * groups)
    if not key_lead == value_lead == batch:  # e.g. one key head for all
        batch = _broadcast(batch, key_lead, value_lead)
    if batch is None:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must have broadcastable leading (batch, heads) dims"
        )
    return (*batch, query.shape[-2], key.shape[-2])


def _stretches_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it."""
    if len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape) :]
    return all(size in (1, want) for size, want in zip(shape, tail, strict=True))


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, or None where they do not."""
    width = max(len(shape) for shape in shapes)
    padded = [(1,) * (width - len(shape)) + shape for shape in shapes]
    out = []
    for sizes in zip(*padded, strict=True):
        other = {size for size in sizes if size != 1}  # 1 stretches to anything
        if len(other) > 1:
            return None
        out.append(other.pop() if other else 1)
    return tuple(out)


def _masked_softmax(
    scores: Tensor, keep: Tensor | None, *, in_place: bool, may_have_empty_rows: bool
) -> Tensor:
    """:func:`softmax_with_mask`, optionally filling ``scores`` in place.

    ``in_place``: the caller owns ``scores`` and no gradient needs its values (a matrix
    product's output), so the mask is written into it rather than into a copy: one pass
    and one ``T x T`` buffer fewer. ``may_have_empty_rows=False`` (a causal mask, where
    every query sees itself) skips the guard and its pass over the weights.
    """
    if keep is None:
        return torch.softmax(scores, dim=-1)
    row_ok = None
    if may_have_empty_rows:
        keep, row_ok = _guard_empty_rows(keep)
    fill = scores.masked_fill_ if in_place else scores.masked_fill
    weights = torch.softmax(fill(~keep, float("-inf")), dim=-1)
    return weights if row_ok is None else weights * row_ok


def _check_sinks(sinks: Any, query: Tensor) -> None:
    """One-line error unless ``sinks`` is a floating ``(heads,)`` tensor for ``query``'s
    heads (its dim -3)."""
    heads = query.shape[-3] if query.dim() >= 3 else None
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating tensor of shape ({heads},) (one logit per "
                        f"query head), got {type(sinks).__name__}"
                        + (f" of dtype {sinks.dtype}" if isinstance(sinks, Tensor) else ""))
    if heads is None or tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), one per query head "
                         f"(query's dim -3), got {tuple(sinks.shape)}")


def _softmax_with_sinks(scores: Tensor, keep: Tensor | None, sinks: Tensor) -> Tensor:
    """Softmax over the keys and one sink per head, the sink's weight left out.

    ``scores (..., heads, T_q, T_k)`` (filled in place where ``keep`` is False),
    ``sinks (heads,) -> weights (..., heads, T_q, T_k)``. The sink is one more column of
    scores, always kept: the denominator is ``sum_j exp(s_j) + exp(sink)``, so each row
    sums to less than one, and a row with every key masked is all zeros (no guard needed).
    """
    if keep is not None:
        scores.masked_fill_(~keep, float("-inf"))
    sink_column = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    with_sink = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)
    return with_sink[..., :-1]


def _sink_as_a_key(scaled_query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                   sinks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The sinks as one more key, for a kernel that knows no sinks; exact.

    Each head gets one extra dimension and one extra key at the end: the queries' new
    dimension holds their head's sink logit, the keys' holds 0 and the extra key is
    ``(0, ..., 0, 1)``, so a real key scores ``q . k`` as before and the extra key
    scores exactly ``sink``, in every query head, even where key heads are shared
    (GQA). Its value is zero and every query may see it. The mask stays boolean and
    shared by the heads.

    ``scaled_query (..., H, T_q, d)`` (already multiplied by the softmax scale),
    ``key (..., G, T_k, d)``, ``value (..., G, T_k, d_v)``, ``mask`` broadcastable to
    ``(..., T_q, T_k)`` -> ``(..., H, T_q, d + 1)``, ``(..., G, T_k + 1, d + 1)``,
    ``(..., G, T_k + 1, d_v)``, mask ``(..., T_q, T_k + 1)`` (or None).
    """
    sink_dim = sinks.to(scaled_query.dtype)[:, None, None].expand(*scaled_query.shape[:-1], 1)
    query = torch.cat((scaled_query, sink_dim), dim=-1)
    key = F.pad(key, (0, 1, 0, 1))  # a zero column for the sink, a zero row for its key
    key[..., -1, -1] = 1.0
    value = F.pad(value, (0, 0, 0, 1))
    if mask is not None:
        mask = F.pad(mask, (0, 1), value=True)
    return query, key, value, mask


# ---------------------------------------------------------------------------
# 3. The scaled dot-product kernel
# ---------------------------------------------------------------------------


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention ``softmax(q k^T * scale) v``, masked.

    Shapes: ``query (..., T_q, d)``, ``key (..., T_k, d)``, ``value (..., T_k, d_v)``
    ``-> (output (..., T_q, d_v), weights (..., T_q, T_k) or None)``. The leading
    dimensions are usually ``(batch, heads)``.

    Grouped queries (GQA, MQA): ``key`` and ``value`` may have ``G`` heads (dim -3)
    where ``query`` has ``H``, ``G`` dividing ``H``; query head ``i`` then attends with
    key/value head ``i // (H / G)``. The fused path hands the groups to PyTorch's kernel
    (``enable_gqa``) without copying them; the eager path repeats each key/value head
    for its queries, the definition written out.

    Args:
        mask: boolean, broadcastable to ``(..., T_q, T_k)``, True = may attend; e.g.
            ``(T_k,)`` (per key), ``(T_q, T_k)`` or ``(batch, 1, T_q, T_k)``. Both
            backends accept the same masks and give the same result.
        causal: hide keys after each query. With ``T_q < T_k`` (new tokens
            against a KV cache) queries are aligned to the last keys.
        window: with ``causal``, each query sees only its last ``window`` keys
            (itself included): sliding-window attention.
        dropout_p: dropout on the attention weights; pass 0 in eval mode.
        scale: defaults to ``1 / sqrt(d)``.
        need_weights: run the eager path and also return the weights (before
            dropout). Otherwise the fused PyTorch kernel runs and no ``T_q x T_k``
            matrix is kept for the backward pass.
        sinks: learned attention sinks (gpt-oss), ``(heads,)``: one logit per query head
            (dim -3) that joins every softmax denominator as a key that is always
            visible and has a zero value. A query's weights over the real keys then sum
            to ``1 / (1 + exp(sink - logsumexp(scores)))``, below one: the head may
            attend to "nothing". The eager path appends the sink as one more column of
            the scores; the fused one as one more key (see :func:`_sink_as_a_key`),
            except for a single query, whose row of scores is cheaper.

    Queries with no key to attend to get zero output and zero gradient (with sinks:
    all their weight goes to the sink, whose value is zero).
    """
    # Checked before anything is allocated, once for both backends.
    groups = _query_groups(query, key, value)
    mask = _checked_mask(mask, _scores_shape(query, key, value, groups))
    if sinks is not None:
        _check_sinks(sinks, query)
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    # With sinks, one query (a decoding step) needs only its row of scores per head: far
    # less than the fused path's copy of every cached key and value to add the sink key.
    eager = need_weights or (sinks is not None and num_queries == 1)
    if groups > 1 and (eager or not _SDPA_HAS_GQA):
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
        groups = 1
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    # PyTorch's is_causal is aligned top-left, so it only means "causal" when
    # queries and keys coincide; a single new query against a cache sees all.
    use_is_causal = False
    # A causal mask alone leaves every query at least its own key (causal_mask refuses
    # more queries than keys); only a caller's mask can hide a whole row.
    may_have_empty_rows = mask is not None
    if window is not None and not causal:
        raise ValueError("window needs causal=True: each query sees its last window keys")
    # With at most `window` keys, every query sees all it would see anyway: no band.
    banded = window is not None and num_keys > window
    if causal and (num_queries > 1 or banded):
        if (mask is None and num_queries == num_keys and not need_weights and not banded
                and sinks is None):
            use_is_causal = True
        else:
            tri = causal_mask(num_queries, num_keys, device=query.device,
                              window=window if banded else None)
            mask = tri if mask is None else mask & tri

    if eager:
        # Scale the (T, d) queries rather than the (T, T) scores; the scores are ours, so
        # the mask is written into them: three passes over T x T in all.
        scores = (query * scale) @ key.transpose(-2, -1)
        if sinks is None:
            weights = _masked_softmax(scores, mask, in_place=True,
                                      may_have_empty_rows=may_have_empty_rows)
        else:
            weights = _softmax_with_sinks(scores, mask, sinks)
        dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
        return dropped @ value, weights if need_weights else None

    if sinks is not None:
        query, key, value, mask = _sink_as_a_key(query * scale, key, value, mask, sinks)
        scale = 1.0  # the queries carry it now
    row_ok = None
    if mask is not None and sinks is None:  # a sink is always there to attend to
        mask, row_ok = _guard_empty_rows(mask)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=use_is_causal,
        scale=scale,
        **({"enable_gqa": True} if groups > 1 else {}),
    )
    if row_ok is not None:
        out = out * row_ok
    return out, None


def attention_logits(
    query: Tensor,
    key: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
) -> Tensor:
    """The scores :func:`attention`'s softmax takes: ``q k^T * scale``, ``-inf`` where a
    key is hidden (by ``mask``, ``causal`` or ``window``, as :func:`attention` hides it).

    Shapes: ``query (..., H, T_q, d)``, ``key (..., G, T_k, d)`` with ``G`` dividing
    ``H`` (grouped queries, as in :func:`attention`) ``-> (..., H, T_q, T_k)``. The
    product is the eager kernel's own, ``(query * scale) @ key^T``, so a softmax of
    these scores is its weights. For reading a layer (qkv.heads); the kernels never
    need it.
    """
    groups = _query_groups(query, key, key)
    mask = _checked_mask(mask, _scores_shape(query, key, key, groups))
    if window is not None and not causal:
        raise ValueError("window needs causal=True: each query sees its last window keys")
    if groups > 1:
        key = key.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query * scale) @ key.transpose(-2, -1)
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    banded = window is not None and num_keys > window
    if causal and (num_queries > 1 or banded):
        tri = causal_mask(num_queries, num_keys, device=query.device,
                          window=window if banded else None)
        mask = tri if mask is None else mask & tri
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))
