"""The second walkthrough's newcomer trip points (docs/walkthroughs.md, "The quick demo at 8690a9e"):
what the demo's closing lines say about the files compared, the ceilings, the alarms, the plot,
the rejections, the live line and the final JSON line."""

import io

import pytest
from rich.console import Console

from daemon.demo import print_report


def _phase(workload: str) -> dict:
    row = {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0}
    return {"workload": workload, "heldout_samples": 0, "adapter_at_phase_end": 0, "final_adapter": 0,
            "plain": row, "frozen": {**row, "matches_plain": "8/8"}, "adapted_draft": {**row, "matches_plain": "8/8"},
            "adapted": {**row, "same_run_as": "plain"}, "controller_pick": {"why": "off: plain"},
            "served": {"requests": 10, "repeats": 0}, "live_first_third": {"alpha": None},
            "live_last_third": {"alpha": None},
            "llamacpp_plain": {"tokens_per_s": 50.0, "same_tokens_as_plain": "3/8"},
            "speed_vs_llamacpp_ci": {"adapted": {"ratio": 1.48, "low": 1.45, "high": 1.51, "prompts": 8}}}


def _printed(report: dict) -> str:
    out = io.StringIO()
    print_report({"adapters": [], "recovery": [], "requests": 10, "active_adapter": 1, "seconds": 1.0,
                  "key_prefix": "x:"} | report, Console(file=out, width=600))
    return out.getvalue()


def test_the_peer_line_names_which_file_each_side_decodes():
    """Q8_0 served, llama.cpp's peer on the packaged Q4_1: not "the same file"; the ×llama.cpp column
    says the peer decodes the packaged file and the caption names both files. Served packaged: the same file."""
    q8 = {"format": "Q8_0", "file": "qwen-Q8_0.gguf", "setting": "auto"}
    text = _printed({"phases": [_phase("prose")], "served_format": q8, "llamacpp_peer_file": "qwen-q4_1.gguf"})
    assert "same file" not in text, text
    assert "llama.cpp decodes the packaged file qwen-q4_1.gguf, our plain decoding the served Q8_0 (qwen-Q8_0.gguf)" in text
    assert "compare the format choice and the engine together" in text
    assert "pick ×llama.cpp plain of the packaged file [95 % CI]" in text
    assert "×llama.cpp plain: llama.cpp decodes the packaged file qwen-q4_1.gguf" in text  # the table's caption
    packaged = {"format": "packaged", "file": "qwen-q4_1.gguf", "setting": "packaged"}
    text = _printed({"phases": [_phase("prose")], "served_format": packaged, "llamacpp_peer_file": "qwen-q4_1.gguf"})
    assert "both are plain decoding of the same file, qwen-q4_1.gguf" in text
    assert "of the packaged file [95 % CI]" not in text and "pick ×llama.cpp plain [95 % CI]" in text
    # a report without the files (an older report.json) claims no sameness
    text = _printed({"phases": [_phase("prose")]})
    assert "same file" not in text and "our plain decoding the served format (which may differ" in text


def test_each_ceiling_lists_the_gammas_measured_and_the_plain_step_it_divides_by():
    """The 8690a9e run: steps measured at 1, 2, 4, 5 rows (γ 1, 3, 4; no 3-row step, so no γ=2), the
    stopped trainer's plain step 9.51 ms, beside the trainer 14.38 ms. Beside the trainer: 5 x 14.38 /
    63.77 = 1.13x at γ=4; stopped: 4 x 9.51 / 34.90 = 1.09x at γ=3. Neither says "γ=1-4"; the line
    beside the trainer names its 14.38 ms plain step and that the trainer slowed it (against 9.51)."""
    stopped_ms = {1: 9.51, 2: 27.55, 4: 34.90, 5: 43.98}
    beside_ms = {1: 14.38, 2: 40.90, 4: 52.01, 5: 63.77}

    def ceil(ms):
        by = {r - 1: round(r * ms[1] / ms[r], 3) for r in ms if r > 1}
        g = max(by, key=by.get)
        return {"by_gamma": by, "gamma": g, "speedup": by[g]}

    assert ceil(beside_ms)["gamma"] == 4 and ceil(stopped_ms)["gamma"] == 3
    rem = {"engine_ceiling": ceil(stopped_ms), "step_cost_ms": stopped_ms,
           "beside_trainer": {"engine_ceiling": ceil(beside_ms), "step_cost_ms": beside_ms}}
    text = _printed({"phases": [_phase("prose")], "remeasured": rem})
    assert "γ=1-4" not in text and "γ=1-3" not in text
    assert ("engine ceiling with the trainer stopped (re-measured before the evaluation): even if every proposal were "
            "accepted at no cost, speculation could run at most 1.09x plain (γ=3, the best of γ=1, 3, 4 measured: "
            "steps measured at 1, 2, 4, 5 rows, no other γ priced); a verification of 2 rows cost 2.90 plain steps; "
            "against a plain step of 9.51 ms\n") in text
    text = " ".join(text.split())  # the line beside the trainer is over 600 columns: wrapped
    assert ("engine ceiling while serving, beside the trainer: even if every proposal were accepted at no cost, "
            "speculation could run at most 1.13x plain (γ=4, the best of γ=1, 3, 4 measured: steps measured at 1, 2, "
            "4, 5 rows, no other γ priced); a verification of 2 rows cost 2.84 plain steps; above the 1.09x with the "
            "trainer stopped: each ceiling divides by its own moment's plain step, and 5 rows cost 4.43 plain steps "
            "here against 4.62 with the trainer stopped, medians of other requests' steps; against a plain step of 14.38 ms measured beside the trainer, which slowed it "
            "(9.51 ms with the trainer stopped)") in text


