"""A useful v0 before the first request: the base draft bootstrapped on built-in corpora, once per pair.

The derived draft starts near α = 0.02-0.07 on served traffic, so online adaptation would start
from nothing. On its first start on a pair, ``daemonctl run`` (as the trainer's first job) and
``daemonctl demo`` (before the first request) distil the target's teacher-forced distributions on
the built-in corpora into a LoRA adapter on the draft, as ``daemonctl bootstrap`` does, and keep
it in a cache keyed by the pair fingerprint and everything that shapes the adapter (draft
vocabulary, LoRA and loss settings, corpora and budget): ``<cache>/bootstrap/<key>/``, beside the
converted models (``$DRAFTD_CACHE_DIR`` or ``~/.cache/draftd/models``). Every later start on an empty registry
registers the cached adapter and promotes it in seconds, so adaptation starts from that speed
floor: the trainer's rounds continue from it and the gate judges candidates against it.

A registry that already holds a version is left alone (an operator's history is never
overwritten); a bootstrap that did not raise held-out α over the base draft is cached as that
negative result (``meta.json`` without an adapter) and not retried until its directory is removed.

Held-out α here is on whole documents held out (``decoder.workloads.split_documents``), teacher
forced; documents sharing a run of 8 words with the first ``EVAL_RESERVED_PROMPTS`` prompts of a
workload are in neither split (``bootstrap_documents``), so the demo's never-served evaluation
prompts are never bootstrap text.
The budget defaults come from ``bench/bootstrap_bench.py`` (README, "A useful v0").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from daemon.bootstrap_data import TOPK, WINDOW_TOKENS  # what `daemonctl bootstrap` scores with

log = structlog.get_logger(__name__)

FORMAT = 2  # bump when the bootstrap's data or training changes meaning: older caches are ignored (2: 8-word-run exclusion)
CORPORA = ("prose", "code", "math")  # decoder.workloads.documents


@dataclass(frozen=True)
class WarmStartConfig:
    """What v0 is bootstrapped on, and its budget (``DRAFTD_BOOTSTRAP__*``)."""

    enabled: bool = True
    workloads: tuple[str, ...] = ("prose", "code", "math")
    corpus_tokens: int = 12_000  # teacher-scored training tokens per workload (bench/bootstrap_bench.py: README, "A useful v0")
    heldout_tokens: int = 2_048  # teacher-scored held-out tokens per workload (the gate's and the table's α)
    heldout_fraction: float = 0.1  # of each workload's characters, whole documents
    max_steps: int = 60  # optimiser steps (full head: ~3.3 s each on 2 cores, held-out α 0.18 -> ~0.32)
    max_seconds: float = 300.0  # training seconds at most, for a slower host (scoring and evaluation not counted)
    round_steps: int = 20  # steps between held-out evaluations

    def __post_init__(self):
        for name in ("corpus_tokens", "heldout_tokens", "max_steps", "round_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"bootstrap.{name}={v!r}: must be an integer >= 1")
        for name, lo, hi in (("heldout_fraction", 0.0, 1.0), ("max_seconds", 0.0, 24 * 3600.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi or (name == "heldout_fraction" and v == hi):
                raise ValueError(f"bootstrap.{name}={v!r}: must be a number in ({lo:g}, {hi:g}"
                                 f"{')' if name == 'heldout_fraction' else ']'}, e.g. {0.1 if name == 'heldout_fraction' else 300}")
        if isinstance(self.workloads, str) or not self.workloads:
            raise ValueError(f"bootstrap.workloads={self.workloads!r}: a non-empty tuple of built-in corpora, e.g. ('prose', 'code', 'math')")
        names = []
        for w in self.workloads:  # gsm8k is math's corpus: one of them, once
            w = "math" if w == "gsm8k" else w
            if w not in CORPORA:
                raise ValueError(f"bootstrap.workloads: {w!r} has no built-in corpus; choose from {', '.join(CORPORA)} (or gsm8k = math)")
            if w not in names:
                names.append(w)
        object.__setattr__(self, "workloads", tuple(names))


@dataclass
class WarmStart:
    """What a start did about v0."""

    source: str  # "cache" | "trained" | "registry" (versions exist) | "disabled" | "no gain" | "no data" | "failed"
    version: int | None  # the version registered and promoted now (None: none)
    reason: str
    cache_dir: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def bootstrap_cache_root() -> Path:
    """``bootstrap/`` in the model cache (``$DRAFTD_CACHE_DIR`` or ``~/.cache/draftd/models``)."""
    from decoder.models.packaged import cache_root

    return cache_root() / "bootstrap"


def cache_key(fingerprint_key: str, cfg: WarmStartConfig, distill_config: Any, vocab: Any) -> str:
    """16 hex digits of sha256 over everything that shapes the bootstrapped adapter."""
    dc = {k: v for k, v in dataclasses.asdict(distill_config).items()
          if k not in ("max_steps", "max_seconds", "max_epochs", "weighting", "copy_gate", "copy_gate_lr", "copy_gate_init")}
    ids = [] if vocab is None else [int(x) for x in (vocab.tolist() if hasattr(vocab, "tolist") else vocab)]
    blob = json.dumps({"format": FORMAT, "pair": fingerprint_key, "config": dataclasses.asdict(cfg), "distill": dc,
                       "vocab": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def scoring_engine(choice: str, target: str, device: str = "cpu", threads: int | None = None):
    """A llama.cpp context of the target for bootstrap scoring (closed after the block), where
    ``models.engine`` would serve the target on llama.cpp; else None (the torch target scores).

    Raises:
        decoder.engines.base.EngineError: ``choice`` is ``llamacpp`` and llama.cpp cannot load the target.
    """
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.engines.llamacpp_lib import llamacpp_available
    from decoder.engines.registry import target_gguf

    gguf = target_gguf(target) if choice != "torch" and device == "cpu" else None
    if gguf is None or not llamacpp_available():
        yield None
        return
    eng = LlamaCppEngine(gguf, n_ctx=4 * WINDOW_TOKENS, threads=threads)
    try:
        yield eng
    finally:
        eng.close()


def score_corpora(pair: Any, fingerprint: Any, cfg: WarmStartConfig, precision: str,
                  progress: Callable[[str], None] = lambda m: None, engine: Any = None) -> tuple[list, list, dict]:
    """The target's teacher-forced top-k on each workload's bootstrap documents.

    ``engine``: the served target's engine (``decoder.engines``), which then scores the windows
    (``decoder.teacher.score_windows_engine``); None: the torch target (``score_windows``, bf16
    autocast per ``precision``).

    Returns (train samples, held-out samples, stats: per workload documents, positions, scoring
    wall and CPU seconds). A workload without corpus text (math without ``../shared/data``) is
    skipped and named in ``stats["skipped"]``.
    """
    from decoder.teacher import corpus_windows, score_windows, score_windows_engine
    from decoder.workloads import bootstrap_documents, split_documents
    from trainer.distill import autocast_dtype

    ac = autocast_dtype(precision, next(pair.target.parameters()).device)
    train, held = [], []
    stats = {"scorer": getattr(engine, "name", "torch"), "workloads": {}, "skipped": [], "wall_seconds": 0.0,
             "cpu_seconds": 0.0}
    for w in cfg.workloads:
        docs = bootstrap_documents(w)
        if not docs:
            stats["skipped"].append(w)
            continue
        tr_docs, he_docs = split_documents(docs, cfg.heldout_fraction)
        row = {"train_documents": len(tr_docs), "heldout_documents": len(he_docs)}
        t0, c0 = time.perf_counter(), time.process_time()
        for side, ds, budget, out in (("train", tr_docs, cfg.corpus_tokens, train), ("heldout", he_docs, cfg.heldout_tokens, held)):
            items = corpus_windows(pair.tokenizer, ds, WINDOW_TOKENS, max_tokens=budget)
            progress(f"bootstrap: the target scores {sum(len(x) for _, x in items)} {w} tokens ({side})")
            prefix = f"bootstrap-{side}"
            got = list(score_windows_engine(engine, items, w, fingerprint, k=TOPK, request_prefix=prefix)
                       if engine is not None else
                       score_windows(pair.target, items, w, fingerprint, k=TOPK, request_prefix=prefix, autocast_dtype=ac))
            row[f"{side}_positions"] = sum(s.num_tokens for s in got)
            out.extend(got)
        row["wall_seconds"], row["cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
        stats["wall_seconds"] += row["wall_seconds"]
        stats["cpu_seconds"] += row["cpu_seconds"]
        stats["workloads"][w] = row
    return train, held, stats


def train_v0(pair: Any, fingerprint: Any, distiller: Any, cfg: WarmStartConfig, precision: str,
             progress: Callable[[str], None] = lambda m: None, on_round: Callable[[Any], None] | None = None,
             engine: Any = None):
    """Score the corpora and distil them into ``distiller``'s adapter (registered nowhere).

    Returns (``trainer.bootstrap.BootstrapResult``, scoring stats). Every position trains
    (weighting ``all``: teacher-forced records have no rejections). ``engine``: see :func:`score_corpora`.

    Raises:
        trainer.bootstrap.NotEnoughSamples: no corpus text at all, or none held out.
    """
    from trainer.bootstrap import BootstrapConfig, bootstrap

    train, held, stats = score_corpora(pair, fingerprint, cfg, precision, progress, engine)
    orig = distiller.config
    # v0 carries no copy gate (λ = 0): the gate is learnt per workload by the rounds from served
    # traffic (trainer.distill.DistillConfig.copy_gate), so the cache key leaves its settings out
    distiller.config = dataclasses.replace(orig, weighting="all", copy_gate=False)
    try:
        res = bootstrap(train, distiller, None,
                        BootstrapConfig(max_steps=cfg.max_steps, max_seconds=cfg.max_seconds, round_steps=cfg.round_steps,
                                        promote=True),
                        on_round=on_round, heldout=held)
    finally:
        distiller.config = orig
    return res, stats


def ensure_v0(pair: Any, fingerprint: Any, registry: Any, distiller: Any, cfg: WarmStartConfig, precision: str = "auto",
              progress: Callable[[str], None] = lambda m: None, engine: Any = None) -> WarmStart:
    """Make the bootstrapped v0 the active shared version of an empty registry (trained once per cache key).

    Args:
        pair: ``decoder.models.loading.ModelPair`` (its torch target scores the corpora on a cache miss).
        fingerprint: ``store.schema.PairFingerprint`` of the pair.
        registry: ``store.registry.AdapterRegistry``.
        distiller: ``trainer.distill.Distiller`` on the draft; on a cache miss its adapter is trained
            in place, so a trainer built on it continues from v0. Whatever goes wrong, it is left
            on the base draft unless v0 was promoted.
        cfg: corpora and budget.
        precision: ``trainer.precision`` (bf16 autocast for scoring where native).
        progress: one-line progress messages.
        engine: an engine of the target (``scoring_engine``) to score the corpora on, the served
            numerics; None (what ``run`` and ``demo`` pass): the torch target under bf16 autocast,
            which took half the CPU time of llama.cpp's Q4_1 here (``bench/bootstrap_bench.py --scorer``).

    "Empty" means no version was ever promoted, rejected or rolled back: a candidate left by a
    start that failed between registering and promoting does not count. Processes on one host
    take a lock per cache key (``fcntl.flock``), so one bootstraps and the rest wait and take its
    cache. A cache entry that cannot be used (unreadable or inconsistent ``meta.json``, weights
    that do not load into the draft) is bootstrapped again; a cache that cannot be written costs
    only the cache (v0 is promoted from a temporary copy).

    Never raises for a failed bootstrap (no corpus, no gain, a non-finite round, bad corpus
    files): the start goes on from the base draft and ``WarmStart.reason`` says why. Registry
    errors propagate (Redis is required), with the distiller reset.
    """
    if not cfg.enabled:
        return WarmStart("disabled", None, "bootstrap.enabled=false: adaptation starts from the base draft")
    history = _history(registry)
    if history is not None:
        return history
    key = cache_key(fingerprint.key(), cfg, distiller.config, getattr(distiller, "_vocab", None))
    d = bootstrap_cache_root() / key
    try:
        with _key_lock(d):
            history = _history(registry)  # another process may have promoted it while we waited
            if history is not None:
                return history
            return _ensure_locked(d, key, pair, fingerprint, registry, distiller, cfg, precision, progress, engine)
    except BaseException:
        distiller.reset_adapter()  # never train on from weights the registry does not serve
        raise


def promote_cached_v0(fingerprint: Any, registry: Any, cfg: WarmStartConfig, distill_config: Any, vocab: Any = None
                      ) -> WarmStart | None:
    """What ``serve`` does at start when no trainer has run yet: promote the cached bootstrap of
    this pair into an empty registry (the serving loop then hot-swaps it in between requests), so a
    serve started alone serves v0, never the untrained draft, and never waits for a bootstrap.

    Args:
        fingerprint: ``store.schema.PairFingerprint`` of the served pair.
        registry: ``store.registry.AdapterRegistry`` the serving loop follows.
        cfg, distill_config, vocab: what the trainer would bootstrap with (``warm_start_config``,
            ``distill_config`` and ``draft_vocab_ids`` of the same settings), which make the cache key.

    Returns:
        The WarmStart of the promotion; None when bootstrap is disabled, the registry already has
        history, or no usable cache entry exists (a trainer's first start bootstraps it). Registry
        errors propagate.
    """
    if not cfg.enabled or _history(registry) is not None:
        return None
    key = cache_key(fingerprint.key(), cfg, distill_config, vocab)
    d = bootstrap_cache_root() / key
    if not (d / "meta.json").exists():
        return None
    with _key_lock(d):
        if _history(registry) is not None:
            return None
        meta, why = _read_cache(d, None)
        if meta is None or not (d / "adapter").is_dir():
            log.info("serve_no_cached_v0", cache=str(d), why=why or "the cached bootstrap has no adapter (no gain)")
            return None
        return _promote(d, key, meta, registry, "cache")


def _history(registry: Any) -> WarmStart | None:
    """A WarmStart("registry") when the registry has history, else None."""
    recs = [r for r in registry.list() if r.state != "candidate"]
    if not recs:
        return None
    return WarmStart("registry", None, f"the registry already holds {len(recs)} version(s) (active "
                                      f"v{registry.active_version()}): adaptation continues from there")


@contextlib.contextmanager
def _key_lock(d: Path):
    """An exclusive ``flock`` on ``<cache>/.<key>.lock`` (no lock when the cache dir cannot be made)."""
    import fcntl

    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        f = open(d.parent / f".{d.name}.lock", "a")
    except OSError as e:
        log.warning("bootstrap_cache_unwritable", cache=str(d.parent), error=str(e))
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_locked(d: Path, key: str, pair, fingerprint, registry, distiller, cfg, precision, progress, engine) -> WarmStart:
    from trainer.bootstrap import NotEnoughSamples
    from trainer.publish import adapter_meta

    for stale in d.parent.glob(f".{d.name}.tmp-*"):  # a killed process's half-written entry (we hold the key's lock)
        shutil.rmtree(stale, ignore_errors=True)
    if d.exists() or d.is_symlink():
        meta, why = _read_cache(d, distiller)
        if meta is not None:
            return _promote(d, key, meta, registry, "cache")
        log.warning("bootstrap_cache_unusable", cache=str(d), error=why)
        progress(f"the cached bootstrap {d} cannot be used ({why}); bootstrapping it again")
        _remove(d)
    progress(f"bootstrapping v0 on the built-in corpora (once for this pair: cache {d})")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res, stats = train_v0(pair, fingerprint, distiller, cfg, precision, progress,
                              on_round=lambda pt: progress(f"bootstrap: {pt.steps} steps, held-out α {pt.alpha:.3f}, "
                                                           f"greedy agreement {pt.greedy:.3f}"),
                              engine=engine)
    except Exception as e:  # noqa: BLE001 - no corpus text, a non-finite round, a damaged corpus file: start from the base
        distiller.reset_adapter()
        why = "skipped" if isinstance(e, NotEnoughSamples) else "failed"
        log.warning("bootstrap_failed", error=f"{type(e).__name__}: {e}")
        return WarmStart("no data" if why == "skipped" else "failed", None,
                         f"bootstrap {why} ({type(e).__name__}: {e}); adaptation starts from the base draft")
    gain = res.after.served - res.base.served  # as trainer.bootstrap promoted: acceptance as served
    meta = {
        "format": FORMAT, "key": key, "pair": fingerprint.key(), "config": dataclasses.asdict(cfg),
        "created_at": time.time(), "alpha_base": res.base.alpha, "alpha_after": res.after.alpha,
        "served_base": res.base.served, "served_after": res.after.served, "gain": gain,
        "alpha_base_by_workload": {w: c.alpha for w, c in sorted(res.base.per_workload.items())},
        "alpha_after_by_workload": {w: c.alpha for w, c in sorted(res.after.per_workload.items())},
        "steps": res.steps, "train_seconds": res.train_seconds, "samples_trained": res.samples_trained,
        "heldout_samples": res.heldout_samples, "scoring": stats,
        "wall_seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
        "curve": [dataclasses.asdict(p) for p in res.curve],
        "adapter_meta": dataclasses.asdict(adapter_meta(0, res.base, res.after, res.samples_trained, 0,
                                                        res.curve[-1].loss if res.curve else float("nan"))),
    }
    if not gain > 0:
        distiller.reset_adapter()  # the trainer starts from the base draft, which serves
    tmp = Path(tempfile.mkdtemp(prefix="draftd-v0-"))
    try:
        if gain > 0:
            distiller.save(tmp / "adapter")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        try:
            _write_cache(d, tmp)
        except OSError as e:
            log.warning("bootstrap_cache_unwritable", cache=str(d), error=str(e))
            progress(f"[yellow]the bootstrap cannot be cached ({e}): the next start on this pair bootstraps again[/]")
        return _promote(tmp, key, meta, registry, "trained", shown=d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _read_cache(d: Path, distiller: Any) -> tuple[dict | None, str]:
    """(meta, "") for a usable cache entry, else (None, why). Usable: ``meta.json`` of this
    format with numbers where numbers belong, an adapter exactly when its gain is positive, its registry
    record shared (no scope); the adapter is then loaded into ``distiller`` (shapes and
    vocabulary checked, as the trainer will continue from it; reset again if that fails). With
    ``distiller`` None (serve, which trains nothing) the adapter's files are checked to exist."""
    import math

    from store.registry import AdapterMeta

    try:
        meta = json.loads((d / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return None, f"meta.json is not a format-{FORMAT} record"
        for k in ("alpha_base", "alpha_after", "gain", "cpu_seconds"):
            v = meta.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                return None, f"meta.json {k}={v!r} is not a finite number"
        if isinstance(meta.get("steps"), bool) or not isinstance(meta.get("steps"), int):
            return None, f"meta.json steps={meta.get('steps')!r} is not an integer"
        am = meta.get("adapter_meta")
        if not isinstance(am, dict):
            return None, f"meta.json adapter_meta={am!r} is not a record"
        rec = AdapterMeta(**{k: v for k, v in am.items() if k in AdapterMeta.__dataclass_fields__})
        if rec.scope or not isinstance(rec.samples_trained, int) or not isinstance(rec.tokens_trained, int):
            return None, "meta.json adapter_meta is not a shared adapter's record"
        rose = meta["gain"] > 0  # what the bootstrap promoted on (acceptance as served)
        has = (d / "adapter").exists()
        if rose != has:
            return None, ("held-out α rose but the adapter is missing" if rose else "an adapter beside a result without gain")
        if has and distiller is None:
            missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (d / "adapter" / f).is_file()]
            if missing:
                return None, f"the cached adapter lacks {missing}"
        elif has:
            try:
                distiller.load_adapter_weights(d / "adapter")
            except BaseException:
                distiller.reset_adapter()
                raise
    except Exception as e:  # noqa: BLE001 - anything unreadable is a damaged entry
        return None, f"{type(e).__name__}: {e}"
    return meta, ""


def _promote(src: Path, key: str, meta: dict, registry: Any, source: str, shown: Path | None = None) -> WarmStart:
    """Register ``src``'s adapter as the shared v0 and promote it (or report a result without gain)."""
    from store.registry import AdapterMeta

    shown = shown or src
    what = (f"held-out α {meta['alpha_base']:.3f} -> {meta['alpha_after']:.3f} in {meta['steps']} steps, "
            f"{meta['cpu_seconds'] / 60:.1f} CPU minutes")
    if not (src / "adapter").is_dir():
        return WarmStart("no gain", None, f"the bootstrap did not raise held-out α ({what}); remove {shown} to retry",
                         str(shown), meta)
    fields = {k: v for k, v in meta["adapter_meta"].items() if k in AdapterMeta.__dataclass_fields__}
    am = AdapterMeta(**{**fields, "parent": 0, "scope": ""})
    version = registry.register(src / "adapter", am)
    reason = f"v0 bootstrap ({'cached' if source == 'cache' else 'trained now'}, {key}): {what}"
    registry.promote(version, reason)
    log.info("bootstrap_v0_promoted", version=version, source=source, cache=str(shown), alpha_after=meta["alpha_after"])
    return WarmStart(source, version, reason, str(shown), meta)


def _write_cache(d: Path, src: Path) -> None:
    """``d`` as a copy of ``src`` (meta.json [+ adapter/]), written whole or not at all (the caller
    holds the key's lock, so nothing else writes ``d``)."""
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.parent / f".{d.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(src, tmp)
        if d.exists() or d.is_symlink():
            _remove(d)
        os.replace(tmp, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
