"""A pre-allocated key/value cache for autoregressive decoding.

During generation every new token needs the keys and values of all tokens
before it. Recomputing them costs a full forward pass per token; keeping them
turns each step into one token's worth of work. The buffers are allocated
once at their full length, so appending writes in place and nothing is
re-copied as the sequence grows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_positive_int

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of one attention layer, ``(batch, heads, max_len, head_dim)``.

    Args:
        batch_size, num_heads, max_len, head_dim: buffer shape.
        dtype, device: of the buffers; match the layer's.
        value_dim: width of a value head when it differs from ``head_dim``.

    ``pos`` counts the tokens stored so far. :meth:`append` writes new keys and
    values after them and returns views of everything stored, ready for
    attention.
    """

    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        value_dim: int | None = None,
    ) -> None:
        for name, size in (("batch_size", batch_size), ("num_heads", num_heads),
                           ("head_dim", head_dim)):
            check_positive_int(name, size)
        check_positive_int("max_len", max_len, "number of tokens")
        value_dim = head_dim if value_dim is None else value_dim
        check_positive_int("value_dim", value_dim)
        self.keys = torch.zeros(
            batch_size, num_heads, max_len, head_dim, dtype=dtype, device=device
        )
        self.values = torch.zeros(
            batch_size, num_heads, max_len, value_dim, dtype=dtype, device=device
        )
        self.pos = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``(batch, heads, T_new, head_dim)`` keys and values.

        Returns views ``(batch, heads, pos + T_new, head_dim)`` of all keys and
        values stored so far.
        """
        if keys.shape[0] != self.keys.shape[0] or keys.shape[1] != self.keys.shape[1]:
            raise ValueError(
                f"cache holds batch {self.keys.shape[0]} x {self.keys.shape[1]} heads, "
                f"got keys of shape {tuple(keys.shape)}"
            )
        end = self.pos + keys.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache is full: {self.pos} tokens stored + {keys.shape[2]} new > "
                f"max_len={self.max_len}; reset() it or use a sliding window"
            )
        self.keys[:, :, self.pos : end] = keys
        self.values[:, :, self.pos : end] = values
        self.pos = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reset(self) -> None:
        """Forget every stored token; the buffers are reused."""
        self.pos = 0

    def __repr__(self) -> str:
        b, h, n, d = self.keys.shape
        return f"KVCache(batch={b}, heads={h}, max_len={n}, head_dim={d}, pos={self.pos})"
