"""`serve` under load: 8 concurrent openai clients x 25 requests over mixed workloads and sampling
policies; Redis killed and restarted mid-run; an adapter promoted mid-run."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from serve_helpers import MODEL, serving  # noqa: E402

WORKLOADS = ("prose", "code", "math")
PROMPTS = {"prose": "the river ran", "code": "def f(x):", "math": "3 + 4 * 2 ="}


def _request(oc, i: int, c: int):
    w = WORKLOADS[(i + c) % 3]
    kw = dict(model=MODEL, max_tokens=6 + i % 5, extra_body={"workload": w})
    policy = (i + 2 * c) % 3
    if policy == 0:
        kw["temperature"] = 0
    elif policy == 1:
        kw.update(temperature=0.8, top_p=0.9, seed=i)
    else:
        kw["temperature"] = 1.0
    stream = i % 2 == 1
    if i % 4 < 2:
        r = oc.completions.create(prompt=PROMPTS[w], stream=stream, **kw)
        if stream:
            chunks = list(r)
            return "".join(x.choices[0].text for x in chunks), chunks[-1].model_extra["draftd"]
        return r.choices[0].text, r.model_extra["draftd"]
    msgs = [{"role": "user", "content": PROMPTS[w]}]
    r = oc.chat.completions.create(messages=msgs, stream=stream, **kw)
    if stream:
        chunks = list(r)
        return "".join(x.choices[0].delta.content or "" for x in chunks), chunks[-1].model_extra["draftd"]
    return r.choices[0].message.content, r.model_extra["draftd"]


class Load:
    """``clients`` threads x ``n`` requests each; records (send time, measurement) and failures."""

    def __init__(self, served, clients: int = 8, n: int = 25):
        self.served, self.clients, self.n = served, clients, n
        self.done: list[tuple[float, dict]] = []
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(c,)) for c in range(clients)]

    def _client(self, c: int) -> None:
        oc = self.served.openai()
        for i in range(self.n):
            sent = time.monotonic()
            try:
                _, m = _request(oc, i, c)
                with self._lock:
                    self.done.append((sent, m))
            except Exception as e:  # noqa: BLE001 - counted: the test asserts there are none
                with self._lock:
                    self.failures.append(f"client {c} request {i}: {e!r}")

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def wait_for(self, n: int) -> None:
        while len(self.done) + len(self.failures) < n and any(t.is_alive() for t in self.threads):
            time.sleep(0.02)

    def join(self) -> None:
        for t in self.threads:
            t.join(600)


def test_load_8_clients_x_25_requests_no_failure_one_sample_per_request(redis_client, key_prefix):
    from store.buffer import stream_depth

    with serving(redis_client, key_prefix, heartbeat_s=0.5) as s:
        load = Load(s).start()
        load.join()
        assert load.failures == []
        assert len(load.done) == 200
        assert s.loop.writer.flush(30)
        assert stream_depth(redis_client, s.store_config) == 200  # one VerifiedSample per served request
        ids = {m["request_id"] for _, m in load.done}
        assert len(ids) == 200
        st = s.loop.status()
        assert st["requests_served"] == 200 and st["requests_failed"] == 0
        assert set(st["requests_by_workload"]) == set(WORKLOADS)
        assert st["buffer"]["written"] == 200 and st["buffer"]["dropped"] == 0


def _redis_server(port: int, dir_) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: the Redis restart test needs its own server")
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(dir_)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    c = redis.Redis(port=port)
    for _ in range(500):
        try:
            c.ping()
            return p
        except redis.ConnectionError:
            time.sleep(0.02)
    p.kill()
    pytest.fail(f"redis-server on port {port} did not answer")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_killed_and_restarted_during_a_load_run_fails_no_request(tmp_path):
    from store.buffer import stream_depth
    from store.client import connect
    from store.config import StoreConfig
    from store.registry import AdapterRegistry

    port = free_port()
    proc = _redis_server(port, tmp_path)
    try:
        client = connect(f"redis://127.0.0.1:{port}/0")
        prefix = "test:serve:restart:"
        registry = AdapterRegistry(client, tmp_path / "artifacts", StoreConfig(key_prefix=prefix))
        with serving(client, prefix, registry=registry, heartbeat_s=0.2) as s:
            load = Load(s).start()
            load.wait_for(40)
            proc.kill()  # SIGKILL: no goodbye
            proc.wait(30)
            load.wait_for(100)  # served while Redis is down
            down = s.loop.writer.stats()
            proc = _redis_server(port, tmp_path)
            load.join()
            assert load.failures == []
            assert len(load.done) == 200
            assert s.loop.writer.flush(60)  # writes resumed by themselves
            after = s.loop.writer.stats()
            assert after.redis_up and after.written > down.written
            assert stream_depth(client, s.store_config) > 0
            assert s.loop.status()["requests_served"] == 200
            # `daemonctl status` after it: the heartbeat carries the writer's outage (daemon.reports.buffer_warnings)
            from daemon.reports import buffer_warnings
            from store.heartbeat import read_heartbeats

            hb, deadline = None, time.time() + 10
            while hb is None and time.time() < deadline:
                mine = [h for h in read_heartbeats(client, s.store_config) if h["server_id"] == s.service.server_id]
                hb = mine[0] if mine and (mine[0].get("buffer") or {}).get("last_outage") else None
                time.sleep(0.1)
            assert hb is not None and hb["buffer"]["outages"] == 1 and hb["buffer"]["down_since"] is None
            (warn,) = buffer_warnings([hb], time.time())
            assert warn.startswith(f"serve {s.service.server_id}: its record writer lost Redis 1 time, last at "), warn
            assert f"{after.dropped} records dropped" in warn or f"{after.dropped} record dropped" in warn, warn
    finally:
        proc.kill()
        proc.wait(30)


def test_an_adapter_promoted_during_a_load_run_serves_from_the_next_request(redis_client, key_prefix, tmp_path):
    from adapt_helpers import exact_draft, fixing_lora, perturb, shallow_target
    from store.config import StoreConfig
    from store.registry import AdapterMeta, AdapterRegistry

    target = shallow_target()
    draft = exact_draft(target)
    noise = perturb(draft, scale=3.0)
    registry = AdapterRegistry(redis_client, tmp_path / "artifacts", StoreConfig(key_prefix=key_prefix))
    v1 = registry.register(fixing_lora(draft, noise, tmp_path / "fix"), AdapterMeta(parent=0))
    with serving(redis_client, key_prefix, target=target, draft=draft, registry=registry) as s:
        load = Load(s).start()
        load.wait_for(40)
        registry.promote(v1, "promoted mid-run")
        assert s.loop.manager.wait_prepared(v1, 120)
        ready = time.monotonic()
        load.join()
        assert load.failures == []
        before = [m["adapter_version"] for sent, m in load.done if sent < ready]
        after = [m["adapter_version"] for sent, m in load.done if sent > ready]
        assert after, "no request was sent after the promotion was prepared"
        assert set(after) == {v1}
        assert 0 in before
