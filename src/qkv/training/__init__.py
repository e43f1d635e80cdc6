"""Training utilities: masked losses, safe checkpoints and a small reusable trainer.

See :mod:`qkv.training.checkpoint` for the run-directory layout and its guarantees, and
:mod:`qkv.training.trainer` for the loop's reproducibility and Ctrl-C behaviour.
"""

from .checkpoint import (
    CheckpointError,
    is_checkpoint,
    load_config,
    load_trainer_state,
    load_weights,
    save_checkpoint,
)
from .losses import MaskedSoftmaxCELoss, masked_cross_entropy
from .trainer import TrainConfig, Trainer, epoch_seed, resolve_device, seed_everything

__all__ = [
    "CheckpointError",
    "is_checkpoint",
    "load_config",
    "load_trainer_state",
    "load_weights",
    "save_checkpoint",
    "MaskedSoftmaxCELoss",
    "masked_cross_entropy",
    "TrainConfig",
    "Trainer",
    "epoch_seed",
    "resolve_device",
    "seed_everything",
]
