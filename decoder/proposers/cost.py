"""The measured cost of a decoding step by the rows it verifies (:class:`StepCost`), alone or fused
with batch mates' rows (continuous batching), shared by the n-gram gate, the goodput controller's
batch scaling (:meth:`StepCost.batch_factor`) and its ceiling (:func:`speculation_ceiling`)."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque

from decoder.metrics import line_at
from decoder.proposers.base import is_int


class StepCost:
    """Measured wall ms of one decoding step (proposal, verification, acceptance test; not the
    cache crop after it, which costs microseconds) by the rows it verified, n = proposals + 1
    (n = 1: a plain step). Fed by the decoder from the steps that ran no draft model (the n-gram
    proposer's and plain ones).

    - t(1): the median of the last ``window`` plain steps (a median, not a mean: one step stalled
      by another process, a page fault or a graph rebuild must not make proposals look expensive
      for the next dozens).
    - t(n), n > 1, paired in time: each step of n rows counts as its ratio to the plain steps of
      its own time (the median of the last ``ref_steps`` plain steps of the ``ref_max_age_s``
      seconds before it; with none that recent, to t(1) when read), and t(n) = t(1) x the
      median ratio of its last ``window`` steps, never below t(1) (a verification is never
      cheaper than a plain step; before any plain step, the median of its ms). Beside a
      trainer that runs in rounds every step costs more during a round, and proposals are tried
      at other times than plain steps run, so unpaired medians mixed a busy core's multi-row
      steps with an idle core's plain ones.
    - priced (:meth:`ms`, and through it the fused and batch prices): the least-squares fit of
      those t(n) that never falls with more rows (:func:`monotone_fit`, pool adjacent violators),
      each t(n) weighted by its readings (t(1): the plain steps in its window): a verification of
      more rows cannot cost less, so a run of readings that falls with more rows is noise and is
      priced at its weighted mean (a running max would let one high reading raise the price of
      every larger n). :meth:`status` and :meth:`ceiling` give t(n) as measured.
    - an unmeasured n is read off the measured ones as priced (:func:`read_off` of the fit):
      between two measured row counts on the straight line between them; beyond the largest, on
      the least-squares line through the measured multi-row counts (slope clamped at >= 0) where
      two are measured, else at the largest one's own cost; so before any proposal is measured a
      proposal looks as cheap as a plain step, and one longer than any measured as cheap as the
      longest, and the first ones measure what they really cost. The line leaves the plain step
      out: llama.cpp runs one row on another kernel than several, so the step from 1 to 2 rows
      is no per-row price (a 2-row verification at 2.05 plain steps and 5 rows at 2.7 on one
      CPU, bench/RESULTS.md, "Tenth session"); drawn through 1 and 2 rows it priced 5 rows at
      5.2 steps, and a gate that believed it never proposed more than one token again.
    - a step fused with batch mates' rows (continuous batching, :mod:`decoder.batching`): B
      sequences of r rows each, t_B(r) (:meth:`fused_ms`), the price of a γ that every request of
      the batch runs (each request of a key follows the same policy). llama.cpp decodes all
      B x r rows of a fused forward in one ubatch, the same matrix shapes as one sequence's
      forward of B x r rows, so t_B(r) is modelled as t(B x r) off the batch-1 curve above, times
      a per-B correction k_B = the median of measured T_B(N') / t(N') over the total row counts N'
      measured at B (each (B, N') reading paired in time like n > 1 above; k_B = 1 before any),
      never below t(r) (a step with batch mates never costs less than alone). A measured
      (B, B x r) is read as measured. A step's readings are keyed by the rows of the whole fused
      forward (``total``), not its own: keyed by its own rows, a request verifying 2 rows beside
      three plain ones (5 rows) was read as the price of 2 rows each (8), so speculating looked
      cheap inside a batch and every request then paid for everyone's rows. Its wall time includes
      its batch mates' proposals and sampling, which run in turn (what a request's step costs in
      that batch).

    Raises: ValueError for a ``window`` or ``ref_steps`` that is not an int >= 1, or a
    ``ref_max_age_s`` (seconds) that is not a number >= 0.
    """

    def __init__(self, window: int = 33, *, ref_steps: int = 9, ref_max_age_s: float = 5.0,
                 clock=time.monotonic):
        if not is_int(window) or window < 1:
            raise ValueError(f"StepCost: window={window!r} must be an int >= 1")
        if not is_int(ref_steps) or ref_steps < 1:
            raise ValueError(f"StepCost: ref_steps={ref_steps!r} must be an int >= 1")
        if not isinstance(ref_max_age_s, (int, float)) or not ref_max_age_s >= 0:
            raise ValueError(f"StepCost: ref_max_age_s={ref_max_age_s!r} must be a number of seconds >= 0")
        self.window, self.ref_steps, self.ref_max_age_s = window, ref_steps, float(ref_max_age_s)
        self._clock = clock
        self._plain: deque[tuple[float, float]] = deque(maxlen=window)  # (ms, clock)
        self._rows: dict[int, deque[tuple[float, float | None]]] = {}  # rows > 1 -> (ms, ratio to its time's plain steps)
        # fused steps: (batch size B > 1, rows of the whole forward) -> (ms, ratio to its time's plain steps)
        self._fused: dict[tuple[int, int], deque[tuple[float, float | None]]] = {}
        self._est: dict[int, float] | None = None  # t(n), computed on the first read after an add
        self._fit: dict[int, float] | None = None  # t(n) as priced (monotone_fit of _est), likewise
        self._fused_est: dict[tuple[int, int], float] | None = None  # t_B(r) as measured
        # each deque's median (of ms, or of ratios at a t(1)), by its key and that t(1): recomputed
        # for the key a step was added to, not for all of them at every step (a batch of 4 adds and
        # reads at every member's step)
        self._medians: dict[tuple, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def add(self, rows: int, ms: float, batch: int = 1, total: int | None = None) -> None:
        """One step of ``rows`` (an int >= 1) verified rows took ``ms``, in a fused forward of
        ``batch`` sequences (an int >= 1; 1: alone) that fed ``total`` rows in all, its batch
        mates' included (None: ``batch`` x ``rows``, every mate verifying as many); a non-finite
        reading is ignored, a negative one counts as 0.

        Raises:
            ValueError: ``rows`` or ``batch`` is not an int >= 1, or ``total`` is neither None
                nor an int >= ``rows``.
        """
        if not is_int(rows) or rows < 1:
            raise ValueError(f"StepCost.add: rows={rows!r} must be an int >= 1 (proposals + 1)")
        if not is_int(batch) or batch < 1:
            raise ValueError(f"StepCost.add: batch={batch!r} must be an int >= 1 (sequences in the fused forward)")
        if total is not None and (not is_int(total) or total < rows):
            raise ValueError(f"StepCost.add: total={total!r} must be None or an int >= rows={rows} "
                             f"(the rows of the whole fused forward)")
        ms = float(ms)
        if not math.isfinite(ms):  # a broken clock reading must not poison the estimate
            return
        rows, batch, ms = int(rows), int(batch), max(0.0, ms)
        if batch > 1:
            rows = int(total) if total is not None else batch * rows
        with self._lock:
            now = self._clock()
            self._fused_est = None
            if rows == 1 and batch == 1:
                self._est = self._fit = None
                self._plain.append((ms, now))
                return
            recent = [m for m, t in self._plain if 0 <= now - t <= self.ref_max_age_s][-self.ref_steps:]
            ref = statistics.median(recent) if recent else 0.0
            if batch == 1:
                self._est = self._fit = None
                into = self._rows.setdefault(rows, deque(maxlen=self.window))
                self._medians.pop(("r", rows), None)
            else:
                into = self._fused.setdefault((batch, rows), deque(maxlen=self.window))
                self._medians.pop(("f", batch, rows), None)
            into.append((ms, ms / ref if ref > 0 else None))

    def clear(self) -> None:
        """Forget every reading: the next steps measure t(n) anew. For a change of load the
        paired ratios cannot follow (a trainer that ran beside every measured step and stops:
        beside it a verified row cost more of a plain step than alone)."""
        with self._lock:
            self._plain.clear()
            self._rows.clear()
            self._fused.clear()
            self._medians.clear()
            self._est = self._fit = self._fused_est = None

    def _median(self, key: tuple, d: deque, t1: float) -> float:
        """The median of ``d``'s ratios (a reading with none read against ``t1``), or of its ms
        where ``t1`` is 0; cached by ``key`` and ``t1`` (lock held)."""
        hit = self._medians.get(key)
        if hit is not None and hit[0] == t1:
            return hit[1]
        v = statistics.median(q if q is not None else m / t1 for m, q in d) if t1 > 0 else \
            statistics.median(m for m, _ in d)
        self._medians[key] = (t1, v)
        return v

    def _estimates(self) -> dict[int, float]:
        """t(n) per measured n (lock held)."""
        if self._est is not None:
            return self._est
        if not self._plain:  # no plain step yet: the raw medians
            est = {r: self._median(("r", r), d, 0.0) for r, d in self._rows.items()}
        else:
            t1 = statistics.median(m for m, _ in self._plain)
            est = {1: t1}
            for r, d in self._rows.items():
                if t1 > 0:  # a step with no plain steps of its time is read against t(1) now
                    est[r] = t1 * max(1.0, self._median(("r", r), d, t1))
                else:
                    est[r] = self._median(("r", r), d, 0.0)
        self._est = est
        return est

    def _fitted(self) -> dict[int, float]:
        """t(n) as priced (lock held): :func:`monotone_fit` of :meth:`_estimates`, each t(n)
        weighted by the readings it is the median of."""
        if self._fit is None:
            est = self._estimates()
            counts = {r: len(d) for r, d in self._rows.items()}
            if self._plain:
                counts[1] = len(self._plain)
            self._fit = monotone_fit(est, {r: counts.get(r, 1) for r in est})
        return self._fit

    def _fused_estimates(self) -> dict[tuple[int, int], float]:
        """t_B(r) per measured (B, r), B > 1 (lock held): t(1) x the median paired ratio, or the
        raw median before any plain step."""
        if self._fused_est is not None:
            return self._fused_est
        t1 = self._estimates().get(1, 0.0) if self._plain else 0.0
        est = {}
        for k, d in self._fused.items():
            est[k] = t1 * self._median(("f", *k), d, t1) if t1 > 0 else self._median(("f", *k), d, 0.0)
        self._fused_est = est
        return est

    def ms(self, rows: int) -> float:
        """Estimated ms of a step verifying ``rows`` tokens alone (batch 1; NaN before any step
        is measured): the monotone fit of the measured t(n) (class docstring), an unmeasured n
        read off it (:func:`read_off`)."""
        with self._lock:
            est = self._fitted()
        if rows in est:
            return est[rows]
        return read_off(est, rows)

    def fused_ms(self, batch: int, rows: int) -> float:
        """Estimated ms of one request's step in a fused forward of ``batch`` sequences that
        verify ``rows`` rows each (B x r rows in all): t_B(r) of the class docstring, measured
        where (B, B x r) was, else t(B x r) x k_B, never below t(r). ``batch`` <= 1: :meth:`ms`.
        NaN before any step is measured."""
        if batch <= 1:
            return self.ms(rows)
        alone = self.ms(rows)
        t = self.fused_total_ms(batch, batch * rows)
        return max(t, alone) if alone == alone and t == t else t

    def fused_total_ms(self, batch: int, total: int) -> float:
        """Estimated ms of a step in a fused forward of ``batch`` sequences feeding ``total`` rows
        in all: measured where (B, total) was, else t(total) x k_B (class docstring); NaN before
        any step is measured."""
        with self._lock:
            meas = {n: t for (b, n), t in self._fused_estimates().items() if b == batch}
        if total in meas:
            return meas[total]
        model = {n: self.ms(n) for n in {*meas, total}}
        ks = [meas[n] / model[n] for n in meas if model[n] == model[n] and model[n] > 0]
        k = statistics.median(ks) if ks else 1.0
        t = model[total] * k
        if t != t:  # no batch-1 curve yet: the measured points at this B, if any
            return line_at(sorted(meas.items()), total)
        return t

    def batch_factor(self, batch: int, rows: int, total: int | None = None) -> float:
        """t_B(r) / t(r): how much dearer one request's step of ``rows`` verified rows is in a
        fused forward of ``batch`` sequences than alone (>= 1; 1 for ``batch`` <= 1 and while
        nothing is measured); with ``total``, in a forward of that many rows in all (a step as it
        ran: its mates' rows as they were) instead of ``batch`` x ``rows``. What the goodput
        controller multiplies its batch-1 costs by, and divides a fused step's readings by."""
        if batch <= 1:
            return 1.0
        alone = self.ms(rows)
        fused = self.fused_ms(batch, rows) if total is None else self.fused_total_ms(batch, max(int(total), rows))
        if not (alone == alone and fused == fused) or alone <= 0:
            return 1.0
        return max(1.0, fused / alone)

    def at_batch(self, batch: int) -> "BatchView":
        """This cost as seen by a step in a fused forward of ``batch`` sequences: an object whose
        ``ms(rows)`` is :meth:`fused_ms` (``batch``, rows) (what the n-gram gate weighs its
        proposals against)."""
        return BatchView(self, batch)

    def fused_status(self, batches=(2, 4), rows=(1, 2, 3, 4, 5)) -> dict[int, dict[int, float]]:
        """{B: {r: t_B(r) ms}} for each of ``batches`` and ``rows`` (modelled where unmeasured;
        see :meth:`fused_ms`), and under ``"measured"`` the (B, r) read from fused steps; JSON-ready
        after str keys."""
        with self._lock:
            measured = sorted(self._fused_estimates())
        out: dict = {b: {r: round(v, 4) for r in rows if (v := self.fused_ms(b, r)) == v} for b in batches}
        out["measured"] = [f"{b}x{n // b}" if n % b == 0 else f"{b}:{n}rows" for b, n in measured]
        return out

    def plain(self) -> tuple[float, int]:
        """(t(1) as measured: the median ms of the last ``window`` plain steps, and how many
        there are); (NaN, 0) before any."""
        with self._lock:
            if not self._plain:
                return math.nan, 0
            return self._estimates()[1], len(self._plain)

    def status(self) -> dict[int, float]:
        """t(n) in ms per verified row count measured so far, as measured (t(1) x the paired
        median ratio for n > 1; see the class), before the monotone fit :meth:`ms` prices on."""
        with self._lock:
            return {k: round(v, 4) for k, v in sorted(self._estimates().items())}

    def ceiling(self, gamma_max: int = 8) -> dict | None:
        """What this engine lets any proposer buy: the speedup over plain decoding at γ if every
        proposed token were accepted and proposing cost nothing, (γ + 1) t(1) / t(γ + 1), for
        each measured γ <= ``gamma_max`` (Leviathan et al. 2023, Theorem 3.8's speedup with α = 1
        and c = 0, a verification's measured cost in place of one step), on t(n) as measured
        (:meth:`status`, not the fit :meth:`ms` prices on: a report keeps this figure beside the
        costs it was read from). A proposer with real α and cost gets less; where the best is near
        1, no proposer can pay here.

        Returns: {"by_gamma": {γ: speedup}, "gamma": best γ, "speedup": best} or None while
        plain steps or proposals are unmeasured.

        Raises: ValueError: ``gamma_max`` is not an int >= 1."""
        with self._lock:
            med = self._estimates()
        return speculation_ceiling(med, gamma_max)


def read_off(measured: dict[int, float], n: int) -> float:
    """The cost of ``n`` rows read off ``measured`` ({rows: ms}) where ``n`` is unmeasured (see
    :class:`StepCost`): between the nearest measured row counts below and above ``n``, the
    straight line between them; above the largest, the least-squares line (slope >= 0,
    :func:`decoder.metrics.line_at`) through the measured counts of 2 rows or more where there are
    two, else the largest count's own cost; below the smallest, its cost. NaN with nothing
    measured."""
    if n in measured:
        return measured[n]
    if not measured:
        return math.nan
    below = [r for r in measured if r < n]
    above = [r for r in measured if r > n]
    if below and above:
        lo, hi = max(below), min(above)
        return measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo)
    if above:
        return measured[min(above)]
    multi = sorted((r, t) for r, t in measured.items() if r >= 2)
    if len(multi) >= 2:
        return max(line_at(multi, n), measured[max(measured)])
    return measured[max(measured)]


def isotonic_blocks(values, weights=None) -> list[tuple[int, int, float]]:
    """The weighted least-squares fit of ``values`` (a sequence of finite numbers) that never
    decreases along the sequence, by pool adjacent violators: each value starts a block; while a
    block's value is below the one before it, the two merge at their weighted mean.

    Args:
        values: the readings, in order (e.g. ms by increasing rows).
        weights: one number > 0 per value (e.g. its sample count); None: all 1.

    Returns: the fit as blocks (start, stop, value): ``values[start:stop]`` all fit at ``value``;
    consecutive, covering every index, values non-decreasing ([] for no values).

    Raises: ValueError: a value is not finite, a weight not finite and > 0, or ``weights`` is not
    as long as ``values``."""
    values = [float(v) for v in values]
    weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    if len(weights) != len(values):
        raise ValueError(f"isotonic_blocks: {len(weights)} weights for {len(values)} values")
    if not all(math.isfinite(v) for v in values) or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"isotonic_blocks: values must be finite and weights finite and > 0 "
                         f"(values {values!r}, weights {weights!r})")
    blocks: list[list[float]] = []  # [start, stop, weighted mean, total weight]
    for i, (v, w) in enumerate(zip(values, weights)):
        blocks.append([i, i + 1, v, w])
        while len(blocks) > 1 and blocks[-2][2] > blocks[-1][2]:
            _, stop, m2, w2 = blocks.pop()
            b = blocks[-1]
            b[1], b[2], b[3] = stop, (b[2] * b[3] + m2 * w2) / (b[3] + w2), b[3] + w2
    return [(int(a), int(b), m) for a, b, m, _ in blocks]


def monotone_fit(ms_by_rows: dict, weights: dict | None = None) -> dict[int, float]:
    """``ms_by_rows`` ({rows: ms}, int keys) as priced: the weighted least-squares fit that never
    falls with more rows (:func:`isotonic_blocks` over increasing rows), ``weights`` ({rows: a
    number > 0}, e.g. readings per row count; None, or a row count missing: 1). A run of readings
    that falls with more rows is priced at its weighted mean; readings that rise are kept.

    Raises: ValueError: as :func:`isotonic_blocks` (a non-finite ms or a weight <= 0)."""
    keys = sorted(ms_by_rows)
    w = None if weights is None else [weights.get(k, 1) for k in keys]
    out: dict[int, float] = {}
    for a, b, m in isotonic_blocks([ms_by_rows[k] for k in keys], w):
        out.update((k, m) for k in keys[a:b])
    return out


class BatchView:
    """:meth:`StepCost.at_batch`: ``ms(rows)`` = ``cost.fused_ms(batch, rows)``."""

    __slots__ = ("cost", "batch")

    def __init__(self, cost: StepCost, batch: int):
        self.cost, self.batch = cost, max(1, int(batch))

    def ms(self, rows: int) -> float:
        return self.cost.fused_ms(self.batch, rows)


def speculation_ceiling(ms_by_rows: dict[int, float], gamma_max: int = 8) -> dict | None:
    """(γ + 1) t(1) / t(γ + 1) for each γ <= ``gamma_max`` whose t(γ + 1) is in ``ms_by_rows``
    (ms, or any unit, by verified rows; see :meth:`StepCost.ceiling`), and the best of them.

    A t(γ + 1) below t(1) (noise, or a broken clock's near-zero reading) counts as t(1): a
    verification is never cheaper than a plain step, so no γ reads above γ + 1.

    Returns: {"by_gamma": {γ: speedup}, "gamma": best γ, "speedup": best} (rounded to 3 places),
    or None without t(1) > 0 and one more row count.

    Raises: ValueError: ``gamma_max`` is not an int >= 1."""
    if not is_int(gamma_max) or gamma_max < 1:
        raise ValueError(f"StepCost.ceiling: gamma_max={gamma_max!r} must be an int >= 1")
    med = {int(r): float(t) for r, t in ms_by_rows.items()}
    if med.get(1, 0) <= 0:
        return None
    by = {r - 1: (r * med[1] / max(med[r], med[1])) for r in med if 1 < r <= gamma_max + 1 and med[r] > 0}
    if not by:
        return None
    g = max(by, key=by.get)
    return {"by_gamma": {k: round(v, 3) for k, v in sorted(by.items())}, "gamma": g, "speedup": round(by[g], 3)}
