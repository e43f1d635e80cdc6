"""Attention as the models of 2025-26 run it: each mechanism its own class beside
:class:`~qkv.multihead.MultiHeadAttention`, built on the same kernel
(:func:`qkv.functional.attention`) and the same cache protocol.

- :class:`SinkAttention` (gpt-oss): one learned logit per head joins the softmax's
  denominator, so a head may give part of its attention to nothing;
- :class:`GatedAttention` (Qwen3-Next, Qwen3.5's full-attention layers): a sigmoid gate,
  projected with the query, scales each head's output before ``out_proj``; RoPE may
  turn only part of each head (``rotary_dim``);
- :class:`SharedKVAttention` (Gemma 4's ``num_kv_shared_layers``): a layer with queries
  only, attending with the keys and values an earlier layer computed and cached, handed
  over by a :class:`KVHandoff`.

A layer without RoPE ("NoPE": SmolLM3's every fourth layer, Llama 4's global layers) is
a plain ``MultiHeadAttention(..., rope=False)``: nothing new is needed.

The cache protocol: a layer's ``cache`` is anything with ``pos`` (tokens seen so far),
``ring`` (a sliding-window ring) and ``append(keys, values)``, which stores the new keys
and values ``(batch, kv_heads, T_new, head_dim)`` and returns those the new queries attend
to. :class:`~qkv.kv_cache.KVCache` is one; :class:`KVHandoff` wraps one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .checks import check_positive_int
from .kv_cache import KVCache
from .multihead import MultiHeadAttention
from .positional import apply_rope, rope_angles

__all__ = ["SinkAttention", "GatedAttention", "SharedKVAttention", "KVHandoff",
           "rotate_partial"]


class SinkAttention(MultiHeadAttention):
    r"""Multi-head attention with a learned attention sink per head (gpt-oss).

    .. math::
        w_{ij} = \frac{e^{s_{ij}}}{\sum_{j'} e^{s_{ij'}} + e^{\sigma_h}}, \quad
        s_{ij} = q_i \cdot k_j \cdot \text{scale}

    The sink ``sigma_h`` is one more logit in head ``h``'s softmax with no value behind
    it: a query's weights over the real keys sum to less than one, the rest goes
    nowhere. It lets a head stay quiet without piling its weight on the first token.

    Takes :class:`~qkv.multihead.MultiHeadAttention`'s arguments (gpt-oss: ``qkv_bias``
    and ``out_bias`` on, ``rope`` on, ``window_size`` on every other layer); adds the
    parameter ``sinks (num_heads,)``, created after the others and starting at zero.

    Shapes: ``x (batch, T_q, d_in) -> (batch, T_q, d_out)``; with ``need_weights`` also
    the weights ``(batch, num_heads, T_q, T_k)``, whose rows sum to less than one.
    """

    # What its attention weights are, for a page that draws them (qkv view).
    weights_note = ("learned sinks: each row sums to less than 1, the rest of the weight "
                    "goes to the head's sink logit, no token")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, **options: Any
                ) -> tuple[Tensor, Tensor | None]:
        # Everything MultiHeadAttention computes, with the sinks in the softmax.
        return super()._attend(q, k, v, sinks=self.sinks, **options)


def rotate_partial(x: Tensor, past: int, rotary_dim: int, base: float = 10_000.0,
                   scaling: dict[str, Any] | None = None) -> Tensor:
    """Partial RoPE: turn the first ``rotary_dim`` dimensions of each head of ``x (...,
    T, head_dim)`` by the rotary embedding of a ``rotary_dim``-wide head at positions
    ``past, past + 1, ...`` (frequencies ``base^(-2i / rotary_dim)``, "rotate half" within
    them); the other ``head_dim - rotary_dim`` dimensions pass unchanged. Qwen3-Next's
    ``partial_rotary_factor`` is ``rotary_dim / head_dim``."""
    positions = torch.arange(past, past + x.shape[-2], device=x.device)
    cos, sin = rope_angles(positions, rotary_dim, base, scaling)
    turned = apply_rope(x[..., :rotary_dim], cos, sin)
    return torch.cat((turned, x[..., rotary_dim:]), dim=-1)


class GatedAttention(MultiHeadAttention):
    r"""Multi-head attention with a sigmoid output gate (Qwen3-Next, Qwen3.5).

    .. math::
        [q_h \,|\, g_h] = x W_{q,h}, \quad
        o_h = \text{attention}(q_h, K_h, V_h) \odot \sigma(g_h), \quad
        \text{out} = \text{concat}(o_1, \dots, o_H) W_o

    The query projection is twice as wide: head ``h``'s slice of ``W_query``'s output
    is its query (``head_dim``) followed by its gate (``head_dim``), the layout of
    Hugging Face's ``q_proj``, so those weights load unchanged. The gate, a function of
    the token alone, lets a head switch its output off (the softmax cannot: its weights
    always sum to one).

    Takes :class:`~qkv.multihead.MultiHeadAttention`'s arguments (Qwen3-Next: RoPE,
    ``q_norm`` and ``k_norm``) and:

    Args:
        rotary_dim: with ``rope``, how many of each head's dimensions turn (the first
            ones; default all). Qwen3-Next turns a quarter: ``partial_rotary_factor *
            head_dim``. See :func:`rotate_partial`.

    Shapes: ``x (batch, T_q, d_in) -> (batch, T_q, d_out)``; with ``need_weights`` also
    the weights ``(batch, num_heads, T_q, T_k)`` (before the gate).
    """

    def __init__(self, *args: Any, rotary_dim: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if rotary_dim is not None:
            check_positive_int("rotary_dim", rotary_dim)
            if not self.rope or rotary_dim % 2 or rotary_dim > self.head_dim:
                raise ValueError(f"rotary_dim must be an even number of dimensions up to "
                                 f"head_dim={self.head_dim}, with rope=True; got "
                                 f"{rotary_dim} (rope={self.rope})")
        self.rotary_dim = self.head_dim if rotary_dim is None else rotary_dim
        # Each head's query and its gate, side by side.
        self.W_query = nn.Linear(self.d_in, 2 * self.inner_dim,
                                 bias=self.W_query.bias is not None)

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
        """As :meth:`MultiHeadAttention.forward`, the heads' outputs gated."""
        past = cache.pos if cache is not None else 0
        ring = cache is not None and cache.ring
        key, value, mask = self._prepare(x, key, value, valid_lens=valid_lens,
                                         key_padding_mask=key_padding_mask, past=past, ring=ring)
        batch, num_queries, _ = x.shape
        # (b, T, heads * 2 * head_dim) -> query and gate, each (b, T, heads, head_dim)
        q, gate = self.W_query(x).view(batch, num_queries, self.num_heads, 2,
                                       self.head_dim).unbind(dim=3)
        out, weights = self._attend_heads(q.transpose(1, 2), key, value, cache=cache,
                                          past=past, mask=mask, ring=ring,
                                          need_weights=need_weights)
        # (b, T, heads * head_dim), each head's output scaled by its gate in (0, 1)
        out = self._merge_heads(out) * torch.sigmoid(gate.reshape(batch, num_queries, -1))
        out = self.out_proj(self._tap_heads(out))
        return (out, weights) if need_weights else out

    def _rotate(self, t: Tensor, past: int) -> Tensor:
        # rotate_partial, on the layer's kept table of rotary_dim-wide angles
        cos, sin = self._rope_table(past + t.shape[-2], self.rotary_dim, self.rope_base,
                                    self.rope_scaling, t.dtype, t.device)
        turned = apply_rope(t[..., :self.rotary_dim], cos[past:], sin[past:])
        return torch.cat((turned, t[..., self.rotary_dim:]), dim=-1)

    def extra_repr(self) -> str:
        partial = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        return super().extra_repr() + ", gated=True" + partial


