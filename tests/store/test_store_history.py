"""Acceptance history: bucketed counts and rates derived on read, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from store.config import HistoryConfig, StoreConfig
from store.history import AcceptanceHistory

NOW = 100_000.0


@pytest.fixture
def hist(client, prefix):
    cfg = StoreConfig(key_prefix=prefix, history=HistoryConfig(bucket_s=10, retention_s=3600))
    return AcceptanceHistory(client, cfg, clock=lambda: NOW)


def test_buckets_and_derived_rates(hist):
    # chat, v1: two records in bucket 99_990 (ts 99_991 and 99_999.9), one in bucket 100_000
    hist.record("chat", 1, {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 30,
                            "num_emitted_tokens": 40, "num_steps": 10, "alpha_sum": 0.75, "alpha_count": 1,
                            "wall_ms": 500.0, "requests": 1}, ts=99_991.0)
    hist.record("chat", 1, {"num_drafts": 5, "num_draft_tokens": 20, "num_accepted_tokens": 5,
                            "num_emitted_tokens": 10, "num_steps": 5, "alpha_sum": 0.25, "alpha_count": 1,
                            "wall_ms": 250.0, "requests": 1}, ts=99_999.9)
    hist.record("chat", 1, {"num_draft_tokens": 8, "num_accepted_tokens": 8, "num_emitted_tokens": 10,
                            "num_steps": 2, "requests": 1}, ts=100_000.0)
    rows = hist.read("chat", 1)
    assert [r.ts for r in rows] == [99_990.0, 100_000.0]
    a, b = rows
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens, a.num_emitted_tokens, a.num_steps) == (15, 60, 35, 50, 15)
    assert a.acceptance_rate == pytest.approx(35 / 60)
    assert a.tau == pytest.approx(50 / 15)
    assert a.alpha == pytest.approx((0.75 + 0.25) / 2)
    assert a.goodput == pytest.approx(50 / 750)
    assert a.requests == 2
    assert b.acceptance_rate == 1.0 and b.tau == 5.0
    assert math.isnan(b.alpha) and math.isnan(b.goodput)  # zero denominators -> NaN
    t = hist.totals("chat", 1)
    assert (t.num_draft_tokens, t.num_accepted_tokens, t.num_steps) == (68, 43, 17)
    assert t.acceptance_rate == pytest.approx(43 / 68) and t.tau == pytest.approx(60 / 17)
    assert (t.ts, t.workload, t.version) == (99_990.0, "chat", 1)


def test_filters_windows_and_non_ascii_workloads(hist):
    wl = "数学|证明:ü"  # contains the index separator and a colon
    hist.record("chat", 1, {"num_draft_tokens": 4, "num_accepted_tokens": 1}, ts=99_950.0)
    hist.record("chat", 2, {"num_draft_tokens": 4, "num_accepted_tokens": 2}, ts=99_960.0)
    hist.record(wl, 2, {"num_draft_tokens": 4, "num_accepted_tokens": 3}, ts=99_960.0)
    hist.record(wl, 2, {"num_draft_tokens": 4, "num_accepted_tokens": 4}, ts=99_975.0)
    assert [(r.workload, r.version, r.ts) for r in hist.read()] == [
        ("chat", 1, 99_950.0), ("chat", 2, 99_960.0), (wl, 2, 99_960.0), (wl, 2, 99_970.0)]
    assert [r.num_accepted_tokens for r in hist.read(workload=wl)] == [3, 4]
    assert [r.workload for r in hist.read(version=2, start=99_960, end=99_960)] == ["chat", wl]
    assert [r.ts for r in hist.read(start=99_965.0)] == [99_960.0, 99_960.0, 99_970.0]  # bucket of start onwards
    assert [r.ts for r in hist.read(end=99_959.9)] == [99_950.0]
    t = hist.totals(version=2)
    assert (t.workload, t.version, t.num_accepted_tokens, t.num_draft_tokens) == (None, 2, 9, 12)
    assert t.acceptance_rate == pytest.approx(9 / 12)
    empty = hist.totals(workload="nope", start=5.0)
    assert empty.num_draft_tokens == 0 and math.isnan(empty.acceptance_rate) and empty.ts == 5.0


def test_retention_expires_buckets_and_trims_index(client, prefix):
    now = [NOW]
    cfg = StoreConfig(key_prefix=prefix, history=HistoryConfig(bucket_s=10, retention_s=60))
    h = AcceptanceHistory(client, cfg, clock=lambda: now[0])
    h.record("chat", 0, {"num_steps": 1}, ts=NOW)
    ttl = client.ttl(cfg.keys.history_bucket("chat", 0, 100_000))
    assert 0 < ttl <= 60
    now[0] = NOW + 120  # two minutes later, a new write trims the index of old buckets
    h.record("chat", 0, {"num_steps": 2}, ts=now[0])
    assert [r.num_steps for r in h.read()] == [2]
    assert client.zcard(cfg.keys.history_index) == 1


def test_record_validates_counters(hist):
    with pytest.raises(ValueError, match="num_acepted"):
        hist.record("chat", 0, {"num_acepted": 1})
    with pytest.raises(ValueError, match="num_steps"):
        hist.record("chat", 0, {"num_steps": 1.5})
    with pytest.raises(ValueError, match="empty"):
        hist.record("", 0, {"num_steps": 1})
    # a negative count (a caller's subtraction gone wrong) would silently lower the stored totals
    with pytest.raises(ValueError, match=r"must be >= 0, got \{'num_accepted_tokens': -3\} for 'chat' v0"):
        hist.record("chat", 0, {"num_draft_tokens": 4, "num_accepted_tokens": -3})
    with pytest.raises(ValueError, match="alpha_sum"):
        hist.record("chat", 0, {"alpha_sum": -0.5})
    assert hist.read() == []


def test_a_write_is_applied_once_per_writer_and_seq(hist, client, prefix):
    # the same write retried (same seq) or an older one arriving late is skipped; a newer one and
    # another writer's are applied: 1 + 4 + 16 steps, not 1 + 2 + 4 + 8 + 16
    assert hist.record("chat", 1, {"num_steps": 1, "requests": 1}, seq=3) is True
    assert hist.record("chat", 1, {"num_steps": 2, "requests": 1}, seq=3) is False  # a resend
    assert hist.record("chat", 1, {"num_steps": 8, "requests": 1}, seq=2) is False  # older than applied
    assert hist.record("chat", 1, {"num_steps": 4, "requests": 1}, seq=4) is True
    assert hist.record("chat", 2, {"num_steps": 32, "requests": 1}, seq=1) is True  # another version: its own numbers
    other = AcceptanceHistory(client, StoreConfig(key_prefix=prefix, history=HistoryConfig(bucket_s=10, retention_s=3600)),
                              clock=lambda: NOW)
    assert other.writer != hist.writer
    assert other.record("chat", 1, {"num_steps": 16, "requests": 1}, seq=3) is True
    row = hist.totals(workload="chat", version=1)
    assert (row.num_steps, row.requests) == (1 + 4 + 16, 3)
    assert hist.totals(workload="chat", version=2).num_steps == 32
    # without a seq every call is a new write
    hist.record("chat", 1, {"num_steps": 64})
    hist.record("chat", 1, {"num_steps": 64})
    assert hist.totals(workload="chat", version=1).num_steps == 1 + 4 + 16 + 128


def test_a_write_whose_reply_was_lost_counts_once_when_resent_or_retried(private_redis, tmp_path):
    # The server is busy (a script running 1.5 s) when the write arrives: the client's 0.3 s read
    # times out, redis-py (its default Retry) resends it on new connections, and record raises
    # StoreUnavailableError; the server runs what it had read once the script ends. The caller
    # (AcceptanceTracker) then retries with the same seq, as the error tells it to. Counted once.
    import threading
    import time

    from store.client import connect
    from store.errors import StoreUnavailableError

    busy = connect(private_redis.url, socket_timeout=10.0)  # waits out its own 1.5 s script
    slow = connect(private_redis.url, socket_timeout=0.3)
    cfg = StoreConfig(key_prefix="t:", history=HistoryConfig(bucket_s=10, retention_s=3600))
    h = AcceptanceHistory(slow, cfg, clock=lambda: NOW)
    h.record("chat", 0, {"requests": 1})  # the script is loaded before the server is busy
    spin = ("local t0 = redis.call('TIME') local t = t0 "
            "while (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) < 1500000 do t = redis.call('TIME') end return 1")
    th = threading.Thread(target=lambda: busy.eval(spin, 0))
    th.start()
    time.sleep(0.2)
    seq = h.next_seq()
    with pytest.raises(StoreUnavailableError):
        h.record("chat", 0, {"requests": 1, "num_steps": 5}, seq=seq)
    th.join()
    time.sleep(0.2)
    applied_meanwhile = busy.info("commandstats")["cmdstat_evalsha"]["calls"] - 1
    assert applied_meanwhile >= 1  # the server ran the write whose reply was lost: the case under test
    assert h.record("chat", 0, {"requests": 1, "num_steps": 5}, seq=seq) is False  # the caller's retry
    row = AcceptanceHistory(private_redis.client(), cfg, clock=lambda: NOW).totals(workload="chat", version=0)
    assert (row.requests, row.num_steps) == (2, 5)


def test_concurrent_writes_without_seq_all_count(hist):
    # each call takes its number and writes under one lock: a later number landing first must
    # not turn an earlier one into a skip (4 threads x 100 writes = 400)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: hist.record("conc", 1, {"requests": 1}), range(400)))
    assert hist.totals(workload="conc", version=1).requests == 400


def test_a_write_redis_cannot_keep_writes_nothing_and_says_so(hist, client, prefix):
    hist.record("big", 1, {"requests": 1, "num_steps": 2**62})
    with pytest.raises(ValueError, match="num_steps.* outside a 64-bit integer"):
        hist.record("big", 1, {"requests": 1, "num_steps": 2**63})
    # 2**62 + 2**62 overflows what Redis keeps: refused whole, before any counter moves
    with pytest.raises(ValueError, match="would overflow the stored counts of 'big' v1 .*nothing was written"):
        hist.record("big", 1, {"requests": 1, "num_steps": 2**62}, seq=99)
    row = hist.totals(workload="big", version=1)
    assert (row.requests, row.num_steps) == (1, 2**62)
    assert hist.record("big", 1, {"requests": 1}, seq=99) is True  # the refused seq was not marked applied
    key = StoreConfig(key_prefix=prefix).keys.history_bucket("big", 1, hist.bucket_of(NOW))
    assert 0 < client.ttl(key) <= 3600
    for bad in (0, -1, 2**53 + 1, 2.0, True):
        with pytest.raises(ValueError, match="seq=.* must be an int in 1..2\\*\\*53"):
            hist.record("big", 1, {"requests": 1}, seq=bad)
    with pytest.raises(ValueError, match="ts=inf is not a finite time"):
        hist.record("big", 1, {"requests": 1}, ts=float("inf"))
    assert hist.totals(workload="big", version=1).requests == 2


def test_an_unreadable_entry_is_left_out_and_named_not_an_error_for_every_reader(hist, client):
    """A history index member that is not ``bucket|version|workload`` (written by hand, another
    program under the prefix) or a bucket whose count is not a number: read() used to raise
    ValueError, so `daemonctl status`, /metrics and `adapters show` all failed on one bad entry.
    It is left out, with a warning naming the key, the entry and how to remove it; the readable
    rows are returned as ever."""
    from structlog.testing import capture_logs

    hist.record("chat", 1, {"num_steps": 4, "requests": 1}, ts=99_991.0)
    hist.record("code", 1, {"num_steps": 3, "requests": 1}, ts=99_991.0)
    index = hist._keys.history_index
    client.zadd(index, {b"garbage-no-bars": 99_990, b"abc|1|chat": 99_990})  # no fields; a bucket not a number
    client.hset(hist._keys.history_bucket("code", 1, 99_990), "num_steps", b"three")
    with capture_logs() as logs:
        rows = hist.read()
    assert [(r.workload, r.version, r.num_steps) for r in rows] == [("chat", 1, 4)]
    bad = sorted(e["entry"] for e in logs if e["event"] == "history_entry_unreadable")
    assert bad == ["abc|1|chat", "code v1 bucket 99990", "garbage-no-bars"], logs
    assert all(e["key"] and "ZREM" in e["fix"] or "DEL" in e["fix"] for e in logs), logs
