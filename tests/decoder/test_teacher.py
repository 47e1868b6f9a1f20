"""Prefill records: the decoder's prompt distributions and the bootstrap's corpus scoring.

Each row is checked against an independent full forward pass of the target over the same text
(no cache, one sequence at a time), the same reference the decode records are checked against.
"""

import numpy as np
import pytest
import torch

from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from decoder.teacher import corpus_windows, score_windows, windows
from decoder.workloads import documents, split_documents
from store.schema import PairFingerprint, decode, encode
from trainer.service import is_heldout, split_key

FP = PairFingerprint("tiny-t", "tiny-d", "chars")


def enc(tok, s):
    return tok(s)["input_ids"]


def _reference_rows(target, ids, k):
    with torch.no_grad():
        p = torch.softmax(target(input_ids=torch.tensor([ids])).logits[0].float(), -1)  # (L, V)
    return torch.topk(p, k, -1)


def test_record_prompt_rows_are_the_targets_prompt_distributions(target, other_draft, tok):
    got = []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4, record_prompt=True),
                             sink=got.append, pair_fingerprint=FP)
    ids = enc(tok, "abcabd cab")
    res = dec.generate(DecodeRequest(ids, max_new_tokens=8, gamma=3, ignore_eos=True, workload="w"))
    pre, rec = got
    assert (pre.source, rec.source) == ("prefill", "decode")
    assert pre.request_id == rec.request_id == res.request_id
    assert pre.record_id != rec.record_id
    assert pre.prompt_ids.tolist() == ids[:1] and pre.output_ids.tolist() == ids[1:]
    assert pre.proposal_lens.size == 0 and pre.rejection_pos.size == 0
    top = _reference_rows(target, ids, 4)
    for j in range(len(ids) - 1):  # row j: p(. | ids[: j + 1])
        assert pre.topk_ids[j].tolist() == top.indices[j].tolist()
        assert np.allclose(pre.topk_probs[j].astype(np.float32), top.values[j].numpy(), atol=1e-3)
        assert pre.tail_mass[j] == pytest.approx(1 - float(top.values[j].sum()), abs=1e-4)
    assert decode(encode(pre)) == pre


def test_record_prompt_does_not_change_the_output(target, other_draft, tok):
    ids = enc(tok, "hello world")
    outs = []
    for flag in (False, True):
        dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4, record_prompt=flag),
                                 sink=lambda s: None, pair_fingerprint=FP)
        outs.append(dec.generate(DecodeRequest(ids, max_new_tokens=10, gamma=2, ignore_eos=True)).output_ids)
    assert outs[0] == outs[1]


def test_no_prefill_record_when_off_or_one_token_prompt(target, other_draft, tok):
    got = []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4), sink=got.append, pair_fingerprint=FP)
    dec.generate(DecodeRequest(enc(tok, "abcdef"), max_new_tokens=3, gamma=2, ignore_eos=True))
    dec.config.record_prompt = True
    dec.generate(DecodeRequest(enc(tok, "a"), max_new_tokens=3, gamma=2, ignore_eos=True))
    assert [s.source for s in got] == ["decode", "decode"]


def test_score_windows_batched_equals_one_sequence_forward(target, tok):
    docs = [("d1", "the cat sat on the mat and the dog sat too"), ("d2", "abc abc abd abe")]
    items = corpus_windows(tok, docs, length=8)
    assert {k for k, _ in items} == {"d1", "d2"} and all(len(w) <= 8 for _, w in items)
    recs = list(score_windows(target, items, "prose", FP, k=5, batch_size=3))
    assert len(recs) == len(items)
    by_ids = {tuple(r.prompt_ids.tolist() + r.output_ids.tolist()): r for r in recs}
    for key, w in items:
        r = by_ids[tuple(w)]
        assert r.source == "prefill" and r.request_id == f"corpus:prose:{key}" and r.workload == "prose"
        top = _reference_rows(target, w, 5)
        assert r.topk_ids.tolist() == top.indices[:-1].tolist()
        assert np.allclose(r.topk_probs.astype(np.float32), top.values[:-1].numpy(), atol=1e-3)


