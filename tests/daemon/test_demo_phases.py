"""The demo's phases are sized by the learner's progress, not the clock alone: a phase serves its
``phase_seconds``, then on until its workload's adapter was promoted and had ``phase_min_judged``
turns judged on enough held-out evidence, and never past ``max_phase_seconds()``."""

import pytest

from daemon.demo import DemoConfig, _phase_progress


class _Svc:
    """A TrainerService's status() as the demo reads it (trainer.service: "workload_turns",
    "workload_versions")."""

    def __init__(self, turns: dict, versions: dict | None = None):
        self.turns, self.versions = turns, versions

    def status(self) -> dict:
        return {"workload_turns": self.turns} | ({"workload_versions": self.versions} if self.versions is not None else {})


def test_a_phase_goes_on_until_its_promoted_version_has_served_its_own_traffic():
    """A walkthrough's code phase ended one second after v8 was promoted: v8 served none of it,
    and the phase's gain at its end was 0. The phase now also waits until the workload's own
    promoted version (workload_versions) served phase_min_served of its requests."""
    cfg = DemoConfig.quick(phase_seconds=120.0)
    assert cfg.phase_min_served == 6
    svc = _Svc({"code": {"turns": 3, "judged": 2, "promoted": 1}}, {"code": 8, "prose": 3})
    rows = [{"workload": "code", "adapter_version": 1}] * 30  # the bootstrap served the phase so far
    done, why = _phase_progress(cfg, svc, "code", 130.0, rows)
    assert not done and why.endswith("; its promoted v8 has served 0 of 6 requests"), why
    rows = rows + [{"workload": "code", "adapter_version": 8}] * 5
    assert not _phase_progress(cfg, svc, "code", 140.0, rows)[0]
    rows = rows + [{"workload": "code", "adapter_version": 8}]
    assert _phase_progress(cfg, svc, "code", 141.0, rows) == (
        True, "120 s served and 2 judged turns of its adapter (1 promoted); its v8 served 6 requests")
    # promoted per the turn counts, but no version of its own in the status yet: on, and said
    done, why = _phase_progress(cfg, _Svc({"code": {"turns": 2, "judged": 2, "promoted": 1}}, {}), "code", 130.0, rows)
    assert not done and why.endswith("; its promoted version has not served yet")
    # the cap still ends it
    assert _phase_progress(cfg, svc, "code", 360.0, rows[:30])[0]


def test_a_phase_ends_at_its_seconds_only_once_its_adapter_was_promoted_and_judged_enough():
    cfg = DemoConfig.quick(phase_seconds=120.0, phase_min_served=0)  # 120 s, 2 judged turns, at most 360 s (what served: below)
    assert (cfg.phase_seconds, cfg.phase_min_judged, cfg.max_phase_seconds()) == (120.0, 2, 360.0)
    none = _Svc({})
    assert _phase_progress(cfg, none, "code", 119.9) == (False, "")  # inside its seconds: no reason yet
    done, why = _phase_progress(cfg, none, "code", 120.0)
    assert not done and "0 turns judged on enough held-out evidence (the phase needs 2;" in why  # no turn of code's adapter yet: on
    # two turns, but one lacked the evidence (too few held-out requests): it does not count
    one = _Svc({"code": {"turns": 2, "judged": 1, "promoted": 0}, "prose": {"turns": 5, "judged": 5, "promoted": 2}})
    done, why = _phase_progress(cfg, one, "code", 250.0)
    assert not done and "1 turn judged" in why and "needs 2; 2 turns in all) and 0 promotions" in why
    # judged twice on evidence but never promoted: the learner has not moved yet, on
    refused = _Svc({"code": {"turns": 2, "judged": 2, "promoted": 0}})
    done, why = _phase_progress(cfg, refused, "code", 300.0)
    assert not done and "2 turns judged" in why and "0 promotions" in why
    two = _Svc({"code": {"turns": 3, "judged": 2, "promoted": 1}})
    assert _phase_progress(cfg, two, "code", 130.0) == (True, "120 s served and 2 judged turns of its adapter (1 promoted)")
    # enough judged turns do not end a phase before its seconds
    assert _phase_progress(cfg, two, "code", 60.0) == (False, "")
    # the cap ends it whatever the trainer did, and says so
    done, why = _phase_progress(cfg, one, "code", 360.0)
    assert done and why == "phase_max_seconds 360 s reached with 1 of 2 judged turns (2 turns, 0 promoted)"


