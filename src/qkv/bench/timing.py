"""The measuring tools every ``qkv bench`` suite shares: clocks, repeats, peak memory, output.

Time
----
:func:`round_robin` warms every case up, then runs ``repeats`` rounds in which each case
runs once, the starting case rotating from round to round. On a machine whose load
changes (other people's tests, a laptop throttling) a slow minute then hits every case
about equally, instead of ruining whichever case happened to be timed in one block
during it. Each case gets a :class:`Stats`: median, min and max over its samples. On the
CPU a sample is ``time.perf_counter`` around the call; on CUDA it is a pair of CUDA
events around it, read after a synchronise, so asynchronous kernel launches are counted
in full.

Peak memory
-----------
CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak, minus what was
allocated before the call. Exact: the caching allocator counts every tensor byte.

CPU: there is no allocator counter, so we ask the kernel. Linux keeps a high-water mark
of each process's resident memory (``VmHWM``) and resets it when ``5`` is written to
``/proc/self/clear_refs``. :func:`cpu_peak_bytes` resets the mark, notes the resident
size, runs the call and reports ``VmHWM - VmRSS(before)``: the most memory the call held
at once, whatever allocated it (tensors, Python objects, library scratch space). Two
things can hide memory from that number, and :func:`run_isolated` removes both by running
each measured case in a fresh interpreter:

- memory that an earlier case freed but the C allocator kept is reused without raising
  the resident size; a fresh process has none;
- glibc moves its threshold for serving large blocks from ``mmap`` up to 32 MiB after the
  first such block is freed, after which freed blocks stay in the heap. The child is
  started with ``MALLOC_MMAP_THRESHOLD_`` fixed (which also switches that adaptation off)
  and ``MALLOC_TRIM_THRESHOLD_`` low, so freed tensors go back to the kernel at once.

Where ``clear_refs`` is not available (not Linux, or a locked-down container) the peak
falls back to ``ru_maxrss`` minus the resident size before the call, which is only right
in a fresh process; results carry the method used.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..options import BENCH_DTYPES as DTYPE_NAMES
from ..options import MEMORY_MODES
from ..utils.fileio import write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "DTYPE_NAMES",
    "error_line",
    "MEMORY_MODES",
    "Stats",
    "cpu_peak_bytes",
    "cuda_peak_bytes",
    "format_mib",
    "format_ms",
    "format_number",
    "hbars",
    "machine_info",
    "markdown_table",
    "peak_bytes",
    "resolve_device",
    "resolve_dtype",
    "round_robin",
    "run_isolated",
    "synchronize",
    "target_line",
    "time_call",
    "write_json",
]

_MIB = 2**20
# Printed by a child of run_isolated before its JSON result, so that anything else the
# child prints (warnings, library banners) cannot be mistaken for the result.
_RESULT_MARK = "QKV-BENCH-RESULT "
# This module's importable name, also when it runs as a run_isolated child (__main__).
_THIS_MODULE = __spec__.name if __spec__ is not None else __name__


# ----------------------------------------------------------------------------
# Devices and dtypes


def resolve_device(name: str) -> torch.device:
    """``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    from ..training import resolve_device as resolve

    return resolve(name)


_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if name != "auto"}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is bfloat16 on CUDA (what GPUs train in) and float32 on the CPU.

    CPU matrix kernels for bfloat16 are only fast on processors with AMX or AVX512-BF16,
    so float32 is the fair default there.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_NAMES)}")
    return _DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------
# Time


@dataclass(frozen=True)
class Stats:
    """Samples of one measured quantity (seconds, or anything else), with a summary."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Stats needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "samples": list(self.samples),
        }


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes, including all the device work it queued."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        synchronize(device)  # nothing queued earlier may be billed to this call
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def round_robin(
    cases: Mapping[str, Callable[[], object]],
    *,
    repeats: int | Mapping[str, int],
    warmup: int,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Stats]:
    """Time every case ``repeats`` times, interleaved, after ``warmup`` untimed calls each.

    Round ``r`` runs the cases starting from the ``r``-th (mod the number of cases), so
    no case is always first after a pause or always right behind the same neighbour.
    ``repeats`` may give each case its own count (``{name: n}``, every case named): a
    case then sits out the rounds after its last, so slow cases can be timed less often
    than quick ones while both are interleaved.

    Returns ``{name: Stats of seconds}`` in the order of ``cases``.
    """
    names = list(cases)
    counts = dict.fromkeys(names, repeats) if isinstance(repeats, int) else dict(repeats)
    if set(counts) != set(names):
        raise ValueError(f"repeats must name every case: {sorted(names)}, got {sorted(counts)}")
    for name, n in counts.items():
        if n < 1:
            raise ValueError(f"repeats must be >= 1, got {n} for {name!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for name in names:
        for _ in range(warmup):
            cases[name]()
        # The first timed call must not inherit a warm-up's queued work or garbage.
        synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds = max(counts.values())
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if r < counts[name]:
                samples[name].append(time_call(cases[name], device))
        if progress is not None:
            progress(f"round {r + 1}/{rounds} done")
    return {name: Stats(tuple(samples[name])) for name in names}


# ----------------------------------------------------------------------------
# Peak memory


def _proc_status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (Linux), or None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident-memory high-water mark; False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    # No /proc: ru_maxrss is the only number there is (bytes on macOS, KiB elsewhere).
    return _max_rss_bytes()


def _max_rss_bytes() -> int:
    import resource  # Unix only; imported here so that the module loads everywhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cpu_peak_bytes(fn: Callable[[], object]) -> tuple[int, str]:
    """Most resident memory ``fn`` adds at once, in this process: ``(bytes, method)``.

    ``method`` is ``"vmhwm"`` (kernel high-water mark, reset just before the call) or
    ``"ru_maxrss"`` (process-lifetime peak; only meaningful in a fresh process).
    Garbage from earlier code is collected first so that it is not freed mid-call.
    """
    gc.collect()
    method = "vmhwm" if _reset_peak_rss() else "ru_maxrss"
    before = _rss_bytes()
    fn()
    peak_kib = _proc_status_kib("VmHWM") if method == "vmhwm" else None
    peak = peak_kib * 1024 if peak_kib is not None else _max_rss_bytes()
    return max(0, peak - before), method


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Most CUDA memory ``fn`` allocates at once beyond what was allocated before it."""
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def peak_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int, str]:
    """Peak extra memory of one call of ``fn`` on ``device``: ``(bytes, method)``."""
    if device.type == "cuda":
        return cuda_peak_bytes(fn, device), "cuda_max_memory_allocated"
    return cpu_peak_bytes(fn)


