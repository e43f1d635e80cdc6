"""Weights kept in GGML's quantized blocks, as a GGUF file stores them.

A GGUF file stores most matrices of a published model in blocks: 32 or 256 values
share one or two float16 scales and hold 4 to 8 bits each (``Q4_K``: 256 values in 144
bytes, 4.5 bits a value). Expanded to float32 such a matrix takes 7x the bytes.
:class:`QuantizedLinear` and :class:`QuantizedEmbedding` keep each row's blocks
exactly as the file holds them, ``blocks`` uint8 ``(rows, row_bytes)``, and expand
them only while they compute: the linear layer one whole matrix per call, the
embedding only the rows it looks up. This is the readable path; native kernels may
compute on the blocks themselves (``QuantizedLinear.backend``).

The types kept are :func:`quantized_types` (the ones nearly every published file uses);
:func:`~qkv.models.gguf_weights.decode_blocks` decodes them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import show
from ..kernels import Mat, decode_kernels, quant_type_code, unavailable_reason
from .gguf_weights import decode_blocks, import_gguf

__all__ = ["KEPT_TYPES", "LINEAR_BACKENDS", "QuantizedEmbedding", "QuantizedLinear",
           "QuantizedWeight", "dequantize_modules", "tie_output_head",
           "quantize_modules", "quantized_modules", "quantized_types"]

# The GGML types a quantized run keeps in their blocks (every other type is expanded).
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# How QuantizedLinear.forward computes (its `backend` attribute).
LINEAR_BACKENDS = ("auto", "torch", "native")


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight read as its blocks, on its way into a quantized layer.

    Attributes:
        qtype: its GGML type (one of :data:`KEPT_TYPES`).
        blocks: uint8 ``(rows, row_bytes)``.
        shape: the weight's own shape ``(rows, columns)``, as a float tensor's (so
            that code checking a state dict's shapes reads it as the weight's).
    """

    qtype: str
    blocks: Tensor
    shape: torch.Size


@cache
def quantized_types() -> dict[str, tuple[int, int]]:
    """Each kept GGML type -> ``(values per block, bytes per block)``, as the gguf
    package's ``GGML_QUANT_SIZES`` gives them: ``{"Q8_0": (32, 34), ..., "Q6_K": (256,
    210)}``."""
    gguf = import_gguf()
    return {name: tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]])
            for name in KEPT_TYPES}


def row_bytes(qtype: str, columns: int, what: str = "a row") -> int:
    """Bytes a row of ``columns`` values takes as ``qtype`` blocks; one line if the
    type is not kept or the row is not whole blocks."""
    types = quantized_types()
    if qtype not in types:
        raise ValueError(f"{what}: type {show(qtype)} is not kept in blocks; "
                         f"kept: {', '.join(types)}")
    block, size = types[qtype]
    if columns % block:
        raise ValueError(f"{what}: {columns:,} values per row are not whole {qtype} blocks "
                         f"of {block}")
    return columns // block * size


