"""Speculative sampling math against hand-worked distributions."""

import math

import pytest
import torch

from decoder.metrics import AcceptanceCounts, StepStats
from decoder.sampling import (SamplingParams, alpha, argmax, topk_rows, verify_greedy, expected_tokens_per_step, predicted_speedup, process_logits,
                              residual_distribution, sample, verify)


def test_residual_hand_worked():
    p, q = torch.tensor([0.6, 0.4]), torch.tensor([0.8, 0.2])
    # max(0, p - q) = [0, 0.2] -> normalised [0, 1]
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.0, 1.0]))
    assert alpha(p, q).item() == pytest.approx(0.8)  # min(.6,.8) + min(.4,.2)


def test_residual_equal_distributions_is_p_not_nan():
    p = torch.tensor([0.25, 0.25, 0.5])
    r = residual_distribution(p, p.clone())
    assert not torch.isnan(r).any()
    assert torch.allclose(r, p)


def test_verify_output_distribution_is_target():
    """q = [0.8, 0.2], p = [0.6, 0.4]: the emitted token must be distributed as p.

    Accept token 0 w.p. 0.8 * 0.75 = 0.6; token 1 is accepted always (0.2) or recovered after
    rejecting token 0 (0.2) -> 0.4. 40k draws: sd of the frequency is 0.0024; allow 4.5 sd."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.8, 0.2]])
    p = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    n, ones = 40_000, 0
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g)
        v = verify(x, q, p, greedy=False, generator=g)
        ones += v.next_token if v.num_accepted == 0 else int(x)
    assert abs(ones / n - 0.4) < 4.5 * math.sqrt(0.24 / n)


def test_sample_draws_the_given_distribution_and_never_a_zero():
    """p = [0.1, 0, 0.6, 0.3, 0] (and the same unnormalised, x 7): 120k draws per row, each
    frequency within 4.5 sd of p; the zero-probability ids are never drawn."""
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    n = 120_000
    x = sample(torch.stack([p, 7 * p]).expand(n, 2, 5), g)
    assert x.shape == (n, 2) and x.dtype == torch.int64
    for row in (0, 1):
        freq = torch.bincount(x[:, row], minlength=5).double() / n
        assert freq[1] == 0 and freq[4] == 0
        sd = torch.sqrt(p.double() * (1 - p.double()) / n)
        assert (freq - p.double()).abs().max() <= 4.5 * sd.max()


def test_sample_redraws_when_the_uniform_lands_on_the_total(monkeypatch):
    """u = 1 (u * total == total) would index past the last positive id; that row is redrawn
    exactly instead of returning a zero-probability id."""
    import decoder.sampling as S

    real = torch.rand
    monkeypatch.setattr(S.torch, "rand", lambda *a, **k: real(*a, **k).fill_(1.0))
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.3, 0.5]])
    x = sample(p, torch.Generator().manual_seed(0))
    assert x[0] in (0, 1) and x[1] == 3


@pytest.mark.parametrize("row", [[0.5, float("nan"), 0.5], [0.5, -0.3, 0.5], [0.1, float("-inf"), 0.2],
                                 [0.1, float("inf"), 0.0], [0.0, 0.0, 0.0]])
def test_sample_refuses_a_row_that_is_not_a_distribution(row):
    """torch.multinomial raised on these; the inverse transform would quietly return an id."""
    with pytest.raises(ValueError, match="cannot sample row 1: probabilities must be finite"):
        sample(torch.tensor([[0.2, 0.8, 0.0], row]), torch.Generator().manual_seed(0))


def test_verify_greedy_counts_only_the_prefix():
    """Accept flags [1, 0, 1] count 1 accepted, not 2; the correction is p's argmax at 2."""
    V = 5
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 4, 2]), V).float()  # target argmax per position
    proposals = torch.tensor([3, 0, 4])  # matches, mismatches, would match
    q = torch.nn.functional.one_hot(proposals, V).float()
    v = verify(proposals, q, p, greedy=True)
    assert (v.num_accepted, v.next_token, v.rejected_at) == (1, 1, 1)
    v = verify(torch.tensor([3, 1, 4]), q, p, greedy=True)
    assert (v.num_accepted, v.next_token, v.rejected_at) == (3, 2, -1)  # bonus = argmax p_4


def test_verify_zero_gamma_is_plain_sampling():
    p = torch.tensor([[0.0, 1.0, 0.0]])
    v = verify(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), p, greedy=False,
               generator=torch.Generator().manual_seed(1))
    assert (v.num_accepted, v.next_token, v.rejected_at) == (0, 1, -1)


