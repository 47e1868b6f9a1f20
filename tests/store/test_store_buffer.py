"""The verified-sample buffer on a real Redis: writer, consumer group, crash recovery,
dead-letter, dedupe, and Redis killed mid-stream."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path


from store.buffer import (
    SampleReader,
    SampleWriter,
    dead_letter_count,
    group_info,
    list_dead_letters,
    stream_depth,
)
from store.config import BufferConfig, StoreConfig
from store.schema import F_BODY, F_FINGERPRINT, F_VERSION, PairFingerprint, encode
from store_helpers import PAIR, SHARED_URL

REPO = Path(__file__).resolve().parents[2]


def write_all(client, cfg, samples) -> None:
    with SampleWriter(client, cfg) as w:
        for s in samples:
            assert w.submit(s) is True
        assert w.flush(10)
        st = w.stats()
    assert st.written == len(samples) and st.dropped == 0


def test_writer_round_trip_through_reader(client, cfg, sample_factory):
    samples = [sample_factory(seed=i, n_tokens=16, workload=["chat", "code", "数学"][i % 3]) for i in range(25)]
    write_all(client, cfg, samples)
    assert stream_depth(client, cfg) == 25
    r = SampleReader(client, cfg, "trainer", "c1", expected_fingerprint=PAIR)
    got = r.read(count=100)
    assert [e.sample for e in got] == samples  # order kept, bit-exact
    assert r.ack(got) == 25
    assert r.read(count=100) == []


def test_writer_rejects_non_samples_and_closed(client, cfg, sample_factory):
    w = SampleWriter(client, cfg)
    assert w.submit("not a sample") is False  # type: ignore[arg-type]
    w.close()
    assert w.submit(sample_factory(n_tokens=4)) is False
    st = w.stats()
    assert (st.submitted, st.rejected, st.written) == (2, 2, 0)


def test_group_creation_is_idempotent(client, cfg):
    r1 = SampleReader(client, cfg, "g", "a")
    assert r1.ensure_group() is False  # BUSYGROUP ignored
    SampleReader(client, cfg, "g", "b")
    assert [g.name for g in group_info(client, cfg)] == ["g"]


def test_own_pending_entries_come_first_then_new(client, cfg, sample_factory):
    samples = [sample_factory(seed=i, n_tokens=8) for i in range(5)]
    write_all(client, cfg, samples)
    first = SampleReader(client, cfg, "g", "c1").read(count=3)
    assert len(first) == 3
    info = group_info(client, cfg)[0]
    assert (info.pending, info.lag) == (3, 2)
    # same consumer name restarts (new object, empty memory): gets its 3 pending entries again
    again = SampleReader(client, cfg, "g", "c1")
    got = again.read(count=10)
    assert [e.entry_id for e in got] == [e.entry_id for e in first]
    rest = again.read(count=10)
    assert [e.sample.record_id for e in rest] == [s.record_id for s in samples[3:]]
    assert again.ack(got + rest) == 5
    assert group_info(client, cfg)[0].pending == 0


CRASHING_CONSUMER = textwrap.dedent(
    """
    import os, sys
    from store.client import connect
    from store.config import StoreConfig
    from store.buffer import SampleReader
    r = SampleReader(connect(sys.argv[1]), StoreConfig(key_prefix=sys.argv[2]), "trainer", "doomed")
    got = r.read(count=10)
    print(len(got), flush=True)
    os._exit(1)  # dies without XACK
    """
)


def test_crashed_consumer_entries_are_reclaimed_nothing_lost(client, cfg, prefix, sample_factory):
    samples = [sample_factory(seed=i, n_tokens=16) for i in range(10)]
    write_all(client, cfg, samples)
    SampleReader(client, cfg, "trainer", "survivor")  # group exists before the crash
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_CONSUMER, SHARED_URL, prefix],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout.strip() == "10", proc.stderr
    pend = client.xpending(cfg.keys.stream, "trainer")
    assert pend["pending"] == 10 and {c["name"] for c in pend["consumers"]} == {b"doomed"}

    survivor = SampleReader(client, cfg, "trainer", "survivor")
    assert survivor.read(count=10) == []  # nothing new: all 10 are held by the dead consumer
    time.sleep(0.06)
    got = survivor.reclaim(min_idle_ms=50)
    assert sorted(e.sample.record_id for e in got) == sorted(s.record_id for s in samples)
    assert {e.sample.record_id: e.sample for e in got} == {s.record_id: s for s in samples}
    assert survivor.ack(got) == 10
    assert client.xpending(cfg.keys.stream, "trainer")["pending"] == 0
    assert survivor.stats.reclaimed == 10


def test_reclaim_respects_min_idle(client, cfg, sample_factory):
    write_all(client, cfg, [sample_factory(seed=i, n_tokens=4) for i in range(3)])
    SampleReader(client, cfg, "g", "a").read(count=3)
    b = SampleReader(client, cfg, "g", "b")
    assert b.reclaim(min_idle_ms=60_000) == []
    assert client.xpending(cfg.keys.stream, "g")["consumers"][0]["name"] == b"a"


def test_malformed_entries_go_to_dead_letter_with_reasons(client, cfg, sample_factory):
    key = cfg.keys.stream
    good = sample_factory(seed=1, n_tokens=8)
    ids = {}
    ids["good"] = client.xadd(key, encode(good))
    f = encode(sample_factory(seed=2, n_tokens=8))
    f[F_VERSION] = b"99"
    ids["version"] = client.xadd(key, f)
    f = encode(sample_factory(seed=3, n_tokens=8))
    f[F_BODY] = b"\xc1not msgpack"
    ids["body"] = client.xadd(key, f)
    other = PairFingerprint("other-target", "other-draft", "tok-zzz")
    ids["pair"] = client.xadd(key, encode(sample_factory(seed=4, n_tokens=8, pair=other)))
    f = encode(sample_factory(seed=5, n_tokens=8, pair=other))
    f[F_FINGERPRINT] = PAIR.key().encode()  # clear field says our pair, body says another
    ids["tampered"] = client.xadd(key, f)
    originals = {eid: flds for eid, flds in client.xrange(key)}

    r = SampleReader(client, cfg, "trainer", "c1", expected_fingerprint=PAIR)
    got = r.read(count=100)
    assert [e.sample for e in got] == [good]
    assert r.stats.dead_lettered == 4
    assert dead_letter_count(client, cfg) == 4
    dl = {d.source_id: d for d in list_dead_letters(client, cfg)}
    assert set(dl) == {ids["version"], ids["body"], ids["pair"], ids["tampered"]}
    assert "unknown schema version 99" in dl[ids["version"]].reason
    assert "body is not decodable" in dl[ids["body"]].reason
    assert "model-pair fingerprint mismatch" in dl[ids["pair"]].reason
    assert other.key() in dl[ids["pair"]].reason and PAIR.key() in dl[ids["pair"]].reason
    assert "does not match the body's pair" in dl[ids["tampered"]].reason
    for sid, d in dl.items():
        assert d.fields == originals[sid]  # original fields kept byte for byte
        assert (d.group, d.consumer, d.source_stream) == ("trainer", "c1", key)
    # dead-lettered entries are acked on the main stream; only the good one is pending
    pend = client.xpending_range(key, "trainer", "-", "+", 100)
    assert [p["message_id"] for p in pend] == [ids["good"]]


def test_reader_without_expected_pair_accepts_any_pair(client, cfg, sample_factory):
    other = PairFingerprint("x", "y", "z")
    client.xadd(cfg.keys.stream, encode(sample_factory(n_tokens=4, pair=other)))
    assert len(SampleReader(client, cfg, "g", "c").read()) == 1


def test_duplicate_record_ids_are_skipped_and_acked(client, cfg, sample_factory):
    key = cfg.keys.stream
    s = sample_factory(seed=9, n_tokens=8)
    client.xadd(key, encode(s))
    client.xadd(key, encode(s))  # e.g. a retried pipeline that had partly succeeded
    r = SampleReader(client, cfg, "g", "c1")
    got = r.read(count=10)
    assert len(got) == 1 and r.stats.duplicates == 1
    assert r.ack(got) == 1
    client.xadd(key, encode(s))  # arrives again after it was processed
    assert r.read(count=10) == [] and r.stats.duplicates == 2
    assert client.xpending(key, "g")["pending"] == 0
    # another reader (new process) knows it was processed too, through Redis
    client.xadd(key, encode(s))
    r2 = SampleReader(client, cfg, "g", "c2")
    assert r2.read(count=10) == [] and r2.stats.duplicates == 1


def test_trimmed_pending_entries_are_counted_not_fatal(client, cfg, sample_factory):
    key = cfg.keys.stream
    for i in range(3):
        client.xadd(key, encode(sample_factory(seed=i, n_tokens=4)))
    a = SampleReader(client, cfg, "g", "a")
    held = a.read(count=3)
    client.xtrim(key, maxlen=0, approximate=False)  # the cap deletes entries still pending
    a2 = SampleReader(client, cfg, "g", "a")  # restart: its pending list points at nothing
    assert a2.read(count=10) == []
    assert a2.stats.trimmed == 3 and len(held) == 3
    assert client.xpending(key, "g")["pending"] == 0


def test_writer_caps_stream_length(client, prefix, sample_factory):
    cfg = StoreConfig(key_prefix=prefix, buffer=BufferConfig(maxlen=100, batch_size=50))
    s = sample_factory(n_tokens=2)
    with SampleWriter(client, cfg) as w:
        for _ in range(1000):
            w.submit(s)
        assert w.flush(10)
    # approximate MAXLEN trims whole radix-tree nodes (100 entries by default): <= 100 + one node
    assert 100 <= stream_depth(client, cfg) <= 200


def test_writer_caps_stream_bytes_for_records_with_hidden_states(client, prefix, sample_factory):
    """Records that carry hidden states are 7x larger; the byte cap keeps the stream's memory
    where the count cap alone would let it grow 7x."""
    s_plain = sample_factory(n_tokens=32, prompt_len=16)
    s_hid = sample_factory(n_tokens=32, prompt_len=16, hidden_size=576)
    b_plain = sum(len(k) + len(v) for k, v in encode(s_plain).items())
    b_hid = sum(len(k) + len(v) for k, v in encode(s_hid).items())
    assert b_hid > 5 * b_plain  # 32 x 576 x 2 bytes of hidden states beside 32 x 196 of top-k
    max_bytes = 200 * b_plain
    for s, n_bytes in ((s_plain, b_plain), (s_hid, b_hid)):
        cfg = StoreConfig(key_prefix=f"{prefix}{n_bytes}:",
                          buffer=BufferConfig(maxlen=100_000, max_bytes=max_bytes, batch_size=50))
        with SampleWriter(client, cfg) as w:
            for _ in range(600):
                w.submit(s)
            assert w.flush(20)
            cap = w.maxlen()
        assert abs(cap - max_bytes // n_bytes) <= 1  # every entry the same size: the mean is it
        depth = stream_depth(client, cfg)
        # approximate MAXLEN trims whole nodes: at most one node (100 entries) beyond the cap
        assert cap <= depth <= cap + 100, (depth, cap)
        if s is s_hid:
            assert depth * n_bytes <= 2 * max_bytes
            assert depth < 600


def test_redis_killed_mid_stream_writer_keeps_accepting_and_resumes(private_redis, tmp_path, sample_factory):
    prefix = "test:store:kill:"
    cfg = StoreConfig(
        key_prefix=prefix,
        buffer=BufferConfig(queue_size=50, batch_size=8, flush_interval_s=0.02, backoff_initial_s=0.02, backoff_max_s=0.2),
    )
    client = private_redis.client()
    samples = [sample_factory(seed=i, n_tokens=8) for i in range(200)]
    w = SampleWriter(client, cfg)
    for s in samples[:20]:
        assert w.submit(s)
    assert w.flush(10) and w.stats().written == 20

    private_redis.kill()
    worst = 0.0
    for s in samples[20:40]:  # the writer finds out on its next batch
        t = time.perf_counter()
        assert w.submit(s) is True
        worst = max(worst, time.perf_counter() - t)
    deadline = time.time() + 10
    while w.stats().redis_up and time.time() < deadline:
        time.sleep(0.01)
    assert not w.stats().redis_up
    for s in samples[40:]:
        t = time.perf_counter()
        assert w.submit(s) is True  # keeps accepting, no exception
        worst = max(worst, time.perf_counter() - t)
    assert worst < 0.05  # submit never waits on Redis (it is a deque append)
    assert w.flush(0.3) is False  # cannot drain while Redis is down
    st = w.stats()
    assert st.errors >= 1 and st.queued == 50
    # the outage as `daemonctl status` reports it (daemon.reports.buffer_warnings)
    assert st.outages == 1 and st.down_since is not None and st.last_outage is None
    assert st.last_error is not None and st.down_since <= st.last_error_at <= time.time()
    went = st.down_since
    # 180 submitted while down; at most queue (50) + one batch in hand (8) survive
    assert st.dropped_redis_down >= 180 - 50 - 8
    assert st.submitted == st.written + st.dropped + st.queued + st.in_flight

    private_redis.start()  # same port, AOF kept the first 20
    assert w.flush(15), w.stats()
    st = w.close()
    assert st.redis_up and st.dropped_on_close == 0
    assert st.outages == 1 and st.down_since is None and st.last_outage[0] == went < st.last_outage[1] <= time.time()
    assert st.submitted == 200 == st.written + st.dropped
    assert st.written == 20 + 200 - 20 - st.dropped_redis_down - st.dropped_queue_full
    c2 = private_redis.client()
    ids = [f[b"rid"].decode() for _, f in c2.xrange(cfg.keys.stream)]
    assert len(ids) == st.written  # nothing written twice, nothing lost beyond the count
    assert ids[:20] == [s.record_id for s in samples[:20]]
    assert ids[-1] == samples[-1].record_id  # drop-oldest keeps the freshest
    assert len(set(ids)) == len(ids)


def test_writer_queue_is_bounded_in_bytes_while_redis_is_down(sample_factory):
    """Redis unreachable: records with hidden states pile up in the queue; queue_max_bytes keeps
    the newest that fit and counts the rest as dropped while Redis is down."""
    import redis

    s = sample_factory(n_tokens=32, prompt_len=16, hidden_size=576)
    one = s.nbytes
    assert one > 32 * 576 * 2
    cfg = StoreConfig(key_prefix="test:store:down:", buffer=BufferConfig(queue_max_bytes=10 * one, backoff_initial_s=0.05,
                                                                         backoff_max_s=0.1))
    w = SampleWriter(redis.Redis(port=1, socket_connect_timeout=0.1), cfg)
    try:
        for _ in range(50):
            assert w.submit(s)
        time.sleep(0.3)
        st = w.stats()
        assert st.queued <= 10 and st.in_flight <= 10  # the batch in hand came from a queue that small
        assert st.dropped_redis_down + st.dropped_queue_full == 50 - st.queued - st.in_flight >= 30
    finally:
        w.close(timeout=0.5)


def _consumers(client, cfg, group: str) -> dict[str, int]:
    return {c["name"].decode(): int(c["pending"]) for c in client.xinfo_consumers(cfg.keys.stream, group)}


def test_a_dead_consumer_is_counted_reclaimed_and_removed(client, cfg, sample_factory):
    """Issue 37 item 8: a dead consumer's pending entries count as backlog (the trigger pulls the
    round forward), are reclaimed, and the dead consumer leaves the group; one that still holds
    entries, or was active recently, stays."""
    from store.buffer import reclaimable_count
    from trainer.service import group_lag

    write_all(client, cfg, [sample_factory(seed=i, n_tokens=4) for i in range(10)])
    assert len(SampleReader(client, cfg, "g", "dead").read(count=6)) == 6  # then the process died
    assert group_lag(client, cfg, "g") == 4  # undelivered only: the 6 held by the dead consumer are missed
    time.sleep(0.06)
    assert reclaimable_count(client, cfg, "g", 50) == 6
    assert reclaimable_count(client, cfg, "g", 60_000) == 0  # not idle long enough
    assert group_lag(client, cfg, "g", reclaim_min_idle_ms=50, consumer="new") == 10
    new = SampleReader(client, cfg, "g", "new")
    got = new.reclaim(min_idle_ms=50)
    assert len(got) == 6 and "dead" not in _consumers(client, cfg, "g")
    assert new.stats.consumers_removed == 1
    assert reclaimable_count(client, cfg, "g", 0, exclude_consumer="new") == 0  # its own are not "reclaimable"
    assert group_lag(client, cfg, "g", reclaim_min_idle_ms=0, consumer="new") == 4
    new.ack(got)
    busy = SampleReader(client, cfg, "g", "busy")
    assert len(busy.read(count=2)) == 2  # holds entries: never removed
    client.xgroup_createconsumer(cfg.keys.stream, "g", "idle")  # registered, holds nothing
    new.prune_consumers(60_000)
    assert {"new", "busy", "idle"} <= set(_consumers(client, cfg, "g"))
    time.sleep(0.06)
    assert new.prune_consumers(50) == ["idle"]
    assert set(_consumers(client, cfg, "g")) == {"new", "busy"}


def _stream_bytes(client, cfg) -> int:
    return sum(sum(len(k) + len(v) for k, v in f.items()) for _, f in client.xrange(cfg.keys.stream))


def test_the_byte_cap_holds_when_record_sizes_shift(client, prefix, sample_factory):
    """Issue 37 item 7: large records, then small ones. A MAXLEN from the mean entry size let the
    stream reach 2.29x the cap (the mean follows the small new records while the large old ones are
    still in the stream); the cap now counts the newest entries that fit, whatever their sizes."""
    big = sample_factory(n_tokens=32, prompt_len=16, hidden_size=576)
    small = sample_factory(n_tokens=8, prompt_len=8, k=8)
    b_big = sum(len(k) + len(v) for k, v in encode(big).items())
    b_small = sum(len(k) + len(v) for k, v in encode(small).items())
    assert b_big > 20 * b_small
    max_bytes = 40 * b_big
    cfg = StoreConfig(key_prefix=f"{prefix}shift:", buffer=BufferConfig(maxlen=100_000, max_bytes=max_bytes, batch_size=20))
    peak = 0.0
    with SampleWriter(client, cfg) as w:
        for s, n in ((big, 120), (small, 1500), (big, 60)):
            for i in range(0, n, 20):
                for _ in range(20):
                    w.submit(s)
                assert w.flush(20)
                peak = max(peak, _stream_bytes(client, cfg) / max_bytes)
    # approximate MAXLEN trims whole macro-nodes (<= 100 entries, <= 4 KB unless one entry is larger)
    slack = (100 * b_small + 2 * b_big) / max_bytes
    print(f"peak {peak:.3f}x the cap")
    assert peak <= 1.0 + slack, (peak, slack)
