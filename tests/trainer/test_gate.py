"""The promotion gate's evidence (trainer.gate.paired_gain) and the gate that reads it
(trainer.service.gate), on hand-worked numbers."""

from __future__ import annotations

import math

import pytest

from trainer.distill import EvalCounts, EvalResult
from trainer.gate import counts_by_record, paired_gain, paired_ratio_gain
from trainer.service import ServiceConfig, gate


def test_paired_gain_two_clusters_enumerated():
    # Cluster A = records r1, r2; cluster B = r3. Per cluster: A: Σ(after - before) = (5 - 3) + (1 - 1) = 2
    # over 15 positions; B: 3 - 4 = -1 over 10. Pooled: before (3 + 1 + 4) / 25 = 0.32, after 0.36,
    # gain 1 / 25 = 0.04. Resampling 2 clusters with replacement: AA (p 1/4) gives 4/30 = 0.1333,
    # AB or BA (1/2) gives 0.04, BB (1/4) gives -2/20 = -0.1; the 95 % percentile interval's ends
    # fall inside the BB and AA masses: [-0.1, 0.1333].
    before = {"r1": (3.0, 10), "r2": (1.0, 5), "r3": (4.0, 10)}
    after = {"r1": (5.0, 10), "r2": (1.0, 5), "r3": (3.0, 10)}
    pg = paired_gain(before, after, {"r1": "A", "r2": "A", "r3": "B"})
    assert (pg.clusters, pg.samples, pg.positions) == (2, 3, 25)
    assert pg.before == pytest.approx(0.32) and pg.after == pytest.approx(0.36) and pg.gain == pytest.approx(0.04)
    assert pg.low == pytest.approx(-0.1) and pg.high == pytest.approx(4 / 30)
    # The same records, each its own cluster: 3 clusters, and the interval is no longer the 2-cluster one.
    pg3 = paired_gain(before, after)
    assert pg3.clusters == 3 and pg3.gain == pytest.approx(0.04)
    assert pg3.low == pytest.approx(-0.1) and pg3.high == pytest.approx(0.2)  # r1 alone: 2 / 10


def test_paired_gain_pairs_only_comparable_records():
    before = {"a": (2.0, 4), "b": (1.0, 4), "only_before": (4.0, 4), "z": (0.0, 0)}
    after = {"a": (3.0, 4), "b": (1.0, 5), "only_after": (0.0, 4), "z": (0.0, 0)}
    pg = paired_gain(before, after)
    # b was scored on other positions, z on none: only "a" pairs. One cluster: the interval is the point.
    assert (pg.clusters, pg.samples, pg.positions) == (1, 1, 4)
    assert pg.gain == pytest.approx(0.25) and pg.low == pytest.approx(0.25) and pg.high == pytest.approx(0.25)


def test_paired_gain_same_ratio_everywhere_has_no_spread():
    # Every cluster gains 0.1 per position: every resample's Δ is 0.1.
    before = {f"r{i}": (0.5 * (i + 1), i + 1) for i in range(6)}
    after = {f"r{i}": (0.6 * (i + 1), i + 1) for i in range(6)}
    pg = paired_gain(before, after)
    assert pg.gain == pytest.approx(0.1) and pg.low == pytest.approx(0.1) and pg.high == pytest.approx(0.1)


def test_paired_gain_empty_and_bad_arguments():
    pg = paired_gain({}, {})
    assert pg.positions == 0 and all(math.isnan(x) for x in (pg.gain, pg.low, pg.high, pg.before))
    with pytest.raises(ValueError, match="confidence=1.5"):
        paired_gain({}, {}, confidence=1.5)
    with pytest.raises(ValueError, match="resamples=10"):
        paired_gain({}, {}, resamples=10)


def _eval(per: dict[str, list[float]], positions: int = 10, alpha_t1: dict[str, list[float]] | None = None) -> EvalResult:
    """One record (and prompt) per listed acceptance as served, ``positions`` positions each; α at
    T = 1 the same unless ``alpha_t1`` gives it."""
    r = EvalResult()
    for w, served in per.items():
        for i, a in enumerate(served):
            a1 = (alpha_t1 or {}).get(w, served)[i]
            r.add_sample(f"{w}-{i}", w, EvalCounts(1, positions, a1 * positions, 0, a * positions))
    return r


