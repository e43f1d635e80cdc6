"""Tests for qkv.data.dates: the synthetic date -> ISO corpus.

The source text is checked against an independent oracle (datetime.strptime on the raw
text), so a bug shared by the generator and its target could not hide.
"""

from __future__ import annotations

import datetime as dt
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.dates import (
    DATE_FORMATS,
    DATE_MAX,
    DATE_MIN,
    DATE_TEMPLATES,
    DATES_NUM_STEPS,
    DATES_SRC_STEPS,
    DATES_TGT_STEPS,
    date_corpus_text,
    format_date,
    iso_target,
    join_date_tokens,
    make_date_pairs,
    normalize_date_text,
    sample_dates,
)
from qkv.data.translate import TranslationData, Vocab, build_array, preprocess, read_pairs

# strptime pattern for each format, applied after the ordinal suffix is removed.
# %y is *not* our rule (it maps 69..99 to 19xx), so two-digit years are compared mod 100.
STRPTIME = {
    "iso": "%Y-%m-%d",
    "mdy_slash": "%m/%d/%Y",
    "mdy_slash_short": "%m/%d/%y",
    "dmy_dot": "%d.%m.%Y",
    "dmy_long": "%d %B %Y",
    "dmy_abbr_short": "%d %b %y",
    "dmy_ordinal_abbr": "%d %b %Y",
    "mdy_long": "%B %d, %Y",
    "mdy_abbr": "%b %d, %Y",
    "mdy_abbr_short": "%b %d, %y",
    "mdy_ordinal": "%B %d %Y",
    "ymd_long": "%Y %B %d",
    "the_ordinal_of": "the %d of %B, %Y",
    "weekday_mdy_long": "%A, %B %d, %Y",
    "weekday_abbr_dmy": "%a %d %b %Y",
    "weekday_the_ordinal_of": "%A, the %d of %B, %Y",
}
ORDINAL = re.compile(r"(\d)(st|nd|rd|th)\b")


def _oracle_check(raw: str, fmt: str, d: dt.date) -> None:
    """Parse `raw` independently and check that it denotes `d` (weekday included)."""
    parsed = dt.datetime.strptime(ORDINAL.sub(r"\1", raw), STRPTIME[fmt]).date()
    if "%y" in STRPTIME[fmt]:
        yy = parsed.year % 100
        assert (1900 + yy if yy >= 50 else 2000 + yy) == d.year, raw
        assert (parsed.month, parsed.day) == (d.month, d.day), raw
    else:
        assert parsed == d, raw
    if "%A" in STRPTIME[fmt]:  # strptime ignores the weekday: check it ourselves
        assert raw.startswith(d.strftime("%A").lower() + ","), raw
    if "%a" in STRPTIME[fmt]:
        assert raw.startswith(d.strftime("%a").lower() + " "), raw
    match = ORDINAL.search(raw)
    if match:
        suffix = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}
        assert match.group(2) == suffix.get(d.day, "th"), raw


def test_formats_are_named_and_complete():
    assert len(DATE_FORMATS) >= 12
    assert set(DATE_FORMATS) == set(STRPTIME) == set(DATE_TEMPLATES)


def test_examples_from_the_module_doc():
    d = dt.date(2021, 3, 3)
    assert format_date(d, "weekday_mdy_long") == "wednesday, march 3, 2021"
    assert format_date(d, "mdy_slash") == "03/03/2021"
    assert format_date(d, "dmy_dot") == "3.3.2021"
    assert format_date(d, "dmy_abbr_short") == "3 mar 21"
    assert format_date(d, "the_ordinal_of") == "the 3rd of march, 2021"
    assert normalize_date_text("March 3rd, 2021") == "march 3 rd , 2 0 2 1"
    assert normalize_date_text("Tuesday,\xa0March 3, 2021") == "tuesday , march 3 , 2 0 2 1"
    assert normalize_date_text("03/03/2021") == "0 3 / 0 3 / 2 0 2 1"
    assert normalize_date_text("3 Sept '21!") == "3 sep 2 1"
    assert normalize_date_text("Thurs") == "thu"
    assert iso_target(d) == "2 0 2 1 - 0 3 - 0 3"
    assert join_date_tokens("2 0 2 1 - 0 3 - 0 3") == "2021-03-03"
    assert join_date_tokens(["1", "9", "-"]) == "19-"


@pytest.mark.parametrize(
    "day, suffix",
    [(1, "st"), (2, "nd"), (3, "rd"), (4, "th"), (11, "th"), (12, "th"), (13, "th"),
     (21, "st"), (22, "nd"), (23, "rd"), (30, "th"), (31, "st")],
)  # fmt: skip
def test_ordinal_suffixes(day, suffix):
    assert format_date(dt.date(2001, 1, day), "mdy_ordinal") == f"january {day}{suffix} 2001"


