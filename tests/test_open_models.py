"""Today's open models in qkv's one decoder, against ``transformers`` itself.

Each family (Llama/SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3, and Llama with each RoPE
scaling) is a tiny random model built with transformers' own classes and saved as a
Hugging Face folder beside a small byte-level tokenizer; ``qkv lm import`` makes a run
of it. The run's logits must match transformers' within 1e-4 (float32), its greedy
tokens equal transformers' ``generate`` token for token, with and without the KV cache,
the Gemma model's well past its sliding window. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from qkv.cli import main
from qkv.models.gpt import GPTConfig, GPTModel, generate
from qkv.tasks.lm import LanguageModel

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320  # the model's rows; the tokenizer has fewer ids, as Qwen's does
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3,
          "Attention is all you need; queries, keys and values. " * 3,
          "Paris is the capital of France, Berlin of Germany. " * 3]

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
DEEPSEEK = dict(
    **{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=24,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_group=2,
    topk_group=1, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
    n_shared_experts=1, pad_token_id=0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10_000.0,
                     "original_max_position_embeddings": 64, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
# Qwen3.5 and Qwen3-Next: Gated DeltaNet layers (two key heads, each serving three value
# heads) and gated full-attention layers turning a quarter of each head (8 of 32)
HYBRID = dict(**{**COMMON, "num_hidden_layers": 4}, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
              pad_token_id=0)
HYBRIDS = ("qwen3_5_text", "qwen3_next")
# Gemma 4's text model with everything its config can switch on: sliding layers of 16-wide
# heads and full ones of 32-wide heads with one key/value head whose values are its keys
# (attention_k_eq_v) and a quarter of each head turning; the last two layers sharing the
# keys and values of the last earlier layer of their kind, with twice wider MLPs; per-layer
# inputs; experts beside every dense MLP; soft-capped logits
GEMMA4 = dict(
    **{**COMMON, "num_hidden_layers": 5, "intermediate_size": 48}, head_dim=16,
    global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6,
    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention"],
    num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB, enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=16, final_logit_softcapping=30.0, pad_token_id=0)
# Families whose matrices are scaled up so that their greedy tokens vary (see hf_model).
SCALED = (*HYBRIDS, "gemma4_text")
# Families whose cached and uncached greedy tokens differ in transformers itself.
TOP_K_TIES = {"deepseek_v32"}
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied-bias": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "llama3-scaling": lambda: transformers.LlamaConfig(**COMMON, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear-scaling": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
    # YaRN as Qwen3's long-context configs set it: cos and sin scaled by about 1.139
    "qwen3-yarn": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # NoPE: layer 1 has no positions at all
    "smollm3": lambda: transformers.SmolLM3Config(**COMMON, no_rope_layers=[1, 0, 1],
                                                  pad_token_id=0, bos_token_id=0,
                                                  attention_bias=True),
    # OLMo 3: norms after each sub-layer only, the QK-norm over all heads at once,
    # two sliding layers then a full one; YaRN on the full one
    "olmo3": lambda: transformers.Olmo3Config(
        **COMMON, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0,
                                            "original_max_position_embeddings": 128,
                                            "rope_theta": 500_000.0},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": 500_000.0}}),
    # gpt-oss: a learned sink per head, sliding and full layers alternating, experts with
    # biases and clamped SwiGLU in every layer, YaRN without truncation
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150_000.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False}),
    # DeepSeek-V3: latent attention (query low-rank, interleaved RoPE, YaRN's mscale on the
    # softmax), a dense first layer, then experts routed by group with a shared expert
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**DEEPSEEK),
    # DeepSeek-V3.2: the same with sparse attention, each query's 8 best keys
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **DEEPSEEK, index_n_heads=2, index_head_dim=16, index_topk=8),
    # Qwen3.5: three DeltaNet layers, then a full one (full_attention_interval 4); tied
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**HYBRID, tie_word_embeddings=True),
    # Qwen3-Next: its own schedule, experts with a gated shared expert but in layer 2
    # (mlp_only_layers), its projections fused in the folder
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **HYBRID, layer_types=["linear_attention", "full_attention", "linear_attention",
                               "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32, mlp_only_layers=[2]),
    "gemma4_text": lambda: transformers.Gemma4TextConfig(**GEMMA4),
}


def byte_level_tokenizer():
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB
    return tok


def hf_model(family: str, seed: int = 0):
    """A random model of ``family``, its norms moved off their initial values (so that a
    norm applied as ``w`` instead of ``1 + w`` could not pass); the hybrids' matrices
    (all but the embedding) scaled up 4 times, so that their greedy tokens vary (at
    transformers' initial scale, the tied Qwen3.5 repeats one token), and Gemma 4's."""
    return perturbed_model(FAMILIES[family](), seed, scaled=family in SCALED)


def perturbed_model(config, seed: int = 0, scaled: bool = True):
    """A transformers model of ``config`` (eos id 2) with its norms and biases moved off
    their initial values and, with ``scaled``, its matrices but the embedding scaled up 4
    times."""
    config.eos_token_id = 2  # <|im_end|>
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            # (DeepSeek's e_score_correction_bias is a buffer, zero as initialised)
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif scaled and p.dim() >= 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, tuple]:
    """family -> (transformers model, its folder, the run qkv lm import made of it)."""
    tok = byte_level_tokenizer()
    out = {}
    for i, family in enumerate(FAMILIES):
        root = tmp_path_factory.mktemp(family)
        model = hf_model(family, seed=i)
        folder = root / "hf"
        model.save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))
        run = root / "run"
        assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 0
        out[family] = (model, folder, run)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(imported, family):
    hf, _, run = imported[family]
    lm = LanguageModel.load(run)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), hf(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers_cached_or_not(imported, family):
    hf, _, run = imported[family]
    model = LanguageModel.load(run).model
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    for use_cache in (True, False):
        # DeepSeek-V3.2's indexer scores many keys exactly 0 (a ReLU-weighted sum over two
        # index heads), and top-k breaks those ties by position differently over a whole
        # sequence than over one new row: transformers' own cached and uncached greedy
        # tokens differ there. Each of qkv's paths is held to transformers' same path: its
        # module path, whose top-k is PyTorch's as transformers' is (the C step keeps the
        # earliest of tied positions, a choice PyTorch's topk does not promise).
        ties = family in TOP_K_TIES
        hf_cache = use_cache if ties else True
        want = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                           pad_token_id=0, attention_mask=torch.ones_like(prompt),
                           use_cache=hf_cache)
        got = generate(model, prompt, 20, use_cache=use_cache, native=False if ties else None)
        assert got.tolist() == want.tolist()


def test_gemma_sliding_layers_past_their_window(imported):
    """40 tokens through a 6-token window: the ring caches of the sliding layers and the
    full cache of the global one give the tokens of the uncached forward and of
    transformers."""
    hf, _, run = imported["gemma3"]
    model = LanguageModel.load(run).model
    windows = [block.att.window_size for block in model.trf_blocks]
    assert windows == [6, 6, None]
    bases = [block.att.rope_base for block in model.trf_blocks]
    assert bases == [10_000.0, 10_000.0, 1_000_000.0]
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    want = hf.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones_like(prompt))
    cached = generate(model, prompt, 40, use_cache=True)
    assert cached.tolist() == want.tolist()
    assert generate(model, prompt, 40, use_cache=False).tolist() == want.tolist()


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrids_over_several_chunks_and_exactly_one(imported, family):
    """The DeltaNet layers run their chunked form 64 tokens at a time: prompts of exactly
    one chunk and of three and a bit give transformers' logits, and a 150-token prompt
    continued greedily (its state carried over from the chunked prompt, one token at a
    time) transformers' tokens, with the cache and without."""
    hf, _, run = imported[family]
    model = LanguageModel.load(run).model
    chunks = {block.att.chunk_size for block in model.trf_blocks
              if block.spec.attention == "gated_deltanet"}
    assert chunks == {64}
    rng = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tokens in (64, 200):
            ids = torch.randint(0, VOCAB, (1, tokens), generator=rng)
            torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    prompt = torch.randint(0, VOCAB, (1, 150), generator=rng)
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones_like(prompt))
    for use_cache in (True, False):
        assert generate(model, prompt, 20, use_cache=use_cache).tolist() == want.tolist()