def test_gate_judges_acceptance_as_served_not_alpha_at_temperature_one():
    """Greedy traffic accepts where the argmaxes agree: a candidate whose T = 1 overlap rises while
    its greedy agreement falls is worse, and one whose agreement rises is promoted even if its
    T = 1 overlap falls."""
    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, regress_margin=0.02)
    before = _eval({"prose": [0.40] * 10}, alpha_t1={"prose": [0.50] * 10})
    v = gate(before, _eval({"prose": [0.35] * 10}, alpha_t1={"prose": [0.60] * 10}), {"prose"}, cfg)
    assert not v.promote and v.worse and v.evidence.gain == pytest.approx(-0.05)
    assert "prose 0.4000 -> 0.3500" in v.reason and "α at T=1 0.500 -> 0.600" in v.reason
    v = gate(before, _eval({"prose": [0.45] * 10}, alpha_t1={"prose": [0.48] * 10}), {"prose"}, cfg)
    assert v.promote and v.evidence.gain == pytest.approx(0.05), v.reason
    with pytest.raises(ValueError, match="metric='x'"):
        counts_by_record({}, metric="x")
    assert counts_by_record(before.per_sample, metric="alpha")["prose-0"] == pytest.approx((5.0, 10))
    assert counts_by_record(before.per_sample)["prose-0"] == pytest.approx((4.0, 10))


def test_gate_needs_evidence_and_a_positive_lower_bound():
    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, promote_margin=0.01,
                        regress_margin=0.02)
    before = _eval({"prose": [0.5] * 10, "code": [0.6] * 10})
    # +0.05 on every prose request: the interval is [0.05, 0.05]: promoted.
    v = gate(before, _eval({"prose": [0.55] * 10, "code": [0.6] * 10}), {"prose"}, cfg)
    assert v.promote and not v.worse, v.reason
    assert v.evidence.gain == pytest.approx(0.05) and v.evidence.low == pytest.approx(0.05)
    assert "95 % CI [+0.0500, +0.0500]" in v.reason
    # what it was promoted on, with its numbers (a walkthrough read the bare "lower bound > 0" after
    # the decoded interval as that interval's)
    assert v.reason.endswith(": promoted on acceptance as served, its gain +0.0500 >= promote_margin 0.01 and its "
                             "lower bound +0.0500 > 0; no workload regressed > 0.02"), v.reason
    # The same mean gain carried by one request of ten: +0.5 on one, 0 on the rest. The point gain
    # is 0.05 but 0.9^10 = 35 % of resamples miss that request, so the lower bound is 0: rejected.
    v = gate(before, _eval({"prose": [1.0] + [0.5] * 9, "code": [0.6] * 10}), {"prose"}, cfg)
    assert not v.promote and not v.worse and v.evidence.gain == pytest.approx(0.05)
    assert v.evidence.low == pytest.approx(0.0) and "lower bound is not above 0" in v.reason
    # A real gain on too few requests: not enough evidence, whatever its size.
    few = ServiceConfig(min_eval_samples=4, min_eval_requests=12, min_eval_positions=80)
    v = gate(before, _eval({"prose": [0.9] * 10, "code": [0.6] * 10}), {"prose"}, few)
    assert not v.promote and "not enough evidence" in v.reason and "10 requests, need min_eval_requests=12" in v.reason
    assert "min_eval_positions" not in v.reason  # met: not named (the walkthrough at ec0c85b read both)
    enough_requests = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=10 ** 6)
    v = gate(before, _eval({"prose": [0.9] * 10, "code": [0.6] * 10}), {"prose"}, enough_requests)
    assert not v.promote and "need min_eval_positions=1000000" in v.reason and "min_eval_requests" not in v.reason
    # Below the margin (point estimate).
    v = gate(before, _eval({"prose": [0.505] * 10, "code": [0.6] * 10}), {"prose"}, cfg)
    assert not v.promote and not v.worse and "its gain as served, +0.0050, is below promote_margin 0.01" in v.reason
    assert "it fell while" not in v.reason
    # served acceptance a hair lower while α at T=1 rose, with no margin (the demo's gate): says which was judged
    zero = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, promote_margin=0.0)
    v = gate(before, _eval({"prose": [0.53, 0.468] * 5, "code": [0.6] * 10}, alpha_t1={"prose": [0.51] * 10,
                                                                               "code": [0.6] * 10}), {"prose"}, zero)
    assert not v.promote and (": its gain as served, -0.0010, is below promote_margin 0; it fell while α at T=1 rose: "
                              "the gate judges acceptance as served, what the decoder sees") in v.reason, v.reason


