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

import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from typing import Any

import structlog

from daemon.redis_embed import RedisHandle, open_redis
from daemon.settings import Settings, distill_config, draft_vocab_ids, service_config, store_config
from store.buffer import dead_letter_count, group_info, stream_depth
from store.history import COUNTS, AcceptanceHistory, HistoryRow
from store.registry import AdapterRecord, AdapterRegistry

log = structlog.get_logger(__name__)

RECENT_WINDOW_S = 300.0  # "recent" for status: speculation on/off and the recent acceptance rate


class DaemonError(Exception):
    """Base class of the daemon's errors."""


class TrainerDisabledError(DaemonError):
    """An operation needs the trainer, which is not running (models.enabled = false)."""


# -- small helpers -----------------------------------------------------------------------------------


def ensure_token(settings: Settings) -> str:
    """The API bearer token: ``api.token`` if configured, else the one in ``<state_dir>/api-token``,
    generated (32 random bytes, URL-safe) with mode 0600 on first use."""
    if settings.api.token is not None:
        return settings.api.token.get_secret_value()
    path = settings.token_file
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.info("api_token_generated", path=str(path))
    return token


def read_token(settings: Settings) -> str | None:
    """The token a client should send: configured, or read from the daemon's token file (None if neither)."""
    if settings.api.token is not None:
        return settings.api.token.get_secret_value()
    try:
        return settings.token_file.read_text().strip()
    except OSError:
        return None


