"""What ``qkv translate train`` and ``qkv lm train`` share: the rules of ``--resume`` and
an honest report when a run stops early.

- The settings flags come from the settings' declarations (:func:`add_settings_flags`)
  and default to None, so a flag the user gave can be told from one left alone: a new
  run fills the rest from the settings' own defaults, and a resume takes the run's saved
  settings and refuses a flag that would change one of them, except those declared
  ``resumable`` (the total ``--epochs``, ``--lr``, ``--device``, ``--bpe-dir``,
  ``--backend``, ``--dtype``, ``--compile`` and ``--strategy``).
- When a run stops (Ctrl-C, SIGTERM, SIGHUP, a diverging loss) the message says what the run
  directory holds, read back from disk, and the exact command that continues it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..options import SAVE_EVERY_MINUTES, Setting, check_save_every


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers and ``kill`` send) or SIGHUP (a closed terminal, a lost
    SSH session), handled like Ctrl-C; ``Terminated("SIGHUP")`` names the signal."""

    @property
    def signal_name(self) -> str:
        return str(self.args[0]) if self.args else "SIGTERM"

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process it killed."""
        return 128 + signal.Signals[self.signal_name].value


class RunStoppedError(Exception):
    """A training run stopped early and said why; ``code`` is the exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """The flags both training commands take for their run directory and output:
    ``--resume``, ``--overwrite``, ``--no-progress``."""
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --run-dir (to its own target, or --epochs)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start a new run in a --run-dir that holds a checkpoint (kept "
                             "until the new run saves)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (default: one on stderr)")


