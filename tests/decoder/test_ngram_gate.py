"""The n-gram proposer's per-step length (decoder/proposers/: StepCost, NgramGate): the step
cost's median and line by hand, the gate's acceptance estimates and choices on hand-computed
goodputs, forgetting, exploration, the proposer feeding it each verification, the shadow, bad
arguments refused, and the decoder with it: greedy still equals plain, a gate that learnt that
matches fail stops proposing them, plain requests teach it, seeded sampling runs without one."""

from __future__ import annotations

import math

import pytest
import torch

from decoder.proposers.cost import StepCost
from decoder.proposers.ngram import NgramGate, NgramHistory, NgramProposer, NgramShadow, match_class
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from tiny import reference_greedy

GREEDY = SamplingParams()


class FixedCost(StepCost):
    """ms(n) = base + per_row * (n - 1), whatever was measured (steps on a tiny torch model cost
    about the same at any n, so a test of the choice fixes what rows cost)."""

    def __init__(self, base: float, per_row: float):
        super().__init__()
        self.base, self.per_row = base, per_row

    def add(self, rows, ms, batch=1, total=None):
        pass

    def ms(self, rows):
        return self.base + self.per_row * (rows - 1)


def test_step_cost_is_the_median_per_row_count_and_read_off_it_elsewhere():
    c = StepCost(window=3)
    assert math.isnan(c.ms(1))
    c.add(1, 8.0)
    assert c.ms(1) == 8.0 and c.ms(5) == 8.0  # one point: flat
    c.add(1, 60.0)  # a stalled step
    c.add(1, 10.0)
    assert c.ms(1) == 10.0  # median of 8, 60, 10
    c.add(1, 12.0)  # window 3: 60, 10, 12
    assert c.ms(1) == 12.0
    c.add(3, 22.0)
    # between (1, 12) and (3, 22) on their line; beyond the one multi-row count, its own cost (an
    # untried longer verification looks as cheap as the longest tried, until it is measured)
    assert c.ms(2) == pytest.approx(17.0) and c.ms(6) == pytest.approx(22.0)
    c.add(2, float("nan"))  # ignored
    assert c.status() == {1: 12.0, 3: 22.0}
    c.add(5, 26.0)
    # beyond two multi-row counts: their line, (3, 22) and (5, 26), slope 2 a row; the plain step
    # is left out (llama.cpp's one-row kernel is not its multi-row one); between them interpolated
    assert c.ms(8) == pytest.approx(32.0) and c.ms(4) == pytest.approx(24.0)
    # the walkthrough's trap, hand-worked: 1 and 2 rows measured (11.76, 24.10 ms) priced 5 rows
    # at 61.1 ms on a line through both (5.2 plain steps; measured 32); now at 24.10 until tried
    e = StepCost()
    e.add(1, 11.76)
    e.add(2, 24.10)
    assert e.ms(5) == pytest.approx(24.10) and e.ms(9) == pytest.approx(24.10)
    # a verification that measured cheaper than a plain step counts as one, and the line is flat
    d = StepCost()
    d.add(1, 10.0)
    d.add(2, 6.0)
    assert d.ms(2) == 10.0 and d.ms(4) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="window"):
        StepCost(window=0)


