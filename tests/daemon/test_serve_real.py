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

from conftest import DAEMONCTL, REDIS_URL, REPO, base_env, ctl, free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow


def test_serve_greedy_equals_generate_no_spec_and_sigterm_drains(tmp_path, key_prefix):
    port = free_port()
    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix,
                   DRAFTD_SERVE__HEARTBEAT_S="0.5")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([DAEMONCTL, "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(proc, port, lambda: (tmp_path / "serve.log").read_text()[-3000:])
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


# a decoder that sees a cancel late: the walkthrough's SIGTERM came during a long prompt's prefill,
# whose current 512-token chunk ran on for seconds after the drain grace cancelled it
LATE_CANCEL = """
import sys, time
import decoder.speculative as sp
def slow_to_stop(real):  # batch 1 (generate) and continuous batching (generate_batched) alike
    def generate(self, req, policy=None, on_step=None):
        if on_step is None:
            return real(self, req, policy)
        def late(ids):
            go_on = on_step(ids)
            if go_on is False:
                time.sleep(8.0)  # longer than uvicorn's graceful shutdown (5 s)
            return go_on
        return real(self, req, policy, on_step=late)
    return generate
sp.SpeculativeDecoder.generate = slow_to_stop(sp.SpeculativeDecoder.generate)
sp.SpeculativeDecoder.generate_batched = slow_to_stop(sp.SpeculativeDecoder.generate_batched)
from daemon.cli import app
sys.argv = ["daemonctl", "serve", "--port", sys.argv[1]]
app()
"""


@pytest.mark.parametrize("late_cancel", [False, True], ids=["prompt-cancel", "late-cancel"])
def test_sigterm_during_a_long_non_streamed_request_drains_within_the_grace_and_exits_cleanly(tmp_path, key_prefix,
                                                                                              late_cancel):
    """SIGTERM while a long non-streamed request decodes: the request gets serve.drain_grace_s, is then
    cancelled, its client is answered with a 503 naming the setting (at once when the decoder is
    slow to stop), never a 500 nor its partial text as a completion, and serve exits 0 without a traceback. It took 35 s
    and printed uvicorn's ASGI CancelledError traceback: the handler waited for the decoder past
    uvicorn's 5 s graceful shutdown, which cancelled it."""
    import sys
    import threading

    grace = 2.0
    port = free_port()
    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix,
                   DRAFTD_SERVE__DRAIN_GRACE_S=str(grace), DRAFTD_SERVE__HEARTBEAT_S="0.5")
    cmd = [sys.executable, "-c", LATE_CANCEL, str(port)] if late_cancel else [DAEMONCTL, "serve", "--port", str(port)]
    out_path, err_path = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=REPO)
    logs = lambda: out_path.read_text()[-3000:] + err_path.read_text()[-3000:]  # noqa: E731
    try:
        wait_healthy(proc, port, logs)
        deadline = time.monotonic() + 300
        oc = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        got: dict = {}

        def long_request():
            try:
                got["r"] = oc.completions.create(model="smollm2-135m", prompt="def fibonacci(n):", max_tokens=4000,
                                                 temperature=0, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                got["e"] = e

        client = threading.Thread(target=long_request)
        client.start()
        while not json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/draftd/status", timeout=10).read())["decoding"]:
            assert time.monotonic() < deadline and client.is_alive(), logs()
            time.sleep(0.1)
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        took = time.monotonic() - sent
        client.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = out_path.read_text() + err_path.read_text()
    assert rc == 0, logs()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, logs()
    # the grace, the decoder's late stop (8 s when late), model and Redis teardown; was grace + 5 s + a traceback
    assert took < grace + (8 if late_cancel else 0) + 12, (took, logs())
    assert "r" not in got, got  # a cancelled request's partial text is never a completion (it was a 200, 'abort')
    e = got["e"]
    assert e.status_code == 503 and e.body["code"] == "draining" and "serve.drain_grace_s" in e.body["message"], e
    if late_cancel:
        assert "e" in got, got  # answered at the grace, not after the decoder's late stop
