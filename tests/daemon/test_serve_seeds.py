"""`seed` over its whole accepted range (a signed 64-bit integer, as vLLM's and OpenAI's APIs take
it): distinct seeds give distinct sampling streams on /v1/completions and /v1/chat/completions,
the same seed the same completion, and one past the range a 400 naming `seed` and the range. Seeds
equal modulo 2^32 (1 and 1 + 2^32; -1 and 2^63 - 1) used to draw alike: torch's CPU generator
keeps a seed's low 32 bits."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("openai")

from serve_helpers import MODEL, serving  # noqa: E402

# pairs equal modulo 2^32; 0 and -2^63 too
SEEDS = [1, 1 + 2**32, -1, 2**63 - 1, 0, -(2**63), 2**32 - 1, 7 * 2**40 + 1]


def post(s, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(s.base_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def text_of(kind: str, body: dict) -> str:
    c = body["choices"][0]
    return c["text"] if kind == "completion" else c["message"]["content"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_distinct_int64_seeds_give_distinct_streams_and_a_seed_reproduces(redis_client, key_prefix, kind):
    path = "/completions" if kind == "completion" else "/chat/completions"
    base = {"model": MODEL, "max_tokens": 24, "temperature": 2.0, "ignore_eos": True}
    base.update({"prompt": "hello"} if kind == "completion" else {"messages": [{"role": "user", "content": "hello"}]})
    with serving(redis_client, key_prefix) as s:
        texts = {}
        for seed in SEEDS:
            code, body = post(s, path, {**base, "seed": seed})
            assert code == 200, body
            texts[seed] = text_of(kind, body)
            assert len(texts[seed]) > 0
        assert len(set(texts.values())) == len(SEEDS), texts  # 24 tokens at T = 2: a collision means one stream
        for seed in (1 + 2**32, -1, -(2**63)):  # and each reproduces
            code, body = post(s, path, {**base, "seed": seed})
            assert code == 200 and text_of(kind, body) == texts[seed], (seed, body)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_past_int64_is_a_400_naming_seed_and_the_range(redis_client, key_prefix, seed):
    with serving(redis_client, key_prefix) as s:
        for path, extra in (("/completions", {"prompt": "a"}), ("/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
            code, body = post(s, path, {"model": MODEL, "max_tokens": 2, "temperature": 1.0, "seed": seed, **extra})
            assert code == 400 and body["error"]["param"] == "seed", body
            msg = body["error"]["message"]
            assert str(-(2**63)) in msg and str(2**63 - 1) in msg, msg  # the accepted range, both ends
