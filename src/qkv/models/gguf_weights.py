"""Read an open model's weights and configuration from a GGUF file (llama.cpp's format).

A GGUF file is a little header followed by the tensors' bytes:

- the magic ``GGUF``, a version (2 or 3), the number of tensors and of metadata entries;
- the metadata: typed key/value pairs. The model's configuration lives under the
  architecture's prefix (``llama.block_count``, ``qwen3.attention.head_count_kv``,
  ``gemma3.rope.freq_base``, ...), the tokenizer under ``tokenizer.``;
- one entry per tensor: its name (llama.cpp's: ``token_embd.weight``,
  ``blk.0.attn_q.weight``, ...), its dimensions, its GGML type (``F32``, ``Q4_K``, ...)
  and where its bytes start, counted from the (aligned) end of the header.

GGML lists a tensor's dimensions fastest-varying first, the reverse of PyTorch: a
``(out, in)`` ``nn.Linear`` weight is stored with dimensions ``[in, out]``. Every shape
this module returns is in PyTorch's order.

Nothing in the file is trusted. ``gguf.GGUFReader`` believes the header's counts (an
array "of 2**60 strings" is walked until the file ends, each element a NumPy object),
reports a truncated tensor as a failed ``reshape`` and does not look for tensors that
overlap. So :func:`read_gguf_header` walks the header itself first, with every count
and length bounded and checked against the bytes that remain before anything is
allocated, and every tensor checked to lie, aligned and whole, inside the file, apart
from the others. Only then are tensors mapped (:func:`read_gguf_tensors`) or a
``GGUFReader`` opened on the file (:func:`open_gguf_reader`, for the tokenizer).

Quantized blocks are expanded here, one tensor at a time, by vectorised PyTorch
decoders of GGML's block layouts (``Q8_0`` ... ``Q6_K``; the tests hold them to the
``gguf`` package's own ``gguf.quants.dequantize``, bit for bit). The ``gguf`` package
(``pip install 'qkv[gguf]'``) gives the type codes and block sizes.

The tensors come back under llama.cpp's names and in llama.cpp's conventions; a model
built from them must still undo three of those: the row order of ``attn_q``/``attn_k``
in ``llama``-architecture files (:func:`unpermute_rope`), Gemma's RMSNorm weights, which
llama.cpp's converter stores as ``1 + w`` (every ``*norm.weight`` of a ``gemma*`` file),
and GPT-2's fused ``attn_qkv`` (stored ``(3d, d)``, as ``nn.Linear`` holds it).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..checks import show
from ..utils.fileio import open_regular

__all__ = [
    "import_gguf",
    "check_tensor_budget",
    "decode_blocks",
    "GGUFHeader",
    "GGUFTensorInfo",
    "QKV_DECODED_TYPES",
    "gguf_version",
    "gguf_weight_types",
    "open_gguf_reader",
    "read_gguf_metadata",
    "permute_rope",
    "quantization_mix",
    "read_gguf_blocks",
    "read_gguf_header",
    "read_gguf_tensors",
    "unpermute_rope",
]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # version 1 had 32-bit counts; gguf's reader refuses it too
# Bounds on the header's counts, far above any released model's (a few thousand
# tensors, a vocabulary of 262,144 tokens with as many merges, templates of some KiB),
# so that a lying count is refused before it costs anything.
_MAX_TENSORS = 1 << 16
_MAX_KEYS = 1 << 16
_MAX_ARRAY = 1 << 24
_MAX_STRING = 1 << 24
_MAX_NAME = 1 << 10
_MAX_NESTING = 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ELEMENTS = 1 << 40
_MAX_ALIGNMENT = 1 << 20
_DEFAULT_ALIGNMENT = 32
# Never more than this is expanded, whatever the caller's budget (1 TiB).
_MAX_TOTAL_BYTES = 1 << 40

# GGUF's metadata value types: id -> (name, struct format) for the fixed-size scalars.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
            10: "<Q", 11: "<q", 12: "<d"}
_BOOL, _STRING, _ARRAY = 7, 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor as the header describes it (nothing of its data read).

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        type_name: the GGML type (``"F32"``, ``"Q4_K"``, ...).
        shape: PyTorch's order, e.g. ``(out, in)`` for a linear weight.
        offset: where its bytes start in the file.
        nbytes: how many bytes it takes there.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's header says, checked (see :func:`read_gguf_header`).

    Attributes:
        path: the file.
        version: the format's version (2 or 3).
        architecture: ``general.architecture`` (``"llama"``, ``"qwen3"``, ``"gemma3"``).
        config: every metadata entry under ``"{architecture}."``, prefix removed
            (``{"block_count": 30, "attention.head_count": 9, "rope.freq_base": ...}``):
            ints, floats, bools, strings and lists of them, as JSON can hold them.
        general: the ``general.*`` entries the same way, prefix removed.
        tensors: name -> :class:`GGUFTensorInfo`, in the file's order.
        file_size: the file's size in bytes when it was read.
    """

    path: Path
    version: int
    architecture: str
    config: dict[str, Any]
    general: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    file_size: int


