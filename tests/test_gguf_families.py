"""The GGUF forms of SmolLM3, OLMo 3, gpt-oss, DeepSeek-V3 and V3.2 and Gemma 4, against
transformers.

Each family's tiny model (the configurations of ``tests/test_open_models.py``) is built
with transformers' own classes and written as llama.cpp's converter
(``convert_hf_to_gguf.py``) writes it, by a small converter here: the gguf package's
tensor names and metadata writers; ``smollm3`` q/k rows permuted for llama.cpp's RoPE;
``olmo2`` (llama.cpp's architecture for OLMo 3) with its per-layer sliding pattern;
``gpt-oss`` with the sinks as ``attn_sinks``, the interleaved gate/up experts split into
3-D ``ffn_gate_exps``/``ffn_up_exps`` stored MXFP4 (as published files are), the down
experts transposed; ``deepseek2`` with the latent up-projection split into ``attn_k_b``
(transposed) and ``attn_v_b``, the per-expert tensors stacked, the score correction as
``exp_probs_b``, YaRN's ``mscale_all_dim`` as ``0.1 *`` it; ``deepseek32`` (DeepSeek-V3.2,
an architecture the gguf package does not name) as ``deepseek2`` plus the lightning
indexer's sizes (``attention.indexer.*``) and tensors (``indexer.attn_q_b``, ``attn_k``,
``k_norm``, ``proj``) as they are; ``gemma4`` with its norms
as they are, per-layer key/value heads and MLP widths, the full layers' proportional
RoPE as a ``rope_freqs`` tensor (1 per turning pair, 1e30 for the rest), the router's
scales as ``ffn_gate_inp.scale`` and ``ffn_down_exps.scale``, the layer scalar as
``layer_output_scale``.

``qkv lm import`` of each file must give logits within 1e-4 of the transformers model
and its 20 greedy tokens, cached and not, past every window; the state dict read back
must equal the model's own (gpt-oss's experts: ``gguf.quants.dequantize`` of the MXFP4
blocks, which the transformers model is given too). transformers' own GGUF reader
checks the gpt-oss file independently (it reads no other of these architectures).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import family_files, no_reads, one_line, refused, write_gguf  # noqa: E402, F401 (no_reads: a fixture)
from qkv.cli import main  # noqa: E402
from qkv.models import gguf_model  # noqa: E402
from qkv.models.gguf_model import gguf_config, read_gguf_model  # noqa: E402
from qkv.models.gguf_weights import read_gguf_header  # noqa: E402
from qkv.models.gpt import GPTConfig, generate  # noqa: E402
from qkv.models.hf_open import config_fields  # noqa: E402
from qkv.tasks.lm import LanguageModel  # noqa: E402
from test_open_models import COMMON, DEEPSEEK, FAMILIES, VOCAB  # noqa: E402
from test_open_models import hf_model as open_model  # noqa: E402

ARCHES = {"smollm3": gguf.MODEL_ARCH.SMOLLM3, "olmo3": gguf.MODEL_ARCH.OLMO2,
          "gpt_oss": gguf.MODEL_ARCH.GPT_OSS, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
          "gemma4_text": gguf.MODEL_ARCH.GEMMA4,
          # gguf 0.19 names no deepseek32: DEEPSEEK2's names, the indexer's below
          "deepseek_v32": gguf.MODEL_ARCH.DEEPSEEK2}
# The files' general.architecture.
ARCH_NAMES = {**{f: gguf.MODEL_ARCH_NAMES[a] for f, a in ARCHES.items()},
              "deepseek_v32": "deepseek32"}
# DeepSeek-V3.2's indexer: transformers' name -> llama.cpp's (gguf's TENSOR_NAMES).
INDEXER = {"wq_b": gguf.MODEL_TENSOR.INDEXER_ATTN_Q_B, "wk": gguf.MODEL_TENSOR.INDEXER_ATTN_K,
           "k_norm": gguf.MODEL_TENSOR.INDEXER_K_NORM,
           "weights_proj": gguf.MODEL_TENSOR.INDEXER_PROJ}
DEEPSEEKS = ("deepseek_v3", "deepseek_v32")
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def gpt_oss_as_llama_cpp_runs_it():
    """test_open_models' gpt-oss, but with YaRN's correction range rounded out to whole
    dimensions (truncate), as llama.cpp computes it for every model: a GGUF file cannot
    say otherwise (its metadata has no such key)."""
    config = FAMILIES["gpt_oss"]()
    config.rope_parameters = {**config.rope_parameters, "truncate": True}
    return config


CONFIGS = {
    # llama.cpp skips RoPE in every 4th layer whatever the file: SmolLM3's own default
    "smollm3": lambda: transformers.SmolLM3Config(
        **{**COMMON, "num_hidden_layers": 4}, pad_token_id=0, bos_token_id=0,
        attention_bias=True, mlp_bias=True),
    "olmo3": FAMILIES["olmo3"],
    "gpt_oss": gpt_oss_as_llama_cpp_runs_it,
    "deepseek_v3": FAMILIES["deepseek_v3"],
    # each query's 8 best keys of up to 40: the selection matters. Index heads 64 wide:
    # llama.cpp rotates them by a Hadamard matrix, which it makes 64, 128, ... wide only.
    # 16 of them: a key scores exactly 0 only when all 16 ReLUs are 0, so no ties at the
    # selection's edge, which ggml's top-k and PyTorch's break differently (test_open_models'
    # 2 heads tie: TOP_K_TIES)
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **DEEPSEEK, index_n_heads=16, index_head_dim=64, index_topk=8),
    "gemma4_text": FAMILIES["gemma4_text"],
}


def hf_model(family: str, seed: int = 0):
    """A random transformers model of ``family``: matrices scaled up 8 times (standard
    deviation 0.16, logits of about 6) so that its greedy tokens vary, norms and biases
    moved off their initial values (as test_open_models does). Gemma 4's is
    test_open_models' own (its soft-capped logits saturate at 8 times)."""
    if family == "gemma4_text":
        return open_model(family, seed)
    config = CONFIGS[family]()
    config.eos_token_id = 2
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if p.dim() >= 2:
                p.mul_(8)
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows (LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert(model, family: str, mxfp4: bool = True, split_kv_b: bool = True):
    """The tensors and metadata llama.cpp's converter writes for ``model``: (llama.cpp
    name -> array or (MXFP4 blocks, type), writer method or key -> value). gpt-oss's
    MXFP4 experts are written into ``model`` too, dequantized, so that it computes
    what the file holds."""
    c, arch = model.config, ARCHES[family]
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    arrays = {}

    def put(name: str, tensor) -> None:
        arrays[name] = np.ascontiguousarray(tensor.numpy() if torch.is_tensor(tensor)
                                            else tensor)

    for hf_name, t in state.items():
        i = re.match(r"model\.layers\.(\d+)\.", hf_name)
        blk = f"blk.{i[1]}" if i else None
        if family == "smollm3" and re.search(r"\.(q|k)_proj\.", hf_name):
            heads = c.num_attention_heads if ".q_proj." in hf_name else c.num_key_value_heads
            t = torch.from_numpy(permute(t.numpy(), heads))
        if family == "gemma4_text" and hf_name.endswith(("router.scale", "per_expert_scale",
                                                         "layer_scalar", "experts.gate_up_proj")):
            kind = {"router.scale": "ffn_gate_inp.scale", "per_expert_scale":
                    "ffn_down_exps.scale", "layer_scalar": "layer_output_scale.weight",
                    "experts.gate_up_proj": "ffn_gate_up_exps.weight"}
            put(f"{blk}." + next(v for k, v in kind.items() if hf_name.endswith(k)), t)
        elif hf_name.endswith("self_attn.sinks"):  # the converter names it .weight
            put(f"{blk}.attn_sinks.weight", t)
        elif family == "gpt_oss" and hf_name.endswith("experts.gate_up_proj"):
            w = t.transpose(1, 2)  # (E, 2I, d), gate and up rows alternating
            put(f"{blk}.ffn_gate_exps.weight", w[:, 0::2])
            put(f"{blk}.ffn_up_exps.weight", w[:, 1::2])
        elif family == "gpt_oss" and hf_name.endswith("experts.gate_up_proj_bias"):
            put(f"{blk}.ffn_gate_exps.bias", t[:, 0::2])
            put(f"{blk}.ffn_up_exps.bias", t[:, 1::2])
        elif family == "gpt_oss" and hf_name.endswith("experts.down_proj"):
            put(f"{blk}.ffn_down_exps.weight", t.transpose(1, 2))  # (E, d, I)
        elif family == "gpt_oss" and hf_name.endswith("experts.down_proj_bias"):
            put(f"{blk}.ffn_down_exps.bias", t)
        elif hf_name.endswith("experts.gate_up_proj"):  # the folder's experts, stacked
            gate, up = t.chunk(2, dim=1)
            put(f"{blk}.ffn_gate_exps.weight", gate)
            put(f"{blk}.ffn_up_exps.weight", up)
        elif hf_name.endswith("experts.down_proj"):
            put(f"{blk}.ffn_down_exps.weight", t)
        elif hf_name.endswith("e_score_correction_bias"):
            put(f"{blk}.exp_probs_b.bias", t)
        elif ".indexer." in hf_name:  # self_attn.indexer.{wq_b,...}.{weight,bias}
            module, kind = hf_name.split(".")[-2:]
            put(f"{gguf.TENSOR_NAMES[INDEXER[module]].format(bid=i[1])}.{kind}", t)
        elif hf_name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = t.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            put(f"{blk}.attn_k_b.weight", k_b.transpose(1, 2))
            put(f"{blk}.attn_v_b.weight", v_b)
        else:
            put(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t)
    if family == "gpt_oss" and mxfp4:
        quantize_experts(model, arrays)

    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    meta = {"add_name": type(model).__name__.removesuffix("ForCausalLM"),
            "add_block_count": c.num_hidden_layers,
            "add_context_length": c.max_position_embeddings,
            "add_embedding_length": c.hidden_size,
            "add_feed_forward_length": c.intermediate_size,
            "add_head_count": c.num_attention_heads,
            "add_head_count_kv": (1 if family in DEEPSEEKS else  # Gemma 4's: per layer
                                  [layer.num_key_value_heads for layer in c.per_layer_config]
                                  if family == "gemma4_text" else c.num_key_value_heads),
            "add_rope_freq_base": rope["rope_theta"],
            "add_layer_norm_rms_eps": c.rms_norm_eps,
            "tokenizer.ggml.model": "gpt2", "add_eos_token_id": 2,
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]}
    if rope["rope_type"] == "yarn":
        meta.update(add_rope_scaling_type=gguf.RopeScalingType.YARN,
                    add_rope_scaling_factor=rope["factor"],
                    add_rope_scaling_orig_ctx_len=rope["original_max_position_embeddings"])
        for key, writer in (("beta_fast", "add_rope_scaling_yarn_beta_fast"),
                            ("beta_slow", "add_rope_scaling_yarn_beta_slow")):
            if key in rope:
                meta[writer] = float(rope[key])
    if family == "smollm3":  # LlamaModel's own keys
        meta.update(add_vocab_size=c.vocab_size,
                    add_rope_dimension_count=c.hidden_size // c.num_attention_heads)
    if family == "olmo3":
        meta.update(add_sliding_window=c.sliding_window,
                    add_sliding_window_pattern=[t == "sliding_attention"
                                                for t in c.layer_types],
                    add_rope_freq_base_swa=c.rope_parameters["sliding_attention"]["rope_theta"])
    if family == "gpt_oss":
        meta.update(add_key_length=c.head_dim, add_value_length=c.head_dim,
                    add_expert_count=c.num_local_experts,
                    add_expert_used_count=c.num_experts_per_tok,
                    add_sliding_window=c.sliding_window,
                    add_expert_feed_forward_length=c.intermediate_size)
    if family in DEEPSEEKS:
        rank, rope_dim = c.kv_lora_rank, c.qk_rope_head_dim
        meta.update(add_expert_used_count=c.num_experts_per_tok,
                    add_expert_group_count=c.n_group,
                    add_expert_group_used_count=c.topk_group,
                    # DeepSeek-V3's config.json says scoring_func "sigmoid"
                    add_expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID,
                    add_leading_dense_block_count=c.first_k_dense_replace,
                    add_vocab_size=c.vocab_size, add_q_lora_rank=c.q_lora_rank,
                    add_kv_lora_rank=rank, add_key_length=rank + rope_dim,
                    add_value_length=rank,
                    add_key_length_mla=c.qk_nope_head_dim + rope_dim,
                    add_value_length_mla=c.v_head_dim,
                    add_expert_feed_forward_length=c.moe_intermediate_size,
                    add_expert_count=c.n_routed_experts,
                    add_expert_shared_count=c.n_shared_experts,
                    add_expert_weights_scale=c.routed_scaling_factor,
                    add_expert_weights_norm=c.norm_topk_prob,
                    add_rope_dimension_count=rope_dim,
                    add_rope_scaling_yarn_log_mul=0.1 * rope["mscale_all_dim"])
        if not split_kv_b:  # files written before llama.cpp's MLA: no latent lengths
            for key in ("add_key_length_mla", "add_value_length_mla"):
                del meta[key]
            meta.update(add_head_count_kv=c.num_attention_heads,
                        add_key_length=c.qk_nope_head_dim + rope_dim,
                        add_value_length=c.v_head_dim)
    if family == "deepseek_v32":
        meta.update(add_indexer_head_count=c.index_n_heads,
                    add_indexer_key_length=c.index_head_dim, add_indexer_top_k=c.index_topk)
    if family == "gemma4_text":
        layer = c.per_layer_config  # each layer's resolved config
        full = layer[c.layer_types.index("full_attention")].head_dim
        turning = int(full * rope["partial_rotary_factor"] / 2)
        put("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (full // 2 - turning),
                                          dtype=np.float32))
        first_shared = c.num_hidden_layers - c.num_kv_shared_layers
        meta.update(
            add_feed_forward_length=[c.intermediate_size * (2 if i >= first_shared else 1)
                                     for i in range(c.num_hidden_layers)],
            add_key_length=full, add_value_length=full, add_key_length_swa=layer[0].head_dim,
            add_value_length_swa=layer[0].head_dim, add_rope_dimension_count=full,
            add_rope_dimension_count_swa=layer[0].head_dim,
            add_rope_freq_base_swa=c.rope_parameters["sliding_attention"]["rope_theta"],
            add_final_logit_softcapping=c.final_logit_softcapping,
            add_sliding_window=c.sliding_window, add_shared_kv_layers=c.num_kv_shared_layers,
            add_embedding_length_per_layer_input=c.hidden_size_per_layer_input,
            add_sliding_window_pattern=[t == "sliding_attention" for t in c.layer_types],
            add_expert_count=c.num_experts, add_expert_used_count=c.top_k_experts,
            add_expert_feed_forward_length=c.moe_intermediate_size)
    return arrays, meta


