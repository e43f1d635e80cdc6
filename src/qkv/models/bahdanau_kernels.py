"""The fused backend of Bahdanau's translator (d2l §11.4): its two recurrences, each
differentiated as one unit.

:class:`qkv.models.Seq2SeqEncoder` and :class:`qkv.models.Seq2SeqAttentionDecoder` run
these kernels with ``backend="fused"`` (the default); ``backend="eager"`` runs the same
maths as d2l writes it, calling the ``nn.GRU`` and :class:`qkv.AdditiveAttention` modules
step by step. Both read the same parameters, so a checkpoint serves either.

At every target step the decoder asks additive attention for a context vector over the
source, feeds ``[context, embedding]`` through a stack of GRU cells, and passes the top
cell's state to the next step as its query. The loop cannot be vectorised over steps,
and at d2l's size (batch 64, 32 hidden units) each operation in it takes microseconds, so
teacher-forced training is dominated by the cost of issuing operations, not by
arithmetic: autograd records and replays several hundred nodes per step.

:func:`attention_gru` (the decoder) and :func:`gru` (the encoder's ``nn.GRU``) each run
as one autograd node. Forward steps PyTorch's own GRU cell (``torch.gru_cell``; the
encoder, PyTorch's whole-sequence GRU kernel) without recording anything. Backward
recomputes every step's gates from the saved states in a few matrix products over all
steps, walks the steps in reverse with hand-derived gradients (one product and one
matrix product per cell), and computes every weight gradient after the loop as one
matrix product over all steps. :func:`decoder_step` is the decoder's step for decoding
one token at a time; the maths exists once.

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

``tests/test_models_seq2seq.py`` checks values and every gradient in float64 against the
same models written with autograd (``torch.gru_cell``, ``nn.GRU``) and against the eager
backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    """One layer's GRU parameters as ``nn.GRU`` stores them: ``W_ih (3H, in)``,
    ``b_ih (3H,)``, ``W_hh (3H, H)``, ``b_hh (3H,)``, gates in the order r, z, n."""

    W_ih: Tensor
    b_ih: Tensor
    W_hh: Tensor
    b_hh: Tensor

    def flat(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.W_ih, self.b_ih, self.W_hh, self.b_hh


def gru_layers(rnn: torch.nn.GRU) -> list[GRULayer]:
    """The parameters of a unidirectional ``nn.GRU``, one :class:`GRULayer` per layer."""
    if rnn.bidirectional or rnn.batch_first or not rnn.bias:
        raise ValueError("only a unidirectional, time-major nn.GRU with biases is supported")
    names = ("weight_ih", "bias_ih", "weight_hh", "bias_hh")
    return [
        GRULayer(*(getattr(rnn, f"{name}_l{i}") for name in names))
        for i in range(rnn.num_layers)
    ]


def _unflatten(flat: Sequence[Tensor]) -> list[GRULayer]:
    return [GRULayer(*flat[i : i + 4]) for i in range(0, len(flat), 4)]


@dataclass
class StepOutput:
    """What one decoder step computes: the new state and what backward needs."""

    weights: Tensor  # (batch, S) attention weights (before dropout)
    kept: Tensor  # (batch, S) the weights the context used (after dropout)
    features: Tensor  # (batch, S, H) sigmoid(2 (K + W_q query)), i.e. (1 + tanh) / 2
    context: Tensor  # (batch, H)
    hidden: list[Tensor] = field(default_factory=list)  # new state per layer, (batch, H)
    inputs: list[Tensor] = field(default_factory=list)  # input of layers > 0, after dropout


def score_bias(keep: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``keep (batch, S)`` bool (True = real token) -> ``(bias (batch, S), row_ok)``.

    ``bias`` is 0 where attention may look and ``-inf`` elsewhere, added to the scores
    at every step instead of re-masking them. A row with no real token at all would give
    ``softmax = 0/0``; its bias is opened to all zeros and ``row_ok (batch, 1)`` (None when
    every row has a token) zeroes its weights, as :func:`qkv.functional.softmax_with_mask`.
    """
    row_ok = keep.any(dim=-1, keepdim=True)
    # an empty row is opened whole: finite (meaningless) weights, then zeroed by row_ok
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    bias = bias.masked_fill(~(keep | ~row_ok), float("-inf"))
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
    # (torch.compile cannot trace an explicit generator=None with symbolic sizes.)
    draw = torch.rand(shape, device=like.device) if generator is None else \
        torch.rand(shape, generator=generator, device=like.device)
    keep = draw < 1.0 - p
    return keep.to(like.dtype).mul_(1.0 / (1.0 - p) if p < 1 else 0.0)


