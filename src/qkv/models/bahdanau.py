"""Bahdanau's translator (d2l §11.4): a GRU encoder, and a GRU decoder with additive attention.

At every step the decoder asks additive attention which source positions matter, with its
last hidden state as the query. The keys of that attention depend only on the source
sentence, so they are projected once per sentence (``attention.project_keys``) and
reused at every step; d2l recomputes them each step.

The encoder and decoder run one of two backends over the same parameters, so a
checkpoint serves either:

- ``"eager"``: d2l's loop as written, calling the ``nn.GRU`` (``rnn``) and
  :class:`qkv.AdditiveAttention` (``attention``) modules at every step; the reference.
- ``"fused"`` (default): the same maths, each recurrence one autograd node with a
  hand-written backward (:mod:`qkv.models.bahdanau_kernels`), several times faster to
  train at d2l's sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import show
from ..functional import BACKENDS, lengths_to_mask
from ..scoring import AdditiveAttention
from . import bahdanau_kernels as fused
from .seq2seq import EncoderDecoder, Seq2SeqConfig

__all__ = ["Seq2SeqEncoder", "Seq2SeqAttentionDecoder", "BahdanauState", "BahdanauSeq2Seq"]

def _check_backend(backend: str) -> None:
    """Raise a one-line ``ValueError`` naming the valid backends, as qkv.MultiHeadAttention."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {show(backend)}")


