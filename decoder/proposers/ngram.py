"""Prompt lookup as a proposer (``"ngram"``): Saxena 2023, "Prompt Lookup Decoding"; Oliaro et al.
2024, "SuffixDecoding". The continuation of the longest recent match of the context's last n
tokens, looked up in the request itself and in the workload's own past requests
(:class:`NgramHistory`). It runs no model (c ≈ 0), and adapts as fast as traffic arrives: every
finished request is indexed at once. Its proposals are deterministic, so q is one-hot and a
proposal x is accepted with probability p(x) (min(1, p/q) with q(x) = 1), the residual being p
with x removed; α = E[p(x)]. With an :class:`NgramGate` it proposes, at each step, only as many of
the matched tokens as pay: the length that maximises expected tokens per ms, from online
acceptance estimates per kind of match and the engine's measured step cost per verified row
count (:class:`decoder.proposers.cost.StepCost`), and none where a plain step is expected to be
faster. :class:`NgramShadow` teaches the gate from the steps that proposed nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

import torch

from decoder.proposers.base import Proposal, ProposerSpec, is_int
from decoder.engines.base import routed_batch_size
from decoder.proposers.cost import StepCost
from decoder.sampling import SamplingParams, seeded_sampling


class _PerWorkload:
    """Per-workload state under one lock; beyond ``max_workloads`` workloads the least recently
    used one is dropped (subclasses set ``_lock``, ``_w`` (an OrderedDict) and ``max_workloads``)."""

    _lock: threading.Lock
    _w: OrderedDict
    max_workloads: int

    def _touch(self, workload: str, make):
        """``workload``'s state, made by ``make()`` if new, now the most recently used (caller holds the lock)."""
        w = self._w.pop(workload, None) or make()
        self._w[workload] = w
        while len(self._w) > self.max_workloads:
            self._w.popitem(last=False)
        return w

    def clear(self, workload: str | None = None) -> None:
        """Forget one workload's state, or every workload's (None)."""
        with self._lock:
            if workload is None:
                self._w.clear()
            else:
                self._w.pop(workload, None)


class NgramHistory(_PerWorkload):
    """Each workload's recent requests, indexed by n-gram for :class:`NgramProposer`.

    Bounded: at most ``max_tokens`` tokens per workload (oldest requests dropped first) and
    ``max_workloads`` workloads (least recently used dropped). Thread-safe.

    index[workload][n-gram] = (sequence number, end): the most recent occurrence of that n-gram
    (n = min_n..max_n tokens) ending just before position ``end`` of that request's tokens.
    """

    def __init__(self, max_n: int = 4, min_n: int = 1, max_tokens: int = 65536, max_workloads: int = 64):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramHistory: need 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
        if max_tokens < 1 or max_workloads < 1:
            raise ValueError(f"NgramHistory: max_tokens={max_tokens} and max_workloads={max_workloads} must be >= 1")
        self.max_n, self.min_n, self.max_tokens, self.max_workloads = max_n, min_n, max_tokens, max_workloads
        self._lock = threading.Lock()
        self._w: OrderedDict[str, _WorkloadIndex] = OrderedDict()

    def add(self, workload: str, tokens: list[int]) -> None:
        """Index one finished request's tokens (prompt + output) under ``workload``."""
        if len(tokens) < 2:
            return
        tokens = list(tokens[-self.max_tokens:])
        with self._lock:
            self._touch(workload, _WorkloadIndex).add(tokens, self.min_n, self.max_n, self.max_tokens)

    def lookup(self, workload: str, key: tuple[int, ...], gamma: int) -> list[int]:
        """The up-to-γ tokens that followed ``key``'s most recent occurrence, or []."""
        return self.lookup_match(workload, key, gamma)[0]

    def lookup_match(self, workload: str, ctx, gamma: int, n: int | None = None,
                     max_len: int = 32) -> tuple[list[int], int]:
        """The up-to-γ tokens that followed the most recent occurrence of ``ctx``'s last ``n``
        tokens (default: all of ``ctx``), and how many tokens of ``ctx`` that occurrence matches
        backwards (>= n, at most ``max_len``): ([], 0) when there is none."""
        n = len(ctx) if n is None else n
        if not 1 <= n <= len(ctx) or max_len < n:
            raise ValueError(f"lookup_match: need 1 <= n={n} <= len(ctx)={len(ctx)} and max_len={max_len} >= n")
        if gamma <= 0:
            return [], 0
        key = tuple(ctx[len(ctx) - n:])
        with self._lock:
            w = self._w.get(workload)
            hit = w.index.get(key) if w is not None else None
            if hit is None or hit[0] not in w.by_seq:
                return [], 0
            seq = w.by_seq[hit[0]]
            end = hit[1]
            return seq[end:end + gamma], _match_len(ctx, len(ctx), seq, end, n, max_len)

    def copy(self) -> "NgramHistory":
        """An independent copy (what an evaluation decodes against, so it leaves no trace)."""
        new = NgramHistory(self.max_n, self.min_n, self.max_tokens, self.max_workloads)
        with self._lock:
            for name, w in self._w.items():
                c = _WorkloadIndex()
                c.seqs, c.by_seq, c.index = deque(w.seqs), dict(w.by_seq), dict(w.index)
                c.next_seq, c.total = w.next_seq, w.total
                new._w[name] = c
        return new

    def tokens(self, workload: str) -> int:
        with self._lock:
            w = self._w.get(workload)
            return w.total if w is not None else 0

    def status(self) -> dict[str, int]:
        """Indexed tokens per workload."""
        with self._lock:
            return {k: w.total for k, w in self._w.items()}


