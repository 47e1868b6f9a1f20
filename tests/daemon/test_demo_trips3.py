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
from daemon.demo import DemoConfig, print_report


def _row(**kw) -> dict:
    return {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0} | kw


def _phase(workload: str, **kw) -> dict:
    return {"workload": workload, "heldout_samples": 0, "adapter_at_phase_end": 0, "final_adapter": 0,
            "plain": _row(), "frozen": _row(matches_plain="8/8"), "adapted_draft": _row(matches_plain="8/8"),
            "adapted": _row(same_run_as="plain"), "controller_pick": {"why": "off: plain"},
            "served": {"requests": 10, "repeats": 0}, "live_first_third": {"alpha": None},
            "live_last_third": {"alpha": None}} | kw


def _printed(report: dict) -> str:
    out = io.StringIO()
    print_report({"adapters": [], "recovery": [], "requests": 10, "active_adapter": 1, "seconds": 1.0,
                  "key_prefix": "x:"} | report, Console(file=out, width=600))
    return out.getvalue()


# 1. the first live line ------------------------------------------------------------------------------------

def test_the_first_live_line_says_first_request_served_not_a_rate_of_one_request():
    """ec0c85b's first line: "prose: 1 request in 0 s; last 1: α 0.75, τ 1.39 (one request's ...),
    18.8 tokens/s": no rate from one request in under a second; what is known instead."""
    one = [{"workload": "prose", "alpha": 0.75, "tau": 1.39, "tokens_per_s": 18.8, "adapter_version": 0}]
    line = demo._progress_line(one, "prose", 1, 0.4)
    assert line == ("prose: first request served (its rolling α and tokens/s once there are more); "
                    "serving the base draft (no adapter yet)"), line
    assert demo._progress_line(one, "prose", 1, 9.0).startswith("prose: first request served (")  # one request, any time
    three = one * 3
    assert demo._progress_line(three, "prose", 3, 0.6).startswith("prose: 3 requests served (its rolling")  # under 1 s
    # two requests over 3 s: a rolling α (0.75 each) and the rate
    assert demo._progress_line(one * 2, "prose", 2, 3.0) == (
        "prose: 2 requests in 3 s; last 2: α 0.750, τ 1.39 (2 speculated), 18.8 tokens/s; "
        "serving the base draft (no adapter yet)")


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
