"""``qkv bench attention``: ten ways to compute causal multi-head self-attention, timed.

Every path below computes the same function with the same weights: queries, keys and
values projected from ``x (batch, T, dim)`` without bias, ``heads`` causal scaled
dot-product heads, concatenated, then an output projection with bias. Before anything
is timed, :func:`check_agreement` runs every path on a small input and checks that the
outputs (and, where a path has a backward, the input gradients) match qkv's, so a
broken baseline cannot make anything look fast.

=================  ===========================================================
``book-wrapper``   LLMs-from-scratch §3.6.1: ``heads`` separate ``CausalAttention``
                   modules of width ``dim / heads``, concatenated (plus the output
                   projection the others have, so that all compute one function)
``book-mha``       §3.6.2: the weight-split ``MultiHeadAttention``, eager softmax
``fused-qkv``      one ``(dim, 3 dim)`` projection for q, k, v; eager softmax
``einsum``         weight-split, every product written with ``torch.einsum``
``sdpa-causal``    fused projection + ``scaled_dot_product_attention(is_causal=True)``
``sdpa-mask``      the same with an explicit boolean causal mask
``torch-mha-w``    ``nn.MultiheadAttention``, ``need_weights=True`` (its default)
``torch-mha``      ``nn.MultiheadAttention``, ``need_weights=False``, ``is_causal``
``flex``           fused projection + compiled FlexAttention with a causal block mask
``qkv``            ``qkv.MultiHeadAttention(dim, dim, T, 0.0, heads)``: the default
=================  ===========================================================

The first nine follow the book's bonus notebook "efficient multi-head attention"; all are
written here from their descriptions. Two modes are measured:

- forward: ``module.eval()`` under ``torch.no_grad()`` (inference; this is also where
  ``nn.MultiheadAttention`` takes its "fast path");
- forward + backward: training mode, ``x`` requires grad (as inside a model), the output
  is back-propagated with a fixed random gradient.

The sweep (``--sweep``) times the forward pass at batch 1 for 128 ... 8,192 tokens for
the eager paths (``book-mha`` and ``qkv-eager``, i.e. ``backend="eager"``) and the fused
default, and measures their peak memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..multihead import MultiHeadAttention
from ..utils.figures import new_figure, save_figure
from .timing import (
    MEMORY_MODES,
    format_mib,
    format_ms,
    machine_info,
    markdown_table,
    peak_bytes,
    resolve_device,
    resolve_dtype,
    round_robin,
    run_isolated,
    target_line,
    write_json,
)

__all__ = [
    "AttentionConfig",
    "PATHS",
    "Weights",
    "build_path",
    "check_agreement",
    "measure_memory",
    "run_attention",
]

# name -> label for tables and plots, in table order.
PATHS: dict[str, str] = {
    "book-wrapper": "book wrapper (12 heads stacked)",
    "book-mha": "book MHA (weight split)",
    "fused-qkv": "fused QKV projection",
    "einsum": "einsum",
    "sdpa-causal": "SDPA is_causal",
    "sdpa-mask": "SDPA explicit mask",
    "torch-mha-w": "nn.MultiheadAttention need_weights=True",
    "torch-mha": "nn.MultiheadAttention need_weights=False",
    "flex": "FlexAttention",
    "qkv": "qkv.MultiHeadAttention (default)",
    "qkv-eager": "qkv.MultiHeadAttention backend='eager'",
}
TABLE_PATHS = tuple(name for name in PATHS if name != "qkv-eager")
SWEEP_PATHS = ("book-mha", "qkv-eager", "qkv")
# The two paths every other one is compared with.
BASELINES = ("book-mha", "torch-mha")
MODES = ("forward", "train")
MODE_LABELS = {"forward": "forward", "train": "forward+backward"}
# Shape of the input on which every path must agree with qkv before it is timed.
_CHECK_BATCH, _CHECK_TOKENS = 2, 24


# ----------------------------------------------------------------------------
# One set of weights for every path


@dataclass(frozen=True)
class Weights:
    """The parameters all paths share: ``(dim, dim)`` projections stored as in
    ``nn.Linear`` (out x in), and the output bias ``(dim,)``."""

    query: Tensor
    key: Tensor
    value: Tensor
    out: Tensor
    out_bias: Tensor

    @classmethod
    def random(cls, dim: int, seed: int = 0) -> Weights:
        """``nn.Linear``'s default initialisation range, from a private generator."""
        g = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(dim)

        def uniform(*shape: int) -> Tensor:
            return (torch.rand(*shape, generator=g) * 2 - 1) * bound

        return cls(uniform(dim, dim), uniform(dim, dim), uniform(dim, dim),
                   uniform(dim, dim), uniform(dim))

    def stacked_qkv(self) -> Tensor:
        """``(3 dim, dim)``: q, k and v rows on top of each other, one fused projection."""
        return torch.cat([self.query, self.key, self.value])