def test_a_qwen3_5_folder_imports_its_text_model(tmp_path):
    """A multimodal Qwen3.5 folder, as Qwen3_5ForConditionalGeneration saves it: the text
    model's config under text_config, its weights under model.language_model., a vision
    tower and (as published folders hold) multi-token-prediction layers beside. The text
    model imports and gives the multimodal model's logits on text; the rest is not read."""
    from safetensors.torch import load_file, save_file

    text = {**FAMILIES["qwen3_5_text"]().to_dict(), "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                "mrope_section": [2, 1, 1]}}
    config = transformers.Qwen3_5Config(
        text_config=text, tie_word_embeddings=False,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, patch_size=4, num_position_embeddings=16))
    torch.manual_seed(7)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2 and "language_model" in name and "embed" not in name:
                p.mul_(4.0)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in weights)
    weights["mtp.fc.weight"] = torch.randn(64, 128)
    weights["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    run = tmp_path / "run"
    assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 0
    lm = LanguageModel.load(run)
    ids = torch.randint(0, VOCAB, (1, 70), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids), hf(input_ids=ids).logits, atol=1e-4, rtol=0)
    assert lm.model.cfg.num_parameters() == sum(
        p.numel() for name, p in hf.named_parameters() if not name.startswith("model.visual."))


