"""Mixture of experts: the feed-forward of DeepSeek-V3, Qwen3-Next, gpt-oss and their kin.

A router scores every token against ``num_experts`` small gated MLPs (the experts), each
token goes to its ``top_k`` best, and the token's output is their outputs weighted by the
router's scores; shared experts, if any, see every token. A model then holds many
experts' parameters but runs only ``top_k`` of them per token
(:meth:`MoE.active_parameters`).

Routing (:meth:`MoE.route`), in the order the families apply it:

1. scores: ``softmax`` over the experts (Qwen, gpt-oss, Mixtral) or an independent
   ``sigmoid`` per expert (DeepSeek-V3);
2. choice: the scores plus ``e_score_correction_bias`` (DeepSeek-V3's load-balancing
   bias, a buffer: it moves which experts are chosen, never their weights);
3. group-limited routing (DeepSeek-V3): the experts are cut into ``n_group`` groups, each
   group scored by the sum of its two best choice scores, and only the ``topk_group``
   best groups stay candidates;
4. the ``top_k`` best candidates; their weights are their *scores* (not the choice);
5. ``norm_topk_prob``: the weights divided by their sum; then times
   ``routed_scaling_factor``.

gpt-oss takes the softmax of the top ``k`` logits: the same numbers as ``softmax`` with
``norm_topk_prob=True`` (a softmax restricted to some entries is the full one
renormalised over them).

Parameters and Hugging Face's names (transformers 5.x stores experts fused, 3-D):

==========================================  ============================================
qkv (``MoE``)                               Hugging Face (``mlp.``)
==========================================  ============================================
``router.weight`` (``.bias``)               ``gate.weight`` (DeepSeek, Qwen);
                                            ``router.weight``/``.bias`` (gpt-oss)
``e_score_correction_bias``                 ``gate.e_score_correction_bias`` (DeepSeek)
``experts.gate_up_proj (E, 2I, d)``         ``experts.gate_up_proj`` (DeepSeek, Qwen,
                                            Gemma 4), as stored
``experts.down_proj (E, I, d)``             ``experts.down_proj`` transposed (DeepSeek,
                                            Qwen, Gemma 4 store ``(E, d, I)``)
``shared_expert.fc1``/``fc2``/``fc3``       ``shared_experts.gate_proj``/``up_proj``/
                                            ``down_proj`` (DeepSeek), ``shared_expert.*``
                                            (Qwen)
``shared_expert_gate.weight``               ``shared_expert_gate.weight`` (Qwen)
==========================================  ============================================

gpt-oss stores its experts the other way round and interleaved: ``gate_up_proj (E, d,
2I)`` with the gate in the even columns and the up projection in the odd ones,
``gate_up_proj_bias (E, 2I)`` likewise, ``down_proj (E, I, d)`` as qkv does. To qkv's:
``w = gate_up_proj.transpose(1, 2); torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)``, the
bias ``torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)``; ``down_proj`` and
``down_proj_bias`` as stored.

Why ``down_proj`` is ``(E, I, d)``: decoding multiplies one token's ``I`` hidden values by
each chosen expert's down projection. Stored ``(d, I)``, that is ``d`` dot products of
short rows (``I`` is small in these models: 512 to 2,048), which PyTorch's CPU
matrix-vector kernel streams at well under the memory's speed; stored ``(I, d)`` it is
one ``(1, I) @ (I, d)`` product over long rows. One thread, four experts of ``d = 2048,
I = 768``: 6.1 ms against 1.4 ms (``docs/benchmarks.md``, "Attention variants and mixture
of experts"). ``gate_up_proj``'s rows are ``d`` long, so it keeps ``nn.Linear``'s layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import check_bool, check_float, check_positive_int, check_str

__all__ = ["MoE", "Experts", "GatedMLP", "gated_activation", "MOE_ACTIVATIONS",
           "MOE_SCORES", "MOE_BACKENDS"]

MOE_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu")
MOE_SCORES = ("softmax", "sigmoid")
MOE_BACKENDS = ("loop", "grouped")


def gated_activation(gate: Tensor, up: Tensor, kind: str = "swiglu", *,
                     alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """The gated unit of an expert, ``(..., I), (..., I) -> (..., I)``.

    - ``"swiglu"``: ``silu(gate) * up`` (Llama, Qwen, DeepSeek);
    - ``"geglu"``: ``gelu_tanh(gate) * up`` (Gemma);
    - ``"clamped_swiglu"`` (gpt-oss): ``gate`` clipped from above at ``limit`` and
      ``up`` to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``.
      The clips bound the product however large the projections grow.
    """
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class GatedMLP(nn.Module):
    """One gated MLP, ``fc3(act(fc1 x, fc2 x))`` (:func:`gated_activation`): a shared
    expert, or a dense layer of a mixture-of-experts model.

    ``fc1`` (the gate) and ``fc2`` (up) map ``d_model -> hidden_dim``, ``fc3`` (down) maps
    back: Hugging Face's ``gate_proj``, ``up_proj``, ``down_proj``.

    Shapes: ``(..., d_model) -> (..., d_model)``.
    """

    def __init__(self, d_model: int, hidden_dim: int, *, bias: bool = False,
                 activation: str = "swiglu", alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("hidden_dim", hidden_dim)
        check_str("activation", activation, choices=MOE_ACTIVATIONS)
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.fc1 = nn.Linear(d_model, hidden_dim, bias=bias)
        self.fc2 = nn.Linear(d_model, hidden_dim, bias=bias)
        self.fc3 = nn.Linear(hidden_dim, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        hidden = gated_activation(self.fc1(x), self.fc2(x), self.activation,
                                  alpha=self.alpha, limit=self.limit)
        return self.fc3(hidden)


def _down(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``hidden (n, I) @ weight (I, d) (+ bias (d,)) -> (n, d)``: one expert's down
    projection, its weight stored input-rows first."""
    out = hidden @ weight
    return out if bias is None else out + bias