class KVHandoff:
    """The keys and values a layer attended with, handed to the later layers that share
    them (Gemma 4's KV sharing).

    A handoff is the source layer's ``cache`` for one forward pass: pass
    ``KVHandoff(cache)`` (the source's own :class:`~qkv.kv_cache.KVCache` while decoding,
    nothing in a full forward) as the source layer's ``cache``. Its :meth:`append` stores
    the new keys and values in the wrapped cache, if any, and keeps what the source's
    queries attend to; each :class:`SharedKVAttention` of the same kind then takes the
    handoff as ``shared`` and attends with exactly those keys and values. Only the
    source layer has a cache: the keys and values are held once.

    Attributes:
        keys, values: ``(batch, kv_heads, T_k, head_dim)`` from the source's last call
            (None before it).
        past: tokens cached before that call (the position of its first new token).
        new: tokens in that call.
    """

    def __init__(self, cache: KVCache | None = None) -> None:
        self.cache = cache
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.past = 0
        self.new = 0

    @property
    def pos(self) -> int:
        """Tokens seen so far: the wrapped cache's, or 0 in a full forward."""
        return self.cache.pos if self.cache is not None else 0

    @property
    def ring(self) -> bool:
        return self.cache is not None and self.cache.ring

    @property
    def window(self) -> int | None:
        """The ring's size (the source's window) or None."""
        return self.cache.max_len if self.cache is not None and self.cache.ring else None

    def append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The cache protocol: store ``(batch, kv_heads, T_new, head_dim)`` keys and
        values in the wrapped cache (if any); return, and keep, what the new queries
        attend to."""
        self.past, self.new = self.pos, keys.shape[2]
        if self.cache is not None:
            keys, values = self.cache.append(keys, values)
        self.keys, self.values = keys, values
        return keys, values

    def __repr__(self) -> str:
        held = "empty" if self.keys is None else f"keys {tuple(self.keys.shape)}"
        return f"KVHandoff({held}, past={self.past}, new={self.new}, cache={self.cache!r})"


class SharedKVAttention(MultiHeadAttention):
    r"""Attention with queries of its own and the keys and values of an earlier layer
    (Gemma 4's ``num_kv_shared_layers``).

    .. math::
        \text{out} = \text{concat}_h\big(\text{softmax}(q_h K_{g(h)}^\top \cdot
        \text{scale})\, V_{g(h)}\big) W_o, \quad q = \text{rope}(\text{norm}(x W_q))

    where ``K, V`` are the source layer's, handed over by a :class:`KVHandoff`. The layer
    has ``W_query``, ``out_proj`` and ``q_norm`` only; it computes no keys or values and
    caches nothing (:meth:`new_cache` is None), so a model of ``L`` layers of which ``S``
    share keeps ``L - S`` layers' keys and values.

    Takes :class:`~qkv.multihead.MultiHeadAttention`'s arguments less those of keys and
    values (``kdim``, ``vdim``, ``k_norm``). ``num_kv_groups`` and ``head_dim`` must be
    the source's; ``window_size`` too when the source decodes with a ring (Gemma 4
    shares within a kind: sliding with sliding, full with full). With ``rope`` the
    queries turn at the same positions as the source's keys.

    Shapes: ``x (batch, T_q, d_in)`` and a handoff whose source saw the same ``T_q``
    tokens ``-> (batch, T_q, d_out)``; with ``need_weights`` also ``(batch, num_heads,
    T_q, T_k)``.
    """

    # What its attention weights are, for a page that draws them (qkv view).
    weights_note = ("shared keys and values: these layers attend with an earlier "
                    "layer's cached keys and values")

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
        out_bias: bool = True,
        backend: str = "fused",
        num_kv_groups: int | None = None,
        window_size: int | None = None,
        rope: bool = False,
        rope_base: float = 10_000.0,
        rope_scaling: dict[str, Any] | None = None,
        head_dim: int | None = None,
        q_norm: nn.Module | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias,
                         causal=causal, out_bias=out_bias, backend=backend,
                         num_kv_groups=num_kv_groups, window_size=window_size, rope=rope,
                         rope_base=rope_base, rope_scaling=rope_scaling, head_dim=head_dim,
                         q_norm=q_norm, scale=scale)
        # Keys and values come from the source layer: no projections of their own.
        del self.W_key, self.W_value

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        shared: KVHandoff,
        *,
        valid_lens: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` with the keys and values in ``shared``.

        Args:
            x: queries ``(batch, T_q, d_in)``, the same tokens the source layer saw in
                the call that filled ``shared``.
            shared: the :class:`KVHandoff` the source layer just used as its cache.
            valid_lens / key_padding_mask: padding, as for the source layer.
            need_weights: also return the weights ``(batch, heads, T_q, T_k)``.
        """
        if not isinstance(shared, KVHandoff):
            raise TypeError(f"shared must be the KVHandoff its source layer used as its "
                            f"cache, got {type(shared).__name__}")
        keys, values = shared.keys, shared.values
        if keys is None or values is None:
            raise ValueError("shared holds no keys yet: run the source layer first, with "
                             "the KVHandoff as its cache")
        _, _, mask = self._prepare(x, None, None, valid_lens=valid_lens,
                                   key_padding_mask=key_padding_mask, past=shared.past,
                                   ring=shared.ring)
        batch, num_queries, _ = x.shape
        want = (batch, self.num_kv_groups, self.head_dim, self.head_dim, num_queries)
        got = (keys.shape[0], keys.shape[1], keys.shape[-1], values.shape[-1], shared.new)
        if got != want:
            raise ValueError(
                f"shared keys/values do not fit this layer: (batch, kv_heads, key width, "
                f"value width, new tokens) = {got}, this layer needs {want}")
        if shared.ring and shared.window != self.window_size:
            raise ValueError(f"the source layer caches a ring of {shared.window} tokens; "
                             f"this layer's window_size ({self.window_size}) must equal it")
        q = self._split_heads(self.W_query(x))
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.rope:
            q = self._rotate(q, shared.past)
        if self.tap is not None:
            q, _, _ = self._tap_inputs(q, None, None)  # the keys and values are the source's
        out, weights = self._attend_tapped(q, keys, values, mask=mask, ring=shared.ring,
                                           need_weights=need_weights)
        out = self.out_proj(self._tap_heads(self._merge_heads(out)))
        return (out, weights) if need_weights else out

    def new_cache(self, batch_size: int, max_len: int | None = None) -> None:  # type: ignore[override]
        """None: the keys and values this layer uses are cached by its source layer."""
        return None

    def extra_repr(self) -> str:
        return super().extra_repr() + ", keys and values: shared"
