"""Issue 16: poison records and broken adapters never stall the trainer or strand good records
(real Redis, real registry, the tiny Llama pair)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from store.buffer import SampleReader, list_dead_letters
from store.config import StoreConfig
from store.registry import AdapterMeta, AdapterRegistry
from tiny_pair import PAIR, VOCAB, make_samples, tiny_draft
from trainer.distill import AdapterMismatch, DistillConfig, Distiller, TrainerError
from trainer.service import ServiceConfig, TrainerService, is_heldout, split_key
from service_helpers import pending, write  # noqa: E402

FAST = DistillConfig(lr=3e-3, batch_size=8, max_steps=10, max_epochs=100, max_seconds=60)


@pytest.fixture
def env(redis_client, key_prefix, tmp_path):
    cfg = StoreConfig(key_prefix=key_prefix)
    return redis_client, cfg, AdapterRegistry(redis_client, tmp_path / "artifacts", cfg), tmp_path


def service(env, **kw):
    client, cfg, registry, tmp = env
    reader = SampleReader(client, cfg, "trainer", "c1", expected_fingerprint=PAIR)
    scfg = ServiceConfig(**{"min_eval_samples": 4, "work_dir": str(tmp / "work"), **kw})
    return TrainerService(reader, registry, Distiller(tiny_draft(), FAST), scfg)


def poisons(good):
    """Three records that pass the schema check but cannot train on a 64-token draft."""
    big = dataclasses.replace(good[0], record_id="poison-big-id", request_id="poison-big-id")
    big.output_ids = big.output_ids.copy()
    big.output_ids[3] = 1_000_000
    empty = dataclasses.replace(good[1], record_id="poison-empty", request_id="poison-empty",
                                prompt_ids=np.zeros(0, np.int32))
    narrow = dataclasses.replace(good[2], record_id="poison-narrow", request_id="poison-narrow",
                                 topk_ids=good[2].topk_ids[:, :4], topk_probs=good[2].topk_probs[:, :4])
    return [big, empty, narrow]


def test_poison_records_are_dead_lettered_and_the_rest_trains(env, train_samples):
    client, cfg, registry, _ = env
    good = train_samples[:24]
    write(client, cfg, good[:12] + poisons(good) + good[12:])
    svc = service(env)
    rep = svc.run_round_now()
    assert rep.decision in ("promoted", "rejected"), rep.reason
    assert rep.read == 27 and rep.dead_lettered == 3
    assert rep.trained_on + rep.heldout_added == 24 and rep.acked == 24
    assert pending(client, cfg) == 0
    dl = {d.fields[b"rid"]: d.reason for d in list_dead_letters(client, cfg)}
    assert set(dl) == {b"poison-big-id", b"poison-empty", b"poison-narrow"}
    assert "1000000" in dl[b"poison-big-id"] and f"vocabulary of {VOCAB}" in dl[b"poison-big-id"]
    assert "empty prompt" in dl[b"poison-empty"]
    assert "top-k width 4" in dl[b"poison-narrow"] and "8" in dl[b"poison-narrow"]


def test_a_round_that_fails_finds_the_record_and_trains_on_the_rest(env, train_samples, monkeypatch):
    """When the read-time screen misses a record, the failing round is retried without it."""
    client, cfg, registry, _ = env
    good = train_samples[24:48]
    write(client, cfg, good[:5] + poisons(good)[:1] + good[5:])
    svc = service(env)
    monkeypatch.setattr(svc.distiller, "sample_problem", lambda s, width=None: None)  # the screen sees nothing
    rep = svc.run_round_now()
    assert rep.decision in ("promoted", "rejected"), rep.reason
    assert rep.dead_lettered == 1 and rep.acked == 24 and pending(client, cfg) == 0
    (d,) = list_dead_letters(client, cfg)
    assert d.fields[b"rid"] == b"poison-big-id" and "IndexError" in d.reason
    assert len(registry.list()) == 1  # one candidate, trained on the 24 good records


def nan_adapter(tmp, registry) -> int:
    d = Distiller(tiny_draft(), FAST)
    out = d.save(tmp / "good-adapter")
    t = load_file(str(out / "adapter_model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in t.items()}, str(out / "adapter_model.safetensors"))
    return registry.register(out, AdapterMeta(samples_trained=1))


def test_loading_a_nan_adapter_leaves_the_weights_as_they_were(env):
    _, _, registry, tmp = env
    v = nan_adapter(tmp, registry)
    d = Distiller(tiny_draft(), FAST)
    before = d.adapter_state()
    with pytest.raises(AdapterMismatch, match="non-finite"):
        d.load_adapter_weights(registry.fetch(v))
    after = d.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nan_active_adapter_then_rollback_trains_again(env, train_samples):
    client, cfg, registry, tmp = env
    v = nan_adapter(tmp, registry)
    client.set(cfg.keys.active, v)  # active behind the gate's back (before issue 16, `adapters promote` let it through)
    write(client, cfg, train_samples[:24])
    svc = service(env)
    with pytest.raises(TrainerError, match=f"active adapter v{v} cannot be loaded"):
        svc.run_round_now()
    assert svc.distiller.weights_finite and svc.status()["sync_error"]
    assert registry.rollback("bad adapter") == 0
    rep = svc.run_round_now()
    assert rep.decision in ("promoted", "rejected"), rep.reason  # never non_finite: the weights were restored
    assert rep.result.finite and rep.acked == 24 and pending(client, cfg) == 0
    assert svc.status()["sync_error"] is None


def test_a_poison_record_in_one_workloads_turn_reruns_only_that_turn(env, train_samples, monkeypatch):
    """Per-workload turns: a record the screen misses fails its own workload's turn; that turn is
    retried without it (the record dead-lettered) and the turns already done stand. Before, the
    whole round was retried: code's turn, done and registered before prose's failed, trained and
    registered a second candidate on the same records (three versions for two turns)."""
    client, cfg, registry, _ = env
    good = train_samples
    write(client, cfg, good)
    svc = service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()
    before = len(registry.list())
    prose = [dataclasses.replace(s, record_id=f"p2-{i}", request_id=f"p2-{i}") for i, s in enumerate(good[:16])]
    code = [dataclasses.replace(s, record_id=f"c2-{i}", request_id=f"c2-{i}") for i, s in enumerate(good[48:64])]
    bad = dataclasses.replace(good[20], record_id="poison-big-id", request_id="poison-big-id")
    bad.output_ids = bad.output_ids.copy()
    bad.output_ids[3] = 1_000_000
    write(client, cfg, prose[:8] + code[:8] + prose[8:] + [bad] + code[8:])  # mixed: no tail waits; code newest
    monkeypatch.setattr(svc.distiller, "sample_problem", lambda s, width=None: None)  # the screen sees nothing
    rep = svc.run_round_now()
    assert list(rep.scopes) == ["code", "prose"], rep.scopes
    assert rep.dead_lettered == 1 and pending(client, cfg) == 0, rep.reason
    assert all(rep.scopes[w]["decision"] in ("promoted", "rejected") for w in ("code", "prose")), rep.scopes
    assert len(registry.list()) == before + 2  # one candidate per turn, none twice
    (d,) = list_dead_letters(client, cfg)
    assert d.fields[b"rid"] == b"poison-big-id" and "IndexError" in d.reason and "prose's turn failed" in d.reason


def _renamed(samples, tag):
    return [dataclasses.replace(s, record_id=f"{tag}-{i}", request_id=f"{tag}-{i}") for i, s in enumerate(samples)]


def _big_id(s, rid):
    bad = dataclasses.replace(s, record_id=rid, request_id=rid)
    bad.output_ids = bad.output_ids.copy()
    bad.output_ids[3] = 1_000_000
    return bad


def test_a_turn_retried_alone_gives_the_head_none_of_its_dead_lettered_held_out_records(env, train_samples, monkeypatch):
    """A break session: a workload turn retried alone (_turn_isolating) dead-lettered a held-out
    record of the round, and the head's turn of the same round was still given it as held out (the
    round's list of held-out entries was built before the turn; the round's retry rebuilt it)."""
    client, cfg, registry, tmp = env
    good, got = train_samples, []

    class Heads:  # what the head's turn is given
        def turn(self, train, heldout):
            got.append(([s.record_id for s in train], [s.record_id for s in heldout]))
            return type("HeadReport", (), {"to_dict": lambda self: {}})()

        def status(self):
            return {}

    write(client, cfg, good)
    reader = SampleReader(client, cfg, "trainer", "c1", expected_fingerprint=PAIR)
    scfg = ServiceConfig(min_eval_samples=4, work_dir=str(tmp / "work"), per_workload=True, min_workload_samples=8,
                         shared_turn=False)
    svc = TrainerService(reader, registry, Distiller(tiny_draft(), FAST), scfg, heads=Heads())
    svc.run_round_now()
    monkeypatch.setattr(svc.distiller, "sample_problem", lambda s, width=None: None)  # the screen sees nothing
    held = [s for s in good[:48] if is_heldout(split_key(s), scfg.holdout_fraction)]
    trains = [s for s in good[:48] if not is_heldout(split_key(s), scfg.holdout_fraction)]
    write(client, cfg, _renamed(good[:16], "p2") + [_big_id(held[0], "poison-held"), _big_id(trains[0], "poison-train")])
    rep = svc.run_round_now()
    assert rep.dead_lettered == 2 and pending(client, cfg) == 0 and rep.scopes["prose"]["steps"] > 0, rep.reason
    train, heldout = got[-1]
    assert "poison-train" not in train and "poison-held" not in heldout and heldout, got[-1]


def test_a_turn_retried_alone_still_yields_on_what_its_first_try_read(env, train_samples, target):
    """A break session: a turn that failed on a record had read some of a new workload's records
    meanwhile (fewer than min_workload_samples); its retry without the record began its look from
    nothing, so the rest arriving did not make it yield and it trained and registered a whole turn
    at the shift. The tries of one turn now count the records read meanwhile together."""
    client, cfg, registry, tmp = env
    good = train_samples
    write(client, cfg, good)
    svc = service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()
    svc.distiller.sample_problem = lambda s, width=None: None  # the screen sees nothing
    svc._yield_every_s = 0.0  # look at every step
    frac = svc.config.holdout_fraction
    code = [s for s in _renamed(make_samples(target, 16, "code", seed=151), "c-new") if not is_heldout(split_key(s), frac)]
    arrive, real = [code[:5], code[5:10]], svc.distiller.train_round

    def meanwhile(samples):  # 5 code records arrive during each try of prose's turn
        if arrive:
            time.sleep(0.01)
            write(client, cfg, arrive.pop(0))
        return real(samples)

    svc.distiller.train_round = meanwhile
    trains = [s for s in good[:48] if not is_heldout(split_key(s), frac)]
    write(client, cfg, [_big_id(trains[0], "poison-a")] + _renamed(trains[:16], "p2"))
    versions = len(registry.list())
    rep = svc.run_round_now()
    assert rep.dead_lettered == 1 and not arrive, rep.reason
    assert rep.yielded == {"workload": "prose", "to": "code", "steps": 0}, (rep.yielded, rep.scopes)
    assert len(registry.list()) == versions and rep.trained_on == 0 and pending(client, cfg) == 16 + 10
