"""The Daemon object in-process (no API, no models): structured log events and the trainer-less paths."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from conftest import REDIS_URL
from daemon.app import Daemon, TrainerDisabledError
from daemon.settings import load_settings
from helpers import make_adapter_dir
from store.registry import AdapterMeta


def test_promote_and_rollback_log_snake_case_events_with_context(tmp_path, key_prefix, monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)
    s = load_settings(state_dir=tmp_path / "state", redis={"url": REDIS_URL}, store={"key_prefix": key_prefix},
                      models={"enabled": False}, api={"enabled": False})
    d = Daemon(s)
    with capture_logs() as logs, d.started():
        v = d.registry.register(make_adapter_dir(tmp_path / "a"), AdapterMeta(parent=0))
        assert d.promote(v, "why not") == {"active": v, "previous": 0, "reason": "why not", "workload": ""}
        assert d.rollback("undo") == {"active": 0, "previous": v, "reason": "undo", "workload": "", "skipped": {}}
        with pytest.raises(TrainerDisabledError, match="models.enabled=false"):
            d.train_now()
        st = d.status()
        assert st["adapter"]["active"] == 0 and st["adapter"]["previous"] == v and st["adapter"]["reason"] == "undo"
    ev = {e["event"]: e for e in logs}
    assert ev["adapter_promoted"]["version"] == v and ev["adapter_promoted"]["previous"] == 0
    assert ev["adapter_rolled_back"]["version"] == 0 and ev["adapter_rolled_back"]["previous"] == v
    assert ev["redis_selected"]["mode"] == "url" and "daemon_started" in ev and "daemon_stopped" in ev
    assert all(e["event"] == e["event"].lower() and " " not in e["event"] for e in logs if e.get("log_level") != "debug"
               and not e["event"].startswith(("Started", "Finished", "Shutting", "Uvicorn", "Waiting")))
