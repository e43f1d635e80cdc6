"""``qkv bench variants``: the attention of 2025-26 models and the mixture-of-experts
feed-forward, each fast path against its readable path and against transformers' own
module holding the same weights.

For each mechanism, every path below computes one function on one set of weights:

================  ====================================  ==================================
mechanism         qkv's paths (readable, then fast)     transformers' module
================  ====================================  ==================================
``mha``           ``MultiHeadAttention`` eager, fused   ``LlamaAttention``
``sink``          ``SinkAttention`` eager, fused        ``GptOssAttention``
``gated``         ``GatedAttention`` eager, fused       ``Qwen3NextAttention``
``latent``        ``LatentAttention`` decompress,       ``DeepseekV3Attention``
                  absorbed, auto
``sparse_latent`` ``SparseLatentAttention`` (same)      ``DeepseekV32Attention``
``moe``           ``MoE`` loop, grouped (three          ``DeepseekV3MoE``, ``GptOssMLP``,
                  families' routings)                   ``Qwen3NextSparseMoeBlock``
================  ====================================  ==================================

Two modes are timed, in inference (``eval``, ``torch.no_grad``), batch 1:

- **prompt**: one forward over ``tokens`` tokens, no cache;
- **decode**: one new token against a cache holding ``tokens`` tokens. qkv's cache is the
  layer's ``new_cache``, transformers' its own ``DynamicCache``, each filled by a forward
  over the same prompt. After each timed step the cache is set back to the prompt (qkv:
  ``cache.pos``; transformers: ``cache.crop(-1)``), so every step sees the same cache.
  A mixture of experts has no cache: its step is one token.

And **long decode**: multi-head latent attention decoding one token against
``long_cache`` (4,096) cached tokens, absorbed against decompressed and against
``DeepseekV3Attention``, which expands the whole cache into every head's keys and values
at each step.

Fair to transformers: its RoPE tables and masks, which its model computes once per
forward for all layers, are built before the clock starts, with its own
``create_causal_mask``; qkv's layers compute theirs inside the timed call. Its attention
and experts run the implementations its models pick by default on this machine (read
from a tiny model built with ``from_config``: SDPA where the family supports it, eager
for gpt-oss; ``grouped_mm`` experts).

Before anything is timed, each path's output is compared with the readable path's
(largest difference over the largest output), so a path that computes something else
cannot look fast. transformers is not a dependency of qkv: without it only qkv's paths
run.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..attention_variants import GatedAttention, SinkAttention
from ..checks import MAX_COUNT, check_int
from ..latent_attention import LatentAttention, SparseLatentAttention
from ..models.gpt import RMSNorm
from ..models.moe import MoE
from ..multihead import MultiHeadAttention
from ..utils.figures import new_figure, save_figure
from .timing import (
    error_line,
    format_ms,
    hbars,
    machine_info,
    markdown_table,
    round_robin,
    target_line,
    write_json,
)

__all__ = ["MECHANISMS", "VariantsConfig", "run_variants"]

# mechanism -> what its rows are called
MECHANISMS: dict[str, str] = {
    "mha": "MultiHeadAttention (GQA, RoPE)",
    "sink": "SinkAttention (gpt-oss)",
    "gated": "GatedAttention (Qwen3-Next)",
    "latent": "LatentAttention (MLA)",
    "sparse_latent": "SparseLatentAttention (DSA)",
    "moe": "MoE",
}
MODES = ("prompt", "decode")
# A path's output may differ from the readable path's by this much of the output's
# largest value (float32 sums over thousands of terms, in another order).
TOLERANCE = 1e-4
_CPU = torch.device("cpu")


@dataclass
class VariantsConfig:
    """What to measure.

    Attributes:
        mechanisms: which of :data:`MECHANISMS` to run.
        tokens: the prompt's length, and the tokens cached before a decoding step.
        long_cache: tokens cached before the long MLA decoding step (0: none).
        repeats, decode_repeats: timed rounds per prompt case and per decoding case.
        warmup: untimed calls per case first, at least one: the first is the call whose
            output is compared with the readable path's.
        peers: also time transformers' modules (where it is installed).
        tiny: toy widths (``--quick``): a smoke test, not a measurement.
    """

    mechanisms: tuple[str, ...] = tuple(MECHANISMS)
    tokens: int = 512
    long_cache: int = 4096
    repeats: int = 5
    decode_repeats: int = 20
    warmup: int = 1
    seed: int = 0
    peers: bool = True
    tiny: bool = False

    @classmethod
    def quick(cls, **overrides: Any) -> VariantsConfig:
        """Toy widths and a dozen tokens: seconds, and every path still compared."""
        small = {"tokens": 12, "long_cache": 24, "repeats": 2, "decode_repeats": 2,
                 "tiny": True}
        return cls(**{**small, **overrides})

    def validate(self) -> None:
        unknown = [m for m in self.mechanisms if m not in MECHANISMS]
        if unknown:
            raise ValueError(f"mechanism {unknown[0]!r} is not benchmarked; choose from "
                             f"{', '.join(MECHANISMS)}")
        if not self.mechanisms:
            raise ValueError(f"mechanisms must name at least one of {', '.join(MECHANISMS)}")
        check_int("tokens", self.tokens, 1, 1 << 20)
        check_int("long_cache", self.long_cache, 0, 1 << 20)
        for name in ("repeats", "decode_repeats"):
            check_int(name, getattr(self, name), 1, MAX_COUNT)
        check_int("warmup", self.warmup, 0, MAX_COUNT)


# ----------------------------------------------------------------------------
# A path: how one implementation runs a prompt and a decoding step


@dataclass
class _Path:
    """One implementation of a mechanism. ``prompt(x)`` and ``decode(x, x1)`` do the
    untimed preparation (caches, masks, RoPE tables) and return the call to time, which
    returns the output ``(1, T, d_model)``.

    ``role``: ``"readable"`` (what the others are checked against), ``"fast"``,
    ``"default"`` (the backend a model runs: the one held to the target) or
    ``"transformers"``.
    """

    name: str
    role: str
    prompt: Callable[[Tensor], Callable[[], Tensor]]
    decode: Callable[[Tensor, Tensor], Callable[[], Tensor]]


def _qkv_paths(layer: nn.Module, backends: list[tuple[str, str, str]]) -> list[_Path]:
    """A qkv layer run with each backend of ``backends`` (``(path name, role,
    backend)``), one module and one set of weights for all. A decoding step's cache is
    filled by a forward over the prompt with the layer's own default backend, once, and
    each path steps on a copy of it (the cache holds the same numbers whichever backend
    attends)."""
    default = layer.backend
    filled: dict[tuple[int, ...], Any] = {}  # the prompt's cache, made once

    def run(backend: str, x: Tensor, **kwargs: Any) -> Tensor:
        layer.backend = backend
        return layer(x, **kwargs)

    def prompt_cache(x: Tensor, extra: int) -> Any:
        key = (x.data_ptr(), *x.shape, extra)
        if key not in filled:
            filled.clear()
            cache = layer.new_cache(x.shape[0], x.shape[1] + extra)
            run(default, x, cache=cache)
            filled[key] = cache
        return copy.deepcopy(filled[key])

    def path(name: str, role: str, backend: str) -> _Path:
        def prompt(x: Tensor) -> Callable[[], Tensor]:
            return lambda: run(backend, x)

        def decode(x: Tensor, x1: Tensor) -> Callable[[], Tensor]:
            if not hasattr(layer, "new_cache"):  # a feed-forward: a step is one token
                return lambda: run(backend, x1)
            cache = prompt_cache(x, x1.shape[1])
            n = cache.pos

            def step() -> Tensor:
                out = run(backend, x1, cache=cache)
                cache.pos = n  # forget the step: each call sees the prompt's cache
                return out

            return step

        return _Path(name, role, prompt, decode)

    return [path(*spec) for spec in backends]


@dataclass
class _Peer:
    """transformers' module for a mechanism and what calling it needs."""

    module: nn.Module
    config: Any
    rotary: nn.Module | None = None  # its RoPE (attention modules)
    mask_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    position_ids: bool = False  # its forward takes position_ids (DeepSeek-V3.2)

    @property
    def name(self) -> str:
        impl = (self.config._attn_implementation if self.rotary is not None
                else self.config._experts_implementation)
        return f"transformers {type(self.module).__name__} ({impl})"


