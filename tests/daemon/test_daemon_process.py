"""The real `daemonctl run` process on real Redis, driven through `daemonctl` and the HTTP API."""

from __future__ import annotations

import json
import os
import re
import stat
import urllib.request

import pytest

from conftest import REDIS_URL, base_env, ctl, free_port, http
from helpers import make_adapter_dir, make_sample
from store.buffer import SampleWriter
from store.config import StoreConfig
from store.history import AcceptanceHistory
from store.registry import AdapterMeta, AdapterRegistry
from store.schema import PairFingerprint

V0 = dict(num_drafts=10, num_draft_tokens=40, num_accepted_tokens=30, num_emitted_tokens=40, num_steps=10,
          requests=2, alpha_sum=1.5, alpha_count=2, wall_ms=2000.0)
V1 = dict(num_drafts=5, num_draft_tokens=20, num_accepted_tokens=18, num_emitted_tokens=23, num_steps=5,
          requests=1, alpha_sum=0.9, alpha_count=1, wall_ms=1000.0)


def register(redis_client, key_prefix, state_dir, tmp_path, n: int) -> AdapterRegistry:
    reg = AdapterRegistry(redis_client, state_dir / "adapters", StoreConfig(key_prefix=key_prefix))
    for i in range(n):
        v = reg.register(make_adapter_dir(tmp_path / f"src{i}", seed=i), AdapterMeta(parent=0, samples_trained=10 * (i + 1), alpha_before=0.5, alpha_after=0.6 + i / 10))
        assert v == i + 1
    return reg


