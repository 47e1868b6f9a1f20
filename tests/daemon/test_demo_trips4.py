"""The quick demo's trips of the fourteenth session's walkthroughs at 302b64b and 7f7aad4
(docs/walkthroughs.md, their "Trips" lists) still there at HEAD: the console's ceiling against
report.json's, an interval bound printed as +0.0000, a live α that mixes proposers, the closing
line, the plot's adapter labels, the closing alarm note's length, the decoded table's width, and
three plain-step figures nothing tells apart."""

import io

from rich.console import Console

import daemon.demo as demo
from test_demo_trips2 import _printed  # the report as printed at 600 columns
from test_demo_trips3 import _phase, _row


def _text(report: dict) -> str:
    return " ".join(_printed(report).split())


# (4) the console's ceiling against report.json's ---------------------------------------------------------

# 7f7aad4's re-measured step costs with the trainer stopped: 5 rows below 4 rows'
STOPPED = {1: 15.72, 2: 28.21, 3: 28.50, 4: 37.44, 5: 37.08}


def test_the_ceiling_priced_over_a_dip_names_report_jsons_figure_on_the_costs_as_measured():
    """The console said "at most 2.10x plain" and report.json's remeasured.engine_ceiling.speedup
    2.12, nothing said which is which. As measured (StepCost.ceiling): γ=4 at 5 x 15.72 / 37.08 =
    2.120x; as priced on the monotone fit (no longer the running max's 4 rows' 37.44), 4 and 5 rows
    at (37.44 + 37.08) / 2 = 37.26: 5 x 15.72 / 37.26 = 2.110x, still the best γ (γ=3: 4 x 15.72 /
    37.26 = 1.688)."""
    by = {r - 1: round(r * STOPPED[1] / STOPPED[r], 3) for r in STOPPED if r > 1}
    assert by[4] == 2.12 and max(by, key=by.get) == 4
    raw = {"by_gamma": by, "gamma": 4, "speedup": by[4]}
    rem = {"requests": 64, "step_cost_ms": STOPPED, "engine_ceiling": raw}
    text = _text({"phases": [_phase("prose")], "remeasured": rem})
    assert "speculation could run at most 2.11x plain (γ=4, the best of γ=1, 2, 3, 4 measured" in text, text
    assert ("5 rows measured 37.08 ms, below 4 rows' 37.44: noise between two readings (a verification of more rows "
            "cannot cost less), priced on the least-squares fit that never falls with more rows: 4 and 5 rows at "
            "37.26 ms, the mean of their readings (2.12x on the costs as measured, the dip included: "
            "report.json's remeasured.engine_ceiling.speedup); against a plain step of 15.72 ms") in text, text
    # beside the trainer: its own key
    line = demo._ceiling_line(raw, STOPPED, "while serving, beside the trainer", STOPPED,
                              key="remeasured.beside_trainer.engine_ceiling")
    assert "(2.12x on the costs as measured, the dip included: report.json's remeasured.beside_trainer" in line
    # costs that rise with rows: one figure, nothing more to tell apart
    rising = {1: 10.0, 2: 20.0, 3: 24.0}
    ceil = {"by_gamma": {1: 1.0, 2: 1.25}, "gamma": 2, "speedup": 1.25}
    assert "on the costs as measured" not in demo._ceiling_line(ceil, rising, "with the trainer stopped")


# (5) an interval bound that fails "above 0" never prints as +0.0000 --------------------------------------

def test_a_bound_that_rounds_to_zero_keeps_its_digits_and_exactly_zero_reads_0():
    from store.wording import signed
    from trainer.gate import PairedGain

    assert signed(0.0534) == "+0.0534" and signed(-0.0534) == "-0.0534"
    assert signed(0.0) == "0" and signed(-0.0) == "0"
    assert signed(3.2e-05) == "+0.000032" and signed(-4e-07) == "-0.00000040"
    assert signed(0.0534, 3) == "+0.053" and signed(0.0004, 3) == "+0.00040"
    pg = PairedGain(10, 10, 100, 0.5, 0.526, 0.026, 0.0, 0.0534, 0.95)
    assert "(+0.0260, 95 % CI [0, +0.0534])" in pg.describe(), pg.describe()
    tiny = PairedGain(10, 10, 100, 0.5, 0.526, 0.026, -3e-06, 0.0534, 0.95)
    assert "CI [-0.0000030, +0.0534]" in tiny.describe()


