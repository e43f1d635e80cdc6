"""qkv: attention mechanisms, from the first dot product to fused multi-head attention.

Everything a learner meets in *Build a Large Language Model (From Scratch)*
chapter 3 and *Dive into Deep Learning*'s attention chapter is importable from
here under the books' names; ``qkv.d2l`` holds d2l's spellings where the two
books use the same name for different signatures.
"""

from . import functional
from .book.efficient_attention import PyTorchMultiHeadAttention
from .book.self_attention import (
    CausalAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    SelfAttentionV1,
    SelfAttentionV2,
)
from .functional import (
    all_attention_scores,
    all_attention_scores_loop,
    attention,
    attention_scores,
    attention_scores_loop,
    causal_mask,
    context_vector,
    context_vector_loop,
    lengths_to_mask,
    masked_softmax,
    normalize_by_sum,
    simple_self_attention,
    softmax_naive,
    softmax_stable,
)
from .kv_cache import KVCache
from .multihead import MultiHeadAttention
from .positional import PositionalEncoding
from .scoring import AdditiveAttention, DotProductAttention

__version__ = "0.1.0"

__all__ = [
    "functional",
    "all_attention_scores",
    "all_attention_scores_loop",
    "attention",
    "attention_scores",
    "attention_scores_loop",
    "causal_mask",
    "context_vector",
    "context_vector_loop",
    "lengths_to_mask",
    "masked_softmax",
    "normalize_by_sum",
    "simple_self_attention",
    "softmax_naive",
    "softmax_stable",
    "KVCache",
    "MultiHeadAttention",
    "PositionalEncoding",
    "AdditiveAttention",
    "DotProductAttention",
    "CausalAttention",
    "MultiHeadAttentionWrapper",
    "PyTorchMultiHeadAttention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "SelfAttentionV1",
    "SelfAttentionV2",
]
