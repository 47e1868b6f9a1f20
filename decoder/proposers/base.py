"""The proposer seam: a :class:`Proposal` of up to γ tokens and the q they were drawn from, the
:class:`Proposer` protocol a request's proposer follows, and the :class:`ProposerSpec` each
proposer declares so that the decoder, the controller and the managers ask the spec instead of
matching names.

Verification (:func:`decoder.sampling.verify`) is lossless for any q, so a proposer only moves
acceptance and cost, never the output distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from decoder.sampling import SamplingParams


@dataclass
class Proposal:
    """γ' <= γ proposed tokens.

    tokens: (γ',) token ids x_1..x_γ'.
    q: (γ', V) processed distributions each x_i was drawn from (a one-hot row for a
        deterministic proposer); verification and α use exactly these.
    """

    tokens: list[int]
    q: torch.Tensor


class Proposer(Protocol):
    """One request's proposer (built per request; the decoder holds its lock meanwhile)."""

    name: str

    def start(self, ids: list[int], prefill: bool) -> None:
        """The prompt is ``ids`` (P tokens); the last one is the pending token. ``prefill``: the
        request will speculate (a model-based proposer may prefill now, inside prefill ms)."""

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, gen: torch.Generator) -> Proposal:
        """Up to ``gamma`` proposals continuing ``ids`` (all tokens so far, pending one last)."""

    def rollback(self, length: int) -> None:
        """Only ``ids[:length]`` survived verification: forget any state beyond it."""

    # optional: ``verified(accepted: int)``, called after each verification of a proposal with its
    # accepted prefix (before any cut at a stop), for a proposer that learns from it


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ProposerSpec:
    """What a proposer declares about itself (:mod:`decoder.proposers.registry` holds them by name).

    - ``modelled_by``: how the goodput controller predicts its tokens per step: ``"alpha"`` (a
      draft model: the acceptance rate α per position, E[accepted] from α and γ, and a speculation
      ceiling), or ``"lengths"`` (the accepted lengths it measured per γ asked).
    - ``versioned_by``: the registry whose promoted versions it proposes with, judged live by a
      rollback monitor: ``"adapter"`` (LoRA adapters of the draft), ``"head"`` (feature-level
      heads), or None (nothing trained).
    - ``needs_features``: fed the target's hidden states (``features(rows, next tokens)``).
    - ``model_free``: runs no model, so its steps measure the verification alone (:class:`StepCost`).
    - ``cli``: offered by the CLI and the bench (``registry.PROPOSERS``); every registered
      proposer may be named by a request or configured in serve.
    - ``build(decoder, request)``: the proposer for one request of a ``SpeculativeDecoder``.
    - ``prior_alpha``: the per-token acceptance α (Leviathan et al. 2023) expected before any
      traffic, from a measurement its SPEC names; what :mod:`decoder.models.formats` prices a
      served weight format with. None: not priced there.
    """

    name: str
    modelled_by: Literal["alpha", "lengths"]
    versioned_by: Literal["adapter", "head"] | None
    needs_features: bool
    model_free: bool
    cli: bool
    build: Callable[[Any, Any], Proposer]
    prior_alpha: float | None = None


def crop_to(cache, length: int) -> None:
    """Drop cached positions beyond ``length``: an engine sequence's ``truncate`` (see
    :mod:`decoder.engines`), or a transformers cache (transformers 5: ``crop(-n)`` removes n)."""
    if hasattr(cache, "truncate"):
        cache.truncate(length)
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
