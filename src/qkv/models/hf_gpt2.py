"""Read a Hugging Face GPT-2 folder (``config.json`` + weights) as :class:`GPTModel` parts.

Hugging Face stores GPT-2 the way OpenAI released it:

- ``Conv1D`` layers, whose weight is ``(in, out)``: the transpose of ``nn.Linear``'s;
- one fused ``c_attn`` projection ``(d, 3d)`` holding the query, key and value
  projections side by side, split here into ``W_query``, ``W_key``, ``W_value``;
- the output head tied to the token embedding (``lm_head`` is often not saved at all);
- biases on every projection, so the model is ``qkv_bias=True``.

Everything is checked before a weight is read: the config's fields and the sizes they
imply, then every tensor's name and shape in the file's header. Weights come from
``model.safetensors``; a folder with only ``pytorch_model.bin`` is read with
``torch.load(weights_only=True)`` (no arbitrary unpickling) and memory-mapped, so it too
is checked before its tensors are copied.

This module does not import :mod:`qkv.models.gpt`; ``GPTModel.from_hf`` builds the model
from :func:`read_config` and :func:`read_weights`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..checks import MAX_SIZE, check_int, parse_json, show

__all__ = ["HF_CONFIG", "HF_SAFETENSORS", "HF_PYTORCH_BIN", "gpt2_fields", "read_config",
           "to_qkv",
           "read_weights", "weights_file"]

HF_CONFIG = "config.json"
HF_SAFETENSORS = "model.safetensors"
HF_PYTORCH_BIN = "pytorch_model.bin"
_MAX_CONFIG_BYTES = 1 << 20


def read_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """``GPTConfig`` fields from the folder's ``config.json``; a one-line ``ValueError``
    names any field qkv's ``GPTModel`` cannot reproduce."""
    path = Path(folder) / HF_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a Hugging Face GPT-2 folder has "
                                f"{HF_CONFIG} and {HF_SAFETENSORS})")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: {path.stat().st_size:,} bytes is too large for a config")
    try:
        config = parse_json(path.read_bytes())
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return gpt2_fields(config, str(path))


def gpt2_fields(config: Any, where: str) -> dict[str, Any]:
    """``GPTConfig`` fields from a GPT-2 ``config.json`` object; ``where`` names it in
    the one-line ``ValueError`` that refuses any field qkv's ``GPTModel`` cannot
    reproduce."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {show(config)}")

    def field(name: str, default: Any = None) -> Any:
        return config.get(name, default)

    model_type = field("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"{where}: model_type must be 'gpt2', got {show(model_type)}")
    sizes = {}
    for ours, theirs in (("vocab_size", "vocab_size"), ("context_length", "n_positions"),
                         ("emb_dim", "n_embd"), ("n_heads", "n_head"),
                         ("n_layers", "n_layer")):
        value = field(theirs)
        check_int(f"{where}: {theirs}", value, 1, MAX_SIZE)
        sizes[ours] = value
    if sizes["emb_dim"] % sizes["n_heads"]:
        raise ValueError(f"{where}: n_embd ({sizes['emb_dim']}) must be divisible by "
                         f"n_head ({sizes['n_heads']})")
    # What qkv's GPTModel computes; anything else would load and give other outputs.
    fixed: dict[str, tuple[Any, Callable[[Any], bool]]] = {
        "n_inner": (None, lambda v: v is None or v == 4 * sizes["emb_dim"]),
        "activation_function": ("gelu_new", lambda v: v in ("gelu_new", "gelu_pytorch_tanh")),
        "layer_norm_epsilon": (1e-5, lambda v: isinstance(v, (int, float))
                               and math.isclose(v, 1e-5)),
        "scale_attn_weights": (True, lambda v: v is True),
        "scale_attn_by_inverse_layer_idx": (False, lambda v: v is False),
        "add_cross_attention": (False, lambda v: v is False),
    }
    for name, (default, ok) in fixed.items():
        value = field(name, default)
        if not ok(value):
            raise ValueError(f"{where}: {name}={show(value)} is not supported (qkv's "
                             f"GPTModel is GPT-2's: {name}={show(default)})")
    tie = field("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ValueError(f"{where}: tie_word_embeddings must be true or false, "
                         f"got {show(tie)}")
    drop = field("attn_pdrop", 0.1)
    if not isinstance(drop, (int, float)) or isinstance(drop, bool) or not 0 <= drop < 1:
        raise ValueError(f"{where}: attn_pdrop must be a number in [0, 1), "
                         f"got {show(drop)}")
    return {**sizes, "drop_rate": float(drop), "qkv_bias": True, "tie_weights": tie}


def weights_file(folder: str | os.PathLike[str]) -> Path:
    """The folder's weights: ``model.safetensors``, else ``pytorch_model.bin``."""
    folder = Path(folder)
    for name in (HF_SAFETENSORS, HF_PYTORCH_BIN):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder}: has neither {HF_SAFETENSORS} nor {HF_PYTORCH_BIN} "
                            "(sharded checkpoints are not supported)")