def import_gguf() -> Any:
    """The gguf package, or a one-line ImportError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a GGUF file needs the gguf package: pip install gguf "
                          "(or pip install 'qkv[gguf]')") from None
    return gguf


class _Header:
    """A bounded walk over a GGUF header held in ``buf``; each problem one line."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def take(self, n: int, what: str) -> int:
        """The offset of the next ``n`` bytes, which must lie in the file."""
        if n > self.size - self.pos:
            raise self.fail(f"truncated GGUF header: {what} needs {n:,} bytes at offset "
                            f"{self.pos:,}, past the file's end ({self.size:,} bytes)")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, limit: int) -> int:
        n = self.unpack("<Q", what)
        if n > limit:
            raise self.fail(f"{what} is {n:,}; at most {limit:,} is accepted")
        return n

    def string(self, what: str, limit: int = _MAX_STRING) -> str:
        n = self.count(f"the length of {what}", limit)
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start:,} is not UTF-8 text") from None

    def value(self, vtype: int, key: str, keep: bool, depth: int = 0) -> Any:
        """The value of type ``vtype`` at the cursor; ``keep=False`` only skips it."""
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            value = self.unpack(fmt, f"metadata {key}")
            if vtype == _BOOL:
                if value > 1:
                    raise self.fail(f"metadata {key} is a bool holding {value}, not 0 or 1")
                return bool(value)
            if isinstance(value, float) and keep and not math.isfinite(value):
                raise self.fail(f"metadata {key} is {value}; a finite number is expected")
            return value
        if vtype == _STRING:
            return self.string(f"metadata {key}")
        if vtype == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.fail(f"metadata {key} nests arrays more than {_MAX_NESTING} deep")
            itype = self.unpack("<I", f"metadata {key}")
            n = self.count(f"the length of metadata {key}", _MAX_ARRAY)
            if itype in _SCALARS and not keep:  # skipped whole: nothing is built
                self.take(n * struct.calcsize(_SCALARS[itype]), f"metadata {key}")
                return None
            if itype not in _SCALARS and itype not in (_STRING, _ARRAY):
                raise self.fail(f"metadata {key} is an array of unknown type {itype}")
            if not keep:
                for _ in range(n):
                    self.value(itype, key, keep, depth + 1)
                return None
            return [self.value(itype, key, keep, depth + 1) for _ in range(n)]
        raise self.fail(f"metadata {key} has unknown value type {vtype} (GGUF's are 0-12)")


