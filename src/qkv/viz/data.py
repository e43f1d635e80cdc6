"""Attention tensors -> the page's data: what :mod:`qkv.viz.page` embeds as JSON.

The page shows *sections*: one attention map each, over every layer and head, with the
tokens that attend (``queries``, the rows) and those attended to (``keys``, the
columns). A language model has one section (causal self-attention); the Bahdanau
translator one (its alignment: output tokens over source tokens); the Transformer
translator three (encoder self-attention, decoder self-attention, cross-attention).

Weights are stored in 8 bits, relative to their row's largest weight: entry ``(l, h, i,
j)`` is ``q / 255 * row_max[l, h, i]`` with ``q`` a byte. Every row keeps its own
resolution (a row's top weights are exact to 1/510 of its maximum, however long the
row), and a causal map stores only its lower triangle. So a 256-token prompt on a
12-layer, 12-head GPT takes 4.7 MB of bytes (6.3 MB as base64), not 38 MB of float32.

Shapes: ``weights`` are ``(layers, heads, queries, keys)``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..data.translate import BOS, EOS
from ..models.decoding import eval_mode
from ..models.transformer import TransformerSeq2Seq
from ..tasks.lm import LanguageModel
from ..tasks.translate import Translator

__all__ = ["VERSION", "MAX_TEXT_CHARS", "encode_section", "decode_section", "example",
           "page_data", "describe"]

VERSION = 1
# The longest text one example takes: far more than any model here attends over, and
# a bound on the work a request to the local server can ask for.
MAX_TEXT_CHARS = 10_000

Target = LanguageModel | Translator


def encode_section(
    section_id: str,
    title: str,
    queries: Sequence[str],
    keys: Sequence[str],
    weights: Tensor,
    *,
    causal: bool = False,
) -> dict[str, Any]:
    """One attention map in the page's format (see the module docstring).

    ``weights (layers, heads, len(queries), len(keys))``: non-negative and finite (rows
    of a softmax, in practice). With ``causal``, ``queries`` and ``keys`` have one
    length and only entries ``j <= i`` are stored (the others must be 0 and read as 0).
    """
    if weights.dim() != 4:
        raise ValueError(f"weights must be (layers, heads, queries, keys), got shape "
                         f"{tuple(weights.shape)}")
    layers, heads, n_q, n_k = weights.shape
    if (n_q, n_k) != (len(queries), len(keys)):
        raise ValueError(f"weights are {n_q} x {n_k} but there are {len(queries)} queries "
                         f"and {len(keys)} keys")
    if causal and n_q != n_k:
        raise ValueError(f"a causal map needs as many queries as keys, got {n_q} and {n_k}")
    w = weights.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"{title}: attention weights must be finite and >= 0")
    row_max = w.amax(dim=-1)
    scaled = w / row_max.clamp_min(torch.finfo(torch.float64).tiny).unsqueeze(-1)
    q = torch.round(scaled * 255).to(torch.uint8)
    if causal:
        q = q[:, :, torch.ones(n_q, n_k, dtype=torch.bool).tril()]  # (L, H, entries)
    return {
        "id": section_id,
        "title": title,
        "queries": list(queries),
        "keys": list(keys),
        "layers": layers,
        "heads": heads,
        "causal": causal,
        "weights": base64.b64encode(q.contiguous().numpy().tobytes()).decode("ascii"),
        "row_max": base64.b64encode(
            row_max.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii"),
    }


def decode_section(section: dict[str, Any]) -> Tensor:
    """The ``(layers, heads, queries, keys)`` float32 weights :func:`encode_section`
    stored (to 8 bits per row): what the page reads, for tests and notebooks."""
    layers, heads = section["layers"], section["heads"]
    n_q, n_k = len(section["queries"]), len(section["keys"])
    q = torch.frombuffer(bytearray(base64.b64decode(section["weights"])), dtype=torch.uint8)
    row_max = torch.frombuffer(bytearray(base64.b64decode(section["row_max"])),
                               dtype=torch.float32).reshape(layers, heads, n_q)
    full = torch.zeros(layers, heads, n_q, n_k, dtype=torch.float32)
    if section["causal"]:
        full[:, :, torch.ones(n_q, n_k, dtype=torch.bool).tril()] = \
            q.reshape(layers, heads, -1).float()
    else:
        full[:] = q.reshape(layers, heads, n_q, n_k).float()
    return full / 255 * row_max.unsqueeze(-1)


def _check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty: give the model something to read")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"text has {len(text):,} characters; at most {MAX_TEXT_CHARS:,}")
    return text


@torch.no_grad()
def _lm_example(lm: LanguageModel, text: str) -> dict[str, Any]:
    labels, weights = lm.attention(text)  # per layer (heads, T, T)
    section = encode_section("self", "Causal self-attention", labels, labels,
                             torch.stack(weights), causal=True)
    return {"text": text, "output": None, "sections": [section]}


@torch.no_grad()
def _translation_example(translator: Translator, text: str, beam: int) -> dict[str, Any]:
    (result,) = translator.translate([text], beam=beam)
    source = result.source_tokens  # with <eos>
    # One row per decoder step: each output token, and <eos> when the decoder stopped
    # on its own (the row that chose to stop).
    produced = (result.tokens + [EOS])[: len(result.attention)]
    model = translator.model
    if not isinstance(model, TransformerSeq2Seq):
        alignment = result.attention[None, None]  # (1, 1, steps, source)
        return {"text": text, "output": result.text, "sections": [encode_section(
            "alignment", "Alignment: each output token's attention over the source",
            produced, source, alignment)]}
    device = translator.device
    src = torch.tensor([translator.src_vocab[source]], device=device)
    valid = torch.tensor([len(source)], device=device)
    # Teacher forcing on the translation itself: the decoder reads <bos> and the tokens
    # it produced, exactly the inputs of its decoding steps.
    inputs = [BOS, *result.tokens][: len(produced)]
    dec = torch.tensor([translator.tgt_vocab[inputs]], device=device)
    with eval_mode(model):
        maps = model.attention_maps(src, valid, dec)

    def stacked(name: str) -> Tensor:
        return torch.stack([w[0] for w in maps[name]])  # (layers, heads, rows, cols)

    return {"text": text, "output": result.text, "sections": [
        encode_section("encoder", "Encoder self-attention (source over source)",
                       source, source, stacked("encoder")),
        encode_section("decoder", "Decoder self-attention (decoder inputs over earlier "
                       "inputs)", inputs, inputs, stacked("decoder"), causal=True),
        encode_section("cross", "Cross-attention (each output token over the source)",
                       produced, source, stacked("cross")),
    ]}


def example(target: Target, text: str, *, beam: int = 1) -> dict[str, Any]:
    """One input text's sections: the model run on ``text`` (a translator translates it,
    greedily or with ``beam``)."""
    text = _check_text(text)
    if isinstance(target, LanguageModel):
        return _lm_example(target, text)
    if isinstance(target, Translator):
        return _translation_example(target, text, beam)
    raise TypeError(f"expected a qkv LanguageModel or Translator, got {type(target).__name__}")


def describe(target: Target, run_dir: str | Path | None = None) -> dict[str, Any]:
    """The page's ``model`` entry: the kind of model and a one-line description."""
    if isinstance(target, LanguageModel):
        cfg = target.model.cfg
        return {"kind": "lm", "run": None if run_dir is None else str(run_dir),
                "name": f"GPT '{target.settings.preset}', {cfg.n_layers} layers x "
                        f"{cfg.n_heads} heads, tokenizer {target.tokenizer.name}"}
    if isinstance(target, Translator):
        kind = "transformer" if isinstance(target.model, TransformerSeq2Seq) else "bahdanau"
        c = target.model.config
        heads = f" x {c.num_heads} heads" if kind == "transformer" else " (GRU)"
        return {"kind": kind, "run": None if run_dir is None else str(run_dir),
                "name": f"{c.num_layers} layers{heads}, {len(target.src_vocab):,} source "
                        f"and {len(target.tgt_vocab):,} target tokens"}
    raise TypeError(f"expected a qkv LanguageModel or Translator, got {type(target).__name__}")


def page_data(target: Target, texts: Sequence[str], *, run_dir: str | Path | None = None,
              beam: int = 1) -> dict[str, Any]:
    """Everything one page shows: the model's description and one example per text."""
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    return {"version": VERSION, "model": describe(target, run_dir),
            "examples": [example(target, text, beam=beam) for text in texts]}
