"""One writer per run directory.

Two trainings writing into one run directory would interleave their checkpoints: one
silently replaces the other, or a resume reads half of each. A run therefore holds an
exclusive lock on ``run_dir/.qkv-lock`` from before it reads anything until it has
written its last file; a second writer is refused with one line naming the holder::

    with run_dir_lock("runs/fra"):
        ...  # train and save

The lock is ``flock(2)`` on the lock file (POSIX; on network file systems Linux maps it
to byte-range locks). The kernel drops it when its process dies, however it dies, so a
crash never leaves a run directory locked: the next run takes the lock over, and says
whose it was. The file also records the holder (pid, host, start time, command) for the
messages. Where ``fcntl`` is missing (Windows), the file is created exclusively and a
holder that is no longer running on this host is taken over.

Locks are re-entrant within a process: :func:`qkv.training.save_checkpoint` takes the
lock for the length of a save unless this process already holds it, so direct library
calls are covered too.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..utils.fileio import file_kind, process_alive

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILE",
    "RunDirBusyError",
    "LockHolder",
    "run_dir_lock",
    "holds_run_dir_lock",
    "running_holder",
    "busy_error",
]

LOCK_FILE = ".qkv-lock"
_MAX_LOCK_BYTES = 4096  # what a holder record may take; anything beyond is ignored


class RunDirBusyError(ValueError):
    """Another process is writing to the run directory: one line naming it."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a run directory's lock."""

    pid: int
    host: str
    since: str  # ISO 8601, local time with offset
    command: str

    @classmethod
    def me(cls) -> LockHolder:
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
        if program == "__main__.py":
            program = "python -m qkv"
        command = " ".join([program, *sys.argv[1:]])
        return cls(os.getpid(), socket.gethostname(), since, command[:200])

    @classmethod
    def parse(cls, data: bytes) -> LockHolder | None:
        """The record in a lock file, or None if it holds none (empty, garbled)."""
        try:
            record = json.loads(data[:_MAX_LOCK_BYTES])
            holder = cls(int(record["pid"]), str(record["host"]), str(record["since"]),
                         str(record.get("command", "")))
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        return holder

    def gone(self) -> bool:
        """True if this holder is known to be dead: on this host, and not running."""
        return self.host == socket.gethostname() and not process_alive(self.pid)

    def describe(self) -> str:
        command = f" ({self.command})" if self.command else ""
        return f"process {self.pid} on {self.host} since {self.since}{command}"

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()


class _Lock:
    """An acquired lock: the open lock file."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        # Unlink before unlocking: a process waiting on this inode then sees that the
        # path names another file (or none) and starts over instead of sharing the lock.
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)  # drops the flock


_held: dict[str, _Lock] = {}  # realpath of run_dir -> the lock this process holds


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def running_holder(run_dir: str | os.PathLike[str]) -> LockHolder | None:
    """The process that seems to hold ``run_dir``'s lock now, from its record; None if
    there is none, or its holder is known to be dead. Reads only: for messages."""
    path = Path(run_dir) / LOCK_FILE
    try:
        with open(path, "rb") as f:
            holder = LockHolder.parse(f.read(_MAX_LOCK_BYTES))
    except OSError:
        return None
    return None if holder is None or holder.gone() else holder


def holds_run_dir_lock(run_dir: str | os.PathLike[str]) -> bool:
    """True if this process holds ``run_dir``'s lock."""
    return _key(Path(run_dir)) in _held


def _read(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, _MAX_LOCK_BYTES)


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, LockHolder.me().to_bytes())
    os.fsync(fd)


def busy_error(run_dir: Path, holder: LockHolder | None) -> RunDirBusyError:
    """The one-line error that refuses a second writer."""
    who = holder.describe() if holder else "another process"
    return RunDirBusyError(f"{run_dir} is in use by {who}: one run writes to a run "
                           "directory at a time; wait for it to finish, or choose another "
                           "--run-dir")


def _flags() -> int:
    # O_NONBLOCK: a FIFO put where the lock file goes must not block the open.
    return (os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            | getattr(os, "O_NONBLOCK", 0))


def _acquire_flock(run_dir: Path, path: Path) -> tuple[int, LockHolder | None]:
    while True:
        try:
            fd = os.open(path, _flags() | os.O_CREAT, 0o644)
        except OSError as error:
            raise OSError(f"cannot create the lock file {path}: "
                          f"{error.strerror or error}; is {run_dir} writable?") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise OSError(f"{path} is {file_kind(mode)}, not the lock file qkv makes; "
                          "remove it, or choose another --run-dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = LockHolder.parse(_read(fd))
            os.close(fd)
            raise busy_error(run_dir, holder) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder we waited on may have unlinked the file as it released it; then
        # this lock is on an orphaned inode and a newcomer may hold the real one.
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            os.close(fd)
            continue
        mine = os.fstat(fd)
        if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)
            continue
        # A record left in a lock we could take is that of a process that died holding it.
        return fd, LockHolder.parse(_read(fd))


def _acquire_exclusive(run_dir: Path, path: Path) -> tuple[int, LockHolder | None]:
    """Without flock: create the file exclusively; take over a holder that is gone."""
    stale = None
    for _ in range(2):
        try:
            return os.open(path, _flags() | os.O_CREAT | os.O_EXCL, 0o644), stale
        except FileExistsError:
            holder = LockHolder.parse(path.read_bytes())
            if holder is None or not holder.gone():
                raise busy_error(run_dir, holder) from None
            stale = holder
            path.unlink(missing_ok=True)
    raise busy_error(run_dir, None)


@contextlib.contextmanager
def run_dir_lock(
    run_dir: str | os.PathLike[str], *, log: Callable[[str], None] | None = None
) -> Iterator[Path]:
    """Hold ``run_dir``'s writer lock for the ``with`` block (creating ``run_dir``).

    Raises :class:`RunDirBusyError` (a ``ValueError``, one line naming the holder's pid, host
    and start time) if another process holds it. A lock left by a process that died is
    taken over; ``log`` is told whose it was. Re-entrant within a process.
    """
    run_dir = Path(run_dir)
    key = _key(run_dir)
    if key in _held:  # an outer block of this process holds it, and releases it
        yield run_dir
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(f"cannot create the run directory {run_dir}: "
                      f"{error.strerror or error}") from None
    path = run_dir / LOCK_FILE
    acquire = _acquire_flock if fcntl is not None else _acquire_exclusive
    fd, stale = acquire(run_dir, path)
    lock = _Lock(path, fd)
    try:
        _write_holder(fd)
        if stale is not None and stale.pid != os.getpid() and log is not None:
            log(f"note: took over the lock of {run_dir} from {stale.describe()}, "
                "which is no longer running")
    except BaseException:
        lock.release()
        raise
    _held[key] = lock
    try:
        yield run_dir
    finally:
        del _held[key]
        lock.release()
