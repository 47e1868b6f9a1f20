import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from tiny import char_tokenizer, tiny_llama, tiny_target  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="session")
def target():
    return tiny_target()


@pytest.fixture(scope="session")
def other_draft():
    """An independently initialised draft: low acceptance, many rejections."""
    return tiny_llama(7, layers=2, hidden=32, head_scale=20.0)


@pytest.fixture
def reg(tmp_path):
    """A real AdapterRegistry on the shared Redis under a unique prefix (see adapt_helpers)."""
    from adapt_helpers import RedisRegistry

    r = RedisRegistry(tmp_path / "artifacts")
    yield r
    r.close()


@pytest.fixture
def pair():
    """A fresh shallow target, an exact 1-layer draft of it, and the noise that makes the draft
    useless (α ≈ 0.02); LoRA layers injected into the draft stay local to the test."""
    from adapt_helpers import exact_draft, perturb, shallow_target

    target = shallow_target()
    draft = exact_draft(target)
    noise = perturb(draft, scale=3.0)
    return target, draft, noise
