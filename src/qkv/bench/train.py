"""``qkv bench train``: GPT training speed in tokens/s and as a share of the matmul rate.

Every case trains one of the GPT presets (:data:`qkv.models.gpt.PRESETS`, initialised
with :meth:`GPTModel.init_weights`) through the code ``qkv lm train`` runs, not a copy
of it: :class:`qkv.training.Trainer` with the LM loss :func:`qkv.tasks.lm.lm_loss`,
AdamW over :func:`qkv.tasks.lm.param_groups` (weight decay 0.1, lr 1e-3), gradient
clipping at 1.0, and batches of random token ids ``(batch, T)`` made once and fed again
every epoch (what the ids are does not change the work). Random ids instead of text keep
the suite offline and free of tokenizer and data-loading time; the trainer still moves
every batch to the device, as in a real run.

Epochs and samples. The trainer runs ``warmup + repeats`` epochs. A warm-up epoch is
one optimizer step: compilation (``torch.compile``), kernel selection and the creation
of AdamW's moments all happen in the first step. Each later epoch is ``steps`` steps and
one timed sample: the trainer's own ``tokens_per_sec`` for that epoch (real tokens over
the epoch's wall time, synchronised at its end). Tables give the median and min-max over
the timed epochs. A case whose timed epochs would overrun ``max_seconds`` stops after
the epochs that fit (at least one): a bfloat16 step on a CPU without bfloat16 matrix
instructions is 9-34x slower than float32 (docs/benchmarks.md), and the sweep should
still end in minutes. Unlike the other suites, the cases are not interleaved: each holds
its own model, gradients and optimizer state (2.6 GB for GPT-2 small), so they run one
after another, and the min-max shows how steady the machine was meanwhile.

Options. An option set is a baseline dtype plus any of ``compile`` (the trainer's
``torch.compile``) and ``eager-attn`` (every :class:`qkv.MultiHeadAttention` in the
model set to ``backend="eager"``, which builds the ``T x T`` weights instead of calling
the fused kernel), written ``"bfloat16+compile"``; ``"default"`` is the baseline alone.
``bfloat16`` trains under ``torch.autocast`` (weights, gradients and optimizer stay
float32). The CPU default measures each preset with each option switched on alone;
the CUDA default measures GPT-2 small in bfloat16 at its full context, with and without
``torch.compile``. A case that fails (no C++ compiler for ``torch.compile``, a backend
error) is reported as failed with a one-line reason; one whose training cannot fit in
memory (:func:`qkv.tasks.pipeline.check_training_memory`, checked before the model is
built) as skipped.

MFU. ``model FLOP/s = GPTConfig.training_flops_per_token(T) x tokens/s`` (6 N + 12 L T d
per token: the model's matrix products, forward and backward), divided by the matmul
rate of the case's dtype (:func:`qkv.training.speed.matmul_rate`: the faster of a
square ``a @ b`` and ``a @ b.T`` on this device), measured before and after the cases;
the faster of the two is used, as the least disturbed. The same ceiling serves every
case of a dtype, so that MFU and tokens/s rank the cases of one dtype alike. It is a
measured rate, not a peak: on a CPU without bfloat16 matrix instructions the two layouts
run at very different speeds (1.3 and 19 GFLOP/s here) and a training step uses both,
so compare the model FLOP/s across dtypes too.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..functional import BACKENDS
from ..models.gpt import PRESETS, GPTConfig, GPTModel
from ..multihead import MultiHeadAttention
from ..tasks.lm import lm_loss, param_groups
from ..tasks.pipeline import check_training_memory
from ..training import (
    InsufficientMemoryError,
    TrainConfig,
    Trainer,
    check_memory,
    seed_everything,
)
from ..training.speed import matmul_rate, model_flops_utilisation
from ..utils.figures import new_figure, save_figure
from .timing import (
    Stats,
    error_line,
    format_number,
    hbars,
    machine_info,
    markdown_table,
    resolve_device,
    target_line,
    write_json,
)

__all__ = [
    "DTYPES",
    "OPTION_FLAGS",
    "OptionSet",
    "PresetPlan",
    "TrainBenchConfig",
    "default_options",
    "model_flops_utilisation",
    "run_train",
    "set_attention_backend",
]

# The dtypes the trainer computes in (float32, or the forward under bfloat16 autocast).
DTYPES = ("float32", "bfloat16")
# What an option set may switch on besides its dtype.
OPTION_FLAGS = ("compile", "eager-attn")
DEFAULT_PRESETS = {"cpu": ("tiny", "mini", "gpt2-small"), "cuda": ("gpt2-small",)}
# Windows per batch when --batch-size is not given.
DEFAULT_BATCH = {"cpu": 2, "cuda": 16}
# The CPU window is the preset's context, at most this: GPT-2 small then takes about 3 s
# per float32 step on 2 cores (256 tokens), the whole preset about 4 minutes with its
# bfloat16 and torch.compile cases; the attention share of the work (12 L T d per token)
# is still visible at 128 (2 % of GPT-2 small's).
CPU_CONTEXT_CAP = 128
# Model FLOPs per timed epoch when --steps is not given: an epoch of 1-5 s (the CPU at
# 20-40 % of 180 GFLOP/s; an H100 at about 40 % of its bfloat16 rate), long enough that
# the per-step overhead is measured as it is, short enough for several samples.
EPOCH_FLOPS = {"cpu": 1e11, "cuda": 4e14}
MAX_AUTO_STEPS = 200
# qkv lm train's defaults: AdamW, lr 1e-3, weight decay 0.1 on the matrices only.
LR = 1e-3
WEIGHT_DECAY = 0.1
# The CUDA target of docs/benchmarks.md.
TARGET_PRESET, TARGET_DTYPE, TARGET_CONTEXT, TARGET_TOKENS_PER_SEC = (
    "gpt2-small", "bfloat16", 1024, 300_000)
TARGET_NAME = "GPT-2 small bf16 ctx 1024 >= 300,000 tokens/s"


# ----------------------------------------------------------------------------
# Option sets


@dataclass(frozen=True)
class OptionSet:
    """How one case trains: ``dtype`` (float32, or bfloat16 autocast), ``compile``
    (``torch.compile``) and ``attention`` (the attention layers' backend)."""

    dtype: str
    compile: bool = False
    attention: str = "fused"

    @classmethod
    def parse(cls, spec: str, base_dtype: str) -> OptionSet:
        """``"default"``, or ``+``-joined parts: at most one dtype of :data:`DTYPES` (else
        ``base_dtype``) and any of :data:`OPTION_FLAGS`; e.g. ``"bfloat16+compile"``."""
        valid = f"'default' or '+'-joined parts of {', '.join((*DTYPES, *OPTION_FLAGS))}"
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"option set {spec!r} is not valid; give {valid}")
        if spec == "default":
            return cls(base_dtype)
        parts = spec.split("+")
        unknown = [p for p in parts if p not in (*DTYPES, *OPTION_FLAGS)]
        if unknown:
            raise ValueError(f"option set {spec!r}: unknown part {unknown[0]!r}; give {valid}")
        if len(set(parts)) != len(parts) or sum(p in DTYPES for p in parts) > 1:
            raise ValueError(f"option set {spec!r} repeats a part or names two dtypes")
        dtype = next((p for p in parts if p in DTYPES), base_dtype)
        return cls(dtype, "compile" in parts, "eager" if "eager-attn" in parts else "fused")

    @property
    def key(self) -> str:
        """Canonical name, e.g. ``"float32+compile"``: the key of the results."""
        return "+".join([self.dtype, *(["compile"] if self.compile else []),
                         *(["eager-attn"] if self.attention == "eager" else [])])

    @property
    def label(self) -> str:
        """Row label, e.g. ``"bfloat16 autocast, torch.compile"``."""
        parts = ["bfloat16 autocast" if self.dtype == "bfloat16" else self.dtype]
        if self.compile:
            parts.append("torch.compile")
        if self.attention == "eager":
            parts.append("eager attention")
        return ", ".join(parts)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


