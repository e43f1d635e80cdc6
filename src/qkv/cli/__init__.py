"""The ``qkv`` command line: a thin shell over the library.

Each sub-command lives in its own module with two functions:
``add_parser(subparsers)`` declares its flags and ``run(args)`` does the work
by calling the library. This file wires them together and makes every failure
one line on stderr (a traceback only with ``--debug``):

- bad input (``ValueError``, ``OSError``): exit status 2;
- a training run that stopped early (Ctrl-C, SIGTERM, SIGHUP, a diverging loss) has
  already reported what is on disk: 130, 143, 129 or 1;
- anything else, a bug or the machine running out of memory: 1.

SIGTERM, which schedulers and ``kill`` send, and SIGHUP, which a closed terminal
sends, are handled like Ctrl-C (exit status 143 and 129). A closed
stdout or stderr (``qkv ... | head -1``) stops the output, never the work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from .. import __version__
from . import bench, lm, translate, view, walkthrough
from .runs import RunStoppedError, Terminated

# The signals that stop a command as Ctrl-C does (a checkpoint of the last completed
# epoch is kept): what schedulers and ``kill`` send, and a closed terminal.
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                    if hasattr(signal, name))

# Sub-command modules, in the order ``qkv --help`` lists them.
COMMANDS = [translate, lm, view, bench, walkthrough]


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the fix."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qkv",
        description="Attention mechanisms: learn them, train them, look inside them.",
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show full tracebacks instead of one-line errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


class _OutputGuard:
    """A text stream whose reader may go away: then output is dropped, work goes on.

    ``qkv translate train | head -1`` closes the pipe after one line; the next write
    would raise ``BrokenPipeError`` in the middle of training. Instead the stream's
    file descriptor is pointed at ``/dev/null`` (so that the final flush at exit is
    quiet too) and ``lost`` is set.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _guarded_process() -> Iterator[_OutputGuard]:
    """SIGTERM and SIGHUP raise :class:`Terminated`; stdout and stderr survive a closed
    pipe."""
    out, err = _OutputGuard(sys.stdout), _OutputGuard(sys.stderr)
    previous_streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, _terminate)
                for signum in TERMINATING if main_thread}
    try:
        yield out
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        with contextlib.suppress(Exception):
            out.flush()
            err.flush()
        sys.stdout, sys.stderr = previous_streams


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    with _guarded_process() as out:
        code = _run(args)
        if out.lost and getattr(args, "action", None) == "train":
            print(f"qkv {args.command} train: stdout was closed, so output stopped; "
                  "training ran on to the end", file=sys.stderr)
        return code


def _run(args: argparse.Namespace) -> int:
    where = f"qkv {args.command}"
    try:
        return args.run(args) or 0
    except RunStoppedError as stopped:  # already reported, in one line
        return stopped.code
    except KeyboardInterrupt as stop:
        print(f"{where}: interrupted", file=sys.stderr)
        return stop.exit_code if isinstance(stop, Terminated) else 130
    except (UsageError, ValueError, OSError) as e:
        if args.debug:
            raise
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, or the machine ran out of memory
        if args.debug:
            raise
        kind = "out of memory" if isinstance(e, MemoryError) else type(e).__name__
        print(f"{where}: error: {kind}: {_one_line(e)} (rerun with --debug for the "
              "traceback)", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    # However the library that raised it wrote it; quoted values keep their spaces.
    return " ".join(str(error).splitlines())
