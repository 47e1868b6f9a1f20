"""Two TrainerServices on one Redis (issue 36 item 3): one holds the trainer lease and trains, the
other stands by and takes over when the leader dies; the dead leader's late round is fenced off
(nothing registered twice) and its entries are reclaimed by the new leader (none lost)."""

from __future__ import annotations

import time

import pytest

from store.buffer import SampleReader
from store.config import StoreConfig
from store.errors import FencedError
from store.lease import Lease, Leadership
from store.registry import AdapterRegistry
from service_helpers import pending, write
from tiny_pair import PAIR, tiny_draft
from trainer.distill import DistillConfig, Distiller
from trainer.service import ServiceConfig, StandbyError, TrainerService, group_lag

FAST = DistillConfig(lr=3e-3, batch_size=8, max_steps=20, max_epochs=100, max_seconds=60)
TTL = 1.0


def contender(client, cfg, tmp, name):
    registry = AdapterRegistry(client, tmp / "artifacts", cfg)

    def acquired(token):
        registry.fencing_token = token
        registry.fence(token)

    leadership = Leadership(Lease(client, cfg, name, ttl_s=TTL), acquired)
    reader = SampleReader(client, cfg, "trainer", name, expected_fingerprint=PAIR)
    svc = TrainerService(reader, registry, Distiller(tiny_draft(), FAST),
                         ServiceConfig(min_eval_samples=4, work_dir=str(tmp / name), reclaim_min_idle_ms=0),
                         backlog=lambda: group_lag(client, cfg, "trainer"), leadership=leadership)
    leadership.start()
    return svc


def test_one_trainer_trains_the_standby_takes_over_and_the_stale_one_is_fenced(redis_client, key_prefix, tmp_path,
                                                                              train_samples):
    client, cfg = redis_client, StoreConfig(key_prefix=key_prefix)
    a = contender(client, cfg, tmp_path, "trainer-a")
    b = contender(client, cfg, tmp_path, "trainer-b")
    try:
        assert a.leading and not b.leading
        assert b.status()["lease"]["lease_holder"] == "trainer-a"
        write(client, cfg, train_samples[:40])
        with pytest.raises(StandbyError, match="trainer-a holds the trainer lease"):
            b.run_round_now()
        b._scheduled()  # the scheduler's tick on a standby: nothing
        assert b.status()["rounds"] == 0 and pending(client, cfg) == 0
        rep = a.run_round_now()
        assert rep.version is not None and pending(client, cfg) == 0
        # the leader dies (no renewal, no release); the standby takes over within TTL + TTL/3
        t0 = time.monotonic()
        a.leadership._stop.set()
        while not b.leading:
            assert time.monotonic() - t0 < TTL * 4 / 3 + 1.0, "the standby did not take over"
            time.sleep(0.01)
        takeover = time.monotonic() - t0
        # the old leader, paused past its lease, wakes up and runs a round with its stale token
        write(client, cfg, train_samples[40:80])
        assert a.leading  # it still believes it leads: only fencing stops it
        with pytest.raises(FencedError):
            a.run_round_now()
        assert [r.version for r in a.registry.list()] == [rep.version] and pending(client, cfg) == 40
        # the new leader reclaims the stale one's entries and trains on them: none lost, none twice
        rep_b = b.run_round_now()
        assert rep_b.read == 40 and rep_b.version > rep.version and pending(client, cfg) == 0  # the fenced one burned a number
        versions = [r.version for r in b.registry.list()]
        assert versions == [rep.version, rep_b.version]
        print(f"takeover {takeover:.2f} s (lease ttl {TTL} s)")
    finally:
        for svc in (a, b):
            svc.leadership.stop()
