"""`daemon.logging.configure` silences library noise no user can act on, and only that."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str, env_extra: dict | None = None) -> str:
    r = _proc(code, env_extra)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _proc(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python, stdout and stderr captured (pipes: not terminals), without the
    caller's progress-bar settings unless ``env_extra`` gives them."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


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


# the walkthrough's log file held transformers' GGUF conversion bar (tqdm.auto, which the hub's
# setting does not reach) as one long carriage-return line: off a terminal tqdm is off
TQDM = """
import sys
CONFIGURE
from tqdm.auto import tqdm
for _ in tqdm(range(50), desc="Converting and de-quantizing GGUF tensors..."):
    pass
"""


def test_tqdm_bars_are_off_when_stderr_is_not_a_terminal():
    bar = "Converting and de-quantizing"
    shown = _proc(TQDM.replace("CONFIGURE", ""))  # the control: without configure the bar reaches the pipe
    assert shown.returncode == 0 and bar in shown.stderr, shown.stderr
    quiet = _proc(TQDM.replace("CONFIGURE", 'from daemon.logging import configure; configure("console", "warning", '
                                            'stream=sys.stderr)'))
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    debug = _proc(TQDM.replace("CONFIGURE", 'from daemon.logging import configure; configure("console", "debug")'))
    assert bar in debug.stderr  # debug keeps library output, as it keeps the hub's bars
    own = _proc(TQDM.replace("CONFIGURE", 'from daemon.logging import configure; configure("console", "warning")'),
                {"TQDM_DISABLE": ""})  # a user's own setting wins (tqdm reads "" as False)
    assert bar in own.stderr


# `daemonctl demo` sends log records to out/demo/demo.log while it runs (logs_to_file): the two
# acceptance_shift warnings of the walkthrough broke into its console output
TO_FILE = """
import json, logging, sys
import structlog
from daemon.logging import configure, logs_to_file
configure("console", "warning", stream=sys.stderr)
with logs_to_file(sys.argv[1], mode="w") as logged:
    structlog.get_logger("decoder.tracking").warning("acceptance_shift", key="code@greedy", recent_alpha=0.12)
    logging.getLogger("apscheduler.scheduler").error("a library error")
    structlog.get_logger("decoder.tracking").info("below the level")
structlog.get_logger("daemon.demo").warning("after_the_run")
lines = [json.loads(x) for x in open(sys.argv[1])]
print(logged.warnings, logged.last, [(d["event"], d["level"]) for d in lines], lines[0]["recent_alpha"])
"""


def test_log_records_go_to_the_demos_file_while_it_runs(tmp_path):
    log = tmp_path / "out" / "demo.log"
    log.parent.mkdir()
    log.write_text("the last run's lines\n")  # mode "w": a run's file holds that run only
    r = _proc(TO_FILE.replace("sys.argv[1]", repr(str(log))))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("2 a library error [('acceptance_shift', 'warning'), ('a library error', 'error')] 0.12"), r.stdout
    assert "acceptance_shift" not in r.stderr, r.stderr
    assert r.stderr.count("a library error") == 1, r.stderr  # an error reaches the console as well
    assert "after_the_run" in r.stderr  # the console's handler is back after the block, unfiltered


# the demo command's own path (daemon.demo._run_and_report), with run_demo replaced by a stand-in
# that logs what the walkthrough's run logged mid-table and returns a minimal report
DEMO = """
import io, json, sys
import structlog
from rich.console import Console
import daemon.demo as demo
from daemon.logging import configure
configure("console", "warning", stream=sys.stderr)
row = {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0}
phase = {"workload": "code", "heldout_samples": 0, "adapter_at_phase_end": 1, "final_adapter": 1, "plain": row,
         "frozen": row, "adapted_draft": row, "adapted": row, "controller_pick": {"why": "off: plain"},
         "served": {"requests": 2, "repeats": 0}, "live_first_third": {"alpha": None}, "live_last_third": {"alpha": None}}
def run_demo(settings, cfg, console):
    for _ in range(2):
        structlog.get_logger("decoder.tracking").warning("acceptance_shift", key="code@greedy", recent_alpha=0.1)
    return {"phases": [phase], "adapters": [], "recovery": [], "requests": 2, "active_adapter": 1, "seconds": 1.0,
            "key_prefix": "x:demo:", "shift_alarms": [{"key": ("code", "greedy"), "proposer": "ngram",
                                                      "reference_alpha": 0.6, "recent_alpha": 0.1}] * 2}
