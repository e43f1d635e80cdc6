"""A small reusable trainer: one loop for the seq2seq translator and, later, a GPT.

The model-specific parts come in as two callables:

- ``loss_fn(model, batch) -> (loss_sum, num_tokens)``: the summed loss over the batch's
  real tokens and their count (see :func:`qkv.training.masked_cross_entropy`). The
  trainer back-propagates ``loss_sum / num_tokens`` (mean per valid token) and reports
  each epoch's loss as total ``loss_sum`` over total ``num_tokens``.
- ``dataset_or_loader_factory(generator) -> iterable of batches``: called once per epoch
  with a ``torch.Generator`` seeded from ``(config.seed, epoch)``. Shuffle with it (e.g.
  ``DataLoader(..., shuffle=True, generator=generator)``) and epoch ``e`` sees the same
  order in a run that was resumed as in one that was not.

Reproducibility. Seeding the global RNGs before building the model is the caller's job
(:func:`seed_everything`). The trainer seeds each epoch's shuffle generator and saves and
restores the global RNG states with its checkpoints, so training N epochs straight and
training k epochs, saving, resuming in a fresh process and training to N give
bit-identical weights (on the same device and software; on GPU,
``torch.use_deterministic_algorithms(True)`` may be needed as well).

Saving on a clock. Besides the end of the run, :meth:`Trainer.fit` saves every
``config.save_every`` minutes (at the end of an epoch, and in one process also inside a
long one, recording the steps done) and after the first epoch of a long run, so that a
SIGKILL, the OOM killer or a power cut loses at most that interval;
:meth:`Trainer.resume` continues from any of these saves exactly. The disk's free space
is checked before training and before each save.

Ctrl-C. A ``KeyboardInterrupt`` during :meth:`Trainer.fit` (with a ``run_dir``) rolls the
model, optimizer, RNGs and history back to the end of the last completed epoch, saves
that as the checkpoint unless it, or a later save inside the next epoch, is already on
disk, and re-raises: what the last save did not keep of the partial epoch is lost, and
:meth:`Trainer.resume` continues exactly. An
interruption before the first epoch completes saves nothing (there is nothing to keep,
and an earlier checkpoint in ``run_dir`` stays as it was). The rollback needs a copy of
the model and optimizer state, taken (on the CPU) after every epoch. A save itself is
never cut short: a Ctrl-C during one takes effect when it is complete.

Divergence. A loss that is not finite (NaN or infinite), or weights that are not finite
at the end of an epoch, stop training with :class:`TrainingDivergedError` naming the epoch
and step; the model is rolled back and saved as for Ctrl-C, so ``run_dir`` keeps the
last finite state. The check costs no synchronisation: a device-side flag per step,
read at most every half second and at the end of each epoch.

Distributed data parallel. Under ``torchrun --nproc_per_node=N`` the trainer joins the
process group (:func:`qkv.training.init_distributed`: gloo on the CPU, NCCL on CUDA with
``cuda:LOCAL_RANK``) and wraps the model in ``DistributedDataParallel``; the factory
should shard the data with :func:`qkv.training.make_loader` (``batch_size`` is then per
process, and every rank must yield the same number of batches). Each step all-reduces the
batch's token count and back-propagates ``loss_sum * world_size / global_tokens``: DDP
averages the ranks' gradients, so the update is that of the per-token mean over the
combined batch, whatever each rank's share of the tokens. The epoch's loss, token count
and time are all-reduced, and validation (run on every rank, on identical weights)
records rank 0's metrics, so every rank holds the same history. Only rank 0 shows
progress, logs, saves and plots; the others wait at a barrier after each save, so that
the checkpoint exists everywhere once :meth:`Trainer.fit` returns. :meth:`Trainer.resume`
loads on every rank. See ``docs/distributed.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..checks import MAX_COUNT, check_float, check_int, check_str, show
from ..options import DTYPES, LOOP, SAVE_EVERY_MINUTES, TRAINING, check_save_every
from ..utils.figures import new_figure, save_figure
from ..utils.fileio import deferred_signals
from ..utils.testing import pause_point
from .checkpoint import (
    CheckpointError,
    capture_rng_state,
    check_room_to_save,
    load_trainer_state,
    load_weights,
    restore_rng_state,
    save_checkpoint,
)
from .distributed import (
    fully_shard_model,
    gather_model_state,
    gather_optimizer_state,
    init_distributed,
    materialize,
    meta_copy,
    scatter_model_state,
    scatter_optimizer_state,
)
from .schedule import LRSchedule
from .speed import matmul_rate, model_flops_utilisation

__all__ = [
    "BEST_DIR",
    "DTYPES",
    "LOSS_PLOT",
    "SAVE_EVERY_MINUTES",
    "check_save_every",
    "plot_progress",
    "EarlyStopping",
    "TrainConfig",
    "Trainer",
    "TrainingDivergedError",
    "default_optimizer",
    "can_fuse_optimizer",
    "seed_everything",
    "epoch_seed",
]

Batch = tuple[Tensor, ...]
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Batch], tuple[Tensor, Tensor]]
DataFactory = Callable[[torch.Generator], Iterable[Batch]]

LOSS_PLOT = "loss.png"
# The sub-directory of run_dir that holds the best weights seen by early stopping: a
# checkpoint of its own (weights and config, no trainer state), loadable as any other.
BEST_DIR = "best"
# Seconds between progress-bar refreshes; each refresh reads the loss from the device.
_PROGRESS_INTERVAL = 0.5
# The clock behind periodic checkpoints (SAVE_EVERY_MINUTES): a run expected to last
# longer than FIRST_SAVE_SECONDS saves its first epoch whatever the interval, so that
# a kill early in a long run does not lose it all.
FIRST_SAVE_SECONDS = 180.0


@dataclass(frozen=True)
class EarlyStopping:
    """Stop when a validation metric has not improved for ``patience`` epochs.

    Attributes:
        metric: a key of the history, e.g. ``"valid_loss"`` or ``"valid_bleu"``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: epochs without improvement before stopping; 0 never stops (the best
            weights are still kept).
        min_delta: an improvement smaller than this does not count.
    """

    metric: str = "valid_loss"
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric.startswith("valid_"):
            raise ValueError(f"early stopping metric must name a validation metric "
                             f"('valid_...'), got {show(self.metric)}")
        check_str("early stopping mode", self.mode, choices=("min", "max"))
        check_int("patience", self.patience, 0, MAX_COUNT)
        check_float("min_delta", self.min_delta, 0.0)

    def improved(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` (None: nothing yet) by more than ``min_delta``."""
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta


