"""The engine seam: what the decoder asks of whatever runs a model's forward passes.

An engine owns a model and its KV cache; the decoder asks it for one thing, over and over:
*feed these new tokens after the cached ones and give me the logits (and, if asked, the final
hidden states) at the last ``keep`` of them*, and, after verification, *forget every cached
position beyond n*. Speculative sampling, acceptance accounting and the records stay in the
decoder (:mod:`decoder.speculative`); only the forward passes move. What else an engine can do
(hidden states, LoRA adapters, batches, ...) it declares in :class:`Capabilities`.

One sequence per engine at a time unless the engine declares ``Capabilities.batch``: the decoder
serves requests one at a time under its lock, and :meth:`Engine.start` begins a request with an
empty cache. A batched engine (``batch=True``, ``max_sequences`` > 1) holds up to
``max_sequences`` sequences at once, each :meth:`Engine.start` taking a free one, and runs the rows
of several sequences in one forward (``forward_batch``); a sequence a request no longer needs is
given back with ``release()`` (:func:`sequence_scope` releases those a request started), and a
forward on a thread that a step scheduler drives (:func:`route_forwards`) is queued there and run
in the next batched forward (:mod:`decoder.batching`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Protocol


class EngineError(RuntimeError):
    """An engine cannot be built or run as asked; the message says what to change."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by the engine; the decoder asks this instead of its class."""

    hidden_states: bool  # forward(..., hidden=True) returns the final hidden states (keep, H)
    lora: bool  # GGUF LoRA adapters set per context (load_lora / set_lora / loras / lora)
    batch: bool  # several sequences at once (forward_batch; llama.cpp built with n_seq > 1)
    torch_module: bool  # its forwards run the decoder's own torch target (the decoder's kernels apply)
    own_threads: bool  # computes on its own thread pool (torch's intra-op threads held at 1 meanwhile)
    max_sequences: int = 1  # sequences it holds at once (> 1 only with batch)
    prompt_cache: bool = False  # start(prefix=...) keeps the cached cells of a common prefix (Sequence.length)


class Sequence(Protocol):
    """One request's KV state inside an engine."""

    length: int  # tokens in the cache

    def forward(self, tokens: list[int], keep: int, hidden: bool = False):
        """Append ``tokens`` (n >= 1) to the cache; return logits (keep, V) float32 at the last
        ``keep`` <= n of them, and with ``hidden`` also their final hidden states (keep, H)
        as a tuple (logits, hidden)."""

    def truncate(self, length: int) -> None:
        """Drop cached positions >= ``length`` (the verification's rejected tail)."""


class Engine(Protocol):
    name: str  # "torch" | "llamacpp"
    vocab_size: int  # V: rows of the LM head
    hidden_size: int  # H
    context_length: int | None  # tokens the model attends over, None = unknown
    eos_ids: frozenset[int]
    capabilities: Capabilities

    def start(self) -> Sequence:
        """A new request's sequence (empty cache)."""

    def describe(self) -> dict:
        """What runs, for records and status: engine, model, threads, dtype."""


_local = threading.local()  # per thread: the sequences a request started, and its forward router


def track(seq) -> None:
    """Called by an engine's ``start()``: ``seq`` is released when the enclosing
    :func:`sequence_scope` on this thread ends (nothing without one)."""
    seqs = getattr(_local, "seqs", None)
    if seqs is not None:
        seqs.append(seq)


@contextlib.contextmanager
def sequence_scope():
    """Every sequence an engine starts on this thread inside the block is released at its end
    (a request's target sequence and its draft's: their slots in a batched engine are free again)."""
    prev = getattr(_local, "seqs", None)
    _local.seqs = []
    try:
        yield
    finally:
        seqs, _local.seqs = _local.seqs, prev
        for s in seqs:
            release = getattr(s, "release", None)
            if release is not None:
                release()


@contextlib.contextmanager
def route_forwards(router):
    """Inside the block, a batched engine's ``Sequence.forward`` on this thread calls
    ``router.call(engine, seq, tokens, keep, hidden)`` instead of decoding at once (the step
    scheduler of :mod:`decoder.batching` fuses the calls of several requests into one forward)."""
    prev = getattr(_local, "router", None)
    _local.router = router
    try:
        yield
    finally:
        _local.router = prev


def forward_router():
    """The router :func:`route_forwards` set on this thread, or None."""
    return getattr(_local, "router", None)


def last_fused_size() -> int:
    """Sequences in the fused forward that served this thread's last forward (continuous
    batching; 1 alone)."""
    router = forward_router()
    return max(1, int(router.last_batch_size())) if router is not None else 1


def _ask_router(method: str, default, *args):
    """``method(*args)`` of the router this thread's forwards go to, or ``default`` outside one (or
    on a router without it)."""
    router = forward_router()
    fn = getattr(router, method, None) if router is not None else None
    return fn(*args) if fn is not None else default


def last_fused_rows() -> int | None:
    """Rows (tokens fed, all its sequences') of the fused forward that served this thread's last
    forward (continuous batching); None alone or unknown."""
    n = _ask_router("last_fused_rows", None)
    return int(n) if n else None


def note_emitted(n: int) -> None:
    """Tell the router this thread's forwards go to (the step scheduler) that its request emitted
    ``n`` tokens in a step (what it measures a batch's goodput by); nothing outside a batch."""
    _ask_router("emitted", None, n)


def routed_speculation_pays(batch: int) -> tuple[bool | None, str]:
    """Whether speculating pays in a batch of ``batch`` requests, as the step scheduler this thread's
    forwards go to has measured it (``StepScheduler.speculation_pays``): (True, "alone") outside one."""
    return _ask_router("speculation_pays", (True, "alone"), batch)


def routed_batch_size() -> int:
    """Requests decoding together in the batch this thread's forwards are fused into (the step
    scheduler's members, :mod:`decoder.batching`; the size of the next fused forward, give or
    take a request joining or finishing at the boundary); 1 outside a batch."""
    router = forward_router()
    if router is None:
        return 1
    members = getattr(router, "members", None)
    n = len(members) if members is not None else router.last_batch_size()
    return max(1, int(n))


def supports(engine, capability: str) -> bool:
    """Whether ``engine`` (None: no engine) declares ``capability`` (a :class:`Capabilities` field)."""
    caps = getattr(engine, "capabilities", None)
    return bool(caps is not None and getattr(caps, capability, False))
