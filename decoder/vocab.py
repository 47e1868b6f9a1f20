"""FR-Spec draft vocabulary: the target's most frequent tokens (Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling").

The draft's LM head is restricted to these ids, so its per-token cost drops (the head is most of a
small draft's cost with a 49k vocabulary); q = 0 outside them. Lossless: the target still scores
the full vocabulary and verification corrects any token the draft cannot propose.

Frequencies are counted on text present on every machine (the standard library's pydoc topics and
Python sources), so no download is needed.
"""

from __future__ import annotations

import collections
import inspect

import torch


def corpus_texts(max_chars: int = 2_000_000) -> list[str]:
    """English prose (pydoc topics) and Python source (stdlib modules), up to ``max_chars``."""
    import importlib

    from pydoc_data.topics import topics

    texts, total = [], 0
    for k in sorted(topics):
        texts.append(topics[k])
        total += len(topics[k])
    for name in ("textwrap", "json.decoder", "argparse", "collections", "functools", "pathlib", "logging",
                 "dataclasses", "typing", "inspect", "statistics", "fractions", "csv", "email.message"):
        try:
            src = inspect.getsource(importlib.import_module(name))
        except (OSError, TypeError, ImportError):
            continue
        texts.append(src)
        total += len(src)
        if total > max_chars:
            break
    return texts


def frequent_token_ids(tokenizer, n: int, texts: list[str] | None = None) -> torch.Tensor:
    """(n,) int64 sorted ids of the n most frequent tokens in ``texts`` plus special tokens.

    Raises:
        ValueError: n < 1 or n larger than the vocabulary.
    """
    vocab = len(tokenizer)
    if not 1 <= n <= vocab:
        raise ValueError(f"draft_vocab={n}: must be in 1..{vocab} (the tokenizer's size)")
    counts: collections.Counter[int] = collections.Counter()
    for t in texts if texts is not None else corpus_texts():
        counts.update(tokenizer(t).input_ids)
    keep = set(tokenizer.all_special_ids)
    for tid, _ in counts.most_common():
        if len(keep) >= n:
            break
        keep.add(tid)
    for tid in range(vocab):  # fill up with the lowest ids (byte-level fallbacks) if the corpus ran short
        if len(keep) >= n:
            break
        keep.add(tid)
    return torch.tensor(sorted(keep), dtype=torch.long)
