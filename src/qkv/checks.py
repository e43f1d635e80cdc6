"""Value checks shared by every layer: each failure is one ``ValueError`` line that names
the value, shows what it was, and says what would be valid.

They exist for values read from files a user may have edited (a checkpoint's JSON), where
anything can appear: a string where a size belongs, ``true`` for an integer, ``1e400``
(which JSON reads as ``inf``), a 400-digit integer, ``NaN``. Each check accepts exactly
the JSON types a field can have and a range that keeps later arithmetic and allocation
sane; ``bool`` never passes for a number, although Python makes it an ``int``.

    width = check_int("model.num_hiddens", value, 1, MAX_SIZE)
    lr = check_float("settings.lr", value, 0.0, lo_open=True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_SIZE",
    "MAX_COUNT",
    "show",
    "check_int",
    "check_float",
    "check_bool",
    "check_str",
    "check_sha256",
    "fields_from_dict",
    "small_divisors",
    "MAX_JSON_DEPTH",
    "parse_json",
    "MAX_THREADS",
    "check_threads",
]

# Largest width, vocabulary, depth or length a model config may name: it keeps every
# dimension an int32-sized number. Whether the model fits in memory is checked separately
# (qkv.training.limits), from the same numbers.
MAX_SIZE = 2**31 - 1
# Largest count that allocates nothing (epochs, steps, frequencies): an int64.
MAX_COUNT = 2**63 - 1
# Most CPU threads torch may be asked for: each is an OS thread with its own stack, and
# past the machine's cores more only slow torch down.
MAX_THREADS = 1024
# Deepest nesting of objects and lists qkv reads from a JSON file: its own files nest at
# most 6 levels, a Hugging Face config.json 3. Python's parser recurses once per level,
# so a file of 100,000 '[' would otherwise end in a RecursionError (or, walked later,
# in one far from where it was read).
MAX_JSON_DEPTH = 32


def show(value: Any, limit: int = 40) -> str:
    """A short, one-line description of ``value`` for an error message.

    Long strings are cut, containers are summarised, and integers too long to print
    (Python refuses to turn an int of more than 4,300 digits into text) are described.
    """
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 128:
            digits = int(value.bit_length() * math.log10(2)) + 1
            return f"{'-' if value < 0 else ''}an integer of about {digits} digits"
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= limit else text[: limit - 4] + "...'"
    if isinstance(value, dict):
        return f"an object with {len(value)} key(s)"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item(s)"
    return f"a {type(value).__name__}"


def _bounds(lo: Any, hi: Any, lo_open: bool = False, hi_open: bool = False) -> str:
    left = "(" if lo_open or lo is None else "["  # an infinite bound is never included
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``; else a one-line ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in {_bounds(lo, hi)}, got {show(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer in {_bounds(lo, hi)}, got {show(value)}")
    return value


def check_float(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``float(value)`` if it is a finite number (ints too, bools not) in the range.

    ``lo_open`` / ``hi_open`` exclude the bound itself: ``check_float("lr", v, 0.0,
    lo_open=True)`` accepts any finite ``v > 0``.
    """
    where = "" if lo is None and hi is None else " in " + _bounds(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number{where}, got {show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"{name} must be a finite number{where}, got {show(value)}") from None
    bad = (
        not math.isfinite(number)
        or (lo is not None and (number <= lo if lo_open else number < lo))
        or (hi is not None and (number >= hi if hi_open else number > hi))
    )
    if bad:
        raise ValueError(f"{name} must be a finite number{where}, got {show(value)}")
    return number


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {show(value)}")
    return value


def check_str(
    name: str,
    value: Any,
    *,
    choices: Sequence[str] | None = None,
    max_len: int = 4096,
) -> str:
    """``value`` if it is a string (one of ``choices``, when given) of at most ``max_len``."""
    if choices is not None:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, "
                             f"got {show(value)}")
        return value
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise ValueError(f"{name} must be a non-empty string of at most {max_len} characters, "
                         f"got {show(value)}")
    return value


