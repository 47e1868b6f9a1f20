"""The served weight format of a built-in target, chosen by measurement (``models.format``, issue 34).

On a CPU what a verification of n rows costs depends on the weight format and the kernels the
build has: upstream llama.cpp runs the packaged Q4_1 file's rows on x86 through a one-row kernel
each (n rows cost nearly n plain steps), its batched kernels make rows cheaper on F16 / Q8_0
weights, and draftd's patched build tiles Q4_1 and Q8_0 (bench/RESULTS.md, "Weight formats and
the cost of a verification", "Eighteenth session"). So at the
first start on a host, :func:`measure_formats` times the candidate formats of the target's weights
(the packaged file, and the packaged file requantised to F16, BF16 and Q8_0 by llama.cpp,
:func:`decoder.models.gguf_export.requantised_gguf`, written once) for a plain step and a
verification of n = 2..8 rows, and caches the measurement per (packaged file, CPU model and flags,
threads) under ``cache_root() / "formats"``. :func:`choose_format` then serves the format with the
best expected goodput for the proposers' expected acceptance, and only where that beats plain
decoding of the packaged file (:func:`expected_tokens`, :func:`speculative_goodput`).

``models.format``: ``"auto"`` (measure and choose), ``"packaged"`` (the file the package ships) or
a llama.cpp weight format (``"F16"``, ``"Q8_0"``, ...: pinned). A requantised copy is a slightly
different model (F16 of the Q4_1 weights: KL 0.004 nats from the packaged file, bench/RESULTS.md);
the decoder is lossless against the format it serves, so greedy output equals plain decoding of
the served file. The draft (``layers:<spec>``) stays derived from the packaged file, as the
trainer's weights are, and records carry the served format (``VerifiedSample.target_format``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from decoder.hostload import cpu_jiffies, others_share

CANDIDATES = ("packaged", "F16", "BF16", "Q8_0")
"""What ``auto`` measures: the packaged file and the three formats whose verification rows are
cheap on llama.cpp's CPU kernels (bench/RESULTS.md)."""

PACKAGED = "packaged"
AUTO = "auto"
ROWS = tuple(range(1, 9))  # a plain step (n = 1) and verifications of γ = 1..7
MEASURE_VERSION = 3  # in the cache file: bumped when the measurement changes (2: per-repeat samples; 3: SHAPE_WARMUP)


PRIOR_MEANS = ", the share of its proposed tokens assumed accepted before any traffic measured it"
"""What "its prior α" means, said after its first figure in a served format's reason (:func:`prior_alphas`)."""


def prior_alphas() -> dict[str, float]:
    """Expected per-token acceptance α per proposer before any traffic (Leviathan et al. 2023's α),
    as each proposer's spec declares it (``ProposerSpec.prior_alpha``, its source beside the SPEC):
    the n-gram proposer 0.66 (the mean accepted share of proposed tokens at ``ngram_min_n = 2`` on
    never-served prose / code / math: 0.84 / 0.67 / 0.48, bench/RESULTS.md, "Consequence for the
    n-gram proposer"; it proposes only on a match, and steps without one, plain steps of the served
    format, are not priced), the derived draft 0.20 (the quick demos' decoded greedy α)."""
    from decoder.proposers.registry import SPECS

    return {name: s.prior_alpha for name, s in SPECS.items() if s.prior_alpha is not None}


def _cost_per_token(name: str, draft_ms: float | None) -> float | None:
    """ms a proposer spends per proposed token: 0 for a model-free one, the derived draft's step
    for the adapter-versioned draft model, None (not priced) for anything else."""
    from decoder.proposers.registry import spec

    s = spec(name)
    if s.model_free:
        return 0.0
    return draft_ms if s.versioned_by == "adapter" and not s.needs_features else None

DRAFT = "__draft__"  # the derived draft's engine among the measured ones
NOISE_MAX = 0.3
"""A format whose typical repeat (median) is more than this much slower than its fastest one, at
any row count, was measured while something moved the step times (another job, most often): every
format still in the running is timed again (:func:`_contest`, up to :data:`MAX_REPEATS` within the time
budget), the measurement is not cached, so the next start measures again, and it is judged on its ratios paired
per repeat only (without per-repeat samples it is left out, and the packaged file serves if it is
the packaged file's own measurement); one with fewer than :data:`MIN_REPEATS` repeats (the time
budget ran out: its noise cannot be told) is left out. On the 2-core AMX Xeon of bench/RESULTS.md, shared with other
jobs: 0.08-0.26 at 1 thread; at 2 threads steps of 0.1-3 s and one repeat in the 20 s budget."""

MIN_REPEATS = 3

SHAPE_WARMUP = 2
"""Steps run per timed step (:func:`_time_rows`): the timed one and, before it, an untimed step of
the same rows on the same engine. llama.cpp rebuilds its graph when a context's batch shape
changes, and a one-row step right after an 8-row one (the previous repeat's, or another file's)
costs more, by more on some files than others (bench/RESULTS.md, fifteenth session): a plain step
in serving follows a plain step."""

BUDGET_FACTOR = 2.0
BUDGET_MIN_S = 20.0
BUDGET_MAX_S = 180.0
"""The measurement's time budget on a host (:func:`scaled_budget`): ``BUDGET_FACTOR`` times its
expected time, predicted from a plain step measured on this CPU before the repeats, at least
``BUDGET_MIN_S`` and at most ``BUDGET_MAX_S`` seconds. A fixed 20 s ran out on an idle AVX2-only
2-core EPYC (load 1.1, the walkthrough at 73f5a31) where a plain step is slower than on the AMX
Xeon it was sized on; the cap keeps a host where a step takes seconds from measuring for minutes."""

MARGIN = 0.05
"""A requantised format serves only if its expected goodput is at least this much (relative)
above the packaged file's plain step: the measurement is a few hundred ms on a possibly shared
host, and the copy is not bit for bit the packaged model."""

CONFIDENCE = 0.95
MAX_REPEATS = 20
"""A requantised format also serves only if the lower bound of the ``CONFIDENCE`` interval of its
goodput over the packaged file's plain decoding, paired per repeat (:func:`paired_ratio`), is at
least 1; while the interval leaves that open (it reaches past ``1 + MARGIN`` but the format has
not yet won) the two files are timed again, up to ``MAX_REPEATS`` repeats within the time budget.
Medians over five repeats alone flipped between fresh starts (docs/walkthroughs.md)."""


@dataclass
class FormatCost:
    """One file's measured step costs (ms, median over repeats) by rows per ``llama_decode``."""

    format: str  # "packaged" or a llama.cpp format name
    file: str  # the GGUF's file name
    ms: dict[int, float] = field(default_factory=dict)  # n rows -> median ms (n = 1: a plain step)
    rows_identical: bool | None = None  # an n-row verification's logits == the same rows one at a time
    row_max_abs_diff: float | None = None  # max |logit| difference between the two
    error: str | None = None  # why it was not measured (the quantiser failed, the file did not load)
    noise: float | None = None  # max over n of median / fastest - 1: how much host load moved the repeats
    repeats: int | None = None  # timed repeats per row count (fewer than asked where max_seconds ran out)
    samples: dict[int, list[float]] = field(default_factory=dict)  # n rows -> ms of each repeat, in repeat order


