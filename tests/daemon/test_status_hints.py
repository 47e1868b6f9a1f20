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