def quantize_experts(model, arrays: dict) -> None:
    """gpt-oss's expert weights as MXFP4 blocks in ``arrays``, and their dequantized
    values written back into ``model`` (its parameters in Hugging Face's layout)."""
    for i, layer in enumerate(model.model.layers):
        back = {}
        for kind in ("gate", "up", "down"):
            name = f"blk.{i}.ffn_{kind}_exps.weight"
            blocks = gguf.quants.quantize(arrays[name], MXFP4)
            arrays[name] = (blocks, MXFP4)
            back[kind] = torch.from_numpy(gguf.quants.dequantize(blocks, MXFP4))
        experts = layer.mlp.experts
        with torch.no_grad():
            experts.gate_up_proj[..., 0::2] = back["gate"].transpose(1, 2)
            experts.gate_up_proj[..., 1::2] = back["up"].transpose(1, 2)
            experts.down_proj.copy_(back["down"].transpose(1, 2))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple]:
    """family -> (transformers model, its GGUF file)."""
    return family_files(tmp_path_factory, CONFIGS, hf_model, convert, ARCH_NAMES)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_lm_import_runs_like_transformers(files, family, tmp_path, capsys):
    """``qkv lm import`` of the file: transformers' logits over 40 tokens (past every
    window) within 1e-4, and its 20 greedy tokens, with and without the KV cache; the
    import prints the file's mix of tensor types."""
    hf, path = files[family]
    run = tmp_path / "run"
    assert main(["lm", "import", str(path), "--run-dir", str(run)]) == 0
    types = read_gguf_header(path).tensors.values()
    mix = re.search(r"tensors in the file: (.*)\n", capsys.readouterr().out)[1]
    assert sum(int(n) for n in re.findall(r" x (\d+)", mix)) == len(types)
    if family == "gpt_oss":
        assert "MXFP4 x 9" in mix  # gate, up and down experts of three layers
    model = LanguageModel.load(run).model
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids), want, atol=1e-4, rtol=0)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    tokens = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert len(set(tokens[0, 11:].tolist())) > 1  # the tokens vary
    for use_cache in (True, False):
        assert generate(model, prompt, 20, use_cache=use_cache).tolist() == tokens.tolist()