@dataclass
class FormatMeasurement:
    """:func:`measure_formats`' result, cached as JSON."""

    key: dict[str, Any]  # what the cache is keyed by: packaged file digest, CPU model and flags, threads, draft
    formats: dict[str, FormatCost]
    draft_ms: float | None = None  # the derived draft's plain step (ms), its cost per proposed token
    reps: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0  # the measurement's wall time
    measured_at: float = 0.0  # epoch seconds
    cache_file: str | None = None
    from_cache: bool = False
    budget_s: float | None = None  # the time budget of its timed steps (s): scaled_budget's, or max_seconds as given
    busy: str | None = None  # why it ran beside other work (their share of the CPUs), so no format is judged on it

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["formats"] = {k: dict(v, ms={str(n): t for n, t in v["ms"].items()},
                                samples={str(n): t for n, t in v.get("samples", {}).items()})
                        for k, v in d["formats"].items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "FormatMeasurement":
        fm = {k: FormatCost(**dict(v, ms={int(n): float(t) for n, t in v["ms"].items()},
                                   samples={int(n): [float(x) for x in t] for n, t in v.get("samples", {}).items()}))
              for k, v in d["formats"].items()}
        return cls(**dict(d, formats=fm))


@dataclass
class FormatChoice:
    """The format a target is served in, the file, and why (shown by ``daemonctl status`` and the demo)."""

    format: str  # "packaged" or a llama.cpp format name
    path: Path
    reason: str
    setting: str = AUTO  # models.format as given (canonical)
    costs: list[dict[str, Any]] = field(default_factory=list)  # per format: ms by rows, best expected goodput
    measurement: dict[str, Any] | None = None  # the cache key, file, reps, wall time
    paired: dict[str, Any] | None = None  # the best other format over the packaged plain step, per repeat (paired_ratio)
    rows_identical: bool | None = None  # a pinned format's row check (check_pinned_rows); None: not checked
    row_max_abs_diff: float | None = None

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the format, file, setting, reason, the cost table, the paired ratio and a pinned
        format's row check."""
        return {"format": self.format, "file": self.path.name, "setting": self.setting, "reason": self.reason,
                "costs": self.costs, "measurement": self.measurement, "paired": self.paired,
                "rows_identical": self.rows_identical, "row_max_abs_diff": self.row_max_abs_diff}


# ---- the setting ------------------------------------------------------------------------------------

NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S")
"""llama.cpp file types its quantiser refuses without an importance matrix ("this quantization
requires an imatrix!"), which draftd does not compute: a pinned ``models.format`` naming one is
refused by :func:`format_setting` instead of failing at the first start's requantisation."""
NOT_WRITTEN = ("NVFP4",)
"""File types the bundled llama-cpp-python names but whose quantiser refuses to write them
("invalid output file type")."""


def format_setting(value: str) -> str:
    """``models.format`` in canonical form: ``"auto"``, ``"packaged"`` or a llama.cpp weight format
    as llama.cpp spells it (``"f16"`` -> ``"F16"``).

    Raises:
        ValueError: not one of those, or one llama.cpp cannot write here (:data:`NEEDS_IMATRIX`,
            :data:`NOT_WRITTEN`); the message names the value and the valid ones (the llama.cpp
            formats are listed only when llama-cpp-python is installed).
    """
    v = str(value).strip()
    if v.lower() in (AUTO, PACKAGED):
        return v.lower()
    try:
        from decoder.models.gguf_export import weight_formats

        known = list(weight_formats())
    except Exception as e:  # noqa: BLE001 - no llama-cpp-python: a pinned format cannot be served
        raise ValueError(f"models.format {value!r}: a weight format needs llama-cpp-python ({e}); use 'auto' or "
                         f"'packaged'") from e
    usable = [f for f in known if f not in NEEDS_IMATRIX + NOT_WRITTEN]
    if v.upper() in NEEDS_IMATRIX + NOT_WRITTEN:
        why = ("llama.cpp quantises it only with an importance matrix (imatrix), which draftd does not compute"
               if v.upper() in NEEDS_IMATRIX else "the bundled llama.cpp's quantiser does not write that file type")
        raise ValueError(f"models.format {value!r}: {why}; use 'auto' (measured), 'packaged' or one of llama.cpp's "
                         f"formats it can write: {', '.join(usable)}")
    if v.upper() not in known:
        raise ValueError(f"models.format {value!r} is not a weight format: use 'auto' (measured), 'packaged' or one "
                         f"of llama.cpp's: {', '.join(usable)}")
    return v.upper()


# ---- the cost model ---------------------------------------------------------------------------------


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted by one verification of γ proposals with per-token acceptance α:
    (1 - α^(γ+1)) / (1 - α) (Leviathan et al. 2023, eq. 1); γ + 1 at α = 1, 1 at γ = 0."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speculative_goodput(ms: dict[int, float], alpha: float, c_ms: float = 0.0) -> tuple[float, int]:
    """Best expected goodput (tokens per ms) and its γ on a file whose n-row step costs ``ms[n]`` ms:
    max over γ of :func:`expected_tokens` / (``ms[γ + 1]`` + γ ``c_ms``), where ``c_ms`` is the
    proposer's ms per proposed token (0 for the model-free n-gram proposer, the draft's step for a
    model proposer); γ = 0 (plain decoding of the file, 1 / ``ms[1]``) when nothing beats it."""
    best = (1.0 / ms[1], 0)
    for n in sorted(ms):
        if n < 2:
            continue
        g = n - 1
        gp = expected_tokens(alpha, g) / (ms[n] + g * c_ms)
        if gp > best[0]:
            best = (gp, g)
    return best


def paired_ratio(measurement: FormatMeasurement, name: str, proposer: str | None, gamma: int, alpha: float | None,
                 confidence: float = CONFIDENCE) -> dict[str, Any] | None:
    """``name``'s expected goodput over the packaged file's plain decoding, paired per repeat.

    Repeat i timed every file back to back (:func:`_time_rows`), so the ratio
    r_i = E / (t_i + γ c) x p_i, where p_i is the packaged file's plain step (ms), t_i the
    format's (γ + 1)-row step (the largest of its 1..γ+1-row steps in that repeat, as costs never
    fall with rows), c the proposer's ms per proposed token and E = :func:`expected_tokens` (α, γ)
    (1 and γ = 0 for plain decoding), sees a change of host load on both files alike. Returned:
    the geometric mean of r_i and its two-sided ``confidence`` interval, Student's t on log r_i
    (``ratio``, ``low``, ``high``), the ``pairs`` k and the ``format``; None below
    :data:`MIN_REPEATS` pairs (no per-repeat samples: a measurement cached before them)."""
    from decoder.control import t_quantile

    pk = measurement.formats[PACKAGED].samples.get(1, [])
    per_n = [measurement.formats[name].samples.get(n, []) for n in range(1, gamma + 2)]
    k = min([len(pk)] + [len(v) for v in per_n])
    if k < MIN_REPEATS:
        return None
    c = (_cost_per_token(proposer, measurement.draft_ms) or 0.0) if proposer else 0.0
    e = expected_tokens(alpha, gamma) if proposer and alpha is not None else 1.0
    logs = [math.log(e * pk[i] / (max(v[i] for v in per_n) + gamma * c)) for i in range(k)]
    mean = sum(logs) / k
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (k - 1))
    h = t_quantile(0.5 + confidence / 2, k - 1) * sd / math.sqrt(k)
    return {"format": name, "ratio": round(math.exp(mean), 4), "low": round(math.exp(mean - h), 4),
            "high": round(math.exp(mean + h), 4), "pairs": k, "confidence": confidence}


