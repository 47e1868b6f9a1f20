"""Issue 16: promote and rollback check the artifact (sha256, loadable, finite); orphans are cleaned."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from store.config import StoreConfig
from store.errors import ArtifactInvalidError, InvalidTransitionError
from store.registry import AdapterMeta, AdapterRegistry
from test_store_registry import peft_dir


@pytest.fixture
def reg(redis_client, key_prefix, tmp_path):
    return AdapterRegistry(redis_client, tmp_path / "artifacts", StoreConfig(key_prefix=key_prefix))


def weights(reg, v):
    return reg.artifact_dir / f"v{v}" / "adapter_model.safetensors"


def test_promote_refuses_truncated_missing_and_nan_adapters(reg, tmp_path):
    good = reg.register(peft_dir(tmp_path / "good"), AdapterMeta())
    cut = reg.register(peft_dir(tmp_path / "cut", 1), AdapterMeta())
    gone = reg.register(peft_dir(tmp_path / "gone", 2), AdapterMeta())
    nan_src = peft_dir(tmp_path / "nan", 3)
    save_file({"base_model.model.q_proj.lora_A.weight": np.full((8, 16), np.nan, np.float32)},
              str(nan_src / "adapter_model.safetensors"))
    nan = reg.register(nan_src, AdapterMeta())  # its sha256 is right: the file itself holds NaN
    raw = weights(reg, cut).read_bytes()
    weights(reg, cut).write_bytes(raw[: len(raw) // 2])
    weights(reg, gone).unlink()
    for v, why in ((cut, "sha256"), (gone, "lacks adapter_model.safetensors"), (nan, "NaN or infinity")):
        with pytest.raises(ArtifactInvalidError, match=f"cannot promote v{v}: .*{why}"):
            reg.promote(v, "operator")
        assert reg.active_version() == 0 and reg.get(v).state == "candidate"
    assert issubclass(ArtifactInvalidError, InvalidTransitionError)  # the API answers 409
    assert reg.promote(good, "ok") == 0 and reg.active_version() == good


def test_rollback_skips_versions_whose_artifact_fails_and_says_so(reg, tmp_path):
    v1, v2, v3 = (reg.register(peft_dir(tmp_path / f"a{i}", i), AdapterMeta()) for i in range(3))
    for v in (v1, v2, v3):
        reg.promote(v, "up")
    raw = weights(reg, v2).read_bytes()
    weights(reg, v2).write_bytes(raw[:-7])  # corrupted after its promotion
    new, skipped = reg.rollback_checked("v3 regressed")
    assert new == v1 and reg.active_version() == v1
    assert list(skipped) == [v2] and "sha256" in skipped[v2]
    rec = reg.get(v2)
    assert rec.state == "rolled_back" and rec.reason.startswith("skipped by rollback:") and "sha256" in rec.reason
    assert reg.get(v3).state == "rolled_back"


def test_clean_orphans_removes_temp_and_unregistered_dirs(reg, tmp_path, redis_client):
    v1 = reg.register(peft_dir(tmp_path / "a"), AdapterMeta())
    d = reg.artifact_dir
    (d / ".tmp-v2-deadbeef").mkdir()
    (d / "v2").mkdir()  # renamed into place, Redis record never written (crash)
    redis_client.incr(reg._keys.adapter_counter)  # ... after Redis issued v2
    (d / "v9").mkdir()  # beyond the counter: not ours to delete
    old = time.time() - 3600
    for p in d.iterdir():
        os.utime(p, (old, old))
    (d / ".tmp-v3-fresh").mkdir()  # a registration in progress
    assert reg.clean_orphans(min_age_s=600) == [".tmp-v2-deadbeef", "v2"]
    assert sorted(p.name for p in d.iterdir()) == [".tmp-v3-fresh", f"v{v1}", "v9"]
