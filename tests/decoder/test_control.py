"""Acceptance windows, automatic rollback and goodput control, driven by real tiny models,
real peft adapters and the real store on Redis."""

from __future__ import annotations

import math

import pytest
import redis

from adapt_helpers import exact_draft, fixing_lora, perturb, random_lora, shallow_target
from decoder.adapters import AdapterManager
from decoder.control import ControllerConfig, GoodputController, expected_tokens_per_step
from decoder.rollback import RollbackMonitor
from decoder.tracking import AcceptanceTracker, key_of
from decoder.metrics import StepStats
from decoder.shift import ShiftConfig, ShiftDetector
from decoder.speculative import DecodeRequest, FixedGamma, SpeculativeDecoder
from store import AcceptanceHistory

PROMPTS = ["the cat sat on", "def f(x): return", "what is 3+4?", "hello there, how"]


def _req(tok, i: int, n: int = 12, workload: str = "prose") -> DecodeRequest:
    return DecodeRequest(tok(PROMPTS[i % len(PROMPTS)])["input_ids"], max_new_tokens=n, ignore_eos=True, workload=workload)


def test_expected_tokens_per_step_hand_values():
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0


def test_tracker_flushes_windows_to_history_and_survives_redis_down(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    dec = SpeculativeDecoder(target, draft, tok)
    history = AcceptanceHistory(reg.client, reg.config)
    tracker = AcceptanceTracker(history, ShiftDetector())
    results = [dec.generate(_req(tok, i), FixedGamma(2)) for i in range(3)]
    for r in results:
        tracker.observe(r)
    assert tracker.flush() == 1
    row = history.totals(workload="prose@greedy", version=0)
    assert row.requests == 3
    assert row.num_draft_tokens == sum(r.counts.num_draft_tokens for r in results)
    assert row.num_accepted_tokens == sum(r.counts.num_accepted_tokens for r in results)
    assert row.alpha == pytest.approx(sum(r.counts.alpha for r in results) / 3)
    assert tracker.status()["windows"]["prose@greedy/v0"]["requests"] == 3

    dead = AcceptanceHistory(redis.Redis(port=1, socket_connect_timeout=0.2), reg.config)  # nothing listens there
    down = AcceptanceTracker(dead)
    down.observe(results[0])
    assert down.flush() == 0  # no exception reaches the caller
    assert down.status()["unflushed_keys"] == 1 and down.flush_errors == 1 and down.last_error
    down.history = history  # Redis is back: the kept counts are written
    assert down.flush() == 1
    assert history.totals(workload="prose@greedy", version=0).requests == 4


def test_tracker_retry_of_a_write_whose_reply_was_lost_counts_once(tok, pair, reg):
    # Redis applied the flush but its reply was lost (a timeout after the server ran it): the
    # tracker retries that write with its own seq before the newer counts of the same key, and
    # the history skips it. Merged into the newer counts and written afresh, it counted twice.
    from store.errors import StoreUnavailableError

    target, draft, noise = pair
    dec = SpeculativeDecoder(target, draft, tok)
    history = AcceptanceHistory(reg.client, reg.config)

    class LostReply:  # the real history, whose first reply is lost after the write is applied
        kind = "adapter"
        lost = 1
        writer = history.writer

        def next_seq(self):
            return history.next_seq()

        def record(self, *a, **kw):
            history.record(*a, **kw)
            if self.lost:
                self.lost -= 1
                raise StoreUnavailableError("recording history: Redis unreachable (read timed out)")

    tracker = AcceptanceTracker(LostReply())
    r1, r2 = [dec.generate(_req(tok, i), FixedGamma(2)) for i in range(2)]
    tracker.observe(r1)
    assert tracker.flush() == 0 and tracker.status()["retrying_writes"] == 1
    tracker.observe(r2)  # the same key, before the retry
    assert tracker.flush() == 2 and tracker.status()["retrying_writes"] == 0
    row = history.totals(workload="prose@greedy", version=0)
    assert row.requests == 2
    assert row.num_draft_tokens == r1.counts.num_draft_tokens + r2.counts.num_draft_tokens


def test_bad_adapter_is_rolled_back_with_the_reason_recorded(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    good = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    bad = reg.register(random_lora(draft, tmp_path / "bad", scale=50.0, seed=3))  # huge random LoRA
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry)
    tracker = AcceptanceTracker(detector=ShiftDetector(ShiftConfig(min_samples=3, lam=0.5)))
    monitor = RollbackMonitor(reg.registry, tracker, min_requests=4, margin=0.2)

    def serve(n: int):
        for i in range(n):
            r = dec.generate(_req(tok, i), FixedGamma(3))
            tracker.observe(r)
            monitor.check(dec.adapter_version)

    reg.registry.promote(good, "trained")
    mgr.poll_once()
    serve(4)
    assert dec.adapter_version == good
    reg.registry.promote(bad, "trained")
    mgr.poll_once()
    serve(4)
    d = monitor.decisions[-1]
    assert d.version == bad and d.previous == good and d.rolled_back
    assert d.new_value < 0.2 and d.previous_value > 0.9
    rec = reg.registry.get(bad)
    assert rec.state == "rolled_back" and rec.reason.startswith(f"auto-rollback: v{bad} alpha=")
    assert f"vs v{good}" in rec.reason and "prose@greedy" in rec.reason
    assert reg.registry.promotion_log()[-1]["event"] == "rollback"
    assert reg.registry.active_version() == good
    mgr.poll_once()  # the previous version is still loaded: a pure switch
    r = dec.generate(_req(tok, 0), FixedGamma(3))
    assert r.adapter_version == good and r.counts.acceptance_rate == 1.0
    assert tracker.alarms and tracker.alarms[0].key == ("prose", "greedy")  # the drop was flagged too


def _monitored(tok, reg, target, draft):
    """A decoder with an adapter manager, an acceptance tracker and a rollback monitor that is
    told each request's workload: (decoder, manager, monitor, serve(n, workloads))."""
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry)
    tracker = AcceptanceTracker()
    monitor = RollbackMonitor(reg.registry, tracker, min_requests=3, margin=0.2)

    def serve(n: int, workloads) -> None:
        for i in range(n):
            for w in workloads:
                r = dec.generate(_req(tok, i, workload=w), FixedGamma(3))
                tracker.observe(r)
                monitor.check(r.adapter_version, r.workload)

    return dec, mgr, monitor, serve


def test_a_bad_workload_adapter_is_rolled_back_in_its_own_scope_only(tok, pair, reg, tmp_path):
    """Interleaved prose and code requests; code gets its own adapter, which is bad: the monitor
    (told each request's workload) compares it with what served code before (the shared good
    adapter), rolls back the code scope only, and code falls back to the shared adapter."""
    target, draft, noise = pair
    good = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    bad = reg.register(random_lora(draft, tmp_path / "bad", scale=50.0, seed=3), scope="code")
    dec, mgr, monitor, serving = _monitored(tok, reg, target, draft)

    def serve(n: int):
        serving(n, ("prose", "code"))

    reg.registry.promote(good, "shared")
    mgr.poll_once()
    serve(3)
    reg.registry.promote(bad, "code's own")
    mgr.poll_once()
    serve(3)
    d = monitor.decisions[-1]
    assert (d.version, d.previous, d.rolled_back) == (bad, good, True)
    assert d.key.startswith("code@") and d.new_value < 0.2 and d.previous_value > 0.9
    assert reg.registry.active_versions() == {"": good, "code": 0}
    last = reg.registry.promotion_log()[-1]
    assert (last["event"], last["scope"], last["version"]) == ("rollback", "code", "0")
    mgr.poll_once()
    r = dec.generate(_req(tok, 0, workload="code"), FixedGamma(3))
    assert r.adapter_version == good and r.counts.acceptance_rate == 1.0
    # code now falls back to the shared adapter: that is not judged against code's own (QA: it
    # was, and a shared rollback followed whenever code's own adapter had been better)
    serve(4)
    assert len(monitor.decisions) == 1 and reg.registry.active_versions() == {"": good, "code": 0}


