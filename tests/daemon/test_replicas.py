"""Two `daemonctl serve` replicas on a real Redis Cluster (issue 36 items 2 and 4; the packaged
SmolLM2-135M pair): both write one buffer and follow one registry; a promotion reaches both; the
master holding the buffer's stream is killed under load (its replica takes over) and a replica is
killed mid-request. Counted: failed client requests (only the one in flight on the killed
replica), records by id (none of the surviving replica's requests lost, none twice), and `status`
listing both replicas."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from conftest import DAEMONCTL, REPO, base_env, ctl, free_port, wait_healthy  # noqa: E402
from store.client import connect  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.heartbeat import read_heartbeats  # noqa: E402
from store.registry import AdapterMeta, AdapterRegistry  # noqa: E402
from store.schema import decode  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1] / "store"))
from store_helpers import LocalCluster  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:", "The history of the river valley begins with", "import numpy as np\n"]


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


def test_two_replicas_share_the_buffer_and_registry_through_a_master_failover_and_a_replica_kill(
        tmp_path, cluster, key_prefix):
    url = cluster.url
    cfg = StoreConfig(key_prefix=key_prefix, hash_tags=True)
    a, pa, env, log_a = start_replica(tmp_path, "a", url, key_prefix)
    b, pb, _, log_b = start_replica(tmp_path, "b", url, key_prefix)
    client = connect(url, socket_timeout=2.0, socket_connect_timeout=0.5)
    try:
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

        # 2. a promotion reaches both replicas
        reg = AdapterRegistry(client, tmp_path / "artifacts", cfg)
        v = reg.register(zero_lora(tmp_path / "lora"), AdapterMeta(parent=0), store_bytes=True)  # other hosts read it from Redis
        reg.promote(v, "replica test")
        deadline = time.time() + 60
        while True:
            beats = {h["server_id"]: h for h in read_heartbeats(client, cfg)}
            if all(beats.get(f"replica-{n}", {}).get("adapter_version") == v for n in "ab"):
                break
            assert time.time() < deadline, {k: h.get("adapter_version") for k, h in beats.items()}
            ask(pa, PROMPTS[2], 4), ask(pb, PROMPTS[2], 4)  # swaps happen at request boundaries
            time.sleep(0.5)
        assert texts[pa] == [ask(pa, q) for q in PROMPTS[:2]]  # lora_B = 0: the same output

        # 3. the master holding the stream dies; requests go on (the writers hold their records)
        victim = cluster.master_of_slot(client.keyslot(cfg.keys.stream))
        assert cluster.node(victim).execute_command("WAIT", 1, 5000) >= 1
        cluster.kill(victim)
        for q in PROMPTS:
            ask(pa, q)

        st = json.loads(ctl(env, "status", "--json").stdout)  # status reads every master's heartbeats
        assert {"replica-a", "replica-b"} <= {h["server_id"] for h in st.get("serving", [])}

        # 4. replica b is killed mid-request: only that request fails; a goes on serving
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

        # records: every request a answered is in the buffer, and no record is there twice
        want = set(served[pa])
        deadline = time.time() + 60
        while True:
            recs = [decode(f) for _, f in client.xrange(cfg.keys.stream)]
            have = {s.request_id for s in recs}
            if want <= have:
                break
            assert time.time() < deadline, f"{len(want - have)} of a's {len(want)} requests have no record"
            time.sleep(1.0)
        ids = [s.record_id for s in recs]
        assert len(ids) == len(set(ids))
        assert cluster.master_of_slot(client.keyslot(cfg.keys.stream)) != victim

        st = json.loads(ctl(env, "status", "--json").stdout)
        assert "replica-a" in {h["server_id"] for h in st.get("serving", [])}  # b's heartbeat expires after its TTL
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        client.close()