def _walk(buf: Any, path: Path, ggml_types: Any,
          block_sizes: Mapping[Any, tuple[int, int]],
          metadata: dict[str, Any] | None = None) -> GGUFHeader:
    """Parse and check the whole header in ``buf`` (the file's bytes, mapped); with
    ``metadata``, every entry (the tokenizer's too) is also put in it, full key -> value."""
    h = _Header(buf, path)
    if h.size < 4 or bytes(buf[:4]) != _MAGIC:
        head = bytes(buf[:4])
        raise h.fail(f"not a GGUF file (it starts with {head!r}, a GGUF file with "
                     f"{_MAGIC!r})")
    h.take(4, "the magic")
    version = h.unpack("<I", "the version")
    if version not in _VERSIONS and version & 0xFFFF == 0 and version >> 16 in _VERSIONS:
        raise h.fail("is a big-endian GGUF file; only little-endian ones are supported")
    if version not in _VERSIONS:
        raise h.fail(f"GGUF version {version} is not supported (supported: "
                     f"{', '.join(map(str, _VERSIONS))})")
    n_tensors = h.count("the tensor count", _MAX_TENSORS)
    n_keys = h.count("the metadata count", _MAX_KEYS)
    raw: dict[str, Any] = {}
    skipped: set[str] = set()
    for i in range(n_keys):
        key = h.string(f"metadata key #{i}", _MAX_NAME)
        if key in raw or key in skipped:
            raise h.fail(f"metadata {key} appears twice")
        vtype = h.unpack("<I", f"metadata {key}'s type")
        # The tokenizer's long lists are skipped here (data.gguf_tokenizer reads them).
        keep = not key.startswith("tokenizer.")
        value = h.value(vtype, key, keep or metadata is not None)
        if metadata is not None:
            metadata[key] = value
        if keep:
            raw[key] = value
        else:
            skipped.add(key)
    architecture = raw.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise h.fail("has no general.architecture (the model family, e.g. 'llama'): it "
                     "does not describe a model")
    alignment = raw.get("general.alignment", _DEFAULT_ALIGNMENT)
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0
            or alignment & (alignment - 1) or alignment > _MAX_ALIGNMENT):
        raise h.fail(f"general.alignment is {show(alignment)}; a power of two up to "
                     f"{_MAX_ALIGNMENT:,} is expected")
    entries = []
    for i in range(n_tensors):
        name = h.string(f"the name of tensor #{i}", _MAX_NAME)
        n_dims = h.unpack("<I", f"tensor {name}'s dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise h.fail(f"tensor {name} has {n_dims:,} dimensions; GGML allows 1 to "
                         f"{_MAX_DIMS}")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, h.take(8 * n_dims,
                                                              f"tensor {name}'s dimensions"))
        code = h.unpack("<I", f"tensor {name}'s type")
        offset = h.unpack("<Q", f"tensor {name}'s offset")
        entries.append((name, dims, code, offset))
    start = -(-h.pos // alignment) * alignment  # the data section, aligned
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, code, offset in entries:
        if name in tensors:
            raise h.fail(f"tensor {name} appears twice")
        try:
            ggml_type = ggml_types(code)
            block, block_bytes = block_sizes[ggml_type]
        except (ValueError, KeyError):
            known = sorted(t.value for t in block_sizes)
            raise h.fail(f"tensor {name} has GGML type code {code}, unknown to gguf "
                         f"{gguf_version()} (it knows codes {known[0]}-{known[-1]}); a "
                         "later gguf may (pip install -U gguf)") from None
        if not all(1 <= d <= _MAX_ELEMENTS for d in dims) or math.prod(dims) > _MAX_ELEMENTS:
            raise h.fail(f"tensor {name} has dimensions {list(dims)}; each must be in "
                         f"[1, {_MAX_ELEMENTS:,}] and their product at most "
                         f"{_MAX_ELEMENTS:,}")
        if dims[0] % block:
            raise h.fail(f"tensor {name}: a row of {dims[0]:,} values is not a whole "
                         f"number of {ggml_type.name} blocks of {block}")
        nbytes = math.prod(dims) // block * block_bytes
        if offset % alignment:
            raise h.fail(f"tensor {name} starts at data offset {offset:,}, not a multiple "
                         f"of the alignment {alignment}")
        if start + offset + nbytes > h.size:
            raise h.fail(f"tensor {name} ({nbytes:,} bytes at offset {start + offset:,}) "
                         f"ends past the file's end ({h.size:,} bytes): the file is "
                         "truncated or its header is wrong")
        tensors[name] = GGUFTensorInfo(name, ggml_type.name, tuple(reversed(dims)),
                                       start + offset, nbytes)
    spans = sorted(tensors.values(), key=lambda t: t.offset)
    for before, after in zip(spans, spans[1:], strict=False):
        if after.offset < before.offset + before.nbytes:
            raise h.fail(f"tensors {before.name} and {after.name} overlap in the file: "
                         "its header is wrong")
    prefix = f"{architecture}."
    return GGUFHeader(
        path=path, version=version, architecture=architecture,
        config={k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)},
        general={k[len("general."):]: v for k, v in raw.items() if k.startswith("general.")},
        tensors=tensors, file_size=h.size)


