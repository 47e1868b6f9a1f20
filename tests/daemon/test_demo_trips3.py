"""The quick demo's console trips of the walkthroughs at bb6e662 and ec0c85b (docs/walkthroughs.md,
their "Trips" lists): the first live line's rate of one request, two names for the bootstrapped
adapter, step costs that fall with more rows and the plain steps prices divide by, a ratio from one
request, a promotion that lowered another workload within the trainer's tolerance, the live rate
against the evaluation's, a plain pick's cells, and the re-measurement's alarm counts."""

import io
import math
import types

import pytest
from rich.console import Console

import daemon.demo as demo
from daemon.demo import DemoConfig
from test_demo_trips2 import _printed  # the report as printed at 600 columns


def _row(**kw) -> dict:
    return {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0} | kw


def _phase(workload: str, **kw) -> dict:
    return {"workload": workload, "heldout_samples": 0, "adapter_at_phase_end": 0, "final_adapter": 0,
            "plain": _row(), "frozen": _row(matches_plain="8/8"), "adapted_draft": _row(matches_plain="8/8"),
            "adapted": _row(same_run_as="plain"), "controller_pick": {"why": "off: plain"},
            "served": {"requests": 10, "repeats": 0}, "live_first_third": {"alpha": None},
            "live_last_third": {"alpha": None}} | kw


# 1. the first live line ------------------------------------------------------------------------------------

def test_the_first_live_line_says_first_request_served_not_a_rate_of_one_request():
    """ec0c85b's first line: "prose: 1 request in 0 s; last 1: α 0.75, τ 1.39 (one request's ...),
    18.8 tokens/s": no rate from one request in under a second; what is known instead."""
    one = [{"workload": "prose", "alpha": 0.75, "tau": 1.39, "tokens_per_s": 18.8, "adapter_version": 0}]
    line = demo._progress_line(one, "prose", 1, 0.4)
    assert line == ("prose: first request served (its rolling α and tokens/s once there are more); "
                    "no adapter yet (the draft waits for v0)"), line
    assert demo._progress_line(one, "prose", 1, 9.0).startswith("prose: first request served (")  # one request, any time
    three = one * 3
    assert demo._progress_line(three, "prose", 3, 0.6).startswith("prose: 3 requests served (its rolling")  # under 1 s
    # two requests over 3 s: a rolling α (0.75 each) and the rate
    assert demo._progress_line(one * 2, "prose", 2, 3.0) == (
        "prose: 2 requests in 3 s; last 2: α 0.750, τ 1.39 (2 speculated), 18.8 tokens/s; "
        "no adapter yet (the draft waits for v0)")


def test_the_live_lines_seconds_include_the_request_just_served(monkeypatch):
    """The line's seconds were read before its request was served, so the first line said "in 0 s"
    of a request that took seconds. Each request here takes 5 s (a clock that moves 1 s a read):
    the first line's seconds cover it."""
    clock = types.SimpleNamespace(t=1000.0)

    def now():
        clock.t += 1.0
        return clock.t

    fake_time = types.SimpleNamespace(time=now, monotonic=lambda: clock.t, perf_counter=lambda: clock.t)
    seen = []

    def serve_one(*a, **k):
        clock.t += 5.0
        return {"t": 0.0, "workload": "prose", "alpha": None, "tau": 1.0, "tokens_per_s": 6.0, "adapter_version": 1}

    monkeypatch.setattr(demo, "time", fake_time)
    monkeypatch.setattr(demo, "_serve_one", serve_one)
    monkeypatch.setattr(demo, "_progress_table", lambda *a, **k: None)
    monkeypatch.setattr(demo, "_progress_line", lambda tl, phase, n, s: seen.append((n, s)) or "")
    monkeypatch.setattr(demo, "_prompts", lambda *a, **k: ["p"] * 3)
    loop = types.SimpleNamespace(manager=None, controller=None, heads=None, decoder=types.SimpleNamespace(adapter_version=1))
    demo._serve_phases(DemoConfig.quick(phases=("prose",), phase_seconds=10.0), None, loop, None, "m", None,
                       types.SimpleNamespace(bucket=lambda: "greedy"), Console(file=io.StringIO()), None)
    assert seen and seen[0][0] == 1 and seen[0][1] >= 5.0, seen


# 2. one name for the bootstrapped adapter -------------------------------------------------------------------