def _peer_path(peer: _Peer) -> _Path:
    """transformers' module as its model calls it, with its own ``DynamicCache``."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask

    module = peer.module

    def first(out: Any) -> Tensor:
        return out[0] if isinstance(out, tuple) else out

    def call(x: Tensor, cache: Any, past: int) -> Callable[[], Tensor]:
        if peer.rotary is None:  # a feed-forward
            return lambda: first(module(x))
        positions = torch.arange(past, past + x.shape[1])[None]
        rope = peer.rotary(x, positions)
        mask = create_causal_mask(config=peer.config, inputs_embeds=x, attention_mask=None,
                                  cache=cache, position_ids=positions, **peer.mask_kwargs)
        extra = {"position_ids": positions} if peer.position_ids else {}
        return lambda: first(module(x, rope, mask, cache=cache, **extra))

    def prompt(x: Tensor) -> Callable[[], Tensor]:
        return call(x, None, 0)

    def decode(x: Tensor, x1: Tensor) -> Callable[[], Tensor]:
        if peer.rotary is None:
            return call(x1, None, 0)
        cache = DynamicCache(config=peer.config)
        call(x, cache, 0)()
        run = call(x1, cache, x.shape[1])

        def step() -> Tensor:
            out = run()
            cache.crop(-1)  # forget the step, as qkv's paths do
            return out

        return step

    return _Path(peer.name, "transformers", prompt, decode)


# ----------------------------------------------------------------------------
# Weights


def _randomize(module: nn.Module, seed: int) -> None:
    """Every parameter and float buffer drawn afresh (transformers leaves some, like
    gpt-oss's sinks and every fused expert tensor, uninitialised outside a model):
    matrices ``N(0, 1 / fan_in)`` with ``fan_in`` the last axis, vectors (norms, biases,
    sinks) uniform in [0.5, 1.5) (whatever their role, a softmax far from flat)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if not t.is_floating_point():
                continue
            if t.dim() > 1:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1]))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.01)
            else:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)