class _WorkloadIndex:
    def __init__(self):
        self.seqs: deque[tuple[int, list[int]]] = deque()  # (sequence number, tokens)
        self.by_seq: dict[int, list[int]] = {}
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}
        self.next_seq = 0
        self.total = 0

    def add(self, tokens: list[int], min_n: int, max_n: int, max_tokens: int) -> None:
        s = self.next_seq
        self.next_seq += 1
        self.seqs.append((s, tokens))
        self.by_seq[s] = tokens
        self.total += len(tokens)
        for end in range(1, len(tokens)):  # a continuation must exist: end < len
            for n in range(min_n, min(max_n, end) + 1):
                self.index[tuple(tokens[end - n:end])] = (s, end)
        while self.total > max_tokens and len(self.seqs) > 1:
            old, toks = self.seqs.popleft()
            del self.by_seq[old]
            self.total -= len(toks)
            # drop the entries that still point into it, so the index stays O(tokens kept)
            for end in range(1, len(toks)):
                for n in range(min_n, min(max_n, end) + 1):
                    key = tuple(toks[end - n:end])
                    if self.index.get(key, (None,))[0] == old:
                        del self.index[key]

def _match_len(a, a_end: int, b, b_end: int, n: int, max_len: int) -> int:
    """How many tokens ``a[:a_end]`` and ``b[:b_end]`` share at their ends, given that the last
    ``n`` are known equal (counted up to ``max_len``)."""
    m = n
    while m < max_len and m < a_end and m < b_end and a[a_end - 1 - m] == b[b_end - 1 - m]:
        m += 1
    return m


# ---- the n-gram proposal's length: expected goodput per step -----------------------------------
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 17)  # a match of m tokens falls in the last bucket whose bound <= m
POSITION_BUCKETS = 4  # conditional acceptance of proposal j: j = 1, 2, 3-4, >= 5


def match_class(source: str, match_len: int) -> tuple[str, int]:
    """The kind of an n-gram match that acceptance is estimated for: (``"own"`` (the request's
    own tokens) or ``"hist"`` (the workload's past requests), the lower bound of its length
    bucket in :data:`MATCH_BUCKETS`)."""
    return source, max(b for b in MATCH_BUCKETS if b <= max(1, match_len))


def _pos_bucket(j: int) -> int:
    return 0 if j == 1 else 1 if j == 2 else 2 if j <= 4 else 3


