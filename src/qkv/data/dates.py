"""A synthetic translation corpus: human-readable dates -> ISO 8601, built offline.

It is the default corpus for the seq2seq examples: deterministic under a seed, no download,
small vocabularies, and a task where attention has to *find* things (the year may come
first, last or as two digits; the day may hide behind an ordinal or a weekday), so the
attention maps are worth looking at.

Dates are drawn uniformly from 1950-01-01 to 2049-12-31, so a two-digit year is never
ambiguous: 50..99 means 19xx and 00..49 means 20xx. Each date is written in one of the
`DATE_FORMATS`, drawn uniformly. Numeric formats read by separator: `/` is US order
(month/day/year), `.` is European order (day.month.year), `-` is ISO (year-month-day).

Token scheme (source and target are space-separated tokens, ready for `read_pairs`):

- every digit is its own token, so numbers are digit sequences ("2021" -> "2 0 2 1"); the
  model copies digits instead of learning a token per number, which keeps the vocabulary
  small and the alignment learnable;
- month and weekday names stay whole words, full or abbreviated ("march", "mar", "tue");
- an ordinal suffix is split off its number ("3rd" -> "3 rd");
- the punctuation marks `, / . -` are tokens of their own; any other character only
  separates tokens;
- the target is the ISO date, one token per character: "2 0 2 1 - 0 3 - 0 3".

    "wednesday, march 3, 2021" -> "wednesday , march 3 , 2 0 2 1" -> "2 0 2 1 - 0 3 - 0 3"
    "the 23rd of june, 1987"   -> "the 2 3 rd of june , 1 9 8 7"  -> "1 9 8 7 - 0 6 - 2 3"
    "5 nov 49"                 -> "5 nov 4 9"                     -> "2 0 4 9 - 1 1 - 0 5"

Sizes: at most 13 source tokens ("wednesday , the 2 3 rd of september , 2 0 2 1") and
exactly 10 target tokens, so with `<eos>` appended `DATES_SRC_STEPS = 14` and
`DATES_TGT_STEPS = 11` avoid any truncation; `DATES_NUM_STEPS` is the larger of the two,
for pipelines with a single `num_steps`. Vocabularies: 57 source tokens and 11 target
tokens, before the four special ones.

Known limit: writing two numbers next to each other with only a space between them
("march 3 2021") loses the boundary once digits are split ("march 3 2 0 2 1"), so no
training format does that; such input at inference time is a guess for the model.

`normalize_date_text` is the one path from raw text to tokens, used both to generate the
corpus and on user input, so training and inference see the same token forms.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Sequence

from ..options import DATES_NUM_STEPS as DATES_NUM_STEPS  # re-exported

DATE_MIN = dt.date(1950, 1, 1)
DATE_MAX = dt.date(2049, 12, 31)

# Written out instead of taken from `calendar`, whose names follow the process locale.
MONTHS = (
    "january", "february", "march", "april", "may", "june",
    "july", "august", "september", "october", "november", "december",
)  # fmt: skip
MONTHS_ABBR = tuple(m[:3] for m in MONTHS)
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
WEEKDAYS_ABBR = tuple(w[:3] for w in WEEKDAYS)

# Name -> template. Fields: year (4 digits), yy (2 digits), mm/dd (zero-padded), m/day
# (unpadded), month/mon (full/abbreviated name), ord (ordinal suffix), weekday/wd.
DATE_TEMPLATES: dict[str, str] = {
    "iso": "{year}-{mm}-{dd}",
    "mdy_slash": "{mm}/{dd}/{year}",
    "mdy_slash_short": "{m}/{day}/{yy}",
    "dmy_dot": "{day}.{m}.{year}",
    "dmy_long": "{day} {month} {year}",
    "dmy_abbr_short": "{day} {mon} {yy}",
    "dmy_ordinal_abbr": "{day}{ord} {mon} {year}",
    "mdy_long": "{month} {day}, {year}",
    "mdy_abbr": "{mon} {day}, {year}",
    "mdy_abbr_short": "{mon} {day}, {yy}",
    "mdy_ordinal": "{month} {day}{ord} {year}",
    "ymd_long": "{year} {month} {day}",
    "the_ordinal_of": "the {day}{ord} of {month}, {year}",
    "weekday_mdy_long": "{weekday}, {month} {day}, {year}",
    "weekday_abbr_dmy": "{wd} {day} {mon} {year}",
    "weekday_the_ordinal_of": "{weekday}, the {day}{ord} of {month}, {year}",
}
DATE_FORMATS: tuple[str, ...] = tuple(DATE_TEMPLATES)

# Sequence lengths including the <eos> that build_array appends (checked by the tests).
DATES_SRC_STEPS = 14
DATES_TGT_STEPS = 11
# DATES_NUM_STEPS (from qkv.options, where the command line reads it) is the larger.

# Letters runs, single ASCII digits, and the four punctuation marks that carry meaning.
_TOKEN_RE = re.compile(r"[^\W\d_]+|[0-9]|[,./-]")
# Common spellings outside our abbreviation scheme, folded onto it.
_ALIASES = {"sept": "sep", "tues": "tue", "thur": "thu", "thurs": "thu", "weds": "wed"}


def _ordinal_suffix(day: int) -> str:
    if 11 <= day % 100 <= 13:  # 11th, 12th, 13th, not 11st, 12nd, 13rd
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")


def format_date(d: dt.date, fmt: str) -> str:
    """Write `d` as raw human text in format `fmt` (one of `DATE_FORMATS`), lower-case.

    >>> format_date(dt.date(2021, 3, 3), "weekday_mdy_long")
    'wednesday, march 3, 2021'

    Raises:
        ValueError: unknown `fmt`, or a two-digit-year format for a date outside
            1950..2049 (where the two digits would not map back to the same year).
    """
    if fmt not in DATE_TEMPLATES:
        raise ValueError(f"unknown date format {fmt!r}; choose one of {', '.join(DATE_FORMATS)}")
    template = DATE_TEMPLATES[fmt]
    if "{yy}" in template and not DATE_MIN.year <= d.year <= DATE_MAX.year:
        raise ValueError(
            f"format {fmt!r} writes a two-digit year, which only covers "
            f"{DATE_MIN.year}..{DATE_MAX.year}, got {d.year}"
        )
    return template.format(
        year=f"{d.year:04d}",
        yy=f"{d.year % 100:02d}",
        mm=f"{d.month:02d}",
        dd=f"{d.day:02d}",
        m=d.month,
        day=d.day,
        month=MONTHS[d.month - 1],
        mon=MONTHS_ABBR[d.month - 1],
        ord=_ordinal_suffix(d.day),
        weekday=WEEKDAYS[d.weekday()],
        wd=WEEKDAYS_ABBR[d.weekday()],
    )


def normalize_date_text(text: str) -> str:
    """Turn raw human text into the model's space-separated token form (see module doc).

    >>> normalize_date_text("March 3rd, 2021")
    'march 3 rd , 2 0 2 1'

    Idempotent, and a fixed point of `translation.preprocess`, so it may run before it.
    """
    tokens = _TOKEN_RE.findall(text.lower())
    return " ".join(_ALIASES.get(tok, tok) for tok in tokens)


def iso_target(d: dt.date) -> str:
    """The target token string for `d`: `2 0 2 1 - 0 3 - 0 3`."""
    return normalize_date_text(d.isoformat())


def join_date_tokens(tokens: str | Sequence[str]) -> str:
    """Undo the tokenisation of a (predicted) target: `"2 0 2 1 - 0 3 - 0 3"` -> `"2021-03-03"`.

    Accepts a space-separated string or a list of tokens.
    """
    if isinstance(tokens, str):
        tokens = tokens.split()
    return "".join(tokens)


def sample_dates(n: int, seed: int = 0) -> list[tuple[dt.date, str]]:
    """`n` (date, format name) draws: dates uniform on DATE_MIN..DATE_MAX, formats uniform."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)  # private generator: the global random state is untouched
    lo, hi = DATE_MIN.toordinal(), DATE_MAX.toordinal()
    return [(dt.date.fromordinal(rng.randint(lo, hi)), rng.choice(DATE_FORMATS)) for _ in range(n)]


def make_date_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """`n` (source, target) token strings, e.g. `("mar 3 , 2 0 2 1", "2 0 2 1 - 0 3 - 0 3")`.

    The same `(n, seed)` always gives the same pairs; the first k pairs of a longer draw
    equal the pairs of `make_date_pairs(k, seed)`.
    """
    pairs = sample_dates(n, seed)
    return [(normalize_date_text(format_date(d, fmt)), iso_target(d)) for d, fmt in pairs]


def date_corpus_text(n: int, seed: int = 0) -> str:
    """The pairs of `make_date_pairs(n, seed)` as `source<TAB>target` lines (for `read_pairs`)."""
    return "".join(f"{src}\t{tgt}\n" for src, tgt in make_date_pairs(n, seed))
