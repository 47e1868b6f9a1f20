"""Synthetic verified samples of a realistic shape, for store tests and benches (no models).

A request of ``n_tokens`` emitted tokens in steps of γ proposals with a uniformly drawn first
rejection (-1 = all accepted, then the bonus token), and per position a random top-k
distribution holding 0.9 of the mass in decreasing order, the rest as tail mass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from store.schema import VerifiedSample


def synthetic_sample(rng: np.random.Generator, n_tokens: int = 128, k: int = 32, prompt_len: int = 200,
                     gamma: int = 4, vocab: int = 262_144, hidden_size: int = 0, **fields: Any) -> VerifiedSample:
    """One VerifiedSample drawn from ``rng``; ``fields`` give the rest (request_id, workload,
    adapter_version, pair, sampling, started_at, finished_at). ``hidden_size`` > 0 adds the
    target's hidden states (n_tokens, hidden_size) float16, normal with unit variance (schema 2)."""
    prop, rej, emitted = [], [], 0
    while emitted < n_tokens:
        r = int(rng.integers(-1, gamma))  # -1 = all γ accepted (+ bonus)
        prop.append(gamma)
        rej.append(r)
        emitted += (gamma if r < 0 else r) + 1
    logits = rng.standard_normal((n_tokens, k)).astype(np.float32)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True) * 0.9
    probs = np.sort(p, axis=-1)[:, ::-1].astype(np.float16)
    return VerifiedSample(
        prompt_ids=rng.integers(0, vocab, prompt_len),
        output_ids=rng.integers(0, vocab, n_tokens),
        proposal_lens=np.array(prop),
        rejection_pos=np.array(rej),
        topk_ids=rng.integers(0, vocab, (n_tokens, k)),
        topk_probs=probs,
        tail_mass=1.0 - probs.astype(np.float32).sum(-1),
        hidden=rng.standard_normal((n_tokens, hidden_size)).astype(np.float16) if hidden_size else None,
        **fields,
    )
