"""Distillation losses between the target's stored top-k distribution and the draft.

Notation follows the speculative decoding papers: ``p`` is the target (teacher), ``q`` the draft
(student). The teacher is known only on its top-k support plus one "other" bucket holding the
tail mass, so every divergence here is computed over the same k + 1 buckets:

    p_b = (p(x_1), ..., p(x_k), 1 - sum_i p(x_i))          # target, from the record
    q_b = (q(x_1), ..., q(x_k), 1 - sum_i q(x_i))          # draft, from its full-vocab softmax

Merging the tail into one bucket is a coarsening of both distributions, so each loss below is a
proper divergence on the bucketed distributions and a lower bound of the full-vocabulary one
(data-processing inequality).

All functions are pure: they take tensors and return tensors, per position. ``N`` is the number
of output positions, ``k`` the top-k width, ``V`` the draft's vocabulary size.
"""

from __future__ import annotations

import math

import torch

# Floor for teacher probabilities inside logarithms (reverse KL needs log p where p may be 0).
P_FLOOR = 1e-8
# Floor for the draft's bucket log-probabilities: exp(-80) ~ 1e-35, far below any real mass,
# and keeps 0 * log q finite when a bucket is empty (k == V leaves no tail).
LOGQ_FLOOR = -80.0

LOSSES = ("forward_kl", "reverse_kl", "jsd", "tv")


def teacher_buckets(topk_probs: torch.Tensor, tail_mass: torch.Tensor) -> torch.Tensor:
    """The target's distribution over k + 1 buckets, renormalised to sum to 1.

    The record stores top-k probabilities in float16 and the tail in float32, so the row sums
    to 1 only within ~1e-3; we clamp negatives to 0 and renormalise in float32.

    Args:
        topk_probs: (N, k) target probabilities of its k most probable tokens.
        tail_mass: (N,) 1 - sum of those probabilities.

    Returns:
        (N, k + 1) float32, rows summing to 1; the last column is the tail bucket.
    """
    p = torch.cat([topk_probs.float(), tail_mass.float().unsqueeze(-1)], dim=-1).clamp_min(0.0)  # (N, k+1)
    return p / p.sum(dim=-1, keepdim=True).clamp_min(P_FLOOR)


