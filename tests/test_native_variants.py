"""decode.c's layers of the models of 2025-26 against float64 references: mixtures of
experts (routing and experts, kernel by kernel against :class:`qkv.models.moe.MoE` in
float64), then each family's native steps against the float64 model and its greedy
tokens against the module path's. ``tests/test_native_decode.py`` covers the dense
families the same way."""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys

import pytest
import torch

from qkv.attention_variants import GatedAttention, SinkAttention
from qkv.kernels import Mat, Moe, decode_kernels, unavailable_reason
from qkv.models.gpt import GPTConfig, GPTModel, generate
from qkv.models.gpt import native_unsupported as unsupported
from qkv.models.moe import MoE
from qkv.models.native_decode import NativeDecoder
from qkv.multihead import MultiHeadAttention
from test_native_decode import as_float64, ptr, step_logits

LIB = decode_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"no native kernels: "
                                   f"{unavailable_reason()}")
DT = {torch.float32: 0, torch.bfloat16: 1}

# The routings qkv.models.moe supports, each in a family's shape.
ROUTINGS = {
    # Qwen3-MoE / Qwen3-Next: softmax, renormalised top-k, a sigmoid-gated shared expert
    "qwen": dict(num_experts=8, top_k=2, norm_topk_prob=True, shared_hidden_dim=24,
                 shared_gate=True),
    # DeepSeek-V3: sigmoid scores, choice bias, 4 groups of which 2 stay, scaled weights
    "deepseek": dict(num_experts=8, top_k=3, score="sigmoid", norm_topk_prob=True,
                     routed_scaling_factor=2.5, n_group=4, topk_group=2,
                     score_correction_bias=True, shared_hidden_dim=32),
    # gpt-oss: softmax of the top k (= renormalised), biases, the clamped SwiGLU
    "gpt_oss": dict(num_experts=4, top_k=2, norm_topk_prob=True, router_bias=True,
                    expert_bias=True, activation="clamped_swiglu", swiglu_limit=1.5),
    # Mixtral-like: softmax weights left unnormalised, GeGLU experts
    "plain": dict(num_experts=6, top_k=2, activation="geglu"),
}
SCORE = {"softmax": 0, "sigmoid": 1}
GLU = {"swiglu": 0, "geglu": 1, "clamped_swiglu": 2}


def mat(w):
    return Mat() if w is None else Mat(data=w.data_ptr(), type=DT[w.dtype])


