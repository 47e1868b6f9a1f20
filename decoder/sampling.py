"""Speculative sampling: the pure math (no models, no clocks).

Notation follows the papers: p is the target's distribution, q the draft's, γ the number of
draft proposals per step (``num_speculative_tokens``).

- Leviathan, Kalman, Matias. "Fast Inference from Transformers via Speculative Decoding",
  ICML 2023 (arXiv:2211.17192), Algorithm 1 and Section 3.
- Chen et al. "Accelerating Large Language Model Decoding with Speculative Sampling", 2023
  (arXiv:2302.01318), Algorithm 2 (modified rejection sampling).

Terms:
- *proposal*: the γ tokens x_1..x_γ the draft samples, x_i ~ q_i.
- *verification*: one target forward over the γ+1 positions giving p_1..p_{γ+1}.
- *accepted prefix*: the longest prefix x_1..x_n whose tokens all pass the test
  r_i < p_i(x_i) / q_i(x_i), r_i ~ U(0, 1) (greedy: x_i == argmax p_i). Tokens after the first
  rejection are discarded even if they would have passed.
- *recovered (correction) token*: at the first rejection i, a token sampled from the residual
  distribution norm(max(0, p_i - q_i)) (Leviathan et al. Section 3.1, Chen et al. eq. 3).
- *bonus token*: when all γ proposals are accepted, one extra token sampled from p_{γ+1}.
Every step therefore emits n + 1 tokens, 0 <= n <= γ, and the emitted sequence is distributed
exactly as sampling from p alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import torch

# Residual masses at or below this are treated as zero (p == q up to float rounding): sample from p.
RESIDUAL_EPS = 1e-12

# Below this temperature logits / T can overflow float32 (|logit| / T > 3.4e38; T itself may round
# to 0 in float32), NaN after the softmax: the distribution is taken as its T -> 0 limit, uniform
# over the maximal logits (float32 logits differ by far more than T there). At or above it |logit|
# would have to pass 3.4e8 to overflow, and logits / T is used as is.
LIMIT_BELOW_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """Sampling policy, applied identically to p and q before the acceptance test.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most probable tokens (0 = off).
    top_p: keep the smallest set of most probable tokens whose mass reaches top_p (1.0 = off).
    seed: per-request seed; the same seed reproduces the same output.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1.0 = off)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def bucket(self) -> str:
        """Sampling-policy key for acceptance statistics, e.g. ``greedy`` or ``t0.7-p0.9``.

        Temperature is rounded to 0.1 and top-p to 0.05, so nearby policies share estimates.
        """
        if self.greedy:
            return "greedy"
        t = round(self.temperature, 1)
        p = round(round(self.top_p / 0.05) * 0.05, 2)
        k = f"-k{self.top_k}" if self.top_k else ""
        return f"t{t:g}-p{p:g}{k}"


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, the same ids (ties: the lowest; a NaN counts as the largest), at a
    fraction of the cost on the CPU: float32/float64 CPU tensors without autograd go through
    numpy, whose argmax over a vocabulary row is many times faster than torch's CPU kernel (a
    sizeable share of a decoding step: bench/RESULTS.md "The serving loop's Python per step"),
    everything else through torch.

    Args:
        x: (..., V) scores.

    Returns:
        (...) int64 indices on ``x``'s device.
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad and x.dim():
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1), dtype=np.int64))
    return x.argmax(-1)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the distribution the request samples from.

    Args:
        logits: (..., V) float, raw model logits (``-inf`` allowed for masked ids).
        params: the request's sampling policy.

    Returns:
        (..., V) float32 probabilities summing to 1 on the last axis. Greedy gives the one-hot
        of the argmax (ties: lowest id), so that α = Σ min(p, q) equals greedy agreement.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits).unsqueeze(-1), 1.0)
    if params.temperature < LIMIT_BELOW_TEMPERATURE:  # a tiny temperature: logits / T would overflow
        top = logits.amax(-1, keepdim=True)
        logits = torch.where(logits == top, 0.0, float("-inf"))
    else:
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (the top-1 stays).
        # a top_p below float32's smallest normal would round to 0 and drop every token: keep the top-1
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= max(params.top_p, torch.finfo(torch.float32).tiny)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's temperature-1 top-k per row, as records store it: ids (n, k) int32, probs
    (n, k) float32, tail mass (n,) = 1 - their sum (clamped at 0), all on the CPU. Ids of exactly
    equal probability come in an unspecified order, and at the k-th place which of them are kept is
    unspecified (as with torch.topk); the probabilities and the tail do not depend on it.

    Args:
        logits: (..., V) raw logits.
        k: ids kept per row (at most V).
    """
    x = logits.float()
    V = x.shape[-1]
    k = min(k, V)
    if x.device.type == "cpu" and x.numel() and V % _TOPK_BLOCK == 0 and k <= V // _TOPK_BLOCK < V:
        ids = _blocked_topk(x.reshape(-1, V), k).reshape(*x.shape[:-1], k)  # the logits' top-k: the probabilities' too
        probs = torch.softmax(x, dim=-1).gather(-1, ids)
    else:
        p = torch.softmax(x, dim=-1)
        probs, ids = torch.topk(p, k, dim=-1)
    tail = (1.0 - probs.sum(-1)).clamp_min(0.0)
    return ids.to(torch.int32).cpu(), probs.cpu(), tail.cpu()


_TOPK_BLOCK = 64  # ids per block in _blocked_topk


def _blocked_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest of each row of ``x`` (n, V), best first, (n, k) int64: every one
    of them lies in one of the k blocks (of ``_TOPK_BLOCK`` ids) with the largest maxima, so the
    top-k runs over k blocks instead of V ids (torch's full-row CPU topk is slow: bench/RESULTS.md
    "The serving loop's Python per step")."""
    n, V = x.shape
    blocks = x.reshape(n, V // _TOPK_BLOCK, _TOPK_BLOCK)
    best = torch.topk(blocks.amax(-1), k, dim=-1).indices  # (n, k) the blocks holding the top-k
    cand = blocks.gather(1, best.unsqueeze(-1).expand(-1, -1, _TOPK_BLOCK)).reshape(n, -1)  # (n, k * B)
    j = torch.topk(cand, k, dim=-1).indices
    return (best.unsqueeze(-1) * _TOPK_BLOCK + torch.arange(_TOPK_BLOCK)).reshape(n, -1).gather(1, j)


MAX_LOGPROBS = 20  # alternatives per position at most (OpenAI's top_logprobs bound)


def served_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution a request is served from (vLLM's
    ``processed_logprobs``): for a sampled request, log of :func:`process_logits` (temperature,
    top-k, top-p; ``-inf`` where a cut removed a token); for a greedy one, the model's own
    log-softmax (greedy decoding applies no temperature, and its one-hot says nothing).

    Args:
        logits: (..., V) raw target logits.
        params: the request's sampling policy.

    Returns:
        (..., V) float32 log-probabilities (nats).
    """
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(process_logits(logits, params))


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the served distribution (nats), and the
    ``top`` most probable tokens there as (id, log-probability), most probable first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, params: SamplingParams, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The emitted ``tokens``' log-probabilities from the rows that emitted them.

    Args:
        logits: (N, V) raw target logits; row j is the distribution that emitted ``tokens[j]``.
        params: the request's sampling policy (:func:`served_logprobs`).
        tokens: (N,) the emitted ids.
        top: alternatives per position, 0..``MAX_LOGPROBS``.

    Raises:
        ValueError: ``top`` outside 0..MAX_LOGPROBS, or fewer rows than tokens.
    """
    if not 0 <= top <= MAX_LOGPROBS:
        raise ValueError(f"top={top!r}: ask for 0 to {MAX_LOGPROBS} alternatives per position")
    if logits.shape[0] < len(tokens):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(tokens)} tokens: one row per emitted token")
    lp = served_logprobs(logits[: len(tokens)], params)  # (N, V)
    chosen = lp.gather(-1, torch.tensor(list(tokens), dtype=torch.long).unsqueeze(-1)).squeeze(-1).tolist()
    if top:
        vals, idx = torch.topk(lp, top, dim=-1)
        alts = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        alts = [()] * len(tokens)
    return [TokenLogprob(int(t), float(c), a) for t, c, a in zip(tokens, chosen, alts)]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of (..., V) probabilities (unnormalised is fine); returns (...,) int64.

    Inverse transform sampling: one uniform u ~ U[0, 1) per row, scaled by the row's total, and
    the first id whose float64 cumulative sum exceeds it. A token of probability 0 adds nothing to
    the sum, so it is never drawn. ``torch.multinomial`` draws the same distribution but cost
    about 1.7 ms per 49k-token row on one CPU core, paid once per draft token and once per
    verification; this costs about 0.1-0.2 ms, its input checks included. ``generator`` is a
    CPU generator (as the decoder's).

    Raises:
        ValueError: a row with a negative, NaN or infinite entry, or summing to 0.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.shape[0] == 0:  # no rows: nothing to draw
        return torch.empty(probs.shape[:-1], dtype=torch.long, device=probs.device)
    cdf = flat.double().cumsum(-1)  # (N, V)
    total = cdf[:, -1:]  # (N, 1)
    ok = torch.isfinite(total[:, 0]) & (total[:, 0] > 0)
    if not bool(ok.all()) or bool(flat.min() < 0):
        bad = int((~ok | (flat < 0).any(-1)).nonzero()[0, 0])
        # the row's index in probs' leading dims (N,) or (B, T, ...), not in the flattened view
        where = bad if probs.dim() <= 2 else tuple(int(i) for i in torch.unravel_index(torch.tensor(bad), probs.shape[:-1]))
        raise ValueError(
            f"cannot sample row {where}: probabilities must be finite and >= 0 with a positive sum (row sum "
            f"{float(total[bad, 0])}, min {float(flat[bad].min())}); check the temperature (a tiny one overflows "
            f"the logits) and that the draft vocabulary is not empty")
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64).to(cdf.device)
    idx = torch.searchsorted(cdf, u * total, right=True).clamp_max(flat.shape[-1] - 1)  # (N, 1)
    bad = flat.gather(-1, idx) <= 0  # only if u * total rounded up to the total: redraw exactly
    if bool(bad.any()):
        rows = bad[:, 0].nonzero()[:, 0]
        idx[rows] = torch.multinomial(flat[rows].float(), 1, generator=generator)
    return idx.reshape(probs.shape[:-1])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) (Leviathan et al. 2023, Sec. 3.1; Chen et al. 2023, eq. 3).

    Args:
        p, q: (..., V) probabilities.

    Returns:
        (..., V) probabilities. Where the residual mass is 0 (p == q), returns p: the rejection
        then had probability 0, so any choice is exact; p avoids a division by zero (NaN).
    """
    r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    safe = mass > RESIDUAL_EPS
    return torch.where(safe, r / torch.where(safe, mass, torch.ones_like(mass)), p)


def alpha(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Expected acceptance of one proposal, α = Σ_x min(p(x), q(x)) = 1 - TV(p, q).

    Leviathan et al. 2023, Definition 3.1 / Corollary 3.6. Shapes: (..., V) -> (...,).
    """
    return torch.minimum(p, q).sum(-1)


