"""A GPT-2 style decoder: the model of LLMs-from-scratch chapter 4, with a KV cache.

    cfg = GPTConfig.preset("tiny", vocab_size=tok.n_vocab)
    model = GPTModel(cfg)
    logits = model(idx)                                   # (batch, T) -> (batch, T, vocab)
    out = generate(model, idx, max_new_tokens=50, temperature=0.8, top_k=40)

The classes keep the book's names, attributes and parameter order (``tok_emb``, ``pos_emb``,
``trf_blocks[i].att.W_query``, ``norm1.scale``, ``ff.layers[0]``, ``final_norm``,
``out_head``), so code and weights written for the book's ``GPTModel`` work here, and the
same seed gives the same parameters. ``GPTModel`` also accepts the book's config dict.

Attention is :class:`qkv.MultiHeadAttention` (fused kernel by default); decoding keeps one
:class:`qkv.KVCache` per layer, so each new token costs one token's worth of work.

Context policy of :func:`generate` (one rule, with or without the cache): the model always
sees the last ``context_size`` tokens, exactly the book's crop. While the sequence fits,
the cache grows by one token per step; once it is full, every further step re-fills it
from the last ``context_size`` tokens (the positions of every kept token shift by one, so
cached keys cannot be reused). Greedy decoding therefore gives the same tokens with and
without the cache, at any length.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..attention_variants import GatedAttention, KVHandoff, SharedKVAttention, SinkAttention
from ..checks import (
    MAX_SIZE,
    check_dropout,
    check_float,
    check_heads,
    check_int,
    check_str,
    show,
    small_divisors,
)
from ..kernels import QUANT_TYPES, unavailable_reason
from ..kv_cache import KVCache
from ..latent_attention import LatentAttention, SparseLatentAttention
from ..linear_attention import GatedDeltaNet
from ..multihead import MultiHeadAttention
from ..options import GPT_PRESETS as PRESETS
from ..options import MAX_NEW_TOKENS
from ..positional import check_rope_scaling
from .moe import Experts, GatedMLP, MoE
from .native_decode import DTYPES as NATIVE_DTYPES
from .native_decode import NativeDecoder

__all__ = [
    "GPTEmbedding",
    "SkipInit",
    "embed_tokens",
    "PRESETS",
    "FeedForward",
    "GatedFeedForward",
    "DenseAndExperts",
    "PerLayerInputs",
    "PerLayerInputGate",
    "GELU",
    "RMSNorm",
    "make_norm",
    "AcrossHeads",
    "ATTENTION_KINDS",
    "PADDED_ATTENTION",
    "LAYOUT_KEYS",
    "LayerSpec",
    "GPTConfig",
    "GPTModel",
    "LayerNorm",
    "TransformerBlock",
    "MAX_NEW_TOKENS",
    "check_max_new_tokens",
    "check_sampling",
    "sampling_probs",
    "generate",
    "generate_text_simple",
    "native_unsupported",
]


# ----------------------------------------------------------------------------
# Configuration

# Overrides of the GPTConfig defaults (which are GPT-2 small, the book's GPT_CONFIG_124M):
# PRESETS, declared in qkv.options with the other names the command line offers.


NORMS = ("layernorm", "rmsnorm", "gemma_rmsnorm")
MLPS = ("gelu", "swiglu", "geglu")
LAYER_TYPES = ("sliding", "full")
# What an entry of GPTConfig.layout may say of its layer (its window is layer_types'):
#   "attention": the attention class, a key of ATTENTION_KINDS (default "mha");
#   "rope": False for a layer without positions ("NoPE": SmolLM3, Llama 4; default
#       cfg.rope);
#   "mlp": "dense" (cfg.mlp's MLP) or "moe" (cfg.moe's mixture of experts);
#   "kv_source": for "shared_kv" layers, the earlier layer whose keys and values they use;
#   "head_dim", "kv_heads": the layer's head size and key/value heads, where they differ
#       from the model-wide ones (Gemma 4's full layers: 512-wide heads, fewer of them);
#   "hidden_dim": its MLP's width, where it differs (Gemma 4's shared layers: twice);
#   "options": more options of its attention class, over attention_options[kind]
#       (Gemma 4's full layers: {"values_from_keys": True}).
LAYOUT_KEYS = ("attention", "rope", "mlp", "kv_source", "head_dim", "kv_heads",
               "hidden_dim", "options")
# "dense_and_moe": a dense MLP and the experts side by side, each with its own norms,
# their outputs added (Gemma 4's MoE models: DenseAndExperts).
LAYER_MLPS = ("dense", "moe", "dense_and_moe")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's makeup, as :meth:`GPTConfig.layer_spec` resolves it from the config.

    Attributes:
        attention: the attention class's name in :data:`ATTENTION_KINDS`.
        window: the sliding window in tokens, or None (every earlier token).
        rope: whether the layer rotates its queries and keys (False: no positions).
        rope_base, rope_scaling: its RoPE frequencies (:meth:`GPTConfig.layer_rope`).
        mlp: ``"dense"``, ``"moe"`` or ``"dense_and_moe"``.
        kv_source: the layer whose keys and values a ``"shared_kv"`` layer attends with.
        head_dim, kv_heads: its attention's head size and key/value heads.
        hidden_dim: its dense MLP's width (None: ``4 * emb_dim``).
        options: its attention class's options (``attention_options[attention]`` and
            the layer's own).
    """

    attention: str = "mha"
    window: int | None = None
    rope: bool = False
    rope_base: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    mlp: str = "dense"
    kv_source: int | None = None
    head_dim: int = 64
    kv_heads: int = 12
    hidden_dim: int | None = None
    options: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------
# Input embeddings (the book's ch. 2)


def embed_tokens(
    tok_emb: nn.Embedding, pos_emb: nn.Embedding, idx: Tensor, start_pos: int = 0
) -> Tensor:
    """Token plus absolute-position embeddings: ``(batch, T) -> (batch, T, dim)``.

    Token ``t`` of the input sits at position ``start_pos + t``; ``start_pos > 0`` is for
    new tokens appended after ``start_pos`` cached ones. Shared by :class:`GPTEmbedding` and
    :class:`GPTModel`, which keeps the book's attribute names.
    """
    if idx.dim() != 2:
        raise ValueError(f"token ids must have shape (batch, tokens), got {tuple(idx.shape)}")
    context_length = pos_emb.num_embeddings
    end = start_pos + idx.shape[1]
    if end > context_length:
        raise ValueError(f"sequence of {end} tokens is longer than context_length={context_length}")
    positions = torch.arange(start_pos, end, device=idx.device)
    # (batch, T, dim) + (T, dim): the position rows broadcast over the batch
    return tok_emb(idx) + pos_emb(positions)


class GPTEmbedding(nn.Module):
    """Learned token and absolute-position embeddings, summed (LLMs-from-scratch §2.8).

    ``tok_emb = nn.Embedding(vocab_size, emb_dim)`` and ``pos_emb = nn.Embedding(
    context_length, emb_dim)``, created in that order (so a seed gives the book's numbers).

    Shapes: ``idx (batch, T) -> (batch, T, emb_dim)``, ``T <= context_length``.
    """

    def __init__(self, vocab_size: int, emb_dim: int, context_length: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, emb_dim)
        self.pos_emb = nn.Embedding(context_length, emb_dim)

    def forward(self, idx: Tensor, start_pos: int = 0) -> Tensor:
        return embed_tokens(self.tok_emb, self.pos_emb, idx, start_pos)


