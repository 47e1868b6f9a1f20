"""A read timeout for uvicorn's HTTP/1.1 protocols, against slow or stalled clients (slowloris).

uvicorn times a connection only between requests (``timeout_keep_alive``, armed when a response
completes): a connection that sends nothing, half a request line or its headers, or fewer body
bytes than its ``Content-Length`` announced, is held open for ever, and enough of them exhaust the
server's file descriptors. :func:`read_timeout_protocol` subclasses the protocol class serve runs
on (``httptools`` or ``h11``, :func:`daemon.serve.event_loop_stack`) so that a request must
arrive whole within ``read_timeout_s`` seconds:

* the timer is armed when the connection opens, and again when bytes arrive while no request is
  being served (the next request on a kept-alive connection, or the rest of a body after an early
  answer); it keeps running while more bytes of the same request trickle in;
* it is disarmed once the request is fully read (headers and body) and is being served, so a long
  generation is never cut by it, and while a pipelined request waits behind another's response;
* past it, a client that has been sent nothing of a response gets a 408 with an OpenAI error body
  (``code`` ``read_timeout``) and ``Connection: close``; the connection is closed in any case.

It relies on these uvicorn internals of both ``HttpToolsProtocol`` and ``H11Protocol`` (as read in
uvicorn 0.55; nothing is pinned; tests/daemon/test_serve_read_timeout.py runs on both): the
``asyncio.Protocol`` methods ``connection_made``, ``data_received`` and ``connection_lost``;
``on_response_complete`` (the callback a ``RequestResponseCycle`` calls when its response is sent,
looked up on the instance); the attributes ``transport``, ``loop``, ``client``,
``server_state.default_headers`` and ``cycle`` (the latest request's ``RequestResponseCycle``, with
``more_body``, ``response_started``, ``response_complete`` and ``disconnected``); and
``HttpToolsProtocol.pipeline`` (requests parsed while another is served; ``H11Protocol`` has none:
h11 pauses reading instead).
"""

from __future__ import annotations

import asyncio
import json
import math

import structlog

log = structlog.get_logger("daemon.serve")

DEFAULT_READ_TIMEOUT_S = 30.0


def timeout_body(read_timeout_s: float) -> bytes:
    """The 408's OpenAI error body."""
    message = (f"the request was not received in full within {read_timeout_s:g} s (serve.read_timeout_s): send the "
               f"request line, headers and body without pausing, or raise serve.read_timeout_s on the server")
    return json.dumps({"error": {"message": message, "type": "timeout_error", "param": None,
                                 "code": "read_timeout"}}).encode()


class _ReadTimeout:
    """Mixed in before uvicorn's protocol class (see the module docstring)."""

    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # a 400, or a websocket upgrade
            self._disarm_read_timer()
        elif self._serving():
            self._disarm_read_timer()
        else:
            self._arm_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self._serving():  # closed, or a pipelined request (read whole) started
            self._disarm_read_timer()
        elif self.cycle is not None and self.cycle.more_body:  # a started request's body, or an early answer's
            self._arm_read_timer()
        # else idle: uvicorn's keep-alive timer runs until the next request's bytes

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_timer()
        super().connection_lost(exc)

    def _serving(self) -> bool:
        """A request read whole is being served (or one waits behind another's response)."""
        cycle = self.cycle
        return bool(getattr(self, "pipeline", None)) or (
            cycle is not None and not cycle.more_body and not cycle.response_complete)

    def _arm_read_timer(self) -> None:
        """Start the timer unless it runs: the bytes of one request never push its deadline back."""
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self._serving():
            return
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app waiting for the body sees the client gone; its answer is dropped
        if not answering:
            self.transport.write(self._timeout_response())
        log.info("serve_read_timeout", client="%s:%d" % self.client if self.client else None,
                 read_timeout_s=self.read_timeout_s)
        self.transport.close()

    def _timeout_response(self) -> bytes:
        body = timeout_body(self.read_timeout_s)
        head = [b"HTTP/1.1 408 Request Timeout\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        return b"".join(head) + body


def read_timeout_protocol(http: str, read_timeout_s: float) -> type:
    """uvicorn's protocol class for ``http`` (``"httptools"`` or ``"h11"``, as uvicorn.Config's
    ``http`` names them) with the read timeout; pass it as ``uvicorn.Config(http=...)``."""
    if not (isinstance(read_timeout_s, (int, float)) and math.isfinite(read_timeout_s) and read_timeout_s > 0):
        raise ValueError(f"read_timeout_s={read_timeout_s!r}: give a finite number of seconds above 0 "
                         f"(serve.read_timeout_s; default {DEFAULT_READ_TIMEOUT_S:g})")
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"http={http!r}: the read timeout covers uvicorn's 'httptools' and 'h11' protocols; name one")
    return type(f"ReadTimeout{base.__name__}", (_ReadTimeout, base), {"read_timeout_s": float(read_timeout_s)})
