"""Continuous batching (issue 35 item 1): several sequences in one llama_decode, and the serving
loop's step scheduler. Every batched row is compared with the same row decoded alone, and every
request served in a batch with the same request served alone (greedy also with plain decoding)."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from decoder.batching import StepScheduler
from decoder.engines.base import Capabilities, EngineError, sequence_scope
from decoder.engines.llamacpp_lib import llamacpp_available

needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")


# ---- the step scheduler, on a fake engine (no model) -----------------------------------------
class _Seq:
    def __init__(self, engine, sid):
        self.engine, self.seq_id, self.length = engine, sid, 0

    def forward(self, tokens, keep, hidden=False):
        from decoder.engines.base import forward_router

        r = forward_router()
        if r is not None:
            return r.call(self.engine, self, tokens, keep, hidden)
        return self.engine.forward_batch([(self, tokens, keep)], hidden)[0]


class _FakeEngine:
    """Row r of a forward is [seq_id, position]; a token -1 fails its forward."""

    capabilities = Capabilities(False, False, True, False, True, max_sequences=8)

    def __init__(self):
        self.calls: list[list[int]] = []  # seq ids per forward_batch

    def forward_batch(self, items, hidden=False):
        self.calls.append([s.seq_id for s, _, _ in items])
        if any(-1 in toks for _, toks, _ in items):
            raise ValueError("token -1")
        out = []
        for s, toks, keep in items:
            pos = torch.arange(s.length, s.length + len(toks))[-keep:]
            out.append(torch.stack([torch.full_like(pos, s.seq_id), pos], 1))
            s.length += len(toks)
        return out


def _drive(sched: StepScheduler):
    while True:
        sched.wait_boundary()
        if sched.pending:
            sched.fire()
        elif not sched.members:
            return


def test_the_scheduler_fuses_every_waiting_forward_and_hands_each_member_its_rows():
    eng = _FakeEngine()
    sched = StepScheduler()
    got: dict[int, list] = {}
    order: list[int] = []
    fused: dict[int, list] = {}

    def member(sid, steps):
        from decoder.engines.base import last_fused_rows, last_fused_size

        s = _Seq(eng, sid)
        rows = []
        for k in range(steps):
            order.append(sid)
            rows.append(s.forward([1] * (k + 1), k + 1).tolist())
            fused.setdefault(sid, []).append((last_fused_size(), last_fused_rows()))
        got[sid] = rows

    for sid, steps in ((0, 3), (1, 3), (2, 2)):
        sched.spawn(lambda sid=sid, steps=steps: member(sid, steps), f"m{sid}")
    _drive(sched)
    # each member's k-th forward fed k + 1 tokens after its earlier ones: rows at their own positions
    for sid, steps in ((0, 3), (1, 3), (2, 2)):
        pos = 0
        for k in range(steps):
            assert got[sid][k] == [[sid, p] for p in range(pos, pos + k + 1)]
            pos += k + 1
    assert eng.calls == [[0, 1, 2], [0, 1, 2], [0, 1]]  # one fused forward per step
    # each member learns its forward's batch size and the rows fed in it by everyone: 3 x 1, 3 x 2, 2 x 3
    assert fused == {0: [(3, 3), (3, 6), (2, 6)], 1: [(3, 3), (3, 6), (2, 6)], 2: [(3, 3), (3, 6)]}
    assert sched.status()["by_sequences"] == {"2": 1, "3": 2}
    # members ran one at a time, in sequence order, each up to its next forward
    assert order == [0, 1, 2, 0, 1, 2, 0, 1]


def test_batch_goodput_judges_speculation_on_the_whole_batchs_tokens_per_ms():
    from decoder.batching import BatchGoodput

    now = [0.0]
    g = BatchGoodput(window=8, min_cycles=4, max_age_s=60.0, clock=lambda: now[0])
    assert g.pays(4)[0] is False and "measuring plain" in g.pays(4)[1]  # plain first: the safe side
    for _ in range(4):
        g.add(4, "plain", 4, 10.0)  # 0.4 tok/ms
    assert g.pays(4)[0] is None  # speculative cycles unmeasured: the model decides
    for _ in range(4):
        g.add(4, "spec", 6, 20.0)  # 0.3 tok/ms: more tokens a cycle, but slower cycles
    pays, why = g.pays(4)
    assert pays is False and why == "off in batches of 4: speculative steps 0.3000 tok/ms vs plain 0.4000"
    for _ in range(8):
        g.add(4, "spec", 10, 20.0)  # the window now holds only these: 0.5 tok/ms
    assert g.pays(4)[0] is True
    assert g.status()["4"] == {"plain": 0.4, "spec": 0.5, "cycles": {"plain": 4, "spec": 8}, "pays": True}
    fixed = BatchGoodput(window=8, min_cycles=4, clock=lambda: now[0])
    for _ in range(4):  # only speculative cycles: a batch mate keeps its own γ, plain cannot be measured
        fixed.add(2, "spec", 3, 10.0)
    assert fixed.pays(2) == (None, "plain steps in batches of 2 cannot be measured lately (a batch mate keeps its own γ)")
    fixed.add(2, "spec", 3, float("nan"))  # an unusable reading is dropped
    assert fixed.rate(2, "spec")[1] == 4
    now[0] = 61.0  # both stale: plain is measured again first
    assert g.pays(4)[0] is False
    g.add(4, "plain", 4, 10.0)  # a stale window starts over: one new cycle is not enough
    assert g.rate(4, "plain") == (None, 1)
    with pytest.raises(ValueError, match="min_cycles=9"):
        BatchGoodput(window=8, min_cycles=9)
    with pytest.raises(ValueError, match="max_age_s=0"):
        BatchGoodput(max_age_s=0)


def test_the_scheduler_counts_each_cycles_emitted_tokens_by_kind():
    # two members: 3 plain steps each (1 row, 1 token), then 3 verifications of 3 rows emitting 2
    # tokens each; the clock moves 10 ms a fire. A cycle runs from one fire to the next and counts
    # the tokens emitted from that first fire's results, as the kind of that fire
    from decoder.engines.base import note_emitted

    eng = _FakeEngine()
    now = [0.0]

    def clock():
        return now[0]

    sched = StepScheduler(clock=clock)
    sched.primary = eng
    real_fire = sched.fire

    def fire():
        now[0] += 0.010
        return real_fire()

    sched.fire = fire

    def member(sid):
        s = _Seq(eng, sid)
        for _ in range(3):
            s.forward([1], 1)
            note_emitted(1)
        for _ in range(3):
            s.forward([1, 1, 1], 3)
            note_emitted(2)

    for sid in (0, 1):
        sched.spawn(lambda sid=sid: member(sid), f"m{sid}")
    _drive(sched)
    st = sched.goodput.status()["2"]
    # fires: p p p s s s (6); cycles between consecutive fires: p->p, p->p, p->s (kind of its start: plain),
    # s->s, s->s: 3 plain cycles of 2 tokens, 2 spec cycles of 4 tokens, each 10 ms
    assert st["cycles"] == {"plain": 3, "spec": 2}
    assert [(t, pytest.approx(ms)) for t, ms in sched.goodput._cycles[(2, "plain")]] == [(2, 10.0)] * 3
    assert [(t, pytest.approx(ms)) for t, ms in sched.goodput._cycles[(2, "spec")]] == [(4, 10.0)] * 2


def test_a_cycle_is_classified_by_its_rows_and_engines_not_by_its_groups():
    # a feature-level proposer's target forwards ask for hidden states (their own group): one row
    # each beside a plain member is still a plain cycle; a forward on the draft's engine is not
    eng, draft = _FakeEngine(), _FakeEngine()
    sched = StepScheduler()
    sched.primary = eng

    def member(sid, hidden, engine, steps=20):
        s = _Seq(engine, sid)
        for _ in range(steps):
            s.forward([1], 1, hidden) if hidden else s.forward([1], 1)

    sched.spawn(lambda: member(0, True, eng), "eagle")
    sched.spawn(lambda: member(1, False, eng), "plain")
    _drive(sched)
    assert sched.goodput.status()["2"]["cycles"] == {"plain": 19, "spec": 0}
    sched2 = StepScheduler()
    sched2.primary = eng
    sched2.spawn(lambda: member(0, False, draft), "draft")
    sched2.spawn(lambda: member(1, False, eng), "plain")
    _drive(sched2)
    assert sched2.goodput.status()["2"]["cycles"] == {"plain": 0, "spec": 19}


def test_a_forward_cut_by_the_budget_reports_no_fused_rows():
    # its step spanned several fused forwards: no one forward's rows to key its cost by
    from decoder.engines.base import last_fused_rows

    eng = _FakeEngine()
    sched = StepScheduler(step_token_budget=2)
    got = {}

    def long(sid):
        s = _Seq(eng, sid)
        s.forward([1] * 5, 5)
        got[sid] = last_fused_rows()

    def short(sid):
        s = _Seq(eng, sid)
        for _ in range(4):
            s.forward([1], 1)
        got[sid] = last_fused_rows()

    sched.spawn(lambda: long(0), "long")
    sched.spawn(lambda: short(1), "short")
    _drive(sched)
    assert got[0] is None and got[1] is not None


def test_a_forward_that_fails_in_a_fused_call_fails_only_its_own_member():
    eng = _FakeEngine()
    sched = StepScheduler()
    res: dict[int, object] = {}

    def member(sid, tok):
        try:
            res[sid] = _Seq(eng, sid).forward([tok], 1).tolist()
        except ValueError as e:
            res[sid] = str(e)

    for sid, tok in ((0, 5), (1, -1), (2, 5)):
        sched.spawn(lambda sid=sid, tok=tok: member(sid, tok), f"m{sid}")
    _drive(sched)
    assert res == {0: [[0, 0]], 1: "token -1", 2: [[2, 0]]}


def test_a_step_token_budget_cuts_a_long_forward_only_while_a_short_one_shares_the_step():
    """Budget 4: member 0's 10-token forward (keep 6: its rows span the pieces) goes in pieces of 4
    while member 1 feeds one-row steps beside it, and whole when it is alone; member 0 still gets
    the rows of its whole forward, at their positions, and member 1 a row every step."""
    eng = _FakeEngine()
    sched = StepScheduler(step_token_budget=4)
    got: dict[int, list] = {}
    fed: list[list[int]] = []
    real_fb = eng.forward_batch

    def forward_batch(items, hidden=False):
        fed.append([len(t) for _, t, _ in items])
        return real_fb(items, hidden)

    eng.forward_batch = forward_batch

    def long_member():
        s = _Seq(eng, 0)
        got[0] = [s.forward([1] * 10, 6).tolist(), s.forward([1] * 10, 1).tolist()]

    def short_member():
        s = _Seq(eng, 1)
        got[1] = [s.forward([1], 1).tolist() for _ in range(3)]

    sched.spawn(long_member, "long")
    sched.spawn(short_member, "short")
    _drive(sched)
    assert got[0][0] == [[0, p] for p in range(4, 10)] and got[0][1] == [[0, 19]]
    assert got[1] == [[[1, 0]], [[1, 1]], [[1, 2]]]
    # three shared steps: 4 + 4 tokens of the long forward beside a row each, then its last 2 and the
    # short member's last row; then the long member's second forward alone, whole
    assert fed == [[4, 1], [4, 1], [2, 1], [10]]
    assert sched.status()["budget_cut_pieces"] == 2 and sched.status()["step_token_budget"] == 4


def test_without_a_short_forward_beside_them_long_forwards_go_whole():
    eng = _FakeEngine()
    fed: list[list[int]] = []
    real_fb = eng.forward_batch
    eng.forward_batch = lambda items, hidden=False: fed.append([len(t) for _, t, _ in items]) or real_fb(items, hidden)
    sched = StepScheduler(step_token_budget=4)
    got = {}

    def member(sid, n):
        got[sid] = _Seq(eng, sid).forward([1] * n, 1).tolist()

    for sid, n in ((0, 9), (1, 7)):
        sched.spawn(lambda sid=sid, n=n: member(sid, n), f"m{sid}")
    _drive(sched)
    assert fed == [[9, 7]] and got == {0: [[0, 8]], 1: [[1, 6]]} and sched.cut == 0


def test_a_budgeted_forward_returns_its_hidden_states_joined_and_a_fault_fails_its_member():
    class HiddenEngine(_FakeEngine):
        def forward_batch(self, items, hidden=False):
            rows = super().forward_batch(items, hidden)
            return [(r, r * 10) for r in rows] if hidden else rows

    eng = HiddenEngine()
    sched = StepScheduler(step_token_budget=3)
    got: dict[int, object] = {}

    def long_member():
        logits, hid = _Seq(eng, 0).forward([1] * 8, 8, hidden=True)
        got[0] = (logits.tolist(), hid.tolist())

    def short_member():
        s = _Seq(eng, 1)
        got[1] = [s.forward([1], 1, hidden=True)[0].tolist() for _ in range(2)]

    def faulty_member():
        try:
            _Seq(eng, 2).forward([1] * 5 + [-1], 1, hidden=True)
        except ValueError as e:
            got[2] = str(e)

    for sid, fn in enumerate((long_member, short_member, faulty_member)):
        sched.spawn(fn, f"m{sid}")
    _drive(sched)
    assert got[0] == ([[0, p] for p in range(8)], [[0, 10 * p] for p in range(8)])
    assert got[1] == [[[1, 0]], [[1, 1]]] and got[2] == "token -1"


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_the_step_token_budget_is_validated(bad):
    from decoder.loop import LoopConfig

    with pytest.raises(ValueError, match="step_token_budget"):
        StepScheduler(step_token_budget=bad)
    with pytest.raises(ValueError, match="step_token_budget"):
        LoopConfig(max_batch=4, step_token_budget=bad)
    assert LoopConfig(max_batch=4, step_token_budget=None).step_token_budget is None


def test_sequence_scope_releases_what_a_request_started():
    released = []

    class S:
        def release(self):
            released.append(self)

    from decoder.engines.base import track

    with sequence_scope():
        a, b = S(), S()
        track(a)
        track(b)
    assert released == [a, b]
    track(S())  # outside a scope: nothing kept
    assert len(released) == 2


def test_a_loop_on_an_engine_without_batch_stays_at_batch_one():
    from decoder.control import GoodputController
    from decoder.loop import LoopConfig, ServingLoop

    def generate(req, policy=None, on_step=None):
        raise AssertionError("not called")

    dec = types.SimpleNamespace(engine=types.SimpleNamespace(name="torch", capabilities=Capabilities(
        False, False, False, True, False)), draft_engine=None, adapter_version=0, generate=generate,
        generate_batched=generate)
    loop = ServingLoop(dec, controller=GoodputController(), config=LoopConfig(max_batch=4))
    assert loop.batching is None and "one sequence at a time" in loop.batch_why
    with pytest.raises(ValueError, match="max_batch"):
        LoopConfig(max_batch=0)


# ---- the llama.cpp engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf():
    from decoder.models.packaged import packaged_gguf

    return packaged_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def real(gguf):
    from decoder.models.loading import load_pair

    return load_pair("smollm2-135m", "layers:0-3")


def _ids(real, n: int) -> list[int]:
    from test_engines import _long_ids  # the first n tokens of the workloads' prose

    return _long_ids(real, n)


@needs_llamacpp
def test_sequences_are_slots_started_released_and_checked(gguf):
    from decoder.engines.llamacpp import LlamaCppEngine

    e = LlamaCppEngine(gguf, n_ctx=256, threads=2, n_seq=2)
    try:
        assert e.capabilities.batch and e.capabilities.max_sequences == 2
        a, b = e.start(), e.start()
        assert (a.seq_id, b.seq_id) == (0, 1) and e.free_sequences == 0
        with pytest.raises(EngineError, match="all 2 sequences"):
            e.start()
        with pytest.raises(ValueError, match="twice"):
            e.forward_batch([(a, [1], 1), (a, [2], 1)])
        fresh = e.forward_batch([(a, [1, 2, 3], 1)])[0]
        a.forward([4, 5], 2)
        a.release()
        with pytest.raises(EngineError, match="released"):
            a.forward([1], 1)
        c = e.start()  # the released slot, cleared
        assert c.seq_id == 0 and c.length == 0
        assert torch.equal(c.forward([1, 2, 3], 1), fresh)
        with pytest.raises(ValueError, match="flash_attn"):
            LlamaCppEngine(gguf, n_seq=2, flash_attn=False)
    finally:
        e.close()


@needs_llamacpp
@pytest.mark.slow
def test_a_batched_row_equals_the_same_row_decoded_alone_at_every_cache_length(gguf, real):
    """Losslessness under batching rests on this: four sequences at different cache lengths (past
    the 256- and 512-cell KV views), prefilled together, then verified together with different
    block sizes (plain rows beside γ + 1 blocks) and rolled back by different amounts; every
    sequence's logits are the same bits as the same rows decoded alone in a one-sequence engine."""
    from decoder.engines.llamacpp import LlamaCppEngine

    ids = _ids(real, 1500)
    be = LlamaCppEngine(gguf, n_ctx=1024, threads=2, n_seq=4)
    alone = [LlamaCppEngine(gguf, n_ctx=1024, threads=2) for _ in range(4)]  # each sequence decoded alone
    try:
        starts, cached = [0, 300, 600, 900], [100, 300, 37, 250]
        seqs = [be.start() for _ in range(4)]
        refs = [a.start() for a in alone]
        be.forward_batch([(seqs[i], ids[starts[i]: starts[i] + cached[i]], 1) for i in range(4)])
        for i, r in enumerate(refs):
            r.forward(ids[starts[i]: starts[i] + cached[i]], 1)
        compared = 0
        for step, gammas in enumerate([(0, 0, 0, 0), (3, 0, 5, 1), (1, 1, 1, 1), (5, 2, 0, 3)] * 3):
            items = []
            for i, s in enumerate(seqs):
                c = starts[i] + s.length
                items.append((s, ids[c: c + gammas[i] + 1], gammas[i] + 1))
            outs = be.forward_batch(items)
            for i, (s, block, _) in enumerate(items):
                want = refs[i].forward(block, len(block))
                assert torch.equal(outs[i], want), (step, i, float((outs[i] - want).abs().max()))
                compared += 1
            for i, s in enumerate(seqs):  # reject part of each block, as a verification does
                s.truncate(s.length - gammas[i] // 2)
                refs[i].truncate(s.length)
            if step == 5:  # and grow past the 512-cell view
                grow = [ids[starts[i] + s.length: starts[i] + s.length + 250] for i, s in enumerate(seqs)]
                be.forward_batch([(s, grow[i], 1) for i, s in enumerate(seqs)])
                for i, r in enumerate(refs):
                    r.forward(grow[i], 1)
        assert compared == 48 and max(s.length for s in seqs) > 512
    finally:
        for e in alone + [be]:
            e.close()


@needs_llamacpp
def test_each_sequences_rows_of_a_fused_forward_are_its_own_logits_and_hidden_states(gguf, real):
    """forward_batch copies each sequence's rows out of llama.cpp's output buffers by their place
    in the batch: with different keeps, with hidden states (every row an output there) and
    without, each sequence gets the rows the same blocks give decoded alone, and a copy of its
    own (a later decode does not change them)."""
    from decoder.engines.llamacpp import LlamaCppEngine

    ids = _ids(real, 120)
    blocks = [(ids[0:30], 3), (ids[30:31], 1), (ids[40:55], 15), (ids[60:64], 2)]
    for hidden in (False, True):
        be = LlamaCppEngine(gguf, n_ctx=256, threads=2, n_seq=4, embeddings=hidden)
        alone = LlamaCppEngine(gguf, n_ctx=256, threads=2, embeddings=hidden)
        try:
            seqs = [be.start() for _ in blocks]
            outs = be.forward_batch([(s, b, k) for s, (b, k) in zip(seqs, blocks)], hidden)
            kept = [o[0].clone() if hidden else o.clone() for o in outs]
            be.forward_batch([(s, [7], 1) for s in seqs], hidden)  # overwrites llama.cpp's buffers
            for i, (b, k) in enumerate(blocks):
                want = alone.start().forward(b, k, hidden)
                got = outs[i]
                if hidden:
                    assert got[0].shape == (k, alone.vocab_size) and got[1].shape == (k, alone.hidden_size)
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (hidden, i)
                    got = got[0]
                else:
                    assert got.shape == (k, alone.vocab_size) and torch.equal(got, want), (hidden, i)
                assert torch.equal(got, kept[i])
        finally:
            be.close()
            alone.close()


def _prefill_then_decode(engine, seq, prompt: list[int], feed, n: int = 8) -> torch.Tensor:
    """Prefill ``prompt[:-1]`` through ``feed(seq, tokens)`` as the decoder's 512-token chunks,
    then greedy-decode ``n`` tokens one at a time: the (n + 1, V) logits."""
    for i in range(0, len(prompt) - 1, 512):
        feed(seq, prompt[i: min(i + 512, len(prompt) - 1)])
    rows = [seq.forward(prompt[-1:], 1)[0]]
    for _ in range(n):
        rows.append(seq.forward([int(rows[-1].argmax())], 1)[0])
    return torch.stack(rows)


@needs_llamacpp
@pytest.mark.parametrize("model", ["tiny-f32", pytest.param("packaged", marks=pytest.mark.slow)])
def test_a_prompt_prefilled_in_budget_pieces_beside_another_sequence_gives_the_same_logits(tmp_path, model):
    """What the step token budget rests on: a 700-token prompt whose 512-token prefill chunks are
    fed in pieces of 16 or 64 tokens (from its start, or from token 200 on: a short request that
    arrives mid-prefill), each piece in one llama_decode with another sequence's plain row, then
    decoded greedily, gives the same logits bits at every decoded position as the prompt
    prefilled in whole chunks in a one-sequence engine (plain decoding)."""
    from decoder.engines.llamacpp import LlamaCppEngine

    if model == "packaged":
        from decoder.models.loading import load_pair
        from decoder.models.packaged import packaged_gguf
        from decoder.workloads import prose_prompts

        path, tok = packaged_gguf("smollm2-135m"), load_pair("smollm2-135m", "layers:0-3").tokenizer
        ids = [t for p in prose_prompts(12, chars=2000) for t in tok(p.text)["input_ids"]][:800]
    else:
        from test_gguf_export import tiny_model, write_tiny_gguf

        path = write_tiny_gguf(tiny_model(), tmp_path / "tiny.gguf")
        ids = [int(x) for x in torch.randint(3, 200, (800,), generator=torch.Generator().manual_seed(0))]
    prompt, mate = ids[:700], ids[700:]
    alone = LlamaCppEngine(path, n_ctx=1024, threads=2)
    try:
        want = _prefill_then_decode(alone, alone.start(), prompt, lambda s, t: s.forward(t, 1))
    finally:
        alone.close()
    be = LlamaCppEngine(path, n_ctx=1024, threads=2, n_seq=2)
    try:
        for piece, from_ in ((64, 0), (16, 200)):
            a, b = be.start(), be.start()
            b.forward(mate[:20], 1)
            fed = [0]

            def feed(s, chunk, piece=piece, from_=from_, b=b, fed=fed):
                i = 0
                while i < len(chunk):
                    if fed[0] + i < from_:  # before the short request came: whole, alone
                        n = min(len(chunk), from_ - fed[0]) - i
                        s.forward(chunk[i: i + n], 1)
                    else:
                        n = min(piece, len(chunk) - i)
                        be.forward_batch([(s, chunk[i: i + n], 1), (b, [mate[b.length % 100]], 1)])
                    i += n
                fed[0] += len(chunk)

            got = _prefill_then_decode(be, a, prompt, feed)
            assert torch.equal(got, want), (piece, from_, float((got - want).abs().max()),
                                            int((got.argmax(1) != want.argmax(1)).sum()))
            a.release()
            b.release()
    finally:
        be.close()


# ---- the serving loop ----------------------------------------------------------------------
@needs_llamacpp
@pytest.mark.slow
def test_requests_served_together_each_equal_their_output_served_alone(real):
    """Five requests at once on a loop of max_batch 4 (one waits and joins when a slot frees):
    greedy with the n-gram proposer, the draft, plain decoding and the controller's pick, a seeded
    sampled one, a stop string, different lengths, and one cancelled mid-way. Each greedy output
    equals plain decoding of its prompt, each request's output equals its output served alone
    (the seeded sampled one too), the cancelled one stops with a prefix of its own, and the
    forwards were fused (some fused forwards held several sequences)."""
    from decoder.engines.registry import choose_engine
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, FixedGamma

    tok = real.tokenizer
    ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, n_seq=4)
    loop = build_serving_loop(real.target, real.draft, tok, engine=ch.target, draft_engine=ch.draft,
                              config=LoopConfig(max_batch=4), proposers=("ngram", "draft"))
    assert loop.batching is not None, loop.batch_why

    def reqs():
        p = lambda s: tok(s)["input_ids"]  # noqa: E731
        return [
            DecodeRequest(p("def fibonacci(n):"), SamplingParams(), 28, gamma=3, proposer="ngram", request_id="ngram"),
            DecodeRequest(p("The capital of France is"), SamplingParams(), 16, gamma=4, proposer="draft",
                          request_id="draft"),
            DecodeRequest(p("Once upon a time,"), SamplingParams(temperature=0.8, seed=7), 20, gamma=2,
                          proposer="draft", request_id="sampled"),
            DecodeRequest(p("1, 2, 3, 4,"), SamplingParams(), 24, gamma=0, request_id="plain"),
            DecodeRequest(p("Write a sentence about the sea."), SamplingParams(), 40, stop=["."], request_id="stop"),
            DecodeRequest(p("List three colors:"), SamplingParams(), 40, gamma=2, proposer="ngram", ignore_eos=True,
                          request_id="cancelled"),
        ]

    with loop:
        alone = {r.request_id: loop.generate(r, timeout=600) for r in reqs()}
        plain = {r.request_id: loop.decoder.generate(r, FixedGamma(0)) for r in reqs() if r.params.greedy}
        tickets: dict[str, object] = {}

        def cancel_after_4(ids):
            t = tickets["cancelled"]
            if len(t.tokens) >= 4:
                t.cancel()

        for r in reqs():
            tickets[r.request_id] = loop.submit(r, on_tokens=cancel_after_4 if r.request_id == "cancelled" else None)
        together = {k: t.result(600) for k, t in tickets.items()}
        st = loop.status()["batch"]
    for k, res in together.items():
        if k == "cancelled":
            assert res.finish_reason == "cancelled" and 4 <= len(res.output_ids) < 40
            assert res.output_ids == alone[k].output_ids[: len(res.output_ids)]
            continue
        assert res.output_ids == alone[k].output_ids, k
        assert res.text == alone[k].text and res.finish_reason == alone[k].finish_reason, k
        if k in plain:
            assert res.output_ids == plain[k].output_ids, k
    assert together["stop"].finish_reason in ("stop", "eos") and together["sampled"].steps
    assert any(int(n) >= 3 for n in st["by_sequences"]), st
    assert st["running"] == 0


