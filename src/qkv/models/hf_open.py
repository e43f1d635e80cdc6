"""Read a Hugging Face folder of an open model as :class:`GPTModel` parts.

These families share one layout, the one ``LlamaForCausalLM`` saves: ``nn.Linear``
weights ``(out, in)`` under ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` and
``model.layers.{i}.mlp.{gate,up,down}_proj``, RMSNorm weights, ``model.embed_tokens``,
``model.norm`` and, unless tied, ``lm_head``. They differ in a few switches, each a
``GPTConfig`` field here:

- Llama (SmolLM2, Llama 3.x): biases only with ``attention_bias`` / ``mlp_bias``; RoPE
  scaled the Llama 3 way or linearly;
- Mistral: every layer sees a window of ``sliding_window`` tokens (when set);
- Qwen2: biases on the query, key and value projections; Qwen3: an RMSNorm over each
  head's query and key (``qk_norm``); both may window some layers (``layer_types``);
- Gemma 3: norms ``x_hat * (1 + w)``, two more per block (``post_norms``), embeddings
  scaled by ``sqrt(emb_dim)``, a GeGLU MLP, queries scaled by ``query_pre_attn_scalar``,
  windowed layers with their own RoPE base (``rope_local_base``).

:func:`config_fields` reads a ``config.json`` object the way transformers reads it: a
key left out takes the family's default in transformers, and RoPE comes from either
layout saved files hold (``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``,
or transformers 5's ``rope_parameters``, for Gemma 3 one per layer type). When the
windowed layers' RoPE differs from the others', ``rope_local_base`` is set and those
layers are unscaled; otherwise every layer uses ``rope_base`` and ``rope_scaling``.
Anything qkv's ``GPTModel`` cannot reproduce is a one-line ``ValueError``.

:func:`read_open_weights` reads ``model.safetensors`` or the shards a
``model.safetensors.index.json`` names; every shard's header (names, shapes, dtypes)
and the total size are checked before a tensor's data is read. No pickles.

The other direction writes a model out for the Hugging Face tools:
:func:`hf_config` is the ``config.json`` of a model of ``GPTConfig`` fields (both RoPE
layouts, so that transformers 4 and 5 read it), :func:`from_qkv` renames a state dict
back, and :func:`write_hf_folder` writes both as a folder (Llama, Mistral, Qwen2/3,
Gemma 3, and gpt-oss, DeepSeek-V3/V3.2, Qwen3.5, Qwen3-Next and Gemma 4 as their text
models; not yet GPT-2, SmolLM3, OLMo 3, Qwen3.5-MoE). A field a family cannot express
is refused: the config must read back (:func:`config_fields`) as the same fields.

The families of 2025-26 (SmolLM3, OLMo 3, gpt-oss, DeepSeek-V3/V3.2, Qwen3.5,
Qwen3-Next and Gemma 4) mix kinds of layers: their fields hold a ``layout``, and their
tensors' names follow from the model built on the ``meta`` device
(:func:`_layout_tensors`). Where a folder stores the same model differently from its
family's causal-LM class (a multimodal ``qwen3_5`` or ``gemma4`` folder nests the text
model under ``model.language_model.``; ``qwen3_next`` fuses its linear-attention
projections), the functions that name tensors take the folder's ``model_type``.

GPT-2 folders keep their own reader (:mod:`.hf_gpt2`); :func:`config_fields` hands a
GPT-2 config to it. This module imports :mod:`qkv.models.gpt` only for
:func:`hf_config`'s check of the fields.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..checks import MAX_SIZE, check_bool, check_float, check_int, parse_json, show
from ..positional import check_rope_scaling
from ..utils.fileio import fsync_dir, read_regular, temp_path
from ..utils.native import library_call
from .hf_gpt2 import HF_CONFIG, HF_SAFETENSORS, gpt2_fields
from .hub import WEIGHTS_INDEX

__all__ = ["SUPPORTED_TYPES", "TEXT_MODEL_TYPES", "config_fields", "expected_tensors", "to_qkv",
           "read_open_config", "read_open_weights", "hf_config", "field_difference",
           "from_qkv", "write_hf_folder"]

SUPPORTED_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3",
                   "olmo3", "gpt_oss", "deepseek_v3", "deepseek_v32", "qwen3_5_text",
                   "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "gemma4_text", "gemma4")
# The hybrids of Gated DeltaNet ("linear_attention") and gated softmax attention
# ("full_attention") layers. A "qwen3_5" folder is the multimodal model: its config holds
# the text model's under "text_config", and its weights the text model's under
# "model.language_model." beside a vision tower, which qkv leaves unread.
_HYBRID = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
# Those with experts (and a gated shared expert); Qwen3.5-MoE's are in every layer,
# their top-k weights renormalised, and it has no dense MLP (no intermediate_size).
_HYBRID_MOE = ("qwen3_next", "qwen3_5_moe_text")
# The families whose layers are not all multi-head attention and a dense MLP: their
# GPTConfig has a layout, and their tensors' names follow from the modules it builds.
_MIXED = ("gpt_oss", "deepseek_v3", "deepseek_v32", *_HYBRID)
_DEEPSEEK = ("deepseek_v3", "deepseek_v32")
_MAX_CONFIG_BYTES = 1 << 20
_MAX_INDEX_BYTES = 16 << 20  # an index of a 70B model is ~100 KB
# safetensors' dtype names of the weights qkv reads (its header's "dtype").
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Hugging Face activation name -> GPTConfig.mlp (the gate's activation).
_MLPS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# YaRN's optional keys (qkv.positional.check_rope_scaling fills their defaults).
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate")
# transformers' layer kinds -> GPTConfig.layer_types', and back.
_LAYER_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
_LAYER_TYPES = {ours: theirs for theirs, ours in _LAYER_KINDS.items()}
# The model_types hf_config writes -> transformers' class (config.json's "architectures").
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM",
                  "deepseek_v32": "DeepseekV32ForCausalLM",
                  "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                  "gemma4_text": "Gemma4ForCausalLM"}
# A multimodal folder's type -> its text model's, the type its model is written back as.
TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "gemma4": "gemma4_text"}

# What transformers assumes for a key config.json leaves out: each family's config class.
_COMMON_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "rope_theta": 10_000.0, "sliding_window": 4096,
    "use_sliding_window": False, "max_window_layers": 28,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32,
              "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "head_dim": 128, "max_position_embeddings": 32768},
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131_072, "tie_word_embeddings": True,
                    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "use_bidirectional_attention": False},
    "smollm3": {"vocab_size": 128_256, "hidden_size": 2048, "intermediate_size": 11008,
                "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
                "max_position_embeddings": 32768, "tie_word_embeddings": True,
                "sliding_window": None, "no_rope_layer_interval": 4},
    "olmo3": {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "gpt_oss": {"vocab_size": 201_088, "hidden_size": 2880, "intermediate_size": 2880,
                "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5,
                "sliding_window": 128, "attention_bias": True, "num_local_experts": 128,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
    "deepseek_v3": {"vocab_size": 129_280, "hidden_size": 7168, "intermediate_size": 18432,
                    "num_hidden_layers": 61, "num_attention_heads": 128,
                    "max_position_embeddings": 4096, "moe_intermediate_size": 2048,
                    "n_shared_experts": 1, "n_routed_experts": 256,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "rope_interleave": True},
}
_DEFAULTS["deepseek_v32"] = {**_DEFAULTS["deepseek_v3"], "max_position_embeddings": 163_840,
                             "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
# Both hybrids' linear-attention layers; their full-attention layers turn a quarter of
# each head (transformers' default partial_rotary_factor for them).
_LINEAR_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "full_attention_interval": 4, "partial_rotary_factor": 0.25}
_DEFAULTS["qwen3_5_text"] = {
    **_LINEAR_DEFAULTS, "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "max_position_embeddings": 32768}
_DEFAULTS["qwen3_next"] = {
    **_LINEAR_DEFAULTS, "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "decoder_sparse_step": 1, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
    "norm_topk_prob": True, "mlp_only_layers": []}
_DEFAULTS["qwen3_5_moe_text"] = {
    **_LINEAR_DEFAULTS, "vocab_size": 248_320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
    "num_experts_per_tok": 8}
_DEFAULTS["gemma4_text"] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "tie_word_embeddings": True, "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False, "num_kv_shared_layers": 0, "enable_moe_block": False,
    "use_double_wide_mlp": False, "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional",
                                           "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}}}
# The families whose RoPE may differ between sliding and full layers (rope_parameters
# holds one dict per layer type).
_ROPE_PER_LAYER_TYPE = ("gemma3_text", "olmo3", "gemma4_text")


class _Reader:
    """One config's values, with its family's defaults under those it leaves out, each
    checked as it is read; an error names ``where`` and the field."""

    def __init__(self, config: Mapping[str, Any], defaults: Mapping[str, Any],
                 where: str) -> None:
        self.config, self.defaults, self.where = config, defaults, where

    def get(self, name: str) -> Any:
        return self.config.get(name, self.defaults.get(name))

    def size(self, name: str, lo: int = 1) -> int:
        return check_int(f"{self.where}: {name}", self.get(name), lo, MAX_SIZE)

    def flag(self, name: str) -> bool:
        return check_bool(f"{self.where}: {name}", self.get(name))

    def positive(self, name: str) -> float:
        return check_float(f"{self.where}: {name}", self.get(name), 0.0, lo_open=True)


def config_fields(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``GPTConfig`` fields from a Hugging Face ``config.json`` object of a supported
    ``model_type``; ``where`` names the config in errors. Every value is checked before
    it is used; a field qkv cannot reproduce is a one-line ``ValueError``."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {show(config)}")
    kind = config.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{where}: model_type {show(kind)} is not supported; qkv reads "
                         f"{', '.join(SUPPORTED_TYPES)}")
    if kind == "gpt2":
        return gpt2_fields(config, where)
    if kind in TEXT_MODEL_TYPES:  # Gemma 4's multimodal classes tie by default
        return config_fields(_text_config(config, TEXT_MODEL_TYPES[kind], kind == "gemma4",
                                          where), where)
    if kind == "gemma4_text":
        return _gemma4_fields(config, where)
    read = _Reader(config, {**_COMMON_DEFAULTS, **_DEFAULTS[kind]}, where)
    get, size, flag, positive = read.get, read.size, read.flag, read.positive

    for name in ("attn_logit_softcapping", "final_logit_softcapping", "quantization_config"):
        if config.get(name) is not None:
            raise ValueError(f"{where}: {name}={show(config[name])} is not supported (qkv "
                             f"reproduces {name}=None)")
    if kind == "gemma3_text" and flag("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention=True is not supported "
                         "(qkv's GPTModel is causal)")
    rotary_fraction = None
    if kind in _HYBRID:
        # Their full-attention layers (GatedAttention) turn part of each head; the
        # factor is taken out here, and the other families' RoPE readers refuse it.
        config, rotary_fraction = _partial_rotary_factor(config, get("partial_rotary_factor"),
                                                         where)
    emb_dim, n_heads, n_layers = (size("hidden_size"), size("num_attention_heads"),
                                  size("num_hidden_layers"))
    kv_heads = n_heads if get("num_key_value_heads") is None else size("num_key_value_heads")
    if n_heads % kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({n_heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    head_dim = emb_dim // n_heads if get("head_dim") is None else size("head_dim")
    act_key = "hidden_activation" if kind == "gemma3_text" else "hidden_act"
    mlp = _MLPS.get(get(act_key)) if isinstance(get(act_key), str) else None
    if kind in _HYBRID and mlp != "swiglu":
        raise ValueError(f"{where}: hidden_act={show(get(act_key))} is not supported for "
                         f"{kind}; qkv reproduces 'silu' (its MLPs and its linear-attention "
                         "layers' convolution)")
    if mlp is None:
        raise ValueError(f"{where}: {act_key}={show(get(act_key))} is not supported; qkv "
                         f"reproduces {', '.join(map(repr, _MLPS))}")
    # Which projections carry biases is fixed by each family's modeling code.
    attention_bias = flag("attention_bias") if kind not in ("qwen2", "mistral") else False
    context = size("max_position_embeddings")
    kinds, window = _layer_kinds(config, kind, n_layers, get, where)
    full, local = _rope(config, kind, context, get, where)
    if window is None:
        if "sliding" in kinds and local != full:
            raise ValueError(f"{where}: sliding_window=None with sliding_attention layers "
                             "of their own RoPE is not supported")
        kinds = ["full"] * n_layers
    if "sliding" in kinds and local != full:
        if local[1] is not None:
            raise ValueError(f"{where}: RoPE scaling ({local[1]['rope_type']}) on the "
                             "sliding_attention layers is not supported (qkv scales the "
                             "full_attention layers only)")
        rope_local_base = local[0]
    else:
        rope_local_base = None
    gemma, olmo, hybrid = kind == "gemma3_text", kind == "olmo3", kind in _HYBRID
    return {
        "vocab_size": size("vocab_size"), "context_length": context, "emb_dim": emb_dim,
        "n_heads": n_heads, "n_layers": n_layers, "drop_rate": 0.0,
        "n_kv_groups": None if kv_heads == n_heads else kv_heads,
        "head_dim": None if head_dim * n_heads == emb_dim else head_dim,
        "hidden_dim": size("moe_intermediate_size" if kind == "qwen3_5_moe_text"
                           else "intermediate_size"), "mlp": mlp,
        "qkv_bias": kind == "qwen2" or attention_bias, "out_bias": attention_bias,
        "mlp_bias": flag("mlp_bias") if kind in ("llama", "smollm3") else False,
        # Qwen3-Next's and Qwen3.5's norms are zero-centred too: x_hat * (1 + w)
        "norm": "gemma_rmsnorm" if gemma or hybrid else "rmsnorm",
        "norm_eps": positive("rms_norm_eps"),
        "post_norms": gemma or olmo, "pre_norms": not olmo,
        "qk_norm": kind in ("qwen3", "gemma3_text", "olmo3", *_HYBRID), "qk_norm_full": olmo,
        "query_scale": positive("query_pre_attn_scalar") ** -0.5 if gemma else None,
        "embed_scale": gemma, "tie_weights": flag("tie_word_embeddings"),
        "window_size": window if "sliding" in kinds else None,
        "layer_types": kinds if len(set(kinds)) > 1 else None,
        "rope": True, "rope_base": full[0], "rope_scaling": full[1],
        "rope_local_base": rope_local_base,
        "layout": _nope_layout(config, n_layers, get, where) if kind == "smollm3" else None,
        **(_hybrid_layers(config, kind, n_layers, head_dim, rotary_fraction, read, where)
           if hybrid else _mixed_layers(kind, n_layers, read, where) if kind in _MIXED else {}),
    }


def _text_config(config: Mapping[str, Any], text_type: str, tie_default: bool,
                 where: str) -> dict[str, Any]:
    """The text model's config of a multimodal folder (Qwen3.5's ``qwen3_5``, Gemma 4's
    ``gemma4``): its ``text_config`` (of ``model_type`` ``text_type``), tied or not as
    the folder's own class reads it, from the top level (``tie_default`` when the top
    level is silent). The vision (and audio) towers are not imported."""
    text = config.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, Mapping):
        raise ValueError(f"{where}: text_config must be an object, got {show(text)}")
    if text.get("model_type", text_type) != text_type:
        raise ValueError(f"{where}: text_config.model_type is {show(text['model_type'])}; a "
                         f"{config.get('model_type')} folder's text model is {text_type!r}")
    tie = config.get("tie_word_embeddings", tie_default)
    if "tie_word_embeddings" in text and text["tie_word_embeddings"] != tie:
        raise ValueError(f"{where}: tie_word_embeddings is {show(tie)} but "
                         f"text_config.tie_word_embeddings is {show(text['tie_word_embeddings'])}"
                         "; the multimodal and the text-only classes would read them "
                         "differently")
    return {**text, "model_type": text_type, "tie_word_embeddings": tie}


def _gemma4_fields(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``GPTConfig`` fields of a ``gemma4_text`` config (Gemma 4's text model).

    Gemma 4 over Gemma 3: norms scale by ``w`` (not ``1 + w``); queries are not scaled
    (the QK-norms set their size); value heads are normalised without scale; full layers
    have their own head size and key/value heads (``global_head_dim``,
    ``num_global_key_value_heads`` with ``attention_k_eq_v``, or ``per_layer_config``),
    take values from the keys with ``attention_k_eq_v`` and turn a part of each head
    (proportional RoPE); the last ``num_kv_shared_layers`` layers attend with the keys
    and values of the last earlier layer of their type, with a twice wider MLP under
    ``use_double_wide_mlp``; with ``enable_moe_block`` experts run beside every dense
    MLP; per-layer inputs, a scalar per layer and soft-capped logits."""
    read = _Reader(config, {**_COMMON_DEFAULTS, **_DEFAULTS["gemma4_text"]}, where)
    get, size, flag = read.get, read.size, read.flag

    if config.get("quantization_config") is not None:
        raise ValueError(f"{where}: quantization_config={show(config['quantization_config'])} "
                         "is not supported (qkv reproduces quantization_config=None)")
    # "vision": images attend both ways, text causally (all qkv reads); "all": every token
    if config.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError(f"{where}: use_bidirectional_attention="
                         f"{show(config['use_bidirectional_attention'])} is not supported "
                         "(qkv's GPTModel is causal: None or 'vision', for text)")
    if get("hidden_activation") != "gelu_pytorch_tanh":
        raise ValueError(f"{where}: hidden_activation={show(get('hidden_activation'))} is not "
                         "supported; qkv reproduces 'gelu_pytorch_tanh'")
    emb_dim, n_heads, n_layers = (size("hidden_size"), size("num_attention_heads"),
                                  size("num_hidden_layers"))
    kv_heads, head_dim = size("num_key_value_heads"), size("head_dim")
    declared = config.get("layer_types")
    if declared is None:  # Gemma4TextConfig's default: every sixth layer is a full one
        declared = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                    for i in range(n_layers)]
    if isinstance(declared, list) and declared:  # as transformers forces it
        declared = [*declared[:-1], "full_attention"]
    config = {**config, "layer_types": declared,
              "rope_parameters": config.get("rope_parameters") or get("rope_parameters")}
    kinds, window = _layer_kinds(config, "gemma4_text", n_layers, get, where)
    full, local = _rope(config, "gemma4_text", size("max_position_embeddings"), get, where)
    if local[1] is not None:
        raise ValueError(f"{where}: RoPE scaling ({local[1]['rope_type']}) on the "
                         "sliding_attention layers is not supported")
    if window is None and "sliding" in kinds:
        raise ValueError(f"{where}: sliding_window=None with sliding_attention layers is "
                         "not supported")
    k_eq_v = flag("attention_k_eq_v")
    # Each full layer's head size and key/value heads, as Gemma4TextConfig derives them.
    overrides = config.get("per_layer_config")
    if overrides is None:
        full_heads = {"head_dim": size("global_head_dim")}
        if k_eq_v and get("num_global_key_value_heads") is not None:
            full_heads["num_key_value_heads"] = size("num_global_key_value_heads")
        overrides = {str(i): full_heads for i, k in enumerate(kinds) if k == "full"}
    elif isinstance(overrides, Mapping):  # transformers saves "05" for layer 5 of 10 or more
        overrides = {str(int(k)) if isinstance(k, str) and k.isdecimal() else k: v
                     for k, v in overrides.items()}
    if not isinstance(overrides, Mapping) or any(
            not isinstance(v, Mapping) or set(v) - {"head_dim", "num_key_value_heads"}
            for v in overrides.values()) or not set(overrides) <= {
            str(i) for i in range(n_layers)}:
        raise ValueError(f"{where}: per_layer_config must map layer indices to "
                         f"head_dim and num_key_value_heads, got {show(overrides)}")
    shared = size("num_kv_shared_layers", 0)
    first_shared = n_layers - shared
    if shared > n_layers:
        raise ValueError(f"{where}: num_kv_shared_layers ({shared}) exceeds "
                         f"num_hidden_layers ({n_layers})")
    moe = None
    if flag("enable_moe_block"):
        moe = {"hidden_dim": size("moe_intermediate_size"), "num_experts": size("num_experts"),
               "top_k": size("top_k_experts"), "score": "softmax", "norm_topk_prob": True,
               "activation": "geglu", "router_norm": check_float(
                   f"{where}: rms_norm_eps", get("rms_norm_eps"), 0.0, 1.0, lo_open=True),
               "per_expert_scale": True}
    hidden = size("intermediate_size")
    layout: list[dict[str, Any]] = []
    for i, kind in enumerate(kinds):
        heads = overrides.get(str(i), {})
        entry: dict[str, Any] = {
            "head_dim": check_int(f"{where}: per_layer_config.{i}.head_dim",
                                 heads.get("head_dim", head_dim), 2, MAX_SIZE),
            "kv_heads": check_int(f"{where}: per_layer_config.{i}.num_key_value_heads",
                                  heads.get("num_key_value_heads", kv_heads), 1, MAX_SIZE)}
        if moe is not None:
            entry["mlp"] = "dense_and_moe"
        if i >= first_shared:
            producers = [j for j in range(first_shared) if kinds[j] == kind]
            if not producers:
                raise ValueError(f"{where}: layer {i} ({_LAYER_TYPES[kind]}) shares the keys "
                                 f"and values of an earlier {_LAYER_TYPES[kind]} layer, but "
                                 f"the first {first_shared} layers have none")
            entry.update(attention="shared_kv", kv_source=producers[-1])
            if flag("use_double_wide_mlp"):
                entry["hidden_dim"] = 2 * hidden
        elif k_eq_v and kind == "full":
            entry["options"] = {"values_from_keys": True}
        if n_heads % entry["kv_heads"]:
            raise ValueError(f"{where}: num_attention_heads ({n_heads}) must be a multiple "
                             f"of layer {i}'s key/value heads ({entry['kv_heads']})")
        layout.append(entry)
    ple = get("hidden_size_per_layer_input")
    cap = config.get("final_logit_softcapping")
    return {
        "vocab_size": size("vocab_size"), "context_length": size("max_position_embeddings"),
        "emb_dim": emb_dim, "n_heads": n_heads, "n_layers": n_layers, "drop_rate": 0.0,
        "n_kv_groups": None if kv_heads == n_heads else kv_heads,
        "head_dim": None if head_dim * n_heads == emb_dim else head_dim,
        "hidden_dim": hidden, "mlp": "geglu", "mlp_bias": False,
        "qkv_bias": flag("attention_bias"), "out_bias": flag("attention_bias"),
        "norm": "rmsnorm", "norm_eps": check_float(f"{where}: rms_norm_eps",
                                                   get("rms_norm_eps"), 0.0, lo_open=True),
        "post_norms": True, "qk_norm": True, "query_scale": 1.0, "embed_scale": True,
        "tie_weights": flag("tie_word_embeddings"),
        "window_size": window if "sliding" in kinds else None,
        "layer_types": kinds if len(set(kinds)) > 1 else None,
        "rope": True, "rope_base": full[0], "rope_scaling": full[1],
        "rope_local_base": local[0] if "sliding" in kinds and local != full else None,
        "layout": layout, "attention_options": {"mha": {"v_norm": True}}, "moe": moe,
        "per_layer_inputs": ({"width": size("hidden_size_per_layer_input"),
                              "vocab_size": size("vocab_size_per_layer_input")}
                             if ple else None),
        "layer_scalar": True,
        "logit_softcap": None if cap is None else check_float(
            f"{where}: final_logit_softcapping", cap, 0.0, lo_open=True),
    }


