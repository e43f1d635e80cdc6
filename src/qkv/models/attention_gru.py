"""The recurrence of Bahdanau's decoder (d2l §11.4), stepped and differentiated as one unit.

At every target step the decoder asks additive attention for a context vector over the
source, feeds ``[context, embedding]`` through a stack of GRU cells, and passes the top
cell's state to the next step as its query. The loop cannot be vectorised over steps,
and at d2l's size (batch 64, 32 hidden units) each operation in it takes microseconds, so
teacher-forced training is dominated by the cost of issuing operations, not by
arithmetic: autograd records and replays several hundred nodes per step.

:func:`attention_gru` runs the whole loop as one autograd node. Forward is the step
below, once per target token. Backward walks the steps in reverse with hand-derived
gradients, and defers every weight gradient to after the loop, where it is one matrix
product over all steps instead of one per step. Together that issues about a tenth of the
operations. :func:`decoder_step` is the same step for decoding one token at a time; the
maths exists once.

The maths, per step ``t`` with ``h[l]`` the previous state of layer ``l``
(PyTorch's GRU gate order ``r, z, n``):

    e       = w_v . tanh(K + W_q h[-1])            additive scores over the source
    a       = softmax(e + bias)                      bias: 0 or -inf (padding)
    c       = dropout(a) @ V                         context
    g_i     = [c, emb_t] W_ih^T + b_ih   (layer 0; layer l > 0: dropout(h_new[l-1]))
    g_h     = h[l] W_hh^T + b_hh
    r, z    = sigmoid(g_i[:2H] + g_h[:2H])
    n       = tanh(g_i[2H:] + r * g_h[2H:])
    h_new   = n + z * (h[l] - n)

``tests/test_models_seq2seq.py`` checks values and every gradient against the same model
written with autograd (``torch.gru_cell``, :class:`qkv.AdditiveAttention`) in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GRULayer",
    "StepOutput",
    "attention_gru",
    "decoder_step",
    "dropout_keep",
    "gru",
    "gru_layers",
    "score_bias",
]


@dataclass
class GRULayer:
    """One layer's GRU parameters as ``nn.GRU`` stores them (``(3H, in)``, ``(3H, H)``, ...).

    ``W_ih`` and ``b_ih`` of layer 0 may be None where its input projection is computed
    before the loop.

    Layer 0's input weight is split by the caller: its context columns go to
    :func:`decoder_step` as ``W_ctx``; its embedding columns are applied to every step's
    embedding at once, before the loop.
    """

    W_ih: Tensor | None
    b_ih: Tensor | None
    W_hh: Tensor
    b_hh: Tensor


def gru_layers(rnn: torch.nn.GRU) -> list[GRULayer]:
    """The parameters of a unidirectional ``nn.GRU``, one :class:`GRULayer` per layer."""
    if rnn.bidirectional or rnn.batch_first or not rnn.bias:
        raise ValueError("only a unidirectional, time-major nn.GRU with biases is supported")
    names = ("weight_ih", "bias_ih", "weight_hh", "bias_hh")
    return [
        GRULayer(*(getattr(rnn, f"{name}_l{i}") for name in names))
        for i in range(rnn.num_layers)
    ]


@dataclass
class StepOutput:
    """What one step computes: the new state and, for backward, its intermediates."""

    hidden: list[Tensor]  # new state per layer, each (batch, H)
    weights: Tensor  # (batch, S) attention weights (before dropout)
    kept: Tensor  # (batch, S) the weights the context used (after dropout)
    features: Tensor  # (batch, S, H) sigmoid(2 (K + W_q query)), i.e. (1 + tanh) / 2
    context: Tensor  # (batch, H)
    inputs: list[Tensor]  # per layer l > 0, its input (batch, H) after dropout
    rz: list[Tensor]  # per layer, (batch, 2H) reset and update gates
    n: list[Tensor]  # per layer, (batch, H) candidate state
    gh_n: list[Tensor]  # per layer, (batch, H) the candidate's hidden projection


def score_bias(keep: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``keep (batch, S)`` bool (True = real token) -> ``(bias (batch, S), row_ok)``.

    ``bias`` is 0 where attention may look and ``-inf`` elsewhere, added to the scores
    at every step instead of re-masking them. A row with no real token at all would give
    ``softmax = 0/0``; its bias is opened to all zeros and ``row_ok (batch, 1)`` (None when
    every row has a token) zeroes its weights, as :func:`qkv.functional.softmax_with_mask`.
    """
    row_ok = keep.any(dim=-1, keepdim=True)
    guarded = keep | ~row_ok
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    bias = bias.masked_fill(~guarded, float("-inf"))
    return bias, (None if bool(row_ok.all()) else row_ok.to(dtype))


