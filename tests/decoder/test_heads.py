"""Feature-level heads through the registry (decoder/heads.py, trainer/heads.py): registered,
gated and promoted by the trainer from served records, hot-swapped between requests per
workload scope, refused when they cannot serve, rolled back; on a real Redis with the tiny pair."""

from __future__ import annotations

import torch

from decoder.eagle import EagleHead, load_head, save_head
from decoder.heads import HeadManager, serving_head_loader
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from store.config import StoreConfig
from store.registry import HEAD_FILE, AdapterMeta, AdapterRegistry
from tiny import reference_greedy, tiny_llama

GREEDY = SamplingParams()


def _head_dir(path, target, seed):
    path.mkdir(parents=True)
    torch.manual_seed(seed)
    save_head(EagleHead.from_target(target), path / HEAD_FILE, target)
    return path


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_heads_swap_between_requests_per_scope_and_a_bad_head_never_serves(target, tok, redis_client, key_prefix,
                                                                           tmp_path):
    cfg = StoreConfig(key_prefix=key_prefix)
    heads = AdapterRegistry(redis_client, tmp_path / "heads", cfg, kind="head")
    dec = SpeculativeDecoder(target, target, tok)
    mgr = HeadManager(dec, heads, load=serving_head_loader(dec, torch.float32))
    v1 = heads.register(_head_dir(tmp_path / "h1", target, 1), AdapterMeta())
    heads.promote(v1, "first")
    assert mgr.poll_once() == v1 and dec.head_version == 0  # prepared; the switch waits for a boundary
    ids = _ids(tok, "the cat sat")
    r = dec.generate(DecodeRequest(ids, GREEDY, 10, ignore_eos=True, workload="prose", proposer="eagle", gamma=2))
    assert r.head_version == v1 and r.proposer == "eagle"
    assert r.output_ids == reference_greedy(target, ids, 10)  # lossless with the swapped-in head
    # the same weights as the file, rebuilt on the target, as it serves
    want = load_head(target, heads.fetch(v1) / HEAD_FILE)
    assert torch.equal(dec.eagle_head.fc.weight, want.fc.weight)
    # another model's head: registered and promoted in the registry, refused by the decoder
    other = tiny_llama(3, layers=2, hidden=32)
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    save_head(EagleHead.from_target(other), bad_dir / HEAD_FILE, other)
    v2 = heads.register(bad_dir, AdapterMeta())
    heads.promote(v2, "wrong model")
    assert mgr.poll_once() == v1
    assert mgr.failures[-1].version == v2 and "other target weights" in mgr.failures[-1].reason
    r = dec.generate(DecodeRequest(ids, GREEDY, 6, ignore_eos=True, workload="prose", proposer="eagle"))
    assert r.head_version == v1  # what served keeps serving
    # a workload scope of its own; the others keep the shared head
    v3 = heads.register(_head_dir(tmp_path / "h3", target, 3), AdapterMeta(scope="code"))
    heads.promote(v3, "code's own")
    heads.rollback("v2 cannot serve")  # the shared pointer back to v1
    mgr.poll_once()
    got = {w: dec.generate(DecodeRequest(ids, GREEDY, 4, ignore_eos=True, workload=w, proposer="eagle")).head_version
           for w in ("code", "prose")}
    assert got == {"code": v3, "prose": v1}
    # the shared scope rolled back to no head: a request of prose has none (the controller then
    # does not offer "eagle"); code keeps its own
    heads.rollback("regressed")
    mgr.poll_once()
    dec.generate(DecodeRequest(ids, GREEDY, 4, ignore_eos=True, workload="prose"))
    assert dec.head_version == 0 and dec.eagle_head is None
    assert dec.generate(DecodeRequest(ids, GREEDY, 4, ignore_eos=True, workload="code",
                                      proposer="eagle")).head_version == v3
    st = mgr.status()
    assert st["routes"] == {"": 0, "code": v3} and st["failures"] == 1 and v3 in st["loaded"]
    mgr.close()


