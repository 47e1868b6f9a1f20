"""The quick demo's trips of the sixteenth session's walkthrough at c750c7d (docs/walkthroughs.md, "The
quick demo at c750c7d", its "Trips" paragraph) still there at HEAD: the build banner's estimate, the
served-format line, each phase's live closing line, the notes' gains, the two ceilings, the third
ceiling's value, the dip said twice, the alarm note's clock and the plot's swap labels. The figures
are that run's report.json's, copied here."""

import re
from pathlib import Path

from decoder.models.formats import FormatCost, FormatMeasurement, choose_format

ROOT = Path(__file__).resolve().parents[2]


# (1) the build banner's estimate -------------------------------------------------------------------------

def test_the_build_banner_estimate_covers_the_builds_measured_on_two_idle_cores():
    """c750c7d's banner: "about 3-5 minutes on 2 idle cores", then "llama.cpp built in 120 s" (the AMX
    Xeon, alone); 39d6919's build took 161 s on the Zen 4, alone. Each inside the banner's range."""
    text = (ROOT / "scripts" / "install").read_text()
    m = re.search(r"about (\d+)-(\d+) minutes on 2 idle cores", text)
    assert m, "the banner's estimate is gone"
    low, high = int(m.group(1)) * 60, int(m.group(2)) * 60
    for built_s in (120, 161):
        assert low <= built_s <= high, (built_s, m.group(0))
    # the header comment says the same range
    assert f"~{m.group(1)}-{m.group(2)} min on 2 cores" in text


# (2) the served-format line: what the others' figures divide by, and what a prior α is --------------------

# c750c7d's format measurement (report.json's served_format.costs, ms by rows; 5 repeats, 300 cached tokens)
PK = {1: 10.368, 2: 17.062, 3: 19.381, 4: 21.59, 5: 23.843, 6: 26.169, 7: 28.532, 8: 31.901}
Q8 = {1: 13.216, 2: 18.628, 3: 20.744, 4: 23.347, 5: 25.495, 6: 28.704, 7: 31.433, 8: 34.626}
F16 = {1: 32.57, 2: 39.126, 3: 43.89, 4: 48.627, 5: 68.013, 6: 72.188, 7: 75.234, 8: 79.397}
BF16 = {1: 26.29, 2: 32.261, 3: 40.648, 4: 45.916, 5: 53.264, 6: 59.734, 7: 57.405, 8: 61.789}


def _walk_measurement() -> FormatMeasurement:
    def cost(f, ms, noise, same=True, diff=0.0):
        return FormatCost(f, f"m-{f}.gguf", dict(ms), same, diff, noise=noise, repeats=5)

    fm = {"packaged": cost("packaged", PK, 0.0468), "F16": cost("F16", F16, 0.0382),
          "BF16": cost("BF16", BF16, 0.0778, False, 0.151), "Q8_0": cost("Q8_0", Q8, 0.0597)}
    return FormatMeasurement({"model": "m"}, fm, draft_ms=3.3247, reps=5, cached_tokens=300)


def test_the_other_formats_figures_say_they_divide_by_the_packaged_files_plain_decoding():
    """c750c7d: "the packaged file is the best, with ngram γ=3 at its prior α 0.66: 1.14x the tokens per ms
    of its own plain decoding (...); the other formats' best, as multiples of that: F16 0.51x; ...; Q8_0
    1.06x": "that" read as the 1.14x, Q8_0 ahead of the best. By hand, E(0.66, 3) = (1 - 0.66^4) / 0.34
    tokens a verification of 4 rows: 2.3831 / 21.59 ms against 1 / 10.368 ms, 1.14x; Q8_0's
    2.3831 / 23.347, 1.06x; F16's 2.3831 / 48.627, 0.51x, all of the packaged file's plain step."""
    e = (1 - 0.66 ** 4) / (1 - 0.66)
    best, q8, f16 = (f"{e / ms * PK[1]:.2f}" for ms in (PK[4], Q8[4], F16[4]))
    assert (best, q8, f16) == ("1.14", "1.06", "0.51")
    c = choose_format(_walk_measurement())  # the priors, as the demo's start prices them
    assert c.format == "packaged", c.reason
    assert c.reason.startswith(
        f"measured: the packaged file is the best, with ngram γ=3 at its prior α 0.66, the share of its proposed "
        f"tokens assumed accepted before any traffic measured it: {best}x the tokens per ms of its own plain decoding "
        f"(10.37 ms a step after 300 cached tokens); the other formats' best, each as a multiple of the packaged "
        f"file's plain decoding, not of the {best}x: F16 {f16}x; BF16 left out ("), c.reason
    assert c.reason.endswith(f"; Q8_0 {q8}x"), c.reason
    assert "as multiples of that" not in c.reason and c.reason.count("the share of its proposed tokens") == 1
    # priced with measured α (not the priors) there is nothing to explain
    assert "assumed accepted" not in choose_format(_walk_measurement(), alphas={"ngram": 0.66}).reason


