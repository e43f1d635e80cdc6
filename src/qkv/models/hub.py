"""Fetch a Hugging Face model repository's import files into the local Hub cache.

``qkv lm import`` takes a folder, a GGUF file or a Hub repo id. For a repo id,
:func:`fetch_model` downloads, through ``huggingface_hub`` (an optional dependency,
imported only here and only when a repo id is fetched), exactly the files an import
reads and returns the folder that holds them:

- ``config.json`` (required);
- ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
  ``chat_template.jinja``, ``special_tokens_map.json``, and GPT-2's ``vocab.json`` and
  ``merges.txt``, each when the repository has it;
- ``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names.
  Nothing else: no ``*.bin`` (pickles), no ONNX, GGUF or other copies of the weights.

The files land in huggingface_hub's own cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``,
else ``~/.cache/huggingface/hub``), shared with transformers, and the folder returned is
the cache's snapshot of one commit. On POSIX its files are symlinks to
``../../blobs/<hash>``: every one is checked to resolve inside the repository's own
cache folder. A snapshot that transformers filled before may hold other files too;
fetch_model downloads none of them, and the import reads only the files above.
``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE``/``HF_HOME`` are read when
:func:`fetch_model` is called (huggingface_hub reads them once, when it is imported,
so a change made after that would otherwise be missed); the token (``HF_TOKEN`` or
``hf auth login``) is huggingface_hub's own business.

Bounded before anything is downloaded: the repository's file listing (one request,
with sizes) must name only plain relative paths, and the weights it lists must fit in
``max_bytes`` and, with the other files not yet cached, in the free space of the cache.
A download interrupted by Ctrl-C or a lost connection leaves no partial file in the
snapshot folder: huggingface_hub writes each file as ``blobs/<hash>...incomplete`` and
moves it into place whole, and a snapshot whose weights are missing is never returned.

Offline (``HF_HUB_OFFLINE=1``, no network, connection refused, DNS failure), a snapshot
already in the cache with ``config.json`` and all its weights is used as it is;
otherwise the error is one line saying so and naming the other forms of the import (a
local folder or a .gguf file).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from ..checks import parse_json, show
from .hf_gpt2 import HF_CONFIG, HF_SAFETENSORS

__all__ = ["MAX_DOWNLOAD_BYTES", "IMPORT_FILES", "WEIGHTS_FILE", "WEIGHTS_INDEX",
           "is_repo_id", "fetch_model"]

CONFIG_FILE = HF_CONFIG
WEIGHTS_FILE = HF_SAFETENSORS
WEIGHTS_INDEX = "model.safetensors.index.json"
# What an import reads besides the weights; config.json is the only one required.
IMPORT_FILES = (CONFIG_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "special_tokens_map.json", "vocab.json", "merges.txt")
# The most weights fetch_model downloads unless told otherwise: far above the models
# qkv imports (a 1B model is ~2.5 GB in bfloat16), far below what a mistyped id of a
# 400B model would fill a disk with.
MAX_DOWNLOAD_BYTES = 64 << 30
# An index names the shards and their tensors: ~100 KB for a 70B model.
_MAX_INDEX_BYTES = 16 << 20

# Hugging Face's rule for user, organisation and repository names: ASCII letters,
# digits, '-', '_' and '.', at most 96 characters, starting and ending with a letter
# or digit, and neither '--' nor '..' inside.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"({_NAME})/({_NAME})")
# A branch, tag, pull-request ref ("refs/pr/1") or commit hash: git's characters, no
# "..", no empty segment (huggingface_hub writes the ref as a file under the cache).
_REVISION = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")
_HEX_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_repo_id(text: str) -> bool:
    """Whether ``text`` names a Hugging Face repository rather than a local path.

    The rule: a path that exists on this machine is a path, whatever it looks like;
    otherwise ``text`` is a repo id when it is exactly ``owner/name``, each part made of
    ASCII letters, digits, ``-``, ``_`` and ``.`` (at most 96, starting and ending with a
    letter or digit, without ``--`` or ``..``), and does not end in ``.gguf`` (a GGUF
    file that is not there yet is still a file). Anything else (``./x``, ``~/x``,
    ``a/b/c``, ``x.gguf``, ``name`` alone) is treated as a path.
    """
    if (not isinstance(text, str) or not _valid_repo_id(text)
            or text.lower().endswith(".gguf")):
        return False
    try:
        return not Path(text).expanduser().exists()
    except OSError:
        return True


def _valid_repo_id(text: str) -> bool:
    match = _REPO_ID.fullmatch(text)
    return match is not None and not any("--" in part or ".." in part
                                         for part in match.groups())


def _check_revision(revision: str | None) -> None:
    if revision is None:
        return
    if (not isinstance(revision, str) or len(revision) > 255
            or not _REVISION.fullmatch(revision) or ".." in revision):
        raise ValueError(f"revision must be a branch, tag or commit hash (letters, digits, "
                         f"'-', '_', '.', '/'), got {show(revision)}")


def _safe_name(name: Any) -> bool:
    """Whether a listed file name stays inside the folder it is written to."""
    if not isinstance(name, str) or not name or len(name) > 1024 or "\\" in name:
        return False
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    path = PurePosixPath(name)
    return (not path.is_absolute() and ":" not in path.parts[0]
            and all(part not in ("", ".", "..") for part in name.split("/")))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").upper() in _TRUE


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> str | None:
    """huggingface_hub's cache folder, read now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``;
    ``None`` leaves the library's own default."""
    if cache_dir is not None:
        return os.fspath(Path(cache_dir).expanduser())
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def _unreachable(repo_id: str, why: str) -> OSError:
    why = " ".join(why.split())
    if len(why) > 160:
        why = why[:157] + "..."
    return ConnectionError(f"cannot download {repo_id}: offline, or the Hugging Face Hub is "
                           f"unreachable ({why}), and the cache holds no complete copy; "
                           f"download it elsewhere and pass its local folder or a .gguf file "
                           f"instead: qkv lm import FOLDER or qkv lm import FILE.gguf")