def test_the_loop_learns_a_head_from_its_own_traffic_then_serves_and_rolls_it_back(target, other_draft, tok,
                                                                                  redis_client, key_prefix, tmp_path):
    """serve -> buffer (hidden states) -> TrainerService round with a head turn -> head v1
    promoted -> the loop's HeadManager swaps it in -> the controller warms up 'eagle' and serves
    with it (greedy outputs equal plain) -> a rollback takes it out again."""
    from decoder.loop import build_serving_loop
    from store.buffer import SampleReader
    from store.schema import PairFingerprint
    from trainer.distill import DistillConfig, Distiller
    from trainer.heads import HeadConfig, HeadTrainer
    from trainer.service import ServiceConfig, TrainerService

    cfg = StoreConfig(key_prefix=key_prefix)
    pair = PairFingerprint("tiny-t", "tiny-d", "chars")
    heads = AdapterRegistry(redis_client, tmp_path / "heads", cfg, kind="head")
    loop = build_serving_loop(target, other_draft, tok, client=redis_client, store_config=cfg, pair_fingerprint=pair,
                              decoder_config=DecoderConfig(topk_record=8, record_prompt=True, record_hidden=True),
                              proposers=("eagle", "ngram"), head_registry=heads, poll_interval_s=0.2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 40, (10,), generator=g).tolist() for _ in range(48)]

    def serve(batch):
        out = []
        for i, ids in batch:
            r = loop.generate(DecodeRequest(ids, GREEDY, 24, ignore_eos=True, workload="w"), timeout=120)
            assert r.output_ids == reference_greedy(target, ids, 24), i
            out.append(r)
        return out

    with loop:
        first = serve(list(enumerate(prompts[:40])))
        assert "eagle" not in {r.proposer for r in first} and all(r.head_version == 0 for r in first)
        assert loop.writer.flush(10)
        reader = SampleReader(redis_client, cfg, "trainer", "c1", expected_fingerprint=pair)
        torch.manual_seed(0)
        ht = HeadTrainer(heads, lambda: EagleHead.from_target(target), lambda p: load_head(target, p),
                         lambda h, p, meta: save_head(h, p, target, meta), vocab_size=dec_vocab(loop),
                         config=HeadConfig(steps=200, window=16, batch=4, min_eval_positions=16, unroll=1),
                         work_dir=tmp_path / "work")
        svc = TrainerService(reader, AdapterRegistry(redis_client, tmp_path / "adapters", cfg),
                             Distiller(other_draft, DistillConfig(max_steps=2, batch_size=8)),
                             ServiceConfig(max_samples_per_round=512, min_eval_samples=2, work_dir=str(tmp_path / "w")),
                             heads=ht)
        rep = svc.run_round_now()
        head = rep.head
        assert head["decision"] == "promoted", head
        assert head["records"] > 0 and head["records_without_hidden"] == 0
        assert head["alpha_after"] > 0.05 and head["alpha_before"] == 0.0  # against no head at all
        v1 = head["version"]
        assert heads.active_version() == v1 and heads.get(v1).alpha_after == head["alpha_after"]
        assert loop.heads.wait_prepared(v1, timeout=30)
        later = serve(list(enumerate(prompts[40:], 40)) * 2)
        by_head = {r.head_version for r in later if r.proposer == "eagle"}
        assert by_head == {v1}, [(r.proposer, r.head_version) for r in later]
        assert loop.status()["heads"]["serving_version"] == v1
        # the head's requests are tracked and flushed by head version, and a monitor judges them
        n_eagle = sum(r.proposer == "eagle" for r in later)
        assert loop.tracker.window("w", "greedy", v1, proposer="eagle").counts.num_requests == n_eagle
        loop.tracker.flush()
        from store import AcceptanceHistory

        assert sum(r.requests for r in AcceptanceHistory(redis_client, cfg, kind="head").read(version=v1)) == n_eagle
        assert loop.head_monitor.proposer == "eagle" and loop.status()["heads"]["judged"] == []  # v1 had no predecessor
        # a second round trains from v1 and judges its candidate against v1, not against no head
        assert loop.writer.flush(10)
        rep2 = svc.run_round_now().head
        assert rep2["parent"] == v1 and rep2["decision"] in ("promoted", "rejected"), rep2
        assert rep2["alpha_before"] > 0.05 and (rep2["decision"] == "promoted") == (heads.active_version() != v1)
        while heads.active_version():  # back past v1 (and v2, if the second round promoted one)
            heads.rollback("operator: regressed")
        assert loop.heads.wait_prepared(0, timeout=30)
        after = serve([(0, prompts[0]), (1, prompts[1])])
        assert all(r.proposer != "eagle" and r.head_version == 0 for r in after)
    st = svc.status()["heads"]
    assert st["turns"] == 2 and st["last"]["parent"] == v1