def default_options(device_type: str, dtype: str) -> tuple[str, ...]:
    """The option sets measured when none are given.

    CPU with ``--dtype auto``: the float32 baseline and each option alone (bfloat16,
    compile, eager attention). With an explicit dtype, that dtype's baseline, compiled,
    and with eager attention. CUDA: the baseline (bfloat16 unless told otherwise) with
    and without compile.
    """
    if device_type == "cuda":
        return ("default", "compile")
    if dtype == "auto":
        return ("default", "bfloat16", "compile", "eager-attn")
    return ("default", "compile", "eager-attn")


def set_attention_backend(model: torch.nn.Module, backend: str) -> int:
    """Set ``backend`` on every :class:`qkv.MultiHeadAttention` in ``model``; returns how
    many layers were set. ``GPTModel`` builds its layers with the default (fused) and
    takes no backend argument, but each layer reads its ``backend`` at every call."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    for layer in layers:
        layer.backend = backend
    return len(layers)


# ----------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class PresetPlan:
    """One preset as the suite trains it: ``batch_size`` windows of ``context_length``
    tokens per step, ``steps`` steps per timed epoch."""

    preset: str
    model: GPTConfig
    batch_size: int
    context_length: int
    steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_length

    @property
    def flops_per_token(self) -> float:
        return self.model.training_flops_per_token(self.context_length)


@dataclass
class TrainBenchConfig:
    """What to train. None picks the device's default (see the module docstring).

    Attributes:
        presets: :data:`qkv.models.gpt.PRESETS` names. None: tiny, mini and gpt2-small
            on the CPU, gpt2-small on CUDA.
        batch_size: windows per step. None: 2 on the CPU, 16 on CUDA.
        context_length: tokens per window, at most each preset's context. None: the
            preset's, at most :data:`CPU_CONTEXT_CAP` on the CPU.
        steps: optimizer steps per timed epoch. None: about :data:`EPOCH_FLOPS` model
            FLOPs per epoch (1 to :data:`MAX_AUTO_STEPS` steps).
        options: option sets (:meth:`OptionSet.parse`); the first is the baseline of
            the ratios. None: :func:`default_options`.
        repeats: timed epochs per case; warmup: one-step warm-up epochs before them.
        max_seconds: stop a case's timed epochs once the next would end past this many
            seconds of them (at least one runs); None: no limit.
        vocab_size: None keeps the presets' (GPT-2's 50,257 ids).
        matmul_size: ``n`` of the ``n x n`` matmul ceiling; None: ``MATMUL_SIZES``.
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        dtype: the baseline dtype: ``"auto"`` (float32 on the CPU, bfloat16 on CUDA),
            ``"float32"`` or ``"bfloat16"``.
        seed: model initialisation and the random token ids.
    """

    presets: tuple[str, ...] | None = None
    batch_size: int | None = None
    context_length: int | None = None
    steps: int | None = None
    options: tuple[str, ...] | None = None
    repeats: int = 3
    warmup: int = 1
    max_seconds: float | None = 60.0
    vocab_size: int | None = None
    matmul_size: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: Any) -> TrainBenchConfig:
        """The tiny preset on 2 x 32 tokens, 2 steps, no torch.compile (compiling even tiny
        takes 13-18 s on 2 cores): seconds on any CPU."""
        small = {"presets": ("tiny",), "batch_size": 2, "context_length": 32, "steps": 2,
                 "repeats": 2, "warmup": 1, "matmul_size": 256,
                 "options": ("float32", "bfloat16", "eager-attn")}
        return cls(**{**small, **overrides})

    def validate(self) -> None:
        """One-line ``ValueError`` naming the first bad field; allocates nothing."""
        if self.presets is not None:
            if isinstance(self.presets, str) or not self.presets:
                raise ValueError(f"presets must be a non-empty list of names from "
                                 f"{', '.join(PRESETS)}, got {self.presets!r}")
            for i, name in enumerate(self.presets):
                if name not in PRESETS:
                    raise ValueError(f"unknown preset {name!r}; choose from "
                                     f"{', '.join(PRESETS)}")
                if name in self.presets[:i]:
                    raise ValueError(f"preset {name!r} is given twice; give each once")
        for name in ("batch_size", "context_length", "steps", "vocab_size", "matmul_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or unset), got {value!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) \
                or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) \
                or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.max_seconds is not None and not (
                isinstance(self.max_seconds, (int, float)) and math.isfinite(self.max_seconds)
                and self.max_seconds > 0):
            raise ValueError(f"max_seconds must be a number > 0 (or unset), "
                             f"got {self.max_seconds!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype {self.dtype!r} is not supported: the trainer computes "
                             f"in float32 or under bfloat16 autocast; choose auto, "
                             f"{', '.join(DTYPES)}")
        if self.options is not None:
            if isinstance(self.options, str) or not self.options:
                raise ValueError(f"options must be a non-empty list of option sets, "
                                 f"got {self.options!r}")
            self.option_sets("float32")  # parses each, refuses duplicates
        if self.context_length is not None:
            # Every preset this config may train, on any device: nothing is resolved yet.
            names = self.presets or tuple(dict.fromkeys(
                n for names in DEFAULT_PRESETS.values() for n in names))
            for name in names:
                own = GPTConfig.preset(name).context_length
                if self.context_length > own:
                    raise ValueError(f"context_length {self.context_length} is longer than "
                                     f"preset {name!r}'s context of {own}; choose <= {own} "
                                     f"or other presets")
        if self.vocab_size is not None:
            GPTConfig.preset("tiny", vocab_size=self.vocab_size)  # its own range check

    def option_sets(self, base_dtype: str, device_type: str = "cpu") -> list[OptionSet]:
        """The option sets to measure, parsed, baseline first; duplicates refused."""
        specs = self.options if self.options is not None else default_options(
            device_type, self.dtype)
        sets = [OptionSet.parse(spec, base_dtype) for spec in specs]
        keys = [s.key for s in sets]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise ValueError(f"option set {specs[i]!r} is {key!r} again (base dtype "
                                 f"{base_dtype}); give each option set once")
        return sets

    def base_dtype(self, device: torch.device) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.type == "cuda" else "float32"

    def plan(self, device: torch.device) -> list[PresetPlan]:
        """Every preset's batch, window and steps on ``device``; nothing is allocated."""
        kind = "cuda" if device.type == "cuda" else "cpu"
        plans = []
        for name in self.presets or DEFAULT_PRESETS[kind]:
            overrides = {} if self.vocab_size is None else {"vocab_size": self.vocab_size}
            cfg = GPTConfig.preset(name, **overrides)
            context = self.context_length or (
                cfg.context_length if kind == "cuda"
                else min(cfg.context_length, CPU_CONTEXT_CAP))
            batch = self.batch_size or DEFAULT_BATCH[kind]
            steps = self.steps
            if steps is None:
                per_step = cfg.training_flops_per_token(context) * batch * context
                steps = max(1, min(MAX_AUTO_STEPS, round(EPOCH_FLOPS[kind] / per_step)))
            plans.append(PresetPlan(name, cfg, batch, context, steps))
        return plans