def test_layers_as_llama_cpp_runs_them(files, tmp_path):
    """The runs' layers: SmolLM3's 4th without RoPE, OLMo 3's and gpt-oss's windows where
    the file says, DeepSeek's dense first layer and latent attention."""
    layers = {}
    for family in CONFIGS:
        config = gguf_config(read_gguf_header(files[family][1]))
        cfg = GPTConfig(**config_fields(config, family))
        layers[family] = [cfg.layer_spec(i) for i in range(cfg.n_layers)]
    assert [s.rope for s in layers["smollm3"]] == [True, True, True, False]
    assert [s.window for s in layers["olmo3"]] == [6, 6, None]
    assert [s.rope_scaling is None for s in layers["olmo3"]] == [True, True, False]
    assert [s.window for s in layers["gpt_oss"]] == [6, None, 6]
    assert [(s.attention, s.mlp) for s in layers["deepseek_v3"]] == [
        ("latent", "dense"), ("latent", "moe"), ("latent", "moe")]
    assert [(s.attention, s.mlp) for s in layers["deepseek_v32"]] == [
        ("sparse_latent", "dense"), ("sparse_latent", "moe"), ("sparse_latent", "moe")]
    assert layers["deepseek_v32"][1].options["index_topk"] == 8
    # Gemma 4: 16-wide sliding heads, 32-wide full ones of one key/value head (its
    # values its keys), the last two layers sharing, their MLPs twice as wide
    gemma = layers["gemma4_text"]
    assert [(s.window, s.head_dim, s.kv_heads, s.kv_source) for s in gemma] == [
        (6, 16, 2, None), (None, 32, 1, None), (6, 16, 2, None), (6, 16, 2, 2),
        (None, 32, 1, 1)]
    assert [s.hidden_dim for s in gemma] == [48, 48, 48, 96, 96]
    assert gemma[1].options == {"v_norm": True, "values_from_keys": True}
    assert gemma[1].rope_scaling == {"rope_type": "proportional", "factor": 1.0,
                                     "partial_rotary_factor": 0.25}


