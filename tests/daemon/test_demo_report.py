"""The demo's printed report says when served traffic repeated prompts (the n-gram proposer then
copies a repeat's earlier output, so live α is not a never-served measurement)."""

import io

from rich.console import Console

from daemon.demo import print_report


def _phase(workload: str, requests: int, repeats: int) -> dict:
    row = {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0}
    return {"workload": workload, "heldout_samples": 0, "adapter_at_phase_end": 0, "final_adapter": 0,
            "plain": row, "frozen": row, "adapted_draft": row, "adapted": row,
            "controller_pick": {"why": "off: plain"}, "served": {"requests": requests, "repeats": repeats},
            "live_first_third": {"alpha": None}, "live_last_third": {"alpha": None}}


def test_repeated_prompts_are_reported_per_phase():
    report = {"phases": [_phase("prose", 142, 73), _phase("math", 125, 0)], "adapters": [], "recovery": [],
              "requests": 267, "active_adapter": 0, "seconds": 1.0, "key_prefix": "draftd:demo:"}
    out = io.StringIO()
    print_report(report, Console(file=out, width=200))
    text = out.getvalue()
    assert "prose: 73 of 142 served requests repeated a prompt" in text and "(69 distinct prompts served)" in text
    assert "math: 0 of" not in text and "math:" in text  # no repeats: no line about them


def test_paired_intervals_of_the_evaluation():
    """The table's evidence, by hand: two prompts; v0 accepts 2 of 8 and 3 of 4 proposals, the
    adapted draft 6 of 8 and 2 of 4 (gain 8/12 - 5/12 = 0.25, interval over the prompts [-0.25,
    0.5]); plain decodes 10 tokens in 100 ms on each, the pick 10 in 50 ms and 10 in 100 ms."""
    from daemon.demo import _paired_intervals
    from decoder.metrics import AcceptanceCounts

    def c(acc, prop, emitted=10):
        return AcceptanceCounts(num_draft_tokens=prop, alpha_sum=float(acc), num_emitted_tokens=emitted)

    per = {"plain": [(c(0, 0), 100.0), (c(0, 0), 100.0)],
           "frozen": [(c(2, 8), 100.0), (c(3, 4), 100.0)],
           "adapted_draft": [(c(6, 8), 100.0), (c(2, 4), 100.0)],
           "adapted": [(c(0, 0), 50.0), (c(0, 0), 100.0)]}
    out = _paired_intervals(per, 0.95)
    g = out["alpha_gain_ci"]
    assert out["eval_prompts"] == 2 and g["clusters"] == 2
    assert abs(g["gain"] - 0.25) < 1e-9 and abs(g["low"] + 0.25) < 1e-9 and abs(g["high"] - 0.5) < 1e-9
    # the pick: 20 tokens in 150 ms against 20 in 200 ms: 4/3 of plain's rate
    sp = out["speed_vs_plain_ci"]["adapted"]
    assert sp["ratio"] == round(4 / 3, 4) and sp["prompts"] == 2
    assert sp["low"] == 1.0 and sp["high"] == 2.0  # resamples of only the second / only the first prompt


def test_plot_timeline_draws_each_proposer_and_the_plain_rate(tmp_path):
    import random

    from daemon.demo import plot_timeline

    rng = random.Random(0)
    timeline, t = [], 0.0
    for w in ("prose", "code"):
        for i in range(30):
            t += 1.0
            prop, g = [("draft", 3), ("ngram", 2), (None, 0)][i % 3]
            timeline.append({"t": t, "workload": w, "adapter_version": 1 if t > 20 else 0, "proposer": prop, "gamma": g,
                             "alpha": rng.random() if g else None, "tokens_per_s": 20 + rng.random() * 10})
    path = tmp_path / "a.png"
    plot_timeline(timeline, [{"t": 0.0, "workload": "prose"}, {"t": 30.5, "workload": "code"}], path)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_promotion_check_leaves_out_the_base_draft_that_served_before_v0():
    """Requests served by the base draft (version 0) while v0 (here version 1) was bootstrapping
    are no promotion after v0: the chain is v0 -> the final version, one pair, by hand: v0 accepts
    2 of 8 and 3 of 4 proposals, v5 6 of 8 and 2 of 4 (gain 0.25, interval [-0.25, 0.5])."""
    from types import SimpleNamespace

    from daemon.demo import DemoConfig, _versions_check
    from decoder.metrics import AcceptanceCounts

    def c(acc, prop):
        return AcceptanceCounts(num_draft_tokens=prop, alpha_sum=float(acc), num_emitted_tokens=10)

    decoder = SimpleNamespace(adapter_version=5, draft_engine=SimpleNamespace(set_lora=None, capabilities=SimpleNamespace(lora=True)), ngram_history=None)
    timeline = [{"workload": "prose", "adapter_version": v} for v in (0, 0, 1, 5)]
    per = {"frozen": [(c(2, 8), 1.0), (c(3, 4), 1.0)], "adapted_draft": [(c(6, 8), 1.0), (c(2, 4), 1.0)]}
    rows = _versions_check(DemoConfig.quick(), "prose", [], None, None, decoder, None, None, 1, timeline, per)
    assert [(r["parent"], r["version"]) for r in rows] == [(1, 5)]
    assert abs(rows[0]["gain"] - 0.25) < 1e-9 and abs(rows[0]["low"] + 0.25) < 1e-9 and rows[0]["lowered"] is False