def test_time_bounded_phases_when_asked_or_without_per_workload_adapters():
    none = _Svc({})
    assert _phase_progress(DemoConfig.quick(phase_seconds=120.0, phase_min_judged=0), none, "math", 120.0) == (True, "120 s served")
    assert _phase_progress(DemoConfig.quick(phase_seconds=120.0, per_workload=False), none, "math", 121.0) == (True, "120 s served")
    assert _phase_progress(DemoConfig.quick(phase_seconds=120.0), None, "math", 120.0) == (True, "120 s served")
    assert DemoConfig.quick(phase_max_seconds=200.0).max_phase_seconds() == 200.0
    # the quick demo's phases: 60 s at least, then on until the learner's part is done, at most 3 x 60
    quick = DemoConfig.quick()
    assert (quick.phase_seconds, quick.phase_min_judged, quick.phase_min_served, quick.max_phase_seconds()) == (60.0, 2, 6, 180.0)
    assert DemoConfig(phase_seconds=10.0).max_phase_seconds() == 30.0


@pytest.mark.parametrize("kw, match", [
    ({"phase_seconds": 0.0}, "phase_seconds=0.0: must be a finite number > 0"),
    ({"phase_seconds": float("inf")}, "phase_seconds=inf"),
    ({"phase_min_judged": -1}, "phase_min_judged=-1: must be >= 0"),
    ({"phase_min_judged": float("nan")}, "phase_min_judged=nan: must be >= 0"),
    ({"phase_seconds": 1e308}, "phase_seconds=1e.308: too large"),
    ({"phase_max_seconds": 50.0}, "phase_max_seconds=50.0: must be finite and >= phase_seconds=60.0"),
    ({"phase_max_seconds": float("nan")}, "phase_max_seconds=nan"),
])
def test_bad_phase_sizes_are_refused_with_the_value_and_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig.quick(**kw)


def test_the_report_says_how_long_each_phase_served_and_why_it_ended():
    import io

    from rich.console import Console

    from daemon.demo import _phase_lengths

    report = {"shifts": [
        {"t": 0.0, "request": 0, "workload": "prose", "seconds": 131.2, "requests": 40,
         "ended": "120 s served and 2 judged turns of its adapter (1 promoted)",
         "turns": {"turns": 3, "judged": 2, "promoted": 1}},
        {"t": 131.2, "request": 40, "workload": "code"},  # a report of an older run: no lengths
        {"t": 131.2, "request": 40, "workload": "math", "seconds": 122.0, "wall_seconds": 237.4, "requests": 383,
         "ended": "phase_max_seconds 360 s reached", "turns": {"turns": 1, "judged": 0, "promoted": 0}},
    ]}
    out = io.StringIO()
    _phase_lengths(report, Console(file=out, width=400))
    assert out.getvalue().splitlines() == [
        "prose: served 131 s, 40 requests, 3 turns of its adapter (2 judged, 1 promoted); ended: its phase_seconds "
        "passed with its adapter judged phase_min_judged times and promoted",
        # the first phase serves from the first request, its clock from v0: both said
        "math: served 237 s of traffic, 122 s of them on the phase's clock (it starts at v0's arrival; the 115 s "
        "before served while v0 bootstrapped), 383 requests, 1 turns of its adapter (0 judged, 0 promoted); "
        "ended: phase_max_seconds 360 s reached"]


class _Clock:
    """``time`` as daemon.demo reads it: each ``time()`` call advances 1 s (a request served)."""

    def __init__(self, t0: float = 1000.0):
        self.t = t0

    def time(self) -> float:
        self.t += 1.0
        return self.t

    def perf_counter(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t


def _serve(monkeypatch, cfg, svc, trainer):
    """``_serve_phases`` on a fake clock, each request a stub row (no model, no server): the shifts."""
    import io
    import types

    from rich.console import Console

    import daemon.demo as demo

    clock = _Clock()
    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "_serve_one", lambda *a, **k: {"t": 0.0})
    monkeypatch.setattr(demo, "_progress_table", lambda *a, **k: None)
    monkeypatch.setattr(demo, "_prompts", lambda *a, **k: ["p"] * 3)
    loop = types.SimpleNamespace(manager=None, controller=None, heads=None,
                                 decoder=types.SimpleNamespace(adapter_version=0))
    params = types.SimpleNamespace(bucket=lambda: "greedy")
    screen = io.StringIO()
    traffic = demo._serve_phases(cfg, None, loop, None, "m", svc, params, Console(file=screen, width=300), trainer)
    return traffic.shifts, screen.getvalue()


