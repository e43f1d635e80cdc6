"""Build a translator from its :class:`~qkv.models.seq2seq.Seq2SeqConfig`."""

from __future__ import annotations

import logging

from .bahdanau import BahdanauSeq2Seq
from .seq2seq import EncoderDecoder, Seq2SeqConfig, num_parameters
from .transformer import TransformerSeq2Seq

__all__ = ["build_model"]

logger = logging.getLogger(__name__)


def build_model(config: Seq2SeqConfig) -> EncoderDecoder:
    """Validate ``config``, build the model it names, initialise it and log its size."""
    config.validate()
    models: dict[str, type[EncoderDecoder]] = {
        "bahdanau": BahdanauSeq2Seq,
        "transformer": TransformerSeq2Seq,
    }
    model = models[config.model](config)
    model.init_weights()
    logger.info(
        "built %s model with %s trainable parameters", config.model, f"{num_parameters(model):,}"
    )
    return model
