"""Losses against hand-computed values on small distributions with the tail bucket."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import losses as L

# One position, V = 4. Draft q over the vocabulary = (0.5, 0.125, 0.125, 0.25).
# Target top-2 = ids (2, 0) with p = (0.5, 0.25), tail 0.25.
# Buckets: p_b = (0.5, 0.25, 0.25); q_b = (q[2], q[0], q[1] + q[3]) = (0.125, 0.5, 0.375).
Q_VOCAB = torch.tensor([[0.5, 0.125, 0.125, 0.25]])
IDS = torch.tensor([[2, 0]])
P_TOP = torch.tensor([[0.5, 0.25]], dtype=torch.float16)
P_TAIL = torch.tensor([0.25])
PB = [0.5, 0.25, 0.25]
QB = [0.125, 0.5, 0.375]


def _buckets():
    p = L.teacher_buckets(P_TOP, P_TAIL)
    logq = L.student_bucket_logprobs(Q_VOCAB.log(), IDS)
    return p, logq


def test_buckets():
    p, logq = _buckets()
    assert p.tolist() == [PB]
    assert torch.allclose(logq.exp(), torch.tensor([QB]))


def test_teacher_buckets_renormalise_float16_rounding():
    p = L.teacher_buckets(torch.tensor([[0.6001, 0.3]], dtype=torch.float16), torch.tensor([0.1005]))
    assert abs(p.sum().item() - 1.0) < 1e-6


def test_tail_bucket_is_stable_when_topk_hold_almost_all_mass():
    # q = (1 - 3e-12, 1e-12, 1e-12, 1e-12): log(1 - sum exp(gathered)) would give log(0) in float32.
    logits = torch.tensor([[0.0, -27.631, -27.631, -27.631]])  # exp(-27.631) ~ 1e-12
    logq = torch.log_softmax(logits, -1)
    b = L.student_bucket_logprobs(logq, torch.tensor([[0, 1]]))
    assert math.isclose(b[0, 2].item(), math.log(2e-12), rel_tol=1e-3)


def test_buckets_from_raw_logits_equal_the_hand_worked_ones_and_their_gradient():
    """Logits (Q_VOCAB's log plus any constant) give the same buckets as log-probabilities, and the
    gradient w.r.t. the logits equals that of the two-pass form (log_softmax, then a masked
    logsumexp), computed independently here in float64."""
    logits = (Q_VOCAB.log() + 7.25).double().requires_grad_(True)
    b = L.student_bucket_logprobs(logits, IDS)
    assert torch.allclose(b.exp().float(), torch.tensor([QB]), atol=1e-6)
    p = torch.tensor([PB], dtype=torch.float64)
    L.forward_kl(p, b).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    logq = torch.log_softmax(ref_logits, -1)
    mask = torch.zeros_like(logq, dtype=torch.bool).scatter_(-1, IDS, True)
    ref = torch.cat([logq.gather(-1, IDS), torch.logsumexp(logq.masked_fill(mask, float("-inf")), -1, keepdim=True)], -1)
    L.forward_kl(p, ref).sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    # by hand: d KL / d x_v = q_v - p_b for a top-k id v = b, and q_v - p_tail q_v / q_tail for a
    # tail id: ids 2, 0 are the top-k (p .5, .25); ids 1, 3 share the tail (p .25, q .375)
    hand = [0.5 - 0.25, 0.125 - 0.25 * 0.125 / 0.375, 0.125 - 0.5, 0.25 - 0.25 * 0.25 / 0.375]
    assert torch.allclose(logits.grad, torch.tensor([hand], dtype=torch.float64), atol=1e-6)


def test_tail_bucket_is_stable_from_raw_logits():
    logits = torch.tensor([[50.0, 22.369, 22.369, 22.369]])  # q(tail ids) ~ 1e-12 each, shifted by 50
    b = L.student_bucket_logprobs(logits, torch.tensor([[0, 1]]))
    assert math.isclose(b[0, 2].item(), math.log(2e-12), rel_tol=1e-3)
    assert math.isclose(b[0, 0].item(), 0.0, abs_tol=1e-6)


def test_tail_bucket_when_k_equals_vocab_is_floored():
    b = L.student_bucket_logprobs(Q_VOCAB.log(), torch.tensor([[0, 1, 2, 3]]))
    assert b[0, 4].item() == L.LOGQ_FLOOR
    p = torch.tensor([[0.5, 0.125, 0.125, 0.25, 0.0]])
    for name in L.LOSSES:
        assert L.per_position_loss(name, p, b).item() == pytest.approx(0.0, abs=1e-6)


def test_forward_kl():
    p, logq = _buckets()
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(PB, QB))
    # = 0.5 ln 4 + 0.25 ln 0.5 + 0.25 ln(2/3)
    assert math.isclose(want, 0.5 * math.log(4) + 0.25 * math.log(0.5) + 0.25 * math.log(2 / 3))
    assert L.forward_kl(p, logq).item() == pytest.approx(want, rel=1e-5)


def test_reverse_kl():
    p, logq = _buckets()
    want = 0.125 * math.log(0.125 / 0.5) + 0.5 * math.log(0.5 / 0.25) + 0.375 * math.log(0.375 / 0.25)
    assert L.reverse_kl(p, logq).item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("beta", [0.5, 0.1, 0.9])
def test_jsd(beta):
    p, logq = _buckets()
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(PB, QB)]
    kl_pm = sum(pi * math.log(pi / mi) for pi, mi in zip(PB, m))
    kl_qm = sum(qi * math.log(qi / mi) for qi, mi in zip(QB, m))
    want = beta * kl_pm + (1 - beta) * kl_qm
    assert L.jsd(p, logq, beta).item() == pytest.approx(want, rel=1e-5)
    if beta == 0.5:  # m = (0.3125, 0.375, 0.3125), written out
        hand = 0.5 * (0.5 * math.log(0.5 / 0.3125) + 0.25 * math.log(0.25 / 0.375) + 0.25 * math.log(0.25 / 0.3125))
        hand += 0.5 * (0.125 * math.log(0.125 / 0.3125) + 0.5 * math.log(0.5 / 0.375) + 0.375 * math.log(0.375 / 0.3125))
        assert L.jsd(p, logq, 0.5).item() == pytest.approx(hand, rel=1e-5)
        assert hand <= math.log(2)


def test_jsd_rejects_degenerate_beta():
    p, logq = _buckets()
    with pytest.raises(ValueError, match="beta=1.0"):
        L.jsd(p, logq, 1.0)


def test_tv_and_alpha():
    p, logq = _buckets()
    # |p - q| = (0.375, 0.25, 0.125) -> TV = 0.375; alpha = 0.125 + 0.25 + 0.25 = 0.625 = 1 - TV
    assert L.tv(p, logq).item() == pytest.approx(0.375, rel=1e-6)
    assert L.alpha(p, logq).item() == pytest.approx(0.625, rel=1e-6)


def test_zeros_in_teacher():
    # p_b = (1, 0, 0): target certain of id 2, whose draft probability is 0.125.
    p = L.teacher_buckets(torch.tensor([[1.0, 0.0]], dtype=torch.float16), torch.tensor([0.0]))
    logq = L.student_bucket_logprobs(Q_VOCAB.log(), IDS)
    assert L.forward_kl(p, logq).item() == pytest.approx(math.log(8), rel=1e-5)
    fl = math.log(L.P_FLOOR)
    want_r = 0.125 * math.log(0.125) + 0.5 * (math.log(0.5) - fl) + 0.375 * (math.log(0.375) - fl)
    assert L.reverse_kl(p, logq).item() == pytest.approx(want_r, rel=1e-5)
    m = [0.5 + 0.0625, 0.25, 0.1875]
    want_j = 0.5 * math.log(1 / m[0]) + 0.5 * sum(qi * math.log(qi / mi) for qi, mi in zip(QB, m))
    assert L.jsd(p, logq).item() == pytest.approx(want_j, rel=1e-5)
    assert L.tv(p, logq).item() == pytest.approx(0.875, rel=1e-6)


@pytest.mark.parametrize("name", L.LOSSES)
@pytest.mark.parametrize("zeros", [False, True])
def test_gradients_finite_when_p_equals_q(name, zeros):
    # Student logits such that q_b == p_b exactly on the buckets, with and without zero buckets.
    torch.manual_seed(0)
    V, k = 16, 4
    logits = torch.randn(3, V, requires_grad=True)
    if zeros:
        # Put the draft's mass almost entirely on the top-k, teacher tail exactly 0.
        with torch.no_grad():
            logits[:, k:] = -200.0
    logq_full = torch.log_softmax(logits, -1)
    ids = torch.arange(k).expand(3, k)
    with torch.no_grad():
        qb = L.student_bucket_logprobs(logq_full, ids).exp()
        if zeros:
            qb[:, k] = 0.0
            qb[0, 1] = 0.0  # and a zero inside the top-k
            qb = qb / qb.sum(-1, keepdim=True)
    p = qb.clone()
    logq = L.student_bucket_logprobs(logq_full, ids)
    loss = L.weighted_mean(L.per_position_loss(name, p, logq), torch.ones(3))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logits.grad).all()
    if not zeros:
        assert loss.item() == pytest.approx(0.0, abs=1e-5)


def test_weighted_mean():
    v = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    assert L.weighted_mean(v, torch.tensor([1.0, 0.0, 3.0])).item() == pytest.approx(13 / 4)
    z = L.weighted_mean(v, torch.zeros(3))
    assert z.item() == 0.0
    z.backward()
    assert v.grad.tolist() == [0.0, 0.0, 0.0]


def test_unknown_loss_names_choices():
    p, logq = _buckets()
    with pytest.raises(ValueError, match="forward_kl"):
        L.per_position_loss("kl", p, logq)


# Restricted draft vocabulary (FR-Spec), one position, V = 5, S = ids (0, 2, 4) = columns 0..2.
# Draft logits over S: log(1, 2, 1) -> q_S = (0.25, 0.5, 0.25) on ids (0, 2, 4), 0 on ids 1 and 3.
# Target top-2 = ids (2, 3) with p = (0.5, 0.3), tail 0.2; id 3 is outside S.
# Draft buckets: q(2) = 0.5, q(3) = 0, tail = q(0) + q(4) = 0.5 (id 3's placeholder column 0 is
# id 0, which is not in the top-k and must stay in the tail).
def _restricted():
    logits = torch.tensor([[1.0, 2.0, 1.0]]).log()
    cols = torch.tensor([[1, 0]])  # id 2 -> column 1; id 3 absent -> placeholder 0
    present = torch.tensor([[True, False]])
    p = L.teacher_buckets(torch.tensor([[0.5, 0.3]], dtype=torch.float16), torch.tensor([0.2]))
    return logits, cols, present, p


def test_restricted_vocab_buckets_by_hand():
    logits, cols, present, p = _restricted()
    logq = L.student_bucket_logprobs(logits, cols, present)
    assert logq[0, 1].item() == L.LOGQ_FLOOR
    assert torch.allclose(logq.exp(), torch.tensor([[0.5, 0.0, 0.5]]), atol=1e-7)
    # acceptance of the served FR-Spec draft: min(.5, .5) + min(.3, 0) + min(.2, .5) = 0.7
    assert L.alpha(p, logq).item() == pytest.approx(0.7, abs=1e-3)
    # training target p(. | S): id 3's 0.3 dropped, (0.5, 0, 0.2) / 0.7
    pc = L.teacher_on_vocab(p, present)
    assert torch.allclose(pc, torch.tensor([[5 / 7, 0.0, 2 / 7]]), atol=1e-3)
    want = 5 / 7 * math.log((5 / 7) / 0.5) + 2 / 7 * math.log((2 / 7) / 0.5)
    assert L.forward_kl(pc, logq).item() == pytest.approx(want, abs=1e-3)


def test_restricted_vocab_with_every_id_present_equals_the_full_buckets():
    torch.manual_seed(1)
    logits, ids = torch.randn(4, 10), torch.randint(0, 10, (4, 3))
    ids[:, 1] = (ids[:, 0] + 1) % 10  # distinct within a row
    ids[:, 2] = (ids[:, 0] + 2) % 10
    full = L.student_bucket_logprobs(logits, ids)
    assert torch.allclose(L.student_bucket_logprobs(logits, ids, torch.ones(4, 3, dtype=torch.bool)), full)
    p = torch.softmax(torch.randn(4, 4), -1)
    assert torch.equal(L.teacher_on_vocab(p, torch.ones(4, 3, dtype=torch.bool)), p / p.sum(-1, keepdim=True))


@pytest.mark.parametrize("name", L.LOSSES)
def test_restricted_vocab_gradients_finite_when_p_equals_q(name):
    logits, cols, present, p = _restricted()
    logits = logits.clone().requires_grad_(True)
    logq = L.student_bucket_logprobs(logits, cols, present)
    pc = L.teacher_on_vocab(p, present)
    with torch.no_grad():  # a teacher equal to the draft on the restricted buckets (0 where absent)
        pc = logq.exp() * torch.tensor([[1.0, 0.0, 1.0]])
    loss = L.per_position_loss(name, pc, logq).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert loss.item() == pytest.approx(0.0, abs=1e-5)


def test_teacher_at_temperature_by_hand():
    # buckets (0.5, 0.3, 0.2 tail): T = 0.5 squares them: 0.25, 0.09, 0.04 over 0.38
    p = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.0, 0.0]])
    got = L.at_temperature(p, 0.5)
    assert torch.allclose(got[0], torch.tensor([0.25, 0.09, 0.04]) / 0.38, atol=1e-6)
    assert torch.equal(got[1], torch.zeros(3))  # no mass stays no mass
    # T = 0: one-hot at the most probable top-k bucket, never the tail (greedy picks a token)
    tail_heavy = torch.tensor([[0.1, 0.3, 0.6], [0.4, 0.4, 0.2]])
    assert torch.equal(L.at_temperature(tail_heavy, 0.0), torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert L.at_temperature(p, 1.0) is p
    # T = 2: square roots
    r = torch.tensor([0.5, 0.3, 0.2]).sqrt()
    assert torch.allclose(L.at_temperature(p[:1], 2.0)[0], r / r.sum(), atol=1e-6)
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature="):
            L.at_temperature(p, bad)


def test_forward_kl_at_temperature_zero_is_cross_entropy_on_the_top1():
    p = torch.tensor([[0.2, 0.5, 0.3]])
    logq = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    ce = -math.log(0.6)
    assert L.forward_kl(L.at_temperature(p, 0.0), logq).item() == pytest.approx(ce, abs=1e-6)


def test_teacher_at_each_rows_own_temperature():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.1, 0.3, 0.6]])
    got = L.at_temperature(p, torch.tensor([0.0, 0.5, 1.0]))
    assert torch.allclose(got[0], torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(got[1], torch.tensor([0.25, 0.09, 0.04]) / 0.38, atol=1e-6)
    assert torch.allclose(got[2], p[2])
    with pytest.raises(ValueError, match="temperature="):
        L.at_temperature(p, torch.tensor([0.0, -1.0, 1.0]))


def test_copy_mixture_on_buckets_hand_worked():
    """q = (0.5, 0.3 | tail 0.2). Row 0: candidate in top-k column 1, z = 0 (λ = 1/2):
    (0.25, 0.15 + 0.5, 0.1). Row 1: candidate in the tail, z = log 3 (λ = 3/4):
    (0.125, 0.075, 0.05 + 0.75). Row 2: no candidate: q unchanged."""
    import math

    from trainer.losses import mix_copy_logq

    logq = torch.tensor([[0.5, 0.3, 0.2]] * 3).log()
    out = mix_copy_logq(logq, torch.tensor([1, 2, 0]), torch.tensor([0.0, math.log(3.0), 5.0]),
                        torch.tensor([True, True, False])).exp()
    assert torch.allclose(out, torch.tensor([[0.25, 0.65, 0.1], [0.125, 0.075, 0.8], [0.5, 0.3, 0.2]]), atol=1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(3))
