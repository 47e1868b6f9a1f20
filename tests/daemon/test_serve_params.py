"""Request parameters checked without a server (``daemon.serve.parse_request`` on the tiny
tokenizer): values a client may send that are valid but reach places with narrower ranges."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serve_helpers import MODEL, invoke_serve, tokenizer


def parse(body: dict, kind: str = "completion"):
    from daemon.serve import parse_request

    tok = tokenizer()
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"prompt": "ab"} if kind == "completion" else {"messages": [{"role": "user", "content": "ab"}]})
    base.update(body)
    return parse_request(base, kind, tok, models={MODEL}, context_len=512, vocab=len(tok.get_vocab()),
                         max_tokens_default=16)


@pytest.mark.parametrize("top_k", [10**30, 2**64, 10**12])
def test_a_top_k_past_the_vocabulary_is_off_and_its_record_encodes(top_k):
    """top_k 10**30 was accepted (200) and its verified record could not be packed (msgpack:
    OverflowError, the record dropped: sample_encode_failed); a k at least the vocabulary cuts
    nothing (decoder.sampling.process_logits), so it is served as off."""
    from store.schema import PairFingerprint, SamplingSettings, decode, encode
    from store.synthetic import synthetic_sample

    p = parse({"top_k": top_k, "temperature": 1.0, "seed": 1})
    assert p.top_k == 0
    s = synthetic_sample(np.random.default_rng(0), n_tokens=4, k=4, prompt_len=4, request_id="r", workload="w",
                         adapter_version=0, pair=PairFingerprint("t", "d", "h"),
                         sampling=SamplingSettings(1.0, 1.0, p.top_k, p.seed))
    assert decode(encode(s)).sampling.top_k == 0


def test_a_top_k_inside_the_vocabulary_is_kept():
    assert parse({"top_k": 5, "temperature": 1.0}).top_k == 5
    assert parse({"top_k": -1, "temperature": 1.0}).top_k == 0


@pytest.mark.parametrize("model", [1, ["tiny"], ""])
def test_a_model_that_is_not_a_name_is_not_called_missing(model):
    """``"model": 1`` was answered 'model: missing' (code invalid_type): the field was there."""
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse({"model": model})
    e = ei.value
    assert (e.status, e.param, e.code) == (400, "model", "invalid_type")
    assert "missing" not in e.message and json.dumps(model) in e.message


def test_a_missing_model_is_called_missing():
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse({"model": None})
    assert (ei.value.param, ei.value.code) == ("model", "missing") and "missing" in ei.value.message


def test_sigterm_while_loading_stops_serve_before_it_listens(tmp_path, monkeypatch, key_prefix):
    """SIGTERM (twice) while the pair was loading waited for the whole load (minutes when the
    served format is measured), then serve bound its port, announced serving and drained at once.
    Now it stops after the stage it is in: nothing after the pair's load runs."""
    import os
    import signal
    import types

    import decoder.engines.registry as engines_registry
    import decoder.models.loading as loading
    from daemon.cli import app

    redis_url = "redis://127.0.0.1:6379/0"  # tests/daemon/conftest.py's REDIS_URL (the key_prefix fixture's Redis)
    for k, v in {"DRAFTD_STATE_DIR": str(tmp_path), "DRAFTD_REDIS__URL": redis_url,
                 "DRAFTD_STORE__KEY_PREFIX": key_prefix}.items():
        monkeypatch.setenv(k, v)

    def load_pair(*a, **kw):  # the operator's SIGTERM arrives while the pair loads
        os.kill(os.getpid(), signal.SIGTERM)
        return types.SimpleNamespace(target_name="t", draft_name="d", tokenizer_hash="h")

    def choose_engine(*a, **kw):
        raise AssertionError("serve went on loading after SIGTERM")

    monkeypatch.setattr(loading, "load_pair", load_pair)
    monkeypatch.setattr(engines_registry, "choose_engine", choose_engine)
    r = invoke_serve(app, "--port", "1")
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 0, r.output
    assert "serving" not in r.output


def test_a_bad_include_usage_is_named_by_its_path():
    """``stream_options: {"include_usage": "x"}`` was refused as param ``include_usage``, a field
    the request does not have at its top level."""
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse({"stream": True, "stream_options": {"include_usage": "x"}})
    assert (ei.value.status, ei.value.param, ei.value.code) == (400, "stream_options.include_usage", "invalid_type")
    assert ei.value.message.startswith('stream_options.include_usage: "x"')
    assert parse({"stream": True, "stream_options": {"include_usage": True}}).include_usage is True
    assert parse({"stream": True, "stream_options": {}}).include_usage is False


@pytest.mark.parametrize("field, value, kind", [("n", True, "completion"), ("echo", 0, "completion"),
                                                ("store", 0, "chat"), ("best_of", True, "completion")])
def test_a_value_of_another_json_type_is_refused_even_if_python_calls_it_equal(field, value, kind):
    """`n: true`, `echo: 0` and `store: 0` passed the n=1 / echo=false / store=false checks (True == 1
    and 0 == False in Python); the 400 names the field."""
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as e:
        parse({field: value}, kind)
    assert e.value.status == 400 and e.value.param == field


def test_the_values_served_still_pass():
    parse({"n": 1, "echo": False, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0})
    parse({"store": False, "n": 1}, "chat")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_cache_prompt_is_llama_servers_boolean(kind):
    """``cache_prompt`` (llama-server's request field) defaults to true; false reaches the request;
    anything but a boolean is a 400 naming it."""
    from daemon.serve import ApiError

    assert parse({}, kind).cache_prompt is True
    assert parse({"cache_prompt": False}, kind).cache_prompt is False
    with pytest.raises(ApiError) as ei:
        parse({"cache_prompt": "no"}, kind)
    assert (ei.value.status, ei.value.param, ei.value.code) == (400, "cache_prompt", "invalid_type")


