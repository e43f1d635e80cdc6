"""d2l's sentence BLEU, sacreBLEU's corpus BLEU and exact match."""

from __future__ import annotations

import math
import random
import sys

import pytest

from qkv.training.metrics import bleu, corpus_bleu, exact_match


def test_identical_is_one():
    assert bleu("je suis chez moi .", "je suis chez moi .", k=2) == 1.0
    assert bleu("va !", "va !") == 1.0


def test_d2l_k4_example_is_zero():
    # No 4-gram of the prediction occurs in the label, so p_4 = 0 and the product is 0.
    assert bleu("A B B C D", "A B C D E F", k=4) == 0.0


def _d2l_bleu(pred_seq: str, label_seq: str, k: int) -> float:
    """d2l's loop, transcribed: the independent reference for the cases where it is defined."""
    pred_tokens, label_tokens = pred_seq.split(" "), label_seq.split(" ")
    len_pred, len_label = len(pred_tokens), len(label_tokens)
    score = math.exp(min(0, 1 - len_label / len_pred))
    for n in range(1, min(k, len_pred) + 1):
        num_matches, label_subs = 0, {}
        for i in range(len_label - n + 1):
            gram = " ".join(label_tokens[i:i + n])
            label_subs[gram] = label_subs.get(gram, 0) + 1
        for i in range(len_pred - n + 1):
            gram = " ".join(pred_tokens[i:i + n])
            if label_subs.get(gram, 0) > 0:
                num_matches += 1
                label_subs[gram] -= 1
        score *= math.pow(num_matches / (len_pred - n + 1), math.pow(0.5, n))
    return score


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_matches_d2l_loop_when_prediction_has_k_tokens(k):
    rng = random.Random(k)
    for _ in range(200):
        pred = " ".join(rng.choice("abcd") for _ in range(rng.randint(k, 7)))
        label = " ".join(rng.choice("abcd") for _ in range(rng.randint(1, 7)))
        assert bleu(pred, label, k) == pytest.approx(_d2l_bleu(pred, label, k), rel=1e-12)


def test_hand_computed_k2():
    # label "a b c d" (4 tokens), prediction "a b d" (3 tokens):
    #   brevity penalty = exp(min(0, 1 - 4/3)) = exp(-1/3)
    #   p_1: unigrams a, b, d all occur in the label          -> 3/3 = 1
    #   p_2: bigrams "a b" (in the label), "b d" (not)         -> 1/2
    #   BLEU = exp(-1/3) * 1 ** (1/2) * (1/2) ** (1/4) = 0.7165313 * 0.8408964 = 0.6025286
    expected = math.exp(-1 / 3) * 1.0**0.5 * 0.5**0.25
    assert bleu("a b d", "a b c d", k=2) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.6025286, abs=1e-7)


def test_clipped_precision():
    # "the" appears twice in the label, so only two of the prediction's three count:
    # p_1 = 2/3; the bigram "the the" occurs once in the label: p_2 = 1/2; no brevity penalty.
    expected = (2 / 3) ** 0.5 * (1 / 2) ** 0.25
    assert bleu("the the the", "the the", k=2) == pytest.approx(expected)


def test_longer_prediction_has_no_brevity_penalty():
    # Prediction longer than the label: exp(min(0, 1 - 2/4)) = 1; p_1 = 2/4, p_2 = 1/3.
    assert bleu("a b x y", "a b", k=2) == pytest.approx((2 / 4) ** 0.5 * (1 / 3) ** 0.25)


@pytest.mark.parametrize("pred", ["", "   ", "va"])
def test_prediction_shorter_than_k_scores_zero(pred):
    assert bleu(pred, "va !", k=2) == 0.0


def test_empty_label():
    assert bleu("a b", "", k=2) == 0.0


def test_bad_k():
    with pytest.raises(ValueError, match="k must be >= 1"):
        bleu("a", "a", k=0)


def test_corpus_bleu():
    refs = ["je suis chez moi .", "il est calme ."]
    assert corpus_bleu(refs, refs) == pytest.approx(100.0)
    assert 0.0 <= corpus_bleu(["je suis calme .", "il est calme ."], refs) < 100.0
    # BLEU-4 on a corpus shorter than 4 tokens has no 4-grams: sacreBLEU scores it 0.
    assert corpus_bleu(["j'ai perdu ."], ["j'ai perdu ."]) == 0.0
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        corpus_bleu(refs, refs[:1])
    with pytest.raises(ValueError, match="at least one"):
        corpus_bleu([], [])