def _load(ours: nn.Module, state: dict[str, Tensor], renames: dict[str, str]) -> None:
    """``state`` (transformers' names) into ``ours``, each name's first matching prefix
    of ``renames`` replaced; every parameter must be found."""
    out = {}
    for name, tensor in state.items():
        for theirs, mine in renames.items():
            if name.startswith(theirs):
                name = mine + name[len(theirs):]
                break
        out[name] = tensor
    ours.load_state_dict(out, strict=True)


_ATTENTION_NAMES = {"q_proj.": "W_query.", "k_proj.": "W_key.", "v_proj.": "W_value.",
                    "o_proj.": "out_proj.", "q_norm.weight": "q_norm.scale",
                    "k_norm.weight": "k_norm.scale"}

# transformers' model type -> (its config class, what a one-layer toy of it needs)
_TOY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4}),
    "qwen3_next": ("Qwen3NextConfig", {"num_experts": 4, "layer_types": ["full_attention"],
                                       "moe_intermediate_size": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 8, "first_k_dense_replace": 0,
                                         "moe_intermediate_size": 16}),
    "deepseek_v32": ("DeepseekV32Config", {"n_routed_experts": 8, "first_k_dense_replace": 0,
                                           "moe_intermediate_size": 16, "q_lora_rank": 16,
                                           "index_n_heads": 2, "index_head_dim": 32}),
}
_defaults_seen: dict[str, tuple[str, str]] = {}


def _transformers_defaults(model_type: str) -> tuple[str, str]:
    """The attention and experts implementations transformers' own model of
    ``model_type`` runs here by default: read from a one-layer toy made by
    ``AutoModelForCausalLM.from_config``, as ``from_pretrained`` would choose them."""
    if model_type not in _defaults_seen:
        import transformers

        name, extra = _TOY_MODELS[model_type]
        config = getattr(transformers, name)(hidden_size=64, num_attention_heads=4,
                                             num_key_value_heads=4, num_hidden_layers=1,
                                             vocab_size=32, intermediate_size=32, **extra)
        toy = transformers.AutoModelForCausalLM.from_config(config)
        _defaults_seen[model_type] = (toy.config._attn_implementation,
                                      getattr(toy.config, "_experts_implementation", None)
                                      or "eager")
    return _defaults_seen[model_type]


