"""`daemonctl generate` as a user runs it, with the real packaged model: stdout is the text only."""

from __future__ import annotations

import json

import pytest

from conftest import base_env, ctl, free_port

pytestmark = pytest.mark.slow


def test_generate_prints_only_the_text_on_stdout_and_the_record_on_stderr(tmp_path):
    env = base_env(tmp_path / "state", free_port())
    r = ctl(env, "generate", "-p", "def fibonacci(n):", "--gamma", "3", "--max-new-tokens", "12", timeout=300)
    assert r.returncode == 0, r.stderr
    # no log line (e.g. the small-M kernel calibration) mixed into the generated text
    assert "small_m_linear" not in r.stdout and "[info" not in r.stdout and "[debug" not in r.stdout
    assert r.stdout.strip(), "the generated text"
    record = json.loads(r.stderr[r.stderr.index("{"):])
    assert record["matches_plain"] is True and record["output_tokens"] == 12
