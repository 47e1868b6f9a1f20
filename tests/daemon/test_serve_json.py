"""Issue 37 item 11: `response_format: {"type": "json_object"}` (JSON mode) is served: the completion
is one JSON object (or, cut by max_tokens, a prefix of one), streamed or not, and greedy JSON mode
gives the same text with speculation as without. JSON schemas and grammars: test_serve_grammar.py."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from decoder.constrain import DONE, JsonObjectConstraint, feed  # noqa: E402
from serve_helpers import MODEL, serving  # noqa: E402
from tiny import CHARS  # noqa: E402

JSON_CHARS = [{"@": "{", "$": "}"}.get(c, c) for c in CHARS]  # the tiny models' vocabulary, with braces


def test_json_mode_serves_an_object_streamed_or_not_with_and_without_speculation(redis_client, key_prefix):
    texts = {}
    for spec in (True, False):
        with serving(redis_client, f"{key_prefix}{spec}:", chars=JSON_CHARS, speculation=spec) as s:
            oc = s.openai()
            for content in ("give me json", "a", "{{"):
                msgs = [{"role": "user", "content": content}]
                r = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0,
                                               response_format={"type": "json_object"})
                text = r.choices[0].message.content
                state = feed(JsonObjectConstraint([]).start(), text)
                assert state is not None, text
                if r.choices[0].finish_reason == "stop":
                    assert state[1] == DONE and isinstance(json.loads(text), dict), text
                streamed = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=48, temperature=0, response_format={"type": "json_object"},
                    stream=True) if c.choices)
                assert streamed == text
                texts[(spec, content)] = text
    for content in ("give me json", "a", "{{"):
        assert texts[(True, content)] == texts[(False, content)]  # lossless: speculation changes nothing
    print(texts)


def test_json_schema_and_grammars_on_a_torch_target_are_refused_naming_what_is_served(redis_client, key_prefix):
    """Schemas and grammars run on llama.cpp's grammar engine (tests/daemon/test_serve_grammar.py):
    a target with no GGUF gets a 400 naming the field, the fix, and JSON mode as what works."""
    with serving(redis_client, key_prefix, chars=JSON_CHARS) as s:
        oc = s.openai()
        msgs = [{"role": "user", "content": "x"}]
        with pytest.raises(openai.BadRequestError) as ei:
            oc.chat.completions.create(model=MODEL, messages=msgs, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})
        body = ei.value.body
        assert body["param"] == "response_format" and "json_object" in body["message"]
        assert "models.engine=llamacpp" in body["message"]
        with pytest.raises(openai.BadRequestError) as ei:
            oc.chat.completions.create(model=MODEL, messages=msgs, extra_body={"grammar": 'root ::= "yes" | "no"'})
        assert ei.value.body["param"] == "grammar" and "llama.cpp" in ei.value.body["message"]
