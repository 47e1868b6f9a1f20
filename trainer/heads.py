"""The trainer service's head rounds: distil the feature-level head from buffered records,
judge it on held-out records, and publish it through a registry of kind ``"head"``.

A round of :class:`trainer.service.TrainerService` splits its records into training and
held-out ones by prompt (``split_key``) and hands both to :meth:`HeadTrainer.turn` after the
draft's LoRA turn, so the head and the adapter are judged on the same held-out prompts. Only
records carrying the target's hidden states (``store.schema`` version 2,
``DecoderConfig.record_hidden``) are used; no target forward runs (``trainer.head``).

A turn:

1. starts from the head the registry serves (fetched and rebuilt when its version changed;
   a fresh head, EAGLE-1's initialisation, while none is promoted),
2. trains ``steps`` optimiser steps (on the last rejected candidate when what serves has not
   changed since, so that small turns add up) (``HeadDistiller``: forward KL on the stored top-k + the
   feature regression) on this round's windows plus up to ``replay_per_workload`` records kept
   from earlier rounds per workload,
3. measures teacher-forced α at depth 1 (α = Σ_x min(p, q), Leviathan et al. 2023, §3.1) per
   workload on the held-out pool, for the serving head (before) and the candidate (after),
4. gates as the adapter gate does: the mean over judged workloads must rise by
   ``promote_margin`` and no judged workload may fall by more than ``regress_margin``; a workload
   counts when it has ``min_eval_positions`` held-out positions. With no head serving, before
   is 0 (no feature-level proposer at all) and the candidate needs α >= ``min_alpha``.
5. registers the candidate (``save(head, path, meta)``) and promotes it, or marks it rejected.

The held-out and replay pools are bounded (records per workload) and live in process memory,
like the adapter turn's.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from store.registry import HEAD_FILE, AdapterMeta
from trainer.head import HeadDistiller, column_map, groups, head_batch, heldout_alpha, record_items

log = structlog.get_logger(__name__)


@dataclass
class HeadConfig:
    """A head turn's size and its gate (module docstring)."""

    steps: int = 150  # optimiser steps per turn (0.1-0.3 s each on 2 CPU cores for SmolLM2's head)
    window: int = 64  # rows per training window
    batch: int = 8
    lr: float = 1e-3
    unroll: int = 2  # proposal depths in the loss (EAGLE-3's training-time test)
    feature_weight: float = 1.0
    replay_per_workload: int = 64  # records with hidden states kept per workload for later turns
    heldout_per_workload: int = 32  # held-out records kept per workload
    min_eval_positions: int = 64  # held-out positions a workload needs to count in the gate
    promote_margin: float = 0.005
    regress_margin: float = 0.01
    min_alpha: float = 0.05  # what the first head must reach (against no head at all)

    def __post_init__(self):
        ints = ("steps", "window", "batch", "unroll", "replay_per_workload", "heldout_per_workload", "min_eval_positions")
        bad = [n for n in ints if not isinstance(getattr(self, n), int) or isinstance(getattr(self, n), bool)]
        margins = (self.promote_margin, self.regress_margin, self.lr, self.min_alpha, self.feature_weight)
        if bad or not all(isinstance(m, (int, float)) and math.isfinite(m) for m in margins) or self.regress_margin < 0:
            raise ValueError(f"HeadConfig {asdict(self)}: {', '.join(bad) or 'the margins'} must be "
                             f"{'integers' if bad else 'finite numbers (regress_margin >= 0)'}")
        if not (self.steps >= 1 and self.window >= 3 and self.batch >= 1 and 0 < self.lr <= 1 and self.unroll >= 1
                and self.replay_per_workload >= 0 and self.heldout_per_workload >= 1 and self.min_eval_positions >= 1
                and 0 <= self.feature_weight < math.inf and 0 <= self.min_alpha < 1):
            raise ValueError(f"HeadConfig {asdict(self)}: steps, batch, unroll, heldout_per_workload and "
                             f"min_eval_positions >= 1, window >= 3, lr in (0, 1], replay_per_workload >= 0, "
                             f"feature_weight finite >= 0, min_alpha in [0, 1)")


