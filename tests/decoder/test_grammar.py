"""Issue 37 item 11: constrained output by JSON schema and GBNF grammar on llama.cpp's grammar
engine (decoder.grammar), on the packaged SmolLM2 GGUF. The output follows the grammar; greedy
speculative decoding under it equals plain (γ = 0) decoding under it token for token, with the
n-gram and the draft proposers; the partial masks (greedy / top-k rows) equal the full mask where
the row is used; bad schemas and grammars are refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from decoder.engines.llamacpp_lib import llamacpp_available
from decoder.grammar import GrammarConstraint, GrammarError, GrammarVocab, check_gbnf, schema_to_gbnf
from decoder.sampling import SamplingParams, process_logits
from decoder.speculative import DecodeRequest, SpeculativeDecoder

pytestmark = [pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")]

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"]}
YES_NO = 'root ::= ("yes" | "no")'


def check_person(text: str) -> dict:
    """The schema's checks by hand (the jsonschema package is not installed here)."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "city"}, obj
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert obj["city"] in ("Paris", "Rome", "Oslo")
    return obj


# ---- refusals (no model) ---------------------------------------------------------------------------
@pytest.mark.parametrize("schema, why", [
    (5, "is a JSON object"),
    ({"type": "foo"}, "Unrecognized schema"),
    ({"$ref": "https://example.com/s.json"}, "remote schemas are not fetched"),
    ({"type": "array", "minItems": 10**9}, "minItems"),
    ({"type": "string", "pattern": "^a{99999}$"}, "pattern"),
    # number bounds the converter drops without a word (break helper: "minimum": 5 decoded 8738582242312554)
    ({"type": "integer", "minimum": 5, "maximum": 10}, "^minimum: the grammar cannot bound numbers"),
    ({"type": "object", "properties": {"a": {"type": "integer", "maximum": 10}}}, "^properties.a.maximum: "),
    ({"anyOf": [{"type": "string"}, {"type": "number", "exclusiveMinimum": 0}]}, "^anyOf.1.exclusiveMinimum: "),
    ({"type": "array", "items": {"type": "number", "multipleOf": 2}}, "^items.multipleOf: "),
    ({"$defs": {"n": {"type": "integer", "minimum": 0}}, "$ref": "#/$defs/n"}, r"^\$defs.n.minimum: "),
])
def test_schemas_the_converter_cannot_serve_are_refused_with_the_reason(schema, why):
    with pytest.raises(GrammarError, match=why):
        schema_to_gbnf(schema)


def test_a_property_named_like_a_bound_is_not_a_bound():
    """Only schema keywords are refused: a property called "minimum", or an enum holding the word, is data."""
    schema_to_gbnf({"type": "object", "properties": {"minimum": {"type": "integer"}}, "required": ["minimum"]})
    schema_to_gbnf({"type": "string", "enum": ["minimum", "maximum"], "default": "minimum"})


@pytest.mark.parametrize("text, why", [
    ("", "empty"), ("   ", "empty"), (7, "string of GBNF"), ("root ::= " + "(" * 2000 + '"a"' + ")" * 2000, "nest"),
    ("root ::= " + '"a" ' * 20000, "characters"),
])
def test_grammars_llama_cpp_should_not_see_are_refused_before_it_does(text, why):
    with pytest.raises(GrammarError, match=why):
        check_gbnf(text)


def test_nesting_is_counted_outside_strings_classes_and_comments():
    check_gbnf('root ::= "((((" [(] x # ((((((\nx ::= ("a")')


# a tree node referring to itself, written as JSON Schema's examples write it: a root $ref beside
# the $defs it points into (the break helper's: refused as "KeyError: '#/$defs/node'")
NODE = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["name", "children"]}
TREE = {"$defs": {"node": NODE}, "$ref": "#/$defs/node"}
TREE_AT_ROOT = json.loads(json.dumps(NODE).replace("#/$defs/node", "#"))  # "$ref": "#", the root itself
TREE_IN_A_PROPERTY = {"type": "object", "properties": {"tree": {"$ref": "#/definitions/node"}}, "required": ["tree"],
                      "definitions": {"node": json.loads(json.dumps(NODE).replace("$defs", "definitions"))}}


