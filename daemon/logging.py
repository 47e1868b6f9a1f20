"""structlog, configured once per process: JSON lines off a TTY, the console renderer on one.

Event names are snake_case with keyword context, e.g.
``log.info("adapter_promoted", version=3, previous=2, reason=...)``. Standard-library loggers
(uvicorn, apscheduler) go through the same renderer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator, Literal

import structlog

_configured = False


def configure(fmt: Literal["auto", "json", "console"] = "auto", level: str = "info", stream=None) -> None:
    """Configure structlog and the standard ``logging`` root once (later calls are no-ops).

    Below ``debug`` it also silences what libraries print that no user can act on: transformers'
    progress bar per model load (``HF_HUB_DISABLE_PROGRESS_BARS=1`` unless set, so it must run
    before transformers is imported; every ``daemonctl`` command does), peft's call of a
    deprecated transformers attribute (a FutureWarning per adapter wrap), and, when stderr (where
    tqdm writes) is not a terminal, every tqdm bar (``TQDM_DISABLE=1`` unless set, read when tqdm is
    first imported): transformers' GGUF conversion draws one with ``tqdm.auto`` whatever the hub
    setting says, and off a terminal its carriage returns make one long line in a log file."""
    global _configured
    if _configured:
        return
    if level.lower() != "debug":  # library noise no user can act on (a user's own setting wins)
        # transformers' progress bar per model load (it reads this when first imported)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # peft asks transformers 5 a deprecated attribute on every adapter wrap
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):  # a bar in a log file: one long \r line
            os.environ.setdefault("TQDM_DISABLE", "1")
    stream = stream or sys.stdout
    if stream is sys.stdout or stream is sys.stderr:  # looked up at each write (see _Std)
        stream = _Std("stdout" if stream is sys.stdout else "stderr")
    tty = hasattr(stream, "isatty") and stream.isatty()
    use_json = fmt == "json" or (fmt == "auto" and not tty)
    structlog.configure(
        processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_formatter(use_json, tty))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("apscheduler", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    _configured = True


_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def _formatter(use_json: bool, colors: bool = False) -> logging.Formatter:
    """structlog's rendering for a ``logging`` handler: JSON lines, or the console renderer."""
    # tracebacks without their frames' locals: a local may hold a secret (a Redis URL, a token)
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(
        colors=colors, exception_formatter=_exception_formatter())
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if use_json else (lambda _l, _m, e: e),
            renderer,
        ],
    )


class LogCount(logging.Handler):
    """Counts the records at WARNING and above (``warnings``) and keeps the last one's event."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.warnings, self.last = 0, None

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings += 1
        msg = record.msg
        try:
            self.last = msg.get("event") if isinstance(msg, dict) else record.getMessage()
        except Exception:  # noqa: BLE001 - arguments that do not fit the format (a library's bug): the
            self.last = str(msg)  # file handler reports it as logging does; never the caller's exception


@contextlib.contextmanager
def logs_to_file(path: Path | str, mode: str = "a") -> Iterator[LogCount]:
    """While the block runs, every log record (structlog's and the standard library's, at the
    root's level) goes to ``path`` as JSON lines (``mode`` ``"a"``: appended, ``"w"``: the file
    started afresh) instead of the console (an error goes to both: the user must see it), so a warning
    (``acceptance_shift``, a library's) does not break into a live display such as
    ``daemonctl demo``'s table; yields a :class:`LogCount` of the warnings written, for the display
    to mention. The handlers before the block are restored after it. Call :func:`configure` first
    (structlog's records reach ``logging`` only through it)."""
    root = logging.getLogger()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, mode=mode, encoding="utf-8")
    to_file.setFormatter(_formatter(use_json=True))
    count = LogCount()
    saved = root.handlers[:]
    errors = _AtLeast(logging.ERROR)  # an error still reaches the console: the user must see it
    for h in saved:
        h.addFilter(errors)
    root.handlers[:] = [to_file, count, *saved]
    try:
        yield count
    finally:
        root.handlers[:] = saved
        for h in saved:
            h.removeFilter(errors)
        to_file.close()


class _AtLeast(logging.Filter):
    """Passes records at ``level`` or above."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


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
