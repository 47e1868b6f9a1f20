"""Fixtures of the daemon tests: real Redis, the real `daemonctl run` process, `daemonctl` runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

REPO = Path(__file__).resolve().parents[2]
DAEMONCTL = str(Path(sys.executable).with_name("daemonctl"))
REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(state_dir: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTD_")}
    env.update(
        DRAFTD_STATE_DIR=str(state_dir),
        DRAFTD_API__PORT=str(port),
        DRAFTD_LOG_FORMAT="json",
        PYTHONUNBUFFERED="1",
        COLUMNS="200",
        DRAFTD_BOOTSTRAP__ENABLED="false",  # no v0 bootstrap (minutes of training) unless a test asks for it
    )
    env.update(extra)
    return env


def paused_trainer_env(key_prefix: str, **extra: str) -> dict[str, str]:
    """The settings of a daemon on the shared Redis under ``key_prefix`` whose trainer waits
    (paused, no scheduled round within the test), on one torch thread; ``extra`` added."""
    return {
        "DRAFTD_REDIS__URL": REDIS_URL,
        "DRAFTD_STORE__KEY_PREFIX": key_prefix,
        "DRAFTD_MODELS__TORCH_THREADS": "1",
        "DRAFTD_TRAINER__START_PAUSED": "true",
        "DRAFTD_TRAINER__INTERVAL_S": "3600",
        **extra,
    }


def wait_healthy(proc: subprocess.Popen, port: int, logs, timeout_s: float = 300.0) -> None:
    """Until the `daemonctl serve` process ``proc`` answers /health on ``port``; fails with
    ``logs()`` (its log's tail) if it exits first, or after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, logs()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            assert time.monotonic() < deadline, "serve did not answer /health"
            time.sleep(0.5)


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    env: dict[str, str]
    port: int
    log_path: Path
    state_dir: Path
    returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.state_dir / "api-token").read_text().strip()

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait(10)
            raise
        return self.returncode


def start_daemon(state_dir: Path, port: int, env_extra: dict[str, str], timeout: float = 120, args: tuple = ()) -> DaemonProc:
    env = base_env(state_dir, port, **env_extra)
    state_dir.mkdir(parents=True, exist_ok=True)
    log_path = state_dir.parent / f"daemon-{port}-{time.monotonic_ns()}.log"
    f = open(log_path, "w")
    proc = subprocess.Popen([DAEMONCTL, "run", *args], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    d = DaemonProc(proc, env, port, log_path, state_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(d.url + "/healthz", timeout=1) as r:
                if json.loads(r.read()) == {"ok": True}:
                    return d
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"daemon did not answer within {timeout} s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProc] = []

    def make(env_extra: dict[str, str], state_dir: Path | None = None, port: int | None = None, **kw) -> DaemonProc:
        d = start_daemon(state_dir or tmp_path / "state", port or free_port(), env_extra, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc.poll() is None:
            try:
                d.stop(timeout=60)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def url_daemon(daemon_factory, key_prefix):
    """A daemon without models on the real Redis, under a unique key prefix."""
    return daemon_factory({"DRAFTD_REDIS__URL": REDIS_URL, "DRAFTD_STORE__KEY_PREFIX": key_prefix, "DRAFTD_MODELS__ENABLED": "false"})


def ctl(d_or_env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = d_or_env.env if isinstance(d_or_env, DaemonProc) else d_or_env
    return subprocess.run([DAEMONCTL, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def http(method: str, url: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, method=method, headers=headers, data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
