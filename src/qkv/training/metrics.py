"""Translation metrics: d2l's sentence BLEU, sacreBLEU's corpus BLEU, exact match.

All three take already-tokenised text, tokens separated by whitespace, which is what
the translation pipeline produces (lower-cased, a space before ``, . ! ?``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

__all__ = ["References", "bleu", "corpus_bleu", "exact_match", "has_sacrebleu", "reference_sets"]


def _ngrams(tokens: list[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu(pred_seq: str, label_seq: str, k: int = 2) -> float:
    """Sentence BLEU as *Dive into Deep Learning* defines it.

    ``exp(min(0, 1 - len_label / len_pred)) * prod_{n=1..k} p_n ** (1 / 2**n)``, where
    ``p_n`` is the clipped n-gram precision: matches between the prediction's n-grams and
    the label's, each label n-gram usable as often as it occurs, over the prediction's
    n-gram count. The weights ``1 / 2**n`` reward longer matches more.

    A prediction shorter than ``k`` tokens (the empty one included) has no n-grams for
    ``n = k``, so ``p_k`` is undefined; the score is then 0.0. d2l's own loop
    instead stops at ``n = len_pred`` and so gives such predictions a positive score.
    Tokens are split on whitespace (d2l splits on single spaces: equal for the
    single-spaced text the pipeline produces).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    pred_tokens, label_tokens = pred_seq.split(), label_seq.split()
    len_pred, len_label = len(pred_tokens), len(label_tokens)
    if len_pred < k:
        return 0.0
    score = math.exp(min(0.0, 1 - len_label / len_pred))  # brevity penalty
    for n in range(1, k + 1):
        label_counts = _ngrams(label_tokens, n)
        pred_counts = _ngrams(pred_tokens, n)
        # Clipping: a predicted n-gram matches at most as many times as the label has it.
        matches = sum(min(count, label_counts[gram]) for gram, count in pred_counts.items())
        score *= (matches / (len_pred - n + 1)) ** (0.5**n)
    return score


def has_sacrebleu() -> bool:
    """Whether the optional sacreBLEU package (``pip install 'qkv[bleu]'``) is installed."""
    try:
        import sacrebleu  # noqa: F401
    except ImportError:
        return False
    return True


SACREBLEU_TOKENIZER = "13a"

# One reference per prediction, or a non-empty list of them (several valid translations).
References = Sequence[str] | Sequence[Sequence[str]]


def reference_sets(preds: Sequence[str], refs: References) -> list[list[str]]:
    """Each prediction's references as a list: ``refs[i]`` is one string or a non-empty
    sequence of strings."""
    if len(preds) != len(refs):
        raise ValueError(f"got {len(preds)} predictions but {len(refs)} references")
    sets = [[r] if isinstance(r, str) else list(r) for r in refs]
    for i, group in enumerate(sets):
        if not group or not all(isinstance(r, str) for r in group):
            raise ValueError(f"references of prediction {i} must be a string or a non-empty "
                             f"list of strings, got {refs[i]!r}")
    return sets


def corpus_bleu(
    preds: Sequence[str], refs: References, *, tokenize: str = SACREBLEU_TOKENIZER
) -> float:
    """Standard corpus-level BLEU-4 from sacreBLEU, on its 0-100 scale.

    This is the number papers report, unlike :func:`bleu` (d2l's sentence score, 0-1,
    k = 2 by default): n-gram counts are pooled over the corpus before the precisions
    and the brevity penalty are taken.

    ``preds`` and ``refs`` are *detokenised* text (``"va!"``, as a person writes it, not
    the pipeline's ``"va !"``; see :func:`qkv.data.translate.detokenize`), which
    sacreBLEU's own tokenizer, ``"13a"`` by default, splits the same way for every
    system: that is what makes the score comparable with other tools'. ``tokenize="none"``
    scores space-separated tokens as given.

    ``refs[i]`` is the reference of ``preds[i]``, or a list of its references: an n-gram
    then matches if any reference has it (clipped by the most any one has), and the
    brevity penalty uses the reference length closest to the prediction's, as BLEU
    defines for several references.
    """
    sets = reference_sets(preds, refs)
    if not preds:
        raise ValueError("corpus_bleu needs at least one prediction")
    try:
        import sacrebleu  # optional dependency: imported only when needed
    except ImportError:
        raise ImportError(
            "corpus_bleu needs sacrebleu: pip install 'qkv[bleu]'"
        ) from None
    # sacreBLEU takes reference *streams*; a prediction with fewer references than the
    # most has None in the streams it lacks, which sacreBLEU skips.
    streams = [[group[j] if j < len(group) else None for group in sets]
               for j in range(max(len(group) for group in sets))]
    return float(sacrebleu.corpus_bleu(list(preds), streams, tokenize=tokenize).score)


def exact_match(preds: Sequence[str], refs: References) -> float:
    """Fraction of predictions whose token sequence (whitespace-split) equals the
    reference's, or any of them when ``refs[i]`` is a list."""
    sets = reference_sets(preds, refs)
    if not preds:
        raise ValueError("exact_match needs at least one prediction")
    return sum(any(p.split() == r.split() for r in group)
               for p, group in zip(preds, sets, strict=True)) / len(preds)
