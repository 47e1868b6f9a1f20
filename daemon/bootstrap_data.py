"""The data pipeline of ``daemonctl bootstrap``: the target's distributions on built-in text,
as VerifiedSamples handed to a sink (the CLI's sink streams them to the buffer and keeps them for
trainer.bootstrap).

Two sources: ``corpus`` scores documents teacher-forced, one target forward per 128-token window
(decoder.teacher); ``decode`` has the target generate from built-in prompts at gamma = 0, so every
position is a plain step carrying the target's top-k. The daemon is the one package that may use
decoder and trainer together, so the pipeline lives here, not in either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (description, total) -> advance(n): a progress task; the CLI passes rich's, tests a no-op.
Progress = Callable[[str, int], Callable[[int], None]]

WINDOW_TOKENS = 128  # corpus window length: one target forward each
TOPK = 32  # target top-k stored per position


def decode_prompts(pair: Any, fingerprint: Any, prompts: list, max_new_tokens: int, sink: Callable[[Any], None],
                   progress: Progress) -> None:
    """The target decodes each prompt at gamma = 0; the decoder hands every request's sample to ``sink``."""
    from decoder.speculative import DecodeRequest, SpeculativeDecoder

    dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, sink=sink, pair_fingerprint=fingerprint)
    advance = progress("target decoding prompts (gamma = 0)", len(prompts))
    for p in prompts:
        dec.generate(DecodeRequest(p.token_ids(pair.tokenizer), max_new_tokens=max_new_tokens, gamma=0, workload=p.workload))
        advance(1)


def score_corpora(pair: Any, fingerprint: Any, corpora: dict[str, list], corpus_tokens: int, precision: str,
                  sink: Callable[[Any], None], progress: Progress, on_empty: Callable[[str], None]) -> None:
    """The target scores up to ``corpus_tokens`` tokens of each workload's documents, teacher-forced;
    ``on_empty(workload)`` for a workload with no text (it is skipped)."""
    from decoder.teacher import corpus_windows, score_windows
    from trainer.distill import autocast_dtype

    for w, docs in corpora.items():
        items = corpus_windows(pair.tokenizer, docs, WINDOW_TOKENS, max_tokens=corpus_tokens)
        if not items:
            on_empty(w)
            continue
        advance = progress(f"target scoring the {w} corpus (positions)", sum(len(x) - 1 for _, x in items))
        label = "math" if w == "gsm8k" else w  # the served math prompts' workload tag
        ac = autocast_dtype(precision, next(pair.target.parameters()).device)
        for sample in score_windows(pair.target, items, label, fingerprint, k=TOPK, request_prefix="bootstrap",
                                    on_batch=advance, autocast_dtype=ac):
            sink(sample)
