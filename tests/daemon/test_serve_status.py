"""`daemonctl status` lists the serving decoders (their heartbeats in Redis); `history` and
`adapters list` read Redis directly when no daemon answers."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openai")

from conftest import REDIS_URL, base_env, ctl, free_port  # noqa: E402
from helpers import make_adapter_dir  # noqa: E402
from serve_helpers import MODEL, serving  # noqa: E402


def test_status_lists_serving_decoders_and_history_adapters_read_redis_without_a_daemon(redis_client, key_prefix, tmp_path):
    from store.config import StoreConfig
    from store.registry import AdapterMeta, AdapterRegistry

    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix)
    registry = AdapterRegistry(redis_client, tmp_path / "state" / "adapters", StoreConfig(key_prefix=key_prefix))
    v1 = registry.register(make_adapter_dir(tmp_path / "a1"), AdapterMeta(parent=0))
    with serving(redis_client, key_prefix, heartbeat_s=0.2) as s:
        oc = s.openai()
        for w in ("prose", "code"):
            oc.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, extra_body={"workload": w})
        s.loop.tracker.flush()
        hb = None
        for _ in range(200):  # the next heartbeat carries the 2 requests
            r = ctl(env, "status", "--json")
            st = json.loads(r.stdout)
            hb = next((h for h in st.get("serving", []) if h["server_id"] == s.service.server_id), None)
            if hb and hb["requests_served"] == 2:
                break
        assert hb is not None and hb["requests_served"] == 2
        assert hb["adapter_version"] == 0 and hb["queue_depth"] == 0 and hb["model"] == MODEL
        assert set(hb["speculation_by_workload"]) == {"prose", "code"} and hb["last_seen_s"] >= 0
        # the controller's γ per batch size, per workload@bucket (issue 35 item 2)
        by_batch = hb["speculation_by_batch"]
        assert {k.split("@")[0] for k in by_batch} == {"prose", "code"} and all("1" in v for v in by_batch.values())
        text = ctl(env, "status").stdout
        assert "serving" in text and s.service.server_id in text and "γ by batch" in text
        h = ctl(env, "history", "--json")
        assert h.returncode == 0, h.stderr
        hist = json.loads(h.stdout)
        assert {r["workload"].split("@")[0] for r in hist["series"]} == {"prose", "code"}
        a = ctl(env, "adapters", "list", "--json")
        assert a.returncode == 0, a.stderr
        assert [row["version"] for row in json.loads(a.stdout)] == [v1]
        assert "read from Redis directly" in a.stderr
    st = json.loads(ctl(env, "status", "--json").stdout)
    assert all(h["server_id"] != s.service.server_id for h in st.get("serving", []))  # removed on close


def test_status_names_the_served_weight_format_and_why(redis_client, key_prefix, tmp_path):
    """models.format: serve's status carries the choice with its cost table; the heartbeat, and so
    `daemonctl status`, the format, file, setting and reason."""
    env = base_env(tmp_path / "state", free_port(), DRAFTD_REDIS__URL=REDIS_URL, DRAFTD_STORE__KEY_PREFIX=key_prefix)
    served = {"format": "F16", "file": "m-F16.gguf", "setting": "auto", "reason": "measured: F16 expects 0.1360 tokens/ms",
              "costs": [{"format": "F16", "ms": {"1": 13.0}}], "measurement": {"reps": 5}}
    with serving(redis_client, key_prefix, heartbeat_s=0.2, served_format=served) as s:
        assert s.service.status()["served_format"] == served
        hb = None
        for _ in range(200):
            st = json.loads(ctl(env, "status", "--json").stdout)
            hb = next((h for h in st.get("serving", []) if h["server_id"] == s.service.server_id), None)
            if hb:
                break
        assert hb is not None and hb["served_format"] == {k: served[k] for k in ("format", "file", "setting", "reason")}
        text = " ".join(ctl(env, "status").stdout.split())
        assert "served format" in text and "F16 (m-F16.gguf; models.format=auto): measured: F16 expects" in text
        assert "AMX" not in text  # no AMX path: nothing said
    # on llama.cpp's AMX path: the measured GGML_AMX_VNNI_MAX_ROWS and its source, in the heartbeat and the table
    amx = dict(served, amx_rows={"setting": "4,3", "source": "measured", "reason": "1 thread(s): ...", "ms": {}})
    with serving(redis_client, key_prefix, heartbeat_s=0.2, served_format=amx) as s:
        for _ in range(200):
            st = json.loads(ctl(env, "status", "--json").stdout)
            hb = next((h for h in st.get("serving", []) if h["server_id"] == s.service.server_id), None)
            if hb:
                break
        assert hb["served_format"]["amx_rows"] == {"setting": "4,3", "source": "measured"}
        text = " ".join(ctl(env, "status").stdout.split())
        assert "AMX per-row kernel up to GGML_AMX_VNNI_MAX_ROWS=4,3 rows (measured)" in text