def test_corpus_bleu_without_sacrebleu(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # makes `import sacrebleu` fail
    with pytest.raises(ImportError, match=r"pip install 'qkv\[bleu\]'"):
        corpus_bleu(["a"], ["a"])


def test_exact_match():
    assert exact_match(["va !", "je  suis", "x"], ["va !", "je suis", "y"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="1 predictions but 2 references"):
        exact_match(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="at least one"):
        exact_match([], [])


def test_corpus_bleu_on_detokenized_text_gives_no_tokenization_warning(caplog):
    pytest.importorskip("sacrebleu")
    from qkv.data.translate import detokenize, preprocess

    lines = [f"il y a {i} chats ." for i in range(120)]
    detok = [detokenize(preprocess(line).split()) for line in lines]
    assert detok[0] == "il y a 0 chats."
    with caplog.at_level("WARNING"):
        assert corpus_bleu(detok, detok) == pytest.approx(100.0)
    assert "tokenized period" not in caplog.text
    # The warning the detokenisation avoids: tokenised lines handed to sacreBLEU's 13a.
    with caplog.at_level("WARNING"):
        corpus_bleu(lines, lines)
    assert "tokenized period" in caplog.text


def _naive_multi_ref_bleu(preds, refs, max_n=4):
    """Corpus BLEU-4 written out from its definition, in float64, on whitespace tokens:
    each n-gram clipped by the most any one reference has, the brevity penalty on the
    summed reference lengths closest to each prediction's (the shorter on a tie)."""
    matches, totals = [0] * max_n, [0] * max_n
    hyp_len = ref_len = 0
    for pred, group in zip(preds, refs, strict=True):
        p, rs = pred.split(), [r.split() for r in group]
        hyp_len += len(p)
        ref_len += min((abs(len(r) - len(p)), len(r)) for r in rs)[1]
        for n in range(1, max_n + 1):
            grams = [tuple(p[i:i + n]) for i in range(len(p) - n + 1)]
            most = {}
            for r in rs:
                counts = {}
                for g in (tuple(r[i:i + n]) for i in range(len(r) - n + 1)):
                    counts[g] = counts.get(g, 0) + 1
                for g, c in counts.items():
                    most[g] = max(most.get(g, 0), c)
            seen = {}
            for g in grams:
                seen[g] = seen.get(g, 0) + 1
            matches[n - 1] += sum(min(c, most.get(g, 0)) for g, c in seen.items())
            totals[n - 1] += len(grams)
    precision = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / max_n
    penalty = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * penalty * math.exp(precision)


def test_corpus_bleu_with_several_references_per_prediction():
    pytest.importorskip("sacrebleu")
    preds = ["le chat dort sur le tapis rouge", "il fait beau aujourd'hui à paris",
             "je ne sais pas quoi faire maintenant"]
    refs = [["le chien dort sur le tapis", "le chat dort sur un tapis rouge"],
            ["il fait beau aujourd'hui à paris"],
            ["je ne sais pas quoi dire", "je sais pas quoi faire", "je ne sais plus quoi faire"]]
    want = _naive_multi_ref_bleu(preds, refs)
    assert corpus_bleu(preds, refs, tokenize="none") == pytest.approx(want, abs=1e-9)
    # More references can only find more matches than the first alone.
    first = corpus_bleu(preds, [group[0] for group in refs], tokenize="none")
    assert first == pytest.approx(_naive_multi_ref_bleu(preds, [[g[0]] for g in refs]))
    assert first < want
    # A prediction equal to its second reference is a perfect translation.
    assert corpus_bleu(["il fait très beau à paris ce matin"],
                       [["il pleut", "il fait très beau à paris ce matin"]]) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="references of prediction 1 must be"):
        corpus_bleu(preds[:2], [["a"], []])


def test_exact_match_with_several_references():
    assert exact_match(["va !", "marche .", "x"],
                       [["bouge !", "va !"], "marche .", ["y", "z"]]) == pytest.approx(2 / 3)
