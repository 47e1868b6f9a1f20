"""Speculation per request inside a batch (issue 35 item 2): the goodput controller prices a step
by the rows verified across the fused batch (StepCost's t_B(r)), so γ shrinks as the batch grows
and turns off where rows cost nearly a step; the decision per batch size is in status.

Every expected γ below is computed by hand from injected step costs (no wall clock): with the
draft's proposals free (draft ms 0) and no overhead, a request's rate at batch B is

    E(α, γ) / t_B(γ + 1),   E(α, γ) = (1 - α^(γ+1)) / (1 - α)   (Leviathan et al. 2023, eq. 1)

against 1 / t_B(1) for plain decoding.
"""

from __future__ import annotations

import pytest

from decoder.control import DRAFT, ControllerConfig, GoodputController, batch_sizes_up_to
from decoder.loop import LoopConfig, ServingLoop, speculation_by_batch
from decoder.metrics import StepStats
from decoder.proposers.cost import StepCost
from decoder.proposers.ngram import NgramGate
from decoder.speculative import DecoderConfig, SpeculativeDecoder

KEY = ("prose", "greedy")
ALPHA = 0.8


def t_cheap_rows(n: int) -> float:
    """Batch-1 step of n rows: 10 ms plain, 2 ms a further row (a memory-bound engine)."""
    return 8.0 + 2.0 * n


def cost_of(t, rows=range(1, 6), fused=None) -> StepCost:
    """A StepCost fed exact readings at batch 1 (rows 1..5) and ``fused`` {(B, r): ms}; a frozen
    clock, so every reading is paired with the plain steps of its time."""
    c = StepCost(clock=lambda: 0.0)
    for _ in range(3):
        for n in rows:
            c.add(n, t(n))
        for (b, r), ms in (fused or {}).items():
            c.add(r, ms, batch=b)
    return c


def warmed(cost: StepCost | None, t=t_cheap_rows, sizes=(1, 2, 4, 8)) -> GoodputController:
    """A controller whose key has measured α = 0.8, free proposals and verify ms t(γ + 1) at γ = 0..4,
    each three times alike (so the confidence bound of ControllerConfig.confidence is the estimate)."""
    ctl = GoodputController(ControllerConfig(min_steps=1, batch_sizes=sizes), step_cost=cost)
    for _ in range(3):
        for g in range(5):
            ctl.observe(KEY, StepStats(g, 0, 1, -1 if g == 0 else 0, ALPHA * g, 0.0, t(g + 1)))
    return ctl


def E(g: int, a: float = ALPHA) -> float:
    return (1 - a ** (g + 1)) / (1 - a)


def test_the_fused_step_model_reads_the_batch_1_curve_at_the_total_rows_with_a_measured_correction():
    c = cost_of(t_cheap_rows)
    assert c.fused_ms(2, 3) == pytest.approx(t_cheap_rows(6))  # 2 x 3 rows: one sequence's 6 rows
    assert c.fused_ms(4, 2) == pytest.approx(t_cheap_rows(8))  # read off the line past the 5 measured
    assert c.batch_factor(4, 1) == pytest.approx(16 / 10)
    assert c.batch_factor(1, 3) == 1.0 and c.at_batch(4).ms(2) == pytest.approx(24.0)
    # fused steps measured at batch 4: 20 ms for one row each, where the model says t(4) = 16 ms,
    # so k_4 = 1.25 carries to the unmeasured rows: t_4(2) = t(8) x 1.25 = 30 ms
    m = cost_of(t_cheap_rows, fused={(4, 1): 20.0})
    assert m.fused_ms(4, 1) == pytest.approx(20.0)
    assert m.fused_ms(4, 2) == pytest.approx(30.0)
    assert m.fused_ms(2, 1) == pytest.approx(t_cheap_rows(2))  # batch 2 unmeasured: the model alone
    assert m.fused_status(batches=(4,), rows=(1, 2))["measured"] == ["4x1"]
    with pytest.raises(ValueError):
        m.add(1, 5.0, batch=0)