def make_moe(routing: str, d_model: int = 32, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(d_model, 16, **ROUTINGS[routing], backend="loop").eval()
    if moe.e_score_correction_bias is not None:  # a bias that moves the choice
        moe.e_score_correction_bias.copy_(0.2 * torch.randn(moe.num_experts))
    return moe


# the most threads a test runs the experts kernel on (its work buffer holds their sums)
THREADS = 3


def moe_struct(moe: MoE, keep: dict) -> Moe:
    """decode.c's qkv_moe for ``moe``, written from the module's fields here; ``keep``
    gets every tensor it points to (the work buffers by name)."""
    def vec(t):
        if t is None:
            return None
        t = t.detach().float().contiguous()
        keep[len(keep)] = t
        return t.data_ptr()

    def buf(name, n, dtype=torch.float32):
        keep[name] = torch.zeros(n, dtype=dtype)
        return keep[name]

    ex, sh = moe.experts, moe.shared_expert
    s = Moe(experts=moe.num_experts, top_k=moe.top_k, score=SCORE[moe.score],
            norm_topk=int(moe.norm_topk_prob), n_group=moe.n_group,
            topk_group=moe.topk_group, glu=GLU[ex.activation], width=ex.hidden_dim,
            shared_width=0 if sh is None else sh.fc1.out_features,
            scaling=moe.routed_scaling_factor, alpha=ex.alpha, limit=ex.limit,
            router=mat(moe.router.weight), router_bias=vec(moe.router.bias),
            choice_bias=vec(moe.e_score_correction_bias), gate_up=mat(ex.gate_up_proj),
            down=mat(ex.down_proj), gate_up_bias=vec(ex.gate_up_proj_bias),
            down_bias=vec(ex.down_proj_bias),
            shared_gate=mat(None if moe.shared_expert_gate is None
                            else moe.shared_expert_gate.weight))
    if sh is not None:
        s.shared1, s.shared2, s.shared3 = mat(sh.fc1.weight), mat(sh.fc2.weight), \
            mat(sh.fc3.weight)
        s.shared_b1, s.shared_b2, s.shared_b3 = (vec(m.bias) for m in
                                                 (sh.fc1, sh.fc2, sh.fc3))
    s.logits = buf("logits", moe.num_experts + 1).data_ptr()
    s.weights = buf("weights", moe.top_k).data_ptr()
    s.hidden = buf("hidden", moe.top_k * ex.hidden_dim + s.shared_width).data_ptr()
    s.chosen = buf("chosen", moe.top_k, torch.int32).data_ptr()
    s.partial = buf("partial", THREADS * moe.d_model).data_ptr()  # each thread's sum
    return s


# ----------------------------------------------------------------------------
# mixture of experts, kernel by kernel


@needs_kernels
@pytest.mark.parametrize("routing", ROUTINGS)
def test_route_kernel_chooses_and_weighs_as_moe_route(routing):
    # A router that is the identity hands MoE.route the logits as they are.
    moe = make_moe(routing, d_model=ROUTINGS[routing]["num_experts"]).double()
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(moe.num_experts))
        if moe.router.bias is not None:
            moe.router.bias.zero_()
    keep: dict = {}
    s = moe_struct(moe.float(), keep)
    moe.double()
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        x = 2 * torch.randn(moe.num_experts, generator=g, dtype=torch.float64)
        keep["logits"][: moe.num_experts] = x
        LIB.qkv_route(ctypes.byref(s))
        ref_w, ref_e = moe.route(x[None])
        # the same experts in the same order (best first), the same weights
        assert keep["chosen"].tolist() == ref_e[0].tolist()
        assert torch.allclose(keep["weights"].double(), ref_w[0], atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("threads", [2, 3])
def test_moe_kernel_is_the_float64_moe(routing, dtype, mode, threads):
    moe = make_moe(routing).to(dtype)
    keep: dict = {}
    s = moe_struct(moe, keep)
    ref_moe = make_moe(routing).double()
    ref_moe.load_state_dict(moe.state_dict())  # the weights as rounded to dtype
    g = torch.Generator().manual_seed(2)
    # 3 x N(0, 1) tokens: gpt-oss's clamps (at 1.5 here) cut some of the projections
    xs, ys = 3 * torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    with torch.no_grad():
        ref = ref_moe(xs.double()) + (ys.double() if mode else 0)
    for x, y, r in zip(xs, ys.clone(), ref, strict=True):
        # 3 threads: shares of the experts' rows and of y's outputs that end mid-expert
        LIB.qkv_moe_forward(ctypes.byref(s), ptr(x), ptr(y), 32, mode, threads)
        assert torch.allclose(y.double(), r, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# attention with sinks and gates


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks, gate", [(True, False), (False, True), (True, True),
                                         (False, False)])
