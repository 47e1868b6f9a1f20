"""TrainerService on a real Redis stream and a real registry, with the tiny Llama pair."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from store.buffer import SampleReader
from store.config import StoreConfig
from store.registry import AdapterMeta, AdapterRegistry
from tiny_pair import PAIR, make_samples, tiny_draft
from trainer.distill import BASE, DistillConfig, Distiller
from trainer.service import ServiceConfig, TrainerService, group_lag, is_heldout, replay_mix, split_key
from service_helpers import pending, write  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAST = DistillConfig(lr=3e-3, batch_size=8, max_steps=40, max_epochs=100, max_seconds=120)


@pytest.fixture
def env(redis_client, key_prefix, tmp_path):
    cfg = StoreConfig(key_prefix=key_prefix)
    registry = AdapterRegistry(redis_client, tmp_path / "artifacts", cfg)
    return redis_client, cfg, registry, tmp_path


def make_service(env, consumer="c1", distill=FAST, **kw):
    client, cfg, registry, tmp = env
    reader = SampleReader(client, cfg, "trainer", consumer, expected_fingerprint=PAIR)
    scfg = ServiceConfig(**{"min_eval_samples": 4, "work_dir": str(tmp / "work"), **kw})
    return TrainerService(reader, registry, Distiller(tiny_draft(), distill), scfg, backlog=lambda: group_lag(client, cfg, "trainer"))


def test_round_registers_promotes_and_acks(env, train_samples, heldout_samples):
    client, cfg, registry, _ = env
    samples = train_samples + heldout_samples
    write(client, cfg, samples)
    svc = make_service(env)
    rep = svc.run_round_now()
    n_held = sum(is_heldout(split_key(s), 0.2) for s in samples)
    assert rep.read == len(samples) and rep.trained_on == len(samples) - n_held and rep.heldout_added == n_held
    assert rep.decision == "promoted", rep.reason
    assert rep.version == 1 and registry.active_version() == 1
    rec = registry.get(1)
    assert rec.state == "promoted" and rec.parent == 0 and rec.samples_trained == rep.trained_on
    assert rec.alpha_after > rec.alpha_before + 0.2, (rec.alpha_before, rec.alpha_after)
    assert set(rec.alpha_after_by_workload) == {"prose", "code"}
    # peft's files and the copy gate trained with the LoRA (DistillConfig.copy_gate, on by default)
    assert sorted(p.name for p in (Path(rec.artifact_path)).iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                         "copy_gate.json"]
    assert rep.acked == len(samples) and pending(client, cfg) == 0
    assert list((Path(env[3]) / "work" / "candidates").iterdir()) == []
    # Nothing new: an idle round, nothing registered.
    rep2 = svc.run_round_now()
    assert rep2.decision == "idle" and len(registry.list()) == 1
    st = svc.status()
    assert st["rounds"] == 2 and st["promoted_version"] == 1 and sum(st["heldout"].values()) == rep.heldout_added


def test_with_store_bytes_a_decoder_on_another_host_fetches_the_promoted_adapter(env, train_samples, heldout_samples,
                                                                                  tmp_path):
    """trainer.adapter_bytes_in_redis: the round registers the adapter's files in Redis too; a
    registry on another artifact dir (another host, without the daemon's state_dir) materialises
    them byte for byte. Without it, that registry cannot (the files live on the daemon's host)."""
    from store.registry import ArtifactMissingError

    client, cfg, registry, _ = env
    write(client, cfg, train_samples + heldout_samples)
    rep = make_service(env, store_bytes=True).run_round_now()
    assert rep.decision == "promoted", rep.reason
    assert registry.get(rep.version).has_bytes
    elsewhere = AdapterRegistry(client, tmp_path / "other-host", cfg)
    got = Path(elsewhere.fetch(rep.version))
    src = Path(registry.get(rep.version).artifact_path)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (got / name).read_bytes() == (src / name).read_bytes()
    from store.registry import AdapterMeta

    v2 = registry.register(src, AdapterMeta(parent=rep.version))  # the default: files on this host only
    assert not registry.get(v2).has_bytes
    with pytest.raises(ArtifactMissingError, match="adapter_bytes_in_redis"):
        AdapterRegistry(client, tmp_path / "third-host", cfg).fetch(v2)


def test_rejected_candidate_is_registered_with_reason(env, train_samples):
    client, cfg, registry, _ = env
    write(client, cfg, train_samples)
    svc = make_service(env, promote_margin=2.0)  # alpha cannot rise by 2
    rep = svc.run_round_now()
    assert rep.decision == "rejected" and "is below promote_margin 2" in rep.reason
    rec = registry.get(rep.version)
    assert rec.state == "rejected" and "promote_margin" in rec.reason
    assert registry.active_version() == 0 and pending(client, cfg) == 0


def test_non_finite_round_is_not_registered(env, train_samples):
    client, cfg, registry, _ = env
    write(client, cfg, train_samples[:20])
    distill = DistillConfig(lr=float("inf"), max_steps=3)
    rep = make_service(env, distill=distill).run_round_now()
    assert rep.decision == "non_finite" and "non-finite" in rep.reason
    assert registry.list() == [] and pending(client, cfg) == 0


def test_scheduled_round_triggered_by_backlog(env, train_samples, heldout_samples):
    client, cfg, registry, _ = env
    svc = make_service(env, interval_s=3600, check_interval_s=0.2, min_new_samples=50)
    svc.start()
    try:
        assert svc.status()["next_run_time"] is not None
        write(client, cfg, train_samples + heldout_samples)
        deadline = time.time() + 120
        while svc.status()["rounds"] == 0 and time.time() < deadline:
            time.sleep(0.2)
        while svc.status()["running"] and time.time() < deadline:
            time.sleep(0.2)
        last = svc.status()["last_round"]
        assert last is not None and last["trigger"] == "backlog", last
        assert last["decision"] == "promoted", last["reason"]
        assert registry.active_version() == last["version"]
        svc.pause()
        assert svc.status()["paused"]
        svc.resume()
    finally:
        svc.stop()
    assert pending(client, cfg) == 0


def test_follows_operator_rollback(env, train_samples, target):
    client, cfg, registry, _ = env
    write(client, cfg, train_samples)
    svc = make_service(env)
    assert svc.run_round_now().decision == "promoted"
    registry.rollback("operator says no")
    svc._sync_active()  # what the next round does first
    assert svc.status()["promoted_version"] == 0
    init = Distiller(tiny_draft(), FAST).adapter_state()
    now = svc.distiller.adapter_state()
    assert all(torch.equal(init[n], now[n]) for n in init if "lora_B" in n)  # restarted from the base draft
    write(client, cfg, make_samples(target, 8, "prose", seed=55))
    assert svc.run_round_now().parent == 0


def test_crash_mid_round_leaves_nothing_and_samples_are_redelivered(env, train_samples, heldout_samples):
    client, cfg, registry, tmp = env
    samples = train_samples + heldout_samples
    write(client, cfg, samples)
    child = subprocess.Popen(
        [sys.executable, str(HERE / "service_child.py"), cfg.key_prefix, str(tmp / "artifacts"), str(tmp / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )
    try:
        deadline = time.time() + 180
        line = ""
        while time.time() < deadline:
            line = child.stdout.readline()
            if line.startswith("TRAINING") or not line:
                break
        assert line.startswith("TRAINING"), f"child did not start training: {line!r}"
        time.sleep(1.0)  # mid-round
        assert child.poll() is None
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(30)
    # No adapter visible, nothing active, every entry still pending (held by the dead consumer).
    assert registry.list() == [] and registry.active_version() == 0
    assert not any(p.name.startswith("v") for p in (tmp / "artifacts").glob("*"))
    assert pending(client, cfg) == len(samples)
    # A new trainer reclaims them and its round succeeds (the stale candidate dir is cleared).
    svc = make_service(env, consumer="survivor", reclaim_min_idle_ms=0)
    rep = svc.run_round_now()
    assert rep.reclaimed == len(samples) and rep.read == len(samples)
    assert rep.decision == "promoted", rep.reason
    assert [r.version for r in registry.list()] == [rep.version]
    assert pending(client, cfg) == 0


def test_failed_registration_keeps_entries_for_the_next_round(env, train_samples):
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples[:40])
    svc = make_service(env)
    registry.artifact_dir.parent.mkdir(parents=True, exist_ok=True)
    registry.artifact_dir.write_text("not a directory")  # register() cannot write its artifact
    with pytest.raises(OSError):
        svc.run_round_now()
    assert svc.status()["last_round"]["decision"] == "error"
    assert registry.list() == [] and pending(client, cfg) == 40 and svc.status()["carried_over"] == 40
    registry.artifact_dir.unlink()
    rep = svc.run_round_now()
    assert rep.read == 40 and rep.version is not None and pending(client, cfg) == 0


def test_replay_mix_takes_other_workloads_newest_first_round_robin():
    from collections import deque
    from types import SimpleNamespace as S

    p = [S(workload="prose", n=i) for i in range(3)]
    c = [S(workload="code", n=i) for i in range(1)]
    kept = {"prose": deque(p), "code": deque(c), "empty": deque()}
    math = [S(workload="math", n=i) for i in range(4)]
    assert replay_mix(math, kept) == [c[0], p[2], p[1], p[0]]
    assert replay_mix(math[:2], kept) == [c[0], p[2]]  # at most as many as the new samples
    assert replay_mix([S(workload="prose", n=9)] * 3, kept) == [c[0]]  # never the round's own workloads
    assert replay_mix([], kept) == []
    assert replay_mix(math[:1], kept, ratio=3.0) == [c[0], p[2], p[1]]
    assert len(replay_mix(math[:1], kept, ratio=float("inf"))) == 4  # everything kept, no overflow
    assert replay_mix(math, kept, ratio=0.0) == [] and replay_mix(math, kept, ratio=float("nan")) == []


def test_round_on_a_new_workload_replays_the_old_one(env, train_samples):
    client, cfg, registry, _ = env
    prose = [s for s in train_samples if s.workload == "prose"]
    code = [s for s in train_samples if s.workload == "code"]
    svc = make_service(env, replay_per_workload=10)
    write(client, cfg, prose)
    rep1 = svc.run_round_now()
    assert rep1.replayed == 0 and rep1.trained_on > 10
    write(client, cfg, code)
    rep2 = svc.run_round_now()
    assert rep2.replayed == 10  # the 10 most recent prose samples kept, fewer than the new code ones
    assert rep2.trained_on > 10 and rep2.decision in ("promoted", "rejected")


def test_a_workload_the_hash_holds_nothing_out_of_is_topped_up_with_untrained_prompts(env, train_samples):
    """holdout_fraction 0: the hash holds no prompt out. Without the top-up every round is
    rejected for want of held-out samples; with it, whole prompts never trained on are held out
    until min_eval_samples, the gate judges alpha, and a topped-up prompt served again stays
    held out while a trained prompt served again is trained on."""
    import dataclasses

    client, cfg, registry, _ = env
    prose = [s for s in train_samples if s.workload == "prose"][:24]
    assert len({split_key(s) for s in prose}) == 24  # one record per prompt
    write(client, cfg, prose[:12])
    svc = make_service(env, holdout_fraction=0.0, min_eval_requests=4)
    rep = svc.run_round_now()
    assert (rep.heldout_added, rep.heldout_topped_up, rep.trained_on) == (4, 4, 8)
    assert "not enough held-out" not in rep.reason and rep.decision in ("promoted", "rejected"), rep.reason
    held_ids = {s.record_id for s in svc._heldout["prose"]}
    assert held_ids == {s.record_id for s in prose[:4]}  # the first prompts, in arrival order
    # the same prompts again (new records): a topped-up one stays held out, a trained one trains;
    # the pool has enough, so no new prompt is held out
    again = [dataclasses.replace(prose[0], record_id="again-0"), dataclasses.replace(prose[5], record_id="again-5")]
    write(client, cfg, again + prose[12:16])
    rep2 = svc.run_round_now()
    assert rep2.heldout_added == 1 and rep2.heldout_topped_up == 1 and rep2.trained_on == 5
    assert "again-0" in {s.record_id for s in svc._heldout["prose"]}


def test_the_top_up_holds_out_as_many_prompts_as_the_gates_interval_needs(env, train_samples):
    """min_eval_samples 4 but min_eval_requests 8 (the gate's paired interval is over held-out
    prompts): the top-up holds out 8 whole prompts, not 4, so the round is judged instead of
    refused for 'not enough evidence'."""
    client, cfg, registry, _ = env
    prose = [s for s in train_samples if s.workload == "prose"][:12]
    write(client, cfg, prose)
    rep = make_service(env, holdout_fraction=0.0, min_eval_requests=8, min_eval_positions=1).run_round_now()
    assert (rep.heldout_added, rep.heldout_topped_up, rep.trained_on) == (8, 8, 4)
    assert "not enough" not in rep.reason and rep.evidence["clusters"] == 8, rep.reason


def test_without_the_top_up_such_a_workload_blocks_the_gate(env, train_samples):
    client, cfg, registry, _ = env
    write(client, cfg, [s for s in train_samples if s.workload == "prose"][:12])
    rep = make_service(env, holdout_fraction=0.0, heldout_topup=False).run_round_now()
    assert rep.decision == "rejected" and "not enough held-out samples" in rep.reason and rep.heldout_added == 0


def test_the_top_up_never_holds_out_a_workloads_last_training_prompt(env, train_samples):
    client, cfg, registry, _ = env
    one = [s for s in train_samples if s.workload == "code"][:1]
    write(client, cfg, one)
    rep = make_service(env, holdout_fraction=0.0).run_round_now()
    assert rep.heldout_added == 0 and rep.trained_on == 1


def test_kept_samples_drop_their_hidden_states(env, train_samples):
    """The held-out and replay pools live in the trainer's memory for many rounds; the LoRA
    trainer never reads hidden states (schema 2), so it keeps the records without them."""
    import dataclasses

    import numpy as np

    client, cfg, registry, _ = env
    rng = np.random.default_rng(0)
    with_h = [dataclasses.replace(s, hidden=rng.standard_normal((s.num_tokens, 16)).astype(np.float16))
              for s in train_samples]
    write(client, cfg, with_h)
    svc = make_service(env, replay_per_workload=10, holdout_fraction=0.5)
    rep = svc.run_round_now()
    assert rep.trained_on > 0 and rep.heldout_added > 0
    kept = [s for d in (*svc._heldout.values(), *svc._replay.values()) for s in d]
    assert kept and all(s.hidden is None for s in kept)
    by_id = {s.record_id: s for s in with_h}
    for s in kept:  # everything else is the record as written
        assert s == dataclasses.replace(by_id[s.record_id], hidden=None)


def test_promoted_adapter_is_evaluated_only_on_new_heldout_samples(env, train_samples, heldout_samples, target):
    client, cfg, registry, _ = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, holdout_fraction=0.5)
    assert svc.run_round_now().decision == "promoted"
    promoted = svc.distiller.adapter_state()
    held_before = {s.record_id for d in svc._heldout.values() for s in d}
    calls = []
    real = svc.distiller.evaluate

    def spy(samples, adapter=None, **kw):
        calls.append(([s.record_id for s in samples], adapter))
        return real(samples, adapter=adapter, **kw)

    svc.distiller.evaluate = spy
    write(client, cfg, make_samples(target, 10, "prose", seed=77))
    rep = svc.run_round_now()
    held_now = [s for d in svc._heldout.values() for s in d]
    new_ids = {s.record_id for s in held_now} - held_before
    assert new_ids, "the new samples must put some records on the held-out side"
    before_call = [ids for ids, a in calls if a is not None]
    assert len(before_call) == 1 and set(before_call[0]) == new_ids  # only the new ones
    svc.distiller.evaluate = real
    full = real(held_now, adapter=promoted)  # independent: every held-out sample, from scratch
    assert rep.before["overall"]["positions"] == full.overall.positions
    assert rep.before["overall"]["alpha"] == pytest.approx(full.alpha, abs=1e-5)
    for w, c in full.per_workload.items():
        assert rep.before["per_workload"][w]["alpha"] == pytest.approx(c.alpha, abs=1e-5)
    # an operator rollback changes the promoted adapter: nothing cached is reused
    registry.rollback("operator")
    svc.distiller.evaluate = spy
    calls.clear()
    write(client, cfg, make_samples(target, 8, "code", seed=78))
    svc.run_round_now()
    base_call = [ids for ids, a in calls if a is not None]
    assert set(base_call[0]) == {s.record_id for d in svc._heldout.values() for s in d}


def test_per_workload_round_trains_each_workload_its_own_adapter(env, train_samples, heldout_samples, target):
    """per_workload: after the shared turn, each workload trains its own adapter from what
    serves it (the shared adapter just promoted), judged on its own held-out slice only; it is
    registered in its scope with numbers an independent evaluation reproduces, and the shared
    adapter's training state is untouched by the workload turns."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    # without the copy channel: this seeded run's routing steps need code's first own candidate
    # promoted, and the copy gate (tested in test_distill) changes which candidates pass
    nocopy = dataclasses.replace(FAST, copy_gate=False)
    svc = make_service(env, distill=nocopy, per_workload=True, min_workload_samples=8)
    rep = svc.run_round_now()
    assert rep.decision == "promoted" and rep.version == 1, rep.reason
    shared_after_round = svc.distiller.adapter_state()
    assert set(rep.scopes) == {"prose", "code"}
    independent = Distiller(tiny_draft(), nocopy)
    shared_dir = registry.fetch(1)
    for w, sr in rep.scopes.items():
        rec = registry.get(sr["version"])
        assert (rec.scope, rec.parent, sr["parent"]) == (w, 1, 1)  # started from the shared v1
        held = list(svc._heldout[w])
        independent.load_adapter_weights(shared_dir)
        assert independent.evaluate(held).alpha == pytest.approx(sr["alpha_before"], abs=1e-5)
        independent.load_adapter_weights(registry.fetch(sr["version"]))
        assert independent.evaluate(held).alpha == pytest.approx(sr["alpha_after"], abs=1e-5)
        assert rec.alpha_after_by_workload == {w: pytest.approx(sr["alpha_after"])}
        if sr["decision"] == "promoted":
            assert sr["alpha_after"] >= sr["alpha_before"] + svc.config.promote_margin
            assert registry.active_version(w) == sr["version"] == registry.resolve(w)
        else:
            assert rec.state == "rejected" and registry.resolve(w) == 1
    assert any(sr["decision"] == "promoted" for sr in rep.scopes.values()), rep.scopes
    # the workload turns restored the shared adapter's own training state
    independent.load_adapter_weights(shared_dir)
    for name, t in shared_after_round.items():
        assert torch.equal(t, independent.adapter_state()[name])
    assert registry.active_version() == 1

    # next round: code brings new samples; its adapter starts from code's own version (if promoted)
    code_v = registry.active_version("code")
    write(client, cfg, make_samples(target, 24, "code", seed=91))
    rep2 = svc.run_round_now()
    assert set(rep2.scopes) == {"code"}
    assert rep2.scopes["code"]["parent"] == (code_v or registry.active_version())
    # an operator rollback of code's scope is followed: code is served (and judged) by the shared one again
    assert registry.active_version("code"), "seeded: code's own adapter is promoted by now"
    back = registry.rollback("operator", scope="code")  # code's previous own version, else 0 (none)
    write(client, cfg, make_samples(target, 24, "code", seed=92))
    rep3 = svc.run_round_now()
    assert rep3.scopes["code"]["parent"] == (back or registry.active_version())
    want = rep3.scopes["code"]["version"] if rep3.scopes["code"]["decision"] == "promoted" else back
    assert svc.status()["workload_versions"]["code"] == want == registry.active_version("code")


def test_without_the_shared_turn_each_workload_trains_only_its_own_adapter(env, train_samples, heldout_samples, target):
    """trainer.shared_turn off: samples of a workload taking its own turn do not train the shared
    adapter (it stays the base draft: nothing of the shared scope is registered), each workload's
    adapter starts from what serves it and is judged on its own slice; the samples of a workload
    below min_workload_samples wait unacked for more (three rounds at most once its traffic stopped,
    then they train the shared adapter, so a workload gone quiet strands nothing); every entry is
    acked in the end."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    rep = svc.run_round_now()
    assert rep.decision == "idle" and "shared_turn" in rep.reason and rep.result is None
    assert set(rep.scopes) == {"prose", "code"}
    assert all(r.scope != "" for r in registry.list()) and registry.active_version() == 0
    independent = Distiller(tiny_draft(), FAST)
    for w, sr in rep.scopes.items():
        rec = registry.get(sr["version"])
        assert (rec.scope, rec.parent) == (w, 0)  # from the base draft: the shared scope never trained
        independent.start_from(BASE)
        assert independent.evaluate(list(svc._heldout[w])).alpha == pytest.approx(sr["alpha_before"], abs=1e-5)
    assert any(sr["decision"] == "promoted" for sr in rep.scopes.values()), rep.scopes
    assert pending(client, cfg) == 0
    # the turns a caller sizing a phase reads (the demo): one each, judged on enough evidence
    # (this fixture's held-out slices pass min_eval_requests and min_eval_positions)
    turns = svc.status()["workload_turns"]
    for w, sr in rep.scopes.items():
        ev = sr["evidence"]
        assert ev["clusters"] >= svc.config.min_eval_requests and ev["positions"] >= svc.config.min_eval_positions
        assert turns[w] == {"turns": 1, "judged": 1, "promoted": int(sr["decision"] == "promoted")}
    # a workload with too few samples for its own turn: they wait, pending, round after round (the round
    # they arrive in and three after their workload's traffic stopped)
    write(client, cfg, make_samples(target, 6, "code", seed=95))
    waits = [svc.run_round_now() for _ in range(4)]
    n = waits[0].deferred
    assert n > 0 and all(r.deferred == n and r.trained_on == 0 and r.scopes == {} and r.result is None for r in waits)
    assert "wait for the next round" in waits[0].reason and pending(client, cfg) == n
    # ... until the fifth round trains the shared adapter on them and acks them
    rep2 = svc.run_round_now()
    assert rep2.deferred == 0 and rep2.trained_on == n and rep2.result is not None
    assert rep2.decision in ("promoted", "rejected") and registry.get(rep2.version).scope == ""
    assert pending(client, cfg) == 0
    assert svc.status()["workload_turns"] == turns  # deferred rounds and the shared turn are no workload turns
    with pytest.raises(ValueError, match="shared_turn=False without per_workload=True"):
        ServiceConfig(shared_turn=False)


def test_deferred_samples_join_their_workloads_own_turn_when_enough_have_come(env, train_samples, heldout_samples, target):
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()
    first = make_samples(target, 5, "code", seed=96)
    write(client, cfg, first)
    r1 = svc.run_round_now()
    assert r1.deferred > 0 and r1.scopes == {}
    write(client, cfg, make_samples(target, 12, "code", seed=97))
    r2 = svc.run_round_now()
    assert r2.deferred == 0 and r2.scopes["code"]["trained_on"] == r2.trained_on >= r1.deferred + 8
    assert pending(client, cfg) == 0


def test_a_workload_still_sending_keeps_its_waiting_records_for_its_own_turn(env, train_samples, heldout_samples, target):
    """shared_turn off: a third walkthrough's round trained the shared adapter on two code records
    that had waited three rounds (2 s each) for code to gather min_workload_samples while code's
    traffic went on, and held code's own first turn back a round. A workload still sending (its
    newest record newer each round) keeps its records waiting until they make its own turn; nothing
    of the shared scope is registered meanwhile."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()
    shared = [r.version for r in registry.list() if r.scope == ""]
    reps = []
    for i in range(24):  # a trickle of code traffic: a record a round
        write(client, cfg, make_samples(target, 1, "code", seed=300 + i))
        reps.append(svc.run_round_now())
        if "code" in reps[-1].scopes:
            break
    assert "code" in reps[-1].scopes and len(reps) >= 8, [(r.deferred, r.trained_on, list(r.scopes)) for r in reps]
    assert all(r.result is None for r in reps), [r.reason for r in reps]  # no shared turn on code's records
    assert [r.version for r in registry.list() if r.scope == ""] == shared
    assert reps[-1].scopes["code"]["trained_on"] >= 8 and pending(client, cfg) == 0


def test_a_shifts_tail_waits_while_the_newer_workload_is_learnt_first(env, train_samples, heldout_samples, target):
    """shared_turn off: after a shift from prose to code, the round holding prose's last samples and
    code's first gives code its turn and lets prose's tail wait, unacked (a walkthrough's trainer spent
    the first 33 s of each phase on the last phase's tail, so the new workload's judged turns, and
    the phase, came a round later); the tail takes its turn once code's traffic has run tail_wait_s past
    it (then after code's: newest traffic first), or once a round holds no newer workload. Every entry
    is acked in the end."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()  # prose and code each have their own adapter and held-out slice now
    write(client, cfg, make_samples(target, 16, "prose", seed=120))
    time.sleep(0.01)  # the buffer's ids order the traffic (ms): code's first comes after prose's last
    write(client, cfg, make_samples(target, 16, "code", seed=121))
    rep = svc.run_round_now()
    tail = rep.deferred
    assert list(rep.scopes) == ["code"] and tail > 0, (rep.scopes, rep.reason)
    assert "prose (its traffic stopped before code's began) waits behind code's newer traffic" in rep.reason, rep.reason
    assert pending(client, cfg) == tail  # waiting, not lost
    # more code traffic: the tail still waits (code has not run tail_wait_s past it)
    write(client, cfg, make_samples(target, 16, "code", seed=122))
    rep = svc.run_round_now()
    assert list(rep.scopes) == ["code"] and rep.deferred == tail and pending(client, cfg) == tail
    # with tail_wait_s 0 it takes its turn, after code's (newest traffic first)
    svc.config = dataclasses.replace(svc.config, tail_wait_s=0.0)
    write(client, cfg, make_samples(target, 16, "code", seed=123))
    rep = svc.run_round_now()
    assert list(rep.scopes) == ["code", "prose"] and rep.deferred == 0 and pending(client, cfg) == 0, rep.scopes
    assert rep.scopes["prose"]["trained_on"] == tail
    # and without it: a round with no newer workload trains the tail
    svc.config = dataclasses.replace(svc.config, tail_wait_s=300.0)
    write(client, cfg, make_samples(target, 16, "prose", seed=124))
    time.sleep(0.01)
    write(client, cfg, make_samples(target, 16, "code", seed=125))
    assert list(svc.run_round_now().scopes) == ["code"]
    rep = svc.run_round_now()  # only prose's carried tail: nothing newer to wait for
    assert list(rep.scopes) == ["prose"] and rep.deferred == 0 and pending(client, cfg) == 0, rep.reason
    with pytest.raises(ValueError, match=r"tail_wait_s=-1.0; use a finite number of seconds >= 0"):
        ServiceConfig(per_workload=True, shared_turn=False, tail_wait_s=-1.0)


def test_a_stop_that_cuts_the_round_judges_its_turn_and_leaves_the_rest_pending(env, train_samples, heldout_samples, target):
    """stop(cut_round=True) (the demo's, at its end: a walkthrough waited 21-24 s for a round's
    training): the turn under way ends its training at the next step and is judged and registered as
    usual; the turns not begun are skipped, their entries pending (unacked), not lost; a turn cut
    before its first step is neither judged nor registered (a walkthrough's cut round registered a
    0-step candidate, rejected at +0.0000), its entries pending too; start() clears the cut and the
    next round trains them. Newest traffic first: code's samples were written last, so its turn runs
    first."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    real_finite, real = svc.distiller._weights_finite, svc.distiller.train_round
    steps = []

    def cut_after_two(*a):  # inside train_round: checked after every optimiser step
        steps.append(1)
        if len(steps) == 2:
            svc.stop(wait=False, cut_round=True)
        return real_finite(*a)

    def counting(samples):
        svc.distiller._weights_finite = cut_after_two
        try:
            return real(samples)
        finally:
            svc.distiller._weights_finite = real_finite

    svc.distiller.train_round = counting
    rep = svc.run_round_now()
    assert list(rep.scopes) == ["code"] and rep.scopes["code"]["steps"] == 2, rep.scopes
    assert rep.scopes["code"]["decision"] in ("promoted", "rejected") and registry.get(rep.scopes["code"]["version"]).scope == "code"
    held = {x.record_id for d in svc._heldout.values() for x in d}
    n_train = {w: sum(1 for s in train_samples + heldout_samples if s.workload == w and s.record_id not in held)
               for w in ("prose", "code")}
    assert rep.deferred == n_train["prose"] > 0 and pending(client, cfg) == n_train["prose"]
    turns = svc.status()["workload_turns"]
    assert turns["code"]["turns"] == 1 and "prose" not in turns
    # cut before its first step: code's new turn is neither judged nor registered, its entries wait too
    svc.start()  # clears the cut
    svc.stop()
    write(client, cfg, make_samples(target, 24, "code", seed=130))

    def stopped_meanwhile(samples):
        svc.stop(wait=False, cut_round=True)
        return real(samples)

    svc.distiller.train_round = stopped_meanwhile
    versions = len(registry.list())
    rep = svc.run_round_now()
    code = rep.scopes["code"]
    assert (code["steps"], code["decision"], code["version"]) == (0, "skipped", None), code
    assert "stopped before this turn's first step" in code["reason"] and len(registry.list()) == versions
    assert pending(client, cfg) == rep.deferred > n_train["prose"] and svc.status()["workload_turns"] == turns
    svc.distiller.train_round = real
    svc.start()
    svc.stop()
    rep = svc.run_round_now()  # code's waiting records train; prose's, older than code's newer traffic, wait on
    assert list(rep.scopes) == ["code"] and rep.scopes["code"]["steps"] > 0 and pending(client, cfg) == n_train["prose"]
    rep = svc.run_round_now()  # nothing newer left: prose's turn
    assert list(rep.scopes) == ["prose"] and rep.scopes["prose"]["trained_on"] == n_train["prose"]
    assert rep.scopes["prose"]["steps"] > 0 and pending(client, cfg) == 0


def test_a_turn_under_way_at_a_shift_yields_to_the_new_workload(env, train_samples, heldout_samples, target):
    """shared_turn off: a walkthrough's rounds under way at each shift had begun before it with the old
    workload's records alone, so nothing in them was newer and the tail trained first (20-36 s). Now a
    workload turn reads the records arriving meanwhile and yields once they show its traffic stopped
    and another's began (none of its own, min_workload_samples of the other): not judged, nothing
    registered, its records wait as a tail (pending, with the records read meanwhile); the next round
    trains the new workload and the tail waits; where its own traffic goes on beside the other's
    (mixed traffic) it never yields."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()
    svc._yield_every_s = 0.0  # look at every step (the service looks every 2 s)
    real = svc.distiller.train_round
    arrive = []

    def meanwhile(samples):  # the records that arrive while the turn trains
        for batch in arrive:
            time.sleep(0.01)  # each batch at a later ms than the one before
            write(client, cfg, batch)
        arrive.clear()
        return real(samples)

    svc.distiller.train_round = meanwhile
    write(client, cfg, make_samples(target, 24, "prose", seed=150))
    arrive.append(make_samples(target, 24, "code", seed=151))
    versions = len(registry.list())
    rep = svc.run_round_now()
    prose = rep.scopes["prose"]
    assert prose["decision"] == "skipped" and prose["version"] is None and len(registry.list()) == versions, prose
    assert prose["reason"].startswith("yielded after 0 steps: its traffic stopped and code's began meanwhile"), prose
    assert pending(client, cfg) == rep.deferred + 24 and rep.trained_on == 0
    # the round's log says so (report.json's trainer_rounds; the demo's console line)
    assert rep.yielded == {"workload": "prose", "to": "code", "steps": 0} and rep.waits == {}
    logged = svc.rounds_log(since=svc.status()["rounds"] - 1)
    assert [r["yielded"] for r in logged] == [rep.yielded] and logged[0]["turns"]["prose"]["decision"] == "skipped"
    rep = svc.run_round_now()  # code first; prose's records wait behind it
    assert list(rep.scopes) == ["code"] and rep.scopes["code"]["steps"] > 0 and "prose" in rep.reason, rep.reason
    assert rep.waits == {"prose": "code"} and rep.yielded is None and svc.rounds_log()[-1]["waits"] == {"prose": "code"}
    rep = svc.run_round_now()  # nothing newer: prose trains
    assert list(rep.scopes) == ["prose"] and rep.scopes["prose"]["steps"] > 0 and pending(client, cfg) == 0
    # mixed traffic: prose goes on beside code (its last records after code's), so prose's turn does not yield
    write(client, cfg, make_samples(target, 24, "prose", seed=152))
    arrive.append(make_samples(target, 12, "code", seed=153) + make_samples(target, 4, "prose", seed=154))
    rep = svc.run_round_now()
    assert rep.scopes["prose"]["steps"] > 0 and rep.scopes["prose"]["decision"] in ("promoted", "rejected"), rep.scopes
    # a turn that began while the last of its traffic still arrived (a walkthrough's round began 8 s before the
    # shift): prose's last records, then code's, read meanwhile: it yields
    write(client, cfg, make_samples(target, 24, "prose", seed=155))
    arrive.append(make_samples(target, 4, "prose", seed=156))
    arrive.append(make_samples(target, 12, "code", seed=157))
    rep = svc.run_round_now()
    assert rep.scopes["prose"]["reason"].startswith("yielded after 0 steps"), rep.scopes["prose"]
    # a break session: the records a yield reads leave the group's lag, so the backlog check must count them
    # (else the new workload's round waited for the next interval)
    assert svc._read_meanwhile == 16
    modified = []
    svc._scheduler = types.SimpleNamespace(modify_job=lambda *a, **k: modified.append(a))
    svc.backlog = lambda: 0
    svc.config = dataclasses.replace(svc.config, min_new_samples=16)
    svc._check()
    assert modified == [("round",)] and svc._next_trigger == "backlog"
    svc._scheduler = None
    svc.run_round_now()
    assert svc._read_meanwhile == 0
    # ... and only records that would train count toward the yield: 7 of code's (one short) and 3 held out do not
    hf = svc.config.holdout_fraction
    pool = make_samples(target, 60, "code", seed=160)
    trains = [x for x in pool if not is_heldout(split_key(x), hf)][:7]
    held = [x for x in pool if is_heldout(split_key(x), hf)][:3]
    assert len(trains) == 7 and len(held) == 3
    write(client, cfg, make_samples(target, 24, "prose", seed=161))
    arrive.append(trains + held)
    rep = svc.run_round_now()
    assert rep.scopes["prose"]["steps"] > 0 and not rep.scopes["prose"]["reason"].startswith("yielded"), rep.scopes


def test_rounds_log_keeps_each_rounds_summary_in_order(env, train_samples, heldout_samples, target):
    """rounds_log: every round's summary, numbered from 1, oldest first, ``since`` skipping those
    already seen; a turn's α and gate evidence as measured (None where not measured, never NaN:
    report.json is JSON), and bounded (the oldest forgotten)."""
    import json

    import trainer.service as service

    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    first = svc.run_round_now()
    write(client, cfg, make_samples(target, 24, "prose", seed=170))
    second = svc.run_round_now()
    log_ = svc.rounds_log()
    assert [r["round"] for r in log_] == [1, 2] and [r["round"] for r in svc.rounds_log(since=1)] == [2]
    assert [r["decision"] for r in log_] == [first.decision, second.decision]
    turn = log_[1]["turns"]["prose"]
    assert turn["version"] == second.scopes["prose"]["version"] and turn["steps"] == second.scopes["prose"]["steps"] > 0
    ev = second.scopes["prose"]["evidence"]
    assert turn["evidence"]["gain"] == pytest.approx(ev["gain"]) and turn["alpha_after"] == pytest.approx(
        second.scopes["prose"]["alpha_after"])
    json.loads(json.dumps(log_, allow_nan=False))  # no NaN anywhere
    skipped = service.RoundReport(trigger="t", started_at=0.0, scopes={"code": service.ScopeReport(scope="code").to_dict()})
    assert skipped.summary(9)["turns"]["code"]["alpha_before"] is None
    svc._history = service.deque(svc._history, maxlen=2)
    svc.run_round_now()
    assert [r["round"] for r in svc.rounds_log()] == [2, 3]


def test_a_cut_before_the_shared_turns_first_step_registers_nothing_and_acks_nothing(env, train_samples, heldout_samples):
    """A break session: the shared turn cut before its first step registered a 0-step candidate and
    acked all 101 training records. Now nothing is judged or registered and the round's training
    records stay pending; and a cut asked while no round runs cuts nothing (the next round trains)."""
    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env)
    svc.stop(cut_round=True)  # no round under way: nothing to cut, now or later
    real = svc.distiller.train_round

    def cut(samples):
        svc.stop(wait=False, cut_round=True)
        return real(samples)

    svc.distiller.train_round = cut
    rep = svc.run_round_now()
    assert rep.result.steps == 0 and rep.version is None and registry.list() == [], rep.reason
    assert "stopped before the shared turn's first step" in rep.reason
    assert pending(client, cfg) == rep.deferred == rep.read - rep.heldout_added > 0 and rep.trained_on == 0
    svc.distiller.train_round = real
    rep = svc.run_round_now()  # the cut ended with its round
    assert rep.result.steps > 0 and rep.version == 1 and pending(client, cfg) == 0


def test_a_waiting_tail_takes_no_room_from_the_newer_workload_and_a_failed_ack_carries_each_record_once(
        env, train_samples, heldout_samples, target):
    """A break session: a waiting tail filled most of a round (carried records count toward
    max_samples_per_round), so the newer workload never gathered min_workload_samples for its turn
    while the tail waited for it; and a round whose ack failed carried the waiting tail twice (the
    next round trained it twice). Now the tail rides along without taking the round's room, and a
    failed round carries each record once."""
    from store.errors import StoreUnavailableError

    client, cfg, registry, tmp = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8, shared_turn=False)
    svc.run_round_now()
    write(client, cfg, make_samples(target, 21, "prose", seed=140))
    time.sleep(0.01)
    write(client, cfg, make_samples(target, 3, "code", seed=141))
    svc.run_round_now()
    tail = sum(1 for e in svc._carry if e.sample.workload == "prose")
    assert tail > 0
    write(client, cfg, make_samples(target, 60, "code", seed=142))
    svc.config = dataclasses.replace(svc.config, max_samples_per_round=tail + 7)
    rep = svc.run_round_now()
    assert rep.read == 2 * tail + 7, (rep.read, tail)  # the round's room, tail + 7, and the waiting tail beside it
    assert "code" in rep.scopes, (rep.read, rep.deferred, rep.reason)
    # the ack fails once: the round's records are carried once each
    real_ack, fail = svc.reader.ack, [True]

    def flaky(entries):
        if fail and fail.pop():
            raise StoreUnavailableError("blip")
        return real_ack(entries)

    svc.reader.ack = flaky
    write(client, cfg, make_samples(target, 16, "code", seed=143))
    with pytest.raises(StoreUnavailableError):
        svc.run_round_now()
    ids = [e.entry_id for e in svc._carry]
    assert len(ids) == len(set(ids)) > 0


def test_per_workload_skips_a_workload_without_enough_samples_or_a_usable_tag(env, train_samples, target):
    client, cfg, registry, _ = env
    odd = [s for s in make_samples(target, 40, "code", seed=93)]
    for s in odd:
        s.workload = "two words"
    untagged = make_samples(target, 40, "prose", seed=94)
    for s in untagged:
        s.workload = ""  # untagged traffic is the shared scope's: never an adapter "of its own"
    write(client, cfg, train_samples[:20] + odd + untagged)
    svc = make_service(env, per_workload=True, min_workload_samples=30)
    rep = svc.run_round_now()
    assert rep.decision in ("promoted", "rejected")
    # prose brought < 30 new samples; "" is skipped; "two words" is no workload name (store.schema.workload_problem,
    # the rule serve and the adapter scopes share): the writer refuses its records, so no round ever sees it
    assert set(rep.scopes) == set()
    assert all(r.scope == "" for r in registry.list()) and pending(client, cfg) == 0


def test_per_workload_a_corrupt_workload_adapter_skips_only_that_workload(env, train_samples, heldout_samples):
    """A workload's active adapter whose artifact is corrupt: its turns are skipped with the
    reason (in the report and status), the shared adapter and other workloads train on (QA: the
    fetch error stopped every round before anything was read)."""
    client, cfg, registry, tmp = env
    code = registry.register(registry.fetch(_register_some_adapter(env, train_samples)), AdapterMeta(scope="code"))
    registry.promote(code, "operator")
    (Path(registry.get(code).artifact_path) / "adapter_model.safetensors").write_bytes(b"corrupt")
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, per_workload=True, min_workload_samples=8)
    rep = svc.run_round_now()
    assert rep.decision == "promoted" and rep.acked == rep.read
    assert rep.scopes["code"]["decision"] == "skipped" and f"v{code} cannot be loaded" in rep.scopes["code"]["reason"]
    assert rep.scopes["prose"]["decision"] in ("promoted", "rejected")
    assert "IntegrityError" in svc.status()["workload_errors"]["code"]