def test_a_fused_step_is_keyed_by_the_rows_of_the_whole_forward_not_its_own():
    # one request verifies 2 rows beside three plain mates: 5 rows in all, which cost
    # t(5) = 18 ms. Read as its own 2 rows each (8 rows, t(8) = 24 ms) it made a γ = 1 step in a
    # batch of 4 look 25 % cheaper than it is; keyed by the forward's 5 rows, the model's
    # correction is 18 / t(5) = 1, so a batch where all 4 verify 2 rows reads t(8) = 24 ms.
    c = cost_of(t_cheap_rows)
    for _ in range(3):
        c.add(2, 18.0, batch=4, total=5)
    assert c.fused_ms(4, 2) == pytest.approx(t_cheap_rows(8))
    assert c.fused_total_ms(4, 5) == pytest.approx(18.0)
    assert c.batch_factor(4, 2, total=5) == pytest.approx(18.0 / t_cheap_rows(2))
    assert c.fused_status(batches=(4,), rows=(2,))["measured"] == ["4:5rows"]
    # the controller divides such a step's verify ms by t_4(5 rows) / t(2), not t_4(2) / t(2)
    ctl = GoodputController(ControllerConfig(min_steps=1), step_cost=c)
    ctl.observe(KEY, StepStats(1, 1, 2, -1, 0.8, 0.0, 18.0), batch=4, total=5)
    assert ctl.decision(KEY)["by_batch"] is not None
    assert ctl._keys[KEY].verify_ms[1].value == pytest.approx(t_cheap_rows(2))
    # same bad-value contract as rows and batch
    with pytest.raises(ValueError, match="total=1"):
        c.add(2, 5.0, batch=4, total=1)


def test_gamma_shrinks_as_the_batch_grows():
    # t_B(r) = t(B r) = 8 + 2 B r. α = 0.8: E = 1.8, 2.44, 2.952, 3.3616, 3.68928 at γ = 1..5.
    # B = 1: E / (10 + 2γ): 0.150, 0.1743, 0.1845, 0.18676, 0.18446 -> γ = 4 (plain 0.1)
    # B = 2: E / (12 + 4γ): 0.1125, 0.1220, 0.1230, 0.12006 -> γ = 3 (plain 0.0833)
    # B = 4: E / (16 + 8γ): 0.0750, 0.07625, 0.0738 -> γ = 2 (plain 0.0625)
    # B = 8: E / (24 + 16γ): 0.0450, 0.04357 -> γ = 1 (plain 0.04167)
    ctl = warmed(cost_of(t_cheap_rows))
    by = ctl.decision(KEY)["by_batch"]
    assert {b: d["gamma"] for b, d in by.items()} == {1: 4, 2: 3, 4: 2, 8: 1}
    assert all(by[b]["speculate"] and by[b]["proposer"] == DRAFT for b in by)
    for b, g in ((1, 4), (2, 3), (4, 2), (8, 1)):
        assert by[b]["tokens_per_ms"] == pytest.approx(E(g) / t_cheap_rows(b * (g + 1)), rel=1e-3)
        assert by[b]["plain_tokens_per_ms"] == pytest.approx(1 / t_cheap_rows(b), rel=1e-3)
    assert by[4]["step_cost_factor"][3] == pytest.approx(t_cheap_rows(12) / t_cheap_rows(3), abs=1e-3)
    assert ctl.decision(KEY)["gamma"] == 4  # batch 1's decision is unchanged
    assert [ctl.batch_gamma(KEY, DRAFT, b, 4) for b in (1, 2, 4, 8)] == [4, 3, 2, 1]
    assert ctl.batch_gamma(KEY, DRAFT, 2, 2) == 2  # never above the request's own γ


def test_speculation_turns_off_at_batch_4_where_rows_cost_nearly_a_step():
    # measured fused steps at batch 4: 16 ms plain, then 14 ms for every further row of each of the
    # 4 sequences (4 rows at 0.875 of the batch's step): E / (16 + 14γ) = 0.0600, 0.0555, ... all
    # below plain's 1 / 16 = 0.0625, so a request in a batch of 4 decodes plainly
    fused = {(4, r): 16.0 + 14.0 * (r - 1) for r in range(1, 6)}
    ctl = warmed(cost_of(t_cheap_rows, fused=fused), sizes=(1, 2, 4))
    by = ctl.decision(KEY)["by_batch"]
    assert {b: d["gamma"] for b, d in by.items()} == {1: 4, 2: 3, 4: 0}
    assert by[4]["speculate"] is False and by[4]["proposer"] is None
    assert by[4]["why"].startswith("off: plain 0.0625 tok/ms per request")
    assert by[4]["gamma_by_proposer"] == {DRAFT: 0}
    assert ctl.batch_gamma(KEY, DRAFT, 4, 4) == 0


