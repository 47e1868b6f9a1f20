"""The draft model as a proposer (``"draft"``): a small causal LM (the derived draft, its LoRA
adapters merged), autoregressive over its own KV cache; q is its processed distribution, mixed
with the copy channel when the adapter serving carries a gate (``store.copy_channel``)."""

from __future__ import annotations

import numpy as np
import torch

from decoder.proposers.base import Proposal, ProposerSpec, crop_to
from decoder.sampling import SamplingParams, argmax, process_logits, sample
from store.copy_channel import copy_candidate, copy_features, copy_lambda, mix_argmax


class DraftModelProposer:
    """Proposals from the draft model through the decoder's draft call.

    ``draft_logits(tokens, cache) -> (V,)`` runs the draft on ``tokens`` appended to ``cache``
    and returns the logits at the last position, in the target's vocabulary (the decoder's
    ``_draft_logits``: serving copy, FR-Spec head). The cache holds a prefix of the request's
    tokens and catches up lazily, so a request that never speculates never runs the draft.

    ``copy_gate``: the serving adapter's copy gate weights (6,) (``store.copy_channel``), or None
    (no copy channel: q is the draft's). With a gate, each proposal comes from the mixture

        q_mix(x) = (1 - λ) q(x) + λ 1[x = c],  λ = sigmoid(w · f)

    (See et al. 2017, eq. 9), c and f from ``store.copy_channel`` on the context (the request's
    tokens and the proposals before it), f's q(c) and max q from the draft's temperature-1
    distribution (the trainer's features); greedy proposes argmax q_mix
    (``store.copy_channel.mix_argmax``) with a one-hot q row, sampling draws x ~ q_mix with
    q = the processed q mixed. The row handed to verification is the q_mix x was drawn from, so
    decoding stays lossless (:func:`decoder.sampling.verify` is exact for any q).
    """

    name = "draft"

    def __init__(self, draft_logits, new_cache, copy_gate: np.ndarray | None = None):
        self._logits = draft_logits
        self.cache = new_cache()
        self.length = 0  # tokens in the cache
        self.copy_gate = None if copy_gate is None else np.asarray(copy_gate, dtype=np.float64)
        self.copied = 0  # proposals the copy channel chose (its λ-weighted pick won), for inspection

    def start(self, ids: list[int], prefill: bool) -> None:
        if prefill and len(ids) > 1:
            self._logits(ids[:-1], self.cache)
            self.length = len(ids) - 1

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, gen: torch.Generator) -> Proposal:
        feed = ids[self.length:]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        ctx = np.asarray(ids, dtype=np.int64) if self.copy_gate is not None and gamma else None
        for i in range(gamma):
            logits = self._logits(feed, self.cache)  # (V,)
            q_i = process_logits(logits, params)  # (V,)
            mixed = None
            if ctx is not None:
                mixed = self._mix(logits, q_i, np.concatenate([ctx, np.asarray(tokens, dtype=np.int64)]) if i else ctx,
                                  params)
            if mixed is not None:
                q_i, x = mixed
                if x is None:
                    x = int(sample(q_i, gen))
            else:
                x = int(argmax(q_i)) if params.greedy else int(sample(q_i, gen))
            tokens.append(x)
            qs.append(q_i)
            feed = [x]
        if gamma:
            self.length = len(ids) + gamma - 1
        return Proposal(tokens, torch.stack(qs) if qs else torch.zeros((0, 0)))

    def _mix(self, logits: torch.Tensor, q: torch.Tensor, ctx: np.ndarray, params: SamplingParams):
        """The copy channel at one proposal: None without a candidate; else (q_mix (V,), the greedy
        proposal, or None to sample from q_mix)."""
        c, ell = copy_candidate(ctx)
        if ell == 0 or c >= q.shape[-1]:
            return None
        logp = torch.log_softmax(logits.float(), -1)  # the temperature-1 q the gate's features read
        top = int(argmax(logp))
        q_c, q_max = float(logp[c].exp()), float(logp[top].exp())
        lam = float(copy_lambda(self.copy_gate, copy_features([ell], [q_c], [q_max]), [ell])[0])
        if params.greedy:
            x = mix_argmax(top, q_max, c, q_c, lam)
            self.copied += x == c and x != top
            return torch.nn.functional.one_hot(torch.tensor(x), q.shape[-1]).to(q.dtype), x
        mixed = q * (1.0 - lam)
        mixed[c] += lam
        return mixed, None

    def rollback(self, length: int) -> None:
        if self.length > length:
            crop_to(self.cache, length)
            self.length = length


def build(decoder, req) -> DraftModelProposer:
    """The draft model of ``decoder`` (a ``SpeculativeDecoder``): on its draft engine, or on the
    torch draft (serving copy, FR-Spec head) with a transformers cache."""
    gate = getattr(decoder, "copy_gate", None)  # the serving adapter's copy gate (decoder.adapters), or None
    if decoder.draft_engine is not None:
        return DraftModelProposer(decoder._engine_draft_logits, decoder.draft_engine.start, gate)
    from transformers import DynamicCache

    return DraftModelProposer(decoder._draft_logits, lambda: DynamicCache(config=decoder.draft.config), gate)


# prior_alpha 0.20: the derived draft's decoded greedy α on never-served prompts in the quick demos
# (adapted 0.10-0.26, v0 0.09-0.36: issue 34's table, bench/RESULTS.md).
SPEC = ProposerSpec("draft", modelled_by="alpha", versioned_by="adapter", needs_features=False, model_free=False,
                    cli=True, build=build, prior_alpha=0.20)