def _register_some_adapter(env, samples) -> int:
    """A real trained adapter of the tiny draft, registered as a shared candidate (not promoted)."""
    _, _, registry, tmp = env
    d = Distiller(tiny_draft(), DistillConfig(**{**FAST.__dict__, "max_steps": 2}))
    d.train_round(samples[:16])
    return registry.register(d.save(tmp / "some-adapter"), AdapterMeta())


def test_workload_turns_leave_the_shared_adapter_exactly_as_without_them(env, redis_client, train_samples, target):
    """Two rounds with per_workload on and off over the same data: the shared versions have
    bit-identical weights (the workload turns restore weights, optimiser and round counter)."""
    client, cfg, registry, tmp = env
    other_cfg = StoreConfig(key_prefix=cfg.key_prefix + "off:")
    other = (client, other_cfg, AdapterRegistry(client, tmp / "artifacts-off", other_cfg), tmp / "off")
    rounds = [train_samples, make_samples(target, 40, "code", seed=95) + make_samples(target, 40, "prose", seed=96)]
    shared = {}
    for name, e, per in (("on", env, True), ("off", other, False)):
        svc = make_service(e, per_workload=per, min_workload_samples=8)
        for data in rounds:
            write(e[0], e[1], data)
            svc.run_round_now()
        shared[name] = [r for r in e[2].list() if r.scope == ""]
        assert per == any(r.scope for r in e[2].list())
    assert len(shared["on"]) == len(shared["off"]) == 2
    for a, b in zip(shared["on"], shared["off"]):
        ta = load_file(str(Path(a.artifact_path) / "adapter_model.safetensors"))
        tb = load_file(str(Path(b.artifact_path) / "adapter_model.safetensors"))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_warm_start_runs_once_before_the_first_round_and_the_round_continues_from_it(env, train_samples, heldout_samples):
    """The hook (daemon.warm_start's v0) runs under the round lock before the first round only; the
    round then follows what it promoted, so its candidate's parent is v0; a failing hook is reported,
    not retried, and never stops the rounds."""
    client, cfg, registry, tmp = env
    calls = []

    def warm():
        calls.append(registry.active_version())
        assert svc.status()["warm_start"] == "running" and svc.status()["running"]
        d = Distiller(tiny_draft(), FAST)
        d.train_round(train_samples[:32])
        d.save(tmp / "v0")
        v = registry.register(tmp / "v0", AdapterMeta(parent=0))
        registry.promote(v, "v0 bootstrap (test)")
        return {"version": v}

    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env)
    svc._warm_start = warm
    assert svc.status()["warm_start"] == "pending"
    rep = svc.run_round_now()
    assert calls == [0] and svc.status()["warm_start"] == {"version": 1}
    assert rep.version == 2 and registry.get(2).parent == 1, rep.reason  # judged against v0, not the base draft
    svc.run_round_now()
    assert calls == [0]  # once

    bad = make_service(env, consumer="c2")

    def half_done():  # trains the distiller, then fails before anything is promoted
        bad.distiller.train_round(train_samples[:16])
        raise ZeroDivisionError("division by zero")

    bad._warm_start = half_done
    bad.run_round_now()
    assert bad.status()["warm_start"] == "failed: ZeroDivisionError: division by zero"
    assert bad.status()["rounds"] == 1
    # its rounds follow the registry (v2 here), never the half-trained weights the hook left behind
    assert bad._promoted_version == registry.active_version() == 2


