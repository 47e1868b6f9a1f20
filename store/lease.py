"""One holder at a time: a lease in Redis with a fencing token (the trainer's leader election).

Several ``daemonctl run`` may start against one Redis; one holds the lease and trains, the
others stand by. The lease is one key holding ``"<token> <holder>"``, set with ``SET NX PX``
(it expires by itself ``ttl_s`` after the holder's last renewal, so a dead holder's lease is
free within ``ttl_s``), and renewed every ``ttl_s / 3`` by the holder only (compare-and-PEXPIRE in
one script). Each acquisition takes a new **fencing token** from ``INCR`` on a counter beside
the lease: strictly increasing, never reused. The holder writes the registry with its token
(:attr:`store.registry.AdapterRegistry.fencing_token`); the registry remembers the highest
token it has seen and refuses a lower one, so a holder that lost its lease (paused, partitioned,
its renewals late) can never register or promote after the next holder announced itself
(:meth:`~store.registry.AdapterRegistry.fence`).

Keys (``P`` = ``key_prefix``; one slot with hash tags)::

    P lease:{name}            string "<token> <holder>", PX ttl       (tagged: P{lease:{name}})
    P lease:{name}:token      INCR counter of fencing tokens           (tagged: P{lease:{name}}:token)

Takeover time: a standby polls every ``poll_s`` (default ``ttl_s / 3``), so it holds the lease at
most ``ttl_s + poll_s`` after the holder's last renewal, plus a Redis round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
import structlog

from store.client import REDIS_DOWN
from store.config import StoreConfig, resolve_config

log = structlog.get_logger(__name__)

# KEYS: lease, token counter. ARGV: holder, ttl ms. Returns the new token, the holder's own token
# when it already holds the lease (its ttl renewed), or 0 when another holds it.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local sp = string.find(cur, ' ', 1, true)
  if sp and string.sub(cur, sp + 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(string.sub(cur, 1, sp - 1))
  end
  return 0
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1], 'PX', ARGV[2])
return token
"""

# KEYS: lease. ARGV: "<token> <holder>", ttl ms (0 = release). 1 if it was ours, else 0.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
"""


def lease_keys(config: StoreConfig, name: str) -> tuple[str, str]:
    root = f"{config.key_prefix}{{lease:{name}}}" if config.hash_tags else f"{config.key_prefix}lease:{name}"
    return root, f"{root}:token"


@dataclass(frozen=True)
class LeaseHolder:
    token: int
    holder: str
    ttl_ms: int  # what is left of it


class Lease:
    """The lease ``name`` for ``holder`` (unique per process, e.g. ``hostname-pid``).

    Raises (any method): redis errors when Redis is unreachable (the caller decides; see
    :class:`Leadership`)."""

    def __init__(self, client: redis.Redis, config: StoreConfig, holder: str, *, name: str = "trainer",
                 ttl_s: float = 10.0):
        if not holder or " " in holder:
            raise ValueError(f"lease holder {holder!r} must be a non-empty name without spaces, e.g. 'host-1234'")
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s={ttl_s!r} must be > 0 seconds (e.g. 10)")
        self._client = client
        self.name = name
        self.holder = holder
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.key, self.token_key = lease_keys(resolve_config(config, client), name)
        self.token = 0  # ours while we hold it
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)

    def try_acquire(self) -> int:
        """Take the lease if it is free (or already ours, then renewed); returns our fencing token,
        0 when another holder has it."""
        self.token = int(self._acquire(keys=[self.key, self.token_key], args=[self.holder, self.ttl_ms]))
        return self.token

    def renew(self) -> bool:
        """Extend our lease by ``ttl_s``; False when it is no longer ours (expired, taken)."""
        if not self.token:
            return False
        ok = bool(self._renew(keys=[self.key], args=[f"{self.token} {self.holder}", self.ttl_ms]))
        if not ok:
            self.token = 0
        return ok

    def release(self) -> bool:
        """Give the lease up if it is ours (a standby takes it at its next poll)."""
        if not self.token:
            return False
        ok = bool(self._renew(keys=[self.key], args=[f"{self.token} {self.holder}", 0]))
        self.token = 0
        return ok

    def current(self) -> LeaseHolder | None:
        """Who holds the lease now (None: nobody)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.get(self.key)
        pipe.pttl(self.key)
        raw, ttl = pipe.execute()
        if raw is None:
            return None
        token, _, holder = raw.decode("utf-8", errors="replace").partition(" ")
        return LeaseHolder(int(token), holder, int(ttl))