def _partial_rotary_factor(config: Mapping[str, Any], default: Any,
                           where: str) -> tuple[dict[str, Any], float]:
    """``config`` without its ``partial_rotary_factor`` and the factor itself, read as
    transformers reads it: the RoPE dict's (``rope_parameters`` or ``rope_scaling``),
    else the top level's, else the family's ``default``."""
    config = dict(config)
    top = config.pop("partial_rotary_factor", default)
    factor = top
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if isinstance(rope, Mapping) and "partial_rotary_factor" in rope:
            factor = rope["partial_rotary_factor"]
            config[key] = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    factor = check_float(f"{where}: partial_rotary_factor", factor, 0.0, 1.0, lo_open=True)
    return config, factor


def _hybrid_layers(config: Mapping[str, Any], kind: str, n_layers: int, head_dim: int,
                   rotary_fraction: float, read: _Reader, where: str) -> dict[str, Any]:
    """The ``layout``, ``attention_options`` and ``moe`` fields of Qwen3-Next and Qwen3.5:
    ``layer_types`` (or every ``full_attention_interval``-th layer) a gated full-attention
    layer turning ``partial_rotary_factor`` of each head, the others Gated DeltaNet;
    Qwen3-Next's experts with a gated shared expert in every ``decoder_sparse_step``-th
    layer but those of ``mlp_only_layers``; Qwen3.5-MoE's (``qwen3_5_moe_text``) in every
    layer, renormalised. (Qwen3.5's multimodal RoPE, ``mrope_section``,
    turns a text token as plain RoPE does: its three position ids are equal.)"""
    get, size = read.get, read.size

    declared = config.get("layer_types")
    if declared is None:
        every = size("full_attention_interval")
        declared = ["linear_attention" if (i + 1) % every else "full_attention"
                    for i in range(n_layers)]
    kinds = {"linear_attention": "gated_deltanet", "full_attention": "gated"}
    if not (isinstance(declared, list) and len(declared) == n_layers
            and all(isinstance(k, str) and k in kinds for k in declared)):
        raise ValueError(f"{where}: layer_types must list {n_layers} of "
                         f"{', '.join(map(repr, kinds))}, got {show(declared)}")
    # transformers' head size of the turned part: int(head_dim * factor), rounded down
    rotary_dim = int(head_dim * rotary_fraction)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"{where}: partial_rotary_factor={rotary_fraction} turns "
                         f"{rotary_dim} of each head's {head_dim} dimensions; qkv turns an "
                         "even number of them, at least 2")
    k_heads, v_heads = size("linear_num_key_heads"), size("linear_num_value_heads")
    if v_heads % k_heads:
        raise ValueError(f"{where}: linear_num_value_heads ({v_heads}) must be a multiple of "
                         f"linear_num_key_heads ({k_heads})")
    linear = {"num_k_heads": k_heads, "head_k_dim": size("linear_key_head_dim"),
              "num_v_heads": v_heads, "head_v_dim": size("linear_value_head_dim"),
              "conv_kernel_size": size("linear_conv_kernel_dim")}
    mlps, moe = ["dense"] * n_layers, None
    if kind in _HYBRID_MOE and size("num_experts", 0):
        # Qwen3.5-MoE's schedule and renormalisation are fixed by its modeling code
        fixed = kind == "qwen3_5_moe_text"
        step = 1 if fixed else size("decoder_sparse_step")
        dense = [] if fixed else get("mlp_only_layers")
        if not (isinstance(dense, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in dense)):
            raise ValueError(f"{where}: mlp_only_layers must list layer indices, got "
                             f"{show(dense)}")
        mlps = ["dense" if i in dense or (i + 1) % step else "moe" for i in range(n_layers)]
        moe = {"hidden_dim": size("moe_intermediate_size"), "num_experts": size("num_experts"),
               "top_k": size("num_experts_per_tok"), "score": "softmax",
               "norm_topk_prob": fixed or read.flag("norm_topk_prob"),
               "shared_hidden_dim": size("shared_expert_intermediate_size"),
               "shared_gate": True}
        if moe["top_k"] > moe["num_experts"]:
            raise ValueError(f"{where}: num_experts_per_tok ({moe['top_k']}) must be at most "
                             f"num_experts ({moe['num_experts']})")
    layout = [{"attention": kinds[k], "mlp": m} for k, m in zip(declared, mlps, strict=True)]
    return {"layout": layout, "moe": moe if "moe" in mlps else None,
            "attention_options": {"gated": {"rotary_dim": rotary_dim},
                                  "gated_deltanet": linear}}