class Experts(nn.Module):
    """``num_experts`` gated MLPs of one width, stored as 3-D tensors.

    Parameters (Hugging Face's layout and names, see the module docstring):
    ``gate_up_proj (num_experts, 2 * hidden_dim, d_model)``: each expert's gate rows,
    then its up rows; ``down_proj (num_experts, hidden_dim, d_model)`` (input rows, the
    transpose of ``nn.Linear``'s: see the module docstring); with ``bias``,
    ``gate_up_proj_bias (num_experts, 2 * hidden_dim)`` and ``down_proj_bias
    (num_experts, d_model)``. Initialised as ``nn.Linear`` initialises its weights.
    """

    def __init__(self, d_model: int, hidden_dim: int, num_experts: int, *,
                 bias: bool = False, activation: str = "swiglu", alpha: float = 1.702,
                 limit: float = 7.0) -> None:
        super().__init__()
        for name, n in (("d_model", d_model), ("hidden_dim", hidden_dim),
                        ("num_experts", num_experts)):
            check_positive_int(name, n)
        check_str("activation", activation, choices=MOE_ACTIVATIONS)
        self.d_model, self.hidden_dim, self.num_experts = d_model, hidden_dim, num_experts
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, d_model))
        self.gate_up_proj_bias = (nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
                                  if bias else None)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, d_model)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default: uniform in +-1/sqrt(fan_in), weights and biases alike.
        for weight, bias, fan_in in ((self.gate_up_proj, self.gate_up_proj_bias, self.d_model),
                                     (self.down_proj, self.down_proj_bias, self.hidden_dim)):
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on the tokens ``x (n, d_model) -> (n, d_model)``."""
        gate_up = F.linear(x, self.gate_up_proj[e],
                           None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e])
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = gated_activation(gate, up, self.activation, alpha=self.alpha, limit=self.limit)
        return _down(hidden, self.down_proj[e],
                     None if self.down_proj_bias is None else self.down_proj_bias[e])

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, d_model={self.d_model}, "
                f"hidden_dim={self.hidden_dim}, activation={self.activation!r}"
                + (", bias=True" if self.down_proj_bias is not None else ""))


class MoE(nn.Module):
    """A sparse mixture-of-experts feed-forward layer: router, routed experts and optional
    shared experts.

    Args:
        d_model: token width.
        hidden_dim: each routed expert's inner width (``moe_intermediate_size``).
        num_experts: routed experts ``E``.
        top_k: experts per token (``num_experts_per_tok``).
        score: ``"softmax"`` or ``"sigmoid"`` router scores (see the module docstring).
        norm_topk_prob: divide the chosen experts' weights by their sum.
        routed_scaling_factor: multiply the routed weights (DeepSeek-V3: 2.5).
        n_group, topk_group: group-limited routing (DeepSeek-V3: 8 groups, 4 kept); 1, 1
            is none. Each group must hold at least two experts.
        score_correction_bias: keep the buffer ``e_score_correction_bias (E,)`` added to
            the scores to choose the experts (DeepSeek-V3).
        router_bias: a bias on the router (gpt-oss).
        expert_bias: biases in the experts' projections (gpt-oss).
        activation: :func:`gated_activation`'s ``kind`` (gpt-oss: ``"clamped_swiglu"``
            with ``swiglu_alpha``, ``swiglu_limit``).
        shared_hidden_dim: inner width of the shared expert every token also goes
            through (DeepSeek: ``n_shared_experts * moe_intermediate_size``, one MLP as
            wide as all of them; Qwen3-Next: ``shared_expert_intermediate_size``); None:
            none.
        shared_gate: scale the shared expert's output by ``sigmoid(x . w)``, a gate of
            the token's own (Qwen's ``shared_expert_gate``).
        backend: ``"loop"``, the definition (each expert on the tokens routed to it,
            found one expert at a time), or ``"grouped"`` (default: the token copies
            sorted by expert once, each expert then runs on one contiguous block). Both
            give the same numbers and gradients.

    Parameters are created in the order ``router``, ``experts``, ``shared_expert``,
    ``shared_expert_gate``.

    Shapes: ``x (..., d_model) -> (..., d_model)``.
    """

    def __init__(
        self,
        d_model: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score: str = "softmax",
        norm_topk_prob: bool = False,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        score_correction_bias: bool = False,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: str = "swiglu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_hidden_dim: int | None = None,
        shared_gate: bool = False,
        backend: str = "grouped",
    ) -> None:
        super().__init__()
        for name, n in (("d_model", d_model), ("hidden_dim", hidden_dim),
                        ("num_experts", num_experts), ("top_k", top_k),
                        ("n_group", n_group), ("topk_group", topk_group)):
            check_positive_int(name, n)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be at most num_experts ({num_experts})")
        check_str("score", score, choices=MOE_SCORES)
        check_str("activation", activation, choices=MOE_ACTIVATIONS)
        check_str("backend", backend, choices=MOE_BACKENDS)
        for name, flag in (("norm_topk_prob", norm_topk_prob),
                           ("score_correction_bias", score_correction_bias),
                           ("router_bias", router_bias), ("expert_bias", expert_bias),
                           ("shared_gate", shared_gate)):
            check_bool(name, flag)
        routed_scaling_factor = check_float("routed_scaling_factor", routed_scaling_factor,
                                            0.0, lo_open=True)
        swiglu_alpha = check_float("swiglu_alpha", swiglu_alpha, 0.0, lo_open=True)
        swiglu_limit = check_float("swiglu_limit", swiglu_limit, 0.0, lo_open=True)
        if n_group > 1:
            if num_experts % n_group or num_experts // n_group < 2:
                raise ValueError(f"n_group ({n_group}) must divide num_experts ({num_experts})"
                                 " into groups of at least 2 experts")
            if topk_group > n_group or top_k > topk_group * (num_experts // n_group):
                raise ValueError(
                    f"topk_group ({topk_group}) must be at most n_group ({n_group}) and keep "
                    f"at least top_k ({top_k}) experts: {num_experts // n_group} per group")
        elif topk_group != 1:
            raise ValueError(f"topk_group ({topk_group}) needs n_group > 1 (group-limited "
                             f"routing); with n_group=1 it must be 1")
        if shared_hidden_dim is not None:
            check_positive_int("shared_hidden_dim", shared_hidden_dim, "integer or None")
        elif shared_gate:
            raise ValueError("shared_gate needs a shared expert: set shared_hidden_dim")

        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.score, self.norm_topk_prob = score, norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group
        self.backend = backend
        self.router = nn.Linear(d_model, num_experts, bias=router_bias)
        if score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None
        act = dict(activation=activation, alpha=swiglu_alpha, limit=swiglu_limit)
        self.experts = Experts(d_model, hidden_dim, num_experts, bias=expert_bias, **act)
        self.shared_expert = (GatedMLP(d_model, shared_hidden_dim, bias=expert_bias, **act)
                              if shared_hidden_dim is not None else None)
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if shared_gate else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's experts and their weights: ``x (N, d_model) -> (weights (N,
        top_k), experts (N, top_k))``, weights in ``x``'s dtype.

        The router runs in float32 at least (DeepSeek keeps it there), so a bfloat16 model
        chooses its experts as its float32 router would.
        """
        dtype = torch.promote_types(x.dtype, torch.float32)
        bias = self.router.bias
        logits = F.linear(x.to(dtype), self.router.weight.to(dtype),
                          None if bias is None else bias.to(dtype))  # (N, E)
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.to(dtype)
        if self.n_group > 1:
            # Score each group by its two best experts; hide all but the topk_group best.
            groups = choice.view(len(x), self.n_group, self.num_experts // self.n_group)
            group_score = groups.topk(2, dim=-1).values.sum(dim=-1)  # (N, n_group)
            kept = group_score.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view(choice.shape)
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, top_k)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.routed_scaling_factor
        return weights.to(x.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (..., {self.d_model}), got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)  # (N, d_model)
        weights, experts = self.route(tokens)
        if self.backend == "loop":
            out = self._routed_loop(tokens, weights, experts)
        else:
            out = self._routed_grouped(tokens, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            out = out + shared
        return out.view(x.shape)

    def _routed_loop(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """The definition: ``out[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``,
        summed one expert at a time over the tokens routed to it."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(experts == e)  # the tokens that chose e, and where
            if len(token):
                routed = weights[token, slot, None] * self.experts.expert(e, x[token])
                out.index_add_(0, token, routed)
        return out

    def _routed_grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """As :meth:`_routed_loop`, with the ``N * top_k`` token copies sorted by expert
        once (one sort, one gather, then a gather back and a sum) instead of searched once
        per expert; each expert then projects its contiguous block, experts with no token
        not at all. The gated unit between the two projections runs once over all the
        copies, ``(N * top_k, hidden_dim)``, not once per expert: a few large element-wise
        passes instead of many small ones (gpt-oss's clamped SwiGLU alone is seven per
        expert)."""
        flat = experts.flatten()  # (N * top_k,): the expert of copy t * top_k + j
        order = flat.argsort(stable=True)
        token = order // self.top_k  # the token of each sorted copy
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        used = [e for e, n in enumerate(counts) if n]
        if not used:  # no tokens at all
            return torch.zeros_like(x)
        ex = self.experts
        blocks = x[token].split(counts)  # block e: the tokens routed to expert e

        def bias(b: Tensor | None, e: int) -> Tensor | None:
            return None if b is None else b[e]

        # Every copy's gate and up projection by its expert's weights, (N * top_k, 2I).
        gate_up = torch.cat([F.linear(blocks[e], ex.gate_up_proj[e],
                                      bias(ex.gate_up_proj_bias, e)) for e in used])
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = gated_activation(gate, up, ex.activation, alpha=ex.alpha, limit=ex.limit)
        hidden_blocks = hidden.split([counts[e] for e in used])
        routed = torch.cat([_down(h, ex.down_proj[e], bias(ex.down_proj_bias, e))
                            for e, h in zip(used, hidden_blocks, strict=True)])
        routed = routed * weights.flatten()[order, None]
        # Back to token order (copy t * top_k + j is row inverse[t * top_k + j] of routed),
        # then each token's top_k outputs summed: deterministic on any device, and on a busy
        # 2-core CPU an index_add_ cost a one-token step tens of ms more (docs/benchmarks.md).
        inverse = order.argsort()
        return routed[inverse].view(len(x), self.top_k, -1).sum(dim=1)

    def active_parameters(self) -> int:
        """Parameters one token runs through: the router, the shared expert (and its gate)
        and ``top_k`` of the ``num_experts`` routed experts. Counted from the module's own
        parameters (works on the ``meta`` device)."""
        routed = sum(p.numel() for p in self.experts.parameters())
        others = sum(p.numel() for name, p in self.named_parameters()
                     if not name.startswith("experts."))
        return others + routed * self.top_k // self.num_experts

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, score={self.score!r}"
                + (", norm_topk_prob=True" if self.norm_topk_prob else "")
                + (f", routed_scaling_factor={self.routed_scaling_factor:g}"
                   if self.routed_scaling_factor != 1.0 else "")
                + (f", n_group={self.n_group}, topk_group={self.topk_group}"
                   if self.n_group > 1 else "")
                + f", backend={self.backend!r}")
