"""The shared base of the translation models: their config and their interface.

Every translator subclasses :class:`EncoderDecoder`, so a trainer, the decoders in
:mod:`qkv.models.decoding` and the CLI never look inside:

    config = Seq2SeqConfig(src_vocab_size=len(src_vocab), tgt_vocab_size=len(tgt_vocab))
    model = build_model(config)                        # Xavier init, logs the parameter count
    dec_input = teacher_forcing_input(tgt, bos_id)     # <bos> + target shifted right
    logits = model(src, src_valid_len, dec_input)      # (batch, T_tgt, tgt_vocab)

    state = model.encode(src, src_valid_len)           # once per source sentence
    logits, state, attn = model.decode_step(tokens, state)   # one target token per row

The models are :class:`qkv.models.bahdanau.BahdanauSeq2Seq` and
:class:`qkv.models.transformer.TransformerSeq2Seq`; :func:`qkv.models.build.build_model`
picks one from ``config.model``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import MAX_SIZE, check_dropout, check_float, check_int, show, small_divisors
from ..functional import BACKENDS
from ..options import MODEL_NAMES

__all__ = [
    "MODEL_NAMES",
    "Seq2SeqConfig",
    "EncoderDecoder",
    "init_seq2seq",
    "num_parameters",
    "teacher_forcing_input",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------
# Configuration


@dataclass
class Seq2SeqConfig:
    """Everything needed to rebuild a model (it is saved next to the weights as JSON).

    ``num_heads``, ``ffn_num_hiddens`` and ``max_len`` are used by the Transformer only.
    ``backend`` (``"fused"`` or ``"eager"``) is how either model computes: the Bahdanau
    model's recurrences (see :class:`qkv.models.bahdanau.Seq2SeqEncoder`) or the
    Transformer's attention layers (see :class:`qkv.MultiHeadAttention`). It changes how
    the model computes, not its parameters: a checkpoint saved under one loads under the
    other.
    The Transformer's width is ``num_hiddens``; its ``embed_size`` must equal it (the
    embeddings are added to the residual stream, so they have the model's width).

    A default-constructed config has vocabulary sizes 0 on purpose, as a template to fill
    in; :meth:`validate` (run by :meth:`from_dict` and :func:`build_model`) rejects it.
    """

    model: str = "bahdanau"
    src_vocab_size: int = 0
    tgt_vocab_size: int = 0
    embed_size: int = 32
    num_hiddens: int = 32
    num_layers: int = 2
    dropout: float = 0.1
    num_heads: int = 4
    ffn_num_hiddens: int = 64
    max_len: int = 1000
    backend: str = "fused"
    # Bahdanau: hand the decoder the encoder's state after each sentence's last real
    # token rather than after its padding (d2l's). The Transformer always masks padding.
    skip_padding: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``Seq2SeqConfig.from_dict(c.to_dict()) == c``."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Seq2SeqConfig:
        """Build and validate a config from a dict (e.g. read from a checkpoint's JSON).

        Missing keys take their defaults (so a config saved before a field existed still
        loads, with that field's default). Raises ``ValueError`` (one line naming the key)
        for an unknown key, a value of the wrong type, or an invalid value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in d.items():
            if key not in fields:
                raise ValueError(
                    f"unknown config key {show(key)}; valid keys: {', '.join(fields)}"
                )
            values[key] = _check_type(key, value, type(fields[key].default))
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise a one-line ``ValueError`` naming the first invalid field."""
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), type(f.default))
        if self.model not in MODEL_NAMES:
            raise ValueError(
                f"config key 'model' must be one of {', '.join(MODEL_NAMES)}, got {self.model!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"config key 'backend' must be one of {', '.join(BACKENDS)}, "
                f"got {show(self.backend)}"
            )
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "embed_size",
            "num_hiddens",
            "num_layers",
            "num_heads",
            "ffn_num_hiddens",
            "max_len",
        ):
            # The cap keeps every dimension an int32; whether the model fits in memory is
            # a separate check (num_parameters, qkv.training.limits).
            check_int(f"config key {name!r}", getattr(self, name), 1, MAX_SIZE)
        try:
            check_float("dropout", self.dropout, 0.0, 1.0, hi_open=True)  # NaN, inf fail
            check_dropout(self.dropout)
        except ValueError as e:
            raise ValueError(f"config key 'dropout': {e}") from None
        if self.model == "transformer":
            if self.embed_size != self.num_hiddens:
                raise ValueError(
                    f"config key 'embed_size' must equal num_hiddens ({self.num_hiddens}) for "
                    f"the transformer (its embeddings have the model width), got {self.embed_size}"
                )
            if self.num_hiddens % self.num_heads != 0:
                raise ValueError(
                    f"config key 'num_heads' must divide num_hiddens ({self.num_hiddens}), "
                    f"got {self.num_heads}; e.g. one of {small_divisors(self.num_hiddens)}"
                )

    @property
    def ignores_source_padding(self) -> bool:
        """Whether nothing the encoder hands the decoder depends on source positions past
        a sentence's length: the Transformer masks them; the GRU encoder skips them only
        with ``skip_padding`` (d2l's reads them into its final state). A batch may then
        drop source padding past its longest sentence."""
        return self.model == "transformer" or self.skip_padding

    # Sizes, from the config alone: nothing is allocated. Tested against built models.

    def num_parameters(self) -> int:
        """Number of parameters of :func:`build_model` (this config), by arithmetic only.

        Closed forms, so a config naming a billion layers costs nothing to size up.
        """
        E, H, L, F = self.embed_size, self.num_hiddens, self.num_layers, self.ffn_num_hiddens
        S, T = self.src_vocab_size, self.tgt_vocab_size
        if self.model == "bahdanau":

            def gru(inputs: int) -> int:  # weights (3H, in) and (3H, H), two biases (3H,)
                return 3 * H * (inputs + H + 2) + (L - 1) * 3 * H * (2 * H + 2)

            encoder = S * E + gru(E)
            # attention W_k, W_q (H, H) and w_v (1, H); embedding; GRU on [embedding,
            # context]; dense (T, H) + bias
            decoder = 2 * H * H + H + T * E + gru(E + H) + H * T + T
            return encoder + decoder
        attention = 4 * H * H + H  # W_query, W_key, W_value (no bias), out_proj with bias
        ffn = 2 * H * F + F + H
        layer_norm = 2 * H
        encoder_block = 2 * layer_norm + attention + ffn
        decoder_block = 3 * layer_norm + 2 * attention + ffn
        return (S + T) * H + L * (encoder_block + decoder_block) + 2 * layer_norm + H * T + T

    def num_buffer_elements(self) -> int:
        """Elements of the model's buffers (not saved in checkpoints, but allocated):
        the Transformer's sinusoidal table ``(1, max_len, num_hiddens)``."""
        return self.max_len * self.num_hiddens if self.model == "transformer" else 0

    def parameter_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every ``state_dict`` entry of the model, in order.

        A generator: a caller comparing with a checkpoint can stop after as many entries
        as the checkpoint holds, however many layers the config claims.
        """
        E, H, F = self.embed_size, self.num_hiddens, self.ffn_num_hiddens
        S, T = self.src_vocab_size, self.tgt_vocab_size
        if self.model == "bahdanau":
            yield "encoder.embedding.weight", (S, E)
            yield from _gru_shapes("encoder.rnn", E, H, self.num_layers)
            yield "decoder.attention.W_k.weight", (H, H)
            yield "decoder.attention.W_q.weight", (H, H)
            yield "decoder.attention.w_v.weight", (1, H)
            yield "decoder.embedding.weight", (T, E)
            yield from _gru_shapes("decoder.rnn", E + H, H, self.num_layers)
            yield "decoder.dense.weight", (T, H)
            yield "decoder.dense.bias", (T,)
            return
        yield "src_embedding.weight", (S, H)
        yield "tgt_embedding.weight", (T, H)
        for side, attentions, norms in (("encoder", ("attention",), 2),
                                        ("decoder", ("self_attention", "cross_attention"), 3)):
            for i in range(self.num_layers):
                block = f"{side}_blocks.{i}"
                for n, attention in enumerate(attentions, start=1):
                    yield from _layer_norm_shapes(f"{block}.ln{n}", H)
                    for w in ("W_query", "W_key", "W_value", "out_proj"):
                        yield f"{block}.{attention}.{w}.weight", (H, H)
                    yield f"{block}.{attention}.out_proj.bias", (H,)
                yield from _layer_norm_shapes(f"{block}.ln{norms}", H)
                yield f"{block}.ffn.dense1.weight", (F, H)
                yield f"{block}.ffn.dense1.bias", (F,)
                yield f"{block}.ffn.dense2.weight", (H, F)
                yield f"{block}.ffn.dense2.bias", (H,)
            yield from _layer_norm_shapes(f"{side}_ln", H)
        yield "dense.weight", (T, H)
        yield "dense.bias", (T,)


def _gru_shapes(
    prefix: str, inputs: int, H: int, layers: int
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``nn.GRU(inputs, H, layers)``'s parameters: the three gates stacked, ``3H`` rows."""
    for k in range(layers):
        yield f"{prefix}.weight_ih_l{k}", (3 * H, inputs if k == 0 else H)
        yield f"{prefix}.weight_hh_l{k}", (3 * H, H)
        yield f"{prefix}.bias_ih_l{k}", (3 * H,)
        yield f"{prefix}.bias_hh_l{k}", (3 * H,)


def _layer_norm_shapes(prefix: str, H: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield f"{prefix}.weight", (H,)
    yield f"{prefix}.bias", (H,)


def _check_type(key: str, value: Any, expected: type) -> Any:
    """Return ``value`` (ints widened to float for float fields) or raise ``ValueError``."""
    # bool is a subclass of int, but `num_layers: true` is a mistake, not a 1.
    if expected is bool and isinstance(value, bool):
        return value
    if isinstance(value, bool) or not isinstance(value, expected):
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # a JSON integer beyond float's range
                pass
        raise ValueError(
            f"config key {key!r} must be of type {expected.__name__}, "
            f"got {type(value).__name__} {show(value)}"
        )
    return value


# ----------------------------------------------------------------------------
# The interface shared by all models


class EncoderDecoder(nn.Module):
    """Base class of the translation models; trainers and decoders use only these methods.

    ``state`` objects are opaque to callers. ``decode_step`` may update the state it is
    given in place (the Transformer appends to its KV caches) and returns it.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config

    def init_weights(self) -> None:
        """The init :func:`build_model` applies (default: :func:`init_seq2seq`)."""
        init_seq2seq(self)

    def forward(self, src: Tensor, src_valid_len: Tensor, dec_input: Tensor) -> Tensor:
        """Teacher forcing: ``src (b, S)``, ``src_valid_len (b,)``, ``dec_input (b, T)``
        ``-> logits (b, T, tgt_vocab)``."""
        raise NotImplementedError

    def encode(self, src: Tensor, src_valid_len: Tensor, max_steps: int | None = None) -> Any:
        """Encode ``src (b, S)`` once; ``max_steps`` bounds how many ``decode_step`` calls
        will follow (models with a pre-allocated cache size it from this)."""
        raise NotImplementedError

    def decode_step(self, tokens: Tensor, state: Any) -> tuple[Tensor, Any, Tensor]:
        """One step: ``tokens (b,)`` int64 ``-> (logits (b, tgt_vocab), state, attn (b, S))``
        where ``attn`` are this step's weights over the source positions."""
        raise NotImplementedError

    def reorder_state(self, state: Any, index: Tensor) -> Any:
        """Select / reorder the batch rows of ``state`` (``index (k,)`` int64), for beam
        search and for dropping finished rows. Returns a new state."""
        raise NotImplementedError


def teacher_forcing_input(tgt: Tensor, bos_id: int) -> Tensor:
    """Decoder input for teacher forcing: ``<bos>`` then the target shifted right.

    ``tgt (b, T) -> (b, T)``: row ``[y1, y2, ..., yT]`` becomes ``[<bos>, y1, ..., y(T-1)]``,
    so the decoder predicts ``y_t`` having seen ``y_1 .. y_(t-1)``.
    """
    bos = torch.full_like(tgt[:, :1], bos_id)
    return torch.cat([bos, tgt[:, :-1]], dim=1)


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def init_seq2seq(model: nn.Module) -> None:
    """Xavier-uniform init of every ``nn.Linear`` weight and every GRU weight matrix.

    Biases keep PyTorch's defaults. GRU matrices are initialised as stored, i.e. the three
    gates stacked into one ``(3 * hidden, in)`` matrix per layer and direction.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, nn.GRU):
            for name, param in module.named_parameters():
                if name.startswith("weight_"):
                    nn.init.xavier_uniform_(param)