@dataclass(frozen=True)
class Verification:
    """Outcome of verifying one block of γ proposals.

    num_accepted: n, length of the accepted prefix (0..γ).
    next_token: the recovered token (n < γ) or the bonus token (n == γ).
    rejected_at: index of the first rejected proposal, -1 if all were accepted.
    """

    num_accepted: int
    next_token: int
    rejected_at: int


def verify_greedy(proposals: Sequence[int], choice: Sequence[int]) -> Verification:
    """Greedy verification from the target's argmax per row, without its distributions: accept
    while x_i == choice_i; the next token is choice_{n+1} (:func:`verify`'s greedy case).

    Args:
        proposals: the γ draft tokens.
        choice: γ + 1 target argmax ids (the same positions plus one).

    Raises:
        ValueError: ``choice`` is not one longer than ``proposals``.
    """
    gamma = len(proposals)
    if len(choice) != gamma + 1:
        raise ValueError(f"verify_greedy: {len(choice)} target rows for {gamma} proposals: need {gamma + 1}")
    n = next((i for i in range(gamma) if proposals[i] != choice[i]), gamma)
    return Verification(n, int(choice[n]), n if n < gamma else -1)


def verify(
    proposals: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> Verification:
    """Accept a prefix of the draft's proposals and emit the next token.

    Args:
        proposals: (γ,) int64 draft tokens x_1..x_γ (γ may be 0: plain decoding).
        q: (γ, V) processed draft distributions the proposals were drawn from.
        p: (γ+1, V) processed target distributions at the same positions plus one.
        greedy: accept while x_i == argmax p_i; the next token is argmax p_{n+1}.
        generator: source of the uniforms and of the recovered/bonus draw.

    Returns:
        :class:`Verification`. Sampling case: token i is accepted with probability
        min(1, p_i(x_i) / q_i(x_i)) (Leviathan et al. Algorithm 1); at the first rejection the
        next token is drawn from :func:`residual_distribution`; if all are accepted the bonus
        token is drawn from p_{γ+1}.
    """
    gamma = proposals.shape[0]
    if greedy:
        return verify_greedy([int(x) for x in proposals], argmax(p).tolist())
    if gamma:
        idx = proposals.unsqueeze(-1)
        px = p[:gamma].gather(-1, idx).squeeze(-1)  # (γ,)
        qx = q.gather(-1, idx).squeeze(-1)  # (γ,) > 0: x_i was drawn from q_i
        r = torch.rand(gamma, generator=generator, dtype=p.dtype)
        ok = r * qx < px  # r < p/q without dividing by a tiny q
        if not bool(ok.all()):
            n = int((~ok).nonzero()[0, 0])
            y = sample(residual_distribution(p[n], q[n]), generator)
            return Verification(n, int(y), n)
    return Verification(gamma, int(sample(p[gamma], generator)), -1)


def predicted_speedup(a: float, gamma: int, c: float) -> float:
    """Expected walltime improvement factor (Leviathan et al. 2023, Theorem 3.8):

        (1 - α^(γ+1)) / ((1 - α)(γc + 1))

    a: α, expected acceptance per proposal; gamma: γ; c: draft cost per token over target cost
    per step. α == 1 takes the limit (γ + 1) / (γc + 1).
    """
    if gamma == 0:
        return 1.0
    if a >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - a ** (gamma + 1)) / ((1 - a) * (gamma * c + 1))