@pytest.mark.parametrize("body, kind, shown, python", [
    ({"stream": "yes"}, "completion", '"yes" is not a boolean', "'yes'"),
    ({"n": True}, "completion", "n: true: only n=1", "True"),
    ({"temperature": [None, True]}, "completion", "[null, true] is not a finite number", "None"),
    ({"stop": {"a": None}}, "completion", '{"a": null}: give a string', "None"),
    ({"messages": [{"role": None, "content": "x"}]}, "chat", "null: use system", "None"),
    ({"response_format": {"type": "json_object", "x": 1}}, "chat", '"x" is not a field of a "json_object"', "'x'"),
    ({"workload": "nbsp\u00a0x"}, "completion", '"nbsp\\u00a0x": ', "'nbsp"),
])
def test_messages_name_the_request_values_as_json(body, kind, shown, python):
    """The 400 for ``"stream": "yes"`` said ``'yes'`` and for ``"n": true`` said ``True`` (Python's
    repr of what the client sent as JSON); now the value reads as the client wrote it, a character
    a reader cannot see (a no-break space) as its JSON escape."""
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse(body, kind)
    assert shown in ei.value.message and python not in ei.value.message, ei.value.message


@pytest.mark.parametrize("n, ok", [(1.0, True), (1, True), (2, False), (2.0, False), (1.5, False), (True, False),
                                   ("1", False)])
def test_n_takes_an_integral_float_as_openai_does(n, ok):
    """``"n": 1.0`` was refused ('only n=1'); OpenAI and vLLM (pydantic's lax int) take it."""
    from daemon.serve import ApiError

    if ok:
        parse({"n": n})
        return
    with pytest.raises(ApiError) as ei:
        parse({"n": n})
    assert (ei.value.status, ei.value.param) == (400, "n")


@pytest.mark.parametrize("body, param, shown", [
    ({"messages": [{"role": "user", "content": "x", "tool\u00a0calls": []}]}, "messages[0].tool\u00a0calls",
     'messages[0]: "tool\\u00a0calls" is an unsupported message field'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "s\u00a0": 1}}},
     "response_format.json_schema.s\u00a0", 'response_format.json_schema: "s\\u00a0" is an unknown field'),
])
def test_an_unknown_nested_field_is_named_in_json(body, param, shown):
    """A message's or a json_schema's unknown key was quoted raw; now in JSON as _j spells values
    (an invisible no-break space as its escape); the param stays the path as sent."""
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse(body, "chat")
    assert ei.value.param == param and ei.value.message.startswith(shown), ei.value.message


@pytest.mark.parametrize("best_of, ok", [(1.0, True), (1, True), (2, False), (2.0, False), (1.5, False),
                                         (True, False), ("1", False)])
def test_best_of_takes_an_integral_float_as_n_does(best_of, ok):
    """``"best_of": 1.0`` was refused ('only best_of=1') while ``"n": 1.0`` was served; vLLM reads
    both as pydantic's lax int, so 1.0 is 1 for either."""
    from daemon.serve import ApiError

    if ok:
        parse({"best_of": best_of})
        return
    with pytest.raises(ApiError) as ei:
        parse({"best_of": best_of})
    assert (ei.value.status, ei.value.param, ei.value.code) == (400, "best_of", "unsupported_parameter")


@pytest.mark.parametrize("raw, param", [(b'{"max_tokens": %s}' % (b"9" * 5000), "max_tokens"),
                                        (b'{"stop": ["a"], "seed": -%s}' % (b"1" * 5000), "seed"),
                                        (b'{"prompt": [1, %s]}' % (b"2" * 4301), "prompt[1]")])
def test_an_integer_too_long_to_read_is_a_400_naming_its_field(raw, param):
    """A 5000-digit integer was refused as 'the request body is not JSON: Exceeds the limit (4300
    digits) ... use sys.set_int_max_str_digits()': a Python setting, and no field named."""
    from daemon.serve import ApiError, parse_json_body

    with pytest.raises(ApiError) as ei:
        parse_json_body(raw)
    e = ei.value
    assert (e.status, e.param) == (400, param)
    assert e.message.startswith(f"{param}: an integer of ") and "too large" in e.message
    assert "sys." not in e.message and "not JSON" not in e.message
    assert parse_json_body(b'{"seed": %s}' % (b"9" * 4000))["seed"] == int("9" * 4000)


@pytest.mark.parametrize("name, kind", [("max_tokens", "completion"), ("max_completion_tokens", "chat")])
def test_a_max_tokens_just_under_the_digit_limit_is_a_400_not_a_500(name, kind):
    # the break session of the thirteenth: 4300 nines read, then the context check printed
    # len(prompt) + max_tokens (4301 digits) and raised ValueError: a 500
    from daemon.serve import MAX_TOKENS_BOUND, ApiError

    for v in (int("9" * 4300), 10**20, MAX_TOKENS_BOUND + 1, 1e308):
        with pytest.raises(ApiError) as ei:
            parse({name: v}, kind)
        assert (ei.value.status, ei.value.param) == (400, name), ei.value.message
        assert len(ei.value.message) < 400
    with pytest.raises(ApiError) as ei:  # within the bound: the context check answers, naming both lengths
        parse({name: MAX_TOKENS_BOUND}, kind)
    assert ei.value.code == "context_length_exceeded"
