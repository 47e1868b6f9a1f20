"""The control API's bearer token is never empty: an emptied ``<state_dir>/api-token`` was read as
the token "" (the CLI, sending none, got 401, while ``Authorization: Bearer `` was let through);
it is now written again with a new token, and an empty ``DRAFTD_API__TOKEN`` is a settings error."""

from __future__ import annotations

import os
import stat

import pytest
from fastapi.testclient import TestClient
from structlog.testing import capture_logs

from conftest import REDIS_URL
from daemon.api import create_app
from daemon.app import Daemon
from daemon.settings import ConfigError, load_settings


def _settings(tmp_path, key_prefix, monkeypatch, **api):
    for k in [k for k in os.environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)
    return load_settings(state_dir=tmp_path / "state", redis={"url": REDIS_URL}, store={"key_prefix": key_prefix},
                         models={"enabled": False}, api={"enabled": False, **api})


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_token_file_is_written_again_and_said_so(tmp_path, key_prefix, monkeypatch, content):
    s = _settings(tmp_path, key_prefix, monkeypatch)
    s.token_file.parent.mkdir(parents=True)
    s.token_file.write_text(content)
    d = Daemon(s)
    with capture_logs() as logs, d.started():
        client = TestClient(create_app(d))
        assert len(d.token) >= 32 and s.token_file.read_text().strip() == d.token
        assert stat.S_IMODE(os.stat(s.token_file).st_mode) == 0o600
        url = "/v1/adapters/77/promote"  # authenticated, it reaches the registry: 404, no such version
        assert client.post(url, headers={"Authorization": "Bearer "}).status_code == 401
        assert client.post(url).status_code == 401
        assert client.post(url, headers={"Authorization": f"Bearer {d.token}"}).status_code == 404
    assert any(e["event"] == "api_token_file_empty" and e["path"] == str(s.token_file) for e in logs), logs


def test_a_daemon_whose_token_is_empty_refuses_every_mutation(tmp_path, key_prefix, monkeypatch):
    """The middleware's own guard: an empty expected token matches no credentials, "" included.
    (The middleware authenticates before the body is read: with ``Bearer `` let through, a malformed
    body got 422 from validation instead of 401.)"""
    d = Daemon(_settings(tmp_path, key_prefix, monkeypatch))
    with d.started():
        d.token = ""
        client = TestClient(create_app(d))
        for headers in ({"Authorization": "Bearer "}, {"Authorization": "Bearer"}, {}):
            r = client.post("/v1/rollback", content=b"{not json", headers={**headers, "Content-Type": "application/json"})
            assert r.status_code == 401, (headers, r.text)


@pytest.mark.parametrize("value, needle", [("", "api.token is empty"), ("   ", "api.token is empty"),
                                          (" abc", "api.token has leading or trailing spaces")])
def test_an_unusable_configured_token_is_a_settings_error(monkeypatch, tmp_path, value, needle):
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_API__TOKEN", value)
    with pytest.raises(ConfigError) as e:
        load_settings()
    text = " ".join(str(e.value).split())
    assert needle in text and "DRAFTD_API__TOKEN" in text, text


def test_a_configured_token_is_used_as_given(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_API__TOKEN", "s3cret-token")
    assert load_settings().api.token.get_secret_value() == "s3cret-token"
