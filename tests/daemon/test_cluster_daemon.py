"""`daemonctl run` on a Redis Cluster (issue 36 item 1; the real SmolLM2-135M pair): the URL
redis+cluster://, a round reads the buffer, registers and acks through hash-tagged keys, and
status reads it all back with the password masked."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from conftest import http
from store.buffer import SampleWriter, group_info
from store.client import connect
from store.config import StoreConfig
from store.registry import AdapterRegistry
from test_shutdown import fingerprint, make_sample  # noqa: F401 - the fixture

sys.path.append(str(Path(__file__).resolve().parents[1] / "store"))
from store_helpers import LocalCluster  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli not on PATH")
    c = LocalCluster(tmp_path / "cluster", masters=3, replicas=1, password="clu5ter-pw")
    c.start()
    yield c
    c.stop()


def test_a_daemon_trains_on_a_cluster(daemon_factory, cluster, key_prefix, fingerprint, tmp_path):  # noqa: F811
    client = connect(cluster.url)
    cfg = StoreConfig(key_prefix=key_prefix, hash_tags=True)
    with SampleWriter(client, cfg) as w:
        for i in range(12):
            assert w.submit(make_sample(fingerprint, "prose" if i % 2 else "code", i, vocab=49152))
        assert w.flush(10)
    d = daemon_factory({
        "DRAFTD_REDIS__URL": cluster.url, "DRAFTD_STORE__KEY_PREFIX": key_prefix,
        "DRAFTD_MODELS__TORCH_THREADS": "1", "DRAFTD_TRAINER__START_PAUSED": "true",
        "DRAFTD_TRAINER__INTERVAL_S": "3600", "DRAFTD_TRAINER__MAX_STEPS": "4", "DRAFTD_TRAINER__BATCH_SIZE": "2",
        "DRAFTD_TRAINER__MAX_SEQ_LEN": "64", "DRAFTD_TRAINER__MIN_EVAL_SAMPLES": "1",
    }, state_dir=tmp_path / "state", timeout=240)
    code, body = http("POST", d.url + "/v1/train-now?wait=true", token=d.token)
    assert code == 200, body
    rep = body["report"]
    assert rep["read"] == 12 and rep["decision"] in ("promoted", "rejected"), rep
    reg = AdapterRegistry(client, d.state_dir / "adapters", cfg)
    assert [r.version for r in reg.list()] == [rep["version"]]
    g = next(g for g in group_info(client, cfg) if g.name == "trainer")
    assert g.pending == 0  # acked after the registration
    code, st = http("GET", d.url + "/v1/status")
    assert code == 200 and st["buffer"]["stream"] == f"{key_prefix}{{samples}}" and st["adapter"]["registered"] == 1
    assert st["trainer_lease"]["holder"] == st["trainer"]["lease"]["holder"]
    assert "clu5ter-pw" not in str(st) and "***" in st["redis"]["url"] and len(st["redis"]["cluster_masters"]) == 3
    assert "clu5ter-pw" not in d.log_path.read_text()
    client.close()