# Config fields compared with the original's, through transformers' reading of ours.
FIELDS = {
    "smollm3": ("no_rope_layers", "use_sliding_window", "sliding_window", "attention_bias",
                "mlp_bias"),
    "olmo3": ("sliding_window", "layer_types"),
    "gpt_oss": ("head_dim", "sliding_window", "layer_types", "num_local_experts",
                "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "attention_bias"),
    "gemma4_text": ("head_dim", "sliding_window", "layer_types", "per_layer_config",
                    "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp",
                    "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                    "enable_moe_block", "num_experts", "top_k_experts",
                    "moe_intermediate_size", "final_logit_softcapping"),
    "deepseek_v3": ("head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                    "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor",
                    "norm_topk_prob", "n_group", "topk_group", "num_experts_per_tok",
                    "rope_interleave"),
    "deepseek_v32": ("head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                     "moe_intermediate_size", "first_k_dense_replace", "mlp_layer_types",
                     "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
                     "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_topk"),
}
COMMON_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "hidden_act", "rope_parameters")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_state_dict_and_config_equal_the_models(files, family):
    """The tensors read back are the model's own, under transformers' names (experts
    fused as its modules hold them), bit for bit; the config is the model's, as
    transformers reads it."""
    hf, path = files[family]
    config, state = read_gguf_model(path)
    want = hf.state_dict()
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert set(state) == set(want)
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    ours = transformers.AutoConfig.for_model(**config).to_dict()
    theirs = hf.config.to_dict()
    act = "hidden_activation" if family == "gemma4_text" else "hidden_act"
    for key in (*COMMON_FIELDS, *FIELDS[family]):
        key = act if key == "hidden_act" else key
        mine, original = ours[key], theirs[key]
        if key == "rope_parameters":  # YaRN's truncate is True unless said
            for rope in (mine, original, *mine.values(), *original.values()):
                if isinstance(rope, dict) and rope.get("rope_type") == "yarn":
                    rope.setdefault("truncate", True)
        assert mine == original, key


