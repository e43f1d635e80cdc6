"""Mixture of experts (qkv.models.moe) against a float64 reference written here token by
token from the routing rules, and against transformers' DeepseekV3MoE,
Qwen3NextSparseMoeBlock and GptOssMLP with random weights loaded by the documented
renames; the grouped backend against the loop, as a property."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import DeepseekV3Config, GptOssConfig, Qwen3NextConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from qkv.models.moe import MoE

D = 16
F64 = torch.float64


# ----------------------------------------------------------------- the definition


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def unit(gate: float, up: float, kind: str, alpha=1.702, limit=7.0) -> float:
    if kind == "swiglu":
        return gate * sigmoid(gate) * up
    if kind == "geglu":
        inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
        return 0.5 * gate * (1 + math.tanh(inner)) * up
    gate, up = min(gate, limit), max(-limit, min(up, limit))
    return (up + 1) * gate * sigmoid(alpha * gate)


def mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, kind="swiglu"):
    """One gated MLP on one token, by its equation: ``w_down (act(w_gate x + b), w_up x +
    b) + b_down``."""
    g, u = w_gate @ x, w_up @ x
    if b_gate is not None:
        g, u = g + b_gate, u + b_up
    hidden = torch.tensor([unit(float(a), float(b), kind) for a, b in zip(g, u, strict=True)],
                          dtype=F64)
    out = w_down @ hidden
    return out if b_down is None else out + b_down


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``moe`` on ``x (N, D)`` in float64, one token at a time, from the routing rules."""
    p = {name: t.detach().double() for name, t in moe.state_dict().items()}
    E, k, inner = moe.num_experts, moe.top_k, moe.experts.hidden_dim
    kind = moe.experts.activation
    out = torch.zeros(len(x), x.shape[1], dtype=F64)
    for t, token in enumerate(x.double()):
        logits = [float(p["router.weight"][e] @ token) + float(p.get("router.bias", [0.0] * E)[e])
                  for e in range(E)]
        if moe.score == "softmax":
            top = max(logits)
            total = sum(math.exp(z - top) for z in logits)
            scores = [math.exp(z - top) / total for z in logits]
        else:
            scores = [sigmoid(z) for z in logits]
        bias = p.get("e_score_correction_bias", torch.zeros(E))
        choice = [scores[e] + float(bias[e]) for e in range(E)]
        candidates = list(range(E))
        if moe.n_group > 1:
            size = E // moe.n_group
            group_score = [sum(sorted(choice[g * size : (g + 1) * size])[-2:])
                           for g in range(moe.n_group)]
            best = sorted(range(moe.n_group), key=lambda g: -group_score[g])[: moe.topk_group]
            candidates = [e for e in range(E) if e // size in best]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:k]
        weights = [scores[e] for e in chosen]
        if moe.norm_topk_prob:
            weights = [w / sum(weights) for w in weights]
        for e, w in zip(chosen, weights, strict=True):
            # down_proj is stored (E, I, d), input rows first: its expert's (d, I) is .T
            gu, down = p["experts.gate_up_proj"][e], p["experts.down_proj"][e].T
            b = p.get("experts.gate_up_proj_bias")
            out[t] += w * moe.routed_scaling_factor * mlp(
                token, gu[:inner], gu[inner:], down,
                None if b is None else b[e, :inner], None if b is None else b[e, inner:],
                None if b is None else p["experts.down_proj_bias"][e], kind=kind)
        if moe.shared_expert is not None:
            shared = mlp(token, p["shared_expert.fc1.weight"], p["shared_expert.fc2.weight"],
                         p["shared_expert.fc3.weight"], kind=kind)
            if moe.shared_expert_gate is not None:
                shared = sigmoid(float(p["shared_expert_gate.weight"][0] @ token)) * shared
            out[t] += shared
    return out


def randomize(module: nn.Module, std: float = 0.5) -> None:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.normal_(0.0, std)


FAMILIES = {  # the options of each family, at a tiny size
    "deepseek_v3": dict(num_experts=8, top_k=3, score="sigmoid", norm_topk_prob=True,
                        routed_scaling_factor=2.5, n_group=4, topk_group=2,
                        score_correction_bias=True, shared_hidden_dim=12),
    "qwen3_next": dict(num_experts=8, top_k=2, norm_topk_prob=True, shared_hidden_dim=10,
                       shared_gate=True),
    "gpt_oss": dict(num_experts=4, top_k=2, norm_topk_prob=True, router_bias=True,
                    expert_bias=True, activation="clamped_swiglu"),
    "gemma_like": dict(num_experts=6, top_k=2, activation="geglu"),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_moe_is_the_definition(family, backend):
    torch.manual_seed(0)
    moe = MoE(D, 6, backend=backend, **FAMILIES[family]).double()
    randomize(moe, 1.0)  # large enough for gpt-oss's clamps to bite
    x = torch.randn(2, 5, D, dtype=F64)
    got = moe(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got.view(10, D), reference(moe, x.view(10, D)),
                               rtol=1e-10, atol=1e-10)


def test_the_reference_sees_the_groups_and_the_correction_bias():
    # Without group-limited routing and the bias, DeepSeek's experts would differ: the
    # definition test above could not pass by ignoring them.
    torch.manual_seed(1)
    moe = MoE(D, 6, **FAMILIES["deepseek_v3"]).double()
    randomize(moe, 1.0)
    x = torch.randn(10, D, dtype=F64)
    plain = MoE(D, 6, **{**FAMILIES["deepseek_v3"], "n_group": 1, "topk_group": 1}).double()
    plain.load_state_dict(moe.state_dict())
    assert not torch.allclose(moe.route(x)[1].sort(-1).values, plain.route(x)[1].sort(-1).values)
    unbiased = MoE(D, 6, **{**FAMILIES["deepseek_v3"], "score_correction_bias": False}).double()
    unbiased.load_state_dict({k: v for k, v in moe.state_dict().items()
                              if k != "e_score_correction_bias"})
    assert not torch.allclose(moe(x), unbiased(x))


# ----------------------------------------------------------------- against transformers


def rename(state: dict[str, torch.Tensor], table: dict[str, str]) -> dict[str, torch.Tensor]:
    """Hugging Face's names to qkv's by the module docstring's table (prefix for prefix)."""
    out = {}
    for name, tensor in state.items():
        for theirs, ours in table.items():
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        out[name] = tensor
    return out


SHARED_MLP = {".gate_proj.": ".fc1.", ".up_proj.": ".fc2.", ".down_proj.": ".fc3."}


def shared_names(state, prefix):
    """transformers' DeepSeek/Qwen MoE state in qkv's names and layout: the shared
    expert renamed, and ``experts.down_proj (E, d, I)`` transposed to qkv's ``(E, I, d)``."""
    for theirs, ours in SHARED_MLP.items():
        state = {k.replace(prefix + theirs, "shared_expert" + ours)
                 if k.startswith(prefix) else k: v for k, v in state.items()}
    return {**state, "experts.down_proj": state["experts.down_proj"].transpose(1, 2)}


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_moe_matches_deepseek_v3(backend):
    cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=6, n_routed_experts=8,
                           num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=10,
                           num_hidden_layers=1)
    cfg._experts_implementation = "eager"
    torch.manual_seed(2)
    theirs = DeepseekV3MoE(cfg).eval()
    randomize(theirs)
    with torch.no_grad():
        theirs.gate.e_score_correction_bias.mul_(0.2)
    ours = MoE(D, 6, 8, 3, score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
               n_group=4, topk_group=2, score_correction_bias=True,
               shared_hidden_dim=2 * 6, backend=backend)
    state = rename(theirs.state_dict(), {"gate.weight": "router.weight",
                                         "gate.e_score_correction_bias":
                                         "e_score_correction_bias"})
    ours.load_state_dict(shared_names(state, "shared_experts"))
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_moe_matches_qwen3_next(norm):
    cfg = Qwen3NextConfig(hidden_size=D, moe_intermediate_size=6, num_experts=8,
                          num_experts_per_tok=2, shared_expert_intermediate_size=10,
                          norm_topk_prob=norm, vocab_size=10, num_hidden_layers=1,
                          layer_types=["full_attention"])
    cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    theirs = Qwen3NextSparseMoeBlock(cfg).eval()
    randomize(theirs)
    ours = MoE(D, 6, 8, 2, norm_topk_prob=norm, shared_hidden_dim=10, shared_gate=True)
    state = rename(theirs.state_dict(), {"gate.weight": "router.weight"})
    ours.load_state_dict(shared_names(state, "shared_expert"))
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def gpt_oss_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's transposed, interleaved experts in qkv's layout (the module docstring)."""
    out = rename(state, {"router.": "router."})
    w = state["experts.gate_up_proj"].transpose(1, 2)  # (E, 2I, d), gate/up interleaved
    b = state["experts.gate_up_proj_bias"]
    out["experts.gate_up_proj"] = torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)
    out["experts.gate_up_proj_bias"] = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)
    return out  # down_proj (E, I, d) and its bias as stored


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_moe_matches_gpt_oss_with_its_clamps(backend):
    cfg = GptOssConfig(hidden_size=D, intermediate_size=6, num_local_experts=4,
                       num_experts_per_tok=2, vocab_size=10, num_hidden_layers=1)
    cfg._experts_implementation = "eager"
    torch.manual_seed(4)
    theirs = GptOssMLP(cfg).eval()
    randomize(theirs, 1.0)
    ours = MoE(D, 6, 4, 2, norm_topk_prob=True, router_bias=True, expert_bias=True,
               activation="clamped_swiglu", swiglu_alpha=cfg.swiglu_alpha,
               swiglu_limit=cfg.swiglu_limit, backend=backend)
    ours.load_state_dict(gpt_oss_experts(theirs.state_dict()))
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        experts = theirs.experts
        gate_up = x.view(-1, D) @ experts.gate_up_proj + experts.gate_up_proj_bias[:, None]
        assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()
        torch.testing.assert_close(ours(x), theirs(x)[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- grouped == loop


@st.composite
def moe_options(draw):
    num_experts = draw(st.sampled_from([1, 2, 4, 6, 8]))
    top_k = draw(st.integers(1, num_experts))
    options = dict(num_experts=num_experts, top_k=top_k,
                   score=draw(st.sampled_from(["softmax", "sigmoid"])),
                   norm_topk_prob=draw(st.booleans()),
                   routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                   activation=draw(st.sampled_from(["swiglu", "geglu", "clamped_swiglu"])),
                   router_bias=draw(st.booleans()), expert_bias=draw(st.booleans()),
                   score_correction_bias=draw(st.booleans()))
    groups = [g for g in (2, 3, 4) if num_experts % g == 0 and num_experts // g >= 2]
    if groups and draw(st.booleans()):
        n_group = draw(st.sampled_from(groups))
        low = -(-top_k // (num_experts // n_group))  # enough groups to hold top_k experts
        options.update(n_group=n_group, topk_group=draw(st.integers(low, n_group)))
    if draw(st.booleans()):
        options.update(shared_hidden_dim=draw(st.integers(1, 8)), shared_gate=draw(st.booleans()))
    return options


@settings(max_examples=40, deadline=None)
@given(options=moe_options(), tokens=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_grouped_equals_the_loop_with_gradients(options, tokens, seed):
    torch.manual_seed(seed)
    moe = MoE(D, 5, **options).double()
    randomize(moe, 1.0)
    x = torch.randn(tokens, D, dtype=F64, requires_grad=True)
    probe = torch.randn(tokens, D, dtype=F64)
    results = []
    for backend in ("loop", "grouped"):
        moe.backend = backend
        out = moe(x)
        if tokens == 0:  # nothing to differentiate
            assert out.shape == (0, D)
            continue
        grads = torch.autograd.grad((out * probe).sum(), (x, *moe.parameters()))
        results.append((out, *grads))
    for loop, grouped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------- counts and refusals


def test_active_parameters_are_counted_from_the_module_on_the_meta_device():
    # DeepSeek-V3's MoE layer: 256 experts of 2048, 8 per token, one shared expert.
    with torch.device("meta"):
        moe = MoE(7168, 2048, 256, 8, score="sigmoid", n_group=8, topk_group=4,
                  score_correction_bias=True, shared_hidden_dim=2048)
    expert = 3 * 7168 * 2048
    router = 256 * 7168
    assert sum(p.numel() for p in moe.parameters()) == router + 257 * expert
    assert moe.active_parameters() == router + 9 * expert  # 8 routed + the shared one
    with torch.device("meta"):  # gpt-oss-20b's: 32 experts of 2880, 4 per token, biases
        oss = MoE(2880, 2880, 32, 4, router_bias=True, expert_bias=True,
                  activation="clamped_swiglu")
    per_expert = 3 * 2880 * 2880 + 2 * 2880 + 2880
    assert oss.active_parameters() == 32 * 2880 + 32 + 4 * per_expert


def test_shapes_and_an_empty_batch():
    moe = MoE(D, 4, 4, 2)
    assert moe(torch.randn(2, 3, D)).shape == (2, 3, D)
    assert moe(torch.randn(0, D)).shape == (0, D)


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_experts=4, top_k=5), "top_k"),
    (dict(num_experts=4, top_k=0), "top_k"),
    (dict(num_experts=6, top_k=2, n_group=4, topk_group=1), "n_group"),
    (dict(num_experts=4, top_k=2, n_group=4, topk_group=1), "n_group"),
    (dict(num_experts=8, top_k=2, n_group=2, topk_group=3), "topk_group"),
    (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "topk_group"),
    (dict(num_experts=8, top_k=2, topk_group=2), "topk_group"),
    (dict(num_experts=4, top_k=2, score="relu"), "score"),
    (dict(num_experts=4, top_k=2, activation="gelu"), "activation"),
    (dict(num_experts=4, top_k=2, backend="fused"), "backend"),
    (dict(num_experts=4, top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(num_experts=4, top_k=2, shared_gate=True), "shared_gate"),
    (dict(num_experts=4, top_k=2, shared_hidden_dim=0), "shared_hidden_dim"),
    (dict(num_experts=4, top_k=2, norm_topk_prob=1), "norm_topk_prob"),
])
def test_bad_options_are_one_line_errors(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words) as excinfo:
        MoE(D, 4, **kwargs)
    assert "\n" not in str(excinfo.value)


def test_a_wrong_width_is_a_one_line_error():
    with pytest.raises(ValueError, match=rf"x must have shape \(\.\.\., {D}\)") as excinfo:
        MoE(D, 4, 4, 2)(torch.randn(3, D + 1))
    assert "\n" not in str(excinfo.value)
