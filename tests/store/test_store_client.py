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


SECRET = "s3cret-Pa55"


def _whole(e: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(e))


def test_an_unreachable_redis_is_named_with_its_password_masked():
    """Issue 37 item 3: the message (and the chained traceback) of a failed connect never carries
    the URL's password, in the userinfo or in a ``password=`` query parameter."""
    port = free_port()
    for url in (f"redis://:{SECRET}@127.0.0.1:{port}/0", f"redis://bob:{SECRET}@127.0.0.1:{port}/0",
                f"redis://127.0.0.1:{port}/0?password={SECRET}"):
        with pytest.raises(StoreUnavailableError) as ei:
            connect(url, socket_connect_timeout=0.5)
        assert SECRET not in _whole(ei.value), url
        assert "***" in str(ei.value) and str(port) in str(ei.value)


def _port_free(socket, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_wrong_password_is_named_with_its_password_masked(password_redis):
    with pytest.raises(StoreUnavailableError) as ei:
        connect(f"redis://:{SECRET}@127.0.0.1:{password_redis}/0")
    assert SECRET not in _whole(ei.value)
    assert "***" in str(ei.value)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:{port}/0",  # no password: NOAUTH
    "redis://:" + SECRET + "@127.0.0.1:{port}/0",  # a wrong one: WRONGPASS
    "redis://bob:" + SECRET + "@127.0.0.1:{port}/0",  # an ACL user the server lacks
    "redis+cluster://127.0.0.1:{port}",  # the cluster client's first command, NOAUTH, wrapped in its own error
    "redis+cluster://:" + SECRET + "@127.0.0.1:{port}",
])
def test_an_authentication_failure_says_so_and_names_the_setting_that_holds_the_password(password_redis, url):
    """The break helper's: a Redis with requirepass, reached without the password (or with a
    wrong one), was reported as "cannot reach Redis ... Is redis-server running there?": it is
    running, and it answered."""
    url = url.format(port=password_redis)
    with pytest.raises(StoreUnavailableError) as ei:
        connect(url)
    msg = str(ei.value)
    assert msg.startswith("Redis at '") and f":{password_redis}" in msg, msg
    assert "refused the connection: authentication failed (" in msg, msg
    assert "Give its password in redis.url (DRAFTD_REDIS__URL) as redis" in msg, msg
    assert "Is redis-server running" not in msg and "reach" not in msg, msg
    assert SECRET not in _whole(ei.value)


def test_the_right_password_connects(password_redis):
    c = connect(f"redis://:the-right-one@127.0.0.1:{password_redis}/0")
    try:
        assert c.ping() is True
    finally:
        c.close()


@pytest.mark.parametrize("url,want", [
    ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
    ("redis://u:pw@h:1/0", "redis://u:***@h:1/0"),
    ("rediss://h:1/0", "rediss://h:1/0"),
    ("unix:///run/r.sock?password=pw&db=1", "unix:///run/r.sock?password=***&db=1"),
    ("redis://:pw@h:notaport/0", "redis://:***@h:notaport/0"),
])
def test_mask_url(url, want):
    from store.client import mask_url

    assert mask_url(url) == want


def test_mask_url_of_a_typo_hides_what_precedes_the_at():
    from store.client import mask_url

    assert mask_url("redis//:pw@h:1/0") == "***@h:1/0"
    assert mask_url("unix:///run/a@b.sock") == "unix:///run/a@b.sock"


def test_a_database_the_server_lacks_is_named_with_the_setting_to_fix():
    # the adversarial helper's: redis://.../999 gave `daemonctl status` a traceback ("DB index is out of range")
    url = SHARED_URL.rsplit("/", 1)[0] + "/999"  # redis://127.0.0.1:6379/999
    with pytest.raises(StoreUnavailableError) as ei:
        connect(url)
    msg = str(ei.value)
    assert "/999" in msg and "DB index is out of range" in msg and "DRAFTD_REDIS__URL" in msg, msg