def test_status_json_and_metrics_report_real_values(url_daemon, redis_client, key_prefix):
    d = url_daemon
    cfg = StoreConfig(key_prefix=key_prefix)
    pair = PairFingerprint("t", "d", "h")
    with SampleWriter(redis_client, cfg) as w:
        for i in range(5):
            assert w.submit(make_sample(pair, "prose", i, vocab=64))
        assert w.flush(10)
    AcceptanceHistory(redis_client, cfg).record("prose", 0, V0)

    r = ctl(d, "status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["healthy"] is True and st["problems"] == []
    assert st["daemon"]["up"] is True and st["daemon"]["pid"] == d.proc.pid and st["daemon"]["key_prefix"] == key_prefix
    assert st["redis"]["mode"] == "url" and st["redis"]["up"] is True
    assert st["redis"]["version"].startswith("7.") and st["redis"]["used_memory"] > 0
    assert st["buffer"]["depth"] == 5 and st["buffer"]["dead_letters"] == 0 and st["buffer"]["stream"] == key_prefix + "samples"
    assert st["trainer"]["enabled"] is False
    assert st["adapter"] == {"active": 0, "since": None, "previous": None, "reason": None, "how": None, "registered": 0, "workloads": {}}
    now = st["acceptance"]["prose"]["now"]
    assert now["version"] == 0 and now["requests"] == 2
    assert now["acceptance_rate"] == pytest.approx(30 / 40) and now["tau"] == pytest.approx(40 / 10)
    assert now["alpha"] == pytest.approx(0.75) and now["goodput_tokens_per_ms"] == pytest.approx(40 / 2000.0)
    assert st["speculation"]["prose"]["on"] is True and "10 of 10" in st["speculation"]["prose"]["why"]

    # the rich table renders the same numbers
    r = ctl(d, "status")
    assert r.returncode == 0 and "prose" in r.stdout and "0.750" in r.stdout and "Redis 7." in r.stdout

    with urllib.request.urlopen(d.url + "/metrics") as resp:
        text = resp.read().decode()
    metrics = dict(re.findall(r'^(draftd:[^ ]+) ([0-9.e+-]+)$', text, re.M))
    assert float(metrics['draftd:history_num_drafts{workload="prose"}']) == 10
    assert float(metrics['draftd:history_num_draft_tokens{workload="prose"}']) == 40
    assert float(metrics['draftd:history_num_accepted_tokens{workload="prose"}']) == 30
    assert float(metrics['draftd:history_acceptance_rate{workload="prose"}']) == pytest.approx(0.75)
    # the history's series are named apart from serve's live draftd:spec_decode_* (one Prometheus scrapes both)
    assert not [m for m in metrics if m.startswith("draftd:spec_decode_")]
    assert float(metrics["draftd:buffer_depth"]) == 5
    assert float(metrics['draftd:adapter_active_version{scope=""}']) == 0
    assert float(metrics["draftd:redis_up"]) == 1

    with urllib.request.urlopen(d.url + "/openapi.json") as resp:
        paths = json.loads(resp.read())["paths"]
    assert {"/v1/status", "/v1/history", "/v1/adapters", "/v1/adapters/{version}/promote", "/v1/rollback",
            "/v1/train-now", "/v1/pause", "/v1/resume", "/metrics"} <= set(paths)


def test_promote_rollback_round_trip(url_daemon, redis_client, key_prefix, tmp_path):
    d = url_daemon
    reg = register(redis_client, key_prefix, d.state_dir, tmp_path, 2)
    hist = AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix))
    hist.record("prose", 0, V0)

    r = ctl(d, "adapters", "promote", "1", "--reason", "test promote v1")
    assert r.returncode == 0, r.stderr
    assert "v1 active (was v0)" in r.stdout
    hist.record("prose", 1, V1)
    st = json.loads(ctl(d, "status", "--json").stdout)
    assert st["adapter"]["active"] == 1 and st["adapter"]["previous"] == 0 and st["adapter"]["reason"] == "test promote v1"
    assert st["adapter"]["how"] == "promote"
    acc = st["acceptance"]["prose"]
    assert acc["now"]["version"] == 1 and acc["now"]["acceptance_rate"] == pytest.approx(18 / 20)
    assert acc["previous"]["version"] == 0 and acc["previous"]["acceptance_rate"] == pytest.approx(30 / 40)

    assert ctl(d, "adapters", "promote", "2").returncode == 0
    assert reg.active_version() == 2
    r = ctl(d, "adapters", "rollback", "--reason", "v2 worse")
    assert r.returncode == 0 and "v1 active (rolled back v2)" in r.stdout
    assert reg.active_version() == 1 and reg.get(2).state == "rolled_back" and reg.get(2).reason == "v2 worse"
    assert ctl(d, "adapters", "rollback").returncode == 0
    assert reg.active_version() == 0
    # nothing left to roll back: refused with the registry's reason, exit 1
    r = ctl(d, "adapters", "rollback")
    assert r.returncode == 1 and "no adapter is active" in r.stderr
    # unknown version: 404 from the API
    r = ctl(d, "adapters", "promote", "99")
    assert r.returncode == 1 and "refused (404)" in r.stderr

    rows = json.loads(ctl(d, "adapters", "list", "--json").stdout)
    assert [(a["version"], a["state"], a["active"]) for a in rows] == [(1, "rolled_back", False), (2, "rolled_back", False)]
    events = [(e["event"], e["version"], e["previous"]) for e in reg.promotion_log()]
    assert events == [("promote", "1", "0"), ("promote", "2", "1"), ("rollback", "1", "2"), ("rollback", "0", "1")]

    h = json.loads(ctl(d, "history", "--json").stdout)
    v1 = next(a for a in h["adapters"] if a["version"] == 1)
    assert v1["parent"] == 0 and v1["samples_trained"] == 10 and v1["alpha_after"] == pytest.approx(0.6)
    assert v1["live"]["prose"]["acceptance_rate"] == pytest.approx(0.9) and v1["live"]["prose"]["requests"] == 1
    assert h["base_live"]["prose"]["acceptance_rate"] == pytest.approx(0.75)
    png = tmp_path / "hist.png"
    r = ctl(d, "history", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.shape[0] > 300 and img.shape[1] > 600


def test_workload_adapter_promote_status_and_rollback(url_daemon, redis_client, key_prefix, tmp_path):
    """A workload's own adapter, through the real daemon: promoted in its scope, shown in
    status (code's acceptance is judged against code's own version), listed with its scope,
    rolled back with --workload; a bad workload tag is refused with the value."""
    d = url_daemon
    reg = register(redis_client, key_prefix, d.state_dir, tmp_path, 1)
    code = reg.register(make_adapter_dir(tmp_path / "code", seed=9), AdapterMeta(parent=1, scope="code"))
    hist = AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix))
    assert ctl(d, "adapters", "promote", "1").returncode == 0
    r = ctl(d, "adapters", "promote", str(code), "--reason", "code's own")
    assert r.returncode == 0 and f"v{code} active for workload code (was v0)" in r.stdout
    assert reg.active_versions() == {"": 1, "code": code}
    hist.record("code", code, V1)
    hist.record("prose", 1, V0)
    st = json.loads(ctl(d, "status", "--json").stdout)
    assert st["adapter"]["active"] == 1 and st["adapter"]["workloads"]["code"]["active"] == code
    assert st["adapter"]["workloads"]["code"]["reason"] == "code's own"
    assert st["acceptance"]["code"]["now"]["version"] == code
    assert st["acceptance"]["code"]["now"]["acceptance_rate"] == pytest.approx(18 / 20)
    assert st["acceptance"]["prose"]["now"]["version"] == 1
    r = ctl(d, "status")
    assert r.returncode == 0 and "adapter (code)" in r.stdout and f"v{code} (its own)" in r.stdout
    rows = json.loads(ctl(d, "adapters", "list", "--json").stdout)
    assert [(a["version"], a["scope"], a["active"]) for a in rows] == [(1, "", True), (code, "code", True)]
    with urllib.request.urlopen(d.url + "/metrics") as resp:
        text = resp.read().decode()
    assert f'draftd:adapter_active_version{{scope="code"}} {float(code)}' in text

    r = ctl(d, "adapters", "rollback", "--workload", "code", "--reason", "code regressed")
    assert r.returncode == 0 and f"code: the shared adapter (rolled back v{code})" in r.stdout, r.stdout + r.stderr
    assert reg.active_versions() == {"": 1, "code": 0} and reg.get(code).reason == "code regressed"
    r = ctl(d, "adapters", "rollback", "--workload", "two words")
    assert r.returncode == 1 and "'two words'" in r.stderr and "422" in r.stderr


