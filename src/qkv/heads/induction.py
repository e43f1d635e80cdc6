"""An induction head forming: train a 2-layer attention-only transformer on repeated
random segments and score its heads as it learns (Olsson et al., 2022).

Each training sequence is BOS, ``n`` random tokens, the same ``n`` again. The first copy
cannot be predicted; the second can, by a two-head circuit: a previous-token head in
layer 0 writes "the token before me was A" into each position, and a layer-1 head whose
query is the current token A finds the position whose previous token was A (its key,
written by that head) and copies the token there: the induction head. Its forming shows
as a sudden drop of the loss on the second copy, at the step where the layer-1 head's
induction score rises.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checks import check_positive_int
from ..multihead import MultiHeadAttention
from ..utils.fileio import write_atomic
from .scores import head_scores, induction_batch

__all__ = ["AttentionOnly", "train_induction", "plot_history"]


class AttentionOnly(nn.Module):
    """A transformer without MLPs: token + position embeddings, ``layers`` pre-norm
    blocks ``x + attention(norm(x))`` of :class:`qkv.MultiHeadAttention` (causal), a final
    norm and an unembedding. ``ids (batch, T) -> logits (batch, T, vocab)``."""

    def __init__(self, vocab_size: int, context_length: int, width: int = 64, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, width)
        self.pos_emb = nn.Embedding(context_length, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.attention = nn.ModuleList(
            MultiHeadAttention(width, width, context_length, 0.0, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.out_head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        for norm, att in zip(self.norms, self.attention, strict=True):
            x = x + att(norm(x))
        return self.out_head(self.final_norm(x))


def _losses(model: nn.Module, ids: Tensor, repeat: int) -> tuple[Tensor, float]:
    """The mean next-token loss over all positions (for training) and over the second
    copy's predictions alone (the in-context loss)."""
    logits = model(ids[:, :-1])
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                            reduction="none")
    # predictions of tokens repeat+1 .. 2*repeat (targets of the second copy, but its first)
    second = per_token[:, repeat + 1:]
    return per_token.mean(), float(second.detach().mean())


def train_induction(run_dir: str | Path, *, steps: int = 800, vocab_size: int = 64,
                    repeat: int = 16, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                    every: int = 50, log: Callable[[str], None] | None = None
                    ) -> list[dict[str, Any]]:
    """Train :class:`AttentionOnly` (2 layers, 4 heads, width 64) on BOS + ``n`` random
    tokens + the same again (``n`` drawn per batch from ``repeat // 2 .. repeat``),
    scoring its heads every ``every`` steps on a fixed held-out batch of the protocol
    (``n = repeat``). Writes ``run_dir/heads-history.json``, a list of
    ``{"step", "loss", "in_context_loss", "heads": [{"layer", "head", "previous_token",
    "induction"}]}``, and returns it."""
    for name, value in (("steps", steps), ("vocab_size", vocab_size), ("repeat", repeat),
                        ("batch_size", batch_size), ("every", every)):
        check_positive_int(name, value)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AttentionOnly(vocab_size, 2 * repeat + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    probe = induction_batch(vocab_size, length=repeat, batch=16, seed=seed + 1)
    generator = torch.Generator().manual_seed(seed + 2)
    history: list[dict[str, Any]] = []
    start = time.perf_counter()

    def record(step: int, loss: float) -> None:
        model.eval()
        with torch.no_grad():
            _, in_context = _losses(model, probe, repeat)
        table = head_scores(model, probe, repeat=repeat)
        model.train()
        history.append({"step": step, "loss": loss, "in_context_loss": in_context,
                        "heads": [{k: row[k] for k in ("layer", "head", "previous_token",
                                                       "induction")} for row in table]})
        if log is not None:
            best = max(table, key=lambda r: r["induction"] if r["layer"] == 1 else -1)
            prev = max(r["previous_token"] for r in table if r["layer"] == 0)
            log(f"step {step:5d}  loss {loss:.3f}  second copy {in_context:.3f}  "
                f"best layer-0 previous-token {prev:.2f}  best layer-1 induction "
                f"{best['induction']:.2f} (head {best['head']})  "
                f"{time.perf_counter() - start:.0f} s")

    model.train()
    with torch.no_grad():
        first, _ = _losses(model, probe, repeat)
    record(0, float(first))
    for step in range(1, steps + 1):
        # Each batch its own segment length: with one fixed offset between the copies a
        # head could find "the token after the earlier one" by position alone.
        length = int(torch.randint(repeat // 2, repeat + 1, (), generator=generator))
        ids = induction_batch(vocab_size, length=length, batch=batch_size,
                              seed=int(torch.randint(0, 2**31 - 1, (), generator=generator)))
        loss, _ = _losses(model, ids, length)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % every == 0 or step == steps:
            record(step, loss.item())
    write_atomic(run_dir / "heads-history.json", (json.dumps(history) + "\n").encode())
    return history


def plot_history(history: list[dict[str, Any]], path: str | Path) -> Path:
    """Loss (all tokens and the second copy) and each head's previous-token and induction
    scores over the steps, in three panels."""
    from ..utils.figures import new_figure, save_figure

    steps = [h["step"] for h in history]
    fig = new_figure(11, 3.4)
    loss_ax, prev_ax, ind_ax = fig.subplots(1, 3)
    loss_ax.plot(steps, [h["loss"] for h in history], label="all tokens")
    loss_ax.plot(steps, [h["in_context_loss"] for h in history], label="second copy")
    loss_ax.set_title("loss (nats)")
    loss_ax.legend(fontsize=7)
    heads = [(r["layer"], r["head"]) for r in history[0]["heads"]]
    for ax, score in ((prev_ax, "previous_token"), (ind_ax, "induction")):
        for index, (layer, head) in enumerate(heads):
            ax.plot(steps, [h["heads"][index][score] for h in history],
                    linestyle="-" if layer == 0 else "--", label=f"{layer}.{head}")
        ax.set_title(f"{score} score per head (layer.head)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=6, ncol=2)
    for ax in (loss_ax, prev_ax, ind_ax):
        ax.set_xlabel("step")
    return save_figure(fig, path)


def chance_loss(vocab_size: int) -> float:
    """The loss of a uniform guess, ``ln(vocab_size)``: the first copy's floor."""
    return math.log(vocab_size)
