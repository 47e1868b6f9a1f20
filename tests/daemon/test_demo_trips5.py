"""The quick demo's trips of the sixteenth session's walkthrough at 39d6919 (docs/walkthroughs.md,
"The quick demo at 39d6919", its "Trips" list) still there at HEAD: the served-format line, a live
cell whose measured rate sits above the ceiling it states, the closing ceilings, each phase's
closing line, the plot's swap labels and the speed table's plain picks."""

import io
import re
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

import daemon.demo as demo
from decoder.models.formats import FormatCost, FormatMeasurement, choose_format
from test_demo_trips2 import _printed  # the report as printed at 600 columns
from test_demo_trips3 import _phase


def _text(report: dict) -> str:
    return " ".join(_printed(report).split())


# (1)+(2) the served-format line ---------------------------------------------------------------------------

# 39d6919's format measurement: the packaged Q4_1 15.87 ms a step, its 2 rows 1.72 steps (27.30 ms); Q8_0
# 12.07 ms a step, its 2 rows 2.71 steps (32.71 ms); F16 left out, its rows differ (max 0.0619)
PK, Q8 = {1: 15.87, 2: 27.30}, {1: 12.07, 2: 32.71}
DRIFT = [1.0, 1.1, 0.95, 1.2, 1.05, 0.9, 1.0, 1.15, 1.1, 0.97, 1.02, 1.08]  # the host's load, both files alike
WOBBLE = [1.0, 0.97, 1.03, 1.0, 0.98, 1.02, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0]  # Q8_0's own noise per repeat


def _measurement() -> FormatMeasurement:
    def cost(f, ms, wobble):
        samples = {n: [t * d * w for d, w in zip(DRIFT, wobble)] for n, t in ms.items()}
        return FormatCost(f, f"qwen-{f}.gguf", dict(ms), True, 0.0, noise=0.2, repeats=12, samples=samples)

    fm = {"packaged": cost("packaged", PK, [1.0] * 12), "Q8_0": cost("Q8_0", Q8, WOBBLE),
          "F16": FormatCost("F16", "qwen-F16.gguf", {1: 20.0, 8: 30.0}, False, 0.0619, noise=0.1, repeats=5)}
    return FormatMeasurement({"model": "m"}, fm, None, reps=12, cached_tokens=300)


def test_the_served_format_says_which_figure_chose_it_and_what_its_rows_cost_against_the_packaged_files(monkeypatch):
    """39d6919: "Q8_0 expects 0.0828 tokens/ms (plain decoding), 1.31x the tokens per ms of plain decoding of
    the packaged file (...); paired per repeat 1.24x [1.12, 1.38] over 12 repeats; packaged 1.00x; F16 left
    out (its 8-row verification's logits differ from its one-row steps (max 0.0619) ...output))", nothing
    on what the choice gave up: Q8_0's 2 rows cost 32.71 / 12.07 = 2.71 of its steps, the packaged file's
    27.30 / 15.87 = 1.72. Plain decoding of Q8_0: 15.87 / 12.07 = 1.31x on the medians."""
    import decoder.engines.llamacpp_lib as lib

    monkeypatch.setattr(lib, "_amx_rows", None)  # no AMX path in this process (below: one)
    assert f"{Q8[2] / Q8[1]:.2f}" == "2.71" and f"{PK[2] / PK[1]:.2f}" == "1.72" and f"{PK[1] / Q8[1]:.2f}" == "1.31"
    c = choose_format(_measurement(), alphas={}, proposers=())
    assert c.format == "Q8_0", c.reason
    p = c.paired
    assert 1.2 < p["ratio"] < 1.4 and p["low"] > 1.0 and p["pairs"] == 12
    assert c.reason.startswith(
        f"measured: Q8_0 serves on its ratio paired per repeat, {p['ratio']:.2f}x [{p['low']:.2f}, {p['high']:.2f}] the "
        f"tokens per ms of plain decoding of the packaged file (qwen-packaged.gguf, 15.87 ms a step after 300 cached "
        f"tokens) over 12 repeats, the interval that decided (above 1.00, the ratio at 1.05x or more); on the medians "
        f"it expects 0.0829 tokens/ms (plain decoding), 1.31x; its 2-row verification costs 2.71x its step against "
        f"the packaged file's 1.72x: speculation pays less on it; F16 left out (its 8-row verification's logits "
        f"differ from its one-row steps by up to 0.0619, so greedy speculation could leave plain decoding's "
        f"output)"), c.reason
    assert "packaged 1.00x" not in c.reason and "))" not in c.reason
    # rows as cheap as the packaged file's: no such clause
    m = _measurement()
    m.formats["Q8_0"].ms[2] = 12.07 * 1.72
    assert "speculation pays less" not in choose_format(m, alphas={}, proposers=()).reason
    # the console: the engine line, and the served format on a line of its own (no "output))")
    served = SimpleNamespace(format="Q8_0", path=Path("/x/qwen-Q8_0.gguf"), reason=c.reason)
    eng = SimpleNamespace(name="llamacpp", served=served,
                          reason=f"auto: GGUF target qwen.gguf on CPU; serving Q8_0 (qwen-Q8_0.gguf): {c.reason}")
    lines = demo._engine_lines(eng)
    assert lines == ["engine: llamacpp (auto: GGUF target qwen.gguf on CPU)",
                     f"served format: Q8_0 (qwen-Q8_0.gguf), {c.reason}"]
    assert not any(x.endswith("))") for x in lines)
    assert demo._engine_lines(SimpleNamespace(name="torch", served=None, reason="auto: no GGUF")) == [
        "engine: torch (auto: no GGUF)"]
    # on llama.cpp's AMX path, where the tiles take over from the per-row kernel, on a line of its own
    monkeypatch.setattr(lib, "_amx_rows", {"setting": "4,3", "source": "measured", "reason": "1 thread(s): ..."})
    assert demo._engine_lines(eng)[2:] == [
        "AMX matmuls: the per-row kernel takes up to 4 rows at 1 thread, 3 at 2 threads or more, the AMX tiles more "
        "rows (GGML_AMX_VNNI_MAX_ROWS=4,3, measured; its costs: report.json amx_rows)"]
    # one value (a user's, or the default where the measurement was not used): the reason why it stands
    assert demo._amx_line({"setting": "8", "source": "default", "reason": "noisy: ..."}) == (
        "AMX matmuls: the per-row kernel takes up to 8 rows at any thread count, the AMX tiles more rows "
        "(GGML_AMX_VNNI_MAX_ROWS=8, default; noisy: ...)")
    assert demo._amx_line({"setting": "4,3,2", "source": "cached"}).startswith(
        "AMX matmuls: the per-row kernel takes up to 4 rows at 1 thread, 3 at 2 threads, 2 at 3 threads or more, ")


