"""Connecting to Redis, with the server version check ``store`` relies on.

``store`` needs Redis >= 6.2: XAUTOCLAIM (reclaiming a dead consumer's entries), XADD/XTRIM
``MINID`` (age cap) and ZMSCORE (batch dedupe) all arrived in 6.2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Mapping


import redis

from store.errors import (  # re-exported: the package's exception hierarchy
    ArtifactMissingError,
    IntegrityError,
    InvalidTransitionError,
    RedisVersionError,
    RegistryError,
    StoreError,
    StoreUnavailableError,
    UnknownVersionError,
)
from store.masking import mask_url  # re-exported

URL_SETTING = "redis.url (DRAFTD_REDIS__URL)"  # where a URL's password goes, unless connect() names another setting

MIN_REDIS_VERSION = (6, 2, 0)

# errors that mean "Redis unreachable"; with a cluster also "the slot's master is down or moving"
# (CLUSTERDOWN, MASTERDOWN, TRYAGAIN during a failover, no node reachable at all)
# (not every RedisClusterException: CROSSSLOT and "no key to route by" are programming errors)
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
              redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError,
              redis.exceptions.RedisClusterUnreachableError)
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@contextmanager
def unavailable(what: str) -> Iterator[None]:
    """Re-raise Redis connection/timeout errors inside the block as StoreUnavailableError."""
    try:
        yield
    except REDIS_DOWN as e:
        raise StoreUnavailableError(f"{what}: Redis unreachable ({e}); retry when it is back") from e

__all__ = [
    "MIN_REDIS_VERSION",
    "connect",
    "is_cluster_url",
    "parse_cluster_url",
    "mask_url",
    "check_server_version",
    "parse_version",
    "StoreError",
    "StoreUnavailableError",
    "RedisVersionError",
    "RegistryError",
    "UnknownVersionError",
    "InvalidTransitionError",
    "ArtifactMissingError",
    "IntegrityError",
]


def parse_version(text: str) -> tuple[int, int, int]:
    """``"7.0.15"`` -> ``(7, 0, 15)``; missing parts are 0; a suffix like ``"-rc1"`` is ignored.

    Raises:
        RedisVersionError: ``text`` does not start with a number.
    """
    parts: list[int] = []
    for piece in str(text).strip().split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise RedisVersionError(f"cannot parse Redis version {text!r}; expected e.g. '7.0.15'")
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def check_server_version(info: Mapping[str, Any]) -> tuple[int, int, int]:
    """Check an ``INFO server`` map (as redis-py returns it) against :data:`MIN_REDIS_VERSION`.

    Returns:
        The server version as a tuple.

    Raises:
        RedisVersionError: ``redis_version`` is missing or older than 6.2; the message names the
            version found.
    """
    raw = info.get("redis_version")
    if raw is None:
        raise RedisVersionError(
            "INFO did not report redis_version; store needs Redis >= 6.2 (XAUTOCLAIM). "
            "Point the URL at a Redis server."
        )
    found = parse_version(raw if isinstance(raw, str) else str(raw))
    if found < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION[:2]))
        raise RedisVersionError(
            f"Redis server version {raw} is too old: store needs >= {need} "
            f"(XAUTOCLAIM, XTRIM MINID, ZMSCORE). Upgrade the server, e.g. to Redis 7."
        )
    return found


def is_cluster_url(url: str) -> bool:
    """True for ``redis+cluster://`` and ``rediss+cluster://`` URLs (a Redis Cluster)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``redis+cluster://[user:password@]host:port[,host:port...][/0]`` -> the startup nodes and
    the client options (``username``, ``password``, ``ssl`` for ``rediss+cluster``). Any node of
    the cluster will do as a startup node; several let the client start while one is down.

    Raises:
        ValueError: no host, a port that is not a number, or a database other than 0 (a cluster
            has only database 0); the message masks the password.
    """
    from urllib.parse import unquote

    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    opts: dict[str, Any] = {"ssl": scheme.lower() == "rediss+cluster"}
    if "@" in netloc:
        auth, netloc = netloc.rsplit("@", 1)
        user, colon, password = auth.partition(":")
        if colon:
            opts["password"] = unquote(password)
            if user:
                opts["username"] = unquote(user)
        elif user:
            opts["password"] = unquote(user)  # redis://secret@host: the password alone
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"{mask_url(url)!r}: a Redis Cluster has only database 0; drop '/{path}' from the URL")
    nodes = []
    for part in filter(None, netloc.split(",")):
        host, _, port = part.rpartition(":") if part.rsplit(":", 1)[-1].isdigit() else (part, "", "6379")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise ValueError(f"{mask_url(url)!r}: cannot read node {part!r}; write host:port, e.g. "
                             f"redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
        nodes.append((host, int(port)))
    if not nodes:
        raise ValueError(f"{mask_url(url)!r} names no node; write redis+cluster://host:port[,host:port...]")
    return nodes, opts


def _connect_cluster(url: str, socket_timeout: float, socket_connect_timeout: float, url_setting: str = URL_SETTING,
                     **kwargs: Any) -> Any:
    from redis.cluster import ClusterNode, RedisCluster

    nodes, opts = parse_cluster_url(url)
    try:
        client = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in nodes],
            decode_responses=False,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            **opts,
            **kwargs,
        )
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
        if (auth := _auth_failure(e)) is not None:
            raise StoreUnavailableError(_auth_text(url, auth, opts, url_setting)) from None
        raise StoreUnavailableError(
            f"cannot reach the Redis Cluster at {mask_url(url)!r}: {type(e).__name__}: {_masked(e, opts)}. "
            f"Are its nodes running, and is it a cluster (cluster-enabled yes; a single node takes redis://)?"
        ) from None
    try:
        infos = client.info("server", target_nodes=RedisCluster.ALL_NODES)
    except REDIS_DOWN as e:
        client.close()
        raise StoreUnavailableError(f"cannot reach every node of the Redis Cluster at {mask_url(url)!r}: "
                                    f"{_masked(e, opts)}. Check the nodes `redis-cli cluster nodes` lists") from None
    try:
        per_node = infos.values() if infos and all(isinstance(v, dict) for v in infos.values()) else [infos]
        for info in per_node:
            check_server_version(info)
    except RedisVersionError:
        client.close()
        raise
    return client


def _auth_failure(e: BaseException) -> BaseException | None:
    """The Redis authentication error (``NOAUTH``: no password given; ``WRONGPASS``: a wrong one)
    behind ``e``, following its causes (redis-py wraps it in a cluster error), or None."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _auth_text(url: str, e: BaseException, opts: dict[str, Any] | None = None, setting: str = URL_SETTING) -> str:
    """The message of a refused authentication at ``url``: what Redis said, and where the password
    goes (``setting``, the setting that named the URL)."""
    said = _masked(e, opts or {})
    form = ("redis+cluster://:<password>@host:port[,host:port...], or redis+cluster://<user>:<password>@... for an "
            "ACL user" if is_cluster_url(url) else
            "redis://:<password>@host:port/db, or redis://<user>:<password>@host:port/db for an ACL user")
    return (f"Redis at {mask_url(url)!r} refused the connection: authentication failed ({said}). Give its "
            f"password in {setting} as {form} (a password with '@', ':' or '/' %-encoded)")


