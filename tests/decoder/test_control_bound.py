"""The goodput controller speculates only where the lower confidence bound of its rate over plain
decoding's is above 1 (ControllerConfig.confidence), not on a point estimate ahead by noise: an
n-gram pick priced at 1.11x plain from 4 requests ran at 0.87x on never-served prompts
(docs/walkthroughs.md, the run at 5e6c1fe).

Every expected value is computed by hand from the injected steps: the standard errors with
``statistics`` on the same numbers, the bound as ratio x exp(-z rse), z = NormalDist's quantile.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

import pytest

from decoder.control import ControllerConfig, GoodputController, _Clusters, _Ewma
from decoder.metrics import StepStats

KEY = ("extract", "greedy")
Z95 = NormalDist().inv_cdf(0.95)


def test_the_standard_error_of_a_plain_mean_is_the_sample_sd_over_root_n():
    xs = [10.0, 12.0, 9.0, 15.0, 11.0]
    e = _Ewma()
    for k, x in enumerate(xs, start=1):
        e.add(x, 1.0 / k)  # weights 1, 1/2, 1/3, ...: the running plain mean
    assert e.value == pytest.approx(statistics.fmean(xs))
    assert e.se() == pytest.approx(statistics.stdev(xs) / math.sqrt(len(xs)))
    assert e.rel_se() == pytest.approx(e.se() / statistics.fmean(xs))
    one = _Ewma()
    one.add(3.0, 0.1)
    assert one.se() == math.inf  # one reading says nothing of its spread


def test_an_ewma_s_standard_error_counts_its_weights_not_its_inputs():
    # w = 0.5 on 10 alternating readings: sum of squared weights and the weighted variance by hand
    xs = [1.0, 3.0] * 5
    e = _Ewma()
    for x in xs:
        e.add(x, 0.5)
    ws = [0.5 ** (len(xs) - 1)] + [0.5 * 0.5 ** (len(xs) - 1 - i) for i in range(1, len(xs))]
    assert sum(ws) == pytest.approx(1.0)
    mean = sum(w * x for w, x in zip(ws, xs))
    sw2 = sum(w * w for w in ws)
    var = sum(w * (x - mean) ** 2 for w, x in zip(ws, xs))
    assert e.value == pytest.approx(mean)
    assert e.se() == pytest.approx(math.sqrt(var / (1 - sw2) * sw2))


def test_clusters_give_the_spread_between_requests_not_between_steps():
    c = _Clusters(keep=3)
    for req, tokens in (("a", [2, 2, 2, 2]), ("b", [1, 1]), ("c", [4, 2]), ("d", [3, 3, 3])):
        for t in tokens:
            c.add(req, t)
    means = [1.0, 3.0, 3.0]  # "a" fell out of the last 3
    assert c.count() == 3
    assert c.rel_se() == pytest.approx(statistics.stdev(means) / math.sqrt(3) / statistics.fmean(means))
    single = _Clusters()
    single.add("x", 2.0)
    assert single.rel_se() == math.inf


def _serve(ctl: GoodputController, requests: int, *, plain_ms=10.0, step_ms=12.0, steps=10):
    """``requests`` n-gram requests at γ = 1 whose steps cost ``step_ms`` (its proposals free), the
    odd ones accepting every proposal and the even ones none, and plain steps of ``plain_ms``;
    returns the per-request tokens per step."""
    per = []
    for r in range(requests):
        acc = 1 if r % 2 else 0
        for i in range(steps):
            ctl.observe(KEY, StepStats(1, acc, acc + 1, -1 if acc else 0, 0.0, 0.0, step_ms), proposer="ngram",
                        asked=1, first=i == 0, request=("r", r))
            ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, plain_ms), proposer="ngram", asked=0)
        per.append(1.0 + acc)
    return per


def _lower_by_hand(d: dict, per: list[float]) -> tuple[float, float]:
    """(point ratio, its one-sided 95 % lower bound) of the decision's best n-gram rate over plain,
    the bound from the per-request spread alone (the costs are exact, their errors 0)."""
    rates = {int(g): r for g, r in d["tokens_per_ms_by_proposer"]["ngram"].items()}
    top = max(rates.values())
    ratio = top / d["tokens_per_ms"][0]
    rse = statistics.stdev(per) / math.sqrt(len(per)) / statistics.fmean(per)
    return ratio, ratio * math.exp(-Z95 * rse)


def test_a_pick_ahead_on_four_requests_waits_for_its_bound_and_serves_once_measured_enough():
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    per = _serve(ctl, 4)
    d = ctl.decision(KEY)
    ratio, low = _lower_by_hand(d, per)
    assert ratio > 1.05  # the point estimate alone would speculate (the 5 % margin)
    assert low < 1.0 and d["gamma"] == 0
    assert f"lower bound of that ratio is {low:.2f}x" in d["why"]
    # the same spread over 32 requests: the bound clears 1 and the n-gram serves
    ctl32 = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    per32 = _serve(ctl32, 32)
    d32 = ctl32.decision(KEY)
    ratio32, low32 = _lower_by_hand(d32, per32)
    assert low32 > 1.0 and d32["gamma"] >= 1 and d32["proposer"] == "ngram"
    # confidence 0.5 (z = 0) is the point estimate alone: the 4-request case speculates
    loose = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1, confidence=0.5))
    _serve(loose, 4)
    assert loose.decision(KEY)["gamma"] >= 1


def test_noisy_step_costs_widen_the_bound_too():
    # every request accepts alike, every other proposal (no spread of tokens per step between
    # requests: 1.5 each), but the n-gram's steps cost 4 or 20 ms in turn: 12 ms on average, about
    # 1.25x plain's 0.1 tokens per ms, with a standard error of its own
    def run(cfg):
        ctl = GoodputController(cfg)
        for r in range(4):
            for i in range(6):
                acc = i % 2
                ctl.observe(KEY, StepStats(1, acc, acc + 1, -1 if acc else 0, 0.0, 0.0, 4.0 if i % 2 else 20.0),
                            proposer="ngram", asked=1, first=i == 0, request=r)
                ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0), proposer="ngram", asked=0)
        return ctl.decision(KEY)
    exact = run(ControllerConfig(proposers=("ngram",), min_steps=1, ewma=0.5))
    assert exact["gamma"] == 0 and "lower bound" in exact["why"]
    assert run(ControllerConfig(proposers=("ngram",), min_steps=1, ewma=0.5, confidence=0.5))["gamma"] >= 1


@pytest.mark.parametrize("bad", [0.3, 1.0, True, "0.9", float("nan")])
def test_confidence_must_be_a_fraction_from_one_half(bad):
    with pytest.raises(ValueError, match="confidence=.*must lie in \\[0.5, 1\\)"):
        ControllerConfig(confidence=bad)


def test_a_candidate_ahead_but_unsure_is_measured_every_other_request_until_its_window_is_full():
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    _serve(ctl, 4)
    picks = [ctl._choose(KEY)[1] for _ in range(4)]  # requests 1..4 of the key
    assert [p["gamma"] > 0 for p in picks] == [False, True, False, True]
    assert picks[1]["probe"] and picks[1]["proposer"] == "ngram"
    assert "not yet beyond its confidence bound" in picks[1]["why"] and "(4 requests so far)" in picks[1]["why"]
    # a full window (32 requests) whose bound still does not clear plain: back to probe_every
    full = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    _serve(full, 32, step_ms=14.0)  # 1.5 / 14 = 0.107 tokens per ms: 1.07x plain, inside its bound
    d = full.decision(KEY)
    assert d["gamma"] == 0 and "lower bound" in d["why"]
    assert [full._choose(KEY)[1]["gamma"] for _ in range(4)] == [0, 0, 0, 0]
