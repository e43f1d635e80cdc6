"""A run directory's rules, checked before a training run reads or writes anything.

- **One writer.** The saving process (rank 0) holds the directory's lock
  (:func:`qkv.training.lock.run_dir_lock`) for the whole run; a second run is refused
  with one line naming the holder.
- **No checkpoint replaced by accident.** A new run (not ``resume``) into a directory
  that holds a checkpoint, or any file a save would replace, is refused unless
  ``overwrite``; even then the old checkpoint stays, loadable, until the new run's first
  save replaces it in one step.
- **Writable before, not after, an hour of training.** The directory and every output
  file the run will write (plots) are checked up front.

:func:`qkv.training.checkpoint.describe_run_dir` says what a directory holds, read back
from disk, so that a message after an interruption or a failure states what is really
there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..utils.fileio import check_writable
from .checkpoint import checkpoint_files, checkpoint_progress, describe_run_dir
from .distributed import is_main_process
from .lock import run_dir_lock

__all__ = [
    "open_run_dir",
    "check_resume_target",
    "resumed_settings",
]

Settings = TypeVar("Settings")

@contextlib.contextmanager
def open_run_dir(
    run_dir: str | os.PathLike[str],
    *,
    resume: bool,
    overwrite: bool = False,
    outputs: Iterable[str] = (),
    log: Callable[[str], None] | None = None,
) -> Iterator[Path]:
    """Hold ``run_dir`` for one training run, after checking the rules above.

    ``outputs`` names the files (relative to ``run_dir``) the run will write besides the
    checkpoint, such as plots. On ranks other than 0 of a ``torchrun`` job, which never
    write, this only yields. Raises ``ValueError`` or ``OSError`` subclasses, each one
    line: :class:`qkv.training.lock.RunDirBusyError`, ``FileExistsError`` for a checkpoint
    a new run would replace, ``OSError`` for a location that cannot be written.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ValueError("resume and overwrite contradict each other: resume continues the "
                         f"checkpoint in {run_dir}, overwrite replaces it; choose one")
    if not is_main_process():
        yield run_dir
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"run directory {str(run_dir)!r} exists and is not a "
                                 "directory; choose another --run-dir")
    created = not run_dir.exists()
    try:
        with run_dir_lock(run_dir, log=log):
            existing = checkpoint_files(run_dir)
            if existing and not resume and not overwrite:
                raise FileExistsError(
                    f"{run_dir} already holds {describe_run_dir(run_dir)}; continue it with "
                    "--resume, or start a new run over it with --overwrite (the old "
                    "checkpoint stays until the new run saves)"
                )
            for name in outputs:
                check_writable(run_dir / name)
            yield run_dir
    finally:
        if created:  # a run that saved nothing leaves no empty directory behind
            with contextlib.suppress(OSError):
                run_dir.rmdir()


def check_resume_target(run_dir: str | os.PathLike[str], epochs: int) -> None:
    """Refuse (one-line ``ValueError``) to resume ``run_dir`` up to ``epochs`` when its
    checkpoint is already there: nothing would be trained."""
    progress = checkpoint_progress(run_dir)
    if progress is not None and epochs <= progress[0]:
        done = progress[0]
        raise ValueError(f"nothing to train: {run_dir} holds {describe_run_dir(run_dir)} "
                         f"and the target is epoch {epochs}; pass a larger total, such as "
                         f"--epochs {done + max(1, done // 2)}")


def resumed_settings(saved: Settings, given: Any) -> Settings:
    """The settings of a resumed run: ``saved`` (a settings dataclass read from the
    checkpoint) with each setting a resume may change (declared ``resumable``: the total
    epochs, the learning rate, the device, the BPE folder, and how the model computes:
    backend, dtype, compilation, distributed strategy) that ``given`` sets (not None).
    Every other setting is the run's."""
    names = [name for name, setting in saved.DECLARED.items()  # type: ignore[attr-defined]
             if setting.resumable]
    changes = {name: getattr(given, name) for name in names
               if getattr(given, name) is not None}
    return dataclasses.replace(saved, **changes)  # type: ignore[type-var]