def decoder_step(
    emb: Tensor,
    values: Tensor,
    keys: Tensor,
    hidden: Tensor,
    bias: Tensor,
    row_ok: Tensor | None,
    W_q: Tensor,
    w_v: Tensor,
    layers: Sequence[GRULayer],
    attn_keep: Tensor | None = None,
    layer_keep: Tensor | None = None,
) -> StepOutput:
    """One decoder step (differentiable by autograd).

    Args:
        emb: ``(batch, embed_size)``, this step's input token embedded.
        values: ``(batch, S, H)`` encoder outputs; ``keys``: ``W_k(values)``, same shape.
        hidden: ``(num_layers, batch, H)``, the previous state.
        bias, row_ok: from :func:`score_bias`.
        W_q: ``(H, H)``; ``w_v``: ``(1, H)``: the additive attention's weights.
        layers: the GRU's layers; layer 0 reads ``[context, emb]``.
        attn_keep: ``(batch, S)`` dropout multiplier of the attention weights (0 or
            ``1/(1-p)``), or None for no dropout.
        layer_keep: ``(num_layers - 1, batch, H)`` dropout multipliers between layers.
    """
    attention = _Attention.of(values, keys, bias, row_ok, W_q, w_v)
    return _step(emb, hidden.unbind(0), attention, layers, attn_keep, layer_keep)


@dataclass
class _Attention:
    """A decoder's attention inputs, prepared once per sequence."""

    values: Tensor
    keys2: Tensor  # 2 K, (batch, S, H)
    bias: Tensor
    row_ok: Tensor | None
    W_q_t2: Tensor  # 2 W_q^T, (H, H)
    w_v2: Tensor  # 2 w_v, (H,)

    @classmethod
    def of(cls, values: Tensor, keys: Tensor, bias: Tensor, row_ok: Tensor | None,
           W_q: Tensor, w_v: Tensor) -> _Attention:
        # tanh(u) = 2 sigmoid(2u) - 1, and sigmoid runs ~6x faster than tanh on the CPU
        # (the (batch, S, H) features are the largest tensor of a step). The scores
        # w_v . tanh(u) = 2 w_v . sigmoid(2u) - sum(w_v): the constant drops out of the
        # softmax, so the step computes sigmoid(2u) and scores with 2 w_v.
        return cls(values, 2 * keys, bias, row_ok, 2 * W_q.t(), 2 * w_v[0])


def _step(
    emb: Tensor,
    hidden: Sequence[Tensor],
    att: _Attention,
    layers: Sequence[GRULayer],
    attn_keep: Tensor | None,
    layer_keep: Tensor | None,
) -> StepOutput:
    """One step: attend with the top layer's state, then the stacked GRU cells."""
    # sigmoid(2 (K + W_q query)) = (1 + tanh(K + W_q query)) / 2, (batch, S, H)
    features = torch.sigmoid(att.keys2 + (hidden[-1] @ att.W_q_t2).unsqueeze(1))
    weights = torch.softmax(torch.matmul(features, att.w_v2) + att.bias, dim=-1)
    if att.row_ok is not None:
        weights = weights * att.row_ok
    kept = weights if attn_keep is None else weights * attn_keep
    context = torch.bmm(kept.unsqueeze(1), att.values).squeeze(1)  # (batch, H)
    out = StepOutput(weights, kept, features, context)
    x = torch.cat((context, emb), 1)
    for i, layer in enumerate(layers):
        if i > 0:
            x = out.hidden[-1] if layer_keep is None else out.hidden[-1] * layer_keep[i - 1]
            out.inputs.append(x)
        out.hidden.append(torch.gru_cell(x, hidden[i], layer.W_ih, layer.W_hh, layer.b_ih,
                                         layer.b_hh))
    return out


