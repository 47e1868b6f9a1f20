"""Sampling parameters at the edges of their valid ranges: a temperature above 0 but tiny, a top_p
above 0 but below float32's range. Both are valid requests (serve accepts them); they gave NaN
distributions (serve: a 400 blaming the sampler, 'cannot sample row 0', param null)."""

from __future__ import annotations

import pytest
import torch

from decoder.sampling import SamplingParams, process_logits, sample, served_logprobs


LOGITS = torch.tensor([[1.5, 7.25, -3.0, 7.0, float("-inf")], [0.0, -1.0, 2.0, 1.0, 0.5]])
ARGMAX = [1, 2]


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_tiny_temperature_is_the_argmax_not_nan(temperature):
    p = process_logits(LOGITS, SamplingParams(temperature=temperature, seed=1))
    assert torch.isfinite(p).all()
    assert p.argmax(-1).tolist() == ARGMAX and p.max(-1).values.tolist() == [1.0, 1.0]
    assert sample(p, torch.Generator().manual_seed(1)).tolist() == ARGMAX


@pytest.mark.parametrize("top_p", [1e-300, 1e-46])
def test_a_top_p_below_float32s_range_keeps_the_top_token(top_p):
    p = process_logits(LOGITS, SamplingParams(temperature=1.0, top_p=top_p, seed=1))
    assert torch.isfinite(p).all()
    assert p.argmax(-1).tolist() == ARGMAX and p.max(-1).values.tolist() == [1.0, 1.0]
    lp = served_logprobs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert lp[0, 1].item() == 0.0 and lp[0, 0].item() == float("-inf")


def test_ordinary_temperatures_are_unchanged():
    """At T >= LIMIT_BELOW_TEMPERATURE the logits are divided as before: the same bits."""
    for t in (1e-30, 1e-3, 0.7, 1.0, 2.0):
        got = process_logits(LOGITS, SamplingParams(temperature=t))
        assert torch.equal(got, torch.softmax(LOGITS.float() / t, dim=-1)), t
