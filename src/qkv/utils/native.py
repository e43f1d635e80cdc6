"""Calls into compiled libraries whose failures must stay one line: a panic included.

Hugging Face's ``tokenizers`` and ``safetensors`` are written in Rust. A panic inside
them (Oniguruma giving up on a regular expression of a downloaded ``tokenizer.json``
that backtracks without end, say) reaches Python as pyo3's ``PanicException``, which
derives from ``BaseException``: an ``except Exception`` lets it through. And before it
is raised, Rust's panic hook has already written its report to the process's stderr
(file descriptor 2): two lines, or with ``RUST_BACKTRACE`` set a backtrace of thirty.

:func:`library_call` runs a block of such calls so that a panic comes out as
:class:`LibraryPanic`, an ``Exception`` that the caller's usual handler turns into its
own one-line error, and its report never reaches the terminal: while the block runs,
descriptor 2 points at a scratch file, which is copied to the real stderr afterwards
unless a panic wrote it.

    with library_call():
        ids = backend.encode(text).ids     # a panic: LibraryPanic("Onig: ...")

The blocks of all threads take turns (a lock), so that each restores the stderr it
found. What another thread writes to stderr during a block is held back until the block
ends, and lost if the block panicked.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

__all__ = ["STOPPING", "LibraryPanic", "library_call"]

# What stops the program rather than reports a failure: never turned into an error.
STOPPING = (KeyboardInterrupt, SystemExit, GeneratorExit)


class LibraryPanic(Exception):  # noqa: N818 (named for what happened, as Rust names it)
    """A compiled library panicked (pyo3's ``PanicException``, or any ``BaseException``
    that is not one of :data:`STOPPING`); the message is the panic's, on one line."""


class _Redirect:
    """Descriptor 2 pointed at a scratch file for the outermost block of the thread
    holding the lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.panicked = False
        self.scratch: int | None = None

    def start(self) -> int | None:
        """Point descriptor 2 at the scratch file; the descriptor of the real stderr
        (None when there is none: stderr closed, nothing to keep a report from)."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()  # what Python holds for stderr goes out before, to it
        try:
            saved = os.dup(2)
        except OSError:
            return None
        try:
            if self.scratch is None:
                with tempfile.TemporaryFile() as f:  # its descriptor outlives the object
                    self.scratch = os.dup(f.fileno())
            os.dup2(self.scratch, 2)
        except OSError:
            os.close(saved)
            return None
        return saved

    def stop(self, saved: int, keep: bool) -> None:
        """Give descriptor 2 back; copy to it what was written meanwhile if ``keep``."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        scratch = self.scratch
        assert scratch is not None
        with contextlib.suppress(OSError):
            if os.fstat(scratch).st_size:
                os.lseek(scratch, 0, os.SEEK_SET)
                while keep and (chunk := os.read(scratch, 65536)):
                    os.write(2, chunk)
                os.ftruncate(scratch, 0)
            os.lseek(scratch, 0, os.SEEK_SET)


_redirect = _Redirect()


@contextlib.contextmanager
def library_call() -> Iterator[None]:
    """Run the block's library calls with a panic raised as :class:`LibraryPanic` and
    its report to stderr dropped. Blocks nest; the outermost one holds stderr."""
    state = _redirect
    with state.lock:
        saved = state.start() if state.depth == 0 else None
        if state.depth == 0:
            state.panicked = False
        state.depth += 1
        try:
            yield
        except STOPPING:
            raise
        except Exception:
            raise
        except BaseException as panic:
            state.panicked = True
            text = " ".join(str(panic).split()) or type(panic).__name__
            raise LibraryPanic(text) from None
        finally:
            state.depth -= 1
            if saved is not None:
                state.stop(saved, keep=not state.panicked)