def _untrusted(cost: FormatCost, reps: int | None = None) -> str | None:
    """Why ``cost`` cannot be judged at all, or None: too few repeats (:func:`_noisy`), or noisy
    without per-repeat samples to pair (a measurement cached before them). A noisy measurement with
    samples is judged on its paired ratio (:func:`paired_ratio`), which sees a move of the host's load
    on both files alike, and is measured again at the next start (not cached)."""
    why = _noisy(cost, reps)
    paired = len(cost.samples.get(1, ())) >= MIN_REPEATS and (cost.repeats or 0) >= MIN_REPEATS
    return None if why and paired and (cost.noise or 0.0) > NOISE_MAX else why


def _noisy(cost: FormatCost, reps: int | None = None) -> str | None:
    """Why ``cost`` cannot be trusted (host load), or None: noise above :data:`NOISE_MAX`, or fewer
    than :data:`MIN_REPEATS` repeats (fewer than asked for, when ``reps`` is given)."""
    if cost.noise is not None and cost.noise > NOISE_MAX:
        return (f"the measurement was noisy: a typical repeat took {1 + cost.noise:.2f}x the fastest, the step times "
                f"moved during it")
    if cost.repeats is not None and cost.repeats < min(MIN_REPEATS, reps or MIN_REPEATS):
        return f"only {cost.repeats} repeat(s) fit in the measurement's time budget: too few to tell its noise"
    return None


def choose_format(measurement: FormatMeasurement, alphas: dict[str, float] | None = None,
                  proposers: Sequence[str] | None = None, margin: float = MARGIN,
                  paths: dict[str, Path] | None = None) -> FormatChoice:
    """The format to serve, from measured costs (no timing here).

    Per format, its best expected goodput over ``proposers`` (default: every proposer with a prior
    α; each with its α from ``alphas``, default :func:`prior_alphas`; a proposer without an α is
    left out, the draft model also without a measured ``draft_ms``) and γ (:func:`speculative_goodput`), plain decoding of the file
    included. Left out: a format that failed to measure, or whose n-row verification's logits
    differ from its one-row steps (greedy speculation could then leave plain decoding's output:
    BF16 on an AMX Xeon, 0.15), or whose repeats were noisy (``noise`` above :data:`NOISE_MAX`)
    with no per-repeat samples to pair (:func:`_untrusted`; with them it is judged on its paired ratio).
    The best format serves if it is the packaged file, or if its goodput is above the packaged
    file's plain step by ``margin`` (relative); else the packaged file serves, as it does when the
    packaged file's own measurement cannot be trusted (:func:`_untrusted`) or the measurement ran beside other work (``busy``). Costs are taken non-decreasing in n (a verification
    of n rows costs at least one of fewer rows; a lower median is noise). ``paths``: each format's
    file (default: the measured file names, no directory).
    """
    alphas = prior_alphas() if alphas is None else alphas
    proposers = tuple(alphas) if proposers is None else tuple(proposers)
    fm = measurement.formats
    pk = fm.get(PACKAGED)
    if pk is None:
        raise ValueError("the measurement has no plain step of the packaged file")
    files = paths or {}
    meas = {k: getattr(measurement, k) for k in ("key", "draft_ms", "reps", "cached_tokens", "seconds", "budget_s",
                                                 "measured_at", "cache_file", "from_cache", "busy")}
    if measurement.busy:
        return FormatChoice(PACKAGED, Path(files.get(PACKAGED) or pk.file),
                            f"{measurement.busy}, so no format is judged on it; measured again at the next start "
                            f"(models.format=packaged, or a format named, e.g. Q8_0, serves without measuring)",
                            AUTO, [asdict(c) for c in fm.values()], meas)
    if pk.error or 1 not in pk.ms:
        return FormatChoice(PACKAGED, Path(files.get(PACKAGED) or pk.file),
                            f"the packaged file's measurement failed ({pk.error}), so no format is judged against it; "
                            f"measured again at the next start", AUTO, [asdict(pk)], meas)
    rows, best = [], None
    for name, cost in fm.items():
        row, gp, prop, gamma = _judge_format(name, cost, measurement, alphas, proposers)
        if row["eligible"] and (best is None or gp > best[1]):
            best = (name, gp, prop, gamma)
        rows.append(row)
    name, gp, prop, gamma = best
    paired = None
    if name != PACKAGED:
        paired = paired_ratio(measurement, name, prop, gamma, alphas.get(prop) if prop else None)
        if paired is not None:  # more repeats could still let it serve (_time_rows' ``more``)
            paired["unsure"] = not _paired_wins(paired, margin) and paired["high"] >= 1.0 + margin
    chosen, reason = _verdict(measurement, alphas, rows, best, paired, margin)
    path = Path(files.get(chosen) or fm[chosen].file)
    return FormatChoice(chosen, path, reason, AUTO, rows, meas, paired)


