"""Draining a batching serving loop: a request taken from the queue but not yet decoding (held for
an empty batch because it swaps the adapter, or running the between-request hooks that swap it)
is still work; drain must not report the loop empty while it waits."""

from __future__ import annotations

import threading
import types

from decoder.engines.base import Capabilities


class _Seq:
    def __init__(self, engine):
        self.engine, self.length = engine, 0

    def forward(self, tokens, keep, hidden=False):
        from decoder.engines.base import forward_router

        r = forward_router()
        if r is not None:
            return r.call(self.engine, self, tokens, keep, hidden)
        return self.engine.forward_batch([(self, tokens, keep)], hidden)[0]


class _Engine:
    name = "fake"
    capabilities = Capabilities(False, False, True, False, True, max_sequences=4)

    def forward_batch(self, items, hidden=False):
        return [None for _ in items]


def test_a_request_between_the_queue_and_the_batch_keeps_drain_waiting_and_the_loop_busy():
    from decoder.control import GoodputController
    from decoder.loop import LoopConfig, ServingLoop
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    eng = _Engine()
    a_stepped, a_release = threading.Event(), threading.Event()
    b_asked, b_in_hook, b_release = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []
    seen_in_hook: dict[str, object] = {}

    def generate_batched(req, policy=None, on_step=None):
        s = _Seq(eng)
        if req.workload == "a":
            while not a_release.is_set():  # A decodes step after step until released
                s.forward([1], 1)
                a_stepped.set()
        else:
            s.forward([1], 1)
        order.append(f"{req.workload} finished")
        return types.SimpleNamespace(finish_reason="length", output_ids=[1], workload=req.workload, adapter_version=0,
                                     proposer=None)

    def hook(dec, req):
        if req is not None and req.workload == "b":
            seen_in_hook["busy"] = loop.busy
            b_in_hook.set()
            b_release.wait(60)

    def wants_switch(req):
        if req.workload == "b":
            b_asked.set()
            return True  # b swaps the adapter: it joins only an empty batch
        return False

    dec = types.SimpleNamespace(engine=eng, draft_engine=None, adapter_version=0, _lock=threading.Lock(),
                                between_requests=[hook], wants_switch=wants_switch,
                                generate=lambda req, policy=None, on_step=None: generate_batched(req, policy, on_step),
                                generate_batched=generate_batched)
    loop = ServingLoop(dec, controller=GoodputController(), config=LoopConfig(max_batch=4, check_plain_every=0))
    assert loop.batching is not None, loop.batch_why
    with loop:
        ta = loop.submit(DecodeRequest([1, 2], SamplingParams(), 4, gamma=0, workload="a"))
        assert a_stepped.wait(30)
        tb = loop.submit(DecodeRequest([1, 2], SamplingParams(), 4, gamma=0, workload="b"))
        assert b_asked.wait(30)  # b is held: taken from the queue, waiting for a's batch to drain
        assert loop.busy
        drained: list[bool] = []

        def drain():
            drained.append(loop.drain(60))
            order.append("drain returned")

        th = threading.Thread(target=drain)
        th.start()
        a_release.set()
        assert b_in_hook.wait(30)
        th.join(2)  # a drain that took b for done has returned by now; one that waits for b has not
        b_release.set()
        th.join(60)
        assert ta.result(30).workload == "a" and tb.result(30).workload == "b"
    assert seen_in_hook["busy"] is True  # b, between the queue and the batch, is work in progress
    assert order == ["a finished", "b finished", "drain returned"], order
    assert drained == [True]
