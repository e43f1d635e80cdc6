"""Read a GGUF file (llama.cpp's format) as a Hugging Face model folder would give it.

A Hugging Face folder holds a ``config.json`` and tensors under Hugging Face's names; a
GGUF file holds the same model under llama.cpp's metadata keys, names and conventions.
This module turns the second into the first, so that one Hugging Face -> qkv mapping
serves both:

- :func:`gguf_config`: the ``config.json`` a Hugging Face folder of the model would hold
  (its keys as those files spell them: ``rope_theta``, ``rope_scaling``, ...);
- :func:`gguf_state_dict`: every tensor under its Hugging Face name (as transformers'
  modules hold it), with llama.cpp's conventions undone: the RoPE row order of
  ``attn_q``/``attn_k`` in ``llama`` and ``smollm3`` files, Gemma's norm weights stored
  as ``1 + w``, GPT-2's ``Conv1D`` weights stored transposed, experts split or
  transposed, DeepSeek's latent up-projection split in two.

Supported architectures (``general.architecture`` -> Hugging Face ``model_type``):

==============  ====================  ===================================================
``llama``       ``llama``             Llama, SmolLM2 and Mistral files (``mistral`` when
                                      ``general.name`` says Mistral)
``qwen2``       ``qwen2``
``qwen3``       ``qwen3``
``gemma3``      ``gemma3_text``
``gpt2``        ``gpt2``
``smollm3``     ``smollm3``           NoPE every 4th layer
``olmo2``       ``olmo3``             OLMo 2 and OLMo 3 files both say ``olmo2``
``gpt-oss``     ``gpt_oss``           experts MXFP4 in published files, dequantized here
``deepseek2``   ``deepseek_v3``       DeepSeek-V3/R1 (and Kimi K2) files
``deepseek32``  ``deepseek_v32``      DeepSeek-V3.2: ``deepseek2`` and a lightning indexer
``qwen3next``   ``qwen3_next``        Gated DeltaNet and gated attention, experts
``qwen35``      ``qwen3_5_text``      the same with a dense MLP (Qwen3.5's text model)
``qwen35moe``   ``qwen3_5_moe_text``  Qwen3.5-MoE's text model
``gemma4``      ``gemma4_text``       Gemma 4's text model
==============  ====================  ============================================
A ``deepseek2`` file with an indexer's metadata is refused: DeepSeek-V3.2's sparse
attention is llama.cpp's ``deepseek32`` architecture.

The configuration says what llama.cpp would run, which is not always what the original
``config.json`` said; llama.cpp's converter drops what its runtime does not use:

- ``llama`` files: no sliding window (llama.cpp runs Mistral v0.1 with full attention);
  ``model_type`` is ``"mistral"`` when ``general.name`` says Mistral, else ``"llama"``.
- ``gemma3`` files: llama.cpp fixes what the file does not say: every sixth layer is
  global (layer ``i`` is full iff ``(i + 1) % 6 == 0``) when the file has a sliding window,
  every layer otherwise; the sliding layers' RoPE base is 10000; the query scale is
  ``head_dim ** -0.5``, except for 62-layer models (Gemma 3 27B), where it is
  ``(hidden_size / num_attention_heads) ** -0.5`` (``query_pre_attn_scalar``).
- ``smollm3`` files: llama.cpp skips RoPE in every 4th layer (``(i + 1) % 4 == 0``); the
  file does not say which layers (SmolLM3's own ``no_rope_layer_interval``), and no
  layer has a window.
- ``olmo2`` files: with ``attention.sliding_window``, the layers the converter's
  ``attention.sliding_window_pattern`` marks (a flag per layer; a period ``p`` marks
  ``i % p < p - 1``; without it llama.cpp's period 4) attend within the window with
  plain RoPE (base ``rope.freq_base_swa``, else ``rope.freq_base``), the others with the
  file's RoPE scaling; without a window every layer is full (OLMo 2).
- ``gpt-oss`` files: sliding and full layers alternate, the first sliding; the clamped
  SwiGLU's limit is 7 (llama.cpp's constants); YaRN's correction range is rounded out
  to whole dimensions (``truncate``), as llama.cpp rounds it for every model (the
  original gpt-oss ``config.json`` says ``truncate: false``).
- ``deepseek2`` files: routing must be sigmoid (``expert_gating_func`` 2, DeepSeek-V3's;
  llama.cpp takes a file without it for DeepSeek-V2's softmax routing, which qkv does
  not compute); groups of experts only with ``expert_group_count`` (older files have
  none: no group limit); ``norm_topk_prob`` only with ``expert_weights_norm``; RoPE
  pairs interleaved; YaRN's ``mscale`` and ``mscale_all_dim`` both
  ``rope.scaling.yarn_log_multiplier / 0.1`` (the converter writes ``0.1 *
  mscale_all_dim``; llama.cpp takes ``mscale`` equal to it). MLA files (``attention.
  key_length_mla``, converters since 2025) hold the key and value up-projections
  ``attn_k_b`` ``(heads, kv_lora_rank, qk_nope_head_dim)`` and ``attn_v_b``; older files
  one ``attn_kv_b``; both read back as ``kv_b_proj``.
- ``deepseek32`` files: a ``deepseek2`` file (MLA form, ``attention.q_lora_rank``
  required: the indexer reads the query latent) plus ``attention.indexer.head_count``,
  ``key_length`` and ``top_k`` (``index_n_heads``, ``index_head_dim``, ``index_topk``)
  and each layer's ``indexer.attn_q_b``, ``attn_k``, ``k_norm`` (weight and bias) and
  ``proj``, stored as transformers holds them: llama.cpp's index heads are [rope | nope]
  with rotate-half RoPE, as qkv's :class:`~qkv.latent_attention.LightningIndexer`. The
  ``nextn_predict_layers`` blocks the converter appends (multi-token prediction) are
  left unread.
- ``qwen3next`` and ``qwen35`` files: layer ``i`` is full attention iff ``(i + 1) %
  full_attention_interval == 0`` (llama.cpp's default 4), the others Gated DeltaNet of
  the ``ssm.*`` sizes; ``rope.dimension_count`` turns part of each head (the partial
  RoPE factor); every norm but ``ssm_norm`` is stored as ``1 + w``, ``A_log`` as
  ``ssm_a = -exp(A_log)``; Qwen3-Next's ``attn_qkv`` and ``attn_gate`` (older files:
  ``ssm_in``) are fused back into the folder's ``in_proj_qkvz``, rows per key head;
  Qwen3.5's value heads, stored tiled over the key heads, are put back in the folder's
  grouped order. Qwen3-Next files have experts in every layer, renormalised (llama.cpp
  computes nothing else). The ``nextn_predict_layers`` blocks after the model's own
  (multi-token prediction) are left unread, as a folder's ``mtp.`` tensors are. Qwen3.5's
  ``rope.dimension_sections`` (multimodal RoPE) turn text tokens as plain RoPE does.
- ``gemma4`` files: norms stored as they are (``w``: Gemma 4 scales by ``w``, not ``1 +
  w``); ``attention.sliding_window_pattern`` flags the sliding layers;
  ``attention.key_length`` is the full layers' head size, ``key_length_swa`` the sliding
  ones'; ``attention.head_count_kv`` and ``feed_forward_length`` may be per layer (the
  full layers' key/value heads; the shared layers' doubled MLP); a full layer without
  ``attn_v`` takes its values from its keys (``attention_k_eq_v``); the last
  ``attention.shared_kv_layers`` layers have no ``attn_k``/``attn_v``; the full layers'
  proportional RoPE is the ``rope_freqs.weight`` tensor: 1 for each pair that turns,
  1e30 (a frequency divided down to nothing) for the rest; the router's scale is
  ``ffn_gate_inp.scale`` and the per-expert scale ``ffn_down_exps.scale``; the layer
  scalar ``layer_output_scale``.
- Llama 3's RoPE scaling (``rope_type`` ``"llama3"``) is stored as a ``rope_freqs.weight``
  tensor, not as metadata: per RoPE frequency, the divisor the scaling applies (its
  ``factor`` for the low frequencies, 1 for the high ones, a blend between).
  :func:`gguf_config` reads that small tensor and gives back the ``rope_scaling`` whose
  divisors it holds (:func:`llama3_scaling`); :func:`gguf_state_dict` leaves it out.
- ``tie_word_embeddings`` is True when the file has no ``output.weight``. GPT-2 files from
  older converters hold a copy of the embedding there: they come back untied, with
  ``lm_head.weight`` equal to ``transformer.wte.weight``.
- ``qwen2`` files get no ``attention_bias`` key (Hugging Face's Qwen2 always has a query,
  key and value bias and no output bias); ``olmo2`` files none either (OLMo has no
  biases); the other families get ``attention_bias = True`` iff the file has
  ``blk.0.attn_q.bias`` (and SmolLM3 ``mlp_bias`` iff it has ``blk.0.ffn_up.bias``).

Metadata that changes what a model computes and that qkv does not reproduce (a logit
scale, a clamp on the projections, ...: :data:`_NOT_COMPUTED`) is refused, naming the
key. Floats stored as float32 (``1e-5`` is ``9.99999974738e-06`` there) are given back as
the shortest decimal that rounds to the same float32 (``1e-05``), as ``config.json``
spells it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import MAX_SIZE, check_float, check_int, show
from ..linear_attention import fused_row_order
from ..positional import rope_frequencies
from ..utils.fileio import fsync_dir, temp_path
from .gguf_weights import (
    GGUFHeader,
    GGUFTensorInfo,
    check_tensor_budget,
    import_gguf,
    open_gguf_reader,
    permute_rope,
    read_gguf_blocks,
    read_gguf_header,
    read_gguf_tensors,
    unpermute_rope,
)
from .hf_open import config_fields, field_difference, from_qkv, hf_config, to_qkv
from .quantized import QuantizedWeight

__all__ = ["GGUF_ARCHITECTURES", "gguf_config", "gguf_state_dict", "llama3_scaling",
           "read_gguf_model", "write_gguf"]

# general.architecture -> Hugging Face's model_type
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                "gpt2": "gpt2", "smollm3": "smollm3", "olmo2": "olmo3", "gpt-oss": "gpt_oss",
                "deepseek2": "deepseek_v3", "deepseek32": "deepseek_v32",
                "qwen3next": "qwen3_next", "qwen35": "qwen3_5_text",
                "qwen35moe": "qwen3_5_moe_text", "gemma4": "gemma4_text"}
GGUF_ARCHITECTURES = tuple(_MODEL_TYPES)
# The hybrids of Gated DeltaNet and gated full attention (their model_types).
_HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# DeepSeek's architectures of latent attention: V3's, and V3.2's with the indexer.
_DEEPSEEK_ARCHES = ("deepseek2", "deepseek32")
_FULL_ATTENTION_EVERY = 4  # llama.cpp's full_attention_interval when a file gives none
# The model_types whose attn_q/attn_k rows llama.cpp's converter reorders for its RoPE
# (LlamaModel and its subclasses); the others are stored as Hugging Face holds them.
_PERMUTED = ("llama", "mistral", "smollm3")

_ROPE_BASE = 10000.0  # llama.cpp's rope.freq_base when a file has none
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62
_SMOLLM3_NOPE_EVERY = 4  # llama.cpp's n_no_rope_layer_step for smollm3
_OLMO2_SWA_PERIOD = 4  # llama.cpp's sliding pattern for olmo2 files that give none
_GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp's clamp in gpt-oss's SwiGLU
# llama.cpp's expert_gating_func codes; DeepSeek-V3 routes with sigmoid scores.
_GATING = {0: "none (llama.cpp reads softmax)", 1: "softmax", 2: "sigmoid"}
_SIGMOID = 2
# rope.scaling.* key -> the key of Hugging Face's rope_scaling ("type" and "factor" aside);
# "finetuned" says only how the model was trained. The converter writes YaRN's
# attention factor as yarn_attn_factor; older files as attn_factor.
_ROPE_SCALING_KEYS = {"original_context_length": "original_max_position_embeddings",
                      "attn_factor": "attention_factor", "yarn_attn_factor": "attention_factor",
                      "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
# DeepSeek's YaRN: the converter writes 0.1 * mscale_all_dim under this key.
_YARN_LOG_MUL = "yarn_log_multiplier"
# Metadata that changes what llama.cpp computes, which no config.json of these families
# says and qkv does not reproduce: refused when present (Gemma 3 reads its own softcap).
_NOT_COMPUTED = ("attention.clamp_kqv", "attention.scale", "attention.temperature_scale",
                 "logit_scale", "embedding_scale", "residual_scale",
                 "attn_logit_softcapping", "router_logit_softcapping", "swiglu_clamp_exp",
                 "swiglu_clamp_shexp", "expert_group_scale", "interleave_moe_layer_step",
                 "moe_every_n_layers", "final_logit_softcapping")
_ROPE_FREQS = "rope_freqs.weight"
# Every Llama 3.x (3.1: factor 8, 3.2: factor 32) scales RoPE with these.
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192
# llama.cpp's converter computes the divisors in float32 arithmetic: the fraction of each
# frequency kept (1 / divisor) comes out within 6e-7 of the exact value whatever the
# factor (the divisor itself is off by up to factor * 1e-7, relatively).
_ROPE_FREQS_ATOL = 2e-6


def _decimal(value: float) -> float:
    """A float32 value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the model in a GGUF file, from its header (and,
    in a ``llama`` file holding one, its ``rope_freqs.weight``: ``head_dim / 2`` floats,
    read once the header is checked).

    Args:
        header: :func:`~qkv.models.gguf_weights.read_gguf_header` of the file.

    Returns:
        ``model_type`` (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``,
        ``"gemma3_text"``, ``"gpt2"``, ``"smollm3"``, ``"olmo3"``, ``"gpt_oss"``,
        ``"deepseek_v3"``, ``"deepseek_v32"``, ``"qwen3_next"``, ``"qwen3_5_text"`` or
        ``"qwen3_5_moe_text"``) and the fields of that family's ``config.json`` that its
        reader (:func:`~qkv.models.hf_open.config_fields`) reads: for GPT-2
        ``vocab_size``, ``n_positions``, ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``
        (None: ``4 * n_embd``), ``layer_norm_epsilon``; for the others ``vocab_size``,
        ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
        ``max_position_embeddings``, ``rms_norm_eps``, RoPE (``rope_theta`` and
        ``rope_scaling``, None or ``{"rope_type", "factor", ...}``; OLMo's
        ``rope_parameters`` per layer type), ``tie_word_embeddings`` and each family's
        own: Gemma 3's ``sliding_window``, ``layer_types``, ``rope_local_base_freq``,
        ``query_pre_attn_scalar``, ``final_logit_softcapping``; SmolLM3's
        ``no_rope_layers``; OLMo 3's and gpt-oss's ``sliding_window`` and
        ``layer_types``; gpt-oss's experts (``num_local_experts``,
        ``num_experts_per_tok``, ``swiglu_limit``); DeepSeek-V3's latent attention
        (``kv_lora_rank``, ``q_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
        ``v_head_dim``, ``rope_interleave``) and routing (``n_routed_experts``,
        ``n_shared_experts``, ``moe_intermediate_size``, ``first_k_dense_replace``,
        ``routed_scaling_factor``, ``norm_topk_prob``, ``n_group``, ``topk_group``);
        the hybrids' ``partial_rotary_factor``, ``full_attention_interval``, ``linear_*``
        sizes and experts (``num_experts``, ``num_experts_per_tok``,
        ``moe_intermediate_size``, ``shared_expert_intermediate_size``).

    Raises:
        ValueError: one line naming the file and the key: an architecture other than
            :data:`GGUF_ARCHITECTURES`, a missing or out-of-range size, sizes that do not
            divide, a ``block_count`` beyond the file's tensors, partial rotary
            embeddings, unknown RoPE scaling keys, a ``rope_freqs`` tensor that is no
            llama3 scaling's (:func:`llama3_scaling`), metadata qkv does not compute
            (:data:`_NOT_COMPUTED`, DeepSeek-V2's softmax routing, sparse attention,
            scaled experts), linear-attention sizes that do not divide.
    """
    arch, meta, tensors, path = (header.architecture, header.config, header.tensors,
                                 header.path)
    if arch not in _MODEL_TYPES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    where = f"{path}: metadata {arch}."

    def integer(key: str, default: int | None = None, lo: int = 1) -> int:
        value = meta.get(key, default)
        if value is None:
            raise ValueError(f"{where}{key} is missing; a {arch} model needs it")
        return check_int(f"{where}{key}", value, lo, MAX_SIZE)

    def number(key: str, default: float | None = None) -> float:
        value = meta.get(key, default)
        if value is None:
            raise ValueError(f"{where}{key} is missing; a {arch} model needs it")
        return _decimal(check_float(f"{where}{key}", value, 0.0, lo_open=True))

    for key in _NOT_COMPUTED:
        if key in meta and not (arch in ("gemma3", "gemma4")
                                and key == "final_logit_softcapping"):
            raise ValueError(f"{where}{key} is {show(meta[key])}; qkv does not compute it "
                             f"(a {arch} model without it is read)")
    layers = integer("block_count")
    if layers > len(tensors):  # each layer has tensors: a lying count stops here
        raise ValueError(f"{where}block_count is {layers:,}, but the file holds only "
                         f"{len(tensors):,} tensors")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: has no tensor token_embd.weight (the token embedding)")
    vocab = tensors["token_embd.weight"].shape[0]
    if integer("vocab_size", vocab) != vocab:
        raise ValueError(f"{where}vocab_size is {meta['vocab_size']:,}, but "
                         f"token_embd.weight has {vocab:,} rows")
    hidden, heads = integer("embedding_length"), integer("attention.head_count")
    common = {"vocab_size": vocab, "tie_word_embeddings": "output.weight" not in tensors}
    if arch == "gpt2":
        inner = integer("feed_forward_length")
        if hidden % heads:
            raise ValueError(f"{where}embedding_length {hidden} is not a multiple of "
                             f"attention.head_count {heads}")
        return {"model_type": "gpt2", **common, "n_positions": integer("context_length"),
                "n_embd": hidden, "n_layer": layers, "n_head": heads,
                "n_inner": None if inner == 4 * hidden else inner,
                "layer_norm_epsilon": number("attention.layer_norm_epsilon"),
                "activation_function": "gelu_new"}
    rope = {"rope_theta": number("rope.freq_base", _ROPE_BASE),
            "rope_scaling": _rope_scaling(meta, where, arch in _DEEPSEEK_ARCHES)}
    shared = {"model_type": _MODEL_TYPES[arch], **common, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "max_position_embeddings": integer("context_length"),
              "rms_norm_eps": number("attention.layer_norm_rms_epsilon"), **rope,
              "hidden_act": "silu"}
    if arch in _DEEPSEEK_ARCHES:
        return _deepseek2_config(meta, shared, integer, number, where)
    if shared["model_type"] in _HYBRIDS:
        return _hybrid_config(meta, shared, integer, where)
    if arch == "gemma4":
        return _gemma4_config(header, shared, integer, number, where)

    kv_heads = integer("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ValueError(f"{where}attention.head_count {heads} is not a multiple of "
                         f"attention.head_count_kv {kv_heads}")
    if "attention.key_length" in meta:
        head_dim = integer("attention.key_length")
    elif "rope.dimension_count" in meta:  # llama's files: the rotary width is head_dim
        head_dim = integer("rope.dimension_count")
    elif hidden % heads:
        raise ValueError(f"{where}embedding_length {hidden} is not a multiple of "
                         f"attention.head_count {heads}, and no attention.key_length says "
                         "the heads' size")
    else:
        head_dim = hidden // heads
    for key in ("attention.value_length", "rope.dimension_count"):
        if integer(key, head_dim) != head_dim:
            raise ValueError(f"{where}{key} is {meta[key]}, not the heads' size {head_dim}; "
                             "qkv supports neither values of another size nor partial "
                             "rotary embeddings")
    config = {
        **shared, "intermediate_size": integer("feed_forward_length"),
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "sliding_window": None,
    }
    if arch == "llama" and _ROPE_FREQS in tensors:  # read now that the header is checked
        if config["rope_scaling"] is not None:
            raise ValueError(f"{where}rope.scaling.type is "
                             f"{config['rope_scaling']['rope_type']!r} and the file holds a "
                             f"{_ROPE_FREQS} tensor too: two RoPE scalings, qkv reads one")
        config["rope_scaling"] = llama3_scaling(header, head_dim, config["rope_theta"])
    if arch not in ("qwen2", "olmo2"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama" and "mistral" in str(header.general.get("name", "")).lower():
        config["model_type"] = "mistral"
    if arch == "gemma3":
        window = integer("attention.sliding_window", 0, lo=0)
        config.pop("hidden_act")
        config.update(
            hidden_activation="gelu_pytorch_tanh", sliding_window=window or None,
            layer_types=["sliding_attention" if window and (i + 1) % _GEMMA3_GLOBAL_EVERY
                         else "full_attention" for i in range(layers)],
            rope_local_base_freq=number("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE),
            query_pre_attn_scalar=(hidden // heads if layers == _GEMMA3_27B_LAYERS
                                   else head_dim),
            final_logit_softcapping=(number("final_logit_softcapping")
                                     if "final_logit_softcapping" in meta else None))
    if arch == "smollm3":
        config.update(no_rope_layers=[int((i + 1) % _SMOLLM3_NOPE_EVERY != 0)
                                      for i in range(layers)],
                      use_sliding_window=False, mlp_bias="blk.0.ffn_up.bias" in tensors)
    if arch == "olmo2":
        window = integer("attention.sliding_window", 0, lo=0)
        sliding = _sliding_layers(meta, layers, where) if window else [False] * layers
        full = {"rope_type": "default", **(config.pop("rope_scaling") or {}),
                "rope_theta": config.pop("rope_theta")}
        config.update(
            sliding_window=window or None,
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            rope_parameters={"full_attention": full, "sliding_attention": {
                "rope_type": "default",
                "rope_theta": number("rope.freq_base_swa", full["rope_theta"])}})
    if arch == "gpt-oss":
        config.update(
            intermediate_size=integer("expert_feed_forward_length"),
            sliding_window=integer("attention.sliding_window"),
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(layers)],
            num_local_experts=integer("expert_count"),
            num_experts_per_tok=integer("expert_used_count"),
            swiglu_limit=_GPT_OSS_SWIGLU_LIMIT)
    return config


# A rope_freqs divisor this large leaves its pair unturned (llama.cpp's converter writes
# 1e30 for the pairs Gemma 4's proportional RoPE does not turn).
_UNTURNED = 1e20


def _gemma4_config(header: GGUFHeader, shared: dict[str, Any], integer: Any, number: Any,
                   where: str) -> dict[str, Any]:
    """A ``gemma4`` file's ``config.json`` (``gemma4_text``): see the module docstring.
    Each full layer's head size and key/value heads are given as ``per_layer_config``."""
    meta, tensors = header.config, header.tensors
    layers, heads = shared["num_hidden_layers"], shared["num_attention_heads"]
    if shared["rope_scaling"] is not None:
        raise ValueError(f"{where}rope.scaling.type is {shared['rope_scaling']['rope_type']!r}"
                         "; a gemma4 model has none")

    def per_layer(key: str, default: int | None = None) -> list[int]:
        value = meta.get(key, default)
        if not isinstance(value, list):
            return [integer(key, default)] * layers
        if len(value) != layers:
            raise ValueError(f"{where}{key} lists {len(value)} values for {layers} layers")
        return [check_int(f"{where}{key}[{i}]", v, 1, MAX_SIZE) for i, v in enumerate(value)]

    key = "attention.sliding_window_pattern"
    if not isinstance(meta.get(key), list):
        raise ValueError(f"{where}{key} must flag each of the {layers} layers (true: "
                         f"sliding), got {show(meta.get(key))}")
    sliding = _sliding_layers(meta, layers, where)
    full_dim = integer("attention.key_length")
    swa_dim = integer("attention.key_length_swa", full_dim)
    for key, want in (("attention.value_length", full_dim),
                      ("attention.value_length_swa", swa_dim),
                      ("rope.dimension_count", full_dim),
                      ("rope.dimension_count_swa", swa_dim)):
        if integer(key, want) != want:
            raise ValueError(f"{where}{key} is {meta[key]}, not the heads' size {want}; qkv "
                             "supports neither values of another size nor a rotary width "
                             "other than rope_freqs says")
    kv = per_layer("attention.head_count_kv", heads)
    ffn = per_layer("feed_forward_length")
    n_shared = integer("attention.shared_kv_layers", 0, lo=0)
    if n_shared > layers:
        raise ValueError(f"{where}attention.shared_kv_layers ({n_shared}) exceeds "
                         f"block_count ({layers})")
    first_shared = layers - n_shared
    swa_kv = {kv[i] for i in range(layers) if sliding[i]}
    if len(swa_kv) > 1 or len(set(ffn[:first_shared])) > 1 or \
            len(set(ffn[first_shared:])) > 1:
        raise ValueError(f"{where}attention.head_count_kv and feed_forward_length: qkv reads "
                         "one value for the sliding layers' key/value heads and one MLP "
                         "width, doubled or not in the shared layers")
    width = ffn[0]
    double = bool(n_shared) and ffn[-1] != width
    if double and ffn[-1] != 2 * width:
        raise ValueError(f"{where}feed_forward_length is {ffn[-1]} in the shared layers; "
                         f"qkv reads {width} or twice it (use_double_wide_mlp)")
    # A full layer without attn_v takes its values from its keys (attention_k_eq_v).
    own_values = {f"blk.{i}.attn_v.weight" in tensors for i in range(first_shared)
                  if not sliding[i]}
    if len(own_values) > 1:
        raise ValueError(f"{header.path}: some full layers hold attn_v and others do not; "
                         "qkv reads values from the keys in every full layer or in none")
    window = integer("attention.sliding_window") if any(sliding) else None
    full_rope: dict[str, Any] = {"rope_type": "default",
                                 "rope_theta": number("rope.freq_base", _ROPE_BASE)}
    if _ROPE_FREQS in tensors:
        full_rope.update(rope_type="proportional", partial_rotary_factor=_proportional(
            header, full_dim))
    ple = integer("embedding_length_per_layer_input", 0, lo=0)
    config = {
        **{k: v for k, v in shared.items() if k not in ("rope_theta", "rope_scaling",
                                                         "hidden_act")},
        "hidden_activation": "gelu_pytorch_tanh", "intermediate_size": width,
        "num_key_value_heads": swa_kv.pop() if swa_kv else kv[0], "head_dim": swa_dim,
        "global_head_dim": full_dim, "attention_bias": False,
        "per_layer_config": {str(i): {"head_dim": full_dim, "num_key_value_heads": kv[i]}
                             for i in range(layers) if not sliding[i]},
        "attention_k_eq_v": own_values == {False}, "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": {"full_attention": full_rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": number("rope.freq_base_swa", _ROPE_BASE)}},
        "num_kv_shared_layers": n_shared, "use_double_wide_mlp": double,
        "hidden_size_per_layer_input": ple,
        "vocab_size_per_layer_input": (tensors["per_layer_token_embd.weight"].shape[0]
                                       if ple and "per_layer_token_embd.weight" in tensors
                                       else shared["vocab_size"]),
        "enable_moe_block": "expert_count" in meta,
        "final_logit_softcapping": (number("final_logit_softcapping")
                                    if "final_logit_softcapping" in meta else None)}
    if config["enable_moe_block"]:
        config.update(num_experts=integer("expert_count"),
                      top_k_experts=integer("expert_used_count"),
                      moe_intermediate_size=integer("expert_feed_forward_length"))
    return config


def _proportional(header: GGUFHeader, head_dim: int) -> float:
    """The ``partial_rotary_factor`` of Gemma 4's proportional RoPE from the file's
    ``rope_freqs.weight`` (``head_dim / 2`` divisors): 1 for each pair that turns, then
    1e30 for each that does not."""
    where = f"{header.path}: tensor {_ROPE_FREQS}"
    shape = header.tensors[_ROPE_FREQS].shape
    if shape != (head_dim // 2,):
        raise ValueError(f"{where} has shape {list(shape)}; full layers' heads of "
                         f"{head_dim} imply [{head_dim // 2}]")
    divisors = read_gguf_tensors(header.path, [_ROPE_FREQS], header=header)[_ROPE_FREQS]
    return _proportional_from_divisors(divisors, head_dim, where)


def _proportional_from_divisors(divisors: Tensor, head_dim: int, where: str) -> float:
    """:func:`_proportional` of the ``head_dim / 2`` divisors a ``rope_freqs`` holds."""
    turning = int((divisors == 1).sum())
    if not (bool((divisors[:turning] == 1).all()) and bool((divisors[turning:] > _UNTURNED)
                                                           .all())) or turning == 0:
        raise ValueError(f"{where} is not Gemma 4's proportional RoPE (1 for each pair "
                         "that turns, then 1e30 for the rest)")
    return 2 * turning / head_dim


def _sliding_layers(meta: Mapping[str, Any], layers: int, where: str) -> list[bool]:
    """Which layers attend within the window, from ``attention.sliding_window_pattern``
    as llama.cpp reads it: a flag per layer, or a period ``p`` (layer ``i`` slides iff
    ``i % p < p - 1``; 0: every layer), llama.cpp's 4 when the file gives none."""
    key = "attention.sliding_window_pattern"
    pattern = meta.get(key, _OLMO2_SWA_PERIOD)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"{where}{key} must flag each of the {layers} layers "
                             f"(true: sliding), got {show(pattern)}")
        return list(pattern)
    period = check_int(f"{where}{key}", pattern, 0, MAX_SIZE)
    return [period == 0 or i % period < period - 1 for i in range(layers)]


def _deepseek2_config(meta: Mapping[str, Any], shared: dict[str, Any], integer: Any,
                      number: Any, where: str) -> dict[str, Any]:
    """DeepSeek-V3's ``config.json`` from a ``deepseek2`` file's metadata, or
    DeepSeek-V3.2's from a ``deepseek32`` file's: latent attention's sizes, the experts
    and their routing, V3.2's indexer (``shared`` holds the sizes every family has, RoPE
    read)."""
    sparse = shared["model_type"] == "deepseek_v32"
    indexer = sorted(k for k in meta if k.startswith("attention.indexer."))
    if indexer and not sparse:
        raise ValueError(f"{where}{indexer[0]} says the model has DeepSeek's sparse "
                         "attention (DeepSeek-V3.2): such a model is a deepseek32 file, "
                         "not deepseek2")
    if sparse and "attention.key_length_mla" not in meta:
        # llama.cpp's deepseek32 graph runs the MLA form only (attn_k_b and attn_v_b)
        raise ValueError(f"{where}attention.key_length_mla is missing; a deepseek32 "
                         "model needs it (llama.cpp runs its latent attention as MLA)")
    gating = integer("expert_gating_func", 0, lo=0)
    if gating != _SIGMOID:
        raise ValueError(f"{where}expert_gating_func is {gating} "
                         f"({_GATING.get(gating, 'unknown')}); qkv reads DeepSeek-V3's "
                         f"sigmoid routing ({_SIGMOID}), not DeepSeek-V2's softmax routing")
    heads, rope_dim = shared["num_attention_heads"], integer("rope.dimension_count")
    kv_rank = integer("attention.kv_lora_rank")
    if "attention.key_length_mla" in meta:  # MLA files: attention over the latent
        qk, v = integer("attention.key_length_mla"), integer("attention.value_length_mla")
        for key, want in (("attention.key_length", kv_rank + rope_dim),
                          ("attention.value_length", kv_rank),
                          ("attention.head_count_kv", 1)):
            if integer(key, want) != want:
                raise ValueError(f"{where}{key} is {meta[key]}; latent attention of rank "
                                 f"{kv_rank} with {rope_dim} RoPE dimensions implies {want}")
    else:  # older files: the heads' sizes once decompressed
        qk, v = integer("attention.key_length"), integer("attention.value_length")
        if integer("attention.head_count_kv", heads) != heads:
            raise ValueError(f"{where}attention.head_count_kv is "
                             f"{meta['attention.head_count_kv']}; a file without "
                             f"attention.key_length_mla has {heads} (one per head)")
    if qk <= rope_dim:
        raise ValueError(f"{where}the heads' key size {qk} leaves no dimensions beside "
                         f"rope.dimension_count {rope_dim}")
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor"):
        if meta.get(key, 1.0) != 1.0:  # llama.cpp scales the softmax by its square too
            raise ValueError(f"{where}{key} is {show(meta[key])}; qkv reads DeepSeek's "
                             "YaRN without one (1)")
    experts = integer("expert_count")
    if sparse:
        # the indexer reads its queries from the query latent: llama.cpp's deepseek32
        # loader needs q_lora_rank too
        integer("attention.q_lora_rank")
        # llama.cpp's converter appends DeepSeek-V3.2's multi-token-prediction block
        # (a draft head the logits do not go through): not counted, left unread
        blocks = shared["num_hidden_layers"]
        drafts = integer("nextn_predict_layers", 0, lo=0)
        if drafts >= blocks:
            raise ValueError(f"{where}nextn_predict_layers is {drafts}, but block_count "
                             f"{blocks} leaves no layer for the model itself (at most "
                             "block_count - 1)")
        shared = {**shared, "num_hidden_layers": blocks - drafts,
                  "index_n_heads": integer("attention.indexer.head_count"),
                  "index_head_dim": integer("attention.indexer.key_length"),
                  "index_topk": integer("attention.indexer.top_k")}
    return {
        **shared, "intermediate_size": integer("feed_forward_length"),
        "num_key_value_heads": heads, "head_dim": rope_dim, "attention_bias": False,
        "kv_lora_rank": kv_rank,
        "q_lora_rank": (integer("attention.q_lora_rank")
                        if "attention.q_lora_rank" in meta else None),
        "qk_nope_head_dim": qk - rope_dim, "qk_rope_head_dim": rope_dim, "v_head_dim": v,
        "rope_interleave": True, "n_routed_experts": experts,
        "num_experts_per_tok": integer("expert_used_count"),
        "moe_intermediate_size": integer("expert_feed_forward_length"),
        "n_shared_experts": integer("expert_shared_count", 0, lo=0),
        "first_k_dense_replace": integer("leading_dense_block_count", 0, lo=0),
        "routed_scaling_factor": number("expert_weights_scale", 1.0),
        "norm_topk_prob": _flag(meta, "expert_weights_norm", where),
        "n_group": integer("expert_group_count", 1),
        "topk_group": integer("expert_group_used_count", 1),
    }


def _hybrid_config(meta: Mapping[str, Any], shared: dict[str, Any], integer: Any,
                   where: str) -> dict[str, Any]:
    """Qwen3-Next's or Qwen3.5's ``config.json`` from a ``qwen3next`` or ``qwen35`` file's
    metadata (``shared`` holds the sizes every family has, RoPE read).

    The linear-attention layers' sizes are llama.cpp's ``ssm.*`` keys: ``group_count``
    key heads of ``state_size``, ``time_step_rank`` value heads sharing ``inner_size``,
    a convolution of ``conv_kernel`` taps. Layer ``i`` is a full-attention one iff
    ``(i + 1) % full_attention_interval == 0`` (llama.cpp's only schedule for these
    files). ``rope.dimension_count`` is the rotated part of each head (the partial RoPE
    factor times ``key_length``). The last ``nextn_predict_layers`` blocks are the
    multi-token-prediction head, which the logits do not go through: not counted, and
    left unread. Qwen3-Next's and Qwen3.5-MoE's files have experts in every layer, their
    weights renormalised (llama.cpp computes nothing else for them)."""
    heads, blocks = shared["num_attention_heads"], shared["num_hidden_layers"]
    drafts = integer("nextn_predict_layers", 0, lo=0)
    if drafts >= blocks:
        raise ValueError(f"{where}nextn_predict_layers is {drafts}, but block_count {blocks} "
                         "leaves no layer for the model itself (at most block_count - 1)")
    kv_heads = integer("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ValueError(f"{where}attention.head_count {heads} is not a multiple of "
                         f"attention.head_count_kv {kv_heads}")
    head_dim = integer("attention.key_length")
    if integer("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{where}attention.value_length is {meta['attention.value_length']}, "
                         f"not attention.key_length {head_dim}; qkv's gated attention has "
                         "keys and values of one size")
    rotary = integer("rope.dimension_count", head_dim)
    if rotary > head_dim or rotary % 2:
        raise ValueError(f"{where}rope.dimension_count is {rotary}; qkv turns an even number "
                         f"of each head's attention.key_length {head_dim} dimensions")
    k_heads, v_heads = integer("ssm.group_count"), integer("ssm.time_step_rank")
    if v_heads % k_heads:
        raise ValueError(f"{where}ssm.time_step_rank {v_heads} (value heads) is not a "
                         f"multiple of ssm.group_count {k_heads} (key heads)")
    inner = integer("ssm.inner_size")
    if inner % v_heads:
        raise ValueError(f"{where}ssm.inner_size {inner} is not a multiple of "
                         f"ssm.time_step_rank {v_heads} (the value heads that share it)")
    config = {
        **shared, "num_hidden_layers": blocks - drafts, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "partial_rotary_factor": rotary / head_dim,
        "attention_bias": False,
        "full_attention_interval": integer("full_attention_interval", _FULL_ATTENTION_EVERY),
        "linear_conv_kernel_dim": integer("ssm.conv_kernel"),
        "linear_key_head_dim": integer("ssm.state_size"),
        "linear_value_head_dim": inner // v_heads,
        "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
    }
    if int(head_dim * config["partial_rotary_factor"]) != rotary:  # as transformers rounds
        raise ValueError(f"{where}rope.dimension_count {rotary} of attention.key_length "
                         f"{head_dim} is no factor transformers turns back into {rotary}")
    if shared["model_type"] == "qwen3_5_text":
        config["intermediate_size"] = integer("feed_forward_length")
        return config
    scale = meta.get("expert_weights_scale", 1.0)
    if scale != 1.0:
        raise ValueError(f"{where}expert_weights_scale is {show(scale)}; qkv reads "
                         "these experts unscaled (1)")
    moe = integer("expert_feed_forward_length")
    config.update(
        num_experts=integer("expert_count"), num_experts_per_tok=integer("expert_used_count"),
        moe_intermediate_size=moe,
        # llama.cpp: the shared expert is feed_forward_length wide when not said
        shared_expert_intermediate_size=integer("expert_shared_feed_forward_length",
                                                meta.get("feed_forward_length")))
    if shared["model_type"] == "qwen3_next":  # Qwen3.5-MoE's class has no such keys
        config.update(intermediate_size=integer("feed_forward_length", moe),
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return config


def _flag(meta: Mapping[str, Any], key: str, where: str) -> bool:
    value = meta.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{where}{key} must be a bool, got {show(value)}")
    return value


def _rope_scaling(meta: dict[str, Any], where: str,
                  deepseek: bool = False) -> dict[str, Any] | None:
    """Hugging Face's ``rope_scaling`` from the ``rope.scaling.*`` keys, as llama.cpp
    reads them: a factor without a type is linear; type "none" or a linear factor of 1
    is no scaling. ``deepseek``: YaRN's ``yarn_log_multiplier`` is read too (the
    converter's ``0.1 * mscale_all_dim``) and needed."""
    keys = {k.removeprefix("rope.scaling."): v for k, v in meta.items()
            if k.startswith("rope.scaling.") and k != "rope.scaling.finetuned"}
    kind = keys.pop("type", "linear")
    factor = keys.pop("factor", meta.get("rope.scale_linear"))  # its older name
    log_mul = keys.pop(_YARN_LOG_MUL, None) if deepseek else None
    unknown = sorted(set(keys) - set(_ROPE_SCALING_KEYS))
    if unknown:
        raise ValueError(f"{where}rope.scaling.{unknown[0]} is not understood by qkv (known: "
                         f"type, factor, {', '.join(_ROPE_SCALING_KEYS)}"
                         f"{', ' + _YARN_LOG_MUL if deepseek else ''})")
    if not isinstance(kind, str):
        raise ValueError(f"{where}rope.scaling.type must be a string, got {show(kind)}")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if factor is None:
        raise ValueError(f"{where}rope.scaling.type is {kind!r}, but rope.scaling.factor "
                         "is missing")
    scaling = {"rope_type": kind,
               "factor": _decimal(check_float(f"{where}rope.scaling.factor", factor, 0.0,
                                              lo_open=True))}
    for key, value in keys.items():
        scaling[_ROPE_SCALING_KEYS[key]] = value if isinstance(value, int) else _decimal(
            check_float(f"{where}rope.scaling.{key}", value))
    if deepseek and kind == "yarn":
        if log_mul is None:
            raise ValueError(f"{where}rope.scaling.{_YARN_LOG_MUL} is missing; DeepSeek's "
                             "YaRN needs it (0.1 * mscale_all_dim)")
        mscale = check_float(f"{where}rope.scaling.{_YARN_LOG_MUL}", log_mul, 0.0) / 0.1
        scaling["mscale"] = scaling["mscale_all_dim"] = _decimal(float(np.float32(mscale)))
    return scaling


def llama3_scaling(header: GGUFHeader, head_dim: int, rope_theta: float) -> dict[str, Any]:
    """The llama3 ``rope_scaling`` whose divisors a file's ``rope_freqs.weight`` holds.

    llama.cpp's converter stores Llama 3's RoPE scaling as, for each of the ``head_dim /
    2`` frequencies, the divisor the scaling applies to it: ``factor`` for wavelengths
    over ``original_max_position_embeddings / low_freq_factor``, 1 for those under
    ``original_max_position_embeddings / high_freq_factor``, a blend between. Only
    ``original / low`` and ``original / high`` shape the divisors, so ``low_freq_factor``
    is taken as 1 and ``high_freq_factor`` as 4, every Llama 3.x's (a file of another
    ratio is refused); ``factor`` is the largest divisor, and
    ``original_max_position_embeddings`` follows from a divisor in the blend (8192,
    Llama 3's, when none is). They are accepted only if
    :func:`~qkv.positional.rope_frequencies` gives every divisor back: the fraction of
    each frequency kept, ``1 / divisor``, within 2e-6 (float32 arithmetic's error).

    Args:
        header: the file's checked :func:`~qkv.models.gguf_weights.read_gguf_header`; the
            tensor (``head_dim / 2`` values) is read from ``header.path``.
        head_dim: the heads' size.
        rope_theta: the RoPE base.

    Returns:
        ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}``, as ``config.json`` holds it.

    Raises:
        ValueError: one line naming the file: the tensor is not of shape ``[head_dim /
            2]``, or no such llama3 scaling gives its divisors (their range is named).
    """
    where = f"{header.path}: tensor {_ROPE_FREQS}"
    shape = header.tensors[_ROPE_FREQS].shape
    if shape != (head_dim // 2,):
        raise ValueError(f"{where} has shape {list(shape)}; heads of {head_dim} imply "
                         f"[{head_dim // 2}]")
    divisors = read_gguf_tensors(header.path, [_ROPE_FREQS], header=header)[_ROPE_FREQS]
    return _llama3_from_divisors(divisors, head_dim, rope_theta, where)


def _llama3_from_divisors(divisors: Tensor, head_dim: int, rope_theta: float,
                          where: str) -> dict[str, Any]:
    """:func:`llama3_scaling` of the ``head_dim / 2`` divisors a ``rope_freqs`` holds."""
    divisors = divisors.double()
    factor = _decimal(float(divisors.max()))
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    inv_freq = rope_frequencies(head_dim, rope_theta)
    # A divisor d in the blend, at wavelength w: 1 / d = (1 - s) / factor + s, where
    # s = (original / w - low) / (high - low), which gives original.
    original = _LLAMA3_ORIGINAL
    blend = ((divisors > 1) & (divisors < factor)).nonzero().flatten()
    if len(blend):
        i = int(blend[0])
        s = (1 / float(divisors[i]) - 1 / factor) / (1 - 1 / factor)
        original = round(2 * math.pi / float(inv_freq[i]) * (low + s * (high - low)))
    if factor > 0 and 1 <= original <= MAX_SIZE:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": original}
        kept = rope_frequencies(head_dim, rope_theta, scaling) / inv_freq
        if float((kept - 1 / divisors).abs().max()) <= _ROPE_FREQS_ATOL:
            return scaling
    raise ValueError(f"{where} holds RoPE divisors from {float(divisors.min()):.7g} to "
                     f"{float(divisors.max()):.7g} that no llama3 scaling gives (qkv reads "
                     f"Llama 3.x's: low_freq_factor {low:g}, high_freq_factor {high:g}; tried "
                     f"factor {factor:.7g}, original_max_position_embeddings {original})")


def _plan(config: dict[str, Any],
          stored: Container[str] = ()) -> dict[str, tuple[str, tuple[int, ...]]]:
    """llama.cpp's tensor name -> (Hugging Face's name, the shape the GGUF file holds,
    PyTorch's order), every tensor the configuration implies, in llama.cpp's order.

    Two llama.cpp tensors may make one Hugging Face tensor (gate and up experts,
    DeepSeek's key and value up-projections): both then name it. Where llama.cpp writes
    a tensor in two forms, ``stored`` (the file's tensor names) picks the one the file
    has: DeepSeek's ``attn_kv_b`` (older files) or ``attn_k_b`` and ``attn_v_b``; the
    experts' ``ffn_gate_up_exps`` (``--fuse-gate-up-exps``) or ``ffn_gate_exps`` and
    ``ffn_up_exps``."""
    vocab, model_type = config["vocab_size"], config["model_type"]
    if model_type == "gpt2":
        d = config["n_embd"]
        f = config["n_inner"] or 4 * d  # None: 4 * n_embd, as in config.json
        plan = {"token_embd.weight": ("transformer.wte.weight", (vocab, d)),
                "position_embd.weight": ("transformer.wpe.weight", (config["n_positions"], d)),
                "output_norm.weight": ("transformer.ln_f.weight", (d,)),
                "output_norm.bias": ("transformer.ln_f.bias", (d,))}
        # llama.cpp name -> (Hugging Face name, rows, columns; None: a norm's vector);
        # every one has a bias of its rows.
        block = {"attn_norm": ("ln_1", d, None), "attn_qkv": ("attn.c_attn", 3 * d, d),
                 "attn_output": ("attn.c_proj", d, d), "ffn_norm": ("ln_2", d, None),
                 "ffn_up": ("mlp.c_fc", f, d), "ffn_down": ("mlp.c_proj", d, f)}
        for i in range(config["n_layer"]):
            for name, (hf, rows, cols) in block.items():
                hf = f"transformer.h.{i}.{hf}"
                plan[f"blk.{i}.{name}.weight"] = (f"{hf}.weight",
                                                  (rows,) if cols is None else (rows, cols))
                plan[f"blk.{i}.{name}.bias"] = (f"{hf}.bias", (rows,))
    else:
        d = config["hidden_size"]
        plan = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, d)),
                "output_norm.weight": ("model.norm.weight", (d,))}
        for i in range(config["num_hidden_layers"]):
            for name, (hf, shape) in _block(config, i, stored).items():
                plan[f"blk.{i}.{name}"] = (f"model.layers.{i}.{hf}", shape)
        width = config.get("hidden_size_per_layer_input") if model_type == "gemma4_text" \
            else None
        if width:  # Gemma 4's per-layer inputs
            rows = config["num_hidden_layers"] * width
            plan.update({
                "per_layer_token_embd.weight": ("model.embed_tokens_per_layer.weight",
                                                (config["vocab_size_per_layer_input"], rows)),
                "per_layer_model_proj.weight": ("model.per_layer_model_projection.weight",
                                                (rows, d)),
                "per_layer_proj_norm.weight": ("model.per_layer_projection_norm.weight",
                                               (width,))})
    if not config["tie_word_embeddings"]:
        plan["output.weight"] = ("lm_head.weight", (vocab, plan["token_embd.weight"][1][1]))
    return plan


