"""docker-compose.yml: Redis >= 7 with persistence, the daemon, an example decoder, healthchecks;
every DRAFTD_ variable names a settings field and its value validates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from daemon.settings import Settings, env_keys, load_settings

yaml = pytest.importorskip("yaml")
COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def test_compose_services_env_keys_and_healthchecks(monkeypatch):
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert {"redis", "daemon", "decoder"} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc and svc["healthcheck"]["test"], name
    redis = services["redis"]
    major = int(re.match(r"redis:(\d+)", redis["image"]).group(1))
    assert major >= 7
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])

    known = env_keys()
    for name in ("daemon", "decoder"):
        env = services[name]["environment"]
        draftd = {k: str(v) for k, v in env.items() if k.startswith("DRAFTD_")}
        assert draftd, name
        unknown = sorted(set(draftd) - known)
        assert not unknown, f"{name}: {unknown} are not settings fields"
        for k in list(__import__("os").environ):
            if k.startswith("DRAFTD_"):
                monkeypatch.delenv(k)
        for k, v in draftd.items():
            monkeypatch.setenv(k, "compose-token" if v.startswith("${") else v)
        s = load_settings()
        assert s.redis.url == "redis://redis:6379/0" and s.redis.embedded == "never"
    assert services["daemon"]["ports"] == ["127.0.0.1:8787:8787"]
    dec = services["decoder"]
    assert dec["command"] == ["daemonctl", "serve"]  # the inference service beside the daemon and Redis
    port = dec["environment"]["DRAFTD_SERVE__PORT"]
    assert dec["ports"] == [f"127.0.0.1:{port}:{port}"] and dec["environment"]["DRAFTD_SERVE__HOST"] == "0.0.0.0"
    assert f"127.0.0.1:{port}/health" in " ".join(dec["healthcheck"]["test"])  # /health is open with an API key
    assert dec["environment"]["DRAFTD_SERVE__API_KEY"].startswith("${DRAFTD_SERVE_API_KEY:?")  # issue 37 item 1


def test_env_keys_cover_every_field():
    keys = env_keys()
    assert {"DRAFTD_REDIS__URL", "DRAFTD_API__TOKEN", "DRAFTD_STATE_DIR", "DRAFTD_TRAINER__INTERVAL_S", "DRAFTD_CONFIG"} <= keys
    n_fields = sum(len(f.annotation.model_fields) if hasattr(f.annotation, "model_fields") else 1 for f in Settings.model_fields.values())
    assert len(keys) == n_fields + 1
    for name, f in Settings.model_fields.items():  # every field documented
        assert f.description, name
        if hasattr(f.annotation, "model_fields"):
            for sub, sf in f.annotation.model_fields.items():
                assert sf.description, f"{name}.{sub}"
