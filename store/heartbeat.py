"""Heartbeats of the serving decoders (``daemonctl serve``), so ``daemonctl status`` lists them.

Key names (``P`` = ``key_prefix``)::

    P serving:{server_id}      string, JSON heartbeat of one server, expiring after ``ttl_s``

A heartbeat is one JSON object (server id, adapter version, requests served, queue depth,
speculation per workload, ``ts`` = seconds since the epoch when written). It expires by itself,
so a server that died without a word disappears from the listing after its TTL.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from store.config import StoreConfig


def heartbeat_key(config: StoreConfig, server_id: str) -> str:
    return f"{config.key_prefix}serving:{server_id}"


def write_heartbeat(client: redis.Redis, config: StoreConfig, server_id: str, data: dict[str, Any], ttl_s: float) -> None:
    """SET the heartbeat with a TTL (ms precision). Raises redis errors (the caller counts them)."""
    client.set(heartbeat_key(config, server_id), json.dumps(data, default=str), px=max(1, int(ttl_s * 1000)))


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