def _mixed_layers(kind: str, n_layers: int, read: _Reader, where: str) -> dict[str, Any]:
    """The ``layout``, ``attention_options`` and ``moe`` fields of a family whose layers
    are not plain attention and a dense MLP: gpt-oss (sinks, experts in every layer),
    DeepSeek-V3 (latent attention; experts after the first ``first_k_dense_replace``
    layers) and V3.2 (sparse latent attention; ``mlp_layer_types``)."""
    get, size, number = read.get, read.size, read.positive

    if kind == "gpt_oss":
        moe = {"hidden_dim": size("intermediate_size"), "num_experts": size("num_local_experts"),
               "top_k": size("num_experts_per_tok"), "score": "softmax",
               "norm_topk_prob": True, "router_bias": True, "expert_bias": True,
               "activation": "clamped_swiglu", "swiglu_alpha": number("swiglu_alpha"),
               "swiglu_limit": number("swiglu_limit")}
        return {"layout": [{"attention": "sink", "mlp": "moe"}] * n_layers, "moe": moe}
    latent = {"kv_lora_rank": size("kv_lora_rank"),
              "q_lora_rank": None if get("q_lora_rank") is None else size("q_lora_rank"),
              "qk_nope_head_dim": size("qk_nope_head_dim"),
              "qk_rope_head_dim": size("qk_rope_head_dim"), "v_head_dim": size("v_head_dim"),
              "rope_interleave": read.flag("rope_interleave") if kind == "deepseek_v3" else True}
    shared = size("n_shared_experts", 0)
    moe = {"hidden_dim": size("moe_intermediate_size"), "num_experts": size("n_routed_experts"),
           "top_k": size("num_experts_per_tok"), "score": "sigmoid",
           "norm_topk_prob": read.flag("norm_topk_prob"),
           "routed_scaling_factor": number("routed_scaling_factor"),
           "n_group": size("n_group"), "topk_group": size("topk_group"),
           "score_correction_bias": True,
           "shared_hidden_dim": shared * size("moe_intermediate_size") if shared else None}
    dense = min(size("first_k_dense_replace", 0), n_layers)
    mlps = ["dense"] * dense + ["moe"] * (n_layers - dense)
    if kind == "deepseek_v3":
        return {"layout": [{"attention": "latent", "mlp": m} for m in mlps],
                "attention_options": {"latent": latent}, "moe": moe}
    declared = get("mlp_layer_types")
    if declared is not None:
        if not (isinstance(declared, list) and len(declared) == n_layers
                and all(t in ("dense", "sparse") for t in declared)):
            raise ValueError(f"{where}: mlp_layer_types must list 'dense' or 'sparse' for "
                             f"each of the {n_layers} layers, got {show(declared)}")
        mlps = ["moe" if t == "sparse" else "dense" for t in declared]
    sparse = {**latent, "index_n_heads": size("index_n_heads"),
              "index_head_dim": size("index_head_dim"), "index_topk": size("index_topk")}
    return {"layout": [{"attention": "sparse_latent", "mlp": m} for m in mlps],
            "attention_options": {"sparse_latent": sparse}, "moe": moe}