def _verdict(measurement: FormatMeasurement, alphas: dict[str, float], rows: list[dict[str, Any]],
             best: tuple[str, float, str | None, int], paired: dict[str, Any] | None,
             margin: float) -> tuple[str, str]:
    """:func:`choose_format`'s served format and its reason, from the rows judged, the best of
    them (format, tokens/ms, proposer, γ) and its :func:`paired_ratio`."""
    pk = measurement.formats[PACKAGED]
    base = 1.0 / pk.ms[1]
    name, gp, prop, gamma = best
    # the measurement's steps run after ``cached_tokens`` of context: dearer than a short request's
    ctx = f" after {measurement.cached_tokens} cached tokens" if measurement.cached_tokens else ""
    pk_plain = f"plain decoding of the packaged file ({pk.file}, {pk.ms[1]:.2f} ms a step{ctx})"
    kind = "its prior α" if alphas is None or alphas == prior_alphas() else "α"
    # a prior α said what it is where it first appears (a walkthrough met "at its prior α 0.66" unexplained)
    prior = PRIOR_MEANS if kind != "α" else ""
    how = f"{prop} γ={gamma} at {kind} {alphas[prop]:.2f}{prior}" if prop else "plain decoding"
    others = _others(rows, name, kind, "" if prop else prior)
    if measurement.from_cache:  # say so: a newcomer read "measured:" of a start that measured nothing
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(measurement.measured_at)) if measurement.measured_at else "earlier"
        src = f"measured on this host ({when}), cached"
    else:
        src = "measured"
    if _untrusted(pk, measurement.reps):
        chosen = PACKAGED
        reason = (f"the packaged file's measurement cannot be trusted ({_untrusted(pk, measurement.reps)}), so no "
                  f"format is judged against it; measured again at the next start")
    elif name != PACKAGED and gp >= base * (1.0 + margin) and _paired_wins(paired, margin):
        if paired:  # the paired interval decided: it comes first, the medians' ratio after it, named as such
            reason = (f"{src}: {name} serves on its ratio paired per repeat, {paired['ratio']:.2f}x "
                      f"[{paired['low']:.2f}, {paired['high']:.2f}] the tokens per ms of {pk_plain} over "
                      f"{paired['pairs']} repeats, the interval that decided (above 1.00, the ratio at "
                      f"{1 + margin:.2f}x or more); on the medians it expects {gp:.4f} tokens/ms ({how}), "
                      f"{gp / base:.2f}x")
        else:
            reason = f"{src}: {name} expects {gp:.4f} tokens/ms ({how}), {gp / base:.2f}x the tokens per ms of {pk_plain}"
        reason += _rows_dearer(measurement, name) + (f"; {others}" if others else "")
        chosen = name
    elif name != PACKAGED and gp >= base * (1.0 + margin):
        chosen = PACKAGED
        reason = (f"{src}: {name} expects {gp:.4f} tokens/ms ({how}), {gp / base:.2f}x the tokens per ms of {pk_plain}, "
                  f"but paired per repeat {paired['ratio']:.2f}x [{paired['low']:.2f}, {paired['high']:.2f}] over "
                  f"{paired['pairs']} repeats ({paired['confidence']:.0%}): not surely {margin:.0%} faster (that needs "
                  f"the ratio at {1 + margin:.2f}x or more and the interval above 1.00), so the packaged file serves"
                  + (f"; {others}" if others else ""))
    else:
        chosen = PACKAGED
        if name == PACKAGED and prop:
            reason = (f"{src}: the packaged file is the best, with {how}: {gp / base:.2f}x the tokens per ms of its own "
                      f"plain decoding ({pk.ms[1]:.2f} ms a step{ctx}); the other formats' best, each as a multiple of "
                      f"the packaged file's plain decoding, not of the {gp / base:.2f}x: "
                      f"{others}")
        elif name == PACKAGED:  # its plain step beats every format's best (the others' figures: x that step)
            reason = (f"{src}: the packaged file is the best: its plain decoding ({gp:.4f} tokens/ms, {pk.ms[1]:.2f} ms "
                      f"a step{ctx}) beats every other format's best (each as a multiple of it): {others}")
        else:
            reason = (f"{src}: no format beats {pk_plain} by {margin:.0%} (best {name}: {gp / base:.2f}x with "
                      f"{how})" + (f"; {others}" if others else ""))
    if not _untrusted(pk, measurement.reps):
        reason += _moved(measurement, {r["format"] for r in rows if r.get("eligible")} | {PACKAGED})
    return chosen, reason


def _others(rows: list[dict[str, Any]], name: str, kind: str, prior: str = "") -> str:
    """The reason's list of the formats other than ``name``: each eligible one's best as a multiple
    of the packaged file's plain decoding, each left-out one with why. The packaged file's own entry
    is left out where its best is that plain decoding (1.00x of itself says nothing) and names its
    proposer where speculation on it is its best, with ``prior`` (:data:`PRIOR_MEANS` where the
    reason has not said what a prior α is yet) after its α."""
    out = []
    for r in rows:
        if r["format"] == name:
            continue
        if not r.get("eligible"):
            out.append(f"{r['format']} left out ({r['why_not']})")
            continue
        b = r["best"]
        if r["format"] == PACKAGED and not b.get("proposer"):
            continue
        spec = (f" (its best, {b['proposer']} γ={b['gamma']} at {kind} {b['alpha']:.2f}{prior})"
                if r["format"] == PACKAGED and b.get("alpha") is not None else "")
        out.append(f"{r['format']} {b['vs_packaged_plain']:.2f}x{spec}")
    return "; ".join(out)


def _rows_dearer(measurement: FormatMeasurement, name: str) -> str:
    """"; its 2-row verification costs 2.71x its step against the packaged file's 1.72x: speculation
    pays less on it" where the served format ``name``'s 2-row step costs more of its own plain steps
    than the packaged file's does (the format is chosen on its best, often plain decoding, and gives
    up that much of what any proposer can buy: costs as priced, never below one step); "" otherwise
    or without both 2-row steps."""
    ratios = []
    for f in (name, PACKAGED):
        ms = measurement.formats[f].ms
        if not ms.get(1) or 2 not in ms:
            return ""
        ratios.append(max(ms[2], ms[1]) / ms[1])
    if round(ratios[0], 2) <= round(ratios[1], 2):  # not "1.72x against 1.72x"
        return ""
    return (f"; its 2-row verification costs {ratios[0]:.2f}x its step against the packaged file's {ratios[1]:.2f}x: "
            f"speculation pays less on it")


def _moved(measurement: FormatMeasurement, judged: set[str]) -> str:
    """The reason's note on a judged measurement whose step times moved (noise above
    :data:`NOISE_MAX` on a format in ``judged``: judged on the paired ratios all the same, not
    cached), or ""."""
    moved = [f"{f} {1 + c.noise:.2f}x" for f, c in measurement.formats.items()
             if f in judged and not c.error and c.noise is not None and c.noise > NOISE_MAX]
    if not moved:
        return ""
    return (f"; the step times moved during the measurement (a typical repeat over the fastest: {', '.join(moved)}): "
            f"a format is judged on its ratio paired per repeat, which sees the move on both files alike, and it is "
            f"measured again at the next start")


def _paired_wins(paired: dict[str, Any] | None, margin: float) -> bool:
    """A requantised format's paired ratio (:func:`paired_ratio`) lets it serve: at least
    ``1 + margin`` with the interval's lower bound at least 1; True without one (no samples)."""
    return paired is None or (paired["ratio"] >= 1.0 + margin and paired["low"] >= 1.0)


# ---- the measurement --------------------------------------------------------------------------------