def dec_vocab(loop) -> int:
    return loop.decoder.vocab_p


def _records(target, tok, n, seed, hidden=True, workload="w"):
    """Decoded records of ``n`` random prompts, through the buffer's encoding."""
    from store.schema import PairFingerprint, decode, encode

    got = []
    dec = SpeculativeDecoder(target, target, tok, DecoderConfig(topk_record=8, record_prompt=True, record_hidden=hidden),
                             sink=lambda s: got.append(decode(encode(s))),
                             pair_fingerprint=PairFingerprint("tiny-t", "tiny-t", "chars"))
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        ids = torch.randint(2, 40, (10,), generator=g).tolist()
        dec.generate(DecodeRequest(ids, GREEDY, 24, ignore_eos=True, workload=workload, gamma=0))
    return got


def _trainer(target, heads, tmp_path, **kw):
    from trainer.heads import HeadConfig, HeadTrainer

    cfg = {"steps": 150, "window": 16, "batch": 4, "min_eval_positions": 16, "unroll": 1, **kw}
    return HeadTrainer(heads, lambda: EagleHead.from_target(target), lambda p: load_head(target, p),
                       lambda h, p, meta: save_head(h, p, target, meta), vocab_size=44, config=HeadConfig(**cfg),
                       work_dir=tmp_path / "work")


def test_the_head_gate_promotes_a_gain_rejects_no_gain_and_trains_the_rejected_one_on(target, tok, redis_client,
                                                                                   key_prefix, tmp_path):
    heads = AdapterRegistry(redis_client, tmp_path / "heads", StoreConfig(key_prefix=key_prefix), kind="head")
    train, held = _records(target, tok, 24, 1), _records(target, tok, 6, 2)
    torch.manual_seed(0)
    ht = _trainer(target, heads, tmp_path)
    first = ht.turn(train, held)
    assert first.decision == "promoted" and first.parent == 0 and first.alpha_before == 0.0
    assert heads.active_version() == first.version and heads.get(first.version).state == "promoted"
    # no gain possible at a learning rate of 1e-9: the candidate equals what serves, so it is
    # rejected against v1's own held-out α (measured again, on the same records)
    ht.config.lr = 1e-9
    second = ht.turn([], held)
    assert second.decision == "idle" and second.reason == "no training records"
    second = ht.turn(train[:4], [])
    assert second.decision == "rejected" and "did not beat the serving head's" in second.reason
    assert second.parent == first.version and abs(second.alpha_before - first.alpha_after) < 1e-4
    assert heads.get(second.version).state == "rejected" and heads.active_version() == first.version
    assert ht._carry is not None and ht._carry[0] == first.version  # trains on next turn
    # records without hidden states are counted and named, not trained on
    lean = _records(target, tok, 3, 3, hidden=False)
    third = ht.turn(lean, [])
    assert third.decision == "idle" and third.records_without_hidden == len(lean)
    assert "set serve.record_hidden" in third.reason


