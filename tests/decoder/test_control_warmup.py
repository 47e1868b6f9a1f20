"""A warm-up request moves on once what it measures has ``min_steps`` steps
(:meth:`GoodputController.after_warm_up`): plain decoding while plain is unmeasured, then its
proposer's best γ; it never switches proposer."""

from __future__ import annotations

from decoder.control import ControllerConfig, GoodputController
from decoder.metrics import StepStats

KEY = ("prose", "greedy")


class Clock:
    """A clock the test advances by each step's modelled time (no overhead outside the steps)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(pol, clock: Clock, steps: int, step_of) -> list[int]:
    """γ of ``steps`` steps of one request; ``step_of(γ)`` is the StepStats each reports."""
    gammas = []
    for _ in range(steps):
        g = pol.gamma()
        gammas.append(g)
        st = step_of(g)
        clock.t += (st.draft_ms + st.verify_ms) / 1e3
        pol.update(st)
    return gammas


def useless_draft(g: int) -> StepStats:
    """A draft step of γ = g none of whose proposals pass (α = 0), 2 ms per proposal, verify
    10 + g ms; γ = 0 is a 10 ms plain step."""
    return StepStats(g, 0, 1, 0 if g else -1, 0.0, 2.0 * g, 10.0 + g)


def perfect_draft(g: int) -> StepStats:
    """Every proposal passes (α = 1), 0.5 ms per proposal, verify 10 + g ms."""
    return StepStats(g, g, g + 1, -1, float(g), 0.5 * g, 10.0 + g)


def test_a_useless_draft_warms_up_for_min_steps_then_plain_is_measured_then_plain_serves():
    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=2), clock=clock)
    pol = ctl.policy_for(KEY)
    gammas = run(pol, clock, 8, useless_draft)
    # 2 draft steps at gamma_init, 2 plain steps (plain unmeasured), then the draft's best γ at
    # these costs: α = 0 so every γ > 0 is slower than plain -> 0
    assert gammas == [3, 3, 0, 0, 0, 0, 0, 0]
    assert pol.decision["why"] == ("warm-up: measuring α and draft cost at γ=3; "
                                   "then plain decoding, which beats draft")
    assert pol.decision["probe"] is False and pol.decision["speculate"] is False
    # the key is warm: the next request is not a warm-up
    nxt = ctl.policy_for(KEY)
    assert nxt.gamma() == 0 and not nxt.decision["why"].startswith("warm-up")


def test_a_perfect_draft_returns_to_its_best_gamma_after_plain_is_measured():
    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=2), clock=clock)
    pol = ctl.policy_for(KEY)
    gammas = run(pol, clock, 7, perfect_draft)
    assert gammas[:4] == [3, 3, 0, 0]
    # one request is one prompt: its acceptance says nothing of the next one's (ControllerConfig.confidence),
    # so the rest of it decodes plainly, and says why
    assert gammas[4:] == [0, 0, 0]
    assert pol.decision["why"].endswith("; then plain decoding until draft, ahead of it, clears its 95 % bound on "
                                        "more requests (1 request so far)")
    # the next request measures the draft again (every other request while it is ahead but unconfirmed);
    # with two requests alike (α = 1 in both) it goes on at its best γ <= gamma_max: α = 1, cost
    # 0.5 g + 10 + g per g + 1 tokens (verify costs for γ it never ran from the line through (1, 10) and (4, 13))
    rate = {g: (g + 1) / (0.5 * g + 10.0 + g) for g in range(1, 5)}
    best = max(rate, key=rate.get)
    second = ctl.policy_for(KEY)
    g2 = run(second, clock, 5, perfect_draft)
    assert second.decision["why"].startswith("probe: draft γ=4, ahead of plain but not yet beyond its confidence bound")
    assert g2[0] == best == 4
    assert g2[2:] == [best] * 3 and second.decision["why"].endswith(f"; then draft γ={best}, its best")
    third = ctl.policy_for(KEY)
    assert run(third, clock, 3, perfect_draft) == [best] * 3 and not third.decision["probe"]


def test_a_request_never_switches_proposer_mid_warm_up():
    """ngram warms up first, over its whole request (a model-free proposer's first steps are no
    sample of its request: an answer's start copies the question), never switching to the draft
    (still cold: the next request measures it, for min_steps steps, then plain decoding)."""
    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=2, min_steps=2, proposers=("ngram", "draft")),
                            clock=clock)
    pol = ctl.policy_for(KEY)
    assert run(pol, clock, 6, perfect_draft) == [2] * 6
    assert pol.decision["proposer"] == "ngram" and pol.decision["why"] == "warm-up: measuring ngram at γ=2"
    nxt = ctl.policy_for(KEY)
    assert run(nxt, clock, 4, perfect_draft)[:3] == [2, 2, 0]
    assert nxt.decision["why"].startswith("warm-up: measuring draft at γ=2; then measuring plain decoding")


def test_a_plain_warm_up_request_keeps_plain_until_it_is_measured():
    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=2), clock=clock)
    run(ctl.policy_for(KEY), clock, 2, useless_draft)  # a short first request: the draft's 2 steps only
    pol = ctl.policy_for(KEY)
    gammas = run(pol, clock, 5, useless_draft)
    assert gammas == [0, 0, 0, 0, 0]
    assert pol.decision["why"] == "warm-up: measuring plain decoding; then plain decoding, which beats draft"


def test_a_plain_warm_up_request_without_a_proposer_stops_warming_once_plain_is_measured():
    """Several proposers: plain's warm-up request has no proposer; once plain is measured it
    stays plain and says so (no re-check every step)."""
    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=2, min_steps=2, proposers=("ngram",)),
                            clock=clock)
    run(ctl.policy_for(KEY), clock, 2, perfect_draft)  # ngram's 2 steps, nothing more
    pol = ctl.policy_for(KEY)
    assert run(pol, clock, 4, useless_draft) == [0, 0, 0, 0]
    assert pol.decision["why"] == "warm-up: measuring plain decoding; then plain decoding"
    assert pol._warming is False


def test_a_model_run_proposer_warms_up_in_one_request_of_a_key_at_a_time():
    """Three requests of a cold key start together (a 4-client load): the first measures the
    draft, the others plain decoding (which the warm-up needs too), not the draft three times.
    Once the first is gone while the draft is still cold, the next request measures it again; a
    key whose plain decoding is measured gives the best measured choice instead."""
    import gc

    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=2, proposers=("draft", "ngram")),
                            clock=clock)
    first, second, third = (ctl.policy_for(KEY) for _ in range(3))
    assert first.gamma() == 3 and first.decision["proposer"] == "draft" and first.decision["warm_up"] is True
    for pol in (second, third):
        assert pol.gamma() == 0 and pol.decision["warm_up"] is True and pol.decision["proposer"] is None
        assert pol.decision["why"] == "warm-up: measuring plain decoding (draft's warm-up is under way in another request)"
    del first
    gc.collect()
    again = ctl.policy_for(KEY)
    assert again.gamma() == 3 and again.decision["proposer"] == "draft"  # the draft is still unmeasured
    run(second, clock, 3, useless_draft)  # plain decoding measured (2 steps after the one after the prefill)
    later = ctl.policy_for(KEY)
    assert later.gamma() == 0 and later.decision["warm_up"] is False  # draft busy in `again`: the best measured
    # a model-free proposer (n-gram) is not held to one request: its warm-ups cost no model steps
    ctl2 = GoodputController(ControllerConfig(gamma_max=4, gamma_init=2, min_steps=2, proposers=("ngram", "draft")),
                             clock=clock)
    a, b = ctl2.policy_for(KEY), ctl2.policy_for(KEY)
    assert a.gamma() == 2 and b.gamma() == 2 and a.decision["proposer"] == b.decision["proposer"] == "ngram"


def test_a_periodic_probe_of_a_draft_that_plain_beats_moves_on_to_plain_after_min_steps():
    clock = Clock()
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=2, probe_every=3,
                                             ceiling_probe_every=3), clock=clock)
    run(ctl.policy_for(KEY), clock, 8, useless_draft)  # the warm-up: the key is warm, plain serves
    probes = []
    for _ in range(6):
        pol = ctl.policy_for(KEY)
        gammas = run(pol, clock, 8, useless_draft)
        if gammas[0]:
            probes.append((gammas, pol.decision))
        else:
            assert gammas == [0] * 8  # a request that is no probe serves plain throughout
    assert probes, "no request probed the draft"
    for gammas, decision in probes:
        # it measures the draft for min_steps steps (the α estimate moves), then serves plain
        assert gammas == [3, 3, 0, 0, 0, 0, 0, 0] or gammas == [gammas[0]] * 2 + [0] * 6
        assert decision["why"].startswith("probe: ") and decision["why"].endswith("; then plain decoding, which beats draft")
        assert decision["probe"] is False and decision["speculate"] is False