def test_attend_cached_kernel_with_sinks_and_gates(dtype, sinks, gate):
    heads, kv_heads, hd, cache_len, n = 6, 2, 12, 10, 7
    g = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(kv_heads, cache_len, hd, generator=g).to(dtype)
                    for _ in range(2))
    before = keys.clone(), values.clone()
    q = torch.randn(heads, hd, generator=g)
    sink = 2 * torch.randn(heads, generator=g) if sinks else None
    gates = torch.randn(heads, hd, generator=g) if gate else None
    out, scores = torch.empty(heads * hd), torch.empty(heads * cache_len)
    LIB.qkv_attend_cached(ptr(q), ptr(keys), ptr(values), DT[dtype], ptr(out), heads,
                          kv_heads, hd, cache_len, n, 0.3, ptr(sink), ptr(gates),
                          ptr(scores), 2)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])  # read only
    # the definition: head h reads key/value head h // 3; its sink is one more logit
    # with no value; then each output value times sigmoid(its gate)
    k = keys[:, :n].double().repeat_interleave(3, dim=0)
    v = values[:, :n].double().repeat_interleave(3, dim=0)
    logits = (k @ q.double()[:, :, None])[..., 0] * 0.3  # (heads, n)
    if sinks:
        logits = torch.cat((logits, sink.double()[:, None]), dim=1)
    weights = torch.softmax(logits, dim=1)[:, :n]
    ref = (weights[:, None] @ v)[:, 0]
    if gate:
        ref = ref * torch.sigmoid(gates.double())
    assert torch.allclose(out.double().view(heads, hd), ref, atol=1e-5)


# ----------------------------------------------------------------------------
# whole models


