"""The goodput controller speculates only where the lower confidence bound of its rate over plain
decoding's is above 1 (ControllerConfig.confidence), not on a point estimate ahead by noise: an
n-gram pick priced at 1.11x plain from 4 requests ran at 0.87x on never-served prompts
(docs/walkthroughs.md, the run at 5e6c1fe).

Every expected value is computed by hand from the injected steps: the standard errors with
``statistics`` on the same numbers, the bound as ratio x exp(-t sd / sqrt(k) / mean) for k
requests, t Student's one-sided 95 % quantile at k - 1 degrees of freedom from the printed table.
"""

from __future__ import annotations

import math
import re
import statistics
from statistics import NormalDist

import pytest

from decoder.control import DRAFT, ControllerConfig, GoodputController, _Clusters, _Ewma, t_quantile
from decoder.metrics import StepStats

KEY = ("extract", "greedy")
Z95 = NormalDist().inv_cdf(0.95)
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 10: 1.812, 30: 1.697, 31: 1.696}  # one-sided 0.95


def test_t_quantiles_match_the_table():
    for df, t in T95.items():
        assert t_quantile(0.95, df) == pytest.approx(t, abs=0.002)
    assert t_quantile(0.975, 3) == pytest.approx(3.182, abs=0.005)
    assert t_quantile(0.5, 7) == 0.0
    for bad in ((0.95, 0), (0.4, 3), (1.0, 3)):
        with pytest.raises(ValueError, match="t_quantile"):
            t_quantile(*bad)


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
    # (accepted, asked) per step: a request's acceptance is its accepted over its asked proposals
    for req, steps in (("a", [(2, 2), (2, 2)]), ("b", [(0, 3), (1, 1)]), ("c", [(4, 4), (1, 4)]),
                       ("d", [(3, 4), (3, 4), (9, 4)])):
        for acc, asked in steps:
            c.add(req, acc, asked)
    means = [1 / 4, 5 / 8, 10 / 12]  # "a" fell out of the last 3; d's 9 of 4 counts as 4
    assert c.count() == 3
    assert c.rel_se() == pytest.approx(statistics.stdev(means) / math.sqrt(3) / statistics.fmean(means))
    single = _Clusters()
    single.add("x", 2.0, 3)
    assert single.rel_se() == math.inf


def _serve(ctl: GoodputController, requests: int, *, plain_ms=10.0, step_ms=13.0, steps=10):
    """``requests`` n-gram requests at γ = 1 whose steps cost ``step_ms`` (its proposals free), the
    odd ones accepting every proposal and the even ones none, and plain steps of ``plain_ms``;
    returns the per-request acceptance (accepted / asked)."""
    per = []
    for r in range(requests):
        acc = 1 if r % 2 else 0
        for i in range(steps):
            ctl.observe(KEY, StepStats(1, acc, acc + 1, -1 if acc else 0, 0.0, 0.0, step_ms), proposer="ngram",
                        asked=1, first=i == 0, request=("r", r))
            ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, plain_ms), proposer="ngram", asked=0)
        per.append(float(acc))
    return per


def _lower_by_hand(d: dict, per: list[float], step_ms: float = 13.0) -> tuple[float, float]:
    """(point ratio, its one-sided 95 % lower bound) of the decision's best n-gram rate (γ = 1)
    over plain, the bound from the per-request spread of acceptance alone (the costs are exact,
    their errors 0): the accepted part E - 1 of E tokens per step carries it."""
    rates = {int(g): r for g, r in d["tokens_per_ms_by_proposer"]["ngram"].items()}
    assert max(rates, key=rates.get) == 1
    ratio = rates[1] / d["tokens_per_ms"][0]
    e = rates[1] * step_ms  # tokens per γ = 1 step
    rse = statistics.stdev(per) / math.sqrt(len(per)) / statistics.fmean(per) * (e - 1) / e
    return ratio, ratio * math.exp(-T95[len(per) - 1] * rse)


def test_a_pick_ahead_on_four_requests_waits_for_its_bound_and_serves_once_measured_enough():
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    per = _serve(ctl, 4)
    d = ctl.decision(KEY)
    ratio, low = _lower_by_hand(d, per)
    assert ratio > 1.05  # the point estimate alone would speculate (the 5 % margin)
    assert low < 1.0 and d["gamma"] == 0
    shown = float(re.search(r"lower bound of that ratio is ([0-9.]+)x", d["why"]).group(1))
    assert shown == pytest.approx(low, abs=0.011) and "4 requests measured" in d["why"]
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
    _serve(full, 32, step_ms=14.0)  # about 1.5 / 14 = 0.107 tokens per ms: 1.07x plain, inside its bound
    d = full.decision(KEY)
    assert d["gamma"] == 0 and "lower bound" in d["why"]
    assert [full._choose(KEY)[1]["gamma"] for _ in range(4)] == [0, 0, 0, 0]