def test_process_logits_top_p_top_k_temperature():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # top-p 0.8: mass before token 3rd is 0.8 >= 0.8 -> dropped; keep [.5, .3] renormalised
    assert torch.allclose(process_logits(logits, SamplingParams(1.0, top_p=0.8)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(process_logits(logits, SamplingParams(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    # temperature 2: p^(1/2) renormalised
    s = probs.sqrt()
    assert torch.allclose(process_logits(logits, SamplingParams(2.0)), s / s.sum())
    assert process_logits(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(-1.0)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(1.0, top_p=0.0)
    assert SamplingParams(0.7, top_p=0.9).bucket() == "t0.7-p0.9"
    assert SamplingParams().bucket() == "greedy"


def test_accounting_hand_worked():
    c = AcceptanceCounts()
    c.add_step(StepStats(proposed=3, accepted=1, emitted=2, rejected_at=1, alpha_sum=1.5, draft_ms=3, verify_ms=5))
    c.add_step(StepStats(proposed=3, accepted=3, emitted=4, rejected_at=-1, alpha_sum=2.7, draft_ms=3, verify_ms=5))
    c.add_step(StepStats(proposed=0, accepted=0, emitted=1, rejected_at=-1, alpha_sum=0.0, draft_ms=0, verify_ms=4))
    assert c.acceptance_rate == pytest.approx(4 / 6)
    assert c.mean_accepted_length == pytest.approx(7 / 3)  # bonus included, plain step counted
    assert c.alpha == pytest.approx(4.2 / 6)
    assert c.acceptance_per_position == [1.0, 0.5, 0.5]
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (2, 6, 4)
    assert math.isnan(AcceptanceCounts().acceptance_rate)
    assert AcceptanceCounts().summary()["alpha"] is None


def test_leviathan_formulas():
    # (1 - .8^5) / ((1 - .8)(4 * .1 + 1)) = 0.67232 / 0.28
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx(0.67232 / 0.28)
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_sample_names_a_bad_row_by_its_leading_index_and_takes_no_rows():
    """A (2, 3, V) batch with a NaN at [1, 1] names (1, 1), not the flattened row 4; (0, V) and
    (2, 0, V) give an empty result of the leading shape (min() over no rows raised before)."""
    p = torch.full((2, 3, 4), 0.25)
    p[1, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"cannot sample row \(1, 1\)"):
        sample(p, torch.Generator().manual_seed(0))
    for shape in [(0, 5), (2, 0, 5)]:
        out = sample(torch.ones(shape), torch.Generator().manual_seed(0))
        assert out.shape == shape[:-1] and out.dtype == torch.long


# ---- seeds over the signed 64-bit range -----------------------------------------------------------
def _mt_init_genrand(s: int) -> list[int]:
    """mt19937's init_genrand (Matsumoto & Nishimura's reference code), 624 words."""
    mt = [s & 0xFFFFFFFF]
    for i in range(1, 624):
        mt.append((1812433253 * (mt[-1] ^ (mt[-1] >> 30)) + i) & 0xFFFFFFFF)
    return mt


def _mt_init_by_array(key: list[int]) -> list[int]:
    """mt19937's init_by_array (the reference code), 624 words."""
    mt, n = _mt_init_genrand(19650218), 624
    i, j = 1, 0
    for _ in range(max(n, len(key))):
        mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525)) + key[j] + j) & 0xFFFFFFFF
        i, j = i + 1, j + 1
        if i >= n:
            mt[0], i = mt[n - 1], 1
        if j >= len(key):
            j = 0
    for _ in range(n - 1):
        mt[i] = ((mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941)) - i) & 0xFFFFFFFF
        i += 1
        if i >= n:
            mt[0], i = mt[n - 1], 1
    mt[0] = 0x80000000
    return mt


def _mt_words(g: torch.Generator) -> list[int]:
    import struct

    return list(struct.unpack_from("<624Q", bytes(g.get_state().tolist()), 24))


@pytest.mark.parametrize("seed", [0, 1, 5, 2**32 - 1])
def test_seeds_below_2_32_draw_as_torch_seeds_them(seed):
    from decoder.sampling import seeded_generator

    g = seeded_generator(seed)
    assert _mt_words(g) == _mt_init_genrand(seed)  # also pins the state layout the generator writes into
    assert torch.equal(torch.rand(64, generator=g), torch.rand(64, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("seed", [1 + 2**32, -1, 2**63 - 1, -(2**63), 2**40 + 12345])
def test_other_int64_seeds_get_mt19937_init_by_array_of_their_two_words(seed):
    from decoder.sampling import seeded_generator

    u = seed % 2**64
    g = seeded_generator(seed)
    assert _mt_words(g) == _mt_init_by_array([u & 0xFFFFFFFF, u >> 32])
    assert g.initial_seed() == u
    draws = torch.rand(20000, generator=g)
    assert abs(float(draws.mean()) - 0.5) < 0.01  # a working stream (sd of the mean 0.002)
    again = torch.rand(64, generator=seeded_generator(seed))
    assert torch.equal(again, draws[:64])
    low = torch.rand(64, generator=seeded_generator(u & 0xFFFFFFFF))  # the seed torch would have kept
    assert not torch.equal(again, low)


def test_a_seed_outside_64_bits_is_refused():
    from decoder.sampling import seeded_generator

    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="64-bit"):
            seeded_generator(seed)


def test_argmax_gives_torchs_ids_ties_nan_and_strides():
    # hand-built rows: a tie (lowest id wins), a NaN (counts as the largest), all -inf, one row
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0],
                      [0.0, float("nan"), 5.0, float("nan")],
                      [float("-inf")] * 4,
                      [-2.0, -1.0, -3.0, -1.5]])
    assert argmax(x).tolist() == [1, 1, 0, 1]
    assert argmax(x).dtype == torch.int64
    g = torch.Generator().manual_seed(0)
    big = torch.randn(5, 49152, generator=g)
    big[2, 7], big[2, 40000] = 100.0, 100.0  # a tie far apart
    assert torch.equal(argmax(big), big.argmax(-1)) and int(argmax(big)[2]) == 7
    assert torch.equal(argmax(big.t().contiguous().t()), big.argmax(-1))  # a non-contiguous view
    assert torch.equal(argmax(big[:, ::3]), big[:, ::3].argmax(-1))
    assert int(argmax(big[3])) == int(big[3].argmax())  # one row: a 0-d result
    assert torch.equal(argmax(big.double()), big.argmax(-1))
    assert torch.equal(argmax(big.bfloat16()), big.bfloat16().argmax(-1))  # torch's path
    w = big.clone().requires_grad_()
    assert torch.equal(argmax(w), big.argmax(-1))


