"""Proposers: what suggests the γ tokens that the target verifies (one file per proposer).

- :mod:`decoder.proposers.base`: :class:`Proposal`, the :class:`Proposer` protocol, and the
  :class:`ProposerSpec` each proposer declares (how the controller models it, what versions it,
  whether it needs the target's features, how the decoder builds one for a request).
- :mod:`decoder.proposers.draft`: the draft model (``"draft"``).
- :mod:`decoder.proposers.ngram`: prompt lookup over the request and the workload's past requests
  (``"ngram"``), its gate and shadow.
- :mod:`decoder.proposers.eagle`: the feature-level head (``"eagle"``).
- :mod:`decoder.proposers.cost`: :class:`StepCost`, the measured cost of a step by verified rows.
- :mod:`decoder.proposers.registry`: every proposer's spec by name; the only place that lists them.
"""
