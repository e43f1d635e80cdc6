"""The skeleton every task's training run shares, step by step, with what each guarantees.

A task (:mod:`.translate`, :mod:`.lm`) brings its settings, its data, its model and its
loss; this module runs them the same way for both:

    with training_run(run_dir, settings.device, resume=resume, overwrite=overwrite,
                      outputs=(LOSS_PLOT,), log=log) as log:
        saved = ... if resume else None                        # from the config.json
        settings = run_settings(settings, saved, run_dir)      # resolved, seeded
        ...                                                    # the task's data
        check_training_memory(...)                             # before the model exists
        model = ...                                            # the task's model
        module, history = fit(model, loss_fn, train_set, settings, ...)

and a task's ``config.json`` is read back (to evaluate, load or resume a run) with
:func:`read_run_config` and :func:`check_model_config`, which turn anything malformed
into one :class:`qkv.training.CheckpointError` line naming the file and the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset

from ..checks import show
from ..options import TRAINING
from ..training import (
    SAVE_EVERY_MINUTES,
    TRAIN_BYTES_PER_PARAMETER,
    CheckpointError,
    EarlyStopping,
    LRSchedule,
    TrainConfig,
    Trainer,
    check_memory,
    check_resume_target,
    format_bytes,
    init_distributed,
    load_config,
    main_process_log,
    make_loader,
    open_run_dir,
    resolve_device,
    resumed_settings,
    seed_everything,
)

__all__ = [
    "RunConfig",
    "TaskSettings",
    "check_model_config",
    "check_training_memory",
    "fit",
    "read_run_config",
    "run_settings",
    "train_config",
    "training_run",
]


class TaskSettings(Protocol):
    """What the skeleton reads of a task's settings dataclass (resolved: no None left in
    the :data:`qkv.options.TRAINING` settings it has)."""

    epochs: Any
    lr: Any
    clip_norm: float | None
    batch_size: int
    warmup_steps: int
    decay: str
    patience: int
    seed: int
    device: str

    def resolved(self) -> Any: ...


S = TypeVar("S", bound=TaskSettings)


# ----------------------------------------------------------------------------
# Starting a run


@contextlib.contextmanager
def training_run(
    run_dir: Path,
    device: str,
    *,
    resume: bool,
    overwrite: bool,
    outputs: Iterable[str],
    log: Callable[[str], None] | None,
) -> Iterator[Callable[[str], None]]:
    """Join ``torchrun``'s process group (if any), then hold ``run_dir`` for one run.

    Guarantees, in this order: the process group is joined before anything logs or
    touches a device (every rank then agrees on who is rank 0); the log yielded prints on
    rank 0 only; ``run_dir`` obeys :func:`qkv.training.open_run_dir`'s rules (one writer,
    no checkpoint replaced unless ``overwrite``, ``outputs`` writable) for as long as the
    block runs, and an empty directory this run created is removed if it saved nothing.
    """
    init_distributed(device)
    log = main_process_log(log)
    with open_run_dir(run_dir, resume=resume, overwrite=overwrite, outputs=outputs, log=log):
        yield log


def run_settings(given: S, saved: S | None, run_dir: Path) -> S:
    """The resolved settings of this run, with every random generator seeded from them.

    A new run (``saved`` None) is ``given``, resolved. A resume is the ``saved`` settings
    with only what a resume may change taken from ``given`` (see
    :func:`qkv.training.resumed_settings`), and it is refused in one line when the
    checkpoint already reached the target epoch: nothing would be trained.
    """
    settings = given if saved is None else resumed_settings(saved, given)
    settings = settings.resolved()
    if saved is not None:
        check_resume_target(run_dir, settings.epochs)
    seed_everything(settings.seed)
    return settings


def check_training_memory(
    what: str,
    num_parameters: int,
    *,
    optimizer: str,
    device: str,
    hint: str,
    activation_bytes: int = 0,
    buffer_bytes: int = 0,
) -> None:
    """Refuse, before a byte of it is allocated, a model whose training cannot fit.

    ``what`` names the model (and the batches) in the one-line
    :class:`qkv.training.InsufficientMemoryError`; ``hint`` says which flags make it
    smaller. Counted: :data:`TRAIN_BYTES_PER_PARAMETER` per parameter (float32 weights,
    gradients and ``optimizer``'s two moments), plus the activations a training batch
    keeps for backward and the model's buffers (both in bytes, from its config).
    """
    detail = (f"{TRAIN_BYTES_PER_PARAMETER} bytes per parameter for float32 weights, "
              f"gradients and {optimizer}'s two moments")
    if activation_bytes:
        detail += f", and {format_bytes(activation_bytes)} of activations"
    check_memory(
        TRAIN_BYTES_PER_PARAMETER * num_parameters + activation_bytes + buffer_bytes,
        f"training {what} ({detail})",
        hint=hint,
        device=resolve_device(device),
    )


# ----------------------------------------------------------------------------
# Reading a run's config.json back


@dataclass
class RunConfig:
    """A task's ``config.json`` whose sections are exactly the task's (see
    :func:`read_run_config`); :meth:`parse` builds each one."""

    path: Path
    sections: dict[str, Any]

    def parse(self, section: str, build: Callable[[Any], Any]) -> Any:
        """``build(section's JSON)``; its one-line ``TypeError`` or ``ValueError`` becomes
        a ``CheckpointError`` naming the file and the section."""
        try:
            return build(self.sections[section])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: {section}: {e}") from None


def read_run_config(
    run_dir: str | Path, *, task: str, sections: tuple[str, ...], what: str
) -> RunConfig:
    """``run_dir``'s ``config.json``, checked to be ``task``'s and to have ``sections``.

    Guarantees: the manifest and the file's digest were checked and the JSON parsed
    within bounds (:func:`qkv.training.load_config`); the file holds a ``task``
    checkpoint; it has every one of ``sections`` and nothing else, else one
    ``CheckpointError`` line naming the first unknown or missing section and listing
    ``what`` (e.g. "a translator") has.
    """
    config = load_config(run_dir, task=task)
    path = Path(run_dir) / "config.json"
    unknown = sorted(set(config) - set(sections))
    missing = [name for name in sections if name not in config]
    if unknown or missing:
        problem = f"unknown section {show(unknown[0])}" if unknown else f"no {missing[0]!r}"
        raise CheckpointError(f"{path} has {problem}; {what}'s config has "
                              f"{', '.join(sections)}")
    return RunConfig(path, config)


def check_model_config(path: Path, saved: Any, implied: Any, *, ignore: Iterable[str] = ()
                       ) -> None:
    """Refuse a saved model config that differs from the one its settings imply.

    Training built the model from the settings, and resuming builds it again from them:
    a difference means the file was edited, so the first differing field (a dataclass
    field of both configs, except those in ``ignore``) is one ``CheckpointError`` line.
    """
    skipped = set(ignore)
    for f in dataclasses.fields(saved):
        if f.name in skipped:
            continue
        value, expected = getattr(saved, f.name), getattr(implied, f.name)
        if value != expected:
            raise CheckpointError(f"{path}: model.{f.name} is {show(value)} but the settings "
                                  f"imply {show(expected)}")


# ----------------------------------------------------------------------------
# Training


def fit(
    model: nn.Module,
    loss_fn: Callable[..., Any],
    train_set: Dataset,
    settings: TaskSettings,
    *,
    task: str,
    run_dir: Path,
    resume: bool,
    sections: Mapping[str, Any],
    progress: bool,
    log: Callable[[str], None],
    log_every: int,
    drop_last: bool = False,
    optimizer: torch.optim.Optimizer | Callable[[nn.Module], torch.optim.Optimizer]
    | None = None,
    validate: Callable[[nn.Module], dict[str, float]] | None = None,
    flops_per_token: float | None = None,
    epoch_samples: int | None = None,
    checkpoint_every: int = 0,
    save_every: float = SAVE_EVERY_MINUTES,
) -> tuple[nn.Module, dict[str, list]]:
    """Train ``model`` to ``settings.epochs``, checkpointing to ``run_dir``.

    ``settings`` are the run's, resolved: the trainer's configuration is made of them
    (:func:`train_config`), and the checkpoint's ``config.json`` is ``{"task": task,
    "settings": settings as a dict, **sections}``, the sections the task's config reader
    expects. ``loss_fn(model, batch) -> (loss_sum, num_tokens)`` on batches of
    ``train_set`` (``settings.batch_size`` per process: this process's shard under
    torchrun, a seeded shuffle otherwise). With ``resume`` the weights, optimizer, random
    state and history come from ``run_dir``'s checkpoint first. Returns the trained
    model, unwrapped from DDP, and the history (see :meth:`qkv.training.Trainer.fit`).
    ``validate`` scores the model after each epoch; with it, ``settings.patience`` > 0
    stops early and the model returned holds the best weights. ``epoch_samples`` (all
    processes together) makes each epoch that many samples drawn at random, rather than
    ``train_set`` once (see :func:`qkv.training.make_loader`). The other arguments are
    :class:`qkv.training.TrainConfig`'s loop settings.
    """
    config = train_config(settings, early_stopping=validate is not None, log_every=log_every,
                          progress=progress, flops_per_token=flops_per_token,
                          checkpoint_every=checkpoint_every, save_every=save_every)
    trainer = Trainer(
        model,
        loss_fn,
        lambda g: make_loader(train_set, settings.batch_size, g, drop_last=drop_last,
                              samples=epoch_samples),
        config,
        run_dir=run_dir,
        checkpoint_config={"task": task, "settings": dataclasses.asdict(settings), **sections},
        optimizer=optimizer,
        validate=validate,
        log=log,
    )
    if resume:
        trainer.resume()
    history = trainer.fit()
    return trainer.module, history


# The settings of a run that are the trainer's own, as they are: TrainConfig's fields
# that qkv.options.TRAINING declares (a task without one, such as the translator's
# strategy, leaves TrainConfig's default).
TRAINED = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name in TRAINING)


def train_config(settings: Any, *, early_stopping: bool, **loop: Any) -> TrainConfig:
    """The trainer's configuration for a run's resolved ``settings``: its
    :data:`TRAINED` settings, the learning-rate schedule of ``warmup_steps`` and
    ``decay``, and early stopping on the held-out loss after ``patience`` epochs without
    a better one (when there is a held-out set, ``early_stopping``); ``loop`` sets the
    loop's own settings (:data:`qkv.options.LOOP`)."""
    return TrainConfig(
        **{name: getattr(settings, name) for name in TRAINED if hasattr(settings, name)},
        schedule=LRSchedule(warmup_steps=settings.warmup_steps, decay=settings.decay),
        early_stopping=EarlyStopping("valid_loss", patience=settings.patience)
        if settings.patience and early_stopping else None,
        **loop,
    )