def test_the_loading_line_names_the_bootstrap_by_its_registry_version_once(monkeypatch, tmp_path):
    """ec0c85b: "v0: v0 bootstrap (trained now, ...)" then "serving v1": the registry registers the
    v0 bootstrap as v1 (version 0 is the base draft), so the loading line says "v1 (the v0
    bootstrap, ...)" and the live lines' "serving v1" names the same adapter. The reason is the one
    daemon.warm_start writes."""
    import daemon.settings
    import daemon.warm_start as ws

    class Registry:
        def register(self, path, meta):
            return 1

        def promote(self, version, reason):
            self.reason = reason

    (tmp_path / "adapter").mkdir()
    meta = {"alpha_base": 0.174, "alpha_after": 0.334, "steps": 60, "cpu_seconds": 186.0, "adapter_meta": {}}
    v0 = ws._promote(tmp_path, "abc123", meta, Registry(), "trained")
    assert v0.version == 1
    monkeypatch.setattr(ws, "ensure_v0", lambda *a, **k: v0)
    monkeypatch.setattr(daemon.settings, "warm_start_config", lambda s: None)
    out = io.StringIO()
    models = types.SimpleNamespace(pair=None, fp=None)
    settings = types.SimpleNamespace(trainer=types.SimpleNamespace(precision="fp32"))
    demo._warm_start(settings, models, None, None, Console(file=out, width=300))
    text = " ".join(out.getvalue().split())
    assert ("v1 (the v0 bootstrap, trained now, abc123): held-out α 0.174 -> 0.334 in 60 steps, 3.1 CPU minutes; "
            "served as v1 from here on") in text, text
    assert "v0: v0" not in text
    # a reason in another wording is kept whole behind the name
    assert demo._v0_line(3, "registry: kept") == "v3 (the v0 bootstrap): registry: kept; served as v3 from here on"


# 3. step costs as priced, and which plain step each price divides by ----------------------------------------

STOPPED = {1: 11.39, 2: 32.60, 3: 32.20, 5: 43.64}  # ec0c85b's re-measured costs: 3 rows below 2 rows'


def test_step_costs_that_fall_with_more_rows_are_priced_on_the_monotone_fit_and_called_noise():
    # priced on the least-squares fit that never falls with more rows (tests/daemon/test_demo_isotonic.py),
    # no longer the running max: 2 and 3 rows at (32.60 + 32.20) / 2 = 32.40, not both at 32.60
    envelope, dips = demo._running_max({str(k): v for k, v in STOPPED.items()})
    assert envelope == pytest.approx({1: 11.39, 2: 32.40, 3: 32.40, 5: 43.64}, abs=1e-9) and dips == [(3, 32.20, 2, 32.60)]
    assert demo._running_max({1: 1.0, 2: 2.0}) == ({1: 1.0, 2: 2.0}, [])
    # the ceiling at a dip: 2 rows 20 ms, 3 rows 14 ms (raw γ=2: 3 x 10 / 14 = 2.14x); priced at their mean,
    # 17 ms, γ=2 gives 3 x 10 / 17 = 1.76x, above γ=1's 2 x 10 / 17 = 1.18 and γ=3's 4 x 10 / 30 = 1.33
    cost = {1: 10.0, 2: 20.0, 3: 14.0, 4: 30.0}
    raw = {"by_gamma": {1: 1.0, 2: 2.143, 3: 1.333}, "gamma": 2, "speedup": 2.143}
    line = demo._ceiling_line(raw, cost, "with the trainer stopped")
    assert "at most 1.76x plain (γ=2," in line and "at most 2.14x" not in line, line
    assert ("; 3 rows measured 14.00 ms, below 2 rows' 20.00: noise between two readings (a verification of more "
            "rows cannot cost less), priced on the least-squares fit that never falls with more rows: 2 and 3 rows at "
            "17.00 ms, the mean of their readings") in line
    # costs that rise: the line as before, no noise clause
    assert "noise" not in demo._ceiling_line({"by_gamma": {1: 1.0}, "gamma": 1, "speedup": 1.0}, {1: 10.0, 2: 20.0}, "x")


