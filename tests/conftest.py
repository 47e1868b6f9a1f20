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


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory):
    """A redis-server of our own with ``--requirepass the-right-one`` on a free loopback port
    (skipped where redis-server is not on PATH); yields its port."""
    import shutil
    import socket
    import subprocess
    import time

    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")

    with socket.socket() as s:  # a port the kernel hands out as free
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path_factory.mktemp("authredis")), "--requirepass", "the-right-one"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        while True:
            try:
                redis.Redis(port=port, password="the-right-one", socket_connect_timeout=0.2).ping()
                break
            except redis.ConnectionError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(10)