def _num(x: float) -> float | None:
    """JSON-safe float: NaN -> None."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def sum_rows(rows: list[HistoryRow], workload: str | None = None, version: int | None = None) -> HistoryRow:
    """Counts of ``rows`` added up; rates derived from the sums (see store.history.HistoryRow)."""
    sums = {n: 0 for n in COUNTS}
    for r in rows:
        for n in COUNTS:
            sums[n] += getattr(r, n)
    return HistoryRow(ts=rows[0].ts if rows else math.nan, workload=workload, version=version, **sums)


def row_summary(r: HistoryRow) -> dict[str, Any]:
    """Counts and derived rates of a history row, JSON-ready (NaN -> null).

    acceptance_rate = accepted / drafted tokens; tau = emitted tokens / verification steps
    (mean accepted length with the correction or bonus token); alpha = mean per-request alpha;
    goodput = emitted tokens per second of decode wall time.
    """
    return {
        "requests": r.requests,
        "num_drafts": r.num_drafts,
        "num_draft_tokens": r.num_draft_tokens,
        "num_accepted_tokens": r.num_accepted_tokens,
        "num_emitted_tokens": r.num_emitted_tokens,
        "num_steps": r.num_steps,
        "acceptance_rate": _num(r.acceptance_rate),
        "tau": _num(r.tau),
        "alpha": _num(r.alpha),
        "goodput_tokens_per_s": _num(r.tokens_per_s),
    }


def adapter_dict(rec: AdapterRecord) -> dict[str, Any]:
    d = asdict(rec)
    for k in ("loss", "alpha_before", "alpha_after"):
        d[k] = _num(d[k])
    return d


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

    from decoder.models import load_pair
    from store.buffer import SampleReader
    from store.schema import PairFingerprint
    from trainer.distill import Distiller
    from trainer.service import TrainerService, group_lag

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
    service = TrainerService(
        reader,
        registry,
        Distiller(pair.draft, distill_config(settings), vocab=draft_vocab_ids(settings, pair.tokenizer)),
        service_config(settings),
        backlog=lambda: group_lag(handle.client, scfg, group),
    )
    service.fingerprint = fingerprint.key()  # shown in status
    if settings.trainer.start_paused:
        service.pause()
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
            self.history = AcceptanceHistory(self.redis.client, self.store_config, clock=self.clock)
            self.trainer = stack.enter_context(trainer_component(s, self.redis, self.registry))
            stack.callback(self._stop_rounds)  # runs before the trainer's own exit
            if s.api.enabled:
                from daemon.api import create_app

                self.api = stack.enter_context(ApiServer(create_app(self), s.api.host, s.api.port))
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
        new = self.registry.rollback(reason, scope=workload)
        log.info("adapter_rolled_back", version=new, previous=previous, reason=reason, scope=workload, source="api")
        return {"active": new, "previous": previous, "reason": reason, "workload": workload}

    def train_now(self, wait: bool = False) -> dict:
        svc = self._need_trainer()
        if self._stop.is_set():
            raise DaemonError("the daemon is shutting down; no new rounds")
        busy = svc.status()["running"]
        fut = self._rounds.submit(svc.run_round_now, "manual")
        log.info("train_now_requested", queued_behind_running_round=busy, wait=wait)
        if not wait:
            return {"submitted": True, "queued_behind_running_round": busy}
        report = fut.result()
        return {"submitted": True, "report": _jsonable(report.to_dict())}

    def pause(self) -> dict:
        self._need_trainer().pause()
        log.info("trainer_paused", source="api")
        return {"paused": True}

    def resume(self) -> dict:
        self._need_trainer().resume()
        log.info("trainer_resumed", source="api")
        return {"paused": False}

    def adapters(self) -> list[dict]:
        actives = self.registry.active_versions()
        return [adapter_dict(r) | {"active": r.version == actives.get(r.scope, 0)} for r in self.registry.list()]

    def adapter(self, version: int) -> dict:
        rec = self.registry.get(version)
        rows = self.history.read(version=version)
        by_w = {w: row_summary(sum_rows([r for r in rows if r.workload == w], w, version)) for w in sorted({r.workload for r in rows})}
        return adapter_dict(rec) | {"active": self.registry.active_version(rec.scope) == version, "live": by_w}

    # -- status and history ----------------------------------------------------------------------------

    def _active_since(self, log_events: list[dict], active: int, scope: str = "") -> tuple[float | None, int | None, str | None]:
        """When ``active`` became ``scope``'s active version, the version before it and the reason,
        from the promotion log."""
        for ev in reversed(log_events):
            if (ev.get("event") in ("promote", "rollback") and ev.get("scope", "") == scope
                    and int(ev.get("version", -1)) == active):
                return float(ev["ts"]), int(ev["previous"]), ev.get("reason")
        return None, None, None

    def status(self) -> dict:
        now = self.clock()
        problems: list[str] = []
        warnings: list[str] = []
        redis_info = self.redis.describe()
        out: dict[str, Any] = {
            "daemon": {
                "up": True,
                "pid": os.getpid(),
                "started_at": self.started_at,
                "uptime_s": None if self.started_at is None else round(now - self.started_at, 1),
                "state_dir": str(self.settings.state_dir),
                "key_prefix": self.settings.store.key_prefix,
                "api": f"http://{self.settings.api.host}:{self.api.port}" if self.api else None,
            },
            "redis": redis_info,
        }
        if not redis_info.get("up"):
            problems.append(f"Redis unreachable at {redis_info['url']}: {redis_info.get('error')}")
            out.update(healthy=False, problems=problems, warnings=warnings)
            return out
        c, cfg = self.redis.client, self.store_config
        groups = [asdict(g) | {"last_delivered_id": g.last_delivered_id.decode()} for g in group_info(c, cfg)]
        trainer_group = next((g for g in groups if g["name"] == self.settings.store.consumer_group), None)
        dead = dead_letter_count(c, cfg)
        out["buffer"] = {
            "stream": cfg.keys.stream,
            "depth": stream_depth(c, cfg),
            "dead_letters": dead,
            "consumer_lag": None if trainer_group is None else trainer_group["lag"],
            "consumer_pending": None if trainer_group is None else trainer_group["pending"],
            "groups": groups,
        }
        if dead:
            warnings.append(f"{dead} dead-lettered entries in {cfg.keys.dead_letter} (daemonctl status --json shows the count; inspect with XRANGE)")
        # trainer
        if self.trainer is None:
            out["trainer"] = {"enabled": False, "reason": "models.enabled=false: no model pair loaded, no rounds"}
        else:
            st = self.trainer.status()
            last = st.get("last_round")
            out["trainer"] = {
                "enabled": True,
                "fingerprint": getattr(self.trainer, "fingerprint", None),
                "paused": st["paused"],
                "running": st["running"],
                "rounds": st["rounds"],
                "next_run_time": None if st["paused"] else st["next_run_time"],
                "heldout": st["heldout"],
                "last_round": None if last is None else {
                    k: last.get(k) for k in ("trigger", "started_at", "seconds", "decision", "reason", "version", "read", "trained_on",
                                             "acked", "scopes")
                },
            }
            if last and last.get("decision") == "error":
                problems.append(f"last training round failed: {last.get('reason')}")
        # adapter
        actives = self.registry.active_versions()
        active = actives[""]
        events = self.registry.promotion_log(1000)
        since, previous, reason = self._active_since(events, active)
        own = {}
        for w, v in actives.items():
            if w and v:
                w_since, w_prev, w_reason = self._active_since(events, v, w)
                own[w] = {"active": v, "since": w_since, "previous": w_prev, "reason": w_reason}
        out["adapter"] = {"active": active, "since": since, "previous": previous, "reason": reason,
                          "registered": len(self.registry.list()), "workloads": own}
        # acceptance per workload: the adapter serving it (its own, else the shared one) vs the
        # one before it, and the recent window
        rows = self.history.read()
        workloads = sorted({r.workload for r in rows})
        acc, spec = {}, {}
        for w in workloads:
            wr = [r for r in rows if r.workload == w]
            w_active, w_since, w_previous = (own[w]["active"], own[w]["since"], own[w]["previous"]) if w in own \
                else (active, since, previous)
            cur = [r for r in wr if r.version == w_active and (w_since is None or r.ts + self.history.bucket_s > w_since)]
            prev = [r for r in wr if w_previous is not None and r.version == w_previous]
            recent = [r for r in wr if r.ts >= now - RECENT_WINDOW_S]
            acc[w] = {
                "now": row_summary(sum_rows(cur, w, w_active)) | {"version": w_active},
                "previous": None if w_previous is None else row_summary(sum_rows(prev, w, w_previous)) | {"version": w_previous},
                "recent": row_summary(sum_rows(recent, w)),
            }
            rs = sum_rows(recent, w)
            if not recent or rs.num_steps == 0:
                spec[w] = {"on": None, "why": f"no requests recorded in the last {RECENT_WINDOW_S:.0f} s"}
            elif rs.num_drafts > 0:
                spec[w] = {"on": True, "why": f"{rs.num_drafts} of {rs.num_steps} verification steps drafted in the last {RECENT_WINDOW_S:.0f} s"}
            else:
                spec[w] = {"on": False, "why": f"all {rs.num_steps} steps in the last {RECENT_WINDOW_S:.0f} s were plain (gamma = 0)"}
        out["acceptance"] = acc
        out["speculation"] = spec
        from store.heartbeat import read_heartbeats

        out["serving"] = [hb | {"last_seen_s": round(now - float(hb.get("ts") or now), 1)}
                          for hb in read_heartbeats(c, cfg)]  # `daemonctl serve` instances (expiring heartbeats)
        out.update(healthy=not problems, problems=problems, warnings=warnings)
        return out

    def history_report(self, since: float | None = None) -> dict:
        """Per adapter version: metadata, held-out alpha before/after, live acceptance per workload
        while it was active; the promotion log; and the bucketed acceptance series for plots."""
        rows = self.history.read(start=since)
        actives = self.registry.active_versions()
        active = actives[""]
        versions = []
        for rec in self.registry.list():
            vr = [r for r in rows if r.version == rec.version]
            live = {w: row_summary(sum_rows([r for r in vr if r.workload == w], w, rec.version)) for w in sorted({r.workload for r in vr})}
            versions.append(adapter_dict(rec) | {"active": rec.version == actives.get(rec.scope, 0), "live": live})
        base = [r for r in rows if r.version == 0]
        base_live = {w: row_summary(sum_rows([r for r in base if r.workload == w], w, 0)) for w in sorted({r.workload for r in base})}
        series = [{"ts": r.ts, "workload": r.workload, "version": r.version} | row_summary(r) for r in rows]
        return {"active": active, "actives": actives, "base_live": base_live, "adapters": versions,
                "events": self.registry.promotion_log(1000), "series": series, "bucket_s": self.history.bucket_s}


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
