"""Models built from qkv attention: translators (Bahdanau GRU, Transformer) and a GPT.

Both share one interface (:class:`EncoderDecoder`), built from a :class:`Seq2SeqConfig`
by :func:`build_model`; :func:`greedy_decode` and :func:`beam_search` work with either.
The GPT is :class:`GPTModel`; :class:`GPTModelFast` is the book's fused-attention form of it.
"""

from .bahdanau import BahdanauSeq2Seq, BahdanauState, Seq2SeqAttentionDecoder, Seq2SeqEncoder
from .build import build_model
from .decoding import beam_search, greedy_decode, length_penalty_factor, score_sequence
from .gpt import (
    GELU,
    FeedForward,
    GPTConfig,
    GPTEmbedding,
    GPTModel,
    LayerNorm,
    TransformerBlock,
    embed_tokens,
    generate,
    generate_text_simple,
)
from .gpt import PRESETS as GPT_PRESETS
from .gpt_fast import GPTModelFast, TransformerBlockFast
from .seq2seq import (
    MODEL_NAMES,
    EncoderDecoder,
    Seq2SeqConfig,
    init_seq2seq,
    num_parameters,
    teacher_forcing_input,
)
from .transformer import (
    PositionWiseFFN,
    TransformerDecoderBlock,
    TransformerEncoderBlock,
    TransformerSeq2Seq,
    TransformerState,
)

__all__ = [
    "MODEL_NAMES",
    "Seq2SeqConfig",
    "EncoderDecoder",
    "build_model",
    "init_seq2seq",
    "num_parameters",
    "teacher_forcing_input",
    "Seq2SeqEncoder",
    "Seq2SeqAttentionDecoder",
    "BahdanauState",
    "BahdanauSeq2Seq",
    "PositionWiseFFN",
    "TransformerEncoderBlock",
    "TransformerDecoderBlock",
    "TransformerState",
    "TransformerSeq2Seq",
    "greedy_decode",
    "beam_search",
    "score_sequence",
    "length_penalty_factor",
    "GPT_PRESETS",
    "GPTConfig",
    "GPTEmbedding",
    "embed_tokens",
    "GPTModel",
    "GPTModelFast",
    "TransformerBlockFast",
    "TransformerBlock",
    "LayerNorm",
    "FeedForward",
    "GELU",
    "generate",
    "generate_text_simple",
]