def _recompute_gates(inputs: Tensor, before: Tensor, layer: GRULayer) -> Tensor:
    """One layer's gate derivatives for all steps at once: ``inputs (T, batch, in)``,
    ``before (T, batch, H)`` (the state each step read) -> :func:`_gate_factors`."""
    T, B, H = before.shape
    gi = torch.addmm(layer.b_ih, inputs.reshape(T * B, -1), layer.W_ih.t()).view(T, B, 3 * H)
    gh = torch.addmm(layer.b_hh, before.reshape(T * B, H), layer.W_hh.t()).view(T, B, 3 * H)
    rz = torch.sigmoid(gi[..., : 2 * H] + gh[..., : 2 * H])
    gh_n = gh[..., 2 * H :]
    n = torch.tanh(torch.addcmul(gi[..., 2 * H :], rz[..., :H], gh_n))
    return _gate_factors(rz, n, gh_n, before)


def _gate_factors(rz: Tensor, n: Tensor, gh_n: Tensor, before: Tensor) -> Tensor:
    """The local derivatives of GRU cells, for any number of steps and layers at once.

    ``rz (..., 2H)``, ``n``, ``gh_n``, ``before`` (the state each step read) ``(..., H)``
    ``-> G (..., 5, H)``. Every gradient a cell passes back is the gradient ``dh`` of its
    new state times a factor known from forward:

        d n_pre = dh (1 - z)(1 - n^2)        d z_pre = dh (h - n) z (1 - z)
        d r_pre = d n_pre gh_n r (1 - r)     d h (direct) = dh z

    ``G`` stacks them as ``[r, z, n, n * r, z]``: ``dh * G`` holds the gradients of the
    input projection (blocks 0-2), of the hidden projection (blocks 0, 1, 3; its n part is
    scaled by r) and the direct path (block 4), so that :func:`_cell_backward` is one
    product and one matrix product. Computed once, in a few large operations.
    """
    H = n.shape[-1]
    r, z = rz[..., :H], rz[..., H:]
    # written straight into the result: temporaries of this size cost more in fresh
    # memory than in arithmetic
    G = n.new_empty(*n.shape[:-1], 5, H)
    f_r, f_z, f_n, f_nr, f_h = G.unbind(-2)
    torch.mul(1 - z, 1 - n * n, out=f_n)
    torch.mul(f_n, r, out=f_nr)
    torch.mul(f_nr * gh_n, 1 - r, out=f_r)
    torch.mul(before - n, z - z * z, out=f_z)
    f_h.copy_(z)
    return G


def _hidden_map(W_hh: Tensor) -> Tensor:
    """``W_hh (3H, H) -> (5H, H)``: the rows that take ``dh * G`` (see
    :func:`_gate_factors`) to the gradient of the state the cell read, ``[W_hh_r; W_hh_z;
    0; W_hh_n; I]``."""
    H = W_hh.shape[1]
    eye = torch.eye(H, dtype=W_hh.dtype, device=W_hh.device)
    return torch.cat([W_hh[: 2 * H], torch.zeros_like(eye), W_hh[2 * H :], eye])


