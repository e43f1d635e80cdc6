"""The language-model task end to end: text -> tokens -> GPT -> trainer -> generate.

What ``qkv lm`` runs, as a library:

    settings = LMSettings(text="story.txt", tokenizer="gpt2", preset="mini")
    lm, history = train_language_model(settings, "runs/lm")
    print(lm.generate("Every effort moves you", max_new_tokens=40).text)
    lm = LanguageModel.load("runs/lm")                # later, from the checkpoint

With no ``text`` the model trains on a small English-like corpus qkv generates itself
(:func:`qkv.data.generated_corpus`), so it always runs offline. The default tokenizer
is byte-level (256 symbols, no download); ``tokenizer="gpt2"`` uses GPT-2's BPE through
tiktoken, offline from ``bpe_dir`` (or ``$QKV_BPE_DIR``) holding ``encoder.json`` and
``vocab.bpe``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data.gpt import GPTDataset, create_dataloader, generated_corpus
from .data.tokenizers import Tokenizer, get_tokenizer, tokenizer_from_dict
from .data.translation import load_corpus
from .models.gpt import PRESETS, GPTConfig, GPTModel, generate
from .training import (
    LOSS_PLOT,
    CheckpointError,
    TrainConfig,
    Trainer,
    check_resume_target,
    get_rank_and_world_size,
    init_distributed,
    load_config,
    load_weights,
    main_process_log,
    make_loader,
    open_run_dir,
    resolve_device,
    seed_everything,
)

__all__ = ["LMSettings", "LanguageModel", "Generation", "train_language_model", "lm_loss"]

TASK = "lm"


@dataclass
class LMSettings:
    """Everything that defines a language-model training run; saved in the checkpoint.

    ``context_length`` (default: the preset's) is the window length; ``stride`` (default:
    half the window, like the book's 256/128) the step between windows.
    ``val_fraction`` of the token ids, taken from the end, is held out for validation.
    ``epochs`` and ``lr`` left at None take 10 and 1e-3 (:meth:`resolved`); on a resume,
    None means the run's own.
    """

    text: str | None = None
    tokenizer: str = "bytes"
    bpe_dir: str | None = None
    preset: str = "tiny"
    context_length: int | None = None
    stride: int | None = None
    drop_rate: float | None = None
    tie_weights: bool = False
    batch_size: int = 16
    epochs: int | None = None
    lr: float | None = None
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    val_fraction: float = 0.1
    corpus_chars: int = 60_000
    seed: int = 0
    device: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> LMSettings:
        """A copy with ``epochs`` and ``lr`` defaulted (10, 1e-3); validated."""
        out = dataclasses.replace(self, epochs=10 if self.epochs is None else self.epochs,
                                  lr=1e-3 if self.lr is None else self.lr)
        out.validate()
        return out

    def validate(self) -> None:
        """Refuse, in one line, values that cannot train (non-finite ones included)."""
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        for name in ("batch_size", "corpus_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.epochs is not None and self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        # `not a < x < b` also refuses NaN, which fails every comparison.
        for name in ("lr", "clip_norm"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay must be a finite number >= 0, "
                             f"got {self.weight_decay}")
        if self.drop_rate is not None and not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {self.drop_rate}")
        for name in ("context_length", "stride"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")

    def model_config(self, vocab_size: int) -> GPTConfig:
        overrides: dict[str, Any] = {"vocab_size": vocab_size, "tie_weights": self.tie_weights}
        if self.context_length is not None:
            overrides["context_length"] = self.context_length
        if self.drop_rate is not None:
            overrides["drop_rate"] = self.drop_rate
        return GPTConfig.preset(self.preset, **overrides)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LMSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown lm settings {unknown}; valid: {sorted(known)}")
        return cls(**d)


def lm_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """Summed next-token cross-entropy of ``(inputs, targets)`` ``(batch, T)`` and ``b*T``."""
    inputs, targets = batch
    logits = model(inputs)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss_sum, torch.tensor(targets.numel(), device=targets.device)


@dataclass
class Generation:
    """A prompt's continuation and how fast it came."""

    prompt: str
    text: str
    new_tokens: int
    seconds: float

    @property
    def tokens_per_sec(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


class LanguageModel:
    """A trained GPT and its tokenizer: ``generate`` and ``attention``."""

    def __init__(self, model: GPTModel, tokenizer: Tokenizer, settings: LMSettings) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.settings = settings

    @classmethod
    def load(cls, run_dir: str | Path, device: str = "cpu", bpe_dir: str | None = None):
        """Rebuild from a checkpoint; anything malformed is one ``CheckpointError`` line."""
        config = load_config(run_dir, task=TASK)
        try:
            settings = LMSettings.from_dict(config["settings"])
            model_config = GPTConfig.from_dict(config["model"])
            tokenizer = tokenizer_from_dict(config["tokenizer"],
                                            bpe_dir=bpe_dir or settings.bpe_dir)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{run_dir}/config.json is malformed: {e}") from e
        if tokenizer.n_vocab != model_config.vocab_size:
            raise CheckpointError(
                f"{run_dir}: tokenizer has {tokenizer.n_vocab} ids but the model expects "
                f"vocab_size={model_config.vocab_size}"
            )
        model = GPTModel(model_config)
        load_weights(run_dir, model)
        return cls(model.to(resolve_device(device)), tokenizer, settings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode_prompt(self, prompt: str) -> Tensor:
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"the prompt {prompt!r} has no tokens")
        return torch.tensor([ids], device=self.device)

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 50,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        use_cache: bool = True,
        seed: int | None = None,
    ) -> Generation:
        """Continue ``prompt``; greedy at temperature 0, seedable sampling otherwise."""
        idx = self.encode_prompt(prompt)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        start = time.perf_counter()
        out = generate(self.model, idx, max_new_tokens, temperature=temperature, top_k=top_k,
                       use_cache=use_cache, generator=generator)
        seconds = time.perf_counter() - start
        new = out[0, idx.shape[1] :].tolist()
        return Generation(prompt, self.tokenizer.decode(new), len(new), seconds)

    @torch.no_grad()
    def attention(self, prompt: str) -> tuple[list[str], list[Tensor]]:
        """Token strings of ``prompt`` and per-layer weights ``(heads, T, T)``."""
        idx = self.encode_prompt(prompt)
        context = self.model.cfg.context_length
        if idx.shape[1] > context:
            raise ValueError(f"the prompt has {idx.shape[1]} tokens; the model's "
                             f"context_length is {context}")
        _, weights = self.model(idx, need_weights=True)
        labels = [self.tokenizer.decode([i]) for i in idx[0].tolist()]
        return labels, [w[0].cpu() for w in weights]

    def heatmap(self, prompt: str, path: str | Path, layers: Sequence[int] | None = None):
        """Per-layer, per-head attention of ``prompt``: one row of panels per layer."""
        from .viz import plot_attention_grid

        labels, weights = self.attention(prompt)
        layers = range(len(weights)) if layers is None else layers
        for layer in layers:
            if not 0 <= layer < len(weights):
                raise ValueError(f"layer {layer} does not exist; the model has layers "
                                 f"0..{len(weights) - 1}")
        panels, titles = [], []
        for layer in layers:
            for head, matrix in enumerate(weights[layer]):
                panels.append(matrix)
                titles.append(f"layer {layer}, head {head}")
        # Make whitespace tokens visible on the axes.
        shown = [t.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t") for t in labels]
        return plot_attention_grid(
            panels, titles=titles, row_labels=shown, col_labels=shown, path=path,
            ncols=weights[0].shape[0], suptitle=f"Causal self-attention on {prompt!r}",
        )


def _load_text(settings: LMSettings) -> str:
    if settings.text is None:
        return generated_corpus(settings.corpus_chars, seed=settings.seed)
    path = Path(settings.text)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    text = load_corpus(path)
    if not text.strip():
        raise ValueError(f"text file {path} is empty")
    return text


def train_language_model(
    settings: LMSettings,
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> tuple[LanguageModel, dict[str, list]]:
    """Train (or, with ``resume``, continue) a GPT in ``run_dir``.

    With ``resume``, everything but ``settings.epochs`` (the new total; None: the run's
    own), ``settings.lr`` (None: the run's own), ``settings.bpe_dir`` (None: the run's
    own) and ``settings.device`` comes from the checkpoint. Without it, a ``run_dir``
    that holds a checkpoint is refused unless ``overwrite`` (see
    :func:`qkv.training.open_run_dir`).

    Under ``torchrun --nproc_per_node=N`` every process runs this on its shard of the
    windows (``settings.batch_size`` per process); only rank 0 logs and saves.
    """
    run_dir = Path(run_dir)
    # Join the torchrun process group, if any, before anything logs or touches a device.
    init_distributed(settings.device)
    log = main_process_log(log)
    with open_run_dir(run_dir, resume=resume, overwrite=overwrite, outputs=(LOSS_PLOT,),
                      log=log):
        return _train(settings, run_dir, resume=resume, progress=progress, log=log)


def _train(
    settings: LMSettings,
    run_dir: Path,
    *,
    resume: bool,
    progress: bool,
    log: Callable[[str], None],
) -> tuple[LanguageModel, dict[str, list]]:
    if resume:
        saved = load_config(run_dir, task=TASK)
        old = LMSettings.from_dict(saved["settings"])
        settings = dataclasses.replace(
            old,
            epochs=old.epochs if settings.epochs is None else settings.epochs,
            lr=old.lr if settings.lr is None else settings.lr,
            device=settings.device,
            bpe_dir=settings.bpe_dir or old.bpe_dir,  # the folder may have moved
        )
    settings = settings.resolved()
    if resume:
        check_resume_target(run_dir, settings.epochs)
    seed_everything(settings.seed)

    tokenizer = get_tokenizer(settings.tokenizer, bpe_dir=settings.bpe_dir)
    ids = torch.tensor(tokenizer.encode(_load_text(settings)), dtype=torch.long)
    cfg = settings.model_config(tokenizer.n_vocab)
    window = cfg.context_length
    stride = settings.stride or max(1, window // 2)
    split = int(len(ids) * (1 - settings.val_fraction))
    train_ids, val_ids = ids[:split], ids[split:]
    train_set = GPTDataset(train_ids, window, stride)
    val_set = GPTDataset(val_ids, window, window) if len(val_ids) > window else None
    _, world_size = get_rank_and_world_size()
    if len(train_set) < settings.batch_size * world_size:
        raise ValueError(
            f"{len(train_ids):,} training tokens give {len(train_set)} windows of "
            f"{window}, fewer than batch_size={settings.batch_size} x {world_size} "
            "process(es); use more text, a smaller --context-length or --batch-size"
        )

    model = GPTModel(cfg).init_weights()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"GPT '{settings.preset}': {n_params:,} parameters, {cfg.n_layers} layers x "
        f"{cfg.n_heads} heads, context {window}; tokenizer {tokenizer.name} "
        f"({tokenizer.n_vocab:,} ids); {len(train_ids):,} training tokens in "
        f"{len(train_set):,} windows, {len(val_ids):,} validation tokens")

    # The usual GPT recipe: decay matrices, not biases and norm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
    )

    def validate(module: nn.Module) -> dict[str, float]:
        device = next(module.parameters()).device
        loss_sum, tokens = 0.0, 0
        for inputs, targets in create_dataloader(val_set, batch_size=settings.batch_size,
                                                 shuffle=False, drop_last=False):
            s, n = lm_loss(module, (inputs.to(device), targets.to(device)))
            loss_sum, tokens = loss_sum + s.item(), tokens + int(n)
        return {"loss": loss_sum / tokens}

    trainer = Trainer(
        model,
        lm_loss,
        # This process's shard under torchrun; otherwise a seeded shuffle of all windows.
        lambda g: make_loader(train_set, settings.batch_size, g, drop_last=True),
        TrainConfig(epochs=settings.epochs, lr=settings.lr, clip_norm=settings.clip_norm,
                    device=settings.device, seed=settings.seed, log_every=1,
                    progress=progress),
        run_dir=run_dir,
        checkpoint_config={
            "task": TASK,
            "settings": dataclasses.asdict(settings),
            "model": cfg.to_dict(),
            "tokenizer": tokenizer.to_dict(),
        },
        optimizer=optimizer,
        validate=validate if val_set is not None else None,
        log=log,
    )
    if resume:
        trainer.resume()
    history = trainer.fit()
    return LanguageModel(trainer.module, tokenizer, settings), history