def check_tree(obj, depth: int = 0) -> int:
    """The tree schema's checks by hand; returns the number of nodes."""
    assert isinstance(obj, dict) and set(obj) == {"name", "children"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8, obj
    assert isinstance(obj["children"], list) and len(obj["children"]) <= 2, obj
    return 1 + sum(check_tree(c, depth + 1) for c in obj["children"])


@pytest.mark.parametrize("schema", [TREE, TREE_AT_ROOT, TREE_IN_A_PROPERTY], ids=["root-ref", "hash", "property"])
def test_a_recursive_schema_becomes_a_recursive_grammar(schema):
    text = schema_to_gbnf(schema)
    rules = dict(line.split(" ::= ", 1) for line in text.splitlines())
    node = next(name for name in rules if name.startswith("ref-"))
    assert node in rules[node] or any(node in rules[r] and r in rules[node] for r in rules), text  # it recurses


@pytest.mark.parametrize("schema, why", [
    ({"$defs": {}, "$ref": "#/$defs/nope"}, r"^\$ref '#/\$defs/nope': 'nope' is not in the schema; refer to a schema "
                                            r"under \$defs, as #/\$defs/<name>$"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/b/type"}, "b": {"type": "string"}}},
     r"^\$ref '#/properties/b/type' points at a str, not a schema object$"),
    ({"type": "array", "items": {"$ref": "node"}}, r"^\$ref 'node' is not local: remote schemas are not fetched"),
    ({"type": "array", "items": {"$ref": "#node"}}, r"^\$ref '#node': a local \$ref is '#' or a JSON pointer"),
])
def test_a_ref_to_nothing_is_refused_naming_it(schema, why):
    with pytest.raises(GrammarError, match=why):
        schema_to_gbnf(schema)


# ---- the packaged GGUF -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf():
    from decoder.models.packaged import packaged_gguf

    return packaged_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def vocab(gguf):
    return GrammarVocab(gguf)


@pytest.fixture(scope="module")
def engine(gguf):
    from decoder.engines.llamacpp import LlamaCppEngine

    e = LlamaCppEngine(gguf, n_ctx=512, threads=2)
    yield e
    e.close()


@pytest.fixture(scope="module")
def real():
    from decoder.models.loading import load_pair

    return load_pair("smollm2-135m", "layers:0-3")


@pytest.fixture(scope="module")
def dec(engine, real):
    return SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=engine)


def chat_ids(real, text: str) -> list[int]:
    tok = real.tokenizer
    return tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True))["input_ids"]


@pytest.mark.parametrize("text, why", [
    ("root ::= foo", "Undefined rule"), ('root ::= "a', "unexpected end"), ('x ::= "a"', "root"),
    ("root ::= root \"a\"", "left recursion"), ('root ::= "a"{3000}', "repetitions"),
])
def test_grammars_llama_cpp_does_not_parse_are_refused_with_its_reason(vocab, text, why):
    with pytest.raises(GrammarError, match=why):
        GrammarConstraint(vocab, text)


def test_a_yes_no_grammar_gives_exactly_one_of_them_greedy_and_sampled(dec, real, vocab):
    g = GrammarConstraint(vocab, YES_NO, width=dec.vocab_p)
    ids = chat_ids(real, "Is Paris in France? Answer yes or no.")
    outs = []
    for params, gamma in [(SamplingParams(), 0), (SamplingParams(), 3)] + [(SamplingParams(1.0, seed=s), 3)
                                                                           for s in range(4)]:
        r = dec.generate(DecodeRequest(ids, params, 8, gamma=gamma, proposer="ngram", constraint=g))
        text = real.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        assert text in ("yes", "no") and r.finish_reason == "eos", (text, r.output_ids)
        outs.append(text)
    assert outs[0] == outs[1]
    print(outs)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_under_a_schema_is_valid_and_speculation_equals_plain_token_for_token(dec, real, vocab, proposer):
    g = GrammarConstraint(vocab, schema_to_gbnf(PERSON), width=dec.vocab_p)
    for prompt in ("Describe Ann, 31, from Rome, as JSON.", "Bob lives in Oslo. Give his JSON record."):
        ids = chat_ids(real, prompt)
        plain = dec.generate(DecodeRequest(ids, SamplingParams(), 40, gamma=0, constraint=g))
        spec = dec.generate(DecodeRequest(ids, SamplingParams(), 40, gamma=4, proposer=proposer, constraint=g))
        assert spec.output_ids == plain.output_ids, prompt
        assert plain.finish_reason == "eos", real.tokenizer.decode(plain.output_ids)
        check_person(real.tokenizer.decode(plain.output_ids, skip_special_tokens=True))
        assert spec.counts.num_draft_tokens > 0  # speculation ran under the mask