@needs_llamacpp
@pytest.mark.slow
def test_a_batch_mate_that_joins_or_leaves_does_not_change_a_request(real):
    """The same long greedy request decoded while other requests join and leave at different
    steps (three arrival patterns) equals its plain decoding each time; while alone it fires its own
    steps (``solo_fired``), and the mates that arrive meanwhile are admitted into fused forwards."""
    from decoder.engines.registry import choose_engine
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, FixedGamma

    tok = real.tokenizer
    ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, n_seq=3)
    loop = build_serving_loop(real.target, real.draft, tok, engine=ch.target, draft_engine=ch.draft,
                              config=LoopConfig(max_batch=3), proposers=("ngram", "draft"))
    main = DecodeRequest(tok("Explain how a bicycle works.")["input_ids"], SamplingParams(), 48, gamma=3,
                         proposer="draft", ignore_eos=True)
    with loop:
        want = loop.decoder.generate(main, FixedGamma(0)).output_ids
        for n_mates, mate_len in ((1, 5), (2, 17), (2, 40)):
            gate = threading.Event()
            mates = []

            def join(ids, n_mates=n_mates, mate_len=mate_len):
                if len(ids) and not gate.is_set():
                    gate.set()
                    for j in range(n_mates):
                        mates.append(loop.submit(DecodeRequest(tok(f"Count to {j + 5}:")["input_ids"], SamplingParams(),
                                                               mate_len + 7 * j, gamma=j, proposer="ngram")))

            t = loop.submit(main, on_tokens=join)
            assert t.result(600).output_ids == want, (n_mates, mate_len)
            for m in mates:
                m.result(600)
        st = loop.status()["batch"]
    # alone, the request fired its own steps (no hand-off to the driver); the mates that arrived meanwhile
    # were admitted all the same, into fused forwards with it
    assert st["solo_fired"] > 0 and any(int(n) >= 2 for n in st["by_sequences"]), st


