"""Issue 16 item 5: dead letters are bounded, workload tags are capped where they enter, and the
writer counts as dropped only what never reached Redis."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from redis.backoff import NoBackoff
from redis.retry import Retry

from decoder.workloads import load_jsonl
from store.buffer import SampleReader, SampleWriter, list_dead_letters
from store.client import connect
from store.config import BufferConfig, StoreConfig
from store.schema import F_BODY, MAX_WORKLOAD_LEN, encode
from store_helpers import PrivateRedis, make_sample


@pytest.fixture
def cfg(key_prefix):
    return StoreConfig(key_prefix=key_prefix)


def test_a_dead_letter_keeps_reason_id_and_a_bounded_excerpt(redis_client, cfg):
    f = encode(make_sample(seed=1, n_tokens=8))
    f[F_BODY] = b"\xc1" + b"x" * (8 << 20)  # an 8 MB body that does not decode
    sid = redis_client.xadd(cfg.keys.stream, f)
    r = SampleReader(redis_client, cfg, "trainer", "c1")
    assert r.read(count=10) == [] and r.stats.dead_lettered == 1
    (d,) = list_dead_letters(redis_client, cfg)
    assert d.source_id == sid and "body is not decodable" in d.reason
    assert d.fields[b"rid"] == f[b"rid"] and d.fields[b"w"] == b"chat"  # the small fields whole
    assert d.truncated and d.orig_bytes == sum(len(k) + len(v) for k, v in f.items())
    assert sum(len(v) for v in d.fields.values()) == cfg.buffer.dead_letter_excerpt_bytes
    raw = redis_client.xrange(cfg.keys.dead_letter)[0][1]
    assert sum(len(k) + len(v) for k, v in raw.items()) < 6000  # of 8 MB


def test_workload_tags_are_capped_where_they_enter(redis_client, cfg, tmp_path):
    long = "w" * (1 << 20)
    with SampleWriter(redis_client, cfg) as w:
        assert w.submit(make_sample(seed=2, n_tokens=4, workload=long))
        assert w.submit(make_sample(seed=3, n_tokens=4, workload=MAX_WORKLOAD_LEN * "c"))
        assert w.flush(5)
        st = w.stats()
    assert (st.written, st.dropped_error) == (1, 1)
    assert "workload tag" in st.last_error and f"({1 << 20} characters)" in st.last_error and len(st.last_error) < 600
    f = encode(make_sample(seed=4, n_tokens=4))
    f[b"w"] = long.encode()  # written by another client
    redis_client.xadd(cfg.keys.stream, f)
    got = SampleReader(redis_client, cfg, "trainer", "c1").read(count=10)
    assert [e.sample.workload for e in got] == [MAX_WORKLOAD_LEN * "c"]
    (d,) = list_dead_letters(redis_client, cfg)
    assert f"at most {MAX_WORKLOAD_LEN} characters" in d.reason
    p = tmp_path / "w.jsonl"
    p.write_text(json.dumps({"prompt": "hi", "workload": "a\nb"}) + "\n")
    with pytest.raises(ValueError, match=r"w.jsonl:1: workload tag 'a\\nb'"):
        load_jsonl(p)


class CuttingProxy:
    """TCP proxy to a Redis that, once ``cut`` is set, forwards the next request to Redis (so it
    runs) but never its reply, then closes the connection and stops accepting: a pipeline whose
    fate the client cannot know."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._up, args=(c, u), daemon=True).start()
            threading.Thread(target=self._down, args=(c, u), daemon=True).start()

    def _up(self, c: socket.socket, u: socket.socket) -> None:
        deadline = None
        c.settimeout(0.05)
        while deadline is None or time.monotonic() < deadline:
            try:
                data = c.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            u.sendall(data)
            if self.cut.is_set() and deadline is None:
                deadline = time.monotonic() + 0.3  # the rest of the pipeline, then cut
        self.listener.close()
        for s in (c, u):
            s.close()

    def _down(self, c: socket.socket, u: socket.socket) -> None:
        while True:
            try:
                data = u.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            if not self.cut.is_set():
                try:
                    c.sendall(data)
                except OSError:
                    return


def test_close_counts_a_sent_unanswered_batch_as_unconfirmed_not_dropped(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        admin = server.client()
        proxy = CuttingProxy(server.port)
        client = connect(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=1.0, socket_connect_timeout=0.5,
                         retry=Retry(NoBackoff(), 0))
        cfg = StoreConfig(key_prefix="faults:", buffer=BufferConfig(backoff_initial_s=0.05, backoff_max_s=0.1))
        w = SampleWriter(client, cfg)
        assert w.submit(make_sample(seed=0, n_tokens=4)) and w.flush(5)
        proxy.cut.set()
        for i in range(10):
            assert w.submit(make_sample(seed=1 + i, n_tokens=4))
        time.sleep(1.5)  # sent, no reply, connection closed; reconnects are refused
        st = w.close(timeout=0.5)
        present = {f[b"rid"] for _, f in admin.xrange(cfg.keys.stream)}
        missing = st.submitted - len(present)
        assert len(present) == 11 and missing == 0  # Redis ran the unanswered pipeline
        assert st.dropped == missing == 0, st
        assert st.unconfirmed_on_close == 10 and st.written == 1
        assert st.submitted == st.written + st.dropped + st.rejected + st.unconfirmed_on_close
    finally:
        server.kill()


def test_close_with_redis_down_from_the_start_counts_every_record_dropped(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    cfg = StoreConfig(key_prefix="faults:", buffer=BufferConfig(batch_size=64))
    w = SampleWriter(server.client(), cfg)
    server.kill()
    for i in range(150):
        w.submit(make_sample(seed=i, n_tokens=2, k=2, prompt_len=2))
    time.sleep(0.3)
    st = w.close(timeout=0.5)
    assert (st.dropped_on_close, st.unconfirmed_on_close, st.written) == (150, 0, 0)
