"""Data-parallel training under ``torchrun``: process group set-up and sharded loaders.

Launch any script or CLI that uses :class:`~qkv.training.Trainer` with ``torchrun``::

    torchrun --nproc_per_node=4 -m qkv translate train ...

``torchrun`` starts one process per device and tells each who it is through the
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
:func:`init_distributed` reads it and joins the process group (gloo on the CPU, NCCL on
CUDA with one GPU per process); without ``torchrun`` it does nothing, so the same code
runs as a plain single process. The trainer calls it itself; calling it earlier (to learn
the rank before building data, say) is harmless.

:func:`make_loader` builds an epoch's loader: each process gets its own shard of the
dataset (a ``DistributedSampler``) when distributed, a plain shuffled ``DataLoader``
otherwise. ``batch_size`` is per process, so one optimizer step sees
``batch_size * world_size`` samples.

See ``docs/distributed.md`` for launching on one or several machines.
"""

from __future__ import annotations

import atexit
import copy
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from ..checks import MAX_COUNT, check_int
from ..data.loading import batch_loader
from ..options import STRATEGIES

__all__ = [
    "resolve_device",
    "init_distributed",
    "cleanup_distributed",
    "make_loader",
    "get_rank_and_world_size",
    "is_main_process",
    "main_process_log",
    "main_process_first",
    "STRATEGIES",
    "shard_units",
    "meta_copy",
    "materialize",
    "fully_shard_model",
    "gather_model_state",
    "scatter_model_state",
    "gather_optimizer_state",
    "scatter_optimizer_state",
]


def get_rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """True on rank 0, and in a process that is not part of a process group."""
    return get_rank_and_world_size()[0] == 0


T = TypeVar("T")

# How long the other ranks wait for rank 0's preparation (tokenizing a text of many
# gigabytes takes an hour): far past the training group's own timeout (NCCL's is ten
# minutes), which is right for collectives that should take milliseconds.
PREPARATION_TIMEOUT = timedelta(days=1)


def main_process_first(work: Callable[[], T]) -> T:
    """``work()`` on rank 0, then on every other rank once rank 0's has returned (to
    reuse what it wrote, e.g. a token file); just ``work()`` without a process group.

    The others wait in a barrier of a gloo group of their own, with
    :data:`PREPARATION_TIMEOUT`, so that a long preparation is not mistaken for a hang.
    """
    rank, world_size = get_rank_and_world_size()
    if world_size == 1:
        return work()
    group = dist.new_group(backend="gloo", timeout=PREPARATION_TIMEOUT)
    try:
        result = work() if rank == 0 else None
        dist.barrier(group=group)
        return work() if rank != 0 else result  # type: ignore[return-value]
    finally:
        dist.destroy_process_group(group)


def main_process_log(log: Callable[[str], None] | None) -> Callable[[str], None]:
    """``log`` (default ``print``) on rank 0; a function that drops the line elsewhere,
    so the other ranks of a torchrun job train in silence."""
    if is_main_process():
        return log or print
    return lambda line: None


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {name} is not set: "
                           "launch with torchrun, which sets RANK, LOCAL_RANK, "
                           "MASTER_ADDR and MASTER_PORT") from None
    except ValueError:
        raise RuntimeError(f"{name}={os.environ[name]!r} is not an integer") from None


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; ``"cpu"``; ``"cuda"`` / ``"cuda:N"``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available; "
                             "use --device cpu or auto")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but only "
                             f"{torch.cuda.device_count()} CUDA device(s) exist")
        return device
    raise ValueError(f"unknown device {name!r}: expected auto, cpu, cuda or cuda:N")


