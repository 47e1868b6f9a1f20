"""A non-streamed request the server cancels mid-decode is an error, never a 200 with partial text
as if complete (issue 37, admission control): shutdown past the drain grace is a 503 ``draining``.
It was a 200 whose text stopped wherever the cancellation landed, ``finish_reason: "abort"``,
which an OpenAI client reads as a finished completion (OpenAI has no such finish_reason)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("openai")

from serve_helpers import MODEL, serving  # noqa: E402


def post(s, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(s.base_url + "/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def slow_decoder(s, monkeypatch, calls: list):
    """Every target forward sleeps 50 ms, so a 400-token request decodes for ~20 s."""
    dec = s.loop.decoder
    real = dec._target_logits

    def slow(tokens, seq, keep):
        calls.append(len(tokens))
        time.sleep(0.05)
        return real(tokens, seq, keep)

    monkeypatch.setattr(dec, "_target_logits", slow)


def test_a_non_streamed_request_cancelled_by_the_drain_is_a_503_not_partial_text(redis_client, key_prefix, monkeypatch):
    with serving(redis_client, key_prefix) as s:
        calls: list = []
        slow_decoder(s, monkeypatch, calls)
        out: dict = {}
        t = threading.Thread(target=lambda: out.__setitem__("r", post(s, {
            "model": MODEL, "prompt": "abc", "max_tokens": 400, "temperature": 0, "ignore_eos": True})))
        t.start()
        deadline = time.time() + 60
        while len(calls) < 5:  # the prompt's prefill and a few decoding steps: mid-decode
            assert time.time() < deadline and t.is_alive(), out
            time.sleep(0.02)
        assert s.loop.drain(0.0) is False  # no grace: the running request is cancelled at its next step
        t.join(30)
        code, body = out["r"]
        assert code == 503, (code, body)
        assert body["error"]["code"] == "draining" and "cancelled" in body["error"]["message"], body
        assert "choices" not in body
        assert s.loop.status()["requests_cancelled"] == 1


def test_a_streamed_request_cancelled_by_the_drain_ends_with_an_error_event(redis_client, key_prefix, monkeypatch):
    """The text already streamed stays sent; the stream ends with the 503 error event (the OpenAI
    client raises it), not a final chunk whose finish_reason says the completion ended."""
    with serving(redis_client, key_prefix) as s:
        calls: list = []
        slow_decoder(s, monkeypatch, calls)
        req = urllib.request.Request(s.base_url + "/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 400, "temperature": 0,
                                                      "ignore_eos": True, "stream": True}).encode())
        got: dict = {}

        def read():
            with urllib.request.urlopen(req, timeout=60) as r:
                got["text"] = r.read().decode()

        t = threading.Thread(target=read)
        t.start()
        deadline = time.time() + 60
        while len(calls) < 5:
            assert time.time() < deadline and t.is_alive(), got
            time.sleep(0.02)
        assert s.loop.drain(0.0) is False
        t.join(30)
        datas = [ln[len("data: "):] for ln in got["text"].splitlines() if ln.startswith("data: ")]
        assert datas[-1] == "[DONE]"
        last = json.loads(datas[-2])
        assert last["error"]["code"] == "draining", last
        finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, datas[:-2]) if c.get("choices")]
        assert not any(finishes), finishes  # no chunk claimed the completion finished