def _cell_backward(
    dh: Tensor, G: Tensor, hidden_map: Tensor, views: _StepViews, t: int, add: Tensor | None
) -> Tensor:
    """Backward through step ``t`` of one GRU cell: ``dh (batch, H)``, the gradient of its
    new state -> the gradient of the state it read, plus ``add`` (what that state receives
    from outside the recurrence, or None). Writes ``dh * G`` (:func:`_gate_factors`,
    ``(batch, 5, H)``) into step ``t`` of ``views``, where :func:`_weight_grads` and the
    input gradients read it; ``hidden_map`` from :func:`_hidden_map`."""
    torch.mul(dh.unsqueeze(1), G, out=views.blocks[t])
    flat = views.flat[t]
    return flat @ hidden_map if add is None else torch.addmm(add, flat, hidden_map)


def _input_grads(D: Tensor) -> Tensor:
    """``D (..., 5, H)`` from :func:`_cell_backward` -> the gradient of the input
    projection's output ``(..., 3H)``, a view (blocks r, z, n)."""
    return D[..., :3, :].reshape(*D.shape[:-2], 3 * D.shape[-1])


class _StepViews:
    """Per-step views of a layer's ``D (T, batch, 5, H)``, made once per backward: the
    loops index them instead of slicing tensors at every step (each slice is a call)."""

    def __init__(self, D: Tensor) -> None:
        T, B, _, H = D.shape
        self.D = D
        self.blocks = D.unbind(0)  # (batch, 5, H)
        self.flat = D.view(T, B, 5 * H).unbind(0)  # (batch, 5H)
        self.inputs = _input_grads(D).unbind(0)  # (batch, 3H): the input projection's


def _weight_grads(
    D: Tensor, inputs: Tensor, before: Tensor, need: Sequence[bool]
) -> list[Tensor | None]:
    """``W_ih, b_ih, W_hh, b_hh`` gradients of one layer, each one product over all
    steps: ``D (T, batch, 5, H)`` from :func:`_cell_backward`, ``inputs (T, batch, in)``,
    ``before (T, batch, H)``."""
    H = D.shape[-1]
    rows = D.shape[0] * D.shape[1]
    d_gi = _input_grads(D).reshape(rows, 3 * H)
    grads: list[Tensor | None] = [None] * 4
    if need[0]:
        grads[0] = d_gi.t() @ inputs.reshape(rows, -1)
    if need[2]:
        # blocks 0, 1 and 3 are the hidden projection's r, z, n: one product over blocks
        # 0-3, then the unused block 2 is dropped
        d_w = D[..., :4, :].reshape(rows, 4 * H).t() @ before.reshape(rows, H)
        grads[2] = torch.cat([d_w[: 2 * H], d_w[3 * H :]])
    if need[1] or need[3]:
        sums = D.sum((0, 1))  # (5, H)
        grads[1] = sums[:3].reshape(-1) if need[1] else None
        grads[3] = torch.cat([sums[:2].reshape(-1), sums[3]]) if need[3] else None
    return grads


