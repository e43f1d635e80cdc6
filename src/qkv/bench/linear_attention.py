"""The gated delta rule (linear attention), chunked and recurrent, against its peers.

Every case computes the same function on the same inputs: the gated delta rule of
:mod:`qkv.linear_attention` over L2-normalised queries and keys, at batch 1 with
Qwen3.5's head shapes (transformers' ``Qwen3_5TextConfig`` defaults: 16 query/key heads,
32 value heads, both of size 128), in float32 on the CPU, without gradients:

=================  ===============================================================
``qkv-chunked``    ``qkv.linear_attention.gated_delta_rule(backend="chunked")``
``qkv-recurrent``  the same with ``backend="recurrent"``: one token at a time
``hf-chunked``     transformers' PyTorch fallback ``torch_chunk_gated_delta_rule``
                   (Qwen3-Next's and Qwen3.5's, used where flash-linear-attention's
                   kernels are not installed)
``hf-recurrent``   transformers' ``torch_recurrent_gated_delta_rule``
``fla-chunked``    flash-linear-attention's pure-PyTorch reference
                   ``naive_chunk_gated_delta_rule``, where ``fla`` imports
``fla-recurrent``  its ``naive_recurrent_gated_delta_rule``
=================  ===============================================================

The inputs are laid out as the models make them, ``(batch, T, heads, dim)``; qkv takes
transposed views of them (no copy). fla's reference has no grouped value heads, so its
queries and keys are repeated to the 32 value heads before the clock starts.

Before anything is timed, every case runs on a short input and must agree with
``qkv-chunked``. Times are medians over interleaved repeats (:func:`round_robin`). Peak
memory is measured in a fresh interpreter per case (:func:`run_isolated`): the inputs
exist before the measured call, so the number is what the call adds, its output
included. Long prompts (``long_tokens``, default 32,768) run the chunked forms once each,
to show that the memory beyond the output stays bounded.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..linear_attention import gated_delta_rule, l2_normalize
from ..utils.figures import new_figure, save_figure
from .timing import (
    MEMORY_MODES,
    cpu_peak_bytes,
    error_line,
    format_mib,
    format_ms,
    machine_info,
    markdown_table,
    round_robin,
    run_isolated,
    target_line,
    write_json,
)

__all__ = ["CASES", "LinearBenchConfig", "check_agreement", "measure_case", "run_linear"]

CASES: dict[str, str] = {
    "qkv-chunked": "qkv chunked",
    "qkv-recurrent": "qkv recurrent",
    "hf-chunked": "transformers torch_chunk_gated_delta_rule",
    "hf-recurrent": "transformers torch_recurrent_gated_delta_rule",
    "fla-chunked": "fla naive_chunk_gated_delta_rule",
    "fla-recurrent": "fla naive_recurrent_gated_delta_rule",
}
LONG_CASES = ("qkv-chunked", "hf-chunked")
# Shape of the input on which every case must agree with qkv-chunked before it is timed:
# more than two chunks, the last one short.
_CHECK_TOKENS = 150


@dataclass
class LinearBenchConfig:
    """Qwen3.5's linear-attention heads at 512, 2,048 and 8,192 tokens; 32,768 once."""

    tokens: tuple[int, ...] = (512, 2048, 8192)
    long_tokens: tuple[int, ...] = (32768,)
    key_heads: int = 16
    value_heads: int = 32
    head_dim: int = 128
    chunk_size: int = 64
    repeats: int = 5
    warmup: int = 1
    memory: str = "isolated"
    cases: tuple[str, ...] = field(default_factory=lambda: tuple(CASES))
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> LinearBenchConfig:
        return cls(**{"tokens": (256,), "long_tokens": (), "key_heads": 2, "value_heads": 4,
                      "head_dim": 32, "repeats": 2, **overrides})

    def validate(self) -> None:
        for name in ("key_heads", "value_heads", "head_dim", "chunk_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.value_heads % self.key_heads:
            raise ValueError(f"value_heads ({self.value_heads}) must be a multiple of "
                             f"key_heads ({self.key_heads})")
        if not self.tokens or any(t < 1 for t in (*self.tokens, *self.long_tokens)):
            raise ValueError(f"tokens must be positive lengths, got {self.tokens} and "
                             f"{self.long_tokens}")
        unknown = [c for c in self.cases if c not in CASES]
        if unknown or "qkv-chunked" not in self.cases:
            raise ValueError(f"cases must include 'qkv-chunked' and come from "
                             f"{', '.join(CASES)}; got {', '.join(self.cases)}")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")


def make_inputs(tokens: int, key_heads: int, value_heads: int, head_dim: int, seed: int = 0
                ) -> dict[str, Tensor]:
    """``q, k (1, T, key_heads, head_dim)`` L2-normalised, ``v (1, T, value_heads,
    head_dim)``, ``g, beta (1, T, value_heads)``: float32, in the models' layout, with
    decays and write strengths in the ranges Qwen's gates produce."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(1, tokens, key_heads, head_dim, generator=gen))
    k = l2_normalize(torch.randn(1, tokens, key_heads, head_dim, generator=gen))
    v = torch.randn(1, tokens, value_heads, head_dim, generator=gen)
    g = -torch.rand(1, tokens, value_heads, generator=gen) * 2.0
    beta = torch.rand(1, tokens, value_heads, generator=gen)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def _fla_naive() -> Any:
    # fla's package imports Triton at its root; the reference needs only torch and einops.
    return importlib.import_module("fla.ops.gated_delta_rule.naive")


def _hf_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """transformers' two PyTorch functions, unwrapped from the decorator that would swap in
    flash-linear-attention's Triton kernels where that package imports."""
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    return (inspect.unwrap(module.torch_chunk_gated_delta_rule),
            inspect.unwrap(module.torch_recurrent_gated_delta_rule))


def make_case(name: str, inputs: dict[str, Tensor], chunk_size: int) -> Callable[[], Tensor]:
    """A no-argument call of case ``name`` on ``inputs`` returning the output ``(1, T,
    value_heads, head_dim)``. Raises ImportError when the case's package is missing."""
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    if name.startswith("qkv-"):
        backend = name.removeprefix("qkv-")
        heads = [t.transpose(1, 2) for t in (q, k, v, g, beta)]  # views

        def qkv_call() -> Tensor:
            out, _ = gated_delta_rule(*heads, chunk_size=chunk_size, backend=backend)
            return out.transpose(1, 2)
        return qkv_call
    if name.startswith("hf-"):
        chunk, recurrent = _hf_functions()
        if name == "hf-chunked":
            return lambda: chunk(q, k, v, g=g, beta=beta, chunk_size=chunk_size)[0]
        return lambda: recurrent(q, k, v, g=g, beta=beta)[0]
    naive = _fla_naive()
    group = v.shape[2] // q.shape[2]
    q_all, k_all = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    if name == "fla-chunked":
        return lambda: naive.naive_chunk_gated_delta_rule(q_all, k_all, v, g, beta,
                                                          chunk_size=chunk_size)[0]
    return lambda: naive.naive_recurrent_gated_delta_rule(q_all, k_all, v, beta, g)[0]


def available_cases(names: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The cases whose packages import, and ``{name: why not}`` for the others."""
    inputs = make_inputs(2, 1, 1, 4)
    ok, skipped = [], {}
    for name in names:
        try:
            make_case(name, inputs, 64)
        except ImportError as e:
            skipped[name] = error_line(e)
        else:
            ok.append(name)
    return tuple(ok), skipped


def check_agreement(config: LinearBenchConfig, names: tuple[str, ...], tol: float = 1e-4
                    ) -> dict[str, float]:
    """Every case on a short input must match ``qkv-chunked`` to ``tol`` (relative to the
    output's scale). Returns ``{case: largest absolute difference}``."""
    inputs = make_inputs(_CHECK_TOKENS, config.key_heads, config.value_heads, config.head_dim,
                         config.seed)
    with torch.no_grad():
        reference = make_case("qkv-chunked", inputs, config.chunk_size)()
        scale = max(reference.abs().max().item(), 1e-6)
        diffs = {}
        for name in names:
            diff = (make_case(name, inputs, config.chunk_size)() - reference).abs().max().item()
            if not diff <= tol * scale:  # also catches nan
                raise RuntimeError(f"case {name!r} disagrees with qkv-chunked by {diff:.3g} "
                                   f"(tolerance {tol * scale:.3g}); its timing would be "
                                   "meaningless")
            diffs[name] = diff
    return diffs


def measure_case(name: str, tokens: int, key_heads: int, value_heads: int, head_dim: int,
                 chunk_size: int, seed: int = 0) -> dict[str, Any]:
    """Peak extra memory and seconds of one call of case ``name`` (inputs made first, so
    not counted; the output is). Module-level and JSON in, JSON out, for
    :func:`~qkv.bench.timing.run_isolated`.

    One call on a short input comes first, so that one-time work (thread pools, the
    libraries' own buffers) is not counted; a long prompt is not run twice."""
    import time

    warm = make_inputs(min(tokens, 256), key_heads, value_heads, head_dim, seed)
    with torch.no_grad():
        make_case(name, warm, chunk_size)()
    del warm
    inputs = make_inputs(tokens, key_heads, value_heads, head_dim, seed)
    call = make_case(name, inputs, chunk_size)
    seconds = 0.0

    def run() -> None:
        nonlocal seconds
        start = time.perf_counter()
        with torch.no_grad():
            out = call()
        seconds = time.perf_counter() - start
        del out

    nbytes, method = cpu_peak_bytes(run)
    output = tokens * value_heads * head_dim * 4
    return {"bytes": nbytes, "method": method, "seconds": seconds, "output_bytes": output}


def _measure(config: LinearBenchConfig, name: str, tokens: int) -> dict[str, Any]:
    kwargs = {"name": name, "tokens": tokens, "key_heads": config.key_heads,
              "value_heads": config.value_heads, "head_dim": config.head_dim,
              "chunk_size": config.chunk_size, "seed": config.seed}
    if config.memory == "isolated":
        return run_isolated(measure_case, **kwargs)
    return measure_case(**kwargs)


def run_linear(config: LinearBenchConfig, out_dir: str | Path,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time every case at every length, measure its peak memory, print the tables and
    write ``linear_attention.json`` and ``linear_attention.png`` in ``out_dir``."""
    config.validate()
    out_dir = Path(out_dir)
    device = torch.device("cpu")
    machine = machine_info(device)
    names, skipped = available_cases(config.cases)
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    diffs = check_agreement(config, names)
    log("agreement with qkv-chunked (max abs diff): " + ", ".join(
        f"{n} {d:.2g}" for n, d in diffs.items()))
    results: dict[str, dict[str, Any]] = {}
    for tokens in config.tokens:
        inputs = make_inputs(tokens, config.key_heads, config.value_heads, config.head_dim,
                             config.seed)
        calls = {name: make_case(name, inputs, config.chunk_size) for name in names}
        log(f"{tokens:,} tokens: timing {len(calls)} cases, {config.repeats} repeats")
        with torch.no_grad():
            stats = round_robin(calls, repeats=config.repeats, warmup=config.warmup,
                                device=device)
        row: dict[str, Any] = {}
        for name in names:
            row[name] = {"seconds": stats[name].to_dict()}
            if config.memory != "off":
                row[name]["memory"] = _measure(config, name, tokens)
        results[str(tokens)] = row
        log(", ".join(f"{n} {format_ms(stats[n].median)} ms" for n in names))
    long_results: dict[str, dict[str, Any]] = {}
    for tokens in config.long_tokens:
        long_results[str(tokens)] = {}
        for name in (n for n in LONG_CASES if n in names):
            run = _measure(config, name, tokens)
            long_results[str(tokens)][name] = run
            log(f"{tokens:,} tokens, {name}: {run['seconds']:.3g} s, peak "
                f"{format_mib(run['bytes'])} MiB (output {format_mib(run['output_bytes'])} MiB)")
    report: dict[str, Any] = {
        "suite": "linear_attention",
        "config": dataclasses.asdict(config),
        "machine": machine,
        "skipped": skipped,
        "agreement": diffs,
        "results": results,
        "long": long_results,
        "targets": _targets(config, names, results, long_results),
    }
    log("\n" + table(report))
    if long_results:
        log("\n" + long_table(report))
    log("")
    for target in report["targets"]:
        log(target_line(target))
    write_json(out_dir / "linear_attention.json", report)
    plot(report, out_dir / "linear_attention.png")
    log(f"\nwrote {out_dir / 'linear_attention.json'} and {out_dir / 'linear_attention.png'}")
    return report


def _targets(config: LinearBenchConfig, names: tuple[str, ...], results: dict[str, Any],
             long_results: dict[str, Any]) -> list[dict[str, Any]]:
    targets = []
    if "hf-chunked" in names:
        ratios = {t: r["qkv-chunked"]["seconds"]["median"] / r["hf-chunked"]["seconds"]["median"]
                  for t, r in results.items()}
        worst = max(ratios.values())
        targets.append({
            "name": "qkv chunked at least as fast as transformers' chunked fallback",
            "value": worst, "threshold": 1.0, "met": worst <= 1.0,
            "value_text": ", ".join(f"{int(t):,} tokens {r:.2f}x the time"
                                    for t, r in ratios.items())})
        if config.memory != "off":
            mem = {t: r["qkv-chunked"]["memory"]["bytes"] / max(r["hf-chunked"]["memory"]["bytes"],
                                                               1)
                   for t, r in results.items()}
            worst = max(mem.values())
            targets.append({
                "name": "qkv chunked uses no more memory than transformers' chunked fallback",
                "value": worst, "threshold": 1.0, "met": worst <= 1.0,
                "value_text": ", ".join(f"{int(t):,} tokens {r:.2f}x the memory"
                                        for t, r in mem.items())})
    if long_results and config.memory != "off":
        # Bounded: beyond its output, the call holds about one chunk's temporaries at any
        # length, so that part must not grow from the shortest length to the longest.
        first = results[str(config.tokens[0])]["qkv-chunked"]["memory"]
        extra_first = max(first["bytes"] - first["output_bytes"], 0)
        for tokens, runs in long_results.items():
            run = runs["qkv-chunked"]
            extra = run["bytes"] - run["output_bytes"]
            limit = extra_first + 64 * 2**20
            targets.append({
                "name": f"qkv chunked at {int(tokens):,} tokens holds at most its output + "
                        f"what it held at {config.tokens[0]:,} tokens + 64 MiB",
                "value": extra, "threshold": limit, "met": extra <= limit,
                "value_text": f"peak {format_mib(run['bytes'])} MiB = output "
                              f"{format_mib(run['output_bytes'])} MiB + "
                              f"{format_mib(extra)} MiB (at {config.tokens[0]:,} tokens: "
                              f"+ {format_mib(extra_first)} MiB)"})
    return targets


def table(report: dict[str, Any]) -> str:
    """Median ms (and the ratio to qkv-chunked) and peak MiB per case and length."""
    results = report["results"]
    lengths = list(results)
    names = list(results[lengths[0]])
    header = ["case"] + [f"{int(t):,} tok ms" for t in lengths]
    with_memory = "memory" in results[lengths[0]][names[0]]
    if with_memory:
        header += [f"{int(t):,} tok MiB" for t in lengths]
    rows = []
    for name in names:
        row = [CASES[name]]
        for t in lengths:
            median = results[t][name]["seconds"]["median"]
            ratio = median / results[t]["qkv-chunked"]["seconds"]["median"]
            row.append(f"{format_ms(median)} ({ratio:.2g}x)")
        if with_memory:
            row += [format_mib(results[t][name]["memory"]["bytes"]) for t in lengths]
        rows.append(row)
    return markdown_table(header, rows)


def long_table(report: dict[str, Any]) -> str:
    rows = []
    for tokens, runs in report["long"].items():
        for name, run in runs.items():
            rows.append([f"{CASES[name]}, {int(tokens):,} tokens", f"{run['seconds']:.3g}",
                         format_mib(run["bytes"]), format_mib(run["output_bytes"])])
    return markdown_table(["case", "seconds (one run)", "peak MiB", "output MiB"], rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Time and (where measured) peak memory against the prompt length, log-log."""
    results = report["results"]
    lengths = [int(t) for t in results]
    names = list(results[str(lengths[0])])
    with_memory = "memory" in results[str(lengths[0])][names[0]]
    fig = new_figure(12 if with_memory else 6, 3.2)
    axes = fig.subplots(1, 2 if with_memory else 1, squeeze=False)[0]
    for name in names:
        axes[0].plot(lengths, [results[str(t)][name]["seconds"]["median"] * 1000
                               for t in lengths], marker="o", label=CASES[name])
        if with_memory:
            axes[1].plot(lengths, [results[str(t)][name]["memory"]["bytes"] / 2**20
                                   for t in lengths], marker="o", label=CASES[name])
    for ax, label in zip(axes, ("median ms", "peak MiB"), strict=False):
        ax.set_xscale("log", base=2)
        if all(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
            ax.set_yscale("log")  # (tiny sizes measured in-process can read 0 MiB)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    cfg = report["config"]
    fig.suptitle(f"gated delta rule, {cfg['key_heads']} key / {cfg['value_heads']} value "
                 f"heads of {cfg['head_dim']}, float32, CPU", fontsize=10)
    return save_figure(fig, path)