# (3) each phase's live closing line: one statement of each fact ------------------------------------------

def test_each_phases_live_closing_line_states_its_seconds_and_turns_once():
    """c750c7d: "code ended after 120 s and 241 requests: 120 s served and 3 judged turns of its adapter
    (1 promoted); its v9 served 155 requests" (report.json's shifts[1]); prose "201 s of traffic, 120 s of
    them on the phase's clock ... and 329 requests: 120 s served and 6 judged turns ..."."""
    import daemon.demo as demo

    code = {"workload": "code", "seconds": 120.4, "wall_seconds": 120.4, "requests": 241,
            "ended": "120 s served and 3 judged turns of its adapter (1 promoted); its v9 served 155 requests",
            "turns": {"turns": 3, "judged": 3, "promoted": 1}}
    prose = {"workload": "prose", "seconds": 120.2, "wall_seconds": 201.1, "requests": 329,
             "ended": "120 s served and 6 judged turns of its adapter (2 promoted); its v3 served 189 requests",
             "turns": {"turns": 6, "judged": 6, "promoted": 2}}
    line = demo._phase_end_line("code", code)
    assert line == ("code ended after 120 s, 241 requests and 3 turns of its adapter (3 judged, 1 promoted): its "
                    "phase_seconds passed with its adapter judged phase_min_judged times and promoted; its v9 served "
                    "155 requests"), line
    line = demo._phase_end_line("prose", prose)
    assert line == ("prose ended after 201 s of traffic, 120 s of them on the phase's clock (it starts at v0's "
                    "arrival; the 81 s before served while v0 bootstrapped), 329 requests and 6 turns of its adapter "
                    "(6 judged, 2 promoted): its phase_seconds passed with its adapter judged phase_min_judged times "
                    "and promoted; its v3 served 189 requests"), line
    for line in (demo._phase_end_line("code", code), demo._phase_end_line("prose", prose)):
        assert line.count("120 s") == 1 and len(re.findall(r"\d+ judged", line)) == 1, line
    # a time-bounded phase without a trainer: no turns to give
    bare = {"seconds": 120.0, "requests": 50, "ended": "120 s served"}
    assert demo._phase_end_line("math", bare) == "math ended after 120 s, 50 requests: its phase_seconds passed"


# (4) the notes' gains signed as the table's ----------------------------------------------------------------