def test_step_cost_pairs_each_multi_row_step_with_the_plain_steps_of_its_time():
    """Hand values: plain steps cost 10 ms on an idle core and 20 ms while a training round shares
    it; the 2-row steps (36 ms) all ran during the round. Paired with the plain steps of their time
    they cost 1.8 plain steps, so t(2) = 1.8 x the plain median now (10 ms) = 18 ms and γ = 1's
    ceiling is 2 x 10 / 18 = 1.111x; unpaired medians gave 36 ms and 0.556x. A 3-row step with no
    plain step in the last 30 s is read against the plain median when read: 30 / 10 = 3."""
    now = [0.0]
    c = StepCost(ref_steps=3, clock=lambda: now[0])
    for _ in range(5):  # idle
        c.add(1, 10.0)
        now[0] += 1
    now[0] = 100.0  # a training round
    for _ in range(3):
        c.add(1, 20.0)
        c.add(2, 36.0)
        now[0] += 1
    now[0] = 200.0  # idle again
    for _ in range(30):
        c.add(1, 10.0)
        now[0] += 1
    assert c.ms(1) == 10.0
    assert c.ms(2) == pytest.approx(18.0)
    assert c.ceiling(1) == {"by_gamma": {1: 1.111}, "gamma": 1, "speedup": 1.111}
    now[0] = 1000.0
    c.add(3, 30.0)  # the newest plain step is 771 s old: no reference of its time
    assert c.ms(3) == pytest.approx(30.0)
    for bad in ({"ref_steps": 0}, {"ref_steps": 1.5}, {"ref_max_age_s": -1}, {"ref_max_age_s": float("nan")}):
        with pytest.raises(ValueError, match="StepCost: ref_"):
            StepCost(**bad)


def test_step_cost_pairs_only_with_recent_plain_steps():
    """Nine plain steps of 20 ms (a busy core) up to t = 8 s; at t = 29 s five 2-row steps of 12 ms
    (the core idle again): no plain step in the 5 s before them, so they are not paired with the
    busy ones (that read 0.6 plain steps, below what any verification costs) but read against
    t(1) now; then plain steps of 10 ms: t(2) = 12 ms, 1.2 plain steps."""
    now = [0.0]
    c = StepCost(clock=lambda: now[0])
    for k in range(9):
        now[0] = float(k)
        c.add(1, 20.0)
    now[0] = 29.0
    for _ in range(5):
        c.add(2, 12.0)
    for k in range(30):
        now[0] = 30.0 + k
        c.add(1, 10.0)
    assert c.ms(1) == 10.0 and c.ms(2) == pytest.approx(12.0)
    assert c.ceiling(1)["speedup"] == pytest.approx(2 / 1.2, abs=1e-3)


def test_the_engine_ceiling_is_gamma_plus_one_over_the_verification_cost():
    """Hand values: plain 10 ms, 2 rows 18 ms, 4 rows 24 ms, 10 rows 70 ms: at α = 1 and no
    proposing cost γ=1 gives 2 * 10 / 18 = 1.111x, γ=3 4 * 10 / 24 = 1.667x (the best), γ=9 is past
    gamma_max 8 and left out."""
    c = StepCost()
    assert c.ceiling() is None
    c.add(2, 18.0)
    assert c.ceiling() is None  # no plain step measured
    for rows, ms in ((1, 10.0), (4, 24.0), (10, 70.0)):
        c.add(rows, ms)
    assert c.ceiling() == {"by_gamma": {1: 1.111, 3: 1.667}, "gamma": 3, "speedup": 1.667}
    assert c.ceiling(gamma_max=1) == {"by_gamma": {1: 1.111}, "gamma": 1, "speedup": 1.111}
    c.add(3, 1e-300)  # a broken clock: 3 rows never read as cheaper than a plain step, so at most γ + 1 = 3x
    assert c.ceiling()["by_gamma"] == {1: 1.111, 2: 3.0, 3: 1.667}
    for bad in (0, -1, 2.5, None, True):
        with pytest.raises(ValueError, match="gamma_max=.* must be an int >= 1"):
            c.ceiling(gamma_max=bad)


def test_match_class_buckets_the_match_length():
    assert match_class("own", 1) == ("own", 1)
    assert match_class("hist", 5) == ("hist", 4)
    assert match_class("hist", 8) == ("hist", 6)
    assert match_class("own", 16) == ("own", 9)
    assert match_class("own", 40) == ("own", 17)


def _observe(gate, cls, times, proposed, accepted):
    for _ in range(times):
        gate.observe("w", cls, proposed, accepted)


