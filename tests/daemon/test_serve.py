"""`daemonctl serve` on tiny models: the real openai client against uvicorn on a free loopback
port, the serving loop inside, a real Redis."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import MODEL, Blocker, plain_text, serving, tiny_pair  # noqa: E402

PROMPTS = ["def add(a, b):", "the cat sat on", "x = 3 + 4 * (", "once upon a time"]


@pytest.fixture
def srv(redis_client, key_prefix):
    with serving(redis_client, key_prefix) as s:
        yield s


def test_completions_greedy_equal_plain_decoding_streamed_or_not(srv):
    target, draft = tiny_pair()
    oc = srv.openai()
    for prompt in PROMPTS:
        want, plain = plain_text(srv.tokenizer, target, draft, srv.tokenizer(prompt).input_ids, 12)
        r = oc.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == len(plain.output_ids)
        assert r.usage.prompt_tokens == len(prompt)
        assert r.choices[0].finish_reason == ("length" if plain.finish_reason == "length" else "stop")
        m = r.model_extra["draftd"]
        assert m["adapter_version"] == 0 and m["proposed_tokens"] >= m["accepted_tokens"] >= 0
        assert {"tau", "alpha", "gamma_policy", "why", "draft_ms", "verify_ms", "matches_plain"} <= set(m)
        chunks = list(oc.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
        assert chunks[-1].model_extra["draftd"]["request_id"]


def test_chat_greedy_equals_plain_decoding_of_the_chat_template(srv):
    target, draft = tiny_pair()
    oc = srv.openai()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
    ids = srv.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    want, _ = plain_text(srv.tokenizer, target, draft, list(ids), 10)
    r = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    stream = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def _target_logprobs(target, prompt_ids, output_ids):
    """(N, V) log-softmax of the target's raw logits at each output position, teacher-forced."""
    import torch

    with torch.no_grad():
        logits = target(torch.tensor([list(prompt_ids) + list(output_ids[:-1])])).logits[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.float(), -1)


def test_logprobs_are_the_targets_scores_in_chat_and_completions_streamed_or_not(srv):
    """Greedy, speculating (γ = 3): every token's logprob and its top alternatives equal the
    target's own log-softmax at that position (a teacher-forced forward here), in the completions'
    legacy shape and chat's, streamed and not; the streamed chunks carry the same values."""
    import torch

    target, draft = tiny_pair()
    oc = srv.openai()
    prompt = "the cat sat on"
    ids = srv.tokenizer(prompt).input_ids
    want_text, plain = plain_text(srv.tokenizer, target, draft, ids, 10)
    lp = _target_logprobs(target, ids, plain.output_ids)
    chosen = [lp[j, t].item() for j, t in enumerate(plain.output_ids)]
    top2 = torch.topk(lp, 2, -1)
    tok = srv.tokenizer
    r = oc.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                              extra_body={"gamma": 3})
    got = r.choices[0].logprobs
    assert r.choices[0].text == want_text
    assert got.tokens == [tok.decode([t]) for t in plain.output_ids]
    assert got.token_logprobs == pytest.approx(chosen, abs=1e-4)
    assert [list(d.values()) for d in got.top_logprobs] == [pytest.approx(v, abs=1e-4) for v in top2.values.tolist()]
    assert got.text_offset == [sum(len(s) for s in got.tokens[:j]) for j in range(len(got.tokens))]
    chunks = list(oc.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                        stream=True, extra_body={"gamma": 3}))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(chosen, abs=1e-4)
    assert [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] \
        == got.text_offset
    # chat: the chat template's prompt
    msgs = [{"role": "user", "content": "what is 2+2?"}]
    cids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    cids = list(cids["input_ids"] if hasattr(cids, "keys") else cids)
    _, cplain = plain_text(tok, target, draft, cids, 8)
    clp = _target_logprobs(target, cids, cplain.output_ids)
    cwant = [clp[j, t].item() for j, t in enumerate(cplain.output_ids)]
    c = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(cwant, abs=1e-4)
    assert [e.token for e in content] == [tok.decode([t]) for t in cplain.output_ids]
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3 for e in content)
    assert [a.logprob for e in content for a in e.top_logprobs] == \
        pytest.approx(torch.topk(clp, 3, -1).values.flatten().tolist(), abs=1e-4)
    s = list(oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                        stream=True))
    assert [e.logprob for ch in s if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content] \
        == pytest.approx(cwant, abs=1e-4)
    no = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert no.choices[0].logprobs is None


