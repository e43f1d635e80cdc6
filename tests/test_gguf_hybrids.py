"""The GGUF forms of Qwen3-Next (``qwen3next``), Qwen3.5 (``qwen35``) and Qwen3.5-MoE
(``qwen35moe``), against transformers.

Each family's tiny model is built with transformers' own classes and written as
llama.cpp's converter (``convert_hf_to_gguf.py``, its ``Qwen3NextModel``,
``Qwen3_5TextModel`` and ``Qwen3_5MoeTextModel``) writes it, by the small converter
here, from that converter's conventions: every norm but the linear attention's gated one
stored as ``1 + w``; ``A_log`` as ``ssm_a = -exp(A_log)``; ``dt_bias`` as
``ssm_dt.bias``; the convolution squeezed to ``(channels, kernel)``; Qwen3-Next's fused
``in_proj_qkvz`` (rows per key head) split into ``attn_qkv`` (all queries, all keys, all
values) and ``attn_gate`` (or kept whole as ``ssm_in``, the older files' form), its
``in_proj_ba`` kept as ``ssm_ba``; Qwen3.5's (and Qwen3.5-MoE's) value heads reordered
from grouped (by key head) to tiled order wherever they appear (the values' rows of
``in_proj_qkv`` and of the convolution, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
``dt_bias``, ``A_log``, the columns of ``out_proj``); the experts stacked into 3-D
``ffn_*_exps``; the shared expert's gate as ``ffn_gate_inp_shexp``; the schedule as
``full_attention_interval`` and the rotated part of each head as
``rope.dimension_count``.

``qkv lm import`` of each file must give logits within 1e-4 of the transformers model
and its 20 greedy tokens, cached and not; the state dict read back must be the model's.
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
from qkv.models.gguf_model import read_gguf_model  # noqa: E402
from qkv.models.gpt import generate  # noqa: E402
from qkv.tasks.lm import LanguageModel  # noqa: E402
from test_open_models import HYBRID, VOCAB  # noqa: E402

ARCHES = {"qwen3_5_text": gguf.MODEL_ARCH.QWEN35, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
          "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE}
# Two key heads of 8, each serving three value heads of 8 (llama.cpp's loader takes the
# value heads' size to be the state size): the tiled order differs from the grouped one.
SHAPE = {**HYBRID, "linear_value_head_dim": 8}
CONFIGS = {
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**SHAPE, tie_word_embeddings=True),
    # llama.cpp's Qwen3-Next: experts (with the gated shared expert) in every layer
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=32),
    # Qwen3.5-MoE: Qwen3.5's layers, experts in every layer, no dense MLP
    "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in SHAPE.items() if k != "intermediate_size"}, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32),
}


def hf_model(family: str, seed: int = 0):
    """A random transformers model of ``family``: matrices but the embedding scaled up 4
    times so that its greedy tokens vary, norms and biases moved off their initial
    values (so that a norm read as ``w`` instead of ``1 + w`` could not pass)."""
    config = CONFIGS[family]()
    config.eos_token_id = 2
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


def tiled(t: torch.Tensor, dim: int, key_heads: int, group: int, size: int) -> torch.Tensor:
    """The converter's value-head reordering (``_reorder_v_heads``): the heads along
    ``dim`` (``size`` each), grouped by key head (``h * group + j``), put in tiled order:
    position ``j * key_heads + h`` holds grouped head ``h * group + j``."""
    order = [h * group + j for j in range(group) for h in range(key_heads)]
    heads = t.movedim(dim, 0).reshape(key_heads * group, size, -1)
    return heads[order].reshape(t.movedim(dim, 0).shape).movedim(0, dim)


def convert(model, family: str, ssm_in: bool = False, vector_gate: bool = False):
    """The tensors and metadata llama.cpp's converter writes for ``model``: (llama.cpp
    name -> array, writer method or key -> value). ``ssm_in``: Qwen3-Next's older form
    (the fused rows kept whole); ``vector_gate``: the shared expert's gate as a vector."""
    c, arch = model.config, ARCHES[family]
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    k_heads, v_heads = c.linear_num_key_heads, c.linear_num_value_heads
    hk, hv, group = c.linear_key_head_dim, c.linear_value_head_dim, v_heads // k_heads
    keys = 2 * k_heads * hk
    qwen35 = family != "qwen3_next"  # Qwen3.5 and Qwen3.5-MoE

    def heads(t, dim, size):  # Qwen3.5's value heads in tiled order
        return tiled(t, dim, k_heads, group, size) if qwen35 else t

    def name_of(hf_name: str) -> str:  # gguf's tensor name map (dt_bias renamed first)
        return names.get_name(hf_name.replace(".dt_bias", ".dt_proj.bias"),
                              try_suffixes=(".weight", ".bias"))

    def named(kind, bid: str) -> str:  # the converter's format_tensor_name
        return f"{gguf.TENSOR_NAMES[kind].format(bid=bid)}.weight"

    T = gguf.MODEL_TENSOR
    arrays = {}
    for hf_name, t in state.items():
        i = re.match(r"model\.layers\.(\d+)\.", hf_name)
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            t = t + 1  # zero-centred norms
        if hf_name.endswith("in_proj_qkvz.weight") and not ssm_in:
            # per key head [q, k, v, z] -> [all q, all k, all v] and [all z]
            per_head = t.reshape(k_heads, -1, t.shape[-1])
            q, k, v, z = per_head.split([hk, hk, group * hv, group * hv], dim=1)
            arrays[named(T.ATTN_QKV, i[1])] = torch.cat(
                [x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            arrays[named(T.ATTN_GATE, i[1])] = z.reshape(-1, t.shape[-1])
            continue
        if hf_name.endswith("experts.gate_up_proj"):  # stacked, as the folder's experts
            gate, up = t.chunk(2, dim=1)
            arrays[named(T.FFN_GATE_EXP, i[1])] = gate
            arrays[named(T.FFN_UP_EXP, i[1])] = up
            continue
        if hf_name.endswith("experts.down_proj"):
            arrays[named(T.FFN_DOWN_EXP, i[1])] = t
            continue
        if hf_name.endswith("conv1d.weight"):
            t = t.squeeze(1)
        if hf_name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # the values' part
            t = torch.cat((t[:keys], heads(t[keys:], 0, hv)))
        elif hf_name.endswith("in_proj_z.weight"):
            t = heads(t, 0, hv)
        elif hf_name.endswith(("in_proj_b.weight", "in_proj_a.weight", "dt_bias")):
            t = heads(t, 0, 1)
        elif hf_name.endswith("A_log"):
            t = heads(-t.exp(), 0, 1)
        elif hf_name.endswith("linear_attn.out_proj.weight"):
            t = heads(t, 1, hv)
        elif hf_name.endswith("shared_expert_gate.weight") and vector_gate:
            t = t.flatten()
        arrays[name_of(hf_name)] = t
    arrays = {k: np.ascontiguousarray(v.float().numpy()) for k, v in arrays.items()}

    rope = c.rope_parameters
    meta = {"add_name": type(model).__name__.removesuffix("ForCausalLM"),
            "add_block_count": c.num_hidden_layers,
            "add_context_length": c.max_position_embeddings,
            "add_embedding_length": c.hidden_size,
            "add_head_count": c.num_attention_heads,
            "add_head_count_kv": c.num_key_value_heads,
            "add_rope_freq_base": rope["rope_theta"],
            "add_layer_norm_rms_eps": c.rms_norm_eps,
            "add_key_length": c.head_dim, "add_value_length": c.head_dim,
            "add_ssm_conv_kernel": c.linear_conv_kernel_dim,
            "add_ssm_state_size": hk, "add_ssm_group_count": k_heads,
            "add_ssm_time_step_rank": v_heads, "add_ssm_inner_size": v_heads * hv,
            "add_full_attention_interval": c.to_dict().get("full_attention_interval", 4),
            "add_rope_dimension_count": int(c.head_dim * rope["partial_rotary_factor"]),
            "tokenizer.ggml.model": "gpt2", "add_eos_token_id": 2,
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]}
    if family != "qwen3_5_moe_text":
        meta["add_feed_forward_length"] = c.intermediate_size
    if qwen35:
        meta["add_rope_dimension_sections"] = [2, 1, 1, 0]
    if family != "qwen3_5_text":
        meta.update(add_expert_count=c.num_experts, add_expert_used_count=c.num_experts_per_tok,
                    add_expert_feed_forward_length=c.moe_intermediate_size,
                    add_expert_shared_feed_forward_length=c.shared_expert_intermediate_size)
    return arrays, meta


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple]:
    """family -> (transformers model, its GGUF file)."""
    return family_files(tmp_path_factory, CONFIGS, hf_model, convert, ARCHES)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_lm_import_runs_like_transformers(files, family, tmp_path):
    """``qkv lm import`` of the file: transformers' logits over 70 tokens (past a chunk of
    64) within 1e-4, and its 20 greedy tokens, with and without the cache."""
    hf, path = files[family]
    run = tmp_path / "run"
    assert main(["lm", "import", str(path), "--run-dir", str(run)]) == 0
    model = LanguageModel.load(run).model
    kinds = [block.spec.attention for block in model.trf_blocks]
    assert kinds == ["gated_deltanet"] * 3 + ["gated"]
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    tokens = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert len(set(tokens[0, 11:].tolist())) > 1  # the tokens vary
    for use_cache in (True, False):
        assert generate(model, prompt, 20, use_cache=use_cache).tolist() == tokens.tolist()


