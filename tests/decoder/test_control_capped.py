"""ControllerConfig.capped: a proposer whose γ only caps what its own gate proposes per step (the
gated n-gram proposer) is offered at gamma_max alone, warmed up there, and priced inside a batch
at the rows its steps really verify, not at gamma_max + 1."""

from __future__ import annotations

import re

import pytest

from decoder.control import ControllerConfig, GoodputController
from decoder.metrics import StepStats
from decoder.proposers.cost import StepCost

KEY = ("extract", "greedy")


def _cost() -> StepCost:
    """Batch-1 steps of 10 + 2 (n - 1) ms, and fused steps of 4 requests at 3 rows each (12 in all)
    and 9 rows each (36): what ρ_4(3) and ρ_4(9) are read from."""
    c = StepCost(clock=lambda: 0.0)
    for _ in range(3):
        for n in range(1, 10):
            c.add(n, 10.0 + 2.0 * (n - 1))
        c.add(3, 20.0, batch=4)
        c.add(9, 60.0, batch=4)
    return c


def test_a_capped_proposer_warms_up_at_gamma_max_and_is_offered_there_alone():
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), capped=("ngram",), min_steps=1, gamma_max=8,
                                             gamma_init=3, batch_sizes=(1, 4)), step_cost=_cost())
    pol = ctl.policy_for(KEY)
    assert (pol.gamma(), pol.proposer_name()) == (8, "ngram")  # not gamma_init = 3
    # its gate proposed 2 of the 8 it could, both accepted: 3 tokens in a 3-row step of 14 ms
    for _ in range(3):
        ctl.observe(KEY, StepStats(2, 2, 3, -1, 2.0, 0.0, 14.0), proposer="ngram", asked=8)
        ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    s = ctl._keys[KEY]
    ev = ctl._evaluate(s)
    assert set(ev["others"]["ngram"]) == {8}
    assert ev["others"]["ngram"][8] == pytest.approx(3 / 14.0)
    d = ctl.decision(KEY)
    assert (d["proposer"], d["gamma"]) == ("ngram", 8)  # 3 / 14 = 0.214 tokens/ms against plain's 0.1
    # in a fused step of 4 its 3 rows cost ρ_4(3) of their batch-1 time, not ρ_4(9)
    ev4 = ctl._evaluate(s, batch=4)
    rho3, rho9 = ctl.batch_factor(4, 3), ctl.batch_factor(4, 9)
    assert rho3 != pytest.approx(rho9)
    assert ev4["others"]["ngram"][8] == pytest.approx(3 / (14.0 * rho3))


def test_an_uncapped_proposer_is_still_offered_at_every_gamma():
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), min_steps=1, gamma_max=8, gamma_init=3))
    pol = ctl.policy_for(KEY)
    assert pol.gamma() == 3
    for _ in range(3):
        ctl.observe(KEY, StepStats(2, 2, 3, -1, 2.0, 0.0, 14.0), proposer="ngram", asked=3)
        ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    assert set(ctl._evaluate(ctl._keys[KEY])["others"]["ngram"]) == set(range(1, 9))


@pytest.mark.parametrize("capped", [("draft",), ("eagle",), "ngramx"])
def test_capped_names_a_configured_length_modelled_proposer(capped):
    with pytest.raises(ValueError, match="ControllerConfig.capped"):
        ControllerConfig(proposers=("ngram", "draft"), capped=capped)


def test_the_serving_loop_caps_the_gated_ngram_proposer_only(target, other_draft, tok):
    from decoder.loop import build_serving_loop
    from decoder.speculative import DecoderConfig

    for gate, want in ((True, ("ngram",)), (False, ())):
        loop = build_serving_loop(target, other_draft, tok, proposers=("ngram", "draft"),
                                  decoder_config=DecoderConfig(ngram_gate=gate, small_m_linear=False,
                                                               draft_precision="fp32"))
        assert loop.controller.config.capped == want
        loop.close()


def test_a_model_free_proposer_measured_on_one_slow_request_is_probed_until_three_are():
    """A walkthrough of dc5feed: the n-gram's one warm-up request ran beside the v0 bootstrap (32 ms a
    token), plain decoding then looked faster, and with a probe once in 10 requests prose stayed on
    plain decoding for 200 requests. Now it is measured every other request until 3 requests are,
    and then, while it is priced ahead of plain within the 5 % margin, every other request still (a
    walkthrough of 7746fc5: priced at 1.00-1.04x from 3 requests, one its warm-up, never measured
    again, it ran 1.08-1.13x plain on never-served prompts), until its lead clears the margin."""
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), capped=("ngram",), min_steps=1, gamma_max=8,
                                             probe_every=10, unsure_probe_every=2))
    picks, whys = [], {}
    for i in range(1, 13):
        pol = ctl.policy_for(KEY)
        g = pol.gamma()
        name = pol.proposer_name() if g else "plain"
        picks.append(name)
        whys[i] = pol.decision["why"]
        if name == "ngram":  # slow the first time (a loaded host), then 3 tokens in 14 ms
            ms = 60.0 if i == 1 else 14.0
            ctl.observe(KEY, StepStats(2, 2, 3, -1, 2.0, 0.0, ms), proposer="ngram", asked=8, first=True, request=i)
        else:
            ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0), first=True, request=i)
    # warm-ups (the n-gram, slow; plain), plain's verdict, then the n-gram every other request until it
    # has 3 requests (4 and 6); after 6 its price (3 requests, the slow one among them: 0.102 tok/ms) is
    # ahead of plain's 0.100 within the margin: probed at 8 (not left to the periodic probe at 10), then
    # ahead beyond the margin, not yet beyond its bound: probed every other request
    assert picks == ["ngram", "plain", "plain", "ngram", "plain", "ngram", "plain", "ngram", "plain", "ngram",
                     "plain", "ngram"], picks
    assert "ngram" not in picks[2:9:2]  # the odd-numbered slots never probe (unsure_probe_every=2)
    m = re.match(r"probe: ngram γ=8, (\d\.\d+)x plain: ahead within the 5% margin \(min_gain\), measured every other "
                 r"request until 32 requests are \(3 requests so far\); off: the best, ngram γ=8 (\S+) tok/ms", whys[8])
    assert m and 1.0 < float(m.group(1)) <= 1.05, whys[8]