def test_gate_picks_the_length_with_the_best_hand_computed_goodput():
    cost = FixedCost(10.0, 5.0)  # 10, 15, 20, 25 ms for 1..4 rows
    gate = NgramGate(decay=1.0, explore_tries=0, explore_every=1000)
    fair = ("own", 4)
    _observe(gate, fair, 6, 1, 1)
    _observe(gate, fair, 2, 1, 0)
    # a_1 = (6 + 1) / (8 + 2) = 0.7; positions never tried take a_1
    assert gate.acceptance("w", fair) == pytest.approx([0.7, 0.7, 0.7, 0.7])
    # plain 1/10 = 0.1; g=1: 1.7/15 = 0.1133; g=2: 2.19/20 = 0.1095; g=3: 2.533/25 = 0.1013
    assert gate.length("w", fair, 3, cost) == 1
    poor = ("hist", 2)
    _observe(gate, poor, 1, 1, 1)
    _observe(gate, poor, 7, 1, 0)
    # a_1 = 2 / 10 = 0.2: g=1 gives 1.2/15 = 0.08 < 0.1, so a plain step
    assert gate.length("w", poor, 3, cost) == 0
    copy = ("hist", 17)
    _observe(gate, copy, 20, 4, 4)
    # j=1: 20 of 20, j=2: 20 of 20, j=3-4: 40 of 40; j >= 5 never tried: a_3-4
    a1, a34 = 21 / 22, 41 / 42
    assert gate.acceptance("w", copy) == pytest.approx([a1, a1, a34, a34])
    run, e, rates = 1.0, 1.0, {0: 1 / 10}
    for g, a in enumerate([a1, a1, a34, a34, a34, a34, a34, a34], start=1):
        run *= a
        e += run
        rates[g] = e / (10 + 5 * g)
    assert gate.length("w", copy, 8, cost) == max(rates, key=rates.get) == 7  # 8 buys 0.94 tokens for 5 ms
    # dearer rows: 10 + 12 (n - 1) ms
    dear = FixedCost(10.0, 12.0)
    rates2 = {0: 0.1, **{g: (rates[g] * (10 + 5 * g)) / (10 + 12 * g) for g in range(1, 9)}}
    assert gate.length("w", copy, 8, dear) == max(rates2, key=rates2.get)
    assert gate.length("w", copy, 0, cost) == 0


