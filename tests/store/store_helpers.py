"""Shared helpers of the store tests (a module with a unique name, so test files can import it)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from store.client import connect
from store.synthetic import synthetic_sample
from store.schema import PairFingerprint, SamplingSettings, VerifiedSample

SHARED_URL = "redis://127.0.0.1:6379/0"
PAIR = PairFingerprint(target="google/gemma-3-4b-it", draft="google/gemma-3-270m-it", tokenizer_hash="tok-abc123")



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server we own: ``start()``, ``kill()`` (SIGKILL), on a fixed port and data dir."""

    def __init__(self, workdir: Path, aof: bool = False):
        self.port = free_port()
        self.workdir = workdir
        self.aof = aof
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir), "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        # no client-side retries: the writer's own backoff is what is under test
        return connect(self.url, socket_timeout=1.0, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))



def make_sample(
    n_tokens: int = 128,
    k: int = 32,
    prompt_len: int = 200,
    gamma: int = 4,
    workload: str = "chat",
    adapter_version: int = 0,
    pair: PairFingerprint = PAIR,
    seed: int = 0,
    vocab: int = 262_144,
    hidden_size: int = 0,
) -> VerifiedSample:
    """A realistic record: steps of γ proposals, random top-k distributions that sum with the
    tail mass to 1 (store.synthetic)."""
    return synthetic_sample(
        np.random.default_rng(seed), n_tokens, k, prompt_len, gamma, vocab, hidden_size,
        request_id=f"req-{seed}", workload=workload, adapter_version=adapter_version, pair=pair,
        sampling=SamplingSettings(temperature=0.7, top_p=0.95, top_k=64, seed=seed),
        started_at=1_732_870_000.0 + seed, finished_at=1_732_870_008.25 + seed,
    )



def free_cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 is free too (both below 65536)."""
    import random

    for _ in range(200):
        p = random.randint(20_000, 55_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 10_000))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair (P, P + 10000) for a cluster node")


class LocalCluster:
    """A Redis Cluster of our own: ``masters`` redis-server processes in cluster mode (plus
    ``replicas`` per master) on free loopback ports, each in its own directory under ``workdir``;
    ``start()`` creates the cluster with ``redis-cli --cluster create`` and waits for
    ``cluster_state:ok`` on every node; ``stop()`` kills them all."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1, password: str | None = None):
        self.workdir = workdir
        self.masters = masters
        self.replicas = replicas
        self.password = password
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            p = free_cluster_port()
            if p not in self.ports:
                self.ports.append(p)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return "redis+cluster://" + auth + ",".join(f"127.0.0.1:{p}" for p in self.ports[: self.masters])

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.password, socket_connect_timeout=0.5, socket_timeout=2.0)

    def start_node(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", "",
                "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000"]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                self.node(port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server (cluster mode) on port {port} did not start")

    def start(self, timeout: float = 60.0) -> None:
        for p in self.ports:
            self.start_node(p)
        cmd = ["redis-cli"] + (["-a", self.password, "--no-auth-warning"] if self.password else [])
        cmd += ["--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({out.returncode}): {out.stdout[-2000:]} {out.stderr[-2000:]}")
        self.wait_ok(timeout)

    def wait_ok(self, timeout: float = 60.0, ports: list[int] | None = None) -> None:
        deadline = time.time() + timeout
        ports = ports or list(self.procs)
        while time.time() < deadline:
            try:
                if all(b"cluster_state:ok" in self.node(p).execute_command("CLUSTER", "INFO") for p in ports):
                    # and every replica has its master's link up
                    if all(self._replica_synced(p) for p in ports):
                        return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"cluster on ports {ports} not ok within {timeout} s")

    def _replica_synced(self, port: int) -> bool:
        info = self.node(port).info("replication")
        return info.get("role") != "slave" or info.get("master_link_status") == "up"

    def master_of_slot(self, slot: int) -> int:
        for p in self.procs:
            try:
                for lo, hi, master, *_ in self.node(p).execute_command("CLUSTER", "SLOTS"):
                    if lo <= slot <= hi:
                        return int(master[1])
            except redis.RedisError:
                continue
        raise RuntimeError(f"no node serves slot {slot}")

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for p in list(self.procs):
            self.kill(p)
