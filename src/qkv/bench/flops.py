"""``qkv bench flops``: attention kernels in TFLOP/s, against the card's own matmul rate.

A wall-clock time says little across machines; a rate of floating-point operations
compared with what the same device reaches on a plain matrix product says how close
a kernel comes to the hardware. This suite measures, in one interleaved run:

- the **matmul rate**: ``torch.mm`` of two ``n x n`` matrices (default ``n = 8192``) in
  the benchmark dtype, ``2 n^3`` operations per call; the ceiling attention is read
  against (on a GPU in bfloat16 this is the tensor-core rate the card really reaches,
  not its datasheet number);
- **attention** ``softmax(q k^T / sqrt(d)) v`` on ``q, k, v (batch, heads, T, d)``,
  causal and non-causal, forward and forward+backward, through each of these paths:

=================  ===========================================================
``qkv``            :func:`qkv.functional.attention` as ``qkv.MultiHeadAttention``
                   calls it by default (fused: SDPA with PyTorch's own choice of
                   backend, ``is_causal`` for causal self-attention)
``sdpa-flash``     SDPA restricted to one backend with
``sdpa-cudnn``     :func:`torch.nn.attention.sdpa_kernel`: FlashAttention-2, cuDNN's
``sdpa-efficient`` fused attention, the memory-efficient (xFormers) kernel, and
``sdpa-math``      the unfused reference that materialises the scores
``flex``           FlexAttention, compiled, with a causal block mask (or none)
``qkv-eager``      :func:`qkv.functional.attention` with ``need_weights=True``: the
                   ``T x T`` weights are built explicitly (the eager path)
=================  ===========================================================

A path that does not run on this device (a backend PyTorch refuses, FlexAttention
without a compiler, too little memory for the materialised scores) is reported as
skipped, with the reason. Before anything is timed, every path's output and input
gradients are compared with a float64 reference of the same inputs (one head, the
whole sequence), so that a wrong kernel cannot look fast.

FLOP convention (the one FlashAttention's papers use): the forward pass is two
``T x T x d`` matrix products per head, ``4 B H T^2 d`` operations, half of that when
causal (only the lower triangle is needed); the backward pass is five such products,
2.5 times the forward, so forward+backward counts 3.5 times the forward. Softmax,
scaling and masking are not counted. A kernel that skips the masked half of a causal
problem is thus credited with the work it had to do, not with what it avoided.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import attention
from ..utils.figures import new_figure, save_figure
from .attention import causal_mask_mod
from .timing import (
    Stats,
    error_line,
    format_ms,
    format_number,
    hbars,
    machine_info,
    markdown_table,
    resolve_device,
    resolve_dtype,
    round_robin,
    write_json,
)

__all__ = [
    "FlopsConfig",
    "PATHS",
    "attention_flops",
    "check_path",
    "kernel",
    "label",
    "reference_attention",
    "run_flops",
]

# name -> label for tables and plots, in table order.
PATHS: dict[str, str] = {
    "qkv": "qkv fused (default)",
    "sdpa-flash": "SDPA flash",
    "sdpa-cudnn": "SDPA cuDNN",
    "sdpa-efficient": "SDPA memory-efficient",
    "sdpa-math": "SDPA math",
    "flex": "FlexAttention",
    "qkv-eager": "qkv eager (need_weights)",
}
# SDPA backend of each restricted path (attribute names of torch.nn.attention.SDPBackend).
_SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
# Paths that hold (batch, heads, T, T) score matrices in memory.
_MATERIALISING = ("sdpa-math", "qkv-eager", "flex-reference")
MASKS = ("causal", "full")
MASK_LABELS = {"causal": "causal", "full": "non-causal"}
MODES = ("forward", "train")
MODE_LABELS = {"forward": "forward", "train": "forward+backward"}
# Relative error (Frobenius norm) allowed against the float64 reference. Half-precision
# kernels round q, k, v and every partial product to 8 (bf16) or 11 (fp16) bits; float32
# may use TF32 in FlexAttention's matrix products (about 3e-4).
_TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}

Kernel = Callable[[Tensor, Tensor, Tensor, bool], Tensor]


# ----------------------------------------------------------------------------
# Operation counts


def attention_flops(batch: int, heads: int, tokens: int, head_dim: int, *, causal: bool,
                    mode: str) -> float:
    """Floating-point operations credited to one call (see the module docstring).

    ``4 B H T^2 d`` for the forward pass (``q k^T`` and ``weights @ v``, two operations
    per multiply-add), halved when causal; ``mode="train"`` adds the backward's 2.5x.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    forward = 4.0 * batch * heads * tokens * tokens * head_dim * (0.5 if causal else 1.0)
    return forward if mode == "forward" else 3.5 * forward