def _block(config: dict[str, Any], i: int,
           stored: Container[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Layer ``i``'s tensors, as :func:`_plan` gives them, names after ``blk.{i}.`` and
    ``model.layers.{i}.``."""
    model_type, d = config["model_type"], config["hidden_size"]
    if model_type in ("deepseek_v3", "deepseek_v32"):
        return _deepseek_block(config, i, stored)
    if model_type in _HYBRIDS:
        return _hybrid_block(config, i, stored)
    if model_type == "gemma4_text":
        return _gemma4_block(config, i, stored)
    f, hd = config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    block = {} if model_type == "olmo3" else {
        "attn_norm.weight": ("input_layernorm.weight", (d,))}
    block.update({"attn_q.weight": ("self_attn.q_proj.weight", (q, d)),
                  "attn_k.weight": ("self_attn.k_proj.weight", (kv, d)),
                  "attn_v.weight": ("self_attn.v_proj.weight", (kv, d)),
                  "attn_output.weight": ("self_attn.o_proj.weight", (d, q))})
    if model_type == "qwen2" or config.get("attention_bias", False):  # Mistral: none
        block["attn_q.bias"] = ("self_attn.q_proj.bias", (q,))
        block["attn_k.bias"] = ("self_attn.k_proj.bias", (kv,))
        block["attn_v.bias"] = ("self_attn.v_proj.bias", (kv,))
    if model_type != "qwen2" and config.get("attention_bias", False):
        block["attn_output.bias"] = ("self_attn.o_proj.bias", (d,))
    if model_type in ("qwen3", "gemma3_text"):
        block["attn_q_norm.weight"] = ("self_attn.q_norm.weight", (hd,))
        block["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (hd,))
    if model_type == "olmo3":  # over all heads at once
        block["attn_q_norm.weight"] = ("self_attn.q_norm.weight", (q,))
        block["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (kv,))
    if model_type == "gpt_oss":
        block["attn_sinks.weight"] = ("self_attn.sinks", (config["num_attention_heads"],))
    if model_type in ("gemma3_text", "olmo3", "gpt_oss"):
        block["post_attention_norm.weight"] = ("post_attention_layernorm.weight", (d,))
    if model_type == "gemma3_text":
        block["ffn_norm.weight"] = ("pre_feedforward_layernorm.weight", (d,))
    elif model_type not in ("olmo3", "gpt_oss"):
        block["ffn_norm.weight"] = ("post_attention_layernorm.weight", (d,))
    if model_type == "gpt_oss":
        block.update(_experts(config, i, stored, f))
        return block
    block.update({"ffn_gate.weight": ("mlp.gate_proj.weight", (f, d)),
                  "ffn_up.weight": ("mlp.up_proj.weight", (f, d)),
                  "ffn_down.weight": ("mlp.down_proj.weight", (d, f))})
    if config.get("mlp_bias", False):  # SmolLM3
        block.update({"ffn_gate.bias": ("mlp.gate_proj.bias", (f,)),
                      "ffn_up.bias": ("mlp.up_proj.bias", (f,)),
                      "ffn_down.bias": ("mlp.down_proj.bias", (d,))})
    if model_type in ("gemma3_text", "olmo3"):
        block["post_ffw_norm.weight"] = ("post_feedforward_layernorm.weight", (d,))
    return block


def _gemma4_block(config: dict[str, Any], i: int,
                  stored: Container[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A Gemma 4 layer's tensors: attention (none of its own keys and values in a shared
    layer, no values in a full layer with ``attention_k_eq_v``), the dense MLP, the
    experts beside it, the per-layer input's gate and the layer scalar."""
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    full = config["layer_types"][i] == "full_attention"
    heads = config["per_layer_config"].get(str(i), {})
    hd = heads.get("head_dim", config["head_dim"])
    kv = heads.get("num_key_value_heads", config["num_key_value_heads"]) * hd
    q = config["num_attention_heads"] * hd
    shared = i >= layers - config["num_kv_shared_layers"]
    block = {"attn_norm.weight": ("input_layernorm.weight", (d,)),
             "attn_q.weight": ("self_attn.q_proj.weight", (q, d)),
             "attn_q_norm.weight": ("self_attn.q_norm.weight", (hd,))}
    if not shared:
        block["attn_k.weight"] = ("self_attn.k_proj.weight", (kv, d))
        block["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (hd,))
        if not (full and config["attention_k_eq_v"]):
            block["attn_v.weight"] = ("self_attn.v_proj.weight", (kv, d))
    f = config["intermediate_size"] * (2 if shared and config["use_double_wide_mlp"] else 1)
    block.update({"attn_output.weight": ("self_attn.o_proj.weight", (d, q)),
                  "post_attention_norm.weight": ("post_attention_layernorm.weight", (d,)),
                  "ffn_norm.weight": ("pre_feedforward_layernorm.weight", (d,)),
                  "ffn_gate.weight": ("mlp.gate_proj.weight", (f, d)),
                  "ffn_up.weight": ("mlp.up_proj.weight", (f, d)),
                  "ffn_down.weight": ("mlp.down_proj.weight", (d, f)),
                  "post_ffw_norm.weight": ("post_feedforward_layernorm.weight", (d,))})
    if config["enable_moe_block"]:
        e, m = config["num_experts"], config["moe_intermediate_size"]
        block.update({"ffn_gate_inp.weight": ("router.proj.weight", (e, d)),
                      "ffn_gate_inp.scale": ("router.scale", (d,)),
                      "ffn_down_exps.scale": ("router.per_expert_scale", (e,))})
        if f"blk.{i}.ffn_gate_up_exps.weight" in stored:
            block["ffn_gate_up_exps.weight"] = ("experts.gate_up_proj", (e, 2 * m, d))
        else:
            block["ffn_gate_exps.weight"] = ("experts.gate_up_proj", (e, m, d))
            block["ffn_up_exps.weight"] = ("experts.gate_up_proj", (e, m, d))
        block.update({"ffn_down_exps.weight": ("experts.down_proj", (e, d, m)),
                      "pre_ffw_norm_2.weight": ("pre_feedforward_layernorm_2.weight", (d,)),
                      "post_ffw_norm_1.weight": ("post_feedforward_layernorm_1.weight", (d,)),
                      "post_ffw_norm_2.weight": ("post_feedforward_layernorm_2.weight",
                                                 (d,))})
    width = config["hidden_size_per_layer_input"]
    if width:
        block.update({"inp_gate.weight": ("per_layer_input_gate.weight", (width, d)),
                      "proj.weight": ("per_layer_projection.weight", (d, width)),
                      "post_norm.weight": ("post_per_layer_input_norm.weight", (d,))})
    block["layer_output_scale.weight"] = ("layer_scalar", (1,))
    return block


def _deepseek_block(config: dict[str, Any], i: int,
                    stored: Container[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A DeepSeek-V3 or V3.2 layer's tensors: latent attention (V3.2's with its lightning
    indexer), then a dense MLP (the first ``first_k_dense_replace`` layers) or routed and
    shared experts."""
    d, heads = config["hidden_size"], config["num_attention_heads"]
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v, q_rank = config["qk_nope_head_dim"], config["v_head_dim"], config["q_lora_rank"]
    block = {"attn_norm.weight": ("input_layernorm.weight", (d,))}
    if q_rank is None:
        block["attn_q.weight"] = ("self_attn.q_proj.weight", (heads * (nope + rope), d))
    else:
        block.update({"attn_q_a.weight": ("self_attn.q_a_proj.weight", (q_rank, d)),
                      "attn_q_a_norm.weight": ("self_attn.q_a_layernorm.weight", (q_rank,)),
                      "attn_q_b.weight": ("self_attn.q_b_proj.weight",
                                          (heads * (nope + rope), q_rank))})
    block.update({"attn_kv_a_mqa.weight": ("self_attn.kv_a_proj_with_mqa.weight",
                                           (rank + rope, d)),
                  "attn_kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight", (rank,))})
    kv_b = "self_attn.kv_b_proj.weight"
    if f"blk.{i}.attn_kv_b.weight" in stored:
        block["attn_kv_b.weight"] = (kv_b, (heads * (nope + v), rank))
    else:  # split for the absorbed form: the key's part transposed
        block["attn_k_b.weight"] = (kv_b, (heads, rank, nope))
        block["attn_v_b.weight"] = (kv_b, (heads, v, rank))
    block["attn_output.weight"] = ("self_attn.o_proj.weight", (d, heads * v))
    if config["model_type"] == "deepseek_v32":  # stored as transformers holds them
        ix, ix_heads, ix_dim = ("self_attn.indexer.", config["index_n_heads"],
                                config["index_head_dim"])
        block.update({"indexer.attn_q_b.weight": (ix + "wq_b.weight",
                                                  (ix_heads * ix_dim, q_rank)),
                      "indexer.attn_k.weight": (ix + "wk.weight", (ix_dim, d)),
                      "indexer.k_norm.weight": (ix + "k_norm.weight", (ix_dim,)),
                      "indexer.k_norm.bias": (ix + "k_norm.bias", (ix_dim,)),
                      "indexer.proj.weight": (ix + "weights_proj.weight", (ix_heads, d))})
    block["ffn_norm.weight"] = ("post_attention_layernorm.weight", (d,))
    if i < config["first_k_dense_replace"]:
        f = config["intermediate_size"]
        block.update({"ffn_gate.weight": ("mlp.gate_proj.weight", (f, d)),
                      "ffn_up.weight": ("mlp.up_proj.weight", (f, d)),
                      "ffn_down.weight": ("mlp.down_proj.weight", (d, f))})
        return block
    block["exp_probs_b.bias"] = ("mlp.gate.e_score_correction_bias",
                                 (config["n_routed_experts"],))
    block.update(_experts(config, i, stored, config["moe_intermediate_size"]))
    shared = config["n_shared_experts"] * config["moe_intermediate_size"]
    if shared:
        block.update({"ffn_gate_shexp.weight": ("mlp.shared_experts.gate_proj.weight",
                                                (shared, d)),
                      "ffn_up_shexp.weight": ("mlp.shared_experts.up_proj.weight",
                                              (shared, d)),
                      "ffn_down_shexp.weight": ("mlp.shared_experts.down_proj.weight",
                                                (d, shared))})
    return block


def _hybrid_block(config: dict[str, Any], i: int,
                  stored: Container[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A Qwen3-Next or Qwen3.5 layer's tensors: gated full attention (queries and their
    gates in one ``attn_q``) or Gated DeltaNet (llama.cpp's ``ssm_*`` names), then a dense
    MLP (Qwen3.5) or experts with a gated shared expert (Qwen3-Next).

    Qwen3-Next files hold its linear attention's queries, keys and values as
    ``attn_qkv`` and its ``z`` as ``attn_gate`` (older ones the folder's fused rows as
    ``ssm_in``), both read back into the folder's ``in_proj_qkvz``; ``ssm_ba`` is the
    folder's ``in_proj_ba``. Qwen3.5 files split ``b`` and ``a`` (``ssm_beta``,
    ``ssm_alpha``)."""
    d, hd, heads = config["hidden_size"], config["head_dim"], config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    block = {"attn_norm.weight": ("input_layernorm.weight", (d,)),
             "post_attention_norm.weight": ("post_attention_layernorm.weight", (d,))}
    if (i + 1) % config["full_attention_interval"] == 0:
        block.update({"attn_q.weight": ("self_attn.q_proj.weight", (2 * heads * hd, d)),
                      "attn_k.weight": ("self_attn.k_proj.weight", (kv, d)),
                      "attn_v.weight": ("self_attn.v_proj.weight", (kv, d)),
                      "attn_output.weight": ("self_attn.o_proj.weight", (d, heads * hd)),
                      "attn_q_norm.weight": ("self_attn.q_norm.weight", (hd,)),
                      "attn_k_norm.weight": ("self_attn.k_norm.weight", (hd,))})
    else:
        v_heads = config["linear_num_value_heads"]
        keys = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        values = v_heads * config["linear_value_head_dim"]
        conv = 2 * keys + values
        att = "linear_attn."
        if config["model_type"] == "qwen3_next":
            qkvz = att + "in_proj_qkvz.weight"
            if f"blk.{i}.ssm_in.weight" in stored:
                block["ssm_in.weight"] = (qkvz, (conv + values, d))
            else:
                block["attn_qkv.weight"] = (qkvz, (conv, d))
                block["attn_gate.weight"] = (qkvz, (values, d))
            block["ssm_ba.weight"] = (att + "in_proj_ba.weight", (2 * v_heads, d))
        else:
            block.update({"attn_qkv.weight": (att + "in_proj_qkv.weight", (conv, d)),
                          "attn_gate.weight": (att + "in_proj_z.weight", (values, d)),
                          "ssm_beta.weight": (att + "in_proj_b.weight", (v_heads, d)),
                          "ssm_alpha.weight": (att + "in_proj_a.weight", (v_heads, d))})
        block.update({
            "ssm_conv1d.weight": (att + "conv1d.weight", (conv, config["linear_conv_kernel_dim"])),
            "ssm_dt.bias": (att + "dt_bias", (v_heads,)),
            "ssm_a": (att + "A_log", (v_heads,)),
            "ssm_norm.weight": (att + "norm.weight", (config["linear_value_head_dim"],)),
            "ssm_out.weight": (att + "out_proj.weight", (d, values))})
    if config["model_type"] == "qwen3_5_text":
        f = config["intermediate_size"]
        block.update({"ffn_gate.weight": ("mlp.gate_proj.weight", (f, d)),
                      "ffn_up.weight": ("mlp.up_proj.weight", (f, d)),
                      "ffn_down.weight": ("mlp.down_proj.weight", (d, f))})
        return block
    block.update(_experts(config, i, stored, config["moe_intermediate_size"]))
    s = config["shared_expert_intermediate_size"]
    # The shared expert's gate, one row: the converter writes it as the folder holds it,
    # (1, d); llama.cpp reads a vector (d,) as well.
    gate = f"blk.{i}.ffn_gate_inp_shexp.weight"
    vector = isinstance(stored, Mapping) and getattr(stored.get(gate), "shape", None) == (d,)
    block.update({
        "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight",
                                      (d,) if vector else (1, d)),
        "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", (s, d)),
        "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", (s, d)),
        "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", (d, s))})
    return block