class NgramGate(_PerWorkload):
    """How many of a match's tokens the n-gram proposer proposes at a step (0: a plain step).

    Per workload and kind of match (:func:`match_class`: own request or workload history x match
    length), it keeps the conditional acceptance a_j = P(proposal j accepted | proposals 1..j-1
    accepted) per position bucket (j = 1, 2, 3-4, >= 5) as forgetting counts: each observation
    first scales every count by ``decay`` (so an estimate rests on about 1 / (1 - decay) recent
    proposals and follows a shift within a few dozen), then adds the positions that were tried;
    a_j = (accepted + 1) / (tried + 2) (a uniform prior), and a bucket never tried takes the
    previous one's estimate. With a step cost t(n) for n verified rows (:class:`StepCost`), a
    proposal of g tokens is expected to emit E(g) = 1 + Σ_{k<=g} Π_{j<=k} a_j tokens (the accepted
    prefix plus the correction or bonus token; Leviathan et al. 2023, eq. (1), with
    position-dependent acceptance) at t(g + 1) ms; the gate picks the g in 0..available with the
    most E(g) / t(g + 1), where E(0) / t(1) is a plain step. Inside a batch of B requests (continuous
    batching) t is the fused step's, t_B(g + 1) (:meth:`StepCost.fused_ms`, the proposer passes
    ``cost.at_batch(B)``), so a batch that already fills the cheap rows proposes less. A kind tried fewer than
    ``explore_tries`` times is proposed at least one token, and every ``explore_every``-th match
    the gate turns down proposes one, so an estimate that turned pessimistic can recover.
    Thread-safe; bounded to ``max_workloads`` workloads (least recently used dropped).
    """

    def __init__(self, decay: float = 0.97, explore_tries: int = 3, explore_every: int = 16,
                 max_workloads: int = 64):
        ints = (explore_tries, explore_every, max_workloads)
        if (not isinstance(decay, (int, float)) or not 0 < decay <= 1 or not all(is_int(v) for v in ints)
                or explore_tries < 0 or explore_every < 1 or max_workloads < 1):
            raise ValueError(f"NgramGate: need 0 < decay={decay!r} <= 1 and the ints explore_tries={explore_tries!r} "
                             f">= 0, explore_every={explore_every!r} >= 1, max_workloads={max_workloads!r} >= 1")
        self.decay, self.explore_tries, self.explore_every = decay, explore_tries, explore_every
        self.max_workloads = max_workloads
        self._lock = threading.Lock()
        # workload -> class -> [hits per bucket, tried per bucket, observations, turned down]
        self._w: OrderedDict[str, dict[tuple, list]] = OrderedDict()

    def _stats(self, workload: str, cls: tuple) -> list:
        return self._touch(workload, dict).setdefault(cls, [[0.0] * POSITION_BUCKETS, [0.0] * POSITION_BUCKETS, 0, 0])

    @staticmethod
    def _acceptance(st: list) -> list[float]:
        hits, tried = st[0], st[1]
        out, prev = [], 0.5
        for b in range(POSITION_BUCKETS):
            prev = (hits[b] + 1.0) / (tried[b] + 2.0) if tried[b] > 0 else prev
            out.append(prev)
        return out

    def acceptance(self, workload: str, cls: tuple) -> list[float]:
        """[a_1, a_2, a_3-4, a_5+] for one kind of match (the prior 0.5 where never tried); reads
        only (no entry is made, no workload becomes more recently used)."""
        with self._lock:
            st = self._w.get(workload, {}).get(cls)
            return self._acceptance(st) if st is not None else [0.5] * POSITION_BUCKETS

    def length(self, workload: str, cls: tuple, available: int, cost: StepCost) -> int:
        """Proposals to make out of ``available`` matched tokens (see the class docstring)."""
        if available <= 0:
            return 0
        with self._lock:
            st = self._stats(workload, cls)
            a = self._acceptance(st)
            explore = st[2] < self.explore_tries
        t1 = cost.ms(1)
        if not t1 == t1:  # nothing measured yet: one proposal measures what a proposal costs
            return 1
        best_g, best = 0, 1.0 / max(t1, 1e-6)
        e, run = 1.0, 1.0
        for g in range(1, available + 1):
            run *= a[_pos_bucket(g)]
            e += run
            r = e / max(cost.ms(g + 1), 1e-6)
            if r > best:
                best_g, best = g, r
        if best_g == 0:
            with self._lock:
                st[3] += 1
                if explore or st[3] % self.explore_every == 0:
                    return 1
        return best_g

    def observe(self, workload: str, cls: tuple, proposed: int, accepted: int) -> None:
        """``accepted`` (<= ``proposed``) of ``proposed`` tokens of a ``cls`` match were accepted."""
        if proposed <= 0:
            return
        accepted = max(0, min(int(accepted), int(proposed)))
        with self._lock:
            st = self._stats(workload, cls)
            hits, tried = st[0], st[1]
            for b in range(POSITION_BUCKETS):
                hits[b] *= self.decay
                tried[b] *= self.decay
            for j in range(1, min(accepted + 1, proposed) + 1):
                tried[_pos_bucket(j)] += 1.0
                hits[_pos_bucket(j)] += 1.0 if j <= accepted else 0.0
            st[2] += 1

    def copy(self) -> "NgramGate":
        """An independent copy (what an evaluation decodes against, so it leaves no trace)."""
        new = NgramGate(self.decay, self.explore_tries, self.explore_every, self.max_workloads)
        with self._lock:
            for w, classes in self._w.items():
                new._w[w] = {c: [list(st[0]), list(st[1]), st[2], st[3]] for c, st in classes.items()}
        return new

    def status(self) -> dict[str, dict[str, dict]]:
        """Per workload and kind of match ("own/4" = the request's own tokens, a 4-5 token match):
        observations and the acceptance estimates [a_1, a_2, a_3-4, a_5+]."""
        with self._lock:
            return {w: {f"{c[0]}/{c[1]}": {"proposals": st[2], "acceptance": [round(x, 3) for x in self._acceptance(st)]}
                        for c, st in sorted(classes.items())} for w, classes in self._w.items()}