def check_sha256(name: str, value: Any) -> str:
    """``value`` if it is a SHA-256 digest: 64 lower-case hexadecimal digits."""
    if not (isinstance(value, str) and len(value) == 64
            and all(c in "0123456789abcdef" for c in value)):
        raise ValueError(f"{name} must be a SHA-256 digest (64 lower-case hex digits), "
                         f"got {show(value)}")
    return value


def fields_from_dict(cls: type, d: Any, what: str) -> dict[str, Any]:
    """``d`` as keyword arguments for the dataclass ``cls``: a JSON object whose keys are
    all fields of ``cls`` (missing ones take their defaults). ``what`` names it in errors."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be an object, got {show(d)}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((k for k in d if k not in known), key=str)
    if unknown:
        listed = ", ".join(show(k) for k in unknown[:5])
        raise ValueError(f"unknown {what} [{listed}]; valid: {sorted(known)}")
    return d


def small_divisors(n: int, count: int = 8) -> list[int]:
    """The ``count`` smallest divisors of ``n >= 1`` in ``O(sqrt(n))`` steps: suggestions
    for an error message about a width that a config may have set to two billion."""
    low, high = [], []
    d = 1
    while d * d <= n and len(low) < count:
        if n % d == 0:
            low.append(d)
            if d * d != n:
                high.append(n // d)
        d += 1
    # Stopping early leaves `count` divisors in `low`, all smaller than any in `high`.
    return sorted(set(low + high))[:count]


def check_positive_int(name: str, value: Any, what: str = "integer") -> None:
    """Raise a one-line error unless ``value`` is an ``int`` >= 1 (a size, a count).

    ``TypeError`` for a value that is not an integer (``2.0``, ``True``, a tensor),
    ``ValueError`` for zero or a negative one. ``what`` names the unit in the message.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive {what}, got {value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"{name} must be a positive {what}, got {value}")


def check_heads(d_out: int, num_heads: int, name: str = "d_out") -> None:
    """Raise a one-line error unless ``d_out`` (called ``name``) splits into ``num_heads``."""
    check_positive_int(name, d_out)
    check_positive_int("num_heads", num_heads)
    if d_out % num_heads != 0:
        raise ValueError(
            f"{name} ({d_out}) must be divisible by num_heads ({num_heads}); "
            f"e.g. num_heads in {small_divisors(d_out)}"
        )


def check_dropout(p: float) -> None:
    """Raise a one-line error unless ``p`` is a probability that leaves something to keep."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(
            f"dropout must be a probability in [0, 1), got {p!r} of type {type(p).__name__}"
        )
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {p}")


def _nesting_exceeds(obj: Any, limit: int) -> bool:
    """Whether JSON-like ``obj`` nests containers more than ``limit`` levels (no recursion)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(
            node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(data)``, with every way hostile JSON fails as a one-line ValueError.

    Python's parser turns ``1e400`` into ``inf`` and accepts ``NaN`` (each field's
    validator refuses those), refuses integers of more than 4,300 digits with a
    ValueError and deep nesting with a RecursionError. Nesting deeper than
    ``max_depth`` is refused whether or not the parser got that far, so that no later
    walk over the result can recurse too deeply either.
    """
    too_deep = f"JSON nested more than {max_depth} levels deep (the most qkv reads)"
    try:
        obj = json.loads(data)
    except RecursionError:
        raise ValueError(too_deep) from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, 4,300-digit ints
        raise ValueError(f"invalid JSON ({' '.join(str(error).splitlines())})") from None
    if _nesting_exceeds(obj, max_depth):
        raise ValueError(too_deep)
    return obj


def check_threads(value: Any, name: str = "threads") -> int:
    """``value`` if it is a thread count in ``[1, MAX_THREADS]``; else one ``ValueError``
    line with the limit and its reason."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_THREADS:,}], got "
                         f"{show(value)} (each is an OS thread; past the machine's cores more "
                         "only slow torch down)")
    return value
