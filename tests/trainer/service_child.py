"""Child process of the crash test: one TrainerService round that trains until it is killed.

Usage: python service_child.py KEY_PREFIX ARTIFACT_DIR WORK_DIR
Prints ``TRAINING <n>`` (flushed) when the Distiller starts its round on n samples.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from store.buffer import SampleReader  # noqa: E402
from store.client import connect  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.registry import AdapterRegistry  # noqa: E402
from tiny_pair import PAIR, tiny_draft  # noqa: E402
from trainer.distill import DistillConfig, Distiller  # noqa: E402
from trainer.service import ServiceConfig, TrainerService  # noqa: E402

torch.set_num_threads(1)
prefix, artifact_dir, work_dir = sys.argv[1:4]
cfg = StoreConfig(key_prefix=prefix)
client = connect("redis://127.0.0.1:6379/0")
reader = SampleReader(client, cfg, "trainer", "doomed", expected_fingerprint=PAIR)
registry = AdapterRegistry(client, artifact_dir, cfg)
dist = Distiller(tiny_draft(), DistillConfig(max_steps=10**9, max_epochs=10**6, max_seconds=3600.0))
train_round = dist.train_round


def announced(samples):
    print(f"TRAINING {len(samples)}", flush=True)
    return train_round(samples)


dist.train_round = announced
svc = TrainerService(reader, registry, dist, ServiceConfig(work_dir=work_dir, min_eval_samples=1))
svc.run_round_now("crash-test")
print("ROUND FINISHED (should have been killed)", flush=True)
