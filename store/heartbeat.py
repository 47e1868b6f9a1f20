"""Heartbeats of the serving decoders (``daemonctl serve``), so ``daemonctl status`` lists them.

Key names (``P`` = ``key_prefix``)::

    P serving:{server_id}      string, JSON heartbeat of one server, expiring after ``ttl_s``

A heartbeat is one JSON object (server id, adapter version, requests served, queue depth,
speculation per workload, ``ts`` = seconds since the epoch when written). It expires by itself,
so a server that died without a word disappears from the listing after its TTL.

N replicas: each needs its own ``server_id`` (the default, ``hostname-pid``, is; one set by hand
may not be). Every heartbeat carries ``instance``, a random id of the writing process, and is
written with ``SET ... GET``: when the value it replaces is a live heartbeat of another instance
under the same id, two replicas share the id (status would show one of them, flickering); the
write logs ``heartbeat_server_id_clash`` naming the id and returns False.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import redis
import structlog

from store.config import StoreConfig

log = structlog.get_logger(__name__)

INSTANCE = uuid.uuid4().hex[:12]  # this process's heartbeats carry it (``instance``)


def heartbeat_key(config: StoreConfig, server_id: str) -> str:
    return f"{config.key_prefix}serving:{server_id}"


def write_heartbeat(client: redis.Redis, config: StoreConfig, server_id: str, data: dict[str, Any], ttl_s: float,
                    *, instance: str = INSTANCE) -> bool:
    """SET the heartbeat with a TTL (ms precision), ``instance`` added (the writing process's id).
    Returns False (and logs) when it replaced a live heartbeat that another instance wrote under the
    same ``server_id``. Raises redis errors (the caller counts them)."""
    data = {**data, "instance": data.get("instance", instance)}
    prev = client.set(heartbeat_key(config, server_id), json.dumps(data, default=str), px=max(1, int(ttl_s * 1000)),
                      get=True)
    if prev is None:
        return True
    try:
        other = json.loads(prev).get("instance")
    except (ValueError, AttributeError):
        return True
    if other and other != data["instance"]:
        log.warning("heartbeat_server_id_clash", server_id=server_id, this_instance=data["instance"],
                    other_instance=other, fix="give each serving replica its own server id (serve.server_id); "
                    "status lists one heartbeat per id")
        return False
    return True


def clear_heartbeat(client: redis.Redis, config: StoreConfig, server_id: str) -> None:
    client.delete(heartbeat_key(config, server_id))


def read_heartbeats(client: redis.Redis, config: StoreConfig) -> list[dict[str, Any]]:
    """Every live heartbeat under the prefix (SCAN, never KEYS), sorted by server id; entries that
    are not JSON objects are skipped."""
    pattern = heartbeat_key(config, "").replace("*", r"\*") + "*"
    out = []
    for key in client.scan_iter(match=pattern, count=500):
        raw = client.get(key)
        if raw is None:
            continue
        try:
            d = json.loads(raw)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return sorted(out, key=lambda d: str(d.get("server_id", "")))