def test_gate_forgets_at_its_decay_and_explores_turned_down_kinds():
    gate = NgramGate(decay=0.5, explore_tries=0, explore_every=4)
    cls = ("own", 2)
    _observe(gate, cls, 10, 1, 0)
    _observe(gate, cls, 3, 1, 1)
    # tried: 10 failures sum to 2 (1 - 0.5^10) = 1.998, then three times x 0.5 + 1 -> 1.99976;
    # hits 0 -> 1 -> 1.5 -> 1.75; a_1 = 2.75 / 3.99976 (without forgetting it would be 4 / 15)
    tried = 2 * (1 - 0.5 ** 10)
    hits = 0.0
    for _ in range(3):
        tried, hits = tried * 0.5 + 1, hits * 0.5 + 1
    assert gate.acceptance("w", cls)[0] == pytest.approx((hits + 1) / (tried + 2))
    assert gate.acceptance("w", cls)[0] == pytest.approx(0.6875, abs=1e-4)
    # a kind the costs turn down proposes one token every 4th time it is turned down
    bad = ("hist", 1)
    _observe(gate, bad, 5, 1, 0)
    cost = FixedCost(10.0, 10.0)  # a row costs a whole step: a_1 = 1 / (1.94 + 2) never pays
    assert [gate.length("w", bad, 4, cost) for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    # a kind seen fewer than explore_tries times proposes one token whatever its estimate
    fresh = NgramGate(explore_tries=2)
    assert fresh.length("w", bad, 4, cost) == 1  # the prior 0.5 would not pay at 10 ms a row
    fresh.observe("w", bad, 1, 0)
    assert fresh.length("w", bad, 4, cost) == 1
    fresh.observe("w", bad, 1, 0)
    assert fresh.length("w", bad, 4, cost) == 0
    # nothing measured yet: one proposal measures what a proposal costs
    assert NgramGate().length("w", bad, 4, StepCost()) == 1


def test_gate_copy_is_independent_and_status_reads_its_estimates():
    gate = NgramGate(decay=1.0)
    gate.observe("w", ("own", 4), 2, 1)  # j=1 accepted, j=2 rejected
    c = gate.copy()
    c.observe("w", ("own", 4), 1, 1)
    assert gate.status() == {"w": {"own/4": {"proposals": 1, "acceptance": [round(2 / 3, 3), 0.333, 0.333, 0.333]}}}
    assert c.status()["w"]["own/4"]["proposals"] == 2
    gate.clear("w")
    assert gate.status() == {}
    with pytest.raises(ValueError, match="decay"):
        NgramGate(decay=0.0)


def test_proposer_cuts_to_the_gate_and_feeds_it_each_accepted_prefix():
    gate = NgramGate(decay=1.0, explore_tries=0)
    cost = FixedCost(10.0, 6.0)
    h = NgramHistory(max_n=3, min_n=1)
    p = NgramProposer(h, "w", vocab_size=10, gate=gate, cost=cost)
    ids = [5, 6, 7, 8, 9, 6, 7]
    p.start(ids, True)
    # (6, 7) ended at index 3 and ids[0] != ids[4]: a 2-token match of the request's own tokens;
    # no estimate yet: prior a = 0.5 everywhere: g=1 1.5/16, g=2 1.75/22, g=3 1.875/28, all below
    # plain 1/10 -> 0 (explore_tries=0; only every 16th turned-down match explores)
    assert p.propose(ids, 3, GREEDY, torch.Generator()).tokens == []
    assert p.last_class == ("own", 2)
    _observe(gate, ("own", 2), 8, 3, 3)  # this kind is always right: a = 9/10 at j = 1, 2, 3
    # at 6 ms a row: g=1 1.9/16 = 0.119, g=2 2.71/22 = 0.1232, g=3 3.439/28 = 0.1228
    assert p.propose(ids, 3, GREEDY, torch.Generator()).tokens == [8, 9]
    p.verified(1)
    cost.per_row = 5.0  # g=1 1.99/15, g=2 2.80/20 = 0.140, g=3 3.55/25 = 0.142 (a = 10/11, 9/11, 9/10 now)
    prop = p.propose(ids, 3, GREEDY, torch.Generator())
    assert prop.tokens == [8, 9, 6] and prop.q.shape == (3, 10)
    p.verified(3)
    p.verified(3)  # nothing pending: no second observation
    # j=1: 10 of 10 tried, j=2: 9 of 10, j=3-4: 9 of 9 (j >= 5 never tried: a_3-4)
    assert gate.acceptance("w", ("own", 2)) == pytest.approx([11 / 12, 10 / 12, 10 / 11, 10 / 11])
    with pytest.raises(ValueError, match="gate"):
        NgramProposer(h, "w", vocab_size=10, gate=gate)


def _garbage_history(dec, ids, workload="w", junk=3):
    """Every suffix of ``ids`` continues with ``junk`` in the workload's history."""
    dec.ngram_history.clear()
    for i in range(1, len(ids)):
        dec.ngram_history.add(workload, ids[max(0, i - 4):i] + [junk] * 4)


def test_decoder_with_a_gate_equals_plain_greedy_and_stops_proposing_what_fails(target, other_draft, tok):
    ids = tok("the cat sat on the mat. the cat", add_special_tokens=False)["input_ids"]
    ref = reference_greedy(target, ids, 24)
    junk = next(t for t in range(5, 50) if t not in ref)

    def run(gate: bool):
        dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(ngram_gate=gate))
        dec.step_cost = FixedCost(10.0, 10.0)  # a second row costs a whole step (a compute-bound engine)
        proposed, proposals = [], 0
        for _ in range(4):
            _garbage_history(dec, ids + ref, junk=junk)
            r = dec.generate(DecodeRequest(ids, GREEDY, 24, gamma=4, ignore_eos=True, workload="w", proposer="ngram"))
            assert r.output_ids == ref
            proposed.append(r.counts.num_draft_tokens)
            proposals += sum(1 for st in r.steps if st.proposed)
        return dec, proposed, proposals

    dec, gated, n_gated = run(True)
    _, ungated, _ = run(False)
    assert ungated[-1] >= 24  # every step had a (wrong) match of up to 4 tokens
    assert gated[-1] < ungated[-1] / 4  # learnt: a plain step now, but for the exploring ones
    # every proposal's outcome reached the gate, and so did the shadows of the steps without one
    assert sum(st["proposals"] for st in dec.ngram_gate.status()["w"].values()) > n_gated