def _judge_format(name: str, cost, measurement: FormatMeasurement, alphas: dict[str, float],
                  proposers: tuple[str, ...]) -> tuple[dict[str, Any], float, str | None, int]:
    """One format's row of :func:`choose_format` (``eligible``, else ``why_not``), its best
    expected goodput (tokens/ms), and the proposer and γ that give it (None, 0: plain decoding)."""
    row: dict[str, Any] = {"format": name, "file": cost.file}
    if cost.error:
        return dict(row, eligible=False, why_not=cost.error), 0.0, None, 0
    rows_differ = (f"its {max(cost.ms or ROWS)}-row verification's logits differ from its one-row steps by up to "
                   f"{cost.row_max_abs_diff:.3g}, so greedy speculation could leave plain decoding's output")
    if name != PACKAGED and cost.rows_identical is False and 1 not in cost.ms:  # not timed (_time_rows)
        return dict(row, rows_identical=False, eligible=False, why_not=rows_differ), 0.0, None, 0
    ms, running = {}, 0.0
    for n in sorted(cost.ms):
        running = ms[n] = max(running, cost.ms[n])
    gp, prop, gamma = 1.0 / ms[1], None, 0
    for p in proposers:
        a = alphas.get(p)
        c = _cost_per_token(p, measurement.draft_ms) if a is not None else None
        if a is None or c is None:
            continue
        g_gp, g = speculative_goodput(ms, a, c)
        if g > 0 and g_gp > gp:
            gp, prop, gamma = g_gp, p, g
    base = 1.0 / measurement.formats[PACKAGED].ms[1]
    row.update(ms={str(n): round(t, 3) for n, t in sorted(cost.ms.items())}, rows_identical=cost.rows_identical,
               noise=cost.noise, repeats=cost.repeats,
               best={"proposer": prop, "gamma": gamma, "alpha": alphas.get(prop) if prop else None,
                     "tokens_per_ms": round(gp, 5), "vs_packaged_plain": round(gp / base, 3)})
    if name != PACKAGED and cost.rows_identical is False:
        row.update(eligible=False, why_not=rows_differ)
    elif name != PACKAGED and cost.rows_identical is None:
        row.update(eligible=False, why_not="its verification rows were not checked against one-row steps")
    elif name != PACKAGED and _untrusted(cost, measurement.reps):
        row.update(eligible=False, why_not=_untrusted(cost, measurement.reps))
    else:
        row["eligible"] = True
    return row, gp, prop, gamma



