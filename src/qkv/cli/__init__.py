# ruff: noqa: E402 (the signal handlers come before the imports, on purpose)
"""The ``qkv`` command line: a thin shell over the library.

Each sub-command lives in its own module with two functions:
``add_parser(subparsers)`` declares its flags and ``run(args)`` does the work
by calling the library. This file wires them together and makes every failure
one line on stderr (a traceback only with ``--debug``):

- bad input (``ValueError``, ``OSError``): exit status 2;
- a training run that stopped early (Ctrl-C, SIGTERM, SIGHUP, a diverging loss) has
  already reported what is on disk: 130, 143, 129 or 1;
- anything else, a bug, the machine running out of memory or a compiled library's panic
  (a ``BaseException``; only ``SystemExit`` and ``GeneratorExit`` pass through): 1.

SIGTERM, which schedulers and ``kill`` send, and SIGHUP, which a closed terminal
sends, are handled like Ctrl-C (exit status 143 and 129). A closed
stdout or stderr (``qkv ... | head -1``) stops the output, never the work; a
stdout closed before qkv started (``>&-``) or full (``> /dev/full``) is named in
one line, and a command whose result is its output (``prints_result``) then
fails with status 2, refused before any work where it can tell. Warnings, from
qkv or any library, are one line each, cut to a bounded length.
"""

from __future__ import annotations

import os
import signal
import sys

# The signals that stop a command as Ctrl-C does (a checkpoint of the last completed
# epoch is kept): what schedulers and ``kill`` send, and a closed terminal.
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                    if hasattr(signal, name))
STOPPING = (signal.SIGINT, *TERMINATING)


def _stop_now(signum: int, _frame: object) -> None:
    """Before main() runs (its imports) and after it returns, nothing is under way that a
    stop must report or clean up: say so in one line and exit as a shell reports the
    signal (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    os.write(2, b"qkv: interrupted\n")
    os._exit(128 + signum)


def _started_as_program() -> bool:
    """Whether this import is the ``qkv`` program starting (its script, ``python -m qkv``),
    rather than a library or a test importing the module."""
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None:
        return spec.name == "qkv.__main__"
    return os.path.basename(getattr(main_module, "__file__", "") or "") == "qkv"


# First of all, before the imports below: a Ctrl-C from the program's first instant is
# one line, never a traceback from inside an import. (A signal that the process was
# started ignoring stays ignored: `nohup qkv ...` must survive its terminal closing.)
if _started_as_program():
    for _signum in STOPPING:
        if signal.getsignal(_signum) is not signal.SIG_IGN:
            signal.signal(_signum, _stop_now)

from ..utils.testing import pause_point

pause_point("cli-import")  # a test's Ctrl-C here lands among the command line's imports

import argparse
import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from .. import __version__
from . import bench, heads, lm, translate, view, walkthrough
from .runs import RunStoppedError, Terminated

# Sub-command modules, in the order ``qkv --help`` lists them.
COMMANDS = [translate, lm, view, heads, bench, walkthrough]


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2."""


class _HelpFormatter(argparse.HelpFormatter):
    """Examples keep their lines (descriptions are wrapped); a flag's help that does not
    say its default ends with it, where it has one."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if shown and action.option_strings and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the fix, and help shows defaults
    and keeps the examples' lines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qkv",
        description="Attention mechanisms: learn them, train them, look inside them.",
        epilog="examples:\n  qkv walkthrough              # self-attention step by step\n"
               "  qkv translate train          # a translator of dates, in a minute\n"
               "  qkv lm train && qkv lm generate --ckpt runs/lm --prompt \"The \"\n"
               "  qkv COMMAND --help           # each command's flags, defaults and examples",
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show full tracebacks instead of one-line errors"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


# What _OutputGuard.lost says when the reader of a pipe went away (`| head -1`).
READER_LEFT = "was closed"


class _OutputGuard:
    """A text stream whose reader may go away, or that cannot be written: then output is
    dropped, work goes on, and ``lost`` says why.

    ``qkv translate train | head -1`` closes the pipe after one line; the next write
    would raise ``BrokenPipeError`` in the middle of training. A stdout that is full
    (``> /dev/full``, a full disk) raises another ``OSError``; one closed before qkv
    started (``>&-``) is ``None`` in Python. In each case the stream's file descriptor
    is pointed at ``/dev/null`` (so that the final flush at exit, and anything a library
    writes to the descriptor, goes nowhere and never into a file that took its number)
    and ``lost`` says what happened, in words that follow "stdout": ``"was closed"``
    (by its reader: :data:`READER_LEFT`), ``"was closed before qkv started"`` or
    ``"could not be written (No space left on device)"``.
    """

    def __init__(self, stream: TextIO | None, fd: int) -> None:
        self.lost: str | None = None
        if stream is None:
            try:
                os.fstat(fd)  # open after all: something else took the number; leave it be
            except OSError:
                _point_at_devnull(fd)
            stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (for the process)
            self.lost = "was closed before qkv started"
        self.stream = stream

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                self.stream.write(text)
            except OSError as e:
                self._lose(e)
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except OSError as e:
                self._lose(e)

    def _lose(self, error: OSError) -> None:
        self.lost = (READER_LEFT if isinstance(error, BrokenPipeError)
                     else f"could not be written ({error.strerror or error})")
        with contextlib.suppress(OSError, ValueError):
            _point_at_devnull(self.stream.fileno())

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def _point_at_devnull(fd: int) -> None:
    """Make ``fd`` write to ``/dev/null``, whether it is open or closed."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    if devnull != fd:
        os.dup2(devnull, fd)
        os.close(devnull)