def test_an_unsure_candidate_is_probed_every_request_where_requests_are_for_measuring():
    """``unsure_probe_every=1`` (the demo's re-measurement): the same unsure n-gram as above is probed
    on every request, not every other; an invalid value is refused by name."""
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1, unsure_probe_every=1))
    _serve(ctl, 4)
    picks = [ctl._choose(KEY)[1] for _ in range(4)]
    assert [p["gamma"] > 0 and p["probe"] for p in picks] == [True, True, True, True]
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="unsure_probe_every="):
            ControllerConfig(unsure_probe_every=bad)


def test_a_lower_candidate_that_clears_its_bound_serves_when_the_top_one_is_unsure():
    # the draft: 2 requests, one accepting nothing and then one everything (highest estimate, no bound);
    # the n-gram: 12 requests alike, 1.5 tokens per 14 ms step against plain's 1 per 10 ms: 1.07x, exact
    ctl = GoodputController(ControllerConfig(proposers=("ngram", DRAFT), min_steps=1))
    for r in range(12):
        for i in range(6):
            acc = i % 2
            ctl.observe(KEY, StepStats(1, acc, acc + 1, -1 if acc else 0, 0.0, 0.0, 14.0), proposer="ngram", asked=1,
                        first=i == 0, request=("n", r))
            ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0), proposer="ngram", asked=0)
    for r, a in enumerate((0.0, 1.0)):
        for i in range(6 if a == 0 else 30):
            acc = 4 if a else 0
            ctl.observe(KEY, StepStats(4, acc, acc + 1, -1 if acc else 0, 4 * a, 0.5, 26.0), proposer=DRAFT,
                        first=i == 0, request=("d", r))
    d = ctl.decision(KEY)
    rates = d["tokens_per_ms_by_proposer"]
    assert max(d["tokens_per_ms"][g] for g in range(1, 9)) > max(rates["ngram"].values())  # the draft looks best
    assert d["proposer"] == "ngram" and d["gamma"] == 1
    assert rates["ngram"][1] == pytest.approx(1.5 / 14, rel=1e-3)


def test_ewma_1_with_a_bound_is_refused_and_huge_readings_do_not_break_the_key():
    with pytest.raises(ValueError, match="ewma=1 keeps only the last reading"):
        ControllerConfig(ewma=1.0)
    assert ControllerConfig(ewma=1.0, confidence=0.5).ewma == 1.0
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 1e200), proposer="ngram", asked=0)
    _serve(ctl, 3)
    assert ctl.decision(KEY)["gamma"] is not None and ctl._choose(KEY)[0] >= 0


def test_a_bound_below_one_hundredth_says_there_is_none_yet_not_0_00x():
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    ev = {"rel_se": {("ngram", 1): 5.0, ("plain", 0): 0.0}, "requests_measured": {"ngram": 2}}
    why = ctl._unsure(("ngram", 1), 0.2, 0.1, ev)  # 2.0x, bound 2 exp(-1.645 x 5) = 0.0005x
    assert "lower bound of that ratio is below 0.01x, i.e. none yet (2 requests measured" in why, why
    assert "0.00x" not in why
    ev["rel_se"][("ngram", 1)] = 0.1  # 2 exp(-0.1645) = 1.70x
    assert "lower bound of that ratio is 1.70x" in ctl._unsure(("ngram", 1), 0.2, 0.1, ev)


def test_a_bound_just_below_one_is_not_printed_as_one():
    """A walkthrough read "the 95 % lower bound of that ratio is 1.00x" as a bound at 1, not short of it."""
    import math

    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    z = 1.6448536269514722  # the one-sided 95 % normal quantile
    rse = math.log(2 / 0.997) / z  # ratio 2.0, so the bound is 2 exp(-z rse) = 0.997
    ev = {"rel_se": {("ngram", 1): rse, ("plain", 0): 0.0}, "requests_measured": {"ngram": 7}}
    why = ctl._unsure(("ngram", 1), 0.2, 0.1, ev)
    assert "lower bound of that ratio is 0.997x" in why and "1.00x" not in why, why
    ev["rel_se"][("ngram", 1)] = math.log(2 / 1.004) / z  # above 1: two places, as before
    assert "lower bound of that ratio is 1.00x" in ctl._unsure(("ngram", 1), 0.2, 0.1, ev)


