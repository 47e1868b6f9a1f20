"""The serving loop in-process (as the demo drives it): results equal the decoder's own, a bounded
queue, cancellation while queued, drain."""

from __future__ import annotations

import threading

import pytest

from decoder.loop import Cancelled, Draining, LoopConfig, QueueFull, ServingLoop, build_serving_loop
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder

CFG = dict(small_m_linear=False, draft_precision="fp32")


class Hold:
    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, dec, req=None):
        if req is not None:
            self.entered.set()
            self.release.wait(60)


def test_generate_through_the_loop_equals_plain_decoding_and_feeds_controller_and_tracker(tok, target, other_draft):
    loop = build_serving_loop(target, other_draft, tok, decoder_config=DecoderConfig(**CFG))
    plain = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(**CFG))
    with loop:
        for i, text in enumerate(["abc", "hello world", "x = 1 +"]):
            ids = tok(text).input_ids
            req = DecodeRequest(ids, SamplingParams(), 10, workload=("prose", "code")[i % 2])
            got = []
            res = loop.submit(req, on_tokens=got.extend).result(60)
            ref = plain.generate(DecodeRequest(ids, SamplingParams(), 10, gamma=0))
            assert res.output_ids == ref.output_ids == got
        st = loop.status()
        assert st["requests_served"] == 3 and st["requests_by_workload"] == {"prose": 2, "code": 1}
        assert set(st["speculation"]) == {"prose@greedy", "code@greedy"}
        assert {k[:2] for k in loop.tracker.keys()} == {("prose", "greedy"), ("code", "greedy")}


def test_bounded_queue_cancel_while_queued_and_drain(tok, target, other_draft):
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(**CFG))
    hold = Hold()
    dec.between_requests.append(hold)
    loop = ServingLoop(dec, config=LoopConfig(queue_size=2)).start()
    try:
        req = lambda: DecodeRequest(tok("ab").input_ids, SamplingParams(), 4)  # noqa: E731
        first = loop.submit(req())
        assert hold.entered.wait(60)
        queued = [loop.submit(req()), loop.submit(req())]
        with pytest.raises(QueueFull):
            loop.submit(req())
        queued[0].cancel()
        drained = []
        t = threading.Thread(target=lambda: drained.append(loop.drain(60)))
        t.start()
        while not loop.draining:
            threading.Event().wait(0.01)
        with pytest.raises(Draining):
            loop.submit(req())
        hold.release.set()
        t.join(60)
        assert drained == [True]
        assert len(first.result(10).output_ids) >= 1 and len(queued[1].result(10).output_ids) >= 1
        with pytest.raises(Cancelled):
            queued[0].result(10)
        assert loop.status()["requests_cancelled"] == 1 and loop.status()["refused_queue_full"] == 1
    finally:
        hold.release.set()
        loop.close()


def test_a_second_signal_cuts_the_drain_grace_short(tok, target, other_draft):
    """`serve`'s second SIGTERM sets ``cut``: drain stops waiting for the running request (held
    here) long before its 600 s grace and cancels it."""
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(**CFG))
    hold = Hold()
    dec.between_requests.append(hold)
    loop = ServingLoop(dec).start()
    try:
        running = loop.submit(DecodeRequest(tok("ab").input_ids, SamplingParams(), 4))
        queued = loop.submit(DecodeRequest(tok("cd").input_ids, SamplingParams(), 4))
        assert hold.entered.wait(60)
        cut, drained = threading.Event(), []
        t = threading.Thread(target=lambda: drained.append(loop.drain(600, cut)))
        t.start()
        while not loop.draining:
            threading.Event().wait(0.01)
        assert drained == []  # still waiting inside its grace
        cut.set()
        t.join(60)
        assert drained == [False] and not t.is_alive()
        hold.release.set()
        with pytest.raises(Cancelled):
            queued.result(30)
        try:  # cancelled at its next step: it answers with what it has, or Cancelled
            running.result(30)
        except Cancelled:
            pass
    finally:
        hold.release.set()
        loop.close()


def test_a_seed_reproduces_a_sampled_completion_whatever_was_served_before(tok, target, other_draft):
    """Seeded sampled requests run on the n-gram proposer (the first configured) over their own
    tokens only: the same prompt and seed give the same text before and after the workload's
    history has grown; an unseeded request still looks the history up."""
    loop = build_serving_loop(target, other_draft, tok, decoder_config=DecoderConfig(**CFG), proposers=("ngram",))
    ids = tok("hello world, hello world, hello").input_ids
    seeded = lambda: DecodeRequest(ids, SamplingParams(1.0, seed=7), 16, workload="w")  # noqa: E731
    with loop:
        first = loop.generate(seeded()).output_ids
        for s in range(4):  # the workload's history grows with other completions of the same prompt
            loop.generate(DecodeRequest(ids, SamplingParams(1.0, seed=100 + s), 16, workload="w", gamma=0))
        assert loop.decoder.ngram_history.status()["w"] > 0
        assert loop.generate(seeded()).output_ids == first
        assert loop.generate(seeded()).output_ids == first
