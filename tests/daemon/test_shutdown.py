"""SIGTERM while a training round runs in the real daemon (real SmolLM2-135M pair, real Redis):
the round finishes (or, with no grace, is abandoned) and the registry is left consistent."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import http, paused_trainer_env
from helpers import make_sample
from store.buffer import SampleWriter, group_info
from store.config import StoreConfig
from store.registry import AdapterRegistry
from store.schema import PairFingerprint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fingerprint() -> PairFingerprint:
    from transformers import AutoTokenizer

    from decoder.models.loading import resolve_model_dir, tokenizer_hash

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    from daemon.settings import ModelSettings

    default = ModelSettings.model_fields  # the pair the daemon loads with no settings given
    return PairFingerprint(target=default["target"].default, draft=default["draft"].default,
                           tokenizer_hash=tokenizer_hash(tok))


def env_for(key_prefix: str, grace: float) -> dict[str, str]:
    return paused_trainer_env(key_prefix, DRAFTD_TRAINER__MAX_STEPS="4", DRAFTD_TRAINER__BATCH_SIZE="2",
                              DRAFTD_TRAINER__MAX_SEQ_LEN="64", DRAFTD_TRAINER__MIN_EVAL_SAMPLES="1",
                              DRAFTD_TRAINER__SHUTDOWN_GRACE_S=str(grace))


def start_round_then_sigterm(d) -> dict:
    code, body = http("POST", d.url + "/v1/train-now", token=d.token)
    assert code == 200 and body["submitted"] is True, body
    deadline = time.monotonic() + 60
    while True:
        code, st = http("GET", d.url + "/v1/status")
        assert code == 200, st
        if st["trainer"]["running"]:
            break
        assert st["trainer"]["rounds"] == 0, "the round ended before it was seen running"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    d.stop(timeout=300)
    return st


def assert_registry_consistent(redis_client, cfg: StoreConfig, state: Path) -> AdapterRegistry:
    reg = AdapterRegistry(redis_client, state / "adapters", cfg)
    recs = reg.list()
    for rec in recs:
        assert reg.fetch(rec.version) == state / "adapters" / f"v{rec.version}"  # every file there, sha256 checked
    promoted = {r.version for r in recs if r.state == "promoted"}
    assert reg.active_version() in promoted | {0}
    leftovers = [p.name for p in (state / "adapters").glob(".tmp-*")] if (state / "adapters").exists() else []
    assert leftovers == []
    return reg


def write_samples(redis_client, cfg, fingerprint, n=12):
    with SampleWriter(redis_client, cfg) as w:
        for i in range(n):
            assert w.submit(make_sample(fingerprint, "prose" if i % 2 else "code", i, vocab=49152))
        assert w.flush(10)


def test_sigterm_mid_round_lets_the_round_finish(daemon_factory, redis_client, key_prefix, fingerprint, tmp_path):
    cfg = StoreConfig(key_prefix=key_prefix)
    write_samples(redis_client, cfg, fingerprint)
    d = daemon_factory(env_for(key_prefix, 300), timeout=240)
    st = start_round_then_sigterm(d)
    assert st["trainer"]["fingerprint"] == fingerprint.key()
    assert d.returncode == 0
    events = d.events()
    names = [e["event"] for e in events]
    assert names.index("shutdown_requested") < names.index("waiting_for_round") < names.index("trainer_round") < names.index("daemon_stopped")
    rnd = next(e for e in events if e["event"] == "trainer_round")
    assert rnd["decision"] in ("promoted", "rejected") and rnd["read"] == 12
    reg = assert_registry_consistent(redis_client, cfg, d.state_dir)
    assert [r.version for r in reg.list()] == [rnd["version"]]
    assert reg.get(rnd["version"]).state == rnd["decision"]
    g = next(g for g in group_info(redis_client, cfg) if g.name == "trainer")
    assert g.pending == 0 and g.lag == 0  # acked after the registration
    assert list((d.state_dir / "trainer" / "candidates").iterdir()) == []


def test_sigterm_with_no_grace_abandons_the_round_and_registers_nothing(daemon_factory, redis_client, key_prefix, fingerprint):
    cfg = StoreConfig(key_prefix=key_prefix)
    write_samples(redis_client, cfg, fingerprint)
    d = daemon_factory(env_for(key_prefix, 0), timeout=240)
    t0 = time.monotonic()
    start_round_then_sigterm(d)
    assert d.returncode == 0 and time.monotonic() - t0 < 60
    names = [e["event"] for e in d.events()]
    assert "trainer_round_abandoned" in names and "trainer_round" not in names
    reg = assert_registry_consistent(redis_client, cfg, d.state_dir)
    assert reg.list() == [] and reg.active_version() == 0
    g = next(g for g in group_info(redis_client, cfg) if g.name == "trainer")
    assert g.pending == 12  # read, not acked: redelivered to the next trainer
