"""``qkv bench save``: what a periodic checkpoint costs a training run.

Training saves on a clock (:attr:`qkv.training.TrainConfig.save_every`, 10 minutes by
default, and the first epoch of a run expected to last more than
:data:`qkv.training.trainer.FIRST_SAVE_SECONDS`), so that a SIGKILL loses at most that
interval. A save must be cheap beside the training it protects: this suite times
:meth:`qkv.training.Trainer.save` itself (serialising the weights, AdamW's two moments,
the RNG states and the history, hashing, writing, ``fsync``, the atomic commit and the
loss plot) for GPT presets with real optimizer state, into ``--out`` (so on the disk a
run would use), and reports each save's share of the interval it protects:

    cost = save seconds / (save_every minutes x 60)

and, for the one save a long run makes after its first epoch, the same share of the
shortest run that makes it.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import MAX_COUNT, check_int
from ..models.gpt import PRESETS, GPTConfig, GPTModel
from ..training import SAVE_EVERY_MINUTES, TrainConfig, Trainer, check_save_every
from ..training.trainer import FIRST_SAVE_SECONDS
from ..utils.figures import new_figure, save_figure
from .timing import Stats, hbars, machine_info, markdown_table, write_json

__all__ = ["SaveBenchConfig", "run_save"]

TARGET_FRACTION = 0.02  # a save costs under 2 % of the training it protects


@dataclass
class SaveBenchConfig:
    """GPT presets saved ``repeats`` times each, with AdamW state, at ``save_every``."""

    presets: tuple[str, ...] = ("mini", "gpt2-small")
    repeats: int = 3
    save_every: float = SAVE_EVERY_MINUTES

    @classmethod
    def quick(cls, **overrides: Any) -> SaveBenchConfig:
        return cls(**{"presets": ("tiny",), "repeats": 2, **overrides})

    def validate(self) -> None:
        unknown = [p for p in self.presets if p not in PRESETS]
        if unknown or not self.presets:
            raise ValueError(f"unknown GPT preset {unknown[0] if unknown else 'list'!r}; "
                             f"choose from {', '.join(PRESETS)}")
        check_int("repeats", self.repeats, 1, MAX_COUNT)  # the command line bounds it further
        check_save_every(self.save_every)
        if self.save_every == 0:
            raise ValueError("save_every must be > 0 minutes: the cost is a share of it")


def _trainer(preset: str, run_dir: Path) -> Trainer:
    """A GPT of ``preset`` after one AdamW step (so the optimizer state exists)."""
    torch.manual_seed(0)
    cfg = GPTConfig.preset(preset, context_length=8)
    model = GPTModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))

    def loss_fn(m: nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        logits = m(batch[0][:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[0][:, 1:].flatten(),
                                           reduction="sum")
        return loss, torch.tensor(8)

    trainer = Trainer(model, loss_fn, lambda g: [(ids,)],
                      TrainConfig(epochs=1, device="cpu", progress=False, log_every=0),
                      run_dir=run_dir,
                      optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
                      checkpoint_config={"model": cfg.to_dict()}, log=lambda line: None)
    trainer.fit()  # one step, and the first save (untimed: it creates the directory)
    return trainer


def _bytes_on_disk(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.iterdir() if p.is_file())


def run_save(config: SaveBenchConfig, out_dir: str | Path,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time ``Trainer.save`` for each preset; print the table, write ``save.json`` and
    ``save.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    work = out_dir / "save-bench-runs"
    shutil.rmtree(work, ignore_errors=True)
    machine = machine_info(torch.device("cpu"))
    log(f"save: Trainer.save of GPT presets with AdamW state into {work}, "
        f"{config.repeats} saves each; cost against a save every {config.save_every:g} min")
    results: dict[str, Any] = {}
    rows = []
    for preset in config.presets:
        run_dir = work / preset
        trainer = _trainer(preset, run_dir)
        seconds = []
        for _ in range(config.repeats):
            start = time.perf_counter()
            trainer.save()
            seconds.append(time.perf_counter() - start)
        stats = Stats(tuple(seconds))
        size = _bytes_on_disk(run_dir)
        interval = 60 * config.save_every
        results[preset] = {
            "seconds": stats.to_dict(), "bytes": size,
            "parameters": sum(p.numel() for p in trainer.module.parameters()),
            "cost_fraction": stats.median / interval,
            "first_save_fraction": stats.median / FIRST_SAVE_SECONDS,
        }
        rows.append([preset, f"{results[preset]['parameters'] / 1e6:.1f} M",
                     f"{size / 2**20:,.0f} MiB", f"{stats.median:.2f} s",
                     f"{stats.min:.2f}-{stats.max:.2f} s",
                     f"{size / 2**20 / stats.median:,.0f} MiB/s",
                     f"{100 * stats.median / interval:.2f} %",
                     f"{100 * stats.median / FIRST_SAVE_SECONDS:.2f} %"])
        del trainer
        shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    log(markdown_table(
        ["preset", "params", "checkpoint", "save (median)", "min-max", "rate",
         f"cost at {config.save_every:g} min", f"first save of a {FIRST_SAVE_SECONDS:.0f} s run"],
        rows))
    worst = max(r["cost_fraction"] for r in results.values())
    report: dict[str, Any] = {
        "suite": "save",
        "config": dataclasses.asdict(config),
        "machine": machine,
        "results": results,
        "targets": [{
            "name": f"a periodic save costs < {TARGET_FRACTION:.0%} of training",
            "value": worst, "threshold": TARGET_FRACTION, "met": worst < TARGET_FRACTION,
            "value_text": f"{100 * worst:.2f} % (the largest preset, at "
                          f"{config.save_every:g} min)",
        }],
    }
    for target in report["targets"]:
        log(f"{'MET   ' if target['met'] else 'MISSED'} {target['name']}: "
            f"{target['value_text']}")
    write_json(out_dir / "save.json", report)
    fig = new_figure(6, 1.2 + 0.5 * len(results))
    hbars(fig.add_subplot(), list(results), [r["seconds"] for r in results.values()],
          colors=["tab:blue"] * len(results), xlabel="seconds per Trainer.save (median, min-max)")
    save_figure(fig, out_dir / "save.png", dpi=100)
    return report
