"""JSONL workloads: every bad file is a ValueError naming the file (and line), never a raw
UnicodeDecodeError / IsADirectoryError."""

from __future__ import annotations

import pytest

from decoder.workloads import get_workload, load_jsonl


def test_good_rows(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "héllo", "workload": "x"}\n\n{"prompt": "b"}\r\n', encoding="utf-8")
    rows = load_jsonl(p)
    assert [(r.workload, r.text) for r in rows] == [("x", "héllo"), ("default", "b")]


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', ":2: not UTF-8"),
        (b'{"prompt": "a"}\n{bad\n', ":2: not JSON"),
        (b'{"workload": "x"}\n', ":1: row has no string 'prompt'"),
        (b'{"prompt": ""}\n', ":1: 'prompt' is empty"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, content, needle):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="bad.jsonl") as ei:
        load_jsonl(p)
    assert needle in str(ei.value)


def test_directory_and_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        get_workload(str(tmp_path))
    with pytest.raises(ValueError, match="unknown workload 'nosuch'"):
        get_workload("nosuch")


@pytest.mark.parametrize("name, at_least", [("prose", 400), ("code", 1000), ("extract", 400)])
def test_builtin_workloads_do_not_repeat(name, at_least):
    """A demo phase serves a few hundred requests: every built-in workload has that many distinct
    prompts (issue 34: the math phase repeated five prompts and its live α was the n-gram
    proposer copying repeats)."""
    ps = get_workload(name, at_least)
    assert len(ps) == at_least and len({p.text for p in ps}) == at_least
    assert all(p.workload == name for p in ps)


def test_generated_math_is_distinct_and_deterministic():
    from decoder.workloads import generated_math

    qs = generated_math(1000)
    assert len(set(qs)) == 1000 and qs == generated_math(1000) and qs[:10] == generated_math(10)
    assert all(q.endswith("?") for q in qs)


def test_math_without_shared_data_never_repeats(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTD_SHARED_DATA", str(tmp_path))  # an empty directory: no gsm8k_test.jsonl
    ps = get_workload("math", 500)
    assert len({p.text for p in ps}) == 500 and all(p.chat for p in ps)


def test_served_code_is_never_bootstrap_text():
    from decoder.workloads import documents

    corpus = "\n".join(t for _, t in documents("code"))
    assert not [p.text[:200] for p in get_workload("code", 300) if p.text in corpus]


def test_extract_prompts_carry_their_passage():
    from decoder.workloads import EXTRACT_INSTRUCTIONS

    for p in get_workload("extract", 20):
        head, _, passage = p.text.partition("\n\n")
        assert p.chat and head in EXTRACT_INSTRUCTIONS and len(passage) >= 200