def _attention_peer(model_type: str, module_name: str, config: Any, ours: nn.Module,
                    renames: dict[str, str], seed: int, **peer: Any) -> _Peer:
    """transformers' attention ``module_name`` of ``model_type`` built from ``config``
    with random weights, which ``ours`` then loads (renamed by ``renames``)."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config._attn_implementation = _transformers_defaults(model_type)[0]
    module = getattr(modeling, module_name)(config, 0).eval()
    _randomize(module, seed)
    _load(ours, module.state_dict(), renames)
    rotary = getattr(modeling, module_name.replace("Attention", "RotaryEmbedding"))(config)
    return _Peer(module, config, rotary, **peer)


def _moe_peer(model_type: str, module_name: str, config: Any, seed: int) -> _Peer:
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config._experts_implementation = _transformers_defaults(model_type)[1]
    module = getattr(modeling, module_name)(config).eval()
    _randomize(module, seed)
    return _Peer(module, config)


# ----------------------------------------------------------------------------
# The mechanisms, each at one realistic shape (toy widths with ``tiny``)


@dataclass
class _Group:
    """One mechanism at one shape: its paths, the readable one first."""

    key: str
    label: str
    shape: str
    d_model: int
    paths: list[_Path]


_EAGER_FUSED = [("qkv eager", "readable", "eager"), ("qkv fused", "default", "fused")]


def _rope(theta: float, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **extra}


def _mha(tiny: bool, seed: int, peers: bool) -> list[_Group]:
    """Llama 3.2 1B's attention: 2,048 wide, 32 heads of 64, 8 key/value heads, RoPE."""
    d, heads, kv, hd, base = (32, 4, 2, 8, 100.0) if tiny else (2048, 32, 8, 64, 500_000.0)
    layer = MultiHeadAttention(d, d, None, 0.0, heads, num_kv_groups=kv, rope=True,
                               rope_base=base, out_bias=False).eval()
    paths = _qkv_paths(layer, _EAGER_FUSED)
    if peers:
        import transformers

        config = transformers.LlamaConfig(hidden_size=d, num_attention_heads=heads,
                                          num_key_value_heads=kv, head_dim=hd,
                                          num_hidden_layers=1, rope_parameters=_rope(base))
        paths.append(_peer_path(_attention_peer("llama", "LlamaAttention", config, layer,
                                                _ATTENTION_NAMES, seed)))
    else:
        _randomize(layer, seed)
    shape = f"d_model {d}, {heads} heads of {hd}, {kv} key/value heads, RoPE"
    return [_Group("mha", MECHANISMS["mha"], shape, d, paths)]


def _sink(tiny: bool, seed: int, peers: bool) -> list[_Group]:
    """gpt-oss-20b's full-attention layer: 2,880 wide, 64 heads of 64, 8 key/value
    heads, biases, a sink per head."""
    d, heads, kv, hd, base = (32, 4, 2, 8, 100.0) if tiny else (2880, 64, 8, 64, 150_000.0)
    layer = SinkAttention(d, d, None, 0.0, heads, qkv_bias=True, num_kv_groups=kv,
                          head_dim=hd, rope=True, rope_base=base).eval()
    paths = _qkv_paths(layer, _EAGER_FUSED)
    if peers:
        import transformers

        config = transformers.GptOssConfig(
            hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
            num_hidden_layers=1, layer_types=["full_attention"], attention_bias=True,
            rope_parameters=_rope(base), num_local_experts=4, num_experts_per_tok=2,
            intermediate_size=8)
        paths.append(_peer_path(_attention_peer("gpt_oss", "GptOssAttention", config, layer,
                                                _ATTENTION_NAMES, seed)))
    else:
        _randomize(layer, seed)
    shape = f"d_model {d}, {heads} heads of {hd}, {kv} key/value heads, biases, RoPE"
    return [_Group("sink", MECHANISMS["sink"], shape, d, paths)]


def _gated(tiny: bool, seed: int, peers: bool) -> list[_Group]:
    """Qwen3-Next's full-attention layer: 2,048 wide, 16 heads of 256, 2 key/value
    heads, QK-norm, RoPE on a quarter of each head, a sigmoid gate per head."""
    d, heads, kv, hd, rot = (32, 4, 2, 8, 2) if tiny else (2048, 16, 2, 256, 64)
    base, eps = 10_000_000.0, 1e-6
    layer = GatedAttention(d, d, None, 0.0, heads, num_kv_groups=kv, head_dim=hd,
                           out_bias=False, rope=True, rope_base=base, rotary_dim=rot,
                           q_norm=RMSNorm(hd, eps, gemma=True),
                           k_norm=RMSNorm(hd, eps, gemma=True)).eval()
    paths = _qkv_paths(layer, _EAGER_FUSED)
    if peers:
        import transformers

        config = transformers.Qwen3NextConfig(
            hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
            num_hidden_layers=1, layer_types=["full_attention"], rms_norm_eps=eps,
            rope_parameters=_rope(base, partial_rotary_factor=rot / hd))
        paths.append(_peer_path(_attention_peer("qwen3_next", "Qwen3NextAttention", config,
                                                layer, _ATTENTION_NAMES, seed)))
    else:
        _randomize(layer, seed)
    shape = (f"d_model {d}, {heads} heads of {hd}, {kv} key/value heads, QK-norm, "
             f"RoPE on {rot} of {hd}")
    return [_Group("gated", MECHANISMS["gated"], shape, d, paths)]


