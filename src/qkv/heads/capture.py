"""Record what each layer and head computes, or replace it: ``capture`` and ``intervene``.

    with capture(model, names=["weights", "head_out"]) as cache:
        logits = model(ids)
    cache["weights", 3]          # (batch, heads, T, T) of layer 3

The points are :data:`qkv.options.CAPTURE_POINTS` (docs/heads.md renders the table):
queries, keys, values, pre-softmax scores and weights, each head's output before
``out_proj`` inside an attention module, and the residual stream around a decoder
block. Recording sets the modules' ``tap`` (see :class:`qkv.MultiHeadAttention`), no
forward hook: what is not asked for runs as it always does, on the fused kernels, and
the scores and weights are computed beside the kernel, so the logits are the same
with or without a capture. A generation through the KV cache is recorded one call at
a time (``generate`` then runs the model's forward, not the C kernels), and the calls
are joined along the token axis.

Layers: a :class:`~qkv.models.gpt.GPTModel`'s layer ``i`` is its block ``i``; any other
model (a translator) has one layer per attention module that can be tapped, in the order
of ``named_modules`` (:func:`layer_names` lists them), and no block points. An attention
module names the points it computes in ``tap_points`` and those it only reads in
``tap_read_only`` (:func:`layers_table`): multi-head attention and its variants all six;
latent and sparse latent attention all six, ``k`` and ``v`` decompressed from the latent
for the record (read only, as ``scores`` and ``weights``); Gated DeltaNet ``q``, ``k``,
``v`` and ``head_out`` (a recurrence: no softmax over keys, so no scores or weights, and
the catalogue skips it); the Bahdanau translator's additive attention, as one head, all
but ``v``, read only. ``names=None`` asks each layer for the points it has; a point asked
by name of a layer without it is a one-line error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..options import CAPTURE_POINTS

__all__ = ["ActivationCache", "capture", "intervene", "layer_names", "layers_table",
           "names_table", "tap_sites",
           "ATTENTION_POINTS", "BLOCK_POINTS"]

ATTENTION_POINTS = tuple(n for n, (where, _, _) in CAPTURE_POINTS.items() if where == "attention")
BLOCK_POINTS = tuple(n for n, (where, _, _) in CAPTURE_POINTS.items() if where == "block")
# The token axis of each point, along which the calls of a generation are joined.
_TOKEN_AXIS = {"q": 2, "k": 2, "v": 2, "scores": 2, "weights": 2, "head_out": 1,
               **dict.fromkeys(BLOCK_POINTS, 1)}

Handler = Callable[[int, str, Tensor], Tensor | None]


class _Taps:
    """A module's ``tap``: the handlers of the captures and interventions open on it, run
    in the order they were opened; one returning a tensor replaces the point's value."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.handlers: list[tuple[frozenset[str], Handler]] = []
        self.names: frozenset[str] = frozenset()

    def add(self, names: frozenset[str], handler: Handler) -> None:
        self.handlers.append((names, handler))
        self.names = self.names | names

    def remove(self, handler: Handler) -> None:
        self.handlers = [(n, h) for n, h in self.handlers if h is not handler]
        self.names = frozenset().union(*(n for n, _ in self.handlers))

    def __call__(self, name: str, tensor: Tensor) -> Tensor:
        for names, handler in self.handlers:
            if name in names:
                out = handler(self.layer, name, tensor)
                if out is not None:
                    if out.shape != tensor.shape:
                        raise ValueError(f"an intervention on {name!r} of layer {self.layer} "
                                         f"returned shape {tuple(out.shape)}, it must keep "
                                         f"{tuple(tensor.shape)}")
                    tensor = out
        return tensor


def _points(module: nn.Module | None) -> frozenset[str]:
    """The attention points ``module`` computes (its ``tap_points``); none for None."""
    return frozenset(getattr(module, "tap_points", ()))


def tap_sites(model: nn.Module) -> list[tuple[str, nn.Module | None, nn.Module | None]]:
    """One ``(name, block, attention)`` per layer of ``model``: a GPTModel's blocks (the
    attention None where it records nothing per head), else every attention module in it
    that can be tapped (one with ``tap_points``: :class:`qkv.MultiHeadAttention`,
    :class:`qkv.AdditiveAttention`, ...; block None)."""
    blocks = getattr(model, "trf_blocks", None)
    if blocks is not None:
        return [(f"trf_blocks.{i}", block, block.att if _points(block.att) else None)
                for i, block in enumerate(blocks)]
    return [(name, None, module) for name, module in model.named_modules()
            if _points(module)]


def layer_names(model: nn.Module) -> list[str]:
    """The module path of each layer :func:`capture` numbers (``trf_blocks.3``,
    ``decoder.blks.0.cross_attention``, ...)."""
    return [name for name, _, _ in tap_sites(model)]


