"""serve.read_timeout_s: a connection that does not send a whole request in time is closed with a
408 (stalled clients, slowloris, held connections open for ever: uvicorn times only the wait
between requests), while a request being served is never cut by it and kept-alive connections
work; on uvicorn's httptools and h11 protocols alike (daemon/http_timeout.py)."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

pytest.importorskip("openai")

from serve_helpers import MODEL, serving  # noqa: E402

READ_TIMEOUT_S = 1.0
CLOSED_WITHIN_S = 10.0  # a bound on the wait, not a speed claim


@pytest.fixture(params=["httptools", "h11"])
def srv(request, redis_client, key_prefix, monkeypatch):
    import daemon.serve

    if request.param == "httptools":
        pytest.importorskip("httptools")
    monkeypatch.setattr(daemon.serve, "event_loop_stack", lambda: ("asyncio", request.param))
    with serving(redis_client, key_prefix, read_timeout_s=READ_TIMEOUT_S) as s:
        assert s.server.http == request.param
        yield s


def connect(s) -> socket.socket:
    return socket.create_connection(("127.0.0.1", s.server.port), timeout=CLOSED_WITHIN_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; fails if it has not closed within the bound."""
    got, start = b"", time.monotonic()
    while True:
        left = CLOSED_WITHIN_S - (time.monotonic() - start)
        assert left > 0, f"the connection is still open after {CLOSED_WITHIN_S} s (got {got[:200]!r})"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            return got
        got += chunk


def assert_408(got: bytes) -> None:
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), got[:300]
    lines = head.lower().split(b"\r\n")
    assert b"connection: close" in lines and b"content-type: application/json" in lines, head
    assert b"content-length: %d" % len(body) in lines, head
    err = json.loads(body)["error"]
    assert err["code"] == "read_timeout" and err["type"] == "timeout_error", err
    assert "within 1 s (serve.read_timeout_s)" in err["message"], err


def request_bytes(body: dict, path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a Content-Length on a connection that stays open."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(int(ln.split(b":")[1]) for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-body: {head!r}"
        body += chunk
    return int(head.split(b" ")[1]), body


def test_a_connection_that_sends_nothing_gets_a_408_and_is_closed(srv):
    with connect(srv) as sock:
        assert_408(read_until_closed(sock))


def test_half_a_request_line_gets_a_408_and_is_closed(srv):
    with connect(srv) as sock:
        sock.sendall(b"POST /v1/compl")
        assert_408(read_until_closed(sock))


def test_a_body_shorter_than_its_content_length_gets_a_408_and_is_closed(srv):
    with connect(srv) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"model": ')
        assert_408(read_until_closed(sock))
    status, body = request_once(srv, {"model": MODEL, "prompt": "abc", "max_tokens": 2, "temperature": 0})
    assert status == 200, body  # the app that waited for that body let go of it


def test_a_trickle_of_header_bytes_does_not_push_the_deadline_back(srv):
    """slowloris proper: a byte every 0.1 s keeps the connection busy but never completes a request."""
    with connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        start = time.monotonic()
        while not select.select([sock], [], [], 0.1)[0]:
            assert time.monotonic() - start < CLOSED_WITHIN_S, "a trickling client is still connected"
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                return  # closed (the reset may have cost the 408)
        try:
            got = read_until_closed(sock)
        except ConnectionResetError:
            return
        assert got == b"" or got.startswith(b"HTTP/1.1 408 "), got[:300]


def request_once(s, body: dict) -> tuple[int, bytes]:
    with connect(s) as sock:
        sock.sendall(request_bytes(body))
        return read_response(sock)


def slow_forwards(s, monkeypatch, seconds: float) -> None:
    dec = s.loop.decoder
    real = dec._target_logits

    def slow(tokens, seq, keep):
        time.sleep(seconds)
        return real(tokens, seq, keep)

    monkeypatch.setattr(dec, "_target_logits", slow)


def test_requests_served_longer_than_the_read_timeout_are_not_cut_and_the_connection_stays_usable(srv, monkeypatch):
    """A streamed, then a non-streamed completion of 20 forwards at 0.1 s each on one kept-alive
    connection (a non-streamed one has sent nothing of its response until it ends), then a third."""
    import http.client

    slow_forwards(srv, monkeypatch, 0.1)
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=60)
    base = {"model": MODEL, "prompt": "abc", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "gamma": 0}
    try:
        start = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps({**base, "stream": True}),
                     {"Content-Type": "application/json"})
        sock = conn.sock
        r = conn.getresponse()
        text = r.read().decode()
        assert r.status == 200 and time.monotonic() - start > READ_TIMEOUT_S, text  # served past the timeout
        datas = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
        assert datas[-1] == "[DONE]" and json.loads(datas[-2])["choices"][0]["finish_reason"] == "length", text
        start = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps(base), {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
        assert r.status == 200 and time.monotonic() - start > READ_TIMEOUT_S, out
        assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 20, out
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        assert r.status == 200 and conn.sock is sock  # one connection throughout
    finally:
        conn.close()


def test_keep_alive_times_each_request_from_its_own_first_byte(srv):
    """Two requests on one connection: 0.7 s idle after the first, then the second in two halves
    0.45 s apart; 1.15 s after the first response but 0.45 s after the second's first byte."""
    body = request_bytes({"model": MODEL, "prompt": "abc", "max_tokens": 2, "temperature": 0})
    with connect(srv) as sock:
        sock.sendall(body)
        status, out = read_response(sock)
        assert status == 200, out
        time.sleep(0.7)
        sock.sendall(body[:30])
        time.sleep(0.45)
        sock.sendall(body[30:])
        status, out = read_response(sock)
        assert status == 200, out
        assert json.loads(out)["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_the_setting_refuses_what_is_not_a_positive_finite_number_of_seconds(monkeypatch, value):
    from daemon.settings import ConfigError, load_settings

    monkeypatch.setenv("DRAFTD_SERVE__READ_TIMEOUT_S", value)
    with pytest.raises(ConfigError) as ei:
        load_settings()
    assert (f"serve.read_timeout_s (DRAFTD_SERVE__READ_TIMEOUT_S): {value} is not a read timeout: give "
            f"serve.read_timeout_s a finite number of seconds above 0 (default 30)") in str(ei.value), str(ei.value)


def test_the_setting_defaults_to_30_seconds_and_takes_a_fraction(monkeypatch):
    from daemon.settings import load_settings

    assert load_settings().serve.read_timeout_s == 30.0
    monkeypatch.setenv("DRAFTD_SERVE__READ_TIMEOUT_S", "2.5")
    assert load_settings().serve.read_timeout_s == 2.5


def test_the_protocol_refuses_a_bad_timeout_or_an_unknown_implementation():
    from daemon.http_timeout import read_timeout_protocol

    with pytest.raises(ValueError, match=r"read_timeout_s=0: give a finite number of seconds above 0"):
        read_timeout_protocol("h11", 0)
    with pytest.raises(ValueError, match=r"http='auto'"):
        read_timeout_protocol("auto", 1.0)