def test_the_phase_end_learner_is_measured_against_v0_and_reported():
    """The version that served a phase's last request (v3 here) decoded on the phase's prompts:
    runs_out carries every decoded version's per-prompt counts, so the phase-end gain is paired
    against v0's; the printed report names it."""
    from types import SimpleNamespace

    from daemon.demo import DemoConfig, _versions_check
    from decoder.metrics import AcceptanceCounts

    def c(acc, prop):
        return AcceptanceCounts(num_draft_tokens=prop, alpha_sum=float(acc), num_emitted_tokens=10)

    decoder = SimpleNamespace(adapter_version=5, draft_engine=SimpleNamespace(set_lora=None, capabilities=SimpleNamespace(lora=True)), ngram_history=None)
    timeline = [{"workload": "prose", "adapter_version": v} for v in (1, 5)]
    per = {"frozen": [(c(2, 8), 1.0)], "adapted_draft": [(c(6, 8), 1.0)]}
    runs: dict = {}
    _versions_check(DemoConfig.quick(), "prose", [], None, None, decoder, None, None, 1, timeline, per, runs)
    assert set(runs) == {1, 5} and runs[5] == per["adapted_draft"]
    phase = _phase("prose", 10, 0)
    phase["phase_end_gain_ci"] = {"version": 3, "before": 0.2, "after": 0.3, "gain": 0.1, "low": 0.05, "high": 0.15}
    phase["final_adapter"] = 5
    out = io.StringIO()
    print_report({"phases": [phase], "adapters": [], "recovery": [], "requests": 10, "active_adapter": 5, "seconds": 1.0,
                  "key_prefix": "draftd:demo:"}, Console(file=out, width=250))
    assert "at its phase's end the learner (v3) had raised decoded α" in out.getvalue()
    # the table's adapted row is named when it is a later version (walkthrough at 5e6c1fe: code's
    # phase-end v10 beside the table's v13, promoted later), and said to be the same one otherwise
    text = " ".join(out.getvalue().split())
    assert "the table's adapted row is the final adapter serving the workload, v5, which became active after the phase ended" in text
    phase.update(final_adapter=3)
    out = io.StringIO()
    print_report({"phases": [phase], "adapters": [], "recovery": [], "requests": 10, "active_adapter": 3, "seconds": 1.0,
                  "key_prefix": "draftd:demo:"}, Console(file=out, width=250))
    assert "the table's adapted row is this same version, the final one serving the workload" in " ".join(out.getvalue().split())


def test_the_closing_count_of_requests_says_whether_the_re_measurement_is_in_it():
    # the walkthrough at bb6e662: "requests served: 431" against serving.requests_served 495 (64 re-measured)
    phase = _phase("prose", 10, 0)
    base = {"phases": [phase], "adapters": [], "recovery": [], "requests": 431, "active_adapter": 5, "seconds": 1.0,
            "key_prefix": "draftd:demo:"}
    out = io.StringIO()
    print_report(dict(base, remeasured={"requests": 64}), Console(file=out, width=250))
    assert ("Requests served: 431 in the phases and 64 in the re-measurement, 495 in all, in 1.0 s"
            in " ".join(out.getvalue().split()))
    out = io.StringIO()
    print_report(base, Console(file=out, width=250))
    assert "Requests served: 431, in 1.0 s (the plot: None)." in " ".join(out.getvalue().split())