def test_greedy_process_logits_is_the_one_hot_of_the_argmax():
    x = torch.tensor([[0.5, 2.0, 2.0], [-1.0, -3.0, -2.0]])
    p = process_logits(x, SamplingParams())
    assert p.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]] and p.dtype == torch.float32
    assert process_logits(torch.tensor([0.0, 1.0]), SamplingParams()).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("shape", [(1, 49152), (5, 49152), (2, 3, 49152), (49152,), (0, 49152), (4, 640), (3, 100)])
def test_topk_rows_is_the_softmaxs_top_k(shape):
    # the reference: the full softmax, then torch's top-k over all V (the blocked path must agree bit for bit)
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    for scale in (0.5, 4.0, 30.0):
        x = torch.randn(*shape, generator=g) * scale
        for k in (1, 32, 64):
            ids, probs, tail = topk_rows(x, k)
            top = torch.topk(torch.softmax(x, -1), min(k, shape[-1]), dim=-1)
            assert torch.equal(ids, top.indices.to(torch.int32)) and torch.equal(probs, top.values)
            assert torch.equal(tail, (1.0 - top.values.sum(-1)).clamp_min(0.0))
    # a hand-worked row: logits log(4), log(2), log(1), log(1) -> p = 1/2, 1/4, 1/8, 1/8
    ids, probs, tail = topk_rows(torch.tensor([[math.log(4), math.log(2), 0.0, 0.0]]), 2)
    assert ids.tolist() == [[0, 1]] and torch.allclose(probs, torch.tensor([[0.5, 0.25]])) and abs(float(tail) - 0.25) < 1e-6
    # exact ties at the k-th place: any of the tied ids, each at its (equal) probability
    x = torch.full((1, 49152), -5.0)
    x[0, 100] = 3.0
    ids, probs, _ = topk_rows(x, 3)
    assert int(ids[0, 0]) == 100 and ids[0, 1] != ids[0, 2] and probs[0, 1] == probs[0, 2] == torch.softmax(x, -1)[0, 0]


def test_verify_greedy_from_argmax_ids_matches_verify_on_one_hot_rows():
    # proposals 5, 7, 9 against target argmaxes 5, 7, 2, 4: two accepted, the recovered token is 2
    v = verify_greedy([5, 7, 9], [5, 7, 2, 4])
    assert (v.num_accepted, v.next_token, v.rejected_at) == (2, 2, 2)
    assert verify_greedy([5, 7], [5, 7, 3]) == verify(torch.tensor([5, 7]), torch.zeros(2, 10),
                                                      torch.nn.functional.one_hot(torch.tensor([5, 7, 3]), 10).float(), True)
    assert verify_greedy([], [8]).next_token == 8 and verify_greedy([1], [0, 3]).num_accepted == 0
    with pytest.raises(ValueError, match="need 3"):
        verify_greedy([1, 2], [1, 2])
