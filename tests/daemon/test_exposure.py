"""Issue 16 item 4 (and the API side of item 2): a non-loopback bind needs api.allow_remote and is
warned about; the token is checked before a mutating request's body; every URL credential is
masked; promoting a broken adapter is a 409 that says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import save_file
from structlog.testing import capture_logs

from conftest import DAEMONCTL, REDIS_URL
from daemon.api import create_app
from daemon.app import Daemon
from daemon.settings import ConfigError, load_settings
from store.registry import AdapterMeta


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "draftd.example.com"])
def test_non_loopback_bind_is_refused_unless_allowed(host, monkeypatch):
    with pytest.raises(ConfigError, match=r"api.allow_remote = true .*DRAFTD_API__ALLOW_REMOTE"):
        load_settings(api={"host": host})
    monkeypatch.setenv("DRAFTD_API__HOST", host)
    with pytest.raises(ConfigError, match=f"api.host={host!r} is not a loopback address"):
        load_settings()
    monkeypatch.setenv("DRAFTD_API__ALLOW_REMOTE", "true")
    assert load_settings().api.remote


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_load(host):
    assert not load_settings(api={"host": host}).api.remote


def settings(tmp_path, key_prefix, **api):
    return load_settings(state_dir=tmp_path / "state", redis={"url": REDIS_URL}, store={"key_prefix": key_prefix},
                         models={"enabled": False}, api=api)


def test_an_allowed_remote_bind_is_warned_in_log_and_status(tmp_path, key_prefix):
    d = Daemon(settings(tmp_path, key_prefix, host="0.0.0.0", port=0, allow_remote=True))
    with capture_logs() as logs, d.started():
        st = d.status()
    assert any(e["event"] == "api_exposed" and e["log_level"] == "warning" and e["host"] == "0.0.0.0" for e in logs)
    assert any("0.0.0.0" in w and "open to the network" in w for w in st["warnings"]), st["warnings"]


@pytest.fixture
def api(tmp_path, key_prefix):
    d = Daemon(settings(tmp_path, key_prefix, enabled=False))
    with d.started():
        yield TestClient(create_app(d)), d


def test_token_is_checked_before_the_body(api):
    client, d = api
    bad = {"content": b"{not json", "headers": {"Content-Type": "application/json"}}
    r = client.post("/v1/rollback", **bad)
    assert r.status_code == 401 and "bearer token" in r.json()["detail"]
    assert client.post("/v1/adapters/1/promote", content=b"[1,", headers={"Content-Type": "application/json"}).status_code == 401
    r = client.post("/v1/rollback", content=b"{not json",
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {d.token}"})
    assert r.status_code == 422  # with the token, the body is validated


def test_promoting_a_broken_adapter_is_409_with_the_reason(api, tmp_path):
    client, d = api
    src = tmp_path / "nan"
    src.mkdir()
    (src / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    save_file({"lora_A.weight": np.array([[np.nan, 1.0]], np.float32)}, str(src / "adapter_model.safetensors"))
    v = d.registry.register(src, AdapterMeta())
    r = client.post(f"/v1/adapters/{v}/promote", headers={"Authorization": f"Bearer {d.token}"})
    assert r.status_code == 409 and "NaN or infinity" in r.json()["detail"], r.text
    assert d.registry.active_version() == 0 and d.status()["adapter"]["active"] == 0


def test_config_json_masks_every_url_credential(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTD_")}
    env.update(DRAFTD_STATE_DIR=str(tmp_path), DRAFTD_REDIS__DEFAULT_URL="redis://admin:hunter2@db:6379/0",
               DRAFTD_REDIS__URL="unix:///run/redis.sock?db=0&password=sesame")
    out = subprocess.run([DAEMONCTL, "config", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert "hunter2" not in out.stdout and "sesame" not in out.stdout
    assert data["redis"]["default_url"] == "redis://admin:***@db:6379/0"
    assert data["redis"]["url"] == "unix:///run/redis.sock?db=0&password=***"
