"""Teacher-forced target distributions over text: the trainer's data without decoding.

A decoded token costs one target step (~10 tokens/s for SmolLM2-135M on 2 CPU cores); one
forward pass over a 128-token window gives the target's distribution at all 127 next-token
positions at once (~500 positions/s on the same cores, measured by ``bench/train_bench.py``),
which is what distillation needs. The records have ``source="prefill"`` (see
``store.schema.VerifiedSample``): row j is p(. | text[: j + 1]) at temperature 1, top-k plus the
tail mass.

Used by the bootstrap (``daemonctl bootstrap --source corpus``) over the built-in corpora of
``decoder.workloads``; served prompts get the same records from the decoder's own prefill
(``DecoderConfig.record_prompt``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch


def corpus_windows(tokenizer, docs: Iterable[tuple[str, str]], length: int = 128,
                   max_tokens: int | None = None) -> list[tuple[str, list[int]]]:
    """Tokenise documents ``(key, text)`` and cut them into ``(key, window)`` items, in order,
    until ``max_tokens`` tokens (None: all)."""
    out, total = [], 0
    for key, text in docs:
        for w in windows(tokenizer(text, add_special_tokens=False)["input_ids"], length):
            if max_tokens is not None and total >= max_tokens:
                return out
            out.append((key, w))
            total += len(w)
    return out


def windows(token_ids: Sequence[int], length: int, min_length: int = 16) -> list[list[int]]:
    """Split one document's ids into consecutive windows of ``length`` tokens; a last window
    shorter than ``min(min_length, length)`` is dropped (too little context to teach anything)."""
    if length < 2:
        raise ValueError(f"window length={length} must be >= 2 tokens")
    ids = list(token_ids)
    out = [ids[i : i + length] for i in range(0, len(ids), length)]
    return [w for w in out if len(w) >= max(2, min(min_length, length))]


def _by_length(items: Iterable[tuple[str, Sequence[int]]], min_len: int,
               error: Callable[[str, int], str]) -> dict[int, list[tuple[str, Sequence[int]]]]:
    """Items grouped by token length (batches need no padding); ValueError(error(key, n)) for
    an item shorter than ``min_len``."""
    by_len: dict[int, list[tuple[str, Sequence[int]]]] = {}
    for key, s in items:
        if len(s) < min_len:
            raise ValueError(error(key, len(s)))
        by_len.setdefault(len(s), []).append((key, s))
    return by_len


@torch.inference_mode()
def score_windows(
    target: torch.nn.Module,
    items: Iterable[tuple[str, Sequence[int]]],
    workload: str,
    pair_fingerprint,
    k: int = 32,
    batch_size: int = 8,
    request_prefix: str = "corpus",
    on_batch: Callable[[int], None] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> Iterator:
    """Yield one ``VerifiedSample(source="prefill")`` per ``(document key, window)`` item.

    The request id is ``"<request_prefix>:<workload>:<document key>"`` (all windows of one
    document share it, for tracing). The trainer's held-out split hashes each window's text
    (``trainer.service.split_key``); for a document-level split, split the documents first
    (``decoder.workloads.split_documents``), as ``bench/train_bench.py`` does.

    Windows of equal length are batched (no padding, so no attention mask subtleties): shape
    (B, L) in, logits (B, L - 1, V) kept, top-k (B, L - 1, k) out.

    Args:
        target: the target model (eval mode; its device is used).
        items: (document key, token-id window of >= 2 tokens).
        k: top-k width stored per position.
        on_batch: called with the number of positions scored after each batch (progress).
        autocast_dtype: run the target's forward under ``torch.autocast`` with this dtype (e.g.
            bfloat16 where the hardware multiplies it natively: ~2x faster scoring); the
            distributions are computed in fp32 from its logits. None = the model's own dtype.

    Raises:
        ValueError: a window shorter than 2 tokens or ``k < 1``.
    """
    from decoder.sampling import topk_rows as _topk_rows
    from store.schema import VerifiedSample

    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    device = next(target.parameters()).device
    by_len = _by_length(items, 2, lambda key, n: f"a window of {n} tokens (document {key!r}) has no next-token "
                                               f"position; need >= 2")
    n = 0
    for length, group in sorted(by_len.items()):
        for i in range(0, len(group), batch_size):
            t0 = time.time()
            chunk = group[i : i + batch_size]
            x = torch.tensor([w for _, w in chunk], device=device)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                logits = target(input_ids=x).logits[:, :-1]
            top_ids, top_p, tail = _topk_rows(logits.float(), k)  # (B, L - 1, k), (B, L - 1)
            for b in range(x.shape[0]):
                n += 1
                yield VerifiedSample(
                    request_id=f"{request_prefix}:{workload}:{chunk[b][0]}",
                    workload=workload,
                    adapter_version=0,
                    pair=pair_fingerprint,
                    prompt_ids=x[b, :1].cpu().numpy(),
                    output_ids=x[b, 1:].cpu().numpy(),
                    proposal_lens=np.zeros(0),
                    rejection_pos=np.zeros(0),
                    topk_ids=top_ids[b].numpy(),
                    topk_probs=top_p[b].numpy(),
                    tail_mass=tail[b].numpy(),
                    started_at=t0,
                    finished_at=time.time(),
                    source="prefill",
                )
            if on_batch is not None:
                on_batch(x.shape[0] * (length - 1))


def score_windows_engine(
    engine,
    items: Iterable[tuple[str, Sequence[int]]],
    workload: str,
    pair_fingerprint,
    k: int = 32,
    request_prefix: str = "corpus",
    on_batch: Callable[[int], None] | None = None,
) -> Iterator:
    """:func:`score_windows` on an engine (``decoder.engine``: llama.cpp on CPU), one window per forward.

    The served target itself scores the text (llama.cpp's kernels on the GGUF, not the torch copy
    dequantised from it), with logits kept at every position: a window of L tokens in, logits
    (L, V) out, top-k (L - 1, k) + tail mass kept. The records are those of :func:`score_windows`.

    Raises:
        ValueError: a window shorter than 2 tokens or ``k < 1``.
        decoder.engine.EngineError: a window longer than the engine's context.
    """
    from decoder.sampling import topk_rows as _topk_rows
    from store.schema import VerifiedSample

    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    for key, w in items:
        if len(w) < 2:
            raise ValueError(f"a window of {len(w)} tokens (document {key!r}) has no next-token position; need >= 2")
        t0 = time.time()
        seq = engine.start()
        logits = seq.forward(list(w), keep=len(w))  # (L, V)
        top_ids, top_p, tail = _topk_rows(logits[:-1].float(), k)  # (L - 1, k), (L - 1,)
        x = np.asarray(w)
        yield VerifiedSample(
            request_id=f"{request_prefix}:{workload}:{key}", workload=workload, adapter_version=0, pair=pair_fingerprint,
            prompt_ids=x[:1], output_ids=x[1:], proposal_lens=np.zeros(0), rejection_pos=np.zeros(0),
            topk_ids=top_ids.numpy(), topk_probs=top_p.numpy(), tail_mass=tail.numpy(),
            started_at=t0, finished_at=time.time(), source="prefill",
        )
        if on_batch is not None:
            on_batch(len(w) - 1)


@torch.inference_mode()
def continue_windows(
    target: torch.nn.Module,
    items: Iterable[tuple[str, Sequence[int]]],
    new_tokens: int,
    batch_size: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> list[tuple[str, list[int]]]:
    """The target's own continuations of text: ``(key, prompt + new_tokens generated ids)`` per item.

    Training on what the target itself writes puts the draft on the distribution it meets when
    serving (the on-policy data of DistillSpec, Zhou et al. 2024, Sec. 3 and Table 2); the
    returned windows go to :func:`score_windows` for their teacher distributions. Prompts of
    equal length are batched without padding (shape (B, P) in, (B, P + new_tokens) out) through a
    KV-cached loop; end-of-sequence ids (the model's ``eos_token_id``) are never chosen, so every
    window has the same length.
    Batched generation runs at ~140 tokens/s for SmolLM2-135M with B = 32 on 2 CPU cores, against
    ~10 tokens/s for one request.

    Args:
        target: the target model (its device is used).
        items: (key, prompt ids of >= 1 token).
        new_tokens: tokens generated per prompt (>= 1).
        temperature: 0 = greedy (the continuation greedy serving produces), else sampling at it.
        seed: seed of a private ``torch.Generator`` for sampling (the global RNG is untouched).
            Sampled tokens depend on the batch a prompt lands in, as with any batched sampler.
        on_batch: called with the number of tokens generated after each batch.

    Raises:
        ValueError: ``new_tokens`` < 1, ``batch_size`` < 1, a negative or non-finite temperature,
            or an empty prompt.
    """
    import math

    from transformers import DynamicCache

    if new_tokens < 1 or batch_size < 1:
        raise ValueError(f"new_tokens={new_tokens}, batch_size={batch_size}: both must be >= 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature={temperature}: must be a finite number >= 0 (0 = greedy)")
    device = next(target.parameters()).device
    by_len = _by_length(items, 1, lambda key, n: f"an empty prompt (item {key!r}) cannot be continued")
    # Our own loop rather than target.generate: the model's generation_config (repetition
    # penalty, forced or banned tokens, ...) would make the text something other than p's own.
    eos = set()
    for src in (getattr(getattr(target, "generation_config", None), "eos_token_id", None),
                getattr(target.config, "eos_token_id", None)):
        eos.update([src] if isinstance(src, int) else list(src or []))
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)  # the global RNG is not touched
    out = []
    for length, group in sorted(by_len.items()):
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            x = torch.tensor([list(s) for _, s in chunk], device=device)  # (B, P), no padding
            cache = DynamicCache(config=target.config)
            logits = target(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
            new = []
            for t in range(new_tokens):
                logits = logits.float()
                logits[:, eos_ids] = float("-inf")
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1).cpu()
                    nxt = torch.multinomial(probs, 1, generator=gen).to(device)  # (B, 1)
                else:
                    nxt = logits.argmax(-1, keepdim=True)
                new.append(nxt)
                if t + 1 < new_tokens:
                    logits = target(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            y = torch.cat([x, *new], dim=1)  # (B, P + new_tokens)
            out += [(key, y[b].tolist()) for b, (key, _) in enumerate(chunk)]
            if on_batch is not None:
                on_batch(len(chunk) * new_tokens)
    return out