def _masked(e: BaseException, opts: dict[str, Any]) -> str:
    text = str(e)
    if text.startswith("-NOAUTH HELLO") or "HELLO must be called with the client already authenticated" in text:
        text = "NOAUTH: the server needs a password"  # redis-py's RESP3 HELLO refusal, which names HELLO AUTH
    pw = opts.get("password")
    return text.replace(pw, "***") if pw else text


def connect(url: str, *, socket_timeout: float = 5.0, socket_connect_timeout: float = 2.0, url_setting: str = URL_SETTING,
            **kwargs: Any) -> redis.Redis:
    """Open a client for ``url`` (e.g. ``"redis://127.0.0.1:6379/0"``) and check the server version.

    A ``redis+cluster://host:port[,host:port...]`` URL (``rediss+cluster://`` for TLS) opens
    redis-py's ``RedisCluster`` instead (every node's version is checked); the store's components
    then use hash-tagged key names (:func:`store.config.resolve_config`).

    The client returns bytes (``decode_responses=False``): stream fields are binary.
    ``socket_timeout`` / ``socket_connect_timeout`` are seconds; ``url_setting`` names the setting
    the URL came from in an authentication failure's message; extra ``kwargs`` go to
    :func:`redis.Redis.from_url`.

    Raises:
        StoreUnavailableError: the server cannot be reached, or refuses the URL's database or
            credentials (cause chained).
        RedisVersionError: the server is older than 6.2.
    """
    if is_cluster_url(url):
        return _connect_cluster(url, socket_timeout, socket_connect_timeout, url_setting, **kwargs)
    client = redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        **kwargs,
    )
    try:
        info = client.info("server")
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:  # before ConnectionError: they subclass it
        client.close()
        raise StoreUnavailableError(_auth_text(url, e, setting=url_setting)) from e
    except (redis.ConnectionError, redis.TimeoutError) as e:
        client.close()
        raise StoreUnavailableError(f"cannot reach Redis at {mask_url(url)!r}: {e}. Is redis-server running there?") from e
    except redis.ResponseError as e:  # reached, but it refused the URL's setup (e.g. "DB index is out of range")
        client.close()
        raise StoreUnavailableError(f"Redis at {mask_url(url)!r} refused the connection: {e}. Check redis.url "
                                    f"(DRAFTD_REDIS__URL): the database number after the port (below the server's "
                                    f"'databases', 16 by default), the user and the password") from e
    try:
        check_server_version(info)
    except RedisVersionError:
        client.close()
        raise
    return client

