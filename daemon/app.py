"""The daemon: Redis, store objects, the model pair, the trainer, the control API and metrics,
composed as context managers on one ExitStack and torn down in reverse order.

Shutdown (SIGTERM, SIGINT, or :meth:`Daemon.request_stop`): the API stops taking requests,
scheduled rounds are paused and queued manual rounds cancelled, then a running round is given
``trainer.shutdown_grace_s`` to finish. A round that finishes has registered its adapter (files
renamed into place, then one Redis transaction) and acked its entries; a round cut short has
registered nothing and its entries stay pending, to be redelivered. Promote and rollback are
single Lua scripts, so the registry is never half-updated.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import structlog

from daemon.api import create_app
from daemon.client import read_token  # noqa: F401 - re-exported: it lived here
from daemon.errors import DaemonError, TrainerDisabledError, TrainerStandbyError
from daemon.redis_embed import RedisHandle, open_redis
from daemon.reports import RECENT_WINDOW_S, adapter_dict, adapters_list, by_workload, history_report, jsonable, status_report  # noqa: F401
from daemon.settings import Settings, distill_config, draft_vocab_ids, service_config, store_config, warm_start_config
from store.history import AcceptanceHistory
from store.registry import AdapterRegistry

log = structlog.get_logger(__name__)

# -- small helpers -----------------------------------------------------------------------------------


def ensure_token(settings: Settings) -> str:
    """The API bearer token: ``api.token`` if configured (never empty: the settings refuse one),
    else the one in ``<state_dir>/api-token``, generated (32 random bytes, URL-safe) with mode 0600
    on first use. A token file that is empty or blank (emptied by hand, a full disk) is treated as
    missing: a new token is written into it and the warning ``api_token_file_empty`` says so (its
    empty token would have let ``Authorization: Bearer `` through while the CLI, sending none, got 401)."""
    if settings.api.token is not None:
        return settings.api.token.get_secret_value()
    path = settings.token_file
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
        log.warning("api_token_file_empty", path=str(path), action="wrote a new token into it")
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("api_token_generated", path=str(path))
    return token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- components ----------------------------------------------------------------------------------------


@contextmanager
def trainer_component(settings: Settings, handle: RedisHandle, registry: AdapterRegistry) -> Iterator[Any]:
    """Load the model pair and run a TrainerService (APScheduler) on the buffer; None when disabled."""
    if not settings.models.enabled:
        log.info("trainer_disabled", reason="models.enabled=false")
        yield None
        return
    import torch

    from decoder.models.loading import load_pair
    from store.buffer import SampleReader
    from store.schema import PairFingerprint
    from trainer.distill import Distiller
    from trainer.service import TrainerService, group_lag

    from daemon.heads import head_trainer

    m = settings.models
    if m.torch_threads:
        torch.set_num_threads(m.torch_threads)
    t0 = time.perf_counter()
    pair = load_pair(m.target, m.draft, device=m.device)
    fingerprint = PairFingerprint(target=pair.target_name, draft=pair.draft_name, tokenizer_hash=pair.tokenizer_hash)
    log.info("models_loaded", target=m.target, draft=m.draft, fingerprint=fingerprint.key(), seconds=round(time.perf_counter() - t0, 2))
    scfg = store_config(settings)
    group = settings.store.consumer_group
    consumer = f"{group}-{socket.gethostname()}-{os.getpid()}"
    reader = SampleReader(handle.client, scfg, group, consumer, expected_fingerprint=fingerprint)
    distiller = Distiller(pair.draft, distill_config(settings), vocab=draft_vocab_ids(settings, pair.tokenizer))
    ws_cfg = warm_start_config(settings)
    heads = head_trainer(settings, handle.client, pair, scfg) if settings.trainer.heads else None
    if settings.trainer.lease_ttl_s > 0:
        # the trainer writes through a registry of its own, which carries the lease's fencing token;
        # the control API's (an operator's promote or rollback) stays unfenced, so it keeps working on
        # a daemon that lost the lease while a stale round of it is still refused
        registry = AdapterRegistry(handle.client, registry.artifact_dir, scfg)

    warm_start = _warm_start_job(pair, fingerprint, registry, distiller, ws_cfg, heads, settings.trainer.precision)
    leadership = _leadership(settings, handle, scfg, consumer, registry, heads) if settings.trainer.lease_ttl_s > 0 else None
    svc_cfg = service_config(settings)
    service = TrainerService(
        reader,
        registry,
        distiller,
        svc_cfg,
        # new entries and a dead consumer's reclaimable ones both pull a round forward
        backlog=lambda: group_lag(handle.client, scfg, group, consumer=consumer,
                                  reclaim_min_idle_ms=svc_cfg.reclaim_min_idle_ms),
        warm_start=warm_start if ws_cfg.enabled else None,
        heads=heads,
        leadership=leadership,
    )
    service.fingerprint = fingerprint.key()  # shown in status
    if settings.trainer.start_paused:
        service.pause()
    if leadership is not None:
        leadership.start()
        if not leadership.leading:
            log.info("trainer_standby", consumer=consumer, lease=leadership.status())
    service.start()
    log.info("trainer_started", consumer=consumer, interval_s=settings.trainer.interval_s, paused=settings.trainer.start_paused)
    try:
        yield service
    finally:
        from apscheduler.schedulers import SchedulerNotRunningError

        try:
            service.stop(wait=False)
        except SchedulerNotRunningError:  # already stopped by Daemon._stop_rounds' waiter thread
            pass
        if leadership is not None:
            leadership.stop(release=True)  # a standby takes over at its next poll


def _warm_start_job(pair, fingerprint, registry, distiller, ws_cfg, heads, precision: str):
    """The trainer's first job: v0 bootstrapped (first start on this pair) or taken from the cache,
    and with ``trainer.heads`` the head's v0 the same way (its failure never undoes the draft's)."""

    def warm_start():
        from daemon.warm_start import ensure_v0

        progress = lambda msg: log.info("bootstrap_progress", msg=msg)  # noqa: E731
        res = ensure_v0(pair, fingerprint, registry, distiller, ws_cfg, precision, progress=progress)
        if heads is not None:  # trainer.heads: the head's v0 the same way (daemon.heads.ensure_head_v0)
            from daemon.heads import HeadBootstrapConfig, ensure_head_v0

            try:  # the head's v0 failing never undoes the draft's
                hv0 = ensure_head_v0(pair, fingerprint, heads.registry, HeadBootstrapConfig(), precision, progress=progress)
                log.info("head_v0", source=hv0.source, version=hv0.version, reason=hv0.reason)
            except Exception:  # noqa: BLE001 - e.g. Redis refused it: the rounds start from a fresh head
                log.exception("head_v0_failed")
        return res

    return warm_start


def _leadership(settings: Settings, handle: RedisHandle, scfg, consumer: str, registry: AdapterRegistry, heads):
    """One trainer at a time (store.lease): this daemon's Leadership, which announces its fencing
    token to the trainer's registries before their first fenced write."""
    from store.lease import Lease, Leadership

    def acquired(token: int) -> None:  # announce the token before the first fenced write
        for reg in (registry, heads.registry if heads is not None else None):
            if reg is not None:
                reg.fencing_token = token
                reg.fence(token)

    # one holder per daemon instance (two in one process, or a restart under the same pid, are two holders)
    holder = f"{consumer}-{uuid.uuid4().hex[:6]}"
    return Leadership(Lease(handle.client, scfg, holder, ttl_s=settings.trainer.lease_ttl_s), acquired)