def _latent_sizes(tiny: bool) -> tuple[int, int, dict[str, int]]:
    """DeepSeek-V3's latent and per-head sizes at 16 heads and 2,048 wide."""
    if tiny:
        return 32, 4, dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
                           qk_rope_head_dim=4, v_head_dim=6)
    return 2048, 16, dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128)


def _latent_paths(layer: LatentAttention) -> list[_Path]:
    return _qkv_paths(layer, [("qkv decompress", "readable", "decompress"),
                              ("qkv absorbed", "fast", "absorbed"),
                              ("qkv auto", "default", "auto")])


def _latent(tiny: bool, seed: int, peers: bool, key: str = "latent") -> list[_Group]:
    d, heads, sizes = _latent_sizes(tiny)
    layer = LatentAttention(d, heads, **sizes, rope_base=10_000.0, rope_interleave=True).eval()
    paths = _latent_paths(layer)
    if peers:
        import transformers

        config = transformers.DeepseekV3Config(
            hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads, **sizes,
            rope_parameters=_rope(10_000.0), rope_interleave=True, num_hidden_layers=1)
        paths.append(_peer_path(_attention_peer("deepseek_v3", "DeepseekV3Attention",
                                                config, layer, {}, seed)))
    else:
        _randomize(layer, seed)
    shape = (f"d_model {d}, {heads} heads, kv_lora_rank {sizes['kv_lora_rank']}, "
             f"q_lora_rank {sizes['q_lora_rank']}, head dims {sizes['qk_nope_head_dim']} + "
             f"{sizes['qk_rope_head_dim']} (RoPE), values {sizes['v_head_dim']}")
    return [_Group(key, MECHANISMS["latent"], shape, d, paths)]


def _sparse_latent(tiny: bool, seed: int, peers: bool) -> list[_Group]:
    d, heads, sizes = _latent_sizes(tiny)
    index = dict(index_n_heads=4, index_head_dim=8, index_topk=5) if tiny else \
        dict(index_n_heads=64, index_head_dim=128, index_topk=256)
    layer = SparseLatentAttention(d, heads, **sizes, **index, rope_base=10_000.0).eval()
    paths = _latent_paths(layer)
    if peers:
        import transformers

        config = transformers.DeepseekV32Config(
            hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads, **sizes,
            **index, rope_parameters=_rope(10_000.0), num_hidden_layers=1)
        # Its model always builds the mask (its indexer needs it) and passes positions.
        paths.append(_peer_path(_attention_peer(
            "deepseek_v32", "DeepseekV32Attention", config, layer, {}, seed,
            mask_kwargs={"allow_is_causal_skip": False}, position_ids=True)))
    else:
        _randomize(layer, seed)
    shape = (f"as MLA, with {index['index_n_heads']} index heads of "
             f"{index['index_head_dim']}, top {index['index_topk']} keys per query")
    return [_Group("sparse_latent", MECHANISMS["sparse_latent"], shape, d, paths)]


def _shared_names(prefix: str) -> dict[str, str]:
    return {f"{prefix}.gate_proj.": "shared_expert.fc1.",
            f"{prefix}.up_proj.": "shared_expert.fc2.",
            f"{prefix}.down_proj.": "shared_expert.fc3."}


def _gpt_oss_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """gpt-oss's experts (``gate_up_proj (E, d, 2I)``, gate and up interleaved in the
    columns) in qkv's layout (``(E, 2I, d)`` gate rows then up rows); ``down_proj (E, I,
    d)`` is qkv's already."""
    out = dict(state)
    w = state["experts.gate_up_proj"].transpose(1, 2)
    b = state["experts.gate_up_proj_bias"]
    out["experts.gate_up_proj"] = torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)
    out["experts.gate_up_proj_bias"] = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)
    return out


def _fused_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """DeepSeek's and Qwen's fused experts in qkv's layout: ``down_proj (E, d, I)``
    transposed to ``(E, I, d)``."""
    return {**state, "experts.down_proj": state["experts.down_proj"].transpose(1, 2)}


