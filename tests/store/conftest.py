"""Fixtures for store tests: a real Redis (the shared one on 6379 with a unique key prefix, or a
private redis-server on a free port for kill/restart tests) and realistic samples."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from store.client import connect
from store.config import StoreConfig
from store_helpers import SHARED_URL, LocalCluster, PrivateRedis, make_sample


@pytest.fixture
def prefix() -> str:
    return f"test:store:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def client(prefix: str):
    """A client on the shared Redis; every key under the test's prefix is deleted afterwards."""
    c = connect(SHARED_URL)
    yield c
    for k in c.scan_iter(match=f"{prefix}*".encode(), count=1000):
        c.delete(k)
    c.close()


@pytest.fixture
def cfg(prefix: str) -> StoreConfig:
    return StoreConfig(key_prefix=prefix)


@pytest.fixture
def private_redis(tmp_path: Path):
    """A redis-server of our own on a free port (AOF on, fsync always), killed afterwards."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    r = PrivateRedis(tmp_path, aof=True)
    r.start()
    yield r
    r.kill()


@pytest.fixture
def sample_factory():
    return make_sample


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster of our own (3 masters, 1 replica each) on free loopback ports, for the
    tests of one module; killed afterwards (store_helpers.LocalCluster)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not on PATH")
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1)
    try:
        c.start()
        yield c
    finally:
        c.stop()
