"""The verified-sample buffer: decoder -> Redis Stream -> trainer, at least once.

One stream, workload as a field
-------------------------------
All workloads share one stream (``P samples``); the workload travels in the clear ``w`` field of
each entry. Reasons: the trainer distils every workload into the same draft adapter and reads
them in one XREADGROUP, so one consumer group and one pending list cover everything; the caps
(MAXLEN by count, lowered to the newest entries that fit in ``max_bytes``; MINID by age) bound the
buffer's memory with one number instead of one per workload; and new workload names need no
discovery step. Per-workload mixing or filtering is the trainer's decision and reads the ``w``
field without decoding the body.

Writer (decoder side): never blocks on Redis
--------------------------------------------
:meth:`SampleWriter.submit` appends to a bounded in-memory deque and returns; a background
thread takes batches, encodes them and sends them in one pipeline of ``XADD ... MAXLEN ~``.
When the queue is full (``queue_size`` samples, or ``queue_max_bytes`` of their arrays: records
with hidden states are 6.5x larger) the *oldest* queued sample is dropped (fresh samples matter
most for online adaptation) and counted: ``dropped_redis_down`` if the writer currently sees Redis down,
else ``dropped_queue_full``. While Redis is down the batch in hand is retried with exponential
backoff, so nothing already taken from the queue is lost; the queue keeps accepting. A retried
pipeline may have partly succeeded, so an entry can appear twice: readers dedupe on record id.

Reader (trainer side): at least once, idempotent
------------------------------------------------
:class:`SampleReader` uses a consumer group (created idempotently with MKSTREAM), drains its own
pending entries (id ``0``) before asking for new ones (``>``), reclaims entries a dead consumer
held with XAUTOCLAIM, and XACKs only when told to (the trainer acks after the adapter trained on
the entries is durably registered). On ack the record ids go into a per-group sorted set
(``P samples:processed:{group}``, remembered ``processed_ttl_s``); later entries carrying an
already-acked record id, or a record id this reader already holds under another entry id, are
acked and skipped (counted as ``duplicates``).

Malformed entries (unknown schema version, undecodable field, model-pair fingerprint mismatch)
are copied to the dead-letter stream ``P samples:dead`` with ``reason``, ``source_id``,
``source_stream``, ``group``, ``consumer``, ``ts``, ``orig_bytes`` (the original entry's size) and
a bounded excerpt of the original fields (prefixed ``orig:``, at most
``dead_letter_excerpt_bytes`` in all, ``truncated`` 1 when cut), and acked on the main stream in
the same MULTI/EXEC. They never raise out of :meth:`read`. So the dead-letter stream holds at most
about ``dead_letter_maxlen`` x (excerpt + 300) bytes, whatever the entries weighed. The trainer
dead-letters records that decode but cannot train (:meth:`SampleReader.dead_letter`) the same way.

Entries trimmed by the caps while still pending come back with no fields; they are acked and
counted as ``trimmed`` (this is the designed loss of a full buffer, and it is counted).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import redis
import structlog

from store.config import StoreConfig, resolve_config
from store.client import REDIS_DOWN as _REDIS_DOWN
from store.client import unavailable as _unavailable
from store.schema import F_FINGERPRINT, F_RECORD_ID, PairFingerprint, SchemaError, VerifiedSample, decode, encode

log = structlog.get_logger(__name__)


def _describe(e: BaseException) -> str:
    """``"ConnectionError: Error 111 connecting to ...: Connection refused."``: the type and the
    message (redis-py 8's ``repr`` of its errors, e.g. ``network:ConnectionError``, drops the message)."""
    return f"{type(e).__name__}: {e}"



def _before_sending(e: BaseException) -> bool:
    """The failure happened while connecting, so no command of the pipeline reached Redis
    (redis-py's connect errors read "Error 111 connecting to ..." / "Timeout connecting to server")."""
    return "connecting to" in str(e)


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriterStats:
    """Counters of a :class:`SampleWriter` (samples, since it was created).

    Invariant once the writer is closed: ``submitted == written + dropped + rejected +
    unconfirmed_on_close``, where ``dropped = dropped_queue_full + dropped_redis_down +
    dropped_error + dropped_on_close``. While running, ``queued`` + ``in_flight`` samples make up
    the difference. ``dropped`` counts only samples that never reached Redis; a batch whose
    pipeline was sent but got no reply (the connection broke after connecting) may have been
    written in part, so at close it counts as ``unconfirmed_on_close``, not as dropped.
    """

    submitted: int  # calls to submit()
    rejected: int  # submit() returned False: writer closed, or not a VerifiedSample
    written: int  # XADDs Redis acknowledged
    dropped_queue_full: int  # oldest queued sample evicted by a new one while Redis was up
    dropped_redis_down: int  # ditto while Redis was down
    dropped_error: int  # encode failed or Redis refused the XADD (e.g. OOM); see last_error
    dropped_on_close: int  # still queued, or in flight and never sent, when close() gave up
    unconfirmed_on_close: int  # in flight when close() gave up, sent at least once without a reply: maybe written
    errors: int  # failed write attempts (each retried batch counts once per attempt)
    queued: int  # in the in-memory queue now
    in_flight: int  # taken by the writer thread, not yet acknowledged by Redis
    redis_up: bool  # the last write attempt reached Redis
    last_error: str | None
    last_error_at: float | None = None  # clock seconds (time.time by default) of ``last_error``
    outages: int = 0  # times the writer found Redis unreachable after reaching it (or at its start)
    down_since: float | None = None  # clock seconds Redis went unreachable; None while it answers
    last_outage: tuple[float, float] | None = None  # (went down, came back) of the last outage that ended

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_redis_down + self.dropped_error + self.dropped_on_close

    def as_dict(self) -> dict:
        d = asdict(self)
        d["dropped"] = self.dropped
        return d


class SampleWriter:
    """Non-blocking writer of :class:`VerifiedSample` records to the buffer stream.

    Usage::

        with SampleWriter(client, cfg) as w:
            w.submit(sample)      # ~µs, never raises, never touches the network

    The background thread starts in the constructor. ``clock`` (seconds) is used for the
    age cap. ``submit`` takes ownership of the sample: do not mutate its arrays afterwards,
    they are encoded later on the writer thread.
    """

    def __init__(self, client: redis.Redis, config: StoreConfig, *, clock: Callable[[], float] = time.time):
        self._client = client
        config = resolve_config(config, client)
        self._cfg = config.buffer
        self._key = config.keys.stream
        self._mean_bytes: float | None = None  # running mean entry size (maxlen)
        # sizes of the newest entries this writer wrote that fit in max_bytes together, oldest first,
        # and their sum; _fits_full once older ones had to leave (then len() is the MAXLEN)
        self._fits: collections.deque[int] = collections.deque()
        self._fits_sum = 0
        self._fits_full = False
        self._clock = clock
        self._q: collections.deque[VerifiedSample] = collections.deque()
        self._q_bytes = 0  # array bytes of the queued samples (queue_max_bytes)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._in_flight = 0
        self._maybe_sent = False  # the batch in flight was sent at least once without a reply
        self._redis_up = True
        self._last_error: str | None = None
        self._last_error_at: float | None = None  # clock seconds of the last error
        self._down_since: float | None = None  # clock seconds Redis went down (None while up)
        self._outages = 0  # times Redis went down
        self._last_outage: tuple[float, float] | None = None  # (down at, back at) of the last one that ended
        self._last_trim = 0.0
        self._n = collections.Counter()
        self._thread = threading.Thread(target=self._run, name="draftd-sample-writer", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------------

    def submit(self, sample: VerifiedSample) -> bool:
        """Queue ``sample`` for writing; O(1), no I/O, never raises.

        Returns:
            True if queued (possibly evicting the oldest queued sample, counted), False if the
            writer is closed or ``sample`` is not a ``VerifiedSample`` (counted as ``rejected``).
        """
        try:
            with self._lock:
                self._n["submitted"] += 1
                if self._closed or not isinstance(sample, VerifiedSample):
                    self._n["rejected"] += 1
                    return False
                self._q.append(sample)
                self._q_bytes += sample.nbytes
                cap = self._cfg.queue_max_bytes
                while len(self._q) > 1 and (len(self._q) > self._cfg.queue_size
                                            or (cap is not None and self._q_bytes > cap)):
                    self._q_bytes -= self._q.popleft().nbytes
                    self._n["dropped_queue_full" if self._redis_up else "dropped_redis_down"] += 1
                full = len(self._q) >= self._cfg.batch_size
            if full:
                self._wake.set()
            return True
        except Exception:  # noqa: BLE001 - the decoder must never see a store error
            return False

    def stats(self) -> WriterStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            n = self._n
            return WriterStats(
                submitted=n["submitted"],
                rejected=n["rejected"],
                written=n["written"],
                dropped_queue_full=n["dropped_queue_full"],
                dropped_redis_down=n["dropped_redis_down"],
                dropped_error=n["dropped_error"],
                dropped_on_close=n["dropped_on_close"],
                unconfirmed_on_close=n["unconfirmed_on_close"],
                errors=n["errors"],
                queued=len(self._q),
                in_flight=self._in_flight,
                redis_up=self._redis_up,
                last_error=self._last_error,
                last_error_at=self._last_error_at,
                outages=self._outages,
                down_since=self._down_since,
                last_outage=self._last_outage,
            )

    def flush(self, timeout: float | None = 5.0) -> bool:
        """Wait until everything submitted so far is written (or dropped). Seconds; None = forever.

        Returns:
            True if the queue drained, False on timeout (e.g. Redis is down).
        """
        self._wake.set()
        with self._cond:
            return self._cond.wait_for(lambda: not self._q and self._in_flight == 0, timeout)

    def close(self, timeout: float = 5.0) -> WriterStats:
        """Stop accepting, flush for up to ``timeout`` s, stop the thread; returns final stats.

        Samples still unwritten after that are counted in ``dropped_on_close``. May block up to
        ``timeout`` plus one Redis socket timeout. Idempotent.
        """
        with self._lock:
            already = self._closed
            self._closed = True
        if not already:
            self.flush(timeout)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout + 1.0)
            if self._thread.is_alive():
                log.warning("sample_writer_thread_still_running", key=self._key)
            with self._lock:
                unsure = self._in_flight if self._maybe_sent else 0
                lost = len(self._q) + self._in_flight - unsure
                self._q.clear()
                self._q_bytes = 0
                self._in_flight = 0
                self._n["dropped_on_close"] += lost
                self._n["unconfirmed_on_close"] += unsure
                self._cond.notify_all()
            if lost or unsure:
                log.warning("sample_writer_closed_with_loss", dropped_on_close=lost, unconfirmed_on_close=unsure,
                            key=self._key)
        return self.stats()

    def __enter__(self) -> "SampleWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer thread ---------------------------------------------------------------------------

    def _take(self) -> list[VerifiedSample]:
        with self._lock:
            k = min(len(self._q), self._cfg.batch_size)
            batch = [self._q.popleft() for _ in range(k)]
            self._q_bytes -= sum(x.nbytes for x in batch)
            self._in_flight = k
            self._maybe_sent = False
            return batch

    def _encode(self, batch: list[VerifiedSample]) -> list[dict[bytes, bytes]]:
        out = []
        for s in batch:
            try:
                out.append(encode(s))
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self._n["dropped_error"] += 1
                    self._in_flight -= 1
                    self._last_error = f"encode failed for record {getattr(s, 'record_id', '?')}: {_describe(e)}"
                    self._last_error_at = self._clock()
                log.error("sample_encode_failed", error=_describe(e))
        return out

    def maxlen(self, entries: list[dict[bytes, bytes]] = ()) -> int:
        """The MAXLEN the next XADDs carry: ``maxlen``, lowered to the number of newest entries
        (``entries`` included) whose bytes (field names and values) fit in ``max_bytes``
        together, counted on the sizes this writer wrote, so the cap holds when sizes shift
        (large records, then small ones: a mean would follow the small new ones while the large
        old ones are still in the stream). Until this writer has written ``max_bytes``, entries
        written before it started are unknown: they are taken at the running mean size. Never
        below 1."""
        max_bytes = self._cfg.max_bytes
        for fields in entries:
            n = sum(len(k) + len(v) for k, v in fields.items())
            self._mean_bytes = n if self._mean_bytes is None else 0.98 * self._mean_bytes + 0.02 * n
            if max_bytes is None:
                continue
            self._fits.append(n)
            self._fits_sum += n
            while len(self._fits) > 1 and (self._fits_sum > max_bytes or len(self._fits) > self._cfg.maxlen):
                self._fits_sum -= self._fits.popleft()
                self._fits_full = True
        cap = self._cfg.maxlen
        if max_bytes is not None and self._mean_bytes:
            fit = len(self._fits) if self._fits_full else max(len(self._fits), int(max_bytes // self._mean_bytes))
            cap = min(cap, max(1, fit))
        return cap

    def _write(self, entries: list[dict[bytes, bytes]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        maxlen = self.maxlen(entries)
        for fields in entries:
            pipe.xadd(self._key, fields, maxlen=maxlen, approximate=True)
        now = self._clock()
        trim = self._cfg.max_age_s is not None and now - self._last_trim >= self._cfg.trim_interval_s
        if trim:
            minid_ms = max(0, int((now - self._cfg.max_age_s) * 1000))
            pipe.xtrim(self._key, minid=f"{minid_ms}-0", approximate=True)
        results = pipe.execute(raise_on_error=False)  # connection errors still raise
        if trim:
            self._last_trim = now
            results = results[:-1]
        refused = [r for r in results if isinstance(r, Exception)]
        with self._lock:
            self._n["written"] += len(results) - len(refused)
            self._n["dropped_error"] += len(refused)
            if refused:
                self._last_error, self._last_error_at = f"Redis refused XADD: {_describe(refused[0])}", self._clock()
            self._in_flight = 0
            self._cond.notify_all()
        if refused:
            log.error("sample_xadd_refused", n=len(refused), error=_describe(refused[0]))

    def _set_up(self, up: bool, error: Exception | None = None) -> None:
        with self._lock:
            changed = up != self._redis_up
            self._redis_up = up
            if changed and not up:
                self._down_since, self._outages = self._clock(), self._outages + 1
            elif changed and self._down_since is not None:
                self._last_outage, self._down_since = (self._down_since, self._clock()), None
            if error is not None:
                self._n["errors"] += 1
                self._last_error, self._last_error_at = _describe(error), self._clock()
        if changed and up:
            log.info("sample_writer_redis_back", key=self._key)
        elif changed:
            log.warning("sample_writer_redis_down", key=self._key, error=_describe(error))

    def _run(self) -> None:
        backoff = self._cfg.backoff_initial_s
        held: list[dict[bytes, bytes]] | None = None
        while not self._stop.is_set():
            if held is None:
                batch = self._take()
                if not batch:
                    with self._cond:
                        self._in_flight = 0
                        self._cond.notify_all()
                    self._wake.wait(self._cfg.flush_interval_s)
                    self._wake.clear()
                    continue
                held = self._encode(batch)
                if not held:
                    held = None
                    with self._cond:
                        self._cond.notify_all()
                    continue
            try:
                self._write(held)
            except _REDIS_DOWN as e:
                if not _before_sending(e):
                    with self._lock:
                        self._maybe_sent = True
                self._set_up(False, e)
                self._stop.wait(backoff)  # the batch is kept and retried; the queue keeps accepting
                backoff = min(backoff * 2, self._cfg.backoff_max_s)
                continue
            except Exception as e:  # noqa: BLE001 - never let the thread die
                with self._lock:
                    self._n["errors"] += 1
                    self._n["dropped_error"] += len(held)
                    self._in_flight = 0
                    self._last_error, self._last_error_at = _describe(e), self._clock()
                    self._cond.notify_all()
                log.error("sample_write_failed", error=_describe(e), dropped=len(held))
                held = None
                continue
            held = None
            backoff = self._cfg.backoff_initial_s
            self._set_up(True)


# --------------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One decoded buffer entry: its stream id (bytes, e.g. ``b"1732870000000-0"``) and sample."""

    entry_id: bytes
    sample: VerifiedSample


@dataclass(frozen=True)
class DeadLetter:
    """One dead-letter entry: why, where from, and the original fields (bytes -> bytes)."""

    entry_id: bytes  # id in the dead-letter stream
    source_id: bytes  # id the entry had in the main stream
    source_stream: str
    reason: str
    group: str
    consumer: str
    ts: float  # when it was dead-lettered, seconds since the epoch
    fields: dict[bytes, bytes]  # a bounded excerpt of the original fields (see ``truncated``)
    orig_bytes: int = -1  # size of the original entry's fields (-1: dead-lettered before it was recorded)
    truncated: bool = False  # ``fields`` was cut to ``dead_letter_excerpt_bytes``


@dataclass(frozen=True)
class GroupInfo:
    """XINFO GROUPS for one consumer group. ``lag`` is None when the server cannot tell."""

    name: str
    consumers: int
    pending: int  # delivered, not yet acked
    lag: int | None  # entries not yet delivered to the group (Redis >= 7.0)
    last_delivered_id: bytes


@dataclass
class ReaderStats:
    """Counters of a :class:`SampleReader` (entries, since it was created)."""

    delivered: int = 0  # returned to the caller by read() / reclaim()
    acked: int = 0  # acked through ack()
    dead_lettered: int = 0
    duplicates: int = 0  # record id already acked, or already held under another entry id
    trimmed: int = 0  # pending entries the caps deleted before they were acked
    reclaimed: int = 0  # entries XAUTOCLAIM moved to this consumer
    consumers_removed: int = 0  # dead consumers prune_consumers() removed from the group


# XINFO CONSUMERS and XGROUP DELCONSUMER in one step, so no entry is delivered to a consumer
# between the check (no pending entries) and its removal. KEYS[1] stream; ARGV group, own name, min idle ms.
_PRUNE_CONSUMERS = """
local removed = {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[2] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed[#removed + 1] = f['name']
  end
end
return removed
"""


class SampleReader:
    """Consumer-group reader of the buffer stream (the trainer side).

    Args:
        client: a ``decode_responses=False`` client (see :func:`store.client.connect`).
        config: store configuration (key prefix, stream name, dedupe retention).
        group: consumer group name, e.g. ``"trainer"``; created if missing.
        consumer: this consumer's name, unique per process, e.g. ``f"trainer-{hostname}-{pid}"``.
        expected_fingerprint: the trainer's model pair (a :class:`PairFingerprint` or its
            ``key()``); entries from another pair are dead-lettered. None accepts any pair.
        start_id: where a newly created group starts: ``"0"`` (everything buffered) or ``"$"``.

    Raises:
        StoreUnavailableError: Redis unreachable (from any method).
    """

    def __init__(
        self,
        client: redis.Redis,
        config: StoreConfig,
        group: str,
        consumer: str,
        *,
        expected_fingerprint: PairFingerprint | str | None = None,
        start_id: str = "0",
        clock: Callable[[], float] = time.time,
    ):
        self._client = client
        config = resolve_config(config, client)
        self._cfg = config
        self._keys = config.keys
        self._key = self._keys.stream
        self.group = group
        self.consumer = consumer
        if isinstance(expected_fingerprint, PairFingerprint):
            expected_fingerprint = expected_fingerprint.key()
        self._expected = expected_fingerprint.encode() if expected_fingerprint else None
        self._clock = clock
        self._pending_cursor: bytes | None = b"0"  # None once our own pending entries are drained
        self._held: dict[bytes, str] = {}  # entry id -> record id, delivered and not yet acked
        self._held_rids: dict[str, bytes] = {}  # record id -> entry id
        self.stats = ReaderStats()
        self.ensure_group(start_id)

    def ensure_group(self, start_id: str = "0") -> bool:
        """Create the consumer group (and the stream) if missing. Returns True if created."""
        with _unavailable(f"creating group {self.group!r} on {self._key!r}"):
            try:
                self._client.xgroup_create(self._key, self.group, id=start_id, mkstream=True)
                return True
            except redis.ResponseError as e:
                if "BUSYGROUP" in str(e):
                    return False
                raise

    def read(self, count: int = 100, block_ms: int | None = None) -> list[Entry]:
        """Up to ``count`` decoded entries: first this consumer's own pending entries (left by
        a previous run of the same consumer name), then new ones.

        ``block_ms``: wait up to that many milliseconds for new entries (None = don't block).
        Malformed entries are dead-lettered and duplicates skipped, so fewer than ``count``
        entries (or none) may come back while more remain; just call again.
        """
        with _unavailable(f"reading {self._key!r} as {self.group}/{self.consumer}"):
            while self._pending_cursor is not None:
                resp = self._client.xreadgroup(self.group, self.consumer, {self._key: self._pending_cursor}, count=count)
                raw = resp[0][1] if resp else []
                if not raw:
                    self._pending_cursor = None
                    break
                self._pending_cursor = raw[-1][0]
                out = self._process(raw)
                if out:
                    return out
            resp = self._client.xreadgroup(self.group, self.consumer, {self._key: ">"}, count=count, block=block_ms)
            raw = resp[0][1] if resp else []
            return self._process(raw)

    def reclaim(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Claim entries idle for at least ``min_idle_ms`` ms in this group (e.g. held by a dead
        consumer) with XAUTOCLAIM, scanning the whole pending list; return them decoded.

        Entries this reader already holds are not returned twice.
        """
        out: list[Entry] = []
        cursor: bytes | str = "0-0"
        with _unavailable(f"reclaiming on {self._key!r} as {self.group}/{self.consumer}"):
            while True:
                resp = self._client.xautoclaim(self._key, self.group, self.consumer, min_idle_ms, start_id=cursor, count=count)
                cursor, raw = resp[0], resp[1]
                deleted = resp[2] if len(resp) > 2 else []
                if deleted:  # pending ids whose entries were trimmed away; XAUTOCLAIM drops them
                    self.stats.trimmed += len(deleted)
                    log.warning("pending_entries_trimmed", n=len(deleted), group=self.group)
                raw = [(eid, f) for eid, f in raw if eid not in self._held]
                self.stats.reclaimed += len(raw)
                out.extend(self._process(raw))
                if cursor in (b"0-0", "0-0"):
                    break
        self.prune_consumers(min_idle_ms)  # the dead consumers, their entries now ours
        return out

    def prune_consumers(self, min_idle_ms: int) -> list[str]:
        """Remove the group's other consumers that hold no pending entry and were idle for at least
        ``min_idle_ms`` ms (a dead trainer's name after its entries were reclaimed), atomically: a
        consumer with pending entries is never removed (XGROUP DELCONSUMER would drop them), and a
        live one that was removed is re-created by its next read. Returns the names removed."""
        with _unavailable(f"pruning consumers of {self.group!r} on {self._key!r}"):
            try:
                removed = self._client.eval(_PRUNE_CONSUMERS, 1, self._key, self.group, self.consumer, int(min_idle_ms))
            except redis.ResponseError as e:
                if "no such key" in str(e).lower() or "nogroup" in str(e).lower():
                    return []
                raise
        names = [_s(n) for n in removed or ()]
        if names:
            self.stats.consumers_removed += len(names)
            log.info("consumers_removed", group=self.group, consumers=names, why="no pending entries, idle "
                     f">= {min_idle_ms} ms (their entries were reclaimed)")
        return names

    def ack(self, entries: Iterable[Entry | bytes | str]) -> int:
        """XACK ``entries`` (Entry objects or stream ids) and remember their record ids as
        processed, in one MULTI/EXEC. Call only after the work on them is durable.

        Returns:
            The number of entries Redis acknowledged (already-acked ones are not counted).
        """
        ids = [e.entry_id if isinstance(e, Entry) else (e.encode() if isinstance(e, str) else e) for e in entries]
        if not ids:
            return 0
        rids = [self._held[i] for i in ids if i in self._held]
        now = self._clock()
        pkey = self._keys.processed(self.group)
        ttl = self._cfg.buffer.processed_ttl_s
        with _unavailable(f"acking {len(ids)} entries on {self._key!r}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.xack(self._key, self.group, *ids)
            if rids:
                pipe.zadd(pkey, {r: now for r in rids})
                pipe.zremrangebyscore(pkey, "-inf", now - ttl)
                pipe.expire(pkey, int(math.ceil(ttl)))
            n = int(pipe.execute()[0])
        for i in ids:
            rid = self._held.pop(i, None)
            if rid is not None and self._held_rids.get(rid) == i:
                del self._held_rids[rid]
        self.stats.acked += n
        return n

    # -- internals -------------------------------------------------------------------------------

    def _check(self, fields: dict[bytes, bytes]) -> VerifiedSample | str:
        """The decoded sample, or the reason it goes to the dead-letter stream."""
        fp = fields.get(F_FINGERPRINT)
        if self._expected is not None:
            if fp is None:
                return "missing field 'fp' (model-pair fingerprint)"
            if fp != self._expected:
                return (
                    f"model-pair fingerprint mismatch: entry has {fp.decode(errors='replace')!r}, this reader "
                    f"expects {self._expected.decode()!r} (record from another target/draft/tokenizer)"
                )
        try:
            sample = decode(fields)
        except SchemaError as e:
            return e.reason
        except Exception as e:  # noqa: BLE001 - decode should only raise SchemaError; be safe
            return f"undecodable entry: {type(e).__name__}: {e}"
        if fp is not None and fp != sample.pair.key().encode():
            return (
                f"fingerprint field {fp.decode(errors='replace')!r} does not match the body's pair "
                f"{sample.pair.key()!r} (corrupt or hand-edited entry)"
            )
        return sample

    def _process(self, raw: list) -> list[Entry]:
        if not raw:
            return []
        good: list[Entry] = []
        dead: list[tuple[bytes, dict[bytes, bytes], str]] = []
        ack_only: list[bytes] = []
        for eid, fields in raw:
            if not fields:  # deleted by XTRIM while pending
                ack_only.append(eid)
                self.stats.trimmed += 1
                continue
            checked = self._check(fields)
            if isinstance(checked, str):
                dead.append((eid, fields, checked))
            else:
                good.append(Entry(eid, checked))
        if good:
            scores = self._client.zmscore(self._keys.processed(self.group), [e.sample.record_id for e in good])
            kept: list[Entry] = []
            for e, score in zip(good, scores):
                rid = e.sample.record_id
                other = self._held_rids.get(rid)
                if other == e.entry_id:  # we already hold this very entry (e.g. reclaimed our own)
                    continue
                if score is not None or other is not None:
                    ack_only.append(e.entry_id)
                    self.stats.duplicates += 1
                    continue
                self._held[e.entry_id] = rid
                self._held_rids[rid] = e.entry_id
                kept.append(e)
            good = kept
        if dead or ack_only:
            self._dead_letter(dead, ack_only)
        self.stats.delivered += len(good)
        return good

    def dead_letter(self, entries: Iterable[tuple[Entry, str]]) -> int:
        """Move delivered entries that cannot be used (e.g. a token id beyond the trainer's
        vocabulary) to the dead-letter stream with their reasons, and XACK them, in one MULTI/EXEC.
        Returns how many."""
        dead = []
        for e, reason in entries:
            try:
                fields = encode(e.sample)
            except Exception:  # noqa: BLE001 - the reason is what matters; keep the id
                fields = {F_RECORD_ID: e.sample.record_id.encode(errors="replace")}
            dead.append((e.entry_id, fields, reason))
        if not dead:
            return 0
        with _unavailable(f"dead-lettering {len(dead)} entries on {self._key!r}"):
            self._dead_letter(dead, [])
        for eid, _, _ in dead:
            rid = self._held.pop(eid, None)
            if rid is not None and self._held_rids.get(rid) == eid:
                del self._held_rids[rid]
        return len(dead)

    def _excerpt(self, fields: dict[bytes, bytes]) -> tuple[dict[bytes, bytes], int, bool]:
        """A bounded copy of ``fields`` (``orig:`` prefixed): small routing fields first, each value
        cut to what is left of ``dead_letter_excerpt_bytes``. Returns (fields, original bytes, cut)."""
        budget = self._cfg.buffer.dead_letter_excerpt_bytes
        total = sum(len(k) + len(v) for k, v in fields.items())
        out, cut = {}, False
        for k, v in sorted(fields.items(), key=lambda kv: len(kv[1])):
            k = k.encode() if isinstance(k, str) else k
            part = v[: max(0, budget)]
            cut |= len(part) < len(v)
            budget -= len(part)
            out[b"orig:" + k[:64]] = part
        return out, total, cut

    def _dead_letter(self, dead: list[tuple[bytes, dict[bytes, bytes], str]], ack_only: list[bytes]) -> None:
        now = self._clock()
        maxlen = self._cfg.buffer.dead_letter_maxlen
        pipe = self._client.pipeline(transaction=True)
        for eid, fields, reason in dead:
            excerpt, total, cut = self._excerpt(fields)
            entry = {
                b"reason": reason.encode("utf-8")[:2048],
                b"source_id": eid,
                b"source_stream": self._key.encode(),
                b"group": self.group.encode(),
                b"consumer": self.consumer.encode(),
                b"ts": repr(now).encode(),
                b"orig_bytes": str(total).encode(),
                b"truncated": b"1" if cut else b"0",
                **excerpt,
            }
            pipe.xadd(self._keys.dead_letter, entry, maxlen=maxlen, approximate=True)
        ids = [eid for eid, _, _ in dead] + ack_only
        pipe.xack(self._key, self.group, *ids)
        pipe.execute()
        for eid, fields, reason in dead:
            log.warning(
                "sample_dead_lettered",
                entry_id=eid.decode(),
                reason=reason,
                record_id=fields.get(F_RECORD_ID, b"?")[:64].decode(errors="replace"),
            )
        self.stats.dead_lettered += len(dead)


# --------------------------------------------------------------------------------------------
# Operator helpers
# --------------------------------------------------------------------------------------------


def stream_depth(client: redis.Redis, config: StoreConfig) -> int:
    """Entries in the buffer stream now (XLEN), acked or not."""
    with _unavailable("XLEN"):
        return int(client.xlen(resolve_config(config, client).keys.stream))


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def group_info(client: redis.Redis, config: StoreConfig) -> list[GroupInfo]:
    """Consumer groups of the buffer stream with pending count and lag (XINFO GROUPS)."""
    with _unavailable("XINFO GROUPS"):
        try:
            groups = client.xinfo_groups(resolve_config(config, client).keys.stream)
        except redis.ResponseError as e:
            if "no such key" in str(e).lower():
                return []
            raise
    out = []
    for g in groups:
        g = {_s(k): v for k, v in g.items()}
        lag = g.get("lag")
        last = g.get("last-delivered-id", b"")
        out.append(
            GroupInfo(
                name=_s(g["name"]),
                consumers=int(g.get("consumers", 0)),
                pending=int(g.get("pending", 0)),
                lag=None if lag is None else int(lag),
                last_delivered_id=last if isinstance(last, bytes) else str(last).encode(),
            )
        )
    return out


def reclaimable_count(client: redis.Redis, config: StoreConfig, group: str, min_idle_ms: int,
                      exclude_consumer: str | None = None, limit: int = 10_000) -> int:
    """Pending entries of ``group`` idle for at least ``min_idle_ms`` ms and held by a consumer other
    than ``exclude_consumer``: what :meth:`SampleReader.reclaim` would take over (a dead consumer's),
    counted up to ``limit`` (XPENDING IDLE)."""
    with _unavailable("XPENDING"):
        try:
            rows = client.xpending_range(resolve_config(config, client).keys.stream, group, min="-", max="+", count=limit, idle=int(min_idle_ms))
        except redis.ResponseError as e:
            if "no such key" in str(e).lower() or "nogroup" in str(e).lower():
                return 0
            raise
    return sum(1 for r in rows if exclude_consumer is None or _s(r.get("consumer", b"")) != exclude_consumer)


def dead_letter_count(client: redis.Redis, config: StoreConfig) -> int:
    """Entries in the dead-letter stream now (XLEN)."""
    with _unavailable("XLEN dead-letter"):
        return int(client.xlen(resolve_config(config, client).keys.dead_letter))


def list_dead_letters(client: redis.Redis, config: StoreConfig, count: int = 100, start: str = "-") -> list[DeadLetter]:
    """Up to ``count`` dead-letter entries from stream id ``start`` on, oldest first."""
    with _unavailable("XRANGE dead-letter"):
        raw = client.xrange(resolve_config(config, client).keys.dead_letter, min=start, max="+", count=count)
    out = []
    for eid, f in raw:
        out.append(
            DeadLetter(
                entry_id=eid,
                source_id=f.get(b"source_id", b""),
                source_stream=f.get(b"source_stream", b"").decode(),
                reason=f.get(b"reason", b"").decode("utf-8", errors="replace"),
                group=f.get(b"group", b"").decode(),
                consumer=f.get(b"consumer", b"").decode(),
                ts=float(f.get(b"ts", b"nan")),
                fields={k[len(b"orig:"):]: v for k, v in f.items() if k.startswith(b"orig:")},
                orig_bytes=int(f.get(b"orig_bytes", b"-1")),
                truncated=f.get(b"truncated") == b"1",
            )
        )
    return out
