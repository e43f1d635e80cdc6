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

import hashlib
import json
import os
import random
import shutil
import stat
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from ..fileio import (
    deferred_signals,
    fsync_dir,
    remove_stale_temp_files,
    write_atomic,
    write_durable,
)
from ..testing import pause_point
from .lock import run_dir_lock

__all__ = [
    "CheckpointError",
    "FORMAT",
    "VERSION",
    "save_checkpoint",
    "load_config",
    "load_weights",
    "load_trainer_state",
    "is_checkpoint",
    "checkpoint_progress",
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


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: one line naming the path and the problem."""


def _fail(path: Path | str, problem: str) -> CheckpointError:
    # Library exceptions (safetensors, json) can span lines; keep ours to one.
    return CheckpointError(f"{path}: {problem}".replace("\r", " ").replace("\n", " "))


# ----------------------------------------------------------------------------
# Durable, atomic file writes


# ----------------------------------------------------------------------------
# Tensors <-> bytes


def _tensors_to_bytes(tensors: Mapping[str, Tensor]) -> bytes:
    """safetensors bytes; exact duplicates become aliases, overlapping views copies."""
    stored: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        identity = (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                    tensor.dtype)
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
    return safetensors.torch.save(stored, metadata=metadata)


def _looks_like_pickle(data: bytes) -> bool:
    # torch.save writes a zip archive; a bare pickle (protocol >= 2) starts with 0x80.
    return data.startswith(b"PK\x03\x04") or data[:1] == b"\x80"


def _bytes_to_tensors(path: Path, data: bytes) -> dict[str, Tensor]:
    try:
        tensors = safetensors.torch.load(data)
    except Exception as error:  # safetensors raises its own error types
        if _looks_like_pickle(data):
            raise _fail(path, "is a pickle / torch.save file, not safetensors; "
                              "refusing to load it (unpickling can run arbitrary code)") from None
        raise _fail(path, f"is not a valid safetensors file ({error})") from None
    # The library parsed the header, so reading its metadata by hand is safe.
    (header_len,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
    try:
        aliases = json.loads(metadata.get(_ALIAS_KEY, "{}"))
    except json.JSONDecodeError:
        raise _fail(path, f"metadata {_ALIAS_KEY!r} is not valid JSON") from None
    if not isinstance(aliases, dict):
        raise _fail(path, f"metadata {_ALIAS_KEY!r} is not a JSON object")
    for alias, target in aliases.items():
        if target not in tensors:
            raise _fail(path, f"alias {alias!r} points to missing tensor {target!r}")
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
            if key not in tensors:
                raise _fail(path, f"refers to tensor {key!r}, missing from {TRAINER_TENSORS}")
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


def _manifest(files: Mapping[str, bytes]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "files": {
            name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        },
    }


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
    model: nn.Module,
    config: Mapping[str, Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``model``'s weights and ``config`` (any JSON-able mapping) to ``run_dir``.

    With an ``optimizer`` or a ``trainer_state`` the trainer files are written too: the
    optimizer's state, the RNG states of torch (CPU and CUDA), ``random`` and NumPy, and
    ``trainer_state`` (JSON-able: epoch, step, history, ...). Without them, trainer files
    of an earlier save in the same directory are removed. Returns ``run_dir``.

    Raises TypeError, before any file is touched, if ``config`` or ``trainer_state`` is
    not JSON-serialisable.
    """
    run_dir = Path(run_dir)
    # Serialise everything in memory first, so a bad config fails before any write.
    files = {
        MODEL: _tensors_to_bytes(model.state_dict()),
        CONFIG: _json_bytes(dict(config), "config"),
    }
    if optimizer is not None or trainer_state is not None:
        tensors: dict[str, Tensor] = {}
        state = {
            "optimizer": None if optimizer is None
            else _encode(optimizer.state_dict(), "optimizer", tensors),
            "rng": _rng_to_json(capture_rng_state(), tensors),
            "trainer_state": None if trainer_state is None
            else _encode(trainer_state, "trainer_state", tensors),
        }
        if trainer_state is not None and any(k.startswith("trainer_state") for k in tensors):
            raise TypeError("trainer_state must be JSON-serialisable (it holds a tensor)")
        files[TRAINER_TENSORS] = _tensors_to_bytes(tensors)
        files[TRAINER_JSON] = _json_bytes(state, "trainer_state")
    manifest = _json_bytes(_manifest(files), "manifest")

    with run_dir_lock(run_dir), deferred_signals(_say_saving):
        pause_point("save-begin")
        remove_stale_temp_files(run_dir)
        _finish_pending(run_dir)  # an earlier save that died after its commit
        staging = run_dir / STAGING
        staging.mkdir()
        for name, data in files.items():
            write_durable(staging / name, data)
        fsync_dir(staging)
        pause_point("save-staged")
        write_atomic(staging / MANIFEST, manifest)  # the commit point
        pause_point("save-committed")
        _finish_pending(run_dir)
        pause_point("save-done")
    return run_dir


def _say_saving(signum: int) -> None:
    # Runs in a signal handler: os.write, not print, which could re-enter sys.stdout's
    # buffer in the middle of a write.
    os.write(2, b"qkv: a checkpoint is being written; stopping as soon as it is complete\n")


# ----------------------------------------------------------------------------
# Loading


def _parse_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise _fail(path, "manifest missing (not a qkv checkpoint, or an incomplete one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _fail(path, f"invalid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise _fail(path, f"not a {FORMAT} manifest (format {found!r})")
    if manifest.get("version") != VERSION:
        raise _fail(path, f"unsupported {FORMAT} version {manifest.get('version')!r} "
                          f"(this qkv reads version {VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise _fail(path, "manifest has no 'files' object")
    for name, entry in files.items():
        # Only known names: a manifest must not steer reads outside the run directory.
        if name not in _KNOWN:
            raise _fail(path, f"manifest lists unexpected file {name!r}")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("bytes"), int)):
            raise _fail(path, f"manifest entry for {name!r} needs 'sha256' and 'bytes'")
    missing = [name for name in _REQUIRED if name not in files]
    if missing:
        raise _fail(path, f"manifest does not list {', '.join(missing)}")
    return manifest


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
        if not path.is_file():
            raise _fail(path, "missing (listed in the checkpoint manifest)")
        size, expected = path.stat().st_size, self.files[name]["bytes"]
        if size != expected:
            raise _fail(path, f"truncated or altered: {size} bytes, manifest says {expected}")

    def read(self, name: str) -> bytes:
        """The file's bytes after checking them against the manifest (one read, no race)."""
        self.check_size(name)
        path = self.path(name)
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.files[name]["sha256"]:
            raise _fail(path, f"SHA-256 mismatch (corrupt or replaced file): manifest "
                              f"{self.files[name]['sha256'][:16]}..., file {digest[:16]}...")
        return data

    def read_json(self, name: str) -> Any:
        data = self.read(name)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _fail(self.path(name), f"invalid JSON ({error})") from None

    def read_tensors(self, name: str) -> dict[str, Tensor]:
        return _bytes_to_tensors(self.path(name), self.read(name))


def checkpoint_progress(run_dir: str | os.PathLike[str]) -> tuple[int, int | None] | None:
    """``(completed epochs, target epochs)`` of the checkpoint in ``run_dir``.

    None when the checkpoint holds no trainer state (it loads, but cannot be resumed);
    the target is None when the trainer state does not record one. Reads only the
    manifest and ``trainer.json`` (hash checked); raises :class:`CheckpointError` when
    there is no valid checkpoint. For messages that must say what is on disk.
    """
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
    return epoch, target if valid_target else None


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


def _describe(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def load_weights(run_dir: str | os.PathLike[str], model: nn.Module, *, strict: bool = True) -> None:
    """Load ``model.safetensors`` into ``model`` after checking names, shapes and dtypes.

    ``strict=True`` requires exactly the model's ``state_dict`` keys; ``strict=False``
    tolerates missing and unexpected keys. A shape or dtype mismatch is an error either
    way (as in ``nn.Module.load_state_dict``): a :class:`CheckpointError` listing the
    first few offending keys with expected and found shapes.
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
    model.load_state_dict({k: v for k, v in found.items() if k in expected}, strict=strict)


def _optimizer_state(
    saved: Any, optimizer: torch.optim.Optimizer, tensors: Mapping[str, Tensor], path: Path
) -> dict[str, Any]:
    """Rebuild an optimizer state_dict from JSON, checked against ``optimizer``."""
    decoded = _decode(saved, tensors, path)
    if not (isinstance(decoded, dict) and isinstance(decoded.get("state"), dict)
            and isinstance(decoded.get("param_groups"), list)):
        raise _fail(path, "optimizer state needs 'state' and 'param_groups'")
    groups = decoded["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise _fail(path, f"optimizer has {len(optimizer.param_groups)} parameter group(s), "
                          f"checkpoint {len(groups)}")
    params: dict[int, Tensor] = {}
    for live, group in zip(optimizer.param_groups, groups, strict=True):
        if not isinstance(group, dict) or len(group.get("params", [])) != len(live["params"]):
            raise _fail(path, "optimizer parameter groups do not match the checkpoint's")
        params.update(zip(group["params"], live["params"], strict=True))
        # JSON turned tuples (Adam's betas) into lists; give them back their type.
        for key, value in group.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)
    state: dict[int, Any] = {}
    for param_id, entry in decoded["state"].items():
        try:
            param = params[int(param_id)]
        except (KeyError, ValueError):
            raise _fail(path, f"optimizer state for unknown parameter {param_id!r}") from None
        for name, value in entry.items():
            if name in _PARAM_SHAPED and isinstance(value, Tensor) and value.shape != param.shape:
                raise _fail(path, f"optimizer state {name} of parameter {param_id} has shape "
                                  f"{tuple(value.shape)}, parameter {tuple(param.shape)}")
        state[int(param_id)] = entry
    decoded["state"] = state
    return decoded


def load_trainer_state(
    run_dir: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None
) -> dict[str, Any] | None:
    """Restore ``optimizer`` and the global RNGs; return the saved ``trainer_state``.

    Returns None (restoring nothing) when the checkpoint has no trainer files. Everything
    is validated before anything is changed, so a bad checkpoint leaves the optimizer and
    the RNGs as they were. ``optimizer=None`` restores only the RNGs.
    """
    ckpt = _Checkpoint(run_dir)
    if not ckpt.has(TRAINER_JSON):
        return None
    path = ckpt.path(TRAINER_JSON)
    if not ckpt.has(TRAINER_TENSORS):
        raise _fail(ckpt.run_dir, f"manifest lists {TRAINER_JSON} but not {TRAINER_TENSORS}")
    tensors = ckpt.read_tensors(TRAINER_TENSORS)
    saved = ckpt.read_json(TRAINER_JSON)
    if not isinstance(saved, dict) or not {"optimizer", "rng", "trainer_state"} <= set(saved):
        raise _fail(path, "expected keys 'optimizer', 'rng' and 'trainer_state'")
    trainer_state = saved["trainer_state"]
    if trainer_state is not None and not isinstance(trainer_state, dict):
        raise _fail(path, "trainer_state must be a JSON object")
    rng = _rng_from_json(saved["rng"], tensors, path)
    if optimizer is not None:
        if saved["optimizer"] is None:
            raise _fail(path, "checkpoint holds no optimizer state")
        state = _optimizer_state(saved["optimizer"], optimizer, tensors, path)
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            raise _fail(path, f"optimizer state does not fit this optimizer ({error})") from None
    restore_rng_state(rng)
    return trainer_state
