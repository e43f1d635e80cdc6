"""``qkv bench data``: building GPT training windows, time and peak memory.

Both datasets cut one list of token ids (what a tokenizer returns) into input/target
windows of ``max_length`` tokens, the target shifted by one, a new window every
``stride`` tokens. With the defaults, one million ids, windows of 256 and stride 1,
there is a window at almost every position:

- ``qkv``: :class:`qkv.data.lm.GPTDataset` stores the ids once, as one int64 tensor, and
  slices each window as a view when it is asked for;
- ``list-of-tensors``: the book's ``GPTDatasetV1`` algorithm, written here, which builds
  a list of input tensors and a list of target tensors up front, one pair per window,
  so each token is stored about ``2 * max_length / stride`` times.

Every build runs in a fresh interpreter (see :mod:`qkv.bench.timing`), its time and peak
memory taken from the same run; the two kinds alternate over the repeats. The dataset is
still alive when the peak is read, so the peak includes everything it keeps.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..data.lm import GPTDataset
from ..utils.figures import new_figure, save_figure
from .timing import (
    MEMORY_MODES,
    Stats,
    cpu_peak_bytes,
    format_mib,
    hbars,
    machine_info,
    markdown_table,
    run_isolated,
    target_line,
    write_json,
)

__all__ = ["DataBenchConfig", "ListOfTensorsDataset", "build_case", "make_ids", "run_data"]

KINDS = {"qkv": "qkv GPTDataset (ids once, views)", "list": "list of tensors (book's V1)"}


class ListOfTensorsDataset(Dataset):
    """Windows built up front, the way the book's ``GPTDatasetV1`` builds them.

    ``token_ids``: a list of ints. Item ``n`` is ``(input (max_length,), target
    (max_length,))`` int64 for the window starting at ``n * stride``.
    """

    def __init__(self, token_ids: list[int], max_length: int, stride: int) -> None:
        self.input_ids: list[Tensor] = []
        self.target_ids: list[Tensor] = []
        for i in range(0, len(token_ids) - max_length, stride):
            self.input_ids.append(torch.tensor(token_ids[i : i + max_length]))
            self.target_ids.append(torch.tensor(token_ids[i + 1 : i + max_length + 1]))

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, idx: int) -> tuple[Tensor, Tensor]:
        return self.input_ids[idx], self.target_ids[idx]


def make_ids(num_tokens: int, vocab_size: int = 50257, seed: int = 0) -> list[int]:
    """``num_tokens`` random ids below ``vocab_size``, as the Python list a tokenizer gives."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def build_case(
    kind: str, num_tokens: int, max_length: int, stride: int, vocab_size: int = 50257,
    seed: int = 0,
) -> dict[str, Any]:
    """Build one dataset from fresh ids; time it and read its peak memory.

    Module-level and JSON in, JSON out, for :func:`~qkv.bench.timing.run_isolated`.
    The ids exist before the measurement starts: both kinds receive the same list.
    """
    ids = make_ids(num_tokens, vocab_size, seed)
    cls = GPTDataset if kind == "qkv" else ListOfTensorsDataset
    built: list[Dataset] = []
    seconds = 0.0

    def build() -> None:
        nonlocal seconds
        start = time.perf_counter()
        built.append(cls(ids, max_length, stride))
        seconds = time.perf_counter() - start

    nbytes, method = cpu_peak_bytes(build)
    dataset = built[0]
    x, y = dataset[len(dataset) // 2]  # a sanity check that the windows are there
    if not torch.equal(x[1:], y[:-1]):  # token ids: integers, so equal means equal
        raise RuntimeError(f"{kind}: targets are not the inputs shifted by one")
    return {"seconds": seconds, "bytes": nbytes, "method": method, "windows": len(dataset)}


@dataclass
class DataBenchConfig:
    """One million GPT-2-sized ids, windows of 256, stride 1 (a window at every start)."""

    num_tokens: int = 1_000_000
    max_length: int = 256
    stride: int = 1
    vocab_size: int = 50257
    repeats: int = 3
    memory: str = "isolated"
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> DataBenchConfig:
        return cls(**{"num_tokens": 50_000, "max_length": 64, **overrides})

    def validate(self) -> None:
        for name in ("num_tokens", "max_length", "stride", "vocab_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_tokens <= self.max_length:
            raise ValueError(f"num_tokens ({self.num_tokens}) must exceed max_length "
                             f"({self.max_length}) for one window")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")


def run_data(
    config: DataBenchConfig, out_dir: str | Path, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build both datasets ``repeats`` times each, alternating; print the table, write
    ``data.json`` and ``data.png`` in ``out_dir``. Returns the JSON.

    ``memory="isolated"`` (default) builds each in a fresh interpreter; ``"in-process"``
    and ``"off"`` build here (the memory then reads low for whatever the C allocator
    kept from earlier builds, and ``"off"`` drops it from the report).
    """
    config.validate()
    out_dir = Path(out_dir)
    machine = machine_info(torch.device("cpu"))  # recorded when the run starts
    log(f"data: {config.num_tokens:,} token ids, windows of {config.max_length}, stride "
        f"{config.stride}, {config.repeats} builds each "
        f"({'one fresh process per build' if config.memory == 'isolated' else 'in this process'})")
    kwargs = {"num_tokens": config.num_tokens, "max_length": config.max_length,
              "stride": config.stride, "vocab_size": config.vocab_size, "seed": config.seed}
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    names = list(KINDS)
    for r in range(config.repeats):
        for kind in names[r % 2:] + names[: r % 2]:  # alternate which goes first
            if config.memory == "isolated":
                run = run_isolated(build_case, kind=kind, **kwargs)
            else:
                run = build_case(kind, **kwargs)
            runs[kind].append(run)
        log(f"round {r + 1}/{config.repeats}: " + ", ".join(
            f"{k} {runs[k][-1]['seconds']:.3g} s / {format_mib(runs[k][-1]['bytes'])} MiB"
            for k in names))

    results: dict[str, Any] = {}
    for kind in names:
        seconds = Stats(tuple(run["seconds"] for run in runs[kind]))
        entry: dict[str, Any] = {"seconds": seconds.to_dict(), "windows": runs[kind][0]["windows"]}
        if config.memory != "off":
            entry["peak_bytes"] = Stats(tuple(float(run["bytes"]) for run in runs[kind])).to_dict()
            entry["memory_method"] = runs[kind][0]["method"]
        results[kind] = entry
    report: dict[str, Any] = {
        "suite": "data",
        "config": dataclasses.asdict(config),
        "machine": machine,
        "results": results,
        "targets": [],
    }
    if config.memory != "off":
        ours = results["qkv"]["peak_bytes"]["median"]
        theirs = results["list"]["peak_bytes"]["median"]
        name = "dataset memory <= 1/50 of the list-of-tensors dataset"
        if theirs > 0:
            frac = ours / theirs
            report["memory_fraction"] = frac
            report["targets"].append({
                "name": name, "value": frac, "threshold": 1 / 50, "met": frac <= 1 / 50,
                "value_text": f"{format_mib(ours)} MiB vs {format_mib(theirs)} MiB = "
                              f"1/{1 / max(frac, 1e-9):,.0f}",
            })
        else:  # tiny sizes measured in-process can reuse freed memory and read 0
            report["targets"].append({
                "name": name, "value": None, "threshold": 1 / 50, "met": False,
                "value_text": "not measurable: the list of tensors read 0 MiB",
            })
    log(f"\nbuilding {results['qkv']['windows']:,} windows of {config.max_length} tokens:\n")
    log(table(report))
    log("")
    for target in report["targets"]:
        log(target_line(target))
    write_json(out_dir / "data.json", report)
    plot(report, out_dir / "data.png")
    log(f"\nwrote {out_dir / 'data.json'} and {out_dir / 'data.png'}")
    return report


def table(report: dict[str, Any]) -> str:
    rows = []
    for kind, label in KINDS.items():
        r = report["results"][kind]
        s = r["seconds"]
        row = [label, f"{s['median']:.3g}", f"{s['min']:.3g}-{s['max']:.3g}"]
        if "peak_bytes" in r:
            m = r["peak_bytes"]
            row += [format_mib(m["median"]), f"{format_mib(m['min'])}-{format_mib(m['max'])}"]
        rows.append(row)
    header = ["dataset", "build s", "min-max s"]
    if len(rows[0]) > 3:
        header += ["peak MiB", "min-max MiB"]
    return markdown_table(header, rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """Build time and peak memory of both, log scale (they differ by orders of magnitude)."""
    kinds = list(KINDS)
    res = report["results"]
    panels = [("seconds", "build time (s)", 1.0)]
    if all("peak_bytes" in res[k] for k in kinds):
        panels.append(("peak_bytes", "peak memory (MiB)", 2.0**-20))
    fig = new_figure(6 * len(panels), 2.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for i, (ax, (key, label, scale)) in enumerate(zip(axes, panels, strict=True)):
        hbars(ax, [KINDS[k] for k in kinds], [res[k][key] for k in kinds],
              colors=["tab:orange", "tab:blue"], xlabel=label, log=True, scale=scale)
        if i:
            ax.set_yticks([])  # the first panel names the bars for both
    cfg = report["config"]
    fig.suptitle(f"{cfg['num_tokens']:,} ids, windows of {cfg['max_length']}, stride "
                 f"{cfg['stride']}", fontsize=10)
    return save_figure(fig, path)