def _launched_world_size() -> int:
    """The world size ``torchrun`` announced in the environment (1 when it did not)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def _process_device(name: str, world_size: int) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` for a CUDA run on several processes."""
    device = resolve_device(name)
    if device.type != "cuda" or world_size == 1:
        return device
    if device.index is not None:
        # Every process would pick the same GPU; torchrun runs one per LOCAL_RANK instead.
        raise ValueError(f"device {name!r} names one GPU, but under torchrun each process "
                         "uses cuda:LOCAL_RANK; pass 'cuda' or 'auto'")
    local_rank = _env_int("LOCAL_RANK")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local_rank} but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s): lower --nproc_per_node")
    return torch.device("cuda", local_rank)


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the ``torchrun`` process group if there is one; return ``(rank, world_size, device)``.

    With ``WORLD_SIZE > 1`` in the environment (set by ``torchrun``), initialise the
    default process group from it: the gloo backend when ``device`` resolves to the CPU,
    NCCL when it resolves to CUDA, in which case this process uses ``cuda:LOCAL_RANK``.
    Otherwise do nothing and return ``(0, 1, resolve_device(device))``. Idempotent: if a
    process group already exists (ours or the caller's), it is used as it is.

    Args:
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (see :func:`resolve_device`). Under
            ``torchrun`` a specific ``"cuda:N"`` is an error: each process takes its own.
    """
    if dist.is_available() and dist.is_initialized():
        rank, world_size = get_rank_and_world_size()
        return rank, world_size, _process_device(device, world_size)
    world_size = _launched_world_size()
    if world_size <= 1:
        return 0, 1, _process_device(device, 1)
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world_size}, but this torch build has no "
                           "torch.distributed")
    # Check the whole launch environment first: a bad one fails here, in one line, rather
    # than hanging in the rendezvous.
    rank = _env_int("RANK")
    _env_int("LOCAL_RANK")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world_size} but {name} is not set: "
                               "launch with torchrun")
    process_device = _process_device(device, world_size)
    if process_device.type == "cuda":
        # Bind this process to its GPU before NCCL creates anything on the default one.
        torch.cuda.set_device(process_device)
        dist.init_process_group("nccl", device_id=process_device)
    else:
        dist.init_process_group("gloo")
    # Leave cleanly even when the caller forgets cleanup_distributed() (NCCL warns and
    # can leak otherwise); a no-op if it was called.
    atexit.register(cleanup_distributed)
    return rank, world_size, process_device


def cleanup_distributed() -> None:
    """Leave and destroy the default process group, if there is one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def make_loader(
    dataset: Dataset,
    batch_size: int,
    generator: torch.Generator | None,
    *,
    shuffle: bool = True,
    drop_last: bool = False,
    samples: int | None = None,
) -> DataLoader:
    """One epoch's batches: this process's shard when distributed, all of them otherwise.

    Meant for a trainer's ``dataset_or_loader_factory``:
    ``lambda g: make_loader(dataset, batch_size, g)``.

    Single process: the batches of ``DataLoader(dataset, batch_size, shuffle=shuffle,
    generator=generator, drop_last=drop_last)``, exactly (through
    :func:`qkv.data.loading.batch_loader`, which indexes a ``TensorDataset`` a whole batch
    at a time).

    Distributed (``world_size > 1``): a ``DistributedSampler`` gives rank ``r`` the samples
    at positions ``r, r + world_size, ...`` of one shared permutation (or of the dataset's
    order with ``shuffle=False``), so the ranks' shards never overlap and together cover
    the dataset. Unless ``drop_last``, the sampler repeats the first few samples so that
    ``len(dataset)`` divides evenly: every rank then takes the same number of steps, which
    the collective operations of training require.

    The permutation is seeded with ``generator.initial_seed()``, identical on every rank.
    The Trainer passes a generator freshly seeded from ``(config.seed, epoch)``, so that
    seed plays the part of ``DistributedSampler.set_epoch``: a new order every epoch, the
    same order in a resumed run. (It is not the single-process order: that one comes
    from ``RandomSampler`` drawing on the generator after the ``DataLoader`` has.)

    Args:
        dataset: a map-style dataset (with ``__len__``), e.g. a ``TensorDataset``.
        batch_size: samples per batch **per process**; the global batch of one step is
            ``batch_size * world_size``.
        generator: the epoch's seeded generator; None shuffles from torch's global RNG
            in a single process and with seed 0 when distributed.
        shuffle: shuffle every epoch (False: the dataset's order).
        drop_last: drop the last incomplete batch (and, when distributed, the tail of the
            dataset that does not divide evenly, instead of repeating samples).
        samples: make the epoch this many samples (all processes together) drawn at
            random with the generator: whole permutations of the dataset, then part of
            one more, so that within the epoch none repeats before every one has been
            drawn. None: the dataset once. (A fixed-size epoch is how a trainer
            validates every so many steps.)
    """
    if samples is not None:
        check_int("samples", samples, 1, MAX_COUNT)
        if generator is None:
            raise ValueError("make_loader(samples=...) needs the epoch's generator")
        # Drawn alike on every rank: each rank's generator has the same seed.
        rounds = -(-samples // len(dataset))
        order = torch.cat([torch.randperm(len(dataset), generator=generator)
                           for _ in range(rounds)])
        dataset = Subset(dataset, order[:samples].tolist())
    rank, world_size = get_rank_and_world_size()
    if world_size == 1:
        return batch_loader(dataset, batch_size, shuffle=shuffle, generator=generator,
                            drop_last=drop_last)
    sampler = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=0 if generator is None else generator.initial_seed(),
        drop_last=drop_last,
    )
    # The DataLoader draws its workers' base seed from `generator`; giving it one keeps
    # that draw off torch's global RNG, which (as in a single process) is left to dropout.
    return batch_loader(dataset, batch_size, sampler=sampler, generator=generator,
                        drop_last=drop_last)


# ---------------------------------------------------------------------------- FSDP


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: the repeated layers of a model, i.e. the
    members of every ``nn.Sequential`` or ``nn.ModuleList`` whose members (two or more)
    are all of one class (a transformer's blocks), outermost first and not looking
    inside them. The rest of the model is sharded as one unit with the model itself.
    Only one unit's weights are whole at a time."""
    children = list(model.children())
    if isinstance(model, (nn.Sequential, nn.ModuleList)) and len(children) >= 2 \
            and len({type(child) for child in children}) == 1:
        return children
    return [unit for child in children for unit in shard_units(child)]


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the ``meta`` device: its
    structure (and shared weights) without its memory. ``to_empty`` and a state dict
    make it a model again; the trainer keeps one to rebuild a whole model from shards."""
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def materialize(skeleton: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a :func:`meta_copy` real (uninitialised) memory on ``device``, in place;
    parameters it shares (a tied output head) stay shared, which ``to_empty`` alone
    would undo."""
    shared: dict[int, list[str]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    whole = skeleton.to_empty(device=device)
    for first, *aliases in shared.values():
        for alias in aliases:
            owner, _, leaf = alias.rpartition(".")
            setattr(whole.get_submodule(owner), leaf, whole.get_parameter(first))
    return whole


def fully_shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` in place across the process group with ``fully_shard``: each
    :func:`shard_units` module, then the model. Its parameters become ``DTensor``
    shards, so an optimizer must be built after this."""
    from torch.distributed.fsdp import fully_shard

    for unit in shard_units(model):
        fully_shard(unit)
    fully_shard(model)
    return model


def _full_options(**kwargs: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gather_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole state dict of a sharded ``model``, on the CPU of rank 0 (empty on the
    other ranks). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def scatter_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a whole state dict, read from rank 0's ``state`` (the other ranks' is
    ignored: ``{}`` will do), into a sharded ``model``: each rank keeps its shards.
    A collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # Broadcast from rank 0 rather than letting every rank cut its shards from its own
    # whole copy: with torch 2.13 on gloo, the latter's collectives fell out of step
    # between the ranks on a GPT with tied weights (a gloo size-mismatch abort).
    set_model_state_dict(model, state, options=_full_options(broadcast_from_rank0=True))


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer
                           ) -> dict[str, Any]:
    """The whole state of an optimizer of a sharded ``model``, on the CPU of rank 0
    (empty elsewhere), in ``optimizer.state_dict()``'s own layout (parameters numbered
    in group order), so that checkpoints do not depend on the strategy. A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    if not full:
        return {}
    index: dict[str, int] = {}
    groups = []
    for group in full["param_groups"]:
        numbers = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": numbers})
    return {"state": {index[name]: value for name, value in full["state"].items()},
            "param_groups": groups}


def scatter_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict[str, Any]) -> None:
    """Load a whole optimizer state (``optimizer.state_dict()``'s layout, the same on
    every rank) into the optimizer of a sharded ``model``. A collective."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    fqn: dict[int, str] = {}
    groups = []
    for live, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        for number, param in zip(saved["params"], live["params"], strict=True):
            fqn[number] = names[id(param)]
        groups.append({**saved, "params": [fqn[n] for n in saved["params"]]})
    full = {"state": {fqn[n]: value for n, value in state["state"].items()},
            "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, full, options=_full_options())
