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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from ..checks import (
    check_int,
    check_str,
    fields_from_dict,
    show,
)
from ..data.dates import join_date_tokens, make_date_pairs, normalize_date_text
from ..data.loading import batch_loader
from ..data.translate import (
    BOS,
    EOS,
    PAD,
    RESERVED_TOKENS,
    TranslationData,
    Vocab,
    build_array,
    cached_fra_eng,
    detokenize,
    download_fra_eng,
    num_held_out,
    preprocess,
    read_pair_file,
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
from ..models.decoding import check_beam
from ..options import settings_class
from ..training import (
    BEST_DIR,
    LOAD_BYTES_PER_PARAMETER,
    LOSS_PLOT,
    SAVE_EVERY_MINUTES,
    CheckpointError,
    LRSchedule,
    available_memory,
    check_memory,
    check_save_every,
    check_weights,
    format_bytes,
    is_checkpoint,
    is_main_process,
    load_weights,
    masked_cross_entropy,
    resolve_device,
)
from ..training.metrics import bleu, corpus_bleu, exact_match, has_sacrebleu
from ..utils.fileio import regular_file_stat
from . import pipeline
from .settings import (
    CORPUS_EPOCHS,
    CORPUS_HELD_OUT,
    CORPUS_STEPS,
    D2L_RECIPE,
    MAX_NUM_STEPS,
    MODEL_ONLY,
    PRESET_NAMES,
    PRESETS,
    TRANSLATE,
    TRANSLATE_DEFAULTS,
    TRANSLATE_UNSET,
    recipe_values,
)

__all__ = [
    "TranslateSettings",
    "Translation",
    "Translator",
    "group_references",
    "load_pairs",
    "prepare_data",
    "train_translator",
    "translation_loss",
]

logger = logging.getLogger(__name__)

TASK = "translate"
ATTENTION_PLOT = "attention.png"


@settings_class(TRANSLATE, TRANSLATE_DEFAULTS)
class TranslateSettings:
    """Everything that defines a training run; saved in the checkpoint.

    Its fields are the settings :data:`qkv.tasks.settings.TRANSLATE` declares (name,
    type, valid values, help), in that order, with their defaults. ``None`` in a field
    the recipe sets means the recipe's value: ``preset`` (see ``PRESETS``), which by
    default follows ``data``: ``"dates"`` for the dates corpus (10,000 pairs,
    ``num_steps`` 14, 10 epochs, 10 % held out), ``"d2l"`` for fra-eng (d2l's recipe:
    600 pairs, ``num_steps`` 10, 250 epochs, no split, 32 hidden units, ``lr`` 0.005) and
    ``"corpus"`` for a file (every pair, 5 % held out, a wider model with warm-up +
    cosine decay, label smoothing, early stopping and beam search; epochs, held-out count
    and ``num_steps`` chosen from the corpus). A field given explicitly always wins.
    :meth:`resolved` and :meth:`for_corpus` turn these into a run's concrete settings
    once, before training; on a resume, ``None`` in a setting a resume may change
    means the run's own.
    """

    @property
    def recipe(self) -> str:
        """The preset this run follows: ``preset``, or the one its ``data`` implies."""
        if self.preset is not None:
            return self.preset
        return {"dates": "dates", "fra-eng": "d2l"}.get(self.data, "corpus")

    def resolved(self) -> TranslateSettings:
        """A copy with every ``None`` the recipe fixes filled in; validated.

        The corpus recipe leaves ``num_examples`` None (every pair) and, until
        :meth:`for_corpus` has seen the corpus, ``num_steps``, ``held_out`` and
        ``epochs``.
        """
        check_str("preset", self.recipe, choices=PRESET_NAMES)
        check_str("model", self.model, choices=MODEL_NAMES)
        defaults = {**TRANSLATE_UNSET, **recipe_values(self.recipe, self.model)}
        out = dataclasses.replace(self, preset=self.recipe, **{
            k: v for k, v in defaults.items() if getattr(self, k) is None})
        out.validate(resolved=out.recipe != "corpus")
        return out

    def choices(self, given: TranslateSettings) -> list[str]:
        """One line per setting the recipe chose (those ``given`` left None), naming the
        flag that changes it: what a run prints when it starts."""
        lines = []
        for name, setting in TRANSLATE.items():
            if getattr(given, name, None) is None and setting.flag_name and name not in (
                    "preset", "backend", "dtype", "compile"):
                value = getattr(self, name)
                if name == "num_examples" and value is None:
                    value = "all"
                if MODEL_ONLY.get(name, self.model) != self.model:
                    continue  # a setting of the other model
                lines.append(f"  {name} {value}  ({setting.flag_name})")
        return lines

    def for_corpus(self, num_pairs: int, longest: int, sha256: str | None = None
                   ) -> TranslateSettings:
        """The settings a run records, made once the corpus is read: its digest
        (``data_sha256``, None for generated data) and the corpus recipe's choices that
        depend on it: ``num_steps`` fits the longest sentence (``longest`` tokens, plus
        ``<eos>``), ``held_out`` is a count (5 %, at least one batch, at most 5,000, at
        most a fifth of the pairs) and ``epochs`` gives about ``CORPUS_STEPS[model]``
        optimizer steps. Settings that are already set are kept (a digest that differs
        was refused when the corpus was read); the result is validated."""
        out = dataclasses.replace(self, data_sha256=sha256)
        if self.recipe != "corpus":
            return out
        if out.num_steps is None:
            out.num_steps = min(longest + 1, 128)
        if out.held_out is None:
            fraction, most = CORPUS_HELD_OUT
            k = min(max(round(fraction * num_pairs), out.batch_size), most, num_pairs // 5)
            out.held_out = k if k > 0 or num_pairs < 2 else 1
        if out.epochs is None:
            held = num_held_out(out.held_out, num_pairs)
            steps_per_epoch = -(-(num_pairs - held) // (out.batch_size * out.accumulate))
            lo, hi = CORPUS_EPOCHS
            budget = CORPUS_STEPS[out.model]
            out.epochs = min(max(-(-budget // max(steps_per_epoch, 1)), lo), hi)
        out.validate(resolved=True)
        return out

    def validate(self, *, resolved: bool = False) -> None:
        """One-line ``ValueError`` naming the first field of the wrong type or range
        (each checked as :data:`qkv.tasks.settings.TRANSLATE` declares it).

        ``resolved``: every setting a recipe sets must be set (as in a saved run), not
        None; the corpus recipe's ``num_examples`` may stay None (every pair).
        """
        if self.preset is not None:
            check_str("preset", self.preset, choices=PRESET_NAMES)
        required = set(D2L_RECIPE) if resolved else set()
        if resolved and self.recipe == "corpus":
            required.discard("num_examples")
        for name, setting in TRANSLATE.items():
            setting.validate(getattr(self, name), required=name in required)
        if self.decay is not None and self.warmup_steps is not None:
            self.schedule()  # LRSchedule's own checks: inverse_sqrt needs a warm-up

    def schedule(self) -> LRSchedule:
        """The learning-rate schedule of these (resolved) settings."""
        return LRSchedule(warmup_steps=self.warmup_steps, decay=self.decay)

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
            # The Transformer's attention masks padding whatever this says.
            skip_padding=bool(self.skip_padding) and self.model == "bahdanau",
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TranslateSettings:
        """The settings of a saved run (resolved), every field validated.

        A run saved before qkv had recipes trained d2l's (or, on dates, the dates one):
        the fields it lacks take that recipe's values."""
        d = fields_from_dict(cls, d, "translate settings")
        if "preset" not in d:
            old = "dates" if d.get("data") == "dates" else "d2l"
            d = {**{k: v for k, v in PRESETS[old].items() if k not in d}, **d, "preset": old}
        # What every run saved before these fields existed did.
        d = {"split_by": "pair", "dtype": "float32", "compile": False, "skip_padding": False,
             "ban_unk": False, **d}
        settings = cls(**d)
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


# Memory a corpus takes per byte of its file, once read into pairs, vocabularies and
# the padded id tensors: 15.7 measured on fra-eng (180,660 pairs, 20 at the peak while
# the tensors are built); lower, so that a refusal is certain to be right.
CORPUS_BYTES_PER_BYTE = 12


def check_corpus_memory(path: Path) -> None:
    """Refuse, before reading it, a pair file whose pairs cannot fit in memory: one
    :class:`qkv.training.InsufficientMemoryError` line naming its size and the largest
    corpus that would fit. The file is checked to be a regular file first."""
    size = regular_file_stat(path, "corpus file").st_size
    available = available_memory("cpu")
    fits = "" if available is None else (
        f"a corpus of at most {format_bytes(available // CORPUS_BYTES_PER_BYTE)} would fit; ")
    check_memory(
        CORPUS_BYTES_PER_BYTE * size,
        f"reading the corpus file {path} ({format_bytes(size)}) into pairs "
        f"({CORPUS_BYTES_PER_BYTE} bytes of memory per byte of text)",
        hint=f"{fits}keep its first pairs with --num-examples N, or use a smaller file",
    )


def _load_pairs(
    settings: TranslateSettings, reload: bool
) -> tuple[list[list[str]], list[list[str]], str | None]:
    """Pairs and the SHA-256 of the corpus file they came from (None for dates)."""
    if settings.data == "dates":
        pairs = make_date_pairs(settings.num_examples, seed=settings.seed)
        return [s.split() for s, _ in pairs], [t.split() for _, t in pairs], None
    path = _corpus_file(settings, reload)
    if settings.num_examples is None:  # every pair is kept: refuse before reading
        check_corpus_memory(path)
    # And, whichever pairs are kept, as soon as those read would not fit (a file that
    # grew after its size was checked included).
    available = available_memory("cpu")
    max_chars = None if available is None else available // CORPUS_BYTES_PER_BYTE
    # A run saved before digests were recorded has none: its corpus is read unchecked.
    src, tgt, digest = read_pair_file(path, settings.num_examples, max_chars=max_chars,
                                      sha256=settings.data_sha256 if reload else None)
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
    return prepare_run_data(settings, src_vocab, tgt_vocab, reload=reload)[1]


def prepare_run_data(
    settings: TranslateSettings,
    src_vocab: Vocab | None = None,
    tgt_vocab: Vocab | None = None,
    *,
    reload: bool | None = None,
) -> tuple[TranslateSettings, TranslationData]:
    """:func:`prepare_data`, and the settings with the corpus's digest and the corpus
    recipe's choices made from it (see :meth:`TranslateSettings.for_corpus`): what a run
    records."""
    reload = src_vocab is not None if reload is None else reload
    src, tgt, digest = _load_pairs(settings, reload)
    lengths = sorted(max(len(s), len(t)) for s, t in zip(src, tgt, strict=True))
    # The 99.9th percentile: one stray paragraph must not pad every sentence to it.
    settings = settings.for_corpus(len(src), lengths[int(0.999 * (len(lengths) - 1))],
                                   sha256=digest)
    data = TranslationData.from_pairs(
        src,
        tgt,
        num_steps=settings.num_steps,
        min_freq=settings.min_freq,
        held_out=settings.held_out,
        seed=settings.seed,
        split_by=settings.split_by,
        src_vocab=src_vocab,
        tgt_vocab=tgt_vocab,
    )
    data.corpus_sha256 = digest
    return settings, data


def group_references(
    src: Sequence[list[str]], tgt: Sequence[list[str]]
) -> tuple[list[list[str]], list[list[list[str]]]]:
    """The distinct source sentences of the pairs ``(src[i], tgt[i])``, in the order they
    first appear, and the list of every target each one has: its references.

    Tatoeba, like many corpora, gives one sentence several translations ("go ." ->
    "va !", "marche .", "bouge !"); a translation is right if it matches any of them.
    """
    if len(src) != len(tgt):
        raise ValueError(f"got {len(src)} source and {len(tgt)} target sentences")
    refs: dict[tuple[str, ...], list[list[str]]] = {}
    for s, t in zip(src, tgt, strict=True):
        refs.setdefault(tuple(s), []).append(list(t))
    return [list(s) for s in refs], list(refs.values())


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
        weights the other way. A run trained with early stopping (``patience`` > 0)
        loads its best weights, ``run_dir/best``; ``run_dir`` itself holds the last
        epoch's, which ``--resume`` continues from.
        """
        settings, model_config, src_vocab, tgt_vocab = _read_config(run_dir)
        if backend is not None:
            check_str("backend", backend, choices=BACKENDS)
            model_config = dataclasses.replace(model_config, backend=backend)
        # The settings say the backend the model runs, whatever the run was saved with.
        settings = dataclasses.replace(settings, backend=model_config.backend)
        weights_dir = Path(run_dir)
        if settings.patience and is_checkpoint(weights_dir / BEST_DIR):
            weights_dir = weights_dir / BEST_DIR
        n = model_config.num_parameters()
        check_weights(weights_dir, model_config.parameter_shapes(), n)
        check_memory(
            LOAD_BYTES_PER_PARAMETER * n + 4 * model_config.num_buffer_elements(),
            f"loading {_model_name(model_config, n)}",
            hint="load it on a machine with more memory",
        )
        model = build_model(model_config)
        load_weights(weights_dir, model)
        return cls(model.to(resolve_device(device)), src_vocab, tgt_vocab, settings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """Target ids decoding never outputs: the reserved ``<pad>`` and ``<bos>`` (never
        a word: a model trained on a few pairs may still rank them first, and would print
        ``<pad> <bos> <pad>``), and ``<unk>`` when the run's ``ban_unk``. ``<eos>`` ends
        the output rather than appearing in it."""
        reserved = tuple(self.tgt_vocab[t] for t in RESERVED_TOKENS
                         if t != EOS and t in self.tgt_vocab)
        return reserved + ((self.tgt_vocab.unk,) if self.settings.ban_unk else ())

    def check_decoding(self, beam: int, num_steps: int) -> None:
        """One-line ``ValueError`` unless ``beam`` is in ``[1, MAX_BEAM]``, ``num_steps``
        in ``[2, MAX_NUM_STEPS]``, and decoding a sentence with them fits in memory.

        Per hypothesis (one for greedy decoding), each step holds the candidates' logits,
        log-probabilities and scores (3 x the target vocabulary), the attention rows so
        far (``num_steps`` x ``num_steps`` by the end), and the decoder state: the
        encoder's outputs and, for the Transformer, each layer's cached keys and values.
        All float32; a lower bound.
        """
        check_beam(beam)
        check_int("num_steps", num_steps, 2, MAX_NUM_STEPS)
        c = self.model.config
        state = num_steps + (2 * c.num_layers * num_steps if c.model == "transformer"
                             else c.num_layers)
        per_hypothesis = 3 * c.tgt_vocab_size + num_steps * num_steps + state * c.num_hiddens
        how = "greedy decoding" if beam == 1 else f"beam search with a beam of {beam:,}"
        check_memory(4 * beam * per_hypothesis,
                     f"{how} of {num_steps:,} steps over {c.tgt_vocab_size:,} target words",
                     hint="use a smaller beam or num_steps", device=self.device)

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
            raise ValueError(f"cannot translate {show(text, 60)}: it has no tokens")
        if len(tokens) + 1 > num_steps:
            warnings.warn(
                f"{show(text, 60)} has {len(tokens)} tokens; truncated to "
                f"num_steps={num_steps} (including <eos>)",
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
        self.check_decoding(beam, num_steps)
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
                                          max_steps=num_steps, banned_ids=self.banned_ids)
                out_ids, weights = out[0], attn[0]
            else:
                out_ids, weights, score = beam_search(
                    self.model, src, valid, bos_id=bos, eos_id=eos, max_steps=num_steps,
                    beam_size=beam, banned_ids=self.banned_ids,
                )
            tokens = self.tgt_vocab.to_tokens(list(out_ids))
            attention = weights.detach().cpu()[:, : len(src_tokens)]  # drop the padding
            results.append(Translation(text, src_tokens, tokens, self.detokenize(tokens),
                                       attention, score))
        return results

    @torch.no_grad()
    def predict(
        self, src: list[list[str]], *, beam: int = 1, batch_size: int = 256
    ) -> list[list[str]]:
        """Output token lists for source token lists: batched greedy decoding for
        ``beam == 1``, beam search one sentence at a time otherwise."""
        num_steps = self.settings.num_steps
        self.check_decoding(beam, num_steps)
        bos, eos = self.tgt_vocab[BOS], self.tgt_vocab[EOS]
        out_tokens: list[list[str]] = []
        for start in range(0, len(src), batch_size):
            X, valid = build_array(src[start : start + batch_size], self.src_vocab, num_steps)
            X, valid = X.to(self.device), valid.to(self.device)
            if beam == 1:
                out, _ = greedy_decode(self.model, X, valid, bos_id=bos, eos_id=eos,
                                       max_steps=num_steps, banned_ids=self.banned_ids)
                out_tokens += [self.tgt_vocab.to_tokens(list(o)) for o in out]
            else:
                for i in range(len(X)):
                    ids, _, _ = beam_search(self.model, X[i : i + 1], valid[i : i + 1],
                                            bos_id=bos, eos_id=eos, max_steps=num_steps,
                                            beam_size=beam, banned_ids=self.banned_ids)
                    out_tokens.append(self.tgt_vocab.to_tokens(list(ids)))
        return out_tokens

    def plain_text(self, tokens: Sequence[str]) -> str:
        """Tokens as a person writes them (``"va!"``): what sacreBLEU scores."""
        if self.settings.data == "dates":
            return join_date_tokens(tokens)
        return detokenize(tokens)

    @torch.no_grad()
    def evaluate(
        self, src: list[list[str]], tgt: list[list[str]], *, beam: int = 1,
        batch_size: int = 256,
    ) -> dict[str, float | None]:
        """Translations of token lists scored against references.

        Pairs that share a source sentence (``src[i] == src[j]``) are one test case:
        the sentence is translated once and scored against all of its references (see
        :func:`group_references`); each other sentence has its one reference.

        Returns ``bleu`` (d2l's sentence BLEU, k=2, against the best-matching
        reference, averaged over the sentences), ``sacrebleu`` (corpus BLEU-4 on
        detokenised text with sacreBLEU's ``13a`` tokenizer and every reference, 0-100;
        None without the optional sacreBLEU package), ``exact_match`` (the fraction
        equal to one of their references), ``n`` (distinct source sentences),
        ``references`` (pairs) and ``beam`` (1: greedy).
        """
        if not src:
            raise ValueError("nothing to evaluate: the evaluation set is empty")
        sources, refs = group_references(src, tgt)
        return self.score(self.predict(sources, beam=beam, batch_size=batch_size), refs,
                          beam=beam)

    def score(
        self, outputs: list[list[str]], refs: list[list[list[str]]], *, beam: int = 1
    ) -> dict[str, float | None]:
        """:meth:`evaluate`'s scores of output token lists (from :meth:`predict`, decoded
        with ``beam``) against ``refs[i]``, the list of reference token lists of
        ``outputs[i]``."""
        if not outputs:
            raise ValueError("nothing to score: there are no outputs")
        if len(outputs) != len(refs) or not all(refs):
            raise ValueError(f"need a non-empty list of references for each of the "
                             f"{len(outputs)} outputs, got {len(refs)} lists")
        preds = [" ".join(o) for o in outputs]
        joined = [[" ".join(t) for t in group] for group in refs]
        sacre = None
        if has_sacrebleu():
            sacre = corpus_bleu([self.plain_text(o) for o in outputs],
                                [[self.plain_text(t) for t in group] for group in refs])
        d2l_bleu = sum(max(bleu(p, r, k=2) for r in group)
                       for p, group in zip(preds, joined, strict=True))
        return {
            "bleu": d2l_bleu / len(preds),
            "sacrebleu": sacre,
            "exact_match": exact_match(preds, joined),
            "n": float(len(preds)),
            "references": float(sum(len(group) for group in refs)),
            "beam": float(beam),
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


def translation_loss(
    bos_id: int, label_smoothing: float = 0.0, *, trim_source: bool = False
) -> Callable[..., tuple[Tensor, Tensor]]:
    """The trainer's loss for a translation batch ``(src, src_valid_len, tgt,
    tgt_valid_len)``: teacher forcing, then the summed masked cross-entropy and the number
    of target tokens (the trainer divides one by the other: a mean per valid token).

    Target positions past the batch's longest sentence are padding in every row: they
    add nothing to the loss or its gradients, and a decoder step never depends on later
    ones, so the model is run only up to that length (the batch keeps its ``num_steps``
    padding; the loss is the same to the last bit of what the model computes).

    ``trim_source`` does the same to the source, for an encoder that masks padded
    positions out (the Transformer's): nothing it gives the decoder depends on them,
    so the loss is the same up to rounding. Not for d2l's GRU encoder, which reads its
    padding: its final state, the decoder's first, depends on how much there is (unless
    the model's ``skip_padding`` is on).
    """

    def loss_fn(model: torch.nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        src, src_valid_len, tgt, tgt_valid_len = batch
        steps = max(int(tgt_valid_len.max()), 1) if tgt_valid_len.numel() else tgt.shape[1]
        tgt = tgt[:, :steps]
        if trim_source and src_valid_len.numel():
            src = src[:, : max(int(src_valid_len.max()), 1)]
        logits = model(src, src_valid_len, teacher_forcing_input(tgt, bos_id))
        return masked_cross_entropy(logits, tgt, tgt_valid_len,
                                    label_smoothing=label_smoothing)

    return loss_fn


def train_translator(
    settings: TranslateSettings,
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    save_every: float = SAVE_EVERY_MINUTES,
    trace: Callable[[str], None] | None = None,
) -> tuple[Translator, dict[str, list]]:
    """Train (or, with ``resume``, continue) a translator in ``run_dir``.

    With ``resume``, the data, model and vocabularies come from the checkpoint; only
    ``settings.epochs`` (the new total; None: the run's own), ``settings.lr``,
    ``settings.backend``, ``settings.dtype``, ``settings.compile`` (each None: the run's
    own) and ``settings.device`` are taken from the arguments. Without it, a
    ``run_dir`` that holds a checkpoint is refused unless ``overwrite`` (see
    :func:`qkv.training.open_run_dir`: one writer at a time, outputs checked writable
    first). ``save_every``: :attr:`qkv.training.TrainConfig.save_every`, the minutes
    between periodic checkpoints. Returns the trained :class:`Translator` and the
    training history.

    Under ``torchrun --nproc_per_node=N`` every process runs this: each trains on its
    shard of the data (``settings.batch_size`` per process), only rank 0 logs, traces
    and saves, and every rank returns the same trained translator.
    """
    run_dir = Path(run_dir)
    check_save_every(save_every)
    with pipeline.training_run(run_dir, settings.device, resume=resume, overwrite=overwrite,
                               outputs=(LOSS_PLOT, ATTENTION_PLOT), log=log) as log:
        saved, src_vocab, tgt_vocab = None, None, None
        if resume:
            saved, _, src_vocab, tgt_vocab = _read_config(run_dir)
        given = settings
        settings = pipeline.run_settings(settings, saved, run_dir)

        # The corpus's digest and the recipe's choices made from it: from here on the
        # settings are the run's, as its config.json records them, and never change.
        settings, data = prepare_run_data(settings, src_vocab, tgt_vocab)

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
        if saved is None:
            log(f"recipe {settings.recipe!r}; chosen for these pairs, each changed by its "
                "flag:")
            for line in settings.choices(given):
                log(line)
        trim = model.config.ignores_source_padding
        loss_fn = translation_loss(data.tgt_vocab[BOS], settings.label_smoothing,
                                   trim_source=trim)
        if trace is not None and is_main_process():
            loss_fn = _traced_first_batch(model, loss_fn, trace)

        translator = Translator(model, data.src_vocab, data.tgt_vocab, settings)
        translator.held_out = data.valid_pairs
        # Exact match on (the sentences of up to 1,000 of) the held-out pairs after
        # every epoch.
        held_src, held_refs = group_references([s for s, _ in data.valid_pairs[:1000]],
                                               [t for _, t in data.valid_pairs[:1000]])

        held_set = TensorDataset(*(x[:1000] for x in data.valid))
        plain_loss = translation_loss(data.tgt_vocab[BOS], trim_source=trim)

        def validate(module: torch.nn.Module) -> dict[str, float]:
            # Held-out loss without label smoothing (what early stopping watches), and
            # greedy exact match and sacreBLEU, on up to 1,000 held-out pairs.
            device = next(module.parameters()).device
            loss_sum, tokens = 0.0, 0
            # A DataLoader draws a seed from the global RNG each time it is iterated,
            # unless it has a generator of its own: validating must not change the
            # dropout masks of the epochs that follow.
            for batch in batch_loader(held_set, 256, generator=torch.Generator()):
                s, n = plain_loss(module, tuple(x.to(device) for x in batch))
                loss_sum, tokens = loss_sum + float(s), tokens + int(n)
            scores = translator.score(translator.predict(held_src), held_refs)
            record = {"loss": loss_sum / max(tokens, 1), "exact_match": scores["exact_match"]}
            if scores["sacrebleu"] is not None:
                record["sacrebleu"] = scores["sacrebleu"]  # greedy: a trend, not the report
            return record

        module, history = pipeline.fit(
            model, loss_fn, TensorDataset(*data.train), settings, task=TASK, run_dir=run_dir,
            resume=resume, progress=progress, log=log, log_every=max(1, settings.epochs // 10),
            sections={"model": model.config.to_dict(), "src_vocab": data.src_vocab.to_dict(),
                      "tgt_vocab": data.tgt_vocab.to_dict()},
            validate=validate if held_src else None, save_every=save_every,
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
