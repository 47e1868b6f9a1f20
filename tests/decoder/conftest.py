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
