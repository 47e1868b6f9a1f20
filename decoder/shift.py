"""Acceptance-shift detection per workload, and workload keys for untagged requests.

The signal is the per-request α (mean over the request's proposed positions of
Σ_x min(p(x), q(x)) = 1 - TV(p, q); see :class:`decoder.metrics.AcceptanceCounts.alpha`). When
the traffic of a workload changes (new topic, new language, new prompt template) the frozen
draft's α on it drops; the Page-Hinkley test flags that drop online, one request at a time.

Page-Hinkley, one-sided for a *decrease* of the mean (Page 1954; Hinkley 1971; the form used
in concept-drift work, e.g. Gama et al., "A survey on concept drift adaptation", 2014):

    x̄_t = (1/t) Σ_{i<=t} x_i                       running mean
    m_t = Σ_{i<=t} (x_i - x̄_i + δ)                  cumulative deviation (drifts up while stationary)
    M_t = max_{i<=t} m_i
    alarm when t >= min_samples and M_t - m_t > λ

δ is the size of drop tolerated per sample (a stationary sequence accumulates +δ per sample, so
noise alone rarely pulls m_t λ below its maximum); λ is the evidence needed. A sustained drop
of d > δ is flagged after about λ / (d - δ) requests. After an alarm the test restarts, so the
new level becomes the reference.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from store.jsonsafe import nan_none


@dataclass(frozen=True)
class ShiftConfig:
    """Page-Hinkley parameters (per-request α lies in [0, 1]).

    delta: drop per request tolerated as noise (δ); drops smaller than this are never flagged.
    lam: alarm threshold λ on M_t - m_t (units of α x requests). With δ = 0.05, λ = 1.0 a drop
        of 0.3 is flagged after about 4 requests, a drop of 0.1 after about 20.
    min_samples: no alarm before this many requests of the key (the reference mean must settle).
    """

    delta: float = 0.05
    lam: float = 1.0
    min_samples: int = 10

    def __post_init__(self):
        if self.delta < 0 or self.lam <= 0 or self.min_samples < 1:
            raise ValueError(
                f"ShiftConfig(delta={self.delta}, lam={self.lam}, min_samples={self.min_samples}): "
                f"need delta >= 0, lam > 0, min_samples >= 1"
            )


class PageHinkley:
    """One Page-Hinkley test for a drop in the mean of a stream (see the module docstring)."""

    def __init__(self, config: ShiftConfig | None = None):
        self.config = config or ShiftConfig()
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.mean = 0.0  # x̄_t
        self.m = 0.0  # m_t
        self.m_max = 0.0  # M_t

    @property
    def statistic(self) -> float:
        """M_t - m_t, compared with λ."""
        return self.m_max - self.m

    def update(self, x: float) -> bool:
        """Add one observation; True when a drop is flagged (the test then restarts)."""
        if x != x:  # NaN: a request without proposals carries no α
            return False
        self.n += 1
        self.mean += (x - self.mean) / self.n
        self.m += x - self.mean + self.config.delta
        self.m_max = max(self.m_max, self.m)
        if self.n >= self.config.min_samples and self.statistic > self.config.lam:
            return True
        return False


@dataclass(frozen=True)
class ShiftAlarm:
    """A flagged drop: the key, the reference mean before it, and the recent mean."""

    key: Hashable
    ts: float
    samples: int  # observations of the key since the last restart
    reference_alpha: float  # running mean x̄ when flagged (includes the drop's first samples)
    recent_alpha: float  # mean of the last ``recent`` observations
    statistic: float  # M_t - m_t
    proposer: str | None = None  # whose acceptance dropped, when the caller keys tests by proposer


@dataclass
class ShiftDetector:
    """Page-Hinkley per key (e.g. (workload, sampling bucket)); keeps the alarms it raised."""

    config: ShiftConfig = field(default_factory=ShiftConfig)
    recent: int = 5  # observations averaged into ShiftAlarm.recent_alpha
    clock: Callable[[], float] = time.time
    alarms: list[ShiftAlarm] = field(default_factory=list)

    def __post_init__(self):
        self._tests: dict[Hashable, PageHinkley] = {}
        self._last: dict[Hashable, list[float]] = {}

    def update(self, key: Hashable, alpha: float) -> ShiftAlarm | None:
        """Feed one request's α for ``key``; returns the alarm when this observation flags a drop."""
        if alpha != alpha:
            return None
        test = self._tests.setdefault(key, PageHinkley(self.config))
        last = self._last.setdefault(key, [])
        last.append(alpha)
        del last[: -self.recent]
        if not test.update(alpha):
            return None
        alarm = ShiftAlarm(key, self.clock(), test.n, test.mean, sum(last) / len(last), test.statistic)
        self.alarms.append(alarm)
        test.reset()
        last.clear()
        return alarm

    def state(self) -> dict:
        """Per key: observations since restart, running mean and the statistic, JSON-ready."""
        return {
            (key_str(*k) if isinstance(k, tuple) else key_str(k)): {"samples": t.n, "mean_alpha": round(t.mean, 4), "statistic": round(t.statistic, 4)}
            for k, t in self._tests.items()
        }


