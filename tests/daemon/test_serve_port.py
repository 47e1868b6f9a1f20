"""`daemonctl serve --port P` with P in use: it loaded the models (36 s for the packaged pair) and
then died with a traceback around "could not listen ... (in use?)". The port is bound before the
models load, and a port that cannot be bound is one line naming it and the fix, exit 2."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from conftest import REDIS_URL
from daemon.cli import app
from daemon.serve import ServePortError, ServeServer, bind_serve_socket
from serve_helpers import invoke_serve
from serve_helpers import HealthApp  # noqa: E402


@pytest.fixture
def taken():
    """A port another process listens on (this test's own listening socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_told_before_the_models_load(taken, tmp_path, monkeypatch, key_prefix):
    import decoder.models.loading

    loaded = []
    monkeypatch.setattr(decoder.models.loading, "load_pair", lambda *a, **kw: loaded.append(a) or 1 / 0)
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_REDIS__URL", REDIS_URL)
    monkeypatch.setenv("DRAFTD_STORE__KEY_PREFIX", key_prefix)
    r = invoke_serve(app, "--port", str(taken))
    assert not loaded, "the models were loaded before the port was checked"
    assert r.exit_code == 2, (r.output, r.exception)
    text = " ".join(r.output.split())
    assert f"cannot listen on 127.0.0.1:{taken} (Address already in use)" in text, r.output
    assert "--port" in text and "Traceback" not in r.output, r.output


def test_bind_errors_name_the_address_and_the_option():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServePortError, match=f"127.0.0.1:{port} .*pick a free port with --port"):
            bind_serve_socket("127.0.0.1", port)
    with pytest.raises(ServePortError, match="192.0.2.1:8000 .*Set --host"):  # TEST-NET-1: no host's address
        bind_serve_socket("192.0.2.1", 8000)


def test_the_server_listens_on_the_socket_bound_before_it():
    sock = bind_serve_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with ServeServer(HealthApp(), "127.0.0.1", port, sock=sock) as server:
        assert server.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
        with pytest.raises(ServePortError):  # held while it serves
            bind_serve_socket("127.0.0.1", port)
