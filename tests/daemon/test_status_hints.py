"""`daemonctl status` after a demo (issue 37, item 10): it says where the demo's data is, and an
acceptance row without recent traffic says when its last request was recorded."""

from __future__ import annotations

from daemon.reports import buffer_warnings, other_prefixes_hint, speculation_state
from store.history import HistoryRow


def test_no_recent_traffic_says_when_the_last_request_was():
    empty = HistoryRow(workload="prose", version=1, ts=0.0)
    s = speculation_state([], empty, last_ts=1000.0, now=1000.0 + 14 * 60)
    assert s["on"] is None and s["last"] == {"age_s": 840.0} and s["why"].startswith("last request 14 min ago")
    none = speculation_state([], empty)  # no history at all: nothing to date
    assert none == {"on": None, "why": "no requests recorded in the last 300 s"}


def test_no_recent_traffic_tells_the_last_known_acceptance():
    """After a demo: the window that ended at the last request, 9 steps of which 5 drafted 20
    tokens and 8 were accepted: on then, acceptance 8 / 20 = 0.400, its age in minutes."""
    empty = HistoryRow(workload="prose", version=1, ts=0.0)
    last = HistoryRow(workload="prose", version=1, ts=1000.0, requests=3, num_steps=9, num_drafts=5,
                      num_draft_tokens=20, num_accepted_tokens=8)
    s = speculation_state([], empty, last_ts=1000.0, now=1000.0 + 12 * 60, last=last)
    assert s["on"] is None and s["last"] == {"age_s": 720.0, "on": True, "acceptance_rate": 0.4, "requests": 3}
    assert s["why"] == ("last request 12 min ago: speculation was on (5 of 9 steps drafted), acceptance 0.400 "
                        "(3 requests in the 5 min up to it)")
    plain = HistoryRow(workload="prose", version=1, ts=1000.0, requests=1, num_steps=7)
    p = speculation_state([], empty, last_ts=1000.0, now=1030.0, last=plain)
    assert p["last"]["on"] is False and p["why"] == "last request 30 s ago: speculation was off (all 7 steps plain) (1 request in the 5 min up to it)"


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
    acc, spec = acceptance_sections(h, adapter, now, warnings)
    assert len(acc) == len(spec) == STATUS_WORKLOADS == 50
    assert {f"w{i:03d}" for i in range(100, 120)} <= set(acc)  # the busiest are shown
    assert len(warnings) == 1 and warnings[0].startswith("70 more workloads")


def test_a_workload_with_its_own_adapter_is_credited_to_it(redis_client, key_prefix):
    """After a demo with one adapter per workload, `status` credited every workload to the shared
    adapter: the history names rows "workload@bucket" and the lookup of the workload's own adapter
    used the whole name. Prose (its own v3 since t0, none before: the shared v1 served it) and code
    (no own adapter: the shared v1) are read back with hand-computed rates."""
    from daemon.reports import acceptance_sections
    from store.config import StoreConfig
    from store.history import AcceptanceHistory

    import time as _time

    h = AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix))
    first = _time.time() - 3600.0  # inside the history's retention
    t0 = h.bucket_of(first) * h.bucket_s + 3 * h.bucket_s  # v3's promotion, three buckets later
    h.record("prose@greedy", 1, {"requests": 4, "num_steps": 10, "num_draft_tokens": 40, "num_accepted_tokens": 10}, ts=first)
    h.record("prose@greedy", 3, {"requests": 2, "num_steps": 5, "num_draft_tokens": 20, "num_accepted_tokens": 15}, ts=t0 + 1)
    h.record("code@greedy", 1, {"requests": 3, "num_steps": 6, "num_draft_tokens": 30, "num_accepted_tokens": 6}, ts=t0 + 1)
    adapter = {"active": 1, "since": None, "previous": None,
               "workloads": {"prose": {"active": 3, "since": t0, "previous": 0, "reason": "gain", "how": "promote"}}}
    acc, _ = acceptance_sections(h, adapter, t0 + 2)
    prose, code = acc["prose@greedy"], acc["code@greedy"]
    assert prose["now"]["version"] == 3 and prose["now"]["requests"] == 2
    assert prose["now"]["acceptance_rate"] == 15 / 20
    assert prose["previous"]["version"] == 1 and prose["previous"]["acceptance_rate"] == 10 / 40
    assert code["now"]["version"] == 1 and code["now"]["acceptance_rate"] == 6 / 30 and code["previous"] is None


def test_a_workloads_first_own_version_names_the_shared_adapter_before_it():
    from daemon.cli import _activated

    first = {"active": 3, "since": None, "previous": 0, "reason": "held-out gain", "how": "promote"}
    assert _activated(first, " (its own)") == "v3 (its own) active, promoted: held-out gain (before it: the shared adapter)"
    assert _activated({**first, "previous": 2}, " (its own)").endswith("(previous v2)")


