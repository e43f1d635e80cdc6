"""Each task's settings, declared once, with their defaults and the translation task's
recipes (``--preset``).

A task's settings are the shared :data:`qkv.options.TRAINING` ones it uses plus its
own, declared here as :class:`qkv.options.Setting`; :data:`TRANSLATE` and :data:`LM`
list them in the order the settings dataclasses and ``--help`` show them. A setting's
default is in :data:`TRANSLATE_DEFAULTS` or :data:`LM_DEFAULTS`, or, for a translator,
in its recipe (:data:`PRESETS`, :func:`recipe_values`). Free of torch, so that ``qkv
translate train --help`` shows them all without importing it.
"""

from __future__ import annotations

from typing import Any

from ..checks import MAX_COUNT, MAX_SIZE, check_float, check_int, check_sha256, check_str, show
from ..options import (
    BACKENDS,
    DATES_NUM_STEPS,
    GPT_PRESETS,
    HF_TOKENIZER_NAME,
    MAX_BEAM,
    MODEL_NAMES,
    SPLIT_BY,
    TOKENIZER_NAMES,
    TRAINING,
    Setting,
)

# d2l's recipe for its 600 fra-eng pairs: the model's sizes, Adam at 0.005 for 250
# epochs, no schedule, no smoothing, no early stopping, greedy decoding.
D2L_RECIPE: dict[str, Any] = {
    "num_examples": 600, "num_steps": 10, "epochs": 250, "held_out": 0.0, "lr": 0.005,
    "embed_size": 32, "num_hiddens": 32, "num_layers": 2, "dropout": 0.1, "num_heads": 4,
    "ffn_num_hiddens": 64, "batch_size": 64, "warmup_steps": 0, "decay": "constant",
    "label_smoothing": 0.0, "patience": 0, "beam": 1, "split_by": "pair",
    "dtype": "float32", "compile": False, "skip_padding": False, "ban_unk": False}
# Named recipes (--preset). "d2l" and "dates" are fixed; "corpus" is for a user's own
# sentence pairs: every pair read, 5 % held out, a wider model, warm-up + cosine decay,
# label smoothing, early stopping on the held-out loss and beam search in the final
# report, with the epochs (and the held-out count and sentence length) chosen from the
# corpus once it is read (see TranslateSettings.for_corpus).
PRESETS: dict[str, dict[str, Any]] = {
    "d2l": D2L_RECIPE,
    # The dates corpus is larger and its sentences longer; it needs far fewer epochs.
    "dates": {**D2L_RECIPE, "num_examples": 10_000, "num_steps": DATES_NUM_STEPS,
              "epochs": 10, "held_out": 0.1},
    "corpus": {
        "bahdanau": {"embed_size": 128, "num_hiddens": 256, "num_layers": 2,
                     "dropout": 0.2, "batch_size": 128, "lr": 0.005, "warmup_steps": 200,
                     "decay": "cosine", "label_smoothing": 0.1, "patience": 4, "beam": 4},
        "transformer": {"num_hiddens": 128, "num_layers": 2, "num_heads": 4,
                        "ffn_num_hiddens": 512, "dropout": 0.2, "batch_size": 128,
                        "lr": 0.002, "warmup_steps": 300, "decay": "cosine",
                        "label_smoothing": 0.1, "patience": 4, "beam": 4},
    },
}
PRESET_NAMES = tuple(PRESETS)
# The corpus recipe's training length: about this many optimizer steps per model
# (epochs are rounded up), between these bounds. At its model sizes on 2 CPU cores
# either takes under ten minutes on an 18k-pair corpus; see docs/benchmarks.md.
CORPUS_STEPS = {"transformer": 2_700, "bahdanau": 1_600}
CORPUS_EPOCHS = (3, 100)
# The corpus recipe's held-out split: 5 % of the pairs, at least one batch, at most 5,000.
CORPUS_HELD_OUT = (0.05, 5_000)


