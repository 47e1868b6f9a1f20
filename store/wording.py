"""Words and numbers as the packages' messages print them, shared by decoder/, trainer/ and
daemon/ (all of which may import store/)."""

from __future__ import annotations


def requests(n: int) -> str:
    """``n`` with "request" or "requests": ``requests(1) == "1 request"``, ``requests(3) == "3 requests"``."""
    return f"{n} request" if n == 1 else f"{n} requests"


def percent(fraction: float) -> str:
    """``fraction`` (0.95) as the number of a percentage, without the sign (``"95"``; ``"97.5"``
    for 0.975): up to six significant digits, and a fraction below 1 never reads as 100 (a
    confidence of 0.999999999999999 is ``">99.9999"``: true of anything that rounds to 100)."""
    s = f"{fraction * 100:.6g}"
    if fraction < 1 and float(s) >= 100:
        return ">99.9999"
    if "e" in s:  # a tiny or huge fraction: fixed notation, never 1e-07 (nor -0)
        s = f"{fraction * 100:.6f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def signed(x: float, places: int = 4) -> str:
    """``x`` with its sign to ``places`` decimals (``signed(0.0534) == "+0.0534"``), as an
    interval's bound is printed, except where that would print a bound as zero that is not:
    exactly 0 is ``"0"`` (no sign, no decimals: it is no rounding of something above 0), and a
    nonzero ``x`` that rounds to zero keeps two significant digits in fixed notation
    (``signed(3.2e-05) == "+0.000032"``, ``signed(-4e-07) == "-0.00000040"``). NaN is ``"nan"``."""
    if x != x:
        return "nan"
    if x == 0:
        return "0"
    s = f"{x:+.{places}f}"
    if float(s) != 0:
        return s
    import math

    return f"{x:+.{max(places, 1 - math.floor(math.log10(abs(x))))}f}"