def test_an_alarm_after_the_phases_is_named_where_it_fired_not_as_a_phase_shifts():
    """The 8690a9e run's one alarm (math, n-gram, 0.71 -> 0.47) came during the re-measurement with the
    trainer stopped, on requests not in the timeline: the note says so and gives no phase-shift story.
    Here alarm 0 is on the timeline's 2nd request of math's phase (t 3.0 - 1.0 s), alarm 1 the
    re-measurement's (remeasured["alarms"] = [1, 2]), alarm 2 after it (outside any phase)."""
    from daemon.demo import _shift_alarms_note

    alarm = {"key": ["math", "greedy"], "proposer": "ngram", "reference_alpha": 0.71, "recent_alpha": 0.47}
    rem = {"alarms": [0, 1], "requests": 32}
    only = {"shift_alarms": [alarm], "remeasured": rem, "shifts": [{"t": 0.0, "request": 0, "workload": "math"}],
            "timeline": [{"t": 1.0}, {"t": 2.0}]}
    text = _shift_alarms_note(only)
    assert "math n-gram 0.71 -> 0.47, during the re-measurement (32 requests, trainer stopped). Why: the one after" in text, text
    assert "expected after a shift" not in text
    assert "Why: the one after the phases is not at a shift (the re-measurement serves each workload again" in text
    three = {"shift_alarms": [alarm, alarm, alarm], "remeasured": {"alarms": [1, 2], "requests": 32},
             "shifts": [{"t": 1.0, "request": 0, "workload": "math", "requests": 2}],
             "timeline": [{"t": 1.0}, {"t": 3.0, "shift_alarm": True}]}
    text = _shift_alarms_note(three)
    assert "0.47 at request 2 of 2, 2 s into its phase; " in text, text
    assert "0.47, during the re-measurement (32 requests, trainer stopped); " in text
    assert "0.47, outside any phase. " in text
    assert "Why: expected after a shift (prompts the proposer had not seen); the ones after the phases are not at a shift" in text


def test_the_acceptance_plot_keeps_the_drafts_probes_whose_gamma_ended_at_0():
    """The 8690a9e timeline's 53 draft requests were probes: proposer "draft", γ 0 at the end (they
    moved on to plain after their first steps), α measured. The plot's per-proposer series keep them;
    a plain request (nothing proposed, no α) is in none."""
    from daemon.demo import _alpha_by_proposer, _speculated

    timeline = [{"t": 1.0, "proposer": "ngram", "gamma": 4, "alpha": 0.7, "proposed": 40},
                {"t": 2.0, "proposer": "draft", "gamma": 0, "alpha": 0.96, "proposed": 6},  # a probe
                {"t": 3.0, "proposer": "draft", "gamma": 0, "alpha": None, "proposed": 0},  # plain
                {"t": 4.0, "proposer": "draft", "gamma": 0, "alpha": 0.43}]  # an older row: no count, α measured
    assert _alpha_by_proposer(timeline) == {"ngram": [(1.0, 0.7)], "draft": [(2.0, 0.96), (4.0, 0.43)]}
    assert [_speculated(r) for r in timeline] == [True, True, False, True]