def test_transformers_gguf_reader_reads_the_gpt_oss_file(files, tmp_path):
    """transformers' own GGUF reader gets the gpt-oss file's tensors back as they were
    written (those it maps: attention, router, norms; not the sinks or llama.cpp's 3-D
    experts) and the same configuration. Its gpt-oss reader takes the rope.scaling
    keys' name lengths for their values (and fails on them under NumPy 2), so it is
    given the file without them."""
    loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    hf, _ = files["gpt_oss"]
    arrays, meta = convert(hf, "gpt_oss", mxfp4=False)
    meta = {k: v for k, v in meta.items() if not k.startswith("add_rope_scaling")}
    path = write_gguf(tmp_path / "no-rope-scaling.gguf", arrays, "gpt-oss", meta)
    theirs = loader.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)
    want = hf.state_dict()
    assert len(theirs["tensors"]) == 3 * 12 + 3  # 12 per layer; embedding, norm, head
    for name, tensor in theirs["tensors"].items():
        assert torch.equal(tensor, want[name]), name
    ours = read_gguf_model(path)[0]
    compared = [k for k in theirs["config"] if k in ours and k != "model_type"]
    assert len(compared) >= 10
    for key in compared:  # they keep a float32 as is (9.99999974738e-06 for 1e-05)
        value = theirs["config"][key]
        if isinstance(value, float):
            ours[key], value = np.float32(ours[key]), np.float32(value)
        assert ours[key] == value, key


