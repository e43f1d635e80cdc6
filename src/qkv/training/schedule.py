"""Learning-rate schedules: a linear warm-up, then a decay, as one pure function of the step.

The rate of optimizer step ``s`` (counting from 0) is ``peak_lr * schedule.factor(s)``.
Because the factor depends on the step alone, a resumed run needs no scheduler state:
the trainer saves its step count, and the rate follows from it.

    warm-up (s < warmup_steps):  factor = (s + 1) / warmup_steps
    then, with p = (s - warmup_steps) / (total_steps - warmup_steps), clamped to [0, 1]:
      "constant":      1
      "linear":        min_factor + (1 - min_factor) * (1 - p)
      "cosine":        min_factor + (1 - min_factor) * (1 + cos(pi * p)) / 2
      "inverse_sqrt":  sqrt(warmup_steps / (s + 1))   (the original Transformer's, with
                       the peak at the end of warm-up; it needs no total_steps)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checks import MAX_COUNT, check_float, check_int, check_str
from ..options import DECAYS

__all__ = ["DECAYS", "LRSchedule"]


@dataclass(frozen=True)
class LRSchedule:
    """A warm-up + decay multiplier of the peak learning rate.

    Attributes:
        warmup_steps: steps of linear warm-up from ``1 / warmup_steps`` to 1; 0: none.
        decay: one of :data:`DECAYS`.
        total_steps: the step at which ``"linear"`` and ``"cosine"`` reach
            ``min_factor``; None lets the trainer fill in its epochs x batches per epoch.
        min_factor: the floor of ``"linear"`` and ``"cosine"``, in ``[0, 1]``.
    """

    warmup_steps: int = 0
    decay: str = "constant"
    total_steps: int | None = None
    min_factor: float = 0.0

    def __post_init__(self) -> None:
        check_int("warmup_steps", self.warmup_steps, 0, MAX_COUNT)
        check_str("decay", self.decay, choices=DECAYS)
        if self.total_steps is not None:
            check_int("total_steps", self.total_steps, 1, MAX_COUNT)
        check_float("min_factor", self.min_factor, 0.0, 1.0)
        if self.decay == "inverse_sqrt" and self.warmup_steps == 0:
            raise ValueError("decay 'inverse_sqrt' needs warmup_steps >= 1 (its peak is the "
                             "end of warm-up)")

    @property
    def needs_total(self) -> bool:
        """Whether :meth:`factor` needs ``total_steps`` (a decay that ends somewhere)."""
        return self.decay in ("linear", "cosine")

    def factor(self, step: int) -> float:
        """The multiplier of the peak rate at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        if self.decay == "inverse_sqrt":
            return math.sqrt(self.warmup_steps / (step + 1))
        if self.total_steps is None:
            raise ValueError(f"decay {self.decay!r} needs total_steps")
        span = max(self.total_steps - self.warmup_steps, 1)
        p = min(max((step - self.warmup_steps) / span, 0.0), 1.0)
        shape = 1.0 - p if self.decay == "linear" else (1.0 + math.cos(math.pi * p)) / 2
        return self.min_factor + (1.0 - self.min_factor) * shape