def _score_flops_per_token(att: nn.Module, width: int, tokens: int,
                           window: int | None) -> float:
    """Forward FLOPs per token an attention layer spends beyond its projections on a
    window of ``tokens`` (a sliding layer: at most its window): its forward on the
    ``meta`` device under PyTorch's FLOP counter, less ``2 x`` its linear weights per
    token."""
    from torch.utils.flop_counter import FlopCounterMode

    T = tokens if window is None else min(tokens, window)
    x = torch.empty(1, T, width, device="meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        att(x)
    linear = sum(m.weight.numel() for m in att.modules() if isinstance(m, nn.Linear))
    return (counter.get_total_flops() - 2 * T * linear) / T



class SkipInit(TorchFunctionMode):
    """Inside this mode ``torch.nn.init``'s initialisers (``normal_``, ``uniform_``,
    ``kaiming_uniform_``, ...) return their tensor untouched: for building a model on
    the ``meta`` device, where there are no values to set. Why it matters: PyTorch
    computes ``normal_`` of a meta tensor in Python through ``torch._dynamo``, whose
    first use imports it with sympy, ~70 MB of resident memory for the rest of the
    process (a loaded model's process, which then holds them beside the weights)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in _INITIALISERS:
            return args[0] if args else next(iter(kwargs.values()))
        return func(*args, **(kwargs or {}))


# Every in-place initialiser torch.nn.init defines (their names end in "_").
_INITIALISERS = frozenset(getattr(nn.init, name) for name in dir(nn.init)
                          if name.endswith("_") and not name.startswith("_")
                          and callable(getattr(nn.init, name)))

@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPTModel`; the defaults are GPT-2 small (the book's 124M).

    The field names are the keys of the book's ``GPT_CONFIG_124M`` dict, so
    ``GPTConfig.from_dict(GPT_CONFIG_124M)`` and ``cfg["emb_dim"]`` both work.

    Attributes:
        vocab_size: number of token ids (the tokenizer's ``n_vocab``).
        context_length: longest sequence; the size of the position embedding.
        emb_dim: model width; must split into ``n_heads`` heads.
        n_heads, n_layers: attention heads per block, transformer blocks.
        drop_rate: dropout on embeddings, attention weights and residual branches.
        qkv_bias: bias on the query/key/value projections (GPT-2's checkpoints have one).
        tie_weights: share the token embedding matrix with the output head.
        n_kv_groups: key/value heads per layer, dividing ``n_heads`` (grouped-query
            attention); None: one per query head, as in GPT-2.
        window_size: each token attends to its last ``window_size`` tokens (sliding
            window); None: to all before it.
        rope: rotary position embeddings in every attention layer instead of the learned
            position table (the model then has no ``pos_emb``); ``rope_base`` sets their
            frequencies. With ``rope`` and a ``window_size``, generation with the KV cache
            runs past ``context_length``.

    The last four default to GPT-2's choices, so the book's configurations and numbers
    are unchanged; see :class:`qkv.MultiHeadAttention` for what each does.

    Today's open models (Llama, SmolLM2, Mistral, Qwen2/3, Gemma 3) differ from GPT-2
    in the pieces below; each defaults to GPT-2's choice (``docs/models.md`` lists each
    family's settings):

    Attributes:
        norm: ``"layernorm"`` (GPT-2), ``"rmsnorm"`` (Llama, Qwen) or
            ``"gemma_rmsnorm"`` (RMSNorm scaled by ``1 + w`` in float32); ``norm_eps``
            its epsilon.
        post_norms: also normalise each sub-layer's output before it is added back
            (Gemma 3's post-attention and post-feed-forward norms).
        mlp: ``"gelu"`` (GPT-2's ``Linear, GELU, Linear``), ``"swiglu"``
            (``fc3(silu(fc1 x) * fc2 x)``, Llama, Qwen) or ``"geglu"`` (the same with
            tanh-GELU, Gemma); ``hidden_dim`` its width (None: ``4 * emb_dim``),
            ``mlp_bias`` biases on its layers.
        head_dim: size of each attention head (None: ``emb_dim // n_heads``; Gemma and
            Qwen3 use wider heads than that); ``out_bias`` a bias on ``out_proj``.
        qk_norm: normalise each query and key head (a norm of kind ``norm``) before RoPE.
        query_scale: factor on ``q k^T``; None: ``head_dim ** -0.5``.
        layer_types: per layer ``"sliding"`` (attends to its last ``window_size``
            tokens) or ``"full"``; None: every layer is windowed if ``window_size`` is set.
        rope_local_base: the RoPE base of the sliding layers, when it differs from
            ``rope_base`` (Gemma 3: 10,000 for local layers, 1,000,000 for global).
        rope_scaling: stretch RoPE past the trained context, e.g. ``{"rope_type":
            "llama3", ...}`` (:func:`qkv.positional.check_rope_scaling`); with
            ``rope_local_base`` it applies to the full layers only, as in Gemma 3.
        embed_scale: multiply the token embeddings by ``sqrt(emb_dim)`` (Gemma).

    The models of 2025-26 mix kinds of layers. What differs from layer to layer beyond
    its window is one entry per layer in ``layout``; what a kind needs is declared once:

    Attributes:
        layout: per layer, a dict of :data:`LAYOUT_KEYS`: its attention class
            (``{"attention": "mha"}``, a key of :data:`ATTENTION_KINDS`), RoPE or none
            (``{"rope": False}``), a dense MLP or experts (``{"mlp": "moe"}``); a key
            left out takes the model-wide choice. None: every layer ``"mha"`` and dense,
            as before (:meth:`layer_spec` resolves a layer).
        attention_options: per attention kind other than ``"mha"``, the options its
            class takes beside the model-wide sizes (``{"latent": {"kv_lora_rank": 512,
            ...}}``).
        moe: the mixture of experts' options (:class:`qkv.models.moe.MoE`) for layers
            with ``"mlp": "moe"``.
        pre_norms: normalise each sub-layer's input (default); False with
            ``post_norms``: only its output (OLMo 2 and 3).
        qk_norm_full: the QK-norm spans all heads of the projection at once (OLMo 2 and
            3) instead of each head.

    Gemma 4's additions to the residual stream and the output:

    Attributes:
        per_layer_inputs: ``{"width": P, "vocab_size": V}``: per-layer input embeddings
            (:class:`PerLayerInputs`): each token gets a ``P``-wide input of its own in
            every layer, from a ``V x (n_layers * P)`` table and a projection of its
            embedding, which each block gates into its residual stream
            (:class:`PerLayerInputGate`). None: none.
        layer_scalar: each block multiplies its output by a stored scalar (a buffer
            ``layer_scalar (1,)``, one at first).
        logit_softcap: the logits pass through ``c * tanh(logits / c)``; None: as they
            are.
    """

    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False
    tie_weights: bool = False
    n_kv_groups: int | None = None
    window_size: int | None = None
    rope: bool = False
    rope_base: float = 10_000.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    post_norms: bool = False
    mlp: str = "gelu"
    hidden_dim: int | None = None
    mlp_bias: bool = True
    head_dim: int | None = None
    out_bias: bool = True
    qk_norm: bool = False
    query_scale: float | None = None
    layer_types: list[str] | None = None
    rope_local_base: float | None = None
    rope_scaling: dict[str, Any] | None = None
    embed_scale: bool = False
    layout: list[dict[str, Any]] | None = None
    attention_options: dict[str, dict[str, Any]] | None = None
    moe: dict[str, Any] | None = None
    pre_norms: bool = True
    qk_norm_full: bool = False
    per_layer_inputs: dict[str, int] | None = None
    layer_scalar: bool = False
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        # The cap keeps every dimension an int32; whether the model fits in memory is a
        # separate check (num_parameters, qkv.training.limits).
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            check_int(f"GPTConfig.{name}", getattr(self, name), 1, MAX_SIZE)
        for name in ("n_kv_groups", "window_size", "hidden_dim", "head_dim"):
            if getattr(self, name) is not None:
                check_int(f"GPTConfig.{name}", getattr(self, name), 1, MAX_SIZE)
        for name in ("qkv_bias", "tie_weights", "rope", "post_norms", "mlp_bias", "out_bias",
                     "qk_norm", "embed_scale", "pre_norms", "qk_norm_full",
                     "layer_scalar"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"GPTConfig.{name} must be True or False, got {show(getattr(self, name))}"
                )
        self.drop_rate = check_float("GPTConfig.drop_rate", self.drop_rate)  # NaN, inf fail
        check_dropout(self.drop_rate)
        check_str("GPTConfig.norm", self.norm, choices=NORMS)
        check_str("GPTConfig.mlp", self.mlp, choices=MLPS)
        self.norm_eps = check_float("GPTConfig.norm_eps", self.norm_eps, 0.0, 1.0,
                                    lo_open=True)
        if self.query_scale is not None:
            self.query_scale = check_float("GPTConfig.query_scale", self.query_scale, 0.0,
                                           lo_open=True)
        if self.rope_local_base is not None:
            self.rope_local_base = check_float("GPTConfig.rope_local_base",
                                               self.rope_local_base, 1.0, lo_open=True)
        self.rope_scaling = check_rope_scaling(self.rope_scaling, "GPTConfig.rope_scaling")
        if (self.rope_scaling is not None or self.rope_local_base is not None) and not self.rope:
            raise ValueError("GPTConfig.rope_scaling and rope_local_base need rope=True")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, (list, tuple)) or \
                    len(self.layer_types) != self.n_layers or \
                    any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"GPTConfig.layer_types must list {LAYER_TYPES[0]!r} or "
                                 f"{LAYER_TYPES[1]!r} for each of the {self.n_layers} layers, "
                                 f"got {show(self.layer_types)}")
            self.layer_types = list(self.layer_types)
            if "sliding" in self.layer_types and self.window_size is None:
                raise ValueError("GPTConfig.layer_types has sliding layers but no window_size")
        if self.head_dim is None:  # the heads split the width
            if self.emb_dim % self.n_heads != 0:
                # (check_heads would list the divisors by trying every number up to emb_dim)
                raise ValueError(
                    f"emb_dim ({self.emb_dim}) must be divisible by num_heads "
                    f"({self.n_heads}); e.g. num_heads in {small_divisors(self.emb_dim)}"
                )
            check_heads(self.emb_dim, self.n_heads, name="emb_dim")
        if self.n_kv_groups is not None and self.n_heads % self.n_kv_groups:
            raise ValueError(f"GPTConfig.n_kv_groups ({self.n_kv_groups}) must divide "
                             f"n_heads ({self.n_heads})")
        self.rope_base = check_float("GPTConfig.rope_base", self.rope_base, 1.0,
                                     lo_open=True)
        if self.rope and self.attention_head_dim % 2:
            raise ValueError(f"GPTConfig.rope needs an even head size, got "
                             f"{self.attention_head_dim}")
        if not self.pre_norms and not self.post_norms:
            raise ValueError("GPTConfig.pre_norms=False needs post_norms=True: a block "
                             "normalises its sub-layers' inputs, outputs or both")
        if self.qk_norm_full and not self.qk_norm:
            raise ValueError("GPTConfig.qk_norm_full needs qk_norm=True")
        if self.logit_softcap is not None:
            self.logit_softcap = check_float("GPTConfig.logit_softcap", self.logit_softcap,
                                             0.0, lo_open=True)
        if self.per_layer_inputs is not None:
            ple = self.per_layer_inputs
            if not isinstance(ple, dict) or set(ple) != {"width", "vocab_size"}:
                raise ValueError(f"GPTConfig.per_layer_inputs must be None or "
                                 f"{{'width': P, 'vocab_size': V}}, got {show(ple)}")
            for key in ("width", "vocab_size"):
                check_int(f"GPTConfig.per_layer_inputs.{key}", ple[key], 1, MAX_SIZE)
            if not self.rope:
                raise ValueError("GPTConfig.per_layer_inputs needs rope=True (a model "
                                 "without a position table)")
            self.per_layer_inputs = dict(ple)
        self._check_layout()

    def _check_layout(self) -> None:
        """``layout``, ``attention_options`` and ``moe``: their structure, one line each
        (each class checks its own options when it is built)."""
        for name in ("attention_options", "moe"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"GPTConfig.{name} must be an object or None, got "
                                 f"{show(value)}")
        for kind, options in (self.attention_options or {}).items():
            if kind not in ATTENTION_KINDS or not isinstance(options, dict):
                raise ValueError(f"GPTConfig.attention_options maps an attention kind "
                                 f"({', '.join(ATTENTION_KINDS)}) to its options, got "
                                 f"{show(kind)}: {show(options)}")
        if self.layout is None:
            return
        if not isinstance(self.layout, (list, tuple)) or len(self.layout) != self.n_layers:
            raise ValueError(f"GPTConfig.layout must list one entry per layer "
                             f"({self.n_layers}), got {show(self.layout)}")
        self.layout = [dict(entry) if isinstance(entry, dict) else entry
                       for entry in self.layout]
        for i, entry in enumerate(self.layout):
            where = f"GPTConfig.layout[{i}]"
            if not isinstance(entry, dict) or set(entry) - set(LAYOUT_KEYS):
                raise ValueError(f"{where} must be an object of {', '.join(LAYOUT_KEYS)}, "
                                 f"got {show(entry)}")
            kind = entry.get("attention", "mha")
            if kind not in ATTENTION_KINDS:
                raise ValueError(f"{where}.attention is {show(kind)}; choose one of "
                                 f"{', '.join(ATTENTION_KINDS)}")
            if "rope" in entry and (not isinstance(entry["rope"], bool)
                                    or (entry["rope"] and not self.rope)):
                raise ValueError(f"{where}.rope must be True or False, and True only when "
                                 f"GPTConfig.rope is; got {show(entry['rope'])}")
            if entry.get("mlp", "dense") not in LAYER_MLPS:
                raise ValueError(f"{where}.mlp is {show(entry['mlp'])}; choose one of "
                                 f"{', '.join(LAYER_MLPS)}")
            if entry.get("mlp", "dense") != "dense" and self.moe is None:
                raise ValueError(f"{where}.mlp is {show(entry['mlp'])} but GPTConfig.moe "
                                 "is None")
            for key in ("head_dim", "kv_heads", "hidden_dim"):
                if key in entry:
                    check_int(f"{where}.{key}", entry[key], 1, MAX_SIZE)
            if self.n_heads % entry.get("kv_heads", 1):
                raise ValueError(f"{where}.kv_heads ({entry['kv_heads']}) must divide "
                                 f"n_heads ({self.n_heads})")
            if self.rope and entry.get("head_dim", 2) % 2:
                raise ValueError(f"{where}.head_dim must be even with rope, got "
                                 f"{entry['head_dim']}")
            if not isinstance(entry.get("options", {}), dict):
                raise ValueError(f"{where}.options must be an object of the attention "
                                 f"class's options, got {show(entry['options'])}")
            source = entry.get("kv_source")
            if (kind == "shared_kv") != (source is not None):
                raise ValueError(f"{where}: a 'shared_kv' layer, and only one, names its "
                                 f"kv_source; got attention {show(kind)}, kv_source "
                                 f"{show(source)}")
            if source is not None:
                check_int(f"{where}.kv_source", source, 0, i - 1)
                if self.layout[source].get("attention", "mha") == "shared_kv":
                    raise ValueError(f"{where}.kv_source is layer {source}, which computes "
                                     "no keys and values of its own")

    # Per-layer choices, read by the blocks as they are built.

    @property
    def attention_head_dim(self) -> int:
        """Size of each attention head: ``head_dim``, or ``emb_dim // n_heads``."""
        return self.emb_dim // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer: ``n_kv_groups``, or ``n_heads``."""
        return self.n_heads if self.n_kv_groups is None else self.n_kv_groups

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it sees every earlier token)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding":
            return self.window_size
        return None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """RoPE base and scaling of layer ``layer``: a sliding layer of a model with a
        ``rope_local_base`` has that base, unscaled; every other layer ``rope_base`` and
        ``rope_scaling``."""
        if self.rope_local_base is not None and self.layer_window(layer) is not None:
            return self.rope_local_base, None
        return self.rope_base, self.rope_scaling

    def layer_spec(self, layer: int) -> LayerSpec:
        """Everything layer ``layer`` is built from: its ``layout`` entry, with what it
        leaves out taken from the model-wide fields."""
        entry = self.layout[layer] if self.layout is not None else {}
        rope_base, rope_scaling = self.layer_rope(layer)
        kind = entry.get("attention", "mha")
        options = {**(self.attention_options or {}).get(kind, {}), **entry.get("options", {})}
        return LayerSpec(attention=kind,
                         window=self.layer_window(layer), rope=entry.get("rope", self.rope),
                         rope_base=rope_base, rope_scaling=rope_scaling,
                         mlp=entry.get("mlp", "dense"), kv_source=entry.get("kv_source"),
                         head_dim=entry.get("head_dim", self.attention_head_dim),
                         kv_heads=entry.get("kv_heads", self.kv_heads),
                         hidden_dim=entry.get("hidden_dim", self.hidden_dim),
                         options=options)

    # Sizes, from the model this config builds, made on the "meta" device: shapes
    # without storage, so nothing is allocated and no second description of the
    # architecture has to be kept in step with the modules.

    def meta_model(self) -> GPTModel:
        """``GPTModel(self)`` on the ``meta`` device: every module and parameter shape,
        no storage (milliseconds, whatever the model's size). Nothing is initialised
        (:class:`SkipInit`): a meta tensor has no values."""
        with torch.device("meta"), SkipInit():
            return GPTModel(self)

    def num_parameters(self) -> int:
        """Number of parameters of ``GPTModel(self)`` (a tied head counts once)."""
        return sum(p.numel() for p in self.meta_model().parameters())

    def num_saved_values(self) -> int:
        """Numbers a checkpoint of ``GPTModel(self)`` holds: its parameters (a tied head
        once) and its persistent buffers (DeepSeek's expert-choice bias)."""
        model = self.meta_model()
        return (sum(p.numel() for p in model.parameters())
                + sum(b.numel() for name, b in model.named_buffers()
                      if name in model.state_dict()))

    def kv_cache_bytes(self, batch_size: int, tokens: int, *, bytes_per_value: int = 4) -> int:
        """Bytes of the caches that decoding ``tokens`` positions for ``batch_size``
        sequences holds, with the weights in the dtype of ``bytes_per_value`` (2:
        bfloat16, 4: float32, 8: float64): every layer's own cache (its attention's
        ``new_cache``) made on the ``meta`` device and its buffers' bytes counted. So each
        kind counts what it keeps: key/value heads (a sliding layer its ring, allocated
        at its window's size whatever ``tokens``), latent attention's latent and RoPE key,
        a linear-attention layer its fixed state (float32 whatever the weights' dtype),
        nothing for a layer sharing another's."""
        check_int("batch_size", batch_size, 1, MAX_SIZE)
        check_int("tokens", tokens, 1, MAX_SIZE)
        dtypes = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
        if bytes_per_value not in dtypes:
            raise ValueError(f"bytes_per_value must be 2 (bfloat16), 4 (float32) or 8 "
                             f"(float64), got {show(bytes_per_value)}")
        total = 0
        for block in self.meta_model().to(dtypes[bytes_per_value]).trf_blocks:
            cache = block.att.new_cache(batch_size, tokens)
            if cache is not None:
                total += sum(t.numel() * t.element_size() for t in vars(cache).values()
                             if isinstance(t, Tensor))
        return total

    def training_flops_per_token(self, tokens: int | None = None) -> float:
        """Floating-point operations of one training step per token of a ``tokens``-long
        window (default: ``context_length``): the usual count behind "model FLOPs
        utilisation" (MFU), so that figures compare with other trainers'.

        ``6 N`` for the matrix products with the ``N`` weights a token runs through (2
        per multiply-add in the forward pass, twice that in the backward): the
        projections and MLP of every block and the output head (counted even when tied,
        as the product is done either way); of a mixture of experts, the router, the
        shared expert and ``top_k`` routed experts (:meth:`~qkv.models.moe.MoE.
        active_parameters`); embedding look-ups, norms and biases are not products.
        Attention adds three times what each layer's own forward spends beyond its
        projections on one window, counted by PyTorch's FLOP counter on the ``meta``
        device (for multi-head attention ``4 T d`` per token, ``q k^T`` and ``weights @
        v`` over the whole window, without crediting the causal mask's skipped half; a
        sliding layer scores at most its window). Recomputation and padding are not
        counted: this is the model's work, not the hardware's.
        """
        T = self.context_length if tokens is None else tokens
        check_int("tokens", T, 1, MAX_SIZE)
        model = self.meta_model()
        experts = [m for m in model.modules() if isinstance(m, MoE)]
        routed = {id(p) for moe in experts for p in moe.parameters()}
        # every product, the output head's too (counted even when tied)
        matmul_weights = sum(m.weight.numel() for m in model.modules()
                             if isinstance(m, nn.Linear) and id(m.weight) not in routed)
        matmul_weights += sum(moe.active_parameters() for moe in experts)
        measured: dict[str, float] = {}
        attention = 0.0
        for block in model.trf_blocks:
            source = block if block.spec.kv_source is None else \
                model.trf_blocks[block.spec.kv_source]  # the same scores, others' keys
            key = repr(source.spec)
            if key not in measured:
                measured[key] = _score_flops_per_token(source.att, self.emb_dim, T,
                                                       source.spec.window)
            attention += measured[key]
        return 6.0 * matmul_weights + 3.0 * attention

    def num_saved_activations(self, batch_size: int, tokens: int) -> int:
        """A lower bound on the float32 values a training step's forward pass keeps for
        backward, on ``(batch_size, tokens)`` ids: per token, 16 x ``emb_dim`` in each block
        (both LayerNorms' input and output, q, k and v, the attention output, the MLP's
        4 x ``emb_dim`` hidden values before and after GELU) and the log-softmax over the
        vocabulary. Dropout masks and PyTorch's workspace come on top.
        """
        per_token = 16 * self.emb_dim * self.n_layers + self.vocab_size
        return batch_size * tokens * per_token

    def parameter_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every ``state_dict`` entry of ``GPTModel(self)``, in order
        (a tied ``out_head.weight`` is listed too, as ``state_dict`` lists it).

        A generator: a caller comparing with a checkpoint can stop after as many entries
        as the checkpoint holds, however many layers the config claims.
        """
        for name, tensor in self.meta_model().state_dict().items():
            yield name, tuple(tensor.shape)

    def __getitem__(self, key: str) -> Any:
        # the book's classes read their config as a dict: cfg["emb_dim"]
        if key not in self.field_names():
            raise KeyError(
                f"GPTConfig has no field {key!r}; fields: {', '.join(self.field_names())}"
            )
        return getattr(self, key)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able) for a checkpoint; :meth:`from_dict` reverses it.

        The fields of today's open models are left out while they hold GPT-2's default,
        so a GPT-2-style run's ``config.json`` stays what earlier versions wrote."""
        out = asdict(self)
        for name in _OPEN_MODEL_FIELDS:
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPTConfig:
        """Build from a dict (a checkpoint's, or the book's ``GPT_CONFIG_124M``), validated."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a GPTConfig must be a dict of its fields, got {show(d)}")
        unknown = sorted(set(d) - set(cls.field_names()))
        if unknown:
            listed = ", ".join(show(k) for k in unknown[:5])
            raise ValueError(
                f"unknown GPTConfig field(s) [{listed}]; fields: {', '.join(cls.field_names())}"
            )
        return cls(**d)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration from :data:`PRESETS`, with some fields overridden.

        ``GPTConfig.preset("tiny", vocab_size=257)``.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


# The fields added for today's open models (those after rope_base); at their defaults a
# config describes a GPT-2-style model and is saved without them.
_OPEN_MODEL_FIELDS = GPTConfig.field_names()[GPTConfig.field_names().index("rope_base") + 1:]
_DEFAULTS = {f.name: f.default for f in fields(GPTConfig)}


def _as_config(cfg: GPTConfig | Mapping[str, Any]) -> GPTConfig:
    if isinstance(cfg, GPTConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return GPTConfig.from_dict(cfg)
    raise TypeError(f"cfg must be a GPTConfig or a dict, got {type(cfg).__name__}")


# ----------------------------------------------------------------------------
# Building blocks (the book's names)


class LayerNorm(nn.Module):
    """Layer normalisation over the last axis with the book's parameter names.

    ``scale * (x - mean) / sqrt(var + eps) + shift``, biased variance, ``eps = 1e-5``:
    numerically ``nn.LayerNorm(emb_dim)``, run by the same fused kernel.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.scale.shape, self.scale, self.shift, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last axis (Llama, Qwen; Gemma's with ``gemma``).

    ``x / sqrt(mean(x^2) + eps)`` computed in float32, then scaled: by ``scale`` in the
    input's dtype (``scale`` starts at ones), or with ``gemma=True`` by ``1 + scale`` in
    float32 before the result is cast back (``scale`` starts at zeros). Gemma stores
    its weights that way; both roundings are those of the models' own code. With
    ``scaled=False`` there is no ``scale``: the normalised ``x`` itself (Gemma 4's value
    norm and its router's).

    Shapes: ``(..., dim) -> (..., dim)``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, gemma: bool = False,
                 scaled: bool = True) -> None:
        super().__init__()
        self.dim, self.eps, self.gemma = dim, eps, gemma
        self.scale = (nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
                      if scaled else None)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale is None:
            return normed.to(x.dtype)
        if self.gemma:
            return (normed * (1.0 + self.scale.float())).to(x.dtype)
        return self.scale * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps:g}" + (", gemma=True" if self.gemma else "")
                + (", scaled=False" if self.scale is None else ""))