def assert_state_is_the_models(state: dict, hf) -> None:
    """The tensors read back are the model's: those stored as they are bit for bit,
    those stored as ``1 + w`` or ``-exp(A_log)`` within float32's rounding."""
    want = hf.state_dict()
    if hf.config.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert set(state) == set(want)
    for name, tensor in want.items():
        if name.endswith(("A_log", "norm.weight")) and "linear_attn.norm" not in name:
            torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("family", list(CONFIGS))
def test_state_dict_and_config_equal_the_models(files, family):
    hf, path = files[family]
    config, state = read_gguf_model(path)
    assert_state_is_the_models(state, hf)
    ours = transformers.AutoConfig.for_model(**config).to_dict()
    theirs = hf.config.to_dict()
    keys = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "tie_word_embeddings", "layer_types", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "rope_parameters"]
    if family != "qwen3_5_text":
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "shared_expert_intermediate_size"]
    if family == "qwen3_next":
        keys += ["norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"]
    if family != "qwen3_5_moe_text":
        keys.append("intermediate_size")
    for key in keys:
        assert ours[key] == theirs[key], key


def test_older_forms_and_draft_layers(files, tmp_path):
    """Qwen3-Next's older files (its fused rows kept whole as ``ssm_in``, the shared
    expert's gate a vector) read back the same; a Qwen3.5 file with a
    multi-token-prediction block after the model's own (``nextn_predict_layers``) reads
    back the model, that block left out."""
    hf, _ = files["qwen3_next"]
    arrays, meta = convert(hf, "qwen3_next", ssm_in=True, vector_gate=True)
    assert "blk.0.ssm_in.weight" in arrays and "blk.0.attn_qkv.weight" not in arrays
    old = write_gguf(tmp_path / "old.gguf", arrays, "qwen3next", meta)
    assert_state_is_the_models(read_gguf_model(old)[1], hf)

    hf, _ = files["qwen3_5_text"]
    arrays, meta = convert(hf, "qwen3_5_text")
    layers = hf.config.num_hidden_layers
    for name in [n for n in arrays if n.startswith("blk.3.")]:  # a full-attention block
        arrays[name.replace("blk.3.", f"blk.{layers}.")] = arrays[name]
    d = hf.config.hidden_size
    arrays[f"blk.{layers}.nextn.eh_proj.weight"] = np.zeros((d, 2 * d), np.float32)
    arrays[f"blk.{layers}.nextn.enorm.weight"] = np.ones(d, np.float32)
    draft = write_gguf(tmp_path / "draft.gguf", arrays, "qwen35",
                       {**meta, "add_block_count": layers + 1,
                        "qwen35.nextn_predict_layers": 1})
    config, state = read_gguf_model(draft)
    assert config["num_hidden_layers"] == layers
    assert_state_is_the_models(state, hf)