def tiny(dtype=torch.float32, **overrides) -> GPTModel:
    cfg = dict(vocab_size=61, context_length=24, emb_dim=32, n_heads=4, n_layers=2,
               drop_rate=0.0, rope=True, norm="rmsnorm", mlp="swiglu", hidden_dim=48,
               out_bias=False, mlp_bias=False, n_kv_groups=2)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():  # norms and biases away from their ones and zeros, so they count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith("sinks"):  # zero sinks would be a weak test
                p.copy_(torch.randn_like(p))
            if name.endswith(("router_scale", "per_expert_scale")):  # Gemma 4's, off ones
                p.copy_(0.5 + torch.rand_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
            if name.endswith("layer_scalar"):  # Gemma 4's, off their ones
                b.copy_(0.5 + torch.rand_like(b))
    return model.to(dtype)


def moe_layers(routing: str, layout: list[dict]) -> dict:
    return dict(moe=dict(hidden_dim=16, **ROUTINGS[routing]), layout=layout)


LATENT = {"kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
          "v_head_dim": 8}
SPARSE = {**LATENT, "q_lora_rank": 12, "index_n_heads": 4, "index_head_dim": 8,
          "index_topk": 6}
DELTA = {"num_k_heads": 2, "head_k_dim": 8, "num_v_heads": 4, "head_v_dim": 6}
FAMILIES = {
    # Gated DeltaNet (two value heads per key head, a 3-tap window), then gated attention
    # (a quarter of each head turned), experts with a gated shared expert (Qwen3-Next)
    "qwen3_next": {**moe_layers("qwen", [{"attention": "gated_deltanet", "mlp": "moe"},
                                         {"attention": "gated", "mlp": "moe"}]),
                   "attention_options": {"gated_deltanet": {**DELTA, "conv_kernel_size": 3},
                                         "gated": {"rotary_dim": 4}},
                   "head_dim": 16, "qk_norm": True},
    # two Gated DeltaNet layers to one of gated attention, dense MLPs (Qwen3.5)
    "qwen35": {"n_layers": 3, "layout": [{"attention": "gated_deltanet"}] * 2
               + [{"attention": "gated"}], "attention_options": {"gated_deltanet": DELTA}},
    # a dense layer, then DeepSeek-V3's routing
    "deepseek_moe": moe_layers("deepseek", [{"mlp": "dense"}, {"mlp": "moe"}]),
    # sinks, sliding and full layers in turn, biases, clamped SwiGLU experts (gpt-oss)
    "gpt_oss": {**moe_layers("gpt_oss", [{"attention": "sink", "mlp": "moe"}] * 2),
                "qkv_bias": True, "out_bias": True, "window_size": 5,
                "layer_types": ["sliding", "full"]},
    # latent attention with a query latent (interleaved RoPE pairs), then with experts
    "deepseek_v2_mla": {**moe_layers("qwen", [{"attention": "latent"},
                                              {"attention": "latent", "mlp": "moe"}]),
                        "attention_options": {"latent": {**LATENT, "q_lora_rank": 12}}},
    # latent attention without a query latent, "rotate half" RoPE, beside an MHA layer
    "mla_q_proj": {"layout": [{"attention": "latent"}, {}],
                   "attention_options": {"latent": {**LATENT, "rope_interleave": False}}},
    # DeepSeek sparse attention: 6 of up to 20 positions
    "deepseek_v32_dsa": {"layout": [{"attention": "sparse_latent"}] * 2,
                         "attention_options": {"sparse_latent": SPARSE}},
    # a layer without positions (SmolLM3's every fourth)
    "smollm3_nope": {"layout": [{}, {"rope": False}]},
    # the last two layers read the first two's caches, sliding and full (Gemma 4)
    "gemma4_shared_kv": {"n_layers": 4, "window_size": 5,
                         "layer_types": ["sliding", "full"] * 2,
                         "layout": [{}, {}, {"attention": "shared_kv", "kv_source": 0},
                                    {"attention": "shared_kv", "kv_source": 1}]},
}



@functools.cache
def gemma4_text() -> dict:
    """The GPTConfig fields qkv imports a tiny Gemma 4 text model with (transformers'
    Gemma4TextConfig, as tests/test_open_models.py builds it, read by hf_open): sliding
    layers of 8-wide heads, full ones of 16-wide heads with one key/value head whose values
    are its keys, a quarter of each head turned; every value head normalised; the last two
    layers sharing the caches of the last earlier one of their kind, with twice wider
    MLPs; per-layer inputs; a scalar per layer; logits soft-capped at 30 (the tiny
    model's reach about 35)."""
    from qkv.models.hf_open import config_fields

    return config_fields(gemma4_config().to_dict(), "gemma4_text")


@functools.cache
def gemma4_moe() -> dict:
    """The same with experts beside every dense MLP (Gemma 4's MoE models: 4 experts, 2
    chosen, their router normalising what it scores, a scale per expert)."""
    from qkv.models.hf_open import config_fields

    return config_fields(gemma4_config(moe=True).to_dict(), "gemma4_text")


@functools.cache
def gemma4_config(moe: bool = False):
    transformers = pytest.importorskip("transformers")
    experts = dict(num_experts=4, top_k_experts=2, moe_intermediate_size=16) if moe else {}
    return transformers.Gemma4TextConfig(**experts, enable_moe_block=moe,
        vocab_size=61, hidden_size=32, intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention"],
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=61, final_logit_softcapping=30.0,
        max_position_embeddings=24, pad_token_id=0)


# families whose fields come from transformers' configs (imported only when they run)
FROM_TRANSFORMERS = {"gemma4_text": gemma4_text, "gemma4_moe": gemma4_moe}


def fields(family: str) -> dict:
    return FROM_TRANSFORMERS[family]() if family in FROM_TRANSFORMERS else FAMILIES[family]


def test_the_gemma4_family_has_what_it_is_meant_to_test():
    model = tiny(**fields("gemma4_text"))
    cfg, blocks = model.cfg, model.trf_blocks
    assert cfg.per_layer_inputs == {"width": 8, "vocab_size": 61} and cfg.layer_scalar
    assert cfg.logit_softcap == 30.0
    assert [b.spec.kv_source for b in blocks] == [None, None, None, 2, 1]
    assert blocks[1].att.W_value is None and blocks[0].att.W_value is not None
    assert all(b.att.v_norm is not None for b in blocks[:3])
    assert [b.att.head_dim for b in blocks] == [8, 16, 8, 8, 16]
    assert blocks[0].att.window_size == 5 and blocks[1].att.window_size is None
    assert all(b.ff.fc1.out_features == 48 for b in blocks[3:])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [*FAMILIES, *FROM_TRANSFORMERS])
