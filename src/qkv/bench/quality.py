"""``qkv bench quality --ckpt RUN [RUN ...] --ref RUN_F32 --text FILE``: what a run's
weights cost in quality, measured as llama.cpp's ``llama-perplexity --kl-divergence`` measures it.

Both runs read the same tokens of a text (the first ``tokens`` of it, in chunks of
``window``), and each chunk's second half is scored, its first half serving as context
(llama-perplexity's way: every scored position sees at least ``window / 2`` tokens).
At every scored position ``t``, with ``p`` the reference run's next-token distribution
and ``q`` the run's (softmax of the logits, in float64):

- ``KL(p || q) = sum_v p_v (log p_v - log q_v)``: its mean over the positions, and its
  99th percentile (llama.cpp's "99.0% KLD");
- each run's perplexity, ``exp(mean_t -log p(x_{t+1}))`` of the text's own next tokens;
- top-1 agreement: the share of positions where both runs' most likely token is the same
  (llama.cpp's "Same top p").

The runs must share a tokenizer's vocabulary (a quantized run and the float32 import
of the same file do). Several runs (the files of one model in each format) are measured
against one computation of the reference's logits.

With ``llama_cpp`` (``--llama-cpp``), the same numbers are computed a second time from
llama.cpp's own logits (llama-cpp-python, :func:`qkv.bench.peers.llama_cpp_logits`) on
the GGUF files the runs were imported from (each run records its source), on the
same token ids in the same chunks: llama.cpp's KL of the file beside qkv's, in one
table. They are the same arithmetic on the same blocks, so they must agree within the
noise of two summation orders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..tasks.lm import LanguageModel
from ..training import check_memory
from ..utils.fileio import read_regular
from .timing import machine_info, markdown_table, write_json

__all__ = ["QualityConfig", "next_token_quality", "run_quality"]

MAX_TEXT_BYTES = 64 * 2**20


@dataclass
class QualityConfig:
    """What to compare.

    Attributes:
        ckpt: the runs measured (quantized imports, a bfloat16 one, a fine-tune, ...),
            each against the reference; a single path is one run.
        ref: the reference run (the float32 import of the same model).
        text: a UTF-8 text file of at least ``tokens`` tokens.
        tokens: how many of its first tokens are read (at least 4,096 as llama.cpp's
            KL tables are quoted; fewer only for tests).
        window: tokens per chunk (default: 512, llama-perplexity's ``-c``, or the models'
            context if shorter); the second half of each chunk is scored.
        llama_cpp: also compute the numbers from llama.cpp's logits on the GGUF files
            the runs were imported from.
    """

    ckpt: Sequence[str]
    ref: str
    text: str
    tokens: int = 4096
    window: int | None = None
    llama_cpp: bool = False

    def __post_init__(self) -> None:
        self.ckpt = (self.ckpt,) if isinstance(self.ckpt, str) else tuple(self.ckpt)

    def validate(self) -> None:
        if not self.ckpt:
            raise ValueError("ckpt: give at least one run to measure")
        for name in ("tokens", "window"):
            value = getattr(self, name)
            if value is None and name == "window":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 4:
                raise ValueError(f"{name} must be an integer >= 4, got {value!r}")


def scored_logits(model: Callable[[Tensor], Tensor], ids: Tensor, window: int
                  ) -> Iterator[tuple[Tensor, Tensor]]:
    """Each whole chunk's scored positions: ``(logits (window // 2 - 1, vocab), next ids
    (window // 2 - 1,))`` of chunk ``c = 0 .. len(ids) // window - 1``, the logits as
    ``model`` gives them (``(1, T) -> (1, T, vocab)``) at positions ``window // 2 ..
    window - 2``, each predicting the token after it."""
    first = window // 2
    for c in range(len(ids) // window):
        chunk = ids[c * window:(c + 1) * window].reshape(1, window)
        with torch.no_grad():
            logits = model(chunk)[0, first:-1]
        yield logits, chunk[0, first + 1:]


def compare(chunks: Iterable[tuple[Tensor, Tensor]],
            reference: Iterable[tuple[Tensor, Tensor]]) -> dict[str, Any]:
    """The numbers of :func:`next_token_quality` from both runs' :func:`scored_logits`
    (chunk by chunk, in float64)."""
    kls, nll, ref_nll, same = [], [], [], []
    for (q_logits, targets), (p_logits, _) in zip(chunks, reference, strict=True):
        logq = torch.log_softmax(q_logits.double(), dim=-1)
        logp = torch.log_softmax(p_logits.double(), dim=-1)
        kls.append((logp.exp() * (logp - logq)).sum(dim=-1))
        nll.append(-logq.gather(1, targets[:, None])[:, 0])
        ref_nll.append(-logp.gather(1, targets[:, None])[:, 0])
        same.append(logq.argmax(dim=-1) == logp.argmax(dim=-1))
    kl = torch.cat(kls)
    return {"positions": len(kl), "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "ppl": math.exp(float(torch.cat(nll).mean())),
            "ref_ppl": math.exp(float(torch.cat(ref_nll).mean())),
            "top1_agreement": float(torch.cat(same).double().mean()), "kl": kl.tolist()}


def next_token_quality(model: Callable[[Tensor], Tensor],
                       reference: Callable[[Tensor], Tensor], ids: Tensor,
                       window: int) -> dict[str, Any]:
    """Compare ``model``'s next-token distributions with ``reference``'s on ``ids``.

    Args:
        model, reference: language models ``(1, T) -> logits (1, T, vocab)`` of one
            vocabulary.
        ids: token ids ``(n,)``, ``n >= window``; ``n // window`` whole chunks are read.
        window: tokens per chunk; positions ``window // 2 .. window - 2`` of each are
            scored (each predicts the token after it).

    Returns:
        ``positions`` scored, ``kl_mean``, ``kl_p99``, ``kl_max``, ``ppl``, ``ref_ppl``,
        ``top1_agreement`` (0-1), ``kl`` (every position's KL, a list).
    """
    if len(ids) < window:
        raise ValueError(f"the text has {len(ids):,} tokens, fewer than one window of "
                         f"{window:,}")
    return compare(scored_logits(model, ids, window), scored_logits(reference, ids, window))


def run_quality(config: QualityConfig, out_dir: str | Path,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Read the runs and the text, compare each ``config.ckpt`` run with the reference,
    print the table, write ``quality.json`` in ``out_dir``. Returns the JSON.

    Every run's config (and with ``llama_cpp`` its source file) is checked before any
    weights are read. The reference's scored logits are computed once and held (float32,
    ``tokens // window * (window // 2 - 1) * vocab`` values), then each run is loaded in
    turn, so that one model is in memory at a time; llama.cpp's likewise."""
    config.validate()
    runs = {path: LanguageModel.read_config(path) for path in (config.ref, *config.ckpt)}
    vocab = runs[config.ref][1].vocab_size
    for path in config.ckpt:
        if runs[path][1].vocab_size != vocab:
            raise ValueError(f"--ref {config.ref} has {vocab:,} ids, --ckpt {path} "
                             f"{runs[path][1].vocab_size:,}: the runs must share a "
                             "vocabulary")
    files = ({path: _source_file(path, settings.extra.get("source"),
                                 "--ref" if path == config.ref else "--ckpt")
              for path, (settings, _) in runs.items()} if config.llama_cpp else {})
    try:
        text = read_regular(config.text, "text file", MAX_TEXT_BYTES).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--text {config.text}: not UTF-8 text ({error.reason} at byte "
                         f"{error.start:,})") from None
    context = min(model_config.context_length for _, model_config in runs.values())
    window = config.window or min(512, context)
    if window > context:
        raise ValueError(f"window {window:,} is longer than the models' context {context:,}")
    held = config.tokens // window * (window // 2 - 1) * vocab * 4
    check_memory(held, f"holding the reference's logits ({config.tokens:,} tokens, "
                 f"{vocab:,} ids)", hint="pass fewer --tokens")

    ref = LanguageModel.load(config.ref)
    ids = ref.tokenizer.encode(text)
    if len(ids) < config.tokens:
        raise ValueError(f"--text {config.text} has {len(ids):,} tokens; at least "
                         f"{config.tokens:,} are read")
    ids_t = torch.tensor(ids[:config.tokens])
    log(f"quality: {len(config.ckpt)} run(s) against {ref.title}, {config.tokens:,} tokens "
        f"of {config.text} in chunks of {window}, second halves scored")
    report: dict[str, Any] = {
        "suite": "quality", "config": dataclasses.asdict(config), "window": window,
        "machine": machine_info(torch.device("cpu")), "reference": ref.title,
        "runs": [{"ckpt": path} for path in config.ckpt]}
    reference = _held(scored_logits(ref.model, ids_t, window))
    del ref
    for entry in report["runs"]:
        lm = LanguageModel.load(entry["ckpt"])
        log(f"  {entry['ckpt']}: {lm.title}")
        entry.update(model=lm.title, **compare(scored_logits(lm.model, ids_t, window),
                                               reference))
        del lm
    del reference
    if files:
        log(f"llama.cpp: the files the runs were imported from, against {files[config.ref]}")
        with _llama_cpp_model(files[config.ref], window) as model:
            reference = _held(scored_logits(model, ids_t, window))
        for entry in report["runs"]:
            with _llama_cpp_model(files[entry["ckpt"]], window) as model:
                entry["llama_cpp"] = {"file": str(files[entry["ckpt"]]),
                                      **compare(scored_logits(model, ids_t, window),
                                                reference)}
    log(table(report))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "quality.json", report)
    log(f"\nwrote {out_dir / 'quality.json'}")
    return report


def _source_file(run: str, source: object, flag: str) -> Path:
    """The GGUF file ``run`` was imported from (its ``settings.extra.source``), checked to
    exist; one line naming the run otherwise."""
    path = Path(str(source)) if source else None
    if path is None or path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--llama-cpp: {flag} {run} was imported from "
                         f"{source or 'no file'}, not an existing .gguf file; llama.cpp "
                         "reads the file a run was imported from")
    return path


