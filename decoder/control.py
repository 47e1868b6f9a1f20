"""Closing the loop on the decoder side: acceptance windows, automatic rollback, goodput control.

- :class:`AcceptanceTracker`: pooled counts per (workload, sampling bucket, adapter version),
  kept locally and flushed to the store's :class:`store.AcceptanceHistory` in the background;
  feeds the per-request α to a :class:`decoder.shift.ShiftDetector`.
- :class:`RollbackMonitor`: after a promotion, compares the new version's live α with the
  previous version's on the same keys and rolls back when it is worse by more than a margin.
- :class:`GoodputController`: picks the proposer and γ in {0 (plain decoding), 1, ..., γ_max}
  per (workload, sampling bucket) from online estimates of acceptance and of the measured step
  costs, so speculation runs only when it pays, with the proposer that pays most.

Keys are written ``"{workload}@{bucket}"`` wherever they are shown (e.g. ``prose@greedy``,
``code@t0.7-p0.9``): acceptance depends on both the traffic and the sampling policy.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog

from decoder.metrics import AcceptanceCounts, StepStats, line_at
from decoder.proposers.registry import DEFAULT_PROPOSER, REQUEST_PROPOSERS, alpha_modelled, versioned_by
from decoder.sampling import expected_tokens_per_step  # noqa: F401 - re-exported
from decoder.shift import ShiftAlarm, ShiftDetector, key_str  # key_str re-exported: "{workload}@{bucket}"
from store import AcceptanceHistory, AdapterRegistry, InvalidTransitionError, StoreError, UnknownVersionError
from store.history import sum_rows
from store.jsonsafe import nan_none

DRAFT = alpha_modelled()  # the proposer modelled by α: the key's α, its rates by γ, the speculation ceiling
HEAD = versioned_by("head")  # the proposer whose versions are heads (the head registry)

log = structlog.get_logger("decoder.control")

Key = tuple[str, str]  # (workload, sampling bucket)


def key_of(req) -> Key:
    """(workload, sampling bucket) of a :class:`decoder.speculative.DecodeRequest`."""
    return (req.workload, getattr(req, "sampling_bucket", None) or req.params.bucket())


# ---- (a) acceptance windows --------------------------------------------------------------------


@dataclass
class Window:
    """Pooled counts of the requests of one (workload, bucket, version) key.

    counts: steps pooled (see :class:`decoder.metrics.AcceptanceCounts` for the rates).
    request_alpha_sum / request_alpha_count: Σ and number of per-request α values (requests
        without proposals carry none); their ratio is the store's ``alpha`` (a mean of
        per-request α), while ``counts.alpha`` pools positions.
    """

    counts: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    request_alpha_sum: float = 0.0
    request_alpha_count: int = 0

    def add(self, counts: AcceptanceCounts) -> None:
        self.counts.merge(counts)
        a = counts.alpha
        if a == a:
            self.request_alpha_sum += a
            self.request_alpha_count += 1

    def merge(self, other: "Window") -> None:
        self.counts.merge(other.counts)
        self.request_alpha_sum += other.request_alpha_sum
        self.request_alpha_count += other.request_alpha_count

    def history_counts(self) -> dict[str, float]:
        """The counters of :mod:`store.history` (its definitions)."""
        c = self.counts
        return {
            "num_drafts": c.num_drafts,
            "num_draft_tokens": c.num_draft_tokens,
            "num_accepted_tokens": c.num_accepted_tokens,
            "num_emitted_tokens": c.num_emitted_tokens,
            "num_steps": c.num_steps,
            "requests": c.num_requests,
            "alpha_sum": self.request_alpha_sum,
            "alpha_count": self.request_alpha_count,
            "overlap_sum": c.alpha_sum,  # Σ over proposed positions of Σ min(p, q): pooled α on read
            # a broken clock's reading (inf, NaN) loses the time, not the window's counts
            "wall_ms": c.decode_ms if math.isfinite(c.decode_ms) else 0.0,
        }

    def summary(self) -> dict[str, Any]:
        c = self.counts
        return {
            "requests": c.num_requests,
            "alpha": nan_none(c.alpha, 4),
            "acceptance_rate": nan_none(c.acceptance_rate, 4),
            "tau": nan_none(c.mean_accepted_length, 4),
            "goodput_tokens_per_ms": nan_none(c.goodput, 4),
        }


class AcceptanceTracker:
    """Per-(workload, bucket, version) acceptance windows, flushed to the store.

    :meth:`observe` only touches memory (a lock and a few additions); :meth:`flush` writes the
    counts accumulated since the last flush with one ``history.record`` per key. Redis errors
    never reach the caller: a failed write is kept and retried at the next flush with its own
    sequence number, so one that Redis applied before its reply was lost counts once (the last
    error is in :meth:`status`). :meth:`start` runs flushes every ``flush_interval_s`` in a thread.

    Args:
        history: where to flush (None: local only).
        detector: fed each request's α keyed by (workload, bucket, proposer): the draft's and the
            n-gram proposer's acceptance run at different levels, so one test over both would flag
            the controller switching proposers as a drop. Its alarms come back keyed by
            (workload, bucket), with ``proposer`` set.
        flush_interval_s: background flush period.
        history_name: the workload name written to the store for a key; default
            ``"{workload}@{bucket}"`` so the sampling bucket is visible in every reader.
        head_history: where the requests the feature-level head proposed for are flushed,
            keyed by head version (``AcceptanceHistory(kind="head")``; None: kept in memory only).
            They go to ``history`` too, under the adapter version, as every request does.
        draft_history: where the requests the draft model proposed for are flushed, keyed by
            adapter version (``AcceptanceHistory(kind="draft")``; None: kept in memory only): the
            windows a :class:`RollbackMonitor` with ``merged`` judges an adapter on, every
            replica's summed.
        recent: per-key requests kept for the rolling α.
        clock: seconds since the epoch (history bucket times).
    """

    def __init__(
        self,
        history: AcceptanceHistory | None = None,
        detector: ShiftDetector | None = None,
        *,
        flush_interval_s: float = 5.0,
        history_name: Callable[[str, str], str] = key_str,
        recent: int = 50,
        clock: Callable[[], float] = time.time,
        head_history: AcceptanceHistory | None = None,
        draft_history: AcceptanceHistory | None = None,
    ):
        self.history = history
        self.head_history = head_history
        self.draft_history = draft_history
        self.detector = detector
        self.flush_interval_s = flush_interval_s
        self.history_name = history_name
        self.clock = clock
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str, int], Window] = {}
        self._draft: dict[tuple[str, str, int], Window] = {}  # the requests the draft model proposed for
        self._unflushed: dict[tuple[str, str, int], Window] = {}
        # the requests the feature-level head proposed for, keyed (workload, bucket, head version)
        self._heads: dict[tuple[str, str, int], Window] = {}
        self._unflushed_heads: dict[tuple[str, str, int], Window] = {}
        self._unflushed_draft: dict[tuple[str, str, int], Window] = {}
        self._retry: dict[str, list] = {}  # per unflushed attr: failed writes (key, window, ts, (writer, seq)), oldest first
        self._flush_lock = threading.Lock()
        self._recent: dict[Key, deque[float]] = {}
        self._recent_n = recent
        self.alarms: list[ShiftAlarm] = []
        self.flushes = 0
        self.flush_errors = 0
        self.dropped_windows = 0  # windows whose counts the store refused (not finite): logged, not retried
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self, result, workload: str | None = None) -> ShiftAlarm | None:
        """Add one :class:`decoder.speculative.DecodeResult`; returns a shift alarm if its α
        flags a drop. ``workload`` overrides ``result.workload`` (e.g. an inferred key)."""
        w = workload or result.workload
        k = (w, result.sampling_bucket, int(result.adapter_version))
        with self._lock:
            self._totals.setdefault(k, Window()).add(result.counts)
            proposer = getattr(result, "proposer", None) or DEFAULT_PROPOSER  # DecodeResult's default
            if proposer == DRAFT and result.counts.num_draft_tokens:
                self._draft.setdefault(k, Window()).add(result.counts)
                if self.draft_history is not None:
                    self._unflushed_draft.setdefault(k, Window()).add(result.counts)
            head_v = int(getattr(result, "head_version", 0) or 0)
            if proposer == HEAD and head_v > 0 and result.counts.num_draft_tokens:
                hk = (*k[:2], head_v)
                self._heads.setdefault(hk, Window()).add(result.counts)
                if self.head_history is not None:  # nowhere to flush them otherwise
                    self._unflushed_heads.setdefault(hk, Window()).add(result.counts)
            self._unflushed.setdefault(k, Window()).add(result.counts)
            a = result.counts.alpha
            if a == a:
                self._recent.setdefault(k[:2], deque(maxlen=self._recent_n)).append(a)
            alarm = None
            if self.detector is not None and a == a:
                raw = self.detector.update((*k[:2], proposer), a)
                alarm = dataclasses.replace(raw, key=k[:2], proposer=proposer) if raw is not None else None
            if alarm is not None:
                self.alarms.append(alarm)
        if alarm is not None:
            log.warning("acceptance_shift", key=key_str(*k[:2]), proposer=alarm.proposer, version=k[2],
                        reference_alpha=round(alarm.reference_alpha, 4), recent_alpha=round(alarm.recent_alpha, 4))
        return alarm

    def flush(self) -> int:
        """Write the unflushed counts (adapter history, then head history); returns the keys
        written. Never raises on Redis errors: what failed is kept for the next flush."""
        written = 0
        if self.history is not None:
            written += self._flush_into(self.history, "_unflushed")
        if self.head_history is not None:
            written += self._flush_into(self.head_history, "_unflushed_heads")
        if self.draft_history is not None:
            written += self._flush_into(self.draft_history, "_unflushed_draft")
        if self.history is not None or self.head_history is not None or self.draft_history is not None:
            self.flushes += 1
        return written

    def unflushed(self, proposer: str) -> dict[tuple[str, str, int], Window]:
        """Copies of the windows of ``proposer``'s requests ("draft": by adapter version, "eagle":
        by head version) not yet in the store: unflushed, or held after a failed write. A reader
        of the merged history adds them to see this replica's latest requests too."""
        attr = {DRAFT: "_unflushed_draft", HEAD: "_unflushed_heads"}[proposer]
        out: dict[tuple[str, str, int], Window] = {}
        with self._lock:
            for k, win in list(getattr(self, attr).items()) + [(k, w) for k, w, _, _ in self._retry.get(attr, [])]:
                out.setdefault(k, Window()).merge(win)
        return out

    def _flush_into(self, history: AcceptanceHistory, attr: str) -> int:
        # A write that failed is retried with its own counts, time and seq, before any newer one,
        # never merged into newer counts: its reply may have been lost after Redis applied it, and
        # the history skips a seq it has applied (AcceptanceHistory.record), so it counts once.
        with self._flush_lock:
            with self._lock:
                batch = getattr(self, attr)
                setattr(self, attr, {})
                retry = self._retry.pop(attr, [])
            ts = self.clock()
            writes = retry + [(k, win, ts, None) for k, win in batch.items()]
            written = 0
            failed: list[tuple[tuple[str, str, int], Window, float, tuple[str, int] | None]] = []
            for k, win, wts, seq in writes:
                if failed:  # Redis is down: keep the rest, in order, for the next flush without trying
                    failed.append((k, win, wts, seq))
                    continue
                if seq is None or seq[0] != history.writer:  # a seq numbers one writer's writes only
                    seq = (history.writer, history.next_seq())
                try:
                    history.record(self.history_name(k[0], k[1]), k[2], win.history_counts(), wts, seq=seq[1])
                    written += 1
                except ValueError as e:  # counts no store can take (a broken clock's inf): dropped, never retried
                    self.flush_errors += 1
                    self.dropped_windows += 1
                    self.last_error = str(e)
                    log.error("history_window_dropped", kind=history.kind, key=key_str(k[0], k[1]), version=k[2], error=str(e))
                except (StoreError, redis.RedisError, OSError) as e:
                    failed.append((k, win, wts, seq))
                    self.flush_errors += 1
                    self.last_error = str(e)
                    log.warning("history_flush_failed", kind=history.kind, error=str(e), pending_keys=len(writes) - written)
            if failed:
                with self._lock:
                    self._retry[attr] = failed
            return written

    def start(self) -> "AcceptanceTracker":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="acceptance-flush", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the flush thread after a last flush."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def window(self, workload: str, bucket: str, version: int, *, draft_only: bool = False,
               proposer: str | None = None) -> Window:
        """A copy of the cumulative window of one key (empty if never seen).

        ``draft_only`` (or ``proposer="draft"``): of the key's requests whose proposals came from
        the draft model (not the n-gram proposer or the head, not plain decoding), the only ones
        an adapter version changes; ``version`` is the adapter version. ``proposer="eagle"``: of
        the requests the feature-level head proposed for, and ``version`` is the head version.

        Raises: ValueError for another ``proposer``."""
        src = self._source(proposer, draft_only)
        with self._lock:
            out = Window()
            if (workload, bucket, version) in src:
                out.merge(src[(workload, bucket, version)])
            return out

    def keys(self, proposer: str | None = None) -> list[tuple[str, str, int]]:
        """(workload, bucket, version) of every window; ``proposer="eagle"``: of the head's
        windows, version = head version (``"draft"``: the draft's, adapter version)."""
        src = self._source(proposer, False)
        with self._lock:
            return sorted(src)

    def _source(self, proposer: str | None, draft_only: bool) -> dict:
        if proposer is None:
            return self._draft if draft_only else self._totals
        if proposer == DRAFT:
            return self._draft
        if proposer == HEAD:
            return self._heads
        raise ValueError(f"proposer={proposer!r}: windows are kept for 'draft' and 'eagle' (None: all requests)")

    def rolling_alpha(self, workload: str, bucket: str) -> float:
        """Mean α of the last ``recent`` requests of (workload, bucket), any version (NaN if none)."""
        with self._lock:
            r = self._recent.get((workload, bucket))
            return sum(r) / len(r) if r else math.nan

    def status(self) -> dict[str, Any]:
        with self._lock:
            windows = {f"{key_str(w, b)}/v{v}": win.summary() for (w, b, v), win in sorted(self._totals.items())}
            heads = {f"{key_str(w, b)}/head v{v}": win.summary() for (w, b, v), win in sorted(self._heads.items())}
            rolling = {key_str(*k): nan_none(sum(r) / len(r), 4) for k, r in self._recent.items() if r}
            retrying = sum(len(v) for v in self._retry.values())
            unflushed = len({("_unflushed", k) for k in self._unflushed} | {("_unflushed_heads", k) for k in self._unflushed_heads}
                            | {(attr, w[0]) for attr, ws in self._retry.items() for w in ws})  # keys with counts not yet written
        return {
            "windows": windows,
            "head_windows": heads,
            "rolling_alpha": rolling,
            "unflushed_keys": unflushed,
            "retrying_writes": retrying,
            "flushes": self.flushes,
            "flush_errors": self.flush_errors,
            "dropped_windows": self.dropped_windows,
            "last_error": self.last_error,
            "shift_alarms": [
                {"key": key_str(*a.key), "proposer": a.proposer, "ts": a.ts, "reference_alpha": round(a.reference_alpha, 4),
                 "recent_alpha": round(a.recent_alpha, 4)} for a in self.alarms[-20:]
            ],
        }