def matmul_flops(n: int) -> float:
    """``2 n^3``: one multiply and one add per term of an ``n x n`` by ``n x n`` product."""
    return 2.0 * n**3


# ----------------------------------------------------------------------------
# The paths


def reference_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """Textbook attention in the inputs' dtype: ``softmax(q k^T / sqrt(d)) v``.

    ``q, k, v (..., T, d) -> (..., T, d)``. Causal hides key ``j > i`` from query ``i``.
    Called on float64 copies it is the reference every path is checked against.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., T, T)
    if causal:
        t = q.shape[-2]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _qkv_fused(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    # Exactly the call MultiHeadAttention.forward makes for self-attention without
    # padding, dropout or weights: SDPA with is_causal and PyTorch's backend choice.
    return attention(q, k, v, causal=causal)[0]


def _qkv_eager(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    # need_weights=True is what MultiHeadAttention(backend="eager") asks for.
    return attention(q, k, v, causal=causal, need_weights=True)[0]


def _sdpa(backend_name: str) -> Kernel:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        # The backward uses the kernel the forward chose, so only the forward needs it.
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask)


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    # A function of this module, not flex_attention itself, is compiled: torch.compile
    # keeps its compiled versions per code object, and the attention suite's compiled
    # flex_attention already holds several (its own shapes and dtypes); sharing them
    # could exhaust the recompile limit and silently fall back to the unfused kernel.
    return torch.compile(_flex_call, dynamic=False)


class _Flex:
    """FlexAttention with a causal block mask built once per length and device (as a
    model would), compiled or, with ``compile=False``, its unfused reference."""

    def __init__(self, compile: bool) -> None:
        self.compile = compile
        self._block_masks: dict[tuple[int, str], Any] = {}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        block_mask = self._block_mask(q.shape[-2], q.device) if causal else None
        if self.compile:
            return _compiled_flex()(q, k, v, block_mask)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": we know
            return _flex_call(q, k, v, block_mask)

    def _block_mask(self, tokens: int, device: torch.device) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        key = (tokens, str(device))
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(
                causal_mask_mod, None, None, tokens, tokens, device=device
            )
        return self._block_masks[key]


def kernel(name: str, *, compile_flex: bool = True) -> Kernel:
    """The attention function of path ``name``: ``(q, k, v, causal) -> output``, with
    ``q, k, v (batch, heads, T, d)`` and output ``(batch, heads, T, d)``."""
    if name == "qkv":
        return _qkv_fused
    if name == "qkv-eager":
        return _qkv_eager
    if name in _SDPA_BACKENDS:
        return _sdpa(_SDPA_BACKENDS[name])
    if name == "flex":
        return _Flex(compile_flex)
    raise ValueError(f"unknown path {name!r}; choose from {', '.join(PATHS)}")


# ----------------------------------------------------------------------------
# Configuration


@dataclass
class FlopsConfig:
    """What to measure. The defaults are the flops setting of docs/benchmarks.md: 8,192 tokens, head
    dimension 128, here 16 heads at batch 2 (``B H = 32`` heads of work: 2,048 query
    blocks of 128 rows, many per streaming multiprocessor, while the unfused paths'
    float32 scores, 8.6 GB per copy, still fit a large GPU).

    Attributes:
        batch, heads, tokens, head_dim: the shape of ``q``, ``k`` and ``v``.
        matmul_size: ``n`` of the ``n x n x n`` matrix product that sets the ceiling.
        repeats, warmup: timed and untimed calls per case (interleaved rounds).
        device, dtype: ``"auto"``: CUDA + bfloat16 when available, else CPU + float32.
        compile_flex: compile FlexAttention (without, it runs its unfused reference,
            which materialises the scores).
        paths: which paths to measure.
    """

    batch: int = 2
    heads: int = 16
    tokens: int = 8192
    head_dim: int = 128
    matmul_size: int = 8192
    repeats: int = 20
    warmup: int = 3
    device: str = "auto"
    dtype: str = "auto"
    compile_flex: bool = True
    seed: int = 0
    paths: tuple[str, ...] = tuple(PATHS)

    @classmethod
    def quick(cls, **overrides: Any) -> FlopsConfig:
        """Tiny shapes and the uncompiled FlexAttention: seconds on any CPU."""
        small = {"batch": 1, "heads": 2, "tokens": 128, "head_dim": 32, "matmul_size": 256,
                 "repeats": 3, "warmup": 1, "compile_flex": False}
        return cls(**{**small, **overrides})

    def validate(self) -> None:
        for name in ("batch", "heads", "tokens", "head_dim", "matmul_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.paths:
            raise ValueError("paths must name at least one attention path")
        unknown = [p for p in self.paths if p not in PATHS]
        if unknown:
            raise ValueError(f"unknown path(s) {unknown}; choose from {list(PATHS)}")

    def shape_text(self) -> str:
        return (f"batch {self.batch} x {self.heads} heads x {self.tokens:,} tokens, "
                f"head dim {self.head_dim}")


# ----------------------------------------------------------------------------
# Inputs, the reference and the check


@dataclass
class _Inputs:
    """``q, k, v`` and the output gradient ``grad`` ``(batch, heads, T, d)``; ``leaves``
    are copies of ``q, k, v`` that require grad, for the forward+backward cases (kept
    apart so that the forward cases build no autograd graph at all)."""

    q: Tensor
    k: Tensor
    v: Tensor
    grad: Tensor
    leaves: tuple[Tensor, Tensor, Tensor]

    @classmethod
    def random(cls, config: FlopsConfig, device: torch.device, dtype: torch.dtype) -> _Inputs:
        # Random normal data: zeros or constants would hide wrong indexing and can run
        # faster than real data. Generated on the device, from a seeded generator.
        g = torch.Generator(device=device).manual_seed(config.seed)
        shape = (config.batch, config.heads, config.tokens, config.head_dim)
        q, k, v, grad = (torch.randn(shape, generator=g, device=device, dtype=dtype)
                         for _ in range(4))
        leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
        return cls(q, k, v, grad, leaves)  # type: ignore[arg-type]

    def forward(self, fn: Kernel, causal: bool) -> Tensor:
        with torch.no_grad():
            return fn(self.q, self.k, self.v, causal)

    def train(self, fn: Kernel, causal: bool) -> tuple[Tensor, ...]:
        """``(output, dq, dk, dv)``; ``autograd.grad`` leaves no ``.grad`` to accumulate."""
        out = fn(*self.leaves, causal)
        return (out.detach(), *torch.autograd.grad(out, self.leaves, self.grad))


def _reference(inputs: _Inputs, causal: bool) -> tuple[Tensor, ...]:
    """float64 ``(output, dq, dk, dv)`` of head 0 of batch row 0, each ``(T, d)``.

    Heads are independent, so one head's output and gradients depend on that head's
    inputs alone; one head over the whole sequence checks every position and key
    block of the kernels while keeping the float64 scores small (``T x T``).
    """
    q, k, v = (t[0, 0].detach().double().requires_grad_() for t in inputs.leaves)
    out = reference_attention(q, k, v, causal)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), inputs.grad[0, 0].double()))


def _relative_error(got: Tensor, want: Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius), in float64; nan stays nan."""
    got = got.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device``: the CUDA driver's count, or MemAvailable on Linux."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo",
                                                        encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _score_bytes_needed(name: str, config: FlopsConfig, mode: str, compile_flex: bool) -> int:
    """A rough upper bound of what a path that materialises the scores needs: a few
    float32 ``(B, H, T, T)`` tensors (scores, weights, their gradients); 0 for the
    fused kernels, whose memory grows with ``T`` only."""
    key = "flex-reference" if name == "flex" and not compile_flex else name
    if key not in _MATERIALISING:
        return 0
    one = 4 * config.batch * config.heads * config.tokens**2
    return one * (4 if mode == "forward" else 8)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """SDPA warns about every backend it rejects; the reason is reported, not printed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _free(device: torch.device) -> None:
    """Return cached blocks after a failed or huge case, so the next one starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_path(
    name: str, fn: Kernel, inputs: _Inputs, causal: bool, reference: tuple[Tensor, ...],
    *, tol: float, modes: tuple[str, ...] = MODES,
) -> tuple[dict[str, float], dict[str, str]]:
    """Run path ``name`` once per mode and compare head 0 with the float64 reference.

    Returns ``({mode: relative error}, {mode: why it is skipped})``: a mode is skipped
    when it raises (backend unavailable, out of memory, no backward on this device) or
    disagrees with the reference by more than ``tol``; a failed forward skips both.
    The first call of each mode also serves as its first warm-up (compilation,
    kernel selection).
    """
    errors: dict[str, float] = {}
    skipped: dict[str, str] = {}
    device = inputs.q.device
    for mode in modes:
        if "forward" in skipped:
            skipped[mode] = skipped["forward"]
            continue
        try:
            with _quiet():
                got = ((inputs.forward(fn, causal),) if mode == "forward"
                       else inputs.train(fn, causal))
        except Exception as e:  # whatever a backend, the compiler or the allocator raises
            skipped[mode] = f"does not run here: {error_line(e)}"
            _free(device)
            continue
        error = max(_relative_error(g[0, 0], r) for g, r in zip(got, reference, strict=False))
        del got
        if not error <= tol:  # also catches nan
            skipped[mode] = (f"disagrees with the float64 reference: relative error "
                             f"{error:.3g} > {tol:.3g}")
        else:
            errors[mode] = error
    _free(device)
    return errors, skipped