def test_the_leviathan_prediction_prices_a_verification_of_more_rows_never_below_fewer():
    """ec0c85b's table read t(n)/t(1) 2.86 2.83 3.33 3.83: 3 rows cheaper than 2. The prediction
    now reads both on the monotone fit (no longer the running max's 32.60 / 11.39 = 2.862): (32.60 +
    32.20) / 2 / 11.39 = 32.40 / 11.39 = 2.845; 4 rows (unmeasured) on the line from 3 to 5 rows,
    32.20 + (43.64 - 32.20) / 2 = 37.92 ms, / 11.39 = 3.329."""
    from decoder.metrics import AcceptanceCounts
    from decoder.proposers.cost import read_off

    draft = AcceptanceCounts(num_draft_tokens=10, alpha_sum=5.0, num_accepted_tokens=5, num_drafts=10, draft_ms=10.0)
    plain = AcceptanceCounts(num_steps=5, decode_ms=20.0)
    p = demo.leviathan_prediction(draft, plain, lambda n: read_off(STOPPED, n), gamma_max=4)
    rows = p["verify_cost_rows"]
    assert rows[2] == rows[3] == round(32.40 / 11.39, 3) == 2.845 and rows[4] == round(37.92 / 11.39, 3), rows
    assert rows[5] == round(43.64 / 11.39, 3)


def test_the_screen_names_which_plain_step_each_price_divides_by():
    """ec0c85b's screen priced on 11.39 ms (re-measured), 9.94 (beside the trainer), the picks'
    9.09-10.79 and report.json's top-level 9.27, none named. One line names each set, once; the
    Leviathan caption says its costs are the monotone fit and names the dip."""
    pred = {"alpha": 0.5, "c": 0.3, "tau": 2.0, "verify_cost_rows": {2: 2.862, 3: 2.862}, "one_step": None,
            "this_engine": None, "step_cost_ms": STOPPED}
    phases = [_phase("prose", controller_pick={"why": "off: plain", "t_plain_ms": 9.09},
                     adapted_draft=_row(matches_plain="8/8", prediction=pred)),
              _phase("math", controller_pick={"why": "off: plain", "t_plain_ms": 10.79})]
    beside = {"step_cost_ms": {1: 9.94, 2: 30.26, 5: 67.19},
              "engine_ceiling": {"by_gamma": {1: 0.657, 4: 0.739}, "gamma": 4, "speedup": 0.739}}
    rem = {"requests": 64, "step_cost_ms": STOPPED, "beside_trainer": beside,
           "engine_ceiling": {"by_gamma": {1: 0.699, 2: 1.061, 4: 1.305}, "gamma": 4, "speedup": 1.305}}
    text = " ".join(_printed({"phases": phases, "remeasured": rem, "step_cost_ms": {1: 9.27, 2: 27.02}}).split())
    assert ("which plain step each price divides by: the ceiling with the trainer stopped and the Leviathan table, "
            "StepCost's steps by verified rows re-measured with the trainer stopped (11.39 ms); the ceiling while "
            "serving, the same beside the trainer (9.94 ms); each pick's `why`, the controller's own steps of that "
            "workload, re-measured too (a plain step 9.09-10.79 ms); report.json's top-level step_cost_ms (9.27 ms) "
            "is StepCost after the evaluation's own steps, which priced nothing here") in text, text
    assert text.count("which plain step each price divides by") == 1
    # the fit's wording (no longer "the running max", "priced at the fewer rows' cost")
    assert ("t(n) as the least-squares fit that never falls with more rows; 3 rows measured below 2 rows', pooled "
            "at the mean of their run: noise, as the first engine ceiling line below says)") in text, text
    assert text.count("3 rows measured 32.20 ms, below 2 rows' 32.60: noise between two readings") == 1, text
    # no re-measurement (an older report): no such line
    assert "which plain step" not in _printed({"phases": [_phase("prose")]})


def test_the_pick_records_the_plain_step_its_why_was_priced_on():
    class Controller:
        config = types.SimpleNamespace(gamma_max=4)

        def decision(self, key):
            return {"gamma": 0, "why": "off: plain 0.101 tok/ms", "t_plain_ms": 9.86, "tokens_per_ms": {0: 0.101}}

    ev = demo._PhaseEval(*([None] * 11), controller=Controller(), v0_version=1, frozen_head=None, peer=None)
    ev.params = types.SimpleNamespace(bucket=lambda: "greedy")
    row = {}
    assert ev.controller_pick(row, "prose") == (0, None)
    assert row["controller_pick"]["t_plain_ms"] == 9.86