def test_one_request_is_said_in_the_singular_and_one_requests_alpha_to_two_decimals():
    """"prose: 1 requests" and "rolling α, τ (1 of the last 12 speculated) 1.000, 1.03" in the 8690a9e
    run: one request, and one request's α (1.0, τ 1.03) is no rolling mean to 3 places."""
    from daemon.demo import _progress_line, _progress_table

    class Fake:
        def status(self):
            return {}

        def decision(self, key):
            return {"why": "test"}

    plain = {"workload": "prose", "alpha": None, "tau": 1.0, "tokens_per_s": 10.0, "adapter_version": 2}
    one = [dict(plain), {"workload": "prose", "alpha": 1.0, "tau": 1.03, "tokens_per_s": 12.0, "adapter_version": 2}]
    assert _progress_line(one, "prose", 2, 5.0) == ("prose: 2 requests in 5 s; last 2: α 1.00, τ 1.03 (one request's: "
                                                    "the only one that speculated), 11.0 tokens/s; serving v2")
    assert _progress_line(one[1:], "prose", 1, 5.0).startswith("prose: first request served")  # test_demo_trips3
    out = io.StringIO()
    Console(file=out, width=200).print(_progress_table(one, "prose", Fake(), Fake(), Fake(), ("prose", "greedy")))
    text = out.getvalue()
    assert "one request's α, τ (1 of the last 2 speculated)" in text and "1.00, 1.03" in text, text
    assert "1.000" not in text and "rolling α" not in text
    two = one + [{"workload": "prose", "alpha": 0.5, "tau": 2.07, "tokens_per_s": 8.0, "adapter_version": 2}]
    assert _progress_line(two, "prose", 2, 6.0).startswith("prose: 2 requests in 6 s; last 3: α 0.750, τ 1.55 (2 speculated)")


def test_the_final_json_line_names_the_shared_and_each_workloads_adapter():
    """The 8690a9e line held `"active_adapter": 1` (the shared bootstrap) beside per-workload v2, v8,
    v12, v17: the line now says which is which, and keeps active_adapter for earlier consumers."""
    from pathlib import Path

    from daemon.demo import _summary

    report = {"run_id": "r", "key_prefix": "x:", "seconds": 1.0, "requests": 608, "active_adapter": 1, "plot": "p.png",
              "workload_adapters": {"prose": 2, "code": 8, "math": 12, "extract": 17, "idle": 0},
              "phases": [{"workload": "prose", "alpha_gain": 0.432, "alpha_gain_ci": {"low": 0.36, "high": 0.533}}]}
    s = _summary(report, Path("out/demo"))
    assert s["shared_adapter"] == 1 and s["active_adapter"] == 1
    assert s["workload_adapters"] == {"prose": 2, "code": 8, "math": 12, "extract": 17}  # none promoted: left out
    assert s["report"] == "out/demo/report.json" and s["alpha_gain_ci"] == {"prose": [0.36, 0.533]}
    assert s["phase_end_gain"] == {"prose": [None, None, None]} and s["promotions_that_lowered_decoded_alpha"] == []


def test_a_pick_s_price_is_printed_beside_what_it_ran():
    # the walkthrough at c96690d: math's n-gram γ=4 priced 0.164 / 0.100 tok/ms, ran 0.980x [0.924, 1.045]
    from daemon.demo import _price_and_result, _priced
    decision = {"tokens_per_ms": {0: 0.1, 1: 0.09, 4: 0.05}, "tokens_per_ms_by_proposer": {"ngram": {4: 0.164}}}
    assert _priced(decision, "ngram", 4) == pytest.approx(1.64)
    assert _priced(decision, "draft", 4) == pytest.approx(0.5)
    assert _priced(decision, None, 0) is None and _priced({"tokens_per_ms": {}}, "ngram", 4) is None
    row = {"controller_pick": {"priced_vs_plain": 1.64}, "eval_prompts": 8,
           "speed_vs_plain_ci": {"adapted": {"ratio": 0.98, "low": 0.924, "high": 1.045}}}
    assert _price_and_result(row) == (
        "; priced at 1.64x plain decoding per decoding step (on the phase's traffic, its prefill apart: both sides "
        "pay the same prefill, which brings a ratio toward 1), it ran 0.98x [0.92, 1.04] on the 8 never-served "
        "prompts, prefill included")
    assert _price_and_result({"controller_pick": {"priced_vs_plain": None}}) == ""