def test_a_trainer_whose_schedule_never_started_leaves_the_phases_time_bounded(monkeypatch):
    """The warm start raised before ``svc.start()`` (a head bootstrap that failed, Redis gone):
    no turn of any adapter will ever be judged, so a phase must not wait for one up to its cap
    (3x the demo's length, for nothing); it ends at its seconds and the console says why."""
    import threading

    from daemon.demo import _Trainer

    cfg = DemoConfig.quick(phases=("code", "math"), phase_seconds=10.0)  # cap 30 s
    ready = threading.Event()
    ready.set()
    trainer = _Trainer(None, None, _Svc({}), {}, None, ready=ready, ready_at=1000.0)  # never started
    shifts, screen = _serve(monkeypatch, cfg, trainer.svc, trainer)
    assert [(s["workload"], s["ended"]) for s in shifts] == [("code", "10 s served"), ("math", "10 s served")], shifts
    assert all(s["seconds"] < 12 for s in shifts), shifts
    assert "the trainer's schedule did not start" in screen, screen
    # the control: a started trainer that judges nothing serves each phase to its cap
    trainer.started = True
    shifts, _ = _serve(monkeypatch, cfg, trainer.svc, trainer)
    assert [s["ended"] for s in shifts] == ["phase_max_seconds 30 s reached with 0 of 2 judged turns (0 turns, 0 promoted)"] * 2


def test_a_status_without_the_turn_counts_or_with_some_of_them_reads_as_zeros():
    """A trainer status that lacks ``workload_turns`` (an older service), holds None there, or an
    entry without some count: the missing counts read 0 (the phase goes on to its cap), never a
    KeyError / AttributeError that ends the demo mid-run."""
    from daemon.demo import _workload_turns

    class _Old:
        def status(self):
            return {"rounds": 3}

    cfg = DemoConfig.quick(phase_seconds=120.0)
    zeros = {"turns": 0, "judged": 0, "promoted": 0}
    assert _workload_turns(_Old(), "code") == zeros
    assert _workload_turns(_Svc(None), "code") == zeros
    assert _workload_turns(_Svc({"code": {"turns": 2}}), "code") == {"turns": 2, "judged": 0, "promoted": 0}
    done, why = _phase_progress(cfg, _Svc({"code": {"judged": 2}}), "code", 130.0)
    assert not done and "2 turns judged" in why and "needs 2; 0 turns in all) and 0 promotions" in why
    # a status whose workload_versions is None or lacks the workload reads as no version of its own
    assert not _phase_progress(cfg, _Svc({"code": {"judged": 2, "promoted": 1}}, None), "code", 130.0,
                               [{"adapter_version": 0}] * 9)[0]
    assert _phase_progress(cfg, _Svc(None), "code", 360.0)[0]


def test_live_alpha_is_split_by_proposer():
    """The live α of a phase's first and last third, per proposer: the draft's (the learner's)
    rising while the n-gram proposer's falls reads as one falling number when pooled."""
    from daemon.demo import _live_cell, _live_side

    def req(proposer, alpha):
        return {"workload": "code", "proposer": proposer, "alpha": alpha, "tokens_per_s": 50.0}

    timeline = ([req("ngram", 0.8), req("ngram", 0.7), req("draft", 0.1)]  # first third
                + [req(None, None)] * 3
                + [req("draft", 0.5), req("draft", 0.6), req("ngram", 0.3)])  # last third
    row: dict = {}
    _live_side(row, timeline, "code")
    assert row["live_first_third"]["alpha"] == pytest.approx((0.8 + 0.7 + 0.1) / 3, abs=1e-4)  # 4 decimals (_nn)
    assert row["live_last_third"]["alpha"] == pytest.approx((0.5 + 0.6 + 0.3) / 3, abs=1e-4)
    assert row["live_last_third"]["alpha_by_proposer"] == {"draft": {"requests": 2, "alpha": pytest.approx(0.55)},
                                                          "ngram": {"requests": 1, "alpha": pytest.approx(0.3)}}
    assert _live_cell(row) == "draft 0.100→0.550, ngram 0.750→0.300"
    # a report written before the split: the pooled figures
    assert _live_cell({"live_first_third": {"alpha": 0.5}, "live_last_third": {"alpha": None}}) == "0.500 → -"