def test_falling_back_to_the_shared_adapter_is_not_judged(tok, pair, reg, tmp_path):
    """code's own adapter (v1, exact) replaces a poor, newer shared one (v2) on code: judged and
    kept. An operator then rolls code's scope back, so code falls back to v2, which drafts code
    far worse than v1 did: that is no regression of v2, and the shared adapter stays."""
    target, draft, noise = pair
    code = reg.register(fixing_lora(draft, noise, tmp_path / "fix"), scope="code")
    shared = reg.register(random_lora(draft, tmp_path / "poor", scale=50.0, seed=3))
    assert shared > code
    _, mgr, monitor, serving = _monitored(tok, reg, target, draft)

    def serve(n: int):
        serving(n, ("code",))

    for step in (lambda: reg.registry.promote(shared, "shared"), lambda: reg.registry.promote(code, "code's own"),
                 lambda: reg.registry.rollback("operator", scope="code")):
        step()
        mgr.poll_once()
        serve(3)
    assert [(d.version, d.previous, d.rolled_back) for d in monitor.decisions] == [(code, shared, False)]
    assert reg.registry.active_versions() == {"": shared, "code": 0}


def test_good_adapter_is_kept(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry)
    tracker = AcceptanceTracker()
    monitor = RollbackMonitor(reg.registry, tracker, min_requests=3, margin=0.1)
    for v in (0, v1):
        if v:
            reg.registry.promote(v, "trained")
            mgr.poll_once()
        for i in range(3):
            tracker.observe(dec.generate(_req(tok, i), FixedGamma(3)))
            monitor.check(dec.adapter_version)
    d = monitor.decisions[-1]
    assert not d.rolled_back and d.reason.startswith(f"kept: v{v1}") and reg.registry.active_version() == v1


def test_controller_turns_speculation_off_for_a_useless_draft_and_on_after_adaptation(tok, reg, tmp_path):
    # 12 target layers against the draft's 1: with a 3-layer target, fixed per-step overhead made
    # a tiny draft step cost 0.9-1.6 ms against a 1.0-1.6 ms target step depending on what ran
    # before, and whether γ >= 2 paid at α = 1 flipped with it
    target = shallow_target(layers=12)
    draft = exact_draft(target)
    noise = perturb(draft, scale=3.0)
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry)
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, probe_every=4, min_steps=6),
                            adapter_version=lambda: dec.adapter_version)
    key = ("prose", "greedy")

    def serve(n: int, until=lambda d: False) -> list:
        """Up to n requests, stopping once ``until(decision(key))`` holds (timing on a shared
        machine is noisy: the estimates need a varying number of steps to settle)."""
        out = []
        for i in range(n):
            req = _req(tok, i, n=16)
            pol = ctl.policy_for(key_of(req))
            r = dec.generate(req, pol)
            out.append((pol.decision, r))
            if i >= 5 and until(ctl.decision(key)):
                break
        return out

    # off, and plain ahead on the estimates themselves (not only inside the bound of ControllerConfig.confidence)
    served = serve(20, until=lambda d: d["gamma"] == 0 and d["tokens_per_ms"][0] > max(
        v for g, v in d["tokens_per_ms"].items() if g > 0))
    d = ctl.decision(key)
    assert d["gamma"] == 0 and not d["speculate"], d
    assert d["why"].startswith("off: ") and f"α={d['alpha']:.2f}" in d["why"], d["why"]
    assert d["alpha"] < 0.2 and d["tokens_per_ms"][0] > max(v for g, v in d["tokens_per_ms"].items() if g > 0)
    assert d["key"] == "prose@greedy" and set(d) >= {"t_draft_ms", "t_plain_ms", "t_verify_ms", "overhead_ms"}
    assert served[0][0]["why"].startswith("warm-up")

    # adaptation: the trainer's adapter cancels the draft's error
    reg.registry.promote(reg.register(fixing_lora(draft, noise, tmp_path / "fix")), "trained")
    mgr.poll_once()
    served = serve(12, until=lambda d: d["gamma"] >= 2)
    assert served[0][0]["why"].startswith("warm-up"), "a new adapter version is re-measured at once"
    d = ctl.decision(key)
    assert d["gamma"] >= 2 and d["speculate"], d
    assert d["why"].startswith(f"γ={d['gamma']}: ") and "tok/ms vs plain" in d["why"]
    assert d["alpha"] > 0.9 and d["adapter_version"] == dec.adapter_version != 0
    spec = [r for dec_, r in served if dec_["gamma"] > 0]
    assert spec and all(r.counts.acceptance_rate == 1.0 for r in spec)


def test_controller_verify_cost_fit_and_probes():
    ctl = GoodputController(ControllerConfig(gamma_max=6, gamma_init=2, probe_every=5, min_steps=2))
    key = ("code", "t0.7-p0.9")
    for _ in range(4):  # hand-made steps: plain 10 ms; γ=2: draft 1 ms/token, verify 12 ms, α = 0.8
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
        ctl.observe(key, StepStats(2, 2, 3, -1, 1.6, 2.0, 12.0))
    d = ctl.decision(key)
    # line through (1, 10) and (3, 12): t_verify(γ) = 9 + (γ + 1)
    assert d["t_verify_ms"][4] == pytest.approx(14.0)
    assert d["tokens_per_ms"][4] == pytest.approx(expected_tokens_per_step(0.8, 4) / (4 * 1.0 + 14.0), rel=1e-3)
    best = max(d["tokens_per_ms"], key=d["tokens_per_ms"].get)
    assert d["gamma"] == best > 0 and d["why"].startswith(f"γ={best}:")
    gammas = [ctl.policy_for(key).gamma() for _ in range(10)]
    assert 0 in gammas  # plain decoding re-probed within probe_every requests
    assert gammas.count(best) >= 7
    # per-step overhead outside the model calls (step wall time - draft - verify) joins every step's cost
    other = ("code", "greedy")
    for _ in range(3):
        ctl.observe(other, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0), step_ms=15.0)
    assert ctl.decision(other)["overhead_ms"] == pytest.approx(5.0)
    assert ctl.decision(other)["tokens_per_ms"][0] == pytest.approx(1 / 15.0, rel=1e-3)


def _draft_steps(ctl, key, draft_ms_per_token: float, verify_ms: dict[int, float], alpha: float, n: int = 4):
    """n hand-made steps each of plain decoding (10 ms) and of the draft at each γ in verify_ms."""
    for _ in range(n):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
        for g, ms in verify_ms.items():
            ctl.observe(key, StepStats(g, 0, 1, 0, alpha * g, draft_ms_per_token * g, ms))