# 4. no ratio from one request ------------------------------------------------------------------------------

def test_a_candidate_measured_on_one_request_gives_no_bound():
    """bb6e662's re-measured decisions read "is 1.06x plain 0.085, but the 95 % lower bound of that
    ratio is below 0.01x, i.e. none yet (1 request measured ...)": a bound from one request, which
    has none (no spread between requests). The controller (decoder.control) now says so, and the
    demo prints its words as they are."""
    from decoder.control import ControllerConfig, GoodputController

    ctl = GoodputController(ControllerConfig())
    ev = {"rel_se": {("ngram", 4): math.inf, ("plain", 0): 0.05}, "requests_measured": {"ngram": 1}}
    one = ctl._unsure(("ngram", 4), 0.091, 0.085, ev)
    assert one == ("off: the best, ngram γ=4 0.091 tok/ms, is 1.07x plain 0.085 on 1 request: too few for its 95 % "
                   "lower bound (it needs the spread between 2 or more requests; config.confidence)"), one
    ev["requests_measured"]["ngram"] = 3  # two requests or more: the bound, as before
    assert "but the 95 % lower bound of that ratio is" in ctl._unsure(("ngram", 4), 0.091, 0.085, ev)
    text = _printed({"phases": [_phase("extract", controller_pick={"why": one})]})
    assert "extract: controller — off: the best, ngram γ=4 0.091 tok/ms, is 1.07x plain 0.085 on 1 request" in text
    assert "0.01x" not in text


# 5. a promotion that lowered another workload, within the trainer's tolerance ------------------------------

def test_a_promotion_that_lowered_another_workload_names_the_trainers_tolerance():
    """bb6e662: shared v32, judged on code, lowered math's decoded α 0.215 -> 0.184 (-0.032 [-0.053,
    -0.013]), inside the demo's regress_margin 0.05: the note connects the two."""
    v = {"version": 32, "parent": 1, "alpha_before": 0.215, "alpha_after": 0.184, "gain": -0.032, "low": -0.053,
         "high": -0.013, "lowered": True}
    adapters = [{"version": 32, "scope": "", "state": "promoted",
                 "reason": "on code: gain +0.0213 [+0.004, +0.039] (acceptance as served); α at T=1 0.30 -> 0.32: ..."}]
    report = {"phases": [_phase("math", versions=[v])], "adapters": adapters, "config": {"regress_margin": 0.05}}
    text = " ".join(_printed(report).split())
    assert ("math: v1 -> v32 LOWERED decoded α: 0.215 -> 0.184 (-0.032, CI [-0.053, -0.013]); v32 is a shared adapter, "
            "promoted on code's held-out evidence: the trainer's gate lets a promotion lower another workload's "
            "held-out acceptance by up to regress_margin 0.05 (the demo's cross-workload tolerance), and this drop "
            "of 0.032 is within it") in text, text
    big = dict(v, gain=-0.08)
    text = " ".join(_printed(dict(report, phases=[_phase("math", versions=[big])])).split())
    assert "this drop of 0.080 is beyond it: more than the gate allows, worth a look" in text
    assert DemoConfig().regress_margin == 0.05
    report["phases"][0]["alpha_gain"] = 0.2
    summary = demo._summary(report | {"run_id": "r", "key_prefix": "x:", "seconds": 1.0, "requests": 1,
                                      "active_adapter": 1, "plot": None}, demo.Path("out"))
    assert summary["promotions_that_lowered_decoded_alpha"] == ["math: v1 -> v32"] and summary["regress_margin"] == 0.05
    assert demo.lowered_promotions(report) == ["math: v1 -> v32"]  # report.json's key (run_demo), the same list
    assert demo.lowered_promotions({"phases": [_phase("math", versions=[dict(v, lowered=False)])]}) == []
    with pytest.raises(ValueError, match=r"regress_margin=-0.1: must be a finite number >= 0"):
        DemoConfig(regress_margin=-0.1)


# 6. the live rate against the evaluation's ----------------------------------------------------------------

