"""`daemonctl status` after a demo (issue 37, item 10): it says where the demo's data is, and an
acceptance row without recent traffic says when its last request was recorded."""

from __future__ import annotations

from daemon.reports import other_prefixes_hint, speculation_state
from store.history import HistoryRow


def test_no_recent_traffic_says_when_the_last_request_was():
    empty = HistoryRow(workload="prose", version=1, ts=0.0)
    s = speculation_state([], empty, last_ts=1000.0, now=1000.0 + 14 * 60)
    assert s["on"] is None and "no requests recorded in the last 300 s" in s["why"]
    assert "the last was recorded 14 min ago" in s["why"]
    assert "last was" not in speculation_state([], empty)["why"]  # no history at all: nothing to date


def test_hint_points_at_the_demo_prefix(redis_client, key_prefix):
    assert other_prefixes_hint(redis_client, key_prefix) is None
    redis_client.set(f"{key_prefix}demo:registry:active", b"3")
    hint = other_prefixes_hint(redis_client, key_prefix)
    assert hint is not None and f"export DRAFTD_STORE__KEY_PREFIX={key_prefix}demo:" in hint


def test_status_lists_at_most_50_workloads_and_counts_the_rest(redis_client, key_prefix):
    """Issue 37 item 4: a history holding the workloads of 2,000 invented names listed 4,786 lines
    in 5.4 s; status lists the 50 with the most requests and warns about the rest."""
    import time as _time

    from daemon.reports import STATUS_WORKLOADS, acceptance_sections
    from store.config import StoreConfig
    from store.history import AcceptanceHistory

    h = AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix))
    now = _time.time()
    for i in range(120):
        h.record(f"w{i:03d}", 0, {"requests": 1 + (i >= 100) * 10, "num_steps": 1}, ts=now)
    adapter = {"active": 0, "since": None, "previous": None, "workloads": {}}
    warnings: list[str] = []
    t0 = _time.perf_counter()
    acc, spec = acceptance_sections(h, adapter, now, warnings)
    assert _time.perf_counter() - t0 < 5
    assert len(acc) == len(spec) == STATUS_WORKLOADS == 50
    assert {f"w{i:03d}" for i in range(100, 120)} <= set(acc)  # the busiest are shown
    assert len(warnings) == 1 and warnings[0].startswith("70 more workloads")
