"""One trainer at a time: the lease (SET NX PX + a fencing token, renewed), standbys taking over
within a bounded time, and the registry refusing a stale holder's writes (fencing)."""

from __future__ import annotations

import threading
import time

import pytest

from store.errors import FencedError
from store.lease import Lease, Leadership
from store.registry import AdapterMeta, AdapterRegistry
from test_store_registry import peft_dir


def test_lease_is_exclusive_renewed_and_expires(client, cfg):
    a = Lease(client, cfg, "host-a", ttl_s=0.5)
    b = Lease(client, cfg, "host-b", ttl_s=0.5)
    t1 = a.try_acquire()
    assert t1 >= 1 and b.try_acquire() == 0
    assert a.try_acquire() == t1  # already ours: the same token, renewed
    time.sleep(0.3)
    assert a.renew()  # pushed to 0.8 s
    time.sleep(0.3)
    assert b.try_acquire() == 0 and a.current().holder == "host-a"
    time.sleep(0.6)  # a stopped renewing: expired
    t2 = b.try_acquire()
    assert t2 > t1 and not a.renew() and a.token == 0
    assert b.release() and a.current() is None
    assert a.try_acquire() > t2  # tokens only grow


def test_lease_arguments_are_checked(client, cfg):
    with pytest.raises(ValueError, match="without spaces"):
        Lease(client, cfg, "host a")
    with pytest.raises(ValueError, match="ttl_s"):
        Lease(client, cfg, "h", ttl_s=0)


def test_registry_refuses_writes_with_a_stale_fencing_token(client, cfg, tmp_path):
    reg = AdapterRegistry(client, tmp_path / "art", cfg)
    v1 = reg.register(peft_dir(tmp_path / "a1", 1), AdapterMeta())  # unfenced (token 0): always allowed
    reg.fencing_token = 5
    v2 = reg.register(peft_dir(tmp_path / "a2", 2), AdapterMeta())
    reg.promote(v2, "leader 5")
    stale = AdapterRegistry(client, tmp_path / "art", cfg)
    stale.fencing_token = 3
    with pytest.raises(FencedError, match=r"token 3 is older than 5"):
        stale.register(peft_dir(tmp_path / "a3", 3), AdapterMeta())
    assert not (tmp_path / "art" / "v3").exists() and [r.version for r in reg.list()] == [v1, v2]
    for call in (lambda: stale.promote(v1, "x"), lambda: stale.rollback("x"), lambda: stale.set_state(v1, "rejected", "x")):
        with pytest.raises(FencedError):
            call()
    assert reg.active_version() == v2 and reg.get(v1).state == "candidate"
    assert reg.fence(7) == 7 and reg.fence(6) == 7  # a new holder announces itself before writing
    with pytest.raises(FencedError):
        reg.promote(v1, "5 is stale now")
    reg.fencing_token = 0  # an operator's write (no lease) passes
    assert reg.rollback("operator") == 0


class Contender:
    """A TrainerService-like process: while it leads, it trains "rounds" (register + promote
    with its fencing token); ``die()`` stops it without releasing (a killed process)."""

    def __init__(self, client, cfg, tmp_path, name, ttl_s):
        self.name = name
        self.registry = AdapterRegistry(client, tmp_path / "art", cfg)
        self.tmp = tmp_path / name
        self.leadership = Leadership(Lease(client, cfg, name, ttl_s=ttl_s), self._acquired, self._lost)
        self.rounds: list[int] = []
        self.fenced = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, daemon=True)

    def _acquired(self, token):
        self.registry.fencing_token = token
        self.registry.fence(token)

    def _lost(self, why):
        pass

    def start(self):
        self.leadership.start()
        self._thread.start()
        return self

    def _train(self):
        i = 0
        while not self._stop.wait(0.05):
            if self.leadership.leading:
                i += 1
                try:
                    v = self.registry.register(peft_dir(self.tmp / f"r{i}", i), AdapterMeta())
                    self.registry.promote(v, f"{self.name} round {i}")
                    self.rounds.append(v)
                except FencedError:
                    self.fenced += 1

    def die(self):
        self.leadership._stop.set()  # no more renewals, no release: the lease expires by itself
        self._stop.set()
        self._thread.join(5)

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        self.leadership.stop()


