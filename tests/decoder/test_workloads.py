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
