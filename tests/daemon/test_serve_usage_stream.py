"""``stream_options.continuous_usage_stats`` (vLLM's): every streamed chunk carries the usage so
far (it was accepted with any value and did nothing); OpenAI's ``user`` (a string) and
``metadata`` (at most 16 string keys to string values) are checked (any type passed)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import MODEL, plain_text, serving, tiny_pair, tokenizer  # noqa: E402


def parse(body: dict, kind: str = "chat"):
    from daemon.serve import parse_request

    tok = tokenizer()
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"prompt": "ab"} if kind == "completion" else {"messages": [{"role": "user", "content": "ab"}]})
    return parse_request({**base, **body}, kind, tok, models={MODEL}, context_len=512, vocab=len(tok.get_vocab()),
                         max_tokens_default=16)


def refused(body: dict, kind: str = "chat"):
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse(body, kind)
    assert ei.value.status == 400
    return ei.value


@pytest.mark.parametrize("so, usage, continuous", [
    ({"continuous_usage_stats": True}, True, True),  # vLLM: include_usage defaults to true in stream_options
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ({"include_usage": True, "continuous_usage_stats": False}, True, False),
    ({"continuous_usage_stats": False}, False, False),
    ({"continuous_usage_stats": None}, False, False),
])
def test_continuous_usage_stats_is_parsed_as_vllm_reads_it(so, usage, continuous):
    p = parse({"stream": True, "stream_options": so})
    assert (p.include_usage, p.continuous_usage) == (usage, continuous)


@pytest.mark.parametrize("so, param", [
    ({"continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats"),
    ({"continuous_usage_stats": 1}, "stream_options.continuous_usage_stats"),
    ({"include_usage": False, "continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
    ({"usage": True}, "stream_options"),
])
def test_bad_stream_options_are_400s_naming_the_field(so, param):
    assert refused({"stream": True, "stream_options": so}).param == param


@pytest.mark.parametrize("body, param, code", [
    ({"user": 5}, "user", "invalid_type"),
    ({"user": {"id": "u"}}, "user", "invalid_type"),
    ({"metadata": ["a"]}, "metadata", "invalid_type"),
    ({"metadata": "k=v"}, "metadata", "invalid_type"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
    ({"metadata": {"k": 1}}, "metadata.k", "invalid_type"),
    ({"metadata": {"k": None}}, "metadata.k", "invalid_type"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "invalid_value"),
])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_user_and_metadata_take_openais_types_only(body, param, code, kind):
    e = refused(body, kind)
    assert (e.param, e.code) == (param, code)


def test_user_and_metadata_within_openais_bounds_pass():
    parse({"user": "u-1", "metadata": {f"k{i}": "v" * 512 for i in range(16)}})
    parse({"user": None, "metadata": None}, "completion")
    parse({"metadata": {"k" * 64: ""}})


def test_every_streamed_chunk_carries_the_usage_so_far(redis_client, key_prefix):
    """Greedy, on the tiny models' one-character tokens: each chunk's completion_tokens is the
    number of characters streamed up to it (every output token is one character, the last one
    maybe <eos>, which has none), the final chunk's usage is the last usage chunk's, and
    prompt_tokens is the prompt's length in characters."""
    target, draft = tiny_pair()
    prompt = "the cat sat on"
    with serving(redis_client, key_prefix) as s:
        want, res = plain_text(s.tokenizer, target, draft, s.tokenizer(prompt).input_ids, 12)
        oc = s.openai()
        chunks = list(oc.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"continuous_usage_stats": True}))
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == len(res.output_ids)
        assert body[-1].choices[0].finish_reason is not None and body[-1].usage == last.usage
        text = ""
        for c in body[:-1]:
            text += c.choices[0].text
            assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == \
                (len(prompt), len(text), len(prompt) + len(text))
        assert text + body[-1].choices[0].text == want
        msgs = [{"role": "user", "content": "hi"}]
        chat = list(oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                               stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
        assert all(c.usage is not None for c in chat)
        plain = list(oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]