def key_str(*parts: Hashable) -> str:
    """A key as shown everywhere: its parts joined by ``@``, e.g. ``"{workload}@{bucket}"``."""
    return "@".join(map(str, parts))


# ---- workload keys for untagged requests ---------------------------------------------------------

_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import |#include|return\b|for .* in .*:|if .*:\s*$)", re.M)
_INDENTED = re.compile(r"^(    |\t)\S", re.M)
_ARITH = re.compile(r"\d\s*[-+*/=^%]\s*\d")
_MATH_WORDS = re.compile(r"\b(how many|how much|calculate|compute|solve|sum of|product of|percent|total)\b", re.I)
BRACKETS = set("()[]{}<>;=")


def infer_workload(text: str) -> str:
    """A workload key from the prompt alone: ``"code"``, ``"math"`` or ``"prose"``.

    Used when a request carries no workload tag. Rules, first match wins:

    1. ``code``: a line starting like Python/C source (``def ``, ``class ``, ``import ``,
       ``from x import ``, ``#include``, ``return``, a ``for ... in ...:`` or ``if ...:`` line),
       or >= 2 lines indented by 4 spaces or a tab, or brackets/semicolons/``=`` making up
       >= 8 % of the non-space characters (with at least 4 of them).
    2. ``math``: at least one digit and either a ``?``, an arithmetic expression (``3 + 4``,
       ``x=2``) or a quantity word (how many, how much, calculate, solve, total, percent, ...).
    3. ``prose``: everything else.
    """
    if _CODE_LINE.search(text) or len(_INDENTED.findall(text)) >= 2:
        return "code"
    chars = [c for c in text if not c.isspace()]
    n_br = sum(c in BRACKETS for c in chars)
    if chars and n_br >= 4 and n_br / len(chars) >= 0.08:
        return "code"
    if any(c.isdigit() for c in text) and ("?" in text or _ARITH.search(text) or _MATH_WORDS.search(text)):
        return "math"
    return "prose"


def expected_drop_requests(drop: float, config: ShiftConfig) -> float:
    """About how many requests a sustained drop of ``drop`` in α takes to be flagged: λ / (d - δ)
    (inf when d <= δ). Ignores the running mean's lag, so it slightly underestimates."""
    return config.lam / (drop - config.delta) if drop > config.delta else math.inf


def recovery_stats(timeline: list[dict], shifts: list[dict], window: int = 5, level: float = 0.9) -> list[dict]:
    """Requests and seconds from each workload shift until acceptance is back (pure).

    For each shift after the first: the pre-shift level is the mean greedy α of the last
    ``window`` speculating requests (α not None) before the shift; the shift has recovered at the
    first request after it where the mean α of the last ``window`` speculating requests of the
    new phase is >= ``level`` x that pre-shift level. ``requests`` counts every request served
    since the shift (plain ones too), ``seconds`` the time since it. ``None`` when the phase
    ended first, or when there was no pre-shift level to recover to.
    """
    out = []
    for i, sh in enumerate(shifts[1:], 1):
        start = sh["request"]
        end = shifts[i + 1]["request"] if i + 1 < len(shifts) else len(timeline)
        before = [r["alpha"] for r in timeline[:start] if r.get("alpha") is not None][-window:]
        row: dict[str, Any] = {"workload": sh["workload"], "from": shifts[i - 1]["workload"],
                               "pre_shift_alpha": nan_none(sum(before) / len(before), 4) if before else None,
                               "requests": None, "seconds": None, "recovered_alpha": None}
        if before and row["pre_shift_alpha"] is not None:
            target = level * row["pre_shift_alpha"]
            seen: list[float] = []
            for j in range(start, end):
                a = timeline[j].get("alpha")
                if a is None:
                    continue
                seen.append(a)
                if len(seen) >= window and sum(seen[-window:]) / window >= target:
                    row.update(requests=j - start + 1, seconds=round(timeline[j]["t"] - sh["t"], 1),
                               recovered_alpha=nan_none(sum(seen[-window:]) / window, 4))
                    break
        out.append(row)
    return out