@needs_llamacpp
def test_a_sequence_dropped_without_release_frees_its_slot_once(gguf):
    import gc

    from decoder.engines.llamacpp import LlamaCppEngine

    e = LlamaCppEngine(gguf, n_ctx=256, threads=2, n_seq=2)
    try:
        a = e.start()
        a.release()
        b = e.start()  # slot 0 again
        assert b.seq_id == 0
        del a
        gc.collect()  # a's finalizer already ran in release(): slot 0 stays b's
        assert e.free_sequences == 1
        del b
        gc.collect()
        assert e.free_sequences == 2
    finally:
        e.close()


@needs_llamacpp
@pytest.mark.slow
def test_a_long_prompt_prefilled_under_the_step_token_budget_and_its_batch_mates_equal_plain_decoding(real):
    """A 1,100-token prompt (three 512-token prefill chunks; the draft model's own catch-up
    forward of the whole prompt, too) with three short requests beside it on a loop with a small
    budget (16 tokens: many cut points), so its prefill goes in 16-token pieces while they
    decode: every greedy output equals plain decoding of its request (batch 1, no speculation),
    and the budget did cut (``budget_cut_pieces``). Then the same long request cancelled while
    its prefill is being cut stops at its next prefill chunk with no output, and the short ones
    still equal plain decoding."""
    from decoder.engines.registry import choose_engine
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, FixedGamma

    tok = real.tokenizer
    ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, n_seq=4)
    loop = build_serving_loop(real.target, real.draft, tok, engine=ch.target, draft_engine=ch.draft,
                              config=LoopConfig(max_batch=4, step_token_budget=16), proposers=("ngram", "draft"))
    assert loop.batching is not None and loop.batching.step_token_budget == 16
    long_ids = _ids(real, 1100)
    p = lambda s: tok(s)["input_ids"]  # noqa: E731
    # no prompt cache for it: its whole prefill is what this test cuts (the plain run before would hand it the cells)
    long_req = DecodeRequest(long_ids, SamplingParams(), 12, gamma=3, proposer="draft", ignore_eos=True,
                             request_id="long", cache_prompt=False)
    shorts = [DecodeRequest(p("The capital of France is"), SamplingParams(), 24, gamma=0, request_id="plain"),
              DecodeRequest(p("def fibonacci(n):"), SamplingParams(), 20, gamma=2, proposer="ngram", request_id="ngram"),
              DecodeRequest(p("List three colors:"), SamplingParams(), 16, gamma=2, proposer="draft", ignore_eos=True,
                            request_id="draft")]
    with loop:
        plain = {r.request_id: loop.decoder.generate(r, FixedGamma(0)).output_ids for r in [long_req] + shorts}
        tickets = {"long": loop.submit(long_req)} | {r.request_id: loop.submit(r) for r in shorts}
        got = {k: t.result(900) for k, t in tickets.items()}
        st = loop.status()["batch"]
        for k, res in got.items():
            assert res.output_ids == plain[k], k
        assert st["budget_cut_pieces"] > 0 and st["step_token_budget"] == 16, st

        tickets = {"long": loop.submit(long_req)}
        cancel = lambda ids: tickets["long"].cancel()  # noqa: E731 - the first short tokens cancel the long one
        tickets |= {r.request_id: loop.submit(r, on_tokens=cancel) for r in shorts}
        got = {k: t.result(900) for k, t in tickets.items()}
    assert got["long"].finish_reason == "cancelled" and got["long"].output_ids == []
    for r in shorts:
        assert got[r.request_id].output_ids == plain[r.request_id], r.request_id