def _expected(fields: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hugging Face's name and shape of every tensor GPT-2 needs (``lm_head`` aside)."""
    V, T, d, L = (fields["vocab_size"], fields["context_length"], fields["emb_dim"],
                  fields["n_layers"])
    yield "wte.weight", (V, d)
    yield "wpe.weight", (T, d)
    for i in range(L):
        h = f"h.{i}"
        for ln in ("ln_1", "ln_2"):
            yield f"{h}.{ln}.weight", (d,)
            yield f"{h}.{ln}.bias", (d,)
        yield f"{h}.attn.c_attn.weight", (d, 3 * d)
        yield f"{h}.attn.c_attn.bias", (3 * d,)
        yield f"{h}.attn.c_proj.weight", (d, d)
        yield f"{h}.attn.c_proj.bias", (d,)
        yield f"{h}.mlp.c_fc.weight", (d, 4 * d)
        yield f"{h}.mlp.c_fc.bias", (4 * d,)
        yield f"{h}.mlp.c_proj.weight", (4 * d, d)
        yield f"{h}.mlp.c_proj.bias", (d,)
    yield "ln_f.weight", (d,)
    yield "ln_f.bias", (d,)


def _strip(name: str) -> str:
    # GPT2LMHeadModel saves its body under "transformer."; GPT2Model saves it bare.
    return name[len("transformer."):] if name.startswith("transformer.") else name


def read_weights(
    folder: str | os.PathLike[str], fields: Mapping[str, Any]
) -> dict[str, Tensor]:
    """A ``GPTModel(GPTConfig(**fields))`` state dict from the folder's weights.

    Every name and shape is checked against ``fields`` first (from the safetensors
    header, or from the memory-mapped ``pytorch_model.bin``); a missing, unexpected or
    misshapen tensor is a one-line ``ValueError``, and so is one that is not floating
    point or holds NaN or an infinity. The attention's causal-mask buffers
    some checkpoints carry are skipped.
    """
    path = weights_file(folder)
    expected = dict(_expected(fields))
    if not fields["tie_weights"]:
        expected["lm_head.weight"] = (fields["vocab_size"], fields["emb_dim"])
    if path.name == HF_SAFETENSORS:
        from safetensors import safe_open

        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a safetensors file ({error})") from None
        with handle as f:
            names = list(f.keys())  # a safe_open handle is no dict: it has no __iter__
            shapes = {_strip(k): tuple(f.get_slice(k).get_shape()) for k in names}
            _check_names(path, shapes, expected)
            _check_dtypes(path, {_strip(k): f.get_slice(k).get_dtype() for k in names
                                 if _strip(k) in expected})
            raw = {_strip(k): f.get_tensor(k) for k in names if _strip(k) in expected}
    else:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # the safe unpickler's refusals come in many types
            raise ValueError(f"{path}: not a weights-only PyTorch zip file ({error}); "
                             f"convert it to {HF_SAFETENSORS}") from None
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()):
            raise ValueError(f"{path}: expected a dict of named tensors")
        shapes = {_strip(k): tuple(v.shape) for k, v in loaded.items()}
        _check_names(path, shapes, expected)
        raw = {_strip(k): v for k, v in loaded.items() if _strip(k) in expected}
        _check_dtypes(path, {k: v.dtype for k, v in raw.items()})
    _check_finite(path, raw)
    return to_qkv(raw, fields)


