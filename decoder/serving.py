"""Moved to :mod:`decoder.draft_weights` (the draft's weight copy); this name stays until decoder/speculative.py imports from there."""

from decoder.draft_weights import DTYPES, PRECISIONS, ServingDraft, calibrate_draft_precision  # noqa: F401
