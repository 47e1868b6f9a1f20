"""serve.keep_alive_s: how long `daemonctl serve` keeps an idle kept-alive connection open.

uvicorn's default (5 s) equals httpx's and the openai client's idle expiry (5 s), so a client could
reuse a connection just as the server closed it (a walkthrough's demo died of the reset); serve's
keep-alive is longer than the client's expiry, so the client lets an idle connection go first.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from daemon.serve import DEFAULT_KEEP_ALIVE_S, ServeServer
from daemon.settings import ServeSettings
from serve_helpers import HealthApp  # noqa: E402


def _openai_httpx():
    """httpx, or the httpx2 fork openai 3 builds on: the package of openai's Client class."""
    import importlib

    import openai

    client = next(c for c in openai.DefaultHttpxClient.__mro__ if c.__name__ == "Client")
    return importlib.import_module(client.__module__.partition(".")[0])


def test_serves_keep_alive_outlasts_the_clients_idle_expiry():
    client_expiry = _openai_httpx().Limits().keepalive_expiry  # httpx's (and the openai client's) default
    assert ServeSettings().keep_alive_s == DEFAULT_KEEP_ALIVE_S == 30.0
    assert ServeSettings().keep_alive_s > client_expiry


def test_the_setting_reaches_uvicorn():
    assert ServeServer(HealthApp(), "127.0.0.1", 0).server.config.timeout_keep_alive == 30.0
    assert ServeServer(HealthApp(), "127.0.0.1", 0, keep_alive_s=12.5).server.config.timeout_keep_alive == 12.5


def test_an_idle_connection_is_closed_after_the_keep_alive():
    """A raw connection: one request answered, then the server closes it once idle keep_alive_s
    (here 0.2 s; the read below waits at most 60 s, so only an end of stream passes)."""
    import socket

    with ServeServer(HealthApp(), "127.0.0.1", 0, keep_alive_s=0.2) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            got = b""
            while not got.endswith(b'{"ok": true}'):
                chunk = s.recv(4096)
                assert chunk, got  # the whole response first
                got += chunk
            assert got.startswith(b"HTTP/1.1 200")
            assert s.recv(4096) == b""  # closed by the server, kept alive no longer


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_a_bad_keep_alive_is_refused_naming_the_setting(bad):
    with pytest.raises(ValidationError, match="serve.keep_alive_s"):
        ServeSettings(keep_alive_s=bad)
    with pytest.raises(ValueError, match="serve.keep_alive_s"):
        ServeServer(HealthApp(), "127.0.0.1", 0, keep_alive_s=bad)
