"""The promotion gate's evidence: a candidate's held-out gain over the serving version, paired
per request, with a bootstrap confidence interval.

A gain measured as the difference of two pooled rates on a few held-out requests is mostly the
requests' own variance: the same request is easy or hard for both versions. Pairing removes it:
both versions are scored on the very same held-out positions, and the statistic is

    Δ = Σ_i (A_i - B_i) / Σ_i n_i

over held-out requests (clusters) i, where A_i and B_i are the candidate's and the serving
version's summed per-position α (Σ_b min(p_b, q_b), Leviathan et al. 2023, §3.1: α = E[1 - TV(p, q)])
and n_i the request's positions; Δ is the difference of the pooled α, the rate the decoder
sees. Positions inside one request are correlated (one prompt, one topic), so the interval
resamples whole requests: the cluster (or "paired") bootstrap, percentile interval (Efron &
Tibshirani 1993, ch. 13; Davison & Hinkley 1997, §3.8 for clustered data).

A record's cluster is its prompt (``trainer.service.split_key``): a request's prefill and decode
records, and a prompt served twice, form one cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np

from store.wording import percent, signed


@dataclass(frozen=True)
class PairedGain:
    """The candidate's held-out α against the serving version's, paired per position.

    ``gain`` = ``after`` - ``before`` (pooled over positions); ``low`` / ``high``: the
    percentile bootstrap interval of ``gain`` at ``confidence`` over ``clusters`` resampled
    whole (NaN when there are no positions; equal to ``gain`` with one cluster, which says
    nothing about the spread: the gate's ``min_clusters`` refuses that).
    """

    clusters: int  # held-out requests (prompts) both versions were scored on
    samples: int  # records
    positions: int  # output positions
    before: float  # pooled α of the serving version
    after: float  # pooled α of the candidate
    gain: float
    low: float
    high: float
    confidence: float

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """"α before -> after (gain, CI [low, high]) on n positions of k held-out requests"; the bounds
        by ``store.wording.signed``: a bound of exactly 0 reads "0" and one that only rounds to zero
        keeps its digits, so a lower bound that fails "above 0" never prints as +0.0000."""
        pct = percent(self.confidence)
        return (f"α {self.before:.4f} -> {self.after:.4f} ({self.gain:+.4f}, {pct} % CI [{signed(self.low)}, "
                f"{signed(self.high)}]) on {self.positions} positions of {self.clusters} held-out requests")


def paired_gain(
    before: Mapping[str, tuple[float, int]],
    after: Mapping[str, tuple[float, int]],
    clusters: Mapping[str, str] | None = None,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> PairedGain:
    """Paired held-out gain of ``after`` over ``before`` with a cluster-bootstrap interval.

    Args:
        before, after: record id -> (α summed over the record's positions, positions), for the
            serving version and the candidate. Only records in both, with the same positions
            count, are paired (a record scored on different positions is not comparable).
        clusters: record id -> cluster key (its prompt); a record absent from it is its own
            cluster. None: every record its own cluster.
        confidence: two-sided coverage of the interval, in (0, 1).
        resamples: bootstrap resamples (>= 100).
        seed: the resampling generator's seed (the interval is a deterministic function of the
            data and the seed).

    Returns:
        A :class:`PairedGain`; with no paired positions its rates and bounds are NaN.

    Raises:
        ValueError: ``confidence`` outside (0, 1) or ``resamples`` < 100.
    """
    clusters = clusters or {}
    per: dict[str, list[float]] = {}  # cluster -> [Σ B, positions, Σ A, positions]
    samples = 0
    for rid in sorted(before.keys() & after.keys()):
        (sb, nb), (sa, na) = before[rid], after[rid]
        if nb != na or nb <= 0:
            continue
        row = per.setdefault(clusters.get(rid, "record:" + rid), [0.0, 0, 0.0, 0])
        row[0] += sb
        row[1] += nb
        row[2] += sa
        row[3] += nb
        samples += 1
    # Σ A / Σ n - Σ B / Σ n over resampled clusters = Σ (A - B) / Σ n: the ratio form with one denominator
    return dataclasses.replace(paired_ratio_gain({k: tuple(v) for k, v in per.items()}, confidence, resamples, seed),
                               samples=samples)


def paired_ratio_gain(rows: Mapping[str, tuple[float, float, float, float]], confidence: float = 0.95,
                      resamples: int = 2000, seed: int = 0) -> PairedGain:
    """The gain of one pooled rate over another measured on the same units (e.g. decoded α of the
    adapted draft against the frozen v0 on the same never-served prompts), with the percentile
    interval of a bootstrap over units.

    Args:
        rows: unit (a prompt) -> (before numerator, before denominator, after numerator, after
            denominator); e.g. (Σ α over the v0's proposals, its proposals, the same for the
            adapted draft). Units with a zero denominator on either side are left out.
        confidence, resamples, seed: as in :func:`paired_gain`.

    Returns:
        A :class:`PairedGain`: ``before`` = Σ bn / Σ bd, ``after`` = Σ an / Σ ad, ``gain`` their
        difference, ``clusters`` the units, ``positions`` Σ ad (the after side's denominator).

    Raises:
        ValueError: ``confidence`` outside (0, 1) or ``resamples`` < 100.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r}: must lie in (0, 1), e.g. 0.95")
    if resamples < 100:
        raise ValueError(f"resamples={resamples!r}: need >= 100 bootstrap resamples (2000 is the default)")
    kept = [rows[k] for k in sorted(rows) if rows[k][1] > 0 and rows[k][3] > 0]
    nan = float("nan")
    if not kept:
        return PairedGain(0, 0, 0, nan, nan, nan, nan, nan, confidence)
    m = np.asarray(kept, dtype=np.float64)  # (G, 4)
    before, after = m[:, 0].sum() / m[:, 1].sum(), m[:, 2].sum() / m[:, 3].sum()
    g = len(m)
    w = np.random.default_rng(seed).multinomial(g, np.full(g, 1.0 / g), size=resamples).astype(np.float64)  # (R, G)
    stats = (w @ m[:, 2]) / (w @ m[:, 3]) - (w @ m[:, 0]) / (w @ m[:, 1])  # (R,)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return PairedGain(g, g, int(m[:, 3].sum()), float(before), float(after), float(after - before), float(low),
                      float(high), confidence)