def test_partial_rows_equal_the_full_mask_where_the_row_is_used(dec, real, vocab, engine):
    """Greedy / top-k rows check only a row's best tokens: the processed distributions equal the
    fully masked row's, at every position of a constrained output (inside strings, between keys,
    at the end)."""
    g = GrammarConstraint(vocab, schema_to_gbnf(PERSON), width=dec.vocab_p)
    ids = chat_ids(real, "Describe Ann, 31, from Rome, as JSON.")
    out = dec.generate(DecodeRequest(ids, SamplingParams(), 48, gamma=0, constraint=g)).output_ids
    seq = engine.start()
    try:
        logits = seq.forward(ids + out[:-1], len(out))  # row j: the distribution that emitted out[j]
    finally:
        seq.release()
    s = g.start()
    for j, t in enumerate(out):
        row = logits[j: j + 1]
        full = g.constrain(row, s, [], dec.eos_ids, top_k=None)
        for params, k in [(SamplingParams(), 1), (SamplingParams(0.8, top_k=5), 5), (SamplingParams(1.0, top_k=40), 40)]:
            part = g.constrain(row, s, [], dec.eos_ids, top_k=k)
            torch.testing.assert_close(process_logits(part, params), process_logits(full, params), rtol=0, atol=0)
        assert int(full.argmax()) == t
        s = g.advance(s, t, dec.eos_ids)
        assert s is not None
    assert g.done(s)


def accepts(g: GrammarConstraint, tokenizer, text: str) -> bool:
    """``text``, tokenised, is a complete sentence of ``g``'s grammar."""
    s = g.start()
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        s = g.advance(s, t)
        if s is None:
            return False
    return g.done(s)


@pytest.mark.parametrize("schema", [TREE, TREE_AT_ROOT], ids=["root-ref", "hash"])
def test_a_recursive_grammar_takes_trees_of_any_depth_and_nothing_else(vocab, real, schema):
    g = GrammarConstraint(vocab, schema_to_gbnf(schema))
    leaf = '{"name": "c", "children": []}'
    deep = leaf
    for _ in range(5):
        deep = f'{{"name": "n", "children": [{deep}, {leaf}]}}'
    check_tree(json.loads(deep))
    for text in (leaf, deep):
        assert accepts(g, real.tokenizer, text), text
    for text in ('{"name": "a", "children": [1]}', '{"name": "a", "children": [{"name": "b"}]}',
                 '{"name": "a", "children": [' + ", ".join([leaf] * 3) + "]}"):
        assert not accepts(g, real.tokenizer, text), text


def test_two_refs_whose_pointers_end_alike_keep_their_own_schemas(vocab, real):
    """The converter named a target's rule by the pointer's last step: #/$defs/x and
    #/$defs/y/$defs/x shared the first one's rule, so "b" had to be an {"i": integer} object too."""
    x_int = {"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}
    x_str = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}, "b": {"$ref": "#/$defs/y/$defs/x"}},
              "required": ["a", "b"], "$defs": {"x": x_int, "y": {"$defs": {"x": x_str}}}}
    g = GrammarConstraint(vocab, schema_to_gbnf(schema))
    assert accepts(g, real.tokenizer, '{"a": {"i": 1}, "b": {"s": "t"}}')
    assert not accepts(g, real.tokenizer, '{"a": {"i": 1}, "b": {"i": 2}}')


def test_greedy_under_a_recursive_schema_is_a_tree_and_speculation_equals_plain(dec, real, vocab):
    g = GrammarConstraint(vocab, schema_to_gbnf(TREE), width=dec.vocab_p)
    ids = chat_ids(real, "Give a family tree as JSON: Ann has two children, Bob and Cy; Bob has one child, Di.")
    plain = dec.generate(DecodeRequest(ids, SamplingParams(), 96, gamma=0, constraint=g))
    spec = dec.generate(DecodeRequest(ids, SamplingParams(), 96, gamma=4, proposer="ngram", constraint=g))
    assert spec.output_ids == plain.output_ids
    text = real.tokenizer.decode(plain.output_ids, skip_special_tokens=True)
    assert plain.finish_reason == "eos", text
    assert check_tree(json.loads(text)) >= 1, text
