"""Acceptance history: time-bucketed counts per (workload, adapter version), and apart from it
per (workload, head version) for the requests the feature-level head proposed for
(``AcceptanceHistory(kind="head")``: keys ``P head:hist:...``, the same layout), and per
(workload, adapter version) for the requests the draft model proposed for (``kind="draft"``: keys
``P draft:hist:...``; the windows an adapter's rollback is judged on, summed over every replica).

Counts are stored, rates are derived on read (each rate's definition is on the property that
computes it; NaN when its denominator is 0). Counter names follow vLLM's spec-decode metrics:

- ``num_drafts``: verification steps that had a draft proposal (γ > 0)
- ``num_draft_tokens``: tokens the draft proposed (sum of γ over steps)
- ``num_accepted_tokens``: proposed tokens the target accepted
- ``num_emitted_tokens``: tokens emitted (accepted + corrections + bonus tokens)
- ``num_steps``: verification steps (target forwards)
- ``alpha_sum``, ``alpha_count``: sum and number of per-request α values (float), for mean α
- ``overlap_sum``: Σ over proposed positions of Σ_x min(p, q) (float), for α pooled over positions
  (``pooled_alpha``; rows written by builds before it read 0)
- ``wall_ms``: decode wall time, milliseconds (float)
- ``requests``: requests (or chunks) recorded

Storage: one hash per (workload, version, bucket) at ``P hist:{version}:{bucket}:{workload}``
(``bucket`` = bucket start in integer seconds), updated with HINCRBY / HINCRBYFLOAT in one Lua
script and given a TTL of ``retention_s``; a sorted set ``P hist:index`` holds
``"{bucket}|{version}|{workload}"`` scored by bucket start, trimmed to the retention window on
every write. Writes are counted once: each :class:`AcceptanceHistory` is a writer with its own
id, each write carries a sequence number, and the script skips a write whose number is not above
the last one it applied for that writer, workload and version (``P hist:applied:{writer}``, one
field per workload and version, the same TTL). redis-py resends a call whose reply timed out,
and a caller retries after StoreUnavailableError; either would otherwise add the counts twice. Workload names are UTF-8 and may contain any character (the workload is the last
``|``-separated part of an index member, so it is parsed unambiguously).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import redis
import structlog

from store.client import unavailable as _unavailable
from store.config import StoreConfig, resolve_config

INT_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_steps", "alpha_count", "requests")
FLOAT_COUNTS = ("alpha_sum", "wall_ms", "overlap_sum")
COUNTS = INT_COUNTS + FLOAT_COUNTS
DRAFT_KIND = "draft"  # the kind of the requests the draft model proposed for
KINDS = ("adapter", "head", DRAFT_KIND)

log = structlog.get_logger(__name__)

# KEYS: bucket hash, index, the writer's applied hash. ARGV: retention_s, index member, bucket,
# trim-before, applied field, seq, then (i|f, counter, value) triples. Returns 1 if applied, 0 if
# this writer's seq for the field was applied already (a resent or retried write), -1 (writing
# nothing) if a counter would leave the range Redis keeps (a 64-bit integer, a finite float): a
# script that fails half way keeps its first writes, so every check runs before any write.
_RECORD = """
local last = redis.call('HGET', KEYS[3], ARGV[5])
if last and tonumber(last) >= tonumber(ARGV[6]) then return 0 end
for i = 7, #ARGV, 3 do
  local v = tonumber(redis.call('HGET', KEYS[1], ARGV[i + 1]) or '0') + tonumber(ARGV[i + 2])
  if v ~= v or v >= 9.2e18 or v <= -9.2e18 then return -1 end
end
for i = 7, #ARGV, 3 do
  if ARGV[i] == 'i' then redis.call('HINCRBY', KEYS[1], ARGV[i + 1], ARGV[i + 2])
  else redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i + 1], ARGV[i + 2]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