def expected_tokens_per_step(a: float, gamma: int) -> float:
    """E[emitted tokens per step] = (1 - α^(γ+1)) / (1 - α) (Leviathan et al. 2023, eq. 1): the
    accepted prefix plus the correction or bonus token, with i.i.d. acceptance α per position
    (clamped to [0, 1]). γ + 1 at α = 1; 1 at γ <= 0 (plain decoding)."""
    if gamma <= 0:
        return 1.0
    a = min(max(a, 0.0), 1.0)
    if a >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1 - a ** (gamma + 1)) / (1 - a)


SEED_RANGE = (-(2**63), 2**64)  # [low, high): the seeds seeded_generator takes (signed or unsigned 64-bit)
_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState) in torch 2.x
_MT_WORDS_AT = 24  # torch 2.x CPU generator state: u64 initial seed, i32 left, i32 seeded, u64 next, then u64 state[624]


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator whose stream is a function of the whole signed 64-bit ``seed``.

    torch's CPU generator (mt19937) keeps a seed's low 32 bits, so seeds equal modulo 2^32 (1 and
    1 + 2^32; -1 and 2^63 - 1) drew alike. A seed in [0, 2^32) is seeded as torch seeds it (its
    streams unchanged); any other is taken as its 64-bit two's complement, split into two 32-bit
    words and fed to mt19937's ``init_by_array`` (as numpy's legacy ``RandomState`` seeds from an
    array), and the generator's 624-word state set from it.

    Raises ValueError for a seed outside [-2^63, 2^64).
    """
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed={seed}: must be a 64-bit integer")
    g = torch.Generator(device="cpu")
    if 0 <= seed < 2**32:
        g.manual_seed(seed)
        return g
    u = seed % 2**64
    key = np.random.RandomState(np.array([u & 0xFFFFFFFF, u >> 32], dtype=np.uint32)).get_state()[1]  # (624,) uint32
    g.manual_seed(u & 0xFFFFFFFF)  # a fresh state (left = 1, seeded, no cached normal), then its words replaced
    st = g.get_state().numpy().copy()
    if st.size != _STATE_BYTES:  # another torch's layout: refuse rather than draw from a garbled state
        raise RuntimeError(f"torch {torch.__version__}: CPU generator state of {st.size} bytes, expected {_STATE_BYTES}")
    st[:8] = np.frombuffer(np.uint64(u).tobytes(), dtype=np.uint8)  # initial_seed(): the seed as given (mod 2^64)
    st[_MT_WORDS_AT:_MT_WORDS_AT + 624 * 8] = np.frombuffer(key.astype("<u8").tobytes(), dtype=np.uint8)
    g.set_state(torch.from_numpy(st))
    return g


def seeded_sampling(params: SamplingParams) -> bool:
    """A sampled request with a seed: its completion must follow from the seed alone, so nothing
    timing- or traffic-dependent (the n-gram gate) may choose its γ."""
    return not params.greedy and params.seed is not None
