"""The trainer service: buffer -> rounds of distillation -> gated, registered adapters.

A round (``TrainerService.run_round_now`` or the scheduler):

1. Reclaim entries a dead consumer held (XAUTOCLAIM after ``reclaim_min_idle_ms``), then read
   new ones, up to ``max_samples_per_round`` (any overflow is carried to the next round, never
   dropped: the reader holds it pending).
2. Split by prompt (``split_key``): a fixed hash bucket of prompts (``holdout_fraction``) is held out, so
   a redelivered sample always lands on the same side and a held-out sample is never trained
   on. Held-out samples are kept in memory, the most recent ``holdout_per_workload`` per
   workload. A workload the hash left short of ``min_eval_samples`` is topped up with whole
   prompts it never trained on (``heldout_topup``), so the gate is not blocked for a phase.
3. Evaluate the promoted adapter (or the base draft) on the held-out slice, train a candidate,
   evaluate it on the same slice. The promoted adapter's per-sample results are cached while it
   stays promoted (its weights do not change), and a promoted candidate's own evaluation seeds
   the cache, so each round evaluates the promoted adapter only on newly held-out samples.
4. Gate (``gate``): promote only if the candidate's alpha, pooled over the workloads it trained
   on and paired per held-out position with the promoted adapter's, rises by ``promote_margin``
   with the lower bound of its cluster-bootstrap interval above 0 over at least
   ``min_eval_requests`` held-out requests and ``min_eval_positions`` positions
   (``trainer.gate``), no workload with at least ``min_eval_samples`` held-out samples drops
   by more than ``regress_margin``, and the judged records decoded at ``gate_gamma`` (simulated on
   their per-position acceptance: ``trainer.gate.decoded_acceptance``) do not measurably accept
   fewer proposals.
5. Register every finite candidate (promoted or rejected, with the numbers and the reason), then
   XACK the round's entries. A crash before the registration leaves the entries pending, so they
   are redelivered (to this consumer on restart, or reclaimed by another one); a crash between
   registration and ack retrains them once more (delivery is at least once; the reader drops
   entries whose record id was already acked).

Per-workload adapters (``per_workload``, beyond OSD, which keeps one full draft per class):
after the shared adapter's turn, each workload with at least ``min_workload_samples`` new
training samples in the round (and ``min_eval_samples`` held out) trains its own adapter on its
own samples only. It starts from what serves that workload now (its own promoted adapter, else
the shared one; a rejected candidate trains on in the next round while that has not changed)
and is judged only on that workload's held-out slice, against that same adapter. Each turn has
the Distiller's bounds (``max_steps``, ``max_seconds``), so a round takes up to 1 + (number of
such workloads) times them. A workload whose own active adapter cannot be loaded (corrupt or
missing artifact) has its turns skipped, with the reason in ``status()``; the rest train on.
It is registered in the workload's scope (``AdapterMeta.scope``), so promoting it moves only
that workload's pointer, and decoders route that workload's requests to it
(``decoder.adapters``); workloads without an adapter of their own, and unseen ones, keep the
shared adapter. Each scope keeps its own training candidate and optimiser state across rounds.

A candidate the gate found inconclusive (not enough evidence, or a gain whose interval reaches
0) is not thrown away: the next round keeps training it (the promoted snapshot is kept
separately for evaluation), so small gains can accumulate until they are measurable. A
candidate measured *worse* (a negative paired gain, or a workload regressed) is discarded:
training restarts from the serving weights with a fresh optimiser, and the round's samples do
not enter the replay pool. A non-finite round is rolled back inside the Distiller and never registered; its
entries are acked (retrying the same data would fail the same way) and the round is reported.
If the registry's active version changes behind our back (operator promote or rollback), the
next round restarts training from the newly active adapter. An active adapter that cannot be
loaded (corrupt, non-finite) fails the round before anything is read, weights untouched, and the
next round syncs again (e.g. after a rollback); a round never starts from non-finite weights.

Poison records (issue 16): records that decode but cannot train on this draft (a token id beyond
its vocabulary, an empty prompt, another top-k width) are dead-lettered with the reason before
the round (``Distiller.sample_problem``). If the round still raises, each record is run through the
loss alone (``Distiller.probe``); those that fail are dead-lettered and the round runs once more
on the rest, so one bad record never strands the good ones.

Scheduling: an APScheduler ``BackgroundScheduler`` runs the round job every ``interval_s``
(``max_instances=1``, ``coalesce=True``) and a cheap check job every ``check_interval_s`` that
pulls the round forward when at least ``min_new_samples`` entries wait in the group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from apscheduler.schedulers.background import BackgroundScheduler

from store.buffer import group_info
from store.errors import RegistryError
from store.registry import AdapterMeta, check_scope
from store.schema import VerifiedSample
from store.wording import percent, signed
from trainer.distill import BASE, DECODED_GAMMA, AdapterState, Distiller, EvalResult, RoundResult, TrainerError
from trainer.gate import PairedGain, counts_by_record, paired_decoded_gain, paired_gain
from trainer.publish import adapter_meta, publish

log = structlog.get_logger(__name__)


@dataclass
class ServiceConfig:
    """Scheduling, round bounds, held-out split and the promotion gate."""

    interval_s: float = 300.0  # a round at least this often (if there is anything to train on)
    min_new_samples: int = 64  # ... or as soon as this many new entries wait in the group
    check_interval_s: float = 5.0  # how often the cheap backlog check runs
    max_samples_per_round: int = 256  # entries taken per round (reclaimed + new)
    read_block_ms: int | None = None  # XREADGROUP BLOCK for the round's reads (None = no wait)
    reclaim_min_idle_ms: int = 120_000  # entries idle this long in another consumer are taken over
    holdout_fraction: float = 0.2  # share of record ids (by hash) held out for evaluation
    holdout_per_workload: int = 64  # most recent held-out samples kept per workload
    min_eval_samples: int = 8  # held-out samples a workload needs to count in the gate
    # A workload whose hash split left it fewer than min_eval_samples held out (few distinct
    # prompts: a phase cycling 8 problems holds none out 17 % of the time at 0.2) would have every
    # round rejected for "not enough held-out samples". Top-up: the round then also holds out
    # the records of whole prompts of that workload never trained on (all their records, now and
    # when they come again; in memory, so a restart forgets it), keeping at least one prompt of
    # the workload's round in training, until min_eval_samples are held out.
    heldout_topup: bool = True
    promote_margin: float = 0.005  # candidate alpha must beat the promoted one by this much (point estimate)
    regress_margin: float = 0.01  # and may drop by at most this much on any workload
    # The evidence a promotion needs (trainer.gate.paired_gain): the gain paired per held-out
    # position, the lower bound of its ``confidence`` cluster-bootstrap interval above 0, over at
    # least ``min_eval_requests`` held-out requests (prompts) and ``min_eval_positions`` positions
    # of the judged workloads. 14 samples and +0.005 promoted a version that decoded worse.
    min_eval_requests: int = 8
    min_eval_positions: int = 256
    confidence: float = 0.95
    # The decoded check: the held-out records' per-position acceptance as served, decoded at this γ
    # (trainer.gate.decoded_acceptance: proposals from each block start, none at a bonus position);
    # a candidate whose decoded acceptance measurably falls (paired interval entirely below 0) is
    # refused as worse, whatever its per-position gain.
    gate_gamma: int = DECODED_GAMMA
    # What the gate judges on: "decode" = per workload, its held-out decode records (the target's
    # distributions at the positions the draft proposes for while serving) when it has at least
    # min_eval_samples of them, else all its held-out records; "all" = every held-out record (the
    # prompts' prefill records too, whose text the target did not write).
    gate_on: str = "decode"
    # Replay against forgetting: the most recent trained samples of each workload are kept (in
    # memory) and a round that trains on a shifted workload mixes in up to as many replayed
    # samples of the *other* workloads as it has new ones, so the gate's "no workload drops by
    # more than regress_margin" can hold while the draft learns the new one. 0 disables.
    replay_per_workload: int = 0
    replay_ratio: float = 1.0  # replayed samples per new sample, at most
    # Per-workload adapters (see the module docstring): also train one adapter per workload tag,
    # in a round where that workload brought at least ``min_workload_samples`` new training samples.
    per_workload: bool = False
    min_workload_samples: int = 16
    # With per_workload, whether the shared adapter also trains on the samples of workloads that
    # take their own turn this round (True: every sample trains it). False: it trains only on
    # untagged samples; a workload's samples below min_workload_samples in a round wait, unacked,
    # for the next rounds (at most _DEFER_ROUNDS after the workload's traffic stopped, then they
    # train the shared adapter), and a
    # round whose samples all went to workload turns has no shared turn: one turn per workload, not two, and
    # no shared adapter pulled towards each new workload in turn (what made the gate refuse every
    # candidate of a shifted workload for the forgetting it caused on the others: bench/RESULTS.md).
    shared_turn: bool = True
    # shared_turn off: a workload whose traffic stopped before the newest workload's began (the
    # tail of a shift) waits with its samples, unacked, while the newest workload is learnt first,
    # until the newest one's traffic has run this many seconds past the tail's last sample (by
    # the buffer's entry ids); then it takes its turn after the newer ones'. A round's workload
    # turns run newest traffic first.
    tail_wait_s: float = 300.0
    work_dir: str | None = None  # where candidates are written before registration (temp if None)
    # register each adapter's files in Redis too, for decoders on other hosts (AdapterRegistry.register's store_bytes)
    store_bytes: bool = False

    def __post_init__(self) -> None:
        if self.gate_on not in ("decode", "all"):
            raise ValueError(f"ServiceConfig.gate_on={self.gate_on!r}; choose 'decode' or 'all'")
        if not isinstance(self.gate_gamma, int) or isinstance(self.gate_gamma, bool) or self.gate_gamma < 1:
            raise ValueError(f"ServiceConfig.gate_gamma={self.gate_gamma!r}; use an integer >= 1 (the γ decoding is checked at)")
        if self.min_eval_requests < 2 or self.min_eval_positions < 1 or not 0 < self.confidence < 1:
            raise ValueError(f"min_eval_requests={self.min_eval_requests} (>= 2), min_eval_positions="
                             f"{self.min_eval_positions} (>= 1) and confidence={self.confidence} (in (0, 1)) are out of range")
        if not self.shared_turn and not self.per_workload:
            raise ValueError("ServiceConfig.shared_turn=False without per_workload=True: nothing would train; turn "
                             "per_workload on (DRAFTD_TRAINER__PER_WORKLOAD=true) or leave shared_turn on")
        if isinstance(self.tail_wait_s, bool) or not isinstance(self.tail_wait_s, (int, float)) \
                or not 0 <= self.tail_wait_s < math.inf:
            raise ValueError(f"ServiceConfig.tail_wait_s={self.tail_wait_s!r}; use a finite number of seconds >= 0 "
                             f"(0: a shift's tail never waits)")


@dataclass
class RoundReport:
    """What one round did; ``decision`` is one of idle, promoted, rejected, non_finite, error."""

    trigger: str
    started_at: float
    seconds: float = 0.0
    read: int = 0  # entries taken this round (reclaimed + new + carried over)
    reclaimed: int = 0
    trained_on: int = 0  # new samples given to the Distiller
    replayed: int = 0  # kept samples of other workloads mixed in (ServiceConfig.replay_per_workload)
    heldout_added: int = 0
    heldout_topped_up: int = 0  # of those, held out by the top-up (ServiceConfig.heldout_topup), not the hash
    decision: str = "idle"
    reason: str = ""
    version: int | None = None  # registered candidate version
    parent: int = 0  # promoted version it was compared with (0 = base draft)
    result: RoundResult | None = None
    evidence: dict | None = None  # trainer.gate.PairedGain.to_dict(): the paired gain and its interval
    before: dict | None = None  # EvalResult.to_dict() of the promoted adapter
    after: dict | None = None  # EvalResult.to_dict() of the candidate
    acked: int = 0
    deferred: int = 0  # shared_turn off: training samples of workloads below min_workload_samples, kept for the next round (unacked)
    dead_lettered: int = 0  # records of this round that could not train, moved to the dead-letter stream with their reasons
    # per_workload: workload -> ScopeReport.to_dict() of its own adapter's turn this round
    scopes: dict[str, dict] = field(default_factory=dict)
    head: dict | None = None  # trainer.heads.HeadReport.to_dict() of the head's turn (TrainerService(heads=...))
    # shared_turn off: {workload: the newer workload its records wait behind} (a shift's tail)
    waits: dict[str, str] = field(default_factory=dict)
    # a workload turn that gave way to another's newer traffic: {"workload", "to", "steps"} (_yield_check)
    yielded: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self, number: int) -> dict:
        """This round in a few fields, as :meth:`TrainerService.rounds_log` keeps it: ``number`` (1 =
        the process's first round), ``started_at`` (s since the epoch), ``seconds``, the decision,
        the counts, ``waits``, ``yielded``, and per workload turn its decision, version, steps,
        samples, held-out α before and after (None where not measured) and the gate's paired gain
        with its interval (``evidence``: :class:`trainer.gate.PairedGain` fields, or None)."""
        def num(x):
            return None if isinstance(x, float) and not math.isfinite(x) else x

        turns = {w: {"decision": r.get("decision"), "version": r.get("version"), "steps": r.get("steps", 0),
                     "trained_on": r.get("trained_on", 0), "alpha_before": num(r.get("alpha_before")),
                     "alpha_after": num(r.get("alpha_after")),
                     "evidence": None if not r.get("evidence") else {k: num(v) for k, v in r["evidence"].items()},
                     "reason": r.get("reason", "")}
                 for w, r in self.scopes.items()}
        return {"round": number, "trigger": self.trigger, "started_at": self.started_at, "seconds": self.seconds,
                "decision": self.decision, "version": self.version, "read": self.read, "trained_on": self.trained_on,
                "deferred": self.deferred, "acked": self.acked, "dead_lettered": self.dead_lettered,
                "waits": dict(self.waits), "yielded": dict(self.yielded) if self.yielded else None, "turns": turns,
                "reason": self.reason}


@dataclass
class ScopeReport:
    """One workload adapter's turn in a round; ``decision``: promoted, rejected, non_finite, skipped."""

    scope: str
    trained_on: int = 0
    decision: str = "skipped"
    reason: str = ""
    version: int | None = None  # registered candidate version
    parent: int = 0  # the version serving the workload before (its own, else the shared one)
    alpha_before: float = float("nan")  # held-out alpha of ``parent`` on this workload
    alpha_after: float = float("nan")  # ... of the candidate
    steps: int = 0
    evidence: dict | None = None  # trainer.gate.PairedGain.to_dict()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Scope:
    """A workload scope as the trainer follows it."""

    version: int = 0  # the scope's own promoted version (0 = none: the shared adapter serves it)
    state: AdapterState | None = None  # that version's weights
    context: tuple[AdapterState, dict, int] | None = None  # its candidate, optimiser, round counter
    context_from: int = -1  # the serving version that candidate was trained from
    error: str | None = None  # why the scope's active version could not be loaded (its turn is skipped)


def _plain(x: Any) -> Any:
    """A dataclass as a dict of its scalar fields (status is JSON); anything else as it is."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: v for k, v in dataclasses.asdict(x).items() if isinstance(v, (str, int, float, bool, type(None)))}
    return x


class StandbyError(RuntimeError):
    """A round was asked of a trainer that does not hold the trainer lease."""


def is_heldout(key: str, fraction: float) -> bool:
    """Deterministic split: the first 8 hex digits of sha256(key) as a fraction of 2^32."""
    h = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16)
    return h < fraction * 2**32


def split_key(sample) -> str:
    """What the held-out split hashes: the record's whole prompt, i.e. ``prompt_ids`` for a
    decode record and ``prompt_ids + output_ids`` (the teacher-forced text) for a prefill record.

    So a request's prefill and decode records land on the same side, and a prompt served again
    (traffic repeats) lands where it landed before: a held-out record never has a twin with the
    same prompt among the training records, and held-out alpha measures unseen prompts."""
    ids = sample.prompt_ids if sample.source == "decode" else np.concatenate([sample.prompt_ids, sample.output_ids])
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i4").tobytes()).hexdigest()


# shared_turn off: rounds a workload's training sample may wait for its workload to gather
# min_workload_samples; past them it trains the shared adapter (a workload that stopped sending
# traffic never strands its last samples)
_DEFER_ROUNDS = 3
_TRAINED_KEYS_KEPT = 65536  # split keys remembered per workload (trained) and in all (topped-up held out)
_ROUNDS_KEPT = 512  # round summaries TrainerService.rounds_log keeps (a quick demo runs about 20-40 rounds)


def _newest_by_workload(entries: list[Any]) -> dict[str, int]:
    """{workload: the stream time (ms) of its newest entry}, for tagged entries with a stream id."""
    newest: dict[str, int] = {}
    for e in entries:
        ms, w = _entry_ms(e), e.sample.workload
        if w and ms is not None:
            newest[w] = max(newest.get(w, ms), ms)
    return newest


def _entry_ms(entry: Any) -> int | None:
    """The time part (ms) of a buffer entry's Redis stream id (``b"1796676802061-0"``); None for an
    id that has none."""
    eid = getattr(entry, "entry_id", None)
    if isinstance(eid, bytes):
        eid = eid.decode(errors="replace")
    try:
        return int(str(eid).split("-", 1)[0])
    except ValueError:
        return None


def _lean(sample: VerifiedSample) -> VerifiedSample:
    """The sample without its hidden states (schema 2), for what the LoRA trainer keeps in memory
    (held-out and replay pools): it never reads them, and they are 6.5x a record's top-k rows."""
    return dataclasses.replace(sample, hidden=None) if getattr(sample, "hidden", None) is not None else sample


def replay_mix(new: list[VerifiedSample], kept: dict[str, Any], ratio: float = 1.0) -> list[VerifiedSample]:
    """Replayed samples for a round (pure): up to ``ratio * len(new)`` of the kept samples of workloads
    absent from ``new``, newest first, taken round-robin across those workloads (oldest-first
    sequences per workload in ``kept``)."""
    if not ratio > 0:  # also NaN
        return []
    present = {s.workload for s in new}
    pools = [list(reversed(d)) for w, d in sorted(kept.items()) if w not in present and d]
    out: list[VerifiedSample] = []
    i = 0
    cap = int(min(ratio * len(new), sum(len(p) for p in pools)))  # an infinite ratio replays all kept
    while len(out) < cap and any(i < len(p) for p in pools):
        out += [p[i] for p in pools if i < len(p)][: cap - len(out)]
        i += 1
    return out


@dataclass(frozen=True)
class Verdict:
    """The gate's decision: ``promote``, why, the paired evidence (None when no workload could be
    judged), and ``worse``: the candidate measured below the serving version (a negative pooled
    gain, or a workload regressed past ``regress_margin``), so its weights and the round's
    samples must not be trained on further."""

    promote: bool
    reason: str
    evidence: PairedGain | None = None
    worse: bool = False


def _measured_losses(before: EvalResult, after: EvalResult, enough: set[str], trained: set[str],
                     clusters: dict[str, str] | None, cfg: ServiceConfig) -> str:
    """The workloads of ``enough`` (enough held-out samples) whose acceptance as served measurably
    fell (the paired interval over >= 2 requests entirely below 0), as the gate's reason says them:
    the candidate's own (trained) workloads apart from the others, since a loss on its own workload
    can stand beside a pooled α at T = 1 that rose. "" when none lost."""
    own, other = [], []
    for w in sorted(enough):
        pw = paired_gain(counts_by_record(before.per_sample, {w}), counts_by_record(after.per_sample, {w}),
                         clusters, cfg.confidence)
        if pw.clusters >= 2 and pw.high < 0:
            (own if w in trained else other).append(
                f"{w} {pw.gain:+.4f} ({percent(pw.confidence)} % CI [{signed(pw.low)}, {signed(pw.high)}])")
    parts = []
    if own:
        parts.append(f"{'its own workload' if len(own) == 1 else 'its own workloads'} "
                     f"({', '.join(x.split(' ', 1)[0] for x in own)}) measurably lost acceptance as served: {'; '.join(own)}")
    if other:
        parts.append(f"{'another workload' if len(other) == 1 else 'other workloads'} "
                     f"({', '.join(x.split(' ', 1)[0] for x in other)}) measurably lost: {'; '.join(other)}")
    return "; and ".join(parts)


def gate(before: EvalResult, after: EvalResult, trained: set[str], cfg: ServiceConfig,
         clusters: dict[str, str] | None = None) -> Verdict:
    """The promotion decision, its reason and its evidence (pure).

    Judged: the trained workloads with >= ``min_eval_samples`` held-out samples. Promote iff, on
    their held-out records paired per position (``trainer.gate.paired_gain``, clusters = the
    records' prompts, record id -> key), there are >= ``min_eval_requests`` requests and
    >= ``min_eval_positions`` positions, the pooled gain of acceptance as served
    (``EvalCounts.served``: greedy agreement on greedy requests, α at the request's temperature on
    sampled ones; what the decoder will see) is >= ``promote_margin``, the lower bound of its
    ``confidence`` interval is above 0, and no workload with ``min_eval_samples`` held-out samples
    loses more than ``regress_margin`` of it (point estimate; the candidate is then *worse*) or
    measurably loses any (its own paired interval entirely below 0: refused, trained on), and the
    judged records' acceptance decoded at ``gate_gamma`` (``trainer.gate.paired_decoded_gain``)
    does not measurably fall (its paired interval entirely below 0: refused, *worse*); where that
    decoded reading covers >= 2 requests, the lower bound of its interval must be above 0 too (the
    demo's target is decoded α: a walkthrough's candidate, its gain as served barely above 0 and its
    decoded gain's interval reaching below 0, lowered decoded α on never-served prompts). The
    evidence is None when no workload could be judged.
    """
    enough = {w for w, c in after.per_workload.items() if c.samples >= cfg.min_eval_samples}
    judged = sorted(trained & enough)
    if not judged:
        have = {w: c.samples for w, c in sorted(after.per_workload.items())}
        return Verdict(False, f"not enough held-out samples on the trained workloads {sorted(trained)} "
                              f"(held out: {have}; need min_eval_samples={cfg.min_eval_samples})")
    pg = paired_gain(counts_by_record(before.per_sample, set(judged)), counts_by_record(after.per_sample, set(judged)),
                     clusters, cfg.confidence)
    b, a = before.pooled(judged), after.pooled(judged)
    head = f"on {', '.join(judged)}: {pg.describe()} (acceptance as served); α at T=1 {b.alpha:.3f} -> {a.alpha:.3f}"
    regressed = [
        f"{w} {before.per_workload[w].served:.4f} -> {after.per_workload[w].served:.4f}"
        for w in sorted(enough)
        if w in before.per_workload and before.per_workload[w].served - after.per_workload[w].served > cfg.regress_margin
    ]
    worse = bool(regressed) or not pg.gain >= 0
    if regressed:
        return Verdict(False, f"{head}, but regressed more than regress_margin {cfg.regress_margin}: "
                              f"{'; '.join(regressed)}", pg, True)
    lost = _measured_losses(before, after, enough, trained, clusters, cfg)
    if lost:
        return Verdict(False, f"{head}, but {lost}", pg, worse)
    dg = paired_decoded_gain(before.per_sample, after.per_sample, set(judged), clusters, cfg.confidence)
    decoded = (f"decoded at γ={cfg.gate_gamma} {dg.before:.4f} -> {dg.after:.4f} ({dg.gain:+.4f}, "
               f"{percent(dg.confidence)} % CI [{signed(dg.low)}, {signed(dg.high)}])")
    if dg.clusters >= 2 and dg.high < 0:
        # a per-position gain can sit beside fewer accepted proposals: decoding never proposes at a
        # bonus position and starts each block after a correction (issue 34)
        return Verdict(False, f"{head}, but its acceptance {decoded} measurably fell: decoding these held-out "
                              f"requests would accept fewer proposals", pg, True)
    if dg.clusters:  # records evaluated without the decoded counts (none proposed) say nothing of it
        head = f"{head}; {decoded}"
    short = []
    if pg.clusters < cfg.min_eval_requests:
        short.append(f"{pg.clusters} requests, need min_eval_requests={cfg.min_eval_requests}")
    if pg.positions < cfg.min_eval_positions:
        short.append(f"{pg.positions} positions, need min_eval_positions={cfg.min_eval_positions}")
    if short:  # only the minimums not met (a walkthrough read "need min_eval_requests=8" of 8 requests)
        return Verdict(False, f"not enough evidence {head}: {'; '.join(short)}", pg, worse)
    if not pg.gain >= cfg.promote_margin:
        # a walkthrough read "α at T=1 0.432 -> 0.438: the gain is below promote_margin 0.0" as a typo:
        # the gain judged is acceptance as served, which fell while α at T=1 rose
        # (α at T=1 equal as printed, 3 decimals, "held": a walkthrough read "0.475 -> 0.475 ... rose")
        moved = "held" if f"{a.alpha:.3f}" == f"{b.alpha:.3f}" else "rose"
        fell = (f"; it fell while α at T=1 {moved}: the gate judges acceptance as served, what the decoder sees"
                if pg.gain < 0 and a.alpha > b.alpha else "")
        return Verdict(False, f"{head}: its gain as served, {pg.gain:+.4f}, is below promote_margin "
                              f"{cfg.promote_margin:g}{fell}", pg, worse)
    if not pg.low > 0:
        # a walkthrough read "CI [+0.0000, +0.0534] ...: the lower bound is not above 0" as met: a bound
        # of exactly 0 (resamples that missed the one request that gained) is said to be one
        at = " (it is exactly 0: the gate needs it above 0)" if pg.low == 0 else ""
        return Verdict(False, f"{head}: the interval's lower bound is not above 0{at}", pg, worse)
    return _promotion(head, pg, dg, cfg, worse)


def _promotion(head: str, pg: PairedGain, dg: PairedGain, cfg: ServiceConfig, worse: bool) -> Verdict:
    """The gate's last word on a candidate whose gain as served cleared ``promote_margin`` and 0
    with its lower bound: promoted, unless its decoded reading ``dg`` (over >= 2 requests) has a
    lower bound not above 0 (:func:`gate`)."""
    regress = f"no workload regressed > {cfg.regress_margin:g}"
    if dg.clusters < 2:
        # a walkthrough read "... decoded ... CI [-0.0040, +0.0367]: gain >= promote_margin 0.0, lower bound > 0"
        # as the decoded interval's bound: what it was promoted on is said with its numbers
        return Verdict(True, f"{head}: promoted on acceptance as served, its gain {pg.gain:+.4f} >= promote_margin "
                             f"{cfg.promote_margin:g} and its lower bound {pg.low:+.4f} > 0; {regress}", pg)
    if not dg.low > 0:
        # a walkthrough (7746fc5) promoted math at +0.0247 [+0.0052, +0.0430] as served, decoded +0.0228
        # [-0.0060, +0.0494], and its decoded α on never-served math prompts fell -0.020 [-0.039, -0.003]
        return Verdict(False, f"{head}: acceptance as served gained (lower bound {pg.low:+.4f} > 0), but the "
                              f"decoded reading's lower bound {dg.low:+.4f} is not above 0: a gain decoding may not "
                              f"see is not promoted", pg, worse)
    return Verdict(True, f"{head}: promoted on acceptance as served and decoded, its gain {pg.gain:+.4f} >= "
                         f"promote_margin {cfg.promote_margin:g} and both lower bounds above 0 ({pg.low:+.4f} as "
                         f"served, {dg.low:+.4f} decoded); {regress}", pg)


def gate_slice(heldout: list[VerifiedSample], cfg: ServiceConfig) -> list[VerifiedSample]:
    """The held-out records the gate judges on (``ServiceConfig.gate_on``), in their order."""
    if cfg.gate_on == "all":
        return heldout
    by_w: dict[str, int] = {}
    for s in heldout:
        if s.source == "decode":
            by_w[s.workload] = by_w.get(s.workload, 0) + 1
    return [s for s in heldout if s.source == "decode" or by_w.get(s.workload, 0) < cfg.min_eval_samples]


def group_lag(client: Any, store_config: Any, group: str, *, reclaim_min_idle_ms: int | None = None,
              consumer: str | None = None) -> int:
    """Entries waiting for ``group``, the check job's input: those not yet delivered (XINFO GROUPS
    lag; 0 if unknown), plus, with ``reclaim_min_idle_ms``, the pending entries another consumer
    than ``consumer`` has held that long (a dead trainer's: the next round reclaims them)."""
    lag = 0
    for g in group_info(client, store_config):
        if g.name == group:
            lag = int(g.lag or 0)
    if reclaim_min_idle_ms is not None:
        from store.buffer import reclaimable_count

        lag += reclaimable_count(client, store_config, group, reclaim_min_idle_ms, consumer)
    return lag


class TrainerService:
    """Rounds of distillation from the buffer into registered, gated adapters.

    Args:
        reader: ``store.buffer.SampleReader`` (read / reclaim / ack).
        registry: ``store.registry.AdapterRegistry`` (register / promote / set_state /
            active_version / fetch).
        distiller: the ``Distiller`` wrapping the draft.
        config: ServiceConfig.
        clock: seconds since the epoch (timestamps and round durations), injected for tests.
        backlog: callable returning how many new entries wait (e.g. ``group_lag``); without it
            the check job is not scheduled and rounds run on the interval only.
    """

    def __init__(
        self,
        reader: Any,
        registry: Any,
        distiller: Distiller,
        config: ServiceConfig,
        clock: Callable[[], float] = time.time,
        backlog: Callable[[], int] | None = None,
        warm_start: Callable[[], Any] | None = None,
        heads: Any = None,
        leadership: Any = None,
    ):
        self.reader = reader
        # store.lease.Leadership (several daemons on one Redis): scheduled rounds run only while it
        # leads; its fencing token rides on the registry writes (set by its on_acquire). None: always
        self.leadership = leadership
        # trainer.heads.HeadTrainer: each round also distils the feature-level head on the same
        # split (records with hidden states), judged and published through its own registry
        self.heads = heads
        self.registry = registry
        self.distiller = distiller
        self.config = config
        self.clock = clock
        self.backlog = backlog
        self._lock = threading.Lock()
        self._cut_lock = threading.Lock()
        self._round_running = False
        self._waiting: set[Any] = set()  # entry ids of a shift's tail carried to the next round (_newest_first)
        self._yielded: str | None = None  # the workload whose turn gave way this round (_yield_check), and to which
        self._yielded_to: str | None = None
        self._yield_every_s = 2.0  # how often a workload turn reads the records arriving meanwhile
        # per workload, the records its turn read meanwhile this round (a turn retried alone keeps what it saw)
        self._turn_seen: dict[str, list[tuple[int, str, bool]]] = {}
        self._read_meanwhile = 0  # records _yield_check read into the carry since the last round took it (_check counts them)
        self._paused = False
        self._rounds = 0
        self._last: RoundReport | None = None
        self._history: deque[dict] = deque(maxlen=_ROUNDS_KEPT)  # RoundReport.summary() of the latest rounds
        self._heldout: dict[str, deque[VerifiedSample]] = {}
        self._replay: dict[str, deque[VerifiedSample]] = {}
        # split keys (prompts) trained on, and those the top-up holds out, per workload; bounded
        self._trained_keys: dict[str, OrderedDict[str, None]] = {}
        self._topup_keys: OrderedDict[str, None] = OrderedDict()
        self._carry: list[Any] = []  # entries read beyond max_samples_per_round, or deferred, for the next round
        self._deferred: dict[str, int] = {}  # record id -> rounds it has waited (ServiceConfig.shared_turn off)
        # workload -> stream time (ms) of its newest record in the last round: a workload whose newest record
        # is newer than that is still sending, and its waiting records do not count the round (_process_once)
        self._newest_seen: dict[str, int] = {}
        self._promoted_version = -1  # unknown until the first sync (and again after a failed one)
        self.sync_error: str | None = None  # why the registry's active adapter could not be loaded
        self._promoted_state: AdapterState | str = BASE
        # version -> record id -> (workload, EvalCounts): served adapters' held-out evaluations
        self._eval_cache: dict[int, dict[str, tuple[str, Any]]] = {}
        self._scopes: dict[str, _Scope] = {}  # per_workload: workload -> its scope
        # per_workload: workload -> its own adapter's turns so far: "turns" (trained), "judged" (the
        # gate had min_eval_requests and min_eval_positions of evidence), "promoted"
        self._turns: dict[str, dict[str, int]] = {}
        self._scheduler: BackgroundScheduler | None = None
        self._next_trigger = "interval"
        # run once, under the round lock, before the first round (daemon.warm_start: v0 bootstrapped)
        self._warm_start = warm_start
        self.warm_start_result: Any = None  # what it returned (or "failed: ...")
        if config.work_dir is not None:
            self._work = Path(config.work_dir) / "candidates"
            shutil.rmtree(self._work, ignore_errors=True)  # leftovers of a killed process, never registered
            self._work.mkdir(parents=True, exist_ok=True)
        else:
            self._work = Path(tempfile.mkdtemp(prefix="draftd-candidates-"))

    # ---- scheduling ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background scheduler (round job + backlog check job)."""
        if self._scheduler is not None:
            return
        s = BackgroundScheduler(timezone=timezone.utc)
        first = {"next_run_time": datetime.now(timezone.utc)} if self._warm_start is not None else {}
        s.add_job(  # a pending warm start runs at once, as the first round's first step
            self._scheduled, "interval", seconds=self.config.interval_s, id="round", max_instances=1, coalesce=True,
            misfire_grace_time=None, **first,  # a run due while paused runs at resume (once: coalesce)
        )
        if self.backlog is not None:
            s.add_job(
                self._check, "interval", seconds=self.config.check_interval_s, id="check",
                max_instances=1, coalesce=True,
            )
        s.start(paused=self._paused)
        self._scheduler = s

    def stop(self, wait: bool = True, cut_round: bool = False) -> None:
        """Stop the scheduler; with ``wait``, after the round under way. ``cut_round``: that round
        ends its training at the next step (its candidate judged and registered as usual) and
        skips the workload turns it had not begun, whose entries stay pending (unacked) for the
        next trainer to take, and the head's turn: a stop that waits for a judgement, not for a
        round's training. No round under way: nothing to cut (the next round trains as usual)."""
        with self._cut_lock:
            if cut_round and self._round_running:
                self.distiller.interrupt.set()  # the round under way skips the turns it has not begun (_cutting)
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=wait)
            self._scheduler = None

    def pause(self) -> None:
        """Stop scheduled rounds (a running round finishes). ``run_round_now`` still works."""
        self._paused = True
        if self._scheduler is not None:
            self._scheduler.pause()

    def resume(self) -> None:
        self._paused = False
        if self._scheduler is not None:
            self._scheduler.resume()

    def _check(self) -> None:
        """Cheap job: pull the round forward when enough new entries wait."""
        sched = self._scheduler  # read once: stop() may clear it meanwhile
        if self._paused or self._lock.locked() or sched is None or not self.leading:
            return
        try:  # with the records a yielding turn read meanwhile (_yield_check): out of the lag, not yet trained
            waiting = (self.backlog() if self.backlog else 0) + self._read_meanwhile
        except Exception as e:  # noqa: BLE001 - a failed check must not kill the scheduler
            log.warning("trainer_backlog_check_failed", error=str(e))
            return
        if waiting >= self.config.min_new_samples:
            log.info("trainer_round_triggered", waiting=waiting, min_new_samples=self.config.min_new_samples)
            self._next_trigger = "backlog"
            sched.modify_job("round", next_run_time=datetime.now(timezone.utc))

    def _scheduled(self) -> None:
        trigger, self._next_trigger = self._next_trigger, "interval"
        if self._paused or not self.leading:  # a standby: the lease's holder trains
            return
        try:
            self.run_round_now(trigger)
        except Exception as e:  # noqa: BLE001 - reported in status, entries stay pending
            log.exception("trainer_round_failed", error=str(e))

    @property
    def leading(self) -> bool:
        """This trainer may train: it holds the trainer lease (or runs without one)."""
        return self.leadership is None or self.leadership.leading

    def status(self) -> dict:
        sched = self._scheduler  # read once: stop() may clear it meanwhile
        job = sched.get_job("round") if sched is not None else None
        nxt = job.next_run_time if job is not None else None
        return {
            "paused": self._paused,
            "running": self._lock.locked(),
            # v0's bootstrap: "pending" (before the first round), "running", then what it returned
            "warm_start": ("pending" if self._warm_start is not None and self.warm_start_result is None
                           else _plain(self.warm_start_result)),
            "rounds": self._rounds,
            "promoted_version": self._promoted_version,
            "workload_versions": {w: sc.version for w, sc in sorted(self._scopes.items())},
            "workload_turns": {w: dict(t) for w, t in sorted(self._turns.items())},
            "workload_errors": {w: sc.error for w, sc in sorted(self._scopes.items()) if sc.error},
            "next_run_time": nxt.isoformat() if nxt else None,
            "heldout": {w: len(d) for w, d in sorted(self._heldout.items())},
            "carried_over": len(self._carry),
            "sync_error": self.sync_error,
            "last_round": self._last.to_dict() if self._last else None,
            "heads": self.heads.status() if self.heads is not None else None,
            "lease": self.leadership.status() if self.leadership is not None else None,
        }

    def rounds_log(self, since: int = 0) -> list[dict]:
        """The latest rounds (at most the last ``_ROUNDS_KEPT``), oldest first, each as
        :meth:`RoundReport.summary` gives it: those whose ``round`` number is above ``since``."""
        return [r for r in list(self._history) if r["round"] > since]

    # ---- the round ---------------------------------------------------------------------------

    def run_round_now(self, trigger: str = "manual") -> RoundReport:
        """Run one round synchronously (waits for a running one to finish first).

        Raises:
            StandbyError: another trainer holds the lease (this one stands by).
        """
        if not self.leading:
            st = self.leadership.status()
            raise StandbyError(
                f"this trainer ({st['holder']}) stands by: {st['lease_holder'] or 'another trainer'} holds the trainer "
                f"lease (token {st['lease_token']}); run train-now on that daemon, or stop it and this one takes "
                f"over within {st['ttl_s']:.0f} s"
            )
        with self._lock:
            self._run_warm_start()
            report = RoundReport(trigger=trigger, started_at=self.clock())
            self._in_round(True)
            try:
                self._round(report)
            except Exception as e:
                report.decision, report.reason = "error", f"{type(e).__name__}: {e}"
                raise
            finally:
                self._in_round(False)
                report.seconds = self.clock() - report.started_at
                self._rounds += 1
                self._last = report
                self._history.append(report.summary(self._rounds))
                log.info(
                    "trainer_round", trigger=trigger, decision=report.decision, version=report.version,
                    read=report.read, trained_on=report.trained_on, seconds=round(report.seconds, 2),
                    reason=report.reason,
                )
            return report

    @property
    def _cutting(self) -> bool:
        """stop(cut_round=True) was asked during the round under way (the Distiller's interrupt)."""
        return self.distiller.interrupt.is_set()

    def _in_round(self, running: bool) -> None:
        """Mark a round as under way (what stop(cut_round=True) cuts) or over: a cut never outlives
        the round it was meant for."""
        with self._cut_lock:
            self._round_running = running
            if not running:
                self.distiller.interrupt.clear()

    def _run_warm_start(self) -> None:
        """The pending warm start, once (a failure is logged and reported in status, never retried:
        the rounds go on from whatever the registry serves)."""
        fn = self._warm_start
        if fn is None:
            return
        self.warm_start_result = "running"
        try:
            self.warm_start_result = fn()
            log.info("trainer_warm_start", result=_plain(self.warm_start_result))
        except BaseException as e:  # the trainer must start anyway, from the base draft or what the registry serves
            self.warm_start_result = f"failed: {type(e).__name__}: {e}"
            self.distiller.reset_adapter()
            self._promoted_version = -1  # the next sync loads whatever is active
            log.exception("trainer_warm_start_failed", error=str(e))
            if not isinstance(e, Exception):
                raise
        finally:
            self._warm_start = None

    def _sync_active(self) -> None:
        """Follow the registry's active version (ours, or an operator's promote/rollback).

        An active version that cannot be loaded (corrupt, missing, non-finite) leaves the weights
        as they were and the followed version unknown, so the round fails without reading
        anything (entries stay pending) and the next round syncs again, e.g. after a rollback."""
        active = self.registry.active_version()
        if active == self._promoted_version and self.distiller.weights_finite:
            return
        if active == 0:
            if self._promoted_version > 0 or self.sync_error is not None or not self.distiller.weights_finite:
                # rolled back to the base draft (or the weights are broken): restart from it
                self.distiller.reset_adapter()
            self._promoted_state = BASE
        else:
            try:
                self.distiller.load_adapter_weights(self.registry.fetch(active))
            except (RegistryError, TrainerError) as e:
                self._promoted_version = -1
                self.sync_error = f"active adapter v{active} cannot be loaded: {type(e).__name__}: {e}"
                log.error("trainer_active_adapter_unloadable", version=active, error=str(e))
                raise TrainerError(f"{self.sync_error}; roll it back (daemonctl adapters rollback) or promote another") from e
            self._promoted_state = self.distiller.adapter_state()
        self.sync_error = None
        if self._promoted_version != -1 or active != 0:
            log.info("trainer_follows_active_adapter", previous=self._promoted_version, active=active)
        self._promoted_version = active

    def _sync_scopes(self) -> None:
        """Follow each workload scope's active version (ours, or an operator's promote/rollback):
        a change restarts that scope's training from what now serves it."""
        for w, active in self.registry.active_versions().items():
            if not w:
                continue
            sc = self._scopes.setdefault(w, _Scope())
            if active == sc.version and sc.error is None:
                continue
            state = None
            if active:
                saved = self.distiller.training_context()
                try:
                    self.distiller.load_adapter_weights(self.registry.fetch(active))
                    state = self.distiller.adapter_state()
                except (RegistryError, TrainerError) as e:  # a bad artifact of one workload stops only its turns
                    sc.error = f"its active adapter v{active} cannot be loaded: {type(e).__name__}: {e}"
                    log.error("trainer_workload_adapter_unloadable", workload=w, version=active, error=str(e))
                    continue
                finally:
                    self.distiller.load_training_context(saved)
            log.info("trainer_follows_workload_adapter", workload=w, previous=sc.version, active=active)
            sc.version, sc.state, sc.context, sc.error = active, state, None, None

    def _served(self, workload: str | None) -> tuple[int, AdapterState | str]:
        """(version, weights) serving ``workload``'s requests (None: the shared scope)."""
        sc = self._scopes.get(workload) if workload else None
        if sc is not None and sc.version:
            return sc.version, sc.state
        return self._promoted_version, self._promoted_state

    def _evaluate_served(self, heldout: list[VerifiedSample], version: int, state: AdapterState | str) -> EvalResult:
        """A served adapter on the held-out slice, evaluating only samples it has not been
        evaluated on yet (a version's weights never change, and the held-out slice changes by a
        few samples per round, so most of the round's "before" is already known: from the
        previous rounds, or from the round that promoted it)."""
        cache = self._eval_cache.get(version, {})
        fresh = self.distiller.evaluate([s for s in heldout if s.record_id not in cache], adapter=state,
                                         gamma=self.config.gate_gamma)
        cache = {**cache, **fresh.per_sample}
        res = EvalResult()
        for s in heldout:
            if s.record_id in cache:
                w, c = cache[s.record_id]
                res.add_sample(s.record_id, w, c)
        self._eval_cache[version] = cache
        return res

    def _prune_eval_cache(self) -> None:
        """Keep the evaluations of the served versions only, on samples still held out."""
        served = {self._promoted_version} | {sc.version for sc in self._scopes.values() if sc.version}
        keep = {s.record_id for d in self._heldout.values() for s in d}
        self._eval_cache = {v: {k: x for k, x in c.items() if k in keep} for v, c in self._eval_cache.items() if v in served}

    def _take(self, report: RoundReport) -> list[Any]:
        cfg = self.config
        entries, self._carry, self._read_meanwhile = self._carry, [], 0
        # a shift's waiting tail (_newest_first) rides along without taking the round's room: the newer
        # workload's records must still fit, or its turn never comes while the tail waits for it
        cap = cfg.max_samples_per_round + sum(1 for e in entries if e.entry_id in self._waiting)
        reclaimed = self.reader.reclaim(cfg.reclaim_min_idle_ms)
        report.reclaimed = len(reclaimed)
        entries.extend(reclaimed)
        while len(entries) < cap:
            got = self.reader.read(count=cap - len(entries), block_ms=cfg.read_block_ms)
            if not got:
                break
            entries.extend(got)
        entries, self._carry = entries[:cap], entries[cap:]
        report.read = len(entries)
        return entries

    def _round(self, report: RoundReport) -> None:
        self._sync_active()
        if self.config.per_workload:
            self._sync_scopes()
        report.parent = self._promoted_version
        entries = self._take(report)
        try:
            self._process(report, entries)
        except BaseException:
            # Not acked, and the reader will not hand them out again (they are ours, pending):
            # keep them for the next round of this process (once: the round may have carried some already)
            mine = {id(e) for e in entries}
            self._carry = entries + [e for e in self._carry if id(e) not in mine]
            raise

    def _screen(self, report: RoundReport, entries: list[Any]) -> None:
        """Dead-letter (with the reason) the entries this draft cannot use, checked against the
        pair: an empty prompt, a token id beyond the vocabulary, a top-k width other than the
        buffer's (that of the held-out samples, else the round's most common). ``entries`` is
        edited in place."""
        widths = [s.topk_ids.shape[1] for d in self._heldout.values() for s in d if s.num_tokens]
        if not widths:
            widths = [e.sample.topk_ids.shape[1] for e in entries if e.sample.num_tokens]
        width = max(set(widths), key=widths.count) if widths else None
        bad = [(e, why) for e in entries if (why := self.distiller.sample_problem(e.sample, width))]
        self._drop(report, entries, bad)

    def _drop(self, report: RoundReport, entries: list[Any], bad: list[tuple[Any, str]]) -> None:
        if not bad:
            return
        n = self.reader.dead_letter(bad)
        report.dead_lettered += n
        ids = {e.entry_id for e, _ in bad}
        rids = {e.sample.record_id for e, _ in bad}
        entries[:] = [e for e in entries if e.entry_id not in ids]
        for w, d in self._heldout.items():
            self._heldout[w] = deque((x for x in d if x.record_id not in rids), maxlen=d.maxlen)
        for e, why in bad:
            log.warning("trainer_record_dead_lettered", record_id=e.sample.record_id, reason=why)

    def _isolate(self, entries: list[Any]) -> tuple[list[tuple[Any, str]], int]:
        """After a failed round: the entries that fail on their own, by running each through the
        loss, and how many held-out samples of earlier rounds failed so (dropped from the held-out
        set; they were acked then)."""
        bad = [(e, why) for e in entries if (why := self.distiller.probe(e.sample))]
        dropped = 0
        for w, d in self._heldout.items():
            kept = deque((x for x in d if self.distiller.probe(x) is None), maxlen=d.maxlen)
            dropped += len(d) - len(kept)
            self._heldout[w] = kept
        if dropped:
            log.warning("trainer_heldout_samples_dropped", n=dropped, why="they fail the loss on their own")
        return bad, dropped

    def _process(self, report: RoundReport, entries: list[Any]) -> None:
        """Screen the entries, then train on them; when the round raises, find the records that
        fail on their own, dead-letter them and train once more on the rest (a poison record
        never strands the good ones). ``entries`` is edited in place."""
        self._screen(report, entries)
        try:
            self._process_once(report, entries)
        except Exception as e:
            if not isinstance(e, (TrainerError, IndexError, ValueError, RuntimeError)):
                raise
            bad, heldout_dropped = self._isolate(entries)
            if not bad and not heldout_dropped:
                raise
            log.warning("trainer_round_retried_without", records=[x.sample.record_id for x, _ in bad], error=str(e))
            self._drop(report, entries, [(x, f"{why} (the round failed with {type(e).__name__}: {e})") for x, why in bad])
            self._process_once(report, entries)

    def _topup(self, keyed: list[tuple[Any, str]], held: set[str]) -> set[str]:
        """The split keys the held-out top-up adds this round (``ServiceConfig.heldout_topup``):
        per workload short of ``min_eval_samples`` held out (kept, plus this round's) or of
        ``min_eval_requests`` held-out prompts (what the gate's interval needs), whole prompts in
        arrival order that were never trained on, until it has enough, never the workload's last
        prompt in training this round."""
        cfg = self.config
        by_w: dict[str, dict[str, int]] = {}  # workload -> this round's training keys -> records
        have: dict[str, int] = {}
        have_keys: dict[str, set[str]] = {}
        for e, k in keyed:
            w = e.sample.workload
            if k in held:
                have[w] = have.get(w, 0) + 1
                have_keys.setdefault(w, set()).add(k)
            else:
                by_w.setdefault(w, {})
                by_w[w][k] = by_w[w].get(k, 0) + 1
        added: set[str] = set()
        for w, keys in by_w.items():
            n = len(self._heldout.get(w, ())) + have.get(w, 0)
            prompts = have_keys.get(w, set()) | {split_key(s) for s in self._heldout.get(w, ())}
            trained = self._trained_keys.get(w, {})
            fresh = [k for k in keys if k not in trained]
            left = len(keys)  # this round's training prompts of w
            while (n < cfg.min_eval_samples or len(prompts) < cfg.min_eval_requests) and fresh and left > 1:
                k = fresh.pop(0)
                added.add(k)
                prompts.add(k)
                n += keys[k]
                left -= 1
        for k in added:
            self._topup_keys[k] = None
        while len(self._topup_keys) > _TRAINED_KEYS_KEPT:  # bounded: the oldest are forgotten, as on restart
            self._topup_keys.popitem(last=False)
        if added:
            log.info("trainer_heldout_topup", prompts=len(added))
        return added

    def _process_once(self, report: RoundReport, entries: list[Any]) -> None:
        cfg = self.config
        if not self.distiller.weights_finite:
            raise TrainerError("the adapter's weights are not finite before the round; not training (entries kept pending)")
        train, heldout_entries = [], []
        keyed = [(e, split_key(e.sample)) for e in entries]
        held = {k for e, k in keyed if is_heldout(k, cfg.holdout_fraction) or k in self._topup_keys}
        if cfg.heldout_topup:
            held |= self._topup(keyed, held)
        for e, key in keyed:
            s = e.sample
            if key in held:
                d = self._heldout.setdefault(s.workload, deque(maxlen=cfg.holdout_per_workload))
                if all(x.record_id != s.record_id for x in d):
                    d.append(_lean(s))
                    report.heldout_added += 1
                    report.heldout_topped_up += key in self._topup_keys
                heldout_entries.append(e)
            else:
                train.append(e)
                tk = self._trained_keys.setdefault(s.workload, OrderedDict())
                tk[key] = None
                tk.move_to_end(key)
                while len(tk) > _TRAINED_KEYS_KEPT:
                    tk.popitem(last=False)
        report.trained_on = len(train)
        if not train:
            report.decision, report.reason = "idle", "no new training samples"
            report.acked = self.reader.ack(heldout_entries)  # kept in memory; nothing to register
            return
        own: dict[str, list[VerifiedSample]] = {}  # per_workload: the workloads taking their own turn
        if cfg.per_workload:
            by_w: dict[str, list[VerifiedSample]] = {}
            for e in train:
                by_w.setdefault(e.sample.workload, []).append(e.sample)
            own = {w: smp for w, smp in sorted(by_w.items()) if w and len(smp) >= cfg.min_workload_samples}
        deferred: list[Any] = []  # shared turn off: a workload's samples wait (unacked) for enough to train its own
        behind: dict[str, str] = {}
        if not cfg.shared_turn:
            sending = self._still_sending(train)
            own, behind = self._newest_first(own, train)
            report.waits = dict(behind)
            self._waiting = {e.entry_id for e in train if e.sample.workload in behind}
            for e in train:
                rid, w = e.sample.record_id, e.sample.workload
                if w in behind:  # a shift's tail: waits for the newer workload, not counted as deferred for want of samples
                    deferred.append(e)
                elif w and w not in own and self._deferred.get(rid, 0) < _DEFER_ROUNDS:
                    self._deferred[rid] = self._deferred.get(rid, 0) + (w not in sending)
                    deferred.append(e)
        later = {id(e) for e in deferred}
        report.deferred = len(deferred)
        report.trained_on -= len(deferred)
        shared_train = train if cfg.shared_turn else [e for e in train if e.sample.workload not in own and id(e) not in later]
        if shared_train and self._shared_turn(report, shared_train):  # cut before its first step: all stay pending
            deferred += [e for e in train if id(e) not in later]
            report.deferred, report.trained_on, own = len(deferred), 0, {}
        elif not shared_train:
            report.decision, report.reason = "idle", (
                "no shared turn (trainer.shared_turn off): "
                + (f"{', '.join(own)} took their own turns" if own else "no workload had its own turn")
                + (f"; {len(deferred)} samples of workloads below min_workload_samples={cfg.min_workload_samples} "
                   f"or behind a newer one wait for the next round" if deferred else "")
                + "".join(f"; {w} (its traffic stopped before {v}'s began) waits behind {v}'s newer traffic"
                          for w, v in sorted(behind.items())))
        deferred += self._own_turns(report, own, train, entries)
        later = {id(e) for e in deferred}
        if self.heads is not None and not self._cutting:  # never raises: its report says what went wrong
            kept = {e.entry_id for e in entries}  # less the records a turn retried alone dead-lettered (_turn_isolating)
            report.head = self.heads.turn([e.sample for e in train if id(e) not in later],
                                          [e.sample for e in heldout_entries if e.entry_id in kept]).to_dict()
        self._prune_eval_cache()
        done = [e for e in entries if id(e) not in later]
        for e in done:
            self._deferred.pop(e.sample.record_id, None)
        self._carry = deferred + self._carry  # pending in the group, ours: taken first next round
        report.acked = self.reader.ack(done)

    def _still_sending(self, train: list[Any]) -> set[str]:
        """The workloads whose newest record in ``train`` is newer than their newest of the last round
        (by the buffer's stream ids): still sending, so the records they hold back for want of
        ``min_workload_samples`` wait without counting the round (the third walkthrough's round 6
        trained the shared adapter on two code records that had waited three 2-s rounds while code's
        traffic went on). Only a workload gone quiet reaches ``_DEFER_ROUNDS``."""
        newest = _newest_by_workload(train)
        sending = {w for w, ms in newest.items() if ms > self._newest_seen.get(w, -1)}
        self._newest_seen.update(newest)
        return sending

    def _own_turns(self, report: RoundReport, own: dict[str, list], train: list[Any], entries: list[Any]) -> list[Any]:
        """Each workload's own turn, in ``own``'s order, into ``report.scopes`` (a turn that fails on
        a record: :meth:`_turn_isolating`). Returns the entries of the turns skipped because the
        trainer is stopping (:meth:`stop` with ``cut_round``): they stay pending, counted in
        ``report.deferred``, not in ``trained_on`` (with ``shared_turn`` on the shared turn trained
        on them: none stay). ``train`` and ``entries`` lose the records dead-lettered meanwhile."""
        skipped: list[Any] = []
        self._yielded, self._turn_seen = None, {}
        newest_by_w = _newest_by_workload(train)
        for w, smp in own.items():
            newest = newest_by_w.get(w)
            rep = None if self._cutting or self._yielded else self._turn_isolating(report, w, smp, newest, train, entries)
            if rep is None or (rep.decision == "skipped" and (rep.steps == 0 and self._cutting or self._yielded == w)):
                mine = [e for e in train if e.sample.workload == w and not self.config.shared_turn]
                skipped += mine
                if self._yielded:  # a waiting tail now, beside the next round's room (_take)
                    self._waiting |= {e.entry_id for e in mine}
                    if rep is not None:
                        report.yielded = {"workload": w, "to": self._yielded_to, "steps": rep.steps}
                if rep is None:
                    continue
            self._count_turn(rep)
            report.scopes[w] = rep.to_dict()
        report.deferred += len(skipped)
        report.trained_on -= len(skipped)
        return skipped

    def _turn_isolating(self, report: RoundReport, w: str, smp: list, newest: int | None, train: list[Any],
                        entries: list[Any]) -> ScopeReport:
        """``w``'s own turn; where it raises on a record (as :meth:`_process`'s round does), the
        records of ``w`` that fail on their own (this round's, held-out ones included) are
        dead-lettered with the reason (kept held-out samples that fail are dropped: :meth:`_isolate`)
        and the turn alone runs once more without them: the turns already done this round stand
        (retrying the round trained and registered them twice). A failure with no such record, or a
        second one, raises (the round's retry, then the round's error)."""
        try:
            return self._workload_turn(w, smp, newest)
        except (TrainerError, IndexError, ValueError, RuntimeError) as e:
            bad, dropped = self._isolate([x for x in entries if x.sample.workload == w])
            if not bad and not dropped:
                raise
            log.warning("trainer_turn_retried_without", workload=w, records=[x.sample.record_id for x, _ in bad], error=str(e))
            self._drop(report, entries, [(x, f"{why} ({w}'s turn failed with {type(e).__name__}: {e})") for x, why in bad])
            gone = {x.entry_id for x, _ in bad}
            rids = {x.sample.record_id for x, _ in bad}
            report.trained_on -= sum(1 for x in train if x.entry_id in gone)
            train[:] = [x for x in train if x.entry_id not in gone]
            return self._workload_turn(w, [s for s in smp if s.record_id not in rids], newest)

    def _yield_check(self, workload: str, newest_ms: int | None) -> Callable[[], bool] | None:
        """shared_turn off: for ``workload``'s turn (its newest record at stream time ``newest_ms``), the
        check the Distiller asks before each step. At most every ``_yield_every_s`` it reads the records
        that arrived meanwhile (carried to the next round, pending) and says stop once they show the
        workload's traffic stopped and another's began: at least ``min_workload_samples`` records of
        another that would train (not held out), after the workload's last one (``newest_ms``, or a
        later one of its read meanwhile: a turn may begin while its traffic's last records still
        arrive), within ``tail_wait_s`` of it (a tail that waited that long trains, never starved).
        The records it reads count in the backlog check (``_read_meanwhile``), so the new workload's
        round comes as soon as without the yield. A round under way at a shift, begun before
        it, so gives way to the new workload; mixed traffic, the workload's own records among the
        others', does not."""
        if self.config.shared_turn or newest_ms is None:
            return None
        # (ms, workload, would train) of the records read meanwhile, this turn's tries together (_turn_isolating)
        cfg, seen, last = self.config, self._turn_seen.setdefault(workload, []), [-math.inf]

        def check() -> bool:
            if time.monotonic() - last[0] < self._yield_every_s:
                return False
            last[0] = time.monotonic()
            try:
                got = self.reader.read(count=cfg.max_samples_per_round)
            except Exception as e:  # noqa: BLE001 - a failed look never fails the turn
                log.warning("trainer_yield_check_failed", error=str(e))
                return False
            self._carry.extend(got)
            self._read_meanwhile += len(got)
            seen.extend((ms, e.sample.workload, not is_heldout(split_key(e.sample), cfg.holdout_fraction))
                        for e in got if (ms := _entry_ms(e)) is not None)
            # its own traffic's end (the turn may begin while the last of it still arrives), and what came after
            # that would train (held-out records never give a workload its turn: _process_once)
            end = max([newest_ms] + [ms for ms, w, _ in seen if w == workload])
            after: dict[str, list[int]] = {}
            for ms, w, trains in seen:
                if w and w != workload and ms > end and trains:
                    after.setdefault(w, []).append(ms)
            to = next((w for w, t in after.items() if len(t) >= cfg.min_workload_samples
                       and max(t) - end < cfg.tail_wait_s * 1e3), None)
            if to is not None:
                self._yielded, self._yielded_to = workload, to
                log.info("trainer_turn_yields", workload=workload, to=to)
            return to is not None

        return check

    def _newest_first(self, own: dict[str, list], train: list[Any]) -> tuple[dict[str, list], dict[str, str]]:
        """shared_turn off: the workload turns of a round, the most recent traffic first, and the
        workloads whose turn waits: {workload: the newer one it waits for}. A workload whose newest
        sample came before the first sample of the round's newest workload (its traffic stopped
        before that one's began: a shift's tail) waits, so the workload served now is not queued
        behind it, until the newest workload's traffic has run ``tail_wait_s`` past the tail's last
        sample. Times are the buffer's entry ids (Redis stream ids, ms); entries without one leave
        the turns as they are."""
        span: dict[str, list[int]] = {}  # workload -> [first, last] entry ms this round
        for e in train:
            ms, w = _entry_ms(e), e.sample.workload
            if ms is None:
                return own, {}
            if w:
                lo_hi = span.setdefault(w, [ms, ms])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], ms), max(lo_hi[1], ms)
        if not span:
            return own, {}
        v = max(span, key=lambda w: span[w][1])
        wait_ms = self.config.tail_wait_s * 1e3
        behind = {w: v for w in own if w != v and span[w][1] < span[v][0] and span[v][1] - span[w][1] < wait_ms}
        for w in behind:
            log.info("trainer_turn_waits", workload=w, behind=v, samples=len(own[w]))
        order = sorted((w for w in own if w not in behind), key=lambda w: -span[w][1])
        return {w: own[w] for w in order}, behind

    def _shared_turn(self, report: RoundReport, train: list[Any]) -> bool:
        """Train the shared adapter on ``train`` (entries) plus replay, judge and register it. Returns
        True when the trainer's stop (:meth:`stop` with ``cut_round``) came before its first step:
        nothing trained, judged or registered (the round's records stay pending)."""
        cfg = self.config
        heldout = gate_slice([s for d in self._heldout.values() for s in d], cfg)
        before = self._evaluate_served(heldout, self._promoted_version, self._promoted_state)
        new = [e.sample for e in train]
        replay = replay_mix(new, self._replay, cfg.replay_ratio) if cfg.replay_per_workload else []
        report.replayed = len(replay)
        result = self.distiller.train_round(new + replay)
        report.result = result
        if result.steps == 0 and self._cutting:
            report.decision, report.reason = "idle", ("the trainer stopped before the shared turn's first step "
                                                      "(stop(cut_round=True)): not judged; the round's records stay pending")
            return True
        report.before = before.to_dict()
        worse = True
        if not result.finite:
            report.decision, report.reason = "non_finite", f"round rolled back, not registered: {result.reason}"
            log.error("trainer_round_non_finite", reason=result.reason, samples=len(train))
        else:
            worse = self._judge_shared(report, train, heldout, before, result)
        if cfg.replay_per_workload and not worse:  # a round that made the draft worse leaves no samples behind
            for smp in new:
                self._replay.setdefault(smp.workload, deque(maxlen=cfg.replay_per_workload)).append(_lean(smp))
        return False

    def _judge_shared(self, report: RoundReport, train: list[Any], heldout: list[VerifiedSample],
                      before: EvalResult, result: RoundResult) -> bool:
        """Evaluate, gate and register the shared candidate; True when it measured worse than
        the serving version (then training restarts from the serving weights: a candidate the
        gate found worse is never trained on; an inconclusive one trains on next round)."""
        after = self.distiller.evaluate(heldout, gamma=self.config.gate_gamma)
        report.after = after.to_dict()
        trained = {e.sample.workload for e in train}
        v = gate(before, after, trained, self.config, {s.record_id: split_key(s) for s in heldout})
        report.evidence = v.evidence.to_dict() if v.evidence is not None else None
        meta = adapter_meta(self._promoted_version, before, after, result.samples, result.tokens, result.loss_last)
        report.version, report.decision = self._publish(meta, v.promote, v.reason, after)
        report.reason = v.reason
        if v.promote:
            self._promoted_version, self._promoted_state = report.version, self.distiller.adapter_state()
        elif v.worse:
            self.distiller.start_from(self._promoted_state)
            log.info("trainer_candidate_discarded", version=report.version, why="measured worse than the serving version")
        return v.worse

    def _publish(self, meta: AdapterMeta, promote: bool, reason: str, after: EvalResult) -> tuple[int, str]:
        """Register the distiller's adapter with ``meta``, then promote it in its scope (its
        evaluation ``after`` seeds the served-adapter cache) or mark it rejected, with ``reason``.
        Returns (version, "promoted" | "rejected")."""
        version = publish(self.registry, self.distiller, meta, promote, reason, self._work,
                          store_bytes=self.config.store_bytes)
        if promote:
            self._eval_cache[version] = dict(after.per_sample)  # the candidate's evaluation, reused
            return version, "promoted"
        return version, "rejected"

    def _count_turn(self, rep: ScopeReport) -> None:
        """Add a workload turn to ``status()["workload_turns"]`` (what a caller sizing a phase by
        training progress reads, e.g. the demo): a turn that trained counts in "turns"; one whose
        gate saw >= ``min_eval_requests`` held-out requests and >= ``min_eval_positions`` positions
        (enough evidence either way) in "judged"; a promotion in "promoted"."""
        if rep.decision == "skipped":
            return
        t = self._turns.setdefault(rep.scope, {"turns": 0, "judged": 0, "promoted": 0})
        t["turns"] += 1
        ev, cfg = rep.evidence, self.config
        if ev is not None and ev["clusters"] >= cfg.min_eval_requests and ev["positions"] >= cfg.min_eval_positions:
            t["judged"] += 1
        t["promoted"] += rep.decision == "promoted"

    def _workload_turn(self, workload: str, samples: list[VerifiedSample], newest_ms: int | None = None) -> ScopeReport:
        """Train, judge and register ``workload``'s own adapter on its new ``samples`` (see the
        module docstring); the shared adapter's training context is restored afterwards. With
        ``shared_turn`` off and ``newest_ms`` (its newest record's stream time) the turn yields
        (:meth:`_yield_check`): untrained, not judged, its records a waiting tail."""
        cfg = self.config
        rep = ScopeReport(scope=workload, trained_on=len(samples))
        try:
            check_scope(workload)
        except ValueError as e:
            rep.reason = f"no adapter of its own: {e}"
            return rep
        held = gate_slice(list(self._heldout.get(workload, ())), cfg)
        if len(held) < cfg.min_eval_samples:
            rep.reason = (f"{len(held)} held-out {workload} samples, fewer than min_eval_samples="
                          f"{cfg.min_eval_samples}: nothing to judge its own adapter on")
            return rep
        sc = self._scopes.setdefault(workload, _Scope())
        if sc.error is not None:
            rep.reason = sc.error
            return rep
        parent, served = self._served(workload)
        rep.parent = parent
        shared_ctx = self.distiller.training_context()
        try:
            if sc.context is not None and sc.context_from == parent:
                self.distiller.load_training_context(sc.context)  # a rejected candidate trains on
            else:
                self.distiller.start_from(served)  # what serves the workload changed: start from it
            before = self._evaluate_served(held, parent, served)
            self.distiller.should_stop = self._yield_check(workload, newest_ms)
            try:
                result = self.distiller.train_round(samples)
            finally:
                self.distiller.should_stop = None
            rep.steps = result.steps
            rep.alpha_before = before.alpha
            if self._yielded == workload:  # what it trained is dropped: the next turn starts where this one did
                rep.reason = (f"yielded after {result.steps} steps: its traffic stopped and {self._yielded_to}'s began "
                              f"meanwhile; not judged, its records wait for {self._yielded_to}'s turns")
                return rep
            if result.steps == 0 and self._cutting:  # cut before its first step: nothing to judge or register
                rep.reason = "the trainer stopped before this turn's first step (stop(cut_round=True)): not judged"
                return rep
            if not result.finite:
                rep.decision, rep.reason = "non_finite", f"rolled back, not registered: {result.reason}"
                return rep
            after = self.distiller.evaluate(held, gamma=cfg.gate_gamma)
            rep.alpha_after = after.alpha
            v = gate(before, after, {workload}, cfg, {s.record_id: split_key(s) for s in held})
            rep.evidence = v.evidence.to_dict() if v.evidence is not None else None
            meta = adapter_meta(parent, before, after, result.samples, result.tokens, result.loss_last, scope=workload)
            rep.version, rep.decision = self._publish(meta, v.promote, v.reason, after)
            rep.reason = v.reason
            if v.promote:
                sc.version, sc.state = rep.version, self.distiller.adapter_state()
            if v.worse:  # never trained on further: the next turn starts from what serves the workload
                sc.context, sc.context_from = None, -1
            else:
                sc.context, sc.context_from = self.distiller.training_context(), (rep.version if v.promote else parent)
        finally:
            self.distiller.load_training_context(shared_ctx)
        log.info("trainer_workload_round", workload=workload, decision=rep.decision, version=rep.version,
                 trained_on=rep.trained_on, reason=rep.reason)
        return rep
