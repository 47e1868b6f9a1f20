"""Credentials out of every message: a Redis URL's password never reaches a log line, a traceback,
an exception message or ``status`` (stdlib only, so the settings can use it without loading redis)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


def mask_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``; a ``password=``
    query parameter is masked too (``unix:///run/redis.sock?password=secret``). Every message that
    names a Redis URL goes through this: a password never reaches a log, a traceback or ``status``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # e.g. an unbalanced '[' (IPv6): say nothing of what follows the scheme
        return url.split("://", 1)[0] + "://***" if "://" in url else "***"
    if "://" not in url and "@" in url:  # not a URL (a typo such as 'redis//:pw@host'): hide all before the '@'
        return f"***@{url.rsplit('@', 1)[1]}"
    if password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc[1]}"))
    if parts.query:
        head, _, query = url.partition("?")  # not urlunsplit: it drops the empty netloc of unix:///path
        q = [(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(query, keep_blank_values=True)]
        url = f"{head}?{urlencode(q, safe='*')}"
    return url
