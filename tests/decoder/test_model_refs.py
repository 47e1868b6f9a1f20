"""Model references that are paths: a clear ModelLoadError naming the path (no tokenizer or hub-id
error from transformers)."""

from __future__ import annotations

import pytest

from decoder.models.loading import resolve_model_dir
from decoder.models.packaged import ModelLoadError


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


def test_a_gguf_file_is_converted_and_cached_like_a_built_in(tmp_path, monkeypatch):
    """A ``.gguf`` path (what choose_engine and the README call a GGUF target) loads: converted to
    a transformers directory once, then the cached one; a broken one is a ModelLoadError."""
    pytest.importorskip("gguf")
    from test_gguf_export import tiny_model, write_tiny_gguf

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "cache"))
    g = write_tiny_gguf(tiny_model(), tmp_path / "tiny.gguf", extra=False)
    out = resolve_model_dir(str(g))
    assert (out / "config.json").is_file() and out.parent == tmp_path / "cache" and out.name.startswith("tiny-")
    assert resolve_model_dir(str(g)) == out
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(g.read_bytes()[: g.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot load this GGUF file") as ei:
        resolve_model_dir(str(broken))
    assert str(broken) in str(ei.value)


def test_a_built_in_name_at_a_format_is_its_file_requantised(tmp_path, monkeypatch):
    """``name@bf16`` resolves, for llama.cpp and for transformers alike, to the built-in's GGUF
    requantised by llama.cpp (cached under DRAFTD_CACHE_DIR); an unknown format is a ModelLoadError
    that names it and shows the form; a name that is not built in is not a built-in reference."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    import gguf

    import decoder.models.loading as M
    from decoder.models.packaged import PackagedModel
    from decoder.engines.registry import target_gguf
    from test_gguf_export import tiny_model, write_tiny_gguf

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_gguf(tiny_model(), tmp_path / "tiny.gguf", extra=False)
    monkeypatch.setitem(M.PACKAGED, "tiny-pkg", PackagedModel("tiny-pkg", "tiny_pkg", "pip install tiny-pkg"))
    monkeypatch.setattr(M, "packaged_gguf", lambda name: src if name == "tiny-pkg" else None)
    g = M.packaged_target("tiny-pkg@bf16")
    assert g.parent == tmp_path / "cache" / "requant" and g.name.endswith("-BF16.gguf")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(g).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.BF16
    assert target_gguf("tiny-pkg@bf16") == g and target_gguf("tiny-pkg") == src
    out = resolve_model_dir("tiny-pkg@bf16")
    assert (out / "config.json").is_file() and out.name.startswith("tiny-pkg-bf16-")
    assert out != resolve_model_dir("tiny-pkg")  # its own conversion: a different file
    with pytest.raises(ModelLoadError, match=r"model 'tiny-pkg@q9': 'q9' is not a llama.cpp weight format.*tiny-pkg@bf16"):
        M.packaged_target("tiny-pkg@q9")
    assert M.packaged_target("not-built-in@bf16") is None
    # one file, one pair fingerprint: the format as llama.cpp spells it
    assert M.canonical_ref("tiny-pkg@bf16 ") == M.canonical_ref("tiny-pkg@BF16") == "tiny-pkg@BF16"
    assert M.canonical_ref("not-built-in@bf16") == "not-built-in@bf16" and M.canonical_ref("tiny-pkg") == "tiny-pkg"


def test_a_split_reference_trains_on_its_source_and_a_split_file_is_refused_by_transformers(tmp_path, monkeypatch):
    """``name@q4_1s`` is the built-in's Q4_1 file split for llama.cpp; transformers' copy is the
    Q4_1 file's own conversion (the same weights: the split's Q4_0 blocks alone would be another
    model). The split file given as a path is refused, naming what to pass instead."""
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    import gguf

    import decoder.models.loading as M
    from decoder.models.packaged import PackagedModel
    from decoder.models.gguf_export import requantised_gguf
    from test_gguf_export import tiny_model, write_tiny_gguf

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "cache"))
    q41 = requantised_gguf(write_tiny_gguf(tiny_model(), tmp_path / "tiny.gguf", extra=False), "Q4_1",
                           cache_dir=tmp_path / "q41")
    assert gguf.GGMLQuantizationType.Q4_1 in {t.tensor_type for t in gguf.GGUFReader(q41).tensors}
    monkeypatch.setitem(M.PACKAGED, "tiny-pkg", PackagedModel("tiny-pkg", "tiny_pkg", "pip install tiny-pkg"))
    monkeypatch.setattr(M, "packaged_gguf", lambda name: q41 if name == "tiny-pkg" else None)
    split = M.packaged_target("tiny-pkg@q4_1s")
    assert split.name.endswith("-Q4_1S-v3.gguf") and M.canonical_ref("tiny-pkg@q4_1s") == "tiny-pkg@Q4_1S"
    assert resolve_model_dir("tiny-pkg@q4_1s") == resolve_model_dir("tiny-pkg")
    with pytest.raises(ModelLoadError, match=r"is a split Q4_1 file .*pass the Q4_1 file it was split from, or a "
                                             r"built-in name with @q4_1s"):
        resolve_model_dir(str(split))