def test_native_steps_match_the_float64_model(family, dtype):
    model = tiny(dtype, **fields(family))
    assert unsupported(model) is None
    ids = torch.randint(0, 61, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = as_float64(model)(ids)[0, 4:]
    native = step_logits(model, ids, 4, native=True)
    module = step_logits(model, ids, 4, native=False)
    native_err = (native - ref).abs().max().item()
    module_err = (module - ref).abs().max().item()
    # rounding is relative to the logits' size (Gemma 4's tied ones reach about 25)
    size = max(1.0, ref.abs().max().item() / 10)
    if dtype == torch.float32:
        assert native_err < 1e-5 * size and module_err < 1e-5 * size
    else:  # within a bfloat16 step of the largest logits
        assert native_err < max(0.05, 2 ** -7 * ref.abs().max().item())
        assert native_err <= module_err + 1e-3


@needs_kernels
@pytest.mark.parametrize("family", [*FAMILIES, *FROM_TRANSFORMERS])
def test_every_family_generates_the_same_tokens_on_both_paths(family):
    model = tiny(**fields(family))
    idx = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    native = generate(model, idx, 30, native=True)
    module = generate(model, idx, 30, native=False)
    assert torch.equal(native, module)


def test_native_unsupported_names_the_layers_without_a_step():
    # Every attention kind qkv builds has a step now; a class of one's own has not.
    class MyAttention(GatedAttention):
        pass

    model = tiny(**FAMILIES["qwen35"])
    assert unsupported(model) == unavailable_reason()
    model.trf_blocks[2].att.__class__ = MyAttention
    assert unsupported(model).startswith("MyAttention layers have no native step")
    idx = torch.tensor([[1, 2]])
    assert torch.equal(generate(model, idx, 3), generate(model, idx, 3, native=False))


@needs_kernels
@pytest.mark.parametrize("moe", [False, True])
def test_gemma4_native_tokens_are_transformers_greedy_ones(moe):
    # transformers' own Gemma 4, its norms and scales moved off their initial values and
    # its matrices scaled up 4 times (so that its greedy tokens vary), imported as
    # `qkv lm import` does; 19 tokens, well past the 5-token window
    import transformers

    from qkv.models.hf_open import to_qkv

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        gemma4_config(moe), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "norm" in name or name.endswith(("layer_scalar", "router.scale",
                                                "per_expert_scale")):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed" not in name:
                p.mul_(4.0)
    fields = gemma4_moe() if moe else gemma4_text()
    model = GPTModel(GPTConfig(**fields)).eval()
    model.load_state_dict(to_qkv(dict(hf.state_dict()), fields, "gemma4_text"))
    assert unsupported(model) is None
    idx = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf.generate(idx, max_new_tokens=19, min_new_tokens=19, do_sample=False)
    got = generate(model, idx, 19, native=True)
    assert torch.equal(got, want)
    assert len(set(got[0, 5:].tolist())) > 5  # not one token repeated


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_quantized_per_layer_input_table_is_read_in_its_blocks(qtype):
    # The table as a GGUF file keeps it (5 layers x 32 values a row): the step expands
    # the token's row only, so the logits are the float64 model's on the expanded table.
    pytest.importorskip("gguf")
    from test_quant_decode import Blocks

    model = tiny(**{**fields("gemma4_text"), "per_layer_inputs": {"width": 32,
                                                                   "vocab_size": 61}})
    model.per_layer_inputs.embed = Blocks(model.per_layer_inputs.embed, qtype, seed=5)
    assert unsupported(model) is None
    ref = GPTModel(model.cfg).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith(".blocks")}
    state["per_layer_inputs.embed.weight"] = model.per_layer_inputs.embed.expanded()
    ref.load_state_dict(state)
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref.double()(ids)[0, 4:]
    got = step_logits(model, ids, 4, native=True)
    assert (got - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item() / 10)


