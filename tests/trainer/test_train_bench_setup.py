"""bench/train_bench.py's prompt cutting and its checks that run before any model is loaded."""

import argparse
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("train_bench", Path(__file__).parents[2] / "bench" / "train_bench.py")
train_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_bench)


def test_doc_prompts_cuts_at_words_and_skips_empty_cuts():
    """A 1001-character document of one word: the opening cut (400 chars, up to the last space) is
    empty and is skipped, as is the cut at 1200 characters (past the end); a normal document gives
    its opening up to the last whole word."""
    assert train_bench.doc_prompts("w", [("a", " " + "q" * 1000)], 2) == []
    text = " ".join(f"w{i:03d}" for i in range(200))  # 5 chars per word, 999 characters
    out = train_bench.doc_prompts("w", [("a", text)], 3)
    assert [p.text for p in out] == [text[:400].rsplit(" ", 1)[0]]
    assert out[0].text.endswith("w079") and out[0].workload == "w"


def _args(**kw):
    base = dict(workloads="prose", prompts=12, bench_prompts=12, decode_bench=True, target="smollm2-135m", layers="0-3")
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if the setup gets as far as loading the model."""
    import decoder.models.loading

    def boom(*a, **k):
        raise AssertionError("load_pair was called before the prompt checks")

    monkeypatch.setattr(decoder.models.loading, "load_pair", boom)


@pytest.mark.parametrize("kw, match", [({"prompts": 0}, "--prompts 0"), ({"bench_prompts": 0}, "--bench-prompts 0"),
                                       ({"workloads": "prose,short"}, "workload 'short'")])
def test_corpus_setup_stops_before_loading_the_model(monkeypatch, no_model, kw, match):
    """A workload whose held-out side is too short for a prompt, or a zero prompt count, stops
    the run by name before the model is loaded and the data scored (after, before)."""
    import decoder.workloads

    real = decoder.workloads.documents
    monkeypatch.setattr(decoder.workloads, "documents",
                        lambda w: [(f"d{i}", f"tiny document {i}") for i in range(10)] if w == "short" else real(w))
    with pytest.raises(SystemExit, match=match):
        train_bench.corpus_setup(_args(**kw))


@pytest.mark.parametrize("argv, match", [
    (["--pair", "tiny", "--lr-decay", "cosine"], "--lr-decay cosine needs --pair smollm2 --data corpus"),
    (["--pair", "smollm2", "--lr", "-1"], "--lr -1.0: must be a finite number > 0"),
    (["--pair", "smollm2", "--lr", "nan"], "--lr nan: must be a finite number > 0"),
    (["--pair", "smollm2", "--lr", "1e-3", "--lr-min", "2e-3"], "--lr-min 0.002: must be in 0..--lr"),
    (["--pair", "tiny", "--train-draft-vocab", "8"], "--train-draft-vocab needs --pair smollm2 --data corpus"),
    (["--pair", "smollm2", "--train-draft-vocab", "-1"], "--train-draft-vocab -1: must be >= 0"),
])
def test_argument_errors_name_the_flag(monkeypatch, capsys, argv, match):
    monkeypatch.setattr("sys.argv", ["train_bench.py", *argv])
    with pytest.raises(SystemExit) as e:
        train_bench.main()
    assert e.value.code == 2
    assert match in capsys.readouterr().err