def test_a_draft_whose_alpha_one_ceiling_is_below_plain_is_probed_only_every_ceiling_probe_every():
    """Plain 10 ms a step; the draft 4 ms a token, a verification of 2 rows 20 ms, of 3 rows 28 ms:
    at α = 1, γ=1 gives 2 / (4 + 20) = 0.0833 tok/ms and γ=2 3 / (8 + 28) = 0.0833, both below
    plain's 0.1, so however training improves α it cannot pay, and the draft's probes back off:
    5, 10, 20 requests apart (ceiling_probe_every), instead of every probe_every (5)."""
    cfg = ControllerConfig(gamma_max=2, gamma_init=1, probe_every=5, min_steps=2, ceiling_probe_every=20)
    ctl = GoodputController(cfg)
    key = ("prose", "greedy")
    _draft_steps(ctl, key, 4.0, {1: 20.0, 2: 28.0}, alpha=0.3)
    d = ctl.decision(key)
    assert d["draft_ceiling_gamma"] == 1 and d["draft_ceiling_tokens_per_ms"] == pytest.approx(2 / 24, rel=1e-4)
    assert "the draft cannot pay on this engine: at α = 1 its best, γ=1, is 0.083 tok/ms = 0.83x plain" in d["why"]
    assert d["why"].endswith("probed ever more rarely, at most every 20 requests or 60 s")
    gammas = [ctl.policy_for(key).gamma() for _ in range(60)]
    assert [i + 1 for i, g in enumerate(gammas) if g] == [5, 15, 35, 55]
    # a cheap draft, off at α = 0.2 (γ=1: 1.2 / 13 < 0.1) but whose ceiling (2 / 13) beats plain, keeps the old cadence
    other = ("code", "greedy")
    _draft_steps(ctl, other, 1.0, {1: 12.0, 2: 14.0}, alpha=0.2)
    assert "cannot pay" not in ctl.decision(other)["why"]
    gammas = [ctl.policy_for(other).gamma() for _ in range(20)]
    assert [i + 1 for i, g in enumerate(gammas) if g] == [5, 10, 15, 20]


def test_off_says_when_no_proposer_could_pay_on_this_engine():
    """Plain 10 ms a step; the n-gram proposer's verifications of 2 rows 24 ms and of 4 rows 44 ms.
    Even accepted in full and free, γ=1 gives 2 / 24 = 0.083 tok/ms and γ=3 4 / 44 = 0.091, both
    below plain's 0.1: the decision says so, with the numbers. With 4 rows at 36 ms (4 / 36 =
    0.111 > 0.1) a proposer could pay, and it does not say it."""
    cfg = ControllerConfig(gamma_max=3, gamma_init=3, min_steps=2, proposers=("ngram",))
    key = ("prose", "greedy")

    def feed(ctl, four_rows_ms):
        for _ in range(4):
            ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
            ctl.observe(key, StepStats(1, 0, 1, 0, 0.0, 0.0, 24.0), proposer="ngram", asked=1)
            ctl.observe(key, StepStats(3, 0, 1, 0, 0.0, 0.0, four_rows_ms), proposer="ngram", asked=3)

    ctl = GoodputController(cfg)
    feed(ctl, 44.0)
    why = ctl.decision(key)["why"]
    assert why.startswith("off: plain 0.100 tok/ms beats every proposer")
    assert why.endswith("no proposer can pay on this engine now: even accepted in full and free, its best, γ=3, "
                        "is 0.091 tok/ms = 0.91x plain (a verification of 4 rows 44.00 ms, a plain step 10.00 ms)")
    other = GoodputController(cfg)
    feed(other, 36.0)
    assert "no proposer can pay" not in other.decision(key)["why"]


def _ngram_at(cfg, verify_3_rows_ms: float):
    """Plain 10 ms a step; the n-gram proposer at γ=2 with both proposals accepted every step (3
    tokens) in a verification of 3 rows taking ``verify_3_rows_ms``."""
    ctl = GoodputController(cfg)
    key = ("extract", "greedy")
    for _ in range(4):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
        ctl.observe(key, StepStats(2, 2, 3, -1, 2.0, 0.0, verify_3_rows_ms), proposer="ngram", asked=2)
    return ctl, key


def test_speculation_must_beat_plain_by_more_than_min_gain():
    """3 tokens per 29 ms (0.103 tok/ms) is 1.03x plain's 0.1: within the default 5 % margin, so
    plain decoding serves and the decision says why; with min_gain 0 the n-gram proposer serves;
    3 tokens per 27 ms (1.11x) clears the margin."""
    cfg = ControllerConfig(gamma_max=2, gamma_init=2, min_steps=2, proposers=("ngram",))
    ctl, key = _ngram_at(cfg, 29.0)
    d = ctl.decision(key)
    best = max(d["tokens_per_ms_by_proposer"]["ngram"].values())
    assert 1.0 < best / d["tokens_per_ms"][0] < 1.05  # the construction: ahead, but by less than 5 %
    assert d["gamma"] == 0 and not d["speculate"]
    assert "within the 5% margin (min_gain) of plain 0.100" in d["why"], d["why"]
    # the verdict is plain; a model-free proposer ahead within the margin is still measured every other
    # request until a full window of its requests is (tests/decoder/test_control_capped.py)
    assert [ctl.policy_for(key).gamma() for _ in range(4)] == [0, 2, 0, 2]
    assert ctl.decision(key)["gamma"] == 0
    assert ctl.batch_gamma(key, "ngram", 2, 2) == 0
    eager, _ = _ngram_at(ControllerConfig(gamma_max=2, gamma_init=2, min_steps=2, proposers=("ngram",), min_gain=0.0), 29.0)
    assert eager.decision(key)["gamma"] == 2 and eager.decision(key)["proposer"] == "ngram"
    clear, _ = _ngram_at(cfg, 27.0)
    d = clear.decision(key)
    assert d["tokens_per_ms_by_proposer"]["ngram"][2] / d["tokens_per_ms"][0] > 1.05
    assert d["gamma"] == 2 and d["why"].startswith("ngram γ=2:")


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), True, "5%"])
def test_min_gain_is_checked(bad):
    with pytest.raises(ValueError, match="min_gain"):
        ControllerConfig(min_gain=bad)


def test_among_proposers_a_hopeless_draft_drops_out_of_the_probe_rotation():
    """n-gram serves (3 tokens per 12 ms step against plain's 0.1 tok/ms); every probe_every
    requests one probes plain or the draft in turn, but a draft whose ceiling is below plain only
    at back-off intervals (5, 10, 20 = ceiling_probe_every requests apart)."""
    cfg = ControllerConfig(gamma_max=2, gamma_init=2, probe_every=5, min_steps=2, ceiling_probe_every=20,
                           proposers=("ngram", "draft"))
    ctl = GoodputController(cfg)
    key = ("code", "greedy")
    _draft_steps(ctl, key, 4.0, {1: 20.0, 2: 28.0}, alpha=0.3)
    for _ in range(4):
        ctl.observe(key, StepStats(2, 2, 3, -1, 2.0, 0.01, 12.0), proposer="ngram", asked=2)
    chosen = []
    for _ in range(40):
        pol = ctl.policy_for(key)
        g = pol.gamma()
        chosen.append(pol.proposer_name() if g else "plain")
    assert {i + 1 for i, c in enumerate(chosen) if c == "draft"} == {5, 15, 35}
    assert {i + 1 for i, c in enumerate(chosen) if c == "plain"} == {10, 20, 25, 30, 40}
    assert "the draft cannot pay on this engine" in ctl.decision(key)["why"]