@dataclass
class TrainConfig:
    """Hyperparameters of the loop itself (the model's own live in its config).

    Attributes:
        epochs: total epochs; after :meth:`Trainer.resume`, training continues up to this.
        lr: learning rate of the default Adam optimizer.
        clip_norm: clip gradients to this global L2 norm; None disables clipping.
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"`` or
            ``"cuda:N"``. Under ``torchrun`` each process takes ``cuda:LOCAL_RANK``.
        seed: seeds each epoch's shuffle generator (see :func:`epoch_seed`).
        log_every: log a line every this many epochs (and after the last); 0: never.
        checkpoint_every: save every this many epochs; 0: by the clock only (see
            ``save_every``), at the end and on Ctrl-C.
        save_every: minutes; save at the end of the first epoch that finishes at least
            this long after the last save (or the start of :meth:`fit`), and, in one
            process, inside an epoch, before its first step that comes that long after
            it (the checkpoint records the steps done, and :meth:`resume` goes on from
            there exactly); 0: after every epoch. A run expected to last more than
            :data:`FIRST_SAVE_SECONDS` also saves after the first epoch it trains. The
            end of the run is always saved.
        progress: show a tqdm progress bar on stderr.
        schedule: the learning rate of step ``s`` is ``lr * schedule.factor(s)``; None:
            ``lr`` throughout. A ``total_steps`` of None becomes epochs x batches.
        early_stopping: watch a validation metric, keep the best weights in
            ``run_dir/best`` and stop after ``patience`` epochs without improvement;
            :meth:`Trainer.fit` then returns with the best weights in the model.
        accumulate: micro-batches per optimizer step (gradient accumulation); the step
            is that of the per-token mean over all of them, as one big batch would give.
        dtype: ``"float32"``, or ``"bfloat16"`` to run the forward under
            ``torch.autocast`` (weights, gradients and optimizer stay float32).
        compile: train through ``torch.compile(model)``; checkpoints hold the plain model.
        strategy: under ``torchrun``, ``"ddp"`` (a whole model per process) or ``"fsdp"``
            (each process holds a shard of the weights, gradients and optimizer state;
            see :class:`Trainer`). One process ignores it.
        flops_per_token: the model's floating-point operations per training token (e.g.
            :meth:`qkv.models.gpt.GPTConfig.training_flops_per_token`); given, the trainer
            measures the device's matmul rate once and reports model FLOPs utilisation
            (``mfu``, a fraction of that rate) in the progress bar and the history.
    """

    epochs: int = 1
    lr: float = 5e-3
    clip_norm: float | None = 1.0
    device: str = "auto"
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0
    save_every: float = SAVE_EVERY_MINUTES
    progress: bool = True
    schedule: LRSchedule | None = None
    early_stopping: EarlyStopping | None = None
    accumulate: int = 1
    dtype: str = "float32"
    compile: bool = False
    strategy: str = "ddp"
    flops_per_token: float | None = None

    def __post_init__(self) -> None:
        # Each field that is a declared setting is checked as declared (qkv.options):
        # the same check as the run's settings and a saved checkpoint's train_config.
        for name, setting in TRAIN_CONFIG_SETTINGS.items():
            setting.validate(getattr(self, name))


