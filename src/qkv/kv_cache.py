"""A pre-allocated key/value cache for autoregressive decoding.

During generation every new token needs the keys and values of all tokens
before it. Recomputing them costs a full forward pass per token; keeping them
turns each step into one token's worth of work. The buffers are allocated
once at their full length, so appending writes in place and nothing is
re-copied as the sequence grows.

With a sliding window of ``W`` positions, a query never looks further back than ``W``
tokens, so the cache is a ring of ``W`` slots: each new token overwrites the one that has
just left every later query's window. Its memory stays ``W`` positions however long the
generation runs.

Multi-head latent attention (:mod:`qkv.latent_attention`) caches no per-head keys or
values at all: :class:`LatentCache` keeps each token's compressed latent and its one RoPE
key (and, for DeepSeek's sparse attention, the indexer's key), from which every head's
keys and values can be recomputed or, in the absorbed form, never built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_positive_int

__all__ = ["KVCache", "LatentCache", "kv_cache_bytes"]


def kv_cache_bytes(*, layers: int, kv_heads: int, head_dim: int, batch: int, tokens: int,
                   window: int | None = None, bytes_per_value: int = 4,
                   value_dim: int | None = None) -> int:
    """Bytes of the keys and values a model caches to decode ``tokens`` positions:
    ``layers x batch x kv_heads x positions x (head_dim + value_dim) x bytes_per_value``,
    where ``positions`` is ``tokens``, or at most ``window`` with a sliding window.

    ``kv_heads`` is the number of key/value heads (``num_kv_groups``): the query heads
    under multi-head attention, fewer under GQA, 1 under MQA. ``bytes_per_value`` is 4
    for float32, 2 for bfloat16.
    """
    for name, n in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("batch", batch), ("tokens", tokens), ("bytes_per_value", bytes_per_value)):
        check_positive_int(name, n)
    positions = tokens if window is None else min(tokens, window)
    value_dim = head_dim if value_dim is None else value_dim
    return layers * batch * kv_heads * positions * (head_dim + value_dim) * bytes_per_value


class KVCache:
    """Keys and values of one attention layer, ``(batch, heads, max_len, head_dim)``.

    Args:
        batch_size, num_heads, max_len, head_dim: buffer shape (``num_heads``: the
            layer's key/value heads, fewer than its query heads under GQA).
        dtype, device: of the buffers; match the layer's.
        value_dim: width of a value head when it differs from ``head_dim``.
        ring: keep only the last ``max_len`` positions, overwriting the oldest (a
            sliding window of ``max_len``); tokens may then come without end.

    ``pos`` counts the tokens seen so far (the position of the next one). :meth:`append`
    writes new keys and values and returns what the new queries attend to.
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
        ring: bool = False,
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
        self.ring = bool(ring)

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    @property
    def stored(self) -> int:
        """Positions held now: ``pos``, or at most ``max_len`` in a ring."""
        return min(self.pos, self.max_len)

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``(batch, heads, T_new, head_dim)`` keys and values; return the keys and
        values ``(batch, heads, T_k, head_dim)`` the ``T_new`` queries attend to.

        Without ``ring``: views of every position stored, in order (``T_k = pos``).

        With ``ring``: for one new token, the ring's slots themselves (``T_k =
        stored``), in slot order rather than time order, which attention does not need:
        every slot holds one of the token's last ``max_len`` positions, its window. For
        several new tokens, the stored positions in time order followed by the new ones
        (a copy; ``T_k = stored + T_new``): the caller masks each query to its window.
        """
        if keys.shape[0] != self.keys.shape[0] or keys.shape[1] != self.keys.shape[1]:
            raise ValueError(
                f"cache holds batch {self.keys.shape[0]} x {self.keys.shape[1]} heads, "
                f"got keys of shape {tuple(keys.shape)}"
            )
        if self.ring:
            return self._append_ring(keys, values)
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

    def _append_ring(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        new, size = keys.shape[2], self.max_len
        if new == 1:
            slot = self.pos % size  # held position pos - size: out of this token's window
            self.keys[:, :, slot] = keys[:, :, 0]
            self.values[:, :, slot] = values[:, :, 0]
            self.pos += 1
            return self.keys[:, :, : self.stored], self.values[:, :, : self.stored]
        # The stored positions, oldest first, then the new tokens.
        order = torch.arange(self.pos - self.stored, self.pos, device=self.keys.device) % size
        all_keys = torch.cat((self.keys.index_select(2, order), keys), dim=2)
        all_values = torch.cat((self.values.index_select(2, order), values), dim=2)
        # Keep the last `size` of them, each in its slot.
        kept = range(max(0, new - size), new)
        slots = torch.tensor([(self.pos + i) % size for i in kept], device=self.keys.device)
        self.keys.index_copy_(2, slots, keys[:, :, kept.start :])
        self.values.index_copy_(2, slots, values[:, :, kept.start :])
        self.pos += new
        return all_keys, all_values

    def reset(self) -> None:
        """Forget every stored token; the buffers are reused."""
        self.pos = 0

    def __repr__(self) -> str:
        b, h, n, d = self.keys.shape
        ring = ", ring=True" if self.ring else ""
        return f"KVCache(batch={b}, heads={h}, max_len={n}, head_dim={d}, pos={self.pos}{ring})"


class LatentCache:
    """What one latent-attention layer keeps per token, ``(batch, max_len, width)``.

    Args:
        batch_size, max_len: the buffers' first two dimensions.
        latent_dim: the width of the normalised latent ``c`` (``kv_lora_rank``).
        rope_dim: the width of the rotated RoPE key shared by the heads
            (``qk_rope_head_dim``).
        index_dim: the width of DeepSeek sparse attention's index key
            (``index_head_dim``); None (multi-head latent attention): no index keys.
        dtype, device: of the buffers; match the layer's.

    ``kv (batch, max_len, latent_dim + rope_dim)`` holds each token's latent followed by
    its RoPE key, side by side so that the absorbed form attends to them as one key
    without copying; ``index_keys (batch, max_len, index_dim)`` the index keys, or is
    None. ``pos`` counts the tokens seen so far (the position of the next one).
    :meth:`append` writes new tokens and returns what the new queries attend to.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        latent_dim: int,
        rope_dim: int,
        *,
        index_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, size in (("batch_size", batch_size), ("latent_dim", latent_dim),
                           ("rope_dim", rope_dim)):
            check_positive_int(name, size)
        check_positive_int("max_len", max_len, "number of tokens")
        if index_dim is not None:
            check_positive_int("index_dim", index_dim, "integer or None")
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        self.ring = False  # every position is kept: latent attention has no window
        self.kv = torch.zeros(batch_size, max_len, latent_dim + rope_dim, dtype=dtype,
                              device=device)
        self.index_keys = None if index_dim is None else torch.zeros(
            batch_size, max_len, index_dim, dtype=dtype, device=device)
        self.pos = 0

    @property
    def max_len(self) -> int:
        return self.kv.shape[1]

    @property
    def stored(self) -> int:
        """Positions held now: ``pos``."""
        return self.pos

    def append(self, kv: Tensor, index_keys: Tensor | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """Store ``kv (batch, T_new, latent_dim + rope_dim)`` (and, when the cache holds
        them, ``index_keys (batch, T_new, index_dim)``); return views of every position
        stored, in order: ``kv (batch, pos, latent_dim + rope_dim)`` and the index keys
        ``(batch, pos, index_dim)`` or None."""
        batch, _, width = self.kv.shape
        if kv.dim() != 3 or kv.shape[0] != batch or kv.shape[2] != width:
            raise ValueError(f"cache holds batch {batch} x {width} numbers per token, got kv "
                             f"of shape {tuple(kv.shape)}")
        if (index_keys is None) != (self.index_keys is None):
            raise ValueError("this cache holds index keys: pass them" if index_keys is None
                             else "this cache holds no index keys (index_dim=None)")
        if index_keys is not None:
            want = (*kv.shape[:2], self.index_keys.shape[2])
            if tuple(index_keys.shape) != want:
                raise ValueError(f"index_keys must have shape {want}, got "
                                 f"{tuple(index_keys.shape)}")
        end = self.pos + kv.shape[1]
        if end > self.max_len:
            raise ValueError(f"latent cache is full: {self.pos} tokens stored + {kv.shape[1]} "
                             f"new > max_len={self.max_len}; reset() it or make a longer one")
        self.kv[:, self.pos : end] = kv
        if index_keys is not None:
            self.index_keys[:, self.pos : end] = index_keys
        self.pos = end
        return self.kv[:, :end], None if self.index_keys is None else self.index_keys[:, :end]

    def reset(self) -> None:
        """Forget every stored token; the buffers are reused."""
        self.pos = 0

    def __repr__(self) -> str:
        b, n, _ = self.kv.shape
        index = "" if self.index_keys is None else f", index_dim={self.index_keys.shape[2]}"
        return (f"LatentCache(batch={b}, max_len={n}, latent_dim={self.latent_dim}, "
                f"rope_dim={self.rope_dim}{index}, pos={self.pos})")
