"""Attention tensors -> the page's data: what :mod:`qkv.viz.page` embeds as JSON.

The page shows *sections*: one attention map each, over every layer and head, with the
tokens that attend (``queries``, the rows) and those attended to (``keys``, the
columns). A language model has one section (causal self-attention); the Bahdanau
translator one (its alignment: output tokens over source tokens); the Transformer
translator three (encoder self-attention, decoder self-attention, cross-attention).

Weights are stored in 8 bits, on a log scale relative to their row's largest weight:
entry ``(l, h, i, j)`` is ``row_max[l, h, i] * 10 ** (-DECADES * (255 - q) / 254)`` for a
byte ``q`` of 1..255, and 0 for ``q = 0``. Every weight from ``row_max / 10**DECADES`` up
is kept to within 2.3% of itself, however it compares with the rest of its row; smaller
ones read as 0. A linear byte (``w / row_max * 255``) would keep only the top of each row:
when one key takes most of every row, as the first token (an "attention sink") does in
most trained language models, every other weight of a long row is below 1/510 of the
row's maximum and would read as 0, and no colour scale could show it. Each row's maximum
is stored exactly (float32), and a causal map stores only its lower triangle. So a
256-token prompt on a 12-layer, 12-head GPT takes 4.7 MB of bytes (6.3 MB as base64),
not 38 MB of float32.

A language model's example can continue its text greedily (``generate``): its section
then covers the prompt and the generated tokens, and ``generated_from`` is the index of
the first generated one (``None`` when there is none).

A language model whose layers are not all softmax attention (Qwen3.5's and Qwen3-Next's
Gated DeltaNet layers: an attention class with a ``weights_section`` title) has a section
per kind: the softmax layers', and one per such class. ``layer_ids`` then names each
section's layers in the model (absent: ``0, 1, ...``). Such weights need not be
non-negative: their section is ``signed``, its bytes and ``row_max`` those of the
magnitudes ``|w|`` and ``signs`` one bit per stored entry (1: negative), packed eight to
a byte, least significant bit first, in the bytes' order.

Shapes: ``weights`` are ``(layers, heads, queries, keys)``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..attention_variants import SinkAttention
from ..data.translate import BOS, EOS
from ..heads.capture import capture
from ..heads.scores import SCORES, InductionProtocol, head_scores
from ..latent_attention import LatentAttention, SparseLatentAttention
from ..models.decoding import eval_mode
from ..models.gpt import check_max_new_tokens
from ..models.gpt import generate as generate_ids
from ..models.transformer import TransformerSeq2Seq
from ..multihead import MultiHeadAttention
from ..tasks.lm import LanguageModel
from ..tasks.translate import Translator

__all__ = ["VERSION", "DECADES", "MAX_TEXT_CHARS", "encode_section", "decode_section",
           "example", "page_data", "describe", "check_generate", "check_translator_generate",
           "contributions", "rollout", "heads_catalogue", "VIEW_TITLES"]

# The other things a language model's softmax section can show beside its weights.
VIEW_TITLES = {
    "contribution": "Contribution: |a_ij v_j W_O,h|, each weighted, projected value's norm "
                    "(Kobayashi et al., 2020)",
    "rollout": "Attention rollout through each layer: (A + I) / 2 averaged over heads, "
               "multiplied from layer 0 up (Abnar & Zuidema, 2020)",
}

VERSION = 2
# The range of the stored log scale: weights down to 10**-DECADES of their row's largest.
DECADES = 5
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
    generated_from: int | None = None,
    signed: bool = False,
    layer_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One attention map in the page's format (see the module docstring).

    ``weights (layers, heads, len(queries), len(keys))``: finite, and non-negative (rows
    of a softmax, in practice) unless ``signed``. With ``causal``, ``queries`` and
    ``keys`` have one length and only entries ``j <= i`` are stored (the others must be 0
    and read as 0). ``generated_from``: the first query (and key) that the model
    generated, if any. ``layer_ids``: the model's numbers of the ``layers`` (default
    ``0, 1, ...``).
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
    if generated_from is not None and not (
            isinstance(generated_from, int) and 0 <= generated_from <= min(n_q, n_k)):
        raise ValueError(f"generated_from must be an index in 0..{min(n_q, n_k)}, got "
                         f"{generated_from!r}")
    if layer_ids is not None and (
            len(layer_ids) != layers or len(set(layer_ids)) != layers or
            any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layer_ids)):
        raise ValueError(f"layer_ids must name each of the {layers} layers once, got "
                         f"{list(layer_ids)!r}")
    w = weights.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()) or (not signed and bool((w < 0).any())):
        raise ValueError(f"{title}: attention weights must be finite" +
                         ("" if signed else " and >= 0"))
    negative = w < 0
    w = w.abs()
    row_max = w.amax(dim=-1)
    scaled = w / row_max.clamp_min(torch.finfo(torch.float64).tiny).unsqueeze(-1)
    # log10 of 0 is -inf: it clamps to the byte 0, as does anything under the range.
    steps = torch.round(255 + torch.log10(scaled) * (254 / DECADES))
    q = steps.clamp(0, 255).to(torch.uint8)
    if causal:
        stored = torch.ones(n_q, n_k, dtype=torch.bool).tril()
        q = q[:, :, stored]  # (L, H, entries)
        negative = negative[:, :, stored]
    extra: dict[str, Any] = {}
    if layer_ids is not None:
        extra["layer_ids"] = list(layer_ids)
    if signed:
        # A weight that rounds to the byte 0 reads as 0 either way: its sign is dropped.
        bits = (negative & (q > 0)).contiguous().numpy().reshape(-1)
        extra["signs"] = base64.b64encode(
            np.packbits(bits, bitorder="little").tobytes()).decode("ascii")
    return {
        "id": section_id,
        "title": title,
        "queries": list(queries),
        "keys": list(keys),
        "layers": layers,
        "heads": heads,
        "causal": causal,
        "generated_from": generated_from,
        "decades": DECADES,
        "weights": base64.b64encode(q.contiguous().numpy().tobytes()).decode("ascii"),
        "row_max": base64.b64encode(
            row_max.to(torch.float32).numpy().astype("<f4").tobytes()).decode("ascii"),
        **extra,
    }


def decode_section(section: dict[str, Any]) -> Tensor:
    """The ``(layers, heads, queries, keys)`` float32 weights :func:`encode_section`
    stored (8 bits each, log scale; negative where a signed section's bit says so): what
    the page reads, for tests and notebooks."""
    layers, heads = section["layers"], section["heads"]
    n_q, n_k = len(section["queries"]), len(section["keys"])
    q = torch.frombuffer(bytearray(base64.b64decode(section["weights"])), dtype=torch.uint8)
    row_max = torch.frombuffer(bytearray(base64.b64decode(section["row_max"])),
                               dtype=torch.float32).reshape(layers, heads, n_q)
    levels = q.double()
    values = torch.where(levels > 0, 10 ** ((levels - 255) * (DECADES / 254)), 0.0)
    if section.get("signs") is not None:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(section["signs"]), np.uint8),
                             count=len(values), bitorder="little")
        values = torch.where(torch.from_numpy(bits.astype(bool)), -values, values)
    full = torch.zeros(layers, heads, n_q, n_k, dtype=torch.float64)
    if section["causal"]:
        full[:, :, torch.ones(n_q, n_k, dtype=torch.bool).tril()] = \
            values.reshape(layers, heads, -1)
    else:
        full[:] = values.reshape(layers, heads, n_q, n_k)
    return (full * row_max.double().unsqueeze(-1)).float()


def _check_text(text: Any) -> str:
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty: give the model something to read")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"text has {len(text):,} characters; at most {MAX_TEXT_CHARS:,}")
    return text


def check_generate(lm: LanguageModel, prompt_tokens: int, generate: Any,
                   name: str = "generate") -> int:
    """``generate`` if the prompt of ``prompt_tokens`` tokens and that many generated ones
    fit the model's context (the page shows one forward pass over all of them); else a
    one-line ``ValueError``."""
    check_max_new_tokens(generate, name)
    context = lm.model.cfg.context_length
    if prompt_tokens > context:
        raise ValueError(f"the prompt has {prompt_tokens} tokens; the model's "
                         f"context_length is {context}")
    if prompt_tokens + generate > context:
        room = max(context - prompt_tokens, 0)
        raise ValueError(f"{name} {generate}: the prompt has {prompt_tokens} tokens and the "
                         f"model's context_length is {context}, so at most {room} can be "
                         "generated and shown")
    return generate


@torch.no_grad()
def _lm_example(lm: LanguageModel, text: str, generate: int,
                name: str = "generate") -> dict[str, Any]:
    check_max_new_tokens(generate, name)  # before the text is even tokenized
    idx = lm.encode_prompt(text)  # (1, P)
    prompt = idx.shape[1]
    check_generate(lm, prompt, generate, name)
    if generate:
        # Greedy, with the KV cache: the tokens `qkv lm generate` would print.
        idx = generate_ids(lm.model, idx, generate, temperature=0.0, use_cache=True)
    # One forward pass over prompt and continuation: causal, so each generated token's
    # row is what it saw when it was generated.
    # The values of the layers whose heads' outputs are their weighted values (before
    # out_proj), for the contribution view.
    plain = [i for i, block in enumerate(lm.model.trf_blocks)
             if type(block.att) in VALUE_HEADS]
    with capture(lm.model, ["v"], plain) as cache:
        _, weights = lm.model(idx, need_weights=True)  # per layer (1, heads, T, T)
    ids = idx[0].tolist()
    labels = [lm.tokenizer.decode([i]) for i in ids]
    # The layers of each kind of weights (softmax attention first) and head count.
    groups: dict[tuple[str | None, int], list[int]] = {}
    for i, block in enumerate(lm.model.trf_blocks):
        kind = getattr(block.att, "weights_section", None)
        groups.setdefault((kind, weights[i].shape[1]), []).append(i)
    sections = []
    for (kind, _), layers in sorted(groups.items(), key=lambda g: (g[0][0] is not None,
                                                                   g[1][0])):
        title = kind or "Causal self-attention"
        sid = "self" if kind is None else "-".join(kind.split(":")[0].lower().split())
        if any(s["id"] == sid for s in sections):  # another head count of one kind
            sid = f"{sid}-{len(sections)}"
        stacked = torch.stack([weights[i][0] for i in layers])
        section = encode_section(
            sid, title + (" (prompt and greedy continuation)" if generate else ""),
            labels, labels, stacked, causal=True,
            generated_from=prompt if generate else None, signed=kind is not None,
            layer_ids=None if len(groups) == 1 else layers)
        views = {}
        if kind is None and all(i in plain for i in layers):
            atts = [lm.model.trf_blocks[i].att for i in layers]
            views["contribution"] = torch.stack([
                contributions(weights[i][0], cache["v", i][0],
                              getattr(att, VALUE_HEADS[type(att)]).weight)
                for i, att in zip(layers, atts, strict=True)])
        if kind is None and len(groups) == 1:
            views["rollout"] = rollout(stacked)[:, None]
        section["views"] = {
            name: encode_section(f"{sid}:{name}", VIEW_TITLES[name], labels, labels, view,
                                 causal=True, generated_from=prompt if generate else None,
                                 layer_ids=None if len(groups) == 1 else layers)
            for name, view in views.items()}
        sections.append(section)
    output = lm.tokenizer.decode(ids[prompt:]) if generate else None
    return {"text": text, "output": output, "sections": sections}


# The layers whose heads' outputs are their weighted values, with the name of the
# projection that follows (the contribution view's W_O): a latent layer's values are its
# decompressed ones, whichever form ran; a gated layer's gate would mix query and key.
VALUE_HEADS = {MultiHeadAttention: "out_proj", SinkAttention: "out_proj",
               LatentAttention: "o_proj", SparseLatentAttention: "o_proj"}


def contributions(weights: Tensor, values: Tensor, out_proj: Tensor) -> Tensor:
    """Kobayashi et al.'s (2020) norm view of one layer: how much each key's value adds to
    each query's output, ``|a_ij f_h(x_j)|`` with ``f_h(x_j) = v_j W_O,h`` the value of
    key ``j`` in head ``h`` projected by that head's columns of ``out_proj``.

    ``weights (H, T_q, T_k)``, ``values (G, T_k, head_dim)`` (G dividing H),
    ``out_proj (d_out, H * head_dim)`` -> ``(H, T_q, T_k)``, non-negative.
    """
    heads, _, head_dim = weights.shape[0], weights.shape[1], values.shape[-1]
    v = values.repeat_interleave(heads // values.shape[0], dim=0)  # (H, T_k, head_dim)
    w_o = out_proj.reshape(out_proj.shape[0], heads, head_dim)  # (d_out, H, head_dim)
    projected = torch.einsum("hkd,ehd->hke", v.float(), w_o.float())  # (H, T_k, d_out)
    return weights.float() * projected.norm(dim=-1)[:, None, :]


def rollout(weights: Tensor) -> Tensor:
    """Abnar and Zuidema's (2020) attention rollout: ``weights (L, H, T, T)`` of causal
    self-attention -> ``(L, T, T)``, entry ``l`` how much each token's input reaches each
    position after layer ``l``, the residual counted as half: ``R_l = A'_l R_(l-1)`` with
    ``A'_l`` the heads' mean ``(A + I) / 2``, rows renormalised to 1 (a sink's share
    dropped)."""
    mean = weights.double().mean(dim=1)  # (L, T, T)
    eye = torch.eye(mean.shape[-1], dtype=torch.float64)
    out, r = [], eye
    for a in mean:
        a = (a + eye) / 2
        a = a / a.sum(dim=-1, keepdim=True)
        r = a @ r
        out.append(r)
    return torch.stack(out).float()


@torch.no_grad()
def heads_catalogue(lm: LanguageModel) -> dict[str, Any] | None:
    """The page's heads panel: every head's scores (:mod:`qkv.heads.scores`) on the
    induction protocol (BOS + up to 50 random tokens, repeated, within the context), or
    None for a model without per-head softmax weights."""
    context = lm.model.cfg.context_length
    protocol = InductionProtocol(length=max(1, min(50, (context - 1) // 2)), batch=4)
    bos = getattr(lm.tokenizer, "bos_token_id", None)
    protocol.bos_id = bos if isinstance(bos, int) else (lm.tokenizer.eot_token or 0)
    vocab = lm.model.cfg.vocab_size
    try:
        table = head_scores(lm.model, protocol.ids(vocab), repeat=protocol.length)
    except ValueError:  # no layer with per-head softmax weights
        return None
    return {"protocol": protocol.describe(vocab), "scores": table,
            "definitions": dict(SCORES)}


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


def example(target: Target, text: str, *, beam: int = 1, generate: int = 0,
            generate_name: str = "generate") -> dict[str, Any]:
    """One input text's sections: the model run on ``text`` (a translator translates it,
    greedily or with ``beam``; a language model first continues it greedily by
    ``generate`` tokens, when asked). ``generate_name`` names the setting in errors."""
    text = _check_text(text)
    if isinstance(target, LanguageModel):
        return _lm_example(target, text, generate, generate_name)
    if isinstance(target, Translator):
        check_translator_generate(generate, generate_name)
        return _translation_example(target, text, beam)
    raise TypeError(f"expected a qkv LanguageModel or Translator, got {type(target).__name__}")


def describe(target: Target, run_dir: str | Path | None = None) -> dict[str, Any]:
    """The page's ``model`` entry: the kind of model and a one-line description."""
    if isinstance(target, LanguageModel):
        cfg = target.model.cfg
        # What the weights of each kind of layer mean, in the classes' own words.
        notes = dict.fromkeys(note for block in target.model.trf_blocks
                              if (note := getattr(block.att, "weights_note", None)))
        return {"kind": "lm", "run": None if run_dir is None else str(run_dir),
                "name": f"{target.title}, {cfg.n_layers} layers x "
                        f"{cfg.n_heads} heads, tokenizer {target.tokenizer.name}"
                        + "".join(f"; {note}" for note in notes)}
    if isinstance(target, Translator):
        kind = "transformer" if isinstance(target.model, TransformerSeq2Seq) else "bahdanau"
        c = target.model.config
        heads = f" x {c.num_heads} heads" if kind == "transformer" else " (GRU)"
        return {"kind": kind, "run": None if run_dir is None else str(run_dir),
                "name": f"{c.num_layers} layers{heads}, {len(target.src_vocab):,} source "
                        f"and {len(target.tgt_vocab):,} target tokens"}
    raise TypeError(f"expected a qkv LanguageModel or Translator, got {type(target).__name__}")


def check_translator_generate(generate: Any, name: str = "generate") -> None:
    """A translator generates its translation itself: ``generate`` must be 0."""
    if generate != 0 or isinstance(generate, bool):
        raise ValueError(f"{name} {generate!r}: only a language model continues its text; a "
                         "translator's page shows the translation it generates")


def page_data(target: Target, texts: Sequence[str], *, run_dir: str | Path | None = None,
              beam: int = 1, generate: int = 0,
              generate_name: str = "generate") -> dict[str, Any]:
    """Everything one page shows: the model's description and one example per text
    (a language model's continued by ``generate`` greedy tokens)."""
    if isinstance(texts, str) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    if isinstance(target, Translator):
        check_translator_generate(generate, generate_name)
    else:
        check_max_new_tokens(generate, generate_name)
    data = {"version": VERSION, "model": describe(target, run_dir),
            "examples": [example(target, text, beam=beam, generate=generate,
                                 generate_name=generate_name) for text in texts]}
    if isinstance(target, LanguageModel):
        data["heads"] = heads_catalogue(target)
    return data