redis.call('HSET', KEYS[3], ARGV[5], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[1])
return 1
"""


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


@dataclass(frozen=True)
class HistoryRow:
    """Counts of one bucket (or an aggregate of several), with rates derived on read.

    ``ts`` is the bucket start (seconds since the epoch); for :meth:`AcceptanceHistory.totals`
    it is the first bucket's start and ``workload`` / ``version`` are None when mixed.
    """

    ts: float
    workload: str | None
    version: int | None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_steps: int = 0
    alpha_count: int = 0
    requests: int = 0
    alpha_sum: float = 0.0
    wall_ms: float = 0.0
    overlap_sum: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens: fraction of proposed tokens the target accepted."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def tau(self) -> float:
        """τ = num_emitted_tokens / num_steps: mean tokens emitted per verification step,
        i.e. mean accepted length *including* the correction or bonus token."""
        return _ratio(self.num_emitted_tokens, self.num_steps)

    @property
    def alpha(self) -> float:
        """α = alpha_sum / alpha_count: mean of the per-request α values recorded."""
        return _ratio(self.alpha_sum, self.alpha_count)

    @property
    def pooled_alpha(self) -> float:
        """α pooled over proposed positions = overlap_sum / num_draft_tokens, the mean over
        positions of Σ_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al. 2023, §3.1 and Definition
        3.1); :class:`decoder.metrics.AcceptanceCounts`'s ``alpha``."""
        return _ratio(self.overlap_sum, self.num_draft_tokens)

    @property
    def goodput(self) -> float:
        """Goodput: num_emitted_tokens / wall_ms, emitted tokens per ms of decoding (the decoder's and
        the goodput controller's unit, ``AcceptanceCounts.goodput``)."""
        return _ratio(self.num_emitted_tokens, self.wall_ms)

    def counts(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in COUNTS}