def test_a_gemma4_folder_imports_its_text_model(imported, tmp_path):
    """A multimodal Gemma 4 folder, as Gemma4ForConditionalGeneration saves it (the text
    model under text_config and model.language_model., a vision tower beside, the head
    tied at the top level): the text model imports with the text model's logits."""
    text_model, _, _ = imported["gemma4_text"]
    config = transformers.Gemma4Config(
        text_config=text_model.config.to_dict(), audio_config=None,
        vision_config=transformers.Gemma4VisionConfig(
            hidden_size=16, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8))
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    hf.model.language_model.load_state_dict(text_model.model.state_dict())
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    run = tmp_path / "run"
    assert main(["lm", "import", str(folder), "--run-dir", str(run)]) == 0
    lm = LanguageModel.load(run)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(want, text_model(ids).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(lm.model(ids), want, atol=1e-4, rtol=0)


def test_gemma4_configs_qkv_cannot_build_are_one_line(imported, tmp_path, capsys):
    """What a Gemma 4 config can say that qkv does not compute is refused before a weight
    is read, in one line naming the value; the C decoder runs the rest."""
    from qkv.models.gpt import native_unsupported

    _, folder, run_dir = imported["gemma4_text"]
    run = str(tmp_path / "run")
    cases = [
        ({"use_bidirectional_attention": "all"}, r"use_bidirectional_attention='all'"),
        ({"hidden_activation": "silu"}, r"hidden_activation='silu'.*gelu_pytorch_tanh"),
        ({"num_kv_shared_layers": 4}, r"layer 1 \(full_attention\) shares.*first 1 layers"),
        ({"per_layer_config": {"1": {"head_dim": 32, "sliding_window": 3}}},
         r"per_layer_config must map"),
        ({"rope_parameters": {"full_attention": {"rope_type": "proportional",
                                                 "rope_theta": 1e6,
                                                 "partial_rotary_factor": 1.5},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": 1e4}}},
         r"partial_rotary_factor must be in \(0, 1\]"),
    ]
    for i, (change, pattern) in enumerate(cases):
        edited = edit_config(folder, tmp_path / str(i), **change)
        one_line_error(capsys, ["lm", "import", str(edited), "--run-dir", run], pattern)
    assert not (tmp_path / "run").exists()
    assert native_unsupported(LanguageModel.load(run_dir).model) is None


def test_hybrid_configs_qkv_cannot_build_are_one_line(imported, tmp_path, capsys):
    """What the hybrids' configs can say that qkv does not compute is refused before a
    weight is read, in one line naming the value."""
    _, folder, _ = imported["qwen3_next"]
    run = str(tmp_path / "run")
    cases = [
        # 32 * 0.1 = 3.2: transformers would turn 3 dimensions, an odd number
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                              "partial_rotary_factor": 0.1}}, r"partial_rotary_factor=0.1"),
        ({"hidden_act": "gelu_pytorch_tanh"}, r"hidden_act='gelu_pytorch_tanh'.*silu"),
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention",
                          "full_attention"]}, r"layer_types must list 4 of"),
        ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\).*multiple"),
        ({"mlp_only_layers": "all"}, r"mlp_only_layers must list"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\).*num_experts \(4\)"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
    ]
    for n, (change, pattern) in enumerate(cases):
        one_line_error(capsys, ["lm", "import", str(edit_config(folder, tmp_path / str(n),
                                                                 **change)),
                                "--run-dir", run], pattern)
    # the other families still turn every dimension
    _, llama, _ = imported["llama"]
    one_line_error(capsys, ["lm", "import", str(edit_config(llama, tmp_path / "llama",
                                                             partial_rotary_factor=0.5)),
                            "--run-dir", run], r"partial_rotary_factor=0.5 is not supported")
    # a multimodal folder whose two configs disagree on tying the head
    _, qwen35, _ = imported["qwen3_5_text"]
    nested = json.loads((qwen35 / "config.json").read_text())
    one_line_error(capsys, ["lm", "import", str(edit_config(
        qwen35, tmp_path / "mm", model_type="qwen3_5", tie_word_embeddings=False,
        text_config=nested)), "--run-dir", run], r"text_config.tie_word_embeddings is True")
    assert not (tmp_path / "run").exists()