def test_stop_strings_are_cut_like_openai_and_workload_from_header(srv):
    oc = srv.openai()
    full = oc.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    cut = text[: text.find(stop)]
    r = oc.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, stop=[stop],
                              extra_body={"ignore_eos": True}, extra_headers={"X-Draftd-Workload": "code"})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.model_extra["draftd"]["workload"] == "code"
    s = oc.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, stop=stop, stream=True,
                              extra_body={"ignore_eos": True, "workload": "prose"})
    assert "".join(c.choices[0].text for c in s) == cut


def test_a_seed_reproduces_a_sampled_completion(srv):
    oc = srv.openai()
    kw = dict(model=MODEL, prompt="hello", max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"top_k": 20, "ignore_eos": True})
    a = oc.completions.create(seed=1234, **kw).choices[0].text
    b = oc.completions.create(seed=1234, **kw).choices[0].text
    c = "".join(x.choices[0].text for x in oc.completions.create(seed=1234, stream=True, **kw))
    assert a == b == c and len(a) > 0


BAD = [
    ("completion", dict(n=2), "n"),
    ("completion", dict(echo=True), "echo"),
    ("completion", dict(best_of=3), "best_of"),
    ("completion", dict(max_tokens=0), "max_tokens"),
    ("completion", dict(max_tokens=600), "max_tokens"),
    ("completion", dict(temperature=-1), "temperature"),
    ("completion", dict(top_p=0), "top_p"),
    ("completion", dict(top_p=1.5), "top_p"),
    ("completion", dict(seed="x"), "seed"),
    ("completion", dict(stop=""), "stop"),
    ("completion", dict(stop=[1, 2]), "stop"),
    ("completion", dict(frequency_penalty=0.5), "frequency_penalty"),
    ("completion", dict(presence_penalty=1), "presence_penalty"),
    ("completion", dict(logit_bias={"5": 1}), "logit_bias"),
    ("completion", dict(suffix="x"), "suffix"),
    ("completion", dict(extra_body={"top_k": -5}), "top_k"),
    ("completion", dict(extra_body={"gamma": -1}), "gamma"),
    ("completion", dict(extra_body={"gamma": 1000}), "gamma"),
    ("completion", dict(extra_body={"ignore_eos": "yes"}), "ignore_eos"),
    ("completion", dict(extra_body={"workload": "a@b"}), "workload"),
    ("completion", dict(extra_body={"beam_width": 4}), "beam_width"),
    ("completion", dict(extra_headers={"X-Draftd-Workload": "a@b"}), "X-Draftd-Workload"),
    ("completion", dict(stream_options={"include_usage": True}), "stream_options"),
    ("completion", dict(prompt=["one", "two"]), "prompt"),
    ("completion", dict(prompt=[1, 2, 999]), "prompt"),
    ("completion", dict(prompt="x" * 600), "prompt"),
    ("chat", dict(n=3), "n"),
    ("chat", dict(top_logprobs=3), "top_logprobs"),
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", dict(logprobs="yes"), "logprobs"),
    ("completion", dict(logprobs=6), "logprobs"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}), "response_format"),
    ("chat", dict(max_completion_tokens=0), "max_completion_tokens"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
]


@pytest.mark.parametrize("kind,kw,param", BAD, ids=[f"{k}-{p}-{i}" for i, (k, _, p) in enumerate(BAD)])
def test_every_bad_parameter_gets_a_400_naming_it(srv, kind, kw, param):
    oc = srv.openai()
    with pytest.raises(openai.BadRequestError) as ei:
        if kind == "completion":
            args = dict(model=MODEL, prompt="hi", max_tokens=4)
            args.update(kw)
            oc.completions.create(**args)
        else:
            args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            args.update(kw)
            oc.chat.completions.create(**args)
    e = ei.value
    assert e.status_code == 400
    err = e.body if "message" in (e.body or {}) else e.body["error"]
    assert err["param"] == param, err
    assert param.split("[")[0].split(".")[0] in err["message"] or param in err["message"]