def test_the_gate_says_a_lower_bound_of_exactly_0_is_one():
    """7f7aad4's v13: "+0.0260, 95 % CI [+0.0000, +0.0534] ...: the interval's lower bound is not above
    0" read as met. One request of ten gains 0.5 a position, the rest nothing: 0.9^10 = 35 % of the
    resamples miss it and give exactly 0, so the 2.5 % quantile is 0."""
    from trainer.distill import EvalCounts, EvalResult
    from trainer.service import ServiceConfig, gate

    def ev(served):
        r = EvalResult()
        for i, a in enumerate(served):
            r.add_sample(f"prose-{i}", "prose", EvalCounts(1, 10, a * 10, 0, a * 10))
        return r

    cfg = ServiceConfig(min_eval_samples=4, min_eval_requests=8, min_eval_positions=80, promote_margin=0.0)
    v = gate(ev([0.5] * 10), ev([1.0] + [0.5] * 9), {"prose"}, cfg)
    assert not v.promote and v.evidence.low == 0.0
    assert "95 % CI [0, +" in v.reason and "+0.0000" not in v.reason, v.reason
    assert v.reason.endswith("the interval's lower bound is not above 0 (it is exactly 0: the gate needs it above 0)")
    # a decoded α gain's interval in the demo's table likewise
    assert demo._interval({"gain": 0.03, "low": 0.0, "high": 0.061}) == "[0, +0.061]"
    assert demo._interval({"gain": 0.03, "low": -0.0002, "high": 0.061}) == "[-0.00020, +0.061]"


# (6) the live α per proposer ----------------------------------------------------------------------------

def test_the_live_line_gives_each_proposers_alpha_apart():
    """7f7aad4's live lines around v1's arrival: "α 0.690, τ 1.36 (6 speculated)", then "α 0.282, τ
    1.07 (6 speculated)", "serving v1": read as the bootstrap halving α, where the mean mixed the
    n-gram's requests and the draft's. Of the last 8 here: the n-gram on 4 (α 0.8, 0.7, 0.9, 0.8: mean
    0.800; τ 2, 2, 3, 1: 2.00), the draft on 2 (α 0.2, 0.3: 0.250; τ 1.0, 1.2: 1.10), 2 plain."""
    def row(proposer, alpha, tau):
        return {"workload": "prose", "proposer": proposer, "alpha": alpha, "tau": tau, "tokens_per_s": 40.0,
                "adapter_version": 1}

    tl = [row("ngram", 0.8, 2.0), row("draft", 0.2, 1.0), row("ngram", 0.7, 2.0), row(None, None, 1.0),
          row("ngram", 0.9, 3.0), row("draft", 0.3, 1.2), row(None, None, 1.0), row("ngram", 0.8, 1.0)]
    assert demo._progress_line(tl, "prose", 40, 68.0) == (
        "prose: 40 requests in 68 s; last 8: ngram α 0.800, τ 2.00 (4 speculated) and draft α 0.250, τ 1.10 "
        "(2 speculated), 40.0 tokens/s; serving v1")
    # one proposer: named, its own figures
    only = [r for r in tl if r["proposer"] != "draft"]
    assert "; last 6: ngram α 0.800, τ 2.00 (4 speculated), 40.0" in demo._progress_line(only, "prose", 40, 68.0)
    # one draft request among n-gram ones: "one request's", to 2 decimals
    one = tl[:2] + [r for r in tl[2:] if r["proposer"] != "draft"]
    assert "and draft α 0.20, τ 1.00 (one request's), 40.0" in demo._progress_line(one, "prose", 40, 68.0)

    class Fake:
        def status(self):
            return {}

        def decision(self, key):
            return {"why": "test"}

    out = io.StringIO()
    Console(file=out, width=300).print(demo._progress_table(tl, "prose", Fake(), Fake(), Fake(), ("prose", "greedy")))
    text = out.getvalue()
    assert "rolling α, τ (6 of the last 8 speculated)" in text
    assert "ngram α 0.800, τ 2.00 (4 speculated) and draft α 0.250, τ 1.10 (2 speculated)" in text, text


# (8) the closing line, as two sentences ------------------------------------------------------------------