def _read(path: Path, f: Any, metadata: dict[str, Any] | None = None) -> GGUFHeader:
    gguf = import_gguf()
    size = os.fstat(f.fileno()).st_size
    if size == 0:  # mmap refuses an empty file
        raise ValueError(f"{path}: not a GGUF file (it is empty)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        view = memoryview(buf)
        try:
            return _walk(view, path, gguf.GGMLQuantizationType, gguf.GGML_QUANT_SIZES,
                         metadata)
        finally:
            view.release()


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The architecture, configuration and tensor list of a GGUF file; no tensor read.

    Args:
        path: the ``.gguf`` file (a regular file).

    Returns:
        A :class:`GGUFHeader`: ``config`` holds every ``"{architecture}.*"`` metadata
        entry (the model's sizes, norms' epsilon, RoPE base and scaling, sliding window,
        ... whatever the family writes), and ``tensors`` each tensor's name, GGML type
        and shape in PyTorch's order.

    Raises:
        ValueError: one line naming the file: not a GGUF file, a version other than 2 or
            3, a header cut short or holding counts, lengths or dimensions past qkv's
            bounds, an unknown value or tensor type, no ``general.architecture``, a
            tensor that is misaligned, ends past the file's end or overlaps another.
        OSError: ``path`` is missing or not a regular file (a FIFO, a directory).
        ImportError: the gguf package is missing.
    """
    path = Path(path)
    with open_regular(path, "GGUF file") as f:
        return _read(path, f)


def read_gguf_metadata(path: str | os.PathLike[str]) -> tuple[GGUFHeader, dict[str, Any]]:
    """The checked header and every metadata entry, full key -> value (``{"tokenizer.
    ggml.tokens": [...], "general.architecture": "llama", ...}``): strings, numbers,
    bools and lists of them, read by the same bounded walk as :func:`read_gguf_header`.

    For the tokenizer (``tokenizer_from_gguf(path, metadata=...)``): its lists take
    what their Python strings and numbers take (~10 MB for a 50k vocabulary), where a
    ``gguf.GGUFReader`` holds NumPy views of every element (~150 MB). Raises as
    :func:`read_gguf_header` does."""
    path = Path(path)
    metadata: dict[str, Any] = {}
    with open_regular(path, "GGUF file") as f:
        return _read(path, f, metadata), metadata


def open_gguf_reader(path: str | os.PathLike[str]) -> tuple[GGUFHeader, Any]:
    """The checked header and a ``gguf.GGUFReader`` on the file, for the metadata this
    module does not decode (the tokenizer: ``tokenizer_from_gguf(path, reader=...)``).

    The reader is only opened once :func:`read_gguf_header` has bounded every count it
    will believe; raises as that does."""
    path = Path(path)
    header = read_gguf_header(path)
    gguf = import_gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as error:
        raise ValueError(f"{path}: the gguf package cannot read it ({type(error).__name__}: "
                         f"{' '.join(str(error).split())[:160]})") from None
    # Both walks must agree on where every tensor lies.
    theirs = {t.name: int(t.data_offset) for t in reader.tensors}
    ours = {name: info.offset for name, info in header.tensors.items()}
    if theirs != ours:
        raise ValueError(f"{path}: the gguf package places its tensors elsewhere than "
                         "qkv's reading of the header does; the file is not readable safely")
    return header, reader


def read_gguf_tensors(
    path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    max_bytes: int | None = None,
    header: GGUFHeader | None = None,
) -> dict[str, Tensor]:
    """The file's tensors, expanded to ``dtype``, under llama.cpp's names.

    Args:
        path: the ``.gguf`` file.
        names: the tensors to read (default: all), each one the header lists.
        dtype: ``torch.float32`` or ``torch.bfloat16``. Quantized values are expanded in
            float32, then rounded to ``dtype``; F32/F16/BF16 values are exact in float32
            (F64 ones are rounded once, to ``dtype``).
        max_bytes: refuse, before anything is expanded, if the tensors would take more
            than this many bytes in ``dtype`` (the caller passes the memory it has; while
            a tensor is expanded, its bytes and its float32 values are held beside it).
        header: the file's :func:`read_gguf_header`, if already read; it is checked
            again against the file's size.

    Returns:
        name -> tensor of the header's shape (PyTorch's order: a linear weight is
        ``(out, in)``), contiguous, on the CPU.

    Raises:
        ValueError: one line: as :func:`read_gguf_header`; a name the file lacks; a type
            neither qkv nor the installed gguf package decodes (see
            :func:`gguf_weight_types`); a total over ``max_bytes``; a tensor
            holding NaN or an infinity (named).
    """
    path = Path(path)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    gguf = import_gguf()
    with open_regular(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        if header is None:
            header = _read(path, f)
        elif header.file_size != size:
            raise ValueError(f"{path}: the file changed since its header was read "
                             f"({header.file_size:,} bytes then, {size:,} now)")
        wanted = list(header.tensors) if names is None else list(dict.fromkeys(names))
        missing = [n for n in wanted if n not in header.tensors]
        if missing:
            raise ValueError(f"{path}: has no tensor {missing[0]!r} ({len(header.tensors):,} "
                             "tensors in the file)")
        infos = [header.tensors[n] for n in wanted]
        for info in infos:
            _check_readable(path, info)
        check_tensor_budget(header, wanted, dtype, max_bytes)
        if not infos:
            return {}
        data = np.memmap(f, dtype=np.uint8, mode="r")
        try:
            return {info.name: _expand(path, f, data, info, dtype, gguf) for info in infos}
        finally:
            del data


def read_gguf_blocks(
    path: str | os.PathLike[str],
    names: Iterable[str],
    header: GGUFHeader,
) -> dict[str, Tensor]:
    """The file's quantized tensors as their blocks, not expanded.

    Args:
        path: the ``.gguf`` file.
        names: 2-D tensors of types :func:`decode_blocks` reads.
        header: the file's :func:`read_gguf_header`; checked again against its size.

    Returns:
        name -> uint8 ``(rows, row_bytes)``: each row's blocks as the file stores them
        (a copy out of the read-only map, one tensor at a time).

    Raises:
        ValueError: one line: a name the file lacks or of another type or rank; blocks
            that decode to NaN or an infinity (a damaged scale), named. Each tensor is
            decoded a million values at a time to check that, never expanded whole.
    """
    path = Path(path)
    gguf = import_gguf()
    with open_regular(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        if header.file_size != size:
            raise ValueError(f"{path}: the file changed since its header was read "
                             f"({header.file_size:,} bytes then, {size:,} now)")
        infos = []
        for name in dict.fromkeys(names):
            info = header.tensors.get(name)
            if info is None:
                raise ValueError(f"{path}: has no tensor {name!r}")
            if info.type_name not in _DECODERS or len(info.shape) != 2:
                raise ValueError(f"{path}: tensor {name} is {info.type_name} "
                                 f"{list(info.shape)}; blocks are read of 2-D tensors of "
                                 f"{', '.join(_DECODERS)}")
            infos.append(info)
        if not infos:
            return {}
        out = {}
        for info in infos:
            _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[info.type_name]]
            blocks = _read_bytes(path, f, info).reshape(info.shape[0], -1)
            _check_blocks(path, info, blocks.reshape(-1, block_bytes))
            out[info.name] = blocks
    return out


def _read_bytes(path: Path, f: Any, info: GGUFTensorInfo) -> Tensor:
    """A tensor's bytes, read into memory of their own (uint8 ``(nbytes,)``): read, not
    copied out of a map, so the file's pages are not counted in the process's memory
    beside the copy."""
    out = torch.empty(info.nbytes, dtype=torch.uint8)
    view, got = memoryview(out.numpy()), 0
    f.seek(info.offset)
    while got < info.nbytes and (n := f.readinto(view[got:])):
        got += n
    view.release()
    if got != info.nbytes:
        raise ValueError(f"{path}: tensor {info.name} ends past the file's end: the file "
                         "was truncated while it was read")
    return out


# Where each type's float16 scales sit in its block (byte offsets). A block's values are
# its scales times small integers (minus a scaled minimum): they are all finite exactly
# when its scales are, so these fields alone say whether a tensor is damaged.
_SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                 "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}


def _check_blocks(path: Path, info: GGUFTensorInfo, blocks: Tensor) -> None:
    """One line if a block of ``blocks`` (``(n, block_bytes)``) has a NaN or infinite
    scale, which would make its values NaN or infinite. Nothing the tensor's size is
    allocated (a value decoded would be 4 bytes; a scale checked is 3)."""
    bad = torch.zeros(len(blocks), dtype=torch.bool)
    for at in _SCALE_FIELDS[info.type_name]:
        bad |= ~torch.isfinite(blocks[:, at:at + 2].contiguous().view(torch.float16)[:, 0])
    if bool(bad.any()):
        raise ValueError(f"{path}: tensor {info.name} has {int(bad.sum()):,} block(s) of "
                         f"{len(blocks):,} with a NaN or infinite scale; the weights are "
                         "damaged")


def check_tensor_budget(header: GGUFHeader, names: Iterable[str], dtype: torch.dtype,
                        max_bytes: int | None) -> None:
    """Refuse, in one line, tensors of ``header`` that take more than ``max_bytes`` bytes
    once expanded to ``dtype`` (``None``: no bound but a sanity limit of 1 TiB); checked
    before any is read, by :func:`read_gguf_tensors` and by callers that read a file's
    tensors a few at a time."""
    infos = [header.tensors[n] for n in dict.fromkeys(names)]
    total = sum(info.numel for info in infos) * torch.empty((), dtype=dtype).element_size()
    limit = _MAX_TOTAL_BYTES if max_bytes is None else min(max_bytes, _MAX_TOTAL_BYTES)
    if total > limit:
        raise ValueError(f"{header.path}: the {len(infos):,} tensors take {total:,} bytes as "
                         f"{str(dtype).removeprefix('torch.')}; at most {limit:,} are "
                         "available")


def _halves(b: Tensor) -> Tensor:
    """Two float16 bytes per row -> float32 ``(n, 1)``."""
    return b.view(torch.float16).float()


def _nibbles(qs: Tensor, width: int) -> Tensor:
    """Bytes ``(n, k)`` cut in groups of ``width`` -> per group, the low nibbles of its
    bytes, then their high nibbles: ``(n, 2 * k // width, width)`` uint8 values 0-15."""
    groups = qs.reshape(qs.shape[0], -1, 1, width)
    return torch.cat([groups & 0xF, groups >> 4], dim=2).reshape(qs.shape[0], -1, width)


def _k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, float32 ``(n, 8)``:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7 the
    same for the mins, bytes 8-11 the low nibbles of scales 4-7 and of mins 4-7."""
    s = scales.reshape(-1, 3, 4)
    lo, mid, top = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 63, (top & 0xF) | ((lo >> 2) & 0x30)], dim=1)
    mn = torch.cat([mid & 63, (top >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _q8_0(b: Tensor) -> Tensor:  # d, 32 int8
    # int8 times float32 converts each value inside the product's one pass (exactly: an
    # int8 is a float32), without a float copy of the strided values first.
    return b[:, 2:].view(torch.int8) * _halves(b[:, :2])


def _q4_0(b: Tensor) -> Tensor:  # d, 16 bytes of two 4-bit values offset by 8
    q = _nibbles(b[:, 2:], 16).reshape(len(b), 32).to(torch.int8) - 8
    return _halves(b[:, :2]) * q.float()


def _q4_1(b: Tensor) -> Tensor:  # d, min, 16 bytes of two 4-bit values
    q = _nibbles(b[:, 4:], 16).reshape(len(b), 32).float()
    return _halves(b[:, :2]) * q + _halves(b[:, 2:4])


def _fifth_bits(qh: Tensor) -> Tensor:
    """Q5_0/Q5_1's 4 bytes of fifth bits (a little-endian 32-bit word: bit j is value
    j's) -> ``(n, 32)`` uint8 0 or 1."""
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(len(qh), 32)


def _q5_0(b: Tensor) -> Tensor:  # d, 4 bytes of fifth bits, 16 bytes of low nibbles
    q = (_nibbles(b[:, 6:], 16).reshape(len(b), 32) | (_fifth_bits(b[:, 2:6]) << 4))
    return _halves(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: Tensor) -> Tensor:  # d, min, 4 bytes of fifth bits, 16 bytes of low nibbles
    q = (_nibbles(b[:, 8:], 16).reshape(len(b), 32) | (_fifth_bits(b[:, 4:8]) << 4))
    return _halves(b[:, :2]) * q.float() + _halves(b[:, 2:4])


def _crumbs(qs: Tensor) -> Tensor:
    """K-quants' 2-bit fields: bytes ``(n, 64)`` in two halves of 32 -> 16 groups of 16
    values ``(n, 16, 16)`` uint8 0-3: per half, bits 0-1 of its 32 bytes, then bits 2-3,
    4-5 and 6-7."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(len(qs), 2, 1, 32) >> shifts) & 3).reshape(len(qs), 16, 16)


def _q2_k(b: Tensor) -> Tensor:  # 16 scale/min bytes, 64 bytes of 2-bit values, d, dmin
    scales = b[:, :16]
    dl = (_halves(b[:, 80:82]) * (scales & 0xF).float()).unsqueeze(-1)
    ml = (_halves(b[:, 82:84]) * (scales >> 4).float()).unsqueeze(-1)
    return (dl * _crumbs(b[:, 16:80]).float() - ml).reshape(len(b), 256)


def _q3_k(b: Tensor) -> Tensor:  # 32 bytes of high bits, 64 of 2-bit values, 12 scale bytes, d
    n = len(b)
    # 16 six-bit scales, offset by 32: low nibbles from bytes 0-7 (low halves first),
    # the top two bits from bytes 8-11 (bits 0-1 of each, then 2-3, 4-5, 6-7).
    packed = b[:, 96:108]
    low = torch.cat([packed[:, :8] & 0xF, packed[:, :8] >> 4], dim=1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 4, 1)
    top = ((packed[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(n, 16)
    scales = ((low | (top << 4)).to(torch.int8) - 32).float()
    dl = (_halves(b[:, 108:110]) * scales).unsqueeze(-1)
    # A value's high bit, when clear, subtracts 4: bit k of the 32 mask bytes belongs to
    # the k-th group of 32 values.
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = ((b[:, :32].unsqueeze(1) >> shifts) & 1).reshape(n, 16, 16)
    q = _crumbs(b[:, 32:96]).to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return (dl * q.float()).reshape(n, 256)


def _q4_k(b: Tensor) -> Tensor:  # d, dmin, 12 scale bytes, 128 bytes of 4-bit values
    sc, mn = _k_scales(b[:, 4:16])
    d = (_halves(b[:, :2]) * sc).unsqueeze(-1)
    dm = (_halves(b[:, 2:4]) * mn).unsqueeze(-1)
    return (d * _nibbles(b[:, 16:], 32).float() - dm).reshape(len(b), 256)


def _q5_k(b: Tensor) -> Tensor:  # d, dmin, 12 scale bytes, 32 bytes of 5th bits, 128 bytes
    sc, mn = _k_scales(b[:, 4:16])
    d = (_halves(b[:, :2]) * sc).unsqueeze(-1)
    dm = (_halves(b[:, 2:4]) * mn).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # bit k: sub-block k's fifth bit
    q = (_nibbles(b[:, 48:], 32) | (high << 4)).float()
    return (d * q - dm).reshape(len(b), 256)


def _q6_k(b: Tensor) -> Tensor:  # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8, d
    n = len(b)
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = b[:, 192:208].view(torch.int8).float()
    d = (_halves(b[:, 208:210]) * scales).unsqueeze(-1)
    return (d * q).reshape(n, 256)


# GGML type -> its block decoder: bytes (n_blocks, block bytes) -> float32 values
# (n_blocks, block values), in the order ggml's dequantize_row_* writes them. These are
# the types of nearly every published file (and llama.cpp's fallbacks for rows that are
# not whole 256-value blocks), decoded here in PyTorch; any other type the gguf package
# can dequantize goes through its NumPy decoders (:func:`gguf_weight_types`).
_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
# Values decoded per call of a PyTorch decoder (see _expand).
_DECODE_VALUES = 1 << 20
# Types whose bytes are the values themselves.
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}
# The GGML types qkv decodes itself, in PyTorch.
QKV_DECODED_TYPES = (*_FLOATS, *_DECODERS)


def decode_blocks(blocks: Tensor, type_name: str) -> Tensor:
    """Rows of GGML blocks -> their values, by qkv's PyTorch decoders.

    Args:
        blocks: uint8 ``(rows, row_bytes)``, each row whole blocks of ``type_name``
            exactly as a GGUF file stores them (``row_bytes`` a multiple of the type's
            block bytes).
        type_name: one of the quantized types of :data:`QKV_DECODED_TYPES`
            (``"Q8_0"`` ... ``"Q6_K"``).

    Returns:
        float32 ``(rows, row_bytes // block_bytes * block_values)``, in the order ggml's
        ``dequantize_row_*`` writes them.
    """
    if type_name not in _DECODERS:
        raise ValueError(f"decode_blocks: type {show(type_name)} is not one qkv decodes; "
                         f"decoded: {', '.join(_DECODERS)}")
    gguf = import_gguf()
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block_bytes:
        raise ValueError(f"decode_blocks: blocks must be uint8 (rows, a multiple of "
                         f"{block_bytes} bytes) for {type_name}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    rows = len(blocks)
    flat = blocks.reshape(-1, block_bytes)
    values = torch.empty(len(flat), block)
    # A million values at a time into one output: the decoders' temporaries (a few
    # bytes per value each) stay in cache instead of faulting in and out hundreds of
    # MB for a large tensor.
    step = max(1, _DECODE_VALUES // block)
    for i in range(0, len(flat), step):
        values[i:i + step] = _DECODERS[type_name](flat[i:i + step])
    return values.reshape(rows, -1)


def gguf_version() -> str:
    """The installed gguf package's version (``"0.19.0"``), or ``"?"``."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


@cache
def _gguf_dequantizes(type_name: str) -> bool:
    """Whether the installed gguf package's ``gguf.quants.dequantize`` reads a type: it
    is asked to decode one block of zeros (what it raises for a type it lacks is its
    NotImplementedError)."""
    gguf = import_gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        with np.errstate(all="ignore"):
            gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def gguf_weight_types() -> dict[str, str]:
    """Every GGML type a tensor may have that :func:`read_gguf_tensors` expands, and
    who decodes it: ``"qkv"`` (PyTorch decoders here: :data:`QKV_DECODED_TYPES`) or
    ``"gguf"`` (the installed gguf package's ``gguf.quants.dequantize``: the IQ, TQ and
    FP4 types, ...). Which types the second holds depends on the gguf version; integer
    types (``I8`` ... ``I64``) are not weights and are never read."""
    gguf = import_gguf()
    return {t.name: "qkv" if t.name in QKV_DECODED_TYPES else "gguf"
            for t in gguf.GGMLQuantizationType
            if t.name in QKV_DECODED_TYPES or _gguf_dequantizes(t.name)}


def _check_readable(path: Path, info: GGUFTensorInfo) -> None:
    """One line if no decoder here or in the gguf package reads ``info``'s type."""
    if info.type_name in QKV_DECODED_TYPES or _gguf_dequantizes(info.type_name):
        return
    what = ("integer data, not a weight type" if info.type_name.startswith("I")
            and info.type_name[1:].isdigit() else
            f"a type gguf {gguf_version()} cannot dequantize; a later gguf may "
            "(pip install -U gguf)")
    raise ValueError(f"{path}: tensor {info.name} is {info.type_name}, {what}; "
                     f"readable: {', '.join(gguf_weight_types())}")


def quantization_mix(header: GGUFHeader) -> str:
    """The file's tensor types with their counts, most common first:
    ``"Q4_K x 120, Q5_0 x 18, Q6_K x 12, F32 x 61"`` (a model card line)."""
    counts = Counter(info.type_name for info in header.tensors.values())
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())


def _expand(path: Path, f: Any, data: np.ndarray, info: GGUFTensorInfo, dtype: torch.dtype,
            gguf: Any) -> Tensor:
    """One tensor's bytes -> a contiguous tensor of ``info.shape`` and ``dtype``."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[info.type_name]]
    if info.type_name in QKV_DECODED_TYPES:
        # The bytes read into memory of their own (torch wants writable memory; pages
        # of a map would count in the process's memory beside them).
        raw = _read_bytes(path, f, info)
        if info.type_name in _FLOATS:
            values = raw.view(_FLOATS[info.type_name])
            values = values if values.dtype == torch.float64 else values.float()
        else:
            values = decode_blocks(raw.reshape(-1, block_bytes), info.type_name)
    else:
        # The gguf package's decoder, given whole rows (it works through them 16 at a
        # time) straight from the map; its float32 result is the one expanded copy.
        # Random or damaged scales make NumPy warn; such values are refused below.
        rows = data[info.offset:info.offset + info.nbytes].reshape(
            -1, info.shape[-1] // block * block_bytes)
        with np.errstate(all="ignore"):
            values = torch.from_numpy(gguf.quants.dequantize(
                rows, gguf.GGMLQuantizationType[info.type_name]))
    tensor = values.reshape(info.shape).to(dtype)
    # NaN propagates through min and max, and an infinity is one of them: one pass,
    # cheaper than isfinite().all() over a large tensor; the count only on failure.
    low, high = torch.aminmax(tensor)
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{path}: tensor {info.name} holds {bad:,} NaN or infinite "
                         f"value(s) of {tensor.numel():,}; the weights are damaged")
    return tensor.contiguous()


# llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.modify_tensors) reorders the
# rows of attn_q.weight and attn_k.weight of "llama"-architecture files (SmolLM2, Llama,
# Mistral): Hugging Face rotates each head's first half against its second half (RoPE
# "rotate half"), llama.cpp rotates neighbouring pairs (2i, 2i+1), so each head's rows
# (h, 2, d/2) are stored as (h, d/2, 2). A model that applies rotate-half RoPE to them
# must undo that with unpermute_rope (q with the query heads, k with the key/value
# heads). Qwen2, Qwen3 and Gemma 3 files are written unpermuted (llama.cpp runs them
# with rotate-half RoPE), so their weights are used as stored.
def unpermute_rope(weight: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's RoPE row order of a query or key projection.

    Args:
        weight: ``(n_heads * head_dim, ...)``: a weight ``(out, in)`` or a bias
            ``(out,)``, rows as llama.cpp stores them.
        n_heads: the heads the rows belong to: query heads for ``attn_q``, key/value
            heads for ``attn_k``.

    Returns:
        The same values, rows in Hugging Face's (rotate-half) order, a new tensor.
    """
    rows = weight.shape[0]
    if n_heads < 1 or rows % (2 * n_heads):
        raise ValueError(f"unpermute_rope: {rows} rows are not {n_heads} heads of an even "
                         "size")
    rest = weight.shape[1:]
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *rest)
            .transpose(1, 2).reshape(weight.shape).contiguous())


def permute_rope(weight: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's RoPE row order of a query or key projection (the inverse of
    :func:`unpermute_rope`): each head's rows ``(2, d/2)`` stored as ``(d/2, 2)``.

    Args:
        weight: ``(n_heads * head_dim, ...)``, rows in Hugging Face's order.
        n_heads: query heads for ``q_proj``, key/value heads for ``k_proj``.

    Returns:
        The same values, rows as llama.cpp's ``llama`` files store them, a new tensor.
    """
    rows = weight.shape[0]
    if n_heads < 1 or rows % (2 * n_heads):
        raise ValueError(f"permute_rope: {rows} rows are not {n_heads} heads of an even size")
    rest = weight.shape[1:]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *rest)
            .transpose(1, 2).reshape(weight.shape).contiguous())