def test_min_steps_zero_is_refused():
    """min_steps=0 let the controller choose from estimates it had not measured (KeyError: 0)."""
    with pytest.raises(ValueError, match="min_steps=0 must be >= 1"):
        ControllerConfig(min_steps=0)


def test_ceiling_probe_every_must_be_a_multiple_of_probe_every():
    with pytest.raises(ValueError, match="ceiling_probe_every=15 must be a multiple of probe_every=10"):
        ControllerConfig(probe_every=10, ceiling_probe_every=15)
    with pytest.raises(ValueError, match="ceiling_probe_every=0"):
        ControllerConfig(probe_every=10, ceiling_probe_every=0)
    with pytest.raises(ValueError, match="ceiling_probe_every=True"):
        ControllerConfig(probe_every=1, ceiling_probe_every=True)


def _result(version: int, proposer: str, alpha: float | None, workload: str = "prose"):
    """A request's result as the tracker reads it: 4 proposed tokens at α (None: decoded plain)."""
    from types import SimpleNamespace

    from decoder.metrics import AcceptanceCounts

    c = AcceptanceCounts(num_requests=1, num_steps=4, num_emitted_tokens=4)
    if alpha is not None:
        c.num_drafts, c.num_draft_tokens, c.alpha_sum = 1, 4, 4 * alpha
    return SimpleNamespace(workload=workload, sampling_bucket="greedy", adapter_version=version, counts=c,
                           proposer=proposer)


def _judged_results(reg):
    """A tracker, a rollback monitor on it (min_requests 3, margin 0.1) and serve(results), which
    feeds hand-made results to both as the serving loop does."""
    tracker = AcceptanceTracker()
    monitor = RollbackMonitor(reg.registry, tracker, min_requests=3, margin=0.1)

    def serve(results):
        for r in results:
            tracker.observe(r)
            monitor.check(r.adapter_version)

    return tracker, monitor, serve


def test_rollback_judges_an_adapter_on_the_requests_the_draft_served_only(pair, reg, tmp_path):
    """Under v0 the n-gram proposer served 10 requests at α 0.8 and the draft 3 at 0.2 (and 3 were
    plain); under v1 the draft served 3 at 0.25. Pooled over proposers v0's α is 0.66 and v1 would
    be rolled back (0.25 < 0.66 - 0.1); judged on the draft's requests alone it improved (0.20 ->
    0.25) and is kept. v2, whose draft requests fall to 0.05, is rolled back against v1's 0.25."""
    _, draft, _ = pair
    tracker, monitor, serve = _judged_results(reg)
    serve([_result(0, "ngram", 0.8)] * 10 + [_result(0, "draft", 0.2)] * 3 + [_result(0, "draft", None)] * 3)
    assert tracker.window("prose", "greedy", 0).counts.alpha == pytest.approx((10 * 3.2 + 3 * 0.8) / 52)
    assert tracker.window("prose", "greedy", 0, draft_only=True).counts.num_requests == 3
    v1 = reg.register(random_lora(draft, tmp_path / "v1", scale=0.1, seed=1))
    reg.registry.promote(v1, "trained")
    serve([_result(v1, "draft", 0.25)] * 3)
    d = monitor.decisions[-1]
    assert (d.version, d.previous, d.rolled_back) == (v1, 0, False)
    assert d.new_value == pytest.approx(0.25) and d.previous_value == pytest.approx(0.2)
    assert (d.new_requests, d.previous_requests) == (3, 3)
    v2 = reg.register(random_lora(draft, tmp_path / "v2", scale=0.1, seed=2))
    reg.registry.promote(v2, "trained")
    serve([_result(v2, "ngram", 0.9)] * 5 + [_result(v2, "draft", 0.05)] * 3)
    d = monitor.decisions[-1]
    assert (d.version, d.previous, d.rolled_back) == (v2, v1, True)
    assert d.new_value == pytest.approx(0.05) and d.previous_value == pytest.approx(0.25)
    assert reg.registry.active_version() == v1


def test_the_shift_detector_follows_each_proposer_apart():
    """30 requests of the n-gram proposer at α 0.8, then the controller switches prose to the
    draft at α 0.2: no traffic shift, and no alarm (one test over both would flag 0.8 -> 0.2).
    Then the draft's own α falls from 0.6 to 0.1: an alarm keyed (workload, bucket) with
    proposer "draft"."""
    tracker = AcceptanceTracker(detector=ShiftDetector(ShiftConfig(min_samples=5, lam=1.0)))
    for _ in range(30):
        tracker.observe(_result(0, "ngram", 0.8))
    for _ in range(30):
        tracker.observe(_result(0, "draft", 0.2))
    assert tracker.alarms == []
    pooled = ShiftDetector(ShiftConfig(min_samples=5, lam=1.0))  # what one test over both would say
    assert any(pooled.update(("prose", "greedy"), a) for a in [0.8] * 30 + [0.2] * 30)
    code = [_result(0, "draft", 0.6, "code")] * 20 + [_result(0, "draft", 0.1, "code")] * 20
    assert [tracker.observe(r) for r in code].count(None) == len(code) - 1
    (alarm,) = tracker.alarms
    assert alarm.key == ("code", "greedy") and alarm.proposer == "draft" and alarm.reference_alpha > 0.4
    assert tracker.status()["shift_alarms"][0]["key"] == "code@greedy"


def test_a_version_kept_on_one_key_is_still_judged_on_a_key_whose_evidence_comes_later(pair, reg, tmp_path):
    """v1 keeps prose at α 0.6 but breaks code (0.6 -> 0.05), where the controller soon stops
    serving the draft, so code's draft-served requests arrive last (here: after prose's). Kept on
    prose, v1 is rolled back once code has min_requests of them."""
    _, draft, _ = pair
    tracker, monitor, serve = _judged_results(reg)
    serve([_result(0, "draft", 0.6), _result(0, "draft", 0.6, "code")] * 3)
    v1 = reg.register(random_lora(draft, tmp_path / "v1", scale=0.1, seed=1))
    reg.registry.promote(v1, "trained")
    serve([_result(v1, "draft", 0.6)] * 3 + [_result(v1, "draft", 0.05, "code")] * 2)
    kept = monitor.decisions[-1]
    assert (kept.version, kept.key, kept.rolled_back) == (v1, "prose@greedy", False)
    serve([_result(v1, "draft", 0.6)] * 5)  # more prose: judged already, no new decision
    assert monitor.decisions[-1] is kept
    serve([_result(v1, "draft", 0.05, "code")])
    d = monitor.decisions[-1]
    assert (d.version, d.key, d.rolled_back) == (v1, "code@greedy", True)
    assert d.new_value == pytest.approx(0.05) and d.previous_value == pytest.approx(0.6)
    assert reg.registry.active_version() == 0


