"""Two `daemonctl serve` replicas and two `daemonctl run` daemons on a real Redis Cluster (issue 36
items 2-4; the packaged SmolLM2-135M pair), through three faults in one run: the master holding
the buffer's stream is killed under load (its replica takes over), the leading trainer is killed
mid-round (the standby takes the lease, reclaims the dead round's records, trains and registers),
and a serve replica is killed mid-request.

Counted: failed client requests (only the one in flight on the killed replica); records by id
(every answered request's record in the buffer, none twice, none left pending on the dead
trainer); the registry's active version on both replicas after a promotion; one trainer at a time
(the standby refuses train-now while the leader's round runs, leadership intervals from both
daemons' logs never overlap and every finished round lies inside its daemon's interval, the fence
token rose and a write with the dead leader's token is refused, one version registered); the
standby's takeover time (printed)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from conftest import DAEMONCTL, REPO, base_env, ctl, free_port, http, paused_trainer_env, wait_healthy  # noqa: E402
from store.client import connect  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.errors import FencedError  # noqa: E402
from store.heartbeat import read_heartbeats  # noqa: E402
from store.registry import AdapterMeta, AdapterRegistry  # noqa: E402
from store.schema import decode  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1] / "store"))
from store_helpers import LocalCluster  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:", "The history of the river valley begins with", "import numpy as np\n"]
TTL = 2.0  # trainer.lease_ttl_s: the standby leads within TTL + TTL/3 of the leader's death


@pytest.fixture
def cluster(tmp_path):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not on PATH")
    c = LocalCluster(tmp_path / "cluster", masters=3, replicas=1)
    c.start()
    yield c
    c.stop()


def zero_lora(out: Path) -> Path:
    """A peft LoRA (r = 2 on q and v, lora_B zero: the draft's outputs unchanged) shaped for the
    derived 4-layer SmolLM2-135M draft, built from its config alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(out)
    return out


def start_replica(tmp_path: Path, name: str, url: str, key_prefix: str):
    port = free_port()
    env = base_env(tmp_path / f"state-{name}", free_port(), DRAFTD_REDIS__URL=url, DRAFTD_STORE__KEY_PREFIX=key_prefix,
                   DRAFTD_SERVE__HEARTBEAT_S="0.5", DRAFTD_SERVE__SERVER_ID=f"replica-{name}",
                   DRAFTD_MODELS__FORMAT="packaged", DRAFTD_MODELS__TORCH_THREADS="1")
    log = tmp_path / f"serve-{name}.log"
    proc = subprocess.Popen([DAEMONCTL, "serve", "--port", str(port)], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, cwd=REPO)
    return proc, port, env, log


def daemon_env(url: str, key_prefix: str) -> dict[str, str]:
    """A paused trainer (rounds only on train-now) with tiny rounds, the lease at TTL, the dead
    leader's records reclaimable after 1 s, and every version's bytes in Redis (the replicas have
    their own state dirs)."""
    return paused_trainer_env(
        key_prefix, DRAFTD_REDIS__URL=url, DRAFTD_TRAINER__LEASE_TTL_S=str(TTL),
        DRAFTD_TRAINER__MAX_STEPS="4", DRAFTD_TRAINER__BATCH_SIZE="2", DRAFTD_TRAINER__MAX_SEQ_LEN="64",
        DRAFTD_TRAINER__MIN_EVAL_SAMPLES="1", DRAFTD_TRAINER__MIN_EVAL_REQUESTS="2",
        DRAFTD_TRAINER__RECLAIM_MIN_IDLE_MS="1000", DRAFTD_TRAINER__ADAPTER_BYTES_IN_REDIS="true")


def status_of(d) -> dict:
    code, st = http("GET", d.url + "/v1/status")
    assert code == 200, st
    return st


def first_event(d, name: str) -> dict:
    return next(e for e in d.events() if e.get("event") == name)


def ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def leadership_intervals(d, died_at: float | None) -> list[tuple[float, float, int]]:
    """(start, end, token) of each time ``d`` led, from its log's lease_acquired / lease_lost;
    an interval still open ends at ``died_at`` (its SIGKILL) or never."""
    out, start, token = [], None, 0
    for e in d.events():
        if e.get("event") == "lease_acquired":
            start, token = ts(e), int(e["token"])
        elif e.get("event") == "lease_lost" and start is not None:
            out.append((start, ts(e), token))
            start = None
    if start is not None:
        out.append((start, died_at if died_at is not None else float("inf"), token))
    return out


def test_replicas_and_daemons_on_a_cluster_through_a_master_kill_a_trainer_kill_mid_round_and_a_replica_kill(
        tmp_path, cluster, daemon_factory, key_prefix):
    T0 = time.monotonic()
    url = cluster.url
    cfg = StoreConfig(key_prefix=key_prefix, hash_tags=True)
    a, pa, env, log_a = start_replica(tmp_path, "a", url, key_prefix)
    b, pb, _, log_b = start_replica(tmp_path, "b", url, key_prefix)
    client = connect(url, socket_timeout=2.0, socket_connect_timeout=0.5)
    stop_load = threading.Event()
    try:
        with ThreadPoolExecutor(2) as ex:  # both daemons load their models while the replicas load theirs
            daemons = list(ex.map(lambda n: daemon_factory(daemon_env(url, key_prefix), state_dir=tmp_path / f"daemon-{n}",
                                                           timeout=600), "12"))
        wait_healthy(a, pa, lambda: log_a.read_text()[-3000:])
        wait_healthy(b, pb, lambda: log_b.read_text()[-3000:])
        oc = {p: openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="unused", max_retries=0, timeout=600)
              for p in (pa, pb)}
        served: dict[int, list[str]] = {pa: [], pb: []}  # request ids answered, per replica

        def ask(port: int, prompt: str, n: int = 16) -> str:
            r = oc[port].completions.create(model="smollm2-135m", prompt=prompt, max_tokens=n, temperature=0,
                                            extra_body={"workload": "prose"})
            served[port].append(r.id.split("-", 1)[1])
            return r.choices[0].text

        # 1. both replicas serve; the same greedy prompt gives the same text on both
        texts = {p: [ask(p, q) for q in PROMPTS[:2]] for p in (pa, pb)}
        assert texts[pa] == texts[pb]
        print(f"[{time.monotonic() - T0:.0f} s] 2 replicas and 2 daemons up; both replicas answered")

        # 2. steady load on both replicas through the master's and the trainer's deaths: none of it may fail
        load_failures: list[str] = []
        load_ports = [pa, pb]

        hold_load, load_idle = threading.Event(), threading.Event()  # step 3 quiesces the load for an instant

        def load() -> None:
            i = 0
            while not stop_load.is_set():
                if hold_load.is_set():
                    load_idle.set()
                    stop_load.wait(0.05)
                    continue
                load_idle.clear()
                port = load_ports[i % len(load_ports)]
                try:
                    ask(port, f"{PROMPTS[i % len(PROMPTS)]} ({i})", 8)  # new prompts: training and held-out ones
                except Exception as e:  # noqa: BLE001 - counted
                    load_failures.append(f"{port}: {type(e).__name__}: {e}")
                i += 1
                stop_load.wait(0.2)  # leaves the daemons and the adapter conversions some CPU on 2 cores

        loader = threading.Thread(target=load, daemon=True)
        loader.start()

        # 3. the master holding the stream dies under that load; its replica takes over. Replication
        # is asynchronous: a record the master acknowledged in its last instant and never sent to its
        # replica is lost (Redis's documented window; docs/scaling.md), so the kill comes at a
        # moment when the master's replica has every write: the load held for that instant (the
        # replicas' writers flush within a second), the replica's offset caught up, then the kill,
        # and the load resumes at once, through the failover
        victim = cluster.master_of_slot(client.keyslot(cfg.keys.stream))
        hold_load.set()
        assert load_idle.wait(120)
        time.sleep(2.0)  # the last answered requests' records leave the replicas' writers
        import redis as redis_py

        rep = cluster.node(victim).info("replication")["slave0"]
        mirror = redis_py.Redis(host="127.0.0.1", port=int(rep["port"]), password=cluster.password,
                                single_connection_client=True, socket_timeout=2.0)
        mirror.execute_command("READONLY")  # a cluster replica answers reads on this connection
        deadline = time.monotonic() + 30
        while (mine := cluster.node(victim).xinfo_stream(cfg.keys.stream)["last-generated-id"]) != \
                (theirs := mirror.xinfo_stream(cfg.keys.stream)["last-generated-id"]):
            assert time.monotonic() < deadline, (mine, theirs)  # the stream's last entry has reached the replica
            time.sleep(0.05)
        mirror.close()
        t0 = time.monotonic()
        cluster.kill(victim)
        hold_load.clear()
        cluster.wait_ok(120)
        failover_s = time.monotonic() - t0
        assert cluster.master_of_slot(client.keyslot(cfg.keys.stream)) != victim
        print(f"[{time.monotonic() - T0:.0f} s] the stream's master killed under load; failover {failover_s:.1f} s")

        # 4. one daemon leads (a lease key may have moved with the failover: wait for one leader)
        deadline = time.monotonic() + 60
        while True:
            leases = [status_of(d)["trainer"]["lease"] for d in daemons]
            roles = [x["role"] for x in leases]
            if roles.count("leader") == 1 and all(x["lease_holder"] == leases[roles.index("leader")]["holder"] for x in leases):
                break
            assert time.monotonic() < deadline, leases
            time.sleep(0.2)
        leader, standby = (daemons[0], daemons[1]) if roles[0] == "leader" else (daemons[1], daemons[0])
        old_token = leases[roles.index("leader")]["token"]
        consumer = first_event(leader, "trainer_started")["consumer"]
        group = "trainer"

        def held_by(name: str) -> int:
            info = client.xpending(cfg.keys.stream, group)
            return sum(int(c["pending"]) for c in info.get("consumers") or [] if c["name"] in (name, name.encode()))

        while client.xlen(cfg.keys.stream) < 12:  # records for a round
            assert loader.is_alive() and not load_failures, load_failures
            time.sleep(0.5)

        print(f"[{time.monotonic() - T0:.0f} s] {client.xlen(cfg.keys.stream)} records; train-now on the leader")
        # 5. the leader's round is killed mid-round: running, holding the records it took, unacked
        code, body = http("POST", leader.url + "/v1/train-now", token=leader.token)
        assert code == 200 and body["submitted"] is True, body
        deadline = time.monotonic() + 300
        while not (status_of(leader)["trainer"]["running"] and (held := held_by(consumer)) > 0):
            assert time.monotonic() < deadline, "the leader's round never took records"
            time.sleep(0.05)
        code, body = http("POST", standby.url + "/v1/train-now", token=standby.token)  # one trainer at a time
        assert code == 409 and "stands by" in body["detail"], body
        killed_at = time.time()
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(30)
        assert not [e for e in leader.events() if e.get("event") == "trainer_round"]  # the round never finished
        t0 = time.monotonic()
        while (lease := status_of(standby)["trainer"]["lease"])["role"] != "leader":
            assert time.monotonic() - t0 < 60, "the standby did not take over"
            time.sleep(0.05)
        polled_s = time.monotonic() - t0
        took = max(ts(e) for e in standby.events() if e.get("event") == "lease_acquired") - killed_at
        new_token = lease["token"]
        assert new_token > old_token
        print(f"[{time.monotonic() - T0:.0f} s] standby takeover after the leader's SIGKILL mid-round: {took:.2f} s by "
              f"its log, {polled_s:.2f} s polled (lease_ttl_s {TTL}); stream master failover {failover_s:.1f} s; dead round held {held} records")

        # 6. the new leader's round takes the dead round's records over, trains and registers
        code, body = http("POST", standby.url + "/v1/train-now?wait=true", token=standby.token)
        assert code == 200, body
        rep = body["report"]
        assert rep["decision"] in ("promoted", "rejected") and rep["reclaimed"] >= held, rep
        assert held_by(consumer) == 0  # nothing left pending on the dead trainer
        v = rep["version"]
        t0 = time.monotonic()  # a promotion by the round happened just before it returned
        reg = AdapterRegistry(client, tmp_path / "artifacts", cfg)
        assert [r.version for r in reg.list()] == [v]  # the killed round registered nothing, this one once
        assert int(client.get(cfg.keys.fence)) == new_token  # announced before the new leader's first write

        # 7. a promotion reaches both replicas (they load it from Redis; swaps at request boundaries). The
        # round's gate has too little evidence at these sizes to promote, and a rejected version cannot be
        # promoted: an operator (token 0, never fenced) registers and promotes a zero LoRA instead
        if rep["decision"] == "promoted":
            v_round, v = v, v
        else:
            v_round, v = v, reg.register(zero_lora(tmp_path / "lora"), AdapterMeta(parent=0), store_bytes=True)
            t0 = time.monotonic()
            reg.promote(v, "fault test")
        assert reg.active_version() == v
        deadline = time.monotonic() + 120
        while True:
            beats = {h["server_id"]: h for h in read_heartbeats(client, cfg)}
            if all(beats.get(f"replica-{n}", {}).get("adapter_version") == v for n in "ab"):
                break
            assert time.monotonic() < deadline, {k: h.get("adapter_version") for k, h in beats.items()}
            assert loader.is_alive() and not load_failures, load_failures
            time.sleep(0.1)
        followed_s = time.monotonic() - t0
        print(f"[{time.monotonic() - T0:.0f} s] v{v} active on both replicas {followed_s:.1f} s after its promotion "
              f"(the round's v{v_round}: {rep['decision']})")
        stale = AdapterRegistry(client, tmp_path / "artifacts", cfg)
        stale.fencing_token = old_token  # what the dead leader's registry carried
        with pytest.raises(FencedError):
            stale.rollback("a stale leader's write")
        assert reg.active_version() == v

        st = json.loads(ctl(env, "status", "--json").stdout)  # status reads every master's heartbeats
        assert {"replica-a", "replica-b"} <= {h["server_id"] for h in st.get("serving", [])}

        # 8. the steady load ends: not one failure through the master's and the trainer's deaths
        stop_load.set()
        loader.join(300)
        assert not loader.is_alive() and load_failures == [], load_failures
        assert [ask(p, PROMPTS[0]) for p in (pa, pb)] == [texts[pa][0]] * 2  # lossless on v, on both

        # every request b answered has its record before b dies
        deadline = time.monotonic() + 60
        while not set(served[pb]) <= (have_b := {decode(f).request_id for _, f in client.xrange(cfg.keys.stream)}):
            assert time.monotonic() < deadline, (
                f"b's records did not reach the buffer: {sorted(set(served[pb]) - have_b)} of {len(served[pb])} missing; "
                f"dead letters: {[f for _, f in client.xrange(cfg.keys.stream + ':dead')][-3:]}; "
                f"b's log: {log_b.read_text()[-3000:]}")
            time.sleep(1.0)
        print(f"[{time.monotonic() - T0:.0f} s] load stopped: {len(served[pa])} + {len(served[pb])} requests, 0 failed")

        # 9. replica b is killed mid-request: only that request fails; a goes on serving
        failed: list[BaseException] = []
        started = threading.Event()

        def long_stream() -> None:
            try:
                for _ in oc[pb].completions.create(model="smollm2-135m", prompt=PROMPTS[4], max_tokens=400,
                                                   temperature=0, stream=True, extra_body={"workload": "prose"}):
                    started.set()
            except Exception as e:  # noqa: BLE001 - the one failure expected
                failed.append(e)
            started.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(300)
        b.send_signal(signal.SIGKILL)
        b.wait(30)
        t.join(60)
        assert len(failed) == 1
        for q in PROMPTS[:3]:
            ask(pa, q)

        # records: every answered request of both replicas is in the buffer, and no record is there twice
        want = set(served[pa]) | set(served[pb])
        deadline = time.monotonic() + 60
        while True:
            recs = [decode(f) for _, f in client.xrange(cfg.keys.stream)]
            have = {s.request_id for s in recs}
            if want <= have:
                break
            assert time.monotonic() < deadline, f"{len(want - have)} of {len(want)} answered requests have no record"
            time.sleep(1.0)
        ids = [s.record_id for s in recs]
        assert len(ids) == len(set(ids))

        # one trainer at a time: leadership intervals never overlap, tokens rise, every round inside its leader's
        spans = sorted([(s, e, tok, d) for d in daemons
                        for s, e, tok in leadership_intervals(d, killed_at if d is leader else None)])
        assert spans and all(x[1] <= y[0] and x[2] < y[2] for x, y in zip(spans, spans[1:])), spans
        for d in daemons:
            for e in d.events():
                if e.get("event") == "trainer_round":
                    end = ts(e)
                    assert any(s <= end - e["seconds"] and end <= f for s, f, _, o in spans if o is d), (e, spans)

        st = json.loads(ctl(env, "status", "--json").stdout)
        assert "replica-a" in {h["server_id"] for h in st.get("serving", [])}  # b's heartbeat expires after its TTL
    finally:
        stop_load.set()
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        client.close()
