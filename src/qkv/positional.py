"""Sinusoidal positional encoding (Vaswani et al.; d2l's ``PositionalEncoding``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .checks import check_dropout, check_positive_int

__all__ = ["PositionalEncoding", "sinusoidal_table"]


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