def test_step_costs_are_measured_again_once_the_trainer_stopped_on_prompts_never_served(monkeypatch):
    """The phases priced every verification beside the trainer's rounds; before the evaluation
    asks the controller for its picks, _remeasure forgets the costs (the controller's and the
    decoder's StepCost) and the draft's α, serves ``remeasure_requests`` requests per workload from
    the part of its pool its phase never reached (never served, never an evaluation prompt), and
    names each workload's pick on the console."""
    import io
    import types

    from rich.console import Console

    import daemon.demo as demo
    from decoder.control import ControllerConfig, GoodputController
    from decoder.metrics import StepStats
    from decoder.proposers.cost import StepCost

    ctl = GoodputController(ControllerConfig(gamma_max=2, gamma_init=2, min_steps=2, proposers=("ngram", "draft")))
    cost = StepCost()
    for _ in range(3):  # beside the trainer: 2 proposals + 1 row cost 3 plain steps
        cost.add(1, 10.0)
        cost.add(3, 30.0)
        ctl.observe(("code", "greedy"), StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))
        ctl.observe(("code", "greedy"), StepStats(2, 1, 2, 1, 1.0, 2.0, 30.0))
    assert ctl.decision(("code", "greedy"))["alpha"] == pytest.approx(0.5)
    served = []

    def serve_one(oai, loop, tok, model, phase, p, n, t0, ignore_eos=False):
        assert ignore_eos and n == cfg.eval_new_tokens != cfg.max_new_tokens  # what the evaluation decodes
        served.append((phase, p))
        if p == "math17":  # an alarm on the re-measurement's third request: shift_alarms[1:2]
            loop.tracker.alarms.append("alarm")
        cost.add(1, 10.0)
        cost.add(3, 14.0)  # alone: 1.4 plain steps
        return {"workload": phase, "proposer": None, "gamma": 0, "decision": "warm-up: measuring plain decoding"}

    monkeypatch.setattr(demo, "_serve_one", serve_one)
    monkeypatch.setattr(demo, "_prompts", lambda w, n, skip=0: [f"{w}{i}" for i in range(skip, skip + 10)])
    cfg = DemoConfig.quick(phases=("code", "math"), eval_prompts=8, remeasure_requests=2)
    loop = types.SimpleNamespace(controller=ctl, decoder=types.SimpleNamespace(step_cost=cost),
                                 tracker=types.SimpleNamespace(alarms=["a phase's alarm"]))
    traffic = demo._Traffic()
    traffic.shifts = [{"workload": "code", "requests": 3}, {"workload": "math", "requests": 9}]
    screen = io.StringIO()
    out = demo._remeasure(cfg, None, loop, None, "m", traffic, Console(file=screen, width=300))
    # code served its pool's prompts 8..10 (0..7 are the evaluation's): 11 and 12 are next;
    # math reached the end of its 10: the pool wraps (a real pool holds hundreds)
    assert served == [("code", "code11"), ("code", "code12"), ("math", "math17"), ("math", "math8")]
    assert out["requests"] == 4 and out["keys"] == 1 and out["alarms"] == {"before": 1, "after": 2}
    assert out["beside_trainer"]["step_cost_ms"] == {1: 10.0, 3: 30.0}
    assert out["step_cost_ms"] == {1: 10.0, 3: 14.0}  # only what was measured after the trainer stopped
    assert out["engine_ceiling"]["gamma"] == 2 and out["engine_ceiling"]["speedup"] == pytest.approx(3 / 1.4, abs=1e-3)
    d = ctl.decision(("code", "greedy"))
    assert d["t_plain_ms"] is None and d["alpha"] is None  # costs and α forgotten (learnt again on such requests)
    assert "step costs measured again on 4 requests" in screen.getvalue()
    assert out["picks"] == {"code": "plain", "math": "plain"}
    assert "they are now code plain, math plain (the phases' live lines" in screen.getvalue()


def test_remeasure_requests_must_be_a_count():
    assert DemoConfig.quick().remeasure_requests == 16
    assert DemoConfig.quick(remeasure_requests=0).remeasure_requests == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="remeasure_requests=.*must be an int >= 0"):
            DemoConfig.quick(remeasure_requests=bad)


