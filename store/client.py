"""Connecting to Redis, with the server version check ``store`` relies on.

``store`` needs Redis >= 6.2: XAUTOCLAIM (reclaiming a dead consumer's entries), XADD/XTRIM
``MINID`` (age cap) and ZMSCORE (batch dedupe) all arrived in 6.2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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

MIN_REDIS_VERSION = (6, 2, 0)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # errors that mean "Redis unreachable"


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


def connect(url: str, *, socket_timeout: float = 5.0, socket_connect_timeout: float = 2.0, **kwargs: Any) -> redis.Redis:
    """Open a client for ``url`` (e.g. ``"redis://127.0.0.1:6379/0"``) and check the server version.

    The client returns bytes (``decode_responses=False``): stream fields are binary.
    ``socket_timeout`` / ``socket_connect_timeout`` are seconds; extra ``kwargs`` go to
    :func:`redis.Redis.from_url`.

    Raises:
        StoreUnavailableError: the server cannot be reached (cause chained).
        RedisVersionError: the server is older than 6.2.
    """
    client = redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        **kwargs,
    )
    try:
        info = client.info("server")
    except (redis.ConnectionError, redis.TimeoutError) as e:
        client.close()
        raise StoreUnavailableError(f"cannot reach Redis at {url!r}: {e}. Is redis-server running there?") from e
    try:
        check_server_version(info)
    except RedisVersionError:
        client.close()
        raise
    return client


def mask_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``; a ``password=``
    query parameter is masked too (``unix:///run/redis.sock?password=secret``)."""
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc[1]}"))
    if parts.query:
        head, _, query = url.partition("?")  # not urlunsplit: it drops the empty netloc of unix:///path
        q = [(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        url = f"{head}?{urlencode(q, safe='*')}"
    return url
