"""Automatic rollback: after a promotion, the new adapter (or head) version's live acceptance is
compared with the previous version's on the same keys, and the version is rolled back in its
scope when it is worse by more than a margin (:class:`RollbackMonitor`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
import structlog

from decoder.shift import key_str
from decoder.tracking import DRAFT, HEAD, AcceptanceTracker, Window
from store import AcceptanceHistory, AdapterRegistry, InvalidTransitionError, StoreError, UnknownVersionError
from store.history import sum_rows

log = structlog.get_logger("decoder.rollback")

@dataclass(frozen=True)
class RollbackDecision:
    """The verdict on a promoted version against the one it replaced."""

    version: int
    previous: int
    key: str | None  # the worst (workload@bucket) compared; None when nothing was comparable
    new_value: float
    previous_value: float
    new_requests: int
    previous_requests: int
    rolled_back: bool
    reason: str
    ts: float
    kind: str = "adapter"  # what was judged: "adapter" (the draft's LoRA) or "head" (the feature-level head)


class RollbackMonitor:
    """Rolls back a promoted adapter (or head) whose live acceptance is worse than its predecessor's.

    ``proposer="eagle"`` judges the feature-level head's versions instead, with ``registry`` the
    head registry (kind ``"head"``): ``check`` then takes the head version that served a request
    the head proposed for, and the windows compared are the tracker's head windows (the requests
    the head proposed for, by head version); everything below holds with "adapter" read as
    "head" and "the draft model" as "the head".

    Call :meth:`check` periodically (or after each request) with the decoder's adapter version.
    The monitor notices each new version v serving after a version u; on every
    (workload, bucket) key where the draft model has proposed for >= ``min_requests`` requests
    under both v and u (the tracker's draft-only windows: an adapter changes only the draft, so
    requests the n-gram proposer served or decoded plain say nothing about it, and pooling them
    would compare the n-gram proposer's α under u with the draft's under v), it compares the
    metric; if v's is below u's by more than ``margin``
    on any key, it rolls v back in its own scope (``registry.rollback(reason, scope)``, only
    while v is still that scope's active version) and records the decision. Each key is judged
    once it has that evidence: a version kept on the keys judged so far stays under watch on the
    rest (the key an adapter harms is the one where the controller stops serving the draft, so
    its evidence arrives last, from probes).

    With per-workload adapters the decoder's version changes with each request's workload, so
    pass the request's ``workload`` too: the monitor then follows the versions serving each
    workload separately and judges v on that workload's keys only. Without it, one sequence of
    versions is followed over all keys.

    Only a promotion is judged: within one scope, v newer than u (versions only grow), or a
    workload's own adapter replacing the shared one. A rollback, which brings back an older
    version, is not judged against the version it replaced, and neither is the shared adapter
    when a workload falls back to it from an adapter of its own (its own one was specialised to
    beat it there; rolling the shared one back would hurt every workload).

    metric: ``"alpha"`` (pooled α = 1 - TV over proposed positions; informative even with few
        acceptances) or ``"acceptance_rate"`` (accepted / proposed tokens).
    merged: the store's history of the judged proposer's requests (``AcceptanceHistory(kind=
        "draft")`` for adapters, ``kind="head"`` for heads), which every serving replica's
        tracker flushes into. Given, a version is judged on every replica's requests (the
        history's buckets within its retention, plus this replica's not yet flushed), so N
        replicas reach ``min_requests`` N times sooner and all judge the same evidence; the
        first to decide rolls back, the others find the version no longer active. While Redis
        cannot be read, this replica's own windows are judged. None: this replica's only.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        tracker: AcceptanceTracker,
        *,
        min_requests: int = 20,
        margin: float = 0.1,
        metric: str = "alpha",
        clock: Callable[[], float] = time.time,
        proposer: str = DRAFT,
        merged: AcceptanceHistory | None = None,
    ):
        if metric not in ("alpha", "acceptance_rate"):
            raise ValueError(f"metric={metric!r}: use 'alpha' or 'acceptance_rate'")
        if proposer not in (DRAFT, HEAD):
            raise ValueError(f"proposer={proposer!r}: the monitor judges 'draft' (adapters) or 'eagle' (heads)")
        self.proposer = proposer
        self.kind = "head" if proposer == HEAD else "adapter"
        if getattr(registry, "kind", self.kind) != self.kind:
            raise ValueError(f"proposer={proposer!r} judges {self.kind}s, but the registry holds {registry.kind}s; "
                             f"pass AdapterRegistry(..., kind={self.kind!r})")
        self.registry, self.tracker, self.merged = registry, tracker, merged
        self.min_requests, self.margin, self.metric = min_requests, margin, metric
        self.merged_read_errors = 0  # reads of ``merged`` that failed (this replica's windows judged instead)
        self.clock = clock
        self.decisions: list[RollbackDecision] = []
        # per workload (None = all keys): [current version, previous version]
        self._seen: dict[str | None, list[int | None]] = {}
        self._judged: set[tuple[int, str | None]] = set()  # (version, workload) rolled back: judged for good
        self._judged_keys: dict[tuple[int, str | None], set[str]] = {}  # keys a kept version was judged on
        self._scopes: dict[int, str] = {0: ""}  # version -> its registry scope (never changes)

    def check(self, serving_version: int, workload: str | None = None) -> RollbackDecision | None:
        """Note the version serving now (for ``workload``'s requests, or for all when None);
        judge it if there is enough data. Returns the decision made now (None: nothing to judge
        yet). Redis errors are recorded, never raised."""
        seen = self._seen.setdefault(workload, [None, None])
        if serving_version != seen[0]:
            if seen[0] is not None:
                seen[1] = seen[0]
            seen[0] = serving_version
        v, u = seen
        if u is None or v == 0 or (v, workload) in self._judged:
            return None
        scope_v, scope_u = self._scope(v), self._scope(u)
        if scope_v is None or scope_u is None:
            return None  # unknown for now (Redis down)
        if scope_v == scope_u:
            if v < u:
                return None  # a rollback brought an older version back
        elif not (scope_u == "" and scope_v != ""):
            return None  # a fallback to the shared adapter (or two workloads' versions interleaved)
        worst, judged = None, []
        done = self._judged_keys.setdefault((v, workload), set())
        for key, (n_new, x_new), (n_old, x_old) in self._evidence(v, u, workload):
            if key in done or n_new < self.min_requests or n_old < self.min_requests:
                continue
            if x_new != x_new or x_old != x_old:
                continue
            judged.append(key)
            if worst is None or x_new - x_old < worst[1] - worst[2]:
                worst = (key, x_new, x_old, n_new, n_old)
        if worst is None:
            return None
        key, x_new, x_old, n_new, n_old = worst
        bad = x_new < x_old - self.margin
        if bad:
            self._judged.add((v, workload))
        else:  # kept on these keys; the keys still short of evidence are judged as they reach it
            done.update(judged)
        if bad:
            what = "head " if self.kind == "head" else ""
            reason = (f"auto-rollback: {what}v{v} {self.metric}={x_new:.3f} on {key} over {n_new} requests vs "
                      f"v{u} {x_old:.3f} over {n_old} (margin {self.margin})")
            rolled = self._rollback(v, reason, workload)
            if not rolled[0]:
                reason += f"; not rolled back: {rolled[1]}"
        else:
            what = "head " if self.kind == "head" else ""
            reason = (f"kept: {what}v{v} {self.metric}={x_new:.3f} on {key} vs v{u} {x_old:.3f} "
                      f"(worst key; margin {self.margin})")
            rolled = (False, "")
        d = RollbackDecision(v, u, key, x_new, x_old, n_new, n_old, rolled[0], reason, self.clock(), self.kind)
        self.decisions.append(d)
        event = f"{self.kind}_judged"
        log.warning(event, version=v, previous=u, rolled_back=rolled[0], reason=reason) if bad else \
            log.info(event, version=v, previous=u, rolled_back=False, reason=reason)
        return d

    def _evidence(self, v: int, u: int, workload: str | None):
        """(key, (requests, metric) under ``v``, (requests, metric) under ``u``) for every key
        "workload@bucket" of ``workload`` (None: all) where ``v`` served the judged proposer: from
        the merged history plus this replica's unflushed windows when ``merged`` is set and
        readable, else from this replica's tracker."""
        local = [(w, b) for w, b, ver in self.tracker.keys(self.proposer)
                 if ver == v and (workload is None or w == workload)]
        if self.merged is not None:
            try:
                rows = {ver: self.merged.read(version=ver) for ver in (v, u)}
            except (StoreError, redis.RedisError, OSError) as e:
                self.merged_read_errors += 1
                log.warning("rollback_merged_history_unreadable", kind=self.kind, error=str(e))
            else:
                pending = self.tracker.unflushed(self.proposer)
                names = {key_str(w, b) for w, b in local} | {
                    r.workload for r in rows[v] if workload is None or r.workload.split("@", 1)[0] == workload}
                out = []
                for name in sorted(names):
                    w, _, b = name.partition("@")
                    sides = []
                    for ver in (v, u):
                        mine = pending.get((w, b, ver), Window()).counts
                        theirs = sum_rows([r for r in rows[ver] if r.workload == name])
                        n = theirs.requests + mine.num_requests
                        drafted = theirs.num_draft_tokens + mine.num_draft_tokens
                        top = (theirs.overlap_sum + mine.alpha_sum if self.metric == "alpha"
                               else theirs.num_accepted_tokens + mine.num_accepted_tokens)
                        sides.append((n, top / drafted if drafted else float("nan")))
                    out.append((name, *sides))
                return out
        out = []
        for w, b in local:
            new, old = (self.tracker.window(w, b, v, proposer=self.proposer),
                        self.tracker.window(w, b, u, proposer=self.proposer))
            out.append((key_str(w, b), (new.counts.num_requests, getattr(new.counts, self.metric)),
                        (old.counts.num_requests, getattr(old.counts, self.metric))))
        return out

    def _scope(self, version: int) -> str | None:
        """``version``'s scope ("" = shared; None while the registry cannot say)."""
        if version not in self._scopes:
            try:
                self._scopes[version] = self.registry.get(version).scope
            except UnknownVersionError:
                self._scopes[version] = ""  # not registered here (e.g. loaded by hand): treat as shared
            except (StoreError, redis.RedisError, OSError):
                return None
        return self._scopes[version]

    def _rollback(self, version: int, reason: str, workload: str | None) -> tuple[bool, str]:
        try:
            scope = self._scopes.get(version, "")
            active = self.registry.active_version(scope)
            if active != version:
                where = f"scope {scope!r}" if scope else "the shared scope"
                return False, f"the registry's active version in {where} is now v{active}"
            self.registry.rollback(reason, scope=scope)
            return True, ""
        except InvalidTransitionError as e:
            return False, str(e)
        except (StoreError, redis.RedisError, OSError) as e:
            self._judged.discard((version, workload))  # Redis down: judge again at the next check
            return False, f"registry unreachable: {e}"
