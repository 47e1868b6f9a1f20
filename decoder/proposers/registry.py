"""Every proposer by name, from the spec its module declares (:class:`ProposerSpec`).

Adding a proposer is one file in this package (the class, a ``build(decoder, request)`` and a
``SPEC``) and its line in :data:`SPECS`; the decoder builds it, the goodput controller models it
and the rollback monitor judges its versions from the spec alone.
"""

from __future__ import annotations

from decoder.proposers import draft, eagle, ngram
from decoder.proposers.base import ProposerSpec

SPECS: dict[str, ProposerSpec] = {s.name: s for s in (draft.SPEC, ngram.SPEC, eagle.SPEC)}
# what serve, the CLI, the controller and the bench choose among
PROPOSERS: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s.cli)
# every proposer a request may name ("eagle" needs a head on the decoder: SpeculativeDecoder.eagle_head)
REQUEST_PROPOSERS: tuple[str, ...] = tuple(SPECS)
DEFAULT_PROPOSER = draft.SPEC.name  # a request's proposer when neither it nor the policy names one


def spec(name: str) -> ProposerSpec:
    """The spec of proposer ``name``. Raises ValueError naming the known ones."""
    s = SPECS.get(name)
    if s is None:
        raise ValueError(f"proposer {name!r}: use one of {REQUEST_PROPOSERS}")
    return s


def alpha_modelled() -> str:
    """The proposer the goodput controller models by α (the draft model: its rates by γ, its
    speculation ceiling)."""
    return next(n for n, s in SPECS.items() if s.modelled_by == "alpha")


def versioned_by(kind: str) -> str:
    """The proposer whose versions the registry ``kind`` (``"adapter"`` or ``"head"``) holds."""
    for s in SPECS.values():
        if s.versioned_by == kind:
            return s.name
    raise ValueError(f"no proposer is versioned by {kind!r} registries")