def test_a_failing_head_turn_never_fails_the_round_that_carries_it(target, tok, redis_client, key_prefix, tmp_path):
    """The LoRA round registers, judges and acks as before when the head's constructor raises;
    the head's report says why."""
    from store.buffer import SampleReader, SampleWriter
    from store.schema import PairFingerprint
    from trainer.distill import DistillConfig, Distiller
    from trainer.service import ServiceConfig, TrainerService
    from tiny import tiny_llama as tl

    cfg = StoreConfig(key_prefix=key_prefix)
    heads = AdapterRegistry(redis_client, tmp_path / "heads", cfg, kind="head")
    ht = _trainer(target, heads, tmp_path)
    ht.new_head = lambda: (_ for _ in ()).throw(RuntimeError("out of memory building the head"))
    recs = _records(target, tok, 16, 4)
    with SampleWriter(redis_client, cfg) as w:
        for r in recs:
            w.submit(r)
        assert w.flush(10)
    reader = SampleReader(redis_client, cfg, "trainer", "c1", expected_fingerprint=PairFingerprint("tiny-t", "tiny-t", "chars"))
    svc = TrainerService(reader, AdapterRegistry(redis_client, tmp_path / "adapters", cfg),
                         Distiller(tl(7, layers=2, hidden=32), DistillConfig(max_steps=2, batch_size=8)),
                         ServiceConfig(min_eval_samples=1, work_dir=str(tmp_path / "w")), heads=ht)
    rep = svc.run_round_now()
    assert rep.decision in ("promoted", "rejected") and rep.acked == len(recs)
    assert rep.head["decision"] == "failed" and "out of memory building the head" in rep.head["reason"]
    assert heads.list() == []


def test_the_heads_v0_is_bootstrapped_once_then_taken_from_the_cache(target, tok, redis_client, key_prefix, tmp_path,
                                                                       monkeypatch):
    """daemon.heads.ensure_head_v0: trained on the built-in corpora on the first start, promoted
    as v1 of an empty registry; a second empty registry gets the cached file (same bytes, no
    training); a registry with history is left alone."""
    import hashlib
    from types import SimpleNamespace

    from daemon.heads import HeadBootstrapConfig, ensure_head_v0
    from store.schema import PairFingerprint

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "cache"))
    pair = SimpleNamespace(target=target, tokenizer=tok)
    fp = PairFingerprint("tiny-t", "tiny-t", "chars")
    cfg = HeadBootstrapConfig(workloads=("prose", "code"), corpus_tokens=1500, heldout_tokens=400, train_seconds=20,
                              max_steps=60)
    reg1 = AdapterRegistry(redis_client, tmp_path / "h1", StoreConfig(key_prefix=key_prefix + "a:"), kind="head")
    torch.manual_seed(0)
    first = ensure_head_v0(pair, fp, reg1, cfg)
    assert first.source == "trained" and first.version == 1 and reg1.active_version() == 1
    assert first.meta["steps"] == 60 and set(first.meta["alpha_by_workload"]) == {"prose", "code"}
    assert reg1.get(1).alpha_after == first.meta["alpha"] > 0.05  # the registry records the bootstrap's held-out α
    reg2 = AdapterRegistry(redis_client, tmp_path / "h2", StoreConfig(key_prefix=key_prefix + "b:"), kind="head")
    second = ensure_head_v0(pair, fp, reg2, cfg)
    assert second.source == "cache" and second.version == 1
    digest = lambda r: hashlib.sha256((r.fetch(1) / HEAD_FILE).read_bytes()).hexdigest()  # noqa: E731
    assert digest(reg1) == digest(reg2)
    assert ensure_head_v0(pair, fp, reg1, cfg).source == "registry"
    # a truncated cache entry is bootstrapped again, not promoted (and refused) on every start
    cached = tmp_path / "cache" / "bootstrap-head"
    (f,) = list(cached.glob(f"*/{HEAD_FILE}"))
    f.write_bytes(f.read_bytes()[:1000])
    reg3 = AdapterRegistry(redis_client, tmp_path / "h3", StoreConfig(key_prefix=key_prefix + "c:"), kind="head")
    third = ensure_head_v0(pair, fp, reg3, cfg)
    assert third.source == "trained" and reg3.active_version() == 1 and len(reg3.list()) == 1
    for k in redis_client.scan_iter(match=key_prefix + "*"):
        redis_client.delete(k)


