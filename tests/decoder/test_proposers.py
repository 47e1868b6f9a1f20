"""Proposers (decoder/proposers/): the n-gram lookup by hand, lossless decoding with it
(greedy equals plain token for token; T = 1 first-token chi-square), the decoder's on_step
hook, the accepted count at an EOS cut, and the goodput controller choosing among proposers
on hand-computed rates."""

from __future__ import annotations

import math

import pytest
import torch

from decoder.control import ControllerConfig, GoodputController
from decoder.metrics import StepStats
from decoder.proposers.ngram import NgramHistory, NgramProposer
from decoder.sampling import SamplingParams, process_logits
from decoder.speculative import DecodeRequest, DecoderConfig, FixedGamma, SpeculativeDecoder
from test_speculative import _chi2_crit_001, _chi_square, speculating_from_the_first_token
from tiny import reference_greedy

GREEDY = SamplingParams()


def enc(tok, s):
    return tok(s, add_special_tokens=False)["input_ids"]


def test_ngram_proposes_the_continuation_of_the_longest_earlier_match():
    h = NgramHistory(max_n=3, min_n=1)
    p = NgramProposer(h, "w", vocab_size=10)
    ids = [5, 6, 7, 8, 9, 6, 7]
    p.start(ids, True)
    # suffix (9, 6, 7) never occurred before; (6, 7) ended at index 3 -> continuation ids[3:6]
    prop = p.propose(ids, 3, GREEDY, torch.Generator())
    assert prop.tokens == [8, 9, 6]
    assert prop.q.shape == (3, 10)
    assert prop.q.sum(-1).tolist() == [1.0, 1.0, 1.0] and prop.q[0, 8] == 1 and prop.q[2, 6] == 1
    # the most recent occurrence wins: (1,) ends at 1 and at 4; continuation from 4
    ids2 = [1, 2, 3, 1, 4, 1]
    p.start(ids2, True)
    assert p.propose(ids2, 2, GREEDY, torch.Generator()).tokens == [4, 1]
    # no earlier occurrence of any suffix, empty history: no proposal
    p.start([1, 2, 3], True)
    assert p.propose([1, 2, 3], 4, GREEDY, torch.Generator()).tokens == []


def test_ngram_history_is_per_workload_and_bounded():
    h = NgramHistory(max_n=2, min_n=1, max_tokens=6)
    h.add("code", [1, 2, 3, 4])
    p = NgramProposer(h, "code", vocab_size=10)
    p.start([9, 2, 3], True)
    assert p.propose([9, 2, 3], 3, GREEDY, torch.Generator()).tokens == [4]  # (2, 3) -> 4 from history
    other = NgramProposer(h, "prose", vocab_size=10)
    other.start([9, 2, 3], True)
    assert other.propose([9, 2, 3], 3, GREEDY, torch.Generator()).tokens == []
    h.add("code", [7, 7, 8, 8, 5])  # 4 + 5 tokens > 6: the first request is dropped
    assert h.tokens("code") == 5
    p.start([9, 2, 3], True)
    assert p.propose([9, 2, 3], 3, GREEDY, torch.Generator()).tokens == []
    with pytest.raises(ValueError, match="min_n"):
        NgramHistory(max_n=1, min_n=2)


def test_ngram_greedy_equals_plain_and_learns_from_the_workload(target, other_draft, tok):
    # ungated: the gate's choices follow measured step times (tested on their own below), and on a
    # loaded host they can turn down a match this test counts on
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(ngram_gate=False))
    ids = enc(tok, "the cat sat on the mat. the cat")
    ref = reference_greedy(target, ids, 24)
    first = dec.generate(DecodeRequest(ids, GREEDY, 24, gamma=4, ignore_eos=True, workload="w", proposer="ngram"))
    assert first.output_ids == ref and first.proposer == "ngram"
    assert first.record()["proposer"] == "ngram"
    # the same request again: its own earlier output is in the workload's history now
    again = dec.generate(DecodeRequest(ids, GREEDY, 24, gamma=4, ignore_eos=True, workload="w", proposer="ngram"))
    assert again.output_ids == ref
    assert again.counts.num_accepted_tokens > first.counts.num_accepted_tokens
    assert again.counts.num_steps < first.counts.num_steps
    # plain requests feed the history too: a fresh workload learns from a plain request
    dec.generate(DecodeRequest(ids, GREEDY, 24, gamma=0, ignore_eos=True, workload="fresh"))
    learned = dec.generate(DecodeRequest(ids, GREEDY, 24, gamma=4, ignore_eos=True, workload="fresh",
                                         proposer="ngram"))
    assert learned.output_ids == ref
    assert learned.counts.num_accepted_tokens > first.counts.num_accepted_tokens