def test_transformers_gguf_reader_reads_the_gemma4_file(files):
    """transformers' own GGUF reader gets the gemma4 file's tensors back as the model
    holds them (those it maps: attention, dense MLPs, every norm, so the norms are stored
    as they are, not as 1 + w; the per-layer inputs), and the same sizes."""
    loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    hf, path = files["gemma4_text"]
    theirs = loader.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)
    want = hf.state_dict()
    assert len(theirs["tensors"]) == 98  # of 123: not the experts, router scales, scalars
    for name, tensor in theirs["tensors"].items():
        assert torch.equal(tensor, want[name]), name
    ours = read_gguf_model(path)[0]
    compared = [k for k in theirs["config"] if k in ours and k != "model_type"
                and not isinstance(theirs["config"][k], list)]  # (theirs: per layer)
    assert len(compared) >= 8
    for key in compared:
        value = theirs["config"][key]
        if isinstance(value, float):
            ours[key], value = np.float32(ours[key]), np.float32(value)
        assert ours[key] == value, key


def test_older_and_fused_forms(files, tmp_path):
    """llama.cpp's other forms of the same tensors read back the same: DeepSeek files
    from before its MLA (one attn_kv_b, the heads' sizes once decompressed), experts
    written fused (ffn_gate_up_exps: gate rows, then up rows)."""
    hf, path = files["deepseek_v3"]
    want = read_gguf_model(path)
    arrays, meta = convert(hf, "deepseek_v3", split_kv_b=False)
    old = write_gguf(tmp_path / "old.gguf", arrays, "deepseek2", meta)
    config, state = read_gguf_model(old)
    assert config == want[0] and state.keys() == want[1].keys()
    assert all(torch.equal(state[k], want[1][k]) for k in state)
    for family in ("deepseek_v3", "gpt_oss"):
        hf, path = files[family]
        arrays, meta = convert(hf, family, mxfp4=False)
        for i in range(hf.config.num_hidden_layers):
            for kind in ("weight", "bias"):
                gate, up = (arrays.pop(f"blk.{i}.ffn_{p}_exps.{kind}", None)
                            for p in ("gate", "up"))
                if gate is not None:
                    arrays[f"blk.{i}.ffn_gate_up_exps.{kind}"] = np.concatenate((gate, up), 1)
        fused = write_gguf(tmp_path / f"{family}.gguf", arrays, gguf.MODEL_ARCH_NAMES[
            ARCHES[family]], meta)
        state = read_gguf_model(fused)[1]
        for name, tensor in hf.state_dict().items():
            if name in state:
                assert torch.equal(state[name], tensor), name


