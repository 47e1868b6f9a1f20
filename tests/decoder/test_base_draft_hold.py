"""serve.base_draft / build_serving_loop(hold_base_draft=True): the controller does not offer a
draft that has no adapter version yet (issue 35: at 1 client with no cached v0, the untrained
derived draft was warmed up and probed, 0-1 tokens accepted of 7-62 proposed, and those requests
ran slower than plain), and offers it from the first request after v0 is prepared."""

from __future__ import annotations

from types import SimpleNamespace as NS

from decoder.control import ControllerConfig, GoodputController
from decoder.loop import _availability
from decoder.metrics import StepStats

KEY = ("prose", "greedy")


def _request(ctl):
    pol = ctl.policy_for(KEY)
    g = pol.gamma()
    return (pol.proposer_name() if g else "plain"), g, pol.decision["why"]


def test_a_held_draft_alone_serves_plain_and_warms_up_once_offered():
    ready = {"v": False}
    cfg = ControllerConfig(gamma_max=4, gamma_init=3, probe_every=5, min_steps=2, proposers=("draft",))
    ctl = GoodputController(cfg, proposer_available=lambda n: n != "draft" or ready["v"])
    for _ in range(12):  # probe slots included: never the draft while it is held
        name, g, why = _request(ctl)
        assert (name, g) == ("plain", 0)
        assert "not offered while no adapter version of it is served" in why
        ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    d = ctl.decision(KEY)
    assert d["last"]["warm_up"] is False and (d["gamma"], d["why"]) == (0, d["last"]["why"])
    ready["v"] = True  # v0 prepared: the next request measures the draft at gamma_init
    name, g, why = _request(ctl)
    assert (name, g) == ("draft", 3) and why.startswith("warm-up")


def test_a_held_draft_among_proposers_is_never_warmed_up_nor_probed():
    ready = {"v": False}
    cfg = ControllerConfig(gamma_max=4, gamma_init=3, probe_every=5, min_steps=2, proposers=("ngram", "draft"))
    ctl = GoodputController(cfg, proposer_available=lambda n: n != "draft" or ready["v"])
    seen = []
    for _ in range(30):
        name, g, _ = _request(ctl)
        seen.append(name)
        if name == "ngram":
            ctl.observe(KEY, StepStats(g, 1, 2, 1, 1.0, 0.01, 12.0), proposer="ngram", asked=g)
        else:
            ctl.observe(KEY, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    assert "draft" not in seen and {"ngram", "plain"} <= set(seen)
    ready["v"] = True
    assert _request(ctl)[:2] == ("draft", 3)  # the first request after v0: the draft's warm-up


def test_availability_holds_only_the_draft_and_only_with_a_followed_registry_and_no_version():
    dec = NS(eagle_head=None)
    mgr = NS(has_version=False)
    held = _availability(dec, mgr, True)
    assert [held(n) for n in ("draft", "ngram", "eagle")] == [False, True, False]
    mgr.has_version = True
    assert held("draft") is True
    assert _availability(dec, NS(has_version=False), False)("draft") is True  # offer
    assert _availability(dec, None, True)("draft") is True  # no registry followed: the draft is what it is
    dec.eagle_head = object()
    assert _availability(dec, None, False)("eagle") is True


def test_the_loop_offers_the_draft_once_the_first_promoted_version_is_prepared(pair, reg, tmp_path, tok):
    from adapt_helpers import fixing_lora
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, DecoderConfig

    target, draft, noise = pair
    loop = build_serving_loop(target, draft, tok, registry=reg.registry, config=LoopConfig(queue_size=8),
                              decoder_config=DecoderConfig(small_m_linear=False, draft_precision="fp32"),
                              proposers=("ngram", "draft"), poll_interval_s=0.1, hold_base_draft=True)
    with loop:
        loop.start()
        assert loop.manager.has_version is False
        assert loop.status()["proposers_offered"] == ["ngram"]
        ids = tok.encode("the cat sat on the mat")
        for _ in range(3):
            res = loop.generate(DecodeRequest(ids, SamplingParams(), 8, workload="prose"), timeout=120)
            assert res.adapter_version == 0
        assert all(d["last"].get("proposer") != "draft" for d in loop.controller.status().values())
        v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
        reg.registry.promote(v1, "v0 of this test")
        assert loop.manager.wait_prepared(v1, 120)
        assert loop.manager.has_version is True
        assert loop.status()["proposers_offered"] == ["ngram", "draft"]
        # the next request swaps v1 in; the draft, unmeasured, is warmed up once the n-gram's warm-up is done
        chosen = []
        for _ in range(12):
            res = loop.generate(DecodeRequest(ids, SamplingParams(), 8, workload="prose"), timeout=120)
            assert res.adapter_version == v1
            chosen.append(loop.controller.decision(("prose", "greedy"))["last"]["proposer"])
            if chosen[-1] == "draft":
                break
        assert chosen[-1] == "draft", chosen
