"""structlog, configured once per process: JSON lines off a TTY, the console renderer on one.

Event names are snake_case with keyword context, e.g.
``log.info("adapter_promoted", version=3, previous=2, reason=...)``. Standard-library loggers
(uvicorn, apscheduler) go through the same renderer.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Literal

import structlog

_configured = False


def configure(fmt: Literal["auto", "json", "console"] = "auto", level: str = "info", stream=None) -> None:
    """Configure structlog and the standard ``logging`` root once (later calls are no-ops).

    Below ``debug`` it also silences what libraries print that no user can act on: transformers'
    progress bar per model load (``HF_HUB_DISABLE_PROGRESS_BARS=1`` unless set, so it must run
    before transformers is imported; every ``daemonctl`` command does) and peft's call of a
    deprecated transformers attribute (a FutureWarning per adapter wrap)."""
    global _configured
    if _configured:
        return
    if level.lower() != "debug":  # library noise no user can act on (a user's own setting wins)
        # transformers' progress bar per model load (it reads this when first imported)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # peft asks transformers 5 a deprecated attribute on every adapter wrap
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    stream = stream or sys.stdout
    if stream is sys.stdout or stream is sys.stderr:  # looked up at each write (see _Std)
        stream = _Std("stdout" if stream is sys.stdout else "stderr")
    tty = hasattr(stream, "isatty") and stream.isatty()
    use_json = fmt == "json" or (fmt == "auto" and not tty)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # tracebacks without their frames' locals: a local may hold a secret (a Redis URL, a token)
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(
        colors=tty, exception_formatter=_exception_formatter())
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if use_json else (lambda _l, _m, e: e),
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("apscheduler", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    _configured = True


class _Std:
    """``sys.stdout`` / ``sys.stderr`` as they are at each write, not as they were when logging was
    configured: rich's ``Live`` (``daemonctl demo``'s live table, progress bars) swaps them for
    proxies that print above its display on the same console, so a log line (a structlog warning, a
    library's stdlib one) is routed through that console instead of tearing the live table."""

    def __init__(self, name: str):
        self.name = name

    @property
    def _stream(self):
        return getattr(sys, self.name)

    def write(self, s: str) -> int:
        return self._stream.write(s)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        s = self._stream
        return hasattr(s, "isatty") and s.isatty()


def _exception_formatter():
    """rich's traceback (as structlog's default) but never with locals; plain text without rich."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)


def console(stderr: bool = False, width: int = 200):
    """A rich Console; off a terminal (pipes, CI logs) ``width`` columns instead of rich's 80, so
    tables keep their values whole. ``COLUMNS`` in the environment still wins."""
    import os

    from rich.console import Console

    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c.width = width
    return c