def run_isolated(
    func: Callable[..., Any], /, *, threads: int | None = None, timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """``func(**kwargs)`` in a fresh Python interpreter; returns its (JSON-able) result.

    ``func`` must be a module-level function (the child imports it by name) and
    ``kwargs`` JSON-able. The child uses ``threads`` torch threads (default: this
    process's count, so that both sides run the same kernels) and glibc settings that
    return freed memory to the kernel at once (see the module docstring).

    Raises:
        RuntimeError: the child failed; the message ends with its last stderr lines.
    """
    if func.__module__ == "__main__" or "<locals>" in func.__qualname__:
        raise ValueError(f"run_isolated needs a module-level function of an importable "
                         f"module, got {func.__module__}.{func.__qualname__}")
    spec = {
        "module": func.__module__,
        "name": func.__qualname__,
        "kwargs": kwargs,
        "threads": torch.get_num_threads() if threads is None else threads,
    }
    env = {
        **os.environ,
        # Fixed thresholds: allocations of 128 KiB and more are mmap-ed and unmapped when
        # freed, so the resident size follows the live tensors (see the module docstring).
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "MALLOC_TRIM_THRESHOLD_": "131072",
        # The child imports what this process can import, installed or not.
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    proc = subprocess.run(
        [sys.executable, "-m", _THIS_MODULE, json.dumps(spec)],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if proc.returncode == 0 and line.startswith(_RESULT_MARK):
            return json.loads(line[len(_RESULT_MARK):])
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:]) or "no output"
    raise RuntimeError(
        f"isolated run of {spec['module']}.{spec['name']} failed "
        f"(exit {proc.returncode}): {tail}"
    )


def _child_main(argv: Sequence[str]) -> int:
    """Entry point of a :func:`run_isolated` child: ``python -m qkv.bench.timing SPEC``."""
    spec = json.loads(argv[0])
    torch.set_num_threads(int(spec["threads"]))
    target: Any = importlib.import_module(spec["module"])
    for part in spec["name"].split("."):
        target = getattr(target, part)
    result = target(**spec["kwargs"])
    print(_RESULT_MARK + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------
# Reporting


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on, for the JSON and the docs."""
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_multiprocessors"] = props.multi_processor_count
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
        info["driver"] = _nvidia_driver()
    return info


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version as ``nvidia-smi`` reports it; None where it cannot run."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.split()
        return out[0] if out else None
    return None


def _cpu_model() -> str:
    """``lscpu``'s model name, read from where lscpu reads it."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                            errors="replace") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with three significant digits (``1234.5`` ms stays whole)."""
    ms = seconds * 1000.0
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def format_mib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / _MIB:,.1f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-markdown table with padded columns: readable in a terminal, pastable in docs.

    The first column is left-aligned, the others (numbers) right-aligned.
    """
    rows = [list(map(str, row)) for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        "-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([line(list(map(str, header))), rule, *(line(r) for r in rows)])


def target_line(target: Mapping[str, Any]) -> str:
    """A suite's report line for one of its targets: ``target MET    NAME: VALUE`` (or
    ``MISSED``), from a ``{"name", "met", "value_text", ...}`` entry of its report."""
    return (f"target {'MET   ' if target['met'] else 'MISSED'} {target['name']}: "
            f"{target['value_text']}")


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON, atomically (a reader never sees half a file)."""
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    return write_atomic(path, text.encode("utf-8"))


def format_number(x: float) -> str:
    """Three significant digits, thousands separated, never scientific notation."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def hbars(
    ax: Axes, labels: Sequence[str], summaries: Sequence[Mapping[str, float]], *,
    colors: Sequence[str], xlabel: str, log: bool = False, scale: float = 1.0,
) -> None:
    """Horizontal bars at each summary's median, whiskers from min to max, the median
    written past the whisker. ``summaries``: ``{"median", "min", "max"}`` mappings."""
    med = [s["median"] * scale for s in summaries]
    err = [[(s["median"] - s["min"]) * scale for s in summaries],
           [(s["max"] - s["median"]) * scale for s in summaries]]
    ax.barh(range(len(labels)), med, xerr=err, capsize=4, color=colors)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    if log and all(m > 0 for m in med):
        ax.set_xscale("log")
    for i, s in enumerate(summaries):
        ax.annotate(f" {format_number(s['median'] * scale)}", (s["max"] * scale, i),
                    va="center", fontsize=9)
    ax.margins(x=0.18)  # room for the numbers
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))


def error_line(e: BaseException) -> str:
    """``"Type: first line of the message"`` (at most 200 characters of it), for a case
    a suite reports as failed or skipped rather than raising."""
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