# (5) a live cell's measured rate above the ceiling it states ---------------------------------------------

def test_the_no_proposer_can_pay_clause_is_not_said_beside_a_measured_rate_above_its_bound():
    """39d6919's math cell: "the best, ngram γ=1 0.0920 tok/ms, is within the 5% margin (min_gain) of
    plain 0.0917; no proposer can pay on this engine now: even accepted in full and free, its best, γ=4,
    is 0.091 tok/ms = 0.99x plain": a rate measured above the bound it states, in one cell (the ceiling
    priced on the verification steps' costs, the n-gram's rate on its own steps). With the n-gram at
    0.0900, below the bound, the clause stands: 0.091 / 0.0917 = 0.99x."""
    from decoder.control import ControllerConfig, GoodputController

    ctl = GoodputController(ControllerConfig(gamma_max=4, proposers=("ngram",)))
    ev = {"engine_ceiling": (4, 0.091), "t_verify": {4: 5 / 0.091}, "t_plain": 1 / 0.0917}

    def why(ngram):
        cands = {("plain", 0): 0.0917, ("ngram", 1): ngram}
        return ctl._why_among(cands, ("plain", 0), ev)

    above = why(0.0920)
    assert above == "off: the best, ngram γ=1 0.0920 tok/ms, is within the 5% margin (min_gain) of plain 0.0917", above
    below = why(0.0900)
    assert below.startswith("off: plain 0.092 tok/ms beats every proposer (best ngram γ=1 0.090)"), below
    assert below.endswith("no proposer can pay on this engine now: even accepted in full and free, its best, γ=4, is "
                          f"0.091 tok/ms = {0.091 / 0.0917:.2f}x plain (a verification of 5 rows 54.95 ms, a plain "
                          "step 10.91 ms)"), below


# (6) the closing ceilings: why the one beside the trainer is the higher -----------------------------------

def _ceil(ms: dict) -> dict:
    by = {r - 1: round(r * ms[1] / ms[r], 3) for r in ms if r > 1}
    g = max(by, key=by.get)
    return {"by_gamma": by, "gamma": g, "speedup": by[g]}