def test_the_notes_print_each_gain_signed_as_the_table_does():
    """c750c7d: the table "+0.422 [+0.314, +0.564]", the notes "raised decoded α 0.178 -> 0.600 (0.422, CI
    [0.314, 0.564])" and "v2 -> v3 no measured change in decoded α: 0.593 -> 0.600 (0.007, CI [-0.026,
    0.050])" (prose; report.json's phase_end_gain_ci and versions)."""
    from test_demo_trips3 import _phase

    pe = {"version": 3, "before": 0.178, "after": 0.600, "gain": 0.4219, "low": 0.3138, "high": 0.5641}
    versions = [{"parent": 1, "version": 2, "alpha_before": 0.178, "alpha_after": 0.593, "gain": 0.415,
                 "low": 0.305, "high": 0.566, "lowered": False},
                {"parent": 2, "version": 3, "alpha_before": 0.593, "alpha_after": 0.600, "gain": 0.007,
                 "low": -0.026, "high": 0.050, "lowered": False}]
    text = _text({"phases": [_phase("prose", final_adapter=3, phase_end_gain_ci=pe, versions=versions)]})
    assert ("prose: at its phase's end the learner (v3) had raised decoded α 0.178 -> 0.600 (+0.422, CI [+0.314, "
            "+0.564]); the table's adapted row is this same version") in text, text
    assert "prose: v1 -> v2 raised decoded α: 0.178 -> 0.593 (+0.415, CI [+0.305, +0.566])" in text, text
    assert "prose: v2 -> v3 no measured change in decoded α: 0.593 -> 0.600 (+0.007, CI [-0.026, +0.050])" in text, text
    # the copy channel's table likewise: its gain cells signed as their intervals are
    row = {"alpha": 0.5, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0}
    copy = _phase("prose", adapted_nogate=row, frozen_fixedgate=row, alpha_gain_ci={"gain": 0.1, "low": 0.05,
                                                                                    "high": 0.2})
    text = _text({"phases": [copy]})
    assert "+0.100 [+0.050, +0.200]" in text and "0.100 [+" not in text.replace("+0.100 [+", ""), text


def _text(report: dict) -> str:
    from test_demo_trips2 import _printed  # the report as printed at 600 columns

    return " ".join(_printed(report).split())


# (5)-(7) the closing ceilings ----------------------------------------------------------------------------

# c750c7d's report.json: remeasured.step_cost_ms (the trainer stopped), remeasured.beside_trainer.step_cost_ms,
# the top-level step_cost_ms (after the evaluation's own steps), ms by rows
STOPPED = {1: 8.3317, 2: 16.1952, 3: 18.6836, 4: 19.9926, 5: 19.8083}
BESIDE = {1: 6.9766, 2: 13.9493, 3: 12.6865, 4: 15.3527, 5: 16.4076}
LAST = {1: 7.0055, 2: 14.69, 3: 17.1056, 4: 16.4876, 5: 20.1639}


def _ceil(ms: dict) -> dict:  # StepCost.ceiling on the costs as measured: (γ + 1) t(1) / t(γ + 1)
    by = {r - 1: round(r * ms[1] / max(ms[r], ms[1]), 3) for r in ms if r > 1}
    g = max(by, key=by.get)
    return {"by_gamma": by, "gamma": g, "speedup": by[g]}


def _walk_report(**kw) -> dict:
    from test_demo_trips3 import _phase

    rem = {"requests": 64, "step_cost_ms": STOPPED, "engine_ceiling": _ceil(STOPPED),
           "beside_trainer": {"step_cost_ms": BESIDE, "engine_ceiling": _ceil(BESIDE)}}
    return {"phases": [_phase("prose", **kw)], "remeasured": rem, "step_cost_ms": LAST, "engine_ceiling": _ceil(LAST)}


def test_the_ceiling_beside_the_trainer_compares_with_the_stopped_headline_and_claims_no_cause():
    """c750c7d: stopped "at most 2.08x plain" (5 rows priced at 4 rows' 19.99: 5 x 8.3317 / 19.9926 = 2.084;
    2.10x with the dip, 5 x 8.3317 / 19.8083 = 2.103), beside the trainer 2.13x (5 x 6.9766 / 16.4076 =
    2.126) "above the 2.10x with the trainer stopped: ... (the trainer slows a verification and a plain step
    alike)", while its plain step, 6.98 ms, was faster than the stopped 8.33. 5 rows: 16.4076 / 6.9766 =
    2.35 plain steps beside the trainer, 19.9926 / 8.3317 = 2.40 stopped. Priced now on the monotone fit
    (tests/daemon/test_demo_isotonic.py), no longer the running max: 4 and 5 rows stopped at (19.9926 +
    19.8083) / 2 = 19.9005, the headline 5 x 8.3317 / 19.9005 = 2.093, 5 rows 19.9005 / 8.3317 = 2.39."""
    assert _ceil(STOPPED)["speedup"] == 2.103 and _ceil(BESIDE)["speedup"] == 2.126
    five = (STOPPED[4] + STOPPED[5]) / 2
    headline = f"{5 * STOPPED[1] / five:.2f}"
    assert headline == "2.09"
    text = _text(_walk_report())
    assert "speculation could run at most 2.09x plain (γ=4" in text and "at most 2.13x plain (γ=4" in text, text
    assert (f"above the {headline}x with the trainer stopped: each ceiling divides by its own moment's plain step, "
            f"and 5 rows cost {BESIDE[5] / BESIDE[1]:.2f} plain steps here against {five / STOPPED[1]:.2f} with "
            f"the trainer stopped, medians of other requests' steps; against a plain step of 6.98 ms measured beside "
            f"the trainer (8.33 ms with the trainer stopped)") in text, text
    assert "above the 2.10x" not in text and "alike" not in text and "which slowed it" not in text
    # a beside ceiling at the stopped headline, above its dip-included 2.10x only: not "above"
    level = {1: 6.9766, 2: 13.9493, 5: 5 * 6.9766 / 2.09}
    assert "above the" not in _line(level)


