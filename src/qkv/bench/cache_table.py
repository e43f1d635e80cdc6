"""What decoding caches, per token and in total, at the published configurations of the
models that made each attention mechanism known (docs/attention-variants.md).

    python -m qkv.bench.cache_table                           # the tables, as Markdown
    python -m qkv.bench.cache_table --plot docs/img/cache-bytes.png

Every number comes from the modules themselves: each model is a :class:`GPTConfig`
(built by :func:`qkv.models.hf_open.config_fields` from its ``config.json`` sizes, as
``qkv lm import`` builds it, where qkv imports the family), and
:meth:`GPTConfig.kv_cache_bytes` makes each layer's own cache on the ``meta`` device and
counts its buffers: a multi-head or grouped-query layer its key/value heads, a sliding
layer a ring of its window, a latent layer its latent and RoPE key (and a sparse one its
index key), a layer that shares another's keys and values nothing. No formula of the
cache is kept here; nothing is allocated or downloaded. It runs in seconds.

The caches are counted in bfloat16 (2 bytes a number), for one sequence.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..linear_attention import GatedDeltaNet
from ..models.gpt import GPTConfig
from ..models.hf_open import config_fields
from ..utils.figures import new_figure, save_figure

__all__ = ["TOKENS", "BYTES_PER_VALUE", "Published", "PUBLISHED", "CacheRow", "cache_rows",
           "markdown_tables", "plot_cache", "main"]

TOKENS = (1024, 4096, 16_384, 32_768, 131_072, 262_144, 1_048_576)
BYTES_PER_VALUE = 2  # bfloat16


@dataclass(frozen=True)
class Published:
    """A model's attention at its published sizes.

    Attributes:
        name: the model, as the table names it.
        attention: its attention mechanism, in words.
        source: where the sizes come from.
        config: builds its :class:`GPTConfig`.
        hypothetical: not a released model: the same sizes with one mechanism taken away,
            to show what that mechanism saves (drawn dashed).
    """

    name: str
    attention: str
    source: str
    config: Callable[[], GPTConfig]
    hypothetical: bool = False


def _imported(config: dict[str, Any]) -> Callable[[], GPTConfig]:
    """The :class:`GPTConfig` that ``qkv lm import`` makes of this ``config.json``."""
    return lambda: GPTConfig(**config_fields(config, f"{config['model_type']} config"))


# config.json of each model on the Hugging Face Hub (the keys that size it; transformers'
# defaults for the rest). DeepSeek-V3's weights are published in FP8; qkv imports them
# dequantized, so its quantization_config is left out.
GPT2_XL = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 1600,
           "n_layer": 48, "n_head": 25}
LLAMA_31_8B = {"model_type": "llama", "vocab_size": 128_256, "hidden_size": 4096,
               "intermediate_size": 14_336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8,
               "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5,
               "rope_theta": 500_000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}
GPT_OSS_20B = {"model_type": "gpt_oss", "vocab_size": 201_088, "hidden_size": 2880,
               "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
               "num_local_experts": 32, "num_experts_per_tok": 4,
               "max_position_embeddings": 131_072, "rope_theta": 150_000.0,
               "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 4096}}
GEMMA3_27B = {"model_type": "gemma3_text", "vocab_size": 262_208, "hidden_size": 5376,
              "intermediate_size": 21_504, "num_hidden_layers": 62,
              "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
              "query_pre_attn_scalar": 168, "sliding_window": 1024,
              "sliding_window_pattern": 6, "max_position_embeddings": 131_072,
              "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 129_280, "hidden_size": 7168,
               "intermediate_size": 18_432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "norm_topk_prob": True,
               "max_position_embeddings": 163_840, "rope_theta": 10_000.0,
               "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096}}
DEEPSEEK_V32 = {**DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64,
                "index_head_dim": 128, "index_topk": 2048}
# Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults are its sizes): 48 layers,
# three Gated DeltaNet layers (16 key heads, 32 value heads of 128) to one gated
# full-attention layer (16 query heads, 2 key/value heads of 256), 512 experts.
QWEN3_NEXT_80B = {"model_type": "qwen3_next", "vocab_size": 151_936, "hidden_size": 2048,
                  "intermediate_size": 5120, "num_hidden_layers": 48,
                  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                  "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
                  "num_experts": 512, "num_experts_per_tok": 10,
                  "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                  "max_position_embeddings": 1_048_576, "rope_theta": 10_000_000.0,
                  "partial_rotary_factor": 0.25,
                  # its 256k context stretched to 1M by YaRN, as Qwen's model card runs it
                  "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 262_144}}
# Gemma 4 E2B's text model (google/gemma-4-E2B-it's text_config): 35 layers, every 5th
# full attention with 512-wide heads, the others a 512-token window with 256-wide ones, one
# key/value head, and the last 20 layers reusing the keys and values of the last earlier
# layer of their kind; per-layer inputs and doubled MLPs in the shared layers cache nothing.
GEMMA4_E2B = {"model_type": "gemma4_text", "vocab_size": 262_144, "hidden_size": 1536,
              "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
              "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
              "sliding_window": 512,
              "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                              for i in range(35)],
              "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
              "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
              "attention_k_eq_v": False, "final_logit_softcapping": 30.0,
              "max_position_embeddings": 131_072, "tie_word_embeddings": True,
              "rope_parameters": {
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                     "rope_theta": 1_000_000.0}}}
# Gemma 3n E4B's text model (transformers' Gemma3nTextConfig defaults, documented as
# google/gemma-3n-E4B): 35 layers, 8 query heads sharing 2 key/value heads of 256, a
# full-attention layer every 5th and a 512-token window on the others, and the last 15
# layers reusing the keys and values of the last earlier layer of their kind (Gemma 4's
# small models share the same way). qkv does not import gemma3n; its attention layers are
# written out here: the rest of the model (AltUp, per-layer inputs, LAuReL) caches nothing.
GEMMA3N_E4B_LAYERS, GEMMA3N_E4B_SHARED = 35, 15


def _gemma3n_e4b(shared: int = GEMMA3N_E4B_SHARED) -> GPTConfig:
    n = GEMMA3N_E4B_LAYERS
    kinds = ["full" if (i + 1) % 5 == 0 else "sliding" for i in range(n)]
    first = n - shared
    # a shared layer reads the last layer of its own kind that computes keys and values
    source = {kind: max(i for i in range(first) if kinds[i] == kind) for kind in set(kinds)}
    layout = [{} if i < first else {"attention": "shared_kv", "kv_source": source[kinds[i]]}
              for i in range(n)]
    return GPTConfig(vocab_size=262_400, context_length=32_768, emb_dim=2048, n_heads=8,
                     n_layers=n, n_kv_groups=2, head_dim=256, drop_rate=0.0,
                     window_size=512, layer_types=kinds, rope=True, rope_base=1_000_000.0,
                     rope_local_base=10_000.0, norm="gemma_rmsnorm", mlp="geglu",
                     hidden_dim=16_384, mlp_bias=False, qkv_bias=False, out_bias=False,
                     qk_norm=True, post_norms=True, embed_scale=True, tie_weights=True,
                     layout=layout if shared else None)


PUBLISHED = (
    Published("GPT-2 XL", "MHA: 25 key/value heads of 64", "openai-community/gpt2-xl",
              _imported(GPT2_XL)),
    Published("Llama 3.1 8B", "GQA: 8 key/value heads for 32 query heads",
              "meta-llama/Llama-3.1-8B", _imported(LLAMA_31_8B)),
    Published("Llama 3.1 8B as MHA", "MHA: 32 key/value heads (no GQA)",
              "Llama 3.1 8B's sizes, one key/value head per query head",
              _imported({**LLAMA_31_8B, "num_key_value_heads": 32}), hypothetical=True),
    Published("gpt-oss-20b", "GQA (8 of 64), sinks; 128-token window on every other layer",
              "openai/gpt-oss-20b", _imported(GPT_OSS_20B)),
    Published("Gemma 3 27B", "GQA (16 of 32); 1,024-token window on 5 layers of 6",
              "google/gemma-3-27b-it", _imported(GEMMA3_27B)),
    Published("Gemma 3n E4B", "GQA (2 of 8), 512-token window on 4 layers of 5; "
              "last 15 of 35 layers share KV", "google/gemma-3n-E4B", _gemma3n_e4b),
    Published("Gemma 3n E4B, no sharing", "the same, every layer caching its own KV",
              "Gemma 3n E4B's sizes without num_kv_shared_layers",
              lambda: _gemma3n_e4b(shared=0), hypothetical=True),
    Published("Gemma 4 E2B", "MQA; 512-token window on 4 layers of 5, 512-wide heads on "
              "the 5th; last 20 of 35 layers share KV", "google/gemma-4-E2B-it",
              _imported(GEMMA4_E2B)),
    Published("DeepSeek-V3", "MLA: latent 512 + RoPE key 64 per token and layer",
              "deepseek-ai/DeepSeek-V3", _imported(DEEPSEEK_V3)),
    Published("DeepSeek-V3.2", "MLA + DSA: index key 128 more; each query reads 2,048 keys",
              "deepseek-ai/DeepSeek-V3.2-Exp", _imported(DEEPSEEK_V32)),
    Published("Qwen3-Next-80B", "Gated DeltaNet on 3 layers of 4 (a fixed state); GQA (2 of "
              "16) on the rest", "Qwen/Qwen3-Next-80B-A3B-Instruct",
              _imported(QWEN3_NEXT_80B)),
)


@dataclass(frozen=True)
class CacheRow:
    """One model's cache, counted by its modules.

    Attributes:
        model: the :class:`Published` it counts.
        layers, context_length: the model's depth and longest sequence.
        total: ``{tokens: bytes}`` of the cache after ``tokens`` tokens, for
            :data:`TOKENS` (also past ``context_length``: the arithmetic of the same
            shapes).
        per_token: bytes each further token adds once every window is full: the slope
            of ``total`` between its last two points.
        windows: bytes the sliding layers' rings hold whatever the length (``total`` is
            ``windows + tokens x per_token`` from the longest window on).
        keys_read: keys a new token's query reads at the last of :data:`TOKENS` (or at
            ``context_length`` if shorter), averaged over the layers (a window or a
            sparse top-k caps it).
    """

    model: Published
    layers: int
    context_length: int
    total: dict[int, int]
    per_token: int
    windows: int
    keys_read: float


def _keys_read(cfg: GPTConfig, tokens: int) -> float:
    """Keys a query at position ``tokens`` attends to, averaged over ``cfg``'s layers,
    read from the modules: a window (``window_size``) or an indexer's ``top_k`` caps
    them."""
    counts = []
    for block in cfg.meta_model().trf_blocks:
        att = block.att
        if isinstance(att, GatedDeltaNet):  # a query reads the state, no cached key
            counts.append(0)
            continue
        cap = getattr(att, "window_size", None)
        indexer = getattr(att, "indexer", None)
        if indexer is not None:
            cap = indexer.top_k
        counts.append(tokens if cap is None else min(tokens, cap))
    return sum(counts) / len(counts)


def cache_rows(models: Sequence[Published] = PUBLISHED,
               tokens: Sequence[int] = TOKENS) -> list[CacheRow]:
    """Each model's cache in bfloat16 bytes, one sequence, at each of ``tokens`` (sorted,
    at least two), from :meth:`GPTConfig.kv_cache_bytes` on the meta device."""
    tokens = sorted(tokens)
    if len(tokens) < 2:
        raise ValueError(f"tokens must list at least two lengths, got {tokens}")
    rows = []
    for model in models:
        cfg = model.config()
        total = {t: cfg.kv_cache_bytes(1, t, bytes_per_value=BYTES_PER_VALUE) for t in tokens}
        (t0, b0), (t1, b1) = list(total.items())[-2:]
        per_token = (b1 - b0) // (t1 - t0)
        rows.append(CacheRow(model, cfg.n_layers, cfg.context_length, total, per_token,
                             b1 - t1 * per_token,
                             _keys_read(cfg, min(tokens[-1], cfg.context_length))))
    return rows


def _size(n: float) -> str:
    """Bytes in binary units: ``131,072 -> '128 KiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{n:,.0f} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def markdown_tables(rows: Sequence[CacheRow]) -> str:
    """Two Markdown tables: bytes per token (and the windows' fixed part), and the total
    at each length (``—`` past the model's context)."""
    lengths = list(rows[0].total)
    last = _tokens(lengths[-1])
    lines = ["| model | attention | layers | bytes per token | + windows (fixed) | "
             f"keys a query reads at {last} or the context (mean per layer) |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        name = f"*{row.model.name}*" if row.model.hypothetical else row.model.name
        windows = _size(row.windows) if row.windows else "—"
        lines.append(f"| {name} | {row.model.attention} | {row.layers} | "
                     f"{row.per_token:,} ({_size(row.per_token)}) | {windows} | "
                     f"{row.keys_read:,.0f} |")
    lines += ["", "| model | context | " + " | ".join(_tokens(t) for t in lengths) + " |",
              "|---|---:|" + "---:|" * len(lengths)]
    for row in rows:
        name = f"*{row.model.name}*" if row.model.hypothetical else row.model.name
        cells = [_size(b) if t <= row.context_length else "—" for t, b in row.total.items()]
        lines.append(f"| {name} | {_tokens(row.context_length)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _colors(rows: Sequence[CacheRow]) -> list[str]:
    """One colour per model; a hypothetical variant takes the colour of the model before
    it (PUBLISHED lists each variant after the model it varies)."""
    colors: list[str] = []
    for row in rows:
        colors.append(colors[-1] if row.model.hypothetical and colors else f"C{len(set(colors))}")
    return colors


def plot_cache(rows: Sequence[CacheRow], path: str | Path) -> Path:
    """Draw bytes per token (bars) and the total cache against the length (log-log, up to
    each model's context) into ``path``; hypothetical variants hatched and dashed."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig = new_figure(13.0, 5.6)
    bars, lines = fig.subplots(1, 2, width_ratios=[1, 1.25])
    colors = _colors(rows)
    y = list(range(len(rows)))[::-1]  # the first model on top
    drawn = bars.barh(y, [row.per_token for row in rows], color=colors, alpha=0.85)
    for patch, yi, row in zip(drawn.patches, y, rows, strict=True):
        if row.model.hypothetical:
            patch.set_hatch("//")
        bars.text(row.per_token * 1.1, yi, _size(row.per_token), va="center", fontsize=9)
    bars.set_yticks(y, [row.model.name for row in rows])
    bars.set_xscale("log", base=2)
    low, high = min(r.per_token for r in rows) / 2, max(r.per_token for r in rows) * 8
    bars.set_xlim(low, high)
    ticks = [4**k for k in range(20) if low <= 4**k <= high]
    bars.xaxis.set_major_locator(FixedLocator(ticks))
    bars.xaxis.set_minor_locator(NullLocator())
    bars.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size(v)))
    bars.set_xlabel("cache bytes per token (bfloat16, once every window is full)")
    bars.set_title("What each further token adds to the cache")

    lengths = list(rows[0].total)
    for row, color in zip(rows, colors, strict=True):
        points = [(t, b) for t, b in row.total.items() if t <= row.context_length]
        label = row.model.name
        if row.context_length < lengths[-1]:
            label += f" (context {_tokens(row.context_length)})"
        lines.plot([t for t, _ in points], [b for _, b in points],
                   "--" if row.model.hypothetical else "-", marker="o", color=color,
                   label=label)
    lines.set_xscale("log", base=2)
    lines.set_yscale("log", base=2)
    lines.xaxis.set_major_locator(FixedLocator(lengths))
    lines.xaxis.set_minor_locator(NullLocator())
    lines.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens(int(round(v)))))
    lines.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _size(v)))
    lines.set_xlabel("tokens in the cache (one sequence)")
    lines.set_ylabel("total cache (bfloat16)")
    lines.set_title("The whole cache, up to each model's context")
    lines.grid(True, which="major", alpha=0.3)
    lines.legend(fontsize=8, loc="upper left")
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qkv.bench.cache_table",
        description="Print the cache tables of docs/attention-variants.md (bfloat16, one "
                    "sequence), counted from each model's modules on the meta device.")
    parser.add_argument("--plot", metavar="FILE",
                        help="also draw them into FILE (.png, .pdf or .svg; default: none)")
    args = parser.parse_args(argv)
    rows = cache_rows()
    print(markdown_tables(rows))
    if args.plot:
        print(f"\nplot written to {plot_cache(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