def test_unauthenticated_mutation_is_refused(url_daemon, redis_client, key_prefix, tmp_path):
    d = url_daemon
    reg = register(redis_client, key_prefix, d.state_dir, tmp_path, 1)
    token_file = d.state_dir / "api-token"
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600 and len(d.token) >= 32

    code, body = http("POST", d.url + "/v1/adapters/1/promote", body={"reason": "x"})
    assert code == 401 and "bearer token" in body["detail"]
    code, _ = http("POST", d.url + "/v1/adapters/1/promote", token="wrong-token", body={"reason": "x"})
    assert code == 401
    for path in ("/v1/rollback", "/v1/pause", "/v1/resume", "/v1/train-now"):
        assert http("POST", d.url + path)[0] == 401, path
    assert reg.active_version() == 0 and reg.promotion_log() == []
    # the CLI without the token file: refused, exit 4
    env = dict(d.env, DRAFTD_STATE_DIR=str(tmp_path / "elsewhere"))
    r = ctl(env, "adapters", "promote", "1")
    assert r.returncode == 4 and "401" in r.stderr
    # reads need no token; with it, the mutation goes through
    assert http("GET", d.url + "/v1/adapters")[0] == 200
    code, body = http("POST", d.url + "/v1/adapters/1/promote", token=d.token, body={"reason": "authorised"})
    assert code == 200 and body == {"active": 1, "previous": 0, "reason": "authorised", "workload": ""}
    # trainer endpoints without a trainer: 409, named
    code, body = http("POST", d.url + "/v1/train-now", token=d.token)
    assert code == 409 and "models.enabled=false" in body["detail"]


def test_status_when_daemon_is_down(tmp_path, key_prefix):

    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix)
    r = ctl(env, "status", "--json")
    assert r.returncode == 1
    st = json.loads(r.stdout)
    assert st["daemon"]["up"] is False and st["healthy"] is False
    assert st["problems"][0].startswith("daemon not running")
    assert st["redis"]["up"] is True and st["redis"]["version"].startswith("7.") and st["buffer"]["depth"] == 0
    r = ctl(env, "pause")
    assert r.returncode == 3 and "no draftd daemon answers" in r.stderr


def test_config_prints_effective_values_with_secrets_masked(tmp_path):

    toml = tmp_path / "draftd.toml"
    toml.write_text('[trainer]\ninterval_s = 42\n[api]\nport = 9999\n')
    env = base_env(tmp_path / "state", 1234, DRAFTD_API__TOKEN="sekret-token", DRAFTD_REDIS__URL="redis://:hunter2@db:6379/0",
                   DRAFTD_CONFIG=str(toml))
    r = ctl(env, "config", "--json")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["trainer"]["interval_s"] == 42 and cfg["api"]["port"] == 1234  # env beats the file
    assert cfg["api"]["token"] == "**********" and cfg["redis"]["url"] == "redis://:***@db:6379/0"
    assert "sekret" not in r.stdout and "hunter2" not in r.stdout
    r = ctl(dict(env, DRAFTD_TRAINER__INTERVAL_S="-1"), "config")
    assert r.returncode == 2 and "interval_s" in r.stderr
