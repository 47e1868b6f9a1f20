"""ThreadFeed: tokens from the serving loop's threads reach each request's asyncio queue in order,
with one wake of the event loop for everything that arrived since it last drained."""

from __future__ import annotations

import asyncio
import threading

import pytest

from daemon.serve import ThreadFeed


def test_items_from_several_threads_arrive_in_order_with_one_wake_while_the_loop_is_busy():
    aloop = asyncio.new_event_loop()
    try:
        feed = ThreadFeed(aloop)
        qs = [asyncio.Queue() for _ in range(4)]

        def member(i):  # four batch members, each emitting 50 steps' tokens
            for k in range(50):
                feed.put(qs[i], [i, k])

        ts = [threading.Thread(target=member, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert all(q.empty() for q in qs)  # nothing runs on the loop until it does
        assert feed.wakes == 1  # the loop was not running: one drain was queued for all 200 items

        aloop.run_until_complete(asyncio.sleep(0))
        for i, q in enumerate(qs):
            got = [q.get_nowait() for _ in range(q.qsize())]
            assert got == [[i, k] for k in range(50)]

        feed.put(qs[0], "next")  # after a drain, the next item wakes the loop again
        assert feed.wakes == 2
        aloop.run_until_complete(asyncio.sleep(0))
        assert qs[0].get_nowait() == "next"
    finally:
        aloop.close()


def test_a_closed_loop_raises_on_every_put_and_never_leaves_the_feed_stuck():
    aloop = asyncio.new_event_loop()
    aloop.close()
    feed = ThreadFeed(aloop)
    q = asyncio.Queue()
    with pytest.raises(RuntimeError):
        feed.put(q, 1)
    with pytest.raises(RuntimeError):  # not swallowed as "a drain is already queued"
        feed.put(q, 2)
    assert feed.wakes == 2


def test_items_put_without_a_wake_wait_for_the_next_flush_in_order():
    # a batch member's tokens: no wake from its thread; the driver's flush at the step boundary wakes once
    aloop = asyncio.new_event_loop()
    try:
        feed = ThreadFeed(aloop)
        q = asyncio.Queue()
        for k in range(5):
            feed.put(q, k, wake=False)
        assert feed.wakes == 0
        aloop.run_until_complete(asyncio.sleep(0))
        assert q.empty()  # nothing was scheduled
        feed.flush()
        feed.flush()  # a drain is already queued: no second wake
        assert feed.wakes == 1
        aloop.run_until_complete(asyncio.sleep(0))
        assert [q.get_nowait() for _ in range(5)] == [0, 1, 2, 3, 4]
        feed.flush()  # nothing waits: no wake
        assert feed.wakes == 1
        feed.put(q, "x", wake=False)
        feed.put(q, "y")  # a wake from elsewhere takes what waits too, in order
        aloop.run_until_complete(asyncio.sleep(0))
        assert [q.get_nowait(), q.get_nowait()] == ["x", "y"]
    finally:
        aloop.close()
    feed.put(q, "late", wake=False)
    feed.flush()  # a closed loop: its items are dropped, not raised at every step boundary
    assert feed.wakes == 2 and not feed._items


def test_a_drain_queued_on_a_loop_that_closed_before_running_it_does_not_strand_the_feed():
    aloop = asyncio.new_event_loop()
    feed = ThreadFeed(aloop)
    q = asyncio.Queue()
    feed.put(q, 1)  # a drain is queued, never run
    aloop.close()
    feed.put(q, 2, wake=False)
    feed.flush()  # the loop is closed: its items go, and the feed is not left "scheduled"
    assert not feed._items and not feed._scheduled