# ----------------------------------------------------------------------------
# Arithmetic


def _summary(samples: Sequence[float]) -> dict[str, Any]:
    return Stats(tuple(samples)).to_dict()


# ----------------------------------------------------------------------------
# One case


class _OutOfTimeError(Exception):
    """Raised by the data factory to end a case whose next epoch would overrun its time."""


class _EpochData:
    """The trainer's data factory for one case: ``generator -> list of (inputs, targets)``.

    Every epoch gets the same batches (made once; the trainer's shuffle generator is not
    needed for ids that are random already), a warm-up epoch only the first. Called at
    the start of every epoch, it also keeps the time budget: before a timed epoch after
    the first, it raises :class:`_OutOfTimeError` if the timed epochs so far plus one more as
    long as the last would exceed ``max_seconds``. The trainer keeps the completed
    epochs in its history. ``clock`` reads seconds (a test passes its own).
    """

    def __init__(self, batches: list[tuple[Tensor, Tensor]], warmup: int,
                 max_seconds: float | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.batches, self.warmup, self.max_seconds = batches, warmup, max_seconds
        self.clock = clock
        self.calls = 0
        self.timed_start = self.last_start = 0.0

    def __call__(self, generator: torch.Generator) -> list[tuple[Tensor, Tensor]]:
        now = self.clock()
        timed = self.calls - self.warmup  # index of the timed epoch starting now
        self.calls += 1
        if timed < 0:
            return self.batches[:1]
        if timed == 0:
            self.timed_start = now
        elif self.max_seconds is not None and \
                (now - self.timed_start) + (now - self.last_start) > self.max_seconds:
            raise _OutOfTimeError(timed)
        self.last_start = now
        return self.batches


def _random_batches(plan: PresetPlan, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``plan.steps`` batches ``(inputs, targets)``, each ``(batch, T)`` int64 on the CPU:
    windows of random ids with the targets shifted by one, as a text's windows are."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(plan.steps):
        ids = torch.randint(0, plan.model.vocab_size,
                            (plan.batch_size, plan.context_length + 1), generator=g)
        batches.append((ids[:, :-1], ids[:, 1:]))
    return batches


def _activation_bytes(plan: PresetPlan, option: OptionSet) -> int:
    """A lower bound on what one training step keeps for backward, in bytes: the model's
    saved activations (:meth:`GPTConfig.num_saved_activations`) and, for eager attention,
    each layer's ``(batch, heads, T, T)`` weights, all in the compute dtype."""
    size = option.torch_dtype.itemsize
    cfg, b, t = plan.model, plan.batch_size, plan.context_length
    total = size * cfg.num_saved_activations(b, t)
    if option.attention == "eager":
        total += size * b * cfg.n_heads * t * t * cfg.n_layers
    return total


def _release(device: torch.device) -> None:
    """Drop what a finished case compiled and cached, so the next starts clean: compiled
    graphs (and dynamo's recompile count, which models of other shapes would exhaust)
    and, on CUDA, the allocator's cached blocks."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _train(plan: PresetPlan, option: OptionSet, config: TrainBenchConfig,
           device: torch.device, batches: list[tuple[Tensor, Tensor]],
           ) -> tuple[dict[str, list], str | None]:
    """Build the model and train it; returns the trainer's history and why the timed
    epochs stopped early (None: all ran). The model, its gradients and the optimizer's
    state are freed when this returns."""
    seed_everything(config.seed)  # the same initial weights for every option set
    model = GPTModel(plan.model).init_weights()
    set_attention_backend(model, option.attention)
    model.to(device)  # before the optimizer is built, as qkv lm train has it there too
    optimizer = torch.optim.AdamW(param_groups(model, WEIGHT_DECAY), lr=LR)
    train_config = TrainConfig(
        epochs=config.warmup + config.repeats, lr=LR, device=str(device), seed=config.seed,
        progress=False, log_every=0, dtype=option.dtype, compile=option.compile)
    trainer = Trainer(model, lm_loss, _EpochData(batches, config.warmup, config.max_seconds),
                      train_config, optimizer=optimizer, log=lambda line: None)
    try:
        trainer.fit()
    except _OutOfTimeError as out:
        return trainer.history, (
            f"stopped after {out.args[0]} of {config.repeats} timed epochs: the next would "
            f"pass max_seconds={config.max_seconds:g}")
    return trainer.history, None


def run_case(plan: PresetPlan, option: OptionSet, config: TrainBenchConfig,
             device: torch.device, batches: list[tuple[Tensor, Tensor]]) -> dict[str, Any]:
    """Train ``plan``'s preset with ``option`` through :class:`Trainer`; returns the case's
    JSON: ``status`` ``"ok"`` with the per-epoch figures, or ``"skipped"`` / ``"failed"``
    with a one-line ``reason``."""
    entry: dict[str, Any] = {"label": option.label, "dtype": option.dtype,
                             "compile": option.compile, "attention": option.attention}
    n = plan.model.num_parameters()
    try:
        check_training_memory(
            f"this {n:,}-parameter GPT ('{plan.preset}') on batches of {plan.batch_size} x "
            f"{plan.context_length} tokens", n, optimizer="AdamW", device=str(device),
            activation_bytes=_activation_bytes(plan, option),
            hint="choose a smaller --presets, --batch-size or --context-length")
    except InsufficientMemoryError as e:
        return {**entry, "status": "skipped", "reason": str(e)}
    _release(device)
    try:
        history, stopped = _train(plan, option, config, device, batches)
    except Exception as e:  # the compiler, a backend, the allocator: the sweep goes on
        return {**entry, "status": "failed", "reason": error_line(e)}
    finally:
        _release(device)
    w = config.warmup
    return {**entry, "status": "ok",
            "tokens_per_sec": _summary(history["tokens_per_sec"][w:]),
            "epoch_seconds": history["seconds"][w:],
            "warmup_seconds": history["seconds"][:w],
            "timed_epochs": len(history["seconds"]) - w,
            "loss": history["loss"][-1],
            "stopped": stopped}


# ----------------------------------------------------------------------------
# The suite


def run_train(
    config: TrainBenchConfig, out_dir: str | Path, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train every preset with every option set, print one table per preset, write
    ``train.json`` and ``train.png`` in ``out_dir``. Returns the JSON."""
    config.validate()
    out_dir = Path(out_dir)
    device = resolve_device(config.device)
    base = config.base_dtype(device)
    options = config.option_sets(base, device.type)
    plans = config.plan(device)
    for plan in plans:  # the token ids of every step are made up front, on the CPU
        check_memory(plan.steps * plan.batch_size * (plan.context_length + 1) * 8,
                     f"making the random token ids of {plan.steps:,} steps of "
                     f"{plan.batch_size:,} x {plan.context_length} tokens ('{plan.preset}')",
                     hint="choose a smaller --batch-size or --steps")
    machine = machine_info(device)  # recorded when the run starts
    dtypes = list(dict.fromkeys(o.dtype for o in options))
    where = f"{device}" + (f" ({machine['gpu']})" if "gpu" in machine else "")
    log(f"train: {', '.join(p.preset for p in plans)} x {len(options)} option sets on "
        f"{where}, {torch.get_num_threads()} threads; qkv's Trainer, lm_loss, AdamW (lr "
        f"{LR:g}, weight decay {WEIGHT_DECAY}), random token ids; "
        f"{_plural(config.warmup, 'one-step warm-up epoch')}, then "
        f"{_plural(config.repeats, 'timed epoch')} per case")

    def rates() -> dict[str, float]:
        return {d: matmul_rate(device, getattr(torch, d), n=config.matmul_size)
                for d in dtypes}

    before = rates()
    results: dict[str, Any] = {}
    for plan in plans:
        n = plan.model.num_parameters()
        log(f"\n{plan.preset}: {n:,} parameters, batch {plan.batch_size} x "
            f"{plan.context_length} tokens, {_plural(plan.steps, 'step')} per epoch "
            f"({plan.steps * plan.tokens_per_step:,} tokens), "
            f"{plan.flops_per_token / 1e6:,.1f} MFLOP per token")
        batches = _random_batches(plan, config.seed)
        cases = {}
        for option in options:
            started = time.perf_counter()
            case = run_case(plan, option, config, device, batches)
            case["case_seconds"] = time.perf_counter() - started
            cases[option.key] = case
            log(f"  {option.label}: " + _case_line(case))
        results[plan.preset] = {
            "parameters": n, "batch_size": plan.batch_size,
            "context_length": plan.context_length, "steps": plan.steps,
            "tokens_per_step": plan.tokens_per_step,
            "flops_per_token": plan.flops_per_token, "cases": cases,
        }
    after = rates()

    ceilings = {d: max(before[d], after[d]) for d in dtypes}
    baseline = options[0].key
    for entry in results.values():
        base_case = entry["cases"][baseline]
        for case in entry["cases"].values():
            if case["status"] != "ok":
                continue
            tps = case["tokens_per_sec"]["samples"]
            flops = [entry["flops_per_token"] * x for x in tps]
            case["model_flops_per_sec"] = _summary(flops)
            case["mfu"] = _summary([model_flops_utilisation(
                entry["flops_per_token"], x, ceilings[case["dtype"]]) for x in tps])
            case["ratio_to_baseline"] = (
                case["tokens_per_sec"]["median"] / base_case["tokens_per_sec"]["median"]
                if base_case["status"] == "ok" else None)

    report: dict[str, Any] = {
        "suite": "train",
        "config": dataclasses.asdict(config),
        "machine": machine,
        "dtype": base,
        "baseline": baseline,
        "options": {o.key: o.label for o in options},
        "flop_convention": ("GPTConfig.training_flops_per_token(T): 6 N (the matrix "
                            "products' weights, forward and backward) + 12 L T d "
                            "(attention) per token"),
        "matmul": {d: {"flops_per_sec": ceilings[d], "before": before[d], "after": after[d],
                       "n": config.matmul_size} for d in dtypes},
        "results": results,
    }
    report["targets"] = targets(report, device)

    unit, scale = _flops_unit(device)
    rate_text = ", ".join(f"{d} {format_number(ceilings[d] / scale)} {unit}" for d in dtypes)
    log(f"\nmatmul rate (torch.mm, the faster of before and after): {rate_text}. "
        f"MFU = model FLOP/s over the rate of the row's dtype.")
    for preset, entry in results.items():
        log(f"\n{preset}, batch {entry['batch_size']} x {entry['context_length']} tokens, "
            f"{_plural(entry['steps'], 'step')} per timed epoch:\n")
        log(table(report, preset))
        for case in entry["cases"].values():
            if case["status"] != "ok":
                log(f"{case['label']}: {case['status']}: {case['reason']}")
            elif case["stopped"]:
                log(f"{case['label']}: {case['stopped']}")
    log("")
    if not report["targets"]:
        log(f"(the target '{TARGET_NAME}' is for --device cuda with gpt2-small at "
            f"context {TARGET_CONTEXT}: not evaluated here)")
    for target in report["targets"]:
        log(target_line(target))
    write_json(out_dir / "train.json", report)
    plot(report, out_dir / "train.png")
    log(f"\nwrote {out_dir / 'train.json'} and {out_dir / 'train.png'}")
    return report


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _case_line(case: dict[str, Any]) -> str:
    if case["status"] != "ok":
        return f"{case['status']} ({case['reason']})"
    warm = ", ".join(f"{s:.1f}" for s in case["warmup_seconds"]) or "none"
    return (f"warm-up {warm} s, {_plural(case['timed_epochs'], 'timed epoch')}, median "
            f"{format_number(case['tokens_per_sec']['median'])} tokens/s "
            f"({case['case_seconds']:.0f} s in all)")


def targets(report: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """The CUDA target, where this run measured what it is about (GPT-2 small, bfloat16,
    context 1024, on CUDA): the best median over those cases. Empty otherwise."""
    entry = report["results"].get(TARGET_PRESET)
    if device.type != "cuda" or entry is None or entry["context_length"] != TARGET_CONTEXT:
        return []
    cases = {k: c for k, c in entry["cases"].items() if c["dtype"] == TARGET_DTYPE}
    if not cases:
        return []
    ok = {k: c for k, c in cases.items() if c["status"] == "ok"}
    if not ok:
        reasons = "; ".join(f"{c['label']}: {c['reason']}" for c in cases.values())
        return [{"name": TARGET_NAME, "value": None, "threshold": TARGET_TOKENS_PER_SEC,
                 "met": False, "value_text": f"not measured ({reasons})"}]
    best = max(ok.values(), key=lambda c: c["tokens_per_sec"]["median"])
    value = best["tokens_per_sec"]["median"]
    return [{"name": TARGET_NAME, "value": value, "threshold": TARGET_TOKENS_PER_SEC,
             "met": value >= TARGET_TOKENS_PER_SEC,
             "value_text": f"{value:,.0f} tokens/s ({best['label']}, batch "
                           f"{entry['batch_size']}, MFU {_percent(best['mfu']['median'])})"}]


def _flops_unit(device: torch.device | str) -> tuple[str, float]:
    return ("TFLOP/s", 1e12) if torch.device(device).type == "cuda" else ("GFLOP/s", 1e9)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g} %"


def table(report: dict[str, Any], preset: str) -> str:
    """One preset: tokens/s, ratio to the baseline, model FLOP/s and MFU per option set."""
    unit, scale = _flops_unit(report["machine"]["device"])
    baseline = report["options"][report["baseline"]]
    header = ["option set", "tokens/s", "min-max tokens/s", f"x {baseline}",
              f"model {unit}", "MFU", "warm-up s", "timed epochs"]
    rows = []
    for case in report["results"][preset]["cases"].values():
        if case["status"] != "ok":
            rows.append([case["label"], case["status"], "-", "-", "-", "-", "-", "-"])
            continue
        tps = case["tokens_per_sec"]
        ratio = case["ratio_to_baseline"]
        rows.append([
            case["label"], format_number(tps["median"]),
            f"{format_number(tps['min'])}-{format_number(tps['max'])}",
            "-" if ratio is None else f"{ratio:.2f}x",
            format_number(case["model_flops_per_sec"]["median"] / scale),
            _percent(case["mfu"]["median"]),
            ", ".join(f"{s:.1f}" for s in case["warmup_seconds"]) or "-",
            str(case["timed_epochs"]),
        ])
    return markdown_table(header, rows)


def plot(report: dict[str, Any], path: Path) -> Path:
    """One panel per preset: tokens/s per option set (median, whiskers min-max), the
    MFU in the label; the baseline in orange."""
    results = report["results"]
    rows = [len(entry["cases"]) for entry in results.values()]
    fig = new_figure(9, sum(0.42 * r + 1.1 for r in rows) + 0.5)
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    for ax, (preset, entry) in zip(axes, results.items(), strict=True):
        ax.set_title(f"{preset}: batch {entry['batch_size']} x {entry['context_length']} "
                     f"tokens, {_plural(entry['steps'], 'step')} per epoch", fontsize=10)
        ok = [(k, c) for k, c in entry["cases"].items() if c["status"] == "ok"]
        if not ok:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "no case ran", ha="center", va="center")
            continue
        hbars(ax, [f"{c['label']} (MFU {_percent(c['mfu']['median'])})" for _, c in ok],
              [c["tokens_per_sec"] for _, c in ok],
              colors=["tab:orange" if k == report["baseline"] else "tab:blue" for k, _ in ok],
              xlabel="training tokens per second (median, whiskers min-max)")
    device = report["machine"].get("gpu", report["machine"]["device"])
    fig.suptitle(f"GPT training through qkv's Trainer on {device}", fontsize=11)
    return save_figure(fig, path)