def test_the_closing_lines_are_two_sentences():
    """7f7aad4: "requests served: 666 in the phases, 730 with the 64 of the re-measurement, adapters serving,
    each workload's own scope: prose v2, ..., seconds: 1063.6, plot: ..." read as one garbled sentence."""
    phases = [_phase(w) for w in ("prose", "code", "math", "extract")]
    report = {"phases": phases, "requests": 666, "seconds": 1063.6, "active_adapter": 1, "plot": "out/demo/acceptance.png",
              "remeasured": {"requests": 64}, "config": {"per_workload": True},
              "workload_adapters": {"prose": 2, "code": 7, "math": 12, "extract": 15}}
    lines = [" ".join(x.split()) for x in _printed(report).splitlines()]
    at = next(i for i, x in enumerate(lines) if x.startswith("Requests served"))
    assert lines[at] == ("Requests served: 666 in the phases and 64 in the re-measurement, 730 in all, in 1063.6 s "
                         "(the plot: out/demo/acceptance.png)."), lines[at]
    assert lines[at + 1] == ("Serving at the end, each workload its own adapter: prose v2, code v7, math v12, extract "
                             "v15; the shared v1 serves any other workload."), lines[at + 1]
    assert not any("adapters serving, each workload's own scope" in x for x in lines)
    # math and extract without their own
    text = _text(report | {"workload_adapters": {"prose": 2, "code": 7}})
    assert ("Serving at the end: prose v2, code v7 (each its own); math, extract the shared v1 (no adapter of their "
            "own promoted).") in text, text


# (9) the plot's labels: what served each workload, no overlap at a shift ------------------------------

def test_the_plot_labels_each_shift_with_what_served_it_and_swaps_inside_phases_apart(tmp_path):
    """302b64b and 7f7aad4: the plot labelled the adapter at every shift "v1" (the shared bootstrap,
    routed before the workload had its own) as if it were a new version, and "v13" and "v1" overlapped
    at the math -> extract shift. Here prose starts on the base draft, v1 (shared) arrives at 3 s, prose's
    own v2 at 5 s; code and math each start on the shared v1, then their own v7, v11 and v12 (11.2 s and
    11.3 s: within 4 % of the 20 s axis, so v12 goes a row lower)."""
    versions = [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 2), (7, 1), (8, 1), (9, 7), (10, 7),
                (11, 1), (11.2, 11), (11.3, 12), (20, 12)]
    work = ["prose"] * 6 + ["code"] * 4 + ["math"] * 4
    timeline = [{"t": float(t), "workload": w, "adapter_version": v, "proposer": "draft", "gamma": 2, "alpha": 0.5,
                 "tokens_per_s": 30.0} for (t, v), w in zip(versions, work)]
    shifts = [{"t": 0.0, "request": 0, "workload": "prose"}, {"t": 6.5, "request": 6, "workload": "code"},
              {"t": 10.5, "request": 10, "workload": "math"}]
    scopes = {1: "", 2: "prose", 7: "code", 11: "math", 12: "math"}
    labels, swaps = demo._plot_labels(timeline, shifts, scopes)
    assert labels == [" prose: base draft", " code: v1 (shared)", " math: v1 (shared)"]
    assert swaps == [(3.0, " v1 (shared)", 0), (5.0, " v2", 0), (9.0, " v7", 0), (11.2, " v11", 0), (11.3, " v12", 1)]
    # shifts without their first request's index start at their time: the same labels
    bare = [{k: v for k, v in s.items() if k != "request"} for s in shifts]
    assert demo._plot_labels(timeline, bare, scopes) == (labels, swaps)
    # a version of another workload's scope is named as such
    assert demo._adapter_name(7, scopes, "math") == "v7 (code's)" and demo._adapter_name(9, scopes, "math") == "v9"
    path = tmp_path / "a.png"
    demo.plot_timeline(timeline, shifts, path, scopes)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# (13) the closing alarm note, short -----------------------------------------------------------------------