def _first_phase(monkeypatch, clock, serve_one, ready, version: int, box: dict, ready_at=None):
    """One 10-s prose phase through ``_serve_phases`` on ``clock`` with ``serve_one`` for a request
    and ``ready`` for v0's event; the trainer goes into ``box["trainer"]`` before it runs. Returns
    (the traffic, the trainer, the loop, the console's text)."""
    import io
    import types

    from rich.console import Console

    import daemon.demo as demo
    from daemon.demo import _Trainer

    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "_serve_one", serve_one)
    monkeypatch.setattr(demo, "_progress_table", lambda *a, **k: None)
    monkeypatch.setattr(demo, "_prompts", lambda *a, **k: ["p"] * 3)
    trainer = box["trainer"] = _Trainer(None, None, _Svc({}), {}, None, ready=ready)
    trainer.started, trainer.ready_at = True, ready_at
    loop = types.SimpleNamespace(manager=None, controller=None, heads=None,
                                 decoder=types.SimpleNamespace(adapter_version=version))
    screen = io.StringIO()
    cfg = DemoConfig.quick(phases=("prose",), phase_seconds=10.0, phase_min_judged=0)
    traffic = demo._serve_phases(cfg, None, loop, None, "m", trainer.svc, types.SimpleNamespace(bucket=lambda: "greedy"),
                                 Console(file=screen, width=300), trainer)
    return traffic, trainer, loop, screen.getvalue()


def test_while_v0_bootstraps_the_client_waits_between_requests(monkeypatch):
    """The first phase serves from the first second, but while v0 bootstraps the demo's client
    waits after each request (9x its time at the default duty 0.10), back at once when v0 is ready."""
    import io
    import types

    from rich.console import Console

    import daemon.demo as demo

    clock = _Clock()
    waits: list[float] = []

    class _Ready:
        def __init__(self):
            self.flag = False

        def is_set(self):
            return self.flag

        def wait(self, timeout=None):
            waits.append(round(timeout, 3))
            if len(waits) == 3:  # v0 arrives during the third wait
                self.flag = True
                box["trainer"].ready_at = clock.t
            return self.flag

    def serve_one(*a, **k):
        clock.t += 2.0  # a request takes 2 s
        return {"t": 0.0, "workload": "prose", "adapter_version": 0}

    box: dict = {}
    traffic, trainer, loop, text = _first_phase(monkeypatch, clock, serve_one, _Ready(), 0, box)
    assert waits == [18.0, 18.0, 18.0]  # 9x each 2-s request, then no more waiting once v0 is ready
    assert "prose traffic for 10 s once v0 is ready (the bootstrap runs first; served meanwhile)" in text
    assert "while v0 bootstraps, the demo's client waits between requests (serving at most 10% of the time)" in text
    assert traffic.shifts[0]["ended"] == "10 s served"
    # the console's live line says both lengths (the walkthrough read "prose ended after 120 s" after
    # 212 s of prose traffic): the requests served before v0's clock started
    sh = traffic.shifts[0]
    assert sh["wall_seconds"] - sh["seconds"] > 1, sh  # the case the line is for
    assert (f"prose ended after {sh['wall_seconds']:.0f} s of traffic, {sh['seconds']:.0f} s of them on the phase's "
            f"clock (it starts at v0's arrival; the {sh['wall_seconds'] - sh['seconds']:.0f} s before served while v0 "
            f"bootstrapped), {sh['requests']} requests: its phase_seconds passed") in text, text
    # duty 1: no waiting while v0 bootstraps
    waits.clear()
    trainer.ready = _Ready()
    trainer.ready.wait = lambda timeout=None: waits.append(timeout)
    clock.t += 0
    n = {"served": 0}

    def serve_until_ready(*a, **k):
        n["served"] += 1
        if n["served"] == 4:
            trainer.ready.flag = True
            trainer.ready_at = clock.t
        return serve_one()

    monkeypatch.setattr(demo, "_serve_one", serve_until_ready)
    demo._serve_phases(DemoConfig.quick(phases=("prose",), phase_seconds=10.0, phase_min_judged=0, bootstrap_duty=1.0),
                       None, loop, None, "m", trainer.svc, types.SimpleNamespace(bucket=lambda: "greedy"),
                       Console(file=io.StringIO()), trainer)
    assert waits == [] and n["served"] > 4
    for bad in (0.0, 1.5, True, float("nan")):
        with pytest.raises(ValueError, match="bootstrap_duty=.*must be a fraction in \\(0, 1\\]"):
            DemoConfig.quick(bootstrap_duty=bad)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="phase_min_served=.*must be an int >= 0"):
            DemoConfig.quick(phase_min_served=bad)


