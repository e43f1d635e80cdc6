"""Attention scoring functions of Dive into Deep Learning (d2l).

``DotProductAttention`` and ``AdditiveAttention`` (Bahdanau) take separate
queries, keys and values plus d2l's ``valid_lens``, and keep the weights of
their last call in ``attention_weights`` for heatmaps. Both mask through
:func:`qkv.functional.softmax_with_mask`, so a query with ``valid_len == 0``
gets zero weights (d2l's own ``masked_softmax`` makes that row uniform).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .checks import check_dropout, check_positive_int
from .functional import (
    attention,
    check_valid_lens,
    lengths_to_mask,
    softmax_with_mask,
)

__all__ = ["DotProductAttention", "AdditiveAttention", "check_same_width"]


def check_same_width(queries: Tensor, keys: Tensor) -> None:
    """One-line ``ValueError`` unless ``queries (..., d)`` and ``keys (..., d)`` share ``d``,
    as a dot product of the two needs."""
    if queries.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"queries and keys must have the same width, got {queries.shape[-1]} "
            f"and {keys.shape[-1]}"
        )


def _keep_mask(valid_lens: Tensor | None, queries: Tensor, num_keys: int) -> Tensor | None:
    """``(batch, 1 or n_q, n_k)`` keep mask from d2l's ``valid_lens``, checked first."""
    if valid_lens is None:
        return None
    check_valid_lens(valid_lens, queries.shape[0], queries.shape[-2], num_keys)
    return lengths_to_mask(valid_lens.to(queries.device), num_keys)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention ``softmax(Q K^T / sqrt(d)) V`` (d2l).

    ``queries (batch, n_q, d)``, ``keys (batch, n_k, d)``, ``values (batch, n_k, d_v)``,
    ``valid_lens`` None, ``(batch,)`` or ``(batch, n_q)`` ``-> (batch, n_q, d_v)``.
    ``attention_weights``: ``(batch, n_q, n_k)`` from the last call, before dropout.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: Tensor | None = None

    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        check_same_width(queries, keys)
        out, self.attention_weights = attention(
            queries,
            keys,
            values,
            mask=_keep_mask(valid_lens, queries, keys.shape[-2]),
            dropout_p=self.dropout.p if self.training else 0.0,
            need_weights=True,
        )
        return out


class AdditiveAttention(nn.Module):
    """Additive (Bahdanau) attention: ``w_v^T tanh(W_q q + W_k k)`` scores (d2l).

    Queries and keys may have different widths; both are mapped to
    ``num_hiddens`` by bias-free ``W_q`` and ``W_k`` (created ``W_k`` first, as
    d2l does), and the bias-free ``w_v`` reduces each (query, key) feature
    vector to one score.

    ``queries (batch, n_q, query_size)``, ``keys (batch, n_k, key_size)``,
    ``values (batch, n_k, d_v)`` ``-> (batch, n_q, d_v)``.

    A decoder calls this once per output step against the same keys. Pass
    ``projected_keys=attn.project_keys(keys)`` and ``mask=`` (the keep mask
    ``lengths_to_mask(valid_lens, n_k)``), both computed once per source
    sentence, to skip rebuilding them at every step.

    Taps (qkv.heads; ``tap`` as :class:`qkv.MultiHeadAttention`'s), as one head: ``q``
    the queries ``(batch, 1, n_q, query_size)`` (a decoder's state), ``k`` the keys
    ``(batch, 1, n_k, key_size)`` (the encoder's states, recorded at every call),
    ``scores`` ``w_v^T tanh(W_q q + W_k k)`` ``(batch, 1, n_q, n_k)``, ``-inf`` where
    ``valid_lens`` hides a key, ``weights`` their masked softmax, ``head_out`` the
    context ``(batch, n_q, 1, d_v)``. All only read: a model may run this attention in
    a fused kernel and record it with :meth:`tap_beside`.
    """

    tap_points = frozenset({"q", "k", "scores", "weights", "head_out"})
    tap_read_only = tap_points

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0):
        super().__init__()
        for name, size in (("key_size", key_size), ("query_size", query_size),
                           ("num_hiddens", num_hiddens)):
            check_positive_int(name, size)
        check_dropout(dropout)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: Tensor | None = None
        self.tap: Any = None  # see "Taps" above

    def project_keys(self, keys: Tensor) -> Tensor:
        """``keys (batch, n_k, key_size) -> (batch, n_k, num_hiddens)``."""
        return self.W_k(keys)

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None = None,
        *,
        projected_keys: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        num_keys = (keys if projected_keys is None else projected_keys).shape[-2]
        keep = mask if mask is not None else _keep_mask(valid_lens, queries, num_keys)
        k = self.project_keys(keys) if projected_keys is None else projected_keys
        q = self.W_q(queries)
        # (batch, n_q, 1, h) + (batch, 1, n_k, h): every query meets every key
        features = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = softmax_with_mask(scores, keep)
        out = self.dropout(self.attention_weights) @ values
        if self.tap is not None:
            self._tap(queries, keys, scores, keep, self.attention_weights, out)
        return out

    @torch.no_grad()
    def tap_beside(self, queries: Tensor, keys: Tensor, values: Tensor, keep: Tensor | None,
                   projected_keys: Tensor | None = None) -> None:
        """Pass ``self.tap`` what :meth:`forward` on these arguments (``keep``: its keep
        mask ``(batch, 1 or n_q, n_k)``) computes, in evaluation, without running the
        caller's own kernel again."""
        k = self.project_keys(keys) if projected_keys is None else projected_keys
        scores = self.w_v(torch.tanh(self.W_q(queries).unsqueeze(2) + k.unsqueeze(1)))
        scores = scores.squeeze(-1)
        weights = softmax_with_mask(scores, keep)
        self._tap(queries, keys, scores, keep, weights, weights @ values)

    def _tap(self, queries: Tensor, keys: Tensor, scores: Tensor, keep: Tensor | None,
             weights: Tensor, out: Tensor) -> None:
        names = self.tap.names
        if "q" in names:
            self.tap("q", queries.unsqueeze(1))
        if "k" in names:
            self.tap("k", keys.unsqueeze(1))
        if "scores" in names:
            hidden = scores if keep is None else scores.masked_fill(~keep, float("-inf"))
            self.tap("scores", hidden.unsqueeze(1))
        if "weights" in names:
            self.tap("weights", weights.unsqueeze(1))
        if "head_out" in names:
            self.tap("head_out", out.unsqueeze(2))
