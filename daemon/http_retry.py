"""The client side of a kept-alive connection's race: resend a request whose connection failed
before any response byte.

An HTTP/1.1 client keeps an idle connection for its next request (httpx and the openai client:
``Limits.keepalive_expiry``, 5 s) and the server closes one idle past its own keep-alive
(uvicorn's ``timeout_keep_alive``, ``serve.keep_alive_s``). A request sent on a connection the
server is closing at that moment never reaches the application: the client reads a reset
(``ReadError`` [Errno 104]) or an end of stream (``RemoteProtocolError``) where the response's
head should be, or cannot send (``WriteError``). Production clients resend such a request on a
fresh connection (urllib3's retry of a stale pooled connection, the openai client's
``max_retries``); :class:`RetryBeforeResponse` does it for an httpx transport, and counts it.

Only a failure raised before the response's head arrived is retried (an httpx transport's
``handle_request`` returns once the head is read), so a streamed response that has delivered a
chunk is never replayed. A timeout is not retried (the server may still be working on the
request), nor is any HTTP status (a 500 is the server's answer, not a lost connection).
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable
from typing import Any

# httpx's (and openai's) idle expiry of a kept-alive connection, the most a client here keeps one
CLIENT_KEEPALIVE_EXPIRY_S = 5.0


def openai_httpx():
    """The httpx module the installed openai client is built on: ``httpx``, or the ``httpx2`` fork
    that openai 3 builds on (the package of ``openai.DefaultHttpxClient``'s ``Client`` class)."""
    import openai

    client = next(c for c in openai.DefaultHttpxClient.__mro__ if c.__name__ == "Client")
    return importlib.import_module(client.__module__.partition(".")[0])


def client_keepalive_expiry(server_keep_alive_s: float) -> float:
    """Seconds a client keeps an idle connection to a server that closes idle ones after
    ``server_keep_alive_s``: httpx's 5 s, or half the server's where that is shorter, so the
    client always lets a connection go before the server closes it (equal expiries race).

    Raises:
        ValueError: ``server_keep_alive_s`` is not a finite number of seconds above 0.
    """
    if not (isinstance(server_keep_alive_s, (int, float)) and math.isfinite(server_keep_alive_s)
            and server_keep_alive_s > 0):
        raise ValueError(f"server_keep_alive_s={server_keep_alive_s!r}: give the server's keep-alive in seconds, "
                         f"a finite number above 0 (serve.keep_alive_s)")
    return min(CLIENT_KEEPALIVE_EXPIRY_S, server_keep_alive_s / 2)


class RetryBeforeResponse:
    """An httpx transport that sends through ``inner`` (an httpx transport) and resends a request
    whose connection failed before the response's head arrived: connecting failed
    (``ConnectError``), or the connection was closed or reset while the request was sent or its
    response's head awaited (``WriteError``, ``ReadError``, ``RemoteProtocolError``); up to
    ``retries`` times, ``backoff_s`` x 2^k seconds apart (k = 0, 1, ...). ``retried`` counts the
    resends; ``on_retry(error)`` is called before each. The request's body is read into memory
    first, so it can be sent again.

    Raises:
        ValueError: ``retries`` not an int >= 0, or ``backoff_s`` not a finite number >= 0.
        (from ``handle_request``) the last of those errors once the retries are spent; any other
            error (a timeout, a broken response body) at once.
    """

    def __init__(self, inner, retries: int = 2, backoff_s: float = 0.25,
                 on_retry: Callable[[Exception], Any] | None = None, sleep: Callable[[float], Any] = time.sleep):
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"retries={retries!r}: give a whole number >= 0 (0 = send once)")
        if not (isinstance(backoff_s, (int, float)) and math.isfinite(backoff_s) and backoff_s >= 0):
            raise ValueError(f"backoff_s={backoff_s!r}: give a finite number of seconds >= 0")
        hx = importlib.import_module(type(inner).__module__.partition(".")[0])  # httpx or httpx2, as ``inner``'s
        self._retry_on = (hx.ConnectError, hx.WriteError, hx.ReadError, hx.RemoteProtocolError)
        self.inner, self.retries, self.backoff_s = inner, retries, float(backoff_s)
        self.on_retry, self.sleep = on_retry, sleep
        self.retried = 0

    def handle_request(self, request):
        request.read()
        for attempt in range(self.retries + 1):
            try:
                return self.inner.handle_request(request)
            except self._retry_on as e:
                if attempt == self.retries:
                    raise
                self.retried += 1
                if self.on_retry is not None:
                    self.on_retry(e)
                self.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")  # the loop returns or raises

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "RetryBeforeResponse":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.inner.__exit__(*exc)


def retrying_openai(base_url: str, *, server_keep_alive_s: float, timeout_s: float = 600.0, retries: int = 2,
                    backoff_s: float = 0.25, on_retry: Callable[[Exception], Any] | None = None,
                    api_key: str = "none") -> tuple[Any, RetryBeforeResponse]:
    """An ``openai.OpenAI`` client of ``base_url`` whose requests are resent where their
    connection failed before any response byte (:class:`RetryBeforeResponse`), and that keeps an
    idle connection at most :func:`client_keepalive_expiry` of the server's keep-alive. The
    client's own ``max_retries`` stays 0: it would also resend a timed-out request and answer a
    5xx by resending, which the caller must see. Returns ``(client, transport)``; the transport's
    ``retried`` counts the resends.

    Raises:
        ValueError: ``server_keep_alive_s``, ``retries`` or ``backoff_s`` out of range.
    """
    import openai

    hx = openai_httpx()
    limits = hx.Limits(max_connections=100, max_keepalive_connections=20,
                       keepalive_expiry=client_keepalive_expiry(server_keep_alive_s))
    transport = RetryBeforeResponse(hx.HTTPTransport(limits=limits), retries=retries, backoff_s=backoff_s,
                                    on_retry=on_retry)
    http = openai.DefaultHttpxClient(transport=transport, timeout=timeout_s)
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                         http_client=http), transport