def _experts(config: dict[str, Any], i: int, stored: Container[str],
             f: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A layer's router and routed experts of ``f`` hidden units each: llama.cpp's 3-D
    ``ffn_*_exps`` tensors ``(experts, rows, columns)``, as transformers' modules hold
    them fused (gpt-oss's router and experts have biases)."""
    d, gpt_oss = config["hidden_size"], config["model_type"] == "gpt_oss"
    e = config["num_local_experts" if gpt_oss else "num_experts"
               if config["model_type"] in _HYBRIDS else "n_routed_experts"]
    router = "mlp.router" if gpt_oss else "mlp.gate"
    block = {"ffn_gate_inp.weight": (f"{router}.weight", (e, d))}
    if gpt_oss:
        block["ffn_gate_inp.bias"] = (f"{router}.bias", (e,))
    biases = ("weight", "bias") if gpt_oss else ("weight",)
    for kind in biases:
        hf = "mlp.experts.gate_up_proj" + ("_bias" if kind == "bias" else "")
        shape = (e, f, d) if kind == "weight" else (e, f)
        if f"blk.{i}.ffn_gate_up_exps.weight" in stored:  # gate rows, then up rows
            block[f"ffn_gate_up_exps.{kind}"] = (hf, (e, 2 * f, *shape[2:]))
        else:
            block[f"ffn_gate_exps.{kind}"] = (hf, shape)
            block[f"ffn_up_exps.{kind}"] = (hf, shape)
    block["ffn_down_exps.weight"] = ("mlp.experts.down_proj", (e, d, f))
    if gpt_oss:
        block["ffn_down_exps.bias"] = ("mlp.experts.down_proj_bias", (e, d))
    return block


def _kept_out(config: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensors a file of this configuration holds that the configuration stands for:
    llama3 RoPE scaling's ``rope_freqs``, in :func:`_plan`'s form."""
    scaling = config.get("rope_scaling") or {}
    if config["model_type"] in ("llama", "mistral") and scaling.get("rope_type") == "llama3":
        return {_ROPE_FREQS: ("rope_scaling (llama3)", (config["head_dim"] // 2,))}
    if config["model_type"] == "gemma4_text" and \
            config["rope_parameters"]["full_attention"]["rope_type"] == "proportional":
        return {_ROPE_FREQS: ("proportional RoPE", (config["global_head_dim"] // 2,))}
    return {}


def _check_tensors(header: GGUFHeader, plan: dict[str, tuple[str, tuple[int, ...]]],
                   model_type: str) -> None:
    """The header lists exactly the planned tensors, each of its planned shape."""
    for name, (hf_name, shape) in plan.items():
        info = header.tensors.get(name)
        if info is None:
            raise ValueError(f"{header.path}: has no tensor {name}, which its metadata "
                             f"implies ({hf_name} of a {model_type} model)")
        if info.shape != shape:
            raise ValueError(f"{header.path}: tensor {name} has shape {list(info.shape)}; "
                             f"its metadata implies {list(shape)}")
    extra = [name for name in header.tensors if name not in plan
             and not _draft_block(header, name)]
    if extra:
        raise ValueError(f"{header.path}: tensor {extra[0]} is not part of a {model_type} "
                         f"model of its metadata ({len(extra)} such tensor(s))")


def _draft_block(header: GGUFHeader, name: str) -> bool:
    """Whether ``name`` is a tensor of the multi-token-prediction blocks a Qwen3.5 or
    DeepSeek-V3.2 file holds after the model's own (``nextn_predict_layers`` of them,
    left unread)."""
    drafts = header.config.get("nextn_predict_layers", 0)
    blocks = header.config.get("block_count", 0)
    parts = name.split(".")
    return (header.architecture in ("qwen3next", "qwen35", "qwen35moe", "deepseek32")
            and isinstance(drafts, int)
            and isinstance(blocks, int) and len(parts) > 2 and parts[0] == "blk"
            and parts[1].isdecimal() and blocks - drafts <= int(parts[1]) < blocks)


def _shifted(model_type: str, name: str) -> bool:
    """Whether llama.cpp stored this tensor as ``1 + w``: Gemma's norms, and Qwen3-Next's
    and Qwen3.5's zero-centred ones (all but the linear attention's gated norm, whose
    weight multiplies as it is)."""
    if model_type in _HYBRIDS:
        return name.endswith("norm.weight") and not name.endswith("ssm_norm.weight")
    return model_type == "gemma3_text" and name.endswith("norm.weight")


def _exact(model_type: str, name: str) -> bool:
    """Whether this tensor is converted in float32 before rounding to the asked dtype:
    the shifted norms (``w`` keeps its precision only if 1 is subtracted first) and
    ``ssm_a`` (``-exp(A_log)``, whose log is taken)."""
    return _shifted(model_type, name) or name.endswith(".ssm_a")


def _grouped(tensor: Tensor, dim: int, key_heads: int, group: int, size: int) -> Tensor:
    """Qwen3.5's value heads as llama.cpp's converter stores them, tiled over the key
    heads (value head ``j`` of key head ``h`` at ``j * key_heads + h``), back in the
    folder's grouped order (at ``h * group + j``), along ``dim`` (of ``key_heads * group
    * size``: ``size`` rows or columns per head)."""
    shape = tensor.shape
    tiled = tensor.reshape(*shape[:dim], group, key_heads, size, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def _linear_to_hf(parts: dict[str, Tensor], config: dict[str, Any]) -> Tensor:
    """A Gated DeltaNet layer's llama.cpp tensors (one, or ``attn_qkv`` and ``attn_gate``)
    -> the Hugging Face tensor they make: ``ssm_conv1d`` ``(C, K)`` back to ``(C, 1,
    K)``, ``ssm_a = -exp(A_log)`` back to ``A_log``, Qwen3-Next's ``attn_qkv`` and
    ``attn_gate`` fused back into ``in_proj_qkvz`` (rows per key head), Qwen3.5's value
    heads back from tiled to grouped order (when there are more value than key heads)."""
    (name, tensor), *rest = parts.items()
    kind = name.split(".")[2]
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    hk, hv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if kind == "attn_qkv" and config["model_type"] == "qwen3_next":
        qkvz, _ = fused_row_order(k_heads, v_heads, hk, hv)
        return torch.cat((tensor, rest[0][1]))[qkvz]
    if kind == "ssm_a":
        tensor = (-tensor).log()
    elif kind == "ssm_conv1d":
        tensor = tensor.unsqueeze(1)
    group = v_heads // k_heads
    if config["model_type"] == "qwen3_next" or group == 1:
        return tensor
    return _regroup_values(kind, tensor, 2 * k_heads * hk, hv, k_heads, group)


def _regroup_values(kind: str, tensor: Tensor, keys: int, hv: int, outer: int,
                    inner: int) -> Tensor:
    """A DeltaNet tensor's value-head rows (or ``ssm_out``'s columns) reordered by
    :func:`_grouped` with ``(outer, inner)``: ``(key heads, group)`` reads llama.cpp's
    tiled order back, ``(group, key heads)`` writes it; ``keys`` rows of queries and
    keys lead ``attn_qkv`` and ``ssm_conv1d``."""
    if kind in ("attn_qkv", "ssm_conv1d"):  # the values' rows, after the queries and keys
        return torch.cat((tensor[:keys], _grouped(tensor[keys:], 0, outer, inner, hv)))
    if kind == "attn_gate":
        return _grouped(tensor, 0, outer, inner, hv)
    if kind in ("ssm_beta", "ssm_alpha", "ssm_dt", "ssm_a"):
        return _grouped(tensor, 0, outer, inner, 1)
    if kind == "ssm_out":
        return _grouped(tensor, 1, outer, inner, hv)
    return tensor  # ssm_norm: one weight every head shares


def _to_hf(parts: dict[str, Tensor], config: dict[str, Any]) -> Tensor:
    """The llama.cpp tensors that make one Hugging Face tensor (one, or two in
    :func:`_plan`'s order) -> that tensor as transformers' module holds it."""
    model_type = config["model_type"]
    (name, tensor), *rest = parts.items()
    if model_type in _HYBRIDS and name.startswith("blk.") and name.split(".")[2].startswith(
            ("ssm_", "attn_qkv", "attn_gate")):
        return _linear_to_hf(parts, config)
    if name.endswith("ffn_gate_inp_shexp.weight"):  # (d,) or (1, d) -> (1, d)
        return tensor.reshape(1, -1)
    kind = name.split(".")[-2]
    if model_type in _PERMUTED and kind in ("attn_q", "attn_k"):
        return unpermute_rope(tensor, config["num_attention_heads" if kind == "attn_q"
                                             else "num_key_value_heads"])
    if _shifted(model_type, name):
        return tensor - 1
    if model_type == "gpt2" and name.startswith("blk.") and tensor.dim() == 2:
        return tensor.t().contiguous()  # nn.Linear's (out, in) -> Conv1D's (in, out)
    if kind == "attn_k_b":  # (heads, rank, nope) and (heads, v, rank) -> (heads*(nope+v), rank)
        k_b, v_b = tensor, rest[0][1]
        return torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1).contiguous()
    if kind in ("ffn_gate_exps", "ffn_gate_up_exps"):
        gate, up = (tensor, rest[0][1]) if rest else tensor.chunk(2, dim=1)
        if model_type != "gpt_oss":  # (E, 2I, d): gate rows, then up rows
            return torch.cat((gate, up), dim=1) if rest else tensor
        # gpt-oss: (E, d, 2I), gate and up in alternate columns (biases: (E, 2I))
        pairs = torch.stack((gate, up), dim=-1)  # (E, I, [d,] 2)
        if pairs.dim() == 4:
            pairs = pairs.transpose(1, 2)
        return pairs.flatten(-2).contiguous()
    if model_type == "gpt_oss" and name.endswith("ffn_down_exps.weight"):
        return tensor.transpose(1, 2).contiguous()  # (E, d, I) -> (E, I, d)
    return tensor


def gguf_state_dict(
    path: str | os.PathLike[str],
    header: GGUFHeader,
    config: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    max_bytes: int | None = None,
    keep: Container[str] = (),
) -> dict[str, Tensor | QuantizedWeight]:
    """The GGUF file's tensors under Hugging Face's names, in Hugging Face's conventions.

    Before any tensor is read, the header must list exactly the tensors ``config``
    implies, each of the shape it implies: ``rope_freqs.weight`` too when ``config``'s
    ``rope_scaling`` is llama3's (which stands for it; it is not returned); and they must
    fit in ``max_bytes``. Then they are read and converted one Hugging Face tensor at a
    time (two llama.cpp tensors at most): beside the result, one tensor's conversion is
    held, never the file's whole model twice.

    Args:
        path: the ``.gguf`` file.
        header: its :func:`~qkv.models.gguf_weights.read_gguf_header`.
        config: its :func:`gguf_config`.
        dtype: ``torch.float32`` or ``torch.bfloat16`` (quantized weights are expanded in
            float32, then rounded; Gemma's norms have 1 subtracted before rounding).
        max_bytes: refuse before expanding if the tensors would take more than this
            (see :func:`~qkv.models.gguf_weights.read_gguf_tensors`).
        keep: GGML types (of :data:`~qkv.models.quantized.KEPT_TYPES`) whose 2-D
            tensors come back as their blocks, a :class:`~qkv.models.quantized.
            QuantizedWeight` (rows reordered as the float tensor's would be), not
            expanded; GPT-2's transposed weights are always expanded.

    Returns:
        Hugging Face name -> tensor, as transformers' ``*ForCausalLM`` holds it:
        ``model.embed_tokens.weight`` ``(vocab, hidden)``,
        ``model.layers.{i}.self_attn.q_proj.weight`` ``(heads * head_dim, hidden)``, ...,
        ``lm_head.weight`` only when untied; for GPT-2 ``transformer.wte.weight``,
        ``transformer.h.{i}.attn.c_attn.weight`` ``(n_embd, 3 * n_embd)`` (``Conv1D``'s
        ``(in, out)``), ...; experts fused: DeepSeek's
        ``model.layers.{i}.mlp.experts.gate_up_proj`` ``(experts, 2 * moe_intermediate,
        hidden)`` (gate rows, then up rows) and ``down_proj`` ``(experts, hidden,
        moe_intermediate)``, gpt-oss's ``gate_up_proj`` ``(experts, hidden, 2 *
        intermediate)`` (gate and up columns alternating) and ``down_proj`` ``(experts,
        intermediate, hidden)``. Everything the matching ``*ForCausalLM`` holds, its
        tied ``lm_head.weight`` aside.

    Raises:
        ValueError: one line: a tensor missing, of another shape or not part of the
            model; too many bytes; as :func:`~qkv.models.gguf_weights.read_gguf_tensors`.
    """
    model_type = config["model_type"]
    plan = _plan(config, header.tensors)
    _check_tensors(header, {**plan, **_kept_out(config)}, model_type)
    groups: dict[str, list[str]] = {}  # Hugging Face name -> its llama.cpp tensors
    for name, (hf_name, _) in plan.items():
        groups.setdefault(hf_name, []).append(name)
    kept = {names[0] for names in groups.values()
            if len(names) == 1 and model_type != "gpt2"
            and header.tensors[names[0]].type_name in keep
            and len(header.tensors[names[0]].shape) == 2}
    check_tensor_budget(header, [n for n in plan if n not in kept], dtype, max_bytes)
    out: dict[str, Tensor | QuantizedWeight] = {}
    for hf_name, names in groups.items():
        if names[0] in kept:
            out[hf_name] = _blocks_to_hf(path, header, names[0], config)
            continue
        # Gemma's norms come as 1 + w; w keeps its precision only if 1 is subtracted
        # before rounding to bfloat16. Every other conversion only moves values.
        wide = any(_exact(model_type, n) for n in names)
        out[hf_name] = _to_hf(read_gguf_tensors(path, names, torch.float32 if wide else dtype,
                                                header=header), config).to(dtype)
    return out


def _blocks_to_hf(path: str | os.PathLike[str], header: GGUFHeader, name: str,
                  config: dict[str, Any]) -> QuantizedWeight:
    """One 2-D quantized tensor's blocks as :func:`_to_hf` would give its values: the
    rows of a ``llama`` file's ``attn_q``/``attn_k`` reordered (whole rows move, so
    their blocks move with them); every other such tensor is used as stored."""
    info = header.tensors[name]
    blocks = read_gguf_blocks(path, [name], header)[name]
    kind = name.split(".")[-2]
    if config["model_type"] in _PERMUTED and kind in ("attn_q", "attn_k"):
        blocks = unpermute_rope(blocks, config["num_attention_heads" if kind == "attn_q"
                                               else "num_key_value_heads"])
    return QuantizedWeight(info.type_name, blocks, torch.Size(info.shape))


def read_gguf_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    max_bytes: int | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A GGUF file's Hugging Face config and state dict: :func:`gguf_config` and
    :func:`gguf_state_dict` of its header (every check done before a tensor is read)."""
    header = read_gguf_header(path)
    config = gguf_config(header)
    return config, gguf_state_dict(path, header, config, dtype, max_bytes)


# model_type -> the general.architecture write_gguf gives it (llama.cpp runs Mistral as
# llama).
_WRITTEN = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "gpt_oss": "gpt-oss", "qwen3_5_text": "qwen35",
            "deepseek_v3": "deepseek2", "deepseek_v32": "deepseek32", "qwen3_next": "qwen3next",
            "gemma4_text": "gemma4"}