def test_a_ceiling_beside_the_trainer_above_the_stopped_one_says_why_and_the_third_is_named():
    """39d6919: "with the trainer stopped ... at most 1.10x" (10.13 / 29.61 / 46.13 ms at 1, 2, 5 rows: 5 x
    10.13 / 46.13 = 1.098 at γ=4), "beside the trainer ... at most 1.26x" (10.39 / 29.27 / 37.83 / 41.24 at
    1, 2, 4, 5: 5 x 10.39 / 41.24 = 1.260), and report.json's engine_ceiling 1.144 (5 x 13.69 / 59.82) a
    third, named nowhere. Beside the trainer 5 rows cost 41.24 / 10.39 = 3.97 plain steps, stopped
    46.13 / 10.13 = 4.55."""
    stopped_ms, beside_ms, last_ms = {1: 10.13, 2: 29.61, 5: 46.13}, {1: 10.39, 2: 29.27, 4: 37.83, 5: 41.24}, \
        {1: 13.69, 2: 36.87, 5: 59.82}
    assert _ceil(stopped_ms)["speedup"] == 1.098 and _ceil(beside_ms)["speedup"] == 1.26
    assert _ceil(last_ms)["speedup"] == 1.144
    rem = {"requests": 64, "step_cost_ms": stopped_ms, "engine_ceiling": _ceil(stopped_ms),
           "beside_trainer": {"step_cost_ms": beside_ms, "engine_ceiling": _ceil(beside_ms)}}
    text = _text({"phases": [_phase("prose")], "remeasured": rem, "step_cost_ms": last_ms,
                  "engine_ceiling": _ceil(last_ms)})
    assert ("speculation could run at most 1.26x plain (γ=4, the best of γ=1, 3, 4 measured: steps measured at 1, 2, "
            "4, 5 rows, no other γ priced); a verification of 2 rows cost 2.82 plain steps; above the 1.10x with the "
            "trainer stopped: each ceiling divides by its own moment's plain step, and 5 rows cost 3.97 plain steps "
            "here against 4.55 with the trainer stopped, "
            "medians of other requests' steps; against a plain step of 10.39 ms measured beside the trainer") in text, text
    assert ("report.json's top-level step_cost_ms (13.69 ms) and engine_ceiling (a third ceiling, 1.144x, on those steps) are "
            "StepCost after the evaluation's own steps, which priced nothing here") in text, text
    assert "1.14x" not in text  # its figure as report.json keeps it, not as a third ceiling line (test_demo_trips6)
    # the stopped line says nothing of the kind, nor a beside line below the stopped one
    assert text.count("above the") == 1
    lower = {1: 10.39, 2: 29.27, 5: 52.0}
    assert "above the" not in demo._ceiling_line(_ceil(lower), lower, "while serving, beside the trainer", stopped_ms,
                                                 stopped_ceil=_ceil(stopped_ms))


# (7) each phase's closing line: one statement of each fact -----------------------------------------------

def test_each_phases_closing_line_states_its_seconds_and_turns_once():
    """39d6919: "prose: served 243 s ..., 201 requests, 4 turns of its adapter (4 judged, 1 promoted); ended:
    120 s served and 4 judged turns of its adapter (1 promoted)", and "121 s of them on the phase's clock"
    beside "120 s served". The why as _phase_progress gives it, each of the three kinds."""
    cfg = demo.DemoConfig.quick()
    turns = {"turns": 4, "judged": 4, "promoted": 1}

    class Svc:
        def __init__(self, t):
            self.t = t

        def status(self):
            return {"workload_turns": {"prose": self.t}, "workload_versions": {"prose": 2}}

    rows = [{"adapter_version": 2}] * 30
    done, why = demo._phase_progress(cfg, Svc(turns), "prose", 121.0, rows)
    capped, cap_why = demo._phase_progress(cfg, Svc({"turns": 3, "judged": 1, "promoted": 0}), "prose",
                                           cfg.max_phase_seconds(), rows)
    assert done and capped
    shifts = [{"workload": "prose", "seconds": 121.0, "wall_seconds": 243.0, "requests": 201, "ended": why,
               "turns": turns},
              {"workload": "code", "seconds": 120.4, "requests": 136, "ended": "120 s served", "turns": turns},
              {"workload": "math", "seconds": cfg.max_phase_seconds(), "requests": 400, "ended": cap_why,
               "turns": {"turns": 3, "judged": 1, "promoted": 0}}]
    out = io.StringIO()
    demo._phase_lengths({"shifts": shifts}, Console(file=out, width=600))
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "prose: served 243 s of traffic, 121 s of them on the phase's clock (it starts at v0's arrival; the 122 s "
        "before served while v0 bootstrapped), 201 requests, 4 turns of its adapter (4 judged, 1 promoted); ended: "
        "its phase_seconds passed with its adapter judged phase_min_judged times and promoted; its v2 served 30 "
        "requests"), lines[0]
    assert lines[1] == ("code: served 120 s, 136 requests, 4 turns of its adapter (4 judged, 1 promoted); ended: its "
                        "phase_seconds passed")
    assert lines[2].endswith("3 turns of its adapter (1 judged, 0 promoted); "
                             f"ended: phase_max_seconds reached before the rest of its rule was met "
                             f"({cfg.phase_min_judged} judged turns of its adapter, a promotion, its promoted version "
                             f"serving phase_min_served requests)"), lines[2]
    for line in lines[:2]:  # each count and each length once: no "120 s served" beside the clock's 121 s
        assert len(re.findall(r"\d+ judged", line)) == 1 and line.count("120 s") <= 1, line


