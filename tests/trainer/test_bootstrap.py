"""Bootstrap on target-generated gamma = 0 samples of the tiny pair, into a real registry."""

from __future__ import annotations

import pytest

from store.config import StoreConfig
from store.registry import AdapterRegistry
from tiny_pair import make_samples
from trainer.bootstrap import BootstrapConfig, bootstrap
from trainer.distill import DistillConfig, Distiller, TrainerError


def test_bootstrap_registers_and_promotes_v1(redis_client, key_prefix, tmp_path, target, draft):
    samples = make_samples(target, 64, "prose", seed=11) + make_samples(target, 64, "code", seed=12)  # gamma = 0
    registry = AdapterRegistry(redis_client, tmp_path / "artifacts", StoreConfig(key_prefix=key_prefix))
    dist = Distiller(draft, DistillConfig(lr=3e-3, batch_size=8))
    points = []
    res = bootstrap(samples, dist, registry, BootstrapConfig(max_steps=80, round_steps=40, holdout_fraction=0.2), on_round=points.append)
    assert res.steps == 80 and [p.steps for p in res.curve] == [40, 80] and points == res.curve
    assert res.samples_trained + res.heldout_samples == len(samples)
    assert res.after.alpha > res.base.alpha + 0.3, res.reason
    assert res.promoted and res.version == 1 and registry.active_version() == 1
    rec = registry.get(1)
    assert rec.state == "promoted" and rec.reason.startswith("bootstrap: held-out alpha")
    assert dist.config.max_steps == DistillConfig().max_steps  # the caller's config is restored


def test_bootstrap_refuses_rejected_weighting_on_plain_samples(target, draft):
    samples = make_samples(target, 40, seed=13)
    dist = Distiller(draft, DistillConfig(weighting="rejected"))
    with pytest.raises(TrainerError, match="weighting='rejected'"):
        bootstrap(samples, dist, None, BootstrapConfig(max_steps=10, holdout_fraction=0.2))


def test_bootstrap_without_promote_registers_a_candidate_that_can_be_promoted(redis_client, key_prefix, tmp_path,
                                                                               target, draft):
    """`daemonctl bootstrap --no-promote` ("register the adapter but do not promote it") stored it
    as rejected, which promote() refuses ("register a new adapter instead")."""
    samples = make_samples(target, 48, "prose", seed=21)
    registry = AdapterRegistry(redis_client, tmp_path / "artifacts", StoreConfig(key_prefix=key_prefix))
    dist = Distiller(draft, DistillConfig(lr=3e-3, batch_size=8))
    res = bootstrap(samples, dist, registry, BootstrapConfig(max_steps=20, round_steps=20, holdout_fraction=0.25,
                                                             promote=False))
    assert not res.promoted and res.version == 1 and registry.active_version() == 0
    rec = registry.get(1)
    assert rec.state == "candidate" and rec.reason.endswith("(promote=False)"), (rec.state, rec.reason)
    registry.promote(1, "by hand")
    assert registry.active_version() == 1