# Gemma 4's proportional RoPE: rope_freqs' divisor for the pairs that do not turn (as
# llama.cpp's converter writes it).
_NOT_TURNING = 1e30
# YaRN's keys of rope_scaling -> the rope.scaling.* key write_gguf gives them (gpt-oss's
# and DeepSeek's files; their factor and original context are written apart).
_YARN_WRITTEN = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow",
                 "attention_factor": "yarn_attn_factor"}
# write_gguf's types of the 2-D weights -> general.file_type (llama.cpp's LlamaFileType).
_FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}


def _metadata(config: dict[str, Any], arch: str, gguf: Any) -> dict[str, tuple[Any, Any]]:
    """The ``{arch}.*`` metadata of a model of ``config`` (:func:`hf_config`'s form, every
    size spelled out), key (prefix removed) -> (value, GGUF value type): what
    :func:`gguf_config` reads, typed as llama.cpp's converter types it."""
    u32, f32, string = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32,
                        gguf.GGUFValueType.STRING)
    head_dim = config["head_dim"]
    meta = {
        "vocab_size": (config["vocab_size"], u32),
        "context_length": (config["max_position_embeddings"], u32),
        "embedding_length": (config["hidden_size"], u32),
        "block_count": (config["num_hidden_layers"], u32),
        "feed_forward_length": (config["intermediate_size"], u32),
        "attention.head_count": (config["num_attention_heads"], u32),
        "attention.head_count_kv": (config["num_key_value_heads"], u32),
        "attention.key_length": (head_dim, u32), "attention.value_length": (head_dim, u32),
        "rope.dimension_count": (head_dim, u32),
        "attention.layer_norm_rms_epsilon": (config["rms_norm_eps"], f32),
    }
    if "rope_theta" in config:  # Gemma 4's is per layer type
        meta["rope.freq_base"] = (config["rope_theta"], f32)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":  # llama3's is a tensor (_rope_freqs)
        meta["rope.scaling.type"] = ("linear", string)
        meta["rope.scaling.factor"] = (scaling["factor"], f32)
    if scaling.get("rope_type") == "yarn" and arch in ("gpt-oss", *_DEEPSEEK_ARCHES):
        meta["rope.scaling.type"] = ("yarn", string)
        meta["rope.scaling.factor"] = (scaling["factor"], f32)
        meta["rope.scaling.original_context_length"] = (
            scaling["original_max_position_embeddings"], u32)
        for key, written in _YARN_WRITTEN.items():
            if scaling.get(key) is not None:
                meta[f"rope.scaling.{written}"] = (scaling[key], f32)
    if config["model_type"] in _HYBRIDS:
        meta.update(_hybrid_metadata(config, gguf))
    if arch in _DEEPSEEK_ARCHES:
        meta.update(_deepseek2_metadata(config, gguf))
    if arch == "gemma4":
        meta.update(_gemma4_metadata(config, gguf))
    if arch == "gpt-oss":  # intermediate_size is each expert's
        meta.update({"attention.sliding_window": (config["sliding_window"], u32),
                     "expert_count": (config["num_local_experts"], u32),
                     "expert_used_count": (config["num_experts_per_tok"], u32),
                     "expert_feed_forward_length": (config["intermediate_size"], u32)})
    if arch == "gemma3":
        if config["sliding_window"] is not None:
            meta["attention.sliding_window"] = (config["sliding_window"], u32)
        meta["rope.freq_base_swa"] = (config["rope_local_base_freq"], f32)
    return meta