def test_unknown_model_404_bad_json_400_and_no_500(srv):
    oc = srv.openai()
    with pytest.raises(openai.NotFoundError) as ei:
        oc.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"
    for body in (b"{not json", b"[1, 2]", b'{"model": "tiny"}', b'{"prompt": "x"}'):
        req = urllib.request.Request(srv.base_url + "/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(req, timeout=30)
        assert he.value.code == 400
        assert set(json.loads(he.value.read())["error"]) == {"message", "type", "param", "code"}
    models = oc.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_full_queue_gets_429_with_retry_after(redis_client, key_prefix):
    with serving(redis_client, key_prefix, queue_size=1) as s:
        block = Blocker()
        s.loop.decoder.between_requests.append(block)
        oc = s.openai()
        results = []
        first = threading.Thread(target=lambda: results.append(oc.completions.create(model=MODEL, prompt="a", max_tokens=2)))
        first.start()
        assert block.entered.wait(60)  # decoding (held); the queue is empty
        second = threading.Thread(target=lambda: results.append(oc.completions.create(model=MODEL, prompt="b", max_tokens=2)))
        second.start()
        while s.loop.queue_depth < 1:
            threading.Event().wait(0.01)
        with pytest.raises(openai.RateLimitError) as ei:
            oc.completions.create(model=MODEL, prompt="c", max_tokens=2)
        assert ei.value.response.headers["retry-after"] == "1"
        assert ei.value.body["code"] == "queue_full"
        block.release.set()
        first.join(60)
        second.join(60)
        assert len(results) == 2


def test_sigterm_style_drain_finishes_in_flight_and_refuses_new_with_503(redis_client, key_prefix):
    with serving(redis_client, key_prefix) as s:
        block = Blocker()
        s.loop.decoder.between_requests.append(block)
        oc = s.openai()
        results = []
        t = threading.Thread(target=lambda: results.append(oc.completions.create(model=MODEL, prompt="a", max_tokens=4)))
        t.start()
        assert block.entered.wait(60)
        drained = []
        d = threading.Thread(target=lambda: drained.append(s.loop.drain(60)))
        d.start()
        while not s.loop.draining:
            threading.Event().wait(0.01)
        with pytest.raises(openai.InternalServerError) as ei:
            oc.completions.create(model=MODEL, prompt="b", max_tokens=2)
        assert ei.value.status_code == 503 and ei.value.body["code"] == "draining"
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(f"http://127.0.0.1:{s.server.port}/health", timeout=10)
        assert he.value.code == 503
        block.release.set()
        t.join(60)
        d.join(60)
        assert drained == [True] and len(results) == 1 and results[0].choices[0].text is not None


@pytest.mark.parametrize("cut_after_s", [None, 3.0])
def test_past_the_drain_grace_waiting_clients_are_answered_at_once_streamed_or_not(redis_client, key_prefix,
                                                                                   cut_after_s):
    """What `serve` does once the drain grace is spent (service.abandon): a client still waiting for a
    decoder that has not stopped yet gets a 503 naming serve.drain_grace_s (a stream: the error
    event, then [DONE]) at once, so uvicorn's graceful shutdown never has to cancel a handler. A
    second stop signal that cut the drain short is named instead (a break session read "after the
    drain grace (serve.drain_grace_s = 30 s)" 3 s into a 30 s grace)."""
    with serving(redis_client, key_prefix) as s:
        block = Blocker()
        s.loop.decoder.between_requests.append(block)
        oc = s.openai()
        got: dict = {}

        def plain():
            try:
                oc.completions.create(model=MODEL, prompt="a", max_tokens=4)
            except openai.APIStatusError as e:
                got["plain"] = e

        def streamed():
            try:
                list(oc.completions.create(model=MODEL, prompt="b", max_tokens=4, stream=True))
            except openai.APIError as e:
                got["stream"] = e

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert block.entered.wait(60)
        while s.loop.queue_depth < 1:  # one decoding (held), one queued
            time.sleep(0.02)
        t0 = time.monotonic()
        s.service.abandon(2.0, cut_after_s)
        for t in threads:
            t.join(10)
        assert time.monotonic() - t0 < 3, "a waiting client was not answered at once"
        e = got["plain"]
        assert e.status_code == 503 and e.body["code"] == "draining", e.body
        if cut_after_s is None:
            assert "serve.drain_grace_s = 2 s" in e.body["message"]
            assert "serve.drain_grace_s" in str(got["stream"])
        else:
            assert ("cancelled when a second stop signal (SIGTERM/SIGINT) cut the drain short after 3 s, before the "
                    "drain grace ran out") in e.body["message"], e.body["message"]
            assert "drain_grace_s" not in e.body["message"]
            assert "cut the drain short after 3 s" in str(got["stream"])
        block.release.set()


def test_streaming_sends_each_verification_step_and_a_disconnect_cancels(srv, monkeypatch):
    """A chunk per verification step while the client keeps up (a client that falls behind gets
    every queued step in one chunk: on a busy host the tiny model's sub-millisecond steps can
    outrun the event loop, so each step here takes 20 ms)."""
    if not srv.loop.streams_steps:
        pytest.skip("SpeculativeDecoder.generate has no on_step hook yet: tokens arrive in one chunk at the end")
    real = srv.loop._on_step

    def paced(t, ids):
        threading.Event().wait(0.02)
        return real(t, ids)

    monkeypatch.setattr(srv.loop, "_on_step", paced)
    oc = srv.openai()
    chunks = list(oc.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0, stream=True,
                                        extra_body={"gamma": 1, "ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    steps = chunks[-1].model_extra["draftd"]["steps"]
    assert len(texts) == steps + 1 and steps > 1  # the prefill's first token, then each verification step's
    whole = oc.completions.create(model=MODEL, prompt="abc", max_tokens=24, temperature=0,
                                  extra_body={"gamma": 1, "ignore_eos": True})
    assert "".join(texts) == whole.choices[0].text
    monkeypatch.setattr(srv.loop, "_on_step", real)
    # a client that goes away after the first chunk: its request ends "cancelled" at the next step
    done = []
    srv.loop.observers.append(lambda t, res: done.append(res))
    stream = oc.completions.create(model=MODEL, prompt="abc", max_tokens=400, temperature=0, stream=True,
                                   extra_body={"gamma": 1, "ignore_eos": True})
    next(iter(stream))
    stream.close()
    while not done:
        threading.Event().wait(0.02)
    assert done[-1].finish_reason == "cancelled" and len(done[-1].output_ids) < 400


def test_a_non_streamed_request_whose_client_goes_away_is_cancelled(srv, monkeypatch):
    """A non-streamed client that times out (or disconnects) stops its request at the next step: the
    slot frees at once instead of decoding for nobody (Starlette's BaseHTTPMiddleware hid the
    disconnect from request.is_disconnected(), so it ran to max_tokens)."""
    if not srv.loop.streams_steps:
        pytest.skip("SpeculativeDecoder.generate has no on_step hook: a request cannot stop mid-way")
    real = srv.loop._on_step

    def slow(t, ids):  # 50 ms a step: 400 tokens at gamma 1 would take about 20 s
        threading.Event().wait(0.05)
        return real(t, ids)

    monkeypatch.setattr(srv.loop, "_on_step", slow)
    done = []
    srv.loop.observers.append(lambda t, res: done.append(res))
    with pytest.raises(openai.APITimeoutError):
        srv.openai(timeout=1.0).completions.create(model=MODEL, prompt="abc", max_tokens=400, temperature=0,
                                                   extra_body={"gamma": 1, "ignore_eos": True})
    gone = time.monotonic()
    while not done:
        assert time.monotonic() - gone < 10, "the request kept decoding after its client went away"
        time.sleep(0.02)
    assert done[-1].finish_reason == "cancelled" and len(done[-1].output_ids) < 400
    while srv.loop.busy:  # observers run just before the worker lets go of the ticket
        assert time.monotonic() - gone < 10
        time.sleep(0.02)
    r = srv.openai().completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0)  # the slot is free
    assert r.choices[0].finish_reason == "length"


def test_metrics_spec_decode_counters_latencies_and_queue(srv):
    oc = srv.openai()
    for w in ("prose", "code"):
        oc.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0,
                              extra_body={"gamma": 2, "workload": w, "ignore_eos": True})
    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.port}/metrics", timeout=10).read().decode()
    for name in ("draftd:spec_decode_num_drafts_total", "draftd:spec_decode_num_draft_tokens_total",
                 "draftd:spec_decode_num_accepted_tokens_total", "draftd:time_to_first_token_seconds_bucket",
                 "# TYPE draftd:inter_token_latency_seconds histogram", "draftd:e2e_request_latency_seconds_bucket",
                 "draftd:num_requests_waiting"):
        assert name in text, name
    assert 'draftd:spec_decode_num_drafts_total{adapter_version="0",workload="code"}' in text
    drafts = [line for line in text.splitlines() if line.startswith('draftd:spec_decode_num_draft_tokens_total{adapter_version="0",workload="prose"}')]
    assert drafts and float(drafts[0].split()[-1]) > 0
    per_pos = [line for line in text.splitlines() if line.startswith("draftd:spec_decode_num_accepted_tokens_per_pos_total")]
    assert all('position="' in line for line in per_pos)
    # 8 tokens a request: the first from the prefill, 7 from verification steps (what the counter
    # counts, as the acceptance history does)
    value = lambda prefix: float(next(line for line in text.splitlines() if line.startswith(prefix)).split()[-1])  # noqa: E731
    assert value('draftd:spec_decode_num_emitted_tokens_total{adapter_version="0",workload="code"}') == 7.0


