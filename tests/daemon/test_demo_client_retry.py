"""The demo's API client and a kept-alive connection closed as a request arrives (daemon/http_retry.py).

A walkthrough's demo died with ``APIConnectionError`` (httpx ``ReadError`` [Errno 104] Connection
reset by peer) on the request after a pause: the client (openai, ``max_retries=0``) reused a
kept-alive connection just as the server closed it, both ends expiring it after 5 s. The server
here is a raw socket server that does the same on purpose: it closes a kept-alive connection with
the request unread (the kernel answers with a reset, as uvicorn's keep-alive timer firing on a
connection whose request bytes it has not read yet).
"""

from __future__ import annotations

import io
import json
import select
import socket
import struct
import threading

import openai
import pytest

from daemon.http_retry import CLIENT_KEEPALIVE_EXPIRY_S, client_keepalive_expiry, openai_httpx, retrying_openai

COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "text": "served", "finish_reason": "stop", "logprobs": None}]}


def _read_request(conn: socket.socket) -> bytes:
    """One HTTP/1.1 request's bytes (head and Content-Length body); b"" at the end of the stream."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return data


def _reset(conn: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a reset, as for a close with unread bytes."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _respond(conn: socket.socket, status: str, body: bytes, ctype: str = "application/json") -> None:
    conn.sendall(f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)


class PlanServer(threading.Thread):
    """Serves request k (1-based, over all connections, one connection at a time) as ``plan[k]``
    says: "ok" (a 200 completion, the connection kept alive; the default), "reset" (the
    connection closed with the request unread), "error" (a 500 with an OpenAI error body),
    "chunk_then_close" (a streamed 200's head and one SSE chunk, then the connection closed
    before the stream's end)."""

    def __init__(self, plan: dict[int, str]):
        super().__init__(daemon=True)
        self.plan, self.requests, self.connections = plan, 0, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.stop = threading.Event()

    def run(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            self.connections += 1
            with conn:
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        while not self.stop.is_set():
            if not select.select([conn], [], [], 0.1)[0]:
                continue
            action = self.plan.get(self.requests + 1, "ok")
            if action == "reset":  # the request's bytes are there, unread
                self.requests += 1
                _reset(conn)
                return
            if not _read_request(conn):
                return
            self.requests += 1
            if action == "ok":
                _respond(conn, "200 OK", json.dumps(COMPLETION).encode())
            elif action == "error":
                _respond(conn, "500 Internal Server Error", json.dumps({"error": {
                    "message": "boom", "type": "server_error", "param": None, "code": "internal_error"}}).encode())
            else:  # chunk_then_close
                chunk = json.dumps(COMPLETION | {"choices": [COMPLETION["choices"][0] | {"finish_reason": None}]})
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                event = f"data: {chunk}\n\n".encode()
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                return  # closed without the last chunk

    def __enter__(self) -> "PlanServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(5)
        self.sock.close()


def _create(client, **kw):
    return client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, temperature=0, **kw)


def test_the_walkthroughs_failure_reproduces_with_the_old_client():
    """The demo's former client (openai, max_retries=0): the kept-alive connection closed under the
    second request is an APIConnectionError caused by httpx's ReadError (a reset, as in the
    walkthrough) or RemoteProtocolError (an end of stream first, as loopback may deliver it)."""
    with PlanServer({2: "reset"}) as server:
        client = openai.OpenAI(base_url=server.url, api_key="demo", max_retries=0, timeout=30)
        assert _create(client).choices[0].text == "served"
        with pytest.raises(openai.APIConnectionError) as e:
            _create(client)
        hx = openai_httpx()  # a reset, or an end of stream where the response's head should be
        assert isinstance(e.value.__cause__, (hx.ReadError, hx.RemoteProtocolError)), repr(e.value.__cause__)
        assert (server.requests, server.connections) == (2, 1)  # the second request went on the kept-alive connection


def test_a_request_reset_before_its_response_is_resent_on_a_new_connection_and_counted():
    seen = []
    with PlanServer({2: "reset"}) as server:
        client, transport = retrying_openai(server.url, server_keep_alive_s=30, timeout_s=30, backoff_s=0,
                                            on_retry=seen.append)
        assert _create(client).choices[0].text == "served"
        assert _create(client).choices[0].text == "served"
        assert transport.retried == 1
        assert (server.requests, server.connections) == (3, 2)  # 1 served, 1 reset unread, its resend on a new one
    assert len(seen) == 1 and type(seen[0]).__name__ in ("ReadError", "RemoteProtocolError"), seen


def test_the_retries_are_bounded_and_the_last_error_reaches_the_caller():
    with PlanServer({1: "reset", 2: "reset", 3: "reset"}) as server:
        client, transport = retrying_openai(server.url, server_keep_alive_s=30, timeout_s=30, retries=2, backoff_s=0)
        with pytest.raises(openai.APIConnectionError):
            _create(client)
        assert transport.retried == 2 and server.requests == 3


def test_a_server_error_is_not_resent():
    """A 500 is the server's answer: resending it would hide it (the openai client's max_retries would)."""
    with PlanServer({1: "error"}) as server:
        client, transport = retrying_openai(server.url, server_keep_alive_s=30, timeout_s=30, backoff_s=0)
        with pytest.raises(openai.InternalServerError):
            _create(client)
        assert transport.retried == 0 and server.requests == 1


def test_a_stream_that_delivered_a_chunk_is_never_replayed():
    with PlanServer({1: "chunk_then_close"}) as server:
        client, transport = retrying_openai(server.url, server_keep_alive_s=30, timeout_s=30, backoff_s=0)
        got = []
        with pytest.raises(Exception) as e:  # httpx's error on the broken body, whichever the openai version maps it to
            for chunk in _create(client, stream=True):
                got.append(chunk.choices[0].text)
        assert got == ["served"], (got, e.value)
        assert transport.retried == 0 and server.requests == 1


def test_the_client_lets_an_idle_connection_go_before_the_server_closes_it():
    assert openai_httpx().Limits().keepalive_expiry == CLIENT_KEEPALIVE_EXPIRY_S == 5.0  # httpx's own default
    assert client_keepalive_expiry(30.0) == 5.0
    assert client_keepalive_expiry(4.0) == 2.0
    for bad in (0, -1, float("nan"), float("inf"), "30"):
        with pytest.raises(ValueError, match="serve.keep_alive_s"):
            client_keepalive_expiry(bad)


def test_the_demo_says_once_that_its_client_resent_a_request():
    from rich.console import Console

    import daemon.demo as demo

    screen = io.StringIO()
    note = demo._resend_note(Console(file=screen, width=400))
    hx = openai_httpx()
    note(hx.ReadError("[Errno 104] Connection reset by peer"))
    note(hx.ConnectError("[Errno 111] Connection refused"))
    text = screen.getvalue()
    assert text.count("the demo's client resent a request") == 1, text
    assert "ReadError: [Errno 104] Connection reset by peer" in text and "client_retries" in text, text
