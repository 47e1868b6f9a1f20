"""Acceptance windows on the decoder side: pooled counts per (workload, sampling bucket, adapter
version), kept locally and flushed to the store's :class:`store.AcceptanceHistory` in the
background (every request; apart from it the requests the draft model and the feature-level head
proposed for); the per-request α feeds a :class:`decoder.shift.ShiftDetector`.

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

from decoder.metrics import AcceptanceCounts
from decoder.proposers.registry import DEFAULT_PROPOSER, alpha_modelled, versioned_by
from decoder.shift import ShiftAlarm, ShiftDetector, key_str
from store import AcceptanceHistory, StoreError
from store.jsonsafe import nan_none

DRAFT = alpha_modelled()  # the proposer modelled by α: the key's α, its rates by γ, the speculation ceiling
HEAD = versioned_by("head")  # the proposer whose versions are heads (the head registry)

log = structlog.get_logger("decoder.tracking")

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
            # the verification steps' tokens, as num_steps and wall_ms count them (a first token
            # taken from the prefill is neither a step nor in the decode wall time)
            "num_emitted_tokens": c.num_emitted_tokens - c.num_prefill_tokens,
            "num_steps": c.num_steps,
            "requests": c.num_requests,
            "alpha_sum": self.request_alpha_sum,
            "alpha_count": self.request_alpha_count,
            "overlap_sum": c.alpha_sum,  # Σ over proposed positions of Σ min(p, q): pooled α on read
            # a broken clock's reading (inf, NaN, negative) loses the time, not the window's counts
            "wall_ms": c.decode_ms if math.isfinite(c.decode_ms) and c.decode_ms >= 0 else 0.0,
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
