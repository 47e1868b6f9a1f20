"""`daemon.logging.configure` silences library noise no user can act on, and only that."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, env_extra: dict | None = None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# in a fresh process: configure, then transformers imported, then the two warnings raised
CHECK = """
import warnings
from daemon.logging import configure
configure("console", LEVEL)
from transformers.utils import logging as tl
with warnings.catch_warnings(record=True) as caught:  # keeps the filters configure added
    warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    warnings.warn("another FutureWarning", FutureWarning)
print(tl.is_progress_bar_enabled(), [str(c.message)[:7] for c in caught])
"""


def test_configure_turns_off_progress_bars_and_the_peft_deprecation_only():
    out = _run(CHECK.replace("LEVEL", '"warning"'))
    assert out == "False ['another']"


def test_a_users_own_setting_and_debug_keep_them():
    assert _run(CHECK.replace("LEVEL", '"warning"'), {"HF_HUB_DISABLE_PROGRESS_BARS": "0"}).startswith("True")
    assert _run(CHECK.replace("LEVEL", '"debug"')) == "True ['`is_gra', 'another']"


# `daemonctl demo` configures logging on stderr, then shows a rich Live table there: a warning
# (structlog's or a library's) logged meanwhile went to the stderr captured at configure time and
# tore the table; it now goes through the console Live prints on, above the table
LIVE = """
import io, logging, sys
import structlog
from rich.console import Console
from rich.live import Live
from rich.table import Table
from daemon.logging import configure
screen = io.StringIO()
console = Console(file=screen, force_terminal=True, width=100)
configure("console", "warning", stream=sys.stderr)
table = Table(title="draftd demo (live)")
table.add_row("requests done", "3")
with Live(table, console=console, refresh_per_second=20):
    structlog.get_logger("daemon.serve").warning("heartbeat_failed", error="Redis down")
    logging.getLogger("uvicorn.error").warning("a library warning")
structlog.get_logger("daemon.serve").warning("after_live")  # after the table: plain stderr again
print("heartbeat_failed" in screen.getvalue(), "a library warning" in screen.getvalue(), "after_live" in screen.getvalue())
"""


def test_warnings_logged_under_a_live_table_go_through_its_console():
    import os

    r = subprocess.run([sys.executable, "-c", LIVE], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True True False", (r.stdout, r.stderr)
    assert "heartbeat_failed" not in r.stderr and "a library warning" not in r.stderr, r.stderr
    assert "after_live" in r.stderr
