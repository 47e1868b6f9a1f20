"""Following a registry's promotions and rollbacks: the watcher loop and the life cycle that
:class:`decoder.adapters.AdapterManager` (LoRA adapters) and :class:`decoder.heads.HeadManager`
(feature-level heads) share. A follower prepares what the registry names on its own thread and
switches at the decoder's request boundaries (its ``_between_requests`` hook)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis
import structlog

from store import StoreError
from store.registry import parse_event

log = structlog.get_logger(__name__)


def watch_registry(registry, prepare: Callable[[int, str, str], None], stop: threading.Event, *,
                   poll_interval_s: float, clock: Callable[[], float], after: Callable[[], None] | None = None,
                   name: str = "adapter") -> None:
    """The watcher loop :class:`decoder.adapters.AdapterManager` and :class:`HeadManager` run on
    their thread until ``stop`` is set: subscribe to ``registry``'s events first, then poll
    ``active_versions()`` every ``poll_interval_s`` and on each event call
    ``prepare(version, source, scope)`` (source "poll" or "event"; a burst of events costs one
    call per scope), then ``after()``. Redis errors close the subscription and retry after
    ``poll_interval_s``; ``prepare`` must not raise for a bad artifact (it records it)."""
    ps = None
    next_poll = 0.0
    down = _Outage(name, poll_interval_s, clock)
    while not stop.is_set():
        try:
            if ps is None:
                ps = registry.subscribe()
                next_poll = 0.0  # subscribed first, then polled: nothing falls in between
            now = clock()
            if now >= next_poll:
                for scope, version in registry.active_versions().items():
                    prepare(version, "poll", scope)
                next_poll = now + poll_interval_s
            # short waits, so that stop is prompt whatever the poll interval
            msg = ps.get_message(timeout=min(0.2, poll_interval_s))
            if msg is not None and msg.get("type") == "message":
                for scope, version in latest_events(ps, msg).items():
                    prepare(version, "event", scope)
            if after is not None:
                after()
            down.over()
        except (StoreError, redis.RedisError, OSError, ValueError) as e:
            if stop.is_set():
                break
            down.failed(e)
            _close(ps)
            ps = None
            stop.wait(poll_interval_s)
    _close(ps)


class _Outage:
    """The watcher's log of a run of failures: the first at warning, then one line a minute
    (``REPEAT_S``) with the count so far, and an info line when it is over (a Redis outage logged
    ``adapter_watch_error`` every second without it)."""

    REPEAT_S = 60.0

    def __init__(self, name: str, retry_s: float, clock: Callable[[], float]):
        self.name, self.retry_s, self.clock = name, retry_s, clock
        self.failures, self.since, self.logged = 0, 0.0, 0.0

    def failed(self, e: BaseException) -> None:
        now = self.clock()
        if self.failures == 0:
            self.since = self.logged = now
            log.warning(f"{self.name}_watch_error", error=str(e), retry_in_s=self.retry_s)
        elif now - self.logged >= self.REPEAT_S:
            self.logged = now
            log.warning(f"{self.name}_watch_error", error=str(e), retry_in_s=self.retry_s,
                        failures=self.failures + 1, down_s=round(now - self.since, 1))
        self.failures += 1

    def over(self) -> None:
        if self.failures:
            log.info(f"{self.name}_watch_recovered", failures=self.failures, down_s=round(self.clock() - self.since, 1))
            self.failures = 0


def latest_events(ps, msg) -> dict[str, int]:
    """The newest event's version per scope: ``msg`` and whatever else is queued on ``ps``."""
    ev = parse_event(msg)
    latest = {ev["scope"]: int(ev["version"])}
    while (more := ps.get_message(timeout=0)) is not None:
        if more.get("type") == "message":
            ev = parse_event(more)
            latest[ev["scope"]] = int(ev["version"])
    return latest