def test_ngram_sampling_is_lossless_first_token_chi_square(target, other_draft, tok):
    """T = 1: the first emitted token is distributed as the target's p, whether the one-hot
    proposal (the target's argmax, planted in the history) is accepted or rejected."""
    dec = SpeculativeDecoder(target, other_draft, tok)
    ids = enc(tok, "hello world, hi")
    params = SamplingParams(1.0)
    with torch.inference_mode():
        p = process_logits(target(input_ids=torch.tensor([ids])).logits[0, -1], params)
    assert_planted_first_token_is_lossless(dec, ids, p, params)


def assert_planted_first_token_is_lossless(dec, ids, p, params, n: int = 600):
    """Plant the target's argmax x as the n-gram proposal (history clear, then ids[-4:] + [x, x])
    and decode the first token ``n`` times at ``params`` (seeds 0..n-1): its counts must fit p
    (chi-square, 0.1 %), x must be accepted with probability p(x) (4 sigma), and both the accepted
    and the rejected path must occur."""
    top = int(p.argmax())
    accepted = 0
    counts = torch.zeros_like(p)
    with speculating_from_the_first_token(dec):  # the first token from a verification of ids[-1] + [x]
        for s in range(n):
            dec.ngram_history.clear()
            dec.ngram_history.add("w", ids[-4:] + [top, top])
            r = dec.generate(DecodeRequest(ids, SamplingParams(params.temperature, params.top_p, params.top_k, seed=s),
                                           max_new_tokens=2, gamma=1, ignore_eos=True, workload="w", proposer="ngram"))
            assert r.steps[0].proposed == 1
            accepted += r.steps[0].accepted
            counts[r.output_ids[0]] += 1
    chi2, df = _chi_square(counts, p, n)
    assert chi2 < _chi2_crit_001(max(df, 1)), (chi2, df)
    pt = float(p[top])  # acceptance of a one-hot proposal x has probability p(x)
    assert abs(accepted / n - pt) < 4 * math.sqrt(pt * (1 - pt) / n) + 1e-9
    assert 0 < accepted < n  # both paths exercised


def test_on_step_streams_every_token_and_cancels(target, tok):
    dec = SpeculativeDecoder(target, target, tok)
    ids = enc(tok, "stream me")
    chunks: list[list[int]] = []
    r = dec.generate(DecodeRequest(ids, GREEDY, 12, gamma=3, ignore_eos=True), on_step=lambda t: chunks.append(t))
    assert sum(chunks, []) == r.output_ids == reference_greedy(target, ids, 12)
    assert len(chunks) == len(r.steps) == r.counts.num_steps + 1  # the prefill's token, then each step's
    seen: list[list[int]] = []
    r2 = dec.generate(DecodeRequest(ids, GREEDY, 12, gamma=0, ignore_eos=True),
                      on_step=lambda t: seen.append(t) or len(seen) < 3)
    assert r2.finish_reason == "cancelled" and len(r2.output_ids) == 3 == len(sum(seen, []))


def test_accepted_tokens_stop_at_an_eos_cut(target, tok):
    """The target drafting for itself accepts all 8 proposals; an EOS at output index k cuts the
    block after k + 1 tokens, so only those k + 1 accepted proposals count (issue 16, item 7)."""
    dec = SpeculativeDecoder(target, target, tok)
    for text in ("count me", "hello", "abc", "xyz 123", "the end", "q?", "zz top"):
        ids = enc(tok, text)
        plain = reference_greedy(target, ids, 9)
        k = next((i for i in range(2, 8) if plain[i] not in plain[:i]), None)  # first occurrence at k
        if k is not None:
            break
    assert k is not None, "no prompt whose greedy output has a new token at index 2..7"
    dec.eos_ids = frozenset({plain[k]})
    r = dec.generate(DecodeRequest(ids, GREEDY, 30, gamma=8))
    assert r.output_ids == plain[: k + 1] and r.finish_reason == "eos"
    # token 0 from the prefill's last row; the first verification proposes plain[1:9], cut after plain[k]
    assert [s.proposed for s in r.steps] == [0, 8]
    assert r.counts.num_accepted_tokens == k
    assert r.record()["accepted_tokens"] == k
    assert r.counts.acceptance_rate == pytest.approx(k / 8)