@needs_kernels
def test_a_token_past_the_per_layer_input_table_is_refused():
    model = tiny(**{**fields("gemma4_text"), "per_layer_inputs": {"width": 8,
                                                                   "vocab_size": 40}})
    caches = model.new_caches(1)
    with torch.no_grad():
        model(torch.tensor([[3, 4]]), caches=caches)
    decoder = NativeDecoder(model, caches)
    decoder.step(39)
    with pytest.raises(ValueError, match="token id 40 is past the per-layer input table's 40 "):
        decoder.step(40)
    assert caches[0].pos == 3  # nothing was appended


@needs_kernels
def test_sparse_attention_reads_only_the_selected_latents():
    # The same weights with every position selected are dense MLA: the logits differ
    # once there are more than index_topk positions, so the selection is in effect.
    sparse = tiny(**FAMILIES["deepseek_v32_dsa"])
    dense = tiny(**{**FAMILIES["deepseek_v32_dsa"], "attention_options": {
        "sparse_latent": {**SPARSE, "index_topk": 24}}})
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    a, b = step_logits(sparse, ids, 2, True, 1), step_logits(dense, ids, 2, True, 1)
    assert torch.allclose(a[:4], b[:4], atol=1e-5)  # up to 6 positions: all selected
    assert (a[5:] - b[5:]).abs().amax(dim=-1).min() > 1e-3


@needs_kernels
def test_deltanet_state_stays_float32_in_a_bfloat16_model():
    model = tiny(torch.bfloat16, **FAMILIES["qwen35"])
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    states = []
    for native in (True, False):
        caches = model.new_caches(1)
        with torch.no_grad():
            model(ids[:, :4], caches=caches)
            decoder = NativeDecoder(model, caches) if native else None
            for t in range(4, 12):
                if native:
                    decoder.step(int(ids[0, t]))
                else:
                    model(ids[:, t : t + 1], caches=caches)
        states.append(caches[0].state)
        assert caches[0].state.dtype == torch.float32 and caches[0].pos == 12
    # the same state to bfloat16's rounding of the activations the module path makes
    assert torch.allclose(states[0], states[1], atol=0.05)
    assert states[0].abs().max() > 0.1


@needs_kernels
@pytest.mark.parametrize("family", ["deepseek_v2_mla", "deepseek_v32_dsa", "gpt_oss",
                                    "gemma4_text"])