def test_eagle_is_offered_only_while_a_head_serves_warms_up_at_its_own_gamma_and_a_new_head_is_measured_again():
    head = {"v": 0}
    cfg = ControllerConfig(gamma_max=4, gamma_init=3, probe_every=50, min_steps=2, proposers=("eagle", "ngram"))
    ctl = GoodputController(cfg, head_version=lambda: head["v"], proposer_available=lambda n: n != "eagle" or head["v"] > 0)
    key = ("prose", "greedy")

    def request():
        pol = ctl.policy_for(key)
        g = pol.gamma()
        return (pol.proposer_name() if g else "plain"), g

    # no head: warm-up skips eagle (ngram at gamma_init, then plain)
    assert request() == ("ngram", 3)
    for _ in range(2):
        ctl.observe(key, StepStats(3, 3, 4, -1, 3.0, 0.01, 12.0), proposer="ngram", asked=3)
    assert request() == ("plain", 0)
    for _ in range(2):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    p, g = request()
    assert p == "ngram" and g >= 3  # every proposal accepted at 12 ms a step beats plain's 1 token per 10 ms
    # head v1 is swapped in: eagle warms up at eagle_gamma_init = 1, not gamma_init
    head["v"] = 1
    assert request() == ("eagle", 1)
    for _ in range(2):
        ctl.observe(key, StepStats(1, 1, 2, -1, 1.0, 2.0, 13.0), proposer="eagle", asked=1)
    assert ctl._keys[key].lengths["eagle"].steps == 2
    # a new head: its accepted lengths are unknown again, so it is measured again at γ = 1
    head["v"] = 2
    assert request() == ("eagle", 1)
    assert "eagle" not in ctl._keys[key].lengths
    # rolled back to no head: never offered, whatever was measured
    head["v"] = 0
    assert all(request()[0] != "eagle" for _ in range(60))


def test_eagle_gamma_init_outside_the_range_is_refused():
    with pytest.raises(ValueError, match="eagle_gamma_init=0 must lie in 1..gamma_max=8"):
        ControllerConfig(eagle_gamma_init=0)


def test_estimates_age_and_a_stale_hopeless_verdict_is_reprobed():
    """issue 37, item 9: a minute of CPU contention made the draft '122.5 ms per token', and the
    verdict it gave (the draft cannot pay) stood while the probes backed off to every 100 requests.
    Now a hopeless draft is re-probed at the first probe slot 60 s after its last probe, and a
    measurement after an idle gap weighs 1 - 2^(-gap / half-life) at least."""
    t = [0.0]
    cfg = ControllerConfig(gamma_max=2, gamma_init=1, probe_every=5, min_steps=2, ceiling_probe_every=100,
                           ceiling_reprobe_s=60.0, half_life_s=60.0)
    ctl = GoodputController(cfg, clock=lambda: t[0])
    key = ("prose", "greedy")
    _draft_steps(ctl, key, 122.5, {1: 20.0, 2: 28.0}, alpha=0.9)  # contention: the draft looks hopeless
    assert "cannot pay" in ctl.decision(key)["why"]
    gammas = [ctl.policy_for(key).gamma() for _ in range(40)]  # same second: the back-off (5, 15, 35)
    assert [i + 1 for i, g in enumerate(gammas) if g] == [5, 15, 35]
    t[0] = 61.0  # a minute later, at the next probe slot (request 45), the draft is probed again
    gammas = [ctl.policy_for(key).gamma() for _ in range(10)]
    assert [41 + i for i, g in enumerate(gammas) if g] == [45]
    # that probe measures 4 ms a token, 61 s after the last: weight 1 - 2^(-61/60) = 0.506, not ewma = 0.1
    before = ctl.decision(key)["t_draft_ms"]
    ctl.observe(key, StepStats(1, 1, 2, -1, 0.9, 4.0, 20.0))
    w = 1 - 0.5 ** (61 / 60)
    assert ctl.decision(key)["t_draft_ms"] == pytest.approx((1 - w) * before + w * 4.0, rel=1e-4)
    # within the same second the weight is ewma again
    after = ctl.decision(key)["t_draft_ms"]
    ctl.observe(key, StepStats(1, 1, 2, -1, 0.9, 4.0, 20.0))
    assert ctl.decision(key)["t_draft_ms"] == pytest.approx(0.9 * after + 0.1 * 4.0, rel=1e-4)


@pytest.mark.parametrize("field", ["ceiling_reprobe_s", "half_life_s"])
def test_ageing_settings_are_checked(field):
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match=f"{field}="):
            ControllerConfig(**{field: bad})


def test_a_version_is_judged_on_every_replicas_requests(pair, reg, tmp_path):
    """Two serving replicas, each with its tracker flushing the draft-proposed requests into the
    store's draft history. Under v0 each serves 2 prose requests at α 0.6; under v1 each serves 2
    at 0.1. With min_requests 3 neither replica alone has the evidence; judged on the merged
    history (4 + 4 requests, one of them still unflushed on replica A) v1 is rolled back, with the
    pooled α of both replicas' requests."""
    _, draft, _ = pair
    base = AcceptanceHistory(reg.client, reg.config)
    a = AcceptanceTracker(base, draft_history=base.of_kind("draft"))
    b = AcceptanceTracker(AcceptanceHistory(reg.client, reg.config), draft_history=base.of_kind("draft"))
    local = RollbackMonitor(reg.registry, a, min_requests=3, margin=0.1)
    merged = RollbackMonitor(reg.registry, a, min_requests=3, margin=0.1, merged=base.of_kind("draft"))
    for t in (a, b):
        for _ in range(2):
            t.observe(_result(0, "draft", 0.6))
        t.observe(_result(0, "ngram", 0.9))  # not the draft's: never judged
    for m in (local, merged):
        m.check(0)
    v1 = reg.register(random_lora(draft, tmp_path / "v1", scale=0.1, seed=1))
    reg.registry.promote(v1, "trained")
    b.observe(_result(v1, "draft", 0.1))
    b.observe(_result(v1, "draft", 0.1))
    a.observe(_result(v1, "draft", 0.1))
    a.flush(), b.flush()
    row = base.of_kind("draft").totals(workload="prose@greedy", version=0)
    assert row.requests == 4 and row.pooled_alpha == pytest.approx(0.6)  # the n-gram requests are not in it
    a.observe(_result(v1, "draft", 0.1))  # replica A's latest, not flushed yet
    assert local.check(v1) is None  # 2 requests of v1 here: not enough
    d = merged.check(v1)
    assert d is not None and d.rolled_back and (d.version, d.previous) == (v1, 0)
    assert (d.new_requests, d.previous_requests) == (4, 4)
    assert d.new_value == pytest.approx(0.1) and d.previous_value == pytest.approx(0.6)
    assert reg.registry.active_version() == 0


def test_the_merged_monitor_judges_its_own_windows_while_redis_is_down(pair, reg, tmp_path):
    _, draft, _ = pair
    dead = AcceptanceHistory(redis.Redis(port=1, socket_connect_timeout=0.2), reg.config, kind="draft")
    tracker = AcceptanceTracker()
    monitor = RollbackMonitor(reg.registry, tracker, min_requests=3, margin=0.1, merged=dead)
    for _ in range(3):
        tracker.observe(_result(0, "draft", 0.6))
    monitor.check(0)
    v1 = reg.register(random_lora(draft, tmp_path / "v1", scale=0.1, seed=1))
    reg.registry.promote(v1, "trained")
    for _ in range(3):
        tracker.observe(_result(v1, "draft", 0.1))
    d = monitor.check(v1)
    assert d is not None and d.rolled_back and (d.new_requests, d.previous_requests) == (3, 3)
    assert monitor.merged_read_errors == 1