def make_norm(cfg: GPTConfig, dim: int | None = None) -> nn.Module:
    """The norm ``cfg.norm`` names, over ``dim`` features (default ``cfg.emb_dim``)."""
    dim = cfg.emb_dim if dim is None else dim
    if cfg.norm == "layernorm":
        return LayerNorm(dim, cfg.norm_eps)
    return RMSNorm(dim, cfg.norm_eps, gemma=cfg.norm == "gemma_rmsnorm")


class GELU(nn.Module):
    """GELU with GPT-2's tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    """Position-wise MLP: ``Linear(d, 4d) -> GELU -> Linear(4d, d)``, shape-preserving
    (``hidden_dim``, else ``cfg.hidden_dim``, replaces ``4d`` where set)."""

    def __init__(self, cfg: GPTConfig | Mapping[str, Any], hidden_dim: int | None = None
                 ) -> None:
        super().__init__()
        cfg = _as_config(cfg)
        hidden = hidden_dim or cfg.hidden_dim or 4 * cfg.emb_dim
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, hidden, bias=cfg.mlp_bias),
            GELU(),
            nn.Linear(hidden, cfg.emb_dim, bias=cfg.mlp_bias),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    @property
    def out_layer(self) -> nn.Linear:
        """The projection back into the residual stream."""
        return self.layers[2]


class GatedFeedForward(nn.Module):
    """Gated MLP of Llama, Qwen (SwiGLU) and Gemma (GeGLU): ``fc3(act(fc1 x) * fc2 x)``.

    ``fc1`` (the gate) and ``fc2`` (the values) map ``emb_dim -> hidden_dim`` (the
    argument, else ``cfg.hidden_dim``), ``fc3`` maps back; ``act`` is SiLU for
    ``cfg.mlp == "swiglu"``, tanh-GELU for ``"geglu"``. The names are those of
    LLMs-from-scratch's Llama chapters (Hugging Face's ``gate_proj``, ``up_proj``,
    ``down_proj``).

    Shapes: ``(batch, T, emb_dim) -> (batch, T, emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig | Mapping[str, Any], hidden_dim: int | None = None
                 ) -> None:
        super().__init__()
        cfg = _as_config(cfg)
        hidden = hidden_dim or cfg.hidden_dim or 4 * cfg.emb_dim
        self.fc1 = nn.Linear(cfg.emb_dim, hidden, bias=cfg.mlp_bias)
        self.fc2 = nn.Linear(cfg.emb_dim, hidden, bias=cfg.mlp_bias)
        self.fc3 = nn.Linear(hidden, cfg.emb_dim, bias=cfg.mlp_bias)
        self.act: nn.Module = nn.SiLU() if cfg.mlp == "swiglu" else GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.act(self.fc1(x)) * self.fc2(x))

    @property
    def out_layer(self) -> nn.Linear:
        """The projection back into the residual stream."""
        return self.fc3


