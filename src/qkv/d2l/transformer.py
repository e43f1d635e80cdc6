"""The Transformer of both books' attention chapters, in each edition's signature.

d2l 1.0.3 (English) and d2l-zh 2.0 (Chinese) build the same model with different
argument lists, and partly different names:

====================  ===============================  ==================================
piece                 d2l 1.0.3                        d2l-zh
====================  ===============================  ==================================
feed-forward          ``PositionWiseFFN(ffn_num_hid    ``PositionWiseFFN(ffn_num_input,
                      dens, ffn_num_outputs)``         ffn_num_hiddens, ffn_num_outputs)``
residual + norm       ``AddNorm(norm_shape, dropout)`` ``AddNorm(normalized_shape,
                                                       dropout)``
encoder block         ``TransformerEncoderBlock(num    ``EncoderBlock(key_size, query_
                      _hiddens, ffn_num_hiddens,       size, value_size, num_hiddens,
                      num_heads, dropout,              norm_shape, ffn_num_input, ffn_num
                      use_bias=False)``                _hiddens, num_heads, dropout,
                                                       use_bias=False)``
encoder               ``TransformerEncoder(vocab_      ``TransformerEncoder(vocab_size,
                      size, num_hiddens, ffn_num_      key_size, query_size, value_size,
                      hiddens, num_heads, num_blks,    num_hiddens, norm_shape, ffn_num_
                      dropout, use_bias=False)``       input, ffn_num_hiddens, num_heads,
                                                       num_layers, dropout,
                                                       use_bias=False)``
decoder block         ``TransformerDecoderBlock(num    ``DecoderBlock(key_size, ...,
                      _hiddens, ffn_num_hiddens,       num_heads, dropout, i)``, the
                      num_heads, dropout, i)``         encoder block's widths
decoder               ``TransformerDecoder(vocab_      ``TransformerDecoder(vocab_size,
                      size, num_hiddens, ffn_num_      key_size, ..., num_layers,
                      hiddens, num_heads, num_blks,    dropout)``, the encoder's
                      dropout)``                       without ``use_bias``
====================  ===============================  ==================================

Every class here takes both forms, told apart by how the call binds
(:func:`qkv.d2l.attention.bind_form`: the 1.0.3 form when the arguments fit it);
``EncoderBlock`` and ``DecoderBlock`` are d2l-zh's names for the two block classes. As in
the books, the 1.0.3 form's layers are lazy (``nn.LazyLinear``, sized and initialised by
the first call) and d2l-zh's are sized when built; modules are created, and lazy ones
first called, in the books' order, so a seed gives the books' weights and dropout draws.

The decoder's state is d2l's list ``[enc_outputs, enc_valid_lens, [keys of block i]]``:
while decoding one token at a time (evaluation mode) block ``i`` appends its input to
``state[2][i]`` and attends to all of it; in training the whole target goes in at once
and position ``t`` sees positions ``0 .. t`` (valid lengths ``1 .. T``).

Attention weights, after each forward, as the books read them: the encoder's
``attention_weights`` lists each block's ``(batch * num_heads, n_q, n_k)``; the
decoder's ``attention_weights`` is ``[self-attention per block, encoder-decoder
attention per block]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import check_dropout, check_heads, check_int, check_positive_int
from ..positional import PositionalEncoding
from .attention import MultiHeadAttention, bind_form
from .encoder_decoder import AttentionDecoder, Encoder

__all__ = [
    "PositionWiseFFN",
    "AddNorm",
    "TransformerEncoderBlock",
    "EncoderBlock",
    "TransformerEncoder",
    "TransformerDecoderBlock",
    "DecoderBlock",
    "TransformerDecoder",
]

# The d2l-zh forms' widths, each of which must equal num_hiddens: a block adds every
# sublayer's output to the sublayer's input.
_ZH_WIDTHS = ("key_size", "query_size", "value_size", "ffn_num_input")


def _check(name: str, a: dict[str, Any]) -> None:
    """One-line errors for the arguments ``a`` of class ``name``, before anything is built."""
    for arg, value in a.items():
        if arg == "dropout":
            check_dropout(value)
        elif arg in ("norm_shape", "normalized_shape"):
            shape = [value] if isinstance(value, int) and not isinstance(value, bool) else value
            if isinstance(shape, str) or not isinstance(shape, Sequence) or not shape:
                raise TypeError(f"{arg} must be a positive integer or a list of them, got "
                                f"{value!r} of type {type(value).__name__}")
            for size in shape:
                check_positive_int(arg, size)
        elif arg == "i":
            check_int("i (the block's index)", value, 0)
        elif arg != "use_bias":
            check_positive_int(arg, value)
    if "num_hiddens" not in a:  # the feed-forward network and AddNorm alone
        return
    check_heads(a["num_hiddens"], a["num_heads"], name="num_hiddens")
    for arg in _ZH_WIDTHS:
        if arg in a and a[arg] != a["num_hiddens"]:
            raise ValueError(f"{name}: {arg} ({a[arg]}) must equal num_hiddens "
                             f"({a['num_hiddens']}): each sublayer's output is added to its "
                             "input")


def _attention(a: dict[str, Any], bias: bool) -> MultiHeadAttention:
    """A block's multi-head attention in the block's form (d2l-zh's leads with widths)."""
    widths = [a[arg] for arg in ("key_size", "query_size", "value_size") if arg in a]
    return MultiHeadAttention(*widths, a["num_hiddens"], a["num_heads"], a["dropout"], bias)


def _ffn(a: dict[str, Any]) -> PositionWiseFFN:
    """A block's feed-forward network in the block's form (d2l-zh's gives its input)."""
    ffn_input = [a["ffn_num_input"]] if "ffn_num_input" in a else []
    return PositionWiseFFN(*ffn_input, a["ffn_num_hiddens"], a["num_hiddens"])


def _ffn_d2l(ffn_num_hiddens, ffn_num_outputs): ...


def _ffn_zh(ffn_num_input, ffn_num_hiddens, ffn_num_outputs): ...


class PositionWiseFFN(nn.Module):
    """The same two-layer MLP at every position: ``dense2(relu(dense1(X)))``.

    ``PositionWiseFFN(ffn_num_hiddens, ffn_num_outputs)`` (d2l 1.0.3, both layers
    ``nn.LazyLinear``) or ``PositionWiseFFN(ffn_num_input, ffn_num_hiddens,
    ffn_num_outputs)`` (d2l-zh, ``nn.Linear``). Both layers have biases.

    ``X (batch, num_steps, ffn_num_input) -> (batch, num_steps, ffn_num_outputs)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        form, a = bind_form("PositionWiseFFN", args, kwargs, {"d2l": _ffn_d2l, "d2l-zh": _ffn_zh})
        _check("PositionWiseFFN", a)
        super().__init__()
        if form == "d2l":
            self.dense1 = nn.LazyLinear(a["ffn_num_hiddens"])
        else:
            self.dense1 = nn.Linear(a["ffn_num_input"], a["ffn_num_hiddens"])
        self.relu = nn.ReLU()
        if form == "d2l":
            self.dense2 = nn.LazyLinear(a["ffn_num_outputs"])
        else:
            self.dense2 = nn.Linear(a["ffn_num_hiddens"], a["ffn_num_outputs"])

    def forward(self, X: Tensor) -> Tensor:
        return self.dense2(self.relu(self.dense1(X)))


def _addnorm_d2l(norm_shape, dropout=0.0): ...


def _addnorm_zh(normalized_shape, dropout=0.0): ...


class AddNorm(nn.Module):
    """Residual connection, then layer normalisation: ``ln(dropout(Y) + X)``.

    ``AddNorm(norm_shape, dropout)`` (d2l 1.0.3) or ``AddNorm(normalized_shape, dropout)``
    (d2l-zh): the same module; the shape is ``nn.LayerNorm``'s, the trailing dimensions
    normalised over (d2l-zh's encoder-block example normalises over ``[100, 24]``, time
    and features).

    ``X, Y (..., *norm_shape) -> (..., *norm_shape)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _, a = bind_form("AddNorm", args, kwargs, {"d2l": _addnorm_d2l, "d2l-zh": _addnorm_zh})
        _check("AddNorm", a)
        super().__init__()
        self.dropout = nn.Dropout(a["dropout"])
        self.ln = nn.LayerNorm(a.get("norm_shape", a.get("normalized_shape")))

    def forward(self, X: Tensor, Y: Tensor) -> Tensor:
        return self.ln(self.dropout(Y) + X)


def _encoder_block_d2l(num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False): ...


def _encoder_block_zh(key_size, query_size, value_size, num_hiddens, norm_shape,
                      ffn_num_input, ffn_num_hiddens, num_heads, dropout, use_bias=False): ...


class TransformerEncoderBlock(nn.Module):
    """One encoder layer: multi-head self-attention, then the feed-forward network, each
    followed by :class:`AddNorm`.

    ``TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout,
    use_bias=False)`` (d2l 1.0.3, lazy) or, as d2l-zh's ``EncoderBlock``, ``(key_size,
    query_size, value_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
    num_heads, dropout, use_bias=False)``, whose widths must all be ``num_hiddens``.
    ``use_bias``: biases on the attention's projections.

    ``forward(X (batch, num_steps, num_hiddens), valid_lens (batch,) or None) -> (batch,
    num_steps, num_hiddens)``; ``attention.attention.attention_weights`` holds the last
    weights ``(batch * num_heads, num_steps, num_steps)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        _, a = bind_form(name, args, kwargs,
                         {"d2l": _encoder_block_d2l, "d2l-zh": _encoder_block_zh})
        _check(name, a)
        super().__init__()
        norm_shape = a.get("norm_shape", a["num_hiddens"])
        self.attention = _attention(a, a["use_bias"])
        self.addnorm1 = AddNorm(norm_shape, a["dropout"])
        self.ffn = _ffn(a)
        self.addnorm2 = AddNorm(norm_shape, a["dropout"])

    def forward(self, X: Tensor, valid_lens: Tensor | None) -> Tensor:
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class EncoderBlock(TransformerEncoderBlock):
    """d2l-zh's name for :class:`TransformerEncoderBlock` (which takes either form)."""


def _encoder_d2l(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout,
                 use_bias=False): ...


def _encoder_zh(vocab_size, key_size, query_size, value_size, num_hiddens, norm_shape,
                ffn_num_input, ffn_num_hiddens, num_heads, num_layers, dropout,
                use_bias=False): ...


class TransformerEncoder(Encoder):
    """Embedding scaled by ``sqrt(num_hiddens)``, plus :class:`~qkv.PositionalEncoding`
    (with dropout), then ``num_blks`` (d2l-zh: ``num_layers``) encoder blocks.

    ``TransformerEncoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks,
    dropout, use_bias=False)`` (d2l 1.0.3) or ``TransformerEncoder(vocab_size, key_size,
    query_size, value_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens,
    num_heads, num_layers, dropout, use_bias=False)`` (d2l-zh). The blocks are
    ``blks.block0``, ``blks.block1``, ...

    ``forward(X (batch, num_steps) int64, valid_lens (batch,), *args) -> (batch,
    num_steps, num_hiddens)``; ``attention_weights`` then lists each block's
    ``(batch * num_heads, num_steps, num_steps)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        form, a = bind_form("TransformerEncoder", args, kwargs,
                            {"d2l": _encoder_d2l, "d2l-zh": _encoder_zh})
        _check("TransformerEncoder", a)
        super().__init__()
        num_blks = a.pop("num_blks" if form == "d2l" else "num_layers")
        vocab_size = a.pop("vocab_size")
        self.num_hiddens = a["num_hiddens"]
        self.embedding = nn.Embedding(vocab_size, self.num_hiddens)
        self.pos_encoding = PositionalEncoding(self.num_hiddens, a["dropout"])
        block = EncoderBlock if form == "d2l-zh" else TransformerEncoderBlock
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(f"block{i}", block(**a))
        self.attention_weights: list[Tensor | None] = [None] * num_blks

    def forward(self, X: Tensor, valid_lens: Tensor | None, *args: Any) -> Tensor:
        # The encoding lies in [-1, 1]; the scaled embedding is not drowned by it.
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self.attention_weights = []
        for blk in self.blks:
            X = blk(X, valid_lens)
            self.attention_weights.append(blk.attention.attention.attention_weights)
        return X


def _decoder_block_d2l(num_hiddens, ffn_num_hiddens, num_heads, dropout, i): ...


def _decoder_block_zh(key_size, query_size, value_size, num_hiddens, norm_shape,
                      ffn_num_input, ffn_num_hiddens, num_heads, dropout, i): ...


class TransformerDecoderBlock(nn.Module):
    """Decoder layer ``i``: masked self-attention, encoder-decoder attention, then the
    feed-forward network, each followed by :class:`AddNorm`. No biases on the attention.

    ``TransformerDecoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, i)``
    (d2l 1.0.3, lazy) or, as d2l-zh's ``DecoderBlock``, ``(key_size, query_size,
    value_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens, num_heads,
    dropout, i)``.

    ``forward(X (batch, T, num_hiddens), state) -> ((batch, T, num_hiddens), state)``
    with ``state = [enc_outputs (batch, src_len, num_hiddens), enc_valid_lens (batch,)
    or None, keys]``, where ``keys[i]`` is None or this block's inputs so far, to which
    ``X`` is appended (see the module docstring). Weights: ``attention1.attention`` and
    ``attention2.attention`` hold ``(batch * num_heads, T, n_k)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        _, a = bind_form(name, args, kwargs,
                         {"d2l": _decoder_block_d2l, "d2l-zh": _decoder_block_zh})
        _check(name, a)
        super().__init__()
        self.i = a["i"]
        norm_shape = a.get("norm_shape", a["num_hiddens"])
        self.attention1 = _attention(a, False)
        self.addnorm1 = AddNorm(norm_shape, a["dropout"])
        self.attention2 = _attention(a, False)
        self.addnorm2 = AddNorm(norm_shape, a["dropout"])
        self.ffn = _ffn(a)
        self.addnorm3 = AddNorm(norm_shape, a["dropout"])

    def forward(self, X: Tensor, state: list[Any]) -> tuple[Tensor, list[Any]]:
        enc_outputs, enc_valid_lens, keys = state[0], state[1], state[2]
        key_values = X if keys[self.i] is None else torch.cat((keys[self.i], X), dim=1)
        keys[self.i] = key_values
        if self.training:
            # The whole target at once: position t may look at positions 0 .. t only.
            batch, num_steps, _ = X.shape
            dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch, 1)
        else:
            # One token at a time: the keys are this token and those before it.
            dec_valid_lens = None
        Y = self.addnorm1(X, self.attention1(X, key_values, key_values, dec_valid_lens))
        Z = self.addnorm2(Y, self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens))
        return self.addnorm3(Z, self.ffn(Z)), state


