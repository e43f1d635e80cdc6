"""The book's fast multi-head attention: one fused query/key/value projection and
PyTorch's scaled-dot-product kernel (LLMs-from-scratch ch. 3 bonus material, the
``PyTorchMultiHeadAttention`` its package exports and its ``GPTModelFast`` uses).

Where :class:`qkv.MultiHeadAttention` keeps three projections ``W_query``, ``W_key``,
``W_value``, this layer computes all three with one ``Linear(d_in, 3 * d_out)`` named
``qkv``, whose output rows are the queries', then the keys', then the values'
(``qkv.weight[:d_out]`` is ``W_query.weight``), and projects the heads back with
``proj`` (``out_proj`` there). The parameter names and shapes are the book's, so a
state dict saved from the book's class loads here. There is no ``context_length``: the
causal mask is implied, never stored.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..checks import check_dropout, check_heads, check_positive_int
from ..functional import attention

__all__ = ["PyTorchMultiHeadAttention"]


class PyTorchMultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with a fused ``qkv`` projection.

    Args:
        d_in: width of the input.
        d_out: width of the output, split into ``num_heads`` heads of
            ``head_dim = d_out // num_heads``.
        num_heads: number of heads.
        dropout: dropout probability on the attention weights, in training mode only
            (kept as a float in ``self.dropout``, as in the book).
        qkv_bias: bias on the fused projection (``proj`` always has one).

    Parameters, created in this order: ``qkv`` (``Linear(d_in, 3 * d_out)``), ``proj``
    (``Linear(d_out, d_out)``).

    Shapes: ``x (batch, T, d_in) -> (batch, T, d_out)``, any ``T``.
    """

    def __init__(
        self, d_in: int, d_out: int, num_heads: int, dropout: float = 0.0, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        check_positive_int("d_in", d_in)
        check_heads(d_out, num_heads)
        check_dropout(dropout)
        self.d_in, self.d_out = d_in, d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_in:
            raise ValueError(f"x must have shape (batch, tokens, {self.d_in}), "
                             f"got {tuple(x.shape)}")
        b, t, _ = x.shape
        # (b, T, 3 * d_out) -> (3, b, heads, T, head_dim): queries, keys, values
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out, _ = attention(q, k, v, causal=True,
                           dropout_p=self.dropout if self.training else 0.0)
        # (b, heads, T, head_dim) -> (b, T, d_out)
        return self.proj(out.transpose(1, 2).reshape(b, t, self.d_out))

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}, " \
               f"dropout={self.dropout}"
