"""The store on a real Redis Cluster (3 masters, 1 replica each, started by the ``redis_cluster``
fixture): hash-tagged keys keep every script and MULTI in one slot; the buffer, registry,
history and heartbeats behave as on one node; a master's failover loses no acknowledged record."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from redis.cluster import key_slot

from store.buffer import SampleReader, SampleWriter, dead_letter_count, list_dead_letters, stream_depth
from store.client import StoreUnavailableError, connect, parse_cluster_url
from store.config import BufferConfig, StoreConfig, resolve_config
from store.heartbeat import read_heartbeats, write_heartbeat
from store.history import AcceptanceHistory
from store.registry import AdapterMeta, AdapterRegistry
from store.schema import encode
from store_helpers import PAIR, make_sample
from test_store_registry import next_event, peft_dir


@pytest.fixture
def ccfg() -> StoreConfig:
    return StoreConfig(key_prefix=f"test:cluster:{uuid.uuid4().hex[:8]}:", hash_tags=True,
                       buffer=BufferConfig(flush_interval_s=0.01, backoff_initial_s=0.05, backoff_max_s=0.5))


@pytest.fixture
def cclient(redis_cluster):
    c = connect(redis_cluster.url, socket_timeout=2.0, socket_connect_timeout=1.0)
    yield c
    c.close()


# -- key layout (no cluster needed) ------------------------------------------------------------------


def test_every_key_group_a_script_or_multi_touches_shares_one_slot():
    k = StoreConfig(key_prefix="draftd:", hash_tags=True).keys
    buffer = [k.stream, k.dead_letter, k.processed("trainer")]
    assert k.stream == "draftd:{samples}" and k.dead_letter == "draftd:{samples}:dead"
    registry = [k.adapter_counter, k.adapter_versions, k.adapter(7), k.adapter_blob(7), k.active, k.active_stack,
                k.active_in("chat"), k.active_stack_in("chat"), k.adapter_scopes, k.promotions, k.adapter_root + "12"]
    hist = [k.history_index, k.history_bucket("chat", 3, 100).decode(), k.history_applied("w1")]
    import dataclasses
    h = dataclasses.replace(k, kind="head")
    head = [h.adapter(1), h.active, h.promotions, h.history_index, h.history_applied("w")]
    for group in (buffer, registry, hist, head[:3], head[3:]):
        assert len({key_slot(x.encode()) for x in group}) == 1, group
    # groups spread: the stream is not on the registry's slot
    assert key_slot(k.stream.encode()) != key_slot(k.active.encode())
    # another stream name, another slot
    k2 = StoreConfig(key_prefix="draftd:", hash_tags=True, buffer=BufferConfig(stream="samples-b")).keys
    assert key_slot(k2.stream.encode()) != key_slot(k.stream.encode())


def test_single_node_names_are_unchanged_by_default():
    k = StoreConfig(key_prefix="draftd:").keys
    assert (k.stream, k.dead_letter, k.processed("t")) == ("draftd:samples", "draftd:samples:dead", "draftd:samples:processed:t")
    assert (k.adapter(3), k.active, k.active_in("chat"), k.history_index) == (
        "draftd:adapter:v:3", "draftd:adapter:active", "draftd:adapter:active:w:chat", "draftd:hist:index")
    assert k.events_channel == "draftd:adapter:events"


def test_cluster_url_parsing_and_masking():
    nodes, opts = parse_cluster_url("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001/0")
    assert nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)] and opts == {"ssl": False, "password": "p@ss", "username": "u"}
    assert parse_cluster_url("rediss+cluster://h")[0] == [("h", 6379)]
    with pytest.raises(ValueError, match=r"\*\*\*.*only database 0") as e:
        parse_cluster_url("redis+cluster://:hunter2@h:1/3")
    assert "hunter2" not in str(e.value)
    from store.masking import mask_url

    assert mask_url("redis+cluster://u:hunter2@h1:7000,h2:7001/0") == "redis+cluster://u:***@h1:7000,h2:7001/0"
    assert mask_url("rediss+cluster://:hunter2@h1:7000") == "rediss+cluster://:***@h1:7000"


def test_an_unreachable_cluster_is_named_with_its_password_masked():
    with pytest.raises(StoreUnavailableError) as e:
        connect("redis+cluster://:hunter2@127.0.0.1:1", socket_connect_timeout=0.2, socket_timeout=0.2)
    assert "hunter2" not in str(e.value) and "***" in str(e.value) and e.value.__cause__ is None


# -- on the cluster -----------------------------------------------------------------------------------


def test_untagged_keys_on_a_cluster_are_refused(cclient, ccfg):
    assert resolve_config(ccfg.model_copy(update={"hash_tags": None}), cclient).hash_tags is True
    with pytest.raises(ValueError, match="hash_tags"):
        AdapterRegistry(cclient, "/tmp/x", ccfg.model_copy(update={"hash_tags": False}))


def test_buffer_write_read_ack_dead_letter(cclient, ccfg):
    samples = [make_sample(n_tokens=8, seed=i) for i in range(20)]
    with SampleWriter(cclient, ccfg) as w:
        for s in samples:
            assert w.submit(s)
        assert w.flush(10)
    assert w.stats().written == 20
    bad = encode(make_sample(n_tokens=4, seed=99))
    bad[b"v"] = b"999"  # an unknown schema version: dead-lettered
    cclient.xadd(ccfg.keys.stream, bad)
    r = SampleReader(cclient, ccfg, "trainer", "t1", expected_fingerprint=PAIR)
    got = []
    while batch := r.read(count=8):
        got += batch
    assert sorted(e.sample.record_id for e in got) == sorted(s.record_id for s in samples)
    assert r.ack(got) == 20
    assert dead_letter_count(cclient, ccfg) == 1 and r.stats.dead_lettered == 1
    assert list_dead_letters(cclient, ccfg)[0].source_stream == ccfg.keys.stream
    assert stream_depth(cclient, ccfg) == 21
    # a record written again after its ack is a duplicate (the processed set, same slot)
    with SampleWriter(cclient, ccfg) as w:
        w.submit(samples[0])
        w.flush(10)
    assert r.read(count=8) == [] and r.stats.duplicates == 1
    assert r.prune_consumers(0) == []
    # a dead consumer's entries are reclaimed
    late = make_sample(n_tokens=8, seed=50)
    with SampleWriter(cclient, ccfg) as w:
        w.submit(late)
        w.flush(10)
    dead = SampleReader(cclient, ccfg, "trainer", "t-dead")
    assert len(dead.read(count=8)) == 1
    assert [e.sample.record_id for e in r.reclaim(0)] == [late.record_id]
    assert "t-dead" not in [c["name"].decode() for c in cclient.xinfo_consumers(ccfg.keys.stream, "trainer")]


def test_registry_register_promote_rollback_events(cclient, ccfg, tmp_path):
    reg = AdapterRegistry(cclient, tmp_path / "art", ccfg)
    ps = reg.subscribe()
    v1 = reg.register(peft_dir(tmp_path / "a1", 1), AdapterMeta(samples_trained=5), store_bytes=True)
    v2 = reg.register(peft_dir(tmp_path / "a2", 2), AdapterMeta(scope="chat"))
    v3 = reg.register(peft_dir(tmp_path / "a3", 3), AdapterMeta())
    assert (v1, v2, v3) == (1, 2, 3)
    assert reg.promote(v1, "first") == 0
    assert next_event(ps)["version"] == v1
    assert reg.promote(v2, "chat's own") == 0
    assert reg.promote(v3, "better") == v1
    assert reg.active_versions() == {"": v3, "chat": v2} and reg.resolve("chat") == v2 and reg.resolve("code") == v3
    assert reg.rollback("worse") == v1
    ev = [next_event(ps) for _ in range(3)][-1]
    assert (ev["event"], ev["version"], ev["previous"]) == ("rollback", v1, v3)
    reg.set_state(v3, "rejected", "bad")
    assert [r.state for r in reg.list()] == ["promoted", "promoted", "rejected"]
    assert [e["event"] for e in reg.promotion_log()] == ["promote", "promote", "promote", "rollback", "set_state"]
    ps.close()
    # the bytes kept in Redis restore a missing local copy
    import shutil
    shutil.rmtree(tmp_path / "art" / "v1")
    assert reg.fetch(v1).is_dir()


def test_history_and_heartbeats(cclient, ccfg):
    hist = AcceptanceHistory(cclient, ccfg, clock=lambda: 100_000.0)
    assert hist.record("chat", 1, {"num_draft_tokens": 8, "num_accepted_tokens": 6, "requests": 1}, seq=1)
    assert not hist.record("chat", 1, {"num_draft_tokens": 8, "num_accepted_tokens": 6, "requests": 1}, seq=1)
    hist.record("code", 1, {"num_draft_tokens": 4, "num_accepted_tokens": 1, "requests": 1})
    t = hist.totals(version=1)
    assert (t.num_draft_tokens, t.num_accepted_tokens, t.requests) == (12, 7, 2)
    for sid in ("replica-a", "replica-b", "replica-c"):  # keys on several slots: SCAN visits every master
        write_heartbeat(cclient, ccfg, sid, {"server_id": sid, "requests_served": 1}, ttl_s=30)
    assert [h["server_id"] for h in read_heartbeats(cclient, ccfg)] == ["replica-a", "replica-b", "replica-c"]


def test_lease_and_fencing_on_the_cluster(cclient, ccfg, tmp_path):
    from store.errors import FencedError
    from store.lease import Lease, lease_keys

    assert len({key_slot(x.encode()) for x in lease_keys(ccfg, "trainer")}) == 1
    a, b = Lease(cclient, ccfg, "a", ttl_s=0.3), Lease(cclient, ccfg, "b", ttl_s=0.3)
    ta = a.try_acquire()
    assert ta and b.try_acquire() == 0
    time.sleep(0.45)
    tb = b.try_acquire()
    assert tb > ta and not a.renew()
    reg_a, reg_b = AdapterRegistry(cclient, tmp_path / "art", ccfg), AdapterRegistry(cclient, tmp_path / "art", ccfg)
    reg_a.fencing_token, reg_b.fencing_token = ta, tb
    reg_b.fence(tb)
    with pytest.raises(FencedError):
        reg_a.register(peft_dir(tmp_path / "x", 1), AdapterMeta())
    assert reg_b.register(peft_dir(tmp_path / "y", 2), AdapterMeta()) >= 1


def test_three_serving_replicas_write_one_buffer_follow_one_registry_and_report_apart(cclient, ccfg, tmp_path,
                                                                                   redis_cluster):
    """Issue 36 item 2 at the store's level: three replicas, each with its own client, writer,
    history writer, heartbeat and registry subscription, on the cluster."""
    replicas = []
    for i in range(3):
        c = connect(redis_cluster.url, socket_timeout=2.0, socket_connect_timeout=1.0)
        reg = AdapterRegistry(c, tmp_path / f"art{i}", ccfg)
        replicas.append({"id": f"replica-{i}", "client": c, "writer": SampleWriter(c, ccfg),
                         "hist": AcceptanceHistory(c, ccfg, clock=lambda: 200_000.0), "reg": reg, "ps": reg.subscribe()})
    sent = []
    for i, rp in enumerate(replicas):
        for j in range(30):
            s = make_sample(n_tokens=4, seed=10_000 + 100 * i + j, workload=("chat", "code")[j % 2])
            sent.append(s.record_id)
            rp["writer"].submit(s)
            rp["hist"].record(s.workload, 0, {"num_draft_tokens": 4, "num_accepted_tokens": 2, "requests": 1})
        write_heartbeat(rp["client"], ccfg, rp["id"], {"server_id": rp["id"], "requests_served": 30}, ttl_s=30)
    for rp in replicas:
        assert rp["writer"].close().written == 30
    trainer = AdapterRegistry(cclient, tmp_path / "trainer-art", ccfg)
    v = trainer.register(peft_dir(tmp_path / "t1", 1), AdapterMeta(), store_bytes=True)
    trainer.promote(v, "for every replica")
    for rp in replicas:  # each follows the promotion: the event, the pointer, the bytes
        assert next_event(rp["ps"])["version"] == v and rp["reg"].active_version() == v
        assert rp["reg"].fetch(v).is_dir()
        rp["ps"].close()
    r = SampleReader(cclient, ccfg, "trainer", "t1")
    got = []
    while batch := r.read(count=50):
        got += [e.sample.record_id for e in batch]
    assert sorted(got) == sorted(sent) and len(set(got)) == 90  # 0 lost, 0 duplicated
    t = replicas[0]["hist"].totals(version=0)
    assert (t.requests, t.num_draft_tokens, t.num_accepted_tokens) == (90, 360, 180)  # every replica, once
    assert [h["server_id"] for h in read_heartbeats(cclient, ccfg)] == ["replica-0", "replica-1", "replica-2"]
    for rp in replicas:
        rp["client"].close()


def test_a_master_failover_loses_no_acknowledged_record(redis_cluster, ccfg, tmp_path):
    """(About 8 s: the failover takes 4.) Kill the master holding the stream (and the registry) after its replica caught up; the
    replica is promoted, the writer retries through the failover, the registry keeps its active
    version; every record the writer counted as written is read once (by id)."""
    client = connect(redis_cluster.url, socket_timeout=1.0, socket_connect_timeout=0.5)
    # a prefix whose events channel lives on the registry's master, so the second failover also
    # kills the node a follower's subscription is on
    reg_slot_master = redis_cluster.master_of_slot(key_slot(ccfg.keys.active.encode()))
    while redis_cluster.master_of_slot(key_slot(ccfg.keys.events_channel.encode())) != reg_slot_master:
        ccfg = ccfg.model_copy(update={"key_prefix": f"test:cluster:{uuid.uuid4().hex[:8]}:"})
    k = ccfg.keys
    reg = AdapterRegistry(client, tmp_path / "art", ccfg)
    v = reg.register(peft_dir(tmp_path / "a1", 1), AdapterMeta())
    reg.promote(v, "before the failover")
    w = SampleWriter(client, ccfg)
    first = [make_sample(n_tokens=4, seed=i) for i in range(50)]
    for s in first:
        w.submit(s)
    assert w.flush(10)
    bad = encode(make_sample(n_tokens=4, seed=7777))
    bad[b"v"] = b"999"
    client.xadd(k.stream, bad)
    pre = SampleReader(client, ccfg, "audit", "a1")  # another group: dead-letters the bad entry
    while pre.read(count=100):
        pass
    hist = AcceptanceHistory(client, ccfg, clock=lambda: 300_000.0)
    hist.record("chat", v, {"num_draft_tokens": 8, "num_accepted_tokens": 5, "requests": 1})
    victim = redis_cluster.master_of_slot(key_slot(k.stream.encode()))
    # async replication: wait until the victim's replica holds what the victim acknowledged
    assert redis_cluster.node(victim).execute_command("WAIT", 1, 5000) >= 1
    reg_master = redis_cluster.master_of_slot(key_slot(k.active.encode()))
    for other in {reg_master, redis_cluster.master_of_slot(key_slot(k.history_index.encode()))} - {victim}:
        redis_cluster.node(other).execute_command("WAIT", 1, 5000)
    t0 = time.time()
    redis_cluster.kill(victim)
    second = [make_sample(n_tokens=4, seed=1000 + i) for i in range(50)]
    for s in second:  # submitted during the failover: the writer holds and retries them
        w.submit(s)
        time.sleep(0.01)
    assert w.flush(30), w.stats()
    took = time.time() - t0
    st = w.close()
    assert st.written == 100 and st.dropped == 0, st
    assert redis_cluster.master_of_slot(key_slot(k.stream.encode())) != victim
    r = SampleReader(client, ccfg, "trainer", "t1")
    ids = []
    while batch := r.read(count=64):
        ids += [e.sample.record_id for e in batch]
    assert sorted(ids) == sorted(s.record_id for s in first + second)  # none lost, none twice
    assert reg.active_version() == v and reg.get(v).state == "promoted"
    # the dead letter written before the failover survived it; "trainer" dead-lettered the same entry again
    assert dead_letter_count(client, ccfg) == 2 and r.stats.dead_lettered == 1
    assert [d.group for d in list_dead_letters(client, ccfg)] == ["audit", "trainer"]
    assert hist.totals(version=v).requests == 1
    # a second failover, of the registry's master: its pointer, stack and log survive, and its
    # scripts run on the promoted replica (redis-py reloads one it lacks: NOSCRIPT)
    reg_master = redis_cluster.master_of_slot(key_slot(k.active.encode()))
    follower = AdapterRegistry(connect(redis_cluster.url, socket_timeout=1.0, socket_connect_timeout=0.5),
                               tmp_path / "follower", ccfg)
    ps = follower.subscribe()
    assert redis_cluster.node(reg_master).execute_command("WAIT", 1, 5000) >= 1
    redis_cluster.kill(reg_master)
    with pytest.raises(redis.ConnectionError):  # the subscription's node is gone
        for _ in range(20):
            ps.get_message(timeout=0.1)
    deadline = time.time() + 30
    src2 = peft_dir(tmp_path / "a2", 2)
    while True:
        try:
            v2 = reg.register(src2, AdapterMeta())
            break
        except StoreUnavailableError:
            assert time.time() < deadline, "the registry's slot did not come back"
            time.sleep(0.2)
    assert reg.active_version() == v and [e["event"] for e in reg.promotion_log()] == ["promote"]
    ps = follower.subscribe()  # what the serve replicas' watcher does on an error: a new subscription
    assert reg.promote(v2, "after the failover") == v and reg.rollback("and back") == v
    assert [next_event(ps)["version"] for _ in range(2)] == [v2, v]  # the follower hears both
    ps.close()
    assert hist.record("chat", v, {"requests": 1}) and hist.totals(version=v).requests == 2
    print(f"failover: writes resumed {took:.1f} s after the master was killed")
    client.close()