def test_controller_picks_the_proposer_and_gamma_with_the_best_hand_computed_rate():
    ctl = GoodputController(ControllerConfig(gamma_max=6, gamma_init=4, probe_every=50, min_steps=2,
                                             proposers=("draft", "ngram")))
    key = ("code", "greedy")
    for _ in range(4):
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 10.0))  # plain step: 10 ms
        # draft: α 0.2, 5 ms per draft token, verify of 2 rows 10.5 ms
        ctl.observe(key, StepStats(1, 0, 1, 0, 0.2, 5.0, 10.5), proposer="draft")
        # ngram asked 4, always 3 accepted, verify of 5 rows 12 ms, lookup 0.1 ms
        ctl.observe(key, StepStats(4, 3, 4, 3, 3.0, 0.1, 12.0, 4), proposer="ngram")
    gamma, d = ctl._choose(key)
    # ngram: E[tokens | γ] = 1 + Σ_{j<=γ} P(acc >= j) = 1 + min(γ, 3). γ = 4 measured: 4 / 12.1.
    # γ = 3 unmeasured: 0.1 + t_verify(3), the line through (1, 10), (2, 10.5), (5, 12) at 4 rows.
    xs, ys = [1, 2, 5], [10.0, 10.5, 12.0]
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    r3 = 4.0 / (0.1 + my + slope * (4 - mx))
    assert d["tokens_per_ms_by_proposer"]["ngram"][4] == pytest.approx(4 / 12.1, abs=1e-5)
    assert d["tokens_per_ms_by_proposer"]["ngram"][3] == pytest.approx(r3, abs=1e-5)
    assert (gamma, d["proposer"]) == (3, "ngram") and r3 > 4 / 12.1 > 0.1
    assert d["why"].startswith("ngram γ=3")
    pol = ctl.policy_for(key)
    assert pol.gamma() == 3 and pol.proposer_name() == "ngram"


def test_controller_warms_up_each_proposer_then_plain():
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=2, min_steps=1, proposers=("ngram", "draft")))
    key = ("w", "greedy")
    _, d = ctl._choose(key)
    assert (d["gamma"], d["proposer"]) == (2, "ngram")
    ctl.observe(key, StepStats(2, 1, 2, 1, 1.0, 0.1, 11.0, 2), proposer="ngram")
    _, d = ctl._choose(key)
    assert (d["gamma"], d["proposer"]) == (2, "draft")
    ctl.observe(key, StepStats(2, 1, 2, 1, 1.0, 4.0, 11.0), proposer="draft")
    _, d = ctl._choose(key)
    assert d["gamma"] == 0 and d["why"].startswith("warm-up: measuring plain")
    with pytest.raises(ValueError, match="proposers"):
        ControllerConfig(proposers=("medusa",))


def test_decoder_follows_the_controllers_proposer(target, other_draft, tok):
    from decoder.tracking import key_of

    dec = SpeculativeDecoder(target, other_draft, tok)
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=1, proposers=("ngram", "draft")))
    ids = enc(tok, "abcabcabc")
    req = DecodeRequest(ids, GREEDY, 8, ignore_eos=True, workload="w")
    r = dec.generate(req, ctl.policy_for(key_of(req)))
    assert r.proposer == "ngram" and r.output_ids == reference_greedy(target, ids, 8)
    assert r.steps[0].asked == 0 and r.steps[1].asked == 3  # the prefill's token, then γ = 3
    r = dec.generate(req, ctl.policy_for(key_of(req)))
    assert r.proposer == "draft" and r.output_ids == reference_greedy(target, ids, 8)
    for _ in range(3):  # warmed up: the best candidate serves; the record names it
        pol = ctl.policy_for(key_of(req))
        r = dec.generate(req, pol)
        assert r.output_ids == reference_greedy(target, ids, 8)
        assert r.proposer == (pol.proposer_name() or "none") == (pol.decision["proposer"] or "none")


def test_ngram_index_stays_bounded_when_old_requests_drop_out():
    """Dropped requests take their index entries with them (QA: the index grew ~0.5 GB per
    million tokens served while the history kept 64k)."""
    g = torch.Generator().manual_seed(0)
    h = NgramHistory(max_n=3, min_n=1, max_tokens=300)
    for _ in range(200):
        h.add("w", torch.randint(0, 50_000, (100,), generator=g).tolist())
    w = h._w["w"]
    assert w.total <= 300
    assert len(w.index) <= 3 * w.total  # at most max_n - min_n + 1 entries per kept token
    assert all(seq in w.by_seq for seq, _ in w.index.values())
    # the newest request is still found
    last = w.seqs[-1][1]
    p = NgramProposer(h, "w", vocab_size=50_000)
    p.start([7, last[10], last[11]], True)
    assert p.propose([7, last[10], last[11]], 2, GREEDY, torch.Generator()).tokens == last[12:14]


