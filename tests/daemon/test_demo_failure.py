"""`daemonctl demo` dying of an exception nobody expected: one line on the console (what failed,
where the traceback is, whether a rerun is safe), the traceback in out/demo/demo.log, exit code 1.
A walkthrough's demo printed 440 lines of httpx frames for a reset connection and left demo.log empty."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
import typer
from rich.console import Console

import daemon.demo as demo

RAISED_AT: list[int] = []


def _serve_like():
    """Raises as the openai client did: its error caused by httpx's, caused by the socket's."""
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError as e:
        RAISED_AT.append(sys._getframe().f_lineno + 1)
        raise RuntimeError("Connection error.") from e


def test_an_unexpected_failure_is_one_line_and_its_traceback_goes_to_the_log(tmp_path, monkeypatch):
    def run_demo(settings, cfg, console):
        logging.getLogger("some.library").warning("before the failure")
        _serve_like()

    monkeypatch.setattr(demo, "run_demo", run_demo)
    root = logging.getLogger()
    before = [(h, list(h.filters)) for h in root.handlers]
    screen = io.StringIO()
    with pytest.raises(typer.Exit) as e:
        demo._run_and_report(None, demo.DemoConfig.quick(out_dir=tmp_path), Console(file=screen, width=1000))
    assert e.value.exit_code == 1
    text = screen.getvalue()
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 2 and "log messages of this run" in lines[0], text  # the run's first line, then the failure's
    line = lines[1]
    assert line.startswith("error: the demo stopped on an unexpected RuntimeError: Connection error. "
                           "(caused by ConnectionResetError: [Errno 104] Connection reset by peer) "
                           f"in tests/daemon/test_demo_failure.py:{RAISED_AT[-1]} (_serve_like); "
                           f"its full traceback is in {tmp_path / 'demo.log'}. Rerunning is safe"), line
    assert "Traceback" not in text
    assert [(h, list(h.filters)) for h in root.handlers] == before
    records = [json.loads(x) for x in (tmp_path / "demo.log").read_text().splitlines()]
    assert [r["event"] for r in records] == ["before the failure", "demo_failed"]
    tb = records[-1]["exception"]
    assert tb.startswith("Traceback") and "ConnectionResetError: [Errno 104] Connection reset by peer" in tb, tb
    assert "in _serve_like" in tb and "in run_demo" in tb and tb.rstrip().endswith("RuntimeError: Connection error."), tb
    assert records[-1]["error"] == "RuntimeError: Connection error." and records[-1]["level"] == "error"


def test_an_expected_exit_and_an_interrupt_pass_through_unchanged(tmp_path, monkeypatch):
    """typer.Exit (a configured refusal) keeps its code and Ctrl-C stays an interrupt: neither is
    the unexpected failure's line."""
    for raised, caught in ((typer.Exit(2), typer.Exit), (KeyboardInterrupt(), KeyboardInterrupt)):
        monkeypatch.setattr(demo, "run_demo", lambda *a, r=raised: (_ for _ in ()).throw(r))
        screen = io.StringIO()
        with pytest.raises(caught) as e:
            demo._run_and_report(None, demo.DemoConfig.quick(out_dir=tmp_path), Console(file=screen, width=1000))
        if caught is typer.Exit:
            assert e.value.exit_code == 2
        assert "unexpected" not in screen.getvalue()
        assert "demo_failed" not in (tmp_path / "demo.log").read_text()