def test_deepseek32_draft_block_is_left_unread(files, tmp_path):
    """llama.cpp's converter appends DeepSeek-V3.2's multi-token-prediction block after
    the model's own (``nextn_predict_layers``; a full layer plus its ``nextn.*``
    tensors): the file reads as the model without it."""
    hf, path = files["deepseek_v32"]
    want = read_gguf_model(path)
    arrays, meta = convert(hf, "deepseek_v32")
    layers, d = hf.config.num_hidden_layers, hf.config.hidden_size
    last = f"blk.{layers - 1}."
    draft = {f"blk.{layers}." + k.removeprefix(last): v
             for k, v in arrays.items() if k.startswith(last)}
    for kind, shape in ((gguf.MODEL_TENSOR.NEXTN_EH_PROJ, (d, 2 * d)),
                        (gguf.MODEL_TENSOR.NEXTN_ENORM, (d,)),
                        (gguf.MODEL_TENSOR.NEXTN_HNORM, (d,)),
                        (gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM, (d,))):
        name = gguf.TENSOR_NAMES[kind].format(bid=layers) + ".weight"
        draft[name] = np.ones(shape, np.float32)
    mtp = write_gguf(tmp_path / "mtp.gguf", {**arrays, **draft}, "deepseek32",
                     {**meta, "add_block_count": layers + 1, "add_nextn_predict_layers": 1})
    config, state = read_gguf_model(mtp)
    assert config == want[0] and state.keys() == want[1].keys()
    assert all(torch.equal(state[k], want[1][k]) for k in state)
    refused(write_gguf(tmp_path / "all.gguf", {**arrays, **draft}, "deepseek32",
                       {**meta, "add_block_count": layers + 1,
                        "add_nextn_predict_layers": layers + 1}),
            f"nextn_predict_layers is {layers + 1}", "leaves no layer")