def test_format_date_errors():
    with pytest.raises(ValueError, match="unknown date format 'nope'"):
        format_date(dt.date(2000, 1, 1), "nope")
    with pytest.raises(ValueError, match="two-digit year"):
        format_date(dt.date(2050, 1, 1), "dmy_abbr_short")
    assert format_date(dt.date(2050, 1, 1), "iso") == "2050-01-01"  # 4 digits: any year


def test_deterministic_under_seed_and_seeds_differ():
    assert make_date_pairs(300, seed=7) == make_date_pairs(300, seed=7)
    assert make_date_pairs(300, seed=7) != make_date_pairs(300, seed=8)
    assert make_date_pairs(50, seed=7) == make_date_pairs(300, seed=7)[:50]
    state = random.getstate()
    make_date_pairs(10)
    assert random.getstate() == state  # the global generator is left alone
    assert make_date_pairs(0) == []
    with pytest.raises(ValueError):
        make_date_pairs(-1)


def test_pairs_match_dates_and_the_oracle():
    n = 2000
    draws = sample_dates(n, seed=3)
    pairs = make_date_pairs(n, seed=3)
    for (d, fmt), (src, tgt) in zip(draws, pairs, strict=True):
        assert DATE_MIN <= d <= DATE_MAX
        assert join_date_tokens(tgt) == d.isoformat()
        raw = format_date(d, fmt)
        assert src == normalize_date_text(raw)  # train and inference share one path
        _oracle_check(raw, fmt, d)
    assert {fmt for _, fmt in draws} == set(DATE_FORMATS)  # every format appears
    years = [d.year for d, _ in draws]
    assert min(years) < 1960 and max(years) > 2040  # spread over the whole range


@settings(max_examples=300, deadline=None)
@given(d=st.dates(min_value=DATE_MIN, max_value=DATE_MAX), fmt=st.sampled_from(DATE_FORMATS))
def test_property_every_date_every_format(d, fmt):
    raw = format_date(d, fmt)
    _oracle_check(raw, fmt, d)
    src = normalize_date_text(raw)
    assert normalize_date_text(src) == src  # idempotent
    assert preprocess(src) == src  # the translate command's preprocess+split changes nothing
    assert len(src.split()) + 1 <= DATES_SRC_STEPS
    assert len(iso_target(d).split()) + 1 == DATES_TGT_STEPS


def test_steps_constants_are_tight():
    # Longest source: long weekday, two-digit day with ordinal, long month, 4-digit year.
    d = dt.date(2021, 9, 22)  # a wednesday in september
    lengths = {fmt: len(normalize_date_text(format_date(d, fmt)).split()) for fmt in DATE_FORMATS}
    assert max(lengths.values()) + 1 == DATES_SRC_STEPS
    assert max(DATES_SRC_STEPS, DATES_TGT_STEPS) == DATES_NUM_STEPS
    assert 10 <= DATES_NUM_STEPS <= 16


def test_vocab_sizes_are_small():
    pairs = make_date_pairs(5000, seed=0)
    src_vocab = Vocab([s.split() for s, _ in pairs])
    tgt_vocab = Vocab([t.split() for _, t in pairs])
    assert len(src_vocab) - 1 <= 60  # 57 tokens with this scheme, plus <unk>
    assert set(tgt_vocab.idx_to_token[1:]) == set("0123456789-")


def test_round_trip_through_read_pairs_vocab_build_array():
    n = 300
    pairs = make_date_pairs(n, seed=5)
    text = date_corpus_text(n, seed=5)
    assert text.count("\n") == n and preprocess(text) == text
    src, tgt = read_pairs(preprocess(text))
    assert [" ".join(s) for s in src] == [s for s, _ in pairs]
    assert [" ".join(t) for t in tgt] == [t for _, t in pairs]

    data = TranslationData.from_pairs(src, tgt, num_steps=DATES_NUM_STEPS, min_freq=1)
    X, X_len, Y, Y_len = data.train
    # No truncation: every row keeps all its tokens plus <eos>.
    assert X_len.tolist() == [len(s) + 1 for s in src]
    assert Y_len.tolist() == [DATES_TGT_STEPS] * n
    for i in (0, 17, n - 1):
        assert data.src_vocab.to_tokens(X[i, : X_len[i] - 1]) == src[i]
        assert data.tgt_vocab.to_tokens(Y[i, : Y_len[i]]) == [*tgt[i], "<eos>"]
    # The target side alone also fits DATES_TGT_STEPS.
    Y2, Y2_len = build_array(tgt, data.tgt_vocab, DATES_TGT_STEPS)
    assert torch.equal(Y2, Y[:, :DATES_TGT_STEPS]) and torch.equal(Y2_len, Y_len)
