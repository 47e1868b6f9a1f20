"""Issue 37 item 6: inputs that gave 500 are 400s naming the field: a lone surrogate in a prompt, a
message or any other string, and JSON nested deeper than any request field (or than the parser)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from conftest import REDIS_URL  # at import: in a whole-suite run the name conftest is rebound to later dirs' files
from serve_helpers import MODEL, serving


@pytest.fixture(scope="module")
def srv(request):
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"test:inputs:{id(request)}:"
    with serving(client, prefix) as s:
        yield s
    for k in client.scan_iter(prefix + "*"):
        client.delete(k)


def post(srv, path: str, raw: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(srv.base_url + path, data=raw, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


SURROGATE = [
    ("/completions", '{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
    ("/completions", '{"model": "tiny", "prompt": ["\\udfff"], "max_tokens": 2}', "prompt[0]"),
    ("/completions", '{"model": "tiny", "prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
    ("/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                          '"text": "\\udbff"}]}], "max_tokens": 2}', "messages[0].content[0].text"),
    ("/completions", '{"model": "tiny", "prompt": "ab", "workload": "w\\ud800", "max_tokens": 2}', "workload"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE, ids=[p for _, _, p in SURROGATE])
def test_a_lone_surrogate_is_a_400_naming_the_field(srv, path, raw, param):
    code, body = post(srv, path, raw.encode())
    assert code == 400, body
    assert body["error"]["param"] == param and "surrogate" in body["error"]["message"], body
    assert body["error"]["message"].startswith(param)


def test_a_paired_surrogate_is_text(srv):
    """An escaped pair (JSON's way to write a character beyond the BMP) is valid: served, not refused."""
    code, body = post(srv, "/completions", b'{"model": "tiny", "prompt": "ab \\ud83d\\ude00", "max_tokens": 2}')
    assert code == 200, body


@pytest.mark.parametrize("depth", [40, 5_000, 200_000])
def test_deeply_nested_json_is_a_400(srv, depth):
    raw = b'{"model": "tiny", "max_tokens": 2, "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    code, body = post(srv, "/completions", raw)
    assert code == 400, body
    assert body["error"]["code"] == "invalid_json" and "nest" in body["error"]["message"], body
    if depth < 1000:
        assert body["error"]["param"] == "prompt"


def test_the_server_still_serves_after_them(srv):
    oc = srv.openai()
    r = oc.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