def teacher_on_vocab(p: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """The teacher's buckets conditioned on a restricted draft vocabulary S (FR-Spec).

    A draft whose head covers only S has q(x) = 0 outside S, so its acceptance is
    alpha_S = sum_{x in S} min(p(x), q(x)) <= p(S), with equality for any q >= p on S, which
    p(. | S) = p / p(S) gives. So the training target is p with the top-k buckets outside S
    zeroed and the rest renormalised; the tail bucket is kept whole (the record does not say
    how much of it lies in S, so this assumes all of it does).

    Args:
        p: (N, k + 1) teacher buckets from ``teacher_buckets``; the last column is the tail.
        present: (N, k) bool, True where the top-k id lies in S.

    Returns:
        (N, k + 1) float32 rows summing to 1 (a row with all its mass outside S stays 0).
    """
    keep = torch.cat([present, torch.ones_like(present[:, :1])], dim=-1)  # (N, k+1)
    q = p * keep
    return q / q.sum(dim=-1, keepdim=True).clamp_min(P_FLOOR)


def at_temperature(p: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """The teacher's buckets as a request at ``temperature`` samples them: p_T ∝ p^(1/T).

    Acceptance is measured on the processed distributions (Leviathan et al. 2023, §3.1 apply
    the same transform to p and q), so a draft serving greedy requests is accepted where its
    argmax is the target's, not where its T = 1 distribution overlaps the target's: distilling
    towards p at the served temperature spends the draft's capacity on that (DistillSpec, Zhou
    et al. 2023, §4: the best divergence depends on the decoding strategy). T = 1 returns ``p``;
    T = 0 is greedy decoding's target, one-hot at the most probable top-k bucket (forward KL then
    is the cross-entropy on the target's top-1). The tail bucket is sharpened as one bucket, an
    upper bound of its share (it holds many tokens, each below the k-th).

    Args:
        p: (N, k + 1) teacher buckets from ``teacher_buckets``; the last column is the tail.
        temperature: T >= 0, one for all rows or (N,) one per row (each record's own).

    Returns:
        (N, k + 1) float32, rows summing to 1 (a row with no mass stays 0).

    Raises:
        ValueError: a temperature negative or not finite.
    """
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(p.dtype).reshape(-1, 1)  # (N, 1)
        if not bool(torch.all(torch.isfinite(t) & (t >= 0))):
            raise ValueError(f"temperature={t.flatten().tolist()[:8]}: use finite temperatures >= 0")
        if bool(torch.all(t == 1.0)):
            return p
        greedy = at_temperature(p, 0.0)
        logp = torch.log(p.clamp_min(P_FLOOR)) / t.clamp_min(1e-6)
        soft = torch.softmax(logp, dim=-1) * (p > 0)
        soft = soft / soft.sum(dim=-1, keepdim=True).clamp_min(P_FLOOR)
        return torch.where(t == 0, greedy, torch.where(t == 1.0, p, soft))
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature!r}: use a finite T >= 0 (0 = greedy, 1 = the model's own p)")
    if temperature == 1.0:
        return p
    if temperature == 0.0:
        top = p[:, :-1].argmax(dim=-1, keepdim=True)  # (N, 1)
        out = torch.zeros_like(p).scatter_(-1, top, 1.0)
        return out * (p.sum(-1, keepdim=True) > 0)
    logp = torch.log(p.clamp_min(P_FLOOR)) / temperature
    out = torch.softmax(logp, dim=-1) * (p > 0)
    return out / out.sum(dim=-1, keepdim=True).clamp_min(P_FLOOR)


def student_bucket_logprobs(
    logits: torch.Tensor, topk_ids: torch.Tensor, present: torch.Tensor | None = None
) -> torch.Tensor:
    """The draft's log-probabilities reduced to the teacher's k + 1 buckets, from its logits.

    With x the logits: top-k buckets are x gathered at the ids; the tail bucket is a logsumexp
    over the vocabulary with the top-k ids set to -inf, which is exact and stable (unlike
    log(1 - sum exp(gathered)), which cancels catastrophically when the top-k hold almost all
    the mass); both are normalised by log Z = logaddexp(tail, logsumexp(top)), so one pass over
    the vocabulary does it all (no (N, V) log_softmax to hold and back-propagate through).
    Shift-invariant: log-probabilities give the same result as the logits they came from.

    With a restricted draft vocabulary S (FR-Spec), ``logits`` has one column per id of S and
    ``topk_ids`` holds column indices, with ``present`` False where the target's id is not in S:
    those buckets get q = 0 (``LOGQ_FLOOR``), and the tail bucket is S minus the present top-k.

    Args:
        logits: (N, V) draft logits (or log-probabilities), any float dtype; computed in fp32.
            V is the vocabulary, or |S| with ``present``.
        topk_ids: (N, k) int64 column indices of the target's top-k (token ids without S).
        present: optional (N, k) bool, False where a top-k id has no column (outside S); the
            ``topk_ids`` entry there is ignored (any valid column, e.g. 0).

    Returns:
        (N, k + 1) log q over the buckets, floored at ``LOGQ_FLOOR``.
    """
    x = logits.float()
    ids = topk_ids.long()
    top = x.gather(-1, ids)  # (N, k)
    if present is not None:
        top = top.masked_fill(~present, float("-inf"))
        # only present ids leave the tail; an absent one's placeholder column must stay in it
        ids = torch.where(present, ids, ids.new_full((), x.shape[-1]))
        x = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=-1)  # a scratch column for absent ids
        tail = torch.logsumexp(x.scatter(-1, ids, float("-inf"))[:, :-1], dim=-1)  # (N,)
    else:
        tail = torch.logsumexp(x.scatter(-1, ids, float("-inf")), dim=-1)  # (N,); -inf if k == V
    log_z = torch.logaddexp(tail, torch.logsumexp(top, dim=-1))  # (N,)
    return (torch.cat([top, tail.unsqueeze(-1)], dim=-1) - log_z.unsqueeze(-1)).clamp_min(LOGQ_FLOOR)  # (N, k+1)


def _kl(p: torch.Tensor, logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum_b p_b (log p_b - log q_b) with 0 log 0 = 0. (N, B) -> (N,)."""
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(dim=-1)


def forward_kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Forward KL(p || q) = sum_b p_b log(p_b / q_b), per position.

    The distillation loss of Hinton et al. (2015) and the default of Online Speculative Decoding
    (Liu et al., ICML 2024, Sec. 4): mass-covering, pushes q up wherever the target has mass.

    Args:
        p: (N, B) teacher bucket probabilities (rows sum to 1, may contain zeros).
        logq: (N, B) student bucket log-probabilities.

    Returns:
        (N,) per-position KL, >= 0.
    """
    logp = p.clamp_min(P_FLOOR).log()
    return _kl(p, logp, logq)


def reverse_kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Reverse KL(q || p) = sum_b q_b log(q_b / p_b), per position.

    Mode-seeking (MiniLLM, Gu et al. 2024; an OSD option). Where the teacher bucket is 0, log p
    is floored at log(``P_FLOOR``) so the loss stays finite and strongly penalises q there.

    Args:
        p: (N, B) teacher bucket probabilities.
        logq: (N, B) student bucket log-probabilities.

    Returns:
        (N,) per-position KL, >= 0 up to the floor.
    """
    q = logq.exp()
    logp = p.clamp_min(P_FLOOR).log()
    return (q * (logq - logp)).sum(dim=-1)


def jsd(p: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence, as in GKD (Agarwal et al., ICLR 2024, Eq. 2).

        m = beta p + (1 - beta) q
        JSD_beta(p || q) = beta KL(p || m) + (1 - beta) KL(q || m)

    beta = 0.5 is the symmetric JSD (bounded by log 2); m > 0 wherever p or q is, so both
    terms are finite without a floor. beta must lie in (0, 1); at the ends the loss is 0.

    Args:
        p: (N, B) teacher bucket probabilities.
        logq: (N, B) student bucket log-probabilities.
        beta: interpolation weight of the teacher in the mixture m.

    Returns:
        (N,) per-position divergence, >= 0.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta={beta} must lie strictly between 0 and 1")
    q = logq.exp()
    logp = p.log()  # -inf where p == 0; those terms are masked in _kl and vanish in logaddexp
    # log m = logsumexp(log beta + log p, log(1-beta) + log q), stable for tiny p or q.
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log(1.0 - beta))  # (N, B)
    return beta * _kl(p, logp, logm) + (1.0 - beta) * _kl(q, logq, logm)


def tv(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Total variation distance TV(p, q) = 0.5 sum_b |p_b - q_b|, per position.

    For speculative sampling the expected acceptance of one proposal is
    alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al., ICML 2023, Sec. 3.5), so
    this loss optimises exactly what acceptance depends on (DistillSpec, Zhou et al. 2024,
    studies it as a distillation objective).

    Args:
        p: (N, B) teacher bucket probabilities.
        logq: (N, B) student bucket log-probabilities.

    Returns:
        (N,) per-position distance in [0, 1].
    """
    return 0.5 * (p - logq.exp()).abs().sum(dim=-1)


def alpha(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-position acceptance probability alpha = sum_b min(p_b, q_b) over the buckets.

    Over the stored support (top-k ids + tail bucket) this is 1 - TV of the bucketed
    distributions, an upper bound of the full-vocabulary alpha (merging the tail can only
    increase the overlap).

    Args:
        p: (N, B) teacher bucket probabilities.
        logq: (N, B) student bucket log-probabilities.

    Returns:
        (N,) values in [0, 1].
    """
    return torch.minimum(p, logq.exp()).sum(dim=-1)


def per_position_loss(name: str, p: torch.Tensor, logq: torch.Tensor, jsd_beta: float = 0.5) -> torch.Tensor:
    """Dispatch by loss name (one of ``LOSSES``). (N, B), (N, B) -> (N,)."""
    if name == "forward_kl":
        return forward_kl(p, logq)
    if name == "reverse_kl":
        return reverse_kl(p, logq)
    if name == "jsd":
        return jsd(p, logq, jsd_beta)
    if name == "tv":
        return tv(p, logq)
    raise ValueError(f"unknown loss {name!r}; choose one of {LOSSES}")


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i v_i / sum_i w_i; 0 (still attached to the graph) when all weights are 0.

    Args:
        values: (N,) per-position losses.
        weights: (N,) non-negative position weights.
    """
    w = weights.to(values.dtype)
    total = w.sum()
    if total <= 0:
        return (values * 0.0).sum()
    return (values * w).sum() / total


def mix_copy_logq(logq: torch.Tensor, c_bucket: torch.Tensor, z: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """The copy channel's mixture on the teacher's buckets, as log-probabilities.

        q_mix = (1 - λ) q + λ · 1[b = b(c)],   λ = sigmoid(z)

    (a pointer-generator mixture, See et al. 2017, eq. 9, with one pointer: the copy candidate c,
    ``store.copy_channel``). The candidate adds λ to its own bucket: its top-k column, or the
    tail bucket when the target's top-k does not hold it. log(1 - λ) = logsigmoid(-z) and
    log λ = logsigmoid(z), so it is stable for any z. Rows without a candidate keep ``logq``.

    Args:
        logq: (N, B) the draft's bucket log-probabilities (``student_bucket_logprobs``).
        c_bucket: (N,) int64 bucket index of the candidate in 0..B-1 (ignored where not ``has``).
        z: (N,) gate logits w · f.
        has: (N,) bool, True where the position has a candidate.

    Returns:
        (N, B) log q_mix, floored at ``LOGQ_FLOOR``.
    """
    z = z.to(logq.dtype)
    out = logq + torch.nn.functional.logsigmoid(-z).unsqueeze(-1)  # (N, B): (1 - λ) q
    idx = c_bucket.clamp(0, logq.shape[-1] - 1).unsqueeze(-1)  # (N, 1)
    at_c = torch.logaddexp(out.gather(-1, idx), torch.nn.functional.logsigmoid(z).unsqueeze(-1))  # (N, 1): (1 - λ) q_c + λ
    out = out.scatter(-1, idx, at_c)
    return torch.where(has.unsqueeze(-1), out, logq).clamp_min(LOGQ_FLOOR)
