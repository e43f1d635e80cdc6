"""Greedy decoding and beam search for any :class:`~qkv.models.seq2seq.EncoderDecoder`.

Both use only ``encode``, ``decode_step`` and ``reorder_state``, so they run the
Transformer through its KV cache and the GRU model through its recurrent state alike.

Both switch the model to eval mode for the call and restore its previous mode afterwards:
dropout left on would make translations random (a bug the reference once had), and a
trainer may decode a few samples in the middle of training without managing the mode.
Both run under ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..checks import show
from ..options import MAX_BEAM
from .seq2seq import EncoderDecoder, teacher_forcing_input

__all__ = ["greedy_decode", "beam_search", "score_sequence", "length_penalty_factor",
           "eval_mode", "MAX_BEAM", "check_beam"]



def check_beam(value: Any, name: str = "beam") -> int:
    """``value`` if it is an integer in ``[1, MAX_BEAM]``; else a one-line ``ValueError``
    with the limit and its reason."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BEAM:
        raise ValueError(
            f"{name} must be an integer in [1, {MAX_BEAM:,}] (1: greedy), got {show(value)} "
            "(each step scores beam x vocabulary candidates; translations stop improving "
            "long before)"
        )
    return value


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the ``with`` block; its previous mode after it."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _prepare(src: Tensor, src_valid_len: Tensor | int | list[int]) -> tuple[Tensor, Tensor]:
    """``src (S,)`` or ``(b, S)`` and lengths ``()``/``(b,)`` -> ``(b, S)``, ``(b,)`` int64."""
    if src.dim() == 1:
        src = src.unsqueeze(0)
    if src.dim() != 2:
        raise ValueError(f"src must have shape (batch, src_len), got {tuple(src.shape)}")
    valid = torch.as_tensor(src_valid_len, dtype=torch.long, device=src.device).reshape(-1)
    if valid.shape[0] != src.shape[0]:
        raise ValueError(
            f"src_valid_len must have one length per source row ({src.shape[0]}), "
            f"got {tuple(valid.shape)}"
        )
    return src, valid


def _check_steps(max_steps: int) -> None:
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")


@torch.no_grad()
def greedy_decode(
    model: EncoderDecoder,
    src: Tensor,
    src_valid_len: Tensor | int | list[int],
    *,
    bos_id: int,
    eos_id: int,
    max_steps: int,
    banned_ids: Sequence[int] = (),
) -> tuple[list[list[int]], list[Tensor]]:
    """Translate each row by always taking the most likely next token.

    Args:
        src: ``(batch, src_len)`` (or ``(src_len,)``) source ids.
        src_valid_len: ``(batch,)`` number of real source tokens per row.
        bos_id, eos_id: ids of ``<bos>`` (first decoder input) and ``<eos>`` (stop).
        max_steps: most tokens generated per row, ``<eos>`` included.
        banned_ids: ids never generated (e.g. ``<unk>``, a placeholder no reader wants
            to see): the most likely of the others is taken.

    Returns:
        tokens: per row, the generated ids without ``<bos>`` / ``<eos>``.
        attention: per row, a ``(steps, src_len)`` tensor, one row per decoder step; it has
            ``len(tokens) + 1`` rows when the row stopped at ``<eos>`` (the last row is the
            ``<eos>`` step), ``len(tokens)`` when it ran out of steps.
    """
    _check_steps(max_steps)
    src, valid = _prepare(src, src_valid_len)
    banned = _banned(banned_ids, eos_id)
    batch = src.shape[0]
    tokens: list[list[int]] = [[] for _ in range(batch)]
    attention: list[list[Tensor]] = [[] for _ in range(batch)]
    with eval_mode(model):
        state = model.encode(src, valid, max_steps=max_steps)
        rows = list(range(batch))  # original row of each live (not yet finished) row
        inputs = torch.full((batch,), bos_id, dtype=torch.long, device=src.device)
        for _ in range(max_steps):
            logits, state, attn = model.decode_step(inputs, state)
            if banned is not None:
                logits = logits.index_fill(-1, banned.to(logits.device), float("-inf"))
            pred = logits.argmax(dim=-1)
            attn = attn.cpu()
            for i, (row, tok) in enumerate(zip(rows, pred.tolist(), strict=True)):
                attention[row].append(attn[i])
                if tok != eos_id:
                    tokens[row].append(tok)
            alive = pred != eos_id
            if not alive.any():
                break
            if not alive.all():
                # Drop finished rows so later steps do no wasted work for them.
                keep = alive.nonzero().squeeze(1)
                state = model.reorder_state(state, keep)
                rows = [rows[i] for i in keep.tolist()]
                pred = pred[keep]
            inputs = pred
    return tokens, [torch.stack(a) for a in attention]


def _banned(banned_ids: Sequence[int], eos_id: int) -> Tensor | None:
    """``banned_ids`` as an index tensor (None when empty); ``<eos>`` cannot be banned."""
    ids = [int(i) for i in banned_ids]
    if eos_id in ids:
        raise ValueError(f"banned_ids must not hold eos_id ({eos_id}): decoding could never end")
    return torch.tensor(ids, dtype=torch.long) if ids else None