class _Blocks(nn.Module):
    """What both quantized layers share: ``blocks`` uint8 ``(rows, row_bytes)``, the
    type, and the float dtype they compute in (which ``.to(dtype)`` changes, as it
    changes a float layer's weight)."""

    def __init__(self, rows: int, columns: int, qtype: str, dtype: torch.dtype,
                 blocks: Tensor | None) -> None:
        super().__init__()
        size = row_bytes(qtype, columns, type(self).__name__)
        if blocks is None:
            blocks = torch.empty(rows, size, dtype=torch.uint8)
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (rows, size):
            raise ValueError(f"{type(self).__name__}: {rows:,} rows of {columns:,} {qtype} "
                             f"values need uint8 blocks ({rows}, {size}), got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        self.qtype = qtype
        self.dtype = dtype
        self.register_buffer("blocks", blocks)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # .to(dtype), .float(), .bfloat16() convert float tensors: the dtype this layer
        # computes in follows them, as a float layer's weight would (blocks stay uint8).
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return super()._apply(fn, recurse)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The whole matrix ``(rows, columns)`` in ``dtype`` (default: the layer's)."""
        values = decode_blocks(self.blocks.cpu(), self.qtype).to(self.blocks.device)
        return values.to(dtype or self.dtype)


class QuantizedLinear(_Blocks):
    """``nn.Linear`` with its weight kept in GGML blocks: ``(..., in) -> (..., out)``.

    Args:
        in_features, out_features: the weight is ``(out_features, in_features)``;
            ``in_features`` must be whole blocks of ``qtype``.
        qtype: one of :data:`KEPT_TYPES`.
        bias: whether it has a float bias ``(out_features,)``.
        dtype: the float dtype it computes in (and its bias's).
        blocks: uint8 ``(out_features, row_bytes)``, each row's blocks as the file
            stores them; None: uninitialised (to be loaded).

    Attributes:
        backend: how :meth:`forward` computes (:data:`LINEAR_BACKENDS`). ``"torch"``:
            the whole weight expanded to the input's dtype, then ``F.linear`` (the
            readable path). ``"native"``: ``kernels/quant.c``'s matrix product on the
            blocks in place, each input row quantized to 8 bits per block of 32 as
            GGML's CPU backend does (so it differs from ``"torch"`` by that
            quantization, not by rounding); CPU only, no gradients. ``"auto"``
            (default): ``"native"`` where it can run (a prompt's rows, and the one
            row of its last position through the output head), else ``"torch"``.
    """

    backend: str = "auto"

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 dtype: torch.dtype = torch.float32, blocks: Tensor | None = None) -> None:
        super().__init__(out_features, in_features, qtype, dtype, blocks)
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    @property
    def weight(self) -> Tensor:
        """The weight ``(out, in)``, expanded on each access (for code that asks a
        linear layer its weight's dtype or device, or its values)."""
        return self.dequantized_weight()

    def forward(self, x: Tensor) -> Tensor:
        """``x (..., in) -> (..., out)`` by :attr:`backend`."""
        if self.backend not in LINEAR_BACKENDS:
            raise ValueError(f"QuantizedLinear.backend must be one of {LINEAR_BACKENDS}, got "
                             f"{show(self.backend)}")
        if self.backend != "torch":
            reason = self._native_unsupported(x)
            if reason is None:
                return self._native_forward(x)
            if self.backend == "native":
                raise ValueError(f"QuantizedLinear backend 'native' cannot run: {reason}")
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def _native_unsupported(self, x: Tensor) -> str | None:
        """Why the native product cannot compute ``self(x)`` (None when it can)."""
        if decode_kernels() is None:
            return f"no native kernels ({unavailable_reason()})"
        if x.device.type != "cpu" or self.blocks.device.type != "cpu":
            return f"it runs on the CPU, the input is on {x.device} and the blocks on " \
                   f"{self.blocks.device}"
        if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] != self.in_features:
            return (f"it takes float (..., {self.in_features}) inputs, got {x.dtype} "
                    f"{tuple(x.shape)}")
        if torch.is_grad_enabled() and (x.requires_grad or (
                self.bias is not None and self.bias.requires_grad)):
            return "it has no backward (gradients need backend 'torch', or torch.no_grad())"
        return None

    def _native_forward(self, x: Tensor) -> Tensor:
        """The C kernel's product: rows of ``x`` quantized to 8 bits per block of 32,
        integer dot products with the blocks, float32 sums and bias, back in ``x``'s
        dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(len(rows), self.out_features)
        if not len(rows):
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        bias = None if self.bias is None else self.bias.detach().to(torch.float32).contiguous()
        blocks = self.blocks.contiguous()
        weight = Mat(data=blocks.data_ptr(), type=quant_type_code(self.qtype, self.in_features))
        status = decode_kernels().qkv_quant_matmul(
            ctypes.byref(weight), rows.data_ptr(), None if bias is None else bias.data_ptr(),
            y.data_ptr(), len(rows), self.out_features, self.in_features,
            torch.get_num_threads())
        if status:
            raise MemoryError(f"QuantizedLinear: no memory for {len(rows):,} rows of "
                              f"{self.in_features:,} activations quantized to 8 bits")
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"qtype={self.qtype}, bias={self.bias is not None}")


class QuantizedEmbedding(_Blocks):
    """``nn.Embedding`` with its table kept in GGML blocks: ids ``(...)`` ->
    ``(..., embedding_dim)``; only the rows looked up are expanded.

    Args:
        num_embeddings, embedding_dim: the table is ``(num_embeddings, embedding_dim)``.
        qtype, dtype, blocks: as :class:`QuantizedLinear`'s.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str,
                 dtype: torch.dtype = torch.float32, blocks: Tensor | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, qtype, dtype, blocks)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @property
    def weight(self) -> Tensor:
        """The whole table ``(num_embeddings, embedding_dim)``, expanded on each access."""
        return self.dequantized_weight()

    def forward(self, idx: Tensor) -> Tensor:
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got "
                             f"{int(idx.min())}..{int(idx.max())}")
        rows = self.blocks[idx.reshape(-1)]
        values = decode_blocks(rows.cpu(), self.qtype).to(self.blocks.device)
        return values.to(self.dtype).reshape(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """The model's quantized layers: module name -> type (``{"tok_emb": "Q6_K",
    "trf_blocks.0.att.W_query": "Q4_K", ...}``); empty for a float model."""
    return {name: m.qtype for name, m in model.named_modules() if isinstance(m, _Blocks)}


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_modules(model: nn.Module, qtypes: Mapping[str, str],
                     dtype: torch.dtype = torch.float32) -> None:
    """Replace, in place, each named ``nn.Linear``/``nn.Embedding`` of ``model`` by its
    quantized form with uninitialised blocks (allocated on the current default device:
    under ``torch.device("meta")`` nothing is), ready for ``load_state_dict(...,
    assign=True)`` of its ``{name}.blocks``. A layer's bias keeps its place.

    Args:
        model: a float model (built on the meta device, typically).
        qtypes: module name -> GGML type (:func:`quantized_modules`' form).
        dtype: the float dtype the quantized layers compute in.

    Raises:
        ValueError: one line: a name the model lacks or that is not a linear layer or an
            embedding, a type not kept, rows that are not whole blocks.
    """
    modules = dict(model.named_modules())
    for name, qtype in qtypes.items():
        module = modules.get(name) if isinstance(name, str) and name else None
        where = f"quantized layer {show(name)}"
        if type(module) not in (nn.Linear, nn.Embedding):
            what = "not in the model" if module is None else f"a {type(module).__name__}"
            raise ValueError(f"{where} is {what}; only Linear and Embedding layers are kept "
                             "in blocks")
        try:
            if type(module) is nn.Linear:
                new: nn.Module = QuantizedLinear(module.in_features, module.out_features,
                                                 qtype, module.bias is not None, dtype)
                if module.bias is not None:
                    new.bias = module.bias
            else:
                new = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, qtype,
                                         dtype)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        _swap(model, name, new)


