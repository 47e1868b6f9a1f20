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

VALID = ['{}', '{"a": 1}', '{"a": [1, -2.5e+3, true, false, null, "x\\n\\u00e9"], "b": {"c": []}}', ' {"k" : "v" }']
INVALID = ['[]', '1', '{a: 1}', "{'a': 1}", '{"a": 01}', '{"a": 1,}', '{"a" 1}', '{"a": tru}', '{"a": "\x01"}',
           '{"a": 1}}', '{"a": -}', '{"a": 1.}',
           # the object closed: nothing but the end of sequence (a break session's model emitted newlines
           # after '}' up to max_tokens)
           '{"a": 1} ', '{}\n', '{} {}']


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


def _allowed_by_hand(jtok, prefix: str, eos: int) -> list[int]:
    """The tokens JSON mode allows after ``prefix`` (at most two characters of output here), by
    JSON's grammar written out for these prefixes: before the object only whitespace or '{'; right
    after '{' whitespace, '"' (a key) or '}'; inside a key any character but '"' and '\\' and
    control characters, which leaves every one of the tiny vocabulary's characters; after '{}'
    only the end."""
    ids = lambda chars: [jtok.convert_tokens_to_ids(c) for c in chars]  # noqa: E731
    core = prefix.strip(" ")
    if core == "":
        return ids(" {")
    if core == "{":
        return ids(' "}')
    if core == "{}":
        return [eos]
    assert prefix == '{"', prefix
    return ids(JSON_CHARS)


def test_sampled_json_mode_first_three_tokens_follow_the_masked_target_chi_square(target, other_draft, jtok, constraint):
    """T = 1, γ = 2 with a draft that agrees little (its proposals are not masked: many fall outside
    the mask and are rejected, the rest go through the acceptance test against the masked p, and a
    rejection draws from the residual of the masked p): the
    first three emitted tokens, jointly, against the product of the target's own distributions with
    the mask applied and renormalised, each row computed here from the tiny target's logits and the
    masks written out by hand (:func:`_allowed_by_hand`)."""
    import math

    import torch

    from test_speculative import _chi2_crit_001, _chi_square

    dec = SpeculativeDecoder(target, other_draft, jtok)
    eos = 1
    # '{' 0.81 / ' ' 0.19, then '"' 0.996 after '{', then a key's first character spread over the
    # whole vocabulary (entropy 2.8 nats, none above 0.16): there the draft's proposals (q puts all
    # its mass inside the mask) are decided by the acceptance test, not by the mask
    ids = jtok("x").input_ids

    def masked_logp(prefix_ids: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor([ids + prefix_ids])).logits[0, -1].double()
        allowed = _allowed_by_hand(jtok, jtok.decode(prefix_ids), eos)
        z = torch.logsumexp(logits[allowed], 0)
        return {t: float(logits[t] - z) for t in allowed}

    joint: dict[tuple, float] = {}
    for a, la in masked_logp([]).items():
        for b, lb in masked_logp([a]).items():
            for c, lc in masked_logp([a, b]).items():
                joint[(a, b, c)] = math.exp(la + lb + lc)
    assert abs(sum(joint.values()) - 1) < 1e-9
    n, counts, rejected = 2000, Counter(), 0
    for s in range(n):
        r = dec.generate(DecodeRequest(ids, SamplingParams(temperature=1.0, seed=s), max_new_tokens=6, gamma=2,
                                       constraint=constraint))  # 6: the third token is proposed, not only a bonus
        assert len(r.output_ids) >= 3, r.output_ids  # the earliest end of sequence is the third ('{}' then eos)
        counts[tuple(r.output_ids[:3])] += 1
        rejected += r.counts.num_draft_tokens - r.counts.num_accepted_tokens
    assert set(counts) <= set(joint), set(counts) - set(joint)  # never outside the mask
    assert rejected > n // 2, rejected  # the draft's proposals were rejected often: the residual path ran
    keys = sorted(joint)
    chi2, df = _chi_square(torch.tensor([float(counts[k]) for k in keys]), torch.tensor([joint[k] for k in keys]), n)
    assert df >= 8, df
    assert chi2 < _chi2_crit_001(df), (chi2, df, counts.most_common(8))