def test_alpha_moves_by_ewma_per_request_not_per_step():
    """A request's steps share its prompt, so the draft's α moves by ``ewma`` per request: 12
    requests of 20 steps at α 0.5 then one at 0.9 give 0.5 + 0.4 (1 - Π_k 0.9^(13 / (240 + k)))
    (the per-step weight 1 - 0.9^(1 / mean steps per request), the mean counted as the steps come),
    where a per-step EWMA gave 0.5 + 0.4 (1 - 0.9^20) = 0.851: the last request alone. A young
    estimate is the plain mean of its steps: after 3 requests at 0.5 and one at 0.9, 0.6."""
    from decoder.control import DRAFT

    def run(requests, first=True):
        ctl = GoodputController(ControllerConfig(proposers=(DRAFT,)))
        key = ("code", "greedy")
        for a in requests:
            for i in range(20):
                ctl.observe(key, StepStats(2, 1, 2, 1, 2 * a, 1.0, 10.0), proposer=DRAFT,
                            first=(i == 0) if first else None)
        return ctl._keys[key].alpha.value

    assert run([0.5] * 3 + [0.9]) == pytest.approx((60 * 0.5 + 20 * 0.9) / 80)
    want = 0.5 + 0.4 * (1 - math.prod(0.9 ** (13 / (240 + k)) for k in range(1, 21)))
    assert run([0.5] * 12 + [0.9]) == pytest.approx(want, abs=1e-9) and want == pytest.approx(0.5414, abs=1e-4)
    assert run([0.5] * 12 + [0.9], first=None) == pytest.approx(0.5 + 0.4 * (1 - 0.9 ** 20))  # per step


def test_accepted_lengths_move_by_ewma_per_request_too():
    """The n-gram proposer's P(accepted >= 1): 12 requests of 10 steps all accepted, then one of
    10 steps all rejected: 1 - (1 - Π_k 0.9^(13 / (120 + k))) ≈ 0.9, not 0.9^10 = 0.35."""
    from decoder.control import DRAFT

    ctl = GoodputController(ControllerConfig(proposers=("ngram", DRAFT)))
    key = ("extract", "greedy")
    for acc in [1] * 12 + [0]:
        for i in range(10):
            ctl.observe(key, StepStats(1, acc, 1 + acc, -1 if acc else 0, 0.0, 0.1, 10.0), proposer="ngram",
                        asked=1, first=i == 0)
    want = math.prod(0.9 ** (13 / (120 + k)) for k in range(1, 11))
    assert ctl._keys[key].lengths["ngram"].p_ge(1) == pytest.approx(want, abs=1e-9)


def test_an_ngram_probed_again_after_a_gap_is_priced_at_its_steps_cost_now():
    """The n-gram's step costs age like plain decoding's (half_life_s): 10 requests of 10 steps
    at 10 ms, then, two half-lives (120 s) later, one step at 20 ms weighs 3/4 (1 - 2^-2): 17.5 ms,
    where the per-request weight alone (about 0.011 a step) kept it at 10.1 ms. The tokens of those
    steps age alike (one ratio over the same steps): 3 tokens throughout, 3 / 17.5 tok/ms. The
    accepted lengths do not age."""
    t = [0.0]
    ctl = GoodputController(ControllerConfig(proposers=("ngram", "draft"), gamma_max=2, gamma_init=2, half_life_s=60.0),
                            clock=lambda: t[0])
    key = ("extract", "greedy")
    for r in range(10):
        for i in range(10):
            t[0] += 0.01
            ctl.observe(key, StepStats(2, 2, 3, -1, 0.0, 0.0, 10.0), proposer="ngram", asked=2, first=i == 0)
    m = ctl._keys[key].lengths["ngram"]
    assert m.step_ms[2].value == pytest.approx(10.0)
    t[0] += 120.0
    ctl.observe(key, StepStats(2, 1, 2, 1, 0.0, 0.0, 20.0), proposer="ngram", asked=2, first=True)
    assert m.step_ms[2].value == pytest.approx(10.0 + 0.75 * 10.0)
    assert m.tokens[2].value == pytest.approx(3.0 - 0.75 * 1.0)  # 2 tokens that step, weighed alike
    wl = 1.0 - 0.9 ** (11 / 101)  # the per-request weight: 11 requests, 101 steps
    assert m.ge[0].value == pytest.approx(1.0) and m.ge[1].value == pytest.approx(1.0 - wl)  # not aged
    d = ctl.decision(key)
    assert d["tokens_per_ms_by_proposer"]["ngram"][2] == pytest.approx(2.25 / 17.5, rel=1e-3)


def test_each_request_policy_marks_its_first_step():
    """The policies tell the controller where a request starts (observe's ``first``): two
    requests of 5 and 3 steps count as 8 steps of 2 requests of the proposer that served them;
    steps that asked for no proposal (plain decoding) count for none."""
    from decoder.control import DRAFT

    ctl = GoodputController(ControllerConfig(proposers=(DRAFT,), gamma_init=2))
    key = ("prose", "greedy")
    for steps in (5, 3):
        pol = ctl.policy_for(key)
        for _ in range(steps):
            g = pol.gamma()
            pol.update(StepStats(g, 0, 1, 0 if g else -1, 0.3 * g, 1.0, 10.0))
    assert {p: n for p, n in ctl._keys[key].served.items()} == {DRAFT: [8, 2]}
    pol = ctl.policy_for(("math", "greedy"))
    for g in (0, 0, 2, 2):  # a request that starts with plain steps: its first proposing step is its first
        ctl.observe(("math", "greedy"), StepStats(g, 0, 1, 0 if g else -1, 0.3 * g, 1.0, 10.0), proposer=DRAFT,
                    first=not pol._updated)
        pol._updated = pol._updated or g > 0
    assert ctl._keys[("math", "greedy")].served == {DRAFT: [2, 1]}


