"""Safe checkpoints: tensors in safetensors, everything else in JSON, never a pickle.

A run directory holds::

    run_dir/
      model.safetensors   model weights (tied weights stored once, see below)
      config.json         whatever JSON the caller passed: model config, vocabularies, ...
      trainer.safetensors optional: optimizer state tensors and torch RNG states
      trainer.json        optional: optimizer param groups and scalars, Python/NumPy RNG
                          states, and the caller's trainer_state (epoch, step, history)
      checkpoint.json     manifest: format name, version, size and SHA-256 of every file

``torch.load`` unpickles, which can run arbitrary code from an untrusted file; nothing
here ever unpickles. Every loader checks the manifest and the hash of each file it reads,
so a truncated, corrupted or swapped file is a one-line :class:`CheckpointError` instead of
garbage weights.

Crash safety. Replacing several files cannot be one atomic step, so a save goes through a
staging directory ``run_dir/.checkpoint-incoming``:

1. every new file is written there and fsync'ed;
2. the staged manifest is written last, atomically (temp file, fsync, ``os.replace``):
   **this is the commit point**;
3. the staged files are moved into ``run_dir`` one ``os.replace`` at a time, the manifest
   last, and the staging directory is removed.

A save that dies before step 2 leaves the previous checkpoint untouched (the next save
discards the leftovers). One that dies during step 3 leaves a committed checkpoint split
between the two directories: loaders read each file from the staging directory when it is
still there and from ``run_dir`` otherwise, and the next save completes the move. Either
way a loader sees the old checkpoint or the new one, never a mix. Loaders never write.

One writer at a time. A save holds the run directory's lock (:mod:`qkv.training.lock`),
so a second process saving into the same directory is refused, not interleaved. Ctrl-C
and SIGTERM arriving during a save wait until it is complete (then interrupt as usual),
so an interrupted save is one that was never started or one that finished. Before
writing, a save removes the temporary files of writes killed earlier (SIGKILL, power
loss) and refuses a staging directory that is not its own: a symlink, a file, or one
holding files it did not write.

Tied weights: ``state_dict()`` lists a shared parameter under every name; safetensors
refuses to store shared memory, so the first name stores the tensor and the others are
recorded as aliases in the file's metadata (key ``qkv.aliases``), much like
``safetensors.torch.save_model``. Tensors that merely overlap are stored as copies.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import stat
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..checks import (
    MAX_COUNT,
    MAX_JSON_DEPTH,
    check_bool,
    check_float,
    check_int,
    check_str,
    parse_json,
    show,
)
from ..options import LOOP, TRAINING
from ..utils.fileio import (
    FileTooLargeError,
    NotRegularFileError,
    deferred_signals,
    file_kind,
    fsync_dir,
    open_regular,
    read_regular,
    remove_stale_temp_files,
    write_atomic,
    write_durable,
)
from ..utils.testing import pause_point
from .limits import InsufficientDiskError, format_bytes, free_disk_space
from .lock import run_dir_lock

__all__ = [
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "save_checkpoint",
    "load_config",
    "load_weights",
    "load_trainer_state",
    "read_history",
    "is_checkpoint",
    "checkpoint_progress",
    "checkpoint_files",
    "describe_run_dir",
    "check_room_to_save",
    "SafetensorsHeader",
    "read_weights_header",
    "check_weights",
    "write_atomic",
    "capture_rng_state",
    "restore_rng_state",
]

FORMAT = "qkv-checkpoint"
VERSION = 1

MANIFEST = "checkpoint.json"
MODEL = "model.safetensors"
CONFIG = "config.json"
TRAINER_TENSORS = "trainer.safetensors"
TRAINER_JSON = "trainer.json"
_REQUIRED = (MODEL, CONFIG)
_OPTIONAL = (TRAINER_TENSORS, TRAINER_JSON)
_KNOWN = frozenset(_REQUIRED + _OPTIONAL)
STAGING = ".checkpoint-incoming"
# Everything a save writes into the staging directory.
_STAGED = _KNOWN | {MANIFEST}

_ALIAS_KEY = "qkv.aliases"
_TENSOR_TAG = "__safetensors_key__"  # JSON placeholder for a tensor stored in safetensors
# Optimizer state entries that must have their parameter's shape (checked on load so a
# checkpoint from another model fails here, not with a broadcast error steps later).
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})

# Bounds on what a loader reads before trusting it. A file listed in the manifest can be
# any size, but JSON beyond these sizes is no checkpoint qkv writes (a 100,000-token
# vocabulary is about 3 MB), and parsing it would cost many times its size in memory.
MAX_MANIFEST_BYTES = 2**20
MAX_JSON_BYTES = 128 * 2**20
MAX_HEADER_BYTES = 16 * 2**20  # a safetensors header: GPT-2 XL's is 60 kB
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: one line naming the path and the problem."""


def _fail(path: Path | str, problem: str) -> CheckpointError:
    # Library exceptions (safetensors, json) can span lines; keep ours to one.
    return CheckpointError(f"{path}: {problem}".replace("\r", " ").replace("\n", " "))


# ----------------------------------------------------------------------------
# Durable, atomic file writes


# ----------------------------------------------------------------------------
# Tensors <-> bytes


# torch dtype -> the safetensors name of its element type.
_DTYPE_NAMES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32",
    torch.int64: "I64", torch.float64: "F64", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


