"""The draft proposer's copy channel (decoder/proposers/draft.py with store.copy_channel): q_mix by
hand, verification with q_mix reproduces the target's distribution (T = 1), greedy decoding with
any gate equals plain decoding, and the decoder proposes with the gate it was given."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from decoder.models.loading import derive_draft
from decoder.proposers.draft import DraftModelProposer
from decoder.sampling import SamplingParams, verify
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from test_speculative import first_token_chi_square
from tiny import reference_greedy

Q = torch.tensor([0.1, 0.2, 0.6, 0.1])  # the draft's q at every step (a fake draft of 4 ids)
CTX = [1, 2, 3, 1, 2]  # (1, 2) ended at 1, followed by 3: candidate c = 3, ℓ = 2
W_HALF = np.zeros(6)  # w · f = 0: λ = 1/2


def fake_proposer(gate) -> DraftModelProposer:
    return DraftModelProposer(lambda tokens, cache: Q.log().clone(), lambda: None, copy_gate=gate)


def test_q_mix_by_hand():
    # λ = 1/2, q(c = 3) = 0.1: q_mix = 0.5 q + 0.5 1[x = 3] = (0.05, 0.1, 0.3, 0.55)
    prop = fake_proposer(W_HALF).propose(CTX, 1, SamplingParams(1.0), torch.Generator().manual_seed(0))
    assert torch.allclose(prop.q[0], torch.tensor([0.05, 0.1, 0.3, 0.55]))
    # greedy: argmax q_mix is c (0.55 > 0.3), proposed with a one-hot row
    g = fake_proposer(W_HALF).propose(CTX, 1, SamplingParams(), torch.Generator())
    assert g.tokens == [3] and g.q[0].tolist() == [0, 0, 0, 1]
    # λ = sigmoid(-3) ≈ 0.047: 0.953 * 0.1 + 0.047 = 0.143 < 0.572: the draft's argmax 2
    assert fake_proposer([-3.0, 0, 0, 0, 0, 0]).propose(CTX, 1, SamplingParams(), torch.Generator()).tokens == [2]
    # no gate: the draft's own q; no candidate (a context without repeats): the draft's own q
    assert torch.allclose(fake_proposer(None).propose(CTX, 1, SamplingParams(1.0), torch.Generator()).q[0], Q)
    assert torch.allclose(fake_proposer(W_HALF).propose([0, 1, 2], 1, SamplingParams(1.0), torch.Generator()).q[0], Q)


def test_second_proposal_reads_the_first_in_its_context():
    # greedy with λ = 1/2: x_1 = 3 (c after (1, 2)); the context (1, 2, 3, 1, 2, 3) then ends in
    # (1, 2, 3), which ended at 2, followed by 1: x_2 = 1 (0.5 * 0.1 + 0.5 = 0.55 > 0.3)
    prop = fake_proposer(W_HALF).propose(CTX, 2, SamplingParams(), torch.Generator())
    assert prop.tokens == [3, 1]


def test_verification_with_q_mix_emits_the_targets_distribution():
    """T = 1: x ~ q_mix = (0.05, 0.1, 0.3, 0.55) from the proposer, verified against
    p = (0.4, 0.3, 0.2, 0.1) with that q_mix: the emitted token is distributed as p. By hand:
    x is accepted with probability min(1, p/q) = (1, 1, 2/3, 2/11), so α = Σ min(p, q_mix) = 0.45,
    and a rejection resamples from max(0, p - q_mix) / 0.55 = (0.35, 0.2, 0, 0) / 0.55.
    20k draws: sd of a frequency <= 0.0036; allow 4.5 sd."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    prop = fake_proposer(W_HALF)
    n = 20_000
    counts = torch.zeros(4)
    accepted = 0
    for _ in range(n):
        pr = prop.propose(CTX, 1, SamplingParams(1.0), g)
        v = verify(torch.tensor(pr.tokens), pr.q, p, greedy=False, generator=g)
        accepted += v.num_accepted
        counts[pr.tokens[0] if v.num_accepted else v.next_token] += 1
    for i in range(4):
        pi = float(p[0, i])
        assert abs(counts[i] / n - pi) < 4.5 * math.sqrt(pi * (1 - pi) / n), (i, counts / n)
    assert abs(accepted / n - 0.45) < 4.5 * math.sqrt(0.45 * 0.55 / n)


@pytest.fixture(scope="module")
def derived(target):
    return derive_draft(target, "0-1")


@pytest.mark.parametrize("gate", [[6.0, 0, 0, 0, 0, 0], [0.0] * 6, [-1.0, 2, 1, 1, -2, -1]])
@pytest.mark.parametrize("vocab", [None, torch.arange(0, 40)])
def test_greedy_with_the_copy_channel_equals_plain(target, derived, tok, gate, vocab):
    dec = SpeculativeDecoder(target, derived, tok, DecoderConfig(draft_vocab=vocab, ngram_gate=False))
    dec.copy_gate = np.asarray(gate)
    for s in ["the cat sat on the mat. the cat", "abcabcabcab", "def f(x): return x\ndef f("]:
        ids = tok(s).input_ids
        res = dec.generate(DecodeRequest(ids, max_new_tokens=24, gamma=3, ignore_eos=True, proposer="draft"))
        assert res.output_ids == reference_greedy(target, ids, 24), (s, gate)


def test_the_decoder_proposes_with_its_gate(target, derived, tok):
    """λ ≈ 1 wherever there is a candidate (bias 6): on a repetitive prompt the proposals are the
    copy candidates, so they differ from the draft's alone; None: the draft alone again."""
    dec = SpeculativeDecoder(target, derived, tok)
    ids = tok("abcabcabcabcab").input_ids
    from decoder.proposers.draft import build

    plain_draft = build(dec, None).propose(ids, 3, SamplingParams(), torch.Generator())
    dec.copy_gate = np.array([6.0, 0, 0, 0, 0, 0])
    p = build(dec, None)
    copy = p.propose(ids, 3, SamplingParams(), torch.Generator())
    # the context ends in (…, a, b), last seen followed by c: the copy channel continues c, a, b
    assert copy.tokens == tok("cab", add_special_tokens=False).input_ids
    dec.copy_gate = None
    assert build(dec, None).propose(ids, 3, SamplingParams(), torch.Generator()).tokens == plain_draft.tokens


def test_sampling_with_the_copy_channel_is_lossless_first_token_chi_square(target, derived, tok):
    """T = 1, λ = 1/2 on a context with a candidate: the first emitted token fits the target's p."""
    dec = SpeculativeDecoder(target, derived, tok)
    dec.copy_gate = W_HALF
    chi2, crit = first_token_chi_square(dec, tok("the cat the ").input_ids, 800, gamma=1)
    assert chi2 < crit, (chi2, crit)
