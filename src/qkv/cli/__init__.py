"""The ``qkv`` command line: a thin shell over the library.

Each sub-command lives in its own module with two functions:
``add_parser(subparsers)`` declares its flags and ``run(args)`` does the work
by calling the library. This file wires them together and turns user errors
into one line on stderr and exit status 2 (a traceback only with ``--debug``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from . import bench, lm, translate, walkthrough

# Sub-command modules, in the order ``qkv --help`` lists them.
COMMANDS = [translate, lm, bench, walkthrough]


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args) or 0
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130
    except (UsageError, ValueError, FileNotFoundError, OSError) as e:
        if args.debug:
            raise
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2
