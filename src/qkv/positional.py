"""Position information: the sinusoidal encoding added to inputs (Vaswani et al.; d2l's
``PositionalEncoding``) and rotary embeddings (RoPE) applied to queries and keys."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .checks import MAX_SIZE, check_dropout, check_float, check_int, check_positive_int, show

__all__ = ["PositionalEncoding", "sinusoidal_table", "rope_angles", "rope_frequencies",
           "apply_rope", "check_rope_scaling", "ROPE_SCALING_TYPES"]


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

# How a model stretches RoPE past the context it was trained on (``rope_scaling``):
# "linear" divides every frequency by ``factor`` (position interpolation); "llama3"
# (Llama 3.1) divides only the low frequencies, whose wavelengths exceed the original
# context, leaves the high ones and blends the band between.
ROPE_SCALING_TYPES = ("linear", "llama3")
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def check_rope_scaling(scaling: Any, name: str = "rope_scaling") -> dict[str, Any] | None:
    """``scaling`` as a plain dict if it is None or a valid RoPE scaling; else a one-line
    ``ValueError`` naming the type (or key) and what is valid.

    ``{"rope_type": "linear", "factor": f}`` or ``{"rope_type": "llama3", "factor": f,
    "low_freq_factor": l, "high_freq_factor": h, "original_max_position_embeddings":
    n}``; factors finite and positive, ``l < h``.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{name} must be None or a dict, got {show(scaling)}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"{name} type {show(kind)} is not supported; supported: "
                         f"{', '.join(ROPE_SCALING_TYPES)} (or none)")
    keys = _ROPE_SCALING_KEYS[kind]
    out: dict[str, Any] = {"rope_type": kind}
    for key in keys:
        value = scaling.get(key)
        if key == "original_max_position_embeddings":
            out[key] = check_int(f"{name}.{key}", value, 1, MAX_SIZE)
        else:
            out[key] = check_float(f"{name}.{key}", value, 0.0, lo_open=True)
    if kind == "llama3" and not out["low_freq_factor"] < out["high_freq_factor"]:
        raise ValueError(f"{name}: low_freq_factor ({out['low_freq_factor']}) must be below "
                         f"high_freq_factor ({out['high_freq_factor']})")
    return out


def rope_frequencies(head_dim: int, base: float = 10_000.0,
                     scaling: Mapping[str, Any] | None = None, *,
                     device: torch.device | str | None = None) -> Tensor:
    """The ``head_dim / 2`` angular frequencies of RoPE, float64: pair ``i`` turns by
    ``base^(-2i / head_dim)`` per position, then rescaled by ``scaling``
    (:func:`check_rope_scaling`'s form; None: as they are)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64,
                                      device=device) / head_dim)
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: wavelengths longer than original / low_freq_factor are slowed by `factor`,
    # shorter than original / high_freq_factor kept, and the band between interpolated
    # linearly in original / wavelength.
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_angles(positions: Tensor, head_dim: int, base: float = 10_000.0,
                scaling: Mapping[str, Any] | None = None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(T, head_dim)``, of rotary position embedding (RoPE) at
    ``positions (T,)``: pair ``i`` of a head's dimensions turns by ``position * base^(-2i
    / head_dim)`` (rescaled by ``scaling``: :func:`rope_frequencies`). Computed in
    float64, whose angles stay exact to far beyond any context length (float32's lose a
    milliradian by position 30,000), and returned in float64 (:func:`apply_rope`
    casts); ``head_dim`` must be even.

    The layout is "rotate half" (Llama, GPT-NeoX): dimension ``i`` pairs with ``i +
    head_dim / 2``, so the angles of the first half repeat in the second.
    """
    inv_freq = rope_frequencies(head_dim, base, scaling, device=positions.device)
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