@pytest.mark.parametrize("last", ["copy", "none"])
def test_a_gated_proposer_is_priced_by_the_tokens_and_ms_of_the_same_steps(last):
    # A gated n-gram proposer asked for γ = 4: a copying request runs one plain-like step (no match
    # yet: 1 token, 10 ms) then 12 steps of 4 accepted (5 tokens, 20 ms); a request with no match
    # runs 64 plain-like steps (1 token, 10 ms). Its true rate is the tokens over the ms of all
    # those steps, whichever request came last (the costs once followed the last few steps alone,
    # and a last request with no match priced the proposer at its plain step's cost).
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    copy = [(0, 10.0)] + [(4, 20.0)] * 12
    none = [(0, 10.0)] * 64
    order = [copy, none] * 4 if last == "none" else [none, copy] * 4
    tokens = ms = 0.0
    for r, steps in enumerate(order):
        for i, (acc, step_ms) in enumerate(steps):
            ctl.observe(KEY, StepStats(acc, acc, acc + 1, -1, 0.0, 0.0, step_ms), proposer="ngram", asked=4,
                        first=i == 0, request=("r", r))
            tokens, ms = tokens + acc + 1, ms + step_ms
    truth = tokens / ms  # (4 x 61 + 4 x 64) / (4 x 250 + 4 x 640) tokens per ms
    assert truth == pytest.approx(500 / 3560)
    rate = ctl.decision(KEY)["tokens_per_ms_by_proposer"]["ngram"]
    assert float(rate[4]) == pytest.approx(truth, rel=0.01)


def _lower_by_ratio(per: list[tuple[float, float]], plain_ms: float) -> tuple[float, float]:
    """(point ratio over plain, its one-sided 95 % lower bound) from per-request (tokens, ms), requests
    as the units: R = Σt / Σm, se(R) = sqrt(Σ (t - R m)^2 / (k (k - 1))) / mean(m)."""
    k = len(per)
    tt, mm = sum(t for t, _ in per), sum(m for _, m in per)
    r = tt / mm
    se = math.sqrt(sum((t - r * m) ** 2 for t, m in per) / (k * (k - 1))) / (mm / k)
    ratio = r * plain_ms
    return ratio, ratio * math.exp(-T95[k - 1] * se / r)


@pytest.mark.parametrize("requests", [4, 32])
def test_step_costs_that_differ_between_requests_widen_the_bound_by_requests_not_steps(requests):
    # every proposal accepted (2 tokens a γ = 1 step), but a request's steps all cost 14 ms or all 22 ms
    # (say the host was busy during every other request): 1.11x plain on average. Per step the costs
    # look well measured (40 steps); per request, 4 requests cannot tell 1.11x from plain, 32 can.
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    per = []
    for r in range(requests):
        step_ms = 22.0 if r % 2 else 14.0
        for i in range(10):
            ctl.observe(KEY, StepStats(1, 1, 2, -1, 0.0, 0.0, step_ms), proposer="ngram", asked=1,
                        first=i == 0, request=("r", r))
            ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0), proposer="ngram", asked=0)
        per.append((20.0, 10 * step_ms))
    ratio, low = _lower_by_ratio(per, 10.0)
    assert ratio == pytest.approx(2 / 18 * 10)
    d = ctl.decision(KEY)
    if requests == 4:
        assert low < 1.0 and d["gamma"] == 0
        shown = float(re.search(r"lower bound of that ratio is ([0-9.]+)x", d["why"]).group(1))
        assert shown == pytest.approx(low, abs=0.011)
    else:
        assert low > 1.0 and d["proposer"] == "ngram" and d["gamma"] == 1


def _draft_requests(ctl, n, start=0, alpha=0.75):
    for r in range(start, start + n):
        for i in range(8):
            ctl.observe(KEY, StepStats(4, 3, 4, 3, 4 * alpha, 1.0, 12.0), proposer=DRAFT, first=i == 0, request=("d", r))
        ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0), proposer=DRAFT)


@pytest.mark.parametrize("broken", [
    StepStats(4, 3, 4, 3, float("nan"), 1.0, 12.0),  # a NaN α
    StepStats(4, 3, 4, 3, 3.0, 1.0, 0.0),  # a forward of 0 ms
    StepStats(4, 3, 4, 3, 3.0, 1.0, -5.0),  # a clock that went back
    StepStats(4, 3, 4, 3, 3.0, float("inf"), 12.0),
])
def test_a_broken_reading_is_dropped_not_learnt(broken):
    # the adversarial helper's: one NaN α turned the draft off for 32 requests; a 0 ms step priced a γ at
    # 5,000,000 tokens per ms
    clean, hit = (GoodputController(ControllerConfig(min_steps=1)) for _ in range(2))
    _draft_requests(clean, 20)
    _draft_requests(hit, 20)
    hit.observe(KEY, broken, proposer=DRAFT, first=True, request=("bad", 0))
    _draft_requests(clean, 20, start=20)
    _draft_requests(hit, 20, start=20)
    a, b = clean.decision(KEY), hit.decision(KEY)
    assert a["tokens_per_ms"] == b["tokens_per_ms"] and (a["gamma"], a["why"]) == (b["gamma"], b["why"])