# ---- (b) automatic rollback --------------------------------------------------------------------


@dataclass(frozen=True)
class RollbackDecision:
    """The verdict on a promoted version against the one it replaced."""

    version: int
    previous: int
    key: str | None  # the worst (workload@bucket) compared; None when nothing was comparable
    new_value: float
    previous_value: float
    new_requests: int
    previous_requests: int
    rolled_back: bool
    reason: str
    ts: float
    kind: str = "adapter"  # what was judged: "adapter" (the draft's LoRA) or "head" (the feature-level head)


class RollbackMonitor:
    """Rolls back a promoted adapter (or head) whose live acceptance is worse than its predecessor's.

    ``proposer="eagle"`` judges the feature-level head's versions instead, with ``registry`` the
    head registry (kind ``"head"``): ``check`` then takes the head version that served a request
    the head proposed for, and the windows compared are the tracker's head windows (the requests
    the head proposed for, by head version); everything below holds with "adapter" read as
    "head" and "the draft model" as "the head".

    Call :meth:`check` periodically (or after each request) with the decoder's adapter version.
    The monitor notices each new version v serving after a version u; on every
    (workload, bucket) key where the draft model has proposed for >= ``min_requests`` requests
    under both v and u (the tracker's draft-only windows: an adapter changes only the draft, so
    requests the n-gram proposer served or decoded plain say nothing about it, and pooling them
    would compare the n-gram proposer's α under u with the draft's under v), it compares the
    metric; if v's is below u's by more than ``margin``
    on any key, it rolls v back in its own scope (``registry.rollback(reason, scope)``, only
    while v is still that scope's active version) and records the decision. Each key is judged
    once it has that evidence: a version kept on the keys judged so far stays under watch on the
    rest (the key an adapter harms is the one where the controller stops serving the draft, so
    its evidence arrives last, from probes).

    With per-workload adapters the decoder's version changes with each request's workload, so
    pass the request's ``workload`` too: the monitor then follows the versions serving each
    workload separately and judges v on that workload's keys only. Without it, one sequence of
    versions is followed over all keys.

    Only a promotion is judged: within one scope, v newer than u (versions only grow), or a
    workload's own adapter replacing the shared one. A rollback, which brings back an older
    version, is not judged against the version it replaced, and neither is the shared adapter
    when a workload falls back to it from an adapter of its own (its own one was specialised to
    beat it there; rolling the shared one back would hurt every workload).

    metric: ``"alpha"`` (pooled α = 1 - TV over proposed positions; informative even with few
        acceptances) or ``"acceptance_rate"`` (accepted / proposed tokens).
    merged: the store's history of the judged proposer's requests (``AcceptanceHistory(kind=
        "draft")`` for adapters, ``kind="head"`` for heads), which every serving replica's
        tracker flushes into. Given, a version is judged on every replica's requests (the
        history's buckets within its retention, plus this replica's not yet flushed), so N
        replicas reach ``min_requests`` N times sooner and all judge the same evidence; the
        first to decide rolls back, the others find the version no longer active. While Redis
        cannot be read, this replica's own windows are judged. None: this replica's only.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        tracker: AcceptanceTracker,
        *,
        min_requests: int = 20,
        margin: float = 0.1,
        metric: str = "alpha",
        clock: Callable[[], float] = time.time,
        proposer: str = DRAFT,
        merged: AcceptanceHistory | None = None,
    ):
        if metric not in ("alpha", "acceptance_rate"):
            raise ValueError(f"metric={metric!r}: use 'alpha' or 'acceptance_rate'")
        if proposer not in (DRAFT, HEAD):
            raise ValueError(f"proposer={proposer!r}: the monitor judges 'draft' (adapters) or 'eagle' (heads)")
        self.proposer = proposer
        self.kind = "head" if proposer == HEAD else "adapter"
        if getattr(registry, "kind", self.kind) != self.kind:
            raise ValueError(f"proposer={proposer!r} judges {self.kind}s, but the registry holds {registry.kind}s; "
                             f"pass AdapterRegistry(..., kind={self.kind!r})")
        self.registry, self.tracker, self.merged = registry, tracker, merged
        self.min_requests, self.margin, self.metric = min_requests, margin, metric
        self.merged_read_errors = 0  # reads of ``merged`` that failed (this replica's windows judged instead)
        self.clock = clock
        self.decisions: list[RollbackDecision] = []
        # per workload (None = all keys): [current version, previous version]
        self._seen: dict[str | None, list[int | None]] = {}
        self._judged: set[tuple[int, str | None]] = set()  # (version, workload) rolled back: judged for good
        self._judged_keys: dict[tuple[int, str | None], set[str]] = {}  # keys a kept version was judged on
        self._scopes: dict[int, str] = {0: ""}  # version -> its registry scope (never changes)

    def check(self, serving_version: int, workload: str | None = None) -> RollbackDecision | None:
        """Note the version serving now (for ``workload``'s requests, or for all when None);
        judge it if there is enough data. Returns the decision made now (None: nothing to judge
        yet). Redis errors are recorded, never raised."""
        seen = self._seen.setdefault(workload, [None, None])
        if serving_version != seen[0]:
            if seen[0] is not None:
                seen[1] = seen[0]
            seen[0] = serving_version
        v, u = seen
        if u is None or v == 0 or (v, workload) in self._judged:
            return None
        scope_v, scope_u = self._scope(v), self._scope(u)
        if scope_v is None or scope_u is None:
            return None  # unknown for now (Redis down)
        if scope_v == scope_u:
            if v < u:
                return None  # a rollback brought an older version back
        elif not (scope_u == "" and scope_v != ""):
            return None  # a fallback to the shared adapter (or two workloads' versions interleaved)
        worst, judged = None, []
        done = self._judged_keys.setdefault((v, workload), set())
        for key, (n_new, x_new), (n_old, x_old) in self._evidence(v, u, workload):
            if key in done or n_new < self.min_requests or n_old < self.min_requests:
                continue
            if x_new != x_new or x_old != x_old:
                continue
            judged.append(key)
            if worst is None or x_new - x_old < worst[1] - worst[2]:
                worst = (key, x_new, x_old, n_new, n_old)
        if worst is None:
            return None
        key, x_new, x_old, n_new, n_old = worst
        bad = x_new < x_old - self.margin
        if bad:
            self._judged.add((v, workload))
        else:  # kept on these keys; the keys still short of evidence are judged as they reach it
            done.update(judged)
        if bad:
            what = "head " if self.kind == "head" else ""
            reason = (f"auto-rollback: {what}v{v} {self.metric}={x_new:.3f} on {key} over {n_new} requests vs "
                      f"v{u} {x_old:.3f} over {n_old} (margin {self.margin})")
            rolled = self._rollback(v, reason, workload)
            if not rolled[0]:
                reason += f"; not rolled back: {rolled[1]}"
        else:
            what = "head " if self.kind == "head" else ""
            reason = (f"kept: {what}v{v} {self.metric}={x_new:.3f} on {key} vs v{u} {x_old:.3f} "
                      f"(worst key; margin {self.margin})")
            rolled = (False, "")
        d = RollbackDecision(v, u, key, x_new, x_old, n_new, n_old, rolled[0], reason, self.clock(), self.kind)
        self.decisions.append(d)
        event = f"{self.kind}_judged"
        log.warning(event, version=v, previous=u, rolled_back=rolled[0], reason=reason) if bad else \
            log.info(event, version=v, previous=u, rolled_back=False, reason=reason)
        return d

    def _evidence(self, v: int, u: int, workload: str | None):
        """(key, (requests, metric) under ``v``, (requests, metric) under ``u``) for every key
        "workload@bucket" of ``workload`` (None: all) where ``v`` served the judged proposer: from
        the merged history plus this replica's unflushed windows when ``merged`` is set and
        readable, else from this replica's tracker."""
        local = [(w, b) for w, b, ver in self.tracker.keys(self.proposer)
                 if ver == v and (workload is None or w == workload)]
        if self.merged is not None:
            try:
                rows = {ver: self.merged.read(version=ver) for ver in (v, u)}
            except (StoreError, redis.RedisError, OSError) as e:
                self.merged_read_errors += 1
                log.warning("rollback_merged_history_unreadable", kind=self.kind, error=str(e))
            else:
                pending = self.tracker.unflushed(self.proposer)
                names = {key_str(w, b) for w, b in local} | {
                    r.workload for r in rows[v] if workload is None or r.workload.split("@", 1)[0] == workload}
                out = []
                for name in sorted(names):
                    w, _, b = name.partition("@")
                    sides = []
                    for ver in (v, u):
                        mine = pending.get((w, b, ver), Window()).counts
                        theirs = sum_rows([r for r in rows[ver] if r.workload == name])
                        n = theirs.requests + mine.num_requests
                        drafted = theirs.num_draft_tokens + mine.num_draft_tokens
                        top = (theirs.overlap_sum + mine.alpha_sum if self.metric == "alpha"
                               else theirs.num_accepted_tokens + mine.num_accepted_tokens)
                        sides.append((n, top / drafted if drafted else float("nan")))
                    out.append((name, *sides))
                return out
        out = []
        for w, b in local:
            new, old = (self.tracker.window(w, b, v, proposer=self.proposer),
                        self.tracker.window(w, b, u, proposer=self.proposer))
            out.append((key_str(w, b), (new.counts.num_requests, getattr(new.counts, self.metric)),
                        (old.counts.num_requests, getattr(old.counts, self.metric))))
        return out

    def _scope(self, version: int) -> str | None:
        """``version``'s scope ("" = shared; None while the registry cannot say)."""
        if version not in self._scopes:
            try:
                self._scopes[version] = self.registry.get(version).scope
            except UnknownVersionError:
                self._scopes[version] = ""  # not registered here (e.g. loaded by hand): treat as shared
            except (StoreError, redis.RedisError, OSError):
                return None
        return self._scopes[version]

    def _rollback(self, version: int, reason: str, workload: str | None) -> tuple[bool, str]:
        try:
            scope = self._scopes.get(version, "")
            active = self.registry.active_version(scope)
            if active != version:
                where = f"scope {scope!r}" if scope else "the shared scope"
                return False, f"the registry's active version in {where} is now v{active}"
            self.registry.rollback(reason, scope=scope)
            return True, ""
        except InvalidTransitionError as e:
            return False, str(e)
        except (StoreError, redis.RedisError, OSError) as e:
            self._judged.discard((version, workload))  # Redis down: judge again at the next check
            return False, f"registry unreachable: {e}"


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
    useless_alpha: below this α the "off" reason says the draft is useless.
    min_steps: steps of γ = 0 and of γ >= 1 measured before the choice is trusted (warm-up; >= 1).
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
    """

    gamma_max: int = 8
    gamma_init: int = 4
    eagle_gamma_init: int = 1
    ewma: float = 0.1
    probe_every: int = 10
    useless_alpha: float = 0.1
    min_steps: int = 8
    proposers: tuple[str, ...] = (DRAFT,)
    ceiling_probe_every: int = 100
    ceiling_reprobe_s: float = 60.0
    half_life_s: float = 60.0

    def __post_init__(self):
        self.proposers = (self.proposers,) if isinstance(self.proposers, str) else tuple(self.proposers)
        bad = [p for p in self.proposers if p not in REQUEST_PROPOSERS]
        if not self.proposers or bad or len(set(self.proposers)) != len(self.proposers):
            raise ValueError(f"ControllerConfig.proposers={self.proposers!r}: a non-empty list of distinct names "
                             f"from {REQUEST_PROPOSERS}")
        if not 1 <= self.gamma_init <= self.gamma_max or not 1 <= self.eagle_gamma_init <= self.gamma_max:
            raise ValueError(f"gamma_init={self.gamma_init} and eagle_gamma_init={self.eagle_gamma_init} must lie in "
                             f"1..gamma_max={self.gamma_max}")
        if not 0 < self.ewma <= 1:
            raise ValueError(f"ewma={self.ewma} must lie in (0, 1]")
        if self.probe_every < 1 or self.min_steps < 1:  # min_steps 0 trusted estimates that do not exist yet
            raise ValueError(f"probe_every={self.probe_every} and min_steps={self.min_steps} must be >= 1")
        for name in ("ceiling_reprobe_s", "half_life_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:  # NaN too
                raise ValueError(f"{name}={v!r} must be a number of seconds > 0 (math.inf: never)")
        if (not isinstance(self.ceiling_probe_every, int) or isinstance(self.ceiling_probe_every, bool)
                or self.ceiling_probe_every < 1
                or self.ceiling_probe_every % self.probe_every):
            raise ValueError(f"ceiling_probe_every={self.ceiling_probe_every!r} must be a multiple of "
                             f"probe_every={self.probe_every}")


class _Ewma:
    """Exponentially weighted mean; with ``now`` and ``half_life`` (seconds) a measurement after a
    gap weighs at least 1 - 2^(-gap / half_life): the old value ages."""

    __slots__ = ("value", "n", "t")

    def __init__(self):
        self.value, self.n, self.t = math.nan, 0, None

    def add(self, x: float, w: float, now: float | None = None, half_life: float | None = None) -> None:
        if not math.isfinite(x):  # a broken clock reading must not poison the estimate for good
            return
        if now is not None and half_life and self.t is not None and now > self.t:
            w = max(w, 1.0 - 0.5 ** ((now - self.t) / half_life))
        self.value = x if self.n == 0 else (1 - w) * self.value + w * x
        self.n += 1
        if now is not None:
            self.t = now


@dataclass
class _KeyState:
    alpha: _Ewma = field(default_factory=_Ewma)
    draft_ms_per_token: _Ewma = field(default_factory=_Ewma)
    verify_ms: dict[int, _Ewma] = field(default_factory=dict)  # γ -> verify ms of a γ-step (γ=0: plain step)
    overhead_ms: _Ewma = field(default_factory=_Ewma)  # step wall time - draft ms - verify ms
    requests: int = 0
    adapter_version: int | None = None
    head_version: int | None = None
    last: dict[str, Any] = field(default_factory=dict)
    lengths: dict[str, "_LengthModel"] = field(default_factory=dict)  # proposer -> accepted-length model
    ceiling_probes: int = 0  # draft probes in a row while its ceiling was below plain (the back-off's exponent)
    last_ceiling_probe: int = 0  # the request that made the last of them
    last_ceiling_probe_t: float | None = None  # and when (the controller's clock)


@dataclass
class _LengthModel:
    """A proposer modelled by its accepted-prefix lengths, not by α (the n-gram proposer: its
    proposals are all right while a copied span lasts, so acceptance is far from i.i.d.).

    ge[j-1]: EWMA of 1[accepted >= j] over steps that asked for γ >= j, so
    E[tokens per step at γ] = 1 + Σ_{j<=γ} P(accepted >= j) (the bonus or correction token plus the
    accepted prefix); a step with no proposal (no match) counts as accepted 0 at every j.
    step_ms[γ]: EWMA of draft ms + verify ms of steps that asked for γ (what a step with partial
    or no proposals really costs).
    """

    ge: list[_Ewma] = field(default_factory=list)
    step_ms: dict[int, _Ewma] = field(default_factory=dict)
    draft_ms: _Ewma = field(default_factory=_Ewma)
    steps: int = 0

    def observe(self, asked: int, accepted: int, model_ms: float, draft_ms: float, w: float) -> None:
        while len(self.ge) < asked:
            self.ge.append(_Ewma())
        for j in range(1, asked + 1):
            self.ge[j - 1].add(1.0 if accepted >= j else 0.0, w)
        self.step_ms.setdefault(asked, _Ewma()).add(model_ms, w)
        self.draft_ms.add(draft_ms, w)
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
    """

    def __init__(self, config: ControllerConfig | None = None, *, adapter_version: Callable[[], int] | None = None,
                 head_version: Callable[[], int] | None = None,
                 proposer_available: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config or ControllerConfig()
        self.clock = clock
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

    def observe_overhead(self, key: Key, ms: float) -> None:
        """Fold one step's overhead (wall time - draft ms - verify ms: sampling, the acceptance
        test, stop checks, cache crops), which every step pays, plain ones included."""
        with self._lock:
            self._state(key).overhead_ms.add(max(0.0, ms), self.config.ewma)

    def observe(self, key: Key, step: StepStats, step_ms: float | None = None, *, proposer: str = DRAFT,
                asked: int | None = None) -> None:
        """Fold one verification step of ``key`` into the estimates; ``step_ms``, its wall time
        when known, also feeds :meth:`observe_overhead`. ``proposer`` served the step, asked for
        ``asked`` proposals (default: ``step.proposed``); the target's verify cost per γ is shared
        by all proposers."""
        if step_ms is not None:
            self.observe_overhead(key, step_ms - step.draft_ms - step.verify_ms)
        w, now, hl = self.config.ewma, self.clock(), self.config.half_life_s
        with self._lock:
            s = self._state(key)
            g = step.proposed
            s.verify_ms.setdefault(g, _Ewma()).add(step.verify_ms, w, now, hl)
            if proposer != DRAFT:
                asked = g if asked is None else asked
                if asked:
                    s.lengths.setdefault(proposer, _LengthModel()).observe(
                        asked, step.accepted, step.draft_ms + step.verify_ms, step.draft_ms, w)
                return
            if g:
                s.alpha.add(step.alpha_sum / g, w)
                s.draft_ms_per_token.add(step.draft_ms / g, w, now, hl)

    def _verify_cost(self, s: _KeyState, g: int) -> float:
        """t_verify(γ): the per-γ EWMA, else a line through the measured points vs γ + 1."""
        if g in s.verify_ms and s.verify_ms[g].n:
            return s.verify_ms[g].value
        return line_at([(k + 1, e.value) for k, e in s.verify_ms.items() if e.n], g + 1)

    def _evaluate(self, s: _KeyState) -> dict[str, Any]:
        c = self.config
        a = s.alpha.value
        td = s.draft_ms_per_token.value
        o = s.overhead_ms.value if s.overhead_ms.n else 0.0
        tplain = self._verify_cost(s, 0) + o if 0 in s.verify_ms else math.nan
        tv = {g: self._verify_cost(s, g) + o for g in range(1, c.gamma_max + 1)}
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
            for g in range(1, c.gamma_max + 1):
                cost = m.step_ms[g].value + o if g in m.step_ms and m.step_ms[g].n else m.draft_ms.value + tv[g]
                if cost == cost:
                    r[g] = m.tokens_per_step(g) / max(cost, 1e-6)
            others[name] = r
        # the engine's ceiling: any proposer at α = 1 with free proposals, (γ + 1) / t_verify(γ)
        free = {g: (g + 1) / max(tv[g], 1e-6) for g in tv if tv[g] == tv[g] and g in s.verify_ms}
        engine = (max(free, key=free.get), max(free.values())) if free else (None, math.nan)
        return {"alpha": a, "t_draft": td, "t_plain": tplain, "t_verify": tv, "rate": rate, "overhead": o,
                "others": others, "ceiling": ceiling, "engine_ceiling": engine}

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
            s.adapter_version = v
        if self._head_version is not None:
            h = self._head_version()
            if s.head_version is not None and h != s.head_version:
                s.lengths.pop(HEAD, None)  # a new head: its accepted lengths are unknown
            s.head_version = h
        s.requests += 1
        return s

    def offered(self) -> tuple[str, ...]:
        """The configured proposers that can propose now (``proposer_available``), in order."""
        if self._available is None:
            return self.config.proposers
        return tuple(n for n in self.config.proposers if self._available(n))

    def _choose(self, key: Key) -> tuple[int, dict[str, Any]]:
        """γ for the next request of ``key`` and the decision record (called once per request)."""
        if self.config.proposers != (DRAFT,):
            return self._choose_among(key)
        c = self.config
        with self._lock:
            s = self._begin_request(key)
            ev = self._evaluate(s)
            hopeless = self._hopeless(s, ev)
            rate = ev["rate"]
            spec_steps = sum(e.n for g, e in s.verify_ms.items() if g > 0)
            plain_steps = s.verify_ms[0].n if 0 in s.verify_ms else 0
            best = max(rate, key=rate.get) if rate else None
            best_spec = max((g for g in rate if g > 0), key=rate.get, default=None)
            probe = False
            if s.alpha.n == 0 or spec_steps < c.min_steps:
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
            decision = {
                "key": key_str(*key),
                "workload": key[0],
                "sampling": key[1],
                "gamma": gamma,
                "speculate": gamma > 0,
                "probe": probe,
                "best_gamma": best,
                **_estimates(s, ev),
                "tokens_per_ms": {g: nan_none(r, 5) for g, r in sorted(ev["rate"].items())},
                "why": why,
                "proposer": DRAFT,
            }
            s.last = decision
            return gamma, decision

    def _choose_among(self, key: Key) -> tuple[int, dict[str, Any]]:
        """_choose over several proposers: candidates are plain decoding and (proposer, γ) for
        each proposer and γ = 1..γ_max, rated in tokens per ms (the draft by α as in the class
        docstring, a length-modelled proposer by its measured accepted lengths). Warm-up measures
        each proposer in the configured order at ``gamma_init``, then plain decoding. Every
        ``probe_every`` requests one probes, in turn, plain decoding and each proposer other
        than the best at its best γ (so a draft that training improved is noticed)."""
        c = self.config
        with self._lock:
            s = self._begin_request(key)
            ev = self._evaluate(s)
            hopeless = self._hopeless(s, ev)
            cands = self._candidates(ev)
            probe, why = False, ""
            choice = self._warm_up(s)
            if choice is not None:
                choice, why = choice
                probe = True
            best_of = {name: max(((n, g) for (n, g) in cands if n == name), key=cands.get, default=None)
                       for name in c.proposers}
            best = max(cands, key=cands.get) if cands else ("plain", 0)
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
                        why = f"probe: {choice[0]} γ={choice[1]} (every {c.probe_every} requests); " + why
            name, gamma = choice
            decision = {
                "key": key_str(*key),
                "workload": key[0],
                "sampling": key[1],
                "gamma": gamma,
                "proposer": name if gamma else None,
                "speculate": gamma > 0,
                "probe": probe,
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

    def _warm_up(self, s: _KeyState) -> tuple[tuple[str, int], str] | None:
        """The (proposer, γ) still to measure, and why, while a key warms up: each proposer in the
        configured order at ``gamma_init`` for ``min_steps`` steps, then plain decoding; None when
        every candidate is measured."""
        c = self.config
        for name in self.offered():
            if name == DRAFT:
                steps = s.alpha.n and sum(e.n for g, e in s.verify_ms.items() if g > 0)
                cold = s.alpha.n == 0 or steps < c.min_steps
            else:
                m = s.lengths.get(name)
                cold = m is None or m.steps < c.min_steps
            if cold:
                g = c.eagle_gamma_init if name == HEAD else c.gamma_init
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

    @staticmethod
    def _why_among(cands: dict[tuple[str, int], float], best: tuple[str, int], ev: dict[str, Any]) -> str:
        plain = cands.get(("plain", 0), math.nan)
        spec = [k for k in cands if k[1] > 0]
        if best[1] > 0:
            runner = max((k for k in spec if k[0] != best[0]), key=cands.get, default=None)
            also = f"; best {runner[0]} γ={runner[1]} {cands[runner]:.3f}" if runner else ""
            return f"{best[0]} γ={best[1]}: {cands[best]:.3f} tok/ms vs plain {plain:.3f}{also}"
        if not spec:
            return f"off: plain {plain:.3f} tok/ms (no speculative estimate)"
        top = max(spec, key=cands.get)
        why = f"off: plain {plain:.3f} tok/ms beats every proposer (best {top[0]} γ={top[1]} {cands[top]:.3f})"
        g, free = ev.get("engine_ceiling", (None, math.nan))
        if free == free and plain == plain and free < plain:
            why += (f"; no proposer can pay on this engine now: even accepted in full and free, its best, γ={g}, "
                    f"is {free:.3f} tok/ms = {free / plain:.2f}x plain (a verification of {g + 1} rows "
                    f"{ev['t_verify'][g]:.2f} ms, a plain step {ev['t_plain']:.2f} ms)")
        return why

    def _why(self, ev: dict[str, Any], best: int, best_spec: int | None) -> str:
        rate, a = ev["rate"], ev["alpha"]
        if best > 0:
            return f"γ={best}: {rate[best]:.3f} tok/ms vs plain {rate[0]:.3f} (α={a:.2f})"
        if best_spec is None:
            return f"off: plain {rate[0]:.3f} tok/ms (no speculative estimate)"
        label = f"draft useless (α={a:.2f})" if a < self.config.useless_alpha else f"α={a:.2f} too low for its cost"
        why = f"off: {label}: plain {rate[0]:.3f} tok/ms vs best γ={best_spec} {rate[best_spec]:.3f}"
        return why + "; " + self._ceiling_why(ev) if self._draft_cannot_pay(ev) else why

    def decision(self, key: Key) -> dict[str, Any]:
        """The inputs and outcome for ``key`` as they stand now (what the next non-probe request
        would get), plus the last request's decision under ``"last"``; JSON-ready."""
        with self._lock:
            s = self._keys.get(key)
            if s is None:
                return {"key": key_str(*key), "gamma": None, "why": "no requests yet"}
            ev = self._evaluate(s)
            rate = ev["rate"]
            if self.config.proposers != (DRAFT,):
                cands = self._candidates(ev)
                warm = self._warm_up(s)
                best = max(cands, key=cands.get) if cands and warm is None else None
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
                    "last": dict(s.last),
                }
            best = max(rate, key=rate.get) if rate else None
            best_spec = max((g for g in rate if g > 0), key=rate.get, default=None)
            why = self._why(ev, best, best_spec) if best is not None and 0 in rate else "warm-up"
            return {
                "key": key_str(*key),
                "workload": key[0],
                "sampling": key[1],
                "gamma": best,
                "speculate": bool(best),
                **_estimates(s, ev),
                "tokens_per_ms": {g: nan_none(r, 5) for g, r in sorted(rate.items())},
                "why": why,
                "last": dict(s.last),
            }

    def status(self) -> dict[str, Any]:
        """decision() of every key seen, keyed ``"{workload}@{bucket}"``."""
        return {key_str(*k): self.decision(k) for k in list(self._keys)}


class ControlledGamma:
    """The :class:`decoder.speculative.GammaPolicy` of one request under a GoodputController."""

    def __init__(self, controller: GoodputController, key: Key):
        self.controller, self.key = controller, key
        self._gamma: int | None = None
        self._asked: float | None = None  # clock at the last gamma() call (a step starts there)
        self._modelled: float | None = None  # draft_ms + verify_ms of the step just updated
        self.decision: dict[str, Any] | None = None

    def gamma(self) -> int:
        if self._gamma is None:
            self._gamma, self.decision = self.controller._choose(self.key)
        now = self.controller.clock()
        if self._asked is not None and self._modelled is not None:
            # gamma() to gamma(): the whole previous step, loop bookkeeping and cache crops included
            self.controller.observe_overhead(self.key, (now - self._asked) * 1e3 - self._modelled)
        self._asked, self._modelled = now, None
        return self._gamma

    def proposer_name(self) -> str | None:
        """The proposer chosen for this request (after the first :meth:`gamma` call)."""
        return (self.decision or {}).get("proposer") or None

    def update(self, step: StepStats) -> None:
        self._modelled = step.draft_ms + step.verify_ms
        self.controller.observe(self.key, step, proposer=self.proposer_name() or DEFAULT_PROPOSER,
                                asked=step.asked if step.asked is not None else self._gamma)

    def describe(self) -> str:
        return f"goodput γ={self.gamma()} ({self.decision['why']})" if self.decision else "goodput"