def test_serve_with_a_pair_it_cannot_load_exits_2_with_the_reason(tmp_path, monkeypatch, key_prefix):
    """A bad models.target (or an engine that cannot run it) is one error line and exit 2, not a
    traceback."""
    from daemon.cli import app

    redis_url = "redis://127.0.0.1:6379/0"  # tests/daemon/conftest.py's REDIS_URL
    for k, v in {"DRAFTD_STATE_DIR": str(tmp_path), "DRAFTD_REDIS__URL": redis_url, "DRAFTD_STORE__KEY_PREFIX": key_prefix,
                 "DRAFTD_MODELS__TARGET": "/nonexistent/draftd-qa-model"}.items():
        monkeypatch.setenv(k, v)
    from serve_helpers import invoke_serve

    r = invoke_serve(app, "--port", "1")
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "error: model path '/nonexistent/draftd-qa-model' does not exist" in out and "Traceback" not in out


def test_the_server_runs_on_uvloop_and_httptools(srv, monkeypatch):
    """Serving listens on uvloop's event loop with httptools' parser (dependencies: the streamed
    chunks are written beside the next forward), and falls back to asyncio / h11 for whichever
    is missing."""
    import importlib.util

    from daemon.serve import event_loop_stack

    assert (srv.server.loop, srv.server.http) == ("uvloop", "httptools")
    listener = srv.server.server.servers[0]
    assert type(listener).__module__.startswith("uvloop")  # asyncio's is asyncio.base_events.Server
    oc = srv.openai()
    assert oc.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0).choices[0].text
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert event_loop_stack() == ("asyncio", "httptools")