def test_a_v0_ready_at_the_start_is_not_announced_as_a_bootstrap_to_come(monkeypatch):
    """With v0 cached (ready before the first request), the first phase's line does not say the
    bootstrap runs first (a walkthrough read it right after "v0 bootstrap (cached ...)")."""
    clock = _Clock()

    class _Ready:
        def is_set(self):
            return True

        def wait(self, timeout=None):
            return True

    def serve_one(*a, **k):
        clock.t += 2.0
        return {"t": 0.0, "workload": "prose", "adapter_version": 1}

    _, _, _, out = _first_phase(monkeypatch, clock, serve_one, _Ready(), 1, {}, ready_at=0.0)
    assert "phase 1/1: prose traffic for 10 s" in out
    assert "the bootstrap runs first" not in out, out


def test_off_a_terminal_serving_prints_each_phases_last_table_once(monkeypatch):
    """Written to a file, the phases' live table is printed once per phase, the phase's last one (the
    walkthrough's log held 10 full tables); the requests counted in its title show which."""
    import io
    import re
    import types

    from rich.console import Console
    from rich.table import Table

    import daemon.demo as demo

    clock = _Clock()
    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "_serve_one", lambda *a, **k: {"t": 0.0})
    def table(timeline, *a, **k):
        t = Table(title=f"after-{len(timeline)}")
        t.add_column("requests")
        t.add_row(str(len(timeline)))
        return t

    monkeypatch.setattr(demo, "_progress_table", table)
    monkeypatch.setattr(demo, "_prompts", lambda *a, **k: ["p"] * 3)
    loop = types.SimpleNamespace(manager=None, controller=None, heads=None,
                                 decoder=types.SimpleNamespace(adapter_version=0))
    screen = io.StringIO()
    cfg = DemoConfig.quick(phases=("code", "math"), phase_seconds=10.0, phase_min_judged=0)
    traffic = demo._serve_phases(cfg, None, loop, None, "m", None, types.SimpleNamespace(bucket=lambda: "greedy"),
                                 Console(file=screen, width=300), None)
    text = screen.getvalue()
    ends = [s["request"] + s["requests"] for s in traffic.shifts]
    assert len(ends) == 2 and ends[0] > 1, traffic.shifts
    assert re.findall(r"after-(\d+)", text) == [str(n) for n in ends], text


def test_the_first_phase_counts_its_minimum_from_its_first_request_and_its_cap_from_v0(monkeypatch):
    """Where the learner's progress ends a phase, the bootstrap's minutes count toward the first
    phase's phase_seconds (they were served), so once v0 is ready the phase ends as soon as its own
    adapter, trained from v0, was promoted, judged twice and served: not phase_seconds after v0. A
    twenty-first-session walkthrough served prose 246 s while v0 bootstrapped, then 121 s more. The
    cap still counts from v0: a long bootstrap never cuts the learner's turns short."""
    import io
    import types

    from rich.console import Console

    import daemon.demo as demo

    clock = _Clock()
    state = {"served": 0}

    class _Ready:
        def is_set(self):
            return state["served"] >= 150  # v0 after 150 requests (each 2 s: 300 s of traffic)

        def wait(self, timeout=None):
            return self.is_set()

    svc = _Svc({"prose": {"turns": 0, "judged": 0, "promoted": 0}}, {"prose": 0})

    def serve_one(*a, **k):
        clock.t += 1.0  # 2 s a request with the clock's own second
        state["served"] += 1
        if state["served"] == 150:
            trainer.ready_at = clock.t
        if state["served"] == 170:  # 40 s after v0: the adapter promoted (v3) and judged twice
            svc.turns["prose"] = {"turns": 2, "judged": 2, "promoted": 1}
            svc.versions["prose"] = 3
        return {"t": 0.0, "workload": "prose", "adapter_version": 3 if state["served"] > 170 else 0}

    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "_serve_one", serve_one)
    monkeypatch.setattr(demo, "_progress_table", lambda *a, **k: None)
    monkeypatch.setattr(demo, "_prompts", lambda *a, **k: ["p"] * 3)
    trainer = demo._Trainer(None, None, svc, {}, None, ready=_Ready())
    trainer.started, trainer.ready_at = True, None
    loop = types.SimpleNamespace(manager=None, controller=None, heads=None, decoder=types.SimpleNamespace(adapter_version=3))
    screen = io.StringIO()
    cfg = DemoConfig.quick(phases=("prose",), bootstrap_duty=1.0, phase_seconds=120.0)  # 120 s, judged twice, 6 served
    traffic = demo._serve_phases(cfg, None, loop, None, "m", svc, types.SimpleNamespace(bucket=lambda: "greedy"),
                                 Console(file=screen, width=300), trainer)
    sh = traffic.shifts[0]
    # 6 requests of v3 after the 170th: the phase ends at the 176th request, 52 s after v0, not 120 s after
    assert sh["requests"] == 176, sh
    assert 50 <= sh["seconds"] <= 54 and sh["wall_seconds"] > 340, sh
    assert sh["ended"].startswith("120 s served and 2 judged turns of its adapter (1 promoted)"), sh
    assert ("prose traffic for 120 s from its first request (v0 bootstraps first; served meanwhile), then until its "
            "adapter was promoted and judged 2 times (at most 360 s after v0)") in screen.getvalue()
    # the cap counts from v0: 300 s of traffic before v0 does not end the phase at v0 (360 s is 3 x 120)
    assert demo._phase_progress(cfg, _Svc({"prose": {"turns": 0, "judged": 0, "promoted": 0}}), "prose", 400.0,
                                cap_s=10.0)[0] is False
    assert demo._phase_progress(cfg, _Svc({"prose": {"turns": 0, "judged": 0, "promoted": 0}}), "prose", 400.0,
                                cap_s=360.0)[0] is True