def test_the_daemon_wires_head_turns_from_its_settings(target, tok, redis_client, key_prefix, tmp_path, monkeypatch):
    """daemon.heads.head_trainer: the head registry under <state_dir>/heads, trainer.head_steps
    and the margins from the settings, heads built on the target with the cut vocabulary."""
    from types import SimpleNamespace

    from daemon.heads import head_trainer
    from daemon.settings import load_settings

    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_TRAINER__HEAD_STEPS", "7")
    monkeypatch.setenv("DRAFTD_TRAINER__PROMOTE_MARGIN", "0.02")
    s = load_settings(None)
    ht = head_trainer(s, redis_client, SimpleNamespace(target=target, tokenizer=tok), StoreConfig(key_prefix=key_prefix))
    assert ht.registry.kind == "head" and ht.registry.artifact_dir == s.head_dir == tmp_path / "state" / "heads"
    assert ht.config.steps == 7 and ht.config.promote_margin == 0.02
    head = ht.new_head()
    assert head.vocab_ids.numel() == len(tok) and head.hidden_size == 48  # 8192 cut to the tiny vocabulary
    monkeypatch.setenv("DRAFTD_TRAINER__HEAD_STEPS", "0")
    import pytest

    from daemon.settings import ConfigError

    with pytest.raises(ConfigError, match="head_steps"):
        load_settings(None)


def test_found_by_review_fixed_gamma_and_seeded_requests_fall_back_while_no_head_serves(target, other_draft, tok,
                                                                                       redis_client, key_prefix,
                                                                                       tmp_path):
    """With 'eagle' first among the proposers and no head yet, a client's fixed γ and a seeded
    sampled request used to fail ("proposer 'eagle' needs a head"): they run the first proposer
    that can propose now."""
    from decoder.loop import build_serving_loop

    heads = AdapterRegistry(redis_client, tmp_path / "heads", StoreConfig(key_prefix=key_prefix), kind="head")
    loop = build_serving_loop(target, other_draft, tok, decoder_config=DecoderConfig(topk_record=0),
                              proposers=("eagle", "ngram"), head_registry=heads, poll_interval_s=0.2)
    ids = _ids(tok, "abc abc abc")
    with loop:
        r = loop.generate(DecodeRequest(ids, GREEDY, 8, ignore_eos=True, gamma=2), timeout=60)
        assert r.proposer == "ngram" and r.output_ids == reference_greedy(target, ids, 8)
        r = loop.generate(DecodeRequest(ids, SamplingParams(temperature=1.0, seed=3), 8, ignore_eos=True), timeout=60)
        assert r.proposer == "ngram" and len(r.output_ids) == 8


def test_found_by_review_a_head_with_huge_weights_and_the_check_that_wrote_to_the_decoder(target, tok, redis_client,
                                                                                          key_prefix, tmp_path):
    """A head with finite but huge weights passes the registry's check (finite tensors) and
    made every sampled request fail: the manager's probe step refuses it. The check no longer
    sets decoder.eagle_head while requests decode on another thread."""
    cfg = StoreConfig(key_prefix=key_prefix)
    heads = AdapterRegistry(redis_client, tmp_path / "heads", cfg, kind="head")
    dec = SpeculativeDecoder(target, target, tok)
    mgr = HeadManager(dec, heads, load=serving_head_loader(dec, torch.float32))
    v1 = heads.register(_head_dir(tmp_path / "h1", target, 1), AdapterMeta())
    heads.promote(v1, "good")
    mgr.poll_once()
    dec.generate(DecodeRequest(_ids(tok, "cat"), GREEDY, 2, ignore_eos=True))
    serving = dec.eagle_head
    torch.manual_seed(2)
    huge = EagleHead.from_target(target)
    with torch.no_grad():
        for p in huge.parameters():
            p.mul_(1e30)
    d = tmp_path / "huge"
    d.mkdir()
    save_head(huge, d / HEAD_FILE, target)
    v2 = heads.register(d, AdapterMeta())
    heads.promote(v2, "finite, huge")  # the registry's check passes: every tensor is finite
    mgr.poll_once()
    assert mgr.failures[-1].version == v2 and "probe step" in mgr.failures[-1].reason
    assert dec.eagle_head is serving and mgr.route("prose") == v1
    other = EagleHead.from_target(tiny_llama(3, layers=2, hidden=32))
    import pytest

    with pytest.raises(ValueError, match="32-wide features"):
        mgr._check(other)
    assert dec.eagle_head is serving  # untouched by the check
    r = dec.generate(DecodeRequest(_ids(tok, "cat"), SamplingParams(temperature=1.0, seed=1), 6, ignore_eos=True,
                                   proposer="eagle"))
    assert r.head_version == v1 and len(r.output_ids) == 6
    mgr.close()


