"""connect() and the Redis >= 6.2 check."""

from __future__ import annotations

import pytest

from store.client import check_server_version, connect, parse_version
from store.errors import RedisVersionError, StoreUnavailableError

from store_helpers import SHARED_URL, free_port


def test_parse_version():
    assert parse_version("7.0.15") == (7, 0, 15)
    assert parse_version("6.2") == (6, 2, 0)
    assert parse_version("7.4.0-rc1") == (7, 4, 0)
    with pytest.raises(RedisVersionError, match="'banana'"):
        parse_version("banana")


@pytest.mark.parametrize("v", ["6.2.0", "6.2.14", "7.0.15", "7.2.4"])
def test_supported_versions_pass(v):
    assert check_server_version({"redis_version": v}) == parse_version(v)


@pytest.mark.parametrize("v", ["6.0.16", "5.0.7", "6.1.99"])
def test_old_versions_fail_naming_the_version(v):
    with pytest.raises(RedisVersionError) as ei:
        check_server_version({"redis_version": v})
    assert v in str(ei.value) and ">= 6.2" in str(ei.value)


def test_missing_version_field():
    with pytest.raises(RedisVersionError, match="redis_version"):
        check_server_version({})


def test_real_connect_checks_the_server():
    c = connect(SHARED_URL)
    try:
        found = check_server_version(c.info("server"))
        assert found >= (6, 2, 0)
        assert c.ping() is True
        c.set(b"test:store:connect-probe", b"\xff\x00")
        assert c.get(b"test:store:connect-probe") == b"\xff\x00"  # bytes, not decoded
        c.delete(b"test:store:connect-probe")
    finally:
        c.close()


def test_connect_to_nothing_raises_unavailable():
    port = free_port()
    with pytest.raises(StoreUnavailableError, match=str(port)):
        connect(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.5)