def test_qwen3_next_fused_projections_round_trip(imported):
    """Qwen3-Next's in_proj_qkvz and in_proj_ba are split on import and fused back on
    export: from_qkv gives the folder's tensors themselves."""
    from safetensors.torch import load_file

    from qkv.models.hf_open import expected_tensors, from_qkv

    _, folder, run = imported["qwen3_next"]
    lm = LanguageModel.load(run)
    fields = lm.model.cfg.to_dict()
    back = from_qkv(lm.model.state_dict(), fields, "qwen3_next")
    stored = load_file(folder / "model.safetensors")
    assert set(back) == set(stored) == {name for name, _ in
                                        expected_tensors(fields, "qwen3_next")}
    assert all(torch.equal(back[k], stored[k]) for k in stored)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in back


@pytest.mark.parametrize("family", list(FAMILIES))
def test_architecture_facts_come_from_the_model(imported, family):
    hf, _, run = imported[family]
    cfg = LanguageModel.load(run).model.cfg
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    built = GPTModel(cfg)
    assert list(cfg.parameter_shapes()) == [(k, tuple(v.shape))
                                           for k, v in built.state_dict().items()]
    # the KV cache holds each layer's key/value heads, a sliding layer only its window;
    # latent attention its latent and RoPE key, sparse attention the index key beside; a
    # DeltaNet layer the same bytes at any length: the convolution's last K - 1 inputs
    # (q, k and v) and a head_k_dim x head_v_dim state per value head
    c = hf.config
    if family == "gemma4_text":  # each layer's own heads; the sharing layers cache nothing
        own = [layer.self_attn for layer in hf.model.layers
               if not layer.self_attn.is_kv_shared_layer]
        for tokens in (100, 200):
            want = sum(2 * att.k_proj.out_features * 4 * (
                tokens if att.sliding_window is None else min(tokens, att.sliding_window))
                for att in own)
            assert cfg.kv_cache_bytes(1, tokens) == want
        return
    if family.startswith("deepseek"):
        kv = c.kv_lora_rank + c.qk_rope_head_dim + getattr(c, "index_head_dim", 0)
    else:
        kv = 2 * c.num_key_value_heads * cfg.attention_head_dim
    linear = c.layer_types.count("linear_attention") if family in HYBRIDS else 0
    per_token = [kv * 4] * (cfg.n_layers - linear)
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers - linear)]
    for tokens in (100, 200):
        want = sum(p * (tokens if w is None else min(tokens, w))
                   for p, w in zip(per_token, windows, strict=True))
        if linear:
            conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + \
                c.linear_num_value_heads * c.linear_value_head_dim
            state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            want += linear * 4 * (conv * (c.linear_conv_kernel_dim - 1) + state)
        assert cfg.kv_cache_bytes(1, tokens) == want


def test_the_run_keeps_the_tokenizer_and_pads_to_the_model(imported):
    _, folder, run = imported["qwen2"]
    lm = LanguageModel.load(run)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    text = "The quick brown fox <|im_end|> ünïcode"
    assert lm.tokenizer.encode(text) == reference.encode(text)
    assert lm.tokenizer.n_vocab == VOCAB  # the model's rows, past the tokenizer's last id
    assert lm.tokenizer.eos_token_ids == [reference.convert_tokens_to_ids("<|im_end|>")]