def test_score_windows_under_bf16_autocast_is_close_to_fp32(target, tok):
    """bf16 scoring (for speed) gives distributions within bf16 rounding of the fp32 ones:
    the target's top-1 kept wherever fp32's top-1 leads clearly, probabilities within 0.02, and
    still proper distributions (top-k + tail = 1 in fp32)."""
    items = corpus_windows(tok, [("d1", "the cat sat on the mat and the dog sat too, then it ran off")], length=12)
    exact = {tuple(r.output_ids.tolist()): r for r in score_windows(target, items, "prose", FP, k=5)}
    fast = list(score_windows(target, items, "prose", FP, k=5, autocast_dtype=torch.bfloat16))
    assert len(fast) == len(exact)
    for r in fast:
        e = exact[tuple(r.output_ids.tolist())]
        assert r.topk_probs.dtype == e.topk_probs.dtype
        assert np.allclose(r.topk_probs.sum(-1) + r.tail_mass, 1.0, atol=1e-3)
        clear = (e.topk_probs[:, 0] - e.topk_probs[:, 1]) > 0.05
        assert (r.topk_ids[clear, 0] == e.topk_ids[clear, 0]).all()
        p_fast = {(i, t): p for i, (ts, ps) in enumerate(zip(r.topk_ids, r.topk_probs)) for t, p in zip(ts, ps)}
        for i, (ts, ps) in enumerate(zip(e.topk_ids, e.topk_probs)):
            for t, p in zip(ts, ps):
                if (i, t) in p_fast:
                    assert abs(float(p_fast[i, t]) - float(p)) < 0.02
        assert not np.array_equal(r.topk_probs, e.topk_probs)  # autocast really ran


def test_windows_split_and_errors():
    assert windows(list(range(10)), 4, min_length=2) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(10)), 4, min_length=3) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="length=1"):
        windows([1, 2, 3], 1)
    with pytest.raises(ValueError, match="no next-token position"):
        list(score_windows(torch.nn.Linear(1, 1), [("x", [5])], "w", FP))


def test_a_requests_records_fall_on_one_side_of_the_split(target, other_draft, tok):
    got = []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4, record_prompt=True),
                             sink=got.append, pair_fingerprint=FP)
    for i in range(30):
        dec.generate(DecodeRequest(enc(tok, f"abc {i}"), max_new_tokens=2, gamma=1, ignore_eos=True))
    sides = {}
    for s in got:
        sides.setdefault(s.request_id, set()).add(is_heldout(split_key(s), 0.3))
    assert len(sides) == 30 and all(len(v) == 1 for v in sides.values())
    assert 0 < sum(v == {True} for v in sides.values()) < 30  # both sides used
    # the same prompt served again (greedy or sampled) lands on the side it landed before
    first = {s.request_id: is_heldout(split_key(s), 0.3) for s in got if s.source == "decode"}
    got.clear()
    for i in range(30):
        dec.generate(DecodeRequest(enc(tok, f"abc {i}"), SamplingParams(temperature=1.0, seed=i),
                                   max_new_tokens=2, gamma=1, ignore_eos=True))
    again = [is_heldout(split_key(s), 0.3) for s in got if s.source == "decode"]
    assert again == list(first.values())