def test_found_by_review_every_record_of_a_turn_trains_and_odd_widths_are_refused(target, tok, redis_client,
                                                                                key_prefix, tmp_path):
    """A turn trained only on the bounded replay pool (64 records a workload), dropping the
    rest of a round; and one record of another hidden or top-k width stopped every later turn."""
    import dataclasses

    import numpy as np

    from trainer.head import record_items

    heads = AdapterRegistry(redis_client, tmp_path / "heads", StoreConfig(key_prefix=key_prefix), kind="head")
    train, held = _records(target, tok, 24, 1), _records(target, tok, 6, 2)
    ht = _trainer(target, heads, tmp_path, replay_per_workload=2, steps=20)
    odd_h = dataclasses.replace(train[0], record_id="odd-h", hidden=np.zeros((train[0].num_tokens, 32), np.float16))
    odd_k = dataclasses.replace(train[1], record_id="odd-k", topk_ids=train[1].topk_ids[:, :4],
                                topk_probs=train[1].topk_probs[:, :4],
                                tail_mass=1 - train[1].topk_probs[:, :4].astype(np.float32).sum(1))
    odd_held = dataclasses.replace(held[0], record_id="odd-held", workload="other",
                                   hidden=np.zeros((held[0].num_tokens, 32), np.float16))
    torch.manual_seed(0)
    rep = ht.turn(train + [odd_h, odd_k], held + [odd_held])
    assert rep.records == len(train) and rep.records_refused == 3
    assert rep.windows == len(record_items(train, 16))  # every record of the round, not the 2 kept for replay
    assert rep.decision == "promoted", rep
    assert "other" not in ht.status()["heldout_records"]
    rep2 = ht.turn(train[:3], [])  # later turns are not poisoned
    assert rep2.decision in ("promoted", "rejected") and rep2.windows == len(record_items(train[:3] + train[-2:], 16))


def test_found_by_review_head_config_refuses_nan_margins_and_fractional_counts():
    import pytest

    from trainer.heads import HeadConfig

    for kw in ({"promote_margin": float("nan")}, {"regress_margin": float("nan")}, {"regress_margin": -0.1},
               {"steps": 1.5}, {"window": 3.5}, {"heldout_per_workload": 2.5}):
        with pytest.raises(ValueError, match="HeadConfig"):
            HeadConfig(**kw)


def _head_result(head_version: int, proposer: str, alpha: float | None, workload: str = "prose", adapter: int = 0):
    """A request's result as the tracker reads it: 4 tokens proposed at α by ``proposer``
    (None: decoded plain), under adapter ``adapter`` and head ``head_version`` (the decoder
    sets head_version only when the head proposed)."""
    from types import SimpleNamespace

    from decoder.metrics import AcceptanceCounts

    c = AcceptanceCounts(num_requests=1, num_steps=4, num_emitted_tokens=4)
    if alpha is not None:
        c.num_drafts, c.num_draft_tokens, c.alpha_sum = 1, 4, 4 * alpha
    return SimpleNamespace(workload=workload, sampling_bucket="greedy", adapter_version=adapter, counts=c,
                           proposer=proposer, head_version=head_version if proposer == "eagle" else 0)