def _run_phases(monkeypatch, clock, svc, serve_one, adapter_version: int, **quick):
    """daemon.demo._serve_phases on the fake ``clock`` with ``serve_one`` for each request, v0 ready
    and the trainer started, ``DemoConfig.quick(**quick)``: (its _Traffic, the console's text)."""
    import io
    import types

    from rich.console import Console

    import daemon.demo as demo

    monkeypatch.setattr(demo, "time", clock)
    monkeypatch.setattr(demo, "_serve_one", serve_one)
    monkeypatch.setattr(demo, "_progress_table", lambda *a, **k: None)
    monkeypatch.setattr(demo, "_prompts", lambda *a, **k: ["p"] * 3)
    trainer = demo._Trainer(None, None, svc, {}, None, ready=types.SimpleNamespace(is_set=lambda: True, wait=lambda t=None: True))
    trainer.started, trainer.ready_at = True, None
    loop = types.SimpleNamespace(manager=None, controller=None, heads=None,
                                 decoder=types.SimpleNamespace(adapter_version=adapter_version))
    screen = io.StringIO()
    traffic = demo._serve_phases(DemoConfig.quick(**quick), None, loop, None, "m", svc,
                                 types.SimpleNamespace(bucket=lambda: "greedy"), Console(file=screen, width=400), trainer)
    return traffic, screen.getvalue()


def test_each_phase_records_when_its_learner_was_done_inside_its_minimum(monkeypatch):
    """A phase's shift says when the learner's part (promoted, judged twice, its version served 6
    requests) was done, on the clock of its ``seconds``: what sizes phase_seconds (the twenty-seventh
    session's code phase had it done at about 65 s of a 120 s minimum). Fake clock (2 s a request):
    code's own v7 promoted and judged twice at the 20th request, 6 served by the 26th, so done when
    the 27th would start, at 52 s (26 x 2); the phase still serves its 120 s; a phase whose learner
    never finished records none."""
    import daemon.demo as demo

    clock = _Clock()
    svc = _Svc({"code": {"turns": 0, "judged": 0, "promoted": 0}}, {"code": 0})
    served = {"n": 0}

    def serve_one(oai, loop, tok, model, phase, *a, **k):
        clock.t += 1.0
        served["n"] += 1
        if phase == "code" and served["n"] == 20:
            svc.turns["code"], svc.versions["code"] = {"turns": 2, "judged": 2, "promoted": 1}, 7
        return {"t": 0.0, "workload": phase, "adapter_version": svc.versions.get(phase, 0)}

    traffic, _ = _run_phases(monkeypatch, clock, svc, serve_one, 7, phases=("code", "math"), phase_seconds=120.0,
                             phase_max_seconds=130.0)
    code, math = traffic.shifts
    assert 51 <= code["learner_done_s"] <= 53 and code["seconds"] >= 120 and code["ended"].startswith("120 s served"), code
    assert "learner_done_s" not in math and math["ended"].startswith("phase_max_seconds 130 s reached"), math
    assert demo._phase_end_line("code", code).endswith(f"(the learner's part done at {code['learner_done_s']:.0f} s)")
    assert "learner's part" not in demo._phase_end_line("math", math)


class _LoggedSvc(_Svc):
    """A _Svc with TrainerService.rounds_log over the round summaries a test appends."""

    def __init__(self, turns: dict, versions: dict | None = None):
        super().__init__(turns, versions)
        self.rounds: list[dict] = []

    def rounds_log(self, since: int = 0) -> list[dict]:
        return [r for r in self.rounds if r["round"] > since]