def test_the_evaluation_table_says_why_live_tokens_per_s_were_lower():
    live = [({"alpha": None, "tokens_per_s": 20.4}, {"alpha": None, "tokens_per_s": 33.1}),
            ({"alpha": None, "tokens_per_s": 24.0}, {"alpha": None, "tokens_per_s": 29.9})]
    phases = [_phase(w, plain=_row(tokens_per_s=tps), live_first_third=a, live_last_third=b)
              for w, tps, (a, b) in zip(("prose", "code"), (41.3, 51.6), live)]
    text = " ".join(_printed({"phases": phases, "config": {"max_new_tokens": 32, "eval_new_tokens": 64}}).split())
    assert ("live tokens/s in the phases 20.4-33.1 against plain decoding's 41.3-51.6 here: the phases shared the "
            "cores with the trainer, stopped for this evaluation, and served 32 tokens a request against 64 here "
            "(the prompt's prefill weighs more on fewer)") in text, text
    # live as fast as the evaluation: nothing to explain
    assert "live tokens/s in the phases" not in _printed({"phases": [_phase("prose", live_first_third={"tokens_per_s": 70.0})]})


# 7. a plain pick's cells ---------------------------------------------------------------------------------

def test_a_plain_picks_cells_say_plain_not_numbers_that_look_measured():
    """bb6e662 and ec0c85b: a plain pick's row read "pick α -", "pick τ 1.000", "×plain 1.000" with no
    interval, as if measured; the pick is the plain run itself."""
    text = _printed({"phases": [_phase("prose")]})
    cells = [c.strip() for c in next(line for line in text.splitlines() if "plain (off)" in line).split("│")]
    at = cells.index("plain (off)")
    assert cells[at + 1: at + 4] == ["-", "-", "plain (same decoding)"], cells  # said once (trips5: not thrice)
    spec = _phase("extract", adapted=_row(proposer="ngram", gamma=4, alpha=0.61, tau=2.4, speedup_vs_plain=1.22),
                  speed_vs_plain_ci={"adapted": {"ratio": 1.22, "low": 1.15, "high": 1.28}})
    text = _printed({"phases": [spec]})
    assert "plain (same decoding)" not in text and "0.610" in text and "1.220 [1.15, 1.28]" in text
    assert "LOST" not in text and "below 0.97x" not in text
    # a pick that lost: the whole interval below 1 (the twenty-fourth session's math, 0.959 [0.918, 0.998]),
    # and one below 0.97x on the point with an interval across 1
    lost_ci = {"ratio": 0.959, "low": 0.918, "high": 0.998}
    assert demo._pick_cell({"speedup_vs_plain": 0.959}, lost_ci) == "0.959 [0.92, 0.998] LOST to plain"
    assert demo._pick_cell({"speedup_vs_plain": 0.96}, {"ratio": 0.96, "low": 0.90, "high": 1.03}) \
        == "0.960 [0.90, 1.03] below 0.97x"
    assert demo._pick_cell({"speedup_vs_plain": 0.97}, {"ratio": 0.97, "low": 0.90, "high": 1.03}) == "0.970 [0.90, 1.03]"
    lost = _phase("math", adapted=_row(proposer="ngram", gamma=8, alpha=0.49, tau=1.49, speedup_vs_plain=0.959),
                  speed_vs_plain_ci={"adapted": lost_ci})
    assert "LOST" in _printed({"phases": [lost]})  # in the table (its cell may fold across lines)


# 8. the re-measurement's alarms, named -------------------------------------------------------------------

def test_the_remeasurements_alarm_counts_are_named_and_an_older_reports_pair_still_reads():
    alarm = {"key": ["math", "greedy"], "proposer": "ngram", "reference_alpha": 0.71, "recent_alpha": 0.47}
    base = {"shift_alarms": [alarm, alarm], "shifts": [], "timeline": []}
    new = demo._shift_alarms_note(base | {"remeasured": {"alarms": {"before": 1, "after": 2}, "requests": 64}})
    old = demo._shift_alarms_note(base | {"remeasured": {"alarms": [1, 2], "requests": 64}})
    assert new == old and new.count("during the re-measurement (64 requests, trainer stopped)") == 1, new
    assert demo._remeasured_alarms({"remeasured": {"alarms": {"before": 2, "after": 2}}}, 5) == (2, 2)
    assert demo._remeasured_alarms({}, 3) == (3, 3)


# the walkthrough at 302b64b, trip 4: a speculation left off, decoded anyway -----------------------------------