def test_a_promoted_head_that_regresses_live_is_rolled_back_on_the_requests_it_proposed_for(target, redis_client,
                                                                                            key_prefix, tmp_path):
    """Head v1 proposes at α 0.4; v2 replaces it. Under v2 the n-gram proposer serves 6 requests at
    α 0.9 and the draft 3 at 0.8: none of them is v2's doing, and v2 is not judged on them. v2's
    own 3 requests at 0.1 (0.4 - 0.1 > margin 0.1 below v1) roll it back to v1; v3, at 0.45 on
    its own requests, is kept. The adapter monitor never sees a head version."""
    import pytest

    from decoder.rollback import RollbackMonitor
    from decoder.tracking import AcceptanceTracker

    cfg = StoreConfig(key_prefix=key_prefix)
    heads = AdapterRegistry(redis_client, tmp_path / "heads", cfg, kind="head")
    with pytest.raises(ValueError, match="the registry holds heads; pass AdapterRegistry"):
        RollbackMonitor(heads, AcceptanceTracker())  # the adapter monitor on a head registry
    tracker = AcceptanceTracker()
    monitor = RollbackMonitor(heads, tracker, min_requests=3, margin=0.1, proposer="eagle")

    def serve(results):
        for r in results:
            tracker.observe(r)
            if r.proposer == "eagle" and r.head_version:  # as ServingLoop._after does
                monitor.check(r.head_version, r.workload)

    v1 = heads.register(_head_dir(tmp_path / "h1", target, 1), AdapterMeta())
    heads.promote(v1, "first")
    serve([_head_result(v1, "eagle", 0.4)] * 3)
    assert monitor.decisions == []  # the first head has no predecessor to be judged against
    v2 = heads.register(_head_dir(tmp_path / "h2", target, 2), AdapterMeta())
    heads.promote(v2, "trained")
    serve([_head_result(v2, "ngram", 0.9)] * 6 + [_head_result(v2, "draft", 0.8)] * 3 + [_head_result(v2, "eagle", 0.1)] * 2)
    assert monitor.decisions == []  # 2 of v2's own requests: short of min_requests
    assert tracker.window("prose", "greedy", v2, proposer="eagle").counts.num_requests == 2
    serve([_head_result(v2, "eagle", 0.1)])
    d = monitor.decisions[-1]
    assert (d.kind, d.version, d.previous, d.rolled_back, d.key) == ("head", v2, v1, True, "prose@greedy")
    assert d.new_value == pytest.approx(0.1) and d.previous_value == pytest.approx(0.4)
    assert d.reason.startswith(f"auto-rollback: head v{v2} alpha=0.100 on prose@greedy over 3 requests vs v{v1} 0.400")
    assert heads.active_version() == v1
    serve([_head_result(v1, "eagle", 0.4)])  # v1 serves again (a rollback is not judged)
    assert len(monitor.decisions) == 1
    v3 = heads.register(_head_dir(tmp_path / "h3", target, 3), AdapterMeta())
    heads.promote(v3, "trained")
    serve([_head_result(v3, "eagle", 0.45)] * 3)
    d = monitor.decisions[-1]
    assert (d.version, d.previous, d.rolled_back) == (v3, v1, False) and heads.active_version() == v3
    assert d.reason.startswith(f"kept: head v{v3}")
    with pytest.raises(ValueError, match="proposer='ngram'"):
        tracker.window("prose", "greedy", v3, proposer="ngram")


