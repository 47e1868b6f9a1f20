"""Proposers: what suggests the γ tokens that the target verifies.

A proposer turns the request's tokens so far into a :class:`Proposal`: up to γ token ids and the
distributions q they were drawn from. Verification (:func:`decoder.sampling.verify`) is lossless
for any q, so a proposer only moves acceptance and cost, never the output distribution.

- :class:`DraftModelProposer` (``"draft"``): a small causal LM (the derived draft, its LoRA
  adapters merged), autoregressive over its own KV cache; q is its processed distribution.
- :class:`NgramProposer` (``"ngram"``): prompt-lookup / suffix decoding (Saxena 2023, "Prompt
  Lookup Decoding"; Oliaro et al. 2024, "SuffixDecoding"): the continuation of the longest
  recent match of the context's last n tokens, looked up in the request itself and in the
  workload's own past requests (:class:`NgramHistory`). It runs no model (c ≈ 0), and adapts as
  fast as traffic arrives: every finished request is indexed at once. Its proposals are
  deterministic, so q is one-hot and a proposal x is accepted with probability p(x)
  (min(1, p/q) with q(x) = 1), the residual being p with x removed; α = E[p(x)].

Adding a proposer is one class with ``name``, ``start``, ``propose`` and ``rollback`` (see
:class:`Proposer`); the decoder builds one per request (``SpeculativeDecoder.make_proposer``)
and indexes every finished request into its :class:`NgramHistory` itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

import torch

from decoder.sampling import SamplingParams, process_logits, sample

PROPOSERS = ("draft", "ngram")


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


class NgramHistory:
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
            w = self._w.pop(workload, None) or _WorkloadIndex()
            self._w[workload] = w
            while len(self._w) > self.max_workloads:
                self._w.popitem(last=False)
            w.add(tokens, self.min_n, self.max_n, self.max_tokens)

    def lookup(self, workload: str, key: tuple[int, ...], gamma: int) -> list[int]:
        """The up-to-γ tokens that followed ``key``'s most recent occurrence, or []."""
        with self._lock:
            w = self._w.get(workload)
            return w.lookup(key, gamma) if w is not None else []

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

    def clear(self, workload: str | None = None) -> None:
        with self._lock:
            if workload is None:
                self._w.clear()
            else:
                self._w.pop(workload, None)

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

    def lookup(self, key: tuple[int, ...], gamma: int) -> list[int]:
        hit = self.index.get(key)
        if hit is None or hit[0] not in self.by_seq:
            return []
        seq, end = hit
        return self.by_seq[seq][end:end + gamma]


class NgramProposer:
    """Prompt-lookup / suffix proposals (see the module docstring).

    At each step, for n = max_n down to min_n: the continuation of the most recent earlier
    occurrence of the context's last n tokens in this request's own tokens, else in the
    workload's history; the first n that matches wins (longest match first). No match: no
    proposal (the step is a plain step). q is one-hot on each proposed token, (γ', V).
    """

    name = "ngram"

    def __init__(self, history: NgramHistory, workload: str, vocab_size: int, device: torch.device | str = "cpu"):
        self.history, self.workload, self.vocab, self.device = history, workload, vocab_size, device
        self.max_n, self.min_n = history.max_n, history.min_n
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence in ids
        self._indexed = 0  # ids[:e] n-grams with end e <= _indexed are in _index

    def start(self, ids: list[int], prefill: bool) -> None:
        self._index.clear()
        self._indexed = 0

    def _extend_index(self, ids: list[int], upto: int) -> None:
        """Index n-grams of ``ids`` ending at e for _indexed < e <= upto (each has ids[e])."""
        for end in range(max(1, self._indexed + 1), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._index[tuple(ids[end - n:end])] = end
        self._indexed = max(self._indexed, upto)

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, gen: torch.Generator) -> Proposal:
        tokens: list[int] = []
        L = len(ids)
        if gamma > 0:
            # earlier occurrences end at e <= L - 1, so ids[e] exists and e != L (not the tail itself)
            self._extend_index(ids, L - 1)
            for n in range(min(self.max_n, L), self.min_n - 1, -1):
                key = tuple(ids[L - n:])
                e = self._index.get(key)
                if e is not None and e < L:
                    tokens = ids[e:e + gamma]
                    break
                tokens = self.history.lookup(self.workload, key, gamma)
                if tokens:
                    break
        # a history filled elsewhere (another tokenizer) must not propose ids the target lacks
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab), None)
        if bad is not None:
            tokens = tokens[:bad]
        q = torch.zeros((len(tokens), self.vocab), device=self.device)
        if tokens:
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(list(tokens), q)

    def rollback(self, length: int) -> None:
        pass  # the index holds n-grams of verified tokens only (ids[: L - 1] at each proposal)


def crop_to(cache, length: int) -> None:
    """Drop cached positions beyond ``length``: an engine sequence's ``truncate`` (see
    :mod:`decoder.engine`), or a transformers cache (transformers 5: ``crop(-n)`` removes n)."""
    if hasattr(cache, "truncate"):
        cache.truncate(length)
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
