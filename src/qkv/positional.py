"""Position information: the sinusoidal encoding added to inputs (Vaswani et al.; d2l's
``PositionalEncoding``) and rotary embeddings (RoPE) applied to queries and keys, in
"rotate half" layout (Llama) or interleaved pairs (DeepSeek), with the scalings that
stretch them past the trained context (linear, Llama 3's, YaRN)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .checks import (
    MAX_SIZE,
    check_bool,
    check_dropout,
    check_float,
    check_int,
    check_positive_int,
    show,
)

__all__ = ["PositionalEncoding", "RopeTable", "sinusoidal_table", "rope_angles",
           "rope_frequencies",
           "apply_rope", "apply_rope_interleaved", "check_rope_scaling",
           "rope_attention_factor", "yarn_mscale", "ROPE_SCALING_TYPES"]


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
# context, leaves the high ones and blends the band between; "yarn" (DeepSeek-V3, Qwen3's
# long contexts) blends the same way but draws the band by how many turns a pair makes
# over the original context, and also scales the rotated vectors (``attention_factor``).
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# YaRN's optional keys and their values when a config leaves them out (or sets them to
# None): beta_fast / beta_slow turns over the original context mark where the band of
# blended pairs begins and ends; mscale / mscale_all_dim / attention_factor set the scale
# of the rotated vectors (rope_attention_factor); truncate rounds the band outwards to
# whole pairs.
_YARN_DEFAULTS: dict[str, Any] = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
                                  "mscale_all_dim": None, "attention_factor": None,
                                  "truncate": True}


def check_rope_scaling(scaling: Any, name: str = "rope_scaling") -> dict[str, Any] | None:
    """``scaling`` as a plain dict if it is None or a valid RoPE scaling; else a one-line
    ``ValueError`` naming the type (or key) and what is valid.

    ``{"rope_type": "linear", "factor": f}``, ``{"rope_type": "llama3", "factor": f,
    "low_freq_factor": l, "high_freq_factor": h, "original_max_position_embeddings":
    n}`` or ``{"rope_type": "yarn", "factor": f, "original_max_position_embeddings": n}``
    with YaRN's optional ``beta_fast`` (default 32), ``beta_slow`` (1), ``mscale``,
    ``mscale_all_dim``, ``attention_factor`` (None) and ``truncate`` (True), which the
    returned dict always holds. Factors finite and positive, ``l < h``, ``beta_slow <
    beta_fast``, mscales at least 0.
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
    if kind == "yarn":
        out.update(_check_yarn_options(scaling, name))
    return out


