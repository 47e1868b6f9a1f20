"""Issue 35: the step time target (Sarathi-Serve's stall-free batching) on a fake engine whose
forward of r rows takes exactly A + B * r ms on a fake clock, so every piece size is worked by hand."""

import pytest

from decoder.batching import StepCostFit, StepScheduler
from decoder.loop import LoopConfig
from test_batching import _drive, _FakeEngine, _Seq

A, B = 2.0, 1.0  # ms of a fire, and ms per row fed


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _timed_engine(clock: _Clock):
    """A fake engine that advances ``clock`` by A + B * rows (ms) per forward_batch and logs the
    tokens each item fed."""
    eng = _FakeEngine()
    fed: list[list[int]] = []
    real = eng.forward_batch

    def forward_batch(items, hidden=False):
        n = sum(len(t) for _, t, _ in items)
        fed.append([len(t) for _, t, _ in items])
        clock.t += (A + B * n) / 1e3
        return real(items, hidden)

    eng.forward_batch = forward_batch
    return eng, fed


@pytest.fixture
def no_min_piece(monkeypatch):
    """Rooms of a few rows, worked by hand, below the minimum piece: the minimum set to 1."""
    import decoder.batching as batching

    monkeypatch.setattr(batching, "MIN_TIMED_PIECE", 1)


def _fitted(sched: StepScheduler) -> None:
    for r in (1, 2, 3, 5, 8, 1, 2, 4):  # fires on the line A + B r: the fit is exact
        sched.costs.add(r, A + B * r)


def _run(sched, eng, members):
    got = {}
    for sid, lengths in members:
        def body(sid=sid, lengths=lengths):
            s = _Seq(eng, sid)
            got[sid] = [s.forward([1] * n, 1).tolist() for n in lengths]
        sched.spawn(body, f"m{sid}")
    _drive(sched)
    return got


def test_the_cost_line_is_theil_sen_over_the_fires_and_a_few_stalls_do_not_move_it():
    f = StepCostFit(min_fires=3)
    assert f.line() is None
    for r, ms in ((1, 3.0), (3, 7.0), (5, 11.0)):  # ms = 1 + 2 r
        f.add(r, ms)
    a, b = f.line()
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    g = StepCostFit(min_fires=2)
    g.add(4, 9.0), g.add(4, 11.0)
    assert g.line() is None  # one row count: no slope
    h = StepCostFit()
    for i in range(60):
        r = 1 + i % 6
        h.add(r, 8.0 + 2.0 * r)
    h.add(2, 3000.0), h.add(3, 2500.0)  # two calls stalled by the host
    for _ in range(StepCostFit.REFIT_EVERY):
        h.add(4, 16.0)
    a, b = h.line()
    assert a == pytest.approx(8.0) and b == pytest.approx(2.0)  # least squares: a = 122, b = 0.22
    lone = StepCostFit()
    for ms in (5.0, 3.0, 4.0, 100.0):
        lone.add_lone(ms)
    assert lone.lone_ms() == pytest.approx(4.5)


def test_a_lone_requests_step_is_the_interval_between_its_target_forwards_and_draft_fires_stay_off_the_line():
    """A lone request at γ = 4 with a draft model: 4 one-row draft forwards (1.5 ms each) then a 5-row
    verification (2 + 5 ms) per step: its step interval is 13 ms, and the cost line holds only the
    target's forwards."""
    clock = _Clock()
    target, fed = _timed_engine(clock)
    draft = _FakeEngine()
    real = draft.forward_batch

    def draft_fb(items, hidden=False):
        clock.t += 1.5e-3
        return real(items, hidden)

    draft.forward_batch = draft_fb
    sched = StepScheduler(clock, step_token_budget=8, step_ms_target="auto")
    sched.primary = target

    def body():
        t, d = _Seq(target, 0), _Seq(draft, 0)
        for _ in range(4):
            for _ in range(4):
                d.forward([1], 1)
            t.forward([1] * 5, 5)

    sched.spawn(body, "lone")
    _drive(sched)
    assert sched.costs.lone_ms() == pytest.approx(13.0) and sched.step_target_ms() == pytest.approx(26.0)
    assert list(sched.costs._fires) == [(5, pytest.approx(7.0))] * 4