def _kind(block: nn.Module | None, att: nn.Module | None) -> str:
    spec = getattr(block, "spec", None)
    return spec.attention if spec is not None else type(att).__name__


def _check_request(model: nn.Module, names: Iterable[str] | None, layers: Iterable[int] | None,
                   what: str) -> tuple[list[tuple[str, nn.Module | None, nn.Module | None]],
                                       tuple[str, ...], tuple[int, ...]]:
    """The sites, names and layers of a capture or intervention, checked (one line).
    ``names`` None: every point, each layer giving those it has."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} needs a torch.nn.Module, got {type(model).__name__}")
    sites = tap_sites(model)
    if not sites:
        raise ValueError(f"{what}: {type(model).__name__} has no layer qkv can tap (a "
                         "GPTModel, or a model built of qkv.MultiHeadAttention)")
    strict = names is not None
    names = tuple(CAPTURE_POINTS) if names is None else tuple(names)
    for name in names:
        if name not in CAPTURE_POINTS:
            raise ValueError(f"{what}: unknown point {name!r}; valid: "
                             f"{', '.join(CAPTURE_POINTS)}")
    layers = tuple(range(len(sites))) if layers is None else tuple(layers)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or \
                not 0 <= layer < len(sites):
            raise ValueError(f"{what}: layer {layer!r} does not exist; the model has layers "
                             f"0..{len(sites) - 1}")
    if not strict:
        return sites, names, layers
    asked_block = [n for n in names if n in BLOCK_POINTS]
    for layer in layers:
        _, block, att = sites[layer]
        missing = [n for n in names if n in ATTENTION_POINTS and n not in _points(att)]
        if missing:
            has = sorted(_points(att), key=ATTENTION_POINTS.index)
            raise ValueError(f"{what}: layer {layer} is a {_kind(block, att)!r} layer, which "
                             f"has no {missing[0]!r}; pass layers= without it, or points "
                             f"it has ({', '.join(has + list(BLOCK_POINTS))})")
        if asked_block and block is None:
            raise ValueError(f"{what}: {asked_block[0]!r} is a decoder block's point; this "
                             f"model's layers are attention modules: ask for "
                             f"{', '.join(ATTENTION_POINTS)}")
    return sites, names, layers


@contextlib.contextmanager
def _tapping(sites: list, names: tuple[str, ...], layers: tuple[int, ...],
             handler: Handler) -> Iterator[None]:
    """Add ``handler`` to the taps of ``layers``' modules for ``names``; remove it (and a
    tap left empty) on exit, whatever happens inside."""
    touched: list[nn.Module] = []
    try:
        for layer in layers:
            _, block, att = sites[layer]
            for module, points in ((att, _points(att)), (block, BLOCK_POINTS)):
                wanted = frozenset(n for n in names if n in points)
                if module is None or not wanted:
                    continue
                if module.tap is None:
                    module.tap = _Taps(layer)
                module.tap.add(wanted, handler)
                touched.append(module)
        yield
    finally:
        for module in touched:
            module.tap.remove(handler)
            if not module.tap.handlers:
                module.tap = None


class ActivationCache(Mapping):
    """What :func:`capture` recorded: ``cache[name, layer]`` is a tensor (the calls joined
    along the token axis), ``cache.steps(name, layer)`` the list of calls' tensors.

    Joining the calls of a generation through the KV cache (a prompt, then one token at a
    time) gives the tensors a call on the whole sequence gives: ``scores`` and ``weights``
    rows are padded on the key axis to the last call's keys (``-inf`` and 0: keys a query
    could not see). A ring cache (sliding window) keeps its keys in slot order, not in
    time: read its calls with :meth:`steps`.
    """

    def __init__(self, names: tuple[str, ...], layers: tuple[int, ...],
                 layer_names: list[str], device: str | torch.device | None) -> None:
        self.names, self.layers, self.layer_names = names, layers, layer_names
        self.device = device
        self._steps: dict[tuple[str, int], list[Tensor]] = {}

    def _record(self, layer: int, name: str, tensor: Tensor) -> None:
        kept = tensor.detach()
        kept = kept.to(self.device) if self.device is not None else kept.clone()
        self._steps.setdefault((name, layer), []).append(kept)

    def steps(self, name: str, layer: int) -> list[Tensor]:
        """Each forward call's tensor at ``(name, layer)``, in order."""
        return list(self._steps[self._key((name, layer))])

    def _key(self, key: Any) -> tuple[str, int]:
        if not (isinstance(key, tuple) and len(key) == 2):
            raise KeyError(f"index the cache by (name, layer), e.g. ('weights', 0); got {key!r}")
        if key not in self._steps:
            raise KeyError(f"nothing recorded at {key!r}: the capture holds names "
                           f"{list(self.names)} of layers {list(self.layers)}, and records "
                           f"only while the model runs inside it")
        return key

    def __getitem__(self, key: Any) -> Tensor:
        name, layer = self._key(key)
        parts = self._steps[(name, layer)]
        if len(parts) == 1:
            return parts[0]
        if name in ("scores", "weights"):
            width = max(p.shape[-1] for p in parts)
            fill = float("-inf") if name == "scores" else 0.0
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=fill)
                     for p in parts]
        return torch.cat(parts, dim=_TOKEN_AXIS[name])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        calls = max((len(v) for v in self._steps.values()), default=0)
        return (f"ActivationCache(names={list(self.names)}, layers={list(self.layers)}, "
                f"calls={calls})")