def _held(chunks: Iterable[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """The chunks kept, each logits tensor its own (not a view of the chunk's whole
    ``(window, vocab)`` output)."""
    return [(logits.clone(), targets) for logits, targets in chunks]


@contextlib.contextmanager
def _llama_cpp_model(path: Path, window: int) -> Iterator[Callable[[Tensor], Tensor]]:
    """llama.cpp's logits of ``path`` as a model's forward, freed on leaving."""
    from .peers import llama_cpp_logits
    got = llama_cpp_logits(path, window)
    if isinstance(got, str):
        raise ValueError(f"--llama-cpp: {path}: {got}")
    forward, close = got
    try:
        yield forward
    finally:
        close()


def table(report: dict[str, Any]) -> str:
    """One row per run (as given to ``--ckpt``) and whose logits: qkv's, and llama.cpp's
    where it ran."""
    rows = [(run["ckpt"], "qkv", run) for run in report["runs"]]
    rows += [(run["ckpt"], "llama.cpp", run["llama_cpp"]) for run in report["runs"]
             if "llama_cpp" in run]
    return markdown_table(
        ["run", "logits of", "positions", "mean KL", "99 % KL", "max KL", "perplexity",
         "reference perplexity", "same top-1"],
        [[title, name, f"{r['positions']:,}", f"{r['kl_mean']:.6f}", f"{r['kl_p99']:.6f}",
          f"{r['kl_max']:.6f}", f"{r['ppl']:.4f}", f"{r['ref_ppl']:.4f}",
          f"{100 * r['top1_agreement']:.2f} %"] for title, name, r in rows])
