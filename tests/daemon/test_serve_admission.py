"""Issue 37 item 2: admission control. A prompt longer than serve.max_prompt_tokens is a 400 (one
far too long is refused before it is tokenised); a request past serve.request_timeout_s is a 408
(streaming: an error event) and is cancelled; requests are parsed and tokenised off the event loop,
so /health answers while a slow one is tokenised."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import MODEL, Blocker, serving  # noqa: E402


def post(s, path: str, body: dict, timeout: float = 60) -> tuple[int, dict, float]:
    req = urllib.request.Request(s.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - t0


def test_a_prompt_past_max_prompt_tokens_is_a_400_naming_the_limit(redis_client, key_prefix):
    with serving(redis_client, key_prefix, max_prompt_tokens=20) as s:
        code, body, _ = post(s, "/completions", {"model": MODEL, "prompt": "x" * 21, "max_tokens": 2})
        assert code == 400 and body["error"]["code"] == "prompt_too_long" and body["error"]["param"] == "prompt", body
        assert "21 tokens" in body["error"]["message"] and "serve.max_prompt_tokens" in body["error"]["message"]
        code, body, _ = post(s, "/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "y" * 30}]})
        assert code == 400 and body["error"]["param"] == "messages" and body["error"]["code"] == "prompt_too_long"
        assert post(s, "/completions", {"model": MODEL, "prompt": "x" * 20, "max_tokens": 2})[0] == 200
        # a megabyte of text cannot fit in 20 tokens of at most 5 characters: refused untokenised
        s.service.tokenizer = None  # would fail if called
        code, body, _ = post(s, "/completions", {"model": MODEL, "prompt": "x" * (1 << 20), "max_tokens": 2})
        assert code == 400 and body["error"]["code"] == "prompt_too_long" and "characters" in body["error"]["message"]


def test_tokenising_runs_off_the_event_loop(redis_client, key_prefix):
    with serving(redis_client, key_prefix) as s:
        real = s.service.parse

        def slow_parse(*a, **kw):  # a 1 MB prompt's tokenising, as the probe measured it
            time.sleep(2.0)
            return real(*a, **kw)

        s.service.parse = slow_parse
        t = threading.Thread(target=post, args=(s, "/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}))
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with urllib.request.urlopen(s.base_url.rsplit("/v1", 1)[0] + "/health", timeout=30) as r:
            assert r.status == 200
        assert time.monotonic() - t0 < 1.0, "the event loop was blocked by a request being parsed"
        t.join(30)


def test_a_request_past_its_time_budget_is_a_408_and_is_cancelled(redis_client, key_prefix):
    with serving(redis_client, key_prefix, request_timeout_s=1.0) as s:
        block = Blocker()
        s.loop.decoder.between_requests.append(block)
        out: dict[str, tuple] = {}
        first = threading.Thread(target=lambda: out.__setitem__("running", post(s, "/completions",
                                 {"model": MODEL, "prompt": "a", "max_tokens": 4})))
        first.start()
        assert block.entered.wait(60)  # the first one holds the decoder
        code, body, took = post(s, "/completions", {"model": MODEL, "prompt": "b", "max_tokens": 4})
        assert code == 408 and body["error"]["code"] == "request_timeout", body
        assert "while queued" in body["error"]["message"] and "serve.request_timeout_s" in body["error"]["message"]
        assert 0.9 < took < 5
        oc = s.openai()
        with pytest.raises(openai.APIError, match="time budget of 1 s"):  # streamed: the error event, as OpenAI's client reads it
            list(oc.completions.create(model=MODEL, prompt="c", max_tokens=4, stream=True))
        first.join(10)
        code, body, _ = out["running"]
        assert code == 408 and "while decoding" in body["error"]["message"], body
        block.release.set()
        deadline = time.time() + 30
        while s.loop.queue_depth or s.loop.busy:
            assert time.time() < deadline
            time.sleep(0.05)
        st = s.loop.status()
        assert st["requests_cancelled"] >= 2, st  # dropped from the queue / stopped at their next step
        s.loop.decoder.between_requests.remove(block)
        assert post(s, "/completions", {"model": MODEL, "prompt": "d", "max_tokens": 2})[0] == 200


def test_a_streamed_request_past_its_budget_ends_with_a_timeout_event(redis_client, key_prefix):
    with serving(redis_client, key_prefix, request_timeout_s=1.0) as s:
        block = Blocker()
        s.loop.decoder.between_requests.append(block)
        req = urllib.request.Request(s.base_url + "/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 4, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        block.release.set()
        s.loop.decoder.between_requests.remove(block)
        datas = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
        assert datas[-1] == "[DONE]"
        assert json.loads(datas[-2])["error"]["code"] == "request_timeout"


def test_a_timed_out_prefill_stops_at_the_next_chunk(redis_client, key_prefix, monkeypatch):
    """The 408 of a request whose prompt is still being prefilled frees the decoder at the next
    prefill chunk, not at the end of the prompt (the probe: 137 s of prefill nobody could stop)."""
    import decoder.speculative as spec

    monkeypatch.setattr(spec, "PREFILL_CHUNK", 16)
    with serving(redis_client, key_prefix, request_timeout_s=1.0) as s:
        dec = s.loop.decoder
        real = dec._target_logits
        chunks = []

        def slow(tokens, seq, keep):  # 0.2 s a chunk: 25 chunks = 5 s of prefill
            chunks.append(len(tokens))
            time.sleep(0.2)
            return real(tokens, seq, keep)

        monkeypatch.setattr(dec, "_target_logits", slow)
        code, body, took = post(s, "/completions", {"model": MODEL, "prompt": "x" * 401, "max_tokens": 2})
        assert code == 408 and "while decoding" in body["error"]["message"], body
        deadline = time.time() + 3
        while s.loop.busy:
            assert time.time() < deadline, f"the prefill ran on: {len(chunks)} chunks"
            time.sleep(0.02)
        assert len(chunks) < 12, chunks  # stopped after ~1 s of 5
        assert s.loop.status()["requests_cancelled"] == 1