def _mates_running(loop, tok, stop: threading.Event, seed: int) -> threading.Thread:
    """A client that keeps submitting greedy batch mates of changing lengths, γ and proposers
    until ``stop``: each joins the running batch at a step boundary and leaves when done."""
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    def run():
        j = seed
        while not stop.is_set():
            ids = tok(f"Count from {j % 7 + 1} to {j % 7 + 9}:")["input_ids"]
            loop.submit(DecodeRequest(ids, SamplingParams(), 3 + (5 * j) % 17, gamma=j % 4,
                                      proposer=("ngram", "draft")[j % 2])).result(600)
            j += 1

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t



@needs_llamacpp
@pytest.mark.slow
def test_sampled_requests_whose_batch_mates_change_draw_exactly_their_batch_1_tokens(real):
    """T = 1 with the draft (γ = 2), six seeds, each served alone (batch 1) and then again while two
    clients keep batch mates joining and leaving (different lengths, γ and proposers) on a loop of
    max_batch 3: every seed's tokens are the same, so the distribution of a request's tokens does
    not depend on its batch mates (a T = 1 chi-square at 300 seeds took 9 s a request on this
    2-core host, 45 minutes; the per-seed identity is the stronger check)."""
    from decoder.engines.registry import choose_engine
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    tok = real.tokenizer
    ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, n_seq=3)
    loop = build_serving_loop(real.target, real.draft, tok, engine=ch.target, draft_engine=ch.draft,
                              config=LoopConfig(max_batch=3), proposers=("ngram", "draft"))
    assert loop.batching is not None, loop.batch_why
    ids = tok("My favourite animal is the")["input_ids"]
    req = lambda s: DecodeRequest(ids, SamplingParams(1.0, seed=s), 12, gamma=2, proposer="draft",  # noqa: E731
                                  ignore_eos=True)
    seeds = range(6)
    with loop:
        alone = {s: loop.generate(req(s), timeout=600).output_ids for s in seeds}
        before = dict(loop.status()["batch"]["by_sequences"])
        stop = threading.Event()
        mates = [_mates_running(loop, tok, stop, k) for k in (0, 5)]
        try:
            together = {s: loop.generate(req(s), timeout=600).output_ids for s in seeds}
        finally:
            stop.set()
            for m in mates:
                m.join(600)
        after = loop.status()["batch"]["by_sequences"]
    assert together == alone
    assert len({tuple(v) for v in alone.values()}) > 1  # the seeds drew differently: sampling ran
    assert sum(int(after.get(k, 0)) - int(before.get(k, 0)) for k in after if int(k) >= 2) > 0, (before, after)


