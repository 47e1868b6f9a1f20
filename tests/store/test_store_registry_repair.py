"""fetch() of a version whose local copy lost a file: restored from the bytes in Redis (was a raw
OSError 'Directory not empty'), or, without bytes, an ArtifactMissingError naming the file."""

from __future__ import annotations

import pytest

from store.errors import ArtifactMissingError
from store.registry import AdapterMeta, AdapterRegistry


def _src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_text('{"r": 4}')
    (src / "adapter_model.safetensors").write_bytes(b"weights" * 10)
    return src


def test_incomplete_local_copy_is_restored_from_redis(client, cfg, tmp_path):
    reg = AdapterRegistry(client, tmp_path / "art", cfg)
    v = reg.register(_src(tmp_path), AdapterMeta(), store_bytes=True)
    (tmp_path / "art" / f"v{v}" / "adapter_model.safetensors").unlink()
    got = reg.fetch(v)
    assert got == tmp_path / "art" / f"v{v}"
    assert (got / "adapter_model.safetensors").read_bytes() == b"weights" * 10
    assert [p.name for p in (tmp_path / "art").iterdir()] == [f"v{v}"]  # no stale/tmp dirs left


def test_incomplete_local_copy_without_bytes_names_the_file(client, cfg, tmp_path):
    reg = AdapterRegistry(client, tmp_path / "art", cfg)
    v = reg.register(_src(tmp_path), AdapterMeta())
    (tmp_path / "art" / f"v{v}" / "adapter_model.safetensors").unlink()
    with pytest.raises(ArtifactMissingError, match="lacks adapter_model.safetensors"):
        reg.fetch(v)