def test_the_closing_alarm_note_says_what_fired_why_and_where_to_look_in_a_few_lines():
    """302b64b's closing alarm note ran 12 lines at 170 columns, 7f7aad4's 10. 7f7aad4's four n-gram
    alarms: prose 123 s into its phase, code 86 s, extract 29 s and 114 s; none in the re-measurement."""
    import textwrap

    def alarm(w, ref, rec):
        return {"key": [w, "greedy"], "proposer": "ngram", "reference_alpha": ref, "recent_alpha": rec}

    shifts = [{"t": 0.0, "request": 0, "workload": "prose", "requests": 3},
              {"t": 200.0, "request": 3, "workload": "code", "requests": 2},
              {"t": 400.0, "request": 5, "workload": "extract", "requests": 3}]
    timeline = [{"t": t, "shift_alarm": t in (123.0, 286.0, 429.0, 514.0)}
                for t in (10.0, 60.0, 123.0, 210.0, 286.0, 429.0, 480.0, 514.0)]
    report = {"shift_alarms": [alarm("prose", 0.8, 0.35), alarm("code", 0.85, 0.4), alarm("extract", 0.95, 0.65),
                               alarm("extract", 0.9, 0.65)], "shifts": shifts, "timeline": timeline,
              "remeasured": {"alarms": {"before": 4, "after": 4}, "requests": 64}, "plot": "out/demo/acceptance.png"}
    note = demo._shift_alarms_note(report)
    assert note == (
        "4 acceptance_shift alarm(s) (a proposer's windowed α fell below its running mean; mean -> its last requests'): "
        "prose n-gram 0.80 -> 0.35 at request 3 of 3, 123 s into its phase; code n-gram 0.85 -> 0.40 at request 2 of 2, "
        "86 s into its phase; extract n-gram 0.95 -> 0.65 at request 1 of 3, 29 s into its phase; extract n-gram 0.90 -> "
        "0.65 at request 3 of 3, 114 s into its phase. Why: expected after a shift (prompts the proposer had not seen); "
        "the ones 123, 86 and 114 s into their phases are not at a shift (runs of harder prompts). No action needed while "
        "outputs equal plain decoding's (above); one far from a shift or beside a rollback is worth a look: "
        "report.json's shift_alarms, α per proposer in acceptance.png"), note
    assert len(textwrap.wrap(note, 170)) <= 5


# (14) the decoded table fits a 170-column terminal -----------------------------------------------------

def test_the_decoded_comparison_fits_170_columns_without_folding_a_cell():
    """302b64b: the decoded table's 14 columns folded cells ("0.143→0.42" / "9") at a 170-column
    terminal. Two tables of the same rows now (acceptance; the pick's speed), every column kept:
    7f7aad4's prose and extract rows, an n-gram pick on extract, the draft and the n-gram live."""
    def row(w, frozen, adapted, gain, lo, hi, live):
        first = {"alpha": 0.5, "alpha_by_proposer": {p: {"alpha": a} for p, (a, _) in live.items()}}
        last = {"alpha": 0.5, "alpha_by_proposer": {p: {"alpha": b} for p, (_, b) in live.items()}}
        return _phase(w, eval_prompts=8, frozen={"alpha": frozen, "speedup_vs_plain": 0.452, "matches_plain": "8/8"},
                      adapted_draft={"alpha": adapted, "speedup_vs_plain": 0.713, "matches_plain": "8/8"},
                      alpha_gain_ci={"gain": gain, "low": lo, "high": hi}, live_first_third=first, live_last_third=last,
                      speed_vs_llamacpp_ci={"adapted": {"ratio": 1.133, "low": 1.079, "high": 1.182}})
    live = {"draft": (0.143, 0.42), "ngram": (0.812, 0.655)}  # the quick demo's two proposers (no --heads)
    prose = row("prose", 0.178, 0.58, 0.401, 0.294, 0.551, live)
    extract = row("extract", 0.164, 0.604, 0.439, 0.351, 0.552, live)
    extract["adapted"] = {"proposer": "ngram", "gamma": 4, "alpha": 0.712, "tau": 3.104, "speedup_vs_plain": 1.209}
    extract["speed_vs_plain_ci"] = {"adapted": {"ratio": 1.209, "low": 1.03, "high": 1.47}}
    out = io.StringIO()
    demo.print_report({"adapters": [], "recovery": [], "requests": 10, "active_adapter": 1, "seconds": 1.0,
                       "key_prefix": "x:", "phases": [prose, extract]}, Console(file=out, width=170))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 170
    # the point signed as its bounds are (39d6919's walkthrough read "0.451 [+0.377, +0.548]")
    whole = ["draft 0.143→0.420, ngram 0.812→0.655", "+0.401 [+0.294, +0.551]",
             "+0.439 [+0.351, +0.552]", "1.209 [1.03, 1.47]", "1.133 [1.08, 1.18]", "plain (same decoding)", "ngram γ=4"]
    for cell in whole:  # each on one line: no cell folded
        assert any(cell in x for x in lines), (cell, out.getvalue())
    heads = " ".join(" ".join(lines).split())
    for c in ("frozen α", "frozen ×plain", "adapted draft α", "adapted draft ×plain", "α gain [95 % CI]",
              "live α first→last third, per proposer", "plain tok/s", "pick α", "pick τ", "pick ×plain [95 % CI]"):
        assert c in heads or all(w in heads for w in c.split()), c