def test_a_pick_s_price_is_also_given_per_request_with_plain_decodings_prefill():
    # plain spent 1000 ms on the prompts, 200 of them prefilling (f = 0.2); steps at 1.64x plain:
    # a request takes 0.2 + 0.8 / 1.64 = 0.6878 of plain's time, 1.454x
    from daemon.demo import _price_and_result, _price_with_prefill
    pick = {"priced_vs_plain": 1.64}
    _price_with_prefill(pick, 200.0, 1000.0)
    assert pick["plain_prefill_share"] == 0.2
    assert pick["priced_with_prefill"] == pytest.approx(1 / (0.2 + 0.8 / 1.64), abs=1e-3) and pick["priced_with_prefill"] == 1.454
    row = {"controller_pick": pick, "eval_prompts": 8,
           "speed_vs_plain_ci": {"adapted": {"ratio": 1.22, "low": 1.155, "high": 1.284}}}
    assert _price_and_result(row) == (
        "; priced at 1.64x plain decoding per decoding step on the phase's traffic, i.e. 1.45x a request with the "
        "prefill plain decoding spent on these prompts (20% of its time); it ran 1.22x [1.16, 1.28] on the 8 "
        "never-served prompts, prefill included (a gap between the two: what the phase's traffic, its n-gram "
        "history warm, taught the controller that these prompts did not bear out)")
    for bad in ((200.0, 0.0), (-1.0, 1000.0), (1200.0, 1000.0)):  # no time, or a prefill outside it: nothing added
        p = {"priced_vs_plain": 1.64}
        _price_with_prefill(p, *bad)
        assert p == {"priced_vs_plain": 1.64}
    p = {"priced_vs_plain": None}
    _price_with_prefill(p, 200.0, 1000.0)
    assert p == {"priced_vs_plain": None}


def test_turns_after_a_phase_are_told_apart_from_those_in_it():
    # the walkthroughs at d482237 and c96690d: 6/3/2/3 judged at the phase ends, 7/5/4/4 in trainer.workload_turns
    from daemon.demo import _turns_later
    report = {"shifts": [{"workload": "code", "turns": {"turns": 4, "judged": 3, "promoted": 1},
                          "turns_by_run_end": {"turns": 6, "judged": 5, "promoted": 1}},
                         {"workload": "math", "turns": {"turns": 2, "judged": 2, "promoted": 1},
                          "turns_by_run_end": {"turns": 2, "judged": 2, "promoted": 1}}]}
    assert _turns_later(report, "code") == (
        "its adapter had 4 turns (3 judged, 1 promoted) when its phase ended and 6 (5 judged, 1 promoted) by the "
        "run's end: the trainer goes on with a workload's buffered records while later phases serve "
        "(trainer.workload_turns counts them all)")
    assert _turns_later(report, "math") == "" and _turns_later(report, "prose") == "" and _turns_later({}, "code") == ""


def test_an_alarm_late_in_a_phase_is_not_called_a_shift_s():
    # the walkthrough at c96690d: code's alarm fired 92 s into its 120 s phase, under "expected at a phase shift"
    from daemon.demo import _shift_alarms_note

    alarm = {"key": ["code", "greedy"], "proposer": "ngram", "reference_alpha": 0.6, "recent_alpha": 0.3}
    late = {"shift_alarms": [alarm], "remeasured": {"alarms": [1, 1], "requests": 64},
            "shifts": [{"t": 10.0, "request": 0, "workload": "code", "requests": 3}],
            "timeline": [{"t": 11.0}, {"t": 50.0}, {"t": 102.0, "shift_alarm": True}]}
    text = _shift_alarms_note(late)
    assert "at request 3 of 3, 92 s into its phase" in text, text
    assert "Why: the one 92 s into its phase is not at a shift (a run of harder prompts). " in text
    early = dict(late, timeline=[{"t": 11.0}, {"t": 20.0, "shift_alarm": True}, {"t": 30.0}])
    assert "not at a shift" not in _shift_alarms_note(early)


def test_an_alarm_whose_last_requests_had_recovered_says_so():
    # the walkthrough at bb6e662 listed code's n-gram "α 0.38 -> 0.40" under "drops below its running mean"
    from daemon.demo import _shift_alarms_note

    up = {"key": ["code", "greedy"], "proposer": "ngram", "reference_alpha": 0.38, "recent_alpha": 0.40}
    down = dict(up, reference_alpha=0.6, recent_alpha=0.3)
    text = _shift_alarms_note({"shift_alarms": [up, down], "shifts": [], "timeline": []})
    assert "(a proposer's windowed α fell below its running mean; mean -> its last requests')" in text
    assert "code n-gram 0.38 -> 0.40 (its last requests back at or above the mean); " in text, text
    assert "code n-gram 0.60 -> 0.30" in text and "0.30 (its last" not in text  # a drop still under way: no such remark
