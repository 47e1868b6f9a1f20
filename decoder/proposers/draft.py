"""The draft model as a proposer (``"draft"``): a small causal LM (the derived draft, its LoRA
adapters merged), autoregressive over its own KV cache; q is its processed distribution."""

from __future__ import annotations

import torch

from decoder.proposers.base import Proposal, ProposerSpec, crop_to
from decoder.sampling import SamplingParams, process_logits, sample


class DraftModelProposer:
    """Proposals from the draft model through the decoder's draft call.

    ``draft_logits(tokens, cache) -> (V,)`` runs the draft on ``tokens`` appended to ``cache``
    and returns the logits at the last position, in the target's vocabulary (the decoder's
    ``_draft_logits``: serving copy, FR-Spec head). The cache holds a prefix of the request's
    tokens and catches up lazily, so a request that never speculates never runs the draft.
    """

    name = "draft"

    def __init__(self, draft_logits, new_cache):
        self._logits = draft_logits
        self.cache = new_cache()
        self.length = 0  # tokens in the cache

    def start(self, ids: list[int], prefill: bool) -> None:
        if prefill and len(ids) > 1:
            self._logits(ids[:-1], self.cache)
            self.length = len(ids) - 1

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, gen: torch.Generator) -> Proposal:
        feed = ids[self.length:]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(gamma):
            q_i = process_logits(self._logits(feed, self.cache), params)  # (V,)
            x = int(q_i.argmax()) if params.greedy else int(sample(q_i, gen))
            tokens.append(x)
            qs.append(q_i)
            feed = [x]
        if gamma:
            self.length = len(ids) + gamma - 1
        return Proposal(tokens, torch.stack(qs) if qs else torch.zeros((0, 0)))

    def rollback(self, length: int) -> None:
        if self.length > length:
            crop_to(self.cache, length)
            self.length = length


def build(decoder, req) -> DraftModelProposer:
    """The draft model of ``decoder`` (a ``SpeculativeDecoder``): on its draft engine, or on the
    torch draft (serving copy, FR-Spec head) with a transformers cache."""
    if decoder.draft_engine is not None:
        return DraftModelProposer(decoder._engine_draft_logits, decoder.draft_engine.start)
    from transformers import DynamicCache

    return DraftModelProposer(decoder._draft_logits, lambda: DynamicCache(config=decoder.draft.config))


# prior_alpha 0.20: the derived draft's decoded greedy α on never-served prompts in the quick demos
# (adapted 0.10-0.26, v0 0.09-0.36: issue 34's table, bench/RESULTS.md).
SPEC = ProposerSpec("draft", modelled_by="alpha", versioned_by="adapter", needs_features=False, model_free=False,
                    cli=True, build=build, prior_alpha=0.20)
