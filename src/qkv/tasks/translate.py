"""The translation task end to end: data -> model -> trainer -> checkpoint -> use.

This is what ``qkv translate`` runs, as a library:

    settings = TranslateSettings(data="dates", model="bahdanau")
    translator, history = train_translator(settings, "runs/dates")
    for t in translator.translate(["tuesday, march 3, 2021"]):
        print(t.source, "=>", t.text)                 # 2021-03-03
    translator = Translator.load("runs/dates")        # later, from the checkpoint

Data sources (``settings.data``):

- ``"dates"``: a synthetic corpus qkv generates itself (human-readable dates in many
  forms -> ISO ``YYYY-MM-DD``), no network, alignment visible in a heatmap;
- ``"fra-eng"``: d2l's Tatoeba English-French archive, downloaded once into
  ``$QKV_CACHE`` (default ``~/.cache/qkv``) with its SHA-1 checked;
- a path to a ``source<TAB>target`` file.

A run records the SHA-256 of the corpus file it trained on (``settings.data_sha256``).
Evaluating it on its held-out split or resuming it reads that corpus again, never
downloads it, and refuses in one line if it has changed or is missing. Loading a run
(:meth:`Translator.load`) reads the checkpoint only: every field of its ``config.json``
is validated, and the weights file's header is checked against the model the config
describes, before anything is built.

A run directory holds the checkpoint (``model.safetensors``, ``config.json`` with the
settings, model config and both vocabularies, optimizer state for ``--resume``),
``loss.png`` and ``attention.png``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from ..checks import (
    MAX_COUNT,
    MAX_SIZE,
    check_float,
    check_int,
    check_sha256,
    check_str,
    fields_from_dict,
    show,
)
from ..data.dates import DATES_NUM_STEPS, join_date_tokens, make_date_pairs, normalize_date_text
from ..data.translate import (
    BOS,
    EOS,
    PAD,
    TranslationData,
    Vocab,
    build_array,
    cached_fra_eng,
    download_fra_eng,
    preprocess,
    read_corpus,
    read_pairs,
)
from ..functional import BACKENDS
from ..models import (
    MODEL_NAMES,
    EncoderDecoder,
    Seq2SeqConfig,
    beam_search,
    build_model,
    greedy_decode,
    num_parameters,
    teacher_forcing_input,
)
from ..training import (
    LOAD_BYTES_PER_PARAMETER,
    LOSS_PLOT,
    CheckpointError,
    check_memory,
    check_weights,
    is_main_process,
    load_weights,
    masked_cross_entropy,
    resolve_device,
)
from ..training.metrics import bleu, corpus_bleu, exact_match, has_sacrebleu
from . import pipeline

__all__ = [
    "TranslateSettings",
    "Translation",
    "Translator",
    "load_pairs",
    "prepare_data",
    "train_translator",
    "translation_loss",
]

logger = logging.getLogger(__name__)

TASK = "translate"
ATTENTION_PLOT = "attention.png"

# Defaults that depend on the data: the dates corpus is larger, its sentences longer,
# and it needs far fewer epochs than the reference's 600 pairs x 250 epochs.
_DATA_DEFAULTS = {
    "dates": {"num_examples": 10_000, "num_steps": DATES_NUM_STEPS, "epochs": 10,
              "held_out": 0.1, "lr": 0.005},
    "other": {"num_examples": 600, "num_steps": 10, "epochs": 250, "held_out": 0.0,
              "lr": 0.005},
}
# Bounds on settings that size work rather than the model (which is bounded by memory):
# sentences are decoded token by token up to num_steps, and the dates corpus is generated
# num_examples pairs at a time.
MAX_NUM_STEPS = 100_000
MAX_NUM_EXAMPLES = 10_000_000


@dataclass
class TranslateSettings:
    """Everything that defines a training run; saved in the checkpoint.

    ``None`` fields take a default that depends on ``data`` (see ``_DATA_DEFAULTS``):
    the dates corpus uses 10,000 pairs, ``num_steps`` 14, 10 epochs and a 10 % held-out
    split; fra-eng and files use d2l's recipe: 600 pairs, ``num_steps`` 10, 250 epochs
    and no split. The model and optimiser defaults are d2l's too (``lr`` 0.005).
    """

    data: str = "dates"
    model: str = Seq2SeqConfig.model
    num_examples: int | None = None
    num_steps: int | None = None
    held_out: float | None = None
    min_freq: int = 2
    # the model's defaults live once, in Seq2SeqConfig
    embed_size: int = Seq2SeqConfig.embed_size
    num_hiddens: int = Seq2SeqConfig.num_hiddens
    num_layers: int = Seq2SeqConfig.num_layers
    dropout: float = Seq2SeqConfig.dropout
    num_heads: int = Seq2SeqConfig.num_heads
    ffn_num_hiddens: int = Seq2SeqConfig.ffn_num_hiddens
    # How the model computes ("fused" or "eager", see Seq2SeqConfig), not what it is: a
    # resume or a load may run a checkpoint under the other. None: "fused" for a new run,
    # the run's own on a resume (and in a run saved before qkv recorded it).
    backend: str | None = None
    batch_size: int = 64
    lr: float | None = None
    epochs: int | None = None
    clip_norm: float = 1.0
    seed: int = 0
    device: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)
    # SHA-256 of the corpus file trained on (None: generated data, or a run saved before
    # qkv recorded it); evaluating or resuming the run checks the file against it.
    data_sha256: str | None = None

    def resolved(self) -> TranslateSettings:
        """A copy with every ``None`` replaced by the data's default; validated."""
        defaults = _DATA_DEFAULTS["dates" if self.data == "dates" else "other"]
        values = {k: (defaults[k] if v is None and k in defaults else v)
                  for k, v in dataclasses.asdict(self).items()}
        out = TranslateSettings(**values)
        out.backend = out.backend or Seq2SeqConfig.backend
        for name in ("num_examples", "num_steps", "min_freq", "batch_size", "epochs"):
            value = getattr(out, name)
            if not isinstance(value, int) or value < (0 if name == "epochs" else 1):
                raise ValueError(f"{name} must be a positive integer, got {show(value)}")
        out.validate(resolved=True)
        return out

    def validate(self, *, resolved: bool = False) -> None:
        """One-line ``ValueError`` naming the first field of the wrong type or range.

        ``resolved``: the data-dependent fields must be set (as in a saved run), not None.
        """
        check_str("data", self.data)
        check_str("model", self.model, choices=MODEL_NAMES)
        for name, lo, hi in (("num_examples", 1, MAX_NUM_EXAMPLES),
                             ("num_steps", 1, MAX_NUM_STEPS), ("epochs", 0, MAX_SIZE)):
            if getattr(self, name) is not None or resolved:
                check_int(name, getattr(self, name), lo, hi)
        if self.held_out is not None or resolved:
            check_float("held_out", self.held_out, 0.0, 1.0, hi_open=True)
        check_int("min_freq", self.min_freq, 1, MAX_COUNT)
        for name in ("embed_size", "num_hiddens", "num_layers", "num_heads",
                     "ffn_num_hiddens", "batch_size"):
            check_int(name, getattr(self, name), 1, MAX_SIZE)
        check_float("dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if self.backend is not None:
            check_str("backend", self.backend, choices=BACKENDS)
        if self.lr is not None or resolved:
            check_float("lr", self.lr, 0.0, lo_open=True)
        if self.clip_norm is not None:
            check_float("clip_norm", self.clip_norm, 0.0, lo_open=True)
        check_int("seed", self.seed, -(2**63), 2**64 - 1)  # what torch.manual_seed takes
        check_str("device", self.device, max_len=64)
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be an object, got {show(self.extra)}")
        if self.data_sha256 is not None:
            check_sha256("data_sha256", self.data_sha256)

    def model_config(self, src_vocab: Vocab, tgt_vocab: Vocab) -> Seq2SeqConfig:
        embed = self.num_hiddens if self.model == "transformer" else self.embed_size
        return Seq2SeqConfig(
            model=self.model,
            src_vocab_size=len(src_vocab),
            tgt_vocab_size=len(tgt_vocab),
            embed_size=embed,
            num_hiddens=self.num_hiddens,
            num_layers=self.num_layers,
            dropout=self.dropout,
            num_heads=self.num_heads,
            ffn_num_hiddens=self.ffn_num_hiddens,
            max_len=max(64, 2 * (self.num_steps or 10)),
            backend=self.backend or Seq2SeqConfig.backend,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TranslateSettings:
        """The settings of a saved run (resolved), every field validated."""
        settings = cls(**fields_from_dict(cls, d, "translate settings"))
        settings.validate(resolved=True)
        return settings


# ----------------------------------------------------------------------------
# Data


def _corpus_file(settings: TranslateSettings, reload: bool) -> Path:
    """The file ``settings.data`` names; fra-eng from the cache, downloaded only when the
    user asked for it now (``reload=False``), never when a saved run reads it again."""
    if settings.data == "fra-eng":
        return cached_fra_eng() if reload else download_fra_eng()
    path = Path(settings.data)
    if not path.exists():
        if reload:
            raise FileNotFoundError(
                f"the run was trained on {settings.data!r}, which no longer exists; restore "
                "it, or pass --data PATH to evaluate on another file"
            )
        raise FileNotFoundError(
            f"data {settings.data!r} is neither 'dates', 'fra-eng' nor an existing file"
        )
    return path


def _load_pairs(
    settings: TranslateSettings, reload: bool
) -> tuple[list[list[str]], list[list[str]], str | None]:
    """Pairs and the SHA-256 of the corpus file they came from (None for dates)."""
    if settings.data == "dates":
        pairs = make_date_pairs(settings.num_examples, seed=settings.seed)
        return [s.split() for s, _ in pairs], [t.split() for _, t in pairs], None
    path = _corpus_file(settings, reload)
    # A run saved before digests were recorded has none: its corpus is read unchecked.
    text, digest = read_corpus(path, sha256=settings.data_sha256 if reload else None)
    src, tgt = read_pairs(preprocess(text), settings.num_examples)
    if not src:
        raise ValueError(f"no 'source<TAB>target' pairs found in {path}")
    return src, tgt, digest


def load_pairs(
    settings: TranslateSettings, *, reload: bool = False
) -> tuple[list[list[str]], list[list[str]]]:
    """Source and target token lists for ``settings.data`` (resolved settings).

    ``reload``: these are a saved run's settings and its own corpus is read back (to
    evaluate or resume it): fra-eng is never downloaded, and a file must still have the
    SHA-256 the run recorded. Otherwise (new data named by the user) fra-eng is
    downloaded if it is not cached.
    """
    src, tgt, _ = _load_pairs(settings, reload)
    return src, tgt


def prepare_data(
    settings: TranslateSettings,
    src_vocab: Vocab | None = None,
    tgt_vocab: Vocab | None = None,
    *,
    reload: bool | None = None,
) -> TranslationData:
    """Batches, vocabularies and the held-out split for resolved ``settings``.

    ``reload`` (see :func:`load_pairs`) defaults to whether vocabularies are passed: a
    saved run's vocabularies come with its settings. ``corpus_sha256`` of the result is
    the digest of the corpus file read, for the run to record.
    """
    reload = src_vocab is not None if reload is None else reload
    src, tgt, digest = _load_pairs(settings, reload)
    data = TranslationData.from_pairs(
        src,
        tgt,
        num_steps=settings.num_steps,
        min_freq=settings.min_freq,
        held_out=settings.held_out,
        seed=settings.seed,
        src_vocab=src_vocab,
        tgt_vocab=tgt_vocab,
    )
    data.corpus_sha256 = digest
    return data


def _model_name(config: Seq2SeqConfig, num_params: int) -> str:
    return f"this {num_params:,}-parameter {config.model} translator"


def _read_config(run_dir: str | Path) -> tuple[TranslateSettings, Seq2SeqConfig, Vocab, Vocab]:
    """A translator's ``config.json``, every field validated and cross-checked."""
    config = pipeline.read_run_config(
        run_dir, task=TASK, what="a translator",
        sections=("task", "settings", "model", "src_vocab", "tgt_vocab"),
    )
    settings = config.parse("settings", TranslateSettings.from_dict)
    model_config = config.parse("model", Seq2SeqConfig.from_dict)
    src_vocab = config.parse("src_vocab", Vocab.from_dict)
    tgt_vocab = config.parse("tgt_vocab", Vocab.from_dict)
    if (model_config.src_vocab_size, model_config.tgt_vocab_size) != (
        len(src_vocab), len(tgt_vocab)
    ):
        raise CheckpointError(
            f"{run_dir}: vocabulary sizes ({len(src_vocab)}, {len(tgt_vocab)}) do not "
            f"match the model's ({model_config.src_vocab_size}, "
            f"{model_config.tgt_vocab_size})"
        )
    # Not the backend, which changes how the model computes, not what it is.
    implied = settings.model_config(src_vocab, tgt_vocab)
    pipeline.check_model_config(config.path, model_config, implied, ignore=("backend",))
    return settings, model_config, src_vocab, tgt_vocab


# ----------------------------------------------------------------------------
# Using a trained model


@dataclass
class Translation:
    """One translated sentence: tokens on both sides and the attention between them.

    ``attention``: ``(target steps, source tokens)``, the weights each output token put
    on each source token (``<eos>`` included on both sides).
    """

    source: str
    source_tokens: list[str]
    tokens: list[str]
    text: str
    attention: Tensor
    score: float | None = None


class Translator:
    """A trained model with its vocabularies: ``translate``, ``evaluate``, ``heatmap``."""

    def __init__(
        self,
        model: EncoderDecoder,
        src_vocab: Vocab,
        tgt_vocab: Vocab,
        settings: TranslateSettings,
    ) -> None:
        self.model = model.eval()
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        self.settings = settings
        # The held-out (source, target) token lists, when this translator was just trained.
        self.held_out: list[tuple[list[str], list[str]]] = []

    @classmethod
    def load(
        cls, run_dir: str | Path, device: str = "cpu", *, backend: str | None = None
    ) -> Translator:
        """Rebuild from a checkpoint; anything malformed is one ``CheckpointError`` line.

        Reads the checkpoint only (never the corpus, never the network). Everything is
        checked before the model is built: the config's fields, the weights file's header
        against the shapes the config implies, and the memory the model needs.
        ``backend`` (``"fused"`` or ``"eager"``; None: the checkpoint's) runs the same
        weights the other way.
        """
        settings, model_config, src_vocab, tgt_vocab = _read_config(run_dir)
        if backend is not None:
            check_str("backend", backend, choices=BACKENDS)
            model_config = dataclasses.replace(model_config, backend=backend)
        # The settings say the backend the model runs, whatever the run was saved with.
        settings = dataclasses.replace(settings, backend=model_config.backend)
        n = model_config.num_parameters()
        check_weights(run_dir, model_config.parameter_shapes(), n)
        check_memory(
            LOAD_BYTES_PER_PARAMETER * n + 4 * model_config.num_buffer_elements(),
            f"loading {_model_name(model_config, n)}",
            hint="load it on a machine with more memory",
        )
        model = build_model(model_config)
        load_weights(run_dir, model)
        return cls(model.to(resolve_device(device)), src_vocab, tgt_vocab, settings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tokenize(self, text: str) -> list[str]:
        """Raw text -> the source tokens the model was trained on."""
        if self.settings.data == "dates":
            return normalize_date_text(text).split()
        return preprocess(text).split()

    def tokenize_target(self, text: str) -> list[str]:
        """A reference translation -> target tokens, as the corpus was tokenised."""
        if self.settings.data == "dates":
            return normalize_date_text(text).split()
        return preprocess(text).split()

    def detokenize(self, tokens: Sequence[str]) -> str:
        if self.settings.data == "dates":
            return join_date_tokens(tokens)
        return " ".join(tokens)

    def _encode_source(self, text: str, num_steps: int) -> tuple[list[str], list[int]]:
        tokens = self.tokenize(text)
        if not tokens:
            raise ValueError(f"cannot translate {text!r}: it has no tokens")
        if len(tokens) + 1 > num_steps:
            warnings.warn(
                f"{text!r} has {len(tokens)} tokens; truncated to num_steps={num_steps} "
                "(including <eos>)",
                stacklevel=3,
            )
            tokens = tokens[: num_steps - 1]
        return tokens + [EOS], self.src_vocab[tokens + [EOS]]

    @torch.no_grad()
    def translate(
        self, texts: Sequence[str], *, beam: int = 1, num_steps: int | None = None
    ) -> list[Translation]:
        """Translate raw sentences; greedy for ``beam == 1``, beam search otherwise.

        ``num_steps`` bounds both the source length and the output length (default: the
        checkpoint's). Unknown words become ``<unk>``.
        """
        num_steps = self.settings.num_steps if num_steps is None else num_steps
        if num_steps < 2:
            raise ValueError(f"num_steps must be at least 2, got {num_steps}")
        if beam < 1:
            raise ValueError(f"beam must be >= 1, got {beam}")
        bos, eos = self.tgt_vocab[BOS], self.tgt_vocab[EOS]
        results = []
        for text in texts:
            src_tokens, ids = self._encode_source(text, num_steps)
            # Pad like the training batches: the GRU encoder reads the padding too, and
            # its final state (the decoder's first) must look like it did in training.
            padded = ids + [self.src_vocab[PAD]] * (num_steps - len(ids))
            src = torch.tensor([padded], device=self.device)
            valid = torch.tensor([len(ids)], device=self.device)
            score = None
            if beam == 1:
                out, attn = greedy_decode(self.model, src, valid, bos_id=bos, eos_id=eos,
                                          max_steps=num_steps)
                out_ids, weights = out[0], attn[0]
            else:
                out_ids, weights, score = beam_search(
                    self.model, src, valid, bos_id=bos, eos_id=eos, max_steps=num_steps,
                    beam_size=beam,
                )
            tokens = self.tgt_vocab.to_tokens(list(out_ids))
            attention = weights.detach().cpu()[:, : len(src_tokens)]  # drop the padding
            results.append(Translation(text, src_tokens, tokens, self.detokenize(tokens),
                                       attention, score))
        return results

    @torch.no_grad()
    def evaluate(
        self, src: list[list[str]], tgt: list[list[str]], *, batch_size: int = 256
    ) -> dict[str, float | None]:
        """Greedy translations of token lists scored against references.

        Returns ``bleu`` (d2l's per-sentence BLEU, k=2, averaged), ``sacrebleu`` (corpus
        BLEU-4 on the tokenised text, 0-100; None without the optional sacreBLEU package),
        ``exact_match`` (fraction) and ``n``.
        """
        if not src:
            raise ValueError("nothing to evaluate: the evaluation set is empty")
        num_steps = self.settings.num_steps
        bos, eos = self.tgt_vocab[BOS], self.tgt_vocab[EOS]
        preds: list[str] = []
        for start in range(0, len(src), batch_size):
            X, valid = build_array(src[start : start + batch_size], self.src_vocab, num_steps)
            out, _ = greedy_decode(self.model, X.to(self.device), valid.to(self.device),
                                   bos_id=bos, eos_id=eos, max_steps=num_steps)
            preds += [" ".join(self.tgt_vocab.to_tokens(list(o))) for o in out]
        refs = [" ".join(t) for t in tgt]
        return {
            "bleu": sum(bleu(p, r, k=2) for p, r in zip(preds, refs, strict=True)) / len(refs),
            "sacrebleu": corpus_bleu(preds, refs) if has_sacrebleu() else None,
            "exact_match": exact_match(preds, refs),
            "n": float(len(refs)),
        }

    def heatmap(self, translations: Sequence[Translation], path: str | Path) -> Path:
        """Draw target tokens (rows) against source tokens (columns), one panel each."""
        from ..utils.figures import plot_attention_grid

        # One attention row per decoder step: the output tokens, plus <eos> when the
        # decoder stopped on its own rather than at num_steps.
        return plot_attention_grid(
            [t.attention for t in translations],
            titles=[f"{t.source} => {t.text}" for t in translations],
            row_labels=[(t.tokens + [EOS])[: len(t.attention)] for t in translations],
            col_labels=[t.source_tokens for t in translations],
            path=path,
            suptitle=f"What the {self.settings.model} decoder attends to",
            xlabel="source tokens (attended to)",
            ylabel="output tokens",
        )


# ----------------------------------------------------------------------------
# Training


def translation_loss(bos_id: int) -> Callable[..., tuple[Tensor, Tensor]]:
    """The trainer's loss for a translation batch ``(src, src_valid_len, tgt,
    tgt_valid_len)``: teacher forcing, then the summed masked cross-entropy and the number
    of target tokens (the trainer divides one by the other: a mean per valid token).

    Target positions past the batch's longest sentence are padding in every row: they
    add nothing to the loss or its gradients, and a decoder step never depends on later
    ones, so the model is run only up to that length (the batch keeps its ``num_steps``
    padding; the loss is the same to the last bit of what the model computes).
    """

    def loss_fn(model: torch.nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        src, src_valid_len, tgt, tgt_valid_len = batch
        steps = max(int(tgt_valid_len.max()), 1) if tgt_valid_len.numel() else tgt.shape[1]
        tgt = tgt[:, :steps]
        logits = model(src, src_valid_len, teacher_forcing_input(tgt, bos_id))
        return masked_cross_entropy(logits, tgt, tgt_valid_len)

    return loss_fn


def train_translator(
    settings: TranslateSettings,
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    trace: Callable[[str], None] | None = None,
) -> tuple[Translator, dict[str, list]]:
    """Train (or, with ``resume``, continue) a translator in ``run_dir``.

    With ``resume``, the data, model and vocabularies come from the checkpoint; only
    ``settings.epochs`` (the new total; None: the run's own), ``settings.lr`` (None: the
    run's own), ``settings.backend`` (None: the run's own) and ``settings.device`` are
    taken from the arguments. Without it, a
    ``run_dir`` that holds a checkpoint is refused unless ``overwrite`` (see
    :func:`qkv.training.open_run_dir`: one writer at a time, outputs checked writable
    first). Returns the trained :class:`Translator` and the training history.

    Under ``torchrun --nproc_per_node=N`` every process runs this: each trains on its
    shard of the data (``settings.batch_size`` per process), only rank 0 logs, traces
    and saves, and every rank returns the same trained translator.
    """
    run_dir = Path(run_dir)
    with pipeline.training_run(run_dir, settings.device, resume=resume, overwrite=overwrite,
                               outputs=(LOSS_PLOT, ATTENTION_PLOT), log=log) as log:
        saved, src_vocab, tgt_vocab = None, None, None
        if resume:
            saved, _, src_vocab, tgt_vocab = _read_config(run_dir)
        settings = pipeline.run_settings(settings, saved, run_dir)

        data = prepare_data(settings, src_vocab, tgt_vocab)
        settings = dataclasses.replace(settings, data_sha256=data.corpus_sha256)
        config = settings.model_config(data.src_vocab, data.tgt_vocab)
        n = config.num_parameters()
        pipeline.check_training_memory(  # before a byte of the model exists
            _model_name(config, n), n, optimizer="Adam", device=settings.device,
            buffer_bytes=4 * config.num_buffer_elements(),
            hint="choose a smaller --num-hiddens, --num-layers, --embed-size or "
                 "--ffn-num-hiddens",
        )
        model = build_model(config)
        log(f"{settings.model} translator: {num_parameters(model):,} trainable parameters; "
            f"{len(data.train[0]):,} training pairs, {len(data.valid[0]):,} held out; "
            f"vocabularies {len(data.src_vocab)} -> {len(data.tgt_vocab)}")
        loss_fn = translation_loss(data.tgt_vocab[BOS])
        if trace is not None and is_main_process():
            loss_fn = _traced_first_batch(model, loss_fn, trace)

        translator = Translator(model, data.src_vocab, data.tgt_vocab, settings)
        translator.held_out = data.valid_pairs
        # Exact match on (up to 1,000 of) the held-out pairs after every epoch.
        held_src = [s for s, _ in data.valid_pairs[:1000]]
        held_tgt = [t for _, t in data.valid_pairs[:1000]]

        def validate(_: torch.nn.Module) -> dict[str, float]:
            return {"exact_match": translator.evaluate(held_src, held_tgt)["exact_match"]}

        module, history = pipeline.fit(
            model, loss_fn, TensorDataset(*data.train), settings, task=TASK, run_dir=run_dir,
            resume=resume, progress=progress, log=log, log_every=max(1, settings.epochs // 10),
            sections={"model": model.config.to_dict(), "src_vocab": data.src_vocab.to_dict(),
                      "tgt_vocab": data.tgt_vocab.to_dict()},
            validate=validate if held_src else None,
        )
        model.trace = None
        translator.model = module.eval()
        return translator, history


def _traced_first_batch(
    model: EncoderDecoder, loss_fn: Callable[..., tuple[Tensor, Tensor]],
    trace: Callable[[str], None],
) -> Callable[..., tuple[Tensor, Tensor]]:
    """``loss_fn`` with ``model.trace`` on for the first training batch only: the shapes
    of every decoder step, then the norms, once."""
    model.trace = trace

    def traced(m: torch.nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        out = loss_fn(m, batch)
        model.trace = None
        return out

    return traced
