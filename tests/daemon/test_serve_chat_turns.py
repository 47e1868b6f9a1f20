"""A chat whose last message is the assistant's (the break session's "prefill" request): by default
a new assistant turn is opened after it, as vLLM's chat API does (the server rendered the messages
without a generation prompt, the closed assistant turn then answered by an empty reply);
``continue_final_message: true`` renders the final message open and continues it. The expected
prompts are written out by hand from the templates."""

from __future__ import annotations

import pytest

from serve_helpers import MODEL, plain_text, serving, tiny_pair, tokenizer

QA = [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "2+2 is"}]


def parse(body: dict, tok=None):
    from daemon.serve import parse_request

    tok = tok or tokenizer()
    return parse_request({"model": MODEL, "max_tokens": 4, **body}, "chat", tok, models={MODEL}, context_len=None,
                         vocab=len(tok.get_vocab()), max_tokens_default=16)


@pytest.mark.parametrize("flags, msgs, rendered", [
    # serve_helpers.CHAT_TEMPLATE: "<role>: <content>\n" per message, then "assistant: " when asked
    ({}, QA, "user: what is 2+2?\nassistant: 2+2 is\nassistant: "),
    ({"add_generation_prompt": True}, QA, "user: what is 2+2?\nassistant: 2+2 is\nassistant: "),
    ({"continue_final_message": True}, QA, "user: what is 2+2?\nassistant: 2+2 is"),
    ({"continue_final_message": True, "add_generation_prompt": False}, QA, "user: what is 2+2?\nassistant: 2+2 is"),
    ({}, QA[:1], "user: what is 2+2?\nassistant: "),
    ({"add_generation_prompt": False}, QA[:1], "user: what is 2+2?\n"),
    ({"add_generation_prompt": False}, QA, "user: what is 2+2?\nassistant: 2+2 is\n"),
])
def test_the_prompt_is_rendered_as_vllm_renders_it(flags, msgs, rendered):
    tok = tokenizer()
    assert parse({"messages": msgs, **flags}, tok).prompt_ids == tok(rendered).input_ids


@pytest.mark.parametrize("flags, why", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt: false"),
    ({"continue_final_message": 1}, "not a boolean"),
    ({"add_generation_prompt": "yes"}, "not a boolean"),
])
def test_bad_template_flags_are_400s_naming_the_fix(flags, why):
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse({"messages": QA, **flags})
    assert ei.value.status == 400 and ei.value.param in flags and why in ei.value.message


def test_continuing_an_empty_final_message_is_a_400():
    """transformers keeps the whole rendered chat (end-of-turn included) when the final content is
    empty: the request would answer a closed turn, the bug this file is about."""
    from daemon.serve import ApiError

    with pytest.raises(ApiError) as ei:
        parse({"messages": [QA[0], {"role": "assistant", "content": " "}], "continue_final_message": True})
    assert (ei.value.status, ei.value.param) == (400, "continue_final_message")
    assert "empty" in ei.value.message


def test_completions_refuse_the_chat_template_flags():
    from daemon.serve import ApiError, parse_request

    tok = tokenizer()
    with pytest.raises(ApiError) as ei:
        parse_request({"model": MODEL, "prompt": "ab", "continue_final_message": True}, "completion", tok,
                      models={MODEL}, context_len=None, vocab=len(tok.get_vocab()), max_tokens_default=16)
    assert (ei.value.status, ei.value.code) == (400, "unsupported_parameter")


SMOL_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
FRANCE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is"}]


@pytest.mark.slow
@pytest.mark.parametrize("flags, rendered", [
    ({}, SMOL_SYSTEM + "<|im_start|>assistant\nThe capital of France is<|im_end|>\n<|im_start|>assistant\n"),
    ({"continue_final_message": True}, SMOL_SYSTEM + "<|im_start|>assistant\nThe capital of France is"),
])
def test_the_packaged_smollm2_template_continues_or_opens_a_turn(flags, rendered):
    """The break session's request on the packaged model's own tokenizer and chat template
    (tokenizer only: no weights are loaded)."""
    from transformers import AutoTokenizer

    from decoder.models.loading import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    ids = parse({"messages": FRANCE, **flags}, tok).prompt_ids
    assert tok.decode(ids) == rendered


def test_a_served_continuation_is_plain_decoding_of_the_open_final_message(redis_client, key_prefix):
    """Greedy, speculating: the reply continues "2+2 is" (the prompt ends inside the assistant's
    message), equal to plain decoding of that hand-written prompt; by default the reply is a new
    turn's, equal to plain decoding after "assistant: "."""
    target, draft = tiny_pair()
    with serving(redis_client, key_prefix) as s:
        oc = s.openai()
        for extra, rendered in (({"continue_final_message": True}, "user: what is 2+2?\nassistant: 2+2 is"),
                                ({}, "user: what is 2+2?\nassistant: 2+2 is\nassistant: ")):
            want, res = plain_text(s.tokenizer, target, draft, s.tokenizer(rendered).input_ids, 10)
            r = oc.chat.completions.create(model=MODEL, messages=QA, max_tokens=10, temperature=0, extra_body=extra)
            assert r.choices[0].message.content == want
            assert r.usage.prompt_tokens == len(rendered) and r.usage.completion_tokens == len(res.output_ids)