def _network_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean "no answer from the Hub": huggingface_hub's offline errors
    and its HTTP client's transport errors (httpx2, httpx or requests, whichever the
    installed version uses; already imported by huggingface_hub, so none is imported
    here)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    found: list[type[BaseException]] = [OfflineModeIsEnabled, LocalEntryNotFoundError,
                                        ConnectionError, TimeoutError, socket.gaierror]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"),
                         ("requests", "ConnectionError"), ("requests", "Timeout")):
        error = getattr(sys.modules.get(module), name, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _http_error(repo_id: str, revision: str | None, error: Exception) -> Exception | None:
    """The one-line error for the Hub's refusal of a request, or ``None`` when the Hub is
    down or busy (5xx, 429), which is treated like no answer."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    login = "set HF_TOKEN or run `hf auth login`"
    if isinstance(error, RevisionNotFoundError):
        return ValueError(f"{repo_id} has no revision {show(revision)} on the Hub "
                          f"(a branch, tag or commit hash of the repository)")
    if isinstance(error, GatedRepoError):
        return PermissionError(f"{repo_id} is gated (HTTP {status}): accept its terms on its "
                               f"Hub page, then {login}")
    if isinstance(error, RepositoryNotFoundError) and status == 401:
        return PermissionError(f"{repo_id}: the Hub refused access (HTTP 401): the "
                               f"repository is private, gated or does not exist; check the "
                               f"id, or {login}")
    if isinstance(error, RepositoryNotFoundError):
        return FileNotFoundError(f"{repo_id}: no such model repository on the Hub (HTTP "
                                 f"{status}); check the id, or if it is private, {login}")
    if status in (401, 403):
        return PermissionError(f"{repo_id}: the Hub refused access (HTTP {status}); it is "
                               f"private or gated: {login}")
    if status == 429 or (isinstance(status, int) and status >= 500):
        return None
    return OSError(f"{repo_id}: the Hub answered HTTP {status}: {_reason(error)}")


def _index_shards(path: Path) -> list[str]:
    """The shard file names an index's ``weight_map`` names, each checked."""
    size = path.stat().st_size
    if size > _MAX_INDEX_BYTES:
        raise ValueError(f"{path}: {size:,} bytes is too large for a weights index")
    try:
        index = parse_json(path.read_bytes())
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{path}: expected an object with a non-empty 'weight_map', "
                         f"got {show(index)}")
    for shard in weight_map.values():
        if not _safe_name(shard) or not shard.endswith(".safetensors"):
            raise ValueError(f"{path}: shard {show(shard)} must be a .safetensors file "
                             f"inside the repository")
    return sorted(set(weight_map.values()))


