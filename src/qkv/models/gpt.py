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

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from ..checks import (
    MAX_SIZE,
    check_dropout,
    check_float,
    check_heads,
    check_int,
    show,
    small_divisors,
)
from ..kernels import unavailable_reason
from ..kv_cache import KVCache, kv_cache_bytes
from ..multihead import MultiHeadAttention
from .native_decode import DTYPES as NATIVE_DTYPES
from .native_decode import NativeDecoder

__all__ = [
    "GPTEmbedding",
    "embed_tokens",
    "PRESETS",
    "FeedForward",
    "GELU",
    "GPTConfig",
    "GPTModel",
    "LayerNorm",
    "TransformerBlock",
    "MAX_NEW_TOKENS",
    "check_max_new_tokens",
    "check_sampling",
    "generate",
    "generate_text_simple",
    "native_unsupported",
]


# ----------------------------------------------------------------------------
# Configuration

# Overrides of the GPTConfig defaults (which are GPT-2 small, the book's GPT_CONFIG_124M).
PRESETS: dict[str, dict[str, Any]] = {
    # 124M parameters with tied embeddings as in OpenAI's GPT-2; the book (and this preset)
    # keeps a separate output head: 163,009,536 parameters.
    "gpt2-small": {},
    "gpt2-medium": {"emb_dim": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-large": {"emb_dim": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-xl": {"emb_dim": 1600, "n_layers": 48, "n_heads": 25},
    # Small enough to train on a laptop CPU in minutes (pass vocab_size=tokenizer.n_vocab).
    "tiny": {"context_length": 128, "emb_dim": 64, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0},
    "mini": {"context_length": 256, "emb_dim": 128, "n_heads": 4, "n_layers": 4, "drop_rate": 0.1},
    # "tiny" with what current models use: rotary positions instead of a learned table,
    # 2 key/value heads for 4 query heads (GQA), each token seeing its last 64.
    "tiny-modern": {"context_length": 128, "emb_dim": 64, "n_heads": 4, "n_layers": 2,
                    "drop_rate": 0.0, "n_kv_groups": 2, "window_size": 64, "rope": True},
}


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

    def __post_init__(self) -> None:
        # The cap keeps every dimension an int32; whether the model fits in memory is a
        # separate check (num_parameters, qkv.training.limits).
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            check_int(f"GPTConfig.{name}", getattr(self, name), 1, MAX_SIZE)
        for name in ("n_kv_groups", "window_size"):
            if getattr(self, name) is not None:
                check_int(f"GPTConfig.{name}", getattr(self, name), 1, MAX_SIZE)
        for name in ("qkv_bias", "tie_weights", "rope"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"GPTConfig.{name} must be True or False, got {show(getattr(self, name))}"
                )
        self.drop_rate = check_float("GPTConfig.drop_rate", self.drop_rate)  # NaN, inf fail
        check_dropout(self.drop_rate)
        if self.emb_dim % self.n_heads != 0:
            # (check_heads would list the divisors by trying every number up to emb_dim)
            raise ValueError(
                f"emb_dim ({self.emb_dim}) must be divisible by num_heads ({self.n_heads}); "
                f"e.g. num_heads in {small_divisors(self.emb_dim)}"
            )
        check_heads(self.emb_dim, self.n_heads, name="emb_dim")
        if self.n_kv_groups is not None and self.n_heads % self.n_kv_groups:
            raise ValueError(f"GPTConfig.n_kv_groups ({self.n_kv_groups}) must divide "
                             f"n_heads ({self.n_heads})")
        self.rope_base = check_float("GPTConfig.rope_base", self.rope_base, 1.0,
                                     lo_open=True)
        if self.rope and self.head_dim % 2:
            raise ValueError(f"GPTConfig.rope needs an even head size, got emb_dim "
                             f"{self.emb_dim} / n_heads {self.n_heads} = {self.head_dim}")

    # Sizes, from the config alone: nothing is allocated. Tested against built models.

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads per layer: ``n_kv_groups``, or ``n_heads``."""
        return self.n_heads if self.n_kv_groups is None else self.n_kv_groups

    def num_parameters(self) -> int:
        """Number of parameters of ``GPTModel(self)`` by arithmetic (a tied head counts once)."""
        V, C, d, L = self.vocab_size, self.context_length, self.emb_dim, self.n_layers
        kv = self.kv_heads * self.head_dim  # width of the key and value projections
        # W_q, W_k, W_v (with their biases), out_proj
        attention = d * d + 2 * d * kv + (d + 2 * kv if self.qkv_bias else 0) + d * d + d
        feed_forward = 8 * d * d + 5 * d  # (4d, d) + 4d and (d, 4d) + d
        block = attention + feed_forward + 4 * d  # and two LayerNorms
        head = 0 if self.tie_weights else V * d
        positions = 0 if self.rope else C * d
        return V * d + positions + L * block + 2 * d + head

    def kv_cache_bytes(self, batch_size: int, tokens: int, *, bytes_per_value: int = 4) -> int:
        """Bytes of the KV cache that decoding ``tokens`` positions for ``batch_size``
        sequences holds: every layer's ``kv_heads`` keys and values per position, at most
        ``window_size`` positions (see :func:`qkv.kv_cache.kv_cache_bytes`)."""
        return kv_cache_bytes(layers=self.n_layers, kv_heads=self.kv_heads,
                              head_dim=self.head_dim, batch=batch_size, tokens=tokens,
                              window=self.window_size, bytes_per_value=bytes_per_value)

    def training_flops_per_token(self, tokens: int | None = None) -> float:
        """Floating-point operations of one training step per token of a ``tokens``-long
        window (default: ``context_length``): the usual count behind "model FLOPs
        utilisation" (MFU), so that figures compare with other trainers'.

        ``6 N`` for the matrix products with the ``N`` weights they multiply (2 per
        multiply-add in the forward pass, twice that in the backward): the projections
        and MLP of every block and the output head (counted even when tied, as the
        product is done either way); embedding look-ups, norms and biases are not
        products. Attention adds ``12 L T d`` (``q k^T`` and ``weights @ v`` over the
        whole window, forward and backward, without crediting the causal mask's skipped
        half). Recomputation and padding are not counted: this is the model's work,
        not the hardware's.
        """
        T = self.context_length if tokens is None else tokens
        d, L = self.emb_dim, self.n_layers
        kv = self.kv_heads * self.head_dim
        matmul_weights = L * (10 * d * d + 2 * d * kv) + self.vocab_size * d
        # A window caps the keys each query scores; the count stays that of a full window.
        seen = T if self.window_size is None else min(T, self.window_size)
        return 6.0 * matmul_weights + 12.0 * L * seen * d

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
        V, d = self.vocab_size, self.emb_dim
        kv = self.kv_heads * self.head_dim
        yield "tok_emb.weight", (V, d)
        if not self.rope:
            yield "pos_emb.weight", (self.context_length, d)
        for i in range(self.n_layers):
            block = f"trf_blocks.{i}"
            for w, width in (("W_query", d), ("W_key", kv), ("W_value", kv)):
                yield f"{block}.att.{w}.weight", (width, d)
                if self.qkv_bias:
                    yield f"{block}.att.{w}.bias", (width,)
            yield f"{block}.att.out_proj.weight", (d, d)
            yield f"{block}.att.out_proj.bias", (d,)
            yield f"{block}.ff.layers.0.weight", (4 * d, d)
            yield f"{block}.ff.layers.0.bias", (4 * d,)
            yield f"{block}.ff.layers.2.weight", (d, 4 * d)
            yield f"{block}.ff.layers.2.bias", (d,)
            for norm in ("norm1", "norm2"):
                yield f"{block}.{norm}.scale", (d,)
                yield f"{block}.{norm}.shift", (d,)
        yield "final_norm.scale", (d,)
        yield "final_norm.shift", (d,)
        yield "out_head.weight", (V, d)

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
        """Plain dict (JSON-able) for a checkpoint; :meth:`from_dict` reverses it."""
        return asdict(self)

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


class GELU(nn.Module):
    """GELU with GPT-2's tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    """Position-wise MLP: ``Linear(d, 4d) -> GELU -> Linear(4d, d)``, shape-preserving."""

    def __init__(self, cfg: GPTConfig | Mapping[str, Any]) -> None:
        super().__init__()
        cfg = _as_config(cfg)
        self.layers = nn.Sequential(
            nn.Linear(cfg.emb_dim, 4 * cfg.emb_dim),
            GELU(),
            nn.Linear(4 * cfg.emb_dim, cfg.emb_dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm decoder block: ``x + attn(norm1(x))``, then ``x + ff(norm2(x))``.

    Normalising before each sub-layer (GPT-2's order) keeps the residual path an identity,
    which is what lets deep stacks train. Dropout is applied to each branch before it is
    added back ("shortcut dropout").

    Shapes: ``(batch, T, emb_dim) -> (batch, T, emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig | Mapping[str, Any]) -> None:
        super().__init__()
        cfg = _as_config(cfg)
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=cfg.drop_rate,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            num_kv_groups=cfg.n_kv_groups,
            window_size=cfg.window_size,
            rope=cfg.rope,
            rope_base=cfg.rope_base,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg.emb_dim)
        self.norm2 = LayerNorm(cfg.emb_dim)
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)

    def forward(
        self, x: Tensor, *, cache: KVCache | None = None, need_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x (batch, T, emb_dim)``; with ``need_weights`` also ``(batch, heads, T, T_k)``."""
        attended = self.att(self.norm1(x), cache=cache, need_weights=need_weights)
        weights = None
        if need_weights:
            attended, weights = attended
        x = x + self.drop_shortcut(attended)
        x = x + self.drop_shortcut(self.ff(self.norm2(x)))
        return (x, weights) if need_weights else x


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
        # With rotary embeddings the attention layers carry the positions: no table.
        self.pos_emb = None if cfg.rope else nn.Embedding(cfg.context_length, cfg.emb_dim)
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.final_norm = LayerNorm(cfg.emb_dim)
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
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Next-token logits for every position.

        Args:
            idx: token ids ``(batch, T)``.
            caches: one :class:`KVCache` per layer (:meth:`new_caches`); ``idx`` is then
                the tokens after the ``caches[0].pos`` already stored, and positions
                continue from there.
            need_weights: also return each layer's attention weights
                ``(batch, heads, T, T_k)`` (runs the eager attention path).

        Returns:
            logits ``(batch, T, vocab_size)``, or ``(logits, [weights per layer])``.
        """
        if caches is not None and len(caches) != len(self.trf_blocks):
            raise ValueError(
                f"need one KVCache per layer ({len(self.trf_blocks)}), got {len(caches)}"
            )
        start = caches[0].pos if caches is not None else 0
        if self.pos_emb is None:
            if idx.dim() != 2:
                raise ValueError(f"token ids must have shape (batch, tokens), got "
                                 f"{tuple(idx.shape)}")
            x = self.drop_emb(self.tok_emb(idx))
        else:
            x = self.drop_emb(embed_tokens(self.tok_emb, self.pos_emb, idx, start))
        all_weights = []
        for i, block in enumerate(self.trf_blocks):
            cache = caches[i] if caches is not None else None
            if need_weights:
                x, weights = block(x, cache=cache, need_weights=True)
                all_weights.append(weights)
            else:
                x = block(x, cache=cache)
        logits = self.out_head(self.final_norm(x))
        return (logits, all_weights) if need_weights else logits

    def decoding_weights(self) -> dict[str, Tensor]:
        """Copies of the wide layers' weights, laid out for CPU decoding; the model is untouched.

        Wide layers have more outputs than inputs: the output head (unless it is the tied
        token embedding, whose rows must stay contiguous for lookups) and each
        feed-forward's first layer. Each copy has the weight's values and shape
        ``(out, in)`` but is stored transposed in memory (``(in, out)`` row-major). Decoding
        with a KV cache multiplies one token at a time by every weight matrix, so it is
        bound by how fast weights stream from memory, and the CPU's matrix-vector kernel
        streams these layers about 1.5x faster in that layout (``docs/benchmarks.md``,
        "Generation"). Training's matrix products run best on ``nn.Linear``'s own layout,
        so the parameters keep it: :func:`generate` passes these copies to the forward
        pass (:func:`torch.func.functional_call`) for its duration and drops them after.

        Returns ``{state_dict name: tensor}``; empty off the CPU (the layout was measured
        only for the CPU's kernel). The copies cost the wide layers' memory again (267 MB
        of GPT-2 small's 650) and the time to copy them (about 0.3 s for GPT-2 small).
        """
        if self.out_head.weight.device.type != "cpu":
            return {}
        with torch.no_grad():
            return {
                f"{name}.weight": m.weight.detach().t().contiguous().t()
                for name, m in self.named_modules()
                if isinstance(m, nn.Linear)
                and m.out_features > m.in_features
                and m.weight is not self.tok_emb.weight
            }

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
            nn.init.normal_(block.ff.layers[2].weight, mean=0.0, std=residual_std)
        return self


# ----------------------------------------------------------------------------
# Decoding


def native_unsupported(model: nn.Module, batch_size: int = 1) -> str | None:
    """Why :class:`~qkv.models.native_decode.NativeDecoder` (``generate``'s ``native``
    steps) cannot decode ``model`` at ``batch_size`` (None when it can)."""
    if type(model) is not GPTModel:
        return f"a plain GPTModel is needed, got {type(model).__name__}"
    weight = model.out_head.weight
    if weight.device.type != "cpu":
        return f"the kernels run on the CPU, the model is on {weight.device}"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or weight.dtype not in NATIVE_DTYPES:
        return f"float32 or bfloat16 parameters are needed, got {sorted(map(str, dtypes))}"
    if batch_size != 1:
        return f"one sequence at a time, got a batch of {batch_size}"
    for block in model.trf_blocks:
        if type(block) is not TransformerBlock:
            return f"a block of type {type(block).__name__}"
        att, ff = block.att, block.ff
        if type(att) is not MultiHeadAttention or type(ff) is not FeedForward:
            return "attention and feed-forward must be qkv's MultiHeadAttention and FeedForward"
        if (att.num_kv_groups != att.num_heads or att.window_size is not None or att.rope
                or not att.causal or att.d_in != att.d_out):
            return "plain causal multi-head attention is needed (no GQA, window or RoPE)"
        if [type(m) for m in ff.layers] != [nn.Linear, GELU, nn.Linear]:
            return "the feed-forward must be Linear, GELU, Linear"
        if type(block.norm1) is not LayerNorm or type(block.norm2) is not LayerNorm:
            return "the norms must be qkv's LayerNorm"
    if type(model.final_norm) is not LayerNorm:
        return "the final norm must be qkv's LayerNorm"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks are registered, and only the model's forward runs them"
    return unavailable_reason()


# Most tokens one generate() call adds. Each costs a forward step (a whole window's once
# the context is full and positions are learned), and the output is kept whole; 100,000
# tokens is a long book. Longer texts: continue from the end of this one.
MAX_NEW_TOKENS = 100_000


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

    Runs in eval mode (dropout off) and restores the model's mode afterwards. With the
    cache on the CPU and the model's forward doing the steps (``native`` off or not
    possible), a :class:`GPTModel` decodes with :meth:`GPTModel.decoding_weights`, a
    faster layout of some weights, made for this call and dropped after it. Either way
    the model's parameters are never changed.
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
    use_native = False
    if use_cache and native is not False and max_new_tokens > 0:
        reason = native_unsupported(model, idx.shape[0])
        use_native = reason is None
        if native and not use_native:
            raise ValueError(f"native=True, but the kernels cannot decode here: {reason}")
    if use_cache and isinstance(model, GPTModel) and max_new_tokens > 0 and not use_native:
        # one token per step: the matrix-vector products stream weights faster in this
        # layout (GPTModel.decoding_weights); the parameters themselves are not touched
        layout = model.decoding_weights()
    else:
        layout = {}

    def forward(ids: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        kwargs = {} if caches is None else {"caches": caches}
        if not layout:
            return model(ids, **kwargs)
        return functional_call(model, layout, (ids,), kwargs)

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
        endless = (caches is not None and all(c.ring for c in caches)
                   and getattr(model, "pos_emb", True) is None)
        decoder = NativeDecoder(model, caches) if use_native else None
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        stop = None if eos_ids is None else torch.tensor(eos_ids, device=idx.device)
        # The whole output, allocated once: appending to a growing tensor would copy it
        # every step. `end` is the length so far; ids[:, :end] is the sequence.
        ids = idx.new_empty(idx.shape[0], idx.shape[1] + max_new_tokens)
        ids[:, : idx.shape[1]] = idx
        end = idx.shape[1]
        for _ in range(max_new_tokens):
            if caches is None:
                logits = forward(ids[:, max(end - context_size, 0) : end])
            elif caches[0].pos == 0 or (caches[0].pos == context_size and not endless):
                # first step, or the cache is full: (re-)fill it from the last window
                for cache in caches:
                    cache.reset()
                logits = forward(ids[:, max(end - context_size, 0) : end], caches)
            elif decoder is not None:
                logits = decoder.step(int(ids[0, end - 1]))
            else:
                # the cache holds every token but the newest: feed just that one
                logits = forward(ids[:, end - 1 : end], caches)
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
