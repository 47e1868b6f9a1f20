"""The control API answers bad query/path input with 4xx naming the parameter, never 500."""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient

from conftest import REDIS_URL
from daemon.api import create_app
from daemon.app import Daemon
from daemon.settings import load_settings


def _daemon(tmp_path, key_prefix, monkeypatch) -> Daemon:
    """A daemon on the shared Redis under ``key_prefix``, without models or its own API server."""
    for k in [k for k in os.environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)
    s = load_settings(state_dir=tmp_path / "state", redis={"url": REDIS_URL}, store={"key_prefix": key_prefix},
                      models={"enabled": False}, api={"enabled": False})
    return Daemon(s)


@pytest.fixture
def api(tmp_path, key_prefix, monkeypatch):
    d = _daemon(tmp_path, key_prefix, monkeypatch)
    with d.started():
        yield TestClient(create_app(d)), d.token


@pytest.mark.parametrize("since", ["nan", "inf", "-inf", "abc"])
def test_history_since_must_be_a_finite_number(api, since):
    client, _ = api
    r = client.get("/v1/history", params={"since": since})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["query", "since"]


def test_history_since_finite_ok(api):
    client, _ = api
    assert client.get("/v1/history", params={"since": "0"}).status_code == 200


def test_promote_bad_versions(api):
    client, token = api
    h = {"Authorization": f"Bearer {token}"}
    assert client.post("/v1/adapters/abc/promote", headers=h).status_code == 422
    r = client.post("/v1/adapters/77/promote", headers=h)
    assert r.status_code == 404 and "v77" in r.json()["detail"]
    assert client.post("/v1/adapters/77/promote").status_code == 401



def test_metrics_export_at_most_64_workloads_the_rest_summed_as_other(tmp_path, key_prefix, monkeypatch):
    """Issue 37 item 4: the daemon's /metrics exports a label per workload of the acceptance
    history; with 100 invented names, the 63 busiest keep theirs and the rest are summed."""
    import re

    from daemon.metrics import METRICS_WORKLOADS

    d = _daemon(tmp_path, key_prefix, monkeypatch)
    with d.started():
        for i in range(100):
            d.history.record(f"w{i:03d}", 0, {"requests": 1 + (i < 10) * 100, "num_steps": 1})
        text = TestClient(create_app(d)).get("/metrics").text
    labels = set(re.findall(r'draftd:history_requests\{workload="([^"]+)"\}', text))
    assert len(labels) == METRICS_WORKLOADS == 64 and "other" in labels
    assert {f"w{i:03d}" for i in range(10)} <= labels
    total = sum(float(v) for v in re.findall(r'draftd:history_requests\{workload="[^"]+"\} (\S+)', text))
    assert total == 100 + 10 * 100