# (8) the plot's swap labels: two swaps closer than a label's width ---------------------------------------

def test_two_swaps_closer_than_a_labels_width_go_on_different_rows():
    """39d6919's prose: "v1 (shared)" at 124 s and "v2" at 151 s printed as one smudge on a ~620 s axis (four
    phases of about 120 s, prose's 243): 27 s is 4.4 % of it, past the old 4 % rule, while " v1 (shared)"
    (12 characters at 0.0065 of the axis each) spans 7.8 %, 48.4 s. A third swap at 160 s finds row 0 free
    only after 124 + 48.4 = 172.4 s, row 1 after 151 + 3 x 0.0065 x 620 = 163.1 s: row 2. At 200 s row 0
    is free again."""
    width = 12 * 0.0065 * 620
    assert round(width, 1) == 48.4 and 151 - 124 < width and 151 - 124 > 0.04 * 620
    versions = [(0, 0), (100, 0), (124, 1), (151, 2), (160, 3), (200, 4), (620, 4)]
    timeline = [{"t": float(t), "workload": "prose", "adapter_version": v} for t, v in versions]
    scopes = {1: "", 2: "prose", 3: "prose", 4: "prose"}
    _, swaps = demo._plot_labels(timeline, [{"t": 0.0, "request": 0, "workload": "prose"}], scopes)
    assert [(t, row) for t, _, row in swaps] == [(124.0, 0), (151.0, 1), (160.0, 2), (200.0, 0)], swaps
    assert [x for _, x, _ in swaps][:2] == [" v1 (shared)", " v2"]


# (11) the speed table: a plain pick's left-off speculation in its row ------------------------------------

def test_a_plain_picks_row_gives_the_left_off_speculations_ratio_within_170_columns():
    """39d6919: "pick α", "pick τ" and "pick ×plain" read "plain (same decoding)" in every row, and the
    left-off n-gram's 0.942 [0.893, 0.980] (prose) and 0.941 [0.887, 0.998] (extract) were only in the
    notes. Now a column of their own, each row on one line at 170 columns, "plain (same decoding)" once a
    row; a speculating pick's row has nothing left off."""
    def plain_pick(w, g, ratio, lo, hi):
        return _phase(w, eval_prompts=8, controller_pick={"why": "off: plain", "runner_up": {
                          "proposer": "ngram", "gamma": g, "priced_vs_plain": 0.97}},
                      runner_up={"proposer": "ngram", "gamma": g, "alpha": 0.4, "tau": 1.4, "speedup_vs_plain": ratio},
                      speed_vs_plain_ci={"runner_up": {"ratio": ratio, "low": lo, "high": hi}},
                      speed_vs_llamacpp_ci={"adapted": {"ratio": 1.373, "low": 1.295, "high": 1.456}})

    prose, extract = plain_pick("prose", 1, 0.942, 0.893, 0.980), plain_pick("extract", 2, 0.941, 0.887, 0.998)
    code = _phase("code", eval_prompts=8, adapted={"proposer": "ngram", "gamma": 4, "alpha": 0.712, "tau": 3.104,
                                                   "speedup_vs_plain": 1.209},
                  speed_vs_plain_ci={"adapted": {"ratio": 1.209, "low": 1.03, "high": 1.47}})
    out = io.StringIO()
    demo.print_report({"adapters": [], "recovery": [], "requests": 10, "active_adapter": 1, "seconds": 1.0,
                       "key_prefix": "x:", "phases": [prose, code, extract]}, Console(file=out, width=170))
    text = out.getvalue()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 170
    assert text.count("plain (same decoding)") == 2  # once a plain pick's row, not in its α, τ and ×plain cells
    def row(w):  # the speed table's row: the one with its pick
        return next(x for x in lines if x.startswith(f"│ {w} ") and ("plain (off)" in x or "ngram γ=4" in x))

    assert "left off ×plain [95 % CI]" in text
    assert [c.strip() for c in row("prose").split("│")[4:8]] == ["-", "-", "plain (same decoding)",
                                                                "ngram γ=1 0.942 [0.89, 0.98]"], text
    # its upper bound 0.998 is below 1: printed so, not as 1.00 (trips8, the a451b6e walkthrough)
    assert "ngram γ=2 0.941 [0.89, 0.998]" in row("extract"), text
    assert [c.strip() for c in row("code").split("│")[4:8]] == ["0.712", "3.104", "1.209 [1.03, 1.47]", "-"], text