def test_a_standby_takes_over_within_the_lease_ttl_and_the_stale_leader_is_fenced(client, cfg, tmp_path):
    ttl = 1.0
    a = Contender(client, cfg, tmp_path, "trainer-a", ttl).start()
    time.sleep(0.2)
    b = Contender(client, cfg, tmp_path, "trainer-b", ttl).start()
    both = []
    sampler_stop = threading.Event()

    def sample():
        while not sampler_stop.wait(0.02):
            both.append(a.leadership.leading + b.leadership.leading)

    s = threading.Thread(target=sample, daemon=True)
    s.start()
    time.sleep(1.0)
    assert a.leadership.leading and not b.leadership.leading and a.rounds and not b.rounds
    before_kill = list(both)
    t_kill = time.monotonic()
    a.die()
    while not b.leadership.leading:
        assert time.monotonic() - t_kill < ttl + ttl / 3 + 1.0, "standby did not take over"
        time.sleep(0.01)
    takeover = time.monotonic() - t_kill
    assert takeover <= ttl + ttl / 3 + 0.5
    time.sleep(0.5)
    assert b.rounds
    # the dead leader wakes up (a paused process) still holding its old token: fenced
    assert a.leadership.token > 0 and a.registry.fencing_token < b.registry.fencing_token
    with pytest.raises(FencedError):
        a.registry.register(peft_dir(tmp_path / "late", 99), AdapterMeta())
    with pytest.raises(FencedError):
        a.registry.promote(a.rounds[0], "stale")
    sampler_stop.set()
    s.join()
    b.stop()
    # exactly one leader at every sampled time while both lived; the registry holds each round once
    assert before_kill and set(before_kill) == {1}
    assert b.registry.active_version() == b.rounds[-1]
    versions = [r.version for r in b.registry.list()]
    assert versions == sorted(set(versions)) and set(a.rounds + b.rounds) <= set(versions)
    print(f"takeover {takeover:.2f} s with ttl {ttl} s")


def test_two_trainer_processes_one_killed_the_other_takes_over(client, cfg, tmp_path):
    """Real processes, a real SIGKILL: the standby takes over within ttl + ttl/3, and the
    promotion log never interleaves two holders (its tokens never go down)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from store_helpers import SHARED_URL

    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")])}
    ttl = 1.0

    def spawn(name):
        return subprocess.Popen([sys.executable, str(here / "lease_child.py"), SHARED_URL, cfg.key_prefix, name,
                                 str(tmp_path), str(ttl)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=env)

    def leading_line(p):  # the child's log lines (structlog, on stdout) come first
        for line in p.stdout:
            if line.startswith("LEADING"):
                return line
        raise AssertionError("the child exited without leading")

    a = spawn("trainer-a")
    try:
        leading_line(a)
        b = spawn("trainer-b")
        reg = AdapterRegistry(client, tmp_path / "registry", cfg)
        deadline = time.time() + 20
        while len(reg.list()) < 5:
            assert time.time() < deadline
            time.sleep(0.05)
        killed_at = time.time()
        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        line = leading_line(b)
        took = float(line.split()[2]) - killed_at
        assert took <= ttl + ttl / 3 + 0.5
        n = len(reg.list())
        while len(reg.list()) < n + 5:
            assert time.time() < deadline + 10
            time.sleep(0.05)
    finally:
        for p in (a, locals().get("b")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    log = [e for e in reg.promotion_log(count=1000) if e["event"] == "promote"]
    tokens = [int(e["reason"].rsplit(" ", 1)[1]) for e in log]
    holders = [e["reason"].split()[0] for e in log]
    assert tokens == sorted(tokens) and holders[0] == "trainer-a" and holders[-1] == "trainer-b"
    assert holders == sorted(holders)  # all of a's, then all of b's: never interleaved
    versions = [r.version for r in reg.list()]
    assert len(versions) == len(set(versions))
    print(f"takeover after SIGKILL: {took:.2f} s (ttl {ttl} s)")