def _misleading(samples):
    """The samples with each position's whole target mass moved to one wrong token (valid
    distributions that teach the draft the wrong thing), new record ids."""
    import dataclasses

    import numpy as np

    out = []
    for s in samples:
        probs = np.zeros_like(s.topk_probs)
        probs[:, -1] = 1.0  # all mass on the target's k-th most likely token
        out.append(dataclasses.replace(s, topk_probs=probs, tail_mass=np.zeros_like(s.tail_mass),
                                       record_id="bad-" + s.record_id, request_id="bad-" + s.request_id))
    return out


def test_a_candidate_measured_worse_is_discarded(env, train_samples, heldout_samples, target):
    """A round whose candidate measures below the serving version is rejected as worse: training
    restarts from the serving weights (the next candidate never carries it) and the round's
    samples stay out of the replay pool (issue 37: a rejected round never leaves its weights behind)."""
    client, cfg, registry, _ = env
    write(client, cfg, train_samples + heldout_samples)
    svc = make_service(env, replay_per_workload=64)
    first = svc.run_round_now()
    assert first.decision == "promoted", first.reason
    served = svc.distiller.adapter_state()
    replay_before = {w: len(d) for w, d in svc._replay.items()}
    bad = _misleading(make_samples(target, 40, "prose", seed=77))
    write(client, cfg, bad)
    rep = svc.run_round_now()
    assert rep.decision == "rejected" and rep.evidence["gain"] < 0, rep.reason
    now = svc.distiller.adapter_state()
    assert all(torch.equal(served[n], now[n]) for n in served)  # back on the serving weights
    assert {w: len(d) for w, d in svc._replay.items()} == replay_before
    assert not any(s.record_id.startswith("bad-") for d in svc._replay.values() for s in d)
    assert registry.active_version() == first.version and registry.get(rep.version).state == "rejected"