def test_gate_marks_worse_candidates():
    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, regress_margin=0.02)
    before = _eval({"prose": [0.5] * 10, "code": [0.6] * 10})
    v = gate(before, _eval({"prose": [0.45] * 10, "code": [0.6] * 10}), {"prose"}, cfg)
    assert not v.promote and v.worse and v.evidence.gain == pytest.approx(-0.05)
    # Prose gains, code (not trained this round) drops 0.1 > 0.02: worse.
    v = gate(before, _eval({"prose": [0.7] * 10, "code": [0.5] * 10}), {"prose"}, cfg)
    assert not v.promote and v.worse and "code 0.6000 -> 0.5000" in v.reason
    # Too few held-out samples on the trained workload: nothing judged, nothing worse.
    v = gate(before, _eval({"prose": [0.9] * 3, "code": [0.6] * 10}), {"prose"}, cfg)
    assert not v.promote and not v.worse and v.evidence is None and "not enough held-out samples" in v.reason


def test_gate_pairs_records_by_prompt():
    """Two records of one prompt (a prefill and a decode record) are one request to the interval."""
    cfg = ServiceConfig(min_eval_samples=2, min_eval_requests=3, min_eval_positions=10)
    before = _eval({"prose": [0.5] * 4})
    after = _eval({"prose": [0.6] * 4})
    clusters = {"prose-0": "p0", "prose-1": "p0", "prose-2": "p1", "prose-3": "p1"}
    v = gate(before, after, {"prose"}, cfg, clusters)
    assert v.evidence.clusters == 2 and not v.promote and "min_eval_requests=3" in v.reason
    assert gate(before, after, {"prose"}, cfg).promote  # four prompts: enough


def test_paired_ratio_gain_enumerated():
    # Two prompts. P1: v0 accepts 2 of 8 proposals, adapted 6 of 8; P2: v0 3 of 4, adapted 2 of 4.
    # Pooled: v0 5/12, adapted 8/12, gain 0.25. Resamples: P1P1 (1/4): 6/8 - 2/8 = 0.5; P1P2 (1/2):
    # 0.25; P2P2 (1/4): 2/4 - 3/4 = -0.25. Interval: [-0.25, 0.5].
    pg = paired_ratio_gain({"p1": (2, 8, 6, 8), "p2": (3, 4, 2, 4), "none": (0, 0, 1, 2)})
    assert pg.clusters == 2 and pg.positions == 12
    assert pg.before == pytest.approx(5 / 12) and pg.after == pytest.approx(8 / 12) and pg.gain == pytest.approx(0.25)
    assert pg.low == pytest.approx(-0.25) and pg.high == pytest.approx(0.5)
    assert math.isnan(paired_ratio_gain({}).gain)


def test_gate_slice_prefers_decode_records_per_workload():
    from types import SimpleNamespace

    from trainer.service import gate_slice

    def rec(w, source, i):
        return SimpleNamespace(workload=w, source=source, record_id=f"{w}-{source}-{i}")

    held = ([rec("prose", "prefill", i) for i in range(5)] + [rec("prose", "decode", i) for i in range(3)]
            + [rec("code", "prefill", i) for i in range(4)] + [rec("code", "decode", i) for i in range(1)])
    cfg = ServiceConfig(min_eval_samples=3)
    got = [r.record_id for r in gate_slice(held, cfg)]
    # prose has 3 decode records (enough): those alone; code has 1 (too few): all of code's
    assert got == [f"prose-decode-{i}" for i in range(3)] + [f"code-prefill-{i}" for i in range(4)] + ["code-decode-0"]
    assert gate_slice(held, ServiceConfig(min_eval_samples=3, gate_on="all")) == held
    with pytest.raises(ValueError, match="gate_on='prompt'"):
        ServiceConfig(gate_on="prompt")


def test_a_measured_loss_on_any_workload_blocks_promotion():
    """Prose gains +0.05 everywhere; code (not trained this round) loses 0.01 on every request: under
    regress_margin, but its interval is [-0.01, -0.01], a measured loss: not promoted, and not
    marked worse (the pooled gain is positive: training goes on from the candidate)."""
    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, regress_margin=0.02)
    before = _eval({"prose": [0.5] * 10, "code": [0.6] * 10})
    v = gate(before, _eval({"prose": [0.55] * 10, "code": [0.59] * 10}), {"prose"}, cfg)
    assert not v.promote and not v.worse and "code -0.0100" in v.reason and "measurably lost" in v.reason
    # the same loss on one code request of ten: its interval reaches 0, so it is noise: promoted
    v = gate(before, _eval({"prose": [0.55] * 10, "code": [0.5] + [0.6] * 9}), {"prose"}, cfg)
    assert v.promote, v.reason


