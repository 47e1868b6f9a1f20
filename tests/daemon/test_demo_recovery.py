"""recovery_stats: requests and seconds from a shift until α is back to 90 % of its pre-shift level."""

from decoder.shift import recovery_stats


def row(t, alpha, w):
    return {"t": t, "alpha": alpha, "workload": w}


def test_recovery_counts_requests_and_seconds_from_the_shift():
    # prose: last 2 speculating α = 0.5, 0.7 -> pre-shift 0.6, target 0.54 (window 2)
    tl = [row(0, 0.1, "prose"), row(1, 0.5, "prose"), row(2, None, "prose"), row(3, 0.7, "prose")]
    # code from request 4 at t = 10: windows (0.1, 0.2)=0.15, (0.2, 0.6)=0.4, plain, (0.6, 0.5)=0.55 >= 0.54
    tl += [row(10, 0.1, "code"), row(11, 0.2, "code"), row(12, 0.6, "code"), row(13, None, "code"), row(15, 0.5, "code")]
    shifts = [{"t": 0, "request": 0, "workload": "prose"}, {"t": 10, "request": 4, "workload": "code"}]
    (r,) = recovery_stats(tl, shifts, window=2)
    assert r["from"] == "prose" and r["workload"] == "code"
    assert r["pre_shift_alpha"] == 0.6
    assert r["requests"] == 5 and r["seconds"] == 5 and r["recovered_alpha"] == 0.55


def test_no_recovery_within_the_phase_and_no_pre_shift_level():
    tl = [row(0, None, "prose"), row(1, None, "prose"), row(2, 0.1, "code"), row(3, 0.1, "code"),
          row(4, 0.9, "math"), row(5, 0.9, "math"), row(6, 0.2, "x"), row(7, 0.3, "x")]
    shifts = [{"t": 0, "request": 0, "workload": "prose"}, {"t": 2, "request": 2, "workload": "code"},
              {"t": 4, "request": 4, "workload": "math"}, {"t": 6, "request": 6, "workload": "x"}]
    code, math, x = recovery_stats(tl, shifts, window=2)
    assert code["pre_shift_alpha"] is None and code["requests"] is None  # prose never speculated
    assert math["pre_shift_alpha"] == 0.1 and math["requests"] == 2  # 0.9 >= 0.09 at once
    assert x["pre_shift_alpha"] == 0.9 and x["requests"] is None  # 0.25 < 0.81 until the end
