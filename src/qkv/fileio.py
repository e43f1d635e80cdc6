"""Writing files so that nothing is ever half-written.

Every file qkv writes (checkpoints, configurations, figures, benchmark results) goes
through :func:`write_atomic`: readers see the old file or the new one, whole, even if
the process dies mid-write.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["write_atomic", "write_durable", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make renames inside ``path`` durable (POSIX; Windows cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (not atomic by itself)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, whole.

    The bytes go to a temporary file in the same directory (a rename is only atomic
    within one filesystem), are fsync'ed, and the temporary file replaces ``path``.
    Missing parent directories are created. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
