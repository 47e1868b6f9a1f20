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
