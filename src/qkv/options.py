"""The settings, names and limits the command line offers, declared once, free of torch.

``qkv --help`` and a mistyped flag must answer without importing torch (a second and a
half on a quiet machine). So every choice a flag lists and every limit its help states
is declared here, at the bottom of the package, and the module that uses it imports it
from here under the same name (``qkv.functional.BACKENDS`` is this ``BACKENDS``).

A setting of a training run is one :class:`Setting`: its name, type, valid range or
choices, help and whether a resume may change it. :data:`TRAINING` declares the ones
every task shares (epochs, learning rate and schedule, batch, precision, ...),
:data:`LOOP` the training loop's own (logging, saving);
``qkv.tasks.settings`` adds each task's own and their defaults, per recipe. The
settings dataclasses' checks, the command line's flags and their help, the trainer's
configuration and the checkpoint reader's checks all derive from these declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .checks import MAX_COUNT, MAX_SIZE, check_bool, check_float, check_int, check_str, show

# How attention computes (qkv.functional.attention): fused kernels or explicit weights.
BACKENDS = ("fused", "eager")
# How the gated delta rule computes (qkv.linear_attention): chunks of matrix products, or
# one token at a time.
DELTA_BACKENDS = ("chunked", "recurrent")

# The translator architectures (qkv.models.seq2seq).
MODEL_NAMES = ("bahdanau", "transformer")

# Most hypotheses beam search keeps. Every step scores beam x vocabulary candidates and
# carries the decoder state of each kept one; translations stop improving at a beam of a
# few dozen (4 to 10 is usual), while time and memory keep growing with it.
MAX_BEAM = 1000

# Overrides of the GPTConfig defaults (which are GPT-2 small, the book's GPT_CONFIG_124M).
GPT_PRESETS: dict[str, dict[str, Any]] = {
    # 124M parameters with tied embeddings as in OpenAI's GPT-2; the book (and this preset)
    # keeps a separate output head: 163,009,536 parameters.
    "gpt2-small": {},
    "gpt2-medium": {"emb_dim": 1024, "n_layers": 24, "n_heads": 16},
    "gpt2-large": {"emb_dim": 1280, "n_layers": 36, "n_heads": 20},
    "gpt2-xl": {"emb_dim": 1600, "n_layers": 48, "n_heads": 25},
    # Small enough to train on a laptop CPU in minutes (pass vocab_size=tokenizer.n_vocab).
    "tiny": {"context_length": 128, "emb_dim": 64, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0},
    "mini": {"context_length": 256, "emb_dim": 128, "n_heads": 4, "n_layers": 4, "drop_rate": 0.1},
    # "tiny" with what current models use: rotary positions instead of a learned table,
    # 2 key/value heads for 4 query heads (GQA), each token seeing its last 64.
    "tiny-modern": {"context_length": 128, "emb_dim": 64, "n_heads": 4, "n_layers": 2,
                    "drop_rate": 0.0, "n_kv_groups": 2, "window_size": 64, "rope": True},
}

# Most tokens one generate() call adds. Each costs a forward step (a whole window's once
# the context is full and positions are learned), and the output is kept whole; 100,000
# tokens is a long book. Longer texts: continue from the end of this one.
MAX_NEW_TOKENS = 100_000

# Tokenizers a language model trains with (qkv.data.tokenizers); "hf" is an open model's
# own, which a run gets from the model it was imported from, never by name.
TOKENIZER_NAMES = ("gpt2", "bytes")
HF_TOKENIZER_NAME = "hf"

# How a translation corpus is split (qkv.data.translate.held_out_indices).
SPLIT_BY = ("pair", "source")

# Sentence length of the dates corpus, <eos> included (qkv.data.dates).
DATES_NUM_STEPS = 14

# Learning-rate decays after the warm-up (qkv.training.LRSchedule).
DECAYS = ("constant", "linear", "cosine", "inverse_sqrt")

# Forward precisions of training (qkv.training.TrainConfig.dtype).
DTYPES = ("float32", "bfloat16")

# How the processes of a torchrun job share the model: "ddp", a full copy on every
# process with gradients averaged; "fsdp", each process holds 1 / world_size of every
# parameter, gradient and optimizer state, and gathers a block's weights only while it
# computes with them (PyTorch's FSDP2, ``fully_shard``).
STRATEGIES = ("ddp", "fsdp")

# The clock behind periodic checkpoints. A SIGKILL, the OOM killer or a power cut
# loses at most SAVE_EVERY_MINUTES of training by default.
SAVE_EVERY_MINUTES = 10.0
MAX_SAVE_EVERY_MINUTES = 10.0**6


# qkv bench: dtypes a suite runs in ("auto": bfloat16 on CUDA, float32 on the CPU) and how
# CPU peak memory is measured: in a fresh interpreter per case (exact), in this process
# (fast, may under-count memory an earlier case left in the C allocator), or not.
BENCH_DTYPES = ("auto", "float32", "bfloat16", "float16")
MEMORY_MODES = ("isolated", "in-process", "off")

# qkv walkthrough: the book's example sentence, and the most tokens of one's own (every
# step prints T x T matrices; beyond this they stop being readable).
BOOK_TEXT = "Your journey starts with one step"
MAX_WALKTHROUGH_TOKENS = 64
# The walkthrough's sections on the attention of 2025-26 models, after the book's §3.3-3.6:
# the prefix a section's steps share (mla.1, mla.2, ...; `--only mla`) -> what they show.
WALKTHROUGH_MECHANISMS = {
    "mla": "DeepSeek-V3's multi-head latent attention: the latent, its cache against "
           "multi-head attention's, decompressing it into keys and values",
    "absorbed": "latent attention absorbed: the key and value maps folded into the query "
                "and the output, attention in latent space, decoding from the cache",
    "dsa": "DeepSeek-V3.2's sparse attention: the lightning indexer's scores, the top-k "
           "keys of each query, attention over them",
    "sinks": "gpt-oss's learned attention sinks: rows of weights that sum to less than one, "
             "and where the rest goes",
    "kvshare": "Gemma 3n's and Gemma 4's KV sharing: a later layer attends with an earlier "
               "layer's keys and values, cached once",
    "delta": "linear attention to Gated DeltaNet (Qwen3-Next, Qwen3.5): a running sum of "
             "k v^T, then a decay, then the delta correction; a state of fixed size "
             "against a cache that grows",
    "induction": "induction heads, built by hand: a previous-token head in layer 0 writes "
                 "'the word before me', an induction head in layer 1 finds where the current "
                 "word came before and copies the word after it",
}

# What qkv.heads.capture records (and an intervention may replace), by name: where it is
# taken, its shape and what it holds. The one declaration: the attention classes and the
# decoder block tap these names, docs/heads.md's table is rendered from it. "attention"
# points are taken inside an attention module, "block" points in the decoder's
# TransformerBlock around it. H: query heads; G: key/value heads (H without grouped-query
# attention); T: the call's new tokens; T_k: the keys its queries attend to.
CAPTURE_POINTS: dict[str, tuple[str, str, str]] = {
    "q": ("attention", "(batch, H, T, head_dim)",
          "queries after the projection, QK-norm and RoPE"),
    "k": ("attention", "(batch, G, T, head_dim)",
          "the new tokens' keys after the projection, QK-norm and RoPE, before the cache "
          "(a shared_kv layer has none of its own)"),
    "v": ("attention", "(batch, G, T, head_dim)",
          "the new tokens' values, before the cache (none in a shared_kv layer)"),
    "scores": ("attention", "(batch, H, T, T_k)",
               "pre-softmax scores q.k * scale, -inf where a key is hidden (causal, window, "
               "padding); a learned sink is not a column"),
    "weights": ("attention", "(batch, H, T, T_k)",
                "the attention weights, as the eager kernel computes them: rows sum to 1 "
                "(less with learned sinks)"),
    "head_out": ("attention", "(batch, T, H, head_dim)",
                 "each head's output before out_proj (after a gated layer's gate)"),
    "resid_pre": ("block", "(batch, T, emb_dim)", "the residual stream entering the block"),
    "attn_out": ("block", "(batch, T, emb_dim)",
                 "the attention branch as it is added to the stream (out_proj, post-norm)"),
    "resid_mid": ("block", "(batch, T, emb_dim)", "the stream between attention and MLP"),
    "mlp_out": ("block", "(batch, T, emb_dim)", "the MLP branch as it is added"),
    "resid_post": ("block", "(batch, T, emb_dim)", "the residual stream leaving the block"),
}

# The points an attention module computes: a module that can be tapped names those it
# has in ``tap_points`` and, of them, those it only reads in ``tap_read_only``.
ATTENTION_POINTS = frozenset(n for n, (where, _, _) in CAPTURE_POINTS.items()
                             if where == "attention")


# ----------------------------------------------------------------------------
# Settings of a training run


@dataclass(frozen=True)
class Setting:
    """One setting of a training run, declared once.

    ``kind`` is ``int``, ``float``, ``str``, ``bool`` or ``dict`` (a JSON object); a
    number lies in ``[lo, hi]``
    (``lo_open``/``hi_open`` exclude the bound), a string is one of ``choices`` (or any
    string of at most ``max_len`` characters). ``optional``: None is a valid value too
    (it then means what ``help`` says). ``check`` replaces the check the rest implies,
    for a setting with a rule of its own; ``parse`` turns the flag's text into a value.
    ``flag`` is the command-line flag (default ``--name-with-dashes``; ``""``: none),
    ``aliases`` more spellings of it. ``resumable``: ``--resume`` may change it (how a
    run computes or how long it goes on, never what it is).
    """

    name: str
    kind: type
    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: Sequence[str] | None = None
    max_len: int = 4096
    optional: bool = False
    check: Callable[[str, Any], Any] | None = None
    parse: Callable[[str], Any] | None = None
    range_text: str | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    resumable: bool = False

    def replace(self, **changes: Any) -> Setting:
        """This setting with some of its declaration changed (a task's own default)."""
        return dataclasses.replace(self, **changes)

    @property
    def flag_name(self) -> str:
        """The command-line flag, ``""`` for none."""
        return f"--{self.name.replace('_', '-')}" if self.flag is None else self.flag

    @property
    def annotation(self) -> str:
        """The type of the settings dataclass's field, as an annotation."""
        kind = "dict[str, Any]" if self.kind is dict else self.kind.__name__
        return f"{kind} | None" if self.optional else kind

    def validate(self, value: Any, name: str | None = None, *, required: bool = False) -> Any:
        """``value`` if it is valid for this setting, else a one-line ``ValueError``
        naming ``name`` (default: the setting's). None is valid if the setting is
        ``optional`` and the value not ``required`` (a resolved run's)."""
        name = name or self.name
        if value is None and self.optional and not required:
            return None
        if self.check is not None:
            self.check(name, value)
        elif self.kind is dict:
            if not isinstance(value, dict):
                raise ValueError(f"{name} must be an object, got {show(value)}")
        elif self.kind is bool:
            check_bool(name, value)
        elif self.kind is int:
            check_int(name, value, self.lo, self.hi)  # type: ignore[arg-type]
        elif self.kind is float:
            check_float(name, value, self.lo, self.hi, lo_open=self.lo_open,
                        hi_open=self.hi_open)
        else:
            check_str(name, value, choices=self.choices, max_len=self.max_len)
        return value

    def describe(self) -> str:
        """The valid values in words: ``"an integer >= 1"``, ``"a number in [0, 1)"``."""
        if self.range_text is not None:
            return self.range_text
        if self.kind is bool or self.choices is not None:
            return ""
        if self.kind is str:
            return "text"
        noun = "an integer" if self.kind is int else "a number"
        lo, hi = _shown(self.lo), _shown(self.hi)
        if hi is None:
            return noun if lo is None else f"{noun} {'>' if self.lo_open else '>='} {lo}"
        if lo is None:
            return f"{noun} {'<' if self.hi_open else '<='} {hi}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"{noun} in {left}{lo}, {hi}{right}"


def _shown(bound: float | None) -> str | None:
    """A bound as help shows it; the sizes' technical limits (2**31 - 1 and more) are
    not shown: memory refuses long before."""
    if bound is None or bound >= MAX_SIZE:
        return None
    if isinstance(bound, float) and bound.is_integer() and bound < 1e15:
        return f"{int(bound):,}" if bound >= 1e4 else f"{bound:g}"
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"


def _seed(name: str, value: Any) -> None:
    check_int(name, value, -(2**63), 2**64 - 1)  # what torch.manual_seed takes


def _count(name: str, lo: int, help: str, hi: int = MAX_SIZE, **more: Any) -> Setting:
    return Setting(name, int, help, lo=lo, hi=hi, **more)


# The settings of the training loop that every task shares. The tasks give them
# defaults of their own (qkv.tasks.settings), per recipe where they have recipes.
TRAINING: dict[str, Setting] = {s.name: s for s in (
    _count("epochs", 0, "total epochs to train (with --resume: the new total)",
           resumable=True),
    Setting("lr", float, "peak learning rate of the optimizer (Adam, AdamW)", lo=0.0,
            lo_open=True, resumable=True),
    _count("batch_size", 1, "examples per batch (per process under torchrun)"),
    Setting("clip_norm", float, "clip the gradients' global L2 norm to this", lo=0.0,
            lo_open=True, optional=True),
    _count("warmup_steps", 0, "learning-rate warm-up from 0 to --lr, in optimizer steps"),
    Setting("decay", str, "learning-rate decay after the warm-up (inverse_sqrt needs a "
            "warm-up)", choices=DECAYS),
    _count("accumulate", 1, "micro-batches per optimizer step (gradient accumulation: "
           "one step sees accumulate x batch-size examples)"),
    _count("patience", 0, "stop after this many epochs without a better held-out loss "
           "and keep the best weights (0: never stop early)"),
    Setting("dtype", str, "forward precision: bfloat16 runs under autocast, weights and "
            "optimizer stay float32", choices=DTYPES, resumable=True),
    Setting("compile", bool, "train through torch.compile", resumable=True),
    Setting("strategy", str, "under torchrun: ddp (a whole model per process) or fsdp "
            "(each process holds 1/N of the weights, gradients and optimizer state); see "
            "docs/distributed.md", choices=STRATEGIES, resumable=True),
    Setting("seed", int, "seed of every random generator (data order, initial weights, "
            "dropout)", check=_seed, range_text="an integer"),
    Setting("device", str, "where to train: auto (CUDA if available), cpu, cuda or cuda:N",
            max_len=64, range_text="", resumable=True),
)}

# The training loop's own settings, beside TRAINING's: how it reports and saves, not
# what it trains (qkv.training.TrainConfig; the command line's --save-every).
LOOP: dict[str, Setting] = {s.name: s for s in (
    _count("log_every", 0, "log a line every this many epochs, and after the last (0: "
           "never)", hi=MAX_COUNT, flag=""),
    _count("checkpoint_every", 0, "save every this many epochs (0: by the clock only, "
           "save_every)", hi=MAX_COUNT, flag=""),
    Setting("save_every", float, "minutes between periodic checkpoints", lo=0.0,
            hi=MAX_SAVE_EVERY_MINUTES, flag=""),
    Setting("progress", bool, "show a progress bar on stderr", flag=""),
    Setting("flops_per_token", float, "the model's floating-point operations per training "
            "token, to report model FLOPs utilisation", lo=0.0, lo_open=True, optional=True,
            flag=""),
)}


def check_save_every(minutes: float, name: str = "save_every") -> float:
    """``minutes`` if it is a valid :attr:`qkv.training.TrainConfig.save_every`, else a
    one-line ``ValueError`` naming ``name`` and the range."""
    return LOOP["save_every"].validate(minutes, name)


def settings_class(declared: Mapping[str, Setting], defaults: Mapping[str, Any]
                   ) -> Callable[[type], type]:
    """Make the decorated class a dataclass whose fields are ``declared``, in order: each
    annotated with its setting's type and defaulting to ``defaults[name]``, or None
    where it has none (the recipe's value, or not set). ``cls.DECLARED`` is
    ``declared``; the class adds what its task does with them (methods only)."""

    def make(cls: type) -> type:
        own = cls.__dict__.get("__annotations__", {})
        if own:
            raise TypeError(f"{cls.__name__}'s fields are its declarations; it declares "
                            f"{sorted(own)} itself")
        cls.__annotations__ = {name: s.annotation for name, s in declared.items()}
        for name in declared:
            default = defaults.get(name)
            setattr(cls, name, dataclasses.field(default_factory=lambda d=default: dict(d))
                    if isinstance(default, dict) else default)
        cls.DECLARED = declared  # type: ignore[attr-defined]
        return dataclasses.dataclass(cls)

    return make
