"""Writing files so that nothing is ever half-written.

Every file qkv writes (checkpoints, configurations, figures, benchmark results) goes
through :func:`write_atomic`: readers see the old file or the new one, whole, even if
the process dies mid-write. A process killed mid-write (SIGKILL, power loss) can leave
its temporary file behind; :func:`remove_stale_temp_files` clears those.

:func:`deferred_signals` holds Ctrl-C and SIGTERM back while a multi-file write runs,
and :func:`check_writable` tells, before an hour of training, whether a file can be
written at all.

Files the user names as inputs (a corpus, a text, a checkpoint's files) are opened with
:func:`open_regular`: what the path is, and its size, are known before a byte is read, so a
FIFO (which would block forever), ``/dev/zero`` (which never ends) or a directory is
refused in one line saying what it is, and a caller can refuse a file too large for memory
before reading it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import re
import secrets
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

# What a file write takes: bytes, or a view of them (a tensor's, a NumPy array's).
Buffer = bytes | bytearray | memoryview

__all__ = [
    "write_atomic",
    "temp_path",
    "write_durable",
    "fsync_dir",
    "remove_stale_temp_files",
    "deferred_signals",
    "check_writable",
    "process_alive",
    "NotRegularFileError",
    "file_kind",
    "regular_file_stat",
    "open_regular",
    "FileTooLargeError",
    "read_regular",
]

# write_atomic's temporary names: ".{name}.{pid}.{8 hex digits}.tmp".
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make renames inside ``path`` durable (POSIX; Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike[str], data: Buffer | Iterable[Buffer]) -> str:
    """Write ``data`` (bytes, or buffers written one after the other: views of large
    tensors need no copy) to ``path`` and fsync it (not atomic by itself). Returns the
    SHA-256 of what was written, hashed beside the write (another thread: hashlib and
    file writes both release the GIL) rather than read back."""
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        digest = pool.submit(_sha256, chunks)
        with open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return digest.result()


def _sha256(chunks: Iterable[Buffer]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def temp_path(path: str | os.PathLike[str]) -> Path:
    """A fresh temporary name beside ``path``, for writing it whole and then renaming:
    one that :func:`remove_stale_temp_files` clears if this process dies first."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole.

    The bytes go to a temporary file in the same directory (a rename is only atomic
    within one filesystem), are fsync'ed, and the temporary file replaces ``path``.
    Missing parent directories are created. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def process_alive(pid: int) -> bool:
    """True if a process ``pid`` runs on this host (this one included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, but another user's (or the question cannot be asked)
        return True
    return True


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files that killed :func:`write_atomic` calls left in ``directory``.

    Only regular files named as :func:`write_atomic` names them, whose writing process is
    gone, are removed: a file of another name, a symlink, or the temporary file of a write
    still in progress (in this or another live process) stays. Returns what was removed.
    """
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(directory):
            match = _TEMP_NAME.match(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            if process_alive(int(match["pid"])):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


# Signals whose default effect would cut a multi-file write short.
_DEFERRED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                  if hasattr(signal, name))


@contextlib.contextmanager
def deferred_signals(
    on_deferred: Callable[[int], None] | None = None,
) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back until the ``with`` block ends, then deliver
    them.

    For a write that must not stop halfway (a checkpoint of several files): a Ctrl-C
    during the block waits for it; each signal that arrived is then re-raised once, in
    order, under the handlers that were installed before the block (so Ctrl-C becomes a
    ``KeyboardInterrupt`` right after the write, and SIGTERM does whatever it did).
    ``on_deferred(signum)`` is called when a signal arrives, to tell the user it will
    wait. Only the main thread can handle signals; elsewhere the block runs
    unprotected, as Python allows nothing else.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        received.append(signum)
        if on_deferred is not None:
            on_deferred(signum)

    previous = {}
    try:
        for signum in _DEFERRED:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # ignored stays ignored
                previous[signum] = signal.signal(signum, hold)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(received):  # once each, in arrival order
        signal.raise_signal(signum)


def check_writable(path: str | os.PathLike[str], *, directory: bool = False) -> Path:
    """Raise a one-line ``OSError`` unless ``path`` can be written (created if need be).

    With ``directory=True``, ``path`` is a directory that files will be written into;
    otherwise a file. Missing parent directories are created, as the writer would. A
    probe file is created and removed, which catches read-only mounts and permissions
    that ``os.access`` misjudges (root, ACLs). Returns ``path``.
    """
    path = Path(path)
    folder = path if directory else path.parent
    if not directory and path.is_dir():
        raise IsADirectoryError(f"cannot write {str(path)!r}: it is a directory; "
                                "name a file instead")
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"cannot write into {str(folder)!r}: it exists and is "
                                 "not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".qkv-write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise OSError(f"cannot write into {str(folder)!r}: {reason}; "
                      "choose a writable location") from None
    return path


# ----------------------------------------------------------------------------
# Reading inputs


class NotRegularFileError(OSError, ValueError):
    """An input path that exists but is not a regular file (a directory, a FIFO, a
    device, ...): bad input, whether the caller catches it as an ``OSError`` or as a
    ``ValueError``. ``kind`` says what it is (:func:`file_kind`)."""

    kind: str = "not a file"


# What each kind of non-regular file is called in a message.
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` describes: ``"a regular file"``, ``"a FIFO (named pipe)"``, ..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def _refuse(path: Path, what: str, mode: int) -> OSError:
    error = NotRegularFileError(f"{what} {str(path)!r} is {file_kind(mode)}, not a regular "
                                "file; name a regular file")
    error.kind = file_kind(mode)
    return error


def regular_file_stat(path: str | os.PathLike[str], what: str = "file") -> os.stat_result:
    """``os.stat(path)``, or a one-line ``OSError`` unless ``path`` is a regular file.

    Nothing is opened: a FIFO, a device (``/dev/zero``), a socket or a directory is
    refused by what it is (:class:`NotRegularFileError`), a missing path as
    ``FileNotFoundError`` "``what`` not found". ``what`` names the input in the message
    ("text file", "corpus file").
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except NotADirectoryError:  # a component of the path is a file
        raise FileNotFoundError(f"{what} not found: {path} (a parent is not a "
                                "directory)") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise OSError(f"cannot read {what} {str(path)!r}: {reason}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, what, st.st_mode)
    return st


def open_regular(path: str | os.PathLike[str], what: str = "file") -> BinaryIO:
    """Open ``path`` for reading in binary mode, only if it is a regular file.

    :func:`regular_file_stat` decides before the file is opened. The file is then opened
    non-blocking (so a FIFO swapped in meanwhile cannot block the open) and checked
    again on the open descriptor: what is read is the regular file that was checked,
    whose size is ``os.fstat(f.fileno()).st_size``.
    """
    path = Path(path)
    regular_file_stat(path, what)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | nonblock)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise OSError(f"cannot read {what} {str(path)!r}: {reason}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, what, st.st_mode)
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class FileTooLargeError(ValueError):
    """An input larger than its reader accepts: one line with the size and the limit."""


def read_regular(path: str | os.PathLike[str], what: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`), at most
    ``max_bytes``: a larger file is a one-line :class:`FileTooLargeError`, refused by its
    size before anything is read, or as soon as it has grown past ``max_bytes`` while
    being read."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise FileTooLargeError(f"{what} {path} is {size:,} bytes; at most "
                                    f"{max_bytes:,} are accepted")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(f"{what} {path} has more than {max_bytes:,} bytes")
    return data