class DecoderBlock(TransformerDecoderBlock):
    """d2l-zh's name for :class:`TransformerDecoderBlock` (which takes either form)."""


def _decoder_d2l(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout): ...


def _decoder_zh(vocab_size, key_size, query_size, value_size, num_hiddens, norm_shape,
                ffn_num_input, ffn_num_hiddens, num_heads, num_layers, dropout): ...


class TransformerDecoder(AttentionDecoder):
    """The encoder's embedding and positional encoding, ``num_blks`` (d2l-zh:
    ``num_layers``) decoder blocks, then ``dense`` to the vocabulary (d2l 1.0.3:
    ``nn.LazyLinear``; d2l-zh: ``nn.Linear``).

    ``TransformerDecoder(vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks,
    dropout)`` (d2l 1.0.3) or ``TransformerDecoder(vocab_size, key_size, query_size,
    value_size, num_hiddens, norm_shape, ffn_num_input, ffn_num_hiddens, num_heads,
    num_layers, dropout)`` (d2l-zh).

    ``init_state(enc_outputs, enc_valid_lens, *args) -> [enc_outputs, enc_valid_lens,
    [None] * num_blks]``; ``forward(X (batch, T) int64, state) -> (logits (batch, T,
    vocab_size), state)``. ``attention_weights`` is then ``[self, cross]``, each a list of
    every block's ``(batch * num_heads, T, n_k)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        form, a = bind_form("TransformerDecoder", args, kwargs,
                            {"d2l": _decoder_d2l, "d2l-zh": _decoder_zh})
        _check("TransformerDecoder", a)
        super().__init__()
        # Both books' names for the depth.
        self.num_blks = self.num_layers = a.pop("num_blks" if form == "d2l" else "num_layers")
        vocab_size = a.pop("vocab_size")
        self.num_hiddens = a["num_hiddens"]
        self.embedding = nn.Embedding(vocab_size, self.num_hiddens)
        self.pos_encoding = PositionalEncoding(self.num_hiddens, a["dropout"])
        block = DecoderBlock if form == "d2l-zh" else TransformerDecoderBlock
        self.blks = nn.Sequential()
        for i in range(self.num_blks):
            self.blks.add_module(f"block{i}", block(**a, i=i))
        if form == "d2l":
            self.dense = nn.LazyLinear(vocab_size)
        else:
            self.dense = nn.Linear(self.num_hiddens, vocab_size)
        self._attention_weights: list[list[Tensor | None]] = [
            [None] * self.num_blks for _ in range(2)]

    def init_state(
        self, enc_outputs: Tensor, enc_valid_lens: Tensor | None, *args: Any
    ) -> list[Any]:
        return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

    def forward(self, X: Tensor, state: list[Any]) -> tuple[Tensor, list[Any]]:
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        self._attention_weights = [[], []]
        for blk in self.blks:
            X, state = blk(X, state)
            self._attention_weights[0].append(blk.attention1.attention.attention_weights)
            self._attention_weights[1].append(blk.attention2.attention.attention_weights)
        return self.dense(X), state

    @property
    def attention_weights(self) -> list[list[Tensor | None]]:
        """``[self-attention, encoder-decoder attention]``, each per block, of the last
        forward."""
        return self._attention_weights