# safetensors' names of the floating-point dtypes (its header's "dtype" field).
_FLOAT_NAMES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def _check_dtypes(path: Path, dtypes: Mapping[str, str | torch.dtype]) -> None:
    """One-line ``ValueError`` naming the first tensor that is not floating point.

    Weights are numbers a model computes with in floating point; integer or boolean
    ones (a quantised or mislabelled file) would be converted without complaint and
    give a model that computes nonsense.
    """
    for name, dtype in dtypes.items():
        floating = (dtype.is_floating_point if isinstance(dtype, torch.dtype)
                    else dtype in _FLOAT_NAMES)
        if not floating:
            shown = str(dtype).removeprefix("torch.")
            raise ValueError(f"{path}: {name} holds {shown} values; GPT-2's weights are "
                             "floating point (float32, float16 or bfloat16)")


def _check_finite(path: Path, raw: Mapping[str, Tensor]) -> None:
    """One-line ``ValueError`` naming the first tensor holding NaN or an infinity: a
    model built from it outputs NaN, and every later command would refuse the run."""
    for name, tensor in raw.items():
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{path}: {name} holds {bad:,} NaN or infinite value(s) of "
                             f"{tensor.numel():,}; the weights are damaged")


def _check_names(path: Path, shapes: Mapping[str, tuple[int, ...]],
                 expected: Mapping[str, tuple[int, ...]]) -> None:
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise ValueError(f"{path}: missing {len(missing)} tensors, e.g. {missing[0]!r}")
    # lm_head.weight of a tied model is the embedding again; attn.bias/masked_bias are
    # the causal mask, rebuilt by qkv's attention.
    extra = [k for k in shapes if k not in expected and k != "lm_head.weight"
             and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if extra:
        raise ValueError(f"{path}: {len(extra)} unexpected tensors for this config, "
                         f"e.g. {extra[0]!r}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ValueError(f"{path}: {name} has shape {list(shapes[name])}, expected "
                             f"{list(shape)} from {HF_CONFIG}")


def to_qkv(raw: Mapping[str, Tensor], fields: Mapping[str, Any]) -> dict[str, Tensor]:
    """Hugging Face GPT-2 names and layouts (``Conv1D``'s ``(in, out)`` weights, the fused
    ``c_attn``; with or without the ``transformer.`` prefix) -> ``GPTModel``'s state dict
    (float32, contiguous). ``fields``: the :func:`gpt2_fields` of the model."""
    raw = {_strip(k): v for k, v in raw.items()}
    d = fields["emb_dim"]

    def t(name: str) -> Tensor:
        return raw[name].float().t().contiguous()  # Conv1D (in, out) -> Linear (out, in)

    def v(name: str) -> Tensor:
        return raw[name].float().clone()

    out = {"tok_emb.weight": v("wte.weight"), "pos_emb.weight": v("wpe.weight")}
    for i in range(fields["n_layers"]):
        h, b = f"h.{i}", f"trf_blocks.{i}"
        q, k, value = raw[f"{h}.attn.c_attn.weight"].float().split(d, dim=1)
        qb, kb, vb = raw[f"{h}.attn.c_attn.bias"].float().split(d)
        for name, weight, bias in (("W_query", q, qb), ("W_key", k, kb),
                                   ("W_value", value, vb)):
            out[f"{b}.att.{name}.weight"] = weight.t().contiguous()
            out[f"{b}.att.{name}.bias"] = bias.clone()
        out[f"{b}.att.out_proj.weight"] = t(f"{h}.attn.c_proj.weight")
        out[f"{b}.att.out_proj.bias"] = v(f"{h}.attn.c_proj.bias")
        out[f"{b}.ff.layers.0.weight"] = t(f"{h}.mlp.c_fc.weight")
        out[f"{b}.ff.layers.0.bias"] = v(f"{h}.mlp.c_fc.bias")
        out[f"{b}.ff.layers.2.weight"] = t(f"{h}.mlp.c_proj.weight")
        out[f"{b}.ff.layers.2.bias"] = v(f"{h}.mlp.c_proj.bias")
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out[f"{b}.{ours}.scale"] = v(f"{h}.{theirs}.weight")
            out[f"{b}.{ours}.shift"] = v(f"{h}.{theirs}.bias")
    out["final_norm.scale"] = v("ln_f.weight")
    out["final_norm.shift"] = v("ln_f.bias")
    out["out_head.weight"] = out["tok_emb.weight"] if fields["tie_weights"] else \
        v("lm_head.weight")
    return out