def test_each_request_runs_its_proposers_best_gamma_at_the_batch_size_of_each_step():
    ctl = warmed(cost_of(t_cheap_rows))
    pol = ctl.policy_for(KEY)
    size = [1]
    pol.batch_size = lambda: size[0]
    seen = []
    for b in (1, 4, 2, 8, 1):
        size[0] = b
        seen.append(pol.gamma())
    assert seen == [4, 2, 3, 1, 4]
    assert pol.decision["gamma"] == 4 and not pol.decision["probe"]


def test_where_the_batch_measured_speculation_not_paying_every_request_decodes_plainly_there():
    # the model says γ 2 at batch 4; the batch's realized goodput says speculative cycles lose at 4
    ctl = warmed(cost_of(t_cheap_rows))
    pol = ctl.policy_for(KEY)
    size = [4]
    pol.batch_size = lambda: size[0]
    verdict = {4: (False, "off in batches of 4: speculative steps 0.3000 tok/ms vs plain 0.4000"), 2: (None, "unmeasured")}
    pol.batch_pays = lambda b: verdict[b]
    assert pol.gamma() == 0 and pol.batch_why.startswith("off in batches of 4")
    size[0] = 2
    assert pol.gamma() == 3  # not measured at 2: the model decides
    size[0] = 1
    assert pol.gamma() == 4  # alone: never asked
    # a warm-up inside such a batch decodes plainly too (its rows would sit in every mate's step)
    cold = GoodputController(ControllerConfig(min_steps=50), step_cost=cost_of(t_cheap_rows))
    w = cold.policy_for(KEY)
    w.batch_size = lambda: 4
    w.batch_pays = lambda b: (False, "off")
    assert w.gamma() == 0 and w.decision["warm_up"]


def test_a_probe_keeps_its_gamma_inside_a_batch():
    ctl = warmed(cost_of(t_cheap_rows))
    ctl._keys[KEY].requests = ctl.config.probe_every - 1  # the next request is a probe (plain decoding)
    pol = ctl.policy_for(KEY)
    pol.batch_size = lambda: 4
    assert pol.gamma() == 0 and pol.decision["probe"]
    ctl2 = warmed(cost_of(t_cheap_rows), sizes=(1, 4))
    ctl2.config.min_steps = 50  # not warm: the warm-up's γ measures, whatever the batch
    pol2 = ctl2.policy_for(KEY)
    pol2.batch_size = lambda: 4
    assert pol2.gamma() == ctl2.config.gamma_init


def test_without_a_step_cost_every_batch_size_is_priced_as_batch_1():
    by = warmed(None).decision(KEY)["by_batch"]
    assert {b: d["gamma"] for b, d in by.items()} == {1: 4, 2: 4, 4: 4, 8: 4}
    assert by[8]["step_cost_factor"][1] == 1.0


def test_a_step_measured_inside_a_batch_counts_at_its_batch_1_cost():
    cost = cost_of(t_cheap_rows)
    ctl = GoodputController(ControllerConfig(min_steps=1), step_cost=cost)
    # a γ = 2 step in a fused forward of 4: verify 8 + 2 x 12 = 32 ms -> 14 ms = t(3) at batch 1
    ctl.observe(KEY, StepStats(2, 1, 2, 1, 1.6, 0.0, t_cheap_rows(12)), batch=4)
    ctl.observe_overhead(KEY, 3.2, batch=4)  # / ρ_4(1) = 1.6
    d = ctl.decision(KEY)
    assert d["t_verify_ms"][2] == pytest.approx(t_cheap_rows(3) + 2.0)
    assert d["overhead_ms"] == pytest.approx(2.0)


def test_the_ngram_gate_prices_its_proposals_at_the_batch_size():
    # t(n) = 9 + n; acceptance 0.5 per position (the prior): E = 1.5, 1.75, 1.875 at g = 1..3
    # B = 1: E / t(g + 1): 0.136, 0.1458, 0.1442 vs plain 0.1 -> 2
    # B = 4: E / t(4 (g + 1)): 0.0882, 0.0833 vs plain 1/13 = 0.0769 -> 1
    # B = 16: 1.5 / 41 = 0.0366 vs plain 1/25 = 0.04 -> 0
    cost = cost_of(lambda n: 9.0 + n)
    gate = NgramGate(explore_tries=0, explore_every=10**6)
    assert [gate.length("w", ("own", 3), 3, cost.at_batch(b)) for b in (1, 4, 16)] == [2, 1, 0]


