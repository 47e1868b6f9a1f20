"""Bootstrap: turn an untrained (e.g. layer-derived) draft into adapter v1.

The samples are VerifiedSamples carrying the target's top-k at every position: by default
teacher-forced windows of built-in corpora (``source="prefill"``, ``daemonctl bootstrap``), or
with ``--source decode`` the target's own generations at gamma = 0 (daemon/bootstrap_data.py).
This module never sees a model besides the Distiller's draft: it takes any iterable of samples,
holds out a fixed record-id hash bucket (the same split as the service), runs Distiller rounds
until a step or time budget, and registers the result; it promotes it only if held-out alpha
rose over the base draft's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from store.schema import VerifiedSample
from trainer.distill import BASE, Distiller, EvalResult, TrainerError
from trainer.publish import adapter_meta, publish
from trainer.service import is_heldout, split_key

log = structlog.get_logger(__name__)


class NotEnoughSamples(TrainerError):
    """The samples split into no training or no held-out ones: more data is needed."""


@dataclass
class BootstrapConfig:
    """Budget and split of a bootstrap run."""

    max_steps: int = 400  # optimiser steps in total, over all rounds
    max_seconds: float = 15 * 60.0  # training seconds in total (evaluation not counted)
    round_steps: int = 50  # steps per round; held-out alpha is measured after each round
    holdout_fraction: float = 0.1  # record-id hash bucket held out (never trained on)
    promote: bool = True  # promote v1 if held-out alpha beats the base draft's


@dataclass
class CurvePoint:
    steps: int
    train_seconds: float
    alpha: float
    greedy: float
    loss: float
    cpu_seconds: float = 0.0  # process CPU time of the training so far (all threads), seconds
    per_workload: dict[str, float] = field(default_factory=dict)  # held-out alpha per workload tag


@dataclass
class BootstrapResult:
    version: int | None  # registered version (None without a registry)
    promoted: bool
    reason: str
    steps: int
    train_seconds: float
    samples_trained: int
    heldout_samples: int
    base: EvalResult
    after: EvalResult
    curve: list[CurvePoint] = field(default_factory=list)


def _split(samples: Iterable[VerifiedSample], heldout: Sequence[VerifiedSample] | None,
           holdout_fraction: float) -> tuple[list[VerifiedSample], list[VerifiedSample]]:
    """(training, held-out) samples: ``heldout`` as given, else by a hash of each record's text;
    NotEnoughSamples when either is empty."""
    train, held = [], []
    if heldout is not None:
        train, held = list(samples), list(heldout)
    else:
        for s in samples:
            (held if is_heldout(split_key(s), holdout_fraction) else train).append(s)
    if not train or not held:
        raise NotEnoughSamples(
            f"bootstrap needs training and held-out samples; got {len(train)} and {len(held)} "
            f"(holdout_fraction={holdout_fraction}); generate more samples"
        )
    return train, held


def bootstrap(
    samples: Iterable[VerifiedSample],
    distiller: Distiller,
    registry: Any | None,
    config: BootstrapConfig,
    clock: Callable[[], float] = time.monotonic,
    on_round: Callable[[CurvePoint], None] | None = None,
    heldout: Sequence[VerifiedSample] | None = None,
) -> BootstrapResult:
    """Distil ``samples`` into the distiller's adapter within the budget; register (and promote) it.

    Args:
        samples: target-generated samples (consumed once, kept in memory).
        distiller: wraps the draft; its DistillConfig gives loss, weighting, lr, batch size. Use
            weighting "all" or "upweight_rejected": gamma = 0 samples have no rejections.
        registry: ``store.registry.AdapterRegistry`` or None (train and evaluate only).
        clock: monotonic seconds for the time budget.
        on_round: called after each round with the new curve point (progress reporting).
        heldout: the held-out samples, when the caller split them (e.g. by document,
            ``decoder.workloads.split_documents``); then every one of ``samples`` trains. None:
            ``samples`` are split by ``holdout_fraction`` on a hash of each record's text.

    Raises:
        NotEnoughSamples: no training or no held-out samples.
        TrainerError: a round went non-finite.
    """
    train, held = _split(samples, heldout, config.holdout_fraction)
    base = distiller.evaluate(held, adapter=BASE)
    log.info("bootstrap_start", train=len(train), heldout=len(held), base_alpha=base.alpha, base_greedy=base.greedy)
    orig = distiller.config
    steps, seconds, cpu, curve = 0, 0.0, 0.0, []
    after = base
    try:
        while steps < config.max_steps and seconds < config.max_seconds:
            distiller.config = dataclasses.replace(
                orig,
                max_steps=min(config.round_steps, config.max_steps - steps),
                max_seconds=config.max_seconds - seconds,
                max_epochs=max(orig.max_epochs, 10**6),  # the budget, not the epoch count, ends a round
            )
            t0, c0 = clock(), time.process_time()
            res = distiller.train_round(train)
            seconds += clock() - t0
            cpu += time.process_time() - c0
            if not res.finite:
                raise TrainerError(f"bootstrap round went non-finite after {steps} steps: {res.reason}; lower lr={orig.lr}")
            if res.steps == 0:
                raise TrainerError(f"bootstrap round made no step (weighting={orig.weighting!r} with gamma=0 samples?)")
            steps += res.steps
            after = distiller.evaluate(held)
            point = CurvePoint(steps, seconds, after.alpha, after.greedy, res.loss_last, cpu,
                               {w: c.alpha for w, c in sorted(after.per_workload.items())})
            curve.append(point)
            log.info("bootstrap_round", **dataclasses.asdict(point))
            if on_round is not None:
                on_round(point)
    finally:
        distiller.config = orig
    gain = after.served - base.served  # acceptance as served, as the promotion gate judges (greedy records: agreement)
    promoted = config.promote and gain > 0
    reason = (
        f"bootstrap: held-out alpha {base.alpha:.4f} -> {after.alpha:.4f}, acceptance as served "
        f"{base.served:.4f} -> {after.served:.4f} ({gain:+.4f}; greedy {base.greedy:.3f} -> {after.greedy:.3f}), "
        f"{steps} steps, {seconds:.0f} s, {len(train)} samples"
    )
    version = None
    if registry is not None:
        meta = adapter_meta(0, base, after, len(train), sum(s.num_tokens for s in train),
                            curve[-1].loss if curve else float("nan"))
        # promote=False (`bootstrap --no-promote`) registers a candidate that can still be promoted; a
        # break session found it stored as rejected, which promote() refuses
        version = publish(registry, distiller, meta, promoted, reason + ("" if config.promote else " (promote=False)"),
                          judged=config.promote)
    return BootstrapResult(version, bool(promoted and registry is not None), reason, steps, seconds, len(train), len(held), base, after, curve)
