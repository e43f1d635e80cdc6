r"""Linear attention: Gated DeltaNet, a layer whose memory of the past has a fixed size.

Softmax attention keeps every past key and value and compares each new query with all of
them. Linear attention keeps one matrix per head instead, the *state* ``S`` (``d_k x d_v``
here, keys along its rows): each token writes its value into it at its key, and a query
reads it back with one product. The state's size does not depend on how many tokens came
before, so a long prompt costs the same memory as a short one.

The *gated delta rule* (Gated DeltaNet, used by Qwen3-Next and Qwen3.5 in three of every
four layers) writes with a correction and forgets with a gate. For each token ``t``, with
decay ``a_t = exp(g_t)`` in ``(0, 1]`` and write strength ``beta_t`` in ``(0, 1)``:

.. math::
    S_t = a_t S_{t-1} + k_t\, \beta_t \big(v_t - a_t S_{t-1}^\top k_t\big)^\top,
    \qquad o_t = S_t^\top q_t

``a_t S_{t-1}^T k_t`` is what the (decayed) state already recalls at key ``k_t``; only the
difference from ``v_t`` is written (the *delta*), so writing the same pair twice does not
double it. (Written with the state transposed, ``S (d_v x d_k)``, this is
``S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k_t) k_t^T`` and ``o_t = S_t q_t``.)

:func:`gated_delta_rule` computes it in two forms behind ``backend=``:

- ``"recurrent"``: the definition, one token at a time (and the step a cached decoder takes);
- ``"chunked"``: the same numbers in matrix products, ``chunk_size`` tokens at a time. Within
  a chunk the ``chunk_size`` sequential corrections are one unit-lower-triangular system
  (the WY/UT representation), solved at once; across chunks the state is carried.

:class:`GatedDeltaNet` is the whole layer of Qwen3-Next and Qwen3.5 around it (projections,
a short causal convolution, normalised queries and keys, the gates, a gated RMSNorm), and
:class:`DeltaNetCache` its decoding cache: the convolution's last inputs and the state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_float, check_positive_int
from .options import DELTA_BACKENDS

__all__ = [
    "DELTA_BACKENDS",
    "DeltaNetCache",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "gated_delta_rule",
    "gated_delta_weights",
    "l2_normalize",
    "split_qkvz_ba",
    "fused_row_order",
]

# Added under the root of ||x||^2 when queries and keys are normalised: Qwen3-Next's and
# Qwen3.5's value (it keeps an all-zero key, as a padded token makes, at zero).
L2_EPS = 1e-6


def l2_normalize(x: Tensor, eps: float = L2_EPS) -> Tensor:
    """``x / sqrt(||x||^2 + eps)`` over the last dimension (any shape)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _state_dtype(*tensors: Tensor) -> torch.dtype:
    # The state sums a whole sequence's writes: float32 at least, float64 when asked.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_rule_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       initial_state: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape (batch, key_heads, T, d_k), got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    batch, key_heads, tokens, _ = q.shape
    if v.dim() != 4 or v.shape[0] != batch or v.shape[2] != tokens:
        raise ValueError(f"v must have shape ({batch}, value_heads, {tokens}, d_v) to match q "
                         f"{tuple(q.shape)}, got {tuple(v.shape)}")
    value_heads = v.shape[1]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads "
                         f"({key_heads}): each key head serves a group of value heads")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (batch, value_heads, tokens):
            raise ValueError(f"{name} must have shape ({batch}, {value_heads}, {tokens}) "
                             f"(batch, value_heads, T), got {tuple(t.shape)}")
    if tokens == 0:
        raise ValueError("gated_delta_rule needs at least one token, got T = 0")
    if initial_state is not None:
        want = (batch, value_heads, q.shape[-1], v.shape[-1])
        if not isinstance(initial_state, Tensor) or initial_state.shape != want:
            shape = tuple(initial_state.shape) if isinstance(initial_state, Tensor) else \
                type(initial_state).__name__
            raise ValueError(f"initial_state must have shape {want} (batch, value_heads, d_k, "
                             f"d_v), got {shape}")


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "chunked",
) -> tuple[Tensor, Tensor | None]:
    r"""The gated delta rule over a sequence (see the module docstring for the equations).

    Args:
        q, k: queries and keys ``(batch, key_heads, T, d_k)``, used as given (a layer
            normalises them first).
        v: values ``(batch, value_heads, T, d_v)``; ``value_heads`` is a multiple ``r`` of
            ``key_heads``, and value head ``j`` reads and writes at key head ``j // r``.
        g: log of each token's decay, ``(batch, value_heads, T)``, ``<= 0``.
        beta: write strength ``(batch, value_heads, T)``, in ``(0, 1)`` in the models.
        scale: factor on the queries; default ``d_k ** -0.5``.
        initial_state: the state before the first token, ``(batch, value_heads, d_k, d_v)``;
            default zeros.
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk of the chunked form (any ``T`` works: the last chunk
            may be shorter).
        backend: ``"chunked"`` (default, matrix products) or ``"recurrent"`` (one token
            at a time, the definition). Both give the same numbers and gradients.

    Returns:
        ``(out, state)``: ``out (batch, value_heads, T, d_v)`` in ``v``'s dtype, and the final
        state ``(batch, value_heads, d_k, d_v)`` (None unless ``output_final_state``). The
        state is computed and returned in float32, or float64 when an input is float64.
    """
    if backend not in DELTA_BACKENDS:
        raise ValueError(f"backend must be one of {DELTA_BACKENDS}, got {backend!r}")
    check_positive_int("chunk_size", chunk_size, "number of tokens")
    _check_rule_inputs(q, k, v, g, beta, initial_state)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    else:
        scale = check_float("scale", scale, 0.0, lo_open=True)
    dtype = _state_dtype(q, k, v, g, beta)
    batch, value_heads, d_k, d_v = v.shape[0], v.shape[1], q.shape[-1], v.shape[-1]
    if initial_state is None:
        state = torch.zeros(batch, value_heads, d_k, d_v, dtype=dtype, device=v.device)
    else:
        state = initial_state.to(dtype)
    if backend == "recurrent":
        out, state = _recurrent(q, k, v, g, beta, scale, state)
    else:
        out, state = _chunked(q, k, v, g, beta, scale, state, chunk_size)
    return out, (state if output_final_state else None)


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
               state: Tensor) -> tuple[Tensor, Tensor]:
    """One token at a time: the definition. ``state (batch, value_heads, d_k, d_v)``."""
    dtype, out_dtype = state.dtype, v.dtype
    group = v.shape[1] // q.shape[1]
    # Each key head serves `group` consecutive value heads: give every value head its own
    # copy of its queries and keys. Tokens are row vectors (b, h, 1, d), so that reading
    # the state is a product: k_t @ S (b, h, 1, d_v).
    q = q.repeat_interleave(group, dim=1).to(dtype).unsqueeze(-2) * scale  # (b, h, T, 1, d_k)
    k = k.repeat_interleave(group, dim=1).to(dtype).unsqueeze(-2)
    v = v.to(dtype).unsqueeze(-2)  # (b, h, T, 1, d_v)
    decay = g.to(dtype).exp()[..., None, None]  # a_t (b, h, T, 1, 1)
    beta = beta.to(dtype)[..., None, None]
    out = torch.empty(v.shape, dtype=out_dtype, device=v.device)  # (b, h, T, 1, d_v)
    for t in range(v.shape[2]):
        k_t = k[:, :, t]
        state = decay[:, :, t] * state  # forget a little: a_t S_{t-1}
        recalled = k_t @ state  # what the state holds at k_t
        correction = beta[:, :, t] * (v[:, :, t] - recalled)  # (b, h, 1, d_v)
        state = state + k_t.mT * correction  # written at k_t: the outer product k_t^T c
        out[:, :, t] = q[:, :, t] @ state  # read at q_t
    return out.squeeze(-2), state


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
             state: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    r"""The chunkwise-parallel form: the same numbers as :func:`_recurrent`.

    Within a chunk of ``n`` tokens, with ``M`` the state before it, ``c_t`` the cumulative
    log-decay from the chunk's start to token ``t`` (``gamma_t = exp(c_t)``) and
    ``D_ts = exp(c_t - c_s)`` for ``s <= t`` (0 above the diagonal), unrolling the
    recurrence gives every quantity as a product:

    - the corrections ``U (n, d_v)`` that the tokens write solve
      ``(I + A) U = diag(beta) V - diag(beta gamma) K M`` with ``A`` strictly lower
      triangular, ``A_ts = beta_t D_ts k_t . k_s``: token ``t``'s correction depends on
      those of the tokens before it in the chunk, a triangular system solved at once;
    - the outputs ``O = diag(gamma) Q M + (Q K^T * D) U``: what the state held at the
      chunk's start, decayed, plus what the chunk wrote so far;
    - the next state ``M' = gamma_n M + (diag(gamma_n / gamma) K)^T U``.

    Value heads are handled in groups under their key head, so ``Q K^T`` and ``K K^T``
    are computed once per key head. Every chunk's temporaries are freed before the next
    one, so memory beyond the inputs and the output is one chunk's worth.
    """
    dtype = state.dtype
    batch, key_heads, tokens, d_k = k.shape
    value_heads, d_v = v.shape[1], v.shape[-1]
    group = value_heads // key_heads
    # (b, key_heads, group, ...): a key head's value heads side by side; queries and keys
    # get a group axis of 1 that broadcasts over them.
    q, k = q.unsqueeze(2), k.unsqueeze(2)
    v = v.reshape(batch, key_heads, group, tokens, d_v)
    g = g.reshape(batch, key_heads, group, tokens)
    beta = beta.reshape(batch, key_heads, group, tokens)
    state = state.reshape(batch, key_heads, group, d_k, d_v)
    out = torch.empty(batch, key_heads, group, tokens, d_v, dtype=v.dtype, device=v.device)
    size = min(chunk_size, tokens)
    future = torch.ones(size, size, dtype=torch.bool, device=v.device).triu(1)
    for start in range(0, tokens, chunk_size):
        end = min(start + chunk_size, tokens)
        n = end - start
        q_c = q[..., start:end, :].to(dtype) * scale  # (b, hk, 1, n, d_k)
        k_c = k[..., start:end, :].to(dtype)
        v_c = v[..., start:end, :].to(dtype)  # (b, hk, r, n, d_v)
        beta_c = beta[..., start:end].to(dtype)  # (b, hk, r, n)
        log_decay = g[..., start:end].to(dtype).cumsum(-1)  # c_t
        # D_ts = exp(c_t - c_s) for s <= t; masked before exp, so nothing overflows above
        decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(
            future[:n, :n], float("-inf")).exp()  # (b, hk, r, n, n)
        gamma = log_decay.exp()[..., None]  # (b, hk, r, n, 1)
        # A's lower triangle; solve_triangular reads nothing above it, nor its diagonal
        # (unitriangular: the I of I + A).
        system = (k_c @ k_c.mT) * decay * beta_c[..., :, None]
        rhs = torch.cat((v_c * beta_c[..., None], k_c * (beta_c[..., None] * gamma)), dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        written, keys_read = solved.split((d_v, d_k), dim=-1)
        corrections = written - keys_read @ state  # U (b, hk, r, n, d_v)
        out[..., start:end, :] = (q_c * gamma) @ state + ((q_c @ k_c.mT) * decay) @ corrections
        last = log_decay[..., -1:]  # c_n
        state = last.exp()[..., None] * state + (
            k_c * (last - log_decay).exp()[..., None]).mT @ corrections
    return (out.reshape(batch, value_heads, tokens, d_v),
            state.reshape(batch, value_heads, d_k, d_v))


def gated_delta_weights(q: Tensor, k: Tensor, g: Tensor, beta: Tensor, *,
                        scale: float | None = None, chunk_size: int = 64) -> Tensor:
    r"""The token-to-token weights the gated delta rule applies to the values.

    From a zero state, the rule's output is linear in the values: ``o_t = sum_s W_ts v_s``
    with

    .. math::
        W_{ts} = \beta_s\, k_s^\top \Big(\prod_{u=s+1}^{t} a_u (I - \beta_u k_u k_u^\top)
        \Big)^\top q_t \quad (s \le t), \qquad W_{ts} = 0 \quad (s > t)

    (``q`` scaled): how much of token ``s``'s value is left, after the decays and the later
    tokens' corrections, where token ``t``'s query reads. Unlike softmax weights they do not
    sum to one and may be negative (a correction removes part of an earlier value). They
    are computed by running the chunked form with each token's value a one-hot vector of
    its own position, so they are exactly what that form builds: ``W @ v`` is its output.

    Args:
        q, k: ``(batch, key_heads, T, d_k)``; g, beta: ``(batch, value_heads, T)``; scale,
            chunk_size: as in :func:`gated_delta_rule`.

    Returns:
        ``(batch, value_heads, T, T)``, query position by value position, float32 (float64
        when an input is float64).
    """
    if not isinstance(g, Tensor) or g.dim() != 3:
        raise ValueError(f"g must have shape (batch, value_heads, T), got "
                         f"{tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__}")
    batch, value_heads, tokens = g.shape
    dtype = _state_dtype(q, k, g, beta)
    one_hot = torch.eye(tokens, dtype=dtype, device=g.device).expand(batch, value_heads,
                                                                      tokens, tokens)
    weights, _ = gated_delta_rule(q, k, one_hot, g, beta, scale=scale, chunk_size=chunk_size)
    return weights


# ----------------------------------------------------------------------------
# The layer


class GatedRMSNorm(nn.Module):
    r"""RMSNorm of each head's output, gated by ``z``: ``w * x / rms(x) * silu(z)``.

    ``x, z (..., dim) -> (..., dim)``; ``rms(x) = sqrt(mean(x^2) + eps)``. The norm is
    taken in float32 (or float64), the weight applied in ``x``'s dtype and the gate in
    float32, as Qwen3-Next and Qwen3.5 do; the result is in ``x``'s dtype. ``weight``
    starts at ones.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        self.eps = check_float("eps", eps, 0.0, lo_open=True)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        dtype = x.dtype
        wide = _state_dtype(x)
        x = x.to(wide)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x.to(dtype)) * F.silu(z.to(wide))).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}"


class DeltaNetCache:
    """What a :class:`GatedDeltaNet` layer needs to go on from where it stopped.

    Attributes:
        conv: the convolution's last ``kernel_size - 1`` inputs, ``(batch, kernel_size - 1,
            conv_dim)``, in the layer's dtype (zeros before the first token).
        state: the delta rule's state ``(batch, value_heads, d_k, d_v)``, float32 (float64
            for a float64 layer).
        pos: tokens seen so far.

    Its size does not depend on how many tokens it has seen (:attr:`nbytes`).
    """

    def __init__(self, batch_size: int, conv_dim: int, kernel_size: int, value_heads: int,
                 d_k: int, d_v: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        for name, size in (("batch_size", batch_size), ("conv_dim", conv_dim),
                           ("kernel_size", kernel_size), ("value_heads", value_heads),
                           ("d_k", d_k), ("d_v", d_v)):
            check_positive_int(name, size)
        self.conv = torch.zeros(batch_size, kernel_size - 1, conv_dim, dtype=dtype,
                                device=device)
        self.state = torch.zeros(batch_size, value_heads, d_k, d_v,
                                 dtype=_state_dtype(self.conv), device=device)
        self.pos = 0
        self.ring = False  # the cache protocol's: no window of positions, a state

    @property
    def nbytes(self) -> int:
        """Bytes held: the convolution window and the state."""
        return self.conv.nbytes + self.state.nbytes

    def reset(self) -> None:
        """Back to before the first token; the buffers are reused."""
        self.conv = torch.zeros_like(self.conv)
        self.state = torch.zeros_like(self.state)
        self.pos = 0

    def __repr__(self) -> str:
        b, window, channels = self.conv.shape
        _, heads, d_k, d_v = self.state.shape
        return (f"DeltaNetCache(batch={b}, conv_window={window}, conv_dim={channels}, "
                f"heads={heads}, d_k={d_k}, d_v={d_v}, pos={self.pos})")


class GatedDeltaNet(nn.Module):
    r"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5: ``x (batch, T, d_in) ->
    (batch, T, d_out)``.

    For each token:

    1. projections: ``q, k`` (``num_k_heads`` heads of ``head_k_dim``), ``v, z``
       (``num_v_heads`` heads of ``head_v_dim``), ``b`` and ``a`` (one number per value
       head), all without bias;
    2. a causal depthwise convolution over time (``conv_kernel_size`` taps, the last on
       the token itself) on ``q, k, v``, then SiLU;
    3. ``q`` and ``k`` L2-normalised per head, ``q`` scaled by ``head_k_dim ** -0.5``;
    4. the gates: decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (log of
       ``a_t`` in ``(0, 1)``), write strength ``beta = sigmoid(b)``;
    5. the gated delta rule (:func:`gated_delta_rule`), value head ``j`` on key head
       ``j // (num_v_heads / num_k_heads)``;
    6. each head's output through :class:`GatedRMSNorm` gated by its ``z``, the heads
       side by side, then ``out_proj``.

    Args:
        d_in: width of ``x``.
        num_k_heads, head_k_dim: query/key heads and their size.
        num_v_heads, head_v_dim: value heads (a multiple of ``num_k_heads``) and their
            size; default ``num_k_heads`` and ``head_k_dim``.
        d_out: width of the output; default ``d_in``.
        conv_kernel_size: taps of the short convolution (Qwen: 4).
        norm_eps: the gated RMSNorm's epsilon (the config's ``rms_norm_eps``).
        chunk_size: tokens per chunk of the chunked form.
        backend: ``"chunked"`` (default) or ``"recurrent"``: how a call of several tokens
            runs the rule. One new token always takes the recurrent step (for one token
            the two forms are the same arithmetic).

    Parameters, named as in Qwen3.5's Hugging Face checkpoints (``...linear_attn.NAME``),
    so that a Qwen3.5 layer's state dict loads as it is:

    ======================  =========================================================
    ``in_proj_qkv.weight``  ``(2 num_k_heads head_k_dim + num_v_heads head_v_dim, d_in)``:
                            q's heads, then k's, then v's
    ``in_proj_z.weight``    ``(num_v_heads head_v_dim, d_in)``
    ``in_proj_b.weight``    ``(num_v_heads, d_in)``
    ``in_proj_a.weight``    ``(num_v_heads, d_in)``
    ``conv1d.weight``       ``(conv_dim, 1, conv_kernel_size)``, ``conv_dim`` the rows
                            of ``in_proj_qkv``, in the same order
    ``dt_bias``, ``A_log``  ``(num_v_heads,)``
    ``norm.weight``         ``(head_v_dim,)``
    ``out_proj.weight``     ``(d_out, num_v_heads head_v_dim)``
    ======================  =========================================================

    Qwen3-Next fuses the first four into ``in_proj_qkvz`` and ``in_proj_ba``, interleaved
    per key head; :func:`split_qkvz_ba` turns its state dict into these names. The
    other names are the same in both families.
    """

    # What its weights are, for a page that draws them (qkv view): not a softmax, so they
    # get a section of their own (titled so), drawn on a scale for either sign.
    weights_note = ("Gated DeltaNet layers: no softmax; their weights are the delta rule's "
                    "effective token-to-token weights (how much of each earlier token's "
                    "value reaches a token's output, after the decays and the later tokens' "
                    "corrections): rows do not sum to 1 and may be negative")
    weights_section = "Gated DeltaNet: the delta rule's effective weights"

    # qkv.heads' taps (``tap`` as :class:`qkv.MultiHeadAttention`'s): ``q`` and ``k`` ``(b,
    # num_k_heads, T, head_k_dim)`` after the convolution and the L2 norm (before the
    # rule's head_k_dim ** -0.5 on q), ``v (b, num_v_heads, T, head_v_dim)`` after the
    # convolution, ``head_out (b, T, num_v_heads, head_v_dim)`` after the gated norm,
    # before out_proj; each may be replaced. No scores or weights: the delta rule is a
    # recurrence, not a softmax over keys (need_weights' weights need the whole sequence
    # in one call, so a generation could not record them step by step).
    tap_points = frozenset({"q", "k", "v", "head_out"})
    tap_read_only: frozenset[str] = frozenset()

    def __init__(
        self,
        d_in: int,
        num_k_heads: int,
        head_k_dim: int,
        *,
        num_v_heads: int | None = None,
        head_v_dim: int | None = None,
        d_out: int | None = None,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
        backend: str = "chunked",
    ) -> None:
        super().__init__()
        num_v_heads = num_k_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_k_dim if head_v_dim is None else head_v_dim
        d_out = d_in if d_out is None else d_out
        for name, size in (("d_in", d_in), ("num_k_heads", num_k_heads),
                           ("head_k_dim", head_k_dim), ("num_v_heads", num_v_heads),
                           ("head_v_dim", head_v_dim), ("d_out", d_out),
                           ("conv_kernel_size", conv_kernel_size)):
            check_positive_int(name, size)
        check_positive_int("chunk_size", chunk_size, "number of tokens")
        norm_eps = check_float("norm_eps", norm_eps, 0.0, lo_open=True)
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads "
                             f"({num_k_heads}): each key head serves a group of value heads")
        if backend not in DELTA_BACKENDS:
            raise ValueError(f"backend must be one of {DELTA_BACKENDS}, got {backend!r}")
        self.d_in, self.d_out = d_in, d_out
        self.num_k_heads, self.head_k_dim = num_k_heads, head_k_dim
        self.num_v_heads, self.head_v_dim = num_v_heads, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.chunk_size = chunk_size
        self.backend = backend

        self.in_proj_qkv = nn.Linear(d_in, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d_in, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d_in, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d_in, num_v_heads, bias=False)
        # Depthwise: one filter per channel. Only its weight is used (see _short_conv).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size,
                                groups=self.conv_dim, bias=False)
        # Qwen's initialisation: dt_bias ones, A uniform in [0.01, 16] (its log stored).
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d_out, bias=False)
        self.tap: Any = None  # see tap_points above

    def _short_conv(self, mixed: Tensor, window: Tensor | None,
                    pad: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Causal depthwise convolution and SiLU along time, in ``(batch, T, channels)``.

        ``mixed (b, T, conv_dim)``; ``window (b, K - 1, conv_dim)``: the inputs before
        the first token (None: zeros, nothing came before); ``pad (b, T)`` bool, True at
        padding positions, which are skipped: each token's window is the ``K - 1`` real
        inputs before it. Returns the output ``(b, T, conv_dim)`` (0 at padding) and the
        last ``K - 1`` real inputs, the next call's window. Output ``t`` is ``sum_j w[:,
        j] * input[t - (K - 1) + j]``: tap ``K - 1`` on the token itself, as
        ``nn.Conv1d`` with ``K - 1`` zeros of left padding computes it.
        """
        batch, tokens, channels = mixed.shape
        taps = self.conv1d.weight[:, 0, :]  # (conv_dim, K)
        before = self.conv_kernel_size - 1
        if window is None:
            window = mixed.new_zeros(batch, before, channels)
        padded = torch.cat((window.to(mixed.dtype), mixed), dim=1)  # (b, K - 1 + T, C)
        order = None
        if pad is not None:
            # Move each row's padding to its front (zeros, as before the first token),
            # keeping the rest in order: the real inputs are then contiguous and each
            # sees the real ones before it. Left padding is already in that order.
            skip = torch.cat((pad.new_zeros(batch, before), pad), dim=1)
            order = torch.argsort(~skip, dim=1, stable=True)[..., None].expand_as(padded)
            padded = padded.masked_fill(skip[..., None], 0).gather(1, order)
            padded = torch.cat((padded.new_zeros(batch, before, channels), padded), dim=1)
            tokens += before  # every position, then only the call's own are kept
        out = padded[:, :tokens] * taps[:, 0]
        for j in range(1, self.conv_kernel_size):
            out = out.addcmul_(padded[:, j : j + tokens], taps[:, j])
        if order is not None:  # back to the call's order, its own positions only
            out = out.scatter(1, order, out.clone())[:, before:].masked_fill(pad[..., None], 0)
        return F.silu(out), padded[:, padded.shape[1] - before:].clone()

    def _heads(self, x: Tensor, window: Tensor | None, pad: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Steps 1-4: ``q, k (b, num_k_heads, T, head_k_dim)`` normalised, ``v (b,
        num_v_heads, T, head_v_dim)``, ``z (b, T, num_v_heads, head_v_dim)``, ``g, beta (b,
        num_v_heads, T)`` and the next convolution window. At the ``pad (b, T)``
        positions the decay is 1 and the write strength 0 (``g = beta = 0``): the state
        goes through them unchanged, as the convolution's window does."""
        batch, tokens, _ = x.shape
        wide = _state_dtype(x)
        mixed, window = self._short_conv(self.in_proj_qkv(x), window, pad)
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        # (b, T, heads * d) -> (b, heads, T, d): heads become a batch axis (views)
        q = l2_normalize(q.view(batch, tokens, self.num_k_heads, self.head_k_dim).to(wide))
        k = l2_normalize(k.view(batch, tokens, self.num_k_heads, self.head_k_dim).to(wide))
        v = v.view(batch, tokens, self.num_v_heads, self.head_v_dim)
        z = self.in_proj_z(x).view(batch, tokens, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        # In float32 at least: in half precision exp(A_log) may overflow.
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) +
                                                     self.dt_bias.to(wide))
        if pad is not None:
            g, beta = g.masked_fill(pad[..., None], 0), beta.masked_fill(pad[..., None], 0)
        return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), z,
                g.transpose(1, 2), beta.transpose(1, 2), window)

    def forward(self, x: Tensor, *, cache: DeltaNetCache | None = None,
                key_padding_mask: Tensor | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Run the layer over ``x (batch, T, d_in)``; returns ``(batch, T, d_out)``.

        Args:
            cache: a :class:`DeltaNetCache` (:meth:`new_cache`): the call starts from its
                window and state and leaves its own in it, so a prompt followed by one
                token at a time gives what one call over the whole sequence gives.
            key_padding_mask: ``(batch, T)`` bool, **True = padding** (as
                :class:`~qkv.multihead.MultiHeadAttention` takes it), anywhere in the
                row: a padding position writes nothing (decay 1, write strength 0) and
                is skipped by the convolution, so each row gives what it gives alone,
                its real tokens' outputs and its cache alike; the output is 0 there.
            need_weights: also return :meth:`token_weights`-style weights ``(batch,
                num_v_heads, T, T)`` of this call (not with a cache: the past is then a
                state, not tokens).
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_in:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (batch, tokens, {self.d_in}), got {shape}")
        batch, tokens, _ = x.shape
        if tokens == 0:
            raise ValueError("x must hold at least one token, got T = 0")
        if cache is not None:
            self._check_cache(cache, batch)
            if need_weights:
                raise ValueError("need_weights needs the whole sequence in one call, without "
                                 "a cache: the tokens before it are a state, not weights")
        pad = None
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool \
                    or key_padding_mask.shape != (batch, tokens):
                got = (f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}"
                       if isinstance(key_padding_mask, Tensor)
                       else type(key_padding_mask).__name__)
                raise ValueError(f"key_padding_mask must be a bool tensor of shape ({batch}, "
                                 f"{tokens}) (True = padding), got {got}")
            pad = key_padding_mask.to(x.device)
        q, k, v, z, g, beta, window = self._heads(
            x, cache.conv if cache is not None else None, pad)
        if self.tap is not None:
            q, k, v = (self.tap(name, t) if name in self.tap.names else t
                       for name, t in (("q", q), ("k", k), ("v", v)))
        backend = "recurrent" if tokens == 1 else self.backend
        out, state = gated_delta_rule(
            q, k, v, g, beta, initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None, chunk_size=self.chunk_size, backend=backend)
        if cache is not None:
            cache.conv, cache.state, cache.pos = window, state, cache.pos + tokens
        out = self.norm(out.transpose(1, 2), z)  # (b, T, heads, d_v)
        if self.tap is not None and "head_out" in self.tap.names:
            out = self.tap("head_out", out)
        out = self.out_proj(out.reshape(batch, tokens, self.value_dim))
        if pad is not None:
            out = out.masked_fill(pad[..., None], 0)
        if need_weights:
            return out, gated_delta_weights(q, k, g, beta, chunk_size=self.chunk_size)
        return out

    @property
    def num_heads(self) -> int:
        """The heads of ``head_out``: the value heads."""
        return self.num_v_heads

    def token_weights(self, x: Tensor) -> Tensor:
        """The token-to-token weights ``(batch, num_v_heads, T, T)`` of each value head over
        ``x (batch, T, d_in)``: the output of the delta rule for query position ``t``
        (before the gated norm and ``out_proj``) is ``sum_s W[t, s] v_s``. They are not a
        softmax: rows do not sum to one and entries may be negative; see
        :func:`gated_delta_weights`."""
        return self.forward(x, need_weights=True)[1]

    def _check_cache(self, cache: DeltaNetCache, batch: int) -> None:
        if not isinstance(cache, DeltaNetCache):
            raise TypeError(f"cache must be a DeltaNetCache (new_cache()), got "
                            f"{type(cache).__name__}")
        conv = (batch, self.conv_kernel_size - 1, self.conv_dim)
        state = (batch, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if tuple(cache.conv.shape) != conv or tuple(cache.state.shape) != state:
            raise ValueError(f"cache holds conv {tuple(cache.conv.shape)} and state "
                             f"{tuple(cache.state.shape)}; this layer at batch {batch} needs "
                             f"{conv} and {state}: make it with new_cache({batch})")

    def new_cache(self, batch_size: int, max_len: int | None = None) -> DeltaNetCache:
        """An empty :class:`DeltaNetCache` for this layer at ``batch_size``, on its device
        and in its dtype. Its size does not depend on the number of tokens: ``max_len``
        (the attention layers' cache length, passed to every layer alike) is not used."""
        weight = self.in_proj_qkv.weight
        return DeltaNetCache(batch_size, self.conv_dim, self.conv_kernel_size,
                             self.num_v_heads, self.head_k_dim, self.head_v_dim,
                             dtype=weight.dtype, device=weight.device)

    def extra_repr(self) -> str:
        return (f"d_in={self.d_in}, d_out={self.d_out}, num_k_heads={self.num_k_heads}, "
                f"head_k_dim={self.head_k_dim}, num_v_heads={self.num_v_heads}, "
                f"head_v_dim={self.head_v_dim}, conv_kernel_size={self.conv_kernel_size}, "
                f"chunk_size={self.chunk_size}, backend={self.backend!r}")


def fused_row_order(num_k_heads: int, num_v_heads: int, head_k_dim: int,
                    head_v_dim: int) -> tuple[Tensor, Tensor]:
    """Where the rows of Qwen3-Next's fused projections come from in :class:`GatedDeltaNet`'s.

    Qwen3-Next stores ``in_proj_qkvz.weight`` with, for each key head ``h`` in turn, the
    rows of its query (``head_k_dim``), key (``head_k_dim``), its group's values and its
    group's ``z`` (``r head_v_dim`` each, ``r = num_v_heads / num_k_heads``), and
    ``in_proj_ba.weight`` with, per key head, its group's ``b`` then ``a`` (``r`` rows
    each). Returns ``(qkvz, ba)``, integer indices such that

        in_proj_qkvz = torch.cat((in_proj_qkv, in_proj_z))[qkvz]
        in_proj_ba = torch.cat((in_proj_b, in_proj_a))[ba]

    (and the separate ones are the fused rows put back: ``unfused[qkvz] = in_proj_qkvz``).
    """
    for name, size in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                       ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        check_positive_int(name, size)
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads "
                         f"({num_k_heads})")
    group = num_v_heads // num_k_heads
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    # The rows of torch.cat((in_proj_qkv, in_proj_z)), one row of this table per key head:
    # all queries, all keys, all values, all z; a key head's values and z are those of its
    # group of value heads, consecutive.
    start = 0
    per_head = []
    for size in (key_dim, key_dim, value_dim, value_dim):
        per_head.append(torch.arange(start, start + size).view(num_k_heads, -1))
        start += size
    qkvz = torch.cat(per_head, dim=1).flatten()
    b = torch.arange(num_v_heads).view(num_k_heads, group)
    ba = torch.cat((b, b + num_v_heads), dim=1).flatten()
    return qkvz, ba


