"""Multi-head attention: the book's weight-split layer, built for production.

``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads)`` is the
class of LLMs-from-scratch §3.6.2, with the same signature and the same order
of parameter creation, so a seed gives the book's numbers. The same class is
the layer qkv's models run: fused kernels by default, per-head weights on
request, padding masks, cross-attention and a KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .checks import check_bool, check_dropout, check_float, check_heads, check_positive_int
from .functional import (
    BACKENDS,
    attention,
    attention_logits,
    check_valid_lens,
    lengths_to_mask,
)
from .kv_cache import KVCache
from .options import ATTENTION_POINTS
from .positional import RopeTable, apply_rope, check_rope_scaling

__all__ = ["MultiHeadAttention"]


def _check_input(name: str, x: Tensor, width: int) -> None:
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(f"{name} must have shape (batch, tokens, {width}), got {tuple(x.shape)}")


class MultiHeadAttention(nn.Module):
    r"""Multi-head scaled dot-product attention.

    .. math::
        \text{head}_i = \text{softmax}\big(Q_i K_i^\top / \sqrt{d_{head}}\big) V_i,
        \quad \text{out} = \text{concat}(\text{head}_1, \dots, \text{head}_h) W_o

    Args:
        d_in: width of the query input ``x``.
        d_out: width of the output, and of the projections, split into
            ``num_heads`` heads of ``head_dim = d_out // num_heads`` (unless
            ``head_dim`` is given).
        context_length: longest sequence accepted; None accepts any length
            (the fused causal path then never allocates a ``T x T`` mask).
        dropout: dropout probability on the attention weights (training only).
        num_heads: number of heads.
        qkv_bias: add a bias to the query, key and value projections.
        causal: hide future tokens (the book's behaviour, default True).
        kdim, vdim: widths of ``key`` and ``value`` inputs for
            cross-attention; default ``d_in``.
        out_bias: bias on ``out_proj`` (the book: True; d2l: False).
        backend: ``"fused"`` (default) runs
            :func:`torch.nn.functional.scaled_dot_product_attention`;
            ``"eager"`` computes the weights explicitly. Asking for weights
            always runs eager for that call.
        num_kv_groups: key/value heads ``G`` (the book's name), dividing
            ``num_heads``; each is shared by ``num_heads / G`` query heads
            (grouped-query attention; ``G = 1`` is multi-query attention).
            ``W_key`` and ``W_value`` project to ``G x head_dim`` and a KV cache
            holds ``G`` heads. Default ``num_heads``: one key/value head per query head.
        window_size: each query sees only its last ``window_size`` keys, itself
            included (sliding-window attention; causal only). Its KV cache is a
            ring of ``window_size`` positions, so decoding can go on past
            ``context_length`` in constant memory.
        rope: rotate queries and keys by their absolute positions (rotary
            position embedding, "rotate half" as in Llama and GPT-NeoX); with a
            KV cache, positions continue from the cache's. ``rope_base`` sets the
            frequencies (default 10,000) and ``rope_scaling`` their stretching past the
            trained context (see :func:`qkv.positional.check_rope_scaling`).
        head_dim: size of each head, when it is not ``d_out // num_heads`` (Gemma,
            Qwen3): the query projection is then ``num_heads * head_dim`` wide, the key
            and value ones ``num_kv_groups * head_dim``, and ``out_proj`` maps the
            heads back to ``d_out``.
        q_norm, k_norm: modules applied to each query and key head ``(..., head_dim)``
            after the projection, before RoPE ("QK-norm": Qwen3, Gemma 3); None: none.
            ``v_norm`` likewise on each value head (Gemma 4: an RMSNorm without scale).
        values_from_keys: the values are the keys' projection before ``k_norm`` and
            RoPE (Gemma 4's ``attention_k_eq_v`` full layers); there is no ``W_value``.
        scale: the factor on ``q k^T``; default ``1 / sqrt(head_dim)`` (Gemma's is
            ``query_pre_attn_scalar ** -0.5``).

    ``window_size`` and ``rope`` apply to self-attention only.

    Parameters are created in the order ``W_query, W_key, W_value, out_proj`` (then
    the norms', if given).

    Shapes:
        ``x (batch, T_q, d_in) -> (batch, T_q, d_out)``; with
        ``need_weights=True`` also the weights ``(batch, num_heads, T_q, T_k)``.

    Taps: ``tap`` is None, or a callable ``tap(name, tensor) -> tensor`` with a set
    ``tap.names`` of the points it wants (:data:`qkv.options.CAPTURE_POINTS`'s attention
    points: ``q``, ``k``, ``v``, ``scores``, ``weights``, ``head_out``); qkv.heads sets it
    to record them or to replace ``q``, ``k``, ``v`` and ``head_out`` with what it
    returns. ``scores`` and ``weights`` are computed beside the kernel, only when
    wanted, and only read (``tap_read_only``): the output still comes from this layer's
    backend, so a recorded call gives the logits an unrecorded one gives.

    Padding: pass either ``valid_lens`` (d2l's form: ``(batch,)`` or
    ``(batch, T_q)``, keys at index ``>= valid_len`` are ignored) or
    ``key_padding_mask`` (``(batch, T_k)`` bool, **True = padding, ignored**, as
    in :class:`torch.nn.MultiheadAttention`). A query left with no key to attend
    to outputs zeros (before ``out_proj``'s bias), never NaN.
    """

    # The taps it has (see "Taps" above); qkv.heads reads these.
    tap_points = ATTENTION_POINTS
    tap_read_only = frozenset({"scores", "weights"})

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int | None = None,
        dropout: float = 0.0,
        num_heads: int = 1,
        qkv_bias: bool = False,
        *,
        causal: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        out_bias: bool = True,
        backend: str = "fused",
        num_kv_groups: int | None = None,
        window_size: int | None = None,
        rope: bool = False,
        rope_base: float = 10_000.0,
        rope_scaling: dict[str, Any] | None = None,
        head_dim: int | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        scale: float | None = None,
        v_norm: nn.Module | None = None,
        values_from_keys: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("d_in", d_in)
        if head_dim is None:
            check_heads(d_out, num_heads)
            head_dim = d_out // num_heads
        else:
            check_positive_int("d_out", d_out)
            check_positive_int("num_heads", num_heads)
            check_positive_int("head_dim", head_dim)
        for name, size in (("kdim", kdim), ("vdim", vdim)):
            if size is not None:
                check_positive_int(name, size)
        check_dropout(dropout)
        if context_length is not None:
            check_positive_int("context_length", context_length, "integer or None")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        num_kv_groups = num_heads if num_kv_groups is None else num_kv_groups
        check_positive_int("num_kv_groups", num_kv_groups)
        if num_heads % num_kv_groups:
            raise ValueError(f"num_kv_groups ({num_kv_groups}) must divide num_heads "
                             f"({num_heads}); e.g. 1 (MQA) or {num_heads} (one per head)")
        if window_size is not None:
            check_positive_int("window_size", window_size, "number of tokens or None")
            if not causal:
                raise ValueError("window_size needs causal=True: each query sees its last "
                                 "window_size tokens")
        check_bool("rope", rope)
        check_float("rope_base", rope_base, 1.0, lo_open=True)
        rope_scaling = check_rope_scaling(rope_scaling)
        if rope and head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        if scale is not None:
            scale = check_float("scale", scale, 0.0, lo_open=True)
        check_bool("values_from_keys", values_from_keys)
        if values_from_keys and (kdim not in (None, vdim) or vdim not in (None, d_in)):
            raise ValueError("values_from_keys takes the values from the keys' projection: "
                             "self-attention only (kdim and vdim left out)")
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm), ("v_norm", v_norm)):
            if norm is not None and not isinstance(norm, nn.Module):
                raise ValueError(f"{name} must be an nn.Module or None, got "
                                 f"{type(norm).__name__}")
        self.num_kv_groups = num_kv_groups
        self.window_size = window_size
        self.rope, self.rope_base, self.rope_scaling = rope, float(rope_base), rope_scaling
        self.scale = scale
        self.d_in, self.d_out = d_in, d_out
        self.kdim = d_in if kdim is None else kdim
        self.vdim = d_in if vdim is None else vdim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.inner_dim = num_heads * head_dim  # the query heads side by side
        self.context_length = context_length
        self.causal = causal
        self.backend = backend

        kv_out = num_kv_groups * self.head_dim
        self.W_query = nn.Linear(d_in, self.inner_dim, bias=qkv_bias)
        self.W_key = nn.Linear(self.kdim, kv_out, bias=qkv_bias)
        # (None with values_from_keys: the keys' projection is the values' too)
        self.W_value = (None if values_from_keys
                        else nn.Linear(self.vdim, kv_out, bias=qkv_bias))
        self.out_proj = nn.Linear(self.inner_dim, d_out, bias=out_bias)
        self.dropout = nn.Dropout(dropout)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.v_norm = v_norm
        self._rope_table = RopeTable(context_length)
        self.tap: Any = None  # see "Taps" above

    def _split_heads(self, x: Tensor) -> Tensor:
        # (b, T, heads * head_dim) -> (b, heads, T, head_dim): heads become a batch axis
        b, t, width = x.shape
        return x.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2)

    def _key_mask(
        self,
        valid_lens: Tensor | None,
        key_padding_mask: Tensor | None,
        batch: int,
        num_queries: int,
        num_keys: int,
        device: torch.device,
    ) -> Tensor | None:
        """Keep mask ``(batch, 1, 1 or T_q, T_k)`` on ``device`` (the queries'), from either
        padding form."""
        if valid_lens is not None and key_padding_mask is not None:
            raise ValueError("pass valid_lens or key_padding_mask, not both")
        if valid_lens is not None:
            check_valid_lens(valid_lens, batch, num_queries, num_keys)
            # The queries' device, not a weight's: a lazy projection (d2l's, in qkv.d2l)
            # has no device until the first call sizes it.
            valid_lens = valid_lens.to(device)
            return lengths_to_mask(valid_lens, num_keys).unsqueeze(1)
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, Tensor):
                raise TypeError(
                    f"key_padding_mask must be a bool tensor of shape ({batch}, {num_keys}), "
                    f"got {type(key_padding_mask).__name__}"
                )
            if key_padding_mask.shape != (batch, num_keys):
                raise ValueError(
                    f"key_padding_mask must have shape ({batch}, {num_keys}), "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            if key_padding_mask.dtype != torch.bool:
                raise ValueError(
                    f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}"
                )
            return ~key_padding_mask[:, None, None, :]
        return None

    def forward(
        self,
        x: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        valid_lens: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to itself, or to ``key``/``value`` (cross-attention).

        Args:
            x: queries ``(batch, T_q, d_in)``.
            key: ``(batch, T_k, kdim)``; None means self-attention on ``x``.
            value: ``(batch, T_k, vdim)``; None means ``value = key``.
            valid_lens / key_padding_mask: padding, see the class docstring.
            need_weights: also return the weights ``(batch, heads, T_q, T_k)``
                (with a ring cache and one new token, ``T_k`` follows the ring's
                slots, not time).
            cache: a :class:`KVCache` (:meth:`new_cache`); the new keys and values
                are appended and the queries attend to everything stored
                (self-attention).

        Returns:
            ``(batch, T_q, d_out)``, or ``(output, weights)`` with ``need_weights``.
        """
        past = cache.pos if cache is not None else 0
        ring = cache is not None and cache.ring
        key, value, mask = self._prepare(x, key, value, valid_lens=valid_lens,
                                         key_padding_mask=key_padding_mask, past=past, ring=ring)
        q = self._split_heads(self.W_query(x))
        out, weights = self._attend_heads(q, key, value, cache=cache, past=past, mask=mask,
                                          ring=ring, need_weights=need_weights)
        out = self.out_proj(self._tap_heads(self._merge_heads(out)))
        return (out, weights) if need_weights else out

    # The steps of forward that the attention classes built on this one share
    # (qkv.attention_variants): each writes its own forward from them.

    def _prepare(self, x: Tensor, key: Tensor | None, value: Tensor | None, *,
                 valid_lens: Tensor | None, key_padding_mask: Tensor | None, past: int,
                 ring: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """Check a call before any projection runs; return ``key`` and ``value`` (``x``
        for self-attention) and the padding's keep mask ``(batch, 1, 1 or T_q, T_k)`` or
        None. ``past``: tokens already cached; ``ring``: the cache is a ring."""
        _check_input("x", x, self.d_in)
        batch, num_queries, _ = x.shape
        if (self.rope or self.window_size is not None) and (key is not None or
                                                             value is not None):
            raise ValueError("rope and window_size apply to self-attention only; this "
                             "layer was called with key/value (cross-attention)")
        if key is None:
            key = x if value is None else value
        value = key if value is None else value
        _check_input("key", key, self.kdim)
        _check_input("value", value, self.vdim)
        if key.shape[:2] != value.shape[:2] or key.shape[0] != batch:
            raise ValueError(
                f"x {tuple(x.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                "must share the batch size, and key and value the number of tokens"
            )
        # A ring cache forgets what left the window, so only the new tokens count.
        span = num_queries if ring else past + num_queries
        if self.context_length is not None and span > self.context_length:
            raise ValueError(
                f"sequence of {span} tokens is longer than "
                f"context_length={self.context_length}"
            )
        if ring and (valid_lens is not None or key_padding_mask is not None):
            raise ValueError("padding masks index keys by position; a ring cache does not "
                             "keep them in order: pad nothing, or use a plain cache")
        # With a cache the keys are the stored ones followed by the new.
        mask = self._key_mask(valid_lens, key_padding_mask, batch, num_queries,
                              past + key.shape[1], x.device)
        return key, value, mask

    def _attend_heads(self, q: Tensor, key: Tensor, value: Tensor, *,
                      cache: KVCache | None, past: int, mask: Tensor | None, ring: bool,
                      need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Everything between the query projection and the heads' merge: the queries
        ``q (batch, heads, T_q, head_dim)`` attend to ``key``/``value`` (as
        :meth:`_prepare` returns them) projected into heads, after QK-norm and RoPE, and
        to the cache's keys and values before them. Returns the heads' outputs
        ``(batch, heads, T_q, head_dim)`` and the weights, as :meth:`_attend`."""
        k = self._split_heads(self.W_key(key))
        v = k if self.W_value is None else self._split_heads(self.W_value(value))
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        if self.rope:  # rotated at their absolute positions, before they are cached
            q, k = self._rotate(q, past), self._rotate(k, past)
        if self.tap is not None:
            q, k, v = self._tap_inputs(q, k, v)
        if cache is not None:
            k, v = cache.append(k, v)
        return self._attend_tapped(q, k, v, mask=mask, ring=ring, need_weights=need_weights)

    def _rotate(self, t: Tensor, past: int) -> Tensor:
        """RoPE on queries or keys ``t (batch, heads, T, head_dim)`` at positions ``past,
        past + 1, ...``."""
        cos, sin = self._rope_table(past + t.shape[-2], self.head_dim, self.rope_base,
                                    self.rope_scaling, t.dtype, t.device)
        return apply_rope(t, cos[past:], sin[past:])

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, ring: bool,
                need_weights: bool, **kernel: Any) -> tuple[Tensor, Tensor | None]:
        """The kernel on ``q (batch, heads, T_q, head_dim)`` and the keys and values
        ``(batch, kv_heads, T_k, head_dim)`` to attend to, with this layer's causality,
        window, scale, dropout and backend; ``kernel``: more of
        :func:`qkv.functional.attention`'s arguments. Returns ``(batch, heads, T_q,
        head_dim)`` and the weights (with ``need_weights`` or the eager backend)."""
        # One new token against a ring sees every slot: all are in its window, in slot
        # order, where a band drawn by position would be wrong.
        window = None if ring and q.shape[-2] == 1 else self.window_size
        return attention(
            q,
            k,
            v,
            mask=mask,
            causal=self.causal,
            dropout_p=self.dropout.p if self.training else 0.0,
            need_weights=need_weights or self.backend == "eager",
            window=window,
            scale=self.scale,
            **kernel,
        )

    def _tap_inputs(self, q: Tensor, k: Tensor | None, v: Tensor | None
                    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``self.tap``'s ``q``, ``k`` and ``v`` (the new tokens' keys and values, before
        the cache; None for a layer that has none of its own): each passed to the tap
        if it wants it, and replaced by what it returns."""
        names = self.tap.names
        if "q" in names:
            q = self.tap("q", q)
        if k is not None and "k" in names:
            k = self.tap("k", k)
        if v is not None and "v" in names:
            v = self.tap("v", v)
        return q, k, v

    def _attend_tapped(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None,
                       ring: bool, need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """:meth:`_attend`, then the ``scores`` and ``weights`` a tap wants, computed beside
        it (the eager kernel's weights, :func:`qkv.functional.attention_logits`'s
        scores) so that the output is the backend's, recorded or not."""
        out, weights = self._attend(q, k, v, mask=mask, ring=ring, need_weights=need_weights)
        tap = self.tap
        if tap is not None and "weights" in tap.names:
            if weights is None:
                weights = self._attend(q, k, v, mask=mask, ring=ring, need_weights=True)[1]
            tap("weights", weights)
            weights = weights if need_weights else None
        if tap is not None and "scores" in tap.names:
            window = None if ring and q.shape[-2] == 1 else self.window_size
            tap("scores", attention_logits(q, k, mask=mask, causal=self.causal, window=window,
                                           scale=self.scale))
        return out, weights

    def _tap_heads(self, merged: Tensor) -> Tensor:
        """``merged (batch, T, heads * head_dim)``, the heads' outputs side by side, through
        ``self.tap``'s ``head_out`` as ``(batch, T, heads, head_dim)``."""
        if self.tap is None or "head_out" not in self.tap.names:
            return merged
        batch, num_queries, _ = merged.shape
        heads = merged.view(batch, num_queries, self.num_heads, self.head_dim)
        return self.tap("head_out", heads).reshape(batch, num_queries, self.inner_dim)

    def _merge_heads(self, out: Tensor) -> Tensor:
        # (b, heads, T, head_dim) -> (b, T, heads * head_dim)
        batch, _, num_queries, _ = out.shape
        return out.transpose(1, 2).reshape(batch, num_queries, self.inner_dim)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """A :class:`KVCache` for this layer: its ``num_kv_groups`` heads, and
        ``max_len`` positions (default: ``context_length``), or with ``window_size`` a
        ring of ``window_size`` positions, whatever ``max_len`` says: all a query can
        see."""
        max_len = self.context_length if max_len is None else max_len
        if self.window_size is not None:
            max_len = self.window_size
        if max_len is None:
            raise ValueError("this layer has no context_length; pass max_len to new_cache()")
        weight = self.W_key.weight
        return KVCache(
            batch_size,
            self.num_kv_groups,
            max_len,
            self.head_dim,
            dtype=weight.dtype,
            device=weight.device,
            ring=self.window_size is not None,
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args, **kwargs):
        # The book's layer stores its causal mask as a buffer; this one builds
        # masks on the fly, so accept (and drop) that key from book checkpoints.
        state_dict.pop(prefix + "mask", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}, "
            f"context_length={self.context_length}, causal={self.causal}, "
            f"backend={self.backend!r}"
            + (f", num_kv_groups={self.num_kv_groups}"
               if self.num_kv_groups != self.num_heads else "")
            + (f", window_size={self.window_size}" if self.window_size is not None else "")
            + (f", rope=True, rope_base={self.rope_base:g}" if self.rope else "")
            + (f", rope_scaling={self.rope_scaling}" if self.rope_scaling else "")
            + (f", head_dim={self.head_dim}" if self.inner_dim != self.d_out else "")
            + (f", scale={self.scale:g}" if self.scale is not None else "")
            + (", values_from_keys=True" if self.W_value is None else "")
        )