def _moe(tiny: bool, seed: int, peers: bool) -> list[_Group]:
    """Three families' routings at one size: 2,048 wide, 32 experts of 512, 4 per token
    (DeepSeek-V3 and Qwen3-Next also a shared expert of 1,024)."""
    # (toy widths a multiple of 4 floats: torch's grouped_mm needs 16-byte strides)
    d, inner, experts, k, shared = (16, 8, 8, 2, 16) if tiny else (2048, 512, 32, 4, 1024)
    size = f"d_model {d}, {experts} experts of {inner}, {k} per token"
    groups = []
    families: list[tuple[str, str, dict[str, Any], str]] = [
        ("deepseek_v3", "DeepseekV3MoE", dict(
            score="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4,
            topk_group=2, score_correction_bias=True, shared_hidden_dim=shared),
         f"sigmoid scores, 4 groups of which 2 kept, a shared expert of {shared}"),
        ("gpt_oss", "GptOssMLP", dict(norm_topk_prob=True, router_bias=True, expert_bias=True,
                                      activation="clamped_swiglu"),
         "softmax over the top k, biases, clamped SwiGLU"),
        ("qwen3_next", "Qwen3NextSparseMoeBlock", dict(
            norm_topk_prob=True, shared_hidden_dim=shared, shared_gate=True),
         f"softmax, a gated shared expert of {shared}"),
    ]
    for model_type, module_name, options, routing in families:
        ours = MoE(d, inner, experts, k, **options).eval()
        paths = _qkv_paths(ours, [("qkv loop", "readable", "loop"),
                                  ("qkv grouped", "default", "grouped")])
        if peers:
            import transformers

            if model_type == "deepseek_v3":
                config = transformers.DeepseekV3Config(
                    hidden_size=d, moe_intermediate_size=inner, n_routed_experts=experts,
                    num_experts_per_tok=k, n_group=4, topk_group=2,
                    n_shared_experts=shared // inner, routed_scaling_factor=2.5,
                    norm_topk_prob=True, num_hidden_layers=1)
                names = {"gate.weight": "router.weight",
                         "gate.e_score_correction_bias": "e_score_correction_bias",
                         **_shared_names("shared_experts")}
            elif model_type == "gpt_oss":
                config = transformers.GptOssConfig(
                    hidden_size=d, intermediate_size=inner, num_local_experts=experts,
                    num_experts_per_tok=k, num_hidden_layers=1)
                names = {}
            else:
                config = transformers.Qwen3NextConfig(
                    hidden_size=d, moe_intermediate_size=inner, num_experts=experts,
                    num_experts_per_tok=k, shared_expert_intermediate_size=shared,
                    norm_topk_prob=True, num_hidden_layers=1, layer_types=["full_attention"])
                names = {"gate.weight": "router.weight", **_shared_names("shared_expert")}
            peer = _moe_peer(model_type, module_name, config, seed)
            state = peer.module.state_dict()
            if model_type == "gpt_oss":
                ours.experts.alpha, ours.experts.limit = config.swiglu_alpha, config.swiglu_limit
                state = _gpt_oss_experts(state)
            else:
                state = _fused_experts(state)
            _load(ours, state, names)
            paths.append(_peer_path(peer))
        else:
            _randomize(ours, seed)
        groups.append(_Group(f"moe-{model_type}", f"MoE, {model_type}'s routing",
                             f"{size}; {routing}", d, paths))
    return groups


_BUILDERS: dict[str, Callable[[bool, int, bool], list[_Group]]] = {
    "mha": _mha, "sink": _sink, "gated": _gated, "latent": _latent,
    "sparse_latent": _sparse_latent, "moe": _moe,
}


# ----------------------------------------------------------------------------
# Measuring a group


def _inputs(batch: int, tokens: int, d_model: int, seed: int) -> tuple[Tensor, Tensor]:
    """A prompt ``(batch, tokens, d_model)`` and the next token ``(batch, 1, d_model)``."""
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(batch, tokens, d_model, generator=g),
            torch.randn(batch, 1, d_model, generator=g))