def split_qkvz_ba(state_dict: dict[str, Any], *, num_k_heads: int, num_v_heads: int,
                  head_k_dim: int, head_v_dim: int, prefix: str = "") -> dict[str, Any]:
    """Qwen3-Next's fused projections as :class:`GatedDeltaNet`'s separate ones.

    Returns a new dict in which ``PREFIX in_proj_qkvz.weight`` and ``PREFIX
    in_proj_ba.weight`` (their rows in the order :func:`fused_row_order` describes) are
    replaced by ``in_proj_qkv`` (all queries, all keys, all values), ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a``; every other entry is kept as it is.
    """
    qkvz_rows, ba_rows = fused_row_order(num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    out = dict(state_dict)
    qkvz, ba = out.pop(prefix + "in_proj_qkvz.weight", None), out.pop(prefix + "in_proj_ba.weight",
                                                                      None)
    if qkvz is None or ba is None:
        raise ValueError(f"state dict lacks {prefix}in_proj_qkvz.weight or "
                         f"{prefix}in_proj_ba.weight (Qwen3-Next's fused projections)")
    per_head = len(qkvz_rows) // num_k_heads
    if qkvz.dim() != 2 or qkvz.shape[0] != len(qkvz_rows):
        raise ValueError(f"{prefix}in_proj_qkvz.weight must have {len(qkvz_rows)} "
                         f"rows ({num_k_heads} key heads x {per_head}), got "
                         f"{tuple(qkvz.shape)}")
    if ba.dim() != 2 or ba.shape != (2 * num_v_heads, qkvz.shape[1]):
        raise ValueError(f"{prefix}in_proj_ba.weight must have shape "
                         f"({2 * num_v_heads}, {qkvz.shape[1]}), got {tuple(ba.shape)}")
    value_dim = num_v_heads * head_v_dim
    qkv, z = torch.empty_like(qkvz).index_copy_(0, qkvz_rows, qkvz).split(
        (len(qkvz_rows) - value_dim, value_dim))
    b, a = torch.empty_like(ba).index_copy_(0, ba_rows, ba).split(num_v_heads)
    # each its own tensor, not a view into the others' storage
    for name, tensor in (("in_proj_qkv", qkv), ("in_proj_z", z), ("in_proj_b", b),
                         ("in_proj_a", a)):
        out[f"{prefix}{name}.weight"] = tensor.clone()
    return out
