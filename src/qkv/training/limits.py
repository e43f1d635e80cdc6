"""Will it fit? The memory a model needs, compared with what the machine has, before the
model is built.

Building a model too big for the machine ends in an out-of-memory kill or a traceback
minutes later; its size is known from its config beforehand (``num_parameters()`` of
:class:`qkv.models.Seq2SeqConfig` and :class:`qkv.models.GPTConfig`, pure arithmetic),
so the tasks ask :func:`check_memory` first:

    needed = TRAIN_BYTES_PER_PARAMETER * config.num_parameters()
    check_memory(needed, f"training this {n:,}-parameter model", hint="use smaller sizes")

The callers' estimates are lower bounds (the GPT adds a lower bound on its activations,
``GPTConfig.num_saved_activations``; the data, workspace and PyTorch itself come on top),
so a refusal is certain to be right, and a pass is no promise.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import torch

__all__ = [
    "MEMINFO",
    "CGROUP_ROOT",
    "TRAIN_BYTES_PER_PARAMETER",
    "LOAD_BYTES_PER_PARAMETER",
    "InsufficientMemoryError",
    "InsufficientDiskError",
    "free_disk_space",
    "available_memory",
    "check_memory",
    "format_bytes",
    "release_freed_memory",
]

# float32 weights, their gradients and Adam's two moments: 4 x 4 bytes.
TRAIN_BYTES_PER_PARAMETER = 16
# Loading a checkpoint for inference: the float32 model (4 bytes), the file's bytes, read
# whole to check their SHA-256 (4), and the tensors safetensors decodes from them (4),
# all alive at once until the weights are copied into the model.
LOAD_BYTES_PER_PARAMETER = 12


# Where Linux reports available memory, and a container's limit (module attributes, so a
# test can point them at files of its own).
MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class InsufficientMemoryError(ValueError):
    """A model would not fit in the memory available: one line, with the numbers."""


class InsufficientDiskError(OSError):
    """A write would not fit on its disk: one line, with the path and the numbers."""


def free_disk_space(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer can still put on the file system holding ``path``
    (or, if it does not exist yet, its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _meminfo_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel counts in KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """What a container's memory limit still allows (cgroup v2, then v1), if it has one."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            limit = (CGROUP_ROOT / limit_file).read_text().strip()
            usage = int((CGROUP_ROOT / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a number near 2**63 (v1) means no limit
        if limit.isdigit() and int(limit) < 2**62:
            return max(int(limit) - usage, 0)
        return None
    return None


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes that can still be allocated on ``device``; None where that is unknown.

    CUDA: the device's free memory. CPU: the kernel's ``MemAvailable`` (Linux), lowered
    to the container's memory limit when there is one; elsewhere free pages from
    ``os.sysconf`` where the platform reports them.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else None
    if device.type != "cpu":
        return None
    known = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    if known:
        return min(known)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def release_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; a
    no-op on other C libraries).

    Why: a tokenizer parsed from its JSON text, a checkpoint's header, a prompt's
    activations leave tens of MB freed but still resident in glibc's arenas; the
    weights read next would then sit above them, and the process's peak with them.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def format_bytes(n: int | float) -> str:
    """``1536 -> '1.5 KiB'``; sizes past exbibytes in scientific notation."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            break
        n /= 1024
    if unit == "EiB" and abs(n) >= 1024:
        return f"{n * 1024.0**6:.3g} bytes"
    return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"


def check_memory(
    needed: int, what: str, *, hint: str, device: torch.device | str = "cpu"
) -> None:
    """Raise :class:`InsufficientMemoryError` if ``needed`` bytes exceed what ``device``
    has available (nothing happens where that is unknown).

    ``what`` names the job and its size, ``hint`` the way out; the message reads
    ``"{what} needs at least 26.1 GiB, but 22.5 GiB is available; {hint}"``.
    """
    available = available_memory(device)
    if available is None or needed <= available:
        return
    where = "" if torch.device(device).type == "cpu" else f" on {device}"
    raise InsufficientMemoryError(
        f"{what} needs at least {format_bytes(needed)}, but {format_bytes(available)} is "
        f"available{where}; {hint}"
    )