def _gemma4_metadata(config: dict[str, Any], gguf: Any) -> dict[str, tuple[Any, Any]]:
    """Gemma 4's own metadata (:func:`_gemma4_config` reads it): the sliding layers'
    flags, the full and sliding heads' sizes, per-layer key/value heads and MLP widths
    (the shared layers' doubled), the RoPE bases, experts, per-layer inputs, the logits'
    soft cap."""
    u32, f32, array = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32,
                       gguf.GGUFValueType.ARRAY)
    layers, swa = config["num_hidden_layers"], config["head_dim"]
    full = config["global_head_dim"]
    sliding = [kind == "sliding_attention" for kind in config["layer_types"]]
    first_shared = layers - config["num_kv_shared_layers"]
    double = 2 if config["use_double_wide_mlp"] else 1
    rope = config["rope_parameters"]
    meta = {
        "attention.sliding_window_pattern": (sliding, array),
        "attention.head_count_kv": ([config["per_layer_config"].get(str(i), {}).get(
            "num_key_value_heads", config["num_key_value_heads"]) for i in range(layers)],
            array),
        "feed_forward_length": ([config["intermediate_size"] * (double if i >= first_shared
                                                                else 1)
                                 for i in range(layers)], array),
        "attention.key_length": (full, u32), "attention.value_length": (full, u32),
        "attention.key_length_swa": (swa, u32), "attention.value_length_swa": (swa, u32),
        "rope.dimension_count": (full, u32), "rope.dimension_count_swa": (swa, u32),
        "rope.freq_base": (rope["full_attention"]["rope_theta"], f32),
        "rope.freq_base_swa": (rope["sliding_attention"]["rope_theta"], f32),
        "attention.shared_kv_layers": (config["num_kv_shared_layers"], u32)}
    if any(sliding):
        meta["attention.sliding_window"] = (config["sliding_window"], u32)
    if config["hidden_size_per_layer_input"]:
        meta["embedding_length_per_layer_input"] = (config["hidden_size_per_layer_input"],
                                                    u32)
    if config["final_logit_softcapping"] is not None:
        meta["final_logit_softcapping"] = (config["final_logit_softcapping"], f32)
    if config["enable_moe_block"]:
        meta.update({"expert_count": (config["num_experts"], u32),
                     "expert_used_count": (config["top_k_experts"], u32),
                     "expert_feed_forward_length": (config["moe_intermediate_size"], u32)})
    return meta