_DTYPE_TORCH = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class _TensorFile:
    """A safetensors file, laid out but not yet written: its header and its tensors'
    bytes as views of the tensors themselves (CPU copies of others), so that writing
    it copies nothing in memory. Exact duplicates (tied weights) become aliases in
    qkv's metadata; other tensors that share storage are copied apart.

    The format: an 8-byte little-endian header length, a JSON header (padded with spaces
    to a multiple of 8 bytes) of ``{name: {dtype, shape, data_offsets}}`` and
    ``__metadata__``, then the tensors' bytes back to back, widest elements first.
    """

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        stored: dict[str, Tensor] = {}
        aliases: dict[str, str] = {}
        first_name: dict[tuple, str] = {}
        storages: set[tuple] = set()
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            if tensor.dtype not in _DTYPE_NAMES:
                raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors "
                                f"cannot store")
            storage = (tensor.device, tensor.untyped_storage().data_ptr())
            identity = (*storage, tensor.storage_offset(), tuple(tensor.shape),
                        tensor.stride(), tensor.dtype)
            if tensor.numel() > 0 and identity in first_name:
                aliases[name] = first_name[identity]
                continue
            first_name[identity] = name
            shared = tensor.numel() > 0 and storage in storages
            storages.add(storage)
            # Dedupe on the original tensors: moving to the CPU first would copy each tied
            # name separately and hide the sharing.
            tensor = tensor.to("cpu").contiguous()
            stored[name] = tensor.clone() if shared else tensor
        metadata = {"format": "pt"}
        if aliases:
            metadata[_ALIAS_KEY] = json.dumps(aliases, sort_keys=True)
        header: dict[str, Any] = {"__metadata__": metadata}
        self.chunks: list[memoryview] = []
        offset = 0
        for name in sorted(stored, key=lambda n: (-stored[n].element_size(), n)):
            tensor = stored[name]
            data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if \
                tensor.numel() else memoryview(b"")
            header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [offset, offset + data.nbytes]}
            self.chunks.append(data)
            offset += data.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.chunks.insert(0, memoryview(struct.pack("<Q", len(text)) + text))

    def __len__(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)


def _looks_like_pickle(data: bytes) -> bool:
    # torch.save writes a zip archive; a bare pickle (protocol >= 2) starts with 0x80.
    return data.startswith(b"PK\x03\x04") or data[:1] == b"\x80"


def _pickle_refused(path: Path) -> CheckpointError:
    return _fail(path, "is a pickle / torch.save file, not safetensors; refusing to load it "
                       "(unpickling can run arbitrary code)")


def _bytes_to_tensors(path: Path, data: bytearray) -> dict[str, Tensor]:
    """The tensors of a safetensors file's bytes, each a view of ``data`` (no copy: a
    model loads in the memory of its file). The header is checked first, as the format
    defines it (:func:`_parse_header`: every range inside the data, the ranges tiling
    it); tied names share one tensor."""
    try:
        if len(data) < 8:
            raise _fail(path, f"is not a valid safetensors file ({len(data)} bytes)")
        (header_len,) = struct.unpack("<Q", data[:8])
        if header_len > min(len(data) - 8, MAX_HEADER_BYTES):
            raise _fail(path, f"is not a valid safetensors file (its header length "
                              f"{header_len:,} exceeds the file's {len(data):,} bytes or "
                              f"the {MAX_HEADER_BYTES:,}-byte limit)")
        header = _parse_header(path, bytes(data[8:8 + header_len]),
                               len(data) - 8 - header_len)
    except CheckpointError:
        if _looks_like_pickle(bytes(data[:4])):
            raise _pickle_refused(path) from None
        raise
    start = 8 + header_len
    tensors = {}
    for name, (dtype, shape) in header.tensors.items():
        begin, end = header.offsets[name]
        kind = _DTYPE_TORCH[dtype]
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=kind)
        else:
            # The file's bytes are little-endian, as the machines torch runs on.
            tensors[name] = torch.frombuffer(data, dtype=kind, offset=start + begin,
                                             count=math.prod(shape)).reshape(shape)
    for alias, target in header.aliases.items():
        tensors[alias] = tensors[target]
    return tensors


def _json_bytes(obj: Any, what: str) -> bytes:
    try:
        return (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode()
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} is not JSON-serialisable: {error}") from None


# ----------------------------------------------------------------------------
# Nested state (optimizer state_dict, RNG) <-> JSON + tensors


