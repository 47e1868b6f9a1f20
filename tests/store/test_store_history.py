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
    assert hist.read() == []