def test_remeasure_costs_forgets_what_steps_cost_and_what_was_accepted():
    """Beside a trainer every verified row cost more: the n-gram proposer's 3 tokens per 30 ms
    step tied plain decoding's 0.1 tok/ms, so plain served. After the trainer stops,
    remeasure_costs makes each proposer warm up again, and the same acceptance at the quiet
    step cost (14 ms) wins: 3 / 14 = 0.214 tok/ms. The n-gram proposer's accepted lengths are
    learnt again with its costs (its gate proposes by them), and the draft's α from the steps
    after it (the requests after a re-measurement are not the ones α was learnt on)."""
    cfg = ControllerConfig(gamma_max=2, gamma_init=2, probe_every=50, min_steps=2, proposers=("ngram", "draft"))
    ctl = GoodputController(cfg)
    key = ("extract", "greedy")
    _draft_steps(ctl, key, 4.0, {1: 20.0, 2: 28.0}, alpha=0.3)
    for _ in range(4):
        ctl.observe(key, StepStats(2, 2, 3, -1, 2.0, 0.0, 30.0), proposer="ngram", asked=2)
    before = ctl.decision(key)
    assert before["tokens_per_ms_by_proposer"]["ngram"][2] == pytest.approx(3 / 30, rel=1e-3)
    assert not before["speculate"]  # 0.1 tok/ms: not 5 % above plain's 0.1
    alpha = before["alpha"]

    assert alpha == pytest.approx(0.3, abs=0.02)
    assert ctl.remeasure_costs() == 1
    d = ctl.decision(key)
    assert d["t_plain_ms"] is None and d["t_verify_ms"][2] is None and d["alpha"] is None
    assert ctl._keys[key].clusters == {} and ctl._keys[key].served == {}
    assert "ngram" not in d["tokens_per_ms_by_proposer"] and ctl._keys[key].lengths["ngram"].ge == []
    pol = ctl.policy_for(key)
    assert pol.gamma() == 2 and pol.proposer_name() == "ngram" and pol.decision["why"] == "warm-up: measuring ngram at γ=2"
    for _ in range(2):  # quiet: the same 2 of 2 accepted, at 14 ms a step
        ctl.observe(key, StepStats(2, 2, 3, -1, 2.0, 0.0, 14.0), proposer="ngram", asked=2)
    pol = ctl.policy_for(key)
    assert pol.gamma() == 2 and pol.proposer_name() == "draft"  # then the draft's costs
    for _ in range(2):  # the draft's steps after it: α = 1.2 / 2 = 0.6 a proposal (the 0.3 before is gone)
        ctl.observe(key, StepStats(2, 0, 1, 0, 1.2, 4.0, 14.0))
    pol = ctl.policy_for(key)
    assert pol.gamma() == 0 and pol.decision["why"] == "warm-up: measuring plain decoding"
    for _ in range(2):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    d = ctl.decision(key)
    assert d["alpha"] == pytest.approx(0.6)
    assert d["tokens_per_ms"][0] == pytest.approx(0.1)
    assert d["tokens_per_ms_by_proposer"]["ngram"][2] == pytest.approx(3 / 14, rel=1e-3)
    pol = ctl.policy_for(key)
    assert (pol.gamma(), pol.proposer_name()) == (2, "ngram")


def test_step_cost_clear_forgets_every_reading():
    from decoder.proposers.cost import StepCost

    c = StepCost()
    for _ in range(3):
        c.add(1, 10.0)
        c.add(3, 30.0)
    assert c.ms(3) == pytest.approx(30.0)
    c.clear()
    assert math.isnan(c.ms(1)) and c.status() == {}
    c.add(1, 10.0)
    c.add(3, 14.0)
    assert c.ms(3) == pytest.approx(14.0)


def test_an_ngram_is_priced_at_plain_decodings_load_through_its_own_plain_steps():
    """A load that moves within seconds: the n-gram served 8 requests (10 steps each at γ = 2: 5
    without a match, one row at 10 ms, and 5 copying 2 tokens in 16 ms) before a load spike, then
    40 plain steps at 20 ms. Plain's step follows the spike step by step (about 19.9 ms), the
    n-gram's costs request by request (about 13 ms a step, 2 tokens): 2 / 13 against 1 / 19.9 priced
    it at about 3.1x plain. Its own one-row steps (10 ms, at the moments it ran) put its costs at
    plain's load: 13 x 19.9 / 10, so its ratio to plain is what it was at one load, 2 x 10 / 13."""
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), gamma_max=2, gamma_init=2, min_steps=8))
    key = ("extract", "greedy")
    for r in range(8):
        for i in range(10):
            copying = i % 2 == 1
            st = StepStats(2, 2, 3, -1, 0.0, 0.0, 16.0) if copying else StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0, asked=2)
            ctl.observe(key, st, proposer="ngram", asked=2, first=i == 0)
    m, s = ctl._keys[key].lengths["ngram"], ctl._keys[key]
    assert m.base_ms.value == pytest.approx(10.0) and m.base_ms.n == 40
    for _ in range(40):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 20.0))
    plain_now = s.verify_ms[0].value
    assert 19.5 < plain_now < 20.0
    d = ctl.decision(key)
    rate, plain = d["tokens_per_ms_by_proposer"]["ngram"][2], d["tokens_per_ms"][0]
    want = m.tokens[2].value / (m.step_ms[2].value * plain_now / 10.0)  # its costs at plain's load now
    assert rate == pytest.approx(want, rel=1e-3) and plain == pytest.approx(1.0 / plain_now, rel=1e-3)
    ratio = m.tokens[2].value * 10.0 / m.step_ms[2].value  # the ratio at one load, by hand from its own EWMAs
    assert rate / plain == pytest.approx(ratio, rel=1e-3) and 1.3 < ratio < 1.8, (rate / plain, ratio)
    # fewer than min_steps steps without a match: its costs as measured (nothing to put them at plain's load with)
    few = GoodputController(ControllerConfig(proposers=("ngram",), gamma_max=2, gamma_init=2, min_steps=8))
    for i in range(4):
        few.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0, asked=2), proposer="ngram", asked=2, first=i == 0)
        few.observe(key, StepStats(2, 2, 3, -1, 0.0, 0.0, 16.0), proposer="ngram", asked=2, first=False)
    f = few._keys[key].lengths["ngram"]
    assert f.base_ms.n == 4 and f.at_load(13.0, 20.0, 8) == 13.0 and f.at_load(13.0, 20.0, 4) == pytest.approx(26.0)


def test_a_one_row_step_after_a_copy_is_not_read_as_plain_decodings_step():
    """llama.cpp rebuilds its graph when a forward's shape changes: an n-gram request's no-match
    step right after a copy (a 3-row step) costs 12 ms, one after another no-match step 10 ms,
    and plain decoding's steps, one row after one row, 10 ms; the first step after the prefill
    pays the rebuild too (13 ms). Requests of 12 steps: the n-gram's repeat (copy, no match
    after it, no match after that) four times; plain decoding's all one row. Read as before, a
    plain step would be the mean of 10 and 12 ms no-match steps and the n-gram's price would rest on it;
    read only after one row, plain's step is 10 ms, the n-gram's load reference (its own one-row
    steps) 10 ms, and its price is its own steps' tokens over their ms, by hand."""
    from decoder.control import ControlledGamma

    class Tick:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Tick()
    ctl = GoodputController(ControllerConfig(proposers=("ngram",), gamma_max=2, gamma_init=2, min_steps=2,
                                             probe_every=1000, unsure_probe_every=1000,
                                             ceiling_probe_every=1000), clock=clock)
    key = ("extract", "greedy")

    def request(pattern, first_ms=13.0):
        pol = ControlledGamma(ctl, key)
        for i, kind in enumerate(pattern):
            pol.gamma()
            if kind == "copy":
                st = StepStats(2, 2, 3, -1, 0.0, 0.0, 16.0, asked=2)
            else:
                ms = first_ms if i == 0 else 12.0 if pattern[i - 1] == "copy" else 10.0
                st = StepStats(0, 0, 1, -1, 0.0, 0.0, ms, asked=2 if kind == "none" else 0)
            clock.t += st.verify_ms / 1e3
            pol.update(st)

    # plain decoding's warm-up takes every one-row step until min_steps are read (a key of one- or
    # two-token requests has no other): a first plain request whose first step costs what the rest do
    request(["plain"] * 12, first_ms=10.0)
    for _ in range(6):
        request(["none"] + ["copy", "none", "none"] * 3 + ["copy", "none"])  # 12 steps
    request(["plain"] * 12)
    s, m = ctl._keys[key], ctl._keys[key].lengths["ngram"]
    assert s.verify_ms[0].value == pytest.approx(10.0)  # no 12 or 13 ms reading in it
    assert m.base_ms.value == pytest.approx(10.0)
    d = ctl.decision(key)
    # per request: 4 copies (16 ms, 3 tokens each), 4 no-match steps after a copy (12 ms), 3 after
    # a no-match step (10 ms), one after the prefill (13 ms), 1 token each: 20 tokens in 12 steps
    tokens, ms = 4 * 3 + 8 * 1, 4 * 16.0 + 4 * 12.0 + 3 * 10.0 + 13.0
    assert m.tokens[2].value == pytest.approx(tokens / 12) and m.step_ms[2].value == pytest.approx(ms / 12)
    assert d["tokens_per_ms"][0] == pytest.approx(1 / 10.0, rel=1e-3)
    assert d["tokens_per_ms_by_proposer"]["ngram"][2] == pytest.approx(tokens / ms, rel=1e-3)