def dropout_keep(
    like: Tensor,
    shape: tuple[int, ...],
    p: float,
    training: bool,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """Dropout as a multiplier: 0 with probability ``p``, else ``1 / (1 - p)``.

    None when nothing is dropped (evaluation, or ``p == 0``). Drawing every step's mask
    at once replaces one random draw per step and layer with one per batch.
    """
    if not training or p == 0:
        return None
    # uniform < 1 - p is a Bernoulli(1 - p) draw, at half the cost of torch.bernoulli here
    keep = torch.rand(shape, generator=generator, device=like.device) < 1.0 - p
    return keep.to(like.dtype).mul_(1.0 / (1.0 - p) if p < 1 else 0.0)


def decoder_step(
    gi_emb: Tensor,
    hidden: Sequence[Tensor],
    values: Tensor,
    keys: Tensor,
    bias: Tensor,
    row_ok: Tensor | None,
    W_q: Tensor,
    w_v: Tensor,
    W_ctx: Tensor,
    layers: Sequence[GRULayer],
    attn_keep: Tensor | None = None,
    layer_keep: Tensor | None = None,
) -> StepOutput:
    """One decoder step.

    Args:
        gi_emb: ``(batch, 3H)``, layer 0's input projection of this step's embedding,
            plus ``b_ih`` of layer 0.
        hidden: ``num_layers`` tensors ``(batch, H)``, the previous state.
        values: ``(batch, S, H)`` encoder outputs; ``keys``: ``W_k(values)``, same shape.
        bias, row_ok: from :func:`score_bias`.
        W_q: ``(H, H)``; ``w_v``: ``(1, H)``; ``W_ctx``: ``(3H, H)``, layer 0's input
            weight columns for the context.
        layers: the GRU layers (layer 0's ``W_ih``, ``b_ih`` are not used here).
        attn_keep: ``(batch, S)`` dropout multiplier of the attention weights (0 or
            ``1/(1-p)``), or None for no dropout.
        layer_keep: ``(num_layers - 1, batch, H)`` dropout multipliers between layers.
    """
    attention = _Attention.of(values, keys, bias, row_ok, W_q, w_v, W_ctx)
    return _step(gi_emb, hidden, attention, _transposed(layers), attn_keep, layer_keep)


@dataclass
class _Attention:
    """The attention inputs of a step, weights pre-transposed for ``x @ W``."""

    values: Tensor
    keys2: Tensor  # 2 K, (batch, S, H)
    bias: Tensor
    row_ok: Tensor | None
    W_q_t2: Tensor  # 2 W_q^T, (H, H)
    w_v2: Tensor  # 2 w_v, (H,)
    W_ctx_t: Tensor  # (H, 3H)

    @classmethod
    def of(cls, values: Tensor, keys: Tensor, bias: Tensor, row_ok: Tensor | None,
           W_q: Tensor, w_v: Tensor, W_ctx: Tensor) -> _Attention:
        # tanh(u) = 2 sigmoid(2u) - 1, and sigmoid runs ~6x faster than tanh on the CPU
        # (the (batch, S, H) features are the largest tensor of a step). The scores
        # w_v . tanh(u) = 2 w_v . sigmoid(2u) - sum(w_v): the constant drops out of the
        # softmax, so the step computes sigmoid(2u) and scores with 2 w_v.
        return cls(values, 2 * keys, bias, row_ok, 2 * W_q.t(), 2 * w_v[0], W_ctx.t())


def _transposed(layers: Sequence[GRULayer]) -> list[GRULayer]:
    # Transposed views once per sequence rather than once per step and matrix.
    return [
        GRULayer(None if x.W_ih is None else x.W_ih.t(), x.b_ih, x.W_hh.t(), x.b_hh)
        for x in layers
    ]


def _step(
    gi0: Tensor,
    hidden: Sequence[Tensor],
    att: _Attention,
    layers_t: Sequence[GRULayer],
    attn_keep: Tensor | None,
    layer_keep: Tensor | None,
) -> StepOutput:
    """One step: attend, then the stacked GRU.

    ``gi0 (batch, 3H)``: layer 0's input projection of the embedding (the context's share
    is added here). ``layers_t``: weights transposed, ``(in, 3H)``.
    """
    H = hidden[0].shape[-1]
    query = hidden[-1]
    # sigmoid(2 (K + W_q query)) = (1 + tanh(K + W_q query)) / 2, (batch, S, H)
    features = torch.sigmoid(att.keys2 + (query @ att.W_q_t2).unsqueeze(1))
    weights = torch.softmax(torch.matmul(features, att.w_v2) + att.bias, dim=-1)
    if att.row_ok is not None:
        weights = weights * att.row_ok
    kept = weights if attn_keep is None else weights * attn_keep
    context = torch.bmm(kept.unsqueeze(1), att.values).squeeze(1)  # (batch, H)
    out = StepOutput([], weights, kept, features, context, [], [], [], [])
    gi = torch.addmm(gi0, context, att.W_ctx_t)
    for i, layer in enumerate(layers_t):
        if i > 0:
            x = out.hidden[-1] if layer_keep is None else out.hidden[-1] * layer_keep[i - 1]
            out.inputs.append(x)
            gi = torch.addmm(layer.b_ih, x, layer.W_ih)
        h = hidden[i]
        gh = torch.addmm(layer.b_hh, h, layer.W_hh)
        rz = torch.sigmoid(gi[:, : 2 * H] + gh[:, : 2 * H])
        gh_n = gh[:, 2 * H :]
        n = torch.tanh(torch.addcmul(gi[:, 2 * H :], rz[:, :H], gh_n))
        out.hidden.append(torch.lerp(n, h, rz[:, H:]))  # n + z * (h - n)
        out.rz.append(rz)
        out.n.append(n)
        out.gh_n.append(gh_n)
    return out


def _gate_factors(
    rz: Tensor, n: Tensor, gh_n: Tensor, before: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The local derivatives of GRU cells, for any number of steps and layers at once.

    ``rz (..., 2H)``, ``n``, ``gh_n``, ``before`` (the state each step read) ``(..., H)``
    ``-> (g_i, g_h (..., 3, H), z (..., H))``. Every gradient of a cell's pre-activations
    is the gradient of its new state times a factor known from forward:

        d n_pre = dh (1 - z)(1 - n^2)        d z_pre = dh (h - n) z (1 - z)
        d r_pre = d n_pre gh_n r (1 - r)

    so ``d gi = dh * g_i`` and ``d gh = dh * g_h`` (gate order r, z, n; the hidden
    projection's n part is scaled by r), and backward through a cell is two products and
    one matrix product. Computed once, in a few large operations.
    """
    H = n.shape[-1]
    r, z = rz[..., :H], rz[..., H:]
    f_n = (1 - z) * (1 - n * n)
    f_r = f_n * gh_n * (r - r * r)
    f_z = (before - n) * (z - z * z)
    return torch.stack((f_r, f_z, f_n), -2), torch.stack((f_r, f_z, f_n * r), -2), z


def _cell_backward(
    dh: Tensor, g_i: Tensor, g_h: Tensor, z: Tensor, W_hh: Tensor, d_gi: Tensor, d_gh: Tensor
) -> Tensor:
    """Backward through one GRU cell: ``dh (batch, H)``, the gradient of its new state ->
    the gradient of the state it read. Writes the gradients of its input and hidden
    projections into ``d_gi``, ``d_gh`` (contiguous ``(batch, 3H)``); ``g_i``, ``g_h``,
    ``z`` from :func:`_gate_factors`."""
    dh3 = dh.unsqueeze(1)  # (batch, 1, H) against (batch, 3, H)
    torch.mul(dh3, g_i, out=d_gi.view(g_i.shape))
    torch.mul(dh3, g_h, out=d_gh.view(g_h.shape))
    return torch.addmm(dh * z, d_gh, W_hh)


class _GRUStack(torch.autograd.Function):
    """A stacked GRU (the encoder's ``nn.GRU``) with the recurrence's backward.

    Forward runs PyTorch's own GRU kernel (a C++ loop over steps) one layer at a time,
    without recording anything for autograd. Backward recomputes every step's gates from
    the saved states in a few matrix products over all steps at once, then runs the
    recurrence backwards with :func:`_cell_backward`, one layer after the other: a layer
    never feeds back into the one below, so each is finished before the next.

    Inputs: ``x (T, batch, in)``, ``hidden (L, batch, H)``, ``layer_keep (T, L-1, batch,
    H)`` or None, then per layer ``W_ih, b_ih, W_hh, b_hh``. Outputs: ``(T, batch, H)``
    the top layer's states, ``(L, batch, H)`` the last state of every layer.
    """

    @staticmethod
    def forward(ctx, x, hidden, layer_keep, *flat):  # noqa: ANN001, ANN205
        layers = [GRULayer(*flat[i : i + 4]) for i in range(0, len(flat), 4)]
        outputs, inputs = [], x
        for i, layer in enumerate(layers):
            if i > 0:
                inputs = outputs[-1] if layer_keep is None else outputs[-1] * layer_keep[:, i - 1]
            out, _ = torch.gru(
                inputs, hidden[i : i + 1], [layer.W_ih, layer.W_hh, layer.b_ih, layer.b_hh],
                True, 1, 0.0, False, False, False,  # biases, 1 layer, no dropout, eval, ...
            )
            outputs.append(out)
        ctx.save_for_backward(x, hidden, layer_keep, *flat, *outputs)
        ctx.num_layers = len(layers)
        return outputs[-1].clone(), torch.stack([out[-1] for out in outputs])

    @staticmethod
    def backward(ctx, d_top, d_last):  # noqa: ANN001, ANN205
        L = ctx.num_layers
        x, hidden, layer_keep, *rest = ctx.saved_tensors
        flat, outputs = rest[: 4 * L], rest[4 * L :]
        layers = [GRULayer(*flat[i : i + 4]) for i in range(0, len(flat), 4)]
        T, B, H = outputs[0].shape
        need = ctx.needs_input_grad
        grads: list[Tensor | None] = [None] * (3 + 4 * L)
        d_out = d_top  # gradient of the current layer's outputs, (T, batch, H) or None
        d_hidden = []
        for i in reversed(range(L)):
            layer = layers[i]
            if i == 0:
                inputs = x
            else:
                keep = None if layer_keep is None else layer_keep[:, i - 1]
                inputs = outputs[i - 1] if keep is None else outputs[i - 1] * keep
            before = torch.cat([hidden[i].unsqueeze(0), outputs[i][:-1]])
            # the forward pass's gates, recomputed for all steps at once
            gi = torch.addmm(layer.b_ih, inputs.reshape(T * B, -1), layer.W_ih.t())
            gh = torch.addmm(layer.b_hh, before.reshape(T * B, H), layer.W_hh.t())
            gi, gh = gi.view(T, B, 3 * H), gh.view(T, B, 3 * H)
            rz = torch.sigmoid(gi[..., : 2 * H] + gh[..., : 2 * H])
            gh_n = gh[..., 2 * H :]
            n = torch.tanh(torch.addcmul(gi[..., 2 * H :], rz[..., :H], gh_n))
            G_i, G_h, Z = (f.unbind(0) for f in _gate_factors(rz, n, gh_n, before))
            d_gi, d_gh = gi.new_empty(T, B, 3 * H), gh.new_empty(T, B, 3 * H)
            D_gi, D_gh = d_gi.unbind(0), d_gh.unbind(0)
            dh = d_last[i] if d_last is not None else x.new_zeros(B, H)
            d_outs = d_out.unbind(0) if d_out is not None else None
            for t in reversed(range(T)):
                if d_outs is not None:
                    dh = dh + d_outs[t]
                dh = _cell_backward(dh, G_i[t], G_h[t], Z[t], layer.W_hh, D_gi[t], D_gh[t])
            d_hidden.append(dh)
            flat_gi, flat_gh = d_gi.view(T * B, 3 * H), d_gh.view(T * B, 3 * H)
            base = 3 + 4 * i
            if need[base]:
                grads[base] = flat_gi.t() @ inputs.reshape(T * B, -1)
            if need[base + 1]:
                grads[base + 1] = flat_gi.sum(0)
            if need[base + 2]:
                grads[base + 2] = flat_gh.t() @ before.reshape(T * B, H)
            if need[base + 3]:
                grads[base + 3] = flat_gh.sum(0)
            # the gradient of this layer's inputs, for all steps at once
            if i > 0 or need[0]:
                d_in = (flat_gi @ layer.W_ih).view(T, B, -1)
                if i > 0 and layer_keep is not None:
                    d_in = d_in * layer_keep[:, i - 1]
                d_out = d_in
        grads[0] = d_out if need[0] else None
        grads[1] = torch.stack(d_hidden[::-1]) if need[1] else None
        return tuple(grads)


def gru(
    x: Tensor,
    rnn: torch.nn.GRU,
    hidden: Tensor | None = None,
    *,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """``rnn(x, hidden)`` for a unidirectional, time-major ``nn.GRU``, with its dropout
    between layers in training: ``x (T, batch, in) -> (outputs (T, batch, H),
    last (L, batch, H))``.

    Same maths, parameters and kernel as calling ``rnn``; the backward is
    :class:`_GRUStack`'s, which issues a fraction of the operations autograd's does
    through ``nn.GRU`` at small sizes.
    """
    layers = gru_layers(rnn)
    T, B = x.shape[:2]
    L, H = len(layers), rnn.hidden_size
    if hidden is None:
        hidden = x.new_zeros(L, B, H)
    layer_keep = (
        dropout_keep(x, (T, L - 1, B, H), rnn.dropout, training, generator) if L > 1 else None
    )
    flat = [t for layer in layers for t in (layer.W_ih, layer.b_ih, layer.W_hh, layer.b_hh)]
    return _GRUStack.apply(x, hidden, layer_keep, *flat)


class _GRURecurrence(torch.autograd.Function):
    """The decoder's stacked GRU over ``T`` steps, attending at each, with a hand-written
    backward (see the module docstring).

    Inputs, in order: ``gi0 (T, batch, 3H)`` (layer 0's input projection of the
    embeddings, its ``b_ih`` included), ``hidden (L, batch, H)``, ``layer_keep (T, L-1,
    batch, H)`` or None, the attention's ``values``, ``keys`` ``(batch, S, H)``, ``bias``,
    ``row_ok``, ``attn_keep (T, batch, S)`` or None, ``W_q``, ``w_v``, ``W_ctx``, then per
    layer ``W_ih, b_ih, W_hh, b_hh`` (layer 0's ``W_ih, b_ih`` are None).

    Outputs: ``top (T, batch, H)`` the top layer's state after each step, ``last (L, batch,
    H)`` the final state, and, not differentiable, every layer's state ``(T, L, batch, H)``,
    the attention weights ``(T, batch, S)`` and the contexts ``(T, batch, H)``.
    """

    @staticmethod
    def forward(ctx, gi0, hidden, layer_keep, values, keys, bias, row_ok, attn_keep,
                W_q, w_v, W_ctx, *flat):  # noqa: ANN001, ANN205 (autograd's signature)
        layers = [GRULayer(*flat[i : i + 4]) for i in range(0, len(flat), 4)]
        att = _Attention.of(values, keys, bias, row_ok, W_q, w_v, W_ctx)
        layers_t = _transposed(layers)
        state = list(hidden.unbind(0))
        steps: list[StepOutput] = []
        gi0_steps = gi0.unbind(0)
        attn_keeps = attn_keep.unbind(0) if attn_keep is not None else None
        layer_keeps = layer_keep.unbind(0) if layer_keep is not None else None
        for t in range(len(gi0_steps)):
            step = _step(
                gi0_steps[t], state, att, layers_t,
                None if attn_keeps is None else attn_keeps[t],
                None if layer_keeps is None else layer_keeps[t],
            )
            steps.append(step)
            state = step.hidden

        L, T = len(layers), len(steps)

        def by_step_and_layer(per_layer: list[list[Tensor]]) -> Tensor:
            # one stack for all steps and layers: (T, layers, batch, X)
            flat = [x for layer_list in per_layer for x in layer_list]
            return torch.stack(flat).view(T, -1, *flat[0].shape)

        states = by_step_and_layer([s.hidden for s in steps])  # (T, L, batch, H)
        before = torch.cat([hidden.unsqueeze(0), states[:-1]])  # the state each step read
        saved = [
            before,
            by_step_and_layer([s.rz for s in steps]),
            by_step_and_layer([s.n for s in steps]),
            by_step_and_layer([s.gh_n for s in steps]),
            by_step_and_layer([s.inputs for s in steps]) if L > 1 else None,
        ]
        weights = torch.stack([s.weights for s in steps])
        contexts = torch.stack([s.context for s in steps])
        saved += [
            weights, contexts,
            torch.stack([s.features for s in steps]),
            torch.stack([s.kept for s in steps]) if attn_keep is not None else weights,
        ]
        ctx.save_for_backward(layer_keep, values, keys, row_ok, attn_keep, W_q, w_v, W_ctx,
                              *flat, *saved)
        ctx.num_layers = L
        ctx.mark_non_differentiable(states, weights, contexts)
        # copies, not views: autograd tracks each differentiable output on its own
        return states[:, -1].clone(), states[-1].clone(), states, weights, contexts

    @staticmethod
    def backward(ctx, d_top, d_last, _s, _w, _c):  # noqa: ANN001, ANN205
        L = ctx.num_layers
        layer_keep, values, keys, row_ok, attn_keep, W_q, w_v, W_ctx, *rest = ctx.saved_tensors
        flat, saved = rest[: 4 * L], rest[4 * L :]
        layers = [GRULayer(*flat[i : i + 4]) for i in range(0, len(flat), 4)]
        before, rz_all, n_all, ghn_all, inputs, weights, contexts, features, kept = saved
        T, _, B, H = before.shape

        # Gradients of every step's pre-activations, filled in reverse; the weight
        # gradients are one product each over all steps, after the loop.
        d_gi = before.new_empty(L, T, B, 3 * H)
        d_gh = before.new_empty(L, T, B, 3 * H)
        dh = (
            list(d_last.unbind(0))
            if d_last is not None
            else [before.new_zeros(B, H) for _ in range(L)]
        )
        d_tops = d_top.unbind(0) if d_top is not None else None
        d_scores = weights.new_empty(weights.shape)  # (T, batch, S)
        d_query = before.new_empty(T, B, H)  # d (W_q query)
        d_context = before.new_empty(T, B, H)

        factors = _gate_factors(rz_all, n_all, ghn_all, before)
        w_v4 = 4 * w_v[0]
        d_keys = keys.new_zeros(keys.shape) if ctx.needs_input_grad[4] else None

        def views(x: Tensor) -> list[tuple[Tensor, ...]]:
            # per step and layer, split once (in C++) rather than indexed in the loop
            return [row.unbind(0) for row in x.unbind(0)]

        G_i, G_h, Z = (views(f) for f in factors)
        D_gi, D_gh = views(d_gi.transpose(0, 1)), views(d_gh.transpose(0, 1))
        keeps = views(layer_keep) if layer_keep is not None else None
        for t in reversed(range(T)):
            if d_tops is not None:
                dh[L - 1] = dh[L - 1] + d_tops[t]
            for i in reversed(range(L)):
                gi = D_gi[t][i]
                dh[i] = _cell_backward(dh[i], G_i[t][i], G_h[t][i], Z[t][i], layers[i].W_hh,
                                       gi, D_gh[t][i])
                if i > 0:
                    dx = gi @ layers[i].W_ih
                    if keeps is not None:
                        dx = dx * keeps[t][i - 1]
                    dh[i - 1] = dh[i - 1] + dx
            # context = kept @ V, kept = dropout(weights), weights = softmax(scores + bias)
            torch.mm(D_gi[t][0], W_ctx, out=d_context[t])
            # d kept, (batch, S); a broadcast product beats a batch of 64 tiny bmm's here
            d_kept = (values * d_context[t].unsqueeze(1)).sum(-1)
            # Softmax backward with dropout and the empty-row guard folded in: with
            # kept = a * keep (a = weights, zero on guarded rows), d a = d_kept * keep, and
            # d scores = a * (d a - sum(a * d a)) = kept * d_kept - a * sum(kept * d_kept).
            kd = kept[t] * d_kept
            torch.addcmul(kd, weights[t], kd.sum(-1, keepdim=True), value=-1, out=d_scores[t])
            # d score / d tanh argument, (batch, S, H): w_v (1 - tanh^2) = 4 w_v s (1 - s).
            # Per step, not for all steps at once: this size stays in cache.
            f = features[t]
            g_f = torch.addcmul(f, f, f, value=-1).mul_(w_v4)
            # d (W_q query) = sum over source positions of d_score * g_f
            torch.bmm(d_scores[t].unsqueeze(1), g_f, out=d_query[t].unsqueeze(1))
            dh[L - 1] = torch.addmm(dh[L - 1], d_query[t], W_q)
            if d_keys is not None:
                d_keys.addcmul_(d_scores[t].unsqueeze(-1), g_f)

        need = ctx.needs_input_grad

        def flat2(x: Tensor) -> Tensor:
            return x.reshape(-1, x.shape[-1])

        grads: list[Tensor | None] = [None] * (11 + 4 * L)
        grads[0] = d_gi[0] if need[0] else None
        grads[1] = torch.stack(dh) if need[1] else None
        if need[3]:
            # sum over steps of kept^T d_context: (batch, S, T) @ (batch, T, H)
            grads[3] = torch.bmm(kept.permute(1, 2, 0), d_context.transpose(0, 1))
        grads[4] = d_keys
        if need[8]:
            grads[8] = flat2(d_query).t() @ flat2(before[:, L - 1])
        if need[9]:
            # d score / d w_v = tanh = 2 s - 1, summed against d_scores without forming it
            grads[9] = 2 * (d_scores.reshape(1, -1) @ flat2(features)) - d_scores.sum()
        if need[10]:
            grads[10] = flat2(d_gi[0]).t() @ flat2(contexts)
        for i in range(L):
            base = 11 + 4 * i
            if i > 0 and need[base]:
                grads[base] = flat2(d_gi[i]).t() @ flat2(inputs[:, i - 1])
            if i > 0 and need[base + 1]:
                grads[base + 1] = d_gi[i].sum((0, 1))
            if need[base + 2]:
                grads[base + 2] = flat2(d_gh[i]).t() @ flat2(before[:, i])
            if need[base + 3]:
                grads[base + 3] = d_gh[i].sum((0, 1))
        return tuple(grads)


def _flat_layers(layers: Sequence[GRULayer]) -> list[Tensor | None]:
    flat: list[Tensor | None] = []
    for i, layer in enumerate(layers):
        flat += [None, None] if i == 0 else [layer.W_ih, layer.b_ih]
        flat += [layer.W_hh, layer.b_hh]
    return flat


def attention_gru(
    gi_emb: Tensor,
    values: Tensor,
    keys: Tensor,
    hidden: Tensor,
    bias: Tensor,
    row_ok: Tensor | None,
    W_q: Tensor,
    w_v: Tensor,
    W_ctx: Tensor,
    layers: Sequence[GRULayer],
    *,
    attn_dropout: float = 0.0,
    layer_dropout: float = 0.0,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Run the decoder over ``T`` teacher-forced steps.

    ``gi_emb (T, batch, 3H)``: layer 0's input projection of every step's embedding (plus
    its ``b_ih``); the other arguments as :func:`decoder_step`. Dropout on the attention
    weights (``attn_dropout``, as :class:`qkv.AdditiveAttention`) and between GRU layers
    (``layer_dropout``, as ``nn.GRU``) is drawn for all steps at once when ``training``.

    Returns ``top (T, batch, H)`` (the top layer's state after each step),
    ``last (L, batch, H)`` (the final state), and, not differentiable, the attention
    weights ``(T, batch, S)``, the contexts ``(T, batch, H)`` and every state
    ``(T, L, batch, H)``.
    """
    T, B = gi_emb.shape[:2]
    L, H, S = len(layers), values.shape[-1], values.shape[1]
    attn_keep = dropout_keep(values, (T, B, S), attn_dropout, training, generator)
    layer_keep = (
        dropout_keep(values, (T, L - 1, B, H), layer_dropout, training, generator)
        if L > 1
        else None
    )
    top, last, states, weights, contexts = _GRURecurrence.apply(
        gi_emb, hidden, layer_keep, values, keys, bias, row_ok, attn_keep, W_q, w_v, W_ctx,
        *_flat_layers(layers),
    )
    return top, last, weights, contexts, states
