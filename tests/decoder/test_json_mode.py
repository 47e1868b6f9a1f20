"""Issue 37 item 11: JSON mode. The output is one JSON object (the target's logits masked at every
verified row, decoder.constrain), and speculation stays lossless under the mask: speculative and
plain decoding give the same greedy output and the same sampled distribution, whatever the draft
proposes (its proposals are not masked)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from decoder.constrain import DONE, JsonObjectConstraint, feed
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, SpeculativeDecoder
from tiny import CHARS, char_tokenizer

# the tiny models' 62 characters, with '{' and '}' in place of '@' and '$'
JSON_CHARS = [{"@": "{", "$": "}"}.get(c, c) for c in CHARS]

VALID = ['{}', '{"a": 1}', '{"a": [1, -2.5e+3, true, false, null, "x\\n\\u00e9"], "b": {"c": []}}', ' {"k" : "v" } ']
INVALID = ['[]', '1', '{a: 1}', "{'a': 1}", '{"a": 01}', '{"a": 1,}', '{"a" 1}', '{"a": tru}', '{"a": "\x01"}',
           '{"a": 1}}', '{"a": -}', '{"a": 1.}']


def _root():
    return JsonObjectConstraint([]).start()


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_and_all_their_prefixes_are_accepted(text):
    for i in range(len(text) + 1):
        assert feed(_root(), text[:i]) is not None, text[:i]
    assert feed(_root(), text)[1] == DONE
    json.loads(text)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_text_is_refused(text):
    s = feed(_root(), text)
    assert s is None or s[1] != DONE, text


@pytest.fixture(scope="module")
def jtok():
    return char_tokenizer(JSON_CHARS)


@pytest.fixture(scope="module")
def constraint(jtok, target):
    return JsonObjectConstraint.for_tokenizer(jtok, target.config.vocab_size)


def test_greedy_json_mode_is_an_object_and_speculation_is_lossless(target, other_draft, jtok, constraint):
    dec = SpeculativeDecoder(target, other_draft, jtok)
    for prompt in ("give json: ", "x", "{{{"):
        ids = jtok(prompt).input_ids
        plain = dec.generate(DecodeRequest(ids, max_new_tokens=40, gamma=0, constraint=constraint))
        spec = dec.generate(DecodeRequest(ids, max_new_tokens=40, gamma=3, constraint=constraint))
        assert spec.output_ids == plain.output_ids, prompt
        text = jtok.decode(plain.output_ids, skip_special_tokens=True)
        state = feed(_root(), text)
        assert state is not None, text  # a prefix of an object at least
        if plain.finish_reason == "eos":
            assert isinstance(json.loads(text), dict)
        free = dec.generate(DecodeRequest(ids, max_new_tokens=40, gamma=0))
        assert feed(_root(), jtok.decode(free.output_ids, skip_special_tokens=True)) is None  # the mask did something


def test_sampled_json_mode_has_the_plain_distribution(target, other_draft, jtok, constraint):
    """Seeded samples of the first 3 tokens: speculative (γ = 3, a draft that agrees little) against
    plain differ no more than two plain runs of other seeds do (sampling noise), all valid."""
    dec = SpeculativeDecoder(target, other_draft, jtok)
    ids = jtok("json: ").input_ids

    def sample(gamma: int, seeds: range) -> Counter:
        c = Counter()
        for s in seeds:
            r = dec.generate(DecodeRequest(ids, SamplingParams(temperature=1.0, seed=s), max_new_tokens=3, gamma=gamma,
                                           constraint=constraint))
            text = jtok.decode(r.output_ids, skip_special_tokens=True)
            assert feed(_root(), text) is not None, text
            c[text[:3]] += 1
        return c

    def tv(a: Counter, b: Counter) -> float:
        return 0.5 * sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / 400

    plain_a, plain_b, spec = sample(0, range(400)), sample(0, range(400, 800)), sample(3, range(800, 1200))
    noise = tv(plain_a, plain_b)
    assert tv(plain_a, spec) < noise + 0.1 and tv(plain_b, spec) < noise + 0.1, (noise, plain_a.most_common(5),
                                                                                  spec.most_common(5))