def _measure(group: _Group, modes: tuple[str, ...], tokens: int, config: VariantsConfig,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Every path of ``group`` in each of ``modes``: checked against the readable path,
    then timed in interleaved rounds. Returns ``{mode: {path: entry}}``."""
    x, x1 = _inputs(1, tokens, group.d_model, config.seed)
    readable = group.paths[0].name
    out: dict[str, Any] = {}
    for mode in modes:
        calls = {p.name: p.prompt(x) if mode == "prompt" else p.decode(x, x1)
                 for p in group.paths}
        outputs = {name: call() for name, call in calls.items()}
        scale = outputs[readable].abs().max().item() or 1.0
        entries: dict[str, Any] = {}
        for path in group.paths:
            diff = (outputs[path.name] - outputs[readable]).abs().max().item() / scale
            if not diff <= TOLERANCE:  # also catches NaN
                raise RuntimeError(
                    f"{group.key} {mode}: {path.name!r} differs from {readable!r} by "
                    f"{diff:.3g} of the output's largest value (tolerance {TOLERANCE:g}); "
                    f"its timing would be meaningless")
            entries[path.name] = {"role": path.role, "max_rel_diff": diff,
                                  "output_max": outputs[path.name].abs().max().item()}
        del outputs
        repeats = config.repeats if mode == "prompt" else config.decode_repeats
        # The compared call was the first warm-up.
        stats = round_robin(calls, repeats=repeats, warmup=max(config.warmup - 1, 0),
                            device=_CPU)
        del calls
        for name, s in stats.items():
            entries[name]["seconds"] = s.to_dict()
        _ratios(entries, readable)
        out[mode] = entries
        log(f"  {group.key} {mode}: " + ", ".join(
            f"{name} {format_ms(s.median)} ms" for name, s in stats.items()))
    return out


def _ratios(entries: dict[str, Any], readable: str) -> None:
    """``speedup_vs_readable`` and ``speedup_vs_transformers``: that path's median time
    over this one's (above 1: this path is the faster)."""
    base = {"readable": entries[readable]["seconds"]["median"]}
    for entry in entries.values():
        if entry["role"] == "transformers":
            base["transformers"] = entry["seconds"]["median"]
    for entry in entries.values():
        for what, seconds in base.items():
            entry[f"speedup_vs_{what}"] = seconds / entry["seconds"]["median"]


# ----------------------------------------------------------------------------
# The suite


def run_variants(config: VariantsConfig, out_dir: str | Path,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every mechanism, print the tables and targets, write ``variants.json``
    and ``variants.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    machine = machine_info(_CPU)
    # Other people's work slows every case alike (the rounds interleave them) but
    # stretches the spread: say how busy the machine was.
    load = {"start": _load_average()}
    skipped: dict[str, str] = {}
    peers = config.peers
    if peers and importlib.util.find_spec("transformers") is None:
        skipped["transformers"] = "not installed (pip install transformers)"
        peers = False
    version = None
    if peers:
        import transformers

        version = transformers.__version__
    log(f"variants: {config.tokens:,}-token prompt and one token against as many cached"
        + (f", MLA also against {config.long_cache:,}" if config.long_cache and
           "latent" in config.mechanisms else "")
        + f"; float32, batch 1, {machine['cpu']}, {torch.get_num_threads()} threads"
        + (f"; transformers {version}" if version else "")
        + (f"; load average {load['start']:.1f}" if load["start"] is not None else "")
        + (" (toy widths)" if config.tiny else ""))
    results: dict[str, Any] = {}
    with torch.no_grad():
        for mechanism in config.mechanisms:
            try:
                groups = _BUILDERS[mechanism](config.tiny, config.seed, peers)
            except Exception as e:  # a transformers without this family: qkv's paths alone
                if not peers:
                    raise
                skipped[f"transformers {mechanism}"] = error_line(e)
                groups = _BUILDERS[mechanism](config.tiny, config.seed, False)
            for group in groups:
                results[group.key] = {"label": group.label, "shape": group.shape,
                                      "paths": [p.name for p in group.paths],
                                      "modes": _measure(group, MODES, config.tokens, config,
                                                        log)}
            del groups  # the modules go: one mechanism's weights in memory at a time
        long_decode = None
        if config.long_cache and "latent" in config.mechanisms:
            group = _latent(config.tiny, config.seed, peers and
                            "transformers latent" not in skipped, key="latent-long")[0]
            long_decode = {"tokens": config.long_cache, "shape": group.shape,
                           "paths": [p.name for p in group.paths],
                           "decode": _measure(group, ("decode",), config.long_cache,
                                              config, log)["decode"]}
            del group
    load["end"] = _load_average()
    report: dict[str, Any] = {
        "suite": "variants", "config": dataclasses.asdict(config), "machine": machine,
        "load_average": load, "dtype": "float32", "transformers": version, "skipped": skipped,
        "results": results, "long_decode": long_decode,
    }
    for mode in MODES:
        log(f"\n{'prompt forward' if mode == 'prompt' else 'one decoding step'}, "
            f"{config.tokens:,} tokens{' cached' if mode == 'decode' else ''} (ms; x = "
            "that path's median over this one's, above 1: this one is the faster):\n")
        log(table(results, mode))
    if long_decode is not None:
        log(f"\nMLA, one decoding step against {config.long_cache:,} cached tokens:\n")
        log(long_table(long_decode))
    for what, reason in skipped.items():
        log(f"skipped {what}: {reason}")
    report["targets"] = targets(report)
    log("")
    for target in report["targets"]:
        log(target_line(target))
    write_json(out_dir / "variants.json", report)
    plot(report, out_dir / "variants.png")
    log(f"\nwrote {out_dir / 'variants.json'} and {out_dir / 'variants.png'}")
    return report


def _load_average() -> float | None:
    """The 1-minute load average (runnable processes; 2 means both cores busy), or None
    where the system does not keep one."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _x(entry: dict[str, Any], what: str) -> str:
    ratio = entry.get(f"speedup_vs_{what}")
    return "-" if ratio is None else f"{ratio:.2f}x"


def table(results: dict[str, Any], mode: str) -> str:
    """One mode's markdown table: every mechanism's paths, medians and ratios."""
    rows = []
    for result in results.values():
        for name, entry in result["modes"][mode].items():
            s = entry["seconds"]
            rows.append([result["label"], name, format_ms(s["median"]),
                         f"{format_ms(s['min'])}-{format_ms(s['max'])}",
                         _x(entry, "readable"), _x(entry, "transformers"),
                         f"{entry['max_rel_diff']:.1e}"])
    return markdown_table(["mechanism", "path", "median ms", "min-max ms", "x readable",
                           "x transformers", "differs by"], rows)


def long_table(long_decode: dict[str, Any]) -> str:
    rows = []
    for name, entry in long_decode["decode"].items():
        s = entry["seconds"]
        rows.append([name, format_ms(s["median"]), f"{format_ms(s['min'])}-"
                     f"{format_ms(s['max'])}", f"{1 / s['median']:,.1f}",
                     _x(entry, "readable"), _x(entry, "transformers"),
                     f"{entry['max_rel_diff']:.1e}"])
    return markdown_table(["path", "ms per token", "min-max ms", "tokens/s",
                           "x decompress", "x transformers", "differs by"], rows)


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """qkv's default path (the backend a model runs) not slower than transformers' module,
    for each mechanism and mode; at the long cache, absorbed MLA decoding not slower than
    transformers' nor than decompressing."""
    out = []

    def add(name: str, ratio: float, text: str) -> None:
        out.append({"name": name, "value": ratio, "threshold": 1.0, "met": ratio >= 1.0,
                    "value_text": text})

    for result in report["results"].values():
        for mode, entries in result["modes"].items():
            default = next(n for n, e in entries.items() if e["role"] == "default")
            peer = next((n for n, e in entries.items() if e["role"] == "transformers"), None)
            if peer is None:
                continue
            ratio = entries[default]["speedup_vs_transformers"]
            add(f"{result['label']}, {mode}: {default} not slower than "
                f"{peer.removeprefix('transformers ')}", ratio,
                f"{ratio:.2f}x ({format_ms(entries[default]['seconds']['median'])} vs "
                f"{format_ms(entries[peer]['seconds']['median'])} ms)")
    long_decode = report.get("long_decode")
    if long_decode is not None:
        entries = long_decode["decode"]
        absorbed = entries["qkv absorbed"]
        tokens = f"{long_decode['tokens']:,}"
        add(f"MLA decoding at {tokens} cached tokens: absorbed not slower than "
            "decompressed", absorbed["speedup_vs_readable"],
            f"{absorbed['speedup_vs_readable']:.2f}x")
        if "speedup_vs_transformers" in absorbed:
            add(f"MLA decoding at {tokens} cached tokens: absorbed not slower than "
                "transformers' DeepseekV3Attention", absorbed["speedup_vs_transformers"],
                f"{absorbed['speedup_vs_transformers']:.2f}x")
    return out


def plot(report: dict[str, Any], path: Path) -> Path:
    """Median time of every path, one panel per mode (log scale), bars coloured by who
    runs them."""
    rows = {mode: [(f"{r['label'].split(' (')[0]}: {name}", e)
                   for r in report["results"].values()
                   for name, e in r["modes"][mode].items()] for mode in MODES}
    n = max(len(v) for v in rows.values())
    fig = new_figure(13, 1.4 + 0.22 * n)
    axes = fig.subplots(1, 2)
    for ax, mode in zip(axes, MODES, strict=True):
        if not rows[mode]:
            continue
        labels = [label for label, _ in rows[mode]]
        colors = {"readable": "tab:gray", "fast": "tab:orange", "default": "tab:orange",
                  "transformers": "tab:blue"}
        hbars(ax, labels, [e["seconds"] for _, e in rows[mode]],
              colors=[colors[e["role"]] for _, e in rows[mode]], log=True, scale=1000.0,
              xlabel=f"{mode}: milliseconds (median, whiskers min-max)")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"attention variants and MoE, float32 on {report['machine']['cpu']} "
                 "(grey: qkv's readable path, orange: qkv's fast paths, blue: transformers)",
                 fontsize=9)
    return save_figure(fig, path)

