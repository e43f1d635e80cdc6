"""Position information: the sinusoidal encoding added to inputs (Vaswani et al.; d2l's
``PositionalEncoding``) and rotary embeddings (RoPE) applied to queries and keys."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .checks import check_dropout, check_positive_int

__all__ = ["PositionalEncoding", "sinusoidal_table", "rope_angles", "apply_rope"]


def sinusoidal_table(max_len: int, num_hiddens: int) -> Tensor:
    """``(max_len, num_hiddens)`` table with ``P[pos, 2j] = sin(pos / 10000^(2j/d))``
    and ``P[pos, 2j+1] = cos(pos / 10000^(2j/d))``.

    Each pair of columns is a rotation at its own frequency, so a fixed offset
    between positions is a linear map of the encoding.
    """
    check_positive_int("max_len", max_len)
    check_positive_int("num_hiddens", num_hiddens)
    # d2l's operations in d2l's order: positions divided by 10000^(2j/d). Multiplying by
    # the reciprocal is the same in exact arithmetic but rounds differently in float32
    # (up to 3.5e-6 over 60 positions, 6.1e-5 over 1000); dividing gives d2l's table.
    X = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
        10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens
    )
    table = torch.zeros(max_len, num_hiddens)
    table[:, 0::2] = torch.sin(X)
    # an odd width has one more sine column than cosine columns
    table[:, 1::2] = torch.cos(X[:, : num_hiddens // 2])
    return table


class PositionalEncoding(nn.Module):
    """Add the sinusoidal table to the input, then dropout.

    ``X (batch, T, num_hiddens) -> (batch, T, num_hiddens)`` with ``T <= max_len``.
    The table is the buffer ``P`` of shape ``(1, max_len, num_hiddens)``.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000) -> None:
        super().__init__()
        check_positive_int("num_hiddens", num_hiddens)
        check_positive_int("max_len", max_len)
        check_dropout(dropout)
        self.num_hiddens = num_hiddens
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("P", sinusoidal_table(max_len, num_hiddens)[None], persistent=False)

    def forward(self, X: Tensor) -> Tensor:
        if X.dim() != 3 or X.shape[-1] != self.num_hiddens:
            raise ValueError(
                f"X must have shape (batch, tokens, {self.num_hiddens}), got {tuple(X.shape)}"
            )
        if X.shape[1] > self.P.shape[1]:
            raise ValueError(
                f"sequence of {X.shape[1]} tokens is longer than max_len={self.P.shape[1]}"
            )
        return self.dropout(X + self.P[:, : X.shape[1]].to(X.dtype))


# ---------------------------------------------------------------------------- RoPE

def rope_angles(positions: Tensor, head_dim: int, base: float = 10_000.0) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(T, head_dim)``, of rotary position embedding (RoPE) at
    ``positions (T,)``: pair ``i`` of a head's dimensions turns by ``position * base^(-2i
    / head_dim)``. Computed in float64, whose angles stay exact to far beyond any
    context length (float32's lose a milliradian by position 30,000), and returned in
    float64 (:func:`apply_rope` casts); ``head_dim`` must be even.

    The layout is "rotate half" (Llama, GPT-NeoX): dimension ``i`` pairs with ``i +
    head_dim / 2``, so the angles of the first half repeat in the second.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64,
                                      device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (..., T, head_dim)`` by :func:`rope_angles`' ``cos, sin (T, head_dim)``:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``. A query at
    position ``m`` and a key at ``n`` then score ``q_m . k_n`` as a function of ``m - n``
    alone: attention sees relative positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
