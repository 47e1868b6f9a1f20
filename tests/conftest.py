"""Fixtures shared by every package's tests: the real Redis on 127.0.0.1:6379 with a unique key
prefix per test, whose keys are deleted afterwards.

No Redis is a failure, not a skip: `.ci/run` starts one when none answers, and a suite that
silently skipped its store tests would prove nothing.
"""

from __future__ import annotations

import os
import uuid

import pytest

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_client():
    import redis

    r = redis.Redis.from_url(REDIS_URL, decode_responses=False)
    try:
        r.ping()
    except redis.ConnectionError as e:
        pytest.fail(f"no Redis answers at {REDIS_URL} ({e}): start one with `redis-server --daemonize yes`")
    yield r
    r.close()


@pytest.fixture
def key_prefix(request, redis_client):
    """``test:<package>:<8 hex>:``; every key under it is deleted after the test."""
    package = request.node.path.parent.name
    prefix = f"test:{package}:{uuid.uuid4().hex[:8]}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=prefix + "*"))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(autouse=True)
def _isolated_from_user_config(monkeypatch):
    """Tests configure draftd explicitly: a user's own DRAFTD_* settings (state dir, key prefix,
    Redis URL, API port...) must not leak into them. DRAFTD_CACHE_DIR (converted models) stays."""
    for k in list(os.environ):
        if k.startswith("DRAFTD_") and k != "DRAFTD_CACHE_DIR":
            monkeypatch.delenv(k)
