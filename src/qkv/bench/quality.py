"""``qkv bench quality --ckpt RUN --ref RUN_F32 --text FILE``: what a run's weights cost in
quality, measured as llama.cpp's ``llama-perplexity --kl-divergence`` measures it.

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

The two runs must share a tokenizer's vocabulary (a quantized run and the float32
import of the same file do).

With ``llama_cpp`` (``--llama-cpp``), the same numbers are computed a second time from
llama.cpp's own logits (llama-cpp-python, :func:`qkv.bench.peers.llama_cpp_logits`) on
the GGUF files the two runs were imported from (each run records its source), on the
same token ids in the same chunks: llama.cpp's KL of the file beside qkv's, in one
table. They are the same arithmetic on the same blocks, so they must agree within the
noise of two summation orders.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..tasks.lm import LanguageModel
from ..utils.fileio import read_regular
from .timing import machine_info, markdown_table, write_json

__all__ = ["QualityConfig", "next_token_quality", "run_quality"]

MAX_TEXT_BYTES = 64 * 2**20


@dataclass
class QualityConfig:
    """What to compare.

    Attributes:
        ckpt: the run measured (a quantized import, a bfloat16 one, a fine-tune, ...).
        ref: the reference run (the float32 import of the same model).
        text: a UTF-8 text file of at least ``tokens`` tokens.
        tokens: how many of its first tokens are read (at least 4,096 as llama.cpp's
            KL tables are quoted; fewer only for tests).
        window: tokens per chunk (default: 512, llama-perplexity's ``-c``, or the models'
            context if shorter); the second half of each chunk is scored.
        llama_cpp: also compute the numbers from llama.cpp's logits on the GGUF files
            the two runs were imported from.
    """

    ckpt: str
    ref: str
    text: str
    tokens: int = 4096
    window: int | None = None
    llama_cpp: bool = False

    def validate(self) -> None:
        for name in ("tokens", "window"):
            value = getattr(self, name)
            if value is None and name == "window":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 4:
                raise ValueError(f"{name} must be an integer >= 4, got {value!r}")


@torch.no_grad()
def next_token_quality(model: torch.nn.Module, reference: torch.nn.Module, ids: Tensor,
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
    chunks = len(ids) // window
    if chunks < 1:
        raise ValueError(f"the text has {len(ids):,} tokens, fewer than one window of "
                         f"{window:,}")
    first = window // 2
    kls, nll, ref_nll, same = [], [], [], []
    for c in range(chunks):
        chunk = ids[c * window:(c + 1) * window].reshape(1, window)
        targets = chunk[0, first + 1:]
        logq = torch.log_softmax(model(chunk)[0, first:-1].double(), dim=-1)
        logp = torch.log_softmax(reference(chunk)[0, first:-1].double(), dim=-1)
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


def run_quality(config: QualityConfig, out_dir: str | Path,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Read both runs and the text, compare, print the table, write ``quality.json`` in
    ``out_dir``. Returns the JSON."""
    config.validate()
    lm, ref = LanguageModel.load(config.ckpt), LanguageModel.load(config.ref)
    if lm.model.cfg.vocab_size != ref.model.cfg.vocab_size:
        raise ValueError(f"--ref {config.ref} has {ref.model.cfg.vocab_size:,} ids, --ckpt "
                         f"{config.ckpt} {lm.model.cfg.vocab_size:,}: the runs must share a "
                         "vocabulary")
    try:
        text = read_regular(config.text, "text file", MAX_TEXT_BYTES).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--text {config.text}: not UTF-8 text ({error.reason} at byte "
                         f"{error.start:,})") from None
    ids = lm.tokenizer.encode(text)
    if len(ids) < config.tokens:
        raise ValueError(f"--text {config.text} has {len(ids):,} tokens; at least "
                         f"{config.tokens:,} are read")
    context = min(lm.model.cfg.context_length, ref.model.cfg.context_length)
    window = config.window or min(512, context)
    if window > context:
        raise ValueError(f"window {window:,} is longer than the models' context {context:,}")
    ids_t = torch.tensor(ids[:config.tokens])
    log(f"quality: {lm.title} against {ref.title}, {config.tokens:,} tokens of "
        f"{config.text} in chunks of {window}, second halves scored")
    files = _source_files(lm, ref) if config.llama_cpp else None  # before any work
    result = next_token_quality(lm.model, ref.model, ids_t, window)
    report = {"suite": "quality", "config": dataclasses.asdict(config), "window": window,
              "machine": machine_info(torch.device("cpu")), "model": lm.title,
              "reference": ref.title, **result}
    if files is not None:
        del lm, ref  # llama.cpp's two models in their place
        log(f"llama.cpp: {files[0]} against {files[1]}, the same ids and chunks")
        report["llama_cpp"] = {"files": [str(f) for f in files],
                               **_llama_cpp_quality(files, ids_t, window)}
    log(table(report))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "quality.json", report)
    log(f"\nwrote {out_dir / 'quality.json'}")
    return report


def _source_files(lm: LanguageModel, ref: LanguageModel) -> tuple[Path, Path]:
    """The GGUF files the two runs were imported from (their ``settings.extra.source``),
    each checked to exist; one line naming the run otherwise."""
    files = []
    for flag, run in (("--ckpt", lm), ("--ref", ref)):
        source = run.settings.extra.get("source")
        path = Path(str(source)) if source else None
        if path is None or path.suffix != ".gguf" or not path.is_file():
            raise ValueError(f"--llama-cpp: {flag} ({run.title}) was imported from "
                             f"{source or 'no file'}, not an existing .gguf file; llama.cpp "
                             "reads the file a run was imported from")
        files.append(path)
    return files[0], files[1]


def _llama_cpp_quality(files: tuple[Path, Path], ids: Tensor, window: int
                       ) -> dict[str, Any]:
    """:func:`next_token_quality` on llama.cpp's logits of the two files."""
    from .peers import llama_cpp_logits
    opened = [llama_cpp_logits(f, window) for f in files]
    try:
        for path, got in zip(files, opened, strict=True):
            if isinstance(got, str):
                raise ValueError(f"--llama-cpp: {path}: {got}")
        return next_token_quality(opened[0][0], opened[1][0], ids, window)
    finally:
        for got in opened:
            if not isinstance(got, str):
                got[1]()


def table(report: dict[str, Any]) -> str:
    rows = [("qkv", report)]
    if "llama_cpp" in report:
        rows.append(("llama.cpp", report["llama_cpp"]))
    return markdown_table(
        ["logits of", "positions", "mean KL", "99 % KL", "max KL", "perplexity",
         "reference perplexity", "same top-1"],
        [[name, f"{r['positions']:,}", f"{r['kl_mean']:.6f}", f"{r['kl_p99']:.6f}",
          f"{r['kl_max']:.6f}", f"{r['ppl']:.4f}", f"{r['ref_ppl']:.4f}",
          f"{100 * r['top1_agreement']:.2f} %"] for name, r in rows])