def _check_yarn_options(scaling: Mapping[str, Any], name: str) -> dict[str, Any]:
    """YaRN's optional keys, checked, with their defaults where absent or None."""
    out = dict(_YARN_DEFAULTS)
    for key in ("beta_fast", "beta_slow", "attention_factor"):
        if scaling.get(key) is not None:
            out[key] = check_float(f"{name}.{key}", scaling[key], 0.0, lo_open=True)
    for key in ("mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            out[key] = check_float(f"{name}.{key}", scaling[key], 0.0)
    if scaling.get("truncate") is not None:
        out["truncate"] = check_bool(f"{name}.truncate", scaling["truncate"])
    if not out["beta_slow"] < out["beta_fast"]:
        raise ValueError(f"{name}: beta_slow ({out['beta_slow']}) must be below beta_fast "
                         f"({out['beta_fast']})")
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's scale for a context stretched ``factor`` times: ``0.1 * mscale * ln(factor)
    + 1``, or 1 when nothing is stretched (``factor <= 1``). Stretched contexts spread
    attention over more keys; the scale sharpens the softmax back."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor on RoPE's ``cos`` and ``sin`` (so on each rotated query and key; their
    scores get its square): 1 but for YaRN, where it is ``attention_factor`` if given,
    else ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both
    mscales are set (DeepSeek: 1, who scale the softmax instead), else
    ``yarn_mscale(factor)`` (Qwen3: about 1.139 at factor 4)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling["attention_factor"] is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    if mscale and all_dim:  # 0 counts as unset, as in the configs' own reading
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


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
    original = scaling["original_max_position_embeddings"]
    if scaling["rope_type"] == "yarn":
        smooth = 1 - _yarn_ramp(head_dim, base, original, scaling, inv_freq.device)
    else:
        # llama3: wavelengths longer than original / low_freq_factor are slowed by
        # `factor`, shorter than original / high_freq_factor kept, and the band between
        # interpolated linearly in original / wavelength.
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_ramp(head_dim: int, base: float, original: int, scaling: Mapping[str, Any],
               device: torch.device) -> Tensor:
    """``(head_dim / 2,)`` float64: how much of YaRN's interpolation (division by
    ``factor``) each pair gets, 0 (kept) to 1 (interpolated).

    Pair ``i`` turns ``original / (2 pi base^(2i / head_dim))`` times over the original
    context, so it turns ``r`` times at ``i(r) = head_dim ln(original / (2 pi r)) / (2 ln
    base)``. Pairs before ``i(beta_fast)`` turn often enough to be kept, pairs after
    ``i(beta_slow)`` are interpolated, and the ramp between is linear in ``i``; with
    ``truncate`` its ends are rounded outwards to whole pairs. The ends are kept in
    ``[0, head_dim - 1]``, as the models were trained with.
    """
    def pair(turns: float) -> float:
        return head_dim * math.log(original / (2 * math.pi * turns)) / (2 * math.log(base))

    low, high = pair(scaling["beta_fast"]), pair(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    return ((i - low) / (high - low)).clamp(0.0, 1.0)


def rope_angles(positions: Tensor, head_dim: int, base: float = 10_000.0,
                scaling: Mapping[str, Any] | None = None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(T, head_dim)``, of rotary position embedding (RoPE) at
    ``positions (T,)``: pair ``i`` of a head's dimensions turns by ``position * base^(-2i
    / head_dim)`` (rescaled by ``scaling``: :func:`rope_frequencies`). Computed in
    float64, whose angles stay exact to far beyond any context length (float32's lose a
    milliradian by position 30,000), and returned in float64 (:func:`apply_rope`
    casts); ``head_dim`` must be even. Under YaRN both are multiplied by
    :func:`rope_attention_factor`, which so scales every rotated query and key.

    The layout is "rotate half" (Llama, GPT-NeoX): dimension ``i`` pairs with ``i +
    head_dim / 2``, so the angles of the first half repeat in the second
    (:func:`apply_rope_interleaved` reads the first half only).
    """
    inv_freq = rope_frequencies(head_dim, base, scaling, device=positions.device)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    factor = rope_attention_factor(scaling)
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


class RopeTable:
    """:func:`rope_angles` for positions ``0, 1, ...``, kept between calls.

    A decoding step needs one position's angles in every layer; recomputing them (in
    float64, with a ``cos`` and a ``sin``) costs more than the step's attention at short
    contexts. A layer holds one table (not a buffer: it is derived, never saved), which
    slices rows and is recomputed only when a longer one, another width, base, scaling,
    dtype or device is asked for, then twice as long as before (up to ``limit``, the
    layer's context length), so that a long generation recomputes a few times, not at
    each step.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._key: tuple[Any, ...] | None = None
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None

    def __call__(self, length: int, width: int, base: float,
                 scaling: Mapping[str, Any] | None, dtype: torch.dtype, device: torch.device
                 ) -> tuple[Tensor, Tensor]:
        """``cos, sin`` of positions ``0 .. length - 1``, each ``(length, width)`` in
        ``dtype`` on ``device`` (:func:`rope_angles` of a ``width``-wide head)."""
        key = (width, base, repr(scaling), dtype, device)
        have = 0 if self._cos is None or key != self._key else self._cos.shape[0]
        if have < length:
            n = max(length, min(2 * have, self.limit or 2 * have), 256)
            cos, sin = rope_angles(torch.arange(n, device=device), width, base, scaling)
            self._key, self._cos, self._sin = key, cos.to(dtype), sin.to(dtype)
        return self._cos[:length], self._sin[:length]  # type: ignore[index]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (..., T, head_dim)`` by :func:`rope_angles`' ``cos, sin (T, head_dim)``:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``. A query at
    position ``m`` and a key at ``n`` then score ``q_m . k_n`` as a function of ``m - n``
    alone: attention sees relative positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on interleaved pairs (DeepSeek's layout, ``rope_interleave``): dimensions
    ``(2i, 2i + 1)`` of ``x (..., T, head_dim)`` turn together by pair ``i``'s angle,

        ``[a, b] -> [a cos - b sin, b cos + a sin]``,

    each pair left in its place. ``cos, sin (T, head_dim)`` are :func:`rope_angles`' (its
    first half holds one angle per pair). The same rotations as :func:`apply_rope`, on
    another pairing of the dimensions: a model trained with one needs that one.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    a, b = x[..., 0::2], x[..., 1::2]  # (..., T, head_dim / 2): each pair's two dimensions
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