def test_two_threads_give_one_threads_logits(family):
    # The work each thread does alone: latent attention's share of the positions (and
    # the merge of the threads' softmaxes), the experts' rows (added without a barrier),
    # Gemma 4's per-layer input products (their rows shared out, then one thread's step).
    model = tiny(**fields(family))
    ids = torch.randint(0, 61, (1, 14), generator=torch.Generator().manual_seed(3))
    one, two = (step_logits(model, ids, 2, True, threads) for threads in (1, 2))
    assert torch.allclose(one, two, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_latent_steps_over_many_tiles_match_the_float64_model(threads):
    # The latent step reads the cache 16 positions a tile on each thread: 41-69 cached
    # positions give whole tiles and a part of one on every thread, a latent rank of 12
    # a vector of 8 values and 4 single ones.
    options = {**LATENT, "kv_lora_rank": 12, "q_lora_rank": 12}
    model = tiny(context_length=80, layout=[{"attention": "latent"}] * 2,
                 attention_options={"latent": options})
    ids = torch.randint(0, 61, (1, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = as_float64(model)(ids)[0, 40:]
    native = step_logits(model, ids, 40, True, threads)
    size = max(1.0, ref.abs().max().item() / 10)
    assert (native - ref).abs().max().item() < 1e-5 * size


@needs_kernels
@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512"
                    or os.environ.get("QKV_NATIVE_AVX512") == "0",
                    reason="the AVX2 build is the one these tests ran")
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    # The kernels above and three families' steps, in the build a CPU without AVX-512 runs.
    # (test_native_decode.py checks that build's dot products in the default run; the
    # code of these layers is the same in both builds, so this one is QKV_SLOW=1 only.)
    if os.environ.get("QKV_SLOW") != "1":
        pytest.skip("set QKV_SLOW=1 to run these kernels' tests on the AVX2 build too")
    env = {**os.environ, "QKV_NATIVE_AVX512": "0", "QKV_KERNEL_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "kernel and not avx2 or float64 and (deepseek_v32 or qwen3_next or gemma4)"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "passed" in proc.stdout
    assert len(list(tmp_path.glob("decode-*.so"))) == 1  # the AVX2 build, on its own key


def test_decode_bytes_count_active_experts_latents_and_states():
    from qkv.bench.lm import decode_bytes_per_token

    # two latent layers, the second with 8 experts of which 2 run; steps attend to
    # 4 .. 13 positions (8.5 on average)
    model = tiny(**FAMILIES["deepseek_v2_mla"])
    cfg, moe = model.cfg, model.trf_blocks[1].ff
    routed = sum(p.numel() for p in moe.experts.parameters())
    unread = (cfg.vocab_size - 1) * cfg.emb_dim + routed * (1 - 2 / 8)
    counted = decode_bytes_per_token(model, prompt_len=4, new_tokens=10)
    assert counted["weights"] == pytest.approx((cfg.num_parameters() - unread) * 4)
    assert counted["kv_cache"] == pytest.approx(2 * (16 + 4) * 8.5 * 4)
    # sparse: every index key (8 wide), then the latents of at most 6 positions
    sparse = decode_bytes_per_token(tiny(**FAMILIES["deepseek_v32_dsa"]), 4, 10)
    assert sparse["kv_cache"] == pytest.approx(2 * (8 * 8.5 + 20 * 5.7) * 4)  # 4, 5, 6, 6..
    # Gated DeltaNet: its float32 state (4 heads of 8 x 6) and its window (3 taps of
    # 2 x 16 + 24 channels), read and written, beside a gated layer's keys and values
    hybrid = decode_bytes_per_token(tiny(torch.bfloat16, **FAMILIES["qwen35"]), 4, 10)
    state = 2 * (4 * 8 * 6 * 4 + 3 * 56 * 2)
    assert hybrid["kv_cache"] == pytest.approx(2 * state + 2 * 2 * 8 * 8.5 * 2)
    # Gemma 4: one row (5 layers x 8) of the 61-row per-layer input table; the tied
    # token table read in full, as the head
    gemma4 = tiny(**fields("gemma4_text"))
    every = sum(p.numel() for p in gemma4.parameters())
    assert decode_bytes_per_token(gemma4, 4, 10)["weights"] == pytest.approx(
        (every - 60 * 5 * 8) * 4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_of_different_heads_and_head_sizes(dtype):
    # Gemma 4's global layers have wider heads than its sliding ones: each layer its own.
    import copy

    model = tiny(n_layers=3)
    torch.manual_seed(1)
    model.trf_blocks[1].att = MultiHeadAttention(
        32, 32, 24, 0.0, num_heads=2, num_kv_groups=1, head_dim=24, rope=True,
        out_bias=False, scale=0.3).eval()
    model.trf_blocks[2].att = SinkAttention(32, 32, 24, 0.0, num_heads=8, num_kv_groups=4,
                                            head_dim=4, rope=True, out_bias=False).eval()
    with torch.no_grad():
        model.trf_blocks[2].att.sinks.normal_()
    model = model.to(dtype)
    assert unsupported(model) is None
    ids = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(ids)[0, 4:]
    native = step_logits(model, ids, 4, native=True)
    assert (native - ref).abs().max() < (1e-5 if dtype == torch.float32 else 0.05)
