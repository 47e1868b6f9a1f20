"""Goodput control: :class:`GoodputController` picks the proposer and γ in {0 (plain decoding), 1,
..., γ_max} per (workload, sampling bucket) from online estimates of acceptance and of the measured
step costs, so speculation runs only when it pays, with the proposer that pays most;
:class:`ControlledGamma` is one request's γ policy under it.

The acceptance windows (:mod:`decoder.tracking`) and automatic rollback (:mod:`decoder.rollback`)
live beside it. Keys are written ``"{workload}@{bucket}"`` wherever they are shown (e.g.
``prose@greedy``, ``code@t0.7-p0.9``): acceptance depends on both the traffic and the sampling
policy.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from statistics import NormalDist
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from decoder.engines.base import last_fused_rows, last_fused_size, routed_batch_size, routed_speculation_pays
from decoder.metrics import StepStats, line_at
from decoder.proposers.registry import DEFAULT_PROPOSER, REQUEST_PROPOSERS, spec as proposer_spec
from decoder.sampling import expected_tokens_per_step  # noqa: F401 - re-exported
from decoder.shift import key_str  # key_str re-exported: "{workload}@{bucket}"
from decoder.tracking import DRAFT, HEAD, Key
from store.jsonsafe import nan_none
from store.wording import percent, requests as _requests

log = structlog.get_logger("decoder.control")

# ---- (c) goodput control -----------------------------------------------------------------------


@dataclass
class ControllerConfig:
    """Goodput controller options.

    gamma_max: largest γ considered.
    gamma_init: γ of the first speculative measurement of a key.
    eagle_gamma_init: γ of the feature-level head's warm-up (again after each new head: every
        proposed token costs a head step, so a γ = 4 warm-up is a slow request per key and head;
        longer γ are extrapolated from the measured depths until measured).
    ewma: weight of a new step in every estimate (α, draft ms per token, verify ms per γ).
    probe_every: every this many requests of a key, one request probes: plain decoding when
        speculating, γ = the best speculative candidate when off, or a γ never measured.
    unsure_probe_every: while plain decoding serves and a candidate ahead of it by more than
        ``min_gain`` is inside its confidence bound, one request in this many probes it (2: every
        other request); 1 where requests cost nothing to spend on it (the demo's re-measurement:
        7 requests of it left prose's and extract's n-gram off, which ran 1.21x and 1.18x plain on
        never-served prompts, docs/walkthroughs.md).
    useless_alpha: below this α the "off" reason says the draft is useless.
    min_steps: steps of γ = 0 and of γ >= 1 measured before the choice is trusted (warm-up; >= 1).
        A warm-up request runs what it measures for this many steps, then moves on
        (:meth:`GoodputController.after_warm_up`), not for its whole length.
    proposers: the proposers the controller chooses among (:mod:`decoder.proposers`): "draft"
        (the draft model, modelled by α), "ngram" and "eagle" (the feature-level head,
        ``decoder.eagle``; the decoder needs one: ``build_serving_loop(eagle_head=...)``), both
        modelled by their measured accepted-length distribution and step cost, see
        :class:`GoodputController`. The first listed warms up first.
    ceiling_probe_every: while the draft's ceiling (its goodput at α = 1, every proposal
        accepted: no adapter can do better at its measured cost) is below plain decoding, the
        draft's probes back off (1, 2, 4, ... ``probe_every`` requests apart) up to one every this
        many requests of a key (each probe serves a request slower than plain; it re-measures the
        costs, which the host's load or a cheaper draft can change); a multiple of ``probe_every``.
    ceiling_reprobe_s: ... and once this many seconds have passed since the draft's last probe, the
        next probe slot probes it and the back-off restarts: a verdict measured under a transient
        load (a minute of CPU contention made the draft "122.5 ms per token") does not stand for
        hundreds of requests.
    half_life_s: estimates age: a measurement that arrives this many seconds after the estimate's
        last one weighs at least 1/2 (2 half-lives: 3/4, ...) whatever ``ewma`` says, so a key
        idle for minutes takes its first new measurements nearly at face value instead of
        keeping the figures it last saw.
    min_gain: speculation is chosen only where its expected tokens per ms beat plain decoding's by
        more than this fraction (0.05: 5 %); within it plain decoding serves. The estimates move
        with the host's load and the traffic by a few per cent between measurements, so a
        proposer "ahead" by less than that loses as often as it wins when measured paired (a pick
        of 1.02x estimated measured 0.96x [0.90, 1.02] on never-served prompts, bench/RESULTS.md),
        and plain decoding is the one configuration that is never worse than itself.
    confidence: speculation is chosen only where, besides ``min_gain``, the lower bound of this
        one-sided confidence of its rate over plain decoding's is above 1: the ratio's standard
        error by the delta method from the costs' per-step standard errors and the accepted
        lengths' per-request one (:class:`_Clusters`), its bound ratio x exp(-z se) with z the
        normal quantile of ``confidence`` (0.95: 1.645). The maximum of noisy estimates is biased
        up (the winner's curse): an n-gram pick priced at 1.11x plain from 4 requests after the
        trainer stopped ran at 0.87x [0.79, 0.95] on never-served prompts (docs/walkthroughs.md,
        the run at 5e6c1fe). 0.5: the point estimate alone (z = 0).
    capped: proposers whose γ is only a cap, each step's length cut below it by their own gate
        (the n-gram proposer with its gate, :class:`decoder.proposers.ngram.NgramGate`): offered
        at ``gamma_max`` alone, warmed up there, and priced inside a batch at the rows their steps
        really verify. With the gate choosing each step's length, a lower cap only takes long
        copies away (cap 8 against the cap 4 the controller had picked, on never-served prompts:
        bench/RESULTS.md, "Twentieth session").
    stall_factor: a step's verification (or the draft's ms per token, or the overhead) read above
        this many times its key's estimate for the same rows, once that estimate has ``min_steps``
        readings, counts at this many times it (0: never cut). A stall (another thread, the
        allocator, a page fault) lands on whichever step runs then, not on plain decoding or on a
        proposer: one stalled plain step, weighted ``ewma`` (more after a gap), priced plain
        decoding several times too dear for the next requests (bench/RESULTS.md, "Twenty-fourth
        session"). A load that really moves still moves the estimates, by up to this factor a
        reading.
    batch_sizes: the batch sizes (requests decoding together, continuous batching) for which
        :meth:`GoodputController.decision` reports the decision (``"by_batch"``); a request
        decides at whatever size it runs, these are only shown. ``build_serving_loop`` passes
        :func:`batch_sizes_up_to` (``serve.max_batch``).
    """

    gamma_max: int = 8
    gamma_init: int = 4
    eagle_gamma_init: int = 1
    ewma: float = 0.1
    probe_every: int = 10
    unsure_probe_every: int = 2
    useless_alpha: float = 0.1
    min_steps: int = 8
    proposers: tuple[str, ...] = (DRAFT,)
    ceiling_probe_every: int = 100
    ceiling_reprobe_s: float = 60.0
    half_life_s: float = 60.0
    min_gain: float = 0.05
    confidence: float = 0.95
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    capped: tuple[str, ...] = ()
    stall_factor: float = 3.0

    def __post_init__(self):
        for name in ("gamma_max", "gamma_init", "eagle_gamma_init"):  # their range is checked below
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or (name == "gamma_max" and v < 1):
                raise ValueError(f"{name}={v!r} must be an int" + (" >= 1" if name == "gamma_max" else ""))
        u = self.useless_alpha
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 <= u <= 1:  # NaN too
            raise ValueError(f"useless_alpha={u!r} must be an acceptance rate in [0, 1]")
        self.batch_sizes = tuple(sorted({int(b) for b in self.batch_sizes}))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"ControllerConfig.batch_sizes={self.batch_sizes!r}: a non-empty list of ints >= 1")
        self.proposers = (self.proposers,) if isinstance(self.proposers, str) else tuple(self.proposers)
        bad = [p for p in self.proposers if p not in REQUEST_PROPOSERS]
        if not self.proposers or bad or len(set(self.proposers)) != len(self.proposers):
            raise ValueError(f"ControllerConfig.proposers={self.proposers!r}: a non-empty list of distinct names "
                             f"from {REQUEST_PROPOSERS}")
        self.capped = (self.capped,) if isinstance(self.capped, str) else tuple(self.capped)
        if any(p not in self.proposers or p == DRAFT for p in self.capped):
            raise ValueError(f"ControllerConfig.capped={self.capped!r}: configured proposers modelled by their "
                             f"accepted lengths (not {DRAFT!r}), from proposers={self.proposers!r}")
        if not 1 <= self.gamma_init <= self.gamma_max or not 1 <= self.eagle_gamma_init <= self.gamma_max:
            raise ValueError(f"gamma_init={self.gamma_init} and eagle_gamma_init={self.eagle_gamma_init} must lie in "
                             f"1..gamma_max={self.gamma_max}")
        if not 0 < self.ewma <= 1:
            raise ValueError(f"ewma={self.ewma} must lie in (0, 1]")
        if self.ewma == 1 and self.confidence != 0.5:  # a weight of 1 keeps one reading: no error to bound
            raise ValueError(f"ewma=1 keeps only the last reading, so no confidence bound can be measured: lower ewma "
                             f"below 1, or set confidence=0.5 (the point estimate alone; got {self.confidence!r})")
        if self.probe_every < 1 or self.min_steps < 1:  # min_steps 0 trusted estimates that do not exist yet
            raise ValueError(f"probe_every={self.probe_every} and min_steps={self.min_steps} must be >= 1")
        if isinstance(self.unsure_probe_every, bool) or not isinstance(self.unsure_probe_every, int) \
                or self.unsure_probe_every < 1:
            raise ValueError(f"unsure_probe_every={self.unsure_probe_every!r} must be an int >= 1")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain={self.min_gain!r} must be a fraction in [0, 1) (0.05: speculate only "
                             f"where it beats plain decoding by more than 5 %)")
        if (isinstance(self.confidence, bool) or not isinstance(self.confidence, (int, float))
                or not 0.5 <= self.confidence < 1):
            raise ValueError(f"confidence={self.confidence!r} must lie in [0.5, 1) (0.95: speculate only where the "
                             f"one-sided 95 % lower bound of its rate over plain decoding's is above 1; 0.5: "
                             f"the point estimate alone)")
        if (isinstance(self.stall_factor, bool) or not isinstance(self.stall_factor, (int, float))
                or not (self.stall_factor == 0 or self.stall_factor > 1)):
            raise ValueError(f"stall_factor={self.stall_factor!r} must be 0 (never cut) or above 1")
        for name in ("ceiling_reprobe_s", "half_life_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:  # NaN too
                raise ValueError(f"{name}={v!r} must be a number of seconds > 0 (math.inf: never)")
        if (not isinstance(self.ceiling_probe_every, int) or isinstance(self.ceiling_probe_every, bool)
                or self.ceiling_probe_every < 1
                or self.ceiling_probe_every % self.probe_every):
            raise ValueError(f"ceiling_probe_every={self.ceiling_probe_every!r} must be a multiple of "
                             f"probe_every={self.probe_every}")


MIN_VERDICT_REQUESTS = 3  # requests a model-free proposer is measured on before plain decoding's verdict stands
HELD_WHY = ("off: the draft is not offered while no adapter version of it is served (serve.base_draft: it is "
            "offered again once one is promoted)")


def _two(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` (tokens per ms) to 3 decimals, or to as many more (up to 6) as it takes to
    tell them apart: "plain 0.136 beats ... 0.136" read as a tie called a win."""
    for d in range(3, 7):
        sa, sb = f"{a:.{d}f}", f"{b:.{d}f}"
        if sa != sb:
            break
    return sa, sb


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: the x with P(T_df <= x) = ``p`` (``p`` in [0.5, 1), ``df`` >= 1).
    Exact for df 1 (tan(π(p - 1/2))) and 2 ((2p - 1) / sqrt(2p(1 - p))); from df 3 the
    Cornish-Fisher expansion in the normal quantile z to 1/df^4 (Abramowitz and Stegun 1964,
    26.7.5; within 0.002 of the table at df 3, p 0.95).

    Raises:
        ValueError: ``df`` below 1 or ``p`` outside [0.5, 1).
    """
    if df < 1 or not 0.5 <= p < 1:
        raise ValueError(f"t_quantile(p={p!r}, df={df!r}): needs p in [0.5, 1) and df >= 1")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def batch_sizes_up_to(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch`` and ``max_batch`` itself: the sizes status reports."""
    out, b = {max(1, int(max_batch))}, 1
    while b <= max_batch:
        out.add(b)
        b *= 2
    return tuple(sorted(out))


class _Ewma:
    """Exponentially weighted mean; with ``now`` and ``half_life`` (seconds) a measurement after a
    gap weighs at least 1 - 2^(-gap / half_life): the old value ages.

    It also keeps the exponentially weighted variance of its inputs (West 1979's incremental
    form, var <- (1 - w)(var + w d^2), d the new input's distance from the old mean) and the
    sum of its weights' squares, Σw_i^2, so :meth:`se` is the standard error of the weighted
    mean, sqrt(s^2 Σw_i^2) with s^2 = var / (1 - Σw_i^2) (the reliability-weighted unbiased
    variance): a plain mean of n inputs gives s / sqrt(n)."""

    __slots__ = ("value", "n", "t", "var", "sw2")

    def __init__(self):
        self.value, self.n, self.t, self.var, self.sw2 = math.nan, 0, None, 0.0, 1.0

    def add(self, x: float, w: float, now: float | None = None, half_life: float | None = None) -> None:
        if not math.isfinite(x):  # a broken clock reading must not poison the estimate for good
            return
        if now is not None and half_life and self.t is not None and now > self.t:
            w = max(w, 1.0 - 0.5 ** ((now - self.t) / half_life))
        if self.n == 0:
            self.value, self.var, self.sw2 = x, 0.0, 1.0
        else:
            d = x - self.value
            self.value += w * d
            self.var = (1 - w) * (self.var + w * d * d)
            self.sw2 = (1 - w) ** 2 * self.sw2 + w * w
        self.n += 1
        if now is not None:
            self.t = now

    def se(self) -> float:
        """Standard error of :attr:`value` (inf below two inputs, or when the last one weighed 1)."""
        if self.n < 2 or self.sw2 >= 1.0:
            return math.inf
        return math.sqrt(max(self.var, 0.0) / (1.0 - self.sw2) * self.sw2)

    def rel_se(self) -> float:
        """:meth:`se` / |value| (inf where the value is 0 or unknown)."""
        v = abs(self.value)
        return self.se() / v if v > 0 else math.inf


class _Clusters:
    """The acceptance of the last ``keep`` requests of one proposer, per request: the fraction of
    its asked proposals accepted (accepted / asked, whatever γ each step asked: 1 for a perfect
    proposer at any γ). The steps of one request share its prompt (a copied span lasts many
    steps, a draft that fits the prompt fits it at every step), so the spread of acceptance
    between requests, not between steps, is what a few requests leave uncertain.
    :meth:`rel_se` is the relative standard error of the mean of per-request means (each request
    one unit: the cluster-robust view)."""

    __slots__ = ("rows", "keep")
    KEEP = 32  # requests kept per proposer and key

    def __init__(self, keep: int = KEEP):
        self.rows: dict[Any, list[float]] = {}  # request -> [proposals asked, accepted, tokens, ms]
        self.keep = keep

    def add(self, request: Any, accepted: float, asked: int, tokens: float = 0.0, ms: float = 0.0) -> None:
        """One step of ``request`` that asked for ``asked`` (>= 1) proposals and kept ``accepted``;
        ``tokens`` and ``ms`` (a length-modelled proposer's: the step's emitted tokens and its
        cost) feed :meth:`ratio_rel_se`."""
        row = self.rows.get(request)
        if row is None:
            row = self.rows[request] = [0, 0.0, 0.0, 0.0]
            while len(self.rows) > self.keep:
                self.rows.pop(next(iter(self.rows)))
        row[0] += asked
        row[1] += min(max(accepted, 0), asked)
        if math.isfinite(tokens) and math.isfinite(ms) and ms >= 0:
            row[2] += tokens
            row[3] += ms

    def ratio_rel_se(self) -> float:
        """The relative standard error of R = Σ tokens / Σ ms over the kept requests, requests as
        the units (the linearised ratio estimator: se(R) = sqrt(Σ (t_i - R m_i)^2 / (k (k - 1))) /
        mean(m); Cochran 1977, "Sampling Techniques", eq. 6.9): the spread of tokens per ms between
        requests, the costs' included (a request with no match runs cheap one-row steps, a copying
        one dear long verifications); inf below 2 requests with a cost."""
        rows = [(t, m) for _, _, t, m in self.rows.values() if m > 0]
        k = len(rows)
        if k < 2:
            return math.inf
        tt, mm = sum(t for t, _ in rows), sum(m for _, m in rows)
        if not tt > 0:
            return math.inf
        r = tt / mm
        se = math.sqrt(sum((t - r * m) ** 2 for t, m in rows) / (k * (k - 1))) / (mm / k)
        return se / r

    def count(self) -> int:
        return len(self.rows)

    def rel_se(self) -> float:
        """sd(per-request acceptance) / sqrt(requests) / their mean; inf below 2 requests or at a
        mean of 0."""
        means = [t / n for n, t, *_ in self.rows.values() if n]
        k = len(means)
        if k < 2:
            return math.inf
        mu = sum(means) / k
        sd = math.sqrt(sum((m - mu) ** 2 for m in means) / (k - 1))
        return sd / math.sqrt(k) / mu if mu > 0 else math.inf


@dataclass
class _KeyState:
    alpha: _Ewma = field(default_factory=_Ewma)
    draft_ms_per_token: _Ewma = field(default_factory=_Ewma)
    # γ -> verify ms of a γ-step; γ = 0: a plain step, read only where the step before it also
    # verified one row (GoodputController.observe: after a change of shape llama.cpp rebuilds its graph)
    verify_ms: dict[int, _Ewma] = field(default_factory=dict)
    overhead_ms: _Ewma = field(default_factory=_Ewma)  # step wall time - draft ms - verify ms
    requests: int = 0
    adapter_version: int | None = None
    head_version: int | None = None
    last: dict[str, Any] = field(default_factory=dict)
    lengths: dict[str, "_LengthModel"] = field(default_factory=dict)  # proposer -> accepted-length model
    ceiling_probes: int = 0  # draft probes in a row while its ceiling was below plain (the back-off's exponent)
    last_ceiling_probe: int = 0  # the request that made the last of them
    last_ceiling_probe_t: float | None = None  # and when (the controller's clock)
    # proposer -> the request (its ControlledGamma, weakly) warming it up now: a model-run proposer's
    # warm-up is given to one request of a key at a time (_choose_among)
    warming: dict[str, Any] = field(default_factory=dict)
    # proposer -> [steps, requests] it served (requests counted by their first step): the mean
    # steps per request, which turns ``ewma`` into a weight per request (_request_weight)
    served: dict[str, list[int]] = field(default_factory=dict)
    # proposer -> the acceptance of its last requests, per request (the acceptance's uncertainty)
    clusters: dict[str, "_Clusters"] = field(default_factory=dict)
    auto_request: int = 0  # a request id for callers that name none (``first`` starts one)


@dataclass
class _LengthModel:
    """A proposer modelled by its accepted-prefix lengths, not by α (the n-gram proposer: its
    proposals are all right while a copied span lasts, so acceptance is far from i.i.d.).

    ge[j-1]: EWMA of 1[accepted >= j] over steps that asked for γ >= j, so
    E[tokens per step at γ] = 1 + Σ_{j<=γ} P(accepted >= j) (the bonus or correction token plus the
    accepted prefix); a step with no proposal (no match) counts as accepted 0 at every j.
    step_ms[γ]: EWMA of draft ms + verify ms of steps that asked for γ (what a step with partial
    or no proposals really costs); tokens[γ]: EWMA of the tokens those same steps emitted
    (accepted + 1), which prices a γ measured directly: a gated proposer's accepted lengths depend
    on the γ it may use (at γ = 1 its gate proposes only where one token pays, at γ = 4 wherever a
    long copy does), so lengths pooled over every γ asked, divided by one γ's own step ms, priced
    γ = 1 on the acceptance of γ = 4's proposals (docs/walkthroughs.md, the run at 2eab659).
    """

    ge: list[_Ewma] = field(default_factory=list)
    step_ms: dict[int, _Ewma] = field(default_factory=dict)
    tokens: dict[int, _Ewma] = field(default_factory=dict)
    draft_ms: _Ewma = field(default_factory=_Ewma)
    steps: int = 0
    # rows[γ]: EWMA of the rows its steps that asked for γ verified (proposed + 1), with the same
    # weights as step_ms: what a capped proposer's step (ControllerConfig.capped) adds to a batch
    rows: dict[int, _Ewma] = field(default_factory=dict)
    # its steps that proposed nothing (no match: one verified row, a plain step), weighted as its
    # step_ms: the plain step at the moments its own steps ran (:meth:`at_load`)
    base_ms: _Ewma = field(default_factory=_Ewma)

    def at_load(self, ms: float, plain_now: float, min_steps: int) -> float:
        """``ms`` (one of its step costs) at the load of ``plain_now`` (plain decoding's step as the
        controller reads it now): ``ms`` x ``plain_now`` / :attr:`base_ms` once ``min_steps`` of
        its steps proposed nothing, else ``ms`` as measured. Plain decoding's step follows the load
        step by step, a proposer's costs request by request; under a load that moves within
        seconds the two were read at different loads (an n-gram pick priced at 2.42x plain per step
        against a plain step read at a load peak ran 0.88x llama.cpp's plain: bench/RESULTS.md,
        "Thirteenth session"). Its own plain steps, read with the same weights at the same
        moments as its other steps, cancel the load in the ratio."""
        b = self.base_ms
        if b.n < max(1, min_steps) or not b.value > 0 or not plain_now > 0:
            return ms
        return ms * plain_now / b.value

    def observe(self, asked: int, accepted: int, model_ms: float, draft_ms: float, w: float,
                w_len: float | None = None, now: float | None = None, half_life: float | None = None,
                proposed: int | None = None, reference: bool = True) -> None:
        """One step: ``w_len`` (default ``w``) weighs its accepted length and its costs alike, a
        young estimate being the plain mean of its steps until that weighs less than ``w_len``.
        ``now`` and ``half_life`` (seconds) age the costs and the tokens they are divided into,
        as plain decoding's step cost ages (:class:`_Ewma`): a step after a gap of one half-life
        weighs at least 1/2, so a proposer probed again after minutes off (a load that changed
        meanwhile: the sidecar's trainer started or stopped) is priced at what its steps cost now,
        not at a per-request average of steps taken under the old load. Its accepted lengths
        (``ge``) do not depend on the load and do not age.

        The tokens and the milliseconds of a γ are one ratio, E[tokens] / E[ms] over the same
        steps: a gated proposer's steps that asked for γ cost one row (no match, or a match the
        gate turned down: a plain step, no token accepted) or up to γ + 1 (a copied span, many
        accepted), so lengths averaged over many requests divided by costs that followed the last
        few steps (a request with no match: plain steps) priced a proposer well above plain
        decoding that ran no faster than it (docs/walkthroughs.md, the run at c96690d).

        ``reference``: a step that proposed nothing joins :attr:`base_ms` (its load reference)
        only where this is True: the controller passes False for a one-row step after a
        multi-row one, which pays a graph rebuild that plain decoding's steps never pay
        (:meth:`GoodputController.observe`)."""
        wl = w if w_len is None else w_len
        while len(self.ge) < asked:
            self.ge.append(_Ewma())
        for j in range(1, asked + 1):
            e = self.ge[j - 1]
            e.add(1.0 if accepted >= j else 0.0, max(wl, 1.0 / (e.n + 1)))
        e = self.step_ms.setdefault(asked, _Ewma())
        e.add(model_ms, max(wl, 1.0 / (e.n + 1)), now, half_life)
        e = self.tokens.setdefault(asked, _Ewma())  # the same weights as its step_ms: one ratio over the same steps
        e.add(min(max(accepted, 0), asked) + 1.0, max(wl, 1.0 / (e.n + 1)), now, half_life)
        self.draft_ms.add(draft_ms, max(wl, 1.0 / (self.draft_ms.n + 1)), now, half_life)
        e = self.rows.setdefault(asked, _Ewma())
        e.add((asked if proposed is None else proposed) + 1.0, max(wl, 1.0 / (e.n + 1)), now, half_life)
        if proposed == 0 and reference:  # a step that verified one row after one row: a plain step, at this moment's load
            self.base_ms.add(model_ms - draft_ms, max(wl, 1.0 / (self.base_ms.n + 1)), now, half_life)
        self.steps += 1

    def p_ge(self, j: int) -> float:
        """P(accepted >= j); beyond the longest γ measured, the last measured ratio continues."""
        known = [e.value for e in self.ge if e.n]
        if not known:
            return math.nan
        if j <= len(known):
            return known[j - 1]
        last = known[-1]
        ratio = last / known[-2] if len(known) >= 2 and known[-2] > 0 else last
        return last * min(1.0, ratio) ** (j - len(known))

    def tokens_per_step(self, g: int) -> float:
        """E[tokens per step] at γ = ``g``: its own steps' mean where measured, else the model."""
        e = self.tokens.get(g)
        if e is not None and e.n:
            return e.value
        return 1.0 + sum(self.p_ge(j) for j in range(1, g + 1))


def _estimates(s: "_KeyState", ev: dict[str, Any]) -> dict[str, Any]:
    """The controller's current inputs for one key, JSON-ready (shared by decide and decision)."""
    return {
        "adapter_version": s.adapter_version,
        "requests": s.requests,
        "alpha": nan_none(ev["alpha"], 4),
        "t_draft_ms": nan_none(ev["t_draft"], 4),
        "t_plain_ms": nan_none(ev["t_plain"], 4),
        "t_verify_ms": {g: nan_none(t, 4) for g, t in ev["t_verify"].items()},
        "overhead_ms": nan_none(ev["overhead"], 4),
        "draft_ceiling_gamma": ev["ceiling"][0],
        "draft_ceiling_tokens_per_ms": nan_none(ev["ceiling"][1], 5),
    }


class GoodputController:
    """Chooses γ per (workload, sampling bucket) to maximise expected tokens per ms.

    For each key it keeps EWMAs of α (per step: alpha_sum / proposed), of draft ms per draft
    token, and of verify ms per γ (γ = 0: a plain step). The verify cost of an unmeasured γ comes
    from a least-squares line through the measured ones against γ + 1 verified tokens (clamped
    at >= 0 slope; a flat line through a single point). Then, for γ = 1..γ_max,

        goodput(γ) = E(α, γ) / (γ · t_draft + t_verify(γ) + o),  E = (1 - α^(γ+1)) / (1 - α)

    (Leviathan et al. 2023, eq. (1) over the measured step cost) and goodput(0) = 1 / (t_plain + o),
    where o is the per-step overhead outside the two model calls (sampling, the acceptance test,
    cache crops), measured by the policy as the time from one step's gamma() call to the next
    minus draft ms and verify ms. t_verify and t_plain are shown with o included.
    The draft's ceiling is the same goodput at α = 1 (E = γ + 1), max over γ: what a perfectly
    trained draft of the measured cost would give. Below plain decoding, no adapter can make the
    draft pay on this engine (a draft nearly as dear as the target, or verification rows that cost
    nearly a plain step each, as on llama.cpp on CPU: bench/RESULTS.md), so the draft's probes back
    off up to one every ``ceiling_probe_every`` requests and the decision says why. It is a bound, not an
    estimate: where a long γ amortises the verification (γ = 8 at 5 plain steps for 9 rows), a
    draft of c = 0.4 keeps a ceiling above plain although no realistic α gets it there.
    The best γ serves the key; every ``probe_every`` requests one request probes plain
    decoding (when speculating), a speculative γ (when off, so a better draft is noticed), or a
    γ never measured. When the adapter version serving the key changes, α is reset and the next
    request re-measures it.

    Inside a batch (continuous batching, :mod:`decoder.batching`): B requests' rows share one
    fused forward, so a request's step costs what the fused step costs. With ``step_cost`` (the
    decoder's :class:`decoder.proposers.cost.StepCost`, the one cost model of steps by verified
    rows and batch size) every cost above is priced at batch B: a step verifying r rows costs its
    batch-1 estimate x ρ_B(r) = t_B(r) / t(r) (:meth:`StepCost.batch_factor`; the target's
    verification of γ + 1 rows at ρ_B(γ + 1), a plain step, the draft's per-token cost and the
    overhead at ρ_B(1)), and

        goodput_B(γ) = E(α, γ) / (ρ_B(1) (γ · t_draft + o) + ρ_B(γ + 1) t_verify(γ)),
        goodput_B(0) = 1 / (ρ_B(1) (t_plain + o))

    Each request keeps the proposer it was given; at every step its γ is the best γ of that
    proposer at the batch size it runs in (:meth:`batch_gamma`, never above the request's own γ;
    0, a plain step, where no γ beats plain decoding there). Where rows cost nearly a plain step
    each (llama.cpp on CPU), ρ_B(γ + 1) grows with B·γ faster than E(α, γ), so γ shrinks as the
    batch grows and speculation turns off where batching already uses the cheap rows (vLLM's
    ``num_speculative_tokens_per_batch_size``, SGLang's adaptive speculative depth). Steps measured
    inside a batch of B feed the batch-1 estimates divided by the same factor. The decision per
    batch size (``config.batch_sizes``) is in :meth:`decision` under ``"by_batch"``. Without
    ``step_cost`` ρ = 1: the batch is ignored.

    Args:
        config: :class:`ControllerConfig`.
        adapter_version: returns the decoder's adapter version (read at a request's first
            ``gamma()`` call, which happens under the decoder's lock after adapter swaps).
        head_version: returns the decoder's feature-level head version (``decoder.heads``),
            read like ``adapter_version``: a new head serving a key resets the ``"eagle"``
            proposer's accepted-length model there, so warm-up measures the new head.
        proposer_available: ``proposer_available(name)`` is False while a configured proposer
            cannot propose (``"eagle"`` before the first head is promoted); such a proposer is
            neither warmed up nor chosen until it is.
        clock: monotonic seconds; a step's wall time runs from its gamma() call to the next one.
        step_cost: the decoder's :class:`decoder.proposers.cost.StepCost` (steps by verified rows,
            alone and fused with batch mates): prices a step by the rows verified across the
            batch (above); None: every batch size is priced as batch 1.
    """

    def __init__(self, config: ControllerConfig | None = None, *, adapter_version: Callable[[], int] | None = None,
                 head_version: Callable[[], int] | None = None,
                 proposer_available: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.perf_counter, step_cost=None):
        self.config = config or ControllerConfig()
        self.clock = clock
        self.step_cost = step_cost
        self._version = adapter_version
        self._head_version = head_version
        self._available = proposer_available
        self._lock = threading.Lock()
        self._keys: dict[Key, _KeyState] = {}

    def policy_for(self, key: Key) -> "ControlledGamma":
        """The γ policy of one request of ``key`` (γ is decided at its first gamma() call)."""
        return ControlledGamma(self, key)

    # ---- estimates -----------------------------------------------------------------------
    def _state(self, key: Key) -> _KeyState:
        return self._keys.setdefault(key, _KeyState())

    def batch_factor(self, batch: int, rows: int, total: int | None = None) -> float:
        """ρ_B(r) = t_B(r) / t(r) from ``step_cost`` (:meth:`StepCost.batch_factor`; with
        ``total``, of a fused forward of that many rows in all); 1 without one, at batch 1, and
        while unmeasured."""
        if batch <= 1 or self.step_cost is None:
            return 1.0
        return self.step_cost.batch_factor(batch, rows, total)

    def remeasure_costs(self) -> int:
        """Forget what steps cost and what proposals were accepted, for every key: the
        verification ms per γ and the plain step's, the per-step overhead, the draft's ms per token
        and its α (with its per-request acceptance), each length-modelled proposer's step ms and
        accepted lengths (and its warm-up), the draft's ceiling back-off; keep the request counts.
        The n-gram proposer's gate proposes as much of a match as the step costs say pays, so its
        accepted lengths change with the costs: lengths learnt over a phase beside the trainer,
        divided by costs measured after the gate had all but stopped proposing, priced it well
        above plain decoding, and the evaluation ran it below (docs/walkthroughs.md, the run at
        5602b44). α goes too: the requests after a re-measurement (the demo's: 64 tokens past any
        end of sequence) are not the ones α was learnt on (the phases' 32-token answers), and
        draft picks priced on the phases' α lost to plain decoding on such requests
        (bench/RESULTS.md, "Twenty-fifth session"). Each key's next requests warm up again (each
        proposer at ``gamma_init`` for ``min_steps`` steps, then plain decoding), so its choice is
        priced at what steps cost and yield from now on. For a change of load the EWMAs would
        follow only where the controller still chooses to measure: a trainer that ran beside every
        step and stops leaves its priced-up verifications standing for whatever is never chosen
        again. Returns the keys reset."""
        with self._lock:
            for s in self._keys.values():
                s.verify_ms = {}
                s.overhead_ms = _Ewma()
                s.draft_ms_per_token = _Ewma()
                s.alpha = _Ewma()
                for m in s.lengths.values():
                    m.ge, m.step_ms, m.tokens, m.draft_ms, m.steps, m.base_ms = [], {}, {}, _Ewma(), 0, _Ewma()
                    m.rows = {}
                s.clusters, s.served = {}, {}
                s.ceiling_probes, s.last_ceiling_probe, s.last_ceiling_probe_t = 0, 0, None
                s.warming = {}
            return len(self._keys)

    def observe_overhead(self, key: Key, ms: float, batch: int = 1) -> None:
        """Fold one step's overhead (wall time - draft ms - verify ms: sampling, the acceptance
        test, stop checks, cache crops), which every step pays, plain ones included; a step in a
        batch of ``batch`` requests counts as ``ms`` / ρ_B(1)."""
        ms = max(0.0, ms) / self.batch_factor(batch, 1)
        with self._lock:
            s = self._state(key)
            s.overhead_ms.add(self._unstalled(s.overhead_ms, ms), self.config.ewma)

    def _unstalled(self, e: _Ewma | None, x: float) -> float:
        """``x`` (ms), at most ``config.stall_factor`` times the estimate ``e`` of the same
        quantity once ``e`` has ``min_steps`` readings (:class:`ControllerConfig`)."""
        f = self.config.stall_factor
        if f and e is not None and e.n >= self.config.min_steps and e.value > 0 and x > f * e.value:
            return f * e.value
        return x

    def observe(self, key: Key, step: StepStats, step_ms: float | None = None, *, proposer: str = DRAFT,
                asked: int | None = None, batch: int = 1, first: bool | None = None, total: int | None = None,
                request: Any = None, after_rows: int | None = None) -> None:
        """Fold one verification step of ``key`` into the estimates; ``step_ms``, its wall time
        when known, also feeds :meth:`observe_overhead`. ``proposer`` served the step, asked for
        ``asked`` proposals (default: ``step.proposed``); the target's verify cost per γ is shared
        by all proposers. A step in a fused forward of ``batch`` requests counts at batch 1: its
        verify ms / ρ_B(γ + 1) (with ``total``, the rows that forward fed in all, its mates' as
        they were: / t_B(total) / t(γ + 1)), its draft ms / ρ_B(1) (class docstring); α and
        accepted lengths do not depend on the batch.

        ``first``: whether this is its request's first step that asked for proposals (True /
        False, as the policies of :meth:`policy_for` and the serving loop say); then α and the
        accepted lengths move by ``ewma`` per *request* (:meth:`_request_weight`), since a request's steps share its prompt
        and are far from independent: weighted per step, one 20-step probe made 88 % of the
        estimate (a walkthrough's code pick rated the draft at α 0.90 after a probe at 0.88, and
        decoded α 0.45 at 0.58x plain). None (a caller that does not say): per step.

        ``request``: a hashable id of the step's request, under which its acceptance joins the
        per-request spread of acceptance (:class:`_Clusters`, the confidence bound of
        ``config.confidence``); None: ``first`` True starts a new request, False continues the
        last one, None makes each step its own.

        ``after_rows``: the rows the same request's previous forward verified (0: its previous
        forward was the prompt's prefill; None: unknown, taken as one row). llama.cpp reuses its
        compute graph only while a forward has the shape of the one before it, so a one-row step
        after a multi-row one (or after the prefill) pays a graph rebuild that plain decoding,
        one row after another, never pays. Only one-row steps after one row are read as plain
        decoding's step (``verify_ms[0]``) and as a length-modelled proposer's load reference
        (:meth:`_LengthModel.at_load`); the rest count in the proposer's own step costs only. Read
        from every one-row step, a plain step was priced at the n-gram's no-match steps, most of
        them after a copy, so above what plain decoding costs, and every n-gram price with it.
        Until plain decoding has ``min_steps`` readings every one-row step counts (requests of one
        or two tokens have no step after one row, and the warm-up would never end). A step after
        a fused forward counts by that forward's rows (the policies pass them)."""
        if not (math.isfinite(step.verify_ms) and step.verify_ms > 0 and math.isfinite(step.draft_ms)
                and step.draft_ms >= 0 and math.isfinite(step.alpha_sum)):
            return  # a broken reading (no forward takes 0 ms; a NaN α): it would price a γ at millions of tokens/ms
        asked = step.proposed if asked is None else asked
        if step_ms is not None:
            self.observe_overhead(key, step_ms - step.draft_ms - step.verify_ms, batch)
        w, now, hl = self.config.ewma, self.clock(), self.config.half_life_s
        g = step.proposed
        fv, fd = self.batch_factor(batch, g + 1, total), self.batch_factor(batch, 1)
        verify_ms, draft_ms = step.verify_ms / fv, step.draft_ms / fd
        reused = g > 0 or after_rows is None or after_rows == 1  # its graph was the step before's (above)
        with self._lock:
            s = self._state(key)
            if not reused and (s.verify_ms[0].n if 0 in s.verify_ms else 0) < self.config.min_steps:
                reused = True  # plain decoding still warming up: a key whose requests end after a step or two
            verify_ms = self._unstalled(s.verify_ms.get(g), verify_ms)  # a stall is nobody's cost (config)
            if proposer == DRAFT and g:
                draft_ms = self._unstalled(s.draft_ms_per_token, draft_ms / g) * g
            if reused:
                s.verify_ms.setdefault(g, _Ewma()).add(verify_ms, w, now, hl)
            # the draft's acceptance is its α (Σ min(p, q) per proposal), a length-modelled proposer's its accepted prefix
            units = g if proposer == DRAFT else asked
            if units:
                if request is None:
                    s.auto_request += first is not False
                    request = ("auto", s.auto_request)
                s.clusters.setdefault(proposer, _Clusters()).add(
                    request, min(max(step.alpha_sum, 0.0), g) if proposer == DRAFT else step.accepted, units,
                    step.accepted + 1, draft_ms + verify_ms)
            if proposer != DRAFT:
                if asked:
                    s.lengths.setdefault(proposer, _LengthModel()).observe(
                        asked, step.accepted, draft_ms + verify_ms, draft_ms, w, self._request_weight(s, proposer, first),
                        now, hl, proposed=g, reference=reused)
                return
            if g:
                # a young estimate is the plain mean of its steps, until that weighs less than a request
                wr = self._request_weight(s, proposer, first)
                s.alpha.add(min(max(step.alpha_sum / g, 0.0), 1.0), wr if first is None else max(wr, 1.0 / (s.alpha.n + 1)))
                s.draft_ms_per_token.add(draft_ms / g, w, now, hl)

    def _request_weight(self, s: _KeyState, proposer: str, first: bool | None) -> float:
        """The EWMA weight of one step of ``proposer`` such that a request of the mean length it
        serves moves α (or the accepted lengths) by ``ewma``: 1 - (1 - ewma)^(1 / steps per
        request). ``first`` None: ``ewma`` (per step). Counts the step: only steps that asked for
        proposals count, and ``first`` marks a request's first such step (lock held)."""
        w = self.config.ewma
        if first is None:
            return w
        n = s.served.setdefault(proposer, [0, 0])
        n[0] += 1
        n[1] += bool(first) or n[1] == 0
        return 1.0 - (1.0 - w) ** (n[1] / n[0])

    def _verify_cost(self, s: _KeyState, g: int) -> float:
        """t_verify(γ): the per-γ EWMA, else a line through the measured points vs γ + 1."""
        if g in s.verify_ms and s.verify_ms[g].n:
            return s.verify_ms[g].value
        return line_at([(k + 1, e.value) for k, e in s.verify_ms.items() if e.n], g + 1)

    def _plain_step(self, s: _KeyState) -> float:
        """Plain decoding's verification ms a step as priced (NaN before its first reading): the
        key's EWMA, or the engine's median of its last plain steps (``step_cost``'s t(1), any key)
        where that has ``min_steps`` readings and is lower (lock held).

        Why the lower of the two: plain decoding's EWMA is read again only where plain steps run,
        so while a proposer serves the key it keeps whatever its last readings said; read high
        (a slow request, a load that has passed) it stays high and prices every proposer too well
        against plain decoding, until a probe reads it again, while read low it corrects itself
        at once (plain decoding then serves): a draft pick priced on a plain step read well above
        the engine's median of the same minutes lost to plain decoding (bench/RESULTS.md,
        "Twenty-fifth session"). The median of the engine's plain steps (the n-gram's no-match
        ones are plain steps too) follows every key's traffic and shrugs off a stalled request;
        plain decoding is never priced above it."""
        v = self._verify_cost(s, 0) if 0 in s.verify_ms else math.nan
        if v == v and self.step_cost is not None and hasattr(self.step_cost, "plain"):
            t1, n = self.step_cost.plain()
            if n >= self.config.min_steps and 0 < t1 < v:
                return t1
        return v

    def _evaluate(self, s: _KeyState, batch: int = 1) -> dict[str, Any]:
        """The estimates and rates (tokens per ms per request) of one key at ``batch`` requests
        per fused step (class docstring; lock held)."""
        c = self.config
        a = s.alpha.value
        rho = {r: self.batch_factor(batch, r) for r in range(1, c.gamma_max + 2)}  # ρ_B(rows)
        td = s.draft_ms_per_token.value * rho[1]
        o = s.overhead_ms.value if s.overhead_ms.n else 0.0
        plain_now = self._plain_step(s)
        tplain = (plain_now + o) * rho[1] if plain_now == plain_now else math.nan
        tv = {g: self._verify_cost(s, g) * rho[g + 1] + o * rho[1] for g in range(1, c.gamma_max + 1)}
        rate: dict[int, float] = {}
        if tplain == tplain:
            rate[0] = 1.0 / max(tplain, 1e-6)  # a zero reading (a coarse clock) must not divide by zero
        if a == a and td == td:
            for g in range(1, c.gamma_max + 1):
                if tv[g] == tv[g]:
                    rate[g] = expected_tokens_per_step(a, g) / max(g * max(td, 0.0) + tv[g], 1e-6)
        ceiling = (None, math.nan)  # (γ, tokens/ms) of the draft at α = 1
        if td == td:
            top = {g: (g + 1) / max(g * max(td, 0.0) + tv[g], 1e-6) for g in tv if tv[g] == tv[g]}
            if top:
                g = max(top, key=top.get)
                ceiling = (g, top[g])
        others: dict[str, dict[int, float]] = {}
        for name, m in s.lengths.items():
            if not m.steps:
                continue
            r: dict[int, float] = {}
            capped = name in c.capped
            for g in ((c.gamma_max,) if capped else range(1, c.gamma_max + 1)):
                if g in m.step_ms and m.step_ms[g].n:  # its draft part at ρ_B(1), verification at ρ_B(γ + 1)
                    d = min(m.draft_ms.value, m.step_ms[g].value) if m.draft_ms.n else 0.0
                    verify = m.at_load(m.step_ms[g].value - d, plain_now, c.min_steps)  # at plain's load
                    rows = g + 1
                    if capped and g in m.rows and m.rows[g].n:  # its gate cuts each step: the rows it verifies
                        rows = min(g + 1, max(1, round(m.rows[g].value)))
                    cost = d * rho[1] + verify * rho[rows] + o * rho[1]
                else:
                    cost = m.draft_ms.value * rho[1] + tv[g]
                if cost == cost:
                    r[g] = m.tokens_per_step(g) / max(cost, 1e-6)
            others[name] = r
        # the engine's ceiling: any proposer at α = 1 with free proposals, (γ + 1) / t_verify(γ)
        free = {g: (g + 1) / max(tv[g], 1e-6) for g in tv if tv[g] == tv[g] and g in s.verify_ms}
        engine = (max(free, key=free.get), max(free.values())) if free else (None, math.nan)
        return {"alpha": a, "t_draft": td, "t_plain": tplain, "t_verify": tv, "rate": rate, "overhead": o * rho[1],
                "others": others, "ceiling": ceiling, "engine_ceiling": engine, "batch": batch, "rho": rho,
                "rel_se": self._rel_se(s, rate, others),
                "requests_measured": {n: c.count() for n, c in s.clusters.items()}}

    def _rel_se(self, s: _KeyState, rate: dict[int, float], others: dict[str, dict[int, float]]
                ) -> dict[tuple[str, int], float]:
        """The relative standard error of each candidate's rate (keys as :meth:`_candidates`):
        for the rate E / t of a speculative choice, sqrt(rse(E)^2 + rse(t)^2) (the delta method on
        log E - log t), rse(t) from its parts' per-step errors (:meth:`_Ewma.se`) and rse(E) from
        the spread of acceptance between requests (:meth:`_Clusters.rel_se`, inf below 2
        requests: one request's steps share one prompt), the relative error of the accepted part
        E - 1 carried to E as x (E - 1) / E, and scaled by t_{k-1} / z (Student's t quantile for
        k requests over the normal one: a bound from a handful of requests is that much wider); plain decoding's from its
        step's. Where a cost is read off other γ's measurements (:meth:`_verify_cost`), their
        largest error. A length-modelled proposer's is at least the relative error of its tokens
        per ms between requests (:meth:`_Clusters.ratio_rel_se`, at t_{k-1} / z): its steps' costs
        are clustered by request as its lengths are, which per-step errors miss. Lock held."""
        z = self._z()

        def verify_rse(g: int) -> float:
            e = s.verify_ms.get(g)
            if e is not None and e.n:
                return e.rel_se()
            known = [x.rel_se() for k, x in s.verify_ms.items() if k > 0 and x.n]
            return max(known) if known else math.inf

        def combine(*parts: tuple[float, float]) -> float:  # (value, rse) of a sum of costs
            tot = sum(v for v, _ in parts)
            if not tot > 0 or not math.isfinite(tot):
                return math.inf
            return math.hypot(*(v * r for v, r in parts if v > 0)) / tot

        def t_over_z(c) -> float:
            return t_quantile(self.config.confidence, c.count() - 1) / z if z > 0 else 1.0

        def tokens_rse(name: str) -> float:
            c = s.clusters.get(name)
            k = c.count() if c is not None else 0
            if k < 2:
                return math.inf
            return c.rel_se() * t_over_z(c)

        out: dict[tuple[str, int], float] = {}
        if 0 in s.verify_ms and s.verify_ms[0].n:
            out[("plain", 0)] = s.verify_ms[0].rel_se()
        td = s.draft_ms_per_token.value

        def of_tokens(spread: float, e: float) -> float:  # the accepted part's error, relative to all E tokens
            return 0.0 if e <= 1.0 else spread * (e - 1.0) / e

        spread = tokens_rse(DRAFT)
        for g in rate:
            if g > 0:
                cost = combine((g * td, s.draft_ms_per_token.rel_se()), (self._verify_cost(s, g), verify_rse(g)))
                out[(DRAFT, g)] = math.hypot(of_tokens(spread, expected_tokens_per_step(s.alpha.value, g)), cost)
        for name, rates in others.items():
            m = s.lengths[name]
            spread = tokens_rse(name)
            for g in rates:
                e = m.step_ms.get(g)
                if e is not None and e.n:
                    cost = e.rel_se()
                else:
                    cost = combine((m.draft_ms.value, m.draft_ms.rel_se()), (self._verify_cost(s, g), verify_rse(g)))
                out[(name, g)] = math.hypot(of_tokens(spread, m.tokens_per_step(g)), cost)
            c = s.clusters.get(name)
            if c is not None and c.count() >= 2:  # tokens per ms between requests, costs and lengths together
                ratio = c.ratio_rel_se() * t_over_z(c)
                for g in rates:
                    out[(name, g)] = max(out[(name, g)], ratio)
        return out

    @staticmethod
    def _draft_cannot_pay(ev: dict[str, Any]) -> bool:
        """True when the draft's α = 1 goodput (its ceiling) is measured and below plain decoding's."""
        plain, top = ev["rate"].get(0, math.nan), ev["ceiling"][1]
        return plain == plain and top == top and top < plain

    def _ceiling_probe_due(self, s: _KeyState) -> bool:
        """At a probe slot, with the draft's ceiling below plain: may the draft be probed? After
        back-off intervals of 1, 2, 4, ... probe_every requests up to ``ceiling_probe_every`` (a
        transient slowdown that made the draft look hopeless is re-measured soon; a draft that
        stays hopeless is probed ever more rarely). The back-off restarts whenever the ceiling is
        above plain again (:meth:`_hopeless`)."""
        c = self.config
        now = self.clock()
        stale = s.last_ceiling_probe_t is not None and now - s.last_ceiling_probe_t >= c.ceiling_reprobe_s
        spacing = min(c.probe_every * 2 ** min(s.ceiling_probes, 30), c.ceiling_probe_every)
        if not stale and s.requests - s.last_ceiling_probe < spacing:
            return False
        s.ceiling_probes = 1 if stale else s.ceiling_probes + 1  # an old verdict: the back-off restarts
        s.last_ceiling_probe, s.last_ceiling_probe_t = s.requests, now
        return True

    def _hopeless(self, s: _KeyState, ev: dict[str, Any]) -> bool:
        """Whether the draft is a candidate whose ceiling is below plain; otherwise the probe
        back-off restarts."""
        hopeless = DRAFT in self.config.proposers and self._draft_cannot_pay(ev)
        if not hopeless:
            s.ceiling_probes = 0
        return hopeless

    def _ceiling_why(self, ev: dict[str, Any]) -> str:
        g, top = ev["ceiling"]
        plain = ev["rate"][0]
        return (f"the draft cannot pay on this engine: at α = 1 its best, γ={g}, is {top:.3f} tok/ms = "
                f"{top / plain:.2f}x plain (draft {ev['t_draft']:.2f} ms per token, a verification of {g + 1} rows "
                f"{ev['t_verify'][g]:.2f} ms, a plain step {ev['t_plain']:.2f} ms); probed ever more rarely, "
                f"at most every {self.config.ceiling_probe_every} requests or {self.config.ceiling_reprobe_s:g} s")

    # ---- the decision ----------------------------------------------------------------------
    def _begin_request(self, key: Key) -> _KeyState:
        """Count a request of ``key``; a new adapter version serving it resets the draft's α
        (caller holds the lock)."""
        s = self._state(key)
        if self._version is not None:
            v = self._version()
            if s.adapter_version is not None and v != s.adapter_version:
                s.alpha = _Ewma()  # a new draft: its α is unknown
                s.clusters.pop(DRAFT, None)
            s.adapter_version = v
        if self._head_version is not None:
            h = self._head_version()
            if s.head_version is not None and h != s.head_version:
                s.lengths.pop(HEAD, None)  # a new head: its accepted lengths are unknown
                s.clusters.pop(HEAD, None)
            s.head_version = h
        s.requests += 1
        return s

    def offered(self) -> tuple[str, ...]:
        """The configured proposers that can propose now (``proposer_available``), in order."""
        if self._available is None:
            return self.config.proposers
        return tuple(n for n in self.config.proposers if self._available(n))

    def _choose(self, key: Key, policy: Any = None) -> tuple[int, dict[str, Any]]:
        """γ for the next request of ``key`` and the decision record (called once per request;
        ``policy``: the request's :class:`ControlledGamma`, for the one-warm-up-at-a-time rule of
        :meth:`_choose_among`)."""
        if self.config.proposers != (DRAFT,):
            return self._choose_among(key, policy)
        c = self.config
        with self._lock:
            s = self._begin_request(key)
            ev = self._evaluate(s)
            hopeless = self._hopeless(s, ev)
            rate = ev["rate"]
            spec_steps = sum(e.n for g, e in s.verify_ms.items() if g > 0)
            plain_steps = s.verify_ms[0].n if 0 in s.verify_ms else 0
            best = self._best(rate, 0, self._by_gamma(ev))
            best_spec = max((g for g in rate if g > 0), key=rate.get, default=None)
            probe = False
            held = DRAFT not in self.offered()  # build_serving_loop's hold_base_draft: no version yet
            warm_up = not held and (s.alpha.n == 0 or spec_steps < c.min_steps or plain_steps < c.min_steps)
            if held:
                gamma, why = 0, HELD_WHY
            elif s.alpha.n == 0 or spec_steps < c.min_steps:
                gamma, probe, why = c.gamma_init, True, f"warm-up: measuring α and draft cost at γ={c.gamma_init}"
            elif plain_steps < c.min_steps:
                gamma, probe, why = 0, True, "warm-up: measuring plain decoding"
            else:
                gamma = best
                why = self._why(ev, best, best_spec)
                if s.requests % c.probe_every == 0:
                    probe = True
                    unexplored = [g for g in range(1, c.gamma_max + 1) if g not in s.verify_ms]
                    if best > 0:
                        gamma, why = 0, f"probe: plain decoding (every {c.probe_every} requests); " + why
                    elif hopeless and not self._ceiling_probe_due(s):
                        probe = False  # _why says so
                    else:  # off: re-measure α at the cheapest informative γ (a better draft shows up there)
                        g = best_spec or 1
                        gamma, why = g, f"probe: γ={g} (every {c.probe_every} requests); " + why
                elif s.requests % c.probe_every == c.probe_every // 2 and best > 0:
                    unexplored = [g for g in range(1, c.gamma_max + 1) if g not in s.verify_ms]
                    if unexplored:
                        g = min(unexplored, key=lambda x: abs(x - best))
                        probe, gamma, why = True, g, f"probe: γ={g}, never measured; " + why
                elif best == 0 and s.requests % 2 == 0:
                    cands = self._candidates(ev)
                    unsure = self._unsure_candidate(s, cands, ev)
                    if unsure is not None:
                        ratio = cands[unsure] / cands[("plain", 0)]
                        probe, gamma, why = True, unsure[1], self._unsure_probe_why(s, unsure, ratio) + why
            decision = {
                "key": key_str(*key),
                "workload": key[0],
                "sampling": key[1],
                "gamma": gamma,
                "speculate": gamma > 0,
                "probe": probe,
                "warm_up": warm_up,
                "best_gamma": best,
                **_estimates(s, ev),
                "tokens_per_ms": {g: nan_none(r, 5) for g, r in sorted(ev["rate"].items())},
                "why": why,
                "proposer": DRAFT,
            }
            s.last = decision
            return gamma, decision

    def _choose_among(self, key: Key, policy: Any = None) -> tuple[int, dict[str, Any]]:
        """_choose over several proposers: candidates are plain decoding and (proposer, γ) for
        each proposer and γ = 1..γ_max, rated in tokens per ms (the draft by α as in the class
        docstring, a length-modelled proposer by its measured accepted lengths). Warm-up measures
        each proposer in the configured order at ``gamma_init``, then plain decoding; a proposer
        that runs a model (the draft, the head) is warmed up by one request of a key at a time:
        a request that starts while another one (``policy``, alive and still warming it) measures
        it runs plain decoding instead while plain is unmeasured (the warm-up needs it too), else
        the best measured choice. Without that, the 4 requests of a cold key that a 4-client load
        starts at once all ran the draft at γ = 4 (bench/RESULTS.md, "CPU per output token").
        Every
        ``probe_every`` requests one probes, in turn, plain decoding and each proposer other
        than the best at its best γ (so a draft that training improved is noticed), for
        ``min_steps`` steps, then goes on as a warm-up request does (:meth:`after_warm_up`)."""
        c = self.config
        with self._lock:
            s = self._begin_request(key)
            ev = self._evaluate(s)
            hopeless = self._hopeless(s, ev)
            cands = self._candidates(ev)
            probe, why = False, ""
            choice = self._warm_up(s)
            if choice is not None and policy is not None:
                choice = self._one_warm_up(s, choice, policy)
            warm_up = choice is not None
            if choice is not None:
                choice, why = choice
                probe = True
            best_of = {name: max(((n, g) for (n, g) in cands if n == name), key=cands.get, default=None)
                       for name in c.proposers}
            best = self._best(cands, ("plain", 0), ev["rel_se"]) if cands else ("plain", 0)
            if choice is None:
                choice, why = best, self._why_among(cands, best, ev)
                if hopeless:
                    why += "; " + self._ceiling_why(ev)
                if s.requests % c.probe_every == 0:
                    others = [("plain", 0)] + [best_of[n] for n in c.proposers if best_of[n] is not None]
                    others = [o for o in others if o != best and o[0] != best[0]]
                    drafts = [o for o in others if o[0] == DRAFT]
                    if drafts and hopeless:  # the draft only when its back-off is due, and then the draft
                        others = drafts if self._ceiling_probe_due(s) else [o for o in others if o[0] != DRAFT]
                    if others:
                        choice = others[(s.requests // c.probe_every) % len(others)]
                        probe = True
                        what = "plain decoding" if choice[1] == 0 else f"{choice[0]} γ={choice[1]}"
                        why = f"probe: {what} (every {c.probe_every} requests); " + why
                elif best[1] == 0 and s.requests % c.unsure_probe_every == 0:
                    unsure = self._unsure_candidate(s, cands, ev)
                    if unsure is not None:
                        choice, probe = unsure, True
                        why = self._unsure_probe_why(s, unsure, cands[unsure] / cands[("plain", 0)]) + why
            name, gamma = choice
            decision = {
                "key": key_str(*key),
                "workload": key[0],
                "sampling": key[1],
                "gamma": gamma,
                "proposer": name if gamma else None,
                "speculate": gamma > 0,
                "probe": probe,
                "warm_up": warm_up,  # ControlledGamma moves a warm-up request on after min_steps (after_warm_up)
                "best_gamma": best[1],
                "best_proposer": best[0] if best[1] else None,
                **_estimates(s, ev),
                "tokens_per_ms": {g: nan_none(r, 5) for g, r in sorted(ev["rate"].items())},
                "tokens_per_ms_by_proposer": {n: {g: nan_none(r, 5) for g, r in sorted(rates.items())}
                                              for n, rates in ev["others"].items()},
                "why": why,
            }
            s.last = decision
            return gamma, decision

    def _unsure_candidate(self, s: _KeyState, cands: dict[tuple[str, int], float], ev: dict[str, Any]
                          ) -> tuple[str, int] | None:
        """The best speculative candidate when its rate beats plain decoding's by more than
        ``min_gain`` but its confidence bound does not clear plain (:meth:`_pays`), while fewer
        than a full window of its requests (:class:`_Clusters`) is measured: a proposer that
        looks better is measured again every other request (for ``min_steps`` steps, as a
        probe) until the bound says, instead of once every ``probe_every`` requests. Else None."""
        plain = cands.get(("plain", 0), math.nan)
        spec = [k for k in cands if k[1] > 0 and cands[k] == cands[k]]
        if plain != plain or not spec:
            return None
        top = max(spec, key=cands.get)
        clusters = s.clusters.get(top[0])
        if not cands[top] > plain * (1.0 + self.config.min_gain) or (clusters is not None and clusters.count() >= clusters.keep):
            return self._few_requests(s, cands, spec)
        return top

    def _few_requests(self, s: _KeyState, cands: dict[tuple[str, int], float], spec: list[tuple[str, int]]
                      ) -> tuple[str, int] | None:
        """The best candidate of a model-free proposer (no model to run: where it proposes badly
        its gate cuts it to about a plain step) measured on fewer than :data:`MIN_VERDICT_REQUESTS`
        requests, whatever its rate: a verdict from one request's steps is one prompt's, at one
        moment's load (a walkthrough's first n-gram request ran while v0 bootstrapped beside it and
        left prose on plain decoding for most of its phase, probed once in ``probe_every``;
        bench/RESULTS.md, "Twentieth session"); or one priced ahead of plain decoding on the point
        but within ``min_gain`` of it, until a full window of its requests is measured: a walkthrough
        (7746fc5) priced the n-gram at 1.00-1.04x plain from 3 requests, one of them its warm-up,
        never measured it again, and on never-served prompts it ran 1.08-1.13x. Else None."""
        plain = cands.get(("plain", 0), math.nan)

        def measured(name: str) -> int:
            return s.clusters[name].count() if name in s.clusters else 0

        few = [k for k in spec if proposer_spec(k[0]).model_free
               and (measured(k[0]) < MIN_VERDICT_REQUESTS or (cands[k] > plain and measured(k[0]) < _Clusters.KEEP))]
        return max(few, key=cands.get) if few else None

    def _unsure_probe_why(self, s: _KeyState, unsure: tuple[str, int], ratio: float) -> str:
        """Why ``unsure`` is probed; ``ratio``: its rate over plain decoding's."""
        n = s.clusters[unsure[0]].count() if unsure[0] in s.clusters else 0
        if n < MIN_VERDICT_REQUESTS and proposer_spec(unsure[0]).model_free:
            return (f"probe: {unsure[0]} γ={unsure[1]}, measured on {_requests(n)}: every other request until "
                    f"{MIN_VERDICT_REQUESTS} are; ")
        if not ratio > 1.0 + self.config.min_gain:
            return (f"probe: {unsure[0]} γ={unsure[1]}, {ratio:.3f}x plain: ahead within {self._margin()}, measured "
                    f"every other request until {_Clusters.KEEP} requests are ({_requests(n)} so far); ")
        return (f"probe: {unsure[0]} γ={unsure[1]}, ahead of plain but not yet beyond its confidence bound: measured "
                f"every other request until it is ({_requests(n)} so far); ")

    def _one_warm_up(self, s: _KeyState, choice: tuple[tuple[str, int], str], policy: Any
                     ) -> tuple[tuple[str, int], str] | None:
        """``choice`` (a warm-up from :meth:`_warm_up`) for the request ``policy``, unless another
        live request of this key is warming up the same model-run proposer: then plain
        decoding's warm-up while plain is unmeasured, else None (the best measured choice). The
        request that gets a model-run proposer's warm-up is remembered (weakly: a finished
        request's policy is gone). Lock held."""
        (name, _), _why = choice
        if name == "plain" or proposer_spec(name).model_free:
            return choice
        ref = s.warming.get(name)
        other = ref() if ref is not None else None
        if other is not None and other is not policy and other.warming_up(name):
            if (s.verify_ms[0].n if 0 in s.verify_ms else 0) < self.config.min_steps:
                return ("plain", 0), f"warm-up: measuring plain decoding ({name}'s warm-up is under way in another request)"
            return None
        s.warming[name] = weakref.ref(policy)
        return choice

    def _warm_up(self, s: _KeyState) -> tuple[tuple[str, int], str] | None:
        """The (proposer, γ) still to measure, and why, while a key warms up: each proposer in the
        configured order at ``gamma_init`` for ``min_steps`` steps, then plain decoding; None when
        every candidate is measured."""
        c = self.config
        for name in self.offered():
            if name == DRAFT:
                steps = s.alpha.n and sum(e.n for g, e in s.verify_ms.items() if g > 0)
                # (its ms per token is unmeasured only before its first step, or after remeasure_costs)
                cold = s.alpha.n == 0 or steps < c.min_steps or s.draft_ms_per_token.n == 0
            else:
                m = s.lengths.get(name)
                cold = m is None or m.steps < c.min_steps
            if cold:
                g = c.eagle_gamma_init if name == HEAD else c.gamma_max if name in c.capped else c.gamma_init
                return (name, g), f"warm-up: measuring {name} at γ={g}"
        if (s.verify_ms[0].n if 0 in s.verify_ms else 0) < c.min_steps:
            return ("plain", 0), "warm-up: measuring plain decoding"
        return None

    def _candidates(self, ev: dict[str, Any]) -> dict[tuple[str, int], float]:
        """(proposer, γ) -> expected tokens per ms; ("plain", 0) for plain decoding."""
        cands: dict[tuple[str, int], float] = {}
        if 0 in ev["rate"]:
            cands[("plain", 0)] = ev["rate"][0]
        offered = self.offered()
        if DRAFT in offered:
            cands.update({(DRAFT, g): r for g, r in ev["rate"].items() if g > 0})
        for name, rates in ev["others"].items():
            if name in offered:
                cands.update({(name, g): r for g, r in rates.items()})
        return cands

    def _why_among(self, cands: dict[tuple[str, int], float], best: tuple[str, int], ev: dict[str, Any]) -> str:
        plain = cands.get(("plain", 0), math.nan)
        spec = [k for k in cands if k[1] > 0]
        if best[1] > 0:
            runner = max((k for k in spec if k[0] != best[0]), key=cands.get, default=None)
            also = f"; best {runner[0]} γ={runner[1]} {cands[runner]:.3f}" if runner else ""
            return f"{best[0]} γ={best[1]}: {cands[best]:.3f} tok/ms vs plain {plain:.3f}{also}"
        if not spec:
            return f"off: plain {plain:.3f} tok/ms (no speculative estimate)"
        top = max(spec, key=cands.get)
        p_s, t_s = _two(plain, cands[top])
        why = (f"off: plain {p_s} tok/ms beats every proposer (best {top[0]} γ={top[1]} {t_s})"
               if cands[top] <= plain else
               self._unsure(top, cands[top], plain, ev) if cands[top] > plain * (1.0 + self.config.min_gain) else
               f"off: the best, {top[0]} γ={top[1]} {t_s} tok/ms, is within {self._margin()} of plain {p_s}")
        g, free = ev.get("engine_ceiling", (None, math.nan))
        # the ceiling is priced on the verification steps' costs by γ, a proposer's rate on its own steps (at
        # plain's load): where a measured rate is above the ceiling, the two cost readings disagree, and the
        # clause would state a bound that a rate in the same sentence breaks, so it is left unsaid
        if free == free and plain == plain and free < plain and cands[top] <= free:
            why += (f"; no proposer can pay on this engine now: even accepted in full and free, its best, γ={g}, "
                    f"is {free:.3f} tok/ms = {free / plain:.2f}x plain (a verification of {g + 1} rows "
                    f"{ev['t_verify'][g]:.2f} ms, a plain step {ev['t_plain']:.2f} ms)")
        return why

    def _unsure(self, top: tuple[str, int], rate: float, plain: float, ev: dict[str, Any]) -> str:
        """Why a candidate ahead by more than ``min_gain`` still does not serve: its bound."""
        rse = self._ratio_rse(ev.get("rel_se"), top, ("plain", 0))
        low = self._lower(rate, plain, rse)
        n = ev.get("requests_measured", {}).get(top[0], 0)
        if n < 2:  # no spread between requests yet, so no bound: no ratio "below 0.01x" from one request
            return (f"off: the best, {top[0]} γ={top[1]} {rate:.3f} tok/ms, is {rate / plain:.2f}x plain {plain:.3f} on "
                    f"{_requests(n)}: too few for its {percent(self.config.confidence)} % lower bound (it needs the "
                    f"spread between 2 or more requests; config.confidence)")
        more = (f"its last {n} requests measured: within noise of plain" if n >= _Clusters.KEEP
                else f"{_requests(n)} measured: not yet enough to tell from plain")
        places = 2  # a bound below 1 never printed as "1.00x" (a walkthrough read it as "at 1", not short of it)
        while low < 1 and round(low, places) >= 1 and places < 6:
            places += 1
        bound = f"is {low:.{places}f}x" if low >= 0.01 else "is below 0.01x, i.e. none yet"  # 2-3 requests: t is 6.3-2.9
        return (f"off: the best, {top[0]} γ={top[1]} {rate:.3f} tok/ms, is {rate / plain:.2f}x plain {plain:.3f}, but "
                f"the {percent(self.config.confidence)} % lower bound of that ratio {bound} ({more}; "
                f"config.confidence)")

    def _why(self, ev: dict[str, Any], best: int, best_spec: int | None) -> str:
        rate, a = ev["rate"], ev["alpha"]
        if best > 0:
            return f"γ={best}: {rate[best]:.3f} tok/ms vs plain {rate[0]:.3f} (α={a:.2f})"
        if best_spec is None:
            return f"off: plain {rate[0]:.3f} tok/ms (no speculative estimate)"
        if rate[best_spec] > rate[0] * (1.0 + self.config.min_gain):
            return self._unsure((DRAFT, best_spec), rate[best_spec], rate[0], ev) + f" (α={a:.2f})"
        label = (f"draft useless (α={a:.2f})" if a < self.config.useless_alpha else
                 f"α={a:.2f} too low for its cost" if rate[best_spec] <= rate[0] else
                 f"α={a:.2f}, within {self._margin()} of plain")
        why = f"off: {label}: plain {rate[0]:.3f} tok/ms vs best γ={best_spec} {rate[best_spec]:.3f}"
        return why + "; " + self._ceiling_why(ev) if self._draft_cannot_pay(ev) else why

    def decision(self, key: Key) -> dict[str, Any]:
        """The inputs and outcome for ``key`` as they stand now (what the next non-probe request
        would get), plus the last request's decision under ``"last"`` and the decision at each of
        ``config.batch_sizes`` under ``"by_batch"`` ({B: {"gamma", "proposer", "speculate",
        "gamma_by_proposer", "tokens_per_ms" (per request), "plain_tokens_per_ms",
        "step_cost_factor" {rows: ρ_B(rows)}, "why"}}); JSON-ready."""
        with self._lock:
            s = self._keys.get(key)
            if s is None:
                return {"key": key_str(*key), "gamma": None, "why": "no requests yet"}
            ev = self._evaluate(s)
            rate = ev["rate"]
            if self.config.proposers != (DRAFT,):
                cands = self._candidates(ev)
                warm = self._warm_up(s)
                best = self._best(cands, ("plain", 0), ev["rel_se"]) if cands and warm is None else None
                return {
                    "key": key_str(*key), "workload": key[0], "sampling": key[1],
                    "gamma": best[1] if best else None, "proposer": best[0] if best and best[1] else None,
                    "speculate": bool(best and best[1]), **_estimates(s, ev),
                    "tokens_per_ms": {g: nan_none(r, 5) for g, r in sorted(rate.items())},
                    "tokens_per_ms_by_proposer": {n: {g: nan_none(r, 5) for g, r in sorted(rs.items())}
                                                  for n, rs in ev["others"].items()},
                    "why": (self._why_among(cands, best, ev)
                            + ("; " + self._ceiling_why(ev) if DRAFT in self.config.proposers
                               and self._draft_cannot_pay(ev) else "")
                            if best is not None else (warm[1] if warm else "warm-up: no estimate yet")),
                    "by_batch": self._by_batch(s),
                    "last": dict(s.last),
                }
            best = self._best(rate, 0, self._by_gamma(ev))
            best_spec = max((g for g in rate if g > 0), key=rate.get, default=None)
            why = self._why(ev, best, best_spec) if best is not None and 0 in rate else "warm-up"
            if DRAFT not in self.offered():
                best, why = 0, HELD_WHY
            return {
                "key": key_str(*key),
                "workload": key[0],
                "sampling": key[1],
                "gamma": best,
                "speculate": bool(best),
                **_estimates(s, ev),
                "tokens_per_ms": {g: nan_none(r, 5) for g, r in sorted(rate.items())},
                "why": why,
                "by_batch": self._by_batch(s),
                "last": dict(s.last),
            }

    def _best(self, rates: dict, plain_key, rse: dict | None = None):
        """The key of the highest rate in ``rates`` (tokens per ms; None when empty), except that
        plain decoding (``plain_key``) stands unless the best beats it by more than
        ``config.min_gain`` with its confidence bound above plain (:meth:`_pays`; ``rse``: each
        key's relative standard error, as ``rates``)."""
        if not rates:
            return None
        plain = rates.get(plain_key, math.nan)
        if plain != plain:
            return max(rates, key=rates.get)
        return self._first_paying(rates, plain, lambda k: self._ratio_rse(rse, k, plain_key), exclude=plain_key) or plain_key

    def _first_paying(self, rates: dict, plain: float, rse_of: Callable[[Any], float], exclude: Any = None):
        """The key of the highest rate in ``rates`` that pays over ``plain`` with its bound
        (:meth:`_pays`), None where none does: a candidate whose estimate is highest but least
        measured does not hide a lower one that clears its bound."""
        for k in sorted((k for k in rates if k != exclude and rates[k] == rates[k]), key=rates.get, reverse=True):
            if not rates[k] > plain * (1.0 + self.config.min_gain):
                return None
            if self._pays(rates[k], plain, rse_of(k)):
                return k
        return None

    @staticmethod
    def _by_gamma(ev: dict[str, Any]) -> dict[int, float]:
        """The draft's relative standard errors by γ (0: plain decoding), as ``ev["rate"]``."""
        return {(0 if n == "plain" else g): r for (n, g), r in ev["rel_se"].items() if n in ("plain", DRAFT)}

    @staticmethod
    def _ratio_rse(rse: dict | None, key, plain_key) -> float:
        """The relative standard error of rate[key] / rate[plain_key] (0 without ``rse``)."""
        if rse is None:
            return 0.0
        return math.hypot(rse.get(key, math.inf), rse.get(plain_key, math.inf))

    def _z(self) -> float:
        return NormalDist().inv_cdf(self.config.confidence)

    def _margin(self) -> str:
        return f"the {self.config.min_gain:.0%} margin (min_gain)"

    def _lower(self, rate: float, plain: float, rse: float) -> float:
        """The one-sided ``config.confidence`` lower bound of rate / plain: ratio x exp(-z rse)."""
        return rate / plain * math.exp(-self._z() * rse) if plain > 0 else math.nan

    def _pays(self, rate: float, plain: float, rse: float = 0.0) -> bool:
        """``rate`` beats ``plain`` (tokens per ms) by more than ``config.min_gain``, and the lower
        confidence bound of their ratio (``rse``: its relative standard error) is above 1."""
        if not rate > plain * (1.0 + self.config.min_gain):
            return False
        return self._z() == 0 or self._lower(rate, plain, rse) > 1.0

    def _best_gamma_for(self, ev: dict[str, Any], proposer: str, cap: int) -> int | None:
        """The best γ in 1..``cap`` of ``proposer`` in an evaluation, 0 where plain decoding beats
        each; None while either side is unestimated."""
        plain = ev["rate"].get(0, math.nan)
        rates = {g: r for g, r in ev["rate"].items() if g > 0} if proposer == DRAFT else ev["others"].get(proposer, {})
        rates = {g: r for g, r in rates.items() if g <= cap and r == r}
        if plain != plain or not rates:
            return None
        return self._first_paying(rates, plain, lambda g: self._ratio_rse(ev.get("rel_se"), (proposer, g), ("plain", 0))) or 0

    def after_warm_up(self, key: Key, proposer: str | None, gamma: int) -> tuple[int, str, bool] | None:
        """What the rest of a warm-up request of ``key`` runs at once the configuration it
        measures (``proposer`` at ``gamma``, or plain decoding when ``gamma`` is 0) has its
        ``min_steps`` steps: ``(γ, why, still_warming)`` (``why`` continues the warm-up's own
        reason), or None to keep ``gamma``. A request
        cannot change its proposer, so: plain decoding (γ = 0) while plain is still unmeasured
        (``still_warming``: it measures); else ``proposer``'s best γ (0 where plain beats each)
        once the estimates can say; else None. Without this, every warm-up configuration ran a
        whole request: a base draft at γ = 4 that none of its proposals passed served 64 tokens at
        about 0.4x plain (bench/RESULTS.md, "draftd serve against llama-server")."""
        c = self.config
        with self._lock:
            s = self._keys.get(key)
            if s is None:
                return None
            warm = self._warm_up(s)
            if warm is not None:
                (name, g), why = warm
                if (name == "plain" and gamma == 0) or (name == proposer and g == gamma):
                    return None  # still measuring what this request runs
                if name == "plain" or (s.verify_ms[0].n if 0 in s.verify_ms else 0) < c.min_steps:
                    return 0, "then measuring plain decoding", True
            if proposer is None:  # a plain warm-up request (no proposer to return to): done measuring
                return (0, "then plain decoding", False) if warm is None and gamma == 0 else None
            ev = self._evaluate(s, 1)
            best = self._best_gamma_for(ev, proposer, c.gamma_max)
            if best is None:
                return None
            if best:
                return best, f"then {proposer} γ={best}, its best", False
            rates = ev["rate"] if proposer == DRAFT else ev["others"].get(proposer, {})
            top = max((r for g, r in rates.items() if g > 0 and r == r), default=math.nan)
            if top > ev["rate"].get(0, math.nan) * (1.0 + c.min_gain):
                n = ev["requests_measured"].get(proposer, 0)
                return 0, (f"then plain decoding until {proposer}, ahead of it, clears its "
                           f"{percent(c.confidence)} % bound on more requests ({_requests(n)} so far)"), False
            return 0, f"then plain decoding, which beats {proposer}", False

    def batch_gamma(self, key: Key, proposer: str, batch: int, cap: int) -> int:
        """γ for the next step of a request of ``key`` served by ``proposer`` in a fused step of
        ``batch`` requests: the proposer's best γ <= ``cap`` (the request's own γ) at that batch
        size, 0 (a plain step) where plain decoding beats every such γ there (class docstring);
        ``cap`` while the key's estimates cannot say (warm-up)."""
        if batch <= 1 or cap <= 0:
            return cap
        with self._lock:
            s = self._keys.get(key)
            if s is None:
                return cap
            g = self._best_gamma_for(self._evaluate(s, batch), proposer, cap)
        return cap if g is None else g

    def _by_batch(self, s: _KeyState) -> dict[int, dict[str, Any]]:
        """What a request of this key runs at in a batch of each of ``config.batch_sizes`` (lock
        held): the key's decision at batch 1 (proposer p, γ_1), then at B the best γ <= γ_1 of p
        there (:meth:`batch_gamma`, as :class:`ControlledGamma` runs it), 0 where plain decoding
        beats each; ``gamma_by_proposer`` the same for every offered proposer (capped by its own
        best γ at batch 1); the rates per request and the step cost factors ρ_B(r)."""
        c = self.config
        ev1 = self._evaluate(s, 1)
        cands1 = self._candidates(ev1)
        warm = self._warm_up(s) if c.proposers != (DRAFT,) else None
        best1 = self._best(cands1, ("plain", 0), ev1["rel_se"]) if cands1 and 0 in ev1["rate"] and warm is None else None
        names = list(self.offered())
        caps = {n: self._best_gamma_for(ev1, n, c.gamma_max) for n in names}
        out: dict[int, dict[str, Any]] = {}
        for b in c.batch_sizes:
            ev = ev1 if b == 1 else self._evaluate(s, b)
            plain = ev["rate"].get(0, math.nan)
            per = {n: (cap if not cap else self._best_gamma_for(ev, n, cap)) for n, cap in caps.items()}
            rho = ev["rho"]
            if best1 is None:
                name, g, why = None, None, "warm-up: no estimate yet"
            elif best1[1] == 0:
                name, g, why = None, 0, "off at batch 1 already"
            else:
                name, g = best1[0], per.get(best1[0])
                if g is None:
                    g = best1[1]
                rates = ev["rate"] if name == DRAFT else ev["others"].get(name, {})
                if g > 0:
                    why = (f"{name} γ={g}: {rates[g]:.4f} tok/ms per request vs plain {plain:.4f} "
                           f"(a step of {g + 1} rows x{rho[g + 1]:.2f} its batch-1 cost, a plain one x{rho[1]:.2f})")
                else:
                    top = max((k for k in rates if k <= best1[1]), key=rates.get, default=None)
                    why = (f"off: plain {plain:.4f} tok/ms per request (a plain step x{rho[1]:.2f} its batch-1 cost)"
                           + (f" beats {name} at every γ <= {best1[1]} (best γ={top} {rates[top]:.4f}, its {top + 1} "
                              f"rows x{rho[top + 1]:.2f})" if top else ""))
            out[b] = {
                "gamma": g,
                "proposer": name if g else None,
                "speculate": bool(g),
                "gamma_by_proposer": per,
                "tokens_per_ms": nan_none((ev["rate"] if name == DRAFT else ev["others"].get(name, {})).get(g, plain)
                                          if g else plain, 5) if g is not None else None,
                "plain_tokens_per_ms": nan_none(plain, 5),
                "step_cost_factor": {r: round(rho[r], 3) for r in range(1, min(c.gamma_max + 1, 5) + 1)},
                "why": why,
            }
        return out

    def status(self) -> dict[str, Any]:
        """decision() of every key seen, keyed ``"{workload}@{bucket}"``."""
        return {key_str(*k): self.decision(k) for k in list(self._keys)}


_request_ids = itertools.count(1)


def forward_rows(step: StepStats, batch: int, total: int | None) -> int:
    """Rows of the forward a step ran: the fused forward's ``total`` inside a batch of ``batch`` > 1
    requests, else the step's own (proposals + 1). A policy passes it as the next step's
    ``after_rows`` (:meth:`GoodputController.observe`)."""
    return total if batch > 1 and total else step.proposed + 1


def new_request_id() -> int:
    """A fresh id for :meth:`GoodputController.observe`'s ``request`` (unique in the process)."""
    return next(_request_ids)


class ControlledGamma:
    """The :class:`decoder.speculative.GammaPolicy` of one request under a GoodputController.

    Inside a batch its γ per batch size is re-read from the controller every ``REFRESH_STEPS``
    steps (an evaluation costs about as much as a fraction of a millisecond, and the estimates
    it reads move by an EWMA)."""

    REFRESH_STEPS = 16

    def __init__(self, controller: GoodputController, key: Key):
        self.controller, self.key = controller, key
        self.request_id = next(_request_ids)  # its steps' unit in the acceptance's per-request spread
        self._gamma: int | None = None
        self._asked: float | None = None  # clock at the last gamma() call (a step starts there)
        self._modelled: float | None = None  # draft_ms + verify_ms of the step just updated
        self._rows: int = 0  # rows its last forward verified (0: none yet, the prefill was its last)
        self._batch = 1  # requests in the fused step of the step under way
        self._steps = 0
        self._updated = False  # a step of this request that asked for proposals has been observed (``first``)
        self._by_batch: dict[int, tuple[int, int]] = {}  # batch size -> (γ there, step it was read at)
        self._warming = False  # a warm-up request: after min_steps steps it may move on (after_warm_up)
        self._warm_proposer: str | None = None  # the proposer the request started with (it cannot change)
        self._warm_why = ""  # the warm-up's own reason
        self.decision: dict[str, Any] | None = None
        self.batch_size: Callable[[], int] = routed_batch_size  # requests decoding together now
        # whether speculating pays at a batch size, as the batch's realized goodput says (decoder.batching)
        self.batch_pays: Callable[[int], tuple[bool | None, str]] = routed_speculation_pays
        self.batch_why: str | None = None  # why the last step inside a batch decoded plainly, if it did

    def warming_up(self, proposer: str) -> bool:
        """Whether this request is (still) the warm-up of ``proposer`` for its key: it started as
        one and has not yet moved on after ``min_steps`` steps (the controller lets one live request
        of a key warm a model-run proposer up at a time)."""
        return self._warming and self._warm_proposer == proposer

    def gamma(self) -> int:
        """γ of the next step: the request's γ (decided at its first call), or inside a batch of
        B > 1 requests its proposer's best γ at B, at most the request's (a probe's and a
        warm-up's γ stay: they measure); ``batch_size()`` says B. Inside a batch where the batch's
        realized goodput says speculating does not pay at B (``batch_pays``,
        :class:`decoder.batching.BatchGoodput`: tokens per ms of the whole batch's speculative
        cycles against its plain ones), 0, warm-ups and probes included: their rows and proposals
        sit in every batch mate's steps."""
        if self._gamma is None:
            self._gamma, self.decision = self.controller._choose(self.key, self)
            # a warm-up, and a periodic probe of another configuration, measure it for min_steps
            # steps and then go on at the best (after_warm_up): a probe of a draft that plain beats
            # used to serve its whole request at the draft (0.74x llama-server's plain at 1 client
            # against 0.97-1.01x for the other requests: bench/RESULTS.md, "Eighth session")
            self._warming = bool(self.decision.get("warm_up") or self.decision.get("probe"))
            self._warm_proposer = self.decision.get("proposer")
            self._warm_why = str(self.decision.get("why", ""))
        now = self.controller.clock()
        b = self.batch_size()
        if self._asked is not None and self._modelled is not None:
            # gamma() to gamma(): the whole previous step, loop bookkeeping and cache crops included
            self.controller.observe_overhead(self.key, (now - self._asked) * 1e3 - self._modelled, self._batch)
        self._asked, self._modelled, self._batch = now, None, b
        self._steps += 1
        if self._warming and self._steps > self.controller.config.min_steps and not self._whole_request():
            nxt = self.controller.after_warm_up(self.key, self.decision.get("proposer") or self._warm_proposer, self._gamma)
            if nxt is not None:
                g, why, self._warming = nxt
                self._warm_proposer = self._warm_proposer or self.decision.get("proposer")
                self._gamma = g
                why = f"{self._warm_why}; {why}"  # still says it was a warm-up request, and what it ran after
                self.decision = {**self.decision, "gamma": g, "speculate": g > 0, "probe": self._warming, "why": why,
                                 "proposer": self._warm_proposer if g else None}
        g = self._gamma
        self.batch_why = None
        if b > 1 and g > 0:
            pays, why = self.batch_pays(b)
            if pays is False:  # measured on the whole batch: its speculative steps cost more than they bring
                self.batch_why = why
                return 0
        if b > 1 and g > 0 and not self.decision.get("probe"):
            hit = self._by_batch.get(b)
            if hit is None or self._steps - hit[1] >= self.REFRESH_STEPS:
                hit = (self.controller.batch_gamma(self.key, self.proposer_name() or DEFAULT_PROPOSER, b, g), self._steps)
                self._by_batch[b] = hit
            g = hit[0]
        return g

    def _whole_request(self) -> bool:
        """Whether this warm-up or probe measures its configuration over the whole request: a
        model-free proposer's (the n-gram's) at γ > 0. Its acceptance depends on where in the
        answer a step falls (the start of an answer restates the question, which it copies), so
        its first ``min_steps`` steps priced it far above what whole requests ran (a math pick:
        docs/walkthroughs.md, the run at 79fed52); it runs no model, so
        a whole request of it costs little where it does not pay (its gate proposes nothing
        there). A model-run draft still moves on after ``min_steps``: a whole request of a draft
        that plain beats is that much slower."""
        p = self.decision.get("proposer") or self._warm_proposer
        return bool(self._gamma) and p is not None and p in REQUEST_PROPOSERS and proposer_spec(p).model_free

    def proposer_name(self) -> str | None:
        """The proposer chosen for this request (after the first :meth:`gamma` call)."""
        return (self.decision or {}).get("proposer") or None

    def update(self, step: StepStats) -> None:
        self._modelled = step.draft_ms + step.verify_ms
        asked = step.asked if step.asked is not None else self._gamma
        batch, total = last_fused_size(), last_fused_rows()
        self.controller.observe(self.key, step, proposer=self.proposer_name() or DEFAULT_PROPOSER,
                                asked=asked, batch=batch, first=not self._updated, total=total,
                                request=self.request_id, after_rows=self._rows if batch <= 1 else None)
        self._rows = forward_rows(step, batch, total)
        self._updated = self._updated or bool(step.asked or step.proposed)

    def describe(self) -> str:
        return f"goodput γ={self.gamma()} ({self.decision['why']})" if self.decision else "goodput"