def _line(beside: dict) -> str:
    import daemon.demo as demo

    return demo._ceiling_line(_ceil(beside), beside, "while serving, beside the trainer", STOPPED,
                              stopped_ceil=_ceil(STOPPED))


def test_the_third_ceiling_is_named_with_its_value():
    """c750c7d: "report.json's top-level step_cost_ms (7.01 ms) and engine_ceiling (a third ceiling, on
    those steps)", its value 1.737 (5 x 7.0055 / 20.1639) nowhere on the console."""
    assert _ceil(LAST)["speedup"] == 1.737
    text = _text(_walk_report())
    assert ("report.json's top-level step_cost_ms (7.01 ms) and engine_ceiling (a third ceiling, 1.737x, on those "
            "steps) are StepCost after the evaluation's own steps") in text, text


def test_a_dip_is_explained_once_on_the_ceiling_line_and_referred_to_by_the_leviathan_caption():
    """c750c7d printed "5 rows measured 19.81 ms, below 4 rows' 19.99: noise between two readings ..." under
    the Leviathan table and again in the ceiling line with the trainer stopped, the same costs."""
    from test_demo_trips3 import _row

    pred = {"alpha": 0.6003, "c": 0.3286, "tau": 2.3333, "verify_cost_rows": {2: 1.944, 3: 2.242, 4: 2.4, 5: 2.4},
            "one_step": {"gamma": 1, "speedup": 1.205}, "this_engine": {"gamma": 1, "speedup": 0.704},
            "step_cost_ms": {str(k): v for k, v in STOPPED.items()}}  # from JSON: keys as strings
    text = _text(_walk_report(adapted_draft=_row(matches_plain="8/8", prediction=pred)))
    assert text.count("19.81 ms") == 1 and text.count("5 rows measured") == 2, text  # said, and referred to
    # priced on the monotone fit (tests/daemon/test_demo_isotonic.py), no longer the running max: 4 and 5 rows
    # at (19.9926 + 19.8083) / 2 = 19.9005, γ=4 5 x 8.3317 / 19.9005 = 2.093 (the running max's 2.08x: / 19.9926)
    assert ("engine ceiling with the trainer stopped (re-measured before the evaluation): even if every proposal were "
            "accepted at no cost, speculation could run at most 2.09x plain") in text
    assert ("5 rows measured 19.81 ms, below 4 rows' 19.99: noise between two readings (a verification of more rows "
            "cannot cost less), priced on the least-squares fit that never falls with more rows: 4 and 5 rows at "
            "19.90 ms, the mean of their readings (2.10x on the costs as measured") in text, text
    assert ("t(n) as the least-squares fit that never falls with more rows; 5 rows measured below 4 rows', pooled at "
            "the mean of their run: noise, as the first engine ceiling line below says)") in text, text
    # other costs than the ceiling line's: the caption explains its own dip
    pred["step_cost_ms"] = {1: 8.0, 2: 16.0, 3: 15.0}
    text = _text(_walk_report(adapted_draft=_row(matches_plain="8/8", prediction=pred)))
    assert "3 rows measured 15.00 ms, below 2 rows' 16.00: noise between two readings" in text, text


