"""Fixtures of the trainer tests: a tiny real (target, draft) pair and target-generated samples."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny_pair import make_samples, tiny_draft, tiny_target  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models: one thread is fastest, and on a shared 2-core machine two threads contending
    with other processes made a 100-step test 50x slower (160 s vs 3 s). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def target(one_torch_thread):
    return tiny_target()


@pytest.fixture(scope="session")
def train_samples(target):
    """96 samples (48 prose, 48 code) with the untrained draft's greedy rejections at gamma 4."""
    d = tiny_draft()
    return make_samples(target, 48, "prose", seed=1, draft=d) + make_samples(target, 48, "code", seed=2, draft=d)


@pytest.fixture(scope="session")
def heldout_samples(target):
    """32 samples from other prompts, never trained on."""
    return make_samples(target, 16, "prose", seed=101) + make_samples(target, 16, "code", seed=102)


@pytest.fixture
def draft():
    return tiny_draft()


