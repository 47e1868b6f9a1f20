"""The writer's last_error names the cause (redis-py 8's repr of a ConnectionError is only
'network:ConnectionError')."""

from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from store.buffer import SampleWriter
from store.config import BufferConfig, StoreConfig
from store_helpers import free_port


def test_writer_to_dead_port_counts_drops_and_names_the_error(sample_factory):
    port = free_port()
    c = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.3, retry=Retry(NoBackoff(), 0))
    cfg = StoreConfig(key_prefix="test:store:deadport:", buffer=BufferConfig(queue_size=4, batch_size=2, backoff_max_s=0.1))
    w = SampleWriter(c, cfg)
    for i in range(3):
        assert w.submit(sample_factory(n_tokens=4, seed=i))
    deadline = time.time() + 5
    while w.stats().redis_up and time.time() < deadline:
        time.sleep(0.02)
    for i in range(10):  # never raises, never blocks
        assert w.submit(sample_factory(n_tokens=4, seed=10 + i))
    st = w.stats()
    assert not st.redis_up
    assert "Connection refused" in st.last_error and "ConnectionError" in st.last_error, st.last_error
    assert st.dropped_redis_down > 0
    final = w.close(timeout=0.5)
    assert final.written == 0
    assert final.submitted == final.written + final.dropped + final.rejected
