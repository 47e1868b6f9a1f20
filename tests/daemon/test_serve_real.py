"""`daemonctl serve` as a user runs it, with the real packaged model (SmolLM2-135M): greedy
served text equals `daemonctl generate --no-spec` on the weight format serve chose (models.format);
SIGTERM drains and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from conftest import DAEMONCTL, REDIS_URL, REPO, base_env, ctl, free_port  # noqa: E402

pytestmark = pytest.mark.slow


def test_serve_greedy_equals_generate_no_spec_and_sigterm_drains(tmp_path, key_prefix):
    port = free_port()
    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix,
                   DRAFTD_SERVE__HEARTBEAT_S="0.5")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([DAEMONCTL, "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "serve did not answer /health"
                time.sleep(0.5)
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        prompt = "def fibonacci(n):"
        r = oc.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0)
        c = oc.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Name a color."}],
                                       max_tokens=12, temperature=0)
        s = "".join(ch.choices[0].text for ch in oc.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16,
                                                                       temperature=0, stream=True))
        # plain decoding of the format serve chose (models.format=auto: measured on this host, cached)
        served = json.loads(ctl(env, "status", "--json").stdout)["serving"][0]["served_format"]
        assert served["setting"] == "auto" and served["format"] and served["reason"], served
        fmt = ["--format", served["format"]]
        g = ctl(env, "generate", "-p", prompt, "--no-spec", "--max-new-tokens", "16", "--json", *fmt, timeout=300)
        assert g.returncode == 0, g.stderr
        assert json.loads(g.stdout)["served_format"] == served["format"]
        gc = ctl(env, "generate", "-p", "Name a color.", "--chat", "--no-spec", "--max-new-tokens", "12", "--json", *fmt,
                 timeout=300)
        assert gc.returncode == 0, gc.stderr
        assert r.choices[0].text == s == json.loads(g.stdout)["text"]
        assert c.choices[0].message.content == json.loads(gc.stdout)["text"]
        st = json.loads(ctl(env, "status", "--json").stdout)
        assert any(h["requests_served"] >= 1 for h in st.get("serving", []))
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    assert rc == 0, (tmp_path / "serve.log").read_text()[-3000:]
    st = json.loads(ctl(env, "status", "--json").stdout)
    assert st.get("serving") == []  # the heartbeat is removed on a clean exit