class AcrossHeads(nn.Module):
    """A norm over every head of a projection at once (OLMo 2 and 3's QK-norm), where
    :class:`qkv.MultiHeadAttention` hands its ``q_norm`` one head at a time: the heads
    are laid side by side, normalised together and split again.

    Shapes: ``(batch, heads, T, head_dim) -> (batch, heads, T, head_dim)``; ``norm``
    normalises ``heads * head_dim`` features.
    """

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor) -> Tensor:
        b, h, t, d = x.shape
        side_by_side = x.transpose(1, 2).reshape(b, t, h * d)
        return self.norm(side_by_side).view(b, t, h, d).transpose(1, 2)


def _qk_norm(cfg: GPTConfig, heads: int, head_dim: int) -> nn.Module | None:
    """The norm of ``heads`` query or key heads of ``head_dim`` that ``cfg.qk_norm`` asks
    for, or None."""
    if not cfg.qk_norm:
        return None
    if cfg.qk_norm_full:
        return AcrossHeads(make_norm(cfg, heads * head_dim))
    return make_norm(cfg, head_dim)


def _mha_arguments(cfg: GPTConfig, spec: LayerSpec) -> dict[str, Any]:
    """:class:`qkv.MultiHeadAttention`'s arguments for a layer of ``cfg``: the ones the
    classes built on it (sinks, gates, shared keys and values) share."""
    head_dim = None if spec.head_dim * cfg.n_heads == cfg.emb_dim else spec.head_dim
    return dict(d_in=cfg.emb_dim, d_out=cfg.emb_dim, context_length=cfg.context_length,
                dropout=cfg.drop_rate, num_heads=cfg.n_heads, qkv_bias=cfg.qkv_bias,
                out_bias=cfg.out_bias,
                num_kv_groups=None if spec.kv_heads == cfg.n_heads else spec.kv_heads,
                window_size=spec.window, rope=spec.rope, rope_base=spec.rope_base,
                rope_scaling=spec.rope_scaling, head_dim=head_dim,
                q_norm=_qk_norm(cfg, cfg.n_heads, spec.head_dim),
                k_norm=_qk_norm(cfg, spec.kv_heads, spec.head_dim), scale=cfg.query_scale)


