"""qkv: attention mechanisms, from the first dot product to fused multi-head attention.

Everything a learner meets in *Build a Large Language Model (From Scratch)*
chapter 3 and *Dive into Deep Learning*'s attention chapter is importable from
here under the books' names; ``qkv.d2l`` holds d2l's spellings where the two
books use the same name for different signatures.

The names are imported on first use (PEP 562), not with the package: ``import qkv``
and the ``qkv`` command's ``--help`` do not import torch, which takes a second or more.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Each public name -> the module that defines it.
_SOURCES = {
    **dict.fromkeys(
        ("all_attention_scores", "all_attention_scores_loop", "attention", "attention_scores",
         "attention_scores_loop", "causal_mask", "context_vector", "context_vector_loop",
         "lengths_to_mask", "masked_softmax", "normalize_by_sum", "simple_self_attention",
         "softmax_naive", "softmax_stable"), ".functional"),
    "KVCache": ".kv_cache",
    "LatentCache": ".kv_cache",
    **dict.fromkeys(("DeltaNetCache", "GatedDeltaNet", "gated_delta_rule"), ".linear_attention"),
    "MultiHeadAttention": ".multihead",
    "LatentAttention": ".latent_attention",
    "SparseLatentAttention": ".latent_attention",
    **dict.fromkeys(("SinkAttention", "GatedAttention", "SharedKVAttention", "KVHandoff"),
                    ".attention_variants"),
    "PositionalEncoding": ".positional",
    "AdditiveAttention": ".scoring",
    "DotProductAttention": ".scoring",
    **dict.fromkeys(("CausalAttention", "MultiHeadAttentionWrapper", "SelfAttention_v1",
                     "SelfAttention_v2", "SelfAttentionV1", "SelfAttentionV2"),
                    ".book.self_attention"),
    "PyTorchMultiHeadAttention": ".book.efficient_attention",
    # what each head does (docs/heads.md): record and replace activations
    **dict.fromkeys(("capture", "intervene"), ".heads.capture"),
}

__all__ = ["functional", *_SOURCES]

def __getattr__(name: str) -> Any:
    if name == "functional":
        return importlib.import_module(".functional", __name__)
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