demo.run_demo = run_demo
screen = io.StringIO()
demo._run_and_report(None, demo.DemoConfig.quick(out_dir=OUT), Console(file=screen, width=300))
print(json.dumps(screen.getvalue()))
"""


def test_the_demo_sends_its_warnings_to_its_log_file_and_counts_them(tmp_path):
    import json

    out = tmp_path / "demo"
    r = _proc(DEMO.replace("OUT", repr(str(out))))
    assert r.returncode == 0, r.stderr
    screen = json.loads(r.stdout.strip().splitlines()[-1])
    assert "acceptance_shift" not in r.stderr, r.stderr
    assert f"log messages of this run (warnings and above) go to {out / 'demo.log'}" in screen
    assert f"2 warning(s) logged during the run, the last 'acceptance_shift': see {out / 'demo.log'}" in screen, screen
    # beside the count, what the alarms are and whether they matter
    note = " ".join(screen[screen.index("2 warning(s) logged"):].split())
    assert "2 acceptance_shift alarm(s) (a proposer's windowed α fell below its running mean" in note, screen
    assert "code n-gram 0.60 -> 0.10" in note and "Why: expected after a shift" in note, screen
    assert [json.loads(x)["event"] for x in (out / "demo.log").read_text().splitlines()] == ["acceptance_shift"] * 2


def test_a_malformed_library_record_under_the_demos_log_file_does_not_raise_into_its_caller(tmp_path):
    """A library's record whose arguments do not fit its format ("%d" given a str) is logging's to
    report ("--- Logging error ---" on stderr), never the caller's exception: the count handler
    used to format it unguarded, so the TypeError reached the thread that logged (a trainer round,
    the serving loop) mid-demo."""
    import json
    import logging

    from daemon.logging import logs_to_file

    log = tmp_path / "demo.log"
    with logs_to_file(log, mode="w") as logged:
        logging.getLogger("some.library").warning("bad %d", "not a number")  # raised TypeError before
        logging.getLogger("some.library").warning("fine %d", 3)
    assert (logged.warnings, logged.last) == (2, "fine 3")
    # the file handler reported the first record as logging does and wrote the second
    assert [json.loads(x)["event"] for x in log.read_text().splitlines()] == ["fine 3"]


def test_an_out_dir_that_cannot_hold_the_demos_log_is_a_clear_error_before_the_demo_runs(tmp_path, monkeypatch):
    """``daemonctl demo --out`` where its log file cannot be written (a file in the way, a
    read-only mount): exit code 2 with the path, the OS's reason and the fix, not a traceback; the
    demo itself never starts and the logging handlers are left as they were."""
    import io
    import logging

    import typer
    from rich.console import Console

    import daemon.demo as demo

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(demo, "run_demo", lambda *a: (_ for _ in ()).throw(AssertionError("the demo ran")))
    before = logging.getLogger().handlers[:]
    screen = io.StringIO()
    try:
        demo._run_and_report(None, demo.DemoConfig.quick(out_dir=blocker / "demo"), Console(file=screen, width=400))
    except typer.Exit as e:
        assert e.exit_code == 2
    else:
        raise AssertionError("no exit")
    text = screen.getvalue()
    assert f"--out {blocker / 'demo'}: cannot write the demo's log file {blocker / 'demo' / 'demo.log'}" in text, text
    assert "pass --out a writable directory" in text, text
    assert logging.getLogger().handlers == before


def test_a_demo_that_raises_midway_leaves_the_handlers_as_they_were_and_its_log_closed(tmp_path, monkeypatch):
    """run_demo raising (Ctrl-C, a Redis error) mid-run: the exception reaches the caller, the root
    logger's handlers are the ones before the run with no filter left on them, demo.log is closed
    and holds what was logged before the failure."""
    import io
    import json
    import logging

    import pytest
    from rich.console import Console

    import daemon.demo as demo

    def run_demo(settings, cfg, console):
        logging.getLogger("some.library").warning("before the failure")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", run_demo)
    opened = []
    real = logging.FileHandler
    monkeypatch.setattr(logging, "FileHandler", lambda *a, **k: opened.append(real(*a, **k)) or opened[-1])
    root = logging.getLogger()
    before = [(h, list(h.filters)) for h in root.handlers]
    with pytest.raises(KeyboardInterrupt):
        demo._run_and_report(None, demo.DemoConfig.quick(out_dir=tmp_path), Console(file=io.StringIO()))
    assert [(h, list(h.filters)) for h in root.handlers] == before
    assert len(opened) == 1 and opened[0].stream is None  # closed
    assert [json.loads(x)["event"] for x in (tmp_path / "demo.log").read_text().splitlines()] == ["before the failure"]