def test_a_plain_picks_runner_up_is_decoded_and_reported_with_its_verdict():
    """302b64b's extract phase served the n-gram proposer on 140 of 164 requests; the re-measurement
    left it off (1.11x, lower bound 0.83x), the evaluation decoded plain, and nothing said how the
    n-gram would have run. The runner-up: the best non-draft candidate of the plain pick's rates
    (0.092 / 0.082 = 1.122x), decoded as ``runner_up`` and reported beside the pick, with a verdict
    read off its paired interval against 1."""
    decision = {"gamma": 0, "tokens_per_ms": {0: 0.082, 3: 0.05},
                "tokens_per_ms_by_proposer": {"ngram": {1: 0.07, 4: 0.092, 2: None}, "draft": {3: 0.2}}}
    up = demo._runner_up(decision)
    assert up == {"proposer": "ngram", "gamma": 4, "priced_vs_plain": round(0.092 / 0.082, 3)}, up
    assert demo._runner_up({"tokens_per_ms": {0: 0.08}, "tokens_per_ms_by_proposer": {"draft": {3: 0.2}}}) is None
    ev = demo._PhaseEval.__new__(demo._PhaseEval)
    ev.cfg, ev.decoder, ev.frozen, ev.frozen_head = demo.DemoConfig(), "dec", "frz", None
    names = [r[0] for r in ev.runs(0, None, up)]
    assert names[-1] == "runner_up" and "adapted" not in names
    assert [r for r in ev.runs(0, None, up) if r[0] == "runner_up"] == [("runner_up", "dec", 4, "ngram")]
    assert "runner_up" not in [r[0] for r in ev.runs(2, "ngram", up)]  # a speculative pick is decoded itself
    for (lo, hi), verdict in {(0.95, 1.09): "leaving it off cost nothing measurable", (1.03, 1.2): "leaving it off "
                              "cost speed", (0.8, 0.97): "leaving it off was right"}.items():
        ph = _phase("extract", controller_pick={"why": "off: ...", "gamma": 0, "runner_up": up}, eval_prompts=8,
                    runner_up=_row(matches_plain="8/8"),
                    speed_vs_plain_ci={"runner_up": {"ratio": round((lo + hi) / 2, 3), "low": lo, "high": hi}})
        text = _printed({"phases": [ph]})
        assert (f"extract: controller — off: ...; left off, ngram γ=4 (priced at 1.12x plain decoding per decoding "
                f"step) ran {(lo + hi) / 2:.2f}x [{lo:.2f}, {hi:.2f}] of plain on the 8 never-served prompts, prefill "
                f"included: {verdict}") in text, text
    # its outputs count in the lossless line like every speculative run's
    assert "greedy outputs equal to plain decoding: 24 of 24" in text


def test_stopping_the_trainer_is_said_before_the_wait():
    """302b64b's console sat 70 s between "extract ended" and "the trainer stopped" (the round under way, then the
    re-measurement): a line now says what is happening before the wait, and in that order."""
    from types import SimpleNamespace as NS

    said, order = [], []
    console = NS(log=lambda msg: said.append(msg))
    registry = NS(active_version=lambda: 3, active_versions=lambda: {"": 3})
    trainer = NS(ready=NS(wait=lambda: None), svc=NS(stop=lambda **kw: order.append(("stop", len(said), kw))),
                 registry=registry)
    decoder = NS(adapter_version=3, run_between_requests=lambda: None)
    loop = NS(decoder=decoder, manager=NS(wait_prepared=lambda *a: None, stop=lambda: None, close=lambda: None),
              heads=None)
    assert demo._finish_serving(trainer, loop, console, remeasure=lambda: "measured") == "measured"
    # the serving is over: the round under way is cut at its next step (trainer.service.TrainerService.stop)
    assert said[0] == ("stopping the trainer (a round under way stops training at once), then the step costs are "
                       "measured again with the cores free") and order == [("stop", 1, {"cut_round": True})]
    said.clear()
    demo._finish_serving(trainer, loop, console)
    assert said[0] == "stopping the trainer (a round under way stops training at once)"