class Seq2SeqEncoder(nn.Module):
    """Embedding then a multi-layer GRU (``rnn``, an ``nn.GRU``).

    ``X (batch, steps)`` int64 ``-> (outputs (steps, batch, num_hiddens),
    state (num_layers, batch, num_hiddens))``.

    The outputs are time-major, as PyTorch's GRU (and d2l) produce them: ``outputs[t]`` is
    the top layer's hidden state after reading token ``t``; ``state`` holds every layer's
    last hidden state. Padding positions are read too; attention masks them later.

    With ``skip_padding`` and ``valid_len (batch,)`` given, ``state`` is instead every
    layer's state after the row's last real token, as ``nn.GRU`` gives for a packed
    sequence: how much padding follows a sentence then changes nothing the decoder sees.
    (d2l's encoder, the default, hands the decoder the state after the padding.)

    ``backend="eager"`` calls ``self.rnn`` on the embedded sequence. ``"fused"`` (default)
    runs the same GRU (its parameters, maths and forward kernel, and its dropout between
    layers in training) with a hand-written backward, :func:`qkv.models.bahdanau_kernels.gru`,
    which issues a fraction of autograd's operations at these sizes. Dropout draws differ
    between the two; in evaluation both compute the same function.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        num_hiddens: int,
        num_layers: int,
        dropout: float = 0.0,
        *,
        backend: str = "fused",
        skip_padding: bool = False,
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.backend = backend
        self.skip_padding = skip_padding
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(embed_size, num_hiddens, num_layers, dropout=dropout)

    def forward(self, X: Tensor, valid_len: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # Transpose the ids (cheap) rather than the embeddings: the GRU wants time first.
        embs = self.embedding(X.t())  # (steps, batch, embed_size)
        lengths = valid_len if self.skip_padding else None
        if self.backend == "eager":
            if lengths is None:
                return self.rnn(embs)
            steps = embs.shape[0]
            packed = nn.utils.rnn.pack_padded_sequence(
                embs, lengths.clamp(1, steps).cpu(), enforce_sorted=False)
            outputs, state = self.rnn(packed)
            return nn.utils.rnn.pad_packed_sequence(outputs, total_length=steps)[0], state
        return fused.gru(embs, self.rnn, training=self.training, lengths=lengths)


@dataclass
class BahdanauState:
    """Decoder state of the Bahdanau model, the same for both backends.

    enc_outputs: ``(batch, src_len, num_hiddens)``, batch-major for attention (values).
    projected_keys: ``attention.W_k(enc_outputs)``, ``(batch, src_len, num_hiddens)``.
    src_valid_len: ``(batch,)``, d2l's ``valid_lens`` (the eager backend masks with it).
    bias: ``(batch, src_len)``, 0 on real source tokens and ``-inf`` on padding, added to
        the attention scores by the fused backend; ``row_ok``: ``(batch, 1)``, or None when
        no source is empty (see :func:`qkv.models.bahdanau_kernels.score_bias`). Both
        built once.
    hidden: ``(num_layers, batch, num_hiddens)``, the decoder GRU state.
    step: number of decoder steps taken (for trace messages).
    """

    enc_outputs: Tensor
    projected_keys: Tensor
    src_valid_len: Tensor
    bias: Tensor
    row_ok: Tensor | None
    hidden: Tensor
    step: int = 0


class Seq2SeqAttentionDecoder(nn.Module):
    """GRU decoder that attends over the encoder outputs at every step (Bahdanau).

    At step ``t``: the query is the top layer of the previous hidden state; additive
    attention over the encoder outputs (padding masked by ``src_valid_len``) gives a
    context vector; ``[context, embedding(y_t)]`` is fed to the GRU; a dense layer maps
    the GRU output to the vocabulary.

    The parameters are d2l's: ``attention`` (:class:`qkv.AdditiveAttention`), ``rnn``
    (``nn.GRU``), ``embedding`` and ``dense``. ``backend="eager"`` runs d2l's loop, calling
    ``self.attention`` and ``self.rnn`` at every step. ``"fused"`` (default) runs the same
    maths as one autograd node (:func:`qkv.models.bahdanau_kernels.attention_gru`), several
    times faster to train at d2l's sizes. Dropout draws differ between the two; in
    evaluation both compute the same function.

    Attributes:
        attention_weights: ``(batch, steps, src_len)`` weights of the last :meth:`forward`
            (or of the last step only, ``steps = 1``, after :meth:`step`).
        trace: optional callable receiving one line per decoder step (tensor shapes) and,
            for the first batch after it was switched on, per-step norms.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        num_hiddens: int,
        num_layers: int,
        dropout: float = 0.0,
        *,
        backend: str = "fused",
    ) -> None:
        super().__init__()
        _check_backend(backend)
        self.backend = backend
        self.attention = AdditiveAttention(num_hiddens, num_hiddens, num_hiddens, dropout)
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(embed_size + num_hiddens, num_hiddens, num_layers, dropout=dropout)
        self.dense = nn.Linear(num_hiddens, vocab_size)
        self.attention_weights: Tensor | None = None
        self.trace: Callable[[str], None] | None = None
        self.trace_norms_pending = False

    def init_state(
        self, enc_outputs: Tensor, enc_state: Tensor, src_valid_len: Tensor
    ) -> BahdanauState:
        """Start decoding from the encoder's ``outputs (src_len, batch, H)`` and ``state
        (num_layers, batch, H)``, with ``src_valid_len (batch,)``; projects the keys once."""
        outputs = enc_outputs.transpose(0, 1)  # (batch, src_len, num_hiddens)
        keep = lengths_to_mask(src_valid_len.to(outputs.device), outputs.shape[1])[:, 0]
        bias, row_ok = fused.score_bias(keep, outputs.dtype)
        return BahdanauState(
            enc_outputs=outputs,
            projected_keys=self.attention.project_keys(outputs),
            src_valid_len=src_valid_len,
            bias=bias,
            row_ok=row_ok,
            hidden=enc_state,
        )

    def forward(self, X: Tensor, state: BahdanauState) -> tuple[Tensor, BahdanauState]:
        """Teacher forcing over all steps: ``X (batch, T)`` int64
        ``-> (logits (batch, T, vocab), state)``; advances ``state`` in place.

        The recurrence forces a loop over steps (:meth:`_eager` or :meth:`_fused`, as
        ``self.backend`` says); the embeddings and the output layer run once for all steps.
        """
        embs = self.embedding(X.t())  # (T, batch, embed_size)
        run = self._eager if self.backend == "eager" else self._fused
        top, last, weights, contexts, states = run(embs, state)
        self.attention_weights = weights.transpose(0, 1)  # (batch, T, src_len)
        if self.trace is not None:
            norms = self.trace_norms_pending
            self.trace_norms_pending = False  # norms for the first batch after switching on
            before = torch.cat([state.hidden.unsqueeze(0), states[:-1]])
            for t in range(embs.shape[0]):
                self._trace_step(state.step + t, state.hidden.shape)
            if norms:
                self.trace("per-step norms (mean L2 over the batch), first batch only:")
                for t in range(embs.shape[0]):
                    self.trace(_step_norms(state.step + t, embs[t], contexts[t], before[t],
                                           states[t]))
        if self.attention.tap is not None and run == self._fused:
            # each step's query is the top layer's state before it
            before = torch.cat([state.hidden.unsqueeze(0), states[:-1]])
            self._tap_attention(before[:, -1].transpose(0, 1), state)
        state.hidden = last
        state.step += embs.shape[0]
        return self.dense(top.transpose(0, 1)), state  # (batch, T, vocab)

    def _tap_attention(self, queries: Tensor, state: BahdanauState) -> None:
        """The fused kernel's attention, recomputed for ``self.attention.tap`` (qkv.heads)
        beside it: ``queries (batch, T, H)``, the top layer's states the steps started
        from."""
        keep = lengths_to_mask(state.src_valid_len.to(queries.device),
                               state.enc_outputs.shape[1])
        self.attention.tap_beside(queries, state.enc_outputs, state.enc_outputs, keep,
                                  projected_keys=state.projected_keys)

    def step(self, tokens: Tensor, state: BahdanauState) -> tuple[Tensor, Tensor]:
        """One step from ``tokens (batch,)``: ``-> (GRU output (batch, H), weights (batch,
        src_len))``; advances ``state`` in place. Same maths as :meth:`forward` for one
        token (dropout too, in training mode), differentiable by autograd."""
        emb = self.embedding(tokens)  # (batch, embed_size)
        if self.backend == "eager":
            top, last, weights, _, _ = self._eager(emb.unsqueeze(0), state)
            out, weights = top[0], weights[0]
        else:
            if self.attention.tap is not None:
                self._tap_attention(state.hidden[-1].unsqueeze(1), state)
            out, last, weights = self._fused_step(emb, state)
        self.attention_weights = weights.unsqueeze(1)  # (batch, 1, src_len)
        if self.trace is not None:
            self._trace_step(state.step, state.hidden.shape)
        state.hidden = last
        state.step += 1
        return out, weights

    def _eager(
        self, embs: Tensor, state: BahdanauState
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """d2l's loop over ``embs (T, batch, E)``, from ``state.hidden``, which it leaves
        alone. Returns the top layer's states ``(T, batch, H)``, the last state ``(L,
        batch, H)``, the attention weights ``(T, batch, src_len)``, the contexts ``(T,
        batch, H)`` and every state ``(T, L, batch, H)``."""
        hidden = state.hidden
        tops, weights, contexts, states = [], [], [], []
        for emb in embs:  # (batch, E): one target position of every sentence
            query = hidden[-1].unsqueeze(1)  # (batch, 1, H): the top layer's latest state
            context = self.attention(  # (batch, 1, H)
                query, state.enc_outputs, state.enc_outputs, state.src_valid_len,
                projected_keys=state.projected_keys,  # W_k(enc_outputs), made once
            )
            x = torch.cat((context, emb.unsqueeze(1)), dim=-1)  # (batch, 1, H + E)
            out, hidden = self.rnn(x.transpose(0, 1), hidden)  # (1, batch, H), (L, batch, H)
            tops.append(out[0])
            weights.append(self.attention.attention_weights[:, 0])
            contexts.append(context[:, 0])
            states.append(hidden)
        stack = torch.stack
        return stack(tops), hidden, stack(weights), stack(contexts), stack(states)

    def _fused(
        self, embs: Tensor, state: BahdanauState
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """:meth:`_eager`'s maths and results as one autograd node (the weights, contexts
        and states not differentiable); dropout drawn for all steps at once."""
        return fused.attention_gru(
            embs,
            *self._recurrence_inputs(state),
            attn_dropout=self.attention.dropout.p,
            layer_dropout=self.rnn.dropout,
            training=self.training,
        )

    def _fused_step(self, emb: Tensor, state: BahdanauState) -> tuple[Tensor, Tensor, Tensor]:
        """One fused step from ``emb (batch, E)``, differentiable by autograd: ``-> (GRU
        output (batch, H), new state (L, batch, H), weights (batch, src_len))``."""
        inputs = self._recurrence_inputs(state)
        layers, batch, H = inputs[-1], emb.shape[0], self.rnn.hidden_size
        like = state.enc_outputs
        out = fused.decoder_step(
            emb,
            *inputs,
            attn_keep=fused.dropout_keep(like, state.bias.shape, self.attention.dropout.p,
                                         self.training),
            layer_keep=fused.dropout_keep(like, (len(layers) - 1, batch, H), self.rnn.dropout,
                                          self.training) if len(layers) > 1 else None,
        )
        return out.hidden[-1], torch.stack(out.hidden), out.weights

    def _recurrence_inputs(self, state: BahdanauState) -> tuple[Any, ...]:
        """``(values, keys, hidden, bias, row_ok, W_q, w_v, layers)``: what a fused step
        reads besides its input, in :func:`~qkv.models.bahdanau_kernels.decoder_step`'s
        order."""
        return (
            state.enc_outputs,
            state.projected_keys,
            state.hidden,
            state.bias,
            state.row_ok,
            self.attention.W_q.weight,
            self.attention.w_v.weight,
            fused.gru_layers(self.rnn),
        )

    def _trace_step(self, step: int, hidden_shape: torch.Size) -> None:
        layers, batch, H = hidden_shape
        self.trace(
            f"decoder step {step}: query {(batch, 1, H)}, context {(batch, 1, H)}, "
            f"GRU output {(batch, H)}, hidden {(layers, batch, H)}"
        )


@torch.no_grad()
def _step_norms(step: int, emb: Tensor, context: Tensor, before: Tensor, after: Tensor) -> str:
    """One trace line; a hidden state's norm is over all its layers, per example."""

    def norm(x: Tensor) -> float:
        # (..., batch, features) -> one L2 norm per example, averaged over the batch
        per_example = x.transpose(0, -2).reshape(x.shape[-2], -1) if x.dim() == 3 else x
        return per_example.norm(dim=-1).mean().item()

    return (
        f"  step {step}: |embedding| {norm(emb):.3f}  |context| {norm(context):.3f}  "
        f"|h_before| {norm(before):.3f}  |h_after| {norm(after):.3f}  "
        f"|h_after - h_before| {norm(after - before):.3f}"
    )


class BahdanauSeq2Seq(EncoderDecoder):
    """GRU encoder + GRU decoder with additive attention (d2l's ``Seq2SeqAttentionDecoder``).

    Both run ``config.backend`` (``"fused"`` or ``"eager"``, see :class:`Seq2SeqEncoder`
    and :class:`Seq2SeqAttentionDecoder`); the parameters, and so the checkpoints, are
    the same under either.

    Set ``model.trace = print`` (any ``Callable[[str], None]``) to log every decoder step's
    tensor shapes and, for the next batch, per-step norms; ``None`` (default) turns it off.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__(config)
        c = config
        self.encoder = Seq2SeqEncoder(
            c.src_vocab_size, c.embed_size, c.num_hiddens, c.num_layers, c.dropout,
            backend=c.backend, skip_padding=c.skip_padding,
        )
        self.decoder = Seq2SeqAttentionDecoder(
            c.tgt_vocab_size, c.embed_size, c.num_hiddens, c.num_layers, c.dropout,
            backend=c.backend,
        )

    @property
    def trace(self) -> Callable[[str], None] | None:
        return self.decoder.trace

    @trace.setter
    def trace(self, fn: Callable[[str], None] | None) -> None:
        self.decoder.trace = fn
        self.decoder.trace_norms_pending = fn is not None

    def forward(self, src: Tensor, src_valid_len: Tensor, dec_input: Tensor) -> Tensor:
        state = self.encode(src, src_valid_len)
        logits, _ = self.decoder(dec_input, state)
        return logits

    def encode(
        self, src: Tensor, src_valid_len: Tensor, max_steps: int | None = None
    ) -> BahdanauState:
        enc_outputs, enc_state = self.encoder(src, src_valid_len)
        return self.decoder.init_state(enc_outputs, enc_state, src_valid_len)

    def decode_step(
        self, tokens: Tensor, state: BahdanauState
    ) -> tuple[Tensor, BahdanauState, Tensor]:
        out, attn = self.decoder.step(tokens, state)
        return self.decoder.dense(out), state, attn

    def reorder_state(self, state: BahdanauState, index: Tensor) -> BahdanauState:
        index = index.to(state.hidden.device)
        return BahdanauState(
            enc_outputs=state.enc_outputs.index_select(0, index),
            projected_keys=state.projected_keys.index_select(0, index),
            src_valid_len=state.src_valid_len.index_select(0, index.to(state.src_valid_len.device)),
            bias=state.bias.index_select(0, index),
            row_ok=None if state.row_ok is None else state.row_ok.index_select(0, index),
            hidden=state.hidden.index_select(1, index),
            step=state.step,
        )
