"""A password-protected Redis on the default address (``redis.default_url``, no ``redis.url``):
it answers, with NOAUTH, and the daemon says its authentication failed and where the password goes,
instead of taking it for "nothing answers" and starting the embedded Redis without a word."""

import socket

import pytest

from daemon.redis_embed import answers, open_redis
from daemon.settings import RedisSettings
from store.client import StoreUnavailableError


@pytest.mark.parametrize("embedded", ["auto", "never"])
def test_a_password_protected_redis_on_the_default_address_is_named_not_replaced(password_redis, tmp_path, embedded):
    url = f"redis://127.0.0.1:{password_redis}/0"
    assert answers(url)  # NOAUTH is an answer
    cfg = RedisSettings(default_url=url, embedded=embedded)
    with pytest.raises(StoreUnavailableError) as ei:
        with open_redis(cfg, tmp_path / "redis"):
            pass
    msg = str(ei.value)
    assert msg.startswith(f"Redis at '{url}' refused the connection: authentication failed ("), msg
    assert ("Give its password in redis.default_url (DRAFTD_REDIS__DEFAULT_URL) or redis.url (DRAFTD_REDIS__URL) as "
            "redis://:<password>@host:port/db") in msg, msg  # the setting the user pointed at is named first
    assert "HELLO" not in msg, msg  # redis-py's RESP3 refusal text named HELLO AUTH, which draftd never asks for
    assert msg.endswith("; or, to leave that Redis alone, set redis.embedded to 'always' (DRAFTD_REDIS__EMBEDDED=always) "
                        "for the embedded one"), msg
    assert not (tmp_path / "redis").exists()  # no embedded server started


def test_nothing_on_the_default_address_is_still_nothing():
    with socket.socket() as s:  # a port the kernel hands out as free, nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not answers(f"redis://127.0.0.1:{port}/0", timeout=0.2)