# (8) the alarm note: the phase line's clock, and plain words ----------------------------------------------

def _alarm(w: str, ref: float, rec: float) -> dict:
    return {"key": [w, "greedy"], "proposer": "ngram", "reference_alpha": ref, "recent_alpha": rec}


def test_the_alarm_note_counts_on_the_phase_lines_clock_and_says_none_is_at_a_shift():
    """c750c7d: prose's n-gram alarm "122 s into its phase" (timeline t 122.25, its phase's first request at
    t 0) while prose's line gave "120 s of them on the phase's clock", which started 201.1 - 120.2 = 80.9 s
    after its first request (at v0): 41 s on that clock. Code's 243.24 - 201.11 = 42 s, extract's 505.43 -
    441.60 = 64 s and 526.36 - 441.60 = 85 s (their clocks start at their first request). Then "Why: the
    ones 122, 42, 64, 85 s into their phases are no shift's"."""
    import daemon.demo as demo

    shifts = [{"t": 0.0, "request": 0, "workload": "prose", "seconds": 120.2, "wall_seconds": 201.1, "requests": 329},
              {"t": 201.109, "request": 329, "workload": "code", "seconds": 120.4, "wall_seconds": 120.4,
               "requests": 241},
              {"t": 321.517, "request": 570, "workload": "math", "seconds": 120.1, "wall_seconds": 120.1,
               "requests": 290},
              {"t": 441.602, "request": 860, "workload": "extract", "seconds": 120.2, "wall_seconds": 120.2,
               "requests": 280}]
    flagged = {139: 122.25, 410: 243.24, 1010: 505.43, 1059: 526.36}
    timeline = [{"t": flagged.get(i, 0.0), "shift_alarm": i in flagged} for i in range(1140)]
    report = {"shift_alarms": [_alarm("prose", 0.7031, 0.5333), _alarm("code", 0.5852, 0.3231),
                               _alarm("extract", 0.8247, 0.6621), _alarm("extract", 0.7932, 0.525)],
              "shifts": shifts, "timeline": timeline, "remeasured": {"alarms": {"before": 4, "after": 4}}}
    on_clock = [round(122.25 - (201.1 - 120.2)), round(243.24 - 201.109), round(505.43 - 441.602),
                round(526.36 - 441.602)]
    assert on_clock == [41, 42, 64, 85]
    note = demo._shift_alarms_note(report)
    assert ("prose n-gram 0.70 -> 0.53 at request 140 of 329, 41 s into its phase; code n-gram 0.59 -> 0.32 at "
            "request 82 of 241, 42 s into its phase; extract n-gram 0.82 -> 0.66 at request 151 of 280, 64 s into "
            "its phase; extract n-gram 0.79 -> 0.53 at request 200 of 280, 85 s into its phase. Why: none of them is "
            "at a shift: they came 41, 42, 64 and 85 s into their phases (runs of harder prompts). No action") in note, \
        note
    assert "122 s" not in note and "shift's" not in note
    # an alarm before the first phase's clock started (v0 still bootstrapping): said so, on the traffic's seconds
    early = dict(report, timeline=[dict(r, t=30.0) if i == 139 else r for i, r in enumerate(timeline)])
    note = demo._shift_alarms_note(early)
    assert ("at request 140 of 329, 30 s after its phase's first request, before its clock started (while v0 "
            "bootstrapped);") in note, note


# (9) the plot's labels readable over the dense n-gram line ----------------------------------------------------

