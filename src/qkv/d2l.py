"""Dive into Deep Learning's attention API under its own names.

``from qkv.d2l import MultiHeadAttention`` gives d2l's signature
``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)`` and its call
``forward(queries, keys, values, valid_lens)``. It is a thin front on the one
:class:`qkv.MultiHeadAttention` (non-causal, cross-attention capable), not a
second implementation: heads run in parallel on a head axis rather than being
folded into the batch, and ``valid_lens`` is broadcast over that axis, which
is what d2l's ``repeat_interleave`` over the folded batch computes.
"""

from __future__ import annotations

from torch import Tensor

from . import multihead
from .functional import check_positive_int, masked_softmax
from .positional import PositionalEncoding
from .scoring import AdditiveAttention, DotProductAttention

__all__ = [
    "masked_softmax",
    "DotProductAttention",
    "AdditiveAttention",
    "MultiHeadAttention",
    "PositionalEncoding",
]


class MultiHeadAttention(multihead.MultiHeadAttention):
    """d2l's multi-head attention.

    Args:
        num_hiddens: width of every projection and of the output.
        num_heads: heads; ``num_hiddens % num_heads`` must be 0.
        dropout: on the attention weights.
        bias: bias on all four projections (d2l default: none).
        query_size, key_size, value_size: input widths, default ``num_hiddens``
            (d2l infers them lazily on the first call).

    ``queries (batch, n_q, query_size)``, ``keys (batch, n_k, key_size)``,
    ``values (batch, n_k, value_size)`` ``-> (batch, n_q, num_hiddens)``.
    ``attention_weights`` holds ``(batch, num_heads, n_q, n_k)`` from the last call;
    ``.reshape(batch * num_heads, n_q, n_k)`` gives d2l's folded layout.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
    ) -> None:
        # d2l's names in the messages: the parent would call them d_out, d_in, kdim, vdim.
        multihead.check_heads(num_hiddens, num_heads, name="num_hiddens")
        for name, size in (("query_size", query_size), ("key_size", key_size),
                           ("value_size", value_size)):
            if size is not None:
                check_positive_int(name, size)
        super().__init__(
            num_hiddens if query_size is None else query_size,
            num_hiddens,
            None,
            dropout,
            num_heads,
            qkv_bias=bias,
            causal=False,
            kdim=key_size if key_size is not None else num_hiddens,
            vdim=value_size if value_size is not None else num_hiddens,
            out_bias=bias,
        )
        self.num_hiddens = num_hiddens
        self.attention_weights: Tensor | None = None

    def forward(  # type: ignore[override]
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        out, self.attention_weights = super().forward(
            queries, keys, values, valid_lens=valid_lens, need_weights=True
        )
        return out