@pytest.mark.usefixtures("no_reads")
def test_malformed_metadata_is_refused_in_one_line(files, tmp_path):
    """A missing or inconsistent ``ssm.*`` key, head count or draft count is one line
    naming the key and what would be valid, before any tensor is read."""
    hf, _ = files["qwen3_next"]
    arrays, meta = convert(hf, "qwen3_next")

    def file(name: str, **changes):
        kept = {k: v for k, v in {**meta, **changes}.items() if v is not None}
        return write_gguf(tmp_path / f"{name}.gguf", arrays, "qwen3next", kept)

    refused(file("state", add_ssm_state_size=None), "qwen3next.ssm.state_size is missing")
    refused(file("groups", add_ssm_group_count=4),
            "ssm.time_step_rank 6 (value heads) is not a multiple of ssm.group_count 4")
    refused(file("inner", add_ssm_inner_size=50),
            "ssm.inner_size 50 is not a multiple of ssm.time_step_rank 6")
    refused(file("kv", add_head_count_kv=3),
            "attention.head_count 4 is not a multiple of attention.head_count_kv 3")
    refused(file("rope", add_rope_dimension_count=7), "rope.dimension_count is 7",
            "even number")
    refused(file("values", add_value_length=16), "attention.value_length is 16",
            "attention.key_length 32")
    refused(file("drafts", **{"qwen3next.nextn_predict_layers": 4}),
            "nextn_predict_layers is 4", "at most block_count - 1")
    refused(file("scale", add_expert_weights_scale=2.5), "expert_weights_scale is 2.5",
            "unscaled (1)")
    refused(file("interval", add_full_attention_interval=2),
            "has no tensor blk.1.attn_q.weight")
    # the tensors of a schedule other than the file's
    refused(file("conv", add_ssm_conv_kernel=3), "tensor blk.0.ssm_conv1d.weight has shape "
            "[80, 4]", "implies [80, 3]")


