"""The demo prices step costs by verified rows on the least-squares fit that never falls with more
rows (pool adjacent violators), not a running max: the second walkthrough at f3f82c0 (/work/walk2.log)
read, beside the trainer, "4 rows measured 15.29 ms, below 3 rows' 22.91, 5 rows measured 17.41 ms,
below 3 rows' 22.91 ... priced at the fewer rows' cost": one high 3-row reading priced 3, 4 and 5
rows at 22.91 ms and the ceiling fell to about 2.07x. With the trainer stopped a high 4-row reading
(18.64 ms beside 5 rows' 18.37) priced 4 and 5 rows at 1.96 plain steps in the Leviathan table."""

import math

import pytest

import daemon.demo as demo
from decoder.metrics import AcceptanceCounts
from decoder.proposers.cost import read_off

# walk2's costs by rows (ms): beside the trainer (2 rows: its 1.27 plain steps of 9.51 ms), and with
# the trainer stopped (2 and 3 rows: the table's 1.20 and 1.39 plain steps of 9.50 ms)
BESIDE = {1: 9.51, 2: 12.08, 3: 22.91, 4: 15.29, 5: 17.41}
STOPPED = {1: 9.50, 2: 11.40, 3: 13.21, 4: 18.64, 5: 18.37}


def _ceil(cost: dict) -> dict:
    by = {r - 1: round(r * cost[1] / cost[r], 3) for r in cost if r > 1}
    g = max(by, key=by.get)
    return {"by_gamma": by, "gamma": g, "speedup": by[g]}


def test_a_falling_run_is_priced_at_its_mean_not_at_its_highest_reading():
    # 22.91 > 15.29 pools to 19.10, above 17.41: (22.91 + 15.29 + 17.41) / 3 = 55.61 / 3 = 18.5367
    fit, dips = demo._monotone_fit({str(k): v for k, v in BESIDE.items()})  # from JSON: keys as strings
    assert fit == pytest.approx({1: 9.51, 2: 12.08, 3: 55.61 / 3, 4: 55.61 / 3, 5: 55.61 / 3}, abs=1e-9)
    assert dips == [(4, 15.29, 3, 22.91), (5, 17.41, 3, 22.91)]
    assert dips.blocks == [((3, 4, 5), pytest.approx(55.61 / 3, abs=1e-9))]
    # rising costs: unchanged, no dip; its former name is the same function; a non-finite reading left out
    assert demo._running_max is demo._monotone_fit
    assert demo._monotone_fit({1: 1.0, 2: 2.0, 3: math.nan}) == ({1: 1.0, 2: 2.0}, [])


def test_the_ceiling_line_prices_the_dip_on_the_fit():
    # as priced, γ=4: 5 x 9.51 / 18.5367 = 2.565 (running max: 5 x 9.51 / 22.91 = 2.076); γ=3: 4 x 9.51
    # / 18.5367 = 2.052, γ=1: 2 x 9.51 / 12.08 = 1.575. As measured γ=3: 4 x 9.51 / 15.29 = 2.488, γ=4:
    # 5 x 9.51 / 17.41 = 2.731, the raw figure report.json keeps
    raw = _ceil(BESIDE)
    assert raw["speedup"] == 2.731
    priced, dips = demo._priced_ceiling(raw, BESIDE)
    assert priced["gamma"] == 4 and priced["speedup"] == 2.565 and priced["by_gamma"][3] == 2.052
    line = " ".join(demo._ceiling_line(raw, BESIDE, "while serving, beside the trainer").split())
    assert f"at most {2.565:.2f}x plain (γ=4," in line, line
    assert ("4 rows measured 15.29 ms, below 3 rows' 22.91, 5 rows measured 17.41 ms, below 3 rows' 22.91: noise "
            "between two readings (a verification of more rows cannot cost less), priced on the least-squares fit "
            "that never falls with more rows: 3, 4 and 5 rows at 18.54 ms, the mean of their readings") in line, line
    assert "fewer rows' cost" not in line
    # with the trainer stopped: (18.64 + 18.37) / 2 = 18.505 for 4 and 5 rows; γ=4 5 x 9.50 / 18.505 = 2.567
    # (running max: 5 x 9.50 / 18.64 = 2.548, the walkthrough's 2.55x)
    priced = demo._priced_ceiling(_ceil(STOPPED), STOPPED)[0]
    assert priced["gamma"] == 4 and priced["speedup"] == 2.567
    assert demo._dips_clause(demo._monotone_fit(STOPPED)[1]).endswith(": 4 and 5 rows at 18.51 ms, the mean of their readings")


def test_the_leviathan_prediction_reads_the_fit():
    # 4 and 5 rows at 18.505 ms: 18.505 / 9.50 = 1.948 plain steps each (running max: 18.64 / 9.50 = 1.962,
    # the walkthrough's "1.96 1.96"); 2 rows 11.40 / 9.50 = 1.2, 3 rows 13.21 / 9.50 = 1.391
    draft = AcceptanceCounts(num_draft_tokens=10, alpha_sum=5.0, num_accepted_tokens=5, num_drafts=10, draft_ms=10.0)
    plain = AcceptanceCounts(num_steps=5, decode_ms=20.0)
    p = demo.leviathan_prediction(draft, plain, lambda n: read_off(STOPPED, n), gamma_max=4)
    assert p["verify_cost_rows"] == {1: 1.0, 2: 1.2, 3: 1.391, 4: 1.948, 5: 1.948}


def test_the_leviathan_caption_names_the_fit():
    text = " ".join(demo._prediction_costs({}, [{"step_cost_ms": STOPPED}]).split())
    assert ("t(n) as the least-squares fit that never falls with more rows; 5 rows measured 18.37 ms, below 4 "
            "rows' 18.64: noise between two readings") in text, text
    assert "running max" not in text and "fewer rows' cost" not in text
    # the first engine ceiling line reads the same costs: the caption refers to it
    report = {"remeasured": {"requests": 64, "step_cost_ms": STOPPED, "engine_ceiling": _ceil(STOPPED)}}
    text = " ".join(demo._prediction_costs(report, [{"step_cost_ms": STOPPED}]).split())
    assert ("t(n) as the least-squares fit that never falls with more rows; 5 rows measured below 4 rows', pooled at "
            "the mean of their run: noise, as the first engine ceiling line below says)") in text, text


def test_two_pooled_runs_are_each_named_at_their_mean():
    # 2 rows 20 > 3 rows 14: (20 + 14) / 2 = 17; 5 rows 40 > 6 rows 30: (40 + 30) / 2 = 35; 4 rows 30 between
    fit, dips = demo._monotone_fit({1: 10.0, 2: 20.0, 3: 14.0, 4: 30.0, 5: 40.0, 6: 30.0})
    assert fit == {1: 10.0, 2: 17.0, 3: 17.0, 4: 30.0, 5: 35.0, 6: 35.0}
    assert dips == [(3, 14.0, 2, 20.0), (6, 30.0, 5, 40.0)] and dips.blocks == [((2, 3), 17.0), ((5, 6), 35.0)]
    assert demo._dips_clause(dips).endswith(
        "priced on the least-squares fit that never falls with more rows: 2 and 3 rows at 17.00 ms, 5 and 6 rows at "
        "35.00 ms, each run at the mean of its readings")