def test_corpora_exist_and_split_by_document():
    prose = documents("prose")
    code = documents("code")
    assert len(prose) > 50 and len(code) > 10
    # code prompts never in the corpus: tests/decoder/test_workloads.py::test_served_code_is_never_bootstrap_text
    tr, he = split_documents(prose, 0.2)
    assert not {k for k, _ in tr} & {k for k, _ in he}
    chars = lambda ds: sum(len(t) for _, t in ds)  # noqa: E731
    assert 0.15 < chars(he) / chars(prose) <= 0.2
    assert split_documents(prose, 0.2) == (tr, he)  # deterministic
    # pydoc's topics contain one another ("compound" holds "try"): no 300-character piece of a
    # held-out topic is in a training topic
    pieces = [t[i : i + 300] for _, t in he for i in range(0, len(t) - 300, 300)]
    assert len(pieces) > 100 and not [p for p in pieces if any(p in t for _, t in tr)]
    with pytest.raises(ValueError, match="no built-in corpus"):
        documents("nope")


def test_prompt_records_for_long_prompts_are_chunked_and_exact(target, other_draft, tok, monkeypatch):
    import decoder.speculative as sp

    monkeypatch.setattr(sp, "_PROMPT_CHUNK", 4)  # 3 chunks for this 11-token prompt
    got = []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=3, record_prompt=True),
                             sink=got.append, pair_fingerprint=FP)
    ids = enc(tok, "hello world")
    dec.generate(DecodeRequest(ids, max_new_tokens=2, gamma=1, ignore_eos=True))
    pre = got[0]
    top = _reference_rows(target, ids, 3)
    assert pre.topk_ids.tolist() == top.indices[:-1].tolist()
    assert np.allclose(pre.topk_probs.astype(np.float32), top.values[:-1].numpy(), atol=1e-3)


def test_two_token_prompt_gets_its_one_prefill_row(target, other_draft, tok):
    got = []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=3, record_prompt=True),
                             sink=got.append, pair_fingerprint=FP)
    dec.generate(DecodeRequest(enc(tok, "ab"), max_new_tokens=2, gamma=1, ignore_eos=True))
    assert [s.source for s in got] == ["prefill", "decode"] and got[0].output_ids.tolist() == enc(tok, "ab")[1:]


def test_continue_windows_greedy_equals_reference_and_eos_is_suppressed(target, tok):
    from decoder.teacher import continue_windows
    from tiny import reference_greedy

    prompts = [("a", enc(tok, "the cat")), ("b", enc(tok, "a dog!!")), ("c", enc(tok, "xyz"))]
    got = continue_windows(target, prompts, new_tokens=9, batch_size=2)
    assert [k for k, _ in got] == ["c", "a", "b"]  # grouped by prompt length, in order within a group
    for key, ids in got:
        prompt = dict(prompts)[key]
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 9
        # greedy continuation = plain greedy decoding, unless EOS (id 1) would come first
        ref = reference_greedy(target, prompt, 9)
        if 1 not in ref:
            assert ids[len(prompt):] == ref
        assert 1 not in ids[len(prompt):]
    sampled = continue_windows(target, prompts[:1], new_tokens=9, temperature=1.0, seed=3)
    assert sampled == continue_windows(target, prompts[:1], new_tokens=9, temperature=1.0, seed=3)
    scored = list(score_windows(target, got, "w", FP, k=4))
    assert [len(s.output_ids) + 1 for s in scored] == [len(ids) for _, ids in got]


@pytest.mark.parametrize("kw,msg", [({"new_tokens": 0}, "new_tokens=0"), ({"temperature": -1.0}, "temperature=-1.0"),
                                    ({"temperature": float("nan")}, "temperature=nan")])
def test_continue_windows_bad_values(target, kw, msg):
    from decoder.teacher import continue_windows

    args = {"new_tokens": 4} | kw
    with pytest.raises(ValueError, match=msg):
        continue_windows(target, [("a", [3, 4])], **args)
    with pytest.raises(ValueError, match="empty prompt"):
        continue_windows(target, [("a", [])], new_tokens=2)