def test_a_phase_that_ended_on_the_bootstrap_calls_it_the_bootstrap():
    """Issue 34's walkthrough: code ended its phase on v1, the bootstrapped v0, and the notes said
    "the learner (v1) had not measurably changed decoded α", as if v1 were learnt there. v0 at the
    phase's end is named the bootstrap, with no gain to report; a learnt version keeps its line."""
    from daemon.demo import _version_name

    code = _phase("code", 10, 0)
    code.update(v0_version=1, adapter_at_phase_end=1, final_adapter=1,
                heldout_alpha={"frozen": 0.16, "phase_end": 0.16, "final": 0.16})
    code["phase_end_gain_ci"] = {"version": 1, "is_v0": True, "before": 0.159, "after": 0.159, "gain": 0.0,
                                 "low": 0.0, "high": 0.0}
    math = _phase("math", 10, 0)
    math.update(v0_version=1, adapter_at_phase_end=9, final_adapter=10)
    math["phase_end_gain_ci"] = {"version": 9, "is_v0": False, "before": 0.23, "after": 0.24, "gain": 0.01,
                                 "low": -0.02, "high": 0.04}
    out = io.StringIO()
    print_report({"phases": [code, math], "adapters": [], "recovery": [], "requests": 20, "active_adapter": 10,
                  "seconds": 1.0, "key_prefix": "draftd:demo:"}, Console(file=out, width=300))
    text = out.getvalue()
    assert ("code: at its phase's end the learner was still the bootstrap (v1): no version of its own was promoted "
            "in its phase (decoded α 0.159)") in text, text
    assert "learner (v1)" not in text
    assert "math: at its phase's end the learner (v9) had not measurably changed decoded α" in text
    assert "0.160 (the bootstrap (v1))" in text  # the held-out table names it too
    # a report written before "is_v0" existed: told from the row's v0_version; no bootstrap: the base draft
    assert _version_name(1, {"v0_version": 1}) == "the bootstrap (v1)"
    assert _version_name(0, {"v0_version": 0}) == "the base draft (v0)"
    assert _version_name(3, {"v0_version": 1}) == "v3" and _version_name(1, {}) == "v1"


