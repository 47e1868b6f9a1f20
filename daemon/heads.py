"""The daemon's wiring of the feature-level head (the ``"eagle"`` proposer): the trainer's head
turns (:class:`trainer.heads.HeadTrainer`, built on the loaded pair's target: trainer/ imports
nothing of decoder/, so the daemon hands the head's constructors over), and the head's v0,
bootstrapped on the built-in corpora once per pair and cached (:func:`ensure_head_v0`), so that
adaptation starts from a head that already proposes, not from EAGLE's random initialisation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from store.registry import HEAD_FILE

if TYPE_CHECKING:
    from daemon.settings import Settings

log = structlog.get_logger(__name__)

HEAD_VOCAB = 8192  # the head's LM head cut to this many most frequent tokens (bench/RESULTS.md, issue 20)


def head_trainer(settings: Settings, client, pair, scfg, head_dir: Path | None = None, work_dir: Path | None = None,
                 steps: int | None = None):
    """The trainer's head turns (``trainer.heads``): a :class:`trainer.heads.HeadTrainer` on the
    head registry under ``head_dir`` (default ``settings.head_dir``), building heads on
    ``pair.target`` with its LM head cut to the :data:`HEAD_VOCAB` most frequent tokens,
    ``steps`` optimiser steps a turn (default ``trainer.head_steps``)."""
    from decoder.eagle import EagleHead, load_head, save_head
    from store import AdapterRegistry
    from trainer.distill import autocast_dtype
    from trainer.heads import HeadConfig, HeadTrainer

    target = pair.target
    vocab = head_vocab(pair)
    return HeadTrainer(
        AdapterRegistry(client, head_dir or settings.head_dir, scfg, kind="head"),
        new_head=lambda: EagleHead.from_target(target, vocab),
        load=lambda path: load_head(target, path),
        save=lambda head, path, meta: save_head(head, path, target, meta),
        vocab_size=int(target.get_output_embeddings().weight.shape[0]),
        config=HeadConfig(steps=steps or settings.trainer.head_steps, promote_margin=settings.trainer.promote_margin,
                          regress_margin=settings.trainer.regress_margin),
        work_dir=work_dir or settings.state_dir,
        autocast=autocast_dtype(settings.trainer.precision, next(target.parameters()).device),
    )


# -- v0: a head bootstrapped on the built-in corpora, cached per pair -----------------------------

HEAD_FORMAT = 1  # bump when the head bootstrap's data or training changes meaning: older caches are ignored


@dataclass(frozen=True)
class HeadBootstrapConfig:
    """What the v0 head is distilled from, and its budget (the README's table, "The head's v0").

    The corpora, split and exclusions are the draft's v0's (``daemon.warm_start``: whole
    documents held out, never the demo's evaluation prompts); the torch target scores them with
    its final hidden states kept (``decoder.eagle.score_features``)."""

    enabled: bool = True
    workloads: tuple[str, ...] = ("prose", "code", "math")
    corpus_tokens: int = 12_000  # scored training tokens per workload
    heldout_tokens: int = 2_048  # scored held-out tokens per workload
    heldout_fraction: float = 0.1
    train_seconds: float = 150.0  # training wall seconds (scoring not counted)
    max_steps: int = 3000
    lr: float = 2e-3  # bench/eagle_bench.py's
    batch: int = 8
    unroll: int = 2


def head_cache_key(fingerprint_key: str, cfg: HeadBootstrapConfig, vocab) -> str:
    """16 hex digits of sha256 over everything that shapes the bootstrapped head."""
    ids = [int(x) for x in vocab.tolist()] if vocab is not None else []
    blob = json.dumps({"format": HEAD_FORMAT, "pair": fingerprint_key, "config": dataclasses.asdict(cfg),
                       "vocab": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_head_v0(pair, fingerprint, registry, cfg: HeadBootstrapConfig, precision: str = "auto",
                   progress: Callable[[str], None] = lambda m: None):
    """Make a bootstrapped head the active shared version of an empty head registry, as
    :func:`daemon.warm_start.ensure_v0` does for the draft: trained once per cache key
    (``<cache>/bootstrap-head/<key>/head.safetensors`` + ``meta.json``), registered and promoted
    from the cache in seconds after that. A registry with history is left alone.

    Returns a ``daemon.warm_start.WarmStart``. Never raises for a failed bootstrap (no corpus
    text, non-finite training): the start goes on without a head and the reason says why.
    Registry errors propagate (Redis is required).
    """
    from daemon.warm_start import WarmStart, _history, _key_lock, bootstrap_cache_root

    if not cfg.enabled:
        return WarmStart("disabled", None, "no head v0: bootstrap disabled")
    history = _history(registry)
    if history is not None:
        return history
    vocab = head_vocab(pair)
    key = head_cache_key(fingerprint.key(), cfg, vocab)
    d = bootstrap_cache_root().parent / "bootstrap-head" / key
    with _key_lock(d):
        history = _history(registry)
        if history is not None:
            return history
        meta = _cached_head(d, pair.target)
        source = "cache"
        if meta is None:
            progress(f"bootstrapping the head's v0 on the built-in corpora (once for this pair: cache {d})")
            try:
                meta = _train_head_v0(pair, vocab, cfg, precision, d, progress)
            except Exception as e:  # noqa: BLE001 - no corpus, bad files: start without a head
                log.warning("head_bootstrap_failed", error=f"{type(e).__name__}: {e}")
                return WarmStart("failed", None, f"head bootstrap failed ({type(e).__name__}: {e}): no head until "
                                                 f"the trainer promotes one")
            source = "trained"
        from store.registry import AdapterMeta

        v = registry.register(d, AdapterMeta(parent=0, alpha_before=0.0, alpha_after=meta["alpha"],
                                             alpha_after_by_workload=meta["alpha_by_workload"],
                                             tokens_trained=meta["positions"]))
        try:
            registry.promote(v, f"v0: head bootstrapped on the built-in corpora ({source}), held-out α {meta['alpha']:.3f}")
        except Exception as e:
            registry.set_state(v, "rejected", f"v0 could not be promoted: {e}")
            shutil.rmtree(d, ignore_errors=True)  # the next start bootstraps it again
            raise
        return WarmStart(source, v, f"head v{v} from the {source} bootstrap: held-out teacher-forced α "
                                    f"{meta['alpha']:.3f} after {meta['steps']} steps", str(d), meta)


def head_vocab(pair):
    """(HEAD_VOCAB,) int64 ids the head's LM head keeps (``decoder.vocab.frequent_token_ids``)."""
    from decoder.vocab import frequent_token_ids

    return frequent_token_ids(pair.tokenizer, min(HEAD_VOCAB, len(pair.tokenizer)))


def _cached_head(d: Path, target) -> dict | None:
    """The cache entry's meta when ``d`` holds a usable head for ``target`` (readable meta, a
    safetensors file of finite tensors that loads onto the target); else None, the entry removed
    (a truncated or foreign file is bootstrapped again, not promoted on every start)."""
    from decoder.eagle import load_head
    from store.registry import safetensors_problem

    if not d.exists():
        return None
    try:
        meta = json.loads((d / "meta.json").read_text())
        ok = {"alpha", "steps", "positions", "alpha_by_workload"} <= set(meta)
        problem = safetensors_problem(d / HEAD_FILE) if ok else "meta.json lacks fields"
        if problem is None:
            load_head(target, d / HEAD_FILE)
            return meta
    except (OSError, ValueError) as e:
        problem = str(e)
    log.warning("head_bootstrap_cache_unusable", cache=str(d), error=problem)
    shutil.rmtree(d, ignore_errors=True)
    return None


def _train_head_v0(pair, vocab, cfg: HeadBootstrapConfig, precision: str, d: Path, progress) -> dict:
    import statistics

    import torch

    from daemon.bootstrap_data import TOPK, WINDOW_TOKENS
    from decoder.eagle import EagleHead, save_head, score_features
    from decoder.teacher import corpus_windows
    from decoder.workloads import bootstrap_documents, split_documents
    from trainer.distill import autocast_dtype
    from trainer.head import HeadDistiller, column_map, groups, head_batch, heldout_alpha

    target = pair.target
    ac = autocast_dtype(precision, next(target.parameters()).device)
    train, held = [], {}
    t0 = time.perf_counter()
    for w in cfg.workloads:
        docs = bootstrap_documents(w)
        if not docs:
            continue
        tr, he = split_documents(docs, cfg.heldout_fraction)
        tw = [x for _, x in corpus_windows(pair.tokenizer, tr, WINDOW_TOKENS, max_tokens=cfg.corpus_tokens)]
        hw = [x for _, x in corpus_windows(pair.tokenizer, he, WINDOW_TOKENS, max_tokens=cfg.heldout_tokens)]
        progress(f"head bootstrap: the target scores {sum(map(len, tw)) + sum(map(len, hw))} {w} tokens with hidden states")
        train += score_features(target, tw, TOPK, autocast_dtype=ac)
        held[w] = score_features(target, hw, TOPK, autocast_dtype=ac)
    if not train or not any(held.values()):
        raise ValueError(f"no corpus text for {cfg.workloads} (decoder.workloads.bootstrap_documents)")
    score_s = time.perf_counter() - t0
    col = column_map(vocab, int(target.get_output_embeddings().weight.shape[0]))
    held_b = {w: [head_batch(g, col) for g in groups(it, 8)] for w, it in held.items() if it}
    head = EagleHead.from_target(target, vocab)
    dist = HeadDistiller(head, train, col, lr=cfg.lr, batch=cfg.batch, unroll=cfg.unroll, total_steps=cfg.max_steps,
                         autocast=ac)
    t_end = time.perf_counter() + cfg.train_seconds
    while dist.steps < cfg.max_steps and time.perf_counter() < t_end:
        if dist.steps == 20:  # the cosine over the steps the pace predicts
            dist.total_steps = max(21, min(cfg.max_steps, int(20 * cfg.train_seconds / max(dist.train_s, 1e-3))))
        dist.step()
        if dist.steps % 200 == 0:
            progress(f"head bootstrap: {dist.steps} steps")
    per = {w: round(heldout_alpha(head, bs, 1)[0], 4) for w, bs in held_b.items()}
    if not all(torch.isfinite(p).all() for p in head.trainable()):
        raise ValueError("the head's weights are not finite after training")
    meta = {"alpha": round(statistics.mean(per.values()), 4), "alpha_by_workload": per, "steps": dist.steps,
            "train_s": round(dist.train_s, 1), "score_s": round(score_s, 1),
            "positions": sum(len(it["ids"]) for it in train)}
    tmp = d.parent / f".{d.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_head(head, tmp / HEAD_FILE, target, {"alpha": meta["alpha"], "steps": dist.steps})
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(d, ignore_errors=True)
    os.rename(tmp, d)
    progress(f"head bootstrap: held-out α {meta['alpha']:.3f} ({per}) after {dist.steps} steps")
    return meta