def recipe_values(recipe: str, model: str) -> dict[str, Any]:
    """The values ``recipe`` gives a ``model`` translator's settings. The corpus recipe
    leaves ``num_examples`` None (every pair), and ``num_steps``, ``held_out`` and
    ``epochs`` None until it has seen the corpus (``TranslateSettings.for_corpus``)."""
    if recipe != "corpus":
        return dict(PRESETS[recipe])
    return {**D2L_RECIPE, "num_examples": None, "num_steps": None, "held_out": None,
            "epochs": None, "split_by": "source", "skip_padding": True, "ban_unk": True,
            **PRESETS["corpus"][model]}


# Bounds on settings that size work rather than the model (which is bounded by memory):
# sentences are decoded token by token up to num_steps, and the dates corpus is generated
# num_examples pairs at a time.
MAX_NUM_STEPS = 100_000
MAX_NUM_EXAMPLES = 10_000_000
FRACTION = {"lo": 0.0, "hi": 1.0, "hi_open": True}


def _held_out(name: str, value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool):
        check_int(name, value, 0, MAX_NUM_EXAMPLES)
    else:
        check_float(name, value, 0.0, 1.0, hi_open=True)


def fraction_or_count(text: str) -> float | int:
    """``--held-out``'s text: ``0.05`` is a fraction, ``500`` a number of pairs."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a fraction in [0, 1) or a count of pairs, got "
                         f"{show(text)}") from None


def _beam(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BEAM:
        raise ValueError(
            f"{name} must be an integer in [1, {MAX_BEAM:,}] (1: greedy), got {show(value)} "
            "(each step scores beam x vocabulary candidates; translations stop improving "
            "long before)")


def _size(name: str, help: str, **more: Any) -> Setting:
    """A size: an integer >= 1, at most MAX_SIZE unless ``more`` says otherwise (memory
    refuses a model long before)."""
    return Setting(name, int, help, **{"lo": 1, "hi": MAX_SIZE, **more})


# The translator's settings, in the order TranslateSettings has them.
TRANSLATE: dict[str, Setting] = {s.name: s for s in (
    Setting("data", str, "'dates' (generated here), 'fra-eng' (downloaded once) or a "
            "source<TAB>target file (read as a stream; one whose pairs cannot fit in "
            "memory is refused before it is read)", range_text=""),
    Setting("model", str, "the translator: a GRU with Bahdanau attention, or a "
            "Transformer", choices=MODEL_NAMES),
    Setting("preset", str, "the recipe: 'd2l' (the book's, for 600 pairs), 'dates', or "
            "'corpus' (for your own pairs: sizes, schedule, smoothing, early stopping and "
            "beam chosen for them); flags override it", choices=tuple(PRESETS),
            optional=True),
    Setting("num_examples", int, "pairs to read, from the start of the corpus", lo=1,
            hi=MAX_NUM_EXAMPLES, optional=True),
    Setting("num_steps", int, "tokens per sentence, <eos> included, after truncation or "
            "padding", lo=1, hi=MAX_NUM_STEPS, aliases=("--num_steps",), optional=True),
    Setting("held_out", float, "pairs held out for evaluation: a fraction (0.1) or a count "
            "(500)", check=_held_out, parse=fraction_or_count, optional=True,
            range_text=f"a fraction in [0, 1) or a count up to {MAX_NUM_EXAMPLES:,}"),
    Setting("split_by", str, "hold out random pairs, or random source sentences with all "
            "their translations (so no held-out sentence is trained on)", choices=SPLIT_BY,
            optional=True),
    Setting("min_freq", int, "words seen fewer times become <unk>", lo=1, hi=MAX_COUNT),
    _size("embed_size", "width of the word embeddings (bahdanau only)", optional=True),
    _size("num_hiddens", "hidden units per layer (the Transformer's width)", optional=True),
    _size("num_layers", "layers of the encoder and of the decoder", optional=True),
    Setting("dropout", float, "dropout probability", **FRACTION, optional=True),
    _size("num_heads", "attention heads (transformer only)", optional=True),
    _size("ffn_num_hiddens", "hidden units of the feed-forward blocks (transformer only)",
          optional=True),
    Setting("skip_padding", bool, "bahdanau: start the decoder from the encoder's state "
            "after each sentence's last real token, not after its padding as d2l does",
            optional=True),
    Setting("backend", str, "how the model computes: 'fused' kernels or 'eager' (the "
            "Bahdanau model's d2l loop, the Transformer's explicit attention weights); the "
            "same weights and, up to float rounding, the same results", choices=BACKENDS,
            optional=True, resumable=True),
    TRAINING["batch_size"].replace(optional=True),
    TRAINING["lr"].replace(optional=True),
    TRAINING["epochs"].replace(optional=True),
    TRAINING["clip_norm"],
    TRAINING["warmup_steps"].replace(optional=True),
    TRAINING["decay"].replace(optional=True),
    Setting("label_smoothing", float, "share of each target's probability spread over "
            "the other words", **FRACTION, optional=True),
    TRAINING["patience"].replace(optional=True),
    Setting("beam", int, "beam size of the held-out report after training (1: greedy)",
            check=_beam, range_text=f"an integer in [1, {MAX_BEAM:,}]", optional=True),
    Setting("ban_unk", bool, "never output <unk>: decode the most likely real word "
            "instead", optional=True),
    TRAINING["accumulate"],
    TRAINING["dtype"].replace(optional=True),
    TRAINING["compile"].replace(optional=True),
    TRAINING["seed"],
    TRAINING["device"],
    Setting("extra", dict, "anything a caller keeps with the run", flag=""),
    Setting("data_sha256", str, "SHA-256 of the corpus file trained on (none: generated "
            "data, or a run saved before qkv recorded it); evaluating or resuming the run "
            "checks the file against it", check=check_sha256, optional=True, flag=""),
)}

# Settings that only one of the translator models has.
MODEL_ONLY = {"embed_size": "bahdanau", "skip_padding": "bahdanau",
              "num_heads": "transformer", "ffn_num_hiddens": "transformer"}

# The translator's defaults outside its recipes.
TRANSLATE_DEFAULTS: dict[str, Any] = {
    "data": "dates", "model": MODEL_NAMES[0], "min_freq": 2, "clip_norm": 1.0,
    "accumulate": 1, "seed": 0, "device": "auto", "extra": {}}
# What a setting left unset (None) that no recipe sets becomes when a new run is
# resolved; a resume keeps the run's own.
TRANSLATE_UNSET: dict[str, Any] = {"backend": BACKENDS[0]}


def _architecture(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {show(value)}")
    from ..models.gpt import GPTConfig  # torch: only to check a saved or imported model

    GPTConfig.from_dict(value)  # its own checks, one line each


# Most characters of the generated corpus a run may ask for (it is built in memory).
MAX_CORPUS_CHARS = 100_000_000


def _tokenizer(name: str, value: Any) -> None:
    # "hf": an open model's own tokenizer, which the run's config holds whole; a run gets
    # it from the model it was made of (qkv lm import, --init), never by name.
    check_str(name, value, choices=(*TOKENIZER_NAMES, HF_TOKENIZER_NAME))


def _gpt_preset(name: str, value: Any) -> None:
    if value not in GPT_PRESETS:
        raise ValueError(f"unknown preset {show(value)}; choose one of {sorted(GPT_PRESETS)}")


# The language model's settings, in the order LMSettings has them.
LM: dict[str, Setting] = {s.name: s for s in (
    Setting("text", str, "UTF-8 text file of any size, tokenized once, streaming, into "
            "RUN_DIR/tokens.bin, which --resume reuses", optional=True, range_text=""),
    Setting("init", str, "start from the weights of this run (trained here, or made by "
            "qkv lm import); its tokenizer, context length and architecture are kept",
            optional=True, metavar="RUN", range_text=""),
    Setting("tokenizer", str, "bytes: 256 byte symbols, no download; gpt2: GPT-2's BPE",
            choices=TOKENIZER_NAMES, check=_tokenizer),
    Setting("bpe_dir", str, "folder with GPT-2's encoder.json and vocab.bpe, for the "
            "gpt2 tokenizer offline (or set QKV_BPE_DIR)", optional=True, range_text="",
            resumable=True),
    Setting("preset", str, "model size", choices=tuple(GPT_PRESETS), check=_gpt_preset),
    _size("context_length", "tokens per training window (the model's context)",
          optional=True),
    _size("stride", "tokens between the starts of two training windows", optional=True),
    Setting("drop_rate", float, "dropout probability", **FRACTION, optional=True,
            flag="--dropout"),
    Setting("tie_weights", bool, "share the token embedding with the output head"),
    _size("emb_dim", "embedding width, where it differs from the preset's",
          optional=True, flag=""),
    _size("n_heads", "attention heads, where they differ from the preset's",
          optional=True, flag=""),
    _size("n_layers", "transformer blocks, where they differ from the preset's",
          optional=True, flag=""),
    Setting("qkv_bias", bool, "biases on the query, key and value projections", flag=""),
    Setting("architecture", dict, "an imported open model's whole architecture "
            "(GPTConfig's fields, written by qkv lm import): it replaces the preset and the "
            "sizes above, and context_length is then the training window",
            check=_architecture, optional=True, flag=""),
    TRAINING["batch_size"],
    TRAINING["epochs"].replace(optional=True),
    TRAINING["lr"].replace(optional=True),
    Setting("weight_decay", float, "AdamW's decoupled decay of the linear layers' "
            "matrices (not biases, norms or embeddings)", lo=0.0),
    TRAINING["clip_norm"],
    TRAINING["warmup_steps"],
    TRAINING["decay"],
    TRAINING["accumulate"],
    _size("batch_tokens", "tokens per optimizer step: --accumulate chosen to reach it "
          "(not with --accumulate)", optional=True),
    TRAINING["patience"],
    _size("eval_every", "validate, save and keep the best every this many optimizer "
          "steps: an epoch becomes that many steps on windows drawn at random (none: an "
          "epoch is one pass over the windows)", optional=True, metavar="STEPS"),
    TRAINING["dtype"].replace(optional=True),
    TRAINING["compile"].replace(optional=True),
    TRAINING["strategy"].replace(optional=True),
    Setting("val_fraction", float, "share of the token ids, from the end, held out for "
            "validation", **FRACTION),
    _size("corpus_chars", "characters of the generated corpus (without --text)",
          hi=MAX_CORPUS_CHARS, flag=""),
    TRAINING["seed"],
    TRAINING["device"],
    Setting("extra", dict, "anything a caller keeps with the run; qkv lm import keeps the "
            "model's origin there", flag=""),
    Setting("text_sha256", str, "SHA-256 of the text file trained on (none: the generated "
            "corpus, or a run saved before qkv recorded it); resuming the run checks the "
            "file against it", check=check_sha256, optional=True, flag=""),
)}
# The language model's defaults; a preset's own context_length and drop_rate come from
# its GPT preset (qkv.options.GPT_PRESETS).
LM_DEFAULTS: dict[str, Any] = {
    "tokenizer": "bytes", "preset": "tiny", "tie_weights": False, "qkv_bias": False,
    "batch_size": 16, "weight_decay": 0.1, "clip_norm": 1.0, "warmup_steps": 0,
    "decay": "constant", "accumulate": 1, "patience": 0, "val_fraction": 0.1,
    "corpus_chars": 60_000, "seed": 0, "device": "auto", "extra": {}}
# What a setting left unset (None) becomes when a new run is resolved; a resume keeps
# the run's own.
LM_UNSET: dict[str, Any] = {"epochs": 10, "lr": 1e-3, "dtype": "float32", "compile": False,
                            "strategy": "ddp"}