@contextlib.contextmanager
def capture(model: nn.Module, names: Iterable[str] | None = None,
            layers: Iterable[int] | None = None, *,
            device: str | torch.device | None = None) -> Iterator[ActivationCache]:
    """Record ``names`` (default: every point of :data:`qkv.options.CAPTURE_POINTS`) of
    ``layers`` (default: all) while ``model`` runs inside the ``with`` block.

    Only what is asked for is kept (detached copies; moved to ``device`` if given), so
    ``names`` and ``layers`` bound the memory: ``weights`` of every layer is ``layers x
    batch x H x T x T`` values. Nothing is allocated before the request is checked.

    Returns the :class:`ActivationCache`, filled as the model runs.
    """
    sites, names, layers = _check_request(model, names, layers, "capture")
    cache = ActivationCache(names, layers, [n for n, _, _ in sites], device)

    def record(layer: int, name: str, tensor: Tensor) -> None:
        cache._record(layer, name, tensor)

    with _tapping(sites, names, layers, record):
        yield cache


Edit = Callable[[Tensor], Tensor]


@contextlib.contextmanager
def intervene(model: nn.Module, edits: Mapping[tuple[str, int], Edit]) -> Iterator[None]:
    """Run ``model`` inside the ``with`` block with each ``edits[(name, layer)]``, a
    function of the point's tensor returning its replacement of the same shape, applied
    where the point is computed (``q``, ``k``, ``v``, ``head_out`` and the block points;
    ``scores`` and ``weights`` are only read, see :func:`capture`). The rest of the model
    runs as always; the model is unchanged afterwards."""
    if not isinstance(edits, Mapping) or not edits:
        raise ValueError("intervene needs edits: a dict {(name, layer): function}")
    for key, edit in edits.items():
        if not (isinstance(key, tuple) and len(key) == 2) or not callable(edit):
            raise ValueError(f"intervene: each edit is (name, layer) -> function, got "
                             f"{key!r} -> {type(edit).__name__}")
    by_layer: dict[int, dict[str, Edit]] = {}
    for (name, layer), edit in edits.items():
        sites, _, _ = _check_request(model, [name], [layer], "intervene")
        _, block, att = sites[layer]
        if name in getattr(att, "tap_read_only", ()):
            editable = [n for n in ATTENTION_POINTS
                        if n in _points(att) and n not in att.tap_read_only]
            raise ValueError(f"intervene: {name!r} is computed beside the kernel and only "
                             f"read in layer {layer} (a {_kind(block, att)!r} layer); "
                             + (f"edit {', '.join(editable)}" if editable else
                                "none of its points can be edited"))
        by_layer.setdefault(layer, {})[name] = edit
    sites = tap_sites(model)

    def apply(layer: int, name: str, tensor: Tensor) -> Tensor:
        return by_layer[layer][name](tensor)

    with contextlib.ExitStack() as stack:
        for layer, layer_edits in by_layer.items():
            stack.enter_context(_tapping(sites, tuple(layer_edits), (layer,), apply))
        yield


def layers_table() -> str:
    """Which attention points each kind of layer gives, read from the classes'
    ``tap_points`` and ``tap_read_only``: the Markdown table docs/heads.md shows."""
    from ..latent_attention import LatentAttention, SparseLatentAttention
    from ..linear_attention import GatedDeltaNet
    from ..multihead import MultiHeadAttention
    from ..scoring import AdditiveAttention

    lines = ["| layer | attention points | only read |", "|---|---|---|"]
    for cls in (MultiHeadAttention, LatentAttention, SparseLatentAttention, GatedDeltaNet,
                AdditiveAttention):
        points = [n for n in ATTENTION_POINTS if n in cls.tap_points]
        read = [n for n in points if n in cls.tap_read_only]
        lines.append(f"| `{cls.__name__}` | {', '.join(points)} | "
                     f"{', '.join(read) or 'none'} |")
    return "\n".join(lines)


def names_table() -> str:
    """:data:`qkv.options.CAPTURE_POINTS` as the Markdown table docs/heads.md shows."""
    lines = ["| name | where | shape | what it holds |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {where} | `{shape}` | {meaning} |"
              for name, (where, shape, meaning) in CAPTURE_POINTS.items()]
    return "\n".join(lines)
