"""Model references that are paths: a clear ModelLoadError naming the path (no tokenizer or hub-id
error from transformers)."""

from __future__ import annotations

import pytest

from decoder.models import ModelLoadError, resolve_model_dir


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json") as ei:
        resolve_model_dir(str(tmp_path))
    assert str(tmp_path) in str(ei.value)


def test_file_is_not_a_model_dir(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a model directory"):
        resolve_model_dir(str(f))


@pytest.mark.parametrize("ref", ["/nonexistent/draftd-model", "./no-such-model", "~/no-such-draftd-model"])
def test_missing_path(ref):
    with pytest.raises(ModelLoadError, match="does not exist") as ei:
        resolve_model_dir(ref)
    assert ref in str(ei.value)


def test_model_dir_and_hub_id_pass_through(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    assert resolve_model_dir("org/some-model") == "org/some-model"