def dispatched_ops(fn: Callable[[], object]) -> list[str]:
    """The private ATen attention operators one call of ``fn`` runs (``torch.profiler``):
    which kernel PyTorch's SDPA dispatcher picked, e.g. ``aten::_flash_attention_forward``."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Profiler clears events at the end of each cycle"
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    return sorted({e.key for e in prof.key_averages()
                   if e.key.startswith("aten::_") and "attention" in e.key})


# ----------------------------------------------------------------------------
# The suite


def run_flops(
    config: FlopsConfig, out_dir: str | Path, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure the matmul rate and every path's attention rate, print the tables, write
    ``flops.json`` and ``flops.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    machine = machine_info(device)  # recorded when the run starts
    tol = _TOLERANCE[dtype]
    log(f"flops: {config.shape_text()}, {dtype_name} on {device}"
        + (f" ({machine['gpu']})" if "gpu" in machine else "")
        + f"; matmul {config.matmul_size}^3")

    inputs = _Inputs.random(config, device, dtype)
    g = torch.Generator(device=device).manual_seed(config.seed + 1)
    n = config.matmul_size
    a, b = (torch.randn(n, n, generator=g, device=device, dtype=dtype) for _ in range(2))
    calls: dict[str, Callable[[], object]] = {"matmul": lambda: torch.mm(a, b)}

    available = _available_bytes(device)
    errors: dict[str, dict[str, dict[str, float]]] = {}
    skipped: dict[str, str] = {}
    for causal, mask in zip((True, False), MASKS, strict=True):
        reference = _reference(inputs, causal)
        for name in config.paths:
            fn = kernel(name, compile_flex=config.compile_flex)
            modes = []
            for mode in MODES:
                need = _score_bytes_needed(name, config, mode, config.compile_flex)
                if available is not None and need > 0.8 * available:
                    skipped[f"{name}/{mask}/{mode}"] = (
                        f"needs about {need / 2**30:,.0f} GiB for the scores, "
                        f"{available / 2**30:,.0f} GiB free")
                else:
                    modes.append(mode)
            errs, skips = check_path(name, fn, inputs, causal, reference, tol=tol,
                                     modes=tuple(modes))
            for mode, reason in skips.items():
                skipped[f"{name}/{mask}/{mode}"] = reason
            errors.setdefault(name, {})[mask] = errs
            for mode in errs:
                run = inputs.forward if mode == "forward" else inputs.train
                calls[f"{name}/{mask}/{mode}"] = functools.partial(run, fn, causal)
        del reference
    checked = [e for by_mask in errors.values() for by_mode in by_mask.values()
               for e in by_mode.values()]
    log(f"{len(calls) - 1} cases agree with the float64 reference (largest relative "
        f"error {max(checked, default=float('nan')):.2g}, tolerance {tol:g}); "
        f"{len(skipped)} skipped")
    dispatch = {mask: dispatched_ops(functools.partial(inputs.forward, _qkv_fused, causal))
                for causal, mask in zip((True, False), MASKS, strict=True)
                if f"qkv/{mask}/forward" in calls}

    log(f"timing {len(calls)} cases x {config.repeats} rounds")
    stats = round_robin(calls, repeats=config.repeats, warmup=config.warmup, device=device,
                        progress=log if config.repeats <= 5 else _every(5, config.repeats, log))

    mm = _rate(stats["matmul"], matmul_flops(n))
    report: dict[str, Any] = {
        "suite": "flops",
        "config": dataclasses.asdict(config),
        "machine": machine,
        "dtype": dtype_name,
        "flop_convention": ("forward = 4*B*H*T^2*d (halved when causal); backward = 2.5 x "
                            "forward; forward+backward = 3.5 x forward; softmax not counted"),
        "matmul": {"n": n, "flops": matmul_flops(n), **mm},
        "results": {},
        "relative_error": errors,
        "dispatch": dispatch,
        "skipped": skipped,
    }
    for name in config.paths:
        for mask in MASKS:
            for mode in MODES:
                key = f"{name}/{mask}/{mode}"
                if key not in stats:
                    continue
                flops = attention_flops(config.batch, config.heads, config.tokens,
                                        config.head_dim, causal=mask == "causal", mode=mode)
                entry = {"flops": flops, **_rate(stats[key], flops)}
                entry["fraction_of_matmul"] = entry["tflops"]["median"] / mm["tflops"]["median"]
                report["results"].setdefault(name, {}).setdefault(mask, {})[mode] = entry

    log("")
    log(f"{dtype_name} matmul {n}x{n}x{n}: {format_number(mm['tflops']['median'])} TFLOP/s "
        f"(median of {config.repeats}; min-max {format_number(mm['tflops']['min'])}-"
        f"{format_number(mm['tflops']['max'])}); {format_ms(mm['seconds']['median'])} ms")
    for mask in MASKS:
        for mode in MODES:
            log(f"\n{MASK_LABELS[mask]} {MODE_LABELS[mode]}, {config.shape_text()}:\n")
            log(table(report, mask, mode))
    log(f"\nsummary: TFLOP/s (median) and % of the {dtype_name} matmul rate:\n")
    log(summary_table(report))
    for mask, ops in dispatch.items():
        log(f"qkv's default {MASK_LABELS[mask]} forward runs: {', '.join(ops) or '?'}")
    # One line per path and reason, not per case: a missing backend skips all four.
    grouped: dict[tuple[str, str], list[str]] = {}
    for what, reason in skipped.items():
        name, mask, mode = what.split("/")
        grouped.setdefault((name, reason), []).append(
            f"{MASK_LABELS[mask]} {MODE_LABELS[mode]}")
    for (name, reason), cases in grouped.items():
        what = "all cases" if len(cases) == len(MASKS) * len(MODES) else ", ".join(cases)
        log(f"skipped {name} ({what}): {reason}")

    write_json(out_dir / "flops.json", report)
    plot(report, out_dir / "flops.png")
    log(f"\nwrote {out_dir / 'flops.json'} and {out_dir / 'flops.png'}")
    return report


def _every(k: int, total: int, log: Callable[[str], None]) -> Callable[[str], None]:
    """A progress callback that passes on every ``k``-th round's line and the last."""
    count = 0

    def progress(line: str) -> None:
        nonlocal count
        count += 1
        if count % k == 0 or count == total:
            log(line)

    return progress