def cpu_key(threads: int) -> dict[str, Any]:
    """The host part of the cache key: CPU model name, a digest of its flags (Linux /proc/cpuinfo;
    ``platform.processor()`` elsewhere) and the thread count."""
    from decoder.engines.llamacpp import cpuinfo_fields

    f = cpuinfo_fields()
    model, flags = f.get("model name"), " ".join(sorted((f.get("flags") or f.get("Features") or "").split()))
    return {"cpu": model or platform.processor() or platform.machine(), "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:12], "threads": int(threads)}


def _cache_file(key: dict[str, Any], cache_dir: Path) -> Path:
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{key['model']}-t{key['threads']}-{h}.json"


def _backend_key(gguf: Path) -> str:
    """The llama.cpp build's identity (``cpu_backend_identity``) for a measurement's cache key, taken
    after this process's once-only kernel settings, which it names (``llama_extra_buffers`` sets
    ``GGML_AMX_VNNI_MAX_ROWS`` where the AMX path runs: :mod:`decoder.engines.amx_rows`)."""
    from decoder.engines.llamacpp_lib import cpu_backend_identity, llama_extra_buffers, llamacpp_available

    if llamacpp_available():
        llama_extra_buffers(gguf)
    return cpu_backend_identity()


def measure_formats(gguf: Path, threads: int | None = None, formats: Sequence[str] = CANDIDATES,
                    reps: int = 5, cached: int = 300, n_ctx: int = 1024, draft_layers: str | None = None,
                    cache_dir: Path | None = None, use_cache: bool = True, progress=None,
                    max_seconds: float | None = None, proposers: Sequence[str] | None = None) -> FormatMeasurement:
    """Step costs of ``gguf`` (a packaged file) in each of ``formats`` on this host, cached.

    Each format's file (``"packaged"``: ``gguf``; others :func:`decoder.models.gguf_export.requantised_gguf`,
    written once) is loaded in llama.cpp at ``threads`` (default ``os.cpu_count()``, what the
    engine runs) with ``cached`` tokens in the cache (above 256, where llama.cpp's one-row flash
    attention path changes), all open at once and interleaved within each repeat (:func:`_time_rows`):
    one ``llama_decode`` of each of n = 1..8 rows with logits at all n, truncated back. Reported:
    the median ms per n over ``reps`` (fewer where the repeats pass the time budget: ``max_seconds``
    when given, else :func:`scaled_budget` from a plain step timed first, ``budget_s``); whether the
    8-row logits equal the same rows decoded one at a time (``rows_identical``); with ``draft_layers``
    (``"0-3"``) the derived draft's plain step (``draft_ms``), the cost c of a proposed token. About
    :data:`SHAPE_WARMUP` x reps x (1 + 2 + ... + 8) one-row steps' worth per file (more where an unsure
    contest is timed again), plus one quantisation per format, written once.

    Cached as JSON in ``cache_dir`` (default ``cache_root() / "formats"``) keyed by the packaged
    file's digest, the CPU model and flags, the threads, the formats, the draft layers and the llama.cpp
    build (:func:`decoder.engines.llamacpp_lib.cpu_backend_identity`); delete
    it to measure again. Not cached: a format over :data:`NOISE_MAX`, or other processes above
    :data:`BUSY_MAX` of the CPUs (``busy``: no format is judged on it, :func:`choose_format`).
    """
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.gguf_export import derived_draft_gguf, file_digest16, requantised_gguf
    from decoder.models.packaged import cache_root

    gguf = Path(gguf)
    threads = int(threads or os.cpu_count() or 1)
    fmts = list(dict.fromkeys(f if f == PACKAGED else f.upper() for f in formats))
    # the llama.cpp build is part of the key: a rebuilt or patched backend prices steps anew
    key = {"model": f"{gguf.stem}-{file_digest16(gguf)}", **cpu_key(threads), "formats": fmts,
           "draft_layers": draft_layers, "version": MEASURE_VERSION, "llama_cpu": _backend_key(gguf)}
    cdir = Path(cache_dir or cache_root() / "formats")
    cfile = _cache_file(key, cdir)
    cached_m = _cached_measurement(cfile, key) if use_cache else None
    if cached_m is not None:
        return cached_m
    t0 = time.perf_counter()
    costs: dict[str, FormatCost] = {}
    engines: dict[str, tuple[Any, Sequence[int]]] = {}
    try:
        for f in fmts:
            try:
                path = gguf if f == PACKAGED else requantised_gguf(gguf, f)
                costs[f] = FormatCost(f, path.name)
                engines[f] = (LlamaCppEngine(path, n_ctx=n_ctx, threads=threads), ROWS)
            except Exception as e:  # noqa: BLE001 - one format's failure leaves the others measured
                costs[f] = FormatCost(f, costs[f].file if f in costs else "", error=f"{type(e).__name__}: {e}"[:300])
        if PACKAGED not in engines:
            raise RuntimeError(f"the packaged file {gguf.name} could not be loaded: {costs[PACKAGED].error}")
        if draft_layers:
            from decoder.models.loading import parse_layers

            pk = engines[PACKAGED][0]
            layers = parse_layers(draft_layers, int(pk.L.llama_model_n_layer(pk.model)))
            engines[DRAFT] = (LlamaCppEngine(derived_draft_gguf(gguf, layers), n_ctx=n_ctx, threads=threads), (1,))
        if progress:
            progress(f"measuring the target's weight formats ({', '.join(f for f in engines if f != DRAFT)}) at "
                     f"{threads} thread{'s' if threads != 1 else ''} (models.format=auto; cached for this host "
                     f"unless a measurement was noisy)")
        timed = _time_rows(engines, reps, cached, max_seconds,
                           more=lambda times, checks: _contest(times, checks, costs, proposers))
    finally:
        for eng, _ in engines.values():
            eng.close()
    budget = next((t["budget_s"] for t in timed.values() if t.get("budget_s") is not None), max_seconds)
    incomplete = [f for f, t in timed.items() if f in costs and not _fill_cost(costs[f], t, budget, max_seconds, threads)]
    draft_ms = timed[DRAFT]["ms"].get(1) if DRAFT in timed else None
    noisy = [f for f, c in costs.items() if _noisy(c, reps) or f in incomplete]
    busy = _busy(timed)
    m = FormatMeasurement(key, costs, draft_ms, reps, cached, round(time.perf_counter() - t0, 2), time.time(),
                          str(cfile), budget_s=None if budget is None else round(budget, 1), busy=busy)
    if not use_cache or noisy or busy or not _write_cache(m, cfile):  # taken again at the next start
        m.cache_file = None
    return m


def _fill_cost(cost: FormatCost, t: dict[str, Any], budget: float | None, max_seconds: float | None,
               threads: int) -> bool:
    """``cost`` filled from its :func:`_time_rows` result ``t``; False (and ``cost.error`` set by
    :func:`_incomplete`) when some row count was not timed within the budget."""
    cost.rows_identical, cost.row_max_abs_diff = t["rows_identical"], t["row_max_abs_diff"]
    if "ms" not in t and t["rows_identical"] is False:  # left out on its rows, not timed (_time_rows)
        return True
    cost.ms, cost.noise, cost.repeats = t["ms"], t["noise"], t.get("repeats")
    cost.samples = t.get("samples", {})
    if set(t["ms"]) == set(ROWS):
        return True
    cost.error = _incomplete(sorted(t["ms"]), budget, max_seconds is None, threads, t.get("load"))
    return False


def _medians(done: dict[int, list[float]]) -> tuple[dict[int, float], float]:
    """The median ms per row count of ``done`` ({n: [ms, ...]}, each non-empty) and the noise,
    max over n of median / fastest - 1 (0.0 without any)."""
    med = {n: statistics.median(v) for n, v in done.items()}
    return med, max((med[n] / min(v) - 1.0 for n, v in done.items()), default=0.0)


def _contest(times: dict[str, dict[int, list[float]]], checks: dict[str, dict[str, Any]],
             costs: dict[str, FormatCost], proposers: Sequence[str] | None) -> list[str]:
    """The engines :func:`_time_rows` should time once more: the packaged file and the best other
    format while :func:`choose_format` on the times so far finds their paired ratio unsure
    (``paired["unsure"]``: not yet serving, but its interval reaches past ``1 + MARGIN``); else,
    while any format still in the running (the packaged file and every eligible one) is noisy
    (``noise`` above :data:`NOISE_MAX`), all of those; none otherwise."""
    fm = {}
    for f, by_n in times.items():
        done = {n: v for n, v in by_n.items() if v}
        if f == DRAFT or f not in costs or not done:
            continue
        med, noise = _medians(done)
        fm[f] = FormatCost(f, costs[f].file, med, checks[f]["rows_identical"], checks[f]["row_max_abs_diff"],
                           noise=noise, repeats=min(len(v) for v in by_n.values()), samples=dict(done))
    if PACKAGED not in fm or 1 not in fm[PACKAGED].ms:
        return []
    draft = times.get(DRAFT, {}).get(1)
    c = choose_format(FormatMeasurement({}, fm, statistics.median(draft) if draft else None), proposers=proposers)
    if c.paired and c.paired.get("unsure"):
        return [PACKAGED, c.paired["format"]]
    # step times that moved (a host settling after a build, a file just written): every format still
    # in the running timed again, so the medians rest on more repeats, the later ones on a quieter host
    running = [r["format"] for r in c.costs if r["format"] == PACKAGED or r.get("eligible")]
    return running if any((fm[f].noise or 0.0) > NOISE_MAX for f in running) else []


def _incomplete(rows: list[int], budget_s: float | None, scaled: bool, threads: int,
                load: tuple[float, float, float] | None) -> str:
    """Why a format's measurement is incomplete, as it happened: the budget (s) it did not finish
    in and where that came from, the row counts timed, the CPU load seen (``os.getloadavg()``, 1 /
    5 / 15 min; None where the OS has none) and the settings that change it."""
    how = (f"{BUDGET_FACTOR:g}x its time expected from a plain step timed on this CPU, within "
           f"{BUDGET_MIN_S:g}-{BUDGET_MAX_S:g} s" if scaled else "models.format_max_seconds")
    cpus = os.cpu_count() or 1
    if load is None:
        seen = "the CPU load is not known on this OS"
    else:
        seen = (f"CPU load {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {cpus} CPUs, its own "
                f"{threads} thread(s) included" + ("; more runnable work than CPUs, so other jobs slowed it"
                                                   if load[0] > cpus else ""))
    took = "its time budget" if budget_s is None else f"{budget_s:.1f} s"
    return (f"did not finish in {took} (the budget: {how}): rows {rows} of 1-{max(ROWS)} timed; {seen}; "
            f"set models.format_max_seconds to give it longer, or models.format=packaged (or a pinned format, "
            f"e.g. F16) to serve without measuring")


def _cached_measurement(cfile: Path, key: dict) -> FormatMeasurement | None:
    """The measurement cached in ``cfile`` under ``key``; None when absent, damaged or another key's."""
    if not cfile.exists():
        return None
    try:
        m = FormatMeasurement.from_json(json.loads(cfile.read_text()))
    except Exception:  # noqa: BLE001 - damaged (a field of another type, missing, not JSON): measured again
        return None
    if m.key != key or not _usable(m):
        return None
    m.from_cache, m.cache_file = True, str(cfile)
    return m


def _usable(m: FormatMeasurement) -> bool:
    """A cached measurement :func:`choose_format` can judge: the packaged file's plain step, and every
    step cost a positive finite number of ms (a hand-edited or damaged file otherwise failed at start
    with a traceback, or was kept as a failed measurement it said would be taken again)."""
    pk = m.formats.get(PACKAGED)
    if pk is None or pk.error or 1 not in pk.ms:
        return False
    return all(math.isfinite(t) and t > 0 for c in m.formats.values() for t in c.ms.values())


def _write_cache(m: FormatMeasurement, cfile: Path) -> bool:
    """``m`` written to ``cfile`` atomically; False when the cache cannot be written (measured again next start)."""
    try:
        cfile.parent.mkdir(parents=True, exist_ok=True)
        tmp = cfile.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(m.to_json(), indent=1))
        os.replace(tmp, cfile)
        return True
    except OSError:
        return False


