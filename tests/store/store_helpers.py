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

