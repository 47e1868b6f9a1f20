"""The control API (FastAPI) and the Prometheus endpoint.

Read-only endpoints need no token; mutating ones need ``Authorization: Bearer <token>``
(``api.token`` or the generated ``<state_dir>/api-token``) and answer 401 without it.
OpenAPI schema at ``/openapi.json``, docs at ``/docs``.

======  =================================  ===========================================
GET     /healthz                           liveness
GET     /v1/status                         what ``daemonctl status`` shows
GET     /v1/history?since=<epoch s>        what ``daemonctl history`` shows
GET     /v1/adapters                       registered adapter versions
GET     /v1/adapters/{version}             one version, with its live acceptance
POST    /v1/adapters/{version}/promote     make it active (body: reason)
POST    /v1/rollback                       reactivate the previous version (body: reason, workload: "" = shared)
POST    /v1/train-now?wait=false           run a round now (wait=true returns its report)
POST    /v1/pause, /v1/resume              scheduled rounds off / on
GET     /metrics                           Prometheus text format
======  =================================  ===========================================
"""

from __future__ import annotations

import secrets
from typing import Any

import structlog
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from daemon.errors import DaemonError, TrainerDisabledError, TrainerStandbyError
from daemon.metrics import DraftdCollector
from store.registry import check_scope
from store.errors import FencedError, InvalidTransitionError, StoreUnavailableError, UnknownVersionError

log = structlog.get_logger(__name__)


class ReasonBody(BaseModel):
    reason: str = Field("operator", description="Why; recorded in the registry and the promotion log.")


class RollbackBody(ReasonBody):
    workload: str = Field("", description="Roll back this workload's own adapter; '' (default) = the shared adapter.")


def _answer(status: int):
    """An exception handler answering ``status`` with the exception's message as the detail."""
    async def handler(_r: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=status)
    return handler


def create_app(daemon: Any) -> FastAPI:  # daemon: a daemon.app.Daemon (app imports this module, not back)
    app = FastAPI(title="draftd control API", version="1", description=__doc__)
    metrics_registry = CollectorRegistry(auto_describe=False)
    metrics_registry.register(DraftdCollector(daemon))
    require_token = _authenticate(app, daemon)
    # the most specific class wins (Starlette looks handlers up along the exception's MRO)
    for exc, code in ((UnknownVersionError, 404), (InvalidTransitionError, 409), (TrainerDisabledError, 409), (TrainerStandbyError, 409),
                      (FencedError, 409), (DaemonError, 503), (StoreUnavailableError, 503)):
        app.add_exception_handler(exc, _answer(code))

    # FastAPI runs plain `def` endpoints in a worker thread: the Redis calls and a waited-for
    # round never block the event loop.

    _read_routes(app, daemon)
    _operate_routes(app, daemon, require_token)

    @app.get("/metrics", tags=["read"])
    def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _authenticate(app: FastAPI, daemon: Any):
    """The bearer-token check on every mutating request (a middleware, before the body is read),
    and the dependency that documents it in OpenAPI; returns the dependency."""
    bearer = HTTPBearer(auto_error=False)

    @app.middleware("http")
    async def token_before_body(request: Request, call_next):  # noqa: ANN001, ANN202
        """Mutating requests are authenticated before their body is read or validated: without the
        token a malformed body gets 401, not 422 (the Depends below documents it in OpenAPI)."""
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            if (scheme.lower() != "bearer" or not daemon.token  # an empty token is no token: refuse all
                    or not secrets.compare_digest(cred.strip().encode(), daemon.token.encode())):
                log.warning("api_unauthorized", has_credentials=bool(cred), path=request.url.path)
                return JSONResponse(
                    {"detail": "missing or wrong bearer token: send 'Authorization: Bearer <token>' (api.token, or the "
                               "daemon's <state_dir>/api-token)"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"},
                )
        return await call_next(request)

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not daemon.token or not secrets.compare_digest(creds.credentials.encode(), daemon.token.encode()):
            log.warning("api_unauthorized", has_credentials=creds is not None)
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token: send 'Authorization: Bearer <token>' (api.token, or the "
                "daemon's <state_dir>/api-token)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_token


def _read_routes(app: FastAPI, daemon: Any) -> None:
    @app.get("/healthz", tags=["read"])
    def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/v1/status", tags=["read"])
    def status() -> dict[str, Any]:
        return daemon.status()

    @app.get("/v1/history", tags=["read"])
    def history(
        since: float | None = Query(None, allow_inf_nan=False, description="Epoch seconds; finite."),
    ) -> dict[str, Any]:
        return daemon.history_report(since)

    @app.get("/v1/adapters", tags=["read"])
    def adapters() -> list[dict[str, Any]]:
        return daemon.adapters()

    @app.get("/v1/adapters/{version}", tags=["read"])
    def adapter(version: int) -> dict[str, Any]:
        return daemon.adapter(version)


def _operate_routes(app: FastAPI, daemon: Any, require_token) -> None:
    @app.post("/v1/adapters/{version}/promote", tags=["operate"], dependencies=[Depends(require_token)])
    def promote(version: int, body: ReasonBody | None = None) -> dict[str, Any]:
        return daemon.promote(version, (body or ReasonBody()).reason)

    @app.post("/v1/rollback", tags=["operate"], dependencies=[Depends(require_token)])
    def rollback(body: RollbackBody | None = None) -> dict[str, Any]:
        body = body or RollbackBody()
        try:
            check_scope(body.workload)
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from e
        return daemon.rollback(body.reason, body.workload)

    @app.post("/v1/train-now", tags=["operate"], dependencies=[Depends(require_token)])
    def train_now(wait: bool = False) -> dict[str, Any]:
        return daemon.train_now(wait)

    @app.post("/v1/pause", tags=["operate"], dependencies=[Depends(require_token)])
    def pause() -> dict[str, Any]:
        return daemon.pause()

    @app.post("/v1/resume", tags=["operate"], dependencies=[Depends(require_token)])
    def resume() -> dict[str, Any]:
        return daemon.resume()