def test_the_head_history_is_kept_by_head_version_apart_from_the_adapter_history(redis_client, key_prefix):
    """Every request goes to the adapter history under its adapter version (here 7: 5 requests,
    20 proposed tokens); only the head's 3 go to the head history, under head versions 2 and 3,
    so summing either kind counts each request once."""
    from decoder.tracking import AcceptanceTracker
    from store import AcceptanceHistory

    cfg = StoreConfig(key_prefix=key_prefix)
    hist = AcceptanceHistory(redis_client, cfg)
    heads = hist.of_kind("head")
    tracker = AcceptanceTracker(hist, head_history=heads)
    for r in [_head_result(2, "eagle", 0.5, adapter=7), _head_result(2, "eagle", 0.25, adapter=7),
              _head_result(3, "eagle", 0.75, adapter=7), _head_result(2, "ngram", 1.0, adapter=7),
              _head_result(2, "draft", None, adapter=7)]:
        tracker.observe(r)
    assert tracker.flush() == 3  # one adapter key, two head keys
    rows = hist.read()
    assert [(r.workload, r.version, r.requests, r.num_draft_tokens) for r in rows] == [("prose@greedy", 7, 5, 16)]
    by_v = {r.version: r for r in heads.read()}
    assert sorted(by_v) == [2, 3]
    assert (by_v[2].requests, by_v[2].num_draft_tokens, by_v[3].requests) == (2, 8, 1)
    assert by_v[2].alpha_sum == 0.5 + 0.25 and by_v[3].alpha_sum == 0.75  # per-request α, summed
    assert heads.read(version=7) == [] and hist.read(version=2) == []
    assert redis_client.exists(f"{key_prefix}head:hist:index") and redis_client.exists(f"{key_prefix}hist:index")
    assert tracker.status()["head_windows"]["prose@greedy/head v2"]["requests"] == 2
    import pytest

    with pytest.raises(ValueError, match="history kind 'lora'"):
        AcceptanceHistory(redis_client, cfg, kind="lora")


def test_found_by_review_a_broken_clock_loses_the_time_not_the_counts(redis_client, key_prefix):
    """A head request timed at inf ms: HINCRBYFLOAT refused it inside MULTI while Redis applied the
    rest, so every flush added the integer counts again (1 request read as 5) and the keys queued
    after it were never written. Now the window goes out with wall_ms 0 and the history refuses a
    non-finite counter by name."""
    import math

    import pytest

    from decoder.tracking import AcceptanceTracker
    from store import AcceptanceHistory

    cfg = StoreConfig(key_prefix=key_prefix)
    heads = AcceptanceHistory(redis_client, cfg, kind="head")
    tracker = AcceptanceTracker(head_history=heads)
    bad = _head_result(2, "eagle", 0.5)
    bad.counts.decode_ms = math.inf
    tracker.observe(bad)
    tracker.observe(_head_result(2, "eagle", 0.25, workload="code"))
    for _ in range(3):
        tracker.flush()
    rows = {r.workload: r for r in heads.read()}
    assert (rows["prose@greedy"].requests, rows["prose@greedy"].wall_ms, rows["code@greedy"].requests) == (1, 0.0, 1)
    with pytest.raises(ValueError, match=r"must be finite numbers, got \{'wall_ms': inf\} for 'w' v1"):
        heads.record("w", 1, {"requests": 1, "wall_ms": math.inf})


def test_found_by_review_heads_list_survives_a_corrupt_head_history(redis_client, key_prefix, tmp_path):
    """A head history index member without '|' (or an index of another type) used to crash
    ``heads list`` even with no heads registered; now the unreadable member is left out (the
    history's reader skips it with a warning naming the key) and an index of another type lists
    the versions with live None and why."""
    from daemon.reports import heads_list
    from store import AcceptanceHistory

    cfg = StoreConfig(key_prefix=key_prefix)
    heads = AdapterRegistry(redis_client, tmp_path / "heads", cfg, kind="head")
    hist = AcceptanceHistory(redis_client, cfg, kind="head")
    redis_client.zadd(f"{key_prefix}head:hist:index", {"garbage": 1})
    assert heads_list(heads, hist) == []  # nothing registered: the history is not read
    v1 = heads.register(_head_dir(tmp_path / "h1", tiny_llama(3, layers=2, hidden=32), 1), AdapterMeta())
    (row,) = heads_list(heads, hist)
    assert row["version"] == v1 and row["live"]["requests"] == 0 and not row.get("live_error")
    redis_client.delete(f"{key_prefix}head:hist:index")
    redis_client.set(f"{key_prefix}head:hist:index", "a string")
    (row,) = heads_list(heads, hist)
    assert row["live"] is None and "WRONGTYPE" in row["live_error"]