def test_a_measured_loss_says_whether_the_workload_is_the_candidates_own():
    """The 8690a9e walkthrough read "a workload measurably lost: math -0.0221" for math's own candidate.
    Trained on math: math loses 0.01 on every request (interval [-0.01, -0.01]): its own workload;
    trained on prose with code losing the same: another workload; both named when both lose."""
    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, regress_margin=0.02)
    before = _eval({"prose": [0.5] * 10, "math": [0.6] * 10})
    v = gate(before, _eval({"prose": [0.55] * 10, "math": [0.59] * 10}), {"math", "prose"}, cfg)
    assert not v.promote and "but its own workload (math) measurably lost acceptance as served: math -0.0100" in v.reason
    assert "another workload" not in v.reason and "a workload measurably lost" not in v.reason
    v = gate(before, _eval({"prose": [0.55] * 10, "math": [0.59] * 10}), {"prose"}, cfg)
    assert "but another workload (math) measurably lost: math -0.0100" in v.reason and "its own" not in v.reason
    both = _eval({"prose": [0.49] * 10, "math": [0.59] * 10, "code": [0.7] * 10})
    v = gate(_eval({"prose": [0.5] * 10, "math": [0.6] * 10, "code": [0.7] * 10}), both, {"prose", "code"}, cfg)
    assert ("its own workload (prose) measurably lost acceptance as served: prose -0.0100" in v.reason
            and "; and another workload (math) measurably lost: math -0.0100" in v.reason), v.reason


def test_a_confidence_below_one_is_never_described_as_a_100_percent_interval():
    """``round(0.999999999999999 * 100)`` printed "100 % CI" (an interval of every outcome)."""
    from trainer.gate import PairedGain

    kw = dict(clusters=10, samples=10, positions=100, before=0.5, after=0.6, gain=0.1, low=0.05, high=0.15)
    g = PairedGain(**kw, confidence=0.999999999999999)
    assert "100 %" not in g.describe() and ">99.9999 % CI" in g.describe(), g.describe()
    assert "97.5 % CI" in PairedGain(**kw, confidence=0.975).describe()


def _eval_decoded(served: list[float], decoded: list[float], positions: int = 10, proposed: float = 10.0) -> EvalResult:
    """Prose records with acceptance as served ``served`` and decoded acceptance ``decoded`` (accepted
    over ``proposed`` proposals at the gate's γ), one prompt each."""
    r = EvalResult()
    for i, (a, d) in enumerate(zip(served, decoded)):
        r.add_sample(f"prose-{i}", "prose", EvalCounts(1, positions, a * positions, 0, a * positions, d * proposed, proposed))
    return r


def test_gate_needs_the_decoded_lower_bound_above_0_too():
    """Acceptance as served gains +0.05 on every request (its interval [+0.05, +0.05]); decoded
    acceptance gains +0.05 on five requests and loses 0.04 on the other five: pooled +0.005, and
    every bootstrap resample with six or more of the losing requests (P > 0.37) is below 0, so its
    95 % lower bound is below 0: not promoted (the walkthrough at 7746fc5 promoted such a candidate
    and its decoded α on never-served prompts fell). Decoded +0.05 everywhere: promoted, both bounds said."""
    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, promote_margin=0.0,
                        regress_margin=0.02)
    before = _eval_decoded([0.5] * 10, [0.30] * 10)
    v = gate(before, _eval_decoded([0.55] * 10, [0.35] * 5 + [0.26] * 5), {"prose"}, cfg)
    assert v.evidence.low == pytest.approx(0.05)
    assert not v.promote and not v.worse, v.reason
    assert "decoded at γ=" in v.reason and "0.3000 -> 0.3050 (+0.0050" in v.reason
    assert "acceptance as served gained (lower bound +0.0500 > 0), but the decoded reading's lower bound -0.0" in v.reason
    v = gate(before, _eval_decoded([0.55] * 10, [0.35] * 10), {"prose"}, cfg)
    assert v.promote, v.reason
    assert v.reason.endswith("promoted on acceptance as served and decoded, its gain +0.0500 >= promote_margin 0 and "
                             "both lower bounds above 0 (+0.0500 as served, +0.0500 decoded); no workload regressed > 0.02")
