"""`daemonctl history --plot FILE`: a file matplotlib cannot write (no such folder: a
FileNotFoundError traceback; a .txt name: matplotlib's ValueError) is refused before the table is
printed, naming the value and the fix (exit 2); a good name is written."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import REDIS_URL, free_port
from daemon.cli import app
from store.config import StoreConfig
from store.history import AcceptanceHistory

TITLE = "adapter history"


@pytest.fixture
def offline(monkeypatch, tmp_path, key_prefix, redis_client):
    """A daemon that is down (nothing on its API port) over the shared Redis, with one workload's
    acceptance recorded."""
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_STORE__KEY_PREFIX", key_prefix)
    monkeypatch.setenv("DRAFTD_REDIS__URL", REDIS_URL)
    monkeypatch.setenv("DRAFTD_API__PORT", str(free_port()))
    AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix)).record(
        "prose", 0, {"requests": 1, "num_steps": 4, "num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 4})
    return tmp_path


@pytest.mark.parametrize("name, needles", [
    ("nodir/h.png", ["the folder", "nodir' does not exist", "mkdir -p"]),
    ("h.txt", ["ends in .txt, which matplotlib does not write", ".png", ".svg", "e.g. --plot h.png"]),
    ("h", ["has no file type suffix", "e.g. --plot h.png"]),
    (".", ["is a folder", "history.png"]),
])
def test_a_plot_file_matplotlib_cannot_write_is_refused_before_the_table(offline, name, needles):
    path = offline / name if name != "." else offline
    r = CliRunner().invoke(app, ["history", "--plot", str(path)], terminal_width=300)
    assert r.exit_code == 2, (r.output, r.exception)
    text = " ".join(r.output.split())
    assert f"--plot {str(path)!r}" in text, text
    for needle in needles:
        assert needle in text, (needle, text)
    assert TITLE not in r.output and "Traceback" not in r.output, r.output


def test_a_good_plot_file_is_written_after_the_table(offline):
    path = offline / "h.svg"
    r = CliRunner().invoke(app, ["history", "--plot", str(path)], terminal_width=300)
    assert r.exit_code == 0, (r.output, r.exception)
    assert TITLE in r.stdout and f"wrote {path}" in r.output
    assert b"<svg" in path.read_bytes()[:2000]