def test_a_candidate_rejected_for_want_of_evidence_trains_on(env, train_samples):
    """Issue 37 item 5, the other half: a candidate rejected only because its gain is not yet
    measurable (below promote_margin, not worse) is kept on purpose: the next round trains on from
    its weights, and its samples enter the replay pool, so small gains accumulate until they are
    measurable (docs/reliability.md). Only a candidate measured worse is discarded (above)."""
    client, cfg, registry, _ = env
    write(client, cfg, train_samples)
    svc = make_service(env, promote_margin=2.0, replay_per_workload=64)  # alpha cannot rise by 2
    start = {n: t.clone() for n, t in svc.distiller.adapter_state().items()}
    rep = svc.run_round_now()
    assert rep.decision == "rejected" and "below promote_margin" in rep.reason and rep.evidence["gain"] >= 0, rep.reason
    now = svc.distiller.adapter_state()
    assert any(not torch.equal(start[n], now[n]) for n in start)  # the candidate's weights, not the serving ones
    assert sum(len(d) for d in svc._replay.values()) == min(rep.trained_on, 64 * len(svc._replay))
    assert registry.active_version() == 0 and registry.get(rep.version).state == "rejected"


def test_workload_turns_count_only_evidence_the_gate_could_judge_on():
    """status()["workload_turns"]: a skipped turn is none; a turn whose gate saw fewer than
    min_eval_requests held-out requests (or min_eval_positions positions) trained but was not judged."""
    from trainer.service import ScopeReport

    svc = TrainerService.__new__(TrainerService)  # only the counter and the config are used
    svc.config, svc._turns = ServiceConfig(min_eval_requests=8, min_eval_positions=256), {}
    ev = lambda clusters, positions: {"clusters": clusters, "positions": positions}  # noqa: E731
    svc._count_turn(ScopeReport("code", decision="skipped", reason="too few held out"))
    svc._count_turn(ScopeReport("code", decision="rejected", evidence=ev(7, 900)))  # 7 requests < 8
    svc._count_turn(ScopeReport("code", decision="rejected", evidence=ev(8, 255)))  # 255 positions < 256
    svc._count_turn(ScopeReport("code", decision="non_finite"))
    svc._count_turn(ScopeReport("code", decision="rejected", evidence=ev(8, 256)))
    svc._count_turn(ScopeReport("math", decision="promoted", evidence=ev(12, 400)))
    assert svc._turns == {"code": {"turns": 4, "judged": 1, "promoted": 0}, "math": {"turns": 1, "judged": 1, "promoted": 1}}