# TrainConfig's fields that are declared settings: the run's training settings
# (qkv.options.TRAINING) and the loop's own (qkv.options.LOOP).
TRAIN_CONFIG_SETTINGS = {f.name: {**TRAINING, **LOOP}[f.name]
                         for f in dataclasses.fields(TrainConfig)
                         if f.name in TRAINING or f.name in LOOP}


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global RNG and torch (CPU and every CUDA device)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)  # NumPy's legacy seed is limited to 32 bits
    torch.manual_seed(seed)


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for epoch ``epoch``'s shuffle, a pure function of ``(seed, epoch)``.

    Deriving it (rather than drawing from a running RNG) is what makes the shuffle of
    epoch ``e`` independent of how many epochs ran in this process.
    """
    digest = hashlib.sha256(f"qkv/epoch/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _cpu_copy(obj: Any) -> Any:
    """Deep copy of nested state with every tensor copied to the CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def can_fuse_optimizer(params: Iterable[Tensor]) -> bool:
    """Whether PyTorch's fused Adam/AdamW step (one kernel for every tensor) takes these
    parameters: floating point, plain tensors (not FSDP's sharded ``DTensor``), on the
    CPU or CUDA. Pass the result as ``fused=... or None``."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
               and not hasattr(p, "to_local") for p in params)


def default_optimizer(model: nn.Module, lr: float, device: torch.device) -> torch.optim.Adam:
    """``Adam(model.parameters(), lr)``, fused into one kernel where PyTorch has one
    (:func:`can_fuse_optimizer`; ``device`` is where the model was moved to).

    Same algorithm, same state dict; the fused update replaces about ten operations per
    parameter tensor, which at the translator's size (the Bahdanau model's 23 small
    tensors) makes the optimizer step about 4x faster on the CPU.
    """
    fused = device.type in ("cpu", "cuda") and can_fuse_optimizer(model.parameters())
    return torch.optim.Adam(model.parameters(), lr=lr, fused=fused or None)


class TrainingDivergedError(RuntimeError):
    """The loss or the weights stopped being finite: one line naming epoch and step."""

    def __init__(self, message: str, epoch: int, step: int, lr: float) -> None:
        super().__init__(message)
        self.epoch, self.step, self.lr = epoch, step, lr


class Trainer:
    """Train ``model`` with ``loss_fn`` on the batches of ``data``; checkpoint to ``run_dir``.

    Args:
        model: the module to train (moved to the configured device).
        loss_fn: ``(model, batch) -> (loss_sum, num_tokens)``, batch already on the device.
        dataset_or_loader_factory: ``generator -> iterable of batches`` (tuples of
            tensors), called once per epoch with that epoch's seeded generator.
        config: the loop's hyperparameters.
        run_dir: where :meth:`save` writes the checkpoint and ``loss.png``; None: no saving.
        checkpoint_config: JSON-able dict saved as the checkpoint's ``config.json`` (model
            config, vocabularies, ... enough to rebuild the model).
        optimizer: default :func:`default_optimizer`, ``Adam(model.parameters(), lr)``
            (fused where PyTorch has a fused kernel); or a function ``model -> optimizer``,
            which FSDP needs (the optimizer must hold the sharded parameters).
        validate: ``model -> {name: value}``, run after every epoch in eval mode under
            ``torch.no_grad()``; the values go into the history as ``valid_<name>``.
        log: receives each log line; default prints through ``tqdm.write`` so that lines
            and the progress bar do not garble each other (a plain print without a bar).

    Under ``torchrun`` with ``config.strategy="fsdp"`` the model is sharded in place
    (``fully_shard`` on each block, then the whole model): every rank holds
    ``1 / world_size`` of it. The step and the loss are those of DDP. Whatever needs the
    whole weights gathers them on rank 0's CPU, as a collective that every rank joins:
    saving (so a run saves after every epoch, and Ctrl-C keeps the last one saved),
    keeping the best weights, and, after :meth:`fit`, :attr:`module`, which on rank 0 is
    an unsharded copy of the trained model on the CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        dataset_or_loader_factory: DataFactory,
        config: TrainConfig,
        *,
        run_dir: str | Path | None = None,
        checkpoint_config: dict[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        validate: Callable[[nn.Module], dict[str, float]] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        # Joins the process group under torchrun (a no-op otherwise) and picks this
        # process's device: cuda:LOCAL_RANK for a multi-GPU run.
        self.rank, self.world_size, self.device = init_distributed(config.device)
        model = model.to(self.device)
        self._plain = model  # what is saved and loaded, whatever wraps it for training
        self._fsdp = self.world_size > 1 and config.strategy == "fsdp"
        # Under FSDP: the model's shape without its memory (rebuilt into a whole model
        # after fit), and, once gathered, that whole model.
        self._skeleton: nn.Module | None = None
        self._gathered: nn.Module | None = None
        if self._fsdp:
            if isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError("under FSDP the optimizer must hold the sharded "
                                 "parameters: pass a function model -> optimizer")
            self._skeleton = meta_copy(model)
            fully_shard_model(model)
        self.loss_fn = loss_fn
        self.data = dataset_or_loader_factory
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.checkpoint_config = dict(checkpoint_config or {})
        if optimizer is None:
            optimizer = default_optimizer(model, config.lr, self.device)
        elif not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(model)
        self.optimizer = optimizer
        # Each group's peak rate, which a schedule scales; taken before a resume loads
        # the saved (scheduled) rates into the groups.
        self._peak_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.schedule = config.schedule
        if self.world_size > 1 and not self._fsdp:
            # DDP broadcasts rank 0's weights now, so every rank starts from the same
            # model, and averages the gradients across ranks in backward().
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids)
        self._ddp = model if self.world_size > 1 and not self._fsdp else None
        if config.compile:
            model = torch.compile(model)
        self.model = model
        self.validate = validate
        self.log = log or tqdm.write
        self.epoch = 0  # completed epochs
        self.step = 0  # optimizer steps taken
        # The epoch of the checkpoint in run_dir that this trainer saved or resumed from.
        self.saved_epoch: int | None = None
        self.history: dict[str, list] = {"epoch": [], "loss": [], "tokens_per_sec": []}
        # Early stopping: {"metric", "epoch", "value"} of the best validation so far, and
        # a CPU copy of that epoch's weights when this process saw it.
        self.best: dict[str, Any] | None = None
        self._best_weights: dict[str, Any] | None = None
        self.stopped_early = False
        self._ceiling: float | None = None  # FLOP/s of all ranks' matmuls, for MFU
        self._last_save = self._fit_started = time.monotonic()  # the clock of periodic saves
        # How far into the next epoch a checkpoint resumed from was saved (or None).
        self._partial: dict[str, Any] | None = None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def _can_save(self) -> bool:
        return self.run_dir is not None and self.is_main_process

    @property
    def module(self) -> nn.Module:
        """The model being trained, unwrapped: ``self.model`` may be wrapped by DDP and
        ``torch.compile``. Under FSDP, after :meth:`fit`, rank 0's is a whole copy on the
        CPU (the other ranks' stays sharded)."""
        return self._gathered if self._gathered is not None else self._module

    @property
    def _module(self) -> nn.Module:
        # DDP and torch.compile wrap the model; checkpoints hold the unwrapped one.
        return self._plain

    # ------------------------------------------------------------------ training

    def fit(self) -> dict[str, list]:
        """Train from the current epoch to ``config.epochs``; return the history.

        The history maps ``"epoch"``, ``"loss"`` (per token), ``"tokens_per_sec"``,
        ``"seconds"`` (the epoch's wall time, its validation included; its running sum is
        the time trained so far), ``"mfu"`` (with ``config.flops_per_token``) and each
        ``"valid_<name>"`` to one value per completed epoch (resumed epochs included).
        """
        cfg = self.config
        bar = tqdm(
            desc="train", unit="step", file=sys.stderr, dynamic_ncols=True,
            disable=not (cfg.progress and self.is_main_process),
        )
        # What Ctrl-C rolls back to: the state at the end of the last completed epoch.
        # Only the saving rank needs it. (The Ctrl-C path below runs no collective: the
        # other ranks may be gone already.)
        # Under FSDP the weights are in shards on every rank: rather than gather them for
        # a rescue copy, each epoch is saved as it ends.
        rescue = self._capture() if self._can_save and not self._fsdp else None
        if cfg.flops_per_token is not None and self._ceiling is None:
            self._ceiling = self._measure_ceiling()
        if self._partial is not None and cfg.epochs <= self.epoch:
            raise ValueError(f"the checkpoint resumed was saved {self._partial['groups']} steps "
                             f"into epoch {self.epoch + 1}: train to at least epoch "
                             f"{self.epoch + 1} (epochs is {cfg.epochs})")
        first = self.epoch + 1  # the first epoch this call trains
        self._last_save = self._fit_started = time.monotonic()
        if self._can_save:
            check_room_to_save(self.run_dir, self._checkpoint_bytes())
        try:
            pause_point("train-start")
            stop = self._patience_spent()
            while self.epoch < cfg.epochs and not stop:
                # An epoch resumed from a save inside it counts the time before the save.
                started = time.perf_counter() - (self._partial or {}).get("seconds", 0.0)
                record = self._train_epoch(self.epoch, bar)
                if self.validate is not None:
                    record.update(self._run_validation())
                record["seconds"] = self._slowest(time.perf_counter() - started)
                self.epoch += 1
                self._append_history(record)
                if cfg.early_stopping is not None:
                    self._track_best(record)
                    stop = self._patience_spent()
                last = self.epoch == cfg.epochs or stop
                if cfg.log_every and (self.epoch % cfg.log_every == 0 or last):
                    self._log_epoch(record)
                if rescue is not None:
                    rescue = self._capture()
                pause_point("epoch-end")
                if not last and self._save_due(first=self.epoch == first):
                    self._save_and_wait()  # the last one is saved below
        except (KeyboardInterrupt, TrainingDivergedError) as stop:
            bar.close()
            if rescue is not None:
                self._keep_last_completed_epoch(rescue, stop)
            raise
        finally:
            bar.close()
        self._save_and_wait()
        if stop and self.best is not None:
            self.stopped_early = self.epoch < cfg.epochs
            if self.is_main_process:
                self.log(f"early stop after epoch {self.epoch}: "
                         f"{self.best['metric']} has not improved for "
                         f"{self.epoch - self.best['epoch']} epochs")
        if self.best is not None:
            self._load_best()
        if self._fsdp:
            self._gather_module()
        if self.history["loss"] and self.is_main_process:
            # The reference's closing line (d2l train_seq2seq): the last epoch's numbers.
            where = self.device if self.world_size == 1 else (
                f"{self.world_size} x {self.device.type}")
            self.log(f"loss {self.history['loss'][-1]:.3f}, "
                     f"{self.history['tokens_per_sec'][-1]:.1f} tokens/sec on {where}")
        return self.history

    def _measure_ceiling(self) -> float:
        """The matmul rate of the device in the training dtype, times the number of
        ranks: what MFU is a fraction of. Rank 0 measures; every rank records its
        figure, so that the histories agree."""
        dtype = torch.bfloat16 if self.config.dtype == "bfloat16" else torch.float32
        rate = [matmul_rate(self.device, dtype) if self.is_main_process else 0.0]
        if self.world_size > 1:
            dist.broadcast_object_list(rate, src=0)
        return rate[0] * self.world_size

    def _mfu(self, tokens_per_sec: float) -> float:
        assert self.config.flops_per_token is not None and self._ceiling is not None
        return model_flops_utilisation(self.config.flops_per_token, tokens_per_sec,
                                       self._ceiling)

    def _keep_last_completed_epoch(self, rescue: dict[str, Any], stop: BaseException) -> None:
        """Roll back to ``rescue`` (the end of the last completed epoch) and save it,
        unless it is the checkpoint already on disk or there is no completed epoch."""
        self._restore(rescue)
        if self.epoch == 0 or self.epoch == self.saved_epoch:
            return
        why = "interrupted" if isinstance(stop, KeyboardInterrupt) else "stopped"
        self.log(f"{why}: saving the state after epoch {self.epoch} to {self.run_dir}")
        self.save()

    def _save_due(self, first: bool) -> bool:
        """Whether the epoch that just ended is saved before training goes on: every
        epoch under FSDP (Ctrl-C keeps the last save there), every
        ``checkpoint_every`` epochs, and by the clock (``save_every``; a long run's first
        epoch). Under DDP rank 0's clock decides for every rank, which then all wait
        for its save."""
        cfg = self.config
        if self._fsdp or (cfg.checkpoint_every and self.epoch % cfg.checkpoint_every == 0):
            return True
        if self.run_dir is None:
            return False
        # After the first epoch, this call's whole run is about its time times the epochs.
        expected = (time.monotonic() - self._fit_started) * (cfg.epochs - self.epoch + 1)
        due = [self._clock_due() or (first and expected > FIRST_SAVE_SECONDS)]
        if self.world_size > 1:
            dist.broadcast_object_list(due, src=0)
        return bool(due[0])

    def _clock_due(self) -> bool:
        """Whether ``save_every`` minutes have passed since the last save (or the start of
        :meth:`fit`)."""
        return time.monotonic() - self._last_save >= 60 * self.config.save_every

    def _checkpoint_bytes(self) -> int:
        """About how many bytes a checkpoint of this run takes: the weights, the
        optimizer state (two moments per parameter for Adam-like optimizers when none
        exists yet) and the trainer's state, plus a best copy of the weights under early
        stopping. For the disk-space checks, made before anything is written."""
        weights = sum(t.numel() * t.element_size() for t in self._module.state_dict().values())
        held = [t for s in self.optimizer.state.values() for t in s.values()
                if isinstance(t, Tensor)]
        if held:
            optimizer = sum(t.numel() * t.element_size() for t in held)
        else:
            moments = 2 if "betas" in self.optimizer.defaults else int(
                bool(self.optimizer.defaults.get("momentum")))
            optimizer = moments * sum(p.numel() * p.element_size()
                                      for p in self._module.parameters() if p.requires_grad)
        best = weights if self.config.early_stopping is not None else 0
        return weights + optimizer + best + (1 << 18)  # JSON, RNG states, the loss plot

    def _save_and_wait(self) -> None:
        """Save on rank 0 (with a ``run_dir``); every rank then waits for the save."""
        if self.run_dir is None:
            return
        self.save()  # a no-op on the other ranks
        # The barrier is reached by every rank, outside any rank-0-only branch, so it
        # cannot deadlock; after it the checkpoint is complete for anyone who reads it.
        if self.world_size > 1:
            dist.barrier()

    def _train_epoch(self, epoch: int, bar: tqdm) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        generator = torch.Generator().manual_seed(epoch_seed(cfg.seed, epoch))
        start = time.perf_counter()  # includes data loading, as the reference's timer does
        batches = self.data(generator)
        # Optimizer steps per epoch (a short last group of micro-batches is a step too).
        steps = -(-len(batches) // cfg.accumulate) if hasattr(batches, "__len__") else None
        if bar.total is None and steps is not None:
            bar.reset(total=steps * (cfg.epochs - epoch))
        if self.schedule is not None and self.schedule.needs_total and \
                self.schedule.total_steps is None:
            if steps is None:
                raise ValueError(f"decay {self.schedule.decay!r} needs the schedule's "
                                 "total_steps when the data has no len()")
            self.schedule = dataclasses.replace(self.schedule,
                                                total_steps=steps * cfg.epochs)
        # Accumulate on the device: reading the loss every step would force a sync.
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        token_total = torch.zeros((), dtype=torch.int64, device=self.device)
        # The first step whose loss was not finite, or -1; kept on the device and read
        # only every _PROGRESS_INTERVAL, so that checking costs no synchronisation.
        bad_step = torch.full((), -1, dtype=torch.int64, device=self.device)
        # A checkpoint saved inside this epoch: its groups are skipped (the shuffle is a
        # function of the epoch, so the rest comes in the same order) and its sums kept.
        done, self._partial = (self._partial or {}), None
        skip = done.get("groups", 0)
        if done:
            loss_total += done["loss_sum"]
            token_total += done["tokens"]
            start -= done["seconds"]
        # Saves inside an epoch, on the clock, in one process (under torchrun every rank
        # would have to agree at every step).
        mid_epoch = self._can_save and self.world_size == 1 and cfg.save_every > 0
        last_refresh = last_check = time.perf_counter()
        for index, group in enumerate(_groups(batches, cfg.accumulate)):
            if index < skip:
                continue
            # Before a step, not after: the epoch's end has a save rule of its own.
            if mid_epoch and index > skip and self._clock_due():
                self._check_finite(epoch, bad_step, weights=True)  # never save a diverged state
                self.save(partial={"epoch": epoch, "groups": index,
                                   "loss_sum": loss_total.item(), "tokens": int(token_total.item()),
                                   "seconds": time.perf_counter() - start})
                pause_point("mid-epoch-save")
            self.optimizer.zero_grad(set_to_none=True)
            if len(group) == 1:
                loss_sum, num_tokens = self._forward(group[0])
                if self.world_size == 1:
                    # Mean per valid token in this batch; clamp keeps an all-padding batch
                    # finite.
                    (loss_sum / num_tokens.clamp_min(1)).backward()
                else:
                    # The mean per valid token of the combined batch of all ranks. DDP
                    # averages gradients (divides their sum by world_size), so scale by
                    # world_size over the global token count; dividing by the local count
                    # instead would weight a rank's tokens by how few of them it got.
                    global_tokens = num_tokens.detach().clone()
                    dist.all_reduce(global_tokens)
                    (loss_sum * self.world_size / global_tokens.clamp_min(1)).backward()
            else:
                loss_sum, num_tokens = self._accumulate(group)
            bad_step = torch.where((bad_step < 0) & ~loss_sum.detach().isfinite(),
                                   self.step + 1, bad_step)
            if cfg.clip_norm is not None:
                nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
            if self.schedule is not None:
                factor = self.schedule.factor(self.step)
                for group, peak in zip(self.optimizer.param_groups, self._peak_lrs,
                                       strict=True):
                    group["lr"] = peak * factor
            self.optimizer.step()
            self.step += 1
            loss_total += loss_sum.detach()
            token_total += num_tokens.detach()
            bar.update()
            now = time.perf_counter()
            if now - last_check >= _PROGRESS_INTERVAL:
                last_check = now
                self._check_finite(epoch, bad_step)
            if not bar.disable and now - last_refresh >= _PROGRESS_INTERVAL:
                last_refresh = now
                tokens = token_total.item()
                rate = tokens * self.world_size / (now - start)  # the ranks run alike
                extra = {"mfu": f"{self._mfu(rate):.1%}"} if self._ceiling else {}
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss_total.item() / max(tokens, 1):.3f}",
                                tok_s=f"{rate:.0f}", **extra, refresh=False)
        tokens = int(token_total.item())  # .item() synchronises, so the timing is honest
        self._check_finite(epoch, bad_step, weights=True)
        seconds = time.perf_counter() - start
        loss_sum_total = loss_total.item()
        if self.world_size > 1:
            # Every rank records the whole epoch: total loss and tokens over all ranks,
            # and the slowest rank's time (the step is as fast as the slowest rank).
            totals = torch.tensor([loss_sum_total, tokens], dtype=torch.float64,
                                  device=self.device)
            dist.all_reduce(totals)
            loss_sum_total, tokens = totals[0].item(), int(totals[1].item())
        seconds = self._slowest(seconds)
        # After the all-reduce, so that every rank raises together (none waits forever).
        if tokens == 0:
            raise ValueError(f"epoch {epoch + 1}: the data yielded no tokens (no batches, "
                             "or num_tokens was always 0)")
        record = {"loss": loss_sum_total / tokens, "tokens_per_sec": tokens / seconds}
        if self._ceiling:
            record["mfu"] = self._mfu(record["tokens_per_sec"])
        return record

    def _forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """``loss_fn`` on ``batch`` moved to the device, under autocast when configured."""
        batch = tuple(t.to(self.device, non_blocking=True) if isinstance(t, Tensor) else t
                      for t in batch)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.config.dtype == "bfloat16"):
            loss_sum, num_tokens = self.loss_fn(self.model, batch)
        return loss_sum, torch.as_tensor(num_tokens, device=self.device)

    def _accumulate(self, group: list[Batch]) -> tuple[Tensor, Tensor]:
        """Gradients of the per-token mean over all of ``group``'s micro-batches (and, under
        DDP, all ranks'): each micro-batch back-propagates its loss *sum*, and the summed
        gradients are divided by the group's token count once it is known. Returns the
        group's ``(loss_sum, num_tokens)``."""
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        for i, micro in enumerate(group):
            # Under DDP, all-reduce the gradients once, after the last micro-batch.
            last = i == len(group) - 1
            sync = contextlib.nullcontext() if last or self._ddp is None else \
                self._ddp.no_sync()
            if self._fsdp:  # FSDP's no_sync: reduce-scatter only after the last one
                self._plain.set_requires_gradient_sync(last)
            with sync:
                loss_sum, num_tokens = self._forward(micro)
                loss_sum.backward()
            loss_total = loss_total + loss_sum.detach().double()
            tokens = tokens + num_tokens.detach()
        global_tokens = tokens.clone()
        if self.world_size > 1:
            dist.all_reduce(global_tokens)
        scale = self.world_size / global_tokens.clamp_min(1).double()
        for param in self._module.parameters():
            if param.grad is not None:
                grad = _local(param.grad)  # a DTensor's own shard under FSDP
                grad.mul_(scale.to(grad.dtype))
        return loss_total, tokens

    def _check_finite(self, epoch: int, bad_step: Tensor, weights: bool = False) -> None:
        """Raise :class:`TrainingDivergedError` if a step's loss (or, with ``weights``, a
        parameter) is not finite. Every rank raises together: all see the same weights,
        and a non-finite loss on any rank reaches every rank through the gradients."""
        step = int(bad_step.item())
        if step < 0 and weights:
            finite = torch.tensor(all(bool(_local(p.detach()).isfinite().all())
                                      for p in self._module.parameters()),
                                  device=self.device)
            if self._fsdp:  # each rank sees only its shards
                dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            step = -1 if bool(finite) else self.step
        if step < 0:
            return
        raise TrainingDivergedError(
            f"training diverged at epoch {epoch + 1}, step {step:,}: the loss or the weights "
            f"stopped being finite (NaN or infinite) with lr {self._lr():g}; a smaller lr "
            "or clip_norm usually helps", epoch + 1, step, self._lr())

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _slowest(self, seconds: float) -> float:
        """``seconds`` on one process; under DDP the slowest rank's, so every rank
        records the same history."""
        if self.world_size == 1:
            return seconds
        value = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    def _run_validation(self) -> dict[str, float]:
        assert self.validate is not None
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = self.validate(self._module)
        finally:
            self.model.train(was_training)
        record = {f"valid_{name}": float(value) for name, value in metrics.items()}
        if self.world_size > 1:
            # Every rank validated the same weights (which keeps their RNG streams in step
            # and lets a validate() shard its own work); all record rank 0's numbers, so
            # the histories match even where GPU kernels are not bit-reproducible.
            shared = [record]
            dist.broadcast_object_list(shared, src=0)
            record = shared[0]
        return record

    def _append_history(self, record: dict[str, float]) -> None:
        record = {"epoch": self.epoch, **record}
        done = len(self.history["epoch"])
        for key in [*self.history, *(k for k in record if k not in self.history)]:
            # A metric that appears late (or disappears) is padded with None to stay aligned.
            column = self.history.setdefault(key, [None] * done)
            column.append(record.get(key))

    def _log_epoch(self, record: dict[str, float]) -> None:
        if not self.is_main_process:
            return
        extra = "".join(
            f", {k} {v:.3f}" for k, v in record.items() if k.startswith("valid_")
        )
        mfu = f" (MFU {record['mfu']:.1%})" if record.get("mfu") is not None else ""
        self.log(f"epoch {self.epoch}/{self.config.epochs}: loss {record['loss']:.3f}, "
                 f"{record['tokens_per_sec']:.1f} tokens/sec{mfu}{extra}")

    # ------------------------------------------------------------------ state

    def _capture(self) -> dict[str, Any]:
        return {
            "model": _cpu_copy(self._module.state_dict()),
            "optimizer": _cpu_copy(self.optimizer.state_dict()),
            "rng": capture_rng_state(),
            "epoch": self.epoch,
            "step": self.step,
            "history": _cpu_copy(self.history),
            "best": _cpu_copy(self.best),
            "best_weights": self._best_weights,  # never modified in place: no copy needed
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        self._module.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        restore_rng_state(snapshot["rng"])
        self.epoch, self.step = snapshot["epoch"], snapshot["step"]
        self.history = snapshot["history"]
        self.best, self._best_weights = snapshot["best"], snapshot["best_weights"]

    def _track_best(self, record: dict[str, float]) -> None:
        """Remember (and save to ``run_dir/best``) this epoch's weights if they are the best
        so far by the early-stopping metric."""
        rule = self.config.early_stopping
        assert rule is not None
        value = record.get(rule.metric)
        if value is None:
            given = sorted(k for k in record if k.startswith("valid_"))
            raise ValueError(f"early stopping watches {rule.metric!r}, but validation gives "
                             f"{given or 'nothing (no validate function)'}")
        if not math.isfinite(value) or not rule.improved(
                value, None if self.best is None else self.best["value"]):
            return
        self.best = {"metric": rule.metric, "epoch": self.epoch, "value": float(value)}
        weights = self._whole_weights()
        self._best_weights = weights if self._fsdp else _cpu_copy(weights)
        if self.run_dir is not None:
            if self.is_main_process:
                best_dir = self.run_dir / BEST_DIR
                best_dir.mkdir(parents=True, exist_ok=True)
                save_checkpoint(best_dir, weights, self.checkpoint_config)
            if self.world_size > 1:
                dist.barrier()

    def _patience_spent(self) -> bool:
        rule = self.config.early_stopping
        if rule is None or self.best is None or rule.patience == 0:
            return False
        return self.epoch - self.best["epoch"] >= rule.patience

    def _load_best(self) -> None:
        """Put the best weights into the model: from memory, or from ``run_dir/best``."""
        if self._fsdp:
            # Rank 0 alone holds them in memory; all ranks can read run_dir/best, which
            # rank 0 wrote before a barrier.
            if self.run_dir is not None and (self.run_dir / BEST_DIR).is_dir():
                load_weights(self.run_dir / BEST_DIR, self._module, load=self._scatter_weights)
            else:
                scatter_model_state(self._plain, self._best_weights or {})
        elif self._best_weights is not None:
            self._module.load_state_dict(self._best_weights)
        elif self.run_dir is not None and (self.run_dir / BEST_DIR).is_dir():
            load_weights(self.run_dir / BEST_DIR, self._module)

    # Under FSDP these gather or scatter across the ranks (collectives: every rank
    # calls them); otherwise they are the module's and optimizer's own state dicts.

    def _whole_weights(self) -> dict[str, Tensor]:
        """The model's whole state dict (under FSDP: on rank 0's CPU, empty elsewhere)."""
        return gather_model_state(self._plain) if self._fsdp else self._module.state_dict()

    def _whole_optimizer_state(self) -> dict[str, Any]:
        if self._fsdp:
            return gather_optimizer_state(self._plain, self.optimizer)
        return self.optimizer.state_dict()

    def _scatter_weights(self, state: dict[str, Tensor]) -> None:
        scatter_model_state(self._plain, state)

    def _scatter_optimizer_state(self, state: dict[str, Any]) -> None:
        scatter_optimizer_state(self._plain, self.optimizer, state)

    def _gather_module(self) -> None:
        """Under FSDP, rebuild the trained model whole on rank 0's CPU (:attr:`module`)."""
        assert self._skeleton is not None
        weights = gather_model_state(self._plain)
        if self.is_main_process:
            whole = materialize(self._skeleton, "cpu")
            whole.load_state_dict(weights)
            self._gathered = whole.train(self._plain.training)

    def trainer_state(self, partial: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON-able loop state saved with a checkpoint; ``partial``: how far into
        the next epoch it is (groups of micro-batches done, their loss sum, tokens and
        seconds), for a save inside an epoch."""
        state = {
            "epoch": self.epoch,
            "step": self.step,
            "history": self.history,
            "train_config": asdict(self.config),
            "best": self.best,
        }
        if partial is not None:
            state["partial"] = partial
        return state

    def save(self, partial: dict[str, Any] | None = None) -> None:
        """Checkpoint model, optimizer, RNGs and loop state to ``run_dir``; draw ``loss.png``.
        ``partial``: the save is inside an epoch (see :meth:`trainer_state`).

        Writes nothing on ranks other than 0 (whose RNG state is the one saved); under
        FSDP every rank must call it, as it gathers the shards. Under DDP,
        a caller that saves outside :meth:`fit` and reads the checkpoint on another rank
        must ``torch.distributed.barrier()`` after this on every rank.
        """
        if self.run_dir is None:
            raise ValueError("Trainer.save() needs a run_dir")
        weights, optimizer = self._whole_weights(), self._whole_optimizer_state()
        if not self.is_main_process:
            return
        # A Ctrl-C or SIGTERM held back during the save acts only once the save is
        # recorded here, so that the rollback it triggers knows what the disk holds.
        with deferred_signals():
            save_checkpoint(self.run_dir, weights, self.checkpoint_config,
                            optimizer=optimizer, trainer_state=self.trainer_state(partial))
            self._last_save = time.monotonic()
            self.saved_epoch = self.epoch
        if self.history["loss"]:
            try:
                plot_history(self.history, self.run_dir / LOSS_PLOT)
            except OSError as error:  # a picture of the run; the checkpoint is what counts
                self.log(f"note: could not draw {self.run_dir / LOSS_PLOT} "
                         f"({error.strerror or error}); the checkpoint is saved")

    def resume(self) -> None:
        """Restore model, optimizer, RNGs, epoch and history from ``run_dir``.

        Call it on a freshly built model and trainer, then :meth:`fit` to go on to
        ``config.epochs``. Under DDP every rank calls it and loads the same checkpoint
        (rank 0's weights, optimizer state and RNG states), so ``run_dir`` must be
        readable on every machine.
        """
        if self.run_dir is None:
            raise ValueError("Trainer.resume() needs a run_dir")
        if self._fsdp:  # every rank reads the whole checkpoint and keeps its shards
            load_weights(self.run_dir, self._module, load=self._scatter_weights)
            state = load_trainer_state(self.run_dir, self.optimizer,
                                       load=self._scatter_optimizer_state)
        else:
            load_weights(self.run_dir, self._module)
            state = load_trainer_state(self.run_dir, self.optimizer)
        if state is None:
            raise CheckpointError(f"{self.run_dir}: checkpoint holds no trainer state; "
                                  "it can be loaded but not resumed")
        if self.world_size > 1 and self.device.type == "cuda" and self.device.index != 0:
            # Rank 0 saved the RNG state of every GPU as its process saw them, but only its
            # own, cuda:0, drew numbers. The ranks draw in lockstep, each on its own GPU, so
            # that state is the one this rank's GPU would have had.
            torch.cuda.set_rng_state(torch.cuda.get_rng_state(0), self.device)
        try:
            self.epoch, self.step = int(state["epoch"]), int(state["step"])
            self.history = {k: list(v) for k, v in state["history"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointError(f"{self.run_dir}: trainer state needs epoch, step and "
                                  "history") from None
        self.saved_epoch = self.epoch
        self._partial = _saved_partial(state.get("partial"), self.epoch, self.run_dir)
        if self._partial is not None and self.world_size > 1:
            # Saved by one process: its steps were that process's batches, not a shard's.
            raise CheckpointError(
                f"{self.run_dir}: the checkpoint was saved {self._partial['groups']} steps into "
                f"epoch {self.epoch + 1} by one process; resume it in one process (without "
                "torchrun) to finish that epoch, then go on under torchrun")
        self.best = _saved_best(state.get("best"), self.run_dir)
        saved = state.get("train_config") or {}
        saved_lr = saved.get("lr")  # finite and > 0: load_trainer_state checked it
        if saved_lr is not None and saved_lr != self.config.lr:
            # The optimizer state just loaded carries the old rate; this run asked for
            # another. Scale every group alike, so groups keep their ratios.
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * self.config.lr / saved_lr
        changed = [f"{k} {saved[k]} -> {getattr(self.config, k)}"
                   for k in ("seed", "lr", "clip_norm")
                   if k in saved and saved[k] != getattr(self.config, k)]
        if changed and self.is_main_process:
            self.log(f"note: resuming at epoch {self.epoch} with {', '.join(changed)}; the "
                     "run will not match an uninterrupted one")


def _local(tensor: Tensor) -> Tensor:
    """A ``DTensor``'s shard on this rank (a plain tensor is its own)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _groups(batches: Iterable[Batch], size: int) -> Iterator[list[Batch]]:
    """Consecutive lists of ``size`` batches (the last may be shorter)."""
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _saved_partial(partial: Any, epoch: int, run_dir: Path | None) -> dict[str, Any] | None:
    """The ``partial`` record of a save inside epoch ``epoch + 1``, checked; None when the
    save was at the end of an epoch."""
    if partial is None:
        return None
    kinds = {"epoch": int, "groups": int, "loss_sum": float, "tokens": int, "seconds": float}
    ok = isinstance(partial, dict) and set(partial) == set(kinds) and all(
        isinstance(partial[k], t) and not isinstance(partial[k], bool) for k, t in kinds.items())
    if not ok or partial["epoch"] != epoch or partial["groups"] < 1 or partial["tokens"] < 0 \
            or partial["seconds"] < 0 or not math.isfinite(partial["loss_sum"]):
        raise CheckpointError(f"{run_dir}: trainer state's 'partial' must describe the "
                              f"steps done in epoch {epoch + 1}, got {partial!r:.120}")
    return dict(partial)


def _saved_best(best: Any, run_dir: Path | None) -> dict[str, Any] | None:
    """The ``best`` record of a saved trainer state, checked; None when there is none."""
    if best is None:
        return None
    try:
        ok = (isinstance(best, dict) and isinstance(best.get("metric"), str)
              and isinstance(best.get("epoch"), int) and isinstance(best.get("value"), float))
    except TypeError:
        ok = False
    if not ok:
        raise CheckpointError(f"{run_dir}: trainer state's 'best' must hold metric, epoch "
                              f"and value, got {best!r:.80}")
    return dict(best)


def plot_history(history: dict[str, list], path: str | Path) -> Path:
    """Draw the per-epoch training loss (and ``valid_loss`` if present) to ``path``."""
    fig = new_figure(5, 3.5)
    ax = fig.add_subplot()
    for key, label in (("loss", "train"), ("valid_loss", "valid")):
        points = [(e, v) for e, v in zip(history["epoch"], history.get(key, []), strict=False)
                  if v is not None]
        if points:
            ax.plot(*zip(*points, strict=True), label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss per token")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=100)


def plot_progress(
    histories: Mapping[str, Mapping[str, list]], metric: str, path: str | Path, *,
    ylabel: str | None = None,
) -> Path:
    """Draw ``metric`` (a history key, e.g. ``"valid_sacrebleu"``) against the minutes
    trained, one line per history (labelled by its key), to ``path``.

    The minutes are the running sum of each epoch's ``"seconds"`` (training and
    validation, not saving), so runs of different speeds compare on time, not epochs.
    """
    if not histories:
        raise ValueError("nothing to plot: no histories given")
    fig = new_figure(6, 4)
    ax = fig.add_subplot()
    for label, history in histories.items():
        seconds, values = history.get("seconds"), history.get(metric)
        if not seconds or not values or None in seconds:
            raise ValueError(f"{label}: its history has no per-epoch 'seconds' and "
                             f"{metric!r} to plot (known: {', '.join(sorted(history))})")
        minutes = [total / 60 for total in itertools.accumulate(seconds)]
        points = [(m, v) for m, v in zip(minutes, values, strict=True) if v is not None]
        if not points:
            raise ValueError(f"{label}: no epoch recorded {metric!r}")
        ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=label)
    ax.set_xlabel("minutes of training (validation included)")
    ax.set_ylabel(ylabel or metric)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path, dpi=100)
