"""Two real `daemonctl run` on one Redis (issue 36 item 3; the real SmolLM2-135M pair): one holds
the trainer lease, the other stands by (train-now: 409 naming the holder); SIGKILL the holder and
the standby leads within lease_ttl_s + lease_ttl_s/3."""

from __future__ import annotations

import signal
import time

import pytest

from conftest import http, paused_trainer_env

pytestmark = pytest.mark.slow
TTL = 2.0


def env_for(key_prefix: str) -> dict[str, str]:
    return paused_trainer_env(key_prefix, DRAFTD_TRAINER__LEASE_TTL_S=str(TTL))


def lease_of(d) -> dict:
    code, st = http("GET", d.url + "/v1/status")
    assert code == 200, st
    return st["trainer"]["lease"]


def test_one_daemon_trains_the_other_stands_by_and_takes_over(daemon_factory, key_prefix, tmp_path):
    a = daemon_factory(env_for(key_prefix), state_dir=tmp_path / "a")
    assert lease_of(a)["role"] == "leader"
    import urllib.request

    with urllib.request.urlopen(a.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert "draftd:trainer_lease_leader 1.0" in text, [l for l in text.splitlines() if "lease" in l]
    b = daemon_factory(env_for(key_prefix), state_dir=tmp_path / "b")
    lb = lease_of(b)
    assert lb["role"] == "standby" and lb["lease_holder"] == lease_of(a)["holder"]
    code, body = http("POST", b.url + "/v1/train-now", token=b.token)
    assert code == 409 and "stands by" in body["detail"] and lease_of(a)["holder"] in body["detail"], body
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)
    t0 = time.monotonic()
    while lease_of(b)["role"] != "leader":
        assert time.monotonic() - t0 < TTL * 4 / 3 + 3.0, "the standby did not take over"
        time.sleep(0.05)
    took = time.monotonic() - t0
    code, body = http("POST", b.url + "/v1/train-now", token=b.token)
    assert code == 200 and body["submitted"] is True, body
    print(f"daemon takeover after SIGKILL: {took:.2f} s (lease_ttl_s {TTL})")
