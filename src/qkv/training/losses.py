"""Masked sequence losses.

Sequences in a batch are padded to a common length; only the first ``valid_len``
positions of each carry a real target. The loss must ignore the rest, and it must be
normalised per *valid token*: d2l's ``MaskedSoftmaxCELoss`` zeroes the padded positions
but then averages over all ``num_steps`` positions, so a short sentence's loss is diluted
by its padding. Here padding never enters either the sum or the count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["masked_cross_entropy", "MaskedSoftmaxCELoss", "valid_mask"]


def valid_mask(valid_len: Tensor, num_steps: int) -> Tensor:
    """``(batch,)`` lengths -> ``(batch, num_steps)`` bool, True where ``position < valid_len``."""
    positions = torch.arange(num_steps, device=valid_len.device)
    return positions[None, :] < valid_len[:, None]


def _check_shapes(logits: Tensor, targets: Tensor, valid_len: Tensor) -> None:
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            "expected logits (batch, T, vocab) and targets (batch, T), got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if valid_len.shape != targets.shape[:1]:
        raise ValueError(
            f"valid_len must have shape (batch,) = ({targets.shape[0]},), "
            f"got {tuple(valid_len.shape)}"
        )


def masked_cross_entropy(
    logits: Tensor, targets: Tensor, valid_len: Tensor, *, label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Softmax cross-entropy summed over the valid positions only.

    Args:
        logits: ``(batch, T, vocab)`` unnormalised scores.
        targets: ``(batch, T)`` class indices.
        valid_len: ``(batch,)``; position ``t`` of example ``b`` counts when
            ``t < valid_len[b]``.
        label_smoothing: ``eps`` in ``[0, 1)``: the target distribution puts ``1 - eps``
            on the target and spreads ``eps`` evenly over all ``vocab`` classes (the
            target included), as ``torch.nn.functional.cross_entropy`` defines it.

    Returns:
        ``(loss_sum, num_tokens)``: two scalar tensors on the logits' device (float
        and int64). The per-token loss is ``loss_sum / num_tokens``; returning both lets a
        trainer accumulate exact epoch averages over batches of different sizes.
    """
    _check_shapes(logits, targets, valid_len)
    mask = valid_mask(valid_len, targets.shape[1])
    # Padded positions get ignore_index, so cross_entropy neither adds them to the sum
    # nor sends them gradient; unlike boolean indexing this keeps shapes static (no
    # host-device sync on CUDA).
    ignore = -100
    masked_targets = torch.where(mask, targets, torch.full_like(targets, ignore))
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        masked_targets.reshape(-1),
        ignore_index=ignore,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return loss_sum, mask.sum()


class MaskedSoftmaxCELoss(nn.CrossEntropyLoss):
    """d2l's masked loss under d2l's name and call: ``loss(pred, label, valid_len)``.

    ``pred (batch, T, vocab)``, ``label (batch, T)``, ``valid_len (batch,)`` ->
    ``(batch,)``: each sequence's mean loss over its *valid* tokens (0 for an empty one).

    Difference from d2l, on purpose: d2l returns the masked sum divided by ``T``, so
    a sequence with 2 valid tokens out of ``T = 4`` scores half its true per-token
    loss. Training code should prefer :func:`masked_cross_entropy`, which also gives the
    token count for an exact batch average.
    """

    def __init__(self, *, label_smoothing: float = 0.0) -> None:
        # d2l flips ``self.reduction`` inside forward; fixing it here keeps forward pure.
        super().__init__(reduction="none", label_smoothing=label_smoothing)

    def forward(self, pred: Tensor, label: Tensor, valid_len: Tensor) -> Tensor:  # type: ignore[override]
        _check_shapes(pred, label, valid_len)
        mask = valid_mask(valid_len, label.shape[1])
        # nn.CrossEntropyLoss wants the class axis second: (batch, vocab, T).
        per_token = super().forward(pred.permute(0, 2, 1), label)
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
        return per_token.sum(dim=1) / mask.sum(dim=1).clamp_min(1)