class ApiServer:
    """uvicorn serving the control API in a background thread (it installs no signal handlers there)."""

    def __init__(self, app: Any, host: str, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="draftd-api", daemon=True)
        self.host, self.port = host, port

    def __enter__(self) -> "ApiServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive():
                raise DaemonError(f"control API could not listen on {self.host}:{self.port} (in use?); set DRAFTD_API__PORT")
            if time.monotonic() > deadline:
                raise DaemonError(f"control API did not start on {self.host}:{self.port} within 30 s")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        log.info("api_listening", host=self.host, port=self.port)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        log.info("api_stopped")


# -- the daemon ----------------------------------------------------------------------------------------


class Daemon:
    """Owns the components and implements what the control API exposes.

    Use :meth:`run` (blocks until SIGTERM/SIGINT), or ``with daemon.started(): ...`` in-process.
    """

    def __init__(self, settings: Settings, *, clock=time.time):
        self.settings = settings
        self.clock = clock
        self.store_config = store_config(settings)
        self.redis: RedisHandle | None = None
        self.registry: AdapterRegistry | None = None
        self.history: AcceptanceHistory | None = None
        self.trainer: Any = None
        self.api: ApiServer | None = None
        self.token: str = ""
        self.started_at: float | None = None
        self.abandoned_round = False
        self._stop = threading.Event()
        self._rounds = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftd-round")
        self._pending: list[Future] = []

    # -- lifecycle -------------------------------------------------------------------------------

    @contextmanager
    def started(self) -> Iterator["Daemon"]:
        s = self.settings
        with ExitStack() as stack:
            s.state_dir.mkdir(parents=True, exist_ok=True)
            self.token = ensure_token(s)
            self.redis = stack.enter_context(open_redis(s.redis, s.redis_dir))
            self.registry = AdapterRegistry(self.redis.client, s.adapter_dir, self.store_config)
            if removed := self.registry.clean_orphans():
                log.info("adapter_orphans_removed", removed=removed)
            self.history = AcceptanceHistory(self.redis.client, self.store_config, clock=self.clock)
            self.trainer = stack.enter_context(trainer_component(s, self.redis, self.registry))
            stack.callback(self._stop_rounds)  # runs before the trainer's own exit
            if s.api.enabled:
                self.api = stack.enter_context(ApiServer(create_app(self), s.api.host, s.api.port))
            if s.api.enabled and s.api.remote:
                log.warning("api_exposed", host=s.api.host, port=self.api.port,
                            why="api.allow_remote=true: the read endpoints (pid, state dir, key prefix, /docs) are open to the network")
            self.started_at = self.clock()
            log.info("daemon_started", pid=os.getpid(), redis=self.redis.mode, state_dir=str(s.state_dir),
                     api=f"{s.api.host}:{self.api.port}" if self.api else None, trainer=self.trainer is not None)
            try:
                yield self
            finally:
                log.info("daemon_stopping")
        log.info("daemon_stopped", abandoned_round=self.abandoned_round)

    def request_stop(self, signum: int | None = None) -> None:
        if not self._stop.is_set():
            log.info("shutdown_requested", signal=signal.Signals(signum).name if signum else None)
        self._stop.set()

    def run(self) -> int:
        """Run until SIGTERM/SIGINT; returns the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.request_stop(signum))
        with self.started():
            while not self._stop.wait(1.0):
                pass
        return 0

    def _stop_rounds(self) -> None:
        """Pause scheduling, cancel queued manual rounds, give a running round the grace period."""
        svc = self.trainer
        if svc is None:
            self._rounds.shutdown(wait=False, cancel_futures=True)
            return
        svc.pause()
        self._rounds.shutdown(wait=False, cancel_futures=True)
        running = svc.status()["running"]
        done = threading.Event()

        def wait_all() -> None:
            svc.stop(wait=True)  # waits for a scheduled round in progress
            self._rounds.shutdown(wait=True)  # and for a manual one
            done.set()

        threading.Thread(target=wait_all, name="draftd-stop", daemon=True).start()
        grace = self.settings.trainer.shutdown_grace_s
        if running:
            log.info("waiting_for_round", grace_s=grace)
        if not done.wait(grace):
            self.abandoned_round = True
            log.warning("trainer_round_abandoned", grace_s=grace,
                        consequence="nothing registered for it; its entries stay pending and are redelivered")

    # -- operations (the API calls these) ----------------------------------------------------------

    def _need_trainer(self) -> Any:
        if self.trainer is None:
            raise TrainerDisabledError("the trainer is not running (models.enabled=false); start the daemon with models enabled")
        return self.trainer

    def promote(self, version: int, reason: str) -> dict:
        previous = self.registry.promote(version, reason)
        scope = self.registry.get(version).scope
        log.info("adapter_promoted", version=version, previous=previous, reason=reason, scope=scope, source="api")
        return {"active": version, "previous": previous, "reason": reason, "workload": scope}

    def rollback(self, reason: str, workload: str = "") -> dict:
        """Roll back the shared adapter, or ``workload``'s own (its requests then use its previous
        own version, else the shared one)."""
        previous = self.registry.active_version(workload)
        new, skipped = self.registry.rollback_checked(reason, scope=workload)
        if skipped:
            log.warning("rollback_skipped_bad_adapters", skipped=skipped, scope=workload)
        log.info("adapter_rolled_back", version=new, previous=previous, reason=reason, scope=workload, source="api")
        return {"active": new, "previous": previous, "reason": reason, "workload": workload,
                "skipped": {str(v): why for v, why in skipped.items()}}

    def train_now(self, wait: bool = False) -> dict:
        svc = self._need_trainer()
        if self._stop.is_set():
            raise DaemonError("the daemon is shutting down; no new rounds")
        if not svc.leading:
            st = svc.leadership.status()
            raise TrainerStandbyError(
                f"this daemon's trainer ({st['holder']}) stands by: {st['lease_holder'] or 'another daemon'} holds the "
                f"trainer lease; run train-now there, or stop that daemon and this one takes over within "
                f"{st['ttl_s'] * 4 / 3:.0f} s")
        busy = svc.status()["running"]
        fut = self._rounds.submit(svc.run_round_now, "manual")
        log.info("train_now_requested", queued_behind_running_round=busy, wait=wait)
        if not wait:
            return {"submitted": True, "queued_behind_running_round": busy}
        try:
            report = fut.result().to_dict()
        except Exception as e:  # noqa: BLE001 - a failed round is a report (decision "error"), not a 500
            log.warning("train_now_round_failed", error=f"{type(e).__name__}: {e}")
            report = svc.status()["last_round"]
        return {"submitted": True, "report": jsonable(report)}

    def pause(self) -> dict:
        self._need_trainer().pause()
        log.info("trainer_paused", source="api")
        return {"paused": True}

    def resume(self) -> dict:
        self._need_trainer().resume()
        log.info("trainer_resumed", source="api")
        return {"paused": False}

    def adapters(self) -> list[dict]:
        return adapters_list(self.registry)

    def adapter(self, version: int) -> dict:
        rec = self.registry.get(version)
        live = by_workload(self.history.read(version=version), version)
        return adapter_dict(rec) | {"active": self.registry.active_version(rec.scope) == version, "live": live}

    # -- status and history (built in daemon.reports) ----------------------------------------------

    def status(self) -> dict:
        s = self.settings
        now = self.clock()
        daemon = {
            "up": True,
            "pid": os.getpid(),
            "started_at": self.started_at,
            "uptime_s": None if self.started_at is None else round(now - self.started_at, 1),
            "state_dir": str(s.state_dir),
            "key_prefix": s.store.key_prefix,
            "api": f"http://{s.api.host}:{self.api.port}" if self.api else None,
        }
        return status_report(daemon, s, self.redis, self.store_config, self.registry, self.history, self.trainer, now)

    def history_report(self, since: float | None = None) -> dict:
        """See :func:`daemon.reports.history_report`."""
        return history_report(self.registry, self.history, since)