def test_bfloat16_import_stores_and_runs_bfloat16(imported, tmp_path):
    hf, folder, _ = imported["qwen3"]
    run = tmp_path / "bf16"
    assert main(["lm", "import", str(folder), "--run-dir", str(run), "--dtype",
                 "bfloat16"]) == 0
    model = LanguageModel.load(run).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf.to(torch.bfloat16)(ids).logits.float()
        hf.float()
        got = model(ids).float()
    # both round the same weights to bfloat16; their sums round differently
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_fine_tuning_an_imported_model(imported, tmp_path):
    _, _, run = imported["llama"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS) * 20, encoding="utf-8")
    tuned = tmp_path / "tuned"
    assert main(["lm", "train", "--init", str(run), "--run-dir", str(tuned), "--text",
                 str(text), "--epochs", "1", "--context-length", "32", "--batch-size", "4",
                 "--dtype", "bfloat16", "--no-progress", "--sample", ""]) == 0
    lm = LanguageModel.load(tuned)
    assert lm.settings.window(lm.model.cfg) == 32
    assert lm.model.cfg.context_length == 256  # the model's own, unchanged
    before = LanguageModel.load(run).model.state_dict()
    after = lm.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_attention_heatmap_of_an_imported_model(imported, tmp_path):
    _, _, run = imported["gemma3"]
    out = tmp_path / "att.png"
    assert main(["lm", "attention", "--ckpt", str(run), "--prompt", "The quick brown fox",
                 "--heatmap", str(out), "--layers", "2"]) == 0
    assert out.stat().st_size > 1000


def test_a_hybrid_heatmap_has_a_row_per_layer_and_centres_the_delta_rule(imported, tmp_path,
                                                                         monkeypatch):
    """lm attention on Qwen3-Next: layer 0 (DeltaNet, 6 value heads) fills a row, layer 1
    (softmax, 4 heads) the next with two slots empty; the delta rule's panels (weights of
    either sign) on a scale symmetric about 0, the softmax ones from 0."""
    import qkv.utils.figures as figures

    drawn = {}
    real = figures.plot_attention_grid

    def keep(matrices, **kwargs):
        drawn["fig"] = real(matrices, **{**kwargs, "path": None})
        return real(matrices, **kwargs)

    monkeypatch.setattr(figures, "plot_attention_grid", keep)
    lm = LanguageModel.load(imported["qwen3_next"][2])
    lm.heatmap("The quick brown", tmp_path / "att.png", layers=[0, 1])
    images = [(ax, ax.images[0]) for ax in drawn["fig"].axes if ax.images]
    assert len(images) == 10
    rows = sorted({round(ax.get_position().y0, 3) for ax, _ in images}, reverse=True)
    per_row = [[im for ax, im in images if round(ax.get_position().y0, 3) == y] for y in rows]
    assert [len(r) for r in per_row] == [6, 4]
    for image in per_row[0]:
        assert image.norm.vmin == -image.norm.vmax and image.get_cmap().name == "RdBu_r"
    assert any(float(image.get_array().min()) < 0 for image in per_row[0])
    for image in per_row[1]:
        assert image.norm.vmin == 0.0 and image.get_cmap().name == "Reds"


# The commands are the same code for every family: three families that between them have
# every attention kind (latent and sparse, Gated DeltaNet and gated, shared KV) run them in
# the default suite, the others with QKV_SLOW=1 (the suite's time budget).
EVERY_COMMAND_ALWAYS = ("deepseek_v32", "qwen3_5_text", "gemma4_text")


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v32", "olmo3", *HYBRIDS,
                                    "gemma4_text"])
