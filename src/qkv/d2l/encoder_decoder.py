"""d2l's encoder-decoder interface: the base classes the books' translators derive from.

``EncoderDecoder.forward`` returns the decoder's output only, as d2l 1.0.3 does; d2l-zh's
returns ``(output, state)``. :func:`qkv.d2l.train_seq2seq` takes either, and callers that
want the state get it from ``decoder(...)`` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import check_positive_int
from .v2 import Classifier

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


class EncoderDecoder(Classifier):
    """``forward(enc_X, dec_X, *args) -> Y_hat``: encode, ``init_state``, decode.

    ``*args`` (typically ``enc_valid_len (batch,)``) go to both the encoder and the
    decoder's ``init_state``. Returns the decoder's first output only, as d2l 1.0.3 does
    (d2l-zh's returned ``(Y_hat, state)``; ``train_seq2seq`` takes either). A
    :class:`Classifier`, as in 1.0.3, so a :class:`Trainer` fits it with
    cross-entropy and ``predict_step`` decodes greedily.
    """

    def __init__(self, encoder: nn.Module, decoder: nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, enc_X: Tensor, dec_X: Tensor, *args: Any) -> Tensor:
        enc_all_outputs = self.encoder(enc_X, *args)
        dec_state = self.decoder.init_state(enc_all_outputs, *args)
        return self.decoder(dec_X, dec_state)[0]

    def predict_step(
        self, batch: Sequence[Tensor], device: torch.device | str, num_steps: int,
        save_attention_weights: bool = False,
    ) -> tuple[Tensor, list[Any]]:
        """Greedy decoding of a batch ``(src, tgt, src_valid_len, label)`` (as
        ``MTFraEng.build`` gives it): ``(outputs (batch, num_steps), attention_weights)``.

        Decoding starts from ``tgt[:, 0]`` (``<bos>``) and feeds each argmax back for
        ``num_steps`` steps, past ``<eos>`` too (cut the rows there yourself). With
        ``save_attention_weights``, ``decoder.attention_weights`` is kept after every
        step. As in d2l, the model's train/eval mode and autograd are left as they are.
        """
        check_positive_int("num_steps", num_steps)
        src, tgt, src_valid_len, _ = (a.to(device) for a in batch)
        enc_all_outputs = self.encoder(src, src_valid_len)
        dec_state = self.decoder.init_state(enc_all_outputs, src_valid_len)
        outputs, attention_weights = [tgt[:, :1]], []
        for _ in range(num_steps):
            Y, dec_state = self.decoder(outputs[-1], dec_state)
            outputs.append(Y.argmax(dim=2))
            if save_attention_weights:
                attention_weights.append(self.decoder.attention_weights)
        return torch.cat(outputs[1:], dim=1), attention_weights
