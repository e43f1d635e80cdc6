"""d2l's tensor vocabulary: the framework-neutral names the books' code is written in.

d2l writes one text for several frameworks, so its code says ``d2l.reshape(X, shape)``,
``d2l.concat``, ``d2l.normal`` where PyTorch code would say ``X.reshape(shape)``,
``torch.cat``, ``torch.normal``. On PyTorch those names are:

- torch's own functions and dtypes under d2l's name (``ones is torch.ones``,
  ``concat is torch.cat``, ``int64 is torch.int64``, ...), so they take every argument
  torch takes and draw from torch's random stream exactly as torch does;
- tensor methods as functions of the tensor: ``reshape(x, *args)`` is
  ``x.reshape(*args)``, ``transpose(x)`` is ``x.t()`` (2-D only, as in d2l), ``size(x)``
  is ``x.numel()``, ``astype(x, dtype)`` is ``x.type(dtype)``, ...;
- ``check_shape`` and ``check_len``, the one-line checks the English edition's cells
  make.

The names are the union of both editions' lists (d2l-zh 2.0 and d2l 1.0.3); where both
have a name they agree. ``numpy(x)`` also moves a GPU tensor to the CPU, where d2l's
would fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "nn_Module", "ones", "ones_like", "zeros", "zeros_like", "tensor", "arange", "meshgrid",
    "sin", "sinh", "cos", "cosh", "tanh", "linspace", "exp", "log", "normal", "rand",
    "randn", "matmul", "batch_matmul", "int32", "int64", "float32", "concat", "stack",
    "abs", "eye", "sigmoid", "numpy", "size", "reshape", "to", "reduce_sum", "argmax",
    "astype", "transpose", "reduce_mean", "expand_dims", "swapaxes", "repeat",
    "check_shape", "check_len", "CheckError",
]

nn_Module = nn.Module  # noqa: N816  (d2l's name)

# torch's functions and dtypes, the same objects under d2l's names
ones = torch.ones
ones_like = torch.ones_like
zeros = torch.zeros
zeros_like = torch.zeros_like
tensor = torch.tensor
arange = torch.arange
meshgrid = torch.meshgrid
sin = torch.sin
sinh = torch.sinh
cos = torch.cos
cosh = torch.cosh
tanh = torch.tanh
linspace = torch.linspace
exp = torch.exp
log = torch.log
normal = torch.normal
rand = torch.rand
randn = torch.randn
matmul = torch.matmul
batch_matmul = torch.bmm
int32 = torch.int32
int64 = torch.int64
float32 = torch.float32
concat = torch.cat
stack = torch.stack
abs = torch.abs
eye = torch.eye
sigmoid = torch.sigmoid


# Tensor methods as functions: ``f(x, *args, **kwargs)`` is ``x.method(*args, **kwargs)``.


def numpy(x: Tensor, *args: Any, **kwargs: Any) -> np.ndarray:
    """``x`` as a numpy array: detached from the graph and copied to the CPU if needed."""
    return x.detach().cpu().numpy(*args, **kwargs)


def size(x: Tensor, *args: Any, **kwargs: Any) -> int:
    """The number of elements of ``x`` (``x.numel()``), not its shape."""
    return x.numel(*args, **kwargs)


def reshape(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.reshape(shape)``: ``reshape(x, (2, -1))`` or ``reshape(x, 2, -1)``."""
    return x.reshape(*args, **kwargs)


def to(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.to(device or dtype)``."""
    return x.to(*args, **kwargs)


def reduce_sum(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.sum(dim, keepdim=False)``: the sum over ``dim``, or of everything."""
    return x.sum(*args, **kwargs)


def reduce_mean(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.mean(dim, keepdim=False)``: the mean over ``dim``, or of everything."""
    return x.mean(*args, **kwargs)


def argmax(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.argmax(dim)``; torch also takes numpy's ``axis=`` for ``dim``."""
    return x.argmax(*args, **kwargs)


def astype(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.type(dtype)``: ``x`` converted to ``dtype`` (a copy unless it has it already)."""
    return x.type(*args, **kwargs)


def transpose(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.t()``: a matrix ``(n, m)`` transposed to ``(m, n)`` (at most 2-D, as in d2l)."""
    return x.t(*args, **kwargs)


def expand_dims(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.unsqueeze(dim)``: a new axis of size 1 at ``dim``."""
    return x.unsqueeze(*args, **kwargs)


def swapaxes(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.swapaxes(axis0, axis1)``."""
    return x.swapaxes(*args, **kwargs)


def repeat(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``x.repeat(*sizes)``: ``x`` tiled ``sizes[i]`` times along axis ``i``."""
    return x.repeat(*args, **kwargs)


# The English edition's checks


class CheckError(AssertionError, ValueError):
    """A failed :func:`check_shape` or :func:`check_len`.

    An ``AssertionError``, as d2l raises (its checks are ``assert`` statements), and a
    ``ValueError``, as qkv's checks raise; unlike an ``assert`` it is not skipped under
    ``python -O``.
    """


def check_len(a: Any, n: int) -> None:
    """Raise :class:`CheckError` unless ``len(a) == n``."""
    if len(a) != n:
        raise CheckError(f"list's length {len(a)} != expected length {n}")


def check_shape(a: Any, shape: Sequence[int]) -> None:
    """Raise :class:`CheckError` unless ``a.shape`` is ``shape`` (a tuple, list or
    ``torch.Size``), in d2l's words: ``tensor's shape ... != expected shape ...``."""
    expected = tuple(shape) if isinstance(shape, Sequence) else shape
    if tuple(a.shape) != expected:
        raise CheckError(f"tensor's shape {a.shape} != expected shape {shape}")