def _raise_stop(signum: int, _frame: object) -> None:
    """While main() runs: Ctrl-C is a ``KeyboardInterrupt``, SIGTERM and SIGHUP are
    :class:`Terminated`, so that a training run saves and reports what is on disk."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signal.Signals(signum).name)


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """Within the block, the stopping signals raise (:func:`_raise_stop`); after it, the
    program stops at once (:func:`_stop_now`), and a library caller gets its own handlers
    back. Only the main thread can handle signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    program = _started_as_program()
    # A signal the process was started ignoring stays ignored.
    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOPPING
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, _stop_now if program else handler)


@contextlib.contextmanager
def _guarded_output() -> Iterator[_OutputGuard]:
    """stdout and stderr survive a closed pipe, a full disk or being closed from the
    start."""
    out, err = _OutputGuard(sys.stdout, 1), _OutputGuard(sys.stderr, 2)
    previous_streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield out
    finally:
        with contextlib.suppress(Exception):
            out.flush()
            err.flush()
        sys.stdout, sys.stderr = previous_streams


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``qkv`` command line on ``argv`` (default: ``sys.argv[1:]``); the exit
    status. A Ctrl-C at any moment, from the parsing of the flags to the last line of
    output, is one line on stderr and status 130 (SIGTERM: 143, SIGHUP: 129)."""
    with _stop_signals_raise():
        try:
            return _main(argv)
        except KeyboardInterrupt as stop:  # outside a command: nothing ran to report on
            print("qkv: interrupted", file=sys.stderr)
            return stop.exit_code if isinstance(stop, Terminated) else 130


def _main(argv: Sequence[str] | None) -> int:
    pause_point("cli-start")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    with _guarded_output() as out:
        where = f"qkv {args.command}"
        # Commands whose product is what they print (a translation, generated text).
        printing = getattr(args, "prints_result", False)
        if out.lost and printing:  # refused before any work
            print(f"{where}: error: stdout {out.lost}, so the output would be lost; "
                  "redirect it to a file (or to /dev/null)", file=sys.stderr)
            return 2
        code = _run(args)
        out.flush()  # a full stdout shows itself here at the latest
        if out.lost is None:
            return code
        if getattr(args, "action", None) == "train":
            print(f"{where} train: stdout {out.lost}, so output stopped; training ran "
                  "on to the end", file=sys.stderr)
        elif out.lost == READER_LEFT:  # `| head`: the reader wanted no more
            pass
        elif printing:
            print(f"{where}: error: stdout {out.lost}; the output is lost", file=sys.stderr)
            code = code or 2
        else:  # the product is a file; what was printed only described it
            print(f"{where}: stdout {out.lost}; its messages are lost", file=sys.stderr)
        return code


# The longest warning qkv repeats: a library may quote a whole input in one (a 10,000-
# character sentence); the start says what the warning is about.
MAX_WARNING_CHARS = 200


@contextlib.contextmanager
def _warnings_in_one_line(where: str) -> Iterator[None]:
    """Every warning raised in the block (qkv's, torch's, any library's) as one line of
    qkv's own on stderr: at most :data:`MAX_WARNING_CHARS` of its text, each text once."""
    seen: set[str] = set()

    def say(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            file: TextIO | None = None, line: str | None = None) -> None:
        text = " ".join(str(message).splitlines())
        if len(text) > MAX_WARNING_CHARS:
            text = f"{text[:MAX_WARNING_CHARS]}... ({len(text):,} characters in all)"
        if text not in seen:
            seen.add(text)
            print(f"{where}: warning: {text}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = say
        yield


def _run(args: argparse.Namespace) -> int:
    where = f"qkv {args.command}"
    try:
        with _warnings_in_one_line(where):
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
    except (SystemExit, GeneratorExit):  # the program's own way out: not a failure
        raise
    except BaseException as e:  # a bug, the machine out of memory, a library's panic
        # (pyo3's PanicException derives from BaseException, not Exception)
        if args.debug:
            raise
        kind = "out of memory" if isinstance(e, MemoryError) else type(e).__name__
        print(f"{where}: error: {kind}: {_one_line(e)} (rerun with --debug for the "
              "traceback)", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    # However the library that raised it wrote it; quoted values keep their spaces.
    return " ".join(str(error).splitlines())