def _causal_future(tokens: int) -> Tensor:
    """``(T, T)`` bool, True above the diagonal: the keys a query must not see."""
    return torch.ones(tokens, tokens, dtype=torch.bool).triu(diagonal=1)


# ----------------------------------------------------------------------------
# The reference paths


class BookCausalHead(nn.Module):
    """One head computed as the book's ``CausalAttention`` does: explicit scores, a float
    mask buffer of ones above the diagonal filled in place with ``-inf``, softmax,
    dropout, weighted sum. ``x (b, T, d_in) -> (b, T, d_head)``."""

    def __init__(self, d_in: int, d_head: int, context_length: int, dropout: float = 0.0):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_head, bias=False)
        self.W_key = nn.Linear(d_in, d_head, bias=False)
        self.W_value = nn.Linear(d_in, d_head, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.ones(context_length, context_length).triu(1))

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)
        scores = queries @ keys.transpose(1, 2)  # (b, T, T)
        scores.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return self.dropout(weights) @ values


class BookHeadStack(nn.Module):
    """The book's ``MultiHeadAttentionWrapper``: ``heads`` independent heads run one after
    the other and concatenated, then the output projection all paths share.
    ``x (b, T, dim) -> (b, T, dim)``."""

    def __init__(self, dim: int, heads: int, context_length: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.heads = nn.ModuleList(
            BookCausalHead(dim, self.head_dim, context_length) for _ in range(heads)
        )
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(torch.cat([head(x) for head in self.heads], dim=-1))

    @torch.no_grad()
    def load(self, w: Weights) -> None:
        for i, head in enumerate(self.heads):
            rows = slice(i * self.head_dim, (i + 1) * self.head_dim)
            head.W_query.weight.copy_(w.query[rows])
            head.W_key.weight.copy_(w.key[rows])
            head.W_value.weight.copy_(w.value[rows])
        _load_linear(self.out_proj, w.out, w.out_bias)


class BookMHA(nn.Module):
    """The book's weight-split ``MultiHeadAttention`` (§3.6.2): three projections, heads
    as a batch axis, eager masked softmax. ``x (b, T, dim) -> (b, T, dim)``."""

    def __init__(self, dim: int, heads: int, context_length: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.W_query = nn.Linear(dim, dim, bias=False)
        self.W_key = nn.Linear(dim, dim, bias=False)
        self.W_value = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.ones(context_length, context_length).triu(1))

    def forward(self, x: Tensor) -> Tensor:
        b, t, dim = x.shape
        # (b, T, dim) -> (b, heads, T, head_dim)
        q = self.W_query(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(2, 3)  # (b, heads, T, T)
        scores.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
        weights = self.dropout(torch.softmax(scores / self.head_dim**0.5, dim=-1))
        context = (weights @ v).transpose(1, 2).contiguous().view(b, t, dim)
        return self.out_proj(context)

    @torch.no_grad()
    def load(self, w: Weights) -> None:
        self.W_query.weight.copy_(w.query)
        self.W_key.weight.copy_(w.key)
        self.W_value.weight.copy_(w.value)
        _load_linear(self.out_proj, w.out, w.out_bias)


class EinsumMHA(BookMHA):
    """The weight-split layer with every product an ``einsum``. Same parameters."""

    def forward(self, x: Tensor) -> Tensor:
        b, t, dim = x.shape
        split = (b, t, self.heads, self.head_dim)
        q = torch.einsum("bti,oi->bto", x, self.W_query.weight).view(split)
        k = torch.einsum("bti,oi->bto", x, self.W_key.weight).view(split)
        v = torch.einsum("bti,oi->bto", x, self.W_value.weight).view(split)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        scores = scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        weights = self.dropout(torch.softmax(scores / self.head_dim**0.5, dim=-1))
        context = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, dim)
        return self.out_proj(context)


def causal_mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """FlexAttention's description of causality: a query sees keys at or before it."""
    return q_idx >= kv_idx


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # Without compile, flex_attention runs an unfused reference that builds every score.
    return torch.compile(flex_attention, dynamic=False)


class FusedQKV(nn.Module):
    """q, k and v from one ``(dim, 3 dim)`` projection, then one of four kernels.

    ``kernel``: ``"eager"`` (explicit masked softmax), ``"sdpa-causal"``,
    ``"sdpa-mask"`` or ``"flex"``. ``x (b, T, dim) -> (b, T, dim)``.
    """

    KERNELS = ("eager", "sdpa-causal", "sdpa-mask", "flex")

    def __init__(
        self, dim: int, heads: int, context_length: int, kernel: str, compile_flex: bool = True
    ) -> None:
        super().__init__()
        if kernel not in self.KERNELS:
            raise ValueError(f"kernel must be one of {self.KERNELS}, got {kernel!r}")
        self.heads, self.head_dim, self.kernel = heads, dim // heads, kernel
        self.compile_flex = compile_flex
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim)
        self.register_buffer("future", _causal_future(context_length), persistent=False)
        self._block_masks: dict[tuple[int, str], Any] = {}

    def forward(self, x: Tensor) -> Tensor:
        b, t, dim = x.shape
        # (b, T, 3 dim) -> (3, b, heads, T, head_dim): one matrix product makes all three
        qkv = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.kernel == "eager":
            scores = (q @ k.transpose(-2, -1)).masked_fill(self.future[:t, :t], -torch.inf)
            context = torch.softmax(scores / self.head_dim**0.5, dim=-1) @ v
        elif self.kernel == "sdpa-causal":
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.kernel == "sdpa-mask":
            # SDPA's boolean mask means "may attend": the complement of the future
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=~self.future[:t, :t])
        else:
            context = self._flex(q, k, v)
        return self.out_proj(context.transpose(1, 2).reshape(b, t, dim))

    def _flex(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        t = q.shape[2]
        key = (t, str(q.device))
        if key not in self._block_masks:  # built once per length, as a model would
            self._block_masks[key] = create_block_mask(
                causal_mask_mod, None, None, t, t, device=q.device
            )
        if self.compile_flex:
            return _compiled_flex_attention()(q, k, v, block_mask=self._block_masks[key])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": we know
            return flex_attention(q, k, v, block_mask=self._block_masks[key])

    @torch.no_grad()
    def load(self, w: Weights) -> None:
        self.qkv.weight.copy_(w.stacked_qkv())
        _load_linear(self.out_proj, w.out, w.out_bias)


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` called as its documentation suggests for causal
    self-attention: a boolean mask (True = hidden) plus the ``is_causal`` hint, which
    lets it use SDPA's causal kernel when no weights are returned.
    ``x (b, T, dim) -> (b, T, dim)``."""

    def __init__(self, dim: int, heads: int, context_length: int, need_weights: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.need_weights = need_weights
        self.register_buffer("future", _causal_future(context_length), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        out, _ = self.mha(x, x, x, attn_mask=self.future[:t, :t], need_weights=self.need_weights,
                          is_causal=True)
        return out

    @torch.no_grad()
    def load(self, w: Weights) -> None:
        self.mha.in_proj_weight.copy_(w.stacked_qkv())
        # bias=True is the default users get; a zero q/k/v bias keeps the function equal
        self.mha.in_proj_bias.zero_()
        _load_linear(self.mha.out_proj, w.out, w.out_bias)


def _load_linear(layer: nn.Linear, weight: Tensor, bias: Tensor | None = None) -> None:
    layer.weight.copy_(weight)
    if bias is not None:
        layer.bias.copy_(bias)


def build_path(
    name: str, dim: int, heads: int, context_length: int, weights: Weights,
    *, compile_flex: bool = True,
) -> nn.Module:
    """The module for path ``name`` with ``weights`` loaded (on the CPU, float32)."""
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
    module: nn.Module
    if name == "book-wrapper":
        module = BookHeadStack(dim, heads, context_length)
    elif name == "book-mha":
        module = BookMHA(dim, heads, context_length)
    elif name == "einsum":
        module = EinsumMHA(dim, heads, context_length)
    elif name == "fused-qkv":
        module = FusedQKV(dim, heads, context_length, "eager")
    elif name in ("sdpa-causal", "sdpa-mask", "flex"):
        module = FusedQKV(dim, heads, context_length, name, compile_flex=compile_flex)
    elif name in ("torch-mha-w", "torch-mha"):
        module = TorchMHA(dim, heads, context_length, need_weights=name == "torch-mha-w")
    elif name in ("qkv", "qkv-eager"):
        backend = "eager" if name == "qkv-eager" else "fused"
        module = MultiHeadAttention(dim, dim, context_length, 0.0, heads, backend=backend)
        with torch.no_grad():
            module.W_query.weight.copy_(weights.query)
            module.W_key.weight.copy_(weights.key)
            module.W_value.weight.copy_(weights.value)
            _load_linear(module.out_proj, weights.out, weights.out_bias)
        return module
    else:
        raise ValueError(f"unknown attention path {name!r}; choose from {', '.join(PATHS)}")
    module.load(weights)
    return module


def supports_backward(name: str, device: torch.device) -> bool:
    """FlexAttention has no backward on the CPU (torch raises); everything else does."""
    return not (name == "flex" and device.type == "cpu")


def probe_flex(dim: int, heads: int, device: torch.device, compile_flex: bool) -> str | None:
    """None when FlexAttention runs here, else why not (one line).

    Compiling it needs a C++ compiler on the CPU and Triton on CUDA; where either is
    missing the path is reported as skipped instead of failing the whole suite.
    """
    try:
        # the shape check_agreement uses, so that its call reuses the compiled kernel
        case = _make_case("flex", _CHECK_BATCH, _CHECK_TOKENS, dim, heads, device,
                          torch.float32, 0, compile_flex)
        case.forward()
    except Exception as e:  # whatever the compiler stack raises
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return f"FlexAttention does not run here: {type(e).__name__}: {first_line}"
    return None


# ----------------------------------------------------------------------------
# Configuration


@dataclass
class AttentionConfig:
    """What to measure. The defaults are the book's bonus benchmark: batch 8, 1,024
    tokens, 768 dims, 12 heads (GPT-2 small's attention layer).

    Attributes:
        repeats, warmup: timed and untimed calls per path and mode.
        device, dtype: ``"auto"``: CUDA + bfloat16 when available, else CPU + float32.
        memory: ``"isolated"`` (fresh interpreter per case on the CPU), ``"in-process"``
            or ``"off"``.
        compile_flex: compile FlexAttention (without, it runs its unfused reference).
        paths: which paths go in the table.
        sweep: also run the sequence-length sweep (batch ``sweep_batch``, forward only).
    """

    batch: int = 8
    tokens: int = 1024
    dim: int = 768
    heads: int = 12
    repeats: int = 5
    warmup: int = 1
    device: str = "auto"
    dtype: str = "auto"
    memory: str = "isolated"
    compile_flex: bool = True
    seed: int = 0
    paths: tuple[str, ...] = TABLE_PATHS
    sweep: bool = False
    sweep_tokens: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    sweep_batch: int = 1
    sweep_paths: tuple[str, ...] = SWEEP_PATHS
    sweep_repeats: int = 3

    @classmethod
    def quick(cls, **overrides: Any) -> AttentionConfig:
        """Small shapes that run in seconds anywhere."""
        small = {"batch": 2, "tokens": 128, "dim": 64, "heads": 4, "repeats": 3,
                 "sweep_tokens": (64, 128, 256), "sweep_repeats": 2}
        return cls(**{**small, **overrides})

    def validate(self) -> None:
        for name in ("batch", "tokens", "dim", "heads", "repeats", "sweep_batch",
                     "sweep_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if not self.paths:
            raise ValueError("paths must name at least one attention path")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")
        unknown = [p for p in (*self.paths, *self.sweep_paths) if p not in PATHS]
        if unknown:
            raise ValueError(f"unknown attention path(s) {unknown}; choose from {list(PATHS)}")


# ----------------------------------------------------------------------------
# Running one case


@dataclass
class _Case:
    """A module, its input and the two calls that are timed."""

    module: nn.Module
    x: Tensor
    grad: Tensor

    def forward(self) -> None:
        self.module.eval()
        with torch.no_grad():
            self.module(self.x)

    def train(self) -> None:
        self.module.train()
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None
        self.module(self.x).backward(self.grad)


def _make_case(
    name: str, batch: int, tokens: int, dim: int, heads: int, device: torch.device,
    dtype: torch.dtype, seed: int, compile_flex: bool,
) -> _Case:
    module = build_path(name, dim, heads, tokens, Weights.random(dim, seed),
                        compile_flex=compile_flex).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, tokens, dim, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(batch, tokens, dim, generator=g).to(device=device, dtype=dtype)
    x.requires_grad_(supports_backward(name, device))
    return _Case(module, x, grad)


def measure_memory(
    name: str, mode: str, batch: int, tokens: int, dim: int, heads: int, device: str,
    dtype: str, seed: int = 0, compile_flex: bool = True,
) -> dict[str, Any]:
    """Peak extra memory of one call of path ``name`` in ``mode`` (``"forward"`` or
    ``"train"``), after one warm-up call. Module-level and JSON in, JSON out, so that
    :func:`~qkv.bench.timing.run_isolated` can run it in a fresh interpreter.

    The module, its input and the output gradient exist before the measured call, so
    the number is what the call itself adds: activations, scores, saved tensors,
    gradients.
    """
    dev = torch.device(device)
    case = _make_case(name, batch, tokens, dim, heads, dev, getattr(torch, dtype), seed,
                      compile_flex)
    call = case.forward if mode == "forward" else case.train
    call()  # one-time work (kernel selection, compiled code, block masks) is not counted
    if mode == "train":  # the gradients of the warm-up would already be allocated
        case.module.zero_grad(set_to_none=True)
        case.x.grad = None
    nbytes, method = peak_bytes(call, dev)
    return {"bytes": nbytes, "method": method}


def _memory(
    config: AttentionConfig, name: str, mode: str, batch: int, tokens: int,
    device: torch.device, dtype: torch.dtype,
) -> dict[str, Any] | None:
    if config.memory == "off":
        return None
    kwargs = {"name": name, "mode": mode, "batch": batch, "tokens": tokens, "dim": config.dim,
              "heads": config.heads, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "seed": config.seed,
              "compile_flex": config.compile_flex}
    # On CUDA the allocator's own counters are exact in any process.
    if config.memory == "isolated" and device.type == "cpu":
        return run_isolated(measure_memory, **kwargs)
    return measure_memory(**kwargs)


# ----------------------------------------------------------------------------
# Agreement


def check_agreement(
    paths: tuple[str, ...], dim: int, heads: int, device: torch.device, *,
    batch: int = _CHECK_BATCH, tokens: int = _CHECK_TOKENS, seed: int = 0,
    compile_flex: bool = True,
    tol: float = 1e-4,
) -> dict[str, float]:
    """Run every path on one small float32 input; all must match ``qkv``.

    Compares the outputs and, for paths with a backward, the gradients with respect to
    ``x``. Returns ``{path: largest absolute difference}``.

    Raises:
        RuntimeError: a path disagrees by more than ``tol`` (relative to the output scale).
    """
    reference = _make_case("qkv", batch, tokens, dim, heads, device, torch.float32, seed, False)
    ref_out = reference.module(reference.x)
    ref_out.backward(reference.grad)
    scale = max(ref_out.abs().max().item(), reference.x.grad.abs().max().item(), 1e-6)
    diffs = {}
    for name in paths:
        case = _make_case(name, batch, tokens, dim, heads, device, torch.float32, seed,
                          compile_flex)
        if supports_backward(name, device):
            out = case.module(case.x)
            out.backward(case.grad)
            diff = max((out - ref_out).abs().max().item(),
                       (case.x.grad - reference.x.grad).abs().max().item())
        else:
            with torch.no_grad():
                out = case.module(case.x)
            diff = (out - ref_out).abs().max().item()
        if not diff <= tol * scale:  # also catches nan
            raise RuntimeError(
                f"attention path {name!r} disagrees with qkv.MultiHeadAttention by {diff:.3g} "
                f"(tolerance {tol * scale:.3g}); its timing would be meaningless"
            )
        diffs[name] = diff
    return diffs


# ----------------------------------------------------------------------------
# The suite


def run_attention(
    config: AttentionConfig, out_dir: str | Path, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure every path, print the tables, write ``attention.json`` and ``attention.png``
    (and ``attention-sweep.png`` with ``config.sweep``) in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    machine = machine_info(device)  # recorded when the run starts
    paths = list(config.paths)
    skipped: dict[str, str] = {}

    log(f"attention: batch {config.batch}, {config.tokens} tokens, {config.dim} dims, "
        f"{config.heads} heads, {str(dtype).removeprefix('torch.')} on {device}, "
        f"{torch.get_num_threads()} threads")
    if "flex" in paths:
        reason = probe_flex(config.dim, config.heads, device, config.compile_flex)
        if reason is not None:
            skipped["flex"] = reason
            paths.remove("flex")
    agreement = check_agreement(tuple(paths), config.dim, config.heads, device,
                                seed=config.seed, compile_flex=config.compile_flex)
    log(f"all {len(paths)} paths agree with qkv.MultiHeadAttention "
        f"(largest difference {max(agreement.values()):.2g})")

    results: dict[str, dict[str, Any]] = {name: {} for name in paths}
    for mode in MODES:
        names = [n for n in paths if mode == "forward" or supports_backward(n, device)]
        cases = {
            n: _make_case(n, config.batch, config.tokens, config.dim, config.heads, device,
                          dtype, config.seed, config.compile_flex)
            for n in names
        }
        calls = {n: (c.forward if mode == "forward" else c.train) for n, c in cases.items()}
        log(f"timing {MODE_LABELS[mode]}: {len(names)} paths x {config.repeats} rounds")
        stats = round_robin(calls, repeats=config.repeats, warmup=config.warmup,
                            device=device, progress=log)
        del cases, calls
        for n in names:
            results[n][mode] = {"seconds": stats[n].to_dict()}
        for n in names:
            memory = _memory(config, n, mode, config.batch, config.tokens, device, dtype)
            if memory is not None:
                results[n][mode]["peak_bytes"] = memory["bytes"]
                results[n][mode]["memory_method"] = memory["method"]
        if config.memory != "off":
            where = ("the CUDA allocator's counters, in this process" if device.type == "cuda"
                     else "one fresh process per path" if config.memory == "isolated"
                     else "in this process")
            log(f"peak memory of {MODE_LABELS[mode]} measured ({where})")
    for name in paths:
        if not supports_backward(name, device):
            skipped.setdefault(f"{name} forward+backward",
                               "torch has no FlexAttention backward on the CPU")
    _add_ratios(results)

    report: dict[str, Any] = {
        "suite": "attention",
        "config": dataclasses.asdict(config),
        "machine": machine,
        "dtype": str(dtype).removeprefix("torch."),
        "agreement_max_abs_diff": agreement,
        "skipped": skipped,
        "results": results,
    }
    for mode in MODES:
        log(f"\n{MODE_LABELS[mode]}, batch {config.batch} x {config.tokens} tokens "
            f"(ms; speed-up = baseline time / path time):\n")
        log(table(results, mode, PATHS))
    for what, reason in skipped.items():
        log(f"skipped {what}: {reason}")

    if config.sweep:
        report["sweep"] = run_sweep(config, device, dtype, log)
    report["targets"] = targets(report)
    log("")
    for target in report["targets"]:
        log(target_line(target))

    write_json(out_dir / "attention.json", report)
    plot(report, out_dir / "attention.png")
    if config.sweep:
        where = f"{report['dtype']} on {machine.get('gpu', machine['device'])}"
        plot_sweep(report["sweep"], out_dir / "attention-sweep.png", where)
    log(f"\nwrote {out_dir / 'attention.json'} and {out_dir / 'attention.png'}"
        + (f" and {out_dir / 'attention-sweep.png'}" if config.sweep else ""))
    return report


def _add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """``speedup_vs_<baseline>``: the baseline's median time over the path's."""
    for mode in MODES:
        for base in BASELINES:
            base_time = results.get(base, {}).get(mode, {}).get("seconds", {}).get("median")
            if base_time is None:
                continue
            for entry in results.values():
                if mode in entry:
                    entry[mode][f"speedup_vs_{base}"] = (
                        base_time / entry[mode]["seconds"]["median"]
                    )


def table(results: dict[str, dict[str, Any]], mode: str, labels: dict[str, str]) -> str:
    """One mode's markdown table: median, min-max, speed-ups, peak memory."""
    header = ["path", "median ms", "min-max ms", "x book MHA", "x nn.MHA (no weights)",
              "peak MiB"]
    rows = []
    for name, entry in results.items():
        if mode not in entry:
            continue
        m = entry[mode]
        s = m["seconds"]
        rows.append([
            labels.get(name, name),
            format_ms(s["median"]),
            f"{format_ms(s['min'])}-{format_ms(s['max'])}",
            _ratio_text(m.get("speedup_vs_book-mha")),
            _ratio_text(m.get("speedup_vs_torch-mha")),
            format_mib(m.get("peak_bytes")),
        ])
    return markdown_table(header, rows)


def _ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


# ----------------------------------------------------------------------------
# Sequence-length sweep


def run_sweep(
    config: AttentionConfig, device: torch.device, dtype: torch.dtype,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Forward time and peak memory of ``config.sweep_paths`` at each sweep length."""
    sweep: dict[str, Any] = {"batch": config.sweep_batch, "tokens": list(config.sweep_tokens),
                             "paths": {name: [] for name in config.sweep_paths}}
    for tokens in config.sweep_tokens:
        cases = {
            n: _make_case(n, config.sweep_batch, tokens, config.dim, config.heads, device,
                          dtype, config.seed, config.compile_flex)
            for n in config.sweep_paths
        }
        stats = round_robin({n: c.forward for n, c in cases.items()},
                            repeats=config.sweep_repeats, warmup=config.warmup, device=device)
        del cases
        for n in config.sweep_paths:
            point: dict[str, Any] = {"tokens": tokens, "seconds": stats[n].to_dict()}
            memory = _memory(config, n, "forward", config.sweep_batch, tokens, device, dtype)
            if memory is not None:
                point["peak_bytes"] = memory["bytes"]
            sweep["paths"][n].append(point)
        log(f"sweep {tokens:>5} tokens: " + ", ".join(
            f"{n} {format_ms(stats[n].median)} ms"
            + (f" / {format_mib(sweep['paths'][n][-1].get('peak_bytes'))} MiB"
               if config.memory != "off" else "")
            for n in config.sweep_paths))
    log(f"\nforward sweep, batch {config.sweep_batch} (median ms, peak MiB):\n")
    header = ["tokens"] + [f"{n} ms" for n in config.sweep_paths] + (
        [f"{n} MiB" for n in config.sweep_paths] if config.memory != "off" else [])
    rows = []
    for i, tokens in enumerate(config.sweep_tokens):
        points = [sweep["paths"][n][i] for n in config.sweep_paths]
        row = [f"{tokens:,}"] + [format_ms(p["seconds"]["median"]) for p in points]
        if config.memory != "off":
            row += [format_mib(p.get("peak_bytes")) for p in points]
        rows.append(row)
    log(markdown_table(header, rows))
    return sweep


# ----------------------------------------------------------------------------
# Targets and plots


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The attention targets of docs/benchmarks.md, evaluated on this run's medians."""
    out: list[dict[str, Any]] = []
    res = report["results"]

    def add(name: str, value: float | None, threshold: float, text: str, higher: bool):
        if value is None:
            return
        met = value >= threshold if higher else value <= threshold
        out.append({"name": name, "value": value, "threshold": threshold, "met": bool(met),
                    "value_text": text})

    train = res.get("qkv", {}).get("train", {})
    speedup = train.get("speedup_vs_book-mha")
    if speedup is not None:
        add("qkv forward+backward >= 2x faster than book MHA", speedup, 2.0,
            f"{speedup:.2f}x", True)
    for mode in MODES:
        ratio = res.get("qkv", {}).get(mode, {}).get("speedup_vs_torch-mha")
        if ratio is not None:
            add(f"qkv {MODE_LABELS[mode]} not slower than nn.MultiheadAttention("
                "need_weights=False)", ratio, 1.0, f"{ratio:.2f}x", True)
    sweep = report.get("sweep")
    if sweep:
        last = {n: points[-1] for n, points in sweep["paths"].items()}
        fused, eager = last.get("qkv"), last.get("qkv-eager")
        if fused and eager and "peak_bytes" in fused and "peak_bytes" in eager:
            name = (f"forward at {fused['tokens']:,} tokens: peak memory <= 1/4 of the "
                    "eager path")
            if eager["peak_bytes"] > 0:
                frac = fused["peak_bytes"] / eager["peak_bytes"]
                add(name, frac, 0.25, f"{format_mib(fused['peak_bytes'])} MiB vs "
                    f"{format_mib(eager['peak_bytes'])} MiB = 1/{1 / max(frac, 1e-9):.0f}",
                    False)
            else:  # tiny shapes measured in-process can read 0
                out.append({"name": name, "value": None, "threshold": 0.25, "met": False,
                            "value_text": "not measurable: the eager path read 0 MiB"})
    return out


def plot(report: dict[str, Any], path: Path) -> Path:
    """Horizontal bars: median time per path, whiskers min-max, one panel per mode."""
    res = report["results"]
    cfg = report["config"]
    fig = new_figure(11, 0.42 * len(res) + 1.6)
    axes = fig.subplots(1, 2, sharey=True)
    names = list(res)
    for ax, mode in zip(axes, MODES, strict=True):
        ys, meds, lo, hi = [], [], [], []
        for i, n in enumerate(names):
            if mode in res[n]:
                s = res[n][mode]["seconds"]
                ys.append(i)
                meds.append(s["median"] * 1000)
                lo.append((s["median"] - s["min"]) * 1000)
                hi.append((s["max"] - s["median"]) * 1000)
        colors = ["tab:orange" if names[y].startswith("qkv") else "tab:blue" for y in ys]
        ax.barh(ys, meds, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_title(f"{MODE_LABELS[mode]}")
        ax.set_xlabel("milliseconds (median, whiskers min-max)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(names)), [PATHS.get(n, n) for n in names])
    axes[0].invert_yaxis()
    device = report["machine"].get("gpu", report["machine"]["device"])
    fig.suptitle(f"causal self-attention, batch {cfg['batch']} x {cfg['tokens']} tokens x "
                 f"{cfg['dim']} dims, {cfg['heads']} heads, {report['dtype']} on "
                 f"{device}", fontsize=10)
    return save_figure(fig, path)


def plot_sweep(sweep: dict[str, Any], path: Path, where: str | None = None) -> Path:
    """Forward time and peak memory against sequence length, log-log. ``where`` (e.g.
    ``"bfloat16 on NVIDIA H200"``) goes into the figure's title."""
    has_memory = any("peak_bytes" in p for pts in sweep["paths"].values() for p in pts)
    fig = new_figure(11 if has_memory else 6, 4.2)
    axes = fig.subplots(1, 2 if has_memory else 1, squeeze=False)[0]
    for name, points in sweep["paths"].items():
        tokens = [p["tokens"] for p in points]
        axes[0].plot(tokens, [p["seconds"]["median"] * 1000 for p in points], marker="o",
                     label=PATHS.get(name, name))
        if has_memory:
            axes[1].plot(tokens, [p.get("peak_bytes", 0) / 2**20 for p in points], marker="o",
                         label=PATHS.get(name, name))
    titles = ["forward time", "forward peak memory"]
    ylabels = ["milliseconds (median)", "MiB above the inputs"]
    for ax, title, ylabel in zip(axes, titles, ylabels, strict=False):
        ax.set_xscale("log", base=2)
        if all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")  # tiny shapes measured in-process can read 0 MiB
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, batch {sweep['batch']}" + (f"\n{where}" if where else ""),
                     fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return save_figure(fig, path)
