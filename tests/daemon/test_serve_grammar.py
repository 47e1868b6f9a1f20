"""Issue 37 item 11: `response_format: {"type": "json_schema", ...}` and a raw GBNF `grammar` (extra
body, as llama-server takes it) are served on the packaged SmolLM2 GGUF (llama.cpp engine): the
output follows the schema / grammar, streamed or not, the same with speculation as without; a bad
schema or grammar is a 400 naming the field."""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai")

from conftest import REDIS_URL  # noqa: E402 - at import: a function-local import finds another package's conftest
from decoder.engines.llamacpp_lib import llamacpp_available  # noqa: E402

pytestmark = [pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")]

MODEL = "smollm2-135m"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"]}


@contextmanager
def real_serving(redis_client, key_prefix: str):
    from daemon.serve import InferenceService, ServeServer
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.models.loading import load_pair
    from decoder.models.packaged import packaged_gguf
    from decoder.speculative import DecoderConfig
    from store.config import StoreConfig
    from store.schema import PairFingerprint

    pair = load_pair(MODEL, "layers:0-3")
    engine = LlamaCppEngine(packaged_gguf(MODEL), n_ctx=1024, threads=2)
    loop = build_serving_loop(
        pair.target, pair.draft, pair.tokenizer, client=redis_client, store_config=StoreConfig(key_prefix=key_prefix),
        decoder_config=DecoderConfig(topk_record=8), pair_fingerprint=PairFingerprint(MODEL, "layers:0-3", "t"),
        config=LoopConfig(queue_size=8), poll_interval_s=0.2, history_flush_s=0.5, proposers=("ngram", "draft"),
        engine=engine)
    loop.start()
    service = InferenceService(loop, pair.tokenizer, MODEL, context_len=engine.context_length, max_tokens_default=32,
                               server_id=f"test-{os.getpid()}-{id(loop)}")
    try:
        with ServeServer(service, "127.0.0.1", 0) as server:
            yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                                timeout=600)
    finally:
        loop.close()
        engine.close()


@pytest.fixture(scope="module")
def oc():
    import redis

    client = redis.Redis.from_url(REDIS_URL, decode_responses=False)
    prefix = f"test:daemon:{uuid.uuid4().hex[:8]}:"
    try:
        with real_serving(client, prefix) as oc_:
            yield oc_
    finally:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
        client.close()


def _chat(oc, content: str, stream: bool = False, **kw):
    args = dict(model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, **kw)
    if not stream:
        r = oc.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for c in oc.chat.completions.create(stream=True, **args):
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    return text, finish


def test_json_schema_output_validates_streamed_or_not_with_and_without_speculation(oc):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    got = {}
    for gamma in (0, 4):
        for stream in (False, True):
            got[(gamma, stream)] = _chat(oc, "Describe Ann, 31, from Rome, as JSON.", stream, max_tokens=40,
                                         response_format=rf, extra_body={"gamma": gamma})
    text, finish = got[(0, False)]
    assert all(v == (text, finish) for v in got.values()), got  # lossless, and streamed = not
    assert finish == "stop", text
    obj = json.loads(text)  # the schema's checks by hand (no jsonschema package here)
    assert set(obj) == {"name", "age", "city"} and isinstance(obj["name"], str), obj
    assert isinstance(obj["age"], int) and obj["city"] in ("Paris", "Rome", "Oslo"), obj


def test_a_yes_no_grammar_gives_exactly_one_of_them(oc):
    g = 'root ::= ("yes" | "no")'
    for content, kw in [("Is Paris in France?", {}), ("Is the sea dry?", {"temperature": 1.0, "seed": 3})]:
        args = dict(max_tokens=8, extra_body={"grammar": g, "gamma": 3})
        if kw:
            r = oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **args, **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        else:
            text, finish = _chat(oc, content, **args)
        assert text in ("yes", "no") and finish == "stop", text
    r = oc.completions.create(model=MODEL, prompt="Q: Is water wet? A:", max_tokens=8, temperature=0,
                              extra_body={"grammar": g})  # completions take it too
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("kw, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "Unrecognized schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                         "maxItems": 10**6}}}},
     "response_format.json_schema.schema", "maxItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
    ({"extra_body": {"grammar": "root ::= foo"}}, "grammar", "Undefined rule identifier 'foo'"),
    ({"extra_body": {"grammar": ""}}, "grammar", "empty"),
    ({"extra_body": {"grammar": 'root ::= "a"'}, "response_format": {"type": "json_object"}}, "grammar", "one of them"),
])
def test_bad_schemas_and_grammars_get_a_400_naming_the_field(oc, kw, param, says):
    with pytest.raises(openai.BadRequestError) as ei:
        oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, **kw)
    body = ei.value.body
    assert body["param"] == param and says in body["message"], body
    assert body["message"].startswith(param)


def test_grammars_compile_against_the_targets_gguf_or_the_packaged_one_it_came_from():
    from daemon.serve import _grammar_gguf
    from decoder.models.packaged import packaged_gguf

    class LlamaTarget:
        path = "/models/t.gguf"

    assert _grammar_gguf("anything", LlamaTarget()) == "/models/t.gguf"
    packaged = str(packaged_gguf(MODEL))
    assert _grammar_gguf(MODEL, object()) == packaged == _grammar_gguf(f"{MODEL}@bf16", object())  # a torch target
    assert _grammar_gguf("HuggingFaceTB/SmolLM2-135M", object()) is None  # no GGUF: a 400 names the field
