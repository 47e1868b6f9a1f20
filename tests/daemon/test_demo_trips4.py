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
    2.120x; as priced, 5 rows at 4 rows' 37.44: 5 x 15.72 / 37.44 = 2.099x, still the best γ (γ=3:
    4 x 15.72 / 37.44 = 1.679)."""
    by = {r - 1: round(r * STOPPED[1] / STOPPED[r], 3) for r in STOPPED if r > 1}
    assert by[4] == 2.12 and max(by, key=by.get) == 4
    raw = {"by_gamma": by, "gamma": 4, "speedup": by[4]}
    rem = {"requests": 64, "step_cost_ms": STOPPED, "engine_ceiling": raw}
    text = _text({"phases": [_phase("prose")], "remeasured": rem})
    assert "speculation could run at most 2.10x plain (γ=4, the best of γ=1, 2, 3, 4 measured" in text, text
    assert ("5 rows measured 37.08 ms, below 4 rows' 37.44: noise between two readings (a verification of more rows "
            "cannot cost less), priced at the fewer rows' cost (2.12x on the costs as measured, the dip included: "
            "report.json's remeasured.engine_ceiling.speedup); against a plain step of 15.72 ms") in text, text
    # beside the trainer: its own key
    line = demo._ceiling_line(raw, STOPPED, "while serving, beside the trainer", STOPPED,
                              key="remeasured.beside_trainer.engine_ceiling")
    assert "(2.12x on the costs as measured, the dip included: report.json's remeasured.beside_trainer" in line
    # costs that rise with rows: one figure, nothing more to tell apart
    rising = {1: 10.0, 2: 20.0, 3: 24.0}
    ceil = {"by_gamma": {1: 1.0, 2: 1.25}, "gamma": 2, "speedup": 1.25}
    assert "on the costs as measured" not in demo._ceiling_line(ceil, rising, "with the trainer stopped")
