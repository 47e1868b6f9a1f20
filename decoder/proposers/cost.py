"""The measured cost of a decoding step by the rows it verifies (:class:`StepCost`), shared by the
n-gram gate and the goodput controller's ceiling (:func:`speculation_ceiling`)."""

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
    - an unmeasured n is read off a least-squares line through the measured ones (slope clamped
      at >= 0; flat through a single point, so before any proposal is measured a proposal looks
      as cheap as a plain step, and the first ones measure what it really costs).

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
        self._est: dict[int, float] | None = None  # t(n), computed on the first read after an add
        self._lock = threading.Lock()

    def add(self, rows: int, ms: float) -> None:
        """One step of ``rows`` (an int >= 1) verified rows took ``ms``; a non-finite reading is
        ignored, a negative one counts as 0.

        Raises:
            ValueError: ``rows`` is not an int >= 1.
        """
        if not is_int(rows) or rows < 1:
            raise ValueError(f"StepCost.add: rows={rows!r} must be an int >= 1 (proposals + 1)")
        ms = float(ms)
        if not math.isfinite(ms):  # a broken clock reading must not poison the estimate
            return
        rows, ms = int(rows), max(0.0, ms)
        with self._lock:
            now = self._clock()
            self._est = None
            if rows == 1:
                self._plain.append((ms, now))
                return
            recent = [m for m, t in self._plain if 0 <= now - t <= self.ref_max_age_s][-self.ref_steps:]
            ref = statistics.median(recent) if recent else 0.0
            self._rows.setdefault(rows, deque(maxlen=self.window)).append((ms, ms / ref if ref > 0 else None))

    def _estimates(self) -> dict[int, float]:
        """t(n) per measured n (lock held)."""
        if self._est is not None:
            return self._est
        if not self._plain:  # no plain step yet: the raw medians
            est = {r: statistics.median(m for m, _ in d) for r, d in self._rows.items()}
        else:
            t1 = statistics.median(m for m, _ in self._plain)
            est = {1: t1}
            for r, d in self._rows.items():
                if t1 > 0:  # a step with no plain steps of its time is read against t(1) now
                    est[r] = t1 * max(1.0, statistics.median(q if q is not None else m / t1 for m, q in d))
                else:
                    est[r] = statistics.median(m for m, _ in d)
        self._est = est
        return est

    def ms(self, rows: int) -> float:
        """Estimated ms of a step verifying ``rows`` tokens (NaN before any step is measured)."""
        with self._lock:
            est = self._estimates()
        if rows in est:
            return est[rows]
        return line_at(list(est.items()), rows)

    def status(self) -> dict[int, float]:
        """t(n) in ms per verified row count measured so far (t(1) x the paired median ratio for
        n > 1; see the class)."""
        with self._lock:
            return {k: round(v, 4) for k, v in sorted(self._estimates().items())}

    def ceiling(self, gamma_max: int = 8) -> dict | None:
        """What this engine lets any proposer buy: the speedup over plain decoding at γ if every
        proposed token were accepted and proposing cost nothing, (γ + 1) t(1) / t(γ + 1), for
        each measured γ <= ``gamma_max`` (Leviathan et al. 2023, Theorem 3.8's speedup with α = 1
        and c = 0, a verification's measured cost in place of one step). A proposer with real α
        and cost gets less; where the best is near 1, no proposer can pay here.

        Returns: {"by_gamma": {γ: speedup}, "gamma": best γ, "speedup": best} or None while
        plain steps or proposals are unmeasured.

        Raises: ValueError: ``gamma_max`` is not an int >= 1."""
        with self._lock:
            med = self._estimates()
        return speculation_ceiling(med, gamma_max)


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