class _GRUStack(torch.autograd.Function):
    """A stacked GRU (the encoder's ``nn.GRU``) with the recurrence's backward.

    Forward runs PyTorch's own GRU kernel (a C++ loop over steps) one layer at a time.
    Backward goes one layer after the other, top first (a layer never feeds back into
    the one below), each in reverse over the steps with :func:`_cell_backward`.

    Inputs: ``x (T, batch, in)``, ``hidden (L, batch, H)``, ``layer_keep (T, L-1, batch,
    H)`` or None, ``last (batch,)`` int64 or None, then per layer ``W_ih, b_ih, W_hh,
    b_hh``. Outputs: ``(T, batch, H)`` the top layer's states, ``(L, batch, H)`` every
    layer's state after step ``last[b]`` of row ``b`` (None: after the last step).
    """

    @staticmethod
    def forward(ctx, x, hidden, layer_keep, last, *flat):  # noqa: ANN001, ANN205
        outputs, inputs = [], x
        for i, layer in enumerate(_unflatten(flat)):
            if i > 0:
                inputs = outputs[-1] if layer_keep is None else outputs[-1] * layer_keep[:, i - 1]
            out, _ = torch.gru(
                inputs, hidden[i : i + 1], [layer.W_ih, layer.W_hh, layer.b_ih, layer.b_hh],
                True, 1, 0.0, False, False, False,  # biases, 1 layer, no dropout, eval, ...
            )
            outputs.append(out)
        ctx.save_for_backward(x, hidden, layer_keep, last, *flat, *outputs)
        ctx.num_layers = len(outputs)
        if last is None:
            return outputs[-1].clone(), torch.stack([out[-1] for out in outputs])
        rows = torch.arange(x.shape[1], device=x.device)
        return outputs[-1].clone(), torch.stack([out[last, rows] for out in outputs])

    @staticmethod
    def backward(ctx, d_top, d_last):  # noqa: ANN001, ANN205
        L = ctx.num_layers
        x, hidden, layer_keep, last, *rest = ctx.saved_tensors
        layers, outputs = _unflatten(rest[: 4 * L]), rest[4 * L :]
        T, B, H = outputs[0].shape
        need = ctx.needs_input_grad
        grads: list[Tensor | None] = [None] * (4 + 4 * L)
        d_out = d_top  # gradient of the current layer's outputs, (T, batch, H) or None
        d_hidden = []
        for i in reversed(range(L)):
            layer = layers[i]
            keep = None if i == 0 or layer_keep is None else layer_keep[:, i - 1]
            inputs = x if i == 0 else outputs[i - 1] if keep is None else outputs[i - 1] * keep
            before = torch.cat([hidden[i].unsqueeze(0), outputs[i][:-1]])
            G = _recompute_gates(inputs, before, layer).unbind(0)
            hidden_map = _hidden_map(layer.W_hh)
            views = _StepViews(x.new_empty(T, B, 5, H))
            if last is not None and d_last is not None:
                # Row b's final state is its state after step last[b]: that step's
                # output receives the gradient, with the top layer's own.
                placed = x.new_zeros(T, B, H)
                placed[last, torch.arange(B, device=x.device)] = d_last[i]
                d_out = placed if d_out is None else d_out + placed
                dh = x.new_zeros(B, H)
            else:
                dh = d_last[i] if d_last is not None else x.new_zeros(B, H)
            d_outs = d_out.unbind(0) if d_out is not None else None
            if d_outs is not None:
                dh = dh + d_outs[T - 1]
            for t in reversed(range(T)):
                # step t - 1's output gradient joins in the cell's matrix product
                add = d_outs[t - 1] if d_outs is not None and t > 0 else None
                dh = _cell_backward(dh, G[t], hidden_map, views, t, add)
            D = views.D
            d_hidden.append(dh)
            grads[4 + 4 * i : 8 + 4 * i] = _weight_grads(D, inputs, before,
                                                         need[4 + 4 * i : 8 + 4 * i])
            if i > 0 or need[0]:
                # the gradient of this layer's inputs, all steps at once
                d_out = _input_grads(D) @ layer.W_ih
                if keep is not None:
                    d_out = d_out * keep
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
    lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``rnn(x, hidden)`` for a unidirectional, time-major ``nn.GRU``, with its dropout
    between layers in training: ``x (T, batch, in) -> (outputs (T, batch, H),
    last (L, batch, H))``.

    Same maths, parameters and forward kernel as calling ``rnn``; the backward is
    :class:`_GRUStack`'s, which issues a fraction of the operations autograd's does
    through ``nn.GRU`` at small sizes.

    ``lengths (batch,)``: row ``b`` is ``lengths[b]`` steps long (clamped to [1, T]) and
    ``last[:, b]`` is every layer's state after its last step, as ``rnn`` gives for a
    packed sequence; ``outputs`` past a row's length are states after reading padding,
    which no caller should use (attention masks them).
    """
    layers = gru_layers(rnn)
    T, B = x.shape[:2]
    L, H = len(layers), rnn.hidden_size
    if hidden is None:
        hidden = x.new_zeros(L, B, H)
    layer_keep = (
        dropout_keep(x, (T, L - 1, B, H), rnn.dropout, training, generator) if L > 1 else None
    )
    flat = [t for layer in layers for t in layer.flat()]
    last = None if lengths is None else (lengths.to(x.device).clamp(1, T) - 1).long()
    with _float32(x):
        return _GRUStack.apply(_up(x), _up(hidden), layer_keep, last, *map(_up, flat))


class _AttentionGRU(torch.autograd.Function):
    """The decoder's loop over ``T`` teacher-forced steps, with a hand-written backward.

    Inputs, in order: ``embs (T, batch, E)``, ``hidden (L, batch, H)``, ``layer_keep
    (T, L-1, batch, H)`` or None, the attention's ``values``, ``keys`` ``(batch, S, H)``,
    ``bias``, ``row_ok``, ``attn_keep (T, batch, S)`` or None, ``W_q``, ``w_v``, then per
    layer ``W_ih, b_ih, W_hh, b_hh``.

    Outputs: ``top (T, batch, H)`` the top layer's state after each step, ``last (L, batch,
    H)`` the final state, and, not differentiable, every layer's state ``(T, L, batch, H)``,
    the attention weights ``(T, batch, S)`` and the contexts ``(T, batch, H)``.
    """

    @staticmethod
    def forward(ctx, embs, hidden, layer_keep, values, keys, bias, row_ok, attn_keep,
                W_q, w_v, *flat):  # noqa: ANN001, ANN205 (autograd's signature)
        layers = _unflatten(flat)
        att = _Attention.of(values, keys, bias, row_ok, W_q, w_v)
        state = list(hidden.unbind(0))
        steps: list[StepOutput] = []
        emb_steps = embs.unbind(0)
        attn_keeps = attn_keep.unbind(0) if attn_keep is not None else None
        layer_keeps = layer_keep.unbind(0) if layer_keep is not None else None
        for t in range(len(emb_steps)):
            step = _step(
                emb_steps[t], state, att, layers,
                None if attn_keeps is None else attn_keeps[t],
                None if layer_keeps is None else layer_keeps[t],
            )
            steps.append(step)
            state = step.hidden

        L, T = len(layers), len(steps)

        def by_step_and_layer(per_step: list[list[Tensor]]) -> Tensor:
            # one stack for all steps and layers, then a view: (T, layers, batch, X)
            flat_list = [x for step_list in per_step for x in step_list]
            return torch.stack(flat_list).view(T, -1, *flat_list[0].shape)

        states = by_step_and_layer([s.hidden for s in steps])  # (T, L, batch, H)
        inputs = by_step_and_layer([s.inputs for s in steps]) if L > 1 else None
        weights = torch.stack([s.weights for s in steps])
        contexts = torch.stack([s.context for s in steps])
        features = torch.stack([s.features for s in steps])
        kept = torch.stack([s.kept for s in steps]) if attn_keep is not None else weights
        ctx.save_for_backward(embs, hidden, layer_keep, values, W_q, w_v,
                              *flat, states, inputs, weights, contexts, features, kept)
        ctx.num_layers = L
        ctx.mark_non_differentiable(states, weights, contexts)
        # copies, not views: autograd tracks each differentiable output on its own
        return states[:, -1].clone(), states[-1].clone(), states, weights, contexts

    @staticmethod
    def backward(ctx, d_top, d_last, _s, _w, _c):  # noqa: ANN001, ANN205
        L = ctx.num_layers
        # (dropout and the empty-row guard reach backward through kept and weights)
        embs, hidden, layer_keep, values, W_q, w_v, *rest = ctx.saved_tensors
        layers = _unflatten(rest[: 4 * L])
        states, inputs, weights, contexts, features, kept = rest[4 * L :]
        T, _, B, H = states.shape
        need = ctx.needs_input_grad
        before = torch.cat([hidden.unsqueeze(0), states[:-1]])  # the state each step read
        layer_inputs = [
            torch.cat([contexts, embs], -1) if i == 0 else inputs[:, i - 1] for i in range(L)
        ]
        # every cell's gate derivatives, recomputed per layer for all steps at once
        factors = [
            _recompute_gates(layer_inputs[i], before[:, i], layers[i]).unbind(0)
            for i in range(L)
        ]
        hidden_maps = [_hidden_map(layer.W_hh) for layer in layers]
        views = [_StepViews(before.new_empty(T, B, 5, H)) for _ in range(L)]  # dh * factors
        dh = list(d_last.unbind(0)) if d_last is not None else [
            before.new_zeros(B, H) for _ in range(L)
        ]
        d_tops = d_top.unbind(0) if d_top is not None else None
        keeps = [k.unbind(0) for k in layer_keep.unbind(0)] if layer_keep is not None else None
        # Every per-step tensor the loop reads or writes, as views made once: (batch, 1, S)
        # rows for the attention's products, (batch, S, 1) columns for d_keys.
        d_scores = weights.new_empty(weights.shape)  # (T, batch, S)
        d_query = before.new_empty(T, B, H)  # d (W_q query)
        d_scores_rows = d_scores.unsqueeze(2).unbind(0)
        d_scores_cols = d_scores.unsqueeze(3).unbind(0)
        d_query_steps, d_query_rows = d_query.unbind(0), d_query.unsqueeze(2).unbind(0)
        kept_rows, weights_rows = kept.unsqueeze(2).unbind(0), weights.unsqueeze(2).unbind(0)
        features_steps = features.unbind(0)
        d_keys = values.new_zeros(values.shape) if need[4] else None
        W_ctx = layers[0].W_ih[:, :H]  # layer 0's input is [context, embedding]
        # Layer 0 reads context @ W_ctx^T = kept @ (V W_ctx^T): d kept is one product per
        # step with this (batch, 3H, S) map (d_context follows after the loop, for all
        # steps at once); in this orientation the bmm is fast.
        ctx_map = torch.matmul(W_ctx, values.transpose(1, 2))
        d_gi0_rows = _input_grads(views[0].D).unsqueeze(2).unbind(0)  # (batch, 1, 3H)
        w_v4 = 4 * w_v[0]
        if d_tops is not None:
            dh[L - 1] = dh[L - 1] + d_tops[T - 1]
        for t in reversed(range(T)):
            for i in reversed(range(L)):
                # the top layer's output gradient of step t - 1 joins in its matrix product
                add = d_tops[t - 1] if i == L - 1 and d_tops is not None and t > 0 else None
                dh[i] = _cell_backward(dh[i], factors[i][t], hidden_maps[i], views[i], t, add)
                if i > 0:
                    d_gi = views[i].inputs[t]
                    if keeps is None:
                        dh[i - 1] = torch.addmm(dh[i - 1], d_gi, layers[i].W_ih)
                    else:
                        dx = d_gi @ layers[i].W_ih
                        dh[i - 1] = torch.addcmul(dh[i - 1], dx, keeps[t][i - 1])
            d_kept = torch.bmm(d_gi0_rows[t], ctx_map)  # (batch, 1, S)
            # Softmax backward with dropout and the empty-row guard folded in: with
            # kept = a * keep (a = weights, zero on guarded rows), d a = d_kept * keep, and
            # d scores = a * (d a - sum(a * d a)) = kept * d_kept - a * sum(kept * d_kept).
            kd = kept_rows[t] * d_kept
            torch.addcmul(kd, weights_rows[t], kd.sum(-1, keepdim=True), value=-1,
                          out=d_scores_rows[t])
            # d score / d tanh argument, (batch, S, H): w_v (1 - tanh^2) = 4 w_v s (1 - s).
            # Per step, not for all steps at once: this size stays in cache.
            f = features_steps[t]
            g_f = torch.addcmul(f, f, f, value=-1).mul_(w_v4)
            # d (W_q query) = sum over source positions of d_score * g_f
            torch.bmm(d_scores_rows[t], g_f, out=d_query_rows[t])
            dh[L - 1] = torch.addmm(dh[L - 1], d_query_steps[t], W_q)
            if d_keys is not None:
                d_keys.addcmul_(d_scores_cols[t], g_f)
        D = [v.D for v in views]

        def flat2(x: Tensor) -> Tensor:
            return x.reshape(-1, x.shape[-1])

        grads: list[Tensor | None] = [None] * (10 + 4 * L)
        if need[0]:
            grads[0] = _input_grads(D[0]) @ layers[0].W_ih[:, H:]
        grads[1] = torch.stack(dh) if need[1] else None
        if need[3]:
            d_context = _input_grads(D[0]) @ W_ctx  # (T, batch, H)
            # sum over steps of kept^T d_context: (batch, S, T) @ (batch, T, H)
            grads[3] = torch.bmm(kept.permute(1, 2, 0), d_context.transpose(0, 1))
        grads[4] = d_keys
        if need[8]:
            grads[8] = flat2(d_query).t() @ flat2(before[:, L - 1])
        if need[9]:
            # d score / d w_v = tanh = 2 s - 1, summed against d_scores without forming it
            grads[9] = 2 * (d_scores.reshape(1, -1) @ flat2(features)) - d_scores.sum()
        for i in range(L):
            base = 10 + 4 * i
            grads[base : base + 4] = _weight_grads(D[i], layer_inputs[i], before[:, i],
                                                   need[base : base + 4])
        return tuple(grads)


def attention_gru(
    embs: Tensor,
    values: Tensor,
    keys: Tensor,
    hidden: Tensor,
    bias: Tensor,
    row_ok: Tensor | None,
    W_q: Tensor,
    w_v: Tensor,
    layers: Sequence[GRULayer],
    *,
    attn_dropout: float = 0.0,
    layer_dropout: float = 0.0,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Run the decoder over ``T`` teacher-forced steps.

    ``embs (T, batch, E)``: every step's input token embedded; the other arguments as
    :func:`decoder_step`. Dropout on the attention weights (``attn_dropout``, as
    :class:`qkv.AdditiveAttention`) and between GRU layers (``layer_dropout``, as
    ``nn.GRU``) is drawn for all steps at once when ``training``.

    Returns ``top (T, batch, H)`` (the top layer's state after each step),
    ``last (L, batch, H)`` (the final state), and, not differentiable, the attention
    weights ``(T, batch, S)``, the contexts ``(T, batch, H)`` and every state
    ``(T, L, batch, H)``.
    """
    T, B = embs.shape[:2]
    L, H, S = len(layers), values.shape[-1], values.shape[1]
    attn_keep = dropout_keep(values, (T, B, S), attn_dropout, training, generator)
    layer_keep = (
        dropout_keep(values, (T, L - 1, B, H), layer_dropout, training, generator)
        if L > 1
        else None
    )
    with _float32(embs):
        top, last, states, weights, contexts = _AttentionGRU.apply(
            _up(embs), _up(hidden), layer_keep, _up(values), _up(keys), _up(bias), row_ok,
            attn_keep, _up(W_q), _up(w_v), *(_up(t) for layer in layers for t in layer.flat()),
        )
    return top, last, weights, contexts, states


def _float32(like: Tensor) -> torch.autocast:
    """Autocast off: the kernels write into buffers of their inputs' dtype and keep the
    recurrence in it, so under ``torch.autocast`` (``--dtype bfloat16``) they run in
    float32, their lower-precision inputs cast up by :func:`_up` (the layers around them
    still run in the lower precision)."""
    return torch.autocast(like.device.type, enabled=False)


def _up(t: Tensor) -> Tensor:
    """``t`` in float32 if it is in a lower precision (float64 stays float64)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