def _encode(obj: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    """JSON-able copy of ``obj``; tensors go to ``tensors[key]`` and leave a placeholder."""
    if isinstance(obj, Tensor):
        tensors[key] = obj
        return {_TENSOR_TAG: key}
    if isinstance(obj, Mapping):
        return {str(k): _encode(v, f"{key}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} (at {key}) in a checkpoint")


def _decode(obj: Any, tensors: Mapping[str, Tensor], path: Path) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR_TAG}:
            key = obj[_TENSOR_TAG]
            if not isinstance(key, str) or key not in tensors:
                raise _fail(path, f"refers to tensor {show(key)}, missing from {TRAINER_TENSORS}")
            return tensors[key]
        return {k: _decode(v, tensors, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors, path) for v in obj]
    return obj


# ----------------------------------------------------------------------------
# RNG state


def capture_rng_state() -> dict[str, Any]:
    """Every global RNG that training touches: torch CPU, CUDA (if present), random, NumPy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional for this module
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states are restored per device present)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state:
        saved = list(state["cuda"])
        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if present != len(saved):
            warnings.warn(
                f"checkpoint holds CUDA RNG states for {len(saved)} device(s), "
                f"{present} present: restoring {min(present, len(saved))}; "
                "results will not repeat exactly",
                stacklevel=2,
            )
        for device, device_state in enumerate(saved[:present]):
            torch.cuda.set_rng_state(device_state, device)


def _rng_to_json(state: Mapping[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "torch": _encode(state["torch"], "rng.torch", tensors),
        "python": [state["python"][0], list(state["python"][1]), state["python"][2]],
    }
    if "cuda" in state:
        out["cuda"] = _encode(list(state["cuda"]), "rng.cuda", tensors)
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return out


def _rng_from_json(obj: Any, tensors: Mapping[str, Tensor], path: Path) -> dict[str, Any]:
    """Rebuild and validate an RNG state on throwaway generators, touching no global one."""
    try:
        state: dict[str, Any] = {"torch": _decode(obj["torch"], tensors, path)}
        torch.Generator().set_state(state["torch"])
        version, internal, gauss = obj["python"]
        state["python"] = (version, tuple(internal), gauss)
        random.Random().setstate(state["python"])
        if "cuda" in obj:
            state["cuda"] = _decode(obj["cuda"], tensors, path)
            for device_state in state["cuda"]:
                if device_state.dtype != torch.uint8 or device_state.dim() != 1:
                    raise ValueError("CUDA RNG state must be a 1-D uint8 tensor")
        if "numpy" in obj:
            import numpy as np

            kind, keys, pos, has_gauss, cached = obj["numpy"]
            state["numpy"] = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            np.random.RandomState().set_state(state["numpy"])
    except CheckpointError:
        raise
    except Exception as error:
        raise _fail(path, f"invalid RNG state ({type(error).__name__}: {error})") from None
    return state


# ----------------------------------------------------------------------------
# Saving


def _manifest(files: Mapping[str, tuple[int, str]]) -> bytes:
    """The manifest's bytes for ``{name: (size, sha256)}``."""
    return _json_bytes({
        "format": FORMAT,
        "version": VERSION,
        "files": {name: {"bytes": size, "sha256": digest}
                  for name, (size, digest) in files.items()},
    }, "manifest")


def _staging_dir(run_dir: Path) -> Path | None:
    """``run_dir``'s staging directory if there is one; refuse one that is not a plain
    directory (a symlink would let a save write, and a loader read, somewhere else)."""
    staging = run_dir / STAGING
    try:
        mode = os.lstat(staging).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else "not a directory"
        raise _fail(staging, f"is {kind}, not the staging directory a qkv save makes; "
                             "move it out of the run directory")
    return staging


def _finish_pending(run_dir: Path) -> None:
    """Complete a committed save (step 3 above) or discard an uncommitted one."""
    staging = _staging_dir(run_dir)
    if staging is None:
        return
    remove_stale_temp_files(staging)
    foreign = sorted(entry.name for entry in os.scandir(staging)
                     if entry.name not in _STAGED or not entry.is_file(follow_symlinks=False))
    if foreign:
        # Deleting them with the staging directory could destroy someone's files.
        raise _fail(staging, f"holds {_describe(foreign)}, which no qkv save writes; "
                             "move them out of the run directory")
    staged_manifest = staging / MANIFEST
    if not staged_manifest.is_file():
        shutil.rmtree(staging)  # never committed: the checkpoint in run_dir is intact
        return
    names = _parse_manifest(staged_manifest)["files"]
    for name in names:
        if (staging / name).exists():
            os.replace(staging / name, run_dir / name)
            pause_point("save-moving")  # the checkpoint is split between two directories
    fsync_dir(run_dir)
    os.replace(staged_manifest, run_dir / MANIFEST)
    fsync_dir(run_dir)
    for stale in _OPTIONAL:  # e.g. trainer files of a previous save, not in this one
        if stale not in names:
            (run_dir / stale).unlink(missing_ok=True)
    shutil.rmtree(staging)


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    model: nn.Module | Mapping[str, Tensor],
    config: Mapping[str, Any],
    *,
    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
    trainer_state: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``model``'s weights and ``config`` (any JSON-able mapping) to ``run_dir``.

    With an ``optimizer`` or a ``trainer_state`` the trainer files are written too: the
    optimizer's state, the RNG states of torch (CPU and CUDA), ``random`` and NumPy, and
    ``trainer_state`` (JSON-able: epoch, step, history, ...). Without them, trainer files
    of an earlier save in the same directory are removed. Returns ``run_dir``.

    ``model`` and ``optimizer`` may also be given as their ``state_dict()`` (a sharded
    model's, gathered: see :class:`qkv.training.Trainer` under FSDP).

    Raises TypeError, before any file is touched, if ``config`` or ``trainer_state`` is
    not JSON-serialisable.
    """
    run_dir = Path(run_dir)
    # Lay everything out first, so a bad config fails before any write. The JSON files
    # are serialised; the tensors are written from their own memory (no copy of the
    # weights is built) and hashed on the way.
    files: dict[str, bytes | _TensorFile] = {
        MODEL: _TensorFile(model.state_dict() if isinstance(model, nn.Module) else model),
        CONFIG: _json_bytes(dict(config), "config"),
    }
    if optimizer is not None or trainer_state is not None:
        tensors: dict[str, Tensor] = {}
        state = {
            "optimizer": None if optimizer is None else _encode(
                optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer)
                else optimizer, "optimizer", tensors),
            "rng": _rng_to_json(capture_rng_state(), tensors),
            "trainer_state": None if trainer_state is None
            else _encode(trainer_state, "trainer_state", tensors),
        }
        if trainer_state is not None and any(k.startswith("trainer_state") for k in tensors):
            raise TypeError("trainer_state must be JSON-serialisable (it holds a tensor)")
        files[TRAINER_TENSORS] = _TensorFile(tensors)
        files[TRAINER_JSON] = _json_bytes(state, "trainer_state")
    needed = sum(len(data) for data in files.values()) + 4096  # and the manifest
    epoch = trainer_state.get("epoch") if trainer_state is not None else None
    what = "the checkpoint" + (f" after epoch {epoch}" if isinstance(epoch, int) else "")

    with run_dir_lock(run_dir), deferred_signals(_say_saving):
        remove_stale_temp_files(run_dir)
        _finish_pending(run_dir)  # an earlier save that died after its commit
        free = free_disk_space(run_dir)
        if needed > free:
            raise InsufficientDiskError(
                f"cannot save {what} to {run_dir}: it needs {format_bytes(needed)} and "
                f"{format_bytes(free)} is free there; {run_dir} still holds "
                f"{describe_run_dir(run_dir)}; free some space and resume")
        pause_point("save-begin")
        staging = run_dir / STAGING
        staging.mkdir()
        try:
            digests = {name: write_durable(staging / name, data if isinstance(data, bytes)
                                           else data.chunks)
                       for name, data in files.items()}
            fsync_dir(staging)
            pause_point("save-staged")
            manifest = _manifest({name: (len(data), digests[name])
                                  for name, data in files.items()})
            write_atomic(staging / MANIFEST, manifest)  # the commit point
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # Uncommitted: the checkpoint in run_dir is the previous one, intact.
            shutil.rmtree(staging, ignore_errors=True)
            raise InsufficientDiskError(
                f"the disk filled up while saving {what} to {run_dir} ({error.strerror}): "
                f"it needs {format_bytes(needed)}, {format_bytes(free)} was free when the "
                f"save began; the partial copy was removed and {run_dir} still holds "
                f"{describe_run_dir(run_dir)}; free some space and resume") from None
        pause_point("save-committed")
        _finish_pending(run_dir)
        pause_point("save-done")
    return run_dir


def check_room_to_save(run_dir: str | os.PathLike[str], checkpoint_bytes: int) -> None:
    """Refuse, before training, a ``run_dir`` whose disk cannot take a checkpoint of
    ``checkpoint_bytes`` and its staging copy (a save writes the new checkpoint beside
    the old one and replaces it only when complete): :class:`InsufficientDiskError`,
    one line with the numbers."""
    run_dir = Path(run_dir)
    copies = 1 if checkpoint_files(run_dir) else 2  # a checkpoint there is counted in use
    needed, free = copies * checkpoint_bytes, free_disk_space(run_dir)
    if needed > free:
        room = "a checkpoint takes" if copies == 1 else "a checkpoint and its staging copy take"
        raise InsufficientDiskError(
            f"not enough disk space to train into {run_dir}: {room} about "
            f"{format_bytes(needed)} and {format_bytes(free)} is free there; free some "
            "space or choose another --run-dir")


def _say_saving(signum: int) -> None:
    # Runs in a signal handler: os.write, not print, which could re-enter sys.stdout's
    # buffer in the middle of a write.
    os.write(2, b"qkv: a checkpoint is being written; stopping as soon as it is complete\n")


# ----------------------------------------------------------------------------
# Loading


def _not_regular(path: Path, kind: str) -> CheckpointError:
    # A FIFO there would block the read forever.
    return _fail(path, f"is {kind}, not a regular file; a qkv save writes only regular files")


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    """``path``'s bytes (:func:`qkv.utils.fileio.read_regular`), each refusal a
    :class:`CheckpointError`."""
    try:
        return read_regular(path, what, limit)
    except NotRegularFileError as error:
        raise _not_regular(path, error.kind) from None
    except FileTooLargeError:
        raise _fail(path, f"is larger than {limit:,} bytes, too large for {what}") from None


def _parse_json(path: Path, data: bytes) -> Any:
    """:func:`qkv.checks.parse_json` (bounded nesting; every failure one line), its error
    a :class:`CheckpointError` naming ``path``."""
    try:
        return parse_json(data, MAX_JSON_DEPTH)
    except ValueError as error:
        raise _fail(path, str(error)) from None


def _parse_manifest(path: Path) -> dict[str, Any]:
    try:
        data = _read_bounded(path, MAX_MANIFEST_BYTES, "a checkpoint manifest")
    except FileNotFoundError:
        raise _fail(path, "manifest missing (not a qkv checkpoint, or an incomplete one)") from None
    manifest = _parse_json(path, data)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise _fail(path, f"not a {FORMAT} manifest (format {show(found)})")
    if manifest.get("version") != VERSION or isinstance(manifest.get("version"), bool):
        raise _fail(path, f"unsupported {FORMAT} version {show(manifest.get('version'))} "
                          f"(this qkv reads version {VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise _fail(path, "manifest has no 'files' object")
    for name, entry in files.items():
        # Only known names: a manifest must not steer reads outside the run directory.
        if name not in _KNOWN:
            raise _fail(path, f"manifest lists unexpected file {show(name)}")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("bytes"), int)):
            raise _fail(path, f"manifest entry for {name!r} needs 'sha256' and 'bytes'")
        try:
            check_int(f"manifest entry {name!r}: 'bytes'", entry["bytes"], 0, MAX_COUNT)
        except ValueError as error:
            raise _fail(path, str(error)) from None
    missing = [name for name in _REQUIRED if name not in files]
    if missing:
        raise _fail(path, f"manifest does not list {', '.join(missing)}")
    return manifest


class SafetensorsHeader(NamedTuple):
    """What a safetensors file says it holds, read without its tensor data.

    ``tensors``: stored name -> ``(dtype, shape)``, e.g. ``("F32", (13, 32))``;
    ``aliases``: name -> stored name, for tied weights stored once (see the module doc).
    """

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    aliases: dict[str, str]
    offsets: dict[str, tuple[int, int]] = {}  # stored name -> its data's [begin, end)

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every name, aliases included, as ``state_dict()`` lists them."""
        return {**self.tensors, **{a: self.tensors[t] for a, t in self.aliases.items()}}

    def num_elements(self) -> int:
        """Elements stored (each tied tensor once): a model's parameter count."""
        return sum(math.prod(shape) for _, shape in self.tensors.values())


def _show_shape(shape: Iterable[Any]) -> str:
    dims = [show(d) for d in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _parse_header(path: Path, header: bytes, data_len: int) -> SafetensorsHeader:
    """Validate a safetensors header as the format defines it: every tensor's dtype, shape
    and byte range, ranges that tile the ``data_len`` data bytes exactly, and qkv's alias
    metadata. A header that passes describes at most ``data_len`` bytes of tensors."""
    raw = _parse_json(path, header)

    def bad(problem: str) -> CheckpointError:
        return _fail(path, f"is not a valid safetensors file (header: {problem})")

    if not isinstance(raw, dict):
        raise bad(f"expected a JSON object, found {show(raw)}")
    metadata = raw.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not (isinstance(metadata, dict)
            and all(isinstance(v, str) for v in metadata.values())):
        raise bad("'__metadata__' must map strings to strings")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    ranges: dict[str, tuple[int, int]] = {}
    spans = []
    for name, entry in raw.items():
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
            raise bad(f"entry {show(name)} needs exactly 'dtype', 'shape' and 'data_offsets'")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPE_BYTES:
            raise bad(f"{show(name)} has dtype {show(dtype)}; valid: {', '.join(_DTYPE_BYTES)}")
        if not (isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_COUNT
                for d in shape)):
            raise bad(f"{show(name)} has shape {show(shape)}; expected a list of sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise bad(f"{show(name)} has data_offsets {show(offsets)}; expected [begin, end] "
                      f"within the {data_len:,} data bytes")
        needed = math.prod(shape) * _DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != needed:
            raise bad(f"{show(name)} is {_show_shape(shape)} {dtype}, {show(needed)} bytes, "
                      f"but its data_offsets span {offsets[1] - offsets[0]:,}")
        tensors[name] = (dtype, tuple(shape))
        spans.append((offsets[0], offsets[1]))
        ranges[name] = (offsets[0], offsets[1])
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise bad("tensor data ranges overlap or leave gaps")
        end = stop
    if end != data_len:
        raise bad(f"tensors cover {end:,} of the {data_len:,} data bytes")
    return SafetensorsHeader(tensors, _parse_aliases(path, metadata, tensors), ranges)


def _parse_aliases(path: Path, metadata: Mapping[str, str], stored: Mapping[str, Any]
                   ) -> dict[str, str]:
    aliases = _parse_json(path, metadata.get(_ALIAS_KEY, "{}").encode())
    if not isinstance(aliases, dict):
        raise _fail(path, f"metadata {_ALIAS_KEY!r} is not a JSON object")
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in stored:
            raise _fail(path, f"alias {show(alias)} points to missing tensor {show(target)}")
        if alias in stored:
            raise _fail(path, f"alias {show(alias)} is also a stored tensor")
    return aliases


class _Checkpoint:
    """A validated manifest plus where each of its files currently lives."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise _fail(self.run_dir, "checkpoint directory does not exist")
        staging = _staging_dir(self.run_dir)
        # A committed save still being moved into place is the newest checkpoint.
        self.pending = staging is not None and (staging / MANIFEST).is_file()
        manifest_dir = staging if staging is not None and self.pending else self.run_dir
        self.files: dict[str, dict[str, Any]] = _parse_manifest(manifest_dir / MANIFEST)["files"]

    def has(self, name: str) -> bool:
        return name in self.files

    def path(self, name: str) -> Path:
        staged = self.run_dir / STAGING / name
        if self.pending and staged.is_symlink():
            raise _fail(staged, "is a symlink; a qkv save never stages one")
        return staged if self.pending and staged.exists() else self.run_dir / name

    def check_size(self, name: str) -> None:
        path = self.path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise _fail(path, "missing (listed in the checkpoint manifest)") from None
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, file_kind(st.st_mode))
        size, expected = st.st_size, self.files[name]["bytes"]
        if size != expected:
            raise _fail(path, f"truncated or altered: {size} bytes, manifest says {expected}")

    def check_digest(self, name: str, digest: str) -> None:
        if digest != self.files[name]["sha256"]:
            raise _fail(self.path(name), f"SHA-256 mismatch (corrupt or replaced file): "
                                         f"manifest {self.files[name]['sha256'][:16]}..., "
                                         f"file {digest[:16]}...")

    def read(self, name: str) -> bytearray:
        """The file's bytes after checking them against the manifest (one read, no race),
        in one writable buffer that tensors may be views of."""
        self.check_size(name)
        with open_regular(self.path(name), "checkpoint file") as f:
            data = bytearray(self.files[name]["bytes"])
            view, got = memoryview(data), 0
            while got < len(data) and (n := f.readinto(view[got:])):
                got += n  # one read call returns at most about 2 GiB on Linux
            view.release()
            if got != len(data) or f.read(1):
                raise _fail(self.path(name), f"changed while it was read (manifest says "
                                             f"{len(data):,} bytes)")
        self.check_digest(name, hashlib.sha256(data).hexdigest())
        return data

    def read_json(self, name: str) -> Any:
        if self.files[name]["bytes"] > MAX_JSON_BYTES:
            raise _fail(self.path(name), f"is {self.files[name]['bytes']:,} bytes; a checkpoint's "
                                         f"JSON is at most {MAX_JSON_BYTES:,}")
        return _parse_json(self.path(name), self.read(name))

    def read_tensors(self, name: str) -> dict[str, Tensor]:
        return _bytes_to_tensors(self.path(name), self.read(name))

    def read_header(self, name: str) -> SafetensorsHeader:
        """The safetensors header of ``name``: its first 8 + n bytes, no tensor data.

        A file whose header is unusable is hashed in full (streamed, in 1 MiB pieces)
        before the header is blamed, so a corrupted file is reported as corrupted.
        """
        self.check_size(name)
        path = self.path(name)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            try:
                if len(prefix) < 8:
                    raise _fail(path, f"is not a valid safetensors file ({size} bytes)")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > min(size - 8, MAX_HEADER_BYTES):
                    raise _fail(path, f"is not a valid safetensors file (its header length "
                                      f"{header_len:,} exceeds the file's {size:,} bytes or "
                                      f"the {MAX_HEADER_BYTES:,}-byte limit)")
                return _parse_header(path, f.read(header_len), size - 8 - header_len)
            except CheckpointError:
                f.seek(0)
                digest = hashlib.sha256()
                while chunk := f.read(2**20):
                    digest.update(chunk)
                self.check_digest(name, digest.hexdigest())
                if _looks_like_pickle(prefix):
                    raise _pickle_refused(path) from None
                raise


def checkpoint_progress(run_dir: str | os.PathLike[str]) -> tuple[int, int | None] | None:
    """``(completed epochs, target epochs)`` of the checkpoint in ``run_dir``.

    None when the checkpoint holds no trainer state (it loads, but cannot be resumed);
    the target is None when the trainer state does not record one. Reads only the
    manifest and ``trainer.json`` (hash checked); raises :class:`CheckpointError` when
    there is no valid checkpoint. For messages that must say what is on disk.
    """
    progress = _saved_progress(run_dir)
    return None if progress is None else progress[:2]


def _saved_progress(run_dir: str | os.PathLike[str]
                    ) -> tuple[int, int | None, int | None] | None:
    """:func:`checkpoint_progress`, and the steps into the next epoch of a checkpoint
    saved inside one (None for one saved at an epoch's end), from one read."""
    ckpt = _Checkpoint(run_dir)
    if not ckpt.has(TRAINER_JSON):
        return None
    saved = ckpt.read_json(TRAINER_JSON)
    state = saved.get("trainer_state") if isinstance(saved, dict) else None
    epoch = state.get("epoch") if isinstance(state, dict) else None
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise _fail(ckpt.path(TRAINER_JSON), f"trainer_state.epoch must be an integer >= 0, "
                                             f"got {epoch!r}")
    train_config = state.get("train_config")
    target = train_config.get("epochs") if isinstance(train_config, dict) else None
    valid_target = isinstance(target, int) and not isinstance(target, bool) and target >= 0
    partial = state.get("partial")
    steps = partial.get("groups") if isinstance(partial, dict) else None
    valid_steps = isinstance(steps, int) and not isinstance(steps, bool)
    return epoch, target if valid_target else None, steps if valid_steps else None


# Every name a save writes or replaces in a run directory.
_SAVED_NAMES = (MANIFEST, MODEL, CONFIG, TRAINER_TENSORS, TRAINER_JSON, STAGING)


def checkpoint_files(run_dir: str | os.PathLike[str]) -> list[str]:
    """The names in ``run_dir`` that a checkpoint save would replace."""
    run_dir = Path(run_dir)
    return [name for name in _SAVED_NAMES
            if os.path.lexists(run_dir / name)]


def describe_run_dir(run_dir: str | os.PathLike[str]) -> str:
    """What ``run_dir`` holds, read from disk, as a phrase for a message.

    "no checkpoint", "the checkpoint after epoch 3 of 10", "a checkpoint without
    trainer state" or "a checkpoint that does not load (why)".
    """
    if not checkpoint_files(run_dir):
        return "no checkpoint"
    try:
        progress = _saved_progress(run_dir)
    except CheckpointError as error:
        return f"a checkpoint that does not load ({error})"
    if progress is None:
        return "a checkpoint without trainer state (it loads, but cannot be resumed)"
    epoch, target, steps = progress
    return (f"the checkpoint after epoch {epoch}" + ("" if target is None else f" of {target}")
            + ("" if steps is None else f" and {steps} steps into epoch {epoch + 1}"))


def is_checkpoint(run_dir: str | os.PathLike[str]) -> bool:
    """True if ``run_dir`` holds a manifest of this format and version (hashes not checked)."""
    try:
        _Checkpoint(run_dir)
    except CheckpointError:
        return False
    return True


def load_config(run_dir: str | os.PathLike[str], task: str | None = None) -> dict[str, Any]:
    """The ``config`` dict saved with the checkpoint.

    Validates the manifest, checks that every listed file is present with its recorded
    size, and checks ``config.json`` against its SHA-256. (Each other file's hash is
    checked by the loader that reads it.) With ``task``, the config's ``"task"`` entry
    must equal it (a translator's run directory is not a language model's).
    """
    ckpt = _Checkpoint(run_dir)
    for name in ckpt.files:
        ckpt.check_size(name)
    config = ckpt.read_json(CONFIG)
    if not isinstance(config, dict):
        raise _fail(ckpt.path(CONFIG), f"expected a JSON object, found {type(config).__name__}")
    if task is not None and config.get("task") != task:
        raise CheckpointError(
            f"{run_dir} holds a {config.get('task')!r} checkpoint, not a {task!r} one"
        )
    return config


def read_weights_header(run_dir: str | os.PathLike[str]) -> SafetensorsHeader:
    """Names, dtypes and shapes in ``model.safetensors``, from its header alone.

    Reads the 8-byte length and the JSON header (bounded by the file's size and
    :data:`MAX_HEADER_BYTES`), never the tensor data; a valid header describes no more
    bytes than the file holds.
    """
    return _Checkpoint(run_dir).read_header(MODEL)


def check_weights(
    run_dir: str | os.PathLike[str],
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    num_parameters: int,
    *,
    dtype: str = "F32",
    dtypes: Mapping[str, str] | None = None,
) -> int:
    """Check ``model.safetensors`` against the model a config describes, before it is built.

    ``shapes``: the model's ``state_dict`` names and shapes as the config implies them
    (e.g. ``config.parameter_shapes()``, read lazily: no more entries than the file holds
    are taken); ``num_parameters``: the config's parameter count (tied weights once).
    ``dtype``: every tensor's safetensors dtype, but those ``dtypes`` names (a quantized
    layer's ``U8`` blocks). Only the file's header is read, so an edited config naming a
    million-wide layer is refused at once, in one line such as ``config.json says
    decoder.dense.weight is (13, 1000000), the weights say (13, 32)``. Returns the file's
    size in bytes.
    """
    ckpt = _Checkpoint(run_dir)
    path = ckpt.path(MODEL)
    header = ckpt.read_header(MODEL)
    found = header.shapes()
    described = set()
    for name, shape in itertools.islice(shapes, len(found) + 1):
        if name not in found:
            raise _fail(path, f"{CONFIG} says the model has {name} {_show_shape(shape)}, "
                              "the weights do not hold it")
        stored_dtype, stored_shape = found[name]
        if tuple(shape) != stored_shape:
            raise _fail(path, f"{CONFIG} says {name} is {_show_shape(shape)}, the weights say "
                              f"{_show_shape(stored_shape)}")
        wanted = (dtypes or {}).get(name, dtype)
        if stored_dtype != wanted:
            raise _fail(path, f"{name} is stored as {stored_dtype}; the model is {wanted}")
        described.add(name)
    extra = sorted(set(found) - described)
    if extra:
        raise _fail(path, f"the weights hold {_describe(extra)}, which {CONFIG} does not "
                          "describe")
    stored = header.num_elements()
    if stored != num_parameters:  # e.g. tie_weights says tied, the file stores two copies
        raise _fail(path, f"{CONFIG} says the model has {num_parameters:,} parameters, the "
                          f"weights hold {stored:,}")
    return path.stat().st_size


def _finite(tensor: Tensor) -> bool:
    """Whether every value is finite: NaN propagates through min and max, and an
    infinity is one of them, so one pass that allocates nothing the tensor's size."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _describe(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def load_weights(
    run_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    strict: bool = True,
    load: Callable[[dict[str, Tensor]], object] | None = None,
) -> None:
    """Load ``model.safetensors`` into ``model`` after checking names, shapes and dtypes.

    ``load`` puts the checked tensors into the model; default ``model.load_state_dict``
    (a sharded model needs its own: see :class:`qkv.training.Trainer` under FSDP).

    ``strict=True`` requires exactly the model's ``state_dict`` keys; ``strict=False``
    tolerates missing and unexpected keys. A shape or dtype mismatch is an error either
    way (as in ``nn.Module.load_state_dict``): a :class:`CheckpointError` listing the
    first few offending keys with expected and found shapes. So are weights that are NaN
    or infinite: no run saves them (the trainer stops first), and a model holding them
    decodes garbage or fails deep inside sampling.
    """
    ckpt = _Checkpoint(run_dir)
    path = ckpt.path(MODEL)
    found = ckpt.read_tensors(MODEL)
    expected = model.state_dict()
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_describe(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_describe(unexpected)}")
        raise _fail(path, "weights do not match the model: " + "; ".join(parts))
    bad = [
        f"{k} expected {tuple(expected[k].shape)} {expected[k].dtype}, "
        f"found {tuple(found[k].shape)} {found[k].dtype}"
        for k in expected
        if k in found
        and (found[k].shape != expected[k].shape or found[k].dtype != expected[k].dtype)
    ]
    if bad:
        raise _fail(path, f"{len(bad)} tensor(s) do not match the model: {_describe(bad)}")
    nonfinite = [k for k, v in found.items()
                 if k in expected and v.is_floating_point() and not _finite(v)]
    if nonfinite:
        raise _fail(path, f"{len(nonfinite)} tensor(s) hold NaN or infinite values "
                          f"({_describe(nonfinite)}); refusing weights no model can use")
    checked = {k: v for k, v in found.items() if k in expected}
    if load is None:
        model.load_state_dict(checked, strict=strict)
    else:
        load(checked)


# Ranges of the optimizer hyper-parameters torch's optimizers share (all: finite).
_GROUP_RANGES = {"lr": (0.0, None), "eps": (0.0, None), "weight_decay": (0.0, None),
                 "momentum": (0.0, None), "betas": (0.0, 1.0)}


# Param-group entries that choose an implementation of the same update.
_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")


def _check_group_value(name: str, key: str, value: Any, live: Any) -> None:
    """A saved param-group entry must have the live optimizer's type and a valid range."""
    lo, hi = _GROUP_RANGES.get(key, (None, None))
    hi_open = key == "betas"  # a beta of 1 never forgets; Adam refuses it
    if isinstance(live, bool):
        check_bool(name, value)
    elif isinstance(live, (int, float)):
        check_float(name, value, lo, hi, hi_open=hi_open)
    elif isinstance(live, tuple):
        if not (isinstance(value, list) and len(value) == len(live)):
            raise ValueError(f"{name} must be a list of {len(live)} numbers, got {show(value)}")
        for i, item in enumerate(value):
            check_float(f"{name}[{i}]", item, lo, hi, hi_open=hi_open)
    elif live is None:  # foreach / fused: None picks a default, a bool forces it
        if value is not None:
            check_bool(name, value)
    elif isinstance(live, Tensor):  # a tensor lr (capturable optimizers)
        if not (isinstance(value, Tensor) and value.numel() == 1
                and bool(torch.isfinite(value).all())):
            raise ValueError(f"{name} must be a one-element finite tensor, got {show(value)}")
    elif isinstance(live, str):
        check_str(name, value, max_len=256)


def _optimizer_state(
    saved: Any, optimizer: torch.optim.Optimizer, tensors: Mapping[str, Tensor], path: Path
) -> dict[str, Any]:
    """Rebuild an optimizer state_dict from JSON, checked against ``optimizer``.

    Every value torch would take on trust is checked first: parameter ids, each group's
    hyper-parameters (type of the live optimizer's, finite, in range: ``lr``, ``eps``,
    ``weight_decay`` >= 0, ``betas`` in [0, 1)), and per-parameter state (tensors of the
    parameter's shape, or a finite, non-negative ``step``).
    """
    decoded = _decode(saved, tensors, path)
    if not (isinstance(decoded, dict) and isinstance(decoded.get("state"), dict)
            and isinstance(decoded.get("param_groups"), list)):
        raise _fail(path, "optimizer state needs 'state' and 'param_groups'")
    groups = decoded["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise _fail(path, f"optimizer has {len(optimizer.param_groups)} parameter group(s), "
                          f"checkpoint {len(groups)}")
    params: dict[int, Tensor] = {}
    for index, (live, group) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            raise _fail(path, "optimizer parameter groups do not match the checkpoint's")
        where = f"optimizer param_groups[{index}]"
        try:
            for i, param in zip(ids, live["params"], strict=True):
                check_int(f"{where}.params id", i, 0, MAX_COUNT)
                if i in params:
                    raise ValueError(f"{where} repeats parameter id {i}")
                params[i] = param
            for key, live_value in live.items():
                if key == "params":
                    continue
                if key in _IMPLEMENTATION_KEYS:
                    # How this optimizer runs its update, not what it learned: a run
                    # saved with the fused kernel resumes with the loop and back.
                    group[key] = live_value
                    continue
                if key not in group:
                    raise ValueError(f"{where} has no {key!r}")
                _check_group_value(f"{where}.{key}", key, group[key], live_value)
        except ValueError as error:
            raise _fail(path, str(error)) from None
        # JSON turned tuples (Adam's betas) into lists; give them back their type.
        for key, value in group.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
    state: dict[int, Any] = {}
    for param_id, entry in decoded["state"].items():
        # int() would also take " 1_0" or Arabic-Indic digits
        if not (param_id.isascii() and param_id.isdigit() and int(param_id) in params):
            raise _fail(path, f"optimizer state for unknown parameter {show(param_id)}")
        param = params[int(param_id)]
        if not isinstance(entry, dict):
            raise _fail(path, f"optimizer state of parameter {param_id} must be an object, "
                              f"got {show(entry)}")
        for name, value in entry.items():
            where = f"optimizer state {show(name)} of parameter {param_id}"
            if name == "step":
                number = value if not isinstance(value, Tensor) else (
                    value.item() if value.numel() == 1 else None)
                try:
                    check_float(where, number, 0.0)
                except ValueError:
                    raise _fail(path, f"{where} must be a finite number >= 0 (or a one-element "
                                      f"tensor of one), got {show(value)}") from None
            elif isinstance(value, Tensor):
                if (name in _PARAM_SHAPED or value.numel() != 1) and value.shape != param.shape:
                    raise _fail(path, f"optimizer state {name} of parameter {param_id} has shape "
                                      f"{tuple(value.shape)}, parameter {tuple(param.shape)}")
            elif value is not None:
                raise _fail(path, f"{where} must be a tensor, got {show(value)}")
        state[int(param_id)] = entry
    decoded["state"] = state
    return decoded


def _check_trainer_state(state: Any, path: Path) -> None:
    """The loop state :class:`qkv.training.Trainer` saves: ``epoch`` and ``step`` (counts),
    ``history`` (equally long per-epoch lists of numbers) and ``train_config``, whose
    declared settings (:data:`qkv.options.TRAINING`, :data:`qkv.options.LOOP`) are
    checked as declared. Keys it does not know are the caller's business and pass."""
    if not isinstance(state, dict):
        raise _fail(path, f"trainer_state must be a JSON object, got {show(state)}")
    try:
        for key in ("epoch", "step"):
            if key in state:
                check_int(f"trainer_state.{key}", state[key], 0, MAX_COUNT)
        history = state.get("history", {})
        if not isinstance(history, dict):
            raise ValueError(f"trainer_state.history must be an object of per-epoch lists, "
                             f"got {show(history)}")
        lengths = set()
        for key, column in history.items():
            name = f"trainer_state.history[{show(key)}]"
            if not isinstance(column, list):
                raise ValueError(f"{name} must be a list, got {show(column)}")
            for value in column:
                # NaN and inf are honest records of a diverged loss; a value a plot cannot
                # turn into a float is not.
                if value is not None and not (isinstance(value, float) or (
                        isinstance(value, int) and not isinstance(value, bool)
                        and value.bit_length() <= 1000)):
                    raise ValueError(f"{name} must hold numbers or null, found {show(value)}")
            lengths.add(len(column))
        if len(lengths) > 1:
            raise ValueError(f"trainer_state.history lists differ in length: {sorted(lengths)}")
        train_config = state.get("train_config")
        train_config = {} if train_config is None else train_config
        if not isinstance(train_config, dict):
            raise ValueError(f"trainer_state.train_config must be an object, "
                             f"got {show(train_config)}")
        # Each value as its setting is declared (qkv.options), which is how the trainer
        # that saved it checked it.
        for key, value in train_config.items():
            setting = TRAINING.get(key) or LOOP.get(key)
            if setting is not None:
                setting.validate(value, f"trainer_state.train_config.{key}")
    except ValueError as error:
        raise _fail(path, str(error)) from None


def _read_trainer_json(ckpt: _Checkpoint) -> tuple[Path, dict[str, Any]]:
    """``trainer.json`` (its path and content), its keys and its ``trainer_state`` checked;
    the caller has checked that the checkpoint lists it."""
    path = ckpt.path(TRAINER_JSON)
    saved = ckpt.read_json(TRAINER_JSON)
    if not isinstance(saved, dict) or not {"optimizer", "rng", "trainer_state"} <= set(saved):
        raise _fail(path, "expected keys 'optimizer', 'rng' and 'trainer_state'")
    if saved["trainer_state"] is not None:
        _check_trainer_state(saved["trainer_state"], path)
    return path, saved


def load_trainer_state(
    run_dir: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None,
    *,
    load: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any] | None:
    """Restore ``optimizer`` and the global RNGs; return the saved ``trainer_state``.

    Returns None (restoring nothing) when the checkpoint has no trainer files. Everything
    is validated before anything is changed, so a bad checkpoint leaves the optimizer and
    the RNGs as they were. ``optimizer=None`` restores only the RNGs. ``load`` puts the
    checked optimizer state into the optimizer; default ``optimizer.load_state_dict``.
    """
    ckpt = _Checkpoint(run_dir)
    if not ckpt.has(TRAINER_JSON):
        return None
    if not ckpt.has(TRAINER_TENSORS):
        raise _fail(ckpt.run_dir, f"manifest lists {TRAINER_JSON} but not {TRAINER_TENSORS}")
    tensors = ckpt.read_tensors(TRAINER_TENSORS)
    path, saved = _read_trainer_json(ckpt)
    trainer_state = saved["trainer_state"]
    rng = _rng_from_json(saved["rng"], tensors, path)
    if optimizer is not None:
        if saved["optimizer"] is None:
            raise _fail(path, "checkpoint holds no optimizer state")
        state = _optimizer_state(saved["optimizer"], optimizer, tensors, path)
        try:
            (optimizer.load_state_dict if load is None else load)(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            raise _fail(path, f"optimizer state does not fit this optimizer ({error})") from None
    restore_rng_state(rng)
    return trainer_state


def read_history(run_dir: str | os.PathLike[str]) -> dict[str, list]:
    """The per-epoch training history a checkpoint holds (see :meth:`Trainer.fit`), read
    and validated without restoring anything; ``{}`` when it holds no trainer state."""
    ckpt = _Checkpoint(run_dir)
    if not ckpt.has(TRAINER_JSON):
        return {}
    state = _read_trainer_json(ckpt)[1]["trainer_state"]
    if state is None:
        return {}
    return {key: list(column) for key, column in state.get("history", {}).items()}