def test_the_phases_say_a_yield_a_waiting_tail_and_when_the_new_workload_was_first_promoted(monkeypatch):
    """A walkthrough read the yield and the tail's wait off Redis's processed-record times: they were
    only in a round's reason. Now the console says a turn that gave way (each time) and a tail that
    waits (once until its turn trains, not every round nor behind each newer workload; a yield
    says it for its workload), and each shift records ``first_promotion_s``: from its
    first request to the end of the first round that promoted its workload's own adapter (a later
    promotion and a rejected turn do not move it), in the phase-end line and the closing summary.
    Fake clock (each time() call and each request 1 s)."""
    import io

    from rich.console import Console

    import daemon.demo as demo

    clock = _Clock()
    svc = _LoggedSvc({"prose": {"turns": 0, "judged": 0, "promoted": 0}, "code": {"turns": 0, "judged": 0, "promoted": 0}},
                     {"prose": 0, "code": 0})
    seen = {"code": 0}
    ends = {}

    def summary(n, started, seconds, turns, waits=None, yielded=None):
        return {"round": n, "started_at": started, "seconds": seconds, "turns": turns, "waits": waits or {}, "yielded": yielded}

    def serve_one(oai, loop, tok, model, phase, *a, **k):
        clock.t += 1.0
        if phase == "code":
            seen["code"] += 1
            n = seen["code"]
            if n == 1:
                ends["first_request"] = clock.t
            if n == 5:
                svc.rounds.append(summary(1, clock.t - 3, 2.0, {"prose": {"decision": "skipped"}},
                                          yielded={"workload": "prose", "to": "code", "steps": 3}))
            if n == 8:
                svc.rounds.append(summary(2, clock.t - 4, 3.0, {"code": {"decision": "promoted"}}, waits={"prose": "code"}))
                ends["promotion"] = clock.t - 1
            if n == 12:
                svc.rounds.append(summary(3, clock.t - 2, 1.0, {"code": {"decision": "promoted"}}, waits={"prose": "code"}))
            if n == 14:  # behind a newer workload still: not said again (a walkthrough read it once per shift)
                svc.rounds.append(summary(4, clock.t - 1, 0.5, {}, waits={"prose": "math"}))
            if n == 16:  # prose's tail trained; a later wait is said again
                svc.rounds.append(summary(5, clock.t - 1, 0.5, {"prose": {"decision": "rejected"}}))
                svc.rounds.append(summary(6, clock.t - 1, 0.5, {}, waits={"prose": "math"}))
        return {"t": 0.0, "workload": phase, "adapter_version": 0}

    traffic, text = _run_phases(monkeypatch, clock, svc, serve_one, 0, phases=("prose", "code"), phase_seconds=30.0,
                                phase_max_seconds=40.0)
    assert text.count("trainer: prose's turn gave way to code's newer traffic after 3 steps (not judged; prose's last "
                      "records wait, code is learnt first)") == 1, text
    # the yield said prose's records wait: not again behind code (round 2) nor behind math (round 4) ...
    assert "behind code's" not in text, text
    # ... until prose's turn trained (round 5): its next wait (round 6) is said
    assert text.count("trainer: prose's last records wait behind math's newer traffic (math is learnt first; they train "
                      "once a round holds nothing newer, or trainer.tail_wait_s after)") == 1, text
    assert text.index("gave way") < text.index("behind math's")
    prose, code = traffic.shifts
    assert "first_promotion_s" not in prose
    # the phase began a few clock seconds before its first request; the second promotion (round 3) does not count
    lo = ends["promotion"] - ends["first_request"]
    assert lo <= code["first_promotion_s"] <= lo + 4, (code, ends)
    line = demo._phase_end_line("code", code)
    assert f"(its adapter first promoted {code['first_promotion_s']:.0f} s after its first request" in line, line
    assert "first promoted" not in demo._phase_end_line("prose", prose)
    # a first phase served while v0 bootstrapped: its clock, and so its first promotion, counts from v0's arrival
    first = {"seconds": 19.0, "wall_seconds": 100.0, "requests": 58, "ended": "60 s served", "first_promotion_s": 9.4,
             "first_promotion_from": "v0's arrival"}
    assert demo._phase_end_line("prose", first).endswith("(its adapter first promoted 9 s after v0's arrival)")
    out = io.StringIO()
    demo._phase_lengths({"shifts": traffic.shifts}, Console(file=out, width=600))
    assert f"its adapter first promoted {code['first_promotion_s']:.0f} s after its first request" in out.getvalue()