def test_seeded_sampling_runs_without_a_gate_and_records_step_costs(target, other_draft, tok):
    dec = SpeculativeDecoder(target, other_draft, tok)
    ids = tok("hello world, hi", add_special_tokens=False)["input_ids"]
    seeded = DecodeRequest(ids, SamplingParams(1.0, seed=3), 4, gamma=2, workload="w", proposer="ngram")
    assert dec.make_proposer("ngram", seeded).gate is None
    greedy = DecodeRequest(ids, GREEDY, 4, gamma=2, workload="w", proposer="ngram")
    assert dec.make_proposer("ngram", greedy).gate is dec.ngram_gate
    alone = DecodeRequest(ids, GREEDY, 4, gamma=2, workload="w", proposer="ngram", ngram_history=False)
    g = dec.make_proposer("ngram", alone).gate
    assert g is not None and g is not dec.ngram_gate
    assert SpeculativeDecoder(target, other_draft, tok, DecoderConfig(ngram_gate=False)).make_proposer(
        "ngram", greedy).gate is None
    with pytest.raises(ValueError, match="ngram_gate='no'"):
        DecoderConfig(ngram_gate="no")
    dec.generate(DecodeRequest(ids, GREEDY, 6, gamma=0, ignore_eos=True))
    assert 1 in dec.step_cost.status() and dec.step_cost.ms(1) > 0


def test_shadow_reads_the_accepted_prefix_off_the_emitted_tokens():
    gate = NgramGate(decay=1.0)
    h = NgramHistory(max_n=3, min_n=1)
    h.add("w", [1, 2, 3, 4, 5])
    sh = NgramShadow(h, "w", gate, vocab_size=10, tokens=8)
    ids = [9, 1, 2]
    sh.start(ids)
    sh.idle_step(ids)  # (1, 2) matches the history, 2 tokens back: would propose 3, 4, 5
    sh.idle_step(ids)  # one shadow at a time
    cls = ("hist", 2)
    sh.settle(ids + [3])  # 3 emitted as matched: not settled yet
    assert gate.status() == {}
    sh.settle(ids + [3, 4, 7])  # 4 right, 7 where 5 was matched: accepted prefix 2 of 3
    # j=1: 1 of 1, j=2: 1 of 1, j=3: 0 of 1
    assert gate.acceptance("w", cls) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    # a request that ends before the shadow settles counts what it saw: 1 of 1 right
    ids2 = [8, 1, 2]
    sh.start(ids2)
    sh.idle_step(ids2)
    sh.settle(ids2 + [3], final=True)
    assert gate.status()["w"]["hist/2"]["proposals"] == 2
    assert gate.acceptance("w", cls) == pytest.approx([3 / 4, 2 / 3, 1 / 3, 1 / 3])
    # no match, no shadow
    sh.start([7, 7, 6])
    sh.idle_step([7, 7, 6])
    sh.settle([7, 7, 6, 1], final=True)
    assert gate.status() == {"w": {"hist/2": {"proposals": 2, "acceptance": [0.75, 0.667, 0.333, 0.333]}}}


