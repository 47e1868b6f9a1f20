"""Issue 37 item 1: `serve` takes an API key (--api-key / DRAFTD_SERVE__API_KEY, a bearer token as
the OpenAI client sends it; /health stays open) and refuses a non-loopback bind without one unless
serve.allow_remote, as the control API does."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from conftest import base_env, ctl, free_port  # noqa: E402
from serve_helpers import MODEL, serving  # noqa: E402

KEY = "sk-draftd-test-key"


@pytest.fixture
def clean_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)
    return monkeypatch


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "serve.example.com"])
def test_a_non_loopback_bind_without_a_key_is_refused_unless_allowed(host, clean_env):
    from daemon.settings import ConfigError, load_settings

    with pytest.raises(ConfigError) as ei:
        load_settings(serve={"host": host})
    msg = str(ei.value)
    assert f"serve.host={host!r}" in msg and "DRAFTD_SERVE__API_KEY" in msg and "DRAFTD_SERVE__ALLOW_REMOTE" in msg
    assert load_settings(serve={"host": host, "api_key": KEY}).serve.api_key.get_secret_value() == KEY
    assert load_settings(serve={"host": host, "allow_remote": True}).serve.api_key is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_a_loopback_bind_needs_no_key(host, clean_env):
    from daemon.settings import load_settings

    assert load_settings(serve={"host": host}).serve.api_key is None


def test_the_key_comes_from_the_environment_and_is_masked(clean_env):
    from daemon.settings import effective, load_settings

    clean_env.setenv("DRAFTD_SERVE__API_KEY", KEY)
    clean_env.setenv("DRAFTD_SERVE__HOST", "0.0.0.0")
    s = load_settings()
    assert s.serve.api_key.get_secret_value() == KEY and s.serve.host == "0.0.0.0"
    assert KEY not in json.dumps(effective(s)) and KEY not in repr(s)


def test_serve_host_option_without_a_key_exits_2_naming_the_fix(tmp_path):
    env = base_env(tmp_path / "state", free_port())
    out = ctl(env, "serve", "--host", "0.0.0.0", "--port", "0")
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert "is not a loopback address" in text and "--api-key" in text


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return r.status, (json.loads(body) if body[:1] in (b"{", b"[") else {})
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_keyed_server_serves_the_key_only(redis_client, key_prefix):
    from store.buffer import stream_depth

    with serving(redis_client, key_prefix, api_key=KEY) as s:
        root = s.base_url.rsplit("/v1", 1)[0]
        assert _get(root + "/health")[0] == 200  # open: load balancers and healthchecks
        ok = s.openai().completions.create(model=MODEL, prompt="hi", max_tokens=3)  # the client's api_key
        assert ok.choices[0].text is not None
        chat = s.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.choices[0].message.role == "assistant"
        deadline = time.time() + 10
        while stream_depth(redis_client, s.store_config) < 2 and time.time() < deadline:
            time.sleep(0.1)
        depth = stream_depth(redis_client, s.store_config)
        assert depth == 2
        with pytest.raises(openai.AuthenticationError) as ei:
            s.openai(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert ei.value.status_code == 401 and ei.value.body["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in ei.value.body["message"]
        with pytest.raises(openai.AuthenticationError):
            s.openai(api_key="wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        for key in ("wrong", None):
            for path in ("/v1/models", "/metrics", "/draftd/status"):
                code, body = _get(root + path, key)
                assert code == 401, (path, body)
        # a malformed body without the key is 401 (not 400): checked before the body is read
        req = urllib.request.Request(s.base_url + "/completions", data=b"{not json", method="POST")
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(req, timeout=30)
        assert he.value.code == 401
        assert _get(root + "/v1/models", KEY)[0] == 200 and _get(root + "/metrics", KEY)[0] == 200
        time.sleep(1.0)  # the writer flushes every 50 ms: an unauthenticated request left no record
        assert stream_depth(redis_client, s.store_config) == depth


def test_an_unkeyed_server_stays_open_on_loopback(redis_client, key_prefix):
    with serving(redis_client, key_prefix) as s:
        assert s.service.api_key is None
        r = s.openai(api_key="anything").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