def _mha(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    # "v_norm": True in the options asks for a scale-free RMSNorm on each value head
    options = dict(spec.options)
    if options.pop("v_norm", False):
        options["v_norm"] = RMSNorm(spec.head_dim, cfg.norm_eps, scaled=False)
    return MultiHeadAttention(**_mha_arguments(cfg, spec), **options)


def _sink(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    return SinkAttention(**_mha_arguments(cfg, spec), **spec.options)


def _gated(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    return GatedAttention(**_mha_arguments(cfg, spec), **spec.options)


def _shared_kv(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    arguments = _mha_arguments(cfg, spec)
    del arguments["k_norm"]  # the keys are the source layer's, normalised there
    return SharedKVAttention(**arguments, **spec.options)


def _latent(cfg: GPTConfig, spec: LayerSpec, kind: str = "latent") -> nn.Module:
    cls = LatentAttention if kind == "latent" else SparseLatentAttention
    return cls(cfg.emb_dim, cfg.n_heads, context_length=cfg.context_length,
               dropout=cfg.drop_rate, bias=cfg.qkv_bias, rope_base=spec.rope_base,
               rope_scaling=spec.rope_scaling, **spec.options)


def _sparse_latent(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    return _latent(cfg, spec, "sparse_latent")


def _gated_deltanet(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    return GatedDeltaNet(cfg.emb_dim, norm_eps=cfg.norm_eps, **spec.options)


# Attention kind (GPTConfig.layout's "attention") -> how a layer of that kind is built
# from the config and the layer's spec. A new mechanism is a class in the attention core
# and one entry here.
_ATTENTION_BUILDERS: dict[str, Callable[[GPTConfig, LayerSpec], nn.Module]] = {
    "mha": _mha,  # multi-head, grouped-query or multi-query attention
    "sink": _sink,  # with a learned sink logit per head (gpt-oss)
    "gated": _gated,  # its output gated per head (Qwen3-Next, Qwen3.5)
    "shared_kv": _shared_kv,  # queries only, an earlier layer's keys and values (Gemma 4)
    "latent": _latent,  # multi-head latent attention (DeepSeek-V2/V3, Kimi K2)
    "sparse_latent": _sparse_latent,  # with DeepSeek's sparse top-k selection (V3.2)
    "gated_deltanet": _gated_deltanet,  # linear attention, a fixed-size state (Qwen3.5)
}
ATTENTION_KINDS = tuple(_ATTENTION_BUILDERS)
# The kinds that take a padding mask (GPTModel.forward's key_padding_mask).
PADDED_ATTENTION = ("mha", "sink", "gated", "shared_kv", "gated_deltanet")


class DenseAndExperts(nn.Module):
    """A dense MLP and a mixture of experts side by side (Gemma 4's MoE models).

    ``x`` is the residual stream and ``h = norm2(x)`` the block's usual MLP input:

        ``out = post_dense_norm(dense(h)) + post_moe_norm(moe(moe_norm(x)))``

    where the experts' router scores ``x`` itself (:class:`~qkv.models.moe.MoE`'s
    ``route_x``). The block then applies its ``post_norm2`` to ``out`` as to any MLP's.

    Shapes: ``h, x (batch, T, emb_dim) -> (batch, T, emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig, hidden_dim: int | None = None) -> None:
        super().__init__()
        self.dense = GatedFeedForward(cfg, hidden_dim)
        self.post_dense_norm = make_norm(cfg)
        self.moe_norm = make_norm(cfg)
        self.moe = MoE(cfg.emb_dim, **(cfg.moe or {}))
        self.post_moe_norm = make_norm(cfg)

    def forward(self, h: Tensor, x: Tensor) -> Tensor:
        dense = self.post_dense_norm(self.dense(h))
        experts = self.post_moe_norm(self.moe(self.moe_norm(x), route_x=x))
        return dense + experts

    @property
    def out_layer(self) -> nn.Linear:
        """The dense MLP's projection back into the residual stream."""
        return self.dense.fc3


class PerLayerInputs(nn.Module):
    """Per-layer input embeddings (Gemma 4's "PLE"): for every token, one ``width``-wide
    input per layer, from the token's id and from its embedding.

        ``ple = (norm(proj(e) / sqrt(emb_dim)) + embed(id) * sqrt(width)) / sqrt(2)``

    where ``e`` is the token's (scaled) embedding, ``embed`` a ``vocab_size x (n_layers *
    width)`` table and ``proj`` a ``Linear(emb_dim, n_layers * width)``, both cut into
    ``n_layers`` slices of ``width``; ``norm`` normalises each slice. Block ``i`` gets
    slice ``i`` (:class:`PerLayerInputGate`). Ids past the table (a larger main
    vocabulary) are refused.

    Shapes: ``idx (batch, T)``, ``e (batch, T, emb_dim) -> (batch, T, n_layers, width)``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        ple = cfg.per_layer_inputs or {}
        self.n_layers, self.width = cfg.n_layers, ple["width"]
        self.embed = nn.Embedding(ple["vocab_size"], cfg.n_layers * self.width)
        self.proj = nn.Linear(cfg.emb_dim, cfg.n_layers * self.width, bias=False)
        self.norm = make_norm(cfg, self.width)

    def forward(self, idx: Tensor, e: Tensor) -> Tensor:
        if idx.numel() and int(idx.max()) >= self.embed.num_embeddings:
            raise ValueError(f"token id {int(idx.max())} is past the per-layer input table's "
                             f"{self.embed.num_embeddings} rows")
        split = (*idx.shape, self.n_layers, self.width)
        # each scale rounded to the weights' dtype, as the embedding's own is
        scale = torch.tensor(self.width ** 0.5, dtype=self.embed.weight.dtype)
        from_id = (self.embed(idx) * scale).view(split)
        from_embedding = self.norm((self.proj(e) * e.shape[-1] ** -0.5).view(split))
        return (from_embedding + from_id) * 2 ** -0.5


class PerLayerInputGate(nn.Module):
    """How a block takes in its per-layer input ``p`` (:class:`PerLayerInputs`):

        ``x + norm(proj(gelu_tanh(gate(x)) * p))``

    ``gate``: ``Linear(emb_dim, width)``, ``proj``: ``Linear(width, emb_dim)``.

    Shapes: ``x (batch, T, emb_dim)``, ``p (batch, T, width) -> (batch, T, emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        width = (cfg.per_layer_inputs or {})["width"]
        self.gate = nn.Linear(cfg.emb_dim, width, bias=False)
        self.proj = nn.Linear(width, cfg.emb_dim, bias=False)
        self.norm = make_norm(cfg)

    def forward(self, x: Tensor, p: Tensor) -> Tensor:
        return x + self.norm(self.proj(F.gelu(self.gate(x), approximate="tanh") * p))


def _feed_forward(cfg: GPTConfig, spec: LayerSpec) -> nn.Module:
    """The layer's MLP: ``cfg.mlp``'s dense one (``spec.hidden_dim`` wide), ``cfg.moe``'s
    experts, or both side by side."""
    if spec.mlp == "moe":
        return MoE(cfg.emb_dim, **(cfg.moe or {}))
    if spec.mlp == "dense_and_moe":
        return DenseAndExperts(cfg, spec.hidden_dim)
    mlp = FeedForward if cfg.mlp == "gelu" else GatedFeedForward
    return mlp(cfg, spec.hidden_dim)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm1(x))``, then ``x + ff(norm2(x))``.

    Normalising before each sub-layer (GPT-2's order) keeps the residual path an identity,
    which is what lets deep stacks train. Dropout is applied to each branch before it is
    added back ("shortcut dropout"). With ``cfg.post_norms`` (Gemma 3) each branch is
    normalised once more before it is added: ``x + post_norm1(attn(norm1(x)))``; with
    ``cfg.pre_norms=False`` as well (OLMo 2 and 3) only then: ``x + post_norm1(attn(x))``
    (``norm1`` and ``norm2`` are identities).

    ``layer`` is the block's index in the model: its :meth:`GPTConfig.layer_spec` picks
    the attention class (:data:`ATTENTION_KINDS`), window, RoPE and MLP.

    Gemma 4 adds two steps after the MLP: with ``cfg.per_layer_inputs`` the block's
    per-layer input enters (``ple``, a :class:`PerLayerInputGate`), and with
    ``cfg.layer_scalar`` the output is multiplied by the buffer ``layer_scalar (1,)``.

    Shapes: ``(batch, T, emb_dim) -> (batch, T, emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig | Mapping[str, Any], layer: int = 0) -> None:
        super().__init__()
        cfg = _as_config(cfg)
        self.spec = spec = cfg.layer_spec(layer)
        self.att = _ATTENTION_BUILDERS[spec.attention](cfg, spec)
        self.ff = _feed_forward(cfg, spec)
        self.norm1 = make_norm(cfg) if cfg.pre_norms else nn.Identity()
        self.norm2 = make_norm(cfg) if cfg.pre_norms else nn.Identity()
        self.post_norm1 = make_norm(cfg) if cfg.post_norms else None
        self.post_norm2 = make_norm(cfg) if cfg.post_norms else None
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)
        self.ple = PerLayerInputGate(cfg) if cfg.per_layer_inputs is not None else None
        if cfg.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None
        # None, or qkv.heads' callable tap(name, tensor) -> tensor with a set tap.names of
        # the block points (qkv.options.CAPTURE_POINTS) it records or replaces
        self.tap: Any = None

    def forward(
        self, x: Tensor, *, cache: Any = None, shared: KVHandoff | None = None,
        need_weights: bool = False, key_padding_mask: Tensor | None = None,
        per_layer_input: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x (batch, T, emb_dim)``; with ``need_weights`` also ``(batch, heads, T, T_k)``.

        ``cache`` is the layer's own (its attention's ``new_cache``); a ``"shared_kv"``
        layer has none and takes its source layer's keys and values as ``shared``.
        ``key_padding_mask (batch, T_k)``, True = padding, covers every key the layer
        attends to (the cached ones, then ``x``'s); a Gated DeltaNet layer, whose past
        is a state, takes its last ``T`` columns (``x``'s tokens).
        ``per_layer_input (batch, T, width)``: this layer's slice of
        :class:`PerLayerInputs` (models with ``cfg.per_layer_inputs``)."""
        padding = {}
        if key_padding_mask is not None:
            if self.spec.attention not in PADDED_ATTENTION:
                raise ValueError(f"key_padding_mask: {self.spec.attention!r} layers take "
                                 f"no padding mask (those of {', '.join(PADDED_ATTENTION)} do)")
            padding["key_padding_mask"] = (key_padding_mask[:, -x.shape[1]:]
                                           if self.spec.attention == "gated_deltanet"
                                           else key_padding_mask)
        tap = self._tap_point if self.tap is not None else None
        if tap is not None:
            x = tap("resid_pre", x)
        if self.spec.attention == "shared_kv":
            if shared is None:
                raise ValueError("a shared_kv layer needs the KVHandoff of its kv_source "
                                 "layer (GPTModel.forward passes it)")
            attended = self.att(self.norm1(x), shared, need_weights=need_weights, **padding)
        else:
            attended = self.att(self.norm1(x), cache=cache, need_weights=need_weights,
                                **padding)
        weights = None
        if need_weights:
            attended, weights = attended
        if self.post_norm1 is not None:
            attended = self.post_norm1(attended)
        if tap is not None:
            attended = tap("attn_out", attended)
        x = x + self.drop_shortcut(attended)
        if tap is not None:
            x = tap("resid_mid", x)
        if self.spec.mlp == "dense_and_moe":  # its router reads x before the norm
            fed = self.ff(self.norm2(x), x)
        else:
            fed = self.ff(self.norm2(x))
        if self.post_norm2 is not None:
            fed = self.post_norm2(fed)
        if tap is not None:
            fed = tap("mlp_out", fed)
        x = x + self.drop_shortcut(fed)
        if self.ple is not None:
            if per_layer_input is None:
                raise ValueError("this block takes a per-layer input (GPTModel.forward "
                                 "passes it)")
            x = self.ple(x, per_layer_input)
        if self.layer_scalar is not None:
            x = x * self.layer_scalar
        if tap is not None:
            x = tap("resid_post", x)
        return (x, weights) if need_weights else x

    def _tap_point(self, name: str, x: Tensor) -> Tensor:
        """``x`` through ``self.tap`` if it wants the point ``name``."""
        return self.tap(name, x) if name in self.tap.names else x


# ----------------------------------------------------------------------------
# The model


class GPTModel(nn.Module):
    """GPT-2 style language model: ids ``(batch, T)`` -> next-token logits ``(batch, T, vocab)``.

    Token + learned position embeddings, dropout, ``n_layers`` :class:`TransformerBlock`,
    a final :class:`LayerNorm` and a bias-free output head. With ``cfg.tie_weights`` the head
    reuses the token embedding matrix (GPT-2's 124M parameters instead of 163M).

    Parameters are created in the book's order with PyTorch's default initialisers, so
    ``torch.manual_seed(123); GPTModel(GPT_CONFIG_124M)`` holds the book's parameters and,
    in eval mode, gives its outputs (§4.7's untrained "Hello, I am Featureiman
    Byeswickattribute argue"). In training mode dropout draws differ from the book's.
    :meth:`init_weights` applies GPT-2's initialisation instead, which trains better,
    in particular with tied weights.

    Args:
        cfg: a :class:`GPTConfig` or the book's config dict.
    """

    def __init__(self, cfg: GPTConfig | Mapping[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg = _as_config(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.per_layer_inputs = (PerLayerInputs(cfg) if cfg.per_layer_inputs is not None
                                 else None)
        # With rotary embeddings the attention layers carry the positions: no table.
        self.pos_emb = None if cfg.rope else nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        # layers whose keys and values later ("shared_kv") layers attend with
        self.kv_sources = frozenset(block.spec.kv_source for block in self.trf_blocks
                                    if block.spec.kv_source is not None)
        self.final_norm = make_norm(cfg)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # one Parameter in two places: the same storage, updated once per step
            self.out_head.weight = self.tok_emb.weight

    @classmethod
    def from_hf(cls, folder: str | os.PathLike[str]) -> GPTModel:
        """GPT-2 from a Hugging Face folder (``config.json`` + ``model.safetensors``, or
        only ``pytorch_model.bin``, read weights-only), any size from ``gpt2`` to
        ``gpt2-xl``. The config and every tensor's name and shape are checked before
        the model is built (see :mod:`qkv.models.hf_gpt2`); returned in eval mode.
        """
        from .hf_gpt2 import read_config, read_weights

        fields = read_config(folder)
        cfg = GPTConfig(**fields)
        weights = read_weights(folder, fields)
        model = cls(cfg)
        model.load_state_dict(weights)
        return model.eval()

    def forward(
        self,
        idx: Tensor,
        *,
        caches: list[KVCache] | None = None,
        need_weights: bool = False,
        logits_to_keep: int = 0,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits for every position.

        Args:
            idx: token ids ``(batch, T)``.
            caches: one :class:`KVCache` per layer (:meth:`new_caches`); ``idx`` is then
                the tokens after the ``caches[0].pos`` already stored, and positions
                continue from there.
            key_padding_mask: ``(batch, caches[0].pos + T)`` bool, **True = padding**:
                the padding of every token so far, the cached ones then ``idx``'s (rows
                of different lengths left-padded to one, as a batch of prompts is). No
                layer attends to a padding position and a Gated DeltaNet layer's state
                goes through it unchanged, so each row's logits at its own tokens are
                those it gets alone (with rotary positions, which see only the distance
                between tokens; the logits at padding positions mean nothing). Layers
                of the kinds in :data:`PADDED_ATTENTION` take it; a sliding window's
                ring cache does not keep positions in order and refuses it.
            need_weights: also return each layer's attention weights
                ``(batch, heads, T, T_k)`` (runs the eager attention path).
            logits_to_keep: ``n > 0``: the logits of the last ``n`` positions only
                (transformers' name): the output head, a ``vocab_size x emb_dim``
                product per position, runs on those alone. A prompt needs its last
                position's to pick the next token (``generate`` passes 1); 0: all.

        Returns:
            logits ``(batch, T, vocab_size)`` (``(batch, min(T, n), vocab_size)`` with
            ``logits_to_keep=n``), or ``(logits, [weights per layer])``.
        """
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or \
                logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an integer >= 0 (0: every position), "
                             f"got {logits_to_keep!r}")
        if caches is not None and len(caches) != len(self.trf_blocks):
            raise ValueError(
                f"need one KVCache per layer ({len(self.trf_blocks)}), got {len(caches)}"
            )
        start = caches[0].pos if caches is not None else 0
        if key_padding_mask is not None:
            want = (idx.shape[0], start + idx.shape[-1])
            if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != \
                    torch.bool or tuple(key_padding_mask.shape) != want:
                got = (f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}"
                       if isinstance(key_padding_mask, Tensor)
                       else type(key_padding_mask).__name__)
                raise ValueError(f"key_padding_mask must be a bool tensor of shape {want} "
                                 f"(the cached tokens, then idx's; True = padding), got {got}")
        if self.pos_emb is None:
            if idx.dim() != 2:
                raise ValueError(f"token ids must have shape (batch, tokens), got "
                                 f"{tuple(idx.shape)}")
            x = self.tok_emb(idx)
            if self.cfg.embed_scale:  # Gemma: sqrt(emb_dim), rounded to the weights' dtype
                x = x * torch.tensor(self.cfg.emb_dim ** 0.5, dtype=x.dtype)
            # (batch, T, n_layers, width): each layer's own input (Gemma 4)
            per_layer = (self.per_layer_inputs(idx, x) if self.per_layer_inputs is not None
                         else None)
            x = self.drop_emb(x)
        else:
            per_layer = None
            x = self.drop_emb(embed_tokens(self.tok_emb, self.pos_emb, idx, start))
        all_weights = []
        # The layers whose keys and values later layers share hand them over through a
        # KVHandoff wrapped around their cache (held once, in the source's cache).
        handoffs: dict[int, KVHandoff] = {}
        for i, block in enumerate(self.trf_blocks):
            cache = caches[i] if caches is not None else None
            if i in self.kv_sources:
                cache = handoffs[i] = KVHandoff(cache)
            source = block.spec.kv_source
            shared = handoffs[source] if source is not None else None
            extra = {} if per_layer is None else {"per_layer_input": per_layer[:, :, i]}
            if need_weights:
                x, weights = block(x, cache=cache, shared=shared, need_weights=True,
                                   key_padding_mask=key_padding_mask, **extra)
                all_weights.append(weights)
            else:
                x = block(x, cache=cache, shared=shared, key_padding_mask=key_padding_mask,
                          **extra)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.out_head(self.final_norm(x))
        if self.cfg.logit_softcap is not None:  # Gemma: c * tanh(logits / c)
            cap = self.cfg.logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return (logits, all_weights) if need_weights else logits

    def new_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty :class:`KVCache` per layer, on the model's device and dtype.

        ``max_len`` defaults to ``cfg.context_length`` and cannot exceed it (positions
        beyond it have no embedding). With ``cfg.window_size`` each is a ring of the
        window's size instead.
        """
        max_len = self.cfg.context_length if max_len is None else max_len
        if not 1 <= max_len <= self.cfg.context_length:
            raise ValueError(
                f"max_len must be in [1, context_length={self.cfg.context_length}], got {max_len}"
            )
        return [block.att.new_cache(batch_size, max_len) for block in self.trf_blocks]

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> GPTModel:
        """GPT-2's initialisation: N(0, std) weights, zero biases, and the two residual
        projections of each block scaled by ``1 / sqrt(2 * n_layers)`` so the residual
        stream's variance does not grow with depth. Returns the model."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for block in self.trf_blocks:
            nn.init.normal_(block.att.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.ff.out_layer.weight, mean=0.0, std=residual_std)
        return self


# ----------------------------------------------------------------------------
# Decoding


# The attention classes decode.c's step runs (NoPE layers are MultiHeadAttention's).
_NATIVE_ATTENTION = (MultiHeadAttention, SinkAttention, GatedAttention, SharedKVAttention,
                     LatentAttention, SparseLatentAttention, GatedDeltaNet)


def native_unsupported(model: nn.Module, batch_size: int = 1) -> str | None:
    """Why :class:`~qkv.models.native_decode.NativeDecoder` (``generate``'s ``native``
    steps) cannot decode ``model`` at ``batch_size`` (None when it can)."""
    if type(model) is not GPTModel:
        return f"a plain GPTModel is needed, got {type(model).__name__}"
    weight = model.final_norm.scale  # (a quantized head's weight would expand its blocks)
    if weight.device.type != "cpu":
        return f"the kernels run on the CPU, the model is on {weight.device}"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or weight.dtype not in NATIVE_DTYPES:
        return f"float32 or bfloat16 parameters are needed, got {sorted(map(str, dtypes))}"
    if batch_size != 1:
        return f"one sequence at a time, got a batch of {batch_size}"
    norms = (LayerNorm, RMSNorm)
    ple = model.per_layer_inputs
    if ple is not None and (type(ple) is not PerLayerInputs or type(ple.norm) not in norms
                            or not _native_linear(ple.proj)
                            or not (type(ple.embed) is nn.Embedding or hasattr(ple.embed,
                                                                                "blocks"))):
        return "per-layer inputs must be qkv's PerLayerInputs, of an embedding, a linear " \
               "layer and a norm"
    for block in model.trf_blocks:
        if type(block) is not TransformerBlock:
            return f"a block of type {type(block).__name__}"
        att, ff = block.att, block.ff
        if type(att) not in _NATIVE_ATTENTION:
            return (f"{type(att).__name__} layers have no native step (it runs "
                    f"{', '.join(c.__name__ for c in _NATIVE_ATTENTION)})")
        if isinstance(att, LatentAttention):
            if att.d_model != model.cfg.emb_dim:
                return "latent attention over the residual stream is needed"
        elif isinstance(att, GatedDeltaNet):
            if att.d_in != model.cfg.emb_dim or att.d_out != model.cfg.emb_dim:
                return "Gated DeltaNet over the residual stream is needed"
        elif (not att.causal or att.d_in != model.cfg.emb_dim or att.d_out != model.cfg.emb_dim
                or att.kdim != att.d_in or att.vdim != att.d_in):
            return "causal self-attention over the residual stream is needed"
        elif (att.W_query.out_features not in (att.num_heads * att.head_dim,
                                               2 * att.num_heads * att.head_dim)
              or getattr(att, "W_key", att.W_query).out_features % att.head_dim
              or att.num_heads % att.num_kv_groups
              or (hasattr(att, "W_key")
                  and att.W_key.out_features != att.num_kv_groups * att.head_dim)):
            return "a layer's projections must have the same heads as it says it has"
        elif any(m is not None and type(m) not in norms
                 for m in (att.q_norm, att.k_norm, getattr(att, "v_norm", None))):
            return "QK-norms and value norms must be qkv's LayerNorm or RMSNorm"
        parts = (ff,)
        if type(ff) is DenseAndExperts:  # Gemma 4's: a dense MLP and experts side by side
            parts = (ff.dense, ff.moe)
            if any(type(m) not in norms for m in (ff.post_dense_norm, ff.moe_norm,
                                                   ff.post_moe_norm)):
                return "the norms must be qkv's LayerNorm or RMSNorm"
        for part in parts:
            if type(part) not in (FeedForward, GatedFeedForward, MoE):
                return (f"{type(part).__name__} feed-forwards have no native step (it runs "
                        "FeedForward, GatedFeedForward, MoE and DenseAndExperts of them)")
            if type(part) is FeedForward and (
                    len(part.layers) != 3 or type(part.layers[1]) is not GELU
                    or not all(map(_native_linear, part.layers[::2]))):
                return "the feed-forward must be Linear, GELU, Linear"
            if type(part) is GatedFeedForward and type(part.act) not in (nn.SiLU, GELU):
                return "the gated feed-forward's activation must be SiLU or GELU"
            if type(part) is MoE and (
                    type(part.experts) is not Experts or type(part.router) is not nn.Linear
                    or (part.shared_expert is not None
                        and type(part.shared_expert) is not GatedMLP)):
                return "a mixture of experts must be built from qkv's Experts and GatedMLP"
        if block.ple is not None and (type(block.ple) is not PerLayerInputGate
                                      or type(block.ple.norm) not in norms
                                      or not all(map(_native_linear, (block.ple.gate,
                                                                      block.ple.proj)))):
            return "a block's per-layer input must be qkv's PerLayerInputGate"
        if any(m is not None and type(m) not in norms for m in
               (block.norm1, block.norm2, block.post_norm1, block.post_norm2)):
            return "the norms must be qkv's LayerNorm or RMSNorm"
    if type(model.final_norm) not in norms:
        return "the final norm must be qkv's LayerNorm or RMSNorm"
    if any(getattr(m, "tap", None) is not None for m in model.modules()):
        return "a capture or an intervention taps the layers, and only the model's forward " \
               "runs its taps"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks are registered, and only the model's forward runs them"
    for name, m in model.named_modules():
        if hasattr(m, "blocks") and m.qtype not in QUANT_TYPES:
            return f"{name} keeps {m.qtype} blocks; the kernels read {', '.join(QUANT_TYPES)}"
    return unavailable_reason()


def _native_linear(m: nn.Module) -> bool:
    """Whether the kernels read ``m`` as a linear layer: an ``nn.Linear``, or a layer that
    keeps its weight in GGML blocks (``blocks``, ``qtype``)."""
    return type(m) is nn.Linear or hasattr(m, "blocks")


# MAX_NEW_TOKENS (qkv.options): most tokens one generate() call adds.


def check_max_new_tokens(value: Any, name: str = "max_new_tokens") -> int:
    """``value`` if it is an integer in ``[0, MAX_NEW_TOKENS]``; else a one-line
    ``ValueError`` with the limit and its reason."""
    if isinstance(value, bool) or not isinstance(value, int) or not \
            0 <= value <= MAX_NEW_TOKENS:
        raise ValueError(
            f"{name} must be an integer in [0, {MAX_NEW_TOKENS:,}], got {show(value)} (one "
            "call generates at most that many: each token is a forward step and the "
            "whole output is kept; continue from the end of the text for more)"
        )
    return value


def check_sampling(temperature: Any, top_k: Any = None, seed: Any = None, *,
                   top_p: Any = None, flags: bool = False) -> None:
    """One-line ``ValueError`` unless ``temperature`` is a finite number >= 0, ``top_k``
    None or a positive integer, ``top_p`` None or a number in ``(0, 1]`` and ``seed`` None
    or an integer ``torch.manual_seed`` takes. ``flags``: name them as the command line
    does (``--top-k``)."""
    def name(field: str) -> str:
        return "--" + field.replace("_", "-") if flags else field

    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{name('temperature')} must be a finite number >= 0 (0 = greedy), "
                         f"got {show(temperature)}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{name('top_k')} must be a positive integer or None, got {show(top_k)}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):  # also refuses NaN
        raise ValueError(f"{name('top_p')} must be a number in (0, 1] or None (1 = no cut), "
                         f"got {show(top_p)}")
    if seed is not None:
        check_int(name("seed"), seed, -(2**63), 2**64 - 1)  # what torch.manual_seed takes


def sampling_probs(logits: Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> Tensor:
    """The distribution one sampling step draws from: ``logits (batch, vocab)`` ->
    float32 probabilities ``(batch, vocab)``, zero for every token cut.

    In the order transformers' ``generate`` applies them: the logits are divided by
    ``temperature`` (> 0); ``top_k`` keeps the ``k`` largest (ties with the k-th too);
    ``top_p`` keeps the nucleus, the most likely tokens until their probabilities reach
    ``top_p`` together: a token stays while the tokens more likely than it hold less than
    ``top_p``, so the most likely one always stays. The kept probabilities are renormalised.
    """
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:  # 1 keeps everything: no sort, no rounding at the tail
        ranked, order = probs.sort(dim=-1, descending=True)
        ahead = ranked.cumsum(dim=-1) - ranked  # the mass of the tokens more likely than each
        cut = torch.empty_like(ahead, dtype=torch.bool).scatter_(-1, order, ahead >= top_p)
        probs = probs.masked_fill(cut, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _next_token(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> Tensor:
    """Pick one id per row from ``logits (batch, vocab)`` -> ``(batch, 1)``."""
    if temperature == 0.0:  # top-k and top-p always keep the most likely token
        return logits.argmax(dim=-1, keepdim=True)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def _eos_ids(eos_id: Any, vocab_size: int | None) -> list[int] | None:
    """``eos_id`` (an id, a list or tuple of ids, or None) as a list; one-line
    ``ValueError`` for anything else or an id outside the vocabulary."""
    if eos_id is None:
        return None
    ids = list(eos_id) if isinstance(eos_id, (list, tuple)) else [eos_id]
    top = MAX_SIZE if vocab_size is None else vocab_size - 1
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= top
                      for i in ids):
        raise ValueError(f"eos_id must be an id or a non-empty list of ids in [0, {top}], "
                         f"got {show(eos_id)}")
    return ids


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    eos_id: int | list[int] | tuple[int, ...] | None = None,
    context_size: int | None = None,
    native: bool | None = None,
    on_token: Callable[[Tensor], None] | None = None,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Extend ``idx (batch, T)`` by up to ``max_new_tokens`` tokens -> ``(batch, T + n)``.

    Args:
        model: a :class:`GPTModel` (or any model mapping ``(batch, T)`` ids to logits when
            ``use_cache=False`` and ``context_size`` is given).
        temperature: 0 picks the most likely token (greedy); above 0 samples from
            ``softmax(logits / temperature)``, flatter as it grows.
        top_k: sample only among the ``k`` most likely tokens.
        top_p: sample only from the nucleus, the most likely tokens whose probabilities
            first reach ``top_p`` together (applied after ``temperature`` and ``top_k``,
            as transformers does: :func:`sampling_probs`).
        use_cache: decode with one :class:`KVCache` per layer; the tokens are the same as
            without it, only faster.
        generator: source of randomness for sampling, for reproducible output.
        eos_id: an id, or a list of ids (an open model may end a reply with any of
            several): stop once every row has produced one of them; a row that finished
            early is padded with the first. (Unlike the book's batch-of-one loop, the
            final id is kept in the output.)
        context_size: tokens the model sees; default ``model.cfg.context_length``.
        native: how the cache's one-token steps run. ``False``: the model's own forward
            (the readable path). ``True``: qkv's C kernels
            (:class:`qkv.models.native_decode.NativeDecoder`: the same maths, float32
            activations, weights read where they are in float32 or bfloat16), an error
            where they cannot run (or without the cache). ``None`` (default): the
            kernels where they can run (:func:`native_unsupported` says why not), else
            the model's forward. The prompt, and the re-fill of a full cache, always run
            through the model's forward.
        on_token: called with each step's new ids ``(batch, 1)`` as soon as they are
            chosen (to stream the text); an exception it raises ends the generation.
        key_padding_mask: ``(batch, T)`` bool, True where ``idx`` is padding: prompts of
            different lengths left-padded to one. Each row then gets the tokens it gets
            alone (a :class:`GPTModel` with rotary positions; see its ``forward``). The
            steps run through the model's forward (not the C kernels).

    ``max_new_tokens`` is at most :data:`MAX_NEW_TOKENS`; the output is allocated once,
    so each step costs the same however long the text has grown.

    Context: the model always sees the last ``context_size`` tokens (the book's crop). A
    layer's cache holds ``min(context_size, T + max_new_tokens)`` positions, all this call
    can fill (a sliding-window layer's, its window): a few tokens from a model with a
    128k context allocate a few positions, not 128k. The cache grows while the sequence
    fits; once full, each step re-fills it from the last ``context_size`` tokens, because
    their positions have all shifted by one. A model with rotary positions and a sliding
    window (``cfg.rope`` and ``cfg.window_size``) needs no re-fill: its caches are rings
    that keep the window, and positions only matter relative to each other, so it feeds
    one token per step for as long as asked, computing what the model computes on the
    whole sequence. Past ``context_size`` that is more than ``use_cache=False`` sees:
    each layer's window reaches one window further back, which the re-read of the last
    ``context_size`` tokens cuts off.

    Runs in eval mode (dropout off) and restores the model's mode afterwards; the
    model's parameters are never changed.
    """
    if idx.dim() != 2 or idx.shape[1] == 0 or idx.is_floating_point():
        raise ValueError(
            f"idx must be integer ids of shape (batch, T >= 1), got {tuple(idx.shape)}"
        )
    check_max_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k, top_p=top_p)
    cfg = getattr(model, "cfg", None)
    eos_ids = _eos_ids(eos_id, getattr(cfg, "vocab_size", None))
    model_context = getattr(cfg, "context_length", None)
    if context_size is None:
        if model_context is None:
            raise ValueError("pass context_size: the model has no cfg.context_length")
        context_size = model_context
    if context_size < 1 or (model_context is not None and context_size > model_context):
        raise ValueError(
            f"context_size must be in [1, context_length={model_context}], got {context_size}"
        )
    if use_cache and not hasattr(model, "new_caches"):
        raise ValueError("this model has no new_caches(); pass use_cache=False")

    if native and not use_cache:
        raise ValueError("native=True runs the cached steps: it needs use_cache=True")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool \
                or key_padding_mask.shape != idx.shape:
            got = (f"{tuple(key_padding_mask.shape)} {key_padding_mask.dtype}"
                   if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__)
            raise ValueError(f"key_padding_mask must be a bool tensor of idx's shape "
                             f"{tuple(idx.shape)} (True = padding), got {got}")
        if native:
            raise ValueError("native=True does not take a key_padding_mask: the C kernels "
                             "attend to every cached position (pass native=None)")
        if use_cache and getattr(cfg, "window_size", None) is not None:
            raise ValueError(f"key_padding_mask: a sliding window (window_size="
                             f"{cfg.window_size}) caches in rings, which do not keep "
                             "positions in order; pass use_cache=False")
        native = False
    use_native = False
    if use_cache and native is not False and max_new_tokens > 0:
        reason = native_unsupported(model, idx.shape[0])
        use_native = reason is None
        if native and not use_native:
            raise ValueError(f"native=True, but the kernels cannot decode here: {reason}")
    # Only the last position's logits pick the next token; a model that can compute no
    # others does not (GPTModel's output head is a fifth to a third of a prompt's work in
    # SmolLM2, Qwen3 or GPT-2).
    keep = {"logits_to_keep": 1} if "logits_to_keep" in \
        inspect.signature(model.forward).parameters else {}

    def forward(ids: Tensor, caches: list[KVCache] | None = None,
                first: int = 0) -> Tensor:
        """The model on ``ids``, the last tokens of ``ids_so_far[:, first:end]`` (the
        cache holding the others): with padding, that span's padding goes along."""
        extra = {} if pads is None else {"key_padding_mask": pads[:, first:end]}
        if caches is None:
            return model(ids, **keep, **extra)
        return model(ids, caches=caches, **keep, **extra)

    was_training = model.training
    model.eval()
    try:
        caches = None
        if use_cache:
            # Room for the (cropped) prompt and every new token, at most the context. A
            # cache smaller than context_size is never full: the re-fill below only
            # happens to a cache of context_size positions. (A sliding-window layer
            # sizes its ring to its window whatever max_len says.)
            max_len = min(context_size, idx.shape[1] + max_new_tokens)
            caches = model.new_caches(idx.shape[0], max_len)
        endless = (caches is not None and all(c.ring for c in caches if c is not None)
                   and getattr(model, "pos_emb", True) is None)
        decoder = NativeDecoder(model, caches) if use_native else None
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        stop = None if eos_ids is None else torch.tensor(eos_ids, device=idx.device)
        # The whole output, allocated once: appending to a growing tensor would copy it
        # every step. `end` is the length so far; ids[:, :end] is the sequence.
        ids = idx.new_empty(idx.shape[0], idx.shape[1] + max_new_tokens)
        ids[:, : idx.shape[1]] = idx
        end = idx.shape[1]
        # The padding of every position (the new tokens are none); cached from `held`.
        pads = None
        if key_padding_mask is not None:
            pads = torch.zeros(ids.shape, dtype=torch.bool, device=idx.device)
            pads[:, :end] = key_padding_mask.to(idx.device)
        held = 0
        for _ in range(max_new_tokens):
            if caches is None:
                first = max(end - context_size, 0)
                logits = forward(ids[:, first:end], first=first)
            elif caches[0].pos == 0 or (caches[0].pos == context_size and not endless):
                # first step, or the cache is full: (re-)fill it from the last window
                for cache in caches:
                    if cache is not None:  # a shared_kv layer keeps none
                        cache.reset()
                held = max(end - context_size, 0)
                logits = forward(ids[:, held:end], caches, first=held)
            elif decoder is not None:
                logits = decoder.step(int(ids[0, end - 1]))
            else:
                # the cache holds every token but the newest: feed just that one
                logits = forward(ids[:, end - 1 : end], caches, first=held)
            next_id = _next_token(logits[:, -1, :], float(temperature), top_k, top_p, generator)
            if eos_ids is not None:
                next_id = next_id.masked_fill(finished[:, None], eos_ids[0])
                finished |= torch.isin(next_id[:, 0], stop)
            ids[:, end : end + 1] = next_id
            end += 1
            if on_token is not None:
                on_token(ids[:, end - 1 : end])
            if eos_ids is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return ids[:, :end]


def generate_text_simple(
    model: nn.Module, idx: Tensor, max_new_tokens: int, context_size: int
) -> Tensor:
    """The book's greedy decoder (§4.7): ``generate`` with temperature 0 and the book's crop."""
    return generate(
        model,
        idx,
        max_new_tokens,
        context_size=context_size,
        use_cache=hasattr(model, "new_caches"),
    )