# (11) which plain-decoding figure measures what ----------------------------------------------------------

def test_one_line_names_what_each_plain_decoding_figure_measures():
    """7f7aad4: the re-measured plain step 15.72 ms, the format measurement's 14.72 ms and the evaluation's
    plain 50.8-61.7 tokens/s, nothing said which to trust."""
    sf = {"format": "packaged", "file": "m.gguf", "costs": [{"format": "packaged", "file": "m.gguf", "ms": {1: 14.72}},
                                                           {"format": "Q8_0", "file": "q.gguf", "ms": {1: 20.39}}],
          "measurement": {"cached_tokens": 300}}
    phases = [_phase("prose", plain=_row(tokens_per_s=50.8)),
              _phase("math", plain=_row(tokens_per_s=61.7))]
    report = {"phases": phases, "served_format": sf, "remeasured": {"requests": 64, "step_cost_ms": STOPPED},
              "config": {"max_new_tokens": 32, "eval_new_tokens": 64}}
    line = demo._plain_figures(report)
    assert line == (
        "plain decoding, three measurements of their own: 14.72 ms, the format measurement's step of the packaged "
        "file at startup, before the trainer, after 300 cached tokens; 15.72 ms, the serving loop's own steps "
        "re-measured on 64 requests (prompts of at most 256 tokens, 32 new tokens each), the trainer stopped; "
        "50.8-61.7 tokens/s, the evaluation's whole requests of 64 new tokens, prefill included, the trainer stopped. "
        "Each moved with the host's load at its moment; speed is judged on the evaluation's ratios, paired per "
        "prompt"), line
    assert line in _text(report)
    # report.json read back: the rows' keys are strings
    back = dict(report, served_format=dict(sf, costs=[{"format": "packaged", "ms": {"1": 14.72}}]))
    assert demo._plain_figures(back) == line
    # one figure alone: nothing to tell apart
    assert demo._plain_figures({"phases": phases[:1]}) is None
    # Q8_0 served (39d6919's walkthrough: the packaged file's 15.87 ms beside a served 12.07, read as a drift)
    q8 = demo._plain_figures(dict(report, served_format=dict(sf, format="Q8_0")))
    assert q8.startswith("plain decoding, three measurements of their own: 20.39 ms, the format measurement's step "
                         "of the Q8_0 copy served at startup, before the trainer, after 300 cached tokens;"), q8


def test_the_live_trainer_cell_does_not_repeat_the_workload_of_its_turn():
    """39d6919's walkthrough: "rounds 4, last: prose rejected on prose: α 0.5278 -> 0.5346 ...": each
    workload's turn reason opens with its own scope. Now "prose rejected: α ...", the reason kept."""
    from daemon.demo import _progress_table

    class Fake:
        def status(self):
            return {"rounds": 4, "last_round": {"decision": "idle", "scopes": {
                "prose": {"decision": "rejected", "reason": "on prose: α 0.5278 -> 0.5346 (+0.0068)"},
                "code": {"decision": "promoted", "reason": "on code: α 0.40 -> 0.47 (+0.07)"}}}}

        def decision(self, key):
            return {"why": "test"}

    out = io.StringIO()
    Console(file=out, width=200).print(_progress_table([], "prose", Fake(), Fake(), Fake(), ("prose", "greedy")))
    text = " ".join(out.getvalue().split())
    assert "last: code promoted: α 0.40 -> 0.47 (+0.07); prose rejected: α 0.5278 -> 0.5346 (+0.0068)" in text, text
    assert "on prose" not in text and "on code" not in text
