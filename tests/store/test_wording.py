"""store.wording: the shared plural and percentage of the packages' messages."""

from __future__ import annotations

import pytest

from store.wording import percent, requests


@pytest.mark.parametrize("n, text", [(0, "0 requests"), (1, "1 request"), (2, "2 requests")])
def test_requests_says_one_request_and_n_requests(n, text):
    assert requests(n) == text


@pytest.mark.parametrize("fraction, text", [(0.95, "95"), (0.975, "97.5"), (0.5, "50"), (0.9999, "99.99"),
                                            (0.999999999999999, ">99.9999"), (1 - 2 ** -53, ">99.9999"),
                                            (0.9999996, ">99.9999"), (1.0, "100")])
def test_a_fraction_below_one_never_reads_as_100_percent(fraction, text):
    """A confidence of 0.999999999999999 printed as "100 %" (``:g`` and ``round`` both round it up)."""
    assert percent(fraction) == text


@pytest.mark.parametrize("fraction, text", [(1e-9, "0"), (-0.0, "0"), (0.0, "0"), (1e-5, "0.001"),
                                            (1234.567, "123457")])
def test_a_percentage_is_never_in_exponent_notation(fraction, text):
    # the break session of the thirteenth: percent(1e-9) gave "1e-07", percent(-0.0) "-0"
    assert percent(fraction) == text


def test_the_plural_of_request_is_defined_once():
    """``_requests(n)`` was written twice (decoder/control.py and daemon/demo.py); both use
    store.wording.requests now."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    copies = [str(f.relative_to(root)) for pkg in ("store", "decoder", "trainer", "daemon")
              for f in sorted((root / pkg).rglob("*.py")) if re.search(r"^def _requests\(", f.read_text(), re.M)]
    assert copies == []
    import daemon.demo
    import decoder.control

    assert decoder.control._requests is requests and daemon.demo._requests is requests