def _weights_in(folder: Path) -> list[str] | None:
    """The weights files of a snapshot folder if all are present, else ``None``."""
    if (folder / WEIGHTS_FILE).is_file():
        return [WEIGHTS_FILE]
    if (folder / WEIGHTS_INDEX).is_file():
        shards = _index_shards(folder / WEIGHTS_INDEX)
        if all((folder / shard).is_file() for shard in shards):
            return [WEIGHTS_INDEX, *shards]
    return None


def _check_inside(folder: Path, names: Iterable[str]) -> None:
    """Every file resolves inside the repository's cache folder (``snapshots/<commit>``'s
    grandparent, where huggingface_hub keeps the blobs its symlinks point at)."""
    root = folder.resolve().parent.parent
    for name in names:
        target = (folder / name).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise OSError(f"{folder / name}: resolves to {target}, outside the Hub cache "
                          f"folder {root}")


def _from_cache(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The cached snapshot holding config.json and all its weights, or ``None``."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, CONFIG_FILE, cache_dir=cache_dir,
                                    revision=revision)
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    weights = _weights_in(folder)
    if weights is None:
        return None
    _check_inside(folder, [CONFIG_FILE, *weights])
    return folder


def _listed_size(sibling: Any) -> int | None:
    lfs = getattr(sibling, "lfs", None)
    # An attribute in recent huggingface_hub releases, a dict key in older ones.
    size = lfs.get("size") if isinstance(lfs, dict) else getattr(lfs, "size", None)
    size = size if size is not None else getattr(sibling, "size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None


def _free_bytes(folder: str | None) -> int:
    from huggingface_hub import constants

    path = Path(folder if folder is not None else constants.HF_HUB_CACHE).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def fetch_model(
    repo_id: str,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] | None = None,
    max_bytes: int = MAX_DOWNLOAD_BYTES,
) -> Path:
    """Download the files an import of ``repo_id`` reads; return their local folder.

    ``revision`` is a branch, tag or commit hash (the default branch when ``None``);
    ``cache_dir`` overrides huggingface_hub's cache folder; ``log`` receives one line
    per step; ``max_bytes`` bounds the weights' listed size. Files already in the
    cache are not downloaded again. Raises one-line errors: ``ValueError`` for a bad id
    or revision, a missing revision, a listing with an unsafe name or no safetensors
    weights, weights over ``max_bytes``; ``FileNotFoundError`` for a missing repository;
    ``PermissionError`` for a private or gated one; ``ConnectionError`` when the Hub
    cannot be reached and the cache does not hold the model; ``ImportError`` without
    ``huggingface_hub``.
    """
    if not isinstance(repo_id, str) or not _valid_repo_id(repo_id):
        raise ValueError(f"a Hugging Face repo id is owner/name (letters, digits, '-', '_', "
                         f"'.'), got {show(repo_id)}")
    _check_revision(revision)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {show(max_bytes)}")
    try:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        raise ImportError("downloading a Hugging Face repo id needs huggingface_hub "
                          "(pip install 'qkv[hf]'), or pass a downloaded folder or a .gguf "
                          "file: qkv lm import FOLDER or qkv lm import FILE.gguf") from None
    say = log if log is not None else (lambda line: None)
    cache = _cache_dir(cache_dir)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    network = _network_errors()

    def offline(why: str) -> Path:
        folder = _from_cache(repo_id, revision, cache)
        if folder is None:
            raise _unreachable(repo_id, why)
        say(f"{repo_id}: the Hub is not reachable ({why}); using the cached {folder}")
        return folder

    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") \
            or constants.HF_HUB_OFFLINE:
        return offline("HF_HUB_OFFLINE is set")
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision,
                                                    files_metadata=True)
    except network as error:
        return offline(_reason(error))
    except HfHubHTTPError as error:
        refusal = _http_error(repo_id, revision, error)
        if refusal is None:
            return offline(_reason(error))
        raise refusal from None

    commit = info.sha
    if not isinstance(commit, str) or not _HEX_COMMIT.fullmatch(commit):
        raise OSError(f"{repo_id}: the Hub's listing gives no commit hash (got {show(commit)})")
    sizes: dict[str, int | None] = {}
    for sibling in info.siblings or ():
        name = getattr(sibling, "rfilename", None)
        if not _safe_name(name):
            raise ValueError(f"{repo_id}: the Hub lists a file named {show(name)}, which "
                             f"would leave the download folder; refusing the repository")
        sizes[name] = _listed_size(sibling)
    if CONFIG_FILE not in sizes:
        raise ValueError(f"{repo_id} at {commit[:12]} has no {CONFIG_FILE}; it is not a "
                         f"transformers model repository")

    def need_size(name: str) -> int:
        size = sizes.get(name)
        if size is None:
            raise OSError(f"{repo_id}: the Hub's listing gives no size for {name}; "
                          f"cannot bound the download")
        return size

    def download(name: str, at: str = commit) -> Path:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(repo_id, name, revision=at, cache_dir=cache,
                                   endpoint=endpoint)
        except (*network, HfHubHTTPError) as error:
            refusal = None if isinstance(error, network) else _http_error(repo_id, revision,
                                                                          error)
            if refusal is None:
                raise _unreachable(repo_id, f"while downloading {name}: "
                                            f"{_reason(error)}") from None
            raise refusal from None
        size, expected = os.path.getsize(path), sizes.get(name)
        if expected is not None and size != expected:
            raise OSError(f"{repo_id}: {name} has {size:,} bytes, the Hub listed {expected:,}")
        return Path(path)

    small = [name for name in IMPORT_FILES if name in sizes]
    if WEIGHTS_FILE in sizes:
        weights = [WEIGHTS_FILE]
    elif WEIGHTS_INDEX in sizes:
        if need_size(WEIGHTS_INDEX) > _MAX_INDEX_BYTES:
            raise ValueError(f"{repo_id}: {WEIGHTS_INDEX} is {sizes[WEIGHTS_INDEX]:,} bytes, "
                             f"too large for a weights index")
        shards = _index_shards(download(WEIGHTS_INDEX))
        missing = [shard for shard in shards if shard not in sizes]
        if missing:
            raise ValueError(f"{repo_id}: {WEIGHTS_INDEX} names {show(missing[0])}, which "
                             f"the repository does not have")
        small.append(WEIGHTS_INDEX)
        weights = shards
    else:
        others = sorted(n for n in sizes if n.endswith((".bin", ".pt", ".pth", ".gguf",
                                                         ".h5", ".msgpack", ".onnx")))
        have = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "") or "no weights"
        raise ValueError(f"{repo_id} at {commit[:12]} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX}"
                         f" (it has {have}); qkv reads safetensors weights only")
    weight_bytes = sum(need_size(name) for name in weights)
    if weight_bytes > max_bytes:
        raise ValueError(f"{repo_id}: its weights are {weight_bytes:,} bytes, more than the "
                         f"{max_bytes:,} allowed; download it yourself and pass the folder")

    from huggingface_hub import try_to_load_from_cache

    names = [*small, *weights]
    todo = [name for name in names
            if not isinstance(try_to_load_from_cache(repo_id, name, cache_dir=cache,
                                                     revision=commit), str)]
    todo_bytes = sum(need_size(name) for name in todo)
    free = _free_bytes(cache)
    if todo_bytes > free:
        raise OSError(f"{repo_id}: {todo_bytes:,} bytes to download, {free:,} free in the "
                      f"Hub cache {cache or constants.HF_HUB_CACHE}")
    say(f"{repo_id} at {commit[:12]}: {len(names)} files, {weight_bytes:,} bytes of weights, "
        f"{len(todo)} to download ({todo_bytes:,} bytes)")
    # Small files first, weights last: an interrupted fetch leaves a snapshot without
    # its weights, which _from_cache never returns.
    # config.json by the revision asked for (the default branch when none), so that
    # huggingface_hub records which commit that revision is and an offline fetch of the
    # same revision finds this snapshot; every other file by the listing's commit.
    folder = download(CONFIG_FILE, revision or constants.DEFAULT_REVISION).parent
    if folder.name != commit:
        raise OSError(f"{repo_id} changed while it was being downloaded (commit "
                      f"{commit[:12]}, then {folder.name[:12]}); try again")
    for name in names:
        download(name)
    _check_inside(folder, names)
    return folder
