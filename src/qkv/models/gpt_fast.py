"""The book's ``GPTModelFast``: chapter 4's GPT with PyTorch's own layers and the fused
attention of :class:`qkv.PyTorchMultiHeadAttention` (LLMs-from-scratch bonus material).

    torch.manual_seed(123)
    model = GPTModelFast(GPT_CONFIG_124M)          # the book's config dict
    logits = model(idx)                            # (batch, T) -> (batch, T, vocab)

It computes what :class:`~qkv.models.gpt.GPTModel` computes, with the book's
``GPTModelFast`` parameter names, so a state dict saved from the book's class loads here:
each block's attention is one ``att.qkv`` projection (queries', keys', values' rows in
that order) and ``att.proj``; the norms are ``nn.LayerNorm`` (``norm1.weight`` /
``norm1.bias`` where ``GPTModel`` has ``norm1.scale`` / ``norm1.shift``). Parameters are
drawn in the same order from the same initialisers, so a seed gives the same numbers as
``GPTModel`` under that seed. It has no KV cache: decode it with
``generate(..., use_cache=False)`` or :func:`~qkv.models.gpt.generate_text_simple`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ..book.efficient_attention import PyTorchMultiHeadAttention
from ..checks import show
from .gpt import FeedForward, GPTConfig, embed_tokens

__all__ = ["BOOK_CONFIG_FIELDS", "GPTModelFast", "TransformerBlockFast", "book_config"]

# The keys of the book's GPT_CONFIG_124M: all GPTModelFast reads.
BOOK_CONFIG_FIELDS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers",
                      "drop_rate", "qkv_bias")


def book_config(cfg: GPTConfig | Mapping[str, Any]) -> GPTConfig:
    """``cfg`` as a :class:`GPTConfig`, checked to describe the book's GPT-2 and nothing more.

    Raises:
        ValueError: not a config, or a field beyond :data:`BOOK_CONFIG_FIELDS` set away
            from its default (rotary positions, tied weights, ...), which this model
            would silently ignore; :class:`~qkv.models.gpt.GPTModel` builds those.
    """
    if isinstance(cfg, Mapping):
        cfg = GPTConfig.from_dict(cfg)
    if not isinstance(cfg, GPTConfig):
        raise ValueError(f"cfg must be a GPTConfig or the book's config dict, got {show(cfg)}")
    plain = GPTConfig(**{name: getattr(cfg, name) for name in BOOK_CONFIG_FIELDS})
    extra = [name for name in GPTConfig.field_names()
             if getattr(cfg, name) != getattr(plain, name)]
    if extra:
        raise ValueError(f"GPTModelFast builds the book's GPT-2 ({', '.join(BOOK_CONFIG_FIELDS)}), "
                         f"not {extra[0]}={show(getattr(cfg, extra[0]))}; use GPTModel for that")
    return cfg


class TransformerBlockFast(nn.Module):
    """Pre-norm block: ``x + drop(att(norm1(x)))``, then ``x + drop(ff(norm2(x)))``.

    Shapes: ``(batch, T, emb_dim) -> (batch, T, emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig | Mapping[str, Any]) -> None:
        super().__init__()
        cfg = book_config(cfg)
        self.att = PyTorchMultiHeadAttention(cfg.emb_dim, cfg.emb_dim, cfg.n_heads,
                                             dropout=cfg.drop_rate, qkv_bias=cfg.qkv_bias)
        self.ff = FeedForward(cfg)
        self.norm1 = nn.LayerNorm(cfg.emb_dim)
        self.norm2 = nn.LayerNorm(cfg.emb_dim)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModelFast(nn.Module):
    """GPT-2 of the book's chapter 4, fast form: ids ``(batch, T)`` -> logits
    ``(batch, T, vocab_size)``, ``T <= context_length``.

    Args:
        cfg: the book's config dict (``GPT_CONFIG_124M``) or a :class:`GPTConfig` using
            only its fields (:func:`book_config`).

    Attributes (the book's): ``tok_emb``, ``pos_emb``, ``drop_emb``, ``trf_blocks``
    (:class:`TransformerBlockFast`), ``final_norm``, ``out_head``; ``cfg`` is the
    :class:`GPTConfig`.
    """

    def __init__(self, cfg: GPTConfig | Mapping[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg = book_config(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*[TransformerBlockFast(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = nn.LayerNorm(cfg.emb_dim)
        self.out_head = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, in_idx: Tensor) -> Tensor:
        x = self.drop_emb(embed_tokens(self.tok_emb, self.pos_emb, in_idx))
        return self.out_head(self.final_norm(self.trf_blocks(x)))