def length_penalty_factor(length: int, alpha: float) -> float:
    """GNMT's length normaliser ``((5 + length) / 6) ** alpha`` (Wu et al., 2016).

    A hypothesis scores ``sum(log p) / length_penalty_factor(length, alpha)``. Log-probs
    only add negative terms, so unnormalised beams prefer short outputs; ``alpha = 0``
    keeps the raw sum, larger ``alpha`` favours longer translations.
    """
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    model: EncoderDecoder,
    src: Tensor,
    src_valid_len: Tensor | int | list[int],
    *,
    bos_id: int,
    eos_id: int,
    max_steps: int,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    banned_ids: Sequence[int] = (),
) -> tuple[list[int], Tensor, float]:
    """Beam search for one source sentence ``src (1, src_len)`` (or ``(src_len,)``).

    Each step extends every live hypothesis by every token and keeps the ``beam_size``
    best by summed log-probability. A kept candidate ending in ``<eos>`` is finished and
    leaves the beam; so is every live one when ``max_steps`` tokens have been generated.
    The winner is the finished hypothesis with the best length-normalised score (see
    :func:`length_penalty_factor`). With ``beam_size=1`` this is exactly greedy decoding.

    Search stops early once no live hypothesis can still beat the best finished one
    (its log-prob can only fall, and the normaliser is at most that of ``max_steps``).

    ``banned_ids`` are never generated: their probability is spread over the other
    tokens (the softmax is taken without them). ``beam_size`` is at most
    :data:`MAX_BEAM`.

    Returns:
        tokens: the best hypothesis without ``<bos>`` / ``<eos>``.
        attention: its ``(steps, src_len)`` weights, rows as in :func:`greedy_decode`.
        score: its normalised score (log-prob over generated tokens, ``<eos>`` included).
    """
    _check_steps(max_steps)
    check_beam(beam_size, "beam_size")
    src, valid = _prepare(src, src_valid_len)
    banned = _banned(banned_ids, eos_id)
    if src.shape[0] != 1:
        raise ValueError(f"beam_search decodes one sentence, got a batch of {src.shape[0]}")
    device = src.device
    finished: list[tuple[float, list[int], Tensor]] = []
    with eval_mode(model):
        state = model.encode(src, valid, max_steps=max_steps)
        hyps: list[list[int]] = [[]]  # tokens of each live hypothesis
        logp = torch.zeros(1, device=device)  # (live,) summed log-probs
        attn_so_far = torch.zeros(1, 0, src.shape[1])  # (live, steps, src_len), on the CPU
        inputs = torch.full((1,), bos_id, dtype=torch.long, device=device)
        best_possible = length_penalty_factor(max_steps, length_penalty)
        for step in range(max_steps):
            logits, state, attn = model.decode_step(inputs, state)
            if banned is not None:
                logits = logits.index_fill(-1, banned.to(logits.device), float("-inf"))
            vocab = logits.shape[-1]
            cand = logp[:, None] + torch.log_softmax(logits.float(), dim=-1)  # (live, vocab)
            attn_all = torch.cat([attn_so_far, attn.cpu()[:, None]], dim=1)
            top_logp, top_idx = cand.flatten().topk(min(beam_size, cand.numel()))
            norm = length_penalty_factor(step + 1, length_penalty)
            last_step = step == max_steps - 1
            keep: list[tuple[float, int, int]] = []
            for lp, flat in zip(top_logp.tolist(), top_idx.tolist(), strict=True):
                if lp == float("-inf"):
                    continue  # a banned token: fewer allowed candidates than the beam
                beam, tok = divmod(flat, vocab)
                if tok == eos_id:
                    finished.append((lp / norm, hyps[beam], attn_all[beam]))
                elif last_step:
                    finished.append((lp / norm, hyps[beam] + [tok], attn_all[beam]))
                else:
                    keep.append((lp, beam, tok))
            if not keep:
                break
            index = torch.tensor([b for _, b, _ in keep], device=device)
            state = model.reorder_state(state, index)
            hyps = [hyps[b] + [t] for _, b, t in keep]
            logp = torch.tensor([lp for lp, _, _ in keep], device=device)
            attn_so_far = attn_all[index.cpu()]
            inputs = torch.tensor([t for _, _, t in keep], device=device)
            if finished and max(lp for lp, _, _ in keep) / best_possible <= max(
                s for s, _, _ in finished
            ):
                break
    score, tokens, attention = max(finished, key=lambda f: f[0])
    return tokens, attention, score


@torch.no_grad()
def score_sequence(
    model: EncoderDecoder,
    src: Tensor,
    src_valid_len: Tensor | int | list[int],
    tokens: list[int],
    *,
    bos_id: int,
    length_penalty: float = 0.6,
) -> float:
    """Beam search's score of a given output ``tokens`` (append ``<eos>`` if it ended).

    Runs one teacher-forced forward: ``sum(log p(tokens)) / length_penalty_factor(len)``.
    Useful to compare the outputs of different decoders under one measure.
    """
    if not tokens:
        raise ValueError("tokens must contain at least one generated id")
    src, valid = _prepare(src, src_valid_len)
    target = torch.tensor([tokens], dtype=torch.long, device=src.device)
    with eval_mode(model):
        logits = model(src, valid, teacher_forcing_input(target, bos_id))
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, target[..., None]).sum()
    return logp.item() / length_penalty_factor(len(tokens), length_penalty)