def test_plain_requests_teach_the_gate_and_stay_plain(target, other_draft, tok):
    ids = tok("the cat sat on the mat. the cat", add_special_tokens=False)["input_ids"]
    ref = reference_greedy(target, ids, 16)
    dec = SpeculativeDecoder(target, other_draft, tok)
    dec.ngram_history.add("w", ids + ref)  # the same request served before: its continuation is a perfect copy
    r = dec.generate(DecodeRequest(ids, GREEDY, 16, gamma=0, ignore_eos=True, workload="w"))
    assert r.output_ids == ref and r.counts.num_draft_tokens == 0
    st = dec.ngram_gate.status()["w"]
    # the copy was read off the plain steps: shadows of up to 8 tokens, every one right
    copies = {k: v for k, v in st.items() if k.startswith("hist/")}
    assert copies and all(v["acceptance"][0] > 0.5 for v in copies.values())
    assert sum(v["proposals"] for v in st.values()) >= 2  # 16 tokens: at least two settled windows
    # without the served history (or seeded sampling), no shadow
    before = sum(v["proposals"] for v in st.values())
    dec.generate(DecodeRequest(ids, GREEDY, 16, gamma=0, ignore_eos=True, workload="w", ngram_history=False))
    dec.generate(DecodeRequest(ids, SamplingParams(1.0, seed=1), 16, gamma=0, ignore_eos=True, workload="w"))
    assert sum(v["proposals"] for v in dec.ngram_gate.status()["w"].values()) == before


def test_bad_arguments_are_refused_and_reads_leave_no_trace():
    for kw in ({"max_workloads": float("nan")}, {"explore_every": 2.5}, {"explore_tries": -1}, {"decay": float("nan")},
               {"decay": 1.5}, {"max_workloads": True}):
        with pytest.raises(ValueError, match="NgramGate"):
            NgramGate(**kw)
    with pytest.raises(ValueError, match="window=1.5"):
        StepCost(window=1.5)
    c = StepCost()
    for rows in (0, -4, 2.7):
        with pytest.raises(ValueError, match="rows="):
            c.add(rows, 10.0)
    gate = NgramGate(max_workloads=2)
    gate.observe("a", ("own", 4), 1, 1)
    gate.observe("b", ("own", 4), 1, 1)
    assert gate.acceptance("c", ("own", 4)) == [0.5] * 4  # the prior, and "a" is not evicted by the read
    assert set(gate.status()) == {"a", "b"}
    h = NgramHistory(max_n=3)
    h.add("w", [1, 2, 3, 4])
    assert h.lookup_match("w", [9, 1, 2], 0, 2) == ([], 0)
    assert h.lookup_match("w", [9, 1, 2], 4, 2) == ([3, 4], 2)
    with pytest.raises(ValueError, match="n=5"):
        h.lookup_match("w", [1, 2], 4, 5)
    with pytest.raises(ValueError, match="tokens=0"):
        NgramShadow(h, "w", gate, vocab_size=10, tokens=0)


def test_shadow_proposes_what_the_proposer_would_and_yields_to_a_real_proposal():
    gate = NgramGate(decay=1.0)
    h = NgramHistory(max_n=3, min_n=1)
    h.add("w", [1, 2, 3, 99, 5])  # 99: an id outside a 10-token vocabulary
    sh = NgramShadow(h, "w", gate, vocab_size=10)
    ids = [9, 1, 2]
    sh.start(ids)
    sh.idle_step(ids)  # would propose 3 only (the proposer cuts at 99)
    sh.settle(ids + [3], final=False)  # all of it right: settled at once
    # 1 of 1 at j=1 (not 1 of 3 with a rejection at 99): a_1 = 2/3, untried positions take it
    assert gate.acceptance("w", ("hist", 2)) == pytest.approx([2 / 3] * 4)
    h.add("w", [1, 2, 3, 4, 5, 6])
    sh.start(ids)
    sh.idle_step(ids)  # now 3, 4, 5, 6
    sh.settle(ids + [3])  # one right so far, not settled
    sh.proposing(ids + [3])  # a real proposal covers what follows: the shadow counts 1 of 1
    st = gate.status()["w"]["hist/2"]
    assert st["proposals"] == 2
    assert gate.acceptance("w", ("hist", 2)) == pytest.approx([3 / 4] * 4)  # j=1: 2 of 2, nothing else tried
