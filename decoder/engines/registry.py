"""Choosing an engine: ``models.engine = auto | torch | llamacpp`` (:func:`choose_engine`).

``auto`` takes llama.cpp for a GGUF target on CPU when llama-cpp-python is installed, and says why
in :attr:`EngineChoice.reason` (the decoder puts the engine's name in every record).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from decoder.engines.base import Engine, EngineError, supports
from decoder.engines.llamacpp import LlamaCppEngine
from decoder.engines.llamacpp_lib import llamacpp_available

ENGINES = ("auto", "torch", "llamacpp")


@dataclass
class EngineChoice:
    """The engine a decoder runs its target (and draft) on, and why."""

    name: str  # "torch" | "llamacpp"
    reason: str
    target: Engine | None = None  # None: the decoder wraps its torch target itself
    draft: Engine | None = None  # the draft on llama.cpp (the derived draft's GGUF), else None
    served: Any = None  # decoder.models.formats.FormatChoice: the target's weight format on llama.cpp, else None

    @property
    def served_format(self) -> str | None:
        """The served weight format's name (``"packaged"``, ``"F16"``, ...), what records carry; None off llama.cpp."""
        return self.served.format if self.served is not None else None


@contextlib.contextmanager
def torch_threads_for(engine):
    """While decoding on a llama.cpp ``engine``: torch's intra-op threads at 1, restored after.

    On llama.cpp the decoder's own torch work per step is vector math over a vocabulary row or
    a few (processing, sampling, the acceptance test); with torch's default threads, its OpenMP
    workers kept spinning after each of those small ops and took the cores from llama.cpp's
    thread pool: measured (2 cores, Xeon), our plain decoding 58-77 tokens/s against 148-157 with
    one torch thread, llama.cpp's own generation 146 in the same build. torch's thread count is
    process-wide: a process that also trains in torch (the demo) chooses its own.
    """
    if not supports(engine, "own_threads") or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def target_gguf(target: str) -> Path | None:
    """The GGUF behind a target reference: a built-in name's packaged file (``name@FORMAT``: the
    packaged file requantised, :func:`decoder.models.loading.packaged_target`), or a ``.gguf`` path; None
    for anything else (a transformers directory or hub id)."""
    from decoder.models.loading import packaged_target

    gguf = packaged_target(target)
    if gguf is not None:
        return gguf
    p = Path(target).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def choose_engine(choice: str, target: str, device: str = "cpu", draft: str = "layers:0-3",
                  threads: int | None = None, embeddings: bool = False, target_format: str = "packaged",
                  proposers: Sequence[str] | None = None, progress=None, n_seq: int = 1,
                  draft_vocab=None, v_cache: str = "auto", format_max_seconds: float | None = None) -> EngineChoice:
    """Resolve ``models.engine`` for a target.

    ``auto``: llama.cpp when the target is a GGUF (a built-in name or a ``.gguf`` path), the
    device is the CPU and llama-cpp-python imports; torch otherwise. ``llamacpp`` insists (and
    raises where it cannot); ``torch`` never builds a llama.cpp context. On llama.cpp a derived
    draft (``layers:<spec>``) runs there too, from a GGUF of those blocks
    (:func:`decoder.models.gguf_export.derived_draft_gguf`, written once and cached). ``n_seq``:
    sequences each llama.cpp engine holds at once (``LlamaCppEngine(n_seq=...)``, serve's
    ``serve.max_batch``); a torch choice ignores it. ``draft_vocab``: the FR-Spec restricted ids
    ((V',) tensor, ``decoder.vocab.frequent_token_ids``; ``DecoderConfig.draft_vocab`` must be the
    same) or None: a derived draft on llama.cpp is then the restricted GGUF of those ids
    (:func:`decoder.models.gguf_export.restricted_draft_gguf`: a V'-row LM head, inputs fed as
    embeddings), whose step costs a fraction of the full-head draft's (bench/RESULTS.md).
    ``v_cache``: every llama.cpp engine's V cache type (``LlamaCppEngine(v_cache=...)``, ``models.v_cache``).

    ``target_format`` (``models.format``) picks the weight format a built-in target is served in on
    llama.cpp (:func:`decoder.models.formats.resolve_format`): ``"packaged"`` (this function's
    default: no measurement), ``"auto"`` (measured once per host and cached, then chosen by expected
    goodput for ``proposers``, default every proposer with a prior α) or a pinned llama.cpp format; :attr:`EngineChoice.served` says which
    and why. ``format_max_seconds`` (``models.format_max_seconds``): the ``auto`` measurement's time
    budget in seconds; None = scaled to the host (:func:`decoder.models.formats.scaled_budget`). A
    derived draft stays derived from the packaged file (the trainer's weights).

    Raises:
        EngineError: ``llamacpp`` asked for a non-GGUF target, a GPU device, or without
            llama-cpp-python; an unknown choice.
    """
    if choice not in ENGINES:
        raise EngineError(f"engine {choice!r}: use one of {ENGINES}")
    if choice == "torch":
        return EngineChoice("torch", "asked for (models.engine=torch)")
    gguf = target_gguf(target)
    why_not = None
    if gguf is None:
        why_not = f"target {target!r} is not a GGUF file"
    elif device != "cpu":
        why_not = f"device {device!r} (llama.cpp is used here for CPU serving only)"
    elif not llamacpp_available():
        why_not = "llama-cpp-python is not installed (scripts/install builds it)"
    if why_not:
        if choice == "llamacpp":
            raise EngineError(f"--engine llamacpp: {why_not}; use --engine torch or auto")
        return EngineChoice("torch", f"auto: {why_not}")
    served = None
    if target_format is not None:
        from decoder.models.formats import check_pinned_rows, resolve_format

        try:
            served = resolve_format(target_format, target, threads, draft, proposers, progress=progress,
                                    max_seconds=format_max_seconds)
        except ValueError as e:  # the setting's value: the message names it and the valid ones
            raise EngineError(str(e)) from e
    tgt = LlamaCppEngine(served.path if served is not None else gguf, threads=threads, embeddings=embeddings, n_seq=n_seq,
                         v_cache=v_cache)
    if served is not None:  # a format the measurement did not choose: are its verification rows the same bits?
        check_pinned_rows(served, tgt)
    dr = None
    if draft.startswith("layers:"):
        from decoder.models.gguf_export import derived_draft_gguf
        from decoder.models.loading import parse_layers

        layers = parse_layers(draft.split(":", 1)[1], _block_count(tgt))
        path = derived_draft_gguf(gguf, layers)
        if draft_vocab is not None:
            from decoder.models.gguf_export import restricted_draft_gguf

            path = restricted_draft_gguf(path, draft_vocab)
        dr = LlamaCppEngine(path, n_ctx=tgt.context_length, threads=threads, n_seq=n_seq, v_cache=v_cache)
    elif draft == "self":  # its own context: one sequence per context
        dr = LlamaCppEngine(tgt.path, n_ctx=tgt.context_length, threads=threads, n_seq=n_seq, v_cache=v_cache)
    reason = ("asked for (models.engine=llamacpp)" if choice == "llamacpp"
              else f"auto: GGUF target {gguf.name} on CPU, llama-cpp-python installed")
    if served is not None and (served.setting != "packaged" or Path(served.path) != gguf):
        reason += f"; serving {served.format} ({Path(served.path).name}): {served.reason}"
    return EngineChoice("llamacpp", reason, tgt, dr, served)


def _block_count(engine: LlamaCppEngine) -> int:
    return int(engine.L.llama_model_n_layer(engine.model))