def test_qwen35_pretokenizer_keeps_combining_marks_with_their_letters(tmp_path):
    """``tokenizer.ggml.pre = "qwen35"`` splits as Qwen3.5's tokenizer.json does: a
    combining mark stays with the letter before it (Qwen 2's pattern cuts it off)."""
    from qkv.data.gguf_tokenizer import SPLIT_PATTERNS

    tokenizers = pytest.importorskip("tokenizers")

    def pieces(pre: str, text: str) -> list[str]:
        split = tokenizers.pre_tokenizers.Split(
            tokenizers.Regex(SPLIT_PATTERNS[pre]), behavior="isolated")
        return [p for p, _ in split.pre_tokenize_str(text)]

    text = "cafe\u0301 na\u0308ive, it's 42"
    assert pieces("qwen35", text) == ["cafe\u0301", " na\u0308ive", ",", " it", "'s", " ",
                                      "4", "2"]
    assert pieces("qwen2", text)[:2] == ["cafe", "\u0301"]


def test_qwen3_5_moe_folder_reads_as_its_file(files, tmp_path):
    """A ``qwen3_5_moe_text`` folder (its experts saved one tensor each) is read too: the
    same qkv state dict as its GGUF file gives, and transformers' logits (1e-4)."""
    from qkv.models.gpt import GPTConfig, GPTModel
    from qkv.models.hf_open import config_fields, read_open_config, read_open_weights, to_qkv

    hf, path = files["qwen3_5_moe_text"]
    hf.save_pretrained(tmp_path / "hf")
    fields = config_fields(read_open_config(tmp_path / "hf"), "folder")
    folder = read_open_weights(tmp_path / "hf", fields)
    config, state = read_gguf_model(path)
    assert config_fields(config, "file") == fields
    from_file = to_qkv(state, fields, config["model_type"])
    assert folder.keys() == from_file.keys()
    for name, tensor in folder.items():
        torch.testing.assert_close(from_file[name], tensor, rtol=1e-6, atol=1e-6)
    model = GPTModel(GPTConfig(**fields)).eval()
    model.load_state_dict(folder)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
