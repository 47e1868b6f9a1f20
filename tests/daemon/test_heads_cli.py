"""`daemonctl heads list` / `heads rollback` on the real Redis: they read and write the head
registry directly (no daemon), and a rollback with nothing active exits 1 naming why."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file
from typer.testing import CliRunner

from daemon.cli import app
from store.config import StoreConfig
from store.registry import HEAD_FILE, AdapterMeta, AdapterRegistry


def test_heads_list_and_rollback(redis_client, key_prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_STORE__KEY_PREFIX", key_prefix)
    monkeypatch.setenv("DRAFTD_REDIS__URL", "redis://127.0.0.1:6379/0")
    heads = AdapterRegistry(redis_client, tmp_path / "state" / "heads", StoreConfig(key_prefix=key_prefix), kind="head")
    r = CliRunner().invoke(app, ["heads", "list"])
    assert r.exit_code == 0 and "no heads registered" in r.stdout
    for seed in (1, 2):
        d = tmp_path / f"h{seed}"
        d.mkdir()
        save_file({"fc.weight": np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)}, str(d / HEAD_FILE))
        heads.promote(heads.register(d, AdapterMeta(alpha_before=0.1 * seed, alpha_after=0.2 * seed)), f"head {seed}")
    # what the serving loop flushed for the requests head v2 proposed for: 2 requests, per-request α 0.5 and 0.25
    from store import AcceptanceHistory

    AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix), kind="head").record(
        "prose@greedy", 2, {"requests": 2, "num_draft_tokens": 8, "num_accepted_tokens": 3, "alpha_sum": 0.75,
                            "alpha_count": 2})
    run = CliRunner()
    rows = json.loads(run.invoke(app, ["heads", "list", "--json"]).stdout)
    assert [(r["version"], r["active"], r["alpha_after"]) for r in rows] == [(1, False, 0.2), (2, True, 0.4)]
    assert rows[0]["live"] == {"requests": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "alpha": None}
    assert rows[1]["live"] == {"requests": 2, "num_draft_tokens": 8, "num_accepted_tokens": 3, "alpha": 0.375}
    table = run.invoke(app, ["heads", "list"], terminal_width=250).stdout
    assert "live alpha, mean per request (requests)" in table and "0.375 (2)" in table and "- (0)" in table
    # from another state dir the versions' files are not there: refused, nothing changes (they
    # used to be skipped as bad, rolling every head back)
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "elsewhere"))
    r = run.invoke(app, ["heads", "rollback"])
    assert r.exit_code == 1 and "Nothing was rolled back" in " ".join(r.output.split())
    assert heads.active_version() == 2 and heads.get(1).state == "promoted"
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    r = run.invoke(app, ["heads", "rollback", "--reason", "regressed"])
    assert r.exit_code == 0 and "shared: head v1 active" in r.stdout
    assert heads.active_version() == 1 and heads.get(2).state == "rolled_back" and heads.get(2).reason == "regressed"
    assert run.invoke(app, ["heads", "rollback"]).exit_code == 0 and heads.active_version() == 0
    r = run.invoke(app, ["heads", "rollback"])
    assert r.exit_code == 1 and "no head is active" in r.output and "Traceback" not in r.output
    r = run.invoke(app, ["heads", "rollback", "--workload", "two words"])
    assert r.exit_code == 1 and "not a usable workload tag" in " ".join(r.output.split())