def test_ngram_never_proposes_ids_outside_the_targets_vocabulary():
    h = NgramHistory(max_n=2)
    h.add("w", [1, 2, 3, 99, 4])  # 99 >= vocab 10: a history filled by another tokenizer
    p = NgramProposer(h, "w", vocab_size=10)
    p.start([5, 2], True)
    assert p.propose([5, 2], 3, GREEDY, torch.Generator()).tokens == [3]


def test_controller_decision_says_warm_up_until_every_candidate_is_measured():
    ctl = GoodputController(ControllerConfig(gamma_max=4, gamma_init=3, min_steps=2, proposers=("ngram", "draft")))
    key = ("w", "greedy")
    for _ in range(2):
        ctl.observe(key, StepStats(3, 3, 4, -1, 3.0, 0.1, 11.0, 3), proposer="ngram")
    d = ctl.decision(key)
    assert d["gamma"] is None and not d["speculate"] and d["why"] == "warm-up: measuring draft at γ=3"
    _, chosen = ctl._choose(key)
    assert (chosen["proposer"], chosen["gamma"]) == ("draft", 3)


def test_controller_survives_zero_and_non_finite_timings():
    for props in (("draft",), ("ngram", "draft")):
        ctl = GoodputController(ControllerConfig(gamma_max=3, gamma_init=2, min_steps=1, proposers=props))
        key = ("w", "greedy")
        ctl.observe(key, StepStats(0, 0, 1, -1, 0.0, 0.0, 0.0))
        ctl.observe(key, StepStats(2, 1, 2, 1, 1.0, 0.0, 0.0, 2), proposer=props[0])
        ctl.observe(key, StepStats(2, 1, 2, 1, 1.0, float("nan"), float("inf"), 2), proposer=props[-1])
        for _ in range(4):
            ctl._choose(key)
        import json

        json.dumps(ctl.status(), allow_nan=False)
    with pytest.raises(ValueError, match="probe_every"):
        ControllerConfig(probe_every=0)
    assert ControllerConfig(proposers="ngram").proposers == ("ngram",)


def test_a_requests_own_gamma_runs_the_first_configured_proposer(target, other_draft, tok):
    from decoder.loop import ServingLoop

    dec = SpeculativeDecoder(target, other_draft, tok)
    ctl = GoodputController(ControllerConfig(proposers=("ngram",)))
    ids = enc(tok, "abcabcabcabc")
    with ServingLoop(dec, controller=ctl) as loop:
        r = loop.generate(DecodeRequest(ids, GREEDY, 8, gamma=3, ignore_eos=True, workload="w"))
    assert r.proposer == "ngram" and r.output_ids == reference_greedy(target, ids, 8)
    assert "the request's gamma" in r.policy
    assert ctl._keys[("w", "greedy")].lengths["ngram"].steps >= 1  # its steps fed the controller


def test_every_registered_proposer_is_built_from_its_spec(target, other_draft, tok):
    """decoder/proposers/registry.py is the one list: the decoder builds each registered proposer
    from its spec, the CLI's list and a request's list come from the specs, and an unknown name
    is refused naming the known ones."""
    from decoder.eagle import EagleHead
    from decoder.proposers.registry import PROPOSERS, REQUEST_PROPOSERS, SPECS, spec

    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig())
    dec.eagle_head = EagleHead.from_target(target)
    req = DecodeRequest(enc(tok, "hello"), GREEDY, 4)
    for name, s in SPECS.items():
        assert spec(name) is s and dec.make_proposer(name, req).name == name
        assert getattr(dec.make_proposer(name, req), "needs_features", False) == s.needs_features
    assert PROPOSERS == ("draft", "ngram") and REQUEST_PROPOSERS == ("draft", "ngram", "eagle")
    with pytest.raises(ValueError, match=r"proposer 'nope': use one of \('draft', 'ngram', 'eagle'\)"):
        dec.make_proposer("nope", req)


def test_proposer_names_are_literals_only_in_the_proposers_package():
    """decoder/ asks the registry and the specs, it does not match proposer names: outside
    decoder/proposers/ no string constant is a proposer's name (messages that mention one are
    sentences, not names)."""
    import ast
    from pathlib import Path

    from decoder.proposers.registry import SPECS

    root = Path(__file__).resolve().parents[2] / "decoder"
    found = [f"{f.relative_to(root.parent)}:{n.lineno} {n.value!r}"
             for f in sorted(root.rglob("*.py")) if "proposers" not in f.relative_to(root).parts
             for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Constant) and n.value in SPECS]
    assert found == []