def _nope_layout(config: Mapping[str, Any], n_layers: int, get: Any,
                 where: str) -> list[dict[str, Any]] | None:
    """SmolLM3's layers without RoPE as a ``GPTConfig.layout`` (None when every layer
    rotates): ``no_rope_layers`` (1 rotates, 0 does not), or every
    ``no_rope_layer_interval``-th layer when it is absent."""
    flags = config.get("no_rope_layers")
    if flags is None:
        every = check_int(f"{where}: no_rope_layer_interval", get("no_rope_layer_interval"),
                          1, MAX_SIZE)
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    if not (isinstance(flags, list) and len(flags) == n_layers
            and all(f in (0, 1) and not isinstance(f, float) for f in flags)):
        raise ValueError(f"{where}: no_rope_layers must list 0 or 1 for each of the "
                         f"{n_layers} layers, got {show(flags)}")
    if all(flags):
        return None
    return [{} if rotates else {"rope": False} for rotates in flags]


def _layer_kinds(config: Mapping[str, Any], kind: str, n_layers: int, get: Any,
                 where: str) -> tuple[list[str], int | None]:
    """Each layer's kind as the config declares it ("sliding" or "full") and the window
    in tokens (``None``: no layer is windowed, whatever the kinds say)."""
    if kind in ("llama", *_DEEPSEEK, *_HYBRID):
        return ["full"] * n_layers, None
    window = get("sliding_window")
    if window is not None:
        check_int(f"{where}: sliding_window", window, 1, MAX_SIZE)
    if kind == "mistral":  # MistralModel windows every layer and ignores layer_types
        return ["sliding"] * n_layers, window
    if kind == "smollm3":
        if not check_bool(f"{where}: use_sliding_window", get("use_sliding_window")):
            window = None
        if config.get("layer_types") is None:  # the NoPE layers are the windowed ones
            layout = _nope_layout(config, n_layers, get, where) or [{}] * n_layers
            return ["sliding" if "rope" in entry else "full" for entry in layout], window
    if kind in ("qwen2", "qwen3") and not check_bool(f"{where}: use_sliding_window",
                                                     get("use_sliding_window")):
        window = None
    declared = config.get("layer_types")
    if declared is not None:
        if not (isinstance(declared, list) and len(declared) == n_layers
                and all(isinstance(k, str) and k in _LAYER_KINDS for k in declared)):
            raise ValueError(f"{where}: layer_types must list {n_layers} of "
                             f"{', '.join(map(repr, _LAYER_KINDS))}, got {show(declared)}")
        return [_LAYER_KINDS[k] for k in declared], window
    if kind == "gpt_oss":  # GptOssConfig's default: sliding and full layers alternate
        return ["sliding" if (i + 1) % 2 else "full" for i in range(n_layers)], window
    if kind == "gemma3_text":  # older configs: every pattern-th layer is a full one
        pattern = check_int(f"{where}: sliding_window_pattern", get("sliding_window_pattern"),
                            1, MAX_SIZE)
        return ["sliding" if (i + 1) % pattern else "full" for i in range(n_layers)], window
    first = check_int(f"{where}: max_window_layers", get("max_window_layers"), 0, MAX_SIZE)
    return ["sliding" if i >= first else "full" for i in range(n_layers)], window


_Rope = tuple[float, dict[str, Any] | None]


def _rope(config: Mapping[str, Any], kind: str, context: int, get: Any,
          where: str) -> tuple[_Rope, _Rope]:
    """``(base, scaling)`` of the full-attention layers and of the sliding ones.

    transformers 5 saves ``rope_parameters`` (for Gemma 3 one dict per layer type);
    older files hold ``rope_theta``, ``rope_scaling`` and, for Gemma 3,
    ``rope_local_base_freq``, whose ``rope_scaling`` is the full layers'. A value inside
    the dict wins over the top-level one.
    """
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: {name} must be an object or null, got {show(value)}")
    nested = isinstance(params, dict) and any(k in _LAYER_KINDS for k in params)
    if kind in _ROPE_PER_LAYER_TYPE:
        if params and not nested:
            raise ValueError(f"{where}: {kind} rope_parameters must map "
                             f"{', '.join(_LAYER_KINDS)} to their parameters")
        params = params or {}
        for name in _LAYER_KINDS:
            if params.get(name) is not None and not isinstance(params[name], dict):
                raise ValueError(f"{where}: rope_parameters.{name} must be an object, got "
                                 f"{show(params[name])}")
        full = {**(params.get("full_attention") or {}), **(scaling or {})}
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", get("rope_theta"))
        local.setdefault("rope_theta", get("rope_local_base_freq" if kind == "gemma3_text"
                                           else "rope_theta"))
        named = (("rope_parameters.full_attention", full),
                 ("rope_parameters.sliding_attention", local))
    else:
        if nested:
            raise ValueError(f"{where}: rope_parameters per layer type are read for "
                             f"{', '.join(_ROPE_PER_LAYER_TYPE)} only, not {kind}")
        full = dict(scaling or params or {})
        full.setdefault("rope_theta", get("rope_theta"))
        if "original_max_position_embeddings" in config:  # transformers lets it win
            full["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        named = (("rope_parameters", full), ("rope_parameters", full))
    for _, rope in named:
        if "partial_rotary_factor" in config:
            rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    first, second = (_rope_fields(rope, context, f"{where}: {name}") for name, rope in named)
    return first, second


def _rope_fields(rope: Mapping[str, Any], context: int, where: str) -> _Rope:
    """``(rope_base, rope_scaling)`` from one transformers RoPE dict."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = check_float(f"{where}.rope_theta", rope.get("rope_theta"), 0.0, lo_open=True)
    partial = rope.get("partial_rotary_factor", 1.0)
    if rope_type == "proportional":  # Gemma 4: the first part of each head turns
        return base, check_rope_scaling({"rope_type": "proportional",
                                         "factor": rope.get("factor", 1.0),
                                         "partial_rotary_factor": partial}, where)
    if isinstance(partial, bool) or partial != 1:
        raise ValueError(f"{where}.partial_rotary_factor={show(partial)} is not supported "
                         "(qkv rotates every dimension of a head: 1.0)")
    if rope_type == "default":
        return base, None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"{where}.rope_type={show(rope_type)} is not supported; qkv "
                         f"reproduces {', '.join(map(repr, _ROPE_TYPES))}")

    def positive(name: str) -> float:
        return check_float(f"{where}.{name}", rope.get(name), 0.0, lo_open=True)

    if rope_type == "linear":
        return base, {"rope_type": "linear", "factor": positive("factor")}
    if rope_type == "yarn":
        # transformers' reading: the original context defaults to the model's, a factor
        # left out is the context's stretch over it
        original = check_int(f"{where}.original_max_position_embeddings",
                             rope.get("original_max_position_embeddings", context), 1,
                             MAX_SIZE)
        factor = positive("factor") if rope.get("factor") is not None else context / original
        return base, check_rope_scaling({
            **{k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None},
            "rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": original}, where)
    low, high = positive("low_freq_factor"), positive("high_freq_factor")
    if high <= low:
        raise ValueError(f"{where}: high_freq_factor ({high}) must exceed low_freq_factor "
                         f"({low})")
    original = check_int(f"{where}.original_max_position_embeddings",
                         rope.get("original_max_position_embeddings", context), 1, MAX_SIZE)
    return base, {"rope_type": "llama3", "factor": positive("factor"),
                  "low_freq_factor": low, "high_freq_factor": high,
                  "original_max_position_embeddings": original}


def hf_config(fields: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face folder holding a model of ``GPTConfig``
    ``fields`` (:func:`config_fields`' output, a run's ``config.json``: a field left out
    takes ``GPTConfig``'s default) as ``model_type`` (``"llama"``, ``"mistral"``,
    ``"qwen2"``, ``"qwen3"``, ``"gemma3_text"``, or one of the families of mixed layers:
    ``"gpt_oss"``, ``"deepseek_v3"``, ``"deepseek_v32"``, ``"qwen3_5_text"``,
    ``"qwen3_next"``, ``"gemma4_text"``, whose layout, attention options and experts
    become their config keys; a multimodal folder's model is written as its text model,
    :data:`TEXT_MODEL_TYPES`).

    RoPE is written in both layouts: transformers 5's ``rope_parameters`` (for Gemma 3
    one per layer type) and the older ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq``. The config must read back as ``fields``
    (:func:`config_fields`; ``drop_rate``, a training setting, aside, and a size left
    ``None`` equal to its default): a field the family cannot express (Qwen2 without
    query biases, a window on a Llama, ...) is a one-line ``ValueError`` naming it.
    """
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type {show(model_type)} cannot be written; qkv writes "
                         f"{', '.join(_ARCHITECTURES)}")
    f, gemma = _complete(fields), model_type == "gemma3_text"
    acts = {mlp: act for act, mlp in _MLPS.items()}
    if f["mlp"] not in acts:
        raise ValueError(f"fields: mlp={show(f['mlp'])} cannot be written as a {model_type} "
                         f"config.json; it holds {', '.join(map(repr, acts))} MLPs")
    if model_type in _LAYOUT_WRITTEN:
        config = _layout_config(f, model_type)
        config["hidden_activation" if model_type == "gemma4_text" else "hidden_act"] = \
            acts[f["mlp"]]
        return _read_back(f, config, model_type)
    d, n_heads, n_layers, window = f["emb_dim"], f["n_heads"], f["n_layers"], f["window_size"]
    head_dim = f["head_dim"] or d // n_heads
    kinds = [_LAYER_TYPES["sliding" if window is not None and (
        f["layer_types"] is None or f["layer_types"][i] == "sliding") else "full"]
        for i in range(n_layers)]
    full = {"rope_type": "default", **(f["rope_scaling"] or {}), "rope_theta": f["rope_base"]}
    config: dict[str, Any] = {
        **_sizes_config(f, model_type),
        "hidden_activation" if gemma else "hidden_act": acts[f["mlp"]],
        "rope_scaling": None if f["rope_scaling"] is None else dict(f["rope_scaling"]),
        "rope_parameters": full,
    }
    if model_type in ("llama", "qwen3", "gemma3_text"):  # Qwen2 always has q/k/v biases
        config["attention_bias"] = f["qkv_bias"]
    if model_type == "llama":
        config["mlp_bias"] = f["mlp_bias"]
    if model_type != "llama":
        config["sliding_window"] = window
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=window is not None, layer_types=kinds)
    if gemma:
        local = full if f["rope_local_base"] is None else {
            "rope_type": "default", "rope_theta": f["rope_local_base"]}
        # transformers computes query_pre_attn_scalar ** -0.5: an integer where one fits
        scale = f["query_scale"] or head_dim ** -0.5
        scalar = round(scale ** -2) if round(scale ** -2) ** -0.5 == scale else scale ** -2
        config.update(layer_types=kinds, query_pre_attn_scalar=scalar,
                      rope_local_base_freq=local["rope_theta"],
                      rope_parameters={"full_attention": full, "sliding_attention": local},
                      attn_logit_softcapping=None, final_logit_softcapping=None)
    return _read_back(f, config, model_type)