def _deepseek2_metadata(config: dict[str, Any], gguf: Any) -> dict[str, tuple[Any, Any]]:
    """DeepSeek-V3's own metadata (:func:`_deepseek2_config` reads it), as llama.cpp's
    converter writes it since its MLA: attention over the latent (one key/value head of
    ``kv_lora_rank + qk_rope_head_dim``) with the heads' sizes as ``*_mla``, sigmoid
    routing, YaRN's ``mscale_all_dim`` as ``0.1 *`` it; DeepSeek-V3.2's indexer sizes
    (``attention.indexer.*``) too."""
    u32, f32, flag = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32,
                      gguf.GGUFValueType.BOOL)
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    meta = {
        "attention.head_count_kv": (1, u32),
        "attention.key_length": (rank + rope, u32), "attention.value_length": (rank, u32),
        "attention.key_length_mla": (config["qk_nope_head_dim"] + rope, u32),
        "attention.value_length_mla": (config["v_head_dim"], u32),
        "attention.kv_lora_rank": (rank, u32), "rope.dimension_count": (rope, u32),
        "expert_gating_func": (_SIGMOID, u32),
        "expert_count": (config["n_routed_experts"], u32),
        "expert_used_count": (config["num_experts_per_tok"], u32),
        "expert_feed_forward_length": (config["moe_intermediate_size"], u32),
        "expert_shared_count": (config["n_shared_experts"], u32),
        "leading_dense_block_count": (config["first_k_dense_replace"], u32),
        "expert_weights_scale": (config["routed_scaling_factor"], f32),
        "expert_weights_norm": (bool(config["norm_topk_prob"]), flag),
        "expert_group_count": (config["n_group"], u32),
        "expert_group_used_count": (config["topk_group"], u32)}
    if config["q_lora_rank"] is not None:
        meta["attention.q_lora_rank"] = (config["q_lora_rank"], u32)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "yarn":
        meta[f"rope.scaling.{_YARN_LOG_MUL}"] = (0.1 * scaling.get("mscale_all_dim", 0.0), f32)
    if config["model_type"] == "deepseek_v32":
        meta.update({"attention.indexer.head_count": (config["index_n_heads"], u32),
                     "attention.indexer.key_length": (config["index_head_dim"], u32),
                     "attention.indexer.top_k": (config["index_topk"], u32)})
    return meta