def test_under_the_target_a_long_forward_feeds_only_what_keeps_the_step_under_it(no_min_piece):
    """Target 6 ms, fit 2 + 1 r: 4 rows fit; the two one-row members take 2, so the 10-token forward
    (budget 8) goes 2 a step while they decode, then its rest whole once it is alone."""
    clock = _Clock()
    eng, fed = _timed_engine(clock)
    sched = StepScheduler(clock, step_token_budget=8, step_ms_target=6.0)
    _fitted(sched)
    got = _run(sched, eng, [(0, [10]), (1, [1, 1, 1]), (2, [1, 1, 1])])
    assert fed[:3] == [[2, 1, 1], [2, 1, 1], [2, 1, 1]]  # every shared step: 2 + 1 + 1 rows = 6 ms
    assert fed[3:] == [[4]]
    assert got[0] == [[[0, 9]]] and got[1] == [[[1, 0]], [[1, 1]], [[1, 2]]]
    st = sched.status()
    assert st["step_ms_target_now"] == 6.0 and st["time_cut_pieces"] == 3
    assert st["step_cost_line_ms"] == {"a": 2.0, "b_per_row": 1.0}


def test_two_long_forwards_share_the_room_first_come_first_fed(no_min_piece):
    """Room 3 rows beside one decoding member: the first long forward takes all 3, the second waits."""
    clock = _Clock()
    eng, fed = _timed_engine(clock)
    sched = StepScheduler(clock, step_token_budget=8, step_ms_target=6.0)
    _fitted(sched)
    got = _run(sched, eng, [(0, [6]), (1, [6]), (2, [1, 1, 1, 1])])
    assert fed[0] == [3, 1] and fed[1] == [3, 1]  # member 0's forward in two pieces of 3, member 1 waiting
    assert fed[2] == [3, 1] and fed[3] == [3, 1]  # then member 1's
    assert got[0] == [[[0, 5]]] and got[1] == [[[1, 5]]] and len(got[2]) == 4


def test_where_the_short_rows_alone_reach_the_target_the_prompt_still_feeds_the_minimum_piece():
    """Target 3.5 ms: the two one-row members alone take 4 ms; the 20-token forward (budget 16) still
    feeds MIN_TIMED_PIECE tokens a step, not the budget's 16."""
    from decoder.batching import MIN_TIMED_PIECE

    clock = _Clock()
    eng, fed = _timed_engine(clock)
    sched = StepScheduler(clock, step_token_budget=16, step_ms_target=3.5)
    _fitted(sched)
    _run(sched, eng, [(0, [20]), (1, [1, 1, 1]), (2, [1, 1, 1])])
    m = MIN_TIMED_PIECE
    assert m < 16 and fed[:3] == [[m, 1, 1], [m, 1, 1], [20 - 2 * m, 1, 1]] and sched.time_cut == 2


def test_auto_targets_twice_a_lone_steps_median_and_waits_for_one(no_min_piece):
    clock = _Clock()
    eng, fed = _timed_engine(clock)
    sched = StepScheduler(clock, step_token_budget=8, step_ms_target="auto")
    _fitted(sched)  # fires of two sequences: no lone step yet
    assert sched.step_target_ms() is None
    _run(sched, eng, [(0, [1, 1])])  # alone: two lone steps of 3 ms
    assert sched.step_target_ms() == pytest.approx(6.0)
    fed.clear()
    _run(sched, eng, [(0, [10]), (1, [1, 1, 1]), (2, [1, 1, 1])])
    assert fed[:3] == [[2, 1, 1]] * 3


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "fast", True])
def test_the_step_time_target_is_validated(bad):
    with pytest.raises(ValueError, match="step_ms_target"):
        StepScheduler(step_ms_target=bad)
    with pytest.raises(ValueError, match="step_ms_target"):
        LoopConfig(max_batch=4, step_ms_target=bad)
    assert LoopConfig(max_batch=4, step_ms_target="auto").step_ms_target == "auto"
    with pytest.raises(ValueError, match="only cuts the pieces the token budget makes"):
        LoopConfig(max_batch=4, step_ms_target=5.0, step_token_budget=None)


def test_serve_setting_itl_target_ms_is_validated():
    from daemon.settings import ServeSettings

    assert ServeSettings(itl_target_ms="auto").itl_target_ms == "auto"
    assert ServeSettings(itl_target_ms="12.5").itl_target_ms == 12.5
    assert ServeSettings().itl_target_ms is None
    assert ServeSettings(itl_target_ms="AUTO").itl_target_ms == "auto"
    assert ServeSettings(itl_target_ms="null").itl_target_ms is None
    for bad in (0, -3, "inf", "abc"):
        with pytest.raises(ValueError, match="itl_target_ms"):
            ServeSettings(itl_target_ms=bad)
    with pytest.raises(ValueError, match="'abc' is not a step time"):  # one message, not pydantic's union of two
        ServeSettings(itl_target_ms="abc")
    with pytest.raises(ValueError, match="only cuts the prompt pieces the token budget makes"):
        ServeSettings(itl_target_ms=5, step_token_budget=None)
