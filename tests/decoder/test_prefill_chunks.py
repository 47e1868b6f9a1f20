"""Issue 37 item 2: a long prompt is prefilled in chunks of PREFILL_CHUNK tokens, and a request
cancelled meanwhile (on_step([]) returns False: past its time budget, its client gone) stops at the
next chunk instead of holding the decoder for the whole prefill. Chunked or not, the output and
the recorded prompt rows are the same."""

import numpy as np
import pytest

import decoder.speculative as spec
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from store.schema import PairFingerprint
from tiny import reference_greedy

PROMPT = "the quick brown fox jumps over the lazy dog. " * 4  # 180 characters = tokens


@pytest.mark.parametrize("record_prompt", [False, True])
def test_chunked_prefill_decodes_and_records_as_one_call(target, other_draft, tok, monkeypatch, record_prompt):
    ids = tok(PROMPT).input_ids
    runs = {}
    for chunk in (10_000, 16):
        monkeypatch.setattr(spec, "PREFILL_CHUNK", chunk)
        got = []
        dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4, record_prompt=record_prompt),
                                 sink=got.append, pair_fingerprint=PairFingerprint("t", "d", "c"))
        polls = []
        res = dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=3, ignore_eos=True),
                           on_step=lambda new: polls.append(list(new)) or True)
        runs[chunk] = (res, got, polls)
    (a, rec_a, polls_a), (b, rec_b, polls_b) = runs[10_000], runs[16]
    assert a.output_ids == b.output_ids == reference_greedy(target, ids, 12)
    assert polls_b.count([]) == -(-(len(ids) - 1) // 16) - 1 and [] not in polls_a  # one poll between chunks
    assert len(rec_a) == len(rec_b) == (2 if record_prompt else 1)
    for x, y in zip(rec_a, rec_b):
        assert x.source == y.source and np.array_equal(x.topk_ids, y.topk_ids)
        assert np.allclose(x.topk_probs.astype(np.float32), y.topk_probs.astype(np.float32), atol=2e-3)


def test_a_request_cancelled_during_prefill_stops_at_the_next_chunk(target, other_draft, tok, monkeypatch):
    monkeypatch.setattr(spec, "PREFILL_CHUNK", 16)
    ids = tok(PROMPT).input_ids
    got, polls = [], []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4, record_prompt=True), sink=got.append,
                             pair_fingerprint=PairFingerprint("t", "d", "c"))
    res = dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=3, ignore_eos=True),
                       on_step=lambda new: polls.append(new) or len(polls) < 3)
    assert res.finish_reason == "cancelled" and res.output_ids == [] and res.steps == []
    assert polls == [[], [], []] and got == []  # no output, no record
    again = dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=3, ignore_eos=True))  # the decoder serves on
    assert again.output_ids == reference_greedy(target, ids, 12)


def test_the_hidden_state_prefill_is_cancelled_between_its_chunks_too(target, other_draft, tok, monkeypatch):
    """With hidden states recorded (serve.record_hidden) the prompt goes through _prompt_features,
    in chunks of _PROMPT_CHUNK: polled the same way."""
    monkeypatch.setattr(spec, "_PROMPT_CHUNK", 16)
    ids = tok(PROMPT).input_ids
    got, polls = [], []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4, record_prompt=True, record_hidden=True),
                             sink=got.append, pair_fingerprint=PairFingerprint("t", "d", "c"))
    res = dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=3, ignore_eos=True),
                       on_step=lambda new: polls.append(new) or len(polls) < 2)
    assert res.finish_reason == "cancelled" and res.output_ids == [] and polls == [[], []] and got == []
    full = dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=3, ignore_eos=True), on_step=lambda new: True)
    assert full.output_ids == reference_greedy(target, ids, 12) and len(got) == 2 and got[0].hidden is not None