def _sizes_config(f: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The config.json keys every family writes alike (``f``: every field): its class,
    sizes, norm epsilon, tying and RoPE base."""
    d, n_heads = f["emb_dim"], f["n_heads"]
    return {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": f["vocab_size"], "hidden_size": d,
        "intermediate_size": f["hidden_dim"] or 4 * d, "num_hidden_layers": f["n_layers"],
        "num_attention_heads": n_heads, "num_key_value_heads": f["n_kv_groups"] or n_heads,
        "head_dim": f["head_dim"] or d // n_heads,
        "max_position_embeddings": f["context_length"], "rms_norm_eps": f["norm_eps"],
        "tie_word_embeddings": f["tie_weights"], "rope_theta": f["rope_base"],
    }


def _read_back(fields: Mapping[str, Any], config: dict[str, Any],
               model_type: str) -> dict[str, Any]:
    """``config``, after a one-line ``ValueError`` if it does not read back as ``fields``."""
    difference = field_difference(fields, config_fields(config, f"{model_type} config"),
                                  "transformers")
    if difference:
        raise ValueError(f"fields cannot be written as a {model_type} config.json: "
                         f"{difference}")
    return config


# The families of mixed layers hf_config writes (their text model's causal-LM class).
_LAYOUT_WRITTEN = ("gpt_oss", "deepseek_v3", "deepseek_v32", "qwen3_5_text", "qwen3_next",
                   "gemma4_text")


def _layout_config(f: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """:func:`hf_config` of the families whose fields hold a ``layout`` (``f``: every
    field): the keys :func:`config_fields` reads back as each part of the layout, its
    options and experts. What a family cannot express shows in the read-back check."""
    from .gpt import GPTConfig

    d, n_heads, n_layers, window = f["emb_dim"], f["n_heads"], f["n_layers"], f["window_size"]
    layout = [GPTConfig.from_dict(f).layer_spec(i) for i in range(n_layers)]
    head_dim = f["head_dim"] or d // n_heads
    scaling = {k: v for k, v in (f["rope_scaling"] or {}).items() if v is not None}
    full = {"rope_type": "default", **scaling, "rope_theta": f["rope_base"]}
    sliding = [layer.window is not None for layer in layout]
    config: dict[str, Any] = {
        **_sizes_config(f, model_type), "attention_bias": f["qkv_bias"],
        "rope_scaling": dict(full) if scaling else None, "rope_parameters": full,
    }
    moe = f["moe"] or {}
    options = f["attention_options"] or {}
    if model_type == "gpt_oss":
        config.update(
            sliding_window=window, intermediate_size=moe.get("hidden_dim"),
            layer_types=[_LAYER_TYPES["sliding" if s else "full"] for s in sliding],
            num_local_experts=moe.get("num_experts"), num_experts_per_tok=moe.get("top_k"),
            swiglu_alpha=moe.get("swiglu_alpha"), swiglu_limit=moe.get("swiglu_limit"))
    elif model_type in _DEEPSEEK:
        kind = "latent" if model_type == "deepseek_v3" else "sparse_latent"
        latent = options.get(kind, {})
        mlps = [layer.mlp for layer in layout]
        shared = moe.get("shared_hidden_dim")
        config.update(
            {k: latent.get(k) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                                        "qk_rope_head_dim", "v_head_dim")},
            moe_intermediate_size=moe.get("hidden_dim"), n_routed_experts=moe.get("num_experts"),
            num_experts_per_tok=moe.get("top_k"), norm_topk_prob=moe.get("norm_topk_prob"),
            routed_scaling_factor=moe.get("routed_scaling_factor"),
            n_group=moe.get("n_group"), topk_group=moe.get("topk_group"),
            n_shared_experts=shared // moe["hidden_dim"] if shared else 0,
            first_k_dense_replace=next((i for i, m in enumerate(mlps) if m != "dense"),
                                       n_layers))
        if model_type == "deepseek_v3":
            config["rope_interleave"] = latent.get("rope_interleave")
        else:
            config.update({k: latent.get(k) for k in ("index_n_heads", "index_head_dim",
                                                      "index_topk")},
                          mlp_layer_types=["sparse" if m == "moe" else "dense" for m in mlps])
    elif model_type in _HYBRID:
        linear = options.get("gated_deltanet", {})
        rotary_dim = options.get("gated", {}).get("rotary_dim", head_dim)
        full["partial_rotary_factor"] = rotary_dim / head_dim
        config.update(
            layer_types=["linear_attention" if layer.attention == "gated_deltanet"
                         else "full_attention" for layer in layout],
            partial_rotary_factor=rotary_dim / head_dim,
            linear_num_key_heads=linear.get("num_k_heads"),
            linear_key_head_dim=linear.get("head_k_dim"),
            linear_num_value_heads=linear.get("num_v_heads"),
            linear_value_head_dim=linear.get("head_v_dim"),
            linear_conv_kernel_dim=linear.get("conv_kernel_size"))
        config["rope_scaling"] = None
        if model_type == "qwen3_next":
            config.update(
                num_experts=moe.get("num_experts", 0), decoder_sparse_step=1,
                mlp_only_layers=[i for i, layer in enumerate(layout) if layer.mlp != "moe"],
                **({"num_experts_per_tok": moe["top_k"], "norm_topk_prob": moe["norm_topk_prob"],
                    "moe_intermediate_size": moe["hidden_dim"],
                    "shared_expert_intermediate_size": moe.get("shared_hidden_dim")}
                   if moe else {}))
    else:  # gemma4_text: its RoPE per layer type only (rope_scaling would replace it)
        del config["rope_theta"], config["rope_scaling"]
        config.update(_gemma4_config(f, layout, head_dim, full, sliding))
    return config


def _gemma4_config(f: Mapping[str, Any], layout: list[Any], head_dim: int,
                   full: dict[str, Any], sliding: list[bool]) -> dict[str, Any]:
    """The ``gemma4_text`` keys of :func:`_layout_config`: each layer's head size and
    key/value heads where they differ from the sliding layers' (``per_layer_config``),
    the trailing layers that share an earlier layer's cache, experts, per-layer inputs."""
    kv_heads = f["n_kv_groups"] or f["n_heads"]
    first = next((i for i, layer in enumerate(layout) if layer.attention == "shared_kv"),
                 len(layout))
    moe, ple = f["moe"], f["per_layer_inputs"]
    local = {"rope_type": "default", "rope_theta": f["rope_local_base"] or f["rope_base"]}
    return {
        "sliding_window": f["window_size"],
        "layer_types": [_LAYER_TYPES["sliding" if s else "full"] for s in sliding],
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "per_layer_config": {str(i): {"head_dim": layer.head_dim,
                                      "num_key_value_heads": layer.kv_heads}
                             for i, layer in enumerate(layout)
                             if (layer.head_dim, layer.kv_heads) != (head_dim, kv_heads)},
        "attention_k_eq_v": any(layer.options.get("values_from_keys") for layer in layout),
        "num_kv_shared_layers": len(layout) - first,
        "use_double_wide_mlp": any(layer.hidden_dim == 2 * f["hidden_dim"]
                                   for layer in layout[first:]),
        "enable_moe_block": moe is not None,
        **({"moe_intermediate_size": moe["hidden_dim"], "num_experts": moe["num_experts"],
            "top_k_experts": moe["top_k"]} if moe else {}),
        "hidden_size_per_layer_input": ple["width"] if ple else 0,
        "vocab_size_per_layer_input": ple["vocab_size"] if ple else f["vocab_size"],
        "final_logit_softcapping": f["logit_softcap"],
    }


def field_difference(fields: Mapping[str, Any], back: Mapping[str, Any],
                     runner: str) -> str | None:
    """None if two sets of every ``GPTConfig`` field build models that compute the same
    (``drop_rate``, a training setting, aside; a size left ``None`` equal to its
    default); else their first difference, in words: ``"window_size is 16; transformers
    would run None"`` (``runner`` runs ``back``)."""
    want, got = _resolved(fields), _resolved(back)
    for key, theirs in got.items():
        ours = want[key]
        if ours == theirs:
            continue
        if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
            i = next(i for i in range(len(ours)) if ours[i] != theirs[i])  # layer_types
            return f"{key}[{i}] is {ours[i]!r}; {runner} would run {theirs[i]!r}"
        if isinstance(ours, Mapping) and isinstance(theirs, Mapping):  # rope_scaling
            inner = next(k for k in (*ours, *theirs) if ours.get(k) != theirs.get(k))
            return (f"{key}[{inner!r}] is {show(ours.get(inner))}; {runner} would run "
                    f"{show(theirs.get(inner))}")
        return f"{key} is {show(fields[key])}; {runner} would run {show(back[key])}"
    return None


def _complete(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Every ``GPTConfig`` field, checked: ``fields`` with those left out at their default."""
    from .gpt import GPTConfig

    return asdict(GPTConfig.from_dict(fields))


def _resolved(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` with each size left ``None`` spelled out and ``drop_rate`` (training
    only) set to 0: two of them build models that compute the same iff they are equal."""
    head_dim = fields["head_dim"] or fields["emb_dim"] // fields["n_heads"]
    return {**fields, "drop_rate": 0.0, "head_dim": head_dim,
            "n_kv_groups": fields["n_kv_groups"] or fields["n_heads"],
            "hidden_dim": fields["hidden_dim"] or 4 * fields["emb_dim"],
            "query_scale": fields["query_scale"] or head_dim ** -0.5}


# A block's tensors of a model with a layout: qkv's name (after "trf_blocks.{i}.") ->
# Hugging Face's (after "model.layers.{i}."), the first prefix that matches. Latent
# attention's modules already carry Hugging Face's names; so do the experts' 3-D tensors.
_BLOCK_NAMES = (
    ("norm1.scale", "input_layernorm.weight"),
    ("norm2.scale", "post_attention_layernorm.weight"),
    ("att.W_query.", "self_attn.q_proj."), ("att.W_key.", "self_attn.k_proj."),
    ("att.W_value.", "self_attn.v_proj."), ("att.out_proj.", "self_attn.o_proj."),
    ("att.q_norm.scale", "self_attn.q_norm.weight"),
    ("att.k_norm.scale", "self_attn.k_norm.weight"),
    ("att.", "self_attn."),
    ("ff.fc1.", "mlp.gate_proj."), ("ff.fc2.", "mlp.up_proj."), ("ff.fc3.", "mlp.down_proj."),
    ("ff.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    ("ff.shared_expert.fc1.", "mlp.shared_experts.gate_proj."),
    ("ff.shared_expert.fc2.", "mlp.shared_experts.up_proj."),
    ("ff.shared_expert.fc3.", "mlp.shared_experts.down_proj."),
    ("ff.", "mlp."),
)
# gpt-oss, the family whose router and experts have biases, names its router "router"
# (the others "gate") and stores its experts transposed, gate and up columns interleaved.
_GPT_OSS_NAMES = (("ff.router.", "mlp.router."),)
_OTHER_NAMES = (("ff.router.", "mlp.gate."),)
# Qwen, the family whose shared expert is gated, names it in the singular.
_QWEN_NAMES = (("ff.shared_expert.fc1.", "mlp.shared_expert.gate_proj."),
               ("ff.shared_expert.fc2.", "mlp.shared_expert.up_proj."),
               ("ff.shared_expert.fc3.", "mlp.shared_expert.down_proj."))
# Gemma 4: its four norms around the sub-layers, the dense MLP and the experts beside it
# (DenseAndExperts, stored at the layer's top level), the per-layer input's gate.
_GEMMA4_NAMES = (
    ("norm2.scale", "pre_feedforward_layernorm.weight"),
    ("post_norm1.scale", "post_attention_layernorm.weight"),
    ("post_norm2.scale", "post_feedforward_layernorm.weight"),
    ("ff.dense.fc1.", "mlp.gate_proj."), ("ff.dense.fc2.", "mlp.up_proj."),
    ("ff.dense.fc3.", "mlp.down_proj."),
    ("ff.post_dense_norm.scale", "post_feedforward_layernorm_1.weight"),
    ("ff.moe_norm.scale", "pre_feedforward_layernorm_2.weight"),
    ("ff.post_moe_norm.scale", "post_feedforward_layernorm_2.weight"),
    ("ff.moe.router.", "router.proj."), ("ff.moe.router_scale", "router.scale"),
    ("ff.moe.per_expert_scale", "router.per_expert_scale"), ("ff.moe.experts.", "experts."),
    ("ple.gate.", "per_layer_input_gate."), ("ple.proj.", "per_layer_projection."),
    ("ple.norm.scale", "post_per_layer_input_norm.weight"), ("layer_scalar", "layer_scalar"),
)
# Linear-attention layers keep their module's own names, under "linear_attn.".
_LINEAR_NAMES = (("att.", "linear_attn."),)
# Where a folder of these types keeps its text model (else "model."), and the tensors it
# holds beside it that qkv leaves unread, as transformers' causal-LM classes do: the
# vision tower, and the multi-token-prediction layers ("mtp.", a draft head for
# speculative decoding that the model's own logits do not go through).
_MODEL_PREFIX = {"qwen3_5": "model.language_model.", "gemma4": "model.language_model."}
_UNREAD = {"qwen3_5": ("model.visual.", "mtp."), "qwen3_5_text": ("mtp.",),
           "qwen3_5_moe_text": ("mtp.",),
           "gemma4": ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                      "model.embed_audio."),
           "qwen3_next": ("mtp.",)}
# The types whose linear-attention layers store q, k, v and z as one fused projection,
# and b and a as another, interleaved per key head (qkv.linear_attention.fused_row_order).
_FUSED_DELTANET = ("qwen3_next",)


def _gpt_oss_experts(name: str) -> tuple[Any, Any] | None:
    """``(to qkv, to Hugging Face)`` for a gpt-oss expert tensor named ``name`` (qkv's
    name), or None: qkv's ``gate_up_proj (E, 2I, d)`` is gate rows then up rows, gpt-oss's
    ``(E, d, 2I)`` has them in alternate columns; ``down_proj (E, I, d)`` is qkv's layout
    (None: stored as it is)."""
    if name.endswith("experts.gate_up_proj"):
        return (lambda w: torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1).transpose(1, 2),
                lambda w: torch.stack(w.transpose(1, 2).chunk(2, dim=-1), dim=-1).flatten(-2))
    if name.endswith("experts.gate_up_proj_bias"):
        return (lambda b: torch.cat((b[..., 0::2], b[..., 1::2]), dim=-1),
                lambda b: torch.stack(b.chunk(2, dim=-1), dim=-1).flatten(-2))
    return None


def _fused_experts(name: str) -> tuple[Any, Any] | None:
    """``(to qkv, to Hugging Face)`` for an expert tensor as transformers' fused modules
    hold it (DeepSeek, Qwen: ``down_proj (E, d, I)``, qkv's transposed), or None."""
    if name.endswith("experts.down_proj"):
        return (lambda w: w.transpose(1, 2), lambda w: w.transpose(1, 2))
    return None


@dataclass(frozen=True)
class _Stored:
    """One tensor as a Hugging Face folder stores it, and where it goes in qkv's model.

    ``piece`` is ``(expert, half)`` when the stored tensor is one expert's slice of a
    qkv 3-D expert tensor (DeepSeek and Qwen store ``experts.{e}.gate_proj.weight``,
    ``up_proj`` and ``down_proj``: half 0 and 1 of ``gate_up_proj``'s rows, or None for
    ``down_proj``, whose ``(d, I)`` is the transpose of its slice of qkv's ``(E, I,
    d)``); ``transform`` is ``(to qkv, to Hugging Face)`` for a tensor stored in another
    layout (gpt-oss's and transformers' fused experts). ``fused`` is the other way round: the stored
    tensor holds several of qkv's, ``ours`` and then ``fused[0]``'s names, and
    ``fused[1:]`` is ``(split: stored -> a tuple of them, fuse: the tuple -> stored)``
    (Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``)."""

    hf: str
    ours: str
    shape: tuple[int, ...]
    piece: tuple[int, int | None] | None = None
    transform: tuple[Any, Any] | None = None
    fused: tuple[tuple[str, ...], Any, Any] | None = None


def _layout_meta_model(fields: Mapping[str, Any]) -> Any:
    """``GPTModel(fields)`` on the ``meta`` device: every tensor's name and shape."""
    from .gpt import GPTConfig

    return GPTConfig.from_dict(fields).meta_model()


def _fused_deltanet(att: Any, hf: str, ours: str) -> dict[str, _Stored | None]:
    """Qwen3-Next's two fused projections of the linear-attention layer ``att``, keyed by
    the first of the qkv tensors each holds: ``hf`` and ``ours`` are the layer's
    ``...linear_attn.`` and ``...att.`` prefixes."""
    from ..linear_attention import fused_row_order

    qkvz, ba = fused_row_order(att.num_k_heads, att.num_v_heads, att.head_k_dim,
                               att.head_v_dim)
    stored: dict[str, _Stored | None] = {}
    for order, fused, first, second in ((qkvz, "in_proj_qkvz", "in_proj_qkv", "in_proj_z"),
                                        (ba, "in_proj_ba", "in_proj_b", "in_proj_a")):
        first_rows = getattr(att, first).out_features
        # split: the stored rows put back in qkv's order (unfused[order] = stored), cut in
        # two; fuse: the two side by side, their rows taken in the stored order
        def split(w: Tensor, order: Tensor = order, rows: int = first_rows) -> tuple[Tensor, ...]:
            unfused = torch.empty_like(w).index_copy_(0, order, w)
            return tuple(t.clone() for t in unfused.split((rows, len(order) - rows)))

        def fuse(parts: tuple[Tensor, ...], order: Tensor = order) -> Tensor:
            return torch.cat(parts)[order]

        stored[f"{ours}{first}.weight"] = _Stored(
            f"{hf}{fused}.weight", f"{ours}{first}.weight", (len(order), att.d_in),
            fused=((f"{ours}{second}.weight",), split, fuse))
        stored[f"{ours}{second}.weight"] = None  # held by the first
    return stored


def _layout_tensors(fields: Mapping[str, Any], model_type: str | None = None,
                    fused_experts: bool = False) -> Iterator[_Stored]:
    """Every tensor a folder of a model of ``fields`` with a layout holds, derived from
    the model itself built on the ``meta`` device: its state dict's names mapped by
    :data:`_BLOCK_NAMES`, experts split per expert (or transposed, for gpt-oss).
    ``model_type``, the folder's, says where it keeps the text model
    (:data:`_MODEL_PREFIX`) and whether it fuses the linear-attention projections
    (:data:`_FUSED_DELTANET`); None: as the family's causal-LM class saves it.

    ``fused_experts``: the experts as transformers' modules hold them instead, one 3-D
    tensor each: ``mlp.experts.gate_up_proj (E, 2I, d)`` (gate rows, then up rows, as qkv)
    and ``mlp.experts.down_proj (E, d, I)`` (transposed for qkv); gpt-oss's are read as
    its folders store them."""
    moe = fields.get("moe") or {}
    gpt_oss = bool(moe.get("expert_bias"))
    gemma = fields.get("post_norms") and fields.get("pre_norms", True)
    rules = (*(_GPT_OSS_NAMES if gpt_oss else _OTHER_NAMES),
             *(_QWEN_NAMES if moe.get("shared_gate") else ()),
             *(_GEMMA4_NAMES if gemma else ()), *_BLOCK_NAMES)
    base = _MODEL_PREFIX.get(model_type, "model.")
    top = {"tok_emb.weight": f"{base}embed_tokens.weight", "final_norm.scale": f"{base}norm.weight",
           "out_head.weight": "lm_head.weight",
           "per_layer_inputs.embed.weight": f"{base}embed_tokens_per_layer.weight",
           "per_layer_inputs.proj.weight": f"{base}per_layer_model_projection.weight",
           "per_layer_inputs.norm.scale": f"{base}per_layer_projection_norm.weight"}
    model = _layout_meta_model(fields)
    fused: dict[str, _Stored | None] = {}
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if name in top:
            if name != "out_head.weight" or not fields["tie_weights"]:
                yield _Stored(top[name], name, shape)
            continue
        _, layer, rest = name.split(".", 2)  # trf_blocks.{i}.rest
        linear = model.trf_blocks[int(layer)].spec.attention == "gated_deltanet"
        ours, theirs = next((a, b) for a, b in (*(_LINEAR_NAMES if linear else ()), *rules)
                            if rest.startswith(a))
        hf = f"{base}layers.{layer}.{theirs}{rest[len(ours):]}"
        if linear and model_type in _FUSED_DELTANET and name.endswith("in_proj_qkv.weight"):
            fused.update(_fused_deltanet(model.trf_blocks[int(layer)].att,
                                         hf[:-len("in_proj_qkv.weight")],
                                         name[:-len("in_proj_qkv.weight")]))
        if name in fused:
            if fused[name] is not None:
                yield fused[name]
            continue
        dense_and_moe = model.trf_blocks[int(layer)].spec.mlp == "dense_and_moe"
        transform = (_gpt_oss_experts(name) if gpt_oss else
                     _fused_experts(name) if fused_experts or dense_and_moe else None)
        if transform is not None:
            stored = tuple(transform[1](torch.empty(shape, device="meta")).shape)
            yield _Stored(hf, name, stored, transform=transform)
        elif (fused_experts or gpt_oss or dense_and_moe) and name.endswith(
                ("experts.gate_up_proj", "experts.down_proj")):
            # (Gemma 4's experts exist only fused, as transformers' module holds them)
            yield _Stored(hf, name, shape)
        elif name.endswith("experts.gate_up_proj"):
            experts, rows, width = shape
            for e in range(experts):
                for half, proj in enumerate(("gate_proj", "up_proj")):
                    yield _Stored(f"{hf[:-len('gate_up_proj')]}{e}.{proj}.weight", name,
                                  (rows // 2, width), (e, half))
        elif name.endswith("experts.down_proj"):
            experts, inner, width = shape
            for e in range(experts):
                yield _Stored(f"{hf}"[:-len("down_proj")] + f"{e}.down_proj.weight", name,
                              (width, inner), (e, None))
        else:
            yield _Stored(hf, name, shape)


def _pack(stored: list[_Stored], raw: Mapping[str, Tensor],
          consume: bool = False) -> dict[str, Tensor]:
    """qkv's state dict from a folder's tensors ``raw`` (Hugging Face's names), experts
    stacked into their 3-D tensors (``consume``: each taken out of ``raw``, a dict)."""
    out: dict[str, Tensor] = {}
    pieces: dict[str, dict[tuple[int, int | None], Tensor]] = {}
    for st in stored:
        tensor = raw.pop(st.hf) if consume else raw[st.hf]  # type: ignore[attr-defined]
        if st.fused is not None:
            names, split, _ = st.fused
            out.update(zip((st.ours, *names), split(tensor), strict=True))
            continue
        if st.transform is not None:
            tensor = st.transform[0](tensor).contiguous()
        if st.piece is None:
            out[st.ours] = tensor
        else:
            pieces.setdefault(st.ours, {})[st.piece] = tensor
    for name in list(pieces):  # each expert's pieces let go once stacked
        parts = pieces.pop(name)
        experts = 1 + max(e for e, _ in parts)
        if name.endswith("gate_up_proj"):
            out[name] = torch.stack([torch.cat((parts[e, 0], parts[e, 1])) for e in
                                     range(experts)])
        else:  # down_proj: each expert's (d, I) transposed into qkv's (E, I, d)
            out[name] = torch.stack([parts[e, None].t() for e in range(experts)])
    return out


def _unpack(stored: list[_Stored], state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """:func:`_pack`'s inverse: qkv's state dict as a folder stores it."""
    out: dict[str, Tensor] = {}
    for st in stored:
        if st.fused is not None:
            names, _, fuse = st.fused
            out[st.hf] = fuse(tuple(state[n] for n in (st.ours, *names))).contiguous()
            continue
        tensor = state[st.ours]
        if st.transform is not None:
            tensor = st.transform[1](tensor).contiguous()
        elif st.piece is not None:
            e, half = st.piece
            tensor = tensor[e].t() if half is None else tensor[e].chunk(2)[half]
        out[st.hf] = tensor.contiguous()
    return out


def _has_layout(fields: Mapping[str, Any]) -> bool:
    return bool(fields.get("moe")) or bool(fields.get("layer_scalar")) or any(
        entry.get("attention", "mha") != "mha" for entry in fields.get("layout") or [])


def _names(fields: Mapping[str, Any], model_type: str | None = None
           ) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """``(Hugging Face name, qkv name, shape)`` of every tensor a model of ``fields``
    holds (in a folder of ``model_type``, see :func:`_layout_tensors`); ``lm_head`` only
    when untied."""
    if _has_layout(fields):
        yield from ((st.hf, st.ours, st.shape) for st in _layout_tensors(fields, model_type))
        return
    if fields.get("mlp", "gelu") not in ("swiglu", "geglu"):
        raise ValueError(f"mlp={show(fields.get('mlp', 'gelu'))}: GPT-2's weights are read by "
                         "qkv.models.hf_gpt2.read_weights, not here")
    V, d, H, L = (fields["vocab_size"], fields["emb_dim"], fields["n_heads"],
                  fields["n_layers"])
    hd = fields["head_dim"] or d // H
    kv = fields["n_kv_groups"] or H
    ff = fields["hidden_dim"] or 4 * d
    yield "model.embed_tokens.weight", "tok_emb.weight", (V, d)
    for i in range(L):
        hf, ours = f"model.layers.{i}", f"trf_blocks.{i}"
        if fields.get("pre_norms", True):
            yield f"{hf}.input_layernorm.weight", f"{ours}.norm1.scale", (d,)
        for theirs, name, rows in (("q_proj", "W_query", H * hd), ("k_proj", "W_key", kv * hd),
                                   ("v_proj", "W_value", kv * hd)):
            yield f"{hf}.self_attn.{theirs}.weight", f"{ours}.att.{name}.weight", (rows, d)
            if fields["qkv_bias"]:
                yield f"{hf}.self_attn.{theirs}.bias", f"{ours}.att.{name}.bias", (rows,)
        if fields["qk_norm"] and fields.get("qk_norm_full"):  # OLMo: over all heads
            yield f"{hf}.self_attn.q_norm.weight", f"{ours}.att.q_norm.norm.scale", (H * hd,)
            yield f"{hf}.self_attn.k_norm.weight", f"{ours}.att.k_norm.norm.scale", (kv * hd,)
        elif fields["qk_norm"]:
            yield f"{hf}.self_attn.q_norm.weight", f"{ours}.att.q_norm.scale", (hd,)
            yield f"{hf}.self_attn.k_norm.weight", f"{ours}.att.k_norm.scale", (hd,)
        yield f"{hf}.self_attn.o_proj.weight", f"{ours}.att.out_proj.weight", (d, H * hd)
        if fields["out_bias"]:
            yield f"{hf}.self_attn.o_proj.bias", f"{ours}.att.out_proj.bias", (d,)
        if not fields.get("pre_norms", True):  # OLMo: norms after the sub-layers only
            yield f"{hf}.post_attention_layernorm.weight", f"{ours}.post_norm1.scale", (d,)
        elif fields["post_norms"]:  # Gemma 3: a norm after attention, one before the MLP
            yield f"{hf}.post_attention_layernorm.weight", f"{ours}.post_norm1.scale", (d,)
            yield f"{hf}.pre_feedforward_layernorm.weight", f"{ours}.norm2.scale", (d,)
        else:
            yield f"{hf}.post_attention_layernorm.weight", f"{ours}.norm2.scale", (d,)
        for theirs, name, shape in (("gate_proj", "fc1", (ff, d)), ("up_proj", "fc2", (ff, d)),
                                    ("down_proj", "fc3", (d, ff))):
            yield f"{hf}.mlp.{theirs}.weight", f"{ours}.ff.{name}.weight", shape
            if fields["mlp_bias"]:
                yield f"{hf}.mlp.{theirs}.bias", f"{ours}.ff.{name}.bias", shape[:1]
        if fields["post_norms"]:
            yield f"{hf}.post_feedforward_layernorm.weight", f"{ours}.post_norm2.scale", (d,)
    yield "model.norm.weight", "final_norm.scale", (d,)
    if not fields["tie_weights"]:
        yield "lm_head.weight", "out_head.weight", (V, d)


def expected_tensors(fields: Mapping[str, Any], model_type: str | None = None
                     ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face name and shape of every tensor a folder of ``fields`` must hold
    (``lm_head.weight`` only when untied; a tied model's file may hold it too).
    ``model_type``: the folder's, where its storage differs from its family's causal-LM
    class (a "qwen3_5" folder's text model sits under ``model.language_model.``, a
    "qwen3_next" folder fuses its linear-attention projections); None: that class's."""
    return ((theirs, shape) for theirs, _, shape in _names(fields, model_type))


def _check_names(where: str, shapes: Mapping[str, tuple[int, ...]],
                 fields: Mapping[str, Any], ours: bool = False,
                 model_type: str | None = None,
                 fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """The expected names (Hugging Face's, or qkv's if ``ours``; a folder of
    ``model_type``, experts as ``fused_experts`` says: see :func:`_layout_tensors`) and
    shapes, after a one-line ``ValueError`` for a missing, unexpected or misshapen tensor
    in ``shapes``."""
    if ours and _has_layout(fields):  # experts: 3-D in qkv, stored otherwise
        expected = {name: tuple(t.shape) for name, t in
                    _layout_meta_model(fields).state_dict().items()
                    if name != "out_head.weight" or not fields["tie_weights"]}
    elif fused_experts:
        expected = {st.hf: st.shape for st in _layout_tensors(fields, model_type, True)}
    else:
        expected = {(q if ours else hf): shape for hf, q, shape in _names(fields, model_type)}
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise ValueError(f"{where}: missing {len(missing)} tensors, e.g. {missing[0]!r}")
    # A tied model's head is the embedding again; transformers saves it or not.
    head_name = "out_head.weight" if ours else "lm_head.weight"
    head = (fields["vocab_size"], fields["emb_dim"])
    extra = [k for k in shapes if k not in expected
             and not (k == head_name and tuple(shapes[k]) == head)]
    if extra:
        raise ValueError(f"{where}: {len(extra)} unexpected tensors for this config, e.g. "
                         f"{extra[0]!r} of shape {list(shapes[extra[0]])}")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: {name} has shape {list(shapes[name])}, expected "
                             f"{list(shape)} from {'the fields' if ours else HF_CONFIG}")
    return expected


def to_qkv(raw: Mapping[str, Tensor], fields: Mapping[str, Any],
           model_type: str | None = None, consume: bool = False) -> dict[str, Tensor]:
    """Hugging Face names (a folder of ``model_type``, see :func:`expected_tensors`) ->
    ``GPTModel``'s; the tensors themselves are unchanged (Gemma's norm weights stay
    ``w``), but for Qwen3-Next's fused projections, split. A tied model's
    ``out_head.weight`` is ``tok_emb.weight``.

    Experts come as a folder stores them (one tensor per expert, gpt-oss's fused) or, for
    the families that store them per expert, fused as transformers' modules hold them
    (``mlp.experts.gate_up_proj``, as qkv's, and ``mlp.experts.down_proj``, qkv's
    transposed). ``consume``: take each tensor out of ``raw`` (a dict) as it is converted,
    so that a tensor stored in another layout (gpt-oss's experts) and its converted copy
    are held together one at a time, not the whole model twice.
    """
    if consume and not isinstance(raw, dict):
        raise ValueError(f"to_qkv: consume=True takes a dict, got {type(raw).__name__}")
    gpt_oss = bool((fields.get("moe") or {}).get("expert_bias"))
    fused = _has_layout(fields) and not gpt_oss and any(
        k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) for k in raw)
    _check_names("state dict", {k: tuple(v.shape) for k, v in raw.items()}, fields,
                 model_type=model_type, fused_experts=fused)
    if _has_layout(fields):
        out = _pack(list(_layout_tensors(fields, model_type, fused)), raw, consume)
    else:
        take = raw.pop if consume else raw.__getitem__  # type: ignore[attr-defined]
        out = {ours: take(theirs) for theirs, ours, _ in _names(fields)}
    if fields["tie_weights"]:
        out["out_head.weight"] = out["tok_emb.weight"]
    return out


def from_qkv(state: Mapping[str, Tensor], fields: Mapping[str, Any],
             model_type: str | None = None, fused_experts: bool = False) -> dict[str, Tensor]:
    """``GPTModel``'s names -> Hugging Face's (a folder of ``model_type``), the inverse of
    :func:`to_qkv`; the tensors themselves are unchanged (Qwen3-Next's projections fused
    back). A tied model's ``out_head.weight`` (the embedding again) is left out, as
    transformers saves it; one that differs from the embedding is refused.
    ``fused_experts``: the experts as transformers' modules hold them, one 3-D tensor
    each (see :func:`_layout_tensors`), not one per expert as folders store them."""
    fields = _complete(fields)
    _check_names("state dict", {k: tuple(v.shape) for k, v in state.items()}, fields,
                 ours=True)
    head, emb = state.get("out_head.weight"), state["tok_emb.weight"]
    if fields["tie_weights"] and head is not None and head.data_ptr() != emb.data_ptr() \
            and not torch.equal(head, emb):
        raise ValueError("state dict: out_head.weight differs from tok_emb.weight, but "
                         "tie_weights=True says they are one matrix")
    if _has_layout(fields):
        return _unpack(list(_layout_tensors(fields, model_type, fused_experts)), state)
    return {theirs: state[ours] for theirs, ours, _ in _names(fields)}


def _inside(folder: Path, name: str) -> Path:
    """``folder / name``, refused unless it resolves to a regular file inside the folder.

    A Hugging Face cache snapshot (``models--owner--name/snapshots/<commit>``) is a
    folder of symlinks into ``../../blobs``: there the repository's cache folder is the
    bound.
    """
    root = folder.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        root = root.parent.parent
    path = folder / name
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a loop of symlinks
        raise ValueError(f"{path}: cannot be resolved ({error})") from None
    if not target.is_relative_to(root):
        raise ValueError(f"{path}: resolves to {target}, outside the model folder {root}")
    if not target.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not target.is_file():
        raise ValueError(f"{path}: not a regular file")
    return path


def _read_json(path: Path, what: str, max_bytes: int) -> dict[str, Any]:
    try:
        value = parse_json(read_regular(path, what, max_bytes))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {show(value)}")
    return value


def read_open_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The folder's ``config.json`` object (at most 1 MiB; one-line errors)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    return _read_json(_inside(folder, HF_CONFIG), "config", _MAX_CONFIG_BYTES)


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files holding the weights, and the index's tensor -> file map."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")

    def present(name: str) -> bool:  # a dangling link is there too, refused by _inside
        return (folder / name).exists() or (folder / name).is_symlink()

    if present(HF_SAFETENSORS):
        return [_inside(folder, HF_SAFETENSORS)], None
    if not present(WEIGHTS_INDEX):
        raise FileNotFoundError(f"{folder}: has neither {HF_SAFETENSORS} nor {WEIGHTS_INDEX}")
    path = _inside(folder, WEIGHTS_INDEX)
    weight_map = _read_json(path, "weights index", _MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path}: expected a non-empty 'weight_map' object, got "
                         f"{show(weight_map)}")
    for shard in weight_map.values():
        if not (isinstance(shard, str) and shard.endswith(".safetensors")
                and shard == Path(shard).name):
            raise ValueError(f"{path}: shard {show(shard)} must be a .safetensors file "
                             f"directly inside {folder}")
    return [_inside(folder, shard) for shard in sorted(set(weight_map.values()))], weight_map


def read_open_weights(
    folder: str | os.PathLike[str],
    fields: Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
    max_bytes: int | None = None,
    *,
    model_type: str | None = None,
) -> dict[str, Tensor]:
    """A ``GPTModel(GPTConfig(**fields))`` state dict (qkv names, ``dtype``) from the
    folder's ``model.safetensors`` or the shards its ``model.safetensors.index.json`` names.

    Before any tensor's data is read: every file must resolve inside the folder, every
    shard's header must hold exactly :func:`expected_tensors` (names, shapes; F32, F16
    or BF16 values; each in the shard the index names), and the state dict must fit in
    ``max_bytes`` bytes (in ``dtype``; ``None``: no bound). A tensor holding NaN or an
    infinity after conversion is refused too. Every error is one line.

    ``model_type`` is the folder's ``config.json``'s (None: the family's causal-LM class's
    storage, see :func:`expected_tensors`). A Qwen3.5 or Qwen3-Next folder may also hold
    tensors that are not the text model's (:data:`_UNREAD`: a vision tower,
    multi-token-prediction layers); those are left unread.
    """
    from safetensors import safe_open

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {show(dtype)}")
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 1)
    folder = Path(folder)
    files, weight_map = _weight_files(folder)

    def opened(path: Path) -> Any:
        try:
            with library_call():
                return safe_open(str(path), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types, or panics
            reason = " ".join(str(error).splitlines())
            raise ValueError(f"{path}: not a safetensors file ({reason})") from None

    @contextlib.contextmanager
    def reading(path: Path) -> Iterator[None]:
        """The library's failure (or panic) while reading ``path``, as one line."""
        try:
            with library_call():
                yield
        except (ValueError, MemoryError):  # qkv's own checks; the machine's memory
            raise
        except Exception as error:
            reason = " ".join(str(error).split())[:200]
            raise ValueError(f"{path}: cannot be read as safetensors ({type(error).__name__}: "
                             f"{reason})") from None

    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        with opened(path) as f, reading(path):
            for name in list(f.keys()):  # a safe_open handle has no __iter__
                if name in found:
                    raise ValueError(f"{path}: {name} is also in {found[name][0].name}")
                if weight_map is not None and weight_map.get(name) != path.name:
                    raise ValueError(f"{path}: holds {name}, which {WEIGHTS_INDEX} puts in "
                                     f"{show(weight_map.get(name))}")
                header = f.get_slice(name)
                found[name] = path, tuple(header.get_shape()), header.get_dtype()
    if weight_map is not None:
        absent = [name for name in weight_map if name not in found]
        if absent:
            raise ValueError(f"{folder / WEIGHTS_INDEX}: puts {absent[0]} in "
                             f"{weight_map[absent[0]]}, which does not hold it")
    unread = _UNREAD.get(model_type, ())
    expected = _check_names(str(folder), {k: v[1] for k, v in found.items()
                                          if not k.startswith(unread)}, fields,
                            model_type=model_type)
    for name in expected:
        path, _, stored = found[name]
        if stored not in _DTYPES:
            raise ValueError(f"{path}: {name} holds {stored} values; qkv reads F32, F16 "
                             "or BF16 weights")
    total = sum(math.prod(shape) for shape in expected.values()) * dtype.itemsize
    if max_bytes is not None and total > max_bytes:
        raise ValueError(f"{folder}: the weights take {total:,} bytes as {dtype}, more than "
                         f"the {max_bytes:,} allowed")
    raw: dict[str, Tensor] = {}
    for path in files:
        with opened(path) as f, reading(path):
            for name in expected:
                if found[name][0] != path:
                    continue
                tensor = f.get_tensor(name).to(dtype)
                if not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise ValueError(f"{path}: {name} holds {bad:,} NaN or infinite value(s) "
                                     f"of {tensor.numel():,} as {dtype}; the weights are "
                                     "damaged or do not fit the dtype")
                raw[name] = tensor
    return to_qkv(raw, fields, model_type, consume=True)


def write_hf_folder(
    folder: str | os.PathLike[str],
    fields: Mapping[str, Any],
    model_type: str,
    state_dict: Mapping[str, Tensor],
) -> Path:
    """Write a model as a Hugging Face folder: ``config.json`` (:func:`hf_config`) and
    ``model.safetensors`` (:func:`from_qkv` of ``state_dict``, a ``GPTModel``'s, in its
    dtypes: F32, F16 or BF16; a tied head once), which ``from_pretrained`` loads.

    ``folder`` must not exist, or be empty: nothing is overwritten. Everything is checked
    before a byte is written, and the files are written into a temporary folder beside it
    that is then renamed: ``folder`` appears whole or not at all. Returns ``folder``.
    """
    from safetensors.torch import save_file

    config = hf_config(fields, model_type)
    tensors = {k: v.detach().cpu().contiguous()
               for k, v in from_qkv(state_dict, fields, model_type).items()}
    dtypes = {v.dtype for v in tensors.values()}
    if not dtypes <= set(_DTYPES.values()):
        raise ValueError(f"state dict: holds {', '.join(sorted(map(str, dtypes)))} tensors; "
                         "Hugging Face folders hold float32, float16 or bfloat16 weights")
    if len(dtypes) == 1:  # what from_pretrained(dtype="auto") builds the model in
        config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    folder = Path(folder)
    if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()
                                    or any(folder.iterdir())):
        raise FileExistsError(f"{folder}: exists and is not an empty folder; name a new "
                              "one (nothing is overwritten)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(folder)
    tmp.mkdir()
    try:
        (tmp / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, tmp / HF_SAFETENSORS, metadata={"format": "pt"})
        for name in (HF_CONFIG, HF_SAFETENSORS):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        os.replace(tmp, folder)  # an empty folder is replaced; a non-empty one refuses
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(folder.parent)
    return folder