@needs_llamacpp
@pytest.mark.slow
def test_logprobs_served_in_a_batch_are_the_engines_own_scores(real):
    """Requests asking for logprobs (greedy with the draft at γ = 3, the n-gram proposer at γ = 2,
    plain, and sampled at T = 0.8) served together on a loop of max_batch 4: each emitted token's
    logprob and top-3 equal the log-softmax of the engine's own rows (raw for greedy, divided by T
    for sampled) from one forward of prompt + output on a sequence decoded alone."""
    from decoder.engines.registry import choose_engine
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    tok = real.tokenizer
    ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, n_seq=4)
    loop = build_serving_loop(real.target, real.draft, tok, engine=ch.target, draft_engine=ch.draft,
                              config=LoopConfig(max_batch=4), proposers=("ngram", "draft"))
    assert loop.batching is not None, loop.batch_why
    p = lambda s: tok(s)["input_ids"]  # noqa: E731
    reqs = [DecodeRequest(p("def fibonacci(n):"), SamplingParams(), 20, gamma=3, proposer="draft", logprobs=3,
                          ignore_eos=True, request_id="draft"),
            DecodeRequest(p("1, 2, 3, 4,"), SamplingParams(), 16, gamma=2, proposer="ngram", logprobs=3,
                          ignore_eos=True, request_id="ngram"),
            DecodeRequest(p("The capital of France is"), SamplingParams(), 12, gamma=0, logprobs=3, ignore_eos=True,
                          request_id="plain"),
            DecodeRequest(p("Once upon a time,"), SamplingParams(temperature=0.8, seed=3), 16, gamma=2,
                          proposer="draft", logprobs=3, ignore_eos=True, request_id="sampled")]
    with loop:
        tickets = {r.request_id: loop.submit(r) for r in reqs}
        got = {k: t.result(600) for k, t in tickets.items()}
        st = loop.status()["batch"]
        for r in reqs:
            res = got[r.request_id]
            out = res.output_ids
            seq = ch.target.start()
            try:
                rows = seq.forward(list(r.prompt_ids) + out[:-1], len(out)).double()  # row j scored out[j]
            finally:
                seq.release()
            lp = torch.log_softmax(rows / (1.0 if r.params.greedy else r.params.temperature), -1)
            assert [x.token for x in res.logprobs] == out, r.request_id
            assert [x.logprob for x in res.logprobs] == pytest.approx([lp[j, t].item() for j, t in enumerate(out)],
                                                                      abs=1e-3), r.request_id
            top = torch.topk(lp, 3, -1)
            assert [b for x in res.logprobs for _, b in x.top] == pytest.approx(top.values.flatten().tolist(),
                                                                                abs=1e-3), r.request_id
            if r.params.greedy:
                assert out == top.indices[:, 0].tolist(), r.request_id
    assert any(int(k) >= 2 for k in st["by_sequences"]), st