def test_the_plots_labels_sit_on_a_white_see_through_box_above_the_lines():
    """c750c7d's plot: extract's "v1 (shared)" and "v20" drawn straight over the dense n-gram points and
    rolling mean. Each label (a shift's and a swap's) now has a white box with alpha below 1, drawn above
    the lines (a higher zorder)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    import daemon.demo as demo

    timeline = [{"t": float(t), "workload": w, "adapter_version": v}
                for t, w, v in [(0, "prose", 0), (50, "prose", 1), (130, "extract", 1), (180, "extract", 20),
                                (240, "extract", 20)]]
    shifts = [{"t": 0.0, "request": 0, "workload": "prose"}, {"t": 125.0, "request": 2, "workload": "extract"}]
    labels, swaps = demo._plot_labels(timeline, shifts, {1: "", 20: "extract"})
    assert labels == [" prose: base draft", " extract: v1 (shared)"] and [x for _, x, _ in swaps] == [" v1 (shared)",
                                                                                                     " v20"]
    fig, ax = plt.subplots()
    try:
        line, = ax.plot([0, 240], [0.5, 0.9])
        demo._draw_labels(ax, shifts, labels, swaps)
        texts = {t.get_text(): t for t in ax.texts}
        assert set(texts) == {" prose: base draft", " extract: v1 (shared)", " v1 (shared)", " v20"}
        for t in texts.values():
            box = t.get_bbox_patch()
            assert box is not None, t.get_text()
            face = box.get_facecolor()
            assert face[:3] == to_rgba("white")[:3] and 0 < face[3] < 1, (t.get_text(), face)
            assert t.get_zorder() > line.get_zorder()
    finally:
        plt.close(fig)


# the second walkthrough at 3535c3a: the recovery table's seconds ----------------------------------------

def test_the_recovery_table_gives_seconds_to_a_tenth_not_three_decimals():
    """3535c3a's recovery table printed "3.800", "9.700" and "7.400" seconds beside whole requests."""
    import io

    from rich.console import Console

    from daemon.demo import _recovery_and_footer

    c = Console(record=True, width=170, file=io.StringIO())
    rows = [{"from": "prose", "workload": "code", "pre_shift_alpha": 0.636, "requests": 8, "seconds": 3.8,
             "recovered_alpha": 0.598},
            {"from": "code", "workload": "math", "pre_shift_alpha": 0.429, "requests": None, "seconds": None,
             "recovered_alpha": None}]
    _recovery_and_footer({"recovery": rows, "requests": 1161, "seconds": 860.0, "key_prefix": "walk3:demo:"}, c)
    text = c.export_text()
    assert re.search(r"│ prose → code\s+│ 0\.636\s+│ 8\s+│ 3\.8\s+│ 0\.598\s+│", text), text
    assert "3.800" not in text
    assert re.search(r"│ code → math\s+│ -\s+│ -\s+│ -\s+│ -\s+│", text.replace("0.429", "-")), text


def test_an_alarm_early_in_the_first_phase_is_not_called_after_a_shift():
    """3535c3a: prose's alarm "16 s into its phase" explained as "expected after a shift (prompts the
    proposer had not seen)", though prose is the first workload: no shift came before it. An early alarm
    in a later phase still is one."""
    import daemon.demo as demo

    shifts = [{"t": 0.0, "request": 0, "workload": "prose", "seconds": 120.2, "wall_seconds": 201.1, "requests": 329},
              {"t": 201.109, "request": 329, "workload": "code", "seconds": 120.4, "wall_seconds": 120.4,
               "requests": 241}]
    flagged = {79: 201.1 - 120.2 + 16.0, 420: 201.109 + 45.0}
    timeline = [{"t": flagged.get(i, 0.0), "shift_alarm": i in flagged} for i in range(570)]
    report = {"shift_alarms": [_alarm("prose", 0.6567, 0.4667), _alarm("code", 0.57, 0.50)],
              "shifts": shifts, "timeline": timeline, "remeasured": {"alarms": {"before": 2, "after": 2}},
              "phases": [{"workload": "prose"}, {"workload": "code"}]}
    note = demo._shift_alarms_note(report)
    assert "16 s into its phase" in note and "45 s into its phase" in note, note
    assert ("Why: the one early in the first phase, prose, came before any shift (its running mean was still "
            "young); the one 45 s into its phase is not at a shift") in note, note
    assert "expected after a shift" not in note
    # the same alarm 10 s into code's phase: that one follows a shift
    later = dict(report, timeline=[dict(r, t=201.109 + 10.0) if i == 420 else r for i, r in enumerate(timeline)])
    note = demo._shift_alarms_note(later)
    assert "Why: expected after a shift (prompts the proposer had not seen); the one early in the first phase" in note, note
