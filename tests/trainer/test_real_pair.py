"""Integration on the real pair (slow): SmolLM2 target, its untrained layer-derived draft,
target-generated samples (decoder at gamma = 0) in a real Redis stream, one scheduled round.

Run with ``pytest -m slow tests/trainer/test_real_pair.py`` (minutes on 2 cores).
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow


def test_scheduled_round_on_real_pair_beats_untrained_draft(redis_client, key_prefix, tmp_path):
    models = pytest.importorskip("decoder.models.loading")
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
    from decoder.workloads import get_workload
    from store.buffer import SampleReader, SampleWriter
    from store.config import StoreConfig
    from store.registry import AdapterRegistry
    from store.schema import PairFingerprint
    from trainer.distill import DistillConfig, Distiller
    from trainer.service import ServiceConfig, TrainerService, group_lag

    try:
        pair = models.load_pair("smollm2-135m", draft="layers:0-7")
    except models.ModelLoadError as e:
        pytest.skip(f"real pair not installed: {e}")
    cfg = StoreConfig(key_prefix=key_prefix)
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    with SampleWriter(redis_client, cfg) as writer:
        dec = SpeculativeDecoder(pair.target, pair.target, pair.tokenizer, DecoderConfig(topk_record=32),
                                 sink=writer.submit, pair_fingerprint=fp)
        for p in get_workload("prose", n=20):
            dec.generate(DecodeRequest(p.token_ids(pair.tokenizer), SamplingParams(temperature=0.0),
                                       max_new_tokens=24, gamma=0, ignore_eos=True, workload="prose"))
        assert writer.flush(30)
    reader = SampleReader(redis_client, cfg, "trainer", "t1", expected_fingerprint=fp)
    registry = AdapterRegistry(redis_client, tmp_path / "artifacts", cfg)
    dist = Distiller(pair.draft, DistillConfig(lr=2e-3, batch_size=4, max_steps=60, max_epochs=16, max_seconds=400))
    svc = TrainerService(reader, registry, dist,
                         ServiceConfig(interval_s=3600, check_interval_s=0.5, min_new_samples=10, min_eval_samples=2,
                                       holdout_fraction=0.25, promote_margin=0.0, work_dir=str(tmp_path / "work")),
                         backlog=lambda: group_lag(redis_client, cfg, "trainer"))
    svc.start()
    try:
        deadline = time.time() + 900
        while (svc.status()["rounds"] == 0 or svc.status()["running"]) and time.time() < deadline:
            time.sleep(1)
    finally:
        svc.stop()
    last = svc.status()["last_round"]
    assert last is not None and last["trigger"] == "backlog" and last["version"] is not None, last
    rec = registry.get(last["version"])
    # Held-out samples are never trained on; the registered adapter beats the untrained draft there.
    assert rec.alpha_after > rec.alpha_before, (rec.alpha_before, rec.alpha_after, rec.reason)
    assert rec.parent == 0 and last["before"]["overall"]["alpha"] == pytest.approx(rec.alpha_before)
