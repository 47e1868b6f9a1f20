"""Step costs by verified rows priced on the least-squares fit that never falls with more rows
(pool adjacent violators), not a running max: decoder.proposers.cost's isotonic_blocks,
monotone_fit and StepCost.ms. Every expected value below is worked by hand in its comment."""

import math

import pytest

from decoder.proposers.cost import StepCost, isotonic_blocks, monotone_fit


def _expand(blocks) -> list[float]:
    return [m for a, b, m in blocks for _ in range(a, b)]


def test_equal_weights_pool_a_falling_run_at_its_mean():
    # [10, 23, 15, 17]: 23 > 15 pools to (23 + 15) / 2 = 19; 19 > 17 pools to (23 + 15 + 17) / 3 = 55 / 3
    # = 18.333...; 10 < 18.33 stays. A running max would price 2, 3 and 4 rows at 23.
    blocks = isotonic_blocks([10, 23, 15, 17])
    assert [(a, b) for a, b, _ in blocks] == [(0, 1), (1, 4)]
    assert _expand(blocks) == pytest.approx([10.0, 55 / 3, 55 / 3, 55 / 3], abs=1e-12)


def test_a_pool_that_falls_below_the_block_before_merges_back():
    # [1, 5, 6, 2]: 6 > 2 pools to 4; then 5 > 4 pools (5 + 6 + 2) / 3 = 13 / 3 = 4.333; 1 < 4.33 stays
    assert _expand(isotonic_blocks([1, 5, 6, 2])) == pytest.approx([1.0, 13 / 3, 13 / 3, 13 / 3], abs=1e-12)


def test_weights_move_the_pooled_value_and_which_readings_pool():
    # weights [1, 3, 1, 1]: 23 (w 3) and 15 (w 1) pool to (3 x 23 + 15) / 4 = 84 / 4 = 21, above 17:
    # (84 + 17) / 5 = 101 / 5 = 20.2 for the last three (equal weights: 18.33)
    assert _expand(isotonic_blocks([10, 23, 15, 17], [1, 3, 1, 1])) == pytest.approx([10, 20.2, 20.2, 20.2], abs=1e-12)
    # weights [1, 1, 3, 1]: 23 and 15 (w 3) pool to (23 + 3 x 15) / 4 = 68 / 4 = 17, not above 17: the last
    # reading stays its own block
    blocks = isotonic_blocks([10, 23, 15, 17], [1, 1, 3, 1])
    assert [(a, b) for a, b, _ in blocks] == [(0, 1), (1, 3), (3, 4)]
    assert _expand(blocks) == pytest.approx([10, 17, 17, 17], abs=1e-12)


def test_monotone_readings_and_a_single_one_are_unchanged():
    assert isotonic_blocks([1.0, 2.0, 2.0, 5.0]) == [(0, 1, 1.0), (1, 2, 2.0), (2, 3, 2.0), (3, 4, 5.0)]
    assert isotonic_blocks([7.5]) == [(0, 1, 7.5)] and isotonic_blocks([7.5], [4]) == [(0, 1, 7.5)]
    assert isotonic_blocks([]) == []


def test_bad_values_and_weights_are_refused():
    with pytest.raises(ValueError):
        isotonic_blocks([1.0, math.nan])
    with pytest.raises(ValueError):
        isotonic_blocks([1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError):
        isotonic_blocks([1.0, 2.0], [1.0])


def test_monotone_fit_keys_by_rows_in_order_of_rows():
    # rows 1, 2, 3, 5 (4 unmeasured), given out of order: 3 rows' 32.20 below 2 rows' 32.60 pools at
    # (32.60 + 32.20) / 2 = 32.40; with 2 rows read 3 times and 3 rows once: (3 x 32.60 + 32.20) / 4 = 32.50
    costs = {5: 43.64, 1: 11.39, 3: 32.20, 2: 32.60}
    assert monotone_fit(costs) == pytest.approx({1: 11.39, 2: 32.40, 3: 32.40, 5: 43.64}, abs=1e-12)
    fit = monotone_fit(costs, {2: 3})  # rows missing from the weights weigh 1
    assert fit == pytest.approx({1: 11.39, 2: 32.50, 3: 32.50, 5: 43.64}, abs=1e-12)
    assert list(fit) == [1, 2, 3, 5] and monotone_fit({}) == {}


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.01
        return self.t


def test_step_cost_prices_on_the_fit_weighted_by_readings_and_reports_the_readings():
    # 5 plain steps of 10 ms: t(1) = 10. 2 rows: 3 steps of 15 ms (ratio 1.5 to their time's plain
    # steps), 3 rows: 1 step of 30 ms (3.0), 4 rows: 2 steps of 20 ms (2.0). As measured {1: 10, 2: 15,
    # 3: 30, 4: 20}; weights (readings) {1: 5, 2: 3, 3: 1, 4: 2}: 30 (w 1) and 20 (w 2) pool to
    # (30 + 2 x 20) / 3 = 70 / 3 = 23.33 (a running max: 30 for both; equal weights: 25).
    cost = StepCost(clock=_Clock())
    for _ in range(5):
        cost.add(1, 10.0)
    for rows, ms, k in ((2, 15.0, 3), (3, 30.0, 1), (4, 20.0, 2)):
        for _ in range(k):
            cost.add(rows, ms)
    assert cost.status() == {1: 10.0, 2: 15.0, 3: 30.0, 4: 20.0}
    assert [cost.ms(n) for n in (1, 2)] == [10.0, 15.0]
    assert cost.ms(3) == pytest.approx(70 / 3, abs=1e-9) and cost.ms(4) == pytest.approx(70 / 3, abs=1e-9)
    # 5 rows, beyond the largest: the least-squares line through the fitted multi-row costs (2, 15),
    # (3, 70/3), (4, 70/3): mean x 3, mean y (15 + 140/3) / 3 = 185/9, slope ((-1)(15 - 185/9) +
    # (+1)(70/3 - 185/9)) / 2 = (70/3 - 15) / 2 = 25/6; at 5: 185/9 + 2 x 25/6 = 260/9 = 28.89 (on the
    # readings as measured: 80/3 = 26.67)
    assert cost.ms(5) == pytest.approx(260 / 9, abs=1e-9)
    # the ceiling stays on the costs as measured (what a report keeps beside them): γ=1 2 x 10 / 15
    assert cost.ceiling(3)["by_gamma"] == {1: 1.333, 2: 1.0, 3: 2.0}
    # one more 4-row step at 20 ms: weights {3: 1, 4: 3}, (30 + 3 x 20) / 4 = 22.5 (the fit is recomputed)
    cost.add(4, 20.0)
    assert cost.ms(3) == pytest.approx(22.5, abs=1e-9) and cost.ms(4) == pytest.approx(22.5, abs=1e-9)
    cost.clear()
    assert math.isnan(cost.ms(3))
