"""The feature-level head as a proposer (``"eagle"``, EAGLE-1: Li et al. 2024): the head
(:class:`decoder.eagle.EagleHead`) drafts from the target's own hidden states, fed to it by the
decoder after the prefill and after each verification."""

from __future__ import annotations

import torch

from decoder.eagle import EagleHead, KVCache
from decoder.proposers.base import Proposal, ProposerSpec
from decoder.sampling import argmax, process_logits, sample


class EagleProposer:
    """Proposals from an :class:`EagleHead` (``"eagle"``), one head row per draft token.

    The decoder feeds it the target's features: after the prefill, the prompt's (row j:
    (f_j, x_{j+1})), and after each verification those of the input token and the accepted
    proposals, each with the token that followed it (the accepted ones, then the bonus token):
    :meth:`features`. Those rows are the head's committed cache; the first proposal of a step
    runs them (the last of them gives q for x_1), then the head continues on its own features g
    for x_2 .. x_γ. Speculative rows are never committed, so a rollback needs no crop.

    Args:
        head: the head (eval mode; its ``vocab_ids`` map its columns to token ids).
        vocab_size: V_p, the target's vocabulary: q has this width, 0 outside the head's ids.
    """

    name = "eagle"
    needs_features = True

    def __init__(self, head: EagleHead, vocab_size: int):
        self.head = head
        self.vocab_size = vocab_size
        self.cache: KVCache | None = None
        self.length = 0  # committed head rows
        self._feats: list[torch.Tensor] = []
        self._next: list[int] = []

    def start(self, ids: list[int], prefill: bool) -> None:
        pass  # the prompt's features arrive through features()

    def features(self, feats: torch.Tensor, next_tokens: list[int]) -> None:
        """Queue committed rows: ``feats`` (m, H) target features, ``next_tokens`` (m,) the token
        after each. Raises ValueError if the two lengths differ."""
        if feats.shape[0] != len(next_tokens):
            raise ValueError(f"features: {feats.shape[0]} feature rows for {len(next_tokens)} tokens")
        if len(next_tokens):
            self._feats.append(feats.float())
            self._next.extend(int(t) for t in next_tokens)

    def _q(self, logits: torch.Tensor, params):
        return process_logits(self.head.full_logits(logits.float(), self.vocab_size), params)

    def propose(self, ids: list[int], gamma: int, params, gen: torch.Generator):
        if not self._next:  # a one-token prompt: no feature yet; the plain step brings its own
            return Proposal([], torch.zeros((0, self.vocab_size)))
        dev = self.head.embed.device
        f = torch.cat(self._feats).to(dev)[None]  # (1, m, H)
        x = torch.tensor([self._next], device=dev)
        logits, g, self.cache = self.head(f, x, self.length, self.cache, last_only=True)
        self.length += x.shape[1]
        self._feats, self._next = [], []
        tokens, qs = [], []
        cache, g_last, logit = self.cache, g[:, -1:], logits[0, -1]
        for i in range(gamma):
            q_i = self._q(logit, params)
            t = int(argmax(q_i)) if params.greedy else int(sample(q_i, gen))
            tokens.append(t)
            qs.append(q_i)
            if i + 1 < gamma:
                lg, g_last, cache = self.head(g_last, torch.tensor([[t]], device=dev), self.length + i, cache)
                logit = lg[0, -1]
        return Proposal(tokens, torch.stack(qs) if qs else torch.zeros((0, self.vocab_size)))

    def rollback(self, length: int) -> None:
        pass  # speculative rows were never committed


def build(decoder, req) -> EagleProposer:
    """``decoder``'s head as a proposer. Raises ValueError without a head, or on an engine
    without hidden states (``SpeculativeDecoder.check_eagle_head``)."""
    decoder.check_eagle_head()
    return EagleProposer(decoder.eagle_head, decoder.vocab_p)


SPEC = ProposerSpec("eagle", modelled_by="lengths", versioned_by="head", needs_features=True, model_free=False,
                    cli=False, build=build)