def test_off_a_terminal_the_live_table_is_printed_once_a_phase_with_a_line_at_most_once_a_minute(monkeypatch):
    """A demo whose output went to a file or a pipe printed nothing for the serving phases (rich's
    Live redraws only on a terminal); then the whole table once a minute wrote 10 tables (52 KB)
    into the 5e6c1fe walkthrough's log. Off a terminal each update's one-line summary is printed at
    most once a minute, and the table once, the last one, at the phase's end."""
    from rich.table import Table

    import daemon.demo as demo

    clock = iter([0.0, 10.0, 59.0, 61.0, 62.0])
    monkeypatch.setattr(demo.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    console = Console(file=out, width=100)  # a StringIO: not a terminal
    with demo._live(console, every_s=60.0) as live:
        for i in range(5):
            t = Table(title=f"snapshot {i}")
            t.add_column("requests")
            t.add_row(str(i))
            live.update(t, f"line {i}")
        live.phase_end()
        live.phase_end()  # nothing new since: nothing printed
    text = out.getvalue()
    assert [i for i in range(5) if f"line {i}" in text] == [0, 3]
    assert [i for i in range(5) if f"snapshot {i}" in text] == [4] and text.count("snapshot") == 1


def test_the_one_line_progress_gives_the_phases_rolling_alpha_and_speed():
    """Of the last 12 requests, the phase's: two speculated (α 0.5 and 0.7, τ 2 and 3), one plain;
    tokens/s (9 + 11 + 10) / 3 = 10.0; the last served by v4. Another workload's rows are left out."""
    from daemon.demo import _progress_line

    tl = [{"workload": "code", "alpha": 0.1, "tau": 1.1, "tokens_per_s": 50.0, "adapter_version": 9},
          {"workload": "prose", "alpha": 0.5, "tau": 2.0, "tokens_per_s": 9.0, "adapter_version": 2},
          {"workload": "prose", "alpha": 0.7, "tau": 3.0, "tokens_per_s": 11.0, "adapter_version": 4},
          {"workload": "prose", "alpha": None, "tau": 1.0, "tokens_per_s": 10.0, "adapter_version": 4}]
    assert _progress_line(tl, "prose", 3, 42.4) == ("prose: 3 requests in 42 s; last 3: α 0.600, τ 2.50 (2 speculated), "
                                                   "10.0 tokens/s; serving v4")
    assert _progress_line(tl[:1] + tl[3:] * 2, "prose", 2, 5.0) == ("prose: 2 requests in 5 s; last 2: plain decoding, "
                                                                   "10.0 tokens/s; serving v4")
    # version 0 is the base draft, no adapter (a walkthrough read "serving v0" while the v0 bootstrap, which
    # registers as v1, was still running)
    base = [dict(tl[3], adapter_version=0)] * 2
    assert _progress_line(base, "prose", 2, 5.0) == ("prose: 2 requests in 5 s; last 2: plain decoding, 10.0 tokens/s; "
                                                     "no adapter yet (the draft waits for v0)")


def test_copy_channel_ablation_intervals_and_table():
    """The copy channel's rows, by hand on one prompt: v0 accepts 2 of 8, the adapted LoRA alone 3
    of 8, with its gate 6 of 8, v0 with the fixed gate 4 of 8: gains 0.5 (LoRA + gate), 0.125 (LoRA
    alone), 0.375 (what the gate adds) and 0.25 (fixed gate); the report prints them in its table."""
    import io

    from rich.console import Console

    from daemon.demo import FIXED_COPY_GATE, _paired_intervals, print_report
    from decoder.metrics import AcceptanceCounts
    from store.copy_channel import copy_features, copy_lambda

    def c(acc, prop):
        return AcceptanceCounts(num_draft_tokens=prop, alpha_sum=float(acc), num_emitted_tokens=10)

    per = {"plain": [(c(0, 0), 100.0)], "frozen": [(c(2, 8), 100.0)], "adapted_draft": [(c(6, 8), 100.0)],
           "adapted_nogate": [(c(3, 8), 100.0)], "frozen_fixedgate": [(c(4, 8), 100.0)]}
    out = _paired_intervals(per, 0.95)
    assert [out[k]["gain"] for k in ("alpha_gain_ci", "nogate_alpha_gain_ci", "gate_alpha_gain_ci",
                                     "fixedgate_alpha_gain_ci")] == [0.5, 0.125, 0.375, 0.25]
    # the fixed gate: λ = 0 below a 3-token match, 1 from it on
    lam = copy_lambda(FIXED_COPY_GATE, copy_features([1, 2, 3, 8], [0.0] * 4, [1.0] * 4), [1, 2, 3, 8])
    assert (lam[:2] < 1e-20).all() and (lam[2:] == 1.0).all()  # z = -150, -50, +50, +550
    row = {"workload": "extract", "heldout_samples": 0, "adapter_at_phase_end": 3, "final_adapter": 3, "eval_prompts": 1,
           "plain": {"tokens_per_s": 10.0, "alpha": None},
           **{k: {"alpha": v, "speedup_vs_plain": 1.0, "tokens_per_s": 10.0}
              for k, v in (("frozen", 0.25), ("adapted_draft", 0.75), ("adapted_nogate", 0.375), ("frozen_fixedgate", 0.5))},
           "adapted": {"proposer": "draft", "gamma": 3, "alpha": 0.75, "tau": 2.0, "speedup_vs_plain": 1.0},
           "live_first_third": {"alpha": None}, "live_last_third": {"alpha": None},
           "controller_pick": {"why": "test"}, "copy_gate": {"v0": None, "final": [1.0, 2, 3, 4, 5, 6]}, **out}
    report = {"phases": [row], "config": {"confidence": 0.95, "eval_gamma": 3}, "adapters": [], "requests": 1,
              "active_adapter": 3, "seconds": 1.0, "key_prefix": "x:"}
    buf = io.StringIO()
    print_report(report, Console(file=buf, width=250))
    text = buf.getvalue()
    assert "the copy channel on the same prompts" in text and "0.375" in text and "+1.00 +2.00 +3.00 +4.00 +5.00 +6.00" in text


def test_a_long_reason_is_cut_at_a_clause_or_word_never_mid_word():
    """The live panel cut trainer reasons at 160 characters mid-word ('... 0.310: g')."""
    from daemon.demo import _brief

    reason = "on prose: gain +0.0312 [+0.0130, +0.0524] (acceptance as served); " + "word " * 40
    assert _brief(reason, 80) == "on prose: gain +0.0312 [+0.0130, +0.0524] (acceptance as served) …"
    assert _brief("x" * 10 + " " + "y" * 100, 50) == "x" * 10 + " …"
    assert _brief("short", 80) == "short" and _brief(None) == ""


def test_the_report_counts_greedy_outputs_equal_to_plain_and_names_those_that_are_not():
    """Each speculative evaluation run carries ``matches_plain`` ("k/n" prompts token-identical to
    the plain run); the footer sums them, leaves out a pick that is the plain run itself, and names
    a run and its prompts that differed."""
    from daemon.demo import _lossless_summary

    ok = _phase("prose", 10, 0)
    ok["frozen"] = {**ok["frozen"], "matches_plain": "8/8"}
    ok["adapted_draft"] = {**ok["adapted_draft"], "matches_plain": "8/8"}
    ok["adapted"] = {**ok["plain"], "same_run_as": "plain"}
    bad = _phase("code", 10, 0)
    bad["frozen"] = {**bad["frozen"], "matches_plain": "8/8"}
    bad["adapted_draft"] = {**bad["adapted_draft"], "matches_plain": "6/8", "differs_from_plain": [2, 5]}
    assert _lossless_summary({"phases": [ok]}) == "greedy outputs equal to plain decoding: 16 of 16 speculative evaluation runs"
    line = _lossless_summary({"phases": [ok, bad]})
    assert line.startswith("greedy outputs equal to plain decoding: 30 of 32 ")
    assert "NOT LOSSLESS: code adapted_draft (prompts [2, 5])" in line
    assert _lossless_summary({"phases": [_phase("math", 3, 0)]}) is None  # no evaluation runs recorded
    # the peer's agreement with plain decoding is reported beside, never counted as a loss
    peer = {**ok, "llamacpp_plain": {"tokens_per_s": 50.0, "same_tokens_as_plain": "3/8"}}
    line = _lossless_summary({"phases": [peer, {**ok, "llamacpp_plain": {"same_tokens_as_plain": "2/8"}}]})
    assert line.startswith("greedy outputs equal to plain decoding: 32 of 32 speculative evaluation runs (")
    assert "NOT LOSSLESS" not in line and "gave the same tokens on 5 of 16 prompts" in line
    report = {"phases": [ok, bad], "adapters": [], "recovery": [], "requests": 20, "active_adapter": 0, "seconds": 1.0,
              "key_prefix": "draftd:demo:"}
    out = io.StringIO()
    print_report(report, Console(file=out, width=250))
    assert "30 of 32 speculative evaluation runs" in out.getvalue()


def test_the_pick_against_llamacpp_plain_paired_per_prompt():
    """By hand: llama.cpp plain decodes 10 tokens in 100 ms on both prompts; our plain run 10 in
    100 and 10 in 125 ms; the pick 10 in 50 and 10 in 100 ms: pooled 20/150 over 20/200 = 1.333x
    (plain: 20/225 over 20/200 = 0.889x); the interval's ends are the two prompts' own ratios,
    the only bootstrap resamples of two units: 1.0x and 2.0x for the pick."""
    from daemon.demo import _speed_vs_peer
    from decoder.metrics import AcceptanceCounts

    def c(emitted=10):
        return AcceptanceCounts(num_emitted_tokens=emitted)

    per = {"plain": [(c(), 100.0), (c(), 125.0)], "adapted": [(c(), 50.0), (c(), 100.0)]}
    out = _speed_vs_peer(per, [(10, 100.0, True), (10, 100.0, True)], 0.95)
    assert out["adapted"]["ratio"] == round((20 / 150) / (20 / 200), 4)
    assert out["plain"]["ratio"] == round((20 / 225) / (20 / 200), 4)
    assert out["adapted"]["low"] == 1.0 and out["adapted"]["high"] == 2.0 and out["adapted"]["prompts"] == 2
    # a plain pick: the pick is the plain run itself
    assert _speed_vs_peer({"plain": per["plain"]}, [(10, 100.0, True)] * 2, 0.95)["adapted"] == out["plain"]


def test_leviathan_prediction_by_hand():
    """α = 0.5, c = 0.25 (1 ms of drafting per proposal against 4 ms a plain step), verification
    of n rows costing 1 + 0.5 (n - 1) plain steps. E(0.5, γ) = 2 - 0.5^γ: γ = 1: 1.5, 2: 1.75,
    3: 1.875. One-step verification: 1.5/1.25 = 1.2, 1.75/1.5 = 1.1667, 1.875/1.75 = 1.0714: best
    γ = 1 at 1.2x. This engine: 1.5/(0.25 + 1.5) = 0.857, 1.75/(0.5 + 2) = 0.7, ...: best γ = 1 at 0.857x."""
    from daemon.demo import leviathan_prediction
    from decoder.metrics import AcceptanceCounts

    draft = AcceptanceCounts(num_draft_tokens=10, alpha_sum=5.0, num_accepted_tokens=5, num_drafts=10, draft_ms=10.0)
    plain = AcceptanceCounts(num_steps=5, decode_ms=20.0)
    p = leviathan_prediction(draft, plain, lambda n: 4.0 * (1 + 0.5 * (n - 1)), gamma_max=3)
    assert p["alpha"] == 0.5 and p["c"] == 0.25
    assert p["verify_cost_rows"] == {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}
    assert p["one_step"] == {"gamma": 1, "speedup": 1.2}
    assert p["this_engine"] == {"gamma": 1, "speedup": round(1.5 / 1.75, 3)}
    assert leviathan_prediction(AcceptanceCounts(), plain, lambda n: 4.0) is None  # nothing proposed
    # unmeasured step costs (NaN): the engine's prediction is left out, the one-step one stays
    q = leviathan_prediction(draft, plain, lambda n: float("nan"), gamma_max=3)
    assert q["this_engine"] is None and q["one_step"]["gamma"] == 1


def test_the_live_table_takes_alpha_and_tau_from_the_requests_that_speculated_only():
    """Plain requests (α None, τ 1.0) no longer pull the rolling τ to 1 beside a probe's α: two
    speculating requests (α 0.5 and 0.7, τ 2 and 3) among three plain ones give α 0.600, τ 2.50;
    none speculating says so."""
    import io

    from rich.console import Console

    from daemon.demo import _progress_table

    class Fake:
        def status(self):
            return {}

        def decision(self, key):
            return {"why": "test"}

    plain = {"workload": "prose", "alpha": None, "tau": 1.0, "tokens_per_s": 10.0}
    tl = [dict(plain), {"workload": "prose", "alpha": 0.5, "tau": 2.0, "tokens_per_s": 9.0}, dict(plain),
          {"workload": "prose", "alpha": 0.7, "tau": 3.0, "tokens_per_s": 11.0}, dict(plain)]

    def render(timeline):
        out = io.StringIO()
        Console(file=out, width=200).print(_progress_table(timeline, "prose", Fake(), Fake(), Fake(), ("prose", "greedy")))
        return out.getvalue()

    text = render(tl)
    assert "rolling α, τ (2 of the last 5 speculated)" in text and "0.600, 2.50" in text, text
    assert "- (plain decoding)" in render([dict(plain)] * 3)


def test_each_engine_ceiling_names_the_gammas_it_was_measured_at():
    """The walkthrough read "0.97x (γ=1)" at the evaluation under "1.14x (γ=4)" beside the trainer
    as the trainer's stop making speculation slower: the re-measured costs had only 1 and 2 rows.
    Each line now says over which γ its ceiling was measured."""
    out = io.StringIO()
    beside = {"engine_ceiling": {"by_gamma": {1: 0.9, 2: 1.0, 3: 1.1, 4: 1.14}, "gamma": 4, "speedup": 1.14},
              "step_cost_ms": {1: 20.0, 2: 36.0}}
    print_report({"phases": [_phase("prose", 10, 0)], "adapters": [], "recovery": [], "requests": 10, "active_adapter": 5,
                  "seconds": 1.0, "key_prefix": "draftd:demo:",
                  "engine_ceiling": {"by_gamma": {1: 0.97}, "gamma": 1, "speedup": 0.97}, "step_cost_ms": {1: 20.0, 2: 41.2},
                  "remeasured": {"beside_trainer": beside}}, Console(file=out, width=600))
    text = out.getvalue()
    assert "at most 0.97x plain (γ=1, the only γ measured then); a verification of 2 rows cost 2.06 plain steps" in text
    assert ("at most 1.14x plain (γ=4, the best of γ=1, 2, 3, 4 measured: steps measured at 1, 2, 3, 4, 5 rows, "
            "no other γ priced); a verification of 2 rows cost 1.80 plain steps") in text


def test_the_stopped_trainers_engine_ceiling_is_the_one_the_picks_were_priced_on():
    """Two walkthroughs read the ceiling "with the trainer stopped" below the one beside the trainer:
    it was priced from the run's last step costs, after the evaluation's own steps, not from the costs
    re-measured before the evaluation that its picks were priced on. The re-measured one is printed."""
    out = io.StringIO()
    beside = {"engine_ceiling": {"by_gamma": {1: 1.1, 2: 1.3}, "gamma": 2, "speedup": 1.3},
              "step_cost_ms": {1: 8.0, 2: 13.4}}
    rem = {"beside_trainer": beside, "engine_ceiling": {"by_gamma": {1: 1.05, 2: 1.25}, "gamma": 2, "speedup": 1.25},
           "step_cost_ms": {1: 6.8, 2: 12.3}}
    print_report({"phases": [_phase("prose", 10, 0)], "adapters": [], "recovery": [], "requests": 10, "active_adapter": 5,
                  "seconds": 1.0, "key_prefix": "draftd:demo:",
                  "engine_ceiling": {"by_gamma": {1: 0.9}, "gamma": 1, "speedup": 0.9}, "step_cost_ms": {1: 8.4, 2: 15.6},
                  "remeasured": rem}, Console(file=out, width=600))
    text = out.getvalue()
    assert ("engine ceiling with the trainer stopped (re-measured before the evaluation): even if every proposal were "
            "accepted at no cost, speculation could run at most 1.25x plain (γ=2, the best of γ=1, 2 measured: steps "
            "measured at 1, 2, 3 rows, no other γ priced); a verification of 2 rows cost 1.81 plain steps") in text
    assert ("at most 1.30x plain (γ=2, the best of γ=1, 2 measured: steps measured at 1, 2, 3 rows, no other γ priced); "
            "a verification of 2 rows cost 1.68 plain steps; against a plain step of 8.00 ms measured beside the trainer, "
            "which slowed it (6.80 ms with the trainer stopped)") in text
    assert "0.90x" not in text  # the run's last costs stay in report.json only


def test_the_closing_line_names_what_serves_each_workload_not_the_shared_version_alone():
    """The walkthrough at 5e6c1fe read "active adapter: v1" beside per-workload v2, v13, v15, v18:
    v1, the shared scope's bootstrap, served none of the four phases' workloads. The closing line
    names each workload's own version, in phase order, and says what the shared one serves."""
    phases = [_phase(w, 10, 0) for w in ("prose", "code", "math", "extract")]
    base = {"phases": phases, "adapters": [], "recovery": [], "requests": 40, "active_adapter": 1, "seconds": 1.0,
            "key_prefix": "draftd:demo:"}
    out = io.StringIO()
    print_report(base | {"workload_adapters": {"code": 13, "extract": 18, "math": 15, "prose": 2},
                         "config": {"per_workload": True}}, Console(file=out, width=400))
    text = out.getvalue()
    assert ("Serving at the end, each workload its own adapter: prose v2, code v13, math v15, extract v18; the shared "
            "v1 serves any other workload.") in text, text
    assert "active adapter: v1" not in text
    out = io.StringIO()  # code never promoted its own: the shared version serves it, said so
    print_report(base | {"workload_adapters": {"prose": 2, "code": 0}, "config": {"per_workload": True}},
                 Console(file=out, width=400))
    assert ("Serving at the end: prose v2 (its own); code, math, extract the shared v1 (no adapter of their own "
            "promoted).") in " ".join(out.getvalue().split())
    out = io.StringIO()  # one shared adapter (--shared-adapter): it serves every workload
    print_report(base | {"active_adapter": 7, "config": {"per_workload": False}}, Console(file=out, width=400))
    assert "Serving at the end: v7, the shared adapter, for every workload." in out.getvalue()


def test_the_acceptance_shift_alarms_are_explained_beside_their_count():
    """The 5e6c1fe walkthrough's 2 ``acceptance_shift`` warnings were pointed at with no word on
    whether they mattered. The note says what the alarm is, names each (workload, proposer, α before
    and after, where in its phase: requests 3 and 2 of phases starting at requests 0 and 4, at
    t 5.7 - 0 and 9.0 - 7.0 s), and that after a phase shift it is expected."""
    from daemon.demo import _shift_alarms_note

    assert _shift_alarms_note({"shift_alarms": []}) is None
    timeline = [{"t": t, "shift_alarm": t in (5.7, 9.0)} for t in (1.0, 2.0, 5.7, 6.0, 7.5, 9.0, 10.0)]
    report = {"shift_alarms": [
        {"key": ("math", "greedy"), "proposer": "ngram", "reference_alpha": 0.712, "recent_alpha": 0.514},
        {"key": ["extract", "greedy"], "proposer": "draft", "reference_alpha": 0.79, "recent_alpha": 0.557}],  # from JSON
        "shifts": [{"t": 0.0, "request": 0, "workload": "math", "requests": 4},
                   {"t": 7.0, "request": 4, "workload": "extract", "requests": 3}], "timeline": timeline}
    text = _shift_alarms_note(report)
    assert text == ("2 acceptance_shift alarm(s) (a proposer's windowed α fell below its running mean; mean -> its last "
                    "requests'): math n-gram 0.71 -> 0.51 at request 3 of 4, 6 s into its phase; extract draft 0.79 -> "
                    "0.56 at request 2 of 3, 2 s into its phase. Why: expected after a shift (prompts the proposer had "
                    "not seen). No action needed while outputs equal plain decoding's (above); one far from a shift or "
                    "beside a rollback is worth a look: report.json's shift_alarms, α per proposer in acceptance.png"), text


def test_the_leviathan_tables_costs_are_one_measurement_named_in_its_caption():
    """The 5e6c1fe walkthrough's "t(n)/t(1), n = 2..5 (measured)" differed by phase on one engine
    (prose 1.61 1.87 2.48 2.65, math 1.94 2.34 2.49 2.65): each phase read StepCost as the
    evaluation's own steps had moved it. Every phase's prediction now carries the one snapshot it
    was priced on; the caption says which (re-measured with the trainer stopped) and the rows
    agree. A report whose predictions differ or lack it is said to be per phase."""
    costs = {1: 10.0, 2: 16.1, 3: 18.7, 4: 24.8}
    pred = {"alpha": 0.5, "c": 0.3, "tau": 2.0, "verify_cost_rows": {1: 1.0, 2: 1.61, 3: 1.87, 4: 2.48, 5: 2.65},
            "one_step": {"gamma": 2, "speedup": 1.1}, "this_engine": {"gamma": 1, "speedup": 0.7}, "step_cost_ms": costs}
    phases = []
    for w in ("prose", "math"):
        ph = _phase(w, 10, 0)
        ph["adapted_draft"] = dict(ph["adapted_draft"], prediction=dict(pred))
        phases.append(ph)
    base = {"phases": phases, "adapters": [], "recovery": [], "requests": 20, "active_adapter": 1, "seconds": 1.0,
            "key_prefix": "draftd:demo:"}
    out = io.StringIO()
    print_report(base | {"remeasured": {"requests": 16, "step_cost_ms": costs}}, Console(file=out, width=400))
    text = " ".join(out.getvalue().split())
    assert ("costs t(n)/t(1) plain steps, one measurement for every phase: the step costs as the evaluation began "
            "(re-measured on 16 requests with the trainer stopped, the costs the controller's picks were priced on; "
            "measured at 1, 2, 3, 4 rows, other n read off them; t(n) as the least-squares fit that never falls with "
            "more rows)") in text, text  # the monotone fit's wording (tests/daemon/test_demo_isotonic.py)
    assert text.count("1.61 1.87 2.48 2.65") == 2
    phases[1]["adapted_draft"]["prediction"]["step_cost_ms"] = {1: 10.0, 2: 19.4}
    out = io.StringIO()
    print_report(base, Console(file=out, width=400))
    assert "measured when each phase was evaluated (the evaluation's own steps move them, so phases differ)" in \
        " ".join(out.getvalue().split())