def test_an_alpha_sum_beyond_its_proposals_counts_as_all_accepted():
    ctl = GoodputController(ControllerConfig(min_steps=1))
    ctl.observe(KEY, StepStats(4, 4, 5, -1, 4e9, 1.0, 12.0), proposer=DRAFT, first=True, request=1)
    assert ctl.decision(KEY)["alpha"] == 1.0


@pytest.mark.parametrize("kw, name", [(dict(useless_alpha=-1), "useless_alpha"), (dict(useless_alpha=2), "useless_alpha"),
                                      (dict(useless_alpha=float("nan")), "useless_alpha"), (dict(gamma_max=1.5), "gamma_max"),
                                      (dict(gamma_max="8"), "gamma_max"), (dict(gamma_init=0), "gamma_init"),
                                      (dict(gamma_init=2.0), "gamma_init")])
def test_a_bad_controller_setting_names_itself(kw, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        ControllerConfig(**kw)


def test_an_ngram_probe_measures_its_whole_request_and_a_draft_probe_its_first_steps():
    # the walkthrough at 79fed52: math's n-gram, measured on its probes' first min_steps steps (an answer's
    # start copies the question), was priced at 1.48x plain and ran 0.98x
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=2))
    _serve(ctl, 4)  # ahead of plain but unsure: every other request probes it
    ctl.policy_for(KEY).gamma()  # a plain request
    probe = ctl.policy_for(KEY)
    gammas = []
    for i in range(10):
        gammas.append(probe.gamma())
        probe.update(StepStats(gammas[-1], 0, 1, 0 if gammas[-1] else -1, 0.0, 0.0, 13.0 if gammas[-1] else 10.0))
    assert probe.decision["probe"] and probe.decision["proposer"] == "ngram"
    assert gammas == [gammas[0]] * 10 and gammas[0] >= 1  # not plain after min_steps steps
    # the draft's warm-up still moves on after min_steps steps (a whole request of a draft plain beats is slow)
    d = GoodputController(ControllerConfig(min_steps=2))
    pol = d.policy_for(KEY)
    seen = []
    for i in range(6):
        seen.append(pol.gamma())
        pol.update(StepStats(seen[-1], 0, 1, 0 if seen[-1] else -1, 0.0, 1.0 * seen[-1], 12.0))
    assert seen[:2] == [seen[0]] * 2 and seen[0] >= 1 and seen[2] == 0


def test_a_measured_gamma_is_priced_on_its_own_steps_tokens():
    # the walkthrough at 2eab659: prose's gated n-gram at γ = 1 priced 1.19x plain on the accepted lengths of
    # its γ = 4 steps (its gate proposes long copies there, rarely a lone token at γ = 1), ran 0.958x
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1))
    for r in range(6):
        for i in range(10):  # γ = 4: a 4-token copy every other step (5 tokens in 20 ms), else a plain step
            acc = 4 if i % 2 else 0
            ctl.observe(KEY, StepStats(acc, acc, acc + 1, -1, 0.0, 0.0, 20.0 if acc else 10.0), proposer="ngram",
                        asked=4, first=i == 0, request=("a", r))
        for i in range(10):  # γ = 1: the gate proposes one token once in 5 steps, and it is right
            acc = 1 if i % 5 == 0 else 0
            ctl.observe(KEY, StepStats(acc, acc, acc + 1, -1, 0.0, 0.0, 17.0 if acc else 10.0), proposer="ngram",
                        asked=1, first=False, request=("a", r))
    rates = ctl.decision(KEY)["tokens_per_ms_by_proposer"]["ngram"]
    assert float(rates[1]) == pytest.approx((2 * 2 + 8 * 1) / (2 * 17.0 + 8 * 10.0), rel=1e-3)  # 12 / 114
    assert float(rates[4]) == pytest.approx((5 * 5 + 5 * 1) / (5 * 20.0 + 5 * 10.0), rel=1e-3)  # 30 / 150


def test_a_confidence_below_one_is_never_printed_as_100_percent():
    """``confidence=0.999999999999999`` printed "the 100 % lower bound" (``:g`` rounds it up)."""
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1, confidence=0.999999999999999))
    ev = {"rel_se": {("ngram", 1): 0.1, ("plain", 0): 0.0}, "requests_measured": {"ngram": 2}}
    why = ctl._unsure(("ngram", 1), 0.2, 0.1, ev)
    assert "100 %" not in why and "the >99.9999 % lower bound" in why, why
