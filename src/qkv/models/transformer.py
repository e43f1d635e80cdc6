"""Encoder-decoder Transformer for translation, built from qkv's attention layer.

Every attention in the model is :class:`qkv.MultiHeadAttention`:

- encoder self-attention: ``causal=False``, padding hidden through ``valid_lens``;
- decoder self-attention: ``causal=True``; when decoding token by token it appends to a
  :class:`qkv.KVCache` (the cache an LLM uses), so step ``t`` costs one token of work
  instead of re-running the whole prefix;
- decoder cross-attention: ``causal=False`` from the decoder to the encoder output,
  masked by the source ``valid_lens``.

Blocks are **pre-norm** (``x + sublayer(LayerNorm(x))``, as in GPT-2) rather than d2l's
post-norm (``LayerNorm(x + sublayer(x))``): the residual stream is never normalised
away, so the model trains with Adam at a fixed learning rate without warm-up. A final
LayerNorm closes each stack.

Token embeddings are scaled by ``sqrt(d)`` before the sinusoidal positional encoding is
added. They are initialised with standard deviation ``1 / sqrt(d)`` (see
:meth:`TransformerSeq2Seq.init_weights`), so after scaling they have unit size, like the
positional table, and neither drowns out the other.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from ..kv_cache import KVCache
from ..multihead import MultiHeadAttention
from ..positional import PositionalEncoding
from .seq2seq import EncoderDecoder, Seq2SeqConfig, init_seq2seq

__all__ = [
    "PositionWiseFFN",
    "TransformerEncoderBlock",
    "TransformerDecoderBlock",
    "TransformerState",
    "TransformerSeq2Seq",
]


class PositionWiseFFN(nn.Module):
    """The same two-layer MLP applied to every position: ``(b, T, d) -> (b, T, d)``."""

    def __init__(self, num_hiddens: int, ffn_num_hiddens: int) -> None:
        super().__init__()
        self.dense1 = nn.Linear(num_hiddens, ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.Linear(ffn_num_hiddens, num_hiddens)

    def forward(self, X: Tensor) -> Tensor:
        return self.dense2(self.relu(self.dense1(X)))


class TransformerEncoderBlock(nn.Module):
    """Pre-norm block: ``x + SelfAttn(LN(x))`` then ``x + FFN(LN(x))``.

    ``X (b, S, d)``, ``valid_lens (b,)`` ``-> (b, S, d)``; with ``need_weights`` also the
    self-attention weights ``(b, heads, S, S)``. Padded source positions are never
    attended to; their own outputs are computed but ignored downstream. ``backend`` is
    the attention's (see :class:`qkv.MultiHeadAttention`).
    """

    def __init__(self, num_hiddens: int, ffn_num_hiddens: int, num_heads: int, dropout: float,
                 backend: str = "fused"):
        super().__init__()
        self.ln1 = nn.LayerNorm(num_hiddens)
        self.attention = MultiHeadAttention(
            num_hiddens, num_hiddens, None, dropout, num_heads, causal=False, backend=backend
        )
        self.ln2 = nn.LayerNorm(num_hiddens)
        self.ffn = PositionWiseFFN(num_hiddens, ffn_num_hiddens)
        self.dropout = nn.Dropout(dropout)

    def forward(self, X: Tensor, valid_lens: Tensor, *, need_weights: bool = False
                ) -> Tensor | tuple[Tensor, Tensor]:
        attended = self.attention(self.ln1(X), valid_lens=valid_lens, need_weights=need_weights)
        if need_weights:
            attended, weights = attended
        X = X + self.dropout(attended)
        X = X + self.dropout(self.ffn(self.ln2(X)))
        return (X, weights) if need_weights else X


class TransformerDecoderBlock(nn.Module):
    """Pre-norm block: causal self-attention, cross-attention to the encoder, FFN.

    ``X (b, T, d)``, ``enc_outputs (b, S, d)``, ``src_valid_len (b,)`` ``-> (b, T, d)``.
    With ``cache`` the ``T`` new tokens are appended to the self-attention's KV cache and
    attend to everything stored before them. Returns ``(X, self_weights, cross_weights)``:
    with ``need_weights`` the self-attention weights ``(b, heads, T, T_k)`` (``T_k``: the
    tokens in the cache, or ``T``) and the cross-attention weights ``(b, heads, T, S)``;
    else two Nones. ``backend`` is both attentions' (see :class:`qkv.MultiHeadAttention`).
    """

    def __init__(self, num_hiddens: int, ffn_num_hiddens: int, num_heads: int, dropout: float,
                 backend: str = "fused"):
        super().__init__()
        self.ln1 = nn.LayerNorm(num_hiddens)
        self.self_attention = MultiHeadAttention(
            num_hiddens, num_hiddens, None, dropout, num_heads, causal=True, backend=backend
        )
        self.ln2 = nn.LayerNorm(num_hiddens)
        self.cross_attention = MultiHeadAttention(
            num_hiddens, num_hiddens, None, dropout, num_heads, causal=False, backend=backend
        )
        self.ln3 = nn.LayerNorm(num_hiddens)
        self.ffn = PositionWiseFFN(num_hiddens, ffn_num_hiddens)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        X: Tensor,
        enc_outputs: Tensor,
        src_valid_len: Tensor,
        *,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        self_weights = cross_weights = None
        attended = self.self_attention(self.ln1(X), cache=cache, need_weights=need_weights)
        if need_weights:
            attended, self_weights = attended
        X = X + self.dropout(attended)
        attended = self.cross_attention(self.ln2(X), enc_outputs, valid_lens=src_valid_len,
                                        need_weights=need_weights)
        if need_weights:
            attended, cross_weights = attended
        X = X + self.dropout(attended)
        return X + self.dropout(self.ffn(self.ln3(X))), self_weights, cross_weights


@dataclass
class TransformerState:
    """Decoder state of the Transformer.

    enc_outputs: ``(batch, src_len, num_hiddens)``.
    src_valid_len: ``(batch,)``.
    caches: one :class:`qkv.KVCache` per decoder block (its self-attention), buffers
        ``(batch, heads, max_steps, head_dim)``; ``caches[0].pos`` is the number of target
        tokens decoded so far, i.e. the position of the next one.
    """

    enc_outputs: Tensor
    src_valid_len: Tensor
    caches: list[KVCache]

    @property
    def pos(self) -> int:
        return self.caches[0].pos


class TransformerSeq2Seq(EncoderDecoder):
    """Transformer encoder-decoder of width ``num_hiddens`` (see the module docstring).

    Every attention layer runs ``config.backend``: ``"fused"`` (PyTorch's
    ``scaled_dot_product_attention``) or ``"eager"`` (the weights computed explicitly);
    the parameters are the same, so a checkpoint saved under one loads under the other.

    ``model.trace`` (a ``Callable[[str], None]`` or None) logs the tensor shapes of each
    teacher-forced forward and each decode step.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        c = config
        d = c.num_hiddens
        self.num_hiddens = d
        self.trace: Callable[[str], None] | None = None
        self.src_embedding = nn.Embedding(c.src_vocab_size, d)
        self.tgt_embedding = nn.Embedding(c.tgt_vocab_size, d)
        # One table serves both sides; it has no parameters.
        self.pos_encoding = PositionalEncoding(d, c.dropout, c.max_len)
        self.encoder_blocks = nn.ModuleList(
            TransformerEncoderBlock(d, c.ffn_num_hiddens, c.num_heads, c.dropout, c.backend)
            for _ in range(c.num_layers)
        )
        self.encoder_ln = nn.LayerNorm(d)
        self.decoder_blocks = nn.ModuleList(
            TransformerDecoderBlock(d, c.ffn_num_hiddens, c.num_heads, c.dropout, c.backend)
            for _ in range(c.num_layers)
        )
        self.decoder_ln = nn.LayerNorm(d)
        self.dense = nn.Linear(d, c.tgt_vocab_size)

    def init_weights(self) -> None:
        """Xavier-uniform linear weights (as for the GRU model) and ``N(0, 1/d)`` embeddings,
        which the ``sqrt(d)`` scaling brings to unit size."""
        init_seq2seq(self)
        for emb in (self.src_embedding, self.tgt_embedding):
            nn.init.normal_(emb.weight, std=self.num_hiddens**-0.5)

    def _embed(self, embedding: nn.Embedding, tokens: Tensor) -> Tensor:
        """``tokens (b, T) -> (b, T, d)``: scaled embeddings plus positions 0..T-1."""
        return self.pos_encoding(embedding(tokens) * math.sqrt(self.num_hiddens))

    def _encode(self, src: Tensor, src_valid_len: Tensor) -> Tensor:
        X = self._embed(self.src_embedding, src)
        for block in self.encoder_blocks:
            X = block(X, src_valid_len)
        return self.encoder_ln(X)

    def forward(self, src: Tensor, src_valid_len: Tensor, dec_input: Tensor) -> Tensor:
        enc_outputs = self._encode(src, src_valid_len)
        X = self._embed(self.tgt_embedding, dec_input)
        for block in self.decoder_blocks:
            X, _, _ = block(X, enc_outputs, src_valid_len)
        logits = self.dense(self.decoder_ln(X))
        if self.trace is not None:
            self.trace(
                f"transformer forward: src {tuple(src.shape)} -> encoder output "
                f"{tuple(enc_outputs.shape)}; decoder input {tuple(dec_input.shape)} -> logits "
                f"{tuple(logits.shape)}"
            )
        return logits

    def attention_maps(self, src: Tensor, src_valid_len: Tensor, dec_input: Tensor
                       ) -> dict[str, list[Tensor]]:
        """Every attention weight of a teacher-forced :meth:`forward` on ``src (b, S)``
        and ``dec_input (b, T)``, one tensor per layer: ``"encoder"`` self-attention
        ``(b, heads, S, S)``, ``"decoder"`` causal self-attention ``(b, heads, T, T)`` and
        ``"cross"``-attention ``(b, heads, T, S)`` (padded source columns get weight 0)."""
        maps: dict[str, list[Tensor]] = {"encoder": [], "decoder": [], "cross": []}
        X = self._embed(self.src_embedding, src)
        for block in self.encoder_blocks:
            X, weights = block(X, src_valid_len, need_weights=True)
            maps["encoder"].append(weights)
        enc_outputs = self.encoder_ln(X)
        X = self._embed(self.tgt_embedding, dec_input)
        for block in self.decoder_blocks:
            X, self_weights, cross_weights = block(X, enc_outputs, src_valid_len,
                                                   need_weights=True)
            maps["decoder"].append(self_weights)
            maps["cross"].append(cross_weights)
        return maps

    def encode(
        self, src: Tensor, src_valid_len: Tensor, max_steps: int | None = None
    ) -> TransformerState:
        """Run the encoder and allocate one KV cache of ``max_steps`` tokens per decoder
        block (default and upper bound: ``config.max_len``, the positional table's size)."""
        max_steps = self.config.max_len if max_steps is None else max_steps
        if not 0 < max_steps <= self.config.max_len:
            raise ValueError(
                f"max_steps must be in 1..max_len={self.config.max_len}, got {max_steps}"
            )
        enc_outputs = self._encode(src, src_valid_len)
        caches = [
            block.self_attention.new_cache(src.shape[0], max_steps) for block in self.decoder_blocks
        ]
        return TransformerState(enc_outputs, src_valid_len, caches)

    def decode_step(
        self, tokens: Tensor, state: TransformerState
    ) -> tuple[Tensor, TransformerState, Tensor]:
        """Decode one token per row with the KV caches (appended to in place).

        ``tokens (b,)`` ``-> (logits (b, tgt_vocab), state, attn (b, src_len))``; ``attn`` is
        the last block's cross-attention, averaged over heads.
        """
        pos = state.pos
        if pos >= state.caches[0].max_len:
            raise ValueError(
                f"decoded {pos} tokens, the KV cache holds {state.caches[0].max_len}; "
                "pass a larger max_steps to encode()"
            )
        # Same as _embed, but this token sits at position `pos`, not 0.
        pe = self.pos_encoding
        X = self.tgt_embedding(tokens)[:, None] * math.sqrt(self.num_hiddens)
        X = pe.dropout(X + pe.P[:, pos : pos + 1].to(X.dtype))
        last = len(self.decoder_blocks) - 1
        weights = None
        for i, (block, cache) in enumerate(zip(self.decoder_blocks, state.caches, strict=True)):
            X, _, w = block(
                X, state.enc_outputs, state.src_valid_len, cache=cache, need_weights=(i == last)
            )
            weights = w if w is not None else weights
        logits = self.dense(self.decoder_ln(X[:, 0]))
        attn = weights[:, :, 0].mean(dim=1)  # (b, heads, 1, S) -> (b, S)
        if self.trace is not None:
            self.trace(
                f"decode step {pos}: tokens {tuple(tokens.shape)}, KV cache "
                f"{tuple(state.caches[0].keys[:, :, : pos + 1].shape)} x {len(state.caches)} "
                f"blocks, cross-attention {tuple(weights.shape)}, logits {tuple(logits.shape)}"
            )
        return logits, state, attn

    def reorder_state(self, state: TransformerState, index: Tensor) -> TransformerState:
        """Pick rows ``index (k,)`` of the encoder output and of every cache buffer (dim 0),
        keeping each cache's ``pos``."""
        index = index.to(state.enc_outputs.device)
        caches = []
        for cache in state.caches:
            # A shallow copy keeps pos (and anything else the cache tracks); the buffers
            # are replaced by the selected rows, so the old state is left untouched.
            new = copy.copy(cache)
            new.keys = cache.keys.index_select(0, index)
            new.values = cache.values.index_select(0, index)
            caches.append(new)
        return TransformerState(
            enc_outputs=state.enc_outputs.index_select(0, index),
            src_valid_len=state.src_valid_len.index_select(0, index.to(state.src_valid_len.device)),
            caches=caches,
        )
