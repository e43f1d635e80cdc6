"""Training utilities: masked losses, safe checkpoints and a small reusable trainer.

See :mod:`qkv.training.checkpoint` for the run-directory layout and its guarantees,
:mod:`qkv.training.limits` for the memory check made before a model is built,
:mod:`qkv.training.trainer` for the loop's reproducibility and Ctrl-C behaviour, and
:mod:`qkv.training.distributed` for data-parallel training under ``torchrun``.
"""

from .checkpoint import (
    CheckpointError,
    SafetensorsHeader,
    check_weights,
    checkpoint_progress,
    is_checkpoint,
    load_config,
    load_trainer_state,
    load_weights,
    read_history,
    read_weights_header,
    save_checkpoint,
)
from .distributed import (
    STRATEGIES,
    cleanup_distributed,
    get_rank_and_world_size,
    init_distributed,
    is_main_process,
    main_process_log,
    make_loader,
    resolve_device,
)
from .limits import (
    LOAD_BYTES_PER_PARAMETER,
    TRAIN_BYTES_PER_PARAMETER,
    InsufficientMemoryError,
    available_memory,
    check_memory,
    format_bytes,
)
from .lock import RunDirBusyError, holds_run_dir_lock, run_dir_lock
from .losses import MaskedSoftmaxCELoss, masked_cross_entropy
from .rundir import (
    RESUMABLE,
    check_resume_target,
    checkpoint_files,
    describe_run_dir,
    open_run_dir,
    resumed_settings,
)
from .schedule import DECAYS, LRSchedule
from .trainer import (
    BEST_DIR,
    DTYPES,
    LOSS_PLOT,
    EarlyStopping,
    TrainConfig,
    Trainer,
    TrainingDivergedError,
    epoch_seed,
    plot_progress,
    seed_everything,
)

__all__ = [
    "STRATEGIES",
    "CheckpointError",
    "checkpoint_progress",
    "SafetensorsHeader",
    "check_weights",
    "is_checkpoint",
    "load_config",
    "load_trainer_state",
    "read_history",
    "load_weights",
    "read_weights_header",
    "save_checkpoint",
    "LOAD_BYTES_PER_PARAMETER",
    "TRAIN_BYTES_PER_PARAMETER",
    "InsufficientMemoryError",
    "available_memory",
    "check_memory",
    "format_bytes",
    "cleanup_distributed",
    "get_rank_and_world_size",
    "init_distributed",
    "is_main_process",
    "main_process_log",
    "make_loader",
    "RunDirBusyError",
    "holds_run_dir_lock",
    "run_dir_lock",
    "RESUMABLE",
    "check_resume_target",
    "resumed_settings",
    "checkpoint_files",
    "describe_run_dir",
    "open_run_dir",
    "MaskedSoftmaxCELoss",
    "masked_cross_entropy",
    "DECAYS",
    "LRSchedule",
    "BEST_DIR",
    "DTYPES",
    "LOSS_PLOT",
    "plot_progress",
    "EarlyStopping",
    "TrainConfig",
    "Trainer",
    "TrainingDivergedError",
    "epoch_seed",
    "resolve_device",
    "seed_everything",
]