def test_the_remeasurement_probes_an_unsure_candidate_on_every_request_then_restores(monkeypatch):
    """The second walkthrough at 7f7aad4: after the re-measurement's 16 requests a workload had 6-7 of its
    n-gram's, too few for the bound, and "left off" ran 1.18-1.21x plain. Its requests are for measuring, so
    the controller probes an unsure candidate on each of them (unsure_probe_every 1), and serving's every other
    comes back after, an error included."""
    from decoder.control import ControllerConfig, GoodputController
    from types import SimpleNamespace as NS

    ctl = GoodputController(ControllerConfig(proposers=("ngram",)))
    seen = []

    lengths = []

    def serve_one(oai, loop, tok, model_name, phase, p, max_new_tokens, t0, ignore_eos=False):
        seen.append(ctl.config.unsure_probe_every)
        lengths.append((max_new_tokens, ignore_eos))
        return {"workload": "prose", "proposer": None, "gamma": 0, "decision": "off"}

    monkeypatch.setattr(demo, "_serve_one", serve_one)
    monkeypatch.setattr(demo, "_prompts", lambda phase, n, skip=0: ["p"] * 4)
    cost = NS(status=lambda: {}, ceiling=lambda g: {}, clear=lambda: None)
    loop = NS(decoder=NS(step_cost=cost), controller=ctl, tracker=NS(alarms=[]))
    cfg = DemoConfig(phases=("prose",), remeasure_requests=3)
    out = demo._remeasure(cfg, None, loop, None, "m", NS(shifts=[]), NS(log=lambda *a: None))
    assert seen == [1, 1, 1] and ctl.config.unsure_probe_every == 2 and out["requests"] == 3
    # the evaluation's length, not the phases': the picks are priced on requests shaped like the ones they are judged on
    assert cfg.max_new_tokens != cfg.eval_new_tokens and lengths == [(cfg.eval_new_tokens, True)] * 3
    assert out["new_tokens"] == cfg.eval_new_tokens

    def boom(*a, **k):
        raise RuntimeError("client gone")

    monkeypatch.setattr(demo, "_serve_one", boom)
    with pytest.raises(RuntimeError):
        demo._remeasure(cfg, None, loop, None, "m", NS(shifts=[]), NS(log=lambda *a: None))
    assert ctl.config.unsure_probe_every == 2


def test_the_demo_serves_with_the_base_draft_held_as_serve_does(monkeypatch):
    """A walkthrough of 67ebd65: serve held the untrained derived draft until v0, the demo did not
    (its loop never got hold_base_draft), so the base draft was warmed up and probed on 4 of the
    first 50 requests (α 0.07, 0, 0.14, 0), each slower than plain decoding."""
    from contextlib import ExitStack
    from types import SimpleNamespace as NS

    import decoder.loop
    from daemon.settings import load_settings

    seen = {}

    class Captured(Exception):
        pass

    def fake_build(*a, **kw):
        seen.update(kw)
        raise Captured

    monkeypatch.setattr(decoder.loop, "build_serving_loop", fake_build)
    for mode, held in (("auto", True), ("offer", False)):
        monkeypatch.setenv("DRAFTD_SERVE__BASE_DRAFT", mode)
        settings = load_settings(None)
        models = NS(pair=NS(target=None, draft=None), tok=None, vocab=None, fp=None,
                    engines=NS(served_format=None, target=None, draft=None))
        cfg = demo.DemoConfig.quick()
        with ExitStack() as stack, pytest.raises(Captured):
            demo._start_serving(stack, settings, cfg, NS(client=None, config=None), models,
                                NS(registry=None, keep_heldout=None, head_registry=None), console=None)
        assert seen["hold_base_draft"] is held


# the twenty-third session's walkthroughs: report.json's "rollbacks" held checks that kept the version ------------

def test_report_rollbacks_hold_only_the_checks_that_rolled_a_version_back():
    from types import SimpleNamespace as NS

    from decoder.rollback import RollbackDecision

    kept = RollbackDecision(5, 2, "code@greedy", 0.48, 0.47, 20, 20, False, "kept: no measurable loss", 1.0)
    back = RollbackDecision(9, 5, "code@greedy", 0.31, 0.48, 20, 20, True, "rolled back: -0.17", 2.0)
    out = demo._monitor_checks(NS(decisions=[kept, back, kept]))
    assert [d["version"] for d in out["rollbacks"]] == [9] and out["rollbacks"][0]["rolled_back"] is True
    assert [d["version"] for d in out["rollback_checks"]] == [5, 9, 5]
    assert demo._monitor_checks(NS(decisions=[kept])) == {"rollbacks": [], "rollback_checks": [kept.__dict__]}
