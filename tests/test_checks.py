"""qkv.checks: one-line messages that show the value and say what is valid."""

import pytest

from qkv.checks import (
    check_bool,
    check_float,
    check_int,
    check_sha256,
    check_str,
    show,
    small_divisors,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [(3, "3"), (-2**64, str(-2**64)), (10**400, "an integer of about 401 digits"),
     (-(10**5000), "-an integer of about 5001 digits"), (float("nan"), "nan"),
     (True, "True"), (None, "None"), ("a\nb", "'a\\nb'"), ("x" * 100, "'" + "x" * 35 + "...'"),
     ([1, 2, 3], "a list of 3 item(s)"), ({"a": 1}, "an object with 1 key(s)")],
    ids=lambda value: type(value).__name__,  # repr would fail on a 5,001-digit integer
)
def test_show_is_short_and_one_line(value, text):
    assert show(value) == text


def test_check_int():
    assert check_int("n", 5, 1, 9) == 5
    for bad in (0, 10, True, 5.0, "5", None, 10**400):
        with pytest.raises(ValueError, match=r"^n must be an integer in \[1, 9\], got ") as e:
            check_int("n", bad, 1, 9)
        assert "\n" not in str(e.value)


def test_check_float():
    assert check_float("p", 1, 0.0, 1.0) == 1.0 and isinstance(check_float("p", 1), float)
    assert check_float("lr", 1e-300, 0.0, lo_open=True) == 1e-300
    for bad, bounds in ((0.0, r"\(0.0, inf\)"), (float("inf"), r"\(0.0, inf\)"),
                        (float("nan"), r"\(0.0, inf\)"), (10**400, r"\(0.0, inf\)"),
                        (False, r"\(0.0, inf\)"), ("1", r"\(0.0, inf\)")):
        with pytest.raises(ValueError, match=f"^lr must be a finite number in {bounds}, got "):
            check_float("lr", bad, 0.0, lo_open=True)
    with pytest.raises(ValueError, match=r"in \[0.0, 1.0\), got 1.0"):
        check_float("beta", 1.0, 0.0, 1.0, hi_open=True)
    with pytest.raises(ValueError, match="^x must be a finite number, got nan$"):
        check_float("x", float("nan"))


def test_check_bool_str_sha256():
    assert check_bool("b", False) is False
    with pytest.raises(ValueError, match="b must be true or false, got 0"):
        check_bool("b", 0)
    assert check_str("s", "bytes", choices=("gpt2", "bytes")) == "bytes"
    with pytest.raises(ValueError, match="s must be one of 'gpt2', 'bytes', got None"):
        check_str("s", None, choices=("gpt2", "bytes"))
    with pytest.raises(ValueError, match="at most 3 characters, got 'abcd'"):
        check_str("s", "abcd", max_len=3)
    with pytest.raises(ValueError, match="non-empty string"):
        check_str("s", "")
    assert check_sha256("h", "a" * 64) == "a" * 64
    for bad in ("A" * 64, "a" * 63, 5, "g" * 64):
        with pytest.raises(ValueError, match="SHA-256 digest"):
            check_sha256("h", bad)


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 1024, 3 * 5 * 7 * 11 * 13])
def test_small_divisors(n):
    assert small_divisors(n) == [d for d in range(1, n + 1) if n % d == 0][:8]