# ---- the setting resolved ---------------------------------------------------------------------------


def scaled_budget(plain_ms: dict[str, float], rows: dict[str, Sequence[int]], reps: int, elapsed_s: float,
                  factor: float = BUDGET_FACTOR, floor_s: float = BUDGET_MIN_S, cap_s: float = BUDGET_MAX_S) -> float:
    """The measurement's time budget (s) on this host: ``factor`` x (``elapsed_s``, the time
    already spent, + the rest as predicted from each engine's plain step ``plain_ms`` (ms)),
    within [``floor_s``, ``cap_s``]. The rest, per engine with row counts ``rows``: the row
    identity check (2 x max(rows) one-row steps, where max(rows) > 1) and ``SHAPE_WARMUP`` x ``reps`` x Σ n
    one-row steps (each timed step and the untimed one of its shape before it), an n-row step priced at n plain steps: about what it costs where extra rows
    are dear (the packaged file's t(5) / t(1) was 4.68 on the AVX2-only EPYC of
    docs/walkthroughs.md), an overestimate where they are cheap (F16, AMX)."""
    steps = {e: (2 * max(r) if max(r) > 1 else 0) + SHAPE_WARMUP * reps * sum(r) for e, r in rows.items()}
    rest_s = sum(plain_ms[e] * n for e, n in steps.items()) / 1e3
    return min(cap_s, max(floor_s, factor * (elapsed_s + rest_s)))


def _time_rows(engines: dict[str, tuple[Any, Sequence[int]]], reps: int, cached: int,
               max_seconds: float | None = None, more=None) -> dict[str, dict[str, Any]]:
    """Per engine (name -> (engine, row counts)): the median ms of one ``llama_decode`` of n rows
    (logits at all n) for each n, after ``cached`` tokens, over ``reps`` repeats (the row identity
    check before them is the warm-up), the engines interleaved within each repeat (row count by row
    count, every file's n-row step next to the others') so that a change of host load falls on
    every file alike; each timed step right after an untimed step of the same
    rows on the same engine, as plain decoding's steps (and a verification at a steady γ) follow
    steps of their own shape (SHAPE_WARMUP); ``noise``, max over n of median / fastest - 1; whether
    ``max(rows)`` rows in one call give the logits of the same rows one at a time
    (``rows_identical``, their ``row_max_abs_diff``; None when not checked); ``repeats``; the
    budget (``budget_s``) and the CPU load when the steps ended (``load``, ``os.getloadavg()``;
    None where the OS has none); ``others``, the share of the CPUs other processes used during the
    timed repeats (:func:`others_share`; None off Linux).

    The budget bounds it all from the first prefill: past it no further step runs, so a slow or
    busy host (2 llama.cpp threads on 2 cores shared with other jobs took 3 s a step) gets fewer
    repeats, or an incomplete measurement (``ms`` without some row counts), not many minutes of
    measuring. It is ``max_seconds`` when given, else :func:`scaled_budget` of one plain step per
    engine timed after its prefill (a warm-up step).

    ``more``: after the ``reps`` repeats, called with the times so far ({engine: {n: [ms, ...]}})
    and the row checks ({engine: {"rows_identical", "row_max_abs_diff"}}); the engines it names
    are timed once more, all their rows, and it is asked again, until it names none, the
    budget runs out or :data:`MAX_REPEATS` repeats are done. Each engine's ``samples``: its ms
    per n in repeat order. An engine other than :data:`PACKAGED` whose rows differ (``rows_identical``
    False) is not timed: its entry has the row check only."""

    t_start = time.perf_counter()
    seqs, toks, plain_ms = _prefill(engines, cached)
    out = {name: {"rows_identical": None, "row_max_abs_diff": None} for name in engines}
    budget = (max_seconds if max_seconds is not None else
              scaled_budget(plain_ms, {n: r for n, (_, r) in engines.items()}, reps, time.perf_counter() - t_start))
    deadline = t_start + budget
    _check_rows(engines, seqs, toks, cached, deadline, out)
    # a format whose rows differ is left out whatever its times (_judge_format); the packaged file serves regardless
    engines = {name: e for name, e in engines.items() if name == PACKAGED or out[name]["rows_identical"] is not False}
    times = {name: {n: [] for n in rows} for name, (_, rows) in engines.items()}
    jiffies0, t_timed = cpu_jiffies(), time.perf_counter()
    def one_repeat(names) -> None:  # by row count, the files side by side: each pair of steps close in time
        for n in sorted({n for name in names for n in engines[name][1]}):
            for name in (name for name in names if n in engines[name][1]):
                s = seqs[name]
                if time.perf_counter() > deadline:
                    return
                for _ in range(SHAPE_WARMUP - 1):  # the same shape first: served steps follow steps of their shape
                    s.forward(toks[name][:n], n)
                    s.truncate(cached)
                t0 = time.perf_counter()
                s.forward(toks[name][:n], n)
                dt = (time.perf_counter() - t0) * 1e3
                s.truncate(cached)
                times[name][n].append(dt)

    busy = lambda: _busy_now(jiffies0, t_timed)  # noqa: E731 - other processes above BUSY_MAX: stop
    for _ in range(reps):  # the identity check (and the prefill) warmed every engine up
        one_repeat(list(engines))
        if busy():
            break
    for _ in range(reps, MAX_REPEATS if more is not None and not busy() else reps):
        names = [n for n in more(times, out) if n in engines] if time.perf_counter() < deadline else []
        if not names:
            break
        one_repeat(names)
        if busy():
            break
    try:
        load = os.getloadavg()
    except (AttributeError, OSError):  # not on this OS
        load = None
    others = others_share(jiffies0, cpu_jiffies(), time.perf_counter() - t_timed, os.cpu_count() or 1)
    for name, by_n in times.items():
        done = {n: v for n, v in by_n.items() if v}
        med, noise = _medians(done)
        out[name]["ms"] = {n: round(t, 4) for n, t in med.items()}
        out[name]["samples"] = {n: [round(x, 4) for x in v] for n, v in done.items()}
        out[name]["noise"] = round(noise, 4)
        out[name]["repeats"] = min(len(v) for v in by_n.values())
        out[name]["budget_s"], out[name]["load"], out[name]["others"] = budget, load, others
    return out


def _busy_now(jiffies0: tuple[int, int] | None, t_timed: float) -> bool:
    """Other processes used more than :data:`BUSY_MAX` of the CPUs since ``t_timed`` (a
    :func:`cpu_jiffies` snapshot ``jiffies0`` then), judged once :data:`BUSY_JUDGE_S` seconds passed."""
    sec = time.perf_counter() - t_timed
    share = others_share(jiffies0, cpu_jiffies(), sec, os.cpu_count() or 1) if sec >= BUSY_JUDGE_S else None
    return share is not None and share > BUSY_MAX


