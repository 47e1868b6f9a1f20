"""Page-Hinkley drop detection on hand-made α sequences, and the prompt-feature workload key."""

import random

import pytest

from decoder.shift import PageHinkley, ShiftConfig, ShiftDetector, expected_drop_requests, infer_workload


def _noisy(level: float, n: int, seed: int, sd: float = 0.08) -> list[float]:
    rng = random.Random(seed)
    return [min(1.0, max(0.0, rng.gauss(level, sd))) for _ in range(n)]


def test_flags_a_real_drop_soon_after_it_happens():
    det = ShiftDetector(ShiftConfig(delta=0.05, lam=1.0, min_samples=10))
    before, after = _noisy(0.75, 60, seed=1), _noisy(0.35, 30, seed=2)
    flagged = [i for i, a in enumerate(before + after) if det.update(("code", "greedy"), a)]
    assert flagged, "a drop of 0.4 in α was not flagged"
    assert 60 <= flagged[0] <= 60 + 8  # λ / (d - δ) ≈ 3 requests, plus the running mean's lag
    alarm = det.alarms[0]
    assert alarm.key == ("code", "greedy")
    assert alarm.recent_alpha < 0.5 < alarm.reference_alpha


def test_stationary_sequences_raise_no_alarm():
    det = ShiftDetector()
    for seed, level in enumerate((0.9, 0.6, 0.3, 0.05)):
        for a in _noisy(level, 1000, seed=10 + seed):
            assert det.update(("prose", "greedy", level), a) is None
    assert det.alarms == []


def test_an_increase_is_not_a_drop_and_keys_are_independent():
    det = ShiftDetector(ShiftConfig(min_samples=5))
    for a in _noisy(0.2, 30, seed=3) + _noisy(0.9, 30, seed=4):
        assert det.update("math", a) is None
    for a in _noisy(0.8, 20, seed=5):
        det.update("prose", a)
    assert det.update("math", float("nan")) is None  # a request without proposals carries no α
    assert set(det.state()) == {"math", "prose"}


def test_no_alarm_before_min_samples_and_hand_computed_statistic():
    ph = PageHinkley(ShiftConfig(delta=0.0, lam=0.5, min_samples=3))
    # x = 1, 1, 0: means 1, 1, 2/3; m = 0, 0, -2/3; M = 0 -> statistic 2/3 > 0.5 at n = 3
    assert ph.update(1.0) is False and ph.update(1.0) is False
    assert ph.update(0.0) is True
    assert ph.statistic == pytest.approx(2 / 3)
    ph2 = PageHinkley(ShiftConfig(delta=0.0, lam=0.5, min_samples=4))
    assert [ph2.update(x) for x in (1.0, 1.0, 0.0)] == [False, False, False]
    assert expected_drop_requests(0.3, ShiftConfig(delta=0.05, lam=1.0)) == pytest.approx(4.0)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="lam=0"):
        ShiftConfig(lam=0)


@pytest.mark.parametrize(
    "text,want",
    [
        ("def add(a, b):\n    return a + b\n", "code"),
        ("import os\nprint(os.getcwd())", "code"),
        ("x = [f(i) for i in range(10)]; y = {k: v}; z = (x[0], y[1])", "code"),
        ("Natalia sold clips to 48 of her friends in April. How many clips did she sell?", "math"),
        ("Compute 17 * 23 and add 5.", "math"),
        ("The quick brown fox jumps over the lazy dog. It was a sunny day.", "prose"),
        ("In 1969, men landed on the moon.", "prose"),
        ("What is the capital of France?", "prose"),
    ],
)
def test_infer_workload(text, want):
    assert infer_workload(text) == want