# The layer counts at which llama.cpp's deepseek2 loader takes a model for DeepSeek-V2-Lite
# (one query projection, no q_lora_rank): checked with llama-cpp-python 0.3.36.
_DEEPSEEK_LITE_LAYERS = (26, 27)
# The narrowest Hadamard matrix llama.cpp makes (its sizes: powers of two from this one).
# Its deepseek32 graph rotates each index head by one matrix of the head's width, so it
# runs index_head_dim 64, 128, 256, ... only (others fail an assertion in ggml's mul_mat).
_HADAMARD_MIN = 64


def _check_gemma4_sharing(config: dict[str, Any]) -> None:
    """Gemma 4's shared layers must read the caches llama.cpp gives them: it takes a
    shared sliding layer's keys and values from the second-last layer before the shared
    ones, a full layer's from the last (its fixed rule); transformers and qkv from the
    last earlier layer of the same kind. The two agree when the layers before the
    shared ones end sliding, full."""
    kinds, layers = config["layer_types"], config["num_hidden_layers"]
    first = layers - config["num_kv_shared_layers"]
    for i in range(first, layers):
        theirs = first - (2 if kinds[i] == "sliding_attention" else 1)
        ours = max((j for j in range(first) if kinds[j] == kinds[i]), default=None)
        if theirs != ours:
            raise ValueError(
                f"config: layer {i} ({kinds[i]}) shares the cache of layer {ours}; a GGUF "
                f"gemma4 file gives it layer {theirs}'s (llama.cpp: the layers before the "
                f"num_kv_shared_layers={layers - first} shared ones must end sliding, full)")


def _hybrid_metadata(config: dict[str, Any], gguf: Any) -> dict[str, tuple[Any, Any]]:
    """The Gated DeltaNet hybrids' own metadata (:func:`_hybrid_config` reads it): the
    rotated part of each head, the schedule, the linear attention's ``ssm.*`` sizes;
    Qwen3.5's multimodal RoPE sections (text tokens turn alike whatever their split)."""
    u32 = gguf.GGUFValueType.UINT32
    rotary = int(config["head_dim"] * config["partial_rotary_factor"])
    v_heads = config["linear_num_value_heads"]
    meta = {"rope.dimension_count": (rotary, u32),
            "full_attention_interval": (config["full_attention_interval"], u32),
            "ssm.conv_kernel": (config["linear_conv_kernel_dim"], u32),
            "ssm.state_size": (config["linear_key_head_dim"], u32),
            "ssm.group_count": (config["linear_num_key_heads"], u32),
            "ssm.time_step_rank": (v_heads, u32),
            "ssm.inner_size": (v_heads * config["linear_value_head_dim"], u32)}
    if config["model_type"] == "qwen3_next":  # experts in every layer
        meta.update({
            "expert_count": (config["num_experts"], u32),
            "expert_used_count": (config["num_experts_per_tok"], u32),
            "expert_feed_forward_length": (config["moe_intermediate_size"], u32),
            "expert_shared_feed_forward_length": (config["shared_expert_intermediate_size"],
                                                  u32)})
    if config["model_type"] == "qwen3_5_text":
        pairs = rotary // 2
        meta["rope.dimension_sections"] = (
            [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0], gguf.GGUFValueType.ARRAY)
    return meta


def _rope_freqs(config: dict[str, Any]) -> Tensor | None:
    """The ``rope_freqs.weight`` llama.cpp reads llama3 RoPE scaling from (``llama`` files):
    per frequency, the divisor the scaling applies, float32; Gemma 4's proportional RoPE
    (``gemma4`` files): 1 for each pair of the full layers' heads that turns, 1e30 for the
    rest; None without either."""
    if not _kept_out(config):
        return None
    if config["model_type"] == "gemma4_text":
        pairs = config["global_head_dim"] // 2
        factor = config["rope_parameters"]["full_attention"]["partial_rotary_factor"]
        turning = int(config["global_head_dim"] * factor / 2)
        return torch.tensor([1.0] * turning + [_NOT_TURNING] * (pairs - turning))
    head_dim, base, scaling = config["head_dim"], config["rope_theta"], config["rope_scaling"]
    return (rope_frequencies(head_dim, base) / rope_frequencies(head_dim, base, scaling)
            ).float()


def _to_gguf(name: str, tensor: Tensor, config: dict[str, Any]) -> Tensor:
    """One tensor as Hugging Face holds it -> as llama.cpp stores it (:func:`_to_hf`'s
    inverse), float32."""
    model_type, kind = config["model_type"], name.split(".")[-2]
    tensor = tensor.detach().cpu().float()
    if kind.endswith("_exps") and name.split(".")[-1] in ("weight", "bias"):
        return _experts_to_gguf(kind, tensor, model_type).contiguous()
    if model_type in _HYBRIDS and name.startswith("blk.") and name.split(".")[2].startswith(
            ("ssm_", "attn_qkv", "attn_gate")):
        return _linear_to_gguf(name, tensor, config).contiguous()
    if kind in ("attn_k_b", "attn_v_b"):  # kv_b_proj (heads * (nope + v), rank)
        nope = config["qk_nope_head_dim"]
        per_head = tensor.reshape(config["num_attention_heads"], -1, tensor.shape[-1])
        return (per_head[:, :nope].transpose(1, 2) if kind == "attn_k_b"
                else per_head[:, nope:]).contiguous()
    if model_type in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
        return permute_rope(tensor, config["num_attention_heads" if kind == "attn_q"
                                           else "num_key_value_heads"])
    if _shifted(model_type, name):
        return tensor + 1
    return tensor


def _linear_to_gguf(name: str, tensor: Tensor, config: dict[str, Any]) -> Tensor:
    """One of a Gated DeltaNet layer's llama.cpp tensors from the Hugging Face tensor
    that makes it (:func:`_linear_to_hf`'s inverse): Qwen3-Next's fused
    ``in_proj_qkvz`` split into ``attn_qkv`` and ``attn_gate``, the convolution squeezed
    to ``(C, K)``, ``A_log`` as ``ssm_a = -exp(A_log)``, Qwen3.5's value heads from the folder's
    grouped order to llama.cpp's tiled one (:func:`_grouped` with the two counts
    swapped)."""
    kind = name.split(".")[2]
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    hk, hv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if kind in ("attn_qkv", "attn_gate") and config["model_type"] == "qwen3_next":
        qkvz, _ = fused_row_order(k_heads, v_heads, hk, hv)
        unfused = torch.empty_like(tensor)
        unfused[qkvz] = tensor  # all q, all k, all v, then all z
        conv = 2 * k_heads * hk + v_heads * hv
        return unfused[:conv] if kind == "attn_qkv" else unfused[conv:]
    if kind == "ssm_a":
        tensor = -tensor.exp()
    elif kind == "ssm_conv1d":
        tensor = tensor.squeeze(1)
    group = v_heads // k_heads
    if config["model_type"] == "qwen3_next" or group == 1:
        return tensor
    return _regroup_values(kind, tensor, 2 * k_heads * hk, hv, group, k_heads)


def _experts_to_gguf(kind: str, tensor: Tensor, model_type: str) -> Tensor:
    """One of llama.cpp's 3-D expert tensors (or gpt-oss's 2-D expert biases) from
    transformers' fused one: ``ffn_gate_exps`` and ``ffn_up_exps`` ``(E, I, d)`` are
    gpt-oss's alternate columns of ``gate_up_proj`` ``(E, d, 2I)`` (biases ``(E, 2I)``),
    transposed, or the other families' first and second halves of its rows ``(E, 2I, d)``;
    ``ffn_down_exps`` ``(E, d, I)`` is gpt-oss's ``down_proj`` ``(E, I, d)`` transposed,
    the others' as it is."""
    gpt_oss = model_type == "gpt_oss"
    if kind == "ffn_down_exps":
        return tensor.transpose(1, 2) if gpt_oss and tensor.dim() == 3 else tensor
    if kind == "ffn_gate_up_exps":  # gate rows, then up rows, as the others hold them
        return tensor
    half = 0 if kind == "ffn_gate_exps" else 1
    if not gpt_oss:
        return tensor.chunk(2, dim=1)[half]
    if tensor.dim() == 3:
        tensor = tensor.transpose(1, 2)  # (E, 2I, d)
    return tensor[:, half::2]


