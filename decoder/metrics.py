"""Acceptance accounting: counts are stored, rates are derived when read.

Counter names follow vLLM's spec-decode metrics (``num_drafts``, ``num_draft_tokens``,
``num_accepted_tokens``, ``num_accepted_tokens_per_pos``). Every rate returns NaN when its
denominator is zero, so an empty window never reads as 0 % or 100 %.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from store.jsonsafe import nan_none


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def line_at(points: list[tuple[float, float]], x: float) -> float:
    """A cost read off measured (x, y) points at ``x``: NaN without points, flat through a single
    one, else the least-squares line with its slope clamped at >= 0 (a step that verifies more rows
    never costs less), at least 1e-6. What the goodput controller and the n-gram gate's step cost
    use for a γ they have not measured yet."""
    if not points:
        return math.nan
    if len(points) == 1:
        return points[0][1]
    n = len(points)
    mx = sum(p for p, _ in points) / n
    my = sum(q for _, q in points) / n
    sxx = sum((p - mx) ** 2 for p, _ in points)
    slope = max(0.0, sum((p - mx) * (q - my) for p, q in points) / sxx) if sxx else 0.0
    return max(1e-6, my + slope * (x - mx))


@dataclass
class StepStats:
    """One verification step (γ = 0 is a plain decoding step).

    proposed: γ, draft tokens proposed.
    accepted: length of the accepted prefix (0..γ) that the output kept: proposals accepted after
        an EOS or stop-string cut were never used and are not counted.
    emitted: tokens this step added to the output after stop/length truncation (<= accepted + 1).
    rejected_at: index of the first rejected proposal, -1 if none.
    alpha_sum: Σ over the γ proposed positions of Σ_x min(p, q) (processed distributions).
    draft_ms / verify_ms: wall time of the draft's proposal and of the target's forward (ms).
    asked: γ the step asked the proposer for (capped by the tokens left); ``proposed`` may be
        fewer (the n-gram proposer proposes nothing without a match). None: equal to proposed.
    prefill: the request's first token, taken from the prefill's last row
        (``DecoderConfig.first_token_from_prefill``): no forward of its own, so not a
        verification step (:class:`AcceptanceCounts` counts its token apart).
    """

    proposed: int
    accepted: int
    emitted: int
    rejected_at: int
    alpha_sum: float
    draft_ms: float
    verify_ms: float
    asked: int | None = None
    prefill: bool = False


@dataclass
class AcceptanceCounts:
    """Pooled counts over any set of steps (one request, one workload window, a whole bench).

    Derived rates (definitions at each property):
    acceptance_rate, mean_accepted_length (τ), alpha (α), acceptance_per_position, goodput.
    """

    num_requests: int = 0
    num_steps: int = 0  # verification steps, including plain (γ = 0) steps
    num_drafts: int = 0  # steps with γ >= 1
    num_draft_tokens: int = 0  # Σ γ over drafting steps
    num_accepted_tokens: int = 0  # Σ accepted-prefix lengths
    num_emitted_tokens: int = 0  # tokens added to outputs, bonus/corrections included, after truncation
    num_prefill_tokens: int = 0  # of those, first tokens taken from a prefill's last row (no step of their own)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: steps accepting position i+1
    num_proposed_per_pos: list[int] = field(default_factory=list)  # [i]: steps proposing position i+1
    alpha_sum: float = 0.0  # Σ over proposed positions of Σ_x min(p, q); its count is num_draft_tokens
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    decode_ms: float = 0.0  # wall time of decoding steps (excludes prefill)
    prefill_ms: float = 0.0

    def add_step(self, s: StepStats) -> None:
        self.num_emitted_tokens += s.emitted
        if s.prefill:  # the prefill's token: in the output, not a verification step
            self.num_prefill_tokens += s.emitted
            return
        self.num_steps += 1
        self.draft_ms += s.draft_ms
        self.verify_ms += s.verify_ms
        if s.proposed:
            self.num_drafts += 1
            self.num_draft_tokens += s.proposed
            self.num_accepted_tokens += s.accepted
            self.alpha_sum += s.alpha_sum
            _grow(self.num_proposed_per_pos, s.proposed)
            _grow(self.num_accepted_tokens_per_pos, s.proposed)
            for i in range(s.proposed):
                self.num_proposed_per_pos[i] += 1
            for i in range(s.accepted):
                self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: "AcceptanceCounts") -> "AcceptanceCounts":
        for name in ("num_requests", "num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "num_emitted_tokens", "num_prefill_tokens", "alpha_sum", "draft_ms", "verify_ms", "decode_ms",
                     "prefill_ms"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                             (self.num_proposed_per_pos, other.num_proposed_per_pos)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v
        return self

    # ---- derived rates -------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed draft tokens; only each step's accepted prefix counts."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """τ = tokens the verification steps emitted / verification steps (bonus and corrections
        included, after stop truncation; a first token taken from the prefill is not counted),
        pooled over steps, not a mean of per-request means."""
        return _ratio(self.num_emitted_tokens - self.num_prefill_tokens, self.num_steps)

    @property
    def alpha(self) -> float:
        """α = mean over proposed positions (num_draft_tokens) of Σ_x min(p(x), q(x)) = 1 - TV(p, q)."""
        return _ratio(self.alpha_sum, self.num_draft_tokens)

    @property
    def acceptance_per_position(self) -> list[float]:
        """[i] = P(position i+1 accepted | position i+1 proposed), i = 0..γ_max-1."""
        return [_ratio(a, n) for a, n in zip(self.num_accepted_tokens_per_pos, self.num_proposed_per_pos)]

    @property
    def goodput(self) -> float:
        """Emitted (target-verified) tokens per ms of decoding; prefill excluded, since plain and
        speculative decoding pay it alike (and with it a first token taken from its last row)."""
        return _ratio(self.num_emitted_tokens - self.num_prefill_tokens, self.decode_ms)

    @property
    def draft_ms_per_draft_token(self) -> float:
        return _ratio(self.draft_ms, self.num_draft_tokens)

    @property
    def verify_ms_per_step(self) -> float:
        return _ratio(self.verify_ms, self.num_steps)

    def summary(self) -> dict:
        """Counts plus derived rates, JSON-ready (NaN rates become None)."""
        d = asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "alpha", "goodput",
                     "draft_ms_per_draft_token", "verify_ms_per_step"):
            d[name] = nan_none(getattr(self, name))
        d["acceptance_per_position"] = [nan_none(x) for x in self.acceptance_per_position]
        return d


def _grow(lst: list[int], n: int) -> None:
    if len(lst) < n:
        lst.extend([0] * (n - len(lst)))