def test_batch_sizes_up_to():
    assert batch_sizes_up_to(1) == (1,)
    assert batch_sizes_up_to(4) == (1, 2, 4)
    assert batch_sizes_up_to(6) == (1, 2, 4, 6)


def test_status_reports_the_decision_per_batch_size(tok, target, other_draft):
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(small_m_linear=False, draft_precision="fp32"))
    fused = {(4, r): 16.0 + 14.0 * (r - 1) for r in range(1, 6)}
    for _ in range(3):  # the decoder's own step cost, as its steps would have fed it
        for n in range(1, 6):
            dec.step_cost.add(n, t_cheap_rows(n))
        for (b, r), ms in fused.items():
            dec.step_cost.add(r, ms, batch=b)
    loop = ServingLoop(dec, config=LoopConfig(max_batch=4))
    assert loop.controller.step_cost is dec.step_cost and loop.controller.config.batch_sizes == (1, 2, 4)
    loop.controller.config.min_steps = 1
    for _ in range(3):  # three alike: the estimates are certain
        for g in range(5):
            loop.controller.observe(KEY, StepStats(g, 0, 1, -1 if g == 0 else 0, ALPHA * g, 0.0, t_cheap_rows(g + 1)))
    sp = loop.status()["speculation"]["prose@greedy"]
    assert {b: (v["on"], v["gamma"]) for b, v in sp["by_batch"].items()} == {"1": (True, 4), "2": (True, 3),
                                                                           "4": (False, 0)}
    assert speculation_by_batch(loop.status()["speculation"]) == {"prose@greedy": {"1": 4, "2": 3, "4": 0}}


def test_a_requests_gamma_at_a_batch_size_is_re_read_every_refresh_steps():
    cost = cost_of(t_cheap_rows)
    ctl = warmed(cost)
    pol = ctl.policy_for(KEY)
    pol.batch_size = lambda: 4
    assert pol.gamma() == 2  # step 1: read
    for _ in range(3):  # fused steps measured at batch 4 now say rows cost nearly a step there
        for r in range(1, 6):
            cost.add(r, 16.0 + 14.0 * (r - 1), batch=4)
    seen = [pol.gamma() for _ in range(pol.REFRESH_STEPS)]  # steps 2..17: re-read at step 17
    assert seen == [2] * (pol.REFRESH_STEPS - 1) + [0]


def test_with_several_proposers_a_request_keeps_its_proposer_and_takes_its_gamma_at_the_batch_size():
    cfg = ControllerConfig(proposers=("ngram", DRAFT), min_steps=1, ewma=0.5, batch_sizes=(1, 2, 4, 8))
    ctl = GoodputController(cfg, step_cost=cost_of(t_cheap_rows))
    for i in range(20):  # the n-gram proposer: free proposals, accepted prefixes cycling 0..3, cut at γ
        for g in range(5):
            acc = min(g, i % 4)
            ctl.observe(KEY, StepStats(g, acc, acc + 1, -1 if acc == g else acc, 0.0, 0.1, t_cheap_rows(g + 1)),
                        proposer="ngram" if g else DRAFT, asked=g)
        ctl.observe(KEY, StepStats(2, 1, 2, 1, 1.2, 3.0, t_cheap_rows(3)), proposer=DRAFT)
    by = ctl.decision(KEY)["by_batch"]
    assert by[1]["proposer"] == "ngram" and by[1]["gamma"] == ctl.decision(KEY)["gamma"]
    for b in (2, 4, 8):
        assert by[b]["proposer"] in ("ngram", None)
        assert by[b]["gamma"] <= by[1]["gamma"]
        assert all(by[b]["gamma_by_proposer"][n] <= by[1]["gamma_by_proposer"][n] for n in ("ngram", DRAFT))
    pol = ctl.policy_for(KEY)
    pol.batch_size = lambda: 4
    g = pol.gamma()
    assert pol.proposer_name() == "ngram" and not pol.decision["probe"]
    assert g == by[4]["gamma"] < by[1]["gamma"]


def test_an_off_decision_tells_plain_and_the_best_proposer_apart():
    """A walkthrough read "plain 0.136 tok/ms beats every proposer (best draft γ=1 0.136)" as a tie
    called a win: the rates get the decimals it takes to tell them apart."""
    from decoder.control import _two

    assert _two(0.13612, 0.13604) == ("0.1361", "0.1360")
    assert _two(0.1, 0.05) == ("0.100", "0.050")
    assert _two(0.5, 0.5) == ("0.500000", "0.500000")  # equal: as far as it goes
