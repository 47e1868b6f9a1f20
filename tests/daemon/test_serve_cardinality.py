"""Issue 37 item 4: clients cannot grow the server's state without bound. Past serve.max_workloads
distinct workloads (serve.max_sampling_buckets sampling buckets) requests are served under 'other',
counted (draftd:folded_requests) and warned about in `daemonctl status`; /metrics, the controller's
keys, the heartbeat and the Redis history stay bounded."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from serve_helpers import MODEL, serving


def post(s, body: dict) -> dict:
    req = urllib.request.Request(s.base_url + "/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def metrics(s) -> str:
    with urllib.request.urlopen(s.base_url.rsplit("/v1", 1)[0] + "/metrics", timeout=30) as r:
        return r.read().decode()


def test_new_workloads_and_buckets_past_the_bound_fold_into_other(redis_client, key_prefix):
    from daemon.reports import folding_warnings
    from store.heartbeat import read_heartbeats

    with serving(redis_client, key_prefix, max_workloads=4, max_sampling_buckets=3, heartbeat_s=0.2) as s:
        small = len(metrics(s))
        seen = []
        for i in range(40):  # 40 new workloads, 40 new sampling buckets (temperature x top_k)
            r = post(s, {"model": MODEL, "prompt": "ab", "max_tokens": 2, "workload": f"w{i}",
                         "temperature": 0.5 + (i % 10) / 10, "top_k": 2 + i, "seed": i})
            seen.append((r["draftd"]["workload"], r["draftd"]["sampling"]))
        assert [w for w, _ in seen[:4]] == ["w0", "w1", "w2", "w3"]
        assert {w for w, _ in seen[4:]} == {"other"}
        assert {b for _, b in seen[3:]} == {"other"} and len({b for _, b in seen[:3]}) == 3
        assert post(s, {"model": MODEL, "prompt": "ab", "max_tokens": 2, "workload": "w1"})["draftd"]["workload"] == "w1"
        assert post(s, {"model": MODEL, "prompt": "ab", "max_tokens": 2})["draftd"]["workload"] == "default"
        card = s.service.status()["cardinality"]
        assert card["workload"] == {"distinct": 4, "limit": 4, "folded_requests": 36, "folded_values": 36}
        assert card["sampling_bucket"]["folded_requests"] == 37 + 2  # the last two: temperature 1, a 4th bucket
        text = metrics(s)
        labels = {ln.split('workload="', 1)[1].split('"', 1)[0] for ln in text.splitlines() if 'workload="' in ln}
        assert labels <= {"w0", "w1", "w2", "w3", "default", "other"}, labels
        assert 'draftd:folded_requests{key="workload"} 36.0' in text
        assert len(text) < 4 * small + 200_000
        keys = s.loop.status()["speculation"]
        assert len(keys) <= (4 + 2) * (3 + 2), keys.keys()  # workloads (+ default, other) x buckets (+ greedy, other)
        time.sleep(0.5)
        hbs = [hb for hb in read_heartbeats(redis_client, s.store_config) if hb["server_id"] == s.service.server_id]
        assert hbs and hbs[0]["cardinality"]["workload"]["folded_requests"] == 36
        warns = folding_warnings(hbs)
        assert len(warns) == 2 and "serve.max_workloads=4" in warns[0] and "'other'" in warns[0]
        hist = [k for k in redis_client.scan_iter(f"{key_prefix}hist:*", count=1000)]
        keys = {k.decode().rsplit(":", 1)[1] for k in hist if k.count(b":") >= 3 and b"index" not in k and b"applied" not in k}
        assert keys and len(keys) <= 6 * 5, keys  # "{workload}@{bucket}"
        assert {k.split("@")[0] for k in keys} <= {"w0", "w1", "w2", "w3", "default", "other"}, keys