class Leadership:
    """Keeps ``lease`` from a background thread: acquires it when free, renews it every
    ``ttl_s / 3``, and calls ``on_acquire(token)`` / ``on_lose(why)`` on the transitions (from
    that thread). A holder that cannot reach Redis to renew for ``ttl_s`` minus one renewal period
    gives the lease up locally (``on_lose``) before it can have expired on the server, so at most
    one process believes it leads at any time (clocks drifting less than that margin); the
    fencing token covers what remains (a process paused past its lease).
    """

    def __init__(self, lease: Lease, on_acquire: Callable[[int], None] = lambda t: None,
                 on_lose: Callable[[str], None] = lambda why: None, *, poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.lease = lease
        self.on_acquire = on_acquire
        self.on_lose = on_lose
        self.ttl_s = lease.ttl_ms / 1000
        self.poll_s = poll_s if poll_s is not None else self.ttl_s / 3
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed_at = 0.0
        self.token = 0  # > 0 while we lead
        self.acquired_at: float | None = None
        self.last_error: str | None = None

    @property
    def leading(self) -> bool:
        return self.token > 0

    def step(self) -> None:
        """One poll: renew (leader) or try to acquire (standby). Never raises."""
        now = self._clock()
        try:
            if self.token:
                if self.lease.renew():
                    self._renewed_at = now
                else:
                    self._lose("the lease expired or another holder took it")
            else:
                token = self.lease.try_acquire()
                if token:
                    self.token, self._renewed_at, self.acquired_at = token, now, time.time()
                    log.info("lease_acquired", lease=self.lease.name, holder=self.lease.holder, token=token)
                    self.on_acquire(token)
            self.last_error = None
        except REDIS_DOWN as e:
            self.last_error = f"{type(e).__name__}: {e}"
            if self.token and now - self._renewed_at >= self.ttl_s - self.poll_s:
                self._lose(f"Redis unreachable for {now - self._renewed_at:.1f} s ({self.last_error}): the lease "
                           f"may have expired on the server")
        except Exception as e:  # noqa: BLE001 - the thread must survive a callback's failure
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("lease_step_failed", lease=self.lease.name)

    def _lose(self, why: str) -> None:
        token, self.token, self.acquired_at = self.token, 0, None
        self.lease.token = 0
        log.warning("lease_lost", lease=self.lease.name, holder=self.lease.holder, token=token, why=why)
        self.on_lose(why)

    def start(self) -> "Leadership":
        self.step()
        self._thread = threading.Thread(target=self._run, name=f"draftd-lease-{self.lease.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.step()

    def stop(self, release: bool = True) -> None:
        """Stop the thread; ``release``: give the lease up now (a standby takes over at its next poll)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.poll_s + 5)
        if release and self.token:
            try:
                self.lease.release()
            except REDIS_DOWN:
                pass
            self._lose("stopped")

    def status(self) -> dict:
        try:
            cur = self.lease.current()
        except REDIS_DOWN as e:
            cur, self.last_error = None, f"{type(e).__name__}: {e}"
        return {"role": "leader" if self.leading else "standby", "holder": self.lease.holder, "token": self.token,
                "lease_holder": cur.holder if cur else None, "lease_token": cur.token if cur else None,
                "ttl_s": self.ttl_s, "last_error": self.last_error}