def test_new_families_run_every_command(imported, family, tmp_path, capsys):
    if family not in EVERY_COMMAND_ALWAYS and os.environ.get("QKV_SLOW") != "1":
        pytest.skip("set QKV_SLOW=1 to run every command on this family too")
    """What works on a run works on these: lm generate (--chat), lm attention, qkv view
    (saying what sparse attention's, sinks' and the delta rule's weights are), lm train
    --init."""
    _, _, run = imported[family]
    assert main(["lm", "generate", "--ckpt", str(run), "--prompt", "The quick",
                 "--max-new-tokens", "4"]) == 0
    assert main(["lm", "generate", "--ckpt", str(run), "--chat", "--prompt", "hi",
                 "--max-new-tokens", "4"]) == 0
    out = tmp_path / "att.png"
    # (a hybrid's first two layers: a DeltaNet layer of 6 value heads, a softmax one of 4)
    # (Gemma 4's: a full layer and the one sharing its keys and values)
    layers = ["--layers", "0", "1"] if family in HYBRIDS else \
        ["--layers", "1", "4"] if family == "gemma4_text" else []
    assert main(["lm", "attention", "--ckpt", str(run), "--prompt", "The quick brown fox",
                 "--heatmap", str(out), *layers]) == 0
    assert out.stat().st_size > 1000
    page = tmp_path / "view.html"
    assert main(["view", "--ckpt", str(run), "--text", "The quick brown fox jumps over "
                 "the lazy dog", "--generate", "3", "--html", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    note = {"gpt_oss": "learned sinks", "deepseek_v32": "lightning indexer selected",
            "olmo3": None, "qwen3_5_text": "effective token-to-token weights",
            "qwen3_next": "effective token-to-token weights",
            "gemma4_text": "shared keys and values"}[family]
    assert note is None or note in html
    # qkv heads: the catalogue of every layer with softmax weights; DeltaNet layers skipped
    capsys.readouterr()
    assert main(["heads", "--ckpt", str(run), "--length", "5", "--batch", "2",
                 "--json", str(tmp_path / "heads.json")]) == 0
    skipped = capsys.readouterr().out
    scored = {row["layer"] for row in json.loads((tmp_path / "heads.json").read_text())}
    deltanet = {i for i, block in enumerate(LanguageModel.load(run).model.trf_blocks)
                if block.spec.attention == "gated_deltanet"}
    assert scored and not scored & deltanet
    assert (f"layers {', '.join(map(str, sorted(deltanet)))} skipped" in skipped) == \
        bool(deltanet)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS) * 5, encoding="utf-8")
    tuned = tmp_path / "tuned"
    assert main(["lm", "train", "--init", str(run), "--run-dir", str(tuned), "--text",
                 str(text), "--epochs", "1", "--context-length", "16", "--batch-size", "8",
                 "--no-progress", "--sample", ""]) == 0
    before = LanguageModel.load(run).model.state_dict()
    after = LanguageModel.load(tuned).model.state_dict()
    assert set(before) == set(after) and any(not torch.equal(before[k], after[k])
                                             for k in before)
    capsys.readouterr()


def one_line_error(capsys, argv, pattern):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert pytest.importorskip("re").search(pattern, err), err


def edit_config(folder: Path, tmp_path: Path, **changes) -> Path:
    import shutil
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_bad_folders_are_one_line(imported, tmp_path, capsys):
    _, folder, _ = imported["llama"]
    run = str(tmp_path / "run")
    one_line_error(capsys, ["lm", "import", str(edit_config(folder, tmp_path / "a",
                                                             model_type="falcon")),
                            "--run-dir", run], r"falcon.*llama")
    one_line_error(capsys, ["lm", "import", str(edit_config(
        folder, tmp_path / "b", rope_scaling={"rope_type": "longrope", "factor": 4.0})),
        "--run-dir", run], r"longrope")
    # the config says wider layers than the weights hold: refused from the header
    one_line_error(capsys, ["lm", "import", str(edit_config(folder, tmp_path / "c",
                                                             intermediate_size=4096)),
                            "--run-dir", run], r"mlp|96|4096")
    one_line_error(capsys, ["lm", "import", str(tmp_path / "missing"), "--run-dir", run],
                   r"no such file or folder")
    assert not (tmp_path / "run").exists()


def test_config_round_trips_and_gpt2_configs_are_unchanged():
    gpt2 = GPTConfig.preset("tiny", vocab_size=257)
    assert set(gpt2.to_dict()) == {"vocab_size", "context_length", "emb_dim", "n_heads",
                                   "n_layers", "drop_rate", "qkv_bias", "tie_weights",
                                   "n_kv_groups", "window_size", "rope", "rope_base"}
    gemma = GPTConfig(vocab_size=50, context_length=64, emb_dim=32, n_heads=2, n_layers=2,
                      head_dim=24, norm="gemma_rmsnorm", mlp="geglu", qk_norm=True,
                      post_norms=True, rope=True, window_size=4,
                      layer_types=["sliding", "full"], rope_local_base=10_000.0,
                      rope_base=1e6, embed_scale=True, query_scale=0.2)
    assert GPTConfig.from_dict(json.loads(json.dumps(gemma.to_dict()))) == gemma
    with pytest.raises(ValueError, match="layer_types"):
        GPTConfig(n_layers=2, layer_types=["sliding"], window_size=4)
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        GPTConfig(rope=True, rope_scaling={"rope_type": "longrope", "factor": 2.0})
