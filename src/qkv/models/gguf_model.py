"""Read a GGUF file (llama.cpp's format) as a Hugging Face model folder would give it.

A Hugging Face folder holds a ``config.json`` and tensors under Hugging Face's names; a
GGUF file holds the same model under llama.cpp's metadata keys, names and conventions.
This module turns the second into the first, so that one Hugging Face -> qkv mapping
serves both:

- :func:`gguf_config`: the ``config.json`` a Hugging Face folder of the model would hold
  (its keys as those files spell them: ``rope_theta``, ``rope_scaling``, ...);
- :func:`gguf_state_dict`: every tensor under its Hugging Face name, with llama.cpp's
  conventions undone: the RoPE row order of ``attn_q``/``attn_k`` in ``llama`` files,
  Gemma's norm weights stored as ``1 + w``, GPT-2's ``Conv1D`` weights stored transposed.

Supported architectures (``general.architecture``): ``llama`` (Llama, SmolLM2 and Mistral
files all say ``llama``), ``qwen2``, ``qwen3``, ``gemma3`` and ``gpt2``.

The configuration says what llama.cpp would run, which is not always what the original
``config.json`` said; llama.cpp's converter drops what its runtime does not use:

- ``llama`` files: no sliding window (llama.cpp runs Mistral v0.1 with full attention);
  ``model_type`` is ``"mistral"`` when ``general.name`` says Mistral, else ``"llama"``.
- ``gemma3`` files: llama.cpp fixes what the file does not say: every sixth layer is
  global (layer ``i`` is full iff ``(i + 1) % 6 == 0``) when the file has a sliding window,
  every layer otherwise; the sliding layers' RoPE base is 10000; the query scale is
  ``head_dim ** -0.5``, except for 62-layer models (Gemma 3 27B), where it is
  ``(hidden_size / num_attention_heads) ** -0.5`` (``query_pre_attn_scalar``).
- Llama 3's RoPE scaling (``rope_type`` ``"llama3"``) is stored as a ``rope_freqs.weight``
  tensor, not as metadata: per RoPE frequency, the divisor the scaling applies (its
  ``factor`` for the low frequencies, 1 for the high ones, a blend between).
  :func:`gguf_config` reads that small tensor and gives back the ``rope_scaling`` whose
  divisors it holds (:func:`llama3_scaling`); :func:`gguf_state_dict` leaves it out.
- ``tie_word_embeddings`` is True when the file has no ``output.weight``. GPT-2 files from
  older converters hold a copy of the embedding there: they come back untied, with
  ``lm_head.weight`` equal to ``transformer.wte.weight``.
- ``qwen2`` files get no ``attention_bias`` key (Hugging Face's Qwen2 always has a query,
  key and value bias and no output bias); the other families get
  ``attention_bias = True`` iff the file has ``blk.0.attn_q.bias``.

Floats stored as float32 (``1e-5`` is ``9.99999974738e-06`` there) are given back as the
shortest decimal that rounds to the same float32 (``1e-05``), as ``config.json`` spells it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import MAX_SIZE, check_float, check_int, show
from ..positional import rope_frequencies
from ..utils.fileio import fsync_dir, temp_path
from .gguf_weights import (
    GGUFHeader,
    GGUFTensorInfo,
    import_gguf,
    open_gguf_reader,
    permute_rope,
    read_gguf_header,
    read_gguf_tensors,
    unpermute_rope,
)
from .hf_open import config_fields, field_difference, hf_config, to_qkv

__all__ = ["GGUF_ARCHITECTURES", "gguf_config", "gguf_state_dict", "llama3_scaling",
           "read_gguf_model", "write_gguf"]

# general.architecture -> Hugging Face's model_type
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                "gpt2": "gpt2"}
GGUF_ARCHITECTURES = tuple(_MODEL_TYPES)

_ROPE_BASE = 10000.0  # llama.cpp's rope.freq_base when a file has none
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62
# rope.scaling.* key -> the key of Hugging Face's rope_scaling ("type" and "factor" aside);
# "finetuned" says only how the model was trained.
_ROPE_SCALING_KEYS = {"original_context_length": "original_max_position_embeddings",
                      "attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast",
                      "yarn_beta_slow": "beta_slow"}
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
        ``"gemma3_text"`` or ``"gpt2"``) and the fields of that family's
        ``config.json``: for GPT-2 ``vocab_size``, ``n_positions``, ``n_embd``,
        ``n_layer``, ``n_head``, ``n_inner`` (None: ``4 * n_embd``),
        ``layer_norm_epsilon``; for the others
        ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
        ``max_position_embeddings``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``
        (None or ``{"rope_type", "factor", ...}``), Gemma 3's ``sliding_window``,
        ``layer_types``, ``rope_local_base_freq``, ``query_pre_attn_scalar`` and
        ``final_logit_softcapping``; and ``tie_word_embeddings``.

    Raises:
        ValueError: one line naming the file and the key: an architecture other than
            :data:`GGUF_ARCHITECTURES`, a missing or out-of-range size, sizes that do not
            divide, a ``block_count`` beyond the file's tensors, partial rotary
            embeddings, unknown RoPE scaling keys, a ``rope_freqs`` tensor that is no
            llama3 scaling's (:func:`llama3_scaling`).
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
        "model_type": _MODEL_TYPES[arch], **common, "hidden_size": hidden,
        "intermediate_size": integer("feed_forward_length"), "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": integer("context_length"),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon"),
        "rope_theta": number("rope.freq_base", _ROPE_BASE),
        "rope_scaling": _rope_scaling(meta, where), "hidden_act": "silu",
        "sliding_window": None,
    }
    if arch == "llama" and _ROPE_FREQS in tensors:  # read now that the header is checked
        if config["rope_scaling"] is not None:
            raise ValueError(f"{where}rope.scaling.type is "
                             f"{config['rope_scaling']['rope_type']!r} and the file holds a "
                             f"{_ROPE_FREQS} tensor too: two RoPE scalings, qkv reads one")
        config["rope_scaling"] = llama3_scaling(header, head_dim, config["rope_theta"])
    if arch != "qwen2":
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
    return config


def _rope_scaling(meta: dict[str, Any], where: str) -> dict[str, Any] | None:
    """Hugging Face's ``rope_scaling`` from the ``rope.scaling.*`` keys, as llama.cpp
    reads them: a factor without a type is linear; type "none" or a linear factor of 1
    is no scaling."""
    keys = {k.removeprefix("rope.scaling."): v for k, v in meta.items()
            if k.startswith("rope.scaling.") and k != "rope.scaling.finetuned"}
    kind = keys.pop("type", "linear")
    factor = keys.pop("factor", meta.get("rope.scale_linear"))  # its older name
    unknown = sorted(set(keys) - set(_ROPE_SCALING_KEYS))
    if unknown:
        raise ValueError(f"{where}rope.scaling.{unknown[0]} is not understood by qkv (known: "
                         f"type, factor, {', '.join(_ROPE_SCALING_KEYS)})")
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


def _plan(config: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """llama.cpp's tensor name -> (Hugging Face's name, the shape the GGUF file holds,
    PyTorch's order), every tensor the configuration implies, in llama.cpp's order."""
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
        d, f, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
        q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
        plan = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, d)),
                "output_norm.weight": ("model.norm.weight", (d,))}
        block = {"attn_norm.weight": ("input_layernorm.weight", (d,)),
                 "attn_q.weight": ("self_attn.q_proj.weight", (q, d)),
                 "attn_k.weight": ("self_attn.k_proj.weight", (kv, d)),
                 "attn_v.weight": ("self_attn.v_proj.weight", (kv, d)),
                 "attn_output.weight": ("self_attn.o_proj.weight", (d, q)),
                 "ffn_gate.weight": ("mlp.gate_proj.weight", (f, d)),
                 "ffn_up.weight": ("mlp.up_proj.weight", (f, d)),
                 "ffn_down.weight": ("mlp.down_proj.weight", (d, f))}
        if model_type == "gemma3_text":
            block.update({"post_attention_norm.weight": ("post_attention_layernorm.weight", (d,)),
                          "ffn_norm.weight": ("pre_feedforward_layernorm.weight", (d,)),
                          "post_ffw_norm.weight": ("post_feedforward_layernorm.weight", (d,))})
        else:
            block["ffn_norm.weight"] = ("post_attention_layernorm.weight", (d,))
        if model_type in ("qwen3", "gemma3_text"):
            block["attn_q_norm.weight"] = ("self_attn.q_norm.weight", (hd,))
            block["attn_k_norm.weight"] = ("self_attn.k_norm.weight", (hd,))
        if model_type == "qwen2" or config.get("attention_bias", False):  # Mistral: none
            block["attn_q.bias"] = ("self_attn.q_proj.bias", (q,))
            block["attn_k.bias"] = ("self_attn.k_proj.bias", (kv,))
            block["attn_v.bias"] = ("self_attn.v_proj.bias", (kv,))
        if model_type != "qwen2" and config.get("attention_bias", False):
            block["attn_output.bias"] = ("self_attn.o_proj.bias", (d,))
        for i in range(config["num_hidden_layers"]):
            for name, (hf, shape) in block.items():
                plan[f"blk.{i}.{name}"] = (f"model.layers.{i}.{hf}", shape)
    if not config["tie_word_embeddings"]:
        plan["output.weight"] = ("lm_head.weight", (vocab, plan["token_embd.weight"][1][1]))
    return plan


def _kept_out(config: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensors a file of this configuration holds that the configuration stands for:
    llama3 RoPE scaling's ``rope_freqs``, in :func:`_plan`'s form."""
    scaling = config.get("rope_scaling") or {}
    if config["model_type"] in ("llama", "mistral") and scaling.get("rope_type") == "llama3":
        return {_ROPE_FREQS: ("rope_scaling (llama3)", (config["head_dim"] // 2,))}
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
    extra = [name for name in header.tensors if name not in plan]
    if extra:
        raise ValueError(f"{header.path}: tensor {extra[0]} is not part of a {model_type} "
                         f"model of its metadata ({len(extra)} such tensor(s))")


def _shifted(model_type: str, name: str) -> bool:
    """Whether llama.cpp stored this tensor as ``1 + w``: Gemma's norms."""
    return model_type == "gemma3_text" and name.endswith("norm.weight")


def _to_hf(name: str, tensor: Tensor, config: dict[str, Any]) -> Tensor:
    """One tensor as llama.cpp stores it -> as Hugging Face holds it."""
    model_type, kind = config["model_type"], name.split(".")[-2]
    if model_type in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
        return unpermute_rope(tensor, config["num_attention_heads" if kind == "attn_q"
                                             else "num_key_value_heads"])
    if _shifted(model_type, name):
        return tensor - 1
    if model_type == "gpt2" and name.startswith("blk.") and tensor.dim() == 2:
        return tensor.t().contiguous()  # nn.Linear's (out, in) -> Conv1D's (in, out)
    return tensor


def gguf_state_dict(
    path: str | os.PathLike[str],
    header: GGUFHeader,
    config: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    max_bytes: int | None = None,
) -> dict[str, Tensor]:
    """The GGUF file's tensors under Hugging Face's names, in Hugging Face's conventions.

    Before any tensor is read, the header must list exactly the tensors ``config``
    implies, each of the shape it implies: ``rope_freqs.weight`` too when ``config``'s
    ``rope_scaling`` is llama3's (which stands for it; it is not returned).

    Args:
        path: the ``.gguf`` file.
        header: its :func:`~qkv.models.gguf_weights.read_gguf_header`.
        config: its :func:`gguf_config`.
        dtype: ``torch.float32`` or ``torch.bfloat16`` (quantized weights are expanded in
            float32, then rounded; Gemma's norms have 1 subtracted before rounding).
        max_bytes: refuse before expanding if the tensors would take more than this
            (see :func:`~qkv.models.gguf_weights.read_gguf_tensors`).

    Returns:
        Hugging Face name -> tensor: ``model.embed_tokens.weight`` ``(vocab, hidden)``,
        ``model.layers.{i}.self_attn.q_proj.weight`` ``(heads * head_dim, hidden)``, ...,
        ``lm_head.weight`` only when untied; for GPT-2 ``transformer.wte.weight``,
        ``transformer.h.{i}.attn.c_attn.weight`` ``(n_embd, 3 * n_embd)`` (``Conv1D``'s
        ``(in, out)``), .... Everything the matching ``*ForCausalLM`` holds, its tied
        ``lm_head.weight`` aside.

    Raises:
        ValueError: one line: a tensor missing, of another shape or not part of the
            model; as :func:`~qkv.models.gguf_weights.read_gguf_tensors`.
    """
    model_type = config["model_type"]
    plan = _plan(config)
    _check_tensors(header, {**plan, **_kept_out(config)}, model_type)
    # Gemma's norms come as 1 + w; w keeps its precision only if 1 is subtracted before
    # rounding to bfloat16. They are a few KiB, read first, and counted in the budget.
    wide = [n for n in plan if dtype != torch.float32 and _shifted(model_type, n)]
    tensors = read_gguf_tensors(path, wide, torch.float32, max_bytes=max_bytes, header=header)
    if max_bytes is not None:
        max_bytes -= sum(t.numel() * t.element_size() for t in tensors.values())
    tensors.update(read_gguf_tensors(path, [n for n in plan if n not in tensors], dtype,
                                     max_bytes=max_bytes, header=header))
    return {hf_name: _to_hf(name, tensors.pop(name), config).to(dtype)
            for name, (hf_name, _) in plan.items()}


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
            "gemma3_text": "gemma3"}
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
        "rope.freq_base": (config["rope_theta"], f32),
    }
    scaling = config["rope_scaling"] or {}
    if scaling.get("rope_type") == "linear":  # llama3's is a tensor (_rope_freqs)
        meta["rope.scaling.type"] = ("linear", string)
        meta["rope.scaling.factor"] = (scaling["factor"], f32)
    if arch == "gemma3":
        if config["sliding_window"] is not None:
            meta["attention.sliding_window"] = (config["sliding_window"], u32)
        meta["rope.freq_base_swa"] = (config["rope_local_base_freq"], f32)
    return meta


def _rope_freqs(config: dict[str, Any]) -> Tensor | None:
    """The ``rope_freqs.weight`` llama.cpp reads llama3 RoPE scaling from (``llama`` files):
    per frequency, the divisor the scaling applies, float32; None without that scaling."""
    if not _kept_out(config):
        return None
    head_dim, base, scaling = config["head_dim"], config["rope_theta"], config["rope_scaling"]
    return (rope_frequencies(head_dim, base) / rope_frequencies(head_dim, base, scaling)
            ).float()


def _to_gguf(name: str, tensor: Tensor, config: dict[str, Any]) -> Tensor:
    """One tensor as Hugging Face holds it -> as llama.cpp stores it (:func:`_to_hf`'s
    inverse), float32."""
    model_type, kind = config["model_type"], name.split(".")[-2]
    tensor = tensor.detach().cpu().float()
    if model_type in ("llama", "mistral") and kind in ("attn_q", "attn_k"):
        return permute_rope(tensor, config["num_attention_heads" if kind == "attn_q"
                                           else "num_key_value_heads"])
    if _shifted(model_type, name):
        return tensor + 1
    return tensor


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
    as ``1 + w``, Llama 3's RoPE scaling as a ``rope_freqs.weight`` tensor. Norms and
    other 1-D tensors are F32, as llama.cpp's converter writes them; 2-D weights
    ``dtype``.

    Before anything is written the model must read back as itself: the header the file
    will have, read by :func:`gguf_config`, must give ``config``'s ``GPTConfig`` fields
    (:func:`~qkv.models.hf_open.config_fields`). What llama.cpp's format cannot say (a
    window on a Llama or Qwen model, Gemma 3 layers other than five sliding to one full,
    RoPE scaling other than linear and Llama 3's, ...) is a one-line ``ValueError``; so
    are biases on a Qwen3 or Gemma 3 model's projections, which llama.cpp's
    ``attn_output`` lacks there.

    Args:
        path: the ``.gguf`` file to write; it must not exist. It is written under a
            temporary name beside it, then renamed: it appears whole or not at all.
        config: the model's ``config.json`` (``model_type`` ``"llama"``, ``"mistral"``,
            ``"qwen2"``, ``"qwen3"`` or ``"gemma3_text"``).
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
    fields = config_fields(config, "config")
    to_qkv(state_dict, fields)  # checks every name and shape, in one line each
    full = hf_config(fields, model_type)  # every size spelled out
    arch, plan, rope_freqs = _WRITTEN[model_type], _plan(full), _rope_freqs(full)
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
    if rope_freqs is not None:  # the tensor is not in the header above: read it here
        back["rope_scaling"] = _llama3_from_divisors(rope_freqs, full["head_dim"],
                                                     back["rope_theta"], f"{path}: rope")
    difference = field_difference(fields, config_fields(back, str(path)), "llama.cpp")
    if difference:
        raise ValueError(f"config: the model cannot be written to a GGUF {arch} file: "
                         f"{difference} (GPTConfig's fields)")
    tokens = _tokenizer(tokenizer, full["vocab_size"], gguf)
    if os.path.lexists(path):
        raise FileExistsError(f"{path}: exists; name a new file (nothing is overwritten)")

    weight = gguf.GGMLQuantizationType[dtype]
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
        for name, source in tensors.items():
            shape = source.shape if isinstance(source, Tensor) else plan[name][1]
            kind = weight if len(shape) == 2 else gguf.GGMLQuantizationType.F32
            nbytes = math.prod(shape) * (4 if kind == gguf.GGMLQuantizationType.F32 else 2)
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, source in tensors.items():  # one tensor converted at a time
            tensor = source if isinstance(source, Tensor) else _to_gguf(
                name, state_dict[source], full)
            writer.write_tensor_data(_ggml_bytes(tensor, dtype if tensor.dim() == 2 else "F32"))
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