def add_save_every(parser: argparse.ArgumentParser) -> None:
    """The ``--save-every MINUTES`` flag of both training commands."""
    def minutes(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected minutes (a number), got {text!r}") from None
        try:
            return check_save_every(value, "--save-every")
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parser.add_argument(
        "--save-every", type=minutes, default=SAVE_EVERY_MINUTES, metavar="MINUTES",
        help="save a checkpoint at the end of the first epoch that finishes this many "
             f"minutes after the last save (default: {SAVE_EVERY_MINUTES:g}; 0: after every "
             "epoch), so that a kill loses at most that much; a run expected to last more "
             "than a few minutes also saves its first epoch, and the end is always saved")


def show_value(value: Any) -> str:
    """A default as help shows it: ``on``/``off`` for booleans, numbers as written."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_settings_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting],
                       default_text: Callable[[Setting], str],
                       defaults: Mapping[str, Any] | None = None) -> dict[str, str]:
    """A flag for each of ``settings`` that has one, with its help from the declaration:
    what it does, its valid values and ``default_text(setting)``; returns ``{settings
    field: argparse destination}`` for :func:`given_settings`.

    A flag defaults to None (``defaults`` names the exceptions), so that a new run can tell
    a flag the user gave from one left to the settings' defaults, and a resume from one
    left to the run's own."""
    destinations = {}
    for setting in settings:
        if not setting.flag_name:
            continue
        valid = setting.describe()
        default = default_text(setting)
        if setting.resumable and setting.name not in ("device", "bpe_dir"):
            default += "; with --resume, the run's own"
        text = f"{setting.help}{'; ' + valid if valid else ''} (default: {default})"
        kwargs: dict[str, Any] = {"default": (defaults or {}).get(setting.name),
                                  "help": text.replace("%", "%%")}
        if setting.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _flag_type(setting)
            kwargs["choices"] = setting.choices
            kwargs["metavar"] = setting.metavar
        action = parser.add_argument(setting.flag_name, *setting.aliases, **kwargs)
        destinations[setting.name] = action.dest
    return destinations


def _flag_type(setting: Setting) -> Callable[[str], Any]:
    """The flag's text to a value; a parse error is argparse's one line."""
    if setting.parse is None:
        return setting.kind

    def parse(text: str) -> Any:
        try:
            return setting.parse(text)  # type: ignore[misc]
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def given_settings(args: argparse.Namespace, flags: Mapping[str, str]) -> dict[str, Any]:
    """``{settings field: value}`` for the flags the user gave; ``flags`` maps each
    settings field to its argparse destination (flags that default to None)."""
    return {field: getattr(args, dest) for field, dest in flags.items()
            if getattr(args, dest) is not None}


def _same(field: str, given: Any, saved: Any) -> bool:
    if field in ("data", "text") and isinstance(saved, str) and isinstance(given, str):
        # The same file, however the path is spelled.
        with contextlib.suppress(OSError):
            return given == saved or os.path.samefile(given, saved)
    return given == saved


def check_resume_flags(run_dir: Path, task: str, given: Mapping[str, Any],
                       flags: Mapping[str, str], declared: Mapping[str, Setting]) -> None:
    """Refuse flags that a resume of ``run_dir`` would otherwise silently ignore: those of
    the ``declared`` settings a resume may not change."""
    from ..training import load_config
    from ..training.lock import busy_error, running_holder

    try:
        config = load_config(run_dir, task=task)
    except ValueError:
        holder = running_holder(run_dir)
        if holder is not None:  # mid-way through its first save: say who, not "missing"
            raise busy_error(run_dir, holder) from None
        raise
    saved = config.get("settings")
    saved = saved if isinstance(saved, dict) else {}
    changed = [f"--{flags[field].replace('_', '-')} {value} (the run has {saved.get(field)})"
               for field, value in given.items()
               if not declared[field].resumable and not _same(field, value, saved.get(field))]
    if changed:
        raise ValueError(f"--resume continues {run_dir} as it was set up, so "
                         f"{'; '.join(changed)} cannot change; drop "
                         f"{'it' if len(changed) == 1 else 'them'}, or start a new run "
                         "with --overwrite")


def resume_command(task: str, run_dir: Path, args: argparse.Namespace, **extra: Any) -> str:
    """The command that continues the run in ``run_dir`` with this process's options."""
    words = ["qkv", task, "train", "--run-dir", str(run_dir), "--resume"]
    if args.device not in (None, "auto"):
        words += ["--device", args.device]
    if getattr(args, "threads", None) is not None:
        words += ["--threads", str(args.threads)]
    if getattr(args, "save_every", SAVE_EVERY_MINUTES) != SAVE_EVERY_MINUTES:
        words += ["--save-every", f"{args.save_every:g}"]
    for flag, value in extra.items():
        words += [f"--{flag.replace('_', '-')}", str(value)]
    return shlex.join(words)


def _manifest(run_dir: Path) -> bytes | None:
    """The manifest's bytes, to tell whether this run saved; None when there is no
    readable one (a FIFO there is not read: it would block)."""
    from ..training.checkpoint import MANIFEST, MAX_MANIFEST_BYTES
    from ..utils.fileio import read_regular

    try:
        return read_regular(run_dir / MANIFEST, "checkpoint manifest", MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return None


def _resumable(run_dir: Path) -> bool:
    """True if ``run_dir`` holds a checkpoint that ``--resume`` can take further."""
    from ..training import checkpoint_progress

    try:
        progress = checkpoint_progress(run_dir)
    except ValueError:
        return False
    return progress is not None and (progress[1] is None or progress[0] < progress[1])


def _rerun_command() -> str:
    return shlex.join(["qkv", *sys.argv[1:]])


@contextlib.contextmanager
def reporting_stops(task: str, run_dir: Path, args: argparse.Namespace) -> Iterator[None]:
    """Turn an interrupted or diverged run into a truthful report and :class:`RunStoppedError`.

    The report reads the run directory back from disk: whether this run saved anything
    (its manifest changed), what the directory holds now, and the command to go on.
    """
    from ..training import TrainingDivergedError, describe_run_dir, is_main_process

    before = _manifest(run_dir)
    try:
        yield
    except (KeyboardInterrupt, TrainingDivergedError) as stop:
        interrupted = isinstance(stop, KeyboardInterrupt)
        code = (stop.exit_code if isinstance(stop, Terminated) else 130) if interrupted else 1
        if not is_main_process():  # rank 0 reports for everyone
            raise RunStoppedError(code) from None
        if interrupted:
            head = f"interrupted ({stop.signal_name if isinstance(stop, Terminated) else 'Ctrl-C'})"
            extra: dict[str, Any] = {}
        else:
            head = f"error: {stop}"
            extra = {"lr": f"{stop.lr / 2:g}"}
        after = _manifest(run_dir)
        saved = after is not None and after != before
        if saved:
            state = f"{run_dir} holds {describe_run_dir(run_dir)}"
        elif before is not None:
            state = f"this run saved nothing; {run_dir} still holds {describe_run_dir(run_dir)}"
        else:
            state = f"no epoch had completed, so nothing was saved ({run_dir} holds no checkpoint)"
        if not saved and (before is None or getattr(args, "overwrite", False)):
            smaller = "" if interrupted else " with a smaller --lr"
            advice = f"; start again{smaller}: {_rerun_command()}"
        elif _resumable(run_dir):
            how = "with" if interrupted else "with a smaller lr"
            advice = f"; continue {how}: {resume_command(task, run_dir, args, **extra)}"
        else:
            advice = ""
        print(f"qkv {task} train: {head}; {state}{advice}", file=sys.stderr)
        raise RunStoppedError(code) from None