class NgramProposer:
    """Prompt-lookup / suffix proposals (see the module docstring).

    At each step, for n = max_n down to min_n: the continuation of the most recent earlier
    occurrence of the context's last n tokens in this request's own tokens, else in the
    workload's history; the first n that matches wins (longest match first). No match: no
    proposal (the step is a plain step). q is one-hot on each proposed token, (γ', V).

    With ``gate`` (and the decoder's ``cost``) the match's length backwards (up to 32 tokens)
    and its source pick an :class:`NgramGate` estimate, which cuts the proposal to the length
    that pays (possibly none); the accepted prefix, reported by :meth:`verified`, updates it.
    """

    name = "ngram"

    def __init__(self, history: NgramHistory, workload: str, vocab_size: int, device: torch.device | str = "cpu",
                 gate: NgramGate | None = None, cost: StepCost | None = None):
        if (gate is None) != (cost is None):
            raise ValueError("NgramProposer: a gate needs the step cost it weighs proposals against (pass both)")
        self.history, self.workload, self.vocab, self.device = history, workload, vocab_size, device
        self.gate, self.cost = gate, cost
        self.max_n, self.min_n = history.max_n, history.min_n
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence in ids
        self._indexed = 0  # ids[:e] n-grams with end e <= _indexed are in _index
        self._pending: tuple[tuple, int] | None = None  # (class, proposed) awaiting verification
        self.last_class: tuple | None = None  # the kind of match of the last proposal (None: no match)

    def start(self, ids: list[int], prefill: bool) -> None:
        self._index.clear()
        self._indexed = 0
        self._pending = None

    def _extend_index(self, ids: list[int], upto: int) -> None:
        """Index n-grams of ``ids`` ending at e for _indexed < e <= upto (each has ids[e])."""
        for end in range(max(1, self._indexed + 1), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(ids[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def match(self, ids: list[int], gamma: int) -> tuple[list[int], tuple | None]:
        """The longest-n match's continuation (up to γ tokens, cut before any id outside the
        target's vocabulary) and its :func:`match_class`; ([], None) without a match."""
        tokens, cls = self._longest(ids, gamma)
        # a history filled elsewhere (another tokenizer) must not propose ids the target lacks
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab), None)
        return (tokens[:bad] if bad is not None else tokens), cls

    def _longest(self, ids: list[int], gamma: int) -> tuple[list[int], tuple | None]:
        L = len(ids)
        # earlier occurrences end at e <= L - 1, so ids[e] exists and e != L (not the tail itself)
        self._extend_index(ids, L - 1)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            e = self._index.get(tuple(ids[L - n:]))
            if e is not None and e < L:
                return ids[e:e + gamma], match_class("own", _match_len(ids, L, ids, e, n, 32))
            tokens, m = self.history.lookup_match(self.workload, ids, gamma, n)
            if tokens:
                return tokens, match_class("hist", m)
        return [], None

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, gen: torch.Generator) -> Proposal:
        tokens: list[int] = []
        cls = None
        if gamma > 0:
            tokens, cls = self.match(ids, gamma)
        self.last_class = cls
        self._pending = None
        if self.gate is not None and tokens:
            # priced at the batch this step's rows are fused into (StepCost.fused_ms; 1 alone)
            cost = self.cost.at_batch(routed_batch_size()) if hasattr(self.cost, "at_batch") else self.cost
            tokens = tokens[: self.gate.length(self.workload, cls, len(tokens), cost)]
            if tokens:
                self._pending = (cls, len(tokens))
        q = torch.zeros((len(tokens), self.vocab), device=self.device)
        if tokens:
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(list(tokens), q)

    def verified(self, accepted: int) -> None:
        """The last proposal's accepted prefix (the decoder calls this after each verification):
        what the gate learns from."""
        if self._pending is not None:
            cls, proposed = self._pending
            self._pending = None
            self.gate.observe(self.workload, cls, proposed, accepted)

    def rollback(self, length: int) -> None:
        pass  # the index holds n-grams of verified tokens only (ids[: L - 1] at each proposal)