@pytest.mark.usefixtures("no_reads")
def test_refusals_are_one_line_before_any_tensor_is_read(files, tmp_path):
    hf, _ = files["deepseek_v3"]
    arrays, meta = convert(hf, "deepseek_v3", split_kv_b=True)

    def deepseek(name: str, **changes):
        kept = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        return write_gguf(tmp_path / f"{name}.gguf", arrays, "deepseek2", kept)

    # llama.cpp reads a file without a gating function as DeepSeek-V2's softmax routing
    refused(deepseek("v2", add_expert_gating_func=None),
            "deepseek2.expert_gating_func is 0", "sigmoid routing (2)")
    refused(deepseek("soft", add_expert_gating_func=gguf.ExpertGatingFuncType.SOFTMAX),
            "expert_gating_func is 1 (softmax)")
    refused(deepseek("dsa", **{"deepseek2.attention.indexer.top_k": 8}),
            "attention.indexer.top_k", "sparse attention", "a deepseek32 file")
    refused(deepseek("mul", add_rope_scaling_yarn_log_mul=None),
            "rope.scaling.yarn_log_multiplier is missing")
    refused(deepseek("attn", add_rope_scaling_yarn_attn_factor=1.5),
            "rope.scaling.yarn_attn_factor is 1.5")
    refused(deepseek("kvl", add_key_length=20), "attention.key_length is 20", "implies 24")
    refused(deepseek("scale", add_logit_scale=2.0), "deepseek2.logit_scale is 2.0",
            "does not compute it")
    # deepseek32: the indexer's sizes and the query latent are needed (llama.cpp's loader
    # needs them too), and the MLA form, the only one llama.cpp's graph runs
    hf, _ = files["deepseek_v32"]
    arrays, meta = convert(hf, "deepseek_v32")
    for key in ("add_indexer_top_k", "add_q_lora_rank", "add_key_length_mla"):
        kept = {k: v for k, v in meta.items() if k != key}
        what = {"add_indexer_top_k": "attention.indexer.top_k",
                "add_q_lora_rank": "attention.q_lora_rank",
                "add_key_length_mla": "attention.key_length_mla"}[key]
        refused(write_gguf(tmp_path / f"{key}.gguf", arrays, "deepseek32", kept),
                f"deepseek32.{what} is missing", "a deepseek32 model needs it")
    hf, path = files["olmo3"]
    arrays, meta = convert(hf, "olmo3")
    refused(write_gguf(tmp_path / "pattern.gguf", arrays, "olmo2",
                       {**meta, "add_sliding_window_pattern": [True, False]}),
            "olmo2.attention.sliding_window_pattern must flag each of the 3 layers")
    refused(write_gguf(tmp_path / "clamp.gguf", arrays, "olmo2",
                       {**meta, "add_clamp_kqv": 8.0}), "olmo2.attention.clamp_kqv is 8.0")
    # a file of a smaller model than its metadata says (the window layers' tensors gone)
    del arrays["blk.2.post_ffw_norm.weight"]
    refused(write_gguf(tmp_path / "gone.gguf", arrays, "olmo2", meta),
            "has no tensor blk.2.post_ffw_norm.weight",
            "model.layers.2.post_feedforward_layernorm.weight of a olmo3 model")


def test_gemma4_files_qkv_cannot_read_are_one_line(files, tmp_path):
    """What a gemma4 file can say that qkv does not compute, or that is no Gemma 4 model,
    is refused in one line naming the key or tensor."""
    hf, _ = files["gemma4_text"]
    arrays, meta = convert(hf, "gemma4_text")

    def gemma4(name: str, tensors=None, **changes):
        kept = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        return write_gguf(tmp_path / f"{name}.gguf", {**arrays, **(tensors or {})}, "gemma4",
                          kept)

    refused(gemma4("vlen", add_value_length=16), "gemma4.attention.value_length is 16",
            "heads' size 32")
    refused(gemma4("rot", add_rope_dimension_count_swa=8),
            "gemma4.rope.dimension_count_swa is 8")
    refused(gemma4("ffn", add_feed_forward_length=[48, 48, 48, 144, 144]),
            "feed_forward_length is 144 in the shared layers")
    refused(gemma4("pattern", add_sliding_window_pattern=6),
            "sliding_window_pattern must flag each of the 5 layers")
    refused(gemma4("linear", add_rope_scaling_type=gguf.RopeScalingType.LINEAR,
                   add_rope_scaling_factor=2.0), "rope.scaling.type is 'linear'")
    freqs = np.array([1.0, 1e30, 1.0, *[1e30] * 13], dtype=np.float32)
    refused(gemma4("freqs", {"rope_freqs.weight": freqs}), "rope_freqs.weight",
            "not Gemma 4's proportional RoPE")


def test_write_gguf_refuses_these_families(files, tmp_path):
    """Writing these families back to GGUF is not implemented: refused, one line,
    nothing written (test_gguf_write_families tests those written)."""
    for family, (hf, _) in files.items():
        if family in ("gpt_oss", *DEEPSEEKS, "gemma4_text"):  # test_gguf_write_families
            continue
        target = tmp_path / f"{family}.gguf"
        with pytest.raises(ValueError) as error:
            gguf_model.write_gguf(target, hf.config.to_dict(), hf.state_dict())
        one_line(error, f"model_type {family!r} cannot be written to GGUF")
        assert not target.exists()