class AcceptanceHistory:
    """Writes and reads time-bucketed acceptance counts.

    Args:
        client: a ``decode_responses=False`` client.
        config: ``config.history.bucket_s`` (bucket width, s) and ``retention_s``.
        clock: seconds since the epoch, the default ``ts`` of :meth:`record` and the retention cut.
        kind: what ``version`` counts: ``"adapter"`` (the draft's LoRA version; every request is
            recorded under the one that served it), ``"head"`` (the feature-level head's
            version; only the requests it proposed for) or ``"draft"`` (the adapter version; only
            the requests the draft model proposed for, which an adapter changes). The kinds are
            kept apart, so a reader summing one kind's rows never counts a request twice.

    Raises (any method): StoreUnavailableError when Redis is unreachable; ValueError for an
    unknown ``kind``.
    """

    def __init__(self, client: redis.Redis, config: StoreConfig, *, clock: Callable[[], float] = time.time,
                 kind: str = "adapter"):
        if kind not in KINDS:
            raise ValueError(f"history kind {kind!r}: use one of {KINDS}")
        self._client = client
        config = resolve_config(config, client)
        self._config = config
        self.kind = kind
        self._keys = dataclasses.replace(config.keys, kind=kind)
        self.bucket_s = config.history.bucket_s
        self.retention_s = config.history.retention_s
        self._clock = clock
        self.writer = uuid.uuid4().hex  # this instance's writes are deduplicated under it
        self._seq = 0  # the highest seq handed out or written
        self._seq_lock = threading.Lock()
        self._write_lock = threading.Lock()  # a call without seq takes its number and writes under it
        self._record = client.register_script(_RECORD)

    def of_kind(self, kind: str) -> "AcceptanceHistory":
        """The history of ``kind`` on the same Redis, configuration and clock."""
        return AcceptanceHistory(self._client, self._config, clock=self._clock, kind=kind)

    def bucket_of(self, ts: float) -> int:
        """Start (integer seconds) of the bucket holding ``ts``."""
        return int(math.floor(ts / self.bucket_s)) * self.bucket_s

    def next_seq(self) -> int:
        """A new sequence number of this writer (for :meth:`record`'s ``seq``): above every one
        handed out or written so far."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def record(self, workload: str, version: int, counts: Mapping[str, float], ts: float | None = None,
               *, seq: int | None = None) -> bool:
        """Add ``counts`` to the bucket of ``ts`` (default now) for (``workload``, ``version``),
        at most once per ``seq``.

        One round trip (a Lua script); synchronous (callers on a latency-critical path should
        aggregate locally and record from a background task). ``seq`` (from :meth:`next_seq`;
        None: a new one) numbers the write: a write whose seq is not above the last this writer
        applied for (``workload``, ``version``) is skipped, so the same write retried after an
        error whose reply was lost counts once. A caller that retries must retry its oldest
        unapplied write for a key before any newer one, and give one seq to one thread at a time:
        a higher seq that lands first makes a lower one a skip. Calls without ``seq`` are safe
        from any thread (each takes its number and writes under one lock). A seq numbers this
        writer's writes only: another AcceptanceHistory is another writer.

        Returns: True if applied, False if this seq (or a later one) was applied already.

        Raises:
            ValueError: an unknown counter name, a non-integer value for an integer counter, a
                negative or non-finite value, a non-finite ``ts``, an empty workload name, a ``seq`` outside 1..2**53
                (the script compares them as doubles), or a counter that would leave what Redis
                keeps (a 64-bit integer; nothing is written then); the message names the
                offending key.
            StoreUnavailableError: Redis unreachable (the write may or may not have been applied:
                retry it with the same ``seq``).
        """
        unknown = sorted(set(counts) - set(COUNTS))
        if unknown:
            raise ValueError(f"unknown history counters {unknown}; known: {list(COUNTS)}")
        bad = {k: v for k, v in counts.items() if not math.isfinite(float(v))}
        if bad:  # HINCRBYFLOAT refuses them, and a script that fails half way keeps its first writes
            raise ValueError(f"history counters must be finite numbers, got {bad} for {workload!r} v{version}")
        if not workload:
            raise ValueError("workload name is empty; pass the request's workload tag")
        neg = {k: v for k, v in counts.items() if float(v) < 0}
        if neg:  # every counter is a count or a sum of non-negative terms: a negative one is a caller's bug
            raise ValueError(f"history counters must be >= 0, got {neg} for {workload!r} v{version}")
        args: list = []
        for name, value in counts.items():
            if name in INT_COUNTS:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError(f"counter {name!r} must be an integer, got {value!r}")
                if abs(int(value)) >= 2**63:
                    raise ValueError(f"counter {name!r} = {int(value)} is outside a 64-bit integer")
                if int(value):
                    args += ["i", name, int(value)]
            elif value:
                args += ["f", name, repr(float(value))]
        if seq is not None and not (isinstance(seq, int) and not isinstance(seq, bool) and 1 <= seq <= 2**53):
            raise ValueError(f"seq={seq!r} must be an int in 1..2**53 (from next_seq())")
        ts = self._clock() if ts is None else ts
        if not math.isfinite(float(ts)):
            raise ValueError(f"ts={ts!r} is not a finite time (seconds since the epoch); is the clock broken?")
        bucket = self.bucket_of(ts)
        key = self._keys.history_bucket(workload, version, bucket)
        member = f"{bucket}|{int(version)}|{workload}".encode("utf-8")
        applied = self._keys.history_applied(self.writer)

        def write(n: int) -> int:
            with _unavailable(f"recording history for {workload!r} v{version}"):
                return int(self._record(
                    keys=[key, self._keys.history_index, applied],
                    args=[int(self.retention_s), member, bucket, repr(float(self._clock() - self.retention_s)),
                          f"{int(version)}|{workload}".encode("utf-8"), n, *args]))

        if seq is None:
            with self._write_lock:
                done = write(self.next_seq())
        else:
            with self._seq_lock:
                self._seq = max(self._seq, seq)
            done = write(seq)
        if done < 0:
            raise ValueError(f"history counters {dict(counts)} would overflow the stored counts of {workload!r} "
                             f"v{version} (a 64-bit integer or a finite float); nothing was written")
        return bool(done)

    def read(
        self,
        workload: str | None = None,
        version: int | None = None,
        start: float | None = None,
        end: float | None = None,
    ) -> list[HistoryRow]:
        """Buckets overlapping the window [``start``, ``end``] (seconds since the epoch; None =
        unbounded), i.e. with bucket start in [bucket_of(start), end], filtered by ``workload``
        and ``version`` when given, sorted by (ts, workload, version). An entry :meth:`record`
        did not write (an index member that is not ``bucket|version|workload``, a count that is
        not a number) is left out with a ``history_entry_unreadable`` warning naming its key and
        the command that removes it."""
        lo = "-inf" if start is None else self.bucket_of(start)
        hi = "+inf" if end is None else end
        with _unavailable("reading history index"):
            members = self._client.zrangebyscore(self._keys.history_index, lo, hi)
        wanted = []
        for m in members:
            try:  # UnicodeDecodeError is a ValueError
                b, v, w = m.decode("utf-8").split("|", 2)
                bucket, ver = int(b), int(v)
            except ValueError as e:  # not written by record(): left out, never every reader's error
                entry = m.decode("utf-8", "replace")
                log.warning("history_entry_unreadable", key=self._keys.history_index, entry=entry, error=str(e),
                            fix=f"ZREM {self._keys.history_index} {entry!r}")
                continue
            if (workload is None or w == workload) and (version is None or ver == version):
                wanted.append((bucket, ver, w))
        if not wanted:
            return []
        with _unavailable("reading history buckets"):
            pipe = self._client.pipeline(transaction=False)
            for b, v, w in wanted:
                pipe.hgetall(self._keys.history_bucket(w, v, b))
            hashes = pipe.execute()
        rows = []
        for (b, v, w), h in zip(wanted, hashes):
            if not h:  # expired since the index was trimmed
                continue
            try:
                vals = {k.decode(): x for k, x in h.items()}
                rows.append(
                    HistoryRow(
                        ts=float(b),
                        workload=w,
                        version=v,
                        **{n: int(vals.get(n, 0)) for n in INT_COUNTS},
                        **{n: float(vals.get(n, 0.0)) for n in FLOAT_COUNTS},
                    )
                )
            except ValueError as e:  # a count that is not a number (written by hand): the bucket is left out
                key = self._keys.history_bucket(w, v, b).decode("utf-8", "replace")
                log.warning("history_entry_unreadable", key=key, entry=f"{w} v{v} bucket {b}", error=str(e),
                            fix=f"DEL {key!r}")
        rows.sort(key=lambda r: (r.ts, r.workload, r.version))
        return rows

    def totals(
        self,
        workload: str | None = None,
        version: int | None = None,
        start: float | None = None,
        end: float | None = None,
    ) -> HistoryRow:
        """Sum of :meth:`read`'s rows over the window; rates derived from the summed counts.

        An empty window gives a row of zeros (rates NaN) with ``ts = start`` (or NaN).
        """
        rows = self.read(workload, version, start, end)
        ws = {r.workload for r in rows}
        vs = {r.version for r in rows}
        return sum_rows(rows, ws.pop() if len(ws) == 1 else workload, vs.pop() if len(vs) == 1 else version,
                        empty_ts=math.nan if start is None else float(start))


def sum_rows(rows: list[HistoryRow], workload: str | None = None, version: int | None = None,
             empty_ts: float = math.nan) -> HistoryRow:
    """The counts of ``rows`` added up, labelled ``workload`` and ``version``; rates derived from
    the sums. ``ts`` is the first row's, ``empty_ts`` when there are none."""
    sums: dict[str, float] = {n: 0 for n in INT_COUNTS} | {n: 0.0 for n in FLOAT_COUNTS}
    for r in rows:
        for n in COUNTS:
            sums[n] += getattr(r, n)
    return HistoryRow(ts=rows[0].ts if rows else empty_ts, workload=workload, version=version, **sums)