def _app_logging_to(monkeypatch):
    """A FastAPI app with serve's error handlers, and the list its log calls go to: (level, event)."""
    from fastapi import FastAPI

    import daemon.serve as S

    seen = []
    monkeypatch.setattr(S, "log", type("L", (), {"info": lambda self, ev, **kw: seen.append(("info", ev)),
                                                 "exception": lambda self, ev, **kw: seen.append(("exception", ev))})())
    app = FastAPI()
    S._add_error_handlers(app)
    return seen, app


def test_a_client_that_leaves_mid_body_is_logged_once_at_info_not_as_an_internal_error(monkeypatch):
    """Starlette raises ClientDisconnect where a client closes before its body is read (the
    adversarial check: Content-Length 1000, 10 bytes, close): it was logged as
    serve_internal_error with a traceback, a log any client could flood."""
    from fastapi.testclient import TestClient
    from starlette.requests import ClientDisconnect

    seen, app = _app_logging_to(monkeypatch)

    @app.get("/gone")
    def gone():
        raise ClientDisconnect()

    @app.get("/boom")
    def boom():
        raise RuntimeError("x")

    c = TestClient(app, raise_server_exceptions=False)
    r = c.get("/gone")
    assert r.status_code == 400 and r.json()["error"]["code"] == "client_disconnected"
    assert c.get("/boom").status_code == 500
    assert seen == [("info", "serve_client_left_mid_body"), ("exception", "serve_internal_error")]


def test_an_internal_error_is_answered_once_and_goes_no_further(monkeypatch):
    """The adversarial helper's: a 500 was answered, then raised again past the app, so uvicorn logged
    it twice and closed the keep-alive connection (the client's next request failed). Now the app
    answers it and raises nothing: a client that raises server exceptions sees none."""
    from fastapi.testclient import TestClient

    seen, app = _app_logging_to(monkeypatch)

    @app.get("/boom")
    def boom():
        raise RuntimeError("x")

    @app.get("/ok")
    def ok():
        return {"ok": True}

    with TestClient(app, raise_server_exceptions=True) as c:
        r = c.get("/boom")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert c.get("/ok").json() == {"ok": True}
    assert seen == [("exception", "serve_internal_error")]
