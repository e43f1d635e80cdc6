"""docs/attention-variants.md's cache tables and plot (qkv.bench.cache_table).

The numbers come from the models' modules built on the meta device
(``GPTConfig.kv_cache_bytes``); here each is checked against a count worked out by hand
from the published sizes: layers x key/value heads x head size x 2 (a key and a value) x
2 bytes (bfloat16) per token, a sliding layer's ring capped at its window, latent
attention's latent and RoPE key, a layer sharing another's keys and values nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv.bench.cache_table import PUBLISHED, TOKENS, cache_rows, markdown_tables, plot_cache

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "attention-variants.md"
PLOT = ROOT / "docs" / "img" / "attention-variants-cache.png"
BF16 = 2
KV = 2  # a key and a value

# Each model's cache by hand: {name: (bytes per token, bytes of the windows' rings)}.
# Llama 3.1 8B: 32 layers x 8 key/value heads x 128.
LLAMA = 32 * 8 * 128 * KV * BF16
# gpt-oss-20b: 24 layers alternating sliding (128 tokens) and full, 8 key/value heads x 64.
GPT_OSS_LAYER = 8 * 64 * KV * BF16
# Gemma 3 27B: 62 layers, every 6th full (10), the others a 1,024-token window;
# 16 key/value heads x 128.
GEMMA3_LAYER = 16 * 128 * KV * BF16
# Gemma 3n E4B: 35 layers, every 5th full, the others a 512-token window; 2 key/value heads
# x 256; the last 15 layers share: of the 20 that cache, 4 are full (layers 4, 9, 14, 19).
GEMMA3N_LAYER = 2 * 256 * KV * BF16
BY_HAND = {
    "GPT-2 XL": (48 * 25 * 64 * KV * BF16, 0),
    "Llama 3.1 8B": (LLAMA, 0),
    "Llama 3.1 8B as MHA": (32 * 32 * 128 * KV * BF16, 0),
    "gpt-oss-20b": (12 * GPT_OSS_LAYER, 12 * 128 * GPT_OSS_LAYER),
    "Gemma 3 27B": (10 * GEMMA3_LAYER, 52 * 1024 * GEMMA3_LAYER),
    "Gemma 3n E4B": (4 * GEMMA3N_LAYER, 16 * 512 * GEMMA3N_LAYER),
    "Gemma 3n E4B, no sharing": (7 * GEMMA3N_LAYER, 28 * 512 * GEMMA3N_LAYER),
    # Gemma 4 E2B: of the first 15 layers (the last 20 share), 3 are full (4, 9, 14) with
    # one key/value head of 512, 12 slide over 512 tokens with one of 256
    "Gemma 4 E2B": (3 * 512 * KV * BF16, 12 * 512 * 256 * KV * BF16),
    # 61 layers x (latent 512 + RoPE key 64), no key/value heads at all
    "DeepSeek-V3": (61 * (512 + 64) * BF16, 0),
    # and the indexer's key, 128 wide
    "DeepSeek-V3.2": (61 * (512 + 64 + 128) * BF16, 0),
    # 12 full-attention layers of 2 key/value heads x 256; 36 Gated DeltaNet layers keep
    # a float32 state of 32 value heads x 128 x 128 and 3 inputs of the convolution
    # (2 x 16 x 128 + 32 x 128 = 8,192 channels, bfloat16) whatever the length
    "Qwen3-Next-80B": (12 * 2 * 256 * KV * BF16, 36 * (32 * 128 * 128 * 4 + 3 * 8192 * BF16)),
}


@pytest.fixture(scope="module")
def rows():
    return {row.model.name: row for row in cache_rows()}


def test_the_counts_worked_out_by_hand(rows):
    assert BY_HAND["Llama 3.1 8B"][0] == 131_072
    assert BY_HAND["DeepSeek-V3"][0] == 70_272
    assert set(rows) == set(BY_HAND)
    for name, (per_token, windows) in BY_HAND.items():
        row = rows[name]
        assert (row.per_token, row.windows) == (per_token, windows), name
        for tokens, total in row.total.items():
            assert total == windows + tokens * per_token, (name, tokens)


def test_windows_are_capped_and_shared_layers_cache_nothing(rows):
    # A sliding layer holds its window however long the sequence: from 1k to 128k tokens
    # only the full layers grow.
    gemma = rows["Gemma 3 27B"]
    assert gemma.total[131_072] - gemma.total[1024] == (131_072 - 1024) * 10 * GEMMA3_LAYER
    # KV sharing: the 15 sharing layers add nothing; 20 layers' caches remain of 35
    shared, unshared = rows["Gemma 3n E4B"], rows["Gemma 3n E4B, no sharing"]
    assert unshared.total[32_768] - shared.total[32_768] == (
        3 * 32_768 * GEMMA3N_LAYER + 12 * 512 * GEMMA3N_LAYER)
    # Sparse attention caches more (its index keys) but each query reads 2,048 keys
    assert rows["DeepSeek-V3.2"].keys_read == 2048
    # (at the longest length, 1M tokens, or the model's context where shorter)
    assert rows["DeepSeek-V3"].keys_read == 163_840
    assert rows["gpt-oss-20b"].keys_read == (128 + 131_072) / 2
    assert rows["Gemma 3 27B"].keys_read == (52 * 1024 + 10 * 131_072) / 62
    # linear attention reads a state, no cached key: only the 12 full layers of 48 read
    assert rows["Qwen3-Next-80B"].keys_read == 12 * TOKENS[-1] / 48
    # and its 36 DeltaNet layers hold the same at 1k tokens as at 1M
    qwen = rows["Qwen3-Next-80B"]
    assert qwen.total[TOKENS[-1]] - qwen.total[1024] == (TOKENS[-1] - 1024) * qwen.per_token
    # at its context of 32k: 28 sliding layers read 512 keys, 7 full ones 32,768
    assert rows["Gemma 3n E4B"].keys_read == (28 * 512 + 7 * 32_768) / 35
    assert rows["GPT-2 XL"].keys_read == 1024


def test_published_sizes_are_the_imported_configs():
    # DeepSeek-V3 is built as `qkv lm import` builds it: its latent attention in every
    # layer, experts after the first 3
    v3 = next(m for m in PUBLISHED if m.name == "DeepSeek-V3").config()
    assert [v3.layer_spec(i).attention for i in range(61)] == ["latent"] * 61
    assert [v3.layer_spec(i).mlp for i in (0, 2, 3, 60)] == ["dense", "dense", "moe", "moe"]
    assert v3.attention_options["latent"]["kv_lora_rank"] == 512
    gemma3n = next(m for m in PUBLISHED if m.name == "Gemma 3n E4B").config()
    sources = [gemma3n.layer_spec(i).kv_source for i in range(35)]
    # layers 20..34 read layer 18 (sliding) or 19 (full), the last of their kind before
    assert sources == [None] * 20 + [19 if (i + 1) % 5 == 0 else 18 for i in range(20, 35)]


def test_the_doc_shows_these_tables_and_the_plot(rows, tmp_path):
    text = DOC.read_text(encoding="utf-8")
    per_token, totals = markdown_tables(list(rows.values())).split("\n\n")
    assert per_token in text and totals in text  # regenerate the doc if this fails
    assert "python -m qkv.bench.cache_table" in text
    assert "img/attention-variants-cache.png" in text
    assert PLOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    drawn = plot_cache(list(rows.values()), tmp_path / "cache.png")
    height, width, _ = imread(drawn).shape
    assert (height, width) == imread(PLOT).shape[:2]  # the committed plot is this figure's