@torch.no_grad()
def dequantize_modules(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Replace, in place, every quantized layer by the float ``nn.Linear``/
    ``nn.Embedding`` its blocks expand to (``dtype``), one layer at a time; layers that
    shared blocks (a tied output head) share the one expanded weight. Returns what was
    replaced (:func:`quantized_modules`' form)."""
    done = quantized_modules(model)
    expanded: dict[int, nn.Parameter] = {}
    for name in done:
        module = model.get_submodule(name)
        key = module.blocks.data_ptr()
        if key not in expanded:
            expanded[key] = nn.Parameter(module.dequantized_weight(dtype))
        weight = expanded[key]
        if isinstance(module, QuantizedEmbedding):
            new: nn.Module = nn.Embedding(module.num_embeddings, module.embedding_dim,
                                          _weight=weight)
        else:
            new = nn.Linear(module.in_features, module.out_features,
                            bias=module.bias is not None, device="meta")
            new.weight = weight
            if module.bias is not None:
                new.bias = nn.Parameter(module.bias.to(dtype))
        _swap(model, name, new)
    return done


def tie_output_head(model: nn.Module) -> None:
    """Make a tied model's output head share its token embedding's matrix again (after
    ``load_state_dict(..., assign=True)`` gave each name its own): the float weight, or
    both layers' blocks. One line if only one of the two is quantized."""
    emb, head = model.tok_emb, model.out_head
    if isinstance(emb, _Blocks) != isinstance(head, _Blocks):
        which = "tok_emb" if isinstance(emb, _Blocks) else "out_head"
        raise ValueError(f"tied weights: {which} is quantized and the other is not; a tied "
                         "output head is the embedding's matrix")
    if isinstance(emb, _Blocks):
        if emb.qtype != head.qtype:
            raise ValueError(f"tied weights: tok_emb is {emb.qtype}, out_head {head.qtype}; "
                             "a tied output head is the embedding's matrix")
        head.blocks = emb.blocks
    else:
        head.weight = emb.weight