def test_a_stalled_step_counts_at_stall_factor_times_the_estimate():
    """20 plain steps of 10 ms, then one stalled at 300 ms (another thread held the core): read
    at 3 x 10 = 30 ms, the EWMA (weight 0.1) moves to 10 + 0.1 x (30 - 10) = 12 ms, not to 39; a load
    that doubles (20 ms steps) passes whole: 12 + 0.1 x 8 = 12.8. Below min_steps readings nothing
    is cut (no estimate to cut against); stall_factor=0 never cuts."""
    key = ("math", "greedy")
    ctl = GoodputController(ControllerConfig(min_steps=8, half_life_s=math.inf))
    for _ in range(20):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
    ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 300.0))
    assert ctl._keys[key].verify_ms[0].value == pytest.approx(12.0)
    ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 20.0))
    assert ctl._keys[key].verify_ms[0].value == pytest.approx(12.8)
    ctl.observe_overhead(key, 0.5)
    for _ in range(9):
        ctl.observe_overhead(key, 0.5)
    ctl.observe_overhead(key, 250.0)
    assert ctl._keys[key].overhead_ms.value == pytest.approx(0.5 + 0.1 * (1.5 - 0.5))
    young = GoodputController(ControllerConfig(min_steps=8, half_life_s=math.inf))
    for ms in (10.0, 10.0, 300.0):
        young.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, ms))
    assert young._keys[key].verify_ms[0].value == pytest.approx(10.0 + 0.1 * 290.0)
    off = GoodputController(ControllerConfig(min_steps=8, half_life_s=math.inf, stall_factor=0))
    for ms in [10.0] * 20 + [300.0]:
        off.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, ms))
    assert off._keys[key].verify_ms[0].value == pytest.approx(39.0)
    for bad in (1.0, 0.5, -2, float("nan"), "3", True):
        with pytest.raises(ValueError, match="stall_factor"):
            ControllerConfig(stall_factor=bad)


def test_plain_decodings_warm_up_ends_on_a_key_of_two_token_requests():
    """A request of 2 tokens has one step, right after its prefill (a graph rebuild): read only
    after one row, plain decoding would never be measured and the key would warm up forever
    (the break session's repro). Until min_steps plain readings exist, such steps count; after,
    they do not."""
    from decoder.control import ControlledGamma

    ctl = GoodputController(ControllerConfig(proposers=("ngram",), gamma_max=2, gamma_init=2, min_steps=3))
    key = ("tiny", "greedy")
    for i in range(5):
        pol = ControlledGamma(ctl, key)
        pol.gamma()
        pol.update(StepStats(0, 0, 1, -1, 0.0, 0.0, 12.0 + i, asked=0))
    e = ctl._keys[key].verify_ms[0]
    assert e.n == 3  # the first three (warm-up), not the last two (after the prefill, warm)
    assert e.value == pytest.approx(12.1 + 0.1 * (14.0 - 12.1), rel=1e-6)  # 12, then 13 and 14 at weight 0.1
    assert ctl.decision(key)["t_plain_ms"] is not None


def test_a_step_after_a_fused_forward_is_read_by_that_forwards_rows(monkeypatch):
    """A request decoded in a batch of 2 (fused forwards of 2 rows, one of them its own plain
    row), then alone: its first step alone follows a 2-row forward (a graph rebuild, 13 ms) and
    is not plain decoding's step; the next one (after one row, 10 ms) is."""
    import decoder.control as control
    from decoder.control import ControlledGamma

    ctl = GoodputController(ControllerConfig(proposers=("ngram",), gamma_max=2, gamma_init=2, min_steps=2))
    key = ("chat", "greedy")
    for _ in range(3):  # warm plain decoding up alone: 10 ms after one row
        pol = ControlledGamma(ctl, key)
        for _ in range(3):
            pol.gamma()
            pol.update(StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0, asked=0))
    e = ctl._keys[key].verify_ms[0]
    n0 = e.n
    pol = ControlledGamma(ctl, key)
    fused = {"size": 2, "rows": 2}
    monkeypatch.setattr(control, "last_fused_size", lambda: fused["size"])
    monkeypatch.setattr(control, "last_fused_rows", lambda: fused["rows"])
    monkeypatch.setattr(control, "routed_batch_size", lambda: fused["size"])
    pol.gamma()
    pol.update(StepStats(0, 0, 1, -1, 0.0, 0.0, 15.0, asked=0))  # inside the batch (its own reading, scaled)
    n1 = e.n
    fused.update(size=1, rows=1)
    pol.gamma()
    pol.update(StepStats(0, 0, 1, -1, 0.0, 0.0, 13.0, asked=0))  # alone, after the 2-row forward
    assert e.n == n1
    pol.gamma()
    pol.update(StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0, asked=0))  # alone, after one row
    assert e.n == n1 + 1 and n1 >= n0


def test_plain_decoding_is_never_priced_above_the_engines_median_plain_step():
    """The key's plain EWMA read 17 ms (its last readings: a slow request) while the engine's last
    plain steps ran 10 ms. The draft, 2 ms a token, a 2-row verification 14 ms, α = 0.6:
    1.6 / 16 = 0.1 tok/ms. Against plain at 17 ms (0.0588 tok/ms) it looked 1.7x plain; against
    the engine's median, 10 ms (0.1 tok/ms), it ties, and plain serves. Where the engine's median is
    the dearer one, or has fewer than min_steps readings, the key's own EWMA stands."""
    from decoder.proposers.cost import StepCost

    def setup(engine_ms: float, engine_steps: int):
        cost = StepCost()
        for _ in range(engine_steps):
            cost.add(1, engine_ms)
        ctl = GoodputController(ControllerConfig(gamma_max=1, gamma_init=1, min_steps=4, probe_every=50,
                                                 confidence=0.5), step_cost=cost)
        key = ("code", "greedy")
        for _ in range(6):
            ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 17.0))
            ctl.observe(key, StepStats(1, 0, 1, 0, 0.6, 2.0, 14.0))
        return ctl.decision(key)

    d = setup(10.0, 8)
    assert d["t_plain_ms"] == pytest.approx(10.0)
    assert d["tokens_per_ms"][0] == pytest.approx(0.1) and d["tokens_per_ms"][1] == pytest.approx(0.1)
    assert not d["speculate"]
    for engine_ms, steps in ((10.0, 3), (20.0, 8)):  # too few engine readings; or the engine's the dearer
        d = setup(engine_ms, steps)
        assert d["t_plain_ms"] == pytest.approx(17.0)
        assert d["tokens_per_ms"][0] == pytest.approx(1 / 17, rel=1e-3) and d["speculate"] and d["gamma"] == 1