@dataclass
class HeadReport:
    """What one head turn did; JSON-ready via :meth:`to_dict`."""

    decision: str = "idle"  # idle | promoted | rejected | non_finite | failed
    reason: str = ""
    parent: int = 0  # the head version it trained from (0 = a fresh head)
    version: int | None = None
    records: int = 0  # this round's training records with hidden states
    records_without_hidden: int = 0  # this round's training records it could not use
    records_refused: int = 0  # records with hidden states of another width (head or top-k), skipped
    windows: int = 0  # training windows (this round's + replayed)
    steps: int = 0
    train_s: float = 0.0
    loss: float = math.nan
    alpha_before: float = math.nan
    alpha_after: float = math.nan
    alpha_before_by_workload: dict[str, float] = field(default_factory=dict)
    alpha_after_by_workload: dict[str, float] = field(default_factory=dict)
    heldout_positions: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


class HeadTrainer:
    """Head turns for the trainer service (module docstring).

    Args:
        registry: a :class:`store.AdapterRegistry` of kind ``"head"``.
        new_head: ``new_head() -> head``: a fresh trainable float32 head on the target
            (``decoder.eagle.EagleHead.from_target``); the daemon supplies it (trainer/ imports
            nothing of decoder/).
        load: ``load(path) -> head``: a saved head file rebuilt trainable on the target
            (``decoder.eagle.load_head``); raises ValueError for a file that is not this target's.
        save: ``save(head, path, meta)``: write ``head`` to ``path`` (``decoder.eagle.save_head``).
        vocab_size: the target's vocabulary size (the column map of a restricted head).
        config: :class:`HeadConfig`.
        work_dir: where candidates are written before registration (temp when None).
        autocast: the training autocast dtype (``trainer.distill.autocast_dtype``), or None.
    """

    def __init__(self, registry, new_head: Callable[[], Any], load: Callable[[Path], Any],
                 save: Callable[[Any, Path, dict], None], vocab_size: int, config: HeadConfig | None = None,
                 work_dir: str | Path | None = None, autocast: torch.dtype | None = None, seed: int = 0):
        if getattr(registry, "kind", "head") != "head":
            raise ValueError(f"HeadTrainer needs a registry of kind 'head', got {registry.kind!r}")
        self.registry = registry
        self.new_head, self.load, self.save = new_head, load, save
        self.vocab_size = vocab_size
        self.config = config or HeadConfig()
        self.autocast = autocast
        self.seed = seed
        self._head = None  # the trainable head of the serving version
        self._version: int | None = None  # its version (0: fresh, nothing promoted); None: not synced
        self._col = None
        self._k: int | None = None  # the top-k width of the records it trains on (the first seen)
        self._carry: tuple[int | None, Any] | None = None  # (serving version, a rejected candidate trained from it)
        self._heldout: dict[str, deque] = {}
        self._replay: dict[str, deque] = {}
        self._turns = 0
        self.last: HeadReport | None = None
        self._work = Path(work_dir) / "head-candidates" if work_dir is not None else Path(
            tempfile.mkdtemp(prefix="draftd-head-candidates-"))
        shutil.rmtree(self._work, ignore_errors=True)
        self._work.mkdir(parents=True, exist_ok=True)

    # ---- the serving head --------------------------------------------------------------------
    def _sync(self) -> None:
        """Make the trainable head the registry's shared active one (fetched and rebuilt when
        the version changed; a fresh head for version 0). Raises StoreUnavailableError,
        RegistryError or ValueError (a registered head that does not load)."""
        v = self.registry.active_version()
        if v == self._version and self._head is not None:
            return
        head = self.new_head() if v == 0 else self.load(self.registry.fetch(v) / HEAD_FILE)
        self._head, self._version = head, v
        self._col = column_map(getattr(head, "vocab_ids", None), self.vocab_size)

    # ---- a turn ------------------------------------------------------------------------------
    def turn(self, train: list, heldout: list) -> HeadReport:
        """Train, judge and publish a head on one round's ``train`` and ``heldout`` records
        (``store.schema.VerifiedSample``). Records without hidden states are counted and skipped;
        so are records whose hidden width is not the head's or whose top-k width is not the one the
        trainer first saw (``records_refused``: one odd record never stops the head's training).
        Never raises for bad data or a failed training: the report says what happened."""
        cfg = self.config
        rep = HeadReport()
        self._turns += 1
        try:
            rep.records_without_hidden = sum(getattr(s, "hidden", None) is None for s in train)
            if all(getattr(s, "hidden", None) is None for s in [*train, *heldout]):
                rep.reason = (f"no training records with hidden states ({rep.records_without_hidden} without): "
                              f"set serve.record_hidden" if rep.records_without_hidden else "no training records")
                return self._done(rep)
            self._sync()
            rep.parent = int(self._version or 0)
            fresh = self._usable(train, rep)
            self._keep_heldout(self._usable(heldout, rep))
            rep.records = len(fresh)
            if not fresh:
                rep.reason = ("no usable training records with hidden states" if train else "no training records")
                return self._done(rep)
            held = self._held_batches()
            rep.heldout_positions = {w: sum(b["tokens"].numel() for b in bs) for w, bs in held.items()}
            judged = {w: bs for w, bs in held.items() if rep.heldout_positions[w] >= cfg.min_eval_positions}
            if not judged:
                self._keep_replay(fresh)
                rep.reason = (f"no workload has {cfg.min_eval_positions} held-out positions with hidden states "
                              f"(have {rep.heldout_positions or 'none'}): nothing to judge a head on")
                return self._done(rep)
            ids = {s.record_id for s in fresh}
            old = [s for d in self._replay.values() for s in d if s.record_id not in ids]
            items = record_items(fresh + old, cfg.window)  # every record of this round, plus the replay
            self._keep_replay(fresh)
            if not items:
                rep.reason = "no training windows (records shorter than 3 rows)"
                return self._done(rep)
            rep.windows = len(items)
            serving = self._head
            before = ({w: heldout_alpha(serving, bs, 1)[0] for w, bs in judged.items()} if self._version
                      else {w: 0.0 for w in judged})
            # a rejected candidate trains on in the next turn (small turns add up), unless what
            # serves changed meanwhile
            carried = self._carry is not None and self._carry[0] == self._version
            cand = self._carry[1] if carried else self._candidate(serving)
            self._carry = None
            dist = HeadDistiller(cand, items, self._col, lr=cfg.lr, batch=cfg.batch, unroll=cfg.unroll,
                                 feature_weight=cfg.feature_weight, total_steps=cfg.steps,
                                 warmup=min(20, cfg.steps), seed=self.seed + self._turns, autocast=self.autocast)
            t0 = time.perf_counter()
            for _ in range(cfg.steps):
                rep.loss = dist.step()
            rep.steps, rep.train_s = dist.steps, round(time.perf_counter() - t0, 3)
            if not all(torch.isfinite(p).all() for p in cand.trainable()) or not math.isfinite(rep.loss):
                rep.decision, rep.reason = "non_finite", f"the head's weights or loss ({rep.loss}) are not finite: discarded"
                return self._done(rep)
            after = {w: heldout_alpha(cand, bs, 1)[0] for w, bs in judged.items()}
            rep.alpha_before_by_workload = {w: round(a, 4) for w, a in before.items()}
            rep.alpha_after_by_workload = {w: round(a, 4) for w, a in after.items()}
            rep.alpha_before, rep.alpha_after = statistics.mean(before.values()), statistics.mean(after.values())
            promote, rep.reason = self._gate(before, after)
            rep.version = self._register(cand, rep)
            if promote:
                try:
                    self.registry.promote(rep.version, rep.reason)
                except Exception as e:  # registered but not promoted: say so in the registry too
                    self._reject(rep.version, f"promotion failed: {type(e).__name__}: {e}")
                    raise
                self._head, self._version = cand, rep.version
            else:
                self.registry.set_state(rep.version, "rejected", rep.reason)
                self._carry = (self._version, cand)
            rep.decision = "promoted" if promote else "rejected"
        except Exception as e:  # noqa: BLE001 - a head turn never fails the round that carries it
            rep.decision, rep.reason = "failed", f"{type(e).__name__}: {e}"
            log.exception("head_turn_failed")
        return self._done(rep)

    def _usable(self, records: list, rep: HeadReport) -> list:
        """The records with hidden states of the head's width and the trainer's top-k width (the
        first seen); the rest counted in ``rep.records_refused`` with why (logged once a turn)."""
        H = int(self._head.hidden_size)
        out, why = [], set()
        for s in records:
            h = getattr(s, "hidden", None)
            if h is None:
                continue
            if h.ndim != 2 or h.shape[1] != H:
                why.add(f"hidden width {h.shape[-1]} (the head's is {H})")
                rep.records_refused += 1
                continue
            k = int(s.topk_ids.shape[1]) if s.topk_ids.ndim == 2 else -1
            if self._k is None and k > 0:
                self._k = k
            if k != self._k:
                why.add(f"top-k width {k} (the trainer's is {self._k})")
                rep.records_refused += 1
                continue
            out.append(s)
        if why:
            log.warning("head_records_refused", n=rep.records_refused, why=sorted(why))
        return out

    def _keep_heldout(self, records: list) -> None:
        for s in records:
            d = self._heldout.setdefault(s.workload, deque(maxlen=self.config.heldout_per_workload))
            if all(x.record_id != s.record_id for x in d):
                d.append(s)

    def _keep_replay(self, records: list) -> None:
        if not self.config.replay_per_workload:
            return
        for s in records:
            d = self._replay.setdefault(s.workload, deque(maxlen=self.config.replay_per_workload))
            if all(x.record_id != s.record_id for x in d):  # a round retried after a failure brings them again
                d.append(s)

    def _reject(self, version: int, reason: str) -> None:
        try:
            self.registry.set_state(version, "rejected", reason)
        except Exception:  # noqa: BLE001 - best effort: the turn's report carries the reason
            log.exception("head_reject_failed", version=version)

    def _held_batches(self) -> dict[str, list[dict]]:
        out = {}
        for w, d in self._heldout.items():
            items = record_items(d, self.config.window)
            if items:
                out[w] = [head_batch(g, self._col) for g in groups(items, self.config.batch)]
        return out

    def _candidate(self, serving):
        """A trainable copy of the serving head (the serving one stays as it is if rejected)."""
        import copy

        cand = copy.deepcopy(serving)
        for p in cand.parameters():
            p.requires_grad_(True)
        return cand

    def _gate(self, before: dict[str, float], after: dict[str, float]) -> tuple[bool, str]:
        cfg = self.config
        b, a = statistics.mean(before.values()), statistics.mean(after.values())
        if not (math.isfinite(a) and math.isfinite(b)):
            return False, f"held-out α is not finite (serving {b}, candidate {a}): not promoted"
        drops = {w: round(before[w] - after[w], 4) for w in before if before[w] - after[w] > cfg.regress_margin}
        if drops:
            return False, f"held-out α fell by more than {cfg.regress_margin} on {drops}"
        if not self._version and a < cfg.min_alpha:
            return False, f"held-out α {a:.4f} below min_alpha={cfg.min_alpha} for a first head"
        if a < b + cfg.promote_margin:
            return False, f"held-out α {a:.4f} did not beat the serving head's {b:.4f} by {cfg.promote_margin}"
        return True, f"held-out α {b:.4f} -> {a:.4f} over {len(after)} workload(s)"

    def _register(self, head, rep: HeadReport) -> int:
        """Write ``head`` and register it as a candidate with the turn's numbers; its version."""
        src = Path(tempfile.mkdtemp(prefix="head-", dir=self._work))
        try:
            self.save(head, src / HEAD_FILE, {"parent": rep.parent, "steps": rep.steps,
                                              "alpha_after": round(rep.alpha_after, 4)})
            meta = AdapterMeta(parent=rep.parent, samples_trained=rep.records, tokens_trained=rep.windows,
                               loss=rep.loss, alpha_before=rep.alpha_before, alpha_after=rep.alpha_after,
                               alpha_before_by_workload=rep.alpha_before_by_workload,
                               alpha_after_by_workload=rep.alpha_after_by_workload)
            return self.registry.register(src, meta)
        finally:
            shutil.rmtree(src, ignore_errors=True)

    def _done(self, rep: HeadReport) -> HeadReport:
        self.last = rep
        log.info("head_turn", decision=rep.decision, version=rep.version, parent=rep.parent, records=rep.records,
                 steps=rep.steps, alpha_before=rep.alpha_before, alpha_after=rep.alpha_after, reason=rep.reason)
        return rep

    def status(self) -> dict:
        """The serving version it trains from, the pools' sizes and the last turn; JSON-ready."""
        return {"training_from": self._version, "turns": self._turns,
                "heldout_records": {w: len(d) for w, d in self._heldout.items()},
                "replay_records": {w: len(d) for w, d in self._replay.items()},
                "last": self.last.to_dict() if self.last else None}