def _close(ps) -> None:
    if ps is not None:
        try:
            ps.close()
        except Exception:  # noqa: BLE001 - a broken connection may fail to close
            pass


class RegistryFollower:
    """The life cycle of a manager that follows a registry (subclasses set ``_thread_name`` and
    ``_watch_name``, and provide ``_prepare_version(version, source, scope, t0)``, ``_evict()`` and
    ``_between_requests(decoder, request)``; their ``__init__`` calls :meth:`_init_follower` first
    and :meth:`_hook_in` last).

    ``start`` runs the watcher thread (:func:`watch_registry`), ``stop`` ends it, ``close`` also
    removes the hook from the decoder; ``route`` and ``wait_prepared`` read the routes."""

    _thread_name = "registry-follower"
    _watch_name = "registry"

    def _init_follower(self, decoder, registry, poll_interval_s: float, clock: Callable[[], float]) -> None:
        self.decoder, self.registry = decoder, registry
        self.poll_interval_s, self.clock = poll_interval_s, clock
        self._failed: dict[int, str] = {}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prep_lock = threading.Lock()  # one preparation at a time

    def _hook_in(self) -> None:
        """Join the decoder's between-request hooks (the end of a subclass's ``__init__``)."""
        self.decoder.between_requests.append(self._between_requests)

    def _prepare(self, version: int, source: str, scope: str = "") -> None:
        """Prepare ``version`` for ``scope`` (one preparation at a time), unless there is nothing
        to prepare (:meth:`_nothing_to_prepare`); ``_prepare_version`` does the work, timed from t0."""
        with self._prep_lock:
            if self._nothing_to_prepare(version, source, scope):
                return
            self._prepare_version(version, source, scope, self.clock())

    def start(self):
        """Start the watcher thread (subscribe, then poll once, then wait for events)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name=self._thread_name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        """Stop the thread and remove the hook from the decoder."""
        self.stop()
        try:
            self.decoder.between_requests.remove(self._between_requests)
        except ValueError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        watch_registry(self.registry, self._prepare, self._stop, poll_interval_s=self.poll_interval_s,
                       clock=self.clock, after=self._evict, name=self._watch_name)

    def poll_once(self, version: int | None = None, scope: str = "") -> int:
        """Synchronously prepare ``version`` for ``scope`` (default: the registry's active
        versions of every scope) and evict unused ones; returns the version prepared or kept for
        ``scope``. The switch itself still happens at the next request boundary.
        Raises StoreUnavailableError when Redis is unreachable."""
        if version is None:
            for sc, v in self.registry.active_versions().items():
                self._prepare(v, "manual", sc)
        else:
            self._prepare(int(version), "manual", scope)
        self._evict()
        return self._routes.get(scope, 0)

    def _nothing_to_prepare(self, version: int, source: str, scope: str) -> bool:
        """``version`` already routes ``scope``, or failed before and only a poll asks again (a
        new event or :meth:`poll_once` retries it)."""
        return version == self._routes.get(scope, 0) or (version in self._failed and source == "poll")

    def route(self, workload: str | None) -> int:
        """The prepared version a request of ``workload`` runs with: its scope's route, else
        the shared one (None = an idle boundary: the shared one)."""
        routes = self._routes
        return (routes.get(workload, 0) if workload else 0) or routes.get("", 0)

    @property
    def has_version(self) -> bool:
        """Whether some scope routes to a prepared version (not 0, the base): the first one the
        registry promoted (v0 included) is ready to serve."""
        return any(list(self._routes.values()))  # list(): one C call, atomic under the GIL

    def wait_prepared(self, version: int, timeout: float = 30.0, scope: str = "") -> bool:
        """Block until ``version`` is prepared for ``scope`` (True) or failed / timed out (False)."""
        deadline = self.clock() + timeout
        with self._changed:
            while True:
                if self._routes.get(scope, 0) == version and version not in self._failed:
                    return True
                if version in self._failed:
                    return False
                left = deadline - self.clock()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
