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

A run records the SHA-256 of its text file (``settings.text_sha256``); resuming it reads
that file again and refuses in one line if it has changed. The text is tokenized once,
streaming, into ``tokens.bin`` in the run directory (memory-mapped for training, reused
by a resume: see :mod:`qkv.data.tokenfile`), so a text of any size trains in bounded
memory. Loading a run
(:meth:`LanguageModel.load`) reads the checkpoint and the BPE files only, never the
network: every field of ``config.json`` is validated and the weights file's header is
checked against the model the config describes before anything is built.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import (
    check_bool,
    fields_from_dict,
    show,
)
from ..data.chat import ChatTemplateError
from ..data.gguf_tokenizer import tokenizer_from_gguf
from ..data.lm import GPTDataset, create_dataloader, generated_corpus
from ..data.textfile import file_sha256
from ..data.tokenfile import TokenFile, prepare_token_file
from ..data.tokenizers import (
    HF_TOKENIZER_NAME,
    HFTokenizer,
    Tokenizer,
    get_tokenizer,
    load_hf_tokenizer,
    tokenizer_from_dict,
)
from ..models.gguf_model import gguf_config, gguf_state_dict
from ..models.gguf_weights import quantization_mix, read_gguf_metadata
from ..models.gpt import (
    GPTConfig,
    GPTModel,
    check_max_new_tokens,
    check_sampling,
    generate,
)
from ..models.hf_gpt2 import to_qkv as gpt2_to_qkv
from ..models.hf_open import config_fields, read_open_config, read_open_weights, to_qkv
from ..models.hub import fetch_model, is_repo_id
from ..models.quantized import (
    KEPT_TYPES,
    QuantizedWeight,
    dequantize_modules,
    quantize_modules,
    quantized_modules,
    tie_output_head,
)
from ..options import settings_class
from ..training import (
    LOAD_BYTES_PER_PARAMETER,
    LOSS_PLOT,
    SAVE_EVERY_MINUTES,
    TRAIN_BYTES_PER_PARAMETER,
    CheckpointError,
    LRSchedule,
    available_memory,
    can_fuse_optimizer,
    check_memory,
    check_save_every,
    check_weights,
    checkpoint_progress,
    get_rank_and_world_size,
    is_checkpoint,
    load_weights,
    main_process_first,
    read_weights_header,
    release_freed_memory,
    resolve_device,
    save_checkpoint,
)
from . import pipeline
from .settings import LM, LM_DEFAULTS, LM_UNSET

__all__ = ["LMSettings", "LanguageModel", "Generation", "TextStream", "train_language_model",
           "import_model", "IMPORT_DTYPES", "FINE_TUNE_WINDOW",
           "lm_loss", "import_gpt2", "param_groups", "FROM_INIT"]

TASK = "lm"
# Validation scores at most this many windows: spread evenly over the held-out text and
# the same ones at every evaluation, so the curve compares like with like. (The book's
# evaluate_model reads a few batches too.) The whole held-out tenth of a gigabyte of text
# would take longer to score than the training between two evaluations.
MAX_VALID_WINDOWS = 2048
# Training window of a fine-tuned open model unless --context-length says otherwise.
FINE_TUNE_WINDOW = 512


