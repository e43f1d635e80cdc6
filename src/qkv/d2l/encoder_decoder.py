"""d2l's encoder-decoder interface: the base classes the books' translators derive from.

``EncoderDecoder.forward`` returns the decoder's output only, as d2l 1.0.3 does; d2l-zh's
returns ``(output, state)``. :func:`qkv.d2l.train_seq2seq` takes either, and callers that
want the state get it from ``decoder(...)`` directly.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["Encoder", "Decoder", "AttentionDecoder", "EncoderDecoder"]


class Encoder(nn.Module):
    """Base encoder: ``forward(X, *args)`` returns whatever the decoder's ``init_state``
    takes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def forward(self, X: Tensor, *args: Any) -> Any:
        raise NotImplementedError


class Decoder(nn.Module):
    """Base decoder: ``init_state(enc_all_outputs, *args)`` builds the state that
    ``forward(X, state)`` consumes and returns, updated, next to its output."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def init_state(self, enc_all_outputs: Any, *args: Any) -> Any:
        raise NotImplementedError

    def forward(self, X: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError


class AttentionDecoder(Decoder):
    """Base of decoders with attention: they also expose ``attention_weights``."""

    @property
    def attention_weights(self) -> Any:
        raise NotImplementedError


class EncoderDecoder(nn.Module):
    """``forward(enc_X, dec_X, *args) -> Y_hat``: encode, ``init_state``, decode.

    ``*args`` (typically ``enc_valid_len (batch,)``) go to both the encoder and the
    decoder's ``init_state``. Returns the decoder's first output only, as d2l 1.0.3 does.
    """

    def __init__(self, encoder: nn.Module, decoder: nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, enc_X: Tensor, dec_X: Tensor, *args: Any) -> Tensor:
        enc_all_outputs = self.encoder(enc_X, *args)
        dec_state = self.decoder.init_state(enc_all_outputs, *args)
        return self.decoder(dec_X, dec_state)[0]
