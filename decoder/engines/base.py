"""The engine seam: what the decoder asks of whatever runs a model's forward passes.

An engine owns a model and its KV cache; the decoder asks it for one thing, over and over:
*feed these new tokens after the cached ones and give me the logits (and, if asked, the final
hidden states) at the last ``keep`` of them*, and, after verification, *forget every cached
position beyond n*. Speculative sampling, acceptance accounting and the records stay in the
decoder (:mod:`decoder.speculative`); only the forward passes move. What else an engine can do
(hidden states, LoRA adapters, batches, ...) it declares in :class:`Capabilities`.

One sequence per engine at a time: the decoder serves requests one at a time under its lock,
and :meth:`Engine.start` begins a request with an empty cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class EngineError(RuntimeError):
    """An engine cannot be built or run as asked; the message says what to change."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by the engine; the decoder asks this instead of its class."""

    hidden_states: bool  # forward(..., hidden=True) returns the final hidden states (keep, H)
    lora: bool  # GGUF LoRA adapters set per context (load_lora / set_lora / loras / lora)
    batch: bool  # several sequences at once (no engine yet: one sequence per engine)
    torch_module: bool  # its forwards run the decoder's own torch target (the decoder's kernels apply)
    own_threads: bool  # computes on its own thread pool (torch's intra-op threads held at 1 meanwhile)


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


def supports(engine, capability: str) -> bool:
    """Whether ``engine`` (None: no engine) declares ``capability`` (a :class:`Capabilities` field)."""
    caps = getattr(engine, "capabilities", None)
    return bool(caps is not None and getattr(caps, capability))