def test_a_workload_whose_own_adapter_was_rolled_back_is_served_and_compared_as_such(redis_client, key_prefix, tmp_path):
    """extract had its own v2; it was rolled back, so the shared v1 serves extract again. Status
    said 'previous v0' (the shared scope's) and dropped the workload from the adapter section; it
    now shows that extract has none of its own since the rollback, and compares the shared v1's
    requests on extract with v2's."""
    import time as _time

    from daemon.cli import _activated
    from daemon.reports import acceptance_sections, adapter_section
    from helpers import make_adapter_dir
    from store.config import StoreConfig
    from store.history import AcceptanceHistory
    from store.registry import AdapterMeta, AdapterRegistry

    cfg = StoreConfig(key_prefix=key_prefix)
    reg = AdapterRegistry(redis_client, tmp_path / "art", cfg)
    v1 = reg.register(make_adapter_dir(tmp_path / "a1", 1), AdapterMeta(parent=0))
    reg.promote(v1, "shared")
    v2 = reg.register(make_adapter_dir(tmp_path / "a2", 2), AdapterMeta(parent=v1, scope="extract"))
    reg.promote(v2, "extract's own")
    reg.rollback("live acceptance fell", scope="extract")
    a = adapter_section(reg)
    ex = a["workloads"]["extract"]
    assert (ex["active"], ex["previous"], ex["how"]) == (0, v2, "rollback")
    assert _activated(ex, " (its own)").startswith("none of its own since ")
    assert f"v{v2} was rolled back: live acceptance fell; the shared adapter serves it" in _activated(ex, " (its own)")
    h = AcceptanceHistory(redis_client, cfg)
    before = ex["since"] - 3 * h.bucket_s
    h.record("extract@greedy", v2, {"requests": 3, "num_steps": 6, "num_draft_tokens": 30, "num_accepted_tokens": 3}, ts=before)
    h.record("extract@greedy", v1, {"requests": 2, "num_steps": 4, "num_draft_tokens": 20, "num_accepted_tokens": 10},
             ts=ex["since"] + 1)
    acc, _ = acceptance_sections(h, a, _time.time())
    row = acc["extract@greedy"]
    assert row["now"]["version"] == v1 and row["now"]["acceptance_rate"] == 10 / 20
    assert row["previous"]["version"] == v2 and row["previous"]["acceptance_rate"] == 3 / 30


def test_a_servers_redis_outage_stays_in_status_after_redis_is_back():
    """A break session: once Redis was back, `daemonctl status` said nothing of the outage (only
    serve's own /draftd/status kept its last error). Each serve heartbeat's record writer stats now
    give a warning: Redis down now (for how long), or the last outage (when, how long, how long
    ago), the records it dropped (the trainer never sees them) and the last error; none for a
    writer that never lost Redis."""
    import datetime as dt

    t0 = 1_700_000_000.0
    clock = dt.datetime.fromtimestamp(t0).strftime("%H:%M:%S")
    past = {"server_id": "s1", "buffer": {"written": 180, "dropped": 12, "dropped_redis_down": 12, "errors": 5,
                                          "outages": 1, "down_since": None, "last_outage": [t0, t0 + 42.4],
                                          "last_error": "ConnectionError: refused", "last_error_at": t0 + 40}}
    now_down = {"server_id": "s2", "buffer": {"written": 3, "dropped": 0, "dropped_redis_down": 0, "errors": 2,
                                              "outages": 1, "down_since": t0, "last_outage": None,
                                              "last_error": "ConnectionError: refused", "last_error_at": t0 + 1}}
    fine = {"server_id": "s3", "buffer": {"written": 9, "dropped": 0, "outages": 0, "down_since": None}}
    warns = buffer_warnings([past, now_down, fine, {"server_id": "s4"}], now=t0 + 100)
    assert warns[0] == (f"serve s1: its record writer lost Redis 1 time, last at {clock} for 42 s (back 58 s ago); "
                        f"12 records dropped (12 while Redis was down, the oldest first; the trainer never sees them), "
                        f"180 written; last error at {dt.datetime.fromtimestamp(t0 + 40).strftime('%H:%M:%S')}: "
                        f"ConnectionError: refused")
    assert warns[1].startswith("serve s2: its record writer cannot reach Redis for 100 s (records queue in memory "
                               "meanwhile); 0 records dropped"), warns[1]
    assert len(warns) == 2


def test_buffer_warnings_read_a_serves_times_on_its_own_clock_and_an_older_serves_heartbeat():
    """A break session: a serve whose clock ran ahead of the status host's read "cannot reach Redis
    for -20 s" and "back -5 s ago"; an older serve's buffer stats (no dropped_redis_down) read "(0
    while Redis was down ...)", a count it never gave; a heartbeat whose ``buffer`` was not an
    object failed the whole status. The writer's times now count on the serve's clock up to its
    heartbeat's ``ts``, then the heartbeat's age here, never below 0."""
    now = 1_700_000_000.0
    ahead = 20.0  # the serve's clock runs ahead of this host's
    down = {"server_id": "s1", "ts": now + ahead - 2, "buffer": {"written": 3, "dropped": 0, "dropped_redis_down": 0,
                                                                 "outages": 1, "down_since": now + ahead - 12}}
    back = {"server_id": "s2", "ts": now + ahead - 2, "buffer": {"written": 3, "dropped": 0, "dropped_redis_down": 0,
                                                                 "outages": 1, "down_since": None,
                                                                 "last_outage": [now + ahead - 30, now + ahead - 7]}}
    old = {"server_id": "s3", "buffer": {"written": 9, "queued": 0, "redis_up": True, "dropped": 4, "last_error": "x"}}
    odd = {"server_id": "s4", "buffer": "not an object"}
    warns = buffer_warnings([down, back, old, odd], now)
    assert warns[0].startswith("serve s1: its record writer cannot reach Redis for 10 s (records"), warns[0]
    assert " for 23 s (back 5 s ago); 0 records dropped (0 while Redis was down" in warns[1], warns[1]
    assert warns[2] == ("serve s3: its record writer wrote every record it could; 4 records dropped (the trainer "
                        "never sees them), 9 written"), warns[2]
    assert len(warns) == 3