def counts_by_record(per_sample: Mapping[str, tuple[str, object]], workloads: set[str] | None = None,
                     metric: str = "served") -> dict[str, tuple[float, int]]:
    """``EvalResult.per_sample`` (record id -> (workload, EvalCounts)) as record id -> (sum of the
    metric over the record's positions, positions), only the records of ``workloads`` (None: all).

    ``metric``: ``"served"`` (default), the acceptance each record's request saw as served
    (``EvalCounts.served_sum``: greedy agreement for greedy requests, α at the request's
    temperature for sampled ones), so the gate judges the rate the decoder will see; ``"alpha"``,
    α at temperature 1 whatever the request was.

    Raises:
        ValueError: an unknown ``metric``.
    """
    if metric not in ("served", "alpha"):
        raise ValueError(f"metric={metric!r}: use 'served' or 'alpha'")
    field = "served_sum" if metric == "served" else "alpha_sum"
    return {rid: (float(getattr(c, field)), int(c.positions)) for rid, (w, c) in per_sample.items()
            if workloads is None or w in workloads}


def decoded_acceptance(acc, gamma: int) -> tuple[float, float]:
    """Expected (accepted proposals, proposals) of speculative decoding at a fixed ``gamma`` over
    one record, from its per-position acceptance on the draft's own path.

    Teacher-forced acceptance scores every output position alike; decoding proposes ``gamma``
    tokens from each block start, keeps the accepted prefix, and starts the next block after the
    correction (or after the bonus token when all were accepted), so it never proposes at a bonus
    position and weighs the positions after a correction more. Position j's acceptance ``acc[j]``
    is the probability the draft's proposal there is accepted given the target's prefix (greedy:
    1 or 0, the draft's argmax against the target's; sampled: α at the request's temperature), and
    on the accepted path the draft's prefix is the target's, so the expectation is exact for greedy
    records and assumes independent acceptances for sampled ones (Leviathan et al. 2023, §3.1).

    Args:
        acc: (N,) per-position acceptance in [0, 1] (values outside are clipped).
        gamma: proposals per block, >= 1.

    Returns:
        (accepted, proposed): expected sums over the record's blocks (proposed counts the last
        block's proposals cut at the record's end); (0.0, 0.0) for an empty record.

    Raises:
        ValueError: ``gamma`` < 1.
    """
    if gamma < 1:
        raise ValueError(f"gamma={gamma!r}: need >= 1 proposal per block")
    a = np.clip(np.asarray(acc, dtype=np.float64).reshape(-1), 0.0, 1.0)
    n = len(a)
    start = np.zeros(n + gamma + 2)  # start[t]: probability a block starts at position t
    start[0] = 1.0
    accepted = proposed = 0.0
    for t in range(n):
        s = start[t]
        if s == 0.0:
            continue
        g = min(gamma, n - t)
        proposed += s * g
        run = 1.0  # probability the block's first k proposals were all accepted
        for k in range(g):
            start[t + k + 1] += s * run * (1.0 - a[t + k])  # rejected at t + k: the correction, then a new block
            run *= a[t + k]
            accepted += s * run
        start[t + g + 1] += s * run  # all accepted: the bonus token at t + g
    return float(accepted), float(proposed)


def paired_decoded_gain(before: Mapping[str, tuple[str, object]], after: Mapping[str, tuple[str, object]],
                        workloads: set[str], clusters: Mapping[str, str] | None = None, confidence: float = 0.95,
                        resamples: int = 2000, seed: int = 0) -> PairedGain:
    """The candidate's decoded acceptance (``EvalCounts.decoded_accepted / decoded_proposed``, see
    :func:`decoded_acceptance`) against the serving version's on the same held-out records of
    ``workloads``, summed per cluster (record id -> prompt in ``clusters``; absent: its own) and
    bootstrapped over clusters (:func:`paired_ratio_gain`). Records scored on different positions
    by the two, or with no proposals, are left out. ``positions`` of the result: the candidate's
    expected proposals, rounded."""
    clusters = clusters or {}
    per: dict[str, list[float]] = {}
    for rid in sorted(before.keys() & after.keys()):
        (_, cb), (wa, ca) = before[rid], after[rid]
        if wa not in workloads or cb.positions != ca.positions or not (cb.decoded_proposed > 0 and ca.decoded_proposed > 0):
            continue
        row = per.setdefault(clusters.get(rid, "record:" + rid), [0.0, 0.0, 0.0, 0.0])
        for i, x in enumerate((cb.decoded_accepted, cb.decoded_proposed, ca.decoded_accepted, ca.decoded_proposed)):
            row[i] += float(x)
    return paired_ratio_gain({k: tuple(v) for k, v in per.items()}, confidence, resamples, seed)