def _rate(seconds: Stats, flops: float) -> dict[str, Any]:
    """The time samples and the same samples as TFLOP/s."""
    tflops = Stats(tuple(flops / s / 1e12 for s in seconds.samples))
    return {"seconds": seconds.to_dict(), "tflops": tflops.to_dict()}


def label(name: str, compile_flex: bool = True) -> str:
    """The row label of path ``name``; says so when FlexAttention ran uncompiled."""
    text = PATHS.get(name, name)
    return text if name != "flex" or compile_flex else f"{text} (not compiled)"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f} %" if fraction >= 0.1 else f"{100 * fraction:.1f} %"


def table(report: dict[str, Any], mask: str, mode: str) -> str:
    """One mask and mode: time, rate and share of the matmul rate for every path."""
    header = ["path", "median ms", "min-max ms", "TFLOP/s", "min-max TFLOP/s", "of matmul"]
    rows = []
    for name, entry in report["results"].items():
        m = entry.get(mask, {}).get(mode)
        if m is None:
            continue
        s, r = m["seconds"], m["tflops"]
        rows.append([label(name, report["config"]["compile_flex"]), format_ms(s["median"]),
                     f"{format_ms(s['min'])}-{format_ms(s['max'])}",
                     format_number(r["median"]),
                     f"{format_number(r['min'])}-{format_number(r['max'])}",
                     _percent(m["fraction_of_matmul"])])
    return markdown_table(header, rows)


