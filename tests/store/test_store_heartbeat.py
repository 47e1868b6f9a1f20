"""Heartbeats of N serving replicas: one per server id, listed together; a shared id is reported."""

from __future__ import annotations

from store.heartbeat import clear_heartbeat, read_heartbeats, write_heartbeat


def test_replicas_heartbeat_apart_and_a_shared_id_is_reported(client, cfg):
    for i in range(3):
        assert write_heartbeat(client, cfg, f"host-{i}", {"server_id": f"host-{i}"}, ttl_s=30, instance=f"inst-{i}")
    assert write_heartbeat(client, cfg, "host-0", {"server_id": "host-0"}, ttl_s=30, instance="inst-0")  # its own
    hbs = read_heartbeats(client, cfg)
    assert [(h["server_id"], h["instance"]) for h in hbs] == [("host-0", "inst-0"), ("host-1", "inst-1"), ("host-2", "inst-2")]
    assert not write_heartbeat(client, cfg, "host-1", {"server_id": "host-1"}, ttl_s=30, instance="intruder")
    clear_heartbeat(client, cfg, "host-2")
    assert [h["server_id"] for h in read_heartbeats(client, cfg)] == ["host-0", "host-1"]
