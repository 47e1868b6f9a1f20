"""Issue 37 item 3: the Redis password never reaches what `daemonctl` prints, with Redis down or the
password wrong (`status`, `run`'s daemon_failed log line with its traceback, on a terminal too,
`serve`); item 8: `serve` with Redis down exits with one clear line, not a traceback."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import DAEMONCTL, REPO, base_env, ctl, free_port

SECRET = "s3cret-Pa55w0rd"


@pytest.fixture
def down_env(tmp_path):
    """The environment of a daemonctl whose Redis URL (with a password) answers nothing."""
    return base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=f"redis://:{SECRET}@127.0.0.1:{free_port()}/0")


def test_status_with_redis_down_masks_the_password(down_env):
    for args in (("status",), ("status", "--json")):
        out = ctl(down_env, *args)
        text = out.stdout + out.stderr
        assert SECRET not in text, text
        assert "***" in text, text


def test_run_with_redis_down_masks_the_password_in_its_log(down_env):
    out = ctl(down_env, "run")
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "daemon_failed" in text and SECRET not in text, text


def test_run_on_a_terminal_shows_no_locals_in_the_traceback(down_env):
    """On a TTY the log's traceback is rich's: without its frames' locals (they held the URL)."""
    import pty

    env = down_env | {"DRAFTD_LOG_FORMAT": "console", "TERM": "xterm"}
    master, slave = pty.openpty()
    proc = subprocess.Popen([DAEMONCTL, "run"], env=env, stdin=slave, stdout=slave, stderr=slave, cwd=REPO)
    os.close(slave)
    chunks = []
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not b:
            break
        chunks.append(b)
    proc.wait(60)
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert "daemon_failed" in text, text[-3000:]
    assert SECRET not in text, text[-3000:]


def test_serve_with_redis_down_exits_with_one_masked_line(down_env):
    out = ctl(down_env, "serve")
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert SECRET not in text, text
    lines = [ln for ln in text.splitlines() if ln.strip() and '"level"' not in ln]  # JSON log lines aside
    assert len(lines) == 1, text
    assert "cannot reach Redis" in lines[0] and "DRAFTD_REDIS__URL" in lines[0] and "Traceback" not in text


def test_a_malformed_url_is_refused_with_its_password_masked(tmp_path):
    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=f"redis//:{SECRET}@db:6379/0")
    out = ctl(env, "config")
    assert out.returncode == 2
    assert "is not a Redis URL" in out.stdout + out.stderr
    assert SECRET not in out.stdout + out.stderr


def test_settings_repr_masks_the_url():
    from daemon.settings import RedisSettings

    r = RedisSettings(url=f"redis://:{SECRET}@db:6379/0")
    assert SECRET not in repr(r) and "redis://:***@db:6379/0" in repr(r)
    assert r.url == f"redis://:{SECRET}@db:6379/0"  # the value itself is untouched
