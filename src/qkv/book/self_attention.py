"""The book's step-by-step self-attention classes (LLMs-from-scratch §3.4-3.6.1).

These are the teaching forms, kept so a learner can run the chapter as
printed: the same signatures, the same parameter-creation order and hence the
same numbers under the same seed. Each builds on the one before;
:class:`qkv.MultiHeadAttention` is the layer to use in a model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..checks import check_dropout, check_positive_int
from ..functional import attention

__all__ = [
    "SelfAttentionV1",
    "SelfAttentionV2",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
]


class SelfAttentionV1(nn.Module):
    """Self-attention with raw weight matrices (the book's ``SelfAttention_v1``).

    ``W_query``, ``W_key``, ``W_value`` are ``nn.Parameter(torch.rand(d_in, d_out))``
    created in that order. ``x (T, d_in) -> (T, d_out)``; a leading batch
    dimension works too.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: Tensor) -> Tensor:
        queries = x @ self.W_query
        keys = x @ self.W_key
        values = x @ self.W_value
        scores = queries @ keys.transpose(-2, -1)
        # Dividing by sqrt(d_k) keeps the scores' spread independent of the
        # width, so softmax does not saturate into near one-hot rows.
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return weights @ values


class SelfAttentionV2(nn.Module):
    """Self-attention with ``nn.Linear`` projections (the book's ``SelfAttention_v2``).

    ``nn.Linear`` initialises better than ``torch.rand`` and stores the weight
    transposed: copying ``W_query.weight.T`` into v1 reproduces v2 exactly.
    ``x (..., T, d_in) -> (..., T, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = attention(self.W_query(x), self.W_key(x), self.W_value(x), need_weights=True)
        return out


class CausalAttention(nn.Module):
    """Single-head causal self-attention with dropout (book §3.5.3).

    The mask is a ``(context_length, context_length)`` buffer with ones above
    the diagonal, so it follows the module through ``.to(device)``; shorter
    inputs use its top-left corner.
    ``x (batch, T, d_in) -> (batch, T, d_out)`` with ``T <= context_length``.
    """

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("d_out", d_out)
        check_positive_int("context_length", context_length)
        check_dropout(dropout)
        self.d_in, self.d_out = d_in, d_out
        self.context_length = context_length
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask", torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )
        self.attention_weights: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_in:
            raise ValueError(
                f"x must have shape (batch, tokens, {self.d_in}), got {tuple(x.shape)}"
            )
        num_tokens = x.shape[1]
        if num_tokens > self.context_length:
            raise ValueError(
                f"sequence of {num_tokens} tokens is longer than "
                f"context_length={self.context_length}"
            )
        keep = self.mask[:num_tokens, :num_tokens] == 0
        out, self.attention_weights = attention(
            self.W_query(x),
            self.W_key(x),
            self.W_value(x),
            mask=keep,
            dropout_p=self.dropout.p if self.training else 0.0,
            need_weights=True,
        )
        return out


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent :class:`CausalAttention` heads, concatenated.

    Each head has width ``d_out``, so the output has ``d_out * num_heads``
    features: ``x (batch, T, d_in) -> (batch, T, d_out * num_heads)``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        # Checked here too, so that num_heads=0 does not build an empty wrapper.
        check_positive_int("num_heads", num_heads)
        for name, size in (("d_in", d_in), ("d_out", d_out), ("context_length", context_length)):
            check_positive_int(name, size)
        check_dropout(dropout)
        self.heads = nn.ModuleList(
            CausalAttention(d_in, d_out, context_length, dropout, qkv_bias)
            for _ in range(num_heads)
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([head(x) for head in self.heads], dim=-1)


# The book's spellings.
SelfAttention_v1 = SelfAttentionV1
SelfAttention_v2 = SelfAttentionV2
