"""d2l's attention modules, in the forms of both books' editions.

The English d2l 1.0.3 and the Chinese d2l-zh 2.0 give ``AdditiveAttention`` and
``MultiHeadAttention`` different signatures; each class here takes both and tells them
apart by how the call binds (:func:`bind_form`): the 1.0.3 form when the arguments fit
it, d2l-zh's otherwise. The 1.0.3 forms size their projections lazily
(``nn.LazyLinear``, from the first call), as d2l 1.0.3 does, so a seed draws the same
weights in the same order; d2l-zh's are ordinary ``nn.Linear`` of the given widths.

Each is a thin front on qkv's own module (:class:`qkv.DotProductAttention`,
:class:`qkv.AdditiveAttention`, :class:`qkv.MultiHeadAttention`) and keeps d2l's
conventions: a query whose valid length is 0 attends *uniformly* to all keys (qkv's
kernels give it zero weights), and the last weights stay on the module.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from .. import multihead, scoring
from ..checks import check_dropout, check_positive_int
from ..functional import check_valid_lens, masked_softmax

__all__ = [
    "DotProductAttention",
    "AdditiveAttention",
    "MultiHeadAttention",
    "transpose_qkv",
    "transpose_output",
    "bind_form",
]


def bind_form(
    name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], forms: Mapping[str, Callable]
) -> tuple[str, dict[str, Any]]:
    """Which of ``forms`` the call ``name(*args, **kwargs)`` fits, and its arguments.

    ``forms`` maps an edition (``"d2l"``, ``"d2l-zh"``) to a function whose signature is
    that edition's argument list; they are tried in order and the first that binds wins.
    Returns ``(edition, {argument: value})`` with the defaults filled in.

    Raises:
        TypeError: no form binds; one line with Python's complaint about the form the
            number of positional arguments points at, and every form's signature.
    """
    for edition, form in forms.items():
        try:
            bound = inspect.signature(form).bind(*args, **kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        return edition, dict(bound.arguments)
    # A keyword no form knows is the mistake to name; otherwise Python's complaint about
    # the first form with room for the positional arguments given.
    signatures = {edition: inspect.signature(form) for edition, form in forms.items()}
    known = {name for sig in signatures.values() for name in sig.parameters}
    unknown = [name for name in kwargs if name not in known]
    closest = list(forms)[-1]
    for edition, sig in signatures.items():
        positional = [p for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) <= len(positional):
            closest = edition
            break
    why = f"got an unexpected keyword argument {unknown[0]!r}" if unknown else ""
    try:
        signatures[closest].bind(*args, **kwargs)
    except TypeError as e:
        why = why or str(e)
    listed = " or ".join(f"{sig} ({edition})" for edition, sig in signatures.items())
    raise TypeError(f"{name}() {why}; it takes {listed}") from None


class DotProductAttention(scoring.DotProductAttention):
    """d2l's scaled dot-product attention.

    ``queries (batch, n_q, d)``, ``keys (batch, n_k, d)``, ``values (batch, n_k, d_v)``,
    ``valid_lens`` None, ``(batch,)`` or ``(batch, n_q)`` ``-> (batch, n_q, d_v)``;
    ``attention_weights (batch, n_q, n_k)`` from the last call, before dropout. A query
    with ``valid_len == 0`` attends uniformly to all keys, as in d2l.
    """

    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        scoring.check_same_width(queries, keys)
        scores = queries @ keys.transpose(1, 2) / math.sqrt(queries.shape[-1])
        self.attention_weights = masked_softmax(scores, valid_lens)
        return self.dropout(self.attention_weights) @ values


def _additive_d2l(num_hiddens, dropout=0.0): ...  # d2l 1.0.3


def _additive_zh(key_size, query_size, num_hiddens, dropout=0.0): ...  # d2l-zh, d2l 0.17


class AdditiveAttention(scoring.AdditiveAttention):
    """d2l's additive (Bahdanau) attention, in either of d2l's two forms.

    - ``AdditiveAttention(num_hiddens, dropout)`` (d2l 1.0.3): ``W_k``, ``W_q`` and
      ``w_v`` are bias-free :class:`torch.nn.LazyLinear` layers whose input widths are
      taken from the first call (or from a loaded ``state_dict``);
    - ``AdditiveAttention(key_size, query_size, num_hiddens, dropout)`` (d2l-zh, d2l
      0.17): the widths are given, the layers are ordinary bias-free ``nn.Linear``.

    The form is told by the arguments (:func:`bind_form`): three or more positional ones,
    or ``key_size`` / ``query_size`` by keyword, select the second. ``dropout`` defaults
    to 0 in both.

    ``queries (batch, n_q, query_size)``, ``keys (batch, n_k, key_size)``,
    ``values (batch, n_k, d_v)``, ``valid_lens`` None, ``(batch,)`` or ``(batch, n_q)``
    ``-> (batch, n_q, d_v)``; ``attention_weights (batch, n_q, n_k)``. A query with
    ``valid_len == 0`` attends uniformly, as in d2l.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        form, a = bind_form("AdditiveAttention", args, kwargs,
                            {"d2l": _additive_d2l, "d2l-zh": _additive_zh})
        if form == "d2l-zh":
            super().__init__(**a)
            return
        nn.Module.__init__(self)  # the parent's __init__ needs the widths up front
        check_positive_int("num_hiddens", a["num_hiddens"])
        check_dropout(a["dropout"])
        # Created in d2l's order; sized (and initialised) on the first call.
        self.W_k = nn.LazyLinear(a["num_hiddens"], bias=False)
        self.W_q = nn.LazyLinear(a["num_hiddens"], bias=False)
        self.w_v = nn.LazyLinear(1, bias=False)
        self.dropout = nn.Dropout(a["dropout"])
        self.attention_weights = None

    def forward(  # type: ignore[override]
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        # (batch, n_q, 1, h) + (batch, 1, n_k, h): every query meets every key
        features = torch.tanh(self.W_q(queries).unsqueeze(2) + self.W_k(keys).unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return self.dropout(self.attention_weights) @ values


def transpose_qkv(X: Tensor, num_heads: int) -> Tensor:
    """Fold the heads into the batch: ``(batch, n, num_heads * d) -> (batch * num_heads,
    n, d)``, head ``j`` of example ``i`` at row ``i * num_heads + j``."""
    batch, n, _ = X.shape
    return X.reshape(batch, n, num_heads, -1).transpose(1, 2).reshape(batch * num_heads, n, -1)


def transpose_output(X: Tensor, num_heads: int) -> Tensor:
    """Undo :func:`transpose_qkv`: ``(batch * num_heads, n, d) -> (batch, n, num_heads *
    d)``, the heads side by side."""
    _, n, d = X.shape
    return X.reshape(-1, num_heads, n, d).transpose(1, 2).reshape(-1, n, num_heads * d)


def _mha_d2l(num_hiddens, num_heads, dropout=0.0, bias=False, *,  # d2l 1.0.3
             query_size=None, key_size=None, value_size=None): ...


def _mha_zh(key_size, query_size, value_size, num_hiddens, num_heads,  # d2l-zh
            dropout=0.0, bias=False): ...


# qkv.MultiHeadAttention's layer -> d2l's name for it
_D2L_NAMES = {"W_query": "W_q", "W_key": "W_k", "W_value": "W_v", "out_proj": "W_o"}


class MultiHeadAttention(multihead.MultiHeadAttention):
    """d2l's multi-head attention, in either book's form.

    - ``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)`` (d2l 1.0.3):
      the four projections are :class:`torch.nn.LazyLinear`, their input widths taken
      from the first call (or a loaded ``state_dict``), as d2l's. qkv adds keyword-only
      ``query_size``, ``key_size``, ``value_size``: given any, the projections are sized
      when built, the others ``num_hiddens`` wide;
    - ``MultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads,
      dropout, bias=False)`` (d2l-zh): ordinary ``nn.Linear`` of the given widths.

    The call picks the form (:func:`bind_form`): up to four positional arguments are
    d2l 1.0.3's, five or more d2l-zh's. ``dropout`` defaults to 0 in both; ``bias`` is on
    all four projections.

    Built on the one :class:`qkv.MultiHeadAttention` (non-causal, cross-attention
    capable), whose modules it names as d2l does, in d2l's order: ``attention`` (a
    :class:`DotProductAttention`, whose ``dropout`` is the layer's), ``W_q``, ``W_k``,
    ``W_v``, ``W_o``, so it prints, saves and loads as d2l's; ``W_query``, ``W_key``,
    ``W_value``, ``out_proj`` and ``dropout`` name the same modules for the parent. The
    projections are created (or, lazy, initialised on the first call) in d2l's order with
    d2l's shapes, so a seed gives d2l's weights.

    ``backend`` (an attribute, default ``"d2l"``) picks the arithmetic:

    - ``"d2l"``: the book's, step for step: heads folded into the batch
      (:func:`transpose_qkv`), ``valid_lens`` repeated per head, :class:`DotProductAttention`,
      :func:`transpose_output`, ``W_o``. The same operations in the same order give the
      same floats as d2l's package, so training follows the book's numbers bit for bit;
    - ``"qkv"``: the parent's forward, heads on their own axis and ``valid_lens``
      broadcast over it, which computes the same function to rounding (a test checks
      they agree) and draws the same dropout. A query with ``valid_len == 0`` attends
      uniformly to all keys there too (the parent gives it zero weights; the difference
      is added back for those rows only).

    ``queries (batch, n_q, query_size)``, ``keys (batch, n_k, key_size)``,
    ``values (batch, n_k, value_size)`` ``-> (batch, n_q, num_hiddens)``. Every call
    keeps its weights (before dropout) in two layouts, the same numbers:
    ``attention.attention_weights (batch * num_heads, n_q, n_k)``, d2l's, which the
    books' Transformer reads, and ``attention_weights (batch, num_heads, n_q, n_k)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        form, a = bind_form("MultiHeadAttention", args, kwargs,
                            {"d2l": _mha_d2l, "d2l-zh": _mha_zh})
        num_hiddens, num_heads, dropout = a["num_hiddens"], a["num_heads"], a["dropout"]
        # d2l's names in the messages: the parent would call them d_out, d_in, kdim, vdim.
        multihead.check_heads(num_hiddens, num_heads, name="num_hiddens")
        sizes = {name: a[name] for name in ("query_size", "key_size", "value_size")}
        for name, size in sizes.items():
            if size is not None or form == "d2l-zh":
                check_positive_int(name, size)
        check_dropout(dropout)
        lazy = all(size is None for size in sizes.values())
        widths = {name: num_hiddens if size is None else size for name, size in sizes.items()}
        # Lazy: the parent's layers are built on the meta device, which draws no random
        # numbers, and replaced below by lazy ones that draw theirs on the first call.
        with torch.device("meta") if lazy else contextlib.nullcontext():
            super().__init__(
                widths["query_size"], num_hiddens, None, dropout, num_heads,
                qkv_bias=a["bias"], causal=False, kdim=widths["key_size"],
                vdim=widths["value_size"], out_bias=a["bias"],
            )
        # The parent's modules under d2l's names and in d2l's order (attention, W_q, W_k,
        # W_v, W_o), so the layer prints, saves and loads as d2l's; the parent reaches them
        # through the properties below.
        layers = {d2l: self._modules.pop(qkv) for qkv, d2l in _D2L_NAMES.items()}
        del self._modules["dropout"]
        self.attention = DotProductAttention(dropout)
        for name, layer in layers.items():
            setattr(self, name, nn.LazyLinear(num_hiddens, bias=a["bias"]) if lazy else layer)
        self.num_hiddens = num_hiddens
        self.attention_weights: Tensor | None = None
        self.backend = "d2l"

    # qkv.MultiHeadAttention's names for d2l's layers.
    W_query = property(lambda self: self.W_q)
    W_key = property(lambda self: self.W_k)
    W_value = property(lambda self: self.W_v)
    out_proj = property(lambda self: self.W_o)
    dropout = property(lambda self: self.attention.dropout)

    def extra_repr(self) -> str:
        return ""  # as d2l's, which prints its sub-modules only

    def forward(  # type: ignore[override]
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        # A lazy projection takes its width from this call, so the parent's shape checks
        # must expect it; once sized, it is an nn.Linear and its width is fixed.
        for attr, layer, x in (("d_in", self.W_query, queries), ("kdim", self.W_key, keys),
                               ("vdim", self.W_value, values)):
            if isinstance(x, Tensor) and is_lazy(layer.weight):
                setattr(self, attr, x.shape[-1])
        if self.backend == "d2l":
            return self._forward_d2l(queries, keys, values, valid_lens)
        if self.backend != "qkv":
            raise ValueError(f"backend must be 'd2l' or 'qkv', got {self.backend!r}")
        out, weights = super().forward(
            queries, keys, values, valid_lens=valid_lens, need_weights=True
        )
        if valid_lens is not None:  # checked by the parent
            empty = (valid_lens.to(out.device) == 0)
            if empty.dim() == 1:
                empty = empty[:, None].expand(out.shape[0], out.shape[1])
            if bool(empty.any()):
                out, weights = self._uniform_empty_rows(out, weights, values, empty)
        self.attention_weights = weights
        self.attention.attention_weights = weights.reshape(-1, *weights.shape[2:])
        return out

    def _forward_d2l(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None
    ) -> Tensor:
        for name, x in (("queries", queries), ("keys", keys), ("values", values)):
            if not isinstance(x, Tensor) or x.dim() != 3:
                raise ValueError(f"{name} must be a 3-D tensor (batch, n, width), got "
                                 f"{tuple(x.shape) if isinstance(x, Tensor) else type(x)}")
        for name, x, width in (("query", queries, self.d_in), ("key", keys, self.kdim),
                               ("value", values, self.vdim)):
            if x.shape[-1] != width:
                raise ValueError(f"{name} vectors must be {width} wide (this layer's "
                                 f"{name}_size), got shape {tuple(x.shape)}")
        if keys.shape[:2] != values.shape[:2] or queries.shape[0] != keys.shape[0]:
            raise ValueError(f"queries {tuple(queries.shape)}, keys {tuple(keys.shape)} and "
                             f"values {tuple(values.shape)} must share the batch, and keys "
                             "and values the number of keys")
        q = transpose_qkv(self.W_q(queries), self.num_heads)  # (batch * heads, n_q, d)
        k = transpose_qkv(self.W_k(keys), self.num_heads)
        v = transpose_qkv(self.W_v(values), self.num_heads)
        if valid_lens is not None:
            # checked against the batch before it is repeated per head, so that a wrong
            # shape is named as the caller gave it
            check_valid_lens(valid_lens, queries.shape[0], queries.shape[1], keys.shape[1])
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        out = transpose_output(self.attention(q, k, v, valid_lens), self.num_heads)
        weights = self.attention.attention_weights
        self.attention_weights = weights.reshape(-1, self.num_heads, *weights.shape[1:])
        return self.W_o(out)

    def transpose_qkv(self, X: Tensor) -> Tensor:
        """d2l 1.0.3's method: :func:`transpose_qkv` with this layer's ``num_heads``."""
        return transpose_qkv(X, self.num_heads)

    def transpose_output(self, X: Tensor) -> Tensor:
        """d2l 1.0.3's method: :func:`transpose_output` with this layer's ``num_heads``."""
        return transpose_output(X, self.num_heads)

    def _uniform_empty_rows(
        self, out: Tensor, weights: Tensor, values: Tensor, empty: Tensor
    ) -> tuple[Tensor, Tensor]:
        """d2l's result for the queries with ``valid_len == 0`` (``empty (batch, n_q)``).

        The parent gives those rows zero weights, so their output is ``out_proj``'s bias
        alone. d2l gives them weight ``1 / n_k`` on every key; this adds what those
        weights contribute, ``W_o (dropout(uniform) @ V)`` per head, to those rows only
        (zero weights elsewhere add exactly zero), and puts the uniform rows in the weights.
        """
        batch, num_queries, _ = out.shape
        num_keys = values.shape[1]
        uniform = empty[:, None, :, None].to(weights.dtype) / num_keys  # (b, 1, n_q, 1)
        uniform = uniform.expand(batch, self.num_heads, num_queries, num_keys)
        v = self._split_heads(self.W_value(values))  # (b, heads, n_k, head_dim)
        heads = (self.dropout(uniform) @ v).transpose(1, 2).reshape(batch, num_queries, -1)
        out = out + nn.functional.linear(heads, self.out_proj.weight)
        return out, weights + uniform