def _prefill(engines: dict[str, tuple[Any, Sequence[int]]], cached: int) -> tuple[dict, dict, dict[str, float]]:
    """Per engine: a sequence holding ``cached`` tokens, the tokens its timed steps feed (max(rows)
    of them) and one plain step's ms timed after the prefill (a warm-up step, truncated back)."""
    seqs, toks, plain_ms = {}, {}, {}
    for name, (eng, rows) in engines.items():
        vocab = eng.vocab_size
        seqs[name] = eng.start()
        seqs[name].forward([(100 + i) % vocab for i in range(cached)], 1)
        toks[name] = [(5 + 7 * j) % vocab for j in range(max(rows))]
        t0 = time.perf_counter()
        seqs[name].forward(toks[name][:1], 1)
        plain_ms[name] = (time.perf_counter() - t0) * 1e3
        seqs[name].truncate(cached)
    return seqs, toks, plain_ms


def _check_rows(engines, seqs, toks, cached: int, deadline: float, out: dict[str, dict[str, Any]]) -> None:
    """Per engine with more than one row count, before ``deadline``: whether ``max(rows)`` rows in
    one ``llama_decode`` give the logits of the same rows one at a time (``rows_identical`` and
    ``row_max_abs_diff`` in ``out[name]``); the sequences are truncated back to ``cached``."""
    for name, (_, rows) in engines.items():
        if max(rows) > 1 and time.perf_counter() < deadline:
            diff = _row_diff(seqs[name], toks[name], cached)
            out[name].update(rows_identical=diff == 0.0, row_max_abs_diff=diff)


def _row_diff(seq, toks: Sequence[int], cached: int) -> float:
    """The largest |Δ logit| between ``toks`` decoded as one block of rows after the sequence's
    ``cached`` tokens and the same tokens decoded one row at a time (0.0: the same bits); the
    sequence is truncated back to ``cached``."""
    import numpy as np

    block = seq.forward(list(toks), len(toks)).numpy()
    seq.truncate(cached)
    single = np.stack([seq.forward([x], 1).numpy()[0] for x in toks])
    seq.truncate(cached)
    return float(np.abs(block - single).max())


def check_pinned_rows(choice: FormatChoice, engine, rows: int = 8, cached: int = 32) -> FormatChoice:
    """For a format the measurement did not choose (pinned, or named in ``models.target``): whether a
    verification of ``rows`` rows on ``engine`` (the served target) gives the logits of the same rows
    decoded one at a time, as :func:`measure_formats` checks every candidate of ``auto``. Where it does
    not (BF16 or F16 on some CPUs), greedy output under speculation, batching or the prompt cache can
    differ from plain decoding of the format: the reason says so with the difference and the fix, and a
    warning is logged. Sets ``choice.rows_identical`` and ``choice.row_max_abs_diff``; returns ``choice``.
    A packaged or measured choice is returned as it is."""
    if choice.format == PACKAGED or choice.costs:  # the packaged file, or measured (its rows checked there)
        return choice
    vocab = engine.vocab_size
    seq = engine.start()
    try:
        seq.forward([(100 + i) % vocab for i in range(cached)], 1)
        diff = _row_diff(seq, [(5 + 7 * j) % vocab for j in range(rows)], cached)
    finally:
        seq.release()
    choice.rows_identical, choice.row_max_abs_diff = diff == 0.0, diff
    if diff != 0.0:
        choice.reason += (f"; NOT LOSSLESS on this CPU: a verification of {rows} rows gives logits that differ from the "
                          f"same rows decoded one at a time (max |Δ| {diff:.3g}), so greedy output under speculation, batching "
                          f"or the prompt cache can differ from plain decoding of {choice.format}; models.format=auto "
                          f"serves only formats whose rows are identical here, models.format=packaged the packaged file")
        import structlog

        structlog.get_logger("decoder.models.formats").warning(
            "served_format_rows_differ", format=choice.format, row_max_abs_diff=diff, rows=rows,
            fix="models.format=auto or packaged: formats whose verification rows are identical on this CPU")
    return choice


BUSY_MAX = 0.25  # other processes' share of the CPUs during the timed steps above which no format is judged
BUSY_JUDGE_S = 2.0
"""Seconds of timed steps after which :func:`_time_rows` stops at the end of a repeat once other
processes used more than :data:`BUSY_MAX` of the CPUs so far: such a measurement is never judged
(:func:`_busy`), so it is not run to its budget (a break session's busy host measured for 185 s at
every start and threw it away)."""


def _busy(timed: dict[str, dict[str, Any]]) -> str | None:
    """Why :func:`_time_rows`' timing ran beside other work (their share of the CPUs above
    :data:`BUSY_MAX`), or None."""
    others = next((t["others"] for t in timed.values() if t.get("others") is not None), None)
    if others is None or others <= BUSY_MAX:
        return None
    return (f"the measurement ran beside other work: other processes used {others:.0%} of the CPUs during its "
            f"steps (above {BUSY_MAX:.0%})")


def resolve_format(setting: str, target: str, threads: int | None = None, draft: str | None = None,
                   proposers: Sequence[str] | None = None, progress=None,
                   max_seconds: float | None = None) -> FormatChoice | None:
    """What ``models.format`` serves for ``target``; None when the target is not a built-in name
    (a ``.gguf`` path, a directory: served as given).

    A built-in ``name@FORMAT`` serves that format (the setting does not apply). ``packaged``: the
    packaged file. A llama.cpp format: that format, requantised once (pinned). ``auto``:
    :func:`measure_formats` (cached) then :func:`choose_format` with :func:`prior_alphas`; the draft's
    cost is measured when ``draft`` is ``layers:<spec>``; ``max_seconds`` (``models.format_max_seconds``):
    the measurement's time budget in seconds, None = scaled to the host (:func:`scaled_budget`).

    Raises:
        ValueError: ``setting`` is not a valid value (:func:`format_setting`).
        ModelLoadError: the package is missing or the format cannot be written.
    """
    from decoder.models.loading import packaged_target
    from decoder.models.packaged import PACKAGED as BUILT_IN, packaged_gguf

    canon = format_setting(setting)
    base, sep, fmt = target.partition("@")
    if base not in BUILT_IN:
        return None
    if sep:
        path = packaged_target(target)
        return FormatChoice(fmt.strip().upper(), path, f"named in models.target ({target}); models.format does not apply",
                            canon)
    if canon == PACKAGED:
        return FormatChoice(PACKAGED, packaged_gguf(base), "pinned (models.format=packaged)", canon)
    if canon != AUTO:
        return FormatChoice(canon, packaged_target(f"{base}@{canon}"), f"pinned (models.format={canon})", canon)
    src = packaged_gguf(base)
    layers = draft.split(":", 1)[1] if draft and draft.startswith("layers:") else None
    m = measure_formats(src, threads, draft_layers=layers, progress=progress, max_seconds=max_seconds,
                        proposers=proposers)
    paths = {f: packaged_target(f"{base}@{f}") for f, c in m.formats.items() if f != PACKAGED and not c.error}
    paths[PACKAGED] = src  # served whenever nothing else is, measured or not
    return choose_format(m, proposers=proposers, paths=paths)
