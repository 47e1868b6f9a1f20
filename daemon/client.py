"""A small HTTP client of the control API (stdlib only), used by ``daemonctl``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.settings import Settings


def read_token(settings: "Settings") -> str | None:
    """The token a client should send: configured, or read from the daemon's token file (None if neither)."""
    if settings.api.token is not None:
        return settings.api.token.get_secret_value()
    try:
        return settings.token_file.read_text().strip()
    except OSError:
        return None


class ApiError(Exception):
    """The API answered with an error status; ``status`` and ``detail`` say which and why."""

    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class DaemonDown(Exception):
    """Nothing answers at the API address."""


class ApiClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token and method != "GET":
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                detail = json.loads(raw).get("detail", raw.decode())
            except (ValueError, AttributeError):
                detail = raw.decode(errors="replace")
            raise ApiError(e.code, str(detail)) from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise DaemonDown(f"no draftd daemon answers at {self.base_url} ({getattr(e, 'reason', e)})") from e

    def get(self, path: str, **kw: Any) -> Any:
        return self._call("GET", path, **kw)

    def post(self, path: str, body: dict | None = None, **kw: Any) -> Any:
        return self._call("POST", path, body, **kw)