def test_continue_windows_sampling_uses_temperature_and_seed_and_keeps_the_global_rng():
    from decoder.teacher import continue_windows
    from tiny import tiny_llama

    flat = tiny_llama(11, layers=1)  # head_scale 1: near-uniform p, so samples differ from the argmax path
    prompts = [("a", [5, 6, 7])]
    greedy = continue_windows(flat, prompts, new_tokens=12)
    s1 = continue_windows(flat, prompts, new_tokens=12, temperature=1.0, seed=1)
    s2 = continue_windows(flat, prompts, new_tokens=12, temperature=1.0, seed=2)
    assert s1 != greedy and s1 != s2
    assert s1 == continue_windows(flat, prompts, new_tokens=12, temperature=1.0, seed=1)
    cold = continue_windows(flat, prompts, new_tokens=12, temperature=1e-4, seed=1)  # T -> 0 is greedy
    assert cold == greedy
    torch.manual_seed(123)
    expect = torch.rand(3)
    torch.manual_seed(123)
    continue_windows(flat, prompts, new_tokens=4, temperature=1.0, seed=9)
    assert torch.equal(torch.rand(3), expect)


def test_continue_windows_ignores_the_models_generation_settings_and_counts_tokens(target, tok):
    from decoder.teacher import continue_windows
    from tiny import reference_greedy

    ids = enc(tok, "abc")
    ref = reference_greedy(target, ids, 6)
    assert 1 not in ref  # no EOS on this path, so the greedy continuation is the reference
    seen = []
    gc = target.generation_config
    saved = gc.repetition_penalty, gc.forced_eos_token_id
    gc.repetition_penalty, gc.forced_eos_token_id = 1.5, 1
    try:
        got = continue_windows(target, [("k", ids), ("j", ids)], new_tokens=6, batch_size=1, on_batch=seen.append)
    finally:
        gc.repetition_penalty, gc.forced_eos_token_id = saved
    assert [w[len(ids):] for _, w in got] == [ref, ref]
    assert seen == [6, 6]
    with pytest.raises(ValueError, match="batch_size=0"):
        continue_windows(target, [("k", ids)], new_tokens=2, batch_size=0)


def test_split_keeps_documents_that_share_text_on_one_side():
    """b quotes 12+ words of a, c quotes b: {a, b, c} is one group; d and e share nothing. With a
    held-out budget of 40 % of 500 characters, the 300-character group never fits, so it trains,
    and the held-out side is one of d / e (100 characters each) or both."""
    words = [f"w{i}" for i in range(60)]
    a = " ".join(words[:20])
    b = "intro " + " ".join(words[5:19]) + " outro"
    c = " ".join(["c"] * 3) + " " + " ".join(words[6:18])
    docs = [("a", a.ljust(100)), ("b", b.ljust(100)), ("c", c.ljust(100)), ("d", "d " * 50), ("e", "e " * 50)]
    tr, he = split_documents(docs, 0.4)
    assert {"a", "b", "c"} <= {k for k, _ in tr}
    assert {k for k, _ in he} <= {"d", "e"} and len(he) >= 1
    assert sum(len(t) for _, t in he) <= 0.4 * 500
    # 11 shared words is not enough to join: b2 shares only w5..w15 with a
    b2 = "intro " + " ".join(words[5:16]) + " outro"
    tr, he = split_documents([("a", a.ljust(100)), ("b2", b2.ljust(100))], 0.5)
    assert len(tr) == 1 and len(he) == 1


@pytest.mark.parametrize("kw", [{"heldout_fraction": -0.5}, {"heldout_fraction": 1.5}, {"heldout_fraction": float("nan")},
                                {"heldout_fraction": 0.2, "shingle": 0}])
def test_split_documents_refuses_a_fraction_outside_0_1_and_a_zero_shingle(kw):
    """-0.5 or NaN trained everything and 1.5 held everything out, silently; shingle 0 joined every
    document into one group."""
    with pytest.raises(ValueError, match="heldout_fraction|shingle"):
        split_documents([("a", "one two three"), ("b", "four five six")], **kw)
