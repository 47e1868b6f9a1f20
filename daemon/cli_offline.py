"""Read commands of ``daemonctl`` (``history``, ``adapters list``) without a running daemon: the
registry and the acceptance history live in Redis, so they are read there directly when no daemon
answers (right after the demo, or beside `daemonctl serve`), as ``status`` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import typer
from rich.markup import escape as rich_escape

from daemon.logging import console

err = console(stderr=True)


def offline_call(s, what: str, fn: Callable[[Any, Any], Any], kind: str = "adapter") -> Any:
    """``fn(registry, history)`` over Redis directly (URL, else the default address), JSON-encoded
    as the API would (NaN -> None). Exit 3 when no Redis answers either. ``kind="head"``: the
    head registry and the head history (``daemonctl heads``, which always reads Redis: the daemon
    has no head API)."""
    from daemon.redis_embed import answers
    from daemon.settings import store_config
    from store.jsonsafe import jsonable
    from store.client import StoreError, connect
    from store.history import AcceptanceHistory
    from store.registry import AdapterRegistry

    url = s.redis.url or (s.redis.default_url if s.redis.embedded != "always" and answers(s.redis.default_url) else None)
    if url is None:
        err.print(f"[red]no draftd daemon answers at {rich_escape(s.api_url)} and no Redis answers[/]: {what} reads the "
                  f"daemon or its Redis; start one (`daemonctl run`) or set DRAFTD_REDIS__URL")
        raise typer.Exit(3)
    try:
        client = connect(url)
    except StoreError as e:
        err.print(f"[red]no draftd daemon answers at {rich_escape(s.api_url)}, and Redis: {rich_escape(str(e))}[/]")
        raise typer.Exit(3) from e
    try:
        cfg = store_config(s)
        registry = AdapterRegistry(client, s.head_dir if kind == "head" else s.adapter_dir, cfg, kind=kind)
        history = AcceptanceHistory(client, cfg, kind=kind)
        if kind == "adapter":
            err.print(rich_escape(f"no daemon answers at {s.api_url}: read from Redis directly (prefix {s.store.key_prefix})"),
                      style="yellow")
        return json.loads(json.dumps(jsonable(fn(registry, history)), default=str))
    finally:
        client.close()


def read_or_offline(config: Path | None, path: str, what: str, fn: Callable[[Any], Any]) -> Any:
    """GET ``path`` from the daemon; when it is down, ``fn(registry, history)`` over Redis directly."""
    from daemon.client import ApiClient, ApiError, DaemonDown, read_token
    from daemon.settings import ConfigError, load_settings

    try:
        s = load_settings(config)
    except ConfigError as e:
        err.print(f"[red]config error:[/] {rich_escape(str(e))}")
        raise typer.Exit(2) from e
    try:
        return ApiClient(s.api_url, read_token(s)).get(path)
    except DaemonDown:
        return offline_call(s, what, fn)
    except ApiError as e:
        err.print(f"[red]refused ({e.status}):[/] {rich_escape(str(e.detail))}")  # may quote a workload's name
        raise typer.Exit(1 if e.status != 401 else 4) from e