def summary_table(report: dict[str, Any]) -> str:
    """Every path in one table: median TFLOP/s (share of the matmul rate) per column."""
    columns = [(mask, mode) for mask in MASKS for mode in MODES]
    header = ["path"] + [f"{MASK_LABELS[mask]} {MODE_LABELS[mode]}" for mask, mode in columns]
    rows = []
    for name, entry in report["results"].items():
        cells = []
        for mask, mode in columns:
            m = entry.get(mask, {}).get(mode)
            cells.append("-" if m is None else
                         f"{format_number(m['tflops']['median'])} "
                         f"({_percent(m['fraction_of_matmul'])})")
        rows.append([label(name, report["config"]["compile_flex"]), *cells])
    return markdown_table(header, rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """One panel per mask and mode: TFLOP/s per path (median, whiskers min-max), and
    the matmul rate as a dashed line."""
    results = report["results"]
    cfg = report["config"]
    mm = report["matmul"]["tflops"]["median"]
    rows = max(1, len(results))
    fig = new_figure(13, 2 * (0.38 * rows + 1.0) + 0.6)
    axes = fig.subplots(2, 2)
    for i, mask in enumerate(MASKS):
        for j, mode in enumerate(MODES):
            ax = axes[i][j]
            names = [n for n in results if mode in results[n].get(mask, {})]
            ax.set_title(f"{MASK_LABELS[mask]}, {MODE_LABELS[mode]}", fontsize=10)
            if not names:
                ax.set_axis_off()
                continue
            hbars(ax, [label(n, cfg["compile_flex"]) for n in names],
                  [results[n][mask][mode]["tflops"] for n in names],
                  colors=["tab:orange" if n.startswith("qkv") else "tab:blue"
                          for n in names],
                  xlabel="TFLOP/s (median, whiskers min-max)")
            ax.axvline(mm, color="black", linestyle="--", linewidth=1,
                       label=f"{report['dtype']} matmul: {format_number(mm)} TFLOP/s")
            ax.legend(loc="lower right", fontsize=8)
            ax.set_xlim(0, max(mm, *(results[n][mask][mode]["tflops"]["max"]
                                     for n in names)) * 1.2)
    device = report["machine"].get("gpu", report["machine"]["device"])
    fig.suptitle(f"attention rate, {cfg['batch']} x {cfg['heads']} heads x "
                 f"{cfg['tokens']:,} tokens, head dim {cfg['head_dim']}, "
                 f"{report['dtype']} on {device}", fontsize=11)
    return save_figure(fig, path)
