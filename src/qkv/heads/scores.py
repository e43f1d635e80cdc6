"""A catalogue of every head: what it attends to, scored from its attention weights.

Each score is a mean over a batch of sequences of one layer's weights ``A (batch, H, T,
T)``; :data:`SCORES` defines them (docs/heads.md renders it). The standard input is the
induction protocol (:func:`induction_batch`): a first token (BOS), ``n`` random tokens,
the same ``n`` again; in the second copy the token at ``i`` is the one at ``i - n``, and
the one after it was at ``i - n + 1``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..checks import check_positive_int
from ..utils.fileio import write_atomic
from .capture import capture, tap_sites

__all__ = ["SCORES", "SINK_EPSILON", "LOCAL_WINDOW", "induction_batch", "scores_of_weights",
           "head_scores", "scored_layers", "InductionProtocol", "sink_metric",
           "format_table", "write_table", "score_grid", "plot_score_maps", "scores_table"]

SINK_EPSILON = 0.3  # Gu et al.'s threshold on a head's mean weight on the first token
LOCAL_WINDOW = 4  # "local": the weight on the query's own token and the 3 before it

# name -> definition, in the order of the table. Queries i run over 1 .. T-1 (query 0 can
# only see itself) unless the definition says otherwise; "second copy": i in n+1 .. 2n.
SCORES: dict[str, str] = {
    "entropy": "mean over queries of -sum_j A[i,j] ln A[i,j], in nats (0 ln 0 = 0): low is "
               "a focused head, ln(i+1) a uniform one",
    "sink": "mean weight on the first token, over every query i = 0 .. T-1 (Gu et al.'s "
            "alpha_1, query 0 included)",
    "sink_gu": f"Gu et al.'s Sink indicator at epsilon = {SINK_EPSILON}: 1 if sink > "
               f"{SINK_EPSILON}, else 0; its mean over heads is the model's Sink_1 metric",
    "previous_token": "mean weight on the token just before: A[i, i-1]",
    "duplicate_token": "second copy only: mean weight on the earlier occurrence of the "
                       "same token, A[i, i-n]",
    "induction": "second copy only: mean weight on the token after the earlier occurrence "
                 "of the same token, A[i, i-n+1]",
    "local": f"mean weight on the last {LOCAL_WINDOW} tokens, the query's own included: "
             f"sum of A[i, j] for i-{LOCAL_WINDOW - 1} <= j <= i",
    "distance": "mean attention distance in tokens: sum_j A[i, j] (i - j)",
}


class InductionProtocol:
    """The sizes and seed of :func:`induction_batch`, to print beside the scores."""

    def __init__(self, length: int = 50, batch: int = 10, seed: int = 0, bos_id: int = 0,
                 low: int | None = None, high: int | None = None) -> None:
        check_positive_int("length", length)
        check_positive_int("batch", batch)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.length, self.batch = length, batch
        self.seed, self.bos_id, self.low, self.high = seed, bos_id, low, high

    def ids(self, vocab_size: int) -> Tensor:
        """``(batch, 1 + 2 * length)`` ids: :func:`induction_batch` with these settings."""
        return induction_batch(vocab_size, length=self.length, batch=self.batch,
                               seed=self.seed, bos_id=self.bos_id, low=self.low, high=self.high)

    def describe(self, vocab_size: int) -> str:
        low, high = _token_range(vocab_size, self.low, self.high)
        return (f"induction protocol: {self.batch} sequences of BOS (id {self.bos_id}) + "
                f"{self.length} random tokens (ids {low}..{high - 1}, seed {self.seed}) "
                f"repeated once: {1 + 2 * self.length} tokens")


def _token_range(vocab_size: int, low: int | None, high: int | None) -> tuple[int, int]:
    # A real tokenizer's specials and rarest merges sit at the ends of its ids: draw from
    # the ordinary ones (ids 100 .. 19,999 of a large vocabulary), all but id 0 of a toy one.
    big = vocab_size > 1000
    low = (100 if big else 1) if low is None else low
    high = (min(vocab_size, 20_000) if big else vocab_size) if high is None else high
    if not 0 <= low < high <= vocab_size:
        raise ValueError(f"the random tokens' ids must satisfy 0 <= low < high <= "
                         f"vocab_size={vocab_size}, got low={low}, high={high}")
    return low, high


def induction_batch(vocab_size: int, *, length: int = 50, batch: int = 10, seed: int = 0,
                    bos_id: int = 0, low: int | None = None, high: int | None = None) -> Tensor:
    """The induction protocol: ``(batch, 1 + 2 * length)`` ids, each row ``bos_id``, then
    ``length`` tokens drawn uniformly from ``low .. high - 1`` (default: 100 .. 19,999,
    or 1 .. vocab_size - 1 for a vocabulary of at most 1,000) by a generator seeded with
    ``seed``, then the same ``length`` tokens again."""
    check_positive_int("length", length)
    check_positive_int("batch", batch)
    if not 0 <= bos_id < vocab_size:
        raise ValueError(f"bos_id must be an id of the vocabulary (0..{vocab_size - 1}), "
                         f"got {bos_id}")
    low, high = _token_range(vocab_size, low, high)
    generator = torch.Generator().manual_seed(seed)
    half = torch.randint(low, high, (batch, length), generator=generator)
    bos = torch.full((batch, 1), bos_id, dtype=torch.long)
    return torch.cat((bos, half, half), dim=1)


def scores_of_weights(weights: Tensor, repeat: int | None = None) -> dict[str, Tensor]:
    """Every score of :data:`SCORES`, per head, from one layer's causal weights.

    ``weights (batch, H, T, T)``; ``repeat``: ``n`` when the rows are BOS + ``n`` tokens
    + the same ``n`` (``T = 2n + 1``), for ``duplicate_token`` and ``induction`` (left
    out otherwise). Returns ``{score: (H,)}`` in float64.
    """
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2] or weights.shape[-1] < 2:
        raise ValueError(f"weights must be (batch, heads, T, T) with T >= 2, got "
                         f"{tuple(weights.shape)}")
    a = weights.detach().double()
    t = a.shape[-1]
    queries = torch.arange(1, t)
    rows = a[:, :, 1:, :]  # queries 1 .. T-1: (batch, H, T-1, T)
    plogp = torch.where(rows > 0, rows * rows.clamp_min(1e-300).log(), rows.new_zeros(()))
    out = {"entropy": (-plogp.sum(-1)).mean(dim=(0, 2))}
    sink = a[..., :, 0].mean(dim=(0, 2))
    out["sink"] = sink
    out["sink_gu"] = (sink > SINK_EPSILON).double()
    out["previous_token"] = a[:, :, queries, queries - 1].mean(dim=(0, 2))
    if repeat is not None:
        if t != 2 * repeat + 1:
            raise ValueError(f"repeat={repeat} needs T = 2 * repeat + 1 = {2 * repeat + 1} "
                             f"tokens, the weights have {t}")
        second = torch.arange(repeat + 1, t)
        out["duplicate_token"] = a[:, :, second, second - repeat].mean(dim=(0, 2))
        out["induction"] = a[:, :, second, second - repeat + 1].mean(dim=(0, 2))
    keys = torch.arange(t)
    gap = (queries[:, None] - keys[None, :]).double()  # (T-1, T): i - j
    near = ((gap >= 0) & (gap < LOCAL_WINDOW)).double()
    out["local"] = (rows * near).sum(-1).mean(dim=(0, 2))
    out["distance"] = (rows * gap.clamp_min(0)).sum(-1).mean(dim=(0, 2))
    return {name: out[name] for name in SCORES if name in out}


def scored_layers(model: nn.Module) -> list[int]:
    """The layers :func:`head_scores` scores: those whose attention records per-head
    softmax ``weights`` (not a Gated DeltaNet layer's, which has no softmax)."""
    return [i for i, (_, _, att) in enumerate(tap_sites(model))
            if "weights" in getattr(att, "tap_points", ())]


@torch.no_grad()
def head_scores(model: nn.Module, ids: Tensor, repeat: int | None = None,
                layers: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Run ``model`` on ``ids (batch, T)`` once, recording the weights, and score every
    head of ``layers`` (default: each that has per-head softmax weights).

    Returns one dict per head, ``{"layer", "head", score: float, ...}`` (0-based), layer
    by layer; see :func:`scores_of_weights` for ``repeat``.
    """
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"ids must be integer token ids (batch, T), got "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")
    if layers is None:
        layers = scored_layers(model)
    layers = list(layers)
    if not layers:
        raise ValueError("the model has no layer with per-head softmax weights to score")
    was_training = model.training
    model.eval()
    try:
        with capture(model, ["weights"], layers) as cache:
            model(ids.to(next(model.parameters()).device))
    finally:
        model.train(was_training)
    table = []
    for layer in layers:
        scores = scores_of_weights(cache["weights", layer], repeat)
        for head in range(next(iter(scores.values())).shape[0]):
            row: dict[str, Any] = {"layer": layer, "head": head}
            row.update({name: float(values[head]) for name, values in scores.items()})
            table.append(row)
    return table


def sink_metric(table: Sequence[dict[str, Any]]) -> float:
    """Gu et al.'s Sink_1 at epsilon :data:`SINK_EPSILON`: the percentage of heads whose
    mean weight on the first token exceeds it."""
    if not table:
        return math.nan
    return 100.0 * sum(row["sink_gu"] for row in table) / len(table)


def format_table(table: Sequence[dict[str, Any]]) -> str:
    """The catalogue as a terminal table: one line per head, a column per score."""
    names = [n for n in SCORES if n in table[0]] if table else []
    header = f"{'layer':>5} {'head':>4} " + " ".join(f"{n[:10]:>10}" for n in names)
    lines = [header]
    for row in table:
        lines.append(f"{row['layer']:>5} {row['head']:>4} "
                     + " ".join(f"{row[n]:>10.4f}" for n in names))
    return "\n".join(lines)


def write_table(table: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write the catalogue to ``path``: JSON (a list of ``{"layer", "head", score: value}``,
    0-based) for ``.json``, CSV (a header, then a row per head) for ``.csv``."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(list(table), indent=1) + "\n"
    elif path.suffix.lower() == ".csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(table[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)
        text = buffer.getvalue()
    else:
        raise ValueError(f"{path}: write the table to a .json or .csv file")
    return write_atomic(path, text.encode())


def score_grid(table: Sequence[dict[str, Any]], name: str) -> np.ndarray:
    """``(layers, heads)`` of score ``name``; NaN where a layer has no such head."""
    layers = max(r["layer"] for r in table) + 1
    heads = max(r["head"] for r in table) + 1
    grid = np.full((layers, heads), np.nan)
    for row in table:
        grid[row["layer"], row["head"]] = row[name]
    return grid


def plot_score_maps(table: Sequence[dict[str, Any]], folder: str | Path, title: str = ""
                    ) -> list[Path]:
    """One layers x heads heatmap per score, ``folder/heads-SCORE.png``; the paths."""
    from ..utils.figures import new_figure, save_figure

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in (n for n in SCORES if n in table[0]):
        grid = score_grid(table, name)
        fig = new_figure(1.2 + 0.35 * grid.shape[1], 1.2 + 0.3 * grid.shape[0])
        ax = fig.add_subplot()
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{name}{': ' + title if title else ''}", fontsize=8)
        fig.colorbar(image, ax=ax)
        paths.append(save_figure(fig, folder / f"heads-{name}.png"))
    return paths


def scores_table() -> str:
    """:data:`SCORES` as the Markdown table docs/heads.md shows."""
    lines = ["| score | definition (A: one head's weights, queries i, keys j) |", "|---|---|"]
    lines += [f"| `{name}` | {definition} |" for name, definition in SCORES.items()]
    return "\n".join(lines)