def _stored_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama.cpp's converter stores this tensor in float32 whatever the file's
    type: vectors, biases, norms, the routers, the DeltaNet convolution (which
    llama.cpp's kernels take in float32) and DeepSeek-V3.2's indexer weights
    (``indexer.proj``)."""
    return (len(shape) < 2 or not name.endswith(".weight") or name.endswith("_norm.weight")
            or ".ffn_gate_inp" in name or ".ssm_conv1d." in name or ".indexer.proj." in name)


def write_gguf(
    path: str | os.PathLike[str],
    config: Mapping[str, Any],
    state_dict: Mapping[str, Tensor],
    dtype: str = "F32",
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a Hugging Face model as a GGUF file that llama.cpp runs: the inverse of
    :func:`read_gguf_model`.

    The metadata holds exactly what :func:`gguf_config` reads (typed as llama.cpp's
    converter types it); the tensors go under llama.cpp's names (:func:`_plan`) in its
    conventions: ``llama`` files' q/k rows permuted for llama.cpp's RoPE, Gemma's norms
    as ``1 + w``, Llama 3's RoPE scaling as a ``rope_freqs.weight`` tensor; gpt-oss's
    sinks as ``attn_sinks``, its alternating gate/up expert columns split into
    ``ffn_gate_exps``/``ffn_up_exps`` ``(E, I, d)`` and its down experts transposed;
    Qwen3.5's norms (but the gated one) as ``1 + w``, ``A_log`` as ``ssm_a =
    -exp(A_log)``, the convolution squeezed, the value heads in llama.cpp's tiled order;
    DeepSeek-V3's ``kv_b_proj`` split into ``attn_k_b`` (transposed) and ``attn_v_b``,
    its experts' halves as ``ffn_gate_exps``/``ffn_up_exps``, the score correction as
    ``exp_probs_b``; Qwen3-Next's fused ``in_proj_qkvz`` split into ``attn_qkv`` and
    ``attn_gate``, its ``in_proj_ba`` as ``ssm_ba``; Gemma 4's norms as they are, its
    proportional RoPE as a ``rope_freqs.weight`` tensor, its experts fused
    (``ffn_gate_up_exps``), the router's scales as ``ffn_gate_inp.scale`` and
    ``ffn_down_exps.scale``.
    Vectors, biases, norms, routers (``ffn_gate_inp*``) and the DeltaNet convolution are
    F32, as llama.cpp's converter writes them; the other 2-D and the 3-D weights (the
    experts, unquantized) ``dtype``.

    Before anything is written the model must read back as itself: the header the file
    will have, read by :func:`gguf_config`, must give ``config``'s ``GPTConfig`` fields
    (:func:`~qkv.models.hf_open.config_fields`). What llama.cpp's format cannot say (a
    window on a Llama or Qwen model, Gemma 3 layers other than five sliding to one full,
    RoPE scaling other than linear and Llama 3's, ...) is a one-line ``ValueError``; so
    are biases on a Qwen3 or Gemma 3 model's projections, which llama.cpp's
    ``attn_output`` lacks there, and DeltaNet value heads of another size than the key
    heads (llama.cpp's loader fails on such a file), a DeepSeek-V3 model without
    ``q_lora_rank`` at another layer count than DeepSeek-V2-Lite's, a DeepSeek-V3.2 one
    without it at all or with an ``index_head_dim`` other than 64, 128, 256, ... (the
    widths of the Hadamard matrices llama.cpp rotates the index heads by), and Gemma 4's
    shared
    layers whose caches llama.cpp would take from other layers
    (:func:`_check_gemma4_sharing`).

    Args:
        path: the ``.gguf`` file to write; it must not exist. It is written under a
            temporary name beside it, then renamed: it appears whole or not at all.
        config: the model's ``config.json`` (``model_type`` ``"llama"``, ``"mistral"``,
            ``"qwen2"``, ``"qwen3"``, ``"gemma3_text"``, ``"gpt_oss"`` or
            ``"qwen3_5_text"``, ``"deepseek_v3"``, ``"deepseek_v32"``, ``"qwen3_next"``
            or ``"gemma4_text"``: :data:`_WRITTEN`).
        state_dict: Hugging Face name -> tensor, as :func:`read_gguf_model` or
            ``*ForCausalLM.state_dict()`` give it (a tied ``lm_head.weight`` may be
            there; it is not written).
        dtype: ``"F32"``, ``"F16"`` or ``"BF16"``: the type of the 2-D weights.
        tokenizer: a GGUF file whose ``tokenizer.*`` metadata is copied (the file a
            model was imported from); its token list must be as long as the
            vocabulary. None: ``tokenizer.ggml.model = "none"``, which llama.cpp loads
            with ``vocab_size`` placeholder tokens: token ids in, logits out, no text.

    Returns:
        ``path``.
    """
    gguf = import_gguf()
    path = Path(path)
    if dtype not in _FILE_TYPES:
        raise ValueError(f"dtype {show(dtype)} is not written; choose "
                         f"{', '.join(_FILE_TYPES)}")
    model_type = config.get("model_type") if isinstance(config, Mapping) else None
    if model_type not in _WRITTEN:
        raise ValueError(f"config: model_type {show(model_type)} cannot be written to GGUF; "
                         f"qkv writes {', '.join(_WRITTEN)}")
    if model_type == "deepseek_v32" and "q_lora_rank" in config and \
            config["q_lora_rank"] is None:  # refused here, before qkv's own layer refuses it
        raise ValueError("config: q_lora_rank=None cannot be written to a GGUF deepseek32 "
                         "file: llama.cpp's deepseek32 loader needs attention.q_lora_rank "
                         "(the indexer reads the query latent); give an integer")
    fields = config_fields(config, "config")
    # Checks every name and shape (one line each), then gives the tensors as transformers'
    # module holds them, whichever form they came in: the module's (Qwen3-Next's
    # projections fused) or from_qkv's (per-expert tensors, projections split).
    try:
        ours = to_qkv(state_dict, fields, model_type)
    except ValueError as error:
        try:
            ours = to_qkv(state_dict, fields)
        except ValueError:
            raise error from None
    state_dict = from_qkv(ours, fields, model_type, fused_experts=True)
    full = hf_config(fields, model_type)  # every size spelled out
    if model_type in _HYBRIDS:
        # llama.cpp's one schedule: a full layer every full_attention_interval (the
        # read-back check below refuses any other)
        kinds = full["layer_types"]
        full["full_attention_interval"] = (kinds.index("full_attention") + 1
                                           if "full_attention" in kinds
                                           else _FULL_ATTENTION_EVERY)
        if full["linear_value_head_dim"] != full["linear_key_head_dim"]:
            raise ValueError(
                f"config: linear_value_head_dim {full['linear_value_head_dim']} cannot be "
                f"written to a GGUF {_WRITTEN[model_type]} file: llama.cpp takes the value "
                f"heads to be linear_key_head_dim ({full['linear_key_head_dim']}) wide")
    index_dim = full.get("index_head_dim") if model_type == "deepseek_v32" else None
    if index_dim is not None and (index_dim < _HADAMARD_MIN or index_dim & (index_dim - 1)):
        raise ValueError(
            f"config: index_head_dim {index_dim} cannot be written to a GGUF deepseek32 file: "
            f"llama.cpp rotates each index head by a Hadamard matrix of its width, which it "
            f"makes for powers of two from {_HADAMARD_MIN} only ({_HADAMARD_MIN}, "
            f"{2 * _HADAMARD_MIN}, ...)")
    if model_type == "deepseek_v3" and full["q_lora_rank"] is None and \
            full["num_hidden_layers"] not in _DEEPSEEK_LITE_LAYERS:
        # llama.cpp tells DeepSeek-V2-Lite (queries without the low-rank bottleneck) by
        # its layer count, and looks for q_lora_rank in any other file
        raise ValueError(
            f"config: q_lora_rank=None with num_hidden_layers "
            f"{full['num_hidden_layers']} cannot be written to a GGUF deepseek2 file: "
            f"llama.cpp reads queries without q_lora_rank only at "
            f"{' or '.join(map(str, _DEEPSEEK_LITE_LAYERS))} layers (DeepSeek-V2-Lite's)")
    stored: tuple[str, ...] = ()
    if model_type == "gemma4_text":
        # the full layers' head size; experts fused, as llama.cpp's converter writes them
        layers, heads = full["num_hidden_layers"], full["per_layer_config"]
        full["global_head_dim"] = next(
            (heads.get(str(i), {}).get("head_dim", full["head_dim"]) for i in range(layers)
             if full["layer_types"][i] == "full_attention"), full["head_dim"])
        stored = tuple(f"blk.{i}.ffn_gate_up_exps.weight" for i in range(layers))
        _check_gemma4_sharing(full)
    arch, plan, rope_freqs = _WRITTEN[model_type], _plan(full, stored), _rope_freqs(full)
    if arch in ("qwen3", "gemma3") and fields["out_bias"]:
        raise ValueError(f"config: attention_bias=True cannot be written to a GGUF {arch} "
                         f"file: llama.cpp's {arch} loads no attn_output.bias")
    meta = _metadata(full, arch, gguf)
    general = {"name": arch}

    # What gguf_config will read: the header, in memory (floats rounded to float32).
    f32 = gguf.GGUFValueType.FLOAT32
    header = GGUFHeader(
        path=path, version=3, architecture=arch,
        config={k: float(np.float32(v)) if t == f32 else v for k, (v, t) in meta.items()},
        general=general, file_size=0,
        tensors={name: GGUFTensorInfo(name, "F32", shape, 0, 0)
                 for name, (_, shape) in plan.items()})
    back = gguf_config(header)
    if rope_freqs is not None and arch == "gemma4":  # not in the header above: read here
        back["rope_parameters"]["full_attention"].update(
            rope_type="proportional", partial_rotary_factor=_proportional_from_divisors(
                rope_freqs, full["global_head_dim"], f"{path}: rope"))
    elif rope_freqs is not None:
        back["rope_scaling"] = _llama3_from_divisors(rope_freqs, full["head_dim"],
                                                     back["rope_theta"], f"{path}: rope")
    difference = field_difference(fields, config_fields(back, str(path)), "llama.cpp")
    if difference:
        raise ValueError(f"config: the model cannot be written to a GGUF {arch} file: "
                         f"{difference} (GPTConfig's fields)")
    tokens = _tokenizer(tokenizer, full["vocab_size"], gguf)
    if os.path.lexists(path):
        raise FileExistsError(f"{path}: exists; name a new file (nothing is overwritten)")

    tensors = {_ROPE_FREQS: rope_freqs} if rope_freqs is not None else {}
    tensors.update((name, hf) for name, (hf, _) in plan.items())
    tmp = temp_path(path)
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        writer.add_name(general["name"])
        writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[dtype]])
        for key, (value, vtype) in meta.items():
            writer.add_key_value(f"{arch}.{key}", value, vtype)
        for key, (value, vtype, sub_type) in tokens.items():
            writer.add_key_value(key, value, vtype, sub_type)
        types = {}  # name -> GGML type
        for name, source in tensors.items():
            shape = tuple(source.shape) if isinstance(source, Tensor) else plan[name][1]
            types[name] = "F32" if _stored_f32(name, shape) else dtype
            kind = gguf.GGMLQuantizationType[types[name]]
            nbytes = math.prod(shape) * (4 if types[name] == "F32" else 2)
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, source in tensors.items():  # one tensor converted at a time
            tensor = source if isinstance(source, Tensor) else _to_gguf(
                name, state_dict[source], full)
            writer.write_tensor_data(_ggml_bytes(tensor, types[name]))
        writer.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _ggml_bytes(tensor: Tensor, dtype: str) -> np.ndarray:
    """A float32 tensor's values as GGML type ``dtype`` stores them, a NumPy array."""
    if dtype == "BF16":  # NumPy has no bfloat16: its bits
        return tensor.to(torch.bfloat16).view(torch.int16).numpy()
    return tensor.to(torch.float16 if dtype == "F16" else torch.float32).numpy()


def _tokenizer(source: str | os.PathLike[str] | None, vocab_size: int,
               gguf: Any) -> dict[str, tuple[Any, Any, Any]]:
    """The ``tokenizer.*`` metadata to write, key -> (value, type, array element type):
    ``source``'s, types kept, or llama.cpp's "no vocabulary"."""
    if source is None:
        return {"tokenizer.ggml.model": ("none", gguf.GGUFValueType.STRING, None)}
    _, reader = open_gguf_reader(source)
    out = {}
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            out[field.name] = field.contents(), vtype, sub
    tokens = out.get("tokenizer.ggml.tokens", (None,))[0]
    if not isinstance(tokens, list) or len(tokens) != vocab_size:
        raise ValueError(f"{source}: its tokenizer.ggml.tokens lists "
                         f"{show(None if tokens is None else len(tokens))} tokens; the "
                         f"model has {vocab_size:,} (llama.cpp needs one per embedding row)")
    return out