@settings_class(LM, LM_DEFAULTS)
class LMSettings:
    """Everything that defines a language-model training run; saved in the checkpoint.

    Its fields are the settings :data:`qkv.tasks.settings.LM` declares (name, type,
    valid values, help), in that order, with their defaults (:data:`LM_DEFAULTS`).
    ``context_length`` (default: the preset's) is the window length; ``stride`` (default:
    half the window, like the book's 256/128) the step between windows.
    ``val_fraction`` of the token ids, taken from the end, is held out for validation.
    ``epochs``, ``lr``, ``dtype``, ``compile`` and ``strategy`` left at None take
    :data:`LM_UNSET`'s values when a new run is resolved (:meth:`resolved`); on a resume,
    None means the run's own.
    """

    def resolved(self) -> LMSettings:
        """A copy with every setting left unset given :data:`LM_UNSET`'s value;
        validated."""
        out = dataclasses.replace(self, **{k: v for k, v in LM_UNSET.items()
                                           if getattr(self, k) is None})
        out.validate()
        return out

    def validate(self) -> None:
        """One-line ``ValueError`` naming the first field of the wrong type or range
        (each checked as :data:`qkv.tasks.settings.LM` declares it, non-finite numbers
        included)."""
        for name, setting in LM.items():
            setting.validate(getattr(self, name))
        self.schedule()  # LRSchedule's own checks: inverse_sqrt needs a warm-up
        if self.batch_tokens is not None and self.accumulate != 1:
            raise ValueError("give accumulate or batch_tokens, not both")

    def for_text(self, sha256: str | None, window: int) -> LMSettings:
        """The settings a run records, made once its text is read: the text's digest
        (``text_sha256``, None for the generated corpus) and, for ``batch_tokens``, the
        ``accumulate`` that reaches it with windows of ``window`` tokens."""
        out = dataclasses.replace(self, text_sha256=sha256)
        if self.batch_tokens is not None:
            out = dataclasses.replace(out, batch_tokens=None, accumulate=max(
                1, -(-self.batch_tokens // (self.batch_size * window))))
        return out

    def schedule(self) -> LRSchedule:
        """The learning-rate schedule of these settings."""
        return LRSchedule(warmup_steps=self.warmup_steps, decay=self.decay)

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The model these settings train, for a tokenizer of ``vocab_size`` ids."""
        if self.architecture is not None:
            changed = {"vocab_size": vocab_size}
            if self.drop_rate is not None:
                changed["drop_rate"] = self.drop_rate
            return GPTConfig.from_dict({**self.architecture, **changed})
        overrides: dict[str, Any] = {"vocab_size": vocab_size, "tie_weights": self.tie_weights,
                                     "qkv_bias": self.qkv_bias}
        for name in ("context_length", "drop_rate", "emb_dim", "n_heads", "n_layers"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        return GPTConfig.preset(self.preset, **overrides)

    def window(self, cfg: GPTConfig) -> int:
        """Tokens per training window: the model's context, or for an imported open
        model (whose context runs to tens of thousands of tokens) ``context_length``,
        default :data:`FINE_TUNE_WINDOW`, at most the model's context."""
        if self.architecture is None:
            return cfg.context_length
        return min(self.context_length or FINE_TUNE_WINDOW, cfg.context_length)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LMSettings:
        """The settings of a saved run, every field validated."""
        settings = cls(**fields_from_dict(cls, d, "lm settings"))
        settings.validate()
        return settings


def lm_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """Summed next-token cross-entropy of ``(inputs, targets)`` ``(batch, T)`` and ``b*T``."""
    inputs, targets = batch
    logits = model(inputs)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss_sum, torch.tensor(targets.numel(), device=targets.device)


@dataclass
class Generation:
    """A prompt's continuation and how fast it came: ``new_tokens`` counts every token
    generated, the end-of-sequence id that stopped it included, which ``text`` leaves out."""

    prompt: str
    text: str
    new_tokens: int
    seconds: float

    @property
    def tokens_per_sec(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


class TextStream:
    """The text of ids that arrive one at a time, in pieces that never end inside a
    character.

    A byte-level BPE token (GPT-2's, or one byte of the ``bytes`` tokenizer) can hold
    part of a multi-byte UTF-8 character; decoded alone, the part reads as U+FFFD.
    :meth:`push` returns only text that further ids cannot change: whenever the ids so
    far decode to text that ends in U+FFFD, that last character is held back until the
    next id tells whether it completes a character. Held ids are decoded together, from
    the last point where their text ended on a whole character, so the pieces joined are
    ``tokenizer.decode(all ids)``. After :data:`MAX_HELD` ids without such a point
    (output that is not text at all), what is held is given out as it decodes.
    """

    MAX_HELD = 32

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._held: list[int] = []
        self._sent = 0  # characters of decode(_held) already given out

    def push(self, token_id: int) -> str:
        """The new text that ``token_id`` completes (possibly ``""``)."""
        self._held.append(token_id)
        text = self.tokenizer.decode(self._held)
        if text.endswith("\ufffd") and len(self._held) < self.MAX_HELD:
            piece = text[self._sent : -1]
            self._sent = max(self._sent, len(text) - 1)
            return piece
        piece = text[self._sent :]
        self._held, self._sent = [], 0
        return piece

    def flush(self) -> str:
        """Whatever is still held, as it decodes now (the end of the output)."""
        piece = self.tokenizer.decode(self._held)[self._sent :]
        self._held, self._sent = [], 0
        return piece


class LanguageModel:
    """A trained GPT and its tokenizer: ``generate`` and ``attention``."""

    def __init__(self, model: GPTModel, tokenizer: Tokenizer, settings: LMSettings) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.settings = settings

    @classmethod
    def load(
        cls, run_dir: str | Path, device: str = "cpu", bpe_dir: str | None = None
    ) -> LanguageModel:
        """Rebuild from a checkpoint; anything malformed is one ``CheckpointError`` line.

        Reads the checkpoint and, for a gpt2 tokenizer, the BPE files in ``bpe_dir`` (else
        ``$QKV_BPE_DIR``, else the folder the run was trained with); never the text, never
        the network. Everything is checked before the model is built, in this order: the
        config's fields, the weights file's header against the shapes the config implies,
        the memory the model needs, and the tokenizer.
        """
        settings, model_config, tokenizer_dict = _read_config(run_dir)
        # The header first: a config edited to claim a huge model is a bad checkpoint,
        # not a machine short of memory.
        qtypes = _run_qtypes(run_dir, settings)
        _empty_model(run_dir, model_config, qtypes)
        n = model_config.num_parameters()
        # The weights are held once, in the buffer the file is read into (quantized
        # layers' blocks as stored): the file's tensor bytes, and a tenth for the rest.
        stored = sum(end - begin for begin, end in read_weights_header(run_dir).offsets.values())
        check_memory(stored + stored // 10 if stored else LOAD_BYTES_PER_PARAMETER * n,
                     f"loading {_model_name(settings, n)}",
                     hint="load it on a machine with more memory")
        try:
            tokenizer = tokenizer_from_dict(tokenizer_dict, bpe_dir=bpe_dir or settings.bpe_dir)
        except ValueError as e:
            raise CheckpointError(f"{run_dir}: tokenizer: {e}") from None
        except (OSError, ImportError) as e:  # BPE files missing, tiktoken not installed
            raise CheckpointError(f"{run_dir}: tokenizer: {e}; pass --bpe-dir DIR to a folder "
                                  "with GPT-2's encoder.json and vocab.bpe") from None
        if tokenizer.n_vocab != model_config.vocab_size:
            raise CheckpointError(
                f"{run_dir}: tokenizer has {tokenizer.n_vocab} ids but the model expects "
                f"vocab_size={model_config.vocab_size}"
            )
        del tokenizer_dict  # its tokenizer.json text, held once: by the tokenizer
        release_freed_memory()  # what parsing the config and the tokenizer left freed
        model = _load_model(run_dir, model_config, qtypes)
        return cls(model.to(resolve_device(device)), tokenizer, settings)

    @staticmethod
    def read_config(run_dir: str | Path) -> tuple[LMSettings, GPTConfig]:
        """A run's settings and model config, validated, without its weights or
        tokenizer: what a command checks of several runs before it loads any."""
        settings, model_config, _ = _read_config(run_dir)
        return settings, model_config

    @property
    def title(self) -> str:
        """What the model is, for a page or a log: ``"GPT 'mini'"``, or an imported
        model's type and source (``"llama from SmolLM2-135M-Instruct.Q4_1.gguf"``,
        ``"llama from HuggingFaceTB/SmolLM2-135M-Instruct"``)."""
        if self.settings.architecture is None:
            return f"GPT '{self.settings.preset}'"
        extra = self.settings.extra
        kind = str(extra.get("model_type", "open model"))
        source = extra.get("repo_id") or (Path(str(extra["source"])).name
                                          if "source" in extra else None)
        title = kind if source is None else f"{kind} from {source}"
        return title if self.settings.init is None else f"{title}, fine-tuned"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode_prompt(self, prompt: str, *, chat: bool = False,
                      system: str | None = None) -> Tensor:
        """``prompt``'s ids ``(1, T)``. A plain prompt is encoded as transformers encodes a
        text: an open model's tokenizer adds what it adds around one (Llama's and Gemma's
        BOS). With ``chat``, the prompt is the user's message: the model's chat template
        rendered around it (and the ``system`` message), whose text already holds every
        special token, so nothing is added."""
        check_bool("chat", chat)
        if system is not None and not chat:
            raise ValueError("a system message belongs to a chat: pass chat=True with it")
        if chat:
            if not isinstance(self.tokenizer, HFTokenizer):
                raise ValueError(f"chat needs an open model's tokenizer with a chat template; "
                                 f"this model's is {self.tokenizer.name!r}: prompt it with "
                                 "plain text instead")
            text = self.tokenizer.chat_prompt(prompt, system)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(prompt)  # an HFTokenizer adds its specials
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
        top_p: float | None = None,
        use_cache: bool = True,
        seed: int | None = None,
        on_text: Callable[[str], None] | None = None,
        chat: bool = False,
        system: str | None = None,
    ) -> Generation:
        """Continue ``prompt``; greedy at temperature 0, seedable sampling otherwise
        (``top_k``, ``top_p``: :func:`qkv.models.gpt.generate`).

        ``chat``: ``prompt`` is a user's message to an instruction-tuned open model, sent
        through its chat template with the optional ``system`` message
        (:meth:`encode_prompt`); the text is the model's reply. An open model's tokenizer
        (:class:`~qkv.data.tokenizers.HFTokenizer`) ends the text at any of its
        ``eos_token_ids``, which the text leaves out; the ``gpt2`` and ``bytes``
        tokenizers generate ``max_new_tokens`` tokens.

        ``on_text`` receives the text as it is generated, piece by piece (see
        :class:`TextStream`); the pieces joined are the returned ``text``. An exception
        it raises ends the generation. ``max_new_tokens`` is at most
        :data:`qkv.models.gpt.MAX_NEW_TOKENS`, checked before anything runs.
        """
        check_max_new_tokens(max_new_tokens)
        check_sampling(temperature, top_k, seed, top_p=top_p)
        idx = self.encode_prompt(prompt, chat=chat, system=system)
        eos = self.tokenizer.eos_token_ids if isinstance(self.tokenizer, HFTokenizer) else []
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        on_token = None
        if on_text is not None:
            stream = TextStream(self.tokenizer)

            def on_token(new: Tensor) -> None:
                token = int(new[0, 0])
                if token in eos:  # the end of the text, not a part of it
                    return
                piece = stream.push(token)
                if piece:
                    on_text(piece)

        start = time.perf_counter()
        out = generate(self.model, idx, max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, use_cache=use_cache, generator=generator,
                       eos_id=eos or None, on_token=on_token)
        seconds = time.perf_counter() - start
        if on_text is not None:
            rest = stream.flush()
            if rest:
                on_text(rest)
        new = out[0, idx.shape[1] :].tolist()
        text = new[:-1] if new and new[-1] in eos else new  # generation stops at an EOS
        return Generation(prompt, self.tokenizer.decode(text), len(new), seconds)

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
        """Per-layer, per-head attention of ``prompt``: one row of panels per layer. A
        layer whose weights are not a softmax (the delta rule's, of a Gated DeltaNet layer:
        rows need not sum to 1, weights may be negative) is drawn on a scale centred on 0:
        blue negative, white 0, red positive."""
        from ..utils.figures import plot_attention_grid

        labels, weights = self.attention(prompt)
        layers = range(len(weights)) if layers is None else layers
        for layer in layers:
            if not 0 <= layer < len(weights):
                raise ValueError(f"layer {layer} does not exist; the model has layers "
                                 f"0..{len(weights) - 1}")
        # One row per layer: a layer with fewer heads than the widest leaves slots empty.
        ncols = max(weights[layer].shape[0] for layer in layers)
        panels, titles, cmaps, centred = [], [], [], []
        for layer in layers:
            # a class with a section of its own on qkv view's page: not softmax weights
            signed = getattr(self.model.trf_blocks[layer].att, "weights_section", None)
            for head, matrix in enumerate(weights[layer]):
                panels.append(matrix)
                titles.append(f"layer {layer}, head {head}{' (not softmax)' if signed else ''}")
                cmaps.append("RdBu_r" if signed else "Reds")
                centred.append(bool(signed))
            panels += [None] * (ncols - len(weights[layer]))
        # Make whitespace tokens visible on the axes.
        shown = [t.replace(" ", "·").replace("\n", "\\n").replace("\t", "\\t") for t in labels]
        return plot_attention_grid(
            panels, titles=titles, row_labels=shown, col_labels=shown, path=path,
            ncols=ncols, cmap=cmaps, centred=centred,
            suptitle=f"Causal self-attention on {prompt!r}",
        )


def _token_ids(settings: LMSettings, tokenizer: Tokenizer, run_dir: Path, progress: bool,
               log: Callable[[str], None]) -> tuple[torch.Tensor | np.ndarray, str | None]:
    """The training text's ids and the SHA-256 of its file (None for the generated corpus).

    A text file is tokenized once, streaming, into ``run_dir``'s memory-mapped id file
    (:func:`qkv.data.tokenfile.prepare_token_file`), which later runs over the same text
    (a resume) reuse; a file whose digest the settings recorded (a run being resumed)
    must still have it. Under torchrun, rank 0 writes the id file and the other ranks
    then read it.
    """
    if settings.text is None:
        text = generated_corpus(settings.corpus_chars, seed=settings.seed)
        return torch.tensor(tokenizer.encode(text), dtype=torch.long), None

    def prepare() -> TokenFile:
        return prepare_token_file(settings.text, tokenizer, run_dir,  # type: ignore[arg-type]
                                  sha256=settings.text_sha256, progress=progress, log=log)

    tokens = main_process_first(prepare)  # the other ranks reuse rank 0's token file
    return tokens.ids, tokens.sha256


def _model_name(settings: LMSettings, num_params: int) -> str:
    if settings.architecture is not None:
        return f"this {num_params:,}-parameter open model"
    resized = any(getattr(settings, k) is not None for k in _SIZES)
    return (f"this {num_params:,}-parameter GPT ('{settings.preset}' preset"
            f"{', resized' if resized else ''})")


# What LMSettings.extra says of an imported model's origin (qkv lm import writes them).
_ORIGIN_KEYS = ("model_type", "source", "repo_id", "revision")


# Where a quantized run's settings record its quantized layers (module -> GGML type).
QUANTIZED_KEY = "quantized"

# The weight dtypes a run may store (safetensors' names): float32, or bfloat16 for an
# open model imported with --dtype bfloat16.
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16}


def _run_qtypes(run_dir: str | Path, settings: LMSettings) -> dict[str, str]:
    """The run's quantized layers (``qkv lm import --keep-quantized``): module name ->
    GGML type, as its settings record them; empty for a float run."""
    qtypes = settings.extra.get(QUANTIZED_KEY, {})
    if not (isinstance(qtypes, dict) and all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in qtypes.items())):
        raise CheckpointError(f"{run_dir}: config.json: settings.extra.{QUANTIZED_KEY} is "
                              f"{show(qtypes)}; expected module name -> GGML type")
    return qtypes


def _empty_model(run_dir: str | Path, cfg: GPTConfig, qtypes: dict[str, str]
                 ) -> tuple[GPTModel, torch.dtype]:
    """The run's model on the meta device (no memory), in the dtype its weights are
    stored in, its quantized layers in place, after the weights' header has been checked
    against it (names, shapes, dtypes): a config that does not match its weights is a
    ``CheckpointError``, whatever size it claims."""
    found = read_weights_header(run_dir).shapes()
    unlisted = [name for name in found if name.endswith(".blocks")
                and name.rpartition(".")[0] not in qtypes]
    if unlisted:
        raise CheckpointError(f"{run_dir}: the weights hold {unlisted[0]}, quantized blocks "
                              f"that config.json's settings.extra.{QUANTIZED_KEY} does not "
                              "list")
    floats = sorted({dtype for name, (dtype, _) in found.items()
                     if name.rpartition(".")[0] not in qtypes})
    if len(floats) != 1 or floats[0] not in _STORED_DTYPES:
        raise CheckpointError(f"{run_dir}: the float weights are stored as "
                              f"{', '.join(floats) or 'nothing'}; runs store one of "
                              f"{' or '.join(_STORED_DTYPES)}")
    dtype = _STORED_DTYPES[floats[0]]
    if not qtypes:
        check_weights(run_dir, cfg.parameter_shapes(), cfg.num_saved_values(),
                      dtype=floats[0])
        return cfg.meta_model().to(dtype), dtype
    model = cfg.meta_model().to(dtype)
    with torch.device("meta"):
        try:
            quantize_modules(model, qtypes, dtype)
            if cfg.tie_weights:
                tie_output_head(model)
        except ValueError as error:
            raise CheckpointError(f"{run_dir}: config.json: {error}") from None
    state = model.state_dict()
    saved = ({id(p): p.numel() for p in model.parameters()}
             | {id(b): b.numel() for b in model.buffers()})
    check_weights(run_dir, ((k, tuple(v.shape)) for k, v in state.items()),
                  sum(saved.values()), dtype=floats[0],
                  dtypes={k: "U8" for k, v in state.items() if v.dtype == torch.uint8})
    return model, dtype


def _load_model(run_dir: str | Path, cfg: GPTConfig, qtypes: dict[str, str]) -> GPTModel:
    """The run's model, in the dtype its weights are stored in, its quantized layers
    kept in their blocks. Built on the meta device and given the tensors of the file as
    read (``assign``): the weights are held once, in the buffer the file was read into."""
    model, _ = _empty_model(run_dir, cfg, qtypes)
    load_weights(run_dir, model, load=lambda tensors: model.load_state_dict(tensors,
                                                                            assign=True))
    if cfg.tie_weights:
        tie_output_head(model)
    return model


def _read_config(run_dir: str | Path) -> tuple[LMSettings, GPTConfig, dict[str, Any]]:
    """A language model's ``config.json``, validated and cross-checked; the tokenizer's
    dict is checked when the tokenizer is rebuilt."""
    config = pipeline.read_run_config(run_dir, task=TASK, what="a language model",
                                      sections=("task", "settings", "model", "tokenizer"))
    settings = config.parse("settings", LMSettings.from_dict)
    model_config = config.parse("model", GPTConfig.from_dict)
    # Settings that each pass their own checks may still not make a model (sizes that
    # do not divide): that too is a bad checkpoint, in one line.
    implied = config.parse("settings", lambda _: settings.model_config(model_config.vocab_size))
    pipeline.check_model_config(config.path, model_config, implied)
    return settings, model_config, config.sections["tokenizer"]


def train_language_model(
    settings: LMSettings,
    run_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    save_every: float = SAVE_EVERY_MINUTES,
) -> tuple[LanguageModel, dict[str, list]]:
    """Train (or, with ``resume``, continue) a GPT in ``run_dir``.

    With ``resume``, everything but ``settings.epochs`` (the new total; None: the run's
    own), ``settings.lr`` (None: the run's own), ``settings.bpe_dir`` (None: the run's
    own) and ``settings.device`` comes from the checkpoint. Without it, a ``run_dir``
    that holds a checkpoint is refused unless ``overwrite`` (see
    :func:`qkv.training.open_run_dir`).

    Under ``torchrun --nproc_per_node=N`` every process runs this on its shard of the
    windows (``settings.batch_size`` per process); only rank 0 logs and saves.
    ``save_every``: :attr:`qkv.training.TrainConfig.save_every`, the minutes between
    periodic checkpoints.
    """
    run_dir = Path(run_dir)
    check_save_every(save_every)
    with pipeline.training_run(run_dir, settings.device, resume=resume, overwrite=overwrite,
                               outputs=(LOSS_PLOT,), log=log) as log:
        saved, saved_tokenizer = None, None
        if resume:
            saved, _, saved_tokenizer = _read_config(run_dir)
            if checkpoint_progress(run_dir) is None:  # e.g. made by qkv lm import
                raise CheckpointError(
                    f"{run_dir}: holds weights but no training state, so there is nothing "
                    f"to resume; start a new run from its weights: --init {run_dir}")
        elif settings.init is not None:
            settings, saved_tokenizer = _settings_from_init(settings)
        settings = pipeline.run_settings(settings, saved, run_dir)

        if saved_tokenizer is None:
            tokenizer = get_tokenizer(settings.tokenizer, bpe_dir=settings.bpe_dir)
        else:  # offline, and checked to give the saved run's ids
            tokenizer = tokenizer_from_dict(saved_tokenizer, bpe_dir=settings.bpe_dir)
        ids, text_sha256 = _token_ids(settings, tokenizer, run_dir, progress, log)
        cfg = settings.model_config(tokenizer.n_vocab)
        window = settings.window(cfg)
        # The text's digest and the choices made from the window: from here on the
        # settings are the run's, as its config.json records them, and never change.
        chose_accumulate = settings.batch_tokens is not None
        settings = settings.for_text(text_sha256, window)
        if chose_accumulate:
            log(f"accumulate {settings.accumulate}: {settings.accumulate} x "
                f"{settings.batch_size} x {window} = "
                f"{settings.accumulate * settings.batch_size * window:,} tokens per step")
        stride = settings.stride or max(1, window // 2)
        split = int(len(ids) * (1 - settings.val_fraction))
        train_ids, val_ids = ids[:split], ids[split:]
        train_set = GPTDataset(train_ids, window, stride)
        val_set = GPTDataset(val_ids, window, window) if len(val_ids) > window else None
        # On a large text, validate on windows spread evenly over the held-out part.
        val_windows = None if val_set is None or len(val_set) <= MAX_VALID_WINDOWS else \
            torch.linspace(0, len(val_set) - 1, MAX_VALID_WINDOWS,
                           dtype=torch.float64).round().long().tolist()
        _, world_size = get_rank_and_world_size()
        strategy = settings.strategy
        if strategy == "fsdp" and world_size == 1:
            log("note: --strategy fsdp shards the model across the processes of a torchrun "
                "job; in one process it trains the whole model as usual")
        if len(train_set) < settings.batch_size * world_size:
            raise ValueError(
                f"{len(train_ids):,} training tokens give {len(train_set)} windows of "
                f"{window}, fewer than batch_size={settings.batch_size} x {world_size} "
                "process(es); use more text, a smaller --context-length or --batch-size"
            )

        num_params, batch = cfg.num_parameters(), settings.batch_size
        counted = num_params
        if strategy == "fsdp":
            # A process keeps 1 / world_size of the weights, gradients and AdamW state,
            # but first builds the whole model (weights only) and then shards it: the
            # larger of the two, in parameters' worth of training state.
            counted = max(-(-num_params // world_size), -(
                -num_params * LOAD_BYTES_PER_PARAMETER // TRAIN_BYTES_PER_PARAMETER))
        pipeline.check_training_memory(  # before a byte of the model exists
            f"{_model_name(settings, num_params)} on batches of {batch} x {window} tokens",
            counted, optimizer="AdamW", device=settings.device,
            activation_bytes=4 * cfg.num_saved_activations(batch, window),
            hint="choose a smaller --preset, --context-length or --batch-size",
        )
        if settings.init is not None and not resume:
            model = _load_model(settings.init, cfg,
                                _run_qtypes(settings.init, _read_config(settings.init)[0]))
            # trained in float32 (--dtype: the forward's autocast), whatever stored;
            # quantized blocks expanded, as gradients need float weights
            expanded = dequantize_modules(model, torch.float32)
            model.float()
            log(f"starting from the weights of {settings.init}")
            if expanded:
                kinds = ", ".join(sorted(set(expanded.values())))
                log(f"its {len(expanded)} quantized layers ({kinds}) are expanded to "
                    "float32 to train")
        else:
            model = GPTModel(cfg).init_weights()
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log(f"GPT '{settings.preset}': {n_params:,} parameters, {cfg.n_layers} layers x "
            f"{cfg.n_heads} heads, context {window}; tokenizer {tokenizer.name} "
            f"({tokenizer.n_vocab:,} ids); {len(train_ids):,} training tokens in "
            f"{len(train_set):,} windows, {len(val_ids):,} validation tokens"
            + ("" if val_windows is None else f" (validation scores {len(val_windows):,} of "
               f"their {len(val_set):,} windows, spread evenly)"))

        def optimizer(module: nn.Module) -> torch.optim.Optimizer:
            # Built by the trainer, after FSDP (if any) has sharded the parameters. The
            # fused update (one kernel for all tensors) took GPT-2 small's AdamW step
            # from 0.69 s to 0.11 s on the CPU; FSDP's sharded parameters take the
            # default loop.
            fused = can_fuse_optimizer(module.parameters())
            return torch.optim.AdamW(param_groups(module, settings.weight_decay),
                                     lr=settings.lr, fused=fused or None)

        def validate(module: nn.Module) -> dict[str, float]:
            device = next(module.parameters()).device
            loss_sum, tokens = 0.0, 0
            # A DataLoader draws a seed from the global RNG each time it is iterated,
            # unless it has a generator of its own: validating must not change the
            # dropout masks of the epochs that follow.
            for inputs, targets in create_dataloader(val_set, batch_size=settings.batch_size,
                                                     shuffle=False, drop_last=False,
                                                     sampler=val_windows,
                                                     generator=torch.Generator()):
                s, n = lm_loss(module, (inputs.to(device), targets.to(device)))
                loss_sum, tokens = loss_sum + s.item(), tokens + int(n)
            return {"loss": loss_sum / tokens}

        module, history = pipeline.fit(
            model, lm_loss, train_set, settings, task=TASK, run_dir=run_dir, resume=resume,
            progress=progress, log=log, log_every=1, drop_last=True, optimizer=optimizer,
            sections={"model": cfg.to_dict(), "tokenizer": tokenizer.to_dict()},
            validate=validate if val_set is not None else None,
            flops_per_token=cfg.training_flops_per_token(window),
            epoch_samples=None if settings.eval_every is None else
            settings.eval_every * settings.accumulate * batch * world_size,
            # --eval-every promises a save at each evaluation, early stopping or not.
            checkpoint_every=0 if settings.eval_every is None else 1,
            save_every=save_every,
        )
        return LanguageModel(module, tokenizer, settings), history


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups for a GPT: decoupled weight decay on the matrices of the linear
    layers only; none on biases, norm gains and shifts, or the embeddings (a tied output
    head is the token embedding, so it is not decayed either)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # each shared Parameter once
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


# The LMSettings fields that override a preset's sizes.
_SIZES = ("emb_dim", "n_heads", "n_layers")
# What a run started with --init takes from the run it starts from; context_length too,
# unless that run is an imported open model, whose training window it is (LMSettings.window).
FROM_INIT = ("tokenizer", "preset", *_SIZES, "qkv_bias", "tie_weights", "architecture")


def _architecture(cfg: GPTConfig, preset: str) -> dict[str, Any]:
    """The LMSettings fields that make ``preset`` into ``cfg``'s architecture: its
    context length, head bias and tying, and the sizes that differ from the preset's
    (those equal to it stay None, as in any run of that preset)."""
    base = GPTConfig.preset(preset)
    return {"preset": preset, "context_length": cfg.context_length,
            "qkv_bias": cfg.qkv_bias, "tie_weights": cfg.tie_weights,
            **{k: getattr(cfg, k) if getattr(cfg, k) != getattr(base, k) else None
               for k in _SIZES}}


def _settings_from_init(settings: LMSettings) -> tuple[LMSettings, dict[str, Any]]:
    """``settings`` with the tokenizer and architecture of the run ``settings.init``
    (read and validated), and that run's tokenizer dict. A field set to something else
    than its default and than the init run's is refused in one line: the weights could
    not be used."""
    init = Path(settings.init)  # type: ignore[arg-type]
    if not is_checkpoint(init):
        raise ValueError(f"--init {init}: no checkpoint there (a run directory of qkv lm "
                         "train or qkv lm import)")
    theirs, cfg, tokenizer = _read_config(init)
    arch = {"tokenizer": theirs.tokenizer, **_architecture(cfg, theirs.preset),
            "architecture": theirs.architecture}
    if theirs.architecture is not None:
        del arch["context_length"]  # the window, this run's to choose
    defaults = LMSettings()
    for name in arch:
        ours, wanted = getattr(settings, name), arch[name]
        if name in _SIZES and wanted is None:
            wanted = getattr(cfg, name)  # the preset's size, which the weights have
        if ours != getattr(defaults, name) and ours != wanted:
            raise ValueError(f"{name} {show(ours)} conflicts with the run it starts from "
                             f"({init}: {show(wanted)}); leave it out")
    # an imported model's origin (its type and source) stays with its fine-tuned runs
    origin = {k: v for k, v in theirs.extra.items() if k in _ORIGIN_KEYS}
    return dataclasses.replace(
        settings, **arch, bpe_dir=settings.bpe_dir or theirs.bpe_dir,
        extra={**origin, **settings.extra},
        drop_rate=cfg.drop_rate if settings.drop_rate is None else settings.drop_rate,
    ), tokenizer


def import_gpt2(
    folder: str | Path,
    run_dir: str | Path,
    *,
    bpe_dir: str | Path | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> LanguageModel:
    """Make a run directory of a Hugging Face GPT-2 folder, for ``lm generate``,
    ``lm attention`` and :meth:`LanguageModel.load`.

    The weights come through :meth:`GPTModel.from_hf`; the tokenizer is GPT-2's BPE from
    the folder's ``vocab.json`` and ``merges.txt`` (or from ``bpe_dir``). The config,
    the tokenizer's size against the model's and the memory the model needs are all
    checked before it is built; the run directory follows the usual rules (one writer,
    an existing checkpoint replaced only with ``overwrite``).
    """
    from ..models.hf_gpt2 import read_config

    folder, run_dir = Path(folder), Path(run_dir)
    fields = read_config(folder)
    cfg = GPTConfig(**fields)
    bpe = Path(bpe_dir) if bpe_dir is not None else folder
    tokenizer = get_tokenizer("gpt2", bpe_dir=bpe)
    if tokenizer.n_vocab != cfg.vocab_size:
        raise ValueError(f"{folder}: the model has vocab_size {cfg.vocab_size} but the "
                         f"GPT-2 tokenizer in {bpe} has {tokenizer.n_vocab} ids")
    # The GPT-2 preset of this size, if there is one; the fields that differ are kept.
    preset = next((name for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")
                   if not any(_architecture(cfg, name)[k] for k in _SIZES)), "gpt2-small")
    settings = LMSettings(tokenizer="gpt2", bpe_dir=str(bpe.resolve()), epochs=0, lr=1e-3,
                          drop_rate=cfg.drop_rate, **_architecture(cfg, preset))
    settings.validate()
    n = cfg.num_parameters()
    check_memory(LOAD_BYTES_PER_PARAMETER * n, f"importing {_model_name(settings, n)}",
                 hint="import it on a machine with more memory")
    with pipeline.training_run(run_dir, "cpu", resume=False, overwrite=overwrite,
                               outputs=(), log=log) as log:
        model = GPTModel.from_hf(folder)
        save_checkpoint(run_dir, model, {
            "task": TASK, "settings": dataclasses.asdict(settings), "model": cfg.to_dict(),
            "tokenizer": tokenizer.to_dict()})
        log(f"imported {_model_name(settings, n)} from {folder} into {run_dir}")
    return LanguageModel(model, tokenizer, settings)


# Weight dtypes an import may store (--dtype).
IMPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def import_model(
    source: str | Path,
    run_dir: str | Path,
    *,
    dtype: str = "float32",
    bpe_dir: str | Path | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    keep_quantized: bool = False,
) -> LanguageModel:
    """Make a run directory of an open model, for ``lm generate``, ``lm attention``,
    ``qkv view``, ``lm train --init`` and :meth:`LanguageModel.load`.

    ``source`` is one of:

    - a Hugging Face folder: ``config.json`` (``model_type`` one of
      :data:`qkv.models.hf_open.SUPPORTED_TYPES`), ``model.safetensors`` or its shards
      with ``model.safetensors.index.json``, and ``tokenizer.json`` (with
      ``tokenizer_config.json``'s chat template and ``generation_config.json``'s EOS
      ids); a GPT-2 folder's ``vocab.json``/``merges.txt`` (or ``bpe_dir``) as before;
    - a ``.gguf`` file (llama.cpp, Ollama, LM Studio): weights dequantized, tokenizer and
      chat template from its metadata;
    - a Hugging Face repo id (``HuggingFaceTB/SmolLM2-135M-Instruct``), downloaded
      through ``huggingface_hub`` (``revision``, ``cache_dir``) when no such path exists.

    The weights are stored in ``dtype`` (``"float32"`` or ``"bfloat16"``). With
    ``keep_quantized`` (a ``.gguf`` file only), every linear layer and embedding whose
    matrix the file holds as one of :data:`~qkv.models.quantized.KEPT_TYPES` keeps its
    blocks (:class:`~qkv.models.quantized.QuantizedLinear`), stored as they are: the run
    is no larger than the file; every other tensor is expanded to ``dtype``. The config
    and every tensor's name and shape are checked, and the memory the model needs, before
    anything is allocated; the run directory follows the usual rules (one writer, an
    existing checkpoint replaced only with ``overwrite``).
    """
    if dtype not in IMPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(IMPORT_DTYPES)}, got {show(dtype)}")
    run_dir = Path(run_dir)
    text = str(source)
    path = Path(text).expanduser()
    origin = {"source": str(path)}  # what the run records it was made of
    if not os.path.lexists(path):
        if not is_repo_id(text):
            raise FileNotFoundError(f"{text}: no such file or folder (give a Hugging Face "
                                    "folder, a .gguf file or a repo id such as "
                                    "HuggingFaceTB/SmolLM2-135M-Instruct)")
        path = fetch_model(text, revision=revision, cache_dir=cache_dir, log=log)
        # the snapshot's folder is named for the commit it holds: the exact revision
        origin = {"repo_id": text, "revision": path.name}
    torch_dtype = IMPORT_DTYPES[dtype]
    if path.is_file():
        return _import_gguf(path, origin, run_dir, torch_dtype, overwrite, log,
                            keep_quantized)
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder or a .gguf file")
    if keep_quantized:
        raise ValueError(f"{path}: --keep-quantized keeps a .gguf file's blocks; a Hugging "
                         "Face folder's weights are floats (leave it out)")
    config = read_open_config(path)
    if config.get("model_type", "gpt2") == "gpt2":
        if dtype != "float32":
            raise ValueError("--dtype bfloat16: GPT-2 imports as float32 (its runs use the "
                             "fast float32 decoder); leave --dtype out")
        return import_gpt2(path, run_dir, bpe_dir=bpe_dir, overwrite=overwrite, log=log)
    cfg = GPTConfig(**config_fields(config, str(path / "config.json")))
    tokenizer = _fit_tokenizer(load_hf_tokenizer(path), cfg, path)
    fields = dataclasses.asdict(cfg)

    def read(budget: int | None) -> dict[str, Tensor]:
        return read_open_weights(path, fields, torch_dtype, max_bytes=budget,
                                 model_type=config["model_type"])

    return _save_import(cfg, {"model_type": str(config["model_type"]), **origin}, tokenizer,
                        read, torch_dtype, run_dir, overwrite, log)


# GGML types whose bytes are the values themselves (never "quantized").
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _import_gguf(path: Path, origin: dict[str, str], run_dir: Path, dtype: torch.dtype,
                 overwrite: bool, log: Callable[[str], None] | None,
                 keep_quantized: bool = False) -> LanguageModel:
    header, metadata = read_gguf_metadata(path)
    config = gguf_config(header)  # what a Hugging Face folder's config.json would say
    fields = config_fields(config, str(path))
    cfg = GPTConfig(**fields)
    tokenizer = _fit_tokenizer(tokenizer_from_gguf(path, metadata=metadata), cfg, path)
    del metadata
    release_freed_memory()  # the token lists' strings, before the weights are read
    gpt2 = config.get("model_type") == "gpt2"
    # Blocks are kept where a matrix reaches its layer as stored (rows reordered at
    # most): plain attention and dense MLPs. Experts, latent attention's split
    # projections and GPT-2's transposed weights are expanded.
    plain = not gpt2 and all(cfg.layer_spec(i).attention == "mha"
                             and cfg.layer_spec(i).mlp == "dense" for i in range(cfg.n_layers))
    keep = KEPT_TYPES if keep_quantized and plain else ()
    notes = []
    if keep_quantized:
        quantized = [t.type_name for t in header.tensors.values()
                     if t.type_name not in _FLOAT_TYPES]
        expanded = sorted({t for t in quantized if t not in keep})
        if expanded:
            why = "" if plain else f" (a {config.get('model_type')} model's layers keep no blocks)"
            notes.append(f"--keep-quantized: expanded to {str(dtype).removeprefix('torch.')}: "
                         f"{', '.join(expanded)}{why}")

    def read(budget: int | None) -> dict[str, Tensor | QuantizedWeight]:
        raw = gguf_state_dict(path, header, config, dtype, max_bytes=budget, keep=keep)
        # consume: a tensor converted to qkv's layout (gpt-oss's experts) leaves raw as
        # its copy is made, so the model is not held twice
        ours = gpt2_to_qkv(raw, fields) if gpt2 else to_qkv(
            raw, fields, config["model_type"], consume=True)
        return {name: t if isinstance(t, QuantizedWeight) else t.to(dtype)
                for name, t in ours.items()}

    # Which file exactly (bench generate runs llama.cpp on it, if it is still the same).
    origin = {**origin, "source_sha256": file_sha256(path, "GGUF file")}
    # The model card's line: what the file holds, as a user compares quantizations.
    card = [f"tensors in the file: {quantization_mix(header)}", *notes]
    # What the weights take: kept tensors their blocks, the others expanded.
    item = torch.empty((), dtype=dtype).element_size()
    weight_bytes = sum(t.nbytes if t.type_name in keep and len(t.shape) == 2 else
                       t.numel * item for t in header.tensors.values())
    return _save_import(cfg, {"model_type": str(config.get("model_type")), **origin},
                        tokenizer, read, dtype, run_dir, overwrite, log, card,
                        weight_bytes if keep else None)


def _fit_tokenizer(tokenizer: HFTokenizer, cfg: GPTConfig, source: Path) -> HFTokenizer:
    """``tokenizer`` with the model's vocabulary size: models pad their embedding past
    the tokenizer's last id (Qwen: to a multiple of 128 rows); a tokenizer with ids the
    model has no row for cannot be used. Its chat template is rendered once on a probe
    conversation, within the render limits: a model whose template fails (it does not
    parse, runs too long, builds too much) is refused here, before its weights are read,
    rather than imported to fail at each ``--chat``."""
    try:
        tokenizer.check_chat_template()
    except ChatTemplateError as error:
        raise ValueError(f"{source}: its chat template fails on a one-message conversation, "
                         f"so the model is not imported: {error} (a model without a "
                         "template imports as a base model)") from None
    if tokenizer.n_vocab > cfg.vocab_size:
        raise ValueError(f"{source}: the tokenizer has {tokenizer.n_vocab:,} ids but the "
                         f"model only {cfg.vocab_size:,} embedding rows")
    if tokenizer.n_vocab < cfg.vocab_size:
        widened = tokenizer_from_dict({**tokenizer.to_dict(), "n_vocab": cfg.vocab_size})
        assert isinstance(widened, HFTokenizer)
        return widened
    return tokenizer


def _save_import(
    cfg: GPTConfig,
    origin: dict[str, str],
    tokenizer: HFTokenizer,
    read: Callable[[int | None], dict[str, Tensor]],
    dtype: torch.dtype,
    run_dir: Path,
    overwrite: bool,
    log: Callable[[str], None] | None,
    card: Sequence[str] = (),
    weight_bytes: int | None = None,
) -> LanguageModel:
    """Check memory, read the weights (``read(budget in bytes)``, qkv's names) into a
    model built without allocating its own, and save the run; ``origin`` (the model
    type, and the source path or the repo id) is kept in the settings' ``extra``;
    ``card``, lines about the source, are logged after the import's own. ``read`` may
    give a weight as its blocks (a :class:`~qkv.models.quantized.QuantizedWeight`): its
    layer is then kept quantized, and ``weight_bytes`` says what the weights take."""
    source = origin.get("repo_id") or origin.get("source")
    n = cfg.num_parameters()
    item = torch.empty((), dtype=dtype).element_size()
    settings = LMSettings(tokenizer=HF_TOKENIZER_NAME, architecture=cfg.to_dict(), epochs=0,
                          lr=1e-3, drop_rate=cfg.drop_rate,
                          extra=origin)
    settings.validate()
    what = f"importing {_model_name(settings, n)} as {str(dtype).removeprefix('torch.')}"
    # the weights, plus one tensor's float32 expansion at a time (a bounded extra)
    check_memory(item * n if weight_bytes is None else weight_bytes, what,
                 hint="import it on a machine with more memory, or pass --dtype bfloat16")
    with pipeline.training_run(run_dir, "cpu", resume=False, overwrite=overwrite,
                               outputs=(), log=log) as log:
        tensors = read(available_memory())
        if cfg.tie_weights:
            tensors.setdefault("out_head.weight", tensors["tok_emb.weight"])
        qtypes = {name.removesuffix(".weight"): t.qtype for name, t in tensors.items()
                  if isinstance(t, QuantizedWeight)}
        model = cfg.meta_model()
        with torch.device("meta"):
            quantize_modules(model, qtypes, dtype)
        tensors = {f"{name.removesuffix('.weight')}.blocks" if isinstance(t, QuantizedWeight)
                   else name: t.blocks if isinstance(t, QuantizedWeight) else t
                   for name, t in tensors.items()}
        # assign: the model takes the read tensors as its parameters, no second copy
        model.load_state_dict(tensors, assign=True)
        if cfg.tie_weights:
            tie_output_head(model)
        model.eval()
        if qtypes:
            settings = dataclasses.replace(settings, extra={
                **settings.extra, QUANTIZED_KEY: quantized_modules(model)})
        save_checkpoint(run_dir, model, {
            "task": TASK, "settings": dataclasses.asdict(settings), "model": cfg.to_dict(),
            "tokenizer": tokenizer.to_dict()})
        log(f"imported {_model_name(settings, n)} from {source} into {run_dir} "
            f"({str(dtype).removeprefix('torch.')})")
        for line in card:
            log(line)
        if qtypes:
            kinds = Counter(qtypes.values())
            log(f"kept in their blocks: {len(qtypes)} layers "
                f"({', '.join(f'{t} x {k}' for t, k in kinds.most_common())})")
    return LanguageModel(model, tokenizer, settings)
