"""qkv.heads on the layers other than multi-head attention: latent (DeepSeek-V3) and sparse
latent (DeepSeek-V3.2) attention against transformers' own eager attention (the tensors
its attention function receives and returns, recorded by wrapping that function), Gated
DeltaNet against transformers' Qwen3.5 layer, and the Bahdanau translator's additive
attention against its own attention weights and a float64 hand computation."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from qkv.heads import capture, intervene
from qkv.heads.interventions import ablated_logits, patch
from qkv.heads.scores import head_scores, induction_batch, scores_of_weights
from qkv.models.gpt import GPTConfig, GPTModel, generate

transformers = pytest.importorskip("transformers")

VOCAB = 61
POINTS = ["q", "k", "v", "scores", "weights", "head_out"]
DEEPSEEK = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
    moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1, pad_token_id=0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10_000.0,
                     "original_max_position_embeddings": 16, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
MODULES = {"deepseek_v3": "transformers.models.deepseek_v3.modeling_deepseek_v3",
           "deepseek_v32": "transformers.models.deepseek_v32.modeling_deepseek_v32"}


def hf_deepseek(family: str, vocab: int = VOCAB):
    """A tiny transformers model of ``family`` (V3.2: each query's 5 best keys) and the
    same weights imported into qkv."""
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(**{**DEEPSEEK, "vocab_size": vocab})
    else:
        config = transformers.DeepseekV32Config(**{**DEEPSEEK, "vocab_size": vocab},
                                                index_n_heads=2, index_head_dim=16,
                                                index_topk=5)
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # sharper heads than transformers' initial scale gives
        for name, p in hf.named_parameters():
            if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
                p.mul_(3.0)
    from qkv.models.hf_open import config_fields, to_qkv
    fields = config_fields(config.to_dict(), "test")
    model = GPTModel(GPTConfig(**fields))
    model.load_state_dict(to_qkv(hf.state_dict(), fields, config.model_type))
    return hf.eval(), model.eval()


@contextlib.contextmanager
def hf_attention_calls(family: str):
    """Record each call of transformers' eager attention function: ``(query, key, value,
    weights, output (b, T, h, d_v))``, in order (layer 0, layer 1, layer 0, ...)."""
    module = importlib.import_module(MODULES[family])
    original = module.eager_attention_forward
    calls = []

    def recorded(mod, query, key, value, *args, **kwargs):
        out, weights = original(mod, query, key, value, *args, **kwargs)
        calls.append((query, key, value, weights, out))
        return out, weights

    module.eager_attention_forward = recorded
    try:
        yield calls
    finally:
        module.eager_attention_forward = original


def half_pairs(t: torch.Tensor, d_r: int = 8) -> torch.Tensor:
    """``t (..., d_n + d_r)`` with its rotated part's interleaved pairs ``(2i, 2i + 1)``
    (DeepSeek's weights, as qkv rotates them) laid out as ``(i, i + d_r / 2)``, as
    transformers reorders them before rotating (dot products are the same)."""
    nope, rope = t[..., :-d_r], t[..., -d_r:]
    rope = rope.unflatten(-1, (d_r // 2, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat((nope, rope), dim=-1)


@pytest.fixture(scope="module", params=list(MODULES))
def pair(request):
    return request.param, *hf_deepseek(request.param)


def test_capture_keeps_the_logits_and_equals_transformers_attention(pair):
    family, hf, model = pair
    ids = induction_batch(VOCAB, length=6, batch=2, seed=1)
    with torch.no_grad():
        plain = model(ids)
        with capture(model) as cache:
            recorded = model(ids)
        assert torch.equal(plain, recorded)  # bit for bit
        with hf_attention_calls(family) as calls:
            hf(ids)
    assert len(calls) == 2
    for layer, (query, key, value, weights, out) in enumerate(calls):
        for name, want in (("q", query), ("k", key), ("v", value), ("weights", weights),
                           ("head_out", out)):
            got = cache[name, layer]
            if name in ("q", "k"):
                got = half_pairs(got)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=0,
                                       msg=f"{name} of layer {layer}")
        # the scores are the weights' logits: -inf exactly where a weight is 0 (future
        # keys; for V3.2 also the keys the indexer did not select)
        scores = cache["scores", layer]
        assert torch.equal(torch.isinf(scores), weights == 0)
        torch.testing.assert_close(torch.softmax(scores.double(), -1).float(), weights,
                                   atol=2e-6, rtol=0)
    if family == "deepseek_v32":  # sparse: each query weighs at most index_topk keys
        assert ((cache["weights", 1] > 0).sum(-1) <= 5).all()
        assert ((cache["weights", 1] > 0).sum(-1) == 5).any()


def test_the_pages_contribution_view_of_latent_layers_is_transformers_values_norms():
    """``qkv view``'s contribution view (Kobayashi et al.: ``a_ij |v_j W_O,h|``) on latent
    layers, from the weights and values transformers' eager attention used and its
    ``o_proj``, in float64."""
    from qkv.data.tokenizers import get_tokenizer
    from qkv.tasks.lm import LanguageModel, LMSettings
    from qkv.viz.data import decode_section, page_data

    hf, model = hf_deepseek("deepseek_v3", vocab=257)
    lm = LanguageModel(model, get_tokenizer("bytes"), LMSettings(preset="tiny"))
    text = "abcabcab"
    (section,) = page_data(lm, [text])["examples"][0]["sections"]
    got = decode_section(section["views"]["contribution"]).double()  # (L, H, T, T)
    with torch.no_grad(), hf_attention_calls("deepseek_v3") as calls:
        hf(torch.tensor([lm.tokenizer.encode(text)]))
    for layer, (_, _, value, weights, _) in enumerate(calls):
        w_o = hf.model.layers[layer].self_attn.o_proj.weight.double()  # (d, H * d_v)
        want = torch.empty_like(got[layer])
        for head in range(4):
            f = value[0, head].double() @ w_o[:, 16 * head: 16 * head + 16].T  # (T, d)
            want[head] = weights[0, head].double() * f.norm(dim=-1)[None, :]
        torch.testing.assert_close(got[layer], want, rtol=0.03, atol=1e-6)  # the page's rounding


def test_generation_is_captured_step_by_step_as_transformers_attends(pair):
    """Through the latent cache (the prompt decompressed, then one token at a time in the
    absorbed form), each step's weights are transformers' cached generation's; for dense
    MLA the joined steps are also the capture of the whole sequence in one call."""
    family, hf, model = pair
    prompt = induction_batch(VOCAB, length=3, batch=1, seed=2)
    with torch.no_grad(), capture(model, POINTS) as steps:
        seq = generate(model, prompt, 5, native=False)
    want = hf.generate(prompt, max_new_tokens=5, do_sample=False, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones_like(prompt),
                       output_attentions=True, return_dict_in_generate=True)
    assert seq.tolist() == want.sequences.tolist()
    assert len(steps.steps("weights", 1)) == 5  # the prompt, then 4 one-token calls
    for step, attentions in enumerate(want.attentions[:5]):
        for layer in (0, 1):
            torch.testing.assert_close(steps.steps("weights", layer)[step], attentions[layer],
                                       atol=2e-6, rtol=0)
    if family == "deepseek_v32":
        return  # top-k ties at 0 break differently over one row than over a sequence
    with torch.no_grad(), capture(model, POINTS) as whole:
        model(seq[:, :-1])
    for name in POINTS:
        a, b = steps[name, 1], whole[name, 1]
        if name == "scores":
            assert torch.equal(torch.isinf(a), torch.isinf(b))
            a, b = a[torch.isfinite(a)], b[torch.isfinite(b)]
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=name)


def test_ablating_a_latent_head_is_transformers_forward_without_it():
    hf, model = hf_deepseek("deepseek_v3")[:2]
    ids = induction_batch(VOCAB, length=6, batch=2, seed=3)
    layer, head = 1, 2

    def zero_head(module, args):  # o_proj's input is the heads' outputs side by side
        x = args[0].clone()
        x[..., head * 16:(head + 1) * 16] = 0.0
        return (x,)

    handle = hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        handle.remove()
    got = ablated_logits(model, ids, [(layer, head)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(got, model(ids), atol=1e-3)
    # patching the clean run into itself changes nothing, at any position
    for pos in (0, ids.shape[1] - 1):
        same = patch(model, ids[:1], ids[:1], point="head_out", layer=1, position=pos,
                     good=3, bad=4, head=1)
        assert same.after == same.before


def test_editing_q_changes_the_layer_and_k_v_scores_are_read_only():
    _, model = hf_deepseek("deepseek_v3")
    ids = induction_batch(VOCAB, length=4, batch=1, seed=4)
    with torch.no_grad():
        plain = model(ids)
        with intervene(model, {("q", 1): lambda q: q}):
            assert torch.equal(model(ids), plain)
        # every query zero: each head weighs its keys uniformly
        with intervene(model, {("q", 1): torch.zeros_like}), \
                capture(model, ["weights"], [1]) as cache:
            model(ids)
    t = ids.shape[1]
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
    torch.testing.assert_close(cache["weights", 1][0], uniform.expand(4, t, t))
    # the absorbed form over many queries records what the decompressed one does
    with torch.no_grad(), capture(model, ["scores", "weights"]) as decompressed:
        model(ids)
    for block in model.trf_blocks:
        block.att.backend = "absorbed"
    try:
        with torch.no_grad(), capture(model, ["scores", "weights"]) as absorbed:
            torch.testing.assert_close(model(ids), plain, atol=1e-5, rtol=0)
    finally:
        for block in model.trf_blocks:
            block.att.backend = "auto"
    for name in ("scores", "weights"):
        torch.testing.assert_close(absorbed[name, 1], decompressed[name, 1], atol=1e-5, rtol=0)
    for name in ("k", "v", "scores", "weights"):
        with pytest.raises(ValueError, match=rf"^intervene: '{name}' is computed beside the "
                                             r"kernel and only read in layer 0 \(a 'latent'"), \
                intervene(model, {(name, 0): lambda x: x}):
            pass


def test_the_catalogue_scores_latent_layers_from_their_weights():
    family = "deepseek_v32"
    hf, model = hf_deepseek(family)
    ids = induction_batch(VOCAB, length=6, batch=2, seed=5)
    table = head_scores(model, ids, repeat=6)
    assert [(r["layer"], r["head"]) for r in table] == [(i, h) for i in (0, 1)
                                                        for h in range(4)]
    with torch.no_grad():
        attentions = hf(ids, output_attentions=True).attentions
    for row in table:
        want = scores_of_weights(attentions[row["layer"]], repeat=6)
        for name, values in want.items():
            assert row[name] == pytest.approx(float(values[row["head"]]), abs=1e-5), name


def hf_qwen3_5():
    """A tiny transformers Qwen3.5 (three Gated DeltaNet layers of two key heads, each
    serving three value heads, then a full-attention one) and the same weights in qkv."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=12, pad_token_id=0)
    torch.manual_seed(4)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # norms off their initial values, so a misplaced one would show
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    from qkv.models.hf_open import config_fields, to_qkv
    fields = config_fields(config.to_dict(), "test")
    model = GPTModel(GPTConfig(**fields))
    model.load_state_dict(to_qkv(hf.state_dict(), fields, config.model_type))
    return hf.eval(), model.eval()


def test_deltanet_layers_give_q_k_v_and_head_out_as_transformers_computes_them(tmp_path,
                                                                            capsys):
    hf, model = hf_qwen3_5()
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    ids = induction_batch(VOCAB, length=6, batch=2, seed=6)
    calls, outs = [], []
    original = module.torch_chunk_gated_delta_rule

    def recorded(query, key, value, **kwargs):  # (b, T, heads, d), q and k not normalised
        calls.append((query, key, value))
        return original(query, key, value, **kwargs)

    hooks = [layer.linear_attn.out_proj.register_forward_pre_hook(
        lambda m, args: outs.append(args[0])) for layer in hf.model.layers[:3]]
    module.torch_chunk_gated_delta_rule = recorded
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        module.torch_chunk_gated_delta_rule = original
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        plain = model(ids)
        with capture(model, ["q", "k", "v", "head_out"], layers=[0, 1, 2]) as cache:
            assert torch.equal(model(ids), plain)  # bit for bit
        with capture(model) as every:  # each layer gives the points it has
            assert torch.equal(model(ids), plain)
    assert ("weights", 3) in every and ("weights", 0) not in every

    def l2(t):  # the rule's L2 norm, eps 1e-6 under the root (as FLA and transformers)
        t = t.double()
        return (t * ((t * t).sum(-1, keepdim=True) + 1e-6).rsqrt()).transpose(1, 2).float()

    for layer, ((query, key, value), out) in enumerate(zip(calls, outs, strict=True)):
        torch.testing.assert_close(cache["q", layer], l2(query), atol=2e-6, rtol=0)
        torch.testing.assert_close(cache["k", layer], l2(key), atol=2e-6, rtol=0)
        torch.testing.assert_close(cache["v", layer], value.transpose(1, 2), atol=2e-6, rtol=0)
        torch.testing.assert_close(cache["head_out", layer], out.view(2, 13, 6, 12),
                                   atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match=r"^capture: layer 0 is a 'gated_deltanet' layer, "
                                         r"which has no 'scores'"), \
            capture(model, ["scores"], layers=[0]):
        pass
    # ablating a DeltaNet head is transformers' forward with that head's output zeroed
    def zero_head(m, args):
        x = args[0].clone()
        x[..., 12:24] = 0.0
        return (x,)

    hook = hf.model.layers[1].linear_attn.out_proj.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        hook.remove()
    torch.testing.assert_close(ablated_logits(model, ids, [(1, 1)]), want, atol=2e-5, rtol=0)
    # the catalogue scores the full-attention layer only
    assert {row["layer"] for row in head_scores(model, ids, repeat=6)} == {3}
    # a generation (the state carried one token at a time) is recorded step by step
    names = ["q", "k", "v", "head_out"]
    with torch.no_grad(), capture(model, names, layers=[0, 2]) as steps:
        seq = generate(model, ids[:1, :5], 4, native=False)
    with torch.no_grad(), capture(model, names, layers=[0, 2]) as whole:
        model(seq[:, :-1])
    assert len(steps.steps("q", 2)) == 4
    for name in names:
        torch.testing.assert_close(steps[name, 2], whole[name, 2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_bahdanau_attention_is_captured_as_one_head_of_each_decoder_step(backend):
    from qkv.functional import lengths_to_mask
    from qkv.heads import layer_names
    from qkv.models.build import build_model
    from qkv.models.seq2seq import Seq2SeqConfig
    cfg = Seq2SeqConfig(model="bahdanau", src_vocab_size=20, tgt_vocab_size=20,
                        embed_size=8, num_hiddens=16, num_layers=2, dropout=0.0,
                        backend=backend)
    torch.manual_seed(5)
    model = build_model(cfg).eval()
    assert layer_names(model) == ["decoder.attention"]
    src, tgt = torch.randint(3, 20, (2, 6)), torch.randint(3, 20, (2, 4))
    lens = torch.tensor([6, 3])
    with torch.no_grad():
        plain = model(src, lens, tgt)
        with capture(model) as cache:
            assert torch.equal(model(src, lens, tgt), plain)  # bit for bit
    weights = cache["weights", 0]
    assert weights.shape == (2, 1, 4, 6)
    # the book's own record of the last forward's weights
    torch.testing.assert_close(weights[:, 0], model.decoder.attention_weights, atol=1e-6,
                               rtol=0)
    assert torch.all(weights[1, :, :, 3:] == 0)
    assert torch.all(torch.isinf(cache["scores", 0][1, :, :, 3:]))
    # step 2 of sentence 0 by hand in float64: w_v . tanh(W_q q + W_k k_j), softmax
    att = model.decoder.attention
    q = cache["q", 0][0, 0, 2].double()
    enc, _ = model.encoder(src, lens)
    keys = enc.transpose(0, 1)[0].double()
    scores = torch.tanh(q @ att.W_q.weight.double().T + keys @ att.W_k.weight.double().T) \
        @ att.w_v.weight.double()[0]
    torch.testing.assert_close(cache["scores", 0][0, 0, 2].double(), scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(weights[0, 0, 2].double(), torch.softmax(scores, -1),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["head_out", 0][0, 2, 0].double(),
                               torch.softmax(scores, -1) @ keys, atol=1e-6, rtol=0)
    # one step at a time (decode_step, as translation runs): the same rows
    with torch.no_grad(), capture(model, ["q", "scores", "weights", "head_out"]) as steps:
        state = model.encode(src, lens)
        for t in range(tgt.shape[1]):
            model.decode_step(tgt[:, t], state)
    assert len(steps.steps("weights", 0)) == 4
    for name in ("q", "weights", "head_out"):
        torch.testing.assert_close(steps[name, 0], cache[name, 0], atol=1e-6, rtol=0)
    keep = lengths_to_mask(lens, 6)[:, None].expand(2, 1, 4, 6)
    torch.testing.assert_close(steps["scores", 0][keep], cache["scores", 0][keep])
    with pytest.raises(ValueError, match=r"^intervene: 'head_out' is computed beside"), \
            intervene(model, {("head_out", 0): lambda x: x}):
        pass


def test_the_transformer_translator_is_captured_as_its_attention_maps_and_step_by_step():
    from qkv.models.build import build_model
    from qkv.models.seq2seq import Seq2SeqConfig
    cfg = Seq2SeqConfig(model="transformer", src_vocab_size=20, tgt_vocab_size=20,
                        embed_size=16, num_hiddens=16, num_heads=2, num_layers=2, dropout=0.0,
                        ffn_num_hiddens=32)
    torch.manual_seed(6)
    model = build_model(cfg).eval()
    src, tgt = torch.randint(3, 20, (2, 5)), torch.randint(3, 20, (2, 4))
    lens = torch.tensor([5, 3])
    with torch.no_grad():
        plain = model(src, lens, tgt)
        with capture(model, POINTS) as cache:
            assert torch.equal(model(src, lens, tgt), plain)
        maps = model.attention_maps(src, lens, tgt)  # the model's own weights
    # layers: encoder 0, 1; then each decoder block's self- and cross-attention
    order = [maps["encoder"][0], maps["encoder"][1], maps["decoder"][0], maps["cross"][0],
             maps["decoder"][1], maps["cross"][1]]
    for layer, want in enumerate(order):
        torch.testing.assert_close(cache["weights", layer], want, atol=1e-6, rtol=0)
    # translation's path: the encoder once, then one token at a time through the caches
    with torch.no_grad(), capture(model, POINTS, layers=[2, 3, 4, 5]) as steps:
        state = model.encode(src, lens)
        for t in range(tgt.shape[1]):
            model.decode_step(tgt[:, t], state)
    for layer in (2, 3, 4, 5):
        assert len(steps.steps("weights", layer)) == 4
        for name in ("q", "weights", "head_out"):
            torch.testing.assert_close(steps[name, layer], cache[name, layer], atol=1e-5,
                                       rtol=0, msg=f"{name} of layer {layer}")