class NgramShadow:
    """Teaches an :class:`NgramGate` from the steps that proposed nothing (plain decoding, the
    draft's requests' plain steps, a match the gate turned down), at no verification cost.

    At such a step, the n-gram match the proposer would have made (up to ``tokens``) is kept; as
    the following steps emit tokens, its accepted prefix is read off them: the number of leading
    matched tokens equal to the emitted ones. For a one-hot proposal that is what verification
    would have accepted, in distribution: greedy, verification accepts x exactly when the target's
    argmax is x, which is the token plain decoding emits; sampled, it accepts x with probability
    p(x) (q(x) = 1), the probability that plain sampling emits x, and so on along the proposal
    (Leviathan et al. 2023, Algorithm 1). So every step of every request can teach the gate, and a
    kind of match it has turned down keeps being measured. One shadow at a time (a new one opens
    only after the last is settled), and a real proposal settles the open one first, so no token
    is counted twice.
    """

    def __init__(self, history: NgramHistory, workload: str, gate: NgramGate, vocab_size: int, tokens: int = 8):
        if not is_int(tokens) or tokens < 1:
            raise ValueError(f"NgramShadow: tokens={tokens!r} must be an int >= 1")
        self.matcher = NgramProposer(history, workload, vocab_size)
        self.gate, self.workload, self.tokens = gate, workload, tokens
        self._open: tuple[tuple, list[int], int] | None = None  # (class, matched tokens, where they start)

    def start(self, ids: list[int]) -> None:
        self.matcher.start(ids, False)
        self._open = None

    def idle_step(self, ids: list[int]) -> None:
        """The step about to run proposes nothing: remember what the n-gram proposer would have
        proposed (``ids``: all tokens so far, the pending one last)."""
        if self._open is None:
            toks, cls = self.matcher.match(ids, self.tokens)  # what the proposer itself would propose
            if toks:
                self._open = (cls, toks, len(ids))

    def proposing(self, ids: list[int]) -> None:
        """A real proposal is about to be verified: settle the open shadow on what ``ids`` has
        emitted so far (k of k right, or its mismatch), so the tokens the proposal covers are not
        counted twice."""
        self.settle(ids, final=True)

    def settle(self, ids: list[int], final: bool = False) -> None:
        """``ids`` has grown by a step's tokens: settle the open shadow once its fate is known
        (a mismatch, every matched token emitted, or ``final``: the request ended)."""
        if self._open is None:
            return
        cls, toks, at = self._open
        emitted = ids[at:at + len(toks)]
        k = 0
        while k < len(emitted) and emitted[k] == toks[k]:
            k += 1
        if k < len(emitted) or k == len(toks):  # a mismatch at k, or all matched
            self.gate.observe(self.workload, cls, len(toks), k)
            self._open = None
        elif final:
            if k:
                self.gate.observe(self.workload, cls, k, k)  # what was seen: k of k right
            self._open = None


def build(decoder, req) -> NgramProposer:
    """``decoder``'s n-gram proposer for ``req``: the served history and gate, or the request's own
    tokens only (``req.ngram_history`` off); no gate for a seeded sampled request."""
    history = decoder.ngram_history if req.ngram_history else NgramHistory(
        decoder.config.ngram_max_n, decoder.ngram_min_n, 1)  # empty: the request's own tokens only
    gate = decoder.ngram_gate
    if gate is not None and seeded_sampling(req.params):
        gate = None  # γ per step would follow step timings, and the seed would not reproduce the completion
    elif gate is not None and not req.ngram_history:
        gate = NgramGate()  # no past traffic: no past acceptance either
    return NgramProposer(history, req.workload, decoder.vocab_p, decoder.device, gate=gate,
                         cost=decoder.step_cost if gate is not None else None)


# prior_alpha 0.66: the mean over prose / code / math (0.84 / 0.67 / 0.48) of the accepted share of
# proposed tokens at ngram_min_n = 2 on never-served prompts, greedy, history empty (bench/RESULTS.md,
# "Consequence for the n-gram proposer"). It proposes only on a match; steps without one are plain.
SPEC = ProposerSpec("ngram", modelled_by="lengths", versioned_by=None, needs_features=False, model_free=True,
                    cli=True, build=build, prior_alpha=0.66)
