"""Does a head matter? Ablate it, or patch it from one prompt into another, and watch a
logit difference the user names.

- :func:`ablate`: run with a set of heads' outputs (``head_out``, before ``out_proj``)
  replaced by zero, or by their mean over a reference text;
- :func:`patch`: run a corrupted prompt with one head's output, or the residual stream
  entering a layer, at one position, taken from the clean prompt's run (activation
  patching); :func:`patch_sweep` does it for every layer, head and position.

Each returns the logit difference ``logit[good] - logit[bad]`` at the last position,
before and after, from :func:`logit_diff`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .capture import capture, intervene, tap_sites

__all__ = ["ABLATIONS", "Effect", "ablate", "ablated_logits", "logit_diff", "parse_heads",
           "patch", "patch_sweep"]

ABLATIONS = ("zero", "mean")


def parse_heads(text: str | Iterable[str]) -> list[tuple[int, int]]:
    """``"4.11"`` or ``["4.11", "5.0"]`` (``LAYER.HEAD``, 0-based) -> ``[(4, 11), (5, 0)]``."""
    items = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    heads = []
    for item in items:
        layer, dot, head = str(item).partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise ValueError(f"a head is LAYER.HEAD, both counted from 0 (e.g. 4.11), got "
                             f"{item!r}")
        heads.append((int(layer), int(head)))
    if not heads:
        raise ValueError("name at least one head, LAYER.HEAD (e.g. 4.11)")
    return heads


def logit_diff(logits: Tensor, good: int, bad: int | None = None) -> float:
    """``logits[0, -1, good] - logits[0, -1, bad]`` (the last position of the first
    sequence); without ``bad``, the logit of ``good`` alone."""
    last = logits[0, -1].double()
    return float(last[good] - (last[bad] if bad is not None else 0.0))


@dataclass
class Effect:
    """A logit difference without and with an intervention."""

    before: float
    after: float

    @property
    def change(self) -> float:
        return self.after - self.before


def _check_heads(model: nn.Module, heads: Sequence[tuple[int, int]]) -> None:
    sites = tap_sites(model)
    for layer, head in heads:
        if not 0 <= layer < len(sites):
            raise ValueError(f"head {layer}.{head}: layer {layer} does not exist; the model "
                             f"has layers 0..{len(sites) - 1}")
        att = sites[layer][2]
        if "head_out" not in getattr(att, "tap_points", ()):
            raise ValueError(f"head {layer}.{head}: layer {layer} has no per-head outputs "
                             "qkv can ablate")
        if not 0 <= head < att.num_heads:
            raise ValueError(f"head {layer}.{head}: layer {layer} has heads "
                             f"0..{att.num_heads - 1}")


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def ablated_logits(model: nn.Module, ids: Tensor, heads: Sequence[tuple[int, int]],
                   how: str = "zero", reference: Tensor | None = None) -> Tensor:
    """Logits ``(batch, T, vocab)`` of ``ids (batch, T)`` with each of ``heads``'s output
    (``head_out``, before ``out_proj``) replaced at every position: by zero
    (``how="zero"``), or by its mean over every position of ``reference (batch', T')``
    ids (``how="mean"``)."""
    if how not in ABLATIONS:
        raise ValueError(f"ablation must be one of {', '.join(ABLATIONS)}, got {how!r}")
    heads = list(heads)
    _check_heads(model, heads)
    if how == "mean" and reference is None:
        raise ValueError("mean ablation needs a reference text to average each head over")
    layers = sorted({layer for layer, _ in heads})
    means: dict[int, Tensor] = {}
    if how == "mean":
        with capture(model, ["head_out"], layers) as cache:
            model(reference.to(_device(model)))
        means = {layer: cache["head_out", layer].mean(dim=(0, 1)) for layer in layers}

    def editor(layer: int) -> Any:
        chosen = [h for lay, h in heads if lay == layer]

        def edit(out: Tensor) -> Tensor:  # (batch, T, H, head_dim)
            out = out.clone()
            for h in chosen:
                out[:, :, h] = 0.0 if how == "zero" else means[layer][h]
            return out
        return edit

    with intervene(model, {("head_out", layer): editor(layer) for layer in layers}):
        return model(ids.to(_device(model)))


@torch.no_grad()
def ablate(model: nn.Module, ids: Tensor, heads: Sequence[tuple[int, int]], good: int,
           bad: int | None = None, how: str = "zero", reference: Tensor | None = None
           ) -> Effect:
    """The logit difference (:func:`logit_diff`) of ``ids (1, T)`` without and with
    ``heads`` ablated (:func:`ablated_logits`)."""
    before = logit_diff(model(ids.to(_device(model))), good, bad)
    after = logit_diff(ablated_logits(model, ids, heads, how, reference), good, bad)
    return Effect(before, after)


PATCH_POINTS = ("head_out", "resid_pre")


@torch.no_grad()
def patch(model: nn.Module, clean: Tensor, corrupted: Tensor, *, point: str, layer: int,
          position: int, good: int, bad: int | None = None, head: int | None = None
          ) -> Effect:
    """Activation patching: run ``corrupted (1, T)`` with ``point`` of ``layer`` at
    ``position`` taken from the run of ``clean (1, T)`` (same length).

    ``point``: ``"head_out"`` (one head's output before ``out_proj``; give ``head``) or
    ``"resid_pre"`` (the residual stream entering ``layer``). Returns the corrupted run's
    logit difference before and after the patch.
    """
    if point not in PATCH_POINTS:
        raise ValueError(f"point must be one of {', '.join(PATCH_POINTS)}, got {point!r}")
    if clean.shape != corrupted.shape or clean.dim() != 2:
        raise ValueError(f"clean and corrupted must be ids of one shape (batch, T), got "
                         f"{tuple(clean.shape)} and {tuple(corrupted.shape)}")
    if not -clean.shape[1] <= position < clean.shape[1]:
        raise ValueError(f"position {position} is outside the {clean.shape[1]} tokens")
    if point == "head_out":
        if head is None:
            raise ValueError("patching head_out needs the head")
        _check_heads(model, [(layer, head)])
    device = _device(model)
    with capture(model, [point], [layer]) as cache:
        model(clean.to(device))
    source = cache[point, layer]

    def edit(x: Tensor) -> Tensor:
        x = x.clone()
        if point == "head_out":
            x[:, position, head] = source[:, position, head]
        else:
            x[:, position] = source[:, position]
        return x

    before = logit_diff(model(corrupted.to(device)), good, bad)
    with intervene(model, {(point, layer): edit}):
        after = logit_diff(model(corrupted.to(device)), good, bad)
    return Effect(before, after)


@torch.no_grad()
def patch_sweep(model: nn.Module, clean: Tensor, corrupted: Tensor, *, point: str,
                good: int, bad: int | None = None) -> Tensor:
    """:func:`patch`'s logit difference for every layer and position (``"resid_pre"``:
    ``(layers, T)``) or every layer, head and position (``"head_out"``: ``(layers, H,
    T)``; layers without per-head outputs are NaN)."""
    sites = tap_sites(model)
    t = clean.shape[1]
    if point == "resid_pre":
        out = torch.empty(len(sites), t, dtype=torch.float64)
        for layer in range(len(sites)):
            for pos in range(t):
                out[layer, pos] = patch(model, clean, corrupted, point=point, layer=layer,
                                        position=pos, good=good, bad=bad).after
        return out
    headed = [layer for layer, (_, _, att) in enumerate(sites)
              if "head_out" in getattr(att, "tap_points", ())]
    heads = max(sites[layer][2].num_heads for layer in headed)
    out = torch.full((len(sites), heads, t), float("nan"), dtype=torch.float64)
    for layer in headed:
        att = sites[layer][2]
        for h in range(att.num_heads):
            for pos in range(t):
                out[layer, h, pos] = patch(model, clean, corrupted, point=point, layer=layer,
                                           position=pos, good=good, bad=bad, head=h).after
    return out
